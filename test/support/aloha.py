"""A fake bimanual ALOHA over rclpy, publishing what the real one does and recording what it
is sent.

Two Interbotix ViperX followers, each with its xs_sdk JointState (the arm's six joints, the
`gripper` servo angle in rad and the two finger positions in m, right_finger mirrored),
four RealSense colour streams and a trajectory controller per arm and per gripper. The
robot does not move: every reading is the pose it was given, so a command's targets and a
hold's positions can be checked exactly against it. Images are small (64x48, not the
RealSense's 640x480) and the same every frame, so the model sees the same input each time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from trajectory_msgs.msg import JointTrajectory

ARM_JOINTS = ['waist', 'shoulder', 'elbow', 'forearm_roll', 'wrist_angle', 'wrist_rotate']
# xs_sdk's joint_states order for a ViperX 300 6DOF.
JOINT_NAMES = ARM_JOINTS + ['gripper', 'left_finger', 'right_finger']
CAMERAS = ['cam_high', 'cam_low', 'cam_left_wrist', 'cam_right_wrist']
NAMESPACES = {'left': 'follower_left', 'right': 'follower_right'}
# One joint_trajectory_controller per arm and per gripper, in each follower's namespace.
CONTROLLERS = {f'{side}_{part}': (f'{ns}/{part}_controller/joint_trajectory',
                                  ARM_JOINTS if part == 'arm' else ['gripper'])
               for side, ns in NAMESPACES.items() for part in ('arm', 'gripper')}
WIDTH, HEIGHT = 64, 48


def camera_topic(camera: str) -> str:
    """realsense2_camera's colour topic under the camera's namespace and name."""
    return f'{camera}/camera/color/image_rect_raw'


def joint_topic(side: str) -> str:
    return f'{NAMESPACES[side]}/joint_states'


@dataclass(frozen=True)
class Pose:
    """One follower as its JointState reads it."""

    arm: tuple[float, ...]  # six joints, rad
    gripper: float  # gripper servo, rad
    finger: float  # left_finger, m

    def positions(self) -> list[float]:
        return [*self.arm, self.gripper, self.finger, -self.finger]


def camera_images(seed: int = 0) -> dict[str, np.ndarray]:
    """A fixed rgb8 picture per camera."""
    rng = np.random.default_rng(seed)
    return {c: rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8) for c in CAMERAS}


class AlohaRobot:
    """Cameras at 30 Hz, joint states at 50 Hz, and every trajectory received per
    controller as (monotonic arrival time, message)."""

    def __init__(self, node, poses: dict[str, Pose], images: dict[str, np.ndarray]):
        self.node = node
        self.poses = poses
        # The RealSense driver publishes reliable; the node may subscribe best effort.
        cam_qos = QoSProfile(depth=2, reliability=ReliabilityPolicy.RELIABLE)
        self.cams = []
        for c in CAMERAS:
            m = Image()
            m.header.frame_id = f'{c}_color_optical_frame'
            m.height, m.width, m.encoding, m.step = HEIGHT, WIDTH, 'rgb8', WIDTH * 3
            m.data = np.ascontiguousarray(images[c]).tobytes()
            self.cams.append((node.create_publisher(Image, camera_topic(c), cam_qos), m))
        self.joints = []
        for side, pose in poses.items():
            m = JointState()
            m.name = list(JOINT_NAMES)
            m.position = pose.positions()
            m.velocity = [0.0] * len(JOINT_NAMES)
            m.effort = [0.0] * len(JOINT_NAMES)
            self.joints.append((node.create_publisher(JointState, joint_topic(side),
                                                      qos_profile_sensor_data), m))
        self.traj: dict[str, list[tuple[float, JointTrajectory]]] = {g: [] for g in CONTROLLERS}
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        for g, (topic, _) in CONTROLLERS.items():
            node.create_subscription(JointTrajectory, '/' + topic,
                                     lambda m, g=g: self.traj[g].append((time.monotonic(), m)),
                                     reliable)
        node.create_timer(1 / 30, lambda: self._publish(self.cams))
        node.create_timer(1 / 50, lambda: self._publish(self.joints))

    def _publish(self, pairs):
        stamp = self.node.get_clock().now().to_msg()
        for pub, m in pairs:
            m.header.stamp = stamp
            pub.publish(m)
