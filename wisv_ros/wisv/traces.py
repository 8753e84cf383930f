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

    meta.json          drafter, target, k, max_new_tokens, target_dtype, drafter_dtype, hidden
                       sizes, source (problem generator and seed)
    problems.jsonl     one line per finished problem: id, answer (the final number of the
                       target's own answer, which the labels compare with; null when the
                       answer ran into max_new_tokens: such problems are not labelled), prompt_ids,
                       generated_ids (target vocabulary), rounds
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
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from wisv_ros.eval.datasets import read_jsonl, Problem, build_prompt, extract_final_number, generate_gsm_symbolic
from wisv_ros.sd.acceptance import FLY_TOP_K, topk_entropy
from wisv_ros.sd.drafting import DraftBlock, Drafter, encode_prompt
from wisv_ros.sd.verification import Verdict, Verifier
from wisv_ros.sd.rounds import generate
from wisv_ros.sd.lm import CausalLM

__all__ = ["LABEL_KINDS", "TraceWriter", "answer_complete", "answer_outcomes", "bench_labelling", "branch_features",
           "collect_traces",
           "final_answer", "fly_points", "label_mismatches", "load_traces", "mismatch_features", "reference_answers",
           "same_number", "target_features",
           "task_labels"]

_SHARD_ROWS = 512
# "The answer is 42." / "The answer is $1,234.50" followed by something that is not a digit.
_FINAL_ANSWER = re.compile(r"answer is[^0-9\-]{0,12}-?[\d,]*\.?\d+(?:[^\d,.]|[.,]\D)", re.IGNORECASE)


def answer_complete(text: str) -> bool:
    """True once a GSM-style answer text has stated its final answer ('The answer is N' + more)."""
    return _FINAL_ANSWER.search(text) is not None



class TraceWriter:
    """Appends mismatch records and hidden-state shards to a trace folder (resumable)."""

    def __init__(self, folder: Path, meta: dict):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        meta_path = self.folder / "meta.json"
        if meta_path.is_file():
            old = json.loads(meta_path.read_text())
            for key in ("drafter", "target", "k", "target_dtype", "source"):
                if key in old and old.get(key) != meta.get(key):
                    raise ValueError(
                        f"{meta_path}: {key} is {old.get(key)!r}, this run has {meta.get(key)!r}; "
                        "use another --out folder or the same settings"
                    )
        else:
            meta_path.write_text(json.dumps(meta, indent=1))
        self.done = {p["id"] for p in read_jsonl(self.folder / "problems.jsonl")}
        existing = read_jsonl(self.folder / "mismatches.jsonl")
        self.n_records = len(existing)
        self._shard = 1 + max((r["shard"] for r in existing), default=-1)
        self._rows_d: list[np.ndarray] = []
        self._rows_t: list[np.ndarray] = []
        self._pending: list[dict] = []

    def add_problem(self, problem_id: str, answer: str | None, prompt_ids: list[int], generated: list[int],
                    rounds: int, records: list[dict], h_draft: list[np.ndarray], h_target: list[np.ndarray],
                    extra: dict | None = None) -> None:
        """Store one finished problem with its mismatch records (atomic per problem); ``extra``: more
        fields for its problems.jsonl line."""
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
                                "generated_ids": generated, "rounds": rounds, **(extra or {})}) + "\n")
        self.done.add(problem_id)

    def _flush_shard(self) -> None:
        if not self._rows_d:
            return
        path = self.folder / f"hidden-{self._shard:05d}.npz"
        np.savez(path, h_draft=np.stack(self._rows_d), h_target=np.stack(self._rows_t))
        self._shard += 1
        self._rows_d, self._rows_t = [], []


def _model_name(lm: CausalLM, default: str) -> str:
    """The model's folder name (the registry name for converted models; the GGUF file's name for
    llama.cpp), not its path: a trace folder committed on one machine resumes on another whose
    cache lives elsewhere."""
    if _is_llama_cpp(lm):
        return lm.path.name
    return Path(str(getattr(lm.model.config, "_name_or_path", "") or default)).name


def _is_llama_cpp(lm) -> bool:
    return hasattr(lm, "continue_branches")


def _dtype_name(lm: CausalLM) -> str:
    """torch weights dtype, or ``gguf`` for llama.cpp (the file's own quantisation)."""
    if _is_llama_cpp(lm):
        return "gguf"
    return str(lm.model.dtype).removeprefix("torch.")


def target_features(logits: torch.Tensor, draft: Sequence[int], a: int) -> dict:
    """What the target's own pass says about the mismatch at draft position ``a`` (logits [K+1, V]).

    p_draft / p_target: the target's probability of the draft token and of its own token;
    entropy: of the target's distribution (nats); topk: its FLY_TOP_K largest probabilities;
    agree_after: how many draft tokens after ``a`` equal the target's argmax given the draft so far
    (the next tokens a lenient rule would keep; FLy's deferred window); left: draft tokens after ``a``.
    """
    agree = 0
    for j in range(a + 1, len(draft)):
        if int(logits[j].argmax()) != int(draft[j]):
            break
        agree += 1
    return {**mismatch_features(logits[a], int(draft[a])), "agree_after": agree, "left": len(draft) - a - 1}


def mismatch_features(logits_row: torch.Tensor, draft_id: int) -> dict:
    """The target's distribution at a mismatch (one row of logits): p_draft / p_target, its
    probability of the draft token and of its own token; entropy (nats); topk, its FLY_TOP_K
    largest probabilities."""
    row = torch.softmax(logits_row.float(), dim=-1)
    ent = float(-(row * torch.log(row.clamp_min(1e-30))).sum())
    top = torch.topk(row, FLY_TOP_K).values
    return {"p_draft": round(float(row[int(draft_id)]), 6), "p_target": round(float(top[0]), 6),
            "entropy": round(ent, 5), "topk": [round(float(v), 6) for v in top]}


def branch_features(trace, row: int, draft_id: int) -> dict | None:
    """``mismatch_features`` from a ``BranchTrace`` row (the summary ``branch_pool(trace_top=n)``
    kept of the logits there) instead of the logits themselves; None when the draft token is not
    among the row's n largest (its probability is then unknown)."""
    ids = trace.top_ids[row]
    hit = np.flatnonzero(ids == int(draft_id))
    if not hit.size or trace.top_ids.shape[1] < FLY_TOP_K:
        return None
    lse = float(trace.logsumexp[row])
    top = np.exp(trace.top_logits[row, :FLY_TOP_K].astype(np.float64) - lse)
    return {"p_draft": round(float(np.exp(float(trace.top_logits[row, hit[0]]) - lse)), 6),
            "p_target": round(float(top[0]), 6), "entropy": round(float(trace.entropy[row]), 5),
            "topk": [round(float(v), 6) for v in top]}


def final_answer(text: str, new_tokens: int, budget: int) -> str | None:
    """The final number of an answer ``text`` whose last ``new_tokens`` were generated under a
    ``budget``; None when they ran into the budget before the answer was stated (cut off)."""
    if new_tokens >= budget and not answer_complete(text):
        return None
    return extract_final_number(text)


class _TracingVerifier(Verifier):
    """A greedy verifier that keeps the logits of its last target pass (for ``target_features``)."""

    last_logits: torch.Tensor | None = None

    def target_pass(self, block: DraftBlock):
        tp = super().target_pass(block)
        self.last_logits = tp.logits
        return tp


def collect_traces(
    drafter: CausalLM,
    target: CausalLM,
    problems: Sequence[Problem],
    out: Path,
    k: int,
    max_new_tokens: int,
    progress: Callable[[Iterable], Iterable] = lambda it: it,
    source: str = "",
) -> TraceWriter:
    """Run greedy SD over ``problems`` and record the first mismatch of every round.

    ``source`` names where the problems come from (generator and seed), kept in meta.json.
    """
    writer = TraceWriter(out, {
        "drafter": _model_name(drafter, "drafter"),
        "target": _model_name(target, "target"),
        "k": k, "max_new_tokens": max_new_tokens,
        "target_dtype": _dtype_name(target), "drafter_dtype": _dtype_name(drafter),
        "d_draft": drafter.hidden_size, "d_target": target.hidden_size, "source": source,
    })
    for problem in progress([p for p in problems if p.id not in writer.done]):
        prompt = build_prompt(problem, tokenizer_has_chat_template=bool(target.tokenizer.chat_template))
        records, hd, ht = [], [], []
        round_id = 0

        def on_round(block: DraftBlock, verdict: Verdict, n_before: int) -> None:
            nonlocal round_id
            a = verdict.accepted
            if a < len(block.token_ids):  # the round ended at a mismatch: record it
                records.append({"round_id": round_id, "position": n_before + a, "block_index": a,
                                "draft_id": int(block.token_ids[a]), "target_id": int(verdict.correction_id),
                                **target_features(v.last_logits, block.token_ids, a)})
                hd.append(np.asarray(block.hidden[a]))
                ht.append(verdict.target_hidden[a].numpy())
            round_id += 1

        d = Drafter(drafter, target_tokenizer=target.tokenizer)
        v = _TracingVerifier(target)
        gen = generate(d, v, prompt, max_new_tokens, k, on_round=on_round, stop_text=answer_complete)
        prompt_ids = encode_prompt(target.tokenizer, prompt)
        # An answer cut off by max_new_tokens has no final number to compare with (see load_traces).
        answer = None if len(gen.token_ids) >= max_new_tokens else extract_final_number(gen.text)
        writer.add_problem(problem.id, answer, prompt_ids, gen.token_ids,
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
    label_answers: dict[str, str | None] = dataclasses.field(default_factory=dict)  # uid -> substituted answer


def load_traces(folder: Path) -> Traces:
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    problems = {p["id"]: p for p in read_jsonl(folder / "problems.jsonl")}
    # An answer that ran into max_new_tokens was cut off: whatever number it ends with is not its
    # final answer, so the problem cannot be labelled (its labels, if any, are ignored).
    cut = meta.get("max_new_tokens")
    for p in problems.values():
        if cut is not None and len(p["generated_ids"]) >= cut:
            p["answer"] = None
    # Records of problems that never finished writing (interrupted run) are dropped.
    # A problem redone after an interrupted run appends its records again: the last copy wins.
    by_uid = {r["uid"]: r for r in read_jsonl(folder / "mismatches.jsonl") if r["problem_id"] in problems}
    records = list(by_uid.values())
    shards: dict[int, dict[str, np.ndarray]] = {}
    hd, ht = [], []
    for r in records:
        if r["shard"] not in shards:
            with np.load(folder / f"hidden-{r['shard']:05d}.npz") as z:
                shards[r["shard"]] = {"h_draft": z["h_draft"], "h_target": z["h_target"]}
        hd.append(shards[r["shard"]]["h_draft"][r["row"]])
        ht.append(shards[r["shard"]]["h_target"][r["row"]])
    label_rows = list(read_jsonl(folder / "labels.jsonl"))
    labels = {lab["uid"]: lab["label"] for lab in label_rows}
    d_d, d_t = meta.get("d_draft", 0), meta.get("d_target", 0)
    return Traces(
        meta=meta,
        records=records,
        h_draft=np.stack(hd).astype(np.float32) if hd else np.zeros((0, d_d), np.float32),
        h_target=np.stack(ht).astype(np.float32) if ht else np.zeros((0, d_t), np.float32),
        labels=np.array([labels.get(r["uid"], -1) if problems[r["problem_id"]]["answer"] is not None else -1
                         for r in records], dtype=np.int8),
        problems=problems,
        label_answers={lab["uid"]: lab.get("answer") for lab in label_rows},
    )


# --------------------------------------------------------------------------- labels for a task

LABEL_KINDS = ("critical", "harmful")
_SOURCE = re.compile(r"gsm_symbolic, seed (\d+)")


def reference_answers(tr: Traces) -> dict[str, str]:
    """The true final answer of every problem of a trace folder, regenerated offline from the
    folder's ``source`` (``"gsm_symbolic, seed N"``: ``generate_gsm_symbolic`` is deterministic and
    prefix-stable). Raises ValueError for another source."""
    m = _SOURCE.fullmatch(str(tr.meta.get("source", "")))
    if m is None:
        raise ValueError(f"trace source {tr.meta.get('source')!r} is not 'gsm_symbolic, seed N': "
                         "the true answers cannot be regenerated (use label kind 'critical')")
    # Ids are gsm_symbolic-<seed>-<index in the generator's stream>; problems of excluded templates are
    # skipped there, so the n-th problem generated can have a larger index: generate until all are seen.
    want = set(tr.problems)
    n = max((int(pid.rsplit("-", 1)[1]) for pid in want), default=-1) + 1
    while True:
        gen = {p.id: p.answer for p in generate_gsm_symbolic(n, int(m.group(1)))}
        if want <= gen.keys() or n == 0:
            break
        n *= 2
    missing = want - gen.keys()
    if missing:
        raise ValueError(f"problems {sorted(missing)[:3]} are not in the stream of {tr.meta.get('source')!r}")
    return {pid: gen[pid] for pid in want}


def same_number(a: str | None, b: str | None) -> bool:
    """Two normalised final numbers (``extract_final_number``) are equal; None equals nothing."""
    if a is None or b is None:
        return False
    try:
        return Decimal(str(a)) == Decimal(str(b))
    except InvalidOperation:
        return str(a) == str(b)


def answer_outcomes(tr: Traces, reference: dict[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """Per record: (target_right, substituted_right), booleans [n]: whether the target's own final
    answer to the record's problem is right, and whether the answer with the draft token put in
    (the label's continuation) is right. Unlabelled records are False in the second array."""
    target_right = np.array([same_number(tr.problems[r["problem_id"]]["answer"], reference[r["problem_id"]])
                             for r in tr.records], dtype=bool)
    sub_right = np.array([same_number(tr.label_answers.get(r["uid"]), reference[r["problem_id"]])
                          for r in tr.records], dtype=bool)
    return target_right, sub_right


def task_labels(tr: Traces, kind: str, reference: dict[str, str] | None = None) -> np.ndarray:
    """Base labels b_t of every record for a label ``kind`` (int8 [n], -1 where unlabelled):

    * ``critical`` (the paper's): 1 when the draft token put in changes the final answer;
    * ``harmful``: 1 when it turns a right final answer into a wrong one (needs the true answers,
      ``reference_answers``). A mismatch in an answer the target gets wrong anyway is 0: accepting it
      cannot cost accuracy (and turns the answer right in some cases).
    """
    if kind not in LABEL_KINDS:
        raise ValueError(f"label kind must be one of {', '.join(LABEL_KINDS)}, got {kind!r}")
    if kind == "critical":
        return tr.labels.copy()
    reference = reference if reference is not None else reference_answers(tr)
    target_right, sub_right = answer_outcomes(tr, reference)
    out = (target_right & ~sub_right).astype(np.int8)
    out[tr.labels < 0] = -1
    return out


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


def _shared_prefix_ok(target: CausalLM, longest: int) -> bool:
    """Slices of one KV cache equal a fresh prefill unless a sliding-window layer already dropped
    states: true when no window is in use or the longest sequence fits in it."""
    cfg = target.model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return True
    return longest < window


@torch.inference_mode()
def _continue_shared(target: CausalLM, prefix: list[int], branches: list[tuple[int, int]], max_new_tokens: int,
                     stop: Callable[[str], bool], batch_size: int) -> Iterator[tuple[list[int], list[list[int]]]]:
    """Greedy continuations of ``prefix[:p] + [token]`` for every ``(p, token)`` in ``branches``,
    yielded batch by batch as ``(branch indices, their continuations)``.

    All branches of one answer share its prefix, so one forward pass over the longest prefix fills
    a KV cache, and every batch of branches starts from slices of it (right-aligned, the left
    padding masked out, positions given explicitly) instead of prefilling each context again.
    Each pass then decodes one token for every row of the batch; a row leaves the batch when it
    stops (``stop(text of its new tokens)`` or an end-of-sequence token), so the batch shrinks as
    continuations finish. Same tokens as one-at-a-time greedy decoding up to the float rounding of
    batched matmuls (tested).
    """
    from transformers import DynamicCache

    model, tok, eos = target.model, target.tokenizer, target.eos_ids()
    for p, _ in branches:
        if not 1 <= p <= len(prefix):
            raise ValueError(f"branch point {p} outside [1, {len(prefix)}]")
    n_shared = max(p for p, _ in branches)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prefix[:n_shared]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    shared = [(layer.keys, layer.values) for layer in cache.layers]
    del cache
    order = sorted(range(len(branches)), key=lambda i: -branches[i][0])  # similar prefix lengths together
    for start in range(0, len(order), batch_size):
        active = order[start:start + batch_size]
        members = list(active)
        conts: dict[int, list[int]] = {i: [] for i in active}
        width = max(branches[i][0] for i in active)
        batch = DynamicCache(config=model.config)
        for li, (k, v) in enumerate(shared):
            kb = k.new_zeros((len(active), k.shape[1], width, k.shape[3]))
            vb = v.new_zeros((len(active), v.shape[1], width, v.shape[3]))
            for j, i in enumerate(active):
                p = branches[i][0]
                kb[j, :, width - p:] = k[0, :, :p]
                vb[j, :, width - p:] = v[0, :, :p]
            batch.update(kb, vb, li)
        valid = torch.zeros((len(active), width), dtype=torch.bool)
        for j, i in enumerate(active):
            valid[j, width - branches[i][0]:] = True
        ids = torch.tensor([[branches[i][1]] for i in active])
        pos = torch.tensor([[branches[i][0]] for i in active])
        for _ in range(max_new_tokens):
            valid = torch.cat([valid, torch.ones((len(active), 1), dtype=torch.bool)], dim=1)
            out = model(input_ids=ids, past_key_values=batch, use_cache=True, logits_to_keep=1,
                        attention_mask=valid[:, None, None, :], position_ids=pos)
            nxt = out.logits[:, -1].argmax(-1)
            keep = []
            for j, i in enumerate(active):
                t = int(nxt[j])
                if t in eos:
                    continue
                conts[i].append(t)
                if not stop(tok.decode(conts[i][-48:], skip_special_tokens=True)):
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep)
                batch.batch_select_indices(idx)
                valid, pos, nxt = valid[idx], pos[idx], nxt[idx]
                active = [active[j] for j in keep]
            ids, pos = nxt[:, None], pos + 1
        yield members, [conts[i] for i in members]


def _continue_llama(target, problem: dict, branches: list[tuple[int, int]], max_new_tokens: int, batch_size: int):
    """``LlamaCppLM.continue_branches`` for the mismatches of one answer, each to its final answer.

    Every continuation runs to its final answer: a continuation that runs back into the target's
    own text for a while can still end elsewhere (the substituted token stays in the context). A
    stop at 12 tokens of such agreement ("rejoin") was measured and dropped: it called 8 of the 10
    critical mismatches of 93 not critical (docs/wisv.md)."""
    tok = target.tokenizer

    def stop(_i: int, cont: list[int]) -> bool:
        return answer_complete(tok.decode(cont[-48:], skip_special_tokens=True))

    yield from target.continue_branches(problem["prompt_ids"] + problem["generated_ids"], branches, max_new_tokens,
                                        stop, batch_size)


def label_mismatches(
    target: CausalLM,
    folder: Path,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    limit: int | None = None,
    progress: Callable | None = None,
    shard: tuple[int, int] = (0, 1),
) -> dict:
    """Label the unlabelled mismatches of a trace folder; appends to labels.jsonl (resumable).

    A llama.cpp target (``LlamaCppLM``) continues the branches of one answer in one batched decode
    per token (``continue_branches``); torch targets slice one shared KV cache (``_continue_shared``).

    ``shard=(i, n)`` labels only the problems whose index in problems.jsonl is i modulo n, so that
    n processes (one per core) can label one folder side by side.

    ``max_new_tokens`` caps each continuation (default: the answer budget the traces were collected
    with, so that no substituted answer gets fewer tokens than the target's own had). A
    continuation that reaches the cap without stating a final answer counts as a changed answer
    (critical): the substitution made the target miss its budget.

    Returns {"labelled": n, "critical": n, "seconds": s, "labels_per_hour": r}.
    """
    folder = Path(folder)
    tr = load_traces(folder)
    if tr.meta.get("search"):
        # Its positions index the searched path, not the target's own answer; its labels come with it.
        raise ValueError(f"{folder} is a {tr.meta['search']} search folder: its mismatches are labelled by the search "
                         "(python -m wisv_ros.cli.traces search --out ...)")
    if max_new_tokens is None:
        max_new_tokens = int(tr.meta.get("max_new_tokens", 256))
    want = tr.meta.get("target_dtype")
    if want is not None and want != _dtype_name(target):
        # The labels compare with the target's own answer in the traces: same weights, same dtype.
        raise ValueError(f"{folder} was collected with the target in {want}, this target is "
                         f"{_dtype_name(target)}: label with --target-dtype {want}")
    i_shard, n_shards = shard
    if not 0 <= i_shard < n_shards:
        raise ValueError(f"shard {i_shard}/{n_shards}: need 0 <= i < n")
    mine = {pid for j, pid in enumerate(tr.problems) if j % n_shards == i_shard}
    # Problems whose own answer was cut off before a final number cannot be labelled.
    todo = [i for i, lab in enumerate(tr.labels)
            if lab < 0 and tr.problems[tr.records[i]["problem_id"]]["answer"] is not None
            and tr.records[i]["problem_id"] in mine]
    if limit is not None:
        todo = todo[:limit]
    def context(i: int) -> list[int]:
        r = tr.records[i]
        p = tr.problems[r["problem_id"]]
        return p["prompt_ids"] + p["generated_ids"][: r["position"]] + [r["draft_id"]]

    # One shared prefill per answer (see _continue_shared), unless a sliding window forbids it.
    by_problem: dict[str, list[int]] = {}
    for i in todo:
        by_problem.setdefault(tr.records[i]["problem_id"], []).append(i)
    t0 = time.perf_counter()
    n = crit = 0
    bar = progress(total=len(todo)) if progress else None
    with (folder / "labels.jsonl").open("a") as f:
        for pid, rows in by_problem.items():
            p = tr.problems[pid]
            prefix = p["prompt_ids"] + p["generated_ids"]
            branches = [(len(p["prompt_ids"]) + tr.records[i]["position"], tr.records[i]["draft_id"]) for i in rows]
            if _is_llama_cpp(target):
                runs = _continue_llama(target, p, branches, max_new_tokens, batch_size)
            elif _shared_prefix_ok(target, len(prefix) + max_new_tokens):
                runs = _continue_shared(target, prefix, branches, max_new_tokens, answer_complete, batch_size)
            else:
                runs = ((chunk, _continue_batch(target, [context(rows[j]) for j in chunk], max_new_tokens, answer_complete))
                        for chunk in ([list(range(c, min(c + batch_size, len(rows))))
                                       for c in range(0, len(rows), batch_size)]))
            for chunk, conts in runs:
                for j, cont in zip(chunk, conts):
                    r = tr.records[rows[j]]
                    answer_ids = p["generated_ids"][: r["position"]] + [r["draft_id"]] + cont
                    text = target.tokenizer.decode(answer_ids, skip_special_tokens=True)
                    answer = final_answer(text, len(cont), max_new_tokens)
                    label = int(answer != p["answer"])
                    crit += label
                    f.write(json.dumps({"uid": r["uid"], "label": label, "answer": answer, "new_tokens": len(cont)}) + "\n")
                f.flush()
                n += len(chunk)
                if bar is not None:
                    bar.update(len(chunk))
                    bar.set_postfix(critical=crit, per_hour=round(n / max(time.perf_counter() - t0, 1e-9) * 3600))
    if bar is not None:
        bar.close()
    dt = time.perf_counter() - t0
    return {"labelled": n, "critical": crit, "seconds": round(dt, 1), "labels_per_hour": round(n / dt * 3600) if dt > 0 else 0}


FLY_ENTROPIES = (0.0, 0.2, 0.4, 0.6, 0.8)
FLY_WINDOWS = (1, 2, 4, 6)


def fly_points(traces: Traces | Sequence[Traces], entropies: Sequence[float] = FLY_ENTROPIES,
               windows: Sequence[int] = FLY_WINDOWS) -> list[dict]:
    """What the FLy-style rule (``acceptance.fly_accept``) would accept of the labelled mismatches of
    ``traces`` (one folder or several), per (entropy_min, window): the share of mismatches accepted,
    of critical ones, and of answers where it accepts at least one critical mismatch -- the columns
    of ``train_head --cv``'s tau curve, so that the head and the baseline compare at equal accuracy
    risk. Where every folder's true answers regenerate (``reference_answers``), also the same
    accuracy estimate as the curve's: ``answers_lost``, ``answers_gained``, ``net_lost_per_100``.
    Needs the target features of ``target_features`` (traces collected since they are recorded).
    The windows are those of the traces' blocks (``left``): at a larger K more mismatches have a
    whole window after them."""
    trs = [traces] if isinstance(traces, Traces) else list(traces)
    recs, y, pids, t_right, s_right = [], [], [], [], []
    outcomes = True
    for f, tr in enumerate(trs):
        # Searched folders (wisv_ros.wisv.search) record no agree_after: FLy's window is unknown there.
        rows_ok = [i for i, lab in enumerate(tr.labels) if lab >= 0 and tr.records[i].get("agree_after", 0) is not None]
        recs += [tr.records[i] for i in rows_ok]
        y += [tr.labels[i] == 1 for i in rows_ok]
        pids += [f"{f}:{tr.records[i]['problem_id']}" for i in rows_ok]
        try:
            tgt, sub = answer_outcomes(tr, reference_answers(tr))
            t_right += [bool(tgt[i]) for i in rows_ok]
            s_right += [bool(sub[i]) for i in rows_ok]
        except ValueError:
            outcomes = False
    if not recs:
        raise ValueError("no labelled mismatch with FLy's window (agree_after) in these traces: searched folders "
                         "(traces search) do not record it; pass first-mismatch trace folders")
    if "topk" not in recs[0]:
        raise ValueError("these traces have no target features (topk, agree_after): collect them again")
    y, pids = np.array(y, dtype=bool), np.array(pids)
    t_right, s_right = np.array(t_right, dtype=bool), np.array(s_right, dtype=bool)
    top = torch.tensor([r["topk"] for r in recs], dtype=torch.float64).reshape(len(recs), -1)
    # The recorded top-k probabilities as logits: their softmax is the renormalised top k that
    # the rule's gate (acceptance.topk_entropy) looks at.
    ent = topk_entropy(torch.log(top.clamp_min(1e-30)), top.shape[1]).numpy() if len(recs) else np.zeros(0)
    agree = np.array([r["agree_after"] for r in recs])
    left = np.array([r["left"] for r in recs])
    answers = sorted(set(pids.tolist()))
    idx = {a: pids == a for a in answers}
    out = []
    for w in windows:
        for e in entropies:
            acc = (ent >= e) & (agree >= w) & (left >= w)
            row = {"fly_entropy": e, "fly_window": w, "accepted": float(acc.mean()) if len(acc) else 0.0,
                   "critical_accepted": float(acc[y].mean()) if y.any() else None,
                   "problems_hit": float(np.mean([bool((acc & y)[idx[a]].any()) for a in answers])) if answers else 0.0}
            if outcomes and answers:
                lost = np.mean([bool(t_right[idx[a]].any() and (acc & ~s_right)[idx[a]].any()) for a in answers])
                gained = np.mean([bool(not t_right[idx[a]].any() and (acc & s_right)[idx[a]].any()) for a in answers])
                row.update(answers_lost=float(lost), answers_gained=float(gained), net_lost_per_100=round(100 * float(lost - gained), 3))
            out.append(row)
    return out


def bench_labelling(target: CausalLM, folder: Path, n_branches: int = 8, batch_size: int = 8,
                    max_new_tokens: int = 256, problem_id: str | None = None) -> list[dict]:
    """Time the two ways of producing labels on the same mismatches of one traced answer.

    ``per_context``: every substituted context prefilled on its own, ``batch_size`` rows per
    ``generate`` call (left padding; a batch runs until its longest row stops).
    ``shared_prefix``: one prefill of the answer, rows sliced out of its KV cache and leaving the
    batch as they stop (what :func:`label_mismatches` does). Picks ``n_branches`` mismatches spread
    over the answer (of ``problem_id``, default the first answer with enough of them) and returns one
    row per way: seconds, labels per hour, continuation tokens, and how many continuations equal
    the per-context ones (float rounding of batched matmuls can flip near-ties).
    """
    tr = load_traces(Path(folder))
    by_problem: dict[str, list[int]] = {}
    for i, r in enumerate(tr.records):
        by_problem.setdefault(r["problem_id"], []).append(i)
    if problem_id is None:
        problem_id = next((pid for pid, rows in by_problem.items() if len(rows) >= n_branches), None)
        if problem_id is None:
            raise ValueError(f"{folder}: no traced answer has {n_branches} mismatches; lower n_branches")
    if problem_id not in by_problem:
        raise ValueError(f"{folder}: no mismatches of problem {problem_id!r}")
    rows = by_problem[problem_id]
    rows = [rows[int(j)] for j in np.linspace(0, len(rows) - 1, min(n_branches, len(rows))).round()]
    p = tr.problems[problem_id]
    prefix = p["prompt_ids"] + p["generated_ids"]
    branches = [(len(p["prompt_ids"]) + tr.records[i]["position"], tr.records[i]["draft_id"]) for i in rows]
    results, reference = [], None
    for way in ("per_context", "shared_prefix"):
        t0 = time.perf_counter()
        if way == "per_context":
            conts = []
            for c in range(0, len(branches), batch_size):
                conts += _continue_batch(target, [prefix[:b] + [t] for b, t in branches[c:c + batch_size]],
                                         max_new_tokens, answer_complete)
            reference = conts
        else:
            got: dict[int, list[int]] = {}
            for members, cs in _continue_shared(target, prefix, branches, max_new_tokens, answer_complete, batch_size):
                got.update(zip(members, cs))
            conts = [got[i] for i in range(len(branches))]
        dt = time.perf_counter() - t0
        results.append({"way": way, "problem": problem_id, "labels": len(branches), "batch_size": batch_size,
                        "seconds": round(dt, 2), "labels_per_hour": round(len(branches) / dt * 3600, 1),
                        "continuation_tokens": sum(len(c) for c in conts),
                        "same_as_per_context": sum(a == b for a, b in zip(conts, reference))})
    return results
