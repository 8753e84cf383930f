"""Token-wise decoding: the rounds of greedy SD, WISV and fly with one-token passes of both models.

Why it is the same thing. In a round of the greedy family (greedy SD, WISV, fly; one vocabulary, no
sampling), the drafter proposes ``d[0..K-1]`` greedily and the target's pass over the block gives its
argmax ``a[i]`` after ``prefix + d[:i]``. Every draft token the round keeps was proposed after the
kept tokens before it, so while a round runs, both models only ever look at *committed* tokens: the
drafter's ``d[i]`` is its greedy token after ``prefix + committed``, and so is the target's ``a[i]``.
The draft tokens after the round's cut (a rejected mismatch) are thrown away and change nothing. So
feeding each committed token once to both models, and applying the acceptance rule one position at a
time, commits the same tokens in the same rounds as the round protocol (``sd.rounds``), and writes
the same ``RoundRecord`` s, at the cost of one drafter and one target step per committed token:

* a position where ``d[i] == a[i]`` is accepted;
* at a mismatch, greedy rejects; WISV asks the judge (``judge(h_D, [0], h_T)`` with the two
  hidden states of that position, the channel of the moment inside the judge) and accepts when the
  rejection probability is below tau; fly accepts when the target's top-k entropy there is at least
  ``fly_entropy`` and the next ``fly_window`` draft tokens, all inside the block, equal the target's
  argmax (looked at by stepping both models ahead and rolling them back when the window fails);
* a rejected mismatch commits ``a[i]`` (the correction) and ends the round; after K kept tokens the
  round commits the bonus ``a[K]``.

What it cannot know, and how the records say it: draft tokens after the cut are never computed, so a
round records the mismatches up to and including its cut (the live log also lists mismatches after
it, which only the sh protocol's second upload prices) and ``drafted = K`` (the drafter drafts K
unless it proposes an end-of-sequence token, which it can only do at a kept position or the cut).
Draft and target times are 0 (latency comes from a hardware profile, ``eval.latency``); the head's
time is measured. Numerically a block
pass and one-token passes round differently (llama.cpp: logits differ by up to ~0.5 at a few
positions), so at a near-tie the live protocol and this decoder can take different tokens; with
``tau = 0`` this decoder is exactly the target alone, token for token, on the same engine.

With tau 0 the result also carries the replay ``Trace`` (the drafter's greedy token after every
prefix of the target's own text), from which ``eval.replay`` derives greedy SD at every K.

No rclpy here: part of the evaluation core.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np
import torch

from wisv_ros.eval.replay import Trace
from wisv_ros.sd.acceptance import FLY_ENTROPY, FLY_TOP_K, FLY_WINDOW, topk_entropy
from wisv_ros.sd.lm import CausalLM
from wisv_ros.sd.roundlog import RoundRecord, round_bytes

__all__ = ["TOKENWISE_METHODS", "TokenwiseResult", "decode_tokenwise"]

TOKENWISE_METHODS = ("greedy", "wisv", "fly")


@dataclasses.dataclass
class TokenwiseResult:
    token_ids: list[int]  # committed answer tokens (clipped at max_new_tokens and after an end-of-sequence id)
    records: list[RoundRecord]
    trace: Trace | None  # greedy (tau 0): the replay trace of the target's own text; else None


class _Pair:
    """Both models fed the same committed tokens; the greedy token, its probability and the hidden
    state of each at the last fed position."""

    def __init__(self, drafter: CausalLM, target: CausalLM, prompt_ids: Sequence[int]):
        self.drafter, self.target = drafter, target
        drafter.reset()
        target.reset()
        self.n = len(prompt_ids)
        self._take(drafter.feed(list(prompt_ids), n_logits=1), target.feed(list(prompt_ids), n_logits=1))

    def _take(self, sd, st) -> None:
        self.d_logits, self.h_d = sd.logits[-1].float(), sd.hidden[-1]
        self.t_logits, self.h_t = st.logits[-1].float(), st.hidden[-1]
        self.d = int(self.d_logits.argmax())
        self.a = int(self.t_logits.argmax())

    def draft_prob(self) -> float:
        return float(torch.softmax(self.d_logits, dim=-1)[self.d])

    def feed(self, tok: int) -> None:
        self._take(self.drafter.feed([tok], n_logits=1), self.target.feed([tok], n_logits=1))
        self.n += 1

    def rollback(self, n_keep: int) -> None:
        """Back to ``n_keep`` fed tokens; the caller feeds the next one (which sets the state)."""
        self.drafter.rollback(n_keep)
        self.target.rollback(n_keep)
        self.n = n_keep


def decode_tokenwise(drafter: CausalLM, target: CausalLM, prompt_ids: Sequence[int], *, k: int, max_new_tokens: int,
                     method: str = "greedy", judge: Callable | None = None, tau: float = 0.0,
                     fly_entropy: float = FLY_ENTROPY, fly_window: int = FLY_WINDOW, stop_text: Callable[[str], bool] | None = None,
                     request_id: str = "tokenwise", dataset: str = "", on_round: Callable[[RoundRecord], None] | None = None,
                     ) -> TokenwiseResult:
    """Decode one prompt (``prompt_ids``, both models' vocabulary) by the rounds of ``method`` at block
    size ``k``; see the module docstring. ``judge``/``tau``: WISV (tau 0 or no judge = greedy);
    ``fly_entropy``/``fly_window``: fly. ``stop_text`` ends the answer after the round whose text makes
    it true (decoded with the target's tokenizer), as ``sd.rounds.generate`` does; with tau 0 after the
    token that makes it true, as the target alone does (``generate_target_only``), so that the trace is
    the target alone's answer. ``on_round`` gets every record as it is made."""
    if method not in TOKENWISE_METHODS:
        raise ValueError(f"method '{method}' is not one of {', '.join(TOKENWISE_METHODS)}")
    if k < 1 or max_new_tokens < 1:
        raise ValueError(f"k and max_new_tokens must be >= 1 (got {k}, {max_new_tokens})")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(f"token-wise decoding needs one vocabulary: drafter {drafter.vocab_size}, target {target.vocab_size}")
    if method == "fly" and (fly_window < 1 or not fly_entropy >= 0):
        raise ValueError(f"fly_window must be >= 1 and fly_entropy >= 0 (got {fly_window}, {fly_entropy})")
    judged = method == "wisv" and judge is not None and tau > 0
    greedy_only = method == "greedy" or (method == "wisv" and not judged)
    eos = target.eos_ids()
    tok_dec = target.tokenizer
    m = _Pair(drafter, target, prompt_ids)
    n_prompt = len(prompt_ids)
    out: list[int] = []
    draft_ids: list[int] = []  # greedy: the drafter's token after every prefix of out
    draft_prob: list[float] = []
    records: list[RoundRecord] = []
    pending = n_prompt  # tokens the next target pass feeds before its block
    hidden_dim = drafter.hidden_size if method == "wisv" else 0
    done = False
    round_id = 0

    def keep(tok: int) -> bool:
        """Commit ``tok``; False once the answer is over (budget, end of sequence, or with tau 0 the
        stop text: the target alone stops after the token that states the answer)."""
        out.append(tok)
        if greedy_only and stop_text is not None and tok_dec is not None and stop_text(tok_dec.decode(out, skip_special_tokens=True)):
            return False
        return len(out) < max_new_tokens and tok not in eos

    while not done:
        prefix_length = n_prompt + len(out)
        start = len(out)
        accepted, mismatches, head_accepted = 0, [], []
        head_s = 0.0
        drafted = k
        j = 0
        while True:  # one round
            if greedy_only:
                draft_ids.append(m.d)
                draft_prob.append(m.draft_prob())
            if j == k:  # every draft kept: the bonus token
                done = not keep(m.a)
                break
            if m.d == m.a:
                accept = True
            else:
                mismatches.append(j)
                accept = False
                if judged:
                    t0 = time.perf_counter()
                    p = judge(m.h_d.numpy()[None, :], [0], m.h_t[None, :])
                    accept = float(np.asarray(p).reshape(-1)[0]) < tau
                    head_s += time.perf_counter() - t0
                elif method == "fly":
                    accept = _fly_window(m, j, k, fly_entropy, fly_window)
                if accept:
                    head_accepted.append(j)
            if not accept:  # the correction ends the round
                if m.d in eos:
                    drafted = j + 1  # the drafter stopped drafting at its end-of-sequence token
                done = not keep(m.a)
                break
            tok = m.d
            accepted += 1
            if not keep(tok):
                done = True
                if tok in eos:
                    drafted = j + 1
                break
            m.feed(tok)
            j += 1
        new = out[start:]
        rec = RoundRecord(request_id=request_id, round_id=round_id, kind="block", method=method, k=k,
                          protocol="fh" if method == "wisv" else "ids", tau=float(tau) if method == "wisv" else 0.0,
                          prefix_length=prefix_length, drafted=drafted, accepted=accepted, mismatches=mismatches,
                          head_accepted=head_accepted if method != "greedy" else [], committed=len(new),
                          target_tokens=pending + drafted, hidden_dim=hidden_dim, head_time_s=head_s)
        for key, val in round_bytes(rec, hidden_dim, target.vocab_size).items():
            setattr(rec, key, val)
        records.append(rec)
        if on_round is not None:
            on_round(rec)
        pending = 1
        round_id += 1
        if not done and stop_text is not None and tok_dec is not None:
            done = stop_text(tok_dec.decode(out, skip_special_tokens=True))
        if not done:
            m.feed(out[-1])  # the correction or bonus, into both models
    trace = None
    if greedy_only:
        # One entry per prefix of out (the replay's teacher-forced drafter tokens): the rounds took one
        # at every prefix but the whole answer, whose drafter token one more drafter step gives.
        logits = drafter.feed([out[-1]], n_logits=1).logits[-1].float()
        draft_ids.append(int(logits.argmax()))
        draft_prob.append(float(torch.softmax(logits, dim=-1).max()))
        trace = Trace(id=request_id, dataset=dataset, prompt_ids=list(prompt_ids), target_ids=list(out),
                      draft_ids=draft_ids[: len(out) + 1], draft_prob=draft_prob[: len(out) + 1], eos_ids=sorted(eos),
                      text=tok_dec.decode(out, skip_special_tokens=True) if tok_dec is not None else "")
    return TokenwiseResult(out, records, trace)


def _fly_window(m: _Pair, j: int, k: int, entropy_min: float, window: int) -> bool:
    """fly at a mismatch at block position ``j`` (``acceptance.fly_accept``): the target's top-k
    entropy there is at least ``entropy_min`` and the next ``window`` draft tokens, inside the block,
    equal the target's argmax. The look-ahead steps both models over the draft token and the window;
    the state is restored to the mismatch afterwards, so the caller feeds the kept tokens as usual."""
    if j + window >= k or float(topk_entropy(m.t_logits, FLY_TOP_K)) < entropy_min:
        return False
    n0 = m.n
    saved = (m.d_logits, m.h_d, m.t_logits, m.h_t, m.d, m.a)
    ok = True
    m.feed(m.d)
    for _ in range(window):
        if m.d != m.a:
            ok = False
            break
        m.feed(m.d)
    m.rollback(n0)
    m.d_logits, m.h_d, m.t_logits, m.h_t, m.d, m.a = saved
    return ok
