"""Stage 1 of training the WISV decision head: mismatch traces and task-driven base labels.

Traces. Greedy speculative decoding runs over calibration problems (GSM8K-style problems generated
offline by ``datasets.generate_gsm_symbolic``, never the GSM8K test problems). Each round that ends
at a mismatch (the target's argmax differs from the draft token) yields one record: the drafter
hidden state that proposed the draft token, the target hidden state at that position, the position
in the answer, the draft and the target token. Only the *first* mismatch of a block is recorded:
its context (prompt + the target's own greedy answer so far) is exactly what greedy SD and WISV see,
so its label is well defined.

Labels (Judge Decoding / AutoJudge style). Put the draft token in place of the target's, let the
target finish greedily, and compare the final numeric answer with the one the target gives on its
own: 1 = critical (the answer changes, the mismatch must be repaired), 0 = harmless. Continuations
run in batches (one batched target pass advances many of them) and stop at their final answer.

On-disk format of a trace folder (all appends, so runs resume where they stopped):

    meta.json          drafter, target, k, dtype, hidden sizes, problem source and seed
    problems.jsonl     one line per finished problem: id, answer (reference final number),
                       prompt_ids, generated_ids (target vocabulary), rounds
    mismatches.jsonl   one line per mismatch: uid, problem_id, round_id, position (index in the
                       generated answer), block_index, draft_id, target_id, shard, row
    hidden-NNNNN.npz   h_draft [n, d_draft] and h_target [n, d_target] (float16), rows as above
    labels.jsonl       one line per labelled mismatch: uid, label (0/1), answer (the final number
                       of the substituted continuation or null), new_tokens

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from .datasets import Problem, build_prompt, extract_final_number
from .decoding import DraftBlock, Drafter, Verdict, Verifier, encode_prompt, generate
from .lm import CausalLM

__all__ = ["TraceWriter", "collect_traces", "label_mismatches", "load_traces", "answer_complete"]

_SHARD_ROWS = 512
# "The answer is 42." / "The answer is $1,234.50" followed by something that is not a digit.
_FINAL_ANSWER = re.compile(r"answer is[^0-9\-]{0,12}-?[\d,]*\.?\d+(?:[^\d,.]|[.,]\D)", re.IGNORECASE)


def answer_complete(text: str) -> bool:
    """True once a GSM-style answer text has stated its final answer ('The answer is N' + more)."""
    return _FINAL_ANSWER.search(text) is not None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from an interrupted run: ignore it
    return out


class TraceWriter:
    """Appends mismatch records and hidden-state shards to a trace folder (resumable)."""

    def __init__(self, folder: Path, meta: dict):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        meta_path = self.folder / "meta.json"
        if meta_path.is_file():
            old = json.loads(meta_path.read_text())
            for key in ("drafter", "target", "k"):
                if old.get(key) != meta.get(key):
                    raise ValueError(
                        f"{meta_path}: {key} is {old.get(key)!r}, this run has {meta.get(key)!r}; "
                        "use another --out folder or the same settings"
                    )
        else:
            meta_path.write_text(json.dumps(meta, indent=1))
        self.done = {p["id"] for p in _read_jsonl(self.folder / "problems.jsonl")}
        existing = _read_jsonl(self.folder / "mismatches.jsonl")
        self.n_records = len(existing)
        self._shard = 1 + max((r["shard"] for r in existing), default=-1)
        self._rows_d: list[np.ndarray] = []
        self._rows_t: list[np.ndarray] = []
        self._pending: list[dict] = []

    def add_problem(self, problem_id: str, answer: str | None, prompt_ids: list[int], generated: list[int],
                    rounds: int, records: list[dict], h_draft: list[np.ndarray], h_target: list[np.ndarray]) -> None:
        """Store one finished problem with its mismatch records (atomic per problem)."""
        for rec, hd, ht in zip(records, h_draft, h_target):
            rec = dict(rec, uid=f"{problem_id}:{rec['round_id']}", problem_id=problem_id,
                       shard=self._shard, row=len(self._rows_d))
            self._pending.append(rec)
            self._rows_d.append(hd.astype(np.float16))
            self._rows_t.append(ht.astype(np.float16))
        # Hidden shard first, then the index lines, then the problem line: a crash in between
        # leaves a problem that is simply redone (its half-written lines are ignored on load).
        self._flush_shard()
        with (self.folder / "mismatches.jsonl").open("a") as f:
            for rec in self._pending:
                f.write(json.dumps(rec) + "\n")
        self.n_records += len(self._pending)
        self._pending = []
        with (self.folder / "problems.jsonl").open("a") as f:
            f.write(json.dumps({"id": problem_id, "answer": answer, "prompt_ids": prompt_ids,
                                "generated_ids": generated, "rounds": rounds}) + "\n")
        self.done.add(problem_id)

    def _flush_shard(self) -> None:
        if not self._rows_d:
            return
        path = self.folder / f"hidden-{self._shard:05d}.npz"
        np.savez(path, h_draft=np.stack(self._rows_d), h_target=np.stack(self._rows_t))
        self._shard += 1
        self._rows_d, self._rows_t = [], []


def collect_traces(
    drafter: CausalLM,
    target: CausalLM,
    problems: Sequence[Problem],
    out: Path,
    k: int,
    max_new_tokens: int,
    progress: Callable[[Iterable], Iterable] = lambda it: it,
) -> TraceWriter:
    """Run greedy SD over ``problems`` and record the first mismatch of every round."""
    writer = TraceWriter(out, {
        "drafter": getattr(drafter.model.config, "_name_or_path", "drafter"),
        "target": getattr(target.model.config, "_name_or_path", "target"),
        "k": k, "max_new_tokens": max_new_tokens,
        "d_draft": drafter.hidden_size, "d_target": target.hidden_size,
    })
    for problem in progress([p for p in problems if p.id not in writer.done]):
        prompt = build_prompt(problem, tokenizer_has_chat_template=bool(target.tokenizer.chat_template))
        records, hd, ht = [], [], []
        round_id = 0

        def on_round(block: DraftBlock, verdict: Verdict, n_before: int) -> None:
            nonlocal round_id
            a = verdict.accepted_count
            if a < len(block.token_ids):  # the round ended at a mismatch: record it
                records.append({"round_id": round_id, "position": n_before + a, "block_index": a,
                                "draft_id": int(block.token_ids[a]), "target_id": int(verdict.correction_id)})
                hd.append(np.asarray(block.hidden[a]))
                ht.append(verdict.target_hidden[a].numpy())
            round_id += 1

        d = Drafter(drafter, target_tokenizer=target.tokenizer)
        gen = generate(d, Verifier(target), prompt, max_new_tokens, k, on_round=on_round, stop_text=answer_complete)
        prompt_ids = encode_prompt(target.tokenizer, prompt)
        writer.add_problem(problem.id, extract_final_number(gen.text), prompt_ids, gen.token_ids,
                           gen.stats.rounds, records, hd, ht)
    return writer


@dataclasses.dataclass
class Traces:
    """A trace folder loaded into memory (``labels`` holds -1 where not labelled yet)."""

    meta: dict
    records: list[dict]
    h_draft: np.ndarray  # [n, d_draft] float32
    h_target: np.ndarray  # [n, d_target] float32
    labels: np.ndarray  # [n] int8
    problems: dict[str, dict]


def load_traces(folder: Path) -> Traces:
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    problems = {p["id"]: p for p in _read_jsonl(folder / "problems.jsonl")}
    # Records of problems that never finished writing (interrupted run) are dropped.
    # A problem redone after an interrupted run appends its records again: the last copy wins.
    by_uid = {r["uid"]: r for r in _read_jsonl(folder / "mismatches.jsonl") if r["problem_id"] in problems}
    records = list(by_uid.values())
    shards: dict[int, dict[str, np.ndarray]] = {}
    hd, ht = [], []
    for r in records:
        if r["shard"] not in shards:
            with np.load(folder / f"hidden-{r['shard']:05d}.npz") as z:
                shards[r["shard"]] = {"h_draft": z["h_draft"], "h_target": z["h_target"]}
        hd.append(shards[r["shard"]]["h_draft"][r["row"]])
        ht.append(shards[r["shard"]]["h_target"][r["row"]])
    labels = {lab["uid"]: lab["label"] for lab in _read_jsonl(folder / "labels.jsonl")}
    d_d, d_t = meta.get("d_draft", 0), meta.get("d_target", 0)
    return Traces(
        meta=meta,
        records=records,
        h_draft=np.stack(hd).astype(np.float32) if hd else np.zeros((0, d_d), np.float32),
        h_target=np.stack(ht).astype(np.float32) if ht else np.zeros((0, d_t), np.float32),
        labels=np.array([labels.get(r["uid"], -1) for r in records], dtype=np.int8),
        problems=problems,
    )


@torch.inference_mode()
def _continue_batch(target: CausalLM, contexts: list[list[int]], max_new_tokens: int,
                    stop: Callable[[str], bool]) -> list[list[int]]:
    """Greedy continuations of several contexts in one batch (left padding); each row stops when
    ``stop(text of its new tokens)`` is true or at an end-of-sequence token."""
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(target.eos_ids()))
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c)
        mask[i, width - len(c):] = 1
    eos = target.eos_ids()
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            new = input_ids[:, width:]
            done = []
            for row in new.tolist():
                text = tok.decode(row[-48:], skip_special_tokens=True)
                done.append(any(t in eos for t in row) or stop(text))
            return torch.tensor(done, dtype=torch.bool)

    out = target.model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=pad, stopping_criteria=StoppingCriteriaList([_Stop()]),
    )
    result = []
    for row in out[:, width:].tolist():
        cut = []
        for t in row:
            if t in eos:
                break
            cut.append(t)
        result.append(cut)
    return result


def label_mismatches(
    target: CausalLM,
    folder: Path,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    limit: int | None = None,
    progress: Callable | None = None,
) -> dict:
    """Label the unlabelled mismatches of a trace folder; appends to labels.jsonl (resumable).

    Returns {"labelled": n, "critical": n, "seconds": s, "labels_per_hour": r}.
    """
    folder = Path(folder)
    tr = load_traces(folder)
    # Problems whose own answer was cut off before a final number cannot be labelled.
    todo = [i for i, lab in enumerate(tr.labels)
            if lab < 0 and tr.problems[tr.records[i]["problem_id"]]["answer"] is not None]
    if limit is not None:
        todo = todo[:limit]
    # Similar lengths in one batch waste less padding.
    def context(i: int) -> list[int]:
        r = tr.records[i]
        p = tr.problems[r["problem_id"]]
        return p["prompt_ids"] + p["generated_ids"][: r["position"]] + [r["draft_id"]]

    todo.sort(key=lambda i: len(context(i)))
    t0 = time.perf_counter()
    n = crit = 0
    bar = progress(total=len(todo)) if progress else None
    with (folder / "labels.jsonl").open("a") as f:
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            conts = _continue_batch(target, [context(i) for i in batch], max_new_tokens, answer_complete)
            for i, cont in zip(batch, conts):
                r = tr.records[i]
                p = tr.problems[r["problem_id"]]
                answer_ids = p["generated_ids"][: r["position"]] + [r["draft_id"]] + cont
                answer = extract_final_number(target.tokenizer.decode(answer_ids, skip_special_tokens=True))
                label = int(answer != p["answer"])
                crit += label
                f.write(json.dumps({"uid": r["uid"], "label": label, "answer": answer, "new_tokens": len(cont)}) + "\n")
            f.flush()
            n += len(batch)
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(critical=crit, per_hour=round(n / max(time.perf_counter() - t0, 1e-9) * 3600))
    if bar is not None:
        bar.close()
    dt = time.perf_counter() - t0
    return {"labelled": n, "critical": crit, "seconds": round(dt, 1), "labels_per_hour": round(n / dt * 3600) if dt > 0 else 0}
