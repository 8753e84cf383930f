"""Benchmark the ROS 2 system: the node graph over the emulated link, per scenario and protocol.

    python -m wisv_ros.cli.system_bench --dataset humaneval --limit 3 --max-new-tokens 64 --k 16

For each scenario (default: ``direct`` and the four of ``wisv_ros.link.SCENARIOS``) the node
graph is started as processes (``wisv_ros.cli.launch``): for a link scenario the ``system`` graph
(drafter, verifier, link monitors and the link emulator relaying /robot <-> /edge); for
``direct`` the ``robot`` and ``edge`` graphs meeting on loopback without the emulator, as on a
real network. Every prompt is sent through the Generate action once per configuration:

- ``greedy``:   greedy SD, token ids only (protocol ids);
- ``fh``/``sh``/``adaptive``: method wisv with tau 0.5 under protocol fh, sh or adaptive. Without a
  decision head (``--head``) the verifier rejects every mismatch, so the text is greedy SD's while
  the link carries what the protocol carries (FH: K drafter hidden states per block; SH: a hidden
  request and reply per block with mismatches);
- ``reject``:   rejection SD (temperature 1), only when drafter and target share a vocabulary.

Beside them, the two things a user would run instead, measured in this process with the same
models and thread count and with the link's delay added from the scenario:

- ``target_stream``: the target alone on the edge streaming its tokens to the robot: target-only
  generation time + RTT (prompt up, last token down) + the prompt's transfer time;
- ``colocated``:     both models on the edge (greedy SD in one process) + the same link terms.

Columns (means over the prompts): ``ms_per_token`` (latency / generated tokens), ``rounds``,
``aal``, ``up_B`` / ``down_B`` (bytes per round), ``link_ms`` (per round: block published ->
verdict received, minus the edge's time; measured by drafter_node), ``nominal_ms`` (per round:
the emulated link's loss-free delay for those bytes: an RTT per exchange -- the block's and, under
SH, each hidden request's -- plus the transfer both ways) and
``overhead_ms`` = ``link_ms - nominal_ms``: the time a round spends in ROS, serialization,
the emulator's relay hops and executor wake-ups, outside model compute and emulated delay.
Losses (PER) add retransmission time that ``nominal_ms`` leaves out, so in the lossy scenarios
overhead_ms is an upper bound; ``direct`` has no emulated delay, no loss and no relay: its
overhead_ms is what ROS 2 itself costs a round. Prints a table, writes CSV and a plot.
Run it alone: other load on the CPU shows up as model time and overhead.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

CONFIGS = {
    "greedy": {"method": "greedy", "protocol": "ids"},
    "fh": {"method": "wisv", "protocol": "fh", "tau": 0.5},
    "sh": {"method": "wisv", "protocol": "sh", "tau": 0.5},
    "adaptive": {"method": "wisv", "protocol": "adaptive", "tau": 0.5},
    "reject": {"method": "reject", "protocol": "ids", "temperature": 1.0},
}
BASELINES = ("target_stream", "colocated")
DIRECT = "direct"  # robot and edge graphs connected directly (loopback), no emulator


def _nominal_round_s(state, up_bytes: float, down_bytes: float, exchanges: float = 1.0) -> float:
    """Loss-free emulated delay of one round: an RTT per exchange (the block's, plus SH hidden
    requests) + both transfers (wisv_ros.emulator's model)."""
    return exchanges * state.rtt_s + 8.0 * up_bytes / state.rate_bps + 8.0 * down_bytes / state.downlink_rate_bps


def _channel(name: str):
    from ..link import SCENARIOS, ChannelState

    if name == DIRECT:
        return ChannelState(rate_bps=1e12, per=0.0, rtt_s=0.0)
    return SCENARIOS[name]


def _prompts(args) -> list[str]:
    """The goal prompts: the user message ``datasets.build_prompt`` makes (the drafter node applies
    the chat template, as ``wisv_ros.cli.bench`` does in one process)."""
    from ..datasets import build_prompt, load

    if args.prompt:
        return list(args.prompt)
    problems = load(args.dataset, args.offset + args.limit)[args.offset:]
    out = []
    for problem in problems:
        prompt = build_prompt(problem, tokenizer_has_chat_template=True)
        out.append(prompt if isinstance(prompt, str) else prompt[-1]["content"])
    return out


def run_scenario(scenario: str, configs: list[str], prompts: list[str], args, log_dir: Path) -> list[dict]:
    """Start the graph with this scenario, send every prompt per config; rows of results."""
    import rclpy

    from ..nodes.client import GenerateClient, spin_in_background
    from .ask import _start_goal, _wait_for_verifier, _Waiter
    from .launch import Launcher, build_commands

    arguments = {"drafter_model": args.drafter, "target_model": args.target}
    robot_sets = [f"drafter.min_confidence:={args.min_confidence}", f"drafter.verdict_timeout_s:={args.verdict_timeout}",
                  "drafter.on_edge_loss:=error"]
    edge_sets = [f"verifier.target_dtype:={args.target_dtype}"] + ([f"verifier.head_path:={args.head}"] if args.head else [])
    if scenario == DIRECT:  # the edge graph's link topics are remapped into /robot: no relay
        commands = build_commands("robot", arguments, robot_sets) + build_commands(
            "edge", {"target_model": args.target}, edge_sets)
        verifier_ns = "/robot"
    else:
        commands = build_commands("system", dict(arguments, scenario=scenario), robot_sets + edge_sets)
        verifier_ns = "/edge"
    log = open(log_dir / f"launch_{scenario}.log", "w")
    launcher = Launcher(commands, out=log)
    rows = []
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node(f"system_bench_{os.getpid()}", context=context)
    executor, _ = spin_in_background(node)
    try:
        launcher.start()
        waiter = _Waiter(args.wait, None)
        _wait_for_verifier(node, verifier_ns, waiter)
        client = GenerateClient(node, "/robot/generate")
        for config in configs:
            for i, prompt in enumerate(tqdm(prompts, desc=f"{scenario} {config}", leave=False)):
                goal = dict(CONFIGS[config], max_new_tokens=args.max_new_tokens, k=args.k)
                run = _start_goal(client, prompt, goal, waiter)
                out = run.outcome(args.timeout)
                r = out.result
                if out.status_name != "succeeded" or not r.rounds:
                    raise RuntimeError(f"{scenario} {config} prompt {i}: {out.status_name}: {r.error} (log: {log.name})")
                rows.append(_row(scenario, config, i, r))
    finally:
        launcher.stop(grace=5.0)
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        log.close()
    return rows


def _row(scenario: str, config: str, prompt: int, r) -> dict:
    state = _channel(scenario)
    n = len(r.token_ids)
    up, down = r.uplink_bytes / r.rounds, r.downlink_bytes / r.rounds
    link = (r.round_trip_s - r.edge_time_s) / r.rounds
    nominal = _nominal_round_s(state, up, down, 1.0 + r.hidden_requests / r.rounds)
    return {"scenario": scenario, "config": config, "prompt": prompt, "tokens": n, "rounds": r.rounds,
            "aal": n / r.rounds, "latency_s": r.latency_s, "ms_per_token": 1e3 * r.latency_s / max(n, 1),
            "up_B": up, "down_B": down, "link_ms": 1e3 * link, "nominal_ms": 1e3 * nominal,
            "overhead_ms": 1e3 * (link - nominal), "draft_s": r.draft_time_s, "edge_s": r.edge_time_s}


def run_baselines(prompts: list[str], scenarios: list[str], args) -> list[dict]:
    """target_stream and colocated, measured once per prompt, combined with each scenario's link."""
    import torch

    from ..decoding import Drafter, Method, Verifier, encode_prompt, generate, generate_target_only
    from ..lm import CausalLM
    from ..models import load_model
    from ..wire import text_to_ids

    torch.set_num_threads(args.threads)
    target = CausalLM(*load_model(args.target, dtype=args.target_dtype))
    drafter = CausalLM(*load_model(args.drafter))
    rows = []
    for i, text in enumerate(tqdm(prompts, desc="baselines", leave=False)):
        # Models without a tokenizer (tiny-random) take the goal's "5 9 12 3" as ids, as the nodes do.
        prompt = text if target.tokenizer is not None else text_to_ids(text)
        ids = encode_prompt(target.tokenizer, prompt, True)
        t0 = time.perf_counter()
        alone = generate_target_only(target, ids, args.max_new_tokens)
        t_alone = time.perf_counter() - t0
        t0 = time.perf_counter()
        sd = generate(Drafter(drafter, target.tokenizer if drafter.tokenizer is not None else None,
                              min_confidence=args.min_confidence),
                      Verifier(target, Method.GREEDY), prompt, args.max_new_tokens, args.k)
        t_sd = time.perf_counter() - t0
        prompt_bytes = len(text.encode())
        for scenario in scenarios:
            state = _channel(scenario)
            link = state.rtt_s + 8.0 * prompt_bytes / state.rate_bps
            for name, n, t, rounds in (("target_stream", len(alone.token_ids), t_alone, len(alone.token_ids)),
                                       ("colocated", len(sd.token_ids), t_sd, sd.stats.rounds)):
                rows.append({"scenario": scenario, "config": name, "prompt": i, "tokens": n, "rounds": rounds,
                             "aal": n / max(rounds, 1), "latency_s": t + link,
                             "ms_per_token": 1e3 * (t + link) / max(n, 1), "up_B": float("nan"),
                             "down_B": float("nan"), "link_ms": float("nan"), "nominal_ms": float("nan"),
                             "overhead_ms": float("nan"), "draft_s": float("nan"), "edge_s": float("nan")})
    return rows


SUMMARY = ["tokens", "rounds", "aal", "ms_per_token", "up_B", "down_B", "link_ms", "nominal_ms", "overhead_ms"]


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["config"]), []).append(r)
    out = []
    for (scenario, config), rs in groups.items():
        s = {"scenario": scenario, "config": config, "prompts": len(rs)}
        for c in SUMMARY:
            s[c] = statistics.fmean(r[c] for r in rs)
        out.append(s)
    return out


def format_table(summary: list[dict]) -> str:
    head = ["scenario", "config", "prompts"] + SUMMARY
    lines = ["  ".join(f"{h:>13s}" for h in head)]
    for s in summary:
        cells = [f"{s['scenario']:>13s}", f"{s['config']:>13s}", f"{s['prompts']:>13d}"]
        cells += ["          n/a" if s[c] != s[c] else f"{s[c]:13.2f}" for c in SUMMARY]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(s["scenario"] for s in summary))
    configs = list(dict.fromkeys(s["config"] for s in summary))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(scenarios)), 4))
    width = 0.8 / len(configs)
    for j, config in enumerate(configs):
        ys = [next((s["ms_per_token"] for s in summary if s["scenario"] == sc and s["config"] == config), 0.0)
              for sc in scenarios]
        ax.bar([i + j * width for i in range(len(scenarios))], ys, width, label=config)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scenarios))], scenarios)
    ax.set_ylabel("latency per generated token (ms)")
    ax.set_title("wisv_ros system: latency per token by link scenario")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    from ..link import SCENARIOS
    from ..models import DEFAULT_DRAFTER, DEFAULT_TARGET

    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.system_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="humaneval", help="prompt set of wisv_ros.datasets (default %(default)s)")
    p.add_argument("--limit", type=int, default=3, help="prompts (default %(default)s)")
    p.add_argument("--offset", type=int, default=0, help="first prompt (default %(default)s)")
    p.add_argument("--prompt", action="append", default=[],
                   help="a prompt instead of the data set (repeatable; space-separated ids for tiny-random models)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=16, help="draft block size K (default %(default)s)")
    p.add_argument("--min-confidence", type=float, default=0.6, help="drafter confidence stop (default %(default)s)")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--target-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--head", default="", help="WISV decision head (.onnx) for the verifier ('' = none)")
    p.add_argument("--scenarios", default=",".join([DIRECT, *SCENARIOS]),
                   help=f"comma-separated, of {', '.join([DIRECT, *SCENARIOS])} (default: all)")
    p.add_argument("--configs", default="greedy,fh,sh,adaptive,reject",
                   help=f"comma-separated, of {', '.join(CONFIGS)} (reject only with one vocabulary)")
    p.add_argument("--baselines", default="target_stream,colocated", help="comma-separated, of target_stream, colocated ('' = none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the in-process baselines (the nodes use their parameter files')")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the nodes to load their models")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per goal")
    p.add_argument("--verdict-timeout", type=float, default=30.0, help="drafter_node verdict_timeout_s (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("runs/system_bench"), help="folder for CSV, plot and node logs")
    args = p.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in scenarios if s not in SCENARIOS and s != DIRECT]
    if bad or not scenarios:
        p.error(f"--scenarios: {bad or 'none'}; choose from {', '.join([DIRECT, *SCENARIOS])}")
    configs = [c for c in args.configs.split(",") if c]
    if any(c not in CONFIGS for c in configs):
        p.error(f"--configs: choose from {', '.join(CONFIGS)}")
    baselines = [b for b in args.baselines.split(",") if b]
    if any(b not in BASELINES for b in baselines):
        p.error(f"--baselines: choose from {', '.join(BASELINES)}")
    if args.limit < 1 or args.max_new_tokens < 1 or args.k < 1:
        p.error("--limit, --max-new-tokens and --k must be >= 1")
    if "reject" in configs:
        from ..decoding import same_vocabulary
        from ..nodes.drafter_node import load_tokenizer

        tiny = args.drafter.startswith("tiny-random") and args.target.startswith("tiny-random")
        if not tiny and not same_vocabulary(load_tokenizer(args.drafter), load_tokenizer(args.target)):
            print(f"note: reject skipped: {args.drafter} and {args.target} have different vocabularies", file=sys.stderr)
            configs.remove("reject")
    prompts = _prompts(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for scenario in scenarios:
        rows += run_scenario(scenario, configs, prompts, args, args.out)
        print(format_table(summarize([r for r in rows if r["scenario"] == scenario])), flush=True)
    if baselines:
        rows += [r for r in run_baselines(prompts, scenarios, args) if r["config"] in baselines]
    summary = summarize(rows)
    print(format_table(summary))
    with open(args.out / "rows.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(args.out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    plot(summary, args.out / "latency_per_token.png")
    print(f"wrote {args.out}/rows.csv, summary.csv, latency_per_token.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
