"""Shadow mode: how far the policy's predictions are from what the robot does while an
operator drives it and the node only watches (`command: false`).

Each measured joint reading, stamped when it was measured, is set against the prediction
of the last frame before it: the newest chunk stamped at or before the reading that covers
it, its target for the joint there (linear between its actions, one action period apart
from the frame's stamp). A reading waits until a newer frame's chunk has come, so which
chunk it is judged by does not depend on how long frames take. The error of every joint
over the last WINDOW_S seconds says whether the policy would have done what the operator
did; commanding is refused while it is larger than a margin."""
import collections

import numpy as np

from oxygen_ros.robot.playback import Chunk

WINDOW_S = 5.0  # the errors reported (and checked before commanding) are over this long, s


class Shadow:
    def __init__(self, joints: list[str | None], window_s: float = WINDOW_S):
        self.joints = list(joints)  # per action index: the name reported; None: not driven
        self.window = window_s
        self._chunks: collections.deque = collections.deque(maxlen=8)
        self._waiting: collections.deque = collections.deque(maxlen=4000)  # (stamp, q)
        self._errors: collections.deque = collections.deque()  # (stamp, |error| per index)
        self._seen = np.full(len(self.joints), -np.inf)  # per index: the last stamp taken

    def clear(self):
        self._chunks.clear()
        self._waiting.clear()
        self._errors.clear()
        self._seen[:] = -np.inf

    def chunk(self, chunk: Chunk):
        self._chunks.append(chunk)
        self._judge()

    def predicted(self, stamp: float) -> np.ndarray | None:
        """Every joint's target at `stamp` by the newest chunk stamped at or before it, if
        that chunk reaches it; else None."""
        for c in reversed(self._chunks):
            if c.stamp <= stamp:
                k = (stamp - c.stamp) / c.period  # in actions from the chunk's first
                if k > len(c.positions) - 1 + 1e-9:  # past its last action
                    return None
                i = min(int(k), len(c.positions) - 2) if len(c.positions) > 1 else 0
                w = k - i
                return c.positions[i] * (1 - w) + c.positions[min(i + 1, len(c.positions) - 1)] * w
        return None

    def measured(self, q: np.ndarray, stamps: np.ndarray):
        """Readings per action index (NaN where there is none) and when each was measured;
        each reading is taken once."""
        new = np.isfinite(q) & np.isfinite(stamps) & (stamps > self._seen)
        for stamp in np.unique(stamps[new]):
            at = new & (stamps == stamp)
            self._waiting.append((float(stamp), np.where(at, q, np.nan)))
            self._seen[at] = stamp
        self._judge()

    def _judge(self):
        """Compare the readings a newer frame's chunk has come for."""
        newest = self._chunks[-1].stamp if self._chunks else -np.inf
        while self._waiting and self._waiting[0][0] < newest:
            stamp, q = self._waiting.popleft()
            want = self.predicted(stamp)
            if want is not None:
                self._errors.append((stamp, np.abs(want - q)))
        while self._errors and self._errors[0][0] < self._errors[-1][0] - self.window:
            self._errors.popleft()

    def errors(self, now: float | None = None) -> dict[str, tuple[float, float, int]]:
        """Per joint compared within the window: (mean, max |error|, readings). With `now`
        (the clock the readings are stamped on) the window ends now: an agreement measured
        long ago, with no readings compared since, is none."""
        start = -np.inf if now is None else now - self.window
        kept = [x for stamp, x in self._errors if stamp >= start]
        if not kept:
            return {}
        e = np.stack(kept)
        out = {}
        for i, name in enumerate(self.joints):
            col = e[:, i][np.isfinite(e[:, i])]
            if name is not None and len(col):
                out[name] = (float(col.mean()), float(col.max()), len(col))
        return out

    def disagreement(self, margin: float, now: float | None = None) -> str | None:
        """Why commanding would be unsafe at `now`, or None: no prediction compared with the
        robot's motion in the window ending now, or a joint whose mean error over it is
        above `margin`."""
        got = self.errors(now)
        if not got:
            when = '' if now is None else f' in the last {self.window:g} s'
            return (f'no prediction has been compared with the measured joints{when} (shadow '
                    'mode needs chunks and fresh joint readings)')
        missing = [j for j in self.joints if j is not None and j not in got]
        if missing:
            return f'no comparison yet for {", ".join(missing)}'
        bad = {j: m for j, (m, _, _) in got.items() if m > margin}
        if bad:
            worst = sorted(bad.items(), key=lambda x: -x[1])
            return ('the prediction disagrees with the measured motion by more than '
                    f'{margin:g} (mean over the last {self.window:g} s): '
                    + ', '.join(f'{j} {m:.3f}' for j, m in worst))
        return None
