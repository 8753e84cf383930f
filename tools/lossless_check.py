"""Greedy SD is lossless with the real pair in float32: its output equals target-only greedy output.

    python tools/lossless_check.py [--prompts 5] [--max-new-tokens 128] [--k 4] [--out docs/engines/lossless.csv]

Runs the default pair in torch float32 (drafter and target) on HumanEval and GSM8K prompts, once
with the target alone and once with greedy speculative decoding, and compares token for token.
Too slow for the test suite (about a minute per prompt on a 2-core CPU); the suite checks the same
on tiny models and, in llama.cpp, that every divergence starts at a near-tie
(test_llama_cpp.py). Exit code 1 when an output differs.
"""
from __future__ import annotations

import argparse
import csv
import platform
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--out", default="docs/engines/lossless.csv")
    args = p.parse_args(argv)

    from wisv_ros.cli.bench import dataset_prompts
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import DEFAULT_DRAFTER, DEFAULT_TARGET, load_model
    from wisv_ros.sd.rounds import generate, generate_target_only
    from wisv_ros.sd.verification import Verifier

    target = CausalLM(*load_model(DEFAULT_TARGET, "float32"))
    drafter = CausalLM(*load_model(DEFAULT_DRAFTER, "float32"))
    n_he = (args.prompts + 1) // 2
    prompts = dataset_prompts("humaneval", n_he) + dataset_prompts("gsm8k", args.prompts - n_he)
    rows, same = [], 0
    for pid, prompt, chat in prompts:
        t0 = time.perf_counter()
        ref = generate_target_only(target, prompt, args.max_new_tokens, chat=chat)
        t1 = time.perf_counter()
        sd = generate(Drafter(drafter), Verifier(target), prompt, args.max_new_tokens, args.k, chat=chat)
        t2 = time.perf_counter()
        first = next((i for i, (a, b) in enumerate(zip(ref.token_ids, sd.token_ids)) if a != b),
                     -1 if len(ref.token_ids) == len(sd.token_ids) else min(len(ref.token_ids), len(sd.token_ids)))
        same += first == -1
        rows.append({"prompt": pid, "tokens": len(ref.token_ids), "identical": int(first == -1), "first_difference": first,
                     "aal": round(sd.stats.aal, 3), "target_only_s": round(t1 - t0, 1), "sd_s": round(t2 - t1, 1)})
        print(rows[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        f.write(f"# {DEFAULT_DRAFTER} -> {DEFAULT_TARGET}, torch float32, greedy K {args.k}, {platform.processor() or platform.machine()}\n")
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{same} of {len(rows)} outputs identical to the target alone; wrote {out}")
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
