"""oxygen_node as a robot sees it: the installed node as its own process, a fake robot of
this process's own (cameras, joint states) and what it receives back; the lifecycle user,
a simulated clock, and the checks of what a controller makes of the commands."""
import contextlib
import functools
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy')
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from lifecycle_msgs.msg import Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue  # noqa: E402
from rcl_interfaces.srv import GetParameters, SetParameters  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from rosgraph_msgs.msg import Clock  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from std_msgs.msg import Empty, String  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

import oxygen_ros.msg as msg_mod  # noqa: E402 (built by colcon; must import)
from support.process import node_env, rate, wait_for, write_params  # noqa: E402

ARM = [f'fr3_joint{i}' for i in range(1, 8)]


JOINTS = ARM + ['gripper']


RATE = 70.0


PARAMS = {
    'autostart': True, 'allow_random_weights': True,
    # Compiled, as a node runs by default: programs() builds the tiny model's before a test
    # starts a node. A test with other dims runs eagerly (compile: false), so that it builds
    # no programs of its own.
    'model': 'tiny', 'threads': 1, 'seed': 0, 'compile': True,
    'robot': 'droid', 'profile_options': '{velocity: true}',
    # Limits where a test is about them (test_node_limits); a real robot file has them.
    'allow_unlimited': True,
    'cameras': ['front', 'wrist'],
    'camera_topics': ['front/image', 'wrist/image'],
    'camera_slots': ['base_0_rgb', 'left_wrist_0_rgb'],
    'joint_topics': ['joint_states'],
    'joints': JOINTS,
    # The tiny model's 4-action chunk spans 0.4 s: enough slack for a shared 2-core machine.
    'action_rate_hz': 10.0,
    'control_rate_hz': RATE,
    'output_groups': ['arm', 'gripper'],
    'outputs': {
        'arm': {'topic': 'arm_controller/joint_trajectory', 'joints': ARM,
                'indices': list(range(7))},
        'gripper': {'topic': 'gripper_controller/joint_trajectory', 'joints': ['gripper'],
                    'indices': [7]},
    },
    'narration_every_n_frames': 5,
    'max_requests': 2, 'max_new_tokens': 8, 'decode_k': 2, 'admission': 'reject_newest',
    'max_input_age': 0.5, 'max_skew': 0.1,
    # Short, so a problem repeated by a later test is said again.
    'report_period': 1.0,
    'prompt': 'pick up the cup',
    # The tiny model's 24 prompt tokens hold no pi05 prompt with an 8-d state (its state
    # alone takes 32): the node refuses it.
    'prompt_format': 'subtask',
}


def image(w=64, h=48, stamp=None, encoding='rgb8'):
    m = Image()
    if stamp is not None:
        m.header.stamp = stamp
    m.height, m.width, m.encoding = h, w, encoding
    m.step = w * 3
    m.data = np.random.randint(0, 255, h * w * 3, dtype=np.uint8).tobytes()
    return m


def joint_state(stamp, names):
    m = JointState()
    m.header.stamp = stamp
    m.name = names
    m.position = [0.1 * i for i in range(len(names))]
    return m


# Liveness: within some WINDOW seconds at least LIVE (90%) of the trajectories
# control_rate_hz gives over it must arrive. A stalled node, a control loop at a fraction of
# its rate or one that keeps holding fails; the exact rate and its gaps are
# tools/node_load.py's.
WINDOW = 2.0


LIVE = 0.9


def arrival(entry):
    """The arrival time of an entry of a received list: (time, msg) pairs or bare times."""
    return entry[0] if isinstance(entry, tuple) else entry


def keeps_commanding(received, rate_hz, alive=lambda: True, window=WINDOW, timeout=30.0,
                     live=LIVE):
    """Whether, after the call, `received` gets at least `live` of `rate_hz` x `window`
    trajectories within some `window` seconds, before `timeout`. Counted over a sliding
    window, so a node still recovering from a hold when the call is made passes once it
    commands steadily; arrivals bunched by a slow receiver cannot make up a slow sender,
    which never gets the count together."""
    start = len(received)
    want = math.ceil(live * rate_hz * window)

    def met():
        t = np.array([arrival(x) for x in list(received)[start:]])
        return len(t) >= want and bool(np.any(t[want - 1:] - t[:len(t) - want + 1] <= window))

    return wait_for(lambda: not alive() or met(), timeout, step=0.1) and alive() and met()


# How much the delivery of two trajectories may differ in latency (s): where the node
# computed a hold, as seen from the arrival times.
JITTER = 0.03


def _along(sent, t):
    """(position, velocity) at t along one trajectory: (arrival, start, start velocity,
    msg) as joint_trajectory_controller interpolates it (aloha_sim's copy of its rules)."""
    from oxygen_ros.sim.aloha_sim import hermite

    t0, p, v, msg = sent
    for pt in msg.points:
        t1 = t0 + pt.time_from_start.sec + pt.time_from_start.nanosec * 1e-9
        q, w = np.array(pt.positions, float), np.array(pt.velocities, float)
        if t < t1:
            return hermite(max(t, t0), t0, p, v, t1, q, w)
        t0, p, v = t1, q, w
    return p, np.zeros_like(p)


def controller_setpoint(received, when, start, fresh_until=math.inf):
    """[(lowest, highest)] per joint of where the controller's setpoint is around `when`
    (within JITTER) along the trajectories `received` [(arrival, JointTrajectory)] of one
    controller that arrived before it, each started at the velocity of the one before from
    `start` (the fake robot's joints: the node starts a command's motion from a fresh
    reading) or, arriving after `fresh_until` (when the node's last good reading grew
    older than max_input_age), from the setpoint of the one before. None before the first
    trajectory."""
    spans = []
    for until in {fresh_until - JITTER, fresh_until + JITTER}:
        sent = None
        for at, m in received:
            if at >= when:
                break
            if sent is None:
                p, v = np.asarray(start, float), np.zeros(len(start))
            else:
                p, v = _along(sent, at)
                if at <= until:
                    p = np.asarray(start, float)
            sent = (at, p, v, m)
        if sent is None:
            return None
        spans += [_along(sent, t)[0] for t in np.linspace(when - JITTER, when + JITTER, 61)]
    seen = np.array(spans)
    return seen.min(axis=0), seen.max(axis=0)


def holds_at_setpoint(received, hold, start, fresh_until=math.inf, slack=1e-6):
    """Whether `hold` (arrival, JointTrajectory), one point at rest, targets where the
    controller's setpoint was when it arrived (controller_setpoint), not where the joints
    were last read."""
    at, m = hold
    if len(m.points) != 1 or any(m.points[0].velocities):
        return False
    span = controller_setpoint(received, at, start, fresh_until)
    q = np.array(m.points[0].positions)
    if span is None:  # nothing sent before: a hold at the reading
        return bool(np.allclose(q, start))
    return bool(np.all((span[0] - slack <= q) & (q <= span[1] + slack)))


def on_path(msg, joints, sent, start, rate=RATE, slack=1e-6):
    """Whether `msg` is a hold of `joints`: one point at rest one control period ahead,
    inside the box of `start` (where the fake robot reads them) and every point of the
    trajectories `sent` before it, where the controller's setpoint has been. A hold at an
    old or glitched reading, or anywhere else the arm never was, fails it."""
    if (len(msg.points) != 1 or list(msg.joint_names) != list(joints)
            or any(msg.points[0].velocities)
            or abs(msg.points[0].time_from_start.sec
                   + msg.points[0].time_from_start.nanosec * 1e-9 - 1 / rate) > 1e-6):
        return False
    seen = [np.asarray(start, float)] + [np.array(p.positions) for m in sent if m is not msg
                                         for p in m.points]
    q = np.array(msg.points[0].positions)
    return bool(np.all((np.min(seen, 0) - slack <= q) & (q <= np.max(seen, 0) + slack)))


class Robot:
    """Cameras at 30 Hz, joints at 50 Hz, knobs to break them, and everything received."""

    def __init__(self, node):
        self.node = node
        best = qos_profile_sensor_data
        self.cams = {'front': node.create_publisher(Image, '/remapped/front', best),
                     'wrist': node.create_publisher(Image, '/wrist/image', best)}
        self.joint_pub = node.create_publisher(JointState, '/joint_states', best)
        self.prompt = node.create_publisher(String, '/oxygen_node/prompt', 10)
        self.narrate = node.create_publisher(Empty, '/oxygen_node/narrate', 10)
        self.paused: set[str] = set()
        self.bad_image: dict[str, object] = {}  # camera -> fn(msg) -> broken msg, every 2nd
        self.lag: dict[str, float] = {}  # camera -> seconds its stamps lag behind
        self.bad_joints = None  # fn(msg) -> broken msg, every 2nd
        self.leave_out: set[str] = {'gripper'}  # joints not published (start-up test)
        self.same_images = False  # every image of a camera the same: the same model inputs
        self._fixed = {cam: image() for cam in self.cams}
        self.n = 0
        self.traj: list[tuple[float, JointTrajectory]] = []
        self.narration = []
        self.texts = []
        self.diag: dict[str, str] = {}
        self.diag_at = 0.0  # when the last report came
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, '/arm_controller/joint_trajectory',
                                 lambda m: self.traj.append((time.monotonic(), m)), reliable)
        node.create_subscription(msg_mod.Narration, '/oxygen_node/narration',
                                 self.narration.append, reliable)
        node.create_subscription(String, '/oxygen_node/narration/text',
                                 lambda m: self.texts.append(m.data), reliable)
        node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diag, 10)
        node.create_timer(1 / 30, self._images)
        node.create_timer(1 / 50, self._joints)
        self.params = node.create_client(SetParameters, '/oxygen_node/set_parameters')
        self.get_params = node.create_client(GetParameters, '/oxygen_node/get_parameters')

    def call(self, client, request, timeout=60):
        assert client.wait_for_service(timeout_sec=30), 'service not offered'
        future = client.call_async(request)
        assert wait_for(future.done, timeout), 'no answer'
        return future.result()

    def set_param(self, name, value):
        """The node's answer (SetParametersResult) to setting `name` over its service."""
        v = ParameterValue()
        if isinstance(value, bool):
            v.type, v.bool_value = ParameterType.PARAMETER_BOOL, value
        elif isinstance(value, int):
            v.type, v.integer_value = ParameterType.PARAMETER_INTEGER, value
        elif isinstance(value, float):
            v.type, v.double_value = ParameterType.PARAMETER_DOUBLE, value
        else:
            v.type, v.string_value = ParameterType.PARAMETER_STRING, value
        req = SetParameters.Request(parameters=[Parameter(name=name, value=v)])
        return self.call(self.params, req).results[0]

    def get_param(self, name):
        v = self.call(self.get_params, GetParameters.Request(names=[name])).values[0]
        return {ParameterType.PARAMETER_BOOL: v.bool_value,
                ParameterType.PARAMETER_INTEGER: v.integer_value,
                ParameterType.PARAMETER_DOUBLE: v.double_value,
                ParameterType.PARAMETER_STRING: v.string_value}[v.type]

    def _on_diag(self, msg):
        for st in msg.status:
            if st.name.startswith('oxygen_node'):
                self.diag = {kv.key: kv.value for kv in st.values}
                self.diag_at = time.monotonic()

    def fresh_diag(self, timeout=5.0):
        """A diagnostics report made after this call."""
        t = time.monotonic()
        assert wait_for(lambda: self.diag_at > t + 0.05, timeout), 'no diagnostics'
        return dict(self.diag)

    def _stamp(self, lag=0.0):
        return (self.node.get_clock().now() - rclpy.duration.Duration(seconds=lag)).to_msg()

    def _images(self):
        self.n += 1
        for cam, pub in self.cams.items():
            if cam in self.paused:
                continue
            m = image(stamp=self._stamp(self.lag.get(cam, 0.0)))
            if self.same_images:
                m.data = self._fixed[cam].data
            if cam in self.bad_image and self.n % 2:
                m = self.bad_image[cam](m)
            pub.publish(m)

    def _joints(self):
        m = joint_state(self._stamp(), [j for j in JOINTS if j not in self.leave_out])
        if self.bad_joints is not None and self.n % 2:
            m = self.bad_joints(m)
        self.joint_pub.publish(m)

    def lifecycle(self, node):
        """Clients of the node's lifecycle services, for transition() and state()."""
        self.change = node.create_client(ChangeState, '/oxygen_node/change_state')
        self.get = node.create_client(GetState, '/oxygen_node/get_state')

    def transition(self, label):
        req = ChangeState.Request()
        req.transition = Transition(label=label)
        return self.call(self.change, req).success

    def state(self):
        return self.call(self.get, GetState.Request()).current_state.label

    def rate(self, seconds):
        return rate(self.traj, seconds)


@functools.cache
def _programs(model: str, threads: int, cache: str | None):
    import torch

    from oxygen_ros.engine import random_model
    from oxygen_ros.engine.compiled import Programs
    from oxygen_ros.model import load_config

    m = random_model(load_config(model), torch.device('cpu'), torch.float32)
    Programs(m, cache, threads=threads).load()


def programs(params):
    """The compiled programs a node of `params` loads (random weights of a named model, as
    PARAMS), built here first where missing, into the cache the node reads: a model's first
    build (tens of seconds) takes longer than a test waits for its node to start. Once per
    test process; a node with a checkpoint or compile: false needs none."""
    if params.get('compile', True) and not params.get('checkpoint'):
        _programs(params['model'], params['threads'], params.get('compile_cache') or None)


@contextlib.contextmanager
def node_process(tmp, params, domain, name, make, *ros_args, program=('-m', 'oxygen_ros.ros.node'),
                 files=()):
    """The installed oxygen_node as its own process with `params`, and a node of ours built
    by `make(node)` and spun in a thread. Yields (process, what make built); `.log()` on
    the latter reads the node's output. `program`: what python runs instead of the node's
    module (a script that starts it); `files`: parameter files read before `params`."""
    programs(params)
    log_path = tmp / 'node.log'
    log = open(log_path, 'w')
    before = [a for f in files for a in ('--params-file', str(f))]
    proc = subprocess.Popen(
        [sys.executable, *program, '--ros-args', *before, '--params-file',
         write_params(tmp / 'params.yaml', params), *ros_args],
        stdout=log, stderr=subprocess.STDOUT, env=node_env(domain))
    os.environ['ROS_DOMAIN_ID'] = domain
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node(name, context=context)
    ours = make(node)
    ours.log = log_path.read_text
    ex = SingleThreadedExecutor(context=context)
    ex.add_node(node)
    threading.Thread(target=ex.spin, daemon=True).start()
    try:
        yield proc, ours
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        ex.shutdown(timeout_sec=1)
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        log.close()


def log_after(robot, mark):
    return robot.log()[mark:]


def expect_log(robot, mark, pattern, timeout=5.0):
    assert wait_for(lambda: re.search(pattern, log_after(robot, mark)), timeout), (
        f'no log line matching {pattern!r}:\n{log_after(robot, mark)[-3000:]}')


def assert_alive_and_commanding(robot, params=PARAMS):
    """`robot` (anything with traj, proc and log) gets new commands from its running node."""
    assert keeps_commanding(robot.traj, params['control_rate_hz'],
                            lambda: robot.proc.poll() is None), (
        f'not commanding at {LIVE:.0%} of {params["control_rate_hz"]:g} Hz or more:\n'
        f'{robot.log()[-3000:]}')


def run_node(tmp_path, domain, extra, timeout=60):
    programs(PARAMS)
    params = write_params(tmp_path / 'params.yaml', PARAMS)
    return subprocess.run(
        [sys.executable, '-m', 'oxygen_ros.ros.node', '--ros-args', '--params-file', params,
         *extra],
        capture_output=True, text=True, timeout=timeout, env=node_env(domain))


# max_input_age below the tiny model's 0.4 s chunk, so a stale input, not the end of the
# chunk, is what stops the robot.
LIFECYCLE = dict(PARAMS, autostart=False, publish_predicted=True, max_input_age=0.25)


# What the fake robot measures: joint i of JOINTS reads 0.1 * i.
MEASURED = {j: 0.1 * i for i, j in enumerate(JOINTS)}


class User(Robot):
    """The robot, plus what a user has: lifecycle and parameter services, the gripper and
    predicted-trajectory topics."""

    def __init__(self, node):
        super().__init__(node)
        self.leave_out = set()
        self.huge_gripper = False
        self.grip = []
        self.predicted = []
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, '/gripper_controller/joint_trajectory',
                                 lambda m: self.grip.append((time.monotonic(), m)), reliable)
        node.create_subscription(JointTrajectory, '/oxygen_node/predicted_trajectory',
                                 self.predicted.append, reliable)
        self.lifecycle(node)

    def _joints(self):
        names = [j for j in JOINTS if j not in self.leave_out]
        m = joint_state(self._stamp(), names)
        # Each joint reads its own value whichever others are left out. A gripper at 1e39 is
        # finite as float64 and infinite once the model casts the state to float32.
        m.position = [1e39 if self.huge_gripper and j == 'gripper' else MEASURED[j]
                      for j in names]
        self.joint_pub.publish(m)



def is_hold(msg, joints, sent):
    """One point at rest where the controller's setpoint can be (on_path)."""
    return on_path(msg, joints, sent, [MEASURED[j] for j in joints])


def after(received, t):
    return [m for at, m in list(received) if at >= t]


class Simulation:
    """Publishes /clock and sensors stamped in simulated time, which runs at `speed` x the
    wall clock (0 = paused: no clock ticks and no sensor data, as a paused simulator)."""

    def __init__(self, node, ns=''):
        self.node = node
        self.sim = 1000.0
        self.speed = 1.0
        self._wall = time.monotonic()
        self._lock = threading.Lock()
        self.clock = node.create_publisher(Clock, '/clock', 10)
        best = qos_profile_sensor_data
        self.cams = [node.create_publisher(Image, f'{ns}/{c}/image', best)
                     for c in ('front', 'wrist')]
        self.joints = node.create_publisher(JointState, f'{ns}/joint_states', best)
        self.traj = []
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, f'{ns}/arm_controller/joint_trajectory',
                                 lambda m: self.traj.append(time.monotonic()), reliable)
        node.create_timer(1 / 200, self._tick_clock)
        node.create_timer(1 / 30, self._images)
        node.create_timer(1 / 50, self._joints)

    def now(self):
        with self._lock:
            wall = time.monotonic()
            self.sim += (wall - self._wall) * self.speed
            self._wall = wall
            return self.sim

    def set_speed(self, speed):
        self.now()
        self.speed = speed

    def _stamp(self):
        t = self.now()
        return rclpy.time.Time(seconds=t).to_msg()

    def _tick_clock(self):
        if self.speed:
            self.clock.publish(Clock(clock=self._stamp()))

    def _images(self):
        if self.speed:
            for pub in self.cams:
                pub.publish(image(stamp=self._stamp()))

    def _joints(self):
        if self.speed:
            self.joints.publish(joint_state(self._stamp(), JOINTS))

    def rate(self, seconds):
        return rate(self.traj, seconds)


# The fake robot measures arm joint i at 0.1 * i and never moves. The DROID velocity profile
# commands q + 0.2 v per action, so a range of +-0.001 around the measured position and
# 0.005/s are left by nearly any action of a random model: clamping is all but certain.
SPEED = 0.005


LIMITS = {j: {'lower': 0.1 * i - 0.001, 'upper': 0.1 * i + 0.001, 'velocity': SPEED}
          for i, j in enumerate(ARM)}
