"""python -m wisv_ros.cli.system_bench end to end with tiny models: real node graphs (direct and
through the link emulator), every configuration, the in-process baselines, CSV and plot."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

pytest.importorskip("rclpy")


def test_system_bench_runs_the_graph_and_accounts_the_link(tmp_path):
    import torch

    from wisv_ros.wisv.head_training import DecisionHead, export_onnx

    torch.manual_seed(0)
    head = tmp_path / "head.onnx"
    export_onnx(DecisionHead(32, 32, hidden=8).eval(), head)
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "wisv_ros.cli.system_bench", "--drafter", "tiny-random:0:64:0.05",
           "--target", "tiny-random:0:64", "--target-dtype", "float32", "--prompt", "5 9 12 3",
           "--max-new-tokens", "24", "--k", "4", "--min-confidence", "0", "--scenarios", "direct,20mbps_5ms",
           "--configs", "greedy,fh,sh", "--tau", "0.5,2.0", "--head", f"rnd={head}",
           "--out", str(out), "--wait", "120", "--timeout", "120"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = list(csv.DictReader(open(out / "summary.csv")))
    assert {(r["scenario"], r["config"], r["tau"]) for r in summary} == {
        (s, c, t) for s in ("direct", "20mbps_5ms")
        for c, t in [("greedy", "nan"), ("fh", "0.5"), ("fh", "2.0"), ("sh", "0.5"), ("sh", "2.0"),
                     ("target_stream", "nan"), ("colocated", "nan")]}
    assert {r["head"] for r in summary if r["config"] in ("greedy", "fh", "sh")} == {"rnd"}
    # Every goal's rounds are in the verifier's round log, and the cost model priced them.
    rows = list(csv.DictReader(open(out / "rows.csv")))
    nodes = [r for r in rows if r["config"] in ("greedy", "fh", "sh")]
    assert nodes and all(float(r["log_rounds"]) == float(r["rounds"]) for r in nodes), [(r["rounds"], r["log_rounds"]) for r in nodes]
    assert all(0 < float(r["model_ms_per_token"]) <= float(r["ms_per_token"]) * 1.05 for r in nodes)
    print("model_error", [(r["scenario"], r["config"], round(float(r["model_error"]), 3)) for r in nodes])
    # tau 2.0 accepts every draft: more tokens per round than tau 0.5 with the same head.
    for s in ("direct", "20mbps_5ms"):
        aal = {r["tau"]: float(r["aal"]) for r in summary if r["scenario"] == s and r["config"] == "fh"}
        assert aal["2.0"] > aal["0.5"]
    rows = {(r["scenario"], r["config"]): r for r in summary if r["tau"] in ("nan", "0.5")}
    f = {key: {k: float(v) for k, v in r.items() if k not in ("scenario", "config", "head")} for key, r in rows.items()}
    for s in ("direct", "20mbps_5ms"):
        assert all(f[(s, c)]["tokens"] == 24 for c in ("greedy", "fh", "sh", "target_stream", "colocated"))
        assert f[(s, "fh")]["up_B"] > f[(s, "greedy")]["up_B"] + 3 * 32 * 2  # K hiddens ride on each block
        assert f[(s, "sh")]["down_B"] > f[(s, "greedy")]["down_B"]  # hidden requests went down
        assert f[(s, "target_stream")]["rounds"] == 24  # one token per target pass
    assert f[("direct", "greedy")]["nominal_ms"] == pytest.approx(0.0, abs=1e-3)
    # 5 ms RTT per exchange: the link time of a round is at least the emulated delay, and SH's
    # hidden exchanges add RTTs to its nominal delay.
    for c in ("greedy", "fh", "sh"):
        link = f[("20mbps_5ms", c)]
        assert link["nominal_ms"] >= 5.0 and link["link_ms"] >= 0.9 * link["nominal_ms"]
        assert link["overhead_ms"] == pytest.approx(link["link_ms"] - link["nominal_ms"], abs=1e-6)
    assert f[("20mbps_5ms", "sh")]["nominal_ms"] > f[("20mbps_5ms", "greedy")]["nominal_ms"] + 1.0
    # The link costs the remote configurations more than the co-located one.
    assert f[("20mbps_5ms", "greedy")]["ms_per_token"] > f[("direct", "greedy")]["ms_per_token"]
    assert (out / "rows.csv").is_file() and (out / "latency_per_token.png").stat().st_size > 1000
    assert (out / "accuracy_latency_vs_tau.png").stat().st_size > 1000


def test_baselines_run_only_what_is_asked(monkeypatch):
    """--baselines target_stream measures the target alone and never runs co-located SD."""
    from types import SimpleNamespace

    from wisv_ros.cli import system_bench
    from wisv_ros.sd import rounds

    def no_sd(*a, **k):
        raise AssertionError("co-located SD ran although only target_stream was asked for")

    monkeypatch.setattr(rounds, "generate", no_sd)
    args = SimpleNamespace(threads=1, target="tiny-random:0:64", drafter="tiny-random:0:64:0.05", target_dtype="float32",
                           k=[4], max_new_tokens=12, min_confidence=0.0)
    rows = system_bench.run_baselines([("5 9 12 3", None)], ["direct", "20mbps_50ms"], args, ("target_stream",))
    assert [(r["scenario"], r["config"]) for r in rows] == [("direct", "target_stream"), ("20mbps_50ms", "target_stream")]
    assert all(r["tokens"] == 12 and r["rounds"] == 12 for r in rows)
    # Same compute, the scenario's RTT added once (prompt up, last token down).
    assert rows[1]["latency_s"] - rows[0]["latency_s"] > 0.05 - 1e-3
