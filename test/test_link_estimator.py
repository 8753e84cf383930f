"""Tests for wisv_ros.link.estimator (pure Python, no ROS): synthetic timings, then the
estimator driven by the link emulator (pings and echoes timed by LinkEmulator)."""

import math

import numpy as np
import pytest

from wisv_ros.link.emulator import Direction, LinkEmulator
from wisv_ros.link.channel import ChannelState, ChannelTrace, scenario
from wisv_ros.link.estimator import LinkEstimator, PingKind

SMALL, LARGE = PingKind.SMALL, PingKind.LARGE


def feed(est, seq, kind, sent, rtt):
    est.on_sent(seq, kind, sent)
    return est.on_echo(seq, sent + rtt)


def test_rtt_is_the_fast_cluster_of_small_pings_and_rate_comes_from_the_large_excess():
    est = LinkEstimator(small_bytes=0, large_bytes=50_000)
    assert est.estimate() is None
    assert feed(est, 0, SMALL, 0.0, 0.050) == pytest.approx(0.050)
    feed(est, 1, SMALL, 0.2, 0.054)
    # Window [50, 54] ms, both within the 5 ms jitter allowance: median 52 ms.
    assert est.rtt_s == pytest.approx(0.052)
    assert est.estimate() is None  # no rate yet
    feed(est, 2, LARGE, 0.4, 0.052 + 0.020)  # 50 kB in 20 ms more: 20 Mbit/s
    e = est.estimate()
    assert e.state.rate_bps == pytest.approx(20e6)
    assert e.state.rtt_s == pytest.approx(0.052)
    assert e.state.per == 0.0
    assert e.samples == 3
    assert e.measured_at == pytest.approx(0.472)


def test_rate_uses_the_fastest_of_the_recent_large_pings():
    est = LinkEstimator(small_bytes=0, large_bytes=10_000, rate_window=3)
    feed(est, 0, SMALL, 0.0, 0.010)
    for seq, extra in enumerate([0.100, 0.004, 0.090], start=1):  # two of them retransmitted
        feed(est, seq, LARGE, float(seq), 0.010 + extra)
    assert est.rate_bps == pytest.approx(8 * 10_000 / 0.004)
    for seq in range(4, 7):  # the window forgets the fast sample after 3 more
        feed(est, seq, LARGE, float(seq), 0.010 + 0.008)
    assert est.rate_bps == pytest.approx(8 * 10_000 / 0.008)


def test_rtt_filter_ignores_middleware_jitter_above_the_fast_cluster():
    est = LinkEstimator(rtt_window=8, late_min_s=0.005)
    jitter = [0.0, 0.001, 0.012, 0.0005, 0.020, 0.002, 0.015, 0.001] * 4  # ms-scale tail
    for seq, j in enumerate(jitter):
        feed(est, seq, SMALL, float(seq), 0.050 + j)
    assert est.rtt_s == pytest.approx(0.0508, abs=0.001)  # the plain mean is 56.4 ms
    assert est.per == 0.0  # jitter below the late margin (0.75 RTT) is not loss


def test_late_small_pings_are_losses_and_stay_out_of_the_rtt():
    est = LinkEstimator(per_window=10, shift_count=3)
    rtts = [0.02] * 4 + [0.06] + [0.02] * 4 + [0.06]  # 2 of 10 came late (retransmitted)
    for seq, r in enumerate(rtts):
        feed(est, seq, SMALL, float(seq), r)
    assert est.rtt_s == pytest.approx(0.02)
    q = 0.2
    assert est.per == pytest.approx(1 - math.sqrt(1 - q))


def test_a_run_of_late_pings_is_a_level_shift_not_loss():
    est = LinkEstimator(per_window=20, shift_count=3)
    for seq in range(5):
        feed(est, seq, SMALL, float(seq), 0.010)
    feed(est, 5, SMALL, 5.0, 0.060)
    feed(est, 6, SMALL, 6.0, 0.060)
    assert est.rtt_s == pytest.approx(0.010)  # two late ones: losses so far
    assert est.per > 0.0
    feed(est, 7, SMALL, 7.0, 0.060)
    assert est.rtt_s == pytest.approx(0.060)  # the third makes it a level shift
    assert est.per == 0.0
    feed(est, 8, SMALL, 8.0, 0.010)  # a drop is followed at once
    assert est.rtt_s == pytest.approx(0.010)
    assert est.per == 0.0


def test_a_stall_that_fakes_a_level_shift_is_undone_by_the_next_normal_sample():
    est = LinkEstimator(shift_count=3)
    for seq, r in enumerate([0.05] * 5 + [0.15, 0.14, 0.13]):  # the host stalled for a moment
        feed(est, seq, SMALL, float(seq), r)
    assert est.rtt_s == pytest.approx(0.13)  # the fast cluster of the run
    feed(est, 8, SMALL, 8.0, 0.051)
    assert est.rtt_s == pytest.approx(0.051)


def test_best_effort_mode_counts_only_pings_that_never_came_back():
    est = LinkEstimator(per_window=10, timeout_s=1.0, per_from_late=False)
    for seq, r in enumerate([0.02] * 4 + [0.06] + [0.02] * 3):  # one late: jitter, not loss
        feed(est, seq, SMALL, float(seq), r)
    assert est.per == 0.0
    est.on_sent(8, SMALL, 8.0)
    est.on_sent(9, SMALL, 8.2)
    est.on_echo(9, 8.22)
    assert est.expire(9.5) == 1  # seq 8 never came back
    assert est.per == pytest.approx(1 - math.sqrt(1 - 0.1))


def test_timed_out_pings_count_as_lost_and_late_echoes_are_ignored():
    est = LinkEstimator(per_window=4, timeout_s=1.0)
    feed(est, 0, SMALL, 0.0, 0.01)
    est.on_sent(1, SMALL, 1.0)
    est.on_sent(2, LARGE, 1.2)
    assert est.expire(2.1) == 1  # seq 1 is 1.1 s old, seq 2 only 0.9 s
    assert est.on_echo(1, 2.2) is None  # too late, already counted as lost
    assert est.on_echo(99, 2.2) is None  # never sent
    assert est.per == pytest.approx(1 - math.sqrt(1 - 0.5))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(small_bytes=-1), "small_bytes"),
        (dict(small_bytes=100, large_bytes=100), "large_bytes"),
        (dict(shift_count=0), "shift_count"),
        (dict(rate_window=0), "rate_window"),
        (dict(rtt_window=0), "rtt_window"),
        (dict(per_window=0), "per_window"),
        (dict(timeout_s=0.0), "timeout_s"),
        (dict(late_factor=-1.0), "late_factor"),
        (dict(per_from_late=1), "per_from_late"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises((TypeError, ValueError), match=field):
        LinkEstimator(**kwargs)


# --------------------------------------------------------------------------- with the emulator

HEADER_BYTES = 40  # rough CDR size of a LinkPing without padding


def simulate(emu, est, duration_s, period_s=0.2, t0=0.0, reliable=True):
    """Alternate small/large pings every period_s; the echo (no padding) comes back down.

    ``reliable=False``: best-effort pings, a lost one never comes back. Returns
    [(echo time, rtt estimate, rate estimate, per estimate)] after each echo.
    """
    events = []
    for seq in range(int(duration_s / period_s)):
        t = t0 + seq * period_s
        kind = SMALL if seq % 2 == 0 else LARGE
        pad = est.small_bytes if kind == SMALL else est.large_bytes
        up = emu.send(HEADER_BYTES + pad, t, Direction.UPLINK, reliable=reliable)
        events.append((t, "sent", seq, kind))
        if up.lost:
            continue
        down = emu.send(HEADER_BYTES, up.deliver_at, Direction.DOWNLINK, reliable=reliable)
        if not down.lost:
            events.append((down.deliver_at, "echo", seq, kind))
    history = []
    for t, what, seq, kind in sorted(events, key=lambda e: (e[0], e[1] == "echo")):
        if what == "sent":
            est.expire(t)
            est.on_sent(seq, kind, t)
        else:
            est.on_echo(seq, t)
            if est.estimate() is not None:
                s = est.estimate().state
                history.append((t, s.rtt_s, s.rate_bps, s.per))
    return history


@pytest.mark.parametrize("name", ["20mbps_50ms", "20mbps_5ms", "500mbps_50ms"])
def test_estimates_match_the_emulated_scenario(name):
    truth = scenario(name)
    emu = LinkEmulator(truth, seed=11)
    est = LinkEstimator(small_bytes=0, large_bytes=64_000)
    history = simulate(emu, est, duration_s=30.0)
    settled = np.array([h[1:] for h in history if h[0] > 5.0])
    rtt_small_ping = truth.rtt_s + 2 * 8 * HEADER_BYTES / truth.rate_bps
    assert np.median(settled[:, 0]) == pytest.approx(rtt_small_ping, rel=0.02)
    assert np.all(np.abs(settled[:, 1] / truth.rate_bps - 1) < 0.05)
    assert np.all(settled[:, 2] < 0.05)


def test_per_estimate_from_late_pings_converges():
    truth = ChannelState(rate_bps=20e6, per=0.05, rtt_s=0.02)
    emu = LinkEmulator(truth, seed=5)
    # A 64 kB ping (43 packets) gets through loss-free with p = 0.95^43 = 11 %: the rate
    # window must be long enough to hold one (1 - 0.89^40 = 99 %).
    est = LinkEstimator(per_window=1000, rate_window=40)
    history = simulate(emu, est, duration_s=400.0)
    assert history[-1][3] == pytest.approx(truth.per, abs=0.015)
    assert history[-1][2] == pytest.approx(truth.rate_bps, rel=0.05)
    short = LinkEstimator(per_window=1000, rate_window=2)
    simulate(LinkEmulator(truth, seed=5), short, duration_s=400.0)
    assert short.rate_bps < 0.9 * truth.rate_bps  # too short a window: retransmissions show


def test_per_from_best_effort_pings_converges_and_rate_is_unbiased():
    truth = ChannelState(rate_bps=20e6, per=0.02, rtt_s=0.05)
    emu = LinkEmulator(truth, seed=9)
    est = LinkEstimator(per_window=1000, per_from_late=False)
    history = simulate(emu, est, duration_s=400.0, reliable=False)
    assert history[-1][3] == pytest.approx(truth.per, abs=0.006)
    assert history[-1][2] == pytest.approx(truth.rate_bps, rel=0.02)
    assert history[-1][1] == pytest.approx(truth.rtt_s, rel=0.02)


def test_rtt_and_rate_steps_are_followed():
    before = ChannelState(rate_bps=20e6, per=0.0, rtt_s=0.010)
    after = ChannelState(rate_bps=10e6, per=0.0, rtt_s=0.060)
    emu = LinkEmulator(ChannelTrace([0.0, 5.0], [before, after]))
    est = LinkEstimator()
    history = simulate(emu, est, duration_s=12.0)
    rtt_mid = (before.rtt_s + after.rtt_s) / 2
    crossed = [t for t, rtt, _, _ in history if t > 5.0 and rtt > rtt_mid]
    # 3 small pings (one every 0.4 s) make a level shift.
    assert crossed and crossed[0] < 5.0 + 1.5
    final = history[-1]
    assert final[1] == pytest.approx(after.rtt_s, rel=0.05)
    assert final[2] == pytest.approx(after.rate_bps, rel=0.05)
    assert all(rtt < rtt_mid for t, rtt, _, _ in history if t < 5.0)
