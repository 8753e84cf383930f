"""One statistics object for every decoding method, with SPEC's metric definitions.

* AAL (average acceptance length): mean tokens committed per round, the correction/bonus token
  included (greedy SD with K=8 commits 1..9 tokens a round; target-only decoding has AAL 1).
* rounds: draft-verify exchanges (target-only: forward passes).
* tokens/s: committed tokens / wall time of the request.
* acceptance per draft position: share of rounds whose i-th draft token was accepted, among rounds
  that drafted at least i+1 tokens.
* link bytes: what each protocol would put on the robot<->edge link for the rounds that happened,
  by the payload formulas of ``wisv_ros.link`` (ids only, FH, SH, full distribution). SH's bytes
  depend on the number of mismatches of each round.

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses

from wisv_ros.link.channel import Protocol, WireFormat, downlink_bytes_verdict, uplink_bytes_dist, uplink_bytes_fh, uplink_bytes_ids, uplink_bytes_sh

__all__ = ["DecodeStats", "format_table"]


@dataclasses.dataclass
class DecodeStats:
    method: str
    k: int
    hidden_dim: int = 0  # drafter hidden size (FH/SH payloads)
    vocab_size: int = 0  # target vocabulary (full-distribution payloads)
    hidden_dtype_bytes: int = 2  # float16 on the wire
    rounds: int = 0
    committed: int = 0
    drafted: int = 0
    accepted: int = 0
    mismatches: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    head_time_s: float = 0.0
    comm_time_s: float = 0.0
    wall_s: float = 0.0
    uplink_bytes: dict[str, int] = dataclasses.field(default_factory=lambda: {p.value: 0 for p in Protocol})
    downlink_bytes: dict[str, int] = dataclasses.field(default_factory=lambda: {p.value: 0 for p in Protocol})
    copy_rounds: int = 0  # rounds drafted from the context on the edge (SwitchSD)
    copy_accepted: int = 0  # copied tokens accepted in those rounds
    copy_empty: int = 0  # copy rounds that accepted nothing (the "speculation tax")
    accepted_at: list[int] = dataclasses.field(default_factory=list)  # rounds accepting draft position i
    drafted_at: list[int] = dataclasses.field(default_factory=list)  # rounds drafting position i

    def wire_format(self) -> WireFormat:
        return WireFormat(hidden_dim=max(self.hidden_dim, 1), hidden_dtype_bytes=self.hidden_dtype_bytes)

    def observe_round(
        self,
        drafted: int,
        accepted: int,
        committed: int,
        mismatches: int,
        draft_time_s: float,
        target_time_s: float,
        head_time_s: float,
        comm_time_s: float = 0.0,
    ) -> None:
        """Record one round (target-only: one forward pass with drafted = 0)."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted={accepted} outside [0, drafted={drafted}]")
        self.rounds += 1
        self.committed += committed
        self.drafted += drafted
        self.accepted += accepted
        self.mismatches += mismatches
        self.draft_time_s += draft_time_s
        self.target_time_s += target_time_s
        self.head_time_s += head_time_s
        self.comm_time_s += comm_time_s
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1
        if drafted == 0:  # target-only: the target streams each token down, nothing goes up
            return
        fmt = self.wire_format()
        down = downlink_bytes_verdict(fmt, accepted + 1)
        sh = uplink_bytes_sh(fmt, drafted, mismatches)
        self.uplink_bytes[Protocol.IDS.value] += uplink_bytes_ids(fmt, drafted)
        self.uplink_bytes[Protocol.FH.value] += uplink_bytes_fh(fmt, drafted)
        self.uplink_bytes[Protocol.SH.value] += sh.ids_up + sh.hiddens_up
        self.uplink_bytes[Protocol.DIST.value] += uplink_bytes_dist(fmt, drafted, max(self.vocab_size, 1))
        for proto in Protocol:
            self.downlink_bytes[proto.value] += down + (sh.request_down if proto == Protocol.SH else 0)

    def observe_copy_round(self, accepted: int, committed: int, target_time_s: float) -> None:
        """Record a copy round: the edge drafted from the context, so nothing goes up the link."""
        self.rounds += 1
        self.committed += committed
        self.target_time_s += target_time_s
        self.copy_rounds += 1
        self.copy_accepted += accepted
        self.copy_empty += accepted == 0
        down = downlink_bytes_verdict(self.wire_format(), accepted + 1)
        for proto in Protocol:
            self.downlink_bytes[proto.value] += down

    @property
    def aal(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.committed / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def as_row(self) -> dict[str, float | int | str]:
        """Flat dict for tables and CSV (column names are the metric names used everywhere)."""
        row: dict[str, float | int | str] = {
            "method": self.method,
            "k": self.k,
            "tokens": self.committed,
            "rounds": self.rounds,
            "aal": round(self.aal, 3),
            "acceptance": round(self.acceptance_rate, 3),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "wall_s": round(self.wall_s, 3),
            "draft_time_s": round(self.draft_time_s, 3),
            "target_time_s": round(self.target_time_s, 3),
            "head_time_s": round(self.head_time_s, 4),
        }
        for proto in Protocol:
            row[f"up_bytes_{proto.value}"] = self.uplink_bytes[proto.value]
        row["down_bytes"] = self.downlink_bytes[Protocol.IDS.value]
        row["copy_rate"] = round(self.copy_rounds / self.rounds, 3) if self.rounds else 0.0
        row["copy_aal"] = round(self.copy_accepted / self.copy_rounds, 3) if self.copy_rounds else 0.0
        row["copy_empty"] = round(self.copy_empty / self.copy_rounds, 3) if self.copy_rounds else 0.0
        return row

    def merge(self, other: "DecodeStats") -> None:
        """Add another request's counts (same method and K) into this one."""
        for name in ("rounds", "committed", "drafted", "accepted", "mismatches", "draft_time_s", "target_time_s", "head_time_s", "comm_time_s",
                     "wall_s", "copy_rounds", "copy_accepted", "copy_empty"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for proto in Protocol:
            self.uplink_bytes[proto.value] += other.uplink_bytes[proto.value]
            self.downlink_bytes[proto.value] += other.downlink_bytes[proto.value]
        for i, (a, d) in enumerate(zip(other.accepted_at, other.drafted_at)):
            while len(self.drafted_at) <= i:
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.accepted_at[i] += a
            self.drafted_at[i] += d


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A plain aligned text table of dict rows."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([line, sep, *body])
