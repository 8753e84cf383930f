"""The tau-selection tool: the pick rule, the parameter-file rewrite, and a run on real small models."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from wisv_ros.cli.select_tau import main, pick_tau, write_tau

ROOT = Path(__file__).resolve().parents[1]


def test_pick_is_the_largest_tau_within_the_budget():
    results = [{"tau": 0.2, "accuracy": 0.80}, {"tau": 0.5, "accuracy": 0.795}, {"tau": 0.8, "accuracy": 0.70}]
    assert pick_tau(results, 0.80, 1.0) == 0.5  # 0.5 points down: in; 10 points: out
    assert pick_tau(results, 0.80, 10.0) == 0.8
    assert pick_tau(results, 0.90, 1.0) == 0.0  # nothing within the budget: greedy
    assert pick_tau([{"tau": 0.3, "accuracy": 0.85}], 0.80, 0.0) == 0.3  # better than the reference


def test_write_tau_keeps_the_comments(tmp_path):
    path = tmp_path / "drafter.yaml"
    shutil.copy(ROOT / "config" / "drafter.yaml", path)
    before = path.read_text()
    write_tau(path, 0.35)
    after = path.read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(changed) == 1 and "tau: 0.35" in changed[0][1] and "# default WISV threshold" in changed[0][1]
    assert changed[0][1].index("#") == changed[0][0].index("#")  # the comment column is kept
    write_tau(path, 0.123456789)  # a value longer than the gap: one space before the comment
    line = next(ln for ln in path.read_text().splitlines() if "tau:" in ln)
    assert line.split("#")[0].strip() == "tau: 0.123457" and line.index("#") == changed[0][0].index("#")
    (tmp_path / "bad.yaml").write_text("a: 1\n")
    with pytest.raises(SystemExit, match="expected exactly one 'tau:' line, found 0"):
        write_tau(tmp_path / "bad.yaml", 0.1)


def test_select_tau_on_smollm2_and_gemma(tmp_path):
    """Two held-out problems, a random head: runs, reports, and writes the pick into the file."""
    import torch

    from wisv_ros.wisv.head_training import DecisionHead, export_onnx

    torch.manual_seed(0)
    head_path = tmp_path / "head.onnx"
    export_onnx(DecisionHead(576, 640, hidden=16).eval(), head_path)
    cfg = tmp_path / "drafter.yaml"
    shutil.copy(ROOT / "config" / "drafter.yaml", cfg)
    out = tmp_path / "tau"
    argv = ["--drafter", "smollm2-135m-instruct", "--target", "gemma3-270m", "--target-dtype", "float32",
            "--head", str(head_path), "--problems", "2", "--taus", "0.5,2.0", "--max-new-tokens", "12",
            "--k", "4", "--threads", "1", "--budget", "100", "--write", str(cfg), "--out", str(out)]
    # Two shards, one after the other here: the first leaves problem 1 to the second and no report.
    assert main(argv + ["--shard", "0/2"]) == 0
    assert not (out / "report.json").exists() and cfg.read_text() == (ROOT / "config" / "drafter.yaml").read_text()
    assert len((out / "rows.0of2.csv").read_text().splitlines()) == 1 + 3  # problem 0: target, 2 taus
    assert main(argv + ["--shard", "1/2"]) == 0
    assert len((out / "rows.1of2.csv").read_text().splitlines()) == 1 + 3
    report = json.loads((out / "report.json").read_text())
    assert [r["tau"] for r in report["results"]] == [0.5, 2.0]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["rounds"] > 0 for r in report["results"])
    # tau > 1 accepts every draft: at least as many tokens per round as a stricter threshold.
    assert report["results"][1]["aal"] >= report["results"][0]["aal"]
    assert report["tau"] == 2.0  # a 100-point budget admits every tau
    assert "tau: 2" in cfg.read_text() and (out / "accuracy_vs_tau.png").stat().st_size > 1000
    # A rerun finds every answer done: it reports again from the rows and answers nothing anew.
    rows_before = sorted(p.read_text() for p in out.glob("rows*.csv"))
    (out / "report.json").unlink()
    assert main(argv) == 0
    assert json.loads((out / "report.json").read_text())["results"] == report["results"]
    assert sorted(p.read_text() for p in out.glob("rows*.csv")) == rows_before
    # Another setting in the same folder is refused with the field that differs.
    with pytest.raises(SystemExit, match=r"holds results of another setting \(k: 4 there, 8 now\)"):
        main([a if a != "4" else "8" for a in argv])


def test_bad_shard_is_refused_with_the_option(tmp_path, capsys):
    head = tmp_path / "head.onnx"
    head.write_bytes(b"")  # never opened: the options are checked first
    for bad in ("2/2", "1", "a/b"):
        with pytest.raises(SystemExit) as exc:
            main(["--head", str(head), "--shard", bad, "--out", str(tmp_path / "out")])
        assert exc.value.code == 2
        assert f"--shard must be I/N with 0 <= I < N, e.g. 0/2 (got '{bad}')" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written for a refused run
