"""Joint limits on what the node commands, without ROS.

joint_trajectory_controller does not enforce joint limits, so the node does, on every point
it publishes: each target is clamped into [lower, upper], and each step is shortened so it
can be made at the joint's maximum speed from the point before it (the first point from
the measured position), as LeRobot's max_relative_target bounds a target by its distance
to the measured position. Velocities are then recomputed from the limited points. A target
(or a measured position) beyond a limit by more than the hold margin is not clamped: the
model's actions, or the limits, do not fit this robot, and the robot holds instead.

Limits are per action index (the action dim a controller joint is driven by); arrays hold
-inf / inf where a joint has no limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

KEYS = ('lower', 'upper', 'velocity')


@dataclass(frozen=True)
class Limit:
    lower: float = -math.inf
    upper: float = math.inf
    velocity: float = math.inf  # largest speed, units/s


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
    joint_limits.<group>.<joint>.<lower|upper|velocity> (what a nested YAML mapping under
    joint_limits becomes). groups: objects with name, joints and indices. ValueError names
    the first parameter that is wrong."""
    by_group = {g.name: g for g in groups}
    entries: dict[tuple[str, str], dict[str, float]] = {}
    for name, value in values.items():
        parts = name.split('.')
        if len(parts) != 4 or parts[0] != 'joint_limits' or parts[3] not in KEYS:
            raise ValueError(f'{name}: expected joint_limits.<group>.<joint>.lower, .upper '
                             'or .velocity')
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
        if 'velocity' in e and e['velocity'] <= 0:
            raise ValueError(f'{where}.velocity must be > 0, got {e["velocity"]:g}')
        g = by_group[group]
        index = g.indices[g.joints.index(joint)]
        if index in out:
            raise ValueError(f'{where}: action index {index} is limited already as '
                             f'{out[index][0]}; limit it once')
        out[index] = (f'{group}/{joint}', Limit(**e))
    return out


class JointLimits:
    """Position and speed limits per action index, and what they do to a command.

    hold_margin: a fraction of a joint's range (upper - lower); a target or measured
    position beyond a limit by more than that is a reason to hold rather than clamp.
    """

    def __init__(self, dim: int, limits: dict[int, tuple[str, Limit]], hold_margin: float):
        if hold_margin < 0:
            raise ValueError(f'hold_margin must be >= 0, got {hold_margin}')
        self.lower = np.full(dim, -np.inf)
        self.upper = np.full(dim, np.inf)
        self.speed = np.full(dim, np.inf)
        self.names = {}
        for i, (name, lim) in limits.items():
            self.lower[i], self.upper[i], self.speed[i] = lim.lower, lim.upper, lim.velocity
            self.names[i] = name
        self.index = np.array(sorted(limits), dtype=np.int64)
        self.hold_margin = hold_margin
        span = self.upper - self.lower
        self.margin = np.full(dim, np.inf)
        ranged = np.isfinite(span)
        self.margin[ranged] = hold_margin * span[ranged]

    def __len__(self) -> int:
        return len(self.index)

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
              measured: np.ndarray | None) -> Limited:
        """The points at `times` (s from now, increasing, > 0) limited: positions in range,
        each step no faster than the joint's speed from the point before (the first from
        `measured`, taken as being at time 0; NaN or None where unknown: the first point is
        then only clamped), velocities recomputed from the limited points for the limited
        joints (the others keep theirs). The last point is at rest. A joint measured beyond
        its range is led back at its speed: its first points lie outside until it is in."""
        times = np.asarray(times, dtype=np.float64)
        pos = np.array(positions, dtype=np.float64)
        vel = np.array(velocities, dtype=np.float64)
        vel[-1] = 0.0
        idx = self.index
        if not len(idx):
            return Limited(pos, vel)
        lo, hi, speed = self.lower[idx], self.upper[idx], self.speed[idx]
        start = (np.full(len(idx), np.nan) if measured is None
                 else np.asarray(measured, dtype=np.float64)[idx])
        raw = pos[:, idx]
        dt = np.diff(times, prepend=0.0)
        out = np.clip(raw, lo, hi)
        steps = np.abs(np.diff(np.concatenate([start[None], out]), axis=0))
        # Clamped points whose steps are all feasible stay as they are (the usual case); else
        # each step is bounded in turn, as it depends on where the one before ended.
        if not np.all((steps <= speed * dt[:, None]) | np.isnan(steps)):
            prev = start
            for k in range(len(raw)):
                step = speed * dt[k]
                # Into the range first, then within reach: a joint measured beyond its
                # range comes back no faster than its speed, never in one jump.
                ranged = np.clip(raw[k], lo, hi)
                out[k] = np.where(np.isnan(prev), ranged,
                                  np.clip(ranged, prev - step, prev + step))
                prev = out[k]
        pos[:, idx] = out
        vel[:, idx] = _velocities(np.concatenate([[0.0], times]),
                                  np.concatenate([start[None], out]))
        findings = []
        over = np.maximum(raw - hi, lo - raw)
        beyond = over.max(axis=0)
        slowed = np.abs(out - np.clip(raw, lo, hi)).max(axis=0)
        for j, i in enumerate(idx):
            name = self.names[i]
            if beyond[j] > 0:
                k = int(np.argmax(over[:, j]))
                findings.append(Finding('position', name, float(beyond[j]),
                                        f'joint limits: {name} target {self._side(i, raw[k, j])};'
                                        f' clamped into [{lo[j]:.4g}, {hi[j]:.4g}]'))
            if slowed[j] > 0:
                findings.append(Finding('speed', name, float(slowed[j]),
                                        f'joint limits: {name} targets move faster than '
                                        f'{speed[j]:.4g}/s; held back by up to {slowed[j]:.4g}'))
        if measured is not None:
            findings += self.outside(measured)
        return Limited(pos, vel, findings)


def describe(limits: JointLimits | None, names: list[str]) -> str:
    """One line for the start-up log. names: the commanded joints, as group/joint."""
    if limits is None:
        return 'joint limits: none (commanded positions and speeds are not bounded)'
    free = [n for n in names if n not in limits.names.values()]
    text = (f'joint limits on {len(limits)} of {len(names)} joints (a target beyond a limit '
            f'by more than {limits.hold_margin:g} of its range holds)')
    return text + (f'; none on {", ".join(free)}' if free else '')


def _velocities(times: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Velocities at points[1:] (points[0] is where the motion starts, NaN where unknown):
    the smaller of the two neighbouring slopes where they agree in sign, else 0 (a turn, a
    flat, or an unknown start), and 0 at the end. No steeper than either neighbouring step,
    so the controller's cubic through points and velocities stays monotone between two
    points: it never overshoots a point, and so never a limit the points respect."""
    slopes = np.diff(points, axis=0) / np.diff(times)[:, None]  # step k ends at point k+1
    left, right = slopes[:-1], slopes[1:]
    # NaN (no start) compares False: velocity 0.
    v = np.where(left * right > 0, np.sign(right) * np.minimum(np.abs(left), np.abs(right)),
                 0.0)
    return np.concatenate([v, np.zeros((1, points.shape[1]))])
