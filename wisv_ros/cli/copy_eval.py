"""Evaluate SwitchSD copy mode: probe-gated copying vs the n-gram baseline, side by side.

    python -m wisv_ros.cli.copy_eval --probe config/probes/qwen2.5-coder-1.5b-instruct_copy.npz
    python -m wisv_ros.cli.copy_eval --probe P.npz --dataset humaneval --limit 20 --out runs/copy_eval/he20

For every prompt four systems run one after the other on the same target and drafter, so that the
machine's noise hits all of them alike:

    target_only   the target alone, one token per forward pass
    greedy        greedy speculative decoding, the drafter drafts every round (no copy mode)
    greedy+ngram  + copy mode whenever the last --ngram-kappa tokens occurred earlier (the probe-less
                  baseline, prompt-lookup style: 3 tokens by default, as prompt lookup decoding matches)
    greedy+probe  + copy mode only when the last --kappa tokens (5) occurred earlier and the copy
                  probe fires too (SwitchSD)

Copy rounds are verified greedily, so every system's output should equal target-only greedy output
(``identical``; bfloat16 can flip near-ties when the shape of a pass changes).

Default: all 164 HumanEval problems (one chat message asking to complete the stub; --humaneval-style
completion continues the bare stub instead) and the 100 GSM8K problems (one chat message), --limit /
--offset take a slice of each. Results go to --out (default runs/copy_eval):

    runs.jsonl     one line per (prompt, system): the DecodeStats counts, the probe's gate counts,
                   identical; a rerun with the same settings skips prompts already there (resume)
    config.json    the settings the runs were made with (a rerun must match them)
    summary.csv    one row per (data set, system), the columns below
    summary.png    speedup, copy activation rate, copy accepted length, empty copy attempts

Columns (per data set and system, over all its prompts):
    tokens, rounds, aal        committed tokens, rounds (target-only: forward passes), tokens/round
    tokens_per_s               committed tokens / wall time
    speedup                    tokens/s over target-only's, same prompts
    speedup_vs_sd              tokens/s over greedy's (the same system without copy mode)
    copy_rounds, copy_rate     copy rounds; their share of all rounds (activation rate)
    copy_aal                   mean copied tokens accepted per copy round (correction/bonus excluded)
    copy_empty                 share of copy rounds that accepted nothing (the speculation tax)
    gate_calls, gate_fired     greedy+probe: rounds where the suffix matched and the probe was asked;
                               share of them where it fired (the n-gram baseline copies at all of them)
    identical                  share of prompts whose output equals target-only greedy output
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from wisv_ros.switchsd.copying import CopyConfig
from wisv_ros.sd.drafting import Drafter
from wisv_ros.sd.rounds import Generation, generate, generate_target_only
from wisv_ros.sd.verification import Method, Verifier
from wisv_ros.sd.lm import CausalLM
from wisv_ros.sd.metrics import DecodeStats, format_table
from wisv_ros.sd.engines import add_backend_args, load_lm
from wisv_ros.sd.models import add_dtype_args
from wisv_ros.cli.bench import dataset_prompts
from wisv_ros.cli.common import add_pair_args, set_threads

SYSTEMS = ("target_only", "greedy", "greedy+ngram", "greedy+probe")
DATASETS = ("humaneval", "gsm8k")
COLUMNS = ["dataset", "system", "prompts", "tokens", "rounds", "aal", "tokens_per_s", "speedup", "speedup_vs_sd",
           "copy_rounds", "copy_rate", "copy_aal", "copy_empty", "gate_calls", "gate_fired", "identical", "wall_s"]
# Settings that change the measured numbers: a resumed run must use the same.
_CONFIG_KEYS = ("target", "drafter", "target_dtype", "drafter_dtype", "k", "min_confidence", "max_new_tokens", "humaneval_style",
                "kappa", "ngram_kappa", "copy_width", "copy_depth", "probe_sha256")


class CountingGate:
    """Wraps a copy gate and counts how often it was asked and how often it fired."""

    def __init__(self, gate: Callable[[np.ndarray], bool]):
        self.gate = gate
        self.calls = 0
        self.fired = 0

    def __call__(self, row: np.ndarray) -> bool:
        out = bool(self.gate(row))
        self.calls += 1
        self.fired += out
        return out


def run_system(system: str, target: CausalLM, drafter: CausalLM, prompt: Any, chat: bool, max_new_tokens: int, *,
               k: int, min_confidence: float, kappa: int, width: int, depth: int, probe=None,
               ngram_kappa: int | None = None) -> tuple[Generation, CountingGate | None]:
    """One request with one of SYSTEMS; returns the generation and the probe's gate counter (greedy+probe).

    ``kappa`` is the suffix length greedy+probe matches, ``ngram_kappa`` greedy+ngram's (None = kappa)."""
    if system == "target_only":
        return generate_target_only(target, prompt, max_new_tokens, chat=chat), None
    if system not in SYSTEMS:
        raise ValueError(f"system '{system}' is not one of {SYSTEMS}")
    if system == "greedy+probe" and probe is None:
        raise ValueError("system greedy+probe needs a probe")
    gate = CountingGate(probe.fires) if system == "greedy+probe" else None
    mode = {"greedy+ngram": "ngram", "greedy+probe": "probe"}.get(system, "off")
    if mode == "ngram" and ngram_kappa is not None:
        kappa = ngram_kappa
    copy = CopyConfig.for_mode(mode, probe, kappa=kappa, width=width, depth=depth, gate=gate)
    d = Drafter(drafter, target_tokenizer=target.tokenizer, min_confidence=min_confidence)
    v = Verifier(target, Method.GREEDY, copy=copy)
    return generate(d, v, prompt, max_new_tokens, k, chat=chat), gate


HUMANEVAL_CHAT = "Complete this Python function:\n\n```python\n{stub}```"


def eval_prompts(dataset: str, limit: int, offset: int, humaneval_style: str) -> list[tuple[str, Any, bool]]:
    """(id, prompt, chat) triples. GSM8K: one chat message asking for 'The answer is N'
    (``datasets.build_prompt``). HumanEval: ``chat`` asks the instruct target in one chat message to
    complete the stub (HUMANEVAL_CHAT; answers usually restate the signature and docstring, which is
    where copying pays); ``completion`` continues the bare stub as code (what cli.bench runs)."""
    if humaneval_style not in ("chat", "completion"):
        raise ValueError(f"humaneval_style must be chat or completion (got {humaneval_style!r})")
    prompts = dataset_prompts(dataset, limit, offset)
    if dataset != "humaneval" or humaneval_style == "completion":
        return prompts
    return [(pid, [{"role": "user", "content": HUMANEVAL_CHAT.format(stub=stub)}], True) for pid, stub, _ in prompts]


def _stats_from(d: dict) -> DecodeStats:
    return DecodeStats(**d)


def summarize(records: list[dict]) -> list[dict]:
    """One row per (data set, system) from the per-prompt records (COLUMNS)."""
    rows = []
    for ds in dict.fromkeys(r["dataset"] for r in records):
        agg: dict[str, DecodeStats] = {}
        extra: dict[str, dict[str, int]] = {}
        for r in records:
            if r["dataset"] != ds:
                continue
            s = _stats_from(r["stats"])
            if r["system"] not in agg:
                agg[r["system"]] = DecodeStats(method=r["system"], k=s.k)
                extra[r["system"]] = {"prompts": 0, "identical": 0, "gate_calls": 0, "gate_fired": 0}
            agg[r["system"]].merge(s)
            e = extra[r["system"]]
            e["prompts"] += 1
            e["identical"] += bool(r["identical"])
            e["gate_calls"] += r.get("gate_calls", 0)
            e["gate_fired"] += r.get("gate_fired", 0)
        base = agg.get("target_only")
        sd = agg.get("greedy")
        for system in [s for s in SYSTEMS if s in agg]:
            s, e = agg[system], extra[system]
            full = s.as_row()

            def ratio(ref: DecodeStats | None) -> float | str:
                return round(s.tokens_per_s / ref.tokens_per_s, 3) if ref is not None and ref.tokens_per_s else ""

            copying = system.startswith("greedy+")
            rows.append({
                "dataset": ds, "system": system, "prompts": e["prompts"], "tokens": s.committed, "rounds": s.rounds,
                "aal": full["aal"], "tokens_per_s": full["tokens_per_s"], "speedup": ratio(base),
                "speedup_vs_sd": ratio(sd) if system != "target_only" else "",
                "copy_rounds": s.copy_rounds if copying else "",
                "copy_rate": full["copy_rate"] if copying else "",
                "copy_aal": full["copy_aal"] if copying else "",
                "copy_empty": full["copy_empty"] if copying else "",
                "gate_calls": e["gate_calls"] if system == "greedy+probe" else "",
                "gate_fired": round(e["gate_fired"] / e["gate_calls"], 3) if system == "greedy+probe" and e["gate_calls"] else "",
                "identical": round(e["identical"] / e["prompts"], 3) if base is not None else "",
                "wall_s": round(s.wall_s, 1),
            })
    return rows


def plot(rows: list[dict], path: Path, title: str) -> Path:
    """Four bar panels (speedup over target-only, copy activation rate, copy accepted length, empty
    copy attempts), data sets on the x axis, one bar per system; PNG."""
    from matplotlib.figure import Figure  # no pyplot: no global backend

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    panels = [("speedup", "speedup over target-only", ("greedy", "greedy+ngram", "greedy+probe")),
              ("copy_rate", "copy activation rate (rounds)", ("greedy+ngram", "greedy+probe")),
              ("copy_aal", "accepted tokens per copy round", ("greedy+ngram", "greedy+probe")),
              ("copy_empty", "copy rounds accepting nothing", ("greedy+ngram", "greedy+probe"))]
    fig = Figure(figsize=(13, 3.4), dpi=110)
    colors = {"greedy": "tab:gray", "greedy+ngram": "tab:orange", "greedy+probe": "tab:blue"}
    for ax, (col, label, systems) in zip(fig.subplots(1, len(panels)), panels):
        width = 0.8 / len(systems)
        for j, system in enumerate(systems):
            vals = []
            for ds in datasets:
                row = next((r for r in rows if r["dataset"] == ds and r["system"] == system), None)
                vals.append(float(row[col]) if row is not None and row[col] != "" else 0.0)
            xs = np.arange(len(datasets)) + (j - (len(systems) - 1) / 2) * width
            bars = ax.bar(xs, vals, width, label=system, color=colors[system])
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        if col == "speedup":
            ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(datasets)), datasets)
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of an interrupted run
            continue
    return out


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.copy_eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--probe", required=True, help="copy probe .npz (python -m wisv_ros.cli.probe train)")
    p.add_argument("--dataset", action="append", choices=DATASETS, help="humaneval and/or gsm8k (repeatable; default both)")
    p.add_argument("--limit", type=int, default=None, help="prompts per data set (default: all, 164 / 100)")
    p.add_argument("--offset", type=int, default=0, help="skip this many prompts of each data set (default %(default)s)")
    p.add_argument("--humaneval-style", choices=("chat", "completion"), default="chat",
                   help="HumanEval prompts: chat (one user message asking to complete the stub) or completion "
                        "(continue the bare stub as code) (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt (default %(default)s)")
    p.add_argument("--out", default="runs/copy_eval", help="results folder, resumed if it exists (default %(default)s)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: summarise the prompts of the selection already finished in --out")
    add_pair_args(p)
    p.add_argument("--kappa", type=int, default=5, help="greedy+probe: suffix tokens to match (default %(default)s)")
    p.add_argument("--ngram-kappa", type=int, default=3,
                   help="greedy+ngram: suffix tokens to match (default %(default)s, prompt lookup decoding's n-gram)")
    p.add_argument("--copy-width", type=int, default=4, help="copy mode: candidates per round, W (default %(default)s)")
    p.add_argument("--copy-depth", type=int, default=16, help="copy mode: tokens per candidate, D (default %(default)s)")
    add_dtype_args(p)
    add_backend_args(p)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    args = p.parse_args(argv)
    for name in ("k", "kappa", "ngram_kappa", "copy_width", "copy_depth", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1 (got {args.limit})")
    if args.offset < 0:
        p.error(f"--offset must be >= 0 (got {args.offset})")
    if not 0 <= args.min_confidence < 1:
        p.error(f"--min-confidence must be in [0, 1) (got {args.min_confidence})")
    if not Path(args.probe).is_file():
        p.error(f"--probe {args.probe}: no such file")
    from wisv_ros.switchsd.probe import load_probe

    probe = load_probe(args.probe)
    config = {key: getattr(args, key) for key in _CONFIG_KEYS if key != "probe_sha256"}
    config["probe_sha256"] = _sha256(args.probe)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.json"
    if config_path.is_file():
        old = json.loads(config_path.read_text())
        diff = {k: (old.get(k), config[k]) for k in _CONFIG_KEYS if old.get(k) != config[k]}
        if diff:
            p.error(f"{out} holds runs with other settings {diff} (old, new); use another --out")
    else:
        config_path.write_text(json.dumps(config, indent=1) + "\n")
    records_path = out / "runs.jsonl"
    records = _read_records(records_path)
    done = {(r["dataset"], r["id"]) for r in records if r["system"] == SYSTEMS[-1]}
    records = [r for r in records if (r["dataset"], r["id"]) in done]  # drop half-finished prompts

    selected, todo = set(), []
    for ds in args.dataset or list(DATASETS):
        limit = args.limit if args.limit is not None else 10_000
        for pid, prompt, chat in eval_prompts(ds, limit, args.offset, args.humaneval_style):
            selected.add((ds, pid))
            if (ds, pid) not in done:
                todo.append((ds, pid, prompt, chat))
    set_threads(args.threads)
    if todo and args.report_only:
        print(f"[copy_eval] --report-only: {len(todo)} prompts of the selection not finished, left out", file=sys.stderr)
    elif todo:
        target = load_lm(args.target, args.target_backend, dtype=args.target_dtype, capture=[(probe.layer, probe.kind)],
                         threads=max(1, args.threads))
        if probe.d_model != target.hidden_size:
            p.error(f"probe {args.probe} is for hidden size {probe.d_model}, target '{args.target}' has {target.hidden_size}")
        drafter = load_lm(args.drafter, args.drafter_backend, dtype=args.drafter_dtype, threads=max(1, args.threads))
        # Rewrite the file without half-finished prompts, then append.
        records_path.write_text("".join(json.dumps(r) + "\n" for r in records))
        bar = tqdm(total=len(todo) * len(SYSTEMS), desc="copy eval", unit="run", file=sys.stderr)
        with records_path.open("a") as f:
            for ds, pid, prompt, chat in todo:
                ref = None
                for system in SYSTEMS:
                    bar.set_postfix_str(f"{ds} {pid} {system}")
                    gen, gate = run_system(system, target, drafter, prompt, chat, args.max_new_tokens, k=args.k,
                                           min_confidence=args.min_confidence, kappa=args.kappa, ngram_kappa=args.ngram_kappa,
                                           width=args.copy_width, depth=args.copy_depth, probe=probe)
                    if system == "target_only":
                        ref = gen.token_ids
                    rec = {"dataset": ds, "id": pid, "system": system, "identical": gen.token_ids == ref, "text": gen.text,
                           "gate_calls": gate.calls if gate else 0, "gate_fired": gate.fired if gate else 0,
                           "stats": dataclasses.asdict(gen.stats)}
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    records.append(rec)
                    bar.update(1)
        bar.close()
    rows = summarize([r for r in records if (r["dataset"], r["id"]) in selected])  # this selection only
    if not rows:
        print("(no finished prompts)")
        return 0
    print(format_table(rows, COLUMNS))
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    png = plot(rows, out / "summary.png", title=f"SwitchSD copy mode: {Path(args.probe).name}, K={args.k}, "
               f"kappa={args.kappa} (n-gram {args.ngram_kappa}), W={args.copy_width}, D={args.copy_depth}, {args.max_new_tokens} new tokens")
    (out / "command.txt").write_text("python -m wisv_ros.cli.copy_eval " + shlex.join(argv) + "\n")
    print(f"wrote {out / 'summary.csv'}, {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
