"""Joint limits without ROS: the clamping and the speed and acceleration limiting of
published points against hand computations (the controller's cubic between them, at its
peak), the velocities kept monotone, braking holds, the controller's velocity the Player
starts from, the hold left exactly where the robot
is, the margin beyond which the robot holds instead, the start errors, and the limits the
shipped robot files carry."""
import math

import numpy as np
import pytest
import yaml
from support.paths import ROOT  # noqa: E402

from oxygen_ros.robot.contract import Config
from oxygen_ros.robot.limits import JointLimits, Limit, describe, parse_limits
from oxygen_ros.robot.params import StartError, flatten
from oxygen_ros.robot.playback import Player, make_chunk


def one_joint(lower=-1.0, upper=1.0, velocity=2.0, margin=0.1, dim=2, acceleration=math.inf):
    # Action 0 limited, action 1 free.
    return JointLimits(dim, {0: ('arm/j', Limit(lower, upper, velocity, acceleration))},
                       margin)


def test_clamp_and_a_single_step_by_hand():
    lim = one_joint()  # [-1, 1], 2/s, no acceleration limit
    out = lim.apply(np.array([0.1]), np.array([[1.5, 7.0]]), np.array([[5.0, 10.0]]),
                    measured=np.array([0.9, 6.0]))
    # 1.5 is clamped to 1; a single point is at rest, so the controller moves along
    # 3u^2 - 2u^3 from 0.9: peak speed 1.5 x the mean. Going d in 0.1 s, from anywhere on
    # the way it must still be able to stop a step (0.1 s) ahead at its peak speed 15 d
    # before the limit: 0.9 + d + 1.5 d <= 1, so d = 0.1 / 2.5 = 0.04 (its peak 0.6/s).
    np.testing.assert_allclose(out.positions[:, 0], [0.94])
    np.testing.assert_array_equal(out.velocities[:, 0], [0.0])
    # The free joint is untouched, but ends at rest.
    np.testing.assert_array_equal(out.positions[:, 1], [7.0])
    np.testing.assert_array_equal(out.velocities[:, 1], [0.0])
    found = {f.kind: f for f in out.findings}
    assert set(found) == {'position', 'speed'}
    assert found['position'].amount == pytest.approx(0.5)
    assert found['speed'].amount == pytest.approx(0.06)
    assert found['position'].joint == 'arm/j'
    assert 'arm/j target 1.5, above its upper limit 1 by 0.5' in found['position'].text
    assert 'faster than 2/s allow; held back by up to 0.06' in found['speed'].text


def test_a_single_step_from_rest_by_its_acceleration():
    # No range; 2/s and 10/s^2. Rest to rest in 0.1 s: the cubic's acceleration peaks at
    # 6 d / h^2 (at both ends), so d = 10 * 0.01 / 6; its speed then peaks at 0.25/s.
    lim = JointLimits(1, {0: ('arm/j', Limit(velocity=2.0, acceleration=10.0))}, 0.1)
    out = lim.apply(np.array([0.1]), np.array([[1.0]]), np.zeros((1, 1)), np.array([0.0]))
    np.testing.assert_allclose(out.positions[:, 0], [1 / 60])
    # With the speed the tighter one (0.1/s: d = 0.1 * 0.1 / 1.5).
    lim = JointLimits(1, {0: ('arm/j', Limit(velocity=0.1, acceleration=10.0))}, 0.1)
    out = lim.apply(np.array([0.1]), np.array([[1.0]]), np.zeros((1, 1)), np.array([0.0]))
    np.testing.assert_allclose(out.positions[:, 0], [0.1 * 0.1 / 1.5])


def test_feasible_points_pass_unchanged():
    # Moving at 1/s from 0, two steps at 1/s (the cubic a straight line), then 0.05 in the
    # last 0.1 s to rest: a parabola braking at exactly 10/s^2. Room to stop before 1 after
    # the second point: 0.2 + 1^2 / 20 + 1 * 0.1 = 0.35.
    times = np.array([0.1, 0.2, 0.3])
    raw = np.array([[0.1, 0.0], [0.2, 0.0], [0.25, 0.0]])
    vel = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    out = one_joint(acceleration=10.0).apply(times, raw, vel, measured=np.array([0.0, 0.0]),
                                             moving=np.array([1.0, 0.0]))
    np.testing.assert_array_equal(out.positions, raw)
    np.testing.assert_array_equal(out.velocities[:, 0], [1.0, 1.0, 0.0])
    assert out.findings == []
    # At 9.9/s^2 the last step cannot brake in time: the points are moved, and say so.
    out = one_joint(acceleration=9.9).apply(times, raw, vel, measured=np.array([0.0, 0.0]),
                                            moving=np.array([1.0, 0.0]))
    assert not np.array_equal(out.positions, raw)
    assert [f.kind for f in out.findings] == ['speed']
    assert 'faster than 2/s, 9.9/s^2 allow' in out.findings[0].text


def test_velocities_keep_each_cubic_monotone():
    # The given velocities, except 0 where the neighbouring steps disagree in direction
    # (a turn) and at most 3 x the slower neighbour's mean speed (Fritsch and Carlson).
    lim = JointLimits(1, {0: ('arm/j', Limit(velocity=100.0))}, 0.1)
    times = np.array([0.1, 0.2, 0.3, 0.4])
    raw = np.array([[0.1], [0.2], [0.1], [0.3]])  # slopes 1, 1, -1, 2 from 0
    out = lim.apply(times, raw, np.array([[5.0], [0.5], [-3.0], [7.0]]), np.array([0.0]))
    np.testing.assert_allclose(out.velocities[:, 0], [3.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(out.positions, raw)


def test_random_commands_are_in_range_and_speed_feasible():
    # Checked against the definition, not the code: every point in [lower, upper], every
    # step (the first from the measured position) no faster than the speed, velocities no
    # faster either, the last at rest.
    rng = np.random.default_rng(0)
    lo, hi, v = np.array([-1.0, 0.0, -0.5]), np.array([1.0, 0.5, 2.0]), np.array([1.0, 0.3, 5])
    lim = JointLimits(3, {i: (f'g/j{i}', Limit(lo[i], hi[i], v[i])) for i in range(3)}, 0.1)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        times = np.cumsum(rng.uniform(0.005, 0.1, n))
        raw = rng.uniform(-3, 3, (n, 3))
        measured = rng.uniform(lo, hi)
        out = lim.apply(times, raw, rng.normal(size=(n, 3)), measured)
        p = out.positions
        assert np.all(p >= lo) and np.all(p <= hi)
        steps = np.abs(np.diff(np.vstack([measured, p]), axis=0))
        assert np.all(steps <= v * np.diff(times, prepend=0.0)[:, None] + 1e-12)
        assert np.all(np.abs(out.velocities) <= v + 1e-12)
        assert np.all(out.velocities[-1] == 0)


def mixed_limits():
    """Four joints: the FR3's kind (speed, acceleration, jerk), a tight range with an
    acceleration only, a speed only (ALOHA's kind), no range at all."""
    return JointLimits(5, {0: ('g/a', Limit(-2.7, 2.7, 2.6, 10.0, 5000.0)),
                           1: ('g/b', Limit(0.0, 0.8, 0.5, 3.0)),
                           2: ('g/c', Limit(-1.8, 1.2, 3.1)),
                           3: ('g/d', Limit(velocity=1.0, acceleration=20.0))}, 0.1)


def adversarial(rng, n):
    """(times, targets, velocities, measured, moving, step) for mixed_limits: noise, jumps
    and smooth runs, out of range, starts unknown or beyond a limit, spacing uneven."""
    times = np.cumsum(rng.choice([1 / 70, 1 / 15, 0.02]) * (
        np.ones(n) if rng.random() < 0.6 else rng.uniform(0.5, 1.5, n)))
    times[0] *= rng.uniform(0.05, 1.0)
    kind = rng.integers(3)
    if kind == 0:
        raw = rng.uniform(-3, 3, (n, 5))
    elif kind == 1:
        raw = np.where(np.arange(n)[:, None] < rng.integers(n + 1), *rng.uniform(-3, 3, (2, 5)))
    else:
        raw = np.cumsum(rng.normal(0, 0.05, (n, 5)), axis=0) + rng.uniform(-1, 1, 5)
    vel = rng.normal(0, 3, (n, 5))
    measured = rng.uniform(-3, 3, 5)
    measured[rng.random(5) < 0.2] = np.nan
    moving = rng.normal(0, 2, 5) * rng.choice([0.0, 0.1, 1.0, 5.0])
    return times, raw, vel, measured, moving, float(rng.choice([0.0, 1 / 70, 1 / 15]))


def test_checking_points_as_placed_or_all_at_once_agrees(monkeypatch):
    # apply() checks a few points one by one as it places them and many all at once
    # first: the same points either way, to the last bit.
    import oxygen_ros.robot.limits as limits

    lim = mixed_limits()
    rng = np.random.default_rng(3)
    moved = 0
    for _ in range(300):
        case = adversarial(rng, int(rng.integers(1, 30)))
        monkeypatch.setattr(limits, 'SMALL', 0)
        a = lim.apply(*case)
        monkeypatch.setattr(limits, 'SMALL', 10 ** 9)
        b = lim.apply(*case)
        assert np.array_equal(a.positions, b.positions)
        assert np.array_equal(a.velocities, b.velocities)
        assert a.findings == b.findings
        moved += any(f.kind == 'speed' for f in a.findings)
    assert moved > 200  # most cases had points placed away from their targets


def test_the_per_joint_check_is_the_array_check():
    # _fits1 (one joint, floats) must answer as _fits (numpy) does, on the segments between
    # placed points (at the limits by construction, where a slip would show) and between
    # random ones.
    import oxygen_ros.robot.limits as limits

    lim = mixed_limits()
    checks = lim._checks
    rng = np.random.default_rng(5)
    answers = []
    for _ in range(100):
        times, raw, vel, measured, moving, step = adversarial(rng, int(rng.integers(2, 30)))
        out = lim.apply(times, raw, vel, measured, moving, step)
        h = np.diff(times, prepend=0.0)[:, None]
        reach = max(float(h.max()), step)
        with np.errstate(invalid='ignore'):
            cap = limits._cap(times, *checks.lim[2:4])
        for p, v in ((out.positions[:, :4], out.velocities[:, :4]),
                     (rng.uniform(-3, 3, (len(times), 4)), rng.normal(0, 3, (len(times), 4)))):
            p0, v0, p1, v1 = p[:-1], v[:-1], p[1:], v[1:]
            with np.errstate(invalid='ignore', divide='ignore'):
                whole = limits._fits((p1 - p0) / h[1:], v0, p1, v1, h[1:], cap[1:], reach,
                                     checks)
            for k, j in np.ndindex(whole.shape):
                one = limits._fits1(float(p0[k, j]), float(v0[k, j]), float(p1[k, j]),
                                    float(v1[k, j]), float(h[k + 1, 0]), float(cap[k + 1, j]),
                                    reach, checks.joints[j])
                assert one == bool(whole[k, j]), (k, j)
            answers += whole.ravel().tolist()
    assert 0.05 < np.mean(answers) < 0.95  # both answers, often


def test_measured_beyond_a_limit_goes_to_the_limit_and_is_said():
    lim = one_joint(velocity=math.inf)
    out = lim.apply(np.array([0.1]), np.array([[1.3, 0.0]]), np.zeros((1, 2)),
                    measured=np.array([1.05, 0.0]))
    assert out.positions[0, 0] == 1.0
    measured = [f for f in out.findings if f.kind == 'measured']
    assert len(measured) == 1 and measured[0].amount == pytest.approx(0.05)
    assert 'arm/j measured at 1.05, above its upper limit 1 by 0.05' in measured[0].text


def test_measured_beyond_a_limit_comes_back_at_its_speed():
    # Range [-1, 1] at 1/s, the hold margin wide enough to command it; measured 0.3 above.
    lim = one_joint(velocity=1.0, margin=0.5)
    times = np.array([0.1, 0.2, 0.3, 0.4])
    out = lim.apply(times, np.full((4, 2), 0.5), np.zeros((4, 2)),
                    measured=np.array([1.3, 0.0]))
    # From rest to 1/s in the first step (constant acceleration: 0.05), 0.1 a step at 1/s,
    # at rest at the last (0.05 again): back inside the range at the last point, never the
    # 0.3 jump to the limit.
    np.testing.assert_allclose(out.positions[:, 0], [1.25, 1.15, 1.05, 1.0])
    np.testing.assert_allclose(out.velocities[:, 0], [-1.0, -1.0, -1.0, 0.0])
    assert {f.kind for f in out.findings} == {'speed', 'measured'}


def test_unknown_start_only_clamps_the_first_point():
    lim = one_joint()
    out = lim.apply(np.array([0.1, 0.2]), np.array([[0.9, 0.0], [-0.5, 0.0]]),
                    np.zeros((2, 2)), measured=np.array([np.nan, 0.0]))
    # 0.9 stands, at rest (nothing to step from); then rest to rest in 0.1 s at a peak of
    # 2/s: 0.1 * 2 / 1.5 below it.
    np.testing.assert_allclose(out.positions[:, 0], [0.9, 0.9 - 0.2 / 1.5])
    np.testing.assert_allclose(out.velocities[:, 0], [0.0, 0.0])


def test_a_hold_brakes_a_moving_joint_by_hand():
    lim = one_joint(acceleration=10.0)
    times, pos, vel = lim.stop(np.array([0.3, 4.0]), np.array([1.0, 5.0]), 0.05, 1.0)
    # 1/s to rest at 10/s^2: 0.1 s and 0.05 of travel (v^2 / 2a), in points 0.05 s apart.
    np.testing.assert_allclose(times, [0.05, 0.1, 0.15])
    np.testing.assert_allclose(pos[:, 0], [0.3375, 0.35, 0.35])
    np.testing.assert_allclose(vel[:, 0], [0.5, 0.0, 0.0])
    np.testing.assert_array_equal(pos[:, 1], [4.0] * 3)  # free: where it is
    # Not moving: one point exactly where it is, even beyond the range.
    times, pos, vel = lim.stop(np.array([1.2, 4.0]), np.array([0.0, 5.0]), 0.05, 1.0)
    np.testing.assert_array_equal(times, [0.05])
    np.testing.assert_array_equal(pos, [[1.2, 4.0]])
    np.testing.assert_array_equal(vel, [[0.0, 0.0]])


def test_a_hold_without_an_acceleration_limit_stops_where_the_joint_is():
    # A range and a speed but no acceleration (ALOHA's joints): moving or not, the hold is
    # one point exactly at the measured position, at rest.
    lim = one_joint()
    times, pos, vel = lim.stop(np.array([0.3, 4.0]), np.array([1.0, 5.0]), 0.05, 1.0)
    np.testing.assert_array_equal(times, [0.05])
    np.testing.assert_array_equal(pos, [[0.3, 4.0]])
    np.testing.assert_array_equal(vel, [[0.0, 0.0]])


def test_hold_margin_is_a_fraction_of_the_range():
    lim = one_joint(margin=0.1)  # range 2: margin 0.2
    assert lim.too_far(np.array([[1.19, 50.0]]), np.array([0.0, 0.0])) is None
    why = lim.too_far(np.array([[0.0, 0.0], [-1.25, 0.0]]), np.array([0.0, 0.0]))
    assert why.startswith('joint limits: arm/j target -1.25, below its lower limit -1 by '
                          '0.25, more than the hold margin 0.2 (0.1 of its range)')
    why = lim.too_far(np.array([[0.0, 0.0]]), np.array([1.3, 0.0]))
    assert 'arm/j measured position 1.3, above its upper limit 1 by 0.3' in why
    assert lim.too_far(np.array([[0.0, 0.0]]), np.array([np.nan, 0.0])) is None
    # A joint with only a speed limit has no range to be beyond.
    free = JointLimits(1, {0: ('g/spin', Limit(velocity=1.0))}, 0.0)
    assert free.too_far(np.array([[1e6]]), np.array([0.0])) is None


def ramp_chunk(values, period=0.1, stamp=0.0):
    v = np.asarray(values, dtype=float)
    return make_chunk(stamp, period, np.stack([v, np.zeros_like(v)], 1))


def test_player_publishes_limited_points():
    p = Player(horizon=1.0, limits=one_joint())
    p.play(ramp_chunk([0.0, 0.5, 1.1, 1.15, 1.1]))  # 0.15 beyond at most: clamped
    at = np.array([0.0, 0.0])
    cmd = p.tick(0.05, hold_at=lambda: at)
    np.testing.assert_allclose(cmd.times, [0.05, 0.15, 0.25, 0.35])
    # What the limits make of the same points from where the robot is, at rest.
    ref = one_joint().apply(cmd.times, np.array([[0.5, 0], [1.1, 0], [1.15, 0], [1.1, 0]]),
                            make_chunk(0.0, 0.1, np.array([[0.0, 0], [0.5, 0], [1.1, 0],
                                                           [1.15, 0], [1.1, 0]])).velocities[1:],
                            at)
    np.testing.assert_array_equal(cmd.positions, ref.positions)
    np.testing.assert_array_equal(cmd.velocities, ref.velocities)
    assert np.all(cmd.positions[:, 0] <= 1.0)
    assert cmd.hold is None and cmd.clamped
    assert {f.kind for f in cmd.findings} == {'position', 'speed'}


def test_player_starts_from_the_controllers_velocity():
    # Unlimited range, 100/s: a ramp at 10/s passes as given.
    lim = JointLimits(1, {0: ('arm/j', Limit(velocity=100.0))}, 0.1)
    p = Player(horizon=1.0, limits=lim)
    p.play(make_chunk(0.0, 0.1, np.arange(5.0)[:, None]))
    cmd = p.tick(0.0, hold_at=lambda: np.array([0.0]))
    np.testing.assert_allclose(cmd.positions[:, 0], [1, 2, 3, 4])
    np.testing.assert_allclose(cmd.velocities[:, 0], [10, 10, 10, 0])
    # Halfway to the first point, the cubic from (0, 0) to (1, 10) in 0.1 s moves at
    # 10 + (0 - 10)(1 - 2 + 0.75) + (10 - 10)(0.75 - 1) = 12.5/s.
    assert p.moving(0.05)[0] == pytest.approx(12.5)
    assert p.moving(0.4)[0] == 0.0  # past the last point: at rest
    # A hold from there, with no acceleration limit to brake within, is the single point
    # where the controller's setpoint is, at rest: on that cubic, 0 + 0 t + 200 t^2 - 1000 t^3
    # at 0.05 s is 0.375, where the arm read at 0 (0) has moved on to.
    p.stop('deactivated')
    cmd = p.tick(0.05, hold_at=lambda: (np.array([0.0]), np.array([0.0])))
    assert cmd.hold == 'deactivated'
    np.testing.assert_allclose(cmd.times, [0.01])
    np.testing.assert_allclose(cmd.positions[:, 0], [0.375])
    np.testing.assert_array_equal(cmd.velocities, [[0.0]])


def test_open_loop_controllers_are_limited_from_the_setpoint():
    """A controller with open_loop_control starts each trajectory from its last command, so
    the speed limit judges the motion from the setpoint; a closed-loop one starts from the
    arm, and an arm lagging its command must not be jerked after it."""
    chunk = ramp_chunk(np.arange(10) * 0.06)  # 0.6/s: under the 1/s limit
    def lagging():  # read at 0.05: the arm lags behind
        return np.array([-0.05, 0.0]), np.array([0.05, 0.05])
    out = {}
    for open_loop in (False, True):
        p = Player(horizon=1.0, limits=one_joint(velocity=1.0), open_loop=open_loop)
        p.play(chunk)
        p.tick(0.0, hold_at=lambda: np.array([0.0, 0.0]))
        setpoint, moving = p.setpoint(0.05), p.moving(0.05)
        assert 0.0 < setpoint[0] < 0.06
        cmd = p.tick(0.05, hold_at=lagging)
        start = setpoint if open_loop else np.array([-0.05, 0.0])
        n = len(cmd.times)
        ref = one_joint(velocity=1.0).apply(cmd.times, chunk.positions[1:1 + n],
                                            chunk.velocities[1:1 + n], start, moving, 0.1)
        np.testing.assert_array_equal(cmd.positions, ref.positions)
        np.testing.assert_array_equal(cmd.velocities, ref.velocities)
        out[open_loop] = cmd
    # From the arm, 0.11 in the 0.05 s to the next action is 2.2/s: slowed. From the
    # setpoint the chunk's own 0.6/s passes as given.
    assert out[False].clamped and not out[True].clamped
    np.testing.assert_allclose(out[True].positions[:, 0], chunk.positions[1:1 + n, 0])


def test_player_holds_instead_when_a_target_is_far_beyond():
    p = Player(horizon=0.2, limits=one_joint(margin=0.1))
    # The last action, beyond the horizon, is 0.3 above the range: more than 0.2.
    p.play(ramp_chunk([0.0, 0.1, 0.2, 0.3, 1.3]))
    cmd = p.tick(0.05, hold_at=lambda: np.array([0.2, -4.0]))
    assert cmd.hold.startswith('joint limits: arm/j target 1.3')
    np.testing.assert_array_equal(cmd.positions, [[0.2, -4.0]])
    np.testing.assert_array_equal(cmd.velocities, [[0.0, 0.0]])
    assert p.chunk is None
    assert p.tick(0.06, hold_at=lambda: np.array([0.2, -4.0])) is None  # said once
    p.play(ramp_chunk([0.0, 0.1, 0.2], stamp=0.1))  # a chunk that fits plays again
    assert p.tick(0.15, hold_at=lambda: np.array([0.0, 0.0])).hold is None


def test_play_steps_bound_what_is_judged():
    p = Player(horizon=0.2, play_steps=3, limits=one_joint(margin=0.1))
    p.play(ramp_chunk([0.0, 0.1, 0.2, 5.0]))  # action 3 is never played
    assert p.tick(0.05, hold_at=lambda: np.array([0.0, 0.0])).hold is None


def test_hold_stays_exactly_where_the_robot_is():
    p = Player(horizon=1.0, hold_after=0.02, limits=one_joint())
    p.play(ramp_chunk([0.0, 0.5]))
    assert p.stop('deactivated')
    cmd = p.tick(0.0, hold_at=lambda: np.array([1.07, 3.0]))
    assert cmd.hold == 'deactivated'
    np.testing.assert_array_equal(cmd.positions, [[1.07, 3.0]])  # not moved into range
    assert not cmd.clamped
    assert [f.kind for f in cmd.findings] == ['measured']
    assert 'measured at 1.07, above its upper limit 1 by 0.07' in cmd.findings[0].text


def test_reanchored_chunks_are_judged_by_the_step_now_starting():
    # DROID-like: each target is where the arm is plus the velocities integrated so far.
    def reanchor(first, state):
        return state + np.cumsum(np.full((4 - first, 2), 0.15), axis=0)

    p = Player(horizon=1.0, limits=one_joint(velocity=1.0))  # margin 0.2
    p.play(make_chunk(0.0, 0.1, np.zeros((4, 2)), reanchor=reanchor))
    at = np.array([0.9, 0.0])
    cmd = p.tick(0.05, measured=lambda: at, hold_at=lambda: at)
    # The targets 1.05, 1.2, 1.35 run past the limit (the last by more than the margin) only
    # because the arm moves toward it: clamped, not held; toward the limit, never past it.
    assert cmd.hold is None
    assert np.all(cmd.positions[:, 0] <= 1.0) and np.all(np.diff(cmd.positions[:, 0]) >= 0)
    assert cmd.positions[-1, 0] > 0.9
    # A step target itself beyond the margin holds.
    p.play(make_chunk(0.0, 0.1, np.zeros((4, 2)), reanchor=lambda first, state: np.full(
        (4 - first, 2), state[0] + 0.5)))
    cmd = p.tick(0.05, measured=lambda: at, hold_at=lambda: at)
    assert cmd.hold.startswith('joint limits: arm/j target 1.4')
    # Without re-anchoring the same integrated targets are the plan itself: judged whole.
    p.play(make_chunk(0.0, 0.1, np.stack([0.9 + np.cumsum(np.full(4, 0.15)),
                                          np.zeros(4)], 1)))
    assert p.tick(0.05, hold_at=lambda: at).hold.startswith('joint limits: arm/j target 1.5')


ARM = [f'fr3_joint{i}' for i in range(1, 8)]
DROID = {
    'robot': 'droid', 'profile_options': '{velocity: true}',
    'cameras': ['front'], 'camera_slots': ['base_0_rgb'],
    'joints': ARM + ['gripper'], 'action_rate_hz': 10.0, 'output_groups': ['arm', 'gripper'],
    'outputs.arm.topic': 'arm/joint_trajectory', 'outputs.arm.joints': ARM,
    'outputs.arm.indices': list(range(7)),
    'outputs.gripper.topic': 'gripper/joint_trajectory', 'outputs.gripper.joints': ['gripper'],
    'outputs.gripper.indices': [7],
}


def test_a_real_robot_without_limits_is_refused_unless_allowed_on_purpose():
    # A real arm without bounds takes whatever a wrong checkpoint says, at any speed.
    with pytest.raises(StartError, match=r"robot droid has no joint_limits: give its joints' "
                       r'limits \(config/droid.yaml has them for the stock robot\), or set '
                       r'allow_unlimited: true'):
        Config.from_values(DROID)
    c = Config.from_values({**DROID, 'allow_unlimited': True})
    assert c.limits is None
    # The identity profile (no robot's conventions: tests, tools) needs none.
    assert Config.from_values({**DROID, 'robot': 'identity', 'profile_options': ''}).limits is None
    assert describe(None, ARM) == ('joint limits: none (commanded positions and speeds are '
                                   'not bounded)')


def test_limits_from_parameters():
    c = Config.from_values({**DROID, 'limit_hold_margin': 0.25,
                            'joint_limits.arm.fr3_joint2.lower': -1,
                            'joint_limits.arm.fr3_joint2.upper': 1.5,
                            'joint_limits.arm.fr3_joint2.velocity': 2,
                            'joint_limits.arm.fr3_joint2.acceleration': 10,
                            'joint_limits.arm.fr3_joint2.jerk': 5000.5,
                            'joint_limits.gripper.gripper.velocity': 0.5})
    lim = c.limits
    assert (lim.lower[1], lim.upper[1], lim.speed[1]) == (-1.0, 1.5, 2.0)
    assert (lim.accel[1], lim.jerk[1]) == (10.0, 5000.5)
    assert lim.accel[7] == math.inf and lim.jerk[7] == math.inf  # a speed only
    assert lim.speed[7] == 0.5 and lim.lower[7] == -math.inf
    assert lim.margin[1] == pytest.approx(0.625)
    assert list(lim.index) == [1, 7]
    names = [f'arm/{j}' for j in ARM] + ['gripper/gripper']
    assert describe(lim, names) == (
        'joint limits on 2 of 8 joints (a target beyond a limit by more than 0.25 of its '
        'range holds); none on arm/fr3_joint1, arm/fr3_joint3, arm/fr3_joint4, arm/fr3_joint5, '
        'arm/fr3_joint6, arm/fr3_joint7')


@pytest.mark.parametrize('given, message', [
    ({'joint_limits.hand.fr3_joint1.lower': 0.0},
     "joint_limits.hand.fr3_joint1.lower: 'hand' is not an output group"),
    ({'joint_limits.arm.gripper.velocity': 1.0},
     "joint_limits.arm.gripper.velocity: arm does not command 'gripper'"),
    ({'joint_limits.arm.fr3_joint1.lower': 1.0, 'joint_limits.arm.fr3_joint1.upper': 1.0},
     'joint_limits.arm.fr3_joint1: lower 1 must be below upper 1'),
    ({'joint_limits.arm.fr3_joint1.lower': 2.0, 'joint_limits.arm.fr3_joint1.upper': 1.0},
     'joint_limits.arm.fr3_joint1: lower 2 must be below upper 1'),
    ({'joint_limits.arm.fr3_joint1.velocity': 0.0},
     'joint_limits.arm.fr3_joint1.velocity must be > 0, got 0'),
    ({'joint_limits.arm.fr3_joint1.velocity': -2.0},
     'joint_limits.arm.fr3_joint1.velocity must be > 0, got -2'),
    ({'joint_limits.arm.fr3_joint1.upper': math.inf, 'joint_limits.arm.fr3_joint1.lower': 0.0},
     'joint_limits.arm.fr3_joint1.upper must be finite, got inf'),
    ({'joint_limits.arm.fr3_joint1.velocity': math.nan},
     'joint_limits.arm.fr3_joint1.velocity must be finite, got nan'),
    ({'joint_limits.arm.fr3_joint1.acceleration': 0.0},
     'joint_limits.arm.fr3_joint1.acceleration must be > 0, got 0'),
    ({'joint_limits.arm.fr3_joint1.jerk': -5.0},
     'joint_limits.arm.fr3_joint1.jerk must be > 0, got -5'),
    ({'joint_limits.arm.fr3_joint1.acceleration': math.inf},
     'joint_limits.arm.fr3_joint1.acceleration must be finite, got inf'),
    ({'joint_limits.arm.fr3_joint1.jerk': True},
     'joint_limits.arm.fr3_joint1.jerk must be a number, got True'),
    ({'joint_limits.arm.fr3_joint1.accel': 10.0},
     r'joint_limits.arm.fr3_joint1.accel: expected joint_limits.<group>.<joint>.lower, .upper, '
     r'.velocity, .acceleration or .jerk'),
    ({'joint_limits.arm.fr3_joint1.lower': -1.0},
     'joint_limits.arm.fr3_joint1: lower and upper go together'),
    ({'joint_limits.arm.fr3_joint1.lowr': -1.0},
     r'joint_limits.arm.fr3_joint1.lowr: expected joint_limits.<group>.<joint>.lower'),
    ({'joint_limits.arm.fr3_joint1': [-1.0, 1.0]},
     r'joint_limits.arm.fr3_joint1: expected joint_limits.<group>.<joint>.lower'),
    ({'joint_limits': '{arm: {}}'}, r'joint_limits: expected joint_limits.<group>'),
    ({'joint_limits.arm.fr3_joint1.velocity': 'fast'},
     "joint_limits.arm.fr3_joint1.velocity must be a number, got 'fast'"),
    ({'limit_hold_margin': -0.1}, 'parameter limit_hold_margin must be >= 0'),
])
def test_limit_mistakes_are_start_errors(given, message):
    with pytest.raises(StartError, match=message.replace('(', r'\(').replace(')', r'\)')):
        Config.from_values({**DROID, **given})


def test_an_action_limited_twice_is_an_error():
    groups = [type('G', (), dict(name='a', joints=['x'], indices=[3]))(),
              type('G', (), dict(name='b', joints=['y'], indices=[3]))()]
    with pytest.raises(ValueError, match='action index 3 is limited already as a/x'):
        parse_limits({'joint_limits.a.x.velocity': 1.0, 'joint_limits.b.y.velocity': 1.0},
                     groups)



def robot_file(name):
    return flatten(yaml.safe_load((ROOT / 'config' / name).read_text())['/**']['ros__parameters'])


def test_shipped_droid_limits_are_franka_and_robotiq():
    lim = Config.from_values(robot_file('droid.yaml')).limits
    # franka_description robots/fr3/joint_limits.yaml; robotiq_2f_85_macro.urdf.xacro.
    np.testing.assert_array_equal(lim.lower, [-2.7437, -1.7837, -2.9007, -3.0421, -2.8065,
                                              0.5445, -3.0159, 0.0])
    np.testing.assert_array_equal(lim.upper, [2.7437, 1.7837, 2.9007, -0.1518, 2.8065,
                                              4.5169, 3.0159, 0.8])
    np.testing.assert_array_equal(lim.speed, [2.62, 2.62, 2.62, 2.62, 5.26, 4.18, 5.26, 0.5])
    # libfranka include/franka/rate_limiting.h: 10 rad/s^2 and 5000 rad/s^3, less its
    # kLimitEps 1e-3; the Robotiq states no acceleration.
    np.testing.assert_allclose(lim.accel, [10 - 1e-3] * 7 + [math.inf])
    np.testing.assert_allclose(lim.jerk, [5000 - 1e-3] * 7 + [math.inf])


def test_shipped_aloha_limits_are_the_vx300s():
    lim = Config.from_values(robot_file('aloha.yaml')).limits
    # aloha_vx300s.urdf.xacro: pi - 1e-5 for the rolls, degrees for the rest, pi rad/s.
    rad = math.radians
    arm_lo = [-math.pi + 1e-5, rad(-106), rad(-101), -math.pi + 1e-5, rad(-107),
              -math.pi + 1e-5]
    arm_hi = [math.pi - 1e-5, rad(72), rad(92), math.pi - 1e-5, rad(128), math.pi - 1e-5]
    for arm in (slice(0, 6), slice(7, 13)):
        np.testing.assert_allclose(lim.lower[arm], arm_lo, atol=1e-8)
        np.testing.assert_allclose(lim.upper[arm], arm_hi, atol=1e-8)
    np.testing.assert_allclose(lim.speed, math.pi, atol=1e-8)
    # Interbotix states no acceleration or jerk the arm enforces.
    assert np.all(lim.accel == math.inf) and np.all(lim.jerk == math.inf)
    # The gripper servo: a speed, no position range.
    for g in (6, 13):
        assert lim.lower[g] == -math.inf and lim.upper[g] == math.inf


def test_shipped_sim_starts_inside_its_limits():
    params = robot_file('sim.yaml')
    lim = Config.from_values(params).limits
    assert len(lim) == 8
    q = np.array(params['initial_positions'])
    assert np.all(q >= lim.lower) and np.all(q <= lim.upper)
    assert lim.outside(q) == []
