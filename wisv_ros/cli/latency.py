"""End-to-end latency of a round log over a channel, on measured or projected hardware.

    python -m wisv_ros.cli.latency runs/rounds.jsonl                              # 4 scenarios, profile embedded_default
    python -m wisv_ros.cli.latency runs/rounds.jsonl --profile orin_robot_l4_edge --protocol adaptive --hidden-dim 896
    python -m wisv_ros.cli.latency runs/rounds.jsonl --measured --scenario 20mbps_50ms --csv latency.csv
    python -m wisv_ros.cli.latency runs/rounds.jsonl --rate-bps 50e6 --per 0.01 --rtt-s 0.02

The log is what a run wrote with ``--round-log`` (``wisv_ros.sd.roundlog``); the cost model is the one of
``wisv_ros.eval.latency``. For each channel (default: the four named scenarios), each method and protocol
it prints requests, tokens, rounds, AAL, ms/token with a 95 % bootstrap CI over requests and tokens/s, and
beside them the two baselines a user could pick instead: the target alone on the edge (``target_alone``)
and drafter and target both on the edge (``both_on_edge``). ``--measured`` takes the compute times the log
recorded; the baselines always come from the profile (``--profile``, default embedded_default). Every
number computed from a profile is a projection and says so: ``projected (profile NAME)``.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

from wisv_ros.eval.latency import (DEFAULT_DEPLOYMENT, PROTOCOLS, MeasuredCompute, ProfileCompute, ProfileError, load_profiles,
                                  request_rows, summarize)
from wisv_ros.link.channel import SCENARIOS, ChannelState, ChannelTrace
from wisv_ros.sd.metrics import format_table
from wisv_ros.sd.roundlog import read_round_log

__all__ = ["main"]

COLUMNS = ["channel", "rate_bps", "per", "rtt_s", "method", "protocol", "compute", "requests", "tokens", "rounds", "copy_rounds",
           "aal", "ms_per_token", "ms_per_token_lo", "ms_per_token_hi", "tokens_per_s", "baseline_compute",
           "target_alone_ms_per_token", "target_alone_ms_per_token_lo", "target_alone_ms_per_token_hi",
           "both_on_edge_ms_per_token", "both_on_edge_ms_per_token_lo", "both_on_edge_ms_per_token_hi", "speedup_vs_target_alone"]


def _channels(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[tuple[str, ChannelState | ChannelTrace]]:
    """(label, channel) pairs: the --scenario, the --trace, the custom channel, or all four scenarios."""
    custom = [args.rate_bps, args.per, args.rtt_s]
    given = [bool(args.scenario), bool(args.trace), any(v is not None for v in custom)]
    if sum(given) > 1:
        p.error("give one channel: --scenario, --trace or --rate-bps/--per/--rtt-s")
    if given[2]:
        if any(v is None for v in custom):
            p.error("a custom channel needs all of --rate-bps, --per and --rtt-s")
        try:
            return [("custom", ChannelState(args.rate_bps, args.per, args.rtt_s))]
        except (TypeError, ValueError) as exc:
            p.error(f"custom channel: {exc}")
    if args.trace:
        try:
            return [(f"trace:{Path(args.trace).name}", ChannelTrace.load(args.trace))]
        except (OSError, ValueError) as exc:
            p.error(f"--trace: {exc}")
    names = args.scenario or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown --scenario {', '.join(unknown)}; valid: {', '.join(SCENARIOS)}")
    return [(n, SCENARIOS[n]) for n in names]


def _summary_rows(label: str, channel: ChannelState | ChannelTrace, rows: list[dict], n_boot: int, seed: int) -> list[dict]:
    """One aggregate row per (method, protocol) of ``rows``."""
    state = channel if isinstance(channel, ChannelState) else None
    out = []
    for key in dict.fromkeys((r["method"], r["protocol"]) for r in rows):
        agg = summarize([r for r in rows if (r["method"], r["protocol"]) == key], n_boot=n_boot, seed=seed)
        out.append({"channel": label, "rate_bps": state.rate_bps if state else "", "per": state.per if state else "",
                    "rtt_s": state.rtt_s if state else "", "method": key[0], "protocol": key[1], **agg})
    return out


def _fmt(v: float, digits: int = 1) -> str:
    return "n/a" if isinstance(v, float) and math.isnan(v) else f"{v:.{digits}f}"


def _table(summary: list[dict]) -> str:
    view = [{"channel": s["channel"], "method": s["method"], "protocol": s["protocol"], "compute": s["compute"], "requests": s["requests"],
             "tokens": s["tokens"], "rounds": s["rounds"], "AAL": _fmt(s["aal"], 2),
             "ms/token [95% CI]": f"{_fmt(s['ms_per_token'])} [{_fmt(s['ms_per_token_lo'])}, {_fmt(s['ms_per_token_hi'])}]",
             "tokens/s": _fmt(s["tokens_per_s"], 2), "target_alone ms/token": _fmt(s["target_alone_ms_per_token"]),
             "both_on_edge ms/token": _fmt(s["both_on_edge_ms_per_token"]),
             "speedup vs target_alone": _fmt(s["speedup_vs_target_alone"], 2)}
            for s in summary]
    return format_table(view)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.latency", description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="round log (JSON lines, wisv_ros.sd.roundlog)")
    ch = p.add_argument_group("channel (default: the four named scenarios)")
    ch.add_argument("--scenario", action="append", help=f"named scenario, repeatable: {', '.join(SCENARIOS)}")
    ch.add_argument("--trace", help="channel trace file (.csv/.yaml, link.ChannelTrace): requests run back to back on it")
    ch.add_argument("--rate-bps", type=float, help="custom channel: rate R in bit/s")
    ch.add_argument("--per", type=float, help="custom channel: packet error rate in [0, 1)")
    ch.add_argument("--rtt-s", type=float, help="custom channel: round-trip time in s")
    p.add_argument("--profile", default=DEFAULT_DEPLOYMENT, help="deployment of the hardware profiles (default %(default)s)")
    p.add_argument("--profiles", default=None, help="hardware profile file (default config/hardware_profiles.yaml)")
    p.add_argument("--measured", action="store_true",
                   help="SD compute as the log measured it (the baselines still come from --profile)")
    p.add_argument("--protocol", default="logged", choices=PROTOCOLS,
                   help="how blocks travel: one protocol for every round, adaptive (per round the cheaper of fh and sh) "
                        "or logged (as each round did; default)")
    p.add_argument("--hidden-dim", type=int, default=None,
                   help="drafter hidden size to price fh/sh with (recomputes the payload bytes; e.g. 896 for qwen2.5-coder-0.5b)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the CI (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default %(default)s)")
    p.add_argument("--csv", default=None, help="write the table's rows (all columns) to this CSV file")
    args = p.parse_args(argv)
    if args.hidden_dim is not None and args.hidden_dim < 1:
        p.error("--hidden-dim must be >= 1")
    if args.bootstrap < 1:
        p.error("--bootstrap must be >= 1")
    channels = _channels(args, p)
    try:
        deployment = load_profiles(args.profiles).deployment(args.profile)
        records = list(read_round_log(args.log))
    except (OSError, ProfileError, ValueError) as exc:
        print(f"[latency] error: {exc}", file=sys.stderr)
        return 1
    compute = MeasuredCompute() if args.measured else ProfileCompute(deployment)
    summary = []
    try:
        for label, channel in channels:
            rows = request_rows(records, channel, compute, protocol=args.protocol, hidden_dim=args.hidden_dim, baseline=deployment)
            summary += _summary_rows(label, channel, rows, args.bootstrap, args.seed)
    except ValueError as exc:
        print(f"[latency] error: {exc}", file=sys.stderr)
        return 1
    print(f"SD compute: {compute.label}" + (" (as the log recorded it)" if args.measured else f" -- {deployment.description}"))
    print(f"baselines target_alone, both_on_edge: {deployment.label}")
    print(_table(summary))
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            w.writeheader()
            w.writerows(summary)
        print(f"[latency] wrote {args.csv}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
