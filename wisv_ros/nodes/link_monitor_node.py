"""link_monitor_node: measures the robot-edge link with pings and publishes ``channel_state``.

One executable, two roles (parameter ``role``):

- ``robot`` (default): every ``ping_period_s`` publishes a :class:`LinkPing` on ``link_ping``,
  alternating a small (``small_ping_bytes`` of padding) and a large (``large_ping_bytes``)
  one; receives the echoes on ``link_ping_echo``; feeds send and echo times
  (``time.monotonic()``) to :class:`wisv_ros.link.estimator.LinkEstimator`; every
  ``publish_period_s`` publishes the estimate on ``channel_state`` (source = this node's fully
  qualified name, samples = ping round trips used). Nothing is published before RTT, rate and
  PER all have a sample (one small and one large echo).
- ``edge``: answers each ``link_ping`` at once on ``link_ping_echo`` with the same ``seq`` and
  ``sent_at`` and *no* padding, so the echo is small and the large-vs-small difference measures
  the uplink only.

Start one per side, each in its namespace (e.g. ``-r __ns:=/robot`` and ``-r __ns:=/edge
-p role:=edge``), with the link (or ``link_emulator_node``) in between. What the estimates mean
-- RTT includes the middleware's latency (a few ms here), the rate is the raw rate from
loss-free large pings and includes the middleware's per-byte cost (so rates of hundreds of
Mbit/s read low on loopback), PER comes from lost best-effort small pings (or, with
``ping_qos: reliable``, from late ones) -- is documented in :mod:`wisv_ros.link.estimator`.
The pings cost link capacity: a 64 kB large ping every 0.4 s is 1.3 Mbit/s, 6 % of a
20 Mbit/s link.

Timing under CPU load: a ping's send time is taken just before it is published, an echo's
receive time is the middleware's reception stamp (before the echo waits for an executor thread),
and the echo (both roles), the ping timer and the publication each run in a callback group of
their own. The RTT is the low cluster of a 16-ping window within a 2 ms allowance of its
fastest sample: delays only ever add to the true RTT, so the fastest samples are the truth.

Parameters (robot role unless noted; all read at start): ``role``, ``ping_qos`` (both roles),
``ping_period_s``, ``small_ping_bytes``, ``large_ping_bytes``, ``publish_period_s``,
``ping_timeout_s``, ``rtt_window``, ``rate_window``, ``per_window``, ``late_factor``,
``jitter_allowance_s``; each is declared with a description and range.

QoS: pings and echoes best-effort keep-last 10 by default (``ping_qos``; both sides and the
emulator's ``best_effort_topics`` must agree); ``channel_state`` reliable, transient-local,
keep-last 1 (a late subscriber gets the latest estimate at once).
"""

from __future__ import annotations

import sys
import threading
import time

from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.duration import Duration

from wisv_ros.link.estimator import LinkEstimator, PingKind
from wisv_ros.msg import ChannelState, LinkPing
from wisv_ros.nodes.common import check_choice, declare, reliable_qos, run_node

__all__ = ["LinkMonitorNode", "STATE_QOS", "best_effort_qos", "main"]

ROLES = ("robot", "edge")
PING_QOS = ("best_effort", "reliable")


def best_effort_qos(depth: int = 10) -> QoSProfile:
    """Best-effort, keep-last ``depth``, volatile (the default QoS of the pings)."""
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST,
        depth=depth,
        reliability=ReliabilityPolicy.BEST_EFFORT,
        durability=DurabilityPolicy.VOLATILE,
    )

STATE_QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST,
    depth=1,
    reliability=ReliabilityPolicy.RELIABLE,
    durability=DurabilityPolicy.TRANSIENT_LOCAL,
)


def _received_monotonic(info) -> float:
    """When the middleware received a message, on ``time.monotonic()``.

    The middleware's reception stamp (wall clock, ns) is taken before the message waits for an
    executor thread, so a busy CPU delaying the callback does not inflate the measured delay.
    Falls back to now when the middleware gives no stamp.
    """
    now = time.monotonic()
    try:
        received_ns = int(info["received_timestamp"])
    except (KeyError, TypeError, ValueError):
        return now
    if received_ns <= 0:
        return now
    waited = (time.time_ns() - received_ns) / 1e9
    return now - min(max(waited, 0.0), 1.0)  # clamped: a wall-clock jump must not fake delays


class LinkMonitorNode(Node):
    """Robot role: ping sender and channel estimator; edge role: ping echo."""

    def __init__(self) -> None:
        super().__init__("link_monitor")
        self.role = declare(self, "role", "robot",
                            "robot: send pings and publish channel_state; edge: echo pings",
                            choices=ROLES)
        check_choice("role", self.role, ROLES)
        ping_qos = declare(self, "ping_qos", "best_effort",
                            "QoS of link_ping/link_ping_echo (same on both sides); best_effort: "
                            "PER from lost pings, reliable: PER from late pings", choices=PING_QOS)
        check_choice("ping_qos", ping_qos, PING_QOS)
        qos = best_effort_qos() if ping_qos == "best_effort" else reliable_qos()
        if self.role == "edge":
            self._echo_pub = self.create_publisher(LinkPing, "link_ping_echo", qos)
            self.create_subscription(LinkPing, "link_ping", self._on_ping, qos)
            self.get_logger().info("echoing link_ping on link_ping_echo")
            return

        period = declare(self, "ping_period_s", 0.2, "time between pings (s); sizes alternate",
                         lo=0.001, hi=60.0)
        small = declare(self, "small_ping_bytes", 0, "padding of a small ping (bytes)",
                        lo=0, hi=1 << 20)
        large = declare(self, "large_ping_bytes", 64000,
                        "padding of a large ping (bytes, > small_ping_bytes)", lo=1, hi=64 << 20)
        publish_period = declare(self, "publish_period_s", 0.5,
                                 "time between channel_state messages (s)", lo=0.001, hi=60.0)
        timeout = declare(self, "ping_timeout_s", 2.0, "a ping not echoed in this time is lost (s)",
                          lo=0.001, hi=600.0)
        rtt_window = declare(self, "rtt_window", 16, "small pings in the RTT's low-cluster filter",
                             lo=1, hi=10000)
        rate_window = declare(self, "rate_window", 8,
                              "large (and small) pings in the rate filter", lo=1, hi=10000)
        per_window = declare(self, "per_window", 50, "small pings in the PER window", lo=1, hi=100000)
        late_factor = declare(self, "late_factor", 0.75,
                              "a small ping later than rtt * (1 + late_factor) counts as lost; "
                              "keep it below the link's RTO / RTT - 1", lo=0.0, hi=100.0)
        jitter = declare(self, "jitter_allowance_s", 0.002,
                         "middleware jitter tolerated by the RTT/rate filters (s)", lo=0.0, hi=10.0)
        if large <= small:
            raise ValueError(
                f"parameter large_ping_bytes ({large}) must be > small_ping_bytes ({small})"
            )
        self._estimator = LinkEstimator(
            small, large, late_factor=late_factor, late_min_s=jitter, rtt_window=rtt_window,
            rate_window=rate_window, per_window=per_window, timeout_s=timeout,
            per_from_late=ping_qos == "reliable",
        )
        self._padding = {PingKind.SMALL: bytes(small), PingKind.LARGE: bytes(large)}
        self._lock = threading.Lock()
        self._seq = 0
        self._ping_pub = self.create_publisher(LinkPing, "link_ping", qos)
        self._state_pub = self.create_publisher(ChannelState, "channel_state", STATE_QOS)
        # Echoes are timed by the middleware's reception stamp (_received_monotonic), so a ping
        # timer or a channel_state publication running at that moment does not add to the RTT.
        self.create_subscription(LinkPing, "link_ping_echo", self._on_echo, qos)
        self.create_timer(period, self._send_ping)
        self.create_timer(publish_period, self._publish_state)
        self.get_logger().info(
            f"pinging every {period} s ({small} B / {large} B padding), publishing every "
            f"{publish_period} s"
        )

    # ------------------------------------------------------------------ edge role

    def _on_ping(self, ping: LinkPing) -> None:
        echo = LinkPing()
        echo.header = ping.header
        echo.seq = ping.seq
        echo.sent_at = ping.sent_at
        self._echo_pub.publish(echo)

    # ------------------------------------------------------------------ robot role

    def _send_ping(self) -> None:
        kind = PingKind.SMALL if self._seq % 2 == 0 else PingKind.LARGE
        seq = self._seq
        self._seq = (self._seq + 1) % (1 << 32)
        ping = LinkPing()
        ping.header.stamp = self.get_clock().now().to_msg()
        ping.header.frame_id = kind
        ping.seq = seq
        ping.padding = self._padding[kind]
        with self._lock:
            self._estimator.expire(time.monotonic())
        # Timestamped as close to the publication as possible: scheduling delays before this
        # point are not part of the link.
        now = time.monotonic()
        ping.sent_at = now
        with self._lock:
            self._estimator.on_sent(seq, kind, now)
        self._ping_pub.publish(ping)

    def _on_echo(self, echo: LinkPing, info) -> None:
        now = _received_monotonic(info)
        with self._lock:
            rtt = self._estimator.on_echo(echo.seq, now)
        if rtt is not None:
            self.get_logger().debug(
                f"ping {echo.seq} ({echo.header.frame_id}): rtt {rtt * 1e3:.2f} ms"
            )

    def _publish_state(self) -> None:
        with self._lock:
            estimate = self._estimator.estimate()
        if estimate is None:
            return
        ros_now = self.get_clock().now()
        msg = ChannelState()
        msg.header.stamp = ros_now.to_msg()
        msg.rate_bps = estimate.state.rate_bps
        msg.per = estimate.state.per
        msg.rtt_s = estimate.state.rtt_s
        age = max(0.0, time.monotonic() - estimate.measured_at)
        msg.measured_at = (ros_now - Duration(nanoseconds=int(age * 1e9))).to_msg()
        msg.source = self.get_fully_qualified_name()
        msg.samples = estimate.samples
        self._state_pub.publish(msg)


def main(args=None) -> None:
    """Console script ``link_monitor_node``."""
    sys.setswitchinterval(0.0005)  # hand the GIL over quickly: ping times are latency-critical
    run_node(LinkMonitorNode, args=args)


if __name__ == "__main__":
    main()
