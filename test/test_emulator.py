"""Tests for wisv_ros.link.emulator (pure Python, no ROS)."""

import math

import numpy as np
import pytest

from wisv_ros.link.emulator import DeliveryQueue, Direction, LinkEmulator
from wisv_ros.link.channel import ChannelState, ChannelTrace, scenario, transfer_time_s

UP = Direction.UPLINK
DOWN = Direction.DOWNLINK


def test_1mb_at_20mbps_5ms_lossless_takes_serialisation_plus_half_rtt():
    emu = LinkEmulator(ChannelState(rate_bps=20e6, per=0.0, rtt_s=0.005))
    delays = [emu.send(1_000_000, 100.0 * i, UP).delay_s for i in range(5)]
    assert np.mean(delays) == pytest.approx(0.4 + 0.0025, rel=1e-12)
    d = emu.send(1_000_000, 1000.0, UP)
    assert (d.packets, d.attempts) == (667, 667)  # ceil(1e6 / 1500), no retransmissions


def test_fifo_a_message_waits_for_earlier_ones_per_direction():
    ch = ChannelState(rate_bps=8e6, per=0.0, rtt_s=0.010, downlink_rate_bps=16e6)
    emu = LinkEmulator(ch)
    tx = 8 * 10_000 / 8e6  # 10 ms per 10 kB uplink
    first = emu.send(10_000, 1.0, UP)
    second = emu.send(10_000, 1.002, UP)  # sent while the first is still on the link
    down = emu.send(10_000, 1.002, DOWN)  # the other direction does not wait
    later = emu.send(10_000, 5.0, "uplink")  # the link is idle again
    assert first.deliver_at == pytest.approx(1.0 + tx + 0.005)
    assert second.start_s == pytest.approx(first.busy_until)
    assert second.deliver_at == pytest.approx(1.0 + 2 * tx + 0.005)
    assert down.deliver_at == pytest.approx(1.002 + 8 * 10_000 / 16e6 + 0.005)
    assert later.start_s == 5.0
    assert later.delay_s == pytest.approx(tx + 0.005)


def test_per_raises_the_mean_delay_of_a_one_packet_message_by_the_analytic_amount():
    per, rtt, rate, n = 0.1, 0.05, 1e6, 1000
    emu = LinkEmulator(ChannelState(rate_bps=rate, per=per, rtt_s=rtt), seed=7)
    tx = 8 * n / rate
    rto = emu.rto_s(emu.state_at(0.0))
    assert rto == pytest.approx(1.5 * rtt)
    delays = np.array([emu.send(n, 10.0 * i, UP).delay_s for i in range(40_000)])
    # Attempts are geometric: E[losses] = PER / (1 - PER), each costs RTO + a new tx.
    extra = per / (1 - per) * (rto + tx)
    assert delays.min() == pytest.approx(tx + rtt / 2)
    assert delays.mean() - (tx + rtt / 2) == pytest.approx(extra, rel=0.05)


def test_per_stretches_a_large_message_like_the_link_model_and_costs_timeouts():
    ch = scenario("20mbps_50ms")  # PER 0.01
    n = 300_000
    emu = LinkEmulator(ch, seed=3)
    sends = [emu.send(n, 100.0 * i, UP) for i in range(300)]
    packets = sends[0].packets
    attempts = np.mean([d.attempts for d in sends])
    assert attempts == pytest.approx(packets / (1 - ch.per), rel=0.02)
    # Mean transmitter time = 8 n / (R (1 - PER)), the link model's transfer time, plus idle
    # waits for timers at the tail; the delay is at least the lossless one and larger on average.
    lossless = 8 * n / ch.rate_bps + ch.rtt_s / 2
    delays = np.array([d.delay_s for d in sends])
    assert delays.min() == pytest.approx(lossless)
    assert delays.mean() > lossless + (transfer_time_s(n, ch.rate_bps, ch.per) - 8 * n / ch.rate_bps)
    assert np.mean(delays > lossless + 1e-9) == pytest.approx(1 - (1 - ch.per) ** packets, abs=0.1)


def test_unreliable_messages_are_lost_whole_and_still_use_the_link():
    ch = ChannelState(rate_bps=10e6, per=0.02, rtt_s=0.02)
    for n, packets in [(100, 1), (15_000, 10)]:
        emu = LinkEmulator(ch, seed=4)
        sends = [emu.send(n, 10.0 * i, UP, reliable=False) for i in range(20_000)]
        share = np.mean([d.lost for d in sends])
        assert share == pytest.approx(1 - (1 - ch.per) ** packets, rel=0.1)
        assert all(d.attempts == packets for d in sends)  # never retransmitted
        ok = [d for d in sends if not d.lost]
        assert ok[0].delay_s == pytest.approx(8 * n / ch.rate_bps + ch.rtt_s / 2)
        assert all(math.isinf(d.deliver_at) for d in sends if d.lost)
    emu = LinkEmulator(ChannelState(rate_bps=8e6, per=0.5, rtt_s=0.0), seed=1)
    first = emu.send(10_000, 0.0, UP, reliable=False)
    second = emu.send(10_000, 0.0, UP, reliable=False)
    assert second.start_s == pytest.approx(first.busy_until) == pytest.approx(0.01)


def test_seeded_runs_are_deterministic_and_seeds_differ():
    ch = ChannelState(rate_bps=1e6, per=0.2, rtt_s=0.01)

    def run(seed):
        emu = LinkEmulator(ch, seed=seed)
        return [emu.delivery_time(3000, float(i), UP) for i in range(200)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    emu = LinkEmulator(ch, seed=1)
    first = [emu.delivery_time(3000, float(i), UP) for i in range(200)]
    emu.reset()
    assert [emu.delivery_time(3000, float(i), UP) for i in range(200)] == first


def test_trace_step_changes_take_effect_at_their_time():
    low = ChannelState(rate_bps=20e6, per=0.0, rtt_s=0.010)
    high = ChannelState(rate_bps=5e6, per=0.0, rtt_s=0.060)
    trace = ChannelTrace([0.0, 3.0], [low, high])
    emu = LinkEmulator(trace, trace_origin_s=100.0)
    n = 10_000
    assert emu.delivery_time(n, 50.0, UP) == pytest.approx(50.0 + 8 * n / 20e6 + 0.005)  # before
    assert emu.delivery_time(n, 102.9, UP) == pytest.approx(102.9 + 8 * n / 20e6 + 0.005)
    assert emu.delivery_time(n, 103.0, UP) == pytest.approx(103.0 + 8 * n / 5e6 + 0.030)
    # A message on the link across the step: packets after it go at the new rate.
    emu = LinkEmulator(trace)
    d = emu.send(150_000, 2.97, UP)  # 60 ms at 20 Mbit/s: 30 ms before the step, rest after
    assert 2.97 + 0.060 + 0.005 < d.deliver_at
    assert d.deliver_at == pytest.approx(3.0 + 8 * (150_000 - 75_000) / 5e6 + 0.030, abs=0.002)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(mtu_bytes=0), "mtu_bytes"),
        (dict(mtu_bytes=1.5), "mtu_bytes"),
        (dict(seed=-1), "seed"),
        (dict(rto_rtt_factor=0.0), "rto_rtt_factor"),
        (dict(rto_min_s=-0.1), "rto_min_s"),
        (dict(trace_origin_s=math.nan), "trace_origin_s"),
    ],
)
def test_constructor_validation_names_the_field(kwargs, field):
    with pytest.raises((TypeError, ValueError), match=field):
        LinkEmulator(scenario("20mbps_5ms"), **kwargs)


def test_send_validation_names_the_argument():
    emu = LinkEmulator(scenario("20mbps_5ms"))
    with pytest.raises(ValueError, match="n_bytes"):
        emu.send(-1, 0.0, UP)
    with pytest.raises(ValueError, match="t_s"):
        emu.send(10, math.inf, UP)
    with pytest.raises(ValueError, match="direction"):
        emu.send(10, 0.0, "sideways")
    with pytest.raises(TypeError, match="channel"):
        LinkEmulator({"rate_bps": 1e6})


def test_zero_byte_message_pays_only_propagation():
    emu = LinkEmulator(ChannelState(rate_bps=1e6, per=0.0, rtt_s=0.02))
    d = emu.send(0, 1.0, DOWN)
    assert d.delay_s == pytest.approx(0.01)
    assert d.packets == 1


def test_delivery_queue_orders_by_time_then_insertion():
    q = DeliveryQueue()
    assert q.next_deadline() is None
    q.push(2.0, "c")
    q.push(1.0, "a")
    q.push(1.0, "b")
    assert q.next_deadline() == 1.0
    assert q.pop_due(0.5) == []
    assert q.pop_due(1.5) == ["a", "b"]
    assert len(q) == 1
    assert q.pop_due(10.0) == ["c"]
    assert len(q) == 0


# --------------------------------------------------------------------------- faults

from wisv_ros.link.emulator import FaultInjector, Faults, parse_outages  # noqa: E402


def test_faults_drop_duplicate_and_reorder_at_their_rates_seeded():
    inj = FaultInjector(Faults(drop_rate=0.1, duplicate_rate=0.05, reorder_rate=0.2, reorder_s=0.5), seed=3)
    out = [inj.apply("draft_block", float(i), float(i) + 0.01) for i in range(20000)]
    dropped = sum(not o for o in out) / len(out)
    dup = sum(len(o) == 2 for o in out) / len(out)
    late = sum(bool(o) and o[0] > i + 0.4 for i, o in enumerate(out)) / len(out)
    assert abs(dropped - 0.1) < 0.01 and abs(dup - 0.9 * 0.05) < 0.01 and abs(late - 0.9 * 0.2) < 0.015
    again = FaultInjector(Faults(drop_rate=0.1, duplicate_rate=0.05, reorder_rate=0.2, reorder_s=0.5), seed=3)
    assert [again.apply("draft_block", float(i), float(i) + 0.01) for i in range(20000)] == out
    assert inj.counts["dropped"] == sum(not o for o in out)


def test_drop_bursts_take_the_next_messages_of_the_same_topic():
    inj = FaultInjector(Faults(drop_rate=0.05, drop_burst=4), seed=1)
    out = [bool(inj.apply("verdict", float(i), float(i))) for i in range(5000)]
    runs, n = [], 0
    for ok in out + [True]:
        if not ok:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert runs and min(runs) >= 4  # every loss is a burst of at least 4 (two may touch)


def test_an_outage_drops_everything_in_its_window_only():
    inj = FaultInjector(Faults(outages=parse_outages(["10:5"])), origin_s=100.0)
    assert inj.apply("t", 109.9, 110.0) == [110.0]
    assert inj.apply("t", 110.0, 110.1) == [] and inj.apply("t", 114.99, 115.0) == []
    assert inj.apply("t", 115.0, 115.1) == [115.1]
    assert inj.counts["outage"] == 2


@pytest.mark.parametrize("kwargs,field", [({"drop_rate": 1.0}, "drop_rate"), ({"duplicate_rate": -0.1}, "duplicate_rate"),
                                          ({"drop_burst": 0}, "drop_burst"), ({"outages": ((1.0, 0.0),)}, "duration_s")])
def test_fault_settings_are_checked_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Faults(**kwargs)
    with pytest.raises(ValueError, match="outage '5'"):
        parse_outages(["5"])
