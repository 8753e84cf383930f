"""Send one prompt to a running drafter_node (Generate action), stream the text, print the stats.

    python -m wisv_ros.cli.launch system &                 # or: ros2 launch wisv_ros system.launch.py
    python -m wisv_ros.cli.ask --prompt "Explain wheel odometry drift in two sentences."
    python -m wisv_ros.cli.ask --action /robot/generate --max-new-tokens 64 --k 6

Before the goal it waits (at most ``--wait`` seconds) until both models are loaded: the drafter
(``<ns>/drafter_node``) and the verifier (``--verifier``) are lifecycle nodes, active once their
models are loaded (``finalized`` if that failed); their ``get_state`` services say which. Then the committed text is printed as feedback arrives, and a table with
the result's tokens, rounds, AAL, latency, tokens/s and uplink/downlink bytes, plus the channel
the robot's link monitor measured (``<ns>/channel_state``) at the end, and a warning when the
drafter committed rounds alone (the edge was lost: that text is not verified).

Exit status: 0 done, 1 the goal was aborted or a model failed to load, 2 timeout (or the
``--launcher-pid`` process ended while waiting), 130 Ctrl-C (a running goal is canceled first).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

__all__ = ["main"]

DEFAULT_PROMPT = ("Write a Python function clamp_velocity(vx, vy, v_max) that scales a planar robot "
                  "velocity so that its norm is at most v_max, keeping the direction.")
COLUMNS = ["tokens", "rounds", "aal", "latency_s", "tokens_per_s", "uplink_bytes", "downlink_bytes"]
OPTIONAL_FIELDS = ("draft_time_s", "round_trip_s", "edge_time_s")
CHANNEL_WAIT_S = 3.0  # how long to wait after the answer for a channel_state not yet received


class _Waiter:
    """Deadline shared by the waits; fails early when the launcher process is gone."""

    def __init__(self, seconds: float, launcher_pid: int | None):
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.launcher_pid = launcher_pid
        self.t0 = time.monotonic()
        self._last_note = 0.0

    def check(self, what: str) -> None:
        if self.launcher_pid is not None:
            try:
                os.kill(self.launcher_pid, 0)
            except ProcessLookupError:
                raise TimeoutError(f"{what}: the launcher (pid {self.launcher_pid}) has exited; see its log") from None
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"{what}: gave up after {self.seconds:.0f} s (--wait)")

    def note(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last_note >= 10.0:
            self._last_note = now
            print(f"[ask] {text} ({now - self.t0:.0f} s)", file=sys.stderr, flush=True)


def _start_goal(client, prompt: str, goal: dict, waiter: _Waiter):
    """Send the goal, again while the drafter rejects goals (its model is loading)."""
    while not client.wait_for_server(1.0):
        waiter.check("no generate action server")
        waiter.note("waiting for the generate action server")
    while True:
        try:
            return client.start(prompt, **goal)
        except (RuntimeError, TimeoutError):  # rejected (model loading or failed: its log says), or no answer yet
            waiter.check("drafter_node kept rejecting the goal (model loading or failed: see its log)")
            waiter.note("waiting for the drafter to load its model")
            time.sleep(1.0)


def _stream(run, timeout: float):
    """Print text deltas as feedback arrives; return the outcome."""
    printed = 0
    deadline = time.monotonic() + timeout

    def flush(feedback):
        nonlocal printed
        for fb in feedback[printed:]:
            sys.stdout.write(fb.text_delta)
        printed = len(feedback)
        sys.stdout.flush()

    while True:
        try:
            outcome = run.outcome(timeout=0.1)
        except TimeoutError:
            flush(list(run.feedback))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result within {timeout:.0f} s (--timeout)") from None
            continue
        flush(outcome.feedback)
        sys.stdout.write("\n")
        return outcome


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.ask", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: a robot coding question)")
    p.add_argument("--action", default="/robot/generate", help="Generate action of drafter_node (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0 = the drafter_node's max_new_tokens")
    p.add_argument("--method", default="", help="greedy, reject or wisv ('' = the node's default)")
    p.add_argument("--k", type=int, default=0, help="draft block size (0 = the node's default)")
    p.add_argument("--protocol", default="", help="ids, fh, sh or adaptive ('' = the node's default)")
    p.add_argument("--tau", type=float, default=-1.0, help="WISV threshold (< 0 = the node's default)")
    p.add_argument("--placement", default="", help="auto, split, edge or robot ('' = the node's default)")
    p.add_argument("--wait", type=float, default=900.0, help="seconds to wait for the models to load (default %(default)s)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the result (default %(default)s)")
    p.add_argument("--verifier", default="/edge/verifier_node", help="the verifier's node name (default %(default)s)")
    p.add_argument("--no-ready-check", action="store_true", help="send the goal without waiting for both nodes to be active")
    p.add_argument("--launcher-pid", type=int, default=None, help="stop waiting when this process (the launcher) exits")
    args = p.parse_args(argv)
    if args.max_new_tokens < 0 or args.k < 0:
        p.error("--max-new-tokens and --k must be >= 0")
    if not args.action.startswith("/") or args.action.endswith("/"):
        p.error(f"--action {args.action!r}: give the absolute action name, e.g. /robot/generate")
    ns = args.action.rsplit("/", 1)[0] or "/"

    import rclpy
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from rclpy.signals import SignalHandlerOptions

    from wisv_ros.sd.metrics import format_table
    from wisv_ros.msg import ChannelState
    from wisv_ros.nodes.client import GenerateClient, spin_in_background, wait_until_active

    # No rclpy signal handler: Ctrl-C raises KeyboardInterrupt here while the context stays up,
    # so that the running goal can still be canceled.
    rclpy.init(args=None, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node(f"wisv_ask_{os.getpid()}")
    executor, spin_thread = spin_in_background(node)
    channel: list = []
    state_qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    node.create_subscription(ChannelState, f"{ns.rstrip('/')}/channel_state", channel.append, state_qos)
    waiter = _Waiter(args.wait, args.launcher_pid)
    client = GenerateClient(node, args.action)
    try:
        if not args.no_ready_check:
            wait_until_active(node, [f"{ns.rstrip('/')}/drafter_node", args.verifier], waiter.check, waiter.note)
        goal = {"max_new_tokens": args.max_new_tokens, "method": args.method, "k": args.k,
                "protocol": args.protocol, "tau": args.tau, "placement": args.placement}
        run = _start_goal(client, args.prompt, goal, waiter)
        print(f"[ask] models ready after {time.monotonic() - waiter.t0:.0f} s; prompt: {args.prompt!r}",
              file=sys.stderr, flush=True)
        try:
            outcome = _stream(run, args.timeout)
        except KeyboardInterrupt:
            print("\n[ask] interrupted: canceling the goal", file=sys.stderr)
            try:
                run.cancel(timeout=5.0)
            except TimeoutError:
                pass
            raise
        # A short answer can finish before discovery delivers the monitor's latched channel_state;
        # give it a moment so that the report says which channel the answer ran on.
        deadline = time.monotonic() + CHANNEL_WAIT_S
        while not channel and time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("[ask] interrupted", file=sys.stderr)
        return 130
    except TimeoutError as exc:
        print(f"[ask] error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"[ask] error: {exc}", file=sys.stderr)
        return 1
    finally:
        executor.shutdown()
        spin_thread.join(timeout=5.0)
        client.client.destroy()
        node.destroy_node()
        rclpy.try_shutdown()
    r = outcome.result
    row = {"tokens": len(r.token_ids), "rounds": r.rounds, "aal": round(r.aal, 2), "latency_s": round(r.latency_s, 2),
           "tokens_per_s": round(r.tokens_per_s, 2), "uplink_bytes": r.uplink_bytes, "downlink_bytes": r.downlink_bytes}
    columns = list(COLUMNS)
    for field in OPTIONAL_FIELDS:  # result fields of newer interface versions, shown when present
        if hasattr(r, field):
            row[field] = round(float(getattr(r, field)), 2)
            columns.append(field)
    print(format_table([row], columns))
    if channel:
        c = channel[-1]
        print(f"channel measured by the link monitor: rate {c.rate_bps / 1e6:.1f} Mbit/s, PER {c.per:.3f}, "
              f"RTT {c.rtt_s * 1e3:.1f} ms")
    if getattr(r, "placement_reason", ""):
        print(f"placement: {r.placement_reason}; rounds split {r.rounds - r.edge_rounds - r.robot_rounds - r.drafter_only_rounds}, "
              f"edge {r.edge_rounds}, robot {r.robot_rounds}")
    if getattr(r, "robot_rounds", 0):
        print(f"[ask] note: the drafter answered {r.robot_rounds} of {r.rounds} rounds alone by choice (placement robot, "
              "max_ms_per_token): that part of the text is not verified by the target", file=sys.stderr)
    alone = int(getattr(r, "drafter_only_rounds", 0))
    if alone:
        print(f"[ask] warning: the drafter committed {alone} of {r.rounds} rounds alone (the edge was lost): "
              "that part of the text is not verified by the target; the node log says why", file=sys.stderr)
    if outcome.status_name != "succeeded":
        print(f"[ask] goal {outcome.status_name}: {r.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
