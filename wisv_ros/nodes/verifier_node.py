"""verifier_node (edge): verifies draft blocks with the target model.

Glue between the topics and the edge side of the round protocol (``sd.rounds.EdgeSessions``:
sessions per request, checks, idempotent resends, two-phase verification, SwitchSD copy rounds;
see that module). A block message is read (``interfaces.convert``), begun (target pass), its
drafter hiddens fetched under SH (HiddenRequest, then a wait of at most
``hidden_request_timeout_s`` for the HiddenReply; without a reply the mismatches are rejected,
which is lossless), finished (decision and copy rounds), and its verdict published with a
``round_stats`` message per round. A malformed or refused block gets a Verdict with ``error``
naming the field; a block of an unknown request without ``context_ids`` gets
``"unknown request <id>: resend context"``.

Topics (relative names; QoS ``common.RELIABLE_QOS``: reliable, keep-last 10, volatile):
  subscribes ``draft_block`` (DraftBlock), ``hidden_reply`` (HiddenReply),
             ``channel_state`` (ChannelState), with a deadline of ``channel_deadline_s``: when no
             channel state arrived for that long a warning is logged (once per silence), never
             fatal; the head keeps using the last state (``default_channel`` before the first).
             The deadline is checked by a timer, not by the DDS deadline QoS: a requested DDS
             deadline makes every publisher that offers none (the link monitor's transient-local
             publisher, a user's node, a bag replay) incompatible, and its messages would be lost.
  publishes  ``verdict`` (Verdict), ``hidden_request`` (HiddenRequest), ``round_stats`` (RoundStats)

A fleet (parameter ``robots``, e.g. ``robot1,robot2``): each robot gets these six topics under its
name (``robot1/draft_block`` ...), so its verdicts and hidden-state requests go to it alone; the
WISV head and ``tau_per_channel`` use the channel state of the block's own robot; a request belongs
to the robot whose block opened it, and a block of another robot under its id is refused by name.

Edge rounds (the robot's placement ``edge``): a block with method ``target_only`` and no draft
tokens asks for up to ``k`` tokens of the target's own (one pass a token, copy rounds in between
where copy mode holds); the verdict commits them all. Every verdict reports ``edge_token_s`` (the
target's time per generated token: timed once at load, then measured on edge rounds) and
``edge_load`` (the share of the last 5 s that other robots' blocks took on the verification
thread), which the robot's placement model reads.

SwitchSD copy mode (parameter ``copy``: off | ngram | probe): after a block, while the context's
last ``copy_kappa`` tokens occurred earlier (and, with ``probe``, the copy probe fires), the edge
verifies up to ``copy_width`` continuations of ``copy_depth`` tokens from the context in one tree
pass, at most ``copy_max_rounds`` rounds and the block's ``copy_budget`` tokens.

Threads: the node spins one executor thread (``common.run_node``) whose callbacks never block: the
block callback queues the block, and one verification thread takes blocks in arrival order and
runs the target; the blocks of different requests that wait together (up to ``max_batch``) are
verified in ONE target pass (``EdgeSessions.begin_many``: each request's tokens in its own KV
sequence), then each gets its decision, SH exchange and verdict. With ``kv_sessions`` > 1 (the default on llama_cpp) each request keeps its own KV
sequence, and a block whose context needs more than ``prefill_chunk`` tokens fed is prefilled a
chunk at a time with the blocks that arrived meanwhile served in between (``rounds.PrefillQueue``):
one robot's long prompt delays the others by about a chunk, not by its whole prefill. Hidden replies and channel states are handled by the executor meanwhile. The
WISV decision head is an ONNX file (``head_path``, see ``wisv.head``); with none, method wisv
rejects every mismatch, i.e. behaves as greedy (logged once). Drafter rows may arrive as the head's
drafter projection (``hidden.head_id`` set: a drafter_node with the same ``head_path``); rows of
another head are refused with a verdict error starting ``head_id:`` (``wisv.head.HeadMismatch``).
"""
from __future__ import annotations

import collections
import queue
import re
import threading
import time


from wisv_ros.interfaces.convert import fill_verdict, read_block
from wisv_ros.interfaces.wire import WireError
from wisv_ros.link.channel import SCENARIOS
from wisv_ros.link.channel import ChannelState as LinkChannel
from wisv_ros.nodes.transport import HiddenFetch
from wisv_ros.nodes.common import (QOS_DEPTH, RELIABLE_QOS, TEARDOWN_TIMEOUT_S, ServingNode, declare, frozen_after_start,
                                    msg_bytes, reliable_qos, run_node, stamp_age_s, stamp_now)
from wisv_ros.sd.acceptance import FLY_ENTROPY, FLY_WINDOW
from wisv_ros.sd.engines import BACKENDS, load_lm, resolve_backend
from wisv_ros.sd.models import WEIGHT_DTYPES, resolve_dtype
from wisv_ros.sd.placement import EdgeLoad
from wisv_ros.sd.rounds import EDGE_BUSY, EDGE_LOADING, EdgeReply, EdgeSessions, PrefillQueue, pick_batch
from wisv_ros.sd.verification import Method
from wisv_ros.switchsd.copying import COPY_MODES

__all__ = ["VerifierNode", "main"]

METHODS = ("greedy", "reject", "wisv", "fly")
ROBOT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


def parse_robots(text: str) -> list[str]:
    """Parameter ``robots``: '' = one robot on the node's own topics ([""]); else comma-separated
    names, each a ROS name component, no repeats."""
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names:
        return [""]
    bad = [n for n in names if not ROBOT_NAME.fullmatch(n)]
    if bad or len(set(names)) != len(names):
        why = f"{bad[0]!r} is not a ROS name (a letter, then letters, digits, _)" if bad else "a name repeats"
        raise ValueError(f"parameter robots: {why}; give e.g. 'robot1,robot2' or '' for one robot")
    return names


def _of(robot: str) -> str:
    return f" of {robot}" if robot else ""


class _Block:
    """A DraftBlock message and the robot whose topic it came on (message fields read through)."""

    __slots__ = ("robot", "msg")

    def __init__(self, robot: str, msg):
        self.robot, self.msg = robot, msg

    def __getattr__(self, name):
        return getattr(self.msg, name)


class VerifierNode(ServingNode):
    def __init__(self, **kwargs):
        super().__init__("verifier_node", **kwargs)
        from wisv_ros.sd.models import DEFAULT_TARGET

        declare(self, "target_model", DEFAULT_TARGET, "target model spec: registry name, HF folder, .gguf file or tiny-random:<seed>:<vocab>")
        declare(self, "target_dtype", "auto", "dtype of the target weights (auto: bfloat16 on CPUs with AMX-BF16/AVX512-BF16, else float32)", choices=WEIGHT_DTYPES)
        declare(self, "method", "greedy", "acceptance rule for blocks whose method field is empty", choices=METHODS)
        declare(self, "hidden_request_timeout_s", 2.0, "SH: wait this long for the drafter's hidden states (s)", lo=0.001, hi=600.0)
        declare(self, "channel_deadline_s", 1.0, "channel_state must arrive at least this often, else a warning is logged (s; 0 = no deadline)", lo=0.0, hi=3600.0)
        declare(self, "head_path", "", "WISV decision head (.onnx with its .json sidecar); '' = none: wisv behaves as greedy")
        declare(self, "tau_per_channel", "head", "WISV: tau per channel, '<scenario>:<tau>,...' (e.g. '20mbps_50ms:0.1,"
                "500mbps_5ms:0.02'); the scenario nearest the measured channel_state gives the tau of every wisv block, "
                "in place of the robot's; 'head' = the schedule chosen with the head (its sidecar's tau_per_channel; "
                "none there: the robot's tau); '' = the robot's tau")
        declare(self, "fly_entropy", FLY_ENTROPY, "method fly: accept a mismatch only where the target's normalised top-8 entropy is "
                "at least this (0 = always, > 1 = never: greedy)", lo=0.0, hi=2.0)
        declare(self, "fly_window", FLY_WINDOW, "method fly: the draft tokens after an accepted mismatch that must all match the "
                "target's own (deferred window)", lo=1, hi=256)
        declare(self, "default_channel", "20mbps_50ms", "channel scenario the head assumes until the first channel_state arrives", choices=tuple(SCENARIOS))
        declare(self, "max_requests", 16, "requests whose verifier state is kept (oldest dropped first)", lo=1, hi=4096)
        declare(self, "max_context", 4096, "longest committed context + block of a request (tokens); longer blocks are "
                "refused by name before any model work (also the llama_cpp context size, plus a block and the copy "
                "candidates)", lo=16, hi=1 << 20)
        declare(self, "kv_sessions", 0, "requests whose KV state the target keeps side by side: switching between robots "
                "then costs no prefill, and long contexts are prefilled in chunks (prefill_chunk); the cache grows to "
                "kv_sessions x max_context tokens; 0 = auto (llama_cpp: one per robot of robots, at least 4; torch keeps one "
                "context: 1)",
                lo=0, hi=64)
        declare(self, "max_batch", 8, "blocks of different requests verified in one target pass at most (bounded by "
                "kv_sessions; 1 = one block per pass): blocks that wait together share the pass", lo=1, hi=64)
        declare(self, "prefill_chunk", 128, "with kv_sessions > 1: a block whose context needs more than this many tokens "
                "prefilled is fed a chunk at a time, and other requests' blocks are verified between two chunks (tokens; "
                "0 = whole contexts at once, holding the target meanwhile)", lo=0, hi=1 << 20)
        declare(self, "robots", "", "the robots this edge serves, comma-separated (e.g. 'robot1,robot2'): each gets "
                "its own topics <robot>/draft_block, hidden_reply, channel_state (in) and <robot>/verdict, hidden_request, "
                "round_stats (out), its own channel for the head, and only it may continue its requests; '' = one robot "
                "on the node's own topics")
        declare(self, "max_queue", 64, "blocks waiting for the verification thread at most; a block beyond it is answered "
                "'edge busy' at once and the drafter resends it later", lo=1, hi=100000)
        declare(self, "max_edge_tokens", 32, "an edge round (a robot's placement edge: the target generates alone) makes "
                "at most this many tokens, whatever it asks: it holds the target that many passes while other robots' "
                "blocks wait", lo=1, hi=1024)
        declare(self, "max_block", 256, "most draft tokens one block may carry (drafter_node allows k up to 256)", lo=1, hi=1024)
        declare(self, "seed", 0, "seed of rejection sampling", lo=0, hi=2**31 - 1)
        declare(self, "threads", 1, "CPU threads of the target's engine", lo=1, hi=256)
        declare(self, "backend", "auto", "target engine: auto (llama_cpp for GGUF weights, torch for the rest), torch (target_dtype) or llama_cpp", choices=BACKENDS)
        declare(self, "copy", "off", "SwitchSD copy mode after each block: off; ngram (copy whenever the last copy_kappa "
                "tokens occurred before: the probe-less baseline); suffix (copy the longest earlier match of any length, the "
                "prompt-lookup rule); probe (ngram, and only when the copy probe fires too)",
                choices=COPY_MODES)
        declare(self, "probe_path", "", "copy probe (.npz from python -m wisv_ros.cli.probe train), needed by copy=probe")
        declare(self, "copy_kappa", 5, "copy mode: suffix tokens to match in the context (kappa)", lo=1, hi=64)
        declare(self, "copy_width", 4, "copy mode: candidate continuations verified per copy round (W)", lo=1, hi=64)
        declare(self, "copy_depth", 16, "copy mode: tokens per candidate (D)", lo=1, hi=256)
        declare(self, "copy_max_rounds", 32, "copy mode: at most this many copy rounds after one block", lo=1, hi=100000)
        declare(self, "round_log", "", "append one JSON record per verified round to this file (wisv_ros.sd.roundlog; "
                "python -m wisv_ros.cli.latency reads it); '' = off")
        for name, choices in (("copy", COPY_MODES), ("target_dtype", WEIGHT_DTYPES), ("default_channel", tuple(SCENARIOS)),
                              ("method", METHODS), ("backend", BACKENDS)):
            if self._param(name) not in choices:
                raise ValueError(f"parameter {name}: '{self._param(name)}' is not one of {', '.join(choices)}")
        self._backend = resolve_backend(self._param("target_model"), self._param("backend"))
        if int(self._param("kv_sessions")) > 1 and self._backend != "llama_cpp":
            raise ValueError(f"parameter kv_sessions: {self._param('kv_sessions')} needs backend llama_cpp "
                             "(the torch engine keeps one context); set kv_sessions:=1")
        self._tau_schedule = None
        if self._param("tau_per_channel") not in ("", "head"):
            from wisv_ros.link.channel import TauSchedule

            self._tau_schedule = TauSchedule.parse(self._param("tau_per_channel"))  # ValueError names the parameter
        if self._param("copy") == "probe" and not self._param("probe_path"):
            raise ValueError("parameter probe_path: copy=probe needs a probe file (.npz); set probe_path or use copy:=ngram")
        self.add_on_set_parameters_callback(frozen_after_start(
            {"target_model", "target_dtype", "threads", "channel_deadline_s", "head_path", "copy", "probe_path", "backend",
             "max_context", "max_block", "tau_per_channel", "kv_sessions", "prefill_chunk", "robots"},
            {"method": METHODS, "default_channel": tuple(SCENARIOS)},
        ))

        from wisv_ros.msg import ChannelState, DraftBlock, HiddenReply, HiddenRequest, RoundStats, Verdict

        self._Verdict, self._HiddenRequest, self._RoundStats = Verdict, HiddenRequest, RoundStats
        # One block and one verdict in flight per request: the worst burst is one per robot, so the
        # DDS history of the two holds as many as the node's own queue (max_queue); beyond that the
        # drafter's timeout and resend, or an "edge busy" answer, make a loss visible.
        burst_qos = reliable_qos(max(QOS_DEPTH, int(self._param("max_queue"))))
        self._robots = parse_robots(self._param("robots"))  # ValueError names the parameter
        self._verdict_pub, self._request_pub, self._stats_pub = {}, {}, {}
        for robot in self._robots:  # '' = the node's own namespace: one robot
            pre = f"{robot}/" if robot else ""
            self._verdict_pub[robot] = self.create_publisher(Verdict, pre + "verdict", burst_qos)
            self._request_pub[robot] = self.create_publisher(HiddenRequest, pre + "hidden_request", RELIABLE_QOS)
            self._stats_pub[robot] = self.create_publisher(RoundStats, pre + "round_stats", RELIABLE_QOS)
            self.create_subscription(DraftBlock, pre + "draft_block",
                                     lambda m, r=robot: self._queue_block(m, r), burst_qos)
            self.create_subscription(HiddenReply, pre + "hidden_reply", lambda m, r=robot: self._hiddens.offer(m, r),
                                     RELIABLE_QOS)
            self.create_subscription(ChannelState, pre + "channel_state",
                                     lambda m, r=robot: self._on_channel_state(m, r), RELIABLE_QOS)
        self._blocks: queue.Queue = queue.Queue()  # (robot, message, perf_counter at reception); max_queue bounds it
        self._busy = 0  # blocks answered "edge busy"
        self._waiting = collections.Counter()  # blocks per robot in the queue (executor +, verification thread -)
        self._wait_lock = threading.Lock()
        self._prefill = PrefillQueue(int(self._param("prefill_chunk")))  # verification thread only
        self._ready: list = []  # (BlockRequest, message, reception time) waiting for a target pass
        self._edge_load = EdgeLoad()  # the verification thread's time per robot (Verdict.edge_load)
        self._robot_now = self._robots[0]  # the robot of the block being decided (whose channel the head sees)
        deadline = float(self._param("channel_deadline_s"))
        self._channel_at = {r: time.monotonic() for r in self._robots}  # the deadline runs from the start
        self._channel_silent = {r: False for r in self._robots}
        if deadline > 0:
            self.create_timer(deadline / 4, self._check_channel_deadline)

        self._edge: EdgeSessions | None = None
        self._round_log = None  # roundlog.RoundLog while loaded, when round_log is set
        self._load_error: str | None = None
        self._channel: dict[str, LinkChannel] = {}  # latest channel state per robot (input of the WISV head)
        self._hiddens = HiddenFetch(self)  # SH: drafter hiddens on request
        self._verify_thread = threading.Thread(target=self._verify_loop, name="verify", daemon=True)
        self._verify_thread.start()
        self.autostart()

    def _param(self, name):
        return self.get_parameter(name).value

    @property
    def _max_batch(self) -> int:
        return max(1, min(int(self._param("max_batch")), self.kv_sessions()))

    def kv_sessions(self) -> int:
        """The KV sequences of the target: parameter kv_sessions; 0 = auto: on llama_cpp one per robot
        of ``robots`` and at least 4, else 1."""
        kv = int(self._param("kv_sessions"))
        return kv if kv > 0 else (max(4, len(self._robots)) if self._backend == "llama_cpp" else 1)

    def _release(self) -> None:
        self._edge = None  # the target and every request's session
        if self._round_log is not None:
            self._round_log.close()
            self._round_log = None

    def _load(self) -> bool:
        try:
            from wisv_ros.switchsd.copying import CopyConfig

            spec = self._param("target_model")
            backend = resolve_backend(spec, self._param("backend"))
            t0 = time.perf_counter()
            dtype = resolve_dtype(self._param("target_dtype")) if backend == "torch" else "gguf"
            probe, capture = None, []
            if self._param("copy") == "probe":
                from wisv_ros.switchsd.probe import load_probe

                probe = load_probe(self._param("probe_path"))
                capture = [(probe.layer, probe.kind)]
            n_ctx = int(self._param("max_context")) + int(self._param("max_block")) \
                + int(self._param("copy_width")) * int(self._param("copy_depth"))
            kv = self.kv_sessions()
            lm = load_lm(spec, backend, dtype=self._param("target_dtype"), capture=capture, threads=int(self._param("threads")),
                         n_ctx=n_ctx * kv, n_sessions=kv)
            if probe is not None and probe.d_model != lm.hidden_size:
                raise ValueError(f"probe {self._param('probe_path')} expects hidden size {probe.d_model}, the target has {lm.hidden_size}")
            head_path = self._param("head_path")
            judge, head_note = self._reject_all, "; no decision head"
            if head_path:
                from wisv_ros.wisv.head import OnnxHead, make_judge

                head = OnnxHead(head_path)
                if head.d_target != lm.hidden_size:
                    raise ValueError(f"head {head_path} expects target hidden size {head.d_target}, the target has {lm.hidden_size}")
                judge = make_judge(head, self._channel_state)  # takes drafter projections of head.head_id too
                head_note = (f"; decision head {head_path} (id {head.head_id})" if head.head_id else
                             f"; decision head {head_path} (takes no drafter projections: {head.split_error})")
                if self._param("tau_per_channel") == "head" and head.meta.get("tau_per_channel"):
                    from wisv_ros.link.channel import TauSchedule

                    try:
                        self._tau_schedule = TauSchedule.parse(head.meta["tau_per_channel"])
                    except ValueError as exc:
                        raise ValueError(f"head {head_path}: its sidecar's {exc}") from None
                    head_note += f", tau per channel {head.meta['tau_per_channel']}"
            copy = CopyConfig.for_mode(self._param("copy"), probe, kappa=int(self._param("copy_kappa")),
                                       width=int(self._param("copy_width")), depth=int(self._param("copy_depth")))
            if self._param("round_log"):
                from wisv_ros.sd.roundlog import RoundLog

                self._round_log = RoundLog(self._param("round_log"), vocab_size=lm.vocab_size, append=True)
            self._edge = EdgeSessions(lm, method=Method(self._param("method")), judge=judge, copy=copy,
                                      seed=int(self._param("seed")), max_requests=int(self._param("max_requests")),
                                      copy_max_rounds=int(self._param("copy_max_rounds")), round_log=self._round_log,
                                      max_context=int(self._param("max_context")), max_block=int(self._param("max_block")),
                                      max_edge_tokens=int(self._param("max_edge_tokens")),
                                      channel_tau=(None if self._tau_schedule is None else
                                                   lambda req: self._tau_schedule.tau_for(self._channel_state(req.robot))))
            # Warm-up (the first passes page the weights in) and the prior of Verdict.edge_token_s.
            token_s = self._edge.measure_token_s()
            self.get_logger().info(f"target {spec} ({backend}, {dtype}) loaded and warmed up in {time.perf_counter() - t0:.1f} s, "
                                   f"{token_s * 1e3:.1f} ms a generated token" + head_note)
            return True
        except Exception as exc:
            self._load_error = f"{type(exc).__name__}: {exc}"
            self.get_logger().error(f"loading the target failed: {self._load_error}")
            return False

    def _reject_all(self, _drafter_hidden, positions, _target_hidden):
        """The judge without a head: every mismatch is rejected (wisv = greedy)."""
        import torch

        if not getattr(self, "_warned_no_head", False):
            self._warned_no_head = True
            self.get_logger().warning("method wisv: no decision head loaded (head_path); every mismatch is rejected (greedy)")
        return torch.ones(len(positions))

    # ------------------------------------------------------------------ channel state
    def _on_channel_state(self, msg, robot: str = "") -> None:
        try:
            self._channel[robot] = LinkChannel(rate_bps=msg.rate_bps, per=msg.per, rtt_s=msg.rtt_s)
        except (TypeError, ValueError) as exc:
            self.get_logger().warning(f"ignoring channel_state{_of(robot)}: {exc}")
            return
        self._channel_at[robot] = time.monotonic()
        if self._channel_silent[robot]:
            self._channel_silent[robot] = False
            self.get_logger().info(f"channel_state{_of(robot)} is arriving again")

    def _check_channel_deadline(self) -> None:
        deadline = float(self._param("channel_deadline_s"))
        for robot in self._robots:
            silent_s = time.monotonic() - self._channel_at[robot]
            if silent_s > deadline and not self._channel_silent[robot]:
                self._channel_silent[robot] = True
                self.get_logger().warning(
                    f"channel_state{_of(robot)} deadline missed: none for {silent_s:.2f} s (deadline {deadline} s); "
                    + ("the WISV head keeps the last channel state" if robot in self._channel
                       else f"the WISV head assumes {self._param('default_channel')}")
                )

    def _channel_state(self, robot: str | None = None) -> LinkChannel:
        """The channel the WISV head sees for ``robot`` (default: the robot of the block being
        decided): its latest channel_state, else ``default_channel``."""
        robot = self._robot_now if robot is None else robot
        got = self._channel.get(robot)
        return got if got is not None else SCENARIOS[self._param("default_channel")]

    # ------------------------------------------------------------------ blocks
    # How long destroy_node waits for the block being verified; run_node's teardown watchdog allows
    # that wait plus the middleware's own teardown.
    verify_join_s = 30.0
    teardown_timeout_s = verify_join_s + TEARDOWN_TIMEOUT_S

    def destroy_node(self) -> None:
        """Stop the verification thread (after the block it is on) before the node goes.

        A thread that has run target passes and is still alive when the interpreter exits makes the
        process abort ("terminate called without an active exception"), seen after a demo goal.
        """
        self._blocks.put(None)
        self._verify_thread.join(timeout=self.verify_join_s)
        super().destroy_node()

    def _queue_block(self, msg, robot: str = "") -> None:
        """The draft_block callback: queue the block for the verification thread, or, with
        ``max_queue`` blocks waiting already, answer at once that the edge is busy (the drafter
        resends later; nothing is dropped without a word)."""
        waiting, limit = self._blocks.qsize(), int(self._param("max_queue"))
        share = max(1, limit // len(self._robots))  # in a fleet no robot takes the others' places
        with self._wait_lock:
            mine = self._waiting[robot]
            if waiting < limit and mine < share:
                self._waiting[robot] += 1
                self._blocks.put((_Block(robot, msg), time.perf_counter()))
                return
        why = (f"{waiting} blocks queued (max_queue {limit})" if waiting >= limit else
               f"{mine} blocks of {robot} queued (its share of max_queue {limit}: {share})")
        reply = EdgeReply(msg.request_id, int(msg.round_id), error=f"{EDGE_BUSY}: {why}; resend later")
        self._busy += 1
        if self._busy == 1 or self._busy % 100 == 0:
            self.get_logger().warning(f"request {msg.request_id} round {msg.round_id}: {reply.error} "
                                      f"({self._busy} blocks answered busy so far)")
        self._publish_verdict(reply, robot)

    def _publish_verdict(self, reply: EdgeReply, robot: str = ""):
        """Publish ``reply`` as a stamped Verdict; returns the message."""
        out = self._Verdict()
        stamp_now(self, out.header)
        fill_verdict(out, reply)
        self._verdict_pub[robot].publish(out)
        return out

    def _verify_loop(self) -> None:
        """The verification thread: blocks in arrival order, those of different requests verified
        together (``max_batch``), long contexts prefilled a chunk at a time between the others
        (``rounds.PrefillQueue``); an exception never ends it; None stops it."""
        while True:
            # Every block that came since the last chunk is served (or begins its prefill) first.
            if len(self._prefill):
                items = []
                for _ in range(self._blocks.qsize()):
                    try:
                        items.append(self._blocks.get_nowait())
                    except queue.Empty:
                        break
            else:
                items = [self._blocks.get()]
                while not self._blocks.empty() and len(items) < 4 * self._max_batch:
                    items.append(self._blocks.get_nowait())  # the only consumer: cannot be empty here
            for item in items:
                if item is None:
                    return
                with self._wait_lock:
                    self._waiting[item[0].robot] -= 1
                self._guarded(self._on_block, *item)
            self._serve_ready()
            if len(self._prefill):
                self._guarded(self._prefill_step, None, 0.0)
                self._serve_ready()

    def _guarded(self, fn, msg, t_recv: float) -> None:
        try:
            fn(msg, t_recv)
        except Exception as exc:  # noqa: BLE001 - e.g. publishing while the node shuts down
            if not self.context.ok():  # shutting down: the round's verdict has nowhere to go
                return
            where = f"request {msg.request_id} round {msg.round_id}: " if msg is not None else "prefill: "
            self.get_logger().error(f"{where}{exc!r}")

    def _edge_now(self) -> EdgeSessions | None:
        edge = self._edge if self._active else None
        if edge is not None:  # parameters that may change while the node runs
            edge.method, edge.max_requests = Method(self._param("method")), int(self._param("max_requests"))
            edge.copy_max_rounds, edge.seed = int(self._param("copy_max_rounds")), int(self._param("seed"))
            edge.fly_entropy, edge.fly_window = float(self._param("fly_entropy")), int(self._param("fly_window"))
            edge.max_edge_tokens = int(self._param("max_edge_tokens"))
        return edge

    def _not_loaded(self, msg) -> EdgeReply:
        return EdgeReply(msg.request_id, int(msg.round_id),
                         error=self._load_error or f"{EDGE_LOADING}: verifier_node is not active yet (loading its "
                                                   "target model); resend")

    def _on_block(self, msg, t_recv: float) -> None:
        """A block off the queue: its first prefill chunk (kept by ``_prefill`` while its context
        needs more), else served at once."""
        edge = self._edge_now()
        if edge is None:
            self._answer(msg, t_recv, self._not_loaded(msg))
            return
        try:
            req = read_block(msg.msg, edge.lm.vocab_size)
            req.robot = msg.robot
        except WireError as exc:
            self._answer(msg, t_recv, EdgeReply(msg.request_id, int(msg.round_id), error=str(exc)))
            return
        for req, (m, t), reply in self._prefill.offer(edge, req, (msg, t_recv)):
            self._serve(edge, req, m, t, reply)

    def _prefill_step(self, _msg, _t) -> None:
        """The next chunk of the oldest block whose context is being prefilled."""
        edge = self._edge_now()
        if edge is None:  # deactivated meanwhile: the kept blocks are answered, the drafters resend
            for _req, (m, t) in self._prefill.drain():
                self._answer(m, t, self._not_loaded(m))
            return
        for req, (m, t), reply in self._prefill.step(edge):
            self._serve(edge, req, m, t, reply)

    def _serve(self, edge: EdgeSessions, req, msg, t_recv: float, reply: EdgeReply | None) -> None:
        """A block done with its prefill: refused at once (``reply``), else ready for a target pass."""
        if reply is not None:
            self._answer(msg, t_recv, reply)
        else:
            self._ready.append((req, msg, t_recv))

    def _serve_ready(self) -> None:
        """Verify the ready blocks, oldest first, up to ``max_batch`` of different requests per target
        pass (``EdgeSessions.begin_many``); then each block's decision, SH exchange and verdict."""
        while self._ready:
            edge = self._edge_now()
            if edge is None:
                for _req, msg, t in self._ready:
                    self._guarded(lambda m, tt: self._answer(m, tt, self._not_loaded(m)), msg, t)
                self._ready.clear()
                return
            self._ready, batch = pick_batch(self._ready, self._max_batch)
            # Edge rounds (placement edge) generate alone, one after another; the blocks share one pass.
            alone = [i for i, (req, _, _) in enumerate(batch) if req.method == Method.TARGET_ONLY.value]
            shared = [i for i in range(len(batch)) if i not in alone]
            rounds: list = [None] * len(batch)
            for i in alone:
                start = time.perf_counter()
                rounds[i] = self._begin(edge, [batch[i][0]])[0]
                self._edge_load.add(batch[i][1].robot, start, time.perf_counter())
            if shared:
                start = time.perf_counter()
                for i, rnd in zip(shared, self._begin(edge, [batch[i][0] for i in shared])):
                    rounds[i] = rnd
                share = (time.perf_counter() - start) / len(shared)  # the shared pass, counted to each robot in it
                for n, i in enumerate(shared):
                    self._edge_load.add(batch[i][1].robot, start + n * share, start + (n + 1) * share)
            for (req, msg, t), rnd in zip(batch, rounds):

                def one(m, tt, rnd=rnd):
                    sh = self._hiddens.new_round()
                    self._robot_now = m.robot  # the head sees this robot's channel
                    start = time.perf_counter()
                    reply = edge.complete(rnd, self._hiddens.fetch)
                    self._edge_load.add(m.robot, start, time.perf_counter() - sh["wait_s"])
                    self._answer(m, tt, reply, sh)
                self._guarded(one, msg, t)

    @staticmethod
    def _begin(edge: EdgeSessions, reqs: list) -> list:
        """``EdgeSessions.begin_many``; an exception answers every block of the pass (never ends the thread)."""
        try:
            return edge.begin_many(reqs)
        except Exception as exc:  # noqa: BLE001
            return [EdgeReply(req.request_id, req.round_id, error=f"internal error: {exc!r}") for req in reqs]

    def _answer(self, msg, t_recv: float, reply: EdgeReply, sh: dict | None = None) -> None:
        uplink_s = max(0.0, stamp_age_s(self, msg.header.stamp) - (time.perf_counter() - t_recv))  # up to reception
        sh = sh if sh is not None else self._hiddens.new_round()
        if reply.resent:  # idempotent: the drafter missed (or timed out on) this verdict
            self.get_logger().info(f"request {msg.request_id} round {msg.round_id}: block resent; publishing its verdict again")
        elif reply.error:
            self.get_logger().warning(f"request {msg.request_id} round {msg.round_id}: {reply.error}")
        else:
            reply.edge_time_s = max(0.0, time.perf_counter() - t_recv - sh["wait_s"])
        reply.edge_load = self._edge_load.load(msg.robot, time.perf_counter())
        out = self._publish_verdict(reply, msg.robot)
        if not reply.error and not reply.resent:
            self._publish_stats(msg, reply, out, sh, uplink_s, time.perf_counter() - t_recv)

    def _publish_stats(self, msg, reply: EdgeReply, verdict_msg, sh: dict, uplink_s: float, edge_s: float) -> None:
        """One RoundStats for the block, one per copy round after it (no link traffic of their own)."""
        v = reply.verdict
        protocol = ("ids", "fh", "sh")[int(msg.protocol)]
        stats = self._RoundStats()
        stamp_now(self, stats.header)
        stats.request_id, stats.round_id = msg.request_id, msg.round_id
        stats.drafted, stats.accepted = len(msg.token_ids), v.accepted
        stats.committed, stats.mismatches = len(v.committed_ids), len(v.mismatches)
        stats.uplink_bytes = msg_bytes(msg.msg) + sh["up"]
        stats.downlink_bytes = msg_bytes(verdict_msg) + sh["down"]
        stats.draft_time_s = msg.draft_time_s
        stats.comm_time_s = uplink_s + sh["wait_s"]  # uplink by the stamps + SH exchange
        stats.target_time_s, stats.head_time_s = v.target_time_s, v.head_time_s
        stats.round_time_s = uplink_s + edge_s
        stats.protocol = protocol
        self._stats_pub[msg.robot].publish(stats)
        for c in reply.copies:
            cs = self._RoundStats()
            cs.header = stats.header
            cs.request_id, cs.round_id = msg.request_id, msg.round_id
            cs.drafted = cs.accepted = c.accepted
            cs.committed = len(c.committed_ids)
            cs.target_time_s = cs.round_time_s = c.target_time_s
            cs.protocol = protocol
            cs.copy_round = True
            self._stats_pub[msg.robot].publish(cs)


def main(args=None) -> None:
    run_node(VerifierNode, args=args)


if __name__ == "__main__":
    main()
