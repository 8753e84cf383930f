"""Mismatch traces and task-driven labels on a real cross-tokenizer pair (SmolLM2 -> Gemma-3-270M)."""
from __future__ import annotations

import json

import numpy as np
import torch
import pytest

from wisv_ros.sd import models
from wisv_ros.eval.datasets import generate_gsm_symbolic
from wisv_ros.sd.rounds import generate_target_only
from wisv_ros.sd.lm import CausalLM
from wisv_ros.cli.traces import main as traces_cli
from wisv_ros.wisv.traces import _continue_batch, _continue_shared, _shared_prefix_ok, answer_complete, bench_labelling, collect_traces, label_mismatches, load_traces


@pytest.fixture(scope="module")
def pair():
    return CausalLM(*models.load_model("gemma3-270m")), CausalLM(*models.load_model("smollm2-135m-instruct"))


@pytest.mark.parametrize("text,done", [
    ("so 3 + 4 = 7. The answer is 7. Done", True),
    ("so 3 + 4 = 7. The answer is 7.", False),  # may still become 7.5
    ("The answer is 1,250 dollars", True),
    ("The answer is 12", False),  # the number may still go on
    ("the answer is -3\n", True),
    ("We add them up: 7", False),
])
def test_answer_complete(text, done):
    assert answer_complete(text) is done


def test_collect_and_label_resume(pair, tmp_path, capsys):
    target, drafter = pair
    problems = generate_gsm_symbolic(2, seed=7)
    out = tmp_path / "traces"
    w = collect_traces(drafter, target, problems, out, k=4, max_new_tokens=48)
    assert w.done == {p.id for p in problems}
    tr = load_traces(out)
    assert len(tr.records) > 0
    assert tr.h_draft.shape == (len(tr.records), drafter.hidden_size)
    assert tr.h_target.shape == (len(tr.records), target.hidden_size)
    for r in tr.records:
        gen = tr.problems[r["problem_id"]]["generated_ids"]
        # Greedy SD commits the target's token at the mismatch: the record agrees with the answer.
        assert r["position"] < len(gen) and gen[r["position"]] == r["target_id"] != r["draft_id"]
        assert 0 <= r["p_draft"] < r["p_target"] == r["topk"][0] <= 1 and 0 <= r["agree_after"] <= r["left"]
    # Resume: nothing is redone.
    w2 = collect_traces(drafter, target, problems, out, k=4, max_new_tokens=48)
    assert w2.n_records == len(tr.records)
    with pytest.raises(ValueError, match="k is 4"):
        collect_traces(drafter, target, problems, out, k=6, max_new_tokens=48)

    # Label: without a final answer in 48 tokens the problem is unlabelable; give every problem an
    # answer so that the substitution decides the label, then label in two resumable steps.
    lines = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
    cut = [p["id"] for p in lines if len(p["generated_ids"]) >= 48]
    assert cut and all(p["answer"] is None for p in lines if p["id"] in cut)  # no final number: not labelled
    cut_uid = next(r["uid"] for r in tr.records if r["problem_id"] in cut)
    for p in lines:
        p["answer"] = p["answer"] or "424242"
    (out / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in lines))
    (out / "labels.jsonl").write_text(json.dumps({"uid": cut_uid, "label": 1, "answer": "1", "new_tokens": 1}) + "\n")
    loaded = load_traces(out)
    assert all(loaded.problems[pid]["answer"] is None for pid in cut)  # an answer written in later is not trusted
    assert all(lab < 0 for r, lab in zip(loaded.records, loaded.labels) if r["problem_id"] in cut)  # nor its labels
    # From here on, pretend the answers were complete.
    (out / "meta.json").write_text(json.dumps(dict(json.loads((out / "meta.json").read_text()), max_new_tokens=10**6)))
    (out / "labels.jsonl").unlink()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["target_dtype"] == str(target.model.dtype).removeprefix("torch.") and meta["k"] == 4
    (out / "meta.json").write_text(json.dumps(dict(meta, target_dtype="float16")))
    with pytest.raises(ValueError, match="--target-dtype float16"):
        label_mismatches(target, out, batch_size=2, max_new_tokens=12)  # labels need the traces' dtype
    (out / "meta.json").write_text(json.dumps(meta))
    first = label_mismatches(target, out, batch_size=2, max_new_tokens=12, limit=1)
    assert first["labelled"] == 1
    (first_pid,) = {r["problem_id"] for r, lab in zip(load_traces(out).records, load_traces(out).labels) if lab >= 0}
    # Two shards (as two processes would): the second problem's, then the rest.
    second = lines[1]["id"]
    odd = label_mismatches(target, out, batch_size=2, max_new_tokens=12, shard=(1, 2))
    assert odd["labelled"] == sum(r["problem_id"] == second for r in tr.records) - (first_pid == second)
    assert {r["problem_id"] for r, lab in zip(load_traces(out).records, load_traces(out).labels) if lab >= 0} <= {first_pid, second}
    rest = label_mismatches(target, out, batch_size=2, max_new_tokens=12, shard=(0, 2))
    assert odd["labelled"] + rest["labelled"] == len(tr.records) - 1
    with pytest.raises(ValueError, match="shard 2/2"):
        label_mismatches(target, out, shard=(2, 2))
    labels = load_traces(out).labels
    assert set(np.unique(labels)) <= {0, 1} and (labels >= 0).all()
    # A continuation that used its whole budget (12) without a final answer has none: critical.
    labs = [json.loads(line) for line in (out / "labels.jsonl").read_text().splitlines()]
    truncated = [lab for lab in labs if lab["new_tokens"] >= 12]
    assert any(lab["answer"] is None for lab in truncated)
    assert all(lab["label"] == 1 for lab in truncated if lab["answer"] is None)

    # The labelling benchmark: both ways on the same mismatches give the same continuations.
    n = min(3, max(len(v) for v in _by_problem(tr).values()))
    rows = bench_labelling(target, out, n_branches=n, batch_size=2, max_new_tokens=8)
    assert [r["way"] for r in rows] == ["per_context", "shared_prefix"]
    assert all(r["labels"] == n and r["same_as_per_context"] == n and r["seconds"] > 0 for r in rows)
    assert rows[0]["continuation_tokens"] == rows[1]["continuation_tokens"] > 0
    with pytest.raises(ValueError, match="lower n_branches"):
        bench_labelling(target, out, n_branches=10_000)
    # The CLI prints the table and writes the CSV; a bad --shard is refused before any model loads.
    csv_path = tmp_path / "bench.csv"
    assert traces_cli(["bench-label", "--out", str(out), "--branches", "2", "--batch-size", "2", "--max-new-tokens", "4",
                       "--target", "gemma3-270m", "--target-dtype", str(target.model.dtype).removeprefix("torch."),
                       "--csv", str(csv_path)]) == 0
    assert csv_path.read_text().splitlines()[0].startswith("way,problem,labels") and len(csv_path.read_text().splitlines()) == 3
    with pytest.raises(SystemExit) as exc:
        traces_cli(["label", "--out", str(out), "--shard", "2/2"])
    assert exc.value.code == 2 and '--shard must be I/N with 0 <= I < N' in capsys.readouterr().err


def _by_problem(tr):
    out = {}
    for r in tr.records:
        out.setdefault(r["problem_id"], []).append(r)
    return out


def test_batched_continuations_match_single(pair):
    target, _ = pair
    tok = target.tokenizer
    contexts = [tok("The capital of France is").input_ids, tok("Counting: one, two, three, four,").input_ids]
    batch = _continue_batch(target, contexts, 8, lambda text: False)
    for ctx, got in zip(contexts, batch):
        ref = generate_target_only(target, ctx, 8)
        assert got == ref.token_ids


def test_shared_prefix_continuations_match_single(pair):
    """One prefill of the answer, branches sliced out of its cache, rows leaving the batch as they
    stop: the same tokens as decoding each substituted context alone."""
    target, _ = pair
    tok = target.tokenizer
    prefix = tok("Tom has 3 apples and buys 4 more. Then he eats 2 of them. How many are left? He has").input_ids
    branches = [(len(prefix) - 1, tok(" five").input_ids[-1]), (6, tok(" pears").input_ids[-1]),
                (len(prefix), tok(" 5").input_ids[-1]), (10, tok(" sells").input_ids[-1]), (3, prefix[3])]
    got: dict[int, list[int]] = {}
    # The stop rule ends rows at different steps, so rows leave a batch while others go on.
    for members, conts in _continue_shared(target, prefix, branches, 10, lambda text: "." in text, batch_size=3):
        assert len(members) <= 3
        got.update(zip(members, conts))
    assert sorted(got) == list(range(len(branches)))
    for i, (p, t) in enumerate(branches):
        ref = generate_target_only(target, prefix[:p] + [t], 10, stop_text=lambda text: "." in text)
        assert got[i] == ref.token_ids, f"branch {i}"
    with pytest.raises(ValueError, match="branch point"):
        next(_continue_shared(target, prefix, [(len(prefix) + 1, 5)], 4, lambda text: False, 2))


def test_shared_prefix_only_within_a_sliding_window(pair):
    target, _ = pair  # Gemma 3: sliding-window layers of 512
    assert _shared_prefix_ok(target, 100)
    assert not _shared_prefix_ok(target, 100_000)


def test_train_head_cli_on_synthetic_traces(tmp_path, capsys):
    """traces folder -> relabel -> train -> ONNX with sidecar, loadable by the verifier's runtime."""
    from wisv_ros.cli.train_head import main as train_main
    from wisv_ros.wisv.head import OnnxHead, sidecar_path
    from wisv_ros.wisv.traces import TraceWriter

    rng = np.random.default_rng(0)
    d_d, d_t = 6, 10
    w = TraceWriter(tmp_path / "tr", {"drafter": "d", "target": "t", "k": 8, "d_draft": d_d, "d_target": d_t})
    labels = []
    for p in range(12):
        n = 12
        recs = [{"round_id": r, "position": 3 * r, "block_index": 0, "draft_id": 1, "target_id": 2} for r in range(n)]
        hd = [rng.normal(size=d_d).astype(np.float32) for _ in range(n)]
        ht = [rng.normal(size=d_t).astype(np.float32) for _ in range(n)]
        w.add_problem(f"p{p}", "1", [0], list(range(40)), n, recs, hd, ht)
        labels += [(f"p{p}:{r}", int(hd[r][0] > 0)) for r in range(n)]
    # Problem p12 is still being labelled (one label missing): training leaves it out.
    w.add_problem("p12", "1", [0], list(range(40)), 3, recs[:3], hd[:3], ht[:3])
    partial = [("p12:0", 1), ("p12:1", 0)]
    with (tmp_path / "tr" / "labels.jsonl").open("w") as f:
        for uid, lab in labels + partial:
            f.write(json.dumps({"uid": uid, "label": lab, "answer": None, "new_tokens": 0}) + "\n")
    out = tmp_path / "head.onnx"
    assert train_main(["--traces", str(tmp_path / "tr"), "--out", str(out), "--epochs", "20", "--lr", "0.01", "--channels", "4",
                       "--cv"]) == 0
    assert "1 problem(s) only partly labelled, left out" in capsys.readouterr().err
    meta = json.loads(sidecar_path(out).read_text())
    assert meta["csi_relabeling"] is True and "--epochs 20" in meta["command"]
    # Cross-validation held out every problem once and scored all 144 mismatches against their base labels;
    # the label is a sign of one drafter feature, which held-out problems share.
    cv = meta["cv"]
    assert (cv["problems"], cv["mismatches"], cv["critical"]) == (12, 144, sum(lab for _, lab in labels))
    assert set(cv["auc"]) == {"20mbps_5ms", "20mbps_50ms", "500mbps_5ms", "500mbps_50ms"}
    assert all(len(folds) == 12 for folds in cv["fold_auc"].values())
    assert cv["auc"]["500mbps_5ms"] > 0.8, cv
    curve = cv["tau_curve"]["20mbps_50ms"]
    assert {0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9} <= {c["tau"] for c in curve}
    assert [c["tau"] for c in curve] == sorted(c["tau"] for c in curve)
    assert "net_lost_per_100" not in curve[0]  # problems without true answers: no accuracy estimate
    for key in ("accepted", "critical_accepted", "problems_hit"):  # a larger tau accepts more
        assert all(a[key] <= b[key] for a, b in zip(curve, curve[1:])), (key, curve)
    assert curve[-1]["critical_accepted"] < curve[-1]["accepted"]  # the head tells critical mismatches apart
    head = OnnxHead(out)
    p = head.reject_prob(np.zeros((2, d_d), np.float32), np.zeros((2, d_t), np.float32), np.zeros(3, np.float32))
    assert p.shape == (2,) and ((p >= 0) & (p <= 1)).all()
    # Grouped folds (4 trainings instead of 12): every problem still held out once, whole.
    assert train_main(["--traces", str(tmp_path / "tr"), "--out", str(out), "--epochs", "20", "--lr", "0.01", "--channels", "4",
                       "--cv", "--folds", "4"]) == 0
    cv4 = json.loads(sidecar_path(out).read_text())["cv"]
    assert (cv4["problems"], cv4["mismatches"]) == (12, 144) and all(len(f) == 12 for f in cv4["fold_auc"].values())
    assert cv4["auc"]["500mbps_5ms"] > 0.8, cv4
    with pytest.raises(SystemExit):
        train_main(["--traces", str(tmp_path / "tr"), "--out", str(out), "--cv", "--folds", "2"])
    assert "--folds must be in [3, 12]" in capsys.readouterr().err


def test_target_features_and_fly_points():
    """The target features of a mismatch, and the FLy-style rule's operating points computed from
    them equal what fly_accept decides on the same logits."""
    from wisv_ros.sd.acceptance import fly_accept, topk_entropy
    from wisv_ros.wisv.traces import Traces, fly_points, target_features

    torch.manual_seed(0)
    rows = []
    decisions = {}
    for n in range(40):
        logits = torch.randn(9, 32) * (0.5 + (n % 4))  # K = 8; sharper or flatter rows
        argmax = logits.argmax(-1).tolist()
        a = n % 5
        draft = list(argmax[:8])
        draft[a] = (argmax[a] + 1) % 32  # mismatch at a
        cut = 3 + (n % 4)
        if a < cut < 8:
            draft[cut] = (argmax[cut] + 2) % 32  # and a later one that ends the agreement
        f = target_features(logits, draft, a)
        assert abs(sum(f["topk"]) - float(torch.topk(torch.softmax(logits[a], -1), 8).values.sum())) < 1e-4
        assert f["left"] == 7 - a and f["agree_after"] == ((cut if a < cut < 8 else 8) - a - 1)
        rows.append(dict(f, problem_id=f"p{n % 7}", uid=str(n)))
        for w in (1, 2, 4):
            for e in (0.0, 0.4):
                decisions[(e, w, n)] = fly_accept(draft, logits, e, w).accepted > a
                h = float(topk_entropy(logits[a]))
                assert decisions[(e, w, n)] == (h >= e and f["agree_after"] >= w)
    labels = np.array([n % 3 == 0 for n in range(40)], dtype=np.int8)
    tr = Traces(meta={}, records=rows, h_draft=np.zeros((40, 2)), h_target=np.zeros((40, 2)), labels=labels, problems={})
    for pt in fly_points(tr, entropies=(0.0, 0.4), windows=(1, 2, 4)):
        acc = np.array([decisions[(pt["fly_entropy"], pt["fly_window"], n)] for n in range(40)])
        assert abs(pt["accepted"] - acc.mean()) < 1e-9
        assert abs(pt["critical_accepted"] - acc[labels == 1].mean()) < 1e-9


def test_harmful_labels_and_tau_per_channel_from_true_answers(tmp_path, capsys):
    """On generated problems the true answers regenerate from the folder's source: harmful = a right
    answer turned wrong; the cross-validation estimates right answers lost per tau and picks a tau
    per channel within the budget."""
    from wisv_ros.cli.train_head import CURVE_TAUS, main as train_main, monotone_fit, pick_tau
    from wisv_ros.wisv.head import sidecar_path
    from wisv_ros.wisv.traces import TraceWriter, reference_answers, task_labels

    rng = np.random.default_rng(1)
    d_d, d_t = 6, 10
    # Problems from later in the stream: their ids skip the excluded templates' indices (id 60 is the
    # 58th problem), so the true answers must be found by id, not by position.
    truth = generate_gsm_symbolic(60, 0)[-12:]
    assert truth[-1].id != "gsm_symbolic-0-59"
    w = TraceWriter(tmp_path / "tr", {"drafter": "d", "target": "t", "k": 8, "d_draft": d_d, "d_target": d_t,
                                      "source": "gsm_symbolic, seed 0"})
    rows = []
    for p, prob in enumerate(truth):
        right = p % 2 == 0  # the target gets every other problem right
        n = 10
        recs = [{"round_id": r, "position": 3 * r, "block_index": 0, "draft_id": 1, "target_id": 2} for r in range(n)]
        hd = [rng.normal(size=d_d).astype(np.float32) for _ in range(n)]
        ht = [rng.normal(size=d_t).astype(np.float32) for _ in range(n)]
        w.add_problem(prob.id, prob.answer if right else "-1", [0], list(range(40)), n, recs, hd, ht)
        for r in range(n):
            # The drafter's first feature decides what the substitution does: > 0 gives another number.
            changes = bool(hd[r][0] > 0)
            sub = ("-2" if right else "-3") if changes else (prob.answer if right else "-1")
            if not right and r == 0:
                sub = prob.answer  # one substitution turns a wrong answer right
            rows.append({"uid": f"{prob.id}:{r}", "label": int(sub != (prob.answer if right else "-1")), "answer": sub,
                         "new_tokens": 5})
    with (tmp_path / "tr" / "labels.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tr = load_traces(tmp_path / "tr")
    assert reference_answers(tr) == {p.id: p.answer for p in truth}
    crit, harm = task_labels(tr, "critical"), task_labels(tr, "harmful")
    right = np.array([int(r["problem_id"].rsplit("-", 1)[1]) % 2 == 0 for r in tr.records])
    assert (harm <= crit).all() and harm.sum() > 0
    assert not harm[~right].any()  # an answer the target gets wrong cannot be harmed
    assert (harm[right] == crit[right]).all()
    with pytest.raises(ValueError, match="label kind"):
        task_labels(tr, "bogus")
    out = tmp_path / "head.onnx"
    assert train_main(["--traces", str(tmp_path / "tr"), "--out", str(out), "--epochs", "20", "--lr", "0.01",
                       "--channels", "4", "--label", "harmful", "--cv", "--folds", "3", "--accuracy-budget", "2"]) == 0
    meta = json.loads(sidecar_path(out).read_text())
    assert meta["label"] == "harmful" and meta["cv"]["critical"] == int(harm.sum())
    assert meta["cv"]["target_right"] == 6
    # Trained on harmful labels, the AUC against harmful labels is the AUC against its own labels.
    assert meta["cv"]["auc_harmful"] == pytest.approx(meta["cv"]["auc"])
    curve = meta["cv"]["tau_curve"]["20mbps_50ms"]
    assert [c["tau"] for c in curve] == list(CURVE_TAUS)
    for c in curve:
        assert 0 <= c["answers_lost"] <= 0.5 and 0 <= c["answers_gained"] <= 0.5
        assert c["net_lost_per_100"] == pytest.approx(100 * (c["answers_lost"] - c["answers_gained"]), abs=1e-3)
    assert curve[-1]["answers_gained"] > 0  # a large tau accepts the substitution that turns a wrong answer right
    schedule = dict(item.split(":") for item in meta["cv"]["tau_per_channel"].split(","))
    budgets = meta["cv"]["accuracy_budget"]
    assert set(schedule) == set(budgets) == {"20mbps_5ms", "20mbps_50ms", "500mbps_5ms", "500mbps_50ms"}
    # The whole budget on the worst channel, less where the link takes a smaller share of a round.
    assert budgets["20mbps_50ms"] == 2.0
    assert budgets["20mbps_50ms"] > budgets["500mbps_50ms"] > budgets["20mbps_5ms"] > budgets["500mbps_5ms"] > 0
    for name, tau in schedule.items():
        assert float(tau) == pick_tau(meta["cv"]["tau_curve"][name], budgets[name])
    assert "tau per channel within those budgets" in capsys.readouterr().err
    # Trained on critical labels, the head is still scored against harmful ones (the accuracy question).
    out_c = tmp_path / "head_critical.onnx"
    assert train_main(["--traces", str(tmp_path / "tr"), "--out", str(out_c), "--epochs", "5", "--lr", "0.01",
                       "--channels", "2", "--label", "critical", "--cv", "--folds", "3"]) == 0
    cv_c = json.loads(sidecar_path(out_c).read_text())["cv"]
    assert cv_c["critical"] == int(crit.sum()) > int(harm.sum())
    assert set(cv_c["auc_harmful"]) == set(cv_c["auc"]) and all(0 <= v <= 1 for v in cv_c["auc_harmful"].values())
    assert "against harmful labels" in capsys.readouterr().err
    # pick_tau: the largest tau whose estimate, made non-decreasing in tau, is within the budget; 0 when none is.
    pts = [{"tau": 0.01, "net_lost_per_100": 0.0}, {"tau": 0.02, "net_lost_per_100": 0.8},
           {"tau": 0.05, "net_lost_per_100": 1.5}, {"tau": 0.1, "net_lost_per_100": 0.5}, {"tau": 0.2, "net_lost_per_100": 3.0}]
    assert monotone_fit([p["net_lost_per_100"] for p in pts]) == [0.0, 0.8, 1.0, 1.0, 3.0]
    assert pick_tau(pts, 1.0) == 0.1 and pick_tau(pts, 0.9) == 0.02 and pick_tau(pts, 0.0) == 0.01
    assert pick_tau(pts[2:], 0.9) == 0.0
    # Critical labels need no true answers; harmful ones refuse a source without them.
    meta_path = tmp_path / "tr" / "meta.json"
    m = json.loads(meta_path.read_text())
    m["source"] = "humaneval"
    meta_path.write_text(json.dumps(m))
    with pytest.raises(SystemExit):
        train_main(["--traces", str(tmp_path / "tr"), "--out", str(out), "--label", "harmful"])
    assert "cannot be regenerated" in capsys.readouterr().err


def test_fly_points_follow_the_rule_and_estimate_accuracy(tmp_path):
    """fly_points applies acceptance.fly_accept's two tests to the recorded target features: a
    mismatch is accepted when the top-k entropy reaches the gate and the recorded agreement after it
    covers the window; with true answers it estimates right answers lost and gained."""
    from wisv_ros.wisv.traces import TraceWriter, fly_points

    truth = generate_gsm_symbolic(2, 0)
    w = TraceWriter(tmp_path / "tr", {"drafter": "d", "target": "t", "k": 8, "d_draft": 2, "d_target": 2,
                                      "source": "gsm_symbolic, seed 0"})
    flat, peaked = [1 / 8] * 8, [0.93] + [0.01] * 7  # normalised top-8 entropy 1.0 and about 0.2
    feats = [(flat, 6, 6), (flat, 1, 6), (peaked, 6, 6), (flat, 6, 6)]  # (topk, agree_after, left)
    rows = []
    for p, prob in enumerate(truth):
        recs = [{"round_id": r, "position": 2 * r, "block_index": 0, "draft_id": 1, "target_id": 2, "topk": t,
                 "agree_after": a, "left": left} for r, (t, a, left) in enumerate(feats)]
        right = p == 0
        w.add_problem(prob.id, prob.answer if right else "-1", [0], list(range(20)), 4, recs,
                      [np.zeros(2, np.float32)] * 4, [np.zeros(2, np.float32)] * 4)
        for r in range(4):
            changes = r == 3  # only the last mismatch of each answer changes it
            sub = ("-7" if right else prob.answer) if changes else (prob.answer if right else "-1")
            rows.append({"uid": f"{prob.id}:{r}", "label": int(changes), "answer": sub, "new_tokens": 1})
    with (tmp_path / "tr" / "labels.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    pts = {(p["fly_entropy"], p["fly_window"]): p for p in fly_points(load_traces(tmp_path / "tr"), (0.5, 1.1), (2, 6))}
    # Entropy 0.5, window 2: mismatches 0 and 3 (flat, agreement 6); 1 lacks agreement, 2 is peaked.
    assert pts[(0.5, 2)]["accepted"] == 0.5 and pts[(0.5, 2)]["critical_accepted"] == 1.0
    assert pts[(0.5, 6)]["accepted"] == 0.5 and pts[(1.1, 2)]["accepted"] == 0.0  # a gate above 1 accepts nothing
    # Answer 0 (right) loses its answer at mismatch 3; answer 1 (wrong) gains: net 0 per 100.
    assert (pts[(0.5, 2)]["answers_lost"], pts[(0.5, 2)]["answers_gained"], pts[(0.5, 2)]["net_lost_per_100"]) == (0.5, 0.5, 0.0)
    assert pts[(1.1, 2)]["net_lost_per_100"] == 0.0 and pts[(1.1, 2)]["problems_hit"] == 0.0
