"""numpy arrays <-> the byte-blob tensor fields of the messages (HiddenStates, Tensor).

A tensor travels as ``data`` (uint8[], little-endian, C order), ``dtype`` (a string) and ``shape``
(uint32[]); HiddenStates adds ``positions`` and ``head_id`` (empty: raw drafter hiddens; else the
decision head whose drafter projection the rows are, see ``wisv.head``). Writing goes through ``array.array('B', a.tobytes())``
(about 3 ms/MB, ten times faster than assigning a numpy array to a ``float32[]`` field); reading
uses ``np.frombuffer`` on the received ``array.array`` without a copy.

The functions take any object with those attributes (a generated message, or a stand-in in
tests), so this module needs no rclpy. Every validation error is a ``WireError`` (a ValueError)
whose message starts with the field name given by the caller, e.g.
``hidden: shape [2, 32] does not match 3 draft tokens``.

dtypes: ``float16``, ``float32``, and ``bfloat16`` (numpy has none: stored as the upper 16 bits of
float32 with round-to-nearest-even, read back as float32).

No rclpy here: this module is part of the ROS-free core.
"""
from __future__ import annotations

import array
import math
from typing import Sequence

import numpy as np

__all__ = [
    "DTYPES",
    "WireError",
    "decode_array",
    "encode_array",
    "fill_hidden",
    "fill_tensor",
    "hidden_head_id",
    "is_empty",
    "read_hidden",
    "read_tensor",
    "text_to_ids",
]

DTYPES = ("float16", "float32", "bfloat16")
_NUMPY = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2")}

#: Start of Verdict.error when the verifier holds no context for a request; the drafter then
#: resends the whole context (DraftBlock.context_ids) with its next block.


class WireError(ValueError):
    """A tensor field is malformed; the message starts with the field's name."""


def _to_bfloat16_bits(a: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(a, dtype="<f4").view("<u4")
    # Round to nearest even on the 16 dropped bits; NaN stays NaN (quiet bit set).
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype("<u2")
    return rounded


MAX_TENSOR_BYTES = 1 << 30  # no tensor of the protocol comes near 1 GiB ([K, V] float32 at K 256, V 152k: 156 MB)


def encode_array(a: np.ndarray, dtype: str, field: str = "tensor") -> tuple[array.array, list[int]]:
    """Bytes (as ``array.array('B')``) and shape of ``a`` converted to ``dtype``."""
    if dtype not in _NUMPY:
        raise WireError(f"{field}: dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    a = np.asarray(a)
    if a.dtype.kind not in "fiu":
        raise WireError(f"{field}: cannot send numpy dtype {a.dtype}")
    if dtype == "bfloat16":
        raw = _to_bfloat16_bits(a.astype(np.float32, copy=False))
    else:
        raw = np.ascontiguousarray(a, dtype=_NUMPY[dtype])
    return array.array("B", raw.tobytes()), [int(n) for n in a.shape]


def decode_array(data, dtype: str, shape: Sequence[int], field: str = "tensor") -> np.ndarray:
    """The array held by (data, dtype, shape); bfloat16 comes back as float32. Validates sizes."""
    if dtype not in _NUMPY:
        raise WireError(f"{field}: dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    shape = [int(n) for n in shape]
    item = _NUMPY[dtype].itemsize
    want = math.prod(shape) * item  # Python ints: a huge shape cannot overflow to a small size
    if want > MAX_TENSOR_BYTES:
        raise WireError(f"{field}: shape {shape} of {dtype} would be {want} bytes, more than {MAX_TENSOR_BYTES}")
    if len(data) != want:
        raise WireError(f"{field}: {len(data)} data bytes, but shape {shape} of {dtype} needs {want}")
    if isinstance(data, list):  # a plain list of ints (not what rclpy gives for uint8[], but accepted)
        data = bytes(data)
    flat = np.frombuffer(data, dtype=_NUMPY[dtype])
    if dtype == "bfloat16":
        flat = (flat.astype("<u4") << 16).view("<f4")
    return flat.reshape(shape)


def fill_tensor(msg, a: np.ndarray, dtype: str = "float32", field: str = "tensor"):
    """Set ``msg.data``, ``msg.dtype``, ``msg.shape`` from ``a``; returns ``msg``."""
    data, shape = encode_array(a, dtype, field)
    msg.data = data
    msg.dtype = dtype
    msg.shape = shape
    return msg


def fill_hidden(msg, a: np.ndarray, positions: Sequence[int] | None = None, dtype: str = "float16",
                field: str = "hidden", head_id: str = ""):
    """Fill a HiddenStates: ``a`` is [n, d]; ``positions`` (default 0..n-1) the draft positions;
    ``head_id``: '' for raw drafter hiddens, else the head whose drafter projection ``a`` holds."""
    a = np.asarray(a)
    if a.ndim != 2:
        raise WireError(f"{field}: hidden states must be 2-D [positions, hidden_size], got shape {list(a.shape)}")
    positions = list(range(a.shape[0])) if positions is None else [int(p) for p in positions]
    if len(positions) != a.shape[0]:
        raise WireError(f"{field}: {len(positions)} positions for {a.shape[0]} hidden states")
    fill_tensor(msg, a, dtype, field)
    msg.positions = positions
    if head_id or hasattr(msg, "head_id"):
        msg.head_id = head_id
    return msg


MAX_HEAD_ID = 64  # characters; the ids of wisv.head are 16 hex digits


def hidden_head_id(msg, field: str = "hidden") -> str:
    """``head_id`` of a HiddenStates field ('' = raw drafter hiddens, also for messages without the field)."""
    head_id = str(getattr(msg, "head_id", "") or "")
    if len(head_id) > MAX_HEAD_ID or not head_id.isprintable():
        raise WireError(f"{field}.head_id: {len(head_id)} characters or unprintable ones; a head id is "
                        f"at most {MAX_HEAD_ID} printable characters")
    return head_id


def is_empty(msg) -> bool:
    """True when the tensor field carries nothing (the "not sent" convention)."""
    return not msg.dtype and len(msg.data) == 0 and len(msg.shape) == 0


def read_tensor(msg, field: str = "tensor", shape: Sequence[int | None] | None = None,
                finite: bool = True) -> np.ndarray:
    """Validated float32 array of a Tensor/HiddenStates field.

    shape: expected shape; ``None`` entries match any size.
    finite: reject NaN/inf.
    """
    if is_empty(msg):
        raise WireError(f"{field}: empty (no tensor sent)")
    out = decode_array(msg.data, msg.dtype, msg.shape, field)
    if shape is not None:
        ok = len(shape) == out.ndim and all(w is None or int(w) == n for w, n in zip(shape, out.shape))
        if not ok:
            want = ", ".join("*" if w is None else str(int(w)) for w in shape)
            raise WireError(f"{field}: shape {list(out.shape)}, expected [{want}]")
    out = out.astype(np.float32, copy=False)
    if finite and not np.isfinite(out).all():
        raise WireError(f"{field}: contains NaN or inf")
    return out


def read_hidden(msg, field: str = "hidden", n: int | None = None, hidden_size: int | None = None,
                positions_below: int | None = None) -> tuple[np.ndarray, list[int]]:
    """Validated ([n, d] float32 hidden states, positions) of a HiddenStates field.

    n: expected number of positions; hidden_size: expected d; positions_below: every position
    must be in [0, positions_below) (the block size).
    """
    h = read_tensor(msg, field, shape=[n, hidden_size])
    positions = [int(p) for p in msg.positions]
    if len(positions) != h.shape[0]:
        raise WireError(f"{field}: {len(positions)} positions for {h.shape[0]} hidden states")
    if positions_below is not None and any(p >= positions_below for p in positions):
        raise WireError(f"{field}: positions {positions} outside the block of {positions_below} tokens")
    if len(set(positions)) != len(positions):
        raise WireError(f"{field}: repeated positions {positions}")
    return h, positions


def text_to_ids(text: str) -> list[int]:
    """A prompt written as space-separated integer ids ("5 9 12 3"), for models without a tokenizer."""
    try:
        ids = [int(tok) for tok in text.split()]
    except ValueError:
        raise WireError(
            f"prompt: the model has no tokenizer, so the prompt must be space-separated integer ids "
            f"(e.g. '5 9 12 3'), got {text[:40]!r}"
        ) from None
    if not ids:
        raise WireError("prompt: empty")
    return ids
