#!/usr/bin/env python3
"""Hosts on one machine: network namespaces joined by veth pairs to a bridge, so ROS 2
processes in different namespaces talk DDS over a real (virtual) Ethernet link.

    sudo python tools/hosts.py measure [--seconds 20] [--one-host] [--transport compressed]

measures oxygen_node (tiny model) commanding two oxygen_sim_robots across the link: the
robots on one host, the node on another; --one-host puts both on one host with the shipped
shared-memory profile (config/fastdds.xml) for comparison. test/system/test_hosts.py uses the same
pieces. Needs root (`ip netns add`); everything made is removed on the way out.

Layout: a namespace `<tag>-sw` holds the bridge; each host is a namespace `<tag>-<host>`
with lo up and eth0 (a veth whose peer is a bridge port) at 10.213.<n>.<i>/24, multicast
routed to eth0 and multicast snooping off on the bridge (no IGMP querier here, so every
group is flooded). The root namespace is not touched. Fast DDS must not use shared memory
between the hosts (they share /dev/shm): FASTDDS_UDP, a UDPv4-only profile, does that.

`python tools/hosts.py agent ...` is the robot-side listener the test runs in a namespace:
it prints every trajectory, the robots' joint positions, the node's diagnostics and the
lifecycle transitions it is asked for on stdin, one JSON object a line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = 'oxh'  # namespace names: oxh<pid>-<host>
# UDPv4 only, and socket buffers that hold a few camera images: a 320x240 rgb8 image is
# 230 KB, four 64 KB datagrams, more than the kernel's default 208 KB receive buffer.
# Fast DDS asks for these sizes; the kernel grants up to net.core.rmem_max / wmem_max.
BUFFER = 4 * 1024 * 1024
FASTDDS_UDP = f"""<?xml version="1.0" encoding="UTF-8" ?>
<profiles xmlns="http://www.eprosima.com/XMLSchemas/fastRTPS_Profiles">
  <transport_descriptors>
    <transport_descriptor>
      <transport_id>udp_only</transport_id>
      <type>UDPv4</type>
      <sendBufferSize>{BUFFER}</sendBufferSize>
      <receiveBufferSize>{BUFFER}</receiveBufferSize>
    </transport_descriptor>
  </transport_descriptors>
  <participant profile_name="oxygen_ros_udp_only" is_default_profile="true">
    <rtps>
      <userTransports><transport_id>udp_only</transport_id></userTransports>
      <useBuiltinTransports>false</useBuiltinTransports>
      <sendSocketBufferSize>{BUFFER}</sendSocketBufferSize>
      <listenSocketBufferSize>{BUFFER}</listenSocketBufferSize>
    </rtps>
  </participant>
</profiles>
"""


def ip(*args, check=True):
    return subprocess.run(['ip', *args], capture_output=True, text=True, check=check,
                          timeout=20)


def no_firewall() -> str | None:
    """None when iptables (with its statistic match) can filter a namespace's packets."""
    if shutil.which('iptables') is None:
        return 'no iptables to drop packets (apt-get install iptables)'
    return None


def why_not() -> str | None:
    """None when network namespaces and veth pairs can be made here, else why not."""
    if os.geteuid() != 0:
        return 'network namespaces need root (ip netns add, veth pairs); not running as root'
    if shutil.which('ip') is None:
        return 'no `ip` command (iproute2) to make network namespaces'
    probe = f'{PREFIX}{os.getpid()}-probe'
    try:
        ip('netns', 'add', probe)
        ip('-n', probe, 'link', 'add', 'a0', 'type', 'veth', 'peer', 'name', 'b0')
    except subprocess.CalledProcessError as e:
        return f'cannot make a network namespace with a veth pair: {e.stderr.strip()}'
    finally:
        ip('netns', 'del', probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale():
    """Namespaces of ours whose process is gone (killed before it could clean up)."""
    for line in ip('netns', 'list', check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ''
        head = name.partition('-')[0]
        if head.startswith(PREFIX) and head[len(PREFIX):].isdigit():
            if not _alive(int(head[len(PREFIX):])):
                ip('netns', 'del', name, check=False)


class Hosts:
    """Network namespaces named `hosts`, each with an address on one private /24, joined by
    a bridge. `run` starts processes in them; leaving the `with` ends those and removes
    every namespace (and with them the veths and the bridge), also on an error."""

    def __init__(self, hosts, subnet: int | None = None):
        self.tag = f'{PREFIX}{os.getpid()}'
        self.subnet = random.randint(1, 254) if subnet is None else subnet
        self.ns = {h: f'{self.tag}-{h}' for h in hosts}
        self.addr = {h: f'10.213.{self.subnet}.{i + 1}' for i, h in enumerate(hosts)}
        self.switch = f'{self.tag}-sw'
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        remove_stale()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _make(self):
        sw = self.switch
        ip('netns', 'add', sw)
        ip('-n', sw, 'link', 'add', 'br0', 'type', 'bridge', 'mcast_snooping', '0')
        ip('-n', sw, 'link', 'set', 'br0', 'up')
        for i, (h, ns) in enumerate(self.ns.items()):
            ip('netns', 'add', ns)
            ip('-n', ns, 'link', 'set', 'lo', 'up')
            port = f'p{i}'
            ip('-n', sw, 'link', 'add', port, 'type', 'veth', 'peer', 'name', 'eth0',
               'netns', ns)
            ip('-n', sw, 'link', 'set', port, 'master', 'br0', 'up')
            ip('-n', ns, 'addr', 'add', f'{self.addr[h]}/24', 'dev', 'eth0')
            ip('-n', ns, 'link', 'set', 'eth0', 'up')
            # Discovery is multicast (239.255.0.1): without a route to it, sends fail.
            ip('-n', ns, 'route', 'add', '224.0.0.0/4', 'dev', 'eth0')

    def run(self, host, argv, env, log) -> subprocess.Popen:
        """`argv` in `host`'s namespace (ip netns exec execs it: the pid is the process's)."""
        p = subprocess.Popen(['ip', 'netns', 'exec', self.ns[host], *argv], env=env,
                             stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.PIPE if log is subprocess.PIPE else None)
        self.procs.append(p)
        return p

    def counters(self, host, iface='eth0') -> dict[str, int]:
        """The interface's byte and packet counters, from sysfs inside the namespace."""
        keys = ('rx_bytes', 'tx_bytes', 'rx_packets', 'tx_packets')
        out = subprocess.run(
            ['ip', 'netns', 'exec', self.ns[host], 'cat',
             *[f'/sys/class/net/{iface}/statistics/{k}' for k in keys]],
            capture_output=True, text=True, check=True, timeout=20).stdout.split()
        return dict(zip(keys, map(int, out), strict=True))

    def firewall(self, host, *rules: list[str]):
        """Append iptables rules (each a list of arguments after `-A`) in `host`'s
        namespace: what a lossy or broken link does to the packets of eth0."""
        for rule in rules:
            subprocess.run(['ip', 'netns', 'exec', self.ns[host], 'iptables', '-A', *rule],
                           capture_output=True, text=True, check=True, timeout=20)

    def loss(self, host, share: float):
        """Drop `share` of eth0's packets at random, both ways (iptables' statistic match)."""
        drop = ['-m', 'statistic', '--mode', 'random', '--probability', f'{share:g}',
                '-j', 'DROP']
        self.firewall(host, ['INPUT', '-i', 'eth0', *drop], ['OUTPUT', '-o', 'eth0', *drop])

    def cut(self, host):
        """Cut `host` off the link (its own loopback keeps working): a partition."""
        self.firewall(host, ['INPUT', '-i', 'eth0', '-j', 'DROP'],
                      ['OUTPUT', '-o', 'eth0', '-j', 'DROP'])

    def heal(self, host):
        """Remove every rule of `host`'s namespace."""
        for chain in ('INPUT', 'OUTPUT'):
            subprocess.run(['ip', 'netns', 'exec', self.ns[host], 'iptables', '-F', chain],
                           capture_output=True, text=True, check=True, timeout=20)

    def close(self):
        stop(self.procs)
        self.procs = []
        for ns in [*self.ns.values(), self.switch]:
            ip('netns', 'del', ns, check=False)


def stop(procs, timeout=15.0) -> list:
    """SIGINT each running process, then wait; kill what is still there. Exit codes."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append('killed')
    return codes


def dds_env(domain: str, profile: str | Path) -> dict:
    """The environment of a process on a host: DDS on the subnet, this Fast DDS profile, one
    torch thread; nothing that would pick another discovery or transport."""
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED='1',
               OMP_NUM_THREADS='1', RCUTILS_LOGGING_BUFFERED_STREAM='0',
               ROS_AUTOMATIC_DISCOVERY_RANGE='SUBNET', RMW_IMPLEMENTATION='rmw_fastrtps_cpp',
               FASTRTPS_DEFAULT_PROFILES_FILE=str(profile))
    for k in ('ROS_STATIC_PEERS', 'ROS_DISCOVERY_SERVER', 'ROS_LOCALHOST_ONLY',
              'FASTDDS_DEFAULT_PROFILES_FILE', 'FASTDDS_BUILTIN_TRANSPORTS'):
        env.pop(k, None)
    return env


# -- the robot-side listener ------------------------------------------------------------------

def agent(robots: list[str], topic: str, joints_every: float):
    """Prints, one JSON object a line: {"traj": robot, "t", "src", "times", "end", "vmax"}
    per trajectory on /<robot>/<topic> (t: time.monotonic() at arrival; src: when the
    publisher sent it, its DDS source timestamp in s of the system clock; times: each point's
    time_from_start; end: the last point's positions; vmax: its largest |velocity|),
    {"joints": robot, "t", "q"} every `joints_every` s per robot, {"diag": name, "t",
    "level", "values"} per status on /diagnostics. Reads lines `<id> <node> <transition>`
    from stdin and answers {"call": id, "sent": t}, then {"done": id, "ok": bool, "t"}
    (lifecycle_msgs ChangeState on /<node>/change_state)."""
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from rclpy.serialization import deserialize_message
    from sensor_msgs.msg import JointState
    from trajectory_msgs.msg import JointTrajectory

    lock = threading.Lock()

    def say(**kw):
        with lock:
            sys.stdout.write(json.dumps(kw) + '\n')
            sys.stdout.flush()

    rclpy.init()
    node = rclpy.create_node('hosts_agent')
    reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    last_joints = {}

    def on_traj(robot, m, info):
        t = time.monotonic()
        end = m.points[-1] if m.points else None
        times = [p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in m.points]
        say(traj=robot, t=t, src=info['source_timestamp'] * 1e-9, times=times,
            end=list(end.positions) if end else [],
            vmax=max((abs(v) for v in end.velocities), default=0.0) if end else 0.0)

    def on_joints(robot, raw):
        # Taken serialized and read only when one is due: at the sim robots' 100 Hz the
        # agent would otherwise spend a third of a core reading joint states it drops, on
        # the two cores the robots and models share.
        t = time.monotonic()
        if t - last_joints.get(robot, 0.0) >= joints_every:
            last_joints[robot] = t
            say(joints=robot, t=t, q=list(deserialize_message(raw, JointState).position))

    def on_diag(m):
        for st in m.status:
            say(diag=st.name, t=time.monotonic(), level=int.from_bytes(st.level, 'little')
                if isinstance(st.level, bytes) else int(st.level),
                values={kv.key: kv.value for kv in st.values})

    for r in robots:
        node.create_subscription(JointTrajectory, f'/{r}/{topic}',
                                 lambda m, info, r=r: on_traj(r, m, info), reliable)
        node.create_subscription(JointState, f'/{r}/joint_states',
                                 lambda m, r=r: on_joints(r, m), qos_profile_sensor_data,
                                 raw=True)
    node.create_subscription(DiagnosticArray, '/diagnostics', on_diag, 50)
    clients = {}

    def calls():
        for line in sys.stdin:
            parts = line.split()
            if len(parts) != 3:
                continue
            cid, target, label = parts
            if target not in clients:
                clients[target] = node.create_client(ChangeState, f'/{target}/change_state')
            c = clients[target]
            ok = c.wait_for_service(timeout_sec=30)
            t = time.monotonic()
            say(call=cid, sent=t)
            if not ok:
                say(done=cid, ok=False, t=time.monotonic(), why='no change_state service')
                continue
            fut = c.call_async(ChangeState.Request(transition=Transition(label=label)))
            end = time.monotonic() + 60
            while not fut.done() and time.monotonic() < end:
                time.sleep(0.005)
            say(done=cid, ok=bool(fut.done() and fut.result().success), t=time.monotonic())

    threading.Thread(target=calls, daemon=True).start()
    ex = SingleThreadedExecutor()
    ex.add_node(node)
    signal.signal(signal.SIGINT, lambda *_: ex.shutdown(timeout_sec=0))
    try:
        ex.spin()
    except Exception:
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


class Listener:
    """What an agent process prints, parsed as it comes: trajectories per robot (arrival
    times and messages), joint readings, the latest diagnostics per status name, answers."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.traj: dict[str, list[tuple[float, dict]]] = {}
        self.joints: dict[str, list[tuple[float, list]]] = {}
        self.diag: dict[str, dict] = {}
        self.answers: dict[str, dict] = {}
        self.lines: list[str] = []
        self._next = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                m = json.loads(line)
            except ValueError:
                self.lines.append(line)
                continue
            if 'traj' in m:
                self.traj.setdefault(m['traj'], []).append((m['t'], m))
            elif 'joints' in m:
                self.joints.setdefault(m['joints'], []).append((m['t'], m['q']))
            elif 'diag' in m:
                self.diag[m['diag']] = m
            elif 'call' in m:
                self.answers.setdefault(m['call'], {})['sent'] = m['sent']
            elif 'done' in m:
                self.answers.setdefault(m['done'], {}).update(m)

    def arrivals(self, robot) -> list[tuple[float, dict]]:
        return self.traj.setdefault(robot, [])

    def transition(self, node: str, label: str, timeout=90.0) -> dict:
        """Ask for a lifecycle transition of `node`; {'sent', 'ok', 't'} once answered."""
        self._next += 1
        cid = str(self._next)
        self.proc.stdin.write(f'{cid} {node} {label}\n'.encode())
        self.proc.stdin.flush()
        end = time.monotonic() + timeout
        while 'ok' not in self.answers.get(cid, {}) and time.monotonic() < end:
            time.sleep(0.02)
        return self.answers.get(cid, {})


def agent_argv(robots, topic, joints_every=0.1) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), 'agent', '--robots',
            ','.join(robots), '--topic', topic, '--joints-every', str(joints_every)]


def write_params(path: Path, params: dict) -> str:
    import yaml

    path.write_text(yaml.safe_dump({'/**': {'ros__parameters': params}}))
    return str(path)


# -- measure: the numbers docs/robots.md quotes ----------------------------------------------

def measure(seconds: float, one_host: bool, transport: str = 'raw'):
    import numpy as np
    import yaml
    from ament_index_python.packages import get_package_share_directory

    share = Path(get_package_share_directory('oxygen_ros'))
    sim = yaml.safe_load((share / 'config' / 'sim.yaml').read_text())['/**']['ros__parameters']
    robots = ['left', 'right']
    # The subtask format: a pi05 prompt with the 8-d state does not fit the tiny model.
    node = dict(sim, model='tiny', prompt_format='subtask', device='cpu', robots=robots,
                report_period=1.0)
    robot = dict(sim, report_every_s=1.0)
    if transport != 'raw':  # the sim robots send what image_transport would, the node reads it
        robot['image_transport'] = transport
        node['camera_transports'] = [transport] * len(sim['cameras'])
    tmp = Path(tempfile.mkdtemp(prefix='hosts_measure_'))
    profile = share / 'config' / 'fastdds.xml'
    if not one_host:
        profile = tmp / 'fastdds_udp.xml'
        profile.write_text(FASTDDS_UDP)
    names = ['robots'] if one_host else ['robots', 'gpu']
    domain = str(random.randint(1, 200))
    env = dds_env(domain, profile)
    lib = share.parents[1] / 'lib' / 'oxygen_ros'
    with Hosts(names) as hosts:
        gpu = names[-1]
        logs = {n: open(tmp / f'{n}.log', 'w') for n in ('node', *robots)}
        hosts.run(gpu, [str(lib / 'oxygen_node'), '--ros-args', '--params-file',
                        write_params(tmp / 'node.yaml', node)], env, logs['node'])
        for r in robots:
            hosts.run('robots', [str(lib / 'oxygen_sim_robot'), '--ros-args', '--params-file',
                                 write_params(tmp / 'sim.yaml', robot),
                                 '-r', f'__ns:=/{r}'], env, logs[r])
        listen = Listener(hosts.run('robots', agent_argv(robots, sim['outputs']['arm']['topic']),
                                    env, subprocess.PIPE))
        end = time.monotonic() + 120
        while time.monotonic() < end and not all(len(listen.arrivals(r)) > 50 for r in robots):
            time.sleep(0.2)
        time.sleep(3.0)  # past the start
        before = hosts.counters(gpu) if not one_host else None
        n0 = {r: len(listen.arrivals(r)) for r in robots}
        t0 = time.monotonic()
        time.sleep(seconds)
        span = time.monotonic() - t0
        rates = {r: (len(listen.arrivals(r)) - n0[r]) / span for r in robots}
        print(f'{"one host (shared memory)" if one_host else "across the link (UDP)"}, '
              f'{transport} images, {seconds:g} s:')
        for r in robots:
            d = listen.diag.get(f'oxygen_node: {r}', {}).get('values', {})
            print(f'  {r}: trajectories at the robot {rates[r]:.1f} Hz; node: action latency '
                  f'p50 {d.get("action_latency_ms_p50")} ms p99 {d.get("action_latency_ms_p99")}'
                  f' ms, frames {d.get("frames")}, frame p50 {d.get("frame_ms_p50")} ms')
        if before is not None:
            after = hosts.counters(gpu)
            rx = (after['rx_bytes'] - before['rx_bytes']) / span
            tx = (after['tx_bytes'] - before['tx_bytes']) / span
            print(f'  gpu eth0: {rx / 1e6:.1f} MB/s in, {tx / 1e6:.2f} MB/s out')
        for r in robots:
            lines = [x for x in (tmp / f'{r}.log').read_text().splitlines()
                     if 'trajectories received' in x][-3:]
            print(f'  {r} sim robot says: ' + ' | '.join(x.split(']: ')[-1] for x in lines))
        gaps = np.diff([t for t, _ in listen.arrivals(robots[0])[n0[robots[0]]:]])
        if len(gaps):
            print(f'  {robots[0]} gaps at the robot: p50 {np.median(gaps) * 1e3:.1f} ms, '
                  f'p99 {np.percentile(gaps, 99) * 1e3:.1f} ms, max {gaps.max() * 1e3:.1f} ms')
    for f in logs.values():
        f.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    sub = ap.add_subparsers(dest='cmd', required=True)
    a = sub.add_parser('agent')
    a.add_argument('--robots', required=True)
    a.add_argument('--topic', required=True)
    a.add_argument('--joints-every', type=float, default=0.1)
    m = sub.add_parser('measure')
    m.add_argument('--seconds', type=float, default=20.0)
    m.add_argument('--one-host', action='store_true')
    m.add_argument('--transport', choices=('raw', 'compressed'), default='raw',
                   help="the sim robots' image_transport (compressed: JPEG)")
    args = ap.parse_args(argv)
    if args.cmd == 'agent':
        agent(args.robots.split(','), args.topic, args.joints_every)
    else:
        why = why_not()
        if why:
            sys.exit(why)
        measure(args.seconds, args.one_host, args.transport)


if __name__ == '__main__':
    main()
