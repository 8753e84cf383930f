"""Benchmark decoding methods side by side on real prompts; print a table and write CSV.

    python -m wisv_ros.cli.bench --dataset humaneval --limit 10 --max-new-tokens 128 --k 8
    python -m wisv_ros.cli.bench --dataset gsm8k --limit 10 --methods target_only,greedy

For each prompt every method runs once, one after the other, so that the machine's noise hits all
methods alike; speedup is the ratio of tokens/s to target-only measured in the same run. Rejection
SD runs only where drafter and target share a vocabulary. Peak memory is the process's resident
set size while the method ran (both models are loaded, so it mostly reflects the weights).

Columns: dataset, method, k, prompts, tokens, rounds, aal, acceptance, tokens_per_s, speedup,
identical (share of prompts whose greedy output equals target-only greedy), peak_rss_mb.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from tqdm import tqdm

from wisv_ros.eval.datasets import build_prompt, load_gsm8k, load_humaneval
from wisv_ros.sd.verification import Method
from wisv_ros.sd.rounds import generate, generate_target_only
from wisv_ros.sd.metrics import DecodeStats, format_table
from wisv_ros.cli.common import PeakRSS, add_model_args, check_args, load_pair, make_halves, set_threads

COLUMNS = ["dataset", "method", "k", "prompts", "tokens", "rounds", "aal", "acceptance", "tokens_per_s", "speedup", "identical", "peak_rss_mb"]


def dataset_prompts(name: str, limit: int, offset: int = 0) -> list[tuple[str, str | list[dict], bool]]:
    """(id, prompt, chat) triples: HumanEval stubs are completed as code, GSM8K questions are one
    chat message asking for 'The answer is N' (``datasets.build_prompt``)."""
    if name not in ("humaneval", "gsm8k"):
        raise SystemExit(f"error: --dataset must be humaneval or gsm8k (got '{name}')")
    problems = (load_humaneval() if name == "humaneval" else load_gsm8k())[offset:offset + limit]
    return [(p.id, build_prompt(p, tokenizer_has_chat_template=True), name == "gsm8k") for p in problems]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", action="append", help="humaneval and/or gsm8k (repeatable; default both)")
    p.add_argument("--limit", type=int, default=5, help="prompts per data set (default %(default)s)")
    p.add_argument("--offset", type=int, default=0, help="skip this many prompts of each data set (default %(default)s)")
    p.add_argument("--methods", default="target_only,greedy,reject", help="comma-separated methods (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (default %(default)s)")
    p.add_argument("--csv", default=None, help="CSV output path (default runs/bench-<time>.csv)")
    add_model_args(p)
    args = p.parse_args(argv)
    check_args(args)
    try:
        methods = [Method.parse(m.strip()) for m in args.methods.split(",") if m.strip()]
    except ValueError as exc:
        p.error(f"--methods: {exc}")
    if args.limit < 1:
        p.error(f"--limit must be >= 1 (got {args.limit})")
    set_threads(args.threads)
    datasets = args.dataset or ["humaneval", "gsm8k"]
    target, drafter = load_pair(args)
    if Method.REJECT in methods:
        from wisv_ros.sd.drafting import same_vocabulary

        if not same_vocabulary(drafter.tokenizer, target.tokenizer):
            print(f"[bench] skipping reject: {args.drafter} and {args.target} have different vocabularies", file=sys.stderr)
            methods.remove(Method.REJECT)

    rows = []
    for ds in datasets:
        prompts = dataset_prompts(ds, args.limit, args.offset)
        agg = {m: DecodeStats(method=str(m), k=0 if m == Method.TARGET_ONLY else args.k) for m in methods}
        peak = {m: 0.0 for m in methods}
        identical = {m: 0 for m in methods}
        bar = tqdm(total=len(prompts) * len(methods), desc=f"bench {ds}", unit="run", file=sys.stderr)
        for pid, prompt, chat in prompts:
            ref_ids = None
            for m in methods:
                bar.set_postfix_str(f"{pid} {m}")
                with PeakRSS() as mem:
                    if m == Method.TARGET_ONLY:
                        res = generate_target_only(target, prompt, args.max_new_tokens, chat=chat)
                    else:
                        d, v = make_halves(m, target, drafter, args)
                        res = generate(d, v, prompt, args.max_new_tokens, args.k, chat=chat)
                peak[m] = max(peak[m], mem.peak_mb)
                agg[m].merge(res.stats)
                if m == Method.TARGET_ONLY:
                    ref_ids = res.token_ids
                if ref_ids is not None and m in (Method.TARGET_ONLY, Method.GREEDY):
                    identical[m] += res.token_ids == ref_ids
                bar.update(1)
        bar.close()
        base = agg.get(Method.TARGET_ONLY)
        for m in methods:
            s = agg[m]
            row = s.as_row()
            row.update(
                dataset=ds,
                prompts=len(prompts),
                speedup=round(s.tokens_per_s / base.tokens_per_s, 3) if base and base.tokens_per_s else "",
                identical=round(identical[m] / len(prompts), 3) if m in (Method.TARGET_ONLY, Method.GREEDY) and base else "",
                peak_rss_mb=round(peak[m]),
            )
            rows.append(row)
    print(format_table(rows, COLUMNS))
    out = Path(args.csv) if args.csv else Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS + [c for c in rows[0] if c not in COLUMNS])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
