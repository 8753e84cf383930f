"""SwitchSD copy probe at run time: a bias-free linear probe on one layer of the target.

``CopyProbe.fires(h)`` is ``sigmoid(wᵀh) >= threshold`` on the target's hidden state at the last
committed position; the verifier copies from the context only when it fires (``switchsd.copying``).
Probes are trained and saved by :mod:`wisv_ros.switchsd.probe_training`.

No rclpy and no training code here.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["SIDECAR_FORMAT", "CopyProbe", "load_probe"]


SIDECAR_FORMAT = "wisv_copy_probe/1"


def _sigmoid(x: np.ndarray | float) -> np.ndarray | float:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


@dataclasses.dataclass
class CopyProbe:
    """A trained copy probe on the hidden states of one (layer, kind) of the target.

    ``prob(h) = sigmoid(wᵀh)`` on the raw captured hidden state (``Step.layers[(layer, kind)]``);
    ``fires(h)`` is ``prob(h) >= threshold``. A row [d] gives a float / bool, a matrix [n, d] arrays.
    """

    w: np.ndarray  # [d] float32
    layer: int
    kind: str
    threshold: float
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def d_model(self) -> int:
        return int(self.w.size)

    def logit(self, hidden: Any) -> np.ndarray | float:
        if isinstance(hidden, torch.Tensor):
            hidden = hidden.detach().float().cpu().numpy()
        h = np.asarray(hidden, dtype=np.float64)
        if h.shape[-1] != self.d_model or h.ndim not in (1, 2):
            raise ValueError(f"hidden must be [{self.d_model}] or [n, {self.d_model}], got {h.shape}")
        z = h @ self.w.astype(np.float64)
        return float(z) if h.ndim == 1 else z

    def prob(self, hidden: Any) -> np.ndarray | float:
        p = _sigmoid(self.logit(hidden))
        return float(p) if np.ndim(p) == 0 else p

    def fires(self, hidden: Any) -> np.ndarray | bool:
        p = self.prob(hidden)
        return bool(p >= self.threshold) if isinstance(p, float) else p >= self.threshold


def load_probe(path: str | Path) -> CopyProbe:
    """Read a probe written by :func:`save_probe` (the .npz and its JSON sidecar)."""
    path = Path(path)
    side = _sidecar(path)
    if not path.is_file() or not side.is_file():
        raise FileNotFoundError(f"copy probe needs {path} and {side}")
    info = json.loads(side.read_text())
    if info.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"{side}: format {info.get('format')!r}, expected {SIDECAR_FORMAT!r}")
    with np.load(path) as z:
        w = z["w"].astype(np.float32)
    if w.size != info["d_model"]:
        raise ValueError(f"{path}: w has {w.size} values, the sidecar says d_model={info['d_model']}")
    meta = {k: v for k, v in info.items() if k not in ("format", "npz", "layer", "kind", "threshold", "d_model")}
    return CopyProbe(w=w, layer=int(info["layer"]), kind=info["kind"], threshold=float(info["threshold"]), meta=meta)
