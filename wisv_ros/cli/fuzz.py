"""Fuzz the running nodes: malformed messages on every input topic and bad Generate goals.

    python -m wisv_ros.cli.fuzz --messages 10000 --goals 500 --out runs/fuzz     # starts its own graph
    python -m wisv_ros.cli.fuzz --messages 300 --goals 30                          # a quick look

Starts the ``robot`` and ``edge`` graphs on this machine (tiny random models by default, topics
meeting in ``/robot`` without the link emulator) and, seeded and bounded:

1. asks a reference prompt (the answer every later reference must repeat);
2. publishes ``--messages`` malformed DraftBlocks (``interfaces.fuzz.block_cases``: NaN and
   infinite numbers, ids outside the vocabulary, more ids than k, unknown protocols, broken
   tensors, bad reject distributions, inconsistent or oversized contexts, odd strings), at most
   ``--window`` unanswered at a time so that losses are the system's, not the harness's, and checks
   that each one gets a Verdict whose error names the field (never ``internal error``), while a
   reference goal runs through the same verifier;
3. publishes ``--messages`` random messages on each of the other inputs (verdict and
   hidden_request to the drafter, hidden_reply and channel_state to both): they must be ignored;
4. sends ``--goals`` bad goals, each of which must be aborted with the field named;
5. asks the reference again, and checks that every node process is still up and how much its
   resident memory grew.

Prints a table per input and writes ``fuzz.csv`` and ``summary.md`` into ``--out``; the exit code
is 1 when any check failed.
"""
from __future__ import annotations

import argparse
import csv
import random
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from wisv_ros.interfaces.fuzz import block_cases, goal_cases, noise_cases

__all__ = ["main"]

TINY_TARGET, TINY_DRAFTER = "tiny-random:0:64", "tiny-random:0:64:0.05"
PROMPT = "5 9 13 2 7 11 3"


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def _fill(msg, fields: dict) -> None:
    """Set message fields from a fuzz case (nested dicts for HiddenStates / Tensor)."""
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, dict):
            _fill(getattr(msg, name), value)
        else:
            setattr(msg, name, value)


def _expect_ok(error: str, expect: str) -> bool:
    """A named error: not empty, not an internal error, and naming what the case broke."""
    return bool(error) and not error.startswith("internal error") and (not expect or expect in error)


class _Verdicts:
    """Verdicts by request id (the fuzz blocks' ids are unique)."""

    def __init__(self):
        self.by_id: dict[str, object] = {}
        self.cv = threading.Condition()

    def __call__(self, msg) -> None:
        with self.cv:
            self.by_id.setdefault(msg.request_id, msg)
            self.cv.notify_all()

    def wait(self, rid: str, timeout: float):
        deadline = time.monotonic() + timeout
        with self.cv:
            while rid not in self.by_id:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cv.wait(left)
            return self.by_id[rid]


def run(args) -> tuple[list[dict], list[str]]:
    from wisv_ros.cli.launch import build_commands, running_graph
    from wisv_ros.msg import ChannelState, DraftBlock, HiddenReply, HiddenRequest, Verdict
    from wisv_ros.nodes.client import GenerateClient
    from wisv_ros.nodes.common import RELIABLE_QOS, reliable_qos
    from wisv_ros.sd.engines import load_lm

    target = load_lm(args.target, args.target_backend, dtype="float32")
    drafter = load_lm(args.drafter, args.target_backend, dtype="float32")
    vocab, hidden = target.vocab_size, drafter.hidden_size
    prefix = [int(x) for x in PROMPT.split()] if target.tokenizer is None else target.tokenizer.encode(PROMPT)
    del target, drafter
    rng = random.Random(args.seed)
    failures: list[str] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arguments = {"drafter_model": args.drafter, "target_model": args.target}
    # placement split: every goal exercises the blocks being fuzzed
    robot_sets = ["drafter.min_confidence:=0.0", "drafter.on_edge_loss:=error", "drafter.placement:=split",
                  f"drafter.backend:={args.target_backend}"]
    edge_sets = ["verifier.target_dtype:=float32", f"verifier.backend:={args.target_backend}"]
    commands = build_commands("robot", arguments, robot_sets) + build_commands(
        "edge", {"target_model": args.target}, edge_sets)
    rows: list[dict] = []
    with running_graph(commands, out / "launch.log", "fuzz", args.wait) as (launcher, node, check):
        client = GenerateClient(node, "/robot/generate")
        verdicts = _Verdicts()
        # Deep history: the harness floods this topic itself, and on a loaded machine its executor can
        # fall 10 messages behind; a verdict pushed out of its own reader's history is the harness's loss.
        node.create_subscription(Verdict, "/robot/verdict", verdicts, reliable_qos(1000))
        pubs = {"draft_block": node.create_publisher(DraftBlock, "/robot/draft_block", RELIABLE_QOS),
                "verdict": node.create_publisher(Verdict, "/robot/verdict", RELIABLE_QOS),
                "hidden_request": node.create_publisher(HiddenRequest, "/robot/hidden_request", RELIABLE_QOS),
                "hidden_reply": node.create_publisher(HiddenReply, "/robot/hidden_reply", RELIABLE_QOS),
                "channel_state": node.create_publisher(ChannelState, "/robot/channel_state", RELIABLE_QOS)}
        types = {"verdict": Verdict, "hidden_request": HiddenRequest, "hidden_reply": HiddenReply,
                 "channel_state": ChannelState}
        while pubs["draft_block"].get_subscription_count() == 0:
            check("the verifier's draft_block subscription")
        procs = dict(launcher.procs)
        pids = {label: proc.pid for label, proc in procs.items()}
        rss0 = {label: _rss_kb(pid) for label, pid in pids.items()}

        def reference():
            return client.start(PROMPT, max_new_tokens=args.reference_tokens, k=4)

        ref = reference().outcome(120.0)
        if ref.status_name != "succeeded":
            raise RuntimeError(f"reference goal: {ref.status_name}: {ref.result.error}")
        ref_ids = list(ref.result.token_ids)

        # DraftBlocks, with a reference goal through the same verifier meanwhile.
        during = reference()
        counts = {"sent": 0, "answered": 0, "named": 0, "internal": 0, "wrong": 0}
        examples: dict[str, str] = {}
        in_flight: list = []
        bar = tqdm(total=args.messages, desc="draft_block", unit="msg", file=sys.stderr)

        def settle(case, rid):
            v = verdicts.wait(rid, args.timeout)
            if v is None:
                failures.append(f"draft_block {case.category}: no verdict within {args.timeout} s ({rid[:40]})")
                return
            counts["answered"] += 1
            if v.error.startswith("internal error"):
                counts["internal"] += 1
                failures.append(f"draft_block {case.category}: {v.error}")
            elif _expect_ok(v.error, case.expect):
                counts["named"] += 1
                examples.setdefault(case.category, v.error[:100])
            else:
                counts["wrong"] += 1
                failures.append(f"draft_block {case.category}: expected '{case.expect}', got '{v.error}'")

        for case in block_cases(rng, args.messages, vocab, hidden, prefix):
            msg = DraftBlock()
            _fill(msg, case.fields)
            pubs["draft_block"].publish(msg)
            counts["sent"] += 1
            in_flight.append((case, msg.request_id.split("\x00", 1)[0]))  # DDS strings end at a NUL
            if len(in_flight) >= args.window:
                settle(*in_flight.pop(0))
            bar.update(1)
        for item in in_flight:
            settle(*item)
        bar.close()
        rows.append({"input": "draft_block (verifier)", **counts, "examples": "; ".join(f"{k}: {v}" for k, v in examples.items())})
        mid = during.outcome(120.0)
        if mid.status_name != "succeeded" or list(mid.result.token_ids) != ref_ids:
            failures.append(f"reference goal during the DraftBlock fuzzing: {mid.status_name} {mid.result.error}, "
                            f"same answer: {list(mid.result.token_ids) == ref_ids}")

        # The other inputs: they must be ignored (paced: at most --rate a second).
        for kind, typ in types.items():
            sent = 0
            for fields in tqdm(noise_cases(rng, args.messages, kind), total=args.messages, desc=kind, unit="msg",
                               file=sys.stderr):
                msg = typ()
                _fill(msg, fields)
                pubs[kind].publish(msg)
                sent += 1
                time.sleep(1.0 / args.rate)
            rows.append({"input": f"{kind} (ignored)", "sent": sent, "answered": "", "named": "", "internal": "",
                         "wrong": "", "examples": ""})

        # Bad goals: aborted, the field named.
        g = {"sent": 0, "answered": 0, "named": 0, "internal": 0, "wrong": 0}
        for case in tqdm(list(goal_cases(rng, args.goals)), desc="goals", unit="goal", file=sys.stderr):
            g["sent"] += 1
            outcome = client.start(PROMPT, max_new_tokens=8, **case.fields).outcome(60.0)
            g["answered"] += 1
            err = outcome.result.error
            if err.startswith("internal error"):
                g["internal"] += 1
                failures.append(f"goal {case.category}: {err}")
            elif outcome.status_name == "aborted" and case.expect in err:
                g["named"] += 1
            else:
                g["wrong"] += 1
                failures.append(f"goal {case.category} {case.fields}: {outcome.status_name}, '{err}' "
                                f"(expected '{case.expect}')")
        rows.append({"input": "Generate goal (drafter)", **g, "examples": ""})

        after = reference().outcome(120.0)
        if after.status_name != "succeeded" or list(after.result.token_ids) != ref_ids:
            failures.append(f"reference goal after the fuzzing: {after.status_name} {after.result.error}")
        for label, pid in pids.items():
            rss1 = _rss_kb(pid)
            alive = procs[label].poll() is None and rss1 > 0
            if not alive:
                failures.append(f"{label} (pid {pid}) is gone")
            rows.append({"input": f"process {label}", "sent": "", "answered": "", "named": "", "internal": "",
                         "wrong": "", "examples": f"alive {alive}; RSS {rss0[label] / 1024:.0f} -> {rss1 / 1024:.0f} MiB"})
    return rows, failures


def main(argv: list[str] | None = None) -> int:
    from wisv_ros.sd.engines import BACKENDS

    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=1000, help="malformed messages per input topic (default %(default)s)")
    p.add_argument("--goals", type=int, default=60, help="bad Generate goals (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="case seed (default %(default)s)")
    p.add_argument("--window", type=int, default=8, help="DraftBlocks unanswered at a time at most (default %(default)s)")
    p.add_argument("--rate", type=float, default=500.0, help="messages a second on the ignored inputs (default %(default)s)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for one verdict (default %(default)s)")
    p.add_argument("--wait", type=float, default=300.0, help="seconds for the nodes to load their models (default %(default)s)")
    p.add_argument("--reference-tokens", type=int, default=32, help="tokens of the reference answer (default %(default)s)")
    p.add_argument("--target", default=TINY_TARGET, help="target model (default %(default)s)")
    p.add_argument("--drafter", default=TINY_DRAFTER, help="drafter model (default %(default)s)")
    p.add_argument("--target-backend", default="torch", choices=BACKENDS, help="engine of both models (default %(default)s)")
    p.add_argument("--out", default="runs/fuzz", help="folder for fuzz.csv, summary.md and the node logs")
    args = p.parse_args(argv)
    if min(args.messages, args.goals, args.window) < 1 or args.rate <= 0 or args.timeout <= 0:
        p.error("--messages, --goals and --window must be >= 1, --rate and --timeout > 0")
    t0 = time.monotonic()
    rows, failures = run(args)
    columns = ["input", "sent", "answered", "named", "internal", "wrong", "examples"]
    with open(Path(args.out) / "fuzz.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    lines = [f"`python -m wisv_ros.cli.fuzz --messages {args.messages} --goals {args.goals} --seed {args.seed}` "
             f"({time.monotonic() - t0:.0f} s; target {args.target}, drafter {args.drafter})", "",
             "| input | sent | answered | named error | internal error | wrong error | notes |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['input']} | {r['sent']} | {r['answered']} | {r['named']} | {r['internal']} | {r['wrong']} | "
              f"{r['examples']} |" for r in rows]
    lines += ["", f"{len(failures)} failed checks" + (":" if failures else "."), *[f"- {x}" for x in failures[:50]]]
    (Path(args.out) / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
