"""Taking over a moving arm over rclpy: oxygen_node (its own process, the tiny random model,
the FR3's limits of config/sim.yaml) watches in shadow mode while an operator's trajectory
drives joint 1 at 1 rad/s; the operator falls silent (its trajectory still moving the arm),
`command` is set true, and the node's first trajectory must keep the FR3's velocity,
acceleration and jerk limits as the controller will move along it.

The controller is computed here, not by oxygen_ros: Jazzy's joint_trajectory_controller,
closed loop, starts a trajectory without a stamp on arrival, from the arm's state then (the
arm is still on the operator's ramp: position and 1 rad/s), through each point with its
velocity along a cubic (test_takeover's `segments`; trajectory.cpp's
interpolate_between_points with positions and velocities). Arrival is the middleware's
receive time of the message (rclpy's message info), not when this process got round to it."""
import math
import time

import numpy as np
import pytest
import yaml

rclpy = pytest.importorskip('rclpy')
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from support.jtc import peaks, segments  # noqa: E402
from support.node import ARM, JOINTS, PARAMS, Robot, joint_state, node_process  # noqa: E402
from support.paths import CONFIG  # noqa: E402
from support.process import new_domain, wait_for  # noqa: E402
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint  # noqa: E402

import oxygen_ros.msg  # noqa: F401, E402 (built by colcon; must import)
from oxygen_ros.robot.stamps import seconds  # noqa: E402

SIM = yaml.safe_load((CONFIG / 'sim.yaml').read_text())['/**']['ros__parameters']
FR3 = SIM['joint_limits']['arm']
HOME = np.array(SIM['initial_positions'], float)  # inside the FR3's limits; gripper open
SPEED = 1.0  # rad/s of joint 1 while the operator drives it
FROM = -1.2  # where joint 1's ramp starts: 3.9 s of room before its upper limit
OPERATOR = 'operator'  # the frame_id of the operator's trajectory, which the node never sets


class Driven(Robot):
    """The fake robot's joints at HOME but joint 1 on the operator's ramp once it starts,
    readings with the driver's velocities; the operator's one trajectory; what the node sends
    to the arm controller and to ~/shadow/arm."""

    def __init__(self, node):
        super().__init__(node)
        self.leave_out = set()
        self.t0 = None  # when the ramp started (ROS time, s)
        self.mine = []  # (received, sent, trajectory) from the node on the arm's topic
        self.shadow = []
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, '/arm_controller/joint_trajectory',
                                 self._on_arm, reliable)
        node.create_subscription(JointTrajectory, '/oxygen_node/shadow/arm',
                                 self.shadow.append, reliable)
        self.teleop = node.create_publisher(JointTrajectory, '/arm_controller/joint_trajectory',
                                            reliable)

    def state(self, t):
        """(positions, velocities) of JOINTS at ROS time t."""
        q, v = HOME.copy(), np.zeros(len(HOME))
        if self.t0 is not None and t >= self.t0:
            q[0], v[0] = FROM + SPEED * (t - self.t0), SPEED
        return q, v

    def _joints(self):
        stamp = self._stamp()
        q, v = self.state(seconds(stamp))
        m = joint_state(stamp, JOINTS)
        m.position, m.velocity = q.tolist(), v.tolist()
        self.joint_pub.publish(m)

    def _on_arm(self, m, info):
        if m.header.frame_id != OPERATOR:
            self.mine.append((info['received_timestamp'] * 1e-9,
                              info['source_timestamp'] * 1e-9, m))

    def drive(self, seconds_ahead=4.0):
        """The operator's trajectory: joint 1 from FROM at SPEED for `seconds_ahead`, the
        others held; sent once, so the operator is silent from then on."""
        now = self.node.get_clock().now().nanoseconds * 1e-9
        m = JointTrajectory()
        m.header.frame_id = OPERATOR
        m.joint_names = ARM
        for k in range(1, int(seconds_ahead * 10) + 1):
            t = 0.1 * k
            p = JointTrajectoryPoint(positions=self.state(now + t)[0][:len(ARM)].tolist())
            p.time_from_start.sec, p.time_from_start.nanosec = int(t), int(round(t % 1 * 1e9))
            m.points.append(p)
        self.t0 = now
        self.teleop.publish(m)


@pytest.fixture(scope='module')
def robot(tmp_path_factory):
    params = dict(PARAMS, command=False, allow_unlimited=False, shadow_margin=10.0,
                  joint_limits={'arm': FR3, 'gripper': SIM['joint_limits']['gripper']},
                  narration_every_n_frames=0)
    with node_process(tmp_path_factory.mktemp('takeover'), params, new_domain(120, 220),
                      'driven_robot', Driven, '-r', 'front/image:=/remapped/front') as (proc, r):
        r.proc = proc
        assert wait_for(lambda: len(r.shadow) > 20 or proc.poll() is not None, 60), r.log()
        assert proc.poll() is None, r.log()
        yield r


def test_the_first_command_takes_over_the_moving_arm_within_the_fr3_limits(robot):
    robot.drive()
    time.sleep(1.3)  # the operator was last heard over a second ago: it may be taken over
    assert robot.mine == [], 'the node commanded the robot in shadow mode'
    r = robot.set_param('command', True)
    assert r.successful, r.reason
    assert wait_for(lambda: robot.mine, 10), robot.log()[-3000:]
    received, sent, m = robot.mine[0]
    assert list(m.joint_names) == ARM and seconds(m.header.stamp) == 0.0
    p, v = robot.state(received)
    assert v[0] == SPEED and FROM < p[0] < FR3['fr3_joint1']['upper'] - 0.5, p
    times = np.array([seconds(x.time_from_start) for x in m.points])
    pos = np.array([x.positions for x in m.points])
    vel = np.array([x.velocities for x in m.points])
    speed, acc, jerk = peaks(segments(p[:len(ARM)], v[:len(ARM)], times, pos, vel))
    print(f'\ntake-over at {SPEED:g} rad/s: delivered {1e3 * (received - sent):.2f} ms after '
          f'it was sent, first point {1e3 * times[0]:.0f} ms out; joint 1 peak speed '
          f'{speed[0]:.3f} rad/s, acceleration {acc[0]:.2f} rad/s^2, jerk {jerk[0]:.0f} '
          f'rad/s^3 (limits {FR3["fr3_joint1"]["velocity"]}, '
          f'{FR3["fr3_joint1"]["acceleration"]}, {FR3["fr3_joint1"]["jerk"]})')
    for i, j in enumerate(ARM):
        assert speed[i] <= FR3[j]['velocity'] * (1 + 1e-6), (j, speed[i])
        assert acc[i] <= FR3[j]['acceleration'] * (1 + 1e-6), (j, acc[i])
        assert jerk[i] <= FR3[j]['jerk'] * (1 + 1e-6), (j, jerk[i])
    assert math.isfinite(float(pos[-1, 0])) and vel[-1].tolist() == [0.0] * len(ARM)
