#!/usr/bin/env python3
"""oxygen_node under a real robot's input load, judged by an independent trajectory checker.

    source install/setup.bash
    python tools/node_load.py --setup aloha [--seconds 60]   # ALOHA: 4 cams 640x480 rgb8
                                                             # at 60 Hz, 2 JointStates at 500 Hz
    python tools/node_load.py --setup sim                    # the default sim (sim.yaml)
    python tools/node_load.py --setup sim --questions 4      # with 4 ~/ask goals in flight
    python tools/node_load.py --setup fleet --robots 3       # one node, 3 sim robots in
                                                             # namespaces r1..r3

Three processes, as on a robot: the node, the robot side (a load generator publishing
pre-built messages for `aloha`, oxygen_sim_robot for `sim`) and this one, which only
listens. Every trajectory on every output topic is checked against the acceptance rules of
joint_trajectory_controller (Jazzy); counting starts `--warmup` seconds after the first
trajectory, so model loading is not held against the rates. Prints, per topic: rate, p99
and max gap, rejected messages with the reasons; and from the node's /diagnostics over the
same window: hold ticks, skipped frames, frames, missed ticks. With `--questions N` this
process also keeps N ~/ask goals in flight (each sent again as soon as its result comes) from
the warm-up on, and counts the results of the window by reason. With `--setup fleet` one
node serves `--robots` sim robots (sim.yaml each, in namespaces r1, r2, ...); halfway through
the window the last robot's cameras stop (its sim robot's publish_images), and the window is
judged in two halves: every robot before, and after the stop the others at full rate and the
stopped one holding.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from oxygen_ros.robot.share import config_dir

ROOT = Path(__file__).resolve().parents[1]


def robot_params(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    return doc['/**']['ros__parameters']


# The checker: joint_trajectory_controller's acceptance rules (oxygen_ros/sim/jtc.py).
from oxygen_ros.sim.jtc import jtc_problems  # noqa: E402, F401

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hosts import stop  # noqa: E402


class Checker:
    """Every trajectory of each robot's output topics (robot '' is a node's only robot;
    fleet robots are in namespaces of their names), and the node's diagnostics per robot."""

    def __init__(self, node, params: dict, robots=('',)):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from trajectory_msgs.msg import JointTrajectory

        self.node = node
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self.topics = {}
        self.arrivals = {}
        self.rejected = {}
        self.counting = False
        self.first = None
        self.diag = {}  # robot -> its status values
        for r in robots:
            for g in params['output_groups']:
                out = params['outputs'][g]
                key = f'{r}/{g}' if r else g
                self.topics[key] = out['joints']
                self.arrivals[key] = []
                self.rejected[key] = {}
                topic = f'/{r}/{out["topic"]}' if r else out['topic']
                node.create_subscription(JointTrajectory, topic,
                                         lambda m, k=key: self._on_traj(k, m), reliable)
        node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diag, 10)

    def _on_traj(self, key, msg):
        t = time.monotonic()
        if self.first is None:
            self.first = t
        if not self.counting:
            return
        self.arrivals[key].append(t)
        for why in jtc_problems(msg, self.topics[key], self.node.get_clock().now().nanoseconds
                                * 1e-9):
            self.rejected[key][why] = self.rejected[key].get(why, 0) + 1

    def _on_diag(self, msg):
        # 'oxygen_node: inference' for one robot, 'oxygen_node: <robot>' in a fleet.
        for st in msg.status:
            name, _, robot = st.name.partition(': ')
            if name == 'oxygen_node':
                self.diag[robot if robot != 'inference' else ''] = {
                    kv.key: kv.value for kv in st.values}


class Questions:
    """Keeps `n` ~/ask goals of the node in flight: each is sent again when it ends."""

    def __init__(self, node, n: int):
        from rclpy.action import ActionClient

        from oxygen_ros.action import Ask

        self.client = ActionClient(node, Ask, '/oxygen_node/ask')
        self.goal = Ask.Goal(question='is the cup in the gripper?')
        self.n = n
        self.goals = []  # per goal: the send future, then its result future
        self.counting = False
        self.reasons = {}
        self.tokens = 0

    def top_up(self):
        still = []
        for g in self.goals:
            if len(g) == 1 and g[0].done():
                g.append(g[0].result().get_result_async())
            if len(g) == 2 and g[1].done():
                r = g[1].result().result
                if self.counting:
                    self.reasons[r.reason] = self.reasons.get(r.reason, 0) + 1
                    self.tokens += r.tokens
            else:
                still.append(g)
        self.goals = still
        while len(self.goals) < self.n:
            self.goals.append([self.client.send_goal_async(self.goal)])


# -- the robot side for --setup aloha -------------------------------------------------------

def load(params_file: str, cam_hz: float, joint_hz: float, width: int, height: int,
         image_qos: str):
    """Four cameras and two JointState topics from pre-built messages (only stamps change),
    so the load generator spends as little as possible of the shared CPU."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from sensor_msgs.msg import Image, JointState

    # The RealSense driver publishes images reliable (depth 1 here: only the newest counts).
    cam_qos = (qos_profile_sensor_data if image_qos == 'best_effort' else
               QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE))

    p = robot_params(Path(params_file))
    rclpy.init()
    node = rclpy.create_node('aloha_load')
    cams = ['cam_high', 'cam_low', 'cam_left_wrist', 'cam_right_wrist']
    images = []
    rng = np.random.default_rng(0)
    for c in cams:
        m = Image()
        m.header.frame_id = c
        m.height, m.width, m.encoding, m.step = height, width, 'rgb8', width * 3
        m.data = rng.integers(0, 255, height * width * 3, dtype=np.uint8).tobytes()
        images.append((node.create_publisher(Image, f'{c}/camera/color/image_rect_raw',
                                             cam_qos), m))
    arm = ['waist', 'shoulder', 'elbow', 'forearm_roll', 'wrist_angle', 'wrist_rotate',
           'gripper', 'left_finger', 'right_finger']
    joints = []
    for topic in p['joint_topics']:
        m = JointState()
        m.name = arm
        m.position = [0.0] * 6 + [0.5, 0.04, -0.04]
        m.velocity = [0.0] * len(arm)
        m.effort = [0.0] * len(arm)
        joints.append((node.create_publisher(JointState, topic, qos_profile_sensor_data), m))

    def publish(pairs):
        stamp = node.get_clock().now().to_msg()
        for pub, m in pairs:
            m.header.stamp = stamp
            pub.publish(m)

    node.create_timer(1.0 / cam_hz, lambda: publish(images))
    node.create_timer(1.0 / joint_hz, lambda: publish(joints))
    ex = SingleThreadedExecutor()
    ex.add_node(node)
    try:
        ex.spin()
    except Exception:  # SIGINT/SIGTERM
        pass
    finally:
        rclpy.try_shutdown()


# -- the run -------------------------------------------------------------------------------

def stats(arrivals: list[float], start: float, end: float) -> dict:
    """Rate and gaps of the arrivals in [start, end); the gaps include the window's edges,
    so a topic that stops shows the silence."""
    got = [t for t in arrivals if start <= t < end]
    gaps = np.diff([start, *got, end])
    return dict(rate_hz=len(got) / (end - start), messages=len(got),
                gap_ms_p99=float(np.percentile(gaps, 99) * 1e3),
                gap_ms_max=float(gaps.max() * 1e3))


def set_param(node, ex, service: str, name: str, value: bool):
    """Set one bool parameter of another node; True when it was accepted."""
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters

    client = node.create_client(SetParameters, service)
    try:
        if not client.wait_for_service(timeout_sec=10):
            return False
        fut = client.call_async(SetParameters.Request(parameters=[Parameter(
            name=name, value=ParameterValue(type=ParameterType.PARAMETER_BOOL,
                                            bool_value=value))]))
        end = time.monotonic() + 10
        while not fut.done() and time.monotonic() < end:
            ex.spin_once(timeout_sec=0.05)
        return fut.done() and fut.result().results[0].successful
    finally:
        node.destroy_client(client)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--setup', choices=('aloha', 'sim', 'fleet'), default='aloha')
    ap.add_argument('--robots', type=int, default=3, help='sim robots of --setup fleet')
    ap.add_argument('--seconds', type=float, default=60.0)
    ap.add_argument('--warmup', type=float, default=10.0)
    ap.add_argument('--model', default='small')
    ap.add_argument('--cam-hz', type=float, default=60.0)
    ap.add_argument('--joint-hz', type=float, default=500.0)
    ap.add_argument('--size', default='640x480', help='camera image WxH (aloha)')
    ap.add_argument('--camera-qos', choices=('reliable', 'best_effort'), default='reliable',
                    help='how the load publishes images (RealSense: reliable)')
    ap.add_argument('--dds-profile', default=str(config_dir() / 'fastdds.xml'),
                    help="Fast DDS profile for every process ('' = Fast DDS defaults)")
    ap.add_argument('--out', help='write the numbers as JSON here')
    ap.add_argument('--node-arg', action='append', default=[],
                    help='extra -p name:=value for the node (repeatable)')
    ap.add_argument('--questions', type=int, default=0,
                    help='~/ask goals kept in flight from the warm-up on')
    ap.add_argument('--role', default='', help=argparse.SUPPRESS)
    ap.add_argument('--params', default='', help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    w, h = (int(x) for x in a.size.split('x'))
    if a.role == 'load':
        return load(a.params, a.cam_hz, a.joint_hz, w, h, a.camera_qos)

    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    cfg = config_dir()
    robot_file = cfg / ('aloha.yaml' if a.setup == 'aloha' else 'sim.yaml')
    params = robot_params(robot_file)
    if a.setup == 'fleet' and a.robots < 1:
        raise SystemExit('--robots must be >= 1')
    robots = [f'r{i + 1}' for i in range(a.robots)] if a.setup == 'fleet' else ['']
    tmp = Path(tempfile.mkdtemp(prefix='node_load_'))
    extra = tmp / 'extra.yaml'
    # Random weights command far outside ALOHA's joint limits, and the node would hold on
    # them; a margin of 1000 ranges clamps instead, so the load of commanding is measured
    # (every point is still limited).
    extra.write_text(yaml.safe_dump({'/**': {'ros__parameters': {
        'model': a.model, 'device': 'cpu', 'threads': 1, 'autostart': True,
        'allow_random_weights': True, 'limit_hold_margin': 1000.0}}}))
    if a.setup == 'fleet':  # every robot on sim.yaml, in the namespace of its name
        fleet = {'robots': robots, **{f'{r}.robot_file': str(robot_file) for r in robots}}
        (tmp / 'fleet.yaml').write_text(yaml.safe_dump({'/**': {'ros__parameters': fleet}}))
    env = dict(os.environ, PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1',
               ROS_DOMAIN_ID=os.environ.get('ROS_DOMAIN_ID', str(np.random.randint(100, 230))))
    env.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    if a.dds_profile:
        env['FASTRTPS_DEFAULT_PROFILES_FILE'] = a.dds_profile
    else:
        env.pop('FASTRTPS_DEFAULT_PROFILES_FILE', None)
    node_args = [x for p in a.node_arg for x in ('-p', p)]
    # As pi05.launch.py layers them: model and engine, then the robot, then overrides.
    ros = ['--ros-args', '--params-file', str(cfg / 'pi05.yaml'), '--params-file',
           str(robot_file), '--params-file', str(extra)]
    fleet_args = ['--params-file', str(tmp / 'fleet.yaml')] if a.setup == 'fleet' else []
    logs = {n: open(tmp / f'{n}.log', 'w') for n in ('node', *(f'robot{r}' for r in robots))}
    node = subprocess.Popen([sys.executable, '-m', 'oxygen_ros.ros.node', *ros, *fleet_args,
                             *node_args],
                            stdout=logs['node'], stderr=subprocess.STDOUT, env=env, cwd=tmp)
    if a.setup == 'aloha':
        robot_cmd = [sys.executable, str(Path(__file__).resolve()), '--role', 'load',
                     '--params', str(robot_file),
                     '--cam-hz', str(a.cam_hz), '--joint-hz', str(a.joint_hz), '--size', a.size,
                     '--camera-qos', a.camera_qos]
    else:
        robot_cmd = [sys.executable, '-m', 'oxygen_ros.sim.sim_robot', *ros]
    # cwd: not the source tree, whose oxygen_ros lacks the generated messages.
    sims = [subprocess.Popen(robot_cmd + (['-r', f'__ns:=/{r}'] if r else []),
                             stdout=logs[f'robot{r}'], stderr=subprocess.STDOUT, env=env,
                             cwd=tmp) for r in robots]
    procs = [node, *sims]

    os.environ.clear()
    os.environ.update(env)
    rclpy.init()
    listener = rclpy.create_node('node_load_checker')
    checker = Checker(listener, params, robots)
    questions = Questions(listener, a.questions) if a.questions else None
    ex = SingleThreadedExecutor()
    ex.add_node(listener)
    result = {}
    try:
        end = time.monotonic() + 180
        while checker.first is None and time.monotonic() < end and node.poll() is None:
            ex.spin_once(timeout_sec=0.1)
        if checker.first is None:
            log = (tmp / 'node.log').read_text()
            raise SystemExit(f'no trajectory within 180 s:\n{log[-3000:]}')
        if questions and not questions.client.wait_for_server(timeout_sec=30):
            raise SystemExit('no ~/ask action server')

        def spin():
            ex.spin_once(timeout_sec=0.05)
            if questions:
                questions.top_up()
        end = time.monotonic() + a.warmup
        while time.monotonic() < end:
            spin()
        before = {r: dict(v) for r, v in checker.diag.items()}
        checker.counting = True
        if questions:
            questions.counting = True
        start = time.monotonic()
        stop_at = start + a.seconds / 2 if a.setup == 'fleet' else math.inf
        stopped = None
        while time.monotonic() < start + a.seconds:
            spin()
            if stopped is None and time.monotonic() >= stop_at:
                stopped = time.monotonic()
                if not set_param(listener, ex, f'/{robots[-1]}/oxygen_sim_robot/set_parameters',
                                 'publish_images', False):
                    raise SystemExit(f'could not stop the cameras of {robots[-1]}')
        checker.counting = False
        if questions:
            questions.counting = False
        span = time.monotonic() - start
        # The next diagnostics report closes the window.
        seen = checker.diag.get(robots[0])
        end = time.monotonic() + 3
        while checker.diag.get(robots[0]) is seen and time.monotonic() < end:
            ex.spin_once(timeout_sec=0.05)
        after = {r: dict(v) for r, v in checker.diag.items()}
    finally:
        codes = stop(procs, 20)
        ex.shutdown(timeout_sec=1)
        listener.destroy_node()
        rclpy.try_shutdown()
        for f in logs.values():
            f.close()

    def delta(r, key):
        try:
            return int(after[r][key]) - int(before.get(r, {}).get(key, 0))
        except (KeyError, ValueError):
            return None

    period_ms = 1e3 / 70.0
    end = start + span
    result = dict(setup=a.setup, model=a.model, seconds=round(span, 2), topics={},
                  node_exit=codes[0], questions=a.questions, robots={})
    print(f'{a.setup} load, model {a.model}, {span:.1f} s after {a.warmup:g} s warm-up, '
          f'{a.questions} ~/ask goals in flight, DDS profile {a.dds_profile or "none"} '
          '(shared machine: timings are noisy)')
    # Fleet: each half of the window on its own; the last robot's cameras stop halfway.
    windows = [('', start, end)] if stopped is None else [
        ('before the stop', start, stopped), ('after the stop', stopped, end)]
    for label, t0, t1 in windows:
        if label:
            print(f'  {label} ({t1 - t0:.1f} s; {robots[-1]} cameras stopped):'
                  if 'after' in label else f'  {label} ({t1 - t0:.1f} s):')
        for g in checker.topics:
            st = stats(checker.arrivals[g], t0, t1)
            rej = {}
            if not label or 'after' in label:  # rejections counted over the whole window
                rej = checker.rejected[g]
                st['rejected'] = sum(rej.values())
                st['reasons'] = rej
            result['topics'][f'{g} {label}'.strip()] = st
            print(f'    {g:20s} {st["rate_hz"]:6.1f} Hz  p99 gap {st["gap_ms_p99"]:7.1f} ms '
                  f'({st["gap_ms_p99"] / period_ms:.2f} periods)  max {st["gap_ms_max"]:7.1f} '
                  'ms' + (f'  rejected {st["rejected"]}' if 'rejected' in st else '')
                  + (f' {rej}' if rej else ''))
    if stopped is not None:
        last = robots[-1]
        heard = [t for g in checker.topics if g.startswith(last + '/')
                 for t in checker.arrivals[g] if t >= stopped]
        result['stopped_robot'] = last
        result['last_trajectory_after_stop_ms'] = (max(heard) - stopped) * 1e3 if heard else 0
        print(f'  {last}: last trajectory {result["last_trajectory_after_stop_ms"]:.0f} ms '
              'after its cameras stopped')
    for r in robots:
        res = {}
        for key in ('hold_ticks', 'skipped_frames', 'frames', 'missed_ticks', 'holds',
                    'dropped_images', 'dropped_joint_states'):
            res[key] = delta(r, key)
        got = after.get(r, {})
        res['control_publish_hz'] = float(got.get('control_publish_hz', 'nan'))
        for key in ('frame_ms_p50', 'frame_ms_p99', 'action_latency_ms_p50',
                    'action_latency_ms_p99', 'chunk_interval_ms_p99', 'chunk_ms', 'last_hold'):
            res[key] = got.get(key)
        result['robots'][r] = res
        who = f'node ({r})' if r else 'node'
        print(f'  {who}: ' + ', '.join(f'{k} {res[k]}' for k in (
            'hold_ticks', 'skipped_frames', 'frames', 'missed_ticks', 'holds')) +
            f', exit code {codes[0]}')
        print(f'  {who} (last 500 frames): ' + ', '.join(f'{k} {res[k]}' for k in (
            'frame_ms_p50', 'frame_ms_p99', 'action_latency_ms_p50', 'action_latency_ms_p99',
            'chunk_interval_ms_p99', 'chunk_ms')))
        if res['last_hold']:
            print(f'  {who} last hold: {res["last_hold"]}')
    if robots == ['']:  # the single-robot JSON as before
        result.update(result.pop('robots')[''])
    if questions:
        result['question_results'] = questions.reasons
        result['question_tokens'] = questions.tokens
        print(f'  questions ended in the window: {questions.reasons}, '
              f'{questions.tokens} tokens')
    print(f'  logs: {tmp}')
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == '__main__':
    main()
