"""The decision heads shipped in config/heads/ for the default pair: what their sidecars say, and that
the command recorded in each sidecar, run on the committed traces, rebuilds the same head."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from wisv_ros.cli.train_head import episodes_from_traces, main as train_main
from wisv_ros.wisv.head import OnnxHead, sidecar_path
from wisv_ros.link.channel import SCENARIOS
from wisv_ros.sd.models import DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[1]
HEADS = {"default.onnx": True, "default_no_csi.onnx": False}  # file -> trained with CSI relabeling
TRACES = ROOT / "data" / "traces" / "default"
HEAD_DRAFTER = "smollm2-135m-instruct"  # the pair the shipped heads and the committed traces are of


def stacked(folders: list[Path], label: str = "critical") -> tuple:
    """(drafter hiddens, target hiddens, labels, answers) of every completely labelled answer of ``folders``."""
    episodes, _, _, _ = episodes_from_traces(folders, label=label)
    return (np.concatenate([e.h_draft for e in episodes]), np.concatenate([e.h_target for e in episodes]),
            np.concatenate([e.labels for e in episodes]), len(episodes))


def channel_gaps(h_d, h_t, csi_head: str, no_csi_head: str) -> tuple[float, float]:
    """Mean rejection at 500 Mbit/s / 5 ms minus at 20 Mbit/s / 50 ms, for the CSI head and its ablation."""

    def mean_reject(name: str, scenario: str) -> float:
        head = OnnxHead(ROOT / "config" / "heads" / name)
        return float(head.reject_prob(h_d, h_t, SCENARIOS[scenario].features()).mean())

    return tuple(mean_reject(n, "500mbps_5ms") - mean_reject(n, "20mbps_50ms") for n in (csi_head, no_csi_head))


@pytest.fixture(scope="module")
def labelled():
    """The mismatches the heads train on: every labelled problem whose labelling is complete."""
    return stacked([TRACES])[:3]


@pytest.mark.parametrize("name,csi", HEADS.items())
def test_sidecar_describes_the_default_pair(name, csi, labelled):
    head = OnnxHead(ROOT / "config" / "heads" / name)
    meta = head.meta
    assert (meta["drafter"], meta["target"]) == (HEAD_DRAFTER, DEFAULT_TARGET)
    assert (head.d_draft, head.d_target) == (576, 1536)  # SmolLM2-135M and Qwen2.5-Coder-1.5B hidden sizes
    assert meta["csi_relabeling"] is csi
    assert meta["command"].startswith("python -m wisv_ros.cli.train_head --traces data/traces/default ")
    # The nested cross-validation ran over every labelled problem of the committed traces.
    h_d, _, labels = labelled
    assert meta["cv"]["mismatches"] == len(labels) and meta["cv"]["critical"] == int(labels.sum())
    assert min(meta["cv"]["auc"].values()) > 0.6


@pytest.mark.parametrize("name", HEADS)
def test_recorded_command_rebuilds_the_shipped_head(name, labelled, tmp_path, monkeypatch):
    shipped = ROOT / "config" / "heads" / name
    argv = shlex.split(json.loads(sidecar_path(shipped).read_text())["command"])[3:]
    argv = [a for a in argv if a != "--cv"]  # the cross-validation only adds metrics (one training per problem)
    out = tmp_path / name
    argv[argv.index("--out") + 1] = str(out)
    monkeypatch.chdir(ROOT)  # the command names the trace folder relative to the checkout
    assert train_main(argv) == 0
    h_d, h_t, _ = labelled
    rebuilt, original = OnnxHead(out), OnnxHead(shipped)
    assert json.loads(sidecar_path(out).read_text())["best_epoch"] == original.meta["best_epoch"]
    for ch in SCENARIOS.values():
        np.testing.assert_allclose(rebuilt.reject_prob(h_d, h_t, ch.features()),
                                   original.reject_prob(h_d, h_t, ch.features()), atol=1e-3)
    assert json.loads(sidecar_path(out).read_text())["channel_best_epoch"] == original.meta["channel_best_epoch"]


def test_shipped_head_is_more_permissive_on_the_worse_channel(labelled):
    """Same hiddens (the mismatches the heads train on), worse channel => lower rejection probability.

    The relabeled targets set the size of the effect: at a 0.1 s round, 20 Mbit/s / 50 ms keeps about
    two thirds of the critical labels that 500 Mbit/s / 5 ms keeps. The no-CSI ablation, trained on
    labels that ignore the channel, must react far less.
    """
    h_d, h_t, _ = labelled
    gap, gap_no_csi = channel_gaps(h_d, h_t, "default.onnx", "default_no_csi.onnx")
    assert gap > 0.02, gap
    assert abs(gap_no_csi) < gap / 2, (gap, gap_no_csi)


# The heads of the default pair (Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B, both GGUF on
# llama.cpp), trained on the four committed qwen trace folders with harmful labels (a right final answer
# turns wrong). Their rebuild from the sidecar command (CV included) takes minutes; the rebuild above
# checks the same training code.
QWEN_HEADS = {"qwen.onnx": True, "qwen_no_csi.onnx": False}
QWEN_TRACES = [ROOT / "data" / "traces" / f for f in ("qwen", "qwen_s1", "qwen_s2", "qwen_s3")]


@pytest.fixture(scope="module")
def qwen_labelled():
    return stacked(QWEN_TRACES, label="harmful")


@pytest.mark.parametrize("name,csi", QWEN_HEADS.items())
def test_default_pair_head_sidecar_matches_the_committed_labels(name, csi, qwen_labelled):
    from wisv_ros.link.channel import TauSchedule

    head = OnnxHead(ROOT / "config" / "heads" / name)
    meta = head.meta
    assert meta["drafter"].startswith("qwen2.5-coder-0.5b-instruct") and meta["target"].startswith("qwen2.5-coder-1.5b-instruct")
    assert (head.d_draft, head.d_target) == (896, 1536)  # Qwen2.5-Coder-0.5B and -1.5B hidden sizes
    assert meta["csi_relabeling"] is csi and meta["label"] == "harmful"
    cmd = meta["command"]
    assert all(f"--traces data/traces/{p.name} " in cmd for p in QWEN_TRACES) and f"--out config/heads/{name} " in cmd
    # Its cross-validation ran over every completely labelled answer of the committed folders.
    _, _, labels, answers = qwen_labelled
    cv = meta["cv"]
    assert (cv["problems"], cv["mismatches"], cv["critical"]) == (answers, len(labels), int(labels.sum()))
    assert meta["train_problems"] + meta["val_problems"] == cv["problems"]
    assert min(cv["auc"].values()) > 0.62  # grouped 5-fold CV by answer against harmful labels: 0.67-0.68 when shipped
    # The tau schedule chosen with the head (the verifier's tau_per_channel "head"), within the budgets:
    # the whole budget on the worst channel, less on the others.
    schedule = TauSchedule.parse(meta["tau_per_channel"])
    assert set(schedule.taus) == set(SCENARIOS) and meta["tau_per_channel"] == cv["tau_per_channel"]
    budgets = cv["accuracy_budget"]
    assert budgets["20mbps_50ms"] == max(budgets.values()) and budgets["500mbps_5ms"] == min(budgets.values())


def test_default_pair_head_is_more_permissive_on_the_worse_channel(qwen_labelled):
    h_d, h_t, _, _ = qwen_labelled
    gap, gap_no_csi = channel_gaps(h_d, h_t, "qwen.onnx", "qwen_no_csi.onnx")
    # With harmful labels the relabeling has little to relax (most answers hold one or two, and the budget
    # ceil(q n) keeps a lone one on every channel), so the CSI head's own response is small: shipped, 0.0053
    # on these mismatches against the ablation's 0.0035 (held out: 0.0043 against -0.0021). Most of WISV's
    # channel dependence comes from the tau per channel in the sidecar.
    assert gap > 0.004, gap
    assert gap > gap_no_csi, (gap, gap_no_csi)
