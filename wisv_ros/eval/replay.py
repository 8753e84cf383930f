"""Exact replay of the lossless greedy methods from one target decode per problem.

Greedy speculative decoding, with or without SwitchSD copy rounds, commits exactly the target's
greedy output T: every method below produces the same tokens, and differs only in how the rounds
cut T. A round's outcome depends only on

* the drafter's greedy token and its probability after ``prompt + T[:i]`` (while the drafts of
  a round agree with T, the drafter sees exactly that prefix), from one teacher-forced drafter
  pass over ``prompt + T``;
* for copy rounds, the candidates the context ``prompt + T[:i]`` offers (a function of the
  tokens) and, for the probe gate, the probe on the target's hidden state at the last fed
  position, from one teacher-forced target pass.

So one target decode plus two prefill passes per problem give the rounds, acceptance and payloads
of greedy SD for every K and of every copy policy, with the same ``RoundRecord`` s the live round
protocol writes (``sd.roundlog``); latency then comes from ``eval.latency``. Two things are not
known from T and are marked: after a round's first mismatch the drafter drafts on from a wrong
prefix, so with a confidence stop the count of drafts after it is unknown unless the mismatching
draft itself stopped the block; the replay then counts the block as drafted to K (an upper bound;
``ReplayResult.bounded_rounds``). WISV (lossy: an accepted mismatch changes the rest of the text)
and rejection sampling cannot be replayed and are decoded for real.

No rclpy, no torch: pure logic over token lists.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Iterable, Sequence

from wisv_ros.sd.roundlog import RoundRecord, json_rows
from wisv_ros.switchsd.copying import copy_candidates, suffix_candidates

__all__ = ["COPY_POLICIES", "CopyPolicy", "ReplayResult", "Trace", "read_traces", "replay_greedy"]


@dataclasses.dataclass
class Trace:
    """One problem's target decode and the teacher-forced passes over it.

    target_ids: the target's greedy continuation (ends with an end-of-sequence id or at the cap).
    draft_ids[i], draft_prob[i]: the drafter's greedy token and its probability after
        ``prompt_ids + target_ids[:i]``, for i = 0 .. len(target_ids).
    probe_prob[j]: the copy probe's probability on the target's hidden state at absolute position
        j of ``prompt_ids + target_ids`` (empty: no probe).
    """

    id: str
    dataset: str
    prompt_ids: list[int]
    target_ids: list[int]
    draft_ids: list[int]
    draft_prob: list[float]
    eos_ids: list[int]
    probe_prob: list[float] = dataclasses.field(default_factory=list)
    text: str = ""
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.target_ids)
        if len(self.draft_ids) != n + 1 or len(self.draft_prob) != n + 1:
            raise ValueError(f"trace {self.id}: draft_ids/draft_prob need {n + 1} entries (one per prefix), "
                             f"got {len(self.draft_ids)}/{len(self.draft_prob)}")
        if self.probe_prob and len(self.probe_prob) != len(self.prompt_ids) + n:
            raise ValueError(f"trace {self.id}: probe_prob needs {len(self.prompt_ids) + n} entries, got {len(self.probe_prob)}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


def read_traces(path: str | Path) -> list[Trace]:
    """Traces of a JSON-lines file ([] if missing); a torn last line (a stopped run) is skipped."""
    path = Path(path)
    return [Trace(**row) for _, row in json_rows(path)] if path.is_file() else []


@dataclasses.dataclass(frozen=True)
class CopyPolicy:
    """A SwitchSD copy policy on the edge (``switchsd.copying.CopyConfig`` in replay form).

    match: "ngram" (the context's last ``kappa`` tokens occurred before) or "suffix" (the longest
    earlier match of the context's end, any length up to ``max_match``, as prompt lookup and
    SuffixDecoding do). gated: copy only while the probe fires (probability >= threshold).
    """

    name: str
    match: str = "ngram"
    kappa: int = 5
    width: int = 4
    depth: int = 16
    gated: bool = False
    threshold: float = 0.5
    max_match: int = 32

    def candidates(self, context: Sequence[int]) -> list[list[int]]:
        if self.match == "ngram":
            return copy_candidates(context, self.kappa, self.width, self.depth)
        if self.match == "suffix":
            return suffix_candidates(context, self.width, self.depth, max_match=self.max_match)
        raise ValueError(f"copy policy {self.name}: match '{self.match}' is not ngram or suffix")


COPY_POLICIES = {
    "ngram": CopyPolicy("ngram", match="ngram", kappa=3),
    "suffix": CopyPolicy("suffix", match="suffix"),
    "probe": CopyPolicy("probe", match="ngram", kappa=5, gated=True),
}


@dataclasses.dataclass
class ReplayResult:
    records: list[RoundRecord]
    tokens: int  # committed tokens (len(target_ids))
    bounded_rounds: int  # blocks whose drafted count is an upper bound (see the module docstring)


def _match(cand: Sequence[int], truth: Sequence[int]) -> int:
    n = 0
    for a, b in zip(cand, truth):
        if a != b:
            break
        n += 1
    return n


def replay_greedy(trace: Trace, k: int, *, min_confidence: float = 0.0, copy: CopyPolicy | None = None,
                  max_new_tokens: int | None = None, copy_max_rounds: int = 32, method: str = "greedy",
                  on_round: Callable[[RoundRecord], None] | None = None) -> ReplayResult:
    """The rounds greedy SD (K, confidence stop) with the copy policy would run on ``trace``.

    Mirrors ``sd.rounds`` (robot: ``Drafter.draft``, edge: ``Verifier.decide`` then
    ``EdgeSessions._copy_rounds``): the first round's target pass also prefills the prompt;
    copy rounds follow a block while the policy offers candidates (and the probe fires), at most
    ``copy_max_rounds`` and the block's copy budget. The last round is clipped at the end of T.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if copy is not None and copy.gated and not trace.probe_prob:
        raise ValueError(f"trace {trace.id}: copy policy {copy.name} is gated by the probe, but the trace has no probe_prob")
    prompt, truth = trace.prompt_ids, trace.target_ids
    n = len(truth)
    cap = n if max_new_tokens is None else max_new_tokens
    eos = set(trace.eos_ids)
    records: list[RoundRecord] = []
    bounded = 0
    done = 0  # committed tokens
    round_id = 0
    pending = len(prompt)  # committed tokens not yet in the target's cache (fed with the next pass)

    def emit(rec: RoundRecord) -> None:
        records.append(rec)
        if on_round is not None:
            on_round(rec)

    while done < n:
        drafted, accepted, mismatch = 0, 0, None
        for j in range(k):
            pos = done + j
            if pos >= n:  # T ends here (cap): nothing to verify the draft against
                break
            tok, prob = trace.draft_ids[pos], trace.draft_prob[pos]
            drafted += 1
            if tok != truth[pos]:
                mismatch = j
                stops = tok in eos or (min_confidence > 0 and prob < min_confidence)
                if not stops and drafted < k:  # drafts on from a wrong prefix: K drafts, or (with a
                    bounded += min_confidence > 0  # confidence stop) at most K
                    drafted = k
                break
            accepted += 1
            if tok in eos or (min_confidence > 0 and prob < min_confidence):
                break
        committed = min(accepted + 1, n - done)
        emit(RoundRecord(request_id=trace.id, round_id=round_id, kind="block", method=method, k=k, protocol="ids",
                         prefix_length=len(prompt) + done, drafted=max(drafted, 1), accepted=accepted,
                         mismatches=[] if mismatch is None else [mismatch], committed=committed,
                         target_tokens=pending + max(drafted, 1)))
        pending = 1  # the correction or bonus token
        block_ids = truth[done:done + committed]
        budget = cap - done - max(drafted, 1) - 1
        done += committed
        if copy is not None and budget > 0 and not eos.intersection(block_ids):
            copied = 0
            for _ in range(copy_max_rounds):
                if done >= n:
                    break
                context = prompt + truth[:done]
                cands = copy.candidates(context)
                if not cands:
                    break
                if copy.gated and trace.probe_prob[len(context) - 2] < copy.threshold:
                    break
                best = max(_match(c, truth[done:]) for c in cands)
                got = min(best + 1, n - done)
                emit(RoundRecord(request_id=trace.id, round_id=round_id, kind="copy", method=method, k=k,
                                 prefix_length=len(context), drafted=max(len(c) for c in cands), accepted=min(best, got),
                                 committed=got, target_tokens=pending + sum(len(c) for c in cands), copy_candidates=len(cands)))
                pending = got  # the pass leaves the context in the cache: the copied tokens are fed next time
                copied_ids = truth[done:done + got]
                done += got
                copied += got
                if copied >= budget or eos.intersection(copied_ids):
                    break
        round_id += 1
    return ReplayResult(records, n, bounded)


def policies(names: Iterable[str], probe_threshold: float | None = None) -> list[CopyPolicy | None]:
    """Copy policies by name ("off" -> None); the probe policy takes the probe's own threshold."""
    out: list[CopyPolicy | None] = []
    for name in names:
        if name == "off":
            out.append(None)
            continue
        if name not in COPY_POLICIES:
            raise ValueError(f"copy policy '{name}' is not one of off, {', '.join(COPY_POLICIES)}")
        pol = COPY_POLICIES[name]
        if pol.gated and probe_threshold is not None:
            pol = dataclasses.replace(pol, threshold=probe_threshold)
        out.append(pol)
    return out
