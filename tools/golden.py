"""Fixed decoding cases whose tokens, rounds and bytes must not change when the code is reorganised.

    python tools/golden.py record [--real]   # write test/data/golden*.json from the current code
    python tools/golden.py check [--real]    # rerun and compare; exit 1 on any difference
    python tools/golden.py record-intended   # write the values of the INTENDED changes

The tiny cases (random 2-layer models, greedy, reject, WISV with a seeded head, copy mode) run in
the test suite (test/test_golden.py). ``--real`` runs the default pair (SmolLM2-135M drafting for
Qwen2.5-Coder-1.5B, float32) with the shipped WISV head and the shipped copy probe on one GSM8K
and one HumanEval prompt; it needs the converted models (python -m wisv_ros.cli.models prepare).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_FILE = ROOT / "test" / "data" / "golden_tiny.json"
REAL_FILE = ROOT / "test" / "data" / "golden_real.json"
# Cases whose rounds changed on purpose when the round loops became one (sd.rounds): in process,
# copy rounds now run where the nodes run them, after a block and within the block's copy budget;
# before, generate() also copied before the first block and up to the token limit. The tokens stay
# those recorded before; the other fields are checked against CHANGES_FILE.
INTENDED = {
    "greedy_ngram_k4_p12": "copy rounds stop at the block's copy budget (as in the nodes)",
    "greedy_ngram_k4_rep": "no copy round before the first block (as in the nodes)",
}
CHANGES_FILE = ROOT / "test" / "data" / "golden_tiny_intended.json"
TINY_PROMPTS = {"p4": [5, 9, 12, 3], "p12": list(range(1, 13)), "rep": [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]}


def _summary(gen) -> dict:
    s = gen.stats
    return {
        "token_ids": list(gen.token_ids),
        "rounds": s.rounds,
        "committed": s.committed,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "mismatches": s.mismatches,
        "copy_rounds": s.copy_rounds,
        "uplink_bytes": dict(s.uplink_bytes),
        "downlink_bytes": dict(s.downlink_bytes),
    }


def tiny_head(folder: Path) -> Path:
    """A seeded, untrained decision head for the tiny models (32-wide hiddens), exported to ONNX."""
    import numpy as np
    import torch

    from wisv_ros.wisv.head_training import DecisionHead, export_onnx

    torch.manual_seed(0)
    head = DecisionHead(32, 32, hidden=16).eval()
    head.fit_normalization(np.random.default_rng(0).standard_normal((32, 67)).astype(np.float32))
    path = folder / "tiny_head.onnx"
    export_onnx(head, path)
    return path


def tiny_cases() -> dict:
    from wisv_ros.link.channel import scenario
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import load_model
    from wisv_ros.sd.rounds import generate
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.verification import Method, Verifier
    from wisv_ros.switchsd.copying import CopyConfig
    from wisv_ros.wisv.head import OnnxHead, make_judge

    target = CausalLM(load_model("tiny-random:0:64")[0])
    drafter = CausalLM(load_model("tiny-random:0:64:0.05")[0])
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        channel = scenario("20mbps_50ms")
        judge = make_judge(OnnxHead(tiny_head(Path(tmp))), lambda: channel)
        for name, prompt in TINY_PROMPTS.items():
            out[f"greedy_k4_{name}"] = _summary(generate(Drafter(drafter), Verifier(target), prompt, 48, 4))
            out[f"reject_k4_{name}"] = _summary(generate(
                Drafter(drafter, temperature=1.0, seed=3), Verifier(target, Method.REJECT, temperature=1.0, seed=3),
                prompt, 48, 4))
            out[f"wisv_k8_tau0.5_{name}"] = _summary(generate(
                Drafter(drafter), Verifier(target, Method.WISV, tau=0.5, judge=judge), prompt, 48, 8))
            out[f"greedy_ngram_k4_{name}"] = _summary(generate(
                Drafter(drafter), Verifier(target, copy=CopyConfig.for_mode("ngram", kappa=2, width=2, depth=6)),
                prompt, 48, 4))
    return out


def real_cases() -> dict:
    import torch

    from wisv_ros.eval.datasets import build_prompt, load_gsm8k, load_humaneval
    from wisv_ros.link.channel import scenario
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import DEFAULT_DRAFTER, DEFAULT_TARGET, load_model
    from wisv_ros.sd.rounds import generate
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.verification import Method, Verifier
    from wisv_ros.switchsd.copying import CopyConfig
    from wisv_ros.switchsd.probe import load_probe
    from wisv_ros.wisv.head import OnnxHead, make_judge

    torch.set_num_threads(2)
    probe = load_probe(ROOT / "config" / "probes" / "qwen2.5-coder-1.5b-instruct_copy.npz")
    target = CausalLM(*load_model(DEFAULT_TARGET, dtype="float32"), capture=[(probe.layer, probe.kind)])
    drafter = CausalLM(*load_model(DEFAULT_DRAFTER, dtype="float32"))
    channel = scenario("20mbps_50ms")
    judge = make_judge(OnnxHead(ROOT / "config" / "heads" / "default.onnx"), lambda: channel)
    gsm = build_prompt(load_gsm8k()[0], tokenizer_has_chat_template=True)
    code = build_prompt(load_humaneval()[0], tokenizer_has_chat_template=True)
    out = {}
    out["wisv_k8_tau0.1_gsm0"] = _summary(generate(
        Drafter(drafter, target_tokenizer=target.tokenizer, min_confidence=0.6),
        Verifier(target, Method.WISV, tau=0.1, judge=judge), gsm, 40, 8))
    out["greedy_probe_k8_he0"] = _summary(generate(
        Drafter(drafter, target_tokenizer=target.tokenizer, min_confidence=0.6),
        Verifier(target, copy=CopyConfig.for_mode("probe", probe)), code, 40, 8, chat=False))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("record", "check", "record-intended"))
    p.add_argument("--real", action="store_true", help="the default pair with the shipped head and probe")
    args = p.parse_args(argv)
    path = REAL_FILE if args.real else TINY_FILE
    got = real_cases() if args.real else tiny_cases()
    if args.action == "record-intended":
        CHANGES_FILE.write_text(json.dumps({n: got[n] for n in INTENDED}, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {len(INTENDED)} intended changes to {CHANGES_FILE.relative_to(ROOT)}")
        return 0
    if args.action == "record":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {len(got)} cases to {path.relative_to(ROOT)}")
        return 0
    want = json.loads(path.read_text(encoding="utf-8"))
    if not args.real:
        changed = json.loads(CHANGES_FILE.read_text(encoding="utf-8"))
        for name, why in INTENDED.items():
            if got[name]["token_ids"] != want[name]["token_ids"]:
                print(f"DIFFERS {name}: token_ids (the intended change, {why}, keeps the tokens)")
                return 1
            print(f"intended change in {name}: {why}")
            want[name] = changed[name]
    bad = [name for name in sorted(set(want) | set(got)) if want.get(name) != got.get(name)]
    for name in bad:
        w, g = want.get(name) or {}, got.get(name) or {}
        fields = [f for f in sorted(set(w) | set(g)) if w.get(f) != g.get(f)]
        print(f"DIFFERS {name}: {', '.join(fields)}")
    print(f"{len(want) - len(bad)} of {len(want)} cases equal the recording in {path.relative_to(ROOT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
