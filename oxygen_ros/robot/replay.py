"""oxygen-replay: a recording through the node's own input path, its chunks against what
followed.

    oxygen-replay RECORDING [...] (--robot NAME | --params-file YAML [...]) [-p NAME:=VALUE]
        [--frames auto|live|rate] [--rate HZ] [--against auto|commands|joints|action]
        [--out DIR] [--bag-out FILE.mcap] [--namespace NS] [--remap FROM:=TO]

A RECORDING is a rosbag2 recording (its directory, or one .db3 or .mcap file; sqlite3 and
MCAP storage, read with rosbags, no ROS install needed) or an ACT/ALOHA HDF5 episode (a
file, or a directory of episode_*.hdf5 as oxygen-demos writes them).

A bag's Image, CompressedImage and JointState messages go in the order they were received
through inputs.Inputs, the code the live node takes them with (the same robot file,
profile, image checks, stamps judged against the recording's clock: /clock when the bag
has it, else the time each message was logged), and the engine runs on the frames the live
node would have run:
- live (the default where the bag holds the node's ~/predicted_trajectory): at the frames
  the node ran, each found by its stamp among the frames the inputs give, as received up to
  then; with frame_noise (and the node's seed) each chunk is the node's own, and the report
  says how far each is from the recorded one;
- rate: a frame every 1/RATE s of the recording's clock, where the inputs give one (stale,
  missing or skewed inputs skip it, as they make the node hold).
Each chunk is compared with what followed: the commands recorded on the controllers'
trajectory topics (an operator's teleop, or the node's own), the HDF5 episode's /action,
or else the measured joint positions. The report (report.json in --out) gives the mean
absolute error per joint and per step of the horizon, and per joint the time shift that
best aligns the prediction with what followed (lead_s > 0: the prediction is ahead); one
plot per joint beside it. --bag-out writes the recording again (MCAP) with the replayed
chunks as trajectory_msgs/JointTrajectory on /oxygen_replay/predicted_trajectory.

The node's parameters come as the node takes them: --robot NAME reads config/pi05.yaml then
config/NAME.yaml, as pi05.launch.py's robot:=; --params-file adds files in order (the
sections for /** and oxygen_node); -p NAME:=VALUE goes over them. docs/replay.md has more.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from oxygen_ros.robot import safe_yaml
from oxygen_ros.robot.aloha import ARM_JOINTS, CAMERAS, finger_from_normalized, gripper_from_finger
from oxygen_ros.robot.contract import Config
from oxygen_ros.robot.inputs import Inputs, problem_key
from oxygen_ros.robot.params import StartError
from oxygen_ros.robot.report import Reporter
from oxygen_ros.robot.share import config_dir
from oxygen_ros.robot.stamps import seconds, split, split_duration

NODE = 'oxygen_node'
# Two stamps within this are the same frame: a stamp goes through a float and back into
# sec/nanosec between the node's input and its ~/predicted_trajectory.
SAME_S = 1e-6
# An HDF5 episode's step t is stamped EPOCH + t * dt: a zero stamp means "unstamped" to the
# node's input rules, which then take the clock instead.
EPOCH = 1.0
REPLAY_TOPIC = '/oxygen_replay/predicted_trajectory'
# A replayed chunk this close to the live one (every target) is the live frame's: the same
# float32 model on the same inputs differs by far less, other inputs by far more.
LIVE_MATCH = 1e-4
INPUT_KINDS = ('image', 'compressed', 'joints')
TYPES = {'image': 'sensor_msgs/msg/Image', 'compressed': 'sensor_msgs/msg/CompressedImage',
         'joints': 'sensor_msgs/msg/JointState',
         'trajectory': 'trajectory_msgs/msg/JointTrajectory',
         'clock': 'rosgraph_msgs/msg/Clock', 'prompt': 'std_msgs/msg/String'}


class ReplayError(Exception):
    """What keeps a recording from being replayed, in one line (exit code 1)."""


# -- the node's parameters, without ROS -----------------------------------------------------

def params_files(robot: str, files: list[str]) -> list[Path]:
    """The files the node would read: pi05.yaml and the robot's file for --robot, then
    --params-file's."""
    out = []
    if robot:
        cfg = config_dir()
        out += [cfg / 'pi05.yaml', cfg / f'{robot}.yaml']
        if not out[-1].exists():
            known = sorted(p.stem for p in cfg.glob('*.yaml') if p.stem != 'pi05')
            raise ReplayError(f'--robot {robot}: no {out[-1]} (robot files: {known})')
    return out + [Path(f) for f in files]


def node_values(files: list[Path], overrides: list[str]) -> dict:
    """The node's parameter values from params files (their /** and oxygen_node sections,
    file by file, the node's own after the wildcard's) and NAME:=VALUE overrides, flattened
    as ROS flattens them."""
    from oxygen_ros.robot.params import flatten

    values = {}
    for path in files:
        try:
            doc = safe_yaml.read(str(path))
        except (OSError, ValueError) as e:
            raise ReplayError(f'params file {path}: {getattr(e, "strerror", None) or e}') \
                from None
        if not isinstance(doc, dict):
            raise ReplayError(f'params file {path}: expected <node>: ros__parameters: ...')
        for key in ('/**', '**', NODE, '/' + NODE):
            block = doc.get(key)
            if isinstance(block, dict) and isinstance(block.get('ros__parameters'), dict):
                values.update(flatten(block['ros__parameters']))
    for rule in overrides:
        name, sep, text = rule.partition(':=')
        if not sep or not name:
            raise ReplayError(f'-p {rule!r}: expected NAME:=VALUE')
        try:
            values[name] = safe_yaml.load(text)
        except ValueError:
            values[name] = text
    return values


def robot_config(values: dict) -> Config:
    if values.get('robots'):
        raise ReplayError("the parameters name a fleet (robots); replay one robot: give its "
                          'robot_file as --params-file')
    try:
        return Config.from_values(values)
    except StartError as e:
        raise ReplayError(str(e)) from None


def make_engine(cfg: Config, threads: int | None = None):
    """The engine as the node configures it, checked against the robot as the node checks."""
    import functools

    from oxygen_ros.engine import Engine, EngineConfig
    from oxygen_ros.model.tokenizer import prompt_tokens

    settings = cfg.engine_settings()
    if threads is not None:
        settings['threads'] = threads
    try:
        engine = Engine(EngineConfig.from_dict(settings))
    except (ValueError, OSError) as e:
        raise ReplayError(f'cannot start the engine: {e}') from None
    cfg.sized_tokens = engine.cfg.max_new_tokens
    cfg.prompt_tokens = functools.partial(prompt_tokens, engine.tokenizer,
                                          state_dim=cfg.profile.state_dim,
                                          prompt_format=engine.cfg.prompt_format)
    cfg.max_token_len = engine.model_cfg.max_token_len
    try:
        cfg.check_engine(engine.slots, engine.action_dim, engine.state_dim,
                         engine.conventions == 'lerobot')
    except StartError as e:
        raise ReplayError(str(e)) from None
    why = cfg.check_prompt(cfg.p.prompt)
    if why:
        raise ReplayError(f'parameter prompt: {why}')
    return engine


# -- topics ---------------------------------------------------------------------------------

def resolve(topic: str, namespace: str = '', remaps: dict | None = None) -> str:
    """A node's topic name as it appears in a bag: relative names under the namespace,
    ~ under the node's name, then the remap rules (FROM resolved the same way)."""
    ns = '/' + namespace.strip('/') if namespace.strip('/') else ''
    if topic.startswith('~'):
        name = f'{ns}/{NODE}{topic[1:]}'
    elif topic.startswith('/'):
        name = topic
    else:
        name = f'{ns}/{topic}'
    name = re.sub('/+', '/', name).rstrip('/') or '/'
    return (remaps or {}).get(name, name)


def remap_rules(rules: list[str], namespace: str) -> dict:
    out = {}
    for rule in rules:
        src, sep, dst = rule.partition(':=')
        if not sep or not src or not dst:
            raise ReplayError(f'--remap {rule!r}: expected FROM:=TO')
        out[resolve(src, namespace)] = resolve(dst, namespace)
    return out


@dataclass
class Plan:
    """Which bag topic is what: (kind, key) per topic."""

    inputs: dict[str, tuple[str, str]]  # topic -> ('image' | 'compressed' | 'joints', key)
    commands: dict[str, str]  # topic -> output group
    predicted: str
    prompt: str

    @classmethod
    def of(cls, cfg: Config, namespace: str = '', remaps: dict | None = None,
           predicted: str = '') -> Plan:
        def r(t):
            return resolve(t, namespace, remaps)

        inputs = {r(t): ('compressed' if cfg.transports[c] == 'compressed' else 'image', c)
                  for c, t in cfg.cameras.items()}
        inputs.update({r(t): ('joints', s) for s, t in cfg.joint_topics.items()})
        return cls(inputs, {r(g.topic): g.name for g in cfg.groups},
                   predicted or r('~/predicted_trajectory'), r('~/prompt'))


# -- what the replay runs on ----------------------------------------------------------------

@dataclass
class Event:
    t: float  # the recording's clock (s)
    kind: str  # INPUT_KINDS, 'command', 'predicted', 'prompt'
    key: str  # camera, joint source or output group
    msg: object
    log_ns: int = 0  # when the bag logged it


@dataclass
class Predicted:
    stamp: float  # action k is for stamp + k * period (the node's min(frame stamp, clock))
    frame_stamp: float  # the observation's stamp (frame_noise's key)
    positions: np.ndarray  # [horizon, outputs] targets of the output joints
    log_ns: int = 0
    live: np.ndarray | None = None  # the recorded live chunk of the same frame


@dataclass
class Run:
    """One recording replayed."""

    path: str
    kind: str  # 'bag' or 'hdf5'
    clock: str  # '/clock', 'log time' or 'episode'
    frames: list[Predicted] = field(default_factory=list)
    skips: list[tuple[float, str]] = field(default_factory=list)  # (clock, why): no frame
    unmatched: list[tuple[float, str]] = field(default_factory=list)  # live frames not found
    live_frames: int = 0
    earlier: int = 0  # live frames found among the earlier inputs of their stamp
    mode: str = 'rate'
    seconds: float = 0.0  # the recording's length
    problems: dict = field(default_factory=dict)  # the input problems counted
    reference: object = None  # Reference: what followed
    against: str = ''
    notes: list[str] = field(default_factory=list)
    storage: str = ''  # a bag's: 'sqlite3' or 'mcap'
    bag: object = None  # a bag's Bag, open until the report is written


def stamp_of(header) -> float:
    return seconds(header.stamp)


class Replay:
    """One robot's inputs and the engine, fed a recording's events in order."""

    def __init__(self, cfg: Config, engine, run: Run, say=print):
        self.cfg, self.engine, self.run = cfg, engine, run
        self.clock = 0.0
        self.reporter = Reporter(say, cfg.p.report_period, clock=lambda: self.clock)
        self.inputs = Inputs(cfg, self.reporter, lambda: self.clock)
        self.prompt = cfg.p.prompt
        names = cfg.output_names
        self.idx = list(names)
        self.names = list(names.values())
        self.column = {n: k for k, n in enumerate(self.names)}
        # Measured positions of each output joint: (stamp, value) per index.
        self.measured: dict[int, list[tuple[float, float]]] = {i: [] for i in self.idx}
        self.reads = {}
        for k, i in enumerate(self.idx):
            src, joint = cfg.hold_sources[i]
            self.reads.setdefault(src, []).append((k, joint))
        self.commands: list[tuple[float, list[int], np.ndarray, np.ndarray]] = []
        self.live: dict[float, tuple[np.ndarray, int]] = {}
        self.why = ''  # why the last look found no frame

    # -- events ------------------------------------------------------------------------------

    def take(self, ev: Event) -> None:
        if ev.t < self.clock - 0.01:
            # The clock went back (a simulation reset): held samples' ages mean nothing.
            self.inputs.clear()
        self.clock = ev.t
        if ev.kind == 'image':
            self.inputs.image(ev.key, ev.msg)
        elif ev.kind == 'compressed':
            self.inputs.compressed(ev.key, ev.msg)
        elif ev.kind == 'joints':
            self.inputs.joints(ev.key, ev.msg)
            self._measure(ev)
        elif ev.kind == 'command':
            self._command(ev)
        elif ev.kind == 'prompt':
            why = self.cfg.check_prompt(ev.msg.data)
            if why:
                self.reporter.report(problem_key('prompt', why), f'~/prompt: {why}')
            else:
                self.prompt = ev.msg.data.strip()

    def _measure(self, ev: Event) -> None:
        t = stamp_of(ev.msg.header) or ev.t
        got = dict(zip(ev.msg.name, ev.msg.position, strict=False))
        for k, joint in self.reads.get(ev.key, ()):
            x = got.get(joint)
            if x is not None and math.isfinite(x):
                self.measured[self.idx[k]].append((t, float(x)))

    def _command(self, ev: Event) -> None:
        m = ev.msg
        group = next(g for g in self.cfg.groups if g.name == ev.key)
        by_joint = dict(zip(group.joints, group.indices, strict=True))
        cols = [(c, self.idx.index(by_joint[j])) for c, j in enumerate(m.joint_names)
                if j in by_joint]
        if not cols or not m.points:
            return
        if any(len(p.positions) != len(m.joint_names) for p in m.points):
            self.reporter.report(f'command:{ev.key}', f'a trajectory for {ev.key} whose '
                                 'points do not name every joint; not compared')
            return
        t0 = stamp_of(m.header) or ev.t
        times = np.array([seconds(p.time_from_start) for p in m.points])
        pos = np.array([[p.positions[c] for c, _ in cols] for p in m.points], dtype=float)
        self.commands.append((t0, [k for _, k in cols], times, pos))

    def add_live(self, m, log_ns: int) -> None:
        """A chunk of the live node (its ~/predicted_trajectory) to replay the frame of."""
        cols = [self.column.get(n) for n in m.joint_names]
        if None in cols or not m.points or \
                any(len(p.positions) != len(cols) for p in m.points):
            return
        out = np.full((len(m.points), len(self.names)), np.nan)
        out[:, cols] = np.array([list(p.positions) for p in m.points], dtype=float)
        self.live[stamp_of(m.header)] = (out, log_ns)

    # -- frames ------------------------------------------------------------------------------

    def look(self, take: bool = True):
        frame, why = self.inputs.frame(self.clock, take)
        if frame is None and not why.startswith('no new input'):
            self.why = why
        return frame, why

    def predict(self, frame, log_ns: int = 0) -> tuple[Predicted | None, str]:
        """The engine on `frame` at the current clock, as the node's engine thread runs it;
        (None, why) when the frame does not run."""
        try:
            obs, state = self.inputs.observation(frame, self.engine.slots, self.prompt)
        except ValueError as e:
            return None, str(e)
        result = self.engine.step(obs)
        try:
            targets = np.asarray(self.cfg.profile.decode_actions(result.actions, state),
                                 dtype=float)
        except ValueError as e:
            return None, f'actions not usable: {e}'
        if not np.all(np.isfinite(targets)):
            return None, 'the model produced NaN/inf actions'
        return Predicted(min(frame.stamp, self.clock), frame.stamp,
                         np.ascontiguousarray(targets[:, self.idx]), log_ns), ''

    def frame(self, frame, log_ns: int = 0) -> Predicted | None:
        p, why = self.predict(frame, log_ns)
        if p is None:
            self.skip(why)
        else:
            self.run.frames.append(p)
        return p

    def skip(self, why: str) -> None:
        self.run.skips.append((self.clock, why))

    def at_rate(self, events, rate: float, progress=None) -> None:
        """A frame every 1/rate s of the recording's clock, from the inputs taken up to
        then, where they give one."""
        period = 1.0 / rate
        first, n = None, 1
        log_ns = 0
        for ev in events:
            if first is None and ev.kind in INPUT_KINDS:
                first = ev.t
            # Tick n at first + n periods, once every input up to then is in (a stamp on
            # the tick, computed another way, counts as in).
            while first is not None and ev.t > first + n * period + 1e-9:
                self._tick(first + n * period, log_ns)
                n += 1
            self.take(ev)
            log_ns = ev.log_ns
            if progress:
                progress(ev)
        while first is not None and first + n * period <= self.clock + 1e-9:
            self._tick(first + n * period, log_ns)
            n += 1

    def _tick(self, t: float, log_ns: int) -> None:
        self.clock = max(self.clock, t)
        frame, why = self.look()
        if frame is None:
            if not why.startswith('no new input'):
                self.skip(why)
            return
        self.frame(frame, log_ns)

    def at_live(self, events, progress=None) -> None:
        """The frames the live node ran (its recorded chunks), found by their stamps: the
        inputs, looked at after every one taken, give a frame with that stamp before a
        newer one comes or the node's chunk for it was recorded. Where an input came
        between the node's looks (a second camera's image, a joint state, within
        milliseconds of the frame's own), the inputs give that stamp twice: the last is
        run, and an earlier one where the node's chunk says the node had not taken that
        input yet (Run.earlier counts those)."""
        targets = sorted(self.live)
        k = 0
        seen = []  # (frame, clock, log_ns) of each distinct frame with the stamp sought
        due = False  # the node's chunk for targets[k] was recorded

        def settle():
            nonlocal k, seen, due
            if not seen:
                self.run.unmatched.append((targets[k], self.why or 'no frame with this stamp '
                                           'from the recorded inputs'))
            else:
                self._settle(targets[k], seen)
            k += 1
            seen, due = [], False

        for ev in events:
            self.take(ev)
            if progress:
                progress(ev)
            if k >= len(targets):
                continue
            if ev.kind == 'predicted':
                if abs(stamp_of(ev.msg.header) - targets[k]) <= SAME_S:
                    if seen:
                        settle()
                    else:
                        due = True
                continue
            if ev.kind not in INPUT_KINDS:
                continue
            frame, _ = self.look(take=False)
            while frame is not None and k < len(targets):
                if frame.stamp < targets[k] - SAME_S:
                    break  # older than the frame sought: the node did not run it
                if abs(frame.stamp - targets[k]) <= SAME_S:
                    if not seen or seen[-1][0].stamps != frame.stamps:
                        seen.append((frame, self.clock, ev.log_ns))
                    if due:
                        settle()
                    break
                settle()  # a newer frame came: the one sought is among those seen before
        while k < len(targets):
            settle()

    def _settle(self, target: float, seen: list) -> None:
        live = self.live[target][0]
        first, why = None, ''
        for n, (frame, clock, log_ns) in enumerate(reversed(seen)):
            now, self.clock = self.clock, clock
            try:
                p, why = self.predict(frame, log_ns)
            finally:
                self.clock = now
            if p is None:
                continue
            first = first or p
            if p.positions.shape == live.shape and \
                    float(np.nanmax(np.abs(p.positions - live))) <= LIVE_MATCH:
                self.run.earlier += int(n > 0)
                self.run.frames.append(p)
                return
        if first is None:
            self.run.unmatched.append((target, why))
        else:
            self.run.frames.append(first)


# -- recordings -------------------------------------------------------------------------------

def is_bag(path: Path) -> bool:
    return (path / 'metadata.yaml').exists() if path.is_dir() else \
        path.suffix in ('.db3', '.mcap')


def episodes(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(path.glob('episode_*.hdf5'), key=lambda p: (len(p.name), p.name))
    return [path]


def cdr_message(store, raw, msgtype: str):
    """A message of a bag. Bytes after its end are taken as padding: rclpy's
    serialize_message leaves some (the node publishes its commands so), which every
    subscriber ignores and rosbags' deserialize_cdr refuses."""
    from rosbags.serde import SerdeError

    try:
        return store.deserialize_cdr(raw, msgtype)
    except SerdeError as e:
        if 'size mismatch' not in str(e):
            raise
    msgdef = store.get_msgdef(msgtype)
    read = msgdef.deserialize_cdr_le if raw[1] else msgdef.deserialize_cdr_be
    return read(memoryview(raw)[4:], 0, msgdef.cls, store)[0]


class Bag:
    """A rosbag2 recording open with rosbags: its connections by the replay's plan."""

    def __init__(self, path: Path, plan: Plan):
        from rosbags.rosbag2 import Reader
        from rosbags.typesys import Stores, get_typestore

        self.path, self.plan = path, plan
        self.store = get_typestore(Stores.ROS2_JAZZY)
        try:
            self.reader = Reader(path)
            self.reader.open()
        except Exception as e:  # rosbags' own errors, a corrupt file
            raise ReplayError(f'{path}: not a readable rosbag2 recording: '
                              f'{type(e).__name__}: {e}') from None
        self.by_topic = {c.topic: c for c in self.reader.connections}
        want = {'image': TYPES['image'], 'compressed': TYPES['compressed'],
                'joints': TYPES['joints']}
        self.conns = {}  # connection id -> (kind, key)
        missing = []
        for topic, (kind, key) in plan.inputs.items():
            c = self.by_topic.get(topic)
            if c is None or c.msgtype != want[kind]:
                missing.append(f'{topic} ({want[kind]})')
                continue
            self.conns[c.id] = (kind, key)
        if missing:
            have = ', '.join(f'{c.topic} ({c.msgtype})' for c in self.reader.connections) \
                or 'none'
            raise ReplayError(f'{path}: the robot\'s inputs {", ".join(missing)} are not in '
                              f'the recording (it has: {have}); --namespace and --remap '
                              'map the robot file\'s topics onto the recording\'s')
        for topic, group in plan.commands.items():
            c = self.by_topic.get(topic)
            if c is not None and c.msgtype == TYPES['trajectory'] and c.msgcount:
                self.conns[c.id] = ('command', group)
        for topic, kind in ((plan.predicted, 'predicted'), (plan.prompt, 'prompt')):
            c = self.by_topic.get(topic)
            if c is not None and c.msgtype == TYPES['trajectory' if kind == 'predicted'
                                                        else 'prompt']:
                self.conns[c.id] = (kind, '')
        clock = self.by_topic.get('/clock')
        self.clock = clock if clock is not None and clock.msgtype == TYPES['clock'] \
            and clock.msgcount else None
        self.storage = next((p.suffix.lstrip('.') for p in
                             ([path] if path.is_file() else sorted(path.iterdir()))
                             if p.suffix in ('.db3', '.mcap')), '?')
        self.storage = {'db3': 'sqlite3'}.get(self.storage, self.storage)

    @property
    def seconds(self) -> float:
        return self.reader.duration * 1e-9

    def by_id(self, cid: int):
        return next(c for c in self.reader.connections if c.id == cid)

    def predicted(self) -> list[tuple[int, object]]:
        """The live node's chunks: (when logged, the message)."""
        conns = [self.by_id(i) for i, (k, _) in self.conns.items() if k == 'predicted']
        if not conns:
            return []
        return [(log_ns, self._msg(c, raw))
                for c, log_ns, raw in self.reader.messages(connections=conns)]

    def _msg(self, c, raw):
        return cdr_message(self.store, raw, c.msgtype)

    def events(self):
        """The plan's messages in the order they were logged, on the recording's clock."""
        conns = [self.by_id(i) for i in self.conns]
        if self.clock is not None:
            conns.append(self.clock)
        clock = None
        for c, log_ns, raw in self.reader.messages(connections=conns):
            if c is self.clock or (self.clock is not None and c.id == self.clock.id):
                clock = seconds(self._msg(c, raw).clock)
                continue
            t = log_ns * 1e-9 if self.clock is None else clock
            if t is None:
                continue  # under /clock, before its first message: no time yet
            kind, key = self.conns[c.id]
            try:
                msg = self._msg(c, raw)
            except Exception as e:  # a message that does not deserialise: the node would
                # never have seen it either
                yield Event(t, 'bad', c.topic, e, log_ns)
                continue
            yield Event(t, kind, key, msg, log_ns)

    def close(self):
        self.reader.close()


class Episode:
    """An ACT/ALOHA HDF5 episode as the robot's topics would have carried it: each step's
    images and joint states, stamped EPOCH + step * dt."""

    def __init__(self, path: Path, cfg: Config):
        import h5py

        self.path, self.cfg = path, cfg
        try:
            f = h5py.File(path, 'r')
        except OSError as e:
            raise ReplayError(f'{path}: not a readable HDF5 file: {e}') from None
        self.file = f
        if 'observations/qpos' not in f:
            raise ReplayError(f'{path}: no /observations/qpos: not an ACT/ALOHA episode')
        self.qpos = np.asarray(f['observations/qpos'][()], dtype=float)
        self.action = np.asarray(f['action'][()], dtype=float) if 'action' in f else None
        self.dt = float(f.attrs.get('dt', 0.02))
        have = sorted(f['observations/images']) if 'observations/images' in f else []
        self.images = {}
        for cam in cfg.cameras:
            name = next((n for n in (cam, CAMERAS.get(cam)) if n in have), None)
            if name is None:
                if cam in cfg.p.optional_cameras:
                    continue
                raise ReplayError(f'{path}: no images of camera {cam} (/observations/images/'
                                  f'{cam}); the episode has {have or "no images"}')
            self.images[cam] = f[f'observations/images/{name}']
        self.aloha = cfg.p.robot == 'aloha'
        n = self.qpos.shape[1] if self.qpos.ndim == 2 else -1
        want = 14 if self.aloha else cfg.profile.state_dim
        if n != want:
            raise ReplayError(f'{path}: /observations/qpos has {n} columns, the '
                              f'{cfg.p.robot} robot file {want}')

    @property
    def seconds(self) -> float:
        return len(self.qpos) * self.dt

    def readings(self, t: int) -> dict[str, dict[str, float]]:
        """Per joint source, what its JointState would carry at step t."""
        q = self.qpos[t]
        if self.aloha:
            out = {}
            for side, row in (('left', q[:7]), ('right', q[7:])):
                finger = float(finger_from_normalized(row[6]))
                out[side] = dict(zip(ARM_JOINTS, row[:6], strict=True))
                out[side].update(gripper=float(gripper_from_finger(finger)),
                                 left_finger=finger, right_finger=-finger)
            return out
        out = {}
        for (src, name), x in zip(self.cfg.joint_map.joints, q, strict=True):
            out.setdefault(src, {})[name] = float(x)
        return out

    def targets(self) -> np.ndarray | None:
        """/action in what the node publishes ([T, action_dim]): ALOHA's normalised grippers
        as the servo angles the robot file commands."""
        if self.action is None:
            return None
        a = self.action.copy()
        if self.aloha:
            a[:, [6, 13]] = gripper_from_finger(finger_from_normalized(a[:, [6, 13]]))
        return a

    def events(self):
        for t in range(len(self.qpos)):
            at = EPOCH + t * self.dt
            header = header_at(at)
            for cam, data in self.images.items():
                px = np.ascontiguousarray(data[t])
                if px.ndim != 3 or px.shape[2] != 3:
                    raise ReplayError(f'{self.path}: images of {cam} are {data.shape}, not '
                                      '[T, H, W, 3] RGB')
                yield Event(at, 'image', cam, SimpleNamespace(
                    header=header, height=px.shape[0], width=px.shape[1], encoding='rgb8',
                    step=px.shape[1] * 3, is_bigendian=0, data=px.reshape(-1)))
            for src, got in self.readings(t).items():
                if src in self.cfg.joint_topics:
                    yield Event(at, 'joints', src, SimpleNamespace(
                        header=header, name=list(got), position=list(got.values())))

    def close(self):
        self.file.close()


def header_at(t: float):
    sec, ns = split(t)
    return SimpleNamespace(stamp=SimpleNamespace(sec=sec, nanosec=ns))


# -- what followed ---------------------------------------------------------------------------

class Reference:
    """What followed, per output joint: linear through its (time, value) points; NaN outside
    them and between two points more than max_gap apart (a joint not read for a while is
    not guessed)."""

    def __init__(self, points: list[tuple[np.ndarray, np.ndarray]], max_gap: float = math.inf):
        self.points = points
        self.max_gap = max_gap

    def at(self, times: np.ndarray, j: int) -> np.ndarray:
        times = np.asarray(times, dtype=float)
        xs, ys = self.points[j]
        if not len(xs):
            return np.full(times.shape, np.nan)
        # A time on the first or last point, computed another way, is on it.
        near = np.where(np.abs(times - xs[0]) < 1e-9, xs[0], times)
        near = np.where(np.abs(near - xs[-1]) < 1e-9, xs[-1], near)
        v = np.interp(near, xs, ys, left=np.nan, right=np.nan)
        if math.isfinite(self.max_gap) and len(xs) > 1:
            after = np.clip(np.searchsorted(xs, times), 1, len(xs) - 1)
            v[(xs[after] - xs[after - 1]) > self.max_gap] = np.nan
        return v

    def span(self) -> tuple[float, float]:
        xs = [x for x, _ in self.points if len(x)]
        return min(x[0] for x in xs), max(x[-1] for x in xs)

    @classmethod
    def from_series(cls, series: list[list[tuple[float, float]]],
                    max_gap: float = math.inf) -> Reference:
        points = []
        for samples in series:
            s = np.array(sorted(samples), dtype=float).reshape(-1, 2)
            points.append((s[:, 0], s[:, 1]))
        return cls(points, max_gap)

    @classmethod
    def from_commands(cls, commands, joints: int, end: float) -> Reference:
        """Trajectories (start, output joints, time_from_start, positions) as a controller
        follows them: each replaces the one before from its start, goes linearly from where
        that one had the joint to its points, and holds its last point (until `end`)."""
        commands = sorted(commands, key=lambda c: c[0])
        points = []
        for j in range(joints):
            mine = [(t0, times, pos[:, cols.index(j)]) for t0, cols, times, pos in commands
                    if j in cols]
            xs, ys = [], []
            for n, (t0, times, pos) in enumerate(mine):
                stop = mine[n + 1][0] if n + 1 < len(mine) else max(end, t0 + times[-1])
                first = ys[-1] if ys else pos[0]
                cx = np.concatenate([[t0], t0 + times])
                cy = np.concatenate([[first], pos])
                keep = cx < stop
                xs += list(cx[keep])
                ys += list(cy[keep])
                xs.append(stop)
                ys.append(float(np.interp(stop, cx, cy)))
            points.append((np.array(xs), np.array(ys)))
        return cls(points)


def _nanmean(x, axis=None):
    x = np.asarray(x, dtype=float)
    n = np.sum(np.isfinite(x), axis=axis)
    s = np.nansum(x, axis=axis)
    with np.errstate(invalid='ignore', divide='ignore'):
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def compare(frames: list[Predicted], ref: Reference, period: float, names: list[str],
            max_shift: float = 0.5) -> dict:
    """Each chunk against what followed: the mean absolute error per joint and horizon step,
    and per joint the shift of what followed (within max_shift) that fits the prediction
    best (lead_s > 0: the prediction is ahead of what followed)."""
    if not frames:
        return {'frames': 0}
    pos = np.stack([f.positions for f in frames])  # [F, H, J]
    horizon = pos.shape[1]
    times = np.array([f.stamp for f in frames])[:, None] + period * np.arange(horizon)
    err = np.stack([np.abs(pos[..., j] - ref.at(times, j)) for j in range(len(names))], -1)
    per_step_joint = _nanmean(err, axis=0)  # [H, J]
    step = min(0.01, period / 2)
    shifts = np.arange(-round(max_shift / step), round(max_shift / step) + 1) * step
    # Nearest to none first: where several fit equally (a joint that did not move), the
    # smallest shift is the answer.
    shifts = shifts[np.argsort(np.abs(shifts), kind='stable')]
    joints = {}
    for j, name in enumerate(names):
        fit = np.array([_nanmean(np.abs(pos[..., j] - ref.at(times + s, j)))
                        for s in shifts])
        best = int(np.nanargmin(fit)) if np.any(np.isfinite(fit)) else None
        joints[name] = {
            'mae': float(_nanmean(err[..., j])),
            'mae_per_step': per_step_joint[:, j].tolist(),
            'compared': int(np.sum(np.isfinite(err[..., j]))),
            'lead_s': None if best is None else float(shifts[best]),
            'mae_at_lead': None if best is None else float(fit[best]),
        }
    return {'frames': len(frames), 'horizon': horizon, 'period_s': period,
            'mae': float(_nanmean(err)),
            'mae_per_step': _nanmean(err, axis=(0, 2)).tolist(), 'joints': joints}


def reference_for(run: Run, rep: Replay, against: str, targets: np.ndarray | None = None,
                  dt: float = 0.0, end: float = 0.0) -> tuple[Reference | None, str]:
    """What followed, as `against` asks ('auto': commands, else /action, else joints)."""
    if not run.frames:
        return None, against
    if against == 'auto':
        against = ('commands' if rep.commands else 'action' if targets is not None
                   else 'joints')
    if against == 'commands':
        if not rep.commands:
            raise ReplayError(f'{run.path}: --against commands, but the recording has no '
                              "commands on the robot's trajectory topics")
        return Reference.from_commands(rep.commands, len(rep.idx), end), against
    if against == 'action':
        if targets is None:
            raise ReplayError(f'{run.path}: --against action needs an HDF5 episode with '
                              '/action')
        t = EPOCH + dt * np.arange(len(targets))
        series = [list(zip(t, targets[:, i], strict=True)) for i in rep.idx]
        return Reference.from_series(series), against
    series = [rep.measured[i] for i in rep.idx]
    if not any(series):
        raise ReplayError(f'{run.path}: no measured positions of the output joints '
                          f'{rep.names} in the recording')
    return Reference.from_series(series, rep.cfg.p.max_input_age), against


# -- replaying --------------------------------------------------------------------------------

def replay_bag(path: Path, cfg: Config, engine, plan: Plan, frames: str, rate: float,
               against: str, progress: bool = True, say=print) -> Run:
    bag = Bag(path, plan)
    try:
        run = Run(str(path), 'bag', '/clock' if bag.clock is not None else 'log time')
        run.seconds = bag.seconds
        run.storage = bag.storage
        rep = Replay(cfg, engine, run, say)
        if frames in ('auto', 'live'):
            for log_ns, msg in bag.predicted():
                rep.add_live(msg, log_ns)
        if frames == 'live' and not rep.live:
            raise ReplayError(f'{path}: --frames live, but the recording has no chunks of the '
                              f'node on {plan.predicted}')
        total = sum(bag.by_id(i).msgcount for i in bag.conns)
        bar, tick = _bar(total, path.name, progress)
        events = _checked(bag.events(), rep)
        try:
            if rep.live:
                run.mode, run.live_frames = 'live', len(rep.live)
                rep.at_live(events, tick)
            else:
                run.mode = 'rate'
                rep.at_rate(events, rate, tick)
        finally:
            if bar is not None:
                bar.close()
        _finish(run, rep, against)
        run.bag = bag
        return run
    except BaseException:
        bag.close()
        raise


def _checked(events, rep: Replay):
    for ev in events:
        if ev.kind == 'bad':
            rep.reporter.report(f'bag:{ev.key}', f'{ev.key}: a message that does not '
                                f'deserialise ({ev.msg}); skipped')
            continue
        yield ev


def _bar(total: int, name: str, progress: bool):
    if not progress:
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=f'oxygen-replay {name}', unit='msg', file=sys.stderr,
               mininterval=0.5)
    return bar, lambda _ev: bar.update()


def _finish(run: Run, rep: Replay, against: str, targets=None, dt: float = 0.0) -> None:
    for p in run.frames:
        live = rep.live.get(p.stamp)
        if live is None:
            # The same frame, its stamp through another float conversion.
            near = [s for s in rep.live if abs(s - p.stamp) <= SAME_S]
            live = rep.live[near[0]] if near else None
        if live is not None:
            p.live = live[0]
    run.problems = dict(rep.reporter.totals)
    run.reference, run.against = reference_for(run, rep, against, targets, dt, rep.clock)


def replay_episode(path: Path, cfg: Config, engine, rate: float, against: str,
                   progress: bool = True, say=print) -> Run:
    ep = Episode(path, cfg)
    try:
        run = Run(str(path), 'hdf5', 'episode')
        run.seconds = ep.seconds
        rep = Replay(cfg, engine, run, say)
        bar, tick = _bar(len(ep.qpos), path.name, progress)
        steps = _per_step(ep.events(), tick)
        try:
            rep.at_rate(steps, rate)
        finally:
            if bar is not None:
                bar.close()
        _finish(run, rep, against, ep.targets(), ep.dt)
        return run
    finally:
        ep.close()


def _per_step(events, tick):
    last = None
    for ev in events:
        if tick and ev.t != last:
            tick(ev)
            last = ev.t
        yield ev


# -- the report -------------------------------------------------------------------------------

def live_summary(run: Run) -> dict | None:
    if run.mode != 'live':
        return None
    diffs = [float(np.nanmax(np.abs(p.positions - p.live))) for p in run.frames
             if p.live is not None and p.live.shape == p.positions.shape]
    return {'frames': run.live_frames, 'replayed': len(run.frames),
            'compared': len(diffs), 'earlier_inputs': run.earlier,
            'max_abs_diff': max(diffs) if diffs else None,
            'unmatched': [{'stamp': s, 'why': w} for s, w in run.unmatched]}


def report(runs: list[Run], cfg: Config, max_shift: float, wall_s: float,
           params: list[str]) -> dict:
    """The JSON report: each recording's frames, and every chunk against what followed."""
    period = cfg.action_period
    names = list(cfg.output_names.values())
    frames = [p for r in runs for p in r.frames]
    # Every recording's chunks against its own reference: one comparison each, pooled.
    per = [compare(r.frames, r.reference, period, names, max_shift)
           if r.reference is not None else None for r in runs]
    pooled = _pool([c for c in per if c], names)
    recording_s = sum(r.seconds for r in runs)
    out = {
        'recordings': [{
            'path': r.path, 'kind': r.kind,
            **({'storage': r.storage} if r.storage else {}),
            'clock': r.clock, 'seconds': r.seconds, 'frames': r.mode,
            'frames_run': len(r.frames),
            'skipped': dict(Counter(problem_key('frame', w) for _, w in r.skips)),
            'input_problems': r.problems, 'against': r.against,
            'mae': c.get('mae') if c else None,
            **({'live': live_summary(r)} if r.mode == 'live' else {}),
            'notes': r.notes,
        } for r, c in zip(runs, per, strict=True)],
        'robot': cfg.p.robot, 'model': cfg.p.model or 'small',
        'checkpoint': cfg.p.checkpoint or None, 'seed': cfg.p.seed,
        'frame_noise': cfg.p.frame_noise, 'params_files': params,
        'joints': names, 'period_s': period,
        'against': sorted({r.against for r in runs if r.against}),
        **pooled,
        'frames_run': len(frames),
        'recording_s': recording_s, 'wall_s': wall_s,
        'time_ratio': wall_s / recording_s if recording_s else None,
    }
    return out


def _pool(parts: list[dict], names: list[str]) -> dict:
    """Comparisons of several recordings as one: means weighted by what each compared."""
    parts = [p for p in parts if p.get('frames')]
    if not parts:
        return {'frames': 0}
    joints = {}
    for name in names:
        got = [(p['joints'][name], p['joints'][name]['compared']) for p in parts]
        w = np.array([n for _, n in got], dtype=float)
        steps = np.array([j['mae_per_step'] for j, _ in got], dtype=float)
        # Each step's weight: what that recording compared, spread evenly over its steps.
        joints[name] = {
            'mae': _weighted([j['mae'] for j, _ in got], w),
            'mae_per_step': [_weighted(steps[:, k], w) for k in range(steps.shape[1])],
            'compared': int(w.sum()),
            'lead_s': _weighted([j['lead_s'] for j, _ in got], w),
            'mae_at_lead': _weighted([j['mae_at_lead'] for j, _ in got], w),
        }
    horizon = parts[0]['horizon']
    per_step = [float(_nanmean([joints[n]['mae_per_step'][k] for n in names]))
                for k in range(horizon)]
    w = np.array([joints[n]['compared'] for n in names], dtype=float)
    return {'frames': sum(p['frames'] for p in parts), 'horizon': horizon,
            'mae': _weighted([joints[n]['mae'] for n in names], w),
            'mae_per_step': per_step, 'per_joint': joints}


def _weighted(values, weights) -> float | None:
    v = np.array([np.nan if x is None else x for x in values], dtype=float)
    w = np.asarray(weights, dtype=float)
    ok = np.isfinite(v) & (w > 0)
    if not ok.any():
        return None
    return float(np.sum(v[ok] * w[ok]) / np.sum(w[ok]))


def _json(x):
    """NaN and infinity as null: JSON has neither."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json(v) for v in x]
    return x


def plot(runs: list[Run], rep: dict, out: Path) -> list[str]:
    """A plot per joint: what followed and every chunk over time (the first recording),
    and the error per horizon step (all)."""
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    paths = []
    run = next((r for r in runs if r.frames and r.reference is not None), None)
    if run is None:
        return paths
    period = rep['period_s']
    for j, name in enumerate(rep['joints']):
        fig, (top, low) = plt.subplots(2, 1, figsize=(9, 6), height_ratios=[2, 1])
        ref = run.reference
        t0 = run.frames[0].stamp
        lo, hi = ref.span()
        grid = np.linspace(max(lo, t0 - 1.0), hi, 4000)
        top.plot(grid - t0, ref.at(grid, j), color='black', lw=1.0,
                 label=f'what followed ({run.against})')
        for k, p in enumerate(run.frames):
            times = p.stamp - t0 + period * np.arange(len(p.positions))
            top.plot(times, p.positions[:, j], color='tab:orange', lw=0.6, alpha=0.6,
                     label='predicted chunks' if k == 0 else None)
        top.set_xlabel(f's from the first frame of {Path(run.path).name}')
        top.set_ylabel(name)
        top.legend(loc='best', fontsize=8)
        joint = rep.get('per_joint', {}).get(name)
        if joint:
            steps = np.arange(len(joint['mae_per_step'])) * period
            low.plot(steps, [np.nan if x is None else x for x in joint['mae_per_step']],
                     marker='o', ms=3)
            lead = joint['lead_s']
            low.set_title(f'mean abs error per horizon step (all: {joint["mae"]:.4g}; '
                          + (f'lead {lead:+.3f} s' if lead is not None else 'no lead') + ')',
                          fontsize=9)
        low.set_xlabel('s ahead of the frame')
        low.set_ylabel('mean abs error')
        fig.tight_layout()
        path = out / f'joint_{re.sub(r"[^A-Za-z0-9_.-]+", "_", name)}.png'
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(str(path))
    return paths


def write_bag(runs: list[Run], out: Path, names: list[str], period: float,
              topic: str = REPLAY_TOPIC) -> None:
    """The recordings' messages again (bags: every topic as it was) and each replayed chunk
    as a JointTrajectory on `topic`, logged when its frame ran, as MCAP. A path ending in
    .mcap is one MCAP file; else a rosbag2 directory."""
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_JAZZY)
    single = out.suffix == '.mcap'
    if out.exists():
        raise ReplayError(f'--bag-out {out} exists already')
    where = Path(tempfile.mkdtemp(prefix='oxygen-replay-', dir=out.parent)) / out.stem \
        if single else out
    T = store.types
    try:
        with Writer(where, version=9, storage_plugin=StoragePlugin.MCAP) as w:
            mine = w.add_connection(topic, TYPES['trajectory'], typestore=store)
            copied = {}
            for r in runs:
                bag = r.bag
                if bag is not None:
                    for c in bag.reader.connections:
                        if c.topic == topic or (c.topic, c.msgtype) in copied:
                            continue
                        try:
                            copied[(c.topic, c.msgtype)] = w.add_connection(
                                c.topic, c.msgtype, msgdef=c.msgdef.data or None,
                                rihs01=c.digest or None,
                                typestore=store if c.msgtype in T else None)
                        except Exception as e:  # a type the bag does not define
                            r.notes.append(f'--bag-out: {c.topic} not copied: {e}')
                chunks = iter(sorted(r.frames, key=lambda p: p.log_ns))
                nxt = next(chunks, None)

                def put(p):
                    w.write(mine, p.log_ns or int(p.stamp * 1e9), store.serialize_cdr(
                        trajectory(T, p, names, period), TYPES['trajectory']))

                if bag is not None:
                    for c, log_ns, raw in bag.reader.messages():
                        while nxt is not None and nxt.log_ns <= log_ns:
                            put(nxt)
                            nxt = next(chunks, None)
                        dst = copied.get((c.topic, c.msgtype))
                        if dst is not None:
                            w.write(dst, log_ns, raw)
                while nxt is not None:
                    put(nxt)
                    nxt = next(chunks, None)
        if single:
            files = list(where.glob('*.mcap'))
            shutil.move(str(files[0]), out)
    finally:
        if single:
            shutil.rmtree(where.parent, ignore_errors=True)


def trajectory(T, p: Predicted, names: list[str], period: float):
    """A replayed chunk as the node's ~/predicted_trajectory carries it."""
    Time = T['builtin_interfaces/msg/Time']
    Duration = T['builtin_interfaces/msg/Duration']
    Header = T['std_msgs/msg/Header']
    Point = T['trajectory_msgs/msg/JointTrajectoryPoint']
    sec, ns = split(p.stamp)
    header = Header(stamp=Time(sec=sec, nanosec=ns), frame_id='')
    from oxygen_ros.robot.playback import velocities

    points = []
    speed = velocities(p.positions, period)
    for k, row in enumerate(p.positions):
        sec, ns = split_duration(k * period)
        points.append(Point(positions=np.ascontiguousarray(row, dtype=np.float64),
                            velocities=np.ascontiguousarray(speed[k], dtype=np.float64),
                            accelerations=np.zeros(0),
                            effort=np.zeros(0),
                            time_from_start=Duration(sec=sec, nanosec=ns)))
    return T['trajectory_msgs/msg/JointTrajectory'](header=header, joint_names=list(names),
                                                    points=points)


# -- the command ------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog='oxygen-replay', description=__doc__.split('\n\n')[0],
        epilog='docs/replay.md: the options, the report, and how to read it')
    ap.add_argument('recordings', nargs='+', metavar='RECORDING',
                    help='rosbag2 directory, .db3 or .mcap file, HDF5 episode, or a directory '
                         'of episode_*.hdf5')
    ap.add_argument('--robot', default='', help='config/pi05.yaml then config/ROBOT.yaml '
                    '(aloha, droid, sim), as pi05.launch.py robot:=')
    ap.add_argument('--params-file', action='append', default=[], metavar='YAML',
                    help="the node's parameters files, in order (after --robot's)")
    ap.add_argument('-p', '--param', action='append', default=[], metavar='NAME:=VALUE',
                    help='a node parameter over the files, as -p on the node')
    ap.add_argument('--namespace', default='', help="the node's namespace (its relative "
                    'topics are under it)')
    ap.add_argument('--remap', action='append', default=[], metavar='FROM:=TO',
                    help="a topic remap, as the node's -r")
    ap.add_argument('--frames', choices=('auto', 'live', 'rate'), default='auto',
                    help="live: at the frames the node ran (its ~/predicted_trajectory); "
                         'rate: every 1/--rate s; auto: live where the bag has them')
    ap.add_argument('--rate', type=float, default=10.0, metavar='HZ',
                    help='frames per second of the recording for --frames rate (default 10)')
    ap.add_argument('--predicted-topic', default='', metavar='TOPIC',
                    help="the node's chunks in the bag (default: its ~/predicted_trajectory)")
    ap.add_argument('--against', choices=('auto', 'commands', 'action', 'joints'),
                    default='auto', help="what followed: the controllers' commands, an "
                    "episode's /action, or the measured joints; auto: the first there is")
    ap.add_argument('--max-shift', type=float, default=0.5, metavar='S',
                    help='the largest lead or lag looked for (s, default 0.5)')
    ap.add_argument('--threads', type=int, default=None,
                    help="torch threads (default: the parameters' threads)")
    ap.add_argument('--out', default='', help='report directory (default: a new temp dir)')
    ap.add_argument('--bag-out', default='', metavar='FILE.mcap',
                    help=f'write the recording with the replayed chunks on {REPLAY_TOPIC}')
    ap.add_argument('--no-progress', dest='progress', action='store_false')
    args = ap.parse_args(argv)
    if not math.isfinite(args.rate) or args.rate <= 0:
        ap.error('--rate must be > 0')
    if not math.isfinite(args.max_shift) or args.max_shift < 0:
        ap.error('--max-shift must be >= 0')
    try:
        return _main(args)
    except ReplayError as e:
        print(f'oxygen-replay: error: {e}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print('oxygen-replay: interrupted', file=sys.stderr)
        return 130


def _main(args) -> int:
    t0 = time.monotonic()
    files = params_files(args.robot, args.params_file)
    if not files and not args.param:
        raise ReplayError("say which robot: --robot NAME or the node's --params-file")
    cfg = robot_config(node_values(files, args.param))
    paths = []
    for r in args.recordings:
        p = Path(r)
        if not p.exists():
            raise ReplayError(f'{p}: no such file or directory')
        if is_bag(p):
            paths.append(('bag', p))
        else:
            found = episodes(p)
            if not found:
                raise ReplayError(f'{p}: neither a rosbag2 recording (metadata.yaml, .db3, '
                                  '.mcap) nor HDF5 episodes (episode_*.hdf5)')
            paths += [('hdf5', e) for e in found]
    engine = make_engine(cfg, args.threads)
    out = Path(args.out or tempfile.mkdtemp(prefix='oxygen-replay-')).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan = Plan.of(cfg, args.namespace, remap_rules(args.remap, args.namespace),
                   resolve(args.predicted_topic, args.namespace) if args.predicted_topic
                   else '')
    notes = []
    if cfg.p.rtc:
        notes.append('the parameters set rtc: the live chunks were guided by the chunk being '
                     'played; replayed chunks are not')
    runs = []
    say = _say(args.progress)
    try:
        for kind, p in paths:
            if kind == 'bag':
                run = replay_bag(p, cfg, engine, plan, args.frames, args.rate, args.against,
                                 args.progress, say)
            else:
                if args.frames == 'live':
                    raise ReplayError(f'{p}: an episode has no live frames; --frames rate')
                run = replay_episode(p, cfg, engine, args.rate, args.against, args.progress,
                                     say)
            run.notes += notes
            runs.append(run)
        wall = time.monotonic() - t0
        rep = report(runs, cfg, args.max_shift, wall, [str(f) for f in files])
        rep['plots'] = plot(runs, rep, out)
        if args.bag_out:
            write_bag(runs, Path(args.bag_out).resolve(), rep['joints'], cfg.action_period)
            rep['bag_out'] = str(Path(args.bag_out).resolve())
    finally:
        for r in runs:
            bag = r.bag
            if bag is not None:
                bag.close()
    path = out / 'report.json'
    path.write_text(json.dumps(_json(rep), indent=1))
    _summary(rep, path)
    return 0


def _say(progress: bool):
    if not progress:
        return lambda m: print(f'oxygen-replay: {m}', file=sys.stderr)
    from tqdm import tqdm

    return lambda m: tqdm.write(f'oxygen-replay: {m}', file=sys.stderr)


def _summary(rep: dict, path: Path) -> None:
    lines = []
    for r in rep['recordings']:
        skipped = sum(r['skipped'].values())
        line = (f'{r["path"]}: {r["frames_run"]} frames ({r["frames"]}), {skipped} skipped'
                + (f', mean abs error {r["mae"]:.4g} against {r["against"]}'
                   if r.get('mae') is not None else ''))
        live = r.get('live')
        if live:
            diff = live['max_abs_diff']
            line += (f'; live: {live["replayed"]}/{live["frames"]} frames found'
                     + (f', largest difference {diff:.3g}' if diff is not None else ''))
        lines.append(line)
    if rep.get('mae') is not None:
        worst = max(rep['per_joint'].items(), key=lambda kv: kv[1]['mae'] or 0)
        lines.append(f'mean abs error {rep["mae"]:.4g} (worst joint {worst[0]}: '
                     f'{worst[1]["mae"]:.4g}); replayed {rep["recording_s"]:.1f} s of '
                     f'recording in {rep["wall_s"]:.1f} s')
    for line in lines:
        print(f'oxygen-replay: {line}')
    print(f'oxygen-replay: report {path}')


if __name__ == '__main__':
    sys.exit(main())
