"""Evaluate whole data sets: one batched target decode per problem, then every lossless method replayed.

    python -m wisv_ros.cli.evaluate decode --dataset gsm8k --dataset humaneval     # resumable
    python -m wisv_ros.cli.evaluate replay --k 4 --k 8 --k 16 --copy off --copy ngram --copy suffix --copy probe
    python -m wisv_ros.cli.evaluate report --results docs/results

``decode`` runs the target greedily over many problems at once (a left-padded batch in torch,
``--batch`` problems per pass), then one teacher-forced drafter pass (and, with the copy probe, one
target pass) per problem, and appends a replay trace per problem to
``OUT/<dataset>/traces.jsonl``; a rerun skips the problems already there. ``replay`` turns the
traces into the round logs every method would write (``eval.replay``: exact for greedy SD at any
K and for every copy policy; see its docstring for the one bound) at ``OUT/<dataset>/rounds/
<system>.jsonl``, scores each problem once (the methods are lossless: they all commit the target's
greedy text) into ``OUT/<dataset>/problems.csv``, and prints one row per (data set, system).
``report`` prices every round log on the four link scenarios with each deployment of
``config/hardware_profiles.yaml`` (``eval.latency``: this machine as measured by engine_bench, and
the projected Jetson Orin robot + L4-class edge) and writes ``--results``: ``summary.csv`` /
``summary.md`` (95 % bootstrap intervals over problems), ``accuracy.csv`` and the plots
``latency_by_scenario.png``, ``aal_by_k.png`` and ``copy.png``; the README's results table between
its ``results:begin`` / ``results:end`` markers is rewritten from it.

Prompts are those of ``copy_eval``: GSM8K one chat message ending "The answer is N" (decoding stops
after the answer is stated), HumanEval one chat message asking to complete the stub (decoding
stops after the answer's code block; its code runs against the data set's tests in the sandbox of
``eval.datasets.humaneval_pass``).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
import time
import zlib
from pathlib import Path

from tqdm import tqdm

from wisv_ros.cli.bench import dataset_prompts
from wisv_ros.cli.copy_eval import HUMANEVAL_CHAT
from wisv_ros.eval.datasets import Problem, gsm8k_correct, humaneval_pass, load_gsm8k, load_humaneval
from wisv_ros.eval.replay import Trace, policies, read_traces, replay_greedy
from wisv_ros.sd.acceptance import FLY_ENTROPY, FLY_WINDOW
from wisv_ros.sd.metrics import format_table
from wisv_ros.sd.models import DEFAULT_DRAFTER, DEFAULT_TARGET, REGISTRY
from wisv_ros.sd.roundlog import RoundLog, RoundRecord
from wisv_ros.wisv.traces import answer_complete

DATASETS = ("gsm8k", "humaneval")
_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)```", re.S)


def code_block_done(text: str) -> bool:
    """True once a chat answer has closed its first code block."""
    return text.count("```") >= 2


def stop_rule(dataset: str):
    return answer_complete if dataset == "gsm8k" else code_block_done


def humaneval_program(problem: Problem, answer: str) -> str:
    """The code of a chat answer (its first code block, else the whole text), with the stub's imports."""
    m = _FENCE.search(answer)
    code = m.group(1) if m else answer
    imports = [ln for ln in problem.prompt.splitlines() if ln.startswith(("import ", "from "))]
    return "\n".join(imports) + "\n" + code + "\n"


def score(problem: Problem, text: str) -> bool:
    if problem.dataset == "gsm8k":
        return gsm8k_correct(text, problem.answer)
    prog = humaneval_program(problem, text)
    return humaneval_pass(Problem(problem.id, problem.dataset, prog, problem.answer, problem.extra), "")


def problems_of(dataset: str) -> dict[str, Problem]:
    return {p.id: p for p in (load_gsm8k() if dataset == "gsm8k" else load_humaneval())}


def prompts_of(dataset: str, limit: int | None) -> list[tuple[str, object]]:
    rows = dataset_prompts(dataset, limit if limit is not None else 10_000)
    if dataset == "humaneval":
        return [(pid, [{"role": "user", "content": HUMANEVAL_CHAT.format(stub=stub)}]) for pid, stub, _ in rows]
    return [(pid, prompt) for pid, prompt, _ in rows]


def _cut_at_stop(tok, ids: list[int], stop) -> list[int]:
    """The shortest prefix of ``ids`` whose text satisfies ``stop`` (all of them if none does)."""
    for n in range(1, len(ids) + 1):
        if stop(tok.decode(ids[:n], skip_special_tokens=True)):
            return ids[:n]
    return ids


def cmd_decode(args) -> int:
    import torch

    from wisv_ros.eval.decode import decode_batch, teacher_force
    from wisv_ros.sd.drafting import encode_prompt
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import load_model
    from wisv_ros.switchsd.probe import load_probe

    if args.threads:
        torch.set_num_threads(args.threads)
    probe = load_probe(args.probe) if args.probe else None
    target_model, tok = load_model(args.target, args.dtype)
    drafter_model, dtok = load_model(args.drafter, args.dtype)
    if dtok is not None and tok is not None and dtok.get_vocab() != tok.get_vocab():
        raise SystemExit(f"error: replay needs a drafter with the target's vocabulary; {args.drafter} and {args.target} differ")
    target = CausalLM(target_model, tok, capture=[(probe.layer, probe.kind)] if probe else [])
    drafter = CausalLM(drafter_model, dtok)
    eos = target.eos_ids()
    pad = tok.pad_token_id if tok.pad_token_id is not None else sorted(eos)[0]
    for ds in args.dataset:
        out = Path(args.out) / ds
        out.mkdir(parents=True, exist_ok=True)
        path = out / "traces.jsonl"
        done = {t.id for t in read_traces(path)}
        todo = [(pid, encode_prompt(tok, prompt, True)) for pid, prompt in prompts_of(ds, args.limit) if pid not in done]
        (out / "config.json").write_text(json.dumps({"target": args.target, "drafter": args.drafter, "dtype": args.dtype,
                                                      "max_new_tokens": args.max_new_tokens, "probe": args.probe or ""}, indent=1))
        stop = stop_rule(ds)
        bar = tqdm(total=len(todo), desc=f"decode {ds}", unit="problem", file=sys.stderr)
        with open(path, "a", encoding="utf-8") as f:
            for start in range(0, len(todo), args.batch):
                part = sorted(todo[start:start + args.batch], key=lambda t: len(t[1]))
                conts = decode_batch(target.model, [ids for _, ids in part], args.max_new_tokens, eos, pad, stop=stop, tokenizer=tok)
                for (pid, ids), cont in zip(part, conts):
                    cont = _cut_at_stop(tok, cont, stop)
                    trace = teacher_force(drafter, ids, cont, id=pid, dataset=ds, eos_ids=eos, target=target if probe else None,
                                          probe=probe, text=tok.decode(cont, skip_special_tokens=True))
                    f.write(trace.to_json() + "\n")
                    f.flush()
                    bar.update(1)
        bar.close()
    return 0


def live_system_name(method: str, k: int, temperature: float, *, fly_entropy: float = FLY_ENTROPY, fly_window: int = FLY_WINDOW,
                     tau: float = 0.0, channel: str = "", head: str = "") -> str:
    """reject_k8_t1, live_greedy_k8 (not greedy_k8: that name is the replayed system's),
    fly_k8_e0.6_w6, wisv_k8_tau0.1_20mbps_50ms_<head file stem>."""
    if method == "reject":
        return f"reject_k{k}_t{temperature:g}"
    if method == "fly":
        return f"fly_k{k}_e{fly_entropy:g}_w{fly_window}"
    if method == "wisv":
        return f"wisv_k{k}_tau{tau:g}_{channel}_{Path(head).stem}"
    return f"live_{method}_k{k}"


def _keep_requests(path: Path, keep: set[str]) -> None:
    """Drop the round records of requests not in ``keep`` (a problem cut short by a stop)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [ln for ln in lines if ln.strip() and json.loads(ln).get("request_id") in keep] if lines else []
    if len(kept) != len(lines):
        path.write_text("".join(kept), encoding="utf-8")


def cmd_live(args) -> int:
    """Decode every problem in process with a method replay cannot reproduce (rejection SD samples),
    on the chosen engine; one round log per system beside the replayed ones, and the system's own
    accuracy (its text is not the target's greedy text). Resumable: problems already in
    ``live_<system>.csv`` are skipped, and a problem cut short by a stop is redone."""
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.engines import load_lm
    from wisv_ros.sd.rounds import generate
    from wisv_ros.sd.verification import Verifier

    target = load_lm(args.target, args.backend, threads=args.threads, n_ctx=4096)
    drafter = load_lm(args.drafter, args.backend, threads=args.threads, n_ctx=4096)
    if drafter.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise SystemExit(f"error: --method {args.method} needs a drafter with the target's vocabulary; "
                         f"{args.drafter} and {args.target} differ")
    system = live_system_name(args.method, args.k, args.temperature, fly_entropy=args.fly_entropy,
                              fly_window=args.fly_window, tau=args.tau, channel=args.channel, head=args.head or "")
    judge = None
    if args.method == "wisv":
        from wisv_ros.link.channel import scenario
        from wisv_ros.wisv.head import OnnxHead, make_judge

        channel = scenario(args.channel)
        judge = make_judge(OnnxHead(args.head), lambda: channel)
    rows = []
    for ds in args.dataset:
        base = Path(args.out) / ds
        csv_path = base / f"live_{system}.csv"
        log_path = base / "rounds" / f"{system}.jsonl"
        done = {r["id"]: r for r in csv.DictReader(open(csv_path))} if csv_path.is_file() else {}
        _keep_requests(log_path, set(done))
        probs = problems_of(ds)
        todo = [(pid, prompt) for pid, prompt in prompts_of(ds, args.limit) if pid not in done]
        new_csv = not csv_path.is_file()
        base.mkdir(parents=True, exist_ok=True)
        bar = tqdm(todo, desc=f"{system} {ds}", unit="problem", file=sys.stderr)
        with RoundLog(log_path, vocab_size=target.vocab_size, hidden_dim=drafter.hidden_size, append=True) as log, \
                open(csv_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["id", "tokens", "rounds", "correct", "wall_s"])
            if new_csv:
                w.writeheader()
            for i, (pid, prompt) in enumerate(bar):
                seed = args.seed + zlib.crc32(pid.encode())  # per problem: a resumed run draws the same
                verifier = Verifier(target, method=args.method, temperature=args.temperature, seed=seed, tau=args.tau,
                                    judge=judge, fly_entropy=args.fly_entropy, fly_window=args.fly_window)
                gen = generate(Drafter(drafter, temperature=args.temperature, seed=seed,
                                       min_confidence=args.min_confidence), verifier, prompt,
                               args.max_new_tokens, args.k, chat=True, stop_text=stop_rule(ds), round_log=log,
                               request_id=pid)
                row = {"id": pid, "tokens": len(gen.token_ids), "rounds": gen.stats.rounds,
                       "correct": int(score(probs[pid], gen.text)), "wall_s": round(gen.stats.wall_s, 2)}
                w.writerow(row)
                f.flush()
                done[pid] = row
        bar.close()
        n = len(done)
        correct = sum(int(r["correct"]) for r in done.values())
        tokens = sum(int(r["tokens"]) for r in done.values())
        rounds = sum(int(r["rounds"]) for r in done.values())
        rows.append({"dataset": ds, "system": system, "problems": n, "tokens": tokens, "rounds": rounds,
                     "aal": round(tokens / max(rounds, 1), 3), "accuracy": round(correct / max(n, 1), 3)})
    print(format_table(rows))
    return 0


def cmd_tokenwise(args) -> int:
    """Decode every problem with the token-wise rounds (``eval.tokenwise``) on llama.cpp: greedy writes
    the replay traces of the target alone's answers (``traces.jsonl``, as ``decode`` does; ``replay``
    then prices greedy SD at every K), wisv and fly write ``live_<system>.csv`` and the round log
    ``rounds/<system>.jsonl`` as ``live`` does, plus every answer's text in ``answers/<system>.jsonl``.
    Resumable: problems already written are skipped."""
    from wisv_ros.eval.tokenwise import decode_tokenwise
    from wisv_ros.sd.drafting import encode_prompt
    from wisv_ros.sd.engines import load_lm

    target = load_lm(args.target, args.backend, threads=args.threads, n_ctx=4096)
    drafter = load_lm(args.drafter, args.backend, threads=args.threads, n_ctx=4096)
    if drafter.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise SystemExit(f"error: token-wise decoding needs a drafter with the target's vocabulary; "
                         f"{args.drafter} and {args.target} differ")
    judge, tau = None, args.tau
    if args.method == "wisv":
        from wisv_ros.link.channel import TauSchedule, scenario
        from wisv_ros.wisv.head import OnnxHead, make_judge

        channel = scenario(args.channel)
        if args.tau_per_channel:
            tau = TauSchedule.parse(args.tau_per_channel).tau_for(channel)
        judge = make_judge(OnnxHead(args.head), lambda: channel)
    system = "target_only" if args.method == "greedy" else live_system_name(
        args.method, args.k, 0.0, fly_entropy=args.fly_entropy, fly_window=args.fly_window, tau=tau,
        channel=args.channel, head=args.head or "")
    for ds in args.dataset:
        base = Path(args.out) / ds
        base.mkdir(parents=True, exist_ok=True)
        probs = problems_of(ds)
        stop = stop_rule(ds)
        if args.method == "greedy":
            path = base / "traces.jsonl"
            done = {t.id for t in read_traces(path)}
            (base / "config.json").write_text(json.dumps({"target": args.target, "drafter": args.drafter, "dtype": "gguf",
                                                          "engine": args.backend, "decoder": "tokenwise",
                                                          "max_new_tokens": args.max_new_tokens, "probe": ""}, indent=1))
        else:
            csv_path = base / f"live_{system}.csv"
            done = {r["id"] for r in csv.DictReader(open(csv_path))} if csv_path.is_file() else set()
            _keep_requests(base / "rounds" / f"{system}.jsonl", done)
        todo = [(pid, prompt) for pid, prompt in prompts_of(ds, args.limit) if pid not in done]
        bar = tqdm(todo, desc=f"{system} {ds}", unit="problem", file=sys.stderr)
        for pid, prompt in bar:
            t0 = time.perf_counter()
            ids = encode_prompt(target.tokenizer, prompt, True)
            res = decode_tokenwise(drafter, target, ids, k=args.k, max_new_tokens=args.max_new_tokens, method=args.method,
                                   judge=judge, tau=tau, fly_entropy=args.fly_entropy, fly_window=args.fly_window,
                                   stop_text=stop, request_id=pid, dataset=ds)
            text = target.tokenizer.decode(res.token_ids, skip_special_tokens=True)
            if args.method == "greedy":
                with open(path, "a", encoding="utf-8") as f:
                    f.write(res.trace.to_json() + "\n")
                continue
            with RoundLog(base / "rounds" / f"{system}.jsonl", vocab_size=target.vocab_size,
                          hidden_dim=drafter.hidden_size, append=True) as log:
                for rec in res.records:
                    log(rec)
            (base / "answers").mkdir(exist_ok=True)
            with open(base / "answers" / f"{system}.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"id": pid, "text": text}) + "\n")
            new_csv = not csv_path.is_file()
            with open(csv_path, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=["id", "tokens", "rounds", "correct", "wall_s"])
                if new_csv:
                    w.writeheader()
                w.writerow({"id": pid, "tokens": len(res.token_ids), "rounds": len(res.records),
                            "correct": int(score(probs[pid], text)), "wall_s": round(time.perf_counter() - t0, 2)})
        bar.close()
    return 0


def system_name(k: int, copy: str) -> str:
    return f"greedy_k{k}" + ("" if copy == "off" else f"+{copy}")


def target_only_records(trace: Trace) -> list[RoundRecord]:
    """The target-only run of a trace: one pass per token (the first also prefills the prompt)."""
    p = len(trace.prompt_ids)
    return [RoundRecord(request_id=trace.id, round_id=i, kind="target", method="target_only", prefix_length=p + i, committed=1,
                        target_tokens=p if i == 0 else 1) for i in range(len(trace.target_ids))]


def cmd_replay(args) -> int:
    from wisv_ros.switchsd.probe import load_probe

    threshold = load_probe(args.probe).threshold if args.probe else None
    rows = []
    for ds in args.dataset:
        base = Path(args.out) / ds
        traces = read_traces(base / "traces.jsonl")
        if not traces:
            raise SystemExit(f"error: no traces in {base / 'traces.jsonl'}; run: python -m wisv_ros.cli.evaluate decode --dataset {ds}")
        cfg = json.loads((base / "config.json").read_text())
        hidden_dim, vocab = _pair_dims(cfg)
        probs = problems_of(ds)
        # Accuracy: once per problem (every method commits the same greedy text).
        scored = {}
        for t in tqdm(traces, desc=f"score {ds}", unit="problem", file=sys.stderr):
            scored[t.id] = score(probs[t.id], t.text)
        with open(base / "problems.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", "tokens", "correct"])
            for t in traces:
                w.writerow([t.id, len(t.target_ids), int(scored[t.id])])
        (base / "rounds").mkdir(exist_ok=True)
        systems = [("target_only", None, None)]
        for k in args.k:
            for name, pol in zip(args.copy, policies(args.copy, threshold)):
                if pol is not None and pol.gated and not traces[0].probe_prob:
                    print(f"[replay] {ds}: no probe in the traces, skipping copy policy {name}", file=sys.stderr)
                    continue
                systems.append((system_name(k, name), k, pol))
        for system, k, pol in systems:
            t0 = time.perf_counter()
            rounds = copies = copied = tokens = bounded = 0
            with RoundLog(base / "rounds" / f"{system}.jsonl", vocab_size=vocab, hidden_dim=hidden_dim) as log:
                for t in traces:
                    if k is None:
                        recs = target_only_records(t)
                    else:
                        res = replay_greedy(t, k, min_confidence=args.min_confidence, copy=pol, max_new_tokens=cfg["max_new_tokens"])
                        recs, bounded = res.records, bounded + res.bounded_rounds
                    for r in recs:
                        log(r)
                    tokens += len(t.target_ids)
                    rounds += sum(r.kind != "copy" for r in recs)
                    copies += sum(r.kind == "copy" for r in recs)
                    copied += sum(r.accepted for r in recs if r.kind == "copy")
            n_rounds = rounds + copies
            rows.append({"dataset": ds, "system": system, "problems": len(traces), "tokens": tokens, "rounds": n_rounds,
                         "aal": round(tokens / n_rounds, 3), "copy_rounds": copies,
                         "copy_aal": round(copied / copies, 3) if copies else "",
                         "accuracy": round(sum(scored.values()) / len(traces), 3), "bounded_rounds": bounded,
                         "replay_s": round(time.perf_counter() - t0, 1)})
    print(format_table(rows))
    _write_csv(Path(args.out) / "replay_summary.csv", rows)
    return 0


REPORT_SCENARIOS = ("20mbps_5ms", "20mbps_50ms", "500mbps_5ms", "500mbps_50ms")


def cmd_report(args) -> int:
    from wisv_ros.eval.latency import ProfileCompute, latency_report, load_profiles

    profiles = load_profiles(args.profiles)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    rows, accuracy = [], []
    for ds in args.dataset:
        base = Path(args.out) / ds
        logs = sorted((base / "rounds").glob("*.jsonl"), key=_system_order)
        if not logs:
            raise SystemExit(f"error: no round logs in {base / 'rounds'}; run: python -m wisv_ros.cli.evaluate replay --dataset {ds}")
        probs = list(csv.DictReader(open(base / "problems.csv")))
        greedy_right = {r["id"]: int(r["correct"]) for r in probs}
        accuracy.append({"dataset": ds, "system": "target greedy (every replayed system)", "problems": len(probs),
                         "correct": sum(greedy_right.values()),
                         "accuracy": round(sum(greedy_right.values()) / len(probs), 3),
                         "greedy_correct_same_problems": "", "right_to_wrong": "", "wrong_to_right": ""})
        for live_csv in sorted(base.glob("live_*.csv")):
            live = list(csv.DictReader(open(live_csv)))
            if live:
                accuracy.append({"dataset": ds, "system": live_csv.stem.removeprefix("live_"), "problems": len(live),
                                 "correct": sum(int(r["correct"]) for r in live),
                                 "accuracy": round(sum(int(r["correct"]) for r in live) / len(live), 3),
                                 **paired_flips(live, greedy_right)})
        jobs = [(log, dep, sc) for log in logs for dep in args.deployment for sc in REPORT_SCENARIOS]
        for log, dep, sc in tqdm(jobs, desc=f"report {ds}", unit="case", file=sys.stderr):
            deployment = profiles.deployment(dep)
            # Rejection SD uploads the drafter's distributions with every block ([K, V] float32); WISV
            # the drafter's hiddens (fh); everything else token ids only.
            protocol = "dist" if log.stem.startswith("reject_") else "fh" if log.stem.startswith("wisv_") else "ids"
            _, agg = latency_report(log, sc, ProfileCompute(deployment), protocol=protocol, n_boot=args.bootstrap)
            rows.append({"dataset": ds, "system": log.stem, "deployment": dep, "scenario": sc, "problems": agg["requests"],
                         "tokens": agg["tokens"], "rounds": agg["rounds"] + agg["copy_rounds"],
                         "aal": round(agg["tokens"] / (agg["rounds"] + agg["copy_rounds"]), 3),
                         "copy_rounds": agg["copy_rounds"], "round_trips": agg["rounds"],
                         "ms_per_token": round(agg["ms_per_token"], 2), "ms_lo": round(agg["ms_per_token_lo"], 2),
                         "ms_hi": round(agg["ms_per_token_hi"], 2),
                         "target_alone_ms": round(agg["target_alone_ms_per_token"], 2),
                         "both_on_edge_ms": round(agg["both_on_edge_ms_per_token"], 2),
                         "speedup_vs_target_alone": round(agg["speedup_vs_target_alone"], 3),
                         "compute": agg["compute"]})
    if args.keep_published:
        order = {ds: i for i, ds in enumerate(args.dataset)}
        rows = sorted(_with_published(rows, results / "summary.csv"),  # stable: deployments, scenarios keep their order
                      key=lambda r: (order.get(r["dataset"], len(order)), _system_order(Path(f"{r['system']}.jsonl"))))
        accuracy = sorted(_with_published(accuracy, results / "accuracy.csv"),
                          key=lambda r: (order.get(r["dataset"], len(order)), not r["system"].startswith("target greedy"),
                                         r["system"]))
    _write_csv(results / "summary.csv", rows)
    _write_csv(results / "accuracy.csv", accuracy)
    md = _report_markdown(rows, accuracy, args)
    goals_md = _wisv_goals(args, rows, results, profiles)
    replay_csv = Path(args.out) / "replay_summary.csv"
    replayed = list(csv.DictReader(open(replay_csv))) if replay_csv.is_file() else []
    claims = _switchsd_claims(rows, replayed)
    md += "\n" + claims
    points = tau_points(rows, accuracy, args.deployment[0])
    if points:  # WISV decoded live at one tau or more: accuracy and latency against tau
        _write_csv(results / "tau.csv", points)
        _tau_plot(points, results / "accuracy_latency_vs_tau.png")
        md += "\nWISV against tau: [tau.csv](tau.csv), [accuracy_latency_vs_tau.png](accuracy_latency_vs_tau.png).\n"
    if goals_md:
        md += "\n## WISV against its goals\n\n" + goals_md
    (results / "summary.md").write_text(md)
    _report_plots(rows, results)
    _update_readme(Path(args.readme), _report_markdown(rows, accuracy, args, README_SYSTEMS) + "\n" + claims
                   + f"\nAll systems, scenarios and plots: [{results}/summary.md]({results}/summary.md).\n")
    print(md)
    return 0


def _wisv_goals(args, rows: list[dict], results: Path, profiles) -> str:
    """The WISV goal checks (``eval.wisv_goals``) of the decoded lossy systems (wisv, fly), each on its
    own channel against greedy SD at the same K; also priced under fh, sh and adaptive. Writes
    ``wisv_goals.csv``, ``wisv_protocols.csv`` and ``wisv_goals.png``; returns the markdown ("" without
    such systems)."""
    from wisv_ros.eval.latency import ProfileCompute, latency_report
    from wisv_ros.eval.wisv_goals import goal_rows, goals_markdown, parse_system

    out_rows, proto_rows, md = [], [], []
    for ds in args.dataset:
        base = Path(args.out) / ds
        reference = {r["id"]: int(r["correct"]) for r in csv.DictReader(open(base / "problems.csv"))}
        correct = {}
        for live_csv in sorted(base.glob("live_*.csv")):
            name = live_csv.stem.removeprefix("live_")
            if parse_system(name) is not None:
                correct[name] = {r["id"]: int(r["correct"]) for r in csv.DictReader(open(live_csv))}
        if not correct:
            continue
        goal = goal_rows(rows, correct, reference, ds)
        if args.keep_published:
            goal = sorted((r for r in _with_published(goal, results / "wisv_goals.csv") if r["dataset"] == ds),
                          key=lambda r: r["system"])
        out_rows += goal
        heads = {parse_system(n)["head"] for n in correct if parse_system(n)["kind"] == "wisv"}
        side = Path(__file__).resolve().parents[2] / "config" / "heads"
        relabel = next((json.loads((side / f"{h}.json").read_text()).get("relabel", {}) for h in sorted(heads)
                        if (side / f"{h}.json").is_file()), {})
        cfg = json.loads((base / "config.json").read_text())
        hidden_dim, _ = _pair_dims(cfg)
        md.append(f"### {ds}\n\nEach decoded system on its own channel (fly: every channel) against greedy SD at the same K; "
                  "answers paired with the target alone's (its greedy answers on the same engine).\n\n"
                  + goals_markdown(goal, hidden_dim, float(relabel.get("round_compute_s", 0.1))))
        # The WISV systems under the three upload protocols (same rounds; fh carries every hidden, sh only
        # the mismatches' in a second exchange, adaptive the cheaper of the two per round).
        for name in correct:
            info = parse_system(name)
            if info["kind"] != "wisv":
                continue
            for dep in args.deployment:
                for proto in ("fh", "sh", "adaptive"):
                    _, agg = latency_report(base / "rounds" / f"{name}.jsonl", info["channel"],
                                            ProfileCompute(profiles.deployment(dep)), protocol=proto, n_boot=200)
                    proto_rows.append({"dataset": ds, "system": name, "scenario": info["channel"], "deployment": dep,
                                       "protocol": proto, "ms_per_token": round(agg["ms_per_token"], 2),
                                       "ms_lo": round(agg["ms_per_token_lo"], 2), "ms_hi": round(agg["ms_per_token_hi"], 2)})
    if not out_rows:
        return ""
    if args.keep_published:
        proto_rows = _with_published(proto_rows, results / "wisv_protocols.csv")
    _write_csv(results / "wisv_goals.csv", out_rows)
    if proto_rows:
        _write_csv(results / "wisv_protocols.csv", proto_rows)
        md.append("Upload protocols of the WISV systems (ms per token on their own channel): [wisv_protocols.csv](wisv_protocols.csv).\n")
    _wisv_goals_plot(out_rows, results / "wisv_goals.png")
    md.append("Plot: [wisv_goals.png](wisv_goals.png) (AAL and accuracy of every decoded system against greedy SD).\n")
    return "\n".join(md)


def _wisv_goals_plot(rows: list[dict], path: Path) -> None:
    """Left: AAL by channel, one line per (K, head, tau) (fly: its setting), greedy SD at each K
    dashed; right: net answers lost against AAL gain. Every series has a colour and marker of its
    own (ten colours, then the next marker), and the legends stand beside the axes."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    from wisv_ros.eval.wisv_goals import scenario_order

    first = rows[0]["deployment"]
    rows = [r for r in rows if r["deployment"] == first]
    fig = Figure(figsize=(15, 4.8), dpi=100, layout="constrained")
    a1, a2 = fig.subplots(1, 2)
    styles = [(c, m) for m in "os^Dv<>ph*" for c in colormaps["tab10"].colors]
    order = scenario_order(8, 896, 0.1)
    def line(r):
        return (r["k"], r["head"], "" if r["tau"] in ("", None) else float(r["tau"]))

    for n, key in enumerate(sorted(dict.fromkeys(line(r) for r in rows), key=str)):
        pts = {r["scenario"]: r["aal"] for r in rows if line(r) == key}
        xs = [i for i, s in enumerate(order) if s in pts]
        color, marker = styles[n % len(styles)]
        a1.plot(xs, [pts[order[i]] for i in xs], "-", color=color, marker=marker, label=f"K {key[0]} {key[1]}" + (f" τ {key[2]:g}" if key[2] != "" else ""))
    for k in dict.fromkeys(r["k"] for r in rows):
        g = {r["scenario"]: r["greedy_aal"] for r in rows if r["k"] == k}
        xs = [i for i, s in enumerate(order) if s in g]
        a1.plot(xs, [g[order[i]] for i in xs], "kx--", alpha=0.5, label=f"greedy SD K {k}")
    a1.set_xticks(range(len(order)), order, fontsize=7)
    a1.set(xlabel="channel (worst to best)", ylabel="AAL (tokens per round)")
    a1.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for n, r in enumerate(rows):
        color, marker = styles[n % len(styles)]
        a2.errorbar(100 * r["aal_gain"], r["net"], yerr=[[r["net"] - r["net_lo"]], [r["net_hi"] - r["net"]]], fmt=marker,
                    color=color, capsize=2, label=f"{r['system']} @ {r['scenario']}")
    a2.axhline(1, color="r", lw=0.8, ls=":")
    a2.axvline(40, color="r", lw=0.8, ls=":")
    a2.set(xlabel="AAL gain over greedy SD (%)", ylabel="net answers lost vs target alone (95 % CI)")
    a2.legend(fontsize=5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fig.savefig(path)


def paired_flips(live: list[dict], greedy_right: dict[str, int]) -> dict:
    """A live system's answers against the target's greedy ones on the same problems: how many of
    those the greedy answers get right, and how many flip right -> wrong and wrong -> right (a
    problem missing from ``greedy_right`` is an error: the two runs must cover the same problems)."""
    missing = [r["id"] for r in live if r["id"] not in greedy_right]
    if missing:
        raise SystemExit(f"error: {len(missing)} live problems (e.g. {missing[0]}) are not in problems.csv; "
                         "replay the same data set first (python -m wisv_ros.cli.evaluate replay)")
    pairs = [(greedy_right[r["id"]], int(r["correct"])) for r in live]
    return {"greedy_correct_same_problems": sum(g for g, _ in pairs),
            "right_to_wrong": sum(g and not w for g, w in pairs), "wrong_to_right": sum(w and not g for g, w in pairs)}


def _system_order(path: Path) -> tuple:
    """target_only, then by K, each K without copy first, then ngram, suffix, probe."""
    name = path.stem
    if name == "target_only":
        return (0, 0, 0)
    if not name.startswith("greedy_k"):  # live systems (reject_k8_t1, live_greedy_k8) after the replayed ones
        return (2, 0, name)
    k, _, copy = name.removeprefix("greedy_k").partition("+")
    return (1, int(k), ["", "ngram", "suffix", "probe"].index(copy) if copy in ("", "ngram", "suffix", "probe") else 9)


def _published_value(text: str):
    """A CSV cell back as the report wrote it: int, float, bool or text."""
    if text in ("True", "False"):
        return text == "True"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _with_published(rows: list[dict], path: Path) -> list[dict]:
    """``rows`` plus the rows of ``path`` (an earlier report's table) whose (dataset, system) is not among
    them: a system whose raw data is not in the run directory keeps its published row, one decoded
    again replaces it. Kept rows go after the new ones, in their published order."""
    if not path.is_file():
        return rows
    have = {(r["dataset"], r["system"]) for r in rows}
    fields = list(rows[0]) if rows else None
    kept = []
    for r in csv.DictReader(open(path, newline="")):
        if (r.get("dataset"), r.get("system")) in have:
            continue
        if fields is not None and set(r) != set(fields):
            raise SystemExit(f"error: {path} has columns {sorted(r)}, this report writes {sorted(fields)}; "
                             "run the report without --keep-published (or restore the run data of every system)")
        kept.append({k: _published_value(v) for k, v in r.items()})
    return rows + kept


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


README_SYSTEMS = ("greedy_k4", "greedy_k8", "greedy_k16", "greedy_k8+ngram", "greedy_k8+suffix", "greedy_k8+probe")


def _report_markdown(rows: list[dict], accuracy: list[dict], args, systems: tuple[str, ...] | None = None) -> str:
    """The headline table: per data set and deployment, on 20 Mbit/s with 50 ms RTT, each system's
    latency per token against the two alternatives a user would run instead."""
    lines = [f"Generated by `python -m wisv_ros.cli.evaluate report` from `{args.out}` "
             "(target Qwen2.5-Coder-1.5B-Instruct, drafter Qwen2.5-Coder-0.5B-Instruct; `greedy_*`: replayed greedy SD, "
             "lossless: every such system commits the target's greedy text; `reject_k<K>_t<T>`: rejection SD decoded "
             "live at temperature T, `evaluate live`). Link 20 Mbit/s, PER 1 %, RTT 50 ms; ms per token with a 95 % "
             "bootstrap interval over problems. `embedded_default`: compute measured on this machine (engine_bench, "
             "llama.cpp, 1 thread); `orin_robot_l4_edge`: **projected** from published figures "
             "(config/hardware_profiles.yaml names every source).", ""]
    lines += ["| data set | deployment | system | AAL (tokens per round, copy rounds included) | ms/token [95 % CI] "
              "| target alone on the edge | both models on the edge | speedup vs target alone |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        live = not r["system"].startswith("greedy_k") and r["system"] != "target_only"
        if r["scenario"] != "20mbps_50ms" or r["system"] == "target_only" or (systems and r["system"] not in systems
                                                                             and not live):
            continue
        lines.append(f"| {r['dataset']} | {r['deployment']} | {r['system']} | {r['aal']} | {r['ms_per_token']} "
                     f"[{r['ms_lo']}, {r['ms_hi']}] | {r['target_alone_ms']} | {r['both_on_edge_ms']} | {r['speedup_vs_target_alone']} |")
    base = [a for a in accuracy if a.get("system", "").startswith("target greedy")] or accuracy
    lines += ["", "Accuracy of the target's greedy answers (the same for every replayed greedy system above): "
              + "; ".join(f"{a['dataset']} {a['correct']}/{a['problems']} ({100 * a['accuracy']:.1f} %)" for a in base)
              + " (GSM8K: exact final number; HumanEval: pass@1 of the answer's code block, sandboxed).", ""]
    live = [a for a in accuracy if a not in base]
    if live:
        lines += ["Decoded live (each system's own answers; paired with the greedy answers to the same problems: "
                  "greedy right, and flips right -> wrong / wrong -> right): "
                  + "; ".join(f"{a['system']} on {a['dataset']} {a['correct']}/{a['problems']} "
                              f"({100 * a['accuracy']:.1f} %; greedy {a['greedy_correct_same_problems']}, "
                              f"{a['right_to_wrong']} / {a['wrong_to_right']})" for a in live), ""]
    return "\n".join(lines)


def _switchsd_claims(rows: list[dict], replayed: list[dict], k: int = 8) -> str:
    """SwitchSD's claims checked on the replay at K ``k`` (20 Mbit/s, 50 ms): probe-gated copy at least
    as fast as the better of no copy and the best heuristic; its copy rounds accept more per attempt
    than the n-gram baseline's while firing less; speedup over the target alone with copy."""
    lines = [f"SwitchSD against its claims (K = {k}, 20 Mbit/s / 50 ms; copy AAL = copied tokens accepted per copy round):", "",
             "| data set | deployment | ms/token: no copy / best heuristic / probe | probe as fast as the better? | "
             "copy AAL probe vs n-gram | copy rounds probe vs n-gram | speedup vs target alone, best copy |", "|---|---|---|---|---|---|---|"]
    base = f"greedy_k{k}"
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        rep = {r["system"]: r for r in replayed if r["dataset"] == ds}
        for dep in dict.fromkeys(r["deployment"] for r in rows):
            sub = {r["system"]: r for r in rows if r["dataset"] == ds and r["deployment"] == dep and r["scenario"] == "20mbps_50ms"}
            if base not in sub or f"{base}+probe" not in sub:
                continue
            heur = min((sub[f"{base}+{h}"]["ms_per_token"], h) for h in ("ngram", "suffix") if f"{base}+{h}" in sub)
            probe = sub[f"{base}+probe"]["ms_per_token"]
            best = min(sub[base]["ms_per_token"], heur[0])
            aal = (rep.get(f"{base}+probe", {}).get("copy_aal", ""), rep.get(f"{base}+ngram", {}).get("copy_aal", ""))
            copies = (sub[f"{base}+probe"]["copy_rounds"], sub.get(f"{base}+ngram", {}).get("copy_rounds", ""))
            best_copy = max(sub[s]["speedup_vs_target_alone"] for s in sub if s.startswith(base + "+"))
            lines.append(f"| {ds} | {dep} | {sub[base]['ms_per_token']} / {heur[0]} ({heur[1]}) / {probe} | "
                         f"{'yes' if probe <= best * 1.0 else f'no, {100 * (probe / best - 1):.1f} % slower'} | "
                         f"{aal[0]} vs {aal[1]} | {copies[0]} vs {copies[1]} | {best_copy} |")
    return "\n".join(lines) + "\n"


def _report_plots(rows: list[dict], results: Path) -> None:
    import numpy as np
    from matplotlib.figure import Figure

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    deps = list(dict.fromkeys(r["deployment"] for r in rows))
    systems = [s for s in dict.fromkeys(r["system"] for r in rows) if s != "target_only"]
    shown = [s for s in ("greedy_k4", "greedy_k8", "greedy_k16", "greedy_k8+ngram", "greedy_k8+suffix", "greedy_k8+probe")
             if s in systems] or systems[:8]
    shown += [s for s in systems if not s.startswith("greedy_k") and s not in shown]  # live systems (reject)
    fig = Figure(figsize=(6.5 * len(deps), 3.6 * len(datasets)), dpi=100)
    axes = np.atleast_2d(fig.subplots(len(datasets), len(deps), squeeze=False))
    for i, ds in enumerate(datasets):
        for j, dep in enumerate(deps):
            ax = axes[i, j]
            sub = [r for r in rows if r["dataset"] == ds and r["deployment"] == dep]
            scen = list(dict.fromkeys(r["scenario"] for r in sub))
            names = ["target alone", "both on edge"] + shown
            width = 0.85 / len(names)
            for n, name in enumerate(names):
                ys, err = [], []
                for sc in scen:
                    if name in ("target alone", "both on edge"):  # the baselines, priced on the greedy K 8 rounds
                        r = next(r for r in sub if r["scenario"] == sc and r["system"] == (shown[1] if len(shown) > 1 else shown[0]))
                        ys.append(r["target_alone_ms"] if name == "target alone" else r["both_on_edge_ms"])
                        err.append((0, 0))
                    else:
                        r = next((r for r in sub if r["scenario"] == sc and r["system"] == name), None)
                        if r is None:  # a system decoded on one data set only
                            ys.append(float("nan"))
                            err.append((0, 0))
                            continue
                        ys.append(r["ms_per_token"])
                        err.append((r["ms_per_token"] - r["ms_lo"], r["ms_hi"] - r["ms_per_token"]))
                xs = np.arange(len(scen)) + (n - (len(names) - 1) / 2) * width
                ax.bar(xs, ys, width, yerr=np.array(err).T, label=name, color=f"C{n}" if n else "black")
            ax.set_xticks(np.arange(len(scen)), scen, fontsize=7)
            ax.set_ylabel("ms per token")
            ax.set_title(f"{ds}, {dep}" + (" (projected)" if dep != "embedded_default" else ""), fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(results / "latency_by_scenario.png")
    # AAL and rounds by K (greedy without copy), per data set.
    fig = Figure(figsize=(9, 3.4), dpi=100)
    a1, a2 = fig.subplots(1, 2)
    for ds in datasets:
        pts = sorted((int(r["system"].split("_k")[1]), r["aal"], r["rounds"] / r["problems"]) for r in rows
                     if r["dataset"] == ds and re.fullmatch(r"greedy_k\d+", r["system"])
                     and r["deployment"] == deps[0] and r["scenario"] == "20mbps_50ms")
        a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=ds)
        a2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=ds)
    a1.set_xlabel("K")
    a1.set_ylabel("AAL (tokens per round)")
    a2.set_xlabel("K")
    a2.set_ylabel("rounds per problem")
    a1.legend()
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(results / "aal_by_k.png")
    # Copy rounds: accepted tokens per copy round and share of rounds, per policy and data set.
    fig = Figure(figsize=(9, 3.4), dpi=100)
    a1, a2 = fig.subplots(1, 2)
    copy_systems = [s for s in systems if "+" in s]
    width = 0.8 / max(len(datasets), 1)
    for d, ds in enumerate(datasets):
        sub = {r["system"]: r for r in rows if r["dataset"] == ds and r["deployment"] == deps[0] and r["scenario"] == "20mbps_50ms"}
        rate = [sub[s]["copy_rounds"] / sub[s]["rounds"] if s in sub else 0 for s in copy_systems]
        xs = np.arange(len(copy_systems)) + (d - (len(datasets) - 1) / 2) * width
        a2.bar(xs, rate, width, label=ds)
        aal = [sub[s]["aal"] if s in sub else 0 for s in copy_systems]
        a1.bar(xs, aal, width, label=ds)
    for ax, label in ((a1, "AAL (all rounds)"), (a2, "copy rounds / all rounds")):
        ax.set_xticks(np.arange(len(copy_systems)), copy_systems, rotation=60, fontsize=6)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    a1.legend()
    fig.tight_layout()
    fig.savefig(results / "copy.png")


_WISV_NAME = re.compile(r"wisv_k(?P<k>\d+)_tau(?P<tau>[0-9.e+-]+)_(?P<channel>[a-z0-9_]+?mbps_\d+ms)_(?P<head>.+)")


def tau_points(rows: list[dict], accuracy: list[dict], deployment: str) -> list[dict]:
    """Accuracy and latency against tau of the WISV systems decoded live (``live_system_name``):
    one row per (data set, K, channel, head, tau), the latency on the system's own channel and
    ``deployment``; tau 0 is greedy SD at the same K (the replayed ``greedy_k<K>``, whose accuracy is
    the target's greedy one). Empty without a WISV system."""
    acc = {(a["dataset"], a["system"]): a for a in accuracy}
    target = {a["dataset"]: a for a in accuracy if a["system"].startswith("target greedy")}
    priced = {(r["dataset"], r["system"], r["scenario"]): r for r in rows if r["deployment"] == deployment}
    out, curves = [], {}
    for (ds, system, scenario), r in priced.items():
        m = _WISV_NAME.fullmatch(system)
        if m is None or scenario != m["channel"] or (ds, system) not in acc:
            continue
        key = dict(dataset=ds, k=int(m["k"]), channel=m["channel"], head=m["head"])
        out.append(dict(key, tau=float(m["tau"]), accuracy=acc[(ds, system)]["accuracy"],
                        problems=acc[(ds, system)]["problems"], ms_per_token=r["ms_per_token"], aal=r["aal"]))
        curves[tuple(key.values())] = key
    for (ds, k, channel, _head), key in curves.items():  # each curve starts at greedy SD
        greedy = priced.get((ds, f"greedy_k{k}", channel))
        if greedy is not None and ds in target:
            out.append(dict(key, tau=0.0, accuracy=target[ds]["accuracy"], problems=target[ds]["problems"],
                            ms_per_token=greedy["ms_per_token"], aal=greedy["aal"]))
    return sorted(out, key=lambda p: (p["dataset"], p["k"], p["channel"], p["head"], p["tau"]))


def _tau_plot(points: list[dict], path: Path) -> None:
    """accuracy_latency_vs_tau.png: one curve per (data set, K, channel, head)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8), dpi=100)
    a1, a2 = fig.subplots(1, 2)
    for key in dict.fromkeys((p["dataset"], p["k"], p["channel"], p["head"]) for p in points):
        pts = [p for p in points if (p["dataset"], p["k"], p["channel"], p["head"]) == key]
        label = f"{key[0]} K {key[1]} {key[2]} {key[3]}"
        a1.plot([p["tau"] for p in pts], [100 * p["accuracy"] for p in pts], marker="o", label=label)
        a2.plot([p["tau"] for p in pts], [p["ms_per_token"] for p in pts], marker="o", label=label)
    a1.set(xlabel="tau (0 = greedy SD)", ylabel="accuracy (%)")
    a2.set(xlabel="tau (0 = greedy SD)", ylabel="ms per token (own channel)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    a1.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)


def _update_readme(readme: Path, md: str) -> None:
    """Replace the README's text between the results markers with ``md`` (nothing if absent)."""
    if not readme.is_file():
        return
    text = readme.read_text()
    begin, end = "<!-- results:begin -->", "<!-- results:end -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        readme.write_text(head + begin + "\n" + md + "\n" + end + tail)


def _pair_dims(cfg: dict) -> tuple[int, int]:
    """(drafter hidden size, target vocabulary) from the models' config files (no weights loaded)."""
    from transformers import AutoConfig

    from wisv_ros.sd.models import resolve

    d = AutoConfig.from_pretrained(resolve(cfg["drafter"])).get_text_config().hidden_size
    v = AutoConfig.from_pretrained(resolve(cfg["target"])).get_text_config().vocab_size
    return int(d), int(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wisv_ros.cli.evaluate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    names = ", ".join(REGISTRY)
    for name in ("decode", "replay", "report", "live", "tokenwise"):
        s = sub.add_parser(name)
        s.add_argument("--dataset", action="append", choices=DATASETS, help="gsm8k and/or humaneval (repeatable; default both)")
        s.add_argument("--out", default="runs/eval", help="traces and round logs, per data set (default %(default)s)")
        s.add_argument("--probe", default=None, help="copy probe .npz (default: config/probes/<target>_copy.npz if it exists)")
        s.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: {names} (default %(default)s)")
    dec = sub.choices["decode"]
    dec.add_argument("--drafter", default=DEFAULT_DRAFTER, help="drafter model, same vocabulary as the target (default %(default)s)")
    dec.add_argument("--limit", type=int, default=None, help="problems per data set (default: all, 100 / 164)")
    dec.add_argument("--batch", type=int, default=16, help="problems decoded at once (default %(default)s)")
    dec.add_argument("--max-new-tokens", type=int, default=384, help="cap per problem (default %(default)s)")
    dec.add_argument("--dtype", default="auto", help="torch weights dtype (default %(default)s: bfloat16 where the CPU has it)")
    dec.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    rep = sub.choices["replay"]
    rep.add_argument("--k", type=int, action="append", help="block sizes (repeatable; default 4, 8, 16)")
    rep.add_argument("--copy", action="append", help="copy policies off, ngram, suffix, probe (repeatable; default all)")
    rep.add_argument("--min-confidence", type=float, default=0.0, help="drafter confidence stop (default %(default)s)")
    live = sub.choices["live"]
    live.add_argument("--method", default="reject", choices=("reject", "greedy", "fly", "wisv"),
                      help="reject: rejection SD (samples; not replayable); greedy: live greedy SD, e.g. to check the "
                      "replay; fly: training-free lenient verification (--fly-entropy, --fly-window); wisv: the "
                      "decision head (--head, --tau, --channel) (default %(default)s)")
    live.add_argument("--fly-entropy", type=float, default=FLY_ENTROPY,
                      help="method fly: accept a mismatch only where the target's normalised top-8 entropy is at least this "
                      "(0..1; default %(default)s)")
    live.add_argument("--fly-window", type=int, default=FLY_WINDOW,
                      help="method fly: draft tokens after the mismatch that must all match the target (default %(default)s)")
    live.add_argument("--head", default=None, help="method wisv: decision head .onnx")
    live.add_argument("--tau", type=float, default=0.1, help="method wisv: rejection threshold (default %(default)s)")
    live.add_argument("--channel", default="20mbps_50ms", help="method wisv: channel scenario the head sees (default %(default)s)")
    live.add_argument("--drafter", default=DEFAULT_DRAFTER, help="drafter model, same vocabulary (default %(default)s)")
    live.add_argument("--k", type=int, default=8, help="block size (default %(default)s)")
    live.add_argument("--temperature", type=float, default=1.0,
                      help="sampling temperature of both models under reject (default %(default)s)")
    live.add_argument("--min-confidence", type=float, default=0.0, help="drafter confidence stop (default %(default)s)")
    live.add_argument("--backend", default="llama_cpp", choices=("torch", "llama_cpp"),
                      help="engine of both models (default %(default)s: the fastest on a CPU)")
    live.add_argument("--threads", type=int, default=1, help="CPU threads per model (default %(default)s)")
    live.add_argument("--limit", type=int, default=None, help="problems per data set (default: all)")
    live.add_argument("--max-new-tokens", type=int, default=384, help="cap per problem (default %(default)s)")
    live.add_argument("--seed", type=int, default=0, help="sampling seed, mixed with each problem's id (default %(default)s)")
    tw = sub.choices["tokenwise"]
    tw.add_argument("--method", default="greedy", choices=("greedy", "wisv", "fly"),
                    help="greedy: the target alone's answers as replay traces (then replay gives greedy SD at every K); "
                    "wisv: the decision head (--head, --tau or --tau-per-channel, --channel); fly: the training-free "
                    "baseline (default %(default)s)")
    tw.add_argument("--head", default=None, help="method wisv: decision head .onnx")
    tw.add_argument("--tau", type=float, default=0.1, help="method wisv: rejection threshold (default %(default)s)")
    tw.add_argument("--tau-per-channel", default="", help="method wisv: '<scenario>:<tau>,...' (the verifier's parameter): the "
                    "tau of the scenario nearest --channel replaces --tau (default: none)")
    tw.add_argument("--channel", default="20mbps_50ms", help="method wisv: channel scenario the head sees (default %(default)s)")
    tw.add_argument("--fly-entropy", type=float, default=FLY_ENTROPY, help="method fly: entropy gate (default %(default)s)")
    tw.add_argument("--fly-window", type=int, default=FLY_WINDOW, help="method fly: deferred window (default %(default)s)")
    tw.add_argument("--drafter", default=DEFAULT_DRAFTER, help="drafter model, same vocabulary (default %(default)s)")
    tw.add_argument("--k", type=int, default=8, help="block size (default %(default)s; greedy: any, replay picks K)")
    tw.add_argument("--backend", default="llama_cpp", choices=("torch", "llama_cpp"), help="engine of both models (default %(default)s)")
    tw.add_argument("--threads", type=int, default=1, help="CPU threads per model (default %(default)s)")
    tw.add_argument("--limit", type=int, default=None, help="problems per data set (default: all)")
    tw.add_argument("--max-new-tokens", type=int, default=384, help="cap per problem (default %(default)s)")
    rpt = sub.choices["report"]
    rpt.add_argument("--results", default="docs/results", help="tables and plots (default %(default)s)")
    rpt.add_argument("--deployment", action="append", help="deployments of the profile file (default: all)")
    rpt.add_argument("--profiles", default=None, help="hardware profile file (default config/hardware_profiles.yaml)")
    rpt.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples per interval (default %(default)s)")
    rpt.add_argument("--keep-published", action="store_true",
                     help="keep the rows of the tables already in --results for systems whose raw data is not in --out "
                     "(a system decoded again replaces its row; default: the tables hold what --out holds)")
    rpt.add_argument("--readme", default="README.md", help="README whose results section is rewritten (default %(default)s)")
    args = p.parse_args(argv)
    args.dataset = args.dataset or list(DATASETS)
    if args.cmd == "report":
        if not args.deployment:
            from wisv_ros.eval.latency import load_profiles

            args.deployment = list(load_profiles(args.profiles).deployments)
        return cmd_report(args)
    if args.probe is None:
        default = Path(__file__).resolve().parents[2] / "config" / "probes" / f"{args.target}_copy.npz"
        args.probe = str(default) if default.is_file() else ""
    if args.cmd == "tokenwise":
        if args.k < 1 or args.max_new_tokens < 1 or args.threads < 1:
            p.error("--k, --max-new-tokens and --threads must be >= 1")
        if args.method == "fly" and (args.fly_window < 1 or not 0 <= args.fly_entropy <= 1):
            p.error(f"--fly-window must be >= 1 and --fly-entropy in [0, 1] (got {args.fly_window}, {args.fly_entropy})")
        if args.method == "wisv":
            from wisv_ros.link.channel import SCENARIOS, TauSchedule

            if not (args.head and Path(args.head).is_file()):
                p.error(f"--method wisv needs --head <decision head .onnx> (got {args.head!r})")
            if args.channel not in SCENARIOS:
                p.error(f"--channel '{args.channel}' is not one of {', '.join(SCENARIOS)}")
            if not (math.isfinite(args.tau) and args.tau >= 0):
                p.error(f"--tau must be finite and >= 0 (got {args.tau})")
            if args.tau_per_channel:
                try:
                    TauSchedule.parse(args.tau_per_channel)
                except ValueError as exc:
                    p.error(f"--tau-per-channel: {exc}")
        return cmd_tokenwise(args)
    if args.cmd == "live":
        if args.k < 1 or args.max_new_tokens < 1 or args.threads < 1:
            p.error("--k, --max-new-tokens and --threads must be >= 1")
        if args.method == "reject" and not (args.temperature > 0 and math.isfinite(args.temperature)):
            p.error(f"--temperature must be a finite number > 0 for reject (got {args.temperature})")
        if args.method != "reject":
            args.temperature = 0.0
        if args.method == "fly" and (args.fly_window < 1 or not 0 <= args.fly_entropy <= 1):
            p.error(f"--fly-window must be >= 1 and --fly-entropy in [0, 1] (got {args.fly_window}, {args.fly_entropy})")
        if args.method == "wisv":
            from wisv_ros.link.channel import SCENARIOS

            if not (args.head and Path(args.head).is_file()):
                p.error(f"--method wisv needs --head <decision head .onnx> (got {args.head!r})")
            if args.channel not in SCENARIOS:
                p.error(f"--channel '{args.channel}' is not one of {', '.join(SCENARIOS)}")
            if not (math.isfinite(args.tau) and args.tau >= 0):
                p.error(f"--tau must be finite and >= 0 (got {args.tau})")
        if not 0 <= args.min_confidence < 1:
            p.error(f"--min-confidence must be in [0, 1) (got {args.min_confidence})")
        return cmd_live(args)
    if args.cmd == "decode":
        if args.batch < 1 or args.max_new_tokens < 1:
            p.error("--batch and --max-new-tokens must be >= 1")
        return cmd_decode(args)
    args.k = args.k or [4, 8, 16]
    args.copy = args.copy or ["off", "ngram", "suffix", "probe"]
    if any(k < 1 for k in args.k):
        p.error("--k must be >= 1")
    return cmd_replay(args)


if __name__ == "__main__":
    sys.exit(main())
