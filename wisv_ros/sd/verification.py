"""The edge half of speculative decoding: the target checks a block in one pass, then decides.

Verification has two phases, so that whoever holds the drafter's hidden states can bring them
between the two however they travel (in process, or a HiddenRequest / HiddenReply exchange under
SH):

1. ``Verifier.target_pass(block)`` runs the target once over (pending committed tokens + draft) and
   returns a ``TargetPass``: logits, target hiddens, the mismatch set S, and ``hidden_positions``,
   the draft positions whose drafter hiddens the decision needs (S under WISV with a head and
   tau > 0; empty otherwise).
2. ``Verifier.decide(target_pass, drafter_hidden)`` applies the acceptance rule (the WISV head gets
   ``drafter_hidden``; None rejects every mismatch, which is lossless), rolls the target's cache back
   to the committed prefix and returns the ``Verdict``.

``verify(block)`` is both phases with the block's own hiddens. ``copy_round()`` is SwitchSD's copy
round: candidates from the context, verified in one tree pass, no drafter block.

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Callable, Sequence

import numpy as np
import torch

from wisv_ros.sd.acceptance import FLY_ENTROPY, FLY_WINDOW, fly_accept, greedy_accept, judged_accept, mismatch_positions, rejection_accept
from wisv_ros.sd.drafting import DraftBlock
from wisv_ros.sd.lm import CausalLM
from wisv_ros.switchsd.copying import CopyConfig, verify_tree

__all__ = ["Judge", "Method", "TargetPass", "Verdict", "Verifier"]

# The WISV decision head as the verifier calls it: (drafter hiddens [K, d_D] numpy, mismatch positions
# S ascending, target hiddens [K+1, d_T]) -> [|S|] rejection probabilities.
Judge = Callable[[np.ndarray, list[int], torch.Tensor], torch.Tensor]


class Method(str, enum.Enum):
    """Decoding methods; the value is the name used by parameters, CLIs, messages and CSV files."""

    TARGET_ONLY = "target_only"  # autoregressive decoding with the target alone
    GREEDY = "greedy"  # greedy speculative decoding (lossless)
    REJECT = "reject"  # rejection-sampling speculative decoding (same vocabulary only)
    WISV = "wisv"  # channel-aware semantic verification (decision head at mismatches)
    FLY = "fly"  # training-free lenient verification (entropy gate + deferred window; a WISV baseline)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: str) -> "Method":
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"method '{name}' is not one of: {', '.join(m.value for m in cls)}") from None


@dataclasses.dataclass
class Verdict:
    """What the edge sends down each round (a block's verdict, or a copy round's)."""

    accepted: int  # draft tokens accepted
    correction_id: int  # correction (accepted < K) or bonus token
    committed_ids: list[int]  # draft[:accepted] + [correction_id]
    mismatches: list[int]  # draft positions where the target's argmax differs (set S)
    target_time_s: float = 0.0
    head_time_s: float = 0.0
    target_hidden: torch.Tensor | None = None  # [K+1, d_target] at the verified positions
    copy_round: bool = False  # drafted from the context on the edge (no drafter block)
    target_tokens: int = 0  # tokens the target pass fed (pending correction + block; copy: all candidates)
    copy_candidates: int = 0  # candidate branches of a copy round
    drafted: int = 0  # copy round: tokens of the longest candidate


@dataclasses.dataclass
class TargetPass:
    """Phase 1 of a verification: the target's pass over one block, not yet decided.

    logits: [K+1, V] (row i predicts draft[i]; row K the bonus); target_hidden: [K+1, d_T].
    hidden_positions: the mismatch positions whose drafter hiddens ``decide`` needs (empty: none).
    """

    block: DraftBlock
    logits: torch.Tensor
    target_hidden: torch.Tensor
    mismatches: list[int]
    hidden_positions: list[int]
    target_time_s: float
    _layers: dict[tuple[int, str], torch.Tensor]
    _pending: int  # committed tokens fed in this pass before the draft


_VERIFIER_SEED_OFFSET = 0x5EED_0000


class Verifier:
    """The target model, its cache, the committed context and the acceptance rule.

    Args:
        lm: the target.
        method: GREEDY, REJECT or WISV (TARGET_ONLY has no verifier).
        temperature: sampling temperature of REJECT (> 0).
        tau: WISV threshold (rejection probability >= tau rejects); 0 = greedy, > 1 accepts all.
        judge: WISV decision head (``Judge``); called only at mismatch positions.
        copy: SwitchSD copy mode (``copy_round``); its rounds accept greedily under GREEDY, WISV
            and FLY, and by speculative sampling under REJECT (exact, see ``switchsd.copying``).
        fly_entropy, fly_window: FLY's entropy gate (normalised top-k entropy, 0..1; > 1 = greedy)
            and deferred window (draft tokens), see ``acceptance.fly_accept``.
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
        judge: Judge | None = None,
        seed: int = 0,
        copy: CopyConfig | None = None,
        fly_entropy: float = FLY_ENTROPY,
        fly_window: int = FLY_WINDOW,
    ):
        if method == Method.TARGET_ONLY:
            raise ValueError("method target_only has no verifier; use rounds.generate_target_only()")
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
        self.fly_entropy = fly_entropy
        self.fly_window = fly_window
        self.generator = torch.Generator().manual_seed(seed + _VERIFIER_SEED_OFFSET)
        self.context: list[int] = []  # prompt + committed, target vocabulary

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.context = list(prompt_ids)
        self._probe_row = None  # the copy gate's state belongs to the previous request

    def target_pass(self, block: DraftBlock) -> TargetPass:
        """Phase 1: one target forward pass over the block (the cache keeps the draft until ``decide``)."""
        t0 = time.perf_counter()
        fed = self.pass_tokens(block)
        step = self.lm.feed(fed, n_logits=len(block.token_ids) + 1)
        return self.pass_result(block, step, len(fed) - len(block.token_ids), time.perf_counter() - t0)

    def pass_tokens(self, block: DraftBlock) -> list[int]:
        """What ``target_pass`` feeds: the context the cache lacks (``lm.sync``: rolls the cache back
        to it), then the draft. For a pass shared with other requests (``LlamaCppLM.feed_many``)."""
        if block.prefix_length != len(self.context):
            raise ValueError(
                f"draft block prefix_length {block.prefix_length} does not match the committed length "
                f"{len(self.context)} on the verifier"
            )
        if self.method == Method.REJECT and block.probs is None:
            raise ValueError("method reject needs the drafter's distributions (block.probs); draft with temperature > 0")
        return self.lm.sync(self.context) + list(block.token_ids)

    def pass_result(self, block: DraftBlock, step, n_pending: int, target_time_s: float) -> TargetPass:
        """The ``TargetPass`` of a block from the step that fed its ``pass_tokens`` (``n_pending`` of
        them context), whether alone or in a shared pass."""
        k = len(block.token_ids)
        logits = step.logits[-(k + 1):]
        mismatches = mismatch_positions(list(block.token_ids), logits)
        judged = self.method == Method.WISV and self.judge is not None and self.tau > 0
        return TargetPass(block=block, logits=logits, target_hidden=step.hidden[-(k + 1):], mismatches=mismatches,
                          hidden_positions=list(mismatches) if judged else [],
                          target_time_s=target_time_s, _layers=step.layers, _pending=n_pending)

    def decide(self, tp: TargetPass, drafter_hidden: np.ndarray | None = None) -> Verdict:
        """Phase 2: the acceptance rule on a ``target_pass``; commits and rolls the cache back.

        drafter_hidden: [K, d_D], read at ``tp.hidden_positions`` only; None (the hiddens did not
        arrive, or protocol ids) rejects every mismatch.
        """
        draft = list(tp.block.token_ids)
        t1 = time.perf_counter()
        if self.method == Method.REJECT:
            decision = rejection_accept(draft, tp.block.probs, tp.logits, self.temperature, self.generator)
        elif self.method == Method.FLY:
            decision = fly_accept(draft, tp.logits, self.fly_entropy, self.fly_window)
        elif tp.hidden_positions and drafter_hidden is not None:
            decision = judged_accept(draft, tp.logits, lambda s: self.judge(drafter_hidden, s, tp.target_hidden), self.tau)
        else:
            decision = greedy_accept(draft, tp.logits)
        head_time_s = time.perf_counter() - t1
        if self.copy is not None and self.copy.layer is not None:
            self._probe_row = tp._layers[self.copy.layer][tp._pending - 1 + decision.accepted].numpy()
        committed = draft[: decision.accepted] + [decision.next_id]
        self.lm.rollback(len(self.context) + decision.accepted)
        self.context.extend(committed)
        return Verdict(accepted=decision.accepted, correction_id=decision.next_id, committed_ids=committed,
                       mismatches=tp.mismatches, target_time_s=tp.target_time_s, head_time_s=head_time_s,
                       target_hidden=tp.target_hidden, target_tokens=tp._pending + len(draft), drafted=len(draft))

    def verify(self, block: DraftBlock) -> Verdict:
        """Both phases with the block's own drafter hiddens (in process, or FH)."""
        return self.decide(self.target_pass(block), block.hidden)

    def copy_round(self) -> Verdict | None:
        """A copy round if copy mode holds: the probe fires (or no probe: n-gram baseline) and the
        context's last kappa tokens occurred before. None: the robot's drafter drafts this round."""
        cfg = self.copy
        if cfg is None:
            return None
        candidates = cfg.candidates(self.context)
        if not candidates:
            return None
        if cfg.gate is not None and (self._probe_row is None or not cfg.gate(self._probe_row)):
            return None
        t0 = time.perf_counter()
        n_pend = self.lm.pending(self.context)  # committed tokens this pass feeds before the candidates
        sampling = self.method == Method.REJECT
        res = verify_tree(self.lm, self.context, candidates, temperature=self.temperature if sampling else 0.0,
                          generator=self.generator)
        if cfg.layer is not None:
            self._probe_row = res.layers[cfg.layer].numpy()
        committed = res.accepted_ids + [res.next_id]
        self.context.extend(committed)
        return Verdict(accepted=len(res.accepted_ids), correction_id=res.next_id, committed_ids=committed,
                       mismatches=[], target_time_s=time.perf_counter() - t0, copy_round=True,
                       target_tokens=n_pend + sum(len(c) for c in candidates), copy_candidates=len(candidates),
                       drafted=max(len(c) for c in candidates))
