"""A robot's control loop: what its player says goes out, every control period.

A thread sleeping to absolute deadlines (on two cores a Python executor next to the model
delayed timer callbacks by tens of ms, measured), or, under use_sim_time, a timer on the
node's clock, so control follows /clock and stops while the simulation pauses. Each tick
takes the joint states waiting, watches the system clock for jumps, asks the player for a
command or a hold and publishes it on the robot's trajectory topics (in shadow mode on its
~/shadow topics). A tick never raises: a failure holds the robot, and a second in a row,
when even the hold cannot go out, is the node's fault.
"""

from __future__ import annotations

import threading
import time
import traceback

import numpy as np
from rclpy.serialization import serialize_message

from oxygen_ros.robot.clock import BACK_S, JumpWatch
from oxygen_ros.robot.inputs import problem_key
from oxygen_ros.robot.playback import Command
from oxygen_ros.ros import messages


class Control:
    """The control loop of ``link`` (a RobotLink: its Config, player, readings, topics)."""

    def __init__(self, link):
        self.link = link
        self._tick_lock = threading.Lock()
        # Ends the loop of the current activation (each gets its own: a thread that
        # outlived stop() must not be restarted by the next start()).
        self._stop = threading.Event()
        self._thread = None
        self._straggler = None  # a control thread that did not end within stop()'s wait
        self._timer = None  # control under use_sim_time
        self._jumps = None  # JumpWatch on the system clock, None under simulated time
        self._jump_handle = None  # rcl's jump callback under simulated time
        self._jump_lock = threading.Lock()
        self._tick_failures = 0
        self._sent_cmd = None  # (monotonic time, times, positions) of the last command sent

    def stopping(self) -> bool:
        return self._stop.is_set() or not self.link.node.context.ok()

    def start(self, sim_time: bool):
        """The control loop: a thread to absolute deadlines, or a timer on the node's clock
        under simulated time (so it follows /clock and stops while the simulation pauses)."""
        self._stop = threading.Event()
        self.link.intake.checked = 0.0
        self._tick_failures = 0
        # Clock jumps: rcl reports those of simulated time (from the first tick on:
        # _sim_tick); the system clock's are found by comparing it with the monotonic clock
        # every tick.
        self._jumps = None if sim_time else JumpWatch(self.link.cfg.p.max_input_age)
        # What came while inactive, so the first frame is not judged on old readings.
        self.link._take_joints()
        if sim_time:
            from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

            self._tick_clock = self.link.now
            self._timer = self.link.node.create_timer(
                1.0 / self.link.cfg.p.control_rate_hz, self._sim_tick,
                callback_group=MutuallyExclusiveCallbackGroup())
        else:
            self._tick_clock = time.monotonic
            self._thread = threading.Thread(target=self._control, args=(self._stop,),
                                            name='control', daemon=True)
            self._thread.start()

    def _sim_tick(self):
        # rcl judges a jump against the last /clock the node read, and it reads none while an
        # activation holds its executor (the commander check listens up to commander_check
        # s): all the simulated time that passed meanwhile would come as one false jump.
        # A timer on simulated time first fires once /clock has been read again.
        if self._jump_handle is None:
            self._watch_jumps()
        self.tick()

    def _watch_jumps(self):
        from rclpy.clock import JumpThreshold
        from rclpy.duration import Duration

        with self._jump_lock:
            if self._stop.is_set():  # stop() ran meanwhile: nothing to watch for
                return
            self._jump_handle = self.link.node.get_clock().create_jump_callback(
                JumpThreshold(min_forward=Duration(seconds=self.link.cfg.p.max_input_age),
                              min_backward=Duration(seconds=-BACK_S), on_clock_change=True),
                post_callback=self._on_jump)

    def stop(self, wait: float = 10.0):
        """End the control loop, waiting up to ``wait`` s for its thread."""
        with self._jump_lock:
            self._stop.set()
            if self._jump_handle is not None:
                self._jump_handle.unregister()
                self._jump_handle = None
        if self._timer is not None:
            self.link.node.destroy_timer(self._timer)
            self._timer = None
        if self._thread is not None:
            self._thread.join(wait)
            if self._thread.is_alive():
                self.link.log.error(f'{self.link.label()}control thread still busy after '
                                    f'{wait:g} s: the next activation is refused until it ends')
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

    def _on_jump(self, jump):
        from rclpy.clock import ClockChange

        change = jump.clock_change
        if change in (ClockChange.ROS_TIME_ACTIVATED, ClockChange.ROS_TIME_DEACTIVATED):
            what = 'ROS time ' + ('activated' if change == ClockChange.ROS_TIME_ACTIVATED
                                  else 'deactivated')
        else:
            what = 'simulated clock'
        self.link.clock_jumped(jump.delta.nanoseconds * 1e-9, what)

    def _control(self, stop: threading.Event):
        period = 1.0 / self.link.cfg.p.control_rate_hz
        deadline = time.monotonic()
        while not stop.is_set() and self.link.node.context.ok():
            deadline += period
            delay = deadline - time.monotonic()
            if delay > 0:
                if stop.wait(delay):
                    break
            else:
                # Late by a period or more: skip the lost ticks instead of bursting to catch up.
                deadline += (-delay // period) * period
            self.tick()

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
                self.link.fault(why, traceback.format_exc())
                try:
                    self._emergency_hold(why)
                except Exception as err:
                    self.link.errors.report('fault:no-hold', f'cannot hold: {err}')
                if self._tick_failures >= 2 and self.link.on_fatal is not None:
                    self.link.on_fatal(f'{self.link.label()}{why} (twice in a row)', '')
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
        self._publish(Command(np.array([1.0 / self.link.cfg.p.control_rate_hz]), at[None],
                              np.zeros((1, len(at))), hold=f'fault: {why}'))

    def _tick(self):
        if self._jumps is not None:
            before = time.monotonic()
            now = self.link.now()
            jump = self._jumps.check(now, before, time.monotonic())
            if jump is not None:
                self.link.clock_jumped(jump, 'system clock')
        self.link._take_joints()
        t = self._tick_clock()
        period = 1.0 / self.link.cfg.p.control_rate_hz
        self.link.stats.tick(t, period)
        if not self.link.cfg.p.command:
            q, stamps = self.link.inputs.hold_at()
            with self.link.lock:
                self.link.shadow.measured(q, stamps)
        try:
            inputs = self.link.inputs
            cmd = self.link.player.tick(self.link.now(), inputs.measured, inputs.hold_at)
        except ValueError as e:
            self.link.reporter.report(problem_key('playback', str(e)), f'playback failed: {e}')
            self.link.stop_commanding(f'playback failure: {e}')
            return
        if cmd is None:
            with self.link.lock:
                if self.link.active:
                    self.link.stats.c['hold_ticks'] += 1
            return
        for f in cmd.findings:
            self.link.reporter.report(f'limits:{f.kind}:{f.joint}', f.text)
        try:
            self._publish(cmd)
        except Exception as e:  # publishing fails once ROS is shutting down
            if self.stopping():
                return
            raise RuntimeError(f'trajectory not sent: {e}') from e

    def _publish(self, cmd: Command):
        for g in self.link.cfg.groups:
            pos = cmd.positions[:, g.indices]
            if not np.all(np.isfinite(pos)):
                self.link.reporter.report(f'hold:none:{g.name}', f'cannot hold {g.name}: nothing '
                                     'was sent to it yet and its joints have no fresh '
                                     'reading; no target published')
                continue
            msg = messages.trajectory(g.joints, pos, cmd.velocities[:, g.indices], cmd.times)
            data = serialize_message(msg)
            if self.link.cfg.p.command:
                self.link.others.sent(data)
                self.link.traj_pubs[g.name].publish(data)
            else:
                self.link.shadow_pubs[g.name].publish(data)
        self._sent_cmd = (time.monotonic(), cmd.times.copy(), cmd.positions.copy())
        s = self.link.stats
        if cmd.hold:
            s.c['holds'] += 1
            s.hold_reason = cmd.hold
            self.link.reporter.report(problem_key('holding', cmd.hold), f'holding: {cmd.hold}')
        else:
            s.c['published'] += 1
            s.c['clamped_commands'] += int(cmd.clamped)
            s.publishes.append(time.monotonic())
