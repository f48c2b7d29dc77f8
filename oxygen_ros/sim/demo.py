"""Run oxygen_node against the simulated robot for a while and say how it went.

    python -m oxygen_ros.sim.demo [--seconds 20] [--model small] [--params config/sim.yaml]

The node and the robot run as two processes (as on a real robot, so neither steals the
other's interpreter); this process only listens. Counting starts at the first trajectory,
so model loading is not held against the rates.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from oxygen_ros.robot.share import config_dir


def first_group_topic(params_file: Path) -> str:
    with open(params_file) as f:
        doc = yaml.safe_load(f)
    for section in doc.values():
        p = section.get('ros__parameters', {})
        if p.get('output_groups'):
            return p['outputs'][p['output_groups'][0]]['topic']
    raise ValueError(f'{params_file} names no output_groups')


class Monitor:
    def __init__(self, node, trajectory_topic: str):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from trajectory_msgs.msg import JointTrajectory

        from oxygen_ros.msg import Narration

        reliable = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
        self.arrivals: list[float] = []
        self.tokens: dict[int, int] = {}
        self.texts: list[str] = []
        self.diagnostics: dict[str, str] = {}
        self.frame_counts: list[tuple[float, int]] = []
        self.started = None
        node.create_subscription(JointTrajectory, trajectory_topic, self._on_traj, reliable)
        node.create_subscription(Narration, 'oxygen_node/narration', self._on_narration,
                                 reliable)
        node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diag, 10)

    def _on_traj(self, _msg):
        t = time.monotonic()
        if self.started is None:
            self.started = t
        self.arrivals.append(t)

    def _on_narration(self, msg):
        if self.started is None:
            return
        self.tokens[msg.request_id] = max(self.tokens.get(msg.request_id, 0), msg.tokens)
        if msg.done and msg.text:
            self.texts.append(msg.text)

    def _on_diag(self, msg):
        for st in msg.status:
            if st.name.startswith('oxygen_node'):
                self.diagnostics = {kv.key: kv.value for kv in st.values}
                if self.started is not None and 'frames' in self.diagnostics:
                    self.frame_counts.append((time.monotonic(), int(self.diagnostics['frames'])))


def require_messages():
    if importlib.util.find_spec('oxygen_ros.msg') is None:
        sys.exit('demo: oxygen_ros.msg is missing; build with colcon, source install/setup.bash '
                 'and run outside the source tree (make demo does all three)')


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    require_messages()
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--seconds', type=float, default=20.0, help='how long to measure')
    ap.add_argument('--model', default='small', help='tiny, small, pi05 or a YAML path')
    ap.add_argument('--params', default=None, help='robot parameters (default: config/sim.yaml)')
    ap.add_argument('--startup-timeout', type=float, default=120.0)
    args = ap.parse_args(argv)

    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    params = Path(args.params) if args.params else config_dir() / 'sim.yaml'
    topic = first_group_topic(params)
    env = dict(os.environ)
    py = sys.executable
    ros = ['--ros-args', '--params-file', str(params)]
    # `python -m` puts the working directory first on the path: from a source checkout's
    # root the sources, which lack the generated oxygen_ros.msg, would shadow the installed
    # package. The children run elsewhere.
    away = tempfile.gettempdir()
    procs = {
        'sim robot': subprocess.Popen([py, '-m', 'oxygen_ros.sim.sim_robot', *ros], env=env,
                                      cwd=away),
        'node': subprocess.Popen([py, '-m', 'oxygen_ros.ros.node', *ros,
                                  '-p', f'model:={args.model}'], env=env, cwd=away),
    }
    rclpy.init()
    node = rclpy.create_node('oxygen_demo_monitor')
    mon = Monitor(node, topic)
    ex = SingleThreadedExecutor()
    ex.add_node(node)
    code = 0
    try:
        deadline = time.monotonic() + args.startup_timeout
        while mon.started is None:
            ex.spin_once(timeout_sec=0.1)
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                print(f'demo: no trajectories ({", ".join(dead) or "timeout"})', file=sys.stderr)
                code = 1
                break
        print(f'demo: trajectories flowing on {topic}; measuring {args.seconds:g} s', flush=True)
        end = time.monotonic() + args.seconds
        while code == 0 and time.monotonic() < end:
            ex.spin_once(timeout_sec=0.1)
        # One more diagnostics message so the node's own numbers cover the whole window.
        until = time.monotonic() + 1.2
        while code == 0 and time.monotonic() < until:
            ex.spin_once(timeout_sec=0.1)
    except KeyboardInterrupt:
        code = 130
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for name, p in procs.items():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                print(f'demo: {name} did not stop on SIGINT; killing it', file=sys.stderr)
                p.kill()
        node.destroy_node()
        rclpy.try_shutdown()
    if code == 0:
        report(mon, args)
    sys.exit(code)


def report(mon: Monitor, args):
    t = [x for x in mon.arrivals if x <= mon.started + args.seconds]
    span = args.seconds
    gaps = np.diff(t) * 1e3 if len(t) > 1 else np.zeros(1)
    tokens = sum(mon.tokens.values())
    d = collections.defaultdict(lambda: '?', mon.diagnostics)
    fc = mon.frame_counts
    fps = (fc[-1][1] - fc[0][1]) / (fc[-1][0] - fc[0][0]) if len(fc) > 1 else float('nan')
    print(f'\n== oxygen_ros demo: model {args.model}, {span:g} s')
    print(f'control publish rate   {len(t) / span:6.1f} Hz  (trajectory messages received)')
    print(f'gap between publishes  p50 {np.percentile(gaps, 50):.1f} ms, '
          f'p99 {np.percentile(gaps, 99):.1f} ms, max {gaps.max():.1f} ms')
    print(f'narration              {tokens / span:6.1f} tokens/s, {len(mon.texts)} finished')
    print(f'frames                 {fps:6.1f} /s')
    print(f'engine (node report)   frames {d["frames"]}, frame ms p50 {d["frame_ms_p50"]}, '
          f'p99 {d["frame_ms_p99"]}, action Hz {d["action_hz"]}, '
          f'deadline misses {d["deadline_misses"]}')
    print(f'control (node report)  hold ticks {d["hold_ticks"]}, missed ticks '
          f'{d["missed_ticks"]}, tick jitter p99 {d["tick_jitter_ms_p99"]} ms')
    for text in mon.texts[-3:]:
        print(f'  narration: {text!r}')


if __name__ == '__main__':
    main()
