"""The bimanual ALOHA in MuJoCo, without ROS: gym-aloha's scenes and tasks (insertion,
transfer-cube), the controllers of the real robot's followers, and the gripper mapping.

gym-aloha (0.1.5) models each ViperX follower as six arm joints and two finger slides
(`left_finger` 0.021..0.057 m, `right_finger` its mirror) driven by position actuators; its
scene file renders with a 4096 shadow map and 4x multisampling, which costs ~10x per frame
on a software renderer, so both are switched off here. Its `gripper` servo is not modelled:
the servo angle the real robot reports and is commanded in is mapped linearly to finger travel
with the constants gym-aloha and the ALOHA profile share (profiles.GRIPPER_*).

`AlohaSim` steps the physics (DT = 0.02 s, 10 substeps of 2 ms) and renders only the cameras
asked for. `Controller` is a joint_trajectory_controller for one joint group: it accepts what
the real one accepts (oxygen_ros.sim.jtc), interpolates cubically through positions and velocities
from where the joints were when the trajectory arrived, and holds the last point after it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from oxygen_ros.robot.aloha import (
    ARM_JOINTS,
    CAMERAS,
    SIDES,
    finger_from_normalized,
)
from oxygen_ros.robot.stamps import seconds
from oxygen_ros.sim.jtc import jtc_problems

TASKS = {'insertion': 'bimanual_viperx_insertion.xml',
         'transfer_cube': 'bimanual_viperx_transfer_cube.xml'}
DT = 0.02
SUCCESS_REWARD = 4


class Unstable(RuntimeError):
    """The physics diverged (MuJoCo's bad-acceleration warning): the episode is over."""


def hermite(t, t0, p0, v0, t1, p1, v1):
    """Cubic through (t0, p0, v0) and (t1, p1, v1), at t in [t0, t1]: position, velocity."""
    h = t1 - t0
    if h <= 0:
        return p1, v1
    s = (t - t0) / h
    h00, h10 = 2 * s**3 - 3 * s**2 + 1, s**3 - 2 * s**2 + s
    h01, h11 = -2 * s**3 + 3 * s**2, s**3 - s**2
    pos = h00 * p0 + h10 * h * v0 + h01 * p1 + h11 * h * v1
    d00, d10 = (6 * s**2 - 6 * s) / h, 3 * s**2 - 4 * s + 1
    d01, d11 = (-6 * s**2 + 6 * s) / h, 3 * s**2 - 2 * s
    return pos, d00 * p0 + d10 * v0 + d01 * p1 + d11 * v1


@dataclass
class Segments:
    """One accepted trajectory in controller joint order, times absolute (s)."""

    times: np.ndarray  # [n] point times
    pos: np.ndarray  # [n, joints]
    vel: np.ndarray | None  # [n, joints], None: positions only (linear, as JTC)
    t0: float  # when it arrived: the point before the first one
    p0: np.ndarray = field(default_factory=lambda: np.zeros(0))
    v0: np.ndarray = field(default_factory=lambda: np.zeros(0))


class Controller:
    """joint_trajectory_controller for one joint group, on the simulation's clock."""

    def __init__(self, joints: list[str], position: np.ndarray, open_loop: bool = False):
        """open_loop: JTC's open_loop_control, each new trajectory starts from the last
        command instead of the measured state."""
        self.joints = list(joints)
        self.open_loop = open_loop
        self.hold(position)
        self.accepted = 0
        self.rejected: list[str] = []

    def hold(self, position):
        """Hold `position` (the controller's state on activation or after a reset)."""
        self.traj = None
        self.hold_at = np.array(position, float)

    def receive(self, msg, now: float, position, velocity) -> str:
        """Take a trajectory_msgs/JointTrajectory arriving at sim time `now` with the joints
        at `position`/`velocity`. '' = accepted; else why it was rejected (the current
        trajectory, or the hold, goes on)."""
        problems = jtc_problems(msg, self.joints, now)
        if problems:
            why = '; '.join(problems)
            self.rejected.append(why)
            return why
        order = [list(msg.joint_names).index(j) for j in self.joints]
        stamp = seconds(msg.header.stamp)
        start = stamp if stamp > 0 else now
        times = np.array([start + seconds(p.time_from_start) for p in msg.points])
        pos = np.array([[p.positions[i] for i in order] for p in msg.points], float)
        has_vel = all(len(p.velocities) for p in msg.points)
        vel = (np.array([[p.velocities[i] for i in order] for p in msg.points], float)
               if has_vel else None)
        if self.open_loop:
            # Where the command is now (JTC's last commanded state), moving as it moves.
            position, velocity = self.state(now)
        # Closed loop (Jazzy's default): where the joints are now is the point before the
        # first.
        self.traj = Segments(times, pos, vel, now, np.array(position, float),
                             np.array(velocity, float))
        self.accepted += 1
        return ''

    def sample(self, t: float) -> np.ndarray:
        """Position command at sim time t."""
        return self.state(t)[0]

    def state(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        """(position, velocity) commanded at sim time t."""
        tr = self.traj
        rest = np.zeros_like(self.hold_at)
        if tr is None:
            return self.hold_at, rest
        if t >= tr.times[-1]:
            self.hold(tr.pos[-1])
            return self.hold_at, rest
        k = int(np.searchsorted(tr.times, t, side='right'))  # first point after t
        if k == 0:
            ta, pa, va = tr.t0, tr.p0, tr.v0
            if t < ta:  # before it arrived (not sampled so)
                return tr.p0, tr.v0
        else:
            ta, pa = tr.times[k - 1], tr.pos[k - 1]
            va = tr.vel[k - 1] if tr.vel is not None else None
        tb, pb = tr.times[k], tr.pos[k]
        if tr.vel is None:
            s = (t - ta) / (tb - ta) if tb > ta else 1.0
            return pa + s * (pb - pa), (pb - pa) / (tb - ta) if tb > ta else rest
        vb = tr.vel[k]
        if va is None:
            va = np.zeros_like(pa)
        return hermite(t, ta, pa, va, tb, pb, vb)


def require():
    """SystemExit with what to install where the optional simulator is missing."""
    import importlib.util

    missing = [m for m in ('gym_aloha', 'dm_control', 'mujoco')
               if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f'the MuJoCo ALOHA needs {", ".join(missing)}: pip install -r '
                         'requirements-mujoco.txt (tools/ws.sh sim-setup)')


def egl():
    # Headless: MuJoCo's EGL backend (Mesa's llvmpipe where there is no GPU). Set before
    # dm_control or mujoco first renders.
    os.environ.setdefault('MUJOCO_GL', 'egl')
    os.environ.setdefault('PYOPENGL_PLATFORM', os.environ['MUJOCO_GL'])


class AlohaSim:
    """gym-aloha's scene for `task`, stepped at DT, rendering without shadows and AA."""

    def __init__(self, task: str = 'insertion', width: int = 640, height: int = 480):
        if task not in TASKS:
            raise ValueError(f'unknown task {task!r}; choose one of {sorted(TASKS)}')
        egl()
        from dm_control import mujoco
        from gym_aloha.constants import ASSETS_DIR
        from gym_aloha.tasks import sim as tasks

        self.task_name = task
        self.width, self.height = width, height
        self.physics = mujoco.Physics.from_xml_path(str(ASSETS_DIR / TASKS[task]))
        quality = self.physics.model.vis.quality
        quality.shadowsize = 0
        quality.offsamples = 0
        self._tasks = tasks
        self.task = tasks.InsertionTask() if task == 'insertion' else tasks.TransferCubeTask()
        self.substeps = int(round(DT / self.physics.timestep()))
        model = self.physics.model
        self.qpos_index = {}  # (side, joint) -> qpos address
        for side in SIDES:
            for j in ARM_JOINTS + ['left_finger', 'right_finger']:
                jid = model.name2id(f'vx300s_{side}/{j}', 'joint')
                self.qpos_index[(side, j)] = int(model.jnt_qposadr[jid])
        self.steps = 0
        # MuJoCo's time restarts at 0 on a reset; the simulation's clock (/clock) must not.
        self._offset = 0.0
        self.reset(0)

    def joint_range(self, side: str, joint: str) -> tuple[float, float]:
        model = self.physics.model
        lo, hi = model.jnt_range[model.name2id(f'vx300s_{side}/{joint}', 'joint')]
        return float(lo), float(hi)

    def reset(self, seed: int | None):
        """A new episode as gym-aloha's env.reset(seed) lays it out: the arms at its start
        pose, the objects at the poses it samples from the seed."""
        from gym_aloha.utils import sample_box_pose, sample_insertion_pose

        if self.task_name == 'insertion':
            pose = np.concatenate(sample_insertion_pose(seed))
        else:
            pose = sample_box_pose(seed)
        self._tasks.BOX_POSE[0] = pose
        before = self.time
        self.task.initialize_episode(self.physics)
        self._offset = before - float(self.physics.data.time)
        self.steps = 0
        self.reward = 0.0

    @property
    def time(self) -> float:
        """Simulated seconds since the start, across resets."""
        return self._offset + float(self.physics.data.time)

    def positions(self, side: str) -> np.ndarray:
        """[6 arm joints, left_finger, right_finger] of one follower."""
        q = self.physics.data.qpos
        return np.array([q[self.qpos_index[(side, j)]]
                         for j in ARM_JOINTS + ['left_finger', 'right_finger']])

    def velocities(self, side: str) -> np.ndarray:
        v = self.physics.data.qvel
        # The arm's joints are hinges and slides: one dof each, qvel address = qpos address.
        return np.array([v[self.qpos_index[(side, j)]]
                         for j in ARM_JOINTS + ['left_finger', 'right_finger']])

    def set_targets(self, arm: dict, finger: dict):
        """Actuator targets: arm[side] six joint positions, finger[side] left_finger (m)."""
        ctrl = np.concatenate([np.concatenate([arm[s], [finger[s], -finger[s]]]) for s in SIDES])
        self.physics.set_control(ctrl)

    def substep(self, n: int = 1):
        """Raises Unstable where MuJoCo gave up on the state (it resets it then)."""
        from dm_control.rl.control import PhysicsError

        before = self.time
        try:
            self.physics.step(n)
        except PhysicsError as e:
            self._offset = before - float(self.physics.data.time)
            raise Unstable(f'{e} at {self.time:.3f} s') from None

    def end_step(self) -> float:
        """After a step's substeps: the task's reward (0..4, 4 = success)."""
        self.steps += 1
        self.reward = float(self.task.get_reward(self.physics))
        return self.reward

    def step(self, action: np.ndarray) -> float:
        """gym-aloha's action (14: arm joints, normalised gripper, per side) for one DT."""
        a = np.asarray(action, float)
        arm = {'left': a[:6], 'right': a[7:13]}
        finger = {'left': finger_from_normalized(a[6]), 'right': finger_from_normalized(a[13])}
        self.set_targets(arm, finger)
        self.substep(self.substeps)
        return self.end_step()

    def render(self, camera: str) -> np.ndarray:
        """HxWx3 uint8 RGB from a ROS camera name (cam_high, ...) or a gym-aloha one."""
        return self.physics.render(self.height, self.width, camera_id=CAMERAS.get(camera, camera))

    def state(self) -> np.ndarray:
        """The ALOHA profile's 14-d state: [6 joints, left_finger (m)] per side."""
        return np.concatenate([self.positions(s)[:7] for s in SIDES])
