"""Tests for wisv_ros.head: training, ONNX export/inference and the judge hook (tiny, CPU, seconds)."""
from __future__ import annotations

import json
from itertools import product

import numpy as np
import pytest
import torch

from wisv_ros.sd.acceptance import Decision, judged_accept
from wisv_ros.wisv.head_training import DecisionHead, export_onnx, train_head
from wisv_ros.wisv.head import OnnxHead, make_judge, sidecar_path
from wisv_ros.eval.scoring import roc_auc
from wisv_ros.link.channel import CHANNEL_FEATURES, SCENARIOS, ChannelState, WireFormat
from wisv_ros.wisv.relabel import ChannelDistribution, Episode, RelabelConfig, make_instances, make_instances_no_csi

torch.set_num_threads(1)

D_D, D_T = 8, 6
N_C = len(CHANNEL_FEATURES)
FAST = dict(hidden=32, dropout=0.1, lr=3e-3, weight_decay=1e-4, batch_size=128, seed=0, progress=False)


def rows(h_d: np.ndarray, h_t: np.ndarray, ch: ChannelState) -> np.ndarray:
    c = np.broadcast_to(ch.features(), (h_d.shape[0], N_C))
    return np.concatenate([h_d, h_t, c], axis=1).astype(np.float32)


# --------------------------------------------------------------------------- AUC


def test_roc_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=60).astype(float)  # many ties
    labels = rng.random(60) < 0.4
    pos, neg = scores[labels], scores[~labels]
    pairwise = np.mean([(p > q) + 0.5 * (p == q) for p, q in product(pos, neg)])
    assert roc_auc(scores, labels) == pytest.approx(pairwise)
    assert roc_auc(-scores, labels) == pytest.approx(1 - pairwise)
    assert np.isnan(roc_auc(scores, np.zeros(60)))


# --------------------------------------------------------------------------- training


def channel_task(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Reject iff h_D[0] > a threshold that grows with the RTT: the channel matters."""
    rng = np.random.default_rng(seed)
    dist = ChannelDistribution(p_fixed=0.0)
    chans = dist.sample(n, rng)
    h_d = rng.normal(size=(n, D_D)) * 3.0 + 1.0  # raw scale: the normalisation must handle it
    h_t = rng.normal(size=(n, D_T))
    c = np.stack([ch.features() for ch in chans])
    X = np.concatenate([h_d, h_t, c], axis=1).astype(np.float32)
    y = (h_d[:, 0] > 1.0 + 6.0 * (c[:, 2] - 0.3)).astype(np.float32)
    return X, y


def test_training_learns_a_channel_dependent_rule():
    X, y = channel_task(3000, 1)
    Xv, yv = channel_task(600, 2)
    head, hist = train_head(X, y, Xv, yv, d_draft=D_D, epochs=25, **FAST)
    assert len(hist.epochs) == 25 and 1 <= hist.best_epoch <= 25
    assert hist.best.val_auc > 0.97 and hist.best.val_accuracy > 0.9
    # The best channel-blind score is h_D[0] itself; the head beats it by using the RTT.
    assert hist.best.val_auc > roc_auc(Xv[:, 0], yv) + 0.03
    # The returned head holds the best epoch's weights.
    with torch.no_grad():
        logits = head(torch.from_numpy(Xv))
    val_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(yv)))
    assert val_loss == pytest.approx(hist.best.val_loss, rel=1e-5)
    assert hist.best.val_loss == min(e.val_loss for e in hist.epochs + hist.channel_epochs)
    assert not head.training


def test_channel_stage_moves_only_the_channel_weights():
    X, y = channel_task(1000, 7)
    Xv, yv = channel_task(300, 8)
    joint, jh = train_head(X, y, Xv, yv, d_draft=D_D, epochs=3, channel_epochs=0, **FAST)
    both, bh = train_head(X, y, Xv, yv, d_draft=D_D, epochs=3, channel_epochs=10, **FAST)
    assert jh.channel_epochs == [] and jh.channel_best_epoch == 0 and len(bh.channel_epochs) == 10
    assert bh.best_epoch == jh.best_epoch
    a, b = joint.state_dict(), both.state_dict()
    for name in a:
        if name == "mlp.0.weight":
            assert torch.equal(a[name][:, :D_D + D_T], b[name][:, :D_D + D_T])
        else:
            assert torch.equal(a[name], b[name]), name
    # The RTT rule is far from learnt after 3 joint epochs: the channel stage improves on it.
    assert bh.channel_best_epoch > 0 and bh.best.val_loss < jh.best.val_loss
    assert not torch.equal(a["mlp.0.weight"][:, -N_C:], b["mlp.0.weight"][:, -N_C:])
    # Requires-grad flags are restored for further training.
    assert all(p.requires_grad for p in both.parameters())
    with pytest.raises(ValueError, match="channel_epochs"):
        train_head(X, y, Xv, yv, d_draft=D_D, epochs=1, channel_epochs=-1, **FAST)


def test_training_is_deterministic_and_normalises_every_column():
    X, y = channel_task(400, 3)
    Xv, yv = channel_task(100, 4)
    a, _ = train_head(X, y, Xv, yv, d_draft=D_D, epochs=2, **FAST)
    b, _ = train_head(X, y, Xv, yv, d_draft=D_D, epochs=2, **FAST)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    np.testing.assert_allclose(a.feature_mean.numpy(), X.mean(0), atol=1e-5)
    np.testing.assert_allclose(a.feature_std.numpy(), X.std(0), rtol=1e-4)
    # A column without spread (one channel only) is centred, not divided by ~0.
    X1 = X.copy()
    X1[:, -N_C:] = SCENARIOS["20mbps_50ms"].features()
    c, _ = train_head(X1, y, Xv, yv, d_draft=D_D, epochs=1, channel_epochs=0, **FAST)
    assert c.feature_std[-N_C:].tolist() == [1.0] * N_C
    np.testing.assert_allclose(c.feature_mean[-N_C:].numpy(), SCENARIOS["20mbps_50ms"].features(), atol=1e-6)
    assert a.d_draft == D_D and a.d_target == D_T


def relabel_episodes(n_episodes: int, seed: int) -> list[Episode]:
    """Episodes whose critical mismatches are those with h_D[0] + h_T[0] > 0."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_episodes):
        n = int(rng.integers(4, 12))
        positions = np.sort(rng.choice(120, size=n, replace=False))
        h_d = rng.normal(size=(n, D_D)).astype(np.float32)
        h_t = rng.normal(size=(n, D_T)).astype(np.float32)
        out.append(Episode(positions, (h_d[:, 0] + h_t[:, 0] > 0).astype(int), h_d, h_t))
    return out


@pytest.fixture(scope="module")
def relabel_data():
    cfg = RelabelConfig(fmt=WireFormat(hidden_dim=2048), round_compute_s=0.1, k=16, alpha=0.8, rho=0.05)
    dist = ChannelDistribution()
    train_eps, val_eps = relabel_episodes(250, 5), relabel_episodes(60, 6)
    return cfg, dist, train_eps, val_eps


def acceptance_gap(head: DecisionHead, episodes: list[Episode]) -> float:
    """Mean acceptance (1 - reject) on critical mismatches: bad channel minus good channel."""
    h_d = np.concatenate([ep.h_draft[ep.labels == 1] for ep in episodes])
    h_t = np.concatenate([ep.h_target[ep.labels == 1] for ep in episodes])
    accept = {
        name: float((1 - head.reject_prob(rows(h_d, h_t, SCENARIOS[name]))).mean())
        for name in ("500mbps_5ms", "20mbps_50ms")
    }
    return accept["20mbps_50ms"] - accept["500mbps_5ms"]


def test_relabeled_head_is_more_permissive_on_a_worse_channel(relabel_data):
    cfg, dist, train_eps, val_eps = relabel_data
    X, y = make_instances(train_eps, dist, 6, 0, config=cfg)
    Xv, yv = make_instances(val_eps, dist, 6, 1, config=cfg)
    head, hist = train_head(X, y, Xv, yv, d_draft=D_D, epochs=15, **FAST)
    assert hist.best.val_auc > 0.9
    # Same hiddens, worse channel => higher acceptance. Label repair rates on critical mismatches
    # are about 0.94 (500 Mbit/s, 5 ms) and 0.57 (20 Mbit/s, 50 ms) with this config.
    assert acceptance_gap(head, val_eps) > 0.15
    # The ablation (base labels, channel ignored by the labels) barely reacts to the channel.
    Xa, ya = make_instances_no_csi(train_eps, dist, 6, 0)
    Xav, yav = make_instances_no_csi(val_eps, dist, 6, 1)
    ablation, _ = train_head(Xa, ya, Xav, yav, d_draft=D_D, epochs=15, **FAST)
    assert abs(acceptance_gap(ablation, val_eps)) < 0.05


# --------------------------------------------------------------------------- ONNX


@pytest.fixture()
def random_head() -> DecisionHead:
    torch.manual_seed(0)
    head = DecisionHead(D_D, D_T, hidden=16, dropout=0.2)
    raw = np.random.default_rng(0).normal(loc=5.0, scale=4.0, size=(200, D_D + D_T + N_C))
    head.fit_normalization(raw)
    head.eval()
    return head


def test_onnx_matches_torch(random_head, tmp_path):
    path = tmp_path / "head.onnx"
    side = export_onnx(random_head, path, {"models": {"drafter": "a", "target": "b"}, "command": "x --y"})
    assert side == sidecar_path(path) == tmp_path / "head.json"
    meta = json.loads(side.read_text())
    assert (meta["d_draft"], meta["d_target"], meta["channel_features"]) == (D_D, D_T, list(CHANNEL_FEATURES))
    assert meta["models"] == {"drafter": "a", "target": "b"} and meta["command"] == "x --y"
    onnx_head = OnnxHead(path)
    assert onnx_head.providers[-1] == "CPUExecutionProvider"
    rng = np.random.default_rng(1)
    for n in (1, 7, 64):
        h_d = rng.normal(5.0, 4.0, size=(n, D_D)).astype(np.float32)
        h_t = rng.normal(5.0, 4.0, size=(n, D_T)).astype(np.float32)
        ch = ChannelState(float(rng.uniform(5e6, 1e9)), float(rng.uniform(0, 0.05)), float(rng.uniform(0, 0.1)))
        got = onnx_head.reject_prob(h_d, h_t, ch.features())
        want = random_head.reject_prob(rows(h_d, h_t, ch)).numpy()
        assert got.shape == (n,) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert got.std() > 1e-3 or n == 1  # not a constant output
    # Per-row channels give the same answer as one broadcast channel.
    c_rows = np.tile(ch.features(), (64, 1))
    np.testing.assert_array_equal(onnx_head.reject_prob(h_d, h_t, c_rows), got)
    assert onnx_head.reject_prob(h_d[:0], h_t[:0], ch.features()).shape == (0,)


def test_export_keeps_the_head_in_training_mode_and_checks_meta(random_head, tmp_path):
    random_head.train()
    export_onnx(random_head, tmp_path / "h.onnx")
    assert random_head.training
    with pytest.raises(ValueError, match="d_draft"):
        export_onnx(random_head, tmp_path / "h2.onnx", {"d_draft": 99})
    assert not (tmp_path / "h2.onnx").exists()


def test_shape_errors_name_the_dims(random_head, tmp_path):
    path = tmp_path / "head.onnx"
    export_onnx(random_head, path)
    head = OnnxHead(path, providers=["CPUExecutionProvider"])
    c = SCENARIOS["20mbps_5ms"].features()
    with pytest.raises(ValueError, match=r"h_draft must be \[n, d_D=8\], got \(3, 5\)"):
        head.reject_prob(np.zeros((3, 5)), np.zeros((3, D_T)), c)
    with pytest.raises(ValueError, match=r"h_target must be \[n=3, d_T=6\], got \(3, 8\)"):
        head.reject_prob(np.zeros((3, D_D)), np.zeros((3, 8)), c)
    with pytest.raises(ValueError, match=r"channel_features must be \[3\] or \[n=3, 3\].*got \(2,\)"):
        head.reject_prob(np.zeros((3, D_D)), np.zeros((3, D_T)), c[:2])
    with pytest.raises(ValueError, match=r"d_in=17\] \(d_D=8 \+ d_T=6 \+ 3 channel features\), got \(2, 16\)"):
        random_head(torch.zeros(2, 16))


def test_onnx_head_rejects_a_foreign_channel_layout(random_head, tmp_path):
    path = tmp_path / "head.onnx"
    side = export_onnx(random_head, path)
    meta = json.loads(side.read_text())
    meta["channel_features"] = ["rate", "per", "rtt"]
    side.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="retrain"):
        OnnxHead(path)
    side.unlink()
    with pytest.raises(FileNotFoundError, match="head.json"):
        OnnxHead(path)


# --------------------------------------------------------------------------- judge


def rtt_head(tmp_path) -> OnnxHead:
    """A hand-set head: reject logit = 10 h_D[0] - 20 rtt_feature (rtt in units of 100 ms)."""
    head = DecisionHead(D_D, D_T, hidden=3, dropout=0.0)
    with torch.no_grad():  # units relu(h), relu(-h), relu(rtt)
        w1 = torch.zeros(3, D_D + D_T + N_C)
        w1[0, 0], w1[1, 0], w1[2, D_D + D_T + CHANNEL_FEATURES.index("rtt")] = 1.0, -1.0, 1.0
        head.mlp[0].weight.copy_(w1)
        head.mlp[0].bias.zero_()
        head.mlp[3].weight.copy_(torch.tensor([[10.0, -10.0, -20.0]]))
        head.mlp[3].bias.zero_()
    head.eval()
    export_onnx(head, tmp_path / "rtt.onnx")
    return OnnxHead(tmp_path / "rtt.onnx")


def toy_round():
    from wisv_ros.sd.drafting import DraftBlock

    draft = [3, 1, 4, 1]
    target_argmax = [3, 2, 4, 5, 9]  # mismatches at 1 and 3; bonus 9
    logits = torch.nn.functional.one_hot(torch.tensor(target_argmax), 10).float()
    hidden = np.zeros((4, D_D), np.float32)
    hidden[1, 0] = -1.0  # clearly acceptable
    hidden[3, 0] = 0.5  # rejected unless the RTT is large
    block = DraftBlock(token_ids=draft, hidden=hidden, probs=None, prefix_length=0)
    target_hidden = torch.randn(5, D_T)
    return draft, logits, block, target_hidden


def test_make_judge_with_judged_accept(tmp_path):
    head = rtt_head(tmp_path)
    draft, logits, block, target_hidden = toy_round()
    channel = {"now": SCENARIOS["500mbps_5ms"]}
    judge = make_judge(head, lambda: channel["now"])
    calls = []

    def recording(s):
        calls.append(list(s))
        return judge(block.hidden, s, target_hidden)

    p = recording([1, 3])
    assert p.dtype == torch.float32 and p.shape == (2,)
    assert p[0] < 0.01 and p[1] > 0.95
    # Good channel: the second mismatch is repaired (correction 5 at position 3).
    assert judged_accept(draft, logits, recording, tau=0.5) == Decision(3, 5)
    # Bad RTT, same hiddens: the head accepts it, so the block is kept with the bonus token.
    channel["now"] = SCENARIOS["20mbps_50ms"]
    assert judged_accept(draft, logits, recording, tau=0.5) == Decision(4, 9)
    assert calls[1:] == [[1, 3], [1, 3]]  # only the mismatches are judged
    assert judged_accept(draft, logits, recording, tau=0.0) == Decision(1, 2)  # greedy: not called
    assert len(calls) == 3


def test_make_judge_errors(tmp_path):
    head = rtt_head(tmp_path)
    _, _, block, target_hidden = toy_round()
    with pytest.raises(TypeError, match="ChannelState"):
        make_judge(head, lambda: None)(block.hidden, [1], target_hidden)
    judge = make_judge(head, lambda: SCENARIOS["20mbps_5ms"])
    with pytest.raises(ValueError, match="out of range"):
        judge(block.hidden, [4], target_hidden)


def test_judge_drives_the_verifier_on_tiny_models(tmp_path):
    """End to end on the tiny random pair: a head that rejects everything gives the target's greedy output."""
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.verification import Method, Verifier
    from wisv_ros.sd.rounds import generate, generate_target_only
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import load_model

    target = CausalLM(load_model("tiny-random:0:64")[0])
    drafter = CausalLM(load_model("tiny-random:0:64:0.05")[0])
    head = DecisionHead(drafter.hidden_size, target.hidden_size, hidden=4, dropout=0.0)
    with torch.no_grad():  # constant logit +10: p_reject ~ 1 everywhere
        head.mlp[3].weight.zero_()
        head.mlp[3].bias.fill_(10.0)
    export_onnx(head.eval(), tmp_path / "all.onnx")
    judge = make_judge(OnnxHead(tmp_path / "all.onnx"), lambda: SCENARIOS["20mbps_50ms"])
    prompt = [5, 9, 12, 3]
    ref = generate_target_only(target, prompt, 24)
    strict = generate(Drafter(drafter), Verifier(target, Method.WISV, tau=0.5, judge=judge), prompt, 24, 4)
    assert strict.token_ids == ref.token_ids
    lax = generate(Drafter(drafter), Verifier(target, Method.WISV, tau=1.5, judge=judge), prompt, 24, 4)
    assert lax.stats.rounds < strict.stats.rounds  # accepting every mismatch needs fewer rounds
