"""The round log: one JSON object per round, written by the round protocol itself.

Every decoding path writes the same records: ``EdgeSessions`` (the verifier node, ``bag reverify``,
in-process ``generate``) one per verified block and one per copy round that followed it, and
``generate_target_only`` one per target forward pass. A latency for any link and any hardware is
then computed from the log afterwards (``wisv_ros.eval.latency``): the tokens, rounds, mismatches
and payload sizes of a run do not depend on the link, only the time does.

Format (JSON lines, UTF-8; field names are the metric names of ``DecodeStats``):

=====================  =====================================================================
request_id             the request (str)
round_id               the block's round; copy rounds carry the round of the block they follow
kind                   "block" (a drafted block), "copy" (a SwitchSD copy round on the edge),
                       "target" (one target-only forward pass)
method                 greedy | reject | wisv | target_only
k                      the block size asked for (drafted may be smaller: confidence stop)
protocol               ids | fh | sh: how the block travelled ("" for copy and target rounds)
tau                    the WISV threshold of the round
prefix_length          committed tokens (prompt included) before the round
drafted                draft tokens in the block (copy: tokens of the longest candidate)
accepted               draft (or copied) tokens accepted
mismatches             block positions where the target's argmax differs from the draft (set S)
head_accepted          of those, the positions the WISV head accepted
committed              tokens the round committed (accepted + the correction or bonus token)
target_tokens          tokens the target's pass fed (the pending correction + the block; copy:
                       all candidates); the compute model charges a pass of this many tokens
copy_candidates        candidate branches a copy round verified in one pass (0 otherwise)
hidden_dim             drafter hidden size, when the edge saw drafter hiddens (else 0)
up_bytes_ids/fh/sh/dist  uplink bytes of the block under each protocol (formulas of
                       ``wisv_ros.link.channel``; fh and sh are 0 while hidden_dim is 0)
down_bytes             the verdict's bytes; down_bytes_sh: the hidden request that sh adds
draft_time_s           drafter compute of the block as measured where it ran
target_time_s          the target pass as measured; head_time_s: the decision (WISV head)
=====================  =====================================================================

A drafter-only round (the robot alone after edge loss) never reaches the edge and is not logged.
No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import IO, Iterable, Iterator

from wisv_ros.link.channel import WireFormat, downlink_bytes_request, downlink_bytes_verdict, uplink_bytes_dist, uplink_bytes_fh, uplink_bytes_ids, uplink_bytes_sh

__all__ = ["KINDS", "RoundLog", "RoundRecord", "json_rows", "read_round_log", "round_bytes"]

KINDS = ("block", "copy", "target")


@dataclasses.dataclass
class RoundRecord:
    request_id: str
    round_id: int
    kind: str
    method: str
    k: int = 0
    protocol: str = ""
    tau: float = 0.0
    prefix_length: int = 0
    drafted: int = 0
    accepted: int = 0
    mismatches: list[int] = dataclasses.field(default_factory=list)
    head_accepted: list[int] = dataclasses.field(default_factory=list)
    committed: int = 0
    target_tokens: int = 0
    copy_candidates: int = 0
    hidden_dim: int = 0
    up_bytes_ids: int = 0
    up_bytes_fh: int = 0
    up_bytes_sh: int = 0
    up_bytes_dist: int = 0
    down_bytes: int = 0
    down_bytes_sh: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    head_time_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind '{self.kind}' is not one of {', '.join(KINDS)}")
        if not 0 <= self.accepted <= max(self.drafted, 0):
            raise ValueError(f"accepted {self.accepted} outside [0, drafted={self.drafted}]")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, row: dict) -> "RoundRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(row) - names)
        if unknown:
            raise ValueError(f"round log: unknown fields {unknown}")
        return cls(**row)


def round_bytes(rec: RoundRecord, hidden_dim: int, vocab_size: int, hidden_dtype_bytes: int = 2) -> dict[str, int]:
    """The payload sizes of a round under each protocol for a drafter of ``hidden_dim``:
    up_bytes_ids/fh/sh/dist, down_bytes, down_bytes_sh (copy and target rounds send nothing up)."""
    fmt = WireFormat(hidden_dim=max(hidden_dim, 1), hidden_dtype_bytes=hidden_dtype_bytes)
    out = dict(up_bytes_ids=0, up_bytes_fh=0, up_bytes_sh=0, up_bytes_dist=0,
               down_bytes=downlink_bytes_verdict(fmt, rec.committed) if rec.kind != "target" else 0, down_bytes_sh=0)
    if rec.kind == "block":
        sh = uplink_bytes_sh(fmt, rec.drafted, len(rec.mismatches))
        out.update(up_bytes_ids=uplink_bytes_ids(fmt, rec.drafted),
                   up_bytes_fh=uplink_bytes_fh(fmt, rec.drafted) if hidden_dim else 0,
                   up_bytes_sh=sh.ids_up + sh.hiddens_up if hidden_dim else 0,
                   up_bytes_dist=uplink_bytes_dist(fmt, rec.drafted, max(vocab_size, 1)),
                   down_bytes_sh=downlink_bytes_request(fmt, len(rec.mismatches)) if rec.mismatches else 0)
    return out


class RoundLog:
    """A thread-safe JSON-lines writer of ``RoundRecord`` s (``path`` or an open text stream).

    vocab_size: the target's (full-distribution bytes); hidden_dim: the drafter's when known
    (a record's own ``hidden_dim`` wins). Records are flushed line by line, so a log of a run that
    was stopped holds every round up to the stop.
    """

    def __init__(self, out: str | Path | IO[str], *, vocab_size: int = 0, hidden_dim: int = 0, append: bool = False):
        if isinstance(out, (str, Path)):
            path = Path(out)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._stream: IO[str] = open(path, "a" if append else "w", encoding="utf-8")
            self._own = True
        else:
            self._stream, self._own = out, False
        self.vocab_size, self.hidden_dim = vocab_size, hidden_dim
        self._lock = threading.Lock()
        self._closed = False
        self.records = 0

    def __call__(self, rec: RoundRecord) -> None:
        self.write(rec)

    def write(self, rec: RoundRecord) -> None:
        if not rec.hidden_dim and self.hidden_dim:
            rec = dataclasses.replace(rec, hidden_dim=self.hidden_dim)
        rec = dataclasses.replace(rec, **round_bytes(rec, rec.hidden_dim, self.vocab_size))
        line = rec.to_json() + "\n"
        with self._lock:
            if self._closed:  # a round that finished while the owner shut the log: dropped, not an error
                return
            self._stream.write(line)
            self._stream.flush()
            self.records += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._own:
                self._stream.close()

    def __enter__(self) -> "RoundLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def json_rows(path: str | Path | Iterable[str]) -> Iterator[tuple[int, dict]]:
    """(line number, object) of a JSON-lines file or lines; ValueError naming the line of a bad one,
    except a torn last line (a run stopped while writing it), which is skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines() if isinstance(path, (str, Path)) else list(path)
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                return
            raise ValueError(f"{path}:{i}: not a JSON object") from None


def read_round_log(path: str | Path | Iterable[str]) -> Iterator[RoundRecord]:
    """Records of a round log; ValueError naming the line of a bad one (a torn last line of a
    stopped run is skipped)."""
    for i, row in json_rows(path):
        try:
            yield RoundRecord.from_dict(row)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{i}: {exc}") from None
