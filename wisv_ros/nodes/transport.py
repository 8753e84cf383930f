"""The round protocol's transports over DDS topics: the robot's ``DdsLink`` (a ``rounds.EdgeLink``) and
the edge's ``HiddenFetch`` (SH: drafter hiddens on request)."""
from __future__ import annotations

import threading
import time

import numpy as np

from wisv_ros.interfaces.convert import HIDDEN_WIRE_DTYPE, fill_block, read_verdict
from wisv_ros.interfaces.wire import WireError, fill_hidden, hidden_head_id, read_hidden
from wisv_ros.nodes.common import msg_bytes, stamp_now
from wisv_ros.sd.rounds import BlockRequest, EdgeReply
from wisv_ros.wisv.head import ProjectedHidden

__all__ = ["DdsLink", "HiddenFetch"]


class DdsLink:
    """``rounds.EdgeLink`` over the node's topics: publish a block, wait for its verdict; counts the
    bytes on the link (blocks, verdicts and the SH exchange) and the round-trip time."""

    def __init__(self, node):
        self.node = node
        self.cv = threading.Condition()
        self.awaiting: tuple[str, int] | None = None
        self.verdict = None
        self.totals = {"up": 0, "down": 0, "round_trip_s": 0.0, "hidden_requests": 0}
        self.last_block: tuple | None = None  # (request_id, round_id, hiddens, head_id) of the block in flight

    def exchange(self, req: BlockRequest, timeout_s: float) -> EdgeReply | None:
        node = self.node
        msg = node._DraftBlock()
        stamp_now(node, msg.header)
        fill_block(msg, req)
        with self.cv:
            self.awaiting, self.verdict = (req.request_id, req.round_id), None
            self.last_block = (req.request_id, req.round_id, req.hidden, req.head_id)
        self.count(up=msg_bytes(msg))
        t0 = time.perf_counter()
        node._block_pub.publish(msg)
        with self.cv:
            self.cv.wait_for(lambda: self.verdict is not None, timeout_s)
            verdict, self.awaiting = self.verdict, None
            if verdict is not None:
                self.totals["round_trip_s"] += time.perf_counter() - t0
        if verdict is None:
            return None
        self.count(down=msg_bytes(verdict))
        return read_verdict(verdict)

    def edge_present(self) -> bool:
        return self.node._block_pub.get_subscription_count() > 0

    def offer(self, msg) -> bool:
        """A verdict from the topic: True if it is the one awaited."""
        with self.cv:
            if self.awaiting == (msg.request_id, msg.round_id) and self.verdict is None:
                self.verdict = msg
                self.cv.notify_all()
                return True
        return False

    def answer_hidden_request(self, msg) -> None:
        """SH, robot side: send the asked rows of the last block's hiddens, or of their projections (HiddenReply)."""
        node, last = self.node, self.last_block
        if last is None or (last[0], last[1]) != (msg.request_id, msg.round_id):
            node.get_logger().warning(f"hidden request for request {msg.request_id} round {msg.round_id}: not the last block; ignored")
            return
        hidden = last[2]
        if hidden is None:
            node.get_logger().warning(f"hidden request for request {msg.request_id} round {msg.round_id}: the block has no hiddens; ignored")
            return
        positions = [int(p) for p in msg.positions]
        if any(not 0 <= p < hidden.shape[0] for p in positions):
            node.get_logger().warning(f"hidden request positions {positions} outside the block of {hidden.shape[0]}; ignored")
            return
        reply = node._HiddenReply()
        stamp_now(node, reply.header)
        reply.request_id, reply.round_id = msg.request_id, msg.round_id
        fill_hidden(reply.hidden, hidden[positions], positions, HIDDEN_WIRE_DTYPE, head_id=last[3])
        self.count(up=msg_bytes(reply), down=msg_bytes(msg), hidden_requests=1)
        node._reply_pub.publish(reply)

    def count(self, up: int = 0, down: int = 0, hidden_requests: int = 0) -> None:
        with self.cv:
            self.totals["up"] += up
            self.totals["down"] += down
            self.totals["hidden_requests"] += hidden_requests


class HiddenFetch:
    """The edge's side of SH: a HiddenRequest for the mismatch positions, then a bounded wait for the
    HiddenReply (``fetch`` is ``EdgeSessions.handle``'s ``fetch_hidden``); counts the exchange's
    bytes and wait in ``sh`` (reset per round by ``new_round``)."""

    def __init__(self, node):
        self.node = node
        self.cv = threading.Condition()
        self.awaiting: tuple[str, str, int] | None = None  # (robot, request, round)
        self.reply = None
        self.sh = {"up": 0, "down": 0, "wait_s": 0.0}

    def new_round(self) -> dict:
        self.sh = {"up": 0, "down": 0, "wait_s": 0.0}
        return self.sh

    def fetch(self, req, positions: list[int]):
        """SH: the drafter's hiddens at ``positions`` as a [k, d] array (zeros elsewhere), a
        ``ProjectedHidden`` of it when the reply names a head (``head_id``); None if they do not arrive."""
        node = self.node
        rid, rnd, k = req.request_id, req.round_id, len(req.token_ids)
        msg = node._HiddenRequest()
        stamp_now(node, msg.header)
        msg.request_id, msg.round_id, msg.positions = rid, rnd, positions
        timeout = float(node.get_parameter("hidden_request_timeout_s").value)
        t0 = time.perf_counter()
        with self.cv:
            self.awaiting, self.reply = (req.robot, rid, rnd), None
        self.sh["down"] += msg_bytes(msg)
        node._request_pub[req.robot].publish(msg)
        with self.cv:
            self.cv.wait_for(lambda: self.reply is not None, timeout)
            reply, self.awaiting = self.reply, None
        self.sh["wait_s"] += time.perf_counter() - t0
        if reply is None:
            node.get_logger().warning(f"request {rid} round {rnd}: no hidden reply within {timeout} s; rejecting the mismatches")
            return None
        self.sh["up"] += msg_bytes(reply)
        try:
            h, got = read_hidden(reply.hidden, "hidden_reply.hidden", n=len(positions), positions_below=k)
            head_id = hidden_head_id(reply.hidden, "hidden_reply.hidden")
        except WireError as exc:
            node.get_logger().warning(f"request {rid} round {rnd}: {exc}; rejecting the mismatches")
            return None
        if got != list(positions):
            node.get_logger().warning(f"request {rid} round {rnd}: hidden reply positions {got} != requested {positions}")
            return None
        full = np.zeros((k, h.shape[1]), np.float32)
        full[positions] = h
        return ProjectedHidden(full, head_id) if head_id else full

    def offer(self, msg, robot: str = "") -> None:
        """A HiddenReply that came on ``robot``'s topic: taken only for that robot's own awaited round."""
        node = self.node
        with self.cv:
            if self.awaiting == (robot, msg.request_id, msg.round_id) and self.reply is None:
                self.reply = msg
                self.cv.notify_all()
                return
        node.get_logger().info(f"ignoring hidden reply for request {msg.request_id} round {msg.round_id} (stale)")
