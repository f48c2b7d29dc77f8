"""When a robot's next frame may start, what it brings, and its chunk back as commands.

``Intake`` is the part of a robot that needs no ROS between its latest samples
(inputs.Inputs) and the engine: whether a frame may start (fresh, complete, not stale,
replan_after passed or the chunk being played about to run out), the observation and
state it is built from, whether it narrates, where its chunk joins the one being played
(real-time chunking), and the chunk decoded into the robot's joint targets. Stale or
missing inputs hold the robot (``hold``) and are reported; the ROS link feeds it the
samples and publishes what comes out.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .inputs import Inputs, problem_key
from .playback import Chunk, make_chunk, replan_at, runs_out
from .report import Reporter

# Stale or missing inputs are looked at this often (s) while no frame can start.
CHECK_S = 0.05
# With replan_after, the next frame starts at the latest this percentile of the robot's last
# LEAD_FRAMES frame-to-chunk latencies, or the last one if longer, plus a control period,
# before the chunk being played runs out: a machine that got slower moves it from the next
# frame on, one slow frame among fast ones for the next frame only.
LEAD_FRAMES = 20
LEAD_PERCENTILE = 95
# How long the chunk before still had to run when a chunk came, for the last this many.
SPARE_KEPT = 100


def replan_lead(latency, margin: float) -> float | None:
    """How long before a chunk runs out its next frame must start (s): the
    LEAD_PERCENTILE-th percentile of the last LEAD_FRAMES latencies (frame stamp to its
    chunk) or the last one, whichever is longer, plus `margin`; None when none was
    measured."""
    # Asked every few ms while a chunk plays: numpy's percentile (linear) on a short list.
    recent = list(itertools.islice(reversed(latency), LEAD_FRAMES))  # newest first
    if not recent:
        return None
    last = recent[0]
    recent.sort()
    i, f = divmod((len(recent) - 1) * LEAD_PERCENTILE / 100, 1)
    i = int(i)
    high = recent[i] + (recent[min(i + 1, len(recent) - 1)] - recent[i]) * f
    return max(high, last) + margin


@dataclass
class Ready:
    """What a robot brings to a frame: the observation and what its chunk needs."""

    obs: object  # engine.Observation
    state: np.ndarray  # the robot-convention state the actions are decoded against
    stamp: float
    narrate: bool
    handover: object  # engine.Handover or None


class Intake:
    """``now()``: the node's clock (s); ``hold(why)``: stop commanding the robot;
    ``take_joints()``: take the joint states waiting (a frame is built from all of them);
    ``latency``: the recent frame-stamp-to-chunk delays (s), for the handover's delay and
    how early the next frame starts."""

    def __init__(self, cfg, inputs: Inputs, reporter: Reporter, now: Callable[[], float],
                 hold: Callable[[str], None], take_joints: Callable[[], None], latency,
                 lock: threading.Lock):
        self.cfg, self.inputs, self.reporter = cfg, inputs, reporter
        self.assembler = inputs.assembler
        self.now, self.hold, self.take_joints = now, hold, take_joints
        self.latency = latency
        self.lock = lock  # the link's: guards the prompt and the narrate flag
        self.player = None
        self.prompt = cfg.p.prompt
        self.narrate_now = False
        self.frames = 0  # frames assembled, for narration_every_n_frames
        self.rtc_delay = 0
        self.checked = 0.0  # monotonic: when staleness was last looked at
        self._stale_since: float | None = None  # monotonic: inputs stale since
        self.resume_at = 0.0  # monotonic: no chunk plays before this (listening)
        self.last: Chunk | None = None  # the last chunk made
        # When a chunk came, how long the one before it still had to run (s; negative: it
        # had run out that long before), for the last SPARE_KEPT chunks.
        self.spare: collections.deque = collections.deque(maxlen=SPARE_KEPT)

    def rebase(self):
        """Activating: frames from inputs that come after this."""
        self.inputs.rebase()
        self._stale_since = None
        self.resume_at = 0.0
        self.last = None  # the chunk before the first one is none of this activation's

    def set_prompt(self, text: str):
        with self.lock:
            self.prompt = text.strip()
            self.narrate_now = True

    def narrate(self):
        with self.lock:
            self.narrate_now = True

    def listening(self) -> bool:
        return time.monotonic() < self.resume_at

    # -- may a frame start? ----------------------------------------------------------------

    def poll(self, slots) -> tuple[Ready | None, float]:
        """When a frame can start, what it needs; otherwise None and how long to wait before
        asking again (stale or missing inputs hold the robot and are reported). ``slots``:
        the engine's image slots. The caller has taken the newest images."""
        wait = self.replan_wait(self.now())
        if wait > 0:
            # The chunk plays on; the inputs that came meanwhile start the frame when it is
            # due, and stale ones still hold the robot.
            self.check(self.now())
            return None, min(wait, CHECK_S)
        if self.assembler.fresh():
            # A frame may start: with every joint state received by now, so that it is
            # built from the inputs as they came (a replay of a recording rebuilds it so),
            # not as the last control tick left them.
            self.take_joints()
        now = self.now()
        if not self.assembler.fresh() and time.monotonic() - self.checked < CHECK_S:
            return None, 0.002
        self.checked = time.monotonic()
        frame, why = self.assembler.ready(now)
        if frame is None:
            if why.startswith('no new input'):
                return None, 0.002
            self.reporter.report(problem_key('frame', why), f'no frame: {why}')
            if 'stale' in why or 'missing' in why or 'ahead of the clock' in why:
                self._went_stale()
                self.hold(f'inputs: {why}')
                # Until something comes back, checking every CHECK_S is enough.
                return None, CHECK_S
            return None, 0.0
        try:
            with self.lock:
                prompt = self.prompt
            obs, state = self.inputs.observation(frame, slots, prompt)
        except ValueError as e:
            self.reporter.report(problem_key('frame', str(e)), f'no frame: {e}')
            return None, 0.0
        self._came_back()
        for note in frame.notes:
            self.reporter.report(problem_key('mask', note), f'camera {note} (masked)')
        self.frames += 1
        every = self.cfg.p.narration_every_n_frames
        with self.lock:
            narrate = self.narrate_now or (every > 0 and self.frames % every == 1 % every)
            self.narrate_now = False
        # A stamp within max_future_stamp ahead must not shift the chunk into the future.
        stamp = min(frame.stamp, now)
        handover = self.handover(stamp, state) if self.cfg.p.rtc else None
        return Ready(obs, state, stamp, narrate, handover), 0.0

    def times(self):
        """What a planner needs of this robot: when its chunk runs out, and the stamp of a
        new observation (None: none since its last frame, or stale inputs). The caller has
        taken the newest images first: the clock is read after them, as converting them
        takes a while and inputs that came meanwhile must not look stamped ahead of it."""
        from oxygen_ros.engine.fleet import RobotTimes

        now = self.now()
        chunk = self.player.chunk if self.player is not None else None
        end = None if chunk is None else runs_out(chunk, self.player.play_steps)
        stamp = None
        a = self.assembler
        if a.fresh() and self.stale(now) is None and not self.replan_wait(now):
            got = [a.latest(n) for n in a.trigger]
            stamps = [x.stamp for x in got if x is not None]
            stamp = max(stamps) if stamps else None
        return RobotTimes(end, stamp)

    def check(self, now: float):
        """Between this robot's frames: stale or missing inputs hold it, as they do when a
        frame of its own is sought; every CHECK_S."""
        if time.monotonic() - self.checked < CHECK_S:
            return
        self.checked = time.monotonic()
        why = self.stale(now)
        if why:
            self.reporter.report(problem_key('frame', why), f'no frame: {why}')
            self._went_stale()
            self.hold(f'inputs: {why}')

    def stale(self, now: float) -> str | None:
        """Which required inputs are stale or missing now (Assembler's words), or None."""
        return self.inputs.stale(now)

    def tick_check(self, now: float):
        """The control thread's look at every tick while a chunk plays: a required input
        gone stale holds the robot at once, not when the engine thread next looks (after a
        long frame) or the chunk runs out."""
        player = self.player
        if player is None or player.chunk is None:
            return
        why = self.stale(now)
        if why:
            self.reporter.report(problem_key('frame', why), f'no frame: {why}')
            self._went_stale()
            self.hold(f'inputs: {why}')

    def lead(self) -> float | None:
        """How long before the chunk being played runs out the next frame starts at the
        latest (s), as measured (replan_lead with a control period's margin: the chunk
        that comes in time is played at the next control tick); None before any chunk."""
        return replan_lead(self.latency, 1.0 / self.cfg.p.control_rate_hz)

    def replan_wait(self, now: float) -> float:
        """How long until the next frame may start (0: now): once replan_after actions of the
        chunk are out, or `lead` s before it runs out if that comes first."""
        player = self.player
        chunk = player.chunk if player is not None else None
        steps = player.play_steps if player is not None else 0
        return max(0.0, replan_at(chunk, self.cfg.p.replan_after, self.lead(), steps) - now)

    def handover(self, stamp: float, state: np.ndarray):
        """Where this frame's chunk joins the chunk being played (real-time chunking): its
        first action is action `start` of that chunk, and `delay` actions will have run by
        the time it is out (the slowest of the last frames, unless rtc_delay says)."""
        from oxygen_ros.engine import Handover

        chunk = self.player.chunk
        if chunk is None or chunk.actions is None:
            return None
        start = int(round((stamp - chunk.stamp) / chunk.period))
        if start < 0:
            return None
        delay = self.cfg.p.rtc_delay
        if not delay:
            recent = list(self.latency)[-10:]
            delay = math.ceil(max(recent) / chunk.period) if recent else 0
        self.rtc_delay = delay
        # The same motion in this frame's terms (delta actions are relative to the state),
        # and as it is sent: clamped into the joint limits. Guided towards targets past a
        # limit, which the robot never reaches, each chunk went further past it than the
        # last until the node held the robot.
        profile = self.cfg.profile
        previous = profile.rebase(chunk.actions, chunk.state, state)
        lim = self.cfg.limits
        if lim is not None:
            moved = np.clip(chunk.positions, lim.lower, lim.upper) - chunk.positions
            if np.any(moved):
                shifted = profile.shifted(previous, moved)
                previous = previous if shifted is None else shifted
        return Handover(start, delay, previous)

    def _went_stale(self):
        if self._stale_since is None:
            self._stale_since = time.monotonic()

    def _came_back(self):
        """Inputs are back: after a long silence (a network partition looks like one) the
        robot may have been taken over by another node meanwhile, which this node hears only
        once DDS has rediscovered it, so it listens before commanding again."""
        since, self._stale_since = self._stale_since, None
        check = self.cfg.p.commander_check
        if since is not None and check and time.monotonic() - since >= check:
            self.resume_at = time.monotonic() + check

    # -- the chunk back --------------------------------------------------------------------

    def chunk(self, stamp: float, state: np.ndarray, actions: np.ndarray) -> Chunk | None:
        """The model's actions as the robot's joint targets, or None (reported, holding)
        when they cannot be commanded."""
        profile = self.cfg.profile
        try:
            targets = profile.decode_actions(actions, state)
        except ValueError as e:
            self.reporter.report(problem_key('actions', str(e)), f'actions not usable: {e}')
            self.hold(f'model failure: {e}')
            return None
        if not np.all(np.isfinite(targets)):
            self.reporter.report('actions:nonfinite', 'model produced NaN/inf actions; '
                                 'not commanding this chunk')
            self.hold('model failure: NaN/inf actions')
            return None
        # A profile whose targets are relative to where the robot is (DROID's velocities)
        # re-anchors the chunk on the state measured as each action step starts.
        reanchor = None
        if profile.reanchors:
            def reanchor(first, measured, a=actions):
                return profile.reanchor(a, measured=measured, first=first)
        chunk = make_chunk(stamp, self.cfg.action_period, targets, actions, state, reanchor)
        self.came(chunk, self.now())
        return chunk

    def came(self, chunk: Chunk, now: float):
        """`chunk` came at `now`: how long the one before it still had to run."""
        before, self.last = self.last, chunk
        if before is not None:
            steps = self.player.play_steps if self.player is not None else 0
            self.spare.append(runs_out(before, steps) - now)
