"""Camera encodings beyond the built-in five, through the real cv_bridge.

Every image is published over rclpy and the message that arrives is converted the way the
node converts it (images.image_to_rgb); the RGB is checked against hand-computed values or
an independent cv2.cvtColor call. The last test runs the node on a yuv422 camera. Without
cv_bridge these skip, and the messages that say what cv_bridge would add are checked.
"""
import os
import re
import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy')

from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from support.process import new_domain  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from oxygen_ros.robot import images  # noqa: E402

NO_BRIDGE = ('cv_bridge is not installed (tools/ws.sh builds it when OXYGEN_CV_BRIDGE_SRC '
             'names cv_bridge-src.tar.gz; .ci/run passes ../shared/ros-overlay/)')
needs_bridge = pytest.mark.skipif(images.bridge() is None, reason=NO_BRIDGE)
H, W = 6, 8
rng = np.random.default_rng(0)


def make(encoding, pixels: np.ndarray, big_endian=False, pad=0) -> Image:
    """An Image of HxW(xC) `pixels` (uint8 or uint16), rows padded by `pad` whole pixels."""
    m = Image()
    m.height, m.width = pixels.shape[:2]
    m.encoding = encoding
    m.is_bigendian = int(big_endian)
    px = pixels
    if pad:
        extra = np.zeros((px.shape[0], pad, *px.shape[2:]), px.dtype)
        px = np.concatenate([px, extra], axis=1)
    m.step = px.shape[1] * (px[0, 0].nbytes if px.ndim == 3 else px.itemsize)
    # Last: concatenate would have turned the byte order back to the machine's.
    m.data = px.astype(px.dtype.newbyteorder('>' if big_endian else '<')).tobytes()
    return m


@pytest.fixture(scope='module')
def wire():
    """send(msg) -> the same message after a trip over rclpy (own domain, own topic)."""
    os.environ['ROS_DOMAIN_ID'] = new_domain(120, 220)
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = rclpy.create_node('encodings', context=ctx)
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    pub = node.create_publisher(Image, 'camera/image', qos)
    got = []
    node.create_subscription(Image, 'camera/image', got.append, qos)
    ex = SingleThreadedExecutor(context=ctx)
    ex.add_node(node)
    threading.Thread(target=ex.spin, daemon=True).start()
    end = time.monotonic() + 10
    while pub.get_subscription_count() < 1 and time.monotonic() < end:
        time.sleep(0.01)

    def send(msg):
        n = len(got)
        pub.publish(msg)
        end = time.monotonic() + 10
        while len(got) == n and time.monotonic() < end:
            time.sleep(0.005)
        assert len(got) > n, 'the image did not arrive'
        return got[-1]

    yield send
    ex.shutdown(timeout_sec=1)
    node.destroy_node()
    rclpy.try_shutdown(context=ctx)


def received_rgb(wire, msg):
    received = wire(msg)
    assert images.image_problem(received) is None, images.image_problem(received)
    rgb = images.image_to_rgb(received)
    assert rgb.dtype == np.uint8 and rgb.shape == (msg.height, msg.width, 3)
    return rgb


def to8(v: np.ndarray) -> np.ndarray:
    # 65535 = 255 * 257: cv_bridge scales 16-bit values by 255/65535 and rounds.
    return np.rint(v / 257.0).astype(np.uint8)


@needs_bridge
@pytest.mark.parametrize('encoding, order, alpha', [
    ('rgb16', [0, 1, 2], False), ('bgr16', [2, 1, 0], False),
    ('rgba16', [0, 1, 2], True), ('bgra16', [2, 1, 0], True)])
def test_16_bit_colour(wire, encoding, order, alpha):
    rgb16 = rng.integers(0, 65536, (H, W, 3), dtype=np.uint16)
    px = rgb16[:, :, order]
    if alpha:
        px = np.concatenate([px, np.full((H, W, 1), 65535, np.uint16)], axis=2)
    np.testing.assert_array_equal(received_rgb(wire, make(encoding, px)), to8(rgb16))


@needs_bridge
@pytest.mark.parametrize('big_endian', [False, True])
def test_mono16_both_byte_orders(wire, big_endian):
    gray = rng.integers(0, 65536, (H, W), dtype=np.uint16)
    gray[0, :3] = [0, 257 * 100, 65535]  # exactly 0, 100, 255
    rgb = received_rgb(wire, make('mono16', gray, big_endian=big_endian, pad=2))
    for c in range(3):
        np.testing.assert_array_equal(rgb[:, :, c], to8(gray))
    assert list(rgb[0, :3, 0]) == [0, 100, 255]


def yuv_to_rgb(y, u, v):
    """BT.601 limited range, as OpenCV computes 4:2:2 (luma below 16 clamps to black)."""
    y = np.maximum(y.astype(float) - 16, 0) * 1.164
    u, v = u.astype(float) - 128, v.astype(float) - 128
    return np.stack([y + 1.596 * v, y - 0.391 * u - 0.813 * v, y + 2.018 * u], axis=-1)


@needs_bridge
@pytest.mark.parametrize('encoding, layout, code', [
    ('yuv422', 'UYVY', 'COLOR_YUV2RGB_UYVY'), ('yuv422_yuy2', 'YUYV', 'COLOR_YUV2RGB_YUY2')])
def test_yuv422(wire, encoding, layout, code):
    import cv2

    packed = rng.integers(0, 256, (H, W // 2, 4), dtype=np.uint8)
    rgb = received_rgb(wire, make(encoding, packed.reshape(H, W, 2)))
    # Independently: each 4-byte group is two pixels sharing one U and one V.
    b = {ch: packed[:, :, i] for i, ch in enumerate(('U0', 'Y0', 'V0', 'Y1') if layout == 'UYVY'
                                                    else ('Y0', 'U0', 'Y1', 'V0'))}
    y = np.stack([b['Y0'], b['Y1']], axis=-1).reshape(H, W)
    u, v = np.repeat(b['U0'], 2, axis=1), np.repeat(b['V0'], 2, axis=1)
    hand = np.clip(np.rint(yuv_to_rgb(y, u, v)), 0, 255)
    assert np.abs(rgb.astype(float) - hand).max() <= 1  # OpenCV works in fixed point
    np.testing.assert_array_equal(
        rgb, cv2.cvtColor(packed.reshape(H, W, 2), getattr(cv2, code)))


BAYER = {'rggb': ('R', 'G', 'G', 'B'), 'bggr': ('B', 'G', 'G', 'R'),
         'gbrg': ('G', 'B', 'R', 'G'), 'grbg': ('G', 'R', 'B', 'G')}


@needs_bridge
@pytest.mark.parametrize('pattern', list(BAYER))
@pytest.mark.parametrize('bits', [8, 16])
def test_bayer(wire, pattern, bits):
    # One colour everywhere: demosaicing must give it back away from the border, and a
    # pattern read the wrong way round swaps red and blue.
    colour = {'R': 200, 'G': 100, 'B': 30}
    scale, dtype = (1, np.uint8) if bits == 8 else (257, np.uint16)
    mosaic = np.zeros((H, W), dtype)
    for (dy, dx), ch in zip([(0, 0), (0, 1), (1, 0), (1, 1)], BAYER[pattern], strict=True):
        mosaic[dy::2, dx::2] = colour[ch] * scale
    rgb = received_rgb(wire, make(f'bayer_{pattern}{bits}', mosaic))
    inner = rgb[2:-2, 2:-2].reshape(-1, 3)
    assert (inner == [200, 100, 30]).all(), inner[:4]


@needs_bridge
@pytest.mark.parametrize('encoding', ['rgb8', 'bgr8', 'rgba8', 'bgra8', 'mono8'])
@pytest.mark.parametrize('pad', [0, 3])
def test_both_paths_agree(wire, encoding, pad):
    channels = images.ENCODINGS[encoding]
    px = rng.integers(0, 256, (H, W, channels), dtype=np.uint8)
    received = wire(make(encoding, px if channels > 1 else px[:, :, 0], pad=pad))
    built_in = images.to_rgb(received.encoding, received.height, received.width,
                             received.step, received.data)
    bridged = np.asarray(images.bridge().imgmsg_to_cv2(received, 'rgb8'))
    np.testing.assert_array_equal(built_in, bridged)
    np.testing.assert_array_equal(images.image_to_rgb(received), built_in)
    # And the right colours, not just the same ones.
    want = {'rgb8': px, 'bgr8': px[:, :, ::-1], 'rgba8': px[:, :, :3],
            'bgra8': px[:, :, 2::-1], 'mono8': np.repeat(px, 3, axis=2)}[encoding]
    np.testing.assert_array_equal(built_in, want)


@needs_bridge
@pytest.mark.parametrize('encoding, pixel', [('16UC1', 2), ('32FC1', 4), ('8UC3', 3)])
def test_depth_is_not_colour(wire, encoding, pixel):
    m = Image(height=H, width=W, encoding=encoding, step=W * pixel, data=bytes(H * W * pixel))
    received = wire(m)
    why = images.image_problem(received)
    assert why and why.startswith(f"unsupported image encoding '{encoding}': a depth"), why
    with pytest.raises(ValueError, match='neither the built-in conversion nor cv_bridge'):
        images.image_to_rgb(received)


@needs_bridge
def test_headers_cv_bridge_would_misread_are_refused():
    rgb = Image(height=2, width=3, encoding='rgba8', step=13, data=bytes(26))
    assert 'not a whole number of 4-byte pixels' in images.image_problem(rgb)
    short = Image(height=2, width=2, encoding='mono16', step=6, data=bytes(10))
    assert 'cv_bridge needs all 2 rows' in images.image_problem(short)
    odd = Image(height=2, width=3, encoding='yuv422', step=6, data=bytes(12))
    assert 'width 3 is odd' in images.image_problem(odd)
    unknown = Image(height=2, width=2, encoding='uyvy', step=4, data=bytes(8))
    assert re.match(r"unsupported image encoding 'uyvy'; supported: rgb8, .*yuv422",
                    images.image_problem(unknown))


@pytest.mark.parametrize('encoding', ['yuv422', 'bayer_grbg8', 'mono16', 'bgra16'])
def test_without_cv_bridge_the_message_says_what_would_convert(encoding):
    pixel = images.BRIDGE_ENCODINGS[encoding]
    with pytest.raises(ValueError) as e:
        images.check_image(encoding, 2, 2, 2 * pixel, 4 * pixel, bridged=False)
    assert str(e.value) == (
        f"unsupported image encoding '{encoding}' without cv_bridge: cv_bridge would convert "
        'it but is not installed; built in: rgb8, bgr8, rgba8, bgra8, mono8')
    assert images.check_image(encoding, 2, 2, 2 * pixel, 4 * pixel, bridged=True) == pixel


def test_depth_message_without_cv_bridge():
    with pytest.raises(ValueError, match="'16UC1': a depth or single-value image, not colour"):
        images.check_image('16UC1', 2, 2, 4, 8, bridged=False)


class YuvRobot:
    """A yuv422 front camera (required) and a 16UC1 wrist camera (optional, so masked), both
    at 30 Hz, and joint states at 50 Hz."""

    def __init__(self, node):
        from support.node import JOINTS, joint_state

        self.node, self.joints, self.joint_state = node, JOINTS, joint_state
        best = qos_profile_sensor_data
        self.front = node.create_publisher(Image, '/front/image', best)
        self.wrist = node.create_publisher(Image, '/wrist/image', best)
        self.joint_pub = node.create_publisher(JointState, '/joint_states', best)
        self.traj = []
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, '/arm_controller/joint_trajectory',
                                 lambda m: self.traj.append(time.monotonic()), reliable)
        self.uyvy = rng.integers(0, 256, (48, 64, 2), dtype=np.uint8)
        node.create_timer(1 / 30, self._images)
        node.create_timer(1 / 50, self._joints)

    def _stamp(self):
        return self.node.get_clock().now().to_msg()

    def _images(self):
        front = make('yuv422', self.uyvy)
        front.header.stamp = self._stamp()
        self.front.publish(front)
        depth = make('16UC1', np.zeros((48, 64), np.uint16))
        depth.header.stamp = self._stamp()
        self.wrist.publish(depth)

    def _joints(self):
        self.joint_pub.publish(self.joint_state(self._stamp(), self.joints))


@needs_bridge
def test_yuv422_camera_drives_the_node(tmp_path):
    from support.node import PARAMS, keeps_commanding, node_process
    from support.process import wait_for

    import oxygen_ros.msg  # noqa: F401 (built by colcon; must import)

    domain = new_domain(120, 220)
    params = dict(PARAMS, optional_cameras=['wrist'])
    with node_process(tmp_path, params, domain, 'yuv_robot', YuvRobot) as (proc, robot):
        assert wait_for(lambda: len(robot.traj) > 20 or proc.poll() is not None, 60), \
            robot.log()[-3000:]
        assert proc.poll() is None, robot.log()[-3000:]
        commanding = keeps_commanding(robot.traj, params['control_rate_hz'],
                                      lambda: proc.poll() is None)
        log = robot.log()
    assert commanding, log[-3000:]
    assert 'yuv422' not in log, log[-3000:]  # the front camera was never refused
    assert "camera wrist: unsupported image encoding '16UC1': a depth" in log, log[-3000:]
    assert re.search(r'camera wrist .*\(masked\)', log), log[-3000:]
    assert 'Traceback' not in log
