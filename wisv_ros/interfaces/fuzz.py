"""Malformed inputs for every topic and the Generate action, as plain field dictionaries.

``cli/fuzz.py`` fills them into messages and publishes them at running nodes; the cases are here,
without rclpy, so that they are seeded, bounded and testable alone. Each case names its category
and what the node must answer:

- ``BlockCase.expect``: the start of the Verdict's ``error`` (a field name or a protocol answer);
  ``""`` = any named error (never ``internal error``).
- ``GoalCase.expect``: the start of the aborted goal's ``error``.

No rclpy here.
"""
from __future__ import annotations

import dataclasses
import math
import random
import struct
from typing import Iterator

__all__ = ["BlockCase", "GoalCase", "block_cases", "goal_cases", "noise_cases", "BLOCK_CATEGORIES", "GOAL_CATEGORIES"]

BLOCK_CATEGORIES = ("number", "ids", "size", "protocol", "tensor", "reject", "context", "string", "round")
GOAL_CATEGORIES = ("number", "choice", "size")


@dataclasses.dataclass
class BlockCase:
    category: str
    expect: str  # start of the expected error ("" = any named error)
    fields: dict  # DraftBlock fields (hidden / draft_probs as dicts of Tensor fields)


@dataclasses.dataclass
class GoalCase:
    category: str
    expect: str
    fields: dict  # Generate.Goal fields


def _tensor(shape, dtype="float16", values=None, data: bytes | None = None) -> dict:
    n = math.prod(shape) if shape else 0
    if data is None:
        fmt = {"float16": "e", "float32": "f"}.get(dtype, "e")
        vals = values if values is not None else [0.0] * n
        data = struct.pack(f"<{len(vals)}{fmt}", *vals)
    return {"data": data, "dtype": dtype, "shape": list(shape)}


def block_cases(rng: random.Random, n: int, vocab: int, hidden: int, prefix: list[int]) -> Iterator[BlockCase]:
    """``n`` malformed DraftBlocks, categories taking turns. ``vocab`` / ``hidden``: the target's
    vocabulary and the drafter's hidden size; ``prefix``: a valid prompt (context_ids)."""
    p = len(prefix)

    def base(**over) -> dict:
        k = over.pop("_k", 2)
        f = {"request_id": f"fuzz-{rng.getrandbits(48):012x}", "round_id": 0, "prefix_length": p,
             "context_ids": list(prefix), "token_ids": [rng.randrange(vocab) for _ in range(k)], "k": k,
             "protocol": 0, "method": "greedy", "tau": 0.0, "temperature": 0.0, "draft_time_s": 0.0,
             "copy_budget": 0, "hidden": None, "draft_probs": None}
        f.update(over)
        return f

    nan, inf = float("nan"), float("inf")
    makers = {
        "number": lambda: rng.choice([
            ("tau", base(tau=rng.choice([nan, inf, -inf, -1.0]))),
            ("temperature", base(temperature=rng.choice([nan, inf, -inf, -0.5, 11.0]))),
            ("draft_time_s", base(draft_time_s=rng.choice([nan, inf, -1.0]))),
        ]),
        "ids": lambda: rng.choice([
            ("token_ids", base(token_ids=[vocab + rng.randrange(1000)], _k=1)),
            ("token_ids", base(token_ids=[-1 - rng.randrange(1000)], _k=1)),
            ("context_ids", base(context_ids=prefix[:-1] + [vocab + 5])),
        ]),
        "size": lambda: rng.choice([
            ("token_ids", base(token_ids=[], _k=1)),
            ("token_ids", (lambda f: (f.update(k=1), f)[1])(base(_k=3))),  # 3 ids, k = 1
            ("token_ids", base(_k=rng.randrange(300, 600))),  # beyond max_block
        ]),
        "protocol": lambda: ("protocol", base(protocol=rng.randrange(3, 256))),
        "tensor": lambda: rng.choice([
            ("hidden", base(protocol=1)),  # fh without hiddens
            ("hidden", base(protocol=1, hidden={**_tensor([2, hidden]), "dtype": "int8", "positions": [0, 1]})),
            ("hidden", base(protocol=1, hidden={**_tensor([2, hidden], data=b"\x00" * 7), "positions": [0, 1]})),
            ("hidden", base(protocol=1, hidden={**_tensor([0], data=b""), "shape": [2**31, 2**31, 4], "positions": [0, 1]})),
            ("hidden", base(protocol=1, hidden={**_tensor([2, hidden], values=[nan] * (2 * hidden)), "positions": [0, 1]})),
            ("hidden", base(protocol=2, hidden={**_tensor([2, hidden]), "positions": [0, 1]})),  # sh must be empty
            ("hidden", base(protocol=1, hidden={**_tensor([2, hidden]), "positions": [5, 9]})),
        ]),
        "reject": lambda: rng.choice([
            ("draft_probs", base(method="reject", temperature=1.0)),
            ("draft_probs", base(method="reject", temperature=1.0, _k=1,
                                 draft_probs=_tensor([1, vocab], "float32", [-1.0 / vocab] * vocab))),
            ("draft_probs", base(method="reject", temperature=1.0, _k=1,
                                 draft_probs=_tensor([1, vocab], "float32", [0.0] * vocab))),
            ("method", base(method=rng.choice(["bogus", "target_only", "rejection"]))),
        ]),
        "context": lambda: rng.choice([
            ("prefix_length", base(prefix_length=p + 3)),
            ("prefix_length", base(context_ids=[1] * 9000, prefix_length=9000)),  # beyond max_context
            ("unknown request", base(context_ids=[], round_id=5)),
        ]),
        "string": lambda: rng.choice([
            ("", base(request_id="fuzz-" + "x" * rng.randrange(1000, 5000), tau=nan)),
            ("", base(request_id="fuzz-\u00e9\u4e2d\u0000nul", tau=nan)),
        ]),
        "round": lambda: ("", base(round_id=2**32 - 1, context_ids=[], prefix_length=p)),  # unknown request
    }
    for i in range(n):
        category = BLOCK_CATEGORIES[i % len(BLOCK_CATEGORIES)]
        expect, fields = makers[category]()
        yield BlockCase(category, expect, fields)


def goal_cases(rng: random.Random, n: int) -> Iterator[GoalCase]:
    """``n`` Generate goals the drafter must abort, naming the field."""
    nan, inf = float("nan"), float("inf")
    makers = {
        "number": lambda: rng.choice([
            ("tau", {"method": "wisv", "tau": rng.choice([nan, inf, 11.0])}),
            ("temperature", {"temperature": rng.choice([nan, inf, 10.5])}),
        ]),
        "choice": lambda: rng.choice([
            ("method", {"method": rng.choice(["bogus", "target_only", "Greedy"])}),
            ("protocol", {"protocol": rng.choice(["bogus", "IDS", "fh "])}),
            ("method reject", {"method": "reject", "temperature": 0.0}),
        ]),
        "size": lambda: ("k", {"k": rng.choice([257, 1000, 2**31])}),
    }
    for i in range(n):
        category = GOAL_CATEGORIES[i % len(GOAL_CATEGORIES)]
        expect, fields = makers[category]()
        yield GoalCase(category, expect, fields)


def noise_cases(rng: random.Random, n: int, kind: str) -> Iterator[dict]:
    """Random messages of the other input topics (verdict, hidden_request, hidden_reply,
    channel_state): unknown requests, bad numbers; a node must ignore them and stay up."""
    nan, inf = float("nan"), float("inf")
    for _ in range(n):
        rid = rng.choice([f"fuzz-{rng.getrandbits(32):08x}", "", "x" * 2000])
        if kind == "verdict":
            yield {"request_id": rid, "round_id": rng.randrange(2**32), "accepted": rng.randrange(2**32),
                   "correction_id": rng.randrange(-2**31, 2**31), "committed_ids": [rng.randrange(-5, 10**6) for _ in range(rng.randrange(0, 40))],
                   "committed_length": rng.randrange(2**32), "edge_time_s": rng.choice([nan, inf, -1.0, 0.1]),
                   "error": rng.choice(["", "edge loading: x", "edge busy: x", "unknown request x"])}
        elif kind == "hidden_request":
            yield {"request_id": rid, "round_id": rng.randrange(2**32), "positions": [rng.randrange(2**32) for _ in range(rng.randrange(0, 20))]}
        elif kind == "hidden_reply":
            yield {"request_id": rid, "round_id": rng.randrange(2**32),
                   "hidden": {**_tensor([1, 4], values=[nan, inf, 0.0, 1.0]), "positions": [rng.randrange(2**32)]}}
        elif kind == "channel_state":
            yield {"rate_bps": rng.choice([nan, inf, -1.0, 0.0, 1e9]), "per": rng.choice([nan, -0.1, 1.5, 0.01]),
                   "rtt_s": rng.choice([nan, inf, -1.0, 0.05]), "samples": rng.randrange(2**32)}
        else:
            raise ValueError(f"kind: '{kind}' is not one of verdict, hidden_request, hidden_reply, channel_state")
