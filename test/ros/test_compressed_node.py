"""oxygen_node on compressed cameras, over rclpy against its own process: a JPEG front camera
(camera_transports) and a PNG wrist camera (a topic ending in /compressed) drive it; empty,
cut, corrupt, mislabelled, depth and resized payloads are dropped with a message naming the
camera while the good images in between keep it commanding; a camera sending only bad ones
holds the robot. Last, the node fed only by oxygen_sim_robot with image_transport
compressed drives it end to end.
"""
import subprocess
import sys
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy')
cv2 = pytest.importorskip('cv2')
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import CompressedImage  # noqa: E402
from support.node import (  # noqa: E402
    PARAMS,
    Robot,
    assert_alive_and_commanding,
    expect_log,
    keeps_commanding,
    node_process,
)
from support.process import new_domain, node_env, wait_for, write_params  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

import oxygen_ros.msg  # noqa: F401, E402 (built by colcon; must import)
from oxygen_ros.robot.images import encode  # noqa: E402
from oxygen_ros.sim.scene import render  # noqa: E402

COMPRESSED = dict(PARAMS, camera_transports=['compressed', 'compressed'],
                  camera_topics=['front/image', 'wrist/image/compressed'])
SCENE = render(64, 48, seed=1)


class Cameras(Robot):
    """support/node.py's fake robot with compressed cameras: front JPEG on
    /front/image/compressed, wrist PNG on /wrist/image/compressed; `bad[cam]` breaks every
    second image of a camera, `all_bad` every one."""

    def __init__(self, node):
        super().__init__(node)
        self.leave_out = set()
        best = qos_profile_sensor_data
        self.cams = {'front': node.create_publisher(CompressedImage, '/front/image/compressed',
                                                    best),
                     'wrist': node.create_publisher(CompressedImage, '/wrist/image/compressed',
                                                    best)}
        self.codec = {'front': ('jpeg', 90), 'wrist': ('png', 3)}
        self.bad = {}
        self.all_bad = False

    def _images(self):
        self.n += 1
        for cam, pub in self.cams.items():
            m = CompressedImage()
            m.header.stamp = self._stamp()
            # Each image a little different, as a camera's are.
            px = np.roll(SCENE, self.n % 8, axis=1)
            m.format, data = encode(px, 'rgb8', *self.codec[cam])
            m.data = data
            if cam in self.bad and (self.all_bad or self.n % 2):
                m = self.bad[cam](m)
            pub.publish(m)


@pytest.fixture(scope='module')
def robot(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('compressed')
    domain = new_domain(120, 220)
    with node_process(tmp, COMPRESSED, domain, 'compressed_robot', Cameras) as (proc, r):
        r.proc = proc
        assert wait_for(lambda: len(r.traj) > 20 or proc.poll() is not None, 60), r.log()
        assert proc.poll() is None, r.log()
        yield r


def test_compressed_cameras_drive_the_node(robot):
    log = robot.log()
    assert 'front <- /front/image/compressed (compressed)' in log, log[-3000:]
    assert 'wrist <- /wrist/image/compressed (compressed)' in log, log[-3000:]
    assert robot.node.count_subscribers('/front/image/compressed') >= 1
    assert robot.node.count_subscribers('/front/image') == 0
    assert_alive_and_commanding(robot, COMPRESSED)
    assert 'image dropped' not in robot.log()


def _with(fmt=None, data=None):
    def bad(m):
        if fmt is not None:
            m.format = fmt
        if data is not None:
            m.data = data(bytes(m.data))
        return m
    return bad


def _flip_tables(data):
    # Overwrite the JPEG's first Huffman table: the structure breaks, decoding fails.
    i = 2
    while data[i + 1] != 0xC4:
        i += 2 + int.from_bytes(data[i + 2:i + 4], 'big')
    return data[:i + 4] + bytes(b ^ 0xFF for b in data[i + 4:i + 24]) + data[i + 24:]


def _other_size(data):
    return encode(render(32, 24), 'rgb8', 'jpeg', 90)[1]


BROKEN = [
    ('empty', 'front', _with(data=lambda d: b''), r'empty jpeg payload'),
    ('cut', 'front', _with(data=lambda d: d[:len(d) // 2]), r'JPEG has no end-of-image marker'),
    ('corrupt', 'front', _with(data=_flip_tables), r'JPEG is corrupt: it does not decode'),
    ('mislabelled', 'wrist', _with(fmt='rgb8; jpeg compressed bgr8'),
     r'the format says jpeg but the \d+-byte payload is a PNG'),
    ('depth', 'wrist', _with(fmt='16UC1; compressedDepth png'), r'compressed depth image'),
    ('unknown', 'front', _with(fmt='h264'), r"unknown compressed image format 'h264'"),
    ('resized', 'front', _with(data=_other_size),
     r'32x24 image, but this camera sent 64x48 before'),
]


@pytest.mark.parametrize('cam,breakage,why', [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_bad_payloads_are_dropped_and_the_node_keeps_commanding(robot, cam, breakage, why):
    first = robot.fresh_diag()
    mark = len(robot.log())
    robot.bad[cam] = breakage
    try:
        expect_log(robot, mark, rf'camera {cam}: .*{why}.*; image dropped, the last good one is '
                   'kept')
        assert_alive_and_commanding(robot, COMPRESSED)  # the good images in between
        d = robot.fresh_diag()
    finally:
        robot.bad.clear()
    assert int(d['dropped_images']) > int(first['dropped_images'])
    assert 'Traceback' not in robot.log()
    assert_alive_and_commanding(robot, COMPRESSED)


def test_a_camera_sending_only_bad_images_holds_the_robot(robot):
    mark = len(robot.log())
    robot.bad['front'], robot.all_bad = _with(data=lambda d: d[:-10]), True
    try:
        expect_log(robot, mark, r'camera front: .*cut short; image dropped')
        # The last good image ages past max_input_age: no frame, and the robot holds.
        expect_log(robot, mark, r'no frame: front stale')
        expect_log(robot, mark, r'holding', timeout=3)
        time.sleep(0.6)  # what is left of the last chunk runs out
        assert robot.rate(0.5) == 0, 'commands from dropped images'
    finally:
        robot.bad.clear()
        robot.all_bad = False
    assert_alive_and_commanding(robot, COMPRESSED)


class Listener:
    def __init__(self, node):
        self.traj = []
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, '/arm_controller/joint_trajectory',
                                 lambda m: self.traj.append(time.monotonic()), reliable)
        self.images = []
        node.create_subscription(CompressedImage, '/front/image/compressed', self.images.append,
                                 qos_profile_sensor_data)


@pytest.mark.parametrize('codec', ['jpeg', 'png'])
def test_sim_robot_with_compressed_images_drives_the_node(tmp_path, codec):
    domain = new_domain(120, 220)
    # The sim reads the same robot parameters; only its topics are /compressed ones.
    params = dict(COMPRESSED, camera_topics=['front/image', 'wrist/image'],
                  image_transport='compressed', image_format=codec, image_width=64,
                  image_height=48, camera_rate_hz=30.0, joint_rate_hz=50.0)
    sim_log = open(tmp_path / 'sim.log', 'w')
    sim = subprocess.Popen([sys.executable, '-m', 'oxygen_ros.sim.sim_robot', '--ros-args',
                            '--params-file', write_params(tmp_path / 'sim.yaml', params)],
                           stdout=sim_log, stderr=subprocess.STDOUT, env=node_env(domain))
    try:
        with node_process(tmp_path, params, domain, 'sim_listener', Listener) as (proc, ours):
            alive = lambda: proc.poll() is None and sim.poll() is None  # noqa: E731
            assert wait_for(lambda: len(ours.traj) > 20 or not alive(), 90), (
                ours.log()[-3000:] + (tmp_path / 'sim.log').read_text()[-2000:])
            commanding = keeps_commanding(ours.traj, params['control_rate_hz'], alive)
            log = ours.log()
            images = list(ours.images)
    finally:
        sim.terminate()
        sim.wait(20)
        sim_log.close()
    sim_text = (tmp_path / 'sim.log').read_text()
    assert commanding, log[-3000:] + sim_text[-2000:]
    assert f'as {codec} on */compressed' in sim_text, sim_text
    assert 'front <- /front/image/compressed (compressed)' in log
    assert 'image dropped' not in log and 'Traceback' not in log, log[-3000:]
    # What the sim sent is what image_transport sends.
    assert images, 'no compressed image seen'
    fmt = 'rgb8; jpeg compressed bgr8' if codec == 'jpeg' else 'rgb8; png compressed bgr8'
    assert {m.format for m in images} == {fmt}
    magic = b'\xff\xd8\xff' if codec == 'jpeg' else b'\x89PNG'
    assert all(bytes(m.data[:len(magic)]) == magic for m in images)
