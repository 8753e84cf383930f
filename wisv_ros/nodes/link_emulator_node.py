"""link_emulator_node: relays robot <-> edge topics through an emulated wireless link.

The kernel here has no netem, so the link is emulated in user space (model:
:mod:`wisv_ros.link.emulator`). The node subscribes to every listed topic on one side with
``raw=True`` (the serialized CDR bytes, never deserialized), asks :class:`LinkEmulator` when
those bytes would arrive on the other side, and publishes them there at that time:

- uplink:   ``<robot_namespace>/<topic>`` -> ``<edge_namespace>/<topic>`` (rate ``rate_bps``)
- downlink: ``<edge_namespace>/<topic>`` -> ``<robot_namespace>/<topic>`` (``downlink_rate_bps``)

Subscription callbacks only compute the delivery time and queue the bytes; a delivery thread
sleeps on a condition variable until the earliest delivery time and publishes (callbacks never
block). The message size the emulator charges is the CDR payload length. Times are on
``time.monotonic()``. What this does not emulate: the middleware's own latency (it comes on top,
about 1 ms per hop on loopback) and reordering. Reliable topics lose nothing (losses cost
retransmission time); best-effort topics lose whole messages.

The node never publishes its own settings on ``channel_state``: ``link_monitor_node`` has to
measure them. (Relaying the monitor's ``channel_state`` to the edge is just another uplink topic.)

Parameters (all read at start, except ``trace_origin_unix_s``):

- ``scenario`` (string, default ``500mbps_5ms``): a name from ``wisv_ros.link.channel.SCENARIOS``.
- ``trace_file`` (string, default empty): CSV/YAML channel trace (``ChannelTrace.load``); when
  set it replaces ``scenario`` and the overrides are not allowed.
- ``rate_bps`` (float, 0 = from the scenario), ``per`` and ``rtt_s`` (float, < 0 = from the
  scenario): override one field of the scenario (``rate_bps`` sets both directions).
- ``trace_origin_unix_s`` (float, 0 = node start): wall-clock time (s since the epoch) of trace
  time 0; may be set at run time to align a trace with an experiment.
- ``mtu_bytes`` (int, 1500), ``seed`` (int, 0): see :class:`LinkEmulator`.
- ``robot_namespace`` (``/robot``), ``edge_namespace`` (``/edge``): the two sides.
- ``uplink_topics`` / ``downlink_topics`` (string arrays of ``name:package/msg/Type``).
- ``qos_depth`` (int, 100): keep-last depth of the relay subscriptions/publishers.
- ``best_effort_topics`` (string array, ``[link_ping, link_ping_echo]``): topics relayed
  best-effort (QoS and emulation: one lost packet drops the message, see
  ``LinkEmulator.send(reliable=False)``); all others are reliable (loss costs retransmission
  time). The QoS on both sides must match: reliable topics need reliable endpoints.
- Faults (``wisv_ros.link.emulator.Faults``; all off by default), on ``fault_topics`` (string
  array, the round protocol's ``draft_block``, ``verdict``, ``hidden_request``, ``hidden_reply``):
  ``fault_drop_rate`` (share dropped outright, reliable or not), ``fault_drop_burst`` (a drop
  takes the next N-1 messages of the topic too), ``fault_duplicate_rate``, ``fault_reorder_rate``
  with ``fault_reorder_s`` (held back that much longer, so later messages overtake), and
  ``fault_outages`` ("START_S:DURATION_S,...", seconds after the node started, or after the
  moment it is set at run time: everything dropped). The counts are logged when the node stops.
"""

from __future__ import annotations

import importlib
import math
import sys
import threading
import time
from dataclasses import replace
from functools import partial

from rcl_interfaces.msg import SetParametersResult
from rclpy.node import Node

from wisv_ros.link.emulator import DeliveryQueue, Direction, FaultInjector, Faults, LinkEmulator, parse_outages
from wisv_ros.link.channel import SCENARIOS, ChannelState, ChannelTrace, scenario
from wisv_ros.nodes.common import check_choice, declare, reliable_qos, run_node
from wisv_ros.nodes.link_monitor_node import _received_monotonic, best_effort_qos

__all__ = ["LinkEmulatorNode", "parse_topic_spec", "main"]

DEFAULT_UPLINK_TOPICS = [
    "draft_block:wisv_ros/msg/DraftBlock",
    "hidden_reply:wisv_ros/msg/HiddenReply",
    "channel_state:wisv_ros/msg/ChannelState",
    "link_ping:wisv_ros/msg/LinkPing",
]
# The link monitor's pings are best-effort: a ping that loses a packet is lost, which is how
# the monitor measures PER (see wisv_ros.link.estimator).
DEFAULT_BEST_EFFORT_TOPICS = ["link_ping", "link_ping_echo"]
DEFAULT_FAULT_TOPICS = ["draft_block", "verdict", "hidden_request", "hidden_reply"]  # the round protocol's
DEFAULT_DOWNLINK_TOPICS = [
    "verdict:wisv_ros/msg/Verdict",
    "hidden_request:wisv_ros/msg/HiddenRequest",
    "link_ping_echo:wisv_ros/msg/LinkPing",
]


def parse_topic_spec(spec: str) -> tuple[str, type]:
    """Parse ``"name:package/msg/Type"`` into the topic name and the message class.

    Raises:
        ValueError: malformed spec, a topic name with a leading ``/`` or a type that does not import.
    """
    name, sep, type_name = spec.partition(":")
    parts = type_name.split("/")
    if not sep or not name or len(parts) != 3 or parts[1] != "msg" or not all(parts):
        raise ValueError(f"topic spec {spec!r} must look like 'name:package/msg/Type'")
    if name.startswith("/") or name.endswith("/") or "//" in name:
        raise ValueError(f"topic spec {spec!r}: the name must be relative (no leading '/')")
    try:
        msg_type = getattr(importlib.import_module(f"{parts[0]}.msg"), parts[2])
    except (ImportError, AttributeError):
        raise ValueError(f"topic spec {spec!r}: message type {type_name} not found") from None
    return name, msg_type


def _check_namespace(name: str, value: str) -> str:
    if not value.startswith("/") or value.endswith("/") and value != "/":
        raise ValueError(f"parameter {name}: {value!r} must be absolute, without a trailing '/'")
    return value.rstrip("/")


class LinkEmulatorNode(Node):
    """Relays the listed topics between the robot and edge namespaces with emulated delays."""

    def __init__(self) -> None:
        super().__init__("link_emulator")
        p_scenario = declare(self, "scenario", "500mbps_5ms",
                             "channel scenario name from wisv_ros.link.channel.SCENARIOS",
                             choices=tuple(sorted(SCENARIOS)))
        p_trace = declare(self, "trace_file", "",
                          "CSV/YAML channel trace (t_s, rate_bps, per, rtt_s); replaces scenario")
        p_rate = declare(self, "rate_bps", 0.0,
                         "override of the scenario's rate in bit/s, both directions (0 = keep)",
                         lo=0.0, hi=1e12)
        p_per = declare(self, "per", -1.0,
                        "override of the scenario's packet error rate in [0, 1) (< 0 = keep)",
                        lo=-1.0, hi=0.999)
        p_rtt = declare(self, "rtt_s", -1.0,
                        "override of the scenario's round-trip time in s (< 0 = keep)",
                        lo=-1.0, hi=60.0)
        p_origin = declare(self, "trace_origin_unix_s", 0.0,
                           "wall-clock time (s since epoch) of trace time 0; 0 = node start; "
                           "settable at run time", lo=0.0, hi=1e11)
        p_mtu = declare(self, "mtu_bytes", 1500, "packet size in bytes", lo=1, hi=1 << 20)
        p_seed = declare(self, "seed", 0, "seed of the packet-loss RNG", lo=0, hi=2**31 - 1)
        p_robot = declare(self, "robot_namespace", "/robot", "namespace of the robot side")
        p_edge = declare(self, "edge_namespace", "/edge", "namespace of the edge side")
        p_up = declare(self, "uplink_topics", DEFAULT_UPLINK_TOPICS,
                       "robot->edge topics, each 'name:package/msg/Type'")
        p_down = declare(self, "downlink_topics", DEFAULT_DOWNLINK_TOPICS,
                         "edge->robot topics, each 'name:package/msg/Type'")
        p_depth = declare(self, "qos_depth", 100, "keep-last depth of the relay QoS", lo=1, hi=10000)
        p_best_effort = declare(self, "best_effort_topics", DEFAULT_BEST_EFFORT_TOPICS,
                                "listed topics relayed best-effort: a lost packet drops the message")

        p_faults = Faults(
            drop_rate=declare(self, "fault_drop_rate", 0.0, "share of fault_topics messages dropped outright, "
                              "reliable topics included (the link model itself never loses those)", lo=0.0, hi=0.99),
            drop_burst=declare(self, "fault_drop_burst", 1, "a drop also takes the next N-1 messages of the topic",
                               lo=1, hi=1000),
            duplicate_rate=declare(self, "fault_duplicate_rate", 0.0, "share of fault_topics messages delivered twice",
                                   lo=0.0, hi=0.99),
            reorder_rate=declare(self, "fault_reorder_rate", 0.0, "share of fault_topics messages held back "
                                 "fault_reorder_s, so that later ones overtake them", lo=0.0, hi=0.99),
            reorder_s=declare(self, "fault_reorder_s", 0.05, "extra delay of a reordered message (s)", lo=0.0, hi=60.0),
            outages=parse_outages(x for x in declare(
                self, "fault_outages", "", "comma-separated outage windows 'START_S:DURATION_S' (s after the node "
                "started): every fault_topics message in them is dropped, e.g. '20:5'").split(",") if x.strip()),
        )
        p_fault_topics = declare(self, "fault_topics", DEFAULT_FAULT_TOPICS, "topics the fault_* settings apply to")
        check_choice("scenario", p_scenario, tuple(sorted(SCENARIOS)))
        overrides = {"rate_bps": p_rate > 0.0, "per": p_per >= 0.0, "rtt_s": p_rtt >= 0.0}
        if p_trace:
            used = [k for k, v in overrides.items() if v]
            if used:
                raise ValueError(f"parameter(s) {', '.join(used)} cannot be combined with trace_file")
            channel: ChannelState | ChannelTrace = ChannelTrace.load(p_trace)
        else:
            state = scenario(p_scenario)
            if overrides["rate_bps"]:
                state = replace(state, rate_bps=p_rate, downlink_rate_bps=p_rate)
            if overrides["per"]:
                state = replace(state, per=p_per)
            if overrides["rtt_s"]:
                state = replace(state, rtt_s=p_rtt)
            channel = state
        robot_ns = _check_namespace("robot_namespace", p_robot)
        edge_ns = _check_namespace("edge_namespace", p_edge)
        if robot_ns == edge_ns:
            raise ValueError("parameters robot_namespace and edge_namespace must differ")
        routes = [(Direction.UPLINK, parse_topic_spec(s)) for s in p_up]
        routes += [(Direction.DOWNLINK, parse_topic_spec(s)) for s in p_down]
        names = [name for _, (name, _) in routes]
        if len(set(names)) != len(names):
            raise ValueError(
                f"parameters uplink_topics/downlink_topics: a topic is listed twice: {names}"
            )
        unknown = sorted(set(p_best_effort) - set(names))
        if unknown:
            raise ValueError(f"parameter best_effort_topics: {unknown} not in uplink/downlink_topics")
        best_effort = set(p_best_effort)
        unknown = sorted(set(p_fault_topics) - set(names))
        if unknown:
            raise ValueError(f"parameter fault_topics: {unknown} not in uplink/downlink_topics")
        self._fault_topic_names = list(p_fault_topics)
        self._fault_topics = set(p_fault_topics) if p_faults.active else set()

        self._t_start = time.monotonic()
        self._emu = LinkEmulator(channel, mtu_bytes=p_mtu, seed=p_seed,
                                 trace_origin_s=self._origin_monotonic(p_origin))
        self._faults = FaultInjector(p_faults, seed=p_seed, origin_s=self._t_start)
        self._queue: DeliveryQueue = DeliveryQueue()
        self._cv = threading.Condition()
        self._stopping = False
        self.relayed = {name: 0 for name in names}
        self.dropped = {name: 0 for name in best_effort}
        self.faulted: dict[str, int] = {}

        self._subs = []
        for direction, (name, msg_type) in routes:
            reliable = name not in best_effort
            qos = reliable_qos(p_depth) if reliable else best_effort_qos(p_depth)
            src, dst = (robot_ns, edge_ns) if direction is Direction.UPLINK else (edge_ns, robot_ns)
            pub = self.create_publisher(msg_type, f"{dst}/{name}", qos)
            callback = partial(self._on_message, name, pub, direction, reliable)
            self._subs.append(
                self.create_subscription(msg_type, f"{src}/{name}", callback, qos, raw=True)
            )
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._thread = threading.Thread(target=self._deliver_loop, name="link_delivery", daemon=True)
        self._thread.start()
        what = f"trace {p_trace}" if p_trace else f"{channel}"
        self.get_logger().info(
            f"emulating {what}, mtu {p_mtu} B, seed {p_seed}; {robot_ns} <-> {edge_ns}: "
            + ", ".join(f"{n} ({d.value})" for d, (n, _) in routes)
        )

    def _origin_monotonic(self, origin_unix_s: float) -> float:
        """Monotonic time of trace time 0 (``origin_unix_s`` 0 means node start)."""
        if origin_unix_s == 0.0:
            return self._t_start
        return time.monotonic() - (time.time() - origin_unix_s)

    def _on_set_parameters(self, params) -> SetParametersResult:
        for p in params:
            if p.name not in ("trace_origin_unix_s", "fault_outages"):
                return SetParametersResult(successful=False,
                                           reason=f"{p.name} is read at start only; restart the node")
        for p in params:
            if p.name == "fault_outages":  # set at run time: the windows start from now
                try:
                    outages = parse_outages(x for x in str(p.value).split(",") if x.strip())
                    faults = replace(self._faults.faults, outages=outages)
                except ValueError as exc:
                    return SetParametersResult(successful=False, reason=f"fault_outages: {exc}")
                with self._cv:
                    self._faults.faults, self._faults.origin_s = faults, time.monotonic()
                    if faults.active:
                        self._fault_topics = set(self._fault_topic_names)
                self.get_logger().info(f"fault_outages set: {outages} (s from now)")
                continue
            value = float(p.value)
            if not math.isfinite(value) or value < 0.0:
                return SetParametersResult(successful=False, reason="trace_origin_unix_s must be >= 0")
            with self._cv:
                self._emu.trace_origin_s = self._origin_monotonic(value)
        return SetParametersResult(successful=True)

    def _on_message(self, name: str, pub, direction: Direction, reliable: bool, data: bytes,
                    info) -> None:
        # The link starts at the middleware's reception, not when an executor thread got to
        # this callback (a busy CPU would add that wait to the emulated delay).
        now = _received_monotonic(info)
        with self._cv:
            delivery = self._emu.send(len(data), now, direction, reliable=reliable)
            if delivery.lost:
                self.dropped[name] += 1
                return
            times = [delivery.deliver_at]
            if name in self._fault_topics:
                times = self._faults.apply(name, now, delivery.deliver_at)
                if not times:
                    self.faulted[name] = self.faulted.get(name, 0) + 1
            for at in times:
                self._queue.push(at, (name, pub, data))
            self._cv.notify()

    def _deliver_loop(self) -> None:
        while True:
            with self._cv:
                if self._stopping:
                    return
                due = self._queue.pop_due(time.monotonic())
                if not due:
                    deadline = self._queue.next_deadline()
                    self._cv.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                    continue
            for name, pub, data in due:
                try:
                    pub.publish(data)
                except Exception:  # noqa: BLE001 - only tolerated while shutting down
                    if self.context.ok():
                        raise
                    return
                self.relayed[name] += 1

    def destroy_node(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=1.0)
        summary = f"relayed per topic: {self.relayed}; dropped: {self.dropped}"
        if self._fault_topics:
            summary += f"; faults: {self._faults.counts}, dropped by faults per topic: {self.faulted}"
        if self.context.ok():
            self.get_logger().info(summary)
        else:  # after a signal the context is shut down: rosout is gone, the console is not
            print(f"[INFO] [{self.get_fully_qualified_name()}]: {summary}", file=sys.stderr, flush=True)
        super().destroy_node()


def main(args=None) -> None:
    """Console script ``link_emulator_node``."""
    sys.setswitchinterval(0.0005)  # the delivery thread gets the GIL quickly when a message is due
    run_node(LinkEmulatorNode, args=args)


if __name__ == "__main__":
    main()
