"""joint_trajectory_controller's acceptance rules (Jazzy), written from its docs: the checker
tools/node_load.py judges the node by, and the one the MuJoCo ALOHA's controllers apply."""

from __future__ import annotations

import math

from oxygen_ros.robot.stamps import seconds


def jtc_problems(msg, joints: list[str], now: float) -> list[str]:
    """Why joint_trajectory_controller (Jazzy defaults: no partial goals, no non-zero end
    velocity) would reject `msg`, a trajectory_msgs/JointTrajectory; [] = accepted."""
    out = []
    names = list(msg.joint_names)
    if not names:
        out.append('empty joint_names')
    if len(set(names)) != len(names):
        out.append('a joint named twice')
    unknown = sorted(set(names) - set(joints))
    if unknown:
        out.append(f'unknown joints {unknown}')
    if set(names) != set(joints) and not unknown:
        out.append('partial joint set')
    if not msg.points:
        out.append('no points')
        return out
    prev = -math.inf
    for k, p in enumerate(msg.points):
        t = seconds(p.time_from_start)
        if t <= prev:
            out.append(f'time_from_start not increasing at point {k}')
        prev = t
        if len(p.positions) != len(names):
            out.append(f'point {k}: {len(p.positions)} positions for {len(names)} joints')
        for field in ('velocities', 'accelerations'):
            n = len(getattr(p, field))
            if n not in (0, len(names)):
                out.append(f'point {k}: {n} {field} for {len(names)} joints')
        values = list(p.positions) + list(p.velocities) + list(p.accelerations)
        if not all(math.isfinite(x) for x in values):
            out.append(f'point {k}: non-finite value')
    last = msg.points[-1]
    if any(v != 0.0 for v in last.velocities):
        out.append('trajectory ends with non-zero velocity')
    stamp = seconds(msg.header.stamp)
    if stamp > 0 and stamp + prev < now:
        out.append('whole trajectory lies in the past')
    return out
