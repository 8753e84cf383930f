"""Tests for wisv_ros.link.channel (pure Python, no ROS)."""

import math

import numpy as np
import pytest

from wisv_ros.link.channel import (
    CHANNEL_FEATURES, SCENARIOS, ChannelState, ChannelTrace, ModelShape, Protocol, ShPayload, WireFormat,
    choose_protocol, comm_time_dist, comm_time_fh, comm_time_ids, comm_time_sh, compute_time_s,
    downlink_bytes_request, downlink_bytes_verdict, exchange_time_s, forward_flops, hidden_bytes, scenario,
    transfer_time_s, uplink_bytes_dist, uplink_bytes_fh, uplink_bytes_ids, uplink_bytes_sh,
)

FMT = WireFormat(hidden_dim=4096)  # fp16 hiddens: B_hid = 8192 bytes


# --------------------------------------------------------------------------- ChannelState


@pytest.mark.parametrize(
    "kwargs, field, range_text",
    [
        (dict(rate_bps=0.0, per=0.0, rtt_s=0.0), "rate_bps", "> 0"),
        (dict(rate_bps=-1.0, per=0.0, rtt_s=0.0), "rate_bps", "> 0"),
        (dict(rate_bps=1e6, per=1.0, rtt_s=0.0), "per", "[0, 1)"),
        (dict(rate_bps=1e6, per=-0.1, rtt_s=0.0), "per", "[0, 1)"),
        (dict(rate_bps=1e6, per=0.0, rtt_s=-0.001), "rtt_s", ">= 0"),
        (dict(rate_bps=1e6, per=0.0, rtt_s=0.0, downlink_rate_bps=0.0), "downlink_rate_bps", "> 0"),
        (dict(rate_bps=math.inf, per=0.0, rtt_s=0.0), "rate_bps", "finite"),
        (dict(rate_bps=1e6, per=math.nan, rtt_s=0.0), "per", "finite"),
    ],
)
def test_channel_state_validation_names_field_and_range(kwargs, field, range_text):
    with pytest.raises(ValueError) as info:
        ChannelState(**kwargs)
    assert field in str(info.value)
    assert range_text in str(info.value)


def test_channel_state_rejects_non_numbers_naming_field():
    with pytest.raises(TypeError, match="rtt_s"):
        ChannelState(rate_bps=1e6, per=0.0, rtt_s="5ms")
    with pytest.raises(TypeError, match="per"):
        ChannelState(rate_bps=1e6, per=True, rtt_s=0.0)


def test_channel_state_downlink_defaults_to_uplink_and_coerces_float():
    ch = ChannelState(rate_bps=20_000_000, per=0, rtt_s=0)
    assert ch.downlink_rate_bps == 20e6
    assert isinstance(ch.rate_bps, float) and isinstance(ch.per, float)
    assert ChannelState(1e6, 0.0, 0.0, downlink_rate_bps=5e6).downlink_rate_bps == 5e6


def test_features_layout_and_reference_points():
    f = ChannelState(rate_bps=1e6, per=0.02, rtt_s=0.1).features()
    assert f.shape == (len(CHANNEL_FEATURES),) == (3,)
    assert f.dtype == np.float32
    np.testing.assert_allclose(f, [0.0, 0.02, 1.0], atol=1e-7)
    np.testing.assert_allclose(ChannelState(1e9, 0.0, 0.005).features(), [1.0, 0.0, 0.05], atol=1e-7)
    assert CHANNEL_FEATURES == ("log_rate", "per", "rtt")


def test_features_monotone_in_rate_and_rtt_and_finite():
    rates = [1e3, 1e5, 20e6, 500e6, 10e9]
    by_rate = [ChannelState(r, 0.01, 0.02).features() for r in rates]
    assert all(np.isfinite(f).all() for f in by_rate)
    log_rate = [f[0] for f in by_rate]
    assert all(a < b for a, b in zip(log_rate, log_rate[1:]))
    assert all(f[1] == pytest.approx(0.01) and f[2] == pytest.approx(0.2) for f in by_rate)

    rtts = [0.0, 0.005, 0.05, 0.5, 5.0]
    by_rtt = [ChannelState(20e6, 0.01, t).features() for t in rtts]
    assert all(np.isfinite(f).all() for f in by_rtt)
    rtt = [f[2] for f in by_rtt]
    assert all(a < b for a, b in zip(rtt, rtt[1:]))


# --------------------------------------------------------------------------- scenarios


def test_scenarios_match_paper_grid():
    assert set(SCENARIOS) == {"20mbps_5ms", "20mbps_50ms", "500mbps_5ms", "500mbps_50ms"}
    for name, ch in SCENARIOS.items():
        mbps, ms = name.split("_")
        assert ch.rate_bps == float(mbps.removesuffix("mbps")) * 1e6
        assert ch.rtt_s == pytest.approx(float(ms.removesuffix("ms")) / 1000)
    assert scenario("20mbps_5ms").per == 0.01
    assert scenario("500mbps_50ms").per == 0.001


def test_unknown_scenario_lists_valid_names():
    with pytest.raises(KeyError) as info:
        scenario("5g_magic")
    msg = str(info.value)
    assert "5g_magic" in msg
    assert all(name in msg for name in SCENARIOS)


# --------------------------------------------------------------------------- payload sizes


def test_wire_format_validation_names_field():
    with pytest.raises(ValueError, match="hidden_dim"):
        WireFormat(hidden_dim=0)
    with pytest.raises(ValueError, match="id_bytes"):
        WireFormat(hidden_dim=8, id_bytes=0)
    with pytest.raises(TypeError, match="hidden_dtype_bytes"):
        WireFormat(hidden_dim=8, hidden_dtype_bytes=2.5)


def test_payload_sizes_default_format_hand_computed():
    assert hidden_bytes(FMT) == 8192
    assert uplink_bytes_ids(FMT, 16) == 64 + 16 * 4 == 128
    assert uplink_bytes_fh(FMT, 16) == 64 + 64 + 16 * 8192 == 131200
    assert uplink_bytes_sh(FMT, 16, 3) == ShPayload(
        ids_up=128, request_down=64 + 3 * 4, hiddens_up=64 + 3 * 8192
    )
    assert uplink_bytes_dist(FMT, 4, 1000) == 64 + 16 + 4 * 1000 * 2 == 8080
    assert downlink_bytes_verdict(FMT, 5) == 64 + 4 + 4 + 5 * 4 == 92
    assert downlink_bytes_request(FMT, 2) == 72


def test_payload_sizes_custom_format_hand_computed():
    fmt = WireFormat(hidden_dim=3, header_bytes=10, id_bytes=2, hidden_dtype_bytes=4, prob_bytes=1)
    assert hidden_bytes(fmt) == 12
    assert uplink_bytes_fh(fmt, 2) == 10 + 2 * 2 + 2 * 12 == 38
    assert uplink_bytes_sh(fmt, 2, 1) == (14, 12, 22)
    assert uplink_bytes_dist(fmt, 2, 7) == 10 + 4 + 2 * 7 * 1 == 28
    assert downlink_bytes_verdict(fmt, 0) == 14


def test_sh_zero_mismatch_has_no_second_transfer():
    assert uplink_bytes_sh(FMT, 16, 0) == ShPayload(ids_up=128, request_down=0, hiddens_up=0)


def test_payload_argument_validation():
    with pytest.raises(ValueError, match="n_mismatch"):
        uplink_bytes_sh(FMT, 4, 5)
    with pytest.raises(ValueError, match="k"):
        uplink_bytes_fh(FMT, 0)
    with pytest.raises(ValueError, match="vocab_size"):
        uplink_bytes_dist(FMT, 4, 0)


# --------------------------------------------------------------------------- time costs


def test_transfer_time_formula_and_per():
    assert transfer_time_s(1000, 8000.0, 0.0) == pytest.approx(1.0)
    assert transfer_time_s(1000, 8000.0, 0.5) == pytest.approx(2.0)
    times = [transfer_time_s(10_000, 20e6, p) for p in (0.0, 0.01, 0.1, 0.5, 0.9)]
    assert all(a < b for a, b in zip(times, times[1:]))
    with pytest.raises(ValueError, match="per"):
        transfer_time_s(1000, 8000.0, 1.0)
    with pytest.raises(ValueError, match="n_bytes"):
        transfer_time_s(-1, 8000.0, 0.0)


def test_exchange_time_uses_rtt_and_both_rates():
    ch = ChannelState(rate_bps=8000.0, per=0.0, rtt_s=0.1, downlink_rate_bps=16000.0)
    assert exchange_time_s(1000, 1000, ch) == pytest.approx(0.1 + 1.0 + 0.5)


def test_comm_time_fh_and_ids_are_one_exchange():
    ch = scenario("20mbps_5ms")
    verdict = downlink_bytes_verdict(FMT, 17)
    assert comm_time_fh(FMT, 16, ch) == pytest.approx(
        exchange_time_s(uplink_bytes_fh(FMT, 16), verdict, ch)
    )
    assert comm_time_ids(FMT, 16, ch) == pytest.approx(
        exchange_time_s(uplink_bytes_ids(FMT, 16), verdict, ch)
    )
    assert comm_time_ids(FMT, 16, ch, n_committed=3) < comm_time_ids(FMT, 16, ch)


def test_sh_with_zero_mismatches_costs_one_exchange():
    ch = scenario("20mbps_50ms")
    t0 = comm_time_sh(FMT, 16, 0, ch)
    assert t0 == pytest.approx(comm_time_ids(FMT, 16, ch))
    assert t0 < 2 * ch.rtt_s
    t1 = comm_time_sh(FMT, 16, 1, ch)
    assert t1 > 2 * ch.rtt_s


def test_sh_with_mismatches_is_two_exchanges():
    ch = scenario("500mbps_5ms")
    payload = uplink_bytes_sh(FMT, 16, 3)
    expected = exchange_time_s(payload.ids_up, payload.request_down, ch) + exchange_time_s(
        payload.hiddens_up, downlink_bytes_verdict(FMT, 17), ch
    )
    assert comm_time_sh(FMT, 16, 3, ch) == pytest.approx(expected)
    with pytest.raises(ValueError, match="n_mismatch"):
        comm_time_sh(FMT, 16, 16.5, ch)


def test_rejection_sd_collapses_at_low_rate():
    slow, fast = scenario("20mbps_50ms"), scenario("500mbps_50ms")
    k, vocab = 10, 32000
    assert comm_time_dist(FMT, k, vocab, slow) > 5 * comm_time_ids(FMT, k, slow)
    assert comm_time_dist(FMT, k, vocab, fast) < 2 * comm_time_ids(FMT, k, fast)


# --------------------------------------------------------------------------- protocol choice


def test_protocol_enum_values():
    assert Protocol("fh") is Protocol.FH
    assert [p.value for p in Protocol] == ["ids", "fh", "sh", "dist"]
    assert str(Protocol.SH) == "sh"
    assert Protocol.DIST == "dist"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("20mbps_5ms", Protocol.SH),  # low rate and low RTT
        ("20mbps_50ms", Protocol.FH),  # high RTT
        ("500mbps_5ms", Protocol.FH),  # high rate
        ("500mbps_50ms", Protocol.FH),  # high rate and high RTT
    ],
)
def test_choose_protocol_paper_regimes(name, expected):
    assert choose_protocol(FMT, 16, scenario(name), expected_mismatches=2.0) is expected


def test_choose_protocol_agrees_with_comm_times():
    for ch in SCENARIOS.values():
        for m in (0.0, 0.5, 2.0, 8.0, 16.0):
            got = choose_protocol(FMT, 16, ch, m)
            better = Protocol.SH if comm_time_sh(FMT, 16, m, ch) < comm_time_fh(FMT, 16, ch) else Protocol.FH
            assert got is better
    # No mismatches expected: SH never needs its second exchange, so it always wins.
    assert all(choose_protocol(FMT, 16, ch, 0.0) is Protocol.SH for ch in SCENARIOS.values())


def test_choose_protocol_switches_once_to_fh_as_rate_or_rtt_grows():
    rates = [5e6, 10e6, 20e6, 50e6, 100e6, 200e6, 500e6, 1e9]
    by_rate = [choose_protocol(FMT, 16, ChannelState(r, 0.01, 0.005), 2.0) for r in rates]
    assert by_rate[0] is Protocol.SH and by_rate[-1] is Protocol.FH
    first_fh = by_rate.index(Protocol.FH)
    assert all(p is Protocol.FH for p in by_rate[first_fh:])

    rtts = [0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1]
    by_rtt = [choose_protocol(FMT, 16, ChannelState(20e6, 0.01, t), 2.0) for t in rtts]
    assert by_rtt[0] is Protocol.SH and by_rtt[-1] is Protocol.FH
    first_fh = by_rtt.index(Protocol.FH)
    assert all(p is Protocol.FH for p in by_rtt[first_fh:])


# --------------------------------------------------------------------------- traces

CSV_TRACE = """t_s,rate_bps,per,rtt_s
0.0,500e6,0.001,0.005
2.5,20e6,0.01,0.050
10,100e6,0.0,0.010
"""

YAML_TRACE = """# two-step trace
samples:
  - {t_s: 0.0, rate_bps: 500.0e6, per: 0.001, rtt_s: 0.005}
  - t_s: 2.5
    rate_bps: 20e6
    per: 0.01
    rtt_s: 0.05
    downlink_rate_bps: 40e6
"""


def test_trace_csv_step_lookup(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(CSV_TRACE)
    trace = ChannelTrace.load(path)
    assert len(trace) == 3
    assert trace.times == (0.0, 2.5, 10.0)
    assert trace.at(0.0).rate_bps == 500e6
    assert trace.at(2.4999).rate_bps == 500e6
    assert trace.at(2.5) == ChannelState(20e6, 0.01, 0.05)
    assert trace.at(9.99).rtt_s == 0.05
    assert trace.at(1e6).rate_bps == 100e6  # last sample holds
    with pytest.raises(ValueError, match="before the trace start"):
        trace.at(-0.1)


def test_trace_yaml_step_lookup(tmp_path):
    path = tmp_path / "trace.yaml"
    path.write_text(YAML_TRACE)
    trace = ChannelTrace.load(str(path))
    assert len(trace) == 2
    assert trace.at(1.0) == ChannelState(500e6, 0.001, 0.005)
    late = trace.at(3.0)
    assert (late.rate_bps, late.per, late.rtt_s, late.downlink_rate_bps) == (20e6, 0.01, 0.05, 40e6)


def test_trace_yaml_plain_list(tmp_path):
    path = tmp_path / "trace.yml"
    path.write_text("- {t_s: 1, rate_bps: 1e6, per: 0, rtt_s: 0}\n")
    trace = ChannelTrace.load(path)
    assert trace.at(1.0).rate_bps == 1e6
    with pytest.raises(ValueError):
        trace.at(0.5)


@pytest.mark.parametrize(
    "name, text, needles",
    [
        ("bad_per.csv", "t_s,rate_bps,per,rtt_s\n0,1e6,0,0\n1,1e6,1.5,0\n", [":3:", "per", "[0, 1)"]),
        ("missing.csv", "t_s,rate_bps,per\n0,1e6,0\n", [":1:", "rtt_s", "missing"]),
        ("unknown.csv", "t_s,rate_bps,per,rtt_s,snr\n0,1e6,0,0,3\n", [":1:", "snr", "unknown"]),
        ("nan.csv", "t_s,rate_bps,per,rtt_s\n0,fast,0,0\n", [":2:", "rate_bps", "not a number"]),
        ("short.csv", "t_s,rate_bps,per,rtt_s\n0,1e6,0\n", [":2:", "expected 4 fields"]),
        ("order.csv", "t_s,rate_bps,per,rtt_s\n1,1e6,0,0\n1,1e6,0,0\n", [":3:", "t_s", "increasing"]),
        ("empty.csv", "", ["empty"]),
        ("no_rows.csv", "t_s,rate_bps,per,rtt_s\n", ["no samples"]),
        ("bad_rtt.yaml", "samples:\n  - {t_s: 0, rate_bps: 1e6, per: 0, rtt_s: 0}\n"
         "  - {t_s: 1, rate_bps: 1e6, per: 0, rtt_s: -1}\n", [":3:", "rtt_s", ">= 0"]),
        ("no_key.yaml", "trace: []\n", ["samples"]),
        ("scalar.yaml", "- 3\n", [":1:", "mapping"]),
        ("broken.yaml", "samples: [\n", ["invalid YAML"]),
        ("trace.json", "[]", ["unknown trace format", ".json"]),
    ],
)
def test_trace_bad_file_gives_clear_error(tmp_path, name, text, needles):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        ChannelTrace.load(path)
    msg = str(info.value)
    assert name in msg
    for needle in needles:
        assert needle in msg


def test_trace_constructor_validation():
    ch = scenario("20mbps_5ms")
    with pytest.raises(ValueError, match="strictly increasing"):
        ChannelTrace([0.0, 0.0], [ch, ch])
    with pytest.raises(ValueError, match="at least one"):
        ChannelTrace([], [])
    with pytest.raises(ValueError, match="length"):
        ChannelTrace([0.0], [ch, ch])


# --------------------------------------------------------------------------- compute model


def test_forward_flops_hand_computed():
    shape = ModelShape(n_layers=1, d_model=2, d_ff=4, vocab=10)
    # 1 * (8*4 + 6*2*4 + 4*1*2) + 2*2*10 = 32 + 48 + 8 + 40
    assert forward_flops(shape, 1, 0) == 128.0
    plain = ModelShape(n_layers=1, d_model=2, d_ff=4, vocab=10, gated_mlp=False)
    assert forward_flops(shape, 1, 0) - forward_flops(plain, 1, 0) == 2 * 2 * 4


def test_forward_flops_attention_term_and_block_consistency():
    shape = ModelShape(n_layers=32, d_model=4096, d_ff=14336, vocab=128256)
    # Each extra context position costs c3 * N * d = 4 * 32 * 4096 per new token.
    assert forward_flops(shape, 1, 100) - forward_flops(shape, 1, 0) == 4 * 32 * 4096 * 100
    # A block of K tokens costs the same as K single-token passes at growing context.
    k, ctx = 8, 500
    singles = sum(forward_flops(shape, 1, ctx + j) for j in range(k))
    assert forward_flops(shape, k, ctx) == pytest.approx(singles, rel=1e-12)
    # 8B-class model: about 2 * params FLOPs per token (~16 GFLOP incl. LM head).
    assert 1.2e10 < forward_flops(shape, 1, 0) < 2.0e10


def test_compute_time():
    assert compute_time_s(1e12, 1e12, 0.5) == pytest.approx(2.0)
    assert compute_time_s(0.0, 1e12, 0.3) == 0.0
    with pytest.raises(ValueError, match="efficiency"):
        compute_time_s(1e9, 1e12, 0.0)
    with pytest.raises(ValueError, match="peak_flops"):
        compute_time_s(1e9, 0.0, 0.5)
    with pytest.raises(ValueError, match="d_model"):
        ModelShape(n_layers=1, d_model=0, d_ff=1, vocab=1)


def test_tau_schedule_parses_names_errors_and_picks_the_nearest_scenario():
    from wisv_ros.link.channel import SCENARIOS, ChannelState, TauSchedule

    s = TauSchedule.parse("20mbps_5ms:0.05, 20mbps_50ms:0.1,500mbps_5ms:0.02,500mbps_50ms:0.08")
    for name, state in SCENARIOS.items():
        assert s.nearest(state) == name
    assert s.tau_for(ChannelState(rate_bps=15e6, per=0.02, rtt_s=0.07)) == 0.1  # a bad link: 20 Mbit/s / 50 ms
    assert s.tau_for(ChannelState(rate_bps=900e6, per=0.0, rtt_s=0.002)) == 0.02
    assert str(TauSchedule.parse(str(s))) == str(s)
    only = TauSchedule.parse("500mbps_5ms:0.3")
    assert only.tau_for(ChannelState(rate_bps=1e6, per=0.2, rtt_s=0.3)) == 0.3  # one entry holds everywhere
    for text, err in [("", "no scenario"), ("5g:0.1", "unknown channel scenario '5g'"), ("20mbps_5ms", "not <scenario>:<tau>"),
                      ("20mbps_5ms:x", "not a number"), ("20mbps_5ms:-1", "finite number >= 0"),
                      ("20mbps_5ms:nan", "finite number >= 0"), ("20mbps_5ms:1,20mbps_5ms:2", "given twice")]:
        with pytest.raises(ValueError, match=err):
            TauSchedule.parse(text)
