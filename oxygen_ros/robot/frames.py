"""Turning a robot's separate input streams into frames the engine can run on.

Cameras and joint readers publish at their own rates, so each input holds its latest
samples and a frame is built once all inputs are recent and close enough in time to
describe the same moment. Nothing here imports ROS: the node feeds plain values in, and the
tests drive it directly.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

# Channels per supported encoding, and how to reach RGB from it.
ENCODINGS = {'rgb8': 3, 'bgr8': 3, 'rgba8': 4, 'bgra8': 4, 'mono8': 1}


@dataclass
class Sample:
    value: object
    stamp: float  # seconds, the time the sample describes
    seq: int  # bumps on every put, so a frame knows what is new


@dataclass
class Frame:
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

    def ready(self, now: float, take: bool = True) -> tuple[Frame | None, str | None]:
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
        return Frame(max(stamps.values()), values, stamps, notes), None

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
        self._lock = threading.Lock()

    def update(self, readings: Mapping[str, float], stamp: float) -> tuple[dict, float]:
        """Take the joints of `readings` read at `stamp`; returns (every value held, the
        stamp of the oldest wanted joint)."""
        with self._lock:
            for name, x in readings.items():
                if name in self.keep:
                    self._values[name] = float(x)
                    self._stamps[name] = stamp
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

    def values(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def clear(self) -> None:
        """Forget every reading (the clock jumped: their stamps mean nothing now)."""
        with self._lock:
            self._values.clear()
            self._stamps.clear()


# Bytes per pixel of the colour encodings only cv_bridge converts to RGB (its
# getConversionCodes: 16-bit colour and mono, YUV 4:2:2, Bayer); 16-bit values scale to 8.
BRIDGE_ENCODINGS = {
    'rgb16': 6, 'bgr16': 6, 'rgba16': 8, 'bgra16': 8, 'mono16': 2,
    'yuv422': 2, 'yuv422_yuy2': 2,
    **{f'bayer_{p}8': 1 for p in ('rggb', 'bggr', 'gbrg', 'grbg')},
    **{f'bayer_{p}16': 2 for p in ('rggb', 'bggr', 'gbrg', 'grbg')},
}
# Where both paths convert, the built-in one is used for these (a 640x480 rgb8 frame: 0.02 ms
# against cv_bridge's 0.7; bgr8 the same 0.7 ms either way); cv_bridge's OpenCV code is ~10x
# faster for rgba8, bgra8 and mono8. Measured by benchmarks/image_conversion.py.
BUILT_IN_FIRST = ('rgb8', 'bgr8')
# sensor_msgs generic types: depth, disparity, masks. Neither path gives them a colour meaning.
NOT_COLOUR = re.compile(r'(8|16|32|64)[USF]C[1-4]')


def _unsupported(encoding: str, bridged: bool) -> str:
    built_in = ', '.join(ENCODINGS)
    if NOT_COLOUR.fullmatch(encoding):
        return (f'unsupported image encoding {encoding!r}: a depth or single-value image, not '
                f'colour; neither the built-in conversion nor cv_bridge makes RGB of it')
    if encoding in BRIDGE_ENCODINGS and not bridged:
        return (f'unsupported image encoding {encoding!r} without cv_bridge: cv_bridge would '
                f'convert it but is not installed; built in: {built_in}')
    more = ', '.join(BRIDGE_ENCODINGS)
    if bridged:
        return f'unsupported image encoding {encoding!r}; supported: {built_in}, {more}'
    return (f'unsupported image encoding {encoding!r}; supported: {built_in} (and with '
            f'cv_bridge: {more})')


# The largest image taken unless max_image_pixels / max_image_bytes say otherwise: a
# 4096x4096 camera, and 64 MiB (4096x4096 rgb8 is 48 MiB). A camera's messages are held for
# a frame and converted, so a bigger one costs memory and time on every image.
MAX_PIXELS = 4096 * 4096
MAX_BYTES = 1 << 26


def check_size(width: int, height: int, nbytes: int, max_pixels: int = MAX_PIXELS,
               max_bytes: int = MAX_BYTES, what: str = 'image') -> None:
    """ValueError when a `width` x `height` image of `nbytes` bytes is over the caps; checked
    before anything is converted or decoded."""
    if width * height > max_pixels:
        raise ValueError(f'{what} of {width}x{height} pixels is over max_image_pixels '
                         f'({max_pixels})')
    if nbytes > max_bytes:
        raise ValueError(f'{what} of {nbytes} bytes is over max_image_bytes ({max_bytes})')


def check_image(encoding: str, height: int, width: int, step: int, size: int,
                bridged: bool = False) -> int:
    """Raise ValueError unless the image header describes a buffer that converts to RGB (with
    cv_bridge's encodings too when `bridged`); returns the bytes per pixel. Cheap enough to
    run in a subscription callback."""
    pixel = ENCODINGS.get(encoding) or (BRIDGE_ENCODINGS.get(encoding) if bridged else None)
    if pixel is None:
        raise ValueError(_unsupported(encoding, bridged))
    if height <= 0 or width <= 0:
        raise ValueError(f'image has no pixels ({width}x{height})')
    if step < width * pixel:
        raise ValueError(
            f'image step {step} is shorter than a {width}-pixel {encoding} row '
            f'({width * pixel} bytes)'
        )
    if size < step * (height - 1) + width * pixel:
        raise ValueError(
            f'image data has {size} bytes, a {width}x{height} {encoding} image with step '
            f'{step} needs {step * height}'
        )
    return pixel


def check_bridged(encoding: str, height: int, width: int, step: int, size: int) -> None:
    """What cv_bridge's imgmsg_to_cv2 also needs, beyond check_image: it views the buffer as
    whole pixels per row, so a step that is not a whole number of pixels would shift every
    row, and a short last row is refused; a 4:2:2 pixel pair needs an even width."""
    pixel = check_image(encoding, height, width, step, size, bridged=True)
    if step % pixel:
        raise ValueError(f'{encoding} image step {step} is not a whole number of '
                         f'{pixel}-byte pixels, which cv_bridge needs')
    if size < step * height:
        raise ValueError(f'image data has {size} bytes, cv_bridge needs all {height} rows of '
                         f'step {step} ({step * height})')
    if encoding.startswith('yuv422') and width % 2:
        raise ValueError(f'{encoding} image width {width} is odd; 4:2:2 pixels come in pairs')


def to_rgb(encoding: str, height: int, width: int, step: int, data) -> np.ndarray:
    """An HxWx3 uint8 RGB array from a raw image buffer (rows may be padded to `step`)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    channels = check_image(encoding, height, width, step, buf.size)
    if buf.size < step * height:
        # The last row's padding may be cut off; pad so the strided view below is valid.
        buf = np.concatenate([buf, np.zeros(step * height - buf.size, np.uint8)])
    rows = buf[: step * height].reshape(height, step)[:, : width * channels]
    px = rows.reshape(height, width, channels)
    if encoding == 'rgb8':
        out = px
    elif encoding == 'bgr8':
        out = px[:, :, ::-1]
    elif encoding == 'rgba8':
        out = px[:, :, :3]
    elif encoding == 'bgra8':
        out = px[:, :, 2::-1]
    else:  # mono8; repeat already makes a new array
        return np.repeat(px, 3, axis=2)
    # A private, contiguous copy: the message buffer may be reused once we return.
    return np.array(out, dtype=np.uint8, order='C')


_bridge = None
_bridge_checked = False


def bridge():
    """A cv_bridge CvBridge where cv_bridge is installed, else None."""
    global _bridge, _bridge_checked
    if not _bridge_checked:
        _bridge_checked = True
        try:
            from cv_bridge import CvBridge

            _bridge = CvBridge()
        except ImportError:
            _bridge = None
    return _bridge


def _via_bridge(encoding: str) -> bool:
    return bridge() is not None and encoding not in BUILT_IN_FIRST and (
        encoding in ENCODINGS or encoding in BRIDGE_ENCODINGS)


def image_problem(msg, max_pixels: int = MAX_PIXELS, max_bytes: int = MAX_BYTES) -> str | None:
    """Why a sensor_msgs/Image cannot be converted, or None. Only reads the header and the
    buffer length, so a subscription callback can afford it."""
    header = (msg.encoding, msg.height, msg.width, msg.step, len(msg.data))
    try:
        check_size(msg.width, msg.height, len(msg.data), max_pixels, max_bytes)
        if _via_bridge(msg.encoding):
            check_bridged(*header)
        else:
            check_image(*header, bridged=bridge() is not None)
    except ValueError as e:
        return str(e)
    return None


def image_to_rgb(msg) -> np.ndarray:
    """HxWx3 uint8 RGB from a sensor_msgs/Image.

    Built in: rgb8, bgr8, rgba8, bgra8 and mono8, the encodings most robot cameras publish.
    Where cv_bridge is installed it also converts 16-bit colour and mono, YUV 4:2:2 and Bayer
    images, and takes the 8-bit encodings it converts faster (BUILT_IN_FIRST keeps the rest).
    """
    if not _via_bridge(msg.encoding):
        return to_rgb(msg.encoding, msg.height, msg.width, msg.step, msg.data)
    check_bridged(msg.encoding, msg.height, msg.width, msg.step, len(msg.data))
    try:
        out = bridge().imgmsg_to_cv2(msg, desired_encoding='rgb8')
    except Exception as e:  # cv_bridge raises its own error types
        raise ValueError(f'cv_bridge cannot convert the {msg.encoding!r} image: {e}') from None
    # A private, contiguous copy: for some encodings cv_bridge returns a view of the message.
    return np.array(out, dtype=np.uint8, order='C')


class Reporter:
    """Says each distinct problem at most once per `period` seconds.

    Repeats inside the window are counted and the count is added to the next message, so a
    problem that happens at 30 Hz reads as one line with "(120 more since)" instead of a
    flood. Totals per key stay available for diagnostics.

    Keys name kinds of problems (robot_link.problem_key keeps what a sender controls out of
    them). Should ever more keys come anyway, those past `max_keys` are counted under
    '<kind>:other' (kind: the key up to its first ':'), so the dictionaries stay bounded and
    the rate limit holds.
    """

    def __init__(
        self,
        say: Callable[[str], None],
        period: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        keep: int = 20,
        max_keys: int = 256,
    ):
        self.say = say
        self.period = period
        self.clock = clock
        self.keep = keep
        self.max_keys = max_keys
        self.totals: dict[str, int] = {}
        self.recent: list[str] = []  # the last messages said, newest last
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def report(self, key: str, message: str | None = None) -> bool:
        """Count a problem under `key` and say it unless it was said recently. Returns
        whether it was said."""
        message = message or key
        now = self.clock()
        with self._lock:
            if key not in self.totals and len(self.totals) >= self.max_keys:
                key = key.partition(':')[0] + ':other'
            self.totals[key] = self.totals.get(key, 0) + 1
            last = self._last.get(key)
            if last is not None and now - last < self.period:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            held = self._held.pop(key, 0)
            self._last[key] = now
            if held:
                message = f'{message} ({held} more since the last report)'
            self.recent = [*self.recent, message][-self.keep:]
        self.say(message)
        return True

    def clear(self, key: str) -> None:
        """Forget a key's window, so the problem is said at once if it comes back."""
        with self._lock:
            self._last.pop(key, None)
            self._held.pop(key, None)

    def count(self, prefix: str = '') -> int:
        with self._lock:
            return sum(n for k, n in self.totals.items() if k.startswith(prefix))
