"""Train the WISV decision head from labelled traces and export it to ONNX.

    python -m wisv_ros.cli.train_head --traces runs/traces/default --out config/heads/default.onnx

Episodes are the problems of the trace folder(s); problems are split into training and validation
sets (``--val-share``) so that no problem contributes to both. Each episode is relabeled for
``--channels`` channel states drawn from the channel distribution (the four named scenarios, the
states of ``--trace-file`` files, and random states), with the soft policy of Eq. 31. ``--no-csi``
trains the ablation head on the base labels b_t instead. Training has two stages (see
``head.train_head``): all weights first, then only the first layer's channel columns
(``--channel-epochs``), each stage keeping the epoch with the lowest validation loss. The ONNX file
gets a JSON sidecar with the models, the sizes and this command line.

The validation AUC printed per epoch is measured on the problems that also choose the epoch, so
with few labelled problems it flatters the head. ``--cv`` adds an estimate that does not: nested
leave-one-problem-out cross-validation. Each problem in turn is held out; the next one in the
shuffled order picks the epoch; the head is trained on the rest (same relabeling and settings)
and scores the held-out problem's mismatches with the channel features of each named scenario.
The pooled AUC of those scores against the base labels b_t (critical or not) is reported per
scenario and written into the sidecar (``cv``); it costs one training per problem. ``--folds N``
holds out N folds of whole problems instead (the next fold picks the epoch): N trainings, for
label sets of hundreds of answers.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from wisv_ros.wisv.head_training import export_onnx, train_head
from wisv_ros.eval.scoring import roc_auc
from wisv_ros.link.channel import SCENARIOS, ChannelTrace, WireFormat
from wisv_ros.wisv.relabel import ChannelDistribution, Episode, RelabelConfig, channel_quality, make_instances, make_instances_no_csi
from wisv_ros.wisv.traces import LABEL_KINDS, answer_outcomes, load_traces, reference_answers, task_labels


class Outcome(NamedTuple):
    """What accepting a mismatch of one answer does to its accuracy: whether the target's own final
    answer is right, and per mismatch (the episode's order) whether the answer with the draft token
    put in is right. From the true answers of generated problems (``traces.reference_answers``)."""

    target_right: bool
    substituted_right: np.ndarray  # bool [n]


def episodes_from_traces(folders: list[Path], label: str = "critical") -> tuple[list[Episode], list[str], dict, list[Outcome | None]]:
    """One Episode per problem whose mismatches are all labelled; returns (episodes, ids, meta, outcomes).

    ``label`` picks the base labels b_t (``traces.task_labels``): ``critical`` (the final answer
    changes; the paper's) or ``harmful`` (a right final answer turns wrong). ``outcomes[i]`` is the
    accuracy outcome of episode i, or None where the folder's problems have no regenerable true
    answers (then ``harmful`` is refused).

    A problem that labelling has not finished is left out (with a note on stderr): the relabeling
    weighs each critical mismatch by its critical neighbours (Eq. 28), so a partial answer would
    get labels that differ from the ones its complete answer gets.
    """
    episodes, ids, meta, outcomes = [], [], {}, []
    for folder in folders:
        tr = load_traces(folder)
        meta = meta or tr.meta
        try:
            reference = reference_answers(tr)
        except ValueError:
            if label != "critical":
                raise
            reference = None
        base = task_labels(tr, label, reference)
        target_right, sub_right = answer_outcomes(tr, reference) if reference is not None else (None, None)
        by_problem: dict[str, list[int]] = {}
        unfinished: set[str] = set()
        for i, r in enumerate(tr.records):
            if tr.labels[i] >= 0:
                by_problem.setdefault(r["problem_id"], []).append(i)
            elif tr.problems[r["problem_id"]]["answer"] is not None:
                unfinished.add(r["problem_id"])
        partial = unfinished & by_problem.keys()
        if partial:
            print(f"{folder}: {len(partial)} problem(s) only partly labelled, left out "
                  f"(python -m wisv_ros.cli.traces label --out {folder} finishes them)", file=sys.stderr)
        for pid, rows in sorted(by_problem.items()):
            if pid in partial:
                continue
            rows.sort(key=lambda i: tr.records[i]["position"])
            episodes.append(Episode(
                positions=np.array([tr.records[i]["position"] for i in rows]),
                labels=base[rows].astype(np.int64),
                h_draft=tr.h_draft[rows],
                h_target=tr.h_target[rows],
            ))
            ids.append(f"{folder}:{pid}")
            outcomes.append(None if reference is None else Outcome(bool(target_right[rows[0]]), sub_right[rows]))
    return episodes, ids, meta, outcomes


def channel_budgets(budget: float, fmt: WireFormat, k: int, round_compute_s: float) -> dict[str, float]:
    """The accuracy budget of each named scenario: ``budget`` on the worst one, and on the others in
    proportion to the share of a round the link takes there, ``1 - q(c)`` (``relabel.channel_quality``):
    a repair costs an extra round trip, which is worth the most where the link is slow; on a perfect
    link (q = 1) no accuracy is traded and WISV is greedy SD."""
    share = {name: 1.0 - channel_quality(ch, fmt, k, round_compute_s) for name, ch in SCENARIOS.items()}
    worst = max(share.values())
    return {name: round(budget * v / worst, 4) if worst > 0 else 0.0 for name, v in share.items()}


def monotone_fit(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in least squares (pool adjacent violators).

    >>> monotone_fit([0.4, 2.2, 1.4, 5.1])
    [0.4, 1.8, 1.8, 5.1]
    """
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [round(m, 6) for m, n in blocks for _ in range(int(n))]


def pick_tau(curve: list[dict], budget: float) -> float:
    """The largest tau of a cross-validated curve (``tau_curve``, ascending tau) whose estimated net
    loss of right answers per 100 problems stays within ``budget`` once the estimates are made
    non-decreasing in tau (``monotone_fit``: accepting more cannot help accuracy on average, and one
    noisy point of a few hundred answers should neither stop the search early nor carry it too far);
    0 (greedy SD) when even the first tau exceeds it."""
    pts = [c for c in curve if c.get("net_lost_per_100") is not None]
    fitted = monotone_fit([c["net_lost_per_100"] for c in pts])
    best = 0.0
    for c, f in zip(pts, fitted):
        if f <= budget:
            best = c["tau"]
    return best


CV_TAUS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)  # the head's probabilities sit low: few critical labels
# The points of the cross-validated tau curve (CV_TAUS among them): fine where the heads' tau lies.
CURVE_TAUS = tuple(sorted({round(0.01 * i, 2) for i in range(1, 31)} | {round(0.05 * i, 2) for i in range(7, 20)} | set(CV_TAUS)))


def cross_validate(episodes: list[Episode], make, train_kwargs: dict, order: np.ndarray, folds: int = 0,
                   outcomes: list[Outcome | None] | None = None) -> dict:
    """Nested cross-validated AUC against the base labels, grouped by problem, per named scenario
    (see module doc): ``folds`` 0 = leave one problem out, else that many folds of whole problems.

    ``make(episodes, seed_offset) -> (X, y)`` builds training instances; ``order`` is the shuffled problem
    order (the fold after the held-out one picks the epoch). Returns {"problems", "mismatches",
    "critical", "auc": {scenario: pooled AUC}, "fold_auc": {scenario: [AUC per held-out problem, None where it has one class]},
    "tau_curve": {scenario: [{"tau", "accepted", "critical_accepted", "problems_hit", ...}]}}: for each tau of
    ``CURVE_TAUS`` the share of held-out mismatches a tau accepts (head probability < tau), of critical ones, and of
    problems where it accepts at least one critical mismatch (an answer that changes, if that
    mismatch came up as it did in the trace). With ``outcomes`` (one per episode, none None), each point
    also estimates accuracy: ``answers_lost`` (share of held-out answers the target gets right in which
    the tau accepts a mismatch whose substituted answer is wrong), ``answers_gained`` (answers it gets
    wrong in which the tau accepts one whose substituted answer is right) and ``net_lost_per_100``
    (100 x (lost - gained)). The estimate takes each answer's mismatches as the trace met them: after
    an accepted mismatch the real text differs, so it is a guide for choosing tau, checked by decoding.
    ``"mean_reject_prob"``: {scenario: mean held-out rejection probability}, how the head responds to
    the channel on answers it has not seen. With ``outcomes``, ``"auc_harmful"``: {scenario: pooled AUC
    against harmful labels} (a right answer turned wrong), whichever labels the head trained on.
    """
    if len(episodes) < 3:
        raise ValueError(f"cross-validation needs labelled mismatches from at least 3 problems, found {len(episodes)}")
    if outcomes is not None and (len(outcomes) != len(episodes) or any(o is None for o in outcomes)):
        outcomes = None
    scores: dict[str, list[np.ndarray]] = {name: [] for name in SCENARIOS}
    fold_auc: dict[str, list[float]] = {name: [] for name in SCENARIOS}
    truth, held_outcomes = [], []
    if folds and not 3 <= folds <= len(order):
        raise ValueError(f"folds must be in [3, {len(order)} problems] (0 = one per problem), got {folds}")
    groups = [[int(i)] for i in order] if not folds else [[int(i) for i in g] for g in np.array_split(order, folds)]
    for j in tqdm(range(len(groups)), desc="cross-validation", unit="fold"):
        held, picker = groups[j], groups[(j + 1) % len(groups)]
        rest = [episodes[i] for g in groups for i in g if g is not held and g is not picker]
        X, y = make(rest, 0)
        Xp, yp = make([episodes[i] for i in picker], 1)
        head, _ = train_head(X, y, Xp, yp, progress=False, **train_kwargs)
        for i in held:
            ep = episodes[i]
            truth.append(ep.labels >= 1)
            if outcomes is not None:
                held_outcomes.append(outcomes[i])
            for name, ch in SCENARIOS.items():
                c = np.broadcast_to(ch.features(), (len(ep), len(ch.features())))
                p = head.reject_prob(np.concatenate([ep.h_draft, ep.h_target, c], axis=1)).numpy()
                scores[name].append(p)
                auc = roc_auc(p, truth[-1])
                fold_auc[name].append(None if auc != auc else auc)  # None: the problem has one class only
    y_all = np.concatenate(truth)
    curve = {}
    for name, v in scores.items():  # what a tau would accept: all mismatches, critical ones, problems hit
        p_all = np.concatenate(v)
        points = []
        for tau in CURVE_TAUS:
            pt = {"tau": tau, "accepted": float(np.mean(p_all < tau)),
                  "critical_accepted": float(np.mean(p_all[y_all] < tau)) if y_all.any() else None,
                  "problems_hit": float(np.mean([bool(np.any((p < tau) & t)) for p, t in zip(v, truth)]))}
            if outcomes is not None:
                lost = np.mean([o.target_right and bool(np.any((p < tau) & ~o.substituted_right)) for p, o in zip(v, held_outcomes)])
                gained = np.mean([not o.target_right and bool(np.any((p < tau) & o.substituted_right))
                                  for p, o in zip(v, held_outcomes)])
                pt.update(answers_lost=float(lost), answers_gained=float(gained), net_lost_per_100=round(100 * float(lost - gained), 3))
            points.append(pt)
        curve[name] = points
    out = {"problems": len(episodes), "mismatches": int(y_all.size), "critical": int(y_all.sum()),
           "auc": {name: roc_auc(np.concatenate(v), y_all) for name, v in scores.items()},
           "mean_reject_prob": {name: float(np.concatenate(v).mean()) for name, v in scores.items()},
           "fold_auc": fold_auc, "tau_curve": curve}
    if outcomes is not None:
        out["target_right"] = int(sum(o.target_right for o in outcomes))
        # The accuracy question whatever the training labels: a right answer turned wrong.
        harmful = np.concatenate([o.target_right & ~o.substituted_right for o in held_outcomes])
        out["auc_harmful"] = {name: roc_auc(np.concatenate(v), harmful) for name, v in scores.items()}
    return out


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
    p.add_argument("--label", default="critical", choices=LABEL_KINDS,
                   help="base labels: critical (the final answer changes; the paper's) or harmful (a right final answer "
                        "turns wrong; needs generated problems whose true answers regenerate) (default %(default)s)")
    p.add_argument("--accuracy-budget", type=float, default=1.0,
                   help="with --cv on generated problems: right answers per 100 (net) WISV may lose on the worst named "
                        "channel; the others get this in proportion to the link's share of a round there. Per scenario "
                        "the largest tau whose cross-validated estimate stays within its budget is written to the "
                        "sidecar as tau_per_channel (default %(default)s)")
    p.add_argument("--val-share", type=float, default=0.2, help="share of problems held out (default %(default)s)")
    # Defaults: the settings of the shipped head. With a few hundred labels of 2,112 features the head
    # overfits within 1-2 epochs; a narrow, strongly regularised layer held the best cross-validated AUC.
    p.add_argument("--hidden", type=int, default=64, help="hidden layer width (default %(default)s)")
    p.add_argument("--dropout", type=float, default=0.5, help="dropout probability (default %(default)s)")
    p.add_argument("--epochs", type=int, default=30, help="epochs; the one with the lowest validation loss is kept (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=1e-2, help="AdamW weight decay (default %(default)s)")
    p.add_argument("--channel-epochs", type=int, default=30,
                   help="epochs of the channel stage: only the channel weights of the first layer train, the rest "
                        "frozen at the best joint epoch; 0 = off (default %(default)s)")
    p.add_argument("--channel-lr", type=float, default=1e-3, help="Adam learning rate of the channel stage (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--folds", type=int, default=0,
                   help="with --cv: folds of whole problems (0 = leave one problem out: one training per problem; "
                        "e.g. 5 when there are hundreds of problems)")
    p.add_argument("--cv", action="store_true",
                   help="also run nested leave-one-problem-out cross-validation (one training per problem)")
    args = p.parse_args(argv)
    if not 0 < args.val_share < 1:
        p.error(f"--val-share must be in (0, 1) (got {args.val_share})")
    if args.weight_decay < 0:
        p.error(f"--weight-decay must be >= 0 (got {args.weight_decay})")
    if args.channels < 1:
        p.error(f"--channels must be >= 1 (got {args.channels})")
    if args.channel_epochs < 0 or not args.channel_lr > 0:
        p.error(f"--channel-epochs must be >= 0 and --channel-lr > 0 (got {args.channel_epochs} and {args.channel_lr})")

    if not (args.accuracy_budget >= 0 and np.isfinite(args.accuracy_budget)):
        p.error(f"--accuracy-budget must be a finite number >= 0 (got {args.accuracy_budget})")
    try:
        episodes, ids, meta, outcomes = episodes_from_traces([Path(t) for t in args.traces], label=args.label)
    except ValueError as exc:
        p.error(str(exc))
    if len(episodes) < 2:
        p.error(f"need labelled mismatches from at least 2 problems, found {len(episodes)}; run "
                "python -m wisv_ros.cli.traces collect/label first")
    if args.cv and len(episodes) < 3:
        p.error(f"--cv needs labelled mismatches from at least 3 problems, found {len(episodes)}")
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(episodes))
    n_val = max(1, int(round(args.val_share * len(episodes))))
    val = [episodes[i] for i in order[:n_val]]
    train = [episodes[i] for i in order[n_val:]]
    dist = ChannelDistribution(traces=[ChannelTrace.load(f) for f in args.trace_file])
    d_draft = int(episodes[0].h_draft.shape[1])
    if args.no_csi:
        def make(eps, offset):
            return make_instances_no_csi(eps, dist, args.channels, args.seed + offset)
    else:
        cfg = RelabelConfig(fmt=WireFormat(hidden_dim=d_draft), round_compute_s=args.round_compute_s,
                            k=args.k, alpha=args.alpha, rho=args.rho)

        def make(eps, offset):
            return make_instances(eps, dist, args.channels, args.seed + offset, config=cfg)
    X, y = make(train, 0)
    Xv, yv = make(val, 1)
    print(f"instances: train {len(y)} (positive share {float((y >= 0.5).mean()):.3f}), val {len(yv)}", file=sys.stderr)
    train_kwargs = dict(d_draft=d_draft, hidden=args.hidden, dropout=args.dropout, epochs=args.epochs, lr=args.lr,
                        weight_decay=args.weight_decay, channel_epochs=args.channel_epochs, channel_lr=args.channel_lr,
                        seed=args.seed)
    head, hist = train_head(X, y, Xv, yv, **train_kwargs)
    cv = None
    if args.cv:
        if args.folds and not 3 <= args.folds <= len(episodes):
            p.error(f"--folds must be in [3, {len(episodes)}] (the labelled problems) or 0, got {args.folds}")
        cv = cross_validate(episodes, make, train_kwargs, order, folds=args.folds, outcomes=outcomes)
        print(f"cross-validated AUC against the base labels ({args.label}; " + f"{cv['problems']} problems, {cv['mismatches']} "
              f"mismatches, {cv['critical']} positive): "
              + ", ".join(f"{name} {auc:.3f}" for name, auc in cv["auc"].items()), file=sys.stderr)
        if "auc_harmful" in cv:
            print("cross-validated AUC against harmful labels (a right answer turned wrong): "
                  + ", ".join(f"{name} {auc:.3f}" for name, auc in cv["auc_harmful"].items()), file=sys.stderr)
        print("mean held-out rejection probability: "
              + ", ".join(f"{name} {v:.4f}" for name, v in cv["mean_reject_prob"].items()), file=sys.stderr)
        accuracy = "net_lost_per_100" in cv["tau_curve"]["20mbps_50ms"][0]
        print("held-out mismatches a tau accepts, per scenario: all / positive / problems with a positive one accepted"
              + (" / estimated right answers lost net per 100" if accuracy else ""), file=sys.stderr)
        print("tau  " + "  ".join(f"{name:>{27 if accuracy else 20}s}" for name in cv["tau_curve"]), file=sys.stderr)
        for i, tau in enumerate(c["tau"] for c in next(iter(cv["tau_curve"].values()))):
            if tau not in CV_TAUS:
                continue
            cells = [cv["tau_curve"][name][i] for name in cv["tau_curve"]]
            print(f"{tau:4.2f}  " + "  ".join(f"{c['accepted']:6.2f} {c['critical_accepted'] or 0:6.2f} {c['problems_hit']:6.2f}"
                                              + (f" {c['net_lost_per_100']:6.1f}" if accuracy else "") for c in cells), file=sys.stderr)
        if accuracy:
            budgets = channel_budgets(args.accuracy_budget, WireFormat(hidden_dim=d_draft), args.k, args.round_compute_s)
            cv["accuracy_budget"] = budgets
            cv["tau_per_channel"] = ",".join(f"{name}:{pick_tau(c, budgets[name]):g}" for name, c in cv["tau_curve"].items())
            print("accuracy budget per channel (right answers per 100, net): "
                  + ", ".join(f"{name} {b:.2f}" for name, b in budgets.items()), file=sys.stderr)
            print(f"tau per channel within those budgets (cross-validated estimate): {cv['tau_per_channel']}", file=sys.stderr)
    best = hist.best
    sidecar = export_onnx(head, args.out, meta={
        "drafter": meta.get("drafter"), "target": meta.get("target"),
        "csi_relabeling": not args.no_csi, "label": args.label,
        "relabel": {"alpha": args.alpha, "rho": args.rho, "k": args.k, "round_compute_s": args.round_compute_s},
        "train_problems": len(train), "val_problems": len(val),
        "val_loss": best.val_loss, "val_auc": best.val_auc, "val_accuracy": best.val_accuracy,
        "best_epoch": hist.best_epoch, "channel_best_epoch": hist.channel_best_epoch, "cv": cv,
        # The verifier's tau_per_channel "head" reads this: the schedule chosen with the head.
        **({"tau_per_channel": cv["tau_per_channel"]} if cv and "tau_per_channel" in cv else {}),
        "command": "python -m wisv_ros.cli.train_head " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
    })
    print(json.dumps({"out": args.out, "sidecar": str(sidecar), "best_epoch": hist.best_epoch,
                      "channel_best_epoch": hist.channel_best_epoch,
                      "val_auc": round(best.val_auc, 4), "val_loss": round(best.val_loss, 4),
                      **({"cv_auc": {k: round(v, 4) for k, v in cv["auc"].items()}} if cv else {}),
                      **({"tau_per_channel": cv["tau_per_channel"]} if cv and "tau_per_channel" in cv else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
