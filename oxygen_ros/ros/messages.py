"""Messages out of the robot link: trajectories (commands, holds, the predicted chunk) and
narration. Stamps use the one rounding rule of robot/stamps.py."""

from __future__ import annotations

import struct

import numpy as np
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from oxygen_ros.msg import Narration
from oxygen_ros.robot.stamps import split, split_duration
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


_U32 = struct.Struct('<I')
_DURATION = struct.Struct('<iI')
# A point's accelerations and effort: two empty sequences.
_NO_MORE = _U32.pack(0) * 2


class TrajectoryBytes:
    """trajectory() for fixed ``joints``, serialized: the CDR (little endian) that
    serialize_message gives for it, built from the numbers directly. A control tick sends
    one per controller; building the message and serializing it took a few times as long as
    the rest of the tick's publishing. Call with positions and velocities [n, len(joints)]
    and times [n] (s from start)."""

    def __init__(self, joints):
        if not joints:
            raise ValueError('a trajectory of no joints')
        self.dim = len(joints)
        body = bytearray(12)  # header.stamp (0, 0) and frame_id's length...
        body[8:12] = _U32.pack(1)
        body += b'\0\0\0\0'  # ... its terminating NUL and the padding to 4
        body += _U32.pack(len(joints))
        for name in joints:
            text = name.encode() + b'\0'
            body += _U32.pack(len(text)) + text + b'\0' * (-len(text) % 4)
        self.prefix = b'\0\1\0\0' + bytes(body)  # CDR, little endian: then the body
        self.offset = len(body)  # where the points' count goes, in the body
        self.count = _U32.pack(self.dim)

    def __call__(self, positions, velocities, times) -> bytes:
        pos = np.ascontiguousarray(positions, dtype='<f8')
        vel = np.ascontiguousarray(velocities, dtype='<f8')
        if pos.shape != vel.shape or pos.shape != (len(times), self.dim):
            raise ValueError(f'positions {pos.shape} and velocities {vel.shape} for '
                             f'{len(times)} times of {self.dim} joints')
        parts = [self.prefix, _U32.pack(len(times))]
        off = self.offset + 4
        size = 8 * self.dim
        count, pad = self.count, b'\0\0\0\0'
        for p, v, t in zip(pos, vel, times):
            for row in (p, v):
                # Every field is a multiple of 4 bytes; doubles start on a multiple of 8.
                parts.append(count)
                off += 4
                if off % 8:
                    parts.append(pad)
                    off += 4
                parts.append(row.tobytes())
                off += size
            parts.append(_NO_MORE)
            parts.append(_DURATION.pack(*split_duration(float(t))))
            off += 16
        return b''.join(parts)


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
