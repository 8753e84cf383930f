"""The engines side by side on this machine: what a token costs, what a block costs, what SD gains.

    python -m wisv_ros.cli.engine_bench --out docs/engines            # the committed report
    python -m wisv_ros.cli.engine_bench --engines llama_cpp --ks 1,4,8 # a quick look

Measured in one run, one thing after another (so that machine noise hits all alike), at
``--threads`` CPU threads per model:

1. ``bandwidth``: this core's memory read bandwidth (numpy reduction over 1 GiB); the target's
   decoding bound is bandwidth / weight bytes read per token (the GGUF file's size for llama.cpp,
   the dequantised weights for torch).
2. ``decode``: the target alone, one token per pass, per engine (ms/token after the prompt).
3. ``block``: the cost of one target pass over K + 1 tokens after the prompt, K = ``--ks``, per
   engine, and its ratio to one token: speculation pays only while a block costs less than the
   tokens it commits (AAL x one token).
4. ``sd``: greedy speculative decoding in process (``sd.rounds.generate``), drafter and target on
   the same engine, for each K of ``--sd-k`` and each confidence stop of ``--min-confidence``,
   against the target alone on that engine (prompt prefill included in both): tokens/s, AAL, and
   whether the output equals the target's own greedy output.

Writes ``rows.csv`` (every measurement) and ``summary.md`` (the table printed here) and
``block_cost.png`` into ``--out``; says which CPU it measured on.
"""
from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import time
from pathlib import Path

from wisv_ros.sd.engines import BACKENDS, check_backend

__all__ = ["main"]

COLUMNS = ["engine", "part", "model", "k", "value", "unit", "note"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 3) -> float:
    """Best of ``repeats`` single-thread reductions over ``gib`` GiB of float32 (GB/s)."""
    import numpy as np

    a = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.add.reduce(a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def _prompt_ids(lm, n: int) -> list[list[int]]:
    """The first ``n`` HumanEval stubs in the model's vocabulary (completion prompts)."""
    from wisv_ros.eval.datasets import build_prompt, load_humaneval
    from wisv_ros.sd.drafting import encode_prompt

    return [encode_prompt(lm.tokenizer, build_prompt(p, tokenizer_has_chat_template=True), chat=False)
            for p in load_humaneval(n)]


def decode_ms(lm, prompt: list[int], tokens: int) -> float:
    """Median ms per one-token pass of greedy decoding after the prompt."""
    lm.reset()
    step = lm.feed(prompt, n_logits=1)
    times = []
    for _ in range(tokens):
        tok = int(step.logits[-1].argmax())
        t0 = time.perf_counter()
        step = lm.feed([tok], n_logits=1)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def block_ms(lm, prompt: list[int], k: int, repeats: int = 3) -> float:
    """Median ms of one pass over K + 1 tokens after the prompt (all K + 1 logits and hiddens)."""
    lm.reset()
    lm.feed(prompt, n_logits=1)
    block = [int(t) for t in prompt[-(k + 1):]] if len(prompt) > k else [0] * (k + 1)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lm.feed(block, n_logits=k + 1)
        times.append(time.perf_counter() - t0)
        lm.rollback(len(prompt))
    return 1e3 * statistics.median(times)


def sd_run(target, drafter, prompts: list[list[int]], tokens: int, k: int, min_confidence: float = 0.0) -> dict:
    """Greedy SD and the target alone on the same prompts: tokens/s of each, AAL, identical outputs."""
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.rounds import generate, generate_target_only
    from wisv_ros.sd.verification import Verifier

    sd_tokens = sd_s = ref_tokens = ref_s = rounds = 0.0
    identical = 0
    for ids in prompts:
        ref = generate_target_only(target, ids, tokens)
        out = generate(Drafter(drafter, min_confidence=min_confidence), Verifier(target), ids, tokens, k)
        ref_tokens += len(ref.token_ids)
        ref_s += ref.stats.wall_s
        sd_tokens += len(out.token_ids)
        sd_s += out.stats.wall_s
        rounds += out.stats.rounds
        identical += out.token_ids == ref.token_ids
    return {"sd_tokens_per_s": sd_tokens / sd_s, "target_tokens_per_s": ref_tokens / ref_s,
            "aal": sd_tokens / rounds, "identical": identical / len(prompts)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for engine in BACKENDS:
        pts = sorted((r["k"], r["value"]) for r in rows if r["engine"] == engine and r["part"] == "block_ratio")
        if pts:
            ax.plot([k for k, _ in pts], [v for _, v in pts], marker="o", label=f"{engine}: block / one token")
    ks = sorted({r["k"] for r in rows if r["part"] == "block_ratio"})
    if ks:
        ax.plot(ks, [k + 1 for k in ks], ls=":", color="grey", label="K + 1 (no batching gain)")
    ax.set_xlabel("draft tokens K (the pass verifies K + 1)")
    ax.set_ylabel("cost of the block pass / one-token pass")
    ax.set_title(f"target block cost ({cpu_name()})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.engine_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="target model (default %(default)s)")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct", help="drafter of the SD rows (default %(default)s)")
    p.add_argument("--engines", default=",".join(BACKENDS), help="comma-separated engines (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per model (default %(default)s)")
    p.add_argument("--tokens", type=int, default=48, help="tokens per decode and SD run (default %(default)s)")
    p.add_argument("--ks", default="1,2,4,8,16,32", help="block sizes K (default %(default)s)")
    p.add_argument("--sd-k", default="4,8", help="comma-separated K of the SD rows (default %(default)s)")
    p.add_argument("--min-confidence", default="0,0.6",
                   help="comma-separated confidence stops of the SD rows (0 = always K; default %(default)s)")
    p.add_argument("--prompts", type=int, default=3, help="HumanEval prompts of the SD rows (default %(default)s)")
    p.add_argument("--torch-dtype", default="auto", help="torch weights dtype (default %(default)s)")
    p.add_argument("--out", default="runs/engine_bench", help="folder for rows.csv, summary.md, block_cost.png")
    args = p.parse_args(argv)
    try:
        engines = [check_backend(e.strip(), "--engines") for e in args.engines.split(",") if e.strip()]
        ks = [int(k) for k in args.ks.split(",") if k.strip()]
        sd_ks = [int(k) for k in args.sd_k.split(",") if k.strip()]
        stops = [float(c) for c in args.min_confidence.split(",") if c.strip()]
    except ValueError as exc:
        p.error(str(exc))
    if not engines or not ks or min(ks) < 1 or args.threads < 1 or args.tokens < 1 or args.prompts < 1:
        p.error("--engines, --ks (>= 1), --threads, --tokens and --prompts must be given and positive")
    if not sd_ks or min(sd_ks) < 1 or not stops or not all(0 <= c < 1 for c in stops):
        p.error("--sd-k must be >= 1 and --min-confidence in [0, 1)")
    from wisv_ros.sd.engines import load_lm
    from wisv_ros.sd.models import MissingModelError

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def add(engine, part, model, k, value, unit, note=""):
        rows.append({"engine": engine, "part": part, "model": model, "k": k, "value": round(value, 4), "unit": unit,
                     "note": note})
        print(f"[engine_bench] {engine:9s} {part:18s} {model:28s} k={k:<3} {value:10.3f} {unit} {note}",
              file=sys.stderr, flush=True)

    cpu = cpu_name()
    print(f"[engine_bench] {cpu}; {args.threads} thread(s) per model", file=sys.stderr)
    add("-", "bandwidth", "-", 0, read_bandwidth_gbs(), "GB/s", "numpy float32 reduction, 1 thread")
    try:
        for engine in engines:
            target = load_lm(args.target, engine, dtype=args.torch_dtype, threads=args.threads)
            prompts = _prompt_ids(target, args.prompts)
            one = decode_ms(target, prompts[0], args.tokens)
            add(engine, "decode", args.target, 0, one, "ms/token")
            add(engine, "decode_rate", args.target, 0, 1e3 / one, "tokens/s")
            for k in ks:
                ms = block_ms(target, prompts[0], k)
                add(engine, "block", args.target, k, ms, "ms")
                add(engine, "block_ratio", args.target, k, ms / one, "x one token")
            drafter = load_lm(args.drafter, engine, dtype=args.torch_dtype, threads=args.threads)
            add(engine, "draft_decode", args.drafter, 0, decode_ms(drafter, prompts[0], args.tokens), "ms/token")
            for k in sd_ks:
                for stop in stops:
                    sd = sd_run(target, drafter, prompts, args.tokens, k, stop)
                    note = f"min_confidence {stop}, AAL {sd['aal']:.2f}, identical {sd['identical']:.2f}"
                    add(engine, "sd_rate", f"{args.drafter}->{args.target}", k, sd["sd_tokens_per_s"], "tokens/s", note)
            add(engine, "target_rate", args.target, 0, sd["target_tokens_per_s"], "tokens/s", "same prompts, target alone")
            del target, drafter
    except MissingModelError as exc:
        print(f"[engine_bench] error: {exc}", file=sys.stderr)
        return 1
    with open(out / "rows.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    lines = [f"Measured on {cpu}, {args.threads} thread(s) per model; target {args.target}, drafter {args.drafter}.", "",
             "| engine | part | model | K | value | unit | note |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['engine']} | {r['part']} | {r['model']} | {r['k']} | {r['value']} | {r['unit']} | {r['note']} |" for r in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    plot(rows, out / "block_cost.png")
    print("\n".join(lines))
    print(f"[engine_bench] wrote {out}/rows.csv, summary.md, block_cost.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
