"""oxygen_node's safety paths at their shipped defaults, over rclpy against its own process:
a chunk longer than max_command_horizon is cut at it, joint states stamped in the future
are dropped (the robot holds at the last good reading, and commands again once stamps are
good), a missing optional camera is masked, a model failure holds; each with the log line
that names it and the /diagnostics counts that change.

The model is the tiny one with 16 actions instead of 4: at 10 actions/s its chunk spans
1.5 s, three times the default 0.5 s horizon. The tests run in order on one node process.
"""
import re
import time

import pytest
import yaml

rclpy = pytest.importorskip('rclpy')
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from support.node import (  # noqa: E402
    ARM,
    JOINTS,
    PARAMS,
    Robot,
    assert_alive_and_commanding,
    expect_log,
    joint_state,
    node_process,
    on_path,
)
from support.process import new_domain, wait_for  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

import oxygen_ros.msg  # noqa: F401, E402 (built by colcon; must import)
from oxygen_ros.model.config import CONFIG_DIR  # noqa: E402
from oxygen_ros.robot.params import BY_NAME  # noqa: E402

HORIZON = BY_NAME['max_command_horizon'].default
FUTURE = BY_NAME['max_future_stamp'].default
ACTIONS = 16  # the test model's action_horizon
PERIOD = 1.0 / PARAMS['action_rate_hz']
# What the fake robot measures: joint i of JOINTS reads 0.1 * i.
MEASURED = [0.1 * i for i in range(len(JOINTS))]
# Joint states stamped AHEAD s in the future, beyond max_future_stamp but within max_skew of
# the cameras: accepted, they would make frames as good ones do, and the robot would go on.
AHEAD = 0.2
SKEW = 0.3


def seconds(d):
    return d.sec + d.nanosec * 1e-9


def is_hold(entry, received):
    """entry (arrival, arm trajectory) is a hold where the controller's setpoint can be,
    after the trajectories `received` before it (the arm reads MEASURED)."""
    at, msg = entry
    return on_path(msg, ARM, [m for t, m in received if t < at], MEASURED[:len(ARM)])


def explain(robot, t):
    """The last one-point trajectory, for a failure's message."""
    one = [e for e in list(robot.traj) if e[0] >= t and len(e[1].points) == 1]
    return f'\nlast one-point trajectory: {one[-1]}' if one else '\nno one-point trajectory'


def holds(robot, t):
    """The holds the arm received from monotonic time t on."""
    sent = list(robot.traj)
    return [e for e in sent if e[0] >= t and is_hold(e, sent)]


class Guard(Robot):
    """The fake robot, with joint states that can be stamped ahead (and read elsewhere), a
    gripper that can read 1e39 (finite as float64, infinite once the model casts the state
    to float32), and each ~/predicted_trajectory with the node clock when it came."""

    def __init__(self, node):
        super().__init__(node)
        self.leave_out = set()
        self.ahead = 0.0
        self.moved = 0.0  # added to every joint while its stamps are ahead
        self.huge_gripper = False
        self.predicted = []
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(
            JointTrajectory, '/oxygen_node/predicted_trajectory',
            lambda m: self.predicted.append((self.node.get_clock().now().nanoseconds * 1e-9, m)),
            reliable)

    def _joints(self):
        m = joint_state(self._stamp(-self.ahead), JOINTS)
        m.position = [x + (self.moved if self.ahead else 0.0) for x in MEASURED]
        if self.huge_gripper:
            m.position[-1] = 1e39
        self.joint_pub.publish(m)


def long_chunk_model(path):
    """The tiny model config with ACTIONS actions per chunk."""
    cfg = yaml.safe_load((CONFIG_DIR / 'tiny.yaml').read_text())
    cfg.update(name='tiny_long_chunk', action_horizon=ACTIONS)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope='module')
def robot(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('safety')
    domain = new_domain(120, 220)
    params = dict(PARAMS, model=long_chunk_model(tmp / 'long_chunk.yaml'), publish_predicted=True,
                  optional_cameras=['wrist'], max_skew=SKEW, compile=False)  # other dims
    with node_process(tmp, params, domain, 'guarded_robot', Guard,
                      '-r', 'front/image:=/remapped/front') as (proc, r):
        r.proc, r.params = proc, params
        assert wait_for(lambda: len(r.traj) > 20 or proc.poll() is not None, 60), r.log()
        assert proc.poll() is None, r.log()
        yield r


def after(received, t):
    return [m for at, m in list(received) if at >= t]


def test_a_chunk_longer_than_the_horizon_is_cut_at_it(robot):
    assert HORIZON == 0.5 and robot.get_param('max_command_horizon') == HORIZON
    assert f'chunks of {ACTIONS} x 8' in robot.log()
    assert_alive_and_commanding(robot, robot.params)
    t = time.monotonic()
    n = len(robot.predicted)
    time.sleep(1.0)
    # The chunks really are longer: 16 actions 0.1 s apart, and each, when it came, still
    # reached at least 0.8 s ahead, far past the horizon.
    chunks = robot.predicted[n:]
    assert len(chunks) >= 5, len(chunks)
    for at, m in chunks:
        ends = [seconds(p.time_from_start) for p in m.points]
        assert ends == pytest.approx([i * PERIOD for i in range(ACTIONS)], abs=1e-6)
        assert seconds(m.header.stamp) + ends[-1] - at > HORIZON + 0.3, (m.header.stamp, at)
    sent = after(robot.traj, t)
    assert len(sent) >= 50, len(sent)
    furthest = []
    for m in sent:
        # header.stamp zero: the controller starts the trajectory on arrival, so
        # time_from_start is how far ahead of now each point lies.
        assert m.header.stamp.sec == 0 and m.header.stamp.nanosec == 0
        times = [seconds(p.time_from_start) for p in m.points]
        assert max(times) <= HORIZON + 1e-9, times
        assert len(times) <= round(HORIZON / PERIOD), times
        furthest.append(max(times))
    # The points go up to the horizon (the cut is there, not earlier).
    assert max(furthest) > HORIZON - PERIOD, max(furthest)


def test_future_joint_stamps_are_dropped_and_the_robot_holds(robot):
    first = robot.fresh_diag()
    mark = len(robot.log())
    t = time.monotonic()
    # The future readings would also move every joint by 1: a hold at them would show.
    robot.ahead, robot.moved = AHEAD, 1.0
    try:
        # No good reading for max_input_age (0.5 s): the joints are stale, and the robot
        # holds where it last was.
        # A hold at the future readings would be 1 away from the setpoint.
        assert wait_for(lambda: holds(robot, t), 3.0), (
            'no hold at the controller setpoint:\n' + robot.log()[mark:][-3000:]
            + explain(robot, t))
        expect_log(robot, mark, rf'joint_states: stamp \d+ ms in the future \(limit '
                   rf'{FUTURE * 1e3:.0f} ms\); message dropped')
        expect_log(robot, mark, r'holding: inputs: joints: stale \(\d+ ms old, limit 500 ms\)')
        time.sleep(0.3)
        held = robot.fresh_diag()
        n, chunks = len(robot.traj), len(robot.predicted)
        time.sleep(1.0)
        # Nothing commanded and no chunk made from the dropped readings, while held.
        assert len(robot.traj) == n, 'commands from future-stamped joint states'
        assert len(robot.predicted) == chunks, 'chunks from future-stamped joint states'
        d = robot.fresh_diag()
    finally:
        robot.ahead, robot.moved = 0.0, 0.0
    sent = [e for e in robot.traj if e[0] >= t]
    assert len(holds(robot, t)) == 1
    assert is_hold(sent[-1], robot.traj), sent[-1]
    assert int(held['future_stamps']) > int(first['future_stamps'])
    assert int(d['future_stamps']) > int(held['future_stamps'])  # still coming, still dropped
    assert int(held['holds']) > int(first['holds'])
    assert d['last_hold'].startswith('inputs: joints: stale'), d['last_hold']
    # Held: every control tick passes without a command.
    assert int(d['hold_ticks']) - int(held['hold_ticks']) >= 0.5 * PARAMS['control_rate_hz']
    assert d['published'] == held['published']
    # Good stamps again: the node commands again, from the readings it now takes.
    time.sleep(0.3)  # the last messages stamped ahead have been taken
    mark = len(robot.log())
    assert_alive_and_commanding(robot, robot.params)
    assert 'in the future' not in robot.log()[mark:]


def test_a_missing_optional_camera_is_masked_and_counted(robot):
    first = robot.fresh_diag()
    mark = len(robot.log())
    robot.paused.add('wrist')
    try:
        expect_log(robot, mark, r'camera wrist stale \(\d+ ms old, limit 500 ms\), left out '
                   r'\(masked\)')
        # Masked, not held: the robot goes on without it.
        assert_alive_and_commanding(robot, robot.params)
        d = robot.fresh_diag()
    finally:
        robot.paused.clear()
    assert int(d['masked_cameras']) > int(first['masked_cameras'])
    assert int(d['holds']) == int(first['holds'])
    assert 'holding' not in robot.log()[mark:]


def test_a_model_failure_holds_and_counts_failed_frames(robot):
    first = robot.fresh_diag()
    mark = len(robot.log())
    t = time.monotonic()
    robot.huge_gripper = True
    try:
        # The engine's own words for the infinite state follow "model failure: ".
        expect_log(robot, mark, r'frame failed: ')
        expect_log(robot, mark, r'holding: model failure: ')
        # The arm holds where its setpoint is (the gripper reads 1e39: not a hold target).
        assert wait_for(lambda: holds(robot, t), 2.0)
        d = robot.fresh_diag()
    finally:
        robot.huge_gripper = False
    assert int(d['failed_frames']) > int(first['failed_frames'])
    assert int(d['holds']) > int(first['holds'])
    assert d['last_hold'].startswith('model failure: '), d['last_hold']
    assert_alive_and_commanding(robot, robot.params)


def test_hold_diagnostics_stand_still_while_commanding(robot):
    """The counts above rise only with what they count: commanding, they stay put."""
    assert_alive_and_commanding(robot, robot.params)
    first = robot.fresh_diag()
    time.sleep(1.0)
    d = robot.fresh_diag()
    for key in ('holds', 'hold_ticks', 'failed_frames', 'future_stamps', 'masked_cameras',
                'limit_holds'):
        assert d[key] == first[key], (key, first[key], d[key])
    assert int(d['published']) > int(first['published'])
    assert re.match('model failure: ', d['last_hold']), d['last_hold']
