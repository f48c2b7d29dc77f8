#!/usr/bin/env python3
"""CPU per control tick of one robot link, without the engine.

    source install/setup.bash
    flock /tmp/oxygen_cpu.lock python tools/tick_cost.py                # sim.yaml, 1400 ticks
    flock /tmp/oxygen_cpu.lock python tools/tick_cost.py --segments     # and by part
    flock /tmp/oxygen_cpu.lock python tools/tick_cost.py --install before=/tmp/a/install \
        --install after=/tmp/b/install --rounds 2                       # alternately

A RobotLink of the robot file (sim.yaml: the DROID-shaped sim robot, velocities re-anchored
every action, joint limits on every joint) on a node of its own, active and commanding. This
process plays the robot: its joint states at the file's joint rate, and every 0.36 s (the
period of the fleet launch's frames) a chunk of random actions in the model's range, its
frame 0.15 s old, handed to the link as the engine thread does. The ticks run here at the
control rate, each timed by this thread's CPU clock (the shared machine's wall clock mostly
measures the neighbours); the first 100 are left out. Prints the median, 90th percentile
and mean microseconds per tick; with --segments also the mean CPU of the tick's parts
(wrapped, so the parts add a little of their own). With `--install LABEL=DIR` (repeatable)
each run sources that colcon install space in a process of its own, the labels in turn,
`--rounds` times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml


def measure(a) -> dict:
    import rclpy
    from sensor_msgs.msg import JointState

    from oxygen_ros.robot.clock import JumpWatch
    from oxygen_ros.robot.contract import Config
    from oxygen_ros.robot.params import flatten
    from oxygen_ros.robot.share import config_dir
    from oxygen_ros.ros.robot_link import RobotLink

    tree = yaml.safe_load((config_dir() / a.robot).read_text())['/**']['ros__parameters']
    cfg = Config.from_values(flatten(tree))
    os.environ['ROS_DOMAIN_ID'] = str(random.randint(100, 230))
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    rclpy.init()
    node = rclpy.create_node('tick_cost')
    link = RobotLink(node, cfg, name='a', prefix='a', private='~/a')
    link.configure()
    link.activate()
    # What Control.start sets up for its thread; the ticks run in this one instead.
    link.control._tick_clock = time.monotonic
    link.control._jumps = JumpWatch(cfg.p.max_input_age)
    robot = rclpy.create_node('tick_cost_robot')
    pubs = {src: robot.create_publisher(JointState, f'/a/{topic}', 50)
            for src, topic in cfg.joint_topics.items()}
    joints = list(tree['joints'])
    rest = np.array(tree['initial_positions'], dtype=np.float64)
    rng = np.random.default_rng(0)

    def joint_states():
        m = JointState()
        m.header.stamp = node.get_clock().now().to_msg()
        m.name = joints
        m.position = (rest + 0.01 * rng.standard_normal(len(rest))).tolist()
        m.velocity = [0.0] * len(joints)
        m.effort = [0.0] * len(joints)
        for p in pubs.values():
            p.publish(m)

    parts: dict[str, int] = {}

    def wrap(obj, name, key):
        f = getattr(obj, name)

        def timed(*args, **kw):
            t = time.thread_time_ns()
            try:
                return f(*args, **kw)
            finally:
                parts[key] = parts.get(key, 0) + time.thread_time_ns() - t
        setattr(obj, name, timed)

    if a.segments:
        from oxygen_ros.ros import control
        wrap(link.player, 'tick', 'player (all)')
        if link.player.limits is not None:
            wrap(link.player.limits, 'apply', 'player: joint limits')
        wrap(link.player, '_start', 'player: where the controller is')
        wrap(link.control, '_publish', 'publish (all)')
        wrap(control.messages, 'trajectory', 'publish: message built')
        wrap(control, 'serialize_message', 'publish: message serialized')
        if hasattr(control.messages, 'TrajectoryBytes'):
            wrap(control.messages.TrajectoryBytes, '__call__', 'publish: bytes written')
        for pub in link.traj_pubs.values():
            wrap(pub, 'publish', 'publish: sent')
        wrap(link, '_take_joints', 'joint states taken')

    period = 1.0 / cfg.p.control_rate_hz
    joint_period = 1.0 / float(tree.get('joint_rate_hz', 100.0))
    horizon, width = 10, 32  # the small model's chunk and action dims
    cpu = []
    start = time.monotonic()
    next_chunk = next_joints = start
    for i in range(a.ticks):
        now = time.monotonic()
        while next_joints <= now:
            joint_states()
            next_joints += joint_period
        if now >= next_chunk:
            acts = rng.uniform(-1, 1, (horizon, width)).astype(np.float32)
            link.on_actions(link.now() - 0.15, rest.copy(), acts)
            next_chunk = now + 0.36
        t = time.thread_time_ns()
        link.control.tick()
        cpu.append(time.thread_time_ns() - t)
        wait = start + (i + 1) * period - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    us = np.array(cpu[100:]) / 1e3
    c = link.stats.c
    out = dict(ticks=len(us), p50=float(np.percentile(us, 50)), p90=float(np.percentile(us, 90)),
               mean=float(us.mean()), published=c['published'], holds=c['holds'],
               hold_ticks=c['hold_ticks'], parts={k: v / a.ticks / 1e3 for k, v in parts.items()})
    node.destroy_node()
    robot.destroy_node()
    rclpy.try_shutdown()
    return out


def show(label: str, r: dict):
    print(f'{label}: CPU per tick p50 {r["p50"]:.0f} us, p90 {r["p90"]:.0f}, mean {r["mean"]:.0f} '
          f'over {r["ticks"]} ticks (commands {r["published"]}, holds {r["holds"]}, hold ticks '
          f'{r["hold_ticks"]})', flush=True)
    for k, v in r['parts'].items():
        print(f'  {k:32s} {v:6.0f} us', flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--robot', default='sim.yaml', help='robot file under config/')
    ap.add_argument('--ticks', type=int, default=1400)
    ap.add_argument('--segments', action='store_true', help='also the CPU of the parts')
    ap.add_argument('--install', action='append', default=[], metavar='LABEL=DIR')
    ap.add_argument('--rounds', type=int, default=1)
    ap.add_argument('--json', action='store_true', help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not a.install:
        for _ in range(a.rounds):
            r = measure(a)
            if a.json:
                print('RESULT ' + json.dumps(r), flush=True)
            else:
                show('sourced', r)
        return
    me = shlex.quote(str(Path(__file__).resolve()))
    opts = f'--robot {shlex.quote(a.robot)} --ticks {a.ticks}' + (' --segments' * a.segments)
    for _ in range(a.rounds):
        for label, install in (x.split('=', 1) for x in a.install):
            got = subprocess.run(
                ['bash', '-c', f'source {shlex.quote(install)}/setup.bash && cd /tmp && exec '
                 f'{shlex.quote(sys.executable)} {me} {opts} --json'],
                capture_output=True, text=True)
            line = next((x for x in got.stdout.splitlines() if x.startswith('RESULT ')), None)
            if line is None:
                raise SystemExit(f'{label} failed:\n{got.stdout[-2000:]}{got.stderr[-2000:]}')
            show(label, json.loads(line[7:]))


if __name__ == '__main__':
    main()
