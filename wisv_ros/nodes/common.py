"""Pieces shared by the wisv_ros nodes: QoS, parameter declaration, byte counting, main().

Only rclpy API that ROS 2 Humble already has is used here (no ``with rclpy.init()``).
"""
from __future__ import annotations

import faulthandler
import sys
import threading
from typing import Callable

import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import serialize_message
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, SetParametersResult

__all__ = [
    "ServingNode",
    "FEEDBACK_QOS",
    "RELIABLE_QOS",
    "check_choice",
    "declare",
    "frozen_after_start",
    "msg_bytes",
    "offload",
    "reliable_qos",
    "run_node",
    "stamp_age_s",
    "stamp_now",
]

QOS_DEPTH = 10


def reliable_qos(depth: int = QOS_DEPTH) -> QoSProfile:
    """Reliable, keep-last ``depth``, volatile: the QoS of every wisv_ros topic.

    Reliable because a lost block or verdict stalls a round until its timeout; keep-last 10 because
    at most a few messages per request are in flight (one block, one verdict, one hidden exchange);
    volatile because a late-joining node must not receive rounds of requests it never saw.
    """
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST,
        depth=depth,
        reliability=ReliabilityPolicy.RELIABLE,
        durability=DurabilityPolicy.VOLATILE,
    )


RELIABLE_QOS = reliable_qos()

#: Generate feedback, on the server and in ``client.GenerateClient``: reliable, keep-last 1000, so
#: that fast rounds (a few ms each) are not thinned out when the client's executor falls behind.
#: A client with rclpy's default (keep-last 10) may miss deltas; the result always has every token.
FEEDBACK_QOS = reliable_qos(1000)


def declare(node: Node, name: str, default, description: str, *, lo=None, hi=None,
            choices: tuple[str, ...] | None = None):
    """Declare a parameter with a description (and a range or a list of choices); return its value."""
    desc = ParameterDescriptor(description=description)
    if choices is not None:
        desc.additional_constraints = "one of: " + ", ".join(repr(c) for c in choices)
    if lo is not None and hi is not None:
        if isinstance(default, bool):
            raise TypeError("no range for a bool parameter")
        if isinstance(default, int):
            desc.integer_range = [IntegerRange(from_value=int(lo), to_value=int(hi), step=1)]
        else:
            desc.floating_point_range = [FloatingPointRange(from_value=float(lo), to_value=float(hi), step=0.0)]
    return node.declare_parameter(name, default, desc).value


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"parameter {name}: '{value}' is not one of {', '.join(choices)}")


def frozen_after_start(names: set[str], choices: dict[str, tuple[str, ...]] | None = None) -> Callable:
    """A set-parameters callback: refuses changes to parameters read only at start (``names``) and
    values outside ``choices`` (ranges are enforced by rclpy from the descriptors)."""
    choices = choices or {}

    def callback(params) -> SetParametersResult:
        for p in params:
            if p.name in names:
                return SetParametersResult(successful=False, reason=f"{p.name} is read at start only; restart the node")
            if p.name in choices and p.value not in choices[p.name]:
                return SetParametersResult(successful=False, reason=f"{p.name}: '{p.value}' is not one of {', '.join(choices[p.name])}")
        return SetParametersResult(successful=True)

    return callback


class ServingNode(LifecycleNode):
    """A lifecycle node that loads its model on configure and serves while active.

    Transitions: ``configure`` runs ``_load()`` (True: loaded; False: ERROR, and ``on_error``
    finalizes the node, so that its state tells clients the model failed; the log says why);
    ``activate`` / ``deactivate`` switch ``_active``, which the subclass checks before serving;
    ``cleanup`` and ``shutdown`` run ``_release()``. With parameter ``autostart`` true the node
    configures and activates itself once the executor spins; with false a lifecycle manager
    (``ros2 lifecycle set``, nav2_lifecycle_manager) drives the transitions.
    """

    _active = False

    def _load(self) -> bool:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def on_configure(self, _state) -> TransitionCallbackReturn:
        return TransitionCallbackReturn.SUCCESS if self._load() else TransitionCallbackReturn.ERROR

    def on_activate(self, _state) -> TransitionCallbackReturn:
        self._active = True
        return TransitionCallbackReturn.SUCCESS

    def on_deactivate(self, _state) -> TransitionCallbackReturn:
        self._active = False
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, _state) -> TransitionCallbackReturn:
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, _state) -> TransitionCallbackReturn:
        self._active = False
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, _state) -> TransitionCallbackReturn:
        return TransitionCallbackReturn.FAILURE

    def autostart(self) -> None:
        """Declare ``autostart``; if true, configure and activate once the executor spins."""
        if not declare(self, "autostart", True, "configure (load the model) and activate at start; false: wait for a "
                       "lifecycle manager (ros2 lifecycle set <node> configure, then activate)"):
            return

        def start() -> None:
            self.destroy_timer(timer)
            if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
                self.trigger_activate()

        timer = self.create_timer(0.01, start)


def msg_bytes(msg) -> int:
    """Serialized size of a message (CDR payload, what goes on the link)."""
    return len(serialize_message(msg))


def stamp_now(node: Node, header) -> None:
    header.stamp = node.get_clock().now().to_msg()


def stamp_age_s(node: Node, stamp) -> float:
    """Seconds since ``stamp`` by this node's clock (>= 0; meaningful with synchronised clocks)."""
    now = node.get_clock().now().nanoseconds
    return max(0.0, (now - (stamp.sec * 1_000_000_000 + stamp.nanosec)) / 1e9)


def offload(node: Node, fn: Callable, *args):
    """Run ``fn(*args)`` in a new thread; an rclpy Future of its result, for ``await`` in a callback.

    The executor stays free while ``fn`` runs (the nodes spin one thread, see ``run_node``); the
    future's done callback makes ``set_result`` wake the executor, which then resumes the awaiting
    coroutine (rclpy's mechanism since Humble).
    """
    from rclpy.task import Future

    future = Future(executor=node.executor)
    future.add_done_callback(lambda _f: None)  # completion schedules a task: wakes the executor

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the awaiting coroutine
            future.set_exception(exc)

    threading.Thread(target=run, name=getattr(fn, "__name__", "offload"), daemon=True).start()
    return future


TEARDOWN_TIMEOUT_S = 10.0
"""How long a node's teardown (its ``destroy_node`` and ``rclpy.try_shutdown``) may take before the
process exits anyway; a node class whose ``destroy_node`` waits for its own threads sets
``teardown_timeout_s`` to that wait plus this."""


def run_node(factory: Callable[[], Node], args=None, until: Callable[[], bool] | None = None, *,
             process_exit: bool = True) -> None:
    """rclpy.init, build the node, spin it on a SingleThreadedExecutor (until ``until()`` is true, if
    given, else until shutdown), shut down cleanly.

    One executor thread, callbacks that never block: long work (a goal's rounds, a target pass)
    runs in the node's own threads. rclpy's MultiThreadedExecutor is not used: with the rclpy of
    these wheels a topic ping-pong between two processes spinning it took 126 ms median, with
    answers up to seconds late, on an idle machine (4-6 ms median under load), against 0.6-0.8 ms
    for SingleThreadedExecutor (``python -m wisv_ros.cli.executor_latency``; rclpy issues #1223,
    #1452). Node tests with it failed at random. Written without ``with rclpy.init()`` (not in
    Humble).

    Shutdown. A signal shuts the context down while callbacks may still be queued; one that then
    publishes raises (``publisher's context is invalid``): after shutdown that ends the spin like
    the signal does, before it the error propagates. The teardown runs under a watchdog
    (``faulthandler``, a C thread, so it fires while the main thread holds the GIL): Fast DDS
    sometimes deadlocks while it destroys the participant when the other processes leave at the
    same moment (seen 3 times in 49 tries of nine link nodes getting SIGINT together: rcl_node_fini waits in
    ``DomainParticipant::set_listener`` on discovery threads that wait on each other). If the
    teardown takes longer than ``teardown_timeout_s`` (default ``TEARDOWN_TIMEOUT_S``), the process
    prints ``Timeout (0:00:10)!`` and every thread's stack to stderr and exits with code 1, instead
    of hanging until something kills it. With ``process_exit`` (a node's ``main``: the process ends
    when this returns) the watchdog stays armed through the interpreter's exit, where the same
    deadlock was also seen (a link emulator whose summary line, written in ``destroy_node``, was its
    last output); a caller that goes on after it (``bag record``) passes False.
    """
    rclpy.init(args=args)
    node = None
    try:
        node = factory()
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        while rclpy.ok() and not (until is not None and until()):
            try:
                executor.spin_once(timeout_sec=0.1 if until is not None else None)
            except Exception:  # noqa: BLE001 - tolerated only once the context is shut down
                if rclpy.ok():
                    raise
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        timeout_s = float(getattr(node, "teardown_timeout_s", TEARDOWN_TIMEOUT_S))
        faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.stderr)
        try:
            if node is not None:
                node.destroy_node()
            rclpy.try_shutdown()
        finally:
            if not process_exit:
                faulthandler.cancel_dump_traceback_later()
