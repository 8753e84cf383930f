"""The engines side by side on this machine: what a token costs, what a block costs, what SD gains.

    python -m wisv_ros.cli.engine_bench --out docs/engines            # the committed report
    python -m wisv_ros.cli.engine_bench --engines llama_cpp --ks 1,4,8 # a quick look

Measured in one run, one thing after another (so that machine noise hits all alike), at
``--threads`` CPU threads per model:

1. ``bandwidth``: the memory read bandwidth of ``--threads`` cores (numpy reductions over 1 GiB
   each); the target's decoding bound (``decode_bound``) is bandwidth / weight bytes read per
   token (the GGUF file's size for llama.cpp, the dequantised weights for torch).
2. ``decode``: the target alone, one token per pass, per engine (ms/token after the prompt), and
   its share of the bound (``decode_of_bound``); with llama.cpp's tools built
   (``tools/build_llama_tools.sh``) also ``llama-bench``'s rate for the same file.
3. ``block``: the cost of one target pass over K + 1 tokens after the prompt, K = ``--ks``, per
   engine, and its ratio to one token: speculation pays only while a block costs less than the
   tokens it commits (AAL x one token).
4. ``sd``: greedy speculative decoding in process (``sd.rounds.generate``), drafter and target on
   the same engine, for each K of ``--sd-k`` and each confidence stop of ``--min-confidence``,
   against the target alone on that engine: tokens/s with the prompt's prefill (``sd_rate``,
   ``target_rate``) and after it (``sd_decode_rate``, ``target_decode_rate``: tokens after the
   first round over the time from its end, as llama.cpp's tools count), AAL, and the share of
   outputs equal to the target's own greedy output.
5. with ``--reject``: rejection SD in process (temperature 1; ``reject_decode_rate``); with
   ``--nodes``: greedy and rejection SD through the node processes (``system_bench --scenarios
   direct``, prompt included).
6. ``llama.cpp tool``: llama.cpp's own speculative decoding with the same pair, prompts, K and
   threads, greedy: ``llama-speculative`` (always K) for stop 0 and ``llama-speculative-simple``
   with ``--spec-draft-p-min`` = the stop otherwise, its decoding rate after the prompt.

Writes ``rows.csv`` (every measurement) and ``summary.md`` (the table printed here) and
``block_cost.png`` into ``--out``; says which CPU it measured on.
"""
from __future__ import annotations

import argparse
import csv
import platform
import re
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


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 3, threads: int = 1) -> float:
    """Best of ``repeats`` reductions over ``gib`` GiB of float32 per thread, ``threads`` at once (GB/s).

    numpy releases the GIL in the reduction loop, so the threads read their arrays in parallel.
    """
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    arrays = [np.ones(int(gib * 2**30) // 4, dtype=np.float32) for _ in range(threads)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.add.reduce, arrays))
            best = min(best, time.perf_counter() - t0)
    return sum(a.nbytes for a in arrays) / best / 1e9


def _prompt_texts(n: int) -> list[str]:
    """The first ``n`` HumanEval stubs (completion prompts, plain text)."""
    from wisv_ros.eval.datasets import build_prompt, load_humaneval

    return [build_prompt(p, tokenizer_has_chat_template=True) for p in load_humaneval(n)]


def _prompt_ids(lm, n: int) -> list[list[int]]:
    """The first ``n`` HumanEval stubs in the model's vocabulary (completion prompts)."""
    from wisv_ros.sd.drafting import encode_prompt

    return [encode_prompt(lm.tokenizer, text, chat=False) for text in _prompt_texts(n)]


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


class _AfterPrefill:
    """A round log that times what follows the first round (the prompt's prefill), as llama.cpp's
    tools report decoding speed: tokens committed after round 1 / seconds from its end to the last."""

    def __init__(self):
        self.stamps: list[tuple[float, int]] = []

    def __call__(self, record) -> None:
        self.stamps.append((time.perf_counter(), record.committed))

    def tokens_and_seconds(self) -> tuple[int, float]:
        if len(self.stamps) < 2:
            return 0, 0.0
        return sum(c for _, c in self.stamps[1:]), self.stamps[-1][0] - self.stamps[0][0]


def sd_run(target, drafter, prompts: list[list[int]], tokens: int, k: int, min_confidence: float = 0.0,
           reference: list[list[int]] | None = None) -> dict:
    """Greedy SD and the target alone on the same prompts: tokens/s of each (prompt prefill included,
    and after the prefill), AAL, the share of outputs identical to the target's own greedy output.

    reference: the target-alone outputs of an earlier call (not decoded again; its rates are then NaN).
    """
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.rounds import generate, generate_target_only
    from wisv_ros.sd.verification import Verifier

    sd_tokens = sd_s = ref_tokens = ref_s = rounds = 0.0
    sd_dec = [0, 0.0]
    ref_dec = [0, 0.0]
    identical = 0
    outputs = []
    for i, ids in enumerate(prompts):
        if reference is None:
            ref_log = _AfterPrefill()
            ref = generate_target_only(target, ids, tokens, round_log=ref_log)
            ref_ids = ref.token_ids
            ref_tokens += len(ref_ids)
            ref_s += ref.stats.wall_s
            n, sec = ref_log.tokens_and_seconds()
            ref_dec = [ref_dec[0] + n, ref_dec[1] + sec]
        else:
            ref_ids = reference[i]
        outputs.append(ref_ids)
        sd_log = _AfterPrefill()
        out = generate(Drafter(drafter, min_confidence=min_confidence), Verifier(target), ids, tokens, k,
                       round_log=sd_log)
        sd_tokens += len(out.token_ids)
        sd_s += out.stats.wall_s
        n, sec = sd_log.tokens_and_seconds()
        sd_dec = [sd_dec[0] + n, sd_dec[1] + sec]
        rounds += out.stats.rounds
        identical += out.token_ids == ref_ids
    nan = float("nan")
    return {"sd_tokens_per_s": sd_tokens / sd_s, "sd_decode_tokens_per_s": sd_dec[0] / sd_dec[1] if sd_dec[1] else nan,
            "target_tokens_per_s": ref_tokens / ref_s if ref_s else nan,
            "target_decode_tokens_per_s": ref_dec[0] / ref_dec[1] if ref_dec[1] else nan,
            "aal": sd_tokens / rounds, "identical": identical / len(prompts), "reference": outputs}


def reject_run(target, drafter, prompts: list[list[int]], tokens: int, k: int, temperature: float = 1.0) -> dict:
    """Rejection-sampling SD (both models sampling at ``temperature``; the output follows the target's
    distribution, not its greedy text): tokens/s after the prefill and AAL."""
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.rounds import generate
    from wisv_ros.sd.verification import Method, Verifier

    n = sec = rounds = committed = 0
    for i, ids in enumerate(prompts):
        clock = _AfterPrefill()
        out = generate(Drafter(drafter, temperature=temperature, seed=i),
                       Verifier(target, Method.REJECT, temperature=temperature, seed=i), ids, tokens, k, round_log=clock)
        got, s_ = clock.tokens_and_seconds()
        n, sec = n + got, sec + s_
        rounds, committed = rounds + out.stats.rounds, committed + len(out.token_ids)
    return {"decode_tokens_per_s": n / sec if sec else float("nan"), "aal": committed / max(rounds, 1)}


def nodes_run(args, out: Path) -> list[dict]:
    """Greedy and rejection SD through the node graph (drafter_node and verifier_node as processes
    over DDS on loopback, no emulated link): ``system_bench --scenarios direct``; its summary rows."""
    import subprocess

    cmd = [sys.executable, "-m", "wisv_ros.cli.system_bench", "--scenarios", "direct", "--configs", "greedy,reject",
           "--limit", str(args.prompts), "--max-new-tokens", str(args.tokens), "--k", str(args.nodes_k),
           "--baselines", "", "--target-backend", "llama_cpp", "--drafter-backend", "llama_cpp", "--out", str(out),
           "--target", args.target, "--drafter", args.drafter]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"system_bench failed (exit {res.returncode}): {' '.join(cmd)}\n{res.stderr[-2000:]}")
    with open(out / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def llama_tools_dir(spec: str) -> Path | None:
    """The folder of llama.cpp's own tools: ``spec`` itself, or for ``auto`` the one
    ``tools/build_llama_tools.sh`` fills in this environment (``<prefix>/llama-tools/<version>/bin``)."""
    if spec == "off":
        return None
    if spec != "auto":
        return Path(spec)
    try:
        from importlib.metadata import version

        found = Path(sys.prefix) / "llama-tools" / version("llama-cpp-python") / "bin"
    except Exception:  # noqa: BLE001 - no llama-cpp-python: no tools either
        return None
    return found if found.is_dir() else None


def _weight_bytes(lm, spec: str, engine: str) -> int:
    """Bytes of weights one decoding step reads: the GGUF file for llama.cpp (its embedding table is
    the tied output matrix, read whole), the parameters in memory for torch less an untied input
    embedding table (one row of it is read per token)."""
    if engine == "llama_cpp":
        return Path(_gguf(spec)).stat().st_size
    total = sum(t.numel() * t.element_size() for t in lm.model.parameters())
    emb, out = lm.model.get_input_embeddings(), lm.model.get_output_embeddings()
    if emb is not None and (out is None or out.weight.data_ptr() != emb.weight.data_ptr()):
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


def _gguf(spec: str) -> str:
    from wisv_ros.sd.models import gguf_path

    return str(gguf_path(spec))


_SPEC_FIELDS = {"decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
                "n_drafted": re.compile(r"n_drafted\s*=\s*(\d+)"), "n_accept": re.compile(r"n_accept\s*=\s*(\d+)"),
                "encoded": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")}


def parse_speculative_log(log: str) -> dict | None:
    """The summary llama-speculative(-simple) logs at its end (None when a field is missing)."""
    got = {name: rx.search(log) for name, rx in _SPEC_FIELDS.items()}
    if not all(got.values()):
        return None
    return {"decoded_tokens": int(got["decoded"].group(1)), "decoded_s": float(got["decoded"].group(2)),
            "prompt_tokens": int(got["encoded"].group(1)), "n_drafted": int(got["n_drafted"].group(1)),
            "n_accept": int(got["n_accept"].group(1))}


def llama_speculative_run(tool: Path, target: str, drafter: str, texts: list[str], tokens: int, k: int,
                          threads: int, p_min: float | None = None, timeout_s: float = 900) -> dict:
    """llama.cpp's own speculative decoding on the same prompts, greedy (temperature 0), K drafts per
    round: ``llama-speculative`` (always K) or, with ``p_min``, ``llama-speculative-simple`` (drafting
    stops below that draft probability, as wisv_ros's confidence stop does).

    Returns decode tokens/s after the prompt (the tool's own "decoded N tokens in S seconds", summed
    over prompts), prompt tokens, drafted and accepted counts.
    """
    import subprocess
    import tempfile

    dec_tokens = accepted = drafted = prompt_tokens = 0
    dec_s = 0.0
    for text in texts:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
        cmd = [str(tool), "-m", _gguf(target), "-md", _gguf(drafter), "-f", f.name, "-n", str(tokens),
               "--spec-draft-n-max", str(k), "--temp", "0", "-t", str(threads), "-tb", str(threads), "-td", str(threads),
               "-tbd", str(threads), "-c", "4096", "-np", "1", "--seed", "0"]
        cmd += (["--spec-type", "draft-simple", "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min)]
                if p_min is not None else [])
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        finally:
            Path(f.name).unlink(missing_ok=True)
        log = res.stdout + res.stderr
        got = parse_speculative_log(log) if res.returncode == 0 else None
        if got is None:
            raise RuntimeError(f"{tool.name} failed (exit {res.returncode}): {' '.join(cmd)}\n{log[-2000:]}")
        dec_tokens += got["decoded_tokens"]
        dec_s += got["decoded_s"]
        prompt_tokens += got["prompt_tokens"]
        drafted += got["n_drafted"]
        accepted += got["n_accept"]
    return {"decode_tokens_per_s": dec_tokens / dec_s, "prompt_tokens": prompt_tokens, "drafted": drafted,
            "accepted": accepted, "acceptance": accepted / drafted if drafted else float("nan")}


def llama_bench_tg(tool: Path, model: str, tokens: int, threads: int) -> float:
    """llama.cpp's own ``llama-bench`` text generation rate (tokens/s, mean of 3 runs of ``tokens``)."""
    import json as _json
    import subprocess

    cmd = [str(tool), "-m", _gguf(model), "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "3", "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {res.returncode}): {' '.join(cmd)}\n{res.stderr[-2000:]}")
    return float(_json.loads(res.stdout)[0]["avg_ts"])


def headline(rows: list[dict]) -> list[str]:
    """The few numbers that decide: per engine, the target alone against its bound, and the best
    greedy SD row (decoding after the prompt) against the target alone; llama.cpp's own tools."""
    def pick(engine, part):
        return [r for r in rows if r["engine"] == engine and r["part"] == part]

    lines = ["| engine | target alone, tokens/s | of the bandwidth bound | best SD, tokens/s (K, row) | SD / target alone |",
             "|---|---|---|---|---|"]
    base = {}
    for engine in dict.fromkeys(r["engine"] for r in rows if r["engine"] != "-"):
        dec = pick(engine, "target_decode_rate") or pick(engine, "decode_rate")
        share = pick(engine, "decode_of_bound")
        sd = max(pick(engine, "sd_decode_rate"), key=lambda r: r["value"], default=None)
        if dec:
            base[engine] = dec[0]["value"]
        ref = base.get(engine, base.get("llama_cpp"))
        lines.append(f"| {engine} | {dec[0]['value']:.2f} |" if dec else f"| {engine} | - |")
        lines[-1] += f" {share[0]['value']:.0%} |" if share else " - |"
        if sd:
            lines[-1] += f" {sd['value']:.2f} (K {sd['k']}, {sd['note'].split(', AAL')[0].split(', acceptance')[0]}) |"
            lines[-1] += f" {sd['value'] / ref:.2f}x |" if ref else " - |"
        else:
            lines[-1] += " - | - |"
    return lines


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
    p.add_argument("--engines", default="torch,llama_cpp", help="comma-separated engines (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per model (default %(default)s)")
    p.add_argument("--tokens", type=int, default=48, help="tokens per decode and SD run (default %(default)s)")
    p.add_argument("--ks", default="1,2,4,8,16,32", help="block sizes K (default %(default)s)")
    p.add_argument("--sd-k", default="4,8", help="comma-separated K of the SD rows (default %(default)s)")
    p.add_argument("--min-confidence", default="0,0.6",
                   help="comma-separated confidence stops of the SD rows (0 = always K; default %(default)s)")
    p.add_argument("--prompts", type=int, default=3, help="HumanEval prompts of the SD rows (default %(default)s)")
    p.add_argument("--torch-dtype", default="auto", help="torch weights dtype (default %(default)s)")
    p.add_argument("--out", default="runs/engine_bench", help="folder for rows.csv, summary.md, block_cost.png")
    p.add_argument("--reject", action="store_true", help="also rejection SD (temperature 1) in process, per K of --sd-k")
    p.add_argument("--nodes", action="store_true",
                   help="also greedy and rejection SD through the node graph (system_bench --scenarios direct; needs "
                   "the ROS 2 environment: source tools/env.sh)")
    p.add_argument("--nodes-k", type=int, default=8, help="K of the node rows (default %(default)s)")
    p.add_argument("--llama-tools", default="auto",
                   help="folder of llama.cpp's own llama-speculative(-simple) and llama-bench, for the rows that race "
                   "them; 'auto': the ones tools/build_llama_tools.sh built for this environment, if any; 'off': "
                   "none (default %(default)s)")
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
    tools = llama_tools_dir(args.llama_tools)
    if tools is not None and not (tools / "llama-speculative").is_file():
        p.error(f"--llama-tools {tools}: no llama-speculative there; build it with 'bash tools/build_llama_tools.sh'")
    if tools is None and args.llama_tools == "auto":
        print("[engine_bench] llama.cpp's own tools are not built: no llama-speculative / llama-bench rows "
              "(build them with 'bash tools/build_llama_tools.sh')", file=sys.stderr)
    bandwidth = read_bandwidth_gbs(threads=args.threads)
    add("-", "bandwidth", "-", 0, bandwidth, "GB/s", f"numpy float32 reduction, {args.threads} thread(s)")
    texts = _prompt_texts(args.prompts)
    try:
        for engine in engines:
            target = load_lm(args.target, engine, dtype=args.torch_dtype, threads=args.threads)
            prompts = _prompt_ids(target, args.prompts)
            one = decode_ms(target, prompts[0], args.tokens)
            add(engine, "decode", args.target, 0, one, "ms/token")
            add(engine, "decode_rate", args.target, 0, 1e3 / one, "tokens/s")
            weight_bytes = _weight_bytes(target, args.target, engine)
            bound = bandwidth / weight_bytes * 1e9
            add(engine, "decode_bound", args.target, 0, bound, "tokens/s",
                f"{bandwidth:.1f} GB/s / {weight_bytes / 1e9:.2f} GB of weights read per token")
            add(engine, "decode_of_bound", args.target, 0, 1e3 / one / bound, "share")
            if engine == "llama_cpp" and tools is not None:
                add("llama.cpp tool", "decode_rate", args.target, 0,
                    llama_bench_tg(tools / "llama-bench", args.target, args.tokens, args.threads), "tokens/s",
                    "llama-bench tg, same build flags")
            for k in ks:
                ms = block_ms(target, prompts[0], k)
                add(engine, "block", args.target, k, ms, "ms")
                add(engine, "block_ratio", args.target, k, ms / one, "x one token")
            drafter = load_lm(args.drafter, engine, dtype=args.torch_dtype, threads=args.threads)
            add(engine, "draft_decode", args.drafter, 0, decode_ms(drafter, prompts[0], args.tokens), "ms/token")
            reference = None
            for k in sd_ks:
                for stop in stops:
                    sd = sd_run(target, drafter, prompts, args.tokens, k, stop, reference=reference)
                    if reference is None:
                        reference = sd["reference"]
                        add(engine, "target_rate", args.target, 0, sd["target_tokens_per_s"], "tokens/s",
                            "same prompts, target alone, prompt included")
                        add(engine, "target_decode_rate", args.target, 0, sd["target_decode_tokens_per_s"],
                            "tokens/s", "same prompts, target alone, after the prompt")
                    note = f"min_confidence {stop}, AAL {sd['aal']:.2f}, identical {sd['identical']:.2f}"
                    pair = f"{args.drafter}->{args.target}"
                    add(engine, "sd_rate", pair, k, sd["sd_tokens_per_s"], "tokens/s", note + ", prompt included")
                    add(engine, "sd_decode_rate", pair, k, sd["sd_decode_tokens_per_s"], "tokens/s",
                        note + ", after the prompt")
            if args.reject:
                for k in sd_ks:
                    rj = reject_run(target, drafter, prompts, args.tokens, k)
                    add(engine, "reject_decode_rate", f"{args.drafter}->{args.target}", k, rj["decode_tokens_per_s"],
                        "tokens/s", f"rejection SD, temperature 1, AAL {rj['aal']:.2f}, after the prompt")
            del target, drafter
            if engine == "llama_cpp" and tools is not None:
                pair = f"{args.drafter}->{args.target}"
                for k in sd_ks:
                    for stop in stops:
                        tool = "llama-speculative" if stop == 0 else "llama-speculative-simple"
                        run = llama_speculative_run(tools / tool, args.target, args.drafter, texts, args.tokens, k,
                                                    args.threads, p_min=None if stop == 0 else stop)
                        add("llama.cpp tool", "sd_decode_rate", pair, k, run["decode_tokens_per_s"], "tokens/s",
                            f"{tool}, " + (f"draft-p-min {stop}" if stop else "always K")
                            + f", acceptance {run['acceptance']:.2f}, prompt tokens {run['prompt_tokens']}"
                            ", after the prompt")
        if args.nodes:
            for r in nodes_run(args, out / "nodes"):
                add("nodes", f"{r['config']}_rate", f"{args.drafter}->{args.target}", int(r["k"]),
                    1e3 / float(r["ms_per_token"]), "tokens/s",
                    f"drafter_node + verifier_node over DDS (llama_cpp), AAL {float(r['aal']):.2f}, prompt included")
    except (MissingModelError, RuntimeError) as exc:
        print(f"[engine_bench] error: {exc}", file=sys.stderr)
        return 1
    with open(out / "rows.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    lines = [f"Measured on {cpu}, {args.threads} thread(s) per model; target {args.target}, drafter {args.drafter}; "
             f"{args.prompts} HumanEval prompts x {args.tokens} tokens.", "",
             *headline(rows), "",
             "Target-alone and SD rates count the tokens after the prompt's prefill (llama.cpp's tools count so); "
             "each SD row is compared with the target alone on the same engine (llama.cpp's tools: llama-bench's rate, "
             "or the llama_cpp backend's where llama-bench did not run).", "",
             "| engine | part | model | K | value | unit | note |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['engine']} | {r['part']} | {r['model']} | {r['k']} | {r['value']} | {r['unit']} | {r['note']} |" for r in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    plot(rows, out / "block_cost.png")
    print("\n".join(lines))
    print(f"[engine_bench] wrote {out}/rows.csv, summary.md, block_cost.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
