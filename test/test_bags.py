"""Bags: record a real drafter/verifier run, read it back, replay it, re-verify it.

Real processes (tiny random models, as test/test_nodes.py): verifier_node + drafter_node in one
namespace, the recorder (``python -m wisv_ros.cli.bag record``) as a subprocess while Generate
goals run; then info, replay into a fresh namespace and reverify on that bag. ``ros2 bag`` itself
is not installable here: the bag format is checked through its metadata, the type hashes against
rosidl's (generated JSON) and the middleware's (DDS discovery), and the data through rosbags and
rclpy. tools/test.sh sets a test-specific ROS_DOMAIN_ID and localhost-only discovery.
"""
from __future__ import annotations

import csv
import json
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

from wisv_ros.interfaces import bags  # noqa: E402
from wisv_ros.interfaces.bags import QosSpec, open_bag, to_plain  # noqa: E402
from wisv_ros.cli import bag as bag_cli  # noqa: E402
from wisv_ros.nodes.client import GenerateClient  # noqa: E402
from wisv_ros.nodes.common import RELIABLE_QOS, reliable_qos  # noqa: E402

TARGET = "tiny-random:0:64"
DRAFTER = "tiny-random:0:64:0.05"
PROMPT = "5 9 12 3"
START_TIMEOUT = 90.0
GOAL_TIMEOUT = 60.0
PID = os.getpid()
SRC_NS = f"/bag_src_{PID}"
REPLAY_NS = f"/bag_replay_{PID}"
TOPICS = ("draft_block", "verdict", "round_stats", "channel_state", "hidden_request", "hidden_reply")


def _cli(*args: str, log: Path | None = None, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "wisv_ros.cli.bag", *args]
    if log is None:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, **kw)


def _node(kind: str, ns: str, log: Path, **params) -> subprocess.Popen:
    cmd = [sys.executable, "-m", f"wisv_ros.nodes.{kind}", "--ros-args", "-r", f"__ns:={ns}", "-p", "threads:=1"]
    for name, value in params.items():
        cmd += ["-p", f"{name}:={value}"]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", RCUTILS_LOGGING_BUFFERED_STREAM="0"))


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> int | None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            return None
    return proc.returncode


class Collector:
    """Messages of one topic with their reception time (time.monotonic) in the test process."""

    def __init__(self, node, msg_type, name: str, qos=None):
        self.items: list[tuple[float, object]] = []
        self._cv = threading.Condition()
        self.sub = node.create_subscription(msg_type, name, self._on, qos or reliable_qos(1000))

    def _on(self, msg) -> None:
        with self._cv:
            self.items.append((time.monotonic(), msg))
            self._cv.notify_all()

    def wait(self, pred, timeout: float):
        with self._cv:
            self._cv.wait_for(lambda: any(pred(m) for _, m in self.items), timeout)
            return next((m for _, m in self.items if pred(m)), None)

    def wait_count(self, n: int, timeout: float) -> int:
        with self._cv:
            self._cv.wait_for(lambda: len(self.items) >= n, timeout)
            return len(self.items)


def _logs(*paths: Path) -> str:
    return "\n".join(f"--- {p}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:]) for p in paths if p.exists())


def _channel_head(path: Path) -> str:
    """A WISV decision head that looks at the channel only: rejection probability 0.01 at
    20 Mbit/s (accept every mismatch), 0.99 at 500 Mbit/s (reject every mismatch)."""
    import torch

    from wisv_ros.wisv.head_training import DecisionHead, export_onnx
    from wisv_ros.link.channel import CHANNEL_FEATURES

    head = DecisionHead(32, 32, hidden=1, dropout=0.0)
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.mlp[0].weight[0, 64 + list(CHANNEL_FEATURES).index("log_rate")] = 1.0  # 0.434 / 0.900
        head.mlp[3].weight.fill_(20.0)
        head.mlp[3].bias.fill_(-13.0)
    export_onnx(head.eval(), path)
    return str(path)


# --------------------------------------------------------------------------- the recording
@pytest.fixture(scope="module")
def recorded(ros, tmp_path_factory):
    """verifier + drafter run two goals (fh greedy, sh wisv) while the recorder records SRC_NS."""
    from wisv_ros.msg import ChannelState, DraftBlock, Verdict
    from wisv_ros.nodes.link_monitor_node import STATE_QOS

    tmp = tmp_path_factory.mktemp("bags")
    logs = {k: tmp / f"{k}.log" for k in ("verifier", "drafter", "record")}
    head = _channel_head(tmp / "head.onnx")
    procs = [
        _node("verifier_node", SRC_NS, logs["verifier"], target_model=TARGET, target_dtype="float32", head_path=head),
        _node("drafter_node", SRC_NS, logs["drafter"], drafter_model=DRAFTER, min_confidence=0.0, placement="split"),
    ]
    block_pub = ros.create_publisher(DraftBlock, f"{SRC_NS}/draft_block", RELIABLE_QOS)
    # A link monitor's channel_state publisher: transient-local; its first estimate predates the recorder.
    state_pub = ros.create_publisher(ChannelState, f"{SRC_NS}/channel_state", STATE_QOS)
    verdicts = Collector(ros, Verdict, f"{SRC_NS}/verdict")
    client = GenerateClient(ros, f"{SRC_NS}/generate")
    recorder = None
    try:
        def state(rate: float) -> ChannelState:
            m = ChannelState()
            m.header.stamp = ros.get_clock().now().to_msg()
            m.rate_bps, m.per, m.rtt_s, m.source, m.samples = rate, 0.01, 0.05, "test", 3
            return m

        state_pub.publish(state(2.0e7))

        def probe() -> object:
            rid = "probe-" + uuid.uuid4().hex[:8]
            b = DraftBlock()
            b.request_id, b.round_id, b.token_ids, b.k, b.method = rid, 0, [1, 2], 2, "greedy"
            b.context_ids, b.prefix_length = [5, 9, 12, 3], 4
            block_pub.publish(b)
            return verdicts.wait(lambda m: m.request_id == rid, 3.0)

        deadline = time.monotonic() + START_TIMEOUT
        while True:  # verifier loaded and matched
            v = probe() if block_pub.get_subscription_count() else None
            if v is not None and not v.error:
                break
            assert time.monotonic() < deadline, "verifier never answered\n" + _logs(*logs.values())
            time.sleep(0.3)

        bag_path = tmp / "run"
        recorder = _cli("record", str(bag_path), "--namespace", SRC_NS, "--progress", "0.2", log=logs["record"])
        deadline = time.monotonic() + 60
        want = [f"{SRC_NS}/{t}" for t in ("draft_block", "verdict", "round_stats", "channel_state")]
        while True:  # the recorder subscribed and gets the verifier's messages
            text = logs["record"].read_text(errors="replace")
            if all(f"recording {t} " in text for t in want):
                probe()
                counts = re.findall(rf"{re.escape(SRC_NS)}/verdict (\d+)", logs["record"].read_text(errors="replace"))
                if counts and int(counts[-1]) > 0:
                    break
            assert recorder.poll() is None and time.monotonic() < deadline, "recorder not ready\n" + _logs(logs["record"])
            time.sleep(0.3)

        assert client.wait_for_server(START_TIMEOUT), _logs(*logs.values())
        outcomes = {}
        goals = (
            ("fh", 2.0e7, dict(max_new_tokens=30, k=4, protocol="fh", method="greedy")),
            ("sh_20mbps", 2.0e7, dict(max_new_tokens=30, k=4, protocol="sh", method="wisv", tau=0.5)),
            ("fh_500mbps", 5.0e8, dict(max_new_tokens=30, k=4, protocol="fh", method="wisv", tau=0.5)),
        )
        for name, rate, goal in goals:
            if rate != 2.0e7:  # a new channel estimate, well before the goal's first block
                state_pub.publish(state(rate))
                time.sleep(0.5)
            deadline = time.monotonic() + START_TIMEOUT
            while True:
                try:
                    run = client.start(PROMPT, **goal)
                    break
                except (RuntimeError, TimeoutError):  # drafter still loading, or the goal response lost or late
                    assert time.monotonic() < deadline, _logs(*logs.values())
                    time.sleep(0.5)
            out = run.outcome(GOAL_TIMEOUT)
            assert out.status_name == "succeeded", out.result.error + "\n" + _logs(*logs.values())
            outcomes[name] = (uuid.UUID(bytes=bytes(run.handle.goal_id.uuid)).hex[:16], out.result)
        state_pub.publish(state(2.0e7))
        # The DDS type hashes the publishers announce (the generated types' own).
        dds_hashes = {}
        for t in ("draft_block", "verdict", "round_stats", "channel_state"):
            infos = ros.get_publishers_info_by_topic(f"{SRC_NS}/{t}")
            dds_hashes[t] = {str(getattr(i, "topic_type_hash", "")) for i in infos}
        time.sleep(0.5)  # round_stats of the last round (published after its verdict)
        rc = _stop(recorder, signal.SIGINT)
        assert rc == 0, f"recorder exit code {rc}\n" + _logs(logs["record"])
        yield {"bag": bag_path, "outcomes": outcomes, "dds_hashes": dds_hashes, "log": logs["record"], "tmp": tmp,
               "head": head}
    finally:
        if recorder is not None:
            _stop(recorder, signal.SIGINT)
        for p in procs:
            _stop(p)
        ros.destroy_publisher(block_pub)
        ros.destroy_publisher(state_pub)
        ros.destroy_subscription(verdicts.sub)
        client.client.destroy()


# --------------------------------------------------------------------------- format
def test_type_hashes_match_rosidl_generated_types():
    """rosbags' hashes of every wisv_ros type equal the ones rosidl generated (share/*/msg/*.json)."""
    store = bags.typestore()
    names = bags.wisv_types(store)
    assert len(names) == len(list(Path(__file__).resolve().parents[1].joinpath("msg").glob("*.msg")))
    found = 0
    for prefix in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        for f in Path(prefix or "/nonexistent").joinpath("share", "wisv_ros", "msg").glob("*.json"):
            for entry in json.loads(f.read_text())["type_hashes"]:
                assert bags.type_hash(entry["type_name"], store) == entry["hash_string"], entry["type_name"]
                found += 1
        if found:
            break
    assert found >= len(names), "no rosidl-generated type hashes (share/wisv_ros/msg/*.json) found"


def test_bag_metadata_is_rosbag2_v9_mcap(recorded):
    bag_path = recorded["bag"]
    from ruamel.yaml import YAML

    meta = YAML(typ="safe").load((bag_path / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
    assert meta["version"] == 9 and meta["storage_identifier"] == "mcap"
    files = meta["relative_file_paths"]
    assert len(files) == 1 and files[0].endswith(".mcap") and (bag_path / files[0]).stat().st_size > 0
    topics = {t["topic_metadata"]["name"]: t for t in meta["topics_with_message_count"]}
    for name in ("draft_block", "verdict", "round_stats", "channel_state", "hidden_request", "hidden_reply"):
        t = topics[f"{SRC_NS}/{name}"]
        md = t["topic_metadata"]
        assert md["serialization_format"] == "cdr" and md["type"].startswith("wisv_ros/msg/")
        assert md["type_description_hash"] == bags.type_hash(md["type"])
        assert t["message_count"] > 0, name
        if name in recorded["dds_hashes"]:  # what the live publishers announced over DDS
            assert recorded["dds_hashes"][name] == {md["type_description_hash"]}, name
    qos = topics[f"{SRC_NS}/channel_state"]["topic_metadata"]["offered_qos_profiles"]
    assert {q["durability"] for q in qos} == {"transient_local"}  # the test's STATE_QOS publisher
    assert all(q["reliability"] == "reliable" for t in topics.values() for q in t["topic_metadata"]["offered_qos_profiles"])
    assert sum(t["message_count"] for t in topics.values()) == meta["message_count"]
    # The mcap file's own schemas carry the message definitions.
    mcap = (bag_path / files[0]).read_bytes()
    assert mcap[:8] == b"\x89MCAP0\r\n" and b"ros2msg" in mcap and b"MSG: wisv_ros/HiddenStates" in mcap


def test_recording_holds_the_rounds(recorded):
    bag = open_bag(recorded["bag"])
    for name, (rid, result) in recorded["outcomes"].items():
        verdicts = [bag.decode(m) for m in bag.messages([f"{SRC_NS}/verdict"])]
        mine = [v for v in verdicts if v.request_id == rid]
        assert [v.round_id for v in mine] == list(range(result.rounds)), name
        ids = [int(i) for v in mine for i in v.committed_ids]
        assert ids[: len(result.token_ids)] == list(result.token_ids)  # the streamed answer, from the bag
        blocks = [bag.decode(m) for m in bag.messages([f"{SRC_NS}/draft_block"])]
        first = next(b for b in blocks if b.request_id == rid)
        assert list(first.context_ids) == [5, 9, 12, 3]
        if name.startswith("fh"):
            assert first.hidden.dtype == "float16" and list(first.hidden.shape) == [len(first.token_ids), 32]
    # The channel state published before the recorder started arrived through transient-local.
    states = [bag.decode(m) for m in bag.messages([f"{SRC_NS}/channel_state"])]
    assert [s.rate_bps for s in states] == [2.0e7, 5.0e8, 2.0e7]
    assert "recording" in recorded["log"].read_text() and "transient_local" in recorded["log"].read_text()


def test_info_lists_topics_counts_and_duration(recorded, capsys):
    assert bag_cli.main(["info", str(recorded["bag"])]) == 0
    out = capsys.readouterr().out
    bag = open_bag(recorded["bag"])
    assert "rosbag2 metadata version 9" in out and "mcap" in out
    assert f"duration:   {bag.duration_ns / 1e9:.3f} s" in out and bag.duration_ns > 0
    for t in bag.topics():
        assert re.search(rf"^{re.escape(t.name)}\s+{re.escape(t.msgtype)}\s+{t.count}\s", out, re.M), t.name


# --------------------------------------------------------------------------- replay
def test_replay_into_a_fresh_namespace(recorded, ros):
    from wisv_ros import msg as wmsg
    from rclpy.qos import DurabilityPolicy

    bag = open_bag(recorded["bag"])
    types = {t.name.rsplit("/", 1)[1]: t.msgtype for t in bag.topics()}
    cols = {name: Collector(ros, getattr(wmsg, types[name].rsplit("/", 1)[1]), f"{REPLAY_NS}/{name}") for name in types}
    try:
        proc = _cli("replay", str(recorded["bag"]), "--remap", f"{SRC_NS}:={REPLAY_NS}", "--wait-for-subscribers", "20")
        # While it replays, the replayed channel_state is offered transient-local like the recorded one.
        durability = None
        deadline = time.monotonic() + 30
        while durability is None and proc.poll() is None and time.monotonic() < deadline:
            infos = ros.get_publishers_info_by_topic(f"{REPLAY_NS}/channel_state")
            durability = infos[0].qos_profile.durability if infos else None
            time.sleep(0.05)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "deprecated" not in err  # rcl did not take --remap OLD:=NEW for a remapping rule
        assert durability == DurabilityPolicy.TRANSIENT_LOCAL
        recorded_msgs = list(bag.messages())
        per_topic: dict[str, list] = {}
        for m in recorded_msgs:
            per_topic.setdefault(m.topic.rsplit("/", 1)[1], []).append(m)
        for name, col in cols.items():
            col.wait_count(len(per_topic[name]), 10.0)
            got = [to_plain(msg) for _, msg in col.items]
            want = [to_plain(bag.decode(m)) for m in per_topic[name]]
            assert got == want, name  # decoded values, in order (raw bytes differ in padding)
        # Spacing: reception time minus recorded time, each relative to a common origin; a constant
        # (the transport latency) is no spacing error, so deviations are taken from the median.
        t0 = recorded_msgs[0].t_ns
        delays = [t_recv - (m.t_ns - t0) / 1e9 for name, col in cols.items()
                  for (t_recv, _), m in zip(col.items, per_topic[name])]
        mid = sorted(delays)[len(delays) // 2]
        errors_ms = sorted(abs(d - mid) * 1e3 for d in delays)
        print(err)
        median, p95 = errors_ms[len(errors_ms) // 2], errors_ms[int(len(errors_ms) * 0.95)]
        print(f"replay spacing error over {len(errors_ms)} messages: median {median:.2f} ms, p95 {p95:.2f} ms, "
              f"max {errors_ms[-1]:.2f} ms; span {(recorded_msgs[-1].t_ns - t0) / 1e9:.2f} s")
        assert median < 10.0 and p95 < 50.0, errors_ms
        late = re.search(r"median (\S+) ms, max (\S+) ms", err)
        assert late and float(late.group(1)) < 5.0, err
        assert f"{REPLAY_NS}/verdict: {len(per_topic['verdict'])}" in err
    finally:
        for col in cols.values():
            ros.destroy_subscription(col.sub)


# --------------------------------------------------------------------------- reverify
def _reverify(recorded, target: str, name: str, head: bool = True):
    out_csv = recorded["tmp"] / f"{name}.csv"
    extra = ["--head", recorded["head"]] if head else []
    proc = _cli("reverify", str(recorded["bag"]), "--target", target, "--target-dtype", "float32", "--csv", str(out_csv),
                "--round-log", str(recorded["tmp"] / f"{name}_rounds.jsonl"), *extra)
    out, err = proc.communicate(timeout=300)
    rows = {r["request_id"]: r for r in csv.DictReader(out_csv.open())} if out_csv.exists() else {}
    return proc.returncode, out, err, rows


def test_reverify_reproduces_every_recorded_verdict(recorded):
    rc, out, err, rows = _reverify(recorded, TARGET, "same")
    print(out + err)
    assert rc == 0, out + err
    assert all(int(r["differ"]) == 0 and int(r["compared"]) == int(r["equal"]) > 0 for r in rows.values()), rows
    for name, (rid, result) in recorded["outcomes"].items():
        r = rows[rid]
        assert int(r["rounds"]) == int(r["compared"]) == result.rounds, (name, r)
        # Recorded AAL counts every committed token; the result clips the last round at max_new_tokens.
        assert 0 <= float(r["aal"]) * result.rounds - result.aal * result.rounds < 5, (name, r)
    assert "request" in out and "AAL" in out and recorded["outcomes"]["fh"][0] in out
    assert re.search(r"(\d+) of \1 re-computed verdicts equal", err), err
    # The head accepted mismatches at 20 Mbit/s (fewer rounds than greedy), rejected them at 500.
    rounds = {name: result.rounds for name, (_, result) in recorded["outcomes"].items()}
    assert rounds["sh_20mbps"] < rounds["fh"] == rounds["fh_500mbps"], rounds
    # The re-run wrote its round log: one block record per recorded round, the head's acceptances in it.
    from wisv_ros.sd.roundlog import read_round_log

    log = list(read_round_log(recorded["tmp"] / "same_rounds.jsonl"))
    for name, (rid, result) in recorded["outcomes"].items():
        mine = [r for r in log if r.request_id == rid]
        assert len(mine) == result.rounds and all(r.kind == "block" for r in mine), name
    sh = [r for r in log if r.request_id == recorded["outcomes"]["sh_20mbps"][0]]
    assert any(r.head_accepted for r in sh) and all(r.protocol == "sh" for r in sh)


def test_reverify_without_the_head_differs_where_the_head_accepted(recorded):
    """Without --head every mismatch is rejected: only the 20 Mbit/s wisv request's verdicts change,
    so reverify really used the recorded channel_state (500 Mbit/s) and hidden replies (SH)."""
    rc, out, err, rows = _reverify(recorded, TARGET, "nohead", head=False)
    assert rc == 1, out + err
    ids = {name: rid for name, (rid, _) in recorded["outcomes"].items()}
    assert int(rows[ids["sh_20mbps"]]["differ"]) > 0
    assert int(rows[ids["fh"]]["differ"]) == 0 and int(rows[ids["fh_500mbps"]]["differ"]) == 0


def test_reverify_with_another_target_reports_differences(recorded):
    rc, out, err, rows = _reverify(recorded, "tiny-random:1:64", "other")
    assert rc == 1, out + err
    assert sum(int(r["differ"]) for r in rows.values()) > 0
    assert any(r["first_diff"].startswith("round ") for r in rows.values())


# --------------------------------------------------------------------------- errors
def _error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        bag_cli.main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bad_input_gives_clear_errors(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert f"error: {missing}: no such bag folder" in _error(capsys, "info", str(missing))
    (tmp_path / "notabag").mkdir()
    (tmp_path / "notabag" / "data.txt").write_text("x")
    assert "not a rosbag2 bag (no metadata.yaml" in _error(capsys, "replay", str(tmp_path / "notabag"))
    (tmp_path / "file.txt").write_text("x")
    assert "not a folder" in _error(capsys, "info", str(tmp_path / "file.txt"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metadata.yaml").write_text("rosbag2_bagfile_information: {version: 9}\n")
    assert f"{broken}: cannot read the bag" in _error(capsys, "info", str(broken))

    from rclpy.serialization import serialize_message
    from wisv_ros.msg import Verdict

    good = tmp_path / "good"
    with bags.BagWriter(good) as w:
        w.add_topic("/a/verdict", "wisv_ros/msg/Verdict", [QosSpec()])
        w.write("/a/verdict", time.time_ns(), serialize_message(Verdict()))
    err = _error(capsys, "replay", str(good), "--topics", "/a/nope")
    assert "topic /a/nope: not in the bag" in err and "/a/verdict" in err
    assert "matches no topic" in _error(capsys, "replay", str(good), "--remap", "/b:=/c")
    assert "expected OLD:=NEW" in _error(capsys, "replay", str(good), "--remap", "/a")
    assert "--rate: must be > 0" in _error(capsys, "replay", str(good), "--rate", "0")
    assert "exists already" in _error(capsys, "record", str(good))
    assert "no namespace has both draft_block and verdict" in _error(capsys, "reverify", str(good), "--target", TARGET)
    assert "--head /no/head.onnx: no such file" in _error(capsys, "reverify", str(good), "--target", TARGET, "--head", "/no/head.onnx")
    with pytest.raises(bags.BagError, match="type wisv_ros/msg/Nope: unknown"):
        bags.type_hash("wisv_ros/msg/Nope")


def test_record_stops_after_duration_and_writes_a_readable_bag(tmp_path):
    out = tmp_path / "empty"
    t0 = time.monotonic()
    proc = _cli("record", str(out), "--namespace", f"/bag_nothing_{PID}", "--duration", "1.0")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert time.monotonic() - t0 >= 1.0
    bag = open_bag(out)
    assert bag.version == 9 and bag.message_count == 0 and bag.topics() == []
    assert "wrote 0 messages on 0 topics" in err
