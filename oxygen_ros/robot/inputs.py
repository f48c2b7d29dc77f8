"""One robot's inputs as the node takes them, without ROS: checks, readings, frames.

Every message a robot sends goes through Inputs: images are checked (size, encoding) or
decoded (compressed), joint states are checked (lengths, NaN, unknown joints, glitches) and
merged per source, stamps are judged against the clock, and what passes is held in the
robot's frames.Assembler. A frame the assembler gives becomes the engine's Observation here.
The live node (robot_link) feeds it from its subscriptions on the node's clock; oxygen-replay
feeds it from a recording on the recording's clock: the same rules either way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np

from oxygen_ros.robot.contract import Config
from oxygen_ros.robot.frames import JointReadings, Snapshot
from oxygen_ros.robot.images import Camera, image_problem, image_to_rgb
from oxygen_ros.robot.report import Reporter
from oxygen_ros.robot.stamps import seconds

# A reading may move a limited joint glitch_speed_factor times its speed limit over the time
# between two stamps plus this much stamp jitter before it counts as a glitch.
GLITCH_SLACK_S = 0.02


def problem_key(kind: str, text: str) -> str:
    """The Reporter key of a problem: its kind and the words of `text` that say what went
    wrong. Numbers (ages, counts) change every time, and what a sender controls (an encoding,
    a format string, payload bytes) is quoted or in brackets in the messages: the key ends
    before the first of those, so a sender cannot make new keys."""
    words = re.split(r"""['"(\[{<]""", re.sub(r'[-\d.]+', '#', text), maxsplit=1)[0]
    return kind + ':' + words[:80].rstrip()


class Inputs:
    """``cfg``: the robot's checked Config; ``reporter``: where its input problems are said;
    ``now``: the clock stamps are judged against (s)."""

    def __init__(self, cfg: Config, reporter: Reporter, now: Callable[[], float]):
        self.cfg = cfg
        self.reporter = reporter
        self.now = now
        self.assembler = cfg.assembler()
        caps = cfg.p.max_image_pixels, cfg.p.max_image_bytes
        self.decoders = {cam: Camera('auto', *caps) for cam, t in cfg.transports.items()
                         if t == 'compressed'}
        # Each source's state joints, and the controllers' joints for a hold at measured
        # positions.
        self.readings = {s: JointReadings(w, [j for src, j in cfg.hold_sources.values()
                                              if src == s])
                         for s, w in cfg.wanted.items()}
        # Per source, what a reading of a limited controller joint may be: (lowest, highest,
        # speed); outside, or faster than the joint moves from its last reading, a glitch.
        self.plausible: dict[str, dict[str, tuple[float, float, float]]] = {}
        # Sources whose next reading is taken as it comes (range-checked only): see rebase.
        self._rebase: set[str] = set()
        if cfg.limits is not None:
            lim = cfg.limits
            for i, (src, joint) in cfg.hold_sources.items():
                self.plausible.setdefault(src, {})[joint] = (
                    lim.lower[i] - lim.margin[i], lim.upper[i] + lim.margin[i], lim.speed[i])

    def stamp(self, header, what: str) -> float | None:
        """The time a sample describes, or None (reported) when it lies in the future."""
        now = self.now()
        t = seconds(header.stamp)
        if t <= 0:
            # Some drivers leave the stamp at zero; the arrival time is the best guess then.
            return now
        ahead = t - now
        limit = self.cfg.p.max_future_stamp
        if ahead > limit:
            self.reporter.report(f'future:{what}', f'{what}: stamp {ahead * 1e3:.0f} ms in the '
                                 f'future (limit {limit * 1e3:.0f} ms); message dropped: the '
                                 'sender and this node must share a clock')
            return None
        return t

    def image(self, cam: str, msg) -> None:
        """A sensor_msgs/Image of camera `cam`: held as it is (converted for a frame)."""
        why = image_problem(msg, self.cfg.p.max_image_pixels, self.cfg.p.max_image_bytes)
        if why:
            self.dropped(cam, why)
            return
        t = self.stamp(msg.header, f'camera {cam}')
        if t is not None:
            self.assembler.put(cam, msg, t)

    def compressed(self, cam: str, msg) -> None:
        """A sensor_msgs/CompressedImage of camera `cam`: decoded now, held as RGB."""
        t = self.stamp(msg.header, f'camera {cam}')
        if t is None:
            return
        try:
            rgb = self.decoders[cam].decode(msg.format, msg.data)
        except ValueError as e:
            self.dropped(cam, str(e))
            return
        self.assembler.put(cam, rgb, t)

    def dropped(self, cam: str, why: str) -> None:
        self.reporter.report(problem_key(f'image:{cam}', why),
                             f'camera {cam}: {why}; image dropped, the last good one is kept')

    def joints(self, src: str, msg) -> None:
        """A sensor_msgs/JointState of joint source `src`."""
        topic = self.cfg.joint_topics[src]
        names, positions = list(msg.name), list(msg.position)
        if len(names) != len(positions):
            self.reporter.report(f'joints:{src}:lengths',
                                 f'{topic}: {len(names)} names but {len(positions)} '
                                 'positions; message dropped')
            return
        readings = self.readings[src]
        got = {n: x for n, x in zip(names, positions, strict=True) if n in readings.keep}
        bad = sorted(n for n, x in got.items() if not math.isfinite(x))
        if bad:
            self.reporter.report(f'joints:{src}:nonfinite',
                                 f'{topic}: joints {", ".join(bad)} read NaN/inf; message '
                                 'dropped, the last good readings are kept')
            return
        if readings.wanted.isdisjoint(got):
            self.reporter.report(f'joints:{src}:unknown',
                                 f'{topic}: none of the joints {list(names)} are used; '
                                 f'expected {sorted(readings.wanted)}')
            return
        t = self.stamp(msg.header, topic)
        if t is None:
            return
        glitches = self._glitches(src, got, t)
        if glitches:
            self.reporter.report(f'glitch:{src}', f'{topic}: {"; ".join(glitches)}: a glitch, '
                                 'message dropped, the last good readings are kept')
            return
        # The driver's velocities where it gives one per joint (a robot moving when the node
        # takes it over starts from that motion); else they are differentiated, except
        # across a rebase (the robot may have been moved: a jump is no velocity).
        # (a list from rclpy, an array from rosbags: never judged by truth value)
        vel = list(getattr(msg, 'velocity', ()))
        given = ({n: float(v) for n, v in zip(names, vel, strict=True) if n in got}
                 if len(vel) == len(names) else None)
        rebased = src in self._rebase
        self._rebase.discard(src)
        merged, oldest = readings.update(got, t, given, differentiate=not rebased)
        limit = self.cfg.p.max_input_age
        if t - oldest > limit:
            self.reporter.report(f'joints:{src}:dropped', f'{topic}: joints '
                                 f'{", ".join(readings.gone(t, limit))} missing from its '
                                 f'messages for {(t - oldest) * 1e3:.0f} ms (limit '
                                 f'{limit * 1e3:.0f} ms): stale')
        self.assembler.put(f'joints:{src}', merged, oldest)

    def _glitches(self, src: str, got: dict, t: float) -> list[str]:
        """What is implausible in a reading of limited joints at `t`: beyond the range by more
        than the hold margin, or a move from the last reading faster than the joint's speed
        limit allows (with GLITCH_SLACK_S of stamp jitter)."""
        out = []
        readings = self.readings[src]
        for joint, (lo, hi, speed) in self.plausible.get(src, {}).items():
            x = got.get(joint)
            if x is None:
                continue
            if not lo <= x <= hi:
                out.append(f'{joint} read {x:.6g}, beyond its range by more than the hold '
                           'margin')
                continue
            last = None if src in self._rebase else readings.last(joint)
            if last is not None and math.isfinite(speed):
                dx, dt = abs(x - last[0]), abs(t - last[1])
                if dx > speed * (dt + GLITCH_SLACK_S) * self.cfg.p.glitch_speed_factor:
                    out.append(f'{joint} moved {dx:.4g} in {dt * 1e3:.0f} ms, faster than '
                               f'its {speed:.4g}/s')
        return out

    def rebase(self) -> None:
        """The robot may have been moved since the last readings (a new activation: by hand,
        by another node, a simulator's reset): each source's next reading is taken as it
        comes, not judged by how far it is from the last one, and the next frame waits for
        new trigger inputs."""
        self._rebase = set(self.readings)
        self.assembler.seen()

    def frame(self, now: float, take: bool = True) -> tuple[Snapshot | None, str | None]:
        """The assembler's frame at `now`, or None and why not (``take`` False: only look)."""
        return self.assembler.ready(now, take)

    def observation(self, frame: Snapshot, slots, prompt: str):
        """(the engine's Observation, the robot-convention state) of a frame; ValueError
        naming the camera whose image does not convert. ``slots``: the engine's."""
        from oxygen_ros.engine import Observation

        images = {slot: None for slot in slots}
        for cam, slot in self.cfg.slots.items():
            msg = frame.values.get(cam)
            if isinstance(msg, np.ndarray):  # a compressed camera's, decoded when taken
                images[slot] = msg
            elif msg is not None:
                try:
                    images[slot] = image_to_rgb(msg)
                except ValueError as e:
                    raise ValueError(f'camera {cam}: {e}') from None
        # The readings held with the frame's images, not the newest ones.
        readings = {s: frame.values[f'joints:{s}'] for s in self.cfg.joint_topics}
        state = self.cfg.joint_map.vector(readings)
        model_state = np.asarray(self.cfg.profile.encode_state(state), dtype=np.float32)
        return Observation(stamp=frame.stamp, images=images, state=model_state,
                           prompt=prompt), state

    def measured(self) -> np.ndarray | None:
        """The state from the newest readings, or None while a joint has none or a source's
        readings are older than max_input_age (a chunk that re-anchors on them would move
        the arm relative to where it was, not where it is)."""
        now, limit = self.now(), self.cfg.p.max_input_age
        if any(r.gone(now, limit) for r in self.readings.values()):
            return None
        readings = {s: r.values() for s, r in self.readings.items()}
        try:
            return self.cfg.joint_map.vector(readings)
        except ValueError:
            return None

    def hold_at(self) -> tuple[np.ndarray, np.ndarray]:
        """Per action index, a fresh reading of the joint it drives (within max_input_age
        by its own stamp; glitches never get here) and its stamp; NaN where there is none."""
        dim = self.cfg.profile.action_dim
        out, stamps = np.full(dim, np.nan), np.full(dim, np.nan)
        now, p = self.now(), self.cfg.p
        for i, (src, joint) in self.cfg.hold_sources.items():
            got = self.readings[src].fresh(joint, now, p.max_input_age,
                                           p.max_future_stamp)
            if got is not None:
                out[i], stamps[i] = got
        return out, stamps

    def motion(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """hold_at's fresh readings and stamps, and each joint's velocity at its reading
        (NaN where there is no fresh reading or no velocity known)."""
        out, stamps = self.hold_at()
        vel = np.full(len(out), np.nan)
        for i, (src, joint) in self.cfg.hold_sources.items():
            if np.isfinite(out[i]):
                vel[i] = self.readings[src].velocity(joint)
        return out, stamps, vel

    def stale(self, now: float) -> str | None:
        """Which required inputs are stale or missing now (Assembler's words), or None."""
        a = self.assembler
        return '; '.join(f'{n} {w}' for n in a.required if (w := a.unusable(n, now))) or None

    def clear(self) -> None:
        """Forget every sample and reading (the clock jumped: their stamps mean nothing)."""
        self.assembler.clear()
        for r in self.readings.values():
            r.clear()
