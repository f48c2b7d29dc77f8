"""Under use_sim_time the node's control follows /clock: a simulation at half speed gets
commands at half the wall rate, and a paused one gets none."""
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy')
pytest.importorskip('oxygen_ros.msg', reason='oxygen_ros.msg exists only in a colcon build '
                    '(make test)')

from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from rosgraph_msgs.msg import Clock  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from test_node import JOINTS, PARAMS, image, node_env, wait_for, write_params  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402


class Simulation:
    """Publishes /clock and sensors stamped in simulated time, which runs at `speed` x the
    wall clock (0 = paused: no clock ticks and no sensor data, as a paused simulator)."""

    def __init__(self, node):
        self.node = node
        self.sim = 1000.0
        self.speed = 1.0
        self._wall = time.monotonic()
        self._lock = threading.Lock()
        self.clock = node.create_publisher(Clock, '/clock', 10)
        best = qos_profile_sensor_data
        self.cams = [node.create_publisher(Image, f'/{c}/image', best) for c in ('front', 'wrist')]
        self.joints = node.create_publisher(JointState, '/joint_states', best)
        self.traj = []
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, '/arm_controller/joint_trajectory',
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
            m = JointState()
            m.header.stamp = self._stamp()
            m.name = JOINTS
            m.position = [0.1 * i for i in range(len(JOINTS))]
            self.joints.publish(m)

    def rate(self, seconds):
        start = len(self.traj)
        time.sleep(seconds)
        return (len(self.traj) - start) / seconds


@pytest.fixture(scope='module')
def sim(tmp_path_factory):
    domain = str(random.randint(221, 232))
    tmp = tmp_path_factory.mktemp('sim_time')
    params = write_params(tmp / 'params.yaml', dict(PARAMS, use_sim_time=True))
    log_path = tmp / 'node.log'
    log = open(log_path, 'w')
    proc = subprocess.Popen(
        [sys.executable, '-m', 'oxygen_ros.node', '--ros-args', '--params-file', params],
        stdout=log, stderr=subprocess.STDOUT, env=node_env(domain))
    os.environ['ROS_DOMAIN_ID'] = domain
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node('simulation', context=context)
    s = Simulation(node)
    s.log = log_path.read_text
    ex = SingleThreadedExecutor(context=context)
    ex.add_node(node)
    threading.Thread(target=ex.spin, daemon=True).start()
    try:
        assert wait_for(lambda: len(s.traj) > 20 or proc.poll() is not None, 60), s.log()
        assert proc.poll() is None, s.log()
        yield s
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        ex.shutdown(timeout_sec=1)
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        log.close()


def test_control_follows_the_simulated_clock(sim):
    full = sim.rate(2.0)
    sim.set_speed(0.5)
    time.sleep(0.3)
    half = sim.rate(2.0)
    sim.set_speed(1.0)
    assert full > 30, sim.log()[-2000:]
    # Ticks are counted in simulated time, so the wall rate halves with the simulation.
    assert 0.3 < half / full < 0.7, f'{full:.1f} Hz at 1x, {half:.1f} Hz at 0.5x'


def test_paused_simulation_gets_no_commands(sim):
    sim.set_speed(0.0)
    time.sleep(0.3)
    try:
        assert sim.rate(1.0) == 0
    finally:
        sim.set_speed(1.0)
    assert wait_for(lambda: sim.rate(0.5) > 10, 10), sim.log()[-2000:]
