"""Under use_sim_time the node's control follows /clock: a slowed simulation gets no more
commands than its simulated time has control ticks, and a paused one gets none. The same
for a node serving a fleet (its own frame planning runs on the node's clock)."""
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy')
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from rosgraph_msgs.msg import Clock  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from test_node import (  # noqa: E402
    JOINTS,
    PARAMS,
    RATE,
    image,
    joint_state,
    keeps_commanding,
    new_domain,
    node_process,
    rate,
    wait_for,
)
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

import oxygen_ros.msg  # noqa: E402, F401 (built by colcon; must import)


class Simulation:
    """Publishes /clock and sensors stamped in simulated time, which runs at `speed` x the
    wall clock (0 = paused: no clock ticks and no sensor data, as a paused simulator)."""

    def __init__(self, node, ns=''):
        self.node = node
        self.sim = 1000.0
        self.speed = 1.0
        self._wall = time.monotonic()
        self._lock = threading.Lock()
        self.clock = node.create_publisher(Clock, '/clock', 10)
        best = qos_profile_sensor_data
        self.cams = [node.create_publisher(Image, f'{ns}/{c}/image', best)
                     for c in ('front', 'wrist')]
        self.joints = node.create_publisher(JointState, f'{ns}/joint_states', best)
        self.traj = []
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, f'{ns}/arm_controller/joint_trajectory',
                                 lambda m: self.traj.append(time.monotonic()), reliable)
        node.create_timer(1 / 200, self._tick_clock)
        node.create_timer(1 / 30, self._images)
        node.create_timer(1 / 50, self._joints)

    def now(self):
        with self._lock:
            wall = time.monotonic()
            self.sim += (wall - self._wall) * self.speed
            self._wall = wall
            return self.sim

    def set_speed(self, speed):
        self.now()
        self.speed = speed

    def _stamp(self):
        t = self.now()
        return rclpy.time.Time(seconds=t).to_msg()

    def _tick_clock(self):
        if self.speed:
            self.clock.publish(Clock(clock=self._stamp()))

    def _images(self):
        if self.speed:
            for pub in self.cams:
                pub.publish(image(stamp=self._stamp()))

    def _joints(self):
        if self.speed:
            self.joints.publish(joint_state(self._stamp(), JOINTS))

    def rate(self, seconds):
        return rate(self.traj, seconds)


@pytest.fixture(scope='module', params=['one robot', 'fleet'])
def sim(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('sim_time')
    domain = new_domain(221, 232)
    params, ns = dict(PARAMS, use_sim_time=True), ''
    if request.param == 'fleet':  # one robot of a fleet, in its namespace
        params['robots'], ns = ['solo'], '/solo'
    with node_process(tmp, params, domain, 'simulation',
                      lambda node: Simulation(node, ns)) as (proc, s):
        assert wait_for(lambda: len(s.traj) > 20 or proc.poll() is not None, 60), s.log()
        assert proc.poll() is None, s.log()
        s.proc = proc
        yield s


def commanding(sim, speed=1.0):
    """At least LIVE (90%) of the commands of the control ticks of `speed` x wall time."""
    return keeps_commanding(sim.traj, RATE * speed, lambda: sim.proc.poll() is None)


def test_control_follows_the_simulated_clock(sim):
    """Two-sided: at a fifth of wall speed, control on the wall clock would send five times
    the simulated ticks (the upper bound, which a slow machine cannot break: it only sends
    fewer), and a node that dropped ticks would send far fewer (the lower bound, half)."""
    sim.set_speed(0.2)
    try:
        time.sleep(0.5)  # what was sent at full speed has arrived
        assert commanding(sim, 0.2), sim.log()[-2000:]
        start, t0 = len(sim.traj), sim.now()
        time.sleep(5.0)  # 1 s of simulated time: 70 ticks
        n, ticks = len(sim.traj) - start, (sim.now() - t0) * RATE
    finally:
        sim.set_speed(1.0)
    # Slack for the node's clock trailing /clock and ticks at the window's ends.
    assert 0.5 * ticks <= n <= 1.2 * ticks + 5, f'{n} trajectories in {ticks:.0f} simulated ticks'


def test_paused_simulation_gets_no_commands(sim):
    sim.set_speed(0.0)
    time.sleep(0.3)
    try:
        assert sim.rate(1.0) == 0
    finally:
        sim.set_speed(1.0)
    assert commanding(sim), sim.log()[-2000:]
