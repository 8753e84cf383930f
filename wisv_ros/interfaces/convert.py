"""DraftBlock and Verdict messages <-> the round protocol's ``BlockRequest`` and ``EdgeReply``.

The functions take any object with the message's fields (a generated rclpy message, a message
decoded from a bag by ``rosbags``, or a stand-in in tests), so this module needs no rclpy. Reading a
block checks its tensors (``WireError`` naming the field); the round protocol checks the rest.

No rclpy here.
"""
from __future__ import annotations

import numpy as np

from wisv_ros.interfaces.wire import WireError, fill_hidden, fill_tensor, hidden_head_id, is_empty, read_hidden, read_tensor
from wisv_ros.sd.rounds import PROTOCOLS, BlockRequest, EdgeReply

__all__ = ["HIDDEN_WIRE_DTYPE", "PROTOCOL_CODE", "fill_block", "fill_verdict", "read_block", "read_verdict"]

HIDDEN_WIRE_DTYPE = "float16"  # drafter hiddens on the link (FH blocks and SH replies)
PROTOCOL_CODE = {name: code for code, name in enumerate(PROTOCOLS)}  # DraftBlock.PROTOCOL_IDS/FH/SH
CORRECTION_NONE = -1  # Verdict.CORRECTION_NONE


def read_block(msg, vocab_size: int | None = None) -> BlockRequest:
    """A DraftBlock message as a ``BlockRequest``; WireError names a malformed field.

    vocab_size: needed to read ``draft_probs`` ([K, V]) of method reject.
    """
    if int(msg.protocol) >= len(PROTOCOLS):
        raise WireError(f"protocol: unknown value {msg.protocol}")
    protocol = PROTOCOLS[int(msg.protocol)]
    token_ids = [int(i) for i in msg.token_ids]
    k = len(token_ids)
    hidden, head_id = None, ""
    if protocol == "fh":
        hidden, positions = read_hidden(msg.hidden, "hidden", n=k, positions_below=max(k, 1))
        if positions != list(range(k)):
            raise WireError(f"hidden: positions {positions}, expected 0..{k - 1} under protocol fh")
        head_id = hidden_head_id(msg.hidden)
    elif not is_empty(msg.hidden) or getattr(msg.hidden, "head_id", ""):
        raise WireError(f"hidden: must be empty under protocol {protocol}")
    probs = None
    if not is_empty(msg.draft_probs):
        probs = read_tensor(msg.draft_probs, "draft_probs", shape=[k, vocab_size]).copy()
    return BlockRequest(
        request_id=msg.request_id, round_id=int(msg.round_id), prefix_length=int(msg.prefix_length),
        token_ids=token_ids, k=int(msg.k), protocol=protocol, method=msg.method, tau=float(msg.tau),
        temperature=float(msg.temperature), context_ids=[int(i) for i in msg.context_ids], hidden=hidden,
        draft_probs=probs, draft_time_s=float(msg.draft_time_s), copy_budget=int(msg.copy_budget), head_id=head_id)


def fill_block(msg, req: BlockRequest) -> None:
    """Write a ``BlockRequest`` into a DraftBlock message (hiddens, or the projections of ``head_id``,
    only under fh, as float16)."""
    msg.request_id = req.request_id
    msg.round_id = req.round_id
    msg.prefix_length = req.prefix_length
    msg.context_ids = list(req.context_ids)
    msg.token_ids = list(req.token_ids)
    msg.k = req.k
    msg.protocol = PROTOCOL_CODE[req.protocol]
    msg.method = req.method
    msg.tau = float(req.tau)
    msg.temperature = float(req.temperature)
    if req.protocol == "fh":
        fill_hidden(msg.hidden, req.hidden, dtype=HIDDEN_WIRE_DTYPE, head_id=req.head_id)
    if req.draft_probs is not None:
        # float32: the acceptance ratio must use the distribution the drafter sampled from.
        fill_tensor(msg.draft_probs, np.asarray(req.draft_probs, np.float32), "float32", "draft_probs")
    msg.draft_time_s = float(req.draft_time_s)
    msg.copy_budget = int(req.copy_budget)


def read_verdict(msg) -> EdgeReply:
    """A Verdict message as an ``EdgeReply``."""
    return EdgeReply(request_id=msg.request_id, round_id=int(msg.round_id), accepted=int(msg.accepted),
                     correction_id=int(msg.correction_id), committed_ids=[int(i) for i in msg.committed_ids],
                     committed_length=int(msg.committed_length), copy_rounds=int(msg.copy_rounds),
                     copy_committed=int(msg.copy_committed), edge_time_s=float(msg.edge_time_s), error=msg.error,
                     # (getattr: Verdicts recorded in bags before the two fields existed)
                     edge_token_s=float(getattr(msg, "edge_token_s", 0.0)), edge_load=float(getattr(msg, "edge_load", 0.0)))


def fill_verdict(msg, reply: EdgeReply) -> None:
    """Write an ``EdgeReply`` into a Verdict message."""
    msg.request_id, msg.round_id = reply.request_id, reply.round_id
    msg.error = reply.error
    msg.edge_token_s, msg.edge_load = float(reply.edge_token_s), float(reply.edge_load)
    if reply.error:
        msg.correction_id = CORRECTION_NONE
        return
    msg.accepted = reply.accepted
    msg.correction_id = reply.correction_id
    msg.committed_ids = list(reply.committed_ids)
    msg.committed_length = reply.committed_length
    msg.copy_rounds = reply.copy_rounds
    msg.copy_committed = reply.copy_committed
    msg.edge_time_s = float(reply.edge_time_s)
