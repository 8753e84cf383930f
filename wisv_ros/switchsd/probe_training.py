"""SwitchSD copy probe training: labels, data collection, per-layer linear probes, layer choice and export.

SwitchSD (SPEC "Training the copy probe") detects *copy mode* -- the target is repeating a span of its
context -- with one bias-free linear probe on one decoder layer, ``p(j) = sigmoid(wᵀ H_j)``. The
verifier copies candidates out of the context only when the probe fires *and* the last kappa tokens
occurred earlier (``copying.copy_candidates``).

Pipeline:

1. Labels. :func:`copy_labels` marks a token with Y = 1 when it lies in a verbatim run of at least
   ``min_run`` (5) tokens that also occurs earlier in the context (prompt included).
2. Prompts. :func:`build_repetition_prompts` turns the 164 HumanEval canonical solutions into chat
   prompts with repetition structure: rename a function, annotate the code and repeat it, quote a line
   verbatim, plus non-copy controls (explain in your own words) so that both labels occur.
3. Collection. :func:`collect_probe_data` lets the target complete each prompt greedily, runs ONE
   forward pass over prompt + completion that captures the requested layers (``lm.CausalLM``
   ``capture``), and stores the completion positions: hidden row j is the residual stream at token j
   (the state after reading token j, which predicts token j + 1) and label j is the label of token j.
4. Probes. :func:`train_probe` fits one probe per (layer, kind) (BCE + L2, LBFGS), :func:`evaluate`
   gives AUC and the F1-best threshold on validation, :func:`select_layer` keeps the (layer, kind) with
   the best validation F1, :class:`ProbeReport` tabulates and plots, :func:`save_probe` /
   :func:`load_probe` export the chosen probe for the verifier (:class:`CopyProbe`).

On-disk format of a probe data folder (appends only, so an interrupted run resumes):

    meta.json       target, layers, kinds, d_model, max_new_tokens, min_run, chat
    index.jsonl     one line per finished prompt: id, kind, source, shard, n_prompt, n_new, n_copy,
                    prompt_ids, generated_ids
    shards/NNNNN.npz  one per prompt: ``L{layer}_{kind}`` [n_new, d] float16 (clipped to the float16
                    range), ``labels`` [n_new] int8, ``positions`` [n_new] int32 (index in prompt + answer)

No rclpy here. Runtime code never imports this module; the verifier loads ``switchsd.probe``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from wisv_ros.eval.datasets import Problem, load_humaneval, read_jsonl
from wisv_ros.eval.scoring import roc_auc
from wisv_ros.sd.drafting import encode_prompt
from wisv_ros.sd.lm import LAYER_KINDS, CausalLM
from wisv_ros.sd.rounds import generate_target_only
from wisv_ros.switchsd.probe import SIDECAR_FORMAT, CopyProbe, _sidecar, _sigmoid, load_probe

__all__ = [
    "PROMPT_KINDS",
    "CopyProbe",
    "LayerResult",
    "ProbeData",
    "ProbeReport",
    "RepetitionPrompt",
    "best_f1_threshold",
    "build_repetition_prompts",
    "collect_probe_data",
    "copy_labels",
    "evaluate",
    "feature_key",
    "load_probe",
    "load_probe_data",
    "save_probe",
    "select_layer",
    "split_by_source",
    "split_three_by_source",
    "train_layers",
    "train_probe",
]

_F16_MAX = float(np.finfo(np.float16).max)


# --------------------------------------------------------------------------- labels


def copy_labels(ids: Sequence[int], start: int, min_run: int = 5) -> np.ndarray:
    """Copy-mode labels (int8, 0/1) of the tokens ``ids[start:]``.

    Y = 1 at a token that lies in a verbatim run of >= ``min_run`` tokens which also occurs earlier in
    ``ids``: the earlier occurrence starts before the run starts (the two may overlap). The whole of
    ``ids`` is the context, so a run copied from the prompt counts.

    Such a run exists around token j iff some window of exactly ``min_run`` tokens covering j occurred
    before (every window of a longer repeated run repeats too). So: find the windows whose n-gram has an
    earlier first occurrence (one ``np.unique`` over the windows, O(n log n)), then mark the tokens the
    marked windows cover (a difference array, O(n)).

    Example (min_run = 3; positions 0..9)::

        ids    = [5, 1, 2, 3, 9, 1, 2, 3, 1, 2]
        labels = [0, 0, 0, 0, 0, 1, 1, 1, 0, 0]   # copy_labels(ids, 0, 3)

    (1, 2, 3) at 5..7 repeats 1..3, which itself is a first occurrence (0); the trailing (1, 2) is
    only 2 tokens long and the windows (2, 3, 1) and (3, 1, 2) never occurred before, so 8, 9 are 0.
    ``copy_labels(ids, 5, 3)`` returns the last five: ``[1, 1, 1, 0, 0]``.
    """
    if min_run < 1:
        raise ValueError(f"min_run must be >= 1 (got {min_run})")
    n = len(ids)
    if not 0 <= start <= n:
        raise ValueError(f"start={start} outside [0, {n}]")
    out = np.zeros(n - start, dtype=np.int8)
    if n < min_run + 1:  # a repeat needs two windows
        return out
    arr = np.asarray(ids, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(arr, min_run)  # [n - min_run + 1, min_run]
    _, first, inverse = np.unique(windows, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    repeated = first[inverse] < np.arange(windows.shape[0])  # window a occurred at some a' < a
    # Token j is covered by a repeated window a iff a <= j < a + min_run.
    diff = np.zeros(n + 1, dtype=np.int64)
    starts = np.flatnonzero(repeated)
    np.add.at(diff, starts, 1)
    np.add.at(diff, starts + min_run, -1)
    covered = np.cumsum(diff[:n]) > 0
    out[:] = covered[start:]
    return out


# --------------------------------------------------------------------------- prompts

#: The prompt kinds, taking turns in this order: code edits ("rename", "annotate"), "quote",
#: "explain" (the non-copy control), "excerpt" (answer with sentences quoted from the docstring)
#: and "turns" (a two-turn chat, MT-Bench style, whose second request makes the model repeat its
#: first answer with a change). The shipped probe was trained on all six.
PROMPT_KINDS = ("rename", "annotate", "quote", "explain", "excerpt", "turns")

_RENAMES = ("{f}_v2", "new_{f}", "{f}_impl", "compute_{f}", "{camel}")
_ANNOTATE = (
    "Add type hints to every function signature in this code, keep everything else unchanged, "
    "and return the whole code.",
    "Add a comment line above every `return` statement saying what is returned, and repeat the "
    "rest of the code unchanged.",
    "Add input validation at the start of `{f}` that raises ValueError on invalid arguments, and "
    "return the whole code.",
)
_EXCERPT = (
    "Answer only with sentences quoted verbatim from the docstring of `{f}`: what does it take and "
    "what does it return?",
    "Which sentences of the docstring of `{f}` describe its result? Quote them exactly, one per line.",
)
_TURN_CHANGES = (
    "Now rename `{f}` to `{g}` and return the whole code again.",
    "Now add a one-line comment above the function and return the whole code again, otherwise unchanged.",
)
_EXPLAIN = (
    "Explain in your own words what this code does and how it works. Do not quote or repeat any code.",
    "Describe the algorithm of `{f}` as a short numbered list of steps in plain English, without code.",
    "What is the time complexity of `{f}`? Answer briefly in words, without repeating the code.",
)


@dataclasses.dataclass(frozen=True)
class RepetitionPrompt:
    """One collection prompt.

    id:     unique and stable for a seed (``"rename/HumanEval/12"``); collection resumes by it.
    kind:   one of PROMPT_KINDS, or any tag for hand-made prompts.
    prompt: chat messages ``[{"role": "user", "content": ...}]``, or token ids (tiny test models).
    source: the problem it was made from; train/validation splits keep a source on one side.
    """

    id: str
    kind: str
    prompt: list[dict] | list[int]
    source: str = ""


def _code(problem: Problem) -> str:
    return problem.prompt + problem.extra["canonical_solution"]


def _fenced(code: str) -> str:
    return "```python\n" + code.rstrip("\n") + "\n```"


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest) if rest else name + "Fn"


def _quote_request(code: str, solution: str, f: str, rng: np.random.Generator) -> str:
    """Ask for one line of the solution verbatim, named by a fragment that occurs once in the code."""
    lines = [ln.strip() for ln in solution.splitlines() if len(ln.strip()) >= 12 and len(ln.split()) >= 3]
    for i in rng.permutation(len(lines)):
        words = lines[i].split()
        fragment = " ".join(words[: max(2, len(words) // 2)])  # a part of the line, not all of it
        if len(fragment) >= 6 and code.count(fragment) == 1:
            return f"Quote verbatim the line of this code that contains `{fragment}`, then explain it in one sentence."
    return f"Quote the docstring of `{f}` verbatim, then say in one sentence whether the code does what it promises."


def _request(problem: Problem, kind: str, rng: np.random.Generator) -> str:
    code = _code(problem)
    f = problem.extra["entry_point"]
    if kind == "rename":
        g = str(rng.choice(_RENAMES)).format(f=f, camel=_camel(f))
        text = f"Rename the function `{f}` to `{g}` (and every call of it) and return the whole code."
    elif kind == "annotate":
        text = str(rng.choice(_ANNOTATE)).format(f=f)
    elif kind == "quote":
        text = _quote_request(code, problem.extra["canonical_solution"], f, rng)
    elif kind == "explain":
        text = str(rng.choice(_EXPLAIN)).format(f=f)
    elif kind == "excerpt":
        text = str(rng.choice(_EXCERPT)).format(f=f)
    else:
        raise ValueError(f"prompt kind '{kind}' is not one of {PROMPT_KINDS}")
    return f"{_fenced(code)}\n\n{text}"


def _turns(problem: Problem, rng: np.random.Generator) -> list[dict]:
    """A two-turn chat: the task, the canonical solution as the assistant's answer, a change request."""
    f = problem.extra["entry_point"]
    g = str(rng.choice(_RENAMES)).format(f=f, camel=_camel(f))
    return [{"role": "user", "content": f"Complete this Python function:\n\n{_fenced(problem.prompt)}"},
            {"role": "assistant", "content": _fenced(_code(problem))},
            {"role": "user", "content": str(rng.choice(_TURN_CHANGES)).format(f=f, g=g)}]


def build_repetition_prompts(n: int, seed: int = 0, kinds: Sequence[str] = PROMPT_KINDS,
                             problems: Sequence[Problem] | None = None) -> list[RepetitionPrompt]:
    """``n`` chat prompts with repetition structure from HumanEval canonical solutions.

    Kinds take turns (prompt i has kind ``kinds[i % len(kinds)]``), so every prefix of the list is
    balanced; each kind walks through the problems in its own seeded order, so at most
    ``len(problems) * len(kinds)`` distinct prompts exist. The same seed gives the same list.
    The "explain" controls are not all Y = 0: naming an identifier of >= 5 tokens is a verbatim copy
    under the label, and small models repeat code anyway (SmolLM2-135M: about half of its tokens).
    """
    problems = list(problems) if problems is not None else load_humaneval()
    if not kinds:
        raise ValueError("kinds must not be empty")
    limit = len(problems) * len(kinds)
    if not 0 <= n <= limit:
        raise ValueError(f"n={n} outside [0, {limit}] ({len(problems)} problems x {len(kinds)} kinds)")
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(len(problems)) for _ in kinds]
    out = []
    for i in range(n):
        k = i % len(kinds)
        problem = problems[int(orders[k][i // len(kinds)])]
        kind = kinds[k]
        # One generator per prompt: a prompt does not change when n changes.
        prng = np.random.default_rng([seed, k, i // len(kinds)])
        messages = (_turns(problem, prng) if kind == "turns"
                    else [{"role": "user", "content": _request(problem, kind, prng)}])
        out.append(RepetitionPrompt(id=f"{kind}/{problem.id}", kind=kind, prompt=messages, source=problem.id))
    return out


# --------------------------------------------------------------------------- collection


def feature_key(layer: int, kind: str) -> str:
    """Array name of a captured layer in a shard: ``L14_post_attn``."""
    return f"L{layer}_{kind}"


def _model_name(lm: CausalLM) -> str:
    return str(getattr(lm.model.config, "_name_or_path", "") or type(lm.model).__name__)


def collect_probe_data(
    lm: CausalLM | Callable[[list[tuple[int, str]]], CausalLM],
    prompts: Sequence[RepetitionPrompt],
    layers: Sequence[int],
    kinds: Sequence[str],
    max_new_tokens: int,
    out_folder: str | Path,
    *,
    min_run: int = 5,
    chat: bool = True,
    target_name: str | None = None,
    progress: Callable[[Iterable], Iterable] = lambda it: it,
) -> list[dict]:
    """Complete each prompt with the target greedily and store captured hiddens + copy labels.

    Args:
        lm: the target, or a factory ``capture -> CausalLM``. A CausalLM that does not capture the
            requested layers is wrapped once by a new CausalLM on the same model with the capture
            hooks (hooks stay on the model).
        prompts: the prompts; ids already in ``out_folder/index.jsonl`` are skipped (resume).
        layers, kinds: the (layer, kind) pairs to store, every layer with every kind.
        max_new_tokens: completion length limit (generation also stops at end-of-sequence).
        min_run: the label's minimum verbatim run (:func:`copy_labels`).
        chat: apply the chat template to text prompts (message lists always use it).
        target_name: recorded in meta.json and checked on resume (default: the model's config name).
        progress: wraps the iterable of prompts still to do (e.g. ``tqdm``).

    Returns the index lines of all prompts in the folder (old and new).
    """
    capture = [(int(layer), kind) for layer in layers for kind in kinds]
    if not capture:
        raise ValueError("nothing to capture: give at least one layer and one kind")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    if isinstance(lm, CausalLM):
        base = lm
        for layer, kind in capture:  # validate before any work (same checks as CausalLM)
            if kind not in LAYER_KINDS or not 0 <= layer < lm.num_layers:
                raise ValueError(f"cannot capture ({layer}, {kind!r}): layers 0..{lm.num_layers - 1}, kinds {LAYER_KINDS}")
    else:
        base = lm(capture)
    folder = Path(out_folder)
    (folder / "shards").mkdir(parents=True, exist_ok=True)
    meta = {"target": target_name or _model_name(base), "layers": sorted({c[0] for c in capture}),
            "kinds": list(dict.fromkeys(kinds)), "d_model": base.hidden_size,
            "max_new_tokens": max_new_tokens, "min_run": min_run, "chat": chat}
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        for key in ("target", "layers", "kinds", "d_model", "min_run"):
            if old.get(key) != meta[key]:
                raise ValueError(f"{meta_path}: {key} is {old.get(key)!r}, this run has {meta[key]!r}; "
                                 "use another output folder or the same settings")
    else:
        meta_path.write_text(json.dumps(meta, indent=1))
    index = read_jsonl(folder / "index.jsonl")
    done = {row["id"] for row in index}
    if len({p.id for p in prompts}) != len(prompts):
        raise ValueError("prompt ids must be unique (collection resumes by id)")
    capturing = base  # becomes a capturing CausalLM on the same model if ``lm`` does not capture
    for p in progress([p for p in prompts if p.id not in done]):
        prompt_ids = encode_prompt(base.tokenizer, p.prompt, chat)
        gen = generate_target_only(base, prompt_ids, max_new_tokens)
        base.reset()
        ids = prompt_ids + gen.token_ids
        capturing.reset()
        step = capturing.feed(ids, n_logits=1)  # ONE forward over prompt + completion
        if any(c not in step.layers for c in capture):
            if capturing is not base or not isinstance(lm, CausalLM):
                raise ValueError(f"the CausalLM does not capture all of {capture}")
            capturing = CausalLM(base.model, base.tokenizer, capture=capture)
            step = capturing.feed(ids, n_logits=1)
        capturing.reset()
        n_prompt = len(prompt_ids)
        arrays = {feature_key(layer, kind): np.clip(step.layers[(layer, kind)][n_prompt:].numpy(), -_F16_MAX, _F16_MAX)
                  .astype(np.float16) for layer, kind in capture}
        labels = copy_labels(ids, n_prompt, min_run)
        shard = f"shards/{len(index):05d}.npz"
        # Shard first, then the index line: a crash in between leaves an orphan shard that the
        # redo of the prompt overwrites (same counter).
        np.savez(folder / shard, labels=labels, positions=np.arange(n_prompt, len(ids), dtype=np.int32), **arrays)
        row = {"id": p.id, "kind": p.kind, "source": p.source, "shard": shard, "n_prompt": n_prompt,
               "n_new": len(gen.token_ids), "n_copy": int(labels.sum()), "prompt_ids": prompt_ids,
               "generated_ids": gen.token_ids}
        with (folder / "index.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        index.append(row)
    return index


# --------------------------------------------------------------------------- loading and splits


@dataclasses.dataclass
class ProbeData:
    """A probe data folder: the index in memory, feature arrays read on demand (one key at a time).

    Rows are the completion tokens of all prompts in index order; ``prompt_row[r]`` is the index line
    of row r.
    """

    folder: Path
    meta: dict
    index: list[dict]
    labels: np.ndarray  # [n] int8
    prompt_row: np.ndarray  # [n] int64

    def features(self, layer: int, kind: str, rows: np.ndarray | None = None) -> np.ndarray:
        """Hidden states [n or len(rows), d] float16 of one (layer, kind), rows in index order."""
        key = feature_key(layer, kind)
        parts = []
        for row in self.index:
            with np.load(self.folder / row["shard"]) as z:
                if key not in z.files:
                    raise KeyError(f"{self.folder / row['shard']} has no {key}; stored: {', '.join(self.keys())}")
                parts.append(z[key])
        x = np.concatenate(parts) if parts else np.zeros((0, self.meta["d_model"]), np.float16)
        return x if rows is None else x[rows]

    def keys(self) -> list[tuple[int, str]]:
        """The stored (layer, kind) pairs."""
        return [(layer, kind) for layer in self.meta["layers"] for kind in self.meta["kinds"]]


def load_probe_data(folder: str | Path) -> ProbeData:
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} missing: collect data first (python -m wisv_ros.cli.probe collect)")
    meta = json.loads(meta_path.read_text())
    index = list({row["id"]: row for row in read_jsonl(folder / "index.jsonl")}.values())
    labels, owner = [], []
    for i, row in enumerate(index):
        with np.load(folder / row["shard"]) as z:
            labels.append(z["labels"])
        owner.append(np.full(len(labels[-1]), i, dtype=np.int64))
    return ProbeData(folder=folder, meta=meta, index=index,
                     labels=np.concatenate(labels) if labels else np.zeros(0, np.int8),
                     prompt_row=np.concatenate(owner) if owner else np.zeros(0, np.int64))


def _sources(data: ProbeData, minimum: int, what: str) -> list[str]:
    """The source problems of ``data`` (a prompt's ``source``, else its id), sorted."""
    sources = sorted({row.get("source") or row["id"] for row in data.index})
    if len(sources) < minimum:
        raise ValueError(f"need prompts from at least {minimum} sources to {what}, found {len(sources)}")
    return sources


def _rows_by_part(data: ProbeData, part: dict[str, int], n_parts: int) -> tuple[np.ndarray, ...]:
    """Row indices per part; ``part`` maps a source to its part (missing: part 0)."""
    prompt_part = np.array([part.get(row.get("source") or row["id"], 0) for row in data.index], dtype=np.int64)
    row_part = prompt_part[data.prompt_row] if len(data.prompt_row) else np.zeros(0, np.int64)
    return tuple(np.flatnonzero(row_part == k) for k in range(n_parts))


def split_by_source(data: ProbeData, val_share: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (train, validation) with every source problem on one side only.

    Prompts made from the same HumanEval problem share their code, so a token-level split would leak.
    At least one source goes to each side (two sources needed).
    """
    if not 0 < val_share < 1:
        raise ValueError(f"val_share must be in (0, 1) (got {val_share})")
    sources = _sources(data, 2, "split")
    order = np.random.default_rng(seed).permutation(len(sources))
    n_val = min(len(sources) - 1, max(1, int(round(val_share * len(sources)))))
    return _rows_by_part(data, {sources[i]: 1 for i in order[:n_val]}, 2)  # type: ignore[return-value]


def split_three_by_source(data: ProbeData, val_share: float = 0.2, test_share: float = 0.2,
                          seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row indices (train, validation, test), every source problem on one side only.

    The layer and the threshold are chosen on validation, so validation metrics of the chosen probe
    are optimistic; the test rows are touched once, by the chosen probe. Each part gets at least one
    source (three sources needed).
    """
    if not (0 < val_share < 1 and 0 < test_share < 1 and val_share + test_share < 1):
        raise ValueError(f"val_share and test_share must be in (0, 1) with a sum < 1 (got {val_share}, {test_share})")
    sources = _sources(data, 3, "split three ways")
    order = np.random.default_rng(seed).permutation(len(sources))
    n_test = min(len(sources) - 2, max(1, int(round(test_share * len(sources)))))
    n_val = min(len(sources) - 1 - n_test, max(1, int(round(val_share * len(sources)))))
    part = {sources[i]: 2 for i in order[:n_test]}
    part.update({sources[i]: 1 for i in order[n_test:n_test + n_val]})
    return _rows_by_part(data, part, 3)  # type: ignore[return-value]


# --------------------------------------------------------------------------- probes

_SCALE_FLOOR = 1e-6  # a feature with a smaller RMS is left unscaled


def train_probe(X: np.ndarray, y: np.ndarray, *, l2: float = 1e-3, max_iter: int = 100,
                max_rows: int | None = None, seed: int = 0) -> np.ndarray:
    """Bias-free logistic regression ``p = sigmoid(wᵀh)``; returns w [d] float32 for RAW hidden states.

    Loss: mean BCE + ``l2 / 2 * |v|²``, minimised by full-batch LBFGS (strong Wolfe line search) in
    float32 from v = 0 (deterministic).

    Scaling: residual streams have a few huge dimensions, which makes the problem badly conditioned,
    so features are divided by their RMS s (no centring: centring would need a bias). The probe is
    trained on z = h / s with weights v, and ``w = v / s`` is returned, so ``wᵀh = vᵀz`` exactly and
    the exported probe needs no normalisation. The L2 penalty acts on v, i.e. on ``w * s``.

    max_rows: train on a random subset of at most this many rows (chosen with ``seed``); None = all.
    """
    x = np.asarray(X)
    t = np.asarray(y).astype(np.float32).ravel()
    if x.ndim != 2 or x.shape[0] != t.shape[0] or x.shape[0] == 0:
        raise ValueError(f"X must be [n, d] and y [n] with n > 0; got {x.shape} and {t.shape}")
    if l2 < 0 or max_iter < 1:
        raise ValueError(f"l2 must be >= 0 and max_iter >= 1 (got {l2}, {max_iter})")
    if max_rows is not None and x.shape[0] > max_rows:
        rows = np.sort(np.random.default_rng(seed).choice(x.shape[0], size=max_rows, replace=False))
        x, t = x[rows], t[rows]
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    tt = torch.from_numpy(t)
    scale = xt.pow(2).mean(dim=0).sqrt()
    scale = torch.where(scale < _SCALE_FLOOR, torch.ones_like(scale), scale)
    z = xt / scale
    v = torch.zeros(z.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([v], lr=1.0, max_iter=max_iter, history_size=20, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-7, tolerance_change=1e-10)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ v, tt) + 0.5 * l2 * (v @ v)
        loss.backward()
        return loss

    opt.step(closure)
    return (v.detach() / scale).numpy().astype(np.float32)


def best_f1_threshold(scores: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(best F1, threshold) over all cut points of ``score >= threshold``; O(n log n).

    The threshold is the midpoint between the lowest score called positive and the next lower score
    (the lowest score itself when everything is positive). No positive label: (0.0, inf).

    >>> best_f1_threshold(np.array([0.9, 0.8, 0.3, 0.1]), np.array([1, 0, 1, 0]))
    (0.8, 0.2)
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    lab = np.asarray(labels).ravel().astype(bool)
    n_pos = int(lab.sum())
    if n_pos == 0 or s.size == 0:
        return 0.0, math.inf
    order = np.argsort(-s, kind="stable")
    ss, ys = s[order], lab[order]
    tp = np.cumsum(ys)
    called = np.arange(1, s.size + 1)
    ends = np.flatnonzero(np.r_[ss[1:] != ss[:-1], True])  # cut only after a group of equal scores
    f1 = 2.0 * tp[ends] / (called[ends] + n_pos)
    i = int(ends[int(np.argmax(f1))])
    threshold = ss[i] if i == s.size - 1 else 0.5 * (ss[i] + ss[i + 1])
    if i < s.size - 1 and threshold <= ss[i + 1]:  # adjacent floats: no midpoint
        threshold = ss[i]
    return round(float(f1.max()), 12), float(threshold)




def evaluate(w: np.ndarray, X: np.ndarray, y: np.ndarray, threshold: float | None = None) -> dict[str, float]:
    """Metrics of a probe on (X, y).

    Always: ``auc``, ``best_f1`` and ``best_threshold`` (a probability; choose it on validation data),
    ``n`` and ``positive_rate``. With ``threshold``: also ``f1``, ``precision`` and ``recall`` of
    ``p >= threshold`` (e.g. on a test split with the validation threshold).
    Ranking and the threshold search use the logits (no ties from a saturated sigmoid).
    """
    logits = np.asarray(X, dtype=np.float64) @ np.asarray(w, dtype=np.float64)
    lab = np.asarray(y).ravel().astype(bool)
    f1, thr_logit = best_f1_threshold(logits, lab)
    out = {"auc": roc_auc(logits, lab), "best_f1": f1, "best_threshold": float(_sigmoid(thr_logit)),
           "n": int(lab.size), "positive_rate": float(lab.mean()) if lab.size else math.nan}
    if threshold is not None:
        called = _sigmoid(logits) >= threshold
        tp = int((called & lab).sum())
        precision = tp / int(called.sum()) if called.any() else 0.0
        recall = tp / int(lab.sum()) if lab.any() else 0.0
        out.update(f1=2 * precision * recall / (precision + recall) if tp else 0.0,
                   precision=precision, recall=recall)
    return out


@dataclasses.dataclass
class LayerResult:
    """One trained probe and its metrics (threshold chosen by F1 on validation)."""

    layer: int
    kind: str
    w: np.ndarray  # [d] float32, for raw hidden states
    train_auc: float
    val_auc: float
    val_f1: float
    threshold: float  # probability threshold maximising validation F1
    n_train: int
    n_val: int
    val_positive_rate: float

    def summary(self) -> dict[str, Any]:
        """The metrics without the weights (JSON-serialisable)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "w"}


def select_layer(results: Sequence[LayerResult]) -> LayerResult:
    """The probe with the best validation F1 (ties: higher validation AUC, then the lower layer)."""
    if not results:
        raise ValueError("no probe results to choose from")

    def key(r: LayerResult) -> tuple[float, float, int]:
        auc = r.val_auc if not math.isnan(r.val_auc) else -1.0
        return (r.val_f1, auc, -r.layer)

    return max(results, key=key)


@dataclasses.dataclass
class ProbeReport:
    """Per-(layer, kind) results with the chosen probe, as a table, JSON and a PNG plot."""

    results: list[LayerResult]

    @property
    def best(self) -> LayerResult:
        return select_layer(self.results)

    def table(self) -> str:
        """A Markdown table, one row per (layer, kind); the chosen probe is marked with *."""
        best = self.best
        lines = ["| layer | kind | train AUC | val AUC | val F1 | threshold | n train | n val | val Y=1 |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(self.results, key=lambda r: (r.layer, r.kind)):
            mark = " *" if r is best else ""
            lines.append(f"| {r.layer}{mark} | {r.kind} | {r.train_auc:.4f} | {r.val_auc:.4f} | {r.val_f1:.4f} | "
                         f"{r.threshold:.3f} | {r.n_train} | {r.n_val} | {r.val_positive_rate:.3f} |")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {"best": {"layer": best.layer, "kind": best.kind}, "results": [r.summary() for r in self.results]}

    def plot(self, path: str | Path, title: str = "copy probe") -> Path:
        """Validation AUC and F1 per layer, one line per kind, the chosen probe circled; PNG (Agg)."""
        from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed

        fig = Figure(figsize=(9, 3.6), dpi=110)
        best = self.best
        for ax, metric, label in zip(fig.subplots(1, 2), ("val_auc", "val_f1"), ("validation AUC", "validation F1")):
            for kind in dict.fromkeys(r.kind for r in self.results):
                rs = sorted((r for r in self.results if r.kind == kind), key=lambda r: r.layer)
                ax.plot([r.layer for r in rs], [getattr(r, metric) for r in rs], marker="o", label=kind)
            ax.plot([best.layer], [getattr(best, metric)], marker="o", markersize=13, fillstyle="none",
                    color="black", linestyle="none", label=f"chosen (L{best.layer} {best.kind})")
            ax.set_xlabel("layer")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        fig.axes[0].legend(loc="lower right", fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
        return path


def train_layers(data: ProbeData, train_rows: np.ndarray, val_rows: np.ndarray, *,
                 keys: Sequence[tuple[int, str]] | None = None, l2: float = 1e-3, max_iter: int = 100,
                 max_rows: int | None = None, seed: int = 0,
                 progress: Callable[[Iterable], Iterable] = lambda it: it) -> ProbeReport:
    """Train and evaluate one probe per stored (layer, kind) (or per ``keys``); see :func:`train_probe`."""
    y = data.labels
    y_tr, y_val = y[train_rows], y[val_rows]
    for name, part in (("training", y_tr), ("validation", y_val)):
        if part.size == 0 or part.min() == part.max():
            raise ValueError(f"the {name} rows need both labels (got {part.size} rows, {int(part.sum())} with Y=1); "
                             "collect more prompts or use other kinds")
    results = []
    for layer, kind in progress(list(keys) if keys is not None else data.keys()):
        x = data.features(layer, kind)
        x_tr, x_val = x[train_rows].astype(np.float32), x[val_rows].astype(np.float32)
        del x
        w = train_probe(x_tr, y_tr, l2=l2, max_iter=max_iter, max_rows=max_rows, seed=seed)
        tr = evaluate(w, x_tr, y_tr)
        va = evaluate(w, x_val, y_val)
        results.append(LayerResult(layer=layer, kind=kind, w=w, train_auc=tr["auc"], val_auc=va["auc"],
                                   val_f1=va["best_f1"], threshold=va["best_threshold"], n_train=len(y_tr),
                                   n_val=len(y_val), val_positive_rate=va["positive_rate"]))
    return ProbeReport(results)


# --------------------------------------------------------------------------- export




def save_probe(path: str | Path, w: np.ndarray, layer: int, kind: str, threshold: float,
               meta: dict[str, Any] | None = None) -> Path:
    """Write the probe to ``path`` (.npz: ``w`` [d] float32) and a JSON sidecar; return the sidecar.

    The sidecar holds ``format``, ``npz``, ``layer``, ``kind``, ``threshold``, ``d_model``, then the
    caller's ``meta`` (target model, command line, metrics; JSON-serialisable; may repeat a generated
    key only with the same value).
    """
    path = Path(path)
    if path.suffix != ".npz":
        raise ValueError(f"probe path must end in .npz (got {path})")
    if kind not in LAYER_KINDS:
        raise ValueError(f"kind '{kind}' is not one of {LAYER_KINDS}")
    w = np.asarray(w, dtype=np.float32).ravel()
    info: dict[str, Any] = {"format": SIDECAR_FORMAT, "npz": path.name, "layer": int(layer), "kind": kind,
                            "threshold": float(threshold), "d_model": int(w.size)}
    for key, value in (meta or {}).items():
        if key in info and info[key] != value:
            raise ValueError(f"meta[{key!r}] = {value!r} contradicts the probe ({info[key]!r})")
        info[key] = value
    text = json.dumps(info, indent=2)  # fail before writing anything if meta is not JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, w=w)
    side = _sidecar(path)
    side.write_text(text + "\n", encoding="utf-8")
    return side




