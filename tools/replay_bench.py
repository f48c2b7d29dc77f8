#!/usr/bin/env python3
"""How long oxygen-replay takes over a recording, against the recording's length.

    source install/setup.bash
    python tools/replay_bench.py [--seconds 60] [--out DIR] [--storage mcap|sqlite3]

Records a live run first: oxygen_sim_robot and oxygen_node on config/sim.yaml (two 320x240
cameras at 30 Hz, joints at 100 Hz, the built-in `small` model on the CPU, one torch
thread) with publish_predicted and frame_noise, as two processes; this one records their
cameras, joints, commands and the node's ~/predicted_trajectory with oxygen_ros.robot.record for
--seconds once the node's chunks come. Then runs `oxygen-replay` on the bag as its own
process (live frames: every frame the node ran) and prints the replay's wall time, the
recording's length, their ratio, and what the replay's report says of the live chunks.
Nothing else should run on the machine meanwhile: the node's frame rate, and so the
replay's work, follows the CPU it gets.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPICS = {'/exterior_1/image_raw': 'sensor_msgs/msg/Image',
          '/wrist/image_raw': 'sensor_msgs/msg/Image',
          '/joint_states': 'sensor_msgs/msg/JointState',
          '/fr3_arm_controller/joint_trajectory': 'trajectory_msgs/msg/JointTrajectory',
          '/gripper_controller/joint_trajectory': 'trajectory_msgs/msg/JointTrajectory',
          '/oxygen_node/predicted_trajectory': 'trajectory_msgs/msg/JointTrajectory'}


def record(tmp: Path, seconds: float, storage: str) -> Path:
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from oxygen_ros.robot.record import Recorder
    from oxygen_ros.robot.share import config_dir

    sim = config_dir() / 'sim.yaml'
    env = dict(os.environ, ROS_DOMAIN_ID=str(random.randint(100, 230)), OMP_NUM_THREADS='1')
    env.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    env.setdefault('FASTRTPS_DEFAULT_PROFILES_FILE', str(config_dir() / 'fastdds.xml'))
    os.environ.update(env)
    # From `tmp`: the installed package (with its generated messages), not the sources.
    ros = ['--ros-args', '--params-file', str(sim), '-p', 'publish_predicted:=true',
           '-p', 'frame_noise:=true']
    procs = [subprocess.Popen([sys.executable, '-m', f'oxygen_ros.{m}', *ros],
                              stdout=open(tmp / f'{m}.log', 'w'), stderr=subprocess.STDOUT,
                              env=env, cwd=tmp)
             for m in ('sim_robot', 'node')]
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node('replay_bench_recorder', context=context)
    ex = SingleThreadedExecutor(context=context)
    ex.add_node(node)
    bag = tmp / f'sim_{storage}'
    try:
        chunks = []
        from trajectory_msgs.msg import JointTrajectory

        node.create_subscription(JointTrajectory, '/oxygen_node/predicted_trajectory',
                                 chunks.append, 10)
        threading.Thread(target=ex.spin, daemon=True).start()
        end = time.monotonic() + 180
        while not chunks and time.monotonic() < end:
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f'a process ended; logs in {tmp}')
            time.sleep(0.1)
        if not chunks:
            raise SystemExit(f'no chunks from the node in 180 s; logs in {tmp}')
        # The cameras publish best effort (sensor data): a reliable subscription would not
        # match them.
        rec = Recorder(node, [(bag, storage)], TOPICS,
                       QoSProfile(depth=200, reliability=ReliabilityPolicy.BEST_EFFORT))
        time.sleep(seconds)
        rec.close()
        print(f'replay_bench: recorded {seconds:g} s: {rec.counts}', flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        ex.shutdown(timeout_sec=1)
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    return bag


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--seconds', type=float, default=60.0)
    ap.add_argument('--storage', choices=('mcap', 'sqlite3'), default='mcap')
    ap.add_argument('--out', default='', help='where the bag, logs and report go')
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix='replay-bench-')).resolve()
    out.mkdir(parents=True, exist_ok=True)
    bag = record(out, args.seconds, args.storage)
    t0 = time.monotonic()
    code = subprocess.call([sys.executable, '-m', 'oxygen_ros.robot.replay', str(bag), '--robot',
                            'sim', '-p', 'frame_noise:=true', '--threads', '1', '--out',
                            str(out / 'report'), '--no-progress'], cwd=out)
    wall = time.monotonic() - t0
    if code:
        print(f'replay_bench: oxygen-replay failed ({code})', file=sys.stderr)
        return 1
    rep = json.loads((out / 'report' / 'report.json').read_text())
    rec = rep['recordings'][0]
    live = rec.get('live') or {}
    result = {'recording_s': rep['recording_s'], 'replay_wall_s': wall,
              'ratio': wall / rep['recording_s'], 'report_wall_s': rep['wall_s'],
              'frames': rec['frames_run'], 'live_frames': live.get('frames'),
              'max_abs_diff': live.get('max_abs_diff'), 'unmatched': len(live.get('unmatched',
                                                                                  [])),
              'cpus': os.cpu_count()}
    (out / 'bench.json').write_text(json.dumps(result, indent=1))
    print(f'replay_bench: {rep["recording_s"]:.1f} s of recording ({rec["frames_run"]} frames) '
          f'replayed in {wall:.1f} s: {result["ratio"]:.2f} of its length; {out}/bench.json')
    return 0


if __name__ == '__main__':
    sys.exit(main())
