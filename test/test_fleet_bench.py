"""fleet_bench's projection: recorded blocks of N robots priced by a hardware profile, sequential
against batched verification on the edge, and the target alone streaming (no models needed)."""
from __future__ import annotations

import pytest

from wisv_ros.cli.fleet_bench import project
from wisv_ros.eval.latency import load_profiles
from wisv_ros.link.channel import scenario


def robots(n: int) -> list[dict]:
    """n robots, each 10 rounds of 8 drafted tokens with 4 committed, after a 40-token prompt."""
    block = {"token_ids": list(range(8)), "prefix_length": 0, "draft_time_s": 0.1, "committed": [1, 2, 3, 4]}
    return [{"prompt": list(range(40)), "blocks": [dict(block) for _ in range(10)], "tokens": 40} for _ in range(n)]


def test_batched_verification_is_one_pass_per_round_and_never_slower():
    dep = load_profiles().deployment("orin_robot_l4_edge")
    ch = scenario("20mbps_50ms")
    one_seq, one_bat = project(robots(1), "sequential", ch, dep), project(robots(1), "batched", ch, dep)
    assert one_seq["wall_s"] == pytest.approx(one_bat["wall_s"]) and one_seq["tokens"] == 40
    seq, bat = project(robots(8), "sequential", ch, dep), project(robots(8), "batched", ch, dep)
    assert seq["tokens"] == bat["tokens"] == 8 * 40
    assert seq["target_passes"] == 80 and bat["target_passes"] == 10
    t = dep.edge.model(dep.target).block  # round 0 feeds the prompt (40) + 8 drafts, later rounds 1 + 8
    assert seq["edge_s"] == pytest.approx(8 * t(48) + 9 * 8 * t(9))
    assert bat["edge_s"] == pytest.approx(t(8 * 48) + 9 * t(8 * 9))
    assert bat["edge_s"] < 0.6 * seq["edge_s"] and bat["wall_s"] < seq["wall_s"]
    alone = project(robots(8), "target_alone", ch, dep)
    assert alone["tokens"] == 320 and alone["target_passes"] == 41
    with pytest.raises(ValueError, match="no deployment|nope"):
        load_profiles().deployment("nope")
