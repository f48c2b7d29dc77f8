"""Messages out of the robot link: trajectories (commands, holds, the predicted chunk) and
narration. Stamps use the one rounding rule of robot/stamps.py."""

from __future__ import annotations

import numpy as np
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from oxygen_ros.msg import Narration
from oxygen_ros.robot.stamps import split
from oxygen_ros.ros.topics import duration


def trajectory(joints, positions: np.ndarray, velocities: np.ndarray, times) -> JointTrajectory:
    """Points at ``times`` (s from start). header.stamp stays zero: the controller starts
    the trajectory on arrival."""
    msg = JointTrajectory()
    msg.joint_names = list(joints)
    msg.points = [JointTrajectoryPoint(positions=p.tolist(), velocities=v.tolist(),
                                       time_from_start=duration(t))
                  for p, v, t in zip(positions, velocities, times, strict=True)]
    return msg


def predicted(chunk, names: dict) -> JointTrajectory:
    """A whole chunk, stamped with its frame: ``names`` maps action index -> joint."""
    idx = list(names)
    msg = trajectory(names.values(), chunk.positions[:, idx], chunk.velocities[:, idx],
                     [i * chunk.period for i in range(len(chunk.positions))])
    msg.header.stamp.sec, msg.header.stamp.nanosec = split(chunk.stamp)
    return msg


def narration(e) -> Narration:
    """One language event (engine.TokenEvent) of a narration."""
    m = Narration()
    m.header.stamp.sec, m.header.stamp.nanosec = split(e.stamp)
    m.request_id = int(e.request_id)
    m.delta, m.text, m.tokens, m.done = e.delta, e.text, int(e.tokens), bool(e.done)
    if e.done:
        m.reason, m.message = e.reason, (e.message if e.cancelled else '')
    return m


def text(s: str) -> String:
    return String(data=s)
