"""The WISV decision head at run time: the exported ONNX head (onnxruntime) and the verifier's judge.

The head maps one mismatch's input ``x = [h_D ; h_T ; c]`` (drafter hidden, target hidden, channel
features of :meth:`link.channel.ChannelState.features`) to a *rejection* probability (SPEC "One
round", step 6; paper Eqs. 23-27). It is trained and exported by :mod:`wisv_ros.wisv.head_training`.

Files (written by ``head_training.export_onnx``):

* ``<name>.onnx``: input ``features`` float32 [n, d_D + d_T + 3] (raw ``[h_D ; h_T ; c]``; the
  normalisation is part of the graph), output ``reject_prob`` float32 [n].
* ``<name>.json``: the sidecar, ``d_draft``, ``d_target``, ``channel_features`` and whatever the
  trainer added (models, training commands).

Pre-projected FH uplink: the head's first layer is linear in h_D, so its drafter part
``P(h_D) = W1_D ((h_D - mean_D) / std_D)`` ([n, hidden], e.g. 64 wide) can be computed on the robot
and sent instead of h_D ([n, d_D], 576 or 896 wide). :class:`HeadWeights` reads the graph's
initializers (normalisation and both Linear layers), :class:`DraftProjection` is the robot's part
(:func:`load_projection`: numpy only, no onnxruntime), and the verifier's judge takes
:class:`ProjectedHidden` rows in place of h_D and runs the rest of the MLP in numpy
(:meth:`OnnxHead.reject_prob_projected`; same probabilities as the graph, checked at load).
A projection carries the ``head_id`` of its head (a hash of ``mean_D``, ``std_D`` and ``W1_D``);
a verifier whose head has another id refuses it with :class:`HeadMismatch`.

No rclpy and no training code here: the verifier node loads :class:`OnnxHead` and :func:`make_judge`,
the drafter node :func:`load_projection`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from wisv_ros.link.channel import CHANNEL_FEATURES, ChannelState

__all__ = [
    "HEAD_MISMATCH",
    "N_CHANNEL",
    "ONNX_INPUT",
    "ONNX_OUTPUT",
    "SIDECAR_FORMAT",
    "DraftProjection",
    "HeadJudge",
    "HeadMismatch",
    "HeadSplitError",
    "HeadWeights",
    "OnnxHead",
    "ProjectedHidden",
    "check_head_id",
    "load_projection",
    "make_judge",
    "sidecar_path",
]

N_CHANNEL = len(CHANNEL_FEATURES)
ONNX_INPUT = "features"
ONNX_OUTPUT = "reject_prob"
SIDECAR_FORMAT = "wisv_decision_head/1"


def sidecar_path(onnx_path: str | Path) -> Path:
    """The JSON sidecar next to an ONNX head: ``head.onnx`` -> ``head.json``."""
    return Path(onnx_path).with_suffix(".json")


def _default_providers() -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    return (["CUDAExecutionProvider"] if "CUDAExecutionProvider" in available else []) + ["CPUExecutionProvider"]


def _read_sidecar(path: Path) -> dict[str, Any]:
    """The sidecar of the head ``path`` (both files must exist), checked for the keys and channel layout."""
    side = sidecar_path(path)
    for p in (path, side):
        if not p.is_file():
            raise FileNotFoundError(f"decision head file missing: {p}")
    meta: dict[str, Any] = json.loads(side.read_text(encoding="utf-8"))
    missing = [k for k in ("d_draft", "d_target", "channel_features") if k not in meta]
    if missing:
        raise ValueError(f"{side}: sidecar lacks {', '.join(missing)}")
    if list(meta["channel_features"]) != list(CHANNEL_FEATURES):
        raise ValueError(
            f"{side}: head trained on channel features {meta['channel_features']}, "
            f"this build computes {list(CHANNEL_FEATURES)}; retrain the head"
        )
    return meta


def _check_rows(name: str, width_name: str, width: int, first: Any, h_target: Any, d_target: int,
                channel_features: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 ([n, width], [n, d_T], [n, 3]) of one head call; ValueError names the bad argument."""
    a = np.asarray(first, dtype=np.float32)
    h_t = np.asarray(h_target, dtype=np.float32)
    c = np.asarray(channel_features, dtype=np.float32)
    if a.ndim != 2 or a.shape[1] != width:
        raise ValueError(f"{name} must be [n, {width_name}={width}], got {a.shape}")
    n = a.shape[0]
    if h_t.shape != (n, d_target):
        raise ValueError(f"h_target must be [n={n}, d_T={d_target}], got {h_t.shape}")
    if c.shape == (N_CHANNEL,):
        c = np.broadcast_to(c, (n, N_CHANNEL))
    elif c.shape != (n, N_CHANNEL):
        raise ValueError(
            f"channel_features must be [{N_CHANNEL}] or [n={n}, {N_CHANNEL}] "
            f"({', '.join(CHANNEL_FEATURES)}), got {c.shape}"
        )
    return a, h_t, c


# --------------------------------------------------------------------------- the split head
class HeadSplitError(ValueError):
    """The head's graph is not the exported MLP (Sub, Div, Gemm, Relu, Gemm, Squeeze, Sigmoid), or the
    split computes other probabilities than the graph: it takes no drafter projections."""


class HeadMismatch(ValueError):
    """Drafter rows projected by another decision head than the verifier's (their ``head_id`` differs).

    The message starts with the field, ``head_id:``, like every refusal of the round protocol.
    """


#: Start of the error of a drafter projection that the verifier's head cannot take (``HeadMismatch``).
HEAD_MISMATCH = "head_id: the drafter projected its hiddens with decision head"


def check_head_id(got: str, have: str) -> None:
    """Raise :class:`HeadMismatch` unless rows projected by the head ``got`` may be judged by the head
    ``have`` ('' = a verifier without a head, or with one that takes no projections)."""
    if got != have:
        runs = f"decision head {have}" if have else "no decision head that takes drafter projections"
        raise HeadMismatch(f"{HEAD_MISMATCH} {got[:40]!r}, this verifier runs {runs}; give drafter_node the "
                           "verifier's head_path, or head_path '' to send raw hiddens")


_PROJECTION_ID_FORMAT = b"wisv_ros drafter projection/1"


@dataclass(frozen=True, eq=False)
class DraftProjection:
    """The drafter part of a head's first layer, run on the robot: ``P(h_D) = W1_D ((h_D - mean_D) / std_D)``.

    Attributes: ``head_id`` (names the projection: equal for heads whose drafter part is equal),
    ``mean``/``std`` [d_D] (the head's normalisation of the drafter columns), ``weight`` [hidden, d_D]
    (the first Linear layer's drafter columns). The bias is left to the verifier.
    """

    head_id: str
    mean: np.ndarray
    std: np.ndarray
    weight: np.ndarray

    @property
    def d_draft(self) -> int:
        return int(self.weight.shape[1])

    @property
    def hidden(self) -> int:
        """Width of a projected row (the head's hidden width)."""
        return int(self.weight.shape[0])

    def __call__(self, h_draft: np.ndarray) -> np.ndarray:
        """float32 [n, hidden] projections of the drafter hiddens ``h_draft`` [n, d_D]."""
        h = np.asarray(h_draft, dtype=np.float32)
        if h.ndim != 2 or h.shape[1] != self.d_draft:
            raise ValueError(f"h_draft must be [n, d_D={self.d_draft}], got {h.shape}")
        return np.ascontiguousarray(((h - self.mean) / self.std) @ self.weight.T, dtype=np.float32)


@dataclass(frozen=True)
class ProjectedHidden:
    """Drafter rows that travelled pre-projected: ``rows`` [K, hidden] float32 (under SH the rows not
    asked for are 0), made by the decision head ``head_id``. The verifier's judge (:class:`HeadJudge`)
    takes it in place of the [K, d_D] drafter hiddens."""

    rows: np.ndarray
    head_id: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.rows.shape)

    @property
    def ndim(self) -> int:
        return int(self.rows.ndim)


@dataclass(frozen=True, eq=False)
class HeadWeights:
    """The parameters of an exported head, read from its ONNX initializers (:meth:`from_onnx`).

    ``p = sigmoid(w2 . relu(w1 ((x - mean) / std) + b1) + b2)`` for raw rows ``x = [h_D ; h_T ; c]``;
    ``mean``/``std`` [d_in], ``w1`` [hidden, d_in], ``b1`` [hidden], ``w2`` [hidden], ``b2`` (float).
    Split: columns ``[:d_draft]`` are the drafter part (:meth:`projection`), the rest the verifier's.
    """

    d_draft: int
    d_target: int
    mean: np.ndarray
    std: np.ndarray
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: float

    @property
    def hidden(self) -> int:
        return int(self.w1.shape[0])

    @classmethod
    def from_onnx(cls, path: str | Path, d_draft: int, d_target: int) -> "HeadWeights":
        """Follow the graph from its input: Sub(mean), Div(std), Gemm(w1, b1), Relu, Gemm(w2, b2),
        [Squeeze], Sigmoid, taking each constant operand from the initializers (HeadSplitError
        otherwise). Needs the ``onnx`` package (ImportError without it)."""
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(path))
        g = model.graph
        init = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in g.initializer}
        nodes = [n for n in g.node if n.op_type != "Constant"]
        ops = [n.op_type for n in nodes]
        want = "Sub, Div, Gemm, Relu, Gemm, [Squeeze,] Sigmoid"
        if len(g.input) != 1 or len(g.output) != 1:
            raise HeadSplitError(f"{path}: graph has {len(g.input)} inputs and {len(g.output)} outputs, expected 1 and 1")

        def fail(why: str) -> HeadSplitError:
            return HeadSplitError(f"{path}: graph {ops} is not the exported head ({want}): {why}")

        def const(node, i: int) -> np.ndarray:
            if i >= len(node.input) or node.input[i] not in init:
                raise fail(f"{node.op_type} input {i} is not an initializer")
            return init[node.input[i]]

        def gemm(node) -> tuple[np.ndarray, np.ndarray]:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if attrs.get("transA", 0):
                raise fail("Gemm with transA")
            w = const(node, 1)
            w = w if attrs.get("transB", 0) else w.T
            b = const(node, 2) if len(node.input) > 2 and node.input[2] else np.zeros(w.shape[0], np.float32)
            return (float(attrs.get("alpha", 1.0)) * w).astype(np.float32), (float(attrs.get("beta", 1.0)) * b).astype(np.float32)

        tensor, found = g.input[0].name, {}
        for op in ("Sub", "Div", "Gemm", "Relu", "Gemm2", "Squeeze", "Sigmoid"):
            users = [n for n in nodes if tensor in n.input]
            if len(users) != 1:
                raise fail(f"{len(users)} nodes read {tensor!r}")
            node = users[0]
            if op == "Squeeze" and node.op_type != "Squeeze":
                continue  # optional
            if node.op_type != op.rstrip("2") or node.input[0] != tensor:
                raise fail(f"expected {op.rstrip('2')} on {tensor!r}, found {node.op_type}")
            found[op] = node
            tensor = node.output[0]
        if tensor != g.output[0].name:
            raise fail(f"the graph's output is {g.output[0].name!r}, the chain ends in {tensor!r}")
        mean, std = const(found["Sub"], 1).reshape(-1), const(found["Div"], 1).reshape(-1)
        w1, b1 = gemm(found["Gemm"])
        w2, b2 = gemm(found["Gemm2"])
        d_in = d_draft + d_target + N_CHANNEL
        if mean.shape != (d_in,) or std.shape != (d_in,) or w1.shape[1:] != (d_in,) or b1.shape != w1.shape[:1]:
            raise fail(f"shapes mean {mean.shape}, std {std.shape}, w1 {w1.shape}, b1 {b1.shape} for d_in {d_in}")
        if w2.shape != (1, w1.shape[0]) or b2.size != 1:
            raise fail(f"output layer w2 {w2.shape}, b2 {b2.shape}; expected [1, {w1.shape[0]}] and [1]")
        return cls(d_draft, d_target, mean, std, w1, b1, w2.reshape(-1), float(b2.reshape(-1)[0]))

    @property
    def head_id(self) -> str:
        """16 hex digits of the SHA-256 of the drafter part (widths, mean_D, std_D, W1_D as float32)."""
        d = self.d_draft
        h = hashlib.sha256(_PROJECTION_ID_FORMAT)
        h.update(np.asarray([d, self.hidden], "<i8").tobytes())
        for a in (self.mean[:d], self.std[:d], self.w1[:, :d]):
            h.update(np.ascontiguousarray(a, "<f4").tobytes())
        return h.hexdigest()[:16]

    def projection(self) -> DraftProjection:
        """The robot's part of the head."""
        d = self.d_draft
        return DraftProjection(self.head_id, self.mean[:d].copy(), self.std[:d].copy(), np.ascontiguousarray(self.w1[:, :d]))

    def reject_prob_projected(self, p_draft: np.ndarray, h_target: np.ndarray, channel_features: np.ndarray
                              ) -> np.ndarray:
        """Rejection probabilities float32 [n] from projections [n, hidden], target hiddens [n, d_T]
        and channel features [3] or [n, 3]: the rest of the MLP, in numpy."""
        p, h_t, c = _check_rows("p_draft", "hidden", self.hidden, p_draft, h_target, self.d_target, channel_features)
        if p.shape[0] == 0:
            return np.zeros(0, np.float32)
        d, dt = self.d_draft, self.d_draft + self.d_target
        z = (p + ((h_t - self.mean[d:dt]) / self.std[d:dt]) @ self.w1[:, d:dt].T
             + ((c - self.mean[dt:]) / self.std[dt:]) @ self.w1[:, dt:].T + self.b1)
        logit = np.maximum(z, 0.0) @ self.w2 + self.b2
        return (1.0 / (1.0 + np.exp(-logit.astype(np.float64)))).astype(np.float32)


def load_projection(path: str | Path) -> DraftProjection:
    """The robot's part of the head ``path`` (``.onnx`` with its sidecar); needs ``onnx``, not onnxruntime.

    Raises FileNotFoundError, ValueError (sidecar), HeadSplitError (the graph does not split).
    """
    path = Path(path)
    meta = _read_sidecar(path)
    return HeadWeights.from_onnx(path, int(meta["d_draft"]), int(meta["d_target"])).projection()


class OnnxHead:
    """A decision head exported by :func:`export_onnx`, run with onnxruntime.

    Args:
        path: the ``.onnx`` file; its JSON sidecar (:func:`sidecar_path`) must sit next to it.
        providers: onnxruntime execution providers; ``None`` = CUDA first when available, else CPU.
        intra_op_threads: CPU threads of the session (the head is tiny: 1 avoids thread overhead).

    Attributes: ``d_draft``, ``d_target``, ``meta`` (the sidecar), ``providers`` (in use); for drafter
    projections: ``weights`` (:class:`HeadWeights`, None when the graph does not split, ``split_error``
    says why), ``head_id`` ('' then) and ``hidden`` (the projection's width, 0 then).

    Raises:
        FileNotFoundError: the ONNX file or its sidecar is missing.
        ValueError: the sidecar's channel feature layout differs from :data:`link.CHANNEL_FEATURES`
            (the head was trained for another layout) or does not match the graph's input width.
    """

    def __init__(self, path: str | Path, providers: list[str] | None = None, *, intra_op_threads: int = 1) -> None:
        import onnxruntime as ort

        path = Path(path)
        side = sidecar_path(path)
        self.meta: dict[str, Any] = _read_sidecar(path)
        self.d_draft = int(self.meta["d_draft"])
        self.d_target = int(self.meta["d_target"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(
            str(path), sess_options=options, providers=providers or _default_providers()
        )
        self.providers: list[str] = self._session.get_providers()
        inp = self._session.get_inputs()[0]
        self._input_name = inp.name
        width = inp.shape[1] if len(inp.shape) == 2 else None
        if width != self.d_draft + self.d_target + N_CHANNEL:
            raise ValueError(
                f"{path}: graph input width {width} != d_D={self.d_draft} + d_T={self.d_target} "
                f"+ {N_CHANNEL} from {side.name}"
            )
        # The split for pre-projected drafter rows; a graph that does not split still serves raw hiddens.
        self.weights: HeadWeights | None = None
        self.split_error = ""
        try:
            weights = HeadWeights.from_onnx(path, self.d_draft, self.d_target)
            self._check_split(weights)
            self.weights = weights
        except Exception as exc:  # noqa: BLE001 - e.g. HeadSplitError, or no onnx package: raw hiddens only
            self.split_error = f"{type(exc).__name__}: {exc}"
        self.head_id = self.weights.head_id if self.weights is not None else ""
        self.hidden = self.weights.hidden if self.weights is not None else 0

    def reject_prob(self, h_draft: np.ndarray, h_target: np.ndarray, channel_features: np.ndarray) -> np.ndarray:
        """Rejection probabilities float32 [n].

        Args:
            h_draft: [n, d_D] drafter hiddens at the mismatches.
            h_target: [n, d_T] target hiddens at the same positions.
            channel_features: [3] (one channel for all rows) or [n, 3], from ``ChannelState.features()``.
        """
        h_d, h_t, c = _check_rows("h_draft", "d_D", self.d_draft, h_draft, h_target, self.d_target, channel_features)
        n = h_d.shape[0]
        if n == 0:
            return np.zeros(0, np.float32)
        x = np.ascontiguousarray(np.concatenate([h_d, h_t, c], axis=1))
        return self._session.run(None, {self._input_name: x})[0].reshape(n)

    def reject_prob_projected(self, p_draft: np.ndarray, h_target: np.ndarray, channel_features: np.ndarray
                              ) -> np.ndarray:
        """Rejection probabilities float32 [n] from the drafter's projection instead of its hiddens.

        Args:
            p_draft: [n, hidden] ``DraftProjection`` rows of this head (``head_id``) at the mismatches.
            h_target, channel_features: as in :meth:`reject_prob`.

        Raises HeadSplitError when this head's graph could not be split (``split_error``).
        """
        if self.weights is None:
            raise HeadSplitError(f"this decision head takes no drafter projections ({self.split_error})")
        return self.weights.reject_prob_projected(p_draft, h_target, channel_features)

    def _check_split(self, weights: HeadWeights) -> None:
        """The split computes what the graph computes: a few random rows through both (HeadSplitError)."""
        rng = np.random.default_rng(0)
        d_h = self.d_draft + self.d_target
        x = (weights.mean[:d_h] + weights.std[:d_h] * rng.standard_normal((4, d_h))).astype(np.float32)
        h_d, h_t = x[:, :self.d_draft], x[:, self.d_draft:]
        c = rng.random((4, N_CHANNEL)).astype(np.float32)
        graph = self.reject_prob(h_d, h_t, c)
        split = weights.reject_prob_projected(weights.projection()(h_d), h_t, c)
        if not np.allclose(graph, split, atol=1e-4, rtol=0):
            raise HeadSplitError(f"the split head gives {split.tolist()}, the graph {graph.tolist()}")


class HeadJudge:
    """The ``judge`` of ``sd.verification.Verifier``: the head with the channel of the moment.

    ``judge(drafter_hidden, positions, target_hidden)`` returns the [len(positions)] float32 rejection
    probabilities at the mismatch positions, from ``drafter_hidden[positions]`` ([K, d_D] numpy; under
    SH only the asked rows need to be filled), ``target_hidden[positions]`` ([K+1, d_T] torch; row i is
    the target hidden at draft position i) and the channel that ``channel_getter()`` returns at call
    time. ``drafter_hidden`` may instead be a :class:`ProjectedHidden` ([K, hidden] projections of the
    head ``head_id``): rows of another head are refused with :class:`HeadMismatch`.

    ``head`` is an :class:`OnnxHead` or anything with the same ``reject_prob(h_draft, h_target,
    channel_features)`` (and, for projections, ``reject_prob_projected`` and ``head_id``).
    ``head_id``: the id of the projections this judge takes ('' = none; ``EdgeSessions`` reads it).

    Raises (from the call): ValueError when a position is out of range or a width is wrong;
    HeadMismatch; TypeError when the getter does not return a ChannelState.
    """

    def __init__(self, head: Any, channel_getter: Callable[[], ChannelState]) -> None:
        self.head = head
        self.channel_getter = channel_getter
        self.head_id: str = str(getattr(head, "head_id", "") or "")

    def __call__(self, drafter_hidden: np.ndarray | ProjectedHidden, positions: list[int],
                 target_hidden: torch.Tensor) -> torch.Tensor:
        projected = isinstance(drafter_hidden, ProjectedHidden)
        if projected:
            check_head_id(drafter_hidden.head_id, self.head_id)
            h_block = np.asarray(drafter_hidden.rows)
        else:
            h_block = np.asarray(drafter_hidden)
        idx = np.asarray(positions, dtype=np.int64).reshape(-1)
        k = h_block.shape[0]
        if idx.size and (idx.min() < 0 or idx.max() >= k or idx.max() >= target_hidden.shape[0]):
            raise ValueError(
                f"mismatch positions {idx.tolist()} out of range for {k} drafter hiddens and "
                f"{target_hidden.shape[0]} target hiddens"
            )
        ch = self.channel_getter()
        if not isinstance(ch, ChannelState):
            raise TypeError(f"channel_getter must return a ChannelState, got {type(ch).__name__}")
        h_t = target_hidden[torch.from_numpy(idx)].detach().to("cpu", torch.float32).numpy()
        score = self.head.reject_prob_projected if projected else self.head.reject_prob
        return torch.from_numpy(np.asarray(score(h_block[idx], h_t, ch.features()), dtype=np.float32))


def make_judge(head: OnnxHead, channel_getter: Callable[[], ChannelState]) -> HeadJudge:
    """The verifier's judge over ``head`` (:class:`HeadJudge`)."""
    return HeadJudge(head, channel_getter)
