"""Replay (eval.replay) against the live round protocol: on tiny random models, the rounds replayed
from one target decode and the teacher-forced passes equal the rounds ``generate`` really runs and
logs, for greedy SD at several K, with a confidence stop where the replay is exact, and with the
n-gram, suffix and probe-gated copy policies."""
from __future__ import annotations

import numpy as np
import pytest

from wisv_ros.eval.decode import decode_batch, teacher_force
from wisv_ros.eval.replay import COPY_POLICIES, CopyPolicy, Trace, read_traces, replay_greedy
from wisv_ros.sd.drafting import Drafter
from wisv_ros.sd.lm import CausalLM
from wisv_ros.sd.models import load_model
from wisv_ros.sd.roundlog import RoundRecord
from wisv_ros.sd.rounds import generate, generate_target_only
from wisv_ros.sd.verification import Verifier
from wisv_ros.switchsd.copying import CopyConfig, suffix_candidates

LAYER = (1, "post_attn")
PROMPTS = [[5, 9, 12, 3], [3, 1, 4, 1, 5, 9, 2, 6] * 3]
N = 60


class _Probe:
    """A stand-in copy probe on the tiny target's layer: fires when the first feature is positive."""

    layer, kind, threshold = LAYER[0], LAYER[1], 0.5

    def prob(self, rows: np.ndarray) -> np.ndarray:
        return (np.atleast_2d(rows)[:, 0] > 0).astype(np.float64)

    def fires(self, row: np.ndarray) -> bool:
        return bool(self.prob(row)[0] >= self.threshold)


@pytest.fixture(scope="module")
def models():
    target_model = load_model("tiny-random:0:16")[0]
    return CausalLM(target_model, capture=[LAYER]), CausalLM(load_model("tiny-random:0:16:0.05")[0])


@pytest.fixture(scope="module")
def traces(models):
    target, drafter = models
    out = []
    for i, prompt in enumerate(PROMPTS):
        cont = generate_target_only(target, prompt, N).token_ids
        out.append(teacher_force(drafter, prompt, cont, id=f"p{i}", dataset="tiny", eos_ids=target.eos_ids(),
                                 target=target, probe=_Probe(), chunk=7))  # small chunks: the chunking is exercised
    return out


def _live(models, prompt, k, copy=None, min_confidence=0.0):
    target, drafter = models
    recs: list[RoundRecord] = []
    out = generate(Drafter(drafter, min_confidence=min_confidence), Verifier(target, copy=copy), prompt, N, k,
                   round_log=recs.append)
    return out, recs


def _key(recs):
    return [(r.kind, r.round_id, r.drafted, r.accepted, r.committed, r.copy_candidates) for r in recs]


def _same_rounds(live, replayed):
    assert len(live) == len(replayed)
    # The last round may verify drafts past max_new_tokens (the robot clips); the replay stops at the
    # end of the target's decode.
    assert _key(live[:-1]) == _key(replayed[:-1])
    assert live[-1].kind == replayed[-1].kind and replayed[-1].accepted <= live[-1].accepted
    assert [r.prefix_length for r in live] == [r.prefix_length for r in replayed]
    assert [r.target_tokens for r in live[:-1]] == [r.target_tokens for r in replayed[:-1]]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_replay_equals_the_live_rounds(models, traces, k):
    for prompt, trace in zip(PROMPTS, traces):
        out, live = _live(models, prompt, k)
        assert out.token_ids == trace.target_ids  # lossless: the same tokens
        res = replay_greedy(trace, k, max_new_tokens=N)
        _same_rounds(live, res.records)
        assert res.bounded_rounds == 0 and res.tokens == len(out.token_ids)


def test_confidence_stop_replay_is_exact_or_an_upper_bound(models, traces):
    stop = 0.45
    short = 0
    for prompt, trace in zip(PROMPTS, traces):
        _, live = _live(models, prompt, 6, min_confidence=stop)
        res = replay_greedy(trace, 6, min_confidence=stop, max_new_tokens=N)
        rep = res.records
        assert len(live) == len(rep) and rep[-1].accepted <= live[-1].accepted  # the last round: see _same_rounds
        assert [(r.round_id, r.accepted, r.committed) for r in live[:-1]] == [(r.round_id, r.accepted, r.committed) for r in rep[:-1]]
        pairs = list(zip(live[:-1], rep[:-1]))
        assert all(b.drafted >= a.drafted for a, b in pairs)  # never fewer than really drafted
        assert sum(a.drafted == b.drafted for a, b in pairs) >= len(pairs) - res.bounded_rounds
        short += sum(r.drafted < 6 for r in live)
    assert short > 0, "the stop must cut some blocks short"


@pytest.mark.parametrize("mode", ["ngram", "suffix", "probe"])
def test_copy_policy_replay_equals_the_live_rounds(models, traces, mode):
    policy = COPY_POLICIES[mode]
    probe = _Probe()
    cfg = (CopyConfig(gate=probe.fires, layer=LAYER, kappa=policy.kappa) if mode == "probe"
           else CopyConfig.for_mode(mode, kappa=policy.kappa))
    copies = 0
    for prompt, trace in zip(PROMPTS, traces):
        out, live = _live(models, prompt, 4, copy=cfg)
        assert out.token_ids == trace.target_ids
        res = replay_greedy(trace, 4, copy=policy, max_new_tokens=N)
        _same_rounds(live, res.records)
        copies += sum(r.kind == "copy" for r in live)
    assert copies > 0, f"the repetitive prompt must give {mode} copy rounds"


def test_suffix_candidates_take_the_longest_match_first():
    ctx = [1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3]
    # "1 2 3" matched at the start (length 3) beats "2 3" at index 5..6 (length 2).
    assert suffix_candidates(ctx, width=2, depth=2) == [[9, 7], [8, 5]]
    assert suffix_candidates([4, 5], width=1, depth=3) == []
    with pytest.raises(ValueError, match="width"):
        suffix_candidates(ctx, width=0)


def test_trace_checks_and_round_trip(tmp_path, traces):
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(t.to_json() + "\n" for t in traces) + '{"id": "torn')
    back = read_traces(path)
    assert [t.target_ids for t in back] == [t.target_ids for t in traces]
    with pytest.raises(ValueError, match="draft_ids/draft_prob need"):
        Trace("x", "d", [1], [2, 3], [4], [0.5], [0])
    with pytest.raises(ValueError, match="gated by the probe"):
        replay_greedy(Trace("x", "d", [1], [2], [2, 3], [0.9, 0.9], [0]), 2, copy=CopyPolicy("p", gated=True))


def test_decode_batch_equals_one_at_a_time(models):
    """Left-padded batched greedy decoding gives each prompt's own greedy continuation."""
    target, _ = models
    conts = decode_batch(target.model, PROMPTS, 20, eos_ids=target.eos_ids(), pad_id=0)
    for prompt, cont in zip(PROMPTS, conts):
        assert cont == generate_target_only(target, prompt, 20).token_ids


def test_humaneval_chat_answers_are_scored_by_their_code_block():
    from wisv_ros.cli.evaluate import code_block_done, humaneval_program, score
    from wisv_ros.eval.datasets import load_humaneval

    problem = load_humaneval(limit=1)[0]  # HumanEval/0: has_close_elements, imports List from typing
    body = problem.extra["canonical_solution"] if "canonical_solution" in problem.extra else None
    assert body is not None, "the loader keeps the canonical solution"
    answer = f"Here is the function:\n```python\n{problem.prompt}{body}```\nIt compares every pair."
    assert code_block_done(answer) and not code_block_done("```python\ndef f():")
    program = humaneval_program(problem, answer)
    assert program.startswith("from typing import List") and "It compares" not in program
    assert score(problem, answer)
    assert not score(problem, answer.replace("return True", "return False"))


def test_report_prices_the_replayed_logs_and_rewrites_the_readme(tmp_path, traces):
    """evaluate report over replayed round logs: one row per (system, deployment, scenario), the SwitchSD
    claims table, the plots, and the README's text between the markers replaced (and nothing else)."""
    import csv as _csv

    from wisv_ros.cli import evaluate
    from wisv_ros.sd.roundlog import RoundLog

    base = tmp_path / "runs" / "gsm8k"
    (base / "rounds").mkdir(parents=True)
    for system, k, copy in [("target_only", None, None), ("greedy_k8", 8, None), ("greedy_k8+ngram", 8, COPY_POLICIES["ngram"]),
                            ("greedy_k8+suffix", 8, COPY_POLICIES["suffix"]), ("greedy_k8+probe", 8, COPY_POLICIES["probe"])]:
        with RoundLog(base / "rounds" / f"{system}.jsonl", vocab_size=16, hidden_dim=32) as log:
            for t in traces:
                recs = evaluate.target_only_records(t) if k is None else replay_greedy(t, k, copy=copy, max_new_tokens=N).records
                for r in recs:
                    log(r)
    (base / "problems.csv").write_text("id,tokens,correct\np0,60,1\np1,60,0\n")
    # A live system (rejection SD decoded by `evaluate live`): its own round log and accuracy file.
    with RoundLog(base / "rounds" / "reject_k8_t1.jsonl", vocab_size=16, hidden_dim=32) as log:
        for t in traces:
            for r in replay_greedy(t, 8, max_new_tokens=N).records:
                log(r)
    (base / "live_reject_k8_t1.csv").write_text("id,tokens,rounds,correct,wall_s\np0,60,9,0,1.0\np1,60,9,0,1.0\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:begin -->\nold\n<!-- results:end -->\noutro\n")
    results = tmp_path / "results"
    assert evaluate.main(["report", "--dataset", "gsm8k", "--out", str(tmp_path / "runs"), "--results", str(results),
                          "--readme", str(readme), "--bootstrap", "50"]) == 0
    rows = list(_csv.DictReader(open(results / "summary.csv")))
    assert len(rows) == 6 * 2 * 4  # systems x deployments x scenarios
    assert [r["system"] for r in rows][-1] == "reject_k8_t1"  # live systems after the replayed ones
    # Rejection SD is priced with the drafter's distributions on the uplink: the same rounds cost more.
    by_sys = {(r["system"], r["deployment"], r["scenario"]): float(r["ms_per_token"]) for r in rows}
    assert by_sys[("reject_k8_t1", "embedded_default", "20mbps_50ms")] > by_sys[("greedy_k8", "embedded_default", "20mbps_50ms")]
    assert all(float(r["ms_per_token"]) > 0 and float(r["ms_lo"]) <= float(r["ms_per_token"]) <= float(r["ms_hi"]) for r in rows)
    # Copy rounds spare drafting: the n-gram system has copy rounds, plain greedy none.
    by = {(r["system"], r["deployment"], r["scenario"]): r for r in rows}
    assert int(by[("greedy_k8+ngram", "embedded_default", "20mbps_50ms")]["copy_rounds"]) > 0
    assert int(by[("greedy_k8", "embedded_default", "20mbps_50ms")]["copy_rounds"]) == 0
    # A longer RTT costs the split system more per token, never less.
    assert float(by[("greedy_k8", "embedded_default", "20mbps_50ms")]["ms_per_token"]) > float(
        by[("greedy_k8", "embedded_default", "20mbps_5ms")]["ms_per_token"])
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("outro\n") and "SwitchSD against its claims" in text
    assert {p.name for p in results.glob("*.png")} == {"latency_by_scenario.png", "aal_by_k.png", "copy.png"}
    assert "1/2" in (results / "summary.md").read_text()  # accuracy from problems.csv
    assert "reject_k8_t1 on gsm8k 0/2" in text and "| reject_k8_t1 |" in text  # the live system's own accuracy
    # Paired with the greedy answers: p0 flips right -> wrong, p1 stays wrong.
    acc = {r["system"]: r for r in _csv.DictReader(open(results / "accuracy.csv"))}["reject_k8_t1"]
    assert (acc["greedy_correct_same_problems"], acc["right_to_wrong"], acc["wrong_to_right"]) == ("1", "1", "0")
    assert "greedy 1, 1 / 0" in text
    # A live run over problems the replay does not have is refused, naming the fix.
    (base / "live_reject_k8_t1.csv").write_text("id,tokens,rounds,correct,wall_s\np9,60,9,0,1.0\n")
    with pytest.raises(SystemExit, match="not in problems.csv; replay the same data set"):
        evaluate.main(["report", "--dataset", "gsm8k", "--out", str(tmp_path / "runs"), "--results", str(results),
                       "--readme", str(readme), "--bootstrap", "50"])


def test_evaluate_live_decodes_scores_logs_and_resumes(tmp_path):
    """`evaluate live` on real weights (llama.cpp, the 0.5B model drafting for itself, a few tokens):
    one CSV row and one round log per problem; a rerun skips them; a problem cut short is redone and
    its partial rounds dropped."""
    import csv as _csv

    from wisv_ros.cli import evaluate
    from wisv_ros.sd.roundlog import read_round_log

    model = "qwen2.5-coder-0.5b-instruct"
    args = ["live", "--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", "10", "--k", "4", "--target", model,
            "--drafter", model, "--out", str(tmp_path)]
    assert evaluate.main(args) == 0
    csv_path = tmp_path / "gsm8k" / "live_reject_k4_t1.csv"
    log_path = tmp_path / "gsm8k" / "rounds" / "reject_k4_t1.jsonl"
    rows = list(_csv.DictReader(open(csv_path)))
    assert [r["id"] for r in rows] == ["gsm8k-test-0013", "gsm8k-test-0051"]
    records = list(read_round_log(log_path))
    for r in rows:
        mine = [rec for rec in records if rec.request_id == r["id"]]
        assert len(mine) == int(r["rounds"]) > 0 and sum(rec.committed for rec in mine) == int(r["tokens"])
        assert all(rec.method == "reject" for rec in mine)
    # Rerun: nothing new. Then drop the second problem's row (as if stopped mid-problem): redone once.
    assert evaluate.main(args) == 0
    assert len(list(_csv.DictReader(open(csv_path)))) == 2 and len(list(read_round_log(log_path))) == len(records)
    csv_path.write_text("".join(csv_path.read_text().splitlines(keepends=True)[:2]))
    assert evaluate.main(args) == 0
    again = list(read_round_log(log_path))
    assert len(list(_csv.DictReader(open(csv_path)))) == 2
    assert sorted({rec.request_id for rec in again}) == ["gsm8k-test-0013", "gsm8k-test-0051"]
    assert sum(rec.request_id == "gsm8k-test-0051" for rec in again) == int(
        list(_csv.DictReader(open(csv_path)))[1]["rounds"])


def test_evaluate_live_rejects_bad_settings(capsys):
    from wisv_ros.cli import evaluate

    with pytest.raises(SystemExit):
        evaluate.main(["live", "--temperature", "nan"])
    assert "--temperature must be a finite number > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["live", "--k", "0"])
    assert "--k" in capsys.readouterr().err


def test_tau_points_start_at_greedy_and_follow_each_wisv_system(tmp_path):
    """The report's accuracy/latency-against-tau curve: every WISV system decoded live on its own
    channel, plus greedy SD at the same K as tau 0 (the target's greedy accuracy)."""
    from wisv_ros.cli import evaluate

    def row(system, scenario, ms, aal=5.0, dep="embedded_default"):
        return {"dataset": "gsm8k", "system": system, "deployment": dep, "scenario": scenario, "ms_per_token": ms, "aal": aal}

    rows = [row("greedy_k8", "20mbps_50ms", 180.0), row("greedy_k8", "500mbps_5ms", 150.0),
            row("wisv_k8_tau0.1_20mbps_50ms_default", "20mbps_50ms", 150.0, 7.0),
            row("wisv_k8_tau0.1_20mbps_50ms_default", "500mbps_5ms", 120.0),  # not its channel: left out
            row("wisv_k8_tau0.3_20mbps_50ms_default", "20mbps_50ms", 130.0, 8.0),
            row("wisv_k8_tau0.3_20mbps_50ms_default", "20mbps_50ms", 99.0, dep="orin_robot_l4_edge"),
            row("reject_k8_t1", "20mbps_50ms", 300.0)]
    accuracy = [{"dataset": "gsm8k", "system": "target greedy (every replayed system)", "problems": 100, "accuracy": 0.56},
                {"dataset": "gsm8k", "system": "wisv_k8_tau0.1_20mbps_50ms_default", "problems": 100, "accuracy": 0.55},
                {"dataset": "gsm8k", "system": "wisv_k8_tau0.3_20mbps_50ms_default", "problems": 100, "accuracy": 0.5}]
    pts = evaluate.tau_points(rows, accuracy, "embedded_default")
    assert [(p["tau"], p["accuracy"], p["ms_per_token"]) for p in pts] == [(0.0, 0.56, 180.0), (0.1, 0.55, 150.0),
                                                                           (0.3, 0.5, 130.0)]
    assert {p["head"] for p in pts} == {"default"} and {p["channel"] for p in pts} == {"20mbps_50ms"}
    assert evaluate.tau_points(rows[:2], accuracy[:1], "embedded_default") == []
    evaluate._tau_plot(pts, tmp_path / "tau.png")
    assert (tmp_path / "tau.png").stat().st_size > 1000
