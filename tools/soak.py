#!/usr/bin/env python3
"""A long run of one node and a fleet of sim robots under abuse: does anything grow, slow
down or stop?

    source install/setup.bash
    python tools/soak.py [--minutes 30] [--robots 3] [--model tiny] [--out DIR]

One oxygen_node serves `--robots` oxygen_sim_robots (sim.yaml, namespaces r1, r2, ...; the
odd ones send raw images, the even ones JPEG on */compressed). Beside them this process:
- every second sends bad inputs on a robot's topics, rotating through kinds: unknown image
  encodings (a new random name each time, so each is a new text to the node), images whose
  buffer is short, images claiming 40000x40000 pixels, corrupt or truncated JPEG and PNG
  payloads, JointStates with NaN, with names the robot does not have, and with names and
  positions of different lengths;
- every 5 s sets a robot's prompt (~/prompt), now and then one too long;
- every 10 s floods a robot's ~/ask with 20 goals at once, and cancels some of them;
- every 10 s samples the node's resident memory (/proc/<pid>/status), every robot's
  /diagnostics (control rate, holds, faults, the problems its Reporter keeps, questions
  open and waiting, requests pending) and the trajectories received per robot.
It writes soak.json (the samples) and soak.png (RSS, control rates, Reporter keys, queues
over time), and prints the growth of RSS from the first ten minutes to the end and the
control rates' range.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hosts import stop  # noqa: E402
from node_load import config_dir, robot_params  # noqa: E402

KINDS = ('encoding', 'short', 'huge', 'jpeg', 'png', 'nan', 'names', 'lengths')


def rss_mb(pid: int) -> float:
    for line in Path(f'/proc/{pid}/status').read_text().splitlines():
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024.0
    return float('nan')


class Abuser:
    """Bad inputs, prompts and ~/ask floods on the fleet's topics, and what comes back."""

    def __init__(self, node, params, robots, compressed):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.action import ActionClient
        from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
        from sensor_msgs.msg import CompressedImage, Image, JointState
        from std_msgs.msg import String
        from trajectory_msgs.msg import JointTrajectory

        from oxygen_ros.action import Ask

        self.node, self.params, self.robots = node, params, robots
        self.Image, self.CompressedImage, self.JointState = Image, CompressedImage, JointState
        self.String, self.Ask = String, Ask
        best = qos_profile_sensor_data
        cam = params['camera_topics'][0]
        self.images = {r: node.create_publisher(Image, f'/{r}/{cam}', best) for r in robots}
        self.compressed = {r: node.create_publisher(CompressedImage, f'/{r}/{cam}/compressed',
                                                    best) for r in robots if r in compressed}
        self.joints = {r: node.create_publisher(JointState, f'/{r}/joint_states', best)
                       for r in robots}
        self.prompts = {r: node.create_publisher(String, f'/oxygen_node/{r}/prompt', 10)
                        for r in robots}
        self.asks = {r: ActionClient(node, Ask, f'/oxygen_node/{r}/ask') for r in robots}
        self.goals = []
        self.sent = {k: 0 for k in KINDS}
        self.arrivals = {r: 0 for r in robots}
        self.diag = {}
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        arm = params['outputs']['arm']['topic']
        for r in robots:
            node.create_subscription(JointTrajectory, f'/{r}/{arm}',
                                     lambda m, r=r: self._count(r), reliable)
        node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diag, 50)
        self.rng = random.Random(0)
        self.k = 0

    def _count(self, r):
        self.arrivals[r] += 1

    def _on_diag(self, msg):
        for st in msg.status:
            name, _, robot = st.name.partition(': ')
            if name == 'oxygen_node':
                self.diag[robot] = {kv.key: kv.value for kv in st.values}

    def _stamp(self):
        return self.node.get_clock().now().to_msg()

    def bad_input(self):
        """One bad message, the next kind in turn, on a robot taken in turn."""
        kind = KINDS[self.k % len(KINDS)]
        r = self.robots[self.k % len(self.robots)]
        self.k += 1
        self.sent[kind] += 1
        if kind in ('encoding', 'short', 'huge'):
            m = self.Image()
            m.header.stamp = self._stamp()
            m.height, m.width, m.encoding, m.step = 240, 320, 'rgb8', 960
            m.data = bytes(240 * 960)
            if kind == 'encoding':  # a new name every time: a new text to the node
                m.encoding = ''.join(self.rng.choices(string.ascii_lowercase + '%{}', k=12))
            elif kind == 'short':
                m.data = bytes(1000)
            else:
                m.height, m.width, m.step = 40000, 40000, 120000
            self.images[r].publish(m)
        elif kind in ('jpeg', 'png'):
            if r not in self.compressed:
                return
            m = self.CompressedImage()
            m.header.stamp = self._stamp()
            m.format = f'rgb8; {kind} compressed bgr8'
            head = b'\xff\xd8\xff\xe0' if kind == 'jpeg' else b'\x89PNG\r\n\x1a\n'
            m.data = head + bytes(self.rng.getrandbits(8) for _ in range(self.rng.randint(0,
                                                                                         300)))
            self.compressed[r].publish(m)
        else:
            m = self.JointState()
            m.header.stamp = self._stamp()
            joints = self.params['joints']
            if kind == 'nan':
                m.name, m.position = list(joints), [float('nan')] * len(joints)
            elif kind == 'names':
                m.name = [''.join(self.rng.choices(string.ascii_lowercase, k=8))
                          for _ in joints]
                m.position = [0.0] * len(joints)
            else:
                m.name, m.position = list(joints), [0.0]
            self.joints[r].publish(m)

    def prompt(self):
        r = self.rng.choice(self.robots)
        long = self.rng.random() < 0.2
        words = self.rng.choices(['pick', 'up', 'the', 'red', 'block', 'place', 'it', 'left',
                                  'cup', 'stack'], k=400 if long else self.rng.randint(2, 8))
        self.prompts[r].publish(self.String(data=' '.join(words)))

    def flood(self):
        r = self.rng.choice(self.robots)
        c = self.asks[r]
        if not c.server_is_ready():
            return
        for i in range(20):
            q = self.rng.choice(['is the block in the gripper?', 'what are you doing?',
                                 'x' * self.rng.randint(1, 3000)])
            self.goals.append(c.send_goal_async(self.Ask.Goal(question=q)))
            if i % 5 == 4:  # some are cancelled as soon as they are accepted
                self.goals[-1].add_done_callback(
                    lambda f: f.result().cancel_goal_async() if f.result().accepted else None)
        # Forget what has ended, so this process does not grow either.
        self.goals = [g for g in self.goals if not g.done()]


def plot(samples, robots, path: Path):
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    t = np.array([s['t'] for s in samples]) / 60.0
    fig, ax = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    ax[0].plot(t, [s['rss_mb'] for s in samples])
    ax[0].set_ylabel('node RSS, MB')
    for r in robots:
        ax[1].plot(t, [s['robots'][r]['received_hz'] for s in samples], label=f'{r} received')
        ax[1].plot(t, [s['robots'][r]['control_publish_hz'] for s in samples], ':',
                   label=f'{r} node says')
        ax[2].plot(t, [s['robots'][r]['problem_kinds'] for s in samples], label=r)
        ax[3].plot(t, [s['robots'][r]['questions_open'] for s in samples], label=f'{r} open')
        ax[3].plot(t, [s['robots'][r]['pending_requests'] for s in samples], ':',
                   label=f'{r} pending')
    ax[1].set_ylabel('trajectories/s')
    ax[2].set_ylabel('problem kinds kept')
    ax[3].set_ylabel('queues')
    ax[3].set_xlabel('minutes')
    for a in ax[1:]:
        a.legend(fontsize=7, ncol=3)
    for a in ax:
        a.grid(alpha=0.3)
    fig.suptitle('oxygen_node soak: a fleet under bad inputs, prompts and ~/ask floods')
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def number(v, default=0.0):
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--minutes', type=float, default=30.0)
    ap.add_argument('--robots', type=int, default=3)
    ap.add_argument('--model', default='tiny')
    ap.add_argument('--sample-s', type=float, default=10.0)
    ap.add_argument('--out', default='')
    a = ap.parse_args(argv)
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    out = Path(a.out or tempfile.mkdtemp(prefix='soak_'))
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_dir()
    robot_file = cfg / 'sim.yaml'
    params = robot_params(robot_file)
    robots = [f'r{i + 1}' for i in range(a.robots)]
    compressed = [r for i, r in enumerate(robots) if i % 2]
    tmp = out / 'run'
    tmp.mkdir(exist_ok=True)
    fleet = {'robots': robots, 'model': a.model, 'threads': 1, 'autostart': True,
             # The tiny model's 24 prompt tokens hold no pi05 prompt with an 8-d state.
             'prompt_format': 'subtask',
             'allow_random_weights': True, 'limit_hold_margin': 1000.0, 'report_period': 5.0,
             **{f'{r}.robot_file': str(robot_file) for r in robots},
             **{f'{r}.camera_transports': ['compressed', 'compressed'] for r in compressed}}
    (tmp / 'fleet.yaml').write_text(yaml.safe_dump({'/**': {'ros__parameters': fleet}}))
    env = dict(os.environ, PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1',
               ROS_DOMAIN_ID=os.environ.get('ROS_DOMAIN_ID', str(random.randint(100, 230))),
               FASTRTPS_DEFAULT_PROFILES_FILE=str(cfg / 'fastdds.xml'))
    env.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    ros = ['--ros-args', '--params-file', str(cfg / 'pi05.yaml'), '--params-file',
           str(robot_file)]
    logs = {n: open(tmp / f'{n}.log', 'w') for n in ('node', *robots)}
    node = subprocess.Popen([sys.executable, '-m', 'oxygen_ros.ros.node', *ros, '--params-file',
                             str(tmp / 'fleet.yaml')], stdout=logs['node'],
                            stderr=subprocess.STDOUT, env=env, cwd=tmp)
    sims = []
    for r in robots:
        extra = ['-p', 'image_transport:=compressed'] if r in compressed else []
        sims.append(subprocess.Popen([sys.executable, '-m', 'oxygen_ros.sim.sim_robot', *ros,
                                      '-r', f'__ns:=/{r}', *extra], stdout=logs[r],
                                     stderr=subprocess.STDOUT, env=env, cwd=tmp))
    os.environ.clear()
    os.environ.update(env)
    rclpy.init()
    me = rclpy.create_node('soak')
    abuse = Abuser(me, params, robots, compressed)
    ex = SingleThreadedExecutor()
    ex.add_node(me)
    samples = []
    try:
        end = time.monotonic() + 180
        while not all(abuse.arrivals.values()) and time.monotonic() < end:
            ex.spin_once(timeout_sec=0.1)
            if node.poll() is not None:
                raise SystemExit('the node ended:\n' + (tmp / 'node.log').read_text()[-3000:])
        start = time.monotonic()
        stop_at = start + a.minutes * 60
        due = dict(bad=start, prompt=start, flood=start, sample=start)
        last = dict(abuse.arrivals)
        last_t = start
        while time.monotonic() < stop_at and node.poll() is None:
            ex.spin_once(timeout_sec=0.02)
            now = time.monotonic()
            if now >= due['bad']:
                abuse.bad_input()
                due['bad'] += 1.0
            if now >= due['prompt']:
                abuse.prompt()
                due['prompt'] += 5.0
            if now >= due['flood']:
                abuse.flood()
                due['flood'] += 10.0
            if now >= due['sample']:
                due['sample'] += a.sample_s
                s = dict(t=now - start, rss_mb=rss_mb(node.pid), robots={})
                for r in robots:
                    d = abuse.diag.get(r, {})
                    s['robots'][r] = dict(
                        received_hz=(abuse.arrivals[r] - last[r]) / max(now - last_t, 1e-9),
                        **{k: number(d.get(k)) for k in (
                            'control_publish_hz', 'holds', 'faults', 'problem_kinds',
                            'questions_open', 'questions_waiting', 'pending_requests',
                            'active_requests', 'dropped_images', 'dropped_joint_states',
                            'rejected_prompts', 'missed_ticks')})
                last, last_t = dict(abuse.arrivals), now
                samples.append(s)
                print(f'{s["t"] / 60:5.1f} min  RSS {s["rss_mb"]:6.1f} MB  ' + '  '.join(
                    f'{r} {v["received_hz"]:4.1f} Hz keys {v["problem_kinds"]:.0f} '
                    f'open {v["questions_open"]:.0f} faults {v["faults"]:.0f}'
                    for r, v in s['robots'].items()), flush=True)
        alive = node.poll() is None
    finally:
        codes = stop([node, *sims], 20)
        ex.shutdown(timeout_sec=1)
        me.destroy_node()
        rclpy.try_shutdown()
        for f in logs.values():
            f.close()
    (out / 'soak.json').write_text(json.dumps(dict(
        minutes=a.minutes, robots=robots, compressed=compressed, model=a.model,
        bad_inputs_sent=abuse.sent, node_alive_at_end=alive, exit_codes=codes,
        samples=samples), indent=1))
    if samples:
        plot(samples, robots, out / 'soak.png')
        rss = np.array([s['rss_mb'] for s in samples])
        t = np.array([s['t'] for s in samples])
        early = rss[t <= min(600.0, t[-1])]
        print(f'RSS: {rss[0]:.1f} MB at the start, {early.max():.1f} MB at most in the first '
              f'{min(600.0, t[-1]) / 60:.0f} min, {rss[-1]:.1f} MB at the end '
              f'({rss.max():.1f} MB peak)')
        for r in robots:
            hz = np.array([s['robots'][r]['received_hz'] for s in samples[1:]] or [0.0])
            v = samples[-1]['robots'][r]
            print(f'{r}: received {hz.min():.1f}..{hz.max():.1f} Hz (median '
                  f'{np.median(hz):.1f}); holds {v["holds"]:.0f}, faults {v["faults"]:.0f}, '
                  f'problem kinds {v["problem_kinds"]:.0f}')
    print(f'bad inputs sent: {abuse.sent}; node alive at the end: {alive}; exit codes {codes}')
    print(f'written: {out / "soak.json"}, {out / "soak.png"}')


if __name__ == '__main__':
    main()
