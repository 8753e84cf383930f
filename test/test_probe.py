"""Tests for wisv_ros.switchsd.probe_training: copy labels, prompts, collection, probe training, layer choice, export."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from wisv_ros.sd import models
from wisv_ros.cli.probe import main as probe_cli
from wisv_ros.sd.rounds import generate_target_only
from wisv_ros.sd.lm import CausalLM
from wisv_ros.switchsd.probe_training import (
    PROMPT_KINDS, LayerResult, RepetitionPrompt, best_f1_threshold, build_repetition_prompts,
    collect_probe_data, copy_labels, evaluate, feature_key, load_probe_data, save_probe, select_layer,
    split_by_source, train_layers, train_probe,
)
from wisv_ros.switchsd.probe import CopyProbe, load_probe

torch.set_num_threads(1)


# --------------------------------------------------------------------------- labels


def brute_labels(ids: list[int], start: int, min_run: int) -> list[int]:
    """The definition, literally: every run [a, b) of >= min_run tokens with an earlier start a' < a."""
    n = len(ids)
    y = [0] * n
    for a in range(n):
        for b in range(a + min_run, n + 1):
            run = ids[a:b]
            if any(ids[a2:a2 + len(run)] == run for a2 in range(a)):
                y[a:b] = [1] * (b - a)
    return y[start:]


def test_copy_labels_docstring_example():
    ids = [5, 1, 2, 3, 9, 1, 2, 3, 1, 2]
    assert copy_labels(ids, 0, 3).tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0]
    assert copy_labels(ids, 5, 3).tolist() == [1, 1, 1, 0, 0]
    assert copy_labels(ids, 5, 3).dtype == np.int8


def test_copy_labels_match_brute_force_with_planted_repeats():
    rng = np.random.default_rng(0)
    n_ones = 0
    for trial in range(120):
        n = int(rng.integers(1, 32))
        ids = rng.integers(0, 2 + trial % 6, size=n).tolist()  # tiny vocabularies: accidental repeats
        if n > 12 and trial % 2:  # plant a copy of a random span later on (may overlap its source)
            a = int(rng.integers(0, n - 6))
            length = int(rng.integers(3, 9))
            dest = int(rng.integers(a + 1, n))
            span = ids[a:a + length]
            ids[dest:dest + len(span)] = span
            ids = ids[:n]
        start = int(rng.integers(0, n + 1))
        min_run = int(rng.integers(1, 7))
        got = copy_labels(ids, start, min_run)
        assert got.tolist() == brute_labels(ids, start, min_run), (ids, start, min_run)
        n_ones += int(got.sum())
    assert n_ones > 50  # the random cases do exercise Y = 1


@pytest.mark.parametrize("length,expected", [(4, 0), (5, 1), (6, 1)])
def test_copy_labels_min_run_edges(length, expected):
    span = [10, 11, 12, 13, 14, 15][:length]
    ids = [1, 2] + span + [3, 4] + span + [5]
    labels = copy_labels(ids, 0, min_run=5)
    second = 2 + length + 2
    assert labels[second:second + length].tolist() == [expected] * length
    assert labels[2:2 + length].sum() == 0  # the first occurrence itself is not a copy
    assert labels[[0, 1, 2 + length, 3 + length, -1]].sum() == 0  # tokens around the runs


def test_copy_labels_overlapping_occurrence_and_prompt_source():
    ids = [7] * 8  # window (7,7,7,7,7) at 1 repeats the one at 0, overlapping it
    assert copy_labels(ids, 0, 5).tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    prompt = [3, 1, 4, 1, 5, 9, 2]
    answer = [8, 1, 4, 1, 5, 9, 6]  # copies 5 tokens of the prompt
    assert copy_labels(prompt + answer, len(prompt), 5).tolist() == [0, 1, 1, 1, 1, 1, 0]
    assert copy_labels([1, 2, 3], 3, 5).shape == (0,)
    with pytest.raises(ValueError):
        copy_labels([1, 2, 3], 4)


# --------------------------------------------------------------------------- prompts


def test_repetition_prompts_are_deterministic_balanced_and_well_formed():
    ps = build_repetition_prompts(40, seed=3)
    assert ps == build_repetition_prompts(40, seed=3)
    assert ps[:8] == build_repetition_prompts(8, seed=3)  # a prompt does not depend on n
    assert [p.id for p in ps] != [p.id for p in build_repetition_prompts(40, seed=4)]
    assert len({p.id for p in ps}) == 40
    assert [p.kind for p in ps[:12]] == list(PROMPT_KINDS) * 2
    for p in ps:
        assert p.source.startswith("HumanEval/") and p.id == f"{p.kind}/{p.source}"
        if p.kind == "turns":  # user, assistant (the canonical solution), user
            assert [m["role"] for m in p.prompt] == ["user", "assistant", "user"]
            continue
        (msg,) = p.prompt
        assert msg["role"] == "user" and msg["content"].startswith("```python\n")
        code, request = msg["content"].rsplit("```\n\n", 1)
        if p.kind == "rename":
            old, new = request.split("`")[1], request.split("`")[3]
            assert old != new and f"def {old}(" in code and new not in code
        if p.kind == "quote" and "contains `" in request:
            assert code.count(request.split("`")[1]) == 1  # the fragment names exactly one line
        if p.kind == "explain":
            assert "verbatim" not in request and "return the whole code" not in request
    with pytest.raises(ValueError):
        build_repetition_prompts(164 * len(PROMPT_KINDS) + 1)


# --------------------------------------------------------------------------- collection (tiny model)

CAPTURE_LAYERS, CAPTURE_KINDS = [0, 1], ["post_attn", "post_mlp"]
TINY = "tiny-random:0:8"  # a small vocabulary: the greedy tiny model repeats itself


def id_prompts(n: int) -> list[RepetitionPrompt]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        span = rng.integers(1, 8, size=8).tolist()
        out.append(RepetitionPrompt(id=f"p{i}", kind="ids", prompt=span + [0] + span, source=f"s{i % 2}"))
    return out


def test_collect_tiny_writes_aligned_shards_and_resumes(tmp_path):
    lm = CausalLM(*models.load_model(TINY))  # captures nothing: collection wraps it
    prompts = id_prompts(3)
    out = tmp_path / "data"
    index = collect_probe_data(lm, prompts[:2], CAPTURE_LAYERS, CAPTURE_KINDS, max_new_tokens=30, out_folder=out)
    assert [r["id"] for r in index] == ["p0", "p1"]
    ref_lm = CausalLM(*models.load_model(TINY),
                      capture=[(layer, k) for layer in CAPTURE_LAYERS for k in CAPTURE_KINDS])
    ones = 0
    for row, p in zip(index, prompts):
        assert row["prompt_ids"] == p.prompt and row["n_prompt"] == len(p.prompt)
        assert row["generated_ids"] == generate_target_only(ref_lm, p.prompt, 30).token_ids
        ids = row["prompt_ids"] + row["generated_ids"]
        ref_lm.reset()
        ref = ref_lm.feed(ids, n_logits=1)
        with np.load(out / row["shard"]) as z:
            labels = z["labels"]
            assert labels.tolist() == copy_labels(ids, len(p.prompt), 5).tolist()
            assert z["positions"].tolist() == list(range(len(p.prompt), len(ids)))
            for layer in CAPTURE_LAYERS:
                for kind in CAPTURE_KINDS:
                    x = z[feature_key(layer, kind)]
                    assert x.dtype == np.float16 and x.shape == (30, 32)
                    expect = ref.layers[(layer, kind)][len(p.prompt):].numpy().astype(np.float16)
                    np.testing.assert_array_equal(x, expect)
        ones += int(labels.sum())
        assert row["n_copy"] == int(labels.sum())
    assert ones > 0  # the greedy tiny model loops: some completion tokens are copies

    # Resume: stored prompts are skipped (no forward pass), a new one is appended.
    lm_passes = lm.forward_passes
    again = collect_probe_data(lm, prompts[:2], CAPTURE_LAYERS, CAPTURE_KINDS, max_new_tokens=30, out_folder=out)
    assert lm.forward_passes == lm_passes and len(again) == 2
    before = (out / index[0]["shard"]).read_bytes()
    more = collect_probe_data(lambda capture: CausalLM(*models.load_model(TINY), capture=capture),
                              prompts, CAPTURE_LAYERS, CAPTURE_KINDS, max_new_tokens=30, out_folder=out)
    assert [r["id"] for r in more] == ["p0", "p1", "p2"]
    assert (out / index[0]["shard"]).read_bytes() == before
    assert len(list((out / "shards").glob("*.npz"))) == 3
    data = load_probe_data(out)
    assert data.labels.shape == (90,) and data.features(1, "post_mlp").shape == (90, 32)
    assert data.prompt_row.tolist() == [0] * 30 + [1] * 30 + [2] * 30
    with pytest.raises(ValueError, match="layers"):
        collect_probe_data(lm, prompts, [0], CAPTURE_KINDS, max_new_tokens=30, out_folder=out)


def test_collect_rejects_bad_capture(tmp_path):
    lm = CausalLM(*models.load_model(TINY))
    with pytest.raises(ValueError, match="cannot capture"):
        collect_probe_data(lm, id_prompts(1), [2], ["post_attn"], max_new_tokens=4, out_folder=tmp_path)


# --------------------------------------------------------------------------- probes (synthetic)


def synthetic(n: int, d: int, seed: int, direction: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian rows with a few huge dimensions (like residual streams); y = 1 iff projection > 0."""
    rng = np.random.default_rng(seed)
    scales = np.ones(d)
    scales[:2] = 200.0
    x = (rng.standard_normal((n, d)) * scales).astype(np.float32)
    return x, (x @ direction > 0).astype(np.int8)


def test_train_probe_separates_a_direction_on_raw_hiddens():
    d = 24
    u = np.random.default_rng(9).standard_normal(d) / np.r_[200.0, 200.0, np.ones(d - 2)]
    x, y = synthetic(1500, d, 0, u)
    x_val, y_val = synthetic(800, d, 1, u)
    x_test, y_test = synthetic(800, d, 2, u)
    w = train_probe(x, y, l2=1e-4, max_iter=100)
    assert w.shape == (d,) and w.dtype == np.float32
    assert np.array_equal(w, train_probe(x, y, l2=1e-4, max_iter=100))  # deterministic
    val = evaluate(w, x_val, y_val)
    assert val["auc"] > 0.99 and val["best_f1"] > 0.95
    assert 0.0 < val["best_threshold"] < 1.0
    test = evaluate(w, x_test, y_test, threshold=val["best_threshold"])
    assert test["auc"] > 0.95 and test["f1"] > 0.9
    # The validation threshold reproduces the validation best F1.
    assert evaluate(w, x_val, y_val, threshold=val["best_threshold"])["f1"] == pytest.approx(val["best_f1"])
    cos = float(w @ u / np.linalg.norm(w) / np.linalg.norm(u))
    assert cos > 0.9  # the fold of the feature scaling into w gives the true direction back
    # A strong L2 shrinks the weights.
    assert np.linalg.norm(train_probe(x, y, l2=10.0)) < np.linalg.norm(w)
    sub = train_probe(x, y, max_rows=300, seed=1)
    assert evaluate(sub, x_val, y_val)["auc"] > 0.95


def test_best_f1_threshold_matches_exhaustive_search():
    rng = np.random.default_rng(4)
    for _ in range(30):
        scores = rng.integers(0, 8, size=40).astype(float) / 8  # ties
        labels = rng.random(40) < 0.4
        if not labels.any():
            continue
        f1, thr = best_f1_threshold(scores, labels)
        best = 0.0
        for t in np.unique(scores):
            called = scores >= t
            tp = (called & labels).sum()
            best = max(best, 2 * tp / (called.sum() + labels.sum()))
        assert f1 == pytest.approx(best)
        called = scores >= thr
        assert 2 * (called & labels).sum() / (called.sum() + labels.sum()) == pytest.approx(best)
    assert best_f1_threshold(np.array([0.2, 0.7]), np.array([0, 0]))[0] == 0.0


def write_synthetic_folder(folder, informative=(2, "post_attn"), d=12, n_prompts=12, seed=0) -> np.ndarray:
    """A probe data folder in the collect format: only ``informative`` carries the label direction."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d)
    layers, kinds = [0, 2, 4], ["post_attn", "post_mlp"]
    (folder / "shards").mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"target": "synthetic", "layers": layers, "kinds": kinds,
                                                  "d_model": d, "max_new_tokens": 40, "min_run": 5, "chat": True}))
    with (folder / "index.jsonl").open("w") as f:
        for i in range(n_prompts):
            n = 40
            informative_x = rng.standard_normal((n, d))
            labels = (informative_x @ u > 0).astype(np.int8)
            arrays = {feature_key(ly, k): (informative_x if (ly, k) == informative else rng.standard_normal((n, d)))
                      .astype(np.float16) for ly in layers for k in kinds}
            shard = f"shards/{i:05d}.npz"
            np.savez(folder / shard, labels=labels, positions=np.arange(n, dtype=np.int32), **arrays)
            f.write(json.dumps({"id": f"q{i}", "kind": "synthetic", "source": f"src{i // 2}", "shard": shard,
                                "n_prompt": 0, "n_new": n, "n_copy": int(labels.sum()),
                                "prompt_ids": [], "generated_ids": []}) + "\n")
    return u


def test_layer_selection_picks_the_informative_layer(tmp_path):
    write_synthetic_folder(tmp_path / "data")
    data = load_probe_data(tmp_path / "data")
    train_rows, val_rows = split_by_source(data, 0.34, seed=0)
    # Sources never straddle the split.
    src = np.array([r["source"] for r in data.index])[data.prompt_row]
    assert not set(src[train_rows]) & set(src[val_rows]) and len(train_rows) + len(val_rows) == 480
    report = train_layers(data, train_rows, val_rows, max_iter=50)
    assert len(report.results) == 6
    best = report.best
    assert (best.layer, best.kind) == (2, "post_attn")
    assert best.val_auc > 0.95 and all(r.val_auc < 0.75 for r in report.results if r is not best)
    table = report.table()
    assert table.count("\n") == 7 and "| 2 * | post_attn |" in table
    png = report.plot(tmp_path / "report.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json.dumps(report.to_dict()))["best"] == {"layer": 2, "kind": "post_attn"}


def test_select_layer_breaks_ties_by_auc_then_lower_layer():
    w = np.zeros(2, np.float32)
    def r(layer, f1, auc):
        return LayerResult(layer, "post_attn", w, 0.9, auc, f1, 0.5, 10, 10, 0.5)
    assert select_layer([r(1, 0.8, 0.9), r(5, 0.85, 0.7), r(3, 0.8, 0.99)]).layer == 5
    assert select_layer([r(6, 0.8, 0.9), r(2, 0.8, 0.9)]).layer == 2
    with pytest.raises(ValueError):
        select_layer([])


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(16).astype(np.float32)
    h = rng.standard_normal((50, 16)).astype(np.float32) * 0.3
    side = save_probe(tmp_path / "probe.npz", w, 14, "post_attn", 0.4, meta={"command": "x", "target": "t"})
    info = json.loads(side.read_text())
    assert info["layer"] == 14 and info["kind"] == "post_attn" and info["command"] == "x" and info["d_model"] == 16
    probe = load_probe(tmp_path / "probe.npz")
    ref = CopyProbe(w=w, layer=14, kind="post_attn", threshold=0.4)
    assert np.array_equal(probe.prob(h), ref.prob(h))
    assert probe.meta == {"command": "x", "target": "t"}
    p0 = probe.prob(h[0])
    assert isinstance(p0, float) and p0 == probe.prob(torch.from_numpy(h[0]))
    assert probe.fires(h[0]) == (p0 >= 0.4) and isinstance(probe.fires(h[0]), bool)
    assert np.array_equal(probe.fires(h), probe.prob(h) >= 0.4) and 0 < probe.fires(h).sum() < 50
    with pytest.raises(ValueError):
        probe.prob(np.zeros(15))
    with pytest.raises(ValueError, match="contradicts"):
        save_probe(tmp_path / "bad.npz", w, 14, "post_attn", 0.4, meta={"layer": 3})


def test_cli_train_exports_the_best_probe(tmp_path, capsys):
    write_synthetic_folder(tmp_path / "data", informative=(4, "post_mlp"))
    out = tmp_path / "probe.npz"
    assert probe_cli(["train", "--data", str(tmp_path / "data"), "--out", str(out), "--val-share", "0.34",
                      "--max-iter", "50"]) == 0
    probe = load_probe(out)
    assert (probe.layer, probe.kind) == (4, "post_mlp")
    assert probe.meta["command"].startswith("python -m wisv_ros.cli.probe train --data")
    assert (tmp_path / "data" / "report" / "report.png").is_file()
    assert "chosen: layer 4 post_mlp" in capsys.readouterr().out


# --------------------------------------------------------------------------- real model


def test_collect_smollm2_real_prompts(tmp_path):
    lm = CausalLM(*models.load_model("smollm2-135m-instruct"))
    prompts = build_repetition_prompts(2, seed=0)
    index = collect_probe_data(lm, prompts, [4, 14], ["post_attn", "post_mlp"], max_new_tokens=24,
                               out_folder=tmp_path / "data")
    assert len(index) == 2
    data = load_probe_data(tmp_path / "data")
    assert data.meta["d_model"] == lm.hidden_size == 576
    for layer in (4, 14):
        for kind in ("post_attn", "post_mlp"):
            x = data.features(layer, kind)
            assert x.shape == (len(data.labels), 576) and np.isfinite(x).all()
    assert len(data.labels) == sum(r["n_new"] for r in index) and 0 < len(data.labels) <= 48
    assert set(np.unique(data.labels)) <= {0, 1}
    # Completion tokens were produced by the chat template's assistant turn.
    assert all(r["n_prompt"] > 100 for r in index)


def test_three_way_split_keeps_sources_apart(tmp_path):
    from wisv_ros.switchsd.probe_training import split_three_by_source

    write_synthetic_folder(tmp_path / "data")  # 12 prompts, 6 sources
    data = load_probe_data(tmp_path / "data")
    parts = split_three_by_source(data, 0.34, 0.34, seed=0)
    src = np.array([r["source"] for r in data.index])[data.prompt_row]
    sets = [set(src[rows]) for rows in parts]
    assert all(sets) and not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert sum(len(rows) for rows in parts) == len(data.labels)
    assert [len(s) for s in sets] == [2, 2, 2]
    with pytest.raises(ValueError):
        split_three_by_source(data, 0.6, 0.5)


def test_cli_train_scores_the_chosen_probe_on_held_out_test_sources(tmp_path, capsys):
    write_synthetic_folder(tmp_path / "data", informative=(2, "post_mlp"), n_prompts=16)
    out = tmp_path / "probe.npz"
    assert probe_cli(["train", "--data", str(tmp_path / "data"), "--out", str(out), "--val-share", "0.25",
                      "--test-share", "0.25", "--max-iter", "50"]) == 0
    probe = load_probe(out)
    test = probe.meta["metrics"]["test"]
    assert (probe.layer, probe.kind) == (2, "post_mlp")
    assert test["n"] == 160 and test["auc"] > 0.9 and 0 < test["f1"] <= 1  # 2 of 8 sources x 2 prompts x 40
    assert "held-out test (160 tokens" in capsys.readouterr().out
    assert "held-out test" in (tmp_path / "data" / "report" / "report.md").read_text()
    with pytest.raises(SystemExit) as exc:
        probe_cli(["train", "--data", str(tmp_path / "data"), "--out", str(out), "--val-share", "0.5",
                   "--test-share", "0.5"])
    assert exc.value.code == 2 and '--test-share must be in [0, 1) with --val-share + --test-share < 1' in capsys.readouterr().err


def test_excerpt_and_two_turn_prompts():
    """The extra kinds: an excerpt question over the code, and a two-turn chat whose second request
    makes the model repeat its first answer (the canonical solution) with a change."""
    assert {"excerpt", "turns"} <= set(PROMPT_KINDS)
    ps = build_repetition_prompts(4, seed=0, kinds=("excerpt", "turns"))
    assert [p.kind for p in ps] == ["excerpt", "turns"] * 2
    excerpt, turns = ps[0], ps[1]
    assert len(excerpt.prompt) == 1 and "docstring" in excerpt.prompt[0]["content"]
    assert "```python" in excerpt.prompt[0]["content"]
    assert [m["role"] for m in turns.prompt] == ["user", "assistant", "user"]
    assert "return the whole code again" in turns.prompt[2]["content"]
    assert turns.prompt[1]["content"].startswith("```python") and turns.source in turns.id
    assert build_repetition_prompts(4, seed=0, kinds=("excerpt", "turns")) == ps  # deterministic


def test_cli_score_rates_a_trained_probe_on_another_folder(tmp_path, capsys):
    """score: the shipped probe, unchanged, on data it never saw (same label direction: high AUC;
    a folder with another direction: near chance), per prompt kind; clear errors on a wrong folder."""
    write_synthetic_folder(tmp_path / "train", informative=(2, "post_mlp"), n_prompts=16, seed=0)
    out = tmp_path / "probe.npz"
    assert probe_cli(["train", "--data", str(tmp_path / "train"), "--out", str(out), "--max-iter", "50"]) == 0
    # Same direction u (seed 0 draws u first), new rows: a held-out folder of the same task.
    write_synthetic_folder(tmp_path / "same", informative=(2, "post_mlp"), n_prompts=4, seed=0)
    idx = (tmp_path / "same" / "index.jsonl").read_text().replace('"kind": "synthetic"', '"kind": "other"', 2)
    (tmp_path / "same" / "index.jsonl").write_text(idx)
    capsys.readouterr()
    assert probe_cli(["score", "--probe", str(out), "--data", str(tmp_path / "same"),
                      "--json", str(tmp_path / "score.json")]) == 0
    score = json.loads((tmp_path / "score.json").read_text())["metrics"]
    assert set(score) == {"all", "other", "synthetic"} and score["other"]["n"] == 80 and score["all"]["n"] == 160
    assert score["all"]["auc"] > 0.9 and "| other | 80 |" in capsys.readouterr().out
    write_synthetic_folder(tmp_path / "foreign", informative=(2, "post_mlp"), n_prompts=4, seed=5)
    assert probe_cli(["score", "--probe", str(out), "--data", str(tmp_path / "foreign"),
                      "--json", str(tmp_path / "foreign.json")]) == 0
    assert json.loads((tmp_path / "foreign.json").read_text())["metrics"]["all"]["auc"] < 0.8
    write_synthetic_folder(tmp_path / "wrong", informative=(2, "post_mlp"), d=10, n_prompts=2)
    with pytest.raises(SystemExit) as exc:
        probe_cli(["score", "--probe", str(out), "--data", str(tmp_path / "wrong")])
    assert exc.value.code == 2 and 'has d_model 10, the probe 12: another target' in capsys.readouterr().err
