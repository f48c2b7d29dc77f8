"""What a robot's diagnostics say: its counters and the rates and delays measured live."""

from __future__ import annotations

import collections
import math
import threading
import time

import numpy as np

from .report import Reporter
from .shadow import WINDOW_S

# How long a robot's diagnostics show ERROR after a fault of the node's own code (s): long
# enough for a 1 Hz diagnostics listener to see it.
FAULT_SHOWN_S = 5.0
COUNTERS = ('chunks', 'frames', 'published', 'hold_ticks', 'missed_ticks', 'narration_requests',
            'holds', 'rtc_delay', 'clamped_commands', 'faults', 'clock_jumps')


class RobotStats:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = dict.fromkeys(COUNTERS, 0)
        self.hold_reason = ''
        self.ticks = collections.deque(maxlen=2000)  # tick times
        self.gaps = collections.deque(maxlen=2000)
        self.publishes = collections.deque(maxlen=2000)  # monotonic: commands sent
        self.latency = collections.deque(maxlen=500)  # frame stamp -> its chunk, s
        self.chunk_times = collections.deque(maxlen=500)

    def add(self, name: str, n: int = 1):
        with self.lock:
            self.c[name] += n

    def tick(self, t: float, period: float):
        """A control tick at ``t``: ticks a period or more late count as missed."""
        if self.ticks:
            gap = t - self.ticks[-1]
            self.gaps.append(gap)
            if gap > 1.5 * period:
                self.c['missed_ticks'] += int(round(gap / period)) - 1
        self.ticks.append(t)

    def chunk(self, latency: float):
        self.c['chunks'] += 1
        self.latency.append(latency)
        self.chunk_times.append(time.monotonic())

    def commanding(self, horizon: float) -> bool:
        """Whether a command (not a hold) went out within ``horizon`` s."""
        return bool(self.publishes) and time.monotonic() - self.publishes[-1] < horizon

    def summary(self, rate_hz: float, chunk_ms: float) -> dict:
        """The robot's rates, delays and counters, as plain numbers."""
        s = {}
        now = time.monotonic()
        recent = [x for x in list(self.publishes) if now - x <= 5.0]
        s['control_publish_hz'] = len(recent) / 5.0
        # A figure with no samples yet is left out, not reported as 0 ms: a node that has not
        # ticked or produced a chunk has no jitter or latency to speak of.
        if self.gaps:
            gaps = np.array(list(self.gaps))
            s['tick_jitter_ms_p99'] = float(np.percentile(np.abs(gaps - 1.0 / rate_hz), 99)
                                            * 1e3)
            s['tick_gap_ms_max'] = float(gaps.max() * 1e3)
        # How late chunks come (the part of each chunk already in the past) and how far
        # apart: together they say whether a chunk lasts until the next.
        if self.latency:
            lat = np.array(list(self.latency))
            s['action_latency_ms_p50'] = float(np.percentile(lat, 50) * 1e3)
            s['action_latency_ms_p99'] = float(np.percentile(lat, 99) * 1e3)
        if len(self.chunk_times) > 1:
            s['chunk_interval_ms_p99'] = float(np.percentile(np.diff(list(self.chunk_times)),
                                                             99) * 1e3)
        s['chunk_ms'] = chunk_ms
        with self.lock:
            s.update(self.c)
        return s


def counts(reporter: Reporter, errors: Reporter) -> dict:
    """The problems a robot's reporters counted, for /diagnostics."""
    r = reporter
    return dict(dropped_images=r.count('image:'), dropped_joint_states=r.count('joints:'),
                future_stamps=r.count('future:'), rejected_prompts=r.count('prompt:'),
                skipped_frames=r.count('frame:'), masked_cameras=r.count('mask:'),
                failed_frames=r.count('engine:') + r.count('actions:'),
                limit_holds=r.count('holding:joint limits'),
                joint_glitches=r.count('glitch:'),
                # Distinct problems kept for the rate limit: bounded, whatever is sent.
                problem_kinds=len(r.totals) + len(errors.totals))


def shadow_summary(errors: dict) -> dict:
    """Shadow mode's part: mean and largest error per joint, and the worst mean."""
    s = {}
    for j, (mean, most, _) in errors.items():
        s[f'shadow_error_mean.{j}'] = mean
        s[f'shadow_error_max.{j}'] = most
    s['shadow_error_mean_worst'] = max((m for m, _, _ in errors.values()),
                                       default=float('nan'))
    return s


def status(s: dict, *, active: bool, command: bool, rate_hz: float, faulted: str,
           faulted_at: float, yielded: str, hold_reason: str) -> tuple[str, str]:
    """(level, message) for a robot's DiagnosticStatus from its summary ``s``: 'ERROR' for
    FAULT_SHOWN_S after a fault of the node's own, 'WARN' while it holds, else 'OK'."""
    if time.monotonic() - faulted_at < FAULT_SHOWN_S:
        return 'ERROR', f'fault: {faulted}'
    holding = s['control_publish_hz'] < 0.5 * rate_hz
    if yielded:
        return 'WARN', f'not commanding: {yielded}'
    if not active:
        return 'OK', 'inactive: not commanding'
    if not command:
        worst = s.get('shadow_error_mean_worst', float('nan'))
        return 'OK', ('shadow mode: not commanding; ' + (
            f'predictions {worst:.3f} from the measured joints at worst (mean over '
            f'{WINDOW_S:g} s)' if math.isfinite(worst) else 'nothing compared yet'))
    if holding:
        return 'WARN', f'holding: {hold_reason or "no fresh actions"}'
    frames = f', {s["frame_ms_p50"]:.0f} ms frames' if 'frame_ms_p50' in s else ''
    return 'OK', f'{s["control_publish_hz"]:.0f} Hz commands{frames}'
