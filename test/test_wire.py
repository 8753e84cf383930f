"""numpy <-> message tensor fields (wisv_ros.interfaces.wire), without rclpy and with the generated messages."""
from __future__ import annotations

import types

import numpy as np
import pytest

from wisv_ros.interfaces.wire import WireError, decode_array, encode_array, fill_hidden, fill_tensor, is_empty, read_hidden, read_tensor, text_to_ids


def blank(hidden: bool = True):
    """A stand-in for Tensor / HiddenStates (the functions are duck-typed)."""
    ns = types.SimpleNamespace(data=b"", dtype="", shape=[])
    if hidden:
        ns.positions = []
    return ns


@pytest.mark.parametrize("dtype,tol", [("float32", 0.0), ("float16", 1e-3), ("bfloat16", 8e-3)])
def test_round_trip(dtype, tol):
    a = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    data, shape = encode_array(a, dtype)
    assert shape == [3, 5]
    assert len(data) == a.size * {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    back = decode_array(data, dtype, shape)
    np.testing.assert_allclose(back.astype(np.float32), a, rtol=tol, atol=tol)


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan():
    a = np.array([1.0, 1.00390625, 1.01171875, np.nan, -2.5], np.float32)
    data, shape = encode_array(a, "bfloat16")
    back = decode_array(data, "bfloat16", shape)
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == pytest.approx(1.015625)
    assert np.isnan(back[3]) and back[4] == -2.5


def test_generated_messages_round_trip_through_serialisation():
    from rclpy.serialization import deserialize_message, serialize_message
    from wisv_ros.msg import DraftBlock

    h = np.arange(4 * 32, dtype=np.float32).reshape(4, 32) / 7
    p = np.full((4, 64), 1 / 64, np.float32)
    msg = DraftBlock()
    fill_hidden(msg.hidden, h, positions=[0, 1, 2, 3], dtype="float16")
    fill_tensor(msg.draft_probs, p, "float32", "draft_probs")
    back = deserialize_message(serialize_message(msg), DraftBlock)
    hh, pos = read_hidden(back.hidden, n=4, hidden_size=32, positions_below=4)
    assert pos == [0, 1, 2, 3]
    np.testing.assert_allclose(hh, h, rtol=1e-3)
    np.testing.assert_array_equal(read_tensor(back.draft_probs, "draft_probs", shape=[4, 64]), p)
    assert is_empty(DraftBlock().hidden) and not is_empty(back.hidden)


def test_errors_name_the_field():
    h = fill_hidden(blank(), np.zeros((2, 8), np.float32))
    with pytest.raises(WireError, match=r"^hidden: shape \[2, 8\], expected \[3, 8\]"):
        read_hidden(h, n=3, hidden_size=8)
    with pytest.raises(WireError, match=r"^hidden: shape \[2, 8\], expected \[\*, 16\]"):
        read_hidden(h, hidden_size=16)
    with pytest.raises(WireError, match=r"^hidden: positions \[0, 1\] outside the block of 1"):
        read_hidden(h, positions_below=1)
    bad = fill_hidden(blank(), np.array([[0.0, np.nan]], np.float32), dtype="float32")
    with pytest.raises(WireError, match=r"^hidden: contains NaN"):
        read_hidden(bad)
    t = fill_tensor(blank(False), np.zeros((2, 3), np.float32), field="draft_probs")
    t.dtype = "int8"
    with pytest.raises(WireError, match=r"^draft_probs: dtype 'int8' is not one of"):
        read_tensor(t, "draft_probs")
    t.dtype = "float16"  # 24 bytes do not hold 2 x 3 float16 ... they hold 12 elements
    with pytest.raises(WireError, match=r"^draft_probs: 24 data bytes, but shape \[2, 3\] of float16 needs 12"):
        read_tensor(t, "draft_probs")
    with pytest.raises(WireError, match=r"^draft_probs: empty"):
        read_tensor(blank(False), "draft_probs")
    with pytest.raises(WireError, match=r"^hidden: hidden states must be 2-D"):
        fill_hidden(blank(), np.zeros(3))
    with pytest.raises(WireError, match=r"^hidden: 1 positions for 2 hidden states"):
        fill_hidden(blank(), np.zeros((2, 3)), positions=[0])


def test_text_to_ids():
    assert text_to_ids(" 5 9  12 3\n") == [5, 9, 12, 3]
    with pytest.raises(WireError, match="^prompt: the model has no tokenizer"):
        text_to_ids("hello world")
    with pytest.raises(WireError, match="^prompt: empty"):
        text_to_ids("  ")
