"""Properties of the player with joint limits, on random chunks, readings and holds.

An arm that follows its controller perfectly (the controller interpolates every trajectory
it gets as joint_trajectory_controller does: aloha_sim's copy of its rules, independent of
limits.py) is driven by the player at 70 Hz for a few seconds: chunks come and go (some far
out of range), the node stops and starts, and readings of the arm come late, stale or not at
all. Whatever happens, every trajectory sent keeps each joint within its range and its
speed limit along the whole motion the controller makes of it, and a hold never jumps.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oxygen_ros.robot.limits import JointLimits, Limit
from oxygen_ros.robot.playback import Player, make_chunk
from oxygen_ros.sim.aloha_sim import hermite

RATE = 70.0
DIM = 2


class Arm:
    """Where a perfectly tracking arm is and was: the controller's setpoint along what it
    got, each trajectory from the state it was in when the trajectory came."""

    def __init__(self, q):
        self.got = []  # (arrival, start position, start velocity, times, pos, vel)
        self.rest = np.array(q, float)

    @property
    def traj(self):
        return self.got[-1] if self.got else None

    def state(self, t):
        """(position, velocity) at t."""
        past = [g for g in self.got if g[0] <= t]
        if not past:
            return self.rest.copy(), np.zeros(DIM)
        t0, p, v, times, pos, vel = past[-1]
        ta = t0
        for tk, q, w in zip(times, pos, vel, strict=True):
            tb = t0 + tk
            if t < tb:
                return hermite(t, ta, p, v, tb, q, w)
            ta, p, v = tb, q, w
        return np.array(p, float), np.zeros(DIM)

    def receive(self, t, cmd):
        p, v = self.state(t)
        self.got.append((t, p, v, cmd.times, cmd.positions, cmd.velocities))


def segments(t, arm):
    """The controller's velocity along its current trajectory, sampled finely."""
    t0, p, v, times, pos, vel = arm.traj
    out = []
    ta, pa, va = t0, p, v
    for tk, q, w in zip(times, pos, vel):
        for s in np.linspace(ta, t0 + tk, 25):
            out.append(hermite(s, ta, pa, va, t0 + tk, q, w)[1])
        ta, pa, va = t0 + tk, q, w
    return np.array(out)


scenario = st.fixed_dictionaries({
    'speed': st.lists(st.floats(0.2, 3.0), min_size=DIM, max_size=DIM),
    'accel': st.one_of(st.none(), st.floats(2.0, 50.0)),
    'chunks': st.lists(st.lists(st.lists(st.floats(-2.0, 2.0), min_size=DIM, max_size=DIM),
                                min_size=2, max_size=8), min_size=1, max_size=6),
    # Per tick: 0 nothing new, 1 a reading, 2 a stale stream (no reading), 3 stop
    'events': st.lists(st.sampled_from([0, 1, 1, 1, 2, 3]), min_size=60, max_size=200),
    'age': st.floats(0.0, 0.3),
})


def scenario_limits(sc) -> JointLimits:
    """A scenario's limits on [-1, 1], its speeds and accelerations; a hold margin so wide
    that every target is clamped and played, never held."""
    lims = {i: (f'g/j{i}', Limit(-1.0, 1.0, sc['speed'][i],
                                 np.inf if sc['accel'] is None else sc['accel']))
            for i in range(DIM)}
    return JointLimits(DIM, lims, 1000.0)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario)
def test_every_command_stays_in_range_and_speed_and_holds_never_jump(sc):
    player = Player(horizon=0.5, hold_after=1 / RATE, limits=scenario_limits(sc))
    arm = Arm(np.zeros(DIM))
    speed = np.array(sc['speed'])
    # (positions, stamps) the node holds, or None. A chunk comes from a frame, and a frame
    # needs a reading: the first is of the arm at rest.
    reading = (np.zeros(DIM), np.full(DIM, 1.0))
    chunks = list(sc['chunks'])
    for k, ev in enumerate(sc['events']):
        t = 1.0 + k / RATE
        if k % 7 == 0 and chunks:
            player.play(make_chunk(t - 0.02, 0.1, chunks.pop(0)))
        if ev == 1:
            at = max(t - sc['age'], 1.0)
            reading = (arm.state(at)[0], np.full(DIM, at))
        elif ev == 2:
            reading = None
        elif ev == 3:
            player.stop('stopped')
        got = reading if reading is not None else (np.full(DIM, np.nan), np.full(DIM, np.nan))
        cmd = player.tick(t, hold_at=lambda g=got: g)
        if cmd is None:
            continue
        if not np.all(np.isfinite(cmd.positions)):
            # No target: only a hold with nothing sent and no fresh reading (not published).
            assert cmd.hold and arm.traj is None, cmd
            continue
        q, _ = arm.state(t)
        arm.receive(t, cmd)
        assert np.all(np.abs(cmd.positions) <= 1.0 + 1e-9), cmd.positions
        v = segments(t, arm)
        assert np.all(np.abs(v) <= speed * (1 + 1e-6) + 1e-9), (cmd, np.abs(v).max(0))
        if cmd.hold:
            # Where the arm is: no further than one control period at the speed limit.
            assert np.all(np.abs(cmd.positions[0] - q) <= speed / RATE + 1e-9), (cmd, q)


open_loop_scenario = st.fixed_dictionaries({
    'speed': st.lists(st.floats(0.2, 3.0), min_size=DIM, max_size=DIM),
    'accel': st.one_of(st.none(), st.floats(2.0, 50.0)),
    # How far the arm lags its setpoint (a servo's tracking error), per joint.
    'lag': st.lists(st.floats(-0.2, 0.2), min_size=DIM, max_size=DIM),
    'keep': st.lists(st.booleans(), min_size=DIM, max_size=DIM),
    'chunks': st.lists(st.lists(st.lists(st.floats(-0.9, 0.9), min_size=DIM, max_size=DIM),
                                min_size=2, max_size=8), min_size=1, max_size=4),
    'events': st.lists(st.sampled_from([0, 1, 1, 1, 2, 3]), min_size=40, max_size=120),
})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(open_loop_scenario)
def test_open_loop_holds_start_at_the_setpoint_within_the_limits(sc):
    """JTC with open_loop_control starts every trajectory from its last command, so that is
    where a hold must start, whatever the readings say (the arm lags its setpoint): every
    hold path (stopped, stale, used up) lands within one control period at the speed limit
    of where the controller is, and its whole motion keeps the speed limit."""
    player = Player(horizon=0.5, hold_after=1 / RATE, limits=scenario_limits(sc),
                    open_loop=True, keep=np.array(sc['keep']))
    arm = Arm(np.zeros(DIM))  # the controller's setpoint, from its last command
    speed, lag = np.array(sc['speed']), np.array(sc['lag'])
    reading = (np.zeros(DIM), np.full(DIM, 1.0))
    chunks = list(sc['chunks'])
    for k, ev in enumerate(sc['events']):
        t = 1.0 + k / RATE
        if k % 7 == 0 and chunks:
            player.play(make_chunk(t - 0.02, 0.1, chunks.pop(0)))
        if ev == 1:  # the arm read where it is: behind its setpoint by the lag once it
            # follows commands (before the first, JTC starts from the state it read)
            behind = lag if arm.traj is not None else 0.0
            reading = (arm.state(t)[0] - behind, np.full(DIM, t))
        elif ev == 2:
            reading = None
        elif ev == 3:
            player.stop('stopped')
        got = reading if reading is not None else (np.full(DIM, np.nan), np.full(DIM, np.nan))
        cmd = player.tick(t, hold_at=lambda g=got: g)
        if cmd is None or not np.all(np.isfinite(cmd.positions)):
            continue
        q, _ = arm.state(t)
        arm.receive(t, cmd)
        v = segments(t, arm)
        assert np.all(np.abs(v) <= speed * (1 + 1e-6) + 1e-9), (cmd, np.abs(v).max(0))
        if cmd.hold:
            assert np.all(np.abs(cmd.positions[0] - q) <= speed / RATE + 1e-9), (cmd, q, lag)


@pytest.mark.parametrize('age', [0.0, 0.05, 0.3])
def test_a_hold_after_the_stream_stopped_is_where_the_arm_is(age):
    """The reading stops mid-motion: the hold lands where the tracking arm is, not where it
    was last read (which would be a jump of the distance it moved since)."""
    limits = JointLimits(DIM, {i: (f'g/j{i}', Limit(-5, 5, 10.0)) for i in range(DIM)}, 1.0)
    player = Player(horizon=0.5, hold_after=1 / RATE, limits=limits)
    arm = Arm(np.zeros(DIM))
    player.play(make_chunk(1.0, 0.1, [[0.1 * i, -0.1 * i] for i in range(1, 20)]))
    last = None
    for k in range(70):
        t = 1.0 + k / RATE
        if t < 1.5:
            last = (arm.state(t - age)[0], np.full(DIM, t - age))
        if k == 50:
            player.stop('inputs stale')
        cmd = player.tick(t, hold_at=lambda g=last: g)
        if cmd is None:
            continue
        q, _ = arm.state(t)
        arm.receive(t, cmd)
        if cmd.hold:
            assert np.abs(q - last[0]).max() > 0.1  # the arm moved on since its reading
            assert np.abs(cmd.positions[0] - q).max() < 1e-6, (cmd.positions, q)
            return
    pytest.fail('no hold')



def paths(c, n):
    """The controller's cubic over each segment of chunk `c`, sampled at n points: [segment]
    -> positions [n, dim]."""
    s = np.linspace(0.0, c.period, n)
    return [hermite(s, 0.0, c.positions[i], c.velocities[i], c.period, c.positions[i + 1],
                    c.velocities[i + 1])[0] for i in range(len(c.positions) - 1)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-3.0, 3.0), min_size=1, max_size=12), st.floats(0.01, 0.5))
def test_the_cubic_between_two_points_stays_between_them(xs, period):
    """What a chunk's velocities make of it under the controller's cubic never goes beyond
    the two points of a segment: a gripper stepping to closed never passes closed, and a
    joint never passes the extreme of what was commanded (central differences did both)."""
    c = make_chunk(0.0, period, np.array(xs)[:, None])
    for i, p in enumerate(paths(c, 101)):
        lo, hi = min(xs[i], xs[i + 1]), max(xs[i], xs[i + 1])
        assert np.all((p >= lo - 1e-9) & (p <= hi + 1e-9)), (i, xs, p.min(), p.max())


def test_a_binarised_gripper_step_never_passes_closed():
    closed = 0.8
    c = make_chunk(0.0, 0.1, [[0.0], [0.0], [closed], [closed], [closed]])
    p = np.concatenate(paths(c, 51))
    assert p.max() <= closed + 1e-12 and p.min() >= -1e-12
