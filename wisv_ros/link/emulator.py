"""User-space emulation of the robot-edge wireless link (pure Python, no rclpy).

The kernel here has no ``netem`` (see ENVIRONMENT.md), so delay and loss are emulated in user
space: :class:`LinkEmulator` computes *when* a message would arrive, and
``wisv_ros.nodes.link_emulator_node`` holds each relayed message until that time.

Model of one direction (uplink = robot -> edge, downlink = edge -> robot):

- **Transmitter FIFO.** Each direction has one transmitter. A message sent at ``t`` starts when
  the transmitter is free: ``start = max(t, busy_until)``; earlier messages are never overtaken.
- **Packets.** The message of ``n`` bytes is cut into ``ceil(n / mtu_bytes)`` packets (at least
  one); every transmission attempt of a packet of ``b`` bytes occupies the transmitter for
  ``8 b / R`` seconds, R = ``rate_bps`` (uplink) or ``downlink_rate_bps`` (downlink). No per-packet
  header overhead is added, so a lossless message costs exactly ``8 n / R``.
- **Propagation.** A packet that gets through arrives ``rtt_s / 2`` after its attempt ends.
- **Loss and retransmission (selective repeat).** Every attempt is lost independently with
  probability PER (seeded RNG). The sender notices a loss when no acknowledgement came back
  within the retransmission timeout ``RTO = max(rto_min_s, rto_rtt_factor * rtt_s)`` after the
  attempt ended (default factor 1.5: an acknowledgement is due one RTT after sending; the timer
  allows 50 % slack, as a transport with a well-converged, low-variance RTT estimate would). The
  packet is then retransmitted, ahead of the message's not-yet-sent packets; meanwhile the
  transmitter keeps sending those. The message is delivered when its last packet has arrived.
  The transmitter is busy until the message's last attempt ends (a retransmission that waits
  for its timer at the end of a message blocks the next message: head-of-line blocking, as on
  one reliable stream).

Consequences worth knowing:

- The transmitter time of a message is ``8 n / R`` times the number of attempts per packet,
  ``1 / (1 - PER)`` on average, i.e. the mean matches :func:`wisv_ros.link.transfer_time_s`.
  The *delay* under loss is larger than that formula, because each loss also waits for the RTO;
  for a one-packet message the mean delay is exactly
  ``tx + rtt/2 + PER / (1 - PER) * (RTO + tx)`` (``tx = 8 n / R``), which the tests check.
- Nothing is ever dropped: loss costs time, as on a reliable link. The exception is a message
  sent with ``reliable=False`` (a best-effort topic): its packets go once, and one lost packet
  loses the message, with probability ``1 - (1 - PER)^packets``.
- With a :class:`~wisv_ros.link.ChannelTrace` the channel state is looked up at the start of each
  transmission attempt, at trace time ``t - trace_origin_s``; before the first sample the first
  sample holds. A step change therefore affects every attempt that starts after it.

Times are plain floats in seconds on whatever clock the caller uses (the node uses
``time.monotonic()``); the emulator never reads a clock itself, so it is deterministic.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import random
from bisect import bisect_right
from dataclasses import dataclass
from typing import Generic, TypeVar

from wisv_ros.link.channel import ChannelState, ChannelTrace, _check_int, _check_nonnegative, _check_positive, _check_real

__all__ = ["Direction", "Delivery", "LinkEmulator", "DeliveryQueue", "Faults", "FaultInjector", "parse_outages"]

T = TypeVar("T")


class Direction(str, enum.Enum):
    """Direction of a message over the link."""

    UPLINK = "uplink"  # robot -> edge, at ChannelState.rate_bps
    DOWNLINK = "downlink"  # edge -> robot, at ChannelState.downlink_rate_bps


@dataclass(frozen=True)
class Delivery:
    """Outcome of sending one message (all times in s, on the caller's clock).

    Attributes:
        sent_at: when the message was handed to the link.
        start_s: when its first packet started (after waiting for earlier messages).
        deliver_at: when its last packet arrived at the far end.
        busy_until: when the transmitter became free again (end of the last attempt).
        packets: number of packets the message was cut into.
        attempts: transmission attempts, retransmissions included (>= packets).
        lost: True if an unreliable message lost a packet; then ``deliver_at`` is inf.
    """

    sent_at: float
    start_s: float
    deliver_at: float
    busy_until: float
    packets: int
    attempts: int
    lost: bool = False

    @property
    def delay_s(self) -> float:
        """deliver_at - sent_at (s): queueing + serialisation + retransmissions + propagation."""
        return self.deliver_at - self.sent_at


class LinkEmulator:
    """Computes delivery times over an emulated lossy link (see the module docstring).

    Args:
        channel: a fixed :class:`ChannelState`, or a :class:`ChannelTrace` (step changes).
        mtu_bytes: packet size in bytes (>= 1); the last packet of a message may be shorter.
        seed: seed of the loss RNG; equal seeds and inputs give equal results.
        rto_rtt_factor: RTO = max(rto_min_s, rto_rtt_factor * rtt_s); must be > 0.
        rto_min_s: lower bound of the RTO in s (>= 0).
        trace_origin_s: caller-clock time that corresponds to trace time 0 (s); the attribute
            of the same name may be reassigned later to re-align the trace.

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range; the message names it.
    """

    def __init__(
        self,
        channel: ChannelState | ChannelTrace,
        *,
        mtu_bytes: int = 1500,
        seed: int = 0,
        rto_rtt_factor: float = 1.5,
        rto_min_s: float = 0.001,
        trace_origin_s: float = 0.0,
    ) -> None:
        if isinstance(channel, ChannelState):
            self._trace = ChannelTrace([0.0], [channel])
        elif isinstance(channel, ChannelTrace):
            self._trace = channel
        else:
            raise TypeError(
                f"channel must be a ChannelState or a ChannelTrace, got {type(channel).__name__}"
            )
        self.mtu_bytes = _check_int("mtu_bytes", mtu_bytes, 1)
        self.seed = _check_int("seed", seed, 0)
        self.rto_rtt_factor = _check_positive("rto_rtt_factor", rto_rtt_factor)
        self.rto_min_s = _check_nonnegative("rto_min_s", rto_min_s)
        self.trace_origin_s = _check_real("trace_origin_s", trace_origin_s)
        self._times = self._trace.times
        self._rng = random.Random(self.seed)
        self._busy_until = {d: -math.inf for d in Direction}

    @property
    def trace(self) -> ChannelTrace:
        """The channel trace in use (a one-sample trace for a fixed ChannelState)."""
        return self._trace

    def reset(self) -> None:
        """Forget queued traffic and restart the loss RNG from the seed."""
        self._rng = random.Random(self.seed)
        self._busy_until = {d: -math.inf for d in Direction}

    def state_at(self, t_s: float) -> ChannelState:
        """Channel state in force at caller time ``t_s`` (the first sample before the trace)."""
        i = bisect_right(self._times, t_s - self.trace_origin_s) - 1
        return self._trace.states[max(i, 0)]

    def _next_change(self, t_s: float) -> float:
        """Caller time of the first trace step strictly after ``t_s`` (inf if none)."""
        i = bisect_right(self._times, t_s - self.trace_origin_s)
        return self._times[i] + self.trace_origin_s if i < len(self._times) else math.inf

    def rto_s(self, state: ChannelState) -> float:
        """Retransmission timeout (s) for ``state``: max(rto_min_s, rto_rtt_factor * rtt_s)."""
        return max(self.rto_min_s, self.rto_rtt_factor * state.rtt_s)

    @staticmethod
    def _rate(state: ChannelState, direction: Direction) -> float:
        if direction is Direction.UPLINK:
            return state.rate_bps
        assert state.downlink_rate_bps is not None  # Set by ChannelState.__post_init__.
        return state.downlink_rate_bps

    def send(
        self, n_bytes: int, t_s: float, direction: Direction | str, *, reliable: bool = True
    ) -> Delivery:
        """Send a message of ``n_bytes`` at caller time ``t_s`` and return its :class:`Delivery`.

        Updates the direction's transmitter FIFO and draws from the loss RNG. ``reliable=False``
        models a best-effort message (a best-effort DDS topic over a link whose residual loss
        rate is PER): every packet is sent once, and if any is lost the whole message is lost
        (``Delivery.lost``); it still occupies the transmitter.

        Raises:
            TypeError, ValueError: ``n_bytes`` not an integer >= 0, ``t_s`` not finite, or an
                unknown ``direction``; the message names the argument.
        """
        n_bytes = _check_int("n_bytes", n_bytes, 0)
        t_s = _check_real("t_s", t_s)
        try:
            direction = Direction(direction)
        except ValueError:
            valid = ", ".join(d.value for d in Direction)
            raise ValueError(f"direction must be one of {valid}, got {direction!r}") from None

        n_packets = max(1, -(-n_bytes // self.mtu_bytes))
        last_size = n_bytes - (n_packets - 1) * self.mtu_bytes
        start = max(t_s, self._busy_until[direction])
        state = self.state_at(start)
        rate = self._rate(state, direction)
        tx_all = 8.0 * n_bytes / rate

        if not reliable:
            return self._send_unreliable(t_s, start, direction, n_packets, last_size)
        # Fast path: no loss possible and no trace step while the message is on the link.
        if state.per == 0.0 and start + tx_all < self._next_change(start):
            end = start + tx_all
            self._busy_until[direction] = end
            return Delivery(t_s, start, end + state.rtt_s / 2.0, end, n_packets, n_packets)

        clock = start
        deliver_at = start
        attempts = 0
        next_original = 0
        retx: list[tuple[float, int]] = []  # (ready time, packet index), a heap
        while next_original < n_packets or retx:
            if retx and retx[0][0] <= clock:
                _, packet = heapq.heappop(retx)
            elif next_original < n_packets:
                packet = next_original
                next_original += 1
            else:  # Only retransmissions left, none due yet: idle until the first timer fires.
                ready, packet = heapq.heappop(retx)
                clock = ready
            state = self.state_at(clock)
            size = last_size if packet == n_packets - 1 else self.mtu_bytes
            end = clock + 8.0 * size / self._rate(state, direction)
            attempts += 1
            if state.per > 0.0 and self._rng.random() < state.per:
                heapq.heappush(retx, (end + self.rto_s(state), packet))
            else:
                deliver_at = max(deliver_at, end + state.rtt_s / 2.0)
            clock = end
        self._busy_until[direction] = clock
        return Delivery(t_s, start, deliver_at, clock, n_packets, attempts)

    def _send_unreliable(
        self, t_s: float, start: float, direction: Direction, n_packets: int, last_size: int
    ) -> Delivery:
        clock = start
        deliver_at = start
        lost = False
        for packet in range(n_packets):
            state = self.state_at(clock)
            size = last_size if packet == n_packets - 1 else self.mtu_bytes
            clock += 8.0 * size / self._rate(state, direction)
            if state.per > 0.0 and self._rng.random() < state.per:
                lost = True
            deliver_at = max(deliver_at, clock + state.rtt_s / 2.0)
        self._busy_until[direction] = clock
        return Delivery(
            t_s, start, math.inf if lost else deliver_at, clock, n_packets, n_packets, lost
        )

    def delivery_time(self, n_bytes: int, t_s: float, direction: Direction | str) -> float:
        """Caller time (s) at which a message of ``n_bytes`` sent at ``t_s`` arrives."""
        return self.send(n_bytes, t_s, direction).deliver_at


class DeliveryQueue(Generic[T]):
    """Items waiting for their delivery time: a heap ordered by time, then by insertion.

    Not thread-safe; the node guards it with a lock.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, deliver_at: float, item: T) -> None:
        """Queue ``item`` for delivery at ``deliver_at`` (s)."""
        heapq.heappush(self._heap, (deliver_at, next(self._counter), item))

    def next_deadline(self) -> float | None:
        """Delivery time of the earliest item, or None if the queue is empty."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[T]:
        """Remove and return, in delivery order, every item due at or before ``now``."""
        due: list[T] = []
        while self._heap and self._heap[0][0] <= now:
            due.append(heapq.heappop(self._heap)[2])
        return due


@dataclass(frozen=True)
class Faults:
    """Message faults beyond the link model (which never loses a message on a reliable topic):
    what a broken relay, a DDS history overrun or a dead radio does to the protocol's topics.

    drop_rate: share of messages dropped (each independently, seeded).
    drop_burst: a drop also drops the next ``drop_burst - 1`` messages of that topic (bursts).
    duplicate_rate: share of messages delivered twice (the copy ``duplicate_gap_s`` later).
    reorder_rate: share of messages held back ``reorder_s`` more, so that later ones overtake them.
    outages: (start_s, duration_s) windows, seconds after the emulator started, in which every
        faulted message is dropped (a radio that is gone).
    """

    drop_rate: float = 0.0
    drop_burst: int = 1
    duplicate_rate: float = 0.0
    duplicate_gap_s: float = 0.002
    reorder_rate: float = 0.0
    reorder_s: float = 0.05
    outages: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("drop_rate", "duplicate_rate", "reorder_rate"):
            value = _check_real(name, getattr(self, name))
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        _check_int("drop_burst", self.drop_burst, 1)
        _check_nonnegative("duplicate_gap_s", self.duplicate_gap_s)
        _check_nonnegative("reorder_s", self.reorder_s)
        for i, window in enumerate(self.outages):
            if len(window) != 2:
                raise ValueError(f"outages[{i}] must be (start_s, duration_s), got {window!r}")
            _check_nonnegative(f"outages[{i}] start_s", window[0])
            _check_positive(f"outages[{i}] duration_s", window[1])

    @property
    def active(self) -> bool:
        return bool(self.drop_rate or self.duplicate_rate or self.reorder_rate or self.outages)


def parse_outages(specs) -> tuple[tuple[float, float], ...]:
    """Outage windows from strings ``"START_S:DURATION_S"`` (ValueError naming the bad one)."""
    out = []
    for spec in specs:
        try:
            start, duration = (float(x) for x in str(spec).split(":"))
        except ValueError:
            raise ValueError(f"outage '{spec}': expected START_S:DURATION_S, e.g. 10:5") from None
        out.append((start, duration))
    return tuple(out)


class FaultInjector:
    """Applies :class:`Faults` to deliveries: ``apply(topic, t_s, deliver_at)`` gives the times at
    which the message arrives (none: dropped; two: duplicated). Seeded and clock-free, like
    :class:`LinkEmulator`; ``t_s`` is on the caller's clock, ``origin_s`` its time of outage 0."""

    def __init__(self, faults: Faults, *, seed: int = 0, origin_s: float = 0.0) -> None:
        self.faults = faults
        self.origin_s = _check_real("origin_s", origin_s)
        self._rng = random.Random(_check_int("seed", seed, 0) + 0x5EED)
        self._burst_left: dict[str, int] = {}
        self.counts = {"dropped": 0, "duplicated": 0, "reordered": 0, "outage": 0}

    def in_outage(self, t_s: float) -> bool:
        rel = t_s - self.origin_s
        return any(start <= rel < start + duration for start, duration in self.faults.outages)

    def apply(self, topic: str, t_s: float, deliver_at: float) -> list[float]:
        f = self.faults
        if self.in_outage(t_s):
            self.counts["outage"] += 1
            return []
        if self._burst_left.get(topic, 0) > 0:
            self._burst_left[topic] -= 1
            self.counts["dropped"] += 1
            return []
        if f.drop_rate and self._rng.random() < f.drop_rate:
            self._burst_left[topic] = f.drop_burst - 1
            self.counts["dropped"] += 1
            return []
        if f.reorder_rate and self._rng.random() < f.reorder_rate:
            deliver_at += f.reorder_s
            self.counts["reordered"] += 1
        times = [deliver_at]
        if f.duplicate_rate and self._rng.random() < f.duplicate_rate:
            times.append(deliver_at + f.duplicate_gap_s)
            self.counts["duplicated"] += 1
        return times
