"""Tests for the copy-mode evaluation CLI (wisv_ros.cli.copy_eval) and the shipped copy probe."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from wisv_ros.cli import copy_eval
from wisv_ros.sd.metrics import DecodeStats
from wisv_ros.switchsd.probe import load_probe
from wisv_ros.switchsd.probe_training import save_probe

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET, TINY_DRAFTER = "tiny-random:0:16", "tiny-random:0:16:0.05"
TINY_D = 32  # hidden size of the tiny-random models
PROMPTS = [("rep/0", [3, 1, 4, 1, 5, 9, 2, 6] * 3, False), ("rep/1", [7, 2, 7, 3, 8, 2, 8] * 3, False)]


def test_humaneval_chat_prompts_wrap_the_stub():
    (pid, prompt, chat), = copy_eval.eval_prompts("humaneval", 1, 0, "chat")
    (pid2, stub, chat2), = copy_eval.eval_prompts("humaneval", 1, 0, "completion")
    assert pid == pid2 == "HumanEval/0" and chat and not chat2
    assert prompt == [{"role": "user", "content": copy_eval.HUMANEVAL_CHAT.format(stub=stub)}]
    assert stub in prompt[0]["content"] and "def has_close_elements" in stub
    (gid, gprompt, gchat), = copy_eval.eval_prompts("gsm8k", 1, 3, "chat")
    assert gchat and gprompt[0]["role"] == "user" and gid == copy_eval.eval_prompts("gsm8k", 4, 0, "chat")[3][0]


def test_counting_gate_counts_calls_and_fires():
    gate = copy_eval.CountingGate(lambda row: float(row[0]) > 0)
    assert [gate(np.array([x])) for x in (1.0, -1.0, 2.0)] == [True, False, True]
    assert (gate.calls, gate.fired) == (3, 2)


def _tiny_probe(tmp_path: Path, threshold: float) -> Path:
    # w = 0: the probability is 0.5 everywhere, so the threshold decides: 0.4 always fires, 0.6 never.
    path = tmp_path / f"probe_{threshold}.npz"
    save_probe(path, np.zeros(TINY_D, np.float32), 1, "post_attn", threshold, meta={"command": "test"})
    return path


def _run(tmp_path, monkeypatch, probe: Path, out: Path, *extra: str) -> int:
    monkeypatch.setattr(copy_eval, "dataset_prompts", lambda ds, limit, offset: PROMPTS[offset:offset + limit])
    # Id prompts for the tokenizer-less tiny models: HumanEval's chat wrapping is not applied.
    return copy_eval.main(["--probe", str(probe), "--dataset", "humaneval", "--out", str(out), "--target", TINY_TARGET,
                           "--drafter", TINY_DRAFTER, "--target-dtype", "float32", "--k", "4", "--kappa", "3",
                           "--min-confidence", "0", "--max-new-tokens", "40", "--humaneval-style", "completion", *extra])


def _summary(out: Path) -> dict[str, dict]:
    with (out / "summary.csv").open() as f:
        return {row["system"]: row for row in csv.DictReader(f)}


def test_cli_runs_all_systems_side_by_side_and_resumes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    assert _run(tmp_path, monkeypatch, _tiny_probe(tmp_path, 0.4), out) == 0
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["id"], r["system"]) for r in records] == [(pid, s) for pid, _, _ in PROMPTS for s in copy_eval.SYSTEMS]
    rows = _summary(out)
    assert list(rows) == list(copy_eval.SYSTEMS)
    for system, row in rows.items():
        assert row["identical"] == "1.0", system  # float32 tiny models: every system is lossless
        assert int(row["prompts"]) == 2 and int(row["tokens"]) == 80
    assert rows["target_only"]["speedup"] == "1.0" and rows["target_only"]["copy_rate"] == ""
    assert int(rows["greedy"]["rounds"]) < 80  # drafted rounds commit more than one token
    assert int(rows["greedy+ngram"]["copy_rounds"]) > 0 and float(rows["greedy+ngram"]["copy_aal"]) > 0
    # An always-firing probe copies wherever the suffix matched, as the n-gram baseline does.
    assert int(rows["greedy+probe"]["copy_rounds"]) > 0 and rows["greedy+probe"]["gate_fired"] == "1.0"
    assert int(rows["greedy+probe"]["gate_calls"]) == int(rows["greedy+probe"]["copy_rounds"])
    assert (out / "summary.png").stat().st_size > 1000
    assert "greedy+probe" in capsys.readouterr().out

    # Rerun: every prompt is done, so no model is loaded and nothing is appended.
    def no_models(*a, **k):
        raise AssertionError("resume must not load models")

    monkeypatch.setattr(copy_eval, "load_lm", no_models)
    assert _run(tmp_path, monkeypatch, _tiny_probe(tmp_path, 0.4), out) == 0
    assert len((out / "runs.jsonl").read_text().splitlines()) == len(records)
    # --report-only with more prompts selected than finished: summarises the finished ones, runs nothing.
    monkeypatch.setattr(copy_eval, "dataset_prompts", lambda ds, limit, offset: (PROMPTS + [("rep/2", [1, 2] * 9, False)])[offset:offset + limit])
    assert copy_eval.main(["--probe", str(_tiny_probe(tmp_path, 0.4)), "--dataset", "humaneval", "--out", str(out),
                           "--target", TINY_TARGET, "--drafter", TINY_DRAFTER, "--target-dtype", "float32", "--k", "4",
                           "--kappa", "3", "--min-confidence", "0", "--max-new-tokens", "40",
                           "--humaneval-style", "completion", "--report-only"]) == 0
    assert int(_summary(out)["greedy"]["prompts"]) == 2
    # --limit summarises only the selected prompts.
    assert _run(tmp_path, monkeypatch, _tiny_probe(tmp_path, 0.4), out, "--limit", "1") == 0
    assert int(_summary(out)["greedy"]["prompts"]) == 1
    # Other settings in the same folder are refused.
    with pytest.raises(SystemExit) as exc:
        _run(tmp_path, monkeypatch, _tiny_probe(tmp_path, 0.4), out, "--kappa", "4")
    assert exc.value.code == 2 and "holds runs with other settings {'kappa': (3, 4)}" in capsys.readouterr().err


def test_ngram_baseline_matches_its_own_suffix_length(tmp_path, monkeypatch, capsys):
    """greedy+ngram copies after a --ngram-kappa match (prompt-lookup style), greedy+probe after --kappa."""
    out = tmp_path / "eval"
    assert _run(tmp_path, monkeypatch, _tiny_probe(tmp_path, 0.4), out, "--ngram-kappa", "1", "--limit", "1") == 0
    short = _summary(out)
    out2 = tmp_path / "eval2"
    assert _run(tmp_path, monkeypatch, _tiny_probe(tmp_path, 0.4), out2, "--ngram-kappa", "3", "--limit", "1") == 0
    same = _summary(out2)
    assert json.loads((out / "config.json").read_text())["ngram_kappa"] == 1
    # The probe system matches --kappa (3 in both runs): the n-gram length leaves it as it was ...
    for col in ("rounds", "copy_rounds", "gate_calls"):
        assert short["greedy+probe"][col] == same["greedy+probe"][col], col
    # ... while the baseline with 1-token matches copies in rounds where no 3-token suffix had occurred before.
    assert int(short["greedy+ngram"]["copy_rounds"]) > int(same["greedy+ngram"]["copy_rounds"]) > 0
    with pytest.raises(SystemExit) as exc:  # a folder made with another n-gram length is refused
        _run(tmp_path, monkeypatch, _tiny_probe(tmp_path, 0.4), out, "--ngram-kappa", "2", "--limit", "1")
    assert exc.value.code == 2 and 'holds runs with other settings' in capsys.readouterr().err


def test_cli_resume_drops_half_finished_prompt(tmp_path, monkeypatch):
    out = tmp_path / "eval"
    probe = _tiny_probe(tmp_path, 0.6)
    assert _run(tmp_path, monkeypatch, probe, out, "--limit", "1") == 0
    lines = (out / "runs.jsonl").read_text().splitlines()
    (out / "runs.jsonl").write_text("\n".join(lines[:2]) + "\n{\"torn")  # killed after two systems
    assert _run(tmp_path, monkeypatch, probe, out, "--limit", "1") == 0
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["system"] for r in records] == list(copy_eval.SYSTEMS)
    rows = _summary(out)
    # A never-firing probe is asked at suffix matches but never copies.
    assert int(rows["greedy+probe"]["copy_rounds"]) == 0 and int(rows["greedy+probe"]["gate_calls"]) > 0
    assert rows["greedy+probe"]["gate_fired"] == "0.0"


def test_cli_rejects_a_probe_of_another_hidden_size(tmp_path, monkeypatch, capsys):
    path = tmp_path / "wide.npz"
    save_probe(path, np.zeros(TINY_D * 2, np.float32), 1, "post_attn", 0.5)
    with pytest.raises(SystemExit) as exc:
        _run(tmp_path, monkeypatch, path, tmp_path / "eval")
    assert exc.value.code == 2 and "is for hidden size 64, target 'tiny-random:0:16' has 32" in capsys.readouterr().err


def test_summarize_speedups_are_ratios_of_tokens_per_s():
    def rec(system, committed, wall, copy_rounds=0, copy_empty=0, copy_accepted=0):
        s = DecodeStats(method=system, k=8, rounds=10, committed=committed, wall_s=wall, copy_rounds=copy_rounds,
                        copy_empty=copy_empty, copy_accepted=copy_accepted)
        import dataclasses

        return {"dataset": "d", "id": "p", "system": system, "identical": True, "stats": dataclasses.asdict(s),
                "gate_calls": 4 if system == "greedy+probe" else 0, "gate_fired": 1 if system == "greedy+probe" else 0}

    rows = {r["system"]: r for r in copy_eval.summarize([
        rec("target_only", 100, 50.0), rec("greedy", 100, 25.0), rec("greedy+ngram", 100, 40.0, 5, 4, 2),
        rec("greedy+probe", 100, 20.0, 1, 0, 6)])}
    assert rows["greedy"]["speedup"] == 2.0 and rows["greedy+probe"]["speedup"] == 2.5
    assert rows["greedy+probe"]["speedup_vs_sd"] == 1.25 and rows["greedy+ngram"]["speedup_vs_sd"] == 0.625
    assert rows["greedy+ngram"]["copy_rate"] == 0.5 and rows["greedy+ngram"]["copy_empty"] == 0.8
    assert rows["greedy+ngram"]["copy_aal"] == 0.4 and rows["greedy+probe"]["copy_aal"] == 6.0
    assert rows["greedy+probe"]["gate_fired"] == 0.25 and rows["greedy"]["gate_calls"] == ""


# --------------------------------------------------------------------------- the shipped probe

QWEN_HIDDEN, QWEN_LAYERS = 1536, 28  # Qwen2.5-Coder-1.5B: hidden_size and num_hidden_layers


def test_shipped_probe_loads_for_the_default_target():
    from wisv_ros.sd.models import DEFAULT_TARGET

    paths = sorted((ROOT / "config" / "probes").glob("*.npz"))
    assert paths, "no probe shipped in config/probes"
    for path in paths:
        probe = load_probe(path)
        assert probe.d_model == QWEN_HIDDEN and 0 <= probe.layer < QWEN_LAYERS
        assert 0 < probe.threshold < 1 and np.isfinite(probe.w).all() and np.abs(probe.w).max() > 0
        assert probe.meta["target"] == DEFAULT_TARGET
        assert probe.meta["command"].startswith("python -m wisv_ros.cli.probe train ")
        assert probe.meta["metrics"]["val_auc"] >= 0.95
        assert path.stat().st_size < 64 * 1024  # small: one weight vector
