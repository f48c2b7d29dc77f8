"""Clock jumps of the node's time, without ROS.

Every age the node judges (an input's staleness, where a chunk's actions lie in time) is the
node clock minus a stamp. When that clock jumps, the ages are wrong by the jump: backward, an
input that stopped never grows old and a chunk lies in the future, so nothing holds the
robot; forward, everything looks stale at once. Under simulated time rcl reports jumps of
/clock (the node registers a jump callback); the system clock can be stepped too (an NTP step,
a manual date change), which rcl does not report: JumpWatch finds those by comparing it with
the monotonic clock, which never jumps.
"""

from __future__ import annotations

import math

# A step back of the clock larger than this is a jump (s): NTP's slewing moves the system
# clock by microseconds per tick; a step moves it by far more.
BACK_S = 0.01


class JumpWatch:
    """Compares successive readings of a clock that may jump with the monotonic clock.

    forward: a step ahead larger than this (beyond the monotonic time passed) is a jump, s;
    back: a step back larger than this is one. Each reading of the clock comes with the
    monotonic time just before and just after it: a thread preempted between two reads
    would otherwise look like a jump of the time it lost, so only what the brackets prove
    counts.
    """

    def __init__(self, forward: float, back: float = BACK_S):
        if not (forward > 0 and back > 0 and math.isfinite(forward) and math.isfinite(back)):
            raise ValueError(f'jump thresholds must be finite and > 0, got {forward}, {back}')
        self.forward, self.back = forward, back
        self._last: tuple[float, float, float] | None = None

    def check(self, now: float, before: float, after: float | None = None) -> float | None:
        """The jump since the last check (s, negative backward), or None. ``before`` and
        ``after``: the monotonic clock just before and after ``now`` was read (``after``
        None: the same instant)."""
        after = before if after is None else after
        last, self._last = self._last, (now, before, after)
        if last is None:
            return None
        ran = now - last[0]
        # The monotonic time between the two readings lies within these.
        least, most = before - last[2], after - last[1]
        if ran - most > self.forward:
            return ran - (least + most) / 2
        if ran - least < -self.back:
            return ran - (least + most) / 2
        return None

    def reset(self) -> None:
        self._last = None
