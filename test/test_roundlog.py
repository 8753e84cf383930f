"""The round log (sd.roundlog): written by the round protocol itself, one record per round, and
consistent with the statistics and payload formulas of the same run. Tiny random models."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from wisv_ros.link.channel import Protocol
from wisv_ros.sd.drafting import Drafter
from wisv_ros.sd.lm import CausalLM
from wisv_ros.sd.models import load_model
from wisv_ros.sd.roundlog import RoundLog, RoundRecord, read_round_log
from wisv_ros.sd.rounds import BlockRequest, EdgeSessions, generate, generate_target_only
from wisv_ros.sd.verification import Method, Verifier
from wisv_ros.switchsd.copying import CopyConfig


@pytest.fixture(scope="module")
def pair():
    return CausalLM(load_model("tiny-random:0:16")[0]), CausalLM(load_model("tiny-random:0:16:0.05")[0])


def _run(pair, copy=None, prompt=(5, 9, 12, 3), n=48, k=4):
    target, drafter = pair
    buf = io.StringIO()
    log = RoundLog(buf, vocab_size=target.vocab_size)
    out = generate(Drafter(drafter), Verifier(target, copy=copy), list(prompt), n, k, round_log=log, request_id="r1")
    return out, list(read_round_log(buf.getvalue().splitlines()))


def test_greedy_log_matches_the_run(pair):
    out, recs = _run(pair)
    s = out.stats
    assert [r.kind for r in recs] == ["block"] * s.rounds
    assert [r.round_id for r in recs] == list(range(s.rounds))
    assert all(r.request_id == "r1" and r.method == "greedy" and r.k == 4 for r in recs)
    # The edge commits what the verdicts say; the robot clips the last round at max_new_tokens.
    total = sum(r.committed for r in recs)
    assert len(out.token_ids) <= total <= len(out.token_ids) + 4
    assert sum(r.accepted for r in recs) == s.accepted and sum(r.drafted for r in recs) == s.drafted
    assert sum(len(r.mismatches) for r in recs) == s.mismatches
    # Prefix lengths chain: each round starts where the previous one ended.
    assert all(b.prefix_length == a.prefix_length + a.committed for a, b in zip(recs, recs[1:]))
    # Bytes by the same formulas as DecodeStats, for every protocol.
    assert recs[0].hidden_dim == pair[1].hidden_size
    for proto in Protocol:
        assert sum(getattr(r, f"up_bytes_{proto.value}") for r in recs) == s.uplink_bytes[proto.value], proto
    # Measured compute is carried: the target pass of every block took time, and fed K + pending tokens.
    assert all(r.target_time_s > 0 and r.target_tokens >= r.drafted for r in recs)


def test_copy_rounds_are_logged_after_their_block(pair):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    out, recs = _run(pair, copy=CopyConfig(kappa=3), prompt=prompt, n=60)
    copies = [r for r in recs if r.kind == "copy"]
    assert len(copies) == out.stats.copy_rounds > 0
    assert sum(r.accepted for r in copies) == out.stats.copy_accepted
    for c in copies:
        assert c.copy_candidates >= 1 and c.up_bytes_ids == 0 and c.down_bytes > 0
    # A copy round carries the round id of the block it followed, and follows it in the log.
    for i, r in enumerate(recs):
        if r.kind == "copy":
            assert recs[i - 1].round_id == r.round_id
            assert r.prefix_length == recs[i - 1].prefix_length + recs[i - 1].committed


def test_a_resent_block_is_logged_once(pair):
    target, _ = pair
    recs: list[RoundRecord] = []
    edge = EdgeSessions(target, round_log=recs.append)
    req = BlockRequest("q", 0, 4, [1, 2, 3], k=3, context_ids=[5, 9, 12, 3])
    first = edge.handle(req)
    again = edge.handle(req)
    assert again.resent and again.committed_ids == first.committed_ids
    assert len(recs) == 1 and recs[0].drafted == 3 and recs[0].protocol == "ids"
    # A refused block is not a round.
    edge.handle(BlockRequest("q", 1, 999, [1], k=1))
    assert len(recs) == 1


def test_wisv_head_decisions_are_logged(pair):
    target, drafter = pair
    recs: list[RoundRecord] = []
    accept_all = lambda dh, positions, th: np.zeros(len(positions))  # noqa: E731 - rejection prob 0
    v = Verifier(target, Method.WISV, tau=0.5, judge=accept_all)
    generate(Drafter(drafter), v, [5, 9, 12, 3], 24, 4, round_log=recs.append)
    mism = [r for r in recs if r.mismatches]
    assert mism, "the tiny pair must disagree somewhere"
    # The head accepts every mismatch: every block is accepted whole, head_accepted == mismatches.
    assert all(r.accepted == r.drafted and r.head_accepted == r.mismatches for r in recs)


def test_target_only_logs_one_record_per_pass(pair):
    target, _ = pair
    recs: list[RoundRecord] = []
    out = generate_target_only(target, [5, 9, 12, 3], 12, round_log=recs.append, request_id="t")
    assert len(recs) == 12 and all(r.kind == "target" and r.method == "target_only" for r in recs)
    assert recs[0].target_tokens == 4 and all(r.target_tokens == 1 for r in recs[1:])
    assert sum(r.committed for r in recs) == len(out.token_ids)
    assert [r.prefix_length for r in recs] == list(range(4, 16))


def test_reading_a_log(tmp_path):
    path = tmp_path / "rounds.jsonl"
    with RoundLog(path, vocab_size=100, hidden_dim=8) as log:
        log(RoundRecord("a", 0, "block", "greedy", k=2, drafted=2, accepted=1, mismatches=[1], committed=2))
    text = path.read_text()
    (rec,) = list(read_round_log(path))
    assert rec.hidden_dim == 8 and rec.up_bytes_fh > rec.up_bytes_ids > 0 and rec.down_bytes_sh > 0
    path.write_text(text + '{"request_id": "a", "round_id"')  # a run stopped mid-line
    assert len(list(read_round_log(path))) == 1
    path.write_text(text + json.dumps({"request_id": "a", "round_id": 1, "kind": "block", "method": "greedy",
                                       "bogus": 1}) + "\n" + text)
    with pytest.raises(ValueError, match=r"rounds.jsonl:2: .*bogus"):
        list(read_round_log(path))
    with pytest.raises(ValueError, match="kind 'nope'"):
        RoundRecord("a", 0, "nope", "greedy")
