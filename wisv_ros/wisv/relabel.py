"""CSI-aware relabeling of mismatch traces for the WISV decision head (SPEC "Training the decision head").

Pure numpy (plus :mod:`wisv_ros.link` for the channel and its costs); no torch, no rclpy.

Glossary (one *episode* = one generated answer from Stage 1):

* mismatch ``t``   a draft position where the target's argmax differed from the draft token, at
  token position ``positions[t]`` in the answer (ascending);
* base label ``b_t`` 1 = critical (putting the draft token in changes the task's final answer,
  so it must be repaired), 0 = harmless;
* importance ``b~_t`` smoothed importance (paper Eq. 28), how close other critical mismatches are;
* budget ``B(c)``  how many critical mismatches are still repaired on channel ``c``;
* hard label ``a_t`` 1 = repair (reject the draft token), the budgeted threshold solution of Eq. 29;
* soft label ``pi_t`` the entropy-regularised policy of Eq. 31.

Choices the paper leaves open (documented here, tested in ``test/test_relabel.py``):

1. **Eq. 28 excludes the mismatch itself.** Literally ``b~_t = max_{k: b_k=1} alpha^|t-k|`` is 1 at
   every critical mismatch (``k = t``), so the budgeted problem (29), which only ranks *critical*
   mismatches, would see all of them tied at 1: relabeling degenerates to "keep the earliest
   ``B(c)``". We take the max over the *other* critical mismatches (``k != t``): a critical
   mismatch inside a cluster of critical ones (a fragile stretch of reasoning) ranks high; an
   isolated critical mismatch ranks lowest (``b~ = 0``) and is the first to be relaxed when the
   channel is bad. ``include_self=True`` gives the literal equation. Distances are in tokens
   (``positions``), not in mismatch indices.
2. **Channel quality** ``q(c) = T_round / (T_round + T_comm^FH(c))`` in (0, 1]: the share of one
   round's time that is compute, where ``T_comm^FH`` is link.py's FH communication time of a
   block of K (the price of the extra round a repair causes) and ``T_round`` the round's compute
   time (drafting + target pass). ``q -> 1`` on a perfect link, and it falls when the rate falls
   or the RTT or PER rise (``comm_time_fh`` is monotone in each).
3. **Budget** ``B(c) = ceil(q(c) * n_critical)``: a perfect channel keeps every critical label;
   any channel keeps at least the most important one (``q > 0``); monotone in ``q``.
4. **Threshold** ``lambda(c)``: critical mismatches are ranked by importance (descending), ties by
   earlier position first; the first ``B(c)`` are repaired. ``lambda`` is the midpoint between
   the ``B``-th and ``(B+1)``-th importance of that order (``-inf`` when ``B >= n_critical``,
   ``+inf`` when ``B == 0``), so every repaired mismatch has ``b~ > lambda`` unless it ties at the
   boundary, where only the rank decides. The soft policy uses the same ``lambda``; at a boundary
   tie it gives 1/2 to the tied mismatches, for every ``rho`` (Eq. 31 cannot tell them apart).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from wisv_ros.link.channel import CHANNEL_FEATURES, SCENARIOS, ChannelState, ChannelTrace, WireFormat, comm_time_fh

__all__ = [
    "ChannelDistribution",
    "Episode",
    "RelabelConfig",
    "channel_quality",
    "make_instances",
    "make_instances_no_csi",
    "relabel",
    "repair_budget",
    "smoothed_importance",
    "soft_policy",
    "threshold",
]


# --------------------------------------------------------------------------- validation


def _as_positions_labels(positions: Sequence[int], labels: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Return (positions int64 [n], labels int64 [n]) or raise naming the problem."""
    pos = np.asarray(positions)
    lab = np.asarray(labels)
    if pos.ndim != 1 or lab.ndim != 1:
        raise ValueError(f"positions and labels must be 1-D, got shapes {pos.shape} and {lab.shape}")
    if pos.shape != lab.shape:
        raise ValueError(f"positions and labels differ in length: {pos.shape[0]} != {lab.shape[0]}")
    if pos.size and not np.issubdtype(pos.dtype, np.integer):
        raise TypeError(f"positions must be integers, got dtype {pos.dtype}")
    if pos.size > 1 and np.any(np.diff(pos) <= 0):
        raise ValueError("positions must be strictly increasing (mismatches in order)")
    if lab.size and not np.all((lab == 0) | (lab == 1)):
        raise ValueError(f"labels must be 0 or 1, got values {sorted(set(lab.tolist()))}")
    return pos.astype(np.int64), lab.astype(np.int64)


def _check_open_unit(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return float(value)


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------- Eq. 28-31


def smoothed_importance(
    positions: Sequence[int], labels: Sequence[int], alpha: float, *, include_self: bool = False
) -> np.ndarray:
    """Smoothed importance b~_t = max_{k: b_k = 1, k != t} alpha^|p_t - p_k| (Eq. 28, choice 1).

    With ``include_self=True`` the max also runs over ``k = t`` (the literal equation: 1 at every
    critical mismatch). Without any qualifying ``k`` the importance is 0. Returns float64 [n].

    >>> smoothed_importance([3, 5, 20], [1, 1, 1], 0.5).tolist()
    [0.25, 0.25, 3.0517578125e-05]
    >>> smoothed_importance([3, 5, 20], [1, 0, 0], 0.5, include_self=True).tolist()
    [1.0, 0.25, 7.62939453125e-06]
    """
    alpha = _check_open_unit("alpha", alpha)
    pos, lab = _as_positions_labels(positions, labels)
    n = pos.size
    if n == 0:
        return np.zeros(0)
    critical = np.flatnonzero(lab == 1)
    if critical.size == 0:
        return np.zeros(n)
    dist = np.abs(pos[:, None] - pos[None, critical]).astype(np.float64)  # [n, n_critical]
    weight = alpha**dist
    if not include_self:
        weight[critical, np.arange(critical.size)] = 0.0  # drop k = t
    return weight.max(axis=1)


def channel_quality(ch: ChannelState, fmt: WireFormat, k: int, round_compute_s: float) -> float:
    """q(c) = T_round / (T_round + T_comm^FH(c)) in (0, 1] (choice 2).

    ``fmt`` sizes the FH upload (``fmt.hidden_dim`` = the drafter's d_D), ``k`` the block length,
    ``round_compute_s`` the compute time of one round (drafting K + one target pass), > 0.

    >>> fmt = WireFormat(hidden_dim=2048)
    >>> round(channel_quality(ChannelState(20e6, 0.01, 0.05), fmt, 16, 0.1), 3)
    0.566
    """
    round_compute_s = _check_positive("round_compute_s", round_compute_s)
    t_comm = comm_time_fh(fmt, k, ch)
    return round_compute_s / (round_compute_s + t_comm)


def repair_budget(n_critical: int, quality: float) -> int:
    """B(c) = ceil(quality * n_critical) (choice 3); 0 only when there is nothing to repair."""
    if isinstance(n_critical, bool) or not isinstance(n_critical, numbers.Integral) or n_critical < 0:
        raise ValueError(f"n_critical must be an integer >= 0, got {n_critical!r}")
    if isinstance(quality, bool) or not isinstance(quality, numbers.Real) or not 0.0 < quality <= 1.0:
        raise ValueError(f"quality must be in (0, 1], got {quality!r}")
    return min(int(n_critical), math.ceil(quality * n_critical))


def _repair_order(importance_of_critical: np.ndarray) -> np.ndarray:
    """Indices of the critical mismatches, most important first, ties by earlier position."""
    # np.lexsort sorts by the last key first; indices are in position order already.
    idx = np.arange(importance_of_critical.size)
    return np.lexsort((idx, -importance_of_critical))


def threshold(importance_of_critical: Sequence[float], budget: int) -> float:
    """lambda(c) for the critical mismatches' importances (in position order) and a budget (choice 4).

    The midpoint between the ``budget``-th and ``(budget+1)``-th largest importance; ``-inf`` when
    the budget covers all of them, ``+inf`` when it is 0.

    >>> threshold([0.5, 0.9, 0.1], 2)
    0.3
    >>> threshold([0.5, 0.9, 0.1], 3), threshold([0.5, 0.9, 0.1], 0)
    (-inf, inf)
    """
    imp = np.asarray(importance_of_critical, dtype=np.float64)
    if imp.ndim != 1:
        raise ValueError(f"importance_of_critical must be 1-D, got shape {imp.shape}")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0:
        raise ValueError(f"budget must be an integer >= 0, got {budget!r}")
    if budget >= imp.size:
        return -math.inf
    if budget == 0:
        return math.inf
    ranked = imp[_repair_order(imp)]
    return float(0.5 * (ranked[budget - 1] + ranked[budget]))


@dataclass(frozen=True)
class _Relaxation:
    importance: np.ndarray  # b~ [n]
    keep: np.ndarray  # a [n] int64
    lam: float


def _relax(
    positions: Sequence[int],
    labels: Sequence[int],
    ch: ChannelState,
    alpha: float,
    fmt: WireFormat,
    k: int,
    round_compute_s: float,
) -> _Relaxation:
    pos, lab = _as_positions_labels(positions, labels)
    importance = smoothed_importance(pos, lab, alpha)
    critical = np.flatnonzero(lab == 1)
    budget = repair_budget(int(critical.size), channel_quality(ch, fmt, k, round_compute_s))
    keep = np.zeros(pos.size, dtype=np.int64)
    keep[critical[_repair_order(importance[critical])[:budget]]] = 1
    return _Relaxation(importance, keep, threshold(importance[critical], budget))


def relabel(
    positions: Sequence[int],
    labels: Sequence[int],
    ch: ChannelState,
    *,
    alpha: float,
    fmt: WireFormat,
    k: int,
    round_compute_s: float,
) -> np.ndarray:
    """Hard labels a_t = b_t * 1{rank of b~_t within B(c)} (Eq. 29 threshold solution); int64 [n].

    Always ``a_t <= b_t``: relabeling only relaxes critical mismatches, never promotes harmless ones.
    """
    return _relax(positions, labels, ch, alpha, fmt, k, round_compute_s).keep


def soft_policy(
    positions: Sequence[int],
    labels: Sequence[int],
    ch: ChannelState,
    *,
    alpha: float,
    fmt: WireFormat,
    k: int,
    round_compute_s: float,
    rho: float,
) -> np.ndarray:
    """Soft labels pi_t = b_t * sigmoid((b~_t - lambda(c)) / rho) (Eq. 31); float64 [n] in [0, 1].

    ``rho > 0`` is the entropy temperature; as ``rho -> 0`` pi tends to the hard labels of
    :func:`relabel` except at a boundary tie (``b~_t == lambda``), where it stays 1/2.
    """
    rho = _check_positive("rho", rho)
    r = _relax(positions, labels, ch, alpha, fmt, k, round_compute_s)
    _, lab = _as_positions_labels(positions, labels)
    with np.errstate(over="ignore"):  # exp overflow -> sigmoid 0, which is the right limit
        z = (r.importance - r.lam) / rho
        pi = 1.0 / (1.0 + np.exp(-z))
    return np.where(lab == 1, pi, 0.0)


# --------------------------------------------------------------------------- channels


class ChannelDistribution:
    """Channel states to relabel with: fixed states (the paper's scenarios and trace states) and random ones.

    Each draw is, with probability ``p_fixed``, one of the fixed states (uniformly: the four
    :data:`link.SCENARIOS` plus every state of every given trace), otherwise a random state with
    rate log-uniform in ``rate_range_bps``, RTT log-uniform in ``rtt_range_s`` and PER uniform in
    ``per_range`` (log-uniform cannot reach PER 0).

    Args:
        traces: :class:`link.ChannelTrace` objects or paths of trace files (CSV/YAML).
        p_fixed: share of draws taken from the fixed states, in [0, 1].
        rate_range_bps, rtt_range_s, per_range: (low, high) of the random states.
    """

    def __init__(
        self,
        traces: Iterable[ChannelTrace | str | Path] = (),
        *,
        p_fixed: float = 0.5,
        rate_range_bps: tuple[float, float] = (5e6, 1e9),
        rtt_range_s: tuple[float, float] = (0.002, 0.100),
        per_range: tuple[float, float] = (0.0, 0.05),
    ) -> None:
        if not 0.0 <= p_fixed <= 1.0:
            raise ValueError(f"p_fixed must be in [0, 1], got {p_fixed!r}")
        for name, (lo, hi), floor in (
            ("rate_range_bps", rate_range_bps, 0.0),
            ("rtt_range_s", rtt_range_s, 0.0),
            ("per_range", per_range, -1.0),
        ):
            if not floor < lo <= hi:
                raise ValueError(f"{name} must satisfy {floor:g} < low <= high, got {(lo, hi)}")
        if per_range[1] >= 1.0 or per_range[0] < 0.0:
            raise ValueError(f"per_range must lie in [0, 1), got {per_range}")
        fixed = list(SCENARIOS.values())
        for trace in traces:
            if not isinstance(trace, ChannelTrace):
                trace = ChannelTrace.load(trace)
            fixed.extend(trace.states)
        self.fixed: tuple[ChannelState, ...] = tuple(fixed)
        self.p_fixed = float(p_fixed)
        self.rate_range_bps = (float(rate_range_bps[0]), float(rate_range_bps[1]))
        self.rtt_range_s = (float(rtt_range_s[0]), float(rtt_range_s[1]))
        self.per_range = (float(per_range[0]), float(per_range[1]))

    def sample(self, n: int, rng: np.random.Generator | int) -> list[ChannelState]:
        """Draw ``n`` channel states; ``rng`` is a numpy Generator or a seed (same seed, same states)."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        rng = np.random.default_rng(rng)
        # Draw every column for every sample, so the stream does not depend on the branch taken.
        use_fixed = rng.random(n) < self.p_fixed
        which = rng.integers(0, len(self.fixed), size=n)
        log_rate = rng.uniform(*np.log(self.rate_range_bps), size=n)
        log_rtt = rng.uniform(*np.log(self.rtt_range_s), size=n)
        per = rng.uniform(*self.per_range, size=n)
        out = []
        for i in range(n):
            if use_fixed[i]:
                out.append(self.fixed[int(which[i])])
            else:
                out.append(ChannelState(float(np.exp(log_rate[i])), float(per[i]), float(np.exp(log_rtt[i]))))
        return out


# --------------------------------------------------------------------------- training instances


@dataclass(frozen=True)
class Episode:
    """The mismatches of one generated answer (Stage 1 trace).

    Attributes:
        positions: int [n], token position of each mismatch in the answer, strictly increasing.
        labels: int [n], base labels b_t in {0, 1} (1 = critical).
        h_draft: float32 [n, d_D], drafter hidden state at each mismatch.
        h_target: float32 [n, d_T], target hidden state at each mismatch.
    """

    positions: np.ndarray
    labels: np.ndarray
    h_draft: np.ndarray
    h_target: np.ndarray

    def __post_init__(self) -> None:
        pos, lab = _as_positions_labels(self.positions, self.labels)
        h_d = np.asarray(self.h_draft, dtype=np.float32)
        h_t = np.asarray(self.h_target, dtype=np.float32)
        for name, h in (("h_draft", h_d), ("h_target", h_t)):
            if h.ndim != 2 or h.shape[0] != pos.size:
                raise ValueError(f"{name} must have shape [n={pos.size}, d], got {h.shape}")
        object.__setattr__(self, "positions", pos)
        object.__setattr__(self, "labels", lab)
        object.__setattr__(self, "h_draft", h_d)
        object.__setattr__(self, "h_target", h_t)

    def __len__(self) -> int:
        return int(self.positions.size)


@dataclass(frozen=True)
class RelabelConfig:
    """Parameters of the CSI-aware relabeling.

    Attributes:
        fmt: wire format of the FH upload; ``fmt.hidden_dim`` is the drafter's d_D.
        round_compute_s: compute time of one round (drafting K + one target pass), s.
        k: draft block length K.
        alpha: importance decay per token of distance, in (0, 1) (Eq. 28).
        rho: soft-policy temperature, > 0 (Eq. 31).
    """

    fmt: WireFormat
    round_compute_s: float
    k: int = 16
    alpha: float = 0.8
    rho: float = 0.05

    def __post_init__(self) -> None:
        _check_positive("round_compute_s", self.round_compute_s)
        _check_open_unit("alpha", self.alpha)
        _check_positive("rho", self.rho)
        if isinstance(self.k, bool) or not isinstance(self.k, numbers.Integral) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1, got {self.k!r}")


_LabelFn = Callable[[Episode, ChannelState], np.ndarray]


def _instances(
    episodes: Sequence[Episode],
    dist: ChannelDistribution,
    n_channels_per_episode: int,
    rng: np.random.Generator | int,
    label_fn: _LabelFn,
) -> tuple[np.ndarray, np.ndarray]:
    if not episodes:
        raise ValueError("no episodes")
    d_d, d_t = episodes[0].h_draft.shape[1], episodes[0].h_target.shape[1]
    rng = np.random.default_rng(rng)
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for i, ep in enumerate(episodes):
        if ep.h_draft.shape[1] != d_d or ep.h_target.shape[1] != d_t:
            raise ValueError(
                f"episode {i}: hidden widths (d_D={ep.h_draft.shape[1]}, d_T={ep.h_target.shape[1]}) "
                f"differ from episode 0 (d_D={d_d}, d_T={d_t})"
            )
        # Channels are drawn even for empty episodes, so the stream does not depend on their content.
        for ch in dist.sample(n_channels_per_episode, rng):
            if len(ep) == 0:
                continue
            c = np.broadcast_to(ch.features(), (len(ep), len(CHANNEL_FEATURES)))
            xs.append(np.concatenate([ep.h_draft, ep.h_target, c], axis=1))
            ys.append(np.asarray(label_fn(ep, ch), dtype=np.float32))
    if not xs:
        return np.zeros((0, d_d + d_t + len(CHANNEL_FEATURES)), np.float32), np.zeros(0, np.float32)
    return np.concatenate(xs).astype(np.float32), np.concatenate(ys)


def make_instances(
    episodes: Sequence[Episode],
    dist: ChannelDistribution,
    n_channels_per_episode: int,
    rng: np.random.Generator | int,
    *,
    config: RelabelConfig,
    soft: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Training instances: for each episode and each of ``n_channels_per_episode`` sampled channels,
    one row per mismatch.

    Returns ``X`` float32 [N, d_D + d_T + 3] with rows ``[h_D ; h_T ; c]`` (``c`` =
    ``ChannelState.features()``) and ``y`` float32 [N]: the soft policy pi_t (``soft=True``) or the
    hard labels a_t.
    """

    def label(ep: Episode, ch: ChannelState) -> np.ndarray:
        kw = dict(alpha=config.alpha, fmt=config.fmt, k=config.k, round_compute_s=config.round_compute_s)
        if soft:
            return soft_policy(ep.positions, ep.labels, ch, rho=config.rho, **kw)
        return relabel(ep.positions, ep.labels, ch, **kw)

    return _instances(episodes, dist, n_channels_per_episode, rng, label)


def make_instances_no_csi(
    episodes: Sequence[Episode],
    dist: ChannelDistribution,
    n_channels_per_episode: int,
    rng: np.random.Generator | int,
) -> tuple[np.ndarray, np.ndarray]:
    """Ablation without CSI-aware relabeling (paper Fig. 5): labels are the base labels b_t.

    ``X`` is exactly what :func:`make_instances` builds for the same arguments and seed (channel
    features included, so the head has the same input layout), but ``y`` ignores the channel: the
    head can only learn to ignore its channel inputs.
    """
    return _instances(episodes, dist, n_channels_per_episode, rng, lambda ep, ch: ep.labels)
