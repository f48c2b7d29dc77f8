"""One robot's side of the node: its topics, its latest samples, its control loop.

A link owns what is per robot: the subscriptions to its cameras and joint states and their
latest samples (frames.Assembler), the observation built from them, its Player and the
control thread (or, under use_sim_time, a timer on the node's clock) asking it what to
publish, its holds, its trajectory, narration and ~/predicted_trajectory publishers and its
part of the diagnostics. The node owns the lifecycle, the parameters, the engine thread and
the ~/ask servers, and hands each link the rclpy node to create its entities on; nothing
here imports the node.

A link's topics are the robot file's, under `prefix` (a robot's namespace in a fleet; ''
for the node's one robot) and its private topics (~/prompt, ~/narrate, ~/narration,
~/predicted_trajectory) under `private` ('~' for the one robot, '~/<robot>' in a fleet).
"""

from __future__ import annotations

import collections
import math
import threading
import time
import traceback
from dataclasses import dataclass

import numpy as np
from rclpy.callback_groups import CallbackGroup
from rclpy.serialization import serialize_message

from oxygen_ros.robot.clock import BACK_S, JumpWatch
from oxygen_ros.robot.contract import Config
from oxygen_ros.robot.inputs import Inputs, problem_key
from oxygen_ros.robot.limits import describe as describe_limits
from oxygen_ros.robot.playback import Command, Player, make_chunk, replan_at, runs_out
from oxygen_ros.robot.report import Reporter
from oxygen_ros.robot.shadow import WINDOW_S, Shadow
from oxygen_ros.robot.stamps import split, split_duration

# How long a robot's diagnostics show ERROR after a fault of the node's own code (s): long
# enough for a 1 Hz diagnostics listener to see it.
FAULT_SHOWN_S = 5.0
def duration(dt: float):
    from builtin_interfaces.msg import Duration

    sec, ns = split_duration(dt)
    return Duration(sec=sec, nanosec=ns)


class Polled(CallbackGroup):
    """Subscriptions the node's own threads take from (see take()); no executor runs them."""

    def can_execute(self, entity) -> bool:
        return False

    def beginning_execution(self, entity) -> bool:
        return False

    def ending_execution(self, entity) -> None:
        pass


def take(sub, on_error=None) -> int:
    """Run the callback of `sub` on every message waiting, oldest first; returns how many.
    A callback that raises costs that message only: ``on_error(exception)`` is told, and the
    messages after it are still taken (without ``on_error`` the exception propagates)."""
    n = 0
    while True:
        with sub.handle:
            got = sub.handle.take_message(sub.msg_type, sub.raw)
        if got is None:
            return n
        try:
            sub.callback(got[0])
        except Exception as e:
            if on_error is None:
                raise
            on_error(sub, e)
        n += 1


def qos(choice: str, depth: int):
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    # sensor_data is best effort, like rclpy's qos_profile_sensor_data.
    rel = ReliabilityPolicy.RELIABLE if choice == 'reliable' else ReliabilityPolicy.BEST_EFFORT
    return QoSProfile(depth=depth, reliability=rel)


def join(prefix: str, name: str) -> str:
    """A robot file's topic under a robot's prefix; absolute and private names stay."""
    if not prefix or name.startswith(('/', '~')):
        return name
    return f'{prefix.rstrip("/")}/{name}'


@dataclass
class Ready:
    """What a link brings to a frame: the observation and what its chunk needs."""

    obs: object  # engine.Observation
    state: np.ndarray  # the robot-convention state the actions are decoded against
    stamp: float
    narrate: bool
    handover: object  # engine.Handover or None


UNDISCOVERED = 'a node not yet discovered by name'


class RobotLink:
    """``node``: the rclpy node whose entities, clock and logger the link uses; ``cfg`` the
    robot's checked Config; ``name`` '' for the node's one robot."""

    def __init__(self, node, cfg: Config, name: str = '', prefix: str = '',
                 private: str = '~', reporter: Reporter | None = None):
        self.node = node
        self.cfg = cfg
        self.name = name
        self.prefix = prefix
        self.private = private
        self.log = node.get_logger()
        if reporter is None:
            # In a fleet every problem says whose it is.
            reporter = Reporter(lambda m: self.log.warning(self.label() + m))
        self.reporter = reporter
        self.reporter.period = cfg.p['report_period']
        # The node's own failures, said at ERROR (rate-limited like the problems).
        self.errors = Reporter(lambda m: self.log.error(self.label() + m),
                               cfg.p['report_period'])
        self.lock = threading.Lock()
        self._tick_lock = threading.Lock()
        self._intake = threading.Lock()  # joint states are taken by one thread at a time
        # Ends the control thread of the current activation (each gets its own: a thread
        # that outlived stop() must not be restarted by the next start()).
        self._stop = threading.Event()
        self.active = False  # chunks from the engine are played only while True
        self._thread = None
        self._straggler = None  # a control thread that did not end within stop()'s wait
        self._jumps = None  # JumpWatch on the system clock, None under simulated time
        self._jump_handle = None  # rcl's jump callback under simulated time
        self.on_fatal = None  # (why, detail): the node cannot hold this robot any more
        self.faulted = ''  # the last fault of the node's own code, for diagnostics
        self._faulted_at = -math.inf
        self._tick_failures = 0
        self._stats_lock = threading.Lock()
        # Never two commanders: hashes of what this link published lately (time, hash), so
        # a trajectory heard on its own topics that is not among them came from another node.
        self._mine: collections.deque = collections.deque()
        self._mine_set: dict[int, int] = {}
        self._mine_lock = threading.Lock()
        self.yielded = ''  # why this robot left commanding to another node
        self._stale_since: float | None = None  # monotonic: inputs stale since
        self._resume_at = 0.0  # monotonic: no chunk plays before this (listening)
        self._timer = None  # control under use_sim_time
        self._ros: list = []
        self.player = None
        self.predicted_pub = None
        self.prompt = cfg.p['prompt']
        self.narrate_now = False
        self.frames = 0  # frames assembled, for narration_every_n_frames
        self.reset_stats()

    def label(self) -> str:
        return f'robot {self.name}: ' if self.name else ''

    # -- configure -------------------------------------------------------------------------

    def configure(self):
        """Create the player, the readings and the robot's topics (the engine is checked)."""
        cfg = self.cfg
        self.prompt = cfg.p['prompt']
        self.narrate_now = False
        self.frames = 0
        self.player = Player(cfg.p['max_command_horizon'], cfg.p['play_steps'],
                             hold_after=1.0 / cfg.p['control_rate_hz'], limits=cfg.limits,
                             open_loop=cfg.p['open_loop_control'])
        self.inputs = Inputs(cfg, self.reporter, self.now)
        self.assembler = self.inputs.assembler
        self._sent_cmd = None  # (monotonic time, times, positions) of the last command sent
        self._setup_ros()

    def _setup_ros(self):
        from rclpy.duration import Duration
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import CompressedImage, Image, JointState
        from std_msgs.msg import Empty, String
        from trajectory_msgs.msg import JointTrajectory

        from oxygen_ros.msg import Narration

        node, cfg, pre = self.node, self.cfg, self.prefix
        priv = self.private
        sub = node.create_subscription
        polled = Polled()
        # Only the newest image of a camera is ever used; joint states are taken every
        # control tick, and 50 deep holds 0.1 s of a 500 Hz stream should a tick run late.
        # A compressed image is decoded when taken (the engine thread, before a frame), so
        # only the newest of each camera is; one that does not decode is dropped there.
        self.image_subs = [
            sub(CompressedImage, join(pre, topic), lambda m, c=cam: self.inputs.compressed(c, m),
                qos(cfg.p['image_qos'], 1), callback_group=polled)
            if cam in self.inputs.decoders else
            sub(Image, join(pre, topic), lambda m, c=cam: self.inputs.image(c, m),
                qos(cfg.p['image_qos'], 1), callback_group=polled)
            for cam, topic in cfg.cameras.items()]
        self._joint_subs = [sub(JointState, join(pre, topic),
                                lambda m, s=src: self.inputs.joints(s, m),
                                qos(cfg.p['joint_qos'], 50), callback_group=polled)
                            for src, topic in cfg.joint_topics.items()]
        self._ros = [*self.image_subs, *self._joint_subs,
                     sub(String, f'{priv}/prompt', self._on_prompt, 10),
                     sub(Empty, f'{priv}/narrate', self._on_narrate, 10)]
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        # A trajectory not delivered within the horizon (at configure) is over: DDS drops it
        # (lifespan) instead of sending it late. Without that, a reliable writer resends
        # what it sent during a network partition once the partition heals, and the
        # controller (stamp 0: start now) would replay a stale hold or chunk, and another
        # node would hear a commander that stopped long ago.
        commands = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE,
                              lifespan=Duration(seconds=cfg.p['max_command_horizon']))
        self.traj_pubs = {g.name: node.create_publisher(JointTrajectory, join(pre, g.topic),
                                                        commands)
                          for g in cfg.groups}
        # What else is said on those topics (raw bytes, compared with what this link sent);
        # taken by the node's watchdog and before activation.
        deep_raw = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self._heard: dict[str, float] = {}  # topic -> when another node was last heard
        self._watch_subs = []
        for g in cfg.groups:
            topic = node.resolve_topic_name(join(pre, g.topic))
            self._watch_subs.append(sub(
                JointTrajectory, topic, lambda m, t=topic: self._on_heard(t, m), deep_raw,
                callback_group=polled, raw=True))
        self._ros += self._watch_subs
        deep = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
        self.narration_pub = node.create_publisher(Narration, f'{priv}/narration', deep)
        self.text_pub = node.create_publisher(String, f'{priv}/narration/text', deep)
        self.predicted_pub = (node.create_publisher(JointTrajectory,
                                                    f'{priv}/predicted_trajectory', reliable)
                              if cfg.p['publish_predicted'] else None)
        # Shadow mode (command: false): the same trajectories, where no controller listens.
        self.shadow_pubs = {g.name: node.create_publisher(
            JointTrajectory, f'{priv}/shadow/{g.name}', reliable) for g in cfg.groups}
        names = cfg.output_names
        self.shadow = Shadow([names.get(i) for i in range(cfg.profile.action_dim)])
        self._ros += [*self.traj_pubs.values(), *self.shadow_pubs.values(),
                      self.narration_pub, self.text_pub,
                      *([self.predicted_pub] if self.predicted_pub else [])]
        self._msgs = dict(JointTrajectory=JointTrajectory, Narration=Narration, String=String)
        name = node.resolve_topic_name
        self.log.info(
            f'{self.label()}{cfg.p["robot"]} robot, model {cfg.p["model"]}: cameras '
            + ', '.join(f'{c} <- {name(join(pre, t))}'
                        + (' (compressed)' if c in self.inputs.decoders else '')
                        for c, t in cfg.cameras.items())
            + '; joints <- ' + ', '.join(name(join(pre, t)) for t in cfg.joint_topics.values())
            + '; trajectories -> ' + ', '.join(name(join(pre, g.topic)) for g in cfg.groups)
            + f'; control {cfg.p["control_rate_hz"]:g} Hz, actions every '
            f'{cfg.action_period * 1e3:.1f} ms, commands reach at most '
            f'{cfg.p["max_command_horizon"]:g} s ahead; '
            + describe_limits(cfg.limits, list(cfg.output_names.values())))

    def topics(self) -> list[str]:
        return [self.node.resolve_topic_name(join(self.prefix, g.topic)) for g in self.cfg.groups]

    def entities(self) -> list:
        """Its subscriptions and publishers, for the node to destroy; forgets them."""
        out, self._ros = self._ros, []
        self.predicted_pub = None
        return out

    # -- lifecycle -------------------------------------------------------------------------

    def activate(self):
        with self.lock:
            self.active = True
            self.yielded = ''
        # While inactive the robot may have been moved: a hold starts from a reading again,
        # and frames from inputs that came after this.
        self.player.forget()
        self.inputs.rebase()
        self._stale_since = None
        self._resume_at = 0.0

    def start(self, sim_time: bool):
        """The control loop: a thread to absolute deadlines, or a timer on the node's clock
        under simulated time (so it follows /clock and stops while the simulation pauses)."""
        self._stop = threading.Event()
        self._checked = 0.0
        self._tick_failures = 0
        # Clock jumps: rcl reports those of simulated time; the system clock's are found by
        # comparing it with the monotonic clock every tick.
        forward = self.cfg.p['max_input_age']
        self._jumps = None if sim_time else JumpWatch(forward)
        if sim_time:
            from rclpy.clock import JumpThreshold
            from rclpy.duration import Duration

            self._jump_handle = self.node.get_clock().create_jump_callback(
                JumpThreshold(min_forward=Duration(seconds=forward),
                              min_backward=Duration(seconds=-BACK_S), on_clock_change=True),
                post_callback=self._on_jump)
        # What came while inactive, so the first frame is not judged on old readings.
        self._take_joints()
        if sim_time:
            from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

            self._tick_clock = self.now
            self._timer = self.node.create_timer(
                1.0 / self.cfg.p['control_rate_hz'], self.tick,
                callback_group=MutuallyExclusiveCallbackGroup())
        else:
            self._tick_clock = time.monotonic
            self._thread = threading.Thread(target=self._control, args=(self._stop,),
                                            name='control', daemon=True)
            self._thread.start()

    def deactivate(self, why: str) -> bool:
        """Stop playing chunks and publish the hold now; True when it was active."""
        with self.lock:
            was_active = self.active
            self.active = False
        if was_active:
            self.stop_commanding(why)
            self.tick()  # publish the hold now, not at the next control period
        return was_active

    def stop(self, wait: float = 10.0):
        """End the control loop, waiting up to ``wait`` s for its thread."""
        self._stop.set()
        if self._jump_handle is not None:
            self._jump_handle.unregister()
            self._jump_handle = None
        if self._timer is not None:
            self.node.destroy_timer(self._timer)
            self._timer = None
        if self._thread is not None:
            self._thread.join(wait)
            if self._thread.is_alive():
                self.log.error(f'{self.label()}control thread still busy after {wait:g} s: '
                               'the next activation is refused until it ends')
                self._straggler = self._thread
            self._thread = None

    def busy(self) -> bool:
        """Whether a control thread of an earlier activation still runs."""
        if self._straggler is not None and not self._straggler.is_alive():
            self._straggler = None
        return self._straggler is not None

    def dead(self) -> bool:
        """Whether the control thread ended although nothing stopped it."""
        t = self._thread
        return t is not None and not t.is_alive() and not self._stop.is_set()

    def fault(self, why: str, detail: str = ''):
        """The node's own code failed on this robot (not its inputs, not the model): it
        holds, the log says so at ERROR, and its diagnostics show ERROR for FAULT_SHOWN_S."""
        with self._stats_lock:
            self._stats['faults'] += 1
        self.faulted = why
        self._faulted_at = time.monotonic()
        said = self.errors.report(problem_key('fault', why), f'{why}; holding')
        if said and detail:
            self.log.error(detail)
        self.stop_commanding(f'fault: {why}')

    def _on_jump(self, jump):
        from rclpy.clock import ClockChange

        change = jump.clock_change
        if change in (ClockChange.ROS_TIME_ACTIVATED, ClockChange.ROS_TIME_DEACTIVATED):
            what = 'ROS time ' + ('activated' if change == ClockChange.ROS_TIME_ACTIVATED
                                  else 'deactivated')
        else:
            what = 'simulated clock'
        self.clock_jumped(jump.delta.nanoseconds * 1e-9, what)

    def clock_jumped(self, delta: float, what: str):
        """The node's clock jumped by `delta` s: every held stamp is off by that much. The
        chunk goes (a hold follows), and inputs count again from the first sample after the
        jump, so neither an input that stopped nor a chunk can hide behind the jump."""
        self.errors.report('clock:jump', f'the {what} jumped {delta:+.3f} s: dropping the '
                           'chunk, holding, and waiting for inputs stamped after the jump')
        with self._stats_lock:
            self._stats['clock_jumps'] += 1
        if self.player is not None:
            self.player.shift(delta)
        self.inputs.clear()
        self._checked = 0.0
        self.stop_commanding(f'the {what} jumped {delta:+.3f} s')

    def _input_failed(self, sub, e: Exception):
        self.fault(f'handling a message on {sub.topic_name} failed (message dropped): '
                   f'{type(e).__name__}: {e}', traceback.format_exc())

    def set_command(self, on: bool):
        """Shadow mode off (on=True: the node commands) or on. Leaving commanding holds the
        robot first, on the controllers' topics, as a stop does (braking within its
        limits); taking it over starts from the readings with the next chunk, as
        activating does."""
        if not on and self.commanding():
            self.stop_commanding('shadow mode: leaving commanding')
            self.tick()  # the hold goes out while this link still commands
        with self._tick_lock:
            with self.lock:
                self.shadow.clear()
                self.cfg.p['command'] = on
            if self.player is not None:
                if on:
                    self.player.drop()
                else:
                    self.player.forget()

    def shadow_problem(self) -> str | None:
        """Why shadow mode may not turn to commanding now, or None: another node still
        commands the robot, or the prediction disagrees with its motion."""
        other = self.commanders()
        if other:
            return other
        with self.lock:
            return self.shadow.disagreement(self.cfg.p['shadow_margin'])

    def stop_commanding(self, why: str):
        if self.player is not None:
            self.player.stop(why)  # the next tick publishes the hold and says why

    def stopping(self) -> bool:
        return self._stop.is_set() or not self.node.context.ok()

    # -- inputs: validate cheaply, keep the latest, nothing else ---------------------------

    def now(self) -> float:
        return self.node.get_clock().now().nanoseconds * 1e-9

    def waiting_for(self) -> str:
        """Why no frame can start now (required inputs missing, stale or stamped ahead), or
        '': what a ~/ask question that timed out waited for."""
        return self.inputs.stale(self.now()) or ''

    def set_prompt(self, text: str):
        with self.lock:
            self.prompt = text.strip()
            self.narrate_now = True

    def _on_prompt(self, msg):
        try:
            self._prompt(msg)
        except Exception as e:  # an executor callback must not end the executor
            self.fault(f'{self.private}/prompt failed: {type(e).__name__}: {e}',
                       traceback.format_exc())

    def _prompt(self, msg):
        why = self.cfg.check_prompt(msg.data)
        if why:
            self.reporter.report(problem_key('prompt', why), f'{self.private}/prompt: {why}; '
                                 f'keeping {self.prompt!r}')
            return
        self.set_prompt(msg.data)
        self.log.info(f'{self.label()}task prompt: {self.prompt!r}')

    def _on_narrate(self, _msg):
        with self.lock:
            self.narrate_now = True  # nothing here can fail

    # -- frames ----------------------------------------------------------------------------

    def poll(self, slots) -> tuple[Ready | None, float]:
        """Take the newest images and, when a frame can start, what it needs; otherwise
        None and how long to wait before asking again (stale or missing inputs hold the
        robot and are reported). ``slots``: the engine's image slots."""
        for sub in self.image_subs:
            take(sub, self._input_failed)
        wait = self._replan_wait(self.now())
        if wait > 0:
            # The chunk plays on; the inputs that came meanwhile start the frame when it is
            # due, and stale ones still hold the robot.
            self.check(self.now())
            return None, min(wait, 0.05)
        if self.assembler.fresh():
            # A frame may start: with every joint state received by now, so that it is
            # built from the inputs as they came (a replay of a recording rebuilds it so),
            # not as the last control tick left them.
            self._take_joints()
        now = self.now()
        # Staleness is checked every 50 ms even when nothing new came.
        if not self.assembler.fresh() and time.monotonic() - self._checked < 0.05:
            return None, 0.002
        self._checked = time.monotonic()
        frame, why = self.assembler.ready(now)
        if frame is None:
            if why.startswith('no new input'):
                return None, 0.002
            self.reporter.report(problem_key('frame', why), f'no frame: {why}')
            if 'stale' in why or 'missing' in why or 'ahead of the clock' in why:
                self._inputs_stale()
                self.stop_commanding(f'inputs: {why}')
                # Until something comes back, checking every 50 ms is enough.
                return None, 0.05
            return None, 0.0
        try:
            obs, state = self._observation(frame, slots)
        except ValueError as e:
            self.reporter.report(problem_key('frame', str(e)), f'no frame: {e}')
            return None, 0.0
        self._inputs_fresh()
        for note in frame.notes:
            self.reporter.report(problem_key('mask', note), f'camera {note} (masked)')
        self.frames += 1
        every = self.cfg.p['narration_every_n_frames']
        with self.lock:
            narrate = self.narrate_now or (every > 0 and self.frames % every == 1 % every)
            self.narrate_now = False
        # A stamp within max_future_stamp ahead must not shift the chunk into the future.
        stamp = min(frame.stamp, now)
        handover = self._handover(stamp, state) if self.cfg.p['rtc'] else None
        return Ready(obs, state, stamp, narrate, handover), 0.0

    def _replan_wait(self, now: float) -> float:
        """How long until replan_after lets the next frame start (0: now)."""
        chunk = self.player.chunk if self.player is not None else None
        return max(0.0, replan_at(chunk, self.cfg.p['replan_after']) - now)

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

    def _observation(self, frame, slots):
        with self.lock:
            prompt = self.prompt
        return self.inputs.observation(frame, slots, prompt)

    def failed(self, why: str):
        """A frame of this robot failed in the engine: it holds."""
        self.reporter.report(problem_key('engine', why), f'frame failed: {why}')
        self.stop_commanding(f'model failure: {why}')

    def times(self):
        """What the fleet's planner needs of this robot: when its chunk runs out, and the
        stamp of a new observation (None: none since its last frame, or stale inputs)."""
        from oxygen_ros.engine.fleet import RobotTimes

        for sub in self.image_subs:
            take(sub, self._input_failed)
        # The clock after the images are taken: converting them takes a while, and inputs
        # that came meanwhile would look stamped ahead of a clock read before.
        now = self.now()
        chunk = self.player.chunk if self.player is not None else None
        end = None if chunk is None else runs_out(chunk, self.player.play_steps)
        stamp = None
        a = self.assembler
        if a.fresh() and self.stale(now) is None and not self._replan_wait(now):
            got = [a.latest(n) for n in a.trigger]
            stamps = [x.stamp for x in got if x is not None]
            stamp = max(stamps) if stamps else None
        return RobotTimes(end, stamp)

    def stale(self, now: float) -> str | None:
        """Which required inputs are stale or missing now (Assembler's words), or None."""
        return self.inputs.stale(now)

    def _inputs_stale(self):
        if self._stale_since is None:
            self._stale_since = time.monotonic()

    def _inputs_fresh(self):
        """Inputs are back: after a long silence (a network partition looks like one) the
        robot may have been taken over by another node meanwhile, which this node hears only
        once DDS has rediscovered it, so it listens before commanding again."""
        since, self._stale_since = self._stale_since, None
        check = self.cfg.p['commander_check']
        if since is not None and check and time.monotonic() - since >= check:
            self._resume_at = time.monotonic() + check

    # -- never two commanders --------------------------------------------------------------

    MINE_S = 5.0  # how long what this link sent is remembered, s

    def _sent_bytes(self, data: bytes):
        now = time.monotonic()
        h = hash(data)
        with self._mine_lock:
            self._mine.append((now, h))
            self._mine_set[h] = self._mine_set.get(h, 0) + 1
            while self._mine and self._mine[0][0] < now - self.MINE_S:
                _, old = self._mine.popleft()
                left = self._mine_set[old] - 1
                if left:
                    self._mine_set[old] = left
                else:
                    del self._mine_set[old]

    def _on_heard(self, topic: str, data: bytes):
        with self._mine_lock:
            if hash(data) not in self._mine_set:
                self._heard[topic] = time.monotonic()

    HEARD_S = 1.0  # another node heard within this long counts as commanding, s

    def heard(self) -> list[str]:
        """The topics of this robot on which another node sent a trajectory within HEARD_S
        (what waits is taken now: the node's watchdog does so every WATCH_S)."""
        for sub in self._watch_subs:
            take(sub, self._input_failed)
        now = time.monotonic()
        return sorted(t for t, at in self._heard.items() if now - at < self.HEARD_S)

    def others(self, topics=None) -> dict[str, list[str]]:
        """topic -> the other nodes with a publisher on it (the ROS graph)."""
        me = (self.node.get_name(), self.node.get_namespace())
        out = {}
        for topic in topics or self.topics():
            # rmw names a publisher whose node it has not discovered yet (a host just back
            # from a partition) _NODE_NAME_UNKNOWN_.
            names = sorted({UNDISCOVERED if i.node_name == '_NODE_NAME_UNKNOWN_' else
                            f'{i.node_namespace.rstrip("/")}/{i.node_name}'
                            for i in self.node.get_publishers_info_by_topic(topic)
                            if (i.node_name, i.node_namespace) != me})
            if names:
                out[topic] = names
        return out

    def commanders(self, listen: float = 0.0, blind: float = 0.0) -> str | None:
        """Another node commanding this robot: what was heard, listening up to ``listen`` s
        where another node has a publisher on a trajectory topic, and up to ``blind`` s where
        none shows yet (the graph not discovered yet); None if nobody else."""
        heard = self.heard()
        start, shown = time.monotonic(), False
        while not heard and listen:
            shown = shown or bool(self.others())  # the graph is asked until it shows one
            if time.monotonic() - start >= (listen if shown else min(blind, listen)):
                break
            time.sleep(0.05)
            heard = self.heard()
        if not heard:
            return None
        others = self.others(heard)
        who = '; '.join(f'{t} <- {", ".join(others.get(t) or ["an unknown node"])}'
                        for t in heard)
        return f'another node commands this robot: {who}'

    def commanding(self) -> bool:
        """Whether this link sent a command (not a hold) within max_command_horizon."""
        return bool(self._publishes) and (
            time.monotonic() - self._publishes[-1] < self.cfg.p['max_command_horizon'])

    def give_way(self, why: str) -> bool:
        """Leave commanding to the other node. A robot this link was commanding gets one
        hold first (both stop: the robot rests); one it only held is left alone, as the
        other node commands it now. True when it was active."""
        hold = self.commanding()
        with self.lock:
            was, self.active = self.active, False
            self.yielded = why
        if not was:
            return False
        self.errors.report('commanders', f'{why}: ' + (
            'holding and leaving commanding' if hold else
            'leaving commanding to it (this node was not commanding)'))
        if hold:
            self.stop_commanding(f'two commanders: {why}')
            self.tick()
        elif self.player is not None:
            self.player.drop()
        return True

    def check(self, now: float):
        """Between this robot's frames (a fleet's other robots run): stale or missing
        inputs hold it, as they do when a frame of its own is sought; every 50 ms."""
        if time.monotonic() - self._checked < 0.05:
            return
        self._checked = time.monotonic()
        why = self.stale(now)
        if why:
            self.reporter.report(problem_key('frame', why), f'no frame: {why}')
            self._inputs_stale()
            self.stop_commanding(f'inputs: {why}')

    def on_actions(self, stamp: float, state: np.ndarray, actions: np.ndarray):
        profile = self.cfg.profile
        try:
            targets = profile.decode_actions(actions, state)
        except ValueError as e:
            self.reporter.report(problem_key('actions', str(e)), f'actions not usable: {e}')
            self.stop_commanding(f'model failure: {e}')
            return
        if not np.all(np.isfinite(targets)):
            self.reporter.report('actions:nonfinite', 'model produced NaN/inf actions; '
                                 'not commanding this chunk')
            self.stop_commanding('model failure: NaN/inf actions')
            return
        # A profile whose targets are relative to where the robot is (DROID's velocities)
        # re-anchors the chunk on the state measured as each action step starts.
        reanchor = None
        if profile.reanchors:
            def reanchor(first, measured, a=actions):
                return profile.reanchor(a, measured=measured, first=first)
        chunk = make_chunk(stamp, self.cfg.action_period, targets, actions, state, reanchor)
        # The whole chunk goes out before any command taken from it, so a listener always
        # has the chunk a trajectory came from.
        if self.predicted_pub is not None:
            self._publish_predicted(chunk)
        listening = time.monotonic() < self._resume_at
        with self.lock:
            if self.active and not listening:
                self.player.play(chunk)
            if not self.cfg.p['command']:
                self.shadow.chunk(chunk)
        if listening:
            self.reporter.report('commanders:listening', 'inputs are back after '
                                 f'{self.cfg.p["commander_check"]:g} s or more: listening '
                                 'for another commander on '
                                 f'{", ".join(self.topics())} before commanding again')
        self._stats['chunks'] += 1
        self._latency.append(self.now() - stamp)
        self._chunk_times.append(time.monotonic())

    def finished(self, ready: Ready, result) -> None:
        """A frame of this robot ended (its chunk already went to on_actions): count it,
        report a refused narration, publish its narration events."""
        self._stats['frames'] += 1
        self._stats['narration_requests'] += int(ready.narrate)
        if result.rejected:
            self.reporter.report('narration:rejected', result.rejected)

    def _publish_predicted(self, chunk):
        from trajectory_msgs.msg import JointTrajectoryPoint

        msg = self._msgs['JointTrajectory']()
        msg.header.stamp.sec, msg.header.stamp.nanosec = split(chunk.stamp)
        names = self.cfg.output_names
        idx = list(names)
        msg.joint_names = list(names.values())
        for i, (p, v) in enumerate(zip(chunk.positions[:, idx], chunk.velocities[:, idx],
                                       strict=True)):
            msg.points.append(JointTrajectoryPoint(positions=p.tolist(), velocities=v.tolist(),
                                                   time_from_start=duration(i * chunk.period)))
        self.predicted_pub.publish(msg)

    def publish_events(self, events):
        Narration, String = self._msgs['Narration'], self._msgs['String']
        for e in events:
            if e.kind != 'narration':
                continue  # questions are answered through ~/ask
            m = Narration()
            m.header.stamp.sec, m.header.stamp.nanosec = split(e.stamp)
            m.request_id = int(e.request_id)
            m.delta, m.text, m.tokens, m.done = e.delta, e.text, int(e.tokens), bool(e.done)
            if e.done:
                m.reason, m.message = e.reason, (e.message if e.cancelled else '')
            self.narration_pub.publish(m)
            if e.done:
                if e.cancelled:
                    self.reporter.report('narration:dropped', f'narration request '
                                         f'{e.request_id}: {e.message}')
                else:
                    self.text_pub.publish(String(data=e.text))

    # -- control ---------------------------------------------------------------------------

    def _control(self, stop: threading.Event):
        period = 1.0 / self.cfg.p['control_rate_hz']
        deadline = time.monotonic()
        while not stop.is_set() and self.node.context.ok():
            deadline += period
            delay = deadline - time.monotonic()
            if delay > 0:
                if stop.wait(delay):
                    break
            else:
                # Late by a period or more: skip the lost ticks instead of bursting to catch up.
                deadline += (-delay // period) * period
            self.tick()

    def _take_joints(self):
        """Take the joint states waiting, in order: the control and engine threads both
        do, one at a time (a reading must not overtake the one before it)."""
        with self._intake:
            for sub in self._joint_subs:
                take(sub, self._input_failed)

    def _measured(self) -> np.ndarray | None:
        return self.inputs.measured()

    def _hold_at(self) -> tuple[np.ndarray, np.ndarray]:
        return self.inputs.hold_at()

    def tick(self):
        """One control period: what the player says goes out. Never raises: a failure holds
        the robot (the next tick publishes the hold), and a second in a row, when even the
        hold cannot go out, is the node's fault (on_fatal)."""
        with self._tick_lock:
            try:
                self._tick()
            except Exception as e:
                if self.stopping():
                    return
                self._tick_failures += 1
                why = f'control tick failed: {type(e).__name__}: {e}'
                self.fault(why, traceback.format_exc())
                try:
                    self._emergency_hold(why)
                except Exception as err:
                    self.errors.report('fault:no-hold', f'cannot hold: {err}')
                if self._tick_failures >= 2 and self.on_fatal is not None:
                    self.on_fatal(f'{self.label()}{why} (twice in a row)', '')
            else:
                self._tick_failures = 0

    def _emergency_hold(self, why: str):
        """A hold that needs nothing the failed tick may have broken (the player, the
        readings): each joint where the last command sent has brought it by now (linear
        between its points), at rest one control period ahead. Nothing sent yet: nothing
        to replace."""
        sent = self._sent_cmd
        if sent is None:
            return
        t0, times, pos = sent
        dt = time.monotonic() - t0
        at = np.array([np.interp(dt, times, pos[:, i]) for i in range(pos.shape[1])])
        self._publish(Command(np.array([1.0 / self.cfg.p['control_rate_hz']]), at[None],
                              np.zeros((1, len(at))), hold=f'fault: {why}'))

    def _tick(self):
        if self._jumps is not None:
            before = time.monotonic()
            now = self.now()
            jump = self._jumps.check(now, before, time.monotonic())
            if jump is not None:
                self.clock_jumped(jump, 'system clock')
        self._take_joints()
        t = self._tick_clock()
        period = 1.0 / self.cfg.p['control_rate_hz']
        if self._ticks:
            gap = t - self._ticks[-1]
            self._gaps.append(gap)
            if gap > 1.5 * period:
                self._stats['missed_ticks'] += int(round(gap / period)) - 1
        self._ticks.append(t)
        if not self.cfg.p['command']:
            q, stamps = self._hold_at()
            with self.lock:
                self.shadow.measured(q, stamps)
        try:
            cmd = self.player.tick(self.now(), self._measured, self._hold_at)
        except ValueError as e:
            self.reporter.report(problem_key('playback', str(e)), f'playback failed: {e}')
            self.stop_commanding(f'playback failure: {e}')
            return
        if cmd is None:
            with self.lock:
                if self.active:
                    self._stats['hold_ticks'] += 1
            return
        for f in cmd.findings:
            self.reporter.report(f'limits:{f.kind}:{f.joint}', f.text)
        try:
            self._publish(cmd)
        except Exception as e:  # publishing fails once ROS is shutting down
            if self.stopping():
                return
            raise RuntimeError(f'trajectory not sent: {e}') from e

    def _publish(self, cmd: Command):
        from trajectory_msgs.msg import JointTrajectoryPoint

        JointTrajectory = self._msgs['JointTrajectory']
        durations = [duration(dt) for dt in cmd.times]
        for g in self.cfg.groups:
            pos = cmd.positions[:, g.indices]
            if not np.all(np.isfinite(pos)):
                self.reporter.report(f'hold:none:{g.name}', f'cannot hold {g.name}: nothing '
                                     'was sent to it yet and its joints have no fresh '
                                     'reading; no target published')
                continue
            vel = cmd.velocities[:, g.indices]
            msg = JointTrajectory()
            # header.stamp stays zero: the controller starts the trajectory on arrival.
            msg.joint_names = list(g.joints)
            msg.points = [JointTrajectoryPoint(positions=p.tolist(), velocities=v.tolist(),
                                               time_from_start=d)
                          for p, v, d in zip(pos, vel, durations, strict=True)]
            data = serialize_message(msg)
            if self.cfg.p['command']:
                self._sent_bytes(data)
                self.traj_pubs[g.name].publish(data)
            else:
                self.shadow_pubs[g.name].publish(data)
        self._sent_cmd = (time.monotonic(), cmd.times.copy(), cmd.positions.copy())
        if cmd.hold:
            self._stats['holds'] += 1
            self.hold_reason = cmd.hold
            self.reporter.report(problem_key('holding', cmd.hold), f'holding: {cmd.hold}')
        else:
            self._stats['published'] += 1
            self._stats['clamped_commands'] += int(cmd.clamped)
            self._publishes.append(time.monotonic())

    # -- diagnostics -----------------------------------------------------------------------

    def reset_stats(self):
        self._stats = dict(chunks=0, frames=0, published=0, hold_ticks=0, missed_ticks=0,
                           narration_requests=0, holds=0, rtc_delay=0, clamped_commands=0,
                           faults=0, clock_jumps=0)
        self.hold_reason = ''
        self._checked = 0.0
        self._ticks = collections.deque(maxlen=2000)  # tick times
        self._gaps = collections.deque(maxlen=2000)
        self._publishes = collections.deque(maxlen=2000)
        self._latency = collections.deque(maxlen=500)  # frame stamp -> its chunk, s
        self._chunk_times = collections.deque(maxlen=500)

    def summary(self, action_horizon: int) -> dict:
        """This robot's part of /diagnostics, as plain numbers."""
        s = {}
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
        s['chunk_ms'] = 1e3 * self.cfg.action_period * action_horizon
        s.update(self._stats)
        if not self.cfg.p['command']:
            with self.lock:
                errors = self.shadow.errors()
            for j, (mean, most, _) in errors.items():
                s[f'shadow_error_mean.{j}'] = mean
                s[f'shadow_error_max.{j}'] = most
            s['shadow_error_mean_worst'] = max((m for m, _, _ in errors.values()),
                                               default=float('nan'))
        return s

    def counts(self) -> dict:
        """The problems this robot's reporter counted, for /diagnostics."""
        r = self.reporter
        return dict(dropped_images=r.count('image:'), dropped_joint_states=r.count('joints:'),
                    future_stamps=r.count('future:'), rejected_prompts=r.count('prompt:'),
                    skipped_frames=r.count('frame:'), masked_cameras=r.count('mask:'),
                    failed_frames=r.count('engine:') + r.count('actions:'),
                    limit_holds=r.count('holding:joint limits'),
                    joint_glitches=r.count('glitch:'),
                    # Distinct problems kept for the rate limit: bounded, whatever is sent.
                    problem_kinds=len(r.totals) + len(self.errors.totals))

    def status(self, s: dict) -> tuple[str, str]:
        """(level, message) for this robot's DiagnosticStatus, from its summary ``s``: 'ERROR'
        for FAULT_SHOWN_S after a fault of the node's own, 'WARN' while it holds, else
        'OK'."""
        with self.lock:
            active = self.active
        if time.monotonic() - self._faulted_at < FAULT_SHOWN_S:
            return 'ERROR', f'fault: {self.faulted}'
        holding = s['control_publish_hz'] < 0.5 * self.cfg.p['control_rate_hz']
        if self.yielded:
            return 'WARN', f'not commanding: {self.yielded}'
        if not active:
            return 'OK', 'inactive: not commanding'
        if not self.cfg.p['command']:
            worst = s.get('shadow_error_mean_worst', float('nan'))
            return 'OK', ('shadow mode: not commanding; ' + (
                f'predictions {worst:.3f} from the measured joints at worst (mean over '
                f'{WINDOW_S:g} s)' if math.isfinite(worst) else 'nothing compared yet'))
        if holding:
            return 'WARN', f'holding: {self.hold_reason or "no fresh actions"}'
        return 'OK', (f'{s["control_publish_hz"]:.0f} Hz commands, '
                      f'{s["frame_ms_p50"]:.0f} ms frames')
