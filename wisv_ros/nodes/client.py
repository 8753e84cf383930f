"""Send a Generate goal from Python and collect its feedback and result.

The client never spins: the node it is given must be spun by an executor in another thread
(``spin_in_background`` does that), and the calls below wait on futures with timeouts.

    rclpy.init()
    node = rclpy.create_node("my_client")
    executor, _ = spin_in_background(node)
    client = GenerateClient(node, "/robot/generate")
    client.wait_for_server(10.0)
    outcome = client.generate("5 9 12 3", max_new_tokens=32, timeout=60.0)
    print(outcome.status_name, outcome.result.token_ids, outcome.feedback_ids())
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from action_msgs.msg import GoalStatus
from rclpy.action import ActionClient
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node

from wisv_ros.nodes.common import FEEDBACK_QOS

__all__ = [
    "wait_until_active","GenerateClient", "GoalRun", "Outcome", "spin_in_background"]

FEEDBACK_GRACE_S = 5.0  # outcome(): wait this long at most for feedback behind the result

_STATUS = {
    GoalStatus.STATUS_SUCCEEDED: "succeeded",
    GoalStatus.STATUS_ABORTED: "aborted",
    GoalStatus.STATUS_CANCELED: "canceled",
}


def spin_in_background(node: Node) -> tuple[SingleThreadedExecutor, threading.Thread]:
    """Spin ``node`` in a daemon thread; call ``executor.shutdown()`` when done.

    One executor thread (see ``common.run_node`` for why not rclpy's MultiThreadedExecutor);
    the calls of this module wait in the caller's thread, never in a callback.
    """
    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    thread = threading.Thread(target=executor.spin, name=f"spin_{node.get_name()}", daemon=True)
    thread.start()
    return executor, thread


def _wait(future, timeout: float | None, what: str):
    done = threading.Event()
    future.add_done_callback(lambda _f: done.set())
    if not done.wait(timeout):
        raise TimeoutError(f"{what}: no answer within {timeout} s")
    return future.result()


@dataclasses.dataclass
class Outcome:
    """What a goal ended with."""

    status: int  # action_msgs/GoalStatus.STATUS_*
    result: object  # Generate.Result
    feedback: list  # Generate.Feedback messages, in arrival order

    @property
    def status_name(self) -> str:
        return _STATUS.get(self.status, f"status {self.status}")

    def feedback_ids(self) -> list[int]:
        """The feedback id deltas concatenated (equals result.token_ids when nothing was lost)."""
        return [int(i) for fb in self.feedback for i in fb.token_ids_delta]

    def feedback_text(self) -> str:
        return "".join(fb.text_delta for fb in self.feedback)


class _ActionClient(ActionClient):
    """rclpy's ActionClient forgets a goal's feedback callback when the result arrives, so feedback
    published just before the result but delivered after it (feedback is a topic, the result a
    service) was dropped. The callback is kept here until ``GoalRun.outcome`` is done with it.

    Also: some rclpy releases (the kilted wheels here) add the client to the node's waitables before
    they create its ``_lock``; an executor spinning in another thread then meets a client without a
    lock and its spin thread dies (AttributeError in ``get_num_entities``), so every later goal times
    out. The lock is made first here; rclpy's own assignment later replaces it before any use that
    matters (nothing is pending yet)."""

    def __init__(self, *args, **kwargs):
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _remove_pending_result_request(self, future):
        kept = dict(self._feedback_callbacks)
        super()._remove_pending_result_request(future)
        self._feedback_callbacks.update(kept)

    def forget_feedback(self, goal_uuid: bytes) -> None:
        self._feedback_callbacks.pop(goal_uuid, None)


class GoalRun:
    """A goal in flight: ``first_feedback()``, ``cancel()``, ``outcome()``."""

    def __init__(self, handle, forget_feedback=lambda _uuid: None):
        self.handle = handle
        self._forget_feedback = forget_feedback
        self.feedback: list = []
        self._got_feedback = threading.Event()
        self._result_future = handle.get_result_async()
        self._fb_cv = threading.Condition()
        self._committed = 0  # the largest committed_length in the feedback so far

    def _on_feedback(self, msg) -> None:
        with self._fb_cv:
            self.feedback.append(msg.feedback)
            self._committed = max(self._committed, int(msg.feedback.committed_length))
            self._fb_cv.notify_all()
        self._got_feedback.set()

    def first_feedback(self, timeout: float) -> bool:
        """Wait until at least one feedback message arrived; False on timeout."""
        return self._got_feedback.wait(timeout)

    def cancel(self, timeout: float = 10.0):
        return _wait(self.handle.cancel_goal_async(), timeout, "cancel")

    def outcome(self, timeout: float | None, feedback_grace_s: float = FEEDBACK_GRACE_S) -> Outcome:
        """The result and the feedback. Feedback and result travel separately (a topic and a
        service), so the last feedback can arrive after the result: it is waited for (at most
        ``feedback_grace_s``) until the feedback has reached the result's length."""
        res = _wait(self._result_future, timeout, "generate result")
        n = len(res.result.token_ids)
        with self._fb_cv:
            self._fb_cv.wait_for(lambda: self._committed >= n, feedback_grace_s)
            feedback = list(self.feedback)
        self._forget_feedback(bytes(self.handle.goal_id.uuid))
        return Outcome(res.status, res.result, feedback)


class GenerateClient:
    """An action client of ``wisv_ros/action/Generate`` on ``node``."""

    def __init__(self, node: Node, action_name: str = "generate"):
        from wisv_ros.action import Generate

        self._Generate = Generate
        self.client = _ActionClient(node, Generate, action_name, feedback_sub_qos_profile=FEEDBACK_QOS)

    def wait_for_server(self, timeout: float) -> bool:
        return self.client.wait_for_server(timeout_sec=timeout)

    def start(self, prompt: str, max_new_tokens: int = 0, method: str = "", k: int = 0, tau: float = -1.0,
              protocol: str = "", temperature: float = -1.0, timeout: float = 10.0, placement: str = "") -> GoalRun:
        """Send a goal (0 / "" / negative = the drafter node's defaults).

        Raises RuntimeError if the drafter rejects it (model loading or failed), TimeoutError if no goal
        response comes within ``timeout`` (the first response right after discovery can be lost, or
        come late while the node loads its model); sending again is safe: goals run one at a time.
        """
        goal = self._Generate.Goal()
        goal.prompt, goal.max_new_tokens, goal.method = prompt, max_new_tokens, method
        goal.k, goal.tau, goal.protocol, goal.temperature = k, tau, protocol, temperature
        goal.placement = placement
        holder: dict[str, GoalRun] = {}
        buffered: list = []
        lock = threading.Lock()

        def on_feedback(msg):  # may arrive before the GoalRun exists
            with lock:
                run = holder.get("run")
                if run is None:
                    buffered.append(msg)
                    return
            run._on_feedback(msg)

        handle = _wait(self.client.send_goal_async(goal, feedback_callback=on_feedback), timeout, "send goal")
        if not handle.accepted:
            raise RuntimeError("goal rejected by drafter_node (model still loading or failed to load: see its log)")
        run = GoalRun(handle, self.client.forget_feedback)
        with lock:
            for msg in buffered:
                run._on_feedback(msg)
            holder["run"] = run
        return run

    def generate(self, prompt: str, timeout: float | None = 120.0, **goal) -> Outcome:
        """Send a goal and wait for its outcome."""
        return self.start(prompt, **goal).outcome(timeout)


def wait_until_active(node: Node, names: list[str], check: Callable[[str], None],
                      note: Callable[[str], None] = lambda _text: None) -> None:
    """Wait until every lifecycle node in ``names`` (fully qualified, e.g. ``/edge/verifier_node``)
    reports state ``active`` on its ``get_state`` service (the drafter and the verifier are active
    once their models are loaded). ``check(what)`` is called while waiting and raises to give up;
    RuntimeError when a node is ``finalized`` (its model failed to load: its log says why)."""
    from lifecycle_msgs.srv import GetState

    for name in names:
        client = node.create_client(GetState, f"{name}/get_state")
        try:
            while True:
                label = ""
                if client.wait_for_service(timeout_sec=0.5):
                    future = client.call_async(GetState.Request())
                    deadline = time.monotonic() + 5.0
                    while not future.done() and time.monotonic() < deadline:
                        time.sleep(0.02)
                    label = future.result().current_state.label if future.done() else ""
                if label == "active":
                    break
                if label == "finalized":
                    raise RuntimeError(f"{name} is finalized: its model failed to load (see its log)")
                check(f"{name} did not become active (state: {label or 'no answer'})")
                note(f"waiting for {name} to load its model (state: {label or 'no answer'})")
                time.sleep(0.5)
        finally:
            node.destroy_client(client)


def set_string_parameter(node: Node, full_name: str, name: str, value: str, timeout: float = 30.0) -> None:
    """Set a string parameter of the running node ``full_name`` (e.g. ``/link_emulator``) through its
    set_parameters service; RuntimeError when the node has no such service or refuses the value."""
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    client = node.create_client(SetParameters, f"{full_name}/set_parameters")
    try:
        if not client.wait_for_service(timeout_sec=timeout):
            raise RuntimeError(f"no parameter service of {full_name}")
        future = client.call_async(SetParameters.Request(parameters=[Parameter(
            name=name, value=ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value))]))
        result = _wait(future, timeout, f"set_parameters of {full_name}").results[0]
        if not result.successful:
            raise RuntimeError(f"{full_name} refused {name}={value!r}: {result.reason}")
    finally:
        node.destroy_client(client)
