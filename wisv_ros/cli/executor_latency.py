"""Round-trip latency of a topic ping-pong between two processes, per rclpy executor.

    python -m wisv_ros.cli.executor_latency [--rounds 300] [--csv runs/executor_latency.csv]

Why the nodes spin a SingleThreadedExecutor (``wisv_ros.nodes.common.run_node``): one round of
speculative decoding is a block out and a verdict back, so the middleware's round trip is paid
every round. This measures it: a client process publishes ``ping`` and waits (in its own thread,
on a condition variable, as drafter_node does) for the server process's ``pong``; both spin the
executor under test. Prints a table (median, p90, p99, max in ms, rounds over 100 ms, rounds with
no answer within ``--timeout``) and writes CSV.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

EXECUTORS = ("single", "multi")


def _make_executor(kind: str, context=None):
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor

    if kind == "single":
        return SingleThreadedExecutor(context=context)
    return MultiThreadedExecutor(num_threads=4, context=context)


def _qos():
    from wisv_ros.nodes.common import RELIABLE_QOS

    return RELIABLE_QOS


def serve(kind: str, topic_prefix: str) -> None:
    """The server process: echoes ``ping`` on ``pong`` until killed."""
    import rclpy
    from std_msgs.msg import String

    rclpy.init()
    node = rclpy.create_node(f"latency_server_{os.getpid()}")
    pub = node.create_publisher(String, f"{topic_prefix}/pong", _qos())
    node.create_subscription(String, f"{topic_prefix}/ping", pub.publish, _qos())
    executor = _make_executor(kind)
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, Exception):  # noqa: BLE001 - killed by the client process
        pass


def measure(server_kind: str, client_kind: str, rounds: int, timeout: float) -> list[float]:
    """Round-trip times in seconds (``timeout`` for a round without an answer)."""
    import rclpy
    from std_msgs.msg import String

    prefix = f"/wisv_latency_{os.getpid()}_{server_kind}_{client_kind}"
    server = subprocess.Popen([sys.executable, "-m", "wisv_ros.cli.executor_latency", "--serve", server_kind,
                               "--prefix", prefix], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node(f"latency_client_{os.getpid()}", context=context)
    cv, got = threading.Condition(), set()

    def on_pong(msg):
        with cv:
            got.add(msg.data)
            cv.notify_all()

    pub = node.create_publisher(String, f"{prefix}/ping", _qos())
    node.create_subscription(String, f"{prefix}/pong", on_pong, _qos())
    executor = _make_executor(client_kind, context)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    times: list[float] = []
    try:
        deadline = time.monotonic() + 60
        while pub.get_subscription_count() == 0 or node.count_publishers(f"{prefix}/pong") == 0:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server process did not come up (is ROS 2 set up? source tools/env.sh)")
            time.sleep(0.05)
        for i in range(-20, rounds):  # 20 warm-up rounds
            t0 = time.perf_counter()
            pub.publish(String(data=str(i)))
            with cv:
                ok = cv.wait_for(lambda: str(i) in got, timeout)
            if i >= 0:
                times.append(time.perf_counter() - t0 if ok else timeout)
    finally:
        server.kill()
        server.wait()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    return times


def summarize(times: list[float], timeout: float) -> dict:
    ms = sorted(t * 1e3 for t in times)
    q = lambda p: ms[min(len(ms) - 1, int(p * len(ms)))]  # noqa: E731
    return {"median_ms": statistics.median(ms), "p90_ms": q(0.90), "p99_ms": q(0.99), "max_ms": ms[-1],
            "over_100ms": sum(t > 100 for t in ms), "lost": sum(t >= timeout * 1e3 for t in ms)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.executor_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=300, help="ping-pongs per configuration (default 300)")
    p.add_argument("--timeout", type=float, default=3.0, help="a round without an answer after this many s counts as lost")
    p.add_argument("--pairs", default="single/single,multi/multi,multi/single,single/multi",
                   help="server/client executor pairs (single or multi), comma-separated")
    p.add_argument("--csv", type=Path, default=Path("runs/executor_latency.csv"), help="CSV output ('' = none)")
    p.add_argument("--serve", choices=EXECUTORS, help=argparse.SUPPRESS)
    p.add_argument("--prefix", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.prefix)
        return 0
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1 (got {args.rounds})")
    pairs = []
    for item in args.pairs.split(","):
        parts = item.strip().split("/")
        if len(parts) != 2 or any(x not in EXECUTORS for x in parts):
            p.error(f"--pairs: '{item}' is not server/client with each one of {', '.join(EXECUTORS)}")
        pairs.append(tuple(parts))
    rows = []
    for server_kind, client_kind in pairs:
        stats = summarize(measure(server_kind, client_kind, args.rounds, args.timeout), args.timeout)
        rows.append({"server": server_kind, "client": client_kind, "rounds": args.rounds, **stats})
        print(f"server {server_kind:6s} client {client_kind:6s} median {stats['median_ms']:8.2f} ms  p90 {stats['p90_ms']:8.1f}  "
              f"p99 {stats['p99_ms']:8.1f}  max {stats['max_ms']:8.1f}  >100ms {stats['over_100ms']:4d}  lost {stats['lost']:4d}",
              flush=True)
    if str(args.csv):
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
