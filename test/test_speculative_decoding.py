"""Mechanics of the ROS-free core on tiny random models (same vocabulary, no tokenizer)."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from wisv_ros.sd.acceptance import (fly_accept, greedy_accept, judged_accept, mismatch_positions, rejection_accept,
                                   topk_entropy)
from wisv_ros.sd.drafting import Drafter
from wisv_ros.sd.verification import Method, Verifier
from wisv_ros.sd.rounds import generate, generate_target_only
from wisv_ros.sd.lm import CausalLM
from wisv_ros.sd.models import load_model

PROMPTS = [[5, 9, 12, 3], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def drafter(drafter_lm):
    """The tiny pair's drafter (conftest): the target's weights with 5 % noise."""
    return drafter_lm


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["p4", "p1", "p12"])
def test_greedy_sd_equals_target_greedy(target, drafter, k, prompt):
    ref = generate_target_only(target, prompt, 48)
    out = generate(Drafter(drafter), Verifier(target, Method.GREEDY), prompt, 48, k)
    assert out.token_ids == ref.token_ids
    assert len(out.token_ids) == 48
    s = out.stats
    assert s.committed == 48 and s.rounds < 48 or k == 1
    assert s.aal == pytest.approx(s.committed / s.rounds)


def test_greedy_sd_exercises_accepts_and_rejects(target, drafter):
    out = generate(Drafter(drafter), Verifier(target), PROMPTS[0], 64, 4)
    s = out.stats
    assert 0 < s.accepted < s.drafted  # both paths of the acceptance rule ran
    assert s.mismatches > 0
    assert s.aal > 1.2
    rates = s.acceptance_by_position()
    assert len(rates) == 4 and rates[0] >= rates[-1]  # later positions are accepted less often


def test_self_drafting_accepts_everything(target):
    twin = CausalLM(load_model("tiny-random:0:64")[0])
    out = generate(Drafter(twin), Verifier(target), PROMPTS[0], 40, 4)
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.aal == pytest.approx(5.0)  # K accepted + bonus every round


def test_rollback_after_rejection_matches_fresh_forward(target, drafter):
    prompt = PROMPTS[2]
    d, v = Drafter(drafter), Verifier(target)
    d.begin(prompt, len(prompt))
    v.begin(prompt)
    rejected = False
    for _ in range(12):
        block = d.draft(6)
        verdict = v.verify(block)
        d.commit(verdict.committed_ids)
        if verdict.accepted < len(block.token_ids):
            rejected = True
            break
    assert rejected, "the drafter never got a token rejected; the test would not exercise rollback"
    # The target's cache now holds prompt + accepted drafts; the correction is pending.
    assert target.cached == v.context[:-1]
    nxt = target.feed(target.sync(v.context), n_logits=1).logits[-1]
    fresh = CausalLM(load_model("tiny-random:0:64")[0])
    ref = fresh.feed(v.context, n_logits=1).logits[-1]
    torch.testing.assert_close(nxt, ref, atol=1e-5, rtol=1e-5)
    # The drafter rolled back as well: its next logits equal a fresh forward too.
    dn = drafter.feed(drafter.sync(d.context_ids()), n_logits=1).logits[-1]
    fresh_d = CausalLM(load_model("tiny-random:0:64:0.05")[0])
    torch.testing.assert_close(dn, fresh_d.feed(d.context_ids(), n_logits=1).logits[-1], atol=1e-5, rtol=1e-5)


def test_rollback_bounds_and_sync(target):
    target.reset()
    target.feed([1, 2, 3, 4, 5], n_logits=1)
    with pytest.raises(ValueError, match="rollback"):
        target.rollback(6)
    assert target.sync([1, 2, 9]) == [9]
    assert target.cached == [1, 2]
    # Identical prefix: one token is left to feed so the caller gets the next logits.
    assert target.sync([1, 2]) == [2]
    assert target.cached == [1]


def test_greedy_accept_rule():
    v = 10
    logits = torch.full((4, v), -5.0)
    for row, tok in enumerate([3, 4, 7, 2]):
        logits[row, tok] = 5.0
    assert greedy_accept([3, 4, 7], logits).__dict__ == {"accepted": 3, "next_id": 2}  # bonus
    assert greedy_accept([3, 5, 7], logits).__dict__ == {"accepted": 1, "next_id": 4}  # correction
    assert mismatch_positions([3, 5, 6], logits) == [1, 2]


def test_judged_accept_tau_limits():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 4, 7, 2]):
        logits[row, tok] = 5.0
    calls = []

    def judge(positions):
        calls.append(positions)
        return torch.tensor([0.5] * len(positions))

    assert judged_accept([3, 5, 6], logits, judge, tau=0.0).accepted == 1  # tau 0 == greedy
    assert calls == []  # ... and the head is never consulted
    assert judged_accept([3, 5, 6], logits, judge, tau=1.5).accepted == 3  # tau > 1 accepts all
    assert calls == [[1, 2]]  # only mismatch positions are judged
    d = judged_accept([3, 5, 6], logits, lambda s: torch.tensor([0.3, 0.9]), tau=0.6)
    assert (d.accepted, d.next_id) == (2, 7)  # first mismatch with p >= tau is cut


def test_topk_entropy_is_normalised():
    sure = torch.full((10,), -20.0)
    sure[3] = 20.0
    flat = torch.zeros(10)
    two = torch.full((10,), -30.0)
    two[[1, 2]] = 0.0
    h = topk_entropy(torch.stack([sure, flat, two]), k=8)
    assert h[0] < 1e-6 and abs(float(h[1]) - 1.0) < 1e-6
    assert abs(float(h[2]) - math.log(2) / math.log(8)) < 1e-5  # two equal tokens of the top 8
    with pytest.raises(ValueError, match="k >= 2"):
        topk_entropy(flat, k=1)


def test_fly_accept_needs_the_entropy_gate_and_the_whole_window():
    k = 8
    target = [3, 4, 7, 2, 5, 6, 1, 8, 9]  # target argmax per row (K + 1 rows)
    logits = torch.full((k + 1, 12), -20.0)
    for row, tok in enumerate(target):
        logits[row, tok] = 20.0
    unsure = logits.clone()
    unsure[1, :8] = 0.0  # row 1: the target is unsure among 8 tokens (draft 5 and its own 4 among them)
    unsure[1, 4] = 0.01
    draft = [3, 5, 7, 2, 5, 6, 1, 8]  # one mismatch, at position 1
    assert fly_accept(draft, logits, entropy_min=0.6, window=3).accepted == 1  # target sure: rejected
    d = fly_accept(draft, unsure, entropy_min=0.6, window=3)
    assert (d.accepted, d.next_id) == (8, 9)  # unsure and the next 3 agree: the whole block, bonus
    assert fly_accept(draft, unsure, entropy_min=1.01, window=3).accepted == 1  # > 1: greedy
    assert fly_accept(draft, unsure, entropy_min=0.6, window=6).accepted == 8  # positions 2..7 agree
    assert fly_accept(draft, unsure, entropy_min=0.6, window=7).accepted == 1  # window runs past the block
    late = [3, 5, 7, 2, 0, 6, 1, 8]  # a second mismatch inside the window of the first
    assert fly_accept(late, unsure, entropy_min=0.6, window=3).accepted == 1
    assert fly_accept(late, unsure, entropy_min=0.6, window=2).accepted == 4  # first taken, second cut
    with pytest.raises(ValueError, match="window must be >= 1"):
        fly_accept(draft, unsure, entropy_min=0.6, window=0)


def test_verifier_method_fly_is_greedy_when_the_gate_is_shut(target):
    """fly with entropy_min > 1 commits exactly greedy SD's tokens; with the gate open it accepts
    mismatches, so it needs fewer rounds and its text leaves the target's."""
    drafter = CausalLM(load_model("tiny-random:0:64:0.01")[0])  # close to the target: agrees after a mismatch
    prompt = PROMPTS[2]
    ref = generate(Drafter(drafter), Verifier(target), prompt, 48, 8)
    shut = generate(Drafter(drafter), Verifier(target, Method.FLY, fly_entropy=1.5, fly_window=1), prompt, 48, 8)
    assert shut.token_ids == ref.token_ids and shut.stats.rounds == ref.stats.rounds
    open_ = generate(Drafter(drafter), Verifier(target, Method.FLY, fly_entropy=0.0, fly_window=1), prompt, 48, 8)
    assert open_.stats.rounds < ref.stats.rounds and open_.token_ids != ref.token_ids


def test_rejection_rule_preserves_target_distribution():
    """One position: committed token ~ p_T whatever p_D is (chi-square, seeded)."""
    gen = torch.Generator().manual_seed(0)
    p_t = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1, 0.0])
    p_d = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.2, 0.2])
    logits_t = torch.log(p_t.clamp_min(1e-12)).repeat(2, 1)
    n = 20000
    counts = torch.zeros(6)
    for _ in range(n):
        d = int(torch.multinomial(p_d, 1, generator=gen))
        dec = rejection_accept([d], p_d[None], logits_t, 1.0, gen)
        counts[d if dec.accepted == 1 else dec.next_id] += 1
    emp = counts / n
    assert emp[5] == 0  # a token the target never emits is never committed
    chi2 = float((((counts - n * p_t) ** 2) / (n * p_t).clamp_min(1e-9))[:5].sum())
    assert chi2 < 20.5  # 4 degrees of freedom, p = 0.0004
    # Control: committing the draft unconditionally is detected as a different distribution.
    chi2_draft = float((((n * p_d - n * p_t) ** 2) / (n * p_t).clamp_min(1e-9))[:5].sum())
    assert chi2_draft > 1000


def test_rejection_sd_matches_target_distribution_end_to_end():
    """Two generated tokens through the full drafter/verifier path: joint law equals the target's."""
    vocab = 8
    tgt = CausalLM(load_model(f"tiny-random:3:{vocab}")[0])
    dft = CausalLM(load_model(f"tiny-random:3:{vocab}:0.3")[0])
    prompt = [2, 5]
    temp = 1.0
    # Exact target law of (t1, t2).
    with torch.no_grad():
        p1 = torch.softmax(tgt.feed(prompt, 1).logits[-1].double(), -1)
        joint = torch.zeros(vocab, vocab, dtype=torch.float64)
        for a in range(vocab):
            tgt.reset()
            joint[a] = p1[a] * torch.softmax(tgt.feed(prompt + [a], 1).logits[-1].double(), -1)
    n = 3000
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for seed in range(n):
        out = generate(Drafter(dft, temperature=temp, seed=seed), Verifier(tgt, Method.REJECT, temperature=temp, seed=seed),
                       prompt, 2, 2)
        counts[out.token_ids[0], out.token_ids[1]] += 1
    expected = n * joint
    mask = expected >= 5  # chi-square cells with enough mass
    chi2 = float((((counts - expected) ** 2) / expected)[mask].sum())
    dof = int(mask.sum()) - 1
    # Generous bound (p ~ 1e-4 for dof ~ 40); a biased sampler gives chi2 in the hundreds.
    assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)
    tv = 0.5 * float((counts / n - joint).abs().sum())
    assert tv < 0.1


def test_rejection_needs_one_vocabulary():
    with pytest.raises(ValueError, match="one vocabulary"):
        rejection_accept([1], torch.full((1, 5), 0.2), torch.zeros(2, 6), 1.0, torch.Generator())


def test_verifier_rejects_mismatched_prefix(target, drafter):
    d, v = Drafter(drafter), Verifier(target)
    d.begin([1, 2, 3], 3)
    v.begin([1, 2, 3, 4])
    with pytest.raises(ValueError, match="prefix_length 3"):
        v.verify(d.draft(2))


def test_method_names_and_errors(target):
    assert Method.parse("greedy") is Method.GREEDY
    with pytest.raises(ValueError, match="target_only, greedy, reject, wisv"):
        Method.parse("fast")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        Verifier(target, Method.REJECT, temperature=0.0)


def test_stats_bytes_follow_protocols(target, drafter):
    out = generate(Drafter(drafter), Verifier(target), PROMPTS[0], 32, 4)
    s = out.stats
    up = s.uplink_bytes
    assert up["ids"] < up["sh"] < up["fh"] < up["dist"]  # SH ships hiddens only at mismatches
    assert s.downlink_bytes["sh"] > s.downlink_bytes["fh"]  # SH's extra request goes down
    row = s.as_row()
    assert row["rounds"] == s.rounds and row["aal"] == round(s.committed / s.rounds, 3)


CORE = ["wisv_ros.sd.acceptance", "wisv_ros.sd.drafting", "wisv_ros.sd.lm", "wisv_ros.sd.metrics", "wisv_ros.sd.models",
        "wisv_ros.sd.rounds", "wisv_ros.sd.verification", "wisv_ros.link.channel", "wisv_ros.link.emulator",
        "wisv_ros.link.estimator", "wisv_ros.wisv.head", "wisv_ros.wisv.relabel", "wisv_ros.wisv.traces",
        "wisv_ros.switchsd.copying", "wisv_ros.switchsd.probe", "wisv_ros.eval.datasets", "wisv_ros.interfaces.wire",
        "wisv_ros.interfaces.convert", "wisv_ros.interfaces.bags", "wisv_ros.graph.description"]


def _imported(modules: list[str]) -> set[str]:
    """The modules that importing ``modules`` loads, in a fresh interpreter."""
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint(' '.join(sorted(sys.modules)))\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return set(res.stdout.split())


def test_core_imports_without_rclpy():
    loaded = _imported(CORE)
    assert set(CORE) <= loaded
    bad = [m for m in loaded if m.split(".")[0] in ("rclpy", "rosidl_runtime_py", "rclpy_message_converter")]
    assert not bad, bad


@pytest.mark.parametrize("module", ["wisv_ros.nodes.verifier_node", "wisv_ros.nodes.drafter_node"])
def test_runtime_code_does_not_import_training_code(module):
    loaded = _imported([module])
    assert module in loaded
    training = {"wisv_ros.wisv.head_training", "wisv_ros.switchsd.probe_training", "wisv_ros.wisv.traces",
                "wisv_ros.wisv.relabel", "wisv_ros.eval.datasets", "matplotlib"}
    assert not training & loaded, sorted(training & loaded)
