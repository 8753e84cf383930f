"""Placement: where a request's tokens are made, chosen per round by the expected latency per token.

Three placements (the drafter_node parameter ``placement``; ``auto`` chooses among them):

* ``split``: distributed speculative decoding, the drafter on the robot and the target on the
  edge (the round protocol of ``sd.rounds``);
* ``edge``: the edge generates with the target alone (method ``target_only`` rounds: up to
  ``edge_chunk`` tokens a round trip, with the edge's copy mode where it runs one) and streams
  them to the robot; the answer is the target's, as under split greedy decoding;
* ``robot``: the robot's drafter answers alone (its own text, not verified by the target).

``PlacementModel`` keeps what the robot measured about each placement (drafting time per block
and per token, the edge's time per block and per generated token, tokens committed per split
round, the middleware's share of a round trip) and combines it with the latest channel state by
the link's cost model (``link.channel``: payload / (R (1 - PER)) + RTT per exchange), so a change
of the link moves the choice at once, without trying the other placements again. The edge reports
its own time per generated token (``Verdict.edge_token_s``) and how busy other robots keep it
(``Verdict.edge_load``, the share of its time in the last seconds); the edge placement's compute
is stretched by 1 / (1 - load).

``auto`` takes the faster of split and edge (both give the target's answer), with a hysteresis so
that noise does not flip it every round; ``robot`` enters only when a latency budget is set
(``max_ms_per_token``) and both placements that keep the target's answer are expected over it
while the robot alone is under it. A placement with nothing measured yet is tried first (split
for a few rounds, then one edge round, unless the edge has reported its token time).

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses
import math

from wisv_ros.link.channel import (ChannelState, WireFormat, comm_time_fh, comm_time_ids, comm_time_sh,
                                   downlink_bytes_verdict, exchange_time_s)

__all__ = ["PLACEMENTS", "PLACEMENT_MODES", "Choice", "EdgeLoad", "PlacementModel"]

PLACEMENTS = ("split", "edge", "robot")
PLACEMENT_MODES = ("auto",) + PLACEMENTS
_LOSSLESS = ("split", "edge")  # placements whose answer is the target's


class _Ewma:
    """Exponentially weighted mean (None until the first sample)."""

    def __init__(self, alpha: float):
        self.alpha, self.value = alpha, None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


@dataclasses.dataclass
class Choice:
    """One decision: the placement, its chunk (edge: tokens to ask for), what each placement was
    expected to cost (seconds per token; None = not known yet) and why, in words."""

    placement: str
    expected_s: dict[str, float | None]
    reason: str
    edge_chunk: int = 0


class PlacementModel:
    """Expected seconds per committed token of each placement, from the robot's own measurements.

    Args:
        wire: the link's payload sizes (``WireFormat``; hidden size for fh/sh blocks).
        mode: ``auto`` or a fixed placement (then ``choose`` always returns it, and still explains).
        max_ms_per_token: auto only: the latency budget above which the robot answers alone
            (0 = never: auto keeps the target's answer).
        edge_chunk: tokens an edge round asks for; 0 = the fewest that keep the round trip under
            ``chunk_overhead`` of the round's compute (at most 32).
        hysteresis: auto switches only to a placement expected this much faster (share).
        warmup_rounds: split rounds measured before auto first compares.
    The model is kept across requests (the pair, the robot and the edge stay), like the protocol
    chooser's mean mismatch count.
    """

    def __init__(self, wire: WireFormat, mode: str = "auto", max_ms_per_token: float = 0.0, edge_chunk: int = 0,
                 hysteresis: float = 0.1, warmup_rounds: int = 2, chunk_overhead: float = 0.1, alpha: float = 0.2):
        if mode not in PLACEMENT_MODES:
            raise ValueError(f"placement: '{mode}' is not one of {', '.join(PLACEMENT_MODES)}")
        if not (math.isfinite(max_ms_per_token) and max_ms_per_token >= 0):
            raise ValueError(f"max_ms_per_token must be finite and >= 0 (0 = no budget), got {max_ms_per_token}")
        if not 0 <= edge_chunk <= 256:
            raise ValueError(f"edge_chunk must be in [0, 256] (0 = auto), got {edge_chunk}")
        self.wire, self.mode = wire, mode
        self.max_s_per_token = max_ms_per_token / 1000.0
        self.edge_chunk, self.hysteresis, self.warmup_rounds = int(edge_chunk), hysteresis, warmup_rounds
        self.chunk_overhead = chunk_overhead
        self.split_draft_s = _Ewma(alpha)  # drafting per split round
        self.split_drafted = _Ewma(alpha)  # draft tokens per split block
        self.split_edge_s = _Ewma(alpha)  # the edge's time per split block (Verdict.edge_time_s)
        self.split_committed = _Ewma(alpha)  # tokens a split round commits (copy rounds included)
        self.split_mismatch = _Ewma(alpha)  # rejected draft positions per block (SH's second exchange)
        self.split_protocol = "ids"
        self.edge_token_s = _Ewma(alpha)  # the edge's time per generated token, as the robot saw it
        self.overhead_s = _Ewma(alpha)  # per exchange: measured wait - edge time - modelled link
        self.local_s = _Ewma(alpha)  # per round on the robot beside drafting and the wait (commit, streaming)
        self.robot_token_s = _Ewma(alpha)  # drafting per drafted token
        self.reported_token_s: float | None = None  # Verdict.edge_token_s
        self.edge_load = 0.0  # Verdict.edge_load
        self.split_rounds = 0
        self.current = "split" if mode == "auto" else mode
        self.last: Choice | None = None

    # ------------------------------------------------------------------ measurements
    def observe_draft(self, drafted: int, draft_s: float) -> None:
        """Any drafted block (split and robot rounds): the robot's time per drafted token."""
        if drafted > 0:
            self.robot_token_s.add(draft_s / drafted)

    def observe_split(self, drafted: int, draft_s: float, committed: int, edge_s: float, wait_s: float,
                      protocol: str, mismatches: int, channel: ChannelState | None) -> None:
        """A split round: ``wait_s`` from sending the block to its verdict (link + edge + middleware)."""
        self.split_rounds += 1
        self.split_draft_s.add(draft_s)
        self.split_drafted.add(drafted)
        self.split_edge_s.add(edge_s)
        self.split_committed.add(committed)
        self.split_mismatch.add(mismatches)
        self.split_protocol = protocol
        self._observe_overhead(wait_s - edge_s - self._split_link_s(channel, drafted, committed, mismatches, protocol))

    def observe_edge(self, tokens: int, edge_s: float, wait_s: float, channel: ChannelState | None) -> None:
        """An edge round that committed ``tokens``."""
        if tokens <= 0:
            return
        self.edge_token_s.add(edge_s / tokens)
        self._observe_overhead(wait_s - edge_s - self._edge_link_s(channel, tokens))

    def observe_report(self, edge_token_s: float, edge_load: float) -> None:
        """What the edge says of itself in a verdict (0 token time = not measured yet)."""
        if math.isfinite(edge_token_s) and edge_token_s > 0:
            self.reported_token_s = float(edge_token_s)
        if math.isfinite(edge_load):
            self.edge_load = min(max(float(edge_load), 0.0), 0.95)

    def observe_local(self, seconds: float) -> None:
        """A round's time on the robot outside drafting and the wait for the edge (committing,
        streaming the text, the executor): paid once a round by every placement."""
        self.local_s.add(max(0.0, seconds))

    def _observe_overhead(self, x: float) -> None:
        self.overhead_s.add(max(0.0, x))

    # ------------------------------------------------------------------ the cost model
    def _split_link_s(self, ch: ChannelState | None, drafted: float, committed: float, mismatches: float,
                      protocol: str) -> float:
        if ch is None:
            return 0.0
        k, n = max(1, round(drafted)), max(1, round(committed))
        if protocol == "fh":
            return comm_time_fh(self.wire, k, ch, n_committed=n)
        if protocol == "sh":
            return comm_time_sh(self.wire, k, min(mismatches, k), ch, n_committed=n)
        return comm_time_ids(self.wire, k, ch, n_committed=n)

    def _edge_link_s(self, ch: ChannelState | None, tokens: int) -> float:
        if ch is None:
            return 0.0
        # up: a request header (no draft tokens); down: a verdict of ``tokens`` ids
        return exchange_time_s(self.wire.header_bytes, downlink_bytes_verdict(self.wire, tokens), ch)

    def edge_compute_s(self) -> float | None:
        """The edge's seconds per generated token for this robot: measured in its own edge rounds
        (queueing included), else the edge's report stretched by its load."""
        if self.edge_token_s.value is not None:
            return self.edge_token_s.value
        if self.reported_token_s is not None:
            return self.reported_token_s / (1.0 - self.edge_load)
        return None

    def chunk(self, ch: ChannelState | None) -> int:
        """Tokens an edge round asks for (``edge_chunk``, or the auto rule)."""
        if self.edge_chunk:
            return self.edge_chunk
        t1 = self.edge_compute_s()
        if t1 is None or t1 <= 0:
            return 8
        fixed = (ch.rtt_s if ch is not None else 0.0) + (self.overhead_s.value or 0.0) + (self.local_s.value or 0.0)
        return int(min(32, max(1, math.ceil(fixed / (self.chunk_overhead * t1)))))

    def expected(self, ch: ChannelState | None) -> dict[str, float | None]:
        """Seconds per committed token of each placement on channel ``ch`` (None: not known yet)."""
        over = self.overhead_s.value or 0.0  # per exchange
        local = self.local_s.value or 0.0  # per round
        robot = self.robot_token_s.value
        if robot is not None and self.split_drafted.value:
            robot += local / self.split_drafted.value
        out: dict[str, float | None] = {"split": None, "edge": None, "robot": robot}
        if self.split_committed.value:
            c = self.split_committed.value
            link = self._split_link_s(ch, self.split_drafted.value, c, self.split_mismatch.value, self.split_protocol)
            out["split"] = (self.split_draft_s.value + self.split_edge_s.value + link + over + local) / c
        t1 = self.edge_compute_s()
        if t1 is not None:
            n = self.chunk(ch)
            out["edge"] = (n * t1 + self._edge_link_s(ch, n) + over + local) / n
        return out

    # ------------------------------------------------------------------ the decision
    def choose(self, ch: ChannelState | None) -> Choice:
        """The placement of the next round on channel ``ch`` (the latest channel state)."""
        exp = self.expected(ch)
        link = (f"channel {ch.rate_bps / 1e6:.1f} Mbit/s, PER {ch.per:.3f}, RTT {ch.rtt_s * 1e3:.0f} ms"
                if ch is not None else "no channel state yet")
        costs = ", ".join(f"{p} {exp[p] * 1e3:.0f}" if exp[p] is not None else f"{p} ?" for p in PLACEMENTS)
        where = f"(ms/token expected: {costs}; {link}; edge load {self.edge_load:.2f})"
        if self.mode != "auto":
            return self._chosen(Choice(self.mode, exp, f"{self.mode}: fixed by the parameter placement {where}"), ch)
        if exp["split"] is None or self.split_rounds < self.warmup_rounds:
            return self._chosen(Choice("split", exp, f"split: measuring split rounds first {where}"), ch)
        if exp["edge"] is None:
            return self._chosen(Choice("edge", exp, f"edge: measuring one edge round {where}"), ch)
        best = min(_LOSSLESS, key=lambda p: exp[p])
        cur = self.current if self.current in _LOSSLESS else best
        pick = best if exp[best] < (1.0 - self.hysteresis) * exp[cur] else cur
        why = (f"{pick}: the faster of split and edge" if pick == best else
               f"{pick}: within {self.hysteresis:.0%} of {best}, staying")
        robot = exp["robot"]
        # Back from robot-only only with a margin under the budget (the same hysteresis).
        budget = self.max_s_per_token * ((1.0 - self.hysteresis) if self.current == "robot" else 1.0)
        if self.max_s_per_token > 0 and exp[pick] > budget and robot is not None:
            if robot <= budget:
                pick, why = "robot", (f"robot: split and edge are over max_ms_per_token = {self.max_s_per_token * 1e3:.0f} "
                                      "and the drafter alone is under it (its own answer, not verified)")
            else:
                why += f" (over max_ms_per_token = {self.max_s_per_token * 1e3:.0f}, and so is the robot alone)"
        return self._chosen(Choice(pick, exp, f"{why} {where}"), ch)

    def _chosen(self, c: Choice, ch: ChannelState | None) -> Choice:
        if c.placement == "edge":
            c.edge_chunk = self.chunk(ch)
        self.current, self.last = c.placement, c
        return c


class EdgeLoad:
    """The edge's side of ``Verdict.edge_load``: how much of the last ``window_s`` seconds the
    edge's one verification thread spent on other robots' work.

    ``add(robot, start, end)`` records a job (a target pass shared by several robots is added once
    per robot, split evenly); ``load(robot, now)`` is the share of the window that the jobs of every
    other robot took (0..1). Thread-safe enough for one writer and readers of floats.
    """

    def __init__(self, window_s: float = 5.0):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._jobs: list[tuple[float, float, str]] = []  # (start, end, robot), oldest first

    def add(self, robot: str, start: float, end: float) -> None:
        self._jobs.append((start, end, robot))
        cut = end - self.window_s
        while self._jobs and self._jobs[0][1] < cut:
            self._jobs.pop(0)

    def load(self, robot: str, now: float) -> float:
        lo = now - self.window_s
        busy = sum(max(0.0, min(e, now) - max(s, lo)) for s, e, r in list(self._jobs) if r != robot)
        return min(1.0, busy / self.window_s)
