"""Never two commanders, over rclpy against the real node: a second oxygen_node refuses to
activate on a robot another node commands; an active node that hears another commander on
its trajectory topics holds and leaves commanding; one whose inputs come back after a long
silence (a healed network partition) listens first and, hearing that another node took the
robot meanwhile, leaves it to that node without a hold of its own.

The other commander is this test (a trajectory every 50 ms, as a standby or a teleop would
send): every message it sends is known, so what the node sent is told apart by content.
"""
import re
import subprocess
import sys
import time

import pytest

rclpy = pytest.importorskip('rclpy')
from builtin_interfaces.msg import Duration  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from support.node import ARM, PARAMS, Robot, keeps_commanding, node_process  # noqa: E402
from support.process import node_env, wait_for, write_params  # noqa: E402
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint  # noqa: E402

import oxygen_ros.msg  # noqa: E402, F401 (built by colcon; must import)
from oxygen_ros.ros.commanders import UNDISCOVERED  # noqa: E402

CHECK = 1.0  # commander_check: short, so the tests wait little
COMMANDERS = dict(PARAMS, commander_check=CHECK)
# The second node, just started, listens up to commander_check from its start before it
# activates: on a loaded machine its DDS discovery of the first node took 3 s (its first
# inputs came 2 s after it activated), so it gets a longer check than CHECK.
SECOND = dict(PARAMS, commander_check=5.0)
TOPIC = '/arm_controller/joint_trajectory'


class Other(Robot):
    """The fake robot, plus a second commander on the arm topic and the node's lifecycle."""

    def __init__(self, node):
        super().__init__(node)
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.cmd_pub = node.create_publisher(JointTrajectory, TOPIC, reliable)
        self.commanding = False
        self.sent = 0
        node.create_timer(0.05, self._command)
        self.lifecycle(node)

    def _command(self):
        if not self.commanding:
            return
        self.sent += 1
        m = JointTrajectory(joint_names=list(ARM))
        m.points = [JointTrajectoryPoint(positions=[0.5] * len(ARM),
                                         velocities=[0.0] * len(ARM),
                                         time_from_start=Duration(nanosec=100_000_000))]
        self.cmd_pub.publish(m)


def ours(msg):
    """Whether a received trajectory is one the test sent."""
    return (len(msg.points) == 1 and list(msg.points[0].positions) == [0.5] * len(ARM))


def from_node(other, t):
    """Trajectories the node sent after `t`."""
    return [m for at, m in list(other.traj) if at >= t and not ours(m)]


@pytest.fixture(scope='module')
def other(domain, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('commanders')
    with node_process(tmp, COMMANDERS, domain, 'other_commander', Other,
                      '-r', 'front/image:=/remapped/front') as (proc, o):
        o.proc = proc
        o.leave_out = set()
        assert wait_for(lambda: len(o.traj) > 20 or proc.poll() is not None, 90), o.log()
        assert proc.poll() is None, o.log()
        yield o


def commanding(o):
    return keeps_commanding(o.traj, PARAMS['control_rate_hz'], lambda: o.proc.poll() is None)


def test_a_second_node_refuses_to_activate_on_a_commanded_robot(other, domain, tmp_path):
    assert commanding(other)
    log = tmp_path / 'second.log'
    with open(log, 'w') as out:
        second = subprocess.Popen(
            [sys.executable, '-m', 'oxygen_ros.ros.node', '--ros-args', '--params-file',
             write_params(tmp_path / 'p.yaml', SECOND), '-r', '__node:=oxygen_node_b',
             '-r', 'front/image:=/remapped/front'],
            stdout=out, stderr=subprocess.STDOUT, env=node_env(domain))
        try:
            assert second.wait(60) == 1, log.read_text()
        finally:
            if second.poll() is None:
                second.kill()
    text = log.read_text()
    assert 'refusing to activate: another node commands this robot: ' in text, text
    # The topics it heard another node on (the arm's, the gripper's or both: it stops
    # listening at the first), each with the nodes the ROS graph shows on it by then: on a
    # loaded machine sometimes only the one discovered first, or one whose publisher is seen
    # before its node's name (named so, never rmw's _NODE_NAME_UNKNOWN_).
    named = re.findall(r'(/\w+/joint_trajectory) <- ([^;\n]+?)(?=;|$)', text, re.M)
    assert named, text
    assert {t for t, _ in named} <= {TOPIC, '/gripper_controller/joint_trajectory'}, text
    nodes = {n for _, who in named for n in who.split(', ')}
    assert nodes <= {'/other_commander', '/oxygen_node', UNDISCOVERED}, text
    # The first goes on commanding, and is still active.
    assert commanding(other)
    assert other.state() == 'active'


def test_an_active_node_that_hears_another_commander_holds_and_leaves(other):
    assert commanding(other)
    mark = len(other.log())
    t = time.monotonic()
    other.commanding = True
    try:
        assert wait_for(lambda: other.state() == 'inactive', 10), other.log()[mark:]
        text = other.log()[mark:]
        assert (f'another node commands this robot: {TOPIC} <- /other_commander: holding and '
                'leaving commanding') in text, text
        assert 'every robot is commanded by another node: deactivating' in text
        # Its last word was a hold; nothing of its own came after.
        mine = from_node(other, t)
        assert mine, 'the node sent nothing after the other commander started'
        last = mine[-1]
        assert len(last.points) == 1 and list(last.points[0].velocities) == [0.0] * len(ARM)
        n = len(from_node(other, t))
        time.sleep(1.0)
        assert len(from_node(other, t)) == n
        # Activating while the other still commands is refused.
        assert not other.transition('activate')
        assert 'refusing to activate: another node commands this robot' in other.log()[mark:]
    finally:
        other.commanding = False
    time.sleep(1.5)  # the other is heard no more
    assert other.transition('activate'), other.log()[-2000:]
    assert commanding(other)


def test_a_goal_on_the_controllers_action_is_another_commander(other):
    # MoveIt or `ros2 action send_goal` move the arm through the controller's
    # follow_joint_trajectory action, not its topic: the action server's status topic lists
    # the goal (published here as the controller's server does: reliable, transient local).
    from action_msgs.msg import GoalInfo, GoalStatus, GoalStatusArray
    from rclpy.qos import DurabilityPolicy
    from unique_identifier_msgs.msg import UUID

    assert commanding(other)
    status = other.node.create_publisher(
        GoalStatusArray, '/arm_controller/follow_joint_trajectory/_action/status',
        QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                   durability=DurabilityPolicy.TRANSIENT_LOCAL))
    goal = GoalStatus(status=GoalStatus.STATUS_EXECUTING,
                      goal_info=GoalInfo(goal_id=UUID(uuid=list(range(16)))))
    mark = len(other.log())
    status.publish(GoalStatusArray(status_list=[goal]))
    assert wait_for(lambda: other.state() == 'inactive', 10), other.log()[mark:]
    text = other.log()[mark:]
    assert ('another node commands this robot: /arm_controller/follow_joint_trajectory: goal '
            '00010203 active: holding and leaving commanding') in text, text
    assert not other.transition('activate')
    # The goal succeeded: the action's status says so, and the node may command again.
    goal.status = GoalStatus.STATUS_SUCCEEDED
    status.publish(GoalStatusArray(status_list=[goal]))
    time.sleep(0.5)
    assert other.transition('activate'), other.log()[-2000:]
    assert commanding(other)
    other.node.destroy_publisher(status)


def test_after_a_long_silence_the_node_listens_and_leaves_a_robot_taken_over(other):
    assert commanding(other)
    mark = len(other.log())
    # The node's inputs stop (the robot is cut off from it) and another node takes over.
    other.paused = {'front', 'wrist'}
    time.sleep(CHECK + 0.5)
    other.commanding = True
    time.sleep(0.3)
    t = time.monotonic()
    other.paused = set()
    try:
        assert wait_for(lambda: other.state() == 'inactive', 10), other.log()[mark:]
        text = other.log()[mark:]
        assert ('leaving commanding to it (this node was not commanding)') in text, text
        # It never commanded, nor held, after its inputs came back.
        assert from_node(other, t) == []
    finally:
        other.commanding = False
    time.sleep(1.5)  # the other is heard no more
    assert other.transition('activate'), other.log()[-2000:]
    assert commanding(other)
