"""Frames of several robots: which robots a frame takes, and real-time chunking in a batch.

``Planner`` decides, between frames, which robots the next frame serves and how long to wait
before deciding again. A robot is due when its current chunk would run out before a frame
started now delivers its next one; a frame starts as soon as any robot with a fresh
observation is due (so it never waits past the earliest deadline) and also takes every
fresh robot that would come due before that frame ends (left for the next frame, it would
miss). A robot whose inputs are stale or missing is left out, and holds; it never delays the
others. Times are seconds on whatever clock the caller reads (a fake one in tests).

``EveryFrame`` is the rule for one robot: a frame starts as soon as its newest observation is
complete, so the chunk is always planned from the latest images (nothing to batch it with).
Both answer ``plan(now, robots)``, so the node runs one path for one robot and for many.

``BatchGuide`` is model/rtc.py's guide for a batch of chunks, one previous chunk (or none)
per row: each row's guidance and frozen steps are its own Guide's exactly, since a row's
actions depend on its own noise only, so one vector-Jacobian product serves every row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model.rtc import Guide, guided


@dataclass
class RobotTimes:
    """What the planner knows of one robot, in seconds on the caller's clock."""

    runs_out: float | None  # when its current chunk is used up; None: it has none
    stamp: float | None  # its newest complete observation; None: none yet


@dataclass
class Plan:
    take: list[str]  # the robots of a frame to start now, most urgent first; [] = none
    wait: float  # with nothing to take: seconds until the next decision
    left_out: dict[str, str] = field(default_factory=dict)  # due but not taken, and why
    estimate: float = 0.0  # the frame's expected start-to-chunk time for `take`


class Planner:
    """``estimate(n)``: seconds from a frame's start to its chunks for a frame of ``n``
    robots, or None when not known yet (``first`` is used then). ``max_robots`` bounds a
    frame; ``margin`` is added to every estimate (the caller's own jitter); ``poll`` is the
    longest wait, so that a robot whose inputs come back is seen soon; ``look`` is the wait
    while a robot is due and only its next observation is missing (the caller sees new
    images only when it looks)."""

    def __init__(self, estimate: Callable[[int], float | None], max_input_age: float,
                 max_robots: int = 8, first: float = 0.2, margin: float = 0.0,
                 poll: float = 0.05, look: float = 0.002):
        if (max_input_age <= 0 or max_robots < 1 or first <= 0 or margin < 0 or poll <= 0
                or not 0 < look <= poll):
            raise ValueError('max_input_age, first and poll must be > 0, max_robots >= 1, '
                             'margin >= 0, 0 < look <= poll')
        self.estimate = estimate
        self.max_input_age = max_input_age
        self.max_robots = max_robots
        self.first = first
        self.margin = margin
        self.poll = poll
        self.look = look

    def frame_time(self, n: int) -> float:
        e = self.estimate(n) if n else 0.0
        return (self.first if e is None else e) + self.margin

    def stale(self, now: float, t: RobotTimes) -> str | None:
        """Why a robot's inputs cannot start a frame now; None when they can."""
        if t.stamp is None:
            return 'no observation yet'
        age = now - t.stamp
        if age > self.max_input_age:
            return f'inputs {age:.3f} s old (max_input_age {self.max_input_age:.3f} s)'
        if age < -self.max_input_age:  # the clock jumped back under them
            return f'inputs stamped {-age:.3f} s ahead of the clock'
        return None

    def plan(self, now: float, robots: dict[str, RobotTimes]) -> Plan:
        def left(name):  # seconds until the robot's chunk runs out
            r = robots[name].runs_out
            return float('-inf') if r is None else r - now

        # Due a microsecond early: a wait shorter than that is no wait on any clock.
        soon = 1e-6
        order = sorted(robots, key=left)
        fresh = [n for n in order if self.stale(now, robots[n]) is None]
        # Due now (a frame started now barely delivers) or before a frame started now
        # ends; the estimate grows with the batch, so settle the set.
        take, e = [], self.frame_time(1)
        if fresh and left(fresh[0]) <= e + soon:
            while True:
                take = [n for n in fresh if left(n) <= 2 * e + soon][:self.max_robots]
                e2 = self.frame_time(len(take))
                if e2 <= e:
                    break
                e = e2
        out = {}
        for n in order:
            if n in take:
                continue
            why = self.stale(now, robots[n])
            if why is None and take and left(n) <= e:
                why = f'the frame is full ({self.max_robots} robots)'
            if why is not None and left(n) <= self.frame_time(1):
                out[n] = why
        if take:
            return Plan(take, 0.0, out, e)
        # Nothing due: decide again when the first robot comes due. One already due that
        # waits for its next observation is looked at every `look`; one with old inputs
        # is checked every `poll`.
        wait = self.poll
        for n in order:
            due_in = left(n) - self.frame_time(1)
            if n in fresh:
                wait = min(wait, max(0.0, due_in))
            elif robots[n].stamp is None:
                wait = min(wait, max(self.look, due_in))
        return Plan([], wait, out, 0.0)


class EveryFrame:
    """A frame for every robot with a fresh observation, as soon as it has one (up to
    ``max_robots``, the most urgent first); otherwise look again after ``look`` s (the caller
    sees new images only when it looks). A robot whose inputs are stale is never taken."""

    def __init__(self, max_input_age: float, max_robots: int = 1, look: float = 0.002):
        if max_input_age <= 0 or max_robots < 1 or look <= 0:
            raise ValueError('max_input_age and look must be > 0, max_robots >= 1')
        self.max_input_age = max_input_age
        self.max_robots = max_robots
        self.look = look

    def plan(self, now: float, robots: dict[str, RobotTimes]) -> Plan:
        def left(name):
            r = robots[name].runs_out
            return float('-inf') if r is None else r - now

        fresh = [n for n in sorted(robots, key=left)
                 if robots[n].stamp is not None
                 and abs(now - robots[n].stamp) <= self.max_input_age]
        take = fresh[:self.max_robots]
        out = {n: f'the frame is full ({self.max_robots} robots)' for n in fresh[len(take):]}
        return Plan(take, 0.0 if take else self.look, out)


class BatchGuide:
    """Guides ([Guide or None] per row) for one batched denoise of chunks [b, horizon, dim];
    rows without one are sampled unguided (their correction is exactly zero). The same
    interface as Guide, so Pi05.denoise takes it. One beta for the batch (the engine's)."""

    def __init__(self, guides: list[Guide | None], horizon: int, dim: int, beta: float):
        self.guides, self.beta = guides, beta
        b = len(guides)
        self.target = torch.zeros(b, horizon, dim)
        self.weights = torch.zeros(b, horizon, 1)
        self.columns = torch.zeros(b, 1, dim)
        for i, g in enumerate(guides):
            if g is None:
                continue
            self.target[i] = g.target.float()
            self.weights[i, :, 0] = g.weights
            self.columns[i, :, :g.columns] = 1.0
            self.columns[i, :, list(g.free)] = 0.0

    def velocity(self, x: torch.Tensor, t: float, velocity) -> torch.Tensor:
        return guided(x, t, self.beta, velocity, self._error)

    def _error(self, clean: torch.Tensor) -> torch.Tensor:
        dev = clean.device
        return (self.target.to(dev) - clean) * self.weights.to(dev) * self.columns.to(dev)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        if self.beta == 0.0:
            return x
        x = x.clone()
        for i, g in enumerate(self.guides):
            if g is not None:
                x[i, :g.delay, :g.columns] = g.target[:g.delay, :g.columns].to(x.device,
                                                                                x.dtype)
        return x
