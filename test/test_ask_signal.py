"""~/ask across oxygen_node's lifecycle: after a cleanup the node configures and answers
again.

The installed node runs as its own process on the tiny model; this process plays the robot
and asks over real rclpy action clients.
"""
import random

import pytest

rclpy = pytest.importorskip('rclpy')
action_mod = pytest.importorskip('oxygen_ros.action', reason='oxygen_ros.action exists only in '
                                 'a colcon build (make test)')

from test_ask_node import ASKING, SUCCEEDED, Asker  # noqa: E402
from test_node import node_process, wait_for  # noqa: E402

Ask = action_mod.Ask
STARTED = dict(ASKING, autostart=True)


@pytest.fixture
def domain():
    # A domain of its own: other test runs on this machine use the same names.
    return str(random.randint(1, 230))


def started(tmp_path, domain, params=STARTED):
    return node_process(tmp_path, params, domain, 'asker', Asker,
                        '-r', 'front/image:=/remapped/front')


def wait_active(proc, a):
    a.leave_out = set()
    assert wait_for(lambda: 'active: commanding' in a.log() or proc.poll() is not None,
                    60), a.log()
    assert wait_for(lambda: a.rate(0.3) > 0.5 * 70, 30), a.log()[-3000:]


def assert_clean_log(a):
    log = a.log()
    assert 'Traceback' not in log and 'KeyboardInterrupt' not in log, log[-3000:]


def test_cleanup_and_configure_again_still_answers(tmp_path, domain):
    with started(tmp_path, domain, dict(STARTED, autostart=False)) as (proc, a):
        assert wait_for(lambda: 'unconfigured: waiting' in a.log() or proc.poll() is not None,
                        60), a.log()
        for step in ('configure', 'cleanup', 'configure', 'activate'):
            assert a.transition(step), (step, a.log()[-3000:])
        wait_active(proc, a)
        (goal,) = a.send('still there?', budget=3)
        status, r = goal.result()
        assert status == SUCCEEDED and 0 < r.tokens <= 3, (r.reason, r.message)
        assert proc.poll() is None
        assert_clean_log(a)
