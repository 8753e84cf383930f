"""Which inputs could a stronger decision head use? Grouped cross-validated AUC of simple models on
feature sets of the labelled mismatches, against harmful and critical labels.

    python tools/head_features.py --traces data/traces/qwen --traces data/traces/qwen_s1 \\
        --traces data/traces/qwen_s2 --traces data/traces/qwen_s3 --csv docs/results/wisv/head_features.csv

Feature sets (all per mismatch, from the trace records):

* ``target``: what the verifier knows from the target's logits: log p_target(draft token),
  log p_target(target token), their difference, the entropy, the top-2 probabilities, the draft
  token's rank among the top 8, the block index and the position in the answer;
* ``text``: both tokens' text: a digit, whitespace only, punctuation only, a leading space,
  letters only, an arithmetic sign; and whether both read the same ignoring case and spaces;
* ``hidden``: the first 64 whitened principal components of [h_D; h_T] (fit on the training folds);
  the head's first layer can fold such a projection in, so this needs no new input.
* with ``--after``, ``after``: the target's hidden state after it reads the draft token (the row of
  the verifier's block pass at the draft token: free at run time, a target state that has seen the
  swap); ``hidden+after`` whitens [h_D; h_T; h_after] together. The traces do not hold it: it is
  computed with the llama.cpp target (``after_states``, about 10 s an answer here) and cached.
* with ``--window``, ``window``: what the FLy rule reads after the mismatch: how many of the next
  draft tokens (at most ``FLY_WINDOW``) the target's argmax given the draft agrees with, that count
  over the tokens the block has left (at most ``FLY_WINDOW``), and whether all of them agree (the
  traces' ``agree_after``; free at run time in the verifier's block pass). Only the target's-own-text
  traces record it; a searched folder is refused.
* with ``--down``, ``down0`` .. ``down16``: the target's hidden state further down the swapped text:
  after it reads the draft token and the next 0, 4, 8 or 16 tokens of its own greedy continuation
  from there (``DOWN_OFFSETS``; fewer where the continuation ends sooner). At run time the verifier's
  block pass holds such a state for a mismatch at least that many draft tokens before the block's
  end, read on the drafter's continuation; a decision taken that late would have to hold the tokens
  after the mismatch back until it is made. ``hidden+downW`` whitens [h_D; h_T; h_downW] together.
  Computed with the llama.cpp target (``down_states``: the continuations of an answer's mismatches
  decoded side by side) and cached.

Models: L2 logistic regression and a one-hidden-layer MLP (64 units, dropout 0.5, weight decay),
both full-batch Adam in torch, trained on ``critical`` or ``harmful`` labels. Folds are grouped by
answer (5 folds, the same split for every row). This is a screen with fixed settings, not the
head's training (``wisv_ros.cli.train_head``: CSI relabeling, epoch choice on held-out answers).
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wisv_ros.eval.scoring import roc_auc  # noqa: E402
from wisv_ros.sd.acceptance import FLY_WINDOW  # noqa: E402
from wisv_ros.wisv.traces import load_traces, reference_answers, task_labels  # noqa: E402

SIGNS = set("+-*/=$%")


def target_features(r: dict) -> list[float]:
    top = np.asarray(r["topk"], dtype=float)
    lp_d, lp_t = np.log(r["p_draft"] + 1e-6), np.log(r["p_target"] + 1e-6)
    rank = float((top > r["p_draft"] + 1e-9).sum())
    return [lp_d, lp_t, lp_t - lp_d, r["entropy"], top[0], top[1], rank, r["block_index"], r["position"] / 100.0]


def token_features(text: str) -> list[float]:
    s = text.strip()
    return [any(c.isdigit() for c in text), s == "", bool(s) and not any(c.isalnum() for c in s),
            text.startswith(" "), s.isalpha(), any(c in SIGNS for c in text)]


def window_features(r: dict) -> list[float]:
    if r.get("agree_after") is None:
        raise ValueError(f"{r['uid']}: no agree_after in the record (searched traces do not record the FLy window; "
                         "screen --window on the target's-own-text traces)")
    agree, room = min(int(r["agree_after"]), FLY_WINDOW), min(int(r["left"]), FLY_WINDOW)
    return [agree, agree / max(room, 1), float(agree >= room)]


def load(folders: list[str], tokenizer: str, after_cache: Path | None = None, target: str = "", window: bool = False,
         down_cache: Path | None = None):
    from transformers import AutoTokenizer

    from wisv_ros.sd.models import resolve
    tok = AutoTokenizer.from_pretrained(resolve(tokenizer))
    rows = {"target": [], "text": [], "window": [], "hd": [], "ht": [], "ha": [], "hdown": [], "critical": [], "harmful": [],
            "group": []}
    for folder in folders:
        tr = load_traces(Path(folder))
        ha = (cached_states(folder, tr, after_cache, target, "after", after_states, n_seq_max=1)
              if after_cache is not None else None)
        hdown = (cached_states(folder, tr, down_cache, target, "down", down_states, n_seq_max=17,
                               meta={"offsets": DOWN_OFFSETS}) if down_cache is not None else None)
        ref = reference_answers(tr)
        crit, harm = task_labels(tr, "critical", ref), task_labels(tr, "harmful", ref)
        for i, r in enumerate(tr.records):
            if tr.labels[i] < 0 or harm[i] < 0:
                continue
            d, t = tok.decode([r["draft_id"]]), tok.decode([r["target_id"]])
            rows["target"].append(target_features(r))
            rows["text"].append(token_features(d) + token_features(t) + [d.strip().lower() == t.strip().lower()])
            if window:
                rows["window"].append(window_features(r))
            rows["hd"].append(tr.h_draft[i])
            rows["ht"].append(tr.h_target[i])
            if ha is not None:
                rows["ha"].append(ha[i])
            if hdown is not None:
                rows["hdown"].append(hdown[i])
            rows["critical"].append(int(crit[i]))
            rows["harmful"].append(int(harm[i]))
            rows["group"].append(f"{folder}:{r['problem_id']}")
    return {k: np.asarray(v, dtype=object if k == "group" else np.float32) for k, v in rows.items()}


def by_answer(records: list[dict], problems: dict[str, dict], searched: bool):
    """The records grouped by answer: ``(problem, text, record indices)`` per answer, text being the
    answer its mismatches were met on (the searched path, whose text before a mismatch never changes
    later, or the target's own answer). A record whose position is past its text is refused."""
    by_pid: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_pid.setdefault(r["problem_id"], []).append(i)
    for pid, rows in by_pid.items():
        p = problems[pid]
        text = p["path_ids"] if searched else p["generated_ids"]
        for i in rows:
            if int(records[i]["position"]) > len(text):
                raise ValueError(f"{records[i]['uid']}: position {records[i]['position']} is past its answer "
                                 f"({len(text)} tokens)")
        yield p, text, rows


def after_states(records: list[dict], problems: dict[str, dict], target, searched: bool, progress=None) -> np.ndarray:
    """The target's final-norm hidden state after it reads each record's draft token: the last row of
    a feed of prompt + text[:position] + [draft_id], text being the answer the mismatch was met on
    (the searched path, whose text before a mismatch never changes later, or the target's own
    answer). ``target``: a ``LlamaCppLM``; each answer's records reuse its cache up to the
    previous one. Returns [len(records), d_T] float16."""
    out = np.zeros((len(records), target.hidden_size), np.float16)
    target.use(0)
    for p, text, rows in by_answer(records, problems, searched):
        for i in sorted(rows, key=lambda i: records[i]["position"]):
            r = records[i]
            j = int(r["position"])
            pending = target.sync(p["prompt_ids"] + text[:j] + [int(r["draft_id"])])
            out[i] = target.feed(pending, n_logits=1).hidden[-1].numpy().astype(np.float16)
        if progress is not None:
            progress.update(1)
    return out


def cached_states(folder: str, tr, cache: Path, target_spec: str, name: str, compute, n_seq_max: int,
                  meta: dict | None = None) -> np.ndarray:
    """States of a trace folder's records from ``cache/<folder name>.npz`` (array ``h_<name>`` by uid;
    ignored where its ``meta`` arrays differ), ``compute(records, problems, lm, searched, progress)``
    with the llama.cpp target ``target_spec`` for the rest, 20 answers at a time, the cache rewritten after each."""
    path = cache / f"{Path(folder).name}.npz"
    meta = {k: np.asarray(v) for k, v in (meta or {}).items()}
    have: dict[str, np.ndarray] = {}
    if path.is_file():
        with np.load(path) as z:
            if all(k in z and np.array_equal(z[k], v) for k, v in meta.items()):
                have = dict(zip(z["uid"].tolist(), z[f"h_{name}"]))
    missing = [r for r in tr.records if r["uid"] not in have]
    if missing:
        from wisv_ros.sd.llama_cpp_lm import LlamaCppLM
        pids = list(dict.fromkeys(r["problem_id"] for r in missing))
        cache.mkdir(parents=True, exist_ok=True)
        with LlamaCppLM.from_gguf(target_spec, n_ctx=4096, threads=1, n_seq_max=n_seq_max, n_sessions=1) as lm, \
                tqdm(total=len(pids), desc=f"{name} states {Path(folder).name}", unit="answer") as bar:
            for start in range(0, len(pids), 20):
                chunk = set(pids[start:start + 20])
                part = [r for r in missing if r["problem_id"] in chunk]
                got = compute(part, tr.problems, lm, tr.meta.get("search") is not None, progress=bar)
                have.update(zip([r["uid"] for r in part], got))
                np.savez_compressed(path, uid=np.array(list(have)), **{f"h_{name}": np.stack(list(have.values()))}, **meta)
    return np.stack([have[r["uid"]] for r in tr.records]).astype(np.float32)

DOWN_OFFSETS = (0, 4, 8, 16)


def down_states(records: list[dict], problems: dict[str, dict], target, searched: bool,
                offsets: tuple[int, ...] = DOWN_OFFSETS, slots: int = 16, progress=None) -> np.ndarray:
    """The target's final-norm hidden state after it reads each record's draft token and the next
    ``o`` tokens of its greedy continuation from there, for every ``o`` in ``offsets`` (the last state
    of the continuation where it ends sooner, at an end-of-sequence token). The text before the draft
    token is the answer the mismatch was met on (as in ``after_states``). ``target``: a ``LlamaCppLM``
    with ``n_seq_max >= slots + 1``; one answer's continuations run side by side (``branch_pool``),
    each branching off the answer held in session 0. Returns [len(records), len(offsets), d_T] float16."""
    depth = max(offsets) + 1  # row o is the pass over the o-th continuation token: o + 1 tokens fed
    out = np.zeros((len(records), len(offsets), target.hidden_size), np.float16)
    target.use(0)
    for p, text, rows in by_answer(records, problems, searched):
        pending = target.sync(p["prompt_ids"] + text)
        if pending:
            target.feed(pending, n_logits=1)
        todo = list(rows)

        def next_branch():
            if not todo:
                return None
            i = todo.pop()
            return i, 0, len(p["prompt_ids"]) + int(records[i]["position"]), int(records[i]["draft_id"])

        for i, _cont, trace in target.branch_pool(next_branch, depth, lambda _k, _c: False, slots, trace_top=1):
            last = len(trace.hidden) - 1
            out[i] = np.stack([trace.hidden[min(o, last)] for o in offsets]).astype(np.float16)
        if progress is not None:
            progress.update(1)
    return out


def folds_by_group(groups: np.ndarray, n: int, seed: int = 0) -> list[np.ndarray]:
    names = np.unique(groups)
    np.random.default_rng(seed).shuffle(names)
    return [np.isin(groups, part) for part in np.array_split(names, n)]


def standardize(train: np.ndarray, x: np.ndarray) -> np.ndarray:
    mu, sd = train.mean(0), train.std(0) + 1e-6
    return (x - mu) / sd


def pca(train: np.ndarray, x: np.ndarray, k: int) -> np.ndarray:
    """``x`` on the first ``k`` whitened principal axes of ``train`` (exact SVD: the same on every run)."""
    mu = train.mean(0)
    _, s, vh = torch.linalg.svd(torch.from_numpy(train - mu), full_matrices=False)
    z = torch.from_numpy(x - mu) @ vh[:k].T / (s[:k] / np.sqrt(len(train)))
    return z.numpy()


def fit_predict(model: str, x_tr: np.ndarray, y_tr: np.ndarray, x_te: np.ndarray, seed: int = 0) -> np.ndarray:
    torch.manual_seed(seed)
    d = x_tr.shape[1]
    if model == "logistic":
        net = torch.nn.Linear(d, 1)
        opt, steps = torch.optim.Adam(net.parameters(), lr=0.05, weight_decay=1e-3), 300
    else:
        net = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(64, 1))
        opt, steps = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=1e-2), 400
    x, y = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    pos = float(y.mean())
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor((1 - pos) / max(pos, 1e-6)))
    net.train()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(net(x).squeeze(1), y).backward()
        opt.step()
    net.eval()
    with torch.no_grad():
        return torch.sigmoid(net(torch.from_numpy(x_te)).squeeze(1)).numpy()


SETS = {"target": ("target",), "text": ("text",), "target+text": ("target", "text"), "hidden": ("hidden",),
        "hidden+target+text": ("hidden", "target", "text")}
DOWN_SETS = {"hidden": ("hidden",), **{f"down{o}": (f"down{o}",) for o in DOWN_OFFSETS},
             **{f"hidden+down{o}": (f"hidden+down{o}",) for o in DOWN_OFFSETS}}
AFTER_SETS = {"hidden": ("hidden",), "after": ("after",), "hidden+after": ("hidden+after",)}
WINDOW_SETS = {"window": ("window",), "hidden": ("hidden",), "hidden+window": ("hidden", "window"),
               "hidden+target+text": ("hidden", "target", "text"),
               "hidden+target+text+window": ("hidden", "target", "text", "window")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", action="append", required=True, help="labelled trace folder (repeatable)")
    p.add_argument("--tokenizer", default="qwen2.5-coder-1.5b-instruct", help="model whose tokenizer decodes the token ids")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--pca", type=int, default=64, help="principal components of [h_D; h_T] (default 64)")
    p.add_argument("--csv", type=Path, default=None, help="write the table here too")
    p.add_argument("--after", action="store_true", help="screen the target's hidden state after the draft token "
                   "instead (feature sets hidden, after, hidden+after; computes the states with the llama.cpp target)")
    p.add_argument("--window", action="store_true", help="screen the FLy window after the mismatch instead "
                   "(feature sets window, hidden, hidden+window, hidden+target+text, hidden+target+text+window; "
                   "traces of the target's own text only)")
    p.add_argument("--down", action="store_true", help="screen the target's hidden state further down the swapped "
                   "text instead (after the draft token and 0, 4, 8, 16 tokens of the target's continuation; feature "
                   "sets hidden, downW, hidden+downW; computes the states with the llama.cpp target)")
    p.add_argument("--down-cache", type=Path, default=Path("runs/head_features_down"),
                   help="where --down keeps the computed states, one .npz per folder (default %(default)s)")
    p.add_argument("--after-cache", type=Path, default=Path("runs/head_features_after"),
                   help="where --after keeps the computed states, one .npz per folder (default %(default)s)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="the traces' target, for --after (GGUF)")
    args = p.parse_args(argv)
    if args.folds < 2:
        p.error(f"--folds must be >= 2 (got {args.folds})")
    if args.after + args.window + args.down > 1:
        p.error("--after, --window and --down are separate screens: pick one")
    try:
        data = load(args.traces, args.tokenizer, args.after_cache if args.after else None, args.target, args.window,
                    args.down_cache if args.down else None)
    except ValueError as e:
        p.error(str(e))
    n = len(data["group"])
    if n == 0:
        p.error("no labelled mismatches with true answers in --traces")
    print(f"{n} labelled mismatches from {len(np.unique(data['group']))} answers: "
          f"{int(data['critical'].sum())} critical, {int(data['harmful'].sum())} harmful", file=sys.stderr)
    h = np.concatenate([data["hd"], data["ht"]], axis=1)
    folds = folds_by_group(data["group"], args.folds)
    # Each fold's inputs, fit on its training rows once and shared by every set, model and label.
    parts = ("target", "text", "window") if args.window else ("target", "text")
    inputs = [{"hidden": pca(h[~test], h, args.pca), **{part: standardize(data[part][~test], data[part])
                                                        for part in parts}} for test in folds]
    sets = WINDOW_SETS if args.window else SETS
    if args.after:
        sets = AFTER_SETS
        ha = np.concatenate([h, data["ha"]], axis=1)
        for test, fold in zip(folds, inputs):
            fold["after"] = pca(data["ha"][~test], data["ha"], args.pca)
            fold["hidden+after"] = pca(ha[~test], ha, args.pca)
    if args.down:
        sets = DOWN_SETS
        for test, fold in zip(folds, inputs):
            for k, o in enumerate(DOWN_OFFSETS):
                hd = data["hdown"][:, k]
                both = np.concatenate([h, hd], axis=1)
                fold[f"down{o}"] = pca(hd[~test], hd, args.pca)
                fold[f"hidden+down{o}"] = pca(both[~test], both, args.pca)
    jobs = [(s, m, lab) for s in sets for m in ("logistic", "mlp") for lab in ("critical", "harmful")]
    out = []
    for name, model, label in tqdm(jobs, desc="feature screen", unit="model"):
        score = np.zeros(n, dtype=np.float32)
        for test, fold in zip(folds, inputs):
            x = np.concatenate([fold[part] for part in sets[name]], axis=1).astype(np.float32)
            score[test] = fit_predict(model, x[~test], data[label][~test], x[test])
        out.append({"features": name, "model": model, "trained_on": label,
                    "auc_harmful": round(roc_auc(score, data["harmful"]), 4),
                    "auc_critical": round(roc_auc(score, data["critical"]), 4)})
    print(f"{'features':20s} {'model':9s} {'trained on':10s} {'AUC harmful':>11s} {'AUC critical':>12s}")
    for r in out:
        print(f"{r['features']:20s} {r['model']:9s} {r['trained_on']:10s} {r['auc_harmful']:11.3f} {r['auc_critical']:12.3f}")
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(out[0]))
            w.writeheader()
            w.writerows(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
