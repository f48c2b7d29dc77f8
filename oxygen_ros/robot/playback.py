"""Which points of the current action chunk to publish at time t, and when to hold.

A chunk's action i is for its frame time + i action periods. Every control tick the player
publishes the actions still ahead, up to `horizon` seconds ahead and, with `play_steps`,
only the first n actions of the chunk. When there is nothing left to play (chunk used up,
inputs stale, model failure, deactivate, shutdown) it says "hold" once, which replaces
whatever the controller is executing: at rest where the controller's setpoint is at that
instant along the last trajectory sent (the player keeps what it sent and follows it as the
controller interpolates it), so a hold never sends the arm back to an old reading; before
anything was sent, at a fresh measured position; with neither, no target (NaN). With joint
limits (limits.py) every published point is limited, and a chunk whose targets lie too far
beyond them is dropped for a hold; the motion is limited from the controller's current
state (a fresh reading, else the setpoint, moving at the velocity of the last trajectory
sent) and a hold of a moving joint brakes within its limits.
Plain numpy in and out, so the tests drive it without ROS.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from oxygen_ros.robot.limits import Finding, JointLimits, position_at, velocity_at

# Commands kept to say where the controller's setpoint was when a reading was taken: two
# seconds of them at 70 Hz, longer than any reading counts as fresh by default.
SENT_KEPT = 140
RECENT_S = 0.1
# Taking over an arm in motion: the first command's motion is planned from the arm's state at
# the tick, but the controller gets it later, the arm by then further along (it moves on as
# before until the command arrives, and a command without a stamp starts on arrival). A
# start that far off changes the first cubic's end accelerations by 6 dp / T^2 and its jerk
# by 12 dp / T^3 (dp = speed x delay, T the segment's duration), which for a first point one
# control period out breaks the limits at a delay of a millisecond. So that command is
# planned within EASE of the acceleration and jerk limits, and its first point lies far
# enough out that a command LATE_S late keeps them (takeover_lead).
TAKEOVER_LATE_S = 0.02
TAKEOVER_EASE = 0.5


@dataclass
class Chunk:
    stamp: float  # frame time; action i is for stamp + i * period
    period: float
    positions: np.ndarray  # [H, action_dim] targets in robot units
    velocities: np.ndarray
    actions: np.ndarray | None = None  # the model's actions the targets came from
    state: np.ndarray | None = None  # the raw robot state of the frame
    # (first, measured raw state) -> targets [H - first, action_dim] of actions first..H-1,
    # for profiles whose targets are relative to where the robot is (velocities).
    reanchor: Callable[[int, np.ndarray], np.ndarray] | None = None


def velocities(positions: np.ndarray, period: float) -> np.ndarray:
    """Velocities at the points such that the controller's cubic between two points never
    goes beyond them: the harmonic mean of the slopes on either side (PCHIP's rule for
    equal spacing), zero where the motion turns or pauses. Central differences overshoot:
    a gripper stepping 0, 0, c, c got c / 2T at the third point and went past c between the
    last two, and a hold taken there lay beyond anything commanded."""
    p = np.asarray(positions, dtype=np.float64)
    v = np.zeros_like(p)
    if len(p) > 1:
        d = np.diff(p, axis=0) / period
        v[0] = d[0]  # one-sided; with any end slope in [0, 3] x the secant no overshoot
        a, b = d[:-1], d[1:]
        same = a * b > 0
        v[1:-1] = np.where(same, 2 * a * b / np.where(same, a + b, 1.0), 0.0)
    # joint_trajectory_controller rejects a trajectory that ends moving.
    v[-1] = 0.0
    return v


def make_chunk(stamp: float, period: float, positions, actions=None, state=None,
               reanchor=None) -> Chunk:
    p = np.asarray(positions, dtype=np.float64)
    if p.ndim != 2 or not len(p):
        raise ValueError(f'a chunk needs [H >= 1, action_dim] positions, got {p.shape}')
    return Chunk(stamp, period, p, velocities(p, period), actions, state, reanchor)


def remaining(chunk: Chunk, now: float) -> int:
    """Index of the first action still in the future at `now`."""
    times = chunk.stamp + chunk.period * np.arange(len(chunk.positions))
    return int(np.searchsorted(times, now, side='right'))


def runs_out(chunk: Chunk, play_steps: int = 0) -> float:
    """When the chunk is used up: the time of its last action played (the first
    ``play_steps`` only, if given), after which Player.tick holds."""
    n = len(chunk.positions)
    if play_steps:
        n = min(n, play_steps)
    return chunk.stamp + (n - 1) * chunk.period


def takeover_lead(limits: JointLimits, moving: np.ndarray) -> float:
    """How far out (s) the first point of a command that takes over an arm moving at
    `moving` ([action_dim]) must lie for a delivery TAKEOVER_LATE_S late to stay within the
    limits the eased plan leaves room for."""
    idx = limits.index
    dp = np.abs(np.asarray(moving, dtype=np.float64)[idx]) * TAKEOVER_LATE_S
    room = 1.0 - TAKEOVER_EASE
    with np.errstate(divide='ignore', invalid='ignore'):
        t_acc = np.sqrt(6.0 * dp / (room * limits.accel[idx]))
        t_jerk = np.cbrt(12.0 * dp / (room * limits.jerk[idx]))
    lead = np.nan_to_num(np.maximum(t_acc, t_jerk), nan=0.0, posinf=0.0)
    return float(lead.max(initial=0.0))


def replan_at(chunk: Chunk | None, after: int, lead: float | None = None,
              play_steps: int = 0) -> float:
    """When the next frame may start: once `after` actions of `chunk` (the one being played)
    are out, or earlier, `lead` s before the chunk runs out (its next chunk takes about that
    long to come); at once when nothing plays or `after` is 0. None: no lead (nothing
    measured yet)."""
    if chunk is None or not after:
        return -math.inf
    at = chunk.stamp + after * chunk.period
    if lead is not None:
        at = min(at, runs_out(chunk, play_steps) - lead)
    return at


@dataclass
class Command:
    """What to publish now: points at `times` (seconds from now, increasing, > 0)."""

    times: np.ndarray
    positions: np.ndarray  # [N, action_dim]; NaN where a hold has no position to hold at
    velocities: np.ndarray
    hold: str | None = None  # why, when this is a hold
    findings: list[Finding] = field(default_factory=list)  # what the joint limits did

    @property
    def clamped(self) -> bool:
        """Whether the joint limits changed a published target."""
        return any(f.kind in ('position', 'speed') for f in self.findings)


class Player:
    """The current chunk and what to publish from it.

    horizon: no published point lies further ahead than this (s).
    play_steps: play only the first n actions of each chunk, then hold unless a newer
    chunk has arrived (LeRobot's n_action_steps, openpi's open_loop_horizon); 0 = all.
    hold_after: time_from_start of the single hold point (s).
    limits: joint limits applied to every published point (None: none).
    open_loop: the controller starts each new trajectory from its last command, not from
    the measured state (JTC's open_loop_control).
    keep: [action_dim] True where a hold keeps the setpoint rather than where the joint is
    (a gripper: closed on an object it is stalled short of its setpoint, and holding at the
    reading would stop the squeeze that holds the object).
    """

    def __init__(self, horizon: float, play_steps: int = 0, hold_after: float = 0.01,
                 limits: JointLimits | None = None, open_loop: bool = False,
                 keep: np.ndarray | None = None):
        if horizon <= 0 or play_steps < 0 or hold_after <= 0:
            raise ValueError(f'horizon and hold_after must be > 0 and play_steps >= 0, got '
                             f'{horizon}, {hold_after}, {play_steps}')
        self.horizon = horizon
        self.play_steps = play_steps
        self.hold_after = hold_after
        self.limits = limits
        self.open_loop = open_loop
        self.keep = None if keep is None or not np.any(keep) else np.asarray(keep, dtype=bool)
        self._eased = None if limits is None else limits.eased(TAKEOVER_EASE)
        # A reading this old or newer says where the arm is better than the setpoint does
        # (a few control periods: about how often a joint stream comes).
        self.recent = max(RECENT_S, 3 * hold_after)
        self._chunk: Chunk | None = None
        self._hold: str | None = None  # a hold still to be published, and why
        # (chunk, first action, targets, velocities) of the last re-anchoring.
        self._anchor: tuple | None = None
        # (time, start positions, start velocities, times, positions, velocities) of the
        # last commands and holds sent, oldest first: where the controller's setpoint is and
        # was, and how it moves.
        self._sent: collections.deque = collections.deque(maxlen=SENT_KEPT)
        self._measured_vel: np.ndarray | None = None  # at the last readings taken (_start)
        self._lock = threading.Lock()

    @property
    def chunk(self) -> Chunk | None:
        return self._chunk

    def play(self, chunk: Chunk) -> None:
        """Play `chunk` from the next tick; a hold not yet published goes out first (a
        chunk that arrives between a stop and the next tick must not swallow the hold)."""
        with self._lock:
            self._chunk = chunk

    def stop(self, why: str) -> bool:
        """Drop the chunk and hold at the next tick. False when already stopped (nothing was
        being commanded, so there is nothing to replace)."""
        with self._lock:
            if self._chunk is None:
                return False
            self._chunk = None
            self._hold = why
            return True

    def drop(self) -> None:
        """Drop the chunk without a hold: another node commands the robot now, and a hold
        would fight it. What was sent no longer says where the controller is."""
        with self._lock:
            self._chunk = None
            self._hold = None
            self._sent.clear()

    def forget(self) -> None:
        """What was sent no longer says where the controller is (a new activation: the
        robot may have been moved since, by hand or by another node)."""
        with self._lock:
            self._sent.clear()

    def shift(self, delta: float) -> None:
        """The clock jumped by `delta` s: what was sent keeps its place in the controller's
        time (which did not jump), so a hold still starts where the controller is."""
        with self._lock:
            self._sent = collections.deque(((r[0] + delta, *r[1:]) for r in self._sent),
                                           maxlen=SENT_KEPT)

    def tick(self, now: float, measured: Callable[[], np.ndarray | None] | None = None,
             hold_at: Callable[[], np.ndarray] | None = None) -> Command | None:
        """What to publish at `now`: the chunk's points still ahead, a hold, or None.

        measured: gives the latest raw robot state, for chunks that re-anchor on it.
        hold_at: gives [action_dim] fresh measured positions (NaN where there is none): a
        hold's target only where nothing was sent yet, and where a command's motion starts.
        Both are called only when needed.
        """
        with self._lock:
            if self._hold is not None:
                why, self._hold = self._hold, None
                return self._hold_command(why, hold_at, now)
            chunk = self._chunk
            if chunk is not None:
                first = remaining(chunk, now)
                last = len(chunk.positions)
                if self.play_steps and self.play_steps < last:
                    last = self.play_steps
                    done = f'the first {last} actions of the chunk are played'
                else:
                    done = 'action chunk used up before the next one arrived'
                if first >= last:
                    self._chunk = None
                    return self._hold_command(done, hold_at, now)
            if chunk is None:
                return None
        times = chunk.stamp + chunk.period * np.arange(first, last) - now
        n = int(np.searchsorted(times, self.horizon, side='right'))
        if n == 0:
            # The next action lies beyond the horizon (a horizon under one action period):
            # nothing may be sent yet.
            return None
        positions, vel = chunk.positions[first:], chunk.velocities[first:]
        if chunk.reanchor is not None and measured is not None:
            positions, vel = self._anchored(chunk, first, measured, positions, vel)
        if hold_at is None and self.limits is not None:
            raise ValueError('joint limits need the measured positions')
        # The controller starts a new trajectory from the arm's state: a recent reading
        # moved on along the setpoint since it was read, else the setpoint.
        start = self._start(now, hold_at, positions.shape[1])[0]
        if self.open_loop:
            # Unless it starts from its last command (JTC's open_loop_control): then the
            # motion the limits judge starts from the setpoint, wherever the arm lags.
            sp = self.setpoint(now)
            if sp is not None:
                start = np.where(np.isfinite(sp), sp, start)

        if self.limits is None:
            vel = vel[:n].copy()
            # The last published point must be at rest, as the controller requires.
            vel[-1] = 0.0
            self._sent.append((now, start, self.moving(now), times[:n], positions[:n], vel))
            return Command(times[:n], positions[:n], vel)
        # The whole rest of the chunk is judged at once: one target far out of range means
        # the model does not fit the robot, and none of its chunk should be played. A chunk
        # that re-anchors is judged by the target of the step now starting: the rest is an
        # extension recomputed at each step (DROID velocities integrated from where the arm
        # is), which runs past a limit whenever the arm moves toward it.
        judged = positions[:1] if chunk.reanchor is not None else positions[:last - first]
        why = self.limits.too_far(judged, start)
        unknown = [self.limits.names[i] for i in self.limits.index
                   if not np.isfinite(start[i])]
        if unknown and not why:
            # The speed limit needs where the motion starts: nothing sent and no fresh
            # reading of these joints.
            why = f'no position of {", ".join(unknown)} to limit the motion from'
        if why:
            with self._lock:
                if self._chunk is chunk:
                    self._chunk = None
            return self._hold_command(why, hold_at, now)
        moving = self.moving(now)
        limits = self.limits
        if self._takes_over(now, moving):
            # Planned with room for the command's delivery (TAKEOVER_LATE_S): the points
            # before the lead are left out.
            k = min(int(np.searchsorted(times[:n], takeover_lead(limits, moving))), n - 1)
            times, positions, vel, n = times[k:], positions[k:], vel[k:], n - k
            limits = self._eased
        out = limits.apply(times[:n], positions[:n], vel[:n], start, moving,
                           max(chunk.period, self.hold_after))
        self._sent.append((now, start, moving, times[:n], out.positions, out.velocities))
        return Command(times[:n], out.positions, out.velocities, findings=out.findings)

    def _takes_over(self, now: float, moving: np.ndarray | None) -> bool:
        """Whether a command now takes over an arm in motion: nothing sent yet (or since
        forget()) and a limited joint measured moving."""
        return (moving is not None and self._record(now) is None
                and bool(np.any(moving[self.limits.index] != 0)))

    def _record(self, t: float):
        """The last command sent at or before t; None before the first."""
        for r in reversed(self._sent):
            if r[0] <= t:
                return r
        return None

    def moving(self, now: float) -> np.ndarray | None:
        """The velocities the controller moves at `now` along the last command sent; before
        the first, the arm's measured velocities (0 where unknown) from the last readings
        taken (a robot taken over in motion), None without any."""
        r = self._record(now)
        if r is None:
            vel = self._measured_vel
            return None if vel is None else np.where(np.isfinite(vel), vel, 0.0)
        t, at, w, times, pos, vel = r
        return velocity_at(now - t, at, w, times, pos, vel)

    def setpoint(self, now: float) -> np.ndarray | None:
        """[action_dim] where the controller's setpoint is at `now` along the last command
        sent (None before the first; NaN where it had no position)."""
        r = self._record(now)
        if r is None:
            return None
        t, at, w, times, pos, vel = r
        return position_at(now - t, at, w, times, pos, vel)

    def _start(self, now: float, hold_at, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(where the controller is now, the recent reading): a reading at most `recent` s
        old moved on by as much as the setpoint moved since its stamp; the setpoint alone
        where there is none (an older reading lies behind an arm that went on along what
        was sent, as far as it moves in max_input_age); the reading alone where nothing was
        sent. NaN where none of them says. The estimate is kept between the reading and the
        setpoint."""
        got = None if hold_at is None else hold_at()
        vel = None
        if isinstance(got, tuple):
            read, stamps = (np.array(x, dtype=np.float64) for x in got[:2])
            if len(got) > 2:
                vel = np.array(got[2], dtype=np.float64)
        else:
            read = (np.full(dim, np.nan) if got is None else np.array(got, dtype=np.float64))
            stamps = np.full(dim, now)
        self._measured_vel = vel
        sp = self.setpoint(now)
        if sp is not None:
            read[~(now - stamps <= self.recent)] = np.nan
        if sp is None:
            # Nothing sent: the arm is where it was read, moved on at its measured velocity
            # since (an arm taken over in motion).
            at = read.copy()
            if vel is not None:
                go = np.isfinite(read) & np.isfinite(vel) & np.isfinite(stamps)
                at[go] += vel[go] * np.clip(now - stamps[go], 0.0, None)
            return at, read
        at = sp.copy()
        for t in np.unique(stamps[np.isfinite(read)]).tolist():
            then = self.setpoint(t)
            if then is None:  # read before the first command kept: from where it started
                then = self._sent[0][1]
            k = np.isfinite(read) & (stamps == t)
            moved = sp[k] - then[k]
            at[k] = read[k] + np.where(np.isfinite(moved), moved, 0.0)
        # Never beyond both the reading and the setpoint: where the motion reversed since the
        # stamp, or the arm stalled (blocked, or not following at all), "moved on as the
        # setpoint did" overshoots what the arm can have done.
        both = np.isfinite(read) & np.isfinite(sp)
        at[both] = np.clip(at[both], np.minimum(read[both], sp[both]),
                           np.maximum(read[both], sp[both]))
        return at, read

    def _hold_command(self, why: str, hold_at, now: float) -> Command:
        if hold_at is None:
            raise ValueError('a hold needs the positions to hold at')
        # Where the controller is now, not where the arm was last read: holding there would
        # send it back. Nothing sent and no fresh reading: NaN, no target.
        pos = self._start(now, hold_at, self._dim())[0]
        sp = self.setpoint(now)
        if sp is not None:
            # A controller that starts from its last command (open_loop) is at its setpoint,
            # whatever the arm's tracking error: a hold anywhere else steps the setpoint
            # across that error within one period. Kept joints (grips) stay at it too.
            k = np.isfinite(sp)
            if not self.open_loop:
                k &= self.keep if self.keep is not None else False
            pos[k] = sp[k]
        if self.limits is None:
            cmd = Command(np.array([self.hold_after]), pos[None], np.zeros((1, len(pos))),
                          hold=why)
            self._sent.append((now, pos, self.moving(now), cmd.times, cmd.positions,
                               cmd.velocities))
            return cmd
        # Where the robot is, even beyond a limit: a hold must not move it (said instead),
        # except that a moving joint brakes to rest within its limits.
        moving = self.moving(now)
        limits, step = self.limits, self.hold_after
        if self._takes_over(now, moving):
            # A hold that takes over a moving arm brakes with the same room as a command.
            limits, step = self._eased, max(step, takeover_lead(limits, moving))
        times, p, v = limits.stop(pos, moving, step, self.horizon)
        self._sent.append((now, pos, moving, times, p, v))
        return Command(times, p, v, hold=why, findings=self.limits.outside(pos))

    def _dim(self) -> int:
        if self._sent:
            return len(self._sent[-1][1])
        if self.limits is not None:
            return len(self.limits.lower)
        return 0

    def _anchored(self, chunk, first, measured, positions, vel):
        """Targets re-anchored on the state measured when action `first` became the next
        one, kept until the next action: DROID's controller reads the joints once per step,
        and anchoring every tick would keep the target a step ahead of wherever the arm is
        (it would chase it instead of following the chunk)."""
        a = self._anchor
        if a is not None and a[0] is chunk and a[1] == first:
            return a[2], a[3]
        state = measured()
        if state is None:
            return positions, vel  # nothing measured yet: the frame's own targets
        p = np.asarray(chunk.reanchor(first, state), dtype=np.float64)
        expected = (len(chunk.positions) - first, chunk.positions.shape[1])
        if p.shape != expected:
            raise ValueError(f'reanchor returned {p.shape}, expected {expected}')
        self._anchor = (chunk, first, p, velocities(p, chunk.period))
        return self._anchor[2], self._anchor[3]
