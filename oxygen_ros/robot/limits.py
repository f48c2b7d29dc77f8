"""Joint limits on what the node commands, without ROS.

joint_trajectory_controller does not enforce joint limits, so the node does, on every point
it publishes, and on the motion between points: given positions and velocities, the
controller moves along a cubic Hermite spline from its current state (position and
velocity) to the first point and from each point to the next. Each target is clamped into
[lower, upper]; its velocity is the chunk's own, limited so that the cubic stays monotone
between two points (it never overshoots a point, and so never a limit the points respect);
and each cubic is checked at its peak: speed, acceleration and (constant inside a segment)
jerk within the joint's limits, and the joint still able to stop before its range ends and
by the last point, which is at rest. A point that fails is moved: from where the point
before left the joint, a segment of constant acceleration (velocity linear, so its peak is
at an end) as close to the target as the limits allow while it can still stop at the
target. A target (or a measured position) beyond a limit by more than the hold margin is
not clamped: the model's actions, or the limits, do not fit this robot, and the robot holds
instead (braking within the limits where it moves).

Limits are per action index (the action dim a controller joint is driven by); arrays hold
-inf / inf where a joint has no limit.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np

KEYS = ('lower', 'upper', 'velocity', 'acceleration', 'jerk')
# Relative slack of the peak checks, for rounding only.
TOL = 1e-9
# Up to this many points x joints, apply() checks each point as it places it, in floats;
# above, all at once with numpy first. Checking all at once costs about as much as 50 checks
# one by one and saves those of the points that fit; a moving joint is placed from its first
# points on (DROID's 8 x 8 every tick it moves: some 50 us less per tick one by one), a
# joint at rest on its targets not at all (some 50 us more).
SMALL = 64


@dataclass(frozen=True)
class Limit:
    lower: float = -math.inf
    upper: float = math.inf
    velocity: float = math.inf  # largest speed, units/s
    acceleration: float = math.inf  # units/s^2
    jerk: float = math.inf  # units/s^3


@dataclass(frozen=True)
class Finding:
    """Something the limits changed or saw, to report: kind 'position' (a target beyond a
    limit, clamped), 'speed' (steps too fast, shortened) or 'measured' (the robot is
    measured beyond a limit)."""

    kind: str
    joint: str  # group/joint
    amount: float  # by how much, in the joint's units
    text: str


@dataclass
class Limited:
    positions: np.ndarray
    velocities: np.ndarray
    findings: list[Finding] = field(default_factory=list)


def parse_limits(values: dict[str, object], groups) -> dict[int, tuple[str, Limit]]:
    """{action index: (group/joint, Limit)} from parameters named
    joint_limits.<group>.<joint>.<lower|upper|velocity|acceleration|jerk> (what a nested
    YAML mapping under joint_limits becomes). groups: objects with name, joints and
    indices. ValueError names the first parameter that is wrong."""
    by_group = {g.name: g for g in groups}
    entries: dict[tuple[str, str], dict[str, float]] = {}
    for name, value in values.items():
        parts = name.split('.')
        if len(parts) != 4 or parts[0] != 'joint_limits' or parts[3] not in KEYS:
            raise ValueError(f'{name}: expected joint_limits.<group>.<joint>.lower, .upper, '
                             '.velocity, .acceleration or .jerk')
        _, group, joint, key = parts
        g = by_group.get(group)
        if g is None:
            raise ValueError(f'{name}: {group!r} is not an output group; output_groups: '
                             f'{list(by_group)}')
        if joint not in g.joints:
            raise ValueError(f'{name}: {group} does not command {joint!r}; its joints: '
                             f'{list(g.joints)}')
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f'{name} must be a number, got {value!r}')
        if not math.isfinite(value):
            raise ValueError(f'{name} must be finite, got {value}')
        entries.setdefault((group, joint), {})[key] = float(value)
    out = {}
    for (group, joint), e in entries.items():
        where = f'joint_limits.{group}.{joint}'
        if ('lower' in e) != ('upper' in e):
            raise ValueError(f'{where}: lower and upper go together (a position range)')
        if 'lower' in e and e['lower'] >= e['upper']:
            raise ValueError(f'{where}: lower {e["lower"]:g} must be below upper '
                             f'{e["upper"]:g}')
        for key in ('velocity', 'acceleration', 'jerk'):
            if key in e and e[key] <= 0:
                raise ValueError(f'{where}.{key} must be > 0, got {e[key]:g}')
        g = by_group[group]
        index = g.indices[g.joints.index(joint)]
        if index in out:
            raise ValueError(f'{where}: action index {index} is limited already as '
                             f'{out[index][0]}; limit it once')
        out[index] = (f'{group}/{joint}', Limit(**e))
    return out


class JointLimits:
    """Position, speed, acceleration and jerk limits per action index, and what they do to a
    command.

    hold_margin: a fraction of a joint's range (upper - lower); a target or measured
    position beyond a limit by more than that is a reason to hold rather than clamp.
    """

    def __init__(self, dim: int, limits: dict[int, tuple[str, Limit]], hold_margin: float):
        if hold_margin < 0:
            raise ValueError(f'hold_margin must be >= 0, got {hold_margin}')
        self.lower = np.full(dim, -np.inf)
        self.upper = np.full(dim, np.inf)
        self.speed = np.full(dim, np.inf)
        self.accel = np.full(dim, np.inf)
        self.jerk = np.full(dim, np.inf)
        self.names = {}
        for i, (name, lim) in limits.items():
            self.lower[i], self.upper[i], self.speed[i] = lim.lower, lim.upper, lim.velocity
            self.accel[i], self.jerk[i] = lim.acceleration, lim.jerk
            self.names[i] = name
        self.index = np.array(sorted(limits), dtype=np.int64)
        # What apply() needs of the limited joints, made once (the arrays are not changed
        # after this): the limits, and those the peak checks compare with (_Checks).
        self._lim = self._at(self.index)
        self._checks = _Checks(self._lim)
        self.hold_margin = hold_margin
        self.rates = {i: self._rates(i) for i in limits}  # for the findings' text
        span = self.upper - self.lower
        self.margin = np.full(dim, np.inf)
        ranged = np.isfinite(span)
        self.margin[ranged] = hold_margin * span[ranged]

    def __len__(self) -> int:
        return len(self.index)

    def eased(self, factor: float) -> JointLimits:
        """These limits with `factor` (0..1] of each acceleration and jerk limit: room
        left for what a plan cannot know (how late a command reaches the controller)."""
        if not 0 < factor <= 1:
            raise ValueError(f'factor must be in (0, 1], got {factor}')
        out = copy.copy(self)
        out.accel, out.jerk = self.accel * factor, self.jerk * factor
        out._lim = out._at(out.index)
        out._checks = _Checks(out._lim)
        out.rates = {i: out._rates(i) for i in self.names}
        return out

    def _beyond(self, x: np.ndarray) -> np.ndarray:
        """How far x lies outside [lower, upper], per element (<= 0 inside)."""
        return np.maximum(x - self.upper, self.lower - x)

    def too_far(self, targets: np.ndarray, measured: np.ndarray | None) -> str | None:
        """Why the robot must hold instead of being clamped (a hold reason), or None.

        targets: [m, dim] the positions still to be played; measured: [dim] where the robot
        is (NaN where unknown)."""
        for what, x, cause in (
                ('target', np.asarray(targets, dtype=np.float64).reshape(-1, len(self.lower)),
                 "the model's actions do not fit this robot"),
                ('measured position', None if measured is None
                 else np.asarray(measured, dtype=np.float64)[None],
                 'the limits do not fit this robot')):
            if x is None or not len(x):
                continue
            over = self._beyond(x) - self.margin
            over[~np.isfinite(over)] = -np.inf  # NaN: not measured; inf margin: no range
            if not (over > 0).any():
                continue
            k, i = np.unravel_index(np.argmax(over), over.shape)
            if over[k, i] > 0:
                return (f'joint limits: {self.names[i]} {what} {self._side(i, x[k, i])}, more '
                        f'than the hold margin {self.margin[i]:.4g} '
                        f'({self.hold_margin:g} of its range): {cause}')
        return None

    def _side(self, i: int, x: float) -> str:
        if x > self.upper[i]:
            return f'{x:.4g}, above its upper limit {self.upper[i]:.4g} by {x - self.upper[i]:.3g}'
        return f'{x:.4g}, below its lower limit {self.lower[i]:.4g} by {self.lower[i] - x:.3g}'

    def outside(self, measured: np.ndarray) -> list[Finding]:
        """The joints measured beyond a limit (a hold keeps them where they are)."""
        x = np.asarray(measured, dtype=np.float64)
        over = self._beyond(x)  # NaN (not measured) compares False
        return [Finding('measured', self.names[i], float(over[i]),
                        f'joint limits: {self.names[i]} measured at {self._side(i, x[i])}')
                for i in self.index if over[i] > 0]

    def apply(self, times: np.ndarray, positions: np.ndarray, velocities: np.ndarray,
              measured: np.ndarray | None, moving: np.ndarray | None = None,
              step: float = 0.0) -> Limited:
        """The points at `times` (s from now, increasing, > 0) limited, for the limited
        joints (the others keep theirs; all end at rest). The motion starts at time 0 at
        `measured` (NaN or None where unknown: the first point is then only clamped, at
        rest) moving at `moving` (the controller's velocity now; None or NaN: 0); `step`: the
        longest first step a later command may have (its points' spacing). Positions
        in range; velocities the given ones where the cubic through them stays monotone and
        within the limits at its peak; points moved where it would not (see the module
        docstring). A joint measured beyond its range is led back within its limits: its
        first points lie outside until it is in."""
        times = np.asarray(times, dtype=np.float64)
        pos = np.array(positions, dtype=np.float64)
        vel = np.array(velocities, dtype=np.float64)
        vel[-1] = 0.0
        idx = self.index
        if not len(idx):
            return Limited(pos, vel)
        lim = self._lim
        lo, hi = lim[0], lim[1]
        start = (np.full(len(idx), np.nan) if measured is None
                 else np.asarray(measured, dtype=np.float64)[idx])
        unknown = np.isnan(start)
        w = (np.zeros(len(idx)) if moving is None
             else np.asarray(moving, dtype=np.float64)[idx].copy())
        w[~np.isfinite(w) | unknown] = 0.0
        raw = pos[:, idx]
        goal = np.minimum(np.maximum(raw, lo), hi)  # np.clip, without its wrapper's cost
        h = np.empty((len(times), 1))  # the steps, the first from time 0
        h[0, 0] = times[0]
        h[1:, 0] = times[1:] - times[:-1]
        reach = max(float(h.max()), step)  # the longest step a command may start with
        with np.errstate(invalid='ignore', divide='ignore'):
            cap = _cap(times, lim[2], lim[3])
            # The mean speed of each step, the first from `start`.
            s = np.empty_like(goal)
            s[0] = goal[0] - start
            s[1:] = goal[1:] - goal[:-1]
            s /= h
            want = _monotone(vel[:, idx], s)
            want[0, unknown] = 0.0  # nothing to step from: the first point stands, at rest
            # Each point as targeted, with its velocity, checked as the controller will move
            # between them; only when one fails are the points after it placed in turn (each
            # depends on where the one before ended). A few points are checked one by one
            # as they are placed (numpy's cost per call outweighs them); many, all at once
            # first.
            if goal.size <= SMALL:
                ok = np.zeros(goal.shape, dtype=bool)
                ok[0] = unknown
            else:
                v0 = np.empty_like(want)
                v0[0] = w
                v0[1:] = want[:-1]
                ok = _fits(s, v0, goal, want, h, cap, reach, self._checks)
                ok[0] |= unknown
            out, v = goal, want
            if not ok.all():
                out, v = _place(ok, goal, want, h, cap, reach, start, w, self._checks)
        pos[:, idx] = out
        vel[:, idx] = v
        findings = []
        over = np.maximum(raw - hi, lo - raw)
        beyond = over.max(axis=0)
        slowed = np.abs(out - goal).max(axis=0) if out is not goal else np.zeros(len(idx))
        for j in np.flatnonzero((beyond > 0) | (slowed > 0)).tolist():
            i = int(idx[j])
            name = self.names[i]
            if beyond[j] > 0:
                k = int(np.argmax(over[:, j]))
                findings.append(Finding('position', name, float(beyond[j]),
                                        f'joint limits: {name} target {self._side(i, raw[k, j])};'
                                        f' clamped into [{lo[j]:.4g}, {hi[j]:.4g}]'))
            if slowed[j] > 0:
                findings.append(Finding('speed', name, float(slowed[j]),
                                        f'joint limits: {name} targets move faster than '
                                        f'{self.rates[i]} allow; held back by up to '
                                        f'{slowed[j]:.4g}'))
        if measured is not None:
            findings += self.outside(measured)
        return Limited(pos, vel, findings)

    def stop(self, at: np.ndarray, moving: np.ndarray | None, step: float,
             horizon: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(times, positions, velocities) of a hold: where the robot is (`at`, [dim]), at
        rest `step` s from now; a limited joint that is `moving` ([dim], the controller's
        velocity now) brakes within its limits instead, as hard as they allow, points `step`
        apart, no further ahead than `horizon` (the last at rest). Never clamped into range:
        a hold must not move the robot anywhere but to a stop."""
        at = np.asarray(at, dtype=np.float64)
        idx = self.index
        w = (np.zeros(len(idx)) if moving is None
             else np.asarray(moving, dtype=np.float64)[idx].copy())
        # A joint without an acceleration limit stops where it is, as holds always did: only
        # a limited one needs the braking points (and would otherwise drift half a step).
        w[~np.isfinite(w) | ~np.isfinite(at[idx]) | ~np.isfinite(self.accel[idx])] = 0.0
        if not np.any(w):
            return np.array([step]), at[None].copy(), np.zeros((1, len(at)))
        lim = self._at(idx)
        with np.errstate(invalid='ignore', divide='ignore'):
            need = float(np.max(np.where(np.isfinite(lim[3]), np.abs(w) / lim[3], 0.0)))
            m = max(1, min(int(horizon / step + 1e-9), math.ceil(need / step - 1e-9) + 1))
            times = step * np.arange(1, m + 1)
            cap = _cap(times, lim[2], lim[3])
            pos = np.repeat(at[None], m, axis=0)
            vel = np.zeros((m, len(at)))
            # Joint by joint, in floats (a joint at rest stays where it is).
            for j in np.flatnonzero(w).tolist():
                i = int(idx[j])
                p, q, a = float(at[i]), float(w[j]), float(lim[3][j]) * step
                ps, vs = [], []
                for c in cap[:, j].tolist():
                    # As hard as allowed: it keeps the room _reach says the command before
                    # left, from anywhere on the way.
                    q1 = (q - a if q > 0 else q + a) if abs(q) > a else 0.0
                    q1 = (-c if q1 < -c else c if q1 > c else q1) if c > 0 else 0.0
                    p, q = p + step * (q + q1) / 2, q1
                    ps.append(p)
                    vs.append(q)
                pos[:, i], vel[:, i] = ps, vs
        return times, pos, vel

    def _at(self, idx):
        return (self.lower[idx], self.upper[idx], self.speed[idx], self.accel[idx],
                self.jerk[idx])

    def _rates(self, i: int) -> str:
        parts = [f'{self.speed[i]:.4g}/s']
        if np.isfinite(self.accel[i]):
            parts.append(f'{self.accel[i]:.4g}/s^2')
        if np.isfinite(self.jerk[i]):
            parts.append(f'{self.jerk[i]:.4g}/s^3')
        return ', '.join(parts)


def describe(limits: JointLimits | None, names: list[str]) -> str:
    """One line for the start-up log. names: the commanded joints, as group/joint."""
    if limits is None:
        return 'joint limits: none (commanded positions and speeds are not bounded)'
    free = [n for n in names if n not in limits.names.values()]
    text = (f'joint limits on {len(limits)} of {len(names)} joints (a target beyond a limit '
            f'by more than {limits.hold_margin:g} of its range holds)')
    return text + (f'; none on {", ".join(free)}' if free else '')


def _segment(t, start, moving, times, positions, velocities):
    """The cubic Hermite segment joint_trajectory_controller is on at t (s from the start of
    a command): (u in [0, 1), its length h, and the end points' positions and velocities)."""
    start = np.asarray(start, dtype=np.float64)
    w = np.zeros_like(start) if moving is None else np.asarray(moving, dtype=np.float64)
    t = max(t, 0.0)
    k = int(np.searchsorted(times, t, side='right'))
    ta, pa, va = (0.0, start, w) if k == 0 else (times[k - 1], positions[k - 1],
                                                 velocities[k - 1])
    h = times[k] - ta
    return (t - ta) / h, h, pa, va, positions[k], velocities[k]


def velocity_at(t, start, moving, times, positions, velocities):
    """[dim] the velocity at t (s from its start) of the motion joint_trajectory_controller
    makes of a command: a cubic Hermite from (start, moving) at 0 to the first point, then
    from point to point; at rest after the last. moving None: 0; NaN where unknown."""
    if t >= times[-1]:
        return np.zeros(len(np.atleast_1d(start)))
    u, h, pa, va, pb, vb = _segment(t, start, moving, times, positions, velocities)
    s = (pb - pa) / h
    return s + (va - s) * (1 - 4 * u + 3 * u * u) + (vb - s) * (3 * u * u - 2 * u)


def position_at(t, start, moving, times, positions, velocities):
    """[dim] where the same motion has the controller's setpoint at t: on the cubic Hermite
    of velocity_at, at the last point after it (the controller holds it)."""
    if t >= times[-1]:
        return np.array(positions[-1], dtype=np.float64)
    u, h, pa, va, pb, vb = _segment(t, start, moving, times, positions, velocities)
    u2, u3 = u * u, u * u * u
    return ((2 * u3 - 3 * u2 + 1) * pa + (u3 - 2 * u2 + u) * h * va
            + (-2 * u3 + 3 * u2) * pb + (u3 - u2) * h * vb)


def _reach(speed, accel, step):
    """How much room a joint moving at `speed` needs before a limit so that braking at
    `accel` keeps it out, whenever a new command restarts its motion: the continuous
    v^2 / 2a, plus one step at that speed (a command's first point may lie a whole step
    ahead, and a joint can stop no earlier than at a point)."""
    return speed * speed / (2 * accel) + speed * step


def _cap(times, speed, accel):
    """[n, J] the largest speed at each point from which the joint can still be at rest at
    the last point."""
    rest = (times[-1] - times)[:, None]
    return np.minimum(speed, np.where(rest > 0, accel * rest, 0.0))  # inf * 0 is NaN


def _monotone(given, s):
    """The given velocities at the points, made to keep the cubic from each point to the
    next monotone (Fritsch and Carlson's sufficient condition): 0 unless both neighbouring
    steps (s: their mean speeds, the first from where the motion starts) go its way, and at
    most 3 times the slower one's mean speed. The last point is at rest."""
    right = np.zeros_like(s)
    right[:-1] = s[1:]
    size = np.abs(s)
    bound = np.zeros_like(s)
    np.minimum(size[:-1], size[1:], out=bound[:-1])
    bound *= 3
    v = np.minimum(np.maximum(given, -bound), bound)
    return np.where((v * s > 0) & (v * right > 0), v, 0.0)


class _Checks:
    """The limited joints' limits as the peak checks use them: arrays (lower, upper,
    speed, acceleration, jerk) for _fits, with the bounds it compares with made once, and
    per joint the floats _fits1 and _place1 take."""

    def __init__(self, lim):
        lo, hi, speed, accel, jerk = lim
        self.lim = lim
        self.smax, self.amax, self.jmax = speed * (1 + TOL), accel * (1 + TOL), jerk * (1 + TOL)
        self.lo, self.hi = lo - 1e-12, hi + 1e-12
        # Without a finite one the check passes for every finite value: skipped.
        self.accel_free = not np.isfinite(accel).any()
        self.jerk_free = not np.isfinite(jerk).any()
        self.joints = [tuple(x) for x in zip(*(a.tolist() for a in (
            lo, hi, speed, accel, jerk, self.smax, self.amax, self.jmax)), strict=True)]


def _fits(s, v0, p1, v1, h, cap, step, c):
    """Whether the cubic Hermite the controller moves along from (p0, v0) to (p1, v1) in h
    s is monotone and within the limits at its peak, and the joint can still stop in its
    range and by the last point (|v1| <= cap). s: (p1 - p0) / h; c: _Checks."""
    e0, e1 = np.abs(v0), np.abs(v1)
    slack = 3 * np.abs(s) * (1 + TOL)
    ok = (s * v0 >= 0) & (s * v1 >= 0) & (e0 <= slack) & (e1 <= slack)
    ok &= e1 <= cap * (1 + TOL)
    # The acceleration is linear in time: its peaks are at the ends; the jerk is constant.
    s6 = 6 * s
    a0 = (s6 - 4 * v0 - 2 * v1) / h
    a1 = (2 * v0 + 4 * v1 - s6) / h
    if not c.accel_free:
        ok &= np.maximum(np.abs(a0), np.abs(a1)) <= c.amax
    if not c.jerk_free:
        ok &= np.abs(a1 - a0) / h <= c.jmax
    # The speed peaks at an end or where the acceleration changes sign (the velocity is a
    # parabola): a0 * u h / 2 past v0 at the fraction u = a0 / (a0 - a1) of the step (used
    # only where it turns).
    turn = a0 * a1 < 0
    inner = np.abs(v0 + a0 * (a0 / (a0 - a1)) * h / 2)
    ends = np.maximum(e0, e1)
    top = np.where(turn, np.maximum(ends, inner), ends)
    ok &= top <= c.smax
    # Room to stop, from anywhere on the way (a new command may start at any moment): what
    # the end needs, plus a step for each unit of speed lost before it (braking at a step's
    # distance per unit of speed lost is what the end's room does not cover).
    least = np.minimum(e0, e1)
    bottom = np.where(turn, np.minimum(least, inner), least)
    end = p1 + np.sign(s) * (_reach(e1, c.lim[3], step) + (top - bottom) * step)
    return ok & (end <= c.hi) & (end >= c.lo)


def _fits1(p0, v0, p1, v1, h, cap, step, lj):
    """_fits for one joint and segment, in floats: the same operations in the same order,
    so the same answer to the last bit (comparisons, not max and min: calls cost more than
    the arithmetic here). lj: lower, upper, speed, acceleration, jerk, and the last three
    times 1 + TOL."""
    lo, hi, _, accel, _, smax, amax, jmax = lj
    s = (p1 - p0) / h
    # The cheap conditions first (the order of a conjunction does not change it).
    if not (s * v0 >= 0 and s * v1 >= 0):
        return False
    a0 = (6 * s - 4 * v0 - 2 * v1) / h
    a1 = (2 * v0 + 4 * v1 - 6 * s) / h
    if not (abs(a0) <= amax and abs(a1) <= amax and abs(a1 - a0) / h <= jmax):
        return False
    e0, e1 = abs(v0), abs(v1)
    slack = 3 * abs(s) * (1 + TOL)
    if not (e0 <= slack and e1 <= slack and e1 <= cap * (1 + TOL)):
        return False
    top, bottom = (e0, e1) if e0 >= e1 else (e1, e0)
    if a0 * a1 < 0:  # the speed turns inside
        inner = abs(v0 + a0 * (a0 / (a0 - a1)) * h / 2)
        if inner > top:
            top = inner
        elif inner < bottom:
            bottom = inner
    if not top <= smax:
        return False
    room = e1 * e1 / (2 * accel) + e1 * step + (top - bottom) * step
    end = p1 + room if s > 0 else p1 - room if s < 0 else p1 + 0.0 * room
    return end <= hi + 1e-12 and end >= lo - 1e-12


def _place1(p, v, goal, h, cap, step, lj):
    """(position, velocity) of a point that does not fit, for one joint (lj as _fits1):
    h s on from (p, v), moving with constant acceleration (the controller's cubic is then a
    parabola: velocity linear, its peak at an end, no turn inside), as close to `goal` as
    the limits allow while it keeps the room to stop there (_reach; _fits' room condition
    for this parabola). The velocity changes by at most accel * h, stays within cap and
    does not change sign (a reversal passes through rest at a point); too fast to keep to
    cap, it brakes at accel. At rest where cap is 0 (the last point). From rest, a parabola
    to rest goes nowhere: a cubic to rest as long as the limits allow is taken instead
    where it gets closer and fits (a single point's only way)."""
    lo, hi, speed, accel = lj[0], lj[1], lj[2], lj[3]
    e = abs(v)
    # In the frame where the goal lies ahead of where the joint would stop.
    stop = e * e / (2 * accel) + e * step
    stop = p + stop if v > 0 else p - stop if v < 0 else p + 0.0 * stop
    sign = 1.0 if goal >= stop else -1.0
    w = sign * v
    if w < 0:
        want = math.inf  # moving away: turn back
    else:
        ahead = sign * goal - sign * p - h * w / 2
        # Speeding up (the room needed grows by a step per unit of speed gained) ...
        b = h / 2 + 2 * step
        c = ahead + w * step
        want = 2 * c / (b + math.sqrt(b * b + 2 * abs(c) / accel))
        if want < w:
            # ... or slowing down (the room still needed is the start's).
            c = ahead - w * step
            want = 2 * c / (h / 2 + math.sqrt(h * h / 4 + 2 * abs(c) / accel))
    v1 = 0.0
    if cap > 0:
        dv = accel * h
        low, high = v - dv, v + dv
        if low < -cap:
            low = -cap
        if high > cap:
            high = cap
        if v > 0 and low < 0:
            low = 0.0
        elif v < 0 and high > 0:
            high = 0.0
        if low > high:
            v1 = v - dv if v > 0 else v + dv  # v is not 0 here
        else:
            v1 = sign * want
            v1 = low if v1 < low else high if v1 > high else v1
    bp = p + h * (v + v1) / 2
    if v == 0 and v1 == 0:
        # The cubic to rest: its peak is 6 / h^2 and 1.5 / h per unit moved, and the room
        # to stop (see _fits) 1.5 step / h more.
        room = (hi - p if goal >= p else p - lo) * (1 - 1e-9)
        d = accel * (h * h) / 6
        d2 = speed * h / 1.5
        d3 = (room if room > 0 else 0.0) / (1 + 1.5 * step / h)
        d = d if d <= d2 else d2
        d = d if d <= d3 else d3
        rp = goal - p
        rp = p + (-d if rp < -d else d if rp > d else rp)
        if abs(rp - goal) < abs(bp - goal) and _fits1(p, v, rp, 0.0, h, cap, step, lj):
            return rp, 0.0
    return bp, v1


def _place(ok, goal, want, h, cap, reach, start, w, checks):
    """(positions, velocities) [n, J] of the limited joints, each point placed in turn
    from where the one before left its joint (see apply). A joint's points depend only on
    its own earlier ones, so each joint that fails somewhere is placed on its own, in
    plain floats (numpy's per-call cost outweighs a dozen joints), from its first failing
    point: before it, and wherever a point fits from the target before it, the targets
    stand (`ok`, the check from target to target, is what placing would compute; where it
    is False a point is checked again from where the joint is)."""
    bad = ~ok
    h1 = h[:, 0].tolist()
    n = len(h1)
    cols = (goal.T.tolist(), want.T.tolist(), cap.T.tolist(), bad.T.tolist())
    firsts = np.argmax(bad, axis=0).tolist()
    lasts = (n - 1 - np.argmax(bad[::-1], axis=0)).tolist()
    js = np.flatnonzero(bad.any(axis=0))
    placed = ([], [])
    for j in js.tolist():
        g, wv, c, fail = (x[j] for x in cols)
        k0, k1 = firsts[j], lasts[j]
        if k0 == 0:
            p, q = float(start[j]), float(w[j])
        else:
            p, q = g[k0 - 1], wv[k0 - 1]
        lj = checks.joints[j]
        pj, vj = g[:k0], wv[:k0]
        off = False
        for k, gk, wk, hk, ck, fk in zip(range(k0, n), g[k0:], wv[k0:], h1[k0:], c[k0:],
                                         fail[k0:]):
            if not off and not fk:
                if k > k1:  # fits from here to the end: the targets stand
                    pj += g[k:]
                    vj += wv[k:]
                    break
                p, q = gk, wk
            elif _fits1(p, q, gk, wk, hk, ck, reach, lj):
                p, q = gk, wk
                off = False
            else:
                p, q = _place1(p, q, gk, hk, ck, reach, lj)
                off = True
            pj.append(p)
            vj.append(q)
        placed[0].append(pj)
        placed[1].append(vj)
    out, v = goal.copy(), want.copy()
    out[:, js] = np.array(placed[0]).T
    v[:, js] = np.array(placed[1]).T
    return out, v
