"""The ``~/ask`` action server: oxygen_ros/action/Ask over an ``ask.Asks``, nothing more.

Every goal is accepted and answered by its result, so a refusal reaches the caller with
its reason (reason 'rejected' and a message) instead of a bare rejection. Execution is a
coroutine: it never blocks the executor (oxygen_node spins a single-threaded one), and
``Asks.wake`` triggers a guard condition so it resumes as soon as feedback is there. A node
that stops spinning (oxygen_node on a signal) ends its goals, then ``close`` spins on until
their results are out.
"""

from __future__ import annotations

import math
import threading
import time

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.qos import QoSProfile

from oxygen_ros.action import Ask
from oxygen_ros.engine.ask import Feedback, Goal, Result
from oxygen_ros.robot.stamps import split


def stamp_msg(msg, t: float) -> None:
    """Seconds -> builtin_interfaces/Time fields of ``msg``."""
    msg.sec, msg.nanosec = split(t)


class _Pause:
    """Awaiting it hands the executor back once; the coroutine resumes on its next pass.

    Jazzy's executor runs a pending task once before each wait for work, and the wait blocks
    until an entity is ready (the guard condition above, a message, a timer) or the spin's
    timeout: an open goal is resumed once per executor wake-up, never in a busy loop.
    Awaiting an rclpy Future instead would change nothing there (its __await__ is the same
    yield until done)."""

    def __await__(self):
        yield


# ROS's service default keeps 10 requests: a burst of callers (goals, then a result request
# each) while the executor is busy overflows it and the requests dropped are never answered.
# Deeper, so a burst waits its turn instead (otherwise the services' default: reliable,
# volatile, keep last).
SERVICE_QOS = QoSProfile(depth=100)


class AskServer:
    # The result is a service reply, the feedback a topic, and rclpy's ActionClient drops
    # feedback that arrives after the result: the last piece gets this head start.
    SETTLE_S = 0.05
    # rclpy sends a result from a task that the goal's end puts on the executor, and the
    # reply needs a moment on the wire before the node is destroyed: close() spins this long
    # after the last goal ended.
    SEND_S = 0.1
    # rclpy keeps an ended goal's result for a late get_result request this long (its
    # default, 15 min, holds every goal of a flood): a caller asks for it at once.
    RESULT_KEPT_S = 60

    def __init__(self, node, asks, name: str = '~/ask'):
        self.asks = asks
        self._node = node
        self._executing = 0  # goals whose coroutine has not returned its result yet
        self._ended_at = -math.inf  # time.monotonic() when the last one returned
        self._wake = node.create_guard_condition(_nothing)
        asks.wake = self._wake.trigger
        self.server = ActionServer(node, Ask, name, execute_callback=self._execute,
                                   goal_callback=lambda _goal: GoalResponse.ACCEPT,
                                   cancel_callback=lambda _handle: CancelResponse.ACCEPT,
                                   result_timeout=self.RESULT_KEPT_S,
                                   goal_service_qos_profile=SERVICE_QOS,
                                   result_service_qos_profile=SERVICE_QOS,
                                   cancel_service_qos_profile=SERVICE_QOS)

    def close(self, spin_once, limit_s: float) -> int:
        """Send the result of every goal, then destroy the server. ``spin_once`` (the node's
        executor's, called with ``timeout_sec``) runs the goals' coroutines: a node that
        stopped spinning calls this once its goals are ended (``Asks.deactivate``). Spins at
        most ``limit_s``; returns how many goals were still executing then, whose callers
        get no result."""
        end = time.monotonic() + limit_s
        while time.monotonic() < end and (
                self._executing or time.monotonic() < self._ended_at + self.SEND_S):
            spin_once(timeout_sec=0.01)
        left = self._executing
        self.destroy()
        return left

    def destroy(self) -> None:
        self.asks.wake = _nothing
        self.server.destroy()
        # A node configured again makes a new server: this one's guard condition goes too.
        self._node.destroy_guard_condition(self._wake)

    async def _execute(self, handle):
        self._executing += 1
        try:
            return await self._answer(handle)
        finally:
            self._executing -= 1
            self._ended_at = time.monotonic()

    async def _answer(self, handle):
        g = handle.request
        answer = self.asks.open(Goal(g.question, g.max_new_tokens, g.prompt_format))
        cancelling = False
        while True:
            if handle.is_cancel_requested and not cancelling:
                cancelling = True
                answer.cancel()
            item = answer.next(timeout=0)
            if item is None:
                await _Pause()
            elif isinstance(item, Feedback):
                handle.publish_feedback(_feedback(item))
            else:
                await self._settle()
                if item.succeeded:
                    handle.succeed()
                elif cancelling and item.reason == 'cancelled':
                    handle.canceled()
                else:
                    handle.abort()
                return _result(item)

    async def _settle(self):
        end = time.monotonic() + self.SETTLE_S
        threading.Timer(self.SETTLE_S, self._wake.trigger).start()
        while time.monotonic() < end:
            await _Pause()


def _feedback(f: Feedback):
    m = Ask.Feedback(request_id=f.request_id, state=f.state, delta=f.delta, text=f.text,
                     tokens=f.tokens)
    stamp_msg(m.stamp, f.stamp)
    return m


def _result(r: Result):
    m = Ask.Result(request_id=r.request_id, text=r.text, tokens=r.tokens, reason=r.reason,
                   message=r.message)
    stamp_msg(m.stamp, r.stamp)
    return m


def _nothing() -> None:
    pass


class RobotAsks:
    """The engine as one robot's ~/ask sees it: its questions are about that robot's frames."""

    def __init__(self, engine, robot: str):
        self.engine, self.robot = engine, robot

    def ask(self, question: str, max_new_tokens: int = 0, prompt_format: str = '') -> int:
        return self.engine.ask(question, max_new_tokens, prompt_format, robot=self.robot)

    def cancel(self, request_id: int):
        return self.engine.cancel(request_id)

    def withdraw(self, request_id: int) -> bool:
        return self.engine.withdraw(request_id)


class AskServers:
    """The ~/<robot>/ask servers of a fleet, closed and destroyed together."""

    def __init__(self, servers):
        self.servers = servers

    def close(self, spin_once, limit_s: float) -> int:
        end = time.monotonic() + limit_s
        return sum(s.close(spin_once, max(0.0, end - time.monotonic())) for s in self.servers)

    def destroy(self):
        for s in self.servers:
            s.destroy()
