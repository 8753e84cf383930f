"""Both launch routes read one description (wisv_ros/graph.py), and the pip route really runs.

- ``launch/*.launch.py`` are loaded with recording stand-ins for ``launch``, ``launch.actions``,
  ``launch.substitutions``, ``launch_ros.actions`` and ``launch_ros.parameter_descriptions``
  (put into ``sys.modules`` only inside the test; the real packages are not installable here),
  and their Node actions are compared with the command lines of ``python -m wisv_ros.cli.launch``.
- The parameter files, executables and link topics are checked against the nodes and packaging.
- ``python -m wisv_ros.cli.launch system`` with tiny models comes up, answers a Generate goal (and
  ``python -m wisv_ros.cli.ask``) with the target's own greedy output, relays the robot monitor's channel_state to the edge, reports a
  node that dies, and stops with no process left; a launcher killed with SIGKILL takes its nodes
  with it (PR_SET_PDEATHSIG).

The real ``ros2 launch`` is not run (no ROS 2 install here).
"""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest
import yaml

from wisv_ros.graph import description as graph
from wisv_ros.cli.launch import build_commands, parse_sets
from wisv_ros.sd.models import DEFAULT_DRAFTER, DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[1]
TARGET = "tiny-random:0:64"
DRAFTER = "tiny-random:0:64:0.05"
PROMPT_IDS = [5, 9, 12, 3]
START_TIMEOUT = 120.0  # five processes start at once on a busy 2-core machine


# --------------------------------------------------------------------------- launch stand-ins
class _Recorded:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _LaunchDescription(_Recorded):
    @property
    def entities(self):
        return self.args[0] if self.args else self.kwargs.get("initial_entities", [])


class _ParameterValue(_Recorded):
    @property
    def value(self):
        return self.args[0]


def _stand_ins() -> dict[str, types.ModuleType]:
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    def cls(name, base=_Recorded):
        return type(name, (base,), {})

    return {
        "launch": module("launch", LaunchDescription=_LaunchDescription),
        "launch.actions": module("launch.actions", DeclareLaunchArgument=cls("DeclareLaunchArgument"),
                                 OpaqueFunction=cls("OpaqueFunction")),
        "launch.substitutions": module("launch.substitutions", LaunchConfiguration=cls("LaunchConfiguration")),
        "launch_ros": module("launch_ros"),
        "launch_ros.actions": module("launch_ros.actions", Node=cls("Node")),
        "launch_ros.parameter_descriptions": module("launch_ros.parameter_descriptions",
                                                    ParameterValue=_ParameterValue),
    }


def load_launch_file(configuration: str, monkeypatch, arguments: dict[str, str] | None = None):
    """Run ``launch/<configuration>.launch.py`` against the stand-ins, as ``ros2 launch`` would:
    declared arguments take their defaults unless given, then the OpaqueFunction makes the nodes.
    Returns (declared arguments {name: (default, description)}, Node kwargs list)."""
    for name, mod in _stand_ins().items():
        monkeypatch.setitem(sys.modules, name, mod)
    path = ROOT / "launch" / f"{configuration}.launch.py"
    spec = importlib.util.spec_from_file_location(f"_launch_{configuration}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ld = mod.generate_launch_description()
    declared, opaque = {}, []
    for entity in ld.entities:
        kind = type(entity).__name__
        if kind == "DeclareLaunchArgument":
            declared[entity.args[0]] = (entity.kwargs["default_value"], entity.kwargs["description"])
        elif kind == "OpaqueFunction":
            opaque.append(entity.kwargs["function"])
        else:
            raise AssertionError(f"unexpected launch entity {kind}")
    configurations = {name: default for name, (default, _) in declared.items()}
    configurations.update(arguments or {})
    context = types.SimpleNamespace(launch_configurations=configurations)
    nodes = []
    for fn in opaque:
        for action in fn(context):
            assert type(action).__name__ == "Node"
            nodes.append(action.kwargs)
    return declared, nodes


# --------------------------------------------------------------------------- normal forms
def _from_launch(kw: dict) -> dict:
    params_file, overrides = kw["parameters"]
    return {
        "package": kw["package"], "executable": kw["executable"], "name": kw["name"], "namespace": kw["namespace"],
        "params_file": params_file,
        "parameters": {k: v.value if isinstance(v, _ParameterValue) else v for k, v in overrides.items()},
        "string_typed": {k for k, v in overrides.items() if isinstance(v, _ParameterValue) and v.kwargs.get("value_type") is str},
        "remappings": list(kw["remappings"]),
        **({"enclave": kw["ros_arguments"][1], "env": kw["additional_env"]} if "ros_arguments" in kw else {}),
    }


def _from_command(cmd: list[str]) -> dict:
    """Parse ``python -m wisv_ros.nodes.<exe> --ros-args ...`` back (``-p`` values read as YAML, as rcl does)."""
    assert cmd[1] == "-m" and cmd[3] == "--ros-args", cmd
    package, nodes, exe = cmd[2].split(".")
    assert nodes == "nodes"
    out = {"package": package, "executable": exe, "parameters": {}, "remappings": [], "string_typed": set()}
    it = iter(cmd[4:])
    for flag in it:
        value = next(it)
        if flag == "--params-file":
            out["params_file"] = value
        elif flag == "-p":
            name, _, raw = value.partition(":=")
            parsed = yaml.safe_load(raw)
            out["parameters"][name] = parsed
            if isinstance(parsed, str):
                out["string_typed"].add(name)
        elif flag == "-r":
            src, _, dst = value.partition(":=")
            if src == "__node":
                out["name"] = dst
            elif src == "__ns":
                out["namespace"] = dst
            else:
                out["remappings"].append((src, dst))
        elif flag == "--enclave":
            out["enclave"] = value
        else:
            raise AssertionError(f"unexpected flag {flag} in {cmd}")
    return out


ARGUMENT_CASES = {
    "robot": [{}, {"drafter_model": DRAFTER, "target_model": "on"}],
    "edge": [{}, {"target_model": TARGET, "robot_namespace": "/robot2"}],
    "system": [{}, {"scenario": "500mbps_5ms", "drafter_model": DRAFTER, "target_model": TARGET, "autostart": "false"}],
    "fleet": [{}, {"robots": "3", "scenarios": "20mbps_50ms,500mbps_5ms,20mbps_5ms", "target_model": TARGET}],
}


# --------------------------------------------------------------------------- one description
@pytest.mark.parametrize("configuration", graph.CONFIGURATIONS)
def test_launch_files_and_pip_launcher_start_the_same_nodes(configuration, monkeypatch):
    for arguments in ARGUMENT_CASES[configuration]:
        declared, launch_nodes = load_launch_file(configuration, monkeypatch, arguments)
        assert {n: d for n, (d, _) in declared.items()} == {a.name: a.default for a in graph.launch_arguments(configuration)}
        pip_nodes = [_from_command(cmd) for _node, cmd in build_commands(configuration, arguments, python="python")]
        assert [_from_launch(kw) for kw in launch_nodes] == pip_nodes, arguments
        names = [(n["namespace"], n["name"]) for n in pip_nodes]
        assert len(set(names)) == len(names)  # no two nodes with one name


def test_configurations_hold_the_documented_nodes(monkeypatch):
    def summary(configuration):
        return sorted((kw["namespace"], kw["executable"], kw["name"]) for kw in load_launch_file(configuration, monkeypatch)[1])

    robot = [("/robot", "drafter_node", "drafter_node"), ("/robot", "link_monitor_node", "link_monitor")]
    edge = [("/edge", "link_monitor_node", "link_monitor"), ("/edge", "verifier_node", "verifier_node")]
    assert summary("robot") == robot
    assert summary("edge") == edge
    assert summary("system") == sorted(robot + edge + [("/", "link_emulator_node", "link_emulator")])
    # With defaults the launch files leave the model names to the parameter files ...
    assert all(not kw["parameters"][1] for kw in load_launch_file("system", monkeypatch)[1])
    # ... and the lone edge meets the robot's topics directly; in `system` the emulator relays them.
    edge_remaps = {kw["name"]: dict(kw["remappings"]) for kw in load_launch_file("edge", monkeypatch)[1]}
    assert edge_remaps["verifier_node"]["draft_block"] == "/robot/draft_block"
    assert edge_remaps["link_monitor"]["link_ping_echo"] == "/robot/link_ping_echo"
    assert all(not kw["remappings"] for kw in load_launch_file("system", monkeypatch)[1])


def test_parameter_files_hold_the_demo_defaults():
    files = {s.params_file for c in graph.CONFIGURATIONS for s in graph.node_specs(c)}
    # Every node parameter file in config/ is used by a configuration (the hardware profiles are no
    # parameter file: they hold no ros__parameters).
    assert files == {p.name for p in (ROOT / "config").glob("*.yaml") if "ros__parameters" in p.read_text()}
    assert "ros__parameters" not in (ROOT / "config" / "hardware_profiles.yaml").read_text()
    params = {}
    for f in files:
        data = yaml.safe_load((ROOT / "config" / f).read_text())
        assert len(data) == 1, f
        (key, body), = data.items()
        params[f] = body["ros__parameters"]
        spec = next(s for c in graph.CONFIGURATIONS for s in graph.node_specs(c) if s.params_file == f)
        assert key == f"/**/{spec.name}", f  # matches the node in any namespace
    assert params["drafter.yaml"]["drafter_model"] == DEFAULT_DRAFTER
    assert params["drafter.yaml"]["target_tokenizer_model"] == ""  # the default pair shares one tokenizer
    assert params["drafter.yaml"]["backend"] == params["verifier.yaml"]["backend"] == "auto"
    assert params["verifier.yaml"]["target_model"] == DEFAULT_TARGET
    assert params["drafter.yaml"]["threads"] == 1 and params["verifier.yaml"]["threads"] == 1
    assert params["link_emulator.yaml"]["scenario"] == "20mbps_50ms"
    assert params["verifier.yaml"]["default_channel"] == "20mbps_50ms"
    assert params["link_monitor_robot.yaml"]["role"] == "robot" and params["link_monitor_edge.yaml"]["role"] == "edge"
    assert params["link_monitor_robot.yaml"]["ping_qos"] == params["link_monitor_edge.yaml"]["ping_qos"]
    for f in files:  # every parameter has a comment
        for line in (ROOT / "config" / f).read_text().splitlines():
            if re.match(r"^\s{4}\w+:", line):
                assert "#" in line, f"{f}: parameter without a comment: {line.strip()}"


def test_link_topics_are_the_emulators_and_cover_the_nodes():
    pytest.importorskip("rclpy")
    from wisv_ros.nodes import link_emulator_node as emu

    assert tuple(s.split(":")[0] for s in emu.DEFAULT_UPLINK_TOPICS) == graph.UPLINK_TOPICS
    assert tuple(s.split(":")[0] for s in emu.DEFAULT_DOWNLINK_TOPICS) == graph.DOWNLINK_TOPICS
    link = set(graph.UPLINK_TOPICS) | set(graph.DOWNLINK_TOPICS)
    for spec in graph.node_specs("system"):
        assert set(spec.link_topics) <= link, spec.key
    robot = {t for s in graph.node_specs("robot") for t in s.link_topics}
    edge = {t for s in graph.node_specs("edge") for t in s.link_topics}
    assert link == robot and link - {"channel_state"} <= edge and "channel_state" in edge
    # The pings are best-effort in the monitors' parameter files and in the emulator.
    assert set(emu.DEFAULT_BEST_EFFORT_TOPICS) == {"link_ping", "link_ping_echo"}
    emu_params = yaml.safe_load((ROOT / "config" / "link_emulator.yaml").read_text())["/**/link_emulator"]["ros__parameters"]
    assert (emu_params["robot_namespace"], emu_params["edge_namespace"]) == (graph.ROBOT_NS, graph.EDGE_NS)


def test_executables_are_packaged():
    setup_py = (ROOT / "setup.py").read_text()
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert re.search(r"install\(DIRECTORY launch config DESTINATION share/\$\{PROJECT_NAME\}\)", cmake)
    for spec in graph.node_specs("system"):
        script = ROOT / "scripts" / spec.executable
        assert script.is_file() and os.access(script, os.X_OK), script
        assert f"from {spec.module} import main" in script.read_text()
        assert f"scripts/{spec.executable}" in cmake
        assert f'"{spec.executable} = {spec.module}:main"' in setup_py
        assert importlib.util.find_spec(spec.module) is not None


def test_autostart_reaches_both_lifecycle_nodes():
    """autostart:=false makes drafter_node and verifier_node wait for a lifecycle manager; the other
    nodes are not lifecycle nodes and get nothing."""
    cmds = {n.spec.full_name: cmd for n, cmd in build_commands("system", {"autostart": "false"}, python="python")}
    for name, cmd in cmds.items():
        lifecycle = name in ("/robot/drafter_node", "/edge/verifier_node")
        assert ("autostart:=false" in cmd) == lifecycle, (name, cmd)
    assert all("autostart" not in " ".join(c) for _n, c in build_commands("system", {}, python="python"))


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="autostart: 'maybe' is not true or false"):
        graph.resolve("robot", {"autostart": "maybe"})
    with pytest.raises(ValueError, match="scenario: '5g' is not one of"):
        graph.resolve("system", {"scenario": "5g"})
    with pytest.raises(ValueError, match="unknown launch argument.*scenario.*valid: "):
        graph.resolve("robot", {"scenario": "20mbps_50ms"})
    with pytest.raises(ValueError, match="drafter_params_file: .*nope.yaml does not exist"):
        graph.resolve("robot", {"drafter_params_file": "/nope.yaml"})
    with pytest.raises(ValueError, match="robot_namespace"):
        graph.resolve("edge", {"robot_namespace": "robot/"})
    with pytest.raises(ValueError, match="configuration 'robots' is not one of"):
        graph.node_specs("robots")
    with pytest.raises(ValueError, match="'link_monitor' is ambiguous"):
        parse_sets("system", ["link_monitor.ping_period_s:=0.5"])
    with pytest.raises(ValueError, match="not a node of configuration 'robot'"):
        parse_sets("robot", ["verifier.threads:=2"])
    with pytest.raises(ValueError, match="expected <node>.<param>:=<value>"):
        parse_sets("robot", ["drafter.k=4"])
    assert parse_sets("system", ["/edge/link_monitor.ping_qos:=reliable", "drafter.k:=4"]) == {
        "monitor_edge": [("ping_qos", "reliable")], "drafter": [("k", "4")]}


def test_string_parameters_survive_the_command_line():
    for value in ["on", "1.5", "", "20mbps_50ms", "tiny-random:0:64", " x", "a: b"]:
        assert yaml.safe_load(graph.format_param(value)) == value, value
    assert graph.format_param(True) == "true" and graph.format_param(2) == "2" and graph.format_param(2.0) == "2.0"


# --------------------------------------------------------------------------- real processes
def _alive(pid: int) -> bool:
    """The process exists, is not a zombie, and is one of our nodes."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "State:\tZ" not in status and b"wisv_ros.nodes" in cmdline


class LaunchProcess:
    def __init__(self, args: list[str], log: Path):
        self.log = log
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "wisv_ros.cli.launch", *args],
                                         stdout=out, stderr=subprocess.STDOUT, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self) -> dict[str, int]:
        return {m[0]: int(m[1]) for m in re.findall(r"\[launch\] started (\S+) \(pid (\d+)\)", self.text())}

    def wait_for(self, pattern: str, timeout: float) -> re.Match | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            time.sleep(0.2)
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.pids().values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _get_parameters(node, full_name: str, names: list[str]) -> dict:
    """Values of ``names`` on node ``full_name`` ("<not declared>" for unknown ones)."""
    from rcl_interfaces.srv import GetParameters
    from rclpy.parameter import parameter_value_to_python

    client = node.create_client(GetParameters, f"{full_name}/get_parameters")
    try:
        assert client.wait_for_service(timeout_sec=30.0), f"no parameter service of {full_name}"
        done = threading.Event()
        future = client.call_async(GetParameters.Request(names=names))
        future.add_done_callback(lambda _f: done.set())
        assert done.wait(30.0), f"get_parameters of {full_name} timed out"
        return {n: parameter_value_to_python(v) if v.type else "<not declared>"
                for n, v in zip(names, future.result().values)}
    finally:
        node.destroy_client(client)


def test_pip_launcher_runs_the_system(ros_node, tmp_path):
    from wisv_ros.sd.rounds import generate_target_only
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import load_model
    from wisv_ros.msg import ChannelState
    from wisv_ros.nodes.client import GenerateClient
    from wisv_ros.nodes.common import RELIABLE_QOS

    n = 24
    expected = generate_target_only(CausalLM(load_model(TARGET)[0]), PROMPT_IDS, n).token_ids
    sets = ["verifier.target_dtype:=float32", "drafter.on_edge_loss:=error", "drafter.min_confidence:=0.0"]
    args = ["system", f"drafter_model:={DRAFTER}", f"target_model:={TARGET}", "scenario:=20mbps_5ms"]
    for s in sets:
        args += ["--set", s]
    states: list = []
    ros_node.create_subscription(ChannelState, "/edge/channel_state", states.append, RELIABLE_QOS)
    launch = LaunchProcess(args, tmp_path / "launch.log")
    try:
        assert launch.wait_for(r"started link_emulator", 30.0), launch.text()
        pids = launch.pids()
        assert set(pids) == {"robot/drafter_node", "robot/link_monitor", "edge/verifier_node", "edge/link_monitor",
                             "link_emulator"}, launch.text()
        client = GenerateClient(ros_node, "/robot/generate")
        assert client.wait_for_server(60.0), launch.text()
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # until both models are loaded: the drafter rejects goals, the verifier errs
            try:
                outcome = client.generate(" ".join(map(str, PROMPT_IDS)), timeout=120.0, max_new_tokens=n)
                if "not loaded yet" not in outcome.result.error and "edge loading" not in outcome.result.error:
                    break
            except (RuntimeError, TimeoutError):  # rejected, or the goal response lost or late
                pass
            assert time.monotonic() < deadline, "models not loaded\n" + launch.text()
            time.sleep(1.0)
        assert outcome.status_name == "succeeded", outcome.result.error + "\n" + launch.text()
        assert list(outcome.result.token_ids) == expected
        assert outcome.result.rounds > 0 and outcome.result.uplink_bytes > 0
        assert outcome.result.downlink_bytes > 0 and outcome.result.round_trip_s > 0  # verdicts came back
        # The robot monitor measured the emulated link, and its channel_state reached the edge.
        deadline = time.monotonic() + 30.0
        while not states and time.monotonic() < deadline:
            time.sleep(0.1)
        assert states, "no channel_state on /edge/channel_state\n" + launch.text()
        assert 0.004 < states[-1].rtt_s < 0.05  # 5 ms emulated plus the middleware's own latency
        # The parameter files and the overrides reached the nodes, and every file parameter is declared.
        for spec in graph.node_specs("system"):
            file_params = yaml.safe_load((ROOT / "config" / spec.params_file).read_text())[f"/**/{spec.name}"]["ros__parameters"]
            expect = dict(file_params)
            if spec.key == "drafter":
                expect.update(drafter_model=DRAFTER, target_tokenizer_model=TARGET, on_edge_loss="error", min_confidence=0.0)
            elif spec.key == "verifier":
                expect.update(target_model=TARGET, target_dtype="float32", default_channel="20mbps_5ms")
            elif spec.key == "emulator":
                expect.update(scenario="20mbps_5ms")
            assert _get_parameters(ros_node, spec.full_name, list(expect)) == expect, spec.full_name
        client.client.destroy()
        # The ask CLI (what tools/demo.sh runs) streams the same text and prints the stats table.
        ask = subprocess.run([sys.executable, "-m", "wisv_ros.cli.ask", "--prompt", " ".join(map(str, PROMPT_IDS)),
                              "--max-new-tokens", str(n), "--wait", "60", "--timeout", "120"],
                             capture_output=True, text=True, timeout=240)
        assert ask.returncode == 0, ask.stdout + ask.stderr
        lines = ask.stdout.splitlines()
        assert lines[0].split() == [str(i) for i in expected], ask.stdout
        assert lines[1].split()[:7] == ["tokens", "rounds", "aal", "latency_s", "tokens_per_s", "uplink_bytes",
                                        "downlink_bytes"], ask.stdout
        assert lines[3].split()[0] == str(n) and "channel measured by the link monitor" in ask.stdout

        # A node that dies is reported; the others keep running (no --shutdown-on-exit).
        os.kill(pids["edge/link_monitor"], signal.SIGKILL)
        assert launch.wait_for(r"edge/link_monitor died: killed by SIGKILL", 10.0), launch.text()
        assert launch.proc.poll() is None
        # SIGTERM: every node stops cleanly, nothing is left behind.
        launch.proc.send_signal(signal.SIGTERM)
        rc = launch.proc.wait(60.0)
        text = launch.text()
        assert rc == 1, text  # one node died
        for label in pids:
            if label != "edge/link_monitor":
                assert f"[launch] {label}: exit code 0" in text, text
        assert not [label for label, pid in pids.items() if _alive(pid)], text
    finally:
        launch.stop()


def test_nodes_do_not_outlive_a_killed_launcher(tmp_path):
    launch = LaunchProcess(["edge", f"target_model:={TARGET}"], tmp_path / "launch.log")
    try:
        assert launch.wait_for(r"started edge/link_monitor", 30.0), launch.text()
        for label in ("edge/verifier_node", "edge/link_monitor"):  # some output: the node is running
            assert launch.wait_for(rf"\[{label}\] ", START_TIMEOUT), launch.text()
        pids = launch.pids()
        launch.proc.send_signal(signal.SIGKILL)
        launch.proc.wait(10.0)
        deadline = time.monotonic() + 30.0
        while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [label for label, pid in pids.items() if _alive(pid)]
    finally:
        launch.stop()


def test_answers_survive_loss_duplicates_reordering_and_an_outage(ros_node, tmp_path):
    """The whole graph over an emulated link that really drops 10 % of the protocol's messages,
    duplicates 5 %, reorders 10 %, and then goes dark for 4 s: with on_edge_loss wait
    every answer is the target's own greedy text, every token once (feedback = result)."""
    from wisv_ros.sd.rounds import generate_target_only
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import load_model
    from wisv_ros.nodes.client import GenerateClient, set_string_parameter

    n = 120
    expected = generate_target_only(CausalLM(load_model(TARGET)[0]), PROMPT_IDS, n).token_ids
    sets = ["verifier.target_dtype:=float32", "drafter.min_confidence:=0.0", "drafter.on_edge_loss:=wait",
            "drafter.verdict_timeout_s:=0.4", "drafter.first_verdict_timeout_s:=2.0", "drafter.verdict_retries:=1",
            "drafter.edge_retry_s:=0.2", "emulator.fault_drop_rate:=0.1", "emulator.fault_duplicate_rate:=0.05",
            "emulator.fault_reorder_rate:=0.1", "emulator.fault_reorder_s:=0.03", "emulator.seed:=7"]
    args = ["system", f"drafter_model:={DRAFTER}", f"target_model:={TARGET}", "scenario:=500mbps_5ms"]
    for s in sets:
        args += ["--set", s]
    launch = LaunchProcess(args, tmp_path / "launch.log")
    try:
        assert launch.wait_for(r"started link_emulator", 30.0), launch.text()
        client = GenerateClient(ros_node, "/robot/generate")
        assert client.wait_for_server(60.0), launch.text()
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # until the drafter accepts goals (model loaded)
            try:
                run = client.start(" ".join(map(str, PROMPT_IDS)), max_new_tokens=n, k=4)
                break
            except (RuntimeError, TimeoutError):
                assert time.monotonic() < deadline, "drafter never accepted a goal\n" + launch.text()
                time.sleep(1.0)
        out = run.outcome(180.0)
        assert out.status_name == "succeeded", out.result.error + "\n" + launch.text()
        assert list(out.result.token_ids) == expected and out.feedback_ids() == expected
        assert out.result.drafter_only_rounds == 0 and out.result.edge_rounds > 0
        assert "resending the block" in launch.text() or "waiting up to edge_wait_s" in launch.text()
        # (That answer ran on placement auto, the parameter files' default: its edge rounds came
        # through the same faults.) A 4 s outage from 0.2 s after it is set; the next answer (split,
        # K = 2: 60 rounds or more, at least 5 ms of RTT each) starts at once, so the link goes dark
        # in the middle of it.
        set_string_parameter(ros_node, "/link_emulator", "fault_outages", "0.2:4")
        run = client.start(" ".join(map(str, PROMPT_IDS)), max_new_tokens=n, k=2, placement="split")
        out = run.outcome(180.0)
        assert out.status_name == "succeeded", out.result.error + "\n" + launch.text()
        assert list(out.result.token_ids) == expected and out.feedback_ids() == expected
        assert out.result.latency_s > 3.5  # the outage was ridden out, not skipped
        client.client.destroy()
    finally:
        launch.stop()


def test_fleet_configuration_checks_its_arguments_and_sets_by_role():
    nodes = graph.resolve("fleet", {"robots": "3", "scenarios": "20mbps_50ms"})
    assert [(n.namespace, n.name) for n in nodes if n.spec.role == "drafter"] == \
        [(f"/robot{i}", "drafter_node") for i in (1, 2, 3)]
    verifier = next(n for n in nodes if n.spec.key == "verifier")
    assert verifier.namespace == "/edge" and verifier.parameters["robots"] == "robot1,robot2,robot3"
    emulators = [n for n in nodes if n.spec.role == "emulator"]
    assert [(e.parameters["robot_namespace"], e.parameters["edge_namespace"], e.parameters["scenario"]) for e in emulators] == \
        [(f"/robot{i}", f"/edge/robot{i}", "20mbps_50ms") for i in (1, 2, 3)]
    assert sorted(n.namespace for n in nodes if n.spec.role == "monitor_edge") == ["/edge/robot1", "/edge/robot2", "/edge/robot3"]
    cmds = dict((n.spec.key, c) for n, c in build_commands("fleet", {"robots": "2"}, ["drafter.k:=4", "drafter2.tau:=0.1"]))
    assert "k:=4" in cmds["drafter1"] and "k:=4" in cmds["drafter2"]
    assert "tau:=0.1" in cmds["drafter2"] and "tau:=0.1" not in cmds["drafter1"]
    for args, error in [({"robots": "0"}, "robots: 0 is outside [1, 32]"), ({"robots": "two"}, "robots: 'two' is not a whole number"),
                        ({"robots": "3", "scenarios": "20mbps_50ms,500mbps_5ms"}, "scenarios: 2 names for 3 robots"),
                        ({"scenarios": "5g"}, "scenarios: '5g' is not one of")]:
        with pytest.raises(ValueError, match=re.escape(error)):
            graph.resolve("fleet", args)


def test_pip_launcher_runs_a_fleet_of_two_robots_on_one_edge(ros_node, tmp_path):
    """Two robots, each on its own emulated link, one verifier: both answers are the target's own
    greedy text; each robot's verdicts arrive on its own topic only; a block sent by robot2 under a
    request id robot1 opened is refused by name and answered on robot2's topic alone."""
    from wisv_ros.msg import DraftBlock, Verdict
    from wisv_ros.nodes.client import GenerateClient
    from wisv_ros.nodes.common import RELIABLE_QOS
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import load_model
    from wisv_ros.sd.rounds import generate_target_only

    n = 16
    expected = generate_target_only(CausalLM(load_model(TARGET)[0]), PROMPT_IDS, n).token_ids
    args = ["fleet", "robots:=2", "scenarios:=20mbps_5ms,500mbps_5ms", f"drafter_model:={DRAFTER}", f"target_model:={TARGET}",
            "--set", "verifier.target_dtype:=float32", "--set", "drafter.on_edge_loss:=error",
            "--set", "drafter.min_confidence:=0.0"]
    verdicts = {r: [] for r in ("robot1", "robot2")}
    for r in verdicts:
        ros_node.create_subscription(Verdict, f"/edge/{r}/verdict", verdicts[r].append, RELIABLE_QOS)
    launch = LaunchProcess(args, tmp_path / "launch.log")
    try:
        assert launch.wait_for(r"started link2/link_emulator", 30.0), launch.text()
        assert set(launch.pids()) == {"edge/verifier_node", "robot1/drafter_node", "robot1/link_monitor",
                                      "edge/robot1/link_monitor", "link1/link_emulator", "robot2/drafter_node",
                                      "robot2/link_monitor", "edge/robot2/link_monitor", "link2/link_emulator"}, launch.text()
        clients = [GenerateClient(ros_node, f"/robot{i}/generate") for i in (1, 2)]
        for c in clients:
            assert c.wait_for_server(60.0), launch.text()
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # until every model is loaded
            try:
                goals = [c.start(" ".join(map(str, PROMPT_IDS)), max_new_tokens=n) for c in clients]
                outs = [g.outcome(120.0) for g in goals]
                if not any("loading" in o.result.error or "not loaded" in o.result.error for o in outs):
                    break
            except (RuntimeError, TimeoutError):
                pass
            assert time.monotonic() < deadline, "models not loaded\n" + launch.text()
            time.sleep(1.0)
        for o in outs:
            assert o.status_name == "succeeded", o.result.error + "\n" + launch.text()
            assert list(o.result.token_ids) == expected and o.result.drafter_only_rounds == 0
        ids = {r: {v.request_id for v in verdicts[r] if not v.error} for r in verdicts}
        assert ids["robot1"] and ids["robot2"] and not ids["robot1"] & ids["robot2"], ids

        pubs = {r: ros_node.create_publisher(DraftBlock, f"/edge/{r}/draft_block", RELIABLE_QOS) for r in verdicts}
        deadline = time.monotonic() + 10.0
        while any(p.get_subscription_count() == 0 for p in pubs.values()):
            assert time.monotonic() < deadline, "verifier's per-robot draft_block not discovered"
            time.sleep(0.1)

        def block(round_id, context=()):
            msg = DraftBlock()
            msg.request_id, msg.round_id, msg.token_ids, msg.k = "shared-id", round_id, [1], 1
            msg.context_ids = list(context)
            msg.prefix_length = len(context) if context else len(PROMPT_IDS) + 2
            return msg

        def wait(robot, pred):
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                got = [v for v in verdicts[robot] if v.request_id == "shared-id" and pred(v)]
                if got:
                    return got[0]
                time.sleep(0.1)
            raise AssertionError(f"no verdict for shared-id on {robot}\n" + launch.text())

        pubs["robot1"].publish(block(0, PROMPT_IDS))
        opened = wait("robot1", lambda v: v.round_id == 0)
        assert not opened.error, opened.error
        pubs["robot2"].publish(block(1))
        refused = wait("robot2", lambda v: v.round_id == 1)
        assert refused.error.startswith("request_id: shared-id belongs to another robot's request"), refused.error
        assert [v.round_id for v in verdicts["robot1"] if v.request_id == "shared-id"] == [0]
        for c in clients:
            c.client.destroy()
    finally:
        launch.stop()


def _keystore(root: Path, configuration: str, robots: int = 2) -> Path:
    """A keystore's layout (enclaves/<node>/ folders) for the nodes of ``configuration``."""
    for spec in graph.node_specs(configuration, robots=robots):
        (root / "enclaves" / spec.full_name.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return root


def test_a_keystore_puts_every_node_in_its_enclave(tmp_path, monkeypatch):
    """keystore:=<dir>: both launch routes run each node in the enclave of its full name with
    security enforced; a keystore or an enclave that is missing is refused with the command that
    makes it."""
    ks = _keystore(tmp_path / "ks", "fleet")
    args = {"robots": "2", "keystore": str(ks)}
    _, launch_nodes = load_launch_file("fleet", monkeypatch, args)
    commands = build_commands("fleet", args, python="python")
    env = {"ROS_SECURITY_KEYSTORE": str(ks.resolve()), "ROS_SECURITY_ENABLE": "true", "ROS_SECURITY_STRATEGY": "Enforce"}
    for kw, (node, cmd) in zip(launch_nodes, commands):
        assert _from_launch(kw)["enclave"] == _from_command(cmd)["enclave"] == node.spec.full_name
        assert kw["additional_env"] == dict(node.env) == env
    with pytest.raises(ValueError, match=re.escape("ros2 security create_keystore")):
        graph.resolve("system", {"keystore": str(tmp_path / "none")})
    with pytest.raises(ValueError, match=re.escape(f"has no enclave /robot3/drafter_node; make it with `ros2 security "
                                                   f"create_enclave {ks} /robot3/drafter_node`")):
        graph.resolve("fleet", {"robots": "3", "keystore": str(ks)})


def _middleware_security() -> str:
    """'' when this middleware can run secure nodes; else why not (the error it gives)."""
    probe = Path(tempfile.mkdtemp())
    (probe / "enclaves" / "probe").mkdir(parents=True)
    env = dict(os.environ, ROS_SECURITY_ENABLE="true", ROS_SECURITY_STRATEGY="Enforce", ROS_SECURITY_KEYSTORE=str(probe))
    code = "import rclpy; rclpy.init(args=['--ros-args', '--enclave', '/probe']); rclpy.create_node('probe')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    text = out.stdout + out.stderr
    if "doesn't have the security libraries" in text:
        return "the middleware has no DDS security: " + text.strip().splitlines()[-2].strip()
    return ""


def test_the_secure_graph_answers_where_the_middleware_has_security(ros_node, tmp_path):
    """With a real keystore (``ros2 security``) the system graph runs secured and answers a goal.
    The Fast DDS wheels on PyPI are built without the security plugins: there this skips, saying so."""
    why = _middleware_security()
    if why:
        pytest.skip(why)
    if shutil.which("ros2") is None:
        pytest.skip("no ros2 CLI (sros2) here to create a keystore")
    ks = tmp_path / "ks"
    subprocess.run(["ros2", "security", "create_keystore", str(ks)], check=True, timeout=120)
    for enclave in [spec.full_name for spec in graph.node_specs("system")] + ["/robot/ask"]:
        subprocess.run(["ros2", "security", "create_enclave", str(ks), enclave], check=True, timeout=120)
    launch = LaunchProcess(["system", f"drafter_model:={DRAFTER}", f"target_model:={TARGET}", f"keystore:={ks}",
                            "--set", "verifier.target_dtype:=float32"], tmp_path / "launch.log")
    try:
        assert launch.wait_for(r"started link_emulator", 30.0), launch.text()
        out = subprocess.run([sys.executable, "-m", "wisv_ros.cli.ask", "--prompt", " ".join(map(str, PROMPT_IDS)),
                              "--max-new-tokens", "8", "--wait", "60", "--timeout", "120"],
                             capture_output=True, text=True, timeout=240,
                             env=dict(os.environ, ROS_SECURITY_ENABLE="true", ROS_SECURITY_STRATEGY="Enforce",
                                      ROS_SECURITY_KEYSTORE=str(ks), ROS_SECURITY_ENCLAVE_OVERRIDE="/robot/ask"))
        assert out.returncode == 0, out.stdout + out.stderr + launch.text()
        assert out.stdout.splitlines()[0].split()  # the answer's tokens came back through the secured graph
    finally:
        launch.stop()
