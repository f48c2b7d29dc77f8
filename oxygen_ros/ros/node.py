"""The ROS 2 node: robot topics in, joint trajectories and narration out.

A lifecycle node (configure: check parameters, load the model, create topics; activate:
command the robot; deactivate / cleanup / shutdown: stop, holding the robot where it is).
It keeps the lifecycle, the live parameters and the watchdog; the rest has its room:
parameters declared in node_params.py (the table is robot/params.py), one RobotLink per
robot (its topics, samples, holds, outputs; its Intake in robot/intake.py and its control
loop in control.py), the engine thread in engine_loop.py, /diagnostics in diagnostics.py,
~/ask in ask_server.py. One robot is a fleet of one: with `robots` the node serves several
from one engine, a link each, on the same path.

Threads, and why:
- the robot's inputs are not dispatched by the executor: an ALOHA publishes ~1200 messages/s
  (two JointStates at 500 Hz, cameras at 60 Hz) and rclpy's executor spent 30% of a core
  rebuilding wait sets for them (measured with per-thread CPU counters and py-spy), time
  the model then lacked. Their subscriptions sit in a callback group no executor runs; the
  control thread takes the joint states each tick and the engine thread the newest image
  of each camera before each frame, so unused images are never even converted;
- the engine thread (engine_loop.py) runs the frames; each robot's control thread
  (control.py) publishes what its player says at control_rate_hz, real-time (SCHED_FIFO)
  where the system allows it: on a full CPU a tick preempted with the GIL held stalled the
  engine thread too;
- the executor runs the lifecycle and parameter services, ~/prompt, ~/narrate, ~/ask (its
  goals are coroutines that never block it) and the diagnostics and watchdog timers.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn

from oxygen_ros.engine.ask import Asks
from oxygen_ros.robot.contract import Config
from oxygen_ros.robot.params import StartError
from oxygen_ros.robot.report import Reporter
from oxygen_ros.ros import node_params, watchdog
from oxygen_ros.ros.ask_server import AskServer, AskServers, RobotAsks
from oxygen_ros.ros.diagnostics import Diagnostics
from oxygen_ros.ros.engine_loop import EngineLoop, describe_weights, start_engine
from oxygen_ros.ros.live_params import LiveParams
from oxygen_ros.ros.robot_link import RobotLink

__all__ = ['OxygenNode', 'main']

SUCCESS, FAILURE = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE
ERROR = TransitionCallbackReturn.ERROR
# How long a stopping node spins on to send the results of the ~/ask goals it ended.
ASK_CLOSE_S = 1.0
# How long deactivate waits for the engine and control threads to end. One still running
# after it (a frame that takes longer) makes the next activation refuse: never two at once.
HALT_S = 10.0
# How often the watchdog looks at the threads and faults (s, on the steady clock: it must
# run while simulated time stands still).
WATCH_S = 0.1


class OxygenNode(LifecycleNode):
    """Declares and checks every parameter at construction, so a wrong one is a start-up
    error whichever lifecycle transition would read it first."""

    def __init__(self, argv=None, **kw):
        super().__init__('oxygen_node', **kw)
        # A node just started has not discovered the ROS graph yet: until commander_check
        # has passed since then, activation listens for another commander even where no
        # other publisher shows on the trajectory topics.
        self._born = time.monotonic()
        self.log = self.get_logger()
        self.reporter = Reporter(self.log.warning)
        # Ends the engine thread of the current activation; each activation gets its own, so
        # one that did not stop in time cannot be restarted by the next activation.
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stragglers: list[threading.Thread] = []  # threads that outlived HALT_S
        # Why the node cannot go on commanding (the watchdog then takes it through
        # ErrorProcessing); None while all is well.
        self.fault: str | None = None
        self._ros: list = []  # publishers and timers made by configure
        self.engine = None
        self.asks = Asks()  # ~/ask goals; the engine takes them only while active
        self.ask_server = None  # from configure to cleanup, or past shutdown until main closes it
        self.start_error = StartError('a lifecycle transition failed; see the log above')
        self.fleet: dict[str, tuple[Config, str]] = {}  # robot -> (its Config, namespace)
        self.cfg = node_params.read(self, argv)
        if self.fleet:
            self.links = [RobotLink(self, c, name=r, prefix=ns, private=f'~/{r}')
                          for r, (c, ns) in self.fleet.items()]
            for link in self.links:
                link.asks = Asks()
        else:
            self.links = [RobotLink(self, self.cfg, reporter=self.reporter)]
            self.links[0].asks = self.asks
        self.by_name = {link.name: link for link in self.links}
        self.add_on_set_parameters_callback(LiveParams(self))

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
        for link in self.links:
            kind = link.cfg.p.robot
            if cfg.random_weights and kind != 'identity' and not cfg.p.allow_random_weights:
                msg = (f'refusing to activate: the {link.label()}{kind} robot would be driven '
                       'by RANDOM weights (no checkpoint). Set checkpoint, or '
                       'allow_random_weights: true for timing and simulation')
                self.log.error(msg)
                self.start_error = StartError(msg)
                return FAILURE
        busy = [t.name for t in self._stragglers if t.is_alive()]
        busy += [f'{link.label()}control' for link in self.links if link.control.busy()]
        self._stragglers = [t for t in self._stragglers if t.is_alive()]
        if busy:
            msg = (f'refusing to activate: the {", ".join(busy)} thread of the last activation '
                   f'is still running (it did not stop within {HALT_S:g} s of deactivate); '
                   'activate again once it has ended')
            self.log.error(msg)
            self.start_error = StartError(msg)
            return FAILURE
        # Never two commanders: where another node has a publisher on a trajectory topic,
        # listen for what it sends before taking the robot.
        for link in self.links:
            # A robot in shadow mode is another's to command (an operator's, say).
            check = cfg.p.commander_check
            other = link.cfg.p.command and link.commanders(
                listen=check, blind=check - (time.monotonic() - self._born))
            if other:
                msg = f'refusing to activate: {link.label()}{other}'
                self.log.error(msg)
                self.start_error = StartError(msg)
                return FAILURE
        self.fault = None
        self._stop = threading.Event()
        for link in self.links:
            link.activate()
        self._start_threads()
        for link in self.links:
            link.asks.activate(RobotAsks(self.engine, link.name) if self.fleet else self.engine)
        self.log.info('active: ' + '; '.join(
            ('commanding ' if link.cfg.p.command else 'shadow mode, not commanding ')
            + ', '.join(link.topics()) for link in self.links))
        return SUCCESS

    def on_deactivate(self, state) -> TransitionCallbackReturn:
        fault = self.fault
        self._halt(f'fault: {fault}' if fault else 'deactivated')
        # A fault goes on through ErrorProcessing (on_error): the node ends unconfigured.
        return ERROR if fault else SUCCESS

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
        if self.fault:
            self.log.error(f'unconfigured after a fault ({self.fault}): configure and '
                           'activate to command again')
        return SUCCESS

    def _configure(self):
        cfg = self.cfg
        self.reporter.period = cfg.p.report_period
        self._check_outputs()
        self.engine = e = start_engine(cfg, self.links, bool(self.fleet), self.log)
        self._setup_ros()
        self.log.info(f'configured: {describe_weights(cfg, e)}; chunks of {e.action_horizon} x '
                      f'{e.action_dim} in {e.denoise_steps} steps; cameras -> slots '
                      f'{cfg.slots}; {cfg.p.robot} robot; activate to command it')
        if e.n_action_steps < e.action_horizon and not cfg.p.play_steps:
            self.log.info(f'the checkpoint plays {e.n_action_steps} of its {e.action_horizon} '
                          f'actions per chunk (n_action_steps); play_steps: '
                          f'{e.n_action_steps} does the same here')

    def _check_outputs(self):
        """Every output on a controller of its own, by the names the topics resolve to
        (namespace, remapping): `arm/jt` and `/arm/jt` are one topic in the root namespace,
        and two robots of a fleet may name one controller. A controller follows one
        trajectory at a time: two commanders on it fight."""
        seen = {}
        for link in self.links:
            for g, topic in zip(link.cfg.groups, link.topics(), strict=True):
                who = f'{link.label()}outputs.{g.name}'
                if topic in seen:
                    raise StartError(f'{seen[topic]} and {who} both command {topic}: a '
                                     'controller follows one trajectory at a time')
                seen[topic] = who

    def _cleanup(self, keep_ask_server: bool = False):
        self._halt('cleanup')
        entities, self._ros = self._ros, []
        for link in self.links:
            entities += link.entities()
        if self.ask_server is not None and not keep_ask_server:
            entities.append(self.ask_server)
            self.ask_server = None
        for entity in entities:
            try:
                self._destroy(entity)
            except Exception:  # already gone with the context
                pass
        self.engine = None
        for link in self.links:
            link.cfg.sized_tokens = None

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
        """Stop commanding: hold every robot where it is, then end the threads."""
        was_active = [link.deactivate(why) for link in self.links]
        self._stop.set()
        for link in self.links:
            link.control.stop(HALT_S)
        end = time.monotonic() + HALT_S
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
            if t.is_alive():
                self.log.error(f'{t.name} thread still busy after {HALT_S:g} s: the next '
                               'activation is refused until it ends')
                self._stragglers.append(t)
        self._threads = []
        if any(was_active):
            # No frame runs now: open goals end with the reason and their rows are free.
            for link in self.links:
                link.asks.deactivate(why)

    # -- ROS interface ---------------------------------------------------------------------

    def _setup_ros(self):
        from rclpy.clock import Clock, ClockType

        cfg = self.cfg
        for link in self.links:
            link.configure()
        self.diagnostics = Diagnostics(self)
        self._ros = [self.diagnostics.pub,
                     self.create_timer(1.0 / cfg.p.diagnostics_rate_hz,
                                       self.diagnostics.publish),
                     self.create_timer(WATCH_S, lambda: watchdog.watch(self),
                                       clock=Clock(clock_type=ClockType.STEADY_TIME))]
        for link in self.links:
            link.on_fatal = self.fail
        for link in self.links:
            link.asks.max_open = cfg.p.max_open_questions
            link.asks.timeout = cfg.p.question_timeout
            link.asks.deactivate('configured, not yet activated')
        if self.fleet:
            self.ask_server = AskServers([AskServer(self, link.asks, f'~/{link.name}/ask')
                                          for link in self.links])
        else:
            self.ask_server = AskServer(self, self.asks)

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    # -- engine thread ---------------------------------------------------------------------

    def _start_threads(self):
        sim = self.get_parameter('use_sim_time').value
        for link in self.links:
            link.control.start(sim)
        self._threads = [EngineLoop(self).start(self._stop)]

    # -- faults ----------------------------------------------------------------------------

    def fail(self, why: str, detail: str = ''):
        """The node cannot go on commanding (its own code failed where no robot's hold
        covers it): every robot holds now, the log says why at ERROR, and the watchdog takes
        the node through ErrorProcessing to unconfigured."""
        first = self.fault is None
        self.fault = self.fault or why
        for link in self.links:
            link.stop_commanding(f'fault: {why}')
        if first:
            self.log.error(f'fault: {why}; holding every robot and leaving commanding'
                           + (f'\n{detail}' if detail else ''))






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
    node = executor = None
    code = 0
    try:
        node = OxygenNode(argv)
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        if node.cfg.p.autostart:
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
        if executor is not None:
            # Before the context goes: an executor collected after it (a start-up error's
            # traceback keeps it alive that long) prints one on its way out.
            executor.shutdown(timeout_sec=0)
        rclpy.try_shutdown()
        # Python puts the default handlers back while it exits, and a signal then would kill
        # the process (exit code -2); from here on there is nothing left to stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if code:
        sys.exit(code)


if __name__ == '__main__':
    main()
