"""SwitchSD copy drafting: candidates copied out of the context, verified in one tree pass.

When the model is about to repeat a span of its context (code edits, quoting), the cheapest draft
is the context itself. ``copy_candidates`` finds the earlier occurrences of the last ``kappa``
tokens (a kappa-gram suffix match) and proposes the ``depth`` tokens that followed each, most
recent first, up to ``width`` distinct candidates. ``verify_tree`` checks all candidates in ONE
target forward pass with a block-triangular attention mask -- each candidate sees the committed
prefix and its own earlier tokens only -- and keeps the candidate with the longest greedy-accepted
run. The result is the same as verifying each candidate on its own (tested).

With ``temperature > 0`` (rejection SD) the tree is walked by speculative sampling for
deterministic drafts: at each depth the distinct next tokens of the candidates still alive are
tried in order, each accepted with its probability under the residual target distribution, which
then drops that token and renormalises; when all are rejected (or no candidate goes deeper) the
token is sampled from the residual. Every committed token follows the target's distribution
exactly (tested by a chi-square test).

Example (kappa = 2, depth = 3)::

    context = [7, 1, 2, 3, 4, 9, 1, 2]          # the suffix (1, 2) occurred at index 1
    copy_candidates(context, kappa=2, width=2, depth=3) == [[3, 4, 9]]

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

import torch

from wisv_ros.sd.lm import CausalLM

__all__ = ["COPY_MODES", "CopyConfig", "CopyResult", "copy_candidates", "suffix_candidates", "verify_tree"]

COPY_MODES = ("off", "ngram", "suffix", "probe")  # copy mode names of the verifier node and the CLIs


@dataclasses.dataclass
class CopyConfig:
    """SwitchSD copy mode on the edge: draft from the context, no round trip to the robot.

    gate:  the copy probe, (hidden row of ``layer`` at the last committed position) -> fires;
           None = the probe-less n-gram baseline (copy whenever the kappa-gram suffix matched).
    layer: (layer, kind) the target captures for the gate (the verifier's CausalLM must capture it).
    kappa, width, depth: suffix length to match, candidates per round (W), tokens per candidate (D).
    match: "ngram" (the last ``kappa`` tokens occurred before: ``copy_candidates``) or "suffix"
           (the longest earlier match of any length: ``suffix_candidates``, the prompt-lookup rule).
    """

    gate: Callable[[np.ndarray], bool] | None = None
    layer: tuple[int, str] | None = None
    kappa: int = 5
    width: int = 4
    depth: int = 16
    match: str = "ngram"

    def candidates(self, context: Sequence[int]) -> list[list[int]]:
        """The copy candidates this mode offers after ``context`` ([]: the robot drafts)."""
        if self.match == "suffix":
            return suffix_candidates(context, self.width, self.depth)
        if self.match == "ngram":
            return copy_candidates(context, self.kappa, self.width, self.depth)
        raise ValueError(f"copy match '{self.match}' is not ngram or suffix")

    @classmethod
    def for_mode(cls, mode: str, probe=None, *, kappa: int = 5, width: int = 4, depth: int = 16,
                 gate: Callable[[np.ndarray], bool] | None = None) -> "CopyConfig | None":
        """Copy mode by name: "off" -> None; "ngram" and "suffix" (no gate); "probe": n-gram
        candidates gated by ``probe`` (a ``probe.CopyProbe``) at its layer, ``gate`` replacing
        ``probe.fires`` (e.g. to count calls)."""
        if mode == "off":
            return None
        if mode in ("ngram", "suffix"):
            return cls(gate=None, kappa=kappa, width=width, depth=depth, match=mode)
        if mode != "probe":
            raise ValueError(f"copy mode '{mode}' is not one of {', '.join(COPY_MODES)}")
        if probe is None:
            raise ValueError("copy mode probe needs a probe")
        return cls(gate=gate if gate is not None else probe.fires, layer=(probe.layer, probe.kind), kappa=kappa, width=width, depth=depth)


def copy_candidates(context: Sequence[int], kappa: int = 5, width: int = 4, depth: int = 16) -> list[list[int]]:
    """Continuations of earlier occurrences of the context's last ``kappa`` tokens, most recent first.

    Returns at most ``width`` distinct, non-empty candidates of at most ``depth`` tokens each; an
    empty list when the suffix did not occur before (then the neural drafter is used).
    """
    if kappa < 1 or width < 1 or depth < 1:
        raise ValueError(f"kappa, width and depth must be >= 1 (got {kappa}, {width}, {depth})")
    n = len(context)
    if n <= kappa:
        return []
    suffix = list(context[n - kappa:])
    # An occurrence ending at index end-1 (end < n) is followed by context[end:end + depth].
    ends = (end for end in range(n - 1, kappa - 1, -1) if list(context[end - kappa:end]) == suffix)
    return _distinct((list(context[end:end + depth]) for end in ends), width)


def _distinct(candidates, width: int) -> list[list[int]]:
    """The first ``width`` distinct, non-empty candidates, in order."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for cand in candidates:
        key = tuple(cand)
        if cand and key not in seen:
            seen.add(key)
            out.append(cand)
            if len(out) == width:
                break
    return out


def suffix_candidates(context: Sequence[int], width: int = 4, depth: int = 16, max_match: int = 32) -> list[list[int]]:
    """Continuations of the earlier occurrences that match the longest end of the context (any
    length from 1 to ``max_match``), longest match first, then most recent; at most ``width``
    distinct, non-empty candidates of at most ``depth`` tokens. This is the candidate rule of prompt
    lookup / SuffixDecoding: it offers a copy whenever the last token occurred before.
    """
    if width < 1 or depth < 1 or max_match < 1:
        raise ValueError(f"width, depth and max_match must be >= 1 (got {width}, {depth}, {max_match})")
    n = len(context)
    if n < 2:
        return []
    last = context[-1]
    matches: list[tuple[int, int]] = []  # (match length, end index of the earlier occurrence)
    for e in range(n - 2, -1, -1):
        if context[e] != last:
            continue
        m = 1
        while m < max_match and e - m >= 0 and context[e - m] == context[n - 1 - m]:
            m += 1
        matches.append((m, e))
    matches.sort(key=lambda t: (-t[0], -t[1]))
    return _distinct((list(context[e + 1:e + 1 + depth]) for _m, e in matches), width)


@dataclasses.dataclass
class CopyResult:
    candidate: int  # index of the kept candidate (-1: none accepted anything)
    accepted_ids: list[int]  # accepted copied tokens of the kept candidate
    next_id: int  # the target's token after them (correction or bonus)
    accepted_per_candidate: list[int]
    layers: dict[tuple[int, str], torch.Tensor]  # captured layers at the last accepted position [d]


def verify_tree(lm: CausalLM, context: Sequence[int], candidates: Sequence[Sequence[int]],
                temperature: float = 0.0, generator: torch.Generator | None = None) -> CopyResult:
    """Verify all candidates in one target pass; keep the longest greedy-accepted run, or with
    ``temperature > 0`` the run accepted by speculative sampling (see the module docstring).

    The cache is rolled back to ``context`` afterwards (accepted tokens are fed with the next pass).
    """
    if not candidates:
        raise ValueError("verify_tree needs at least one candidate")
    pending = lm.sync(context)
    base = len(lm.cached)  # tokens in the cache before this pass
    n_pend = len(pending)
    flat: list[int] = list(pending)
    pos: list[int] = list(range(base, base + n_pend))
    spans: list[tuple[int, int]] = []
    for cand in candidates:
        start = len(flat)
        flat.extend(cand)
        pos.extend(range(base + n_pend, base + n_pend + len(cand)))
        spans.append((start, len(flat)))
    q = len(flat)
    # allowed[i, j]: query i may attend to key j (keys: cache then this pass's tokens).
    allowed = torch.zeros((q, base + q), dtype=torch.bool)
    allowed[:, :base] = True
    for i in range(n_pend):
        allowed[i, base:base + i + 1] = True
    for start, end in spans:
        allowed[start:end, base:base + n_pend] = True
        for i in range(start, end):
            allowed[i, base + start:base + i + 1] = True
    if hasattr(lm, "feed_candidates"):  # llama.cpp: one decode, one KV sequence per candidate
        step, _ = lm.feed_candidates(context, candidates)  # the rows of ``flat``; the cache holds ``context``
    else:
        step = lm.feed(flat, n_logits=q, attention_mask=allowed[None, None], position_ids=torch.tensor([pos]))
        lm.rollback(len(context))
    if temperature > 0:
        return _sample_tree(step, spans, candidates, n_pend, temperature, generator)
    argmax = step.logits.argmax(dim=-1).tolist()  # row i predicts the token after flat[i]
    best, best_n, per = -1, -1, []
    for c, ((start, end), cand) in enumerate(zip(spans, candidates)):
        prev = n_pend - 1  # the row predicting the candidate's first token
        n = 0
        for i, tok in enumerate(cand):
            if argmax[prev] != tok:
                break
            n += 1
            prev = start + i
        per.append(n)
        if n > best_n:
            best, best_n = c, n
    start, _ = spans[best]
    accepted = list(candidates[best][:best_n])
    next_row = n_pend - 1 if best_n == 0 else start + best_n - 1
    return CopyResult(candidate=best if best_n > 0 else -1, accepted_ids=accepted, next_id=int(argmax[next_row]),
                      accepted_per_candidate=per, layers={k: v[next_row] for k, v in step.layers.items()})


def _sample_tree(step, spans: list[tuple[int, int]], candidates: Sequence[Sequence[int]], n_pend: int,
                 temperature: float, generator: torch.Generator | None) -> CopyResult:
    """Speculative sampling down the candidate tree (deterministic drafts: q = one-hot)."""
    from wisv_ros.sd.acceptance import softmax_t

    def row(c: int, depth: int) -> int:  # the row predicting candidate c's token at ``depth``
        return n_pend - 1 if depth == 0 else spans[c][0] + depth - 1

    alive = list(range(len(candidates)))  # candidates agreeing with the accepted prefix
    accepted: list[int] = []
    while True:
        depth = len(accepted)
        # Candidates alive share the accepted prefix, so their rows at this depth are the same
        # distribution; the first one's is used.
        p = softmax_t(step.logits[row(alive[0], depth)], temperature).double()
        deeper = [c for c in alive if depth < len(candidates[c])]
        chosen = None
        for tok in dict.fromkeys(int(candidates[c][depth]) for c in deeper):
            if torch.rand((), generator=generator, dtype=torch.float64) < p[tok]:
                chosen = tok
                break
            p[tok] = 0.0  # residual max(0, p - onehot(tok)), renormalised
            total = p.sum()
            if total <= 0:  # all the mass was on tried tokens (rejected by rounding): keep the last
                p[tok] = 1.0
                total = p.sum()
            p = p / total
        if chosen is None:
            next_row = row(alive[0], depth)
            next_id = int(torch.multinomial(p, 1, generator=generator))
            break
        accepted.append(chosen)
        alive = [c for c in deeper if int(candidates[c][depth]) == chosen]
    per = []
    for cand in candidates:
        n = 0
        while n < min(len(cand), len(accepted)) and int(cand[n]) == accepted[n]:
            n += 1
        per.append(n)
    return CopyResult(candidate=alive[0] if accepted else -1, accepted_ids=accepted, next_id=next_id,
                      accepted_per_candidate=per, layers={k: v[next_row] for k, v in step.layers.items()})
