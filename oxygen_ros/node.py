"""The ROS 2 node: robot topics in, joint trajectories and narration out.

Threads, and why:
- subscription callbacks (executor) only store the latest sample, so they never wait on
  the model;
- the engine thread builds a frame from the latest samples and runs engine.step; its
  action chunk is handed over as soon as it exists, before language decoding;
- the control thread publishes what is left of the current chunk at control_rate_hz,
  shifted so that action i lands at frame time + i action periods. It sleeps to absolute
  deadlines instead of being an executor timer: on two cores a Python executor dispatching
  ~200 callbacks/s next to the model delayed timer callbacks by tens of ms (measured).
  Under use_sim_time control is a timer on the node's clock instead, so it follows /clock;
- a diagnostics timer (executor) reports rates, latencies and counted problems.
"""

from __future__ import annotations

import collections
import re
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import yaml

from oxygen_ros.frames import Assembler, Reporter, image_problem, image_to_rgb
from oxygen_ros.profiles import JointMap, make_profile

QOS_CHOICES = ('sensor_data', 'reliable', 'best_effort')


@dataclass(frozen=True)
class Param:
    name: str
    default: object  # None: no default; the empty list of `kind`
    description: str
    kind: str = ''  # 'str' / 'int' / 'float' / 'bool' / 'str[]' / 'int[]'; '' = from default


# Every parameter the node reads, in one place. Output groups add
# outputs.<group>.{topic,joints,indices} for each name in output_groups.
PARAMS = (
    # model and engine
    Param('model', 'small', "model config: 'tiny', 'small', 'pi05' or a YAML path"),
    Param('checkpoint', '', "checkpoint directory or safetensors file; '' = random weights"),
    Param('tokenizer', '', "SentencePiece model; '' = the built-in tokenizer"),
    Param('device', 'cpu', "'cpu' or 'cuda'"),
    Param('threads', 1, 'torch threads; keep below the core count so control keeps time'),
    Param('denoise_steps', 10, 'flow-matching steps per action chunk'),
    Param('decode_k', 5, 'narration decode steps per frame; 0 = fit the frame budget'),
    Param('frame_budget_ms', 0.0, 'time per frame; 0 = the chunk duration'),
    Param('max_requests', 8, 'narration requests decoded at once (KV cache slots)'),
    Param('max_new_tokens', 30, 'tokens per narration request'),
    Param('admission', 'drop_oldest', 'when all slots are busy: drop_oldest, reject_newest, wait'),
    Param('temperature', 0.0, 'narration sampling temperature; 0 = greedy'),
    Param('seed', 0, 'random seed (weights when no checkpoint, noise, sampling)'),
    Param('prompt_format', 'pi05', "'pi05' (task + state) or 'subtask'"),
    Param('compile', False, 'torch.compile the decode and denoise steps (for CUDA; slow start)'),
    # robot
    Param('robot', 'identity', "robot profile: 'identity', 'aloha' or 'droid'"),
    Param('profile_options', '', 'YAML mapping of profile options, e.g. "{delta: true}"'),
    Param('cameras', None, 'camera names, e.g. [cam_high, cam_left_wrist]', 'str[]'),
    Param('camera_topics', None, 'image topic per camera (relative); default <camera>/image_raw',
          'str[]'),
    Param('camera_slots', None, 'model image slot per camera, e.g. base_0_rgb', 'str[]'),
    Param('optional_cameras', None, 'cameras whose slot is masked instead of holding the robot '
          'when they are missing or stale', 'str[]'),
    Param('image_qos', 'sensor_data', 'image subscription QoS: ' + ', '.join(QOS_CHOICES)),
    Param('joint_topics', ['joint_states'], 'sensor_msgs/JointState topics (relative)'),
    Param('joint_sources', None, 'a name per joint topic, used in `joints` as source/joint; '
          'may be left out with one topic', 'str[]'),
    Param('joints', None, 'state joints in order, as source/joint (or joint with one topic)',
          'str[]'),
    Param('joint_qos', 'sensor_data', 'joint state subscription QoS: ' + ', '.join(QOS_CHOICES)),
    Param('output_groups', None, 'trajectory outputs, e.g. [left_arm, left_gripper]', 'str[]'),
    Param('prompt', 'pick up the object', 'task prompt; ~/prompt changes it at run time'),
    Param('max_prompt_chars', 500, 'longest prompt accepted'),
    # timing
    Param('control_rate_hz', 70.0, 'trajectory publish rate'),
    Param('action_rate_hz', 0.0, 'rate the model was trained at: action i is for frame time + '
          'i / action_rate_hz; 0 = control_rate_hz'),
    Param('max_input_age', 0.5, 's; older inputs are stale and the robot holds'),
    Param('max_skew', 0.1, 's; the most the inputs of one frame may be apart'),
    Param('narration_every_n_frames', 10, 'start a narration request every n frames; 0 = only '
          'on demand (~/narrate)'),
    Param('report_period', 5.0, 's; the same problem is logged at most once per period'),
    Param('diagnostics_rate_hz', 1.0, '/diagnostics publish rate'),
)

GROUP_PARAMS = (
    Param('topic', '', 'trajectory topic (relative), e.g. arm_controller/joint_trajectory'),
    Param('joints', None, 'joint names the controller expects', 'str[]'),
    Param('indices', None, 'action vector index of each joint', 'int[]'),
)

ENGINE_KEYS = ('model', 'checkpoint', 'tokenizer', 'device', 'threads', 'denoise_steps',
               'decode_k', 'frame_budget_ms', 'max_requests', 'max_new_tokens', 'admission',
               'temperature', 'seed', 'prompt_format', 'compile')


class StartError(Exception):
    """A bad parameter or a missing model file: said in one line, exit code 1."""


@dataclass
class Group:
    name: str
    topic: str
    joints: list[str]
    indices: list[int]


@dataclass
class Chunk:
    stamp: float  # frame time; action i is for stamp + i * period
    period: float
    positions: np.ndarray  # [H, action_dim], robot units
    velocities: np.ndarray


def make_chunk(stamp: float, period: float, positions: np.ndarray) -> Chunk:
    p = np.asarray(positions, dtype=np.float64)
    if len(p) > 1:
        v = np.gradient(p, period, axis=0)
    else:
        v = np.zeros_like(p)
    # joint_trajectory_controller rejects a trajectory that ends moving.
    v[-1] = 0.0
    return Chunk(stamp, period, p, v)


def remaining(chunk: Chunk, now: float) -> int:
    """Index of the first action still in the future at `now`."""
    times = chunk.stamp + chunk.period * np.arange(len(chunk.positions))
    return int(np.searchsorted(times, now, side='right'))


def problem_key(kind: str, text: str) -> str:
    # Numbers (ages, counts) change every time; the kind of problem does not.
    return kind + ':' + re.sub(r'[-\d.]+', '#', text)


def seconds(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


class OxygenNode:
    """Wraps an rclpy Node; built by main() so start-up errors can exit cleanly."""

    def __init__(self, rclpy_node_args: dict | None = None):
        from rclpy.node import Node

        self.node = Node('oxygen_node', **(rclpy_node_args or {}))
        self.log = self.node.get_logger()
        self.reporter = Reporter(self.log.warning)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._chunk: Chunk | None = None
        self._readings: dict[str, dict[str, float]] = {}
        self._narrate_now = False
        self._threads: list[threading.Thread] = []
        self._tick_clock = time.monotonic  # what tick gaps are measured in
        self.p = self._read_params()
        self.reporter.period = self.p['report_period']
        self._prompt = self.p['prompt']
        self._setup_robot()
        self.engine = self._make_engine()
        self._check_against_engine()
        self._stats = dict(chunks=0, frames=0, published=0, hold_ticks=0, missed_ticks=0,
                           narration_requests=0)
        self._ticks = collections.deque(maxlen=2000)  # monotonic tick times
        self._gaps = collections.deque(maxlen=2000)
        self._publishes = collections.deque(maxlen=2000)
        self._setup_ros()

    # -- parameters ------------------------------------------------------------------------

    def _declare(self, prefix: str, params) -> dict:
        from rcl_interfaces.msg import ParameterDescriptor
        from rclpy.exceptions import ParameterUninitializedException

        out = {}
        for p in params:
            name = prefix + p.name
            # dynamic_typing: a YAML `70` for a float parameter is fine; types are checked
            # below with a message that names the parameter.
            desc = ParameterDescriptor(description=p.description, dynamic_typing=True)
            self.node.declare_parameter(name, p.default, desc)
            try:
                value = self.node.get_parameter(name).value
            except ParameterUninitializedException:
                value = None
            out[p.name] = _coerce(name, value, p)
        return out

    def _read_params(self) -> dict:
        p = self._declare('', PARAMS)
        groups = []
        for g in p['output_groups']:
            if not re.fullmatch(r'[A-Za-z][A-Za-z0-9_]*', g):
                raise StartError(f'output group name {g!r} must be a plain identifier')
            q = self._declare(f'outputs.{g}.', GROUP_PARAMS)
            groups.append(Group(g, q['topic'], q['joints'], q['indices']))
        p['groups'] = groups
        for name in ('control_rate_hz', 'max_input_age', 'report_period', 'diagnostics_rate_hz'):
            if p[name] <= 0:
                raise StartError(f'{name} must be > 0, got {p[name]}')
        for name in ('action_rate_hz', 'max_skew', 'narration_every_n_frames', 'threads'):
            if p[name] < 0:
                raise StartError(f'{name} must be >= 0, got {p[name]}')
        if p['max_prompt_chars'] < 1:
            raise StartError(f'max_prompt_chars must be >= 1, got {p["max_prompt_chars"]}')
        for name in ('image_qos', 'joint_qos'):
            if p[name] not in QOS_CHOICES:
                raise StartError(f'{name} must be one of {QOS_CHOICES}, got {p[name]!r}')
        why = self._prompt_problem(p['prompt'], p['max_prompt_chars'])
        if why:
            raise StartError(f'parameter prompt: {why}')
        return p

    def _setup_robot(self):
        p = self.p
        try:
            options = yaml.safe_load(p['profile_options']) if p['profile_options'] else {}
        except yaml.YAMLError as e:
            raise StartError(f'profile_options is not YAML: {e}') from None
        if not isinstance(options, dict):
            raise StartError(f'profile_options must be a YAML mapping, got {options!r}')
        if p['robot'] == 'identity':
            options.setdefault('dim', len(p['joints']))
        try:
            self.profile = make_profile(p['robot'], **options)
        except (TypeError, ValueError) as e:
            raise StartError(f'robot profile {p["robot"]!r}: {e}') from None

        cams = p['cameras']
        if not cams:
            raise StartError('cameras is empty: name at least one camera')
        if len(set(cams)) != len(cams):
            raise StartError(f'cameras lists a name twice: {cams}')
        topics = p['camera_topics'] or [f'{c}/image_raw' for c in cams]
        if len(topics) != len(cams) or len(p['camera_slots']) != len(cams):
            raise StartError(f'cameras ({len(cams)}), camera_topics ({len(topics)}) and '
                             f'camera_slots ({len(p["camera_slots"])}) must have equal lengths')
        if len(set(p['camera_slots'])) != len(cams):
            raise StartError(f'camera_slots lists a slot twice: {p["camera_slots"]}')
        unknown = sorted(set(p['optional_cameras']) - set(cams))
        if unknown:
            raise StartError(f'optional_cameras names unknown cameras {unknown}; cameras: {cams}')
        if set(p['optional_cameras']) == set(cams):
            raise StartError('every camera is optional: at least one must be required')
        self.cameras = dict(zip(cams, topics, strict=True))
        self.slots = dict(zip(cams, p['camera_slots'], strict=True))

        jt = p['joint_topics']
        if not jt:
            raise StartError('joint_topics is empty')
        sources = p['joint_sources'] or ([''] if len(jt) == 1 else [])
        if len(sources) != len(jt):
            raise StartError(f'joint_sources must name each of the {len(jt)} joint_topics, '
                             f'got {sources}')
        self.joint_topics = dict(zip(sources, jt, strict=True))
        labels = []
        for label in p['joints']:
            if len(sources) == 1 and not label.startswith(sources[0] + '/'):
                src, name = sources[0], label
            else:
                src, _, name = label.partition('/')
            if src not in self.joint_topics:
                raise StartError(f'joint {label!r}: no joint source {src!r}; sources: {sources}')
            labels.append((src, name))
        try:
            self.joint_map = JointMap(labels)
        except ValueError as e:
            raise StartError(f'joints: {e}') from None
        if len(self.joint_map) != self.profile.state_dim:
            raise StartError(f'{len(self.joint_map)} joints listed but the {p["robot"]} profile '
                             f'takes a {self.profile.state_dim}-d state')
        self._wanted = {s: {n for src, n in labels if src == s} for s in sources}

        if not p['groups']:
            raise StartError('output_groups is empty: name at least one trajectory output')
        for g in p['groups']:
            if not g.topic:
                raise StartError(f'outputs.{g.name}.topic is empty')
            if not g.joints or len(g.joints) != len(g.indices):
                raise StartError(f'outputs.{g.name}: joints ({len(g.joints)}) and indices '
                                 f'({len(g.indices)}) must be non-empty and of equal length')
            bad = [i for i in g.indices if not 0 <= i < self.profile.action_dim]
            if bad:
                raise StartError(f'outputs.{g.name}.indices {bad} outside the '
                                 f'{self.profile.action_dim}-d action of {p["robot"]}')
        period = 1.0 / (p['action_rate_hz'] or p['control_rate_hz'])
        self.action_period = period
        self.assembler = Assembler(
            required=[c for c in cams if c not in p['optional_cameras']]
            + [f'joints:{s}' for s in sources],
            optional=p['optional_cameras'],
            max_input_age=p['max_input_age'], max_skew=p['max_skew'],
            # One frame per image of the main camera: joint states come faster and would
            # otherwise rerun the model on the same images.
            trigger=[next(c for c in cams if c not in p['optional_cameras'])])

    def _make_engine(self):
        from oxygen_ros.engine import Engine, EngineConfig

        d = {k: self.p[k] for k in ENGINE_KEYS}
        d['mode'] = 'oxygen'
        # The engine sizes its frame budget from the rate the chunk is played at.
        d['control_rate_hz'] = 1.0 / self.action_period
        try:
            return Engine(EngineConfig.from_dict(d))
        except (ValueError, OSError) as e:
            raise StartError(f'cannot start the engine: {e}') from None
        except Exception as e:  # e.g. a corrupt safetensors file raises its own error type
            raise StartError(f'cannot start the engine: {type(e).__name__}: {e}') from None

    def _check_against_engine(self):
        unknown = sorted(set(self.slots.values()) - set(self.engine.slots))
        if unknown:
            raise StartError(f'camera_slots {unknown} are not model slots '
                             f'{list(self.engine.slots)}')
        dim = self.engine.action_dim
        if self.profile.action_dim > dim or self.profile.state_dim > dim:
            raise StartError(f'the {self.p["robot"]} profile needs {self.profile.action_dim}-d '
                             f'actions but model {self.p["model"]!r} has {dim}')

    # -- ROS interface ---------------------------------------------------------------------

    def _qos(self, choice: str, depth: int = 5):
        from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data

        if choice == 'sensor_data':
            return qos_profile_sensor_data
        rel = ReliabilityPolicy.RELIABLE if choice == 'reliable' else ReliabilityPolicy.BEST_EFFORT
        return QoSProfile(depth=depth, reliability=rel)

    def _setup_ros(self):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import Empty, String
        from trajectory_msgs.msg import JointTrajectory

        from oxygen_ros.msg import Narration

        n = self.node
        for cam, topic in self.cameras.items():
            n.create_subscription(Image, topic, lambda m, c=cam: self._on_image(c, m),
                                  self._qos(self.p['image_qos']))
        for src, topic in self.joint_topics.items():
            n.create_subscription(JointState, topic, lambda m, s=src: self._on_joints(s, m),
                                  self._qos(self.p['joint_qos'], 10))
        n.create_subscription(String, '~/prompt', self._on_prompt, 10)
        n.create_subscription(Empty, '~/narrate', self._on_narrate, 10)

        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.traj_pubs = {g.name: n.create_publisher(JointTrajectory, g.topic, reliable)
                          for g in self.p['groups']}
        deep = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
        self.narration_pub = n.create_publisher(Narration, '~/narration', deep)
        self.text_pub = n.create_publisher(String, '~/narration/text', deep)
        self.diag_pub = n.create_publisher(DiagnosticArray, '/diagnostics', 10)
        self._msgs = dict(JointTrajectory=JointTrajectory, Narration=Narration, String=String,
                          DiagnosticArray=DiagnosticArray)

        n.create_timer(1.0 / self.p['diagnostics_rate_hz'], self._diagnose)
        self.log.info(
            f'{self.p["robot"]} robot, model {self.p["model"]}: cameras '
            + ', '.join(f'{c} <- {n.resolve_topic_name(t)}' for c, t in self.cameras.items())
            + '; joints <- ' + ', '.join(n.resolve_topic_name(t)
                                         for t in self.joint_topics.values())
            + '; trajectories -> ' + ', '.join(n.resolve_topic_name(g.topic)
                                               for g in self.p['groups'])
            + f'; control {self.p["control_rate_hz"]:g} Hz, actions every '
            f'{self.action_period * 1e3:.1f} ms')

    def _now(self) -> float:
        return self.node.get_clock().now().nanoseconds * 1e-9

    def _stamp(self, header) -> float:
        # Some drivers leave the stamp at zero; the arrival time is the best guess then.
        t = seconds(header.stamp)
        return t if t > 0 else self._now()

    # -- input callbacks: validate cheaply, keep the latest, nothing else -------------------

    def _on_image(self, cam: str, msg):
        why = image_problem(msg)
        if why:
            self.reporter.report(problem_key(f'image:{cam}', why),
                                 f'camera {cam}: {why}; image dropped, the last good one is kept')
            return
        self.assembler.put(cam, msg, self._stamp(msg.header))
        self._wake.set()

    def _on_joints(self, src: str, msg):
        topic = self.joint_topics[src]
        if len(msg.name) != len(msg.position):
            self.reporter.report(f'joints:{src}:lengths',
                                 f'{topic}: {len(msg.name)} names but {len(msg.position)} '
                                 'positions; message dropped')
            return
        wanted = self._wanted[src]
        got = {n: float(x) for n, x in zip(msg.name, msg.position, strict=True) if n in wanted}
        bad = sorted(n for n, x in got.items() if not np.isfinite(x))
        if bad:
            self.reporter.report(f'joints:{src}:nonfinite:{bad}',
                                 f'{topic}: joints {", ".join(bad)} read NaN/inf; message '
                                 'dropped, the last good readings are kept')
            return
        if not got:
            self.reporter.report(f'joints:{src}:unknown',
                                 f'{topic}: none of the joints {list(msg.name)} are used; '
                                 f'expected {sorted(wanted)}')
            return
        with self._lock:
            merged = {**self._readings.get(src, {}), **got}
            self._readings[src] = merged
        self.assembler.put(f'joints:{src}', merged, self._stamp(msg.header))
        self._wake.set()

    def _prompt_problem(self, text: str, limit: int | None = None) -> str | None:
        limit = limit or self.p['max_prompt_chars']
        if not text.strip():
            return 'empty prompt'
        if len(text) > limit:
            return f'prompt of {len(text)} characters is over the limit of {limit}'
        return None

    def _on_prompt(self, msg):
        why = self._prompt_problem(msg.data)
        if why:
            self.reporter.report(f'prompt:{why[:12]}', f'~/prompt: {why}; keeping '
                                 f'{self._prompt!r}')
            return
        with self._lock:
            self._prompt = msg.data.strip()
            self._narrate_now = True
        self.log.info(f'task prompt: {self._prompt!r}')

    def _on_narrate(self, _msg):
        with self._lock:
            self._narrate_now = True

    # -- engine thread ---------------------------------------------------------------------

    def start(self):
        self._threads = [threading.Thread(target=self._run, name='engine', daemon=True)]
        if self.node.get_parameter('use_sim_time').value:
            # Simulated time: a timer on the node's clock in its own callback group, so
            # control follows /clock and stops while the simulation is paused.
            from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

            self._tick_clock = self._now
            self.node.create_timer(1.0 / self.p['control_rate_hz'], self._tick,
                                   callback_group=MutuallyExclusiveCallbackGroup())
        else:
            self._threads.append(threading.Thread(target=self._control, name='control',
                                                  daemon=True))
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 10.0):
        """Stop commanding at once, then wait for the frame in flight."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            self._chunk = None
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                print(f'[oxygen_node] {t.name} thread still busy after {timeout:g} s; leaving it',
                      file=sys.stderr)

    def _run(self):
        frames = 0
        while not self._stop.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            if self._stop.is_set():
                break
            frame, why = self.assembler.ready(self._now())
            if frame is None:
                if not why.startswith('no new input'):
                    self.reporter.report(problem_key('frame', why), f'no frame: {why}')
                continue
            try:
                obs, state = self._observation(frame)
            except ValueError as e:
                self.reporter.report(problem_key('frame', str(e)), f'no frame: {e}')
                continue
            for note in frame.notes:
                self.reporter.report(problem_key('mask', note), f'camera {note} (masked)')
            frames += 1
            every = self.p['narration_every_n_frames']
            with self._lock:
                narrate = self._narrate_now or (every > 0 and frames % every == 1 % every)
                self._narrate_now = False
            try:
                result = self.engine.step(
                    obs, narrate=narrate,
                    on_actions=lambda a, t=frame.stamp, s=state: self._on_actions(t, s, a))
            except Exception as e:  # one bad frame must not end the node
                if self._stopping():
                    break
                self.reporter.report(problem_key('engine', str(e)), f'frame failed: {e}')
                continue
            self._stats['frames'] += 1
            self._stats['narration_requests'] += int(narrate)
            if result.rejected:
                self.reporter.report('narration:rejected', result.rejected)
            try:
                self._publish_events(result.events)
            except Exception as e:  # publishing fails once ROS is shutting down
                if self._stopping():
                    break
                self.reporter.report(problem_key('publish', str(e)), f'narration not sent: {e}')

    def _observation(self, frame):
        from oxygen_ros.engine import Observation

        images = {slot: None for slot in self.engine.slots}
        for cam, slot in self.slots.items():
            msg = frame.values.get(cam)
            if msg is not None:
                try:
                    images[slot] = image_to_rgb(msg)
                except ValueError as e:
                    raise ValueError(f'camera {cam}: {e}') from None
        # The readings held with the frame's images, not the newest ones.
        readings = {s: frame.values[f'joints:{s}'] for s in self.joint_topics}
        with self._lock:
            prompt = self._prompt
        state = self.joint_map.vector(readings)
        model_state = np.asarray(self.profile.encode_state(state), dtype=np.float32)
        return Observation(stamp=frame.stamp, images=images, state=model_state,
                           prompt=prompt), state

    def _on_actions(self, stamp: float, state: np.ndarray, actions: np.ndarray):
        try:
            targets = self.profile.decode_actions(actions, state)
        except ValueError as e:
            self.reporter.report(problem_key('actions', str(e)), f'actions not usable: {e}')
            return
        if not np.all(np.isfinite(targets)):
            self.reporter.report('actions:nonfinite', 'model produced NaN/inf actions; '
                                 'not commanding this chunk')
            return
        chunk = make_chunk(stamp, self.action_period, targets)
        with self._lock:
            if not self._stop.is_set():
                self._chunk = chunk
        self._stats['chunks'] += 1

    def _publish_events(self, events):
        Narration, String = self._msgs['Narration'], self._msgs['String']
        for e in events:
            m = Narration()
            m.header.stamp.sec = int(e.stamp)
            m.header.stamp.nanosec = int(round((e.stamp - int(e.stamp)) * 1e9)) % 1_000_000_000
            m.request_id = int(e.request_id)
            m.delta, m.text, m.tokens, m.done = e.delta, e.text, int(e.tokens), bool(e.done)
            self.narration_pub.publish(m)
            if e.done:
                if e.cancelled:
                    self.reporter.report('narration:dropped', f'narration request '
                                         f'{e.request_id} dropped to free a KV slot')
                else:
                    self.text_pub.publish(String(data=e.text))

    # -- control thread --------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._stop.is_set() or not self.node.context.ok()

    def _control(self):
        period = 1.0 / self.p['control_rate_hz']
        deadline = time.monotonic()
        while not self._stopping():
            deadline += period
            delay = deadline - time.monotonic()
            if delay > 0:
                if self._stop.wait(delay):
                    break
            else:
                # Late by a period or more: skip the lost ticks instead of bursting to catch up.
                deadline += (-delay // period) * period
            self._tick()

    def _tick(self):
        t = self._tick_clock()
        if self._ticks:
            gap = t - self._ticks[-1]
            self._gaps.append(gap)
            period = 1.0 / self.p['control_rate_hz']
            if gap > 1.5 * period:
                self._stats['missed_ticks'] += int(round(gap / period)) - 1
        self._ticks.append(t)
        with self._lock:
            chunk = None if self._stopping() else self._chunk
        if chunk is None:
            return
        first = remaining(chunk, self._now())
        if first >= len(chunk.positions):
            # Used up and nothing newer: stop commanding rather than replay old actions.
            self._stats['hold_ticks'] += 1
            self.reporter.report('control:hold', 'action chunk used up before the next one '
                                 'arrived: holding (no trajectory published)')
            return
        try:
            self._publish_chunk(chunk, first)
        except Exception as e:  # publishing fails once ROS is shutting down
            if not self._stopping():
                self.reporter.report(problem_key('publish', str(e)), f'trajectory not sent: {e}')

    def _publish_chunk(self, chunk: Chunk, first: int):
        from builtin_interfaces.msg import Duration
        from trajectory_msgs.msg import JointTrajectoryPoint

        JointTrajectory = self._msgs['JointTrajectory']
        now = self._now()
        times = [chunk.stamp + i * chunk.period - now for i in range(first, len(chunk.positions))]
        durations = []
        for dt in times:
            ns = max(1, int(dt * 1e9))
            durations.append(Duration(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000))
        for g in self.p['groups']:
            msg = JointTrajectory()
            # header.stamp stays zero: the controller starts the trajectory on arrival.
            msg.joint_names = list(g.joints)
            pos = chunk.positions[first:, g.indices]
            vel = chunk.velocities[first:, g.indices]
            for i, d in enumerate(durations):
                pt = JointTrajectoryPoint()
                pt.positions = pos[i].tolist()
                pt.velocities = vel[i].tolist()
                pt.time_from_start = d
                msg.points.append(pt)
            self.traj_pubs[g.name].publish(msg)
        self._stats['published'] += 1
        self._publishes.append(time.monotonic())

    # -- diagnostics -----------------------------------------------------------------------

    def summary(self) -> dict:
        """Everything /diagnostics reports, as plain numbers."""
        s = dict(self.engine.stats())
        now = time.monotonic()
        recent = [x for x in list(self._publishes) if now - x <= 5.0]
        s['control_publish_hz'] = len(recent) / 5.0
        gaps = np.array(list(self._gaps) or [0.0])
        period = 1.0 / self.p['control_rate_hz']
        s['tick_jitter_ms_p99'] = float(np.percentile(np.abs(gaps - period), 99) * 1e3)
        s['tick_gap_ms_max'] = float(gaps.max() * 1e3)
        s.update(self._stats)
        r = self.reporter
        s['dropped_images'] = r.count('image:')
        s['dropped_joint_states'] = r.count('joints:')
        s['rejected_prompts'] = r.count('prompt:')
        s['skipped_frames'] = r.count('frame:')
        s['masked_cameras'] = r.count('mask:')
        s['failed_frames'] = r.count('engine:') + r.count('actions:')
        return s

    def _diagnose(self):
        from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

        s = self.summary()
        st = DiagnosticStatus()
        st.name = f'{self.node.get_name()}: inference'
        st.hardware_id = self.p['device']
        holding = s['control_publish_hz'] < 0.5 * self.p['control_rate_hz']
        st.level = DiagnosticStatus.WARN if holding else DiagnosticStatus.OK
        st.message = ('holding: no fresh actions' if holding else
                      f'{s["control_publish_hz"]:.0f} Hz commands, '
                      f'{s["frame_ms_p50"]:.0f} ms frames')
        for k, v in s.items():
            st.values.append(KeyValue(key=k, value=f'{v:.3f}' if isinstance(v, float) else str(v)))
        if self.reporter.recent:
            st.values.append(KeyValue(key='last_problem', value=self.reporter.recent[-1]))
        arr = self._msgs['DiagnosticArray']()
        arr.header.stamp = self.node.get_clock().now().to_msg()
        arr.status.append(st)
        try:
            self.diag_pub.publish(arr)
        except Exception:  # shutting down
            pass


def _coerce(name: str, value, p: Param):
    kind = p.kind or {str: 'str', bool: 'bool', int: 'int', float: 'float',
                      list: 'str[]'}[type(p.default)]
    if value is None:
        return [] if kind.endswith('[]') else p.default
    ok = {
        'str': isinstance(value, str),
        'bool': isinstance(value, bool),
        'int': isinstance(value, int) and not isinstance(value, bool),
        'float': isinstance(value, (int, float)) and not isinstance(value, bool),
        'str[]': isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value),
        'int[]': isinstance(value, (list, tuple)) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in value),
    }[kind]
    if not ok:
        raise StartError(f'parameter {name} must be {kind}, got {value!r}')
    if kind == 'float':
        return float(value)
    if kind.endswith('[]'):
        return list(value)
    return value


def main(args=None):
    import rclpy
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor

    # Lets the control timer thread in between torch ops sooner (default is 5 ms).
    sys.setswitchinterval(0.001)
    try:
        rclpy.init(args=args)
    except Exception as e:  # e.g. a params file that is missing or not YAML
        print(f'[oxygen_node] error: {e}', file=sys.stderr, flush=True)
        sys.exit(1)
    holder = None
    code = 0
    try:
        holder = OxygenNode()
        # Callbacks only store samples, so one executor thread keeps up; control and the
        # model have their own threads.
        executor = SingleThreadedExecutor()
        executor.add_node(holder.node)
        holder.start()
        executor.spin()
    except StartError as e:
        # A configuration mistake, not a bug: one clear line, no traceback.
        print(f'[oxygen_node] error: {e}', file=sys.stderr, flush=True)
        code = 1
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except Exception:
        # SIGINT/SIGTERM shut the context down under the executor, which may then fail to
        # build its wait set instead of raising ExternalShutdownException.
        if rclpy.ok():
            raise
    finally:
        if holder is not None:
            holder.stop()
            holder.node.destroy_node()
        rclpy.try_shutdown()
    if code:
        sys.exit(code)


if __name__ == '__main__':
    main()
