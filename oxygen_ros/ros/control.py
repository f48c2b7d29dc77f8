"""A robot's control loop: what its player says goes out, every control period.

A thread sleeping to absolute deadlines (on two cores a Python executor next to the model
delayed timer callbacks by tens of ms, measured), or, under use_sim_time, a timer on the
node's clock, so control follows /clock and stops while the simulation pauses. The thread
runs real-time where the system allows it (raise_priority). Each tick takes the joint states
waiting, watches the system clock for jumps, asks the player for a command or a hold and
publishes it on the robot's trajectory topics (in shadow mode on its ~/shadow topics). A
tick never raises: a failure holds the robot, and a second in a row, when even the hold
cannot go out, is the node's fault.
"""

from __future__ import annotations

import os
import threading
import time
import traceback

import numpy as np
from rclpy.serialization import deserialize_message, serialize_message

from oxygen_ros.robot.clock import BACK_S, JumpWatch
from oxygen_ros.robot.inputs import problem_key
from oxygen_ros.robot.playback import Command
from oxygen_ros.ros import messages

# The control thread's scheduling (raise_priority): SCHED_FIFO at this priority, below
# ros2_control's controller_manager (50) so that a controller on the same machine still
# comes first; where that is not allowed, this nice value.
RT_PRIORITY = 10
NICE = -10


def raise_priority(priority: int = RT_PRIORITY, nice: int = NICE) -> tuple[bool, str]:
    """Raise the calling thread's scheduling: real-time (SCHED_FIFO at `priority`) where the
    process may (root, CAP_SYS_NICE, or an rtprio limit of at least `priority`), else `nice`
    where it may. Returns (real-time, what the thread runs at and why).

    Why it matters: a tick needs the GIL, and so does the engine thread between its torch
    ops. On a full CPU the OS preempts a control thread of normal priority in the middle of
    its tick, GIL held, and the engine thread waits with it until the control thread gets
    a core again: ticks come late, frames slow down, and chunks run out before the next
    arrives (docs/benchmarks.md, "Control rate"). A real-time thread is not preempted by
    ordinary ones, so its GIL is back within the tick's own CPU time."""
    fifo = getattr(os, 'SCHED_FIFO', None)
    if fifo is None:
        return False, 'no SCHED_FIFO on this system'
    names = {os.SCHED_FIFO: 'SCHED_FIFO', os.SCHED_RR: 'SCHED_RR'}
    policy = os.sched_getscheduler(0) & ~getattr(os, 'SCHED_RESET_ON_FORK', 0)
    have = os.sched_getparam(0).sched_priority
    if policy in names and have >= priority:
        return True, f'real-time ({names[policy]}, priority {have}, as started)'
    try:
        # Reset on fork: nothing this thread starts inherits the priority.
        os.sched_setscheduler(0, fifo | getattr(os, 'SCHED_RESET_ON_FORK', 0),
                              os.sched_param(priority))
        return True, f'real-time (SCHED_FIFO, priority {priority})'
    except OSError as e:
        why = f'SCHED_FIFO priority {priority} refused: {e.strerror or e}'
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) > nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)  # this thread only (Linux)
        return False, f'nice {os.getpriority(os.PRIO_PROCESS, tid)} ({why})'
    except OSError as e:
        return False, f'normal priority ({why}; nice {nice}: {e.strerror or e})'


class Control:
    """The control loop of ``link`` (a RobotLink: its Config, player, readings, topics)."""

    def __init__(self, link):
        self.link = link
        # Reentrant: leaving commanding holds it across its own hold tick (RobotLink).
        self._tick_lock = threading.RLock()
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
        # (monotonic time, times, positions) of the last command sent, from where it
        # started (time 0)
        self._sent_cmd = None
        self.scheduling = ''  # what the control thread runs at (raise_priority), once known
        self._writers = {}  # group -> its messages.TrajectoryBytes, None: serialize_message

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
        for g in self.link.cfg.groups:  # checked here, not in the first tick
            self._writer(g)
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
        try:
            realtime, what = raise_priority()
        except Exception as e:  # the loop runs as it is rather than not at all
            realtime, what = False, f'scheduling not changed: {type(e).__name__}: {e}'
        if what != self.scheduling:  # said at the first activation, and when it changes
            self.scheduling = what
            if realtime:
                self.link.log.info(f'{self.link.label()}control thread: {what}')
            else:
                self.link.log.warning(
                    f'{self.link.label()}control thread not real-time: {what}. On a busy CPU '
                    'its ticks then come late and the model waits on them (the GIL); allow '
                    f'real-time scheduling for the node (CAP_SYS_NICE, or rtprio {RT_PRIORITY} '
                    'for its user in /etc/security/limits.conf)')
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
        if self._sent_cmd is None:
            return
        at, moving = self._along_sent(time.monotonic())
        step = 1.0 / self.link.cfg.p.control_rate_hz
        limits = self.link.cfg.limits
        if limits is None:
            times, pos, vel = np.array([step]), at[None], np.zeros((1, len(at)))
        else:  # a moving joint brakes within its limits, as every other hold does
            times, pos, vel = limits.stop(at, moving, step, self.link.cfg.p.max_command_horizon)
        self._publish(Command(times, pos, vel, hold=f'fault: {why}'))

    def _along_sent(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """(positions, velocities) at monotonic `now` along the last command sent, linear
        between its points and from where it started (what it replaced had brought the
        joints there): needs nothing of the player, which a failed tick may have broken."""
        t0, times, pos = self._sent_cmd
        dt = now - t0
        at = np.array([np.interp(dt, times, pos[:, i]) for i in range(pos.shape[1])])
        k = int(np.searchsorted(times, dt, side='right'))
        if 0 < k < len(times):
            vel = (pos[k] - pos[k - 1]) / (times[k] - times[k - 1])
        else:
            vel = np.zeros(pos.shape[1])
        return at, vel

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
            now = self.link.now()
            self.link.intake.tick_check(now)  # a stale input holds now, whatever the engine does
            cmd = self.link.player.tick(now, inputs.measured, inputs.motion)
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

    def _writer(self, g):
        """Group g's trajectories serialized directly (messages.TrajectoryBytes), once the
        middleware has read a sample of them back as the message they stand for; None where
        it did not (serialize_message then)."""
        if g.name not in self._writers:
            from trajectory_msgs.msg import JointTrajectory

            write = messages.TrajectoryBytes(g.joints)
            k = len(g.joints)
            pos = np.arange(3 * k, dtype=np.float64).reshape(3, k) * 0.1 - 1.0
            times = np.array([0.01, 0.3, 1.75])
            try:
                same = deserialize_message(write(pos, -pos, times), JointTrajectory) == \
                    messages.trajectory(g.joints, pos, -pos, times)
            except Exception:
                same = False
            self._writers[g.name] = write if same else None
        return self._writers[g.name]

    def _publish(self, cmd: Command):
        for g in self.link.cfg.groups:
            pos = cmd.positions[:, g.indices]
            if not np.all(np.isfinite(pos)):
                self.link.reporter.report(f'hold:none:{g.name}', f'cannot hold {g.name}: nothing '
                                     'was sent to it yet and its joints have no fresh '
                                     'reading; no target published')
                continue
            vel = cmd.velocities[:, g.indices]
            write = self._writer(g)
            data = (write(pos, vel, cmd.times) if write is not None else
                    serialize_message(messages.trajectory(g.joints, pos, vel, cmd.times)))
            if self.link.cfg.p.command:
                self.link.others.sent(data)
                self.link.traj_pubs[g.name].publish(data)
            else:
                self.link.shadow_pubs[g.name].publish(data)
        now = time.monotonic()
        start = (self._along_sent(now)[0] if self._sent_cmd is not None
                 else cmd.positions[0])
        start = np.where(np.isfinite(start), start, cmd.positions[0])
        self._sent_cmd = (now, np.concatenate(([0.0], cmd.times)),
                          np.vstack([start, cmd.positions]))
        s = self.link.stats
        if cmd.hold:
            s.c['holds'] += 1
            s.hold_reason = cmd.hold
            self.link.reporter.report(problem_key('holding', cmd.hold), f'holding: {cmd.hold}')
        else:
            s.c['published'] += 1
            s.c['clamped_commands'] += int(cmd.clamped)
            s.publishes.append(time.monotonic())
