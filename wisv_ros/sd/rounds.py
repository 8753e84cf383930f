"""The round protocol of distributed speculative decoding, ROS-free: one loop for every transport.

A request is a sequence of rounds. In each round the robot drafts a block, sends it to the edge,
and commits what the edge's verdict commits (SPEC "One round"). Around that, this module owns
everything that keeps a request alive on a real link:

Robot side (``RobotSession``; used by ``generate`` in process and by ``drafter_node`` over DDS):

* round ids: each block gets the next ``round_id`` of its request;
* the whole context (``context_ids``) goes with a request's first block, and again whenever the
  edge may have lost it (``unknown request`` verdict after a verifier restart, or after edge loss);
* resends: a block whose verdict does not come within ``verdict_timeout_s`` (a block carrying the
  whole context: ``first_verdict_timeout_s``) is sent again, same request and round, up to
  ``verdict_retries`` times; the edge answers a resent round with the verdict it already gave;
* edge loss: with ``on_edge_loss = "error"`` the request fails (``EdgeLost``); with
  ``"drafter_only"`` the robot commits its own drafts (drafter-only rounds) and tries the edge again
  at most every ``edge_retry_s``, with the whole context;
* accounting: rounds, drafter-only rounds, copy rounds, drafting and edge time.

Edge side (``EdgeSessions``; used by ``verifier_node``, ``bag reverify`` and ``generate``):

* one core ``Verifier`` (session) per request id, the newest ``max_requests`` kept;
* checks of every block (method, tau, temperature, ids, prefix length, round order) with an error
  reply that names the field;
* idempotent resends: the last reply of each request is kept and given again to a resent block;
* two-phase verification: ``begin`` runs the target pass and says which drafter hiddens the decision
  needs (``EdgeRound.hidden_positions``); the caller fetches them however they travel; ``finish``
  decides, then runs SwitchSD copy rounds (at most ``copy_max_rounds``, and the block's
  ``copy_budget`` tokens) whose tokens end the reply's ``committed_ids``;
* chunked prefill (``prefill``; engines with a KV sequence per request): a block whose context
  still needs many tokens fed is prefilled a chunk at a time, and ``PrefillQueue`` serves the
  other requests' blocks between two chunks, so one robot's long prompt cannot hold the target;
* pre-projected drafter rows (``BlockRequest.head_id``, ``wisv.head.ProjectedHidden``): the robot
  may send the decision head's drafter projection instead of its hiddens (``RobotSession``'s
  ``projection``); the edge refuses rows of another head than its judge's (``HeadMismatch``).

Transports plug in with ``EdgeLink.exchange(request, timeout_s) -> EdgeReply | None`` on the robot
side; ``InProcessLink`` connects a ``RobotSession`` to an ``EdgeSessions`` directly.

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
import time
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from wisv_ros.link.channel import ChannelState, WireFormat, choose_protocol
from wisv_ros.sd.acceptance import FLY_ENTROPY, FLY_WINDOW
from wisv_ros.sd.drafting import DraftBlock, Drafter, encode_prompt, pick_token
from wisv_ros.sd.lm import CausalLM
from wisv_ros.sd.metrics import DecodeStats
from wisv_ros.sd.placement import PLACEMENT_MODES, PlacementModel
from wisv_ros.sd.roundlog import RoundRecord
from wisv_ros.sd.verification import Judge, Method, Verdict, Verifier
from wisv_ros.switchsd.copying import CopyConfig
from wisv_ros.wisv.head import HEAD_MISMATCH, DraftProjection, HeadMismatch, ProjectedHidden, check_head_id

__all__ = [
    "EDGE_LOSS",
    "PROTOCOLS",
    "UNKNOWN_REQUEST",
    "EDGE_LOADING",
    "EDGE_BUSY",
    "REQUEST_ID",
    "BlockRequest",
    "EdgeLink",
    "EdgeLost",
    "EdgeReply",
    "EdgeRound",
    "EdgeSessions",
    "Generation",
    "InProcessLink",
    "PrefillQueue",
    "RobotPolicy",
    "RobotResult",
    "RobotSession",
    "clip",
    "generate",
    "generate_target_only",
    "pick_batch",
    "protocol_chooser",
]

PROTOCOLS = ("ids", "fh", "sh")  # how a block travels: ids only, ids + all hiddens, ids then hiddens on request
EDGE_LOSS = ("error", "drafter_only", "wait")
UNKNOWN_REQUEST = "unknown request"  # start of the error of a block whose request the edge does not know
EDGE_LOADING = "edge loading"  # start of the error of a verifier that is up but has not loaded its target yet
EDGE_BUSY = "edge busy"  # start of the error of a verifier whose block queue is full (resend later)
#: What a request id may be (DraftBlock.request_id): DDS strings end at a NUL byte, so free text could
#: make two ids one; the drafter's own ids are 16 hex digits.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


@dataclasses.dataclass
class BlockRequest:
    """One block as it travels robot -> edge (the DraftBlock message as plain data).

    context_ids: the whole committed context (prompt included) when the edge needs it, else empty.
    hidden: [K, d_D] drafter hiddens; travel with the block under protocol fh only (under sh the
        edge asks for the rows it needs). With ``head_id`` set: [K, hidden] projections of those
        hiddens by that decision head (``wisv.head.DraftProjection``) instead.
    head_id: '' = ``hidden`` holds raw drafter hiddens; else the ``head_id`` of the decision head
        whose drafter projection it holds (the wire: ``HiddenStates.head_id``).
    draft_probs: [K, V] the drafter's distributions (method reject only).
    method: "" = the edge's default. copy_budget: tokens that copy rounds after the block may commit.
    """

    request_id: str
    round_id: int
    prefix_length: int
    token_ids: list[int]
    k: int
    protocol: str = "ids"
    method: str = ""
    tau: float = 0.0
    temperature: float = 0.0
    context_ids: list[int] = dataclasses.field(default_factory=list)
    hidden: np.ndarray | None = None
    draft_probs: np.ndarray | None = None
    draft_time_s: float = 0.0
    copy_budget: int = 0
    head_id: str = ""
    robot: str = ""  # edge side only (not on the wire): the robot whose topics the block came on

    def key(self) -> tuple:
        """What identifies a resend of the same block."""
        return (self.round_id, self.prefix_length, tuple(self.token_ids))

    def drafter_rows(self) -> np.ndarray | ProjectedHidden | None:
        """``hidden`` as the judge takes it: raw [K, d_D], or ``ProjectedHidden`` when ``head_id`` is set."""
        if self.hidden is not None and self.head_id:
            return ProjectedHidden(self.hidden, self.head_id)
        return self.hidden


@dataclasses.dataclass
class EdgeReply:
    """The edge's answer to one block (the Verdict message as plain data).

    committed_ids: the block's accepted drafts + correction/bonus, then the tokens of the copy rounds
    that followed (``copy_committed`` of them, in ``copy_rounds`` rounds). ``error``: the block is void.
    verdict / copies: the core verdicts behind the reply (edge side only; not on the wire).
    """

    request_id: str
    round_id: int
    accepted: int = 0
    correction_id: int = -1
    committed_ids: list[int] = dataclasses.field(default_factory=list)
    committed_length: int = 0
    copy_rounds: int = 0
    copy_committed: int = 0
    edge_time_s: float = 0.0
    error: str = ""
    edge_token_s: float = 0.0  # the edge's measured seconds per generated token (0 = not measured yet)
    edge_load: float = 0.0  # share of the edge's time that other robots' work took lately (0..1)
    verdict: Verdict | None = None
    copies: list[Verdict] = dataclasses.field(default_factory=list)
    resent: bool = False  # the edge gave this reply before (a resent block)


# =========================================================================== edge side
class BlockError(ValueError):
    """A block the edge refuses; the message names the field."""


@dataclasses.dataclass
class _Session:
    verifier: Verifier
    last_round: int
    last_key: tuple | None = None
    last_reply: EdgeReply | None = None
    slot: int | None = None  # the target's KV sequence of this request (engines with sessions)
    pending: bool = False  # between begin and finish: its draft sits in that sequence
    staged: tuple | None = None  # key of the block whose context ``prefill`` feeds ahead of its ``begin``
    prefill_tokens: int = 0  # context tokens fed by ``prefill`` since the last verdict (counted in it)
    prefill_s: float = 0.0
    robot: str = ""  # the robot that opened the request; only it may continue it


@dataclasses.dataclass
class EdgeRound:
    """A block between the target pass and the decision (``EdgeSessions.begin`` -> ``finish``)."""

    request: BlockRequest
    hidden_positions: list[int]  # drafter hiddens the decision needs (fetch them under protocol sh)
    _session: _Session
    _pass: object


class EdgeSessions:
    """The edge side of the round protocol over one target model.

    Args:
        lm: the target (shared by every request).
        method: the acceptance rule of blocks whose ``method`` is empty.
        judge: the WISV decision head (``verification.Judge``); None = wisv rejects every mismatch.
        copy: SwitchSD copy mode after each block (None = off).
        seed: seeds rejection sampling (per request).
        max_requests: requests whose session is kept (beyond: the least recently used request of the
            robot holding the most is dropped).
        copy_max_rounds: copy rounds after one block at most.
        verifier_for: makes the ``Verifier`` of a new request (default: one over ``lm`` with the
            arguments above); ``generate`` hands in its caller's verifier this way.
        round_log: called with a ``roundlog.RoundRecord`` for every verified block and every copy
            round (e.g. a ``roundlog.RoundLog``); a resent block is not logged twice.
        max_context: the longest committed context plus block a request may reach (tokens); a block
            beyond it is refused by name before any model work (one robot must not hold the target
            for minutes or exhaust its memory).
        max_block: the most draft tokens one block may carry.
        head_id: the ``head_id`` of the drafter projections the judge takes; None = the judge's own
            ``head_id`` attribute (``wisv.head.HeadJudge``), '' when it has none. A block or SH
            reply projected by another head is refused (``HeadMismatch``, the error names
            ``head_id``).
        fly_entropy, fly_window: method fly's entropy gate and deferred window (``acceptance.fly_accept``).
        max_edge_tokens: an edge round (method target_only) generates at most this many tokens, whatever
            its ``k`` asks (the reply commits fewer): one robot's edge round holds the target for at most
            that many passes while other robots' blocks wait.
        channel_tau: τ per channel (``link.channel.TauSchedule``): called with every wisv block
            (``BlockRequest``: its ``robot`` names whose channel), its value replaces the block's own
            ``tau`` (None: the block's tau holds).

    A request belongs to the robot whose block opened it (``BlockRequest.robot``, the verifier's
    per-robot topics): a block of another robot under the same request id is refused by name.
    """

    def __init__(self, lm: CausalLM, *, method: Method = Method.GREEDY, judge: Judge | None = None,
                 copy: CopyConfig | None = None, seed: int = 0, max_requests: int = 16, copy_max_rounds: int = 32,
                 verifier_for: Callable[[], Verifier] | None = None,
                 round_log: Callable[[RoundRecord], None] | None = None,
                 max_context: int = 8192, max_block: int = 256, head_id: str | None = None, fly_entropy: float = FLY_ENTROPY, fly_window: int = FLY_WINDOW,
                 channel_tau: Callable[[BlockRequest], float] | None = None, max_edge_tokens: int = 32):
        if max_context < 2 or max_block < 1 or max_edge_tokens < 1:
            raise ValueError(f"max_context must be >= 2, max_block and max_edge_tokens >= 1 (got {max_context}, {max_block}, "
                             f"{max_edge_tokens})")
        self.max_edge_tokens = max_edge_tokens
        self.max_context = max_context
        self.max_block = max_block
        self.fly_entropy, self.fly_window = fly_entropy, fly_window
        self.channel_tau = channel_tau
        self.lm = lm
        self.round_log = round_log
        self.verifier_for = verifier_for
        self.method = Method(method)
        self.judge = judge
        self.head_id = str(getattr(judge, "head_id", "") or "") if head_id is None else head_id
        self.copy = copy
        self.seed = seed
        self.max_requests = max_requests
        self.copy_max_rounds = copy_max_rounds
        self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()
        self._eos = lm.eos_ids()
        self.token_s: float | None = None  # measured target seconds per generated token (edge rounds; Verdict.edge_token_s)

    def measure_token_s(self, context: int = 32, steps: int = 3) -> float:
        """Time one-token target passes after a ``context``-token filler, before any request is served
        (the prior of ``token_s`` until edge rounds measure it); returns seconds per token. The
        target's cache is empty again afterwards."""
        if self._sessions:
            raise RuntimeError("measure_token_s runs before the first request (it uses the target's cache)")
        if getattr(self.lm, "n_sessions", 1) > 1:
            self.lm.use(0)
        self.lm.reset()
        filler = [0] * context  # any id: the cost of a pass does not depend on the tokens
        self.lm.feed(filler, n_logits=1)
        times = []
        for _ in range(steps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            self.lm.feed(filler[:1], n_logits=1)
            times.append(time.perf_counter() - t0)
        self.lm.reset()
        self.token_s = float(np.median(times[1:]))
        return self.token_s

    def context(self, request_id: str) -> list[int] | None:
        """The committed context of a request (None: unknown)."""
        s = self._sessions.get(request_id)
        return None if s is None else s.verifier.context

    def rewind(self, request_id: str, context: Sequence[int]) -> None:
        """Set a known request's committed context (``bag reverify`` follows a recording with it)."""
        self._sessions[request_id].verifier.context = list(context)

    def handle(self, req: BlockRequest,
               fetch_hidden: Callable[[BlockRequest, list[int]], np.ndarray | ProjectedHidden | None] | None = None
               ) -> EdgeReply:
        """Both phases: ``begin``, the drafter hiddens (``req.drafter_rows()`` under fh, ``fetch_hidden``
        under sh: a [K, d_D] array with the asked rows filled, a ``ProjectedHidden`` of them, or None),
        ``finish``."""
        return self.complete(self.begin(req), fetch_hidden)

    def complete(self, out: EdgeRound | EdgeReply,
                 fetch_hidden: Callable[[BlockRequest, list[int]], np.ndarray | ProjectedHidden | None] | None = None
                 ) -> EdgeReply:
        """What ``handle`` does after ``begin`` (or ``begin_many``): the reply of ``out``, with the
        edge's measured time per generated token (``EdgeReply.edge_token_s``)."""
        if isinstance(out, EdgeReply):
            reply = out
        else:
            req = out.request
            hidden = None
            if out.hidden_positions:
                if req.protocol == "fh":
                    hidden = req.drafter_rows()
                elif req.protocol == "sh" and fetch_hidden is not None:
                    hidden = fetch_hidden(req, out.hidden_positions)
            reply = self.finish(out, hidden)
        reply.edge_token_s = self.token_s or 0.0
        return reply

    def begin(self, req: BlockRequest) -> EdgeRound | EdgeReply:
        """Check the block and run the target pass; an ``EdgeReply`` when it is answered already
        (a resend) or refused (``error``)."""
        prep = self._prepare(req)
        if isinstance(prep, EdgeReply):
            return prep
        session, block = prep
        try:
            self._bind(session)
            if req.method == Method.TARGET_ONLY.value:
                return self._remember(session, self._edge_round(req, session))
            tp = session.verifier.target_pass(block)
        except Exception as exc:  # noqa: BLE001 - a block never takes the edge down
            return self._remember(session, self._error(req, exc))
        session.pending = True
        return EdgeRound(req, list(tp.hidden_positions), session, tp)

    def _edge_round(self, req: BlockRequest, session: _Session) -> EdgeReply:
        """Placement edge: the target generates up to ``req.k`` tokens after the context itself (one
        pass a token, each an empty block's bonus token; copy mode's rounds in between as after a
        block), and the reply commits them all. ``token_s``: the measured seconds per token."""
        v = session.verifier
        steps: list[Verdict] = []
        copies: list[Verdict] = []
        committed: list[int] = []
        prefill_tokens, prefill_s = session.prefill_tokens, session.prefill_s
        session.prefill_tokens, session.prefill_s = 0, 0.0
        want = min(req.k, self.max_edge_tokens)
        # REJECT (temperature > 0): the bonus token is sampled from the target, no draft to test.
        probs = torch.zeros((0, self.lm.vocab_size)) if v.method == Method.REJECT else None
        while len(committed) < want and not self._eos.intersection(committed):
            step = v.verify(DraftBlock(token_ids=[], hidden=None, probs=probs, prefix_length=len(v.context)))
            steps.append(step)
            committed += step.committed_ids
            more = self._copy_rounds(v, step.committed_ids, want - len(committed))
            copies += more
            committed += [t for c in more for t in c.committed_ids]
        compute_s = sum(s.target_time_s for s in steps)
        plain = [s.target_time_s for s in steps if s.target_tokens <= 1]  # not those that fed a context too
        if plain:
            mean = sum(plain) / len(plain)
            self.token_s = mean if self.token_s is None else 0.8 * self.token_s + 0.2 * mean
        total = Verdict(accepted=0, correction_id=committed[-1], committed_ids=list(committed), mismatches=[],
                        target_time_s=compute_s + sum(c.target_time_s for c in copies) + prefill_s,
                        target_tokens=sum(s.target_tokens for s in steps) + prefill_tokens)
        if self.round_log is not None:
            common = dict(request_id=req.request_id, round_id=req.round_id, method=Method.TARGET_ONLY.value, k=req.k)
            prefix = req.prefix_length
            for i, s in enumerate(steps):
                self.round_log(RoundRecord(kind="target", prefix_length=prefix, committed=len(s.committed_ids),
                                           target_tokens=s.target_tokens + (prefill_tokens if i == 0 else 0),
                                           target_time_s=s.target_time_s + (prefill_s if i == 0 else 0.0), **common))
                prefix += len(s.committed_ids)
            for c in copies:  # (their position among the steps is not kept: the log prices each alone)
                self.round_log(RoundRecord(kind="copy", prefix_length=prefix, drafted=c.drafted, accepted=c.accepted,
                                           committed=len(c.committed_ids), target_tokens=c.target_tokens,
                                           copy_candidates=c.copy_candidates, target_time_s=c.target_time_s, **common))
                prefix += len(c.committed_ids)
        copied = sum(len(c.committed_ids) for c in copies)
        return EdgeReply(req.request_id, req.round_id, accepted=0, correction_id=committed[-1],
                         committed_ids=list(committed), committed_length=len(v.context), copy_rounds=len(copies),
                         copy_committed=copied, verdict=total, copies=copies)

    def begin_many(self, reqs: Sequence[BlockRequest]) -> list[EdgeRound | EdgeReply]:
        """``begin`` of blocks of different requests with ONE target pass for all of them
        (``LlamaCppLM.feed_many``: each request's tokens in its own KV sequence); the result per
        block is what ``begin`` gives it alone (logits equal up to the rounding of a larger batch).
        Each ``EdgeRound``'s ``target_time_s`` is the shared pass's (the wait every block saw).

        Engines without a KV sequence per request, or a single block, take ``begin`` one by one.
        Blocks of one request must not share a call (ValueError): a request has one block in flight.
        """
        ids = [r.request_id for r in reqs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"begin_many: one block per request, got request ids {ids}")
        if len(reqs) > getattr(self.lm, "n_sessions", 1) > 1:
            raise ValueError(f"begin_many: {len(reqs)} blocks, more than the target's {self.lm.n_sessions} KV sequences")
        if len(reqs) <= 1 or getattr(self.lm, "n_sessions", 1) <= 1 or not hasattr(self.lm, "feed_many"):
            return [self.begin(r) for r in reqs]
        out: list[EdgeRound | EdgeReply | None] = [None] * len(reqs)
        live: list[tuple[int, _Session, DraftBlock, list[int]]] = []
        for i, req in enumerate(reqs):
            if req.method == Method.TARGET_ONLY.value:  # generates its tokens one pass at a time
                out[i] = self.begin(req)
                continue
            prep = self._prepare(req)
            if isinstance(prep, EdgeReply):
                out[i] = prep
                continue
            session, block = prep
            try:
                self._bind(session)  # never takes the sequence of a block bound before it (pending)
                fed = session.verifier.pass_tokens(block)
            except Exception as exc:  # noqa: BLE001
                out[i] = self._remember(session, self._error(req, exc))
                continue
            session.pending = True
            live.append((i, session, block, fed))
        if live:
            t0 = time.perf_counter()
            try:
                steps = self.lm.feed_many([(s.slot, fed) for _, s, _, fed in live])
            except Exception as exc:  # noqa: BLE001 - the whole pass failed: every block of it is answered
                for i, s, _, _ in live:
                    s.pending = False
                    out[i] = self._remember(s, self._error(reqs[i], exc))
                return out
            dt = time.perf_counter() - t0
            for (i, s, block, fed), step in zip(live, steps):
                tp = s.verifier.pass_result(block, step, len(fed) - len(block.token_ids), dt)
                out[i] = EdgeRound(reqs[i], list(tp.hidden_positions), s, tp)
        return out

    def _prepare(self, req: BlockRequest) -> tuple[_Session, DraftBlock] | EdgeReply:
        """A resend's kept reply, a refusal, or the block's session (the round taken) and core block."""
        session = self._sessions.get(req.request_id)
        if (session is not None and session.last_reply is not None and session.last_key == req.key()
                and session.robot == req.robot):  # (another robot's copy is refused by _admit)
            return dataclasses.replace(session.last_reply, resent=True)
        try:
            session, method = self._admit(req)
        except (BlockError, HeadMismatch) as exc:
            return EdgeReply(req.request_id, req.round_id, error=str(exc))
        # From here the round is taken: its reply (or error) is kept for resends.
        session.last_round, session.last_key, session.last_reply = req.round_id, req.key(), None
        session.staged = None
        v = session.verifier
        tau = float(req.tau)
        if method == Method.WISV and self.channel_tau is not None:
            try:
                tau = float(self.channel_tau(req))
            except Exception as exc:  # noqa: BLE001 - a block never takes the edge down
                return self._remember(session, self._error(req, exc))
        if method == Method.TARGET_ONLY:  # the edge's own tokens: the target's argmax, or sampled from it
            method = Method.REJECT if req.temperature > 0 else Method.GREEDY
        v.method, v.tau, v.copy = method, tau, self.copy
        v.fly_entropy, v.fly_window = self.fly_entropy, self.fly_window
        if method == Method.REJECT:
            v.temperature = float(req.temperature)
        probs = torch.from_numpy(np.ascontiguousarray(req.draft_probs)) if req.draft_probs is not None else None
        return session, DraftBlock(token_ids=list(req.token_ids), hidden=req.hidden, probs=probs,
                                   prefix_length=req.prefix_length, draft_time_s=req.draft_time_s)

    def _bind(self, session: _Session) -> None:
        """Point the target at the request's own KV sequence when the engine keeps several
        (``LlamaCppLM`` with ``n_sessions`` > 1): switching between robots then costs no prefill.
        A request without one takes a free sequence, else the least recently used request's that is
        not between its two phases (that request prefills again when it comes back)."""
        n = getattr(self.lm, "n_sessions", 1)
        if n <= 1:
            return
        if session.slot is None:
            used = {s.slot for s in self._sessions.values() if s.slot is not None}
            free = [i for i in range(n) if i not in used]
            if free:
                slot = free[0]
            else:
                victim = next((s for s in self._sessions.values()
                               if s.slot is not None and s is not session and not s.pending), None)
                if victim is None:
                    raise BlockError(f"{EDGE_BUSY}: all {n} KV sequences hold requests between their two phases")
                slot, victim.slot = victim.slot, None
            self.lm.drop(slot)
            session.slot = slot
        self.lm.use(session.slot)

    def prefill(self, req: BlockRequest, chunk: int) -> int | EdgeReply:
        """Feed at most ``chunk`` tokens of the block's committed context into its request's KV
        sequence ahead of ``begin``; returns how many context tokens remain to be fed after this
        call (0: ``begin`` feeds the rest with the draft; at most ``chunk`` tokens are left to it),
        or an ``EdgeReply`` when the block is refused (the same reply a later ``begin`` gives it).

        A block carrying ``context_ids`` creates (stages) its request's session here; a block of a
        known request prefills whatever of its context its sequence lost. Only engines with a KV
        sequence per request (``n_sessions`` > 1) are prefilled in chunks: with one shared sequence
        another request's pass would undo the chunks, so this returns 0 and ``begin`` prefills whole.
        The chunks' tokens and time are added to the block's verdict (``target_tokens``, ``target_time_s``).
        """
        if chunk <= 0 or getattr(self.lm, "n_sessions", 1) <= 1:
            return 0
        session = self._sessions.get(req.request_id)
        if session is not None and session.last_key == req.key() and session.robot == req.robot:
            return 0  # a resend: begin answers it
        if req.context_ids and (session is None or session.staged != req.key()):
            try:
                session, _ = self._admit(req)
            except (BlockError, HeadMismatch) as exc:
                return EdgeReply(req.request_id, req.round_id, error=str(exc))
            session.staged = req.key()
        elif session is None or session.pending or session.robot != req.robot:
            return 0  # unknown, another robot's (begin refuses both), or between its two phases
        try:
            self._bind(session)
            todo = self.lm.sync(session.verifier.context)  # rolls back what the sequence holds beyond it
            if len(todo) <= chunk:
                return 0
            t0 = time.perf_counter()
            self.lm.prefill(todo[:chunk])
            session.prefill_tokens += chunk
            session.prefill_s += time.perf_counter() - t0
            return len(todo) - chunk
        except Exception as exc:  # noqa: BLE001 - a block never takes the edge down
            session.staged = None
            session.last_round, session.last_key = req.round_id, req.key()
            return self._remember(session, self._error(req, exc))

    def finish(self, rnd: EdgeRound, drafter_hidden: np.ndarray | ProjectedHidden | None = None) -> EdgeReply:
        """Decide (with the drafter hiddens at ``rnd.hidden_positions``, raw or projected, or None: reject
        every mismatch), run the copy rounds, and keep the reply for resends."""
        req, session = rnd.request, rnd._session
        session.pending = False
        try:
            self._bind(session)
            if isinstance(drafter_hidden, ProjectedHidden):  # SH: the reply names its head
                check_head_id(drafter_hidden.head_id, self.head_id)
            verdict = session.verifier.decide(rnd._pass, drafter_hidden)
            if session.prefill_tokens:  # the context fed ahead in chunks belongs to this block's pass
                verdict = dataclasses.replace(verdict, target_tokens=verdict.target_tokens + session.prefill_tokens,
                                              target_time_s=verdict.target_time_s + session.prefill_s)
                session.prefill_tokens, session.prefill_s = 0, 0.0
            copies = self._copy_rounds(session.verifier, verdict.committed_ids, req.copy_budget)
        except Exception as exc:  # noqa: BLE001
            return self._remember(session, self._error(req, exc))
        copied = [t for c in copies for t in c.committed_ids]
        reply = EdgeReply(req.request_id, req.round_id, accepted=verdict.accepted, correction_id=verdict.correction_id,
                          committed_ids=list(verdict.committed_ids) + copied,
                          committed_length=len(session.verifier.context), copy_rounds=len(copies),
                          copy_committed=len(copied), verdict=verdict, copies=copies)
        if self.round_log is not None:
            self._log_round(req, session.verifier, verdict, copies, drafter_hidden)
        return self._remember(session, reply)

    def _log_round(self, req: BlockRequest, v: Verifier, verdict: Verdict, copies: list[Verdict],
                   drafter_hidden: np.ndarray | ProjectedHidden | None) -> None:
        # hidden_dim: the width of the rows that travelled (a projection's, when pre-projected)
        hidden = req.hidden if req.hidden is not None else drafter_hidden
        hidden_dim = int(hidden.shape[-1]) if hidden is not None and hidden.ndim == 2 else 0
        method = v.method.value
        common = dict(request_id=req.request_id, round_id=req.round_id, method=method, k=req.k, tau=v.tau,
                      hidden_dim=hidden_dim)
        prefix = req.prefix_length
        head = [m for m in verdict.mismatches if m < verdict.accepted] if v.method == Method.WISV else []
        records = [RoundRecord(kind="block", protocol=req.protocol, prefix_length=prefix, drafted=len(req.token_ids),
                               accepted=verdict.accepted, mismatches=list(verdict.mismatches), head_accepted=head,
                               committed=len(verdict.committed_ids), target_tokens=verdict.target_tokens,
                               draft_time_s=req.draft_time_s, target_time_s=verdict.target_time_s,
                               head_time_s=verdict.head_time_s, **common)]
        prefix += len(verdict.committed_ids)
        for c in copies:
            records.append(RoundRecord(kind="copy", prefix_length=prefix, drafted=c.drafted, accepted=c.accepted,
                                       committed=len(c.committed_ids), target_tokens=c.target_tokens,
                                       copy_candidates=c.copy_candidates, target_time_s=c.target_time_s, **common))
            prefix += len(c.committed_ids)
        for rec in records:
            self.round_log(rec)

    @staticmethod
    def _error(req: BlockRequest, exc: Exception) -> EdgeReply:
        text = str(exc) if isinstance(exc, ValueError) else f"internal error: {type(exc).__name__}: {exc}"
        return EdgeReply(req.request_id, req.round_id, error=text)

    @staticmethod
    def _remember(session: _Session, reply: EdgeReply) -> EdgeReply:
        session.last_reply = reply
        return reply

    def _admit(self, req: BlockRequest) -> tuple[_Session, Method]:
        """The session of a valid block (created from ``context_ids``) and its method; BlockError."""
        if not REQUEST_ID.fullmatch(req.request_id):
            raise BlockError(f"request_id: {req.request_id[:40]!r} is not 1-128 characters of A-Z a-z 0-9 . _ : / -")
        try:
            method = Method.parse(req.method or self.method.value)
        except ValueError as exc:
            raise BlockError(f"method: {exc}") from None
        edge_round = method == Method.TARGET_ONLY  # placement edge: the edge generates k tokens itself
        if method == Method.REJECT and not req.temperature > 0:
            raise BlockError(f"temperature: method reject needs > 0, got {req.temperature}")
        if not math.isfinite(req.tau) or req.tau < 0:
            raise BlockError(f"tau: must be finite and >= 0, got {req.tau}")
        if not math.isfinite(req.temperature) or not 0 <= req.temperature <= 10:
            raise BlockError(f"temperature: must be in [0, 10], got {req.temperature}")
        if not math.isfinite(req.draft_time_s) or req.draft_time_s < 0:
            raise BlockError(f"draft_time_s: must be finite and >= 0, got {req.draft_time_s}")
        if req.protocol not in PROTOCOLS:
            raise BlockError(f"protocol: '{req.protocol}' is not one of {', '.join(PROTOCOLS)}")
        k = len(req.token_ids)
        if edge_round:
            if k:
                raise BlockError(f"token_ids: method target_only (the edge generates) carries no draft tokens, got {k}")
            if req.protocol != "ids" or req.hidden is not None or req.draft_probs is not None:
                raise BlockError("protocol: method target_only sends ids only (no hidden states, no draft_probs)")
            if not 1 <= req.k <= self.max_block:
                raise BlockError(f"k: method target_only asks the edge for 1..max_block = {self.max_block} tokens, got {req.k}")
            k = req.k  # what the round may add to the context
        elif k == 0:
            raise BlockError("token_ids: empty block")
        elif k > req.k:
            raise BlockError(f"token_ids: {k} draft tokens, more than the block size k = {req.k}")
        if k > self.max_block:
            raise BlockError(f"token_ids: {k} draft tokens, more than this verifier's max_block {self.max_block}")
        if req.prefix_length + k > self.max_context:
            raise BlockError(f"prefix_length: {req.prefix_length} committed + {k} new tokens exceed this verifier's "
                             f"max_context {self.max_context}; start a new request with a shorter prompt")
        vocab = self.lm.vocab_size
        self._check_ids("token_ids", req.token_ids, vocab)
        if req.protocol == "fh" and (req.hidden is None or len(req.hidden) != k):
            raise BlockError(f"hidden: protocol fh needs {k} drafter hiddens")
        if req.hidden is not None and not np.isfinite(req.hidden).all():
            raise BlockError("hidden: NaN or infinite values")
        if req.head_id:
            check_head_id(req.head_id, self.head_id)
        if method == Method.REJECT:
            self._check_probs(req.draft_probs, req.token_ids, vocab)
        rid, rnd = req.request_id, req.round_id
        session = self._sessions.get(rid)
        if session is not None and session.robot != req.robot:
            raise BlockError(f"request_id: {rid} belongs to another robot's request; a robot continues only its own")
        if req.context_ids and not (session is not None and session.staged == req.key()):
            # (a session staged by ``prefill`` for this very block holds its context already)
            self._check_ids("context_ids", req.context_ids, vocab)
            if len(req.context_ids) != req.prefix_length:
                raise BlockError(f"prefix_length {req.prefix_length} != len(context_ids) {len(req.context_ids)}")
            if session is not None and rnd <= session.last_round:
                raise BlockError(f"round_id {rnd}: duplicate or out of order (last verified round {session.last_round})")
            if self.verifier_for is not None:
                verifier = self.verifier_for()
            else:
                verifier = Verifier(self.lm, Method.GREEDY if edge_round else method, temperature=req.temperature or 1.0,
                                    tau=req.tau, judge=self.judge, seed=self.seed)
            verifier.begin(req.context_ids)
            # A request that comes back with its context (after robot-only rounds, a lost edge) keeps
            # its KV sequence: the target feeds only what the sequence lacks.
            slot = session.slot if session is not None and not session.pending else None
            session = _Session(verifier, rnd - 1, robot=req.robot, slot=slot)
            self._sessions[rid] = session
            while len(self._sessions) > self.max_requests:
                self._evict()
        elif session is None:
            raise BlockError(f"{UNKNOWN_REQUEST} {rid}: resend context")
        if rnd <= session.last_round:
            raise BlockError(f"round_id {rnd}: duplicate or out of order (last verified round {session.last_round})")
        if req.prefix_length != len(session.verifier.context):
            raise BlockError(f"prefix_length {req.prefix_length} does not match the committed length "
                             f"{len(session.verifier.context)} on the verifier")
        self._sessions.move_to_end(rid)
        return session, method

    def _evict(self) -> None:
        """Forget one session: the least recently used of the robot that holds the most (so that a
        robot opening many requests pushes out its own, not another robot's), never one between its
        two phases."""
        counts = collections.Counter(s.robot for s in self._sessions.values())
        top = max(counts.values())
        rid = next((r for r, s in self._sessions.items() if counts[s.robot] == top and not s.pending), None)
        if rid is None:
            rid = next(r for r, s in self._sessions.items() if not s.pending)
        old = self._sessions.pop(rid)
        if old.slot is not None:
            self.lm.drop(old.slot)

    @staticmethod
    def _check_probs(probs: np.ndarray | None, token_ids: Sequence[int], vocab: int) -> None:
        """draft_probs of a reject block: [K, V], finite, >= 0, rows summing to 1, and the drafted
        token of each row possible (its probability divides in the acceptance ratio)."""
        k = len(token_ids)
        if probs is None or tuple(probs.shape) != (k, vocab):
            shape = None if probs is None else list(probs.shape)
            raise BlockError(f"draft_probs: method reject needs [{k}, {vocab}], got {shape}")
        if not np.isfinite(probs).all() or (probs < 0).any():
            raise BlockError("draft_probs: NaN, infinite or negative values")
        sums = probs.sum(axis=1, dtype=np.float64)
        if not np.allclose(sums, 1.0, atol=1e-3):
            raise BlockError(f"draft_probs: rows must sum to 1, got sums {np.round(sums[:4], 4).tolist()}")
        drafted = probs[np.arange(k), np.asarray(token_ids)]
        if (drafted <= 0).any():
            raise BlockError(f"draft_probs: the drafted token has probability 0 at positions "
                             f"{np.flatnonzero(drafted <= 0)[:5].tolist()}")

    @staticmethod
    def _check_ids(field: str, ids: Sequence[int], vocab: int) -> None:
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise BlockError(f"{field}: ids {bad[:5]} outside the target vocabulary [0, {vocab})")

    def _copy_rounds(self, v: Verifier, committed: list[int], budget: int) -> list[Verdict]:
        """SwitchSD: copy rounds after a block while copy mode holds, at most ``budget`` tokens (the
        last round may pass it: the robot clips) and ``copy_max_rounds`` rounds; none after an
        end-of-sequence token."""
        if v.copy is None or budget <= 0 or self._eos.intersection(committed):
            return []
        copies: list[Verdict] = []
        copied = 0
        for _ in range(self.copy_max_rounds):
            c = v.copy_round()
            if c is None:
                break
            copies.append(c)
            copied += len(c.committed_ids)
            if copied >= budget or self._eos.intersection(c.committed_ids):
                break
        return copies


class PrefillQueue:
    """Blocks whose request context is being prefilled in chunks, for one verification thread.

    ``offer`` takes a block as it arrives: it gives the block its first chunk of prefill
    (``EdgeSessions.prefill``) and either hands it back to be served at once or keeps it; ``step``
    gives the oldest kept block its next chunk and moves it to the back. The thread serves every
    block that arrived since the last step (a short one right away) before the next ``step``, so a
    block of another request waits at most about one chunk per long-context block that arrived
    with it, not for a whole prefill. A resend of a kept block is not kept twice.

    Both return the blocks done with prefill as ``(request, payload, reply)``: ``reply`` None =
    serve it now (``EdgeSessions.handle``); an ``EdgeReply`` = answer it with that (refused).
    ``payload`` is the caller's (e.g. the message and its arrival time).
    """

    def __init__(self, chunk: int):
        if chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0 = whole contexts at once), got {chunk}")
        self.chunk = int(chunk)
        self._kept: collections.OrderedDict[tuple, tuple[BlockRequest, object]] = collections.OrderedDict()
        self.chunks = 0  # chunks prefilled so far

    def __len__(self) -> int:
        return len(self._kept)

    def offer(self, edge: EdgeSessions, req: BlockRequest, payload: object = None) -> list[tuple]:
        key = (req.request_id,) + req.key()
        if key in self._kept:
            return []  # a resend of a block whose prefill goes on: its verdict comes once it is done
        return self._advance(edge, key, req, payload)

    def step(self, edge: EdgeSessions) -> list[tuple]:
        """The next chunk of the oldest kept block ([] when none is kept)."""
        if not self._kept:
            return []
        key, (req, payload) = self._kept.popitem(last=False)
        return self._advance(edge, key, req, payload)

    def drain(self) -> list[tuple[BlockRequest, object]]:
        """Every kept block, forgotten here (e.g. to answer them while the edge is not loaded)."""
        out = list(self._kept.values())
        self._kept.clear()
        return out

    def _advance(self, edge: EdgeSessions, key: tuple, req: BlockRequest, payload: object) -> list[tuple]:
        left = edge.prefill(req, self.chunk)
        if isinstance(left, EdgeReply):
            return [(req, payload, left)]
        if left > 0:
            self.chunks += 1
        if left > self.chunk:
            self._kept[key] = (req, payload)
            return []
        return [(req, payload, None)]


def pick_batch(ready: list, max_batch: int) -> tuple[list, list]:
    """Split ready ``(BlockRequest, ...)`` items, oldest first, into (the rest, one target pass):
    first the oldest block of every robot (so that a robot with many requests cannot crowd the
    others out of a pass), then the oldest others, at most ``max_batch`` blocks and one per request."""
    batch, ids, robots = [], set(), set()
    for rule in ("one per robot", "fill"):
        for item in ready:
            req = item[0]
            if len(batch) >= max_batch or req.request_id in ids or (rule == "one per robot" and req.robot in robots):
                continue
            batch.append(item)
            ids.add(req.request_id)
            robots.add(req.robot)
    taken = {id(item) for item in batch}
    return [item for item in ready if id(item) not in taken], sorted(batch, key=ready.index)


# =========================================================================== robot side
class EdgeLink(Protocol):
    """How the robot reaches the edge."""

    def exchange(self, req: BlockRequest, timeout_s: float) -> EdgeReply | None:
        """Send one block and wait up to ``timeout_s`` for its reply (None: none came)."""

    def edge_present(self) -> bool:
        """Whether an edge is there to try again after a loss (e.g. a verifier subscribed)."""


class EdgeLost(Exception):
    """The edge did not answer (or answered with an error) and ``on_edge_loss`` is ``error``."""


@dataclasses.dataclass
class RobotPolicy:
    """How one request runs on the robot (the drafter_node parameters of the same names)."""

    k: int = 8  # measured best with the default pair and the confidence stop 0.6 (docs/engines.md#defaults-and-why)
    max_new_tokens: int = 128
    method: str = "greedy"
    protocol: str = "adaptive"  # ids | fh | sh | adaptive (see protocol_chooser)
    tau: float = 0.0
    temperature: float = 0.0
    verdict_timeout_s: float = 5.0
    first_verdict_timeout_s: float = 60.0
    verdict_retries: int = 2
    on_edge_loss: str = "drafter_only"
    edge_retry_s: float = 2.0
    edge_wait_s: float = 120.0  # how long to wait for a loading edge (any mode) or a silent one (mode wait)
    placement: str = "split"  # auto | split | edge | robot (sd.placement)

    def __post_init__(self) -> None:
        """ValueError naming the field of a request the robot cannot run."""
        if self.placement not in PLACEMENT_MODES:
            raise ValueError(f"placement: '{self.placement}' is not one of {', '.join(PLACEMENT_MODES)}")
        methods = (Method.GREEDY.value, Method.REJECT.value, Method.WISV.value, Method.FLY.value)
        if self.method not in methods:
            raise ValueError(f"method '{self.method}' is not served by drafter_node (the robot side); use one of {', '.join(methods)}")
        if self.protocol not in PROTOCOLS + ("adaptive",):
            raise ValueError(f"protocol '{self.protocol}' is not one of {', '.join(PROTOCOLS + ('adaptive',))}")
        if self.on_edge_loss not in EDGE_LOSS:
            raise ValueError(f"on_edge_loss: '{self.on_edge_loss}' is not one of {', '.join(EDGE_LOSS)}")
        if not 0 <= self.edge_wait_s <= 86400:
            raise ValueError(f"edge_wait_s must be in [0, 86400] s, got {self.edge_wait_s}")
        if not 1 <= self.k <= 256:
            raise ValueError(f"k must be in [1, 256], got {self.k}")
        if not 0 <= self.temperature <= 10:  # NaN fails too
            raise ValueError(f"temperature must be in [0, 10], got {self.temperature}")
        if not 0 <= self.tau <= 10:
            raise ValueError(f"tau must be in [0, 10] (0 = greedy, > 1 accepts every draft), got {self.tau}")
        if self.max_new_tokens < 1:  # no upper bound here: the verifier's max_context ends a long answer by name
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.method == Method.REJECT.value:
            if self.temperature <= 0:
                raise ValueError("method reject samples: give the goal (or the drafter_node parameter) a temperature > 0")
            if self.protocol in ("fh", "sh"):
                raise ValueError("method reject uploads the drafter distributions: use protocol ids or adaptive")


@dataclasses.dataclass
class RobotResult:
    """What a request did, robot side."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    rounds: int = 0  # rounds that committed tokens (a resent block is the same round)
    drafter_only_rounds: int = 0  # of rounds, those committed without the edge while it was lost
    edge_rounds: int = 0  # of rounds, those the edge generated alone (placement edge)
    robot_rounds: int = 0  # of rounds, those the drafter committed alone by choice (placement robot)
    placement: str = ""  # the placement of the last round
    placement_reason: str = ""  # why (sd.placement.Choice.reason)
    copy_rounds: int = 0
    copy_committed: int = 0
    draft_time_s: float = 0.0
    edge_time_s: float = 0.0


def clip(new_ids: list[int], have: int, max_new: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut committed ids at the token budget and after the first end-of-sequence token; (kept, done)."""
    out = []
    for tok in new_ids:
        if have + len(out) >= max_new:
            return out, True
        out.append(tok)
        if tok in eos:
            return out, True
    return out, have + len(out) >= max_new


def check_reply(req: BlockRequest, reply: EdgeReply) -> str | None:
    """Why a reply cannot be committed (None: it can)."""
    if reply.error:
        return f"verifier error: {reply.error}"
    n = len(reply.committed_ids)
    copied = reply.copy_committed
    edge_round = req.method == Method.TARGET_ONLY.value  # the edge generated: up to k tokens, copies among them
    most = req.k if edge_round else len(req.token_ids) + 1
    if (not 1 <= n - copied <= most or reply.committed_length != req.prefix_length + n
            or (copied and not req.copy_budget and not edge_round)):
        return (f"inconsistent verdict: {n} committed ids ({copied} copied), committed_length "
                f"{reply.committed_length}, block prefix_length {req.prefix_length}")
    return None


_CATCH_UP = 2  # a drafted block that first fed more committed tokens than this paid a prefill: not a sample


class RobotSession:
    """The robot side of one request: the one round loop of the project.

    Args:
        drafter: the robot's ``Drafter`` (``begin`` is called here).
        request_id: the request's id (unique per robot and request).
        target_prompt: the prompt in the target's vocabulary; drafter_prompt: in the drafter's.
        policy: ``RobotPolicy``.
        link: ``EdgeLink``.
        eos: target ids that end the answer.
        protocol_for: (drafted tokens, mean rejected positions) -> "ids" | "fh" | "sh" for a block.
        log: ``log(level, text)`` with level "info" or "warning" (None: silent).
        clock: monotonic seconds (tests replace it); sleep: waits that many seconds (likewise).
        mean_mismatch: the running mean of rejected draft positions to start from (``protocol_for``).
        channel: the latest channel state (None: none yet), for the placement model.
        placer: ``sd.placement.PlacementModel`` that places each round (kept across requests by the
            caller; its ``mode`` is set to ``policy.placement``); None with placement split: every
            round is split; None otherwise: a new model for this request.
        projection: the decision head's drafter part (``wisv.head.DraftProjection``): blocks under fh
            and sh carry its [K, hidden] projections of the hiddens (``BlockRequest.head_id``) instead
            of the [K, d_D] hiddens (pre-projected FH uplink); None = raw hiddens. An edge that refuses
            them (``HeadMismatch``: it runs another head, or none) gets the raw hiddens for the rest
            of the request (a warning is logged; the round is drafted and sent again).
    """

    def __init__(self, drafter: Drafter, request_id: str, target_prompt: Sequence[int], drafter_prompt: Sequence[int],
                 policy: RobotPolicy, link: EdgeLink, eos: set[int],
                 protocol_for: Callable[[int, float], str] = lambda _k, _m: "ids",
                 log: Callable[[str, str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 mean_mismatch: float = 0.0, sleep: Callable[[float], None] = time.sleep,
                 projection: DraftProjection | None = None, channel: Callable[[], ChannelState | None] = lambda: None,
                 placer: PlacementModel | None = None):
        self.drafter, self.request_id, self.policy, self.link, self.eos = drafter, request_id, policy, link, eos
        self.channel = channel
        if placer is None and policy.placement != "split":
            placer = PlacementModel(WireFormat(hidden_dim=drafter.lm.hidden_size), mode=policy.placement)
        if placer is not None:
            placer.mode = policy.placement
        self.placer = placer
        self.round_placement = "split"  # where the latest round ran (split, edge, robot)
        self.projection = projection
        self.sleep = sleep
        self.target_prompt = list(target_prompt)
        self.protocol_for = protocol_for
        self.log = log or (lambda _level, _text: None)
        self.clock = clock
        # Running mean of rejected draft positions (E|S| of protocol choice); a property of the pair,
        # so a robot carries it from one request to the next.
        self.mean_mismatch = mean_mismatch
        drafter.begin(drafter_prompt, len(self.target_prompt))

    def run(self, on_commit: Callable[[list[int], int], None] | None = None,
            on_round: Callable[[DraftBlock | None, EdgeReply | None, int], None] | None = None,
            cancelled: Callable[[], bool] = lambda: False) -> RobotResult:
        """Rounds until ``max_new_tokens``, an end-of-sequence token or ``cancelled()``.

        Each round runs where ``placer`` puts it (``sd.placement``; without one every round is split):
        split (a drafted block verified by the edge), edge (the edge generates, ``target_only``) or
        robot (the drafter's block committed as it is). on_commit(new ids, round_id) after each round
        that committed tokens; on_round(block or None for an edge round, reply or None for a round
        without the edge, tokens generated before the round). Raises ``EdgeLost``.
        """
        p, d, res = self.policy, self.drafter, RobotResult()
        out = res.token_ids
        need_context = True  # the edge has no context for this request yet
        edge_down = False
        next_try = 0.0
        unknown = 0  # "unknown request" answers in a row
        waiting_since = None  # clock() when the edge began loading (or, mode wait, went silent)
        round_id = 0  # blocks sent or drafted alone (BlockRequest.round_id)
        done = p.max_new_tokens <= 0
        while not done and not cancelled():
            t_round, wait_s = self.clock(), 0.0
            ch = self.channel()
            where, chunk = "split", 0
            if self.placer is not None:
                choice = self.placer.choose(ch)
                where, chunk = choice.placement, choice.edge_chunk
                res.placement, res.placement_reason = where, choice.reason
            try_edge = where != "robot" and (not edge_down or (self.clock() >= next_try and self.link.edge_present()))
            block = None
            if where != "edge" or not try_edge:  # (a lost edge: the drafter goes on alone)
                block = self._draft()
                res.draft_time_s += block.draft_time_s
            reply = None
            if try_edge:
                if block is None:
                    req = self._edge_request(round_id, need_context, min(chunk, p.max_new_tokens - len(out)))
                else:
                    req = self._request(block, round_id, need_context,
                                        copy_budget=p.max_new_tokens - len(out) - len(block.token_ids) - 1)
                t_sent = self.clock()
                reply, err = self._exchange(req, probe=edge_down, cancelled=cancelled)
                wait_s = self.clock() - t_sent
                if reply is None and cancelled():
                    break
                round_id += 1
                loading = reply is not None and reply.error.startswith((EDGE_LOADING, EDGE_BUSY))
                if err is not None and ((loading and not edge_down) or (p.on_edge_loss == "wait" and reply is None)):
                    # A verifier that is (re)loading its model or busy, or in mode wait a silent edge,
                    # is not lost: resend the same round (with the context) until edge_wait_s is over.
                    now = self.clock()
                    if waiting_since is None:
                        waiting_since = now
                        self.log("warning", f"request {self.request_id}: {err}; waiting up to edge_wait_s = "
                                            f"{p.edge_wait_s} s for the edge")
                    if now - waiting_since < p.edge_wait_s:
                        need_context = True
                        if reply is not None:  # an answer came at once: pace the resends
                            self.sleep(min(p.edge_retry_s, max(p.edge_wait_s - (now - waiting_since), 0.0)) or 0.05)
                        continue
                    err = f"{err} (still after edge_wait_s = {p.edge_wait_s} s)"
                    if p.on_edge_loss == "wait":
                        raise EdgeLost(f"edge lost in round {round_id - 1}: {err}")
                if err is None:
                    need_context, edge_down, unknown, waiting_since = False, False, 0, None
                    res.edge_time_s += reply.edge_time_s
                    res.copy_rounds += reply.copy_rounds
                    res.copy_committed += reply.copy_committed
                    if block is not None:
                        self.mean_mismatch = 0.8 * self.mean_mismatch + 0.2 * (len(block.token_ids) - reply.accepted)
                    # Not a round that paid a prefill: the context on the edge, or a catch-up on the robot.
                    if not req.context_ids and (block is None or block.caught_up <= _CATCH_UP):
                        self._observe(block, reply, req.protocol, wait_s, ch)
                elif reply is not None and reply.error.startswith(UNKNOWN_REQUEST) and unknown < 2:
                    self.log("info", f"request {self.request_id}: {err}")  # the edge restarted: resend the context
                    need_context, unknown = True, unknown + 1
                    continue
                elif reply is not None and reply.error.startswith(HEAD_MISMATCH) and self.projection is not None:
                    # The edge runs another head (or none): the request goes on with the raw hiddens.
                    self.log("warning", f"request {self.request_id}: {err}; sending the drafter hiddens instead of "
                                        "the projection for the rest of the request")
                    self.projection = None
                    continue
                elif p.on_edge_loss == "error":
                    raise EdgeLost(f"edge lost in round {round_id - 1}: {err}")
                else:
                    if not edge_down:
                        self.log("warning", f"request {self.request_id}: edge lost ({err}); continuing with the drafter alone")
                    edge_down, need_context, next_try = True, True, self.clock() + p.edge_retry_s
                    reply = None
            else:
                round_id += 1
            if reply is None:  # a round without the edge: commit the drafter's own tokens
                if block is None:  # an edge round whose edge was lost
                    block = self._draft()
                    res.draft_time_s += block.draft_time_s
                committed = list(block.token_ids)
                if where == "robot":
                    res.robot_rounds += 1
                else:
                    res.drafter_only_rounds += 1
                need_context = True  # the edge has not seen these tokens
            else:
                committed = list(reply.committed_ids)
                res.edge_rounds += block is None
            self.round_placement = "robot" if reply is None else where
            if on_round is not None:
                on_round(block, reply, len(out))
            d.commit(committed)
            res.rounds += 1
            new, done = clip(committed, len(out), p.max_new_tokens, self.eos)
            out.extend(new)
            if on_commit is not None and new:
                on_commit(new, round_id - 1)
            if self.placer is not None:
                drafted = block.draft_time_s if block is not None else 0.0
                self.placer.observe_local(self.clock() - t_round - drafted - wait_s)
        return res

    def _draft(self) -> DraftBlock:
        block = self.drafter.draft(self.policy.k)
        if not block.token_ids:
            raise EdgeLost("the drafter proposed no token (cross-tokenizer alignment)")
        if self.placer is not None and block.caught_up <= _CATCH_UP:  # (not a prompt's prefill on the robot)
            self.placer.observe_draft(len(block.token_ids), block.draft_time_s)
        return block

    def _observe(self, block: DraftBlock | None, reply: EdgeReply, protocol: str, wait_s: float,
                 ch: ChannelState | None) -> None:
        """Tell the placement model what a round cost (split or edge)."""
        if self.placer is None:
            return
        self.placer.observe_report(reply.edge_token_s, reply.edge_load)
        if block is None:
            self.placer.observe_edge(len(reply.committed_ids), reply.edge_time_s, wait_s, ch)
        else:
            self.placer.observe_split(len(block.token_ids), block.draft_time_s, len(reply.committed_ids),
                                      reply.edge_time_s, wait_s, protocol, len(block.token_ids) - reply.accepted, ch)

    def _edge_request(self, round_id: int, need_context: bool, k: int) -> BlockRequest:
        """Placement edge: ask the edge for up to ``k`` tokens of its own (method target_only)."""
        d = self.drafter
        return BlockRequest(
            request_id=self.request_id, round_id=round_id, prefix_length=d.target_prefix_length, token_ids=[],
            k=max(1, k), protocol="ids", method=Method.TARGET_ONLY.value, temperature=self.policy.temperature,
            context_ids=self.target_prompt + d.committed if need_context else [])

    def _request(self, block: DraftBlock, round_id: int, need_context: bool, copy_budget: int) -> BlockRequest:
        p = self.policy
        protocol = "ids" if p.method == Method.REJECT.value else self.protocol_for(len(block.token_ids), self.mean_mismatch)
        hidden, head_id = block.hidden, ""
        if self.projection is not None and protocol in ("fh", "sh") and hidden is not None:
            hidden, head_id = self.projection(hidden), self.projection.head_id
        return BlockRequest(
            request_id=self.request_id, round_id=round_id, prefix_length=block.prefix_length,
            token_ids=list(block.token_ids), k=p.k, protocol=protocol, method=p.method, tau=p.tau,
            temperature=p.temperature,
            context_ids=self.target_prompt + self.drafter.committed if need_context else [],
            hidden=hidden, head_id=head_id,
            draft_probs=block.probs.float().numpy() if p.method == Method.REJECT.value and block.probs is not None else None,
            draft_time_s=block.draft_time_s, copy_budget=max(0, copy_budget))

    def _exchange(self, req: BlockRequest, probe: bool, cancelled: Callable[[], bool]) -> tuple[EdgeReply | None, str | None]:
        """Send a block, resending it on a timeout; (reply, None) or (reply or None, why not)."""
        p = self.policy
        # A block with the whole context makes the edge prefill it first; a probe of a lost edge keeps
        # the short wait (and gets no resends), so that the robot does not stall on a dead link.
        name = "first_verdict_timeout_s" if req.context_ids and not probe else "verdict_timeout_s"
        timeout = getattr(p, name)
        tries = 1 + (0 if probe else p.verdict_retries)
        reply, err = None, None
        for attempt in range(tries):
            if attempt:
                self.log("warning", f"request {req.request_id} round {req.round_id}: {err}; "
                                    f"resending the block ({attempt}/{p.verdict_retries})")
            reply = self.link.exchange(req, timeout)
            if reply is not None:
                return reply, check_reply(req, reply)
            err = f"no verdict within {name} = {timeout} s"
            if cancelled():
                break
        return reply, err


def protocol_chooser(protocol: str, method: str, hidden_dim: int, channel: Callable[[], ChannelState | None]
                     ) -> Callable[[int, float], str]:
    """``RobotSession.protocol_for`` of a request: ids, fh or sh as asked, or ``adaptive``: ids for
    greedy and reject, and for wisv the cheaper of fh and sh (``link.channel.choose_protocol``) on
    the latest ``channel()`` (fh while there is none)."""
    def choose(k: int, mean_mismatch: float) -> str:
        if protocol != "adaptive":
            return protocol
        if method != Method.WISV.value:
            return "ids"
        ch = channel()
        if ch is None:
            return "fh"
        return choose_protocol(WireFormat(hidden_dim=hidden_dim), k, ch, min(mean_mismatch, k)).value

    return choose


# =========================================================================== in process
class InProcessLink:
    """Robot and edge in one process: a block reaches ``EdgeSessions`` directly (no loss, no wait);
    under sh the edge reads the asked rows from the block's hiddens (or projections)."""

    def __init__(self, edge: EdgeSessions):
        self.edge = edge

    def exchange(self, req: BlockRequest, timeout_s: float) -> EdgeReply:
        return self.edge.handle(req, fetch_hidden=lambda r, _positions: r.drafter_rows())

    def edge_present(self) -> bool:
        return True


@dataclasses.dataclass
class Generation:
    """Result of one request."""

    token_ids: list[int]  # generated target ids (prompt excluded)
    text: str
    stats: DecodeStats


def _decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True) if tok is not None else " ".join(map(str, ids))


class _StopText(Exception):
    pass


def generate(
    drafter: Drafter,
    verifier: Verifier,
    prompt: str | list[dict] | Sequence[int],
    max_new_tokens: int,
    k: int,
    on_commit: Callable[[list[int]], None] | None = None,
    stats: DecodeStats | None = None,
    chat: bool = True,
    on_round: Callable[[DraftBlock, Verdict, int], None] | None = None,
    stop_text: Callable[[str], bool] | None = None,
    copy_max_rounds: int = 32,
    round_log: Callable[[RoundRecord], None] | None = None,
    request_id: str = "in-process",
    projection: DraftProjection | None = None,
) -> Generation:
    """Speculative decoding in one process: the round protocol of the nodes with the edge in process.

    The ``verifier`` gives the target, the method, tau, the judge, copy mode and the seed; blocks
    carry the drafter hiddens (fh) so that the judge sees them. chat: apply each model's chat
    template to a text prompt (False: plain completion, e.g. code). on_commit: called with the ids
    committed by each round (streaming). on_round: called with (block, the block's verdict, tokens
    generated before the round) after each round (trace collection). stop_text: ends generation
    after the round whose text makes it true (e.g. a final answer). round_log: gets a
    ``roundlog.RoundRecord`` per round (``EdgeSessions``), under ``request_id``. projection: the
    blocks carry this head's drafter projections instead of the hiddens (pre-projected FH); the
    verifier's judge must run the same head (``wisv.head.HeadJudge``), else the first block is
    refused and the request goes on with the hiddens.
    """
    target_prompt = encode_prompt(verifier.lm.tokenizer, prompt, chat)
    drafter_prompt = encode_prompt(drafter.lm.tokenizer, prompt, chat) if drafter.cross else target_prompt
    if stats is None:
        stats = DecodeStats(method=str(verifier.method), k=k, hidden_dim=drafter.lm.hidden_size, vocab_size=verifier.lm.vocab_size)
    edge = EdgeSessions(verifier.lm, method=verifier.method, judge=verifier.judge, copy=verifier.copy,
                        copy_max_rounds=copy_max_rounds, verifier_for=lambda: verifier, round_log=round_log,
                        fly_entropy=verifier.fly_entropy, fly_window=verifier.fly_window)
    policy = RobotPolicy(k=k, max_new_tokens=max_new_tokens, method=verifier.method.value, tau=verifier.tau,
                         temperature=verifier.temperature if verifier.method == Method.REJECT else 0.0,
                         on_edge_loss="error")
    eos = verifier.lm.eos_ids()
    session = RobotSession(drafter, request_id, target_prompt, drafter_prompt, policy, InProcessLink(edge), eos,
                           protocol_for=lambda _k, _m: "fh", projection=projection)
    out: list[int] = []

    def account(block: DraftBlock | None, reply: EdgeReply | None, n_before: int) -> None:
        have = n_before
        parts = [reply.verdict] + reply.copies
        for part in parts:
            new, _ = clip(part.committed_ids, have, max_new_tokens, eos)
            if part.copy_round:
                stats.observe_copy_round(accepted=part.accepted, committed=len(new), target_time_s=part.target_time_s)
            elif block is None:  # an edge round (placement edge): the target's own tokens
                stats.observe_round(drafted=0, accepted=0, committed=len(new), mismatches=0, draft_time_s=0.0,
                                    target_time_s=part.target_time_s, head_time_s=0.0)
            else:
                stats.observe_round(drafted=len(block.token_ids), accepted=part.accepted, committed=len(new),
                                    mismatches=len(part.mismatches), draft_time_s=block.draft_time_s,
                                    target_time_s=part.target_time_s, head_time_s=part.head_time_s)
                if on_round is not None:
                    on_round(block, part, n_before)
            have += len(new)

    def commit(new: list[int], _round_id: int) -> None:
        out.extend(new)
        if on_commit is not None:
            on_commit(new)
        if stop_text is not None and stop_text(_decode(verifier.lm.tokenizer, out)):
            raise _StopText

    t_start = time.perf_counter()
    try:
        session.run(on_commit=commit, on_round=account)
    except _StopText:
        pass
    stats.wall_s = time.perf_counter() - t_start
    return Generation(out, _decode(verifier.lm.tokenizer, out), stats)


def generate_target_only(
    lm: CausalLM,
    prompt: str | list[dict] | Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    on_commit: Callable[[list[int]], None] | None = None,
    stats: DecodeStats | None = None,
    chat: bool = True,
    stop_text: Callable[[str], bool] | None = None,
    round_log: Callable[[RoundRecord], None] | None = None,
    request_id: str = "in-process",
) -> Generation:
    """Autoregressive decoding with the target alone (the baseline; one token per forward pass).

    stop_text: ends generation after the token whose text makes it true, as in ``generate``.
    round_log: gets one ``roundlog.RoundRecord`` (kind "target") per forward pass.
    """
    prompt_ids = encode_prompt(lm.tokenizer, prompt, chat)
    if stats is None:
        stats = DecodeStats(method=str(Method.TARGET_ONLY), k=0, hidden_dim=lm.hidden_size, vocab_size=lm.vocab_size)
    eos = lm.eos_ids()
    gen = torch.Generator().manual_seed(seed)
    lm.reset()
    out: list[int] = []
    todo = prompt_ids
    t_start = time.perf_counter()
    done = max_new_tokens <= 0
    while not done:
        t0 = time.perf_counter()
        step = lm.feed(todo, n_logits=1)
        tok, _ = pick_token(step.logits[-1], temperature, gen)
        new, done = clip([tok], len(out), max_new_tokens, eos)
        target_time_s = time.perf_counter() - t0
        if round_log is not None:
            round_log(RoundRecord(request_id=request_id, round_id=stats.rounds, kind="target",
                                  method=Method.TARGET_ONLY.value, prefix_length=len(prompt_ids) + len(out),
                                  committed=len(new), target_tokens=len(todo), target_time_s=target_time_s))
        out.extend(new)
        stats.observe_round(drafted=0, accepted=0, committed=len(new), mismatches=0, draft_time_s=0.0,
                            target_time_s=target_time_s, head_time_s=0.0)
        if on_commit is not None and new:
            on_commit(new)
        if stop_text is not None and not done:
            done = stop_text(_decode(lm.tokenizer, out))
        todo = [tok]
    stats.wall_s = time.perf_counter() - t_start
    return Generation(out, _decode(lm.tokenizer, out), stats)
