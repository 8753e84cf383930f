"""Acceptance rules: which draft tokens of a block the target commits.

Glossary of token roles in one round (K draft tokens, one target pass over prefix + draft):

* draft tokens   ``d[0..K-1]`` proposed by the drafter (target vocabulary);
* target logits  ``L[0..K]``: ``L[i]`` is the target's prediction for the token at draft position i,
  ``L[K]`` predicts the token after the whole block;
* accepted       the first ``n`` draft tokens the rule keeps;
* correction     when ``n < K``: the target's replacement for the rejected draft token ``d[n]``;
* bonus          when ``n == K``: the extra token predicted by ``L[K]`` for free.

Every rule returns ``Decision(accepted, next_id)``: the round commits ``d[:n] + [next_id]``, so a
round always commits between 1 and K+1 tokens.

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

__all__ = ["FLY_ENTROPY", "FLY_TOP_K", "FLY_WINDOW", "Decision", "fly_accept", "greedy_accept", "judged_accept", "mismatch_positions",
           "rejection_accept", "softmax_t", "topk_entropy"]

#: Probabilities the FLy-style entropy gate looks at (``topk_entropy``).
FLY_TOP_K = 8
#: fly's default entropy gate (normalised top-k entropy, 0..1): a mismatch is accepted only above it.
FLY_ENTROPY = 0.6
#: fly's default deferred window (FLy's win_len): the draft tokens after an accepted mismatch that must all
#: equal the target's argmax.
FLY_WINDOW = 6


@dataclasses.dataclass(frozen=True)
class Decision:
    accepted: int  # draft tokens kept, 0..K
    next_id: int  # correction (n < K) or bonus (n == K) token


def softmax_t(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax at a temperature > 0 (float64 for exact ratios in rejection sampling)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    return torch.softmax(logits.double() / temperature, dim=-1)


def mismatch_positions(draft_ids: Sequence[int], target_logits: torch.Tensor) -> list[int]:
    """Positions i where the target's argmax differs from the draft token (the set S of WISV).

    target_logits: [K+1, V] (or [K, V]); only the first K rows are compared.
    """
    k = len(draft_ids)
    if k == 0:
        return []
    argmax = target_logits[:k].argmax(dim=-1)
    draft = torch.as_tensor(list(draft_ids), dtype=argmax.dtype)
    return torch.nonzero(argmax != draft).flatten().tolist()


def greedy_accept(draft_ids: Sequence[int], target_logits: torch.Tensor) -> Decision:
    """Lossless greedy verification: keep drafts up to the first mismatch with the target's argmax.

    The committed sequence is exactly what the target alone would produce greedily.
    target_logits: [K+1, V].
    """
    return judged_accept(draft_ids, target_logits, judge=None, tau=0.0)


def judged_accept(
    draft_ids: Sequence[int],
    target_logits: torch.Tensor,
    judge: Callable[[list[int]], torch.Tensor] | None,
    tau: float,
) -> Decision:
    """Semantic verification (WISV Algorithm 1, steps 4-7).

    At each mismatch position i the ``judge`` returns a *rejection* probability
    sigma(g([h_D; h_T; c])); the block is cut at the first mismatch whose probability is >= tau.
    Positions where draft and target agree are never judged.

    * tau <= 0: every mismatch is rejected (sigma >= 0 always), identical to greedy verification,
      and the judge is not even called;
    * tau > 1: no mismatch is rejected; every draft token is accepted.

    judge: maps the mismatch positions (ascending) to a [len(S)] tensor of rejection probabilities.
    target_logits: [K+1, V].
    """
    k = len(draft_ids)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, expected K+1 = {k + 1}")
    argmax = target_logits.argmax(dim=-1).tolist()
    mismatches = mismatch_positions(draft_ids, target_logits)
    cut = k
    if mismatches:
        if tau <= 0 or judge is None:
            cut = mismatches[0]
        else:
            p_reject = judge(mismatches)
            for pos, p in zip(mismatches, p_reject.tolist()):
                if p >= tau:
                    cut = pos
                    break
    return Decision(accepted=cut, next_id=int(argmax[cut]))


def topk_entropy(logits: torch.Tensor, k: int = FLY_TOP_K) -> torch.Tensor:
    """Normalised entropy of the ``k`` most likely tokens, per row of ``logits`` [..., V]: their
    probabilities renormalised to sum 1, entropy divided by log k. 0: one token holds all the top-k
    mass (the target is sure); 1: the k are equally likely (several continuations are plausible)."""
    if k < 2:
        raise ValueError(f"topk_entropy needs k >= 2, got {k}")
    top = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1).values
    q = top / top.sum(dim=-1, keepdim=True)
    return -(q * torch.log(q.clamp_min(1e-30))).sum(dim=-1) / float(torch.log(torch.tensor(float(k))))


def fly_accept(draft_ids: Sequence[int], target_logits: torch.Tensor, entropy_min: float, window: int,
               top_k: int = FLY_TOP_K) -> Decision:
    """Training-free lenient verification in the manner of FLy (Li et al., 2025): a baseline for WISV.

    A mismatch at draft position i is accepted when both hold:

    * entropy gate: the target is unsure there, ``topk_entropy(L[i]) >= entropy_min``;
    * deferred window: the next ``window`` draft tokens ``d[i+1..i+window]`` all equal the target's
      argmax given the draft so far (the target goes on as if the draft token were its own).

    The block is cut at the first mismatch that fails either test. A mismatch with fewer than
    ``window`` draft tokens after it in the block is rejected (FLy defers that decision into the
    next round; here it is not taken at all, which errs on the side of the target's text).
    ``entropy_min`` > 1 rejects every mismatch: greedy verification.
    target_logits: [K+1, V].
    """
    k = len(draft_ids)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, expected K+1 = {k + 1}")
    if window < 1:
        raise ValueError(f"fly window must be >= 1, got {window}")
    argmax = target_logits.argmax(dim=-1).tolist()
    cut = k
    for i in mismatch_positions(draft_ids, target_logits):
        agreed = i + window < k and all(int(draft_ids[j]) == argmax[j] for j in range(i + 1, i + window + 1))
        if not (agreed and float(topk_entropy(target_logits[i], top_k)) >= entropy_min):
            cut = i
            break
    return Decision(accepted=cut, next_id=int(argmax[cut]))


def rejection_accept(
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator,
) -> Decision:
    """Speculative (rejection) sampling; the committed tokens follow the target's distribution exactly.

    For i = 0..K-1 accept d[i] with probability min(1, p_T(d[i]) / p_D(d[i])); on the first
    rejection sample the correction from norm(max(0, p_T - p_D)); if all are accepted, sample the
    bonus from p_T at position K. Same vocabulary only.

    draft_probs: [K, V] the drafter's sampling distribution at each draft position.
    target_logits: [K+1, V].
    """
    k = len(draft_ids)
    if draft_probs.shape[0] != k or target_logits.shape[0] != k + 1:
        raise ValueError(
            f"shapes: draft_probs {tuple(draft_probs.shape)} and target_logits {tuple(target_logits.shape)} "
            f"do not fit K = {k} (expected [K, V] and [K+1, V])"
        )
    if draft_probs.shape[-1] != target_logits.shape[-1]:
        raise ValueError(
            f"rejection sampling needs one vocabulary: drafter has {draft_probs.shape[-1]} entries, "
            f"target {target_logits.shape[-1]}"
        )
    p_t = softmax_t(target_logits, temperature)
    p_d = draft_probs.double()
    for i, tok in enumerate(draft_ids):
        ratio = p_t[i, tok] / p_d[i, tok].clamp_min(1e-300)
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if u >= ratio:  # reject with probability 1 - min(1, ratio)
            residual = (p_t[i] - p_d[i]).clamp_min(0.0)
            total = residual.sum()
            dist = residual / total if total > 0 else p_t[i]
            return Decision(i, int(torch.multinomial(dist, 1, generator=generator)))
    return Decision(k, int(torch.multinomial(p_t[k], 1, generator=generator)))
