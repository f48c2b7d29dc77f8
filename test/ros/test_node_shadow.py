"""Shadow mode over rclpy against the node's own process (`command: false`): an operator
drives the robot (its joints move along a known path, and it sends its own trajectories on
the controllers' topics); the node sends nothing there, its trajectories go to
~/shadow/<group>, /diagnostics report how far its predictions are from the measured joints
(checked against the same comparison made here from ~/predicted_trajectory and the
readings sent), and turning to commanding is refused while the operator commands or the
prediction disagrees by more than shadow_margin, and taken once neither holds.

The tests run in order on one node process."""
import math
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy')
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from support.node import ARM, JOINTS, PARAMS, Robot, joint_state, keeps_commanding, node_process  # noqa: E402
from support.process import new_domain, wait_for  # noqa: E402
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint  # noqa: E402

import oxygen_ros.msg  # noqa: F401, E402 (built by colcon; must import)
from oxygen_ros.robot.shadow import WINDOW_S  # noqa: E402
from oxygen_ros.robot.stamps import seconds  # noqa: E402

OPERATOR = 'operator'  # the frame_id of the operator's trajectories, which the node never sets


def path(t):
    """Where the operator has joint i of JOINTS at time t (s)."""
    return [0.1 * i + 0.3 * math.sin(0.8 * t + i) for i in range(len(JOINTS))]


class Operated(Robot):
    """The fake robot with its joints moving along `path`, an operator's teleop on the arm
    controller's topic while `driving`, and what the node sends to ~/shadow/<group>."""

    def __init__(self, node):
        super().__init__(node)
        self.leave_out = set()
        self.readings = []  # (stamp, positions) sent
        self.predicted = []
        self.shadow = {'arm': [], 'gripper': []}
        self.driving = True
        self.quiet = False  # True: no joint readings
        self.status = ''
        self.mine = []  # (arrival, trajectory) on the arm controller's topic from the node
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, '/arm_controller/joint_trajectory',
                                 self._on_arm, reliable)
        node.create_subscription(JointTrajectory, '/oxygen_node/predicted_trajectory',
                                 self.predicted.append, reliable)
        for g, got in self.shadow.items():
            node.create_subscription(JointTrajectory, f'/oxygen_node/shadow/{g}',
                                     lambda m, got=got: got.append((time.monotonic(), m)),
                                     reliable)
        self.teleop = node.create_publisher(JointTrajectory, '/arm_controller/joint_trajectory',
                                            reliable)
        node.create_timer(0.1, self._teleop)

    def _on_diag(self, msg):
        for st in msg.status:
            if st.name.startswith('oxygen_node'):
                self.status = st.message
        super()._on_diag(msg)

    def _on_arm(self, m):
        if m.header.frame_id != OPERATOR:
            self.mine.append((time.monotonic(), m))

    def _joints(self):
        if self.quiet:
            return
        stamp = self._stamp()
        q = path(seconds(stamp))
        m = joint_state(stamp, JOINTS)
        m.position = q
        self.readings.append((seconds(stamp), q))
        self.joint_pub.publish(m)

    def _teleop(self):
        if not self.driving:
            return
        m = JointTrajectory()
        m.header.frame_id = OPERATOR
        m.joint_names = ARM
        t = self.node.get_clock().now().nanoseconds * 1e-9
        m.points = [JointTrajectoryPoint(positions=path(t + 0.1)[:len(ARM)])]
        m.points[0].time_from_start.nanosec = 100_000_000
        self.teleop.publish(m)

    def from_node(self, since):
        """The node's trajectories on the arm controller's topic since `since`."""
        return [m for at, m in list(self.mine) if at >= since]


def expected_errors(predicted, readings, start, end):
    """Per joint of JOINTS, the mean |predicted - measured| of the readings stamped in
    [start, end], each against the chunk of the last frame before it where that reaches
    it: the node's comparison, made here from what it published and what was sent to it."""
    chunks = []
    for m in predicted:
        t0 = seconds(m.header.stamp)
        times = np.array([t0 + seconds(p.time_from_start) for p in m.points])
        chunks.append((t0, times, np.array([p.positions for p in m.points])))
    chunks.sort(key=lambda c: c[0])
    starts = [c[0] for c in chunks]
    errs = []
    for stamp, q in readings:
        i = int(np.searchsorted(starts, stamp, side='right')) - 1
        if not start <= stamp <= end or i < 0 or stamp > chunks[i][1][-1]:
            continue
        _, times, pos = chunks[i]
        want = [np.interp(stamp, times, pos[:, k]) for k in range(pos.shape[1])]
        errs.append(np.abs(np.array(want) - np.array(q)))
    return np.mean(errs, axis=0), len(errs)


@pytest.fixture(scope='module')
def robot(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('shadow')
    params = dict(PARAMS, command=False, publish_predicted=True, narration_every_n_frames=0)
    with node_process(tmp, params, new_domain(120, 220), 'operated_robot', Operated,
                      '-r', 'front/image:=/remapped/front') as (proc, r):
        r.proc, r.setup = proc, params
        assert wait_for(lambda: len(r.shadow['arm']) > 20 or proc.poll() is not None, 60), \
            r.log()
        assert proc.poll() is None, r.log()
        yield r


def test_shadow_mode_sends_nothing_to_the_controllers_and_leaves_them_to_the_operator(robot):
    t = time.monotonic()
    n = len(robot.shadow['arm'])
    time.sleep(3.0)
    assert robot.from_node(0.0) == [], 'the node commanded the robot in shadow mode'
    assert len(robot.shadow['arm']) - n >= 0.5 * robot.setup['control_rate_hz'] * 3.0
    assert len(robot.shadow['gripper']) > 0
    assert [m.joint_names for _, m in robot.shadow['arm'][-3:]] == [ARM] * 3
    # The operator commands all along: the node neither gave way nor stopped.
    assert len([m for at, m in robot.traj if at >= t]) >= 25
    assert 'another node commands' not in robot.log(), robot.log()[-3000:]
    assert robot.proc.poll() is None
    d = robot.fresh_diag()
    assert d['active'] == 'True' and 'shadow mode' in robot.status, robot.status


def test_diagnostics_report_the_prediction_against_the_measured_motion(robot):
    d = robot.fresh_diag()
    predicted = list(robot.predicted)
    # The node judges a reading once a newer frame's chunk has come: its window ends
    # before the last frame.
    end = max(seconds(m.header.stamp) for m in predicted)
    want, n = expected_errors(predicted, list(robot.readings), end - WINDOW_S, end)
    assert n > 100, n
    got = np.array([float(d[f'shadow_error_mean.{g}/{j}']) for g, js in
                    (('arm', ARM), ('gripper', ['gripper'])) for j in js])
    # The windows end a report's latency apart: a few of 250 readings differ.
    assert got == pytest.approx(want, rel=0.1, abs=2e-3), (got, want)
    assert all(float(d[f'shadow_error_max.arm/{j}']) >= float(d[f'shadow_error_mean.arm/{j}'])
               for j in ARM)
    assert float(d['shadow_error_mean_worst']) == pytest.approx(got.max(), rel=1e-2)


def test_commanding_is_refused_while_the_operator_commands(robot):
    r = robot.set_param('command', True)
    assert not r.successful and 'another node commands this robot' in r.reason, r.reason
    assert '/arm_controller/joint_trajectory' in r.reason
    assert robot.get_param('command') is False


def test_commanding_is_refused_while_the_prediction_disagrees(robot):
    robot.driving = False
    time.sleep(1.5)  # the operator is no longer heard (1 s)
    worst = float(robot.fresh_diag()['shadow_error_mean_worst'])
    assert robot.set_param('shadow_margin', worst / 2).successful
    r = robot.set_param('command', True)
    assert not r.successful and 'disagrees with the measured motion by more than' in r.reason
    assert robot.get_param('command') is False and robot.from_node(0.0) == []


def test_commanding_is_taken_once_the_prediction_agrees_within_the_margin(robot):
    worst = float(robot.fresh_diag()['shadow_error_mean_worst'])
    assert robot.set_param('shadow_margin', 10 * worst + 1.0).successful
    n = len(robot.shadow['arm'])
    r = robot.set_param('command', True)
    assert r.successful, r.reason
    assert keeps_commanding(robot.mine, robot.setup['control_rate_hz'],
                            lambda: robot.proc.poll() is None), robot.log()[-3000:]
    time.sleep(0.5)
    assert len(robot.shadow['arm']) - n <= 2  # what was on its way when it switched
    d = robot.fresh_diag()
    assert 'shadow_error_mean_worst' not in d
    # Back to shadow mode: a hold on the controllers' topics first, then nothing there.
    assert robot.set_param('command', False).successful
    time.sleep(0.3)
    k = len(robot.from_node(0.0))
    time.sleep(1.0)
    assert len(robot.from_node(0.0)) == k
    # A hold: points one control period apart from one period ahead (braking within the
    # limits), the last at rest.
    last = robot.from_node(0.0)[-1]
    step = 1.0 / robot.setup['control_rate_hz']
    assert [seconds(p.time_from_start) for p in last.points] == pytest.approx(
        [step * (i + 1) for i in range(len(last.points))], abs=1e-6), last
    assert max(abs(v) for v in last.points[-1].velocities) == 0.0
    assert 'holding: shadow mode: leaving commanding' in robot.log()


def test_the_gate_needs_a_comparison_that_ends_now_and_an_active_node(robot):
    # Back in shadow mode (the test before) with a margin every joint met: an agreement
    # measured before the joints went quiet is no agreement once the window has passed.
    assert robot.get_param('command') is False
    assert 'shadow_error_mean_worst' in robot.fresh_diag()
    robot.quiet = True
    time.sleep(WINDOW_S + 1.0)
    r = robot.set_param('command', True)
    assert not r.successful, 'commanding taken on a comparison older than the window'
    assert (f'no prediction has been compared with the measured joints in the last '
            f'{WINDOW_S:g} s') in r.reason, r.reason
    robot.quiet = False
    # Deactivate, set command, activate: the gate is not skipped by leaving active.
    robot.lifecycle(robot.node)
    assert robot.transition('deactivate')
    r = robot.set_param('command', True)
    assert not r.successful and 'only while active' in r.reason, r.reason
    assert robot.get_param('command') is False
    since = time.monotonic()
    n = len(robot.shadow['arm'])
    assert robot.transition('activate')
    assert wait_for(lambda: len(robot.shadow['arm']) > n + 20, 30), robot.log()[-3000:]
    assert robot.from_node(since) == []  # still shadow mode: nothing on the controllers
