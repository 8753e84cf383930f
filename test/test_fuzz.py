"""The fuzz cases (pure) and the fuzz CLI against real node processes (tiny models, a few hundred
messages per input; the README's table comes from the same CLI at 10,000)."""
from __future__ import annotations

import csv
import random

import pytest

from wisv_ros.interfaces.fuzz import BLOCK_CATEGORIES, GOAL_CATEGORIES, block_cases, goal_cases, noise_cases


def test_cases_are_seeded_and_cover_every_category():
    a = list(block_cases(random.Random(1), 90, vocab=64, hidden=32, prefix=[1, 2, 3]))
    b = list(block_cases(random.Random(1), 90, vocab=64, hidden=32, prefix=[1, 2, 3]))
    assert [c.fields["request_id"] for c in a] == [c.fields["request_id"] for c in b]
    assert {c.category for c in a} == set(BLOCK_CATEGORIES)
    assert {c.category for c in goal_cases(random.Random(1), 30)} == set(GOAL_CATEGORIES)
    for kind in ("verdict", "hidden_request", "hidden_reply", "channel_state"):
        assert len(list(noise_cases(random.Random(2), 5, kind))) == 5
    with pytest.raises(ValueError, match="kind: 'bogus'"):
        list(noise_cases(random.Random(2), 1, "bogus"))


def test_every_malformed_block_case_is_refused_by_the_round_protocol_naming_the_field():
    """The cases that reach EdgeSessions (no wire problem) get the named error the case expects."""
    import numpy as np

    from wisv_ros.interfaces.convert import read_block
    from wisv_ros.interfaces.wire import WireError
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import load_model
    from wisv_ros.sd.rounds import EdgeSessions

    class Msg:  # stand-in with the DraftBlock fields
        def __init__(self, fields):
            empty = {"data": b"", "dtype": "", "shape": []}
            for name, value in fields.items():
                if name in ("hidden", "draft_probs"):
                    value = type("T", (), {**empty, "positions": [], **(value or {})})()
                setattr(self, name, value)

    edge = EdgeSessions(CausalLM(load_model("tiny-random:0:64")[0]))
    for case in block_cases(random.Random(3), 300, vocab=64, hidden=32, prefix=[5, 9, 13]):
        try:
            error = edge.handle(read_block(Msg(case.fields), 64)).error
        except WireError as exc:
            error = str(exc)
        assert error and not error.startswith("internal error"), (case.category, error)
        assert case.expect in error, (case.category, case.expect, error)
    assert np  # numpy is what read_block decodes with


def test_fuzz_cli_against_the_nodes(tmp_path):
    from wisv_ros.cli import fuzz

    # --timeout: a verdict delayed by a loaded machine is late, not lost (a lost one still fails after 60 s)
    rc = fuzz.main(["--messages", "180", "--goals", "24", "--timeout", "60", "--out", str(tmp_path)])
    summary = (tmp_path / "summary.md").read_text()
    assert rc == 0, summary
    rows = {r["input"]: r for r in csv.DictReader(open(tmp_path / "fuzz.csv"))}
    block = rows["draft_block (verifier)"]
    assert block["sent"] == block["answered"] == block["named"] == "180" and block["internal"] == "0"
    assert rows["Generate goal (drafter)"]["named"] == "24"
    assert all("alive True" in r["examples"] for name, r in rows.items() if name.startswith("process"))


def test_faults_cli_stall_and_restart(tmp_path):
    """A stalled verifier (SIGSTOP 1 s mid-answer) and a killed one started again (Launcher.restart)
    cost time, not the answer."""
    from wisv_ros.cli import faults

    rc = faults.main(["--faults", "stall,restart", "--tries", "1", "--stall-s", "1", "--tokens", "60",
                      "--out", str(tmp_path)])
    rows = {r["fault"]: r for r in csv.DictReader(open(tmp_path / "faults.csv"))}
    assert rc == 0, (tmp_path / "summary.md").read_text()
    for row in rows.values():
        assert row["identical"] == row["stream_ok"] == "1" and row["drafter_only_rounds"] == "0", row
    assert float(rows["stall"]["median_s"]) >= 1.0
    assert (tmp_path / "launch_restart.log").read_text().count("started edge/verifier_node") == 2  # killed, started again
