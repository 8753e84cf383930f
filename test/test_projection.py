"""Pre-projected FH uplink (wisv.head): the robot sends the head's drafter projection
W1_D ((h_D - mean_D) / std_D) instead of h_D, and the verifier decides exactly as with h_D.
Tiny heads and tiny random models, CPU, seconds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from wisv_ros.link.channel import CHANNEL_FEATURES, SCENARIOS
from wisv_ros.sd.drafting import Drafter
from wisv_ros.sd.rounds import (BlockRequest, EdgeRound, EdgeSessions, InProcessLink, RobotPolicy, RobotSession,
                                generate, generate_target_only)
from wisv_ros.sd.verification import Method, Verifier
from wisv_ros.wisv.head import (HEAD_MISMATCH, HeadJudge, HeadMismatch, HeadSplitError, HeadWeights, OnnxHead, ProjectedHidden,
                                load_projection, make_judge)
from wisv_ros.wisv.head_training import DecisionHead, export_onnx

torch.set_num_threads(1)

D_D, D_T, HIDDEN = 24, 16, 8
N_C = len(CHANNEL_FEATURES)
CHANNEL = SCENARIOS["20mbps_50ms"]
PROMPT = [5, 9, 12, 3]


def make_head(d_draft: int, d_target: int, hidden: int, seed: int, spread: float = 1.0) -> DecisionHead:
    """An untrained head with a non-trivial normalisation (means and stds away from 0 and 1)."""
    torch.manual_seed(seed)
    head = DecisionHead(d_draft, d_target, hidden=hidden, dropout=0.1)
    raw = np.random.default_rng(seed).normal(loc=0.5, scale=1.5, size=(64, d_draft + d_target + N_C))
    head.fit_normalization(raw)
    with torch.no_grad():
        head.mlp[3].weight.mul_(spread)
    return head.eval()


@pytest.fixture()
def tiny(tmp_path):
    """(torch head, its ONNX file) of a small random head."""
    head = make_head(D_D, D_T, HIDDEN, seed=0)
    path = tmp_path / "head.onnx"
    export_onnx(head, path)
    return head, path


def rows(rng, n: int, width: int) -> np.ndarray:
    return rng.normal(0.5, 2.0, size=(n, width)).astype(np.float32)


# --------------------------------------------------------------------------- the split


def test_projection_equals_the_first_layers_drafter_part(tiny):
    head, path = tiny
    proj = load_projection(path)
    assert (proj.d_draft, proj.hidden) == (D_D, HIDDEN)
    h_d = rows(np.random.default_rng(1), 10, D_D)
    with torch.no_grad():
        mean, std = head.feature_mean[:D_D], head.feature_std[:D_D]
        want = ((torch.from_numpy(h_d) - mean) / std) @ head.mlp[0].weight[:, :D_D].T
    got = proj(h_d)
    assert got.shape == (10, HIDDEN) and got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5)
    # The graph's initializers are the module's parameters.
    w = HeadWeights.from_onnx(path, D_D, D_T)
    np.testing.assert_array_equal(w.w1, head.mlp[0].weight.detach().numpy())
    np.testing.assert_array_equal(w.b1, head.mlp[0].bias.detach().numpy())
    np.testing.assert_array_equal(w.mean, head.feature_mean.numpy())
    assert w.b2 == pytest.approx(float(head.mlp[3].bias.detach()))
    with pytest.raises(ValueError, match=r"h_draft must be \[n, d_D=24\]"):
        proj(np.zeros((2, D_D + 1)))


def test_the_projected_judge_gives_the_full_heads_probabilities(tiny):
    _, path = tiny
    onnx_head = OnnxHead(path)
    proj = load_projection(path)
    assert onnx_head.head_id == proj.head_id and len(proj.head_id) == 16 and onnx_head.hidden == HIDDEN
    rng = np.random.default_rng(2)
    h_d, h_t = rows(rng, 32, D_D), rows(rng, 32, D_T)
    for ch in SCENARIOS.values():
        full = onnx_head.reject_prob(h_d, h_t, ch.features())
        split = onnx_head.reject_prob_projected(proj(h_d), h_t, ch.features())
        assert full.std() > 1e-3
        np.testing.assert_allclose(split, full, atol=1e-6)
    # Through the verifier's judge: raw rows and ProjectedHidden rows, same positions.
    judge = make_judge(onnx_head, lambda: CHANNEL)
    assert isinstance(judge, HeadJudge) and judge.head_id == proj.head_id
    target_hidden = torch.from_numpy(rows(rng, 9, D_T))
    block = rows(rng, 8, D_D)
    positions = [1, 4, 6]
    np.testing.assert_allclose(judge(ProjectedHidden(proj(block), proj.head_id), positions, target_hidden).numpy(),
                               judge(block, positions, target_hidden).numpy(), atol=1e-6)
    with pytest.raises(ValueError, match=r"p_draft must be \[n, hidden=8\]"):
        onnx_head.reject_prob_projected(block[:2], h_t[:2], CHANNEL.features())


def test_head_ids_tell_heads_apart(tiny, tmp_path):
    _, path = tiny
    other = make_head(D_D, D_T, HIDDEN, seed=1)
    export_onnx(other, tmp_path / "other.onnx")
    assert load_projection(tmp_path / "other.onnx").head_id != load_projection(path).head_id
    # Only the drafter part names a projection: a head that differs elsewhere takes the same rows.
    same = make_head(D_D, D_T, HIDDEN, seed=0)
    with torch.no_grad():
        same.mlp[0].weight[:, D_D:] += 1.0
        same.mlp[3].bias += 1.0
    export_onnx(same, tmp_path / "same.onnx")
    assert load_projection(tmp_path / "same.onnx").head_id == load_projection(path).head_id


def test_a_projection_of_another_head_is_refused_by_name(tiny, tmp_path):
    _, path = tiny
    export_onnx(make_head(D_D, D_T, HIDDEN, seed=1), tmp_path / "other.onnx")
    mine, theirs = load_projection(path), load_projection(tmp_path / "other.onnx")
    judge = make_judge(OnnxHead(path), lambda: CHANNEL)
    rng = np.random.default_rng(3)
    block, target_hidden = rows(rng, 4, D_D), torch.from_numpy(rows(rng, 5, D_T))
    with pytest.raises(HeadMismatch, match=rf"^head_id: the drafter projected its hiddens with decision head "
                                           rf"'{theirs.head_id}', this verifier runs decision head {mine.head_id}"):
        judge(ProjectedHidden(theirs(block), theirs.head_id), [0], target_hidden)




@pytest.fixture(scope="module")
def pair_head(tmp_path_factory):
    """A head for the tiny pair (hidden size 32 each), spread so that tau 0.5 cuts some mismatches."""
    path = tmp_path_factory.mktemp("head") / "pair.onnx"
    export_onnx(make_head(32, 32, 16, seed=0, spread=30.0), path)
    return path


def test_the_edge_refuses_blocks_and_replies_of_another_head(target, drafter_lm, pair_head, tmp_path):
    export_onnx(make_head(32, 32, 16, seed=5), tmp_path / "other.onnx")
    theirs = load_projection(tmp_path / "other.onnx")
    d = Drafter(drafter_lm)
    d.begin(PROMPT, len(PROMPT))
    block = d.draft(4)
    common = dict(k=4, method="wisv", tau=0.5, context_ids=list(PROMPT))
    # FH: refused before the target pass, naming the field.
    edge = EdgeSessions(target, method=Method.WISV, judge=make_judge(OnnxHead(pair_head), lambda: CHANNEL))
    passes = target.forward_passes
    req = BlockRequest("r", 0, len(PROMPT), block.token_ids, protocol="fh", hidden=theirs(block.hidden),
                       head_id=theirs.head_id, **common)
    reply = edge.handle(req)
    assert reply.error.startswith(f"head_id: the drafter projected its hiddens with decision head '{theirs.head_id}'")
    assert target.forward_passes == passes
    # SH: the reply of another head is refused when it arrives.
    req = BlockRequest("s", 0, len(PROMPT), block.token_ids, protocol="sh", **common)
    rnd = edge.begin(req)
    assert isinstance(rnd, EdgeRound)
    reply = edge.finish(rnd, ProjectedHidden(theirs(block.hidden), theirs.head_id))
    assert reply.error.startswith("head_id: ") and theirs.head_id in reply.error
    # A verifier without a head takes no projections at all.
    bare = EdgeSessions(target, method=Method.WISV)
    req = BlockRequest("t", 0, len(PROMPT), block.token_ids, protocol="fh", hidden=theirs(block.hidden),
                       head_id=theirs.head_id, **common)
    assert "runs no decision head that takes drafter projections" in bare.handle(req).error


def test_a_robot_refused_for_its_projection_goes_on_with_the_hiddens(target, drafter_lm, pair_head, tmp_path):
    """A drafter whose head differs from the verifier's: the first block is refused by name, the
    request goes on with raw hiddens and commits what a robot without a projection commits."""
    export_onnx(make_head(32, 32, 16, seed=5), tmp_path / "other.onnx")
    want, _ = run_rounds(target, drafter_lm, pair_head, "fh", projected=False)
    edge = EdgeSessions(target, method=Method.WISV, judge=make_judge(OnnxHead(pair_head), lambda: CHANNEL))
    link, logs = Recording(edge), []
    policy = RobotPolicy(k=4, max_new_tokens=40, method="wisv", tau=0.5, on_edge_loss="error")
    session = RobotSession(Drafter(drafter_lm), "req", PROMPT, PROMPT, policy, link, eos=target.eos_ids(),
                           protocol_for=lambda _k, _m: "fh", projection=load_projection(tmp_path / "other.onnx"),
                           log=lambda level, text: logs.append((level, text)))
    assert session.run().token_ids == want
    assert link.replies[0].error.startswith(HEAD_MISMATCH) and not any(r.error for r in link.replies[1:])
    assert link.sent[0].head_id and not any(r.head_id for r in link.sent[1:])
    assert [lv for lv, text in logs if HEAD_MISMATCH in text] == ["warning"]


class Recording(InProcessLink):
    """InProcessLink that keeps every block it carried."""

    def __init__(self, edge: EdgeSessions):
        super().__init__(edge)
        self.sent: list[BlockRequest] = []
        self.replies = []

    def exchange(self, req, timeout_s):
        self.sent.append(req)
        reply = super().exchange(req, timeout_s)
        self.replies.append(reply)
        return reply


def run_rounds(target, drafter_lm, head_path, protocol: str, projected: bool, n: int = 40, k: int = 4):
    """One request through RobotSession -> InProcessLink -> EdgeSessions; (tokens, link)."""
    edge = EdgeSessions(target, method=Method.WISV, judge=make_judge(OnnxHead(head_path), lambda: CHANNEL))
    link = Recording(edge)
    policy = RobotPolicy(k=k, max_new_tokens=n, method="wisv", tau=0.5, on_edge_loss="error")
    session = RobotSession(Drafter(drafter_lm), "req", PROMPT, PROMPT, policy, link, eos=target.eos_ids(),
                           protocol_for=lambda _k, _m: protocol,
                           projection=load_projection(head_path) if projected else None)
    return session.run().token_ids, link


@pytest.mark.parametrize("protocol", ["fh", "sh"])
def test_pre_projected_rows_give_the_same_decisions(target, drafter_lm, pair_head, protocol):
    ids_full, full = run_rounds(target, drafter_lm, pair_head, protocol, projected=False)
    ids_proj, proj = run_rounds(target, drafter_lm, pair_head, protocol, projected=True)
    # The head accepted some mismatches: the answer is not the target's greedy one.
    assert ids_full != generate_target_only(target, PROMPT, 40).token_ids
    assert not any(r.error for r in full.replies + proj.replies)
    assert ids_proj == ids_full
    assert [(r.accepted, r.committed_ids) for r in proj.replies] == [(r.accepted, r.committed_ids) for r in full.replies]
    # What travelled: 16-wide projections named by the head, instead of 32-wide hiddens.
    head_id = load_projection(pair_head).head_id
    assert all(r.head_id == head_id and r.hidden.shape == (len(r.token_ids), 16) for r in proj.sent)
    assert all(r.head_id == "" and r.hidden.shape == (len(r.token_ids), 32) for r in full.sent)


def test_generate_in_process_with_a_projection(target, drafter_lm, pair_head):
    judge = make_judge(OnnxHead(pair_head), lambda: CHANNEL)
    rounds_full, rounds_proj = [], []
    full = generate(Drafter(drafter_lm), Verifier(target, Method.WISV, tau=0.5, judge=judge), PROMPT, 40, 4,
                    on_round=lambda _b, v, _n: rounds_full.append((v.accepted, v.committed_ids)))
    proj = generate(Drafter(drafter_lm), Verifier(target, Method.WISV, tau=0.5, judge=judge), PROMPT, 40, 4,
                    on_round=lambda _b, v, _n: rounds_proj.append((v.accepted, v.committed_ids)),
                    projection=load_projection(pair_head))
    assert proj.token_ids == full.token_ids and rounds_proj == rounds_full
    assert proj.stats.rounds == full.stats.rounds


def test_a_graph_that_does_not_split_still_serves_raw_hiddens(tiny, tmp_path):
    import onnx

    _, path = tiny
    model = onnx.load(str(path))
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    relu.op_type = "LeakyRelu"  # a valid graph (onnxruntime runs it), but not the exported MLP
    bad = tmp_path / "bad.onnx"
    onnx.save(model, str(bad))
    (tmp_path / "bad.json").write_text((tmp_path / "head.json").read_text())
    head = OnnxHead(bad)
    assert head.head_id == "" and "LeakyRelu" in head.split_error
    assert head.reject_prob(np.zeros((2, D_D)), np.zeros((2, D_T)), CHANNEL.features()).shape == (2,)
    with pytest.raises(HeadSplitError):
        head.reject_prob_projected(np.zeros((2, HIDDEN)), np.zeros((2, D_T)), CHANNEL.features())
    with pytest.raises(HeadSplitError, match="LeakyRelu"):
        load_projection(bad)


# --------------------------------------------------------------------------- the wire


def test_a_projection_travels_with_its_head_id_in_the_messages():
    pytest.importorskip("rclpy")
    from rclpy.serialization import deserialize_message, serialize_message

    from wisv_ros.interfaces.convert import fill_block, read_block
    from wisv_ros.interfaces.wire import WireError, fill_hidden, hidden_head_id, read_hidden
    from wisv_ros.msg import DraftBlock, HiddenReply

    p = np.random.default_rng(4).normal(size=(4, 16)).astype(np.float32)
    req = BlockRequest("r", 2, 7, [1, 2, 3, 4], k=4, protocol="fh", hidden=p, head_id="0123456789abcdef")
    msg = DraftBlock()
    fill_block(msg, req)
    back = read_block(deserialize_message(serialize_message(msg), DraftBlock))
    assert back.head_id == req.head_id and back.drafter_rows().head_id == req.head_id
    np.testing.assert_allclose(back.hidden, p, rtol=1e-3, atol=1e-3)  # float16 on the link
    # A raw-hidden block reads back without a head id.
    raw = DraftBlock()
    fill_block(raw, BlockRequest("r", 2, 7, [1, 2, 3, 4], k=4, protocol="fh", hidden=np.zeros((4, 32), np.float32)))
    assert read_block(raw).head_id == "" and isinstance(read_block(raw).drafter_rows(), np.ndarray)
    # SH: the HiddenReply names the head too.
    reply = HiddenReply()
    fill_hidden(reply.hidden, p[[1, 3]], [1, 3], head_id=req.head_id)
    got = deserialize_message(serialize_message(reply), HiddenReply)
    assert hidden_head_id(got.hidden) == req.head_id and read_hidden(got.hidden)[1] == [1, 3]
    # A head id under protocol ids, or a giant one, is a malformed field.
    ids = DraftBlock()
    fill_block(ids, BlockRequest("r", 2, 7, [1, 2], k=2, protocol="ids"))
    ids.hidden.head_id = "0123456789abcdef"
    with pytest.raises(WireError, match="^hidden: must be empty under protocol ids"):
        read_block(ids)
    msg.hidden.head_id = "x" * 1000
    with pytest.raises(WireError, match=r"^hidden\.head_id: 1000 characters"):
        read_block(msg)
