"""When a robot's next frame starts under replan_after: once n actions of the chunk are out,
or earlier by the measured frame-to-chunk latency when the chunk would otherwise run out
before the next one comes; and the spare time each chunk came with. Plain numpy, on a fake
clock."""
import collections
import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from support.robots import robot_config

from oxygen_ros.robot.intake import Intake, replan_lead
from oxygen_ros.robot.playback import Player, make_chunk, replan_at, runs_out

USED_UP = 'action chunk used up before the next one arrived'


def test_replan_at_moves_earlier_by_the_lead_and_replan_after_bounds_it():
    # 50 actions at 2.0, 2.02, ..., 2.98: replan_after 45 is 2.9; the chunk runs out at 2.98.
    c = make_chunk(2.0, 0.02, np.zeros((50, 2)))
    assert replan_at(c, 45) == pytest.approx(2.9)
    assert replan_at(c, 45, None) == pytest.approx(2.9)  # nothing measured: as before
    assert replan_at(c, 45, 0.05) == pytest.approx(2.9)  # the lead leaves more: the bound
    assert replan_at(c, 45, 0.15) == pytest.approx(2.83)
    assert replan_at(c, 45, 0.3) == pytest.approx(2.68)
    assert replan_at(c, 10, 0.3) == pytest.approx(2.2)  # replan_after still the latest
    # Longer than the chunk: at once (its stamp is past).
    assert replan_at(c, 45, 2.0) < 2.0
    # With play_steps the chunk runs out at its last action played.
    assert replan_at(c, 45, 0.15, play_steps=30) == pytest.approx(2.0 + 29 * 0.02 - 0.15)
    assert replan_at(c, 0, 0.15) == -math.inf
    assert replan_at(None, 45, 0.15) == -math.inf


def test_the_lead_is_a_high_percentile_of_the_recent_latencies():
    assert replan_lead([], 0.01) is None
    assert replan_lead([0.1], 0.01) == pytest.approx(0.11)
    # A slow frame moves it at once (the machine may have got slower)...
    steady = [0.1] * 19
    assert replan_lead(steady + [0.5], 0.0) == pytest.approx(0.5)
    # ... and for one frame only when the next ones are fast again (not the max), unless
    # they come often (not the mean).
    assert replan_lead(steady[1:] + [0.5, 0.1], 0.0) < 0.13
    assert replan_lead(steady[2:] + [0.5, 0.5, 0.1], 0.0) == pytest.approx(0.5)
    assert replan_lead([0.1] * 10 + [0.2] * 10, 0.0) == pytest.approx(0.2)
    # Only the last twenty count.
    assert replan_lead([0.9] * 30 + [0.1] * 20, 0.0) == pytest.approx(0.1)
    # numpy's percentile (or the last, if longer) of the last twenty, however many there are.
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 20, 21, 60):
        lat = collections.deque(rng.uniform(0.05, 0.3, n), maxlen=500)
        want = max(np.percentile(list(lat)[-20:], 95), lat[-1]) + 0.01
        assert replan_lead(lat, 0.01) == pytest.approx(want, rel=1e-12)


def intake(replan_after=45, latency=(), play_steps=0, clock=None):
    cfg = robot_config('aloha.yaml', replan_after=replan_after)
    clock = clock if clock is not None else [0.0]
    it = Intake(cfg, SimpleNamespace(assembler=None, rebase=lambda: None), None,
                lambda: clock[0], None, None, collections.deque(latency, maxlen=500),
                threading.Lock())
    it.player = Player(1.0, play_steps=play_steps)
    return it, cfg


def test_replan_wait_moves_earlier_as_the_latencies_grow():
    it, cfg = intake()
    period, tick = cfg.action_period, 1.0 / cfg.p.control_rate_hz
    chunk = make_chunk(10.0, period, np.zeros((50, 14)))
    it.player.play(chunk)
    end = runs_out(chunk)
    assert end == pytest.approx(10.98)
    # Nothing measured yet: 45 actions, as before.
    assert it.replan_wait(10.0) == pytest.approx(0.9)
    starts = []
    for ms in (40, 60, 120, 160, 200, 400):
        it.latency.extend([ms / 1e3] * 20)
        starts.append(10.0 + it.replan_wait(10.0))
    # 40 and 60 ms leave 45 actions enough (80 ms less a control period); from 120 ms the
    # frame starts a latency and a control period before the end.
    assert starts[:2] == [pytest.approx(10.9)] * 2
    for ms, at in zip((120, 160, 200, 400), starts[2:]):
        assert at == pytest.approx(end - ms / 1e3 - tick)
    assert all(a >= b for a, b in zip(starts, starts[1:])) and starts[-1] < starts[2]
    # At the trigger it is due, and replan_after alone would have waited.
    at = starts[-2]
    assert it.replan_wait(at) == 0.0
    assert replan_at(chunk, 45) - at > 0.1


def test_replan_after_still_bounds_the_start():
    it, _ = intake(replan_after=10, latency=[0.15] * 20)
    it.player.play(make_chunk(10.0, 0.02, np.zeros((50, 14))))
    assert it.replan_wait(10.0) == pytest.approx(0.2)
    it.cfg.p.replan_after = 0  # 0: a frame whenever inputs come
    assert it.replan_wait(10.0) == 0.0


def test_without_latencies_replan_after_alone():
    it, _ = intake(replan_after=45)
    assert it.replan_wait(10.0) == 0.0  # nothing playing: at once
    it.player.play(make_chunk(10.0, 0.02, np.zeros((50, 14))))
    assert it.replan_wait(10.0) == pytest.approx(0.9)
    assert it.replan_wait(10.5) == pytest.approx(0.4)
    assert it.replan_wait(10.9 + 1e-9) == 0.0


def test_play_steps_end_the_chunk_earlier():
    it, cfg = intake(replan_after=45, latency=[0.1] * 20, play_steps=30)
    it.player.play(make_chunk(10.0, 0.02, np.zeros((50, 14))))
    tick = 1.0 / cfg.p.control_rate_hz
    assert it.replan_wait(10.0) == pytest.approx(29 * 0.02 - 0.1 - tick)


def run(proc, seconds=20.0, replan_after=45, camera_hz=25.0):
    """The node's frames on a fake clock: the engine looks every 2 ms, starts a frame when
    replan_wait lets it, from the newest camera image; its chunk comes proc(i) s after the
    frame started; the player ticks at the control rate. Returns the holds, each frame's
    (start, chunk being played) and the latencies."""
    clock = [0.0]
    it, cfg = intake(replan_after=replan_after, clock=clock)
    state = np.zeros(14)
    state[[6, 13]] = 0.03  # fingers (m)
    actions = np.zeros((50, 14))
    tick, step = 1.0 / cfg.p.control_rate_hz, 0.002
    holds, frames, pending, next_tick = [], [], None, 0.0
    for k in range(int(seconds / step)):
        now = clock[0] = k * step
        if pending is not None and now >= pending[0]:
            chunk = it.chunk(pending[1], state, actions)
            it.player.play(chunk)
            it.latency.append(now - pending[1])
            pending = None
        if now >= next_tick:
            cmd = it.player.tick(now, hold_at=lambda: np.zeros(14))
            if cmd is not None and cmd.hold:
                holds.append((now, cmd.hold))
            next_tick += tick
        if pending is None and it.replan_wait(now) == 0.0:
            stamp = math.floor(now * camera_hz + 1e-9) / camera_hz  # the newest image
            frames.append((now, it.player.chunk))
            pending = (now + proc(len(frames)), stamp)
    return holds, frames, list(it.latency), it


def test_a_slow_machine_never_runs_the_chunk_dry():
    # Frames of 120-160 ms on a 25 Hz camera: with replan_after 45 (4 actions, 80 ms, before
    # the end of a 50-action chunk at 50 Hz) every chunk came after the one before ran out,
    # and the robot held between chunks. With the lead none does.
    rng = np.random.default_rng(0)
    times = rng.uniform(0.12, 0.16, 200)
    holds, frames, latency, it = run(lambda i: times[i])
    assert len(frames) > 15
    assert [why for _, why in holds] == [], holds[:3]
    # Not needlessly early: each frame starts at most the slowest latency and a control
    # period (and a look of the engine) before its chunk runs out.
    tick = 1.0 / it.cfg.p.control_rate_hz
    for start, chunk in frames[2:]:
        left = runs_out(chunk) - start
        assert 0.0 < left <= max(latency) + tick + 0.002, left
    assert min(it.spare) > 0.0


def test_a_fast_machine_keeps_replan_after():
    # 30-45 ms frames on a 60 Hz camera (latencies under 62 ms, 80 ms with a control period):
    # every frame after the first starts once 45 actions of the chunk are out, as before.
    rng = np.random.default_rng(1)
    times = rng.uniform(0.03, 0.045, 200)
    holds, frames, latency, it = run(lambda i: times[i], camera_hz=60.0)
    assert max(latency) < 0.065
    assert holds == []
    for start, chunk in frames[1:]:
        assert start - chunk.stamp == pytest.approx(0.9, abs=0.002 + 1e-9)
    assert min(it.spare) > 0.0


def test_a_machine_that_slows_down_starts_its_frames_earlier():
    # 40 ms frames on a 60 Hz camera, then 150 ms ones from the 10th: that one's chunk comes
    # late (nothing measured said so yet), and from the next frame on the frames start
    # earlier and no chunk runs dry again.
    holds, frames, _, it = run(lambda i: 0.04 if i < 10 else 0.15, camera_hz=60.0)
    assert len(frames) > 20
    early = [start - chunk.stamp for start, chunk in frames[1:10]]
    late = [start - chunk.stamp for start, chunk in frames[10:]]
    assert early == [pytest.approx(0.9, abs=0.002 + 1e-9)] * 9
    assert max(late) < 0.83
    # Held once: between the 10th frame's chunk (at 0.9 s, 0.15 s late) and the chunk before.
    dry = [t for t, why in holds if why == USED_UP]
    assert len(dry) == 1 and frames[9][0] < dry[0] < frames[10][0], (dry, frames[9:11])
    assert holds == [(dry[0], USED_UP)]
    assert sorted(it.spare)[1] > 0.0  # every other chunk came in time


def test_spare_is_how_long_the_chunk_before_still_had_to_run():
    clock = [0.0]
    it, cfg = intake(clock=clock)
    state = np.zeros(14)
    state[[6, 13]] = 0.03
    actions = np.zeros((50, 14))
    it.chunk(1.0, state, actions)  # runs out at 1.98
    assert list(it.spare) == []  # nothing before it
    clock[0] = 1.9
    it.chunk(1.8, state, actions)
    assert list(it.spare) == [pytest.approx(0.08)]
    clock[0] = 2.9
    it.chunk(2.85, state, actions)  # the one before ran out at 2.78
    assert it.spare[-1] == pytest.approx(-0.12)
    # A new activation: its first chunk has none before it.
    it.rebase()
    clock[0] = 10.0
    it.chunk(9.9, state, actions)
    assert len(it.spare) == 2
    it.player.play_steps = 10  # with play_steps, the chunk ends at its last action played
    clock[0] = 10.1
    it.chunk(10.05, state, actions)
    assert it.spare[-1] == pytest.approx(9.9 + 9 * 0.02 - 10.1)
