"""SwitchSD copy probe: collect labelled hidden states from the target, train per-layer probes.

    python -m wisv_ros.cli.probe collect --out runs/probe/default --prompts 400 --seed 0
    python -m wisv_ros.cli.probe train --data runs/probe/default --out config/probes/copy_probe.npz
    python -m wisv_ros.cli.probe summary --data runs/probe/default
    python -m wisv_ros.cli.probe score --probe config/probes/copy_probe.npz --data runs/probe/other

collect: builds repetition prompts from HumanEval canonical solutions (rename, annotate, quote, the
non-copy control "explain", excerpt and two-turn "turns"; --prompt-kinds picks some), lets the target complete them greedily and stores the captured
hidden states of the chosen layers (default every 2nd layer, post_attn and post_mlp) with the copy
labels (Y = 1 inside a verbatim run of >= 5 tokens seen earlier). Appends to the folder and skips
prompts already stored, so an interrupted run continues where it stopped.

train: splits the prompts by source problem into training and validation (and, with --test-share,
a test set), trains one bias-free logistic probe per (layer, kind), writes the report table
(report.md, report.json) and plot (report.png) next to the data (or to --report), and exports the
probe with the best validation F1, with its F1-best threshold, to --out (.npz + .json sidecar
holding this command line). The test sources are scored once, by the chosen probe at its
validation threshold (the layer and threshold were picked on validation, so validation figures of
the chosen probe are optimistic).
score: scores a trained probe, unchanged, on another data folder (e.g. prompt kinds or source
problems it was not trained on): AUC and F1 at the probe's own threshold, overall and per prompt
kind; ``--json`` also writes them to a file.
The format is described in ``wisv_ros/probe.py``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from wisv_ros.sd.engines import BACKENDS, load_lm
from wisv_ros.sd.lm import LAYER_KINDS, CausalLM
from wisv_ros.sd.models import DEFAULT_TARGET, REGISTRY, add_dtype_args, load_model
from wisv_ros.switchsd.probe_training import (
    PROMPT_KINDS, build_repetition_prompts, collect_probe_data, evaluate, load_probe_data, save_probe,
    split_by_source, split_three_by_source, train_layers,
)
from wisv_ros.switchsd.probe import load_probe
from wisv_ros.cli.common import set_threads


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _names(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"'{text}': choose from {', '.join(allowed)}")
        return names
    return parse


def _collect(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    if args.prompts < 1:
        p.error(f"--prompts must be >= 1 (got {args.prompts})")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if args.layer_step < 1:
        p.error(f"--layer-step must be >= 1 (got {args.layer_step})")
    set_threads(args.threads)
    if args.backend == "torch":
        lm = CausalLM(*load_model(args.target, dtype=args.target_dtype))
    else:  # llama.cpp captures through its eval callback: the model is loaded once, with the capture
        try:
            probe_lm = load_lm(args.target, args.backend, threads=max(args.threads, 1), n_ctx=args.n_ctx)
        except ValueError as exc:
            p.error(f"--backend {args.backend}: {exc}")
        n_layers = probe_lm.num_layers
        probe_lm.close()
        lm = lambda capture: load_lm(args.target, args.backend, capture=capture,  # noqa: E731
                                     threads=max(args.threads, 1), n_ctx=args.n_ctx)
    if isinstance(lm, CausalLM) and lm.tokenizer is None:
        p.error(f"target '{args.target}' has no tokenizer; the repetition prompts are text")
    if isinstance(lm, CausalLM):
        n_layers = lm.num_layers
    layers = args.layers if args.layers is not None else list(range(0, n_layers, args.layer_step))
    bad = [layer for layer in layers if not 0 <= layer < n_layers]
    if bad:
        p.error(f"--layers {bad} outside 0..{n_layers - 1}")
    prompts = build_repetition_prompts(args.prompts, seed=args.seed, kinds=args.prompt_kinds)
    index = collect_probe_data(lm, prompts, layers, args.kinds, args.max_new_tokens, Path(args.out),
                               min_run=args.min_run, target_name=args.target,
                               progress=lambda it: tqdm(it, desc="probe data", unit="prompt", file=sys.stderr))
    _print_summary(index)
    return 0


def _print_summary(index: list[dict]) -> None:
    n = sum(r["n_new"] for r in index)
    copy = sum(r["n_copy"] for r in index)
    print(f"{len(index)} prompts, {n} completion tokens, {copy} with Y=1 ({copy / max(n, 1):.1%})")
    kinds = sorted({r["kind"] for r in index})
    for kind in kinds:
        rows = [r for r in index if r["kind"] == kind]
        n_k = sum(r["n_new"] for r in rows)
        print(f"  {kind:10s} {len(rows):5d} prompts {n_k:7d} tokens  Y=1 {sum(r['n_copy'] for r in rows) / max(n_k, 1):.1%}")


def _score(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    probe = load_probe(Path(args.probe))
    data = load_probe_data(Path(args.data))
    if (probe.layer, probe.kind) not in data.keys():
        p.error(f"--data {args.data} has no hidden states of layer {probe.layer} {probe.kind} (the probe's); "
                f"collect them with --layers {probe.layer} --kinds {probe.kind}")
    if data.meta.get("d_model") != probe.d_model:
        p.error(f"--data {args.data} has d_model {data.meta.get('d_model')}, the probe {probe.d_model}: another target")
    X = data.features(probe.layer, probe.kind).astype(np.float32)
    kinds = np.array([data.index[i]["kind"] for i in data.prompt_row])
    groups = {"all": np.ones(len(kinds), bool)} | {k: kinds == k for k in sorted(set(kinds.tolist()))}
    out = {}
    print(f"probe layer {probe.layer} {probe.kind}, threshold {probe.threshold:.3f}, on {args.data}:")
    print("| prompts | tokens | Y=1 | AUC | F1 | precision | recall |\n|---|---|---|---|---|---|---|")
    for name, rows in groups.items():
        m = evaluate(probe.w, X[rows], data.labels[rows], threshold=probe.threshold)
        out[name] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in m.items()}
        print(f"| {name} | {m['n']} | {m['positive_rate']:.3f} | {m['auc']:.4f} | {m['f1']:.4f} | "
              f"{m['precision']:.4f} | {m['recall']:.4f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"probe": str(args.probe), "data": str(args.data),
                                               "sources": sorted({r["source"] for r in data.index}), "metrics": out},
                                              indent=1) + "\n")
    return 0


def _train(args: argparse.Namespace, p: argparse.ArgumentParser, argv: list[str]) -> int:
    if not 0 < args.val_share < 1:
        p.error(f"--val-share must be in (0, 1) (got {args.val_share})")
    if args.l2 < 0 or args.max_iter < 1:
        p.error(f"--l2 must be >= 0 and --max-iter >= 1 (got {args.l2}, {args.max_iter})")
    set_threads(args.threads)
    if not 0 <= args.test_share < 1 or args.val_share + args.test_share >= 1:
        p.error(f"--test-share must be in [0, 1) with --val-share + --test-share < 1 (got {args.test_share})")
    data = load_probe_data(Path(args.data))
    test_rows = None
    try:
        if args.test_share > 0:
            train_rows, val_rows, test_rows = split_three_by_source(data, args.val_share, args.test_share, args.seed)
        else:
            train_rows, val_rows = split_by_source(data, args.val_share, args.seed)
    except ValueError as exc:
        p.error(f"{exc}; collect more prompts first")
    keys = data.keys()
    if args.kinds is not None:
        keys = [k for k in keys if k[1] in args.kinds]
    if args.layers is not None:
        keys = [k for k in keys if k[0] in args.layers]
    if not keys:
        p.error(f"no stored (layer, kind) matches; stored: {data.keys()}")
    try:
        report = train_layers(data, train_rows, val_rows, keys=keys, l2=args.l2, max_iter=args.max_iter,
                              max_rows=args.max_rows, seed=args.seed,
                              progress=lambda it: tqdm(it, desc="probes", unit="probe", file=sys.stderr))
    except ValueError as exc:
        p.error(str(exc))
    folder = Path(args.report) if args.report else Path(args.data) / "report"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.md").write_text(report.table() + "\n")
    (folder / "report.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    png = report.plot(folder / "report.png", title=f"copy probe, {data.meta.get('target', '')}")
    best = report.best
    metrics = best.summary()
    test_line = ""
    if test_rows is not None:
        # The chosen probe with its validation threshold on sources it never saw, once.
        y_test = data.labels[test_rows]
        test = evaluate(best.w, data.features(best.layer, best.kind, test_rows).astype(np.float32), y_test,
                        threshold=best.threshold)
        metrics["test"] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in test.items()}
        test_line = (f"held-out test ({test['n']} tokens, Y=1 {test['positive_rate']:.3f}): AUC {test['auc']:.4f}, "
                     f"F1 {test['f1']:.4f} (precision {test['precision']:.4f}, recall {test['recall']:.4f}) "
                     f"at the validation threshold {best.threshold:.3f}")
        with (folder / "report.md").open("a") as f:
            f.write(f"\nChosen: layer {best.layer} {best.kind}. {test_line}\n")
        (folder / "report.json").write_text(json.dumps({**report.to_dict(), "test": metrics["test"]}, indent=1) + "\n")
    side = save_probe(Path(args.out), best.w, best.layer, best.kind, best.threshold, meta={
        "target": data.meta.get("target"),
        "min_run": data.meta.get("min_run"),
        "data": str(args.data),
        "prompts": len(data.index),
        "tokens": int(len(data.labels)),
        "metrics": metrics,
        "command": "python -m wisv_ros.cli.probe " + shlex.join(argv),
    })
    print(report.table())
    if test_line:
        print(test_line)
    print(f"chosen: layer {best.layer} {best.kind}, val F1 {best.val_f1:.4f}, AUC {best.val_auc:.4f}, "
          f"threshold {best.threshold:.3f} -> {args.out} ({side.name}); plot {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.probe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    col = sub.add_parser("collect", help="complete repetition prompts with the target, store hiddens + copy labels")
    col.add_argument("--out", required=True, help="data folder (created; resumed if it exists)")
    col.add_argument("--target", default=DEFAULT_TARGET,
                     help=f"target model: {', '.join(REGISTRY)}, a HF folder or a .gguf file (default %(default)s)")
    add_dtype_args(col, drafter=False)
    col.add_argument("--prompts", type=int, default=400, help="number of prompts, kinds taking turns (default %(default)s)")
    col.add_argument("--prompt-kinds", type=_names(PROMPT_KINDS), default=list(PROMPT_KINDS),
                     help=f"comma-separated prompt kinds, of {','.join(PROMPT_KINDS)} "
                          f"(default {','.join(PROMPT_KINDS)})")
    col.add_argument("--layers", type=_int_list, default=None, help="comma-separated decoder layers (default: every --layer-step-th)")
    col.add_argument("--layer-step", type=int, default=2, help="default layers 0, step, 2*step, ... (default %(default)s)")
    col.add_argument("--kinds", type=_names(LAYER_KINDS), default=list(LAYER_KINDS),
                     help=f"comma-separated capture points (default {','.join(LAYER_KINDS)})")
    col.add_argument("--max-new-tokens", type=int, default=320, help="completion length limit (default %(default)s)")
    col.add_argument("--min-run", type=int, default=5, help="label: shortest repeated verbatim run (default %(default)s)")
    col.add_argument("--seed", type=int, default=0, help="prompt selection seed (default %(default)s)")
    col.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default; llama_cpp: 1)")
    col.add_argument("--backend", default="torch", choices=[b for b in BACKENDS if b != "auto"],
                     help="engine of the target: torch (the dequantised weights, what the shipped probes were "
                          "trained on) or llama_cpp (the GGUF file; the layer through llama.cpp's eval callback), "
                          "e.g. to check a probe on the engine that runs it (default %(default)s)")
    col.add_argument("--n-ctx", type=int, default=4096, help="llama_cpp context size, tokens (default %(default)s)")
    tr = sub.add_parser("train", help="train one probe per stored (layer, kind), export the best")
    tr.add_argument("--data", required=True, help="data folder written by collect")
    tr.add_argument("--out", required=True, help="probe output path (.npz; a .json sidecar is written beside it)")
    tr.add_argument("--report", default=None, help="report folder (default <data>/report)")
    tr.add_argument("--layers", type=_int_list, default=None, help="only these stored layers (default all)")
    tr.add_argument("--kinds", type=_names(LAYER_KINDS), default=None, help="only these stored kinds (default all)")
    tr.add_argument("--val-share", type=float, default=0.2, help="share of source problems held out (default %(default)s)")
    tr.add_argument("--test-share", type=float, default=0.0,
                    help="share of source problems held out as a test set, scored once by the chosen probe "
                         "(default %(default)s: none)")
    tr.add_argument("--l2", type=float, default=1e-3, help="L2 weight on the scaled probe weights (default %(default)s)")
    tr.add_argument("--max-iter", type=int, default=100, help="LBFGS iterations (default %(default)s)")
    tr.add_argument("--max-rows", type=int, default=None, help="train on at most this many random rows (default all)")
    tr.add_argument("--seed", type=int, default=0, help="split and subsampling seed (default %(default)s)")
    tr.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    summ = sub.add_parser("summary", help="counts of a data folder")
    summ.add_argument("--data", required=True, help="data folder")
    sc = sub.add_parser("score", help="score a trained probe on another data folder (AUC, F1 per prompt kind)")
    sc.add_argument("--probe", required=True, help="probe file (.npz from train)")
    sc.add_argument("--data", required=True, help="data folder written by collect (with the probe's layer and kind)")
    sc.add_argument("--json", default=None, help="also write the metrics to this JSON file")
    args = p.parse_args(argv)
    if args.cmd == "score":
        return _score(args, p)
    if args.cmd == "collect":
        return _collect(args, p)
    if args.cmd == "train":
        return _train(args, p, argv)
    _print_summary(load_probe_data(Path(args.data)).index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
