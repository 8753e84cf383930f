"""A llama.cpp model behind the ``CausalLM`` contract (GGUF weights run as they are, no dequantising).

``LlamaCppLM`` offers what speculative decoding needs from a model -- ``feed``, ``rollback``,
``sync``, ``cached``, captured layers -- on llama.cpp's low-level API (``llama_cpp`` of
llama-cpp-python), so the drafter or the target can run quantised at llama.cpp's speed while the
rest of the project stays unchanged. How each piece maps onto llama.cpp:

* one sequence holds the committed tokens; ``rollback(n)`` is ``llama_memory_seq_rm(seq, n, -1)``.
  With ``n_sessions`` > 1 each session (e.g. each robot's request on the edge) keeps its own
  sequence, chosen by ``use(session)``: switching between sessions costs nothing, where one shared
  sequence would roll back and prefill the other session's context again. The sessions share the
  ``n_ctx`` cells of the (unified) cache;
* hidden states: the context runs with ``embeddings`` on and pooling NONE, so every fed token is an
  output and ``llama_get_embeddings_ith`` is the final-norm hidden state the logits come from;
* captured layers: an eval callback copies the graph nodes ``l_out-<layer>`` (``post_mlp``, the
  layer's output) and ``ffn_inp-<layer>`` (``post_attn``, the residual stream after self-attention,
  the input of the MLP's pre-norm), the names llama.cpp's qwen2/llama graphs give them;
* ``feed_candidates``: SwitchSD's tree verification. The prefix is shared with sequences 1..W
  (``llama_memory_seq_cp``, free in a unified cache), the pending committed tokens belong to every
  sequence, the candidates' tokens to their own sequence (a trie: a token shared by several
  candidates is computed once); afterwards the candidate sequences are dropped.

The tokenizer is the Hugging Face one read from the same GGUF file, so prompts and chat templates
are identical to the torch backend's. Reading it from the GGUF takes 10-15 s (transformers parses
every metadata field in Python); ``models.gguf_tokenizer`` saves it once into the model cache, after which a
load takes under a second.

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import sys
import weakref
from pathlib import Path
from typing import Callable, Hashable, Iterator, Sequence

import numpy as np
import torch

from wisv_ros.sd.lm import LAYER_KINDS, CacheSync, Step

__all__ = ["BranchTrace", "LlamaCppLM", "NODE_NAMES"]

#: llama.cpp graph node of each capture kind (``<name>-<layer>``; qwen2 and llama graphs).
NODE_NAMES = {"post_attn": "ffn_inp", "post_mlp": "l_out"}

_AUTO = object()  # tokenizer argument default: read it from the GGUF file


@dataclasses.dataclass
class BranchTrace:
    """What the model computed along one finished branch of ``branch_pool(trace_top=n)``.

    Row i is the pass over ``fed[i]`` (at cache position ``p + i``), the row that predicts the
    token after it: its final-norm hidden state, the log-sum-exp of its logits, the entropy of its
    distribution (nats) and its ``n`` largest logits with their token ids, largest first. ``fed``
    is the branch token followed by the continuation's tokens that were fed (all but the last,
    and the last too when the branch ended at an end-of-sequence token). While the pool holds the
    branch (until the consumer asks for its next item) ``adopt`` can move its cells into a
    session."""

    seq: int
    p: int
    fed: list[int]
    hidden: np.ndarray
    logsumexp: np.ndarray
    entropy: np.ndarray
    top_ids: np.ndarray
    top_logits: np.ndarray
    alive: bool = True
_initialised = False
_ggml = None


_GGML_LOG_WARN, _GGML_LOG_CONT = 3, 5  # enum ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT
_log_state = {"level": 0, "callback": None}


def _log_callback(llama_cpp):
    """A llama.cpp log callback writing warnings and errors to stderr (kept alive in _log_state)."""
    def log(level, text, _user_data):
        if level != _GGML_LOG_CONT:
            _log_state["level"] = level
        if _log_state["level"] >= _GGML_LOG_WARN and text:
            sys.stderr.write(text.decode("utf-8", errors="replace"))

    _log_state["callback"] = llama_cpp.llama_log_callback(log)
    return _log_state["callback"]


def _backend():
    """The ``llama_cpp`` module and ggml-base functions, initialised once per process."""
    global _initialised, _ggml
    import llama_cpp

    if not _initialised:
        # llama.cpp logs every load detail; keep its warnings and errors only. (llama-cpp-python's
        # own log callback maps ggml's levels off by one, so its logger level cannot do this.)
        llama_cpp.llama_log_set(_log_callback(llama_cpp), ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
        lib.ggml_get_name.argtypes = [ctypes.c_void_p]
        lib.ggml_get_name.restype = ctypes.c_char_p
        lib.ggml_nelements.argtypes = [ctypes.c_void_p]
        lib.ggml_nelements.restype = ctypes.c_int64
        lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
        lib.ggml_nbytes.restype = ctypes.c_size_t
        lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
        lib.ggml_is_contiguous.restype = ctypes.c_bool
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        lib.ggml_backend_tensor_get.restype = None
        _ggml = lib
        _initialised = True
    return llama_cpp, _ggml


class LlamaCppLM(CacheSync):
    """A GGUF model run by llama.cpp, with one KV cache and one explicit rollback (see ``CausalLM``).

    Args:
        path: the GGUF file.
        n_ctx: KV cache cells, shared by the committed sequence and the copy candidates.
        threads: CPU threads for one-token and batch decoding.
        capture: decoder layers to capture, as (layer index, kind) with kind in LAYER_KINDS.
        n_seq_max: sequences of the cache; ``feed_candidates`` takes up to ``n_seq_max - n_sessions``
            candidates.
        n_sessions: sequences kept for separate contexts (``use``); the first ``n_sessions`` of
            ``n_seq_max``.
        n_batch: tokens per ``llama_decode``; longer feeds run as several decodes (each fed token is
            an output, so this also bounds the logits buffer: n_batch x vocab floats).
        tokenizer: a tokenizer to use instead of reading it from the GGUF file (None: no tokenizer).
        gpu_layers: layers offloaded to a GPU (-1: all) with a CUDA build of llama-cpp-python
            (docs/engines.md); 0 on a CPU build.
        extra_bufts: let llama.cpp repack weights into its extra CPU buffer types (CPU_REPACK: the
            AVX2/AVX512 kernels for Q4_K; 1.5x faster decoding here). tools/setup.sh builds
            llama.cpp without its AMX kernels: with them (a GGML_NATIVE build on a CPU with AMX) the
            AMX buffer type crashed the process on the first decode in the VMs here (general
            protection fault in ldtilecfg); with such a build pass False.
    """

    def __init__(self, path: str | Path, *, n_ctx: int = 4096, threads: int = 1,
                 capture: Sequence[tuple[int, str]] = (), n_seq_max: int = 9, n_batch: int = 512,
                 tokenizer=_AUTO, extra_bufts: bool = True, gpu_layers: int = 0, n_sessions: int = 1):
        L, _ = _backend()
        self._L = L
        self._model = None
        self._ctx = None
        self._batch = None
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        if n_seq_max < 1 or n_ctx < 1 or n_batch < 1 or threads < 1:
            raise ValueError(f"n_ctx, threads, n_seq_max and n_batch must be >= 1 (got {n_ctx}, {threads}, {n_seq_max}, {n_batch})")
        if not 1 <= n_sessions <= n_seq_max:
            raise ValueError(f"n_sessions must be in [1, n_seq_max={n_seq_max}] (got {n_sessions})")
        self.path = path
        self.n_ctx = int(n_ctx)
        self.n_seq_max = int(n_seq_max)
        self.n_batch = int(min(n_batch, n_ctx))
        self.n_sessions = int(n_sessions)
        self._seq = 0  # the session sequence in use
        self._cached: list[list[int]] = [[] for _ in range(self.n_sessions)]  # token ids per session, in order
        self.forward_passes = 0
        self.capture = tuple((int(layer), str(kind)) for layer, kind in capture)
        for _, kind in self.capture:
            if kind not in LAYER_KINDS:
                raise ValueError(f"capture kind '{kind}' is not one of {LAYER_KINDS}")

        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = int(gpu_layers)
        mparams.use_extra_bufts = bool(extra_bufts)
        model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self._model = model
        self._vocab = L.llama_model_get_vocab(model)
        self._d = int(L.llama_model_n_embd(model))
        self._n_layer = int(L.llama_model_n_layer(model))
        self._n_vocab = int(L.llama_vocab_n_tokens(self._vocab))

        self._nodes: dict[bytes, tuple[int, str]] = {}
        for layer, kind in self.capture:
            if not 0 <= layer < self._n_layer:
                self.close()
                raise ValueError(f"capture layer {layer} outside [0, {self._n_layer - 1}]")
            self._nodes[f"{NODE_NAMES[kind]}-{layer}".encode()] = (layer, kind)
        self._chunks: dict[tuple[int, str], list[np.ndarray]] = {}
        self._cb_error: BaseException | None = None

        cparams = L.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = self.n_seq_max
        cparams.n_outputs_max = 0  # = n_batch: every fed token is an output
        cparams.n_outputs_max_per_seq = 0
        cparams.n_threads = int(threads)
        cparams.n_threads_batch = int(threads)
        cparams.embeddings = True
        cparams.pooling_type = L.LLAMA_POOLING_TYPE_NONE
        cparams.kv_unified = True  # candidates share the prefix's cells
        cparams.no_perf = True
        if self._nodes:
            # Keep a reference: llama.cpp calls it during every decode. A weak reference to self
            # keeps the object out of a reference cycle, so that dropping it frees the model.
            this = weakref.ref(self)

            def on_eval(tensor, ask, user_data):
                lm = this()
                return lm._on_eval(tensor, ask, user_data) if lm is not None else False

            self._cb = L.ggml_backend_sched_eval_callback(on_eval)
            cparams.cb_eval = self._cb
            cparams.cb_eval_user_data = None
        ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx {n_ctx}, n_seq_max {n_seq_max})")
        self._ctx = ctx
        self._mem = L.llama_get_memory(ctx)
        self._batch = L.llama_batch_init(self.n_batch, 0, self.n_seq_max)

        if self.capture:
            # One decode checks that the captured nodes exist in this model's graph.
            try:
                self.feed([0])
            except RuntimeError as exc:
                self.close()
                raise ValueError(f"cannot capture {self.capture}: {exc}") from exc
            self.reset()
            self.forward_passes = 0

        if tokenizer is _AUTO:
            from wisv_ros.sd.models import gguf_tokenizer

            tokenizer = gguf_tokenizer(path)
        self.tokenizer = tokenizer

    @classmethod
    def from_gguf(cls, path: str | Path, *, n_ctx: int = 4096, threads: int = 1,
                  capture: Sequence[tuple[int, str]] = (), **kwargs) -> "LlamaCppLM":
        """Open a GGUF file, or a registry model's GGUF (``wisv_ros.sd.models.gguf_path``)."""
        from wisv_ros.sd.models import gguf_path

        return cls(gguf_path(str(path)), n_ctx=n_ctx, threads=threads, capture=capture, **kwargs)

    # ------------------------------------------------------------------ properties
    @property
    def hidden_size(self) -> int:
        return self._d

    @property
    def vocab_size(self) -> int:
        """Width of the logits (the GGUF's token table, which may exceed the tokenizer's length)."""
        return self._n_vocab

    @property
    def num_layers(self) -> int:
        return self._n_layer

    def eos_ids(self) -> set[int]:
        """Token ids that end generation: the GGUF's end-of-sequence/end-of-turn and the tokenizer's."""
        ids: set[int] = set()
        for tok in (self._L.llama_vocab_eos(self._vocab), self._L.llama_vocab_eot(self._vocab)):
            if tok >= 0:
                ids.add(int(tok))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # ------------------------------------------------------------------ cache
    @property
    def cached(self) -> list[int]:
        """Token ids in the session sequence in use, in order."""
        return self._cached[self._seq]

    @cached.setter
    def cached(self, ids: list[int]) -> None:
        self._cached[self._seq] = ids

    @property
    def session(self) -> int:
        """The session sequence in use (``use``)."""
        return self._seq

    def use(self, session: int) -> None:
        """Make ``session`` (0 .. n_sessions - 1) the sequence that ``feed``, ``rollback``, ``sync``,
        ``feed_candidates`` and ``continue_branches`` work on; the others keep their cells."""
        if not 0 <= session < self.n_sessions:
            raise ValueError(f"session {session} outside [0, {self.n_sessions - 1}] (n_sessions {self.n_sessions})")
        self._seq = int(session)

    def drop(self, session: int) -> None:
        """Forget one session's context (its cells return to the cache)."""
        if not 0 <= session < self.n_sessions:
            raise ValueError(f"session {session} outside [0, {self.n_sessions - 1}] (n_sessions {self.n_sessions})")
        self._L.llama_memory_seq_rm(self._mem, session, -1, -1)
        self._cached[session] = []

    def cells_used(self) -> int:
        """Cache cells the session contexts hold (each session's tokens; shared cells counted once per session)."""
        return sum(len(c) for c in self._cached)

    def reset(self) -> None:
        """Forget everything (empty cache, every session)."""
        self._L.llama_memory_clear(self._mem, True)
        self._cached = [[] for _ in range(self.n_sessions)]

    def rollback(self, n_keep: int) -> None:
        """Keep the first ``n_keep`` cached tokens and forget the rest."""
        if not 0 <= n_keep <= len(self.cached):
            raise ValueError(f"rollback(n_keep={n_keep}) outside [0, {len(self.cached)}]")
        if n_keep == len(self.cached):
            return
        if not self._L.llama_memory_seq_rm(self._mem, self._seq, n_keep, -1):
            raise RuntimeError(f"llama_memory_seq_rm({self._seq}, {n_keep}, -1) failed")
        del self.cached[n_keep:]

    def _on_eval(self, tensor, ask, _user_data) -> bool:
        """ggml scheduler callback: ask for the captured nodes, then copy them as they are computed."""
        try:
            key = self._nodes.get(_ggml.ggml_get_name(tensor))
            if ask:
                return key is not None
            if key is not None:
                n = int(_ggml.ggml_nelements(tensor))
                nbytes = int(_ggml.ggml_nbytes(tensor))
                if nbytes != 4 * n or n % self._d or not _ggml.ggml_is_contiguous(tensor):
                    raise RuntimeError(f"node {key} is not a contiguous float32 [tokens, {self._d}] tensor")
                out = np.empty((n // self._d, self._d), dtype=np.float32)
                _ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, nbytes)
                self._chunks.setdefault(key, []).append(out)
            return True
        except BaseException as exc:  # an exception cannot cross the C callback: keep it, abort the decode
            self._cb_error = exc
            return False

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        out = [int(i) for i in ids]
        bad = [i for i in out if not 0 <= i < self._n_vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self._n_vocab})")
        return out

    def _decode(self, entries: list[tuple[int, int, Sequence[int]]], last_only: bool = False) -> None:
        """One ``llama_decode`` of (token, position, sequence ids) entries, every one an output
        (``last_only``: only the last; the others skip the output head)."""
        b = self._batch
        for i, (tok, pos, seqs) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = len(seqs)
            for k, s in enumerate(seqs):
                b.seq_id[i][k] = s
            b.logits[i] = not last_only or i == len(entries) - 1
        b.n_tokens = len(entries)
        self._cb_error = None
        rc = self._L.llama_decode(self._ctx, b)
        if self._cb_error is not None:
            raise RuntimeError(f"capturing a layer failed: {self._cb_error}") from self._cb_error
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({len(entries)} tokens, {len(self.cached)} cached, n_ctx {self.n_ctx})")

    def _rows(self, getter, rows: Sequence[int], width: int) -> np.ndarray:
        out = np.empty((len(rows), width), dtype=np.float32)
        for j, i in enumerate(rows):
            ptr = getter(self._ctx, i)
            if not ptr:
                raise RuntimeError(f"llama.cpp has no output for batch row {i}")
            out[j] = np.ctypeslib.as_array(ptr, shape=(width,))
        return out

    def _take_layers(self) -> dict[tuple[int, str], np.ndarray]:
        missing = [k for k in self.capture if k not in self._chunks]
        if missing:
            self._chunks = {}
            names = ", ".join(f"{NODE_NAMES[kind]}-{layer}" for layer, kind in missing)
            raise RuntimeError(f"{self.path.name}: llama.cpp's graph has no node {names} (captures {missing}); "
                               f"the node names {NODE_NAMES} are those of the llama/qwen2 graphs")
        layers = {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in self._chunks.items()}
        self._chunks = {}
        return layers

    def feed(self, ids: Sequence[int], n_logits: int = 1, attention_mask=None, position_ids=None) -> Step:
        """Append ``ids`` to the session sequence in use; see ``CausalLM.feed``.

        Returns logits [n_logits, V] for the last ``n_logits`` positions and the final-norm hidden
        state of every fed position. Feeds longer than ``n_batch`` run as several decodes. Custom
        masks are not supported here: tree verification uses ``feed_candidates``.
        """
        if attention_mask is not None or position_ids is not None:
            raise ValueError("LlamaCppLM.feed takes no attention_mask/position_ids; verify candidates with feed_candidates()")
        if not ids:
            raise ValueError("feed() needs at least one token id")
        ids = self._check_ids(ids)
        n = len(ids)
        if self.cells_used() + n > self.n_ctx:
            raise ValueError(f"feeding {n} tokens after {len(self.cached)} (all sessions: {self.cells_used()}) "
                             f"would exceed n_ctx {self.n_ctx}")
        n_logits = max(1, min(n_logits, n))
        first_logit = n - n_logits
        base = len(self.cached)
        hidden, logits = [], []
        self._chunks = {}
        try:
            for start in range(0, n, self.n_batch):
                chunk = ids[start:start + self.n_batch]
                self._decode([(tok, base + start + i, (self._seq,)) for i, tok in enumerate(chunk)])
                self.cached.extend(chunk)
                hidden.append(self._rows(self._L.llama_get_embeddings_ith, range(len(chunk)), self._d))
                rows = [i for i in range(len(chunk)) if start + i >= first_logit]
                if rows:
                    logits.append(self._rows(self._L.llama_get_logits_ith, rows, self._n_vocab))
            layers = self._take_layers()
        except RuntimeError:
            # Leave the cache as it was before this feed.
            self._L.llama_memory_seq_rm(self._mem, self._seq, base, -1)
            del self.cached[base:]
            self._chunks = {}
            raise
        self.forward_passes += 1
        return Step(
            logits=torch.from_numpy(np.concatenate(logits) if len(logits) > 1 else logits[0]),
            hidden=torch.from_numpy(np.concatenate(hidden) if len(hidden) > 1 else hidden[0]),
            layers={k: torch.from_numpy(v) for k, v in layers.items()},
        )

    def feed_many(self, parts: Sequence[tuple[int, Sequence[int]]]) -> list[Step]:
        """``feed`` of several sessions in one pass: ``parts`` = ``(session, ids)``, at most one part
        per session; every part's tokens go into one ``llama_decode`` (several when they pass
        ``n_batch``, cut in order), each in its own sequence after that session's cached tokens.

        Returns one ``Step`` per part, as ``feed(ids, n_logits=len(ids))`` on that session alone
        would (logits and hidden states of every fed position, captured layers): the verification
        of several robots' blocks in one target pass. The session in use stays what it was.
        """
        sessions = [int(s) for s, _ in parts]
        if len(set(sessions)) != len(sessions):
            raise ValueError(f"feed_many: one part per session, got sessions {sessions}")
        for s in sessions:
            if not 0 <= s < self.n_sessions:
                raise ValueError(f"session {s} outside [0, {self.n_sessions - 1}] (n_sessions {self.n_sessions})")
        ids = [self._check_ids(p) for _, p in parts]
        if any(not p for p in ids):
            raise ValueError("feed_many() needs at least one token id per part")
        total = sum(len(p) for p in ids)
        if self.cells_used() + total > self.n_ctx:
            raise ValueError(f"feeding {total} tokens (all sessions: {self.cells_used()} cached) would exceed n_ctx {self.n_ctx}")
        bases = [len(self._cached[s]) for s in sessions]
        entries = [(tok, bases[j] + i, (s,)) for j, (s, p) in enumerate(zip(sessions, ids)) for i, tok in enumerate(p)]
        logits, hidden, layers = [], [], {}
        self._chunks = {}
        try:
            for start in range(0, len(entries), self.n_batch):
                chunk = entries[start:start + self.n_batch]
                self._decode(chunk)
                rows = range(len(chunk))
                logits.append(self._rows(self._L.llama_get_logits_ith, rows, self._n_vocab))
                hidden.append(self._rows(self._L.llama_get_embeddings_ith, rows, self._d))
            layers = self._take_layers()
        except RuntimeError:
            for s, base in zip(sessions, bases):
                self._L.llama_memory_seq_rm(self._mem, s, base, -1)
            self._chunks = {}
            raise
        logits, hidden = np.concatenate(logits), np.concatenate(hidden)
        steps, at = [], 0
        for s, p in zip(sessions, ids):
            rows = slice(at, at + len(p))
            self._cached[s].extend(p)
            steps.append(Step(logits=torch.from_numpy(logits[rows]), hidden=torch.from_numpy(hidden[rows]),
                              layers={k: torch.from_numpy(np.ascontiguousarray(v[rows])) for k, v in layers.items()}))
            at += len(p)
        self.forward_passes += 1
        return steps

    def prefill(self, ids: Sequence[int]) -> None:
        """Append ``ids`` to the session sequence in use, computing no logits or hidden states but
        the last's (the output head is skipped for the others: about a quarter of a 0.5B model's
        work per token). For a context fed ahead of its block (``EdgeSessions.prefill``)."""
        if not ids:
            raise ValueError("prefill() needs at least one token id")
        ids = self._check_ids(ids)
        if self.cells_used() + len(ids) > self.n_ctx:
            raise ValueError(f"prefilling {len(ids)} tokens after {len(self.cached)} (all sessions: {self.cells_used()}) "
                             f"would exceed n_ctx {self.n_ctx}")
        base = len(self.cached)
        # With embeddings on and pooling NONE llama.cpp makes every token an output (and says so
        # on every call); off, the rows not asked for skip the output head.
        self._L.llama_set_embeddings(self._ctx, False)
        try:
            for start in range(0, len(ids), self.n_batch):
                chunk = ids[start:start + self.n_batch]
                self._decode([(tok, base + start + i, (self._seq,)) for i, tok in enumerate(chunk)], last_only=True)
                self.cached.extend(chunk)
        except RuntimeError:
            self._L.llama_memory_seq_rm(self._mem, self._seq, base, -1)
            del self.cached[base:]
            raise
        finally:
            self._L.llama_set_embeddings(self._ctx, True)
            self._chunks = {}
        self.forward_passes += 1

    def feed_candidates(self, context: Sequence[int], candidates: Sequence[Sequence[int]]) -> tuple[Step, int]:
        """Run the context's pending tokens and every candidate continuation in ONE decode.

        Each candidate sees the context and its own earlier tokens only (its own sequence), as in
        ``switchsd.copying.verify_tree``. Returns ``(step, n_pend)``: rows of ``step.logits``,
        ``step.hidden`` and ``step.layers`` follow verify_tree's flat layout -- the ``n_pend``
        pending context tokens, then each candidate's tokens in order -- so row ``n_pend - 1``
        predicts every candidate's first token and row ``start + i`` the token after candidate
        token i. Afterwards the session in use holds exactly ``context``; the candidate sequences
        are gone.
        """
        L = self._L
        cands = [self._check_ids(c) for c in candidates]
        if not cands or any(not c for c in cands):
            raise ValueError("feed_candidates needs at least one candidate and no empty candidate")
        if len(cands) > self.n_seq_max - self.n_sessions:
            raise ValueError(f"{len(cands)} candidates need n_seq_max >= {len(cands) + self.n_sessions} "
                             f"(this model has {self.n_seq_max}, {self.n_sessions} of them sessions)")
        context = self._check_ids(context)
        pending = self.sync(context)
        base = len(self.cached)
        n_pend = len(pending)
        first = self.n_sessions  # candidate sequences follow the session sequences
        seqs = list(range(first, first + len(cands)))
        # Batch entries: pending tokens in every sequence, then a trie of the candidates.
        entries: list[tuple[int, int, list[int]]] = [(tok, base + i, [self._seq] + seqs) for i, tok in enumerate(pending)]
        flat_rows = list(range(n_pend))
        trie: dict[tuple[int, ...], int] = {}  # candidate prefix -> batch row
        for c, cand in enumerate(cands):
            for i in range(len(cand)):
                key = tuple(cand[:i + 1])
                row = trie.get(key)
                if row is None:
                    row = trie[key] = len(entries)
                    entries.append((cand[i], base + n_pend + i, []))
                entries[row][2].append(first + c)
                flat_rows.append(row)
        if len(entries) > self.n_batch:
            raise ValueError(f"pending + candidate tokens ({len(entries)}) exceed n_batch {self.n_batch}")
        if self.cells_used() + len(entries) > self.n_ctx:
            raise ValueError(f"{len(entries)} tokens after {base} cached would exceed n_ctx {self.n_ctx}")
        for s in seqs:
            L.llama_memory_seq_rm(self._mem, s, -1, -1)
            L.llama_memory_seq_cp(self._mem, self._seq, s, -1, -1)  # unified cache: shares the prefix's cells
        self._chunks = {}
        try:
            self._decode(entries)
            logits = self._rows(L.llama_get_logits_ith, flat_rows, self._n_vocab)
            hidden = self._rows(L.llama_get_embeddings_ith, flat_rows, self._d)
            layers = {k: v[flat_rows] for k, v in self._take_layers().items()}
        except RuntimeError:
            L.llama_memory_seq_rm(self._mem, self._seq, base, -1)
            raise
        finally:
            self._chunks = {}
            for s in seqs:
                L.llama_memory_seq_rm(self._mem, s, -1, -1)
        self.cached.extend(pending)
        self.forward_passes += 1
        step = Step(logits=torch.from_numpy(logits), hidden=torch.from_numpy(hidden),
                    layers={k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in layers.items()})
        return step, n_pend

    def continue_branches(self, prefix: Sequence[int], branches: Sequence[tuple[int, int]], max_new_tokens: int,
                          stop: Callable[[int, list[int]], bool], batch_size: int = 8,
                          ) -> Iterator[tuple[list[int], list[list[int]]]]:
        """Greedy continuations of ``prefix[:p] + [token]`` for every ``(p, token)`` in ``branches``,
        yielded batch by batch as ``(branch indices, their continuations)``.

        The session sequence in use holds the prefix; every running branch gets its own sequence
        sharing the prefix's first ``p`` cells (``llama_memory_seq_cp``: no copy in a unified cache),
        and one ``llama_decode`` advances up to ``batch_size`` branches by one token (``branch_pool``:
        a branch that ends frees its slot for the next one). A branch ends when ``stop(branch index,
        its new tokens)`` is true, at an end-of-sequence token or after ``max_new_tokens``, and its
        cells are freed; finished branches are yielded in groups of ``batch_size``, latest branch
        points started first. ``batch_size`` is at most ``n_seq_max - n_sessions``; the cache needs
        ``len(prefix) + batch_size * max_new_tokens`` cells. Afterwards the session holds the prefix's
        first ``max(p)`` tokens and the branch sequences are gone.
        """
        prefix = self._check_ids(prefix)
        if not 1 <= batch_size <= self.n_seq_max - self.n_sessions:
            raise ValueError(f"batch_size {batch_size} needs n_seq_max >= {batch_size + self.n_sessions} "
                             f"(this model has {self.n_seq_max}, {self.n_sessions} of them sessions)")
        for p, tok in branches:
            if not 1 <= p <= len(prefix):
                raise ValueError(f"branch point {p} outside [1, {len(prefix)}]")
            self._check_ids([tok])
        if not branches:
            return
        n_shared = max(p for p, _ in branches)
        need = n_shared + min(batch_size, len(branches)) * max_new_tokens + self.cells_used() - len(self.cached)
        if need > self.n_ctx:
            raise ValueError(f"{min(batch_size, len(branches))} branches of up to {max_new_tokens} tokens after "
                             f"{n_shared} shared need n_ctx >= {need} (this model has {self.n_ctx})")
        pending = self.sync(prefix[:n_shared])
        if pending:
            self.feed(pending)
        order = sorted(range(len(branches)), key=lambda i: -branches[i][0])
        todo = collections.deque(order)

        def next_branch():
            if not todo:
                return None
            i = todo.popleft()
            return i, self._seq, branches[i][0], branches[i][1]

        # branch_pool refills a slot as soon as its branch ends; finished branches are handed on
        # in groups of batch_size.
        members: list[int] = []
        conts: list[list[int]] = []
        for i, cont in self.branch_pool(next_branch, max_new_tokens, stop, batch_size):
            members.append(i)
            conts.append(cont)
            if len(members) == batch_size:
                yield members, conts
                members, conts = [], []
        if members:
            yield members, conts

    def branch_pool(self, next_branch: Callable[[], tuple[Hashable, int, int, int] | None], max_new_tokens: int,
                    stop: Callable[[Hashable, list[int]], bool], slots: int, trace_top: int = 0,
                    ) -> Iterator[tuple[Hashable, list[int]] | tuple[Hashable, list[int], BranchTrace]]:
        """Greedy continuations of branches of *several* session contexts, decoded side by side.

        ``next_branch()`` is asked for work whenever a slot is free and returns ``(key, session, p,
        token)``: continue the session's first ``p`` cached tokens followed by ``token`` (the
        branch gets its own sequence sharing those cells, as in ``continue_branches``), or None
        when nothing is ready to start. One ``llama_decode`` advances every running branch by a
        token. A branch ends when ``stop(key, its new tokens)`` is true, at an end-of-sequence
        token, or after ``max_new_tokens``; it is yielded then as ``(key, continuation)`` and its
        cells are freed. Between yields the caller may feed or roll back any session (a running
        branch keeps its own cells). At most ``slots`` (<= ``n_seq_max - n_sessions``) branches
        run at once; the generator ends when none runs and ``next_branch()`` returns None.

        ``trace_top`` > 0: yield ``(key, continuation, BranchTrace)`` instead, the branch's hidden
        states and a summary of its logits (the ``trace_top`` largest), and keep its cells until
        the consumer asks for the next item, so that ``adopt`` can hand them to a session.

        Used by the AutoJudge-style label search (``wisv_ros.wisv.search``), where each answer's
        next branch depends on the outcome of its previous one, so the batch is formed across answers.
        """
        L = self._L
        if not 1 <= slots <= self.n_seq_max - self.n_sessions:
            raise ValueError(f"slots {slots} needs n_seq_max >= {slots + self.n_sessions} "
                             f"(this model has {self.n_seq_max}, {self.n_sessions} of them sessions)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        if trace_top < 0 or trace_top > self._n_vocab:
            raise ValueError(f"trace_top must be in [0, {self._n_vocab}] (got {trace_top})")
        free = list(range(self.n_sessions + slots - 1, self.n_sessions - 1, -1))
        eos = self.eos_ids()
        # key -> [sequence, continuation, next token, its position, branch point, trace rows]
        active: dict = {}
        try:
            while True:
                while free:
                    job = next_branch()
                    if job is None:
                        break
                    key, session, p, tok = job
                    if key in active:
                        raise ValueError(f"branch key {key!r} is already running")
                    if not 0 <= session < self.n_sessions:
                        raise ValueError(f"session {session} outside [0, {self.n_sessions - 1}]")
                    if not 1 <= p <= len(self._cached[session]):
                        raise ValueError(f"branch point {p} outside [1, {len(self._cached[session])}] (session {session})")
                    self._check_ids([tok])
                    seq = free.pop()
                    L.llama_memory_seq_rm(self._mem, seq, -1, -1)
                    L.llama_memory_seq_cp(self._mem, session, seq, 0, p)
                    active[key] = [seq, [], int(tok), int(p), int(p), []]
                if not active:
                    return
                keys = list(active)
                try:
                    self._decode([(active[k][2], active[k][3], (active[k][0],)) for k in keys])
                except RuntimeError as exc:
                    raise RuntimeError(f"{exc}: {len(keys)} branches beside {self.cells_used()} session cells; "
                                       "open the model with a larger n_ctx or run fewer slots") from exc
                self.forward_passes += 1
                logits = self._rows(L.llama_get_logits_ith, range(len(keys)), self._n_vocab)
                self._chunks = {}
                if trace_top:
                    hidden = self._rows(L.llama_get_embeddings_ith, range(len(keys)), self._d)
                    x = torch.from_numpy(logits)
                    logp = torch.log_softmax(x, dim=-1)
                    ent = -(logp.exp() * logp).sum(-1)
                    top = torch.topk(x, trace_top, dim=-1)
                    lse = torch.logsumexp(x, dim=-1).numpy()
                    for row, k in enumerate(keys):
                        active[k][5].append((active[k][2], hidden[row], float(lse[row]), float(ent[row]),
                                             top.indices[row].numpy(), top.values[row].numpy()))
                done = []
                for row, k in enumerate(keys):
                    st = active[k]
                    t = int(logits[row].argmax())
                    if t in eos:
                        done.append(k)
                        continue
                    st[1].append(t)
                    if len(st[1]) >= max_new_tokens or stop(k, st[1]):
                        done.append(k)
                        continue
                    st[2], st[3] = t, st[3] + 1
                for k in done:
                    seq, cont, _, _, p, rows = active.pop(k)
                    try:
                        if not trace_top:
                            yield k, cont
                        else:
                            trace = BranchTrace(
                                seq=seq, p=p, fed=[r[0] for r in rows], hidden=np.stack([r[1] for r in rows]),
                                logsumexp=np.array([r[2] for r in rows], dtype=np.float32),
                                entropy=np.array([r[3] for r in rows], dtype=np.float32),
                                top_ids=np.stack([r[4] for r in rows]), top_logits=np.stack([r[5] for r in rows]))
                            yield k, cont, trace
                            trace.alive = False
                    finally:
                        L.llama_memory_seq_rm(self._mem, seq, -1, -1)
                        free.append(seq)
        finally:
            self._chunks = {}
            for st in active.values():
                L.llama_memory_seq_rm(self._mem, st[0], -1, -1)

    def adopt(self, session: int, trace: BranchTrace) -> None:
        """Make a branch of ``branch_pool(trace_top=...)`` the text of ``session``: the session
        keeps its first ``trace.p`` tokens and takes the branch's cells after them (no decode), as
        if it had been fed ``trace.fed``. Only while the pool still holds the branch (before the
        consumer asks for the pool's next item)."""
        if not trace.alive:
            raise RuntimeError("adopt(): the branch's cells are gone (adopt it before asking the pool for its next item)")
        if not 0 <= session < self.n_sessions:
            raise ValueError(f"session {session} outside [0, {self.n_sessions - 1}] (n_sessions {self.n_sessions})")
        if trace.p > len(self._cached[session]):
            raise ValueError(f"branch point {trace.p} is past session {session}'s {len(self._cached[session])} tokens")
        L = self._L
        if not L.llama_memory_seq_rm(self._mem, session, trace.p, -1):
            raise RuntimeError(f"llama_memory_seq_rm({session}, {trace.p}, -1) failed")
        L.llama_memory_seq_cp(self._mem, trace.seq, session, trace.p, -1)
        self._cached[session] = self._cached[session][:trace.p] + list(trace.fed)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free the batch, the context and the model (the object is unusable afterwards)."""
        L = getattr(self, "_L", None)
        if L is None:
            return
        if getattr(self, "_batch", None) is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            L.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            L.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    def __enter__(self) -> "LlamaCppLM":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
