"""A hold stops a moving robot where it is: the joint stream stops mid-motion and the node's
hold must not send the arm back to its last reading.

The robot here moves: its arm follows every trajectory it receives as
joint_trajectory_controller interpolates it (aloha_sim's Controller, which starts each
trajectory from the arm's state and tracks it perfectly), and its joint states say where
the arm is. When they stop, the arm goes on along the last trajectory for max_input_age
before the node finds the readings stale and holds. The commanded jump, between the hold's
target and where the arm is when the hold arrives, is measured against the jump a hold at
the last reading would make.
"""
import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy')
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from support.node import ARM, JOINTS, PARAMS, RATE, Robot, joint_state, node_process  # noqa: E402
from support.process import new_domain, wait_for  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from oxygen_ros.sim.aloha_sim import Controller  # noqa: E402

AGE = 0.2
DRY = 'holding: action chunk used up'


def is_hold(msg):
    """One point at rest one control period ahead: what the node sends to stop the arm (a
    chunk's last action also comes alone and at rest, but at an action time)."""
    return (len(msg.points) == 1 and not any(msg.points[0].velocities)
            and abs(seconds(msg.points[0].time_from_start) - 1 / RATE) < 1e-6)


def seconds(d):
    return d.sec + d.nanosec * 1e-9


class Mover(Robot):
    """The fake robot, with an arm that moves as its controller is told."""

    def __init__(self, node):
        super().__init__(node)
        self.leave_out = set()
        self.arm = Controller(ARM, [0.1 * i for i in range(len(ARM))])
        self.lock = threading.Lock()
        self.joints_on = True
        self.readings = []  # (monotonic time, arm positions) of each reading sent
        self.jumps = []  # (hold's target - arm position when it arrived) per hold
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, '/arm_controller/joint_trajectory',
                                 self._on_arm, reliable)

    def where(self, t):
        with self.lock:
            return np.array(self.arm.sample(t))

    def _on_arm(self, msg):
        t = time.monotonic()
        q = self.where(t)
        v = (q - self.where(t - 1e-3)) / 1e-3
        if is_hold(msg):
            self.jumps.append((t, np.array(msg.points[0].positions) - q))
        with self.lock:
            self.arm.receive(msg, t, q, v)

    def _joints(self):
        if not self.joints_on:
            return
        t = time.monotonic()
        q = self.where(t)
        m = joint_state(self._stamp(), JOINTS)
        m.position = [*q.tolist(), 0.7]
        self.readings.append((t, q))
        self.joint_pub.publish(m)


@pytest.fixture(scope='module')
def robot(tmp_path_factory):
    # Readings stale after 0.2 s: before the tiny model's 0.4 s chunk is used up, so the
    # hold comes while the arm still moves along it.
    params = dict(PARAMS, max_input_age=AGE)
    with node_process(tmp_path_factory.mktemp('holds'), params, new_domain(120, 220),
                      'moving_robot', Mover, '-r', 'front/image:=/remapped/front') as (proc, r):
        assert wait_for(lambda: len(r.traj) > 50 or proc.poll() is not None, 90), r.log()
        assert proc.poll() is None, r.log()
        yield r


def test_a_joint_stream_that_stops_mid_motion_is_held_where_the_arm_is(robot):
    jumps = []
    spoiled = 0
    while len(jumps) < 3:
        robot.joints_on = True
        assert wait_for(lambda: robot.rate(1.0) > 30, 30), robot.log()[-3000:]
        time.sleep(1.0)
        n = len(robot.jumps)
        dry = robot.log().count(DRY)
        robot.joints_on = False
        t = time.monotonic()
        assert wait_for(lambda n=n: len(robot.jumps) > n, 5.0), robot.log()[-3000:]
        at, jump = robot.jumps[n]
        time.sleep(0.5)  # the log line of a hold for another reason, should there be one
        if at - t < AGE - 0.03 and robot.log().count(DRY) > dry and spoiled < 3:
            # The chunk ran out first (a slow, shared machine): that hold is not the one
            # judged here, and once holding the node sends no other. Again.
            spoiled += 1
            continue
        last_q = robot.readings[-1][1]
        # What a hold at the last reading would command: the arm moved on since.
        q = robot.where(at)
        stale = last_q - q
        jumps.append((np.abs(jump).max(), np.abs(stale).max(), at - t))
    print('hold jump, a jump back to the last reading, stream stop to hold (s):', jumps)
    for new, old, after in jumps:
        # Held once the last reading (up to one 50 Hz period before the stop) was AGE old.
        assert AGE - 0.03 < after < AGE + 0.3
        # The arm moved between its last reading and the hold, so a hold there would show.
        assert old > 0.02, jumps
        # The hold targets where the controller is: what it commands is a small part of
        # the way back to the stale reading (at 50 Hz readings the arm moves between
        # them, and the node's setpoint runs ahead of the arrival by the delivery time).
        assert new < old / 3, jumps
