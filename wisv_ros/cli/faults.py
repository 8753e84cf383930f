"""Faults while answering: kill and restart the verifier, stall it, lose and reorder messages,
cut the link; every answer must still be the target's, every token once.

    python -m wisv_ros.cli.faults --tries 10 --out docs/results/faults
    python -m wisv_ros.cli.faults --faults restart --tries 3        # one kind, a quick look

For each fault kind a graph is started on this machine (tiny random models by default; the drafter
with ``on_edge_loss: wait``), a reference answer is asked without the fault, and then ``--tries``
answers with it:

- ``restart``: SIGKILL the verifier after the answer's first tokens and start a new one (it answers
  "edge loading" until its model is in);
- ``stall``: SIGSTOP the verifier for ``--stall-s`` seconds, then SIGCONT;
- ``loss``: through the link emulator with 10 % of the protocol's messages dropped, 10 % reordered
  and 5 % duplicated for the whole answer;
- ``outage``: through the link emulator, the link dark for ``--outage-s`` seconds from the first
  tokens on.

Per kind: answers identical to the reference (and the streamed feedback identical to the result:
no token lost or repeated), resends (the drafter's "resending the block" warnings), drafter-only
rounds, and the time to finish against the first answer's (asked before any fault; for ``loss``
the faults are on from the start, so that one has them too). Writes ``faults.csv`` and ``summary.md``
into ``--out``; exit code 1 when an answer differs.
"""
from __future__ import annotations

import argparse
import csv
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from wisv_ros.cli.fuzz import PROMPT, TINY_DRAFTER, TINY_TARGET  # the same tiny graph and prompt

__all__ = ["main"]

KINDS = ("restart", "stall", "loss", "outage")
LOSS_SETS = ["emulator.fault_drop_rate:=0.1", "emulator.fault_reorder_rate:=0.1", "emulator.fault_reorder_s:=0.03",
             "emulator.fault_duplicate_rate:=0.05"]


def run_kind(kind: str, args, out: Path) -> dict:
    from wisv_ros.cli.launch import build_commands, running_graph
    from wisv_ros.nodes.client import GenerateClient, set_string_parameter, wait_until_active

    arguments = {"drafter_model": args.drafter, "target_model": args.target}
    robot_sets = ["drafter.min_confidence:=0.0", "drafter.on_edge_loss:=wait", "drafter.placement:=split", "drafter.verdict_timeout_s:=0.5",
                  "drafter.first_verdict_timeout_s:=2.0", "drafter.verdict_retries:=1", "drafter.edge_retry_s:=0.2",
                  f"drafter.edge_wait_s:={args.edge_wait_s}"]
    edge_sets = ["verifier.target_dtype:=float32"]
    if kind in ("restart", "stall"):  # robot and edge meeting on loopback
        commands = build_commands("robot", arguments, robot_sets) + build_commands(
            "edge", {"target_model": args.target}, edge_sets)
    else:
        sets = robot_sets + edge_sets + (LOSS_SETS if kind == "loss" else []) + [f"emulator.seed:={args.seed}"]
        commands = build_commands("system", dict(arguments, scenario="500mbps_5ms"), sets)
    log_path = out / f"launch_{kind}.log"
    row = {"fault": kind, "tries": 0, "identical": 0, "stream_ok": 0, "resends": 0, "drafter_only_rounds": 0,
           "reference_s": 0.0, "median_s": 0.0, "max_s": 0.0}
    with running_graph(commands, log_path, "faults", args.wait) as (launcher, node, check):
        client = GenerateClient(node, "/robot/generate")

        def answer():
            return client.start(PROMPT, max_new_tokens=args.tokens, k=args.k)

        ref = answer().outcome(120.0)
        if ref.status_name != "succeeded":
            raise RuntimeError(f"{kind}: reference answer {ref.status_name}: {ref.result.error}")
        ref_ids = list(ref.result.token_ids)
        row["reference_s"] = round(ref.result.latency_s, 2)
        times = []
        for _ in range(args.tries):
            resends_before = log_path.read_text(errors="replace").count("resending the block")
            run = answer()
            if not run.first_feedback(60.0):
                raise RuntimeError(f"{kind}: no first tokens within 60 s; see {log_path}")
            if kind == "restart":
                launcher.restart("edge/verifier_node")
            elif kind == "stall":
                pid = launcher.process("edge/verifier_node").pid
                os.kill(pid, signal.SIGSTOP)
                time.sleep(args.stall_s)
                os.kill(pid, signal.SIGCONT)
            elif kind == "outage":
                set_string_parameter(node, "/link_emulator", "fault_outages", f"0:{args.outage_s}")
            res = run.outcome(args.edge_wait_s + 120.0)
            ids = list(res.result.token_ids)
            row["tries"] += 1
            row["identical"] += res.status_name == "succeeded" and ids == ref_ids
            row["stream_ok"] += res.feedback_ids() == ids
            row["drafter_only_rounds"] += res.result.drafter_only_rounds
            row["resends"] += log_path.read_text(errors="replace").count("resending the block") - resends_before
            times.append(res.result.latency_s)
            if kind == "restart":  # the next try starts once the new verifier is up
                wait_until_active(node, ["/edge/verifier_node"], check)
        row["median_s"] = round(statistics.median(times), 2)
        row["max_s"] = round(max(times), 2)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)} (default: all)")
    p.add_argument("--tries", type=int, default=10, help="answers per fault (default %(default)s)")
    p.add_argument("--tokens", type=int, default=200, help="tokens per answer (default %(default)s)")
    p.add_argument("--k", type=int, default=4, help="draft block size (default %(default)s)")
    p.add_argument("--stall-s", type=float, default=5.0, help="seconds the verifier is stopped (default %(default)s)")
    p.add_argument("--outage-s", type=float, default=5.0, help="seconds the link is dark (default %(default)s)")
    p.add_argument("--edge-wait-s", type=float, default=120.0, help="drafter_node edge_wait_s (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="link emulator seed (default %(default)s)")
    p.add_argument("--wait", type=float, default=300.0, help="seconds for the nodes to load (default %(default)s)")
    p.add_argument("--target", default=TINY_TARGET, help="target model (default %(default)s)")
    p.add_argument("--drafter", default=TINY_DRAFTER, help="drafter model (default %(default)s)")
    p.add_argument("--out", default="runs/faults", help="folder for faults.csv, summary.md and the graph logs")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        p.error(f"--faults: {bad or 'none'}; choose from {', '.join(KINDS)}")
    if args.tries < 1 or args.tokens < 1 or args.k < 1 or min(args.stall_s, args.outage_s) <= 0:
        p.error("--tries, --tokens and --k must be >= 1, --stall-s and --outage-s > 0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows = []
    for kind in kinds:
        print(f"[faults] {kind}: {args.tries} answers", file=sys.stderr, flush=True)
        rows.append(run_kind(kind, args, out))
        print(f"[faults] {rows[-1]}", file=sys.stderr, flush=True)
    with open(out / "faults.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [f"`python -m wisv_ros.cli.faults --faults {','.join(kinds)} --tries {args.tries} --tokens {args.tokens}` "
             f"({time.monotonic() - t0:.0f} s; target {args.target}, drafter {args.drafter}, on_edge_loss wait)", "",
             "| fault | answers | identical to the reference | stream = result | resends | drafter-only rounds "
             "| first answer (s) | median time (s) | max time (s) |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['fault']} | {r['tries']} | {r['identical']} | {r['stream_ok']} | {r['resends']} | "
              f"{r['drafter_only_rounds']} | {r['reference_s']} | {r['median_s']} | {r['max_s']} |" for r in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["identical"] == r["tries"] == r["stream_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
