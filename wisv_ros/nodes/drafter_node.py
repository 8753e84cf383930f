"""drafter_node (robot): serves the ``generate`` action with distributed speculative decoding.

Glue between the Generate action, the topics and the round protocol: each goal runs
``sd.rounds.RobotSession`` (drafting, round ids, resends, edge-loss fallback, accounting; see that
module for the protocol) over ``DdsLink``, which publishes ``draft_block`` and waits for the
``verdict`` of that (request, round) on a condition variable that the verdict callback sets.

Topics (relative names; QoS ``common.RELIABLE_QOS``: reliable, keep-last 10, volatile):
  publishes  ``draft_block`` (DraftBlock), ``hidden_reply`` (HiddenReply)
  subscribes ``verdict`` (Verdict), ``hidden_request`` (HiddenRequest),
             ``channel_state`` (ChannelState; only used by protocol ``adaptive``)
Action server: ``generate`` (Generate); feedback QoS ``common.FEEDBACK_QOS`` (keep-last 1000).

Protocols: ``ids`` sends token ids; ``fh`` adds the K drafter hidden states (float16 bytes);
``sh`` keeps them on the robot and answers HiddenRequest; ``adaptive`` = ``ids`` for greedy and
reject, and for wisv the cheaper of fh/sh by ``link.channel.choose_protocol`` on the latest channel
state (fh until one arrives). Method ``reject`` always sends ids + the drafter distributions.
With ``head_path`` (the verifier's WISV decision head), fh blocks and sh replies carry the head's
drafter projection ([K, 64] for the shipped heads) instead of the [K, d_D] hiddens, named by the
head's id (``wisv.head``; pre-projected FH uplink); a verifier running another head refuses them.

Placement (parameter and goal field ``placement``, ``sd.placement``): every round runs split (as
above), edge (a DraftBlock with method ``target_only`` and no draft tokens: the edge generates up to
``edge_chunk`` tokens with the target alone and the verdict commits them, streamed as feedback) or
robot (the drafter alone, unverified); ``auto`` (default) takes the faster of split and edge per
round by the expected latency per token from the latest channel state, what this node measured
(drafting, round trips, tokens per round; kept across goals) and the edge's reports in each verdict
(``edge_token_s``, ``edge_load``), and robot only past ``max_ms_per_token``. The result says where
the last round ran and why (``placement``, ``placement_reason``) and counts ``edge_rounds`` and
``robot_rounds``; each feedback message names its round's placement.

The result: ``rounds`` are round trips (copy rounds on the edge are counted apart: ``copy_rounds``,
``copy_committed``) and ``aal`` is tokens per round trip; ``draft_time_s``, ``round_trip_s`` (block
published -> verdict received) and ``edge_time_s`` (of that, on the edge), so ``round_trip_s -
edge_time_s`` is the link plus the ROS and serialization overhead; ``drafter_only_rounds``.

Models without a tokenizer (``tiny-random:...``): the goal's prompt is space-separated integer ids
("5 9 12 3") and the result text is the generated ids joined by spaces. Goals are rejected
(GoalResponse.REJECT, reason in this node's log) while the model is loading or failed to load; a
goal with invalid fields is accepted and aborted with the reason in ``error``. One goal runs at a
time (one drafter cache); further goals wait for it.
"""
from __future__ import annotations

import collections
import math
import threading
import time
import uuid

from rclpy.action import ActionServer, CancelResponse, GoalResponse

from wisv_ros.interfaces.wire import WireError, text_to_ids
from wisv_ros.link.channel import ChannelState as LinkChannel
from wisv_ros.link.channel import WireFormat
from wisv_ros.nodes.transport import DdsLink
from wisv_ros.nodes.common import (FEEDBACK_QOS, RELIABLE_QOS, ServingNode, check_choice, declare, frozen_after_start,
                                   offload, run_node)
from wisv_ros.sd.drafting import Drafter, encode_prompt, same_vocabulary
from wisv_ros.sd.engines import BACKENDS, load_lm, resolve_backend
from wisv_ros.sd.models import load_tokenizer
from wisv_ros.sd.placement import PLACEMENT_MODES, PlacementModel
from wisv_ros.sd.rounds import EDGE_LOSS, EdgeLost, RobotPolicy, RobotSession, protocol_chooser
from wisv_ros.sd.verification import Method

__all__ = ["DrafterNode", "main"]

METHODS = (Method.GREEDY.value, Method.REJECT.value, Method.WISV.value, Method.FLY.value)
PROTOCOLS = ("ids", "fh", "sh", "adaptive")


class DrafterNode(ServingNode):
    def __init__(self, **kwargs):
        super().__init__("drafter_node", **kwargs)
        from wisv_ros.sd.models import DEFAULT_DRAFTER

        p = RobotPolicy()  # the defaults of the round protocol are the parameters' defaults
        declare(self, "drafter_model", DEFAULT_DRAFTER,
                "drafter model spec: registry name, HF folder, .gguf file or tiny-random:<seed>:<vocab>[:<noise>]")
        declare(self, "target_tokenizer_model", "",
                "the target model's spec, whose tokenizer the robot needs for cross-tokenizer pairs; '' = same vocabulary as the drafter")
        declare(self, "k", p.k, "default draft block size K (tokens)", lo=1, hi=256)
        declare(self, "method", p.method, "default acceptance rule", choices=METHODS)
        declare(self, "protocol", p.protocol, "default upload protocol (adaptive: ids for greedy/reject, fh or sh by channel for wisv)", choices=PROTOCOLS)
        declare(self, "tau", 0.02, "default WISV threshold (chosen on held-out problems, docs/wisv.md) (0 = greedy, > 1 accepts every draft)", lo=0.0, hi=10.0)
        declare(self, "temperature", p.temperature, "drafter sampling temperature (0 = greedy; reject needs > 0)", lo=0.0, hi=10.0)
        declare(self, "min_confidence", 0.6, "end a block early after a draft token below this drafter probability (0 = always K)", lo=0.0, hi=0.999)
        declare(self, "max_new_tokens", p.max_new_tokens, "default bound on generated tokens (target tokens)", lo=1, hi=1_000_000)
        declare(self, "chat", True, "apply the models' chat templates to text prompts")
        declare(self, "verdict_timeout_s", p.verdict_timeout_s, "wait this long for a verdict before the edge counts as lost (s)", lo=0.01, hi=600.0)
        declare(self, "first_verdict_timeout_s", p.first_verdict_timeout_s,
                "the same for a block that carries the whole context (a request's first block, or the first after a verifier "
                "restart): the edge first runs the prompt through the target, which can take many seconds on a CPU (s)",
                lo=0.01, hi=3600.0)
        declare(self, "verdict_retries", p.verdict_retries,
                "on a verdict timeout, resend the same block (same request and round) this many times before the edge "
                "counts as lost; the verifier answers a resent block idempotently",
                lo=0, hi=100)
        declare(self, "on_edge_loss", p.on_edge_loss, "on a lost edge: 'error' aborts the goal, 'drafter_only' goes on with "
                "the drafter alone (unverified tokens), 'wait' resends until the edge is back (edge_wait_s at most; "
                "the answer stays the target's)", choices=EDGE_LOSS)
        declare(self, "edge_retry_s", p.edge_retry_s, "try a lost or loading edge again at most this often (s)", lo=0.0, hi=3600.0)
        declare(self, "edge_wait_s", p.edge_wait_s, "wait this long for an edge that is loading its model (any on_edge_loss) "
                "or, with on_edge_loss wait, silent, before giving up (s)", lo=0.0, hi=86400.0)
        declare(self, "placement", "auto", "where tokens are made: 'split' (drafter here, target on the edge), 'edge' "
                "(the edge generates with the target alone and streams), 'robot' (the drafter alone, unverified) or 'auto' "
                "(per round, the faster of split and edge by the expected latency per token from the measured channel, "
                "compute times and edge load; robot only past max_ms_per_token)", choices=PLACEMENT_MODES)
        declare(self, "max_ms_per_token", 0.0, "placement auto: when split and edge are both expected slower than this, "
                "the drafter answers alone if it is faster (ms per token; 0 = never leave the target's answer)", lo=0.0, hi=1e6)
        declare(self, "edge_chunk", 0, "placement edge: tokens the edge generates per round trip (0 = the fewest that keep "
                "the round trip under 10 % of their compute, at most 32)", lo=0, hi=256)
        declare(self, "seed", 0, "seed of the drafter's sampling", lo=0, hi=2**31 - 1)
        declare(self, "threads", 1, "CPU threads of the drafter's engine", lo=1, hi=256)
        declare(self, "backend", "auto", "drafter engine: auto (llama_cpp for GGUF weights, torch for the rest), torch or llama_cpp", choices=BACKENDS)
        declare(self, "head_path", "", "the verifier's WISV decision head (.onnx with its .json sidecar): under fh and sh send "
                "its drafter projection (the head's hidden width, 64 for the shipped heads) instead of the drafter hidden "
                "states; the verifier must run the same head; '' = send the hidden states")
        for name, choices in (("method", METHODS), ("protocol", PROTOCOLS), ("on_edge_loss", EDGE_LOSS), ("backend", BACKENDS),
                              ("placement", PLACEMENT_MODES)):
            check_choice(name, self._param(name), choices)
        self.add_on_set_parameters_callback(frozen_after_start(
            {"drafter_model", "target_tokenizer_model", "threads", "backend", "head_path"},
            {"method": METHODS, "protocol": PROTOCOLS, "on_edge_loss": EDGE_LOSS, "placement": PLACEMENT_MODES},
        ))

        from wisv_ros.action import Generate
        from wisv_ros.msg import ChannelState, DraftBlock, HiddenReply, HiddenRequest, Verdict

        self._DraftBlock, self._HiddenReply, self._Generate = DraftBlock, HiddenReply, Generate
        self._block_pub = self.create_publisher(DraftBlock, "draft_block", RELIABLE_QOS)
        self._reply_pub = self.create_publisher(HiddenReply, "hidden_reply", RELIABLE_QOS)
        self.create_subscription(Verdict, "verdict", self._on_verdict, RELIABLE_QOS)
        self.create_subscription(HiddenRequest, "hidden_request", lambda m: self._link.answer_hidden_request(m), RELIABLE_QOS)
        self.create_subscription(ChannelState, "channel_state", self._on_channel_state, RELIABLE_QOS)
        self._action = ActionServer(self, Generate, "generate", self._execute, goal_callback=self._on_goal,
                                    cancel_callback=lambda _req: CancelResponse.ACCEPT, feedback_pub_qos_profile=FEEDBACK_QOS)
        self._lm = None
        self._target_tok = None
        self._projection = None  # wisv.head.DraftProjection of head_path (pre-projected FH uplink)
        self._load_error: str | None = None
        self._goal_lock = threading.Lock()
        self._link = DdsLink(self)
        self._request_ids: collections.deque[str] = collections.deque(maxlen=64)  # recent requests of this node
        self._channel: LinkChannel | None = None
        self._mean_mismatch = 0.0  # rejected draft positions per block, carried across requests
        self._placer: PlacementModel | None = None  # what placement auto measured, carried across requests
        self._logged_placement: str | None = None  # the placement whose reason was logged last
        self.autostart()

    # ------------------------------------------------------------------ parameters and loading
    def _param(self, name):
        return self.get_parameter(name).value

    def _release(self) -> None:
        self._lm = self._target_tok = self._projection = None

    def _load(self) -> bool:
        try:
            spec = self._param("drafter_model")
            t0 = time.perf_counter()
            lm = load_lm(spec, self._param("backend"), dtype="float32", threads=int(self._param("threads")))
            tok = lm.tokenizer
            target_spec = self._param("target_tokenizer_model")
            target_tok = None
            if target_spec and not target_spec.startswith("tiny-random"):
                target_tok = load_tokenizer(target_spec)
                if same_vocabulary(tok, target_tok):
                    target_tok = None
            projection = None
            head_path = self._param("head_path")
            if head_path:
                from wisv_ros.wisv.head import load_projection

                projection = load_projection(head_path)
                if projection.d_draft != lm.hidden_size:
                    raise ValueError(f"head_path {head_path}: the head expects drafter hidden size {projection.d_draft}, "
                                     f"the drafter has {lm.hidden_size}")
            self._lm, self._target_tok, self._projection = lm, target_tok, projection
            width = projection.hidden if projection is not None else lm.hidden_size  # what a row costs on the link
            self._placer = PlacementModel(WireFormat(hidden_dim=width))
            self.get_logger().info(f"drafter {spec} ({resolve_backend(spec, self._param('backend'))}) loaded in {time.perf_counter() - t0:.1f} s"
                                   + (f"; cross-tokenizer with {target_spec}" if target_tok is not None else "")
                                   + (f"; sending the drafter projection of head {head_path} (id {projection.head_id}, "
                                      f"{projection.hidden} wide) instead of {lm.hidden_size}-wide hiddens" if projection else ""))
            return True
        except Exception as exc:  # reported on every goal; the node stays up
            self._load_error = f"{type(exc).__name__}: {exc}"
            self.get_logger().error(f"loading the drafter failed: {self._load_error}")
            return False

    # ------------------------------------------------------------------ action
    def _on_goal(self, _goal) -> GoalResponse:
        if not self._active:
            why = self._load_error or f"drafter_node is not active (drafter model {self._param('drafter_model')} not loaded yet)"
            self.get_logger().warning(f"goal rejected: {why}")
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _policy(self, goal) -> RobotPolicy:
        """Goal fields over parameter defaults, validated (ValueError names the field)."""
        for name in ("tau", "temperature"):  # negative means the node default; NaN means nothing
            if math.isnan(getattr(goal, name)):
                raise ValueError(f"{name}: NaN; give a value (tau 0..10, temperature 0..10) or a negative one for "
                                 "the node default")
        p = RobotPolicy(
            method=goal.method or self._param("method"), protocol=goal.protocol or self._param("protocol"),
            k=int(goal.k) or int(self._param("k")),
            tau=float(goal.tau) if goal.tau >= 0 else float(self._param("tau")),
            max_new_tokens=int(goal.max_new_tokens) or int(self._param("max_new_tokens")),
            temperature=float(goal.temperature) if goal.temperature >= 0 else float(self._param("temperature")),
            **{name: self._param(name) for name in ("verdict_timeout_s", "first_verdict_timeout_s", "verdict_retries",
                                                    "on_edge_loss", "edge_retry_s", "edge_wait_s")},
            placement=goal.placement or self._param("placement"))
        if p.method == "reject" and self._target_tok is not None:
            raise ValueError("method reject needs one vocabulary; this drafter drafts across tokenizers")
        return p

    async def _execute(self, goal_handle):
        """The action's execute callback: the goal runs in its own thread, the executor stays free."""
        return await offload(self, self._run_goal, goal_handle)

    def _run_goal(self, goal_handle):
        result = self._Generate.Result()
        with self._goal_lock:
            t_start = time.perf_counter()
            self._link.totals = {"up": 0, "down": 0, "round_trip_s": 0.0, "hidden_requests": 0}
            out, res, status = [], None, "succeeded"
            try:
                policy = self._policy(goal_handle.request)
                session = self._session(goal_handle, policy)
                sent = [""]  # text streamed so far
                try:
                    res = session.run(on_commit=lambda new, rnd: self._feedback(goal_handle, out, new, rnd, sent,
                                                                                session.round_placement),
                                      cancelled=lambda: goal_handle.is_cancel_requested)
                finally:
                    self._mean_mismatch = session.mean_mismatch
                if res.placement_reason and res.placement != self._logged_placement:
                    self.get_logger().info(f"placement {res.placement_reason}")  # when the choice changes
                    self._logged_placement = res.placement
                status = "canceled" if goal_handle.is_cancel_requested else "succeeded"
            except (EdgeLost, ValueError) as exc:
                status, result.error = "aborted", str(exc)
            except Exception as exc:  # a bug must not kill the node; the client gets the reason
                self.get_logger().error(f"goal failed: {exc!r}")
                status, result.error = "aborted", f"internal error: {type(exc).__name__}: {exc}"
            self._fill_result(result, out, res, time.perf_counter() - t_start)
            if status == "canceled":
                result.error = "canceled"
                goal_handle.canceled()
            elif status == "aborted":
                self.get_logger().warning(f"goal aborted: {result.error}")
                goal_handle.abort()
            else:
                goal_handle.succeed()
            return result

    def _session(self, goal_handle, policy: RobotPolicy) -> RobotSession:
        lm = self._lm
        prompt, chat = goal_handle.request.prompt, bool(self._param("chat"))
        if lm.tokenizer is None:
            d_prompt = t_prompt = text_to_ids(prompt)
            bad = [i for i in d_prompt if not 0 <= i < lm.vocab_size]
            if bad:
                raise WireError(f"prompt: ids {bad[:5]} outside the vocabulary [0, {lm.vocab_size})")
        else:
            d_prompt = encode_prompt(lm.tokenizer, prompt, chat)
            t_prompt = encode_prompt(self._target_tok, prompt, chat) if self._target_tok is not None else d_prompt
        drafter = Drafter(lm, self._target_tok, temperature=policy.temperature, seed=int(self._param("seed")),
                          min_confidence=float(self._param("min_confidence")))
        request_id = uuid.UUID(bytes=bytes(goal_handle.goal_id.uuid)).hex[:16]  # the goal id, shortened
        self._request_ids.append(request_id)
        def log(level: str, text: str) -> None:
            # One call site per severity: rclpy refuses a call site whose severity changes between calls
            # ("Logger severity cannot be changed between calls"), which aborted a goal that logged a
            # warning (edge silent) and then an info (unknown request, resending the context).
            if level == "warning":
                self.get_logger().warning(text)
            else:
                self.get_logger().info(text)

        projection = self._projection
        width = projection.hidden if projection is not None else self._lm.hidden_size  # what a row costs on the link
        placer = self._placer
        placer.max_s_per_token = float(self._param("max_ms_per_token")) / 1000.0
        placer.edge_chunk = int(self._param("edge_chunk"))
        return RobotSession(drafter, request_id, t_prompt, d_prompt, policy, self._link, self._eos(),
                            protocol_for=protocol_chooser(policy.protocol, policy.method, width, lambda: self._channel),
                            log=log, mean_mismatch=self._mean_mismatch, projection=projection,
                            channel=lambda: self._channel, placer=placer)

    def _fill_result(self, result, out: list[int], res, latency: float) -> None:
        result.text = self._decode(out)
        result.token_ids = out
        result.latency_s = latency
        result.tokens_per_s = len(out) / latency if latency > 0 else 0.0
        t = self._link.totals
        result.uplink_bytes, result.downlink_bytes = t["up"], t["down"]
        result.round_trip_s, result.hidden_requests = t["round_trip_s"], t["hidden_requests"]
        if res is not None:
            result.rounds = res.rounds
            result.aal = len(out) / res.rounds if res.rounds else 0.0
            result.draft_time_s, result.edge_time_s = res.draft_time_s, res.edge_time_s
            result.copy_rounds, result.copy_committed = res.copy_rounds, res.copy_committed
            result.drafter_only_rounds = res.drafter_only_rounds
            result.edge_rounds, result.robot_rounds = res.edge_rounds, res.robot_rounds
            result.placement, result.placement_reason = res.placement or "split", res.placement_reason

    # ------------------------------------------------------------------ one request
    def _decode(self, ids: list[int]) -> str:
        tok = self._target_tok if self._target_tok is not None else (self._lm.tokenizer if self._lm else None)
        if tok is None:
            return " ".join(map(str, ids))
        return tok.decode(ids, skip_special_tokens=True)

    def _eos(self) -> set[int]:
        if self._target_tok is not None:
            return {int(self._target_tok.eos_token_id)} if self._target_tok.eos_token_id is not None else set()
        return self._lm.eos_ids()

    def _feedback(self, goal_handle, out: list[int], new: list[int], round_id: int, sent: list[str],
                  placement: str) -> None:
        out.extend(new)
        fb = self._Generate.Feedback()
        full = self._decode(out).rstrip("\ufffd")  # an incomplete character waits for the next round
        if full.startswith(sent[0]):
            fb.text_delta, sent[0] = full[len(sent[0]):], full
        fb.token_ids_delta = new
        fb.committed_length = len(out)
        fb.round_id = round_id
        fb.placement = placement
        goal_handle.publish_feedback(fb)

    # ------------------------------------------------------------------ topics
    def _on_verdict(self, msg) -> None:
        if self._link.offer(msg):
            return
        if msg.request_id in self._request_ids:
            self.get_logger().info(f"ignoring a stale or duplicate verdict: request {msg.request_id} round {msg.round_id}")
        else:  # another drafter's request on the same topic
            self.get_logger().debug(f"ignoring a verdict for request {msg.request_id} (not ours)")

    def _on_channel_state(self, msg) -> None:
        try:
            self._channel = LinkChannel(rate_bps=msg.rate_bps, per=msg.per, rtt_s=msg.rtt_s)
        except (TypeError, ValueError) as exc:
            self.get_logger().warning(f"ignoring channel_state: {exc}")


def main(args=None) -> None:
    run_node(DrafterNode, args=args)


if __name__ == "__main__":
    main()
