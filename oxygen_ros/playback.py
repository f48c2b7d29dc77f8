"""Which points of the current action chunk to publish at time t, and when to hold.

A chunk's action i is for its frame time + i action periods. Every control tick the player
publishes the actions still ahead, up to `horizon` seconds ahead and, with `play_steps`,
only the first n actions of the chunk. When there is nothing left to play (chunk used up,
inputs stale, model failure, deactivate, shutdown) it says "hold" once: one point at the
last measured positions with zero velocity, which replaces whatever the controller is
executing. With joint limits (limits.py) every published point is limited, and a chunk
whose targets lie too far beyond them is dropped for a hold; the motion is limited from
the controller's current state, the measured positions moving at the velocity of the last
published trajectory at that time, and a hold of a moving joint brakes within its limits.
Plain numpy in and out, so the tests drive it without ROS.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from oxygen_ros.limits import Finding, JointLimits, velocity_at


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
    p = np.asarray(positions, dtype=np.float64)
    v = np.gradient(p, period, axis=0) if len(p) > 1 else np.zeros_like(p)
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


@dataclass
class Command:
    """What to publish now: points at `times` (seconds from now, increasing, > 0)."""

    times: np.ndarray
    positions: np.ndarray  # [N, action_dim]; NaN where a hold has no measured position
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
    """

    def __init__(self, horizon: float, play_steps: int = 0, hold_after: float = 0.01,
                 limits: JointLimits | None = None):
        if horizon <= 0 or play_steps < 0 or hold_after <= 0:
            raise ValueError(f'horizon and hold_after must be > 0 and play_steps >= 0, got '
                             f'{horizon}, {hold_after}, {play_steps}')
        self.horizon = horizon
        self.play_steps = play_steps
        self.hold_after = hold_after
        self.limits = limits
        self._chunk: Chunk | None = None
        self._hold: str | None = None  # a hold still to be published, and why
        # (chunk, first action, targets, velocities) of the last re-anchoring.
        self._anchor: tuple | None = None
        # (time, start positions, start velocities, times, positions, velocities) of the
        # last limited command: where the controller is moving now.
        self._sent: tuple | None = None
        self._lock = threading.Lock()

    @property
    def chunk(self) -> Chunk | None:
        return self._chunk

    def play(self, chunk: Chunk) -> None:
        with self._lock:
            self._chunk = chunk
            self._hold = None

    def stop(self, why: str) -> bool:
        """Drop the chunk and hold at the next tick. False when already stopped (nothing was
        being commanded, so there is nothing to replace)."""
        with self._lock:
            if self._chunk is None:
                return False
            self._chunk = None
            self._hold = why
            return True

    def tick(self, now: float, measured: Callable[[], np.ndarray | None] | None = None,
             hold_at: Callable[[], np.ndarray] | None = None) -> Command | None:
        """What to publish at `now`: the chunk's points still ahead, a hold, or None.

        measured: gives the latest raw robot state, for chunks that re-anchor on it.
        hold_at: gives [action_dim] positions to hold at (the last measured ones); with
        limits, also where the first published point is reached from.
        Both are called only when needed.
        """
        with self._lock:
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
                    self._chunk, chunk, self._hold = None, None, done
            if chunk is None:
                why, self._hold = self._hold, None
                if why is None:
                    return None
                return self._hold_command(why, hold_at, now)
        times = chunk.stamp + chunk.period * np.arange(first, last) - now
        n = int(np.searchsorted(times, self.horizon, side='right'))
        if n == 0:
            # The next action lies beyond the horizon (a horizon under one action period):
            # nothing may be sent yet.
            return None
        positions, vel = chunk.positions[first:], chunk.velocities[first:]
        if chunk.reanchor is not None and measured is not None:
            positions, vel = self._anchored(chunk, first, measured, positions, vel)
        if self.limits is None:
            vel = vel[:n].copy()
            # The last published point must be at rest, as the controller requires.
            vel[-1] = 0.0
            return Command(times[:n], positions[:n], vel)
        if hold_at is None:
            raise ValueError('joint limits need the measured positions')
        at = np.asarray(hold_at(), dtype=np.float64)
        # The whole rest of the chunk is judged at once: one target far out of range means
        # the model does not fit the robot, and none of its chunk should be played. A chunk
        # that re-anchors is judged by the target of the step now starting: the rest is an
        # extension recomputed at each step (DROID velocities integrated from where the arm
        # is), which runs past a limit whenever the arm moves toward it.
        judged = positions[:1] if chunk.reanchor is not None else positions[:last - first]
        why = self.limits.too_far(judged, at)
        if why:
            with self._lock:
                if self._chunk is chunk:
                    self._chunk = None
            return self._hold_command(why, lambda: at, now)
        moving = self.moving(now)
        out = self.limits.apply(times[:n], positions[:n], vel[:n], at, moving,
                                max(chunk.period, self.hold_after))
        self._sent = (now, at, moving, times[:n], out.positions, out.velocities)
        return Command(times[:n], out.positions, out.velocities, findings=out.findings)

    def moving(self, now: float) -> np.ndarray | None:
        """The velocities the controller moves at `now` along the last limited command
        (None before the first)."""
        if self._sent is None:
            return None
        t, at, w, times, pos, vel = self._sent
        return velocity_at(now - t, at, w, times, pos, vel)

    def _hold_command(self, why: str, hold_at, now: float) -> Command:
        if hold_at is None:
            raise ValueError('a hold needs the positions to hold at')
        pos = np.asarray(hold_at(), dtype=np.float64)
        if self.limits is None:
            return Command(np.array([self.hold_after]), pos[None], np.zeros((1, len(pos))),
                           hold=why)
        # Where the robot is, even beyond a limit: a hold must not move it (said instead),
        # except that a moving joint brakes to rest within its limits.
        moving = self.moving(now)
        times, p, v = self.limits.stop(pos, moving, self.hold_after, self.horizon)
        self._sent = (now, pos, moving, times, p, v)
        return Command(times, p, v, hold=why, findings=self.limits.outside(pos))

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
