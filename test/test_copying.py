"""Copy drafting: candidate search and the one-pass tree verification."""
from __future__ import annotations

import pytest
import torch

from wisv_ros.switchsd.copying import copy_candidates, verify_tree
from wisv_ros.sd.lm import CausalLM
from wisv_ros.sd.models import load_model


def test_candidates_most_recent_first_and_distinct():
    ctx = [7, 1, 2, 3, 4, 9, 1, 2, 5, 6, 0, 1, 2]
    assert copy_candidates(ctx, kappa=2, width=4, depth=3) == [[5, 6, 0], [3, 4, 9]]
    assert copy_candidates(ctx, kappa=2, width=1, depth=2) == [[5, 6]]
    assert copy_candidates(ctx, kappa=3, width=4, depth=3) == []  # (0, 1, 2) never occurred before
    assert copy_candidates([1, 2, 1, 2, 1, 2], kappa=2, width=4, depth=4) == [[1, 2], [1, 2, 1, 2]]
    with pytest.raises(ValueError, match="kappa"):
        copy_candidates(ctx, kappa=0)


def _single(lm: CausalLM, context, cand):
    """Greedy acceptance of one candidate verified on its own."""
    lm.reset()
    step = lm.feed(list(context) + list(cand), n_logits=len(cand) + 1)
    arg = step.logits.argmax(-1).tolist()
    n = 0
    while n < len(cand) and arg[n] == cand[n]:
        n += 1
    return n, arg[n]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_pass_equals_separate_verification(seed):
    lm = CausalLM(load_model("tiny-random:0:16")[0])
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(0, 16, (12,), generator=gen).tolist()
    # Candidates: the target's own greedy continuation (long acceptance), perturbed copies, noise.
    lm.reset()
    greedy = []
    todo = list(context)
    for _ in range(6):
        t = int(lm.feed(todo, 1).logits[-1].argmax())
        greedy.append(t)
        todo = [t]
    cands = [greedy[:3] + [(greedy[3] + 1) % 16] + greedy[4:], torch.randint(0, 16, (5,), generator=gen).tolist(),
             greedy[:5], greedy[:1] + [(greedy[1] + 3) % 16]]
    expected = [_single(lm, context, c) for c in cands]
    fresh = CausalLM(load_model("tiny-random:0:16")[0])
    fresh.feed(context[:5], 1)  # a partly filled cache, as in a running request
    res = verify_tree(fresh, context, cands)
    assert res.accepted_per_candidate == [n for n, _ in expected]
    best = max(range(len(cands)), key=lambda i: (expected[i][0], -i))
    assert res.accepted_ids == cands[best][: expected[best][0]]
    assert res.next_id == expected[best][1]
    assert fresh.cached == context  # rolled back to the context
    assert res.accepted_per_candidate[2] == 5  # the target's own continuation is accepted whole


def test_tree_pass_on_a_real_model_copies_a_repeated_span():
    model, tok = load_model("smollm2-135m-instruct")
    lm = CausalLM(model, tok)
    text = ("def area(width, height):\n    return width * height\n\n\n"
            "def area_checked(width, height):\n    assert width >= 0\n    return width")
    context = tok(text).input_ids
    cands = copy_candidates(context, kappa=3, width=3, depth=8)
    assert cands, "the suffix '    return width' occurs earlier in the context"
    expected = [_single(lm, context, c)[0] for c in cands]
    res = verify_tree(lm, context, cands)
    assert res.accepted_per_candidate == expected
    assert max(expected) >= 2  # the model really continues by copying


def test_copy_mode_is_lossless_and_copies():
    """n-gram copy mode (no probe) on a repetitive tiny-model sequence: output equals target greedy."""
    from wisv_ros.switchsd.copying import CopyConfig
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.verification import Verifier
    from wisv_ros.sd.rounds import generate, generate_target_only

    target = CausalLM(load_model("tiny-random:0:16")[0])
    drafter = CausalLM(load_model("tiny-random:0:16:0.05")[0])
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3  # repeats: copy candidates exist from the start
    ref = generate_target_only(target, prompt, 60)
    out = generate(Drafter(drafter), Verifier(target, copy=CopyConfig(kappa=3)), prompt, 60, 4)
    assert out.token_ids == ref.token_ids
    s = out.stats
    assert s.copy_rounds > 0 and s.copy_rounds < s.rounds
    assert s.as_row()["copy_rate"] == round(s.copy_rounds / s.rounds, 3)


def test_probe_gate_controls_copy_mode():
    from wisv_ros.switchsd.copying import CopyConfig
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.verification import Verifier
    from wisv_ros.sd.rounds import generate, generate_target_only

    model, _ = load_model("tiny-random:0:16")
    target = CausalLM(model, capture=[(1, "post_attn")])
    drafter = CausalLM(load_model("tiny-random:0:16:0.05")[0])
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    seen = []

    def never(row):
        seen.append(row.shape)
        return False

    out = generate(Drafter(drafter), Verifier(target, copy=CopyConfig(gate=never, layer=(1, "post_attn"), kappa=3)),
                   prompt, 30, 4)
    assert out.stats.copy_rounds == 0 and seen and seen[0] == (32,)  # consulted with the layer's row
    always = generate(Drafter(drafter), Verifier(target, copy=CopyConfig(gate=lambda r: True, layer=(1, "post_attn"),
                                                                      kappa=3)), prompt, 30, 4)
    assert always.stats.copy_rounds > 0
    assert always.token_ids == out.token_ids == generate_target_only(target, prompt, 30).token_ids
    with pytest.raises(ValueError, match="capture layer"):
        Verifier(CausalLM(load_model("tiny-random:0:16")[0]), copy=CopyConfig(gate=never, layer=(1, "post_attn")))


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Chi-square of ``counts`` against ``probs`` over the cells expecting >= 5 (and degrees of freedom)."""
    expected = counts.sum() * probs
    mask = expected >= 5
    return float((((counts - expected) ** 2) / expected)[mask].sum()), int(mask.sum()) - 1


def test_sampled_tree_walk_follows_the_target_distribution():
    """Copy rounds under rejection SD: the first committed token ~ p(. | context) and, after the
    shared candidate token, the second ~ p(. | context + that token), whatever the candidates."""
    from wisv_ros.sd.acceptance import softmax_t

    lm = CausalLM(load_model("tiny-random:0:16")[0])
    ctx, temperature = [3, 1, 4, 1, 5, 9, 2, 6], 1.0
    lm.reset()
    p0 = softmax_t(lm.feed(ctx, n_logits=1).logits[-1], temperature).double()
    order0 = p0.argsort(descending=True).tolist()
    a, e = order0[0], order0[1]
    lm.reset()
    p1 = softmax_t(lm.feed(ctx + [a], n_logits=1).logits[-1], temperature).double()
    order1 = p1.argsort(descending=True).tolist()
    candidates = [[a, order1[0], 7], [a, order1[2]], [e]]
    n = 3000
    first = torch.zeros(16, dtype=torch.float64)
    second = torch.zeros(16, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        res = verify_tree(lm, ctx, candidates, temperature=temperature, generator=gen)
        committed = res.accepted_ids + [res.next_id]
        first[committed[0]] += 1
        if committed[0] == a:
            second[committed[1]] += 1
        assert res.accepted_ids == candidates[res.candidate][:len(res.accepted_ids)] if res.accepted_ids else res.candidate == -1
    chi_first, dof_first = _chi2(first, p0)
    chi_second, dof_second = _chi2(second, p1)
    # p ~ 1e-4 bounds for these degrees of freedom; a greedy or biased walk gives hundreds.
    assert dof_first >= 3 and chi_first < 20 + 3 * dof_first
    assert dof_second >= 3 and chi_second < 20 + 3 * dof_second
    # Greedy acceptance would always commit a first: the sampled walk does not.
    assert first[a] < 0.95 * n


def test_copy_rounds_run_under_rejection_sd():
    """Method reject with copy mode: copy rounds happen and the request completes (the exactness
    of each sampled copy round is the test above)."""
    from wisv_ros.switchsd.copying import CopyConfig
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.verification import Method, Verifier
    from wisv_ros.sd.rounds import generate

    target = CausalLM(load_model("tiny-random:0:64")[0])
    drafter = CausalLM(load_model("tiny-random:0:64:0.05")[0])
    res = generate(Drafter(drafter, temperature=1.0, seed=0),
                   Verifier(target, Method.REJECT, temperature=1.0, seed=0, copy=CopyConfig(kappa=1)),
                   [5, 9, 12, 3], 60, 4)
    assert len(res.token_ids) == 60 and res.stats.copy_rounds > 0
