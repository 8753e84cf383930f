"""Fixtures shared by the tests that talk to nodes over DDS (tools/test.sh sets a test-specific
ROS_DOMAIN_ID and localhost-only discovery)."""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest


@contextmanager
def spun_node(name: str):
    """rclpy initialised and a node named ``<name>_<pid>`` spun in a background thread."""
    rclpy = pytest.importorskip("rclpy")
    from wisv_ros.nodes.client import spin_in_background

    rclpy.init()
    node = rclpy.create_node(f"{name}_{os.getpid()}")
    executor, thread = spin_in_background(node)
    try:
        yield node
    finally:
        executor.shutdown()
        thread.join(5.0)
        node.destroy_node()
        rclpy.try_shutdown()


@pytest.fixture(scope="module")
def ros(request):
    """One spun test node per test module."""
    with spun_node(request.module.__name__.rsplit(".", 1)[-1]) as node:
        yield node


@pytest.fixture
def ros_node(request):
    """A spun test node for one test."""
    with spun_node(request.module.__name__.rsplit(".", 1)[-1]) as node:
        yield node


# The tiny random pair of the core's mechanics tests (same vocabulary, no tokenizer).
@pytest.fixture(scope="module")
def target():
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import load_model

    return CausalLM(load_model("tiny-random:0:64")[0])


@pytest.fixture(scope="module")
def drafter_lm():
    """The target's weights with 5 % noise: accepts about a third of the draft tokens."""
    from wisv_ros.sd.lm import CausalLM
    from wisv_ros.sd.models import load_model

    return CausalLM(load_model("tiny-random:0:64:0.05")[0])
