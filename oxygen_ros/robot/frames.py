"""Turning a robot's separate input streams into frames the engine can run on.

Cameras and joint readers publish at their own rates, so each input holds its latest
samples and a frame is built once all inputs are recent and close enough in time to
describe the same moment. Nothing here imports ROS: the node feeds plain values in, and the
tests drive it directly.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# A velocity is differentiated from two readings at most this far apart (s); further apart
# (a stream that paused) their difference says nothing of how the joint moves now.
VELOCITY_GAP_S = 0.1


@dataclass
class Sample:
    value: object
    stamp: float  # seconds, the time the sample describes
    seq: int  # bumps on every put, so a frame knows what is new


@dataclass
class Snapshot:
    stamp: float  # the newest stamp used: what the frame describes
    values: dict[str, object]  # None for an optional input that was missing or stale
    stamps: dict[str, float]
    notes: list[str] = field(default_factory=list)  # optional inputs left out, and why


class Assembler:
    """Sample hold over named inputs.

    An input is usable when its latest sample is younger than max_input_age. A frame needs
    every required input usable; it takes the newest sample of the `trigger` inputs (default:
    all) and from every other input the held sample closest in time to it, and those must be
    within max_skew of each other. Choosing by time rather than simply the latest keeps a
    100 Hz joint stream from looking skewed against a camera image that waited while the
    model was busy, and gives the state the image was taken with. Optional inputs that are
    missing or stale are left out (None) instead of blocking the frame. A frame is only
    built when a trigger input got a new sample since the last frame, so the same data is
    not run twice and frames follow e.g. the main camera's rate.
    """

    # Enough for 0.5 s of a 100 Hz stream; older samples are pruned by time anyway.
    HISTORY = 64

    def __init__(
        self,
        required: Iterable[str],
        optional: Iterable[str] = (),
        max_input_age: float = 0.5,
        max_skew: float = 0.1,
        trigger: Iterable[str] | None = None,
        max_ahead: float | None = None,
    ):
        self.required = list(required)
        self.optional = [n for n in optional if n not in self.required]
        if not self.required:
            raise ValueError('a frame needs at least one required input')
        if max_input_age <= 0 or max_skew < 0:
            raise ValueError(
                f'max_input_age must be > 0 and max_skew >= 0, got {max_input_age}, {max_skew}'
            )
        self.max_input_age = max_input_age
        self.max_skew = max_skew
        # A sample stamped further ahead of the clock than this (default: max_input_age) is
        # not usable: after the clock stepped back its age would stay negative and never
        # reach max_input_age. No tighter by default: a sample that came while the node was
        # busy (converting images after it read its clock) is legitimately a little ahead.
        self.max_ahead = max_input_age if max_ahead is None else max_ahead
        self.trigger = set(self.names if trigger is None else trigger)
        unknown = sorted(self.trigger - set(self.names))
        if unknown:
            raise ValueError(f'trigger inputs {unknown} are not inputs {self.names}')
        self._samples: dict[str, collections.deque[Sample]] = {}
        self._seq = 0
        self._taken = 0
        self._new = 0  # seq of the newest trigger sample
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return self.required + self.optional

    def put(self, name: str, value, stamp: float) -> None:
        if name not in self.required and name not in self.optional:
            raise KeyError(f'unknown input {name!r}; inputs are {self.names}')
        stamp = float(stamp)
        with self._lock:
            self._seq += 1
            held = self._samples.setdefault(name, collections.deque(maxlen=self.HISTORY))
            held.append(Sample(value, stamp, self._seq))
            # Nothing older than this can be within max_skew of a usable sample.
            while held[0].stamp < stamp - self.max_input_age - self.max_skew:
                held.popleft()
            if name in self.trigger:
                self._new = self._seq

    def latest(self, name: str) -> Sample | None:
        with self._lock:
            held = self._samples.get(name)
            return held[-1] if held else None

    def fresh(self) -> bool:
        """Whether a trigger input got a sample since the last frame was taken."""
        with self._lock:
            return self._new > self._taken

    def ready(self, now: float, take: bool = True) -> tuple[Snapshot | None, str | None]:
        """(frame, None) when a frame can be built now, else (None, why not). ``take``
        False only looks: the samples stay new for the next call (a replay looking for the
        frame a recording's live node ran)."""
        with self._lock:
            held = {n: list(h) for n, h in self._samples.items()}
            seq = self._seq
            new = self._new > self._taken
        # Staleness first: a trigger input that stopped must be named, not read as "no news".
        problems = []
        usable = []
        for name in self.required:
            why = self._unusable(held.get(name), now)
            if why:
                problems.append(f'{name} {why}')
            else:
                usable.append(name)
        if problems:
            return None, '; '.join(problems)
        if not new:
            return None, 'no new input since the last frame'
        notes = []
        for name in self.optional:
            why = self._unusable(held.get(name), now)
            if why:
                notes.append(f'{name} {why}, left out')
            else:
                usable.append(name)
        triggers = [n for n in usable if n in self.trigger] or usable
        anchor = max(held[n][-1].stamp for n in triggers)
        used = {n: min(held[n], key=lambda s: abs(s.stamp - anchor)) for n in usable}
        skew = self._skew(used)
        if skew:
            if take:
                with self._lock:
                    # The same samples stay skewed: look again when a trigger input has news.
                    self._taken = seq
            return None, skew
        values = {n: None for n in self.optional}
        values.update({n: s.value for n, s in used.items()})
        stamps = {n: s.stamp for n, s in used.items()}
        if take:
            with self._lock:
                self._taken = seq
        return Snapshot(max(stamps.values()), values, stamps, notes), None

    def _unusable(self, held: list[Sample] | None, now: float) -> str | None:
        if not held:
            return 'missing (nothing received yet)'
        age = now - held[-1].stamp
        if age > self.max_input_age:
            return f'stale ({age * 1e3:.0f} ms old, limit {self.max_input_age * 1e3:.0f} ms)'
        if age < -self.max_ahead:
            return (f'stamped {-age * 1e3:.0f} ms ahead of the clock (limit '
                    f'{self.max_ahead * 1e3:.0f} ms; did the clock jump back?)')
        return None

    def unusable(self, name: str, now: float) -> str | None:
        """Why input `name` cannot be used at `now` (missing, stale, ahead), or None."""
        with self._lock:
            held = self._samples.get(name)
            held = list(held) if held else None
        return self._unusable(held, now)

    def seen(self) -> None:
        """Count every sample held as taken: the next frame waits for a trigger input's next
        sample (a new activation: what came before may show the robot elsewhere)."""
        with self._lock:
            self._taken = self._new = self._seq

    def clear(self) -> None:
        """Forget every sample (the clock jumped: their ages mean nothing now)."""
        with self._lock:
            self._samples.clear()
            self._taken = self._new = self._seq

    def _skew(self, used: Mapping[str, Sample]) -> str | None:
        if len(used) < 2:
            return None
        oldest = min(used, key=lambda n: used[n].stamp)
        newest = max(used, key=lambda n: used[n].stamp)
        skew = used[newest].stamp - used[oldest].stamp
        if skew > self.max_skew:
            return (
                f'inputs skewed: {oldest} is {skew * 1e3:.0f} ms older than {newest} '
                f'(limit {self.max_skew * 1e3:.0f} ms)'
            )
        return None


class JointReadings:
    """The latest reading of each joint of one JointState source, and when it was read.

    Drivers may split a source over several messages or stop sending some joints; merging
    keeps every joint's last value, and the readings count as old as their oldest wanted
    joint, so a joint that stops coming makes the source stale instead of frozen.
    """

    def __init__(self, wanted: Iterable[str], keep: Iterable[str] = ()):
        self.wanted = set(wanted)
        self.keep = self.wanted | set(keep)  # also read, e.g. a controller joint for a hold
        self._values: dict[str, float] = {}
        self._stamps: dict[str, float] = {}
        self._speeds: dict[str, float] = {}  # rad/s (or m/s); NaN where none is known
        self._lock = threading.Lock()

    def update(self, readings: Mapping[str, float], stamp: float,
               velocities: Mapping[str, float] | None = None,
               differentiate: bool = True) -> tuple[dict, float]:
        """Take the joints of `readings` read at `stamp`, with their `velocities` where the
        driver gives them (else, with `differentiate`, the change from the last reading if
        that is at most VELOCITY_GAP_S old); returns (every value held, the stamp of the
        oldest wanted joint)."""
        given = velocities or {}
        with self._lock:
            for name, x in readings.items():
                if name in self.keep:
                    v = given.get(name, math.nan)
                    if not math.isfinite(v) and differentiate:
                        last, then = self._values.get(name), self._stamps.get(name)
                        dt = math.nan if then is None else stamp - then
                        v = ((x - last) / dt if last is not None and 0 < dt <= VELOCITY_GAP_S
                             else math.nan)
                    self._values[name] = float(x)
                    self._stamps[name] = stamp
                    self._speeds[name] = float(v)
            seen = [self._stamps[n] for n in self.wanted if n in self._stamps]
            return dict(self._values), min(seen) if seen else stamp

    def gone(self, now: float, max_age: float) -> list[str]:
        """Wanted joints last read more than max_age before `now`, sorted."""
        with self._lock:
            return sorted(n for n in self.wanted
                          if n in self._stamps and now - self._stamps[n] > max_age)

    def get(self, name: str) -> float | None:
        with self._lock:
            return self._values.get(name)

    def last(self, name: str) -> tuple[float, float] | None:
        """(value, stamp) of the last reading of `name`."""
        with self._lock:
            if name not in self._values:
                return None
            return self._values[name], self._stamps[name]

    def fresh(self, name: str, now: float, max_age: float,
              ahead: float = 0.0) -> tuple[float, float] | None:
        """(value, stamp) of the last reading of `name` if it was read at most max_age
        before `now` (by its own stamp) and at most `ahead` after it, else None."""
        with self._lock:
            t = self._stamps.get(name)
            if t is None or not now - max_age <= t <= now + ahead:
                return None
            return self._values[name], t

    def velocity(self, name: str) -> float:
        """How fast `name` moved at its last reading (NaN: not known)."""
        with self._lock:
            return self._speeds.get(name, math.nan)

    def values(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def clear(self) -> None:
        """Forget every reading (the clock jumped: their stamps mean nothing now)."""
        with self._lock:
            self._values.clear()
            self._stamps.clear()
            self._speeds.clear()
