"""Wireless link model: channel state, payload sizes, and time costs.

Pure Python (stdlib + numpy; PyYAML only to read YAML traces). No rclpy, no torch,
so the nodes, the benchmark tools and the tests share the same cost model.

The model follows SPEC "Costs" (WISV paper Eqs. 3-19):

- A channel is a link-layer abstraction ``ChannelState(rate_bps, per, rtt_s)``:
  effective rate R, packet error rate PER, round-trip time rtt_s (tau_RTT in the paper; "tau" alone is the WISV threshold).
- Sending ``n`` bytes takes ``8 n / (R (1 - PER))`` seconds (retransmissions stretch the
  serialisation time). Every request/response *exchange* also pays one RTT.
- Per speculative round the protocols differ only in what they upload:

  ======  =========================================  =========
  name    uplink                                     exchanges
  ======  =========================================  =========
  IDS     B_hdr + K b_id           (greedy SD)       1
  FH      B_hdr + K b_id + K B_hid (full hidden)     1
  SH      B_hdr + K b_id, then B_hdr + |S| B_hid     2 (1 if |S| = 0)
  DIST    B_hdr + K b_id + K |V| b_p (rejection SD)  1
  ======  =========================================  =========

  with B_hid = d_h b_h. The downlink carries the verdict (and, for SH, first the
  request for the hiddens at the mismatch set S).
- Compute time is FLOPs / (alpha * peak) with the per-token FLOPs of SPEC Eq. 13.

Glossary: K = draft block length, S = mismatch set (positions where the draft token differs
from the target's argmax), |V| = vocabulary size.
"""

from __future__ import annotations

import csv
import enum
import math
import numbers
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

__all__ = [
    "CHANNEL_FEATURES",
    "ChannelState",
    "SCENARIOS",
    "TauSchedule",
    "scenario",
    "ChannelTrace",
    "WireFormat",
    "ShPayload",
    "hidden_bytes",
    "uplink_bytes_ids",
    "uplink_bytes_fh",
    "uplink_bytes_sh",
    "uplink_bytes_dist",
    "downlink_bytes_request",
    "downlink_bytes_verdict",
    "transfer_time_s",
    "exchange_time_s",
    "comm_time_ids",
    "comm_time_fh",
    "comm_time_sh",
    "comm_time_dist",
    "Protocol",
    "choose_protocol",
    "ModelShape",
    "forward_flops",
    "compute_time_s",
]


# --------------------------------------------------------------------------- validation


def _check_real(name: str, value: Any) -> float:
    """Return ``value`` as a finite float or raise naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _check_int(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` as an int >= ``minimum`` or raise naming the field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_positive(name: str, value: Any) -> float:
    value = _check_real(name, value)
    if value <= 0.0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


def _check_per(name: str, value: Any) -> float:
    value = _check_real(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return value


def _check_nonnegative(name: str, value: Any) -> float:
    value = _check_real(name, value)
    if value < 0.0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


# --------------------------------------------------------------------------- channel state

#: Names of the entries of :meth:`ChannelState.features`, in order. Stable: the decision
#: head is trained on this layout, so changing it invalidates trained heads.
CHANNEL_FEATURES: tuple[str, ...] = ("log_rate", "per", "rtt")

_FEATURE_RATE_REF_BPS = 1e6  # log_rate = 0 at 1 Mbit/s ...
_FEATURE_RATE_DECADES = 3.0  # ... and 1 at 1 Gbit/s
_FEATURE_RTT_UNIT_S = 0.1  # rtt in units of 100 ms


@dataclass(frozen=True)
class ChannelState:
    """State of the robot-edge link for one round.

    Attributes:
        rate_bps: effective uplink data rate R in bit/s, > 0.
        per: packet error rate in [0, 1); the goodput is ``rate_bps * (1 - per)``.
        rtt_s: round-trip time in s, >= 0; paid once per request/response exchange.
        downlink_rate_bps: downlink rate in bit/s, > 0; ``None`` means same as ``rate_bps``
            (after construction it is always a float). The same PER applies both ways.
    """

    rate_bps: float
    per: float
    rtt_s: float
    downlink_rate_bps: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rate_bps", _check_positive("rate_bps", self.rate_bps))
        object.__setattr__(self, "per", _check_per("per", self.per))
        object.__setattr__(self, "rtt_s", _check_nonnegative("rtt_s", self.rtt_s))
        down = self.rate_bps if self.downlink_rate_bps is None else self.downlink_rate_bps
        object.__setattr__(self, "downlink_rate_bps", _check_positive("downlink_rate_bps", down))

    def features(self) -> np.ndarray:
        """Normalised channel features for the decision head, layout :data:`CHANNEL_FEATURES`.

        - ``log_rate`` = log10(rate_bps / 1e6) / 3: 0 at 1 Mbit/s, 1 at 1 Gbit/s
          (20 Mbit/s -> 0.434, 500 Mbit/s -> 0.900); negative below 1 Mbit/s.
        - ``per`` = packet error rate, unchanged (already in [0, 1)).
        - ``rtt`` = rtt_s / 0.1, i.e. RTT in units of 100 ms (5 ms -> 0.05, 50 ms -> 0.5).

        The downlink rate is not a feature. Returns a float32 array of shape (3,).

        >>> [round(float(x), 3) for x in ChannelState(20e6, 0.01, 0.05).features()]
        [0.434, 0.01, 0.5]
        """
        log_rate = math.log10(self.rate_bps / _FEATURE_RATE_REF_BPS) / _FEATURE_RATE_DECADES
        return np.array(
            [log_rate, self.per, self.rtt_s / _FEATURE_RTT_UNIT_S], dtype=np.float32
        )


# --------------------------------------------------------------------------- scenarios

#: The paper's four channel scenarios ({20, 500} Mbit/s x RTT {5, 50} ms). The paper gives
#: no PER values; we choose PER = 0.01 for the 20 Mbit/s ("bad") link and 0.001 for the
#: 500 Mbit/s ("good") link, typical post-HARQ residual error rates for a weak and a strong
#: Wi-Fi/5G link.
SCENARIOS: dict[str, ChannelState] = {
    "20mbps_5ms": ChannelState(rate_bps=20e6, per=0.01, rtt_s=0.005),
    "20mbps_50ms": ChannelState(rate_bps=20e6, per=0.01, rtt_s=0.050),
    "500mbps_5ms": ChannelState(rate_bps=500e6, per=0.001, rtt_s=0.005),
    "500mbps_50ms": ChannelState(rate_bps=500e6, per=0.001, rtt_s=0.050),
}


def scenario(name: str) -> ChannelState:
    """Return the named channel scenario from :data:`SCENARIOS`.

    Raises:
        KeyError: unknown name; the message lists the valid names.
    """
    try:
        return SCENARIOS[name]
    except KeyError:
        valid = ", ".join(sorted(SCENARIOS))
        raise KeyError(f"unknown channel scenario {name!r}; valid names: {valid}") from None


# --------------------------------------------------------------------------- traces

_TRACE_REQUIRED = ("t_s", "rate_bps", "per", "rtt_s")
_TRACE_OPTIONAL = ("downlink_rate_bps",)


class ChannelTrace:
    """A piecewise-constant time series of channel states (step changes).

    Sample ``i`` holds from ``times[i]`` (inclusive) until ``times[i + 1]`` (exclusive);
    the last sample holds forever. Times are in seconds and strictly increasing.

    File formats for :meth:`load` (columns/keys ``t_s, rate_bps, per, rtt_s`` and
    optionally ``downlink_rate_bps``):

    - CSV with a header row, e.g.::

        t_s,rate_bps,per,rtt_s
        0.0,500e6,0.001,0.005
        2.5,20e6,0.01,0.050

    - YAML: a list of mappings, or a mapping with key ``samples`` holding that list::

        samples:
          - {t_s: 0.0, rate_bps: 500.0e6, per: 0.001, rtt_s: 0.005}
          - {t_s: 2.5, rate_bps: 20.0e6, per: 0.01, rtt_s: 0.050}
    """

    def __init__(self, times: Sequence[float], states: Sequence[ChannelState]) -> None:
        if len(times) != len(states):
            raise ValueError(f"times and states differ in length: {len(times)} != {len(states)}")
        if not times:
            raise ValueError("a channel trace needs at least one sample")
        checked = [_check_real(f"times[{i}]", t) for i, t in enumerate(times)]
        for i in range(1, len(checked)):
            if checked[i] <= checked[i - 1]:
                raise ValueError(
                    f"times must be strictly increasing: times[{i}]={checked[i]} "
                    f"<= times[{i - 1}]={checked[i - 1]}"
                )
        for i, state in enumerate(states):
            if not isinstance(state, ChannelState):
                raise TypeError(f"states[{i}] must be a ChannelState, got {type(state).__name__}")
        self._times: tuple[float, ...] = tuple(checked)
        self._states: tuple[ChannelState, ...] = tuple(states)

    @property
    def times(self) -> tuple[float, ...]:
        """Start time (s) of each sample."""
        return self._times

    @property
    def states(self) -> tuple[ChannelState, ...]:
        """Channel state of each sample."""
        return self._states

    def __len__(self) -> int:
        return len(self._times)

    def at(self, t_s: float) -> ChannelState:
        """Channel state in force at time ``t_s`` (the last sample with ``times[i] <= t_s``).

        Raises:
            ValueError: ``t_s`` is before the first sample.
        """
        t_s = _check_real("t_s", t_s)
        i = bisect_right(self._times, t_s) - 1
        if i < 0:
            raise ValueError(f"t_s={t_s} is before the trace start {self._times[0]}")
        return self._states[i]

    @classmethod
    def load(cls, path: str | Path) -> "ChannelTrace":
        """Load a trace from a ``.csv``, ``.yaml`` or ``.yml`` file (format: see class doc).

        Raises:
            ValueError: unknown extension, malformed file, a missing/unknown column, a field
                out of range or non-increasing times; the message names the file, the line
                and the field.
            OSError: the file cannot be read.
        """
        path = Path(path)
        suffix = path.suffix.lower()
        text = path.read_text(encoding="utf-8")
        if suffix == ".csv":
            rows = _csv_rows(text, path)
        elif suffix in (".yaml", ".yml"):
            rows = _yaml_rows(text, path)
        else:
            raise ValueError(f"{path}: unknown trace format {suffix!r}; use .csv, .yaml or .yml")
        return _trace_from_rows(rows, path)


def _csv_rows(text: str, path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Parse CSV text into (line number, row) pairs; values stay strings."""
    reader = csv.reader(text.splitlines())
    header: list[str] | None = None
    rows: list[tuple[int, dict[str, Any]]] = []
    for fields in reader:
        line = reader.line_num
        if not fields or all(not f.strip() for f in fields) or fields[0].lstrip().startswith("#"):
            continue
        fields = [f.strip() for f in fields]
        if header is None:
            header = fields
            _check_columns(header, path, line)
            continue
        if len(fields) != len(header):
            raise ValueError(
                f"{path}:{line}: expected {len(header)} fields ({', '.join(header)}), "
                f"got {len(fields)}"
            )
        rows.append((line, dict(zip(header, fields))))
    if header is None:
        raise ValueError(f"{path}: empty trace (no header row)")
    return rows


def _yaml_rows(text: str, path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Parse YAML text into (line number, row) pairs."""
    import yaml  # Only needed for YAML traces.

    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {exc}") from None
    seq_node = root
    if isinstance(data, dict):
        if "samples" not in data:
            raise ValueError(f"{path}: YAML trace mapping must have a 'samples' key")
        data = data["samples"]
        seq_node = next(v for k, v in root.value if k.value == "samples")
    if not isinstance(data, list):
        raise ValueError(f"{path}: YAML trace must be a list of samples (or 'samples: [...]')")
    rows: list[tuple[int, dict[str, Any]]] = []
    for item, node in zip(data, seq_node.value):
        line = node.start_mark.line + 1
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{line}: sample must be a mapping, got {item!r}")
        _check_columns(list(item), path, line)
        rows.append((line, item))
    return rows


def _check_columns(columns: list[str], path: Path, line: int) -> None:
    missing = [c for c in _TRACE_REQUIRED if c not in columns]
    if missing:
        raise ValueError(f"{path}:{line}: missing field(s) {', '.join(missing)}")
    unknown = [c for c in columns if c not in _TRACE_REQUIRED + _TRACE_OPTIONAL]
    if unknown:
        allowed = ", ".join(_TRACE_REQUIRED + _TRACE_OPTIONAL)
        raise ValueError(f"{path}:{line}: unknown field(s) {', '.join(unknown)}; allowed: {allowed}")


def _trace_from_rows(rows: list[tuple[int, dict[str, Any]]], path: Path) -> ChannelTrace:
    if not rows:
        raise ValueError(f"{path}: trace has no samples")
    times: list[float] = []
    states: list[ChannelState] = []
    for line, row in rows:
        values: dict[str, Any] = {}
        for key, raw in row.items():
            if raw is None or raw == "":
                if key in _TRACE_OPTIONAL:
                    continue
                raise ValueError(f"{path}:{line}: field {key} is empty")
            try:
                values[key] = float(raw) if isinstance(raw, str) else raw
            except ValueError:
                raise ValueError(f"{path}:{line}: field {key}: not a number: {raw!r}") from None
        try:
            t_s = _check_real("t_s", values.pop("t_s"))
            state = ChannelState(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{line}: {exc}") from None
        if times and t_s <= times[-1]:
            raise ValueError(
                f"{path}:{line}: t_s must be strictly increasing, got {t_s} after {times[-1]}"
            )
        times.append(t_s)
        states.append(state)
    return ChannelTrace(times, states)


# --------------------------------------------------------------------------- payload sizes


@dataclass(frozen=True)
class WireFormat:
    """Sizes (bytes) of the fields of the draft/verdict messages.

    Attributes:
        hidden_dim: d_h, width of one drafter hidden state.
        header_bytes: B_hdr, per-message header (default 64).
        id_bytes: b_id, one token id or index (default 4, int32).
        hidden_dtype_bytes: b_h, one hidden element (default 2, float16).
        prob_bytes: one probability of the drafter distribution (default 2, float16).
    """

    hidden_dim: int
    header_bytes: int = 64
    id_bytes: int = 4
    hidden_dtype_bytes: int = 2
    prob_bytes: int = 2

    def __post_init__(self) -> None:
        _check_int("hidden_dim", self.hidden_dim, 1)
        _check_int("header_bytes", self.header_bytes, 0)
        _check_int("id_bytes", self.id_bytes, 1)
        _check_int("hidden_dtype_bytes", self.hidden_dtype_bytes, 1)
        _check_int("prob_bytes", self.prob_bytes, 1)


class ShPayload(NamedTuple):
    """Message sizes (bytes) of one SH round; the last two are 0 when |S| = 0."""

    ids_up: int  # first uplink: B_hdr + K b_id
    request_down: int  # edge -> robot: B_hdr + |S| b_id (indices of the mismatches)
    hiddens_up: int  # second uplink: B_hdr + |S| B_hid


def hidden_bytes(fmt: WireFormat) -> int:
    """B_hid = d_h * b_h, bytes of one hidden state (SPEC Eq. 3)."""
    return fmt.hidden_dim * fmt.hidden_dtype_bytes


def uplink_bytes_ids(fmt: WireFormat, k: int) -> int:
    """Greedy SD / SH first upload: B_hdr + K b_id."""
    k = _check_int("k", k, 1)
    return fmt.header_bytes + k * fmt.id_bytes


def uplink_bytes_fh(fmt: WireFormat, k: int) -> int:
    """FH upload: B_hdr + K b_id + K B_hid (SPEC Eq. 5)."""
    return uplink_bytes_ids(fmt, k) + k * hidden_bytes(fmt)


def downlink_bytes_request(fmt: WireFormat, n_mismatch: int) -> int:
    """SH hidden-state request: B_hdr + |S| b_id; 0 when there is nothing to request."""
    n_mismatch = _check_int("n_mismatch", n_mismatch, 0)
    return 0 if n_mismatch == 0 else fmt.header_bytes + n_mismatch * fmt.id_bytes


def uplink_bytes_sh(fmt: WireFormat, k: int, n_mismatch: int) -> ShPayload:
    """SH message sizes: ids up, request of |S| indices down, |S| hiddens up.

    >>> uplink_bytes_sh(WireFormat(hidden_dim=4096), k=16, n_mismatch=2)
    ShPayload(ids_up=128, request_down=72, hiddens_up=16448)
    """
    k = _check_int("k", k, 1)
    n_mismatch = _check_int("n_mismatch", n_mismatch, 0)
    if n_mismatch > k:
        raise ValueError(f"n_mismatch must be in [0, k={k}], got {n_mismatch}")
    hiddens = 0 if n_mismatch == 0 else fmt.header_bytes + n_mismatch * hidden_bytes(fmt)
    return ShPayload(
        ids_up=uplink_bytes_ids(fmt, k),
        request_down=downlink_bytes_request(fmt, n_mismatch),
        hiddens_up=hiddens,
    )


def uplink_bytes_dist(fmt: WireFormat, k: int, vocab_size: int) -> int:
    """Rejection-sampling SD upload: B_hdr + K b_id + K |V| b_p (the drafter's distributions)."""
    vocab_size = _check_int("vocab_size", vocab_size, 1)
    return uplink_bytes_ids(fmt, k) + k * vocab_size * fmt.prob_bytes


def downlink_bytes_verdict(fmt: WireFormat, n_committed: int) -> int:
    """Verdict: B_hdr + accepted count + correction/bonus id + the committed ids (b_id each)."""
    n_committed = _check_int("n_committed", n_committed, 0)
    return fmt.header_bytes + 2 * fmt.id_bytes + n_committed * fmt.id_bytes


# --------------------------------------------------------------------------- time costs


def transfer_time_s(n_bytes: float, rate_bps: float, per: float) -> float:
    """Serialisation time of ``n_bytes``: 8 n / (R (1 - PER)) seconds (SPEC Eq. 6)."""
    n_bytes = _check_nonnegative("n_bytes", n_bytes)
    rate_bps = _check_positive("rate_bps", rate_bps)
    per = _check_per("per", per)
    return 8.0 * n_bytes / (rate_bps * (1.0 - per))


def exchange_time_s(up_bytes: float, down_bytes: float, ch: ChannelState) -> float:
    """One request/response exchange: RTT + uplink transfer + downlink transfer."""
    assert ch.downlink_rate_bps is not None  # Set by ChannelState.__post_init__.
    return (
        ch.rtt_s
        + transfer_time_s(up_bytes, ch.rate_bps, ch.per)
        + transfer_time_s(down_bytes, ch.downlink_rate_bps, ch.per)
    )


def _verdict_bytes(fmt: WireFormat, k: int, n_committed: int | None) -> int:
    # Default: the largest verdict, all K drafts accepted plus the bonus token.
    return downlink_bytes_verdict(fmt, k + 1 if n_committed is None else n_committed)


def comm_time_ids(
    fmt: WireFormat, k: int, ch: ChannelState, *, n_committed: int | None = None
) -> float:
    """Greedy SD round: one exchange, ids up, verdict down.

    ``n_committed`` sizes the verdict; ``None`` means K + 1 (an upper bound). Same for all
    ``comm_time_*`` functions.
    """
    return exchange_time_s(uplink_bytes_ids(fmt, k), _verdict_bytes(fmt, k, n_committed), ch)


def comm_time_fh(
    fmt: WireFormat, k: int, ch: ChannelState, *, n_committed: int | None = None
) -> float:
    """FH round: one exchange, ids + K hiddens up, verdict down."""
    return exchange_time_s(uplink_bytes_fh(fmt, k), _verdict_bytes(fmt, k, n_committed), ch)


def comm_time_sh(
    fmt: WireFormat,
    k: int,
    n_mismatch: float,
    ch: ChannelState,
    *,
    n_committed: int | None = None,
) -> float:
    """SH round: ids up + request down, then |S| hiddens up + verdict down.

    With ``n_mismatch == 0`` the edge sends the verdict right away: one exchange, ids up and
    verdict down. ``n_mismatch`` may be fractional (an expected |S|, see
    :func:`choose_protocol`); any value > 0 is charged the full second exchange.
    """
    k = _check_int("k", k, 1)
    n = _check_real("n_mismatch", n_mismatch)
    if not 0.0 <= n <= k:
        raise ValueError(f"n_mismatch must be in [0, k={k}], got {n_mismatch!r}")
    verdict = _verdict_bytes(fmt, k, n_committed)
    ids_up = uplink_bytes_ids(fmt, k)
    if n == 0.0:
        return exchange_time_s(ids_up, verdict, ch)
    request_down = fmt.header_bytes + n * fmt.id_bytes
    hiddens_up = fmt.header_bytes + n * hidden_bytes(fmt)
    return exchange_time_s(ids_up, request_down, ch) + exchange_time_s(hiddens_up, verdict, ch)


def comm_time_dist(
    fmt: WireFormat,
    k: int,
    vocab_size: int,
    ch: ChannelState,
    *,
    n_committed: int | None = None,
) -> float:
    """Rejection-sampling SD round: one exchange, ids + K |V| probabilities up, verdict down."""
    return exchange_time_s(
        uplink_bytes_dist(fmt, k, vocab_size), _verdict_bytes(fmt, k, n_committed), ch
    )


# --------------------------------------------------------------------------- protocol choice


class Protocol(str, enum.Enum):
    """What the robot uploads per round."""

    IDS = "ids"  # token ids only (greedy SD)
    FH = "fh"  # ids + all K drafter hiddens
    SH = "sh"  # ids, then the hiddens at the mismatches on request
    DIST = "dist"  # ids + the drafter's K distributions (rejection-sampling SD)

    def __str__(self) -> str:
        return self.value


def choose_protocol(
    fmt: WireFormat, k: int, ch: ChannelState, expected_mismatches: float
) -> Protocol:
    """Pick FH or SH by the smaller expected communication time of one round.

    ``expected_mismatches`` is the caller's estimate of |S| (e.g. a running mean over
    recent rounds), in [0, K]. Up to the small id/request messages, SH wins iff its extra
    exchange is cheaper than the hiddens it avoids::

        RTT + B_hdr / R' < (K - E|S|) B_hid / R',   R' = R (1 - PER)

    so SH wins at low rate and low RTT, FH at high rate or high RTT. Ties go to FH
    (one exchange). With d_h = 4096 fp16 (B_hid = 8 KiB), K = 16, E|S| = 2:

    >>> fmt = WireFormat(hidden_dim=4096)
    >>> choose_protocol(fmt, 16, scenario("20mbps_5ms"), 2.0)     # FH 58 ms, SH 17 ms
    <Protocol.SH: 'sh'>
    >>> choose_protocol(fmt, 16, scenario("500mbps_50ms"), 2.0)   # FH 52 ms, SH 100 ms
    <Protocol.FH: 'fh'>
    """
    t_fh = comm_time_fh(fmt, k, ch)
    t_sh = comm_time_sh(fmt, k, expected_mismatches, ch)
    return Protocol.SH if t_sh < t_fh else Protocol.FH


# --------------------------------------------------------------------------- compute time

# Per-token FLOPs constants of SPEC Eq. 13 (a matmul of an m-vector by an m x n matrix
# costs 2 m n FLOPs):
_C1_PROJ = 8  # Q, K, V, O projections: 4 d x d matmuls x 2 (full MHA; GQA needs fewer)
_C2_GATED_MLP = 6  # gate, up, down: 3 d x d_ff matmuls x 2
_C2_PLAIN_MLP = 4  # up, down: 2 d x d_ff matmuls x 2
_C3_ATTN = 4  # scores q.k (2 l d) + weighted sum of values (2 l d)
_C4_LM_HEAD = 2  # d x |V| unembedding x 2


@dataclass(frozen=True)
class ModelShape:
    """Transformer dimensions for the FLOPs model.

    Attributes:
        n_layers: N, number of decoder layers.
        d_model: d, residual width.
        d_ff: MLP inner width.
        vocab: |V|, vocabulary size.
        gated_mlp: True for SwiGLU-style MLPs (3 matmuls, c2 = 6), False for 2 (c2 = 4).
    """

    n_layers: int
    d_model: int
    d_ff: int
    vocab: int
    gated_mlp: bool = True

    def __post_init__(self) -> None:
        _check_int("n_layers", self.n_layers, 1)
        _check_int("d_model", self.d_model, 1)
        _check_int("d_ff", self.d_ff, 1)
        _check_int("vocab", self.vocab, 1)


def forward_flops(shape: ModelShape, n_tokens: int, context_len: int) -> float:
    """FLOPs of one forward pass over ``n_tokens`` new tokens after ``context_len`` cached ones.

    Per token (SPEC Eq. 13): f(l) = N (8 d^2 + c2 d d_ff + 4 l d) + 2 d |V|, with c2 = 6
    (gated MLP) or 4, where l is the number of positions the token attends to. New token j
    (0-based) attends to ``context_len + j + 1`` positions, so the attention term sums to
    4 N d (n context_len + n (n + 1) / 2). The LM head runs on every new token (verification
    needs K + 1 logits).

    >>> forward_flops(ModelShape(n_layers=1, d_model=2, d_ff=4, vocab=10), 1, 0)
    128.0
    """
    n_tokens = _check_int("n_tokens", n_tokens, 1)
    context_len = _check_int("context_len", context_len, 0)
    n, d = shape.n_layers, shape.d_model
    c2 = _C2_GATED_MLP if shape.gated_mlp else _C2_PLAIN_MLP
    per_token_dense = n * (_C1_PROJ * d * d + c2 * d * shape.d_ff) + _C4_LM_HEAD * d * shape.vocab
    attended = n_tokens * context_len + n_tokens * (n_tokens + 1) / 2
    return float(n_tokens * per_token_dense + n * _C3_ATTN * d * attended)


def compute_time_s(flops: float, peak_flops: float, efficiency: float) -> float:
    """Time of ``flops`` on a device: flops / (efficiency * peak_flops) (SPEC Eq. 11).

    ``peak_flops`` is in FLOP/s (> 0); ``efficiency`` (alpha) in (0, 1] lumps memory
    bandwidth limits and kernel overheads.
    """
    flops = _check_nonnegative("flops", flops)
    peak_flops = _check_positive("peak_flops", peak_flops)
    efficiency = _check_real("efficiency", efficiency)
    if not 0.0 < efficiency <= 1.0:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    return flops / (efficiency * peak_flops)


# --------------------------------------------------------------------------- tau per channel


class TauSchedule:
    """WISV's threshold chosen by the channel: one τ per named scenario, applied to a measured
    channel state by the nearest scenario in the head's own channel features (``features()``).

    The τ of each scenario is chosen on held-out problems for an accuracy budget
    (``python -m wisv_ros.cli.select_tau --channel <scenario>``, docs/wisv.md); between the four
    the nearest one's τ holds. Text form (the verifier's ``tau_per_channel`` parameter):
    ``"20mbps_5ms:0.02,20mbps_50ms:0.1,500mbps_5ms:0.02,500mbps_50ms:0.05"``.

    Raises ValueError naming the entry for an unknown scenario, a τ that is not a finite number
    >= 0, a scenario given twice, or an empty schedule.
    """

    def __init__(self, taus: dict[str, float]):
        if not taus:
            raise ValueError("tau_per_channel: no scenario given (e.g. '20mbps_50ms:0.1,500mbps_5ms:0.02')")
        for name, tau in taus.items():
            if name not in SCENARIOS:
                raise ValueError(f"tau_per_channel: unknown channel scenario {name!r}; valid names: {', '.join(sorted(SCENARIOS))}")
            if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau >= 0):
                raise ValueError(f"tau_per_channel: tau of {name} must be a finite number >= 0, got {tau!r}")
        self.taus = {name: float(tau) for name, tau in taus.items()}
        self._names = list(self.taus)
        self._points = np.stack([SCENARIOS[n].features() for n in self._names]).astype(np.float64)

    @classmethod
    def parse(cls, text: str) -> "TauSchedule":
        """From ``"<scenario>:<tau>,<scenario>:<tau>,..."``."""
        taus: dict[str, float] = {}
        for item in (t.strip() for t in text.split(",")):
            if not item:
                continue
            name, sep, value = item.partition(":")
            name = name.strip()
            if not sep:
                raise ValueError(f"tau_per_channel: entry {item!r} is not <scenario>:<tau>")
            if name in taus:
                raise ValueError(f"tau_per_channel: scenario {name} given twice")
            try:
                taus[name] = float(value)
            except ValueError:
                raise ValueError(f"tau_per_channel: tau of {name} is not a number: {value.strip()!r}") from None
        return cls(taus)

    def nearest(self, state: ChannelState) -> str:
        """The scenario of the schedule nearest to ``state`` (in the head's channel features)."""
        d = np.linalg.norm(self._points - state.features().astype(np.float64), axis=1)
        return self._names[int(np.argmin(d))]

    def tau_for(self, state: ChannelState) -> float:
        return self.taus[self.nearest(state)]

    def __str__(self) -> str:
        return ",".join(f"{n}:{t:g}" for n, t in self.taus.items())
