"""drafter_node (robot): serves the ``generate`` action with distributed speculative decoding.

Per goal, one round is (SPEC "One round"; the decoding itself is ``wisv_ros.decoding.Drafter``):
draft K tokens -> publish ``draft_block`` -> wait for the ``verdict`` of that (request, round) ->
``Drafter.commit`` -> feedback with the committed text/ids -> until ``max_new_tokens`` or EOS.

Topics (relative names; QoS ``common.RELIABLE_QOS``: reliable, keep-last 10, volatile):
  publishes  ``draft_block`` (DraftBlock), ``hidden_reply`` (HiddenReply)
  subscribes ``verdict`` (Verdict), ``hidden_request`` (HiddenRequest),
             ``channel_state`` (ChannelState; only used by protocol ``adaptive``)
Action server: ``generate`` (Generate); feedback QoS ``common.FEEDBACK_QOS`` (keep-last 1000).

Protocols: ``ids`` sends token ids; ``fh`` adds the K drafter hidden states (float16 bytes);
``sh`` keeps them on the robot and answers HiddenRequest; ``adaptive`` = ``ids`` for greedy and
reject, and for wisv the cheaper of fh/sh by ``link.choose_protocol`` on the latest channel state
(fh until one arrives). Method ``reject`` always sends ids + the drafter distributions (float32).

Edge loss: a verdict with ``error`` set, or none within ``verdict_timeout_s`` after the block and
``verdict_retries`` resends of the same block (same request and round id; each waits
``verdict_timeout_s``; the verifier answers a resent round with the verdict it already gave). A block
that carries the whole context (a request's first block, or the first after a verifier restart)
waits ``first_verdict_timeout_s`` instead: the edge runs the prompt through the target first. With
``on_edge_loss=error`` the goal is aborted with that reason. With ``drafter_only`` the robot keeps
going alone (commits its own draft tokens); at most every ``edge_retry_s`` it tries the edge
again (if a verifier is subscribed), sending the whole committed context with that block; the first
verdict that comes back ends drafter-only mode. A verdict ``unknown request`` (verifier restarted)
makes the next block carry the whole context. Stale, duplicate and foreign verdicts are ignored.

SwitchSD copy mode runs on the verifier (its parameter ``copy``): each block carries the request's
remaining token budget (``copy_budget``); tokens the verifier copied from the context after the
block end the verdict's ``committed_ids`` and are committed like the others (the drafter's cache
catches up on its next pass). The result counts them (``copy_rounds``, ``copied_tokens``); its
``rounds`` are round trips and ``aal`` is tokens per round trip, copied tokens included.
The result's timing: ``draft_time_s`` (drafting), ``round_trip_s`` (block published -> verdict
received), ``edge_time_s`` (of that, on the edge by the verdicts' ``edge_time_s``); so
``round_trip_s - edge_time_s`` is the link plus the ROS and serialization overhead.

Threads: the node spins one executor thread (``common.run_node``) whose callbacks never block;
each goal's rounds run in a thread of their own (``common.offload``), which waits for its verdict
on a condition variable that the verdict callback sets.

Models without a tokenizer (``tiny-random:...``): the goal's prompt is space-separated integer ids
("5 9 12 3") and the result text is the generated ids joined by spaces.

Goals are rejected (GoalResponse.REJECT, reason in this node's log) while the model is loading or
failed to load; a goal with invalid fields is accepted and aborted with the reason in ``error``.
One goal runs at a time (one drafter cache); further goals wait for it.
"""
from __future__ import annotations

import collections
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.node import Node

from ..decoding import Drafter, Method, clip, encode_prompt, same_vocabulary
from ..link import ChannelState as LinkChannel
from ..link import WireFormat, choose_protocol
from ..wire import UNKNOWN_REQUEST, WireError, fill_hidden, fill_tensor, text_to_ids
from .common import (FEEDBACK_QOS, RELIABLE_QOS, check_choice, declare, frozen_after_start, msg_bytes, offload,
                     run_node, stamp_now)

__all__ = ["DrafterNode", "main"]

METHODS = (Method.GREEDY.value, Method.REJECT.value, Method.WISV.value)
PROTOCOLS = ("ids", "fh", "sh", "adaptive")
EDGE_LOSS = ("error", "drafter_only")
HIDDEN_WIRE_DTYPE = "float16"
_PROTO_CODE = {"ids": 0, "fh": 1, "sh": 2}  # DraftBlock.PROTOCOL_*


def load_tokenizer(spec: str):
    """The tokenizer of a model spec without loading (or converting) its weights.

    The robot needs only the target's tokenizer: for a registry model it is read from the
    converted folder if one exists, else straight from the GGUF file (no dequantisation).
    """
    from transformers import AutoTokenizer

    from ..models import REGISTRY, cache_dir, resolve

    if spec in REGISTRY:
        converted = cache_dir() / "hf" / spec
        if (converted / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(converted)
        gguf = REGISTRY[spec].locate(cache_dir())
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(resolve(spec))


def _new_totals() -> dict:
    """Per-goal sums behind the Generate result's stats."""
    return {"up": 0, "down": 0, "draft_s": 0.0, "round_trip_s": 0.0, "edge_s": 0.0, "hidden_requests": 0,
            "copy_rounds": 0, "copied": 0, "drafter_only_rounds": 0}


class _GoalFailed(Exception):
    """Abort the goal with this message."""


class DrafterNode(Node):
    def __init__(self, **kwargs):
        super().__init__("drafter_node", **kwargs)
        from ..models import DEFAULT_DRAFTER

        p = {}
        p["drafter_model"] = declare(self, "drafter_model", DEFAULT_DRAFTER,
                                     "drafter model spec: registry name, HF folder, .gguf file or tiny-random:<seed>:<vocab>[:<noise>]")
        p["target_tokenizer_model"] = declare(self, "target_tokenizer_model", "",
                                              "the target model's spec, whose tokenizer the robot needs for cross-tokenizer pairs; '' = same vocabulary as the drafter")
        p["k"] = declare(self, "k", 8, "default draft block size K (tokens)", lo=1, hi=256)
        p["method"] = declare(self, "method", "greedy", "default acceptance rule", choices=METHODS)
        p["protocol"] = declare(self, "protocol", "adaptive", "default upload protocol (adaptive: ids for greedy/reject, fh or sh by channel for wisv)", choices=PROTOCOLS)
        p["tau"] = declare(self, "tau", 0.0, "default WISV threshold (0 = greedy, > 1 accepts every draft)", lo=0.0, hi=10.0)
        p["temperature"] = declare(self, "temperature", 0.0, "drafter sampling temperature (0 = greedy; reject needs > 0)", lo=0.0, hi=10.0)
        p["min_confidence"] = declare(self, "min_confidence", 0.6, "end a block early after a draft token below this drafter probability (0 = always K)", lo=0.0, hi=0.999)
        p["max_new_tokens"] = declare(self, "max_new_tokens", 128, "default bound on generated tokens (target tokens)", lo=1, hi=1_000_000)
        p["chat"] = declare(self, "chat", True, "apply the models' chat templates to text prompts")
        p["verdict_timeout_s"] = declare(self, "verdict_timeout_s", 5.0, "wait this long for a verdict before the edge counts as lost (s)", lo=0.01, hi=600.0)
        p["first_verdict_timeout_s"] = declare(
            self, "first_verdict_timeout_s", 60.0,
            "the same for a block that carries the whole context (a request's first block, or the first after a verifier "
            "restart): the edge first runs the prompt through the target, which can take many seconds on a CPU (s)",
            lo=0.01, hi=3600.0)
        p["verdict_retries"] = declare(self, "verdict_retries", 2,
                                       "on a verdict timeout, resend the same block (same request and round) this many times before the edge counts as lost; the verifier answers a resent block idempotently",
                                       lo=0, hi=100)
        p["on_edge_loss"] = declare(self, "on_edge_loss", "error", "on a lost edge: 'error' aborts the goal, 'drafter_only' goes on with the drafter alone", choices=EDGE_LOSS)
        p["edge_retry_s"] = declare(self, "edge_retry_s", 2.0, "in drafter-only mode, try the edge again at most this often (s)", lo=0.0, hi=3600.0)
        p["seed"] = declare(self, "seed", 0, "seed of the drafter's sampling", lo=0, hi=2**31 - 1)
        p["threads"] = declare(self, "threads", 1, "torch CPU threads", lo=1, hi=256)
        check_choice("method", p["method"], METHODS)
        check_choice("protocol", p["protocol"], PROTOCOLS)
        check_choice("on_edge_loss", p["on_edge_loss"], EDGE_LOSS)
        self.add_on_set_parameters_callback(frozen_after_start(
            {"drafter_model", "target_tokenizer_model", "threads"},
            {"method": METHODS, "protocol": PROTOCOLS, "on_edge_loss": EDGE_LOSS},
        ))

        from ..msg import ChannelState, DraftBlock, HiddenReply, HiddenRequest, Verdict
        from ..action import Generate

        self._DraftBlock, self._HiddenReply = DraftBlock, HiddenReply
        self._Generate = Generate
        self._block_pub = self.create_publisher(DraftBlock, "draft_block", RELIABLE_QOS)
        self._reply_pub = self.create_publisher(HiddenReply, "hidden_reply", RELIABLE_QOS)
        self.create_subscription(Verdict, "verdict", self._on_verdict, RELIABLE_QOS)
        self.create_subscription(HiddenRequest, "hidden_request", self._on_hidden_request, RELIABLE_QOS)
        self.create_subscription(ChannelState, "channel_state", self._on_channel_state, RELIABLE_QOS)
        self._action = ActionServer(
            self, Generate, "generate", self._execute,
            goal_callback=self._on_goal, cancel_callback=lambda _req: CancelResponse.ACCEPT,
            feedback_pub_qos_profile=FEEDBACK_QOS,
        )

        self._lm = None
        self._target_tok = None
        self._load_error: str | None = None
        self._goal_lock = threading.Lock()
        self._cv = threading.Condition()
        self._awaiting: tuple[str, int] | None = None  # (request_id, round_id) of the block in flight
        self._request_ids: collections.deque[str] = collections.deque(maxlen=64)  # recent requests of this node
        self._verdict = None
        self._last_block: tuple[str, int, np.ndarray] | None = None  # for hidden requests
        self._totals = _new_totals()  # of the running goal
        self._channel: LinkChannel | None = None
        self._mean_mismatch = 0.0
        self._loader = threading.Thread(target=self._load, name="load_model", daemon=True)
        self._loader.start()

    # ------------------------------------------------------------------ parameters and loading
    def _param(self, name):
        return self.get_parameter(name).value

    def _load(self) -> None:
        try:
            import torch

            from ..lm import CausalLM
            from ..models import load_model

            torch.set_num_threads(int(self._param("threads")))
            spec = self._param("drafter_model")
            t0 = time.perf_counter()
            model, tok = load_model(spec)
            lm = CausalLM(model, tok)
            target_spec = self._param("target_tokenizer_model")
            target_tok = None
            if target_spec and not target_spec.startswith("tiny-random"):
                target_tok = load_tokenizer(target_spec)
                if same_vocabulary(tok, target_tok):
                    target_tok = None
            self._lm, self._target_tok = lm, target_tok
            self.get_logger().info(f"drafter {spec} loaded in {time.perf_counter() - t0:.1f} s"
                                   + (f"; cross-tokenizer with {target_spec}" if target_tok is not None else ""))
        except Exception as exc:  # reported on every goal; the node stays up
            self._load_error = f"{type(exc).__name__}: {exc}"
            self.get_logger().error(f"loading the drafter failed: {self._load_error}")

    # ------------------------------------------------------------------ action
    def _on_goal(self, _goal) -> GoalResponse:
        if self._lm is None:
            why = self._load_error or f"drafter model {self._param('drafter_model')} is still loading"
            self.get_logger().warning(f"goal rejected: {why}")
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _goal_config(self, goal) -> dict:
        """Goal fields over parameter defaults, validated (ValueError names the field)."""
        cfg = {
            "method": goal.method or self._param("method"),
            "k": int(goal.k) or int(self._param("k")),
            "tau": float(goal.tau) if goal.tau >= 0 else float(self._param("tau")),
            "protocol": goal.protocol or self._param("protocol"),
            "max_new_tokens": int(goal.max_new_tokens) or int(self._param("max_new_tokens")),
            "temperature": float(goal.temperature) if goal.temperature >= 0 else float(self._param("temperature")),
        }
        if cfg["method"] not in METHODS:
            raise ValueError(f"method '{cfg['method']}' is not served by drafter_node; use one of {', '.join(METHODS)}")
        if cfg["protocol"] not in PROTOCOLS:
            raise ValueError(f"protocol '{cfg['protocol']}' is not one of {', '.join(PROTOCOLS)}")
        if not 1 <= cfg["k"] <= 256:
            raise ValueError(f"k must be in [1, 256], got {cfg['k']}")
        if not 0 <= cfg["temperature"] <= 10:
            raise ValueError(f"temperature must be in [0, 10], got {cfg['temperature']}")
        if cfg["method"] == "reject":
            if cfg["temperature"] <= 0:
                raise ValueError("method reject samples: give the goal (or the drafter_node parameter) a temperature > 0")
            if cfg["protocol"] in ("fh", "sh"):
                raise ValueError("method reject uploads the drafter distributions: use protocol ids or adaptive")
            if self._target_tok is not None:
                raise ValueError("method reject needs one vocabulary; this drafter drafts across tokenizers")
        return cfg

    async def _execute(self, goal_handle):
        """The action's execute callback: the goal runs in its own thread, the executor stays free."""
        return await offload(self, self._run_goal, goal_handle)

    def _run_goal(self, goal_handle):
        Result = self._Generate.Result
        with self._goal_lock:
            t_start = time.perf_counter()
            result = Result()
            out: list[int] = []
            rounds = 0
            self._totals = _new_totals()
            try:
                cfg = self._goal_config(goal_handle.request)
                rounds = self._run(goal_handle, cfg, out)
                status = "canceled" if goal_handle.is_cancel_requested else "succeeded"
            except (_GoalFailed, ValueError) as exc:
                status, result.error = "aborted", str(exc)
            except Exception as exc:  # a bug must not kill the node; the client gets the reason
                self.get_logger().error(f"goal failed: {exc!r}")
                status, result.error = "aborted", f"internal error: {type(exc).__name__}: {exc}"
            latency = time.perf_counter() - t_start
            result.text = self._decode(out)
            result.token_ids = out
            result.rounds = rounds
            result.aal = len(out) / rounds if rounds else 0.0
            result.latency_s = latency
            result.tokens_per_s = len(out) / latency if latency > 0 else 0.0
            t = self._totals
            result.uplink_bytes, result.downlink_bytes = t["up"], t["down"]
            result.draft_time_s, result.round_trip_s, result.edge_time_s = t["draft_s"], t["round_trip_s"], t["edge_s"]
            result.copy_rounds, result.copied_tokens = t["copy_rounds"], t["copied"]
            result.hidden_requests = t["hidden_requests"]
            result.drafter_only_rounds = t["drafter_only_rounds"]
            if status == "canceled":
                result.error = "canceled"
                goal_handle.canceled()
            elif status == "aborted":
                self.get_logger().warning(f"goal aborted: {result.error}")
                goal_handle.abort()
            else:
                goal_handle.succeed()
            return result

    # ------------------------------------------------------------------ one request
    def _prompt_ids(self, prompt: str, chat: bool) -> tuple[list[int], list[int]]:
        """(drafter prompt ids, target prompt ids)."""
        lm = self._lm
        if lm.tokenizer is None:
            ids = text_to_ids(prompt)
            bad = [i for i in ids if not 0 <= i < lm.vocab_size]
            if bad:
                raise WireError(f"prompt: ids {bad[:5]} outside the vocabulary [0, {lm.vocab_size})")
            return ids, ids
        d_ids = encode_prompt(lm.tokenizer, prompt, chat)
        t_ids = encode_prompt(self._target_tok, prompt, chat) if self._target_tok is not None else d_ids
        return d_ids, t_ids

    def _decode(self, ids: list[int]) -> str:
        tok = self._target_tok if self._target_tok is not None else (self._lm.tokenizer if self._lm else None)
        if tok is None:
            return " ".join(map(str, ids))
        return tok.decode(ids, skip_special_tokens=True)

    def _eos(self) -> set[int]:
        if self._target_tok is not None:
            return {int(self._target_tok.eos_token_id)} if self._target_tok.eos_token_id is not None else set()
        return self._lm.eos_ids()

    def _run(self, goal_handle, cfg: dict, out: list[int]) -> int:
        """The rounds of one request; appends committed ids to ``out``; returns the number of rounds."""
        goal = goal_handle.request
        d_prompt, t_prompt = self._prompt_ids(goal.prompt, bool(self._param("chat")))
        drafter = Drafter(self._lm, self._target_tok, temperature=cfg["temperature"],
                          seed=int(self._param("seed")), min_confidence=float(self._param("min_confidence")))
        drafter.begin(d_prompt, len(t_prompt))
        request_id = uuid.UUID(bytes=bytes(goal_handle.goal_id.uuid)).hex[:16]  # the goal id, shortened
        with self._cv:
            self._request_ids.append(request_id)
        eos = self._eos()
        timeouts = {name: float(self._param(name)) for name in ("verdict_timeout_s", "first_verdict_timeout_s")}
        retries = int(self._param("verdict_retries"))
        fallback = self._param("on_edge_loss") == "drafter_only"
        retry_s = float(self._param("edge_retry_s"))
        need_context = True  # the verifier has no context for this request yet
        edge_down = False
        next_try = 0.0
        resends = 0
        text_sent = ""
        round_id = 0  # rounds sent or drafted alone (DraftBlock.round_id)
        rounds = 0  # rounds that committed tokens (the result's rounds; a resent round does not count)
        done = cfg["max_new_tokens"] <= 0
        while not done:
            if goal_handle.is_cancel_requested:
                break
            block = drafter.draft(cfg["k"])
            self._totals["draft_s"] += block.drafter_time_s
            if not block.token_ids:
                raise _GoalFailed(f"round {round_id}: the drafter proposed no token (cross-tokenizer alignment)")
            use_edge = not edge_down or (time.monotonic() >= next_try and self._block_pub.get_subscription_count() > 0)
            committed = None
            if use_edge:
                msg = self._block_msg(request_id, round_id, block, cfg,
                                      context=t_prompt + drafter.committed if need_context else None,
                                      copy_budget=cfg["max_new_tokens"] - len(out) - len(block.token_ids) - 1)
                # A block with the whole context makes the edge prefill it first; a probe of a lost
                # edge keeps the short wait, so that the robot does not stall on a dead link.
                wait = "first_verdict_timeout_s" if need_context and not edge_down else "verdict_timeout_s"
                verdict, err = self._exchange(msg, wait, timeouts[wait])
                for attempt in range(1, (0 if edge_down else retries) + 1):  # no resends of a probe of a lost edge
                    if verdict is not None or goal_handle.is_cancel_requested:
                        break
                    # Lost or late (block or verdict): resend the same block; the verifier answers
                    # a resent round with the verdict it already gave, so nothing is committed twice.
                    self.get_logger().warning(f"request {request_id} round {round_id}: {err}; "
                                              f"resending the block ({attempt}/{retries})")
                    stamp_now(self, msg.header)
                    verdict, err = self._exchange(msg, wait, timeouts[wait])
                if verdict is None and goal_handle.is_cancel_requested:
                    break
                round_id += 1
                if err is None:
                    committed = [int(i) for i in verdict.committed_ids]
                    need_context, edge_down, resends = False, False, 0
                    self._observe_mismatches(len(block.token_ids), int(verdict.accepted_count))
                    with self._cv:
                        self._totals["edge_s"] += float(verdict.edge_time_s)
                        self._totals["copy_rounds"] += int(verdict.copy_rounds)
                        self._totals["copied"] += int(verdict.copied_count)
                elif verdict is not None and verdict.error.startswith(UNKNOWN_REQUEST) and resends < 2:
                    # The verifier lost this request (restart): draft again, send the whole context.
                    self.get_logger().info(f"request {request_id}: {err}")
                    need_context, resends = True, resends + 1
                    continue
                elif not fallback:
                    raise _GoalFailed(f"edge lost in round {round_id - 1}: {err}")
                else:
                    if not edge_down:
                        self.get_logger().warning(f"request {request_id}: edge lost ({err}); continuing with the drafter alone")
                    edge_down, need_context, next_try = True, True, time.monotonic() + retry_s
            else:
                round_id += 1
            if committed is None:  # drafter-only round: commit the drafter's own tokens
                committed = [int(i) for i in block.token_ids]
                self._totals["drafter_only_rounds"] += 1
            drafter.commit(committed)
            rounds += 1
            new, done = clip(committed, len(out), cfg["max_new_tokens"], eos)
            out.extend(new)
            text_sent = self._feedback(goal_handle, out, new, text_sent, round_id - 1)
        return rounds

    def _observe_mismatches(self, drafted: int, accepted: int) -> None:
        """Running mean of rejected draft positions: the E|S| estimate of protocol ``adaptive``."""
        self._mean_mismatch = 0.8 * self._mean_mismatch + 0.2 * (drafted - accepted)

    def _feedback(self, goal_handle, out: list[int], new: list[int], text_sent: str, round_id: int) -> str:
        if not new:
            return text_sent
        fb = self._Generate.Feedback()
        full = self._decode(out).rstrip("\ufffd")  # an incomplete character waits for the next round
        if full.startswith(text_sent):
            fb.text_delta, text_sent = full[len(text_sent):], full
        fb.token_ids_delta = new
        fb.committed_length = len(out)
        fb.round_id = round_id
        goal_handle.publish_feedback(fb)
        return text_sent

    # ------------------------------------------------------------------ messages
    def _protocol(self, cfg: dict, k: int) -> str:
        proto = cfg["protocol"]
        if cfg["method"] != "wisv":
            return "ids" if proto == "adaptive" else proto
        if proto != "adaptive":
            return proto
        if self._channel is None:
            return "fh"
        fmt = WireFormat(hidden_dim=self._lm.hidden_size)
        return choose_protocol(fmt, k, self._channel, min(self._mean_mismatch, k)).value

    def _block_msg(self, request_id: str, round_id: int, block, cfg: dict, context: list[int] | None,
                   copy_budget: int = 0):
        msg = self._DraftBlock()
        stamp_now(self, msg.header)
        msg.request_id = request_id
        msg.round_id = round_id
        msg.prefix_length = block.prefix_length
        if context is not None:
            msg.context_ids = context
        msg.token_ids = block.token_ids
        msg.k = cfg["k"]
        msg.method = cfg["method"]
        msg.tau = cfg["tau"]
        msg.temperature = cfg["temperature"]
        proto = "ids" if cfg["method"] == "reject" else self._protocol(cfg, len(block.token_ids))
        msg.protocol = _PROTO_CODE[proto]
        if proto == "fh":
            fill_hidden(msg.hidden, block.hidden, dtype=HIDDEN_WIRE_DTYPE)
        if cfg["method"] == "reject":
            # float32: the acceptance ratio must use the distribution the drafter sampled from.
            fill_tensor(msg.draft_probs, block.probs.float().numpy(), "float32", "draft_probs")
        msg.drafter_time = block.drafter_time_s
        msg.copy_budget = max(0, copy_budget)
        with self._cv:
            self._last_block = (request_id, round_id, block.hidden)
        return msg

    def _exchange(self, msg, timeout_name: str, timeout_s: float):
        """Publish a block, wait up to ``timeout_s`` (parameter ``timeout_name``) for its verdict;
        (verdict, None) or (verdict or None, reason)."""
        key = (msg.request_id, msg.round_id)
        with self._cv:
            self._awaiting, self._verdict = key, None
        self._count_bytes(up=msg_bytes(msg))
        t0 = time.perf_counter()
        self._block_pub.publish(msg)
        with self._cv:
            self._cv.wait_for(lambda: self._verdict is not None, timeout_s)
            verdict, self._awaiting = self._verdict, None
            if verdict is not None:
                self._totals["round_trip_s"] += time.perf_counter() - t0
        if verdict is None:
            return None, f"no verdict within {timeout_name} = {timeout_s} s"
        self._count_bytes(down=msg_bytes(verdict))
        if verdict.error:
            return verdict, f"verifier error: {verdict.error}"
        n = len(verdict.committed_ids)
        copied = int(verdict.copied_count)
        if (not 1 <= n - copied <= len(msg.token_ids) + 1 or verdict.committed_length != msg.prefix_length + n
                or (copied and not msg.copy_budget)):
            return verdict, (f"inconsistent verdict: {n} committed ids ({copied} copied), committed_length "
                             f"{verdict.committed_length}, block prefix_length {msg.prefix_length}")
        return verdict, None

    def _count_bytes(self, up: int = 0, down: int = 0) -> None:
        with self._cv:
            self._totals["up"] += up
            self._totals["down"] += down

    def _on_verdict(self, msg) -> None:
        with self._cv:
            if self._awaiting == (msg.request_id, msg.round_id) and self._verdict is None:
                self._verdict = msg
                self._cv.notify_all()
                return
            ours = msg.request_id in self._request_ids
        if ours:
            self.get_logger().info(f"ignoring a stale or duplicate verdict: request {msg.request_id} round {msg.round_id}")
        else:  # another drafter's request on the same topic
            self.get_logger().debug(f"ignoring a verdict for request {msg.request_id} (not ours)")

    def _on_hidden_request(self, msg) -> None:
        with self._cv:
            last = self._last_block
        if last is None or (last[0], last[1]) != (msg.request_id, msg.round_id):
            self.get_logger().warning(f"hidden request for request {msg.request_id} round {msg.round_id}: not the last block; ignored")
            return
        hidden = last[2]
        positions = [int(p) for p in msg.positions]
        if any(not 0 <= p < hidden.shape[0] for p in positions):
            self.get_logger().warning(f"hidden request positions {positions} outside the block of {hidden.shape[0]}; ignored")
            return
        reply = self._HiddenReply()
        stamp_now(self, reply.header)
        reply.request_id, reply.round_id = msg.request_id, msg.round_id
        fill_hidden(reply.hidden, hidden[positions], positions, HIDDEN_WIRE_DTYPE)
        self._count_bytes(up=msg_bytes(reply), down=msg_bytes(msg))
        with self._cv:
            self._totals["hidden_requests"] += 1
        self._reply_pub.publish(reply)

    def _on_channel_state(self, msg) -> None:
        try:
            self._channel = LinkChannel(rate_bps=msg.rate_bps, per=msg.per, rtt_s=msg.rtt_s)
        except (TypeError, ValueError) as exc:
            self.get_logger().warning(f"ignoring channel_state: {exc}")


def main(args=None) -> None:
    run_node(DrafterNode, args=args)


if __name__ == "__main__":
    main()
