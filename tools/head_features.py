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


def load(folders: list[str], tokenizer: str):
    from transformers import AutoTokenizer

    from wisv_ros.sd.models import resolve
    tok = AutoTokenizer.from_pretrained(resolve(tokenizer))
    rows = {"target": [], "text": [], "hd": [], "ht": [], "critical": [], "harmful": [], "group": []}
    for folder in folders:
        tr = load_traces(Path(folder))
        ref = reference_answers(tr)
        crit, harm = task_labels(tr, "critical", ref), task_labels(tr, "harmful", ref)
        for i, r in enumerate(tr.records):
            if tr.labels[i] < 0 or harm[i] < 0:
                continue
            d, t = tok.decode([r["draft_id"]]), tok.decode([r["target_id"]])
            rows["target"].append(target_features(r))
            rows["text"].append(token_features(d) + token_features(t) + [d.strip().lower() == t.strip().lower()])
            rows["hd"].append(tr.h_draft[i])
            rows["ht"].append(tr.h_target[i])
            rows["critical"].append(int(crit[i]))
            rows["harmful"].append(int(harm[i]))
            rows["group"].append(f"{folder}:{r['problem_id']}")
    return {k: np.asarray(v, dtype=object if k == "group" else np.float32) for k, v in rows.items()}


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", action="append", required=True, help="labelled trace folder (repeatable)")
    p.add_argument("--tokenizer", default="qwen2.5-coder-1.5b-instruct", help="model whose tokenizer decodes the token ids")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--pca", type=int, default=64, help="principal components of [h_D; h_T] (default 64)")
    p.add_argument("--csv", type=Path, default=None, help="write the table here too")
    args = p.parse_args(argv)
    if args.folds < 2:
        p.error(f"--folds must be >= 2 (got {args.folds})")
    data = load(args.traces, args.tokenizer)
    n = len(data["group"])
    if n == 0:
        p.error("no labelled mismatches with true answers in --traces")
    print(f"{n} labelled mismatches from {len(np.unique(data['group']))} answers: "
          f"{int(data['critical'].sum())} critical, {int(data['harmful'].sum())} harmful", file=sys.stderr)
    h = np.concatenate([data["hd"], data["ht"]], axis=1)
    folds = folds_by_group(data["group"], args.folds)
    # Each fold's inputs, fit on its training rows once and shared by every set, model and label.
    inputs = [{"hidden": pca(h[~test], h, args.pca), **{part: standardize(data[part][~test], data[part])
                                                        for part in ("target", "text")}} for test in folds]
    jobs = [(s, m, lab) for s in SETS for m in ("logistic", "mlp") for lab in ("critical", "harmful")]
    out = []
    for name, model, label in tqdm(jobs, desc="feature screen", unit="model"):
        score = np.zeros(n, dtype=np.float32)
        for test, fold in zip(folds, inputs):
            x = np.concatenate([fold[part] for part in SETS[name]], axis=1).astype(np.float32)
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
