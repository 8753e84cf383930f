"""Train the WISV decision head from labelled traces and export it to ONNX.

    python -m wisv_ros.cli.train_head --traces runs/traces/default --out config/heads/default.onnx

Episodes are the problems of the trace folder(s); problems are split into training and validation
sets (``--val-share``) so that no problem contributes to both. Each episode is relabeled for
``--channels`` channel states drawn from the channel distribution (the four named scenarios, the
states of ``--trace-file`` files, and random states), with the soft policy of Eq. 31. ``--no-csi``
trains the ablation head on the base labels b_t instead. The ONNX file gets a JSON sidecar with
the models, the sizes and this command line.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

from ..head import export_onnx, train_head
from ..link import ChannelTrace, WireFormat
from ..relabel import ChannelDistribution, Episode, RelabelConfig, make_instances, make_instances_no_csi
from ..traces import load_traces


def episodes_from_traces(folders: list[Path]) -> tuple[list[Episode], list[str], dict]:
    """One Episode per problem with at least one labelled mismatch; returns (episodes, ids, meta)."""
    episodes, ids, meta = [], [], {}
    for folder in folders:
        tr = load_traces(folder)
        meta = meta or tr.meta
        by_problem: dict[str, list[int]] = {}
        for i, r in enumerate(tr.records):
            if tr.labels[i] >= 0:
                by_problem.setdefault(r["problem_id"], []).append(i)
        for pid, rows in sorted(by_problem.items()):
            rows.sort(key=lambda i: tr.records[i]["position"])
            episodes.append(Episode(
                positions=np.array([tr.records[i]["position"] for i in rows]),
                labels=tr.labels[rows].astype(np.int64),
                h_draft=tr.h_draft[rows],
                h_target=tr.h_target[rows],
            ))
            ids.append(f"{folder}:{pid}")
    return episodes, ids, meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.train_head", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", action="append", required=True, help="labelled trace folder (repeatable)")
    p.add_argument("--out", required=True, help="ONNX output path (a .json sidecar is written beside it)")
    p.add_argument("--channels", type=int, default=16, help="channel states sampled per episode (default %(default)s)")
    p.add_argument("--trace-file", action="append", default=[], help="channel trace file (CSV/YAML) added to the distribution")
    p.add_argument("--k", type=int, default=8, help="block length K used for the channel quality (default %(default)s)")
    p.add_argument("--round-compute-s", type=float, default=0.5, help="compute time of one round, s (default %(default)s)")
    p.add_argument("--alpha", type=float, default=0.8, help="importance decay per token, Eq. 28 (default %(default)s)")
    p.add_argument("--rho", type=float, default=0.05, help="soft-policy temperature, Eq. 31 (default %(default)s)")
    p.add_argument("--no-csi", action="store_true", help="ablation: train on the base labels, ignoring the channel")
    p.add_argument("--val-share", type=float, default=0.2, help="share of problems held out (default %(default)s)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.val_share < 1:
        p.error(f"--val-share must be in (0, 1) (got {args.val_share})")
    if args.channels < 1:
        p.error(f"--channels must be >= 1 (got {args.channels})")

    episodes, ids, meta = episodes_from_traces([Path(t) for t in args.traces])
    if len(episodes) < 2:
        p.error(f"need labelled mismatches from at least 2 problems, found {len(episodes)}; run "
                "python -m wisv_ros.cli.traces collect/label first")
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(episodes))
    n_val = max(1, int(round(args.val_share * len(episodes))))
    val = [episodes[i] for i in order[:n_val]]
    train = [episodes[i] for i in order[n_val:]]
    dist = ChannelDistribution(traces=[ChannelTrace.load(f) for f in args.trace_file])
    d_draft = int(episodes[0].h_draft.shape[1])
    if args.no_csi:
        X, y = make_instances_no_csi(train, dist, args.channels, args.seed)
        Xv, yv = make_instances_no_csi(val, dist, args.channels, args.seed + 1)
    else:
        cfg = RelabelConfig(fmt=WireFormat(hidden_dim=d_draft), round_compute_s=args.round_compute_s,
                            k=args.k, alpha=args.alpha, rho=args.rho)
        X, y = make_instances(train, dist, args.channels, args.seed, config=cfg)
        Xv, yv = make_instances(val, dist, args.channels, args.seed + 1, config=cfg)
    print(f"instances: train {len(y)} (positive share {float((y >= 0.5).mean()):.3f}), val {len(yv)}", file=sys.stderr)
    head, hist = train_head(X, y, Xv, yv, d_draft=d_draft, hidden=args.hidden, dropout=args.dropout,
                            epochs=args.epochs, lr=args.lr, seed=args.seed)
    best = hist.best
    sidecar = export_onnx(head, args.out, meta={
        "drafter": meta.get("drafter"), "target": meta.get("target"),
        "csi_relabeling": not args.no_csi,
        "relabel": {"alpha": args.alpha, "rho": args.rho, "k": args.k, "round_compute_s": args.round_compute_s},
        "train_problems": len(train), "val_problems": len(val),
        "val_loss": best.val_loss, "val_auc": best.val_auc, "val_accuracy": best.val_accuracy,
        "command": "python -m wisv_ros.cli.train_head " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
    })
    print(json.dumps({"out": args.out, "sidecar": str(sidecar), "best_epoch": best.epoch,
                      "val_auc": round(best.val_auc, 4), "val_loss": round(best.val_loss, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
