"""What the command-line tools share: model loading, method set-up and text streaming."""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from wisv_ros.switchsd.copying import COPY_MODES, CopyConfig
from wisv_ros.sd.drafting import Drafter
from wisv_ros.sd.verification import Method, Verifier
from wisv_ros.sd.lm import CausalLM
from wisv_ros.sd.engines import add_backend_args, load_lm
from wisv_ros.sd.models import DEFAULT_DRAFTER, DEFAULT_TARGET, REGISTRY, add_dtype_args


def add_pair_args(p: argparse.ArgumentParser) -> None:
    """--drafter, --target, --k and --min-confidence: the pair and its block, shared by the CLIs."""
    names = ", ".join(REGISTRY)
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help=f"drafter model: {names}, a HF folder or a .gguf file (default %(default)s)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model, same choices (default %(default)s)")
    p.add_argument("--k", type=int, default=8, help="draft tokens per round, K (default %(default)s)")
    p.add_argument("--min-confidence", type=float, default=0.6,
                   help="drafter ends a block after a token it is less sure of than this (0 = always K; default %(default)s)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_pair_args(p)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of method reject (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling methods (default %(default)s)")
    p.add_argument("--copy", default="off", choices=COPY_MODES,
                   help="SwitchSD copy mode on the edge: off; ngram (probe-less baseline: copy whenever the last "
                        "--kappa tokens occurred before); suffix (the longest earlier match of any length, the prompt-lookup "
                        "rule); probe (ngram, and only when the --probe fires too) (default %(default)s)")
    p.add_argument("--probe", default=None, help="copy probe file (.npz from python -m wisv_ros.cli.probe train)")
    p.add_argument("--kappa", type=int, default=5, help="copy mode: suffix tokens to match (default %(default)s)")
    p.add_argument("--copy-width", type=int, default=4, help="copy mode: candidates per round, W (default %(default)s)")
    p.add_argument("--copy-depth", type=int, default=16, help="copy mode: tokens per candidate, D (default %(default)s)")
    p.add_argument("--head", default=None, help="method wisv: decision head ONNX file (from python -m wisv_ros.cli.train_head)")
    p.add_argument("--tau", type=float, default=0.5,
                   help="method wisv: reject a mismatch when the head's rejection probability >= tau "
                        "(0 = greedy SD, > 1 accepts every draft; default %(default)s)")
    p.add_argument("--channel", default="20mbps_50ms",
                   help="method wisv, in-process runs: channel scenario fed to the head (default %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    add_dtype_args(p)
    add_backend_args(p)


def check_args(args: argparse.Namespace) -> None:
    if args.k < 1:
        sys.exit(f"error: --k must be >= 1 (got {args.k})")
    wants_wisv = "wisv" in str(getattr(args, "method", "")) or "wisv" in str(getattr(args, "methods", ""))
    if wants_wisv and not args.head:
        sys.exit("error: method wisv needs --head <decision head .onnx> (train one with python -m wisv_ros.cli.train_head)")
    if getattr(args, "copy", "off") == "probe" and not (args.probe and os.path.isfile(args.probe)):
        sys.exit(f"error: --copy probe needs --probe <existing probe .npz> (got {args.probe!r})")
    if args.head and not os.path.isfile(args.head):
        sys.exit(f"error: --head {args.head}: no such file")
    for name in ("kappa", "copy_width", "copy_depth"):
        if getattr(args, name) < 1:
            sys.exit(f"error: --{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if not 0 <= args.min_confidence < 1:
        sys.exit(f"error: --min-confidence must be in [0, 1) (got {args.min_confidence})")
    if args.temperature <= 0:
        sys.exit(f"error: --temperature must be > 0 (got {args.temperature})")


def set_threads(n: int) -> None:
    import torch

    if n > 0:
        torch.set_num_threads(n)


def parse_shard(p: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    """(I, N) of a ``--shard I/N`` option (0 <= I < N); a parser error naming the option otherwise."""
    try:
        shard = tuple(int(x) for x in text.split("/"))
        if len(shard) == 2 and 0 <= shard[0] < shard[1]:
            return shard
    except ValueError:
        pass
    p.error(f"--shard must be I/N with 0 <= I < N, e.g. 0/2 (got {text!r})")


def load_pair(args: argparse.Namespace, need_drafter: bool = True) -> tuple[CausalLM, CausalLM | None]:
    """Load (target, drafter); the drafter is None when only the target is needed."""
    t0 = time.perf_counter()
    capture = ()
    if getattr(args, "copy", "off") == "probe":
        from wisv_ros.switchsd.probe import load_probe

        args.loaded_probe = load_probe(args.probe)
        capture = [(args.loaded_probe.layer, args.loaded_probe.kind)]
    threads = max(1, getattr(args, "threads", 1))
    target = load_lm(args.target, args.target_backend, dtype=args.target_dtype, capture=capture, threads=threads)
    drafter = (load_lm(args.drafter, args.drafter_backend, dtype=args.drafter_dtype, threads=threads)
               if need_drafter else None)
    print(f"[wisv_ros] models loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return target, drafter


def make_halves(method: Method, target: CausalLM, drafter: CausalLM, args: argparse.Namespace) -> tuple[Drafter, Verifier]:
    """The robot and edge halves for a speculative method."""
    sampling = method == Method.REJECT
    d = Drafter(drafter, target_tokenizer=target.tokenizer, temperature=args.temperature if sampling else 0.0, seed=args.seed,
                min_confidence=args.min_confidence)
    if sampling and d.cross:
        raise SystemExit(
            f"error: method reject needs one vocabulary, but drafter '{args.drafter}' and target '{args.target}' "
            "have different tokenizers; use method greedy or wisv, or a same-tokenizer pair"
        )
    copy = CopyConfig.for_mode(getattr(args, "copy", "off"), getattr(args, "loaded_probe", None),
                               kappa=args.kappa, width=args.copy_width, depth=args.copy_depth)
    judge = None
    if method == Method.WISV:
        if not getattr(args, "head", None):
            raise SystemExit("error: method wisv needs --head <decision head .onnx> (train one with python -m wisv_ros.cli.train_head)")
        from wisv_ros.wisv.head import OnnxHead, make_judge
        from wisv_ros.link.channel import scenario

        channel = scenario(args.channel)
        judge = make_judge(OnnxHead(args.head), lambda: channel)
    v = Verifier(target, method, temperature=args.temperature, seed=args.seed, copy=copy,
                 tau=getattr(args, "tau", 0.0), judge=judge)
    return d, v


class TextStream:
    """Prints committed text as it arrives (decodes the whole answer, prints the new suffix)."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0
        self.out = out

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        if self.tokenizer is None:
            text = " ".join(map(str, self.ids)) + " "
        else:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)


class PeakRSS:
    """Samples the process's resident memory in a background thread; ``peak_mb`` after ``stop()``."""

    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss_mb() -> float:
        try:
            with open(f"/proc/{os.getpid()}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024.0
        except OSError:
            pass
        return 0.0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self.rss_mb())
            self._stop.wait(self.period_s)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, self.rss_mb())
