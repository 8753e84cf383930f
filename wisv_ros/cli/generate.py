"""Generate text for one prompt with a chosen method; stream it and print the stats table.

    python -m wisv_ros.cli.generate                       # default pair, default prompt, greedy SD vs target-only
    python -m wisv_ros.cli.generate --prompt "Explain odometry drift in two sentences." --method greedy --k 6
    python -m wisv_ros.cli.generate --drafter smollm2-135m-instruct --target gemma3-270m --no-chat --prompt "def add(a, b):"

Without ``--prompt`` the prompt is a code stub completed as plain text (a robot-side utility
function), the setting in which a small drafter predicts a large coder well.
"""
from __future__ import annotations

import argparse
import sys

from wisv_ros.sd.verification import Method
from wisv_ros.sd.rounds import generate, generate_target_only
from wisv_ros.sd.metrics import format_table
from wisv_ros.cli.common import TextStream, add_model_args, check_args, load_pair, make_halves, set_threads

DEFAULT_PROMPT = '''import math


def clamp_velocity(vx: float, vy: float, v_max: float) -> tuple[float, float]:
    """Scale the planar velocity (vx, vy) so that its norm is at most v_max (m/s).

    The direction is kept; a velocity already within the limit is returned unchanged.
    >>> clamp_velocity(3.0, 4.0, 1.0)
    (0.6, 0.8)
    """
'''

COLUMNS = ["method", "k", "tokens", "rounds", "aal", "acceptance", "tokens_per_s", "speedup", "up_bytes_ids", "up_bytes_fh", "up_bytes_sh", "up_bytes_dist"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", default=None, help="prompt text (default: a built-in code stub, completed without chat template)")
    p.add_argument("--method", default="greedy", help="target_only, greedy, reject or wisv (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate (default %(default)s)")
    p.add_argument("--no-chat", action="store_true", help="complete the prompt as plain text instead of a chat message")
    p.add_argument("--no-compare", action="store_true", help="skip the target-only run used for the speedup column")
    add_model_args(p)
    args = p.parse_args(argv)
    check_args(args)
    try:
        method = Method.parse(args.method)
    except ValueError as exc:
        p.error(f"--method: {exc}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    set_threads(args.threads)
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    chat = not args.no_chat and args.prompt is not None

    target, drafter = load_pair(args, need_drafter=method != Method.TARGET_ONLY)
    rows = []
    print(f"--- {method} (drafter {args.drafter}, target {args.target}, K={args.k}) ---", file=sys.stderr)
    if args.prompt is None:
        sys.stdout.write(prompt)
    stream = TextStream(target.tokenizer)
    if method == Method.TARGET_ONLY:
        result = generate_target_only(target, prompt, args.max_new_tokens, on_commit=stream, chat=chat)
    else:
        d, v = make_halves(method, target, drafter, args)
        result = generate(d, v, prompt, args.max_new_tokens, args.k, on_commit=stream, chat=chat)
    sys.stdout.write("\n")
    rows.append(result.stats.as_row())
    if method != Method.TARGET_ONLY and not args.no_compare:
        print("--- target_only (for the speedup column) ---", file=sys.stderr)
        base = generate_target_only(target, prompt, args.max_new_tokens, chat=chat)
        rows.append(base.stats.as_row())
        same = base.token_ids == result.token_ids
        if method == Method.GREEDY:
            print(f"greedy SD output identical to target-only greedy: {same}", file=sys.stderr)
    base_tps = next((r["tokens_per_s"] for r in rows if r["method"] == "target_only"), None)
    for r in rows:
        r["speedup"] = round(r["tokens_per_s"] / base_tps, 2) if base_tps else ""
    print(format_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
