"""Fleet benchmark: N robots on one edge, their blocks verified one by one or batched in one pass.

    python -m wisv_ros.cli.fleet_bench [--robots 1,2,4,8] [--max-new-tokens 96] [--k 8]
        [--scenario 20mbps_50ms] [--out runs/fleet]

What it measures, on this machine, with the default pair on llama.cpp (one thread per model):

1. **Record** each robot's greedy speculative decoding alone (robot i answers GSM8K problem i, the
   same prompt for robot i at every N): its blocks (draft tokens, prefix length, the drafter's
   measured time) and what each verdict committed. Greedy SD is deterministic, so these are the
   blocks the robot sends whatever the edge does.
2. **Replay** the recorded blocks of N robots against one edge (``EdgeSessions`` over a target with
   a KV sequence per robot), the robots in lock-step: every round each active robot sends its next
   block at once, and the edge verifies them **sequentially** (``handle`` one after another, the
   order rotating each round) or **batched** (``begin_many``: one target pass for all of them). The
   edge's time is measured; each verdict is checked against the recorded one (``differs`` counts the
   blocks whose verdict differed: a near-tie that another batch or cache layout rounds the other
   way; the edge is then set to the recorded context, as ``bag reverify`` does, and the replay goes on).
3. **Target alone, streaming** to the N robots: the target decodes the N answers itself, one token
   per robot per pass, all robots' tokens in one pass (the continuous batching a serving engine
   does).
4. **Projected** (``--profile``, default ``orin_robot_l4_edge`` of ``config/hardware_profiles.yaml``):
   the same recorded blocks with every compute time from the profile instead of this machine: the
   robot device's drafter time per token, and the edge device's pass over each robot's tokens
   (sequential), over all of them (batched), or one token per robot (target alone). Rows named
   "(projected, <profile>)"; ``--project-only`` skips the measured replay.

A robot's round takes its measured drafting time, the link's exchange (the cost model of
``link.channel``: ids up, the verdict down, ``--scenario``), and its wait at the edge; a lock-step
round lasts as long as its slowest robot. Reported per N and system: system tokens/s (all robots'
committed tokens over the whole run), each robot's latency per token (median and p95 over robots),
target passes per committed token, and batched against sequential. Drafting is timed once per robot
alone: in a real fleet every robot drafts on its own hardware, in parallel; here only the edge's
work is measured under load. Prints a table, writes ``fleet.csv`` and ``fleet.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

__all__ = ["main"]

FIELDS = ["robots", "system", "tokens", "wall_s", "system_tokens_s", "edge_s", "edge_tokens_s",
          "latency_ms_median", "latency_ms_p95", "target_passes", "passes_per_token", "differs"]


def _p95(values: list[float]) -> float:
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(round(0.95 * (len(vals) - 1))))]


def record(drafter, target, prompts: list[list[int]], max_new_tokens: int, k: int, min_confidence: float) -> list[dict]:
    """Each robot's greedy SD alone: its blocks and the committed ids of each verdict."""
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.rounds import generate
    from wisv_ros.sd.verification import Method, Verifier

    robots = []
    for prompt in prompts:
        blocks: list[dict] = []

        def on_round(block, verdict, _n_before, blocks=blocks):
            blocks.append({"token_ids": list(block.token_ids), "prefix_length": block.prefix_length,
                           "draft_time_s": block.draft_time_s, "committed": list(verdict.committed_ids)})

        target.use(0)
        target.reset()
        gen = generate(Drafter(drafter, min_confidence=min_confidence), Verifier(target, Method.GREEDY), prompt,
                       max_new_tokens, k, chat=False, on_round=on_round)
        robots.append({"prompt": list(prompt), "blocks": blocks, "tokens": len(gen.token_ids)})
    target.reset()
    return robots


def replay(target, robots: list[dict], mode: str, k: int, state) -> dict:
    """N robots' recorded blocks in lock-step against one edge, ``sequential`` or ``batched``."""
    from wisv_ros.link.channel import WireFormat, downlink_bytes_verdict, exchange_time_s, uplink_bytes_ids
    from wisv_ros.sd.rounds import BlockRequest, EdgeSessions

    fmt = WireFormat(hidden_dim=1)
    target.reset()
    edge = EdgeSessions(target, max_requests=max(16, len(robots)))
    n = len(robots)
    robot_time = [0.0] * n
    committed = [0] * n
    context = [list(r["prompt"]) for r in robots]
    differs, wall, edge_s = 0, 0.0, 0.0
    passes0 = target.forward_passes
    rounds = max(len(r["blocks"]) for r in robots)
    for r in range(rounds):
        active = [j for j in range(n) if r < len(robots[j]["blocks"])]
        if not active:
            break
        reqs = {}
        for j in active:
            b = robots[j]["blocks"][r]
            reqs[j] = BlockRequest(f"robot{j + 1}", r, b["prefix_length"], b["token_ids"], k=k, protocol="ids",
                                   method="greedy", context_ids=robots[j]["prompt"] if r == 0 else [],
                                   draft_time_s=b["draft_time_s"])
        done_at: dict[int, float] = {}
        replies = {}
        t0 = time.perf_counter()
        if mode == "sequential":
            order = active[r % len(active):] + active[:r % len(active)]
            for j in order:
                replies[j] = edge.handle(reqs[j])
                done_at[j] = time.perf_counter() - t0
        else:
            outs = edge.begin_many([reqs[j] for j in active])
            for j, out in zip(active, outs):
                replies[j] = edge.complete(out)
                done_at[j] = time.perf_counter() - t0
        round_edge = time.perf_counter() - t0
        edge_s += round_edge
        slowest = 0.0
        for j in active:
            b, reply = robots[j]["blocks"][r], replies[j]
            if reply.error:
                raise RuntimeError(f"robot{j + 1} round {r}: the edge refused a recorded block: {reply.error}")
            if list(reply.committed_ids) != b["committed"]:
                # a near-tie the other cache layout decided the other way: the robot follows its
                # recording (as bag reverify does), so that its next recorded block fits
                differs += 1
                edge.rewind(f"robot{j + 1}", context[j] + b["committed"])
            context[j] += b["committed"]
            up = uplink_bytes_ids(fmt, len(b["token_ids"])) + (len(robots[j]["prompt"]) * fmt.id_bytes if r == 0 else 0)
            link = exchange_time_s(up, downlink_bytes_verdict(fmt, len(b["committed"])), state)
            t = b["draft_time_s"] + link + done_at[j]
            robot_time[j] += t
            committed[j] += len(b["committed"])
            slowest = max(slowest, t)
        wall += slowest
    tokens = sum(committed)
    lat = [1000 * robot_time[j] / committed[j] for j in range(n) if committed[j]]
    passes = target.forward_passes - passes0
    return {"tokens": tokens, "wall_s": wall, "edge_s": edge_s, "latency": lat, "target_passes": passes,
            "differs": differs}


def target_alone(target, robots: list[dict], state) -> dict:
    """The target decodes every robot's answer itself, one token per robot per pass (all in one pass)."""
    from wisv_ros.link.channel import WireFormat, downlink_bytes_verdict, exchange_time_s

    fmt = WireFormat(hidden_dim=1)
    target.reset()
    n = len(robots)
    goal = [r["tokens"] for r in robots]
    nxt = [list(r["prompt"]) for r in robots]
    made = [0] * n
    passes0 = target.forward_passes
    t0 = time.perf_counter()
    while True:
        active = [j for j in range(n) if made[j] < goal[j]]
        if not active:
            break
        if len(active) == 1 and target.n_sessions == 1:
            steps = [target.feed(nxt[active[0]], n_logits=1)]
        else:
            steps = target.feed_many([(j, nxt[j]) for j in active])
        for j, step in zip(active, steps):
            nxt[j] = [int(step.logits[-1].argmax())]
            made[j] += 1
    compute = time.perf_counter() - t0
    # streamed: the prompt goes up once, each token comes down as it is made (pipelined behind the compute)
    lat = []
    for j in range(n):
        link = exchange_time_s(len(robots[j]["prompt"]) * fmt.id_bytes, downlink_bytes_verdict(fmt, 1), state)
        lat.append(1000 * (compute + link) / goal[j])
    return {"tokens": sum(goal), "wall_s": compute + max(
        exchange_time_s(len(r["prompt"]) * fmt.id_bytes, downlink_bytes_verdict(fmt, 1), state) for r in robots),
            "edge_s": compute, "latency": lat, "target_passes": target.forward_passes - passes0, "differs": 0}


def project(robots: list[dict], mode: str, state, deployment) -> dict:
    """The recorded blocks in lock-step as ``replay`` runs them, every compute time from a hardware
    profile (``eval.latency``; a projection, not a measurement): the drafter's ``token_s`` per drafted
    token (and its prompt's prefill) on the robot device, and on the edge device one pass over each
    robot's tokens (``sequential``: one after another, the order rotating) or one pass over all of
    them (``batched``), or, ``target_alone``, one pass a token over every robot still answering."""
    from wisv_ros.link.channel import WireFormat, downlink_bytes_verdict, exchange_time_s, uplink_bytes_ids

    fmt = WireFormat(hidden_dim=1)
    tgt, dft = deployment.edge.model(deployment.target), deployment.robot.model(deployment.drafter)
    n = len(robots)
    robot_time, committed, wall, edge_s, passes = [0.0] * n, [0] * n, 0.0, 0.0, 0
    if mode == "target_alone":
        edge_s = tgt.block(sum(len(r["prompt"]) for r in robots))  # every prompt in one prefill pass
        passes = 1
        for step in range(max(r["tokens"] for r in robots)):
            active = sum(step < r["tokens"] for r in robots)
            edge_s += tgt.token_s if active == 1 else tgt.block(active)
            passes += 1
        lat = [1000 * (edge_s + exchange_time_s(len(r["prompt"]) * fmt.id_bytes, downlink_bytes_verdict(fmt, 1), state))
               / r["tokens"] for r in robots]
        return {"tokens": sum(r["tokens"] for r in robots), "wall_s": edge_s + max(
            exchange_time_s(len(r["prompt"]) * fmt.id_bytes, downlink_bytes_verdict(fmt, 1), state) for r in robots),
                "edge_s": edge_s, "latency": lat, "target_passes": passes, "differs": 0}
    for r in range(max(len(x["blocks"]) for x in robots)):
        active = [j for j in range(n) if r < len(robots[j]["blocks"])]
        fed = {j: (len(robots[j]["prompt"]) if r == 0 else 1) + len(robots[j]["blocks"][r]["token_ids"]) for j in active}
        done_at = {}
        if mode == "sequential":
            t = 0.0
            for j in active[r % len(active):] + active[:r % len(active)]:
                t += tgt.block(fed[j])
                done_at[j] = t
            passes += len(active)
        else:
            t = tgt.block(sum(fed.values()))
            done_at = dict.fromkeys(active, t)
            passes += 1
        edge_s += t
        slowest = 0.0
        for j in active:
            b = robots[j]["blocks"][r]
            draft = dft.token_s * len(b["token_ids"]) + (dft.block(len(robots[j]["prompt"])) if r == 0 else 0.0)
            up = uplink_bytes_ids(fmt, len(b["token_ids"])) + (len(robots[j]["prompt"]) * fmt.id_bytes if r == 0 else 0)
            rt = draft + exchange_time_s(up, downlink_bytes_verdict(fmt, len(b["committed"])), state) + done_at[j]
            robot_time[j] += rt
            committed[j] += len(b["committed"])
            slowest = max(slowest, rt)
        wall += slowest
    lat = [1000 * robot_time[j] / committed[j] for j in range(n) if committed[j]]
    return {"tokens": sum(committed), "wall_s": wall, "edge_s": edge_s, "latency": lat, "target_passes": passes,
            "differs": 0}


def _row(n: int, system: str, res: dict) -> dict:
    tokens = res["tokens"]
    return {"robots": n, "system": system, "tokens": tokens, "wall_s": round(res["wall_s"], 3),
            "system_tokens_s": round(tokens / res["wall_s"], 3) if res["wall_s"] else 0.0,
            "edge_s": round(res["edge_s"], 3), "edge_tokens_s": round(tokens / res["edge_s"], 3) if res["edge_s"] else 0.0,
            "latency_ms_median": round(statistics.median(res["latency"]), 2) if res["latency"] else 0.0,
            "latency_ms_p95": round(_p95(res["latency"]), 2) if res["latency"] else 0.0,
            "target_passes": res["target_passes"],
            "passes_per_token": round(res["target_passes"] / tokens, 4) if tokens else 0.0, "differs": res["differs"]}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for system in dict.fromkeys(r["system"] for r in rows):
        rs = [r for r in rows if r["system"] == system]
        ns = [r["robots"] for r in rs]
        a.plot(ns, [r["system_tokens_s"] for r in rs], marker="o", label=system)
        b.plot(ns, [r["latency_ms_median"] for r in rs], marker="o", label=system)
    a.set(xlabel="robots on one edge", ylabel="system tokens/s", xscale="log", xticks=sorted({r["robots"] for r in rows}))
    b.set(xlabel="robots on one edge", ylabel="latency per token, median robot (ms)", xscale="log",
          xticks=sorted({r["robots"] for r in rows}))
    for ax in (a, b):
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    a.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from wisv_ros.sd.models import DEFAULT_DRAFTER, DEFAULT_TARGET

    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.fleet_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--robots", default="1,2,4,8", help="fleet sizes N, comma-separated (default 1,2,4,8)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help=f"drafter model (default {DEFAULT_DRAFTER})")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per robot's answer (default 96)")
    p.add_argument("--k", type=int, default=8, help="draft block size (default 8)")
    p.add_argument("--min-confidence", type=float, default=0.6, help="drafter's confidence stop (default 0.6, as drafter_node)")
    p.add_argument("--scenario", default="20mbps_50ms", help="channel of every robot's link (default 20mbps_50ms)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per model (default 1)")
    p.add_argument("--out", default="runs/fleet", help="folder of fleet.csv and fleet.png (default runs/fleet)")
    p.add_argument("--profile", default="orin_robot_l4_edge",
                   help="deployment of config/hardware_profiles.yaml for the projected rows ('' = none; default %(default)s)")
    p.add_argument("--project-only", action="store_true",
                   help="record the robots' blocks, then only project them (no measured replay on this machine)")
    args = p.parse_args(argv)
    try:
        sizes = sorted({int(x) for x in args.robots.split(",") if x.strip()})
    except ValueError:
        p.error(f"--robots: {args.robots!r} is not a comma-separated list of integers")
    if not sizes or sizes[0] < 1 or sizes[-1] > 32:
        p.error(f"--robots: sizes must be in [1, 32], got {args.robots!r}")
    if args.max_new_tokens < 1 or not 1 <= args.k <= 64:
        p.error(f"--max-new-tokens must be >= 1 and --k in [1, 64] (got {args.max_new_tokens}, {args.k})")
    from wisv_ros.link.channel import SCENARIOS

    if args.scenario not in SCENARIOS:
        p.error(f"--scenario: {args.scenario!r} is not one of {', '.join(SCENARIOS)}")
    state = SCENARIOS[args.scenario]
    deployment = None
    if args.profile:
        from wisv_ros.eval.latency import load_profiles

        deployment = load_profiles().deployment(args.profile)  # ValueError names the profile
    elif args.project_only:
        p.error("--project-only needs --profile")

    from wisv_ros.eval.datasets import build_prompt, load_gsm8k
    from wisv_ros.sd.drafting import encode_prompt
    from wisv_ros.sd.engines import load_lm

    n_max = sizes[-1]
    drafter = load_lm(args.drafter, "llama_cpp", threads=args.threads, n_ctx=4096)
    problems = load_gsm8k(n_max)
    prompts = [encode_prompt(drafter.tokenizer, build_prompt(pr, True), True) for pr in problems]
    per_robot = max(len(x) for x in prompts) + args.max_new_tokens + 2 * args.k + 16
    target = load_lm(args.target, "llama_cpp", threads=args.threads, n_ctx=n_max * per_robot, n_sessions=n_max)
    t_start = time.perf_counter()
    print(f"recording {n_max} robots' greedy SD alone ...", file=sys.stderr)
    robots = record(drafter, target, prompts, args.max_new_tokens, args.k, args.min_confidence)
    rows = []
    systems = [] if args.project_only else [
        ("split, sequential verification", lambda f: replay(target, f, "sequential", args.k, state)),
        ("split, batched verification", lambda f: replay(target, f, "batched", args.k, state)),
        ("target alone, streaming", lambda f: target_alone(target, f, state))]
    if deployment is not None:  # the same recorded blocks, priced by the hardware profile
        tag = f" (projected, {deployment.name})"
        systems += [(name + tag, lambda f, m=mode: project(f, m, state, deployment)) for name, mode in
                    (("split, sequential verification", "sequential"), ("split, batched verification", "batched"),
                     ("target alone, streaming", "target_alone"))]
    for n in sizes:
        fleet = robots[:n]
        for system, fn in systems:
            rows.append(_row(n, system, fn(fleet)))
            print(f"N={n} {system}: {rows[-1]['system_tokens_s']} tokens/s", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "fleet.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    title = (f"{args.drafter} -> {args.target}, llama.cpp {args.threads} thread(s) per model, K {args.k}, "
             f"{args.max_new_tokens} tokens per robot, {args.scenario}")
    plot(rows, out / "fleet.png", title)
    print(f"\n{title}; took {time.perf_counter() - t_start:.0f} s\n")
    print("| robots | system | system tokens/s | latency ms/token: median / p95 robot | target passes per token | "
          "batched vs sequential (tokens/s) | verdicts differing |")
    print("|---|---|---|---|---|---|---|")
    seq = {(r["robots"], r["system"].replace("sequential", "batched")): r for r in rows if "sequential verification" in r["system"]}
    for r in rows:
        base = seq.get((r["robots"], r["system"]))
        ratio = f"{r['system_tokens_s'] / base['system_tokens_s']:.2f}x" if base and base["system_tokens_s"] else ""
        print(f"| {r['robots']} | {r['system']} | {r['system_tokens_s']} | {r['latency_ms_median']} / {r['latency_ms_p95']} | "
              f"{r['passes_per_token']} | {ratio} | {r['differs']} |")
    print(f"\nwrote {out / 'fleet.csv'} and {out / 'fleet.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
