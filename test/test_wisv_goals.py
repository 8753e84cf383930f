"""WISV's goal checks on a whole data set (eval.wisv_goals, `evaluate report`) and `evaluate tokenwise`
on real weights."""
from __future__ import annotations

import csv
import json
import shutil

import pytest
import torch

from wisv_ros.cli import evaluate
from wisv_ros.eval.replay import replay_greedy
from wisv_ros.eval.tokenwise import decode_tokenwise
from wisv_ros.eval.wisv_goals import goal_rows, goals_markdown, paired_net, parse_system, scenario_order
from wisv_ros.sd.lm import CausalLM
from wisv_ros.sd.models import load_model
from wisv_ros.sd.roundlog import RoundLog, read_round_log

N = 40


def test_paired_net_counts_flips_and_bounds_the_net():
    ref = {f"p{i}": int(i < 6) for i in range(10)}  # right on p0..p5
    sys_ = dict(ref, p0=0, p1=0, p7=1)  # two lost, one gained
    out = paired_net(ref, sys_, n_boot=2000)
    assert (out["problems"], out["lost"], out["gained"], out["net"]) == (10, 2, 1, 1)
    assert -3 <= out["net_lo"] < 1 < out["net_hi"] <= 5
    same = paired_net(ref, ref)
    assert (same["net"], same["net_lo"], same["net_hi"]) == (0, 0.0, 0.0)
    with pytest.raises(ValueError, match="no problem in common"):
        paired_net(ref, {"x": 1})


def test_system_names_and_channel_order():
    assert parse_system("wisv_k32_tau0.05_20mbps_50ms_qwen") == {"kind": "wisv", "k": 32, "tau": 0.05,
                                                                  "channel": "20mbps_50ms", "head": "qwen"}
    assert parse_system("fly_k32_e0.6_w6")["kind"] == "fly" and parse_system("greedy_k8") is None
    order = scenario_order(8, 896, 0.1)
    # The RTT weighs most: both 50 ms channels are worse than both 5 ms ones; at one RTT 20 Mbit/s is worse.
    assert order == ["20mbps_50ms", "500mbps_50ms", "20mbps_5ms", "500mbps_5ms"]


def _priced(system, scenario, aal, rounds, ms, problems=2, dep="embedded_default"):
    return {"dataset": "gsm8k", "system": system, "deployment": dep, "scenario": scenario, "problems": problems,
            "aal": aal, "round_trips": rounds, "ms_per_token": ms}


def test_goal_rows_compare_each_system_on_its_own_channel():
    priced = [_priced("greedy_k8", sc, 5.0, 40, 100.0) for sc in ("20mbps_50ms", "500mbps_5ms")]
    priced += [_priced("wisv_k8_tau0.1_20mbps_50ms_h", sc, 7.5, 26, 80.0) for sc in ("20mbps_50ms", "500mbps_5ms")]
    priced += [_priced("wisv_k8_tau0.05_500mbps_5ms_h", "500mbps_5ms", 6.0, 34, 95.0)]
    priced += [_priced("wisv_k8_tau0.1_500mbps_5ms_h", "500mbps_5ms", 6.0, 34, 95.0)]
    priced += [_priced("wisv_k8_tau0.2_20mbps_50ms_h", "20mbps_50ms", 9.0, 20, 70.0, problems=1)]  # under way
    ref = {"a": 1, "b": 0}
    correct = {"wisv_k8_tau0.1_20mbps_50ms_h": {"a": 1, "b": 1}, "wisv_k8_tau0.05_500mbps_5ms_h": {"a": 0, "b": 0},
               "wisv_k8_tau0.1_500mbps_5ms_h": {"a": 1, "b": 0}, "wisv_k8_tau0.2_20mbps_50ms_h": {"a": 1}}
    rows = goal_rows(priced, correct, ref, "gsm8k")
    by = {r["system"]: r for r in rows}
    assert len(rows) == 4  # each WISV system only on its own channel
    bad = by["wisv_k8_tau0.1_20mbps_50ms_h"]
    assert bad["scenario"] == "20mbps_50ms" and bad["aal_gain"] == pytest.approx(0.5)
    assert bad["rounds_change"] == pytest.approx(-0.35) and bad["latency_change"] == pytest.approx(-0.2)
    assert (bad["lost"], bad["gained"], bad["net"]) == (0, 1, -1)
    assert by["wisv_k8_tau0.05_500mbps_5ms_h"]["net"] == 1
    md = goals_markdown(rows, 896, 0.1)
    assert "wisv_k8_tau0.1_20mbps_50ms_h at 20mbps_50ms: AAL +50.0 %" in md and "**met**" in md
    # tau 0.1: 7.5 on the worse channel, 6.0 on the better one; tau 0.05 alone on its channel is no order
    assert "tau 0.1, from the worst channel to the best (20mbps_50ms, 500mbps_5ms): 7.50, 6.00: **in the order" in md
    assert "tau 0.05, from" not in md and "tau 0.2, from" not in md
    # a run on 1 of 2 problems is reported, not judged
    assert "wisv_k8_tau0.2_20mbps_50ms_h at 20mbps_50ms: AAL +80.0 %" in md and "**partial: 1 of 2 problems**" in md
    assert "below greedy SD at the same K in 4 of 4" in md


@pytest.fixture(scope="module")
def tiny():
    return CausalLM(load_model("tiny-random:0:16")[0]), CausalLM(load_model("tiny-random:0:16:0.05")[0])


def test_report_checks_wisv_goals_from_decoded_logs(tmp_path, tiny):
    """`evaluate report` over a run folder holding the target alone's traces (greedy replayed at K 4)
    and a WISV system decoded token-wise: wisv_goals.csv, wisv_protocols.csv, the plot and the section."""
    target, drafter = tiny
    base = tmp_path / "runs" / "gsm8k"
    (base / "rounds").mkdir(parents=True)
    prompts = {"p0": [5, 9, 12, 3], "p1": [3, 1, 4, 1, 5, 9, 2, 6] * 3}
    traces = [decode_tokenwise(drafter, target, ids, k=4, max_new_tokens=N, request_id=pid).trace for pid, ids in prompts.items()]
    for system, k in (("target_only", None), ("greedy_k4", 4)):
        with RoundLog(base / "rounds" / f"{system}.jsonl", vocab_size=16, hidden_dim=32) as log:
            for t in traces:
                for r in (evaluate.target_only_records(t) if k is None else replay_greedy(t, k, max_new_tokens=N).records):
                    log(r)
    (base / "problems.csv").write_text("id,tokens,correct\np0,40,1\np1,40,0\n")
    (base / "config.json").write_text(json.dumps({"target": "qwen2.5-coder-1.5b-instruct",
                                                  "drafter": "qwen2.5-coder-0.5b-instruct", "max_new_tokens": N}))

    def judge(hd, positions, ht):
        return torch.full((len(positions),), 0.0)  # accepts every mismatch

    name = "wisv_k4_tau0.1_20mbps_50ms_h"
    with RoundLog(base / "rounds" / f"{name}.jsonl", vocab_size=16, hidden_dim=32) as log:
        for pid, ids in prompts.items():
            for r in decode_tokenwise(drafter, target, ids, k=4, max_new_tokens=N, method="wisv", judge=judge, tau=0.1,
                                      request_id=pid).records:
                log(r)
    (base / f"live_{name}.csv").write_text("id,tokens,rounds,correct,wall_s\np0,40,5,0,1.0\np1,40,5,1,1.0\n")
    results = tmp_path / "results"
    assert evaluate.main(["report", "--dataset", "gsm8k", "--out", str(tmp_path / "runs"), "--results", str(results),
                          "--readme", "", "--bootstrap", "50"]) == 0
    goals = list(csv.DictReader(open(results / "wisv_goals.csv")))
    assert {(r["system"], r["scenario"]) for r in goals} == {(name, "20mbps_50ms")}
    g = goals[0]
    assert float(g["aal"]) > float(g["greedy_aal"]) and float(g["aal_gain"]) > 0  # every mismatch accepted
    assert float(g["rounds_change"]) < 0 and (g["lost"], g["gained"], g["net"]) == ("1", "1", "0")
    protos = list(csv.DictReader(open(results / "wisv_protocols.csv")))
    assert {r["protocol"] for r in protos} == {"fh", "sh", "adaptive"}
    ms = {(r["deployment"], r["protocol"]): float(r["ms_per_token"]) for r in protos}
    for dep in {r["deployment"] for r in protos}:  # adaptive takes the cheaper of fh and sh in every round
        assert ms[(dep, "adaptive")] <= min(ms[(dep, "fh")], ms[(dep, "sh")]) + 1e-6
    summary = (results / "summary.md").read_text()
    assert "## WISV against its goals" in summary and "net answers lost 0" in summary
    assert (results / "wisv_goals.png").is_file()

    # --keep-published: a second system is reported, then its raw data goes; its rows stay in every
    # table (as published), while a plain report holds only what the run folder holds.
    other = "wisv_k4_tau0.2_20mbps_50ms_h"
    shutil.copy(base / "rounds" / f"{name}.jsonl", base / "rounds" / f"{other}.jsonl")
    (base / f"live_{other}.csv").write_text("id,tokens,rounds,correct,wall_s\np0,40,5,1,1.0\np1,40,5,1,1.0\n")
    report = ["report", "--dataset", "gsm8k", "--out", str(tmp_path / "runs"), "--results", str(results),
              "--readme", "", "--bootstrap", "50"]
    assert evaluate.main(report) == 0
    tables = ("summary.csv", "accuracy.csv", "wisv_goals.csv", "wisv_protocols.csv")
    published = {t: list(csv.DictReader(open(results / t))) for t in tables}
    assert {r["system"] for r in published["wisv_goals.csv"]} == {name, other}
    (base / "rounds" / f"{other}.jsonl").unlink()
    (base / f"live_{other}.csv").unlink()
    assert evaluate.main([*report, "--keep-published"]) == 0
    for t in tables:
        kept = [r for r in csv.DictReader(open(results / t)) if r["system"] == other]
        assert kept and kept == [r for r in published[t] if r["system"] == other], t
        assert len(list(csv.DictReader(open(results / t)))) == len(published[t]), t
    assert f"{other} at 20mbps_50ms" in (results / "summary.md").read_text()
    assert [r["system"] for r in csv.DictReader(open(results / "accuracy.csv"))][0].startswith("target greedy")
    assert evaluate.main(report) == 0
    for t in tables:
        assert other not in {r["system"] for r in csv.DictReader(open(results / t))}, t


def test_evaluate_tokenwise_on_real_weights_writes_resumes_and_checks(tmp_path, capsys):
    """The default pair on llama.cpp, 2 GSM8K problems, 12 tokens: greedy writes the target alone's replay
    traces; wisv with the shipped head writes a CSV row, a round log and the answer per problem, and
    skips them on a rerun."""
    common = ["--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", "12", "--out", str(tmp_path)]
    assert evaluate.main(["tokenwise", "--method", "greedy", *common]) == 0
    traces = [json.loads(line) for line in open(tmp_path / "gsm8k" / "traces.jsonl")]
    assert [t["id"] for t in traces] == ["gsm8k-test-0013", "gsm8k-test-0051"]
    assert all(len(t["target_ids"]) == 12 and len(t["draft_ids"]) == 13 for t in traces)
    assert json.loads((tmp_path / "gsm8k" / "config.json").read_text())["decoder"] == "tokenwise"
    wisv = ["tokenwise", "--method", "wisv", "--head", "config/heads/qwen.onnx", "--k", "8",
            "--tau-per-channel", "20mbps_50ms:0.3,500mbps_5ms:0.01", "--channel", "20mbps_50ms", *common]
    assert evaluate.main(wisv) == 0
    name = "wisv_k8_tau0.3_20mbps_50ms_qwen"  # the tau of the scenario nearest the channel
    rows = list(csv.DictReader(open(tmp_path / "gsm8k" / f"live_{name}.csv")))
    recs = list(read_round_log(tmp_path / "gsm8k" / "rounds" / f"{name}.jsonl"))
    answers = [json.loads(line) for line in open(tmp_path / "gsm8k" / "answers" / f"{name}.jsonl")]
    assert [r["id"] for r in rows] == [a["id"] for a in answers] == ["gsm8k-test-0013", "gsm8k-test-0051"]
    for r in rows:
        mine = [x for x in recs if x.request_id == r["id"]]
        assert len(mine) == int(r["rounds"]) and sum(x.committed for x in mine) == int(r["tokens"]) == 12
        assert all(x.method == "wisv" and x.tau == 0.3 and x.hidden_dim == 896 for x in mine)
    assert evaluate.main(wisv) == 0  # resumed: nothing new
    assert len(list(read_round_log(tmp_path / "gsm8k" / "rounds" / f"{name}.jsonl"))) == len(recs)
    with pytest.raises(SystemExit):
        evaluate.main(["tokenwise", "--method", "wisv", "--head", "config/heads/qwen.onnx", "--tau-per-channel", "mars:0.1"])
    assert "unknown channel scenario 'mars'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["tokenwise", "--method", "wisv"])
    assert "--method wisv needs --head" in capsys.readouterr().err
