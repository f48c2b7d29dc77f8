#!/usr/bin/env python3
"""Trajectories per robot per second under the fleet launch, counted at the robots.

    source install/setup.bash
    flock /tmp/oxygen_cpu.lock python tools/fleet_rate.py            # robots a,b,c, 30 s
    flock /tmp/oxygen_cpu.lock python tools/fleet_rate.py --install before=/tmp/a/install \
        --install after=/tmp/b/install --rounds 3                    # alternately, A B A B ...

Each run starts `ros2 launch oxygen_ros fleet.launch.py robots:=a,b,c robot:=sim sim:=true`
(one node, the `small` random-weight model, a simulated robot per robot; the launch as a
user runs it) in a ROS domain of its own, waits for the first trajectory, lets `--warmup`
seconds pass (model loading and the first frames are not held against the rate), then
counts the JointTrajectory messages received on every robot's controller topics that were
written in the next `--seconds`. This process takes them raw every 20 ms and keeps only
their DDS source timestamps (when the node wrote them), so that it costs the shared CPU
little (0.5-0.8 CPU s a 20 s window; a callback per message took 3.9) and a delivery
bunched by its polling does not move a gap. Prints per robot: trajectories/s on each topic,
the gaps between them on its first topic (p50, p99, max, the window's edges included), and
from the node's /diagnostics over the same window its missed ticks (a control tick 1.5
periods or more after the one before), hold ticks (nothing to publish: the chunk ran out
and its hold went out), holds and frames; then the CPU seconds of each process of the
launch and of this one in the window, and the node's busiest threads (CPU seconds,
involuntary context switches, FIFO where a thread runs real-time). `--burn N` runs N busy
processes beside the launch from the warm-up on: a full CPU.

With `--install LABEL=DIR` (repeatable) each run sources that colcon install space on top of
the current environment, and the runs go round the labels in turn, `--rounds` times, so that
versions are compared within one session of a noisy machine (build an old revision with
`git worktree add` and `colcon build` there). `--py-spy DIR` records the node of every run
over its window (py-spy record, idle threads included, per-thread) into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from oxygen_ros.robot.share import config_dir


def topics(robot_file: Path) -> list[str]:
    p = yaml.safe_load(robot_file.read_text())['/**']['ros__parameters']
    return [p['outputs'][g]['topic'] for g in p['output_groups']]


def node_pid(root: int) -> int | None:
    """The oxygen_node process under ``root`` (the launch), from /proc."""
    kids: dict[int, list[int]] = {}
    for d in Path('/proc').iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / 'stat').read_text().rsplit(')', 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            cmd = (Path('/proc') / str(pid) / 'cmdline').read_bytes().split(b'\0')
        except OSError:
            continue
        if any(c.endswith(b'/oxygen_node') for c in cmd[:2]):
            return pid
        todo += kids.get(pid, [])
    return None


def cpu_seconds(root: int) -> dict:
    """Every process under ``root``, by pid: (name, CPU seconds (user + system), {tid: (CPU
    seconds, involuntary context switches, 'FIFO' or '' for its policy)})."""
    tick = os.sysconf('SC_CLK_TCK')
    out = {}
    todo = [root]
    kids: dict[int, list[int]] = {}
    for d in Path('/proc').iterdir():
        if d.name.isdigit():
            try:
                kids.setdefault(int((d / 'stat').read_text().rsplit(')', 1)[1].split()[1]),
                                []).append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            cmd = (Path('/proc') / str(pid) / 'cmdline').read_bytes().split(b'\0')
            name = next((Path(c.decode()).name for c in cmd[:3]
                         if b'oxygen_' in c or b'ros2' in c), Path(cmd[0].decode()).name)
            threads = {}
            for t in (Path('/proc') / str(pid) / 'task').iterdir():
                f = (t / 'stat').read_text().rsplit(')', 1)[1].split()
                status = (t / 'status').read_text()
                forced = int(status.split('nonvoluntary_ctxt_switches:')[1].split()[0])
                # stat's fields from the third on: utime 14, stime 15, policy 41.
                threads[int(t.name)] = ((int(f[11]) + int(f[12])) / tick, forced,
                                        'FIFO' if f[38] == '1' else '')
            out[pid] = (name, sum(x[0] for x in threads.values()), threads)
        except (OSError, IndexError, ValueError, StopIteration):
            continue
    return out


def gap_stats(times: list[float], start: float, end: float) -> dict:
    """Rate and gaps (ms) of the messages written in [start, end); the gaps include the
    window's edges, so a topic that stops shows the silence."""
    got = sorted(t for t in times if start <= t < end)
    gaps = np.diff([start, *got, end]) * 1e3
    return dict(rate=len(got) / (end - start), p50=float(np.percentile(gaps, 50)),
                p99=float(np.percentile(gaps, 99)), max=float(gaps.max()))


POLL_S = 0.02


def run_once(a, label: str, install: str, robots: list[str], names: list[str], log: Path,
             spy: Path | None) -> dict:
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from trajectory_msgs.msg import JointTrajectory

    domain = str(random.randint(100, 230))
    env = dict(os.environ, ROS_DOMAIN_ID=domain, PYTHONUNBUFFERED='1')
    env.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    launch = ['ros2', 'launch', 'oxygen_ros', 'fleet.launch.py', f'robots:={",".join(robots)}',
              f'robot:={a.robot}', 'sim:=true', *a.launch_arg]
    cmd = ' '.join(shlex.quote(c) for c in launch)
    if install:
        cmd = f'source {shlex.quote(install)}/setup.bash && exec {cmd}'
    out = open(log, 'w')
    proc = subprocess.Popen(['bash', '-c', cmd], stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    saved = os.environ.get('ROS_DOMAIN_ID')
    os.environ['ROS_DOMAIN_ID'] = domain
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    rclpy.init()
    node = rclpy.create_node('fleet_rate')
    # The trajectories are taken here every POLL_S, raw, from a callback group that no
    # executor runs: one wake-up per poll instead of one per message. Each message is
    # counted by the time its publisher wrote it (the DDS source timestamp, system clock),
    # which a delivery bunched by the poll does not move.
    from oxygen_ros.ros.topics import Polled

    group = Polled()
    qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
    subs = {(r, t): node.create_subscription(JointTrajectory, f'/{r}/{t}', lambda m: None,
                                             qos, callback_group=group, raw=True)
            for r in robots for t in names}
    arrivals = {k: [] for k in subs}
    diag: dict[str, dict] = {}

    def on_diag(msg):
        for st in msg.status:
            name, _, robot = st.name.partition(': ')
            if name == 'oxygen_node' and robot in robots:
                diag[robot] = {kv.key: kv.value for kv in st.values}

    node.create_subscription(DiagnosticArray, '/diagnostics', on_diag, 10)
    ex = SingleThreadedExecutor()
    ex.add_node(node)

    def poll() -> int:
        n = 0
        for k, sub in subs.items():
            while True:
                with sub.handle:
                    got = sub.handle.take_message(sub.msg_type, sub.raw)
                if got is None:
                    break
                arrivals[k].append(got[1]['source_timestamp'] * 1e-9)
                n += 1
        ex.spin_once(timeout_sec=0)
        return n

    spy_proc = None
    burners = []
    try:
        end = time.monotonic() + 240
        while not poll() and time.monotonic() < end and proc.poll() is None:
            time.sleep(POLL_S)
        if time.monotonic() >= end or proc.poll() is not None:
            raise SystemExit(f'{label}: no trajectory within 240 s; see {log}')
        # The rest of the machine's work: busy processes from the warm-up on.
        burners = [subprocess.Popen([sys.executable, '-c', 'while True: pass'])
                   for _ in range(a.burn)]
        end = time.monotonic() + a.warmup
        while time.monotonic() < end:
            poll()
            time.sleep(POLL_S)
        before = {r: dict(v) for r, v in diag.items()}
        cpu0 = cpu_seconds(proc.pid)
        mine0 = time.process_time()
        if spy is not None:
            pid = node_pid(proc.pid)
            spy_proc = subprocess.Popen(
                ['py-spy', 'record', '--pid', str(pid), '--duration', str(int(a.seconds)),
                 '--rate', '200', '--idle', '--threads', '--format', 'raw', '--nonblocking',
                 '-o', str(spy)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        start = time.time()
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            poll()
            time.sleep(POLL_S)
        stop_t = time.time()
        cpu1 = cpu_seconds(proc.pid)
        mine = time.process_time() - mine0
        # What was written before the window closed and is still on its way.
        settle = time.monotonic() + 0.5
        while time.monotonic() < settle:
            poll()
            time.sleep(POLL_S)
        seen = diag.get(robots[0])
        end = time.monotonic() + 3
        while diag.get(robots[0]) is seen and time.monotonic() < end:
            ex.spin_once(timeout_sec=0.05)
        after = {r: dict(v) for r, v in diag.items()}
        if spy_proc is not None:
            spy_proc.wait(30)
    finally:
        for b in burners:
            b.kill()
            b.wait()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()
        ex.shutdown(timeout_sec=1)
        node.destroy_node()
        rclpy.try_shutdown()
        if saved is None:
            os.environ.pop('ROS_DOMAIN_ID', None)
        else:
            os.environ['ROS_DOMAIN_ID'] = saved

    def delta(r, key):
        try:
            return int(after[r][key]) - int(before.get(r, {}).get(key, 0))
        except (KeyError, ValueError):
            return None

    res = dict(label=label, seconds=stop_t - start, burn=a.burn, robots={},
               cpu={'fleet_rate': mine})
    for pid, (name, sec, threads) in cpu1.items():
        if pid in cpu0:
            key = f'{name}[{pid}]'
            res['cpu'][key] = sec - cpu0[pid][1]
            if name == 'oxygen_node':
                # Its busiest threads: CPU s, involuntary switches, FIFO where real-time.
                was = cpu0[pid][2]
                res['node_threads'] = sorted(
                    ((round(c - was.get(tid, (0.0, 0))[0], 2),
                      n - was.get(tid, (0.0, 0))[1], fifo)
                     for tid, (c, n, fifo) in threads.items()), reverse=True)[:6]
    for r in robots:
        per = {t: gap_stats(arrivals[(r, t)], start, stop_t) for t in names}
        res['robots'][r] = dict(
            rate={t: round(per[t]['rate'], 2) for t in names},
            gap_ms={k: round(per[names[0]][k], 1) for k in ('p50', 'p99', 'max')},
            **{k: delta(r, k) for k in ('missed_ticks', 'hold_ticks', 'holds', 'frames')},
            tick_jitter_ms_p99=after.get(r, {}).get('tick_jitter_ms_p99'),
            tick_gap_ms_max=after.get(r, {}).get('tick_gap_ms_max'))
    return res


def show(res: dict, names: list[str]):
    rates = [v['rate'][names[0]] for v in res['robots'].values()]
    print(f'{res["label"]}: {res["seconds"]:.1f} s, trajectories/s per robot on '
          f'{names[0]}: ' + ' '.join(f'{x:.1f}' for x in rates)
          + f' (mean {np.mean(rates):.1f})', flush=True)
    for r, v in res['robots'].items():
        print(f'  {r}: ' + ', '.join(f'{t.split("/")[0]} {v["rate"][t]:.1f}/s' for t in names)
              + f'; gaps p50 {v["gap_ms"]["p50"]:.1f} p99 {v["gap_ms"]["p99"]:.1f} '
              f'max {v["gap_ms"]["max"]:.1f} ms; missed ticks {v["missed_ticks"]}, hold ticks '
              f'{v["hold_ticks"]}, holds {v["holds"]}, frames {v["frames"]}', flush=True)
    print('  CPU s in the window: ' + ', '.join(
        f'{k} {v:.1f}' for k, v in sorted(res['cpu'].items(), key=lambda kv: -kv[1]) if v >= 0.1),
        flush=True)
    print('  node threads (CPU s, involuntary switches): ' + ', '.join(
        f'{c:.2f}/{n}{" FIFO" if f else ""}' for c, n, f in res.get('node_threads', [])),
        flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--robots', default='a,b,c')
    ap.add_argument('--robot', default='sim', help='robot file (config/<robot>.yaml)')
    ap.add_argument('--seconds', type=float, default=30.0)
    ap.add_argument('--warmup', type=float, default=10.0)
    ap.add_argument('--rounds', type=int, default=1)
    ap.add_argument('--install', action='append', default=[], metavar='LABEL=DIR',
                    help='a colcon install space to run (repeatable; default: the sourced one)')
    ap.add_argument('--launch-arg', action='append', default=[], metavar='NAME:=VALUE')
    ap.add_argument('--burn', type=int, default=0,
                    help='busy processes (a Python loop each) beside the fleet: a full CPU')
    ap.add_argument('--py-spy', metavar='DIR', help='record the node of each run with py-spy')
    ap.add_argument('--out', help='every run as JSON lines here')
    a = ap.parse_args(argv)
    robots = [r for r in a.robots.split(',') if r]
    names = topics(config_dir() / f'{a.robot}.yaml')
    variants = [tuple(x.split('=', 1)) for x in a.install] or [('sourced', '')]
    tmp = Path(tempfile.mkdtemp(prefix='fleet_rate_'))
    spy_dir = Path(a.py_spy) if a.py_spy else None
    if spy_dir:
        spy_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for i in range(a.rounds):
        for label, install in variants:
            tag = f'{label}-{i}'
            res = run_once(a, label, install, robots, names, tmp / f'{tag}.log',
                           spy_dir / f'{tag}.txt' if spy_dir else None)
            res['round'] = i
            results.append(res)
            show(res, names)
            if a.out:
                with open(a.out, 'a') as f:
                    f.write(json.dumps(res) + '\n')
    if len(variants) > 1 or a.rounds > 1:
        print('per robot trajectories/s, mean over robots, by run:')
        for label, _ in variants:
            runs = [np.mean([v['rate'][names[0]] for v in r['robots'].values()])
                    for r in results if r['label'] == label]
            print(f'  {label}: ' + ' '.join(f'{x:.1f}' for x in runs))
    print(f'logs: {tmp}')


if __name__ == '__main__':
    sys.exit(main())
