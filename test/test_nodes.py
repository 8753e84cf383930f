"""drafter_node and verifier_node as real processes talking over DDS on this machine.

Tiny random models (no tokenizer: prompts are space-separated ids). tools/test.sh sets a
test-specific ROS_DOMAIN_ID and Fast DDS over UDP only (see tools/test.sh); each group of tests uses
its own namespace. Waits are on conditions with timeouts, never fixed sleeps.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

rclpy = pytest.importorskip("rclpy")

from wisv_ros.sd.rounds import generate_target_only  # noqa: E402
from wisv_ros.sd.lm import CausalLM  # noqa: E402
from wisv_ros.sd.models import load_model  # noqa: E402
from wisv_ros.nodes.client import GenerateClient, wait_until_active  # noqa: E402
from wisv_ros.nodes.common import RELIABLE_QOS, reliable_qos  # noqa: E402
from wisv_ros.interfaces.wire import fill_hidden  # noqa: E402

TARGET = "tiny-random:0:64"
DRAFTER = "tiny-random:0:64:0.05"  # agrees with the target about a third of the time
PROMPT = "5 9 12 3"
PROMPT_IDS = [5, 9, 12, 3]
START_TIMEOUT = 90.0  # process start + model load on a busy 2-core machine
GOAL_TIMEOUT = 60.0


# --------------------------------------------------------------------------- processes
class NodeProcess:
    """A node started as ``python -m wisv_ros.nodes.<kind> --ros-args ...``; log in a file."""

    def __init__(self, kind: str, ns: str, log_dir: Path, **params):
        self.kind = kind
        self.log = log_dir / f"{ns.strip('/').replace('/', '_')}_{kind}_{uuid.uuid4().hex[:6]}.log"
        cmd = [sys.executable, "-m", f"wisv_ros.nodes.{kind}", "--ros-args", "-r", f"__ns:={ns}"]
        params.setdefault("threads", 1)
        for name, value in params.items():
            cmd += ["-p", f"{name}:={str(value).lower() if isinstance(value, bool) else value}"]
        env = dict(os.environ, PYTHONUNBUFFERED="1", RCUTILS_LOGGING_BUFFERED_STREAM="0")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def tail(self, n: int = 30) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return f"--- {self.kind} log ({self.log}):\n" + "\n".join(lines[-n:])


@pytest.fixture(scope="module")
def target_lm():
    return CausalLM(load_model(TARGET)[0])


def reference(target_lm, n: int) -> list[int]:
    return generate_target_only(target_lm, PROMPT_IDS, n).token_ids


class Topic:
    """Collects the messages of one topic (in the test process)."""

    def __init__(self, node, msg_type, name: str, qos=RELIABLE_QOS):
        self.msgs: list = []
        self._cv = threading.Condition()
        self.sub = node.create_subscription(msg_type, name, self._on, qos)

    def _on(self, msg) -> None:
        with self._cv:
            self.msgs.append(msg)
            self._cv.notify_all()

    def wait_for(self, pred, timeout: float):
        """First collected message satisfying ``pred`` (None on timeout)."""
        with self._cv:
            self._cv.wait_for(lambda: any(pred(m) for m in self.msgs), timeout)
            return next((m for m in self.msgs if pred(m)), None)


class Pair:
    """verifier_node + drafter_node in one namespace, with test-side endpoints."""

    def __init__(self, ros, ns: str, log_dir: Path, verifier: dict | None = None, drafter: dict | None = None):
        from wisv_ros.msg import DraftBlock, HiddenRequest, RoundStats, Verdict

        self.ros, self.ns, self.log_dir = ros, ns, log_dir
        self.procs = {
            "verifier": NodeProcess("verifier_node", ns, log_dir,
                                    **{"target_model": TARGET, "target_dtype": "float32", **(verifier or {})}),
            "drafter": NodeProcess("drafter_node", ns, log_dir,
                                   **{"drafter_model": DRAFTER, "min_confidence": 0.0, "placement": "split", **(drafter or {})}),
        }
        self.block_pub = ros.create_publisher(DraftBlock, f"{ns}/draft_block", RELIABLE_QOS)
        self.verdicts = Topic(ros, Verdict, f"{ns}/verdict")
        self.stats = Topic(ros, RoundStats, f"{ns}/round_stats")
        self.hidden_requests = Topic(ros, HiddenRequest, f"{ns}/hidden_request")
        self.client = GenerateClient(ros, f"{ns}/generate")
        self.runs: list[Run] = []

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs.values())

    def wait_verifier(self, timeout: float = START_TIMEOUT) -> None:
        """Until both lifecycle nodes are active (models loaded) and the verifier's topics matched."""
        deadline = time.monotonic() + timeout

        def check(what: str) -> None:
            assert time.monotonic() < deadline, what + "\n" + self.logs()

        wait_until_active(self.ros, [f"{self.ns}/verifier_node", f"{self.ns}/drafter_node"], check)
        while self.verdicts.sub.get_publisher_count() == 0 or self.block_pub.get_subscription_count() == 0:
            check("verifier topics not discovered")
            self.verdicts.wait_for(lambda m: False, 0.1)

    def start_goal(self, timeout: float = START_TIMEOUT, **goal) -> "Run":
        """Send a goal, retrying while the drafter rejects goals (model loading)."""
        assert self.client.wait_for_server(timeout), "generate action server not found\n" + self.logs()
        deadline = time.monotonic() + timeout
        while True:
            try:
                run = Run(self, self.client.start(PROMPT, **goal))
                self.runs.append(run)
                return run
            except (RuntimeError, TimeoutError):  # rejected, or the goal response lost or late
                assert time.monotonic() < deadline, "drafter never accepted a goal\n" + self.logs()
                self.verdicts.wait_for(lambda m: False, 0.5)

    def settle(self) -> None:
        """Cancel goals a failed test left running, so that they cannot disturb the next test."""
        for run in self.runs:
            if not run.goal._result_future.done():
                try:
                    run.goal.cancel()
                    run.goal.outcome(GOAL_TIMEOUT)
                except TimeoutError:
                    pass
        self.runs.clear()

    def publish_block(self, rid: str, round_id: int, ids: list[int], context=None, prefix_length=None,
                      protocol: int = 0, hidden=None, method: str = "greedy"):
        from wisv_ros.msg import DraftBlock

        msg = DraftBlock()
        msg.request_id, msg.round_id = rid, round_id
        msg.token_ids, msg.k, msg.method, msg.protocol = ids, len(ids), method, protocol
        if context is not None:
            msg.context_ids = context
        msg.prefix_length = len(context) if prefix_length is None else prefix_length
        if hidden is not None:
            fill_hidden(msg.hidden, hidden, dtype="float16")
        self.block_pub.publish(msg)

    def verdict_for(self, rid: str, round_id: int, timeout: float = 10.0):
        v = self.verdicts.wait_for(lambda m: m.request_id == rid and m.round_id == round_id, timeout)
        assert v is not None, f"no verdict for {rid} round {round_id}\n" + self.logs()
        return v

    def close(self) -> None:
        for p in self.procs.values():
            p.stop()
        for ep in (self.verdicts.sub, self.stats.sub, self.hidden_requests.sub):
            self.ros.destroy_subscription(ep)
        self.ros.destroy_publisher(self.block_pub)
        self.client.client.destroy()


class Run:
    """A goal of a Pair: ``outcome()`` fails with the nodes' logs instead of a bare timeout."""

    def __init__(self, pair: Pair, goal):
        self.pair, self.goal = pair, goal
        self.handle, self.feedback = goal.handle, goal.feedback

    def first_feedback(self, timeout: float = GOAL_TIMEOUT) -> bool:
        return self.goal.first_feedback(timeout)

    def cancel(self):
        return self.goal.cancel()

    def outcome(self, timeout: float = GOAL_TIMEOUT):
        try:
            return self.goal.outcome(timeout)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.pair.logs()}") from None


def request_id(run) -> str:
    return uuid.UUID(bytes=bytes(run.handle.goal_id.uuid)).hex[:16]


@pytest.fixture(scope="module")
def pair(ros, tmp_path_factory):
    # max_requests 1: a block of another request evicts the running one (test_verifier_forgets_...).
    p = Pair(ros, "/nodes_main", tmp_path_factory.mktemp("logs"), verifier={"max_requests": 1})
    try:
        p.wait_verifier()
        yield p
    finally:
        p.close()


@pytest.fixture(autouse=True)
def _settle_goals(request):
    """After each test on the shared pair, no goal of it is left running."""
    yield
    if "pair" in request.fixturenames:
        request.getfixturevalue("pair").settle()


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "protocol,method,tau",
    [("ids", "greedy", 0.0), ("fh", "greedy", 0.0), ("sh", "wisv", 0.5)],
    ids=["ids", "fh", "sh"],
)
def test_generate_equals_target_greedy(pair, target_lm, protocol, method, tau):
    n = 40
    run = pair.start_goal(max_new_tokens=n, k=4, protocol=protocol, method=method, tau=tau)
    out = run.outcome(GOAL_TIMEOUT)
    assert out.status_name == "succeeded", out.result.error + "\n" + pair.logs()
    ids = list(out.result.token_ids)
    assert ids == reference(target_lm, n)
    # Streaming: the feedback deltas are the result, nothing lost or repeated.
    assert out.feedback_ids() == ids
    assert out.feedback_text() == out.result.text == " ".join(map(str, ids))
    r = out.result
    assert 1 < r.aal <= 5 and r.rounds < n and r.rounds * r.aal == pytest.approx(n)
    assert r.uplink_bytes > 0 and r.downlink_bytes > 0 and r.tokens_per_s > 0
    rid = request_id(run)
    stats = [m for m in pair.stats.msgs if m.request_id == rid]
    assert len(stats) == r.rounds and {m.protocol for m in stats} == {protocol}
    assert sum(m.committed for m in stats) >= n
    requests = [m for m in pair.hidden_requests.msgs if m.request_id == rid]
    if protocol == "sh":  # wisv with tau > 0: the verifier fetched the hiddens at the mismatches
        assert requests and all(len(m.positions) > 0 for m in requests)
        assert sum(m.uplink_bytes for m in stats) > sum(m.drafted for m in stats) * 32 * 2  # hiddens went up
    else:
        assert not requests
    if protocol == "fh":  # all K hiddens (32 float16 each) ride on every block
        assert all(m.uplink_bytes > m.drafted * 32 * 2 for m in stats)


def test_cancel_stops_a_long_goal(pair, target_lm):
    n = 100_000
    run = pair.start_goal(max_new_tokens=n, k=1)
    assert run.first_feedback(GOAL_TIMEOUT), pair.logs()
    assert run.cancel().return_code == 0  # ERROR_NONE: cancel accepted
    out = run.outcome(GOAL_TIMEOUT)
    assert out.status_name == "canceled" and out.result.error == "canceled"
    ids = list(out.result.token_ids)
    assert 0 < len(ids) < n
    assert out.feedback_ids() == ids
    assert ids == reference(target_lm, len(ids))


def test_placement_edge_streams_the_targets_tokens_and_cancels(pair, target_lm):
    """Edge-side generation through the nodes: the target's own tokens stream back as feedback,
    several a round trip, with the edge's measured time per token; a long goal is canceled."""
    n = 50
    out = pair.start_goal(max_new_tokens=n, k=4, placement="edge").outcome(GOAL_TIMEOUT)
    assert out.status_name == "succeeded", out.result.error + "\n" + pair.logs()
    r = out.result
    assert list(r.token_ids) == reference(target_lm, n) and out.feedback_ids() == list(r.token_ids)
    assert r.edge_rounds == r.rounds and 1 < r.aal and r.placement == "edge" and "fixed by the parameter" in r.placement_reason
    assert {f.placement for f in out.feedback} == {"edge"} and r.draft_time_s == 0.0
    run = pair.start_goal(max_new_tokens=100_000, placement="edge")
    assert run.first_feedback(GOAL_TIMEOUT), pair.logs()
    assert run.cancel().return_code == 0
    out = run.outcome(GOAL_TIMEOUT)
    ids = list(out.result.token_ids)
    assert out.status_name == "canceled" and 0 < len(ids) < 100_000 and ids == reference(target_lm, len(ids))


def test_placement_auto_chooses_by_what_the_node_measured_and_says_why(pair, target_lm):
    """The drafter node keeps its placement model across goals: after the split goals and the edge
    goal before, auto compares both by their measured costs and explains its choice."""
    n = 80
    out = pair.start_goal(max_new_tokens=n, k=4, placement="auto").outcome(GOAL_TIMEOUT)
    assert out.status_name == "succeeded", out.result.error + "\n" + pair.logs()
    r = out.result
    assert list(r.token_ids) == reference(target_lm, n)  # split or edge: the target's answer either way
    assert r.robot_rounds == 0 and r.placement in ("split", "edge")
    expected = dict(re.findall(r"(split|edge|robot) (\d+|\?)", r.placement_reason.split("expected:")[1]))
    assert set(expected) == {"split", "edge", "robot"} and "?" not in expected.values(), r.placement_reason
    faster = min(("split", "edge"), key=lambda p: int(expected[p]))
    assert r.placement == faster or "staying" in r.placement_reason, r.placement_reason
    assert {f.placement for f in out.feedback} <= {"split", "edge"}
    assert "placement " in pair.procs["drafter"].log.read_text()  # the node logs its choice


def test_verifier_forgets_the_request_and_the_drafter_resends_the_context(pair, target_lm):
    n = 600
    run = pair.start_goal(max_new_tokens=n, k=1)
    assert run.first_feedback(GOAL_TIMEOUT), pair.logs()
    pair.publish_block("evict-" + uuid.uuid4().hex[:8], 0, [1], context=PROMPT_IDS)  # max_requests is 1
    out = run.outcome(GOAL_TIMEOUT)
    assert out.status_name == "succeeded", out.result.error + "\n" + pair.logs()
    assert list(out.result.token_ids) == reference(target_lm, n)
    assert out.feedback_ids() == list(out.result.token_ids)
    rid = request_id(run)
    assert f"unknown request {rid}: resend context" in pair.procs["drafter"].log.read_text(), pair.logs()


def test_malformed_blocks_get_error_verdicts(pair):
    import numpy as np

    rid = "bad-" + uuid.uuid4().hex[:8]
    nan = np.zeros((2, 32), np.float32)
    nan[1, 3] = np.nan
    pair.publish_block(rid, 0, [1, 2], context=PROMPT_IDS, protocol=1, hidden=nan)
    assert "hidden: contains NaN" in pair.verdict_for(rid, 0).error
    pair.publish_block(rid, 1, [1, 2], context=PROMPT_IDS, protocol=1, hidden=np.zeros((3, 32), np.float32))
    assert "hidden: shape [3, 32], expected [2, *]" in pair.verdict_for(rid, 1).error
    pair.publish_block(rid, 2, [1, 2], context=PROMPT_IDS, prefix_length=7)
    assert "prefix_length 7 != len(context_ids) 4" in pair.verdict_for(rid, 2).error
    pair.publish_block(rid, 3, [1, 99], context=PROMPT_IDS)
    assert "token_ids: ids [99] outside the target vocabulary" in pair.verdict_for(rid, 3).error
    other = "unknown-" + uuid.uuid4().hex[:8]
    pair.publish_block(other, 0, [1, 2], prefix_length=4)
    assert pair.verdict_for(other, 0).error == f"unknown request {other}: resend context"
    # A good block, then its duplicate and a wrong prefix length.
    pair.publish_block(rid, 4, [1, 2], context=PROMPT_IDS)
    good = pair.verdict_for(rid, 4)
    assert good.error == "" and good.committed_length == 4 + len(good.committed_ids)
    pair.verdicts.msgs.clear()
    pair.publish_block(rid, 4, [1, 2], prefix_length=good.committed_length)
    assert "round_id 4: duplicate or out of order" in pair.verdict_for(rid, 4).error
    pair.publish_block(rid, 5, [1, 2], prefix_length=good.committed_length + 1)
    assert "does not match the committed length" in pair.verdict_for(rid, 5).error
    assert pair.procs["verifier"].alive(), pair.logs()
    pair.publish_block(rid, 6, [1, 2], prefix_length=good.committed_length)
    assert pair.verdict_for(rid, 6).error == ""  # the request survived the malformed blocks


def test_a_resent_block_gets_the_same_verdict_again(pair):
    """A block resent after a verdict timeout (same request, round, prefix and tokens) is answered
    with the verdict already given, not verified twice and not refused as a duplicate."""
    rid = "resend-" + uuid.uuid4().hex[:8]
    pair.publish_block(rid, 0, [1, 2], context=PROMPT_IDS)
    first = pair.verdict_for(rid, 0)
    assert first.error == ""
    pair.verdicts.msgs.clear()
    pair.publish_block(rid, 0, [1, 2], context=PROMPT_IDS)  # the resend
    again = pair.verdict_for(rid, 0)
    assert again.error == "" and list(again.committed_ids) == list(first.committed_ids)
    assert again.committed_length == first.committed_length
    pair.publish_block(rid, 1, [3], prefix_length=first.committed_length)  # the request goes on
    assert pair.verdict_for(rid, 1).error == ""
    assert pair.stats.wait_for(lambda m: m.request_id == rid and m.round_id == 1, 10.0) is not None
    assert len([m for m in pair.stats.msgs if m.request_id == rid]) == 2  # verified once per round


@pytest.mark.parametrize("mode", ["error", "drafter_only"])
def test_verifier_killed_mid_goal(ros, target_lm, tmp_path, mode):
    n = 1000
    p = Pair(ros, f"/nodes_loss_{mode}", tmp_path,
             drafter={"on_edge_loss": mode, "verdict_timeout_s": 1.0, "edge_retry_s": 0.5})
    try:
        p.wait_verifier()
        run = p.start_goal(max_new_tokens=n, k=2)
        assert run.first_feedback(GOAL_TIMEOUT), p.logs()
        p.procs["verifier"].kill()
        out = run.outcome(GOAL_TIMEOUT)
        ids = list(out.result.token_ids)
        assert p.procs["drafter"].alive(), p.logs()
        assert out.feedback_ids() == ids  # nothing lost or repeated across the loss
        assert len(ids) > 0
        n_verified = len(run.feedback[0].token_ids_delta)
        assert ids[:n_verified] == reference(target_lm, n_verified)
        if mode == "error":
            assert out.status_name == "aborted", p.logs()
            assert "edge lost" in out.result.error and "no verdict within" in out.result.error
            assert len(ids) < n
        else:
            assert out.status_name == "succeeded", out.result.error + "\n" + p.logs()
            assert len(ids) == n
            assert "continuing with the drafter alone" in p.procs["drafter"].log.read_text()
            assert 0 < out.result.drafter_only_rounds < out.result.rounds  # reported, and the first rounds were verified
    finally:
        p.close()


def test_verifier_restarted_mid_goal_costs_time_not_the_answer(ros, target_lm, tmp_path):
    """kill -9 the verifier mid-answer and start a new one (it answers 'edge loading' until its model is
    in): with on_edge_loss wait the drafter resends the round with the context until the edge is back,
    and the answer is the target's own greedy text, every token once, nothing drafter-only."""
    n = 600
    ns = "/nodes_restart"
    # verdict_retries 0: the first missed verdict already counts as a silent edge (a restart that
    # takes less than the retries would otherwise be ridden out by resends alone).
    p = Pair(ros, ns, tmp_path, drafter={"on_edge_loss": "wait", "verdict_timeout_s": 1.0, "edge_retry_s": 0.5, "verdict_retries": 0,
                                         "first_verdict_timeout_s": 2.0, "edge_wait_s": 120.0})
    try:
        p.wait_verifier()
        run = p.start_goal(max_new_tokens=n, k=2)
        assert run.first_feedback(GOAL_TIMEOUT), p.logs()
        p.procs["verifier"].kill()
        p.procs["verifier"] = NodeProcess("verifier_node", ns, tmp_path, target_model=TARGET, target_dtype="float32")
        out = run.outcome(3 * GOAL_TIMEOUT)  # a new process loads its model meanwhile
        ids = list(out.result.token_ids)
        assert out.status_name == "succeeded", out.result.error + "\n" + p.logs()
        assert out.feedback_ids() == ids  # nothing lost or repeated across the restart
        assert ids == reference(target_lm, n)
        assert out.result.drafter_only_rounds == 0
        assert "waiting up to edge_wait_s" in p.procs["drafter"].log.read_text(), p.logs()
    finally:
        p.close()


class SlowFirstVerifier:
    """A stand-in edge in the test process: it answers a request's first block only after ``delay_s``
    (as a real edge does while it prefills a long prompt on a CPU), later blocks at once; each verdict
    commits the block's first draft token."""

    def __init__(self, ros, ns: str, delay_s: float):
        from wisv_ros.msg import DraftBlock, Verdict

        self.ros, self.delay_s, self.Verdict = ros, delay_s, Verdict
        self.committed: list[int] = []
        self.blocks: list = []
        self.pub = ros.create_publisher(Verdict, f"{ns}/verdict", RELIABLE_QOS)
        self.sub = ros.create_subscription(DraftBlock, f"{ns}/draft_block", self._on_block, RELIABLE_QOS)
        self.timers: list[threading.Timer] = []

    def _on_block(self, block) -> None:
        self.blocks.append(block)
        v = self.Verdict()
        v.request_id, v.round_id = block.request_id, block.round_id
        v.accepted, v.correction_id = 1, -1
        v.committed_ids = [int(block.token_ids[0])]
        v.committed_length = block.prefix_length + 1
        if block.round_id == 0:
            t = threading.Timer(self.delay_s, self._publish, (v,))
            self.timers.append(t)
            t.start()
        else:
            self._publish(v)

    def _publish(self, v) -> None:
        self.committed.extend(v.committed_ids)
        self.pub.publish(v)

    def close(self) -> None:
        for t in self.timers:
            t.cancel()
        self.ros.destroy_subscription(self.sub)
        self.ros.destroy_publisher(self.pub)


@pytest.mark.parametrize("first_timeout", [10.0, 0.5])
def test_the_first_block_waits_for_the_prefill(ros, tmp_path, first_timeout):
    """The first block of a request waits first_verdict_timeout_s (the edge prefills the prompt),
    later blocks verdict_timeout_s: a 2 s first verdict passes with 10 s and loses the edge with 0.5 s."""
    ns = f"/nodes_first_{int(first_timeout * 10)}"
    edge = SlowFirstVerifier(ros, ns, delay_s=2.0)
    drafter = NodeProcess("drafter_node", ns, tmp_path, drafter_model=DRAFTER, min_confidence=0.0, on_edge_loss="error",
                          placement="split", verdict_timeout_s=0.5, verdict_retries=0, first_verdict_timeout_s=first_timeout)
    client = GenerateClient(ros, f"{ns}/generate")
    try:
        assert client.wait_for_server(START_TIMEOUT), drafter.tail()
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                goal = client.start(PROMPT, max_new_tokens=6, k=2)
                break
            except (RuntimeError, TimeoutError):  # the drafter is still loading its model
                assert time.monotonic() < deadline, drafter.tail()
                time.sleep(0.5)
        out = goal.outcome(GOAL_TIMEOUT)
        assert len(edge.blocks) >= 1 and list(edge.blocks[0].context_ids) == PROMPT_IDS
        if first_timeout > 2.0:
            assert out.status_name == "succeeded", out.result.error + "\n" + drafter.tail()
            assert list(out.result.token_ids) == edge.committed  # every round went through the edge
            assert out.result.rounds == 6 and out.result.downlink_bytes > 0 and out.result.drafter_only_rounds == 0
            assert out.result.round_trip_s >= 2.0  # the first verdict's wait is counted
        else:
            assert out.status_name == "aborted"
            assert "no verdict within first_verdict_timeout_s = 0.5 s" in out.result.error
            assert len(edge.blocks) == 1  # no resend (verdict_retries 0)
    finally:
        client.client.destroy()
        drafter.stop()
        edge.close()


def test_a_huge_context_is_refused_at_once_and_another_robot_keeps_its_pace(pair, target_lm):
    """One robot sends blocks with a 100,000-token context (beyond max_context) every 50 ms while
    another answers: the huge ones are refused by name before any model work, and the other
    robot's time per round stays under twice its unloaded value (plus 20 ms of scheduling slack)."""
    n = 60
    base = pair.start_goal(max_new_tokens=n, k=2).outcome(GOAL_TIMEOUT)
    assert base.status_name == "succeeded", base.result.error
    unloaded = base.result.round_trip_s / base.result.rounds
    stop, sent = threading.Event(), []

    def flood():
        while not stop.is_set():
            rid = f"heavy-{len(sent)}"
            pair.publish_block(rid, 0, [1], context=[1] * 100_000)
            sent.append(rid)
            stop.wait(0.05)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        out = pair.start_goal(max_new_tokens=n, k=2).outcome(GOAL_TIMEOUT)
    finally:
        stop.set()
        thread.join(10.0)
    assert out.status_name == "succeeded", out.result.error
    assert list(out.result.token_ids) == reference(target_lm, n)
    loaded = out.result.round_trip_s / out.result.rounds
    assert loaded < 2 * unloaded + 0.02, (loaded, unloaded, len(sent))
    assert len(sent) >= 2 and "exceed this verifier's max_context 4096" in pair.verdict_for(sent[0], 0).error


def test_a_long_prompt_does_not_hold_another_robots_rounds(ros, tmp_path):
    """Real weights on llama.cpp (Qwen2.5-Coder-0.5B as target and drafter), a KV sequence per
    request: while one robot's block with a 4,000-token context is prefilled in chunks of 64,
    another robot's whole goal runs to its end, each of its rounds shorter than a fifth of the long
    block's; the long block is then verified as usual."""
    model = "qwen2.5-coder-0.5b-instruct"
    pair = Pair(ros, "/nodes_prefill", tmp_path,
                verifier={"target_model": model, "kv_sessions": 2, "prefill_chunk": 64, "max_context": 4096},
                drafter={"drafter_model": model})
    try:
        pair.wait_verifier()
        warm = pair.start_goal(max_new_tokens=8, k=4).outcome(GOAL_TIMEOUT)
        assert warm.status_name == "succeeded", warm.result.error + "\n" + pair.logs()
        context = [(37 * i) % 20000 + 100 for i in range(4000)]
        t_pub = ros.get_clock().now().nanoseconds * 1e-9
        pair.publish_block("long-0", 0, [context[0]], context=context)
        out = pair.start_goal(max_new_tokens=32, k=4).outcome(GOAL_TIMEOUT)
        assert out.status_name == "succeeded" and out.result.drafter_only_rounds == 0, out.result.error
        assert pair.verdicts.wait_for(lambda m: m.request_id == "long-0", 0.0) is None, \
            "the long block was verified before the other robot's goal ended\n" + pair.logs()
        long_verdict = pair.verdict_for("long-0", 0, timeout=300.0)
        assert not long_verdict.error and long_verdict.committed_length in (4001, 4002), long_verdict.error
        long_stats = pair.stats.wait_for(lambda m: m.request_id == "long-0", 10.0)
        assert long_stats is not None
        during = [m for m in pair.stats.msgs if m.request_id != "long-0" and not m.copy_round
                  and m.header.stamp.sec + m.header.stamp.nanosec * 1e-9 > t_pub]
        assert len(during) >= 5, len(during)
        assert max(m.round_time_s for m in during) < long_stats.round_time_s / 5, \
            ([round(m.round_time_s, 3) for m in during], long_stats.round_time_s)
    finally:
        pair.close()


def test_a_robot_flooding_the_edge_with_requests_does_not_slow_another_robot(ros, tmp_path, target_lm):
    """A fleet edge (robots robot1, robot2; at most 4 requests kept): robot2 opens a new request
    every 5 ms while robot1 answers a goal. robot1's request is never pushed out (no context resend),
    its answer is the target's own, and its time per round stays under twice its unloaded value
    (plus 20 ms of scheduling slack); robot2's surplus is answered 'edge busy' or verified, never lost."""
    from wisv_ros.msg import DraftBlock, Verdict

    ns = "/nodes_flood"
    verifier = NodeProcess("verifier_node", ns, tmp_path, target_model=TARGET, target_dtype="float32",
                           robots="robot1,robot2", max_requests=4, max_queue=16)
    drafter = NodeProcess("drafter_node", f"{ns}/robot1", tmp_path, drafter_model=DRAFTER, min_confidence=0.0,
                          placement="split")
    client = GenerateClient(ros, f"{ns}/robot1/generate")
    flood_pub = ros.create_publisher(DraftBlock, f"{ns}/robot2/draft_block", RELIABLE_QOS)
    # Deep enough for every flood verdict: a keep-last-10 reader drops the oldest when this test
    # process's executor falls behind a 200 Hz burst, and the test counts them all.
    flood_verdicts = Topic(ros, Verdict, f"{ns}/robot2/verdict", reliable_qos(1000))
    n = 60

    def goal():
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                out = client.start(PROMPT, max_new_tokens=n, k=2).outcome(GOAL_TIMEOUT)
                if "loading" not in out.result.error:
                    return out
            except (RuntimeError, TimeoutError):
                pass
            assert time.monotonic() < deadline, drafter.tail() + verifier.tail()
            time.sleep(0.5)

    try:
        assert client.wait_for_server(START_TIMEOUT), drafter.tail()
        base = goal()
        assert base.status_name == "succeeded", base.result.error + verifier.tail()
        unloaded = base.result.round_trip_s / base.result.rounds
        # Both flood endpoints matched before the flood: a volatile, reliable topic delivers only
        # to readers already discovered (discovery is slow on a loaded CI machine).
        deadline = time.monotonic() + START_TIMEOUT
        while not (flood_pub.get_subscription_count() > 0 and ros.count_publishers(f"{ns}/robot2/verdict") > 0):
            assert time.monotonic() < deadline, "the verifier's robot2 endpoints were never discovered"
            time.sleep(0.1)

        def block(request_id):
            msg = DraftBlock()
            msg.request_id, msg.round_id = request_id, 0
            msg.token_ids, msg.k = [1], 1
            msg.context_ids = PROMPT_IDS
            msg.prefix_length = len(PROMPT_IDS)
            return msg

        # ... and matched both ways: the graph lists the verifier's verdict writer before that writer
        # has matched this reader, and a verdict sent in between is lost to this test (not to a robot,
        # whose reader is matched before its first goal). A probe answered proves the path.
        for i in range(int(START_TIMEOUT)):
            flood_pub.publish(block(f"probe-{i}"))
            if flood_verdicts.wait_for(lambda m: m.request_id.startswith("probe-"), 1.0) is not None:
                break
        else:
            raise AssertionError("no probe block on robot2 was answered\n" + verifier.tail())
        stop, sent = threading.Event(), []

        def flood():
            while not stop.is_set():
                msg = block(f"flood-{len(sent)}")
                flood_pub.publish(msg)
                sent.append(msg.request_id)
                stop.wait(0.005)

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30.0
            while len(sent) < 30:  # the flood runs before robot1's goal starts ...
                assert time.monotonic() < deadline, "the flood did not start"
                time.sleep(0.05)
            before = len(sent)
            out = goal()
            during = len(sent) - before  # ... and all through it
        finally:
            stop.set()
            thread.join(10.0)
        assert out.status_name == "succeeded", out.result.error + verifier.tail()
        assert list(out.result.token_ids) == reference(target_lm, n)
        loaded = out.result.round_trip_s / out.result.rounds
        assert loaded < 2 * unloaded + 0.02, (loaded, unloaded, len(sent))
        log = verifier.log.read_text(errors="replace")
        assert "unknown request" not in log  # robot1's request was never pushed out
        answered = flood_verdicts.wait_for(lambda m: m.request_id == sent[-1], 30.0)
        got = {m.request_id for m in flood_verdicts.msgs if m.request_id.startswith("flood-")}
        assert answered is not None, f"{len(sent)} flood blocks sent, {len(got)} answered, the last ({sent[-1]}) not\n" + verifier.tail()
        assert during >= 10 and len(got) == len(sent), (during, len(sent), len(got), sorted(set(sent) - got)[:5])
    finally:
        client.client.destroy()
        ros.destroy_publisher(flood_pub)
        ros.destroy_subscription(flood_verdicts.sub)
        drafter.stop()
        verifier.stop()


def test_invalid_goal_is_aborted_with_the_reason(pair):
    out = pair.start_goal(max_new_tokens=8, method="bogus").outcome(GOAL_TIMEOUT)
    assert out.status_name == "aborted"
    assert "method 'bogus' is not served by drafter_node" in out.result.error
    out = pair.start_goal(max_new_tokens=8, method="reject", temperature=0.0).outcome(GOAL_TIMEOUT)
    assert out.status_name == "aborted" and "temperature > 0" in out.result.error
    out = pair.start_goal(max_new_tokens=8, k=1000).outcome(GOAL_TIMEOUT)
    assert out.status_name == "aborted" and "k must be in [1, 256], got 1000" in out.result.error
    out = pair.start_goal(max_new_tokens=8, tau=float("nan")).outcome(GOAL_TIMEOUT)
    assert out.status_name == "aborted" and "tau: NaN" in out.result.error
    out = pair.start_goal(max_new_tokens=8, method="wisv", tau=float("inf")).outcome(GOAL_TIMEOUT)
    assert out.status_name == "aborted" and "tau must be in [0, 10]" in out.result.error
    out = pair.start_goal(max_new_tokens=8, temperature=float("nan")).outcome(GOAL_TIMEOUT)
    assert out.status_name == "aborted" and "temperature: NaN" in out.result.error


def test_reject_sampling_equals_the_in_process_core(pair, target_lm):
    """Method reject over the nodes (drafter distributions uploaded as float32) commits what
    rounds.generate() commits in one process with the same seeds (both node seeds are 0)."""
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.verification import Method, Verifier
    from wisv_ros.sd.rounds import generate

    n, k, temperature = 40, 4, 1.0
    drafter_lm = CausalLM(load_model(DRAFTER)[0])
    ref = generate(Drafter(drafter_lm, temperature=temperature, seed=0),
                   Verifier(target_lm, Method.REJECT, temperature=temperature, seed=0), PROMPT_IDS, n, k)
    run = pair.start_goal(max_new_tokens=n, k=k, method="reject", temperature=temperature)
    out = run.outcome(GOAL_TIMEOUT)
    assert out.status_name == "succeeded", out.result.error + "\n" + pair.logs()
    assert list(out.result.token_ids) == ref.token_ids
    assert ref.token_ids != reference(target_lm, n)  # sampled, not greedy
    # Each block carried its [k, 64] float32 distribution: more than k * 64 * 4 bytes up per round.
    assert out.result.uplink_bytes > out.result.rounds * k * 64 * 4 * 0.5


def wait_log(proc: NodeProcess, text: str, timeout: float, start: int = 0) -> int:
    """Position just after the first ``text`` in the log from ``start`` (polls the file)."""
    deadline = time.monotonic() + timeout
    while True:
        log = proc.log.read_text(errors="replace")
        pos = log.find(text, start)
        if pos >= 0:
            return pos + len(text)
        assert time.monotonic() < deadline, f"'{text}' not in the log within {timeout} s\n" + proc.tail()
        threading.Event().wait(0.1)


def test_channel_state_deadline_miss_is_logged(pair, ros):
    from wisv_ros.msg import ChannelState

    verifier = pair.procs["verifier"]
    pos = wait_log(verifier, "channel_state deadline missed", 10.0)  # nothing published yet
    pub = ros.create_publisher(ChannelState, f"{pair.ns}/channel_state", RELIABLE_QOS)
    try:
        deadline = time.monotonic() + 10.0
        while pub.get_subscription_count() == 0:
            assert time.monotonic() < deadline, "verifier did not subscribe to channel_state"
            threading.Event().wait(0.05)
        pub.publish(ChannelState(rate_bps=20e6, per=0.01, rtt_s=0.05))
        pos = wait_log(verifier, "channel_state is arriving again", 10.0, pos)
        wait_log(verifier, "channel_state deadline missed", 10.0, pos)  # silent again: logged again
    finally:
        ros.destroy_publisher(pub)
    assert verifier.alive()


def _call(client, request, wait_s: float):
    """One service call; its response, or None when none came within ``wait_s``."""
    future = client.call_async(request)
    deadline = time.monotonic() + wait_s
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    return future.result() if future.done() else None


def lifecycle_state(ros, name: str) -> str:
    """The label of a lifecycle node's state (its get_state service). A request sent right after
    discovery can be lost before the reply path is matched: it is sent again until START_TIMEOUT."""
    from lifecycle_msgs.srv import GetState

    client = ros.create_client(GetState, f"{name}/get_state")
    try:
        assert client.wait_for_service(timeout_sec=START_TIMEOUT), f"no {name}/get_state"
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            res = _call(client, GetState.Request(), 5.0)
            if res is not None:
                return res.current_state.label
            assert time.monotonic() < deadline, f"{name}/get_state did not answer"
    finally:
        ros.destroy_client(client)


_AFTER = {"configure": "inactive", "activate": "active", "deactivate": "inactive", "cleanup": "unconfigured"}


def change_state(ros, name: str, transition: str) -> bool:
    """Trigger a lifecycle transition by its label (configure, activate, deactivate, cleanup); True
    when the node is in the transition's target state afterwards. An unanswered request is checked
    against the node's state before it is sent again (its answer may be what got lost)."""
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState

    client = ros.create_client(ChangeState, f"{name}/change_state")
    try:
        assert client.wait_for_service(timeout_sec=START_TIMEOUT), f"no {name}/change_state"
        req = ChangeState.Request()
        req.transition = Transition(id=getattr(Transition, f"TRANSITION_{transition.upper()}"))
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            res = _call(client, req, 10.0)
            if res is not None and res.success:
                return True
            if lifecycle_state(ros, name) == _AFTER[transition]:
                return True
            if res is not None:
                return False
            assert time.monotonic() < deadline, f"{name}/change_state {transition} did not answer"
    finally:
        ros.destroy_client(client)


def test_lifecycle_transitions_load_serve_and_release(ros, target_lm, tmp_path):
    """autostart false: both nodes wait unconfigured (goals rejected, blocks answered "not active");
    configure + activate by the lifecycle services make them serve; deactivate refuses again."""
    p = Pair(ros, "/nodes_lc", tmp_path, verifier={"autostart": False}, drafter={"autostart": False})
    try:
        for name in ("verifier_node", "drafter_node"):
            assert lifecycle_state(ros, f"/nodes_lc/{name}") == "unconfigured", p.logs()
        assert p.client.wait_for_server(START_TIMEOUT)
        with pytest.raises(RuntimeError, match="goal rejected"):
            p.client.start(PROMPT, max_new_tokens=4)
        while p.block_pub.get_subscription_count() == 0:
            time.sleep(0.05)
        p.publish_block("lc-early", 0, [1, 2], context=PROMPT_IDS)
        early = p.verdict_for("lc-early", 0)
        assert early is not None and "not active" in early.error, p.logs()
        for name in ("verifier_node", "drafter_node"):
            assert change_state(ros, f"/nodes_lc/{name}", "configure"), p.logs()
            assert lifecycle_state(ros, f"/nodes_lc/{name}") == "inactive"
            assert change_state(ros, f"/nodes_lc/{name}", "activate"), p.logs()
            assert lifecycle_state(ros, f"/nodes_lc/{name}") == "active"
        out = p.start_goal(max_new_tokens=12, k=4).outcome(GOAL_TIMEOUT)
        assert out.status_name == "succeeded", out.result.error + "\n" + p.logs()
        assert list(out.result.token_ids) == reference(target_lm, 12)
        assert change_state(ros, "/nodes_lc/drafter_node", "deactivate")
        with pytest.raises(RuntimeError, match="goal rejected"):
            p.client.start(PROMPT, max_new_tokens=4)
        assert change_state(ros, "/nodes_lc/drafter_node", "cleanup")
        assert lifecycle_state(ros, "/nodes_lc/drafter_node") == "unconfigured"
    finally:
        p.close()


def test_goals_are_rejected_when_the_drafter_cannot_load(ros, tmp_path):
    drafter = NodeProcess("drafter_node", "/nodes_noload", tmp_path, drafter_model="no-such-model")
    client = GenerateClient(ros, "/nodes_noload/generate")
    try:
        assert client.wait_for_server(START_TIMEOUT), drafter.tail()
        wait_log(drafter, "loading the drafter failed", START_TIMEOUT)
        assert lifecycle_state(ros, "/nodes_noload/drafter_node") == "finalized"  # clients see the failure
        with pytest.raises(RuntimeError, match="goal rejected"):
            client.start(PROMPT, max_new_tokens=4)
        wait_log(drafter, "goal rejected: MissingModelError: unknown model 'no-such-model'", 10.0)
        assert drafter.alive()
    finally:
        drafter.stop()
        client.client.destroy()


@pytest.mark.parametrize("protocol,projected", [("sh", False), ("fh", True), ("sh", True)],
                         ids=["sh", "fh_projected", "sh_projected"])
def test_wisv_head_over_sh_equals_the_in_process_core(ros, target_lm, tmp_path, protocol, projected):
    """The node graph with an ONNX head (SH: hiddens fetched at the mismatches) commits exactly what
    rounds.generate() commits in one process with the same head and the same float16 hiddens; so does
    a drafter that sends the head's drafter projection instead (head_path on the drafter, FH or SH)."""

    import numpy as np
    import torch

    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.verification import Method, Verifier
    from wisv_ros.sd.rounds import generate
    from wisv_ros.wisv.head_training import DecisionHead, export_onnx
    from wisv_ros.wisv.head import OnnxHead, load_projection, make_judge
    from wisv_ros.link.channel import SCENARIOS

    torch.manual_seed(0)
    head = DecisionHead(32, 32, hidden=16).eval()
    with torch.no_grad():  # spread the untrained head's outputs away from tau
        [m for m in head.modules() if isinstance(m, torch.nn.Linear)][-1].weight.mul_(30)
    path = tmp_path / "head.onnx"
    export_onnx(head, path)
    judge = make_judge(OnnxHead(path), lambda: SCENARIOS["20mbps_50ms"])  # the node's default_channel

    def wire_judge(drafter_hidden, positions, target_hidden):  # the drafter sends float16 hiddens
        return judge(drafter_hidden.astype(np.float16).astype(np.float32), positions, target_hidden)

    n, k, tau = 40, 4, 0.5
    drafter_lm = CausalLM(load_model(DRAFTER)[0])
    ref = generate(Drafter(drafter_lm), Verifier(target_lm, Method.WISV, tau=tau, judge=wire_judge), PROMPT_IDS, n, k)
    assert ref.token_ids != reference(target_lm, n)  # the head accepted some mismatches

    ns = f"/nodes_head_{protocol}{'_projected' if projected else ''}"
    p = Pair(ros, ns, tmp_path, verifier={"head_path": str(path)}, drafter={"head_path": str(path)} if projected else None)
    from wisv_ros.msg import DraftBlock, HiddenReply

    uplink = Topic(ros, DraftBlock if protocol == "fh" else HiddenReply, f"{ns}/{'draft_block' if protocol == 'fh' else 'hidden_reply'}")
    try:
        p.wait_verifier()
        run = p.start_goal(max_new_tokens=n, k=k, method="wisv", tau=tau, protocol=protocol)
        out = run.outcome(GOAL_TIMEOUT)
        assert out.status_name == "succeeded", out.result.error + "\n" + p.logs()
        assert list(out.result.token_ids) == ref.token_ids
        assert out.result.rounds == ref.stats.rounds
        rid = request_id(run)
        assert bool([m for m in p.hidden_requests.msgs if m.request_id == rid]) == (protocol == "sh")
        assert "no decision head" not in p.procs["verifier"].log.read_text()
        assert "head_id:" not in p.procs["verifier"].log.read_text() and out.result.drafter_only_rounds == 0
        # What carried the drafter rows: 16-wide projections named by the head, or 32-wide hiddens.
        carried = [m.hidden for m in uplink.msgs if m.request_id == rid]
        assert carried and {(h.shape[1], h.head_id) for h in carried} == ({(16, load_projection(path).head_id)}
                                                                          if projected else {(32, "")})
    finally:
        ros.destroy_subscription(uplink.sub)
        p.close()


def test_tau_per_channel_follows_the_measured_channel_in_the_verifier(ros, target_lm, tmp_path):
    """verifier_node with a head whose sidecar carries a tau per channel (tau_per_channel "head", the
    default) judges every wisv block with the tau of the scenario nearest the channel_state it last heard, whatever tau the goal asked for: on a channel
    like 500 Mbit/s / 5 ms (tau 0) the answer is the target's greedy one; on 20 Mbit/s / 50 ms (tau
    0.5) it is what the in-process core commits with tau 0.5 and that channel; the round log records
    the tau of each round."""
    import numpy as np
    import torch

    from wisv_ros.link.channel import SCENARIOS
    from wisv_ros.msg import ChannelState
    from wisv_ros.sd.drafting import Drafter
    from wisv_ros.sd.roundlog import read_round_log
    from wisv_ros.sd.rounds import generate
    from wisv_ros.sd.verification import Method, Verifier
    from wisv_ros.wisv.head import OnnxHead, make_judge
    from wisv_ros.wisv.head_training import DecisionHead, export_onnx

    torch.manual_seed(0)
    head = DecisionHead(32, 32, hidden=16).eval()
    with torch.no_grad():  # spread the untrained head's outputs away from tau
        [m for m in head.modules() if isinstance(m, torch.nn.Linear)][-1].weight.mul_(30)
    path = tmp_path / "head.onnx"
    # The schedule travels in the head's sidecar: the verifier's default tau_per_channel "head" reads it.
    export_onnx(head, path, meta={"tau_per_channel": "20mbps_50ms:0.5,500mbps_5ms:0"})
    bad = SCENARIOS["20mbps_50ms"]
    judge = make_judge(OnnxHead(path), lambda: bad)

    def wire_judge(drafter_hidden, positions, target_hidden):  # the drafter sends float16 hiddens
        return judge(drafter_hidden.astype(np.float16).astype(np.float32), positions, target_hidden)

    n, k = 40, 4
    lenient = generate(Drafter(CausalLM(load_model(DRAFTER)[0])), Verifier(target_lm, Method.WISV, tau=0.5, judge=wire_judge),
                       PROMPT_IDS, n, k).token_ids
    assert lenient != reference(target_lm, n)  # tau 0.5 on that channel accepts some mismatches
    ns, log = "/nodes_tau_per_channel", tmp_path / "rounds.jsonl"
    p = Pair(ros, ns, tmp_path, verifier={"head_path": str(path), "round_log": str(log)})
    pub = ros.create_publisher(ChannelState, f"{ns}/channel_state", RELIABLE_QOS)
    try:
        p.wait_verifier()
        deadline = time.monotonic() + 10.0
        while pub.get_subscription_count() < 2:  # the drafter and the verifier
            assert time.monotonic() < deadline, "channel_state subscribers not discovered"
            threading.Event().wait(0.05)
        answers = {}
        for name, ch in (("500mbps_5ms", SCENARIOS["500mbps_5ms"]), ("20mbps_50ms", bad)):
            pub.publish(ChannelState(rate_bps=ch.rate_bps, per=ch.per, rtt_s=ch.rtt_s))
            threading.Event().wait(0.5)  # delivered before the goal's first block
            run = p.start_goal(max_new_tokens=n, k=k, method="wisv", tau=0.9, protocol="fh", placement="split")
            out = run.outcome(GOAL_TIMEOUT)
            assert out.status_name == "succeeded", out.result.error + "\n" + p.logs()
            answers[name] = (request_id(run), list(out.result.token_ids))
        assert answers["500mbps_5ms"][1] == reference(target_lm, n)
        assert answers["20mbps_50ms"][1] == lenient
        taus = {}
        for rec in read_round_log(log):
            taus.setdefault(rec.request_id, set()).add(rec.tau)
        assert taus[answers["500mbps_5ms"][0]] == {0.0} and taus[answers["20mbps_50ms"][0]] == {0.5}
    finally:
        ros.destroy_publisher(pub)
        p.close()


def test_parameters_are_validated_when_set(pair, ros):
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    from wisv_ros.nodes.client import _wait

    cli = ros.create_client(SetParameters, f"{pair.ns}/drafter_node/set_parameters")
    try:
        assert cli.wait_for_service(timeout_sec=10.0)

        def set_param(name, value):
            if isinstance(value, str):
                pv = ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value)
            else:
                pv = ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value)
            req = SetParameters.Request(parameters=[Parameter(name=name, value=pv)])
            return _wait(cli.call_async(req), 10.0, "set_parameters").results[0]

        bad = set_param("method", "bogus")
        assert not bad.successful and "method: 'bogus' is not one of greedy, reject, wisv" in bad.reason
        assert not set_param("k", 0).successful  # below the declared range [1, 256]
        frozen = set_param("drafter_model", "tiny-random:1:64")
        assert not frozen.successful and "read at start only" in frozen.reason
        assert set_param("k", 8).successful
    finally:
        ros.destroy_client(cli)


def test_copy_mode_on_the_edge_is_lossless_and_saves_round_trips(ros, target_lm, tmp_path):
    """SwitchSD copy rounds (n-gram gate; kappa 1 so that the tiny target's repeats trigger it)
    run on the verifier after a block: the text still equals target-only greedy, and the copied
    tokens arrive in the same verdicts (fewer round trips than rounds)."""
    n = 60
    p = Pair(ros, "/nodes_copy", tmp_path, verifier={"copy": "ngram", "copy_kappa": 1})
    try:
        p.wait_verifier()
        run = p.start_goal(max_new_tokens=n, k=4)
        out = run.outcome()
        assert out.status_name == "succeeded", out.result.error + "\n" + p.logs()
        r = out.result
        assert list(r.token_ids) == reference(target_lm, n)
        assert out.feedback_ids() == list(r.token_ids)
        copies = [m for m in p.stats.msgs if m.request_id == request_id(run) and m.copy_round]
        assert r.copy_rounds > 0 and r.copy_rounds == len(copies), p.logs()
        assert r.copy_committed == sum(m.committed for m in copies) > 0
        assert r.edge_time_s > 0 and r.round_trip_s > r.edge_time_s and r.draft_time_s > 0
        # Rejection SD gets copy rounds too (sampled acceptance, exact: test_copying).
        out = p.start_goal(max_new_tokens=n, k=4, method="reject", temperature=1.0).outcome()
        assert out.status_name == "succeeded", out.result.error + "\n" + p.logs()
        assert out.result.copy_rounds > 0 and len(out.result.token_ids) == n
        assert out.feedback_ids() == list(out.result.token_ids)
    finally:
        p.close()


@pytest.mark.parametrize("params,error", [
    ({"copy": "probe"}, "parameter probe_path: copy=probe needs a probe file"),
    ({"tau_per_channel": "5g:0.1"}, "tau_per_channel: unknown channel scenario '5g'"),
    ({"kv_sessions": 2}, "parameter kv_sessions: 2 needs backend llama_cpp"),
], ids=["copy_probe_without_probe", "bad_tau_per_channel", "kv_sessions_on_torch"])
def test_a_verifier_with_bad_parameters_stops_naming_them(tmp_path, params, error):
    node = NodeProcess("verifier_node", "/nodes_bad_params", tmp_path, target_model=TARGET, **params)
    try:
        node.proc.wait(START_TIMEOUT)
        assert node.proc.returncode != 0
        assert error in node.log.read_text()
    finally:
        node.stop()


def test_adaptive_protocol_follows_the_channel_state(pair, ros):
    """Protocol adaptive (method wisv) picks SH on a slow, short link and FH on a fast, long one,
    from the latest channel_state and the running mean of mismatches (link.choose_protocol)."""
    from wisv_ros.msg import ChannelState

    pub = ros.create_publisher(ChannelState, f"{pair.ns}/channel_state", RELIABLE_QOS)
    try:
        deadline = time.monotonic() + 10.0
        while pub.get_subscription_count() < 2:  # the drafter and the verifier
            assert time.monotonic() < deadline, "channel_state subscribers not discovered"
            threading.Event().wait(0.05)
        protocols = {}
        for name, state in {"slow": ChannelState(rate_bps=1e3, per=0.0, rtt_s=0.005),
                            "fast": ChannelState(rate_bps=1e9, per=0.0, rtt_s=0.1)}.items():
            pub.publish(state)
            threading.Event().wait(0.5)  # delivered before the goal's first block
            run = pair.start_goal(max_new_tokens=12, k=4, method="wisv", tau=0.5, protocol="adaptive")
            out = run.outcome()
            assert out.status_name == "succeeded", out.result.error + "\n" + pair.logs()
            rid = request_id(run)
            stats = [m for m in pair.stats.msgs if m.request_id == rid]
            assert stats, pair.logs()
            protocols[name] = {m.protocol for m in stats}
        # On the slow link SH wins while the expected mismatches leave hiddens to save (with the
        # tiny drafter's 32-wide hiddens a round with many mismatches can still go FH).
        assert "sh" in protocols["slow"] and protocols["fast"] == {"fh"}, protocols
    finally:
        ros.destroy_publisher(pub)
