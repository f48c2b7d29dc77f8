"""ALOHA's conventions without a simulator: joint and camera names, and the gripper maps
between the servo angle the follower reports, ALOHA's normalised gripper (its HDF5
episodes' actions) and the finger travel gym-aloha's MuJoCo model moves."""

from __future__ import annotations

import numpy as np

from oxygen_ros.robot.profiles import (
    GRIPPER_JOINT_CLOSE,
    GRIPPER_JOINT_OPEN,
    GRIPPER_POSITION_CLOSE,
    GRIPPER_POSITION_OPEN,
)

ARM_JOINTS = ['waist', 'shoulder', 'elbow', 'forearm_roll', 'wrist_angle', 'wrist_rotate']
SIDES = ['left', 'right']
# gym-aloha's camera names; the ROS names are the real ALOHA's (cam_low: the `angle` view, a
# low camera looking across the table, is the nearest to the real one under the table edge).
CAMERAS = {'cam_high': 'top', 'cam_low': 'angle', 'cam_left_wrist': 'left_wrist',
           'cam_right_wrist': 'right_wrist'}


def normalized_from_gripper(angle):
    """Gripper servo angle (rad) -> ALOHA's normalised gripper, 0 closed .. 1 open."""
    return (np.asarray(angle, float) - GRIPPER_JOINT_CLOSE) / (
        GRIPPER_JOINT_OPEN - GRIPPER_JOINT_CLOSE)


def finger_from_normalized(x):
    """Normalised gripper -> left_finger travel (m), gym-aloha's mapping of its actions."""
    return GRIPPER_POSITION_CLOSE + np.asarray(x, float) * (
        GRIPPER_POSITION_OPEN - GRIPPER_POSITION_CLOSE)


def finger_from_gripper(angle):
    return finger_from_normalized(normalized_from_gripper(angle))


def gripper_from_finger(finger):
    """left_finger (m) -> the servo angle (rad) the follower's JointState reports."""
    x = (np.asarray(finger, float) - GRIPPER_POSITION_CLOSE) / (
        GRIPPER_POSITION_OPEN - GRIPPER_POSITION_CLOSE)
    return GRIPPER_JOINT_CLOSE + x * (GRIPPER_JOINT_OPEN - GRIPPER_JOINT_CLOSE)
