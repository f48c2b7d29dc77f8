"""One robot's side of the node: its topics, its latest samples, its control loop.

A link owns what is per robot and needs ROS: the subscriptions to its cameras and joint
states (their samples go to robot/inputs.Inputs), its Player and the control thread (or,
under use_sim_time, a timer on the node's clock) asking it what to publish, its holds, its
trajectory, narration and ~/predicted_trajectory publishers, and its part of the
diagnostics. When a frame may start and what it brings is its Intake's (robot/intake.py,
no ROS); who else commands the robot is its Commanders' (commanders.py). The node owns the
lifecycle, the parameters, the engine thread and the ~/ask servers, and hands each link the
rclpy node to create its entities on; nothing here imports the node.

A link's topics are the robot file's, under `prefix` (a robot's namespace in a fleet; ''
for the node's one robot) and its private topics (~/prompt, ~/narrate, ~/narration,
~/predicted_trajectory) under `private` ('~' for the one robot, '~/<robot>' in a fleet).
"""

from __future__ import annotations

import math
import threading
import time
import traceback

import numpy as np

from oxygen_ros.robot.contract import Config
from oxygen_ros.robot.inputs import Inputs, problem_key
from oxygen_ros.robot.intake import Intake, Ready
from oxygen_ros.robot.playback import Player
from oxygen_ros.robot.report import Reporter
from oxygen_ros.robot.stats import RobotStats
from oxygen_ros.ros import messages
from oxygen_ros.ros.control import Control
from oxygen_ros.ros.robot_topics import create_topics
from oxygen_ros.ros.topics import join, take

__all__ = ['Ready', 'RobotLink']


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
        self.reporter.period = cfg.p.report_period
        # The node's own failures, said at ERROR (rate-limited like the problems).
        self.errors = Reporter(lambda m: self.log.error(self.label() + m),
                               cfg.p.report_period)
        # What anyone on the graph can change (the prompt topic) is said at most once a
        # period too: a flood of prompts must not flood the log from the executor.
        self.notes = Reporter(lambda m: self.log.info(self.label() + m), cfg.p.report_period)
        self.lock = threading.Lock()
        self._intake = threading.Lock()  # joint states are taken by one thread at a time
        self.active = False  # chunks from the engine are played only while True
        self.on_fatal = None  # (why, detail): the node cannot hold this robot any more
        self.faulted = ''  # the last fault of the node's own code, for diagnostics
        self.faulted_at = -math.inf
        self.yielded = ''  # why this robot left commanding to another node
        self._ros: list = []
        self.player = None
        self.intake = None
        self.stats = RobotStats()
        self.control = Control(self)

    def label(self) -> str:
        return f'robot {self.name}: ' if self.name else ''

    # -- configure -------------------------------------------------------------------------

    def configure(self):
        """Create the player, the readings and the robot's topics (the engine is checked)."""
        cfg = self.cfg
        self.player = Player(cfg.p.max_command_horizon, cfg.p.play_steps,
                             hold_after=1.0 / cfg.p.control_rate_hz, limits=cfg.limits,
                             open_loop=cfg.p.open_loop_control, keep=cfg.hold_setpoint)
        self.inputs = Inputs(cfg, self.reporter, self.now)
        self.intake = Intake(cfg, self.inputs, self.reporter, self.now, self.stop_commanding,
                             self._take_joints, self.stats.latency, self.lock)
        self.intake.player = self.player
        create_topics(self)

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
        self.intake.rebase()

    def deactivate(self, why: str) -> bool:
        """Stop playing chunks and publish the hold now; True when it was active."""
        with self.lock:
            was_active = self.active
            self.active = False
        if was_active:
            self.stop_commanding(why)
            self.control.tick()  # publish the hold now, not at the next control period
        return was_active

    def fault(self, why: str, detail: str = ''):
        """The node's own code failed on this robot (not its inputs, not the model): it
        holds, the log says so at ERROR, and its diagnostics show ERROR for FAULT_SHOWN_S."""
        self.stats.add('faults')
        self.faulted = why
        self.faulted_at = time.monotonic()
        said = self.errors.report(problem_key('fault', why), f'{why}; holding')
        if said and detail:
            self.log.error(detail)
        self.stop_commanding(f'fault: {why}')

    def clock_jumped(self, delta: float, what: str):
        """The node's clock jumped by `delta` s: every held stamp is off by that much. The
        chunk goes (a hold follows), and inputs count again from the first sample after the
        jump, so neither an input that stopped nor a chunk can hide behind the jump."""
        self.errors.report('clock:jump', f'the {what} jumped {delta:+.3f} s: dropping the '
                           'chunk, holding, and waiting for inputs stamped after the jump')
        self.stats.add('clock_jumps')
        if self.player is not None:
            self.player.shift(delta)
        self.inputs.clear()
        self.intake.checked = 0.0
        self.stop_commanding(f'the {what} jumped {delta:+.3f} s')

    def _input_failed(self, sub, e: Exception):
        self.fault(f'handling a message on {sub.topic_name} failed (message dropped): '
                   f'{type(e).__name__}: {e}', traceback.format_exc())

    def set_command(self, on: bool):
        """Shadow mode off (on=True: the node commands) or on. Leaving commanding holds the
        robot first, on the controllers' topics, as a stop does (braking within its
        limits); taking it over starts from the readings with the next chunk, as
        activating does."""
        # One hold of the tick lock from the hold to the switch: a control tick in between
        # would send a chunk that came meanwhile to the controllers after their hold.
        with self.control._tick_lock:
            if not on and self.commanding():
                self.stop_commanding('shadow mode: leaving commanding')
                self.control.tick()  # the hold goes out while this link still commands
            with self.lock:
                self.shadow.clear()
                self.cfg.p.command = on
            if self.player is not None:
                if on:
                    self.player.drop()
                else:
                    self.player.forget()

    def apply(self, name: str, value):
        """A live parameter of this robot, already checked (Config.check_live)."""
        if name == 'command':
            if self.cfg.p.command != value:
                self.set_command(value)
            return
        with self.lock:
            self.cfg.p[name] = value
        if name == 'prompt':
            self.set_prompt(value)
        elif name == 'report_period':
            self.reporter.period = self.errors.period = self.notes.period = value
        elif self.player is not None and name == 'max_command_horizon':
            self.player.horizon = value
        elif self.player is not None and name == 'play_steps':
            self.player.play_steps = value

    def shadow_problem(self) -> str | None:
        """Why shadow mode may not turn to commanding now, or None: another node still
        commands the robot, or the prediction disagrees with its motion."""
        other = self.commanders()
        if other:
            return other
        with self.lock:
            return self.shadow.disagreement(self.cfg.p.shadow_margin, self.now())

    def stop_commanding(self, why: str):
        if self.player is not None:
            self.player.stop(why)  # the next tick publishes the hold and says why

    def stopping(self) -> bool:
        return self.control.stopping()

    # -- inputs ----------------------------------------------------------------------------

    def now(self) -> float:
        return self.node.get_clock().now().nanoseconds * 1e-9

    def waiting_for(self) -> str:
        """Why no frame can start now (required inputs missing, stale or stamped ahead), or
        '': what a ~/ask question that timed out waited for."""
        return self.intake.stale(self.now()) or ''

    def set_prompt(self, text: str):
        self.intake.set_prompt(text)

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
                                 f'keeping {self.intake.prompt!r}')
            return
        self.set_prompt(msg.data)
        self.notes.report('prompt', f'task prompt: {self.intake.prompt!r}')

    def _on_narrate(self, _msg):
        self.intake.narrate()  # nothing here can fail

    # -- frames ----------------------------------------------------------------------------

    def _take_images(self):
        for sub in self.image_subs:
            take(sub, self._input_failed)

    def poll(self, slots) -> tuple[Ready | None, float]:
        """Take the newest images and, when a frame can start, what it needs (Intake.poll)."""
        self._take_images()
        return self.intake.poll(slots)

    def times(self):
        """Take the newest images; what a planner needs of this robot (Intake.times)."""
        self._take_images()
        return self.intake.times()

    def check(self, now: float):
        self.intake.check(now)

    def failed(self, why: str):
        """A frame of this robot failed in the engine: it holds."""
        self.reporter.report(problem_key('engine', why), f'frame failed: {why}')
        self.stop_commanding(f'model failure: {why}')

    # -- never two commanders --------------------------------------------------------------

    def heard(self) -> list[str]:
        return self.others.heard()

    def commanders(self, listen: float = 0.0, blind: float = 0.0) -> str | None:
        return self.others.commanders(listen, blind)

    def commanding(self) -> bool:
        """Whether this link sent a command (not a hold) within max_command_horizon."""
        return self.stats.commanding(self.cfg.p.max_command_horizon)

    def give_way(self, why: str) -> bool:
        """Leave commanding to the other node. A robot this link was commanding gets one
        hold first (both stop: the robot rests); one it only held is left alone, as the
        other node commands it now. True when it was active."""
        with self.control._tick_lock:  # no tick between the decision and the hold (set_command)
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
                self.control.tick()
            elif self.player is not None:
                self.player.drop()
        return True

    # -- chunks out ------------------------------------------------------------------------

    def on_actions(self, stamp: float, state: np.ndarray, actions: np.ndarray):
        chunk = self.intake.chunk(stamp, state, actions)
        if chunk is None:
            return
        # The whole chunk goes out before any command taken from it, so a listener always
        # has the chunk a trajectory came from.
        if self.predicted_pub is not None:
            self.predicted_pub.publish(messages.predicted(chunk, self.cfg.output_names))
        listening = self.intake.listening()
        with self.lock:
            if self.active and not listening:
                self.player.play(chunk)
            if not self.cfg.p.command:
                self.shadow.chunk(chunk)
        if listening:
            self.reporter.report('commanders:listening', 'inputs are back after '
                                 f'{self.cfg.p.commander_check:g} s or more: listening '
                                 'for another commander on '
                                 f'{", ".join(self.topics())} before commanding again')
        self.stats.chunk(self.now() - stamp)

    def finished(self, ready: Ready, result) -> None:
        """A frame of this robot ended (its chunk already went to on_actions): count it,
        report a refused narration."""
        self.stats.add('frames')
        self.stats.add('narration_requests', int(ready.narrate))
        if result.rejected:
            self.reporter.report('narration:rejected', result.rejected)

    def publish_events(self, events):
        for e in events:
            if e.kind != 'narration':
                continue  # questions are answered through ~/ask
            self.narration_pub.publish(messages.narration(e))
            if e.done:
                if e.cancelled:
                    self.reporter.report('narration:dropped', f'narration request '
                                         f'{e.request_id}: {e.message}')
                else:
                    self.text_pub.publish(messages.text(e.text))

    # -- control ---------------------------------------------------------------------------

    def _take_joints(self):
        """Take the joint states waiting, in order: the control and engine threads both
        do, one at a time (a reading must not overtake the one before it)."""
        with self._intake:
            for sub in self._joint_subs:
                take(sub, self._input_failed)
