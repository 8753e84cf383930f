"""End-to-end latency per request from a round log, a channel and a compute model (ROS-free, no torch).

A round log (``wisv_ros.sd.roundlog``) holds what a run did: tokens, rounds, mismatches and the payload
bytes of every protocol. Only the time depends on the link and the hardware, so the latency of the same
rounds over any channel, with any protocol and on any hardware is computed here, afterwards::

    latency(request) = sum over its rounds of (compute + communication)

Communication follows the link emulator (``wisv_ros.link.emulator``): a message of n bytes occupies the
link for 8 n / (R (1 - PER)) on average and arrives half an RTT after it left, so one request/response
*exchange* costs ``wisv_ros.link.channel.exchange_time_s``: RTT + up / (R (1 - PER)) + down / (R_down (1 - PER)).
(The emulator also waits a retransmission timeout after each lost packet; the mean cost here does not.)

- a block round pays one exchange: its ids, fh or dist bytes up, the verdict down; the request's prompt
  rides in its first block (prompt_length x 4 bytes more up);
- sh pays a second exchange (hidden request down, the hiddens up, the verdict down) only when the edge
  needed drafter hiddens: method wisv, tau > 0 and a mismatch in the round; otherwise it is ids;
- adaptive: per round the cheaper of fh and sh, knowing that round's mismatches (an oracle choice);
  logged: every round as it travelled (the record's own protocol);
- copy rounds ride in their block's reply: no exchange, only their target pass;
- a target-only request (``target`` records) pays one exchange: the prompt up, its tokens down.

Compute is either ``MeasuredCompute`` (each record's draft/target/head times as logged) or
``ProfileCompute`` (a deployment of ``config/hardware_profiles.yaml``): the drafter costs drafted x its
one-token time on the robot, plus one prefill of the prompt per request; a target pass costs the edge's
block cost for the record's ``target_tokens`` (a target-only record: one token, or the block cost of its
target_tokens when > 1, the prefill). The head time is the logged one in both (profiles have no entry).

Baselines, from the same requests on the deployment's edge device:

- ``target_alone``: one exchange (prompt up, tokens down), a prefill of the prompt (which yields the first
  token) and tokens - 1 one-token passes of the target;
- ``both_on_edge``: one exchange, then the logged rounds with drafter and target both on the edge device
  and no per-round link cost.

With a ``ChannelTrace`` the requests run back to back in log order, each configuration (SD and each
baseline) on its own clock from 0; an exchange sees the state in force when it starts.

Everything computed from a profile is a projection, labelled ``projected (profile NAME)``.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from wisv_ros.link.channel import ChannelState, ChannelTrace, WireFormat, downlink_bytes_verdict, exchange_time_s, scenario
from wisv_ros.sd.roundlog import RoundRecord, read_round_log, round_bytes

__all__ = [
    "KINDS", "PROTOCOLS", "Deployment", "Device", "MeasuredCompute", "ModelCost", "ProfileCompute", "ProfileError", "Profiles",
    "block_comm_s", "bootstrap_ci", "default_profiles_path", "latency_report", "load_profiles", "needs_hiddens",
    "request_exchange_s", "request_rows", "summarize",
]

PROTOCOLS = ("ids", "fh", "sh", "dist", "adaptive", "logged")
KINDS = ("measured", "published", "derived")  # where a profile number comes from
DEFAULT_DEPLOYMENT = "embedded_default"
_WIRE = WireFormat(hidden_dim=1)  # header and id sizes of the wire format (defaults of link.channel)
_NUMBER_KEYS = ("value", "kind", "source", "formula")


# --------------------------------------------------------------------------- hardware profiles


class ProfileError(ValueError):
    """A hardware profile file that does not validate; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """Compute time of one model on one device.

    token_s: one-token decode pass (s); block_s: ((n_tokens, s), ...) for passes over n tokens.
    """

    token_s: float
    block_s: tuple[tuple[int, float], ...]

    def points(self) -> list[tuple[int, float]]:
        """The block table with (1, token_s) added when the table has no entry for one token."""
        pts = dict(self.block_s)
        pts.setdefault(1, self.token_s)
        return sorted(pts.items())

    def block(self, n_tokens: int) -> float:
        """Seconds of one pass over ``n_tokens``: linear between the table's sizes, linear past the
        largest (slope of the last two sizes, never negative), 0 for n_tokens <= 0.

        >>> ModelCost(0.1, ((2, 0.15), (4, 0.25))).block(3), ModelCost(0.1, ((2, 0.15), (4, 0.25))).block(6)
        (0.2, 0.35)
        """
        if n_tokens <= 0:
            return 0.0
        xs, ys = zip(*self.points())
        if n_tokens >= xs[-1]:
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            return round(ys[-1] + slope * (n_tokens - xs[-1]), 12)
        return round(float(np.interp(n_tokens, xs, ys)), 12)


@dataclasses.dataclass(frozen=True)
class Device:
    """A named device and the compute time of each model it lists."""

    name: str
    description: str
    models: Mapping[str, ModelCost]

    def model(self, name: str) -> ModelCost:
        try:
            return self.models[name]
        except KeyError:
            raise ValueError(f"device {self.name} has no figures for model {name} (it lists: {', '.join(self.models)})") from None


@dataclasses.dataclass(frozen=True)
class Deployment:
    """The drafter on the ``robot`` device, the target on the ``edge`` device (the both_on_edge
    baseline runs the drafter on the edge device too)."""

    name: str
    description: str
    drafter: str
    target: str
    robot: Device
    edge: Device

    @property
    def label(self) -> str:
        return f"projected (profile {self.name})"


@dataclasses.dataclass(frozen=True)
class Profiles:
    """The devices and deployments of one profile file."""

    path: str
    devices: Mapping[str, Device]
    deployments: Mapping[str, Deployment]

    def deployment(self, name: str) -> Deployment:
        try:
            return self.deployments[name]
        except KeyError:
            raise ValueError(f"{self.path}: unknown deployment {name!r}; known: {', '.join(self.deployments)}") from None


def default_profiles_path() -> Path:
    """``config/hardware_profiles.yaml`` of this checkout (else of the installed share folder)."""
    checkout = Path(__file__).resolve().parents[2] / "config" / "hardware_profiles.yaml"
    if checkout.is_file():
        return checkout
    from wisv_ros.graph.description import config_dir

    return config_dir() / "hardware_profiles.yaml"


def load_profiles(path: str | Path | None = None) -> Profiles:
    """Read and validate a hardware profile file (format: the header of config/hardware_profiles.yaml).

    Raises:
        ProfileError: a missing or unknown field, a number without value/kind/source (or a derived one
            without its formula, a published one without a URL), a time <= 0, a deployment naming an
            unknown device or a device without the deployment's models; the message names the field.
    """
    import yaml

    path = Path(path) if path is not None else default_profiles_path()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: invalid YAML: {exc}") from None
    where = str(path)
    _require_mapping(data, where, ("devices", "deployments"))
    devices = {str(name): _device(str(name), raw, f"{where}: devices.{name}") for name, raw in _items(data, "devices", where)}
    deployments = {str(name): _deployment(str(name), raw, devices, f"{where}: deployments.{name}")
                   for name, raw in _items(data, "deployments", where)}
    return Profiles(where, devices, deployments)


def _items(data: dict, key: str, where: str) -> list[tuple[Any, Any]]:
    section = data[key]
    if not isinstance(section, dict) or not section:
        raise ProfileError(f"{where}: {key} must be a non-empty mapping")
    return list(section.items())


def _require_mapping(raw: Any, where: str, required: Sequence[str], optional: Sequence[str] = ()) -> None:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: expected a mapping, got {raw!r}")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ProfileError(f"{where}: missing field(s) {', '.join(missing)}")
    unknown = [str(k) for k in raw if k not in (*required, *optional)]
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join((*required, *optional))}")


def _number(raw: Any, where: str) -> float:
    """A profile number {value, kind, source[, formula]} as seconds; ProfileError naming the field."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: expected {{value, kind, source}} (every number needs a kind and a source), got {raw!r}")
    _require_mapping(raw, where, ("value", "kind", "source"), ("formula",))
    value = raw["value"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ProfileError(f"{where}.value: not a finite number: {value!r}")
    if value < 0:
        raise ProfileError(f"{where}.value: negative time {value}")
    if value == 0:
        raise ProfileError(f"{where}.value: a compute time must be > 0, got 0")
    kind, source = raw["kind"], raw["source"]
    if kind not in KINDS:
        raise ProfileError(f"{where}.kind: {kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(source, str) or not source.strip():
        raise ProfileError(f"{where}.source: empty; say where the number comes from")
    if kind == "published" and "http" not in source:
        raise ProfileError(f"{where}.source: a published number needs the URL it was published at")
    if kind == "derived" and not str(raw.get("formula", "")).strip():
        raise ProfileError(f"{where}.formula: a derived number needs the formula it was computed with")
    return float(value)


def _model_cost(raw: Any, where: str) -> ModelCost:
    _require_mapping(raw, where, ("token_s", "block_s"))
    token_s = _number(raw["token_s"], f"{where}.token_s")
    table = raw["block_s"]
    if not isinstance(table, dict) or not table:
        raise ProfileError(f"{where}.block_s: must map n_tokens to numbers")
    points = {}
    for n, entry in table.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ProfileError(f"{where}.block_s: size {n!r} is not an integer >= 1")
        points[n] = _number(entry, f"{where}.block_s.{n}")
    if max(points) < 2:
        raise ProfileError(f"{where}.block_s: needs a size >= 2 (the cost of a block is what the projection is about)")
    return ModelCost(token_s, tuple(sorted(points.items())))


def _device(name: str, raw: Any, where: str) -> Device:
    _require_mapping(raw, where, ("description", "models"))
    if not isinstance(raw["models"], dict) or not raw["models"]:
        raise ProfileError(f"{where}.models: must map model names to their figures")
    models = {str(m): _model_cost(cost, f"{where}.models.{m}") for m, cost in raw["models"].items()}
    return Device(name, str(raw["description"]).strip(), models)


def _deployment(name: str, raw: Any, devices: Mapping[str, Device], where: str) -> Deployment:
    _require_mapping(raw, where, ("drafter", "target", "robot", "edge"), ("description",))
    for role in ("robot", "edge"):
        if raw[role] not in devices:
            raise ProfileError(f"{where}.{role}: unknown device {raw[role]!r}; devices: {', '.join(devices)}")
    robot, edge = devices[raw["robot"]], devices[raw["edge"]]
    needs = (("robot", robot, raw["drafter"], "the drafter"), ("edge", edge, raw["target"], "the target"),
             ("edge", edge, raw["drafter"], "the drafter of the both_on_edge baseline"))
    for role, device, model, what in needs:
        if model not in device.models:
            raise ProfileError(f"{where}.{role}: device {device.name} has no figures for {model} ({what} runs there)")
    return Deployment(name, str(raw.get("description", "")).strip(), str(raw["drafter"]), str(raw["target"]), robot, edge)


# --------------------------------------------------------------------------- compute models


class MeasuredCompute:
    """Compute as logged: each record's draft_time_s, target_time_s and head_time_s (the first
    block's logged draft time already includes the drafter's pass over the prompt)."""

    label = "measured"

    def draft_s(self, rec: RoundRecord) -> float:
        return rec.draft_time_s

    def target_s(self, rec: RoundRecord) -> float:
        return rec.target_time_s

    def head_s(self, rec: RoundRecord) -> float:
        return rec.head_time_s

    def draft_prefill_s(self, prompt_length: int) -> float:
        return 0.0


class ProfileCompute:
    """Compute from a deployment: the drafter on the robot (or, ``drafter_on="edge"``, on the edge
    device), the target on the edge device; the head time as logged."""

    def __init__(self, deployment: Deployment, drafter_on: str = "robot"):
        if drafter_on not in ("robot", "edge"):
            raise ValueError(f"drafter_on must be robot or edge, got {drafter_on!r}")
        self.deployment = deployment
        self.drafter = (deployment.robot if drafter_on == "robot" else deployment.edge).model(deployment.drafter)
        self.target = deployment.edge.model(deployment.target)
        self.label = deployment.label

    def draft_s(self, rec: RoundRecord) -> float:
        return rec.drafted * self.drafter.token_s if rec.kind == "block" else 0.0

    def target_s(self, rec: RoundRecord) -> float:
        if rec.kind == "target" and rec.target_tokens <= 1:
            return self.target.token_s
        return self.target.block(rec.target_tokens)

    def head_s(self, rec: RoundRecord) -> float:
        return rec.head_time_s

    def draft_prefill_s(self, prompt_length: int) -> float:
        return self.drafter.block(prompt_length)


Compute = MeasuredCompute | ProfileCompute


# --------------------------------------------------------------------------- communication


def _resolve_channel(channel: ChannelState | ChannelTrace | str) -> ChannelState | ChannelTrace:
    if isinstance(channel, str):
        return scenario(channel)
    if isinstance(channel, (ChannelState, ChannelTrace)):
        return channel
    raise TypeError(f"channel must be a ChannelState, a ChannelTrace or a scenario name, got {type(channel).__name__}")


def _state(channel: ChannelState | ChannelTrace, t_s: float) -> ChannelState:
    if isinstance(channel, ChannelState):
        return channel
    return channel.at(max(t_s, channel.times[0]))  # before the trace starts its first sample holds


def needs_hiddens(rec: RoundRecord) -> bool:
    """Did the edge need drafter hiddens for this round (sh's second exchange)? Method wisv with
    tau > 0 judges mismatches with the head, which reads the drafter's hiddens at the mismatches."""
    return rec.method == "wisv" and rec.tau > 0 and bool(rec.mismatches)


def _where(rec: RoundRecord) -> str:
    return f"round log record (request {rec.request_id}, round {rec.round_id}, {rec.kind})"


def _require_hidden_dim(rec: RoundRecord, protocol: str) -> None:
    if rec.hidden_dim <= 0:
        raise ValueError(f"{_where(rec)}: protocol {protocol} sends drafter hiddens, but the record's hidden_dim is 0 (the log "
                         "was written without the drafter's hidden size); pass hidden_dim=N (CLI: --hidden-dim N, e.g. 896 "
                         "for qwen2.5-coder-0.5b-instruct) to recompute the payload bytes")


def _vocab_size(rec: RoundRecord) -> int:
    """The target vocabulary the log's dist bytes were computed with (1 when the log did not know it)."""
    per_token = _WIRE.prob_bytes * max(rec.drafted, 1)
    return max((rec.up_bytes_dist - rec.up_bytes_ids) // per_token, 1) if rec.up_bytes_dist else 1


def block_comm_s(rec: RoundRecord, protocol: str, state: ChannelState, extra_up: int = 0) -> float:
    """Link time (s) of one block round under ``protocol`` (ids, fh, sh, dist, adaptive or logged);
    ``extra_up``: bytes riding in the first uplink message (the prompt of the request's first block)."""
    proto = rec.protocol if protocol == "logged" else protocol
    if proto == "adaptive":
        return min(block_comm_s(rec, "fh", state, extra_up), block_comm_s(rec, "sh", state, extra_up))
    if proto == "ids":
        return exchange_time_s(rec.up_bytes_ids + extra_up, rec.down_bytes, state)
    if proto == "fh":
        _require_hidden_dim(rec, "fh")
        return exchange_time_s(rec.up_bytes_fh + extra_up, rec.down_bytes, state)
    if proto == "dist":
        if _vocab_size(rec) <= 1:
            raise ValueError(f"{_where(rec)}: protocol dist sends the drafter's distributions, but the log was written "
                             "without the target's vocabulary size (RoundLog(vocab_size=...))")
        return exchange_time_s(rec.up_bytes_dist + extra_up, rec.down_bytes, state)
    if proto == "sh":
        if not needs_hiddens(rec):
            return exchange_time_s(rec.up_bytes_ids + extra_up, rec.down_bytes, state)
        _require_hidden_dim(rec, "sh")
        hiddens_up = rec.up_bytes_sh - rec.up_bytes_ids
        return exchange_time_s(rec.up_bytes_ids + extra_up, rec.down_bytes_sh, state) + exchange_time_s(hiddens_up, rec.down_bytes, state)
    raise ValueError(f"{_where(rec)}: protocol {proto!r} is not one of ids, fh, sh, dist")


def request_exchange_s(prompt_length: int, tokens: int, state: ChannelState) -> float:
    """One exchange for a whole request: the prompt's ids up, its tokens down (one verdict's framing)."""
    up = _WIRE.header_bytes + prompt_length * _WIRE.id_bytes
    return exchange_time_s(up, downlink_bytes_verdict(_WIRE, tokens), state)


# --------------------------------------------------------------------------- per request


def _with_hidden_dim(rec: RoundRecord, hidden_dim: int | None) -> RoundRecord:
    """The record with its payload bytes recomputed for a drafter of ``hidden_dim`` (None: as logged)."""
    if hidden_dim is None or rec.kind != "block":
        return rec
    if hidden_dim < 1:
        raise ValueError(f"hidden_dim must be >= 1, got {hidden_dim}")
    return dataclasses.replace(rec, hidden_dim=hidden_dim, **round_bytes(rec, hidden_dim, _vocab_size(rec)))


def _group(records: Iterable[RoundRecord], hidden_dim: int | None) -> dict[str, list[RoundRecord]]:
    groups: dict[str, list[RoundRecord]] = {}
    for rec in records:
        groups.setdefault(rec.request_id, []).append(_with_hidden_dim(rec, hidden_dim))
    if not groups:
        raise ValueError("round log: no records")
    return groups


def _prompt_length(recs: Sequence[RoundRecord]) -> int:
    """Committed tokens before the request's first round: its prompt."""
    return min(r.prefix_length for r in recs)


def _request_cost(recs: Sequence[RoundRecord], channel: ChannelState | ChannelTrace, compute: Compute, protocol: str,
                  t0: float, per_round_link: bool = True) -> tuple[float, float]:
    """(compute_s, comm_s) of one request that starts at ``t0`` on its configuration's clock.

    per_round_link False (both_on_edge), or a request without blocks (target-only): one exchange for
    the request (prompt up, tokens down) instead of one per block round.
    """
    prompt = _prompt_length(recs)
    blocks = per_round_link and any(r.kind == "block" for r in recs)
    comm = 0.0 if blocks else request_exchange_s(prompt, sum(r.committed for r in recs), _state(channel, t0))
    comp = compute.draft_prefill_s(prompt) if any(r.kind == "block" for r in recs) else 0.0
    t = t0 + comm + comp
    first = True
    for rec in recs:
        draft = compute.draft_s(rec) if rec.kind == "block" else 0.0
        link = 0.0
        if blocks and rec.kind == "block":
            link = block_comm_s(rec, protocol, _state(channel, t + draft), prompt * _WIRE.id_bytes if first else 0)
            first = False
        edge = compute.target_s(rec) + compute.head_s(rec)
        comp += draft + edge
        comm += link
        t += draft + link + edge
    return comp, comm


def _target_alone_s(recs: Sequence[RoundRecord], deployment: Deployment, channel: ChannelState | ChannelTrace, t0: float) -> float:
    """The target alone on the edge for the request's tokens: one exchange, the prompt's prefill
    (which yields the first token), then one pass per further token."""
    target = deployment.edge.model(deployment.target)
    prompt, tokens = _prompt_length(recs), sum(r.committed for r in recs)
    return request_exchange_s(prompt, tokens, _state(channel, t0)) + target.block(prompt) + max(tokens - 1, 0) * target.token_s


def _labels(recs: Sequence[RoundRecord], protocol: str) -> tuple[str, str, int]:
    """(method, protocol, k) of a request for the tables."""
    rounds = [r for r in recs if r.kind != "copy"]
    method = "+".join(sorted({r.method for r in rounds})) or "-"
    blocks = [r for r in recs if r.kind == "block"]
    if not blocks:
        return method, "-", 0
    proto = "+".join(sorted({r.protocol for r in blocks})) if protocol == "logged" else protocol
    return method, proto, max(r.k for r in blocks)


def request_rows(records: Iterable[RoundRecord] | str | Path, channel: ChannelState | ChannelTrace | str, compute: Compute, *,
                 protocol: str = "logged", hidden_dim: int | None = None, baseline: Deployment | None = None) -> list[dict]:
    """One row per request (log order): tokens, rounds, AAL and the latency of SD and, with a
    ``baseline`` deployment (default: the compute's own deployment), of the two baselines.

    records: RoundRecords or a round log path; hidden_dim: recompute the payload bytes for a drafter
    of this hidden size (logs written without it cannot price fh and sh).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    channel = _resolve_channel(channel)
    if isinstance(records, (str, Path)):
        records = read_round_log(records)
    if baseline is None and isinstance(compute, ProfileCompute):
        baseline = compute.deployment
    edge_compute = ProfileCompute(baseline, drafter_on="edge") if baseline is not None else None
    clock = {"sd": 0.0, "target_alone": 0.0, "both_on_edge": 0.0}
    rows = []
    for rid, recs in _group(records, hidden_dim).items():
        method, proto, k = _labels(recs, protocol)
        tokens = sum(r.committed for r in recs)
        rounds = sum(r.kind != "copy" for r in recs)
        comp, comm = _request_cost(recs, channel, compute, protocol, clock["sd"])
        latency = comp + comm
        clock["sd"] += latency
        row = {"request_id": rid, "method": method, "protocol": proto, "k": k, "compute": compute.label, "tokens": tokens,
               "rounds": rounds, "copy_rounds": len(recs) - rounds, "aal": tokens / rounds if rounds else math.nan,
               "compute_s": comp, "comm_s": comm, "latency_s": latency, "ms_per_token": _ms_per_token(latency, tokens),
               "tokens_per_s": tokens / latency if latency > 0 else math.nan,
               "baseline_compute": baseline.label if baseline is not None else "", "target_alone_s": math.nan, "both_on_edge_s": math.nan}
        if baseline is not None:
            row["target_alone_s"] = _target_alone_s(recs, baseline, channel, clock["target_alone"])
            row["both_on_edge_s"] = sum(_request_cost(recs, channel, edge_compute, protocol, clock["both_on_edge"], per_round_link=False))
            clock["target_alone"] += row["target_alone_s"]
            clock["both_on_edge"] += row["both_on_edge_s"]
        rows.append(row)
    return rows


def _ms_per_token(seconds: float, tokens: int) -> float:
    return 1e3 * seconds / tokens if tokens > 0 else math.nan


# --------------------------------------------------------------------------- aggregate


def bootstrap_ci(values: Sequence[Any], stat: Callable[[list], float], n: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of ``stat`` over ``values`` (resampled with
    replacement ``n`` times, seeded): (lo, hi) at ``level``.

    >>> bootstrap_ci([1.0, 1.0, 1.0], lambda v: sum(v) / len(v))
    (1.0, 1.0)
    """
    values = list(values)
    if not values:
        raise ValueError("bootstrap_ci: no values")
    if n < 1 or not 0 < level < 1:
        raise ValueError(f"bootstrap_ci: n must be >= 1 and level in (0, 1), got n={n}, level={level}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(n, len(values)))
    stats = np.array([stat([values[i] for i in row]) for row in idx], dtype=np.float64)
    lo, hi = np.nanquantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _ratio_ms(key: str) -> Callable[[list[dict]], float]:
    """ms per token of the rows together: total ``key`` seconds over total tokens."""
    return lambda rows: _ms_per_token(sum(r[key] for r in rows), sum(r["tokens"] for r in rows))


def summarize(rows: Sequence[dict], n_boot: int = 1000, seed: int = 0) -> dict:
    """Aggregate of request rows: totals, AAL, tokens/s = total tokens / total time, ms per token with
    a 95 % bootstrap CI over requests, and the same for the baselines when the rows have them."""
    if not rows:
        raise ValueError("summarize: no rows")
    tokens, rounds = sum(r["tokens"] for r in rows), sum(r["rounds"] for r in rows)
    latency = sum(r["latency_s"] for r in rows)
    out = {"requests": len(rows), "tokens": tokens, "rounds": rounds, "copy_rounds": sum(r["copy_rounds"] for r in rows),
           "aal": tokens / rounds if rounds else math.nan, "latency_s": latency,
           "tokens_per_s": tokens / latency if latency > 0 else math.nan,
           "compute": _joined(r["compute"] for r in rows), "baseline_compute": _joined(r["baseline_compute"] for r in rows)}
    for name, key in (("", "latency_s"), ("target_alone_", "target_alone_s"), ("both_on_edge_", "both_on_edge_s")):
        if any(math.isnan(r[key]) for r in rows):
            out.update({f"{name}ms_per_token": math.nan, f"{name}ms_per_token_lo": math.nan, f"{name}ms_per_token_hi": math.nan})
            continue
        lo, hi = bootstrap_ci(rows, _ratio_ms(key), n=n_boot, seed=seed)
        out.update({f"{name}ms_per_token": _ratio_ms(key)(rows), f"{name}ms_per_token_lo": lo, f"{name}ms_per_token_hi": hi})
    out["speedup_vs_target_alone"] = out["target_alone_ms_per_token"] / out["ms_per_token"]
    return out


def _joined(labels: Iterable[str]) -> str:
    return "; ".join(dict.fromkeys(label for label in labels if label))


def latency_report(records: Iterable[RoundRecord] | str | Path, channel: ChannelState | ChannelTrace | str, compute: Compute, *,
                   protocol: str = "logged", hidden_dim: int | None = None, baseline: Deployment | None = None,
                   n_boot: int = 1000, seed: int = 0) -> tuple[list[dict], dict]:
    """``request_rows`` and their ``summarize`` aggregate."""
    rows = request_rows(records, channel, compute, protocol=protocol, hidden_dim=hidden_dim, baseline=baseline)
    return rows, summarize(rows, n_boot=n_boot, seed=seed)
