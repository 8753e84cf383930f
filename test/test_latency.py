"""End-to-end latency from a round log (eval.latency, cli.latency): hand-built logs whose latency is hand
arithmetic, profile interpolation, the shipped hardware profiles, bad inputs, and the link emulator's own
cost of an exchange.

The hand-built logs go through ``RoundLog`` (vocab 100, drafter hidden size 8), so a block of 4 drafts with
1 mismatch that commits 3 tokens has: ids up 64 + 4*4 = 80 B, fh up 80 + 4*16 = 144 B, sh hiddens up
64 + 16 = 80 B, dist up 80 + 4*100*2 = 880 B, verdict down 64 + 8 + 3*4 = 84 B, sh request down 64 + 4 = 68 B.
On the channel ``CH`` (16 kbit/s at PER 0.5: 1000 B/s of goodput) a byte costs 1 ms and an exchange 10 ms of RTT.
"""
from __future__ import annotations

import csv
import io
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wisv_ros.cli.latency import COLUMNS
from wisv_ros.eval import latency as L
from wisv_ros.link.channel import ChannelState, ChannelTrace, exchange_time_s, transfer_time_s
from wisv_ros.link.emulator import Direction, LinkEmulator
from wisv_ros.sd.roundlog import RoundLog, RoundRecord, read_round_log

REPO = Path(__file__).resolve().parents[1]
CH = ChannelState(rate_bps=16000, per=0.5, rtt_s=0.01)
MEASURED = L.MeasuredCompute()

PROFILE = {
    "devices": {
        "dev": {"description": "test device", "models": {
            "tgt": {"token_s": {"value": 0.1, "kind": "measured", "source": "a.csv; python -m x"},
                    "block_s": {2: {"value": 0.15, "kind": "measured", "source": "a.csv; python -m x"},
                                4: {"value": 0.25, "kind": "published", "source": "https://example.org/bench"},
                                8: {"value": 0.45, "kind": "derived", "source": "a.csv", "formula": "0.25 + 4 x 0.05"}}},
            "dft": {"token_s": {"value": 0.02, "kind": "measured", "source": "a.csv; python -m x"},
                    "block_s": {2: {"value": 0.03, "kind": "measured", "source": "a.csv; python -m x"},
                                8: {"value": 0.09, "kind": "measured", "source": "a.csv; python -m x"}}}}}},
    "deployments": {"d": {"drafter": "dft", "target": "tgt", "robot": "dev", "edge": "dev"}},
}


def _log(*records: RoundRecord, vocab_size: int = 100, hidden_dim: int = 8) -> list[RoundRecord]:
    """The records as a RoundLog writes them (payload bytes filled in) and reads them back."""
    buf = io.StringIO()
    with RoundLog(buf, vocab_size=vocab_size, hidden_dim=hidden_dim) as log:
        for rec in records:
            log(rec)
    return list(read_round_log(buf.getvalue().splitlines()))


def _block(rid="r", round_id=0, method="greedy", protocol="ids", tau=0.0, mismatches=(2,), prefix=0, **kw) -> RoundRecord:
    fields = dict(k=4, drafted=4, accepted=2, committed=3, target_tokens=5, draft_time_s=0.05, target_time_s=0.1) | kw
    return RoundRecord(rid, round_id, "block", method, protocol=protocol, tau=tau, prefix_length=prefix,
                       mismatches=list(mismatches), **fields)


def _profiles(tmp_path, data=PROFILE) -> L.Profiles:
    path = tmp_path / "profiles.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return L.load_profiles(path)


def _latency(records, protocol="logged", compute=MEASURED, channel=CH, **kw) -> float:
    (row,) = L.request_rows(records, channel, compute, protocol=protocol, **kw)
    return row["latency_s"]


# --------------------------------------------------------------------------- communication, by hand


def test_the_logged_bytes_are_the_ones_the_arithmetic_below_uses():
    (rec,) = _log(_block())
    assert (rec.up_bytes_ids, rec.up_bytes_fh, rec.up_bytes_sh, rec.up_bytes_dist) == (80, 144, 160, 880)
    assert (rec.down_bytes, rec.down_bytes_sh) == (84, 68)


@pytest.mark.parametrize("protocol, comm", [
    ("ids", 0.010 + 0.080 + 0.084),
    ("fh", 0.010 + 0.144 + 0.084),
    ("dist", 0.010 + 0.880 + 0.084),
    ("sh", 0.010 + 0.080 + 0.084),  # greedy: the edge never asks for hiddens, sh is ids
])
def test_one_block_round_costs_compute_plus_one_exchange(protocol, comm):
    records = _log(_block())
    assert _latency(records, protocol) == pytest.approx(0.05 + 0.1 + comm)


def test_sh_pays_its_second_exchange_only_when_the_edge_needed_hiddens():
    wisv = _log(_block(method="wisv", tau=0.5))
    two_exchanges = (0.010 + 0.080 + 0.068) + (0.010 + 0.080 + 0.084)  # ids up, request down; hiddens up, verdict down
    assert _latency(wisv, "sh") == pytest.approx(0.15 + two_exchanges)
    # tau 0 (greedy verification) or no mismatch: the verdict comes back in the first exchange.
    for rec in (_block(method="wisv", tau=0.0), _block(method="wisv", tau=0.5, mismatches=())):
        assert _latency(_log(rec), "sh") == pytest.approx(0.15 + 0.010 + 0.080 + 0.084)


def test_adaptive_takes_the_cheaper_of_fh_and_sh_per_round_and_logged_takes_the_records_protocol():
    needs = _log(_block(method="wisv", tau=0.5, protocol="sh"))
    assert _latency(needs, "adaptive") == pytest.approx(0.15 + 0.010 + 0.144 + 0.084)  # fh 238 ms < sh 332 ms
    assert _latency(needs, "logged") == pytest.approx(0.15 + 0.158 + 0.174)  # it travelled as sh
    clean = _log(_block(method="wisv", tau=0.5, mismatches=(), accepted=4, committed=5))
    verdict = 64 + 8 + 5 * 4
    assert _latency(clean, "adaptive") == pytest.approx(0.15 + 0.010 + 0.080 + verdict / 1000)  # sh = ids 174 < fh 238


def test_the_prompt_rides_in_the_first_block_only():
    records = _log(_block(prefix=10), _block(round_id=1, prefix=13))
    per_round = 0.15 + 0.010 + 0.080 + 0.084
    assert _latency(records, "ids") == pytest.approx(2 * per_round + 10 * 4 / 1000)


def test_copy_rounds_cost_their_target_pass_only_and_are_not_rounds():
    records = _log(_block(), RoundRecord("r", 0, "copy", "greedy", drafted=4, accepted=3, committed=4, target_tokens=9,
                                         copy_candidates=2, target_time_s=0.07))
    (row,) = L.request_rows(records, CH, MEASURED, protocol="ids")
    assert row["latency_s"] == pytest.approx(0.15 + 0.174 + 0.07)
    assert (row["tokens"], row["rounds"], row["copy_rounds"], row["aal"]) == (7, 1, 1, 7.0)
    assert row["comm_s"] == pytest.approx(0.174) and row["compute_s"] == pytest.approx(0.22)


# --------------------------------------------------------------------------- compute from a profile


def test_profile_interpolates_between_sizes_and_extrapolates_past_the_last(tmp_path):
    tgt = _profiles(tmp_path).deployment("d").edge.model("tgt")
    assert [tgt.block(n) for n in (0, 1, 2, 3, 4, 6, 8, 10)] == pytest.approx([0, 0.1, 0.15, 0.2, 0.25, 0.35, 0.45, 0.55])
    # A table with a size-1 entry uses it instead of token_s; a falling last segment is not extrapolated downwards.
    assert L.ModelCost(0.1, ((1, 0.12), (2, 0.2))).block(1) == pytest.approx(0.12)
    assert L.ModelCost(0.1, ((2, 0.3), (4, 0.2))).block(10) == pytest.approx(0.2)


def test_target_only_request_costs_its_prefill_its_passes_and_one_exchange(tmp_path):
    dep = _profiles(tmp_path).deployment("d")
    records = _log(*[RoundRecord("t", i, "target", "target_only", prefix_length=5 + i, committed=1, target_tokens=5 if i == 0 else 1,
                                 target_time_s=0.5) for i in range(4)])
    (row,) = L.request_rows(records, CH, L.ProfileCompute(dep))
    exchange = 0.010 + (64 + 5 * 4) / 1000 + (64 + 8 + 4 * 4) / 1000  # prompt up, 4 tokens down
    expected = 0.30 + 3 * 0.1 + exchange  # block(5) = 0.25 + 0.2 / 4
    assert (row["method"], row["protocol"], row["rounds"], row["tokens"]) == ("target_only", "-", 4, 4)
    assert row["latency_s"] == pytest.approx(expected)
    # The target-alone baseline of the same tokens is this very cost, and so is both_on_edge (no drafter).
    assert row["target_alone_s"] == pytest.approx(expected) and row["both_on_edge_s"] == pytest.approx(expected)
    # Measured: the logged pass times instead of the profile.
    (measured,) = L.request_rows(records, CH, MEASURED)
    assert measured["latency_s"] == pytest.approx(4 * 0.5 + exchange)
    assert measured["compute"] == "measured" and row["compute"] == "projected (profile d)"


def test_sd_request_from_a_profile_and_its_two_baselines(tmp_path):
    dep = _profiles(tmp_path).deployment("d")
    records = _log(_block(prefix=6, head_time_s=0.003))
    (row,) = L.request_rows(records, CH, L.ProfileCompute(dep), protocol="ids")
    drafter_prefill, draft, target = 0.07, 4 * 0.02, 0.30  # dft.block(6) = 0.03 + 4/6 x 0.06; tgt.block(5)
    link = 0.010 + (80 + 6 * 4) / 1000 + 0.084
    assert row["latency_s"] == pytest.approx(drafter_prefill + draft + target + 0.003 + link)
    request_exchange = 0.010 + (64 + 6 * 4) / 1000 + (64 + 8 + 3 * 4) / 1000
    assert row["target_alone_s"] == pytest.approx(request_exchange + 0.35 + 2 * 0.1)  # prefill block(6), then 2 passes
    assert row["both_on_edge_s"] == pytest.approx(request_exchange + drafter_prefill + draft + target + 0.003)
    assert row["baseline_compute"] == "projected (profile d)"


def test_measured_compute_gets_baselines_only_from_a_deployment(tmp_path):
    records = _log(_block())
    (row,) = L.request_rows(records, CH, MEASURED)
    assert math.isnan(row["target_alone_s"]) and row["baseline_compute"] == ""
    (row,) = L.request_rows(records, CH, MEASURED, baseline=_profiles(tmp_path).deployment("d"))
    assert row["target_alone_s"] == pytest.approx(0.010 + 0.064 + 0.084 + 0.0 + 2 * 0.1)  # prompt 0: no prefill


# --------------------------------------------------------------------------- channels


def test_a_trace_is_read_at_each_exchange_on_a_clock_that_runs_across_requests():
    slow = ChannelState(rate_bps=8000, per=0.5, rtt_s=0.02)  # 2 ms a byte
    trace = ChannelTrace([0.0, 0.3], [CH, slow])
    records = _log(_block(rid="a"), _block(rid="b"))
    a, b = L.request_rows(records, trace, MEASURED, protocol="ids")
    assert a["latency_s"] == pytest.approx(0.324)  # exchange at t = 0.05: fast
    assert b["latency_s"] == pytest.approx(0.15 + 0.02 + 2 * 0.164)  # starts at 0.324, exchange at 0.374: slow
    # A scenario name works as a channel.
    (row,) = L.request_rows(_log(_block()), "20mbps_5ms", MEASURED, protocol="ids")
    assert row["comm_s"] == pytest.approx(exchange_time_s(80, 84, L.scenario("20mbps_5ms")))


def test_one_exchange_costs_what_the_link_emulator_delivers():
    """The latency model charges an exchange what ``link.emulator.LinkEmulator`` takes to deliver it.

    The emulator has no pure function for a message's delay (``send`` is a stateful, seeded simulation),
    so the messages of a round are driven through it: without loss its delivery times are deterministic
    and must equal the round's latency exactly (fh: one exchange; sh: two, around the target pass). Under
    loss the emulator also waits a retransmission timeout after every lost packet, which the mean-cost model
    (``exchange_time_s``, used here) leaves out; what both share, the transmitter time of a message, must agree
    on average with ``transfer_time_s``.
    """
    lossless = ChannelState(rate_bps=16000, per=0.0, rtt_s=0.01)
    for method, protocol, messages in (("greedy", "fh", [(144, "up"), (84, "down")]),
                                       ("wisv", "sh", [(80, "up"), (68, "down"), (80, "up"), (84, "down")])):
        records = _log(_block(method=method, tau=0.5))
        emu = LinkEmulator(lossless, mtu_bytes=50)  # several packets per message
        t = 0.05  # the drafter's time
        for i, (n, way) in enumerate(messages):
            t = emu.send(n, t, Direction.UPLINK if way == "up" else Direction.DOWNLINK).deliver_at
            if i == 0:
                t += 0.1  # the target pass between the block's arrival and the first reply
        assert _latency(records, protocol, channel=lossless) == pytest.approx(t, abs=1e-12), protocol
    lossy = ChannelState(rate_bps=1e6, per=0.2, rtt_s=0.01)
    emu = LinkEmulator(lossy, mtu_bytes=100, seed=3)
    attempts = [emu.send(1000, 10.0 * i, "uplink").attempts for i in range(2000)]  # 10 packets of 100 B each
    on_air = [a * 8 * 100 / lossy.rate_bps for a in attempts]
    assert sum(on_air) / len(on_air) == pytest.approx(transfer_time_s(1000, lossy.rate_bps, lossy.per), rel=0.02)


# --------------------------------------------------------------------------- bad inputs


def test_fh_without_a_hidden_size_says_which_field_and_how_to_fix_it():
    records = _log(_block(), hidden_dim=0)
    with pytest.raises(ValueError, match=r"hidden_dim is 0.*--hidden-dim"):
        L.request_rows(records, CH, MEASURED, protocol="fh")
    with pytest.raises(ValueError, match="hidden_dim"):
        L.request_rows(_log(_block(method="wisv", tau=0.5), hidden_dim=0), CH, MEASURED, protocol="sh")
    assert _latency(records, "sh") == pytest.approx(0.324)  # greedy sh sends no hiddens: fine without it
    # The override recomputes the bytes: 16 fp16 values per hidden.
    assert _latency(records, "fh", hidden_dim=16) == pytest.approx(0.15 + 0.010 + (80 + 4 * 32) / 1000 + 0.084)


def test_bad_logs_name_what_is_wrong():
    with pytest.raises(ValueError, match="no records"):
        L.request_rows([], CH, MEASURED)
    with pytest.raises(ValueError, match=r"request r, round 0.*protocol 'xyz'"):
        L.request_rows(_log(_block(protocol="xyz")), CH, MEASURED)
    with pytest.raises(ValueError, match="vocab_size"):
        L.request_rows(_log(_block(), vocab_size=0), CH, MEASURED, protocol="dist")
    with pytest.raises(ValueError, match="protocol must be one of"):
        L.request_rows(_log(_block()), CH, MEASURED, protocol="carrier-pigeon")


def _broken(path: tuple, value) -> dict:
    data = yaml.safe_load(yaml.safe_dump(PROFILE))
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


@pytest.mark.parametrize("path, value, message", [
    (("devices", "dev", "models", "tgt", "token_s", "source"), None, r"devices\.dev\.models\.tgt\.token_s: missing field\(s\) source"),
    (("devices", "dev", "models", "tgt", "block_s", 2, "value"), -0.1, r"block_s\.2\.value: negative time"),
    (("devices", "dev", "models", "tgt", "block_s", 8, "formula"), None, r"block_s\.8\.formula: a derived number needs"),
    (("devices", "dev", "models", "tgt", "block_s", 4, "source"), "a blog", r"block_s\.4\.source: a published number needs the URL"),
    (("devices", "dev", "models", "tgt", "token_s", "kind"), "guessed", r"token_s\.kind: 'guessed' is not one of"),
    (("devices", "dev", "models", "tgt", "token_s"), 0.1, r"token_s: expected \{value, kind, source\}"),
    (("deployments", "d", "edge"), "nope", r"deployments\.d\.edge: unknown device 'nope'"),
    (("deployments", "d", "drafter"), "other", r"deployments\.d\.robot: device dev has no figures for other"),
])
def test_bad_profiles_name_the_field(tmp_path, path, value, message):
    with pytest.raises(L.ProfileError, match=message):
        _profiles(tmp_path, _broken(path, value))


# --------------------------------------------------------------------------- the shipped profiles


def _numbers(node, where=""):
    """Every {value, ...} mapping of a profile tree, with its path."""
    if isinstance(node, dict) and "value" in node:
        yield where, node
    elif isinstance(node, dict):
        for key, sub in node.items():
            yield from _numbers(sub, f"{where}.{key}" if where else str(key))


def test_the_shipped_profiles_load_and_every_number_says_where_it_comes_from():
    path = REPO / "config" / "hardware_profiles.yaml"
    profiles = L.load_profiles(path)
    assert {"embedded_default", "orin_robot_l4_edge"} <= set(profiles.deployments)
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    numbers = list(_numbers(raw["devices"]))
    assert len(numbers) >= 20
    for where, entry in numbers:
        assert entry["kind"] in L.KINDS and entry["source"].strip(), where
        if entry["kind"] == "measured":  # a file of this repo and the command that wrote it
            assert (REPO / entry["source"].split()[0]).is_file() and "python -m " in entry["source"], where
        elif entry["kind"] == "published":
            assert "https://" in entry["source"], where
        else:
            assert entry["formula"].strip(), where
    edge = profiles.deployment("orin_robot_l4_edge")
    assert edge.robot.name != edge.edge.name and {edge.drafter, edge.target} <= set(edge.edge.models)


def test_this_machine_profile_is_the_measured_engine_rows():
    rows = list(csv.DictReader((REPO / "docs" / "engines" / "rows.csv").open(encoding="utf-8")))
    llama = {(r["part"], int(r["k"])): float(r["value"]) for r in rows if r["engine"] == "llama_cpp"}
    dev = L.load_profiles().devices["this_machine_llama_cpp"]
    target, drafter = dev.model("qwen2.5-coder-1.5b-instruct"), dev.model("qwen2.5-coder-0.5b-instruct")
    assert target.token_s == pytest.approx(llama[("decode", 0)] / 1e3)
    assert drafter.token_s == pytest.approx(llama[("draft_decode", 0)] / 1e3)
    for (part, k), ms in llama.items():
        if part == "block":  # engine_bench's block K is one pass over K + 1 tokens
            assert dict(target.block_s)[k + 1] == pytest.approx(ms / 1e3), k


# --------------------------------------------------------------------------- aggregate and CLI


def test_summary_is_total_tokens_over_total_time_with_a_bootstrap_ci():
    records = _log(_block(rid="a"), _block(rid="b", draft_time_s=0.35), _block(rid="c", draft_time_s=0.65))
    rows, agg = L.latency_report(records, CH, MEASURED, protocol="ids", n_boot=200, seed=1)
    total = sum(r["latency_s"] for r in rows)
    assert total == pytest.approx(0.324 * 3 + 0.3 + 0.6)
    assert (agg["requests"], agg["tokens"], agg["rounds"], agg["aal"]) == (3, 9, 3, 3.0)
    assert agg["ms_per_token"] == pytest.approx(1e3 * total / 9) and agg["tokens_per_s"] == pytest.approx(9 / total)
    assert agg["ms_per_token_lo"] < agg["ms_per_token"] < agg["ms_per_token_hi"]
    again = L.latency_report(records, CH, MEASURED, protocol="ids", n_boot=200, seed=1)[1]
    assert (again["ms_per_token_lo"], again["ms_per_token_hi"]) == (agg["ms_per_token_lo"], agg["ms_per_token_hi"])  # seeded
    assert math.isnan(agg["target_alone_ms_per_token"])  # measured compute, no deployment: no baseline
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    lo, hi = L.bootstrap_ci([1.0, 2.0, 3.0, 4.0], mean, n=2000, seed=0)
    assert 1.0 <= lo < 2.5 < hi <= 4.0 and L.bootstrap_ci([2.0] * 5, mean) == (2.0, 2.0)


def test_cli_prints_the_projection_and_writes_the_csv(tmp_path):
    log = tmp_path / "rounds.jsonl"
    with RoundLog(log, vocab_size=100, hidden_dim=8) as writer:
        for rid in ("a", "b"):
            writer(_block(rid=rid, prefix=6))
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text(yaml.safe_dump(PROFILE), encoding="utf-8")
    out = tmp_path / "latency.csv"
    cmd = [sys.executable, "-m", "wisv_ros.cli.latency", str(log), "--rate-bps", "16000", "--per", "0.5", "--rtt-s", "0.01",
           "--profiles", str(profiles), "--profile", "d", "--protocol", "ids", "--bootstrap", "50", "--csv", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "projected (profile d)" in res.stdout and "target_alone" in res.stdout
    with out.open(encoding="utf-8") as f:
        reader = csv.DictReader(f)
        (row,) = list(reader)
    assert reader.fieldnames == COLUMNS
    per_request = 0.07 + 0.08 + 0.30 + (0.010 + 0.104 + 0.084)  # as in test_sd_request_from_a_profile_and_its_two_baselines
    assert float(row["ms_per_token"]) == pytest.approx(1e3 * per_request / 3)
    assert float(row["target_alone_ms_per_token"]) == pytest.approx(1e3 * (0.182 + 0.35 + 0.2) / 3)
    assert (row["channel"], row["method"], row["protocol"], row["requests"], row["tokens"]) == ("custom", "greedy", "ids", "2", "6")
    assert row["compute"] == row["baseline_compute"] == "projected (profile d)"
    bad = subprocess.run(cmd[:-2] + ["--profile", "nope"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 1 and "unknown deployment 'nope'" in bad.stderr
