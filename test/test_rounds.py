"""The round protocol (sd.rounds) without ROS: resends, edge restarts, edge loss and recovery,
the edge's checks and idempotent answers, two-phase verification. Tiny random models; the links
here are scripted stand-ins for DDS that lose, delay or restart what a real link would."""
from __future__ import annotations

import dataclasses

import math

import numpy as np
import pytest
import torch

from wisv_ros.sd.drafting import Drafter
from wisv_ros.sd.rounds import (EDGE_BUSY, EDGE_LOADING, BlockRequest, EdgeLost, EdgeReply, EdgeRound, EdgeSessions, InProcessLink, RobotPolicy,
                                RobotSession, generate_target_only)
from wisv_ros.sd.verification import Method

PROMPT = [5, 9, 12, 3]
N = 40




@pytest.fixture(scope="module")
def reference(target):
    return generate_target_only(target, PROMPT, N).token_ids


class Clock:
    """Monotonic seconds that advance by 0.1 s at every reading (time passes while the robot drafts)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.1
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


class ScriptedLink:
    """In process, but each exchange can be lost (the block reaches the edge, its reply does not),
    dropped (the block never arrives) or answered by a restarted edge."""

    def __init__(self, edge: EdgeSessions, clock: Clock | None = None):
        self.edge, self.clock = edge, clock
        self.sent: list[BlockRequest] = []
        self.lose_reply: set[int] = set()  # exchange numbers whose reply is lost
        self.down: set[int] = set()  # exchange numbers that reach no edge
        self.restart_at: int | None = None  # exchange number at which the edge restarts (loses its sessions)
        self.loading: set[int] = set()  # exchange numbers answered by a restarted edge still loading its model
        self.busy: set[int] = set()  # exchange numbers answered "edge busy" (the block was not queued)
        self.present = True

    def exchange(self, req: BlockRequest, timeout_s: float):
        n = len(self.sent)
        self.sent.append(req)
        if self.clock is not None:
            self.clock.t += timeout_s if n in self.down | self.lose_reply else 0.01
        if n == self.restart_at:
            self.edge = EdgeSessions(self.edge.lm, method=self.edge.method)
        if n in self.down:
            return None
        if n in self.busy:
            return EdgeReply(req.request_id, req.round_id, error=f"{EDGE_BUSY}: 64 blocks queued (max_queue 64)")
        if n in self.loading:
            self.edge = EdgeSessions(self.edge.lm, method=self.edge.method)  # the new process: no sessions
            return EdgeReply(req.request_id, req.round_id, error=f"{EDGE_LOADING}: verifier_node is loading its target")
        reply = self.edge.handle(req, fetch_hidden=lambda r, _p: r.hidden)
        return None if n in self.lose_reply else reply

    def edge_present(self) -> bool:
        return self.present


def session(drafter_lm, link, clock=None, **policy) -> RobotSession:
    p = RobotPolicy(**dict(dict(k=4, max_new_tokens=N, on_edge_loss="error"), **policy))
    timing = {"clock": clock, "sleep": clock.sleep} if clock is not None else {"sleep": lambda _s: None}
    return RobotSession(Drafter(drafter_lm), "req-1", PROMPT, PROMPT, p, link, eos=set(), log=None, **timing)


def test_in_process_rounds_equal_target_greedy(target, drafter_lm, reference):
    res = session(drafter_lm, InProcessLink(EdgeSessions(target))).run()
    assert res.token_ids == reference
    assert 1 < res.rounds < N and res.drafter_only_rounds == 0


def test_a_lost_reply_is_resent_and_answered_once(target, drafter_lm, reference):
    link = ScriptedLink(EdgeSessions(target))
    link.lose_reply = {2, 5}
    res = session(drafter_lm, link).run()
    assert res.token_ids == reference  # nothing committed twice or lost
    rounds = [(r.round_id, r.prefix_length) for r in link.sent]
    assert rounds[2] == rounds[3] and rounds[5] == rounds[6]  # the same block went again
    assert len(link.sent) == res.rounds + 2


def test_an_edge_restart_gets_the_context_again(target, drafter_lm, reference):
    link = ScriptedLink(EdgeSessions(target))
    link.restart_at = 3
    res = session(drafter_lm, link).run()
    assert res.token_ids == reference
    assert link.sent[0].context_ids and not link.sent[2].context_ids
    assert not link.sent[3].context_ids and link.sent[4].context_ids == PROMPT + res.token_ids[:link.sent[4].prefix_length - len(PROMPT)]
    assert link.sent[4].round_id == link.sent[3].round_id + 1  # "unknown request": drafted again, with the context


@pytest.mark.parametrize("mode", ["error", "drafter_only", "wait"])
def test_a_loading_edge_is_waited_for_not_lost(target, drafter_lm, reference, mode):
    """A verifier restarted mid-answer that is still loading its model answers 'edge loading': the
    robot resends the round with the context until it is ready, in every on_edge_loss mode, and the
    answer is the target's own (nothing drafter-only)."""
    clock = Clock()
    link = ScriptedLink(EdgeSessions(target), clock)
    link.loading = {3, 4, 5, 6}
    res = session(drafter_lm, link, clock, on_edge_loss=mode, edge_retry_s=1.0, edge_wait_s=30.0).run()
    assert res.token_ids == reference and res.drafter_only_rounds == 0
    assert link.sent[7].context_ids  # the first block the ready edge sees carries the whole context
    assert clock.t >= 4 * 1.0  # paced by edge_retry_s, not a busy loop


def test_a_busy_edge_gets_the_block_again_later(target, drafter_lm, reference):
    clock = Clock()
    link = ScriptedLink(EdgeSessions(target), clock)
    link.busy = {2, 3}
    res = session(drafter_lm, link, clock, edge_retry_s=0.5).run()  # on_edge_loss error: busy is not a loss
    assert res.token_ids == reference and res.drafter_only_rounds == 0
    assert [r.prefix_length for r in link.sent[2:5]] == [link.sent[2].prefix_length] * 3  # the same round, resent


def test_a_loading_edge_is_given_up_after_edge_wait_s(target, drafter_lm):
    clock = Clock()
    link = ScriptedLink(EdgeSessions(target), clock)
    link.loading = set(range(2, 1000))
    with pytest.raises(EdgeLost, match=r"edge loading.*still after edge_wait_s = 5.0 s"):
        session(drafter_lm, link, clock, edge_retry_s=1.0, edge_wait_s=5.0).run()
    assert 5 <= len(link.sent) - 2 <= 7


def test_wait_mode_rides_out_a_silent_edge(target, drafter_lm, reference):
    """on_edge_loss wait: an edge that is silent for a while (killed, then back) costs time, not the
    answer; past edge_wait_s the request fails by name."""
    clock = Clock()
    link = ScriptedLink(EdgeSessions(target), clock)
    link.down = set(range(2, 8))
    link.restart_at = 2
    res = session(drafter_lm, link, clock, on_edge_loss="wait", edge_wait_s=60.0, verdict_retries=1,
                  first_verdict_timeout_s=5.0).run()
    assert res.token_ids == reference and res.drafter_only_rounds == 0
    link = ScriptedLink(EdgeSessions(target), clock)
    link.down = set(range(2, 1000))
    with pytest.raises(EdgeLost, match="still after edge_wait_s = 12.0 s"):
        session(drafter_lm, link, clock, on_edge_loss="wait", edge_wait_s=12.0, verdict_retries=1,
                first_verdict_timeout_s=5.0).run()


def test_a_lost_edge_fails_the_request_when_asked_to(target, drafter_lm):
    link = ScriptedLink(EdgeSessions(target))
    link.down = set(range(1, 100))
    with pytest.raises(EdgeLost, match=r"edge lost in round 1: no verdict within verdict_timeout_s = 5.0 s"):
        session(drafter_lm, link, verdict_retries=2).run()
    assert len(link.sent) == 1 + 3  # the first round, then round 1 sent three times


def test_drafter_only_rounds_while_the_edge_is_gone_then_back(target, drafter_lm):
    clock = Clock()
    link = ScriptedLink(EdgeSessions(target), clock)
    link.down = {2, 3, 4}  # round 2 and its two resends
    res = session(drafter_lm, link, clock, on_edge_loss="drafter_only", edge_retry_s=0.5).run()
    assert len(res.token_ids) == N
    assert res.drafter_only_rounds >= 1
    assert res.rounds > res.drafter_only_rounds
    back = link.sent[5]  # the first block after the loss carries the whole context
    assert back.context_ids and back.prefix_length == len(back.context_ids)


def test_edge_refuses_bad_blocks_naming_the_field(target):
    edge = EdgeSessions(target)
    ok = BlockRequest("r", 0, len(PROMPT), [1, 2], k=2, context_ids=list(PROMPT))
    assert not edge.handle(ok).error
    cases = {
        "round_id 0: duplicate or out of order": BlockRequest("r", 0, len(PROMPT) + 3, [1], k=1),
        "prefix_length 4 does not match the committed length": BlockRequest("r", 1, len(PROMPT), [1], k=1),
        "token_ids: ids [99]": BlockRequest("r", 1, 0, [99], k=1),
        "tau: must be finite and >= 0, got nan": BlockRequest("r", 1, 0, [1], k=1, tau=math.nan),
        "token_ids: method target_only (the edge generates) carries no draft tokens": BlockRequest("r", 1, 0, [1], k=1, method="target_only"),
        "temperature: method reject needs > 0": BlockRequest("r", 1, 0, [1], k=1, method="reject"),
        "unknown request other: resend context": BlockRequest("other", 0, 4, [1], k=1),
        "hidden: protocol fh needs 1 drafter hiddens": BlockRequest("r", 1, 0, [1], k=1, protocol="fh"),
        "token_ids: empty block": BlockRequest("r", 1, 0, [], k=1),
        "token_ids: 3 draft tokens, more than the block size k = 2": BlockRequest("r", 1, 0, [1, 2, 3], k=2),
        "temperature: must be in [0, 10], got nan": BlockRequest("r", 1, 0, [1], k=1, temperature=math.nan),
        "temperature: must be in [0, 10], got inf": BlockRequest("r", 1, 0, [1], k=1, temperature=math.inf),
        "draft_time_s: must be finite": BlockRequest("r", 1, 0, [1], k=1, draft_time_s=-1.0),
        "draft_probs: method reject needs [1, 64], got None": BlockRequest("r", 1, 0, [1], k=1, method="reject",
                                                                            temperature=1.0),
        "draft_probs: NaN, infinite or negative": BlockRequest("r", 1, 0, [1], k=1, method="reject", temperature=1.0,
                                                              draft_probs=np.full((1, 64), -1 / 64, np.float32)),
        "draft_probs: rows must sum to 1": BlockRequest("r", 1, 0, [1], k=1, method="reject", temperature=1.0,
                                                       draft_probs=np.zeros((1, 64), np.float32)),
        "draft_probs: the drafted token has probability 0 at positions [0]": BlockRequest(
            "r", 1, 0, [1], k=1, method="reject", temperature=1.0, draft_probs=np.eye(64, dtype=np.float32)[[0]]),
        "request_id: 'a b' is not 1-128 characters": BlockRequest("a b", 0, len(PROMPT), [1], k=1, context_ids=list(PROMPT)),
        "request_id: 'xxxx": BlockRequest("x" * 129, 0, len(PROMPT), [1], k=1, context_ids=list(PROMPT)),
        "hidden: NaN or infinite values": BlockRequest("r", 1, 0, [1], k=1, protocol="fh",
                                                       hidden=np.full((1, 8), np.nan, np.float32)),
    }
    for text, req in cases.items():
        reply = edge.handle(req)
        assert text in reply.error, (text, reply.error)


def test_edge_bounds_context_and_block_size_before_any_model_work(target):
    edge = EdgeSessions(target, max_context=16, max_block=4)
    passes = target.forward_passes if hasattr(target, "forward_passes") else None
    long = BlockRequest("big", 0, 15, [1, 2], k=2, context_ids=[3] * 15)
    assert "exceed this verifier's max_context 16" in edge.handle(long).error
    wide = BlockRequest("wide", 0, len(PROMPT), [1] * 5, k=5, context_ids=list(PROMPT))
    assert "more than this verifier's max_block 4" in edge.handle(wide).error
    if passes is not None:
        assert target.forward_passes == passes
    assert edge.context("big") is None and edge.context("wide") is None
    ok = BlockRequest("ok", 0, len(PROMPT), [1, 2], k=2, context_ids=list(PROMPT))
    assert not edge.handle(ok).error
    with pytest.raises(ValueError, match="max_context"):
        EdgeSessions(target, max_context=1)


def test_a_request_belongs_to_the_robot_that_opened_it(target):
    """Fleet edge: robot2 can neither continue robot1's request, nor take it over with a new
    context, nor read its verdict by resending its block; robot1 goes on undisturbed."""
    edge = EdgeSessions(target)
    first = BlockRequest("r", 0, len(PROMPT), [1, 2], k=2, context_ids=list(PROMPT), robot="robot1")
    mine = edge.handle(first)
    assert not mine.error
    n = len(PROMPT) + len(mine.committed_ids)
    steal = [dataclasses.replace(first, robot="robot2"),  # a resend of robot1's block from robot2
             BlockRequest("r", 1, n, [3], k=1, robot="robot2"),  # continuing it
             BlockRequest("r", 1, 3, [3], k=1, context_ids=[1, 2, 3], robot="robot2")]  # reopening it
    for req in steal:
        reply = edge.handle(req)
        assert reply.error.startswith("request_id: r belongs to another robot's request"), reply.error
        assert not reply.committed_ids
    assert edge.context("r") == list(PROMPT) + mine.committed_ids
    assert not edge.handle(BlockRequest("r", 1, n, [3], k=1, robot="robot1")).error


def test_a_resent_block_gets_the_same_reply_without_a_second_pass(target):
    edge = EdgeSessions(target)
    req = BlockRequest("r", 0, len(PROMPT), [1, 2, 3], k=3, context_ids=list(PROMPT))
    first = edge.handle(req)
    passes = target.forward_passes
    again = edge.handle(req)
    assert again.resent and not first.resent
    assert (again.committed_ids, again.accepted, again.committed_length) == (first.committed_ids, first.accepted, first.committed_length)
    assert target.forward_passes == passes


def test_two_phase_verification_asks_for_the_mismatch_hiddens(target, drafter_lm):
    calls = []

    def judge(h_draft, positions, h_target):
        calls.append((h_draft.copy(), list(positions)))
        return torch.zeros(len(positions))  # accept every mismatch

    edge = EdgeSessions(target, method=Method.WISV, judge=judge)
    d = Drafter(drafter_lm)
    d.begin(PROMPT, len(PROMPT))
    block = d.draft(8)
    req = BlockRequest("r", 0, len(PROMPT), block.token_ids, k=8, protocol="sh", method="wisv", tau=0.5,
                       context_ids=list(PROMPT))
    rnd = edge.begin(req)
    assert isinstance(rnd, EdgeRound) and rnd.hidden_positions and not calls
    hidden = np.zeros_like(block.hidden)
    hidden[rnd.hidden_positions] = block.hidden[rnd.hidden_positions]
    reply = edge.finish(rnd, hidden)
    assert isinstance(reply, EdgeReply) and reply.accepted == len(block.token_ids)  # the head accepted them all
    assert calls and calls[0][1] == rnd.hidden_positions
    # Without the hiddens (the SH reply did not come) every mismatch is rejected: greedy.
    edge2 = EdgeSessions(target, method=Method.WISV, judge=judge)
    rnd2 = edge2.begin(req)
    reply2 = edge2.finish(rnd2, None)
    assert reply2.accepted == rnd2.hidden_positions[0]


def test_tau_per_channel_replaces_the_blocks_tau_under_wisv(target, drafter_lm):
    """With a tau schedule the edge judges every wisv block with the tau of the channel of the
    moment, whatever tau the block asked for; greedy blocks are untouched; the round log records
    the tau used."""
    from wisv_ros.link.channel import SCENARIOS, ChannelState, TauSchedule
    from wisv_ros.sd.roundlog import RoundRecord

    schedule = TauSchedule.parse("20mbps_50ms:0.6, 500mbps_5ms:0")
    now = {"channel": SCENARIOS["500mbps_5ms"]}
    logged: list[RoundRecord] = []
    edge = EdgeSessions(target, method=Method.WISV, judge=lambda h, s, t: torch.full((len(s),), 0.5),
                        channel_tau=lambda _req: schedule.tau_for(now["channel"]), round_log=logged.append)
    d = Drafter(drafter_lm)
    d.begin(PROMPT, len(PROMPT))
    block = d.draft(8)
    assert mismatch_positions_of(target, block)  # the block has a mismatch to judge

    def ask(rid, method, tau):
        return edge.handle(BlockRequest(rid, 0, len(PROMPT), block.token_ids, k=8, protocol="fh", method=method,
                                        tau=tau, context_ids=list(PROMPT), hidden=block.hidden))

    good = ask("a", "wisv", 0.9)  # good channel: tau 0, the block's 0.9 is not used: greedy
    first = mismatch_positions_of(target, block)[0]
    assert good.accepted == first and logged[-1].tau == 0.0
    now["channel"] = ChannelState(rate_bps=18e6, per=0.01, rtt_s=0.06)
    bad = ask("b", "wisv", 0.0)  # near 20 Mbit/s / 50 ms: tau 0.6 > 0.5, every mismatch accepted
    assert bad.accepted == len(block.token_ids) and logged[-1].tau == 0.6
    plain = ask("c", "greedy", 0.0)
    assert plain.accepted == first


def mismatch_positions_of(target, block):
    from wisv_ros.sd.acceptance import mismatch_positions

    target.reset()
    logits = target.feed(list(PROMPT) + list(block.token_ids), n_logits=len(block.token_ids) + 1).logits
    target.reset()
    return mismatch_positions(block.token_ids, logits)


@pytest.mark.parametrize("field,value,text", [
    ("tau", math.inf, "tau must be in [0, 10]"), ("tau", math.nan, "tau must be in [0, 10]"), ("tau", 11.0, "tau must be"),
    ("temperature", math.nan, "temperature must be in [0, 10]"), ("temperature", math.inf, "temperature must be"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1"), ("k", 0, "k must be in [1, 256]"),
])
def test_robot_policy_names_a_bad_field(field, value, text):
    with pytest.raises(ValueError) as err:
        RobotPolicy(**{field: value})
    assert text in str(err.value)


def test_a_robot_with_many_requests_crowds_out_only_itself(target):
    """Eviction beyond max_requests takes the least recently used request of the robot holding the
    most, and a target pass takes every robot's oldest block before a second block of any robot."""
    from wisv_ros.sd.rounds import pick_batch

    edge = EdgeSessions(target, max_requests=3)
    assert not edge.handle(BlockRequest("calm", 0, len(PROMPT), [1], k=1, context_ids=list(PROMPT), robot="robot1")).error
    for i in range(5):  # robot2 opens five requests
        assert not edge.handle(BlockRequest(f"flood{i}", 0, len(PROMPT), [1], k=1, context_ids=list(PROMPT),
                                            robot="robot2")).error
    assert edge.context("calm") is not None  # robot1's request survived
    assert [rid for rid in ("flood0", "flood1", "flood2", "flood3", "flood4") if edge.context(rid) is not None] == \
        ["flood3", "flood4"]
    ready = [(BlockRequest(f"f{i}", 0, 1, [1], k=1, robot="robot2"),) for i in range(6)]
    ready.insert(4, (BlockRequest("c", 0, 1, [1], k=1, robot="robot1"),))
    rest, batch = pick_batch(ready, 3)
    assert [q.request_id for q, in batch] == ["f0", "f1", "c"]  # robot1's block rides in the first pass
    assert [q.request_id for q, in rest] == ["f2", "f3", "f4", "f5"]
    dup = [(BlockRequest("x", 0, 1, [1], k=1),), (BlockRequest("x", 1, 2, [1], k=1),)]
    assert [len(part) for part in pick_batch(dup, 8)] == [1, 1]  # one block of a request per pass
