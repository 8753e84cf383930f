"""The WISV decision head at run time: the exported ONNX head (onnxruntime) and the verifier's judge.

The head maps one mismatch's input ``x = [h_D ; h_T ; c]`` (drafter hidden, target hidden, channel
features of :meth:`link.channel.ChannelState.features`) to a *rejection* probability (SPEC "One
round", step 6; paper Eqs. 23-27). It is trained and exported by :mod:`wisv_ros.wisv.head_training`.

Files (written by ``head_training.export_onnx``):

* ``<name>.onnx``: input ``features`` float32 [n, d_D + d_T + 3] (raw ``[h_D ; h_T ; c]``; the
  normalisation is part of the graph), output ``reject_prob`` float32 [n].
* ``<name>.json``: the sidecar, ``d_draft``, ``d_target``, ``channel_features`` and whatever the
  trainer added (models, training commands).

No rclpy and no training code here: the verifier node loads :class:`OnnxHead` and :func:`make_judge`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from wisv_ros.link.channel import CHANNEL_FEATURES, ChannelState

__all__ = ["N_CHANNEL", "ONNX_INPUT", "ONNX_OUTPUT", "SIDECAR_FORMAT", "OnnxHead", "make_judge", "sidecar_path"]

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


class OnnxHead:
    """A decision head exported by :func:`export_onnx`, run with onnxruntime.

    Args:
        path: the ``.onnx`` file; its JSON sidecar (:func:`sidecar_path`) must sit next to it.
        providers: onnxruntime execution providers; ``None`` = CUDA first when available, else CPU.
        intra_op_threads: CPU threads of the session (the head is tiny: 1 avoids thread overhead).

    Attributes: ``d_draft``, ``d_target``, ``meta`` (the sidecar), ``providers`` (in use).

    Raises:
        FileNotFoundError: the ONNX file or its sidecar is missing.
        ValueError: the sidecar's channel feature layout differs from :data:`link.CHANNEL_FEATURES`
            (the head was trained for another layout) or does not match the graph's input width.
    """

    def __init__(self, path: str | Path, providers: list[str] | None = None, *, intra_op_threads: int = 1) -> None:
        import onnxruntime as ort

        path = Path(path)
        side = sidecar_path(path)
        for p in (path, side):
            if not p.is_file():
                raise FileNotFoundError(f"decision head file missing: {p}")
        self.meta: dict[str, Any] = json.loads(side.read_text(encoding="utf-8"))
        missing = [k for k in ("d_draft", "d_target", "channel_features") if k not in self.meta]
        if missing:
            raise ValueError(f"{side}: sidecar lacks {', '.join(missing)}")
        if list(self.meta["channel_features"]) != list(CHANNEL_FEATURES):
            raise ValueError(
                f"{side}: head trained on channel features {self.meta['channel_features']}, "
                f"this build computes {list(CHANNEL_FEATURES)}; retrain the head"
            )
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

    def reject_prob(self, h_draft: np.ndarray, h_target: np.ndarray, channel_features: np.ndarray) -> np.ndarray:
        """Rejection probabilities float32 [n].

        Args:
            h_draft: [n, d_D] drafter hiddens at the mismatches.
            h_target: [n, d_T] target hiddens at the same positions.
            channel_features: [3] (one channel for all rows) or [n, 3], from ``ChannelState.features()``.
        """
        h_d = np.asarray(h_draft, dtype=np.float32)
        h_t = np.asarray(h_target, dtype=np.float32)
        c = np.asarray(channel_features, dtype=np.float32)
        if h_d.ndim != 2 or h_d.shape[1] != self.d_draft:
            raise ValueError(f"h_draft must be [n, d_D={self.d_draft}], got {h_d.shape}")
        n = h_d.shape[0]
        if h_t.shape != (n, self.d_target):
            raise ValueError(f"h_target must be [n={n}, d_T={self.d_target}], got {h_t.shape}")
        if c.shape == (N_CHANNEL,):
            c = np.broadcast_to(c, (n, N_CHANNEL))
        elif c.shape != (n, N_CHANNEL):
            raise ValueError(
                f"channel_features must be [{N_CHANNEL}] or [n={n}, {N_CHANNEL}] "
                f"({', '.join(CHANNEL_FEATURES)}), got {c.shape}"
            )
        if n == 0:
            return np.zeros(0, np.float32)
        x = np.ascontiguousarray(np.concatenate([h_d, h_t, c], axis=1))
        return self._session.run(None, {self._input_name: x})[0].reshape(n)


def make_judge(head: OnnxHead, channel_getter: Callable[[], ChannelState]
               ) -> Callable[[np.ndarray, list[int], torch.Tensor], torch.Tensor]:
    """The ``judge`` of ``sd.verification.Verifier``: the head with the channel of the moment.

    ``judge(drafter_hidden, positions, target_hidden)`` returns the [len(positions)] float32 rejection
    probabilities at the mismatch positions, from ``drafter_hidden[positions]`` ([K, d_D] numpy; under
    SH only the asked rows need to be filled), ``target_hidden[positions]`` ([K+1, d_T] torch; row i is
    the target hidden at draft position i) and the channel that ``channel_getter()`` returns at call
    time. ``head`` is an :class:`OnnxHead` or anything with the same ``reject_prob(h_draft, h_target,
    channel_features)``.

    Raises (from the judge): ValueError when a position is out of range; TypeError when the getter
    does not return a ChannelState.
    """

    def judge(drafter_hidden: np.ndarray, positions: list[int], target_hidden: torch.Tensor) -> torch.Tensor:
        h_block = np.asarray(drafter_hidden)
        idx = np.asarray(positions, dtype=np.int64).reshape(-1)
        k = h_block.shape[0]
        if idx.size and (idx.min() < 0 or idx.max() >= k or idx.max() >= target_hidden.shape[0]):
            raise ValueError(
                f"mismatch positions {idx.tolist()} out of range for {k} drafter hiddens and "
                f"{target_hidden.shape[0]} target hiddens"
            )
        ch = channel_getter()
        if not isinstance(ch, ChannelState):
            raise TypeError(f"channel_getter must return a ChannelState, got {type(ch).__name__}")
        h_t = target_hidden[torch.from_numpy(idx)].detach().to("cpu", torch.float32).numpy()
        return torch.from_numpy(np.asarray(head.reject_prob(h_block[idx], h_t, ch.features()), dtype=np.float32))

    return judge
