"""Start a wisv_ros graph without ROS 2 launch: one process per node, logs prefixed, clean stop.

    python -m wisv_ros.cli.launch system                                # robot + edge + emulated link
    python -m wisv_ros.cli.launch system scenario:=500mbps_5ms --set drafter.k:=4
    python -m wisv_ros.cli.launch edge target_model:=gemma3-270m
    python -m wisv_ros.cli.launch system --dry-run                      # print the command lines

The nodes, parameter files and launch arguments (``name:=value``, as for ``ros2 launch``) come
from :mod:`wisv_ros.graph.description`, the description ``launch/*.launch.py`` read too. Each node runs as
``python -m wisv_ros.nodes.<executable> --ros-args -r __node:=... -r __ns:=... --params-file ...
-p ...``; ``--set <node>.<param>:=<value>`` adds ``-p <param>:=<value>`` to one node (``<node>``
is a key -- drafter, verifier, monitor_robot, monitor_edge, emulator -- or a full name such as
/robot/link_monitor; the value is YAML as on a ROS command line).

Every output line of a node is printed with its name in front. Ctrl-C or SIGTERM: SIGINT to
every node, SIGTERM after ``--grace`` seconds, SIGKILL after as long again; a node whose
launcher dies gets SIGTERM from the kernel (PR_SET_PDEATHSIG), so no node outlives it. A node
that exits on its own is reported with its exit code; with ``--shutdown-on-exit`` the others are
then stopped too. The launcher's exit status is 0 when every node ended cleanly, else 1.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from wisv_ros.graph import description as graph

__all__ = ["Launcher", "build_commands", "main", "parse_sets"]

PDEATHSIG = 1  # prctl option PR_SET_PDEATHSIG


def parse_sets(configuration: str, sets: list[str], robots: int = 2) -> dict[str, list[tuple[str, str]]]:
    """``["drafter.k:=4", ...]`` -> ``{node key: [(param, raw value), ...]}``. In the fleet a role
    (``drafter``, ``emulator`` ...) sets that parameter on every robot's node of the role;
    ``drafter2`` or ``/robot2/drafter_node`` on one.

    Raises:
        ValueError: malformed item or unknown node; the message lists the valid node names.
    """
    specs = graph.node_specs(configuration, robots=robots)
    by_name: dict[str, list] = {}
    for s in specs:
        for alias in {s.key, s.name, s.full_name}:
            by_name.setdefault(alias, []).append(s)
    roles = {}
    for s in specs:
        if s.role:
            roles.setdefault(s.role, []).append(s)
    out: dict[str, list[tuple[str, str]]] = {}
    for item in sets:
        target, sep, value = item.partition(":=")
        node, dot, param = target.rpartition(".")
        if not sep or not dot or not node or not param:
            raise ValueError(f"--set {item!r}: expected <node>.<param>:=<value>, e.g. drafter.k:=4")
        matches = roles.get(node) or by_name.get(node, [])
        if len(matches) != 1 and node not in roles:
            valid = ", ".join(sorted({s.key for s in specs} | {s.full_name for s in specs} | set(roles)))
            why = "is ambiguous" if matches else f"is not a node of configuration {configuration!r}"
            raise ValueError(f"--set {item!r}: {node!r} {why}; use one of {valid}")
        for m in matches:
            out.setdefault(m.key, []).append((param, value))
    return out


def build_commands(configuration: str, arguments: dict[str, str] | None = None,
                   sets: list[str] = (), python: str = sys.executable) -> list[tuple[graph.ResolvedNode, list[str]]]:
    """Each node of ``configuration`` with its command line (launch arguments, then ``--set``)."""
    nodes = graph.resolve(configuration, arguments)
    robots = sum(1 for n in nodes if n.spec.role == "drafter") or 2
    extra = parse_sets(configuration, list(sets), robots=robots)
    return [(node, graph.command(node, python, extra.get(node.spec.key, []))) for node in nodes]


@contextmanager
def running_graph(commands: list[tuple[graph.ResolvedNode, list[str]]], log_path: Path, name: str, wait_s: float):
    """The node processes of ``commands`` (output to ``log_path``) and, in this process, an rclpy
    context with a node ``<name>_<pid>`` spun in the background; waits until drafter_node and
    verifier_node are active. Yields (launcher, node, check): ``check(what)`` raises RuntimeError
    when a node exited or ``wait_s`` passed (for the caller's own waits). Everything stops on exit."""
    import rclpy

    from wisv_ros.nodes.client import spin_in_background, wait_until_active

    log = open(log_path, "w")
    launcher = Launcher(commands, out=log)
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node(f"{name}_{os.getpid()}", context=context)
    executor, spin_thread = spin_in_background(node)
    deadline = time.monotonic() + wait_s

    def check(what: str) -> None:
        ended = launcher.poll(set())
        if ended or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {'node(s) exited ' + str(ended) if ended else 'timed out'}; see {log_path}")
        time.sleep(0.2)

    try:
        launcher.start()
        labels = [label for label, _ in launcher.procs]
        names = [f"/{label}" for label in labels if label.endswith(("drafter_node", "verifier_node"))]
        wait_until_active(node, names, check)
        yield launcher, node, check
    finally:
        launcher.stop(grace=5.0)
        executor.shutdown()
        spin_thread.join(10.0)  # a thread still in rclpy at interpreter exit aborts the process
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        log.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Launcher:
    """The child processes of one graph."""

    def __init__(self, commands: list[tuple[graph.ResolvedNode, list[str]]], out=sys.stdout):
        self.commands = commands
        self.out = out
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []

    def say(self, label: str, text: str) -> None:
        with self._lock:
            self.out.write(f"[{label}] {text}\n")
            self.out.flush()

    def _forward(self, label: str, stream) -> None:
        for raw in iter(stream.readline, b""):
            self.say(label, raw.decode(errors="replace").rstrip("\n"))
        stream.close()

    def start(self) -> None:
        for node, cmd in self.commands:
            self._spawn(node.spec.full_name.lstrip("/"), cmd)

    def _spawn(self, label: str, cmd: list[str]) -> subprocess.Popen:
        node = next((n for n, c in self.commands if n.spec.full_name.lstrip("/") == label), None)
        env = dict(os.environ, PYTHONUNBUFFERED="1", RCUTILS_LOGGING_BUFFERED_STREAM="1",
                   RCUTILS_COLORIZED_OUTPUT="0", **dict(node.env if node is not None else ()))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, preexec_fn=_die_with_parent)
        self.procs = [(lab, p) for lab, p in self.procs if lab != label] + [(label, proc)]
        self.say("launch", f"started {label} (pid {proc.pid}): {' '.join(cmd[1:4])} ...")
        t = threading.Thread(target=self._forward, args=(label, proc.stdout), daemon=True)
        t.start()
        self._readers.append(t)
        return proc

    def process(self, label: str) -> subprocess.Popen:
        """The running process of ``label`` (e.g. ``edge/verifier_node``); KeyError naming the labels."""
        found = dict(self.procs)
        if label not in found:
            raise KeyError(f"no node '{label}' in this graph; it has {', '.join(found)}")
        return found[label]

    def restart(self, label: str) -> subprocess.Popen:
        """Kill ``label`` with SIGKILL (a crash, no clean-up) and start it again with the same command."""
        old = self.process(label)
        old.kill()
        old.wait(10)
        cmd = next(cmd for node, cmd in self.commands if node.spec.full_name.lstrip("/") == label)
        return self._spawn(label, cmd)

    def poll(self, reported: set[int]) -> list[tuple[str, int]]:
        """Children that exited since the last call: (label, exit code)."""
        ended = []
        for label, proc in self.procs:
            if proc.pid not in reported and proc.poll() is not None:
                reported.add(proc.pid)
                ended.append((label, proc.returncode))
        return ended

    def stop(self, grace: float) -> None:
        """SIGINT to every running child, then SIGTERM, then SIGKILL (to its process group)."""
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            running = [(label, p) for label, p in self.procs if p.poll() is None]
            if not running:
                break
            if sig != signal.SIGINT:
                self.say("launch", f"{sig.name} to {', '.join(label for label, _ in running)}")
            for _label, p in running:
                try:
                    os.killpg(p.pid, sig) if sig == signal.SIGKILL else p.send_signal(sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            for _label, p in running:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for t in self._readers:
            t.join(timeout=2.0)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.launch", description=__doc__.split("\n\n")[0],
                                epilog="Launch arguments of a configuration: --show-args.")
    p.add_argument("configuration", choices=graph.CONFIGURATIONS)
    p.add_argument("arguments", nargs="*", metavar="name:=value", help="launch arguments, as for ros2 launch")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NODE.PARAM:=VALUE",
                   help="one more parameter for one node (repeatable)")
    p.add_argument("--show-args", action="store_true", help="list the launch arguments and exit")
    p.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGINT, SIGTERM and SIGKILL on stop (default %(default)s)")
    p.add_argument("--shutdown-on-exit", action="store_true", help="stop the whole graph when one node exits")
    args = p.parse_intermixed_args(argv)

    if args.show_args:
        for a in graph.launch_arguments(args.configuration):
            print(f"{a.name}:\n    {a.description}\n    (default: {a.default!r})")
        return 0
    values = {}
    for item in args.arguments:
        name, sep, value = item.partition(":=")
        if not sep or not name:
            p.error(f"launch argument {item!r}: expected name:=value (see --show-args)")
        values[name] = value
    if args.grace <= 0:
        p.error(f"--grace must be > 0 (got {args.grace})")
    try:
        commands = build_commands(args.configuration, values, args.sets)
    except ValueError as exc:
        p.error(str(exc))
    if args.dry_run:
        import shlex

        for _node, cmd in commands:
            print(shlex.join(cmd))
        return 0

    launcher = Launcher(commands)
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, _frame):
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    failed = False
    reported: set[int] = set()
    try:
        launcher.start()
        while not stop.is_set():
            for label, code in launcher.poll(reported):
                failed = failed or code != 0
                launcher.say("launch", f"{label} died: {_describe_exit(code)}" if code != 0
                             else f"{label} exited")
                if args.shutdown_on_exit:
                    launcher.say("launch", "stopping the graph (--shutdown-on-exit)")
                    stop.set()
            if len(reported) == len(launcher.procs):
                launcher.say("launch", "all nodes have exited")
                break
            stop.wait(0.2)
    finally:
        if received:
            launcher.say("launch", f"{received[0]}: stopping {len(launcher.procs)} nodes")
        launcher.stop(args.grace)
    for label, proc in launcher.procs:
        if proc.pid not in reported:
            code = proc.returncode
            # SIGINT/SIGTERM that we sent count as a clean stop.
            clean = code in (0, -signal.SIGINT, -signal.SIGTERM)
            failed = failed or not clean
            launcher.say("launch", f"{label}: {_describe_exit(code)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
