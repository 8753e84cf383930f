"""The generated interfaces and our own wisv_ros package import side by side.

rosidl installs wisv_ros/msg and wisv_ros/action (and, on some routes, an empty generated
wisv_ros/__init__.py); our wisv_ros/__init__.py must be the one imported and must stay ROS-free.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wisv_ros_is_our_package():
    import wisv_ros

    package_xml = (ROOT / "package.xml").read_text()
    assert wisv_ros.__version__ == re.search(r"<version>([^<]+)</version>", package_xml).group(1)
    # Several folders named wisv_ros (ours + the generated one) form one package.
    assert any(Path(p, "msg").is_dir() for p in wisv_ros.__path__)


def test_import_wisv_ros_does_not_import_rclpy():
    code = "import sys, wisv_ros; print('rclpy' in sys.modules, wisv_ros.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    ).stdout.split()
    assert out[0] == "False", "import wisv_ros pulled in rclpy"
    assert Path(out[1]).name == "__init__.py"


def test_generated_interfaces_import():
    from wisv_ros.action import Generate
    from wisv_ros.msg import ChannelState, DraftBlock, HiddenStates, RoundStats, Verdict

    assert DraftBlock.PROTOCOL_IDS == 0
    assert DraftBlock.PROTOCOL_FH == 1
    assert DraftBlock.PROTOCOL_SH == 2
    assert Verdict.CORRECTION_NONE == -1
    assert HiddenStates.DTYPE_BFLOAT16 == "bfloat16"
    for cls in (ChannelState, RoundStats, Generate.Goal, Generate.Result, Generate.Feedback):
        cls()  # default-constructible


def test_draft_block_round_trip_with_4kib_hidden():
    np = pytest.importorskip("numpy")
    from rclpy.serialization import deserialize_message, serialize_message
    from wisv_ros.msg import DraftBlock

    hidden = np.arange(1024, dtype="<f4").reshape(2, 512)  # 2 positions x 512 float32 = 4 KiB
    msg = DraftBlock()
    msg.header.frame_id = "drafter"
    msg.header.stamp.sec = 12
    msg.header.stamp.nanosec = 345
    msg.request_id = "req-1"
    msg.round_id = 7
    msg.prefix_length = 42
    msg.token_ids = [1, 2, 3, 262143]
    msg.protocol = DraftBlock.PROTOCOL_FH
    msg.hidden.data = hidden.tobytes()
    msg.hidden.dtype = "float32"
    msg.hidden.shape = list(hidden.shape)
    msg.hidden.positions = [0, 3]
    msg.draft_time_s = 0.0125

    back = deserialize_message(serialize_message(msg), DraftBlock)

    assert back == msg
    assert back.header.frame_id == "drafter"
    assert (back.header.stamp.sec, back.header.stamp.nanosec) == (12, 345)
    assert (back.request_id, back.round_id, back.prefix_length) == ("req-1", 7, 42)
    assert list(back.token_ids) == [1, 2, 3, 262143]
    assert back.protocol == DraftBlock.PROTOCOL_FH
    assert back.hidden.dtype == "float32"
    assert list(back.hidden.shape) == [2, 512]
    assert list(back.hidden.positions) == [0, 3]
    assert back.draft_time_s == 0.0125
    assert len(back.hidden.data) == 4096
    decoded = np.frombuffer(bytes(back.hidden.data), dtype="<f4").reshape(back.hidden.shape)
    np.testing.assert_array_equal(decoded, hidden)


def test_generate_clients_made_while_the_node_spins_keep_its_executor_alive():
    """rclpy (these wheels) adds an ActionClient to the node before it has its lock; made while an
    executor spins in another thread, a client could kill that thread (every later goal then timed
    out: seen in system_bench's second graph). GenerateClient makes the lock first."""
    import threading
    import time

    from conftest import spun_node
    from wisv_ros.nodes.client import GenerateClient

    import sys

    with spun_node("client_race") as node:
        spin = next(t for t in threading.enumerate() if t.name == f"spin_{node.get_name()}")
        clients = []
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads often: the race shows within a few clients
        try:
            for i in range(200):
                clients.append(GenerateClient(node, f"/client_race_{i}/generate"))
                if not spin.is_alive():
                    break
        finally:
            sys.setswitchinterval(interval)
        time.sleep(0.2)
        assert spin.is_alive(), f"the executor's thread died after {len(clients)} clients"
        for c in clients:
            c.client.destroy()
