"""The wisv_ros node graph, ROS-free: which nodes run in each configuration, and how.

One description, two ways to start it:

- ``ros2 launch wisv_ros {robot,edge,system}.launch.py [arg:=value ...]`` (machines with a ROS 2
  install): ``wisv_ros.graph.ros_launch`` turns :func:`resolve` into ``launch_ros.actions.Node`` actions;
- ``python -m wisv_ros.cli.launch {robot,edge,system} [arg:=value ...]`` (pip-only machines):
  :func:`command` turns the same :func:`resolve` into ``python -m wisv_ros.nodes.<executable>
  --ros-args ...`` command lines. ``test/test_launch.py`` checks that the two agree.

Configurations:

- ``robot``: ``drafter_node`` and ``link_monitor`` (role robot) in ``/robot``;
- ``edge``: ``verifier_node`` and ``link_monitor`` (role edge) in ``/edge``, with the link topics
  remapped into the robot's namespace (argument ``robot_namespace``) so that robot and edge meet
  directly across a real network;
- ``system``: both on one machine, without those remaps, plus ``link_emulator`` relaying the link
  topics between ``/robot`` and ``/edge`` through an emulated channel (argument ``scenario``);
- ``fleet``: N robots (argument ``robots``, default 2) and one edge on one machine: ``/robot1`` ...
  ``/robotN`` each with its drafter and link monitor and its own emulated link (``/linkI/link_emulator``
  relaying ``/robotI`` <-> ``/edge/robotI``; argument ``scenarios``: one scenario per robot), and in
  ``/edge`` one ``verifier_node`` serving them all (parameter ``robots``: every robot on its own
  topics ``/edge/robotI/...``, its own KV sequence, blocks of robots that wait together verified in
  one pass) with one edge link monitor per robot (``/edge/robotI/link_monitor``).

Link topics (robot -> edge: :data:`UPLINK_TOPICS`, edge -> robot: :data:`DOWNLINK_TOPICS`) are the
link emulator's default relay lists. ``channel_state`` is published by the robot's monitor, which
pings the (emulated) link; the drafter reads it in ``/robot`` and the verifier reads the relayed
copy in ``/edge``. ``round_stats`` stays on the edge.

Launch arguments (:func:`launch_arguments`) are strings, as in ``ros2 launch``; an empty model
name keeps the parameter file's value. Each node reads one parameter file from ``config/``
(``<key>_params_file`` replaces it) and then the overrides the arguments give.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from wisv_ros.link.channel import SCENARIOS

__all__ = [
    "CONFIGURATIONS",
    "DOWNLINK_TOPICS",
    "EDGE_NS",
    "LaunchArgument",
    "NodeSpec",
    "PACKAGE",
    "ROBOT_NS",
    "ResolvedNode",
    "UPLINK_TOPICS",
    "command",
    "config_dir",
    "format_param",
    "launch_arguments",
    "node_specs",
    "resolve",
]

PACKAGE = "wisv_ros"
ROBOT_NS = "/robot"
EDGE_NS = "/edge"
CONFIGURATIONS = ("robot", "edge", "system", "fleet")
MAX_ROBOTS = 32  # robots of the fleet configuration at most

#: robot -> edge and edge -> robot topics (relative names), as relayed by link_emulator_node.
UPLINK_TOPICS = ("draft_block", "hidden_reply", "channel_state", "link_ping")
DOWNLINK_TOPICS = ("verdict", "hidden_request", "link_ping_echo")


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One node of the graph, before launch arguments are applied."""

    key: str  # short handle: <key>_params_file argument, `--set <key>.param:=value`
    executable: str  # console script / lib/wisv_ros launcher; module wisv_ros.nodes.<executable>
    name: str  # node name (``-r __node:=``)
    namespace: str  # absolute namespace (``-r __ns:=``)
    params_file: str  # file name in config/
    side: str  # "robot", "edge" or "link": where it runs
    #: link topics this node publishes or subscribes (relative names); remapped on a lone edge
    link_topics: tuple[str, ...] = ()
    package: str = PACKAGE
    role: str = ""  # what the node is in the graph ('' = its key): fleet robots' nodes share their role's
    #                 params file argument, launch-argument overrides and --set handle

    @property
    def role_key(self) -> str:
        return self.role or self.key

    @property
    def module(self) -> str:
        return f"{self.package}.nodes.{self.executable}"

    @property
    def full_name(self) -> str:
        return f"{self.namespace.rstrip('/')}/{self.name}"


@dataclasses.dataclass(frozen=True)
class LaunchArgument:
    name: str
    default: str
    description: str


@dataclasses.dataclass(frozen=True)
class ResolvedNode:
    """A node with its launch arguments applied: what both launch routes start."""

    spec: NodeSpec
    params_file: str  # absolute path
    parameters: dict  # overrides after the file, name -> value (str, bool, int, float)
    remappings: tuple[tuple[str, str], ...]
    enclave: str = ""  # SROS2 enclave ('' = security off): the node's full name in the keystore
    env: tuple[tuple[str, str], ...] = ()  # environment the node needs (the SROS2 variables)

    # Shortcuts for the launch code.
    package = property(lambda self: self.spec.package)
    executable = property(lambda self: self.spec.executable)
    name = property(lambda self: self.spec.name)
    namespace = property(lambda self: self.spec.namespace)


_DRAFTER = NodeSpec("drafter", "drafter_node", "drafter_node", ROBOT_NS, "drafter.yaml", "robot",
                    ("draft_block", "hidden_reply", "channel_state", "verdict", "hidden_request"))
_MONITOR_ROBOT = NodeSpec("monitor_robot", "link_monitor_node", "link_monitor", ROBOT_NS,
                          "link_monitor_robot.yaml", "robot", ("link_ping", "link_ping_echo", "channel_state"))
_VERIFIER = NodeSpec("verifier", "verifier_node", "verifier_node", EDGE_NS, "verifier.yaml", "edge",
                     ("draft_block", "hidden_reply", "channel_state", "verdict", "hidden_request"))
_MONITOR_EDGE = NodeSpec("monitor_edge", "link_monitor_node", "link_monitor", EDGE_NS,
                         "link_monitor_edge.yaml", "edge", ("link_ping", "link_ping_echo"))
_EMULATOR = NodeSpec("emulator", "link_emulator_node", "link_emulator", "/", "link_emulator.yaml", "link")

_NODES = {
    "robot": (_DRAFTER, _MONITOR_ROBOT),
    "edge": (_VERIFIER, _MONITOR_EDGE),
    "system": (_DRAFTER, _MONITOR_ROBOT, _VERIFIER, _MONITOR_EDGE, _EMULATOR),
}

#: launch argument -> the (node key, parameter) pairs it sets when not empty
_ARG_TARGETS = {
    "drafter_model": (("drafter", "drafter_model"),),
    "target_model": (("drafter", "target_tokenizer_model"), ("verifier", "target_model")),
    "scenario": (("emulator", "scenario"), ("verifier", "default_channel")),
    "autostart": (("drafter", "autostart"), ("verifier", "autostart")),
    "scenarios": (),  # fleet: per robot, see resolve
    "robots": (),  # fleet: how many, see node_specs
}
_BOOL_ARGS = {"autostart"}  # launch arguments given to the nodes as bool parameters
_ARG_HELP = {
    "drafter_model": "drafter model spec (registry name, HF folder, .gguf, tiny-random:...); '' = the params file's",
    "target_model": "target model spec; sets the verifier's target_model and the drafter's "
                    "target_tokenizer_model; '' = the params files'",
    "scenario": "emulated channel, one of " + ", ".join(SCENARIOS) + "; also the verifier's "
                "default_channel; '' = the params files'",
    "robot_namespace": "namespace of the robot's nodes, into which the edge's link topics are remapped",
    "autostart": "true: drafter_node and verifier_node (lifecycle nodes) configure and activate themselves; "
                 "false: they wait unconfigured for a lifecycle manager; '' = the params files' (true)",
    "keystore": "SROS2 keystore (from `ros2 security create_keystore`); '' = security off. Every node runs in "
                "the enclave of its full name (e.g. /robot1/drafter_node), security enforced; each enclave must "
                "exist (`ros2 security create_enclave <keystore> <enclave>`)",
    "robots": f"fleet: how many robots share the edge (1-{MAX_ROBOTS}); namespaces /robot1 ... /robotN",
    "scenarios": "fleet: each robot's emulated channel, comma-separated in robot order (one name: every robot); "
                 "'' = scenario (or the params file's)",
}


def _check_configuration(configuration: str) -> None:
    if configuration not in CONFIGURATIONS:
        raise ValueError(f"configuration {configuration!r} is not one of {', '.join(CONFIGURATIONS)}")


def node_specs(configuration: str, robots: int = 2) -> tuple[NodeSpec, ...]:
    """The nodes of ``configuration`` ("robot", "edge", "system" or "fleet" of ``robots`` robots)."""
    _check_configuration(configuration)
    if configuration != "fleet":
        return _NODES[configuration]
    if not 1 <= robots <= MAX_ROBOTS:
        raise ValueError(f"launch argument robots: {robots} is outside [1, {MAX_ROBOTS}]")
    specs = [_VERIFIER]
    for i in range(1, robots + 1):
        ns, edge_ns = f"/robot{i}", f"{EDGE_NS}/robot{i}"
        specs += [dataclasses.replace(_DRAFTER, key=f"drafter{i}", namespace=ns, role="drafter"),
                  dataclasses.replace(_MONITOR_ROBOT, key=f"monitor_robot{i}", namespace=ns, role="monitor_robot"),
                  dataclasses.replace(_MONITOR_EDGE, key=f"monitor_edge{i}", namespace=edge_ns, role="monitor_edge"),
                  dataclasses.replace(_EMULATOR, key=f"emulator{i}", namespace=f"/link{i}", role="emulator")]
    return tuple(specs)


def _fleet_size(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"launch argument robots: {value!r} is not a whole number (1-{MAX_ROBOTS})") from None
    if not 1 <= n <= MAX_ROBOTS:
        raise ValueError(f"launch argument robots: {n} is outside [1, {MAX_ROBOTS}]")
    return n


def config_dir() -> Path:
    """Folder of the parameter files: ``config/`` of this source checkout (pip route, colcon
    ``--symlink-install``), else the installed ``share/wisv_ros/config`` (ament index)."""
    checkout = Path(__file__).resolve().parents[2]  # wisv_ros/graph/description.py -> the checkout
    if (checkout / "package.xml").is_file() and (checkout / "config").is_dir():
        return checkout / "config"
    from ament_index_python.packages import get_package_share_directory

    return Path(get_package_share_directory(PACKAGE)) / "config"


def launch_arguments(configuration: str, config: Path | None = None) -> tuple[LaunchArgument, ...]:
    """The launch arguments of ``configuration`` with their defaults (all strings)."""
    specs = node_specs(configuration, robots=1)
    keys = {s.role_key for s in specs}
    config = config_dir() if config is None else Path(config)
    fleet = configuration == "fleet"
    args = [LaunchArgument(name, "", _ARG_HELP[name]) for name, targets in _ARG_TARGETS.items()
            if any(key in keys for key, _ in targets) and (name != "scenario" or "emulator" in keys)]
    if fleet:
        args += [LaunchArgument("robots", "2", _ARG_HELP["robots"]), LaunchArgument("scenarios", "", _ARG_HELP["scenarios"])]
    if configuration == "edge":
        args.append(LaunchArgument("robot_namespace", ROBOT_NS, _ARG_HELP["robot_namespace"]))
    args.append(LaunchArgument("keystore", "", _ARG_HELP["keystore"]))
    for s in specs:
        where = f"every {s.role_key} node" if fleet and s.role else f"{s.full_name} ({s.executable})"
        args.append(LaunchArgument(f"{s.role_key}_params_file", str(config / s.params_file), f"parameter file of {where}"))
    return tuple(args)


def _check_namespace(value: str) -> str:
    if not value.startswith("/") or value.endswith("/") or "//" in value or " " in value:
        raise ValueError(f"launch argument robot_namespace: {value!r} must be an absolute namespace "
                         "without a trailing '/', e.g. /robot")
    return value


def resolve(configuration: str, arguments: dict[str, str] | None = None,
            config: Path | None = None) -> list[ResolvedNode]:
    """Apply launch ``arguments`` (name -> string; missing ones take their defaults).

    Raises:
        ValueError: unknown configuration or argument name, a bad value, or a missing params file;
            the message names the argument and the valid choices.
    """
    declared = {a.name: a for a in launch_arguments(configuration, config)}
    arguments = dict(arguments or {})
    unknown = sorted(set(arguments) - set(declared))
    if unknown:
        raise ValueError(f"unknown launch argument(s) {', '.join(unknown)} for configuration "
                         f"{configuration!r}; valid: {', '.join(declared)}")
    values = {name: str(arguments.get(name, a.default)) for name, a in declared.items()}
    scenario = values.get("scenario", "")
    if scenario and scenario not in SCENARIOS:
        raise ValueError(f"launch argument scenario: {scenario!r} is not one of {', '.join(SCENARIOS)}")
    robot_ns = _check_namespace(values["robot_namespace"]) if "robot_namespace" in values else None
    n_robots = _fleet_size(values["robots"]) if "robots" in values else 1
    per_robot: list[str] = []
    if values.get("scenarios"):
        per_robot = [x.strip() for x in values["scenarios"].split(",")]
        bad = [x for x in per_robot if x not in SCENARIOS]
        if bad or len(per_robot) not in (1, n_robots):
            why = (f"{bad[0]!r} is not one of {', '.join(SCENARIOS)}" if bad
                   else f"{len(per_robot)} names for {n_robots} robots (give one, or one per robot)")
            raise ValueError(f"launch argument scenarios: {why}")
        per_robot = per_robot * n_robots if len(per_robot) == 1 else per_robot

    nodes = []
    for spec in node_specs(configuration, robots=n_robots):
        params_file = Path(values[f"{spec.role_key}_params_file"]).expanduser()
        if not params_file.is_file():
            raise ValueError(f"launch argument {spec.role_key}_params_file: {params_file} does not exist")
        overrides = {param: _arg_value(arg, values[arg]) for arg, targets in _ARG_TARGETS.items()
                     for key, param in targets if key == spec.role_key and values.get(arg)}
        if configuration == "fleet":
            overrides.update(_fleet_overrides(spec, n_robots, per_robot))
        remaps = ()
        if robot_ns is not None and spec.side == "edge":
            remaps = tuple((t, f"{robot_ns}/{t}") for t in spec.link_topics)
        enclave, env = _security(values.get("keystore", ""), spec)
        nodes.append(ResolvedNode(spec, str(params_file.resolve()), overrides, remaps, enclave, env))
    return nodes


def _security(keystore: str, spec: NodeSpec) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The SROS2 enclave and environment of a node (none without a keystore); ValueError naming a
    keystore or enclave that is not there, with the command that makes it."""
    if not keystore:
        return "", ()
    root = Path(keystore).expanduser()
    if not (root / "enclaves").is_dir():
        raise ValueError(f"launch argument keystore: {root} is no SROS2 keystore (no enclaves/ folder); "
                         f"make one with `ros2 security create_keystore {root}`")
    enclave = spec.full_name
    if not (root / "enclaves" / enclave.lstrip("/")).is_dir():
        raise ValueError(f"launch argument keystore: {root} has no enclave {enclave}; make it with "
                         f"`ros2 security create_enclave {root} {enclave}`")
    return enclave, (("ROS_SECURITY_KEYSTORE", str(root.resolve())), ("ROS_SECURITY_ENABLE", "true"),
                     ("ROS_SECURITY_STRATEGY", "Enforce"))


def _fleet_overrides(spec: NodeSpec, n_robots: int, scenarios: list[str]) -> dict:
    """What makes the fleet's nodes one graph: the verifier serves every robot (its own topics and KV
    sequence, all of them in one batch at most); each emulator joins its robot to the edge side."""
    if spec.role_key == "verifier":
        return {"robots": ",".join(f"robot{i}" for i in range(1, n_robots + 1)), "max_batch": n_robots,
                "max_requests": max(16, 2 * n_robots)}  # kv_sessions auto: one sequence per robot (llama_cpp)
    if spec.role_key == "emulator":
        i = int(spec.key.removeprefix("emulator"))
        out = {"robot_namespace": f"/robot{i}", "edge_namespace": f"{EDGE_NS}/robot{i}"}
        if scenarios:
            out["scenario"] = scenarios[i - 1]
        return out
    return {}


def _arg_value(name: str, value: str):
    """A launch argument's string as the parameter's type (bool arguments: true / false)."""
    if name not in _BOOL_ARGS:
        return value
    if value.lower() not in ("true", "false"):
        raise ValueError(f"launch argument {name}: {value!r} is not true or false")
    return value.lower() == "true"


def format_param(value) -> str:
    """A parameter value for ``-p name:=<value>``; rcl reads it as YAML, so strings that YAML
    would read as something else ("on", "1.5", "") are double-quoted."""
    import json

    import yaml

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        text = repr(value)
        return text if isinstance(value, int) or any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        try:
            plain = yaml.safe_load(value) == value
        except yaml.YAMLError:
            plain = False
        return value if plain and value.strip() == value and value else json.dumps(value)
    raise TypeError(f"parameter value {value!r}: only str, bool, int and float are supported")


def command(node: ResolvedNode, python: str, extra: list[tuple[str, str]] = ()) -> list[str]:
    """The pip route's command line of ``node``: ``python -m wisv_ros.nodes.<executable> --ros-args``
    with the name, namespace, params file, overrides, remaps, then ``extra`` (name, raw value) pairs
    given as ``-p name:=value`` unchanged (the user's YAML, as with ``ros2 run``)."""
    cmd = [python, "-m", node.spec.module, "--ros-args",
           "-r", f"__node:={node.name}", "-r", f"__ns:={node.namespace}",
           "--params-file", node.params_file]
    if node.enclave:
        cmd += ["--enclave", node.enclave]
    for name, value in node.parameters.items():
        cmd += ["-p", f"{name}:={format_param(value)}"]
    for name, value in extra:
        cmd += ["-p", f"{name}:={value}"]
    for src, dst in node.remappings:
        cmd += ["-r", f"{src}:={dst}"]
    return cmd
