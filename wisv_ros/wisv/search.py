"""Labels along the path the accepted tokens take (AutoJudge's search), for the WISV decision head.

``traces.collect_traces`` + ``traces.label_mismatches`` label every mismatch as the first one a
block meets on the target's *own* answer. Once WISV accepts a mismatch, the text goes on from the
draft token, and the later mismatches are those of that other text. This search labels them:

1. The target answers greedily (the answer A0 and its final number).
2. Walk the answer in greedy-SD rounds of K draft tokens: the drafter's greedy token at a position
   is its argmax given the path so far (teacher-forced; exactly what it drafts in a block). At the
   first mismatch of the round, put the draft token in place of the target's and let the target
   finish greedily to its final number. Label 0 when the number equals A0's: the swap is *kept*,
   the path becomes the branch (draft token + continuation) and the round goes on past it, as WISV
   accepting it would. Label 1 (critical) otherwise: the round ends with the target's token (a
   correction), and the next round starts after it.
3. Repeat to the end of the path.

Each label is a branch continued to its final answer (no shortcut: docs/wisv.md), as in
``label_mismatches``. One answer's branches depend on each other, so the batch is formed *across*
answers: ``slots`` answers are searched at once, each with its own KV sequence on the target and
the drafter, and one ``llama_decode`` advances the running branch of every answer by a token
(``LlamaCppLM.branch_pool``). Needs a llama.cpp target and drafter that share the tokenizer.

Output: a trace folder in the format of ``traces.py`` (meta.json carries ``"search":
"autojudge"``), with the labels already in labels.jsonl, so ``train_head --traces`` takes it as it
is; plus ``partial.jsonl``, the branch results of answers under way (``{"problem_id", "n": -1,
"own_ids"}`` for the target's own answer, then ``{"problem_id", "n", "j", "d", "answer",
"new_tokens", "cont"}`` per label, ``cont`` the continuation of a kept swap), from which a stopped
run resumes without decoding them again. Each problems.jsonl line also holds the searched path and the round counts of greedy SD on A0
and of the search's path: the search keeps every swap that leaves the answer as it is, so its
rounds are those of an *oracle* head that accepts every harmless mismatch on the path and loses no
answer, the most a head can gain at zero loss (``oracle_summary``). ``agree_after`` (FLy's window)
is not recorded here: FLy is evaluated by decoding (``evaluate tokenwise --method fly``).

Runtime code does not import this module. No rclpy.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from wisv_ros.eval.datasets import Problem, build_prompt, read_jsonl
from wisv_ros.eval.latency import bootstrap_ci
from wisv_ros.eval.scoring import roc_auc
from wisv_ros.sd.drafting import encode_prompt
from wisv_ros.wisv.traces import (TraceWriter, answer_complete, branch_features, final_answer, mismatch_features,
                                  same_number)

__all__ = ["SEARCH", "head_on_labels", "oracle_summary", "search_labels", "sd_rounds"]

SEARCH = "autojudge"
TRACE_TOP = 64  # logits of each branch row kept for the features of a later mismatch (BranchTrace)


def sd_rounds(path: Sequence[int], draft_argmax: Sequence[int], k: int, rejected: set[int] | None = None) -> int:
    """Rounds greedy SD with K draft tokens takes over ``path`` when the drafter's greedy token at
    each position is ``draft_argmax`` and every mismatch not accepted ends its round with a
    correction. ``rejected``: the mismatches that end a round (None: all of them, greedy SD). A full
    block ends its round with the target's bonus token."""
    n, r, rounds = len(path), 0, 0
    while r < n:
        rounds += 1
        end = min(r + k, n)
        j = next((j for j in range(r, end) if draft_argmax[j] != path[j] and (rejected is None or j in rejected)), None)
        r = end + 1 if j is None else j + 1
    return rounds


@dataclasses.dataclass
class _Side:
    """One model's teacher-forced view of an answer's path, per path index p (0 .. len(path)): the
    hidden state its prediction of path[p] comes from (the state a block's draft token / the
    verifier's row has there); the drafter's argmax there; the target's ``mismatch_features`` at
    the indices where that argmax differs from the path (the mismatches a walk can meet)."""

    hidden: list[np.ndarray] = dataclasses.field(default_factory=list)
    argmax: list[int] = dataclasses.field(default_factory=list)
    feats: dict[int, dict] = dataclasses.field(default_factory=dict)


def _feed_path(lm, session: int, prompt: list[int], path: list[int]) -> tuple[int, torch.Tensor, np.ndarray]:
    """Feed what ``lm``'s session lacks of prompt + path (``sync`` rolls back to the common prefix);
    return (path index the first returned row predicts, logits, hidden) of the rows predicting
    path indices >= 0."""
    lm.use(session)
    pending = lm.sync(prompt + path)
    first = len(path) - len(pending) + 1
    step = lm.feed(pending, n_logits=len(pending))
    skip = max(0, -first)
    return first + skip, step.logits[skip:], step.hidden[skip:].numpy()


def _refresh(target, drafter, a: "_Answer", branch: tuple[int, object] | None = None,
             drafter_only: bool = False) -> bool:
    """Bring both models' views of ``a.path`` up to date (after the path changed).

    ``branch`` = (j, BranchTrace): the path just became ``path[:j] + [draft token] + the branch's
    continuation`` and the target decoded that branch (``branch_pool(trace_top=...)``). The target
    then takes the branch's cells (``adopt``), hidden states and logit summaries instead of a second
    pass over the same tokens; it feeds only the continuation's last token. Where a mismatch's
    draft token is not among a branch row's kept logits, the target is fed again from j (as without
    ``branch``). Returns whether the branch was used.

    ``drafter_only``: the drafter's view only (what a replayed walk needs to find its mismatches);
    the target catches up once the replay ends (``_catch_up``)."""
    if drafter_only:
        _take_drafter(a, *_feed_path(drafter, a.session, a.prompt, a.path))
        return False
    used = False
    if branch is not None:
        j, trace = branch
        target.adopt(a.session, trace)
        used = True
    f_d, logits_d, hid_d = _feed_path(drafter, a.session, a.prompt, a.path)
    f_t, logits_t, hid_t = _feed_path(target, a.session, a.prompt, a.path)
    if used and not (f_d == j + 1 and j + 1 <= f_t <= j + 1 + len(trace.fed)):
        used = False  # the caches are not where a kept swap at j leaves them: feed the target again
    if used:
        n_tr = f_t - j - 1  # path indices j+1 .. f_t-1 come from the branch rows 0 .. n_tr-1
        d_arg = logits_d.argmax(-1).tolist()
        feats = {}
        for q in range(f_d, len(a.path)):
            if d_arg[q - f_d] != a.path[q]:
                f = (branch_features(trace, q - j - 1, d_arg[q - f_d]) if q < f_t
                     else mismatch_features(logits_t[q - f_t], d_arg[q - f_d]))
                if f is None:
                    used = False
                    break
                feats[q] = f
    if not used and branch is not None:
        target.use(a.session)
        target.rollback(min(len(target.cached), len(a.prompt) + f_d - 1))
        f_t, logits_t, hid_t = _feed_path(target, a.session, a.prompt, a.path)
    if f_t != f_d and not used:  # both sessions hold the same prompt + path history
        raise RuntimeError(f"target and drafter caches disagree on {a.problem.id} (rows from {f_t} and {f_d})")
    if used:
        del a.t.hidden[j + 1:]
        a.t.hidden.extend(trace.hidden[i] for i in range(n_tr))
    _take_rows(a.t, f_t, hid_t)
    _take_drafter(a, f_d, logits_d, hid_d)
    if used:
        for q in [q for q in a.t.feats if q >= f_d]:
            del a.t.feats[q]
        a.t.feats.update(feats)
    else:
        _take_target_features(a, f_t, logits_t)
    assert len(a.t.hidden) == len(a.d.hidden) == len(a.d.argmax) == len(a.path) + 1
    return used


def _take_rows(side: "_Side", first: int, hid: np.ndarray) -> None:
    """A fed model's hidden rows replace ``side``'s from path index ``first`` on."""
    del side.hidden[first:]
    side.hidden.extend(hid[i] for i in range(len(hid)))


def _take_drafter(a: "_Answer", first: int, logits: torch.Tensor, hid: np.ndarray) -> None:
    """The drafter's fed rows: its hidden states and greedy tokens from path index ``first`` on."""
    _take_rows(a.d, first, hid)
    del a.d.argmax[first:]
    a.d.argmax.extend(logits.argmax(-1).tolist())


def _take_target_features(a: "_Answer", first: int, logits: torch.Tensor) -> None:
    """The target's features at the path indices from ``first`` on where the drafter disagrees."""
    for q in [q for q in a.t.feats if q >= first]:
        del a.t.feats[q]
    for q in range(first, len(a.path)):
        if a.d.argmax[q] != a.path[q]:
            a.t.feats[q] = mismatch_features(logits[q - first], a.d.argmax[q])


def _catch_up(target, a: "_Answer") -> None:
    """After a replay: one target pass over the answer's final path gives its view of the path and
    the features of every replayed record (``a.stale``). A kept swap changes only what follows its
    mismatch, so the final path holds the text each replayed mismatch was judged on up to it."""
    f_t, logits_t, hid_t = _feed_path(target, a.session, a.prompt, a.path)
    _take_rows(a.t, f_t, hid_t)
    _take_target_features(a, f_t, logits_t)
    for rid, j, d in a.stale:
        if j < f_t:
            raise RuntimeError(f"{a.problem.id}: the target's cache starts past replayed mismatch {j} (row {f_t})")
        rec = a.records[rid]
        feats = mismatch_features(logits_t[j - f_t], d)
        a.records[rid] = _record(rec["round_id"], j, rec["block_index"], d, rec["target_id"], feats, rec["left"], rec["kept"])
        a.ht[rid] = a.t.hidden[j]
    a.stale.clear()
    assert len(a.t.hidden) == len(a.d.hidden) == len(a.path) + 1


def _follow(a: "_Answer", j: int, d: int) -> bool:
    """Make a replayed walk meet the saved event's mismatch: the saved run's drafter agreed with
    the path from where the walk stands up to ``j`` and drafted ``d`` there. The replay's drafter
    pass (another batch, another rounding in llama.cpp) may round a near-tie the other way; its
    argmax is set to the saved walk's so that the replay keeps every saved label instead of
    decoding them again. False where the event cannot be on this walk (a saved file that does not
    belong to this path)."""
    if not (a.q <= j < len(a.path)) or int(d) == a.path[j]:
        return False
    for p in range(a.q, j):
        a.d.argmax[p] = a.path[p]
    a.d.argmax[j] = int(d)
    return True


def _record(rid: int, j: int, block_index: int, d: int, target_id: int, feats: dict, left: int, kept: bool) -> dict:
    """One mismatches.jsonl line of the search (no FLy window: ``agree_after`` None)."""
    return {"round_id": rid, "position": j, "block_index": block_index, "draft_id": d, "target_id": target_id,
            **feats, "agree_after": None, "left": left, "kept": kept}


@dataclasses.dataclass
class _Answer:
    problem: Problem
    session: int
    prompt: list[int]
    a0: str | None = None
    a0_ids: list[int] | None = None
    path: list[int] = dataclasses.field(default_factory=list)
    t: _Side = dataclasses.field(default_factory=_Side)
    d: _Side = dataclasses.field(default_factory=_Side)
    r: int = 0  # round start (path index)
    q: int = 0  # next path index to check
    rounds: int = 0
    kept: list[int] = dataclasses.field(default_factory=list)
    greedy_rounds: int = 0
    records: list[dict] = dataclasses.field(default_factory=list)
    hd: list[np.ndarray] = dataclasses.field(default_factory=list)
    ht: list[np.ndarray] = dataclasses.field(default_factory=list)
    labels: list[dict] = dataclasses.field(default_factory=list)
    waiting: tuple[int, int] | None = None  # (path index, draft token) of the running branch
    stale: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # replayed (record, j, d): no target features yet
    done: bool = False


def _load_partial(path: Path, done: set[str]) -> dict[str, tuple[list[int], list[dict]]]:
    """What unfinished answers of an earlier run decoded: problem id -> (the target's own answer,
    its label events in order). A later line for the same event replaces an earlier one (an answer
    whose replay parted from its saved walk wrote its events again from there); events stop at the
    first gap."""
    lines: dict[str, dict[int, dict]] = {}
    for line in read_jsonl(path):
        if line["problem_id"] not in done:
            by_n = lines.setdefault(line["problem_id"], {})
            n = int(line["n"])
            for later in [m for m in by_n if m > n]:  # written again from n: what followed is stale
                del by_n[later]
            by_n[n] = line
    out = {}
    for pid, by_n in lines.items():
        if -1 not in by_n:
            continue
        events, n = [], 0
        while n in by_n:
            events.append(by_n[n])
            n += 1
        out[pid] = (by_n[-1]["own_ids"], events)
    return out


def search_labels(
    drafter, target, problems: Sequence[Problem], out: Path, k: int, max_new_tokens: int, slots: int = 16,
    progress: Callable | None = None, source: str = "", max_path: int | None = None, limit: int | None = None,
) -> dict:
    """AutoJudge-style search over ``problems`` (module docstring); appends to the trace folder
    ``out``. Resumable without losing work: every branch result of an answer under way goes to
    ``partial.jsonl`` as it comes (the target's own answer, then each label with its continuation
    where the swap was kept), and a later run replays an unfinished answer from there instead of
    decoding it again (following the saved walk's mismatches, ``_follow``). ``limit``: stop after
    this many new labels (the answers under way stay in partial.jsonl). ``drafter`` and ``target``
    are ``LlamaCppLM`` with at least ``slots`` sessions (the target also ``slots`` more sequences
    for the branches: ``n_seq_max >= 2 * slots``). ``max_path`` caps a searched path (default 2 * max_new_tokens): the search of an
    answer stops there.

    Returns {"problems", "labelled", "critical", "kept", "adopted" (kept swaps whose target pass came from
    the branch, ``_refresh``), "seconds", "labels_per_hour", "new_tokens"}.
    """
    if not hasattr(target, "branch_pool") or not hasattr(drafter, "use"):
        raise ValueError("the search runs on llama.cpp: pass --target-backend llama_cpp --drafter-backend llama_cpp")
    if drafter.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError("the search needs a drafter with the target's tokenizer (its draft tokens are target tokens)")
    if target.n_sessions < slots or drafter.n_sessions < slots:
        raise ValueError(f"slots {slots}: open both models with n_sessions >= {slots} "
                         f"(target {target.n_sessions}, drafter {drafter.n_sessions})")
    if k < 1 or max_new_tokens < 1:
        raise ValueError(f"k and max_new_tokens must be >= 1 (got {k}, {max_new_tokens})")
    max_path = max_path or 2 * max_new_tokens
    for s in range(slots):  # the walk assumes both models' sessions start empty (a model used before may not)
        target.drop(s)
        drafter.drop(s)
    writer = TraceWriter(out, {
        "drafter": drafter.path.name, "target": target.path.name, "k": k, "max_new_tokens": max_new_tokens,
        "target_dtype": "gguf", "drafter_dtype": "gguf", "d_draft": drafter.hidden_size,
        "d_target": target.hidden_size, "source": source, "search": SEARCH,
    })
    todo = [p for p in problems if p.id not in writer.done]
    partial_path = writer.folder / "partial.jsonl"
    partial = _load_partial(partial_path, writer.done)
    with partial_path.open("w") as f:  # keep the lines of unfinished answers only
        for pid, (own, events) in partial.items():
            f.write(json.dumps({"problem_id": pid, "n": -1, "own_ids": own}) + "\n")
            for ev in events:
                f.write(json.dumps(ev) + "\n")
    tok = target.tokenizer
    chat = bool(tok.chat_template)
    free_sessions = list(range(slots - 1, -1, -1))
    running: dict[str, _Answer] = {}
    queue = list(reversed(todo))
    stats = {"problems": 0, "labelled": 0, "critical": 0, "kept": 0, "adopted": 0, "new_tokens": 0,
             "replayed": 0, "replay_seconds": 0.0}
    t0 = time.perf_counter()
    bar = progress(total=len(todo)) if progress else None

    def finish(a: _Answer) -> None:
        if a.stale:  # replayed to its end: the target's features of the replayed records
            _catch_up(target, a)
        # Labels first, then the problem line (add_problem): a crash in between leaves a problem
        # that is searched again, and its labels' second copy wins on load.
        with (writer.folder / "labels.jsonl").open("a") as f:
            for lab in a.labels:
                f.write(json.dumps(lab) + "\n")
        writer.add_problem(a.problem.id, a.a0, a.prompt, a.a0_ids or [], a.greedy_rounds, a.records, a.hd, a.ht,
                           extra={"search": SEARCH, "path_ids": a.path, "search_rounds": a.rounds,
                                  "kept": a.kept})
        target.drop(a.session)
        drafter.drop(a.session)
        free_sessions.append(a.session)
        del running[a.problem.id]
        a.done = True
        stats["problems"] += 1
        if bar is not None:
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.update(1)
            bar.set_postfix(labels=stats["labelled"], critical=stats["critical"], kept=stats["kept"],
                            per_hour=round(stats["labelled"] / dt * 3600))

    def advance(a: _Answer):
        """Walk ``a``'s rounds to its next mismatch; return its branch job, or None when finished."""
        n = len(a.path)
        while a.r < n and a.r < max_path:
            end = min(a.r + k, n)
            j = next((j for j in range(a.q, end) if a.d.argmax[j] != a.path[j]), None)
            if j is None:
                a.rounds += 1
                a.r = a.q = end + 1
                continue
            a.waiting = (j, int(a.d.argmax[j]))
            return (a.problem.id, a.session, len(a.prompt) + j, a.waiting[1])
        finish(a)
        return None

    def next_branch():
        # Answers under way first (each has at most one branch running), then a new answer.
        for a in list(running.values()):
            if a.waiting is None and a.a0_ids is not None and not a.done:
                job = advance(a)
                if job is not None:
                    return job
        while free_sessions and queue:
            p = queue.pop()
            s = free_sessions.pop()
            prompt = encode_prompt(tok, build_prompt(p, tokenizer_has_chat_template=chat))
            a = running[p.id] = _Answer(problem=p, session=s, prompt=prompt)
            if p.id in partial:  # under way in an earlier run: replay what it decoded
                t_replay = time.perf_counter()
                own, events = partial[p.id]
                own_answer(a, own, save=False)
                job = None
                for ev in events:
                    if a.done or not _follow(a, ev["j"], ev["d"]):
                        break  # the saved walk does not fit this path: decode from here
                    job = advance(a)
                    if job is None or a.waiting != (ev["j"], ev["d"]):
                        break  # the walk did not reach it (past max_path, or a block's last token): decode from here
                    resolve(a, ev.get("cont"), ev["answer"], ev["new_tokens"], save=False)
                    job = None
                if not a.done:  # decoding goes on from here: the target catches up with the path first
                    _catch_up(target, a)
                stats["replayed"] += 1
                stats["replay_seconds"] += time.perf_counter() - t_replay
                if bar is not None:
                    bar.set_postfix(replayed=stats["replayed"], replay_s=round(stats["replay_seconds"]))
                if job is None and not a.done:
                    job = advance(a)
                if job is not None:
                    return job
                continue
            target.use(s)
            target.sync(prompt)  # the session holds prompt[:-1] (sync leaves the last id to feed)
            if len(prompt) > 1:
                target.prefill(prompt[:-1])
            a.waiting = (-1, prompt[-1])
            return (p.id, s, len(prompt) - 1, prompt[-1])  # the target's own answer first
        return None

    def save_partial(line: dict) -> None:
        with partial_path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def own_answer(a: _Answer, cont: list[int], save: bool = True) -> None:
        a.waiting = None
        a.a0_ids = list(cont)
        a.path = list(cont)
        if save:
            save_partial({"problem_id": a.problem.id, "n": -1, "own_ids": a.a0_ids})
        a.a0 = final_answer(tok.decode(cont, skip_special_tokens=True), len(cont), max_new_tokens)
        if a.a0 is None:  # no final number: nothing to compare labels with
            finish(a)
            return
        _refresh(target, drafter, a, drafter_only=not save)  # a replay: the target catches up at its end
        a.greedy_rounds = sd_rounds(a.path, a.d.argmax, k)

    def resolve(a: _Answer, cont: list[int] | None, answer: str | None, new_tokens: int, save: bool = True,
                trace=None) -> None:
        """The label of the running branch from its final ``answer``; ``cont`` (its tokens) is
        needed where the swap is kept, ``trace`` (its BranchTrace) spares the target a second pass
        over it then."""
        j, d = a.waiting
        a.waiting = None
        label = int(not same_number(answer, a.a0))
        rid = len(a.records)
        if save:
            save_partial({"problem_id": a.problem.id, "n": rid, "j": j, "d": d, "answer": answer,
                          "new_tokens": new_tokens, "cont": None if label else cont})
        a.records.append(_record(rid, j, j - a.r, d, int(a.path[j]), {} if not save else a.t.feats[j],
                                 k - (j - a.r) - 1, not label))
        a.hd.append(a.d.hidden[j])
        a.ht.append(None if not save else a.t.hidden[j])
        if not save:  # a replay: the target's features come with _catch_up
            a.stale.append((rid, j, d))
        a.labels.append({"uid": f"{a.problem.id}:{rid}", "label": label, "answer": answer, "new_tokens": new_tokens})
        if save:
            stats["labelled"] += 1
            stats["critical"] += label
            stats["new_tokens"] += new_tokens
        if label:  # the round ends with the target's correction
            a.rounds += 1
            a.r = a.q = j + 1
        else:  # kept: the path follows the draft token; the round goes on past it
            a.kept.append(j)
            if save:
                stats["kept"] += 1
            a.path = a.path[:j] + [d] + list(cont)
            if _refresh(target, drafter, a, None if trace is None else (j, trace), drafter_only=not save):
                stats["adopted"] += 1
            a.q = j + 1

    def on_result(a: _Answer, cont: list[int], trace) -> None:
        if a.a0_ids is None:  # the target's own answer
            own_answer(a, cont)
            return
        j, d = a.waiting
        text = tok.decode(a.path[:j] + [d] + cont, skip_special_tokens=True)
        resolve(a, cont, final_answer(text, len(cont), max_new_tokens), len(cont), trace=trace)

    def stop(_key, cont: list[int]) -> bool:
        return answer_complete(tok.decode(cont[-48:], skip_special_tokens=True))

    pool = target.branch_pool(next_branch, max_new_tokens, stop, slots, trace_top=TRACE_TOP)
    try:
        for key, cont, trace in pool:
            on_result(running[key], cont, trace)
            if limit is not None and stats["labelled"] >= limit:
                break  # the answers under way resume from partial.jsonl
    finally:
        pool.close()  # frees the running branches' sequences
        for a in list(running.values()):
            target.drop(a.session)
            drafter.drop(a.session)
    if bar is not None:
        bar.close()
    dt = time.perf_counter() - t0
    stats.update(seconds=round(dt, 1), labels_per_hour=round(stats["labelled"] / dt * 3600) if dt > 0 else 0,
                 replay_seconds=round(stats["replay_seconds"], 1))
    return stats


def oracle_summary(folders: Path | str | Sequence[Path | str], n_boot: int = 2000, seed: int = 0) -> dict:
    """Greedy SD against the search's oracle path over the answers of one or more searched folders:
    tokens, rounds and AAL (tokens per round) of each, the AAL gain of accepting every mismatch the
    search kept, and its 95 % bootstrap interval over answers (``aal_gain_ci``, ``n_boot`` resamples)."""
    if isinstance(folders, (str, Path)):
        folders = [folders]
    by_id = {}
    for folder in folders:  # a problem searched twice: the last line wins
        by_id.update((p["id"], p) for p in read_jsonl(Path(folder) / "problems.jsonl")
                     if p.get("search") == SEARCH and p.get("answer") is not None)
    rows = list(by_id.values())

    def gain(rs: list[dict]) -> float:
        g = sum(len(p["generated_ids"]) for p in rs) / max(1, sum(p["rounds"] for p in rs))
        o = sum(len(p["path_ids"]) for p in rs) / max(1, sum(p["search_rounds"] for p in rs))
        return o / g - 1 if g else 0.0

    g_tok = sum(len(p["generated_ids"]) for p in rows)
    g_rounds = sum(p["rounds"] for p in rows)
    o_tok = sum(len(p["path_ids"]) for p in rows)
    o_rounds = sum(p["search_rounds"] for p in rows)
    g_aal = g_tok / g_rounds if g_rounds else 0.0
    o_aal = o_tok / o_rounds if o_rounds else 0.0
    ci = bootstrap_ci(rows, gain, n=n_boot, seed=seed) if rows else (0.0, 0.0)
    return {"answers": len(rows), "greedy_tokens": g_tok, "greedy_rounds": g_rounds, "greedy_aal": round(g_aal, 3),
            "oracle_tokens": o_tok, "oracle_rounds": o_rounds, "oracle_aal": round(o_aal, 3),
            "aal_gain": round(o_aal / g_aal - 1, 4) if g_aal else 0.0,
            "aal_gain_ci": f"[{ci[0]:+.3f}, {ci[1]:+.3f}]",
            "rounds_change": round(o_rounds / g_rounds - 1, 4) if g_rounds else 0.0,
            "kept": sum(len(p["kept"]) for p in rows)}


def _auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    value = roc_auc(scores, labels)
    return None if np.isnan(value) else round(value, 4)


def head_on_labels(head_path: Path, folders: Sequence[Path], channel: str,
                   taus: Sequence[float] = (0.01, 0.02, 0.03, 0.05),
                   shares: Sequence[float] = (0.2, 0.35, 0.5)) -> dict:
    """A decision head's rejection probabilities on the labelled mismatches of ``folders`` (searched
    or not), the channel fixed to the scenario ``channel``: AUC against critical and harmful labels,
    and per τ the share of mismatches it accepts (probability < τ), of critical ones, of harmful
    ones; and per share of mismatches accepted (the ones it is least inclined to reject), the shares
    of critical and harmful ones among them (``shares``). On searched folders of problems the head
    never trained on, this is how it judges the mismatches on the path accepted tokens take."""
    from wisv_ros.link.channel import scenario
    from wisv_ros.wisv.head import OnnxHead
    from wisv_ros.wisv.traces import load_traces, reference_answers, task_labels

    head = OnnxHead(head_path)
    feats = scenario(channel).features()
    probs, crit, harm = [], [], []
    for folder in folders:
        tr = load_traces(Path(folder))
        ok = tr.labels >= 0
        if not ok.any():
            continue
        c = np.repeat(np.asarray(feats, dtype=np.float32)[None], int(ok.sum()), axis=0)
        probs.append(head.reject_prob(tr.h_draft[ok], tr.h_target[ok], c))
        crit.append(tr.labels[ok] == 1)
        harm.append(task_labels(tr, "harmful", reference_answers(tr))[ok] == 1)
    if not probs:
        raise ValueError(f"no labelled mismatches in {', '.join(map(str, folders))}")
    p, y_c, y_h = np.concatenate(probs), np.concatenate(crit), np.concatenate(harm)
    rows = []
    for tau in taus:
        acc = p < tau
        rows.append({"tau": tau, "accepted": round(float(acc.mean()), 4),
                     "critical_accepted": round(float(acc[y_c].mean()), 4) if y_c.any() else None,
                     "harmful_accepted": round(float(acc[y_h].mean()), 4) if y_h.any() else None})
    # Heads are calibrated differently: compare them where they accept the same share of mismatches.
    at_share = []
    for share in shares:
        n = int(round(share * len(p)))
        acc = np.zeros(len(p), dtype=bool)
        acc[np.argsort(p, kind="stable")[:n]] = True  # the n least likely to be rejected
        at_share.append({"share": share, "tau": round(float(p[acc].max()), 4) if n else 0.0,
                         "critical_accepted": round(float(acc[y_c].mean()), 4) if y_c.any() else None,
                         "harmful_accepted": round(float(acc[y_h].mean()), 4) if y_h.any() else None})
    return {"mismatches": len(p), "critical": int(y_c.sum()), "harmful": int(y_h.sum()),
            "auc_critical": _auc(p, y_c), "auc_harmful": _auc(p, y_h), "taus": rows, "shares": at_share}
