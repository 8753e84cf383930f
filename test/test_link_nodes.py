"""link_emulator_node + link_monitor_node as real processes over DDS on loopback.

Three graphs run side by side, each in its own namespace prefix (emulator, robot monitor, edge
echo): two fixed scenarios and one trace with an RTT step. The test process reads each
``<prefix>/robot/channel_state`` and compares the measured estimates with the emulated truth.
tools/test.sh sets a test-specific ROS_DOMAIN_ID. Truth vs measurement: the monitor measures the
whole path, so the middleware's own latency (a few ms for the four DDS hops of a ping round
trip) is included; the scenarios here have RTTs >= 50 ms so that 20 % covers it. Rates of
hundreds of Mbit/s and RTTs of 5 ms cannot be measured within 20 % over loopback DDS (the
middleware's own per-byte cost and latency dominate), so they are not asserted here; the pure
tests in test_link_estimator.py check them against the emulator without middleware.
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

rclpy = pytest.importorskip("rclpy")

from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rcl_interfaces.srv import SetParameters  # noqa: E402

from wisv_ros.link.channel import scenario  # noqa: E402
from wisv_ros.msg import ChannelState  # noqa: E402
from wisv_ros.nodes.link_monitor_node import STATE_QOS  # noqa: E402

DISCOVERY_TIMEOUT_S = 30.0  # nine Python processes start at once on a small machine
SETTLE_S = 8.0  # estimates in the first seconds after the first one are not judged: the
# monitor's RTT window (16 small pings, one every 0.4 s) fills in 6.4 s
JUDGE_S = 4.0  # ... then this long is judged
TOLERANCE = 0.20

STEP_BEFORE = dict(rate_bps=20e6, per=0.0, rtt_s=0.010)
STEP_AFTER = dict(rate_bps=20e6, per=0.0, rtt_s=0.060)
STEP_AT_S = 3.0  # trace time of the step
STEP_FOLLOW_BOUND_S = 3.0  # the estimate must cross the midpoint within this time

GRAPHS = {
    # prefix: (emulator parameters, truth (rate_bps, rtt_s))
    "s20": (["-p", "scenario:=20mbps_50ms"], (20e6, 0.050)),
    "s10": (
        ["-p", "scenario:=500mbps_50ms", "-p", "rate_bps:=10.0e6", "-p", "rtt_s:=0.1",
         "-p", "per:=0.005"],
        (10e6, 0.100),
    ),
    "step": (None, None),  # trace file, see the fixture
}


def _node_cmd(module: str, *ros_args: str) -> list[str]:
    return [sys.executable, "-m", f"wisv_ros.nodes.{module}", "--ros-args", *ros_args]


class _Graphs:
    """The processes, the reader node and the received estimates per prefix."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.received: dict[str, list[tuple[float, ChannelState]]] = {p: [] for p in GRAPHS}
        self.lock = threading.Lock()

    def start(self, name: str, cmd: list[str]) -> None:
        log = open(self.tmp / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def on_state(self, prefix: str, msg: ChannelState) -> None:
        with self.lock:
            self.received[prefix].append((time.monotonic(), msg))

    def states(self, prefix: str) -> list[tuple[float, ChannelState]]:
        with self.lock:
            return list(self.received[prefix])

    def wait_for(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        logs = "\n".join(f"--- {n}\n{self.log(n)[-2000:]}" for n in self.procs)
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}\n{logs}")


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("link_nodes")
    trace = tmp / "step.csv"
    trace.write_text(
        "t_s,rate_bps,per,rtt_s\n"
        f"0.0,{STEP_BEFORE['rate_bps']},{STEP_BEFORE['per']},{STEP_BEFORE['rtt_s']}\n"
        f"{STEP_AT_S},{STEP_AFTER['rate_bps']},{STEP_AFTER['per']},{STEP_AFTER['rtt_s']}\n"
    )
    g = _Graphs(tmp)
    for prefix, (params, _) in GRAPHS.items():
        if params is None:  # Trace time 0 far in the future: the first sample holds until
            # the test moves the origin (at run time) to put the step at a known time.
            params = ["-p", f"trace_file:={trace}",
                      "-p", f"trace_origin_unix_s:={time.time() + 3600.0}"]
        g.start(f"{prefix}_emulator", _node_cmd(
            "link_emulator_node", "-r", f"__ns:=/{prefix}", "-p", f"robot_namespace:=/{prefix}/robot",
            "-p", f"edge_namespace:=/{prefix}/edge", "-p", "seed:=1", *params))
        g.start(f"{prefix}_robot", _node_cmd("link_monitor_node", "-r", f"__ns:=/{prefix}/robot"))
        g.start(f"{prefix}_edge", _node_cmd(
            "link_monitor_node", "-r", f"__ns:=/{prefix}/edge", "-p", "role:=edge"))

    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node("link_nodes_test", context=context)
    for prefix in GRAPHS:
        node.create_subscription(ChannelState, f"/{prefix}/robot/channel_state",
                                 lambda msg, p=prefix: g.on_state(p, msg), STATE_QOS)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    g.node = node
    try:
        for prefix in GRAPHS:
            topic = f"/{prefix}/robot/channel_state"
            g.wait_for(lambda t=topic: node.count_publishers(t) >= 1, DISCOVERY_TIMEOUT_S,
                       f"a publisher on {topic}")
        yield g
    finally:
        for proc in g.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in g.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def _settled(g: _Graphs, prefix: str) -> list[ChannelState]:
    """Wait until JUDGE_S of estimates after SETTLE_S from the first one; return those."""

    def ready():
        states = g.states(prefix)
        if not states:
            return None
        t_first = states[0][0]
        if states[-1][0] < t_first + SETTLE_S + JUDGE_S:
            return None
        return [m for t, m in states if t >= t_first + SETTLE_S]

    return g.wait_for(ready, DISCOVERY_TIMEOUT_S + SETTLE_S + JUDGE_S, f"estimates on {prefix}")


@pytest.mark.parametrize("prefix", ["s20", "s10"])
def test_estimates_track_the_emulated_channel(graphs, prefix):
    rate_truth, rtt_truth = GRAPHS[prefix][1]
    judged = _settled(graphs, prefix)
    rtt = statistics.median(m.rtt_s for m in judged)
    rate = statistics.median(m.rate_bps for m in judged)
    print(f"{prefix}: rtt {rtt * 1e3:.1f} ms (truth {rtt_truth * 1e3:.0f}), rate {rate / 1e6:.2f} "
          f"Mbit/s (truth {rate_truth / 1e6:.0f}), per {judged[-1].per:.3f}")
    assert rtt == pytest.approx(rtt_truth, rel=TOLERANCE), f"rtt {rtt * 1e3:.1f} ms"
    assert rate == pytest.approx(rate_truth, rel=TOLERANCE), f"rate {rate / 1e6:.2f} Mbit/s"
    assert all(0.0 <= m.per < 1.0 for m in judged)
    # The monitor is the only source: the emulator never publishes its own settings.
    assert {m.source for m in judged} == {f"/{prefix}/robot/link_monitor"}
    assert graphs.node.count_publishers(f"/{prefix}/robot/channel_state") == 1
    samples = [m.samples for m in judged]
    assert samples == sorted(samples) and samples[-1] > samples[0]


def test_scenario_20mbps_50ms_is_what_link_py_says():
    truth = scenario("20mbps_50ms")
    assert (truth.rate_bps, truth.rtt_s) == GRAPHS["s20"][1]


def test_rtt_step_in_a_trace_is_followed(graphs):
    before = _settled(graphs, "step")
    midpoint = (STEP_BEFORE["rtt_s"] + STEP_AFTER["rtt_s"]) / 2
    # The median: on a loaded host a stall of a second can lift single estimates.
    assert statistics.median(m.rtt_s for m in before) < midpoint

    # Put trace time STEP_AT_S half a second from now.
    # The plain parameter service (AsyncParameterClient is not in Humble).
    client = graphs.node.create_client(SetParameters, "/step/link_emulator/set_parameters")
    assert client.wait_for_service(timeout_sec=10.0)
    origin_unix = time.time() + 0.5 - STEP_AT_S
    step_mono = time.monotonic() + 0.5
    request = SetParameters.Request(
        parameters=[Parameter("trace_origin_unix_s", value=origin_unix).to_parameter_msg()]
    )
    future = client.call_async(request)
    response = graphs.wait_for(lambda: future.done() and future.result(), 10.0, "set_parameters")
    assert [r.successful for r in response.results] == [True]

    def crossed():
        return next((t for t, m in graphs.states("step") if t > step_mono and m.rtt_s > midpoint),
                    None)

    t_cross = graphs.wait_for(crossed, STEP_FOLLOW_BOUND_S + 2.0, "the RTT estimate to cross")
    print(f"step: crossed {(t_cross - step_mono):.2f} s after the step")
    assert t_cross - step_mono < STEP_FOLLOW_BOUND_S
    # And it settles near the new value (plus the middleware's few ms).
    late = graphs.wait_for(
        lambda: [m for t, m in graphs.states("step") if t > t_cross + 2.0], 10.0, "later estimates")
    print(f"step: rtt {before[-1].rtt_s * 1e3:.1f} ms before, {late[-1].rtt_s * 1e3:.1f} ms after")
    assert late[-1].rtt_s == pytest.approx(STEP_AFTER["rtt_s"], rel=TOLERANCE)


def test_emulator_console_script_rejects_a_bad_parameter_naming_it():
    # The console script registered in setup.py (installed next to the venv's python).
    script = shutil.which("link_emulator_node") or str(
        Path(sys.executable).with_name("link_emulator_node")
    )
    assert Path(script).is_file(), "console script link_emulator_node is not installed"
    proc = subprocess.run(
        [script, "--ros-args", "-p", "scenario:=5g_magic"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "scenario" in proc.stderr and "20mbps_50ms" in proc.stderr


def test_nodes_exit_cleanly_on_sigint(graphs):
    """Every node exits within 15 s: cleanly (0), or, where Fast DDS deadlocked destroying the
    participant (nine processes leave at once here), through run_node's teardown watchdog, which
    says so with the stacks (code 1). A traceback or a hang fails."""
    for proc in graphs.procs.values():
        assert proc.poll() is None, "a node died early"
        proc.send_signal(signal.SIGINT)
    codes = {name: proc.wait(timeout=15) for name, proc in graphs.procs.items()}
    for name, code in codes.items():
        log = graphs.log(name)
        assert "Traceback" not in log, log
        if code != 0:
            assert code == 1 and "Timeout (0:00:10)!" in log, log
    assert sum(code == 0 for code in codes.values()) >= len(codes) - 2, codes  # the deadlock is rare


_RUN_NODE_SCRIPT = """
import os, signal, sys, time
import rclpy
from rclpy.node import Node
from wisv_ros.msg import ChannelState
from wisv_ros.nodes.common import run_node

mode = sys.argv[1]


class Probe(Node):
    teardown_timeout_s = 1.0

    def __init__(self):
        super().__init__("run_node_probe")
        self.pub = self.create_publisher(ChannelState, "run_node_probe", 1)
        self.create_timer(0.2, self.tick)

    def tick(self):
        if mode == "error":
            raise RuntimeError("a callback failed while the node runs")
        try:  # a Ctrl-C: rclpy shuts the context down; Python's own handler raises here, in the
            os.kill(os.getpid(), signal.SIGINT)  # callback (a node's signal mostly comes in the wait)
            time.sleep(1.0)
        except KeyboardInterrupt:
            pass
        deadline = time.monotonic() + 5.0
        while rclpy.ok() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not rclpy.ok(), "SIGINT did not shut the context down"
        if mode == "late":
            self.pub.publish(ChannelState())  # a callback still queued publishes after the signal

    def destroy_node(self):
        if mode == "stuck":
            time.sleep(600)  # a teardown that never ends
        super().destroy_node()


if mode == "exit":  # the process's own exit hangs after a clean teardown
    import atexit
    atexit.register(time.sleep, 600)
run_node(Probe)
print("run_node returned", flush=True)
"""


@pytest.mark.parametrize("mode", ["late", "error", "stuck", "exit"])
def test_run_node_ends_on_a_late_publish_propagates_errors_and_bounds_the_teardown(mode):
    """late: a callback publishing after SIGINT shut the context down ends the spin like the
    signal (exit 0; rclpy raises 'publisher's context is invalid' there, which used to exit 1 with a
    traceback). error: an error while the node runs still propagates. stuck: a teardown longer
    than teardown_timeout_s ends the process with code 1 and every thread's stack. exit: so does a
    hang in the interpreter's exit after run_node returned (the watchdog stays armed)."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _RUN_NODE_SCRIPT, mode], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    if mode == "late":
        assert proc.returncode == 0 and "run_node returned" in out and "Traceback" not in out, out
    elif mode == "error":
        assert proc.returncode == 1 and "a callback failed while the node runs" in out, out
        assert "run_node returned" not in out and "Timeout" not in out, out
    elif mode == "stuck":
        assert proc.returncode == 1 and "Timeout (0:00:01)!" in out and "in destroy_node" in out, out
        assert "run_node returned" not in out and time.monotonic() - started < 30, out
    else:
        assert proc.returncode == 1 and "run_node returned" in out and "Timeout (0:00:01)!" in out, out
        assert time.monotonic() - started < 30, out


def test_topic_specs_parse_and_bad_ones_are_rejected():
    from wisv_ros.nodes.link_emulator_node import DEFAULT_DOWNLINK_TOPICS, parse_topic_spec

    name, msg_type = parse_topic_spec("link_ping:wisv_ros/msg/LinkPing")
    assert name == "link_ping" and msg_type.__name__ == "LinkPing"
    assert [parse_topic_spec(s)[0] for s in DEFAULT_DOWNLINK_TOPICS] == [
        "verdict", "hidden_request", "link_ping_echo"]
    for bad in ["link_ping", "/abs:wisv_ros/msg/LinkPing", "x:wisv_ros/LinkPing",
                "x:wisv_ros/msg/NoSuchType"]:
        with pytest.raises(ValueError, match="topic spec"):
            parse_topic_spec(bad)
