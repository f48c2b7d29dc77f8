"""The motion a controller makes of what the node publishes, within every shipped robot's
limits, at its peak and between points, not only at the points.

For each robot file in config/ with joint_limits, adversarial action chunks (white noise,
step jumps, oscillations, targets slightly and far out of range, holds mid-motion) go
through the node's own Player and joint limits at the node's control rate. The controller
is modelled here, independently of oxygen_ros, as joint_trajectory_controller (Jazzy)
moves with positions and velocities given and no accelerations: each received trajectory
starts from its current state (position and velocity, the measured ones, here the motion
so far: perfect tracking) and goes through the points along a cubic per segment, as
ros-controls/ros2_controllers, commit 94e74de35f9d04f313aca8f29df66c3a76004aa7,
joint_trajectory_controller/src/trajectory.cpp, Trajectory::interpolate_between_points
(the has_velocity && !has_accel case) computes it; after the last point it stays there.
Every published trajectory is sampled densely over its whole length (what the controller
executes if no other follows), and checked against the limits as the robot file gives them
(read from the YAML here, not through the code): position range, speed, acceleration and
the jerk inside each segment.
"""

import numpy as np
import pytest
import yaml
from support.paths import ROOT  # noqa: E402

from oxygen_ros.robot.contract import Config
from oxygen_ros.robot.params import flatten
from oxygen_ros.robot.playback import Player, make_chunk

# Relative slack for rounding; time_from_start is not truncated to nanoseconds here.
TOL = 1e-6



def robot_files():
    out = []
    for path in sorted((ROOT / 'config').glob('*.yaml')):
        doc = yaml.safe_load(path.read_text())
        params = (doc or {}).get('/**', {}).get('ros__parameters', {})
        if 'joint_limits' in params:
            out.append(path.name)
    return out


def yaml_limits(params):
    """{action index: {key: value}} as the robot file states them."""
    out = {}
    for g, joints in params['joint_limits'].items():
        names = params['outputs'][g]['joints']
        idx = params['outputs'][g]['indices']
        for j, lim in joints.items():
            out[idx[names.index(j)]] = {k: float(v) for k, v in lim.items()}
    return out


def cubic(p0, v0, p1, v1, T):
    """Coefficients c0..c3 (per joint) of the controller's cubic over a segment of T s."""
    c2 = (-3 * p0 + 3 * p1 - 2 * v0 * T - v1 * T) / T ** 2
    c3 = (2 * p0 - 2 * p1 + v0 * T + v1 * T) / T ** 3
    return p0, v0, c2, c3


def evaluate(c, t):
    c0, c1, c2, c3 = c
    return (c0 + c1 * t + c2 * t ** 2 + c3 * t ** 3, c1 + 2 * c2 * t + 3 * c3 * t ** 2,
            2 * c2 + 6 * c3 * t, 6 * c3 + 0 * t)


class Controller:
    """The trajectory being executed: start state at `t0`, then the published points."""

    def __init__(self, q):
        self.t0, self.segments = 0.0, []
        self.rest = np.asarray(q, dtype=float)

    def state(self, t):
        """(position, velocity) at t."""
        tau = t - self.t0
        for (a, b, c) in self.segments:
            if a <= tau < b:
                p, v, _, _ = evaluate(c, tau - a)
                return p, v
        return self.rest.copy(), np.zeros_like(self.rest)

    def receive(self, t, times, positions, velocities):
        p, v = self.state(t)
        self.t0, self.segments = t, []
        ta = 0.0
        for tb, p1, v1 in zip(times, positions, velocities, strict=True):
            self.segments.append((ta, tb, cubic(p, v, p1, v1, tb - ta)))
            ta, p, v = tb, p1, v1
        self.rest = positions[-1].copy()

    def samples(self, n=64):
        """Position, velocity, acceleration and jerk sampled along the whole trajectory
        (both ends of every segment included)."""
        out = [[], [], [], []]
        for (a, b, c) in self.segments:
            for x, y in zip(out, evaluate(c, np.linspace(0.0, b - a, n)[:, None]),
                            strict=True):
                x.append(y)
        return [np.concatenate(x) for x in out]


def chunks(rng, kind, lo, hi, n):
    """[n, dim] targets of one adversarial kind; lo, hi: the range to play in."""
    span = hi - lo
    mid = (lo + hi) / 2
    dim = len(lo)
    i = np.arange(n)[:, None]
    if kind == 'random':
        return rng.uniform(lo, hi, (n, dim))
    if kind == 'step':
        a, b = rng.uniform(lo, hi, (2, dim))
        return np.where(i < rng.integers(1, n), a, b)
    if kind == 'oscillate':
        f = rng.uniform(1, 12, dim)
        return mid + rng.uniform(0.1, 0.5) * span * np.sin(2 * np.pi * f * i / 50 + rng.uniform(
            0, 6, dim))
    if kind == 'slightly_out':  # beyond a limit by less than the hold margin: clamped
        return np.where(rng.random(dim) < 0.5, hi + 0.05 * span, lo - 0.05 * span) + 0 * i
    if kind == 'far_out':  # beyond by more than the hold margin: the robot holds
        return np.where(i < n // 2, mid, hi + 0.5 * span)
    raise ValueError(kind)


KINDS = ('random', 'step', 'oscillate', 'slightly_out', 'far_out')


def run(name, seconds=12.0, seed=0):
    """Feed chunks through the node's limiting; the worst ratio of each quantity to its
    limit over everything published, and how many commands and holds were sent."""
    params = flatten(yaml.safe_load((ROOT / 'config' / name).read_text())['/**'][
        'ros__parameters'])
    nested = yaml.safe_load((ROOT / 'config' / name).read_text())['/**']['ros__parameters']
    cfg = Config.from_values(params)
    dim = cfg.profile.action_dim
    stated = yaml_limits(nested)
    lo, hi = np.full(dim, -1.0), np.full(dim, 1.0)  # where an unranged joint is played
    limit = {k: np.full(dim, np.inf) for k in ('lower', 'upper', 'velocity', 'acceleration',
                                               'jerk')}
    limit['lower'][:] = -np.inf
    for i, lim in stated.items():
        for k, v in lim.items():
            limit[k][i] = v
        if 'lower' in lim:
            lo[i], hi[i] = lim['lower'], lim['upper']
    rate = cfg.p.control_rate_hz
    period = cfg.action_period
    player = Player(cfg.p.max_command_horizon, hold_after=1.0 / rate, limits=cfg.limits)
    rng = np.random.default_rng(seed)
    q = rng.uniform(lo + 0.3 * (hi - lo), hi - 0.3 * (hi - lo))
    ctl = Controller(q)
    worst = dict(below=0.0, above=0.0, velocity=0.0, acceleration=0.0, jerk=0.0)
    sent = holds = 0
    travel = np.zeros(dim)  # how far each joint went: the limits must not freeze it
    last = q.copy()
    next_chunk = 0.0
    for tick in range(int(seconds * rate)):
        t = tick / rate
        if t >= next_chunk:
            kind = KINDS[rng.integers(len(KINDS))]
            latency = rng.uniform(0.0, 2 * period)
            player.play(make_chunk(t - latency, period, chunks(rng, kind, lo, hi, 50)))
            next_chunk = t + rng.uniform(0.5, 3) * period
        if rng.random() < 0.01:
            player.stop('stopped mid-motion')
        measured = ctl.state(t)[0]
        travel += np.abs(measured - last)
        last = measured
        cmd = player.tick(t, hold_at=lambda m=measured: m)
        if cmd is None:
            continue
        assert np.all(cmd.velocities[-1] == 0)  # the controller's rule: end at rest
        ctl.receive(t, cmd.times, cmd.positions, cmd.velocities)
        sent += 1
        holds += cmd.hold is not None
        p, v, a, j = ctl.samples()
        span = np.where(np.isfinite(limit['upper'] - limit['lower']),
                        limit['upper'] - limit['lower'], 1.0)
        worst['above'] = max(worst['above'], np.max((p - limit['upper']) / span))
        worst['below'] = max(worst['below'], np.max((limit['lower'] - p) / span))
        for k, x in (('velocity', v), ('acceleration', a), ('jerk', j)):
            worst[k] = max(worst[k], float(np.max(np.abs(x) / limit[k])))
    moved = {i: travel[i] / (hi[i] - lo[i]) for i in stated}
    return worst, sent, holds, stated, moved


# Seed 4 once caught a joint restarted mid-step, by a new command, too close to its limit.
@pytest.mark.parametrize('seed', [0, 4])
@pytest.mark.parametrize('name', robot_files())
def test_published_motion_stays_within_the_limits_at_its_peak(name, seed):
    worst, sent, holds, stated, moved = run(name, seed=seed)
    assert sent > 500 and holds > 5, (sent, holds)
    # Every limited joint goes places: at least its range (or 2 units) in all.
    assert min(moved.values()) > 1.0, moved
    # The range, as a fraction of it, never left (the robot starts inside).
    assert worst['above'] <= TOL and worst['below'] <= TOL, worst
    assert worst['velocity'] <= 1 + TOL, worst
    if any('acceleration' in lim for lim in stated.values()):
        assert worst['acceleration'] <= 1 + TOL, worst
    if any('jerk' in lim for lim in stated.values()):
        assert worst['jerk'] <= 1 + TOL, worst


def test_every_shipped_robot_file_is_checked():
    assert set(robot_files()) >= {'aloha.yaml', 'droid.yaml', 'sim.yaml'}


def test_the_model_is_the_controllers_cubic():
    # A hand case: from rest at 0 to 1 at rest in 1 s: 3t^2 - 2t^3, peak speed 1.5 at 0.5 s,
    # acceleration 6 at the start, jerk -12.
    c = cubic(np.array([0.0]), np.array([0.0]), np.array([1.0]), np.array([0.0]), 1.0)
    p, v, a, j = evaluate(c, np.array([0.0, 0.5, 1.0]))
    np.testing.assert_allclose(p, [0.0, 0.5, 1.0])
    np.testing.assert_allclose(v, [0.0, 1.5, 0.0])
    np.testing.assert_allclose(a, [6.0, 0.0, -6.0])
    np.testing.assert_allclose(j, [-12.0] * 3)
    ctl = Controller([0.0])
    ctl.receive(0.0, np.array([1.0, 2.0]), np.array([[1.0], [1.0]]), np.array([[0.0], [0.0]]))
    assert ctl.state(0.5)[1][0] == pytest.approx(1.5)
    p, v = ctl.state(3.0)  # after the last point: there, at rest
    assert p[0] == 1.0 and v[0] == 0.0
