"""The frame budget: how many decode steps still fit in a frame, and the clock frames are
timed on."""

from __future__ import annotations

import collections
import time

import torch


class Clock:
    """Wall time in ms. On CUDA a reading waits for the device when ``phases`` is on (phase
    times are then real) or when asked (the frame's end); otherwise it does not stall the
    queue of kernels in the middle of a frame."""

    def __init__(self, device, phases: bool = True):
        self.cuda = torch.device(device).type == 'cuda'
        self.phases = phases

    def __call__(self, sync: bool = False) -> float:
        if self.cuda and (sync or self.phases):
            torch.cuda.synchronize()
        return time.perf_counter() * 1e3


class AdaptiveK:
    """Decides, before each decode step, whether one more fits in the frame budget.

    Step times are learned per batch size from the recent past; the estimate is the slowest
    of the last few, so a noisy machine makes it cautious rather than late. The action chunk
    is already out when this is asked: only language yields to the deadline.
    """

    def __init__(self, budget_ms: float, k_max: int, history: int = 16):
        self.budget_ms = budget_ms
        self.k_max = k_max
        self._seen: dict[int, collections.deque] = {}
        self._history = history

    def observe(self, batch: int, ms: float) -> None:
        self._seen.setdefault(batch, collections.deque(maxlen=self._history)).append(ms)

    def estimate(self, batch: int) -> float | None:
        if batch in self._seen:
            return max(self._seen[batch])
        bigger = [b for b in self._seen if b > batch]
        if bigger:
            return max(self._seen[min(bigger)])
        smaller = [b for b in self._seen if b < batch]
        if smaller:
            b = max(smaller)
            # A decode step grows at most linearly with the batch.
            return max(self._seen[b]) * batch / b
        return None

    def fits(self, elapsed_ms: float, steps_done: int, batch: int) -> bool:
        if steps_done >= self.k_max:
            return False
        est = self.estimate(batch)
        if est is None:
            # Nothing measured yet: one step to learn from, never more.
            return steps_done == 0
        return elapsed_ms + est <= self.budget_ms
