"""Placement (sd.placement): the cost model that places each round on split, edge or robot, the
edge's own generation rounds (method target_only in sd.rounds), and a request that moves between
placements as the link changes without losing or repeating a token. Tiny random models, no ROS."""
from __future__ import annotations

import pytest

from wisv_ros.link.channel import ChannelState, WireFormat, scenario
from wisv_ros.sd.drafting import Drafter
from wisv_ros.sd.placement import EdgeLoad, PlacementModel
from wisv_ros.sd.rounds import BlockRequest, EdgeSessions, InProcessLink, RobotPolicy, RobotSession, generate_target_only

PROMPT = [5, 9, 12, 3]
N = 60
WIRE = WireFormat(hidden_dim=64)


@pytest.fixture(scope="module")
def reference(target):
    return generate_target_only(target, PROMPT, N).token_ids


def measured(model: PlacementModel, ch: ChannelState, *, draft_s=0.08, committed=3.0, edge_s=0.2, token_s=0.05,
             rounds=3) -> PlacementModel:
    """Feed a model split rounds (8 drafted, ``committed`` kept) and an edge report, as a robot would."""
    for _ in range(rounds):
        model.observe_draft(8, draft_s)
        model.observe_split(8, draft_s, round(committed), edge_s, edge_s + ch.rtt_s, "ids", 5, ch)
    model.observe_report(token_s, 0.0)
    return model


def test_auto_takes_the_faster_of_split_and_edge_by_the_cost_model():
    ch = scenario("500mbps_5ms")
    # split: (0.08 + 0.2 + ~5 ms) / 3 = 95 ms a token; edge: 50 ms a token and an RTT per chunk
    m = measured(PlacementModel(WIRE), ch)
    exp = m.expected(ch)
    assert exp["split"] == pytest.approx((0.08 + 0.2 + exp["split"] * 3 - 0.28) / 3)
    assert 0.09 < exp["split"] < 0.1 and 0.05 < exp["edge"] < 0.056
    c = m.choose(ch)
    assert c.placement == "edge" and "faster of split and edge" in c.reason and c.edge_chunk >= 1
    # A slow edge (its report says 0.5 s a token): split is the faster.
    m2 = measured(PlacementModel(WIRE), ch, token_s=0.5)
    assert m2.choose(ch).placement == "split"


def test_edge_load_stretches_the_edge_placement():
    ch = scenario("500mbps_5ms")
    m = measured(PlacementModel(WIRE), ch, token_s=0.07)
    assert m.choose(ch).placement == "edge"
    m.observe_report(0.07, 0.5)  # other robots keep the edge busy half the time: 0.14 s a token here
    assert m.expected(ch)["edge"] > 0.14 and m.choose(ch).placement == "split"


def test_hysteresis_keeps_a_placement_within_its_margin():
    ch = scenario("500mbps_5ms")
    m = measured(PlacementModel(WIRE, hysteresis=0.1), ch, token_s=0.5)
    assert m.choose(ch).placement == "split"
    split = m.expected(ch)["split"]
    m.observe_report(split * 0.92, 0.0)  # edge about 7 % faster: not worth a switch
    c = m.choose(ch)
    assert c.placement == "split" and "staying" in c.reason
    m.observe_report(split * 0.5, 0.0)
    assert m.choose(ch).placement == "edge"


def test_nothing_measured_yet_tries_split_then_one_edge_round():
    ch = scenario("20mbps_50ms")
    m = PlacementModel(WIRE)
    assert m.choose(ch).placement == "split" and "measuring split" in m.last.reason
    m.observe_draft(8, 0.08)
    for _ in range(2):
        m.observe_split(8, 0.08, 3, 0.2, 0.3, "ids", 5, ch)
    c = m.choose(ch)
    assert c.placement == "edge" and "measuring one edge round" in c.reason
    m.observe_edge(c.edge_chunk, 0.05 * c.edge_chunk, 0.05 * c.edge_chunk + 0.05, ch)
    assert m.expected(ch)["edge"] is not None


def test_robot_only_past_the_latency_budget_and_back():
    good, bad = scenario("500mbps_5ms"), ChannelState(rate_bps=20e6, per=0.01, rtt_s=2.0)
    m = measured(PlacementModel(WIRE, max_ms_per_token=100.0), good)
    assert m.choose(good).placement == "edge"
    c = m.choose(bad)  # a 2 s round trip: split 0.76 s a token, edge (32 tokens a trip) 0.11 s
    assert c.placement == "robot" and "max_ms_per_token = 100" in c.reason
    assert m.choose(good).placement in ("split", "edge")
    # Without a budget auto never leaves the target's answer.
    m0 = measured(PlacementModel(WIRE), good)
    assert m0.choose(bad).placement in ("split", "edge")


def test_fixed_placements_and_the_chunk_rule():
    ch = scenario("20mbps_50ms")
    for mode in ("split", "edge", "robot"):
        assert PlacementModel(WIRE, mode=mode).choose(ch).placement == mode
    m = measured(PlacementModel(WIRE, mode="edge"), ch, token_s=0.1)
    # the fewest tokens whose compute is 10x the round trip's fixed part (RTT + measured overhead)
    fixed = ch.rtt_s + (m.overhead_s.value or 0.0)
    n = m.chunk(ch)
    assert n * 0.1 * 0.1 >= fixed > (n - 1) * 0.1 * 0.1
    assert measured(PlacementModel(WIRE), ch, token_s=1e-4).chunk(ch) == 32  # capped
    assert PlacementModel(WIRE, edge_chunk=5).chunk(ch) == 5
    with pytest.raises(ValueError, match="placement: 'sideways'"):
        PlacementModel(WIRE, mode="sideways")
    with pytest.raises(ValueError, match="max_ms_per_token"):
        PlacementModel(WIRE, max_ms_per_token=float("nan"))
    with pytest.raises(ValueError, match="placement: 'x'"):
        RobotPolicy(placement="x")


def test_edge_load_counts_other_robots_work_in_the_window():
    load = EdgeLoad(window_s=5.0)
    load.add("robot1", 0.0, 1.0)
    load.add("robot2", 1.0, 3.5)
    assert load.load("robot1", 5.0) == pytest.approx(0.5)
    assert load.load("robot2", 5.0) == pytest.approx(0.2)
    assert load.load("robot1", 9.0) == 0.0  # robot2's job left the window


def test_an_edge_round_generates_the_targets_own_tokens(target, reference):
    edge = EdgeSessions(target, max_block=16)
    reply = edge.handle(BlockRequest("e1", 0, len(PROMPT), [], k=10, method="target_only", context_ids=list(PROMPT)))
    assert not reply.error and reply.committed_ids == reference[:10]
    assert reply.committed_length == len(PROMPT) + 10 and edge.token_s is not None and edge.token_s > 0
    again = edge.handle(BlockRequest("e1", 0, len(PROMPT), [], k=10, method="target_only", context_ids=list(PROMPT)))
    assert again.resent and again.committed_ids == reply.committed_ids  # a resend is answered, not run twice
    nxt = edge.handle(BlockRequest("e1", 1, len(PROMPT) + 10, [], k=5, method="target_only"))
    assert nxt.committed_ids == reference[10:15]
    bad = edge.handle(BlockRequest("e1", 2, len(PROMPT) + 15, [1, 2], k=5, method="target_only"))
    assert bad.error.startswith("token_ids: method target_only")
    big = edge.handle(BlockRequest("e2", 0, len(PROMPT), [], k=17, method="target_only", context_ids=list(PROMPT)))
    assert big.error.startswith("k: method target_only asks the edge for 1..max_block = 16")
    capped = EdgeSessions(target, max_edge_tokens=3)  # asked for 10, the edge makes 3 and says so by the count
    short = capped.handle(BlockRequest("e3", 0, len(PROMPT), [], k=10, method="target_only", context_ids=list(PROMPT)))
    assert short.committed_ids == reference[:3]


def test_a_sampled_edge_round_draws_from_the_target(target, reference):
    edge = EdgeSessions(target, seed=3)
    reply = edge.handle(BlockRequest("s1", 0, len(PROMPT), [], k=20, method="target_only", temperature=1.5,
                                     context_ids=list(PROMPT)))
    assert not reply.error and len(reply.committed_ids) == 20
    assert all(0 <= t < target.vocab_size for t in reply.committed_ids)
    assert reply.committed_ids != reference[:20]  # at temperature 1.5 a tiny random model wanders off its argmax


def test_measure_token_s_leaves_the_cache_empty(target):
    edge = EdgeSessions(target)
    assert edge.measure_token_s() > 0 and target.cached == []


@pytest.mark.parametrize("placement", ["edge", "split"])
def test_edge_and_split_placements_give_the_targets_answer(target, drafter_lm, reference, placement):
    p = RobotPolicy(k=4, max_new_tokens=N, on_edge_loss="error", placement=placement)
    s = RobotSession(Drafter(drafter_lm), "r1", PROMPT, PROMPT, p, InProcessLink(EdgeSessions(target)), eos=set(),
                     channel=lambda: scenario("20mbps_50ms"))
    res = s.run()
    assert res.token_ids == reference
    if placement == "edge":
        assert res.edge_rounds == res.rounds and res.rounds < N  # several tokens per round trip
    else:
        assert res.edge_rounds == 0


class Link:
    """In process; records the placement of every exchange."""

    def __init__(self, edge: EdgeSessions):
        self.edge, self.kinds = edge, []

    def exchange(self, req: BlockRequest, timeout_s: float):
        self.kinds.append("edge" if req.method == "target_only" else "split")
        return self.edge.handle(req, fetch_hidden=lambda r, _p: r.hidden)

    def edge_present(self) -> bool:
        return True


def test_a_link_degradation_moves_the_request_to_robot_only_and_back(target, drafter_lm):
    """Split while the link is good, robot-only while it is too slow for the budget, split again:
    every token committed once, in order, and the edge's context equals what the robot committed."""
    good, bad = scenario("500mbps_5ms"), ChannelState(rate_bps=1e6, per=0.05, rtt_s=3.0)
    rounds = [0]
    channel = lambda: bad if 6 <= rounds[0] < 12 else good  # noqa: E731 - degraded for rounds 6-11
    model = PlacementModel(WireFormat(hidden_dim=drafter_lm.hidden_size), max_ms_per_token=500.0)
    model.observe_report(10.0, 0.0)  # an edge that takes 10 s a token: auto keeps split, never edge
    edge = EdgeSessions(target)
    link = Link(edge)
    p = RobotPolicy(k=4, max_new_tokens=N, on_edge_loss="error", placement="auto")
    s = RobotSession(Drafter(drafter_lm), "r1", PROMPT, PROMPT, p, link, eos=set(), channel=channel, placer=model)
    placements, stream = [], []

    def on_round(_block, _reply, _n):
        placements.append(s.round_placement)
        rounds[0] += 1

    res = s.run(on_commit=lambda new, _r: stream.extend(new), on_round=on_round)
    # split -> robot -> split, each stretch at least a round
    runs = [placements[0]] + [b for a, b in zip(placements, placements[1:]) if a != b]
    assert runs == ["split", "robot", "split"], placements
    assert res.robot_rounds == placements.count("robot") > 0 and res.drafter_only_rounds == 0
    assert stream == res.token_ids and len(res.token_ids) == N
    assert edge.context("r1") == PROMPT + res.token_ids  # the edge got the robot-only tokens with the context
    assert "split" in res.placement_reason


def test_a_switch_between_split_and_edge_mid_answer_keeps_the_targets_answer(target, drafter_lm, reference):
    """Auto moves from split to edge once the edge reports it is fast; the answer stays the target's."""
    model = PlacementModel(WireFormat(hidden_dim=drafter_lm.hidden_size), warmup_rounds=3)
    edge = EdgeSessions(target)
    link = Link(edge)
    p = RobotPolicy(k=4, max_new_tokens=N, on_edge_loss="error", placement="auto")
    s = RobotSession(Drafter(drafter_lm), "r1", PROMPT, PROMPT, p, link, eos=set(),
                     channel=lambda: scenario("20mbps_50ms"), placer=model)
    res = s.run()
    assert res.token_ids == reference
    assert link.kinds[:3] == ["split"] * 3 and "edge" in link.kinds[3:]
