"""Bytes on the link per round with and without the pre-projected FH uplink (wisv.head.DraftProjection).

    python tools/fh_bytes.py --k 8,16,32 --traces data/traces/qwen   # the default pair's head
    python tools/fh_bytes.py --head config/heads/default.onnx --traces data/traces/default  # the earlier pair's

Every number is the length of a serialized message (rclpy CDR, what ``nodes.common.msg_bytes`` counts
and the nodes report as ``uplink_bytes``), filled by the code the nodes use (``interfaces.convert``,
``interfaces.wire``): a steady-state FH DraftBlock (no context, K draft tokens, request id of 16
characters, method wisv), the SH HiddenReply for a number of mismatches, and the Verdict of a
block whose K drafts were all accepted, for the head given (``--head``; default the default pair's,
config/heads/qwen.onnx, drafter width 896).

``--traces``: on the committed mismatch traces of the head's pair (drafter and target hiddens of real
mismatches; the traces keep them in float16, as FH sends them), the head's rejection probabilities from the
hiddens against those from their projections as they travel (float16) and in float32, and how many
accept/reject decisions change at a few tau, over the four channel scenarios.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HEAD = ROOT / "config" / "heads" / "qwen.onnx"


def block_bytes(k: int, hidden: np.ndarray, head_id: str) -> int:
    from rclpy.serialization import serialize_message

    from wisv_ros.interfaces.convert import fill_block
    from wisv_ros.msg import DraftBlock
    from wisv_ros.sd.rounds import BlockRequest

    req = BlockRequest("0123456789abcdef", 41, 300, list(range(1000, 1000 + k)), k=k, protocol="fh", method="wisv",
                       tau=0.02, hidden=hidden, head_id=head_id, draft_time_s=0.1, copy_budget=100)
    msg = DraftBlock()
    fill_block(msg, req)
    return len(serialize_message(msg))


def reply_bytes(rows: np.ndarray, head_id: str) -> int:
    from rclpy.serialization import serialize_message

    from wisv_ros.interfaces.convert import HIDDEN_WIRE_DTYPE
    from wisv_ros.interfaces.wire import fill_hidden
    from wisv_ros.msg import HiddenReply

    msg = HiddenReply()
    msg.request_id, msg.round_id = "0123456789abcdef", 41
    fill_hidden(msg.hidden, rows, list(range(rows.shape[0])), HIDDEN_WIRE_DTYPE, head_id=head_id)
    return len(serialize_message(msg))


def verdict_bytes(k: int) -> int:
    from rclpy.serialization import serialize_message

    from wisv_ros.interfaces.convert import fill_verdict
    from wisv_ros.msg import Verdict
    from wisv_ros.sd.rounds import EdgeReply

    msg = Verdict()
    fill_verdict(msg, EdgeReply("0123456789abcdef", 41, accepted=k, correction_id=7,
                                committed_ids=list(range(1000, 1001 + k)), committed_length=301 + k))
    return len(serialize_message(msg))


def _name(head: Path) -> str:
    try:
        return str(head.resolve().relative_to(ROOT))
    except ValueError:
        return str(head)


def bytes_table(head: Path, ks: list[int], sh_rows: list[int]) -> None:
    from wisv_ros.wisv.head import load_projection

    rng = np.random.default_rng(0)
    print("| head | d_D | K | FH DraftBlock, hiddens (B) | FH DraftBlock, projection (B) | ratio | + Verdict (B) "
          "| FH round, before -> after (B) |")
    print("|---|---|---|---|---|---|---|---|")
    name, proj = _name(head), load_projection(head)
    for k in ks:
        h = rng.normal(size=(k, proj.d_draft)).astype(np.float32)
        raw, pre, down = block_bytes(k, h, ""), block_bytes(k, proj(h), proj.head_id), verdict_bytes(k)
        print(f"| {name} | {proj.d_draft} | {k} | {raw:,} | {pre:,} | {raw / pre:.1f}x | {down} "
              f"| {raw + down:,} -> {pre + down:,} |")
    print()
    print("| head | d_D | SH HiddenReply for n mismatches: hiddens -> projection (B) |")
    print("|---|---|---|")
    cells = []
    for n in sh_rows:
        h = rng.normal(size=(n, proj.d_draft)).astype(np.float32)
        cells.append(f"n = {n}: {reply_bytes(h, ''):,} -> {reply_bytes(proj(h), proj.head_id):,}")
    print(f"| {name} | {proj.d_draft} | {'; '.join(cells)} |")


def precision(head_path: Path, traces: Path, taus: list[float]) -> None:
    from wisv_ros.link.channel import SCENARIOS
    from wisv_ros.wisv.head import OnnxHead
    from wisv_ros.wisv.traces import load_traces

    tr = load_traces(traces)
    head = OnnxHead(head_path)
    proj = head.weights.projection()
    h_d, h_t = tr.h_draft, tr.h_target
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731 - what the link does to a row
    exact = "float16 values" if np.array_equal(h_d, f16(h_d)) else "not float16 values"
    print(f"\n{len(h_d)} mismatches of {traces} (drafter hiddens: {exact}); {_name(head_path)}, all {len(SCENARIOS)} scenarios")
    print("| drafter rows the head gets | max abs. difference of the rejection probability vs the hiddens | "
          + " | ".join(f"decisions changed at tau {t}" for t in taus) + " |")
    print("|---|---|" + "---|" * len(taus))
    for name, fn in (("float16 projections (as they travel)", lambda c: head.reject_prob_projected(f16(proj(h_d)), h_t, c)),
                     ("float32 projections", lambda c: head.reject_prob_projected(proj(h_d), h_t, c))):
        diff, changed = 0.0, {t: 0 for t in taus}
        for ch in SCENARIOS.values():
            ref, got = head.reject_prob(h_d, h_t, ch.features()), fn(ch.features())
            diff = max(diff, float(np.abs(ref - got).max()))
            for t in taus:
                changed[t] += int(((ref >= t) != (got >= t)).sum())
        n = len(h_d) * len(SCENARIOS)
        print(f"| {name} | {diff:.2e} | " + " | ".join(f"{changed[t]} of {n}" for t in taus) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", type=Path, default=HEAD, help="the decision head (ONNX with its sidecar)")
    p.add_argument("--k", default="8,16,32", help="block sizes K, comma-separated")
    p.add_argument("--sh-rows", default="1,2", help="SH: mismatches per HiddenReply, comma-separated")
    p.add_argument("--traces", type=Path, help="mismatch traces of the head's pair (precision check)")
    p.add_argument("--taus", default="0.02,0.1,0.5", help="tau values of the precision check")
    args = p.parse_args(argv)
    if not args.head.is_file():
        p.error(f"--head {args.head}: no such file (the shipped heads are in config/heads/)")
    bytes_table(args.head, [int(k) for k in args.k.split(",")], [int(n) for n in args.sh_rows.split(",")])
    if args.traces:
        precision(args.head, args.traces, [float(t) for t in args.taus.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
