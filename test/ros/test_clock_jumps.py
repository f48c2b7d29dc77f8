"""Clock jumps under simulated time, over rclpy against the real node: /clock stepped back (a
simulator reset, a looped bag) or forward beyond the staleness limit drops the chunk and holds
the robot, and inputs count again from the first sample after the jump, so an input that
stops right after a backward jump still holds the robot (its age no longer hides below zero).
For one robot and for one robot of a fleet."""
import re
import time

import pytest

rclpy = pytest.importorskip('rclpy')
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from support.node import (  # noqa: E402
    ARM,
    PARAMS,
    RATE,
    Simulation,  # noqa: E402
    keeps_commanding,
    node_process,
)
from support.process import new_domain, wait_for  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

import oxygen_ros.msg  # noqa: E402, F401 (built by colcon; must import)


class Jumpy(Simulation):
    """The simulation, whose clock can be stepped, and whose sensors can stop while its
    clock runs on; every trajectory is kept with its arrival time."""

    def __init__(self, node, ns=''):
        self.sensors = True
        super().__init__(node, ns)
        self.msgs = []
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, f'{ns}/arm_controller/joint_trajectory',
                                 lambda m: self.msgs.append((time.monotonic(), m)), reliable)

    def jump(self, delta):
        with self._lock:
            self.sim += delta

    def _images(self):
        if self.sensors:
            super()._images()

    def _joints(self):
        if self.sensors:
            super()._joints()


@pytest.fixture(scope='module', params=['one robot', 'fleet'])
def sim(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('clock_jumps')
    params, ns = dict(PARAMS, use_sim_time=True), ''
    if request.param == 'fleet':
        params['robots'], ns = ['solo'], '/solo'
    with node_process(tmp, params, new_domain(), 'jumpy',
                      lambda node: Jumpy(node, ns)) as (proc, s):
        assert wait_for(lambda: len(s.traj) > 20 or proc.poll() is not None, 60), s.log()
        assert proc.poll() is None, s.log()
        s.proc = proc
        s.started = len(s.log())  # the log up to the first commands: no test's jumps in it
        yield s


def holds_after(sim, t):
    return [m for at, m in list(sim.msgs) if at >= t and len(m.points) == 1
            and list(m.points[0].velocities) == [0.0] * len(ARM)]


def commanding(sim):
    return keeps_commanding(sim.traj, RATE, lambda: sim.proc.poll() is None)


def test_activating_is_no_clock_jump(sim):
    """The first activation listens for another commander for up to commander_check s
    (3 s after the node starts) while /clock runs on: the time that passed meanwhile is no
    jump (before the fix: `the simulated clock jumped +1005.575 s` right after activating)."""
    start = sim.log()[:sim.started]
    assert 'active: commanding' in start, start[-3000:]
    assert 'jumped' not in start, start[-3000:]


def test_a_backward_jump_then_silent_inputs_holds_the_robot(sim):
    assert commanding(sim), sim.log()[-2000:]
    mark = len(sim.log())
    t = time.monotonic()
    sim.sensors = False
    sim.jump(-5.0)
    try:
        assert wait_for(lambda: holds_after(sim, t), 5), (
            'no hold after /clock went back 5 s:\n' + sim.log()[mark:])
        # The step, less the real time between the two /clock messages (a loaded machine
        # may leave up to a second between them).
        assert re.search(r'simulated clock jumped -(4\.\d+|5\.0\d*) s', sim.log()[mark:])
        # Held: nothing but holds comes while the inputs stay silent.
        time.sleep(1.0)
        late = [m for at, m in list(sim.msgs) if at > time.monotonic() - 0.8]
        assert all(len(m.points) == 1 for m in late), [len(m.points) for m in late]
    finally:
        sim.sensors = True
    assert commanding(sim), sim.log()[-2000:]


def test_a_forward_jump_beyond_the_staleness_limit_holds_then_recovers(sim):
    assert commanding(sim), sim.log()[-2000:]
    mark = len(sim.log())
    t = time.monotonic()
    sim.jump(3.0)
    assert wait_for(lambda: holds_after(sim, t), 5), sim.log()[mark:]
    # The step, plus the real time between the two /clock messages.
    assert re.search(r'simulated clock jumped \+(2\.9\d*|3\.\d+) s', sim.log()[mark:])
    assert commanding(sim), sim.log()[-2000:]
