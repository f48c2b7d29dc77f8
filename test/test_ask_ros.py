"""~/ask as a caller sees it: real rclpy action clients over DDS against the action server
(ask_server.AskServer over ask.Asks) on a node named oxygen_node whose engine thread runs a
real tiny-model Engine on synthetic frames, as oxygen_node's does."""
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy')
action_mod = pytest.importorskip('oxygen_ros.action', reason='oxygen_ros.action exists only in '
                                 'a colcon build (make test)')

from action_msgs.msg import GoalStatus  # noqa: E402
from rclpy.action import ActionClient  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402

from oxygen_ros.ask import Asks  # noqa: E402
from oxygen_ros.ask_server import AskServer  # noqa: E402
from oxygen_ros.engine import Engine, EngineConfig, Observation  # noqa: E402

Ask = action_mod.Ask
ROWS = 2
FRAME_S = 1 / 30


class Robot:
    """The serving side: oxygen_node's ~/ask, its engine thread, and what the engine said."""

    def __init__(self, domain):
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain)
        self.node = rclpy.create_node('oxygen_node', context=self.context)
        self.engine = Engine(EngineConfig(
            model='tiny', threads=1, decode_k=1, max_requests=ROWS, max_new_tokens=40,
            stop_at_eos=False, prompt_format='subtask', admission='reject_newest',
            max_question_tokens=48))
        self.asks = Asks()
        self.asks.activate(self.engine)
        self.server = AskServer(self.node, self.asks)
        self.finals = {}  # request id -> the engine's last event of it
        self.unowned = []
        self._stop = threading.Event()
        self.ex = SingleThreadedExecutor(context=self.context)
        self.ex.add_node(self.node)
        self.threads = [threading.Thread(target=self.ex.spin, daemon=True),
                        threading.Thread(target=self._frames, daemon=True)]
        for t in self.threads:
            t.start()

    def _frames(self):
        rng = np.random.default_rng(0)
        size = self.engine.model_cfg.vision.image_size
        n = 0
        while not self._stop.is_set():
            start = time.monotonic()
            n += 1
            obs = Observation(stamp=1000.0 + n * FRAME_S, images={
                s: rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                for s in self.engine.model_cfg.image_slots},
                state=np.zeros(6, np.float32), prompt='pick up the cup')
            events = self.engine.step(obs).events
            self.finals.update({e.request_id: e for e in events if e.done})
            self.unowned += self.asks.deliver(events)
            time.sleep(max(0.0, FRAME_S - (time.monotonic() - start)))

    def close(self):
        self._stop.set()
        self.threads[1].join(10)
        self.ex.shutdown()
        self.threads[0].join(10)
        self.server.destroy()
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


class Caller:
    """A client node of its own context, as another process would have."""

    def __init__(self, domain):
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain)
        self.node = rclpy.create_node('asker', context=self.context)
        self.client = ActionClient(self.node, Ask, '/oxygen_node/ask')
        self.ex = SingleThreadedExecutor(context=self.context)
        self.ex.add_node(self.node)
        self.spinner = threading.Thread(target=self.ex.spin, daemon=True)
        self.spinner.start()
        assert self.client.wait_for_server(timeout_sec=30)

    def send(self, question, budget=0):
        return self.send_all([question], budget)[0]

    def send_all(self, questions, budget):
        """All sent before any is waited for, so they reach the node together."""
        sent = []
        for q in questions:
            feedback = []
            sent.append((self.client.send_goal_async(
                Ask.Goal(question=q, max_new_tokens=budget),
                feedback_callback=lambda m, f=feedback: f.append(m.feedback)), feedback))
        goals = []
        for future, feedback in sent:
            handle = wait(future, 30)
            assert handle.accepted
            goals.append(Goal(handle, feedback, handle.get_result_async()))
        return goals

    def close(self):
        self.ex.shutdown()
        self.spinner.join(10)
        self.client.destroy()
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


class Goal:
    def __init__(self, handle, feedback, result):
        self.handle, self.feedback, self.future = handle, feedback, result

    def result(self, timeout=60):
        r = wait(self.future, timeout)
        # Feedback is a topic and the result a service: let the last pieces arrive.
        time.sleep(0.3)
        return r.status, r.result

    def deltas(self):
        return ''.join(f.delta for f in self.feedback)


def wait(future, timeout):
    end = time.monotonic() + timeout
    while not future.done():
        assert time.monotonic() < end, 'timed out'
        time.sleep(0.01)
    return future.result()


def until(pred, timeout=30):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, 'timed out'
        time.sleep(0.01)


@pytest.fixture(scope='module')
def domain():
    # A domain of its own: other test runs on this machine use the same names.
    return random.randint(20, 100)


@pytest.fixture(scope='module')
def robot(domain):
    r = Robot(domain)
    yield r
    r.close()


@pytest.fixture(scope='module')
def caller(robot, domain):
    c = Caller(domain)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def rows_free_after(robot):
    yield
    until(lambda: robot.engine.cache.free_rows == ROWS)
    assert robot.unowned == []


def test_feedback_adds_up_to_the_result(robot, caller):
    goal = caller.send('is the cup in the gripper?', budget=12)
    status, r = goal.result()
    assert status == GoalStatus.STATUS_SUCCEEDED
    assert (r.reason, r.tokens, r.message) == (Ask.Result.BUDGET, 12, '')
    assert goal.deltas() == r.text == robot.finals[r.request_id].text
    assert {f.request_id for f in goal.feedback} == {r.request_id}
    assert goal.feedback[0].state == Ask.Feedback.WAITING
    streamed = [f for f in goal.feedback if f.state == Ask.Feedback.DECODING]
    assert [f.tokens for f in streamed] == list(range(1, 13))
    # The frame it answered, in every piece and in the result.
    frame = r.stamp.sec + r.stamp.nanosec * 1e-9
    assert frame > 1000 and {(f.stamp.sec, f.stamp.nanosec) for f in streamed} == {
        (r.stamp.sec, r.stamp.nanosec)}


def test_two_concurrent_goals_both_finish(robot, caller):
    a, b = caller.send('where is the towel?', 6), caller.send('what is left to do?', 8)
    (sa, ra), (sb, rb) = a.result(), b.result()
    assert sa == sb == GoalStatus.STATUS_SUCCEEDED
    assert ra.request_id != rb.request_id and (ra.tokens, rb.tokens) == (6, 8)
    assert a.deltas() == ra.text and b.deltas() == rb.text


def test_cancel_mid_stream_frees_the_row(robot, caller):
    a, b = caller.send('first?'), caller.send('second?')  # 40 tokens each: both rows
    until(lambda: sum(f.tokens > 1 for f in a.feedback) > 0)
    wait(a.handle.cancel_goal_async(), 30)
    status, ra = a.result()
    assert status == GoalStatus.STATUS_CANCELED and ra.reason == Ask.Result.CANCELLED
    assert 1 < ra.tokens < 40 and a.deltas() == ra.text
    # The row is free at once: a third question is admitted while the second still runs.
    c = caller.send('third?', 3)
    sc, rc = c.result()
    assert sc == GoalStatus.STATUS_SUCCEEDED and rc.reason == Ask.Result.BUDGET
    assert not b.future.done()
    assert b.result()[1].tokens == 40


def test_a_flood_gets_reasons_not_silence(robot, caller):
    goals = caller.send_all([f'question {i}?' for i in range(5)], 20)
    results = [g.result() for g in goals]
    ok = [r for s, r in results if s == GoalStatus.STATUS_SUCCEEDED]
    refused = [r for s, r in results if s == GoalStatus.STATUS_ABORTED]
    assert len(ok) == ROWS and len(refused) == 5 - ROWS
    assert {r.reason for r in ok} == {Ask.Result.BUDGET}
    for r in refused:
        assert r.reason == Ask.Result.REJECTED and r.request_id > 0
        assert r.message == f'all {ROWS} KV rows are busy (admission reject_newest)'


def test_goals_while_not_active_are_refused_with_the_reason(robot, caller):
    robot.asks.deactivate('the node is inactive')
    try:
        status, r = caller.send('anyone there?').result()
    finally:
        robot.asks.activate(robot.engine)
    assert status == GoalStatus.STATUS_ABORTED and r.reason == Ask.Result.REJECTED
    assert r.message == 'the node is not active: the node is inactive'


def client(domain, *args):
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1')
    return subprocess.Popen([sys.executable, '-m', 'oxygen_ros.ask_client', *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_the_command_line_client_prints_the_answer(robot, domain):
    proc = client(domain, 'is the cup in the gripper?', '--max-new-tokens', '7')
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    rid = int(re.search(r'\[request (\d+), frame \d+\.\d{9}, 7 tokens, budget\]', err)[1])
    assert out == robot.finals[rid].text + '\n'


def test_the_command_line_client_cancels_on_ctrl_c(robot, domain):
    proc = client(domain, 'tell me everything')
    until(lambda: robot.asks.open_count == 1 and any(
        len(r.tokens) > 2 for r in robot.engine.scheduler.active), 60)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert re.search(r'tokens, cancelled\] cancelled by its caller', err), err
