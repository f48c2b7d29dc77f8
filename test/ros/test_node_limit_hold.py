"""A chunk far outside the joint limits holds the robot, at the shipped limit_hold_margin.

oxygen_node runs as its own process on the tiny random model with the identity profile, so
its targets are the model's actions themselves (of order 1), while each arm joint may only
move +-0.001 around where the fake robot measures it: every chunk lies far beyond the range
(checked here on ~/predicted_trajectory, independently of the node). Nothing but holds at
the measured positions may then be commanded, and each is logged and counted.
"""
import re
import time

import numpy as np
import pytest

pytest.importorskip('rclpy')
from support.node import (  # noqa: E402
    ARM,
    LIMITS,  # noqa: E402
    PARAMS,
    User,  # noqa: E402
    node_process,
)
from support.process import new_domain, wait_for  # noqa: E402

import oxygen_ros.msg  # noqa: F401, E402 (built by colcon; must import)
from oxygen_ros.robot.params import BY_NAME  # noqa: E402
from oxygen_ros.robot.stamps import seconds  # noqa: E402

MARGIN = BY_NAME['limit_hold_margin'].default  # a fraction of each joint's range
# What the fake robot measures: joint i of ARM + [gripper] reads 0.1 * i.
MEASURED = [0.1 * i for i in range(len(ARM) + 1)]
HOLD = dict(PARAMS, robot='identity', profile_options='', publish_predicted=True,
            joint_limits={'arm': LIMITS})


@pytest.fixture(scope='module')
def robot(tmp_path_factory):
    domain = new_domain(120, 220)
    with node_process(tmp_path_factory.mktemp('limit_hold'), HOLD, domain, 'hold_robot',
                      User, '-r', 'front/image:=/remapped/front') as (proc, r):
        r.proc = proc
        assert wait_for(lambda: len(r.predicted) > 10 or proc.poll() is not None, 60), r.log()
        assert proc.poll() is None, r.log()
        yield r


def excess(points):
    """How far beyond its range, at most, the arm's targets in `points` lie (independently
    of the node: LIMITS as given)."""
    x = np.array([p.positions[:len(ARM)] for p in points])
    lower = np.array([LIMITS[j]['lower'] for j in ARM])
    upper = np.array([LIMITS[j]['upper'] for j in ARM])
    return float(np.max(np.maximum(x - upper, lower - x)))


def test_the_margin_is_the_shipped_default(robot):
    assert MARGIN == 0.1
    assert robot.get_param('limit_hold_margin') == MARGIN
    assert 'a target beyond a limit by more than 0.1 of its range holds' in robot.log()


def test_far_out_chunks_only_ever_hold_at_the_measured_positions(robot):
    t = time.monotonic()
    assert wait_for(lambda: len(robot.predicted) > 30, 30), robot.log()[-3000:]
    time.sleep(0.5)
    span = 0.002  # each arm joint's range
    # Every chunk, beyond its first action (the frame's own time, already past when it is
    # played), lies beyond the range by far more than the margin.
    for m in list(robot.predicted):
        assert excess(m.points[1:]) > 10 * MARGIN * span, [p.positions for p in m.points]
    arm = [m for at, m in list(robot.traj) if at >= t]
    grip = [m for at, m in list(robot.grip) if at >= t]
    # About one hold per chunk; the fake robot's joints never move.
    assert len(arm) >= 10 and len(grip) >= 10, (len(arm), len(grip))
    for m, joints, at in [*((m, ARM, MEASURED[:-1]) for m in arm),
                          *((m, ['gripper'], MEASURED[-1:]) for m in grip)]:
        assert list(m.joint_names) == joints
        assert len(m.points) == 1, m
        p = m.points[0]
        assert list(p.positions) == pytest.approx(at)
        assert list(p.velocities) == [0.0] * len(joints)
        assert seconds(p.time_from_start) == pytest.approx(1 / PARAMS['control_rate_hz'],
                                                           abs=1e-6)


def test_limit_holds_are_logged_and_counted(robot):
    pattern = (r'holding: joint limits: arm/fr3_joint\d target (?P<x>\S+), (above|below) its '
               r'(upper|lower) limit \S+ by (?P<by>\S+), more than the hold margin 0\.0002 '
               r"\(0\.1 of its range\): the model's actions do not fit this robot")
    assert wait_for(lambda: re.search(pattern, robot.log()), 10), robot.log()[-3000:]
    by = float(re.search(pattern, robot.log()).group('by'))
    assert by > MARGIN * 0.002
    first = robot.fresh_diag()
    time.sleep(1.0)
    d = robot.fresh_diag()
    for key in ('limit_holds', 'holds', 'hold_ticks'):
        assert int(d[key]) > int(first[key]) > 0, (key, first[key], d[key])
    # Every hold was a limit hold (the two counts are read a moment apart), no command ever
    # moved the robot, none was clamped.
    assert 0 <= int(d['holds']) - int(d['limit_holds']) <= 1, d
    assert d['published'] == '0' and d['clamped_commands'] == '0', d
    assert d['last_hold'].startswith('joint limits: arm/fr3_joint'), d['last_hold']
    assert d['last_hold'].endswith("the model's actions do not fit this robot")
    # Between the holds the node ticks without publishing: far more ticks than holds.
    assert int(d['hold_ticks']) > int(d['holds'])
