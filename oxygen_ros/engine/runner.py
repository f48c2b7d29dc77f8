"""Frames: the scheduler's decisions run on the model, one robot or many alike.

A frame is two calls. ``actions(inputs)`` checks each robot's inputs (a robot whose inputs
are wrong is left out with its reason), lets the scheduler decide the frame (``plan``: which
requests get KV rows, where the observations go) and runs its prefill and denoise (``act``):
the chunks are out. The caller sends them to the robots; then ``language(frame)`` starts the
frame's requests from its prefill and decodes (``speak``), and the frame ends. Nothing is
published from in here. Between the two calls the frame owns the scheduler: a cancel from
another thread waits for ``language``, which does it before the frame ends.

Should the model fail on a batch of robots, each is run alone, so that a failure stays with
the robot it belongs to.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .budget import AdaptiveK
from .inputs import ModelInputs, Prepared
from .io import FleetResult, FrameResult, RobotInput
from .questions import Questions
from .requests import Request
from .scheduler import BatchError, FramePlan


class RobotState:
    """The engine's state of one robot."""

    def __init__(self, name: str, seed: int):
        self.name = name
        self.noise = torch.Generator().manual_seed(seed)
        self.inbox: list[Request] = []  # questions waiting for this robot's next frame
        self.last: torch.Tensor | None = None  # the last chunk, model space (RTC)
        self.guided = 0
        self.frames = 0
        self.errors = 0
        self.prompt: tuple[str, tuple] | None = None  # host tokens of the last prompt


@dataclass
class Part:
    """The robots of one scheduler frame (a batch; after a failed batch, one robot)."""

    names: list[str]
    prepared: list[Prepared]
    requests: list[list[Request]]
    narrations: dict[str, Request]
    plan: FramePlan


@dataclass
class OpenFrame:
    """A frame between actions() and language(). ``chunks``: robot -> its chunk [horizon,
    action_dim], the robot's units; ``result`` gathers the rest (errors now, results and
    events once language() has run)."""

    chunks: dict = field(default_factory=dict)
    result: FleetResult = field(default_factory=FleetResult)
    parts: list[Part] = field(default_factory=list)
    owns: bool = False  # holds the scheduler until language() or abandon()


class Runner:
    def __init__(self, cfg, scheduler, cache, inputs: ModelInputs, questions: Questions,
                 robots: dict[str, RobotState], owner: threading.Lock, budget_ms: float):
        self.cfg, self.scheduler, self.cache, self.inputs = cfg, scheduler, cache, inputs
        self.questions, self.robots, self.owner = questions, robots, owner
        self.stats_lock = threading.Lock()
        self.recent = collections.deque(maxlen=200)  # (wall time, frame ms, tokens)
        self.frames = 0
        # What stats() reports of the scheduler, taken by the thread that runs frames as
        # each ends: diagnostics run on another thread, and the scheduler's lists and row
        # owners change under them while a frame runs.
        self.snap = self.snapshot()
        # Frame start to chunks out, per robots in the frame, for planning.
        self.chunk_ms = AdaptiveK(budget_ms, 1)

    def prepare(self, name: str, inp: RobotInput) -> Prepared:
        rb = self.robots.get(name)
        if rb is None:
            added = sorted(n for n in self.robots if n)
            raise ValueError(f'unknown robot {name!r}; this engine has {added}')
        return self.inputs.prepare(rb, name, inp)

    def actions(self, inputs: dict[str, RobotInput], alone: bool = False) -> OpenFrame:
        """``alone``: step's robot, whose wrong inputs and model failures raise as they are
        instead of becoming its error."""
        frame = OpenFrame()
        ready = {}
        for name, inp in inputs.items():
            try:
                ready[name] = self.prepare(name, inp)
            except Exception as e:  # noqa: BLE001 - whatever it is, it is this robot's
                if alone:
                    raise
                frame.result.errors[name] = str(e)
                if name in self.robots:
                    self.robots[name].errors += 1
                continue
            if len(ready) > self.cfg.robots:
                del ready[name]
                frame.result.errors[name] = (f'the frame is full: this engine takes at most '
                                             f'{self.cfg.robots} robots a frame (robots)')
        if not ready:
            return frame
        self.owner.acquire()
        frame.owns = True
        try:
            self._act(ready, frame, alone)
        except BaseException:
            self.abandon(frame)
            raise
        return frame

    def _act(self, ready: dict[str, Prepared], frame: OpenFrame, alone: bool) -> None:
        names = list(ready)
        parts = [ready[n] for n in names]
        f = self.inputs.batch(parts)
        requests, narrations = [], {}
        limit = self.cfg.max_new_tokens
        with self.questions.lock:
            self.questions.cancel_requested()
            for n, p in zip(names, parts, strict=True):
                asks, p.robot.inbox = p.robot.inbox, []
                for r in asks:
                    r.stamp = p.inp.obs.stamp
                if p.inp.narrate:
                    narrations[n] = Request(
                        stamp=p.inp.obs.stamp, prompt=p.inp.obs.prompt,
                        max_new_tokens=p.inp.max_new_tokens or limit,
                        stop_at_eos=self.cfg.stop_at_eos, temperature=self.cfg.temperature,
                        seed=self.cfg.seed, eos_id=self.questions.tokenizer.eos_id, robot=n)
                    asks = asks + [narrations[n]]
                requests.append(asks)
        part = Part(names, parts, requests, narrations, self.scheduler.plan(f, requests))
        try:
            actions = self.scheduler.act(part.plan)
        except BatchError as e:
            self._failed(part, e, frame.result)
            if len(names) > 1:
                # Each robot alone: the one the model fails on fails, the others run.
                for n in names:
                    self._act({n: ready[n]}, frame, alone)
                return
            parts[0].robot.errors += 1
            if alone:
                raise e.__cause__ from None
            frame.result.errors[names[0]] = f'the model failed: {e.__cause__!r}'
            return
        frame.parts.append(part)
        for i, n in enumerate(names):
            frame.chunks[n] = self.inputs.actions_out(actions[i])

    def language(self, frame: OpenFrame) -> FleetResult:
        result = frame.result
        try:
            for part in frame.parts:
                self._speak(part, frame)
        finally:
            self._release(frame)
        for name, events in result.events.items():
            if name in result.results:
                result.results[name].events = events
        return result

    def _speak(self, part: Part, frame: OpenFrame) -> None:
        out = self.scheduler.speak(part.plan)
        result = frame.result
        events = self.questions.events(out) + self.questions.take_ended()
        for ev in events:
            result.events.setdefault(ev.robot, []).append(ev)
        timing = dict(out.timing)
        for i, (n, p) in enumerate(zip(part.names, part.prepared, strict=True)):
            if self.cfg.rtc:
                p.robot.last = out.actions[i].clone()
                p.robot.guided += p.guide is not None
            p.robot.frames += 1
            r = FrameResult(stamp=p.inp.obs.stamp, actions=frame.chunks[n], timing=timing,
                            robot=n)
            nr = part.narrations.get(n)
            if nr is not None and nr.reason == 'rejected':
                whose = f'robot {n!r} frame' if n else 'frame'
                r.rejected = (f'narration request of {whose} {p.inp.obs.stamp:.3f} '
                              f'rejected: {nr.note}')
            result.results[n] = r
        result.timing = timing
        self.chunk_ms.observe(len(part.names), timing['chunk_ms'])
        snap = self.snapshot()
        with self.stats_lock:
            self.frames += 1
            self.recent.append((time.monotonic(), timing['frame_ms'], len(out.tokens)))
            self.snap = snap

    def abandon(self, frame: OpenFrame) -> None:
        """A frame whose language will not run (its caller failed between the calls): the
        rows planned for it are free, and its questions wait for the next frame."""
        try:
            for part in frame.parts:
                self.scheduler.abandon(part.plan)
                self._requeue(part)
            frame.parts = []
        finally:
            self._release(frame)

    def _release(self, frame: OpenFrame) -> None:
        if frame.owns:
            frame.owns = False
            self.owner.release()

    def _failed(self, part: Part, e: BatchError, result: FleetResult) -> None:
        """A failed batch: what it ended is reported, its questions not started go back to
        their robots' inboxes (a retry or the next frame starts them)."""
        for ev in self.questions.events(e.out):
            result.events.setdefault(ev.robot, []).append(ev)
        self._requeue(part)

    def _requeue(self, part: Part) -> None:
        waiting = {r.id for r, _ in self.scheduler.admit.pending}
        with self.questions.lock:
            for p, rs in zip(part.prepared, part.requests, strict=True):
                again = [r for r in rs if r.kind == 'question' and r.row is None
                         and not r.finished and r.id not in waiting]
                p.robot.inbox[:0] = again

    def refresh(self) -> None:
        """A new snapshot for stats(); the caller owns the scheduler."""
        snap = self.snapshot()
        with self.stats_lock:
            self.snap = snap

    def snapshot(self) -> dict:
        s = self.scheduler
        active = [r.robot for r in s.active]
        pending = [r.robot for r, _ in s.admit.pending]
        c = self.cache
        robots = {n: dict(kv_rows=c.held(n), kv_row_cap=c.cap(n),
                          active_requests=active.count(n), pending_requests=pending.count(n))
                  for n in self.robots if n}
        return dict(active_requests=len(active), pending_requests=len(pending),
                    deadline_misses=s.deadline_misses, rejected_requests=s.admit.rejected,
                    dropped_requests=s.admit.dropped, robots=robots)

    def robot_stats(self, name: str) -> dict:
        """One robot's part of the engine, for its diagnostics (safe from any thread)."""
        rb = self.robots[name]
        with self.stats_lock:
            snap = self.snap['robots'].get(name) or dict(
                kv_rows=0, kv_row_cap=self.cache.cap(name), active_requests=0,
                pending_requests=0)
            out = dict(frames=rb.frames, errors=rb.errors, rtc_frames=rb.guided, **snap)
        with self.questions.lock:
            out['questions_waiting'] = len(rb.inbox)
        return out

    def stats(self, action_horizon: int) -> dict:
        """The engine's figures for diagnostics; safe from any thread (the scheduler's part
        is the snapshot taken as the last frame ended)."""
        with self.stats_lock:
            recent = list(self.recent)
            snap = dict(self.snap)
            frames = self.frames
        ms = np.array([m for _, m, _ in recent])
        tokens = sum(n for _, _, n in recent)
        # Frame times only once a frame has run: no frame is not a 0 ms frame.
        times = dict(action_hz=action_horizon * 1000.0 / ms.mean(),
                     frame_ms_p50=float(np.percentile(ms, 50)),
                     frame_ms_p99=float(np.percentile(ms, 99)),
                     tokens_per_s=tokens * 1000.0 / ms.sum()) if recent else {}
        return dict(
            frames=frames,
            **times,
            active_requests=snap['active_requests'],
            pending_requests=snap['pending_requests'],
            questions_waiting=self.questions.waiting(),
            kv_bytes=self.cache.total_bytes,
            kv_bytes_per_slot=self.cache.bytes_per_slot,
            deadline_misses=snap['deadline_misses'],
            rtc_frames=sum(rb.guided for rb in self.robots.values()),
            rejected_requests=snap['rejected_requests'],
            dropped_requests=snap['dropped_requests'],
        )
