"""One way to load a model for decoding, on either engine: ``backend`` torch or llama_cpp.

* ``torch``: ``sd.lm.CausalLM`` over a Hugging Face model (registry GGUF weights dequantised to
  float32 or bfloat16, a Hugging Face folder, or a tiny random model for tests). The engine for
  Hugging Face folders and GPU edges, and the one whose float32 greedy SD equals the target's own
  greedy output token for token.
* ``llama_cpp``: ``sd.llama_cpp_lm.LlamaCppLM`` over the 4-bit GGUF file itself (llama.cpp through
  llama-cpp-python): several times faster per token on a CPU. Its block and one-token passes round
  differently, so greedy SD can flip near-ties (``docs/engines.md``).

Both keep the same contract (``feed`` / ``rollback`` / ``sync``, logits and final-norm hidden
states, captured layers), so the drafter, the target's token-by-token decoding and the target's
block verification can each use the engine that is fastest for it.

No rclpy here.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["BACKENDS", "add_backend_args", "check_backend", "load_lm", "resolve_backend"]

BACKENDS = ("auto", "torch", "llama_cpp")  # auto: llama_cpp for GGUF weights, torch for the rest


def check_backend(name: str, field: str = "backend") -> str:
    """``name`` if it is a backend; ValueError naming ``field`` and the choices otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"{field}: '{name}' is not one of {', '.join(BACKENDS)}")
    return name


def add_backend_args(p, drafter: bool = True) -> None:
    """The command-line tools' ``--target-backend`` and, with ``drafter``, ``--drafter-backend``."""
    p.add_argument("--target-backend", default="torch", choices=BACKENDS,
                   help="engine of the target: torch (dequantised weights; float32 greedy SD equals the target's "
                   "greedy output exactly), llama_cpp (the GGUF file, several times faster on a CPU) or auto "
                   "(llama_cpp for GGUF weights) (default %(default)s)")
    if drafter:
        p.add_argument("--drafter-backend", default="torch", choices=BACKENDS,
                       help="engine of the drafter, same choices (default %(default)s)")


def resolve_backend(spec: str, backend: str) -> str:
    """The engine ``auto`` means for ``spec``: llama_cpp for GGUF weights (registry models, ``.gguf``
    files), which it runs as they are and several times faster on a CPU (docs/engines.md); torch for
    Hugging Face folders and tiny random models."""
    check_backend(backend)
    if backend != "auto":
        return backend
    from wisv_ros.sd.models import REGISTRY

    return "llama_cpp" if spec in REGISTRY or spec.endswith(".gguf") else "torch"


def load_lm(spec: str, backend: str = "torch", *, dtype: str = "auto", capture: Sequence[tuple[int, str]] = (),
            threads: int = 1, n_ctx: int = 4096, n_sessions: int = 1):
    """A decoding model for ``spec`` (registry name, HF folder, ``.gguf`` file, ``tiny-random:...``) on
    ``backend`` (``auto``: see ``resolve_backend``).

    dtype: torch weights dtype (``auto``, ``float32``, ``bfloat16``, ``float16``); llama_cpp runs the
    GGUF file's own quantisation. threads: CPU threads of the engine. n_ctx: llama_cpp context size
    (tokens; prompt + answer + one block; shared by the sessions). n_sessions: contexts the
    llama_cpp engine keeps apart (``LlamaCppLM.use``); torch keeps one.
    """
    backend = resolve_backend(spec, backend)
    if backend == "torch":
        import torch

        from wisv_ros.sd.lm import CausalLM
        from wisv_ros.sd.models import load_model

        if n_sessions != 1:
            raise ValueError(f"n_sessions {n_sessions}: the torch engine keeps one context; use backend llama_cpp")
        torch.set_num_threads(threads)
        model, tok = load_model(spec, dtype=dtype)
        return CausalLM(model, tok, capture=capture)
    if spec.startswith("tiny-random"):
        raise ValueError(f"backend llama_cpp: '{spec}' is a torch test model; give a registry name or a .gguf file")
    from wisv_ros.sd.llama_cpp_lm import LlamaCppLM

    return LlamaCppLM.from_gguf(spec, n_ctx=n_ctx, threads=threads, capture=capture, n_sessions=n_sessions,
                                n_seq_max=n_sessions + 8)
