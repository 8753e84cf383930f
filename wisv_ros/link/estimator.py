"""Estimate the link's channel state from ping round trips (pure Python, no rclpy).

``wisv_ros.nodes.link_monitor_node`` (robot role) sends pings of two sizes in turn to the
edge, which echoes each one back *without* its padding. This module turns the send and echo
times into a :class:`~wisv_ros.link.ChannelState`. What is measured, honestly:

- **RTT** (``rtt_s``): a windowed, jitter-robust statistic of the *small* pings' round trips:
  of the last ``rtt_window`` in-time samples, the *low cluster* (those within ``late_min_s``,
  the jitter allowance, of the fastest one) is reduced to its median. Not an EWMA: the
  middleware's latency on a busy host is heavy-tailed (on this 2-core machine under load:
  median +5 ms, upper quartile +10 ms, stalls of +50 ms and more over the emulated RTT), and an
  EWMA followed the tail and the stalls (measured 57-61 ms on a 50 ms link, and a stall kept it
  near 100 ms for seconds). The estimate is still the whole path's round trip: propagation, the
  serialisation of two small messages and the middleware's latency (FastDDS on loopback adds
  about 1 ms per hop unloaded, and a ping through the emulator makes four hops). A sample is
  *late* if it exceeds the estimate by more than ``max(late_factor * rtt, late_min_s)``; late
  samples are kept out (they are the losses, see PER; the default margin, 0.75 RTT, must stay
  below the link's retransmission timeout, 1.5 RTT in :mod:`wisv_ros.link.emulator`).
  ``shift_count`` late samples in a row are taken as a level shift instead (the RTT really went
  up): the windows restart from them (the estimate becomes their fast cluster) and they stop
  counting as late. A drop needs no rule: a faster sample enters the window and lowers the estimate at
  once. A stall that fakes a level shift is undone by the next normal sample.
- **Rate** (``rate_bps``): a large ping's round trip exceeds a small one's by the serialisation
  of the extra bytes on the uplink (the echo is small again): ``rate = 8 * Δbytes / Δtime``.
  Retransmissions only ever *add* delay and the middleware adds jitter, so, in the spirit of
  BBR's windowed filters, ``Δtime`` compares like with like: over the last ``rate_window`` large
  and the last ``rate_window`` small round trips, each side's *low cluster* (the samples within
  ``late_min_s``, the jitter allowance, of that side's fastest one) is reduced to its median,
  and ``Δtime`` is the difference of the two medians. It therefore estimates the raw
  rate R, not the goodput R (1 - PER). It needs one loss-free large ping in the window: with
  N packets per large ping that holds with probability ``1 - (1 - (1 - PER)^N)^rate_window``
  (64 kB, PER 0.01, window 8: 99.99 %; PER 0.05 needs a window of about 40). (A loss early in a
  large ping can add less than one RTO, because the retransmission overlaps the rest of the
  ping, which is why the allowance is kept small.) The rate includes the middleware's per-byte
  cost (on loopback about 14 ms/MB per hop, two hops up): rates of hundreds of Mbit/s are
  measured low. A ``Δtime`` below ``min_excess_s`` is clamped (the rate saturates at
  ``8 * Δbytes / min_excess_s``). A level shift of the RTT drops the large pings measured
  before it; the last rate is reported until a large ping comes back.
- **PER** (``per``): a small ping and its echo are one packet each, so a ping round trip
  fails with probability ``q = 1 - (1 - PER)^2``; the estimate is ``PER = 1 - sqrt(1 - q)``
  with ``q`` the failed share of the last ``per_window`` small pings. What "failed" means
  depends on the pings' QoS:

  * best-effort pings (``per_from_late=False``, the monitor's default): a lost packet loses
    the ping, which is counted when it is not echoed within ``timeout_s``. This is the
    residual (post-MAC-retransmission) loss rate the scenarios call PER, and jitter cannot fake
    it; :class:`wisv_ros.link.emulator.LinkEmulator` drops best-effort messages accordingly.
  * reliable pings (``per_from_late=True``): the link retransmits, so pings come late rather
    than not at all; late ones (and timed-out ones) count. Jitter larger than the late margin
    (a busy CPU) is mistaken for loss: on this 2-core machine under load a 0.01 PER read as
    0.02-0.1.

  Resolution is ``1 / per_window`` of q, and the estimate lags by ``timeout_s``.

The estimator never reads a clock; callers pass times in s on one monotonic clock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from wisv_ros.link.channel import ChannelState, _check_int, _check_nonnegative, _check_positive, _check_real

__all__ = ["LinkEstimate", "LinkEstimator", "PingKind"]


def _low_cluster_median(values, allowance: float) -> float:
    """Median of the values within ``allowance`` of the smallest one.

    >>> _low_cluster_median([0.05, 0.051, 0.13, 0.052], 0.005)
    0.051
    """
    low = min(values)
    return statistics.median([v for v in values if v <= low + allowance])


class PingKind:
    """Names of the two ping sizes."""

    SMALL = "small"
    LARGE = "large"


@dataclass(frozen=True)
class LinkEstimate:
    """A channel estimate and how it came about.

    Attributes:
        state: the estimated channel (rate_bps, per, rtt_s).
        samples: ping round trips used so far (small and large, echoed or timed out).
        measured_at: time (s, caller clock) of the newest ping result behind the estimate.
    """

    state: ChannelState
    samples: int
    measured_at: float


@dataclass
class _Pending:
    kind: str
    sent_at: float


class LinkEstimator:
    """Online estimator of RTT, rate and PER from small/large ping round trips.

    Args:
        small_bytes: padding of a small ping (bytes, >= 0).
        large_bytes: padding of a large ping (bytes, > small_bytes).
        rtt_window: small pings in the RTT's low-cluster filter (>= 1).
        late_factor: a sample is late above ``rtt * (1 + late_factor)`` ...
        late_min_s: ... or above ``rtt + late_min_s``, whichever is larger (s); also the
            jitter allowance of the RTT and rate filters (the "low cluster" width).
        shift_count: this many late small pings in a row are a level shift (>= 1).
        rate_window: large (and small) round trips in the rate filter (>= 1).
        per_window: small pings in the PER window (>= 1).
        timeout_s: a ping not echoed within this time (s) is lost.
        min_excess_s: smallest Δtime (s) used for the rate (> 0).
        per_from_late: count late small pings as lost (pings on a reliable, retransmitting
            path); False: only pings that never come back (best-effort pings).

    Raises:
        TypeError, ValueError: an argument out of range; the message names it.
    """

    def __init__(
        self,
        small_bytes: int = 0,
        large_bytes: int = 64000,
        *,
        late_factor: float = 0.75,
        late_min_s: float = 0.005,
        shift_count: int = 3,
        rtt_window: int = 8,
        rate_window: int = 8,
        per_window: int = 50,
        timeout_s: float = 2.0,
        min_excess_s: float = 1e-4,
        per_from_late: bool = True,
    ) -> None:
        self.small_bytes = _check_int("small_bytes", small_bytes, 0)
        self.large_bytes = _check_int("large_bytes", large_bytes, 0)
        if self.large_bytes <= self.small_bytes:
            raise ValueError(
                f"large_bytes must be > small_bytes={self.small_bytes}, got {self.large_bytes}"
            )
        self.late_factor = _check_nonnegative("late_factor", late_factor)
        self.late_min_s = _check_nonnegative("late_min_s", late_min_s)
        self.shift_count = _check_int("shift_count", shift_count, 1)
        self.rtt_window = _check_int("rtt_window", rtt_window, 1)
        self.rate_window = _check_int("rate_window", rate_window, 1)
        self.per_window = _check_int("per_window", per_window, 1)
        self.timeout_s = _check_positive("timeout_s", timeout_s)
        self.min_excess_s = _check_positive("min_excess_s", min_excess_s)
        if not isinstance(per_from_late, bool):
            raise TypeError(f"per_from_late must be a bool, got {per_from_late!r}")
        self.per_from_late = per_from_late

        self._pending: dict[int, _Pending] = {}
        self._late_run: list[float] = []  # RTTs of the current run of late small pings
        self._rtt_window: deque[float] = deque(maxlen=self.rtt_window)  # in-time small RTTs
        self._small_rtts: deque[float] = deque(maxlen=self.rate_window)  # ... for the rate
        self._large_rtts: deque[float] = deque(maxlen=self.rate_window)
        self._late_flags: deque[bool] = deque(maxlen=self.per_window)
        self._last_rate: float | None = None
        self._samples = 0
        self._measured_at: float | None = None

    # ------------------------------------------------------------------ inputs

    def on_sent(self, seq: int, kind: str, t_s: float) -> None:
        """Record that ping ``seq`` of ``kind`` (:class:`PingKind`) was sent at ``t_s``."""
        if kind not in (PingKind.SMALL, PingKind.LARGE):
            raise ValueError(f"kind must be {PingKind.SMALL!r} or {PingKind.LARGE!r}, got {kind!r}")
        self._pending[int(seq)] = _Pending(kind, _check_real("t_s", t_s))

    def on_echo(self, seq: int, t_s: float) -> float | None:
        """Record the echo of ping ``seq`` received at ``t_s``; return its round trip (s).

        Unknown, duplicate or already timed-out sequence numbers are ignored (returns None).
        """
        t_s = _check_real("t_s", t_s)
        pending = self._pending.pop(int(seq), None)
        if pending is None:
            return None
        rtt = t_s - pending.sent_at
        if pending.kind == PingKind.SMALL:
            self._small(rtt)
        else:
            self._large(rtt)
        self._samples += 1
        self._measured_at = t_s
        return rtt

    def expire(self, t_s: float) -> int:
        """Count pings sent more than ``timeout_s`` before ``t_s`` as lost; return how many."""
        t_s = _check_real("t_s", t_s)
        lost = [s for s, p in self._pending.items() if t_s - p.sent_at > self.timeout_s]
        for seq in lost:
            if self._pending.pop(seq).kind == PingKind.SMALL:
                self._late_flags.append(True)
            self._samples += 1
            self._measured_at = t_s
        return len(lost)

    def _small(self, rtt: float) -> None:
        estimate = self.rtt_s
        if estimate is not None and rtt > estimate + max(self.late_factor * estimate, self.late_min_s):
            # Late: a loss, or the start of a rise.
            self._late_run.append(rtt)
            self._late_flags.append(self.per_from_late)
            if len(self._late_run) >= self.shift_count:
                # A level shift, not losses: take these samples out of the PER window, restart
                # the windows at the new level (the large ones were measured on the old one).
                for i in range(1, min(len(self._late_run), len(self._late_flags)) + 1):
                    self._late_flags[-i] = False
                self._restart_windows(self._late_run)
            return
        self._late_run.clear()
        self._accept_small(rtt)

    def _restart_windows(self, run: list[float]) -> None:
        """After a level shift: the windows restart from ``run``; large pings are stale."""
        for window in (self._rtt_window, self._small_rtts, self._large_rtts):
            window.clear()
        self._rtt_window.extend(run)
        self._small_rtts.extend(run)
        self._late_run.clear()

    def _accept_small(self, rtt: float) -> None:
        self._late_flags.append(False)
        self._rtt_window.append(rtt)
        self._small_rtts.append(rtt)

    def _large(self, rtt: float) -> None:
        self._large_rtts.append(rtt)

    # ------------------------------------------------------------------ outputs

    @property
    def rtt_s(self) -> float | None:
        """Current RTT estimate (s), None before the first small echo."""
        if not self._rtt_window:
            return None
        return _low_cluster_median(self._rtt_window, self.late_min_s)

    @property
    def rate_bps(self) -> float | None:
        """Current rate estimate (bit/s), None before the first large echo."""
        if self._large_rtts and self._small_rtts:
            excess = _low_cluster_median(self._large_rtts, self.late_min_s) - _low_cluster_median(
                self._small_rtts, self.late_min_s
            )
            self._last_rate = 8.0 * (self.large_bytes - self.small_bytes) / max(
                excess, self.min_excess_s
            )
        return self._last_rate  # Kept across a level shift until a new large ping is back.

    @property
    def per(self) -> float | None:
        """Current PER estimate in [0, 1), None before the first small ping result."""
        if not self._late_flags:
            return None
        q = sum(self._late_flags) / len(self._late_flags)
        # q = 1 means every ping came late: report the largest PER a ChannelState allows.
        return min(1.0 - math.sqrt(1.0 - q), 1.0 - 1e-9)

    def estimate(self) -> LinkEstimate | None:
        """The current :class:`LinkEstimate`, or None until RTT, rate and PER all have data."""
        rtt, rate, per = self.rtt_s, self.rate_bps, self.per
        if rtt is None or rate is None or per is None or self._measured_at is None:
            return None
        state = ChannelState(rate_bps=rate, per=per, rtt_s=max(rtt, 0.0))
        return LinkEstimate(state=state, samples=self._samples, measured_at=self._measured_at)
