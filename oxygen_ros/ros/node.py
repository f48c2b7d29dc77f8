"""The ROS 2 node: robot topics in, joint trajectories and narration out.

A lifecycle node (configure: check parameters, load the model, create topics; activate:
command the robot; deactivate / cleanup / shutdown: stop, holding the robot where it is).
What needs no ROS lives elsewhere: the parameter table and robot contract in contract.py,
which points of a chunk to publish in playback.py, frame assembly in frames.py. Each robot's
ROS side (its topics, samples, control loop, holds, outputs) is a RobotLink
(robot_link.py); this file keeps the lifecycle, the parameters, the engine thread and ~/ask.
With `robots` the node serves several robots from one engine, a link each; without it, one.

Threads, and why:
- the robot's inputs are not dispatched by the executor: an ALOHA publishes ~1200 messages/s
  (two JointStates at 500 Hz, cameras at 60 Hz) and rclpy's executor spent 30% of a core
  rebuilding wait sets for them (measured with per-thread CPU counters and py-spy), time
  the model then lacked. Their subscriptions sit in a callback group no executor runs; the
  control thread takes the joint states each tick and the engine thread the newest image
  of each camera (and the joint states come by then) before each frame, so unused images
  are never even converted;
- the engine thread builds a frame from the latest samples and runs engine.step; its
  action chunk is handed to the player as soon as it exists, before language decoding. In
  a fleet it asks the planner (engine/fleet.py) which robots are due and runs step_fleet
  over those with a new observation;
- each robot's control thread asks the player what to publish at control_rate_hz. It sleeps to
  absolute deadlines instead of being an executor timer: on two cores a Python executor
  next to the model delayed timer callbacks by tens of ms (measured). Under use_sim_time
  control is a timer on the node's clock instead, so it follows /clock;
- the executor runs the lifecycle and parameter services, ~/prompt, ~/narrate, ~/ask (its
  goals are coroutines that never block it; ask.py holds the logic) and the diagnostics
  timer.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import sys
import threading
import time
import traceback

from rcl_interfaces.msg import (
    FloatingPointRange,
    IntegerRange,
    ParameterDescriptor,
    SetParametersResult,
)
from rclpy.lifecycle import LifecycleNode, TransitionCallbackReturn

from oxygen_ros.engine.ask import Asks
from oxygen_ros.robot.contract import Config, robot_config
from oxygen_ros.robot.inputs import problem_key
from oxygen_ros.robot.params import (
    BY_NAME,
    FLEET_BY_NAME,
    GROUP_PARAMS,
    LIMIT_PARAM,
    PARAMS,
    StartError,
    coerce,
    command_line_params,
    identifier,
    is_limit,
    read_robot_file,
    robot_key,
)
from oxygen_ros.robot.report import Reporter
from oxygen_ros.ros.robot_link import RobotLink

__all__ = ['OxygenNode', 'main', 'problem_key']

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
# After a fault outside a frame, the engine thread looks again only this much later (s), so
# a fault that repeats cannot spin a core.
FAULT_WAIT_S = 0.05


class RobotAsks:
    """The engine as one robot's ~/ask sees it: its questions are about that robot's frames."""

    def __init__(self, engine, robot: str):
        self.engine, self.robot = engine, robot

    def ask(self, question: str, max_new_tokens: int = 0, prompt_format: str = '') -> int:
        return self.engine.ask(question, max_new_tokens, prompt_format, robot=self.robot)

    def cancel(self, request_id: int):
        return self.engine.cancel(request_id)

    def withdraw(self, request_id: int) -> bool:
        return self.engine.withdraw(request_id)


class AskServers:
    """The ~/<robot>/ask servers of a fleet, closed and destroyed together."""

    def __init__(self, servers):
        self.servers = servers

    def close(self, spin_once, limit_s: float) -> int:
        end = time.monotonic() + limit_s
        return sum(s.close(spin_once, max(0.0, end - time.monotonic())) for s in self.servers)

    def destroy(self):
        for s in self.servers:
            s.destroy()


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
        self._lock = threading.Lock()
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
        self.cfg = self._read_params(argv)
        if self.fleet:
            self.links = [RobotLink(self, c, name=r, prefix=ns, private=f'~/{r}')
                          for r, (c, ns) in self.fleet.items()]
            for link in self.links:
                link.asks = Asks()
        else:
            self.links = [RobotLink(self, self.cfg, reporter=self.reporter)]
            self.links[0].asks = self.asks
        self.by_name = {link.name: link for link in self.links}
        self.add_on_set_parameters_callback(self._set_parameters)

    # -- parameters ------------------------------------------------------------------------

    def _declare(self, name: str, p, default=None):
        from rclpy.exceptions import ParameterUninitializedException

        # dynamic_typing: a YAML `70` for a float parameter is fine; types are checked by
        # params.coerce with a message that names the parameter.
        desc = ParameterDescriptor(description=p.description + _range_note(p),
                                   dynamic_typing=True, read_only=not p.live)
        high = p.high
        if p.type in ('int', 'int[]') and p.low is not None:
            desc.integer_range = [IntegerRange(from_value=int(p.low), to_value=int(
                2**31 - 1 if high is None else high))]
        elif p.type == 'float' and p.low is not None:
            desc.floating_point_range = [FloatingPointRange(from_value=float(p.low), to_value=(
                1e300 if high is None else float(high)))]
        # Our message, naming the rule broken, before rclpy's range check on the override.
        override = self._parameter_overrides.get(name)
        if override is not None:
            coerce(name, override.value, p)
        try:
            self.declare_parameter(name, p.default if default is None else default, desc)
            return self.get_parameter(name).value
        except ParameterUninitializedException:
            return None
        except Exception as e:  # rclpy's own range or type errors on an override
            raise StartError(f'parameter {name}: {e}') from None

    def _read_params(self, argv) -> Config:
        values = {p.name: self._declare(p.name, p) for p in PARAMS}
        groups = coerce('output_groups', values['output_groups'], BY_NAME['output_groups'])
        for g in groups:
            if not identifier(g):
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
        robots = coerce('robots', values['robots'], BY_NAME['robots'])
        if not robots:
            return Config.from_values(values)
        if len(set(robots)) != len(robots):
            raise StartError(f'robots lists a name twice: {robots}')
        for r in robots:
            self.fleet[r] = self._read_robot(r, values)
        # The node's own settings (engine, lifecycle) with the first robot's contract.
        return self.fleet[robots[0]][0]

    def _read_robot(self, robot: str, values: dict) -> tuple[Config, str]:
        """A robot's <robot>.* parameters over its robot file's over the node's."""
        own = {}
        for full in sorted(n for n in self._parameter_overrides if n.startswith(robot + '.')):
            name = full[len(robot) + 1:]
            if not robot_key(name):
                raise StartError(f'robot {robot}: {name} is not a robot parameter (the '
                                 'model and engine are the node\'s, shared by its robots)')
            if name.startswith('outputs.'):
                key = name.rpartition('.')[2]
                p = next((q for q in GROUP_PARAMS if q.name == key), None)
                if p is None:
                    raise StartError(f'robot {robot}: unknown parameter {name}')
            elif is_limit(name):
                p = LIMIT_PARAM
            else:
                p = FLEET_BY_NAME.get(name) or BY_NAME[name]
            own[name] = self._declare(full, p)
        path = own.get('robot_file') or ''
        file_values, shared = read_robot_file(robot, path) if path else ({}, [])
        if shared:
            self.log.info(f'robot {robot}: {path} also sets {", ".join(shared)}: the '
                          "node's values stand (its robots share them)")
        cfg = robot_config(robot, values, file_values, own)
        if 'prompt' not in own:  # settable while running, as the node's prompt is
            self._declare(f'{robot}.prompt', BY_NAME['prompt'], cfg.p['prompt'])
        return cfg, own.get('namespace') or robot

    def _set_parameters(self, params) -> SetParametersResult:
        try:
            return self._on_set_parameters(params)
        except Exception as e:  # the node's own fault: nothing may be left half applied
            self.fail(f'setting parameters {[p.name for p in params]} failed: '
                      f'{type(e).__name__}: {e}', traceback.format_exc())
            return SetParametersResult(successful=False, reason=f'internal error: {e}')

    def _on_set_parameters(self, params) -> SetParametersResult:
        checked = {}
        for param in params:
            robot, _, base = param.name.partition('.')
            links = getattr(self, 'by_name', {})
            if param.name in BY_NAME:
                # A node parameter is every robot's: each robot's contract must take it (a
                # horizon against its action period, a prompt against its state and limit).
                name, only = param.name, None
                cfgs = [(link.label(), link.cfg) for link in links.values()] if self.fleet \
                    else [('', self.cfg)]
            elif robot in self.fleet and robot in links:
                name, only = base, links[robot]
                cfgs = [('', only.cfg)]
            else:
                continue  # rclpy's own (use_sim_time), read-only ones, or before the links
            for label, cfg in cfgs:
                try:
                    value = cfg.check_live(name, param.value)
                except StartError as e:
                    reason = f'{label}{e}'
                    self.log.warning(f'parameter {param.name} not set: {reason}')
                    return SetParametersResult(successful=False, reason=reason)
            if name == 'command' and value:
                why = self._may_command([only] if only is not None else links.values())
                if why:
                    self.log.warning(f'parameter {param.name} not set: {why}')
                    return SetParametersResult(successful=False, reason=why)
            checked[param.name] = (name, value, only)
        for full, (name, value, only) in checked.items():
            self._apply(name, value, only, full)
        return SetParametersResult(successful=True)

    def _may_command(self, links) -> str | None:
        """Why shadow mode may not turn to commanding these robots now, or None. Inactive,
        nothing is checked: activating listens for other commanders itself."""
        if self.state != 'active':
            return None
        for link in links:
            if link.cfg.p['command']:
                continue
            why = link.shadow_problem()
            if why:
                return f'{link.label()}not commanding: {why}'
        return None

    def _apply(self, name: str, value, only=None, full: str = ''):
        links = self.links if only is None else [only]
        if name == 'command':
            for link in links:  # a single robot's Config is the node's: before that is set
                if link.cfg.p['command'] != value:
                    link.set_command(value)
            if only is None:
                self.cfg.p[name] = value
            self.log.info(f'parameter {full or name} = {value!r}: '
                          + ('commanding' if value else 'shadow mode, not commanding'))
            return
        with self._lock:
            if only is None:
                self.cfg.p[name] = value
            for link in links:
                link.cfg.p[name] = value
        for link in links:
            if name == 'prompt':
                link.set_prompt(value)
            elif name == 'report_period':
                link.reporter.period = value
            elif link.player is not None and name == 'max_command_horizon':
                link.player.horizon = value
            elif link.player is not None and name == 'play_steps':
                link.player.play_steps = value
        if name == 'report_period':
            self.reporter.period = value
        if only is not None:
            self.log.info(f'parameter {full} = {value!r}')
            return
        if self.engine is not None and name == 'temperature':
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
        for link in self.links:
            kind = link.cfg.p['robot']
            if cfg.random_weights and kind != 'identity' and not cfg.p['allow_random_weights']:
                msg = (f'refusing to activate: the {link.label()}{kind} robot would be driven '
                       'by RANDOM weights (no checkpoint). Set checkpoint, or '
                       'allow_random_weights: true for timing and simulation')
                self.log.error(msg)
                self.start_error = StartError(msg)
                return FAILURE
        busy = [t.name for t in self._stragglers if t.is_alive()]
        busy += [f'{link.label()}control' for link in self.links if link.busy()]
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
            check = cfg.p['commander_check']
            other = link.cfg.p['command'] and link.commanders(
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
            ('commanding ' if link.cfg.p['command'] else 'shadow mode, not commanding ')
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
        from oxygen_ros.engine import Engine, EngineConfig
        from oxygen_ros.model.tokenizer import prompt_tokens

        cfg = self.cfg
        self.reporter.period = cfg.p['report_period']
        settings = cfg.engine_settings()
        if self.fleet:
            settings['robots'] = len(self.links)
            # The frame budget of the robot whose chunks are shortest.
            settings['control_rate_hz'] = max(2.0 / link.cfg.action_period
                                              for link in self.links)
        try:
            self.engine = Engine(EngineConfig.from_dict(settings))
        except (ValueError, OSError) as e:
            raise StartError(f'cannot start the engine: {e}') from None
        except Exception as e:  # e.g. a corrupt safetensors file raises its own error type
            raise StartError(f'cannot start the engine: {type(e).__name__}: {e}') from None
        e = self.engine
        for link in self.links:
            link.cfg.sized_tokens = e.cfg.max_new_tokens
            # The engine's tokenizer and format, not the engine: cleanup frees the model.
            link.cfg.prompt_tokens = functools.partial(
                prompt_tokens, e.tokenizer, state_dim=link.cfg.profile.state_dim,
                prompt_format=e.cfg.prompt_format)
            link.cfg.max_token_len = e.model_cfg.max_token_len
            try:
                link.cfg.check_engine(e.slots, e.action_dim, e.state_dim,
                                      e.conventions == 'lerobot')
                why = link.cfg.check_prompt(link.cfg.p['prompt'])
                if why:
                    raise StartError(f'parameter prompt: {why}')
            except StartError as err:
                if not self.fleet:
                    raise
                raise StartError(f'robot {link.name}: {err}') from None
            if self.fleet:
                e.add_robot(link.name)
        self._setup_ros()
        if cfg.random_weights:
            weights = (f'model {cfg.p["model"] or "small"} with RANDOM weights (seed '
                       f'{cfg.p["seed"]}, no checkpoint): not a trained policy')
        else:
            w = e.weights
            weights = (f'{w["layout"]} checkpoint {cfg.p["checkpoint"]} ({e.conventions} '
                       f'conventions, normalisation {w["normalization"] or "off"}; tokenizer '
                       f'{e.tokenizer.source}, {e.tokenizer_from})')
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
            link.stop(HALT_S)
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
        from diagnostic_msgs.msg import DiagnosticArray

        from oxygen_ros.ros.ask_server import AskServer

        cfg = self.cfg
        for link in self.links:
            link.configure()
        from rclpy.clock import Clock, ClockType

        self.diag_pub = self.create_publisher(DiagnosticArray, '/diagnostics', 10)
        self._ros = [self.diag_pub,
                     self.create_timer(1.0 / cfg.p['diagnostics_rate_hz'], self._diagnose),
                     self.create_timer(WATCH_S, self._watch,
                                       clock=Clock(clock_type=ClockType.STEADY_TIME))]
        for link in self.links:
            link.on_fatal = self.fail
        for link in self.links:
            link.asks.max_open = cfg.p['max_open_questions']
            link.asks.timeout = cfg.p['question_timeout']
            link.asks.deactivate('configured, not yet activated')
        if self.fleet:
            self.ask_server = AskServers([AskServer(self, link.asks, f'~/{link.name}/ask')
                                          for link in self.links])
        else:
            self.ask_server = AskServer(self, self.asks)
        self._msgs = dict(DiagnosticArray=DiagnosticArray)

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    # -- engine thread ---------------------------------------------------------------------

    def _start_threads(self):
        sim = self.get_parameter('use_sim_time').value
        for link in self.links:
            link.start(sim)
        step = self._fleet_pass if self.fleet else self._pass
        self._threads = [threading.Thread(target=self._engine_thread, args=(self._stop, step),
                                          name='engine', daemon=True)]
        for t in self._threads:
            t.start()

    def _stopping(self, stop: threading.Event) -> bool:
        return stop.is_set() or not self.context.ok()

    def _engine_thread(self, stop: threading.Event, step):
        """Frames until ``stop``: ``step`` runs one pass and says how long to wait. What a
        pass does not handle itself (a robot's frame, its inputs, its outputs) is the node's
        own code failing: every robot holds and the node leaves commanding (fail)."""
        state = {}
        try:
            while not stop.is_set():
                wait = step(stop, state)
                if wait:
                    stop.wait(wait)
        except Exception as e:
            if not self._stopping(stop):
                self.fail(f'engine thread failed: {type(e).__name__}: {e}',
                          traceback.format_exc())

    def _pass(self, stop, _state) -> float:
        link = self.links[0]
        try:
            ready, wait = link.poll(self.engine.slots)
        except Exception as e:
            if self._stopping(stop):
                return 0.0
            link.fault(f'taking its inputs failed: {type(e).__name__}: {e}',
                       traceback.format_exc())
            return FAULT_WAIT_S
        if ready is None:
            return wait
        try:
            result = self.engine.step(
                ready.obs, narrate=ready.narrate,
                max_new_tokens=self.cfg.p['max_new_tokens'],
                on_actions=lambda a, t=ready.stamp, s=ready.state: link.on_actions(t, s, a),
                handover=ready.handover)
        except Exception as e:  # one bad frame must not end the node
            if not self._stopping(stop):
                link.failed(str(e))
            return 0.0
        self._finished(stop, link, ready, result)
        self._deliver(stop, link, result.events)
        return 0.0

    def _finished(self, stop, link, ready, result):
        """A robot's frame ended: count it. A failure here is the node's own, and holds that
        robot."""
        try:
            link.finished(ready, result)
        except Exception as e:
            if not self._stopping(stop):
                link.fault(f'ending its frame failed: {type(e).__name__}: {e}',
                           traceback.format_exc())

    def _deliver(self, stop, link, events):
        """A frame's events of one robot: question events to their goals, narration out."""
        try:
            unowned = link.asks.deliver(events)
        except Exception as e:
            if not self._stopping(stop):
                link.fault(f'delivering answers failed: {type(e).__name__}: {e}',
                           traceback.format_exc())
            return
        if unowned:
            link.reporter.report('ask:unowned', 'question events of requests '
                                 f'{sorted({ev.request_id for ev in unowned})} that no goal '
                                 'holds: not delivered')
        try:
            link.publish_events(events)
        except Exception as e:  # publishing fails once ROS is shutting down
            if not self._stopping(stop):
                link.reporter.report(problem_key('publish', str(e)),
                                     f'narration not sent: {e}')

    def _fleet_pass(self, stop, state) -> float:
        """Frames of several robots: the planner says which are due, each of those brings
        its newest observation, and one step_fleet serves them all. A robot that is stale,
        whose inputs are bad or whose frame fails holds; the others go on."""
        from oxygen_ros.engine import RobotInput
        from oxygen_ros.engine.fleet import Planner

        e = self.engine
        planner = state.get('planner')
        if planner is None:
            # Due with half a chunk to spare, as the engine's frame budget leaves half a
            # chunk for the next frame's latency: the estimate is of the model's part of a
            # frame only, and this machine's load and the image conversion come on top.
            spare = 0.5 * min(link.cfg.action_period for link in self.links) * e.action_horizon
            planner = state['planner'] = Planner(
                e.chunk_seconds, max(link.cfg.p['max_input_age'] for link in self.links),
                max_robots=len(self.links), margin=spare)
        by = self.by_name
        times, faulted = {}, False
        for link in self.links:
            try:
                times[link.name] = link.times()
            except Exception as err:
                faulted = True
                link.fault(f'taking its inputs failed: {type(err).__name__}: {err}',
                           traceback.format_exc())
        # Read after every robot's images were taken (which takes a while): an input that
        # came meanwhile must not look stamped ahead of the clock.
        now = self._now()
        plan = planner.plan(now, times)
        ready = {}
        for link in self.links:
            try:
                if link.name not in plan.take:
                    link.check(now)  # stale or missing inputs hold it
                    continue
                r, _ = link.poll(e.slots)
            except Exception as err:
                faulted = True
                link.fault(f'taking its inputs failed: {type(err).__name__}: {err}',
                           traceback.format_exc())
                continue
            if r is not None:
                ready[link.name] = r
        if not ready:
            # Nothing due: the plan's wait. Due robots whose images were not ready (poll
            # checks staleness at its own pace): look again soon.
            wait = planner.look if plan.take else plan.wait
            return max(wait, FAULT_WAIT_S) if faulted else wait
        inputs = {n: RobotInput(r.obs, narrate=r.narrate,
                                max_new_tokens=self.cfg.p['max_new_tokens'],
                                handover=r.handover)
                  for n, r in ready.items()}

        def on_actions(name, actions, ready=ready):
            r = ready[name]
            by[name].on_actions(r.stamp, r.state, actions)

        try:
            result = e.step_fleet(inputs, on_actions=on_actions)
        except Exception as err:  # one bad frame must not end the node
            if not self._stopping(stop):
                for n in ready:
                    by[n].failed(str(err))
            return 0.0
        for n, why in result.errors.items():
            by[n].failed(why)
        for n in ready:
            res = result.results.get(n)
            if res is not None:
                self._finished(stop, by[n], ready[n], res)
        # Events of robots not in this frame too: their requests decode in every frame.
        for n, events in result.events.items():
            if n in by:
                self._deliver(stop, by[n], events)
        return 0.0

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

    def _watch(self):
        """Steady-clock watchdog: a fault, or a thread that ended while active, takes the
        node through ErrorProcessing (on_deactivate returns ERROR)."""
        try:
            if self.state == 'inactive':
                for link in self.links:
                    link.heard()  # so that what is heard has its time when activating
            if self.state != 'active':
                return
            if self.fault is None:
                dead = [t.name for t in self._threads if not t.is_alive()]
                dead += [f'{link.label()}control' for link in self.links if link.dead()]
                if dead:
                    self.fail(f'the {", ".join(dead)} thread ended while active')
            if self.fault is not None:
                self._diagnose()  # the ERROR goes out before cleanup ends diagnostics
                self.trigger_deactivate()
                return
            # Questions whose frame does not come (the inputs are stale) end, saying so.
            for link in self.links:
                if link.asks.open_count:
                    link.asks.expire(time.monotonic(), link.waiting_for())
            # Another node commanding a robot: this one gives way (link.give_way); with no
            # robot left to command, the node deactivates.
            for link in self.links:
                if not link.cfg.p['command']:
                    link.heard()  # shadow mode: the operator's; heard when it was sent
                    continue
                other = link.commanders()
                if other:
                    link.give_way(other)
            if not any(link.active for link in self.links):
                self.log.error('every robot is commanded by another node: deactivating')
                self.trigger_deactivate()
        except Exception as e:  # the watchdog itself must not end the executor
            self.log.error(f'watchdog failed: {type(e).__name__}: {e}')

    # -- diagnostics -----------------------------------------------------------------------

    def summary(self, link=None) -> dict:
        """Everything /diagnostics reports (for one robot of a fleet), as plain numbers."""
        link = link or self.links[0]
        s = dict(self.engine.stats())
        if self.fleet:
            s.update(self.engine.robot_stats(link.name))
        s.update(link.summary(self.engine.action_horizon))
        s.update(link.asks.stats())
        s.update(link.counts())
        return s

    def _diagnose(self):
        try:
            arr = self._msgs['DiagnosticArray']()
            arr.header.stamp = self.get_clock().now().to_msg()
            arr.status = [self._status(link) for link in self.links]
        except Exception as e:  # an executor callback must not end the executor
            for link in self.links:
                link.fault(f'diagnostics failed: {type(e).__name__}: {e}',
                           traceback.format_exc())
            return
        try:
            self.diag_pub.publish(arr)
        except Exception:  # shutting down
            pass

    def _status(self, link):
        from diagnostic_msgs.msg import DiagnosticStatus, KeyValue

        s = self.summary(link)
        st = DiagnosticStatus()
        st.name = f'{self.get_name()}: ' + (link.name if self.fleet else 'inference')
        st.hardware_id = self.cfg.p['device']
        with link.lock:
            active = link.active
        level, st.message = link.status(s)
        if self.fault:
            level, st.message = 'ERROR', f'fault: {self.fault}'
        st.level = getattr(DiagnosticStatus, level)
        st.values = [KeyValue(key='active', value=str(active))]
        for k, v in s.items():
            st.values.append(KeyValue(key=k, value=f'{v:.3f}' if isinstance(v, float) else str(v)))
        st.values.append(KeyValue(key='last_hold', value=link.hold_reason))
        st.values.append(KeyValue(key='last_fault', value=self.fault or link.faulted))
        if link.reporter.recent:
            st.values.append(KeyValue(key='last_problem', value=link.reporter.recent[-1]))
        return st


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
