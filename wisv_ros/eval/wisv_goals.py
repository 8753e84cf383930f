"""WISV against its goals on a whole data set: the checks of the evaluation, from priced round logs.

Inputs are what ``cli.evaluate report`` already has: one priced row per (system, deployment,
scenario) (AAL, rounds, ms per token), and per problem whether each system's answer is right.
Systems are named as ``cli.evaluate`` names them: ``greedy_k<K>`` (lossless, replayed from the
target alone's answers: its accuracy is the target's), ``wisv_k<K>_tau<T>_<channel>_<head>`` (decoded
with the head seeing ``channel``), ``fly_k<K>_e<E>_w<W>`` (decoded; the rule ignores the channel).

For each WISV system, against greedy SD at the same K on the system's own channel:

* AAL gain and the change of rounds per problem (goal at 20 Mbit/s / 50 ms: AAL >= +40 %,
  rounds <= -25 %);
* answers lost against the target alone, paired by problem: right -> wrong, wrong -> right, the
  net loss and its 95 % bootstrap interval over problems (goal: at most 1 net answer lost);
* ms per token against greedy SD, per deployment (goal: below greedy SD in every scenario);
* the order of AAL over the scenarios of one head, K and tau schedule, against the order of the
  channel quality that the relabeling uses (goal: the worse the channel, the higher the AAL).

No rclpy here.
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import numpy as np

from wisv_ros.link.channel import SCENARIOS, WireFormat
from wisv_ros.wisv.relabel import channel_quality

__all__ = ["WISV_SYSTEM", "goal_rows", "goals_markdown", "paired_net", "parse_system", "scenario_order"]

WISV_SYSTEM = re.compile(r"wisv_k(?P<k>\d+)_tau(?P<tau>[0-9.e+-]+)_(?P<channel>[a-z0-9_]+?mbps_\d+ms)_(?P<head>.+)")
FLY_SYSTEM = re.compile(r"fly_k(?P<k>\d+)_e(?P<entropy>[0-9.]+)_w(?P<window>\d+)")

GOAL_AAL, GOAL_ROUNDS, GOAL_NET_LOST = 0.40, -0.25, 1


def parse_system(name: str) -> dict | None:
    """{"kind": "wisv" | "fly", "k", ...} of a decoded lossy system's name, None for any other."""
    m = WISV_SYSTEM.fullmatch(name)
    if m:
        return {"kind": "wisv", "k": int(m["k"]), "tau": float(m["tau"]), "channel": m["channel"], "head": m["head"]}
    m = FLY_SYSTEM.fullmatch(name)
    if m:
        return {"kind": "fly", "k": int(m["k"]), "channel": "", "head": f"fly e{m['entropy']} w{m['window']}"}
    return None


def paired_net(reference: Mapping[str, int], system: Mapping[str, int], n_boot: int = 10_000, seed: int = 0) -> dict:
    """A system's answers against the reference's on the problems both answered: right -> wrong
    (``lost``), wrong -> right (``gained``), ``net`` = lost - gained, and the 95 % percentile bootstrap
    interval of the net over problems (``net_lo``, ``net_hi``)."""
    ids = [i for i in system if i in reference]
    if not ids:
        raise ValueError("paired_net: no problem in common")
    d = np.array([int(reference[i]) - int(system[i]) for i in ids], dtype=np.int64)  # 1 lost, -1 gained
    rng = np.random.default_rng(seed)
    boot = d[rng.integers(0, len(d), size=(n_boot, len(d)))].sum(axis=1)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return {"problems": len(ids), "lost": int((d == 1).sum()), "gained": int((d == -1).sum()), "net": int(d.sum()),
            "net_lo": float(lo), "net_hi": float(hi)}


def scenario_order(k: int, hidden_dim: int, round_compute_s: float) -> list[str]:
    """The named scenarios from the worst channel to the best, by the relabeling's channel quality
    (``relabel.channel_quality``: the share of a round that is compute)."""
    fmt = WireFormat(hidden_dim=hidden_dim)
    return sorted(SCENARIOS, key=lambda s: channel_quality(SCENARIOS[s], fmt, k, round_compute_s))


def goal_rows(priced: Sequence[dict], correct: Mapping[str, Mapping[str, int]], reference: Mapping[str, int],
              dataset: str) -> list[dict]:
    """One row per (decoded lossy system, deployment) on the system's own channel (fly: every
    scenario), with greedy SD at the same K beside it. ``priced``: rows with dataset, system,
    deployment, scenario, problems, tokens, aal, round_trips, ms_per_token; ``correct``: per system
    {problem id: 1/0}; ``reference``: the target alone's {problem id: 1/0}."""
    by = {(r["system"], r["deployment"], r["scenario"]): r for r in priced if r["dataset"] == dataset}
    out = []
    for (system, dep, sc), r in sorted(by.items()):
        info = parse_system(system)
        if info is None or (info["channel"] and sc != info["channel"]) or system not in correct:
            continue
        g = by.get((f"greedy_k{info['k']}", dep, sc))
        if g is None:
            continue
        pair = paired_net(reference, correct[system])
        rounds = r["round_trips"] / r["problems"]
        g_rounds = g["round_trips"] / g["problems"]
        out.append({"dataset": dataset, "system": system, "kind": info["kind"], "k": info["k"], "head": info["head"],
                    "tau": info.get("tau", ""), "scenario": sc, "deployment": dep, "problems": r["problems"],
                    "aal": r["aal"], "greedy_aal": g["aal"], "aal_gain": round(r["aal"] / g["aal"] - 1, 4),
                    # the goals are stated on the whole data set: a run still under way is reported, not judged
                    "greedy_problems": g["problems"], "whole": r["problems"] >= g["problems"],
                    "rounds_per_problem": round(rounds, 2), "greedy_rounds_per_problem": round(g_rounds, 2),
                    "rounds_change": round(rounds / g_rounds - 1, 4),
                    "ms_per_token": r["ms_per_token"], "greedy_ms_per_token": g["ms_per_token"],
                    "latency_change": round(r["ms_per_token"] / g["ms_per_token"] - 1, 4),
                    "correct": sum(correct[system].values()), "target_correct": sum(reference[i] for i in correct[system] if i in reference),
                    **{f"{k}": v for k, v in pair.items() if k != "problems"}})
    return out


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def goals_markdown(rows: Sequence[dict], hidden_dim: int, round_compute_s: float, scenario_label: str = "20mbps_50ms") -> str:
    """The tables and the goal checks (met / not met, by how much) of ``goal_rows``."""
    if not rows:
        return ""
    deps = list(dict.fromkeys(r["deployment"] for r in rows))
    first = deps[0]
    lines = ["| system | channel | problems | AAL (greedy SD) | AAL gain | rounds / problem (greedy SD) | rounds | "
             "right (target alone) | lost / gained | net lost [95 % CI] | "
             + " | ".join(f"ms/token vs greedy SD, {d}" for d in deps) + " |",
             "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(deps)]
    keyed = {(r["system"], r["scenario"], r["deployment"]): r for r in rows}
    for r in rows:
        if r["deployment"] != first:
            continue
        lat = []
        for d in deps:
            x = keyed.get((r["system"], r["scenario"], d))
            lat.append(f"{x['ms_per_token']:.1f} vs {x['greedy_ms_per_token']:.1f} ({_pct(x['latency_change'])})" if x else "")
        lines.append(f"| {r['system']} | {r['scenario']} | {r['problems']} | {r['aal']:.2f} ({r['greedy_aal']:.2f}) | "
                     f"{_pct(r['aal_gain'])} | {r['rounds_per_problem']:.1f} ({r['greedy_rounds_per_problem']:.1f}) | "
                     f"{_pct(r['rounds_change'])} | {r['correct']} ({r['target_correct']}) | {r['lost']} / {r['gained']} | "
                     f"{r['net']} [{r['net_lo']:.0f}, {r['net_hi']:.0f}] | " + " | ".join(lat) + " |")
    lines.append("")
    checks = []
    wisv = [r for r in rows if r["kind"] == "wisv" and r["deployment"] == first]
    for r in wisv:
        if r["scenario"] != scenario_label:
            continue
        ok = r["aal_gain"] >= GOAL_AAL and r["rounds_change"] <= GOAL_ROUNDS and r["net"] <= GOAL_NET_LOST
        # A run still under way compares a subset with greedy SD on every problem.
        verdict = ("met" if ok else "not met") if r["whole"] else f"partial: {r['problems']} of {r['greedy_problems']} problems"
        checks.append(f"- {r['system']} at {scenario_label}: AAL {_pct(r['aal_gain'])} (goal >= +40 %), rounds "
                      f"{_pct(r['rounds_change'])} (goal <= -25 %), net answers lost {r['net']} [95 % CI {r['net_lo']:.0f}, "
                      f"{r['net_hi']:.0f}] (goal <= 1): **{verdict}**.")
    # The channel response at one tau: the same head and tau on every channel it was decoded on.
    groups: dict[tuple, dict[str, float]] = {}
    for r in wisv:
        if r["whole"]:
            groups.setdefault((r["k"], r["head"], r["tau"]), {})[r["scenario"]] = r["aal"]
    for (k, head, tau), aal in groups.items():
        if len(aal) < 2:
            continue
        order = [s for s in scenario_order(k, hidden_dim, round_compute_s) if s in aal]
        ok = all(aal[a] >= aal[b] for a, b in zip(order, order[1:]))
        checks.append(f"- AAL of head {head} at K {k}, tau {tau}, from the worst channel to the best ({', '.join(order)}): "
                      f"{', '.join(f'{aal[s]:.2f}' for s in order)}: **{'in the order of channel quality' if ok else 'not in that order'}**.")
    for d in deps:
        lat = [r for r in rows if r["kind"] == "wisv" and r["deployment"] == d]
        if lat:
            worse = [r for r in lat if r["latency_change"] >= 0]
            checks.append(f"- Latency ({d}): below greedy SD at the same K in {len(lat) - len(worse)} of {len(lat)} "
                          f"(system, channel) pairs" + (f"; not in {', '.join(r['system'] for r in worse)}" if worse else "") + ".")
    return "\n".join(lines + checks) + "\n"
