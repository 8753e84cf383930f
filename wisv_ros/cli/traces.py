"""Mismatch traces and task-driven labels for training the WISV decision head (resumable).

    python -m wisv_ros.cli.traces collect --out runs/traces/default --problems 200 --seed 0
    python -m wisv_ros.cli.traces label --out runs/traces/default --batch-size 8
    python -m wisv_ros.cli.traces summary --out runs/traces/default
    python -m wisv_ros.cli.traces bench-label --out runs/traces/default --branches 8
    python -m wisv_ros.cli.traces search --out runs/traces/search --problems 100 --seed 4 --k 32
    python -m wisv_ros.cli.traces oracle --out runs/traces/search

collect: greedy SD over gsm_symbolic problems (generated offline; never the GSM8K test problems),
records the first mismatch of every round (hidden states, position, tokens). label: substitutes the
draft token, lets the target finish greedily in batches, and marks the mismatch critical when the
final answer changes. Both append to the folder and skip what is already done, so an interrupted
run continues where it stopped. search: labels the mismatches along the path the accepted tokens
take (AutoJudge's search: a swap that leaves the answer as it is stays in the text, and the walk
goes on from it; ``wisv_ros/wisv/search.py``); oracle: what accepting every swap the search kept
gains over greedy SD (AAL, rounds). bench-label: times labelling with one shared prefill per answer
against prefilling every substituted context (table + CSV). The format is described in ``wisv_ros/traces.py``.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from wisv_ros.eval.datasets import generate_gsm_symbolic
from wisv_ros.sd.metrics import format_table
from wisv_ros.wisv.traces import bench_labelling, collect_traces, fly_points, label_mismatches, load_traces
from wisv_ros.cli.common import add_model_args, check_args, load_pair, parse_shard, set_threads
from wisv_ros.sd.engines import resolve_backend


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.traces", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    col = sub.add_parser("collect", help="run greedy SD on gsm_symbolic problems and record mismatches")
    col.add_argument("--out", required=True, help="trace folder (created; resumed if it exists)")
    col.add_argument("--problems", type=int, default=200, help="gsm_symbolic problems (default %(default)s)")
    col.add_argument("--max-new-tokens", type=int, default=320, help="answer length limit (default %(default)s)")
    lab = sub.add_parser("label", help="label the recorded mismatches by substituted continuations")
    lab.add_argument("--out", required=True, help="trace folder")
    lab.add_argument("--batch-size", type=int, default=8, help="continuations per batched target pass (default %(default)s)")
    lab.add_argument("--limit", type=int, default=None, help="label at most this many now")
    lab.add_argument("--max-new-tokens", type=int, default=None,
                     help="continuation length limit; reaching it without a final answer counts as critical "
                          "(default: the traces' own answer budget)")
    lab.add_argument("--shard", default="0/1", help="I/N: label only problems I, I+N, I+2N, ... (run N processes side by side; default %(default)s)")
    sea = sub.add_parser("search", help="label mismatches along the path accepted tokens take (AutoJudge's search; llama.cpp)")
    sea.add_argument("--out", required=True, help="trace folder (created; resumed if it exists)")
    sea.add_argument("--problems", type=int, default=100, help="gsm_symbolic problems (default %(default)s)")
    sea.add_argument("--max-new-tokens", type=int, default=512, help="answer and continuation length limit (default %(default)s)")
    sea.add_argument("--slots", type=int, default=16,
                     help="answers searched side by side, one running branch each, decoded in one batch (default %(default)s)")
    sea.add_argument("--limit", type=int, default=None,
                     help="stop after this many new labels; the answers under way resume from the folder's partial.jsonl")
    sea.add_argument("--shard", default="0/1", help="I/N: search only problems I, I+N, ... (N processes side by side; default %(default)s)")
    ben = sub.add_parser("bench-label", help="time shared-prefix labelling against per-context prefills")
    ben.add_argument("--out", required=True, help="trace folder (collected)")
    ben.add_argument("--branches", type=int, default=8, help="mismatches of one answer to label both ways (default %(default)s)")
    ben.add_argument("--batch-size", type=int, default=8, help="continuations per batch (default %(default)s)")
    ben.add_argument("--max-new-tokens", type=int, default=256, help="continuation length limit (default %(default)s)")
    ben.add_argument("--problem", default=None, help="problem id (default: the first with enough mismatches)")
    ben.add_argument("--csv", default="runs/label_bench.csv", help="CSV output (default %(default)s)")
    summ = sub.add_parser("summary", help="counts of a trace folder")
    summ.add_argument("--out", required=True, action="append", help="trace folder (repeatable: --fly pools them)")
    summ.add_argument("--fly", action="store_true", help="also what the FLy-style baseline would accept (per entropy and window)")
    summ.add_argument("--csv", default=None, help="with --fly: write its table here")
    summ.add_argument("--accuracy-budget", type=float, default=1.0,
                      help="with --fly on generated problems: name the setting that accepts the most mismatches while "
                           "its estimate loses at most this many right answers per 100, net (default %(default)s)")
    orc = sub.add_parser("oracle", help="greedy SD against the searched paths: the AAL of accepting every harmless mismatch")
    orc.add_argument("--out", required=True, action="append", help="searched trace folder (repeatable)")
    orc.add_argument("--head", default=None, help="also judge the labels with this decision head (.onnx)")
    orc.add_argument("--channel", default="20mbps_50ms", help="with --head: channel scenario the head sees (default %(default)s)")
    for sp in (col, lab, sea, ben):
        add_model_args(sp)
    args = p.parse_args(argv)

    if args.cmd == "summary":
        trs = [load_traces(Path(folder)) for folder in args.out]
        for folder, tr in zip(args.out, trs):
            labelled = tr.labels >= 0
            answered = {tr.records[i]["problem_id"] for i in np.flatnonzero(labelled)}
            print(f"{folder}: problems {len(tr.problems)}  mismatches {len(tr.records)}  labelled {int(labelled.sum())} "
                  f"from {len(answered)} answers  critical {int((tr.labels == 1).sum())}  "
                  f"hidden {tr.h_draft.shape[1]}+{tr.h_target.shape[1]}")
        if len(trs) > 1:
            print(f"all: labelled {sum(int((tr.labels >= 0).sum()) for tr in trs)}  critical "
                  f"{sum(int((tr.labels == 1).sum()) for tr in trs)}")
        if args.fly and any((tr.labels >= 0).any() for tr in trs):
            try:
                rows = fly_points(trs)
            except ValueError as e:
                p.error(f"summary --fly: {e}")
            print("\nFLy-style rule on the labelled mismatches (share accepted / of critical ones / of answers with a "
                  "critical one accepted" + ("; estimated right answers lost / gained per answer, net per 100" if
                                              "net_lost_per_100" in rows[0] else "") + "):")
            print(format_table([{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]))
            within = [r for r in rows if r.get("net_lost_per_100", float("inf")) <= args.accuracy_budget]
            if "net_lost_per_100" in rows[0]:
                best = max(within, key=lambda r: r["accepted"], default=None)
                print("most permissive setting within " + f"{args.accuracy_budget:g} answers per 100: " +
                      (f"fly_entropy {best['fly_entropy']}, fly_window {best['fly_window']} (accepts "
                       f"{100 * best['accepted']:.1f} % of the mismatches)" if best else "none"))
            if args.csv:
                Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
                with open(args.csv, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=list(rows[0]))
                    w.writeheader()
                    w.writerows(rows)
        return 0
    if args.cmd == "oracle":
        from wisv_ros.wisv.search import oracle_summary

        searched = [f for f in args.out if load_traces(Path(f)).meta.get("search")]
        if not searched and not args.head:
            p.error("oracle: none of --out was made by traces search (pass --head to judge labels of other folders)")
        if searched:
            rows = [dict(folder=folder, **oracle_summary(Path(folder))) for folder in searched]
            if len(searched) > 1:
                rows.append(dict(folder="all", **oracle_summary([Path(f) for f in searched])))
            print(format_table(rows))
        if args.head:
            from wisv_ros.wisv.search import head_on_labels

            rep = head_on_labels(Path(args.head), [Path(f) for f in args.out], args.channel)
            print(f"\n{args.head} at {args.channel}: {rep['mismatches']} mismatches ({rep['critical']} critical, "
                  f"{rep['harmful']} harmful); AUC {rep['auc_critical']} against critical, {rep['auc_harmful']} against harmful labels")
            print(format_table(rep["taus"]))
            print("\nat an equal share of mismatches accepted (the head's least rejected):")
            print(format_table(rep["shares"]))
        return 0
    check_args(args)
    set_threads(args.threads)
    if args.cmd == "search":
        from wisv_ros.sd.llama_cpp_lm import LlamaCppLM
        from wisv_ros.wisv.search import search_labels

        if args.problems < 1 or args.slots < 1 or args.max_new_tokens < 1:
            p.error(f"--problems, --slots and --max-new-tokens must be >= 1 (got {args.problems}, {args.slots}, {args.max_new_tokens})")
        for side in ("target", "drafter"):
            if resolve_backend(getattr(args, side), getattr(args, f"{side}_backend")) != "llama_cpp":
                p.error(f"search runs on llama.cpp: --{side} must be a GGUF model (or pass --{side}-backend llama_cpp)")
        shard = parse_shard(p, args.shard)
        problems = generate_gsm_symbolic(args.problems, seed=args.seed)[shard[0]::shard[1]]
        # Per answer: its prompt and path (up to 2 x max_new_tokens) and, on the target, one branch.
        cells = args.slots * (768 + 3 * args.max_new_tokens)
        threads = max(1, args.threads)
        target = LlamaCppLM.from_gguf(args.target, n_ctx=cells, threads=threads, n_seq_max=2 * args.slots,
                                      n_sessions=args.slots)
        drafter = LlamaCppLM.from_gguf(args.drafter, n_ctx=cells, threads=threads, n_seq_max=args.slots,
                                       n_sessions=args.slots)
        res = search_labels(drafter, target, problems, Path(args.out), args.k, args.max_new_tokens, args.slots,
                            progress=lambda total: tqdm(total=total, desc="search", unit="answer", file=sys.stderr),
                            source=f"gsm_symbolic, seed {args.seed}", limit=args.limit)
        print(f"{res['problems']} answers searched: {res['labelled']} labels ({res['critical']} critical, {res['kept']} "
              f"swaps kept) in {res['seconds']} s: {res['labels_per_hour']} labels/hour; {res['replayed']} answers under "
              f"way replayed from partial.jsonl in {res['replay_seconds']} s")
        return 0
    if args.cmd == "collect":
        if args.problems < 1:
            p.error(f"--problems must be >= 1 (got {args.problems})")
        problems = generate_gsm_symbolic(args.problems, seed=args.seed)
        target, drafter = load_pair(args)
        w = collect_traces(drafter, target, problems, Path(args.out), args.k, args.max_new_tokens,
                           progress=lambda it: tqdm(it, desc="traces", unit="problem", file=sys.stderr),
                           source=f"gsm_symbolic, seed {args.seed}")
        print(f"{len(w.done)} problems, {w.n_records} mismatches in {args.out}")
        return 0
    if args.cmd == "bench-label":
        if args.branches < 1 or args.batch_size < 1:
            p.error(f"--branches and --batch-size must be >= 1 (got {args.branches}, {args.batch_size})")
        target, _ = load_pair(args, need_drafter=False)
        rows = bench_labelling(target, Path(args.out), args.branches, args.batch_size, args.max_new_tokens, args.problem)
        cols = list(rows[0])
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(r[c]) for c in cols) + " |")
        print(f"shared_prefix / per_context: {rows[0]['seconds'] / max(rows[1]['seconds'], 1e-9):.2f}x faster")
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
        return 0
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1 (got {args.batch_size})")
    shard = parse_shard(p, args.shard)
    if resolve_backend(args.target, args.target_backend) == "llama_cpp":
        # One cache sequence per continuation of a batch, cells for all of them beside the answer.
        from wisv_ros.sd.llama_cpp_lm import LlamaCppLM

        budget = args.max_new_tokens or int(load_traces(Path(args.out)).meta.get("max_new_tokens", 320))
        target = LlamaCppLM.from_gguf(args.target, n_ctx=2048 + args.batch_size * budget,
                                      threads=max(1, args.threads), n_seq_max=args.batch_size + 1)
    else:
        target, _ = load_pair(args, need_drafter=False)
    res = label_mismatches(target, Path(args.out), batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                           limit=args.limit, shard=shard, progress=lambda total: tqdm(total=total, desc="labels", unit="label", file=sys.stderr))
    print(f"labelled {res['labelled']} ({res['critical']} critical) in {res['seconds']} s: {res['labels_per_hour']} labels/hour")
    return 0


if __name__ == "__main__":
    sys.exit(main())
