#!/usr/bin/env python3
"""Cost of the joint limits per control tick: Player.tick of several versions of
oxygen_ros/robot/limits.py and playback.py, interleaved tick by tick in one run.

    python tools/bench_limits.py                        # 5cdb457 (speed only) vs this tree
    python tools/bench_limits.py --revs 5cdb457 eb58720 tree --ticks 700 --repeats 3
    python tools/bench_limits.py --revs tree tree       # A/A: the noise of the machine
    python tools/bench_limits.py --revs tree tree --set 1 SMALL 0 --kinds smooth still

Each version (a git revision, or `tree` for the working tree) is loaded from its own copy
of the two files, so versions with different limits (5cdb457 knows only position and speed)
run side by side. The cases, from the robot files' joint limits, action rate and
play_steps at 70 Hz with a 0.5 s horizon: ALOHA and DROID, each with smooth chunks (slow
sines, well within the limits), white-noise chunks (uniform over the range) and, with
--kinds, still ones (targets where the robot rests). Each version drives its own modelled
controller (perfect tracking of the cubic it was sent), so each sees the measured positions
its own commands lead to; the chunks and their arrival times are the same for all. Prints
the median and 90th percentile microseconds per tick (the thread's CPU time: on a shared
machine wall-clock times mostly measure the neighbours) and each version's median over the
first's. Needs only numpy and PyYAML (no ROS).
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = ('limits.py', 'playback.py')


def load(rev: str, where: pathlib.Path):
    """(limits module, playback module) of `rev` ('tree': the working tree), as a package
    of their own under `where` (a revision named twice is loaded twice: an A/A run shows
    the noise)."""
    name = 'lim_' + ''.join(c if c.isalnum() else '_' for c in rev)
    while (where / name).exists():
        name += '_'
    pkg = where / name
    pkg.mkdir()
    (pkg / '__init__.py').write_text('')
    for f in FILES:
        if rev == 'tree':
            text = (ROOT / 'oxygen_ros' / f).read_text()
        else:
            text = subprocess.run(['git', '-C', str(ROOT), 'show', f'{rev}:oxygen_ros/{f}'],
                                  check=True, capture_output=True, text=True).stdout
        (pkg / f).write_text(text.replace('from oxygen_ros.robot.limits import',
                                          'from .limits import'))
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    return importlib.import_module(f'{name}.limits'), importlib.import_module(f'{name}.playback')


def robot(file: str):
    """(action_dim, {index: {key: value}}, action period, play_steps, hold margin) from a
    robot file and pi05.yaml's defaults."""
    p = yaml.safe_load((ROOT / 'config' / 'pi05.yaml').read_text())['/**']['ros__parameters']
    p.update(yaml.safe_load((ROOT / 'config' / file).read_text())['/**']['ros__parameters'])
    stated = {}
    for g, joints in p['joint_limits'].items():
        names, idx = p['outputs'][g]['joints'], p['outputs'][g]['indices']
        for j, lim in joints.items():
            stated[idx[names.index(j)]] = (f'{g}/{j}', {k: float(v) for k, v in lim.items()})
    dim = max(max(o['indices']) for o in p['outputs'].values()) + 1
    rate = p.get('action_rate_hz') or p['control_rate_hz']
    return (dim, stated, 1.0 / rate, p.get('play_steps', 0), p.get('limit_hold_margin', 0.1),
            p['max_command_horizon'], p['control_rate_hz'])


def limits_of(mod, dim, stated, margin):
    """`mod`'s JointLimits, with the keys its Limit knows."""
    known = set(mod.Limit.__dataclass_fields__)
    lim = {i: (n, mod.Limit(**{k: v for k, v in e.items() if k in known}))
           for i, (n, e) in stated.items()}
    return mod.JointLimits(dim, lim, margin)


class Controller:
    """joint_trajectory_controller's cubic Hermite from its state to each point, perfect
    tracking (test_spline.py models it the same way)."""

    def __init__(self, q):
        self.t0, self.seg, self.rest = 0.0, [], np.array(q, dtype=float)

    def state(self, t):
        tau = t - self.t0
        for a, b, p0, v0, p1, v1 in self.seg:
            if a <= tau < b:
                T, u = b - a, tau - a
                c2 = (-3 * p0 + 3 * p1 - 2 * v0 * T - v1 * T) / T ** 2
                c3 = (2 * p0 - 2 * p1 + v0 * T + v1 * T) / T ** 3
                return p0 + v0 * u + c2 * u * u + c3 * u ** 3
        return self.rest.copy()

    def receive(self, t, times, pos, vel):
        p = self.state(t)
        v = np.zeros_like(p)
        if self.seg:
            v = self._velocity(t)
        self.t0, self.seg, ta = t, [], 0.0
        for tb, p1, v1 in zip(times, pos, vel, strict=True):
            self.seg.append((ta, tb, p, v, p1, v1))
            ta, p, v = tb, p1, v1
        self.rest = pos[-1].copy()

    def _velocity(self, t):
        tau = t - self.t0
        for a, b, p0, v0, p1, v1 in self.seg:
            if a <= tau < b:
                T, u = b - a, tau - a
                c2 = (-3 * p0 + 3 * p1 - 2 * v0 * T - v1 * T) / T ** 2
                c3 = (2 * p0 - 2 * p1 + v0 * T + v1 * T) / T ** 3
                return v0 + 2 * c2 * u + 3 * c3 * u * u
        return np.zeros_like(self.rest)


def inputs(rng, kind, lo, hi, n_chunks, length, period):
    """The chunks of a case: (arrival time, [length, dim] targets) each."""
    mid, span = (lo + hi) / 2, hi - lo
    out, t = [], 0.0
    for _ in range(n_chunks):
        i = np.arange(length)[:, None] * period + t
        if kind == 'smooth':
            # Slow sines over a fifth of the range: well within every speed limit.
            x = mid + 0.1 * span * np.sin(2 * np.pi * 0.3 * i + np.arange(len(lo)))
        elif kind == 'still':
            x = mid + 0 * i  # where the robot rests: every point fits
        else:
            x = rng.uniform(lo + 0.05 * span, hi - 0.05 * span, (length, len(lo)))
        out.append((t, x))
        t += rng.uniform(0.5, 1.5) * period * 4
    return out


def case(versions, file, kind, ticks, seed, clock=time.thread_time_ns):
    """{version: [µs per tick]} for one case, the versions' ticks interleaved."""
    dim, stated, period, play, margin, horizon, rate = robot(file)
    lo, hi = np.full(dim, -1.0), np.full(dim, 1.0)
    for i, (_, e) in stated.items():
        if 'lower' in e:
            lo[i], hi[i] = e['lower'], e['upper']
    rng = np.random.default_rng(seed)
    length = 50 if file == 'aloha.yaml' else 15
    chunks = inputs(rng, kind, lo, hi, ticks, length, period)
    q = (lo + hi) / 2
    runs = []
    for lim, play_mod in versions:
        player = play_mod.Player(horizon, play_steps=play, hold_after=1.0 / rate,
                                 limits=limits_of(lim, dim, stated, margin))
        runs.append((player, Controller(q), play_mod.make_chunk, []))
    nxt = 0
    for tick in range(ticks):
        t = tick / rate
        new = None
        while nxt < len(chunks) and chunks[nxt][0] <= t:
            new = chunks[nxt]
            nxt += 1
        # Rotate who goes first, so no version always runs right after another.
        order = runs[tick % len(runs):] + runs[:tick % len(runs)]
        for player, ctl, make, us in order:
            if new is not None:
                player.play(make(new[0], period, new[1]))
            m = ctl.state(t)
            a = clock()
            cmd = player.tick(t, hold_at=lambda m=m: m)
            us.append((clock() - a) / 1e3)
            if cmd is not None:
                ctl.receive(t, cmd.times, cmd.positions, cmd.velocities)
    return [r[3] for r in runs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--revs', nargs='+', default=['5cdb457', 'tree'],
                    help="git revisions to compare, 'tree' for the working tree; ratios are "
                         'to the first')
    ap.add_argument('--ticks', type=int, default=700)
    ap.add_argument('--repeats', type=int, default=3)
    ap.add_argument('--kinds', nargs='+', default=['smooth', 'noise'],
                    choices=['smooth', 'noise', 'still'])
    ap.add_argument('--set', nargs=3, action='append', default=[], metavar=('N', 'NAME', 'VALUE'),
                    help='set limits.NAME = VALUE (a number) in the N-th version, e.g. to '
                         'compare a tuning constant')
    ap.add_argument('--wall', action='store_true',
                    help='wall-clock time instead of the thread\'s CPU time (which leaves out '
                         'the time other processes take the core)')
    a = ap.parse_args()
    clock = time.perf_counter_ns if a.wall else time.thread_time_ns
    with tempfile.TemporaryDirectory() as d:
        versions = [load(r, pathlib.Path(d)) for r in a.revs]
        for n, name, value in a.set:
            setattr(versions[int(n)][0], name, float(value))
        print(f'µs per Player.tick ({"wall clock" if a.wall else "CPU time"}), median (p90) '
              f'over {a.ticks} ticks x {a.repeats}; ratio: median / {a.revs[0]}')
        print(f'{"case":<16}' + ''.join(f'{r:>22}' for r in a.revs))
        for file in ('aloha.yaml', 'droid.yaml'):
            for kind in a.kinds:
                us = [[] for _ in versions]
                for rep in range(a.repeats):
                    got = case(versions, file, kind, a.ticks, rep, clock)
                    for x, y in zip(us, got, strict=True):
                        x += y
                med = [float(np.median(x)) for x in us]
                cells = [f'{m:7.0f} ({np.percentile(x, 90):5.0f}) x{m / med[0]:4.1f}'
                         for m, x in zip(med, us, strict=True)]
                print(f'{file[:-5] + " " + kind:<16}' + ''.join(f'{c:>22}' for c in cells))


if __name__ == '__main__':
    main()
