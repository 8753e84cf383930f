"""Speculative decoding split the way the system is deployed: a Drafter (robot) and a Verifier (edge).

One round (WISV Algorithm 1 / SPEC "One round"):

1. ``Drafter.draft(k)`` proposes a ``DraftBlock`` of K tokens after the committed prefix, in the
   *target* vocabulary, with the drafter hidden state that proposed each token.
2. ``Verifier.verify(block)`` runs the target once over (pending committed tokens + draft), applies
   the acceptance rule and returns a ``Verdict``: accepted count, correction/bonus token, committed
   ids. The target's cache is rolled back to the committed prefix.
3. ``Drafter.commit(verdict.committed_ids)`` appends the committed ids; the drafter's cache is
   rolled back to what it shares with the new prefix and catches up lazily on its next forward pass.

Pairs with one tokenizer draft directly in the shared vocabulary. Pairs with different tokenizers
are aligned through text, as universal assisted generation does: the drafter continues its own
tokenisation of the committed text, its new text is re-tokenised with the target tokenizer, and each
target draft token gets the hidden state of the drafter token that covers its first character.

``generate()`` runs rounds in one process; the ROS nodes run the same two halves on two machines.
No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Callable, Sequence

import numpy as np
import torch

from .acceptance import greedy_accept, judged_accept, mismatch_positions, rejection_accept, softmax_t
from .copying import copy_candidates, verify_tree
from .lm import CausalLM
from .metrics import DecodeStats

__all__ = [
    "CopyConfig",
    "DraftBlock",
    "Drafter",
    "Generation",
    "Method",
    "Verdict",
    "Verifier",
    "clip",
    "encode_prompt",
    "generate",
    "generate_target_only",
    "same_vocabulary",
]


class Method(str, enum.Enum):
    """Decoding methods; the value is the name used by parameters, CLIs, messages and CSV files."""

    TARGET_ONLY = "target_only"  # autoregressive decoding with the target alone
    GREEDY = "greedy"  # greedy speculative decoding (lossless)
    REJECT = "reject"  # rejection-sampling speculative decoding (same vocabulary only)
    WISV = "wisv"  # channel-aware semantic verification (decision head at mismatches)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: str) -> "Method":
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"method '{name}' is not one of: {', '.join(m.value for m in cls)}") from None


@dataclasses.dataclass
class DraftBlock:
    """What the robot uploads each round.

    token_ids: K draft ids in the target vocabulary.
    hidden:    [K, d_drafter] float32, the drafter hidden state that proposed each draft token
               (aligned by character span for cross-tokenizer pairs).
    probs:     [K, V] the drafter's sampling distribution (rejection sampling only).
    prefix_length: committed target tokens before the block (prompt included).
    """

    token_ids: list[int]
    hidden: np.ndarray | None
    probs: torch.Tensor | None
    prefix_length: int
    drafter_time_s: float = 0.0


@dataclasses.dataclass
class CopyConfig:
    """SwitchSD copy mode on the edge: draft from the context, no round trip to the robot.

    gate:  the copy probe, (hidden row of ``layer`` at the last committed position) -> fires;
           None = the probe-less n-gram baseline (copy whenever the kappa-gram suffix matched).
    layer: (layer, kind) the target captures for the gate (the verifier's CausalLM must capture it).
    kappa, width, depth: suffix length to match, candidates per round (W), tokens per candidate (D).
    """

    gate: Callable[[np.ndarray], bool] | None = None
    layer: tuple[int, str] | None = None
    kappa: int = 5
    width: int = 4
    depth: int = 16

    @classmethod
    def for_mode(cls, mode: str, probe=None, *, kappa: int = 5, width: int = 4, depth: int = 16,
                 gate: Callable[[np.ndarray], bool] | None = None) -> "CopyConfig | None":
        """Copy mode by name: "off" -> None; "ngram" (no gate); "probe": gated by ``probe``
        (a ``probe.CopyProbe``) at its layer, ``gate`` replacing ``probe.fires`` (e.g. to count calls)."""
        if mode == "off":
            return None
        if mode == "ngram":
            return cls(gate=None, kappa=kappa, width=width, depth=depth)
        if mode != "probe":
            raise ValueError(f"copy mode '{mode}' is not one of off, ngram, probe")
        if probe is None:
            raise ValueError("copy mode probe needs a probe")
        return cls(gate=gate if gate is not None else probe.fires, layer=(probe.layer, probe.kind), kappa=kappa, width=width, depth=depth)


@dataclasses.dataclass
class Verdict:
    """What the edge sends down each round."""

    accepted_count: int  # draft tokens accepted
    correction_id: int  # correction (accepted_count < K) or bonus token
    committed_ids: list[int]  # draft[:accepted_count] + [correction_id]
    mismatches: list[int]  # draft positions where the target's argmax differs (set S)
    target_time_s: float = 0.0
    head_time_s: float = 0.0
    target_hidden: torch.Tensor | None = None  # [K+1, d_target] at the verified positions
    copy_mode: bool = False  # the round copied from the context (no drafter block)


def same_vocabulary(drafter_tok, target_tok) -> bool:
    """True when the two tokenizers map text to the same ids (drafting needs no text alignment)."""
    if drafter_tok is None or target_tok is None:
        return drafter_tok is None and target_tok is None
    return drafter_tok.get_vocab() == target_tok.get_vocab()


def encode_prompt(tokenizer, prompt: str | list[dict] | Sequence[int], chat: bool = True) -> list[int]:
    """Token ids of a prompt for one model.

    prompt: text, chat messages (``[{"role": "user", "content": ...}]``), or ids (used as they are).
    chat:   with text, wrap it as one user message and apply the model's chat template if it has one.
    Each side of a cross-tokenizer pair encodes the prompt with its own tokenizer and template.
    """
    if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], (int, np.integer))):
        return [int(i) for i in prompt]
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; tiny random models take a list of ids")
    if isinstance(prompt, str) and not (chat and tokenizer.chat_template):
        ids = tokenizer(prompt, add_special_tokens=True).input_ids
        return [int(i) for i in ids]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if not tokenizer.chat_template:
        text = "\n".join(m["content"] for m in messages)
        return [int(i) for i in tokenizer(text, add_special_tokens=True).input_ids]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(i) for i in out]


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """Greedy (temperature 0) or sampled next token; returns (id, sampling distribution or None)."""
    if temperature <= 0:
        return int(logits.argmax()), None
    probs = softmax_t(logits, temperature)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


def _decode_tail(tok, context: Sequence[int], new: Sequence[int]) -> tuple[str, list[int]]:
    """Text of ``new`` ids continuing ``context`` and the end offset (in chars) of each new token.

    Decoding a few context tokens along with the new ones keeps leading spaces and multi-byte
    characters right. A trailing incomplete character (U+FFFD) is dropped.
    """
    window = list(context[-4:])
    head = tok.decode(window, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    ends = []
    text = ""
    for j in range(1, len(new) + 1):
        full = tok.decode(window + list(new[:j]), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        text = full[len(head):] if full.startswith(head) else tok.decode(list(new[:j]), skip_special_tokens=False)
        ends.append(len(text))
    stripped = text.rstrip("\ufffd")
    return stripped, [min(e, len(stripped)) for e in ends]


class Drafter:
    """The robot half: the drafter model, its cache and the committed prefix.

    Args:
        lm: the drafter.
        target_tokenizer: the target's tokenizer, for cross-tokenizer pairs (None when both models
            share one vocabulary).
        temperature: 0 drafts greedily; > 0 samples (rejection sampling needs the distributions).
        seed: seeds the drafter's sampling.
        min_confidence: end the block early after a token whose drafter probability is below this
            (0 = always draft K). Unsure tokens are rarely accepted, and each costs a drafter step.
    """

    def __init__(self, lm: CausalLM, target_tokenizer=None, temperature: float = 0.0, seed: int = 0,
                 min_confidence: float = 0.0):
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.lm = lm
        self.min_confidence = min_confidence
        self.target_tokenizer = target_tokenizer
        self.cross = target_tokenizer is not None and not same_vocabulary(lm.tokenizer, target_tokenizer)
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt_ids: list[int] = []  # drafter's own encoding of the prompt
        self.committed: list[int] = []  # target ids committed after the prompt
        self.target_prefix_length = 0  # committed target tokens, prompt included
        self._eos = lm.eos_ids()
        self._target_eos = None
        if self.cross:
            self._target_eos = target_tokenizer.eos_token_id

    def begin(self, prompt_ids: Sequence[int], target_prompt_length: int) -> None:
        """Start a request: ``prompt_ids`` in the drafter's vocabulary; the target's prompt length."""
        self.prompt_ids = list(prompt_ids)
        self.committed = []
        self.target_prefix_length = target_prompt_length

    def context_ids(self) -> list[int]:
        """The drafter-vocabulary ids of prompt + committed text."""
        if not self.cross:
            return self.prompt_ids + self.committed
        text = self.target_tokenizer.decode(self.committed, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        ids = self.lm.tokenizer(text, add_special_tokens=False).input_ids if text else []
        return self.prompt_ids + [int(i) for i in ids]

    def commit(self, committed_ids: Sequence[int]) -> None:
        """Append the tokens the edge committed this round (draft prefix + correction/bonus)."""
        self.committed.extend(int(i) for i in committed_ids)
        self.target_prefix_length += len(committed_ids)

    def draft(self, k: int) -> DraftBlock:
        """Propose K tokens (fewer if the drafter ends the answer) after the committed prefix."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        t0 = time.perf_counter()
        context = self.context_ids()
        todo = self.lm.sync(context)
        ids: list[int] = []
        hiddens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        # Cross-tokenizer: a couple of extra drafter tokens, since the two tokenisations of the same
        # text rarely have the same length.
        budget = k if not self.cross else k + 2
        target_ids: list[int] = []
        while len(ids) < budget:
            step = self.lm.feed(todo, n_logits=1)
            tok, p = _pick(step.logits[-1], self.temperature, self.generator)
            ids.append(tok)
            hiddens.append(step.hidden[-1])
            if p is not None:
                probs.append(p)
            todo = [tok]
            if tok in self._eos:
                break
            if self.min_confidence > 0:
                conf = float((p if p is not None else torch.softmax(step.logits[-1], -1))[tok])
                if conf < self.min_confidence:
                    break
            if self.cross:
                # Enough drafter text when it re-tokenises into more than K target tokens: the first
                # K of them are then complete.
                text, _ = _decode_tail(self.lm.tokenizer, context, ids)
                if len(self.target_tokenizer(text, add_special_tokens=False).input_ids) > k:
                    break
        if not self.cross:
            block_ids, hidden = ids, torch.stack(hiddens)
        else:
            block_ids, hidden = self._to_target(context, ids, hiddens, k)
        return DraftBlock(
            token_ids=block_ids,
            hidden=hidden.numpy().astype(np.float32, copy=False) if len(block_ids) else np.zeros((0, self.lm.hidden_size), np.float32),
            probs=torch.stack(probs) if probs else None,
            prefix_length=self.target_prefix_length,
            drafter_time_s=time.perf_counter() - t0,
        )

    def _to_target(self, context, ids, hiddens, k) -> tuple[list[int], torch.Tensor]:
        """Re-tokenise drafter ids into target ids; align hidden states by character span."""
        ended = ids[-1] in self._eos
        body = ids[:-1] if ended else ids
        text, ends = _decode_tail(self.lm.tokenizer, context, body)
        enc = self.target_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True) if text else None
        t_ids = [int(i) for i in enc.input_ids] if enc is not None else []
        starts = [s for s, _ in enc.offset_mapping] if enc is not None else []
        out_ids, out_h = [], []
        for tid, start in zip(t_ids, starts):
            if len(out_ids) == k:
                break
            j = next((j for j, e in enumerate(ends) if e > start), len(ends) - 1)
            out_ids.append(tid)
            out_h.append(hiddens[max(j, 0)])
        if ended and len(out_ids) < k and self._target_eos is not None:
            out_ids.append(int(self._target_eos))
            out_h.append(hiddens[-1])
        if not out_ids:
            return [], torch.zeros((0, self.lm.hidden_size))
        return out_ids, torch.stack(out_h)


_VERIFIER_SEED_OFFSET = 0x5EED_0000


class Verifier:
    """The edge half: the target model, its cache and the acceptance rule.

    Args:
        lm: the target.
        method: GREEDY, REJECT or WISV (TARGET_ONLY has no verifier).
        temperature: sampling temperature of REJECT (> 0).
        tau: WISV threshold (rejection probability >= tau rejects); 0 = greedy, > 1 accepts all.
        judge: WISV decision head: (block, positions S, target hidden [K+1, d]) -> [|S|] rejection
            probabilities. Called only at mismatch positions.
        copy: SwitchSD copy mode (``copy_round``); its rounds accept greedily under GREEDY and
            WISV, and by speculative sampling under REJECT (exact, see ``copying``).
        seed: seeds REJECT sampling. The verifier's stream is derived from the seed so that it
            never equals the drafter's stream for the same seed (equal streams would correlate the
            acceptance test with the draft and bias the output distribution).
    """

    def __init__(
        self,
        lm: CausalLM,
        method: Method = Method.GREEDY,
        temperature: float = 1.0,
        tau: float = 0.0,
        judge: Callable[[DraftBlock, list[int], torch.Tensor], torch.Tensor] | None = None,
        seed: int = 0,
        copy: CopyConfig | None = None,
    ):
        if method == Method.TARGET_ONLY:
            raise ValueError("method target_only has no verifier; use generate_target_only()")
        if method == Method.REJECT and temperature <= 0:
            raise ValueError(f"method reject samples: temperature must be > 0, got {temperature}")
        if copy is not None and copy.gate is not None and (copy.layer is None or copy.layer not in lm.capture):
            raise ValueError(f"copy gate needs the target to capture layer {copy.layer}; build CausalLM(capture=[...])")
        self.lm = lm
        self.copy = copy
        self._probe_row: np.ndarray | None = None  # copy-gate layer at the last committed position
        self.method = Method(method)
        self.temperature = temperature
        self.tau = tau
        self.judge = judge
        self.generator = torch.Generator().manual_seed(seed + _VERIFIER_SEED_OFFSET)
        self.context: list[int] = []  # prompt + committed, target vocabulary

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.context = list(prompt_ids)
        self._probe_row = None  # the copy gate's state belongs to the previous request

    def verify(self, block: DraftBlock) -> Verdict:
        """Verify one block in one target forward pass and roll the cache back to the committed prefix."""
        if block.prefix_length != len(self.context):
            raise ValueError(
                f"draft block prefix_length {block.prefix_length} does not match the committed length "
                f"{len(self.context)} on the verifier"
            )
        draft = list(block.token_ids)
        k = len(draft)
        t0 = time.perf_counter()
        todo = self.lm.sync(self.context)
        step = self.lm.feed(todo + draft, n_logits=k + 1)
        logits = step.logits  # [K+1, V]: row i predicts draft[i]; row K the bonus
        target_hidden = step.hidden[-(k + 1):]
        t1 = time.perf_counter()
        if self.method == Method.REJECT:
            if block.probs is None:
                raise ValueError("method reject needs the drafter's distributions (block.probs); draft with temperature > 0")
            decision = rejection_accept(draft, block.probs, logits, self.temperature, self.generator)
        elif self.method == Method.WISV and self.judge is not None and self.tau > 0:
            decision = judged_accept(draft, logits, lambda s: self.judge(block, s, target_hidden), self.tau)
        else:
            decision = greedy_accept(draft, logits)
        t2 = time.perf_counter()
        if self.copy is not None and self.copy.layer is not None:
            self._probe_row = step.layers[self.copy.layer][len(todo) - 1 + decision.n_accepted].numpy()
        committed = draft[: decision.n_accepted] + [decision.next_id]
        self.lm.rollback(len(self.context) + decision.n_accepted)
        self.context.extend(committed)
        return Verdict(
            accepted_count=decision.n_accepted,
            correction_id=decision.next_id,
            committed_ids=committed,
            mismatches=mismatch_positions(draft, logits),
            target_time_s=t1 - t0,
            head_time_s=t2 - t1,
            target_hidden=target_hidden,
        )


    def copy_round(self) -> Verdict | None:
        """A copy round if copy mode holds: the probe fires (or no probe: n-gram baseline) and the
        context's last kappa tokens occurred before. None: the robot's drafter drafts this round."""
        cfg = self.copy
        if cfg is None:
            return None
        candidates = copy_candidates(self.context, cfg.kappa, cfg.width, cfg.depth)
        if not candidates:
            return None
        if cfg.gate is not None and (self._probe_row is None or not cfg.gate(self._probe_row)):
            return None
        t0 = time.perf_counter()
        sampling = self.method == Method.REJECT
        res = verify_tree(self.lm, self.context, candidates, temperature=self.temperature if sampling else 0.0,
                          generator=self.generator)
        if cfg.layer is not None:
            self._probe_row = res.layers[cfg.layer].numpy()
        committed = res.accepted + [res.next_id]
        self.context.extend(committed)
        return Verdict(accepted_count=len(res.accepted), correction_id=res.next_id, committed_ids=committed,
                       mismatches=[], target_time_s=time.perf_counter() - t0, copy_mode=True)


@dataclasses.dataclass
class Generation:
    """Result of one request."""

    token_ids: list[int]  # generated target ids (prompt excluded)
    text: str
    stats: DecodeStats


def clip(new_ids: list[int], have: int, max_new: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut committed ids at the token budget and after the first end-of-sequence token; (kept, done)."""
    out = []
    for tok in new_ids:
        if have + len(out) >= max_new:
            return out, True
        out.append(tok)
        if tok in eos:
            return out, True
    return out, have + len(out) >= max_new


def _decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True) if tok is not None else " ".join(map(str, ids))


def generate(
    drafter: Drafter,
    verifier: Verifier,
    prompt: str | list[dict] | Sequence[int],
    max_new_tokens: int,
    k: int,
    on_commit: Callable[[list[int]], None] | None = None,
    stats: DecodeStats | None = None,
    chat: bool = True,
    on_round: Callable[[DraftBlock, Verdict, int], None] | None = None,
    stop_text: Callable[[str], bool] | None = None,
) -> Generation:
    """Speculative decoding in one process: rounds of draft K -> verify -> commit until done.

    chat: apply each model's chat template to a text prompt (False: plain completion, e.g. code).
    on_commit: called with the ids committed by each round (streaming).
    on_round: called with (block, verdict, tokens generated before the round) after each round
        (trace collection).
    stop_text: ends generation after the round whose text makes it true (e.g. a final answer).
    """
    target_prompt = encode_prompt(verifier.lm.tokenizer, prompt, chat)
    drafter_prompt = encode_prompt(drafter.lm.tokenizer, prompt, chat) if drafter.cross else target_prompt
    if stats is None:
        stats = DecodeStats(method=str(verifier.method), k=k, hidden_dim=drafter.lm.hidden_size, vocab_size=verifier.lm.vocab_size)
    eos = verifier.lm.eos_ids()
    drafter.begin(drafter_prompt, len(target_prompt))
    verifier.begin(target_prompt)
    out: list[int] = []
    t_start = time.perf_counter()
    done = max_new_tokens <= 0
    while not done:
        verdict = verifier.copy_round()
        if verdict is not None:  # copied on the edge: the drafter catches up on its next pass
            drafter.commit(verdict.committed_ids)
            new, done = clip(verdict.committed_ids, len(out), max_new_tokens, eos)
            out.extend(new)
            stats.observe_copy_round(accepted=verdict.accepted_count, committed=len(new), target_s=verdict.target_time_s)
        else:
            block = drafter.draft(k)
            verdict = verifier.verify(block)
            drafter.commit(verdict.committed_ids)
            if on_round is not None:
                on_round(block, verdict, len(out))
            new, done = clip(verdict.committed_ids, len(out), max_new_tokens, eos)
            out.extend(new)
            stats.observe_round(
                drafted=len(block.token_ids),
                accepted=verdict.accepted_count,
                committed=len(new),
                mismatches=len(verdict.mismatches),
                draft_s=block.drafter_time_s,
                target_s=verdict.target_time_s,
                head_s=verdict.head_time_s,
            )
        if on_commit is not None and new:
            on_commit(new)
        if stop_text is not None and not done:
            done = stop_text(_decode(verifier.lm.tokenizer, out))
    stats.wall_s = time.perf_counter() - t_start
    return Generation(out, _decode(verifier.lm.tokenizer, out), stats)


def generate_target_only(
    lm: CausalLM,
    prompt: str | list[dict] | Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    on_commit: Callable[[list[int]], None] | None = None,
    stats: DecodeStats | None = None,
    chat: bool = True,
    stop_text: Callable[[str], bool] | None = None,
) -> Generation:
    """Autoregressive decoding with the target alone (the baseline; one token per forward pass).

    stop_text: ends generation after the token whose text makes it true, as in ``generate``.
    """
    prompt_ids = encode_prompt(lm.tokenizer, prompt, chat)
    if stats is None:
        stats = DecodeStats(method=str(Method.TARGET_ONLY), k=0, hidden_dim=lm.hidden_size, vocab_size=lm.vocab_size)
    eos = lm.eos_ids()
    gen = torch.Generator().manual_seed(seed)
    lm.reset()
    out: list[int] = []
    todo = prompt_ids
    t_start = time.perf_counter()
    done = max_new_tokens <= 0
    while not done:
        t0 = time.perf_counter()
        step = lm.feed(todo, n_logits=1)
        tok, _ = _pick(step.logits[-1], temperature, gen)
        new, done = clip([tok], len(out), max_new_tokens, eos)
        out.extend(new)
        stats.observe_round(drafted=0, accepted=0, committed=len(new), mismatches=0, draft_s=0.0,
                            target_s=time.perf_counter() - t0, head_s=0.0)
        if on_commit is not None and new:
            on_commit(new)
        if stop_text is not None and not done:
            done = stop_text(_decode(lm.tokenizer, out))
        todo = [tok]
    stats.wall_s = time.perf_counter() - t_start
    return Generation(out, _decode(lm.tokenizer, out), stats)
