"""The ROS 2 node: robot topics in, joint trajectories and narration out.

A lifecycle node (configure: check parameters, load the model, create topics; activate:
command the robot; deactivate / cleanup / shutdown: stop, holding the robot where it is).
What needs no ROS lives elsewhere: the parameter table and robot contract in contract.py,
which points of a chunk to publish in playback.py, frame assembly in frames.py.

Threads, and why:
- the robot's inputs are not dispatched by the executor: an ALOHA publishes ~1200 messages/s
  (two JointStates at 500 Hz, cameras at 60 Hz) and rclpy's executor spent 30% of a core
  rebuilding wait sets for them (measured with per-thread CPU counters and py-spy), time
  the model then lacked. Their subscriptions sit in a callback group no executor runs; the
  control thread takes the joint states each tick and the engine thread the newest image
  of each camera before each frame, so unused images are never even converted;
- the engine thread builds a frame from the latest samples and runs engine.step; its
  action chunk is handed to the player as soon as it exists, before language decoding;
- the control thread asks the player what to publish at control_rate_hz. It sleeps to
  absolute deadlines instead of being an executor timer: on two cores a Python executor
  next to the model delayed timer callbacks by tens of ms (measured). Under use_sim_time
  control is a timer on the node's clock instead, so it follows /clock;
- the executor runs the lifecycle and parameter services, ~/prompt, ~/narrate, ~/ask (its
  goals are coroutines that never block it; ask.py holds the logic) and the diagnostics
  timer.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import signal
import sys
import threading
import time

import numpy as np
from rcl_interfaces.msg import (
    FloatingPointRange,
    IntegerRange,
    ParameterDescriptor,
    SetParametersResult,
)
from rclpy.callback_groups import CallbackGroup
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn

from oxygen_ros.ask import Asks
from oxygen_ros.contract import (
    BY_NAME,
    GROUP_PARAMS,
    LIMIT_PARAM,
    PARAMS,
    Config,
    StartError,
    coerce,
    command_line_params,
    is_limit,
    prompt_problem,
)
from oxygen_ros.frames import JointReadings, Reporter, image_problem, image_to_rgb
from oxygen_ros.limits import describe as describe_limits
from oxygen_ros.playback import Command, Player, make_chunk

SUCCESS, FAILURE = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE
# How long a stopping node spins on to send the results of the ~/ask goals it ended.
ASK_CLOSE_S = 1.0


def problem_key(kind: str, text: str) -> str:
    # Numbers (ages, counts) change every time; the kind of problem does not.
    return kind + ':' + re.sub(r'[-\d.]+', '#', text)


def seconds(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


def duration(dt: float):
    from builtin_interfaces.msg import Duration

    ns = max(1, int(dt * 1e9))
    return Duration(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


class Polled(CallbackGroup):
    """Subscriptions the node's own threads take from (see take()); no executor runs them."""

    def can_execute(self, entity) -> bool:
        return False

    def beginning_execution(self, entity) -> bool:
        return False

    def ending_execution(self, entity) -> None:
        pass


def take(sub) -> int:
    """Run the callback of `sub` on every message waiting, oldest first; returns how many."""
    n = 0
    while True:
        with sub.handle:
            got = sub.handle.take_message(sub.msg_type, sub.raw)
        if got is None:
            return n
        sub.callback(got[0])
        n += 1


class OxygenNode(LifecycleNode):
    """Declares and checks every parameter at construction, so a wrong one is a start-up
    error whichever lifecycle transition would read it first."""

    def __init__(self, argv=None, **kw):
        super().__init__('oxygen_node', **kw)
        self.log = self.get_logger()
        self.reporter = Reporter(self.log.warning)
        self._lock = threading.Lock()
        self._tick_lock = threading.Lock()
        self._stop = threading.Event()  # ends the engine and control threads
        self._active = False  # chunks from the engine are played only while True
        self._threads: list[threading.Thread] = []
        self._ros: list = []  # subscriptions, publishers and timers made by configure
        self.engine = None
        self.player = None
        self._timer = None  # control under use_sim_time
        self.asks = Asks()  # ~/ask goals; the engine takes them only while active
        self.ask_server = None  # from configure to cleanup, or past shutdown until main closes it
        self.start_error = StartError('a lifecycle transition failed; see the log above')
        self.cfg = self._read_params(argv)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._reset_stats()

    # -- parameters ------------------------------------------------------------------------

    def _declare(self, name: str, p):
        from rclpy.exceptions import ParameterUninitializedException

        # dynamic_typing: a YAML `70` for a float parameter is fine; types are checked by
        # contract.coerce with a message that names the parameter.
        desc = ParameterDescriptor(description=p.description + _range_note(p),
                                   dynamic_typing=True, read_only=not p.live)
        if p.type in ('int', 'int[]') and p.low is not None:
            desc.integer_range = [IntegerRange(from_value=int(p.low), to_value=2**31 - 1)]
        elif p.type == 'float' and p.low is not None:
            desc.floating_point_range = [FloatingPointRange(from_value=float(p.low),
                                                            to_value=1e300)]
        # Our message, naming the rule broken, before rclpy's range check on the override.
        override = self._parameter_overrides.get(name)
        if override is not None:
            coerce(name, override.value, p)
        try:
            self.declare_parameter(name, p.default, desc)
            return self.get_parameter(name).value
        except ParameterUninitializedException:
            return None
        except Exception as e:  # rclpy's own range or type errors on an override
            raise StartError(f'parameter {name}: {e}') from None

    def _read_params(self, argv) -> Config:
        values = {p.name: self._declare(p.name, p) for p in PARAMS}
        groups = coerce('output_groups', values['output_groups'], BY_NAME['output_groups'])
        for g in groups:
            if not re.fullmatch(r'[A-Za-z][A-Za-z0-9_]*', g):
                continue  # not a parameter name: Config says so below
            for p in GROUP_PARAMS:
                values[f'outputs.{g}.{p.name}'] = self._declare(f'outputs.{g}.{p.name}', p)
        # Joint limits are declared as given (a params file's joint_limits mapping arrives
        # flattened); Config says what is wrong with them.
        limits = sorted(n for n in self._parameter_overrides if is_limit(n))
        for name in limits:
            values[name] = self._declare(name, LIMIT_PARAM)
        # ROS drops a command-line -p value whose type differs from a params file's, so the
        # command line is checked on its own too.
        table = {p.name: p for p in PARAMS}
        table.update({f'outputs.{g}.{p.name}': p for g in groups for p in GROUP_PARAMS})
        table.update({name: LIMIT_PARAM for name in limits})
        for name, value in command_line_params(argv, self.get_name()).items():
            if name in table:
                coerce(name, value, table[name])
        return Config.from_values(values)

    def _on_set_parameters(self, params) -> SetParametersResult:
        checked = {}
        for param in params:
            if param.name not in BY_NAME:
                continue  # rclpy's own (use_sim_time); outputs.* are read-only
            try:
                checked[param.name] = self.cfg.check_live(param.name, param.value)
            except StartError as e:
                self.log.warning(f'parameter {param.name} not set: {e}')
                return SetParametersResult(successful=False, reason=str(e))
        for name, value in checked.items():
            self._apply(name, value)
        return SetParametersResult(successful=True)

    def _apply(self, name: str, value):
        with self._lock:
            self.cfg.p[name] = value
            if name == 'prompt':
                self._prompt = value.strip()
                self._narrate_now = True
        if name == 'report_period':
            self.reporter.period = value
        elif self.player is not None and name == 'max_command_horizon':
            self.player.horizon = value
        elif self.player is not None and name == 'play_steps':
            self.player.play_steps = value
        elif self.engine is not None and name == 'temperature':
            self.engine.cfg = dataclasses.replace(self.engine.cfg, temperature=value)
        elif self.engine is not None and name == 'decode_k':
            self.engine.scheduler.decode_k = value
        elif self.engine is not None and name == 'max_new_tokens':
            self.engine.budget = value  # questions' budget and their default
        self.log.info(f'parameter {name} = {value!r}')

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self._state_machine.current_state[1]

    def on_configure(self, state) -> TransitionCallbackReturn:
        try:
            self._configure()
        except Exception as e:  # rclpy would swallow it without a word
            if not isinstance(e, StartError):
                e = StartError(f'{type(e).__name__}: {e}')
            self.log.error(f'configure failed: {e}')
            self._cleanup()
            self.start_error = e
            return FAILURE
        return SUCCESS

    def on_activate(self, state) -> TransitionCallbackReturn:
        cfg = self.cfg
        if cfg.random_weights and cfg.p['robot'] != 'identity' and not cfg.p[
                'allow_random_weights']:
            msg = (f'refusing to activate: the {cfg.p["robot"]} robot would be driven by '
                   'RANDOM weights (no checkpoint). Set checkpoint, or allow_random_weights: '
                   'true for timing and simulation')
            self.log.error(msg)
            self.start_error = StartError(msg)
            return FAILURE
        self._stop.clear()
        with self._lock:
            self._active = True
        self._start_threads()
        self.asks.activate(self.engine)
        self.log.info('active: commanding ' + ', '.join(
            self.resolve_topic_name(g.topic) for g in cfg.groups))
        return SUCCESS

    def on_deactivate(self, state) -> TransitionCallbackReturn:
        self._halt('deactivated')
        return SUCCESS

    def on_cleanup(self, state) -> TransitionCallbackReturn:
        self._cleanup()
        return SUCCESS

    def on_shutdown(self, state) -> TransitionCallbackReturn:
        self._halt('shutting down')
        # ~/ask outlives it: the goals just ended get their results only while the executor
        # spins, and main closes the server once they are out.
        self._cleanup(keep_ask_server=True)
        return SUCCESS

    def on_error(self, state) -> TransitionCallbackReturn:
        self._halt('lifecycle error')
        self._cleanup()
        return SUCCESS

    def _configure(self):
        from oxygen_ros.engine import Engine, EngineConfig

        cfg = self.cfg
        self.reporter.period = cfg.p['report_period']
        self._prompt = cfg.p['prompt']
        self._narrate_now = False
        self.assembler = cfg.assembler()
        self.player = Player(cfg.p['max_command_horizon'], cfg.p['play_steps'],
                             hold_after=1.0 / cfg.p['control_rate_hz'], limits=cfg.limits)
        # Each source's state joints, and the controllers' joints for a hold at measured
        # positions.
        self._readings = {s: JointReadings(w, [j for src, j in cfg.hold_sources.values()
                                               if src == s])
                          for s, w in cfg.wanted.items()}
        self._last_target = np.full(cfg.profile.action_dim, np.nan)
        try:
            self.engine = Engine(EngineConfig.from_dict(cfg.engine_settings()))
        except (ValueError, OSError) as e:
            raise StartError(f'cannot start the engine: {e}') from None
        except Exception as e:  # e.g. a corrupt safetensors file raises its own error type
            raise StartError(f'cannot start the engine: {type(e).__name__}: {e}') from None
        e = self.engine
        cfg.sized_tokens = e.cfg.max_new_tokens
        cfg.check_engine(e.slots, e.action_dim, e.state_dim, e.conventions == 'lerobot')
        self._setup_ros()
        if cfg.random_weights:
            weights = (f'model {cfg.p["model"] or "small"} with RANDOM weights (seed '
                       f'{cfg.p["seed"]}, no checkpoint): not a trained policy')
        else:
            w = e.weights
            weights = (f'{w["layout"]} checkpoint {cfg.p["checkpoint"]} ({e.conventions} '
                       f'conventions, normalisation {w["normalization"] or "off"})')
        self.log.info(f'configured: {weights}; chunks of {e.action_horizon} x {e.action_dim} '
                      f'in {e.denoise_steps} steps; cameras -> slots {cfg.slots}; '
                      f'{cfg.p["robot"]} robot; activate to command it')
        if e.n_action_steps < e.action_horizon and not cfg.p['play_steps']:
            self.log.info(f'the checkpoint plays {e.n_action_steps} of its {e.action_horizon} '
                          f'actions per chunk (n_action_steps); play_steps: '
                          f'{e.n_action_steps} does the same here')

    def _cleanup(self, keep_ask_server: bool = False):
        self._halt('cleanup')
        entities, self._ros = self._ros, []
        if self.ask_server is not None and not keep_ask_server:
            entities.append(self.ask_server)
            self.ask_server = None
        for entity in entities:
            try:
                self._destroy(entity)
            except Exception:  # already gone with the context
                pass
        self.engine = None
        self.cfg.sized_tokens = None

    def _destroy(self, entity):
        # Through the node: a bare publisher or subscription destroy() leaves its QoS event
        # handlers among what the executor waits on, and its next spin raises on them.
        from rclpy.publisher import Publisher
        from rclpy.subscription import Subscription
        from rclpy.timer import Timer

        if isinstance(entity, Publisher):
            self.destroy_publisher(entity)
        elif isinstance(entity, Subscription):
            self.destroy_subscription(entity)
        elif isinstance(entity, Timer):
            self.destroy_timer(entity)
        else:
            entity.destroy()  # the AskServer

    def _halt(self, why: str):
        """Stop commanding: hold the robot where it is, then end the threads."""
        with self._lock:
            was_active = self._active
            self._active = False
        if was_active:
            self._stop_commanding(why)
            self._tick()  # publish the hold now, not at the next control period
        self._stop.set()
        if self._timer is not None:
            self.destroy_timer(self._timer)
            self._timer = None
        for t in self._threads:
            t.join(10.0)
            if t.is_alive():
                self.log.error(f'{t.name} thread still busy after 10 s; leaving it')
        self._threads = []
        if was_active:
            # No frame runs now: open goals end with the reason and their rows are free.
            self.asks.deactivate(why)

    def _stop_commanding(self, why: str):
        self.player.stop(why)  # the next tick publishes the hold and says why

    # -- ROS interface ---------------------------------------------------------------------

    def _qos(self, choice: str, depth: int):
        from rclpy.qos import QoSProfile, ReliabilityPolicy

        # sensor_data is best effort, like rclpy's qos_profile_sensor_data.
        rel = ReliabilityPolicy.RELIABLE if choice == 'reliable' else ReliabilityPolicy.BEST_EFFORT
        return QoSProfile(depth=depth, reliability=rel)

    def _setup_ros(self):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import Empty, String
        from trajectory_msgs.msg import JointTrajectory

        from oxygen_ros.ask_server import AskServer
        from oxygen_ros.msg import Narration

        cfg = self.cfg
        sub = self.create_subscription
        polled = Polled()
        # Only the newest image of a camera is ever used; joint states are taken every
        # control tick, and 50 deep holds 0.1 s of a 500 Hz stream should a tick run late.
        self._image_subs = [sub(Image, topic, lambda m, c=cam: self._on_image(c, m),
                                self._qos(cfg.p['image_qos'], 1), callback_group=polled)
                            for cam, topic in cfg.cameras.items()]
        self._joint_subs = [sub(JointState, topic, lambda m, s=src: self._on_joints(s, m),
                                self._qos(cfg.p['joint_qos'], 50), callback_group=polled)
                            for src, topic in cfg.joint_topics.items()]
        self._ros = [*self._image_subs, *self._joint_subs,
                     sub(String, '~/prompt', self._on_prompt, 10),
                     sub(Empty, '~/narrate', self._on_narrate, 10)]
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.traj_pubs = {g.name: self.create_publisher(JointTrajectory, g.topic, reliable)
                          for g in cfg.groups}
        deep = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
        self.narration_pub = self.create_publisher(Narration, '~/narration', deep)
        self.text_pub = self.create_publisher(String, '~/narration/text', deep)
        self.diag_pub = self.create_publisher(DiagnosticArray, '/diagnostics', 10)
        self.predicted_pub = (self.create_publisher(JointTrajectory, '~/predicted_trajectory',
                                                    reliable)
                              if cfg.p['publish_predicted'] else None)
        self._ros += [*self.traj_pubs.values(), self.narration_pub, self.text_pub,
                      self.diag_pub, *([self.predicted_pub] if self.predicted_pub else []),
                      self.create_timer(1.0 / cfg.p['diagnostics_rate_hz'], self._diagnose)]
        self.asks.deactivate('configured, not yet activated')
        self.ask_server = AskServer(self, self.asks)
        self._msgs = dict(JointTrajectory=JointTrajectory, Narration=Narration, String=String,
                          DiagnosticArray=DiagnosticArray)
        self.log.info(
            f'{cfg.p["robot"]} robot, model {cfg.p["model"]}: cameras '
            + ', '.join(f'{c} <- {self.resolve_topic_name(t)}' for c, t in cfg.cameras.items())
            + '; joints <- ' + ', '.join(self.resolve_topic_name(t)
                                         for t in cfg.joint_topics.values())
            + '; trajectories -> ' + ', '.join(self.resolve_topic_name(g.topic)
                                               for g in cfg.groups)
            + f'; control {cfg.p["control_rate_hz"]:g} Hz, actions every '
            f'{cfg.action_period * 1e3:.1f} ms, commands reach at most '
            f'{cfg.p["max_command_horizon"]:g} s ahead; '
            + describe_limits(cfg.limits, [f'{g.name}/{j}' for g in cfg.groups for j in g.joints]))

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _stamp(self, header, what: str) -> float | None:
        """The time a sample describes, or None (reported) when it lies in the future."""
        now = self._now()
        t = seconds(header.stamp)
        if t <= 0:
            # Some drivers leave the stamp at zero; the arrival time is the best guess then.
            return now
        ahead = t - now
        if ahead > self.cfg.p['max_future_stamp']:
            self.reporter.report(f'future:{what}', f'{what}: stamp {ahead * 1e3:.0f} ms in the '
                                 f'future (limit {self.cfg.p["max_future_stamp"] * 1e3:.0f} ms); '
                                 'message dropped: the sender and this node must share a clock')
            return None
        return t

    # -- input callbacks: validate cheaply, keep the latest, nothing else -------------------

    def _on_image(self, cam: str, msg):
        why = image_problem(msg)
        if why:
            self.reporter.report(problem_key(f'image:{cam}', why),
                                 f'camera {cam}: {why}; image dropped, the last good one is kept')
            return
        t = self._stamp(msg.header, f'camera {cam}')
        if t is None:
            return
        self.assembler.put(cam, msg, t)

    def _on_joints(self, src: str, msg):
        topic = self.cfg.joint_topics[src]
        names, positions = msg.name, msg.position
        if len(names) != len(positions):
            self.reporter.report(f'joints:{src}:lengths',
                                 f'{topic}: {len(names)} names but {len(positions)} '
                                 'positions; message dropped')
            return
        readings = self._readings[src]
        got = {n: x for n, x in zip(names, positions, strict=True) if n in readings.keep}
        bad = sorted(n for n, x in got.items() if not math.isfinite(x))
        if bad:
            self.reporter.report(f'joints:{src}:nonfinite:{bad}',
                                 f'{topic}: joints {", ".join(bad)} read NaN/inf; message '
                                 'dropped, the last good readings are kept')
            return
        if readings.wanted.isdisjoint(got):
            self.reporter.report(f'joints:{src}:unknown',
                                 f'{topic}: none of the joints {list(names)} are used; '
                                 f'expected {sorted(readings.wanted)}')
            return
        t = self._stamp(msg.header, topic)
        if t is None:
            return
        merged, oldest = readings.update(got, t)
        limit = self.cfg.p['max_input_age']
        if t - oldest > limit:
            self.reporter.report(f'joints:{src}:dropped', f'{topic}: joints '
                                 f'{", ".join(readings.gone(t, limit))} missing from its '
                                 f'messages for {(t - oldest) * 1e3:.0f} ms (limit '
                                 f'{limit * 1e3:.0f} ms): stale')
        self.assembler.put(f'joints:{src}', merged, oldest)

    def _on_prompt(self, msg):
        why = prompt_problem(msg.data, self.cfg.p['max_prompt_chars'])
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

    def _start_threads(self):
        # What came while inactive, so the first frame is not judged on old readings.
        for sub in self._joint_subs:
            take(sub)
        self._threads = [threading.Thread(target=self._run, name='engine', daemon=True)]
        if self.get_parameter('use_sim_time').value:
            # Simulated time: a timer on the node's clock in its own callback group, so
            # control follows /clock and stops while the simulation is paused.
            from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

            self._tick_clock = self._now
            self._timer = self.create_timer(1.0 / self.cfg.p['control_rate_hz'], self._tick,
                                            callback_group=MutuallyExclusiveCallbackGroup())
        else:
            self._tick_clock = time.monotonic
            self._threads.append(threading.Thread(target=self._control, name='control',
                                                  daemon=True))
        for t in self._threads:
            t.start()

    def _run(self):
        frames = 0
        checked = 0.0
        while not self._stop.is_set():
            for sub in self._image_subs:
                take(sub)
            now = self._now()
            # Staleness is checked every 50 ms even when nothing new came.
            if not self.assembler.fresh() and time.monotonic() - checked < 0.05:
                self._stop.wait(0.002)
                continue
            checked = time.monotonic()
            frame, why = self.assembler.ready(now)
            if frame is None:
                if why.startswith('no new input'):
                    self._stop.wait(0.002)
                else:
                    self.reporter.report(problem_key('frame', why), f'no frame: {why}')
                    if 'stale' in why or 'missing' in why:
                        self._stop_commanding(f'inputs: {why}')
                        # Until something comes back, checking every 50 ms is enough.
                        self._stop.wait(0.05)
                continue
            try:
                obs, state = self._observation(frame)
            except ValueError as e:
                self.reporter.report(problem_key('frame', str(e)), f'no frame: {e}')
                continue
            for note in frame.notes:
                self.reporter.report(problem_key('mask', note), f'camera {note} (masked)')
            frames += 1
            every = self.cfg.p['narration_every_n_frames']
            with self._lock:
                narrate = self._narrate_now or (every > 0 and frames % every == 1 % every)
                self._narrate_now = False
            # A stamp within max_future_stamp ahead must not shift the chunk into the future.
            stamp = min(frame.stamp, now)
            try:
                handover = self._handover(stamp, state) if self.cfg.p['rtc'] else None
                result = self.engine.step(
                    obs, narrate=narrate, max_new_tokens=self.cfg.p['max_new_tokens'],
                    on_actions=lambda a, t=stamp, s=state: self._on_actions(t, s, a),
                    handover=handover)
            except Exception as e:  # one bad frame must not end the node
                if self._stopping():
                    break
                self.reporter.report(problem_key('engine', str(e)), f'frame failed: {e}')
                self._stop_commanding(f'model failure: {e}')
                continue
            self._stats['frames'] += 1
            self._stats['narration_requests'] += int(narrate)
            if result.rejected:
                self.reporter.report('narration:rejected', result.rejected)
            unowned = self.asks.deliver(result.events)
            if unowned:
                self.reporter.report('ask:unowned', 'question events of requests '
                                     f'{sorted({e.request_id for e in unowned})} that no goal '
                                     'holds: not delivered')
            try:
                self._publish_events(result.events)
            except Exception as e:  # publishing fails once ROS is shutting down
                if self._stopping():
                    break
                self.reporter.report(problem_key('publish', str(e)), f'narration not sent: {e}')

    def _handover(self, stamp: float, state: np.ndarray):
        """Where this frame's chunk joins the chunk being played (real-time chunking): its
        first action is action `start` of that chunk, and `delay` actions will have run by
        the time it is out (the slowest of the last frames, unless rtc_delay says)."""
        from oxygen_ros.engine import Handover

        chunk = self.player.chunk
        if chunk is None or chunk.actions is None:
            return None
        start = int(round((stamp - chunk.stamp) / chunk.period))
        if start < 0:
            return None
        delay = self.cfg.p['rtc_delay']
        if not delay:
            recent = list(self._latency)[-10:]
            delay = math.ceil(max(recent) / chunk.period) if recent else 0
        self._stats['rtc_delay'] = delay
        # The same motion in this frame's terms (delta actions are relative to the state).
        previous = self.cfg.profile.rebase(chunk.actions, chunk.state, state)
        return Handover(start, delay, previous)

    def _observation(self, frame):
        from oxygen_ros.engine import Observation

        images = {slot: None for slot in self.engine.slots}
        for cam, slot in self.cfg.slots.items():
            msg = frame.values.get(cam)
            if msg is not None:
                try:
                    images[slot] = image_to_rgb(msg)
                except ValueError as e:
                    raise ValueError(f'camera {cam}: {e}') from None
        # The readings held with the frame's images, not the newest ones.
        readings = {s: frame.values[f'joints:{s}'] for s in self.cfg.joint_topics}
        with self._lock:
            prompt = self._prompt
        state = self.cfg.joint_map.vector(readings)
        model_state = np.asarray(self.cfg.profile.encode_state(state), dtype=np.float32)
        return Observation(stamp=frame.stamp, images=images, state=model_state,
                           prompt=prompt), state

    def _on_actions(self, stamp: float, state: np.ndarray, actions: np.ndarray):
        profile = self.cfg.profile
        try:
            targets = profile.decode_actions(actions, state)
        except ValueError as e:
            self.reporter.report(problem_key('actions', str(e)), f'actions not usable: {e}')
            self._stop_commanding(f'model failure: {e}')
            return
        if not np.all(np.isfinite(targets)):
            self.reporter.report('actions:nonfinite', 'model produced NaN/inf actions; '
                                 'not commanding this chunk')
            self._stop_commanding('model failure: NaN/inf actions')
            return
        # A profile whose targets are relative to where the robot is (DROID's velocities)
        # re-anchors the chunk on the state measured as each action step starts.
        reanchor = None
        if profile.reanchors:
            def reanchor(first, measured, a=actions):
                return profile.reanchor(a, measured=measured, first=first)
        chunk = make_chunk(stamp, self.cfg.action_period, targets, actions, state, reanchor)
        with self._lock:
            if self._active:
                self.player.play(chunk)
        self._stats['chunks'] += 1
        self._latency.append(self._now() - stamp)
        self._chunk_times.append(time.monotonic())
        if self.predicted_pub is not None:
            self._publish_predicted(chunk)

    def _publish_predicted(self, chunk):
        from trajectory_msgs.msg import JointTrajectoryPoint

        msg = self._msgs['JointTrajectory']()
        msg.header.stamp.sec = int(chunk.stamp)
        msg.header.stamp.nanosec = int((chunk.stamp - int(chunk.stamp)) * 1e9) % 1_000_000_000
        idx = [i for g in self.cfg.groups for i in g.indices]
        # Group-qualified names: ALOHA's two arms share joint names.
        msg.joint_names = [f'{g.name}/{j}' for g in self.cfg.groups for j in g.joints]
        for i, (p, v) in enumerate(zip(chunk.positions[:, idx], chunk.velocities[:, idx],
                                       strict=True)):
            msg.points.append(JointTrajectoryPoint(positions=p.tolist(), velocities=v.tolist(),
                                                   time_from_start=duration(i * chunk.period)))
        self.predicted_pub.publish(msg)

    def _publish_events(self, events):
        Narration, String = self._msgs['Narration'], self._msgs['String']
        for e in events:
            if e.kind != 'narration':
                continue  # questions are answered through ~/ask
            m = Narration()
            m.header.stamp.sec = int(e.stamp)
            m.header.stamp.nanosec = int(round((e.stamp - int(e.stamp)) * 1e9)) % 1_000_000_000
            m.request_id = int(e.request_id)
            m.delta, m.text, m.tokens, m.done = e.delta, e.text, int(e.tokens), bool(e.done)
            self.narration_pub.publish(m)
            if e.done:
                if e.cancelled:
                    self.reporter.report('narration:dropped', f'narration request '
                                         f'{e.request_id}: {e.message}')
                else:
                    self.text_pub.publish(String(data=e.text))

    # -- control ---------------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._stop.is_set() or not self.context.ok()

    def _control(self):
        period = 1.0 / self.cfg.p['control_rate_hz']
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

    def _measured(self) -> np.ndarray | None:
        readings = {s: r.values() for s, r in self._readings.items()}
        try:
            return self.cfg.joint_map.vector(readings)
        except ValueError:
            return None

    def _hold_at(self) -> np.ndarray:
        """Per action index, the last measured position of the joint it drives; where the
        controller's joint is not measured, the last commanded position."""
        out = self._last_target.copy()
        for i, (src, joint) in self.cfg.hold_sources.items():
            x = self._readings[src].get(joint)
            if x is not None:
                out[i] = x
            else:
                self.reporter.report(f'hold:unmeasured:{src}/{joint}', f'no measured position '
                                     f'of {joint} on {self.cfg.joint_topics[src]}: the last '
                                     'command stands in for it')
        return out

    def _tick(self):
        with self._tick_lock:
            for sub in self._joint_subs:
                take(sub)
            t = self._tick_clock()
            period = 1.0 / self.cfg.p['control_rate_hz']
            if self._ticks:
                gap = t - self._ticks[-1]
                self._gaps.append(gap)
                if gap > 1.5 * period:
                    self._stats['missed_ticks'] += int(round(gap / period)) - 1
            self._ticks.append(t)
            try:
                cmd = self.player.tick(self._now(), self._measured, self._hold_at)
            except ValueError as e:
                self.reporter.report(problem_key('playback', str(e)), f'playback failed: {e}')
                self._stop_commanding(f'playback failure: {e}')
                return
            if cmd is None:
                with self._lock:
                    if self._active:
                        self._stats['hold_ticks'] += 1
                return
            for f in cmd.findings:
                self.reporter.report(f'limits:{f.kind}:{f.joint}', f.text)
            try:
                self._publish(cmd)
            except Exception as e:  # publishing fails once ROS is shutting down
                if not self._stopping():
                    self.reporter.report(problem_key('publish', str(e)),
                                         f'trajectory not sent: {e}')

    def _publish(self, cmd: Command):
        from trajectory_msgs.msg import JointTrajectoryPoint

        JointTrajectory = self._msgs['JointTrajectory']
        durations = [duration(dt) for dt in cmd.times]
        for g in self.cfg.groups:
            pos = cmd.positions[:, g.indices]
            if not np.all(np.isfinite(pos)):
                self.reporter.report(f'hold:none:{g.name}', f'cannot hold {g.name}: no '
                                     'measured or commanded position yet')
                continue
            vel = cmd.velocities[:, g.indices]
            msg = JointTrajectory()
            # header.stamp stays zero: the controller starts the trajectory on arrival.
            msg.joint_names = list(g.joints)
            msg.points = [JointTrajectoryPoint(positions=p.tolist(), velocities=v.tolist(),
                                               time_from_start=d)
                          for p, v, d in zip(pos, vel, durations, strict=True)]
            self.traj_pubs[g.name].publish(msg)
        if cmd.hold:
            self._stats['holds'] += 1
            self._hold_reason = cmd.hold
            self.reporter.report(problem_key('holding', cmd.hold), f'holding: {cmd.hold}')
        else:
            self._last_target = cmd.positions[0].copy()
            self._stats['published'] += 1
            self._stats['clamped_commands'] += int(cmd.clamped)
            self._publishes.append(time.monotonic())

    # -- diagnostics -----------------------------------------------------------------------

    def _reset_stats(self):
        self._stats = dict(chunks=0, frames=0, published=0, hold_ticks=0, missed_ticks=0,
                           narration_requests=0, holds=0, rtc_delay=0, clamped_commands=0)
        self._hold_reason = ''
        self._ticks = collections.deque(maxlen=2000)  # tick times
        self._gaps = collections.deque(maxlen=2000)
        self._publishes = collections.deque(maxlen=2000)
        self._latency = collections.deque(maxlen=500)  # frame stamp -> its chunk, s
        self._chunk_times = collections.deque(maxlen=500)

    def summary(self) -> dict:
        """Everything /diagnostics reports, as plain numbers."""
        s = dict(self.engine.stats())
        now = time.monotonic()
        recent = [x for x in list(self._publishes) if now - x <= 5.0]
        s['control_publish_hz'] = len(recent) / 5.0
        gaps = np.array(list(self._gaps) or [0.0])
        period = 1.0 / self.cfg.p['control_rate_hz']
        s['tick_jitter_ms_p99'] = float(np.percentile(np.abs(gaps - period), 99) * 1e3)
        s['tick_gap_ms_max'] = float(gaps.max() * 1e3)
        # How late chunks come (the part of each chunk already in the past) and how far
        # apart: together they say whether a chunk lasts until the next.
        lat = np.array(list(self._latency) or [0.0])
        s['action_latency_ms_p50'] = float(np.percentile(lat, 50) * 1e3)
        s['action_latency_ms_p99'] = float(np.percentile(lat, 99) * 1e3)
        apart = np.diff(list(self._chunk_times)) if len(self._chunk_times) > 1 else [0.0]
        s['chunk_interval_ms_p99'] = float(np.percentile(apart, 99) * 1e3)
        s['chunk_ms'] = 1e3 * self.cfg.action_period * self.engine.action_horizon
        s.update(self._stats)
        s.update(self.asks.stats())
        r = self.reporter
        s['dropped_images'] = r.count('image:')
        s['dropped_joint_states'] = r.count('joints:')
        s['future_stamps'] = r.count('future:')
        s['rejected_prompts'] = r.count('prompt:')
        s['skipped_frames'] = r.count('frame:')
        s['masked_cameras'] = r.count('mask:')
        s['failed_frames'] = r.count('engine:') + r.count('actions:')
        s['limit_holds'] = r.count('holding:joint limits')
        return s

    def _diagnose(self):
        from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

        s = self.summary()
        st = DiagnosticStatus()
        st.name = f'{self.get_name()}: inference'
        st.hardware_id = self.cfg.p['device']
        with self._lock:
            active = self._active
        holding = s['control_publish_hz'] < 0.5 * self.cfg.p['control_rate_hz']
        st.level = DiagnosticStatus.WARN if holding and active else DiagnosticStatus.OK
        if not active:
            st.message = 'inactive: not commanding'
        elif holding:
            st.message = f'holding: {self._hold_reason or "no fresh actions"}'
        else:
            st.message = (f'{s["control_publish_hz"]:.0f} Hz commands, '
                          f'{s["frame_ms_p50"]:.0f} ms frames')
        st.values = [KeyValue(key='active', value=str(active))]
        for k, v in s.items():
            st.values.append(KeyValue(key=k, value=f'{v:.3f}' if isinstance(v, float) else str(v)))
        st.values.append(KeyValue(key='last_hold', value=self._hold_reason))
        if self.reporter.recent:
            st.values.append(KeyValue(key='last_problem', value=self.reporter.recent[-1]))
        arr = self._msgs['DiagnosticArray']()
        arr.header.stamp = self.get_clock().now().to_msg()
        arr.status.append(st)
        try:
            self.diag_pub.publish(arr)
        except Exception:  # shutting down
            pass


def _range_note(p) -> str:
    text = p.range_text()
    return (f' ({text})' if text else '') + ('' if p.live else ' [read-only while running]')


def main(args=None):
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    argv = sys.argv if args is None else args
    # Lets the control thread in between torch ops sooner (default is 5 ms).
    sys.setswitchinterval(0.001)
    # Our own signal handlers: the first SIGINT/SIGTERM starts a clean shutdown (hold, then
    # stop); later ones, e.g. a second Ctrl-C under ros2 launch, are noted and ignored
    # instead of raising KeyboardInterrupt in the middle of it.
    signals = []

    def on_signal(signum, _frame):
        signals.append(signum)
        if len(signals) > 1:
            print(f'[oxygen_node] {signal.Signals(signum).name} again: already shutting down',
                  file=sys.stderr, flush=True)

    try:
        rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    except Exception as e:  # e.g. a params file that is missing or not YAML
        print(f'[oxygen_node] error: {e}', file=sys.stderr, flush=True)
        sys.exit(1)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    node = None
    code = 0
    try:
        node = OxygenNode(argv)
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        if node.cfg.p['autostart']:
            if node.trigger_configure() != SUCCESS or node.trigger_activate() != SUCCESS:
                raise node.start_error
        else:
            node.log.info('unconfigured: waiting for lifecycle transitions (ros2 lifecycle '
                          f'set {node.get_fully_qualified_name()} configure, then activate)')
        # Callbacks only store samples, so one executor thread keeps up; control and the
        # model have their own threads. spin_once returns often enough to see a signal.
        while not signals and rclpy.ok() and node.state != 'finalized':
            executor.spin_once(timeout_sec=0.1)
    except StartError as e:
        # A configuration mistake, not a bug: one clear line, no traceback.
        print(f'[oxygen_node] error: {e}', file=sys.stderr, flush=True)
        code = 1
    finally:
        if node is not None:
            if node.state in ('unconfigured', 'inactive', 'active'):
                node.trigger_shutdown()  # the hold first; then the open goals end
            if node.ask_server is not None:
                # Their results go out only while the executor spins, which the loop above
                # no longer does. Bounded, so that nothing a client does keeps the process
                # from exiting (ros2 launch would kill it).
                left = node.ask_server.close(executor.spin_once, ASK_CLOSE_S)
                if left:
                    node.log.warning(f'{left} ~/ask goals still running after '
                                     f'{ASK_CLOSE_S:g} s: their callers get no result')
            node.destroy_node()
        rclpy.try_shutdown()
        # Python puts the default handlers back while it exits, and a signal then would kill
        # the process (exit code -2); from here on there is nothing left to stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if code:
        sys.exit(code)


if __name__ == '__main__':
    main()
