"""The installed oxygen_ask command against an Ask server of this test's own that is slow to
accept: a Ctrl-C that lands before the acceptance reaches the client still cancels the goal
(which by then may be running on the node) and exits 1 without a traceback."""
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy')
ament = pytest.importorskip('ament_index_python.packages')
from rclpy.action import ActionServer, CancelResponse, GoalResponse  # noqa: E402
from rclpy.executors import MultiThreadedExecutor  # noqa: E402
from support.process import new_domain, node_env, wait_for  # noqa: E402

import oxygen_ros.action as action_mod  # noqa: E402 (built by colcon; must import)

Ask = action_mod.Ask


class SlowServer:
    """Accepts each goal only after `delay` s, then streams until cancelled."""

    def __init__(self, node, delay):
        self.delay = delay
        self.asked = threading.Event()  # a goal request has arrived
        self.cancels = 0
        self.closing = False
        self.server = ActionServer(node, Ask, '/slow/ask', self._execute,
                                   goal_callback=self._goal, cancel_callback=self._cancel)

    def _goal(self, _goal):
        self.asked.set()
        time.sleep(self.delay)
        return GoalResponse.ACCEPT

    def _cancel(self, _handle):
        self.cancels += 1
        return CancelResponse.ACCEPT

    def _execute(self, handle):
        end = time.monotonic() + 30
        while not (handle.is_cancel_requested or self.closing) and time.monotonic() < end:
            handle.publish_feedback(Ask.Feedback(text='still', tokens=1))
            time.sleep(0.05)
        result = Ask.Result(text='still', tokens=1)
        if handle.is_cancel_requested:
            handle.canceled()
            result.reason, result.message = Ask.Result.CANCELLED, 'cancelled by its caller'
        else:
            handle.abort()
            result.reason = Ask.Result.DROPPED
        return result


@pytest.fixture
def served():
    domain = new_domain(120, 220)
    ctx = rclpy.Context()
    rclpy.init(context=ctx, domain_id=int(domain))
    node = rclpy.create_node('slow_ask', context=ctx)
    server = SlowServer(node, delay=3.0)
    executor = MultiThreadedExecutor(num_threads=4, context=ctx)
    executor.add_node(node)
    spin = threading.Thread(target=executor.spin, daemon=True)
    spin.start()
    yield domain, server
    server.closing = True
    time.sleep(0.2)
    executor.shutdown(timeout_sec=1.0)
    node.destroy_node()
    rclpy.try_shutdown(context=ctx)


def test_ctrl_c_before_the_acceptance_still_cancels(served):
    domain, server = served
    exe = pathlib.Path(ament.get_package_prefix('oxygen_ros')) / 'lib' / 'oxygen_ros' / 'oxygen_ask'
    proc = subprocess.Popen([sys.executable, str(exe), 'anything', '--node', '/slow',
                             '--wait', '20'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=node_env(domain))
    try:
        assert server.asked.wait(60), 'the goal request never reached the server'
        # The server sits in its goal callback for 3 s: the client is still waiting for the
        # acceptance.
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert 'Traceback' not in err, err
    assert proc.returncode == 1, (proc.returncode, err)
    assert wait_for(lambda: server.cancels == 1, 10), err
    assert 'cancelled] cancelled by its caller' in err, err
