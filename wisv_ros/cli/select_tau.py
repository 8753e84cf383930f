"""Pick the WISV threshold tau on held-out generated problems for an accuracy-drop budget.

    python -m wisv_ros.cli.select_tau --head config/heads/default.onnx --problems 60 \\
        --taus 0.01,0.02,0.05,0.1,0.2 --budget 1.0 --write config/drafter.yaml

Problems: gsm_symbolic (reasoning-gym, generated offline) with ``--seed`` (default 1; the traces the
head was trained on use seed 0 by default, and GSM8K test problems are never used). Each problem
is answered once by the target alone (the reference accuracy) and once per tau by WISV SD with the
head under ``--channel``; answers stop at "The answer is N".

tau is the rejection-probability threshold: a mismatch is rejected when the head's probability is
>= tau, so a larger tau accepts more drafts (0 = greedy SD). The pick is the largest tau whose
accuracy is at most ``--budget`` percentage points below the reference; 0 if none is. With n
problems one problem is 100/n points: choose n so that the budget means something (the report
states the resolution). ``--write`` replaces the ``tau:`` value in a parameter file (the drafter's
default tau, e.g. config/drafter.yaml) and keeps its comments. Writes report.json, report.csv and
a plot of accuracy and AAL against tau to ``--out``.

Each answer is a row of ``--out``/rows*.csv as soon as it is done, so a rerun with the same
options resumes, and ``--shard I/N`` splits the problems over N processes side by side (same
``--out``); whichever run finds every answer present writes the report and the pick.
A folder holds one setting (``config.json``): another model, head, channel, K or problem set needs
a new ``--out``; more taus may be added to a finished run.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

from tqdm import tqdm

from wisv_ros.cli.common import add_model_args, check_args, load_pair, make_halves, parse_shard, set_threads

_TAU_LINE = re.compile(r"^(?P<indent>\s*)tau:\s*(?P<value>[^#\n]*?)(?P<comment>\s*#.*)?$", re.MULTILINE)


def pick_tau(results: list[dict], reference_accuracy: float, budget_pp: float) -> float:
    """Largest tau whose accuracy is within ``budget_pp`` percentage points of the reference; 0.0
    (greedy) if none is. ``results``: dicts with ``tau`` and ``accuracy`` (a fraction)."""
    ok = [r["tau"] for r in results if 100.0 * (reference_accuracy - r["accuracy"]) <= budget_pp + 1e-9]
    return max(ok, default=0.0)


def write_tau(path: Path, tau: float) -> None:
    """Replace the value of the single ``tau:`` line of a YAML parameter file, keeping comments."""
    text = path.read_text()
    matches = list(_TAU_LINE.finditer(text))
    if len(matches) != 1:
        raise SystemExit(f"error: --write {path}: expected exactly one 'tau:' line, found {len(matches)}; "
                         "add 'tau: 0.0' under the drafter's ros__parameters")
    m = matches[0]
    line = f"{m['indent']}tau: {tau:g}"
    if m["comment"]:  # the comment stays in its column
        column = len(m.group(0)) - len(m["comment"].lstrip())
        line += " " * max(1, column - len(line)) + m["comment"].lstrip()
    path.write_text(text[:m.start()] + line + text[m.end():])


def _taus(text: str) -> list[float]:
    try:
        taus = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--taus: expected comma-separated numbers, got '{text}'") from None
    if not taus or any(t < 0 for t in taus):
        raise argparse.ArgumentTypeError(f"--taus: give numbers >= 0, got '{text}'")
    return taus


_ROW_FIELDS = ("problem", "run", "correct", "tokens", "rounds")
# What makes two runs' rows comparable; a resumed run must match the folder's config.json.
_CONFIG_KEYS = ("problems", "problem_seed", "max_new_tokens", "head", "channel", "k", "min_confidence", "target", "drafter",
                "target_dtype", "drafter_dtype")


def _run_name(tau: float | None) -> str:
    return "target" if tau is None else f"tau={tau:g}"


def _read_rows(out: Path) -> dict[tuple[int, str], dict]:
    """Every finished (problem, run) in the folder's row files (all shards)."""
    rows = {}
    for path in sorted(out.glob("rows*.csv")):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                rows[(int(r["problem"]), r["run"])] = {"correct": int(r["correct"]), "tokens": int(r["tokens"]),
                                                      "rounds": int(r["rounds"])}
    return rows


def _check_config(out: Path, config: dict) -> None:
    path = out / "config.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = [k for k in _CONFIG_KEYS if old.get(k) != config.get(k)]
        if diff:
            k = diff[0]
            raise SystemExit(f"error: --out {out} holds results of another setting ({k}: {old.get(k)!r} there, "
                             f"{config.get(k)!r} now); use a new --out or the same options")
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2))


def main(argv: list[str] | None = None) -> int:
    from wisv_ros.eval.datasets import build_prompt, generate_gsm_symbolic, gsm8k_correct
    from wisv_ros.sd.verification import Method
    from wisv_ros.sd.rounds import generate, generate_target_only
    from wisv_ros.wisv.traces import answer_complete

    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.select_tau", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", type=int, default=60, help="held-out gsm_symbolic problems (default %(default)s)")
    p.add_argument("--problem-seed", type=int, default=1, help="gsm_symbolic seed (default %(default)s; traces use 0)")
    p.add_argument("--taus", type=_taus, default=_taus("0.01,0.02,0.05,0.1,0.2"),
                   help="thresholds to try (default 0.01,0.02,0.05,0.1,0.2: the shipped head's rejection "
                   "probabilities centre on the share of critical mismatches, 0.15-0.25)")
    p.add_argument("--budget", type=float, default=1.0, help="allowed accuracy drop, percentage points (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--write", type=Path, default=None, help="parameter file whose 'tau:' gets the pick")
    p.add_argument("--out", type=Path, default=Path("runs/tau"), help="report folder; a rerun resumes from its rows (default %(default)s)")
    p.add_argument("--shard", default="0/1", help="I/N: run only problems I, I+N, I+2N, ... (N processes side by side, "
                   "same --out; the last one to finish reports; default %(default)s)")
    add_model_args(p)
    args = p.parse_args(argv)
    args.method = "wisv"
    check_args(args)
    if args.problems < 1:
        p.error(f"--problems must be >= 1 (got {args.problems})")
    if args.budget < 0:
        p.error(f"--budget must be >= 0 (got {args.budget})")
    if args.write is not None and not args.write.is_file():
        p.error(f"--write {args.write}: no such file")
    shard = parse_shard(p, args.shard)
    config = {k: getattr(args, k) for k in _CONFIG_KEYS}
    _check_config(args.out, config)
    runs = [None, *args.taus]  # None: the target alone (the reference)
    problems = generate_gsm_symbolic(args.problems, args.problem_seed)

    def pending(indices, done: dict) -> list[tuple[int, float | None]]:
        return [(i, tau) for i in indices for tau in runs if (i, _run_name(tau)) not in done]

    todo = pending(range(shard[0], len(problems), shard[1]), _read_rows(args.out))
    if todo:
        set_threads(args.threads)
        target, drafter = load_pair(args)
        rows_path = args.out / ("rows.csv" if shard == (0, 1) else f"rows.{shard[0]}of{shard[1]}.csv")
        new_file = not rows_path.exists()
        with open(rows_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=_ROW_FIELDS)
            if new_file:
                w.writeheader()
            for i, tau in tqdm(todo, desc="answers", unit="answer", file=sys.stderr):
                q = problems[i]
                prompt = build_prompt(q, tokenizer_has_chat_template=True)
                if tau is None:
                    res = generate_target_only(target, prompt, args.max_new_tokens, stop_text=answer_complete)
                    rounds = len(res.token_ids)
                else:
                    args.tau = tau
                    d, v = make_halves(Method.WISV, target, drafter, args)
                    res = generate(d, v, prompt, args.max_new_tokens, args.k, stop_text=answer_complete)
                    rounds = res.stats.rounds
                w.writerow({"problem": i, "run": _run_name(tau), "correct": int(gsm8k_correct(res.text, q.answer)),
                            "tokens": len(res.token_ids), "rounds": rounds})
                f.flush()
    done = _read_rows(args.out)  # all shards' answers
    missing = pending(range(len(problems)), done)
    if missing:
        print(f"shard {args.shard} done; {len(missing)} of {len(problems) * len(runs)} answers still missing in "
              f"{args.out} (other shards running, or rerun without --shard to finish)", file=sys.stderr)
        return 0

    n = len(problems)
    reference = sum(done[(i, "target")]["correct"] for i in range(n)) / n
    results = []
    for tau in args.taus:
        rs = [done[(i, _run_name(tau))] for i in range(n)]
        correct, tokens, rounds = (sum(r[k] for r in rs) for k in ("correct", "tokens", "rounds"))
        results.append({"tau": tau, "accuracy": correct / n, "correct": correct,
                        "aal": tokens / max(rounds, 1), "rounds": rounds, "tokens": tokens})
    tau = pick_tau(results, reference, args.budget)

    print(f"reference (target alone): {round(reference * n)}/{n} = {100 * reference:.1f} %  "
          f"(one problem = {100 / n:.2f} points)")
    print(f"{'tau':>6s} {'accuracy %':>11s} {'drop pp':>8s} {'AAL':>6s} {'rounds':>7s}")
    for r in results:
        print(f"{r['tau']:6.2f} {100 * r['accuracy']:11.1f} {100 * (reference - r['accuracy']):8.1f} "
              f"{r['aal']:6.2f} {r['rounds']:7d}")
    print(f"picked tau = {tau:g} (budget {args.budget} points, channel {args.channel})")
    report = {"tau": tau, "budget_pp": args.budget, "reference_accuracy": reference, "problems": n,
              "problem_seed": args.problem_seed, "channel": args.channel, "head": args.head, "k": args.k,
              "min_confidence": args.min_confidence, "results": results,
              "command": " ".join(["python -m wisv_ros.cli.select_tau", *(argv if argv is not None else sys.argv[1:])])}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    with open(args.out / "report.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(results[0]))
        w.writeheader()
        w.writerows(results)
    _plot(results, reference, tau, args.out / "accuracy_vs_tau.png")
    if args.write is not None:
        write_tau(args.write, tau)
        print(f"wrote tau: {tau:g} into {args.write}")
    return 0


def _plot(results: list[dict], reference: float, tau: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    taus = [r["tau"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(taus, [100 * r["accuracy"] for r in results], "o-", label="WISV accuracy")
    ax.axhline(100 * reference, color="gray", linestyle="--", label="target alone")
    ax.axvline(tau, color="green", linestyle=":", label=f"picked tau = {tau:g}")
    ax.set_xlabel("tau (rejection-probability threshold)")
    ax.set_ylabel("accuracy (%)")
    ax2 = ax.twinx()
    ax2.plot(taus, [r["aal"] for r in results], "s--", color="tab:orange", label="AAL")
    ax2.set_ylabel("AAL (tokens per round)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
