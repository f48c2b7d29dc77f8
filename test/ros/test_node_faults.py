"""Faults of the node's own code, over rclpy against the real node process: whatever fails in
the engine thread, a control tick or an executor callback ends in a hold, an ERROR in
diagnostics and a log line, never in a thread that died in silence; a fault that leaves no
way to hold takes the node through ErrorProcessing; a thread that outlives deactivate keeps
the next activation from running a second one beside it.

The faults are injected by a script that starts the installed node after replacing one of
its functions with one that raises (or stalls) while a flag file exists, so each test turns
its fault on and off from here.
"""
import os
import time

import pytest

rclpy = pytest.importorskip('rclpy')
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402
from lifecycle_msgs.msg import TransitionEvent  # noqa: E402
from std_msgs.msg import String  # noqa: E402
from support.node import ARM, PARAMS, Robot, keeps_commanding, node_process  # noqa: E402
from support.process import new_domain, wait_for  # noqa: E402

import oxygen_ros.msg  # noqa: E402, F401 (built by colcon; must import)

# Each fault raises (or stalls) while its flag file exists in $FAULTS; `once` ones remove the
# flag as they fire.
SCRIPT = '''
import os, sys, time
from pathlib import Path

FAULTS = Path(os.environ['FAULTS'])


def fired(name, once):
    flag = FAULTS / name
    if not flag.exists():
        return False
    if once:
        flag.unlink()
    return True


from oxygen_ros.robot import playback


from oxygen_ros.ros import node, robot_link
from oxygen_ros.engine import engine

node.HALT_S = 1.0

finished = robot_link.RobotLink.finished
def _finished(self, ready, result):
    if fired('finished', True):
        raise RuntimeError('injected into the end of a frame')
    return finished(self, ready, result)
robot_link.RobotLink.finished = _finished

tick = playback.Player.tick
def _tick(self, *a, **k):
    if fired('tick_once', True) or fired('tick_always', False):
        raise RuntimeError('injected into the control tick')
    return tick(self, *a, **k)
playback.Player.tick = _tick

from oxygen_ros.robot import contract
problem = contract.Config.check_prompt
def _problem(*a, **k):
    if fired('prompt', True):
        raise RuntimeError('injected into the prompt callback')
    return problem(*a, **k)
contract.Config.check_prompt = _problem

actions = engine.Engine.actions
def _actions(self, *a, **k):
    if fired('slow', True):
        print('slow frame started', flush=True)
        time.sleep(4.0)
        print('slow frame ended', flush=True)
    return actions(self, *a, **k)
engine.Engine.actions = _actions

sys.argv[0] = 'oxygen_node'
node.main()
'''


class Watcher(Robot):
    """The fake robot, plus diagnostics levels, lifecycle services and transition events."""

    def __init__(self, node):
        super().__init__(node)
        self.levels: list[tuple[float, int, str]] = []
        self.events: list[str] = []
        node.create_subscription(DiagnosticArray, '/diagnostics', self._on_level, 10)
        node.create_subscription(TransitionEvent, '/oxygen_node/transition_event',
                                 lambda m: self.events.append(m.goal_state.label), 10)
        self.lifecycle(node)
        self.prompt_pub = node.create_publisher(String, '/oxygen_node/prompt', 10)

    def _on_level(self, msg):
        for st in msg.status:
            if st.name.startswith('oxygen_node'):
                self.levels.append((time.monotonic(), st.level, st.message))


@pytest.fixture(scope='module')
def watcher(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('faults')
    faults = tmp / 'faults'
    faults.mkdir()
    script = tmp / 'faulty_node.py'
    script.write_text(SCRIPT)
    os.environ['FAULTS'] = str(faults)  # node_env copies the environment
    with node_process(tmp, PARAMS, new_domain(), 'watcher', Watcher,
                      '-r', 'front/image:=/remapped/front', program=(str(script),)) as (proc, w):
        w.proc = proc
        w.faults = faults
        w.leave_out = set()
        assert wait_for(lambda: len(w.traj) > 20 or proc.poll() is not None, 90), w.log()
        assert proc.poll() is None, w.log()
        yield w


def inject(w, name):
    t = time.monotonic()
    (w.faults / name).write_text('')
    return t


def holds_after(w, t):
    """Trajectories after `t` that are holds: one point, at rest."""
    return [m for at, m in list(w.traj) if at >= t and len(m.points) == 1
            and list(m.points[0].velocities) == [0.0] * len(ARM)]


def error_after(w, t):
    return [m for at, level, m in list(w.levels)
            if at >= t and level == DiagnosticStatus.ERROR]


def commands_again(w):
    return keeps_commanding(w.traj, PARAMS['control_rate_hz'], lambda: w.proc.poll() is None)


def expect_fault(w, t, text):
    """The log says `text` at ERROR, the robot gets a hold, diagnostics show ERROR."""
    assert wait_for(lambda: text in w.log(), 10), w.log()[-3000:]
    line = next(x for x in w.log().splitlines() if text in x)
    assert '[ERROR]' in line, line
    assert wait_for(lambda: holds_after(w, t), 5), 'no hold after the fault:\n' + w.log()[-3000:]
    assert wait_for(lambda: error_after(w, t), 5), f'no ERROR diagnostics: {w.levels[-3:]}'
    assert any(text in m for m in error_after(w, t)), error_after(w, t)


def test_a_frame_that_fails_outside_the_model_holds_and_the_engine_goes_on(watcher):
    t = inject(watcher, 'finished')
    expect_fault(watcher, t, 'ending its frame failed: RuntimeError: injected')
    assert commands_again(watcher), watcher.log()[-3000:]
    assert watcher.proc.poll() is None
    assert watcher.state() == 'active'


def test_a_control_tick_that_fails_holds_and_control_goes_on(watcher):
    t = inject(watcher, 'tick_once')
    expect_fault(watcher, t, 'control tick failed: RuntimeError: injected')
    assert commands_again(watcher), watcher.log()[-3000:]
    assert watcher.state() == 'active'


def test_a_callback_that_fails_holds_and_the_node_goes_on(watcher):
    t = inject(watcher, 'prompt')
    watcher.prompt_pub.publish(String(data='stack the cups'))
    expect_fault(watcher, t, 'prompt failed: RuntimeError: injected')
    assert commands_again(watcher), watcher.log()[-3000:]
    assert watcher.proc.poll() is None
    assert watcher.state() == 'active'


def test_a_control_tick_that_keeps_failing_takes_the_node_through_error_processing(watcher):
    t = inject(watcher, 'tick_always')
    watcher.events.clear()
    expect_fault(watcher, t, 'control tick failed: RuntimeError: injected')
    assert wait_for(lambda: 'unconfigured' in watcher.events, 10), (
        watcher.events, watcher.log()[-3000:])
    assert 'errorprocessing' in watcher.events
    assert watcher.state() == 'unconfigured'
    assert 'unconfigured after a fault' in watcher.log()
    # Nothing is commanded while unconfigured.
    n = len(watcher.traj)
    time.sleep(1.0)
    assert len(watcher.traj) == n
    (watcher.faults / 'tick_always').unlink()
    assert watcher.transition('configure') and watcher.transition('activate'), (
        watcher.log()[-3000:])
    assert commands_again(watcher), watcher.log()[-3000:]


def test_an_engine_thread_that_outlives_deactivate_keeps_the_next_activation_off(watcher):
    mark = len(watcher.log())
    inject(watcher, 'slow')
    assert wait_for(lambda: 'slow frame started' in watcher.log()[mark:], 10)
    assert watcher.transition('deactivate')
    assert 'engine thread still busy after 1 s' in watcher.log()[mark:]
    # The frame still runs: a second engine thread must not start beside it.
    assert not watcher.transition('activate')
    assert 'refusing to activate: the engine thread of the last activation is still running' \
        in watcher.log()[mark:]
    assert watcher.state() == 'inactive'
    assert wait_for(lambda: 'slow frame ended' in watcher.log()[mark:], 10)
    # Once the old thread has wound up after its frame, activation goes through.
    assert wait_for(lambda: watcher.transition('activate'), 10, step=0.3), watcher.log()[-3000:]
    assert commands_again(watcher), watcher.log()[-3000:]
