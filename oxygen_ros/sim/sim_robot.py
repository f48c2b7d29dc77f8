"""A stand-in robot: publishes camera images and joint states, follows the trajectories
it is sent, and logs how often they arrive and what the narration says.

It reads the same robot parameters as oxygen_node (cameras, camera_topics, joint_topics,
joint_sources, joints, output_groups, outputs.*, joint_limits), so one YAML describes both
sides. Action index i moves state joint i, which holds for the built-in profiles (their
state and action vectors share a layout). Its joints obey the joint limits: they stop at a
position limit and move no faster than the speed limit, as a real arm's would.
"""

from __future__ import annotations

import collections
import signal
import sys
import time
from types import SimpleNamespace

import numpy as np
import rclpy
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.robot.contract import compressed_topic
from oxygen_ros.robot.images import encode, unavailable
from oxygen_ros.robot.limits import JointLimits, parse_limits
from oxygen_ros.robot.params import is_limit
from oxygen_ros.robot.stamps import seconds

PARAMS = {
    'cameras': ([], 'camera names'),
    'camera_topics': ([], 'image topic per camera (relative); default <camera>/image_raw'),
    'joint_topics': (['joint_states'], 'JointState topics to publish'),
    'joint_sources': ([], 'a name per joint topic (see oxygen_node)'),
    'joints': ([], 'joints in state order, as source/joint'),
    'output_groups': ([], 'trajectory inputs to follow'),
    'image_width': (320, 'published image width'),
    'image_height': (240, 'published image height'),
    'image_encoding': ('rgb8', 'rgb8, bgr8, rgba8, bgra8 or mono8'),
    'image_transport': ('raw', "raw: sensor_msgs/Image on each camera topic; compressed: "
                        "sensor_msgs/CompressedImage on <camera topic>/compressed, as "
                        "image_transport's compressed plugin publishes it"),
    'image_format': ('jpeg', 'jpeg or png, with image_transport compressed'),
    'jpeg_quality': (95, '1..100, image_transport\'s default 95'),
    'png_level': (3, '0..9, image_transport\'s default 3'),
    'camera_rate_hz': (30.0, 'image rate per camera'),
    'joint_rate_hz': (100.0, 'joint state rate per topic'),
    'follow_time_s': (0.05, 'time constant of the joints following their targets'),
    'max_joint_speed': (0.0, 'per joint, units/s; > 0 makes the arm lag behind targets that '
                        'move faster (on purpose, to test that); 0 = no limit'),
    'initial_positions': ([], 'joint positions at start, in state order; default zeros'),
    'narration_topic': ('oxygen_node/narration/text', 'final narration texts to log'),
    'report_every_s': (5.0, 'how often to log the received trajectory rate'),
    'publish_images': (True, 'false stops every camera, as a camera failure does (dynamic: '
                       'ros2 param set it to stop and restart them)'),
}
LIST_TYPES = {'cameras', 'camera_topics', 'joint_topics', 'joint_sources', 'joints',
              'output_groups', 'initial_positions'}


class SimRobot(Node):
    def __init__(self):
        super().__init__('oxygen_sim_robot')
        p = {}
        for name, (default, text) in PARAMS.items():
            desc = ParameterDescriptor(description=text, dynamic_typing=True)
            self.declare_parameter(name, default if default != [] else None, desc)
            value = self.get_parameter(name).value
            p[name] = list(value or []) if name in LIST_TYPES else value
        self.p = p
        sources = p['joint_sources'] or [''] * len(p['joint_topics'])
        # (source, joint name) per state index.
        self.joints = []
        for label in p['joints']:
            if len(sources) == 1 and not label.startswith(sources[0] + '/'):
                self.joints.append((sources[0], label))
            else:
                src, _, name = label.partition('/')
                self.joints.append((src, name))
        self.q = np.zeros(len(self.joints))
        if p['initial_positions']:
            if len(p['initial_positions']) != len(self.joints):
                raise ValueError(f'initial_positions has {len(p["initial_positions"])} values '
                                 f'for {len(self.joints)} joints')
            self.q[:] = p['initial_positions']
        self.target = self.q.copy()
        if p['max_joint_speed'] < 0:
            raise ValueError(f'max_joint_speed must be >= 0, got {p["max_joint_speed"]}')

        cams = p['cameras']
        topics = p['camera_topics'] or [f'{c}/image_raw' for c in cams]
        self.compress = compression(p)
        if self.compress:
            topics = [t if compressed_topic(t) else t.rstrip('/') + '/compressed'
                      for t in topics]
        self.image_pubs = [self.create_publisher(CompressedImage if self.compress else Image, t,
                                                 qos_profile_sensor_data)
                           for t in topics]
        self.joint_pubs = {s: self.create_publisher(JointState, t, qos_profile_sensor_data)
                           for s, t in zip(sources, p['joint_topics'], strict=True)}
        w, h = int(p['image_width']), int(p['image_height'])
        yy, xx = np.mgrid[0:h, 0:w]
        # A fixed colour gradient per camera; a square moved by the joints makes frames differ.
        self.backgrounds = [
            np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)),
                      np.full_like(xx, 60 * i % 256)], axis=2).astype(np.uint8)
            for i in range(len(cams))]

        self.groups = {}
        self.received = collections.Counter()
        self.gaps = collections.defaultdict(list)
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        named = []
        for g in p['output_groups']:
            topic = self._group_param(g, 'topic', '')
            indices = list(self._group_param(g, 'indices', None) or [])
            joints = list(self._group_param(g, 'joints', None) or [])
            named.append(SimpleNamespace(name=g, joints=joints, indices=indices))
            self.groups[g] = dict(indices=indices, times=None, pos=None, start=0.0, last=None)
            self.create_subscription(JointTrajectory, topic,
                                     lambda m, g=g: self._on_trajectory(g, m), reliable)
        limits = parse_limits(self._limit_params(), named)
        for i, (name, _) in limits.items():
            if i >= len(self.joints):
                raise ValueError(f'joint_limits.{name.replace("/", ".")}: action index {i} '
                                 f'moves no joint of the {len(self.joints)} simulated')
        # The node's own per-index arrays (no hold margin: the sim only obeys the limits).
        lim = JointLimits(len(self.joints), limits, 0.0)
        self.lower, self.upper, self.speed = lim.lower, lim.upper, lim.speed
        if p['max_joint_speed'] > 0:
            self.speed = np.minimum(self.speed, p['max_joint_speed'])
        self.create_subscription(String, p['narration_topic'], self._on_narration,
                                 QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE))

        self.create_timer(1.0 / p['joint_rate_hz'], self._step_joints)
        self.create_timer(1.0 / p['camera_rate_hz'], self._publish_images)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self.create_timer(p['report_every_s'], self._report)
        self._last_step = time.monotonic()
        self._since = time.monotonic()
        how = f' as {self.compress[0]} on */compressed' if self.compress else ''
        self.get_logger().info(
            f'sim robot: {len(cams)} cameras {w}x{h} {p["image_encoding"]}{how} at '
            f'{p["camera_rate_hz"]:g} Hz, {len(self.joints)} joints at {p["joint_rate_hz"]:g} Hz,'
            f' following {list(self.groups)}')

    def _group_param(self, group, key, default):
        name = f'outputs.{group}.{key}'
        self.declare_parameter(name, default, ParameterDescriptor(dynamic_typing=True))
        return self.get_parameter(name).value

    def _limit_params(self) -> dict:
        names = [n for n in self._parameter_overrides if is_limit(n)]
        for n in names:
            self.declare_parameter(n, None, ParameterDescriptor(dynamic_typing=True))
        return {n: self.get_parameter(n).value for n in names}

    def _on_trajectory(self, g, msg):
        now = time.monotonic()
        st = self.groups[g]
        if st['last'] is not None:
            self.gaps[g].append(now - st['last'])
        st['last'] = now
        self.received[g] += 1
        try:
            times = [seconds(p.time_from_start) for p in msg.points]
            pos = np.array([list(p.positions) for p in msg.points], dtype=float)
            if not len(times) or pos.shape != (len(times), len(st['indices'])):
                return  # a malformed command is ignored, like a controller rejecting it
        except ValueError:
            return
        # Interpolate from where the joints are now to the first point, as a controller does.
        st['times'] = np.concatenate([[0.0], times])
        st['pos'] = np.concatenate([self.q[st['indices']][None], pos])
        st['start'] = now

    def _on_narration(self, msg):
        self.get_logger().info(f'narration: {msg.data!r}')

    def _targets(self, st, now):
        t = now - st['start']
        times, pos = st['times'], st['pos']
        return np.array([np.interp(t, times, pos[:, j]) for j in range(pos.shape[1])])

    def _step_joints(self):
        now = time.monotonic()
        dt = now - self._last_step
        self._last_step = now
        for st in self.groups.values():
            if st['times'] is not None:
                self.target[st['indices']] = self._targets(st, now)
        self.q = follow(self.q, self.target, dt, self.p['follow_time_s'], self.speed,
                        self.lower, self.upper)
        stamp = self.get_clock().now().to_msg()
        for src, pub in self.joint_pubs.items():
            msg = JointState()
            msg.header.stamp = stamp
            idx = [i for i, (s, _) in enumerate(self.joints) if s == src]
            msg.name = [self.joints[i][1] for i in idx]
            msg.position = [float(self.q[i]) for i in idx]
            pub.publish(msg)

    def _on_set_parameters(self, params):
        from rcl_interfaces.msg import SetParametersResult

        for prm in params:
            if prm.name == 'publish_images':
                if not isinstance(prm.value, bool):
                    return SetParametersResult(successful=False,
                                              reason='publish_images must be true or false')
            elif prm.name in PARAMS:
                return SetParametersResult(successful=False,
                                          reason=f'{prm.name} is read at start only')
        for prm in params:
            if prm.name == 'publish_images':
                self.p['publish_images'] = prm.value
                self.get_logger().info('cameras ' + ('on' if prm.value else 'stopped'))
        return SetParametersResult(successful=True)

    def _publish_images(self):
        if not self.p['publish_images']:
            return
        stamp = self.get_clock().now().to_msg()
        enc = self.p['image_encoding']
        for i, (pub, bg) in enumerate(zip(self.image_pubs, self.backgrounds, strict=True)):
            img = bg.copy()
            h, w = img.shape[:2]
            # Where the square sits follows the first joints, so motion shows in the images.
            a = self.q[i % len(self.q)] if len(self.q) else 0.0
            cx = int((0.5 + 0.4 * np.tanh(a)) * (w - 1))
            cy = h // 2
            img[max(0, cy - h // 8):cy + h // 8, max(0, cx - w // 8):cx + w // 8] = (255, 40, 40)
            data = _encode(img, enc)
            if self.compress:
                msg = CompressedImage()
                msg.format, msg.data = encode(data, enc, *self.compress)
            else:
                msg = Image()
                msg.height, msg.width, msg.encoding = h, w, enc
                msg.step = data.shape[1] * (data.shape[2] if data.ndim == 3 else 1)
                msg.data = data.tobytes()
            msg.header.stamp = stamp
            msg.header.frame_id = f'camera_{i}'
            pub.publish(msg)

    def _report(self):
        now = time.monotonic()
        span = now - self._since
        self._since = now
        parts = []
        for g in self.groups:
            gaps = np.array(self.gaps[g]) if self.gaps[g] else np.zeros(1)
            parts.append(f'{g} {self.received[g] / span:.1f} Hz (p99 gap '
                         f'{np.percentile(gaps, 99) * 1e3:.0f} ms)')
            self.received[g] = 0
            self.gaps[g] = []
        self.get_logger().info('trajectories received: ' + ', '.join(parts))


def follow(q, target, dt, time_constant, max_speed, lower=-np.inf, upper=np.inf):
    """The joints after dt s of moving toward their targets: first order with
    time_constant, no faster than max_speed per second (per joint or one for all; 0 or inf:
    no limit), and never beyond [lower, upper]."""
    step = (target - q) * min(1.0, dt / max(time_constant, 1e-3))
    limit = np.where(np.asarray(max_speed) > 0, max_speed, np.inf) * dt
    return np.clip(q + np.clip(step, -limit, limit), lower, upper)


def compression(p: dict) -> tuple[str, int] | None:
    """(format, its quality or level) for image_transport compressed, None for raw;
    ValueError for a bad setting."""
    if p['image_transport'] == 'raw':
        return None
    if p['image_transport'] != 'compressed':
        raise ValueError(f'image_transport must be raw or compressed, got '
                         f'{p["image_transport"]!r}')
    fmt = p['image_format']
    if fmt not in ('jpeg', 'png'):
        raise ValueError(f'image_format must be jpeg or png, got {fmt!r}')
    key, low, high = ('jpeg_quality', 1, 100) if fmt == 'jpeg' else ('png_level', 0, 9)
    value = p[key]
    if not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f'{key} must be an integer in {low}..{high}, got {value!r}')
    why = unavailable()
    if why:
        raise ValueError(f'image_transport compressed: {why}')
    return fmt, value


def _encode(rgb: np.ndarray, encoding: str) -> np.ndarray:
    if encoding == 'rgb8':
        return rgb
    if encoding == 'bgr8':
        return np.ascontiguousarray(rgb[:, :, ::-1])
    if encoding in ('rgba8', 'bgra8'):
        c = rgb if encoding == 'rgba8' else rgb[:, :, ::-1]
        return np.concatenate([c, np.full(rgb.shape[:2] + (1,), 255, np.uint8)], axis=2)
    if encoding == 'mono8':
        return rgb.mean(axis=2).astype(np.uint8)
    raise ValueError(f'image_encoding {encoding!r} is not one of rgb8, bgr8, rgba8, bgra8, mono8')


def main(args=None):
    # Signals only set a flag, as in oxygen_node: a KeyboardInterrupt raised inside rclpy
    # (ros2 launch signals the whole group, sometimes twice) surfaced as a RuntimeError from
    # a message being taken and killed the process instead of stopping it.
    signals = []
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    signal.signal(signal.SIGINT, lambda signum, _frame: signals.append(signum))
    signal.signal(signal.SIGTERM, lambda signum, _frame: signals.append(signum))
    node = None
    try:
        node = SimRobot()
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        while not signals and rclpy.ok():
            executor.spin_once(timeout_sec=0.1)
    except ExternalShutdownException:
        pass
    except ValueError as e:
        print(f'[oxygen_sim_robot] error: {e}', file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        # Ignored from here on, not just noted: at exit Python puts back the default action
        # for signals it handled, and a second SIGINT from ros2 launch would then kill the
        # process on its way out.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()

if __name__ == '__main__':
    main()
