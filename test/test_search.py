"""The AutoJudge-style label search (wisv_ros.wisv.search) on the llama.cpp engine, real weights.

Target: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M). Drafter: the same weights with the runner-up token
promoted at every 23rd position (a drafter that disagrees with the target at known places, so
that the test stays a few seconds per answer; the default pair's search is measured in
docs/wisv.md). Every label is checked against an independent reconstruction: the searched path is
replayed from the target's own answer, one token per feed on a fresh cache, keeping exactly the
swaps whose continuation ends at the answer's number.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from wisv_ros.eval.datasets import build_prompt, extract_final_number, generate_gsm_symbolic
from wisv_ros.sd.drafting import encode_prompt
from wisv_ros.sd.llama_cpp_lm import LlamaCppLM
from wisv_ros.wisv.search import oracle_summary, sd_rounds, search_labels
from wisv_ros.wisv.traces import answer_complete, fly_points, label_mismatches, load_traces, same_number

MODEL = "qwen2.5-coder-0.5b-instruct"
EVERY, AT = 23, 11
NEAR_TIE = 0.5  # llama.cpp's batched and one-token passes round differently (test_llama_cpp.py)


class Promoted:
    """A llama.cpp model whose greedy token is its runner-up at absolute positions p with
    p % EVERY == AT (its logits at the row before are swapped there); everything else delegates."""

    def __init__(self, lm: LlamaCppLM, every: int = EVERY):
        self.lm = lm
        self.every = every

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def feed(self, ids, n_logits=1, **kw):
        base = len(self.lm.cached)
        step = self.lm.feed(ids, n_logits=n_logits, **kw)
        n_logits = max(1, min(n_logits, len(ids)))
        logits = step.logits.clone()
        for r in range(logits.shape[0]):
            predicts = base + len(ids) - n_logits + r + 1
            if predicts % self.every == AT:
                top2 = torch.topk(logits[r], 2).indices
                logits[r, top2[0]], logits[r, top2[1]] = logits[r, top2[1]].item(), logits[r, top2[0]].item()
        step.logits = logits
        return step


def test_sd_rounds_counts_blocks_corrections_and_accepted_mismatches():
    path = list(range(10))
    draft = list(range(10))
    assert sd_rounds(path, draft, 4) == 2  # [0..3]+bonus 4, [5..8]+bonus 9
    draft[2] = -1
    assert sd_rounds(path, draft, 4) == 3  # correction at 2, then [3..6]+7, [8, 9]
    assert sd_rounds(path, draft, 4, rejected=set()) == 2  # the mismatch accepted: as if none
    draft[6] = -1
    assert sd_rounds(path, draft, 4, rejected={6}) == 3  # [0..3] (2 accepted) + 4, [5, 6] corrected at 6, [7..9]


def _greedy(lm, context, n, stop=None):
    """Greedy continuation of ``context``, one token per feed on a fresh cache."""
    lm.reset()
    out, todo = [], list(context)
    for _ in range(n):
        tok = int(lm.feed(todo, n_logits=1).logits[-1].argmax())
        if tok in lm.eos_ids():
            break
        out.append(tok)
        todo = [tok]
        if stop is not None and stop(out):
            break
    return out


def _near_tie(lm, context, a, b) -> bool:
    """Two greedy continuations of ``context`` part at a near-tie of the model (or not at all)."""
    if a == b:
        return True
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lm.reset()
    top2 = torch.topk(lm.feed(list(context) + a[:i], n_logits=1).logits[-1], 2).values
    return float(top2[0] - top2[1]) < NEAR_TIE


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    out = tmp_path_factory.mktemp("search")
    target = LlamaCppLM.from_gguf(MODEL, n_ctx=4096, threads=1, n_seq_max=4, n_sessions=2)
    drafter = Promoted(LlamaCppLM.from_gguf(MODEL, n_ctx=2048, threads=1, n_seq_max=2, n_sessions=2,
                                            tokenizer=target.tokenizer))
    problems = generate_gsm_symbolic(2, seed=7)
    # Stopped after 3 labels, then resumed: the second run replays what the first decoded.
    first = search_labels(drafter, target, problems, out, k=8, max_new_tokens=200, slots=2, source="gsm_symbolic, seed 7",
                          limit=3)
    saved = (out / "partial.jsonl").read_text()
    rest = search_labels(drafter, target, problems, out, k=8, max_new_tokens=200, slots=2, source="gsm_symbolic, seed 7")
    stats = {key: first[key] + rest[key] for key in ("problems", "labelled", "critical", "kept", "adopted", "replayed")}
    yield out, target, drafter, problems, dict(stats, first=first, saved=saved)
    target.close()
    drafter.lm.close()


def test_search_labels_follow_the_path_the_kept_swaps_make(searched):
    out, target, drafter, problems, stats = searched
    tok = target.tokenizer
    lines = [json.loads(x) for x in (out / "problems.jsonl").read_text().splitlines()]
    assert stats["problems"] == len(lines) == 2 and stats["labelled"] > 0
    labels = {x["uid"]: x for x in map(json.loads, (out / "labels.jsonl").read_text().splitlines())}
    records = [json.loads(x) for x in (out / "mismatches.jsonl").read_text().splitlines()]
    assert len(labels) == len(records) == stats["labelled"]
    assert sum(x["label"] for x in labels.values()) == stats["critical"]
    # Every kept swap decoded here took the target's pass from its branch (adopt): the drafter's
    # token is the target's runner-up, always among the logits a branch row keeps.
    assert stats["kept"] > 0 and stats["adopted"] == stats["kept"]
    checked = 0
    for line, problem in zip(sorted(lines, key=lambda x: x["id"]), sorted(problems, key=lambda p: p.id)):
        prompt = encode_prompt(tok, build_prompt(problem, tokenizer_has_chat_template=True))
        assert line["prompt_ids"] == prompt
        own = _greedy(target, prompt, 200, lambda c: answer_complete(tok.decode(c[-48:], skip_special_tokens=True)))
        assert _near_tie(target, prompt, line["generated_ids"], own)
        if line["generated_ids"] != own:
            continue  # parted at a near-tie: the rest would check another answer
        if len(own) >= 200 and not answer_complete(tok.decode(own, skip_special_tokens=True)):
            # Cut off before a final number: nothing to compare a label with, so no label.
            assert line["answer"] is None and not any(r["problem_id"] == line["id"] for r in records)
            continue
        assert line["answer"] == extract_final_number(tok.decode(own, skip_special_tokens=True)) is not None
        final, path, ok = line["path_ids"], list(own), True
        mine = sorted((r for r in records if r["problem_id"] == line["id"]), key=lambda r: r["round_id"])
        kept = [r["position"] for r in mine if r["kept"]]
        for r in mine:
            j, d = r["position"], r["draft_id"]
            if checked >= 6:  # enough one-token decodes for the suite's time; the rest is checked through the path
                ok = False
                break
            assert d != path[j] == r["target_id"] and path[:j] == final[:j]  # later swaps change only what follows
            # The drafter's greedy token there, on the path so far, is the draft token.
            drafter.reset()
            logits = drafter.feed(prompt + path[:j], n_logits=1).logits[-1]
            if int(logits.argmax()) != d:
                assert float(logits.max() - logits[d]) < NEAR_TIE  # the search's batched pass rounded the other way
                ok = False
                break
            cont = _greedy(target, prompt + path[:j] + [d], 200,
                           lambda c: answer_complete(tok.decode(c[-48:], skip_special_tokens=True)))
            lab = labels[f"{line['id']}:{r['round_id']}"]
            # What is known of the search's own continuation: for a kept swap, the path up to the next kept swap.
            later = [q for q in kept if q > j]
            known = final[j + 1:later[0]] if r["kept"] and later else final[j + 1:] if r["kept"] else None
            if len(cont) != lab["new_tokens"] or (known is not None and cont[:len(known)] != known):
                # The search decoded the branch beside other rows on a cache filled by a block pass: the
                # two decodes may part where the target's top two tokens nearly tie, and only there.
                if known is not None:
                    assert _near_tie(target, prompt + path[:j] + [d], known, cont[:len(known)])
                ok = False
                break
            answer = extract_final_number(tok.decode(path[:j] + [d] + cont, skip_special_tokens=True))
            assert lab["answer"] == answer and lab["label"] == int(not same_number(answer, line["answer"]))
            assert r["kept"] == (lab["label"] == 0)
            if lab["label"] == 0:
                path = path[:j] + [d] + cont
            checked += 1
        if ok:  # every label replayed: the replayed path is the searched one
            assert path == final
        assert line["kept"] == kept and all(final[j] == r["draft_id"] for r in mine if r["kept"] for j in [r["position"]])
        # The rounds: greedy SD on the own answer, and on the searched path with its kept swaps accepted.
        drafter.reset()
        d_arg = drafter.feed(prompt + own, n_logits=len(own) + 1).logits[:-1].argmax(-1).tolist()
        assert line["rounds"] == sd_rounds(own, d_arg, 8)
        drafter.reset()
        d_arg = drafter.feed(prompt + final, n_logits=len(final) + 1).logits[:-1].argmax(-1).tolist()
        assert line["search_rounds"] == sd_rounds(final, d_arg, 8, rejected={j for j in range(len(final)) if j not in kept})
    assert checked >= 3


def test_a_stopped_search_resumes_where_it_stopped(searched):
    """The first run stopped after 3 labels with its answers under way; the second replayed them
    from partial.jsonl: every label decoded once, the saved ones kept as they were."""
    out, target, drafter, problems, stats = searched
    assert stats["first"]["labelled"] == 3 and stats["first"]["problems"] == 1  # the answer cut off at 200 tokens
    assert stats["first"]["replayed"] == 0 and stats["replayed"] == 1  # the second run replayed the answer under way
    saved = [json.loads(x) for x in stats["saved"].splitlines()]
    assert sum(1 for x in saved if x["n"] == -1) == 2  # both answers' own text
    events = [x for x in saved if x["n"] >= 0]
    assert len(events) == 3
    labels = [json.loads(x) for x in (out / "labels.jsonl").read_text().splitlines()]
    uids = [x["uid"] for x in labels]
    assert len(uids) == len(set(uids)) == stats["labelled"]  # no label twice, none decoded again
    by_uid = {x["uid"]: x for x in labels}
    for ev in events:
        lab = by_uid[f"{ev['problem_id']}:{ev['n']}"]
        assert (lab["answer"], lab["new_tokens"]) == (ev["answer"], ev["new_tokens"])
        assert (lab["label"] == 0) == (ev["cont"] is not None)
    # The replay fed the target once, at its end: each replayed record still has the target's view
    # of its mismatch on the text it was judged on (the final path up to it).
    tr = load_traces(out)
    assert any(ev["cont"] is not None for ev in events)  # a kept swap among them: its text changed the path
    for ev in events:
        i = next(i for i, r in enumerate(tr.records) if r["problem_id"] == ev["problem_id"] and r["round_id"] == ev["n"])
        r, p = tr.records[i], tr.problems[ev["problem_id"]]
        assert (r["position"], r["draft_id"]) == (ev["j"], ev["d"])
        target.reset()
        step = target.feed(p["prompt_ids"] + p["path_ids"][:r["position"]], n_logits=1)
        assert abs(float(torch.softmax(step.logits[-1], -1)[r["draft_id"]]) - r["p_draft"]) < 0.02
        h = step.hidden[-1].numpy()
        assert float(h @ tr.h_target[i] / np.linalg.norm(h) / np.linalg.norm(tr.h_target[i])) > 0.999
    # The finished answers' lines are dropped from partial.jsonl when the next run starts.
    search_labels(drafter, target, problems, out, k=8, max_new_tokens=200, slots=2, source="gsm_symbolic, seed 7")
    assert (out / "partial.jsonl").read_text() == ""


def test_a_replay_follows_the_saved_walk_where_its_drafter_rounds_otherwise(searched, tmp_path):
    """A replay's drafter pass may round a near-tie the other way and meet another mismatch first.
    Made certain here: the fixture's first run (stopped after 3 labels) is resumed by a drafter that
    promotes its runner-up at other positions, so on its own it would meet none of the saved
    mismatches. The replay still follows the saved walk: every saved event is kept as it was (none
    decoded again, partial.jsonl not rewritten from it) and the next label is the first one decoded."""
    from wisv_ros.wisv.search import _load_partial

    _, target, drafter, problems, stats = searched
    (tmp_path / "partial.jsonl").write_text(stats["saved"])
    pid = next(x["problem_id"] for x in map(json.loads, stats["saved"].splitlines()) if x["n"] >= 0)
    one = [p for p in problems if p.id == pid]
    saved = _load_partial(tmp_path / "partial.jsonl", set())[pid][1]
    n_prompt = len(encode_prompt(target.tokenizer, build_prompt(one[0], tokenizer_has_chat_template=True)))
    assert len(saved) == 3 and all((n_prompt + ev["j"]) % EVERY == AT for ev in saved)  # the first drafter's
    other = Promoted(drafter.lm, every=EVERY + 6)
    rest = search_labels(other, target, one, tmp_path, k=8, max_new_tokens=200, slots=1, limit=1)
    assert rest["replayed"] == 1 and rest["labelled"] == 1
    events = [x for x in map(json.loads, (tmp_path / "partial.jsonl").read_text().splitlines())
              if x["n"] >= 0 and x["problem_id"] == pid]
    assert events[:3] == saved and [x["n"] for x in events] == [0, 1, 2, 3]  # appended after, not rewritten
    assert events[3]["j"] > saved[-1]["j"] and (n_prompt + events[3]["j"]) % (EVERY + 6) == AT  # the new drafter's


def test_search_folder_trains_resumes_and_refuses_relabelling(searched, capsys):
    out, target, drafter, problems, stats = searched
    tr = load_traces(out)
    assert tr.meta["search"] == "autojudge" and (tr.labels >= 0).all() and len(tr.labels) == stats["labelled"]
    assert tr.h_draft.shape == (len(tr.labels), drafter.hidden_size) and np.isfinite(tr.h_target).all()
    # The recorded target hidden state is the row the target's prediction at the mismatch comes from.
    r = tr.records[0]
    p = tr.problems[r["problem_id"]]
    target.reset()
    step = target.feed(p["prompt_ids"] + p["generated_ids"][:r["position"]], n_logits=1)
    if r["round_id"] == 0:  # the first mismatch is on the target's own answer
        h = step.hidden[-1].numpy()
        assert float(h @ tr.h_target[0] / np.linalg.norm(h) / np.linalg.norm(tr.h_target[0])) > 0.999
        assert abs(float(torch.softmax(step.logits[-1], -1)[r["draft_id"]]) - r["p_draft"]) < 0.02
    again = search_labels(drafter, target, problems, out, k=8, max_new_tokens=200, slots=2, source="gsm_symbolic, seed 7")
    assert again["problems"] == 0 and len(load_traces(out).labels) == len(tr.labels)
    with pytest.raises(ValueError, match="search folder"):
        label_mismatches(target, out)
    summary = oracle_summary(out)
    answered = [p for p in tr.problems.values() if p["answer"] is not None]
    assert summary["answers"] == len(answered) and summary["kept"] == stats["kept"]
    assert summary["oracle_rounds"] == sum(p["search_rounds"] for p in answered)
    assert summary["oracle_aal"] == round(sum(len(p["path_ids"]) for p in answered) / summary["oracle_rounds"], 3)
    lo, hi = (float(v) for v in summary["aal_gain_ci"].strip("[]").split(","))
    assert lo - 1e-3 <= summary["aal_gain"] <= hi + 1e-3
    assert oracle_summary([out, out]) == summary  # one answer counted once, however often its folder is named
    with pytest.raises(ValueError, match="agree_after"):  # the search records no FLy window
        fly_points(tr)
    from wisv_ros.cli.train_head import episodes_from_traces

    episodes, ids, meta, outcomes = episodes_from_traces([out], label="harmful")
    assert sum(len(e.labels) for e in episodes) == len(tr.labels) and all(o is not None for o in outcomes)


def test_head_on_labels_judges_every_labelled_mismatch():
    """The shipped head on a committed (training) trace folder: every labelled mismatch judged,
    acceptance grows with tau, and the harmful ones rank above the rest."""
    from pathlib import Path

    from wisv_ros.wisv.search import head_on_labels

    folder = Path(__file__).resolve().parents[1] / "data" / "traces" / "qwen_s1"
    tr = load_traces(folder)
    rep = head_on_labels(folder.parents[2] / "config" / "heads" / "qwen.onnx", [folder], "20mbps_50ms",
                         taus=(0.0, 0.01, 0.05, 1.01))
    assert rep["mismatches"] == int((tr.labels >= 0).sum()) and rep["critical"] == int((tr.labels == 1).sum())
    acc = [r["accepted"] for r in rep["taus"]]
    assert acc[0] == 0.0 and acc[-1] == 1.0 and acc == sorted(acc)
    assert rep["auc_harmful"] > 0.5 and rep["auc_critical"] > 0.5
    # At an equal share accepted, a head that ranks above chance lets fewer harmful ones through.
    assert [r["share"] for r in rep["shares"]] == [0.2, 0.35, 0.5]
    harmful = [r["harmful_accepted"] for r in rep["shares"]]
    assert harmful == sorted(harmful) and harmful[-1] < 0.5
    with pytest.raises(ValueError, match="no labelled"):
        head_on_labels(folder.parents[2] / "config" / "heads" / "qwen.onnx", [], "20mbps_50ms")
