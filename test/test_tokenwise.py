"""Token-wise decoding (eval.tokenwise) against the live round protocol: on tiny random models it commits
the tokens ``sd.rounds.generate`` commits, in the same rounds, for greedy SD, WISV (a deterministic judge)
and fly at several K; with tau 0 it is the target alone and its trace replays to the live greedy rounds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from wisv_ros.eval.replay import replay_greedy
from wisv_ros.eval.tokenwise import decode_tokenwise
from wisv_ros.sd.drafting import Drafter
from wisv_ros.sd.lm import CausalLM
from wisv_ros.sd.models import load_model
from wisv_ros.sd.roundlog import RoundRecord
from wisv_ros.sd.rounds import generate, generate_target_only
from wisv_ros.sd.verification import Method, Verifier

PROMPTS = [[5, 9, 12, 3], [3, 1, 4, 1, 5, 9, 2, 6] * 3]
N = 60


@pytest.fixture(scope="module")
def models():
    # A drafter that agrees with the target often but not always (noise 0.05 on every weight).
    return CausalLM(load_model("tiny-random:0:16")[0]), CausalLM(load_model("tiny-random:0:16:0.05")[0])


def judge(drafter_hidden, positions, target_hidden):
    """Deterministic stand-in for the decision head: reject where the two hiddens' first features
    have the same sign (about half of the mismatches)."""
    hd = np.asarray(drafter_hidden)[positions, 0]
    ht = target_hidden[positions, 0].numpy()
    return torch.tensor((np.sign(hd) == np.sign(ht)).astype(np.float32))


def live(models, prompt, k, method=Method.GREEDY, **kw):
    target, drafter = models
    target.reset()  # (the caches may hold the prompt from an earlier decode: its pass would not feed it)
    drafter.reset()
    recs: list[RoundRecord] = []
    gen = generate(Drafter(drafter), Verifier(target, method=method, **kw), prompt, N, k, round_log=recs.append)
    return gen.token_ids, recs


def key(recs):
    """What both decoders fix: per round, its prefix, kept drafts, committed tokens, the head's
    acceptances and the first mismatch (the one that cut the round, if any)."""
    return [(r.round_id, r.prefix_length, r.accepted, r.committed, r.head_accepted,
             [m for m in r.mismatches if m <= r.accepted][:len(r.head_accepted) + 1]) for r in recs]


@pytest.mark.parametrize("k", [1, 8])
def test_greedy_is_the_target_alone_in_the_live_rounds(models, k):
    target, drafter = models
    for i, prompt in enumerate(PROMPTS):
        res = decode_tokenwise(drafter, target, prompt, k=k, max_new_tokens=N, request_id=f"p{i}")
        assert res.token_ids == generate_target_only(target, prompt, N).token_ids
        ids, recs = live(models, prompt, k)
        assert res.token_ids == ids
        assert key(res.records[:-1]) == key(recs[:-1])  # the live last round may verify drafts past N
        assert [r.target_tokens for r in res.records[:-1]] == [r.target_tokens for r in recs[:-1]]
        assert all(r.drafted == k for r in res.records)
        # The trace replays to the same rounds (greedy SD at this K) as the token-wise decode.
        rep = replay_greedy(res.trace, k)
        assert [(r.accepted, r.committed) for r in rep.records] == [(r.accepted, r.committed) for r in res.records]


@pytest.mark.parametrize("k", [2, 8])
def test_wisv_commits_what_the_live_protocol_commits(models, k):
    target, drafter = models
    accepted_somewhere = 0
    for prompt in PROMPTS:
        res = decode_tokenwise(drafter, target, prompt, k=k, max_new_tokens=N, method="wisv", judge=judge, tau=0.5)
        ids, recs = live(models, prompt, k, method=Method.WISV, judge=judge, tau=0.5)
        assert res.token_ids == ids
        assert key(res.records[:-1]) == key(recs[:-1])
        assert all(r.protocol == "fh" and r.hidden_dim == drafter.hidden_size and r.up_bytes_fh > 0 for r in res.records)
        accepted_somewhere += sum(len(r.head_accepted) for r in res.records)
    assert accepted_somewhere > 0  # the judge did accept mismatches: the text is not the target's


def test_wisv_at_tau_zero_is_greedy(models):
    target, drafter = models
    a = decode_tokenwise(drafter, target, PROMPTS[1], k=4, max_new_tokens=N, method="wisv", judge=judge, tau=0.0)
    b = decode_tokenwise(drafter, target, PROMPTS[1], k=4, max_new_tokens=N)
    assert a.token_ids == b.token_ids and a.trace is not None
    assert [(r.accepted, r.committed) for r in a.records] == [(r.accepted, r.committed) for r in b.records]


@pytest.mark.parametrize("k,window", [(4, 1), (8, 2)])
def test_fly_commits_what_the_live_protocol_commits(models, k, window):
    target, drafter = models
    lenient = 0
    for prompt in PROMPTS:
        res = decode_tokenwise(drafter, target, prompt, k=k, max_new_tokens=N, method="fly", fly_entropy=0.0,
                               fly_window=window)
        ids, recs = live(models, prompt, k, method=Method.FLY, fly_entropy=0.0, fly_window=window)
        assert res.token_ids == ids
        assert [(r.round_id, r.prefix_length, r.accepted, r.committed) for r in res.records[:-1]] == \
               [(r.round_id, r.prefix_length, r.accepted, r.committed) for r in recs[:-1]]
        lenient += sum(len(r.head_accepted) for r in res.records)
    assert lenient > 0


def test_stop_text_and_budget(models):
    target, drafter = models
    res = decode_tokenwise(drafter, target, PROMPTS[0], k=8, max_new_tokens=5)
    assert len(res.token_ids) == 5 and sum(r.committed for r in res.records) == 5
    with pytest.raises(ValueError, match="one of greedy, wisv, fly"):
        decode_tokenwise(drafter, target, PROMPTS[0], k=8, max_new_tokens=5, method="reject")
    with pytest.raises(ValueError, match="k and max_new_tokens"):
        decode_tokenwise(drafter, target, PROMPTS[0], k=0, max_new_tokens=5)
