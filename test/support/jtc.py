"""Jazzy joint_trajectory_controller's motion, computed here independently of oxygen_ros:
given positions and velocities, it moves from its current state (position and velocity)
through each point along a cubic per segment (ros2_controllers
joint_trajectory_controller/src/trajectory.cpp, interpolate_between_points, the
has_velocity && !has_accel case); the peaks of that motion, to set against a robot's
limits."""
import numpy as np


def segments(p, v, times, positions, velocities):
    """The controller's cubics from state (p, v) through the points: [(T, c0, c1, c2, c3)]."""
    out, ta = [], 0.0
    for tb, p1, v1 in zip(times, positions, velocities, strict=True):
        T = tb - ta
        c2 = (-3 * p + 3 * p1 - 2 * v * T - v1 * T) / T ** 2
        c3 = (2 * p - 2 * p1 + v * T + v1 * T) / T ** 3
        out.append((T, p, v, c2, c3))
        ta, p, v = tb, p1, v1
    return out


def peaks(segs):
    """Largest |velocity|, |acceleration| and |jerk| of each joint along the cubics."""
    vel = acc = jerk = np.zeros(len(segs[0][1]))
    for T, _, c1, c2, c3 in segs:
        s = np.linspace(0.0, T, 200)[:, None]
        vel = np.maximum(vel, np.abs(c1 + 2 * c2 * s + 3 * c3 * s ** 2).max(0))
        # The acceleration is linear inside a segment: largest at an end.
        acc = np.maximum(acc, np.maximum(np.abs(2 * c2), np.abs(2 * c2 + 6 * c3 * T)))
        jerk = np.maximum(jerk, np.abs(6 * c3))
    return vel, acc, jerk
