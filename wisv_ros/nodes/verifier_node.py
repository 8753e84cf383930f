"""verifier_node (edge): verifies draft blocks with the target model (``wisv_ros.decoding.Verifier``).

Topics (relative names; QoS ``common.RELIABLE_QOS``: reliable, keep-last 10, volatile):
  subscribes ``draft_block`` (DraftBlock), ``hidden_reply`` (HiddenReply),
             ``channel_state`` (ChannelState), with a deadline of ``channel_deadline_s``: when no
             channel state arrived for that long a warning is logged (once per silence), never
             fatal; the head keeps using the last state (``default_channel`` before the first).
             The deadline is checked by a timer, not by the DDS deadline QoS: a requested DDS
             deadline makes every publisher that offers none (the link monitor's transient-local
             publisher, a user's node, a bag replay) incompatible, and its messages would be lost.
  publishes  ``verdict`` (Verdict), ``hidden_request`` (HiddenRequest), ``round_stats`` (RoundStats)

One core ``Verifier`` per request id (the newest ``max_requests`` are kept); the target model is
shared. A block carrying ``context_ids`` (re)starts its request from that context; a block of an
unknown request without them gets ``Verdict.error = "unknown request <id>: resend context"``.
Malformed blocks (wrong hidden dtype/shape, NaN, prefix_length mismatch, duplicate or out-of-order
round_id, unknown method/protocol, ids outside the vocabulary) get a Verdict with ``error``.
Idempotent resends: the last verdict of each request is kept; a block with the round_id, prefix_length
and token_ids of the last verified round (the drafter resends a block whose verdict it did not get in
time, see drafter_node ``verdict_retries``) is answered with that verdict again, not verified twice.

SwitchSD copy mode (parameter ``copy``: off | ngram | probe): after verifying a block, while the
context's last ``copy_kappa`` tokens occurred earlier (and, with ``probe``, the copy probe fires on
the target's hidden state at the last committed position), the verifier drafts up to
``copy_width`` continuations of ``copy_depth`` tokens from the context and verifies them in one
tree pass (``Verifier.copy_round``), with no round trip to the robot; at most
``copy_max_rounds`` rounds and the block's ``copy_budget`` tokens. The copied tokens end the
verdict's ``committed_ids`` (``copied_count``, ``copy_rounds``) and the robot's drafter catches up
on its next pass. Copy rounds accept greedily (greedy, wisv) or by speculative sampling at the
block's temperature (reject), so rejection SD stays exact.

Threads: the node spins one executor thread (``common.run_node``) whose callbacks never block: the
block callback queues the block, and one verification thread takes blocks in arrival order and
runs the target; hidden replies and channel states are handled by the executor meanwhile.
Under protocol SH with method wisv, the decision head's input is fetched when the core asks for it
(mismatches exist and tau > 0): HiddenRequest with the mismatch positions, then a wait of at most
``hidden_request_timeout_s`` for the HiddenReply; without a reply the mismatches are rejected
(lossless). The WISV decision head is an ONNX file (``head_path``, see ``wisv_ros.head``); with
none, or without drafter hiddens (protocol ids), method wisv rejects every mismatch, i.e. behaves as
greedy (logged once).
"""
from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time

import numpy as np
from rclpy.node import Node

from ..decoding import DraftBlock as CoreBlock
from ..decoding import Method, Verifier
from ..link import SCENARIOS
from ..link import ChannelState as LinkChannel
from ..models import WEIGHT_DTYPES, resolve_dtype
from ..wire import UNKNOWN_REQUEST, WireError, is_empty, read_hidden, read_tensor
from .common import RELIABLE_QOS, declare, frozen_after_start, msg_bytes, run_node, stamp_age_s, stamp_now

__all__ = ["VerifierNode", "main"]

_PROTO_NAME = {0: "ids", 1: "fh", 2: "sh"}  # DraftBlock.PROTOCOL_*
COPY_MODES = ("off", "ngram", "probe")


class BlockError(ValueError):
    """The block cannot be verified; the message goes into Verdict.error."""


@dataclasses.dataclass
class _Session:
    verifier: Verifier
    last_round: int
    # The verdict given to ``last_round`` and what identifies that block (prefix_length, token_ids):
    # a resent block of that round (the drafter's verdict timed out) gets the same verdict again.
    last_verdict: object = None
    last_key: tuple | None = None


class VerifierNode(Node):
    def __init__(self, **kwargs):
        super().__init__("verifier_node", **kwargs)
        from ..models import DEFAULT_TARGET

        declare(self, "target_model", DEFAULT_TARGET, "target model spec: registry name, HF folder, .gguf file or tiny-random:<seed>:<vocab>")
        declare(self, "target_dtype", "auto", "dtype of the target weights (auto: bfloat16 on CPUs with AMX-BF16/AVX512-BF16, else float32)", choices=WEIGHT_DTYPES)
        declare(self, "method", "greedy", "acceptance rule for blocks whose method field is empty", choices=("greedy", "reject", "wisv"))
        declare(self, "hidden_request_timeout_s", 2.0, "SH: wait this long for the drafter's hidden states (s)", lo=0.001, hi=600.0)
        declare(self, "channel_deadline_s", 1.0, "channel_state must arrive at least this often, else a warning is logged (s; 0 = no deadline)", lo=0.0, hi=3600.0)
        declare(self, "head_path", "", "WISV decision head (.onnx with its .json sidecar); '' = none: wisv behaves as greedy")
        declare(self, "default_channel", "20mbps_50ms", "channel scenario the head assumes until the first channel_state arrives", choices=tuple(SCENARIOS))
        declare(self, "max_requests", 16, "requests whose verifier state is kept (oldest dropped first)", lo=1, hi=4096)
        declare(self, "seed", 0, "seed of rejection sampling", lo=0, hi=2**31 - 1)
        declare(self, "threads", 1, "torch CPU threads", lo=1, hi=256)
        declare(self, "copy", "off", "SwitchSD copy mode after each block: off; ngram (copy whenever the last copy_kappa "
                "tokens occurred before: the probe-less baseline); probe (only when the copy probe fires too)",
                choices=COPY_MODES)
        declare(self, "probe_path", "", "copy probe (.npz from python -m wisv_ros.cli.probe train), needed by copy=probe")
        declare(self, "copy_kappa", 5, "copy mode: suffix tokens to match in the context (kappa)", lo=1, hi=64)
        declare(self, "copy_width", 4, "copy mode: candidate continuations verified per copy round (W)", lo=1, hi=64)
        declare(self, "copy_depth", 16, "copy mode: tokens per candidate (D)", lo=1, hi=256)
        declare(self, "copy_max_rounds", 32, "copy mode: at most this many copy rounds after one block", lo=1, hi=100000)
        if self._param("copy") not in COPY_MODES:
            raise ValueError(f"parameter copy: '{self._param('copy')}' is not one of {', '.join(COPY_MODES)}")
        if self._param("copy") == "probe" and not self._param("probe_path"):
            raise ValueError("parameter probe_path: copy=probe needs a probe file (.npz); set probe_path or use copy:=ngram")
        if self._param("target_dtype") not in WEIGHT_DTYPES:
            raise ValueError(f"parameter target_dtype: '{self._param('target_dtype')}' is not one of {', '.join(WEIGHT_DTYPES)}")
        if self._param("default_channel") not in SCENARIOS:
            raise ValueError(f"parameter default_channel: '{self._param('default_channel')}' is not one of {', '.join(SCENARIOS)}")
        if self._param("method") not in ("greedy", "reject", "wisv"):
            raise ValueError(f"parameter method: '{self._param('method')}' is not one of greedy, reject, wisv")
        self.add_on_set_parameters_callback(frozen_after_start(
            {"target_model", "target_dtype", "threads", "channel_deadline_s", "head_path", "copy", "probe_path"},
            {"method": ("greedy", "reject", "wisv"), "default_channel": tuple(SCENARIOS)},
        ))

        from ..msg import ChannelState, DraftBlock, HiddenReply, HiddenRequest, RoundStats, Verdict

        self._Verdict, self._HiddenRequest, self._RoundStats = Verdict, HiddenRequest, RoundStats
        self._verdict_pub = self.create_publisher(Verdict, "verdict", RELIABLE_QOS)
        self._request_pub = self.create_publisher(HiddenRequest, "hidden_request", RELIABLE_QOS)
        self._stats_pub = self.create_publisher(RoundStats, "round_stats", RELIABLE_QOS)
        self._blocks: queue.Queue = queue.Queue()  # (message, perf_counter at reception)
        self.create_subscription(DraftBlock, "draft_block", self._queue_block, RELIABLE_QOS)
        self.create_subscription(HiddenReply, "hidden_reply", self._on_hidden_reply, RELIABLE_QOS)
        self.create_subscription(ChannelState, "channel_state", self._on_channel_state, RELIABLE_QOS)
        deadline = float(self._param("channel_deadline_s"))
        self._channel_at = time.monotonic()  # the deadline runs from the start
        self._channel_silent = False
        if deadline > 0:
            self.create_timer(deadline / 4, self._check_channel_deadline)

        self._lm = None
        self._load_error: str | None = None
        self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()
        self._channel: LinkChannel | None = None  # latest channel state (input of the WISV head)
        self._head_judge = None  # wisv_ros.head.make_judge(...) once the head is loaded
        self._probe = None  # wisv_ros.probe.CopyProbe with copy=probe
        self._copy = None  # wisv_ros.decoding.CopyConfig unless copy=off
        self._warned: set[str] = set()
        self._hcv = threading.Condition()
        self._h_awaiting: tuple[str, int] | None = None
        self._verifying: tuple[str, int] | None = None
        self._h_reply = None
        self._round_extra = {"up": 0, "down": 0, "wait_s": 0.0}
        threading.Thread(target=self._load, name="load_model", daemon=True).start()
        self._verify_thread = threading.Thread(target=self._verify_loop, name="verify", daemon=True)
        self._verify_thread.start()

    def _param(self, name):
        return self.get_parameter(name).value

    def _load(self) -> None:
        try:
            import torch

            from ..lm import CausalLM
            from ..models import load_model

            torch.set_num_threads(int(self._param("threads")))
            spec = self._param("target_model")
            t0 = time.perf_counter()
            dtype = resolve_dtype(self._param("target_dtype"))
            model, tok = load_model(spec, dtype=dtype)
            capture = []
            if self._param("copy") == "probe":
                from ..probe import load_probe

                self._probe = load_probe(self._param("probe_path"))
                capture = [(self._probe.layer, self._probe.kind)]
            lm = CausalLM(model, tok, capture=capture)
            if self._probe is not None and self._probe.d_model != lm.hidden_size:
                raise ValueError(f"probe {self._param('probe_path')} expects hidden size {self._probe.d_model}, the target has {lm.hidden_size}")
            head_path = self._param("head_path")
            if head_path:
                from ..head import OnnxHead, make_judge

                head = OnnxHead(head_path)
                if head.d_target != lm.hidden_size:
                    raise ValueError(f"head {head_path} expects target hidden size {head.d_target}, the target has {lm.hidden_size}")
                self._head_judge = make_judge(head, self._channel_state)
            self._copy = self._copy_config()
            with torch.no_grad():  # warm-up: the first pass pages the weights in and sets up the kernels
                model(torch.zeros((1, 8), dtype=torch.long))
            self._lm = lm
            self.get_logger().info(f"target {spec} ({dtype}) loaded and warmed up in {time.perf_counter() - t0:.1f} s"
                                   + (f"; decision head {head_path}" if head_path else "; no decision head"))
        except Exception as exc:
            self._load_error = f"{type(exc).__name__}: {exc}"
            self.get_logger().error(f"loading the target failed: {self._load_error}")

    # ------------------------------------------------------------------ channel state
    def _on_channel_state(self, msg) -> None:
        try:
            self._channel = LinkChannel(rate_bps=msg.rate_bps, per=msg.per, rtt_s=msg.rtt_s)
        except (TypeError, ValueError) as exc:
            self.get_logger().warning(f"ignoring channel_state: {exc}")
            return
        self._channel_at = time.monotonic()
        if self._channel_silent:
            self._channel_silent = False
            self.get_logger().info("channel_state is arriving again")

    def _check_channel_deadline(self) -> None:
        deadline = float(self._param("channel_deadline_s"))
        silent_s = time.monotonic() - self._channel_at
        if silent_s > deadline and not self._channel_silent:
            self._channel_silent = True
            self.get_logger().warning(
                f"channel_state deadline missed: none for {silent_s:.2f} s (deadline {deadline} s); "
                + ("the WISV head keeps the last channel state" if self._channel is not None
                   else f"the WISV head assumes {self._param('default_channel')}")
            )

    def _channel_state(self) -> LinkChannel:
        """The channel the WISV head sees: the latest channel_state, else ``default_channel``."""
        return self._channel if self._channel is not None else SCENARIOS[self._param("default_channel")]

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.get_logger().warning(text)

    # ------------------------------------------------------------------ blocks
    def _resent_verdict(self, msg):
        """The verdict already given to this block if ``msg`` is a resend of the last verified round."""
        session = self._sessions.get(msg.request_id)
        if (session is None or session.last_verdict is None or int(msg.round_id) != session.last_round
                or session.last_key != (int(msg.prefix_length), tuple(int(i) for i in msg.token_ids))):
            return None
        return session.last_verdict

    def _remember(self, msg, verdict) -> None:
        if self._verifying != (msg.request_id, int(msg.round_id)):
            return  # refused before verification (duplicate, malformed, unknown): nothing to keep
        session = self._sessions.get(msg.request_id)
        if session is not None and session.last_round == int(msg.round_id):
            session.last_verdict = verdict
            session.last_key = (int(msg.prefix_length), tuple(int(i) for i in msg.token_ids))

    def _queue_block(self, msg) -> None:
        self._blocks.put((msg, time.perf_counter()))

    def destroy_node(self) -> None:
        """Stop the verification thread (after the block it is on) before the node goes.

        A thread that has run target passes and is still alive when the interpreter exits makes the
        process abort ("terminate called without an active exception"), seen after a demo goal.
        """
        self._blocks.put(None)
        self._verify_thread.join(timeout=30.0)
        super().destroy_node()

    def _verify_loop(self) -> None:
        """The verification thread: blocks in arrival order; an exception never ends it; None stops it."""
        while True:
            item = self._blocks.get()
            if item is None:
                return
            msg, t_recv = item
            try:
                self._on_block(msg, t_recv)
            except Exception as exc:  # noqa: BLE001 - e.g. publishing while the node shuts down
                if not self.context.ok():  # shutting down: the round's verdict has nowhere to go
                    return
                self.get_logger().error(f"request {msg.request_id} round {msg.round_id}: {exc!r}")

    def _on_block(self, msg, t_recv: float) -> None:
        resent = self._resent_verdict(msg)
        if resent is not None:  # idempotent: the drafter missed (or timed out on) this verdict
            self.get_logger().info(f"request {msg.request_id} round {msg.round_id}: block resent; "
                                   "publishing its verdict again")
            stamp_now(self, resent.header)
            self._verdict_pub.publish(resent)
            return
        self._verifying = None  # (request, round) once this block passed the checks
        uplink_s = stamp_age_s(self, msg.header.stamp)
        self._round_extra = {"up": 0, "down": 0, "wait_s": 0.0}
        try:
            verdict, core_block, core_verdict, proto, copies = self._verify(msg)
        except ValueError as exc:  # BlockError, WireError and the core's own checks
            self._publish_error(msg, str(exc))
            return
        except Exception as exc:  # never crash on a block
            self.get_logger().error(f"verifying request {msg.request_id} round {msg.round_id} failed: {exc!r}")
            self._publish_error(msg, f"internal error: {type(exc).__name__}: {exc}")
            return
        verdict.edge_time_s = max(0.0, time.perf_counter() - t_recv - self._round_extra["wait_s"])
        stamp_now(self, verdict.header)
        self._remember(msg, verdict)
        self._verdict_pub.publish(verdict)
        stats = self._RoundStats()
        stamp_now(self, stats.header)
        stats.request_id, stats.round_id = msg.request_id, msg.round_id
        stats.drafted = len(core_block.token_ids)
        stats.accepted = core_verdict.accepted_count
        stats.committed = len(core_verdict.committed_ids)
        stats.mismatches = len(core_verdict.mismatches)
        stats.uplink_bytes = msg_bytes(msg) + self._round_extra["up"]
        stats.downlink_bytes = msg_bytes(verdict) + self._round_extra["down"]
        stats.draft_time_s = msg.drafter_time
        stats.comm_time_s = uplink_s + self._round_extra["wait_s"]  # uplink by the stamps + SH exchange
        stats.target_time_s = core_verdict.target_time_s
        stats.head_time_s = max(0.0, core_verdict.head_time_s - self._round_extra["wait_s"])
        stats.round_time_s = uplink_s + (time.perf_counter() - t_recv)
        stats.protocol = proto
        stats.copy_mode = False
        self._stats_pub.publish(stats)
        for c in copies:  # the copy rounds that followed the block (no link traffic of their own)
            cs = self._RoundStats()
            cs.header = stats.header
            cs.request_id, cs.round_id = msg.request_id, msg.round_id
            cs.drafted = cs.accepted = c.accepted_count
            cs.committed = len(c.committed_ids)
            cs.target_time_s = cs.round_time_s = c.target_time_s
            cs.protocol = proto
            cs.copy_mode = True
            self._stats_pub.publish(cs)

    def _publish_error(self, msg, error: str) -> None:
        self.get_logger().warning(f"request {msg.request_id} round {msg.round_id}: {error}")
        v = self._Verdict()
        stamp_now(self, v.header)
        v.request_id, v.round_id = msg.request_id, msg.round_id
        v.correction_id = self._Verdict.CORRECTION_NONE
        v.error = error
        self._remember(msg, v)
        self._verdict_pub.publish(v)

    def _verify(self, msg):
        """Check the block, run the core Verifier; (Verdict msg, core block, core verdict, protocol)."""
        lm = self._lm
        if lm is None:
            raise BlockError(self._load_error or "target model not loaded yet")
        rid, rnd = msg.request_id, int(msg.round_id)
        proto = _PROTO_NAME.get(int(msg.protocol))
        if proto is None:
            raise BlockError(f"protocol: unknown value {msg.protocol}")
        try:
            method = Method.parse(msg.method or self._param("method"))
        except ValueError as exc:
            raise BlockError(f"method: {exc}") from None
        if method == Method.TARGET_ONLY:
            raise BlockError("method: target_only has no verifier")
        if method == Method.REJECT and msg.temperature <= 0:
            raise BlockError(f"temperature: method reject needs > 0, got {msg.temperature}")
        if not np.isfinite(msg.tau) or msg.tau < 0:
            raise BlockError(f"tau: must be finite and >= 0, got {msg.tau}")
        draft = [int(i) for i in msg.token_ids]
        k = len(draft)
        if k == 0:
            raise BlockError("token_ids: empty block")
        self._check_ids("token_ids", draft, lm.vocab_size)
        hidden = None
        if proto == "fh":
            hidden, positions = read_hidden(msg.hidden, "hidden", n=k, positions_below=k)
            if positions != list(range(k)):
                raise BlockError(f"hidden: positions {positions}, expected 0..{k - 1} under protocol fh")
        elif not is_empty(msg.hidden):
            raise BlockError(f"hidden: must be empty under protocol {proto}")
        probs = None
        if method == Method.REJECT:
            import torch

            probs = torch.from_numpy(read_tensor(msg.draft_probs, "draft_probs", shape=[k, lm.vocab_size]).copy())

        context = [int(i) for i in msg.context_ids]
        session = self._sessions.get(rid)
        if context:
            self._check_ids("context_ids", context, lm.vocab_size)
            if len(context) != msg.prefix_length:
                raise BlockError(f"prefix_length {msg.prefix_length} != len(context_ids) {len(context)}")
            if session is not None and rnd <= session.last_round:
                raise BlockError(f"round_id {rnd}: duplicate or out of order (last verified round {session.last_round})")
            verifier = Verifier(lm, method, temperature=msg.temperature or 1.0, tau=msg.tau,
                                judge=self._judge, seed=int(self._param("seed")))
            verifier.begin(context)
            session = _Session(verifier, rnd - 1)
            self._sessions[rid] = session
            while len(self._sessions) > int(self._param("max_requests")):
                self._sessions.popitem(last=False)
        elif session is None:
            raise BlockError(f"{UNKNOWN_REQUEST} {rid}: resend context")
        if rnd <= session.last_round:
            raise BlockError(f"round_id {rnd}: duplicate or out of order (last verified round {session.last_round})")
        v = session.verifier
        if msg.prefix_length != len(v.context):
            raise BlockError(f"prefix_length {msg.prefix_length} does not match the committed length {len(v.context)} on the verifier")
        self._sessions.move_to_end(rid)
        session.last_round = rnd  # a retry of this round is refused even if verification fails
        self._verifying = (rid, rnd)
        v.method, v.tau = method, float(msg.tau)
        v.copy = self._copy
        if method == Method.REJECT:
            v.temperature = float(msg.temperature)
        block = CoreBlock(token_ids=draft, hidden=hidden, probs=probs, prefix_length=int(msg.prefix_length),
                          drafter_time_s=float(msg.drafter_time))
        self._current = (rid, rnd, proto)
        core_verdict = v.verify(block)
        copies = self._copy_rounds(v, core_verdict.committed_ids, int(msg.copy_budget))

        out = self._Verdict()
        out.request_id, out.round_id = rid, rnd
        out.accepted_count = core_verdict.accepted_count
        out.correction_id = core_verdict.correction_id
        copied = [t for c in copies for t in c.committed_ids]
        out.committed_ids = list(core_verdict.committed_ids) + copied
        out.committed_length = len(v.context)
        out.copy_mode = bool(copies)
        out.copied_count = len(copied)
        out.copy_rounds = len(copies)
        return out, block, core_verdict, proto, copies

    def _copy_rounds(self, v: Verifier, committed: list[int], budget: int) -> list:
        """SwitchSD: copy rounds after a block while copy mode holds, at most ``budget`` tokens
        (the last round may pass it: the robot clips) and ``copy_max_rounds`` rounds; none after
        an end-of-sequence token."""
        eos = self._lm.eos_ids()
        if v.copy is None or budget <= 0 or eos.intersection(committed):
            return []
        copies, copied = [], 0
        for _ in range(int(self._param("copy_max_rounds"))):
            c = v.copy_round()
            if c is None:
                break
            copies.append(c)
            copied += len(c.committed_ids)
            if copied >= budget or eos.intersection(c.committed_ids):
                break
        return copies

    def _copy_config(self):
        from ..decoding import CopyConfig

        return CopyConfig.for_mode(self._param("copy"), self._probe, kappa=int(self._param("copy_kappa")),
                                   width=int(self._param("copy_width")), depth=int(self._param("copy_depth")))

    @staticmethod
    def _check_ids(field: str, ids: list[int], vocab: int) -> None:
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise BlockError(f"{field}: ids {bad[:5]} outside the target vocabulary [0, {vocab})")

    # ------------------------------------------------------------------ WISV judge
    def _judge(self, block: CoreBlock, positions: list[int], target_hidden):
        """Rejection probabilities at the mismatch positions (called by the core Verifier)."""
        import torch

        rid, rnd, proto = self._current
        reject_all = torch.ones(len(positions))
        if self._head_judge is None:
            self._warn_once("no-head", "method wisv: no decision head loaded (head_path); every mismatch is rejected (greedy)")
            if proto == "sh":  # still exercise (and account) the SH exchange the protocol implies
                self._fetch_hiddens(rid, rnd, positions, len(block.token_ids))
            return reject_all
        if proto == "sh":
            block.hidden = self._fetch_hiddens(rid, rnd, positions, len(block.token_ids))
        if block.hidden is None:  # protocol ids, or the SH reply did not come
            self._warn_once(f"no-hidden-{proto}", f"method wisv under protocol {proto}: no drafter hiddens; mismatches are rejected")
            return reject_all
        return self._head_judge(block, positions, target_hidden)

    def _fetch_hiddens(self, rid: str, rnd: int, positions: list[int], k: int):
        """SH: the drafter's hiddens at ``positions`` as a [k, d] array (zeros elsewhere); None if they do not arrive."""
        req = self._HiddenRequest()
        stamp_now(self, req.header)
        req.request_id, req.round_id, req.positions = rid, rnd, positions
        timeout = float(self._param("hidden_request_timeout_s"))
        t0 = time.perf_counter()
        with self._hcv:
            self._h_awaiting, self._h_reply = (rid, rnd), None
        self._round_extra["down"] += msg_bytes(req)
        self._request_pub.publish(req)
        with self._hcv:
            self._hcv.wait_for(lambda: self._h_reply is not None, timeout)
            reply, self._h_awaiting = self._h_reply, None
        self._round_extra["wait_s"] += time.perf_counter() - t0
        if reply is None:
            self.get_logger().warning(f"request {rid} round {rnd}: no hidden reply within {timeout} s; rejecting the mismatches")
            return None
        self._round_extra["up"] += msg_bytes(reply)
        try:
            h, got = read_hidden(reply.hidden, "hidden_reply.hidden", n=len(positions), positions_below=k)
        except WireError as exc:
            self.get_logger().warning(f"request {rid} round {rnd}: {exc}; rejecting the mismatches")
            return None
        if got != list(positions):
            self.get_logger().warning(f"request {rid} round {rnd}: hidden reply positions {got} != requested {positions}")
            return None
        full = np.zeros((k, h.shape[1]), np.float32)
        full[positions] = h
        return full

    def _on_hidden_reply(self, msg) -> None:
        with self._hcv:
            if self._h_awaiting == (msg.request_id, msg.round_id) and self._h_reply is None:
                self._h_reply = msg
                self._hcv.notify_all()
                return
        self.get_logger().info(f"ignoring hidden reply for request {msg.request_id} round {msg.round_id} (stale)")


def main(args=None) -> None:
    run_node(VerifierNode, args=args)


if __name__ == "__main__":
    main()
