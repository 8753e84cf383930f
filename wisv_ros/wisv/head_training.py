"""The WISV decision head: the module, its training (torch) and its export to ONNX (run by ``wisv.head``).

The head maps one mismatch's input ``x = [h_D ; h_T ; c]`` (drafter hidden, target hidden, channel
features of :meth:`link.ChannelState.features`) to a *rejection* probability (SPEC "One round",
step 6; paper Eqs. 23-27):  ``p = sigmoid(W2 dropout(relu(W1 norm(x) + b1)) + b2)``.

``norm`` standardises the hidden parts with the training set's per-feature mean and std, stored in
the head as buffers; the channel features are already on a unit scale (link.py) and pass through.
The normalisation is part of :meth:`DecisionHead.forward` and therefore of the exported ONNX graph,
so every consumer feeds raw hiddens.

Files written by :func:`export_onnx`:

* ``<name>.onnx``: input ``features`` float32 [n, d_D + d_T + 3] (raw ``[h_D ; h_T ; c]``),
  output ``reject_prob`` float32 [n]; opset 17, TorchScript exporter (see :func:`export_onnx`).
* ``<name>.json``: the sidecar, ``d_draft``, ``d_target``, ``channel_features`` and whatever the
  caller adds (models, training commands).

No rclpy here. Runtime code never imports this module (it pulls in torch.nn and tqdm).
"""
from __future__ import annotations

import copy
import json
import math
import numbers
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from wisv_ros.eval.scoring import roc_auc
from wisv_ros.link.channel import CHANNEL_FEATURES
from wisv_ros.wisv.head import N_CHANNEL, ONNX_INPUT, ONNX_OUTPUT, SIDECAR_FORMAT, sidecar_path

__all__ = [
    "DecisionHead",
    "EpochStats",
    "TrainHistory",
    "export_onnx",
    "train_head",
]

ONNX_OPSET = 17
_STD_FLOOR = 1e-6  # a feature with a smaller training std (e.g. one channel only) is only centred


# --------------------------------------------------------------------------- the module


class DecisionHead(nn.Module):
    """Linear(d_in, hidden) -> ReLU -> Dropout(p) -> Linear(hidden, 1) on normalised inputs.

    Args:
        d_draft: d_D, width of the drafter hidden state.
        d_target: d_T, width of the target hidden state.
        hidden: width of the hidden layer (the paper's d_J).
        dropout: dropout probability in [0, 1).

    ``d_in = d_draft + d_target + len(CHANNEL_FEATURES)``. The buffers ``feature_mean`` and
    ``feature_std`` [d_in] hold the input normalisation (identity until :meth:`fit_normalization`).
    """

    def __init__(self, d_draft: int, d_target: int, hidden: int = 256, dropout: float = 0.1) -> None:
        super().__init__()
        for name, value in (("d_draft", d_draft), ("d_target", d_target), ("hidden", hidden)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        d_draft, d_target, hidden = int(d_draft), int(d_target), int(hidden)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.d_draft = d_draft
        self.d_target = d_target
        self.hidden = hidden
        self.d_in = d_draft + d_target + N_CHANNEL
        self.register_buffer("feature_mean", torch.zeros(self.d_in))
        self.register_buffer("feature_std", torch.ones(self.d_in))
        self.mlp = nn.Sequential(
            nn.Linear(self.d_in, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1)
        )

    def fit_normalization(self, X: np.ndarray | torch.Tensor) -> None:
        """Set the per-feature mean/std of every column (hidden and channel) from training rows X [n, d_in].

        The channel columns are standardised like the hidden ones: ``ChannelState.features()`` puts
        them on a fixed scale of about 0-1, but across the training channels their spread is a
        fraction of that, and unstandardised they learn far slower than the hidden columns.
        """
        x = torch.as_tensor(np.asarray(X, dtype=np.float32))
        self._check_width(x)
        mean = x.double().mean(0).float()
        s = x.double().std(0, unbiased=False).float()
        self.feature_mean.copy_(mean)
        self.feature_std.copy_(torch.where(s > _STD_FLOOR, s, torch.ones_like(s)))

    def _check_width(self, x: torch.Tensor) -> None:
        if x.ndim != 2 or x.shape[1] != self.d_in:
            raise ValueError(
                f"decision head input must be [n, d_in={self.d_in}] (d_D={self.d_draft} + "
                f"d_T={self.d_target} + {N_CHANNEL} channel features), got {tuple(x.shape)}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [n] of the rejection probability for raw rows x [n, d_in]."""
        if not torch.jit.is_tracing():
            self._check_width(x)
        z = (x - self.feature_mean) / self.feature_std
        return self.mlp(z).squeeze(-1)

    def reject_prob(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Rejection probabilities [n] = sigmoid(forward(x)) (no gradient)."""
        with torch.no_grad():
            return torch.sigmoid(self(torch.as_tensor(np.asarray(x, dtype=np.float32))))


# --------------------------------------------------------------------------- training




@dataclass(frozen=True)
class EpochStats:
    """Metrics after one epoch. Accuracy and AUC binarise the (possibly soft) labels at 0.5."""

    epoch: int  # 1-based
    train_loss: float  # mean BCE over the epoch's batches
    val_loss: float
    val_accuracy: float
    val_auc: float


@dataclass
class TrainHistory:
    """Per-epoch metrics and the epochs (1-based) whose weights the returned head holds.

    ``epochs``/``best_epoch``: the joint stage (all weights). ``channel_epochs``/``channel_best_epoch``:
    the channel stage (see :func:`train_head`); ``channel_best_epoch`` is 0 when no channel epoch
    lowered the validation loss (or the stage was off), i.e. the head is the joint stage's best.
    """

    epochs: list[EpochStats] = field(default_factory=list)
    best_epoch: int = 0
    channel_epochs: list[EpochStats] = field(default_factory=list)
    channel_best_epoch: int = 0

    @property
    def best(self) -> EpochStats:
        """Metrics of the returned head."""
        if self.channel_best_epoch:
            return self.channel_epochs[self.channel_best_epoch - 1]
        return self.epochs[self.best_epoch - 1]


def _as_xy(name: str, X: Any, y: Any, d_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = np.asarray(X, dtype=np.float32)
    t = np.asarray(y, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != d_in:
        raise ValueError(f"{name}: X must be [n, d_in={d_in}], got {x.shape}")
    if t.shape != (x.shape[0],):
        raise ValueError(f"{name}: y must be [n={x.shape[0]}], got {t.shape}")
    if t.size and (t.min() < 0 or t.max() > 1):
        raise ValueError(f"{name}: labels must lie in [0, 1]")
    return torch.from_numpy(x), torch.from_numpy(t)


def train_head(
    X: np.ndarray,
    y: np.ndarray,
    X_val: np.ndarray,
    y_val: np.ndarray,
    *,
    d_draft: int,
    hidden: int = 256,
    dropout: float = 0.1,
    epochs: int = 30,
    lr: float = 1e-3,
    weight_decay: float = 1e-4,
    batch_size: int = 256,
    channel_epochs: int = 30,
    channel_lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> tuple[DecisionHead, TrainHistory]:
    """Train a :class:`DecisionHead` with BCE (soft labels allowed) and AdamW; keep the best epoch.

    Two stages, each keeping the epoch with the lowest validation loss:

    1. *joint*: all weights, ``epochs`` epochs of AdamW (``lr``, ``weight_decay``);
    2. *channel*: from the joint stage's best weights, only the channel columns of the first layer
       move, ``channel_epochs`` epochs of Adam at ``channel_lr`` without weight decay; every other
       weight and both biases stay frozen. ``channel_epochs=0`` skips it.

    Why the channel stage: with a few hundred labelled mismatches of ~2,000 hidden features, the
    joint stage memorises the training answers within 1-2 epochs, long before the three channel
    weights have moved, and the head comes out blind to the channel. With the hidden weights
    frozen, the only thing left to learn is how the relabeled target shifts with the channel.
    The biases stay frozen because the answers differ in their share of critical mismatches:
    refitting the biases to the training answers' share moves every validation score with it.

    Args:
        X, y: training rows [n, d_D + d_T + 3] (``[h_D ; h_T ; c]``) and labels in [0, 1] [n]
            (1 = repair = reject), e.g. from :func:`relabel.make_instances`.
        X_val, y_val: validation rows and labels; the returned head has the weights of the epoch
            with the lowest validation loss.
        d_draft: d_D, where the drafter part of a row ends (d_T is the rest minus the channel).
        seed: seeds initialisation, shuffling and dropout; the global torch RNG is left untouched.
        progress: show a tqdm bar over the epochs with the validation metrics.

    Returns the head (eval mode) and its :class:`TrainHistory`.
    """
    x_np = np.asarray(X)
    if x_np.ndim != 2:
        raise ValueError(f"X must be [n, d_in], got shape {x_np.shape}")
    d_target = x_np.shape[1] - d_draft - N_CHANNEL
    if d_target < 1:
        raise ValueError(f"X has {x_np.shape[1]} columns: too few for d_D={d_draft} + d_T + {N_CHANNEL}")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
    if channel_epochs < 0 or not channel_lr > 0:
        raise ValueError(f"channel_epochs must be >= 0 and channel_lr > 0, got {channel_epochs} and {channel_lr}")
    d_in = x_np.shape[1]
    x, t = _as_xy("train", X, y, d_in)
    xv, tv = _as_xy("validation", X_val, y_val, d_in)
    if x.shape[0] == 0 or xv.shape[0] == 0:
        raise ValueError("training and validation sets must not be empty")
    history = TrainHistory()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = DecisionHead(d_draft, d_target, hidden=hidden, dropout=dropout)
        head.fit_normalization(x)
        opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
        loss_fn = nn.BCEWithLogitsLoss()
        shuffle = torch.Generator().manual_seed(seed)
        best_loss = math.inf
        best_state: dict[str, torch.Tensor] = {}
        hard = tv.numpy() >= 0.5

        def run_epoch(epoch: int, grad_mask: torch.Tensor | None) -> EpochStats:
            head.train()
            total, n_seen = 0.0, 0
            for idx in torch.randperm(x.shape[0], generator=shuffle).split(batch_size):
                opt.zero_grad()
                loss = loss_fn(head(x[idx]), t[idx])
                loss.backward()
                if grad_mask is not None:
                    first.weight.grad.mul_(grad_mask)
                opt.step()
                total += loss.item() * idx.numel()
                n_seen += idx.numel()
            head.eval()
            with torch.no_grad():
                logits = head(xv)
            prob = torch.sigmoid(logits).numpy()
            return EpochStats(epoch=epoch, train_loss=total / n_seen, val_loss=float(loss_fn(logits, tv)),
                              val_accuracy=float(np.mean((prob >= 0.5) == hard)), val_auc=roc_auc(prob, hard))

        def run_stage(stage: str, n_epochs: int, grad_mask: torch.Tensor | None, log: list[EpochStats]) -> int:
            """Train n_epochs; returns the epoch (1-based) that lowered the best validation loss last, or 0."""
            nonlocal best_loss, best_state
            best = 0
            for epoch in range(1, n_epochs + 1):
                stats = run_epoch(epoch, grad_mask)
                log.append(stats)
                if stats.val_loss < best_loss:
                    best_loss, best = stats.val_loss, epoch
                    best_state = copy.deepcopy(head.state_dict())
                bar.update()
                bar.set_postfix(stage=stage, val_loss=f"{stats.val_loss:.4f}", acc=f"{stats.val_accuracy:.3f}",
                                auc=f"{stats.val_auc:.3f}")
            return best

        first = head.mlp[0]
        bar = tqdm(total=epochs + channel_epochs, desc="decision head", unit="epoch", disable=not progress)
        history.best_epoch = run_stage("joint", epochs, None, history.epochs)
        if channel_epochs:
            head.load_state_dict(best_state)
            for p in head.parameters():
                p.requires_grad_(False)
            first.weight.requires_grad_(True)
            grad_mask = torch.zeros_like(first.weight)
            grad_mask[:, head.d_draft + head.d_target:] = 1.0
            opt = torch.optim.Adam([first.weight], lr=channel_lr)
            history.channel_best_epoch = run_stage("channel", channel_epochs, grad_mask, history.channel_epochs)
            for p in head.parameters():
                p.requires_grad_(True)
        bar.close()
    head.load_state_dict(best_state)
    head.eval()
    return head, history


# --------------------------------------------------------------------------- ONNX export




class _ProbabilityGraph(nn.Module):
    """What is exported: raw rows in, rejection probabilities out."""

    def __init__(self, head: DecisionHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(x))


def export_onnx(head: DecisionHead, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write ``path`` (ONNX, normalisation included) and its JSON sidecar; return the sidecar path.

    The sidecar holds ``format``, ``onnx`` (file name), ``input``/``output`` names, ``d_draft``,
    ``d_target``, ``d_in``, ``hidden``, ``channel_features``, ``opset``, then the caller's ``meta``
    (models, training commands, metrics...; JSON-serialisable). ``meta`` may repeat a generated
    key only with the same value.

    Exporter: torch 2.13 defaults to the torch.export-based exporter, which needs ``onnxscript``
    (not a dependency of wisv_ros); the TorchScript exporter (``dynamo=False``) works for this MLP,
    and its deprecation warning is silenced here.
    """
    path = Path(path)
    info: dict[str, Any] = {
        "format": SIDECAR_FORMAT,
        "onnx": path.name,
        "input": ONNX_INPUT,
        "output": ONNX_OUTPUT,
        "d_draft": head.d_draft,
        "d_target": head.d_target,
        "d_in": head.d_in,
        "hidden": head.hidden,
        "channel_features": list(CHANNEL_FEATURES),
        "opset": ONNX_OPSET,
    }
    for key, value in (meta or {}).items():
        if key in info and info[key] != value:
            raise ValueError(f"meta[{key!r}] = {value!r} contradicts the head ({info[key]!r})")
        info[key] = value
    text = json.dumps(info, indent=2)  # fail before writing anything if meta is not JSON
    graph = _ProbabilityGraph(copy.deepcopy(head).cpu().eval())
    dummy = torch.zeros(2, head.d_in)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*legacy TorchScript-based ONNX export", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r"The feature will be removed", category=DeprecationWarning)
        torch.onnx.export(
            graph,
            (dummy,),
            str(path),
            input_names=[ONNX_INPUT],
            output_names=[ONNX_OUTPUT],
            dynamic_axes={ONNX_INPUT: {0: "n"}, ONNX_OUTPUT: {0: "n"}},
            opset_version=ONNX_OPSET,
            dynamo=False,
        )
    side = sidecar_path(path)
    side.write_text(text + "\n", encoding="utf-8")
    return side


# --------------------------------------------------------------------------- inference






