"""Joint limits over rclpy: oxygen_node (its own process, the tiny random model) with limits
far narrower than what the model commands publishes only points inside them, reachable at
the joint's speed from the measured position and from each other, accepted by the
independent joint_trajectory_controller checker, and reports the clamping."""
import math
import re
import sys
import time

import pytest

pytest.importorskip('rclpy')
from support.node import ARM, PARAMS, Robot, keeps_commanding, node_process  # noqa: E402
from support.paths import TOOLS  # noqa: E402
from support.process import new_domain, wait_for  # noqa: E402

import oxygen_ros.msg  # noqa: E402, F401 (built by colcon; must import)
from oxygen_ros.robot.playback import RECENT_S  # noqa: E402
from oxygen_ros.robot.stamps import seconds  # noqa: E402

sys.path.insert(0, str(TOOLS))
from node_load import jtc_problems  # noqa: E402
from support.node import LIMITS, SPEED  # noqa: E402

# The node starts a command where it estimates the arm to be: a recent reading (at most
# RECENT_S old) moved on along the setpoint since. This arm never moves, so the first point
# may lie that much more motion away from the reading.
AHEAD = RECENT_S + 0.02


@pytest.fixture(scope='module')
def robot(tmp_path_factory):
    domain = new_domain(120, 220)
    # A margin of 1000 ranges (2 units) keeps every chunk clamped instead of held.
    params = dict(PARAMS, joint_limits={'arm': LIMITS}, limit_hold_margin=1000.0)

    def make(node):
        r = Robot(node)
        r.leave_out = set()
        return r

    with node_process(tmp_path_factory.mktemp('limits'), params, domain, 'limits_robot', make,
                      '-r', 'front/image:=/remapped/front') as (proc, r):
        r.proc = proc
        assert wait_for(lambda: len(r.traj) > 20 or proc.poll() is not None, 60), r.log()
        assert proc.poll() is None, r.log()
        yield r


def test_start_up_log_says_which_joints_are_limited(robot):
    assert 'joint limits on 7 of 8 joints' in robot.log()
    assert 'none on gripper/gripper' in robot.log()


def test_only_in_limit_speed_feasible_points_are_published(robot):
    time.sleep(1.5)
    msgs = [m for _, m in list(robot.traj)]
    assert len(msgs) > 50
    moving = 0
    for m in msgs:
        assert jtc_problems(m, ARM, time.time()) == [], m
        previous = [0.1 * i for i in range(7)]  # where the robot is measured
        t0 = 0.0
        for p in m.points:
            t = seconds(p.time_from_start)
            for i, (x, v) in enumerate(zip(p.positions, p.velocities, strict=True)):
                lim = LIMITS[ARM[i]]
                assert lim['lower'] - 1e-12 <= x <= lim['upper'] + 1e-12, (i, x)
                # time_from_start is truncated to whole nanoseconds.
                slack = AHEAD if t0 == 0.0 else 0.0
                assert abs(x - previous[i]) <= SPEED * (t - t0 + slack + 2e-9), (
                    i, x, previous[i])
                assert abs(v) <= SPEED + 1e-12, (i, v)
            previous, t0 = list(p.positions), t
        moving += len(m.points) > 1
    assert moving, 'only holds were published'


def test_clamping_is_reported_and_counted(robot):
    assert wait_for(lambda: int(robot.diag.get('clamped_commands', 0)) > 0, 5), robot.diag
    assert robot.diag['limit_holds'] == '0'
    log = robot.log()
    assert 'joint limits: arm/fr3_joint' in log
    assert 'clamped into' in log or 'held back by up to' in log
    assert math.isfinite(float(robot.diag['control_publish_hz']))


def test_a_glitching_reading_is_dropped_counted_and_named(robot):
    """Every second joint message reads fr3_joint1 0.5 away, far faster than its 0.005/s: a
    glitch. It is dropped (not a frame's state, not where a command starts or a hold holds),
    counted and named, and the good messages between keep the robot commanded."""
    first = robot.fresh_diag()
    mark = len(robot.log())

    def glitch(m):
        m.position = [x + 0.5 if n == ARM[0] else x for n, x in zip(m.name, m.position)]
        return m

    t = time.monotonic()
    robot.bad_joints = glitch
    try:
        assert wait_for(lambda: 'a glitch, message dropped' in robot.log()[mark:], 5), (
            robot.log()[mark:][-3000:])
        assert keeps_commanding(robot.traj, PARAMS['control_rate_hz'],
                                lambda: robot.proc.poll() is None)
        d = robot.fresh_diag()
    finally:
        robot.bad_joints = None
    assert re.search(r'joint_states: fr3_joint1 moved 0\.5 in \d+ ms, faster than its '
                     r'0\.005/s: a glitch', robot.log()[mark:]), robot.log()[mark:][-3000:]
    assert int(d['joint_glitches']) > int(first['joint_glitches'])
    assert int(d['limit_holds']) == int(first['limit_holds'])
    # Every point sent meanwhile lies in range: a glitch taken for where the arm is would
    # lead it back from 0.5 outside, point by point (limits.py), and show.
    for at, m in list(robot.traj):
        if at >= t:
            for p in m.points:
                for j, x in zip(ARM, p.positions, strict=True):
                    assert LIMITS[j]['lower'] - 1e-12 <= x <= LIMITS[j]['upper'] + 1e-12, m
