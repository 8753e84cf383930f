"""Tests for wisv_ros.wisv.relabel (CSI-aware relabeling; numpy only, no ROS)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from wisv_ros.link.channel import CHANNEL_FEATURES, SCENARIOS, ChannelState, ChannelTrace, WireFormat
from wisv_ros.wisv.relabel import (
    ChannelDistribution, Episode, RelabelConfig, channel_quality, make_instances, make_instances_no_csi,
    relabel, repair_budget, smoothed_importance, soft_policy, threshold,
)

FMT = WireFormat(hidden_dim=2048)
KW = dict(alpha=0.8, fmt=FMT, k=16, round_compute_s=0.1)
PERFECT = ChannelState(rate_bps=1e18, per=0.0, rtt_s=0.0)


def random_episode_arrays(rng: np.random.Generator, max_n: int = 30) -> tuple[np.ndarray, np.ndarray]:
    n = int(rng.integers(0, max_n + 1))
    positions = np.sort(rng.choice(200, size=n, replace=False))
    labels = (rng.random(n) < rng.uniform(0.1, 0.9)).astype(int)
    return positions, labels


def random_episodes(seed: int, n_episodes: int, d_d: int = 4, d_t: int = 6) -> list[Episode]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_episodes):
        pos, lab = random_episode_arrays(rng, 12)
        out.append(Episode(pos, lab, rng.normal(size=(pos.size, d_d)), rng.normal(size=(pos.size, d_t))))
    return out


# --------------------------------------------------------------------------- Eq. 28


def test_literal_importance_is_one_at_critical_positions():
    pos, lab = [2, 7, 9, 30, 31], [1, 0, 1, 0, 1]
    literal = smoothed_importance(pos, lab, 0.7, include_self=True)
    assert literal[[0, 2, 4]].tolist() == [1.0, 1.0, 1.0]
    assert literal[1] == pytest.approx(0.7**2)  # nearest critical is 9
    assert literal[3] == pytest.approx(0.7**1)  # nearest critical is 31
    # Our choice: the mismatch itself does not count, so critical ones rank below 1.
    ours = smoothed_importance(pos, lab, 0.7)
    assert ours[0] == pytest.approx(0.7**7) and ours[2] == pytest.approx(0.7**7)
    assert ours[4] == pytest.approx(0.7**22)
    assert ours[[1, 3]].tolist() == literal[[1, 3]].tolist()  # unchanged where b_t = 0


def test_importance_decays_with_distance():
    alpha = 0.9
    pos = np.array([50, 51, 53, 57, 65, 90])
    lab = np.array([1, 0, 0, 0, 0, 0])
    imp = smoothed_importance(pos, lab, alpha)
    assert imp[0] == 0.0  # an isolated critical mismatch: no other critical one
    assert np.all(np.diff(imp[1:]) < 0)
    np.testing.assert_allclose(imp[1:], alpha ** (pos[1:] - 50))


def test_importance_without_critical_is_zero_and_empty_is_empty():
    assert smoothed_importance([1, 4, 9], [0, 0, 0], 0.5).tolist() == [0.0, 0.0, 0.0]
    assert smoothed_importance([], [], 0.5).shape == (0,)


@pytest.mark.parametrize(
    "pos, lab, alpha, match",
    [
        ([3, 3], [1, 0], 0.5, "strictly increasing"),
        ([5, 2], [1, 0], 0.5, "strictly increasing"),
        ([1, 2], [1, 2], 0.5, "0 or 1"),
        ([1, 2], [1], 0.5, "differ in length"),
        ([1, 2], [1, 0], 1.0, "alpha"),
        ([1, 2], [1, 0], 0.0, "alpha"),
    ],
)
def test_importance_rejects_bad_input(pos, lab, alpha, match):
    with pytest.raises(ValueError, match=match):
        smoothed_importance(pos, lab, alpha)


# --------------------------------------------------------------------------- budget and threshold


def test_channel_quality_orders_the_paper_scenarios():
    q = {name: channel_quality(ch, FMT, 16, 0.1) for name, ch in SCENARIOS.items()}
    assert all(0.0 < v < 1.0 for v in q.values())
    assert q["500mbps_5ms"] > q["500mbps_50ms"] > q["20mbps_50ms"]
    assert q["500mbps_5ms"] > q["20mbps_5ms"] > q["20mbps_50ms"]
    assert channel_quality(PERFECT, FMT, 16, 0.1) == pytest.approx(1.0, abs=1e-9)


def test_repair_budget():
    assert repair_budget(0, 0.3) == 0
    assert repair_budget(5, 1.0) == 5
    assert repair_budget(5, 1e-9) == 1  # the most important critical mismatch is always repaired
    assert repair_budget(10, 0.55) == 6
    budgets = [repair_budget(7, q) for q in np.linspace(0.01, 1.0, 50)]
    assert budgets == sorted(budgets)
    with pytest.raises(ValueError, match="quality"):
        repair_budget(3, 0.0)


def test_threshold_selects_exactly_the_budget():
    imp = np.array([0.3, 0.9, 0.1, 0.6])
    for b in range(5):
        lam = threshold(imp, b)
        assert int(np.sum(imp > lam)) == b
    assert threshold(imp, 4) == -math.inf and threshold(imp, 0) == math.inf


def test_ties_are_broken_by_earlier_position():
    # Critical pairs (10, 12) and (40, 42) are tied: each member's nearest other critical is 2 away.
    pos, lab = [10, 12, 40, 42, 80], [1, 1, 1, 1, 1]
    imp = smoothed_importance(pos, lab, 0.8)
    assert imp[0] == imp[1] == imp[2] == imp[3] > imp[4]
    # Find a channel whose budget is 2 of 5 critical mismatches: the first pair is kept.
    for rate in np.geomspace(1e5, 1e9, 400):
        ch = ChannelState(float(rate), 0.0, 0.0)
        if repair_budget(5, channel_quality(ch, **{k: KW[k] for k in ("fmt", "k", "round_compute_s")})) == 2:
            break
    else:
        pytest.fail("no channel with budget 2 found")
    assert relabel(pos, lab, ch, **KW).tolist() == [1, 1, 0, 0, 0]


def test_isolated_critical_mismatch_is_relaxed_first():
    pos, lab = [5, 6, 8, 100], [1, 1, 1, 1]
    bad = ChannelState(20e6, 0.01, 0.05)  # quality 0.57: 3 of 4 kept
    assert relabel(pos, lab, bad, **KW).tolist() == [1, 1, 1, 0]


# --------------------------------------------------------------------------- relabel


def test_relabel_never_promotes():
    rng = np.random.default_rng(1)
    dist = ChannelDistribution()
    n_relaxed = 0
    for _ in range(150):
        pos, lab = random_episode_arrays(rng)
        for ch in dist.sample(8, rng):
            a = relabel(pos, lab, ch, **KW)
            assert a.dtype.kind == "i" and a.shape == lab.shape
            assert np.all(a <= lab)
            assert lab.sum() == 0 or a.sum() >= 1
            n_relaxed += int(lab.sum() - a.sum())
    assert n_relaxed > 0  # the check above is not vacuous


def test_hard_labels_solve_eq29():
    """a minimises sum_t (b_t - a_t) b~_t subject to sum_t a_t <= B(c), a_t <= b_t (brute force)."""
    from itertools import combinations

    rng = np.random.default_rng(9)
    dist = ChannelDistribution()
    for _ in range(60):
        pos, lab = random_episode_arrays(rng, 8)
        imp = smoothed_importance(pos, lab, KW["alpha"])
        critical = np.flatnonzero(lab == 1).tolist()
        for ch in dist.sample(3, rng):
            q = channel_quality(ch, KW["fmt"], KW["k"], KW["round_compute_s"])
            budget = repair_budget(len(critical), q)
            a = relabel(pos, lab, ch, **KW)
            assert a.sum() == budget
            best = min(
                sum(imp[t] for t in critical if t not in keep)
                for r in range(budget + 1)
                for keep in combinations(critical, r)
            )
            assert np.sum((lab - a) * imp) == pytest.approx(best)


def worse(ch: ChannelState, rng: np.random.Generator) -> ChannelState:
    """The same channel with a lower rate, a higher RTT or a higher PER."""
    which = rng.integers(3)
    if which == 0:
        return ChannelState(ch.rate_bps * rng.uniform(0.05, 1.0), ch.per, ch.rtt_s)
    if which == 1:
        return ChannelState(ch.rate_bps, ch.per, ch.rtt_s + rng.uniform(0.0, 0.2))
    return ChannelState(ch.rate_bps, min(0.5, ch.per + rng.uniform(0.0, 0.3)), ch.rtt_s)


def test_worse_channel_never_yields_more_repairs():
    rng = np.random.default_rng(2)
    dist = ChannelDistribution()
    n_strict = 0
    for _ in range(100):
        pos, lab = random_episode_arrays(rng)
        for ch in dist.sample(5, rng):
            ch_worse = worse(ch, rng)
            a = relabel(pos, lab, ch, **KW)
            a_worse = relabel(pos, lab, ch_worse, **KW)
            assert np.all(a_worse <= a)  # nested: the worse channel repairs a subset
            n_strict += int(a_worse.sum() < a.sum())
    assert n_strict > 20  # the channel does change the labels


def test_perfect_channel_keeps_every_critical_label():
    rng = np.random.default_rng(3)
    for _ in range(100):
        pos, lab = random_episode_arrays(rng)
        assert relabel(pos, lab, PERFECT, **KW).tolist() == lab.tolist()
        np.testing.assert_allclose(soft_policy(pos, lab, PERFECT, rho=0.05, **KW), lab)


# --------------------------------------------------------------------------- soft policy


def test_soft_policy_range_and_zero_where_harmless():
    rng = np.random.default_rng(4)
    dist = ChannelDistribution()
    for _ in range(100):
        pos, lab = random_episode_arrays(rng)
        for ch in dist.sample(4, rng):
            for rho in (1e-3, 0.05, 1.0):
                pi = soft_policy(pos, lab, ch, rho=rho, **KW)
                assert np.all((pi >= 0) & (pi <= 1))
                assert np.all(pi[lab == 0] == 0.0)


def test_soft_policy_tends_to_hard_labels():
    pos, lab = [3, 5, 9, 20, 21, 60], [1, 1, 1, 0, 1, 1]
    ch = ChannelState(20e6, 0.01, 0.05)
    hard = relabel(pos, lab, ch, **KW)
    assert 0 < hard.sum() < sum(lab)  # a real relaxation, not all or nothing
    gaps = [np.abs(soft_policy(pos, lab, ch, rho=r, **KW) - hard).max() for r in (0.3, 0.03, 0.003, 1e-4)]
    assert gaps == sorted(gaps, reverse=True)
    assert gaps[-1] < 1e-6
    assert gaps[0] > 0.05  # a large rho is really soft


def test_soft_policy_is_half_at_a_boundary_tie():
    pos, lab = [10, 12, 40, 42, 80], [1, 1, 1, 1, 1]
    ch = ChannelState(20e6, 0.01, 0.05)  # quality 0.57: budget 3 of 5 splits the second tied pair
    assert relabel(pos, lab, ch, **KW).tolist() == [1, 1, 1, 0, 0]
    # Eq. 31 sees only the importance: all four tied mismatches sit at lambda.
    pi = soft_policy(pos, lab, ch, rho=1e-4, **KW)
    np.testing.assert_allclose(pi, [0.5, 0.5, 0.5, 0.5, 0.0], atol=1e-9)


# --------------------------------------------------------------------------- channel distribution


def test_distribution_is_deterministic_and_in_range(tmp_path):
    trace_file = tmp_path / "trace.csv"
    trace_file.write_text("t_s,rate_bps,per,rtt_s\n0.0,123e6,0.002,0.007\n1.0,7e6,0.03,0.09\n")
    dist = ChannelDistribution([trace_file])
    assert len(dist.fixed) == len(SCENARIOS) + 2
    a = dist.sample(300, 7)
    assert a == dist.sample(300, np.random.default_rng(7))
    assert a != dist.sample(300, 8)
    fixed = set(dist.fixed)
    drawn_fixed = [c for c in a if c in fixed]
    assert 100 < len(drawn_fixed) < 200  # p_fixed = 0.5
    assert {c.rate_bps for c in drawn_fixed} >= {123e6, 7e6}  # the trace states are drawn
    for c in a:
        if c not in fixed:
            assert 5e6 <= c.rate_bps <= 1e9 and 0.002 <= c.rtt_s <= 0.1 and 0.0 <= c.per <= 0.05
    only_random = ChannelDistribution([ChannelTrace.load(trace_file)], p_fixed=0.0).sample(50, 1)
    assert not set(only_random) & fixed


# --------------------------------------------------------------------------- instances


def test_make_instances_layout_and_labels():
    episodes = random_episodes(5, 20)
    cfg = RelabelConfig(fmt=FMT, round_compute_s=0.1, k=16, alpha=0.8, rho=0.05)
    dist = ChannelDistribution()
    n_rows = 3 * sum(len(ep) for ep in episodes)
    X, y = make_instances(episodes, dist, 3, 11, config=cfg, soft=False)
    assert X.dtype == np.float32 and y.dtype == np.float32
    assert X.shape == (n_rows, 4 + 6 + len(CHANNEL_FEATURES)) and y.shape == (n_rows,)
    # Rows are [h_D ; h_T ; c] in episode order, one block per sampled channel.
    first = next(ep for ep in episodes if len(ep))  # empty episodes add no rows
    row = X[0]
    np.testing.assert_array_equal(row[:4], first.h_draft[0])
    np.testing.assert_array_equal(row[4:10], first.h_target[0])
    rng = np.random.default_rng(11)  # the same stream: 3 draws per episode, in order
    per_episode = [dist.sample(3, rng) for _ in episodes]  # empty episodes draw too
    expected_c = np.array(
        [c.features() for ep, chs in zip(episodes, per_episode) for c in chs for _ in range(len(ep))]
    )
    np.testing.assert_array_equal(X[:, 10:], expected_c)
    labels = np.concatenate([np.tile(ep.labels, 3) for ep in episodes])
    assert np.all(y <= labels) and y.sum() < labels.sum()
    X_soft, y_soft = make_instances(episodes, dist, 3, 11, config=cfg)
    np.testing.assert_array_equal(X_soft, X)
    assert np.all((y_soft >= 0) & (y_soft <= labels))
    X_abl, y_abl = make_instances_no_csi(episodes, dist, 3, 11)
    np.testing.assert_array_equal(X_abl, X)
    np.testing.assert_array_equal(y_abl, labels)


def test_make_instances_rejects_mixed_widths():
    episodes = random_episodes(6, 3) + random_episodes(6, 1, d_d=5)
    cfg = RelabelConfig(fmt=FMT, round_compute_s=0.1)
    with pytest.raises(ValueError, match="d_D=5"):
        make_instances(episodes, ChannelDistribution(), 2, 0, config=cfg)


def test_episode_checks_hidden_shapes():
    with pytest.raises(ValueError, match=r"h_target must have shape \[n=2"):
        Episode(np.array([1, 2]), np.array([0, 1]), np.zeros((2, 3)), np.zeros((3, 3)))
