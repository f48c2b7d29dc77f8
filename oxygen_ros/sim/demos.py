"""Scripted demonstrations of gym-aloha's transfer-cube, in ACT's HDF5 layout.

    oxygen-demos --task transfer_cube --episodes 50 --seed 0 --out DIR \
        [--cameras top [angle ...]] [--image-size 480x640] [--compression gzip]
    oxygen-demos --check DIR_OR_FILE [...]

Episode i has seed SEED + i (gym-aloha's cube pose for that seed). The script plans the
grippers' poses from the cube's position (ACT's method: waypoints from the cube pose), turns
them into joint targets with MuJoCo's kinematics of the joint-space scene itself (damped
least squares on mj_jac; no mocap scene), and plays them as an evaluation does:
AlohaSim.step with 14-d actions (six joint targets and the normalised gripper per arm),
400 steps of 0.02 s. The plan depends on the cube pose only, so the episode's /action
replayed in a fresh scene of the same seed gives the same states.

The right gripper points straight down and closes across the cube (fingers along y), lifts
it to a point between the arms; the left gripper comes in level from the left with its
fingers turned upright, closes on the cube from above and below, the right one
opens and leaves, and the left carries the cube away. An episode is kept only when
gym-aloha's reward is 4 (the left gripper touches the cube, the table does not) and, checked
apart from that reward, through the last HOLD_STEPS steps the cube is in the air, held by
the left gripper (Observer.gripped) with nothing else touching it, and keeps its place in
the left gripper while that gripper moves.

Each file, episode_<k>.hdf5 (k counts kept episodes), holds ACT's datasets (float32 as ACT
writes them; observation t is the state before action t):
  /observations/qpos [T, 14]   6 joints + gripper per arm (left, right), gripper normalised
                               0 closed .. 1 open, as gym-aloha's observation
  /observations/qvel [T, 14]   their velocities (gripper per unit of the normalised range)
  /observations/images/<cam> [T, H, W, 3] uint8 for each camera asked for
  /action [T, 14]              the joint targets and normalised gripper commands played
  attrs: sim=True, task, prompt, seed, source ('script'; 'policy' for the closed-loop
         episodes oxygen-eval --direct --record writes in this layout), cube_pose
         (gym-aloha's sampled pose: xyz, quat wxyz),
         dt, max_reward, final_reward, success_step (the first action after which the
         reward is 4)
and per step, for language training (outside /observations, where converters look for
cameras):
  /language/phase [T] str      the script's phase of action t, one of PHASES in that order
                               (a policy's episode: closed_loop_phase, from the scene)
  /language/cube_in_left [T], cube_in_right [T], cube_lifted [T] bool: the state at
                               observation t (contacts and positions, not the script's intent);
                               each dataset's `question` attribute is the yes/no question.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from oxygen_ros.robot.aloha import ARM_JOINTS, CAMERAS, SIDES
from oxygen_ros.robot.profiles import GRIPPER_POSITION_CLOSE, GRIPPER_POSITION_OPEN
from oxygen_ros.sim.aloha_sim import DT, SUCCESS_REWARD

STEPS = 400  # ACT's and LeRobot's episode length for transfer-cube (8 s)
HOLD_STEPS = 25  # the last steps in which the cube must be held by the left gripper alone
PROMPT = 'Pick up the cube with the right arm and transfer it to the left arm.'  # LeRobot's
# (phase, last step): the script's timeline; every episode runs through all, in this order.
PHASES = (('reaching for the cube', 110),
          ('grasping the cube', 140),
          ('lifting the cube', 210),
          ('handing the cube over', 270),
          ('releasing the cube', 310),
          ('holding the cube', STEPS))
QUESTIONS = {'cube_in_left': 'Is the cube in the left gripper?',
             'cube_in_right': 'Is the cube in the right gripper?',
             'cube_lifted': 'Is the cube lifted off the table?'}
ANSWERS = {True: 'yes', False: 'no'}  # the text of an answer, as oxygen-train teaches it
# The point between the finger pads, in gripper_link's frame: the pads are the last 3 cm of
# the fingers (0.124..0.154 m along x); this is a centimetre short of the tips, so that a
# cube centred on it is gripped over most of the pads' length.
TCP = np.array([0.14, 0.0, 0.0])
MEET = np.array([0.02, 0.5, 0.22])  # where the cube is handed over, between the arms
ABOVE = 0.10  # the right gripper's stop above the cube before it descends
CARRY = np.array([-0.06, 0.0, 0.05])  # the left gripper's move with the cube at the end
LIFTED = 0.01  # m between the cube's lowest point and the table: lifted
# A finger face within this of the cube is on it: a held cube's contacts chatter (a finger's
# contact comes and goes from one 2 ms substep to the next, within micrometres), while an
# opening finger is a few tenths of a millimetre off the cube after a step.
GRIP_TOL = 1e-4
FINGERS = {s: (f'vx300s_{s}/10_left_gripper_finger', f'vx300s_{s}/10_right_gripper_finger')
           for s in SIDES}


def frame(x, y) -> np.ndarray:
    """Rotation whose columns are x, y (made orthogonal to x) and x cross y."""
    x = np.asarray(x, float) / np.linalg.norm(x)
    y = np.asarray(y, float) - x * (x @ np.asarray(y, float))
    y /= np.linalg.norm(y)
    return np.column_stack([x, y, np.cross(x, y)])


# Right: pointing down, fingers closing along world y (the cube's faces; it is never turned).
RIGHT_GRIP = frame([0, 0, -1], [0, -1, 0])
# Left: level along +x, turned a quarter about its axis: fingers close along z.
LEFT_GRIP = frame([1, 0, 0], [0, 0, 1])


class PlanError(RuntimeError):
    """No joint targets reach a pose the script asks for."""


class Kinematics:
    """Forward kinematics and IK of each arm's gripper on the scene's own model, in a private
    MjData (the simulation's state is never touched)."""

    def __init__(self, model):
        import mujoco

        self.mj = mujoco
        self.model = model
        self.data = mujoco.MjData(model)
        self.qadr, self.dofs, self.range, self.body = {}, {}, {}, {}
        for s in SIDES:
            ids = [mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, f'vx300s_{s}/{j}')
                   for j in ARM_JOINTS]
            self.qadr[s] = np.array([model.jnt_qposadr[i] for i in ids])
            self.dofs[s] = np.array([model.jnt_dofadr[i] for i in ids])
            self.range[s] = np.array([model.jnt_range[i] for i in ids])
            self.body[s] = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY,
                                             f'vx300s_{s}/gripper_link')

    def fk(self, side: str, q) -> tuple[np.ndarray, np.ndarray]:
        """TCP position and gripper rotation (world) for the arm's six joints."""
        d = self.data
        d.qpos[self.qadr[side]] = q
        self.mj.mj_kinematics(self.model, d)
        self.mj.mj_comPos(self.model, d)  # mj_jac reads the dof frames it computes
        rot = d.xmat[self.body[side]].reshape(3, 3).copy()
        return d.xpos[self.body[side]] + rot @ TCP, rot

    def ik(self, side: str, seed, pos, rot, iters: int = 200) -> tuple[np.ndarray, float, float]:
        """Joints from `seed` towards the TCP at pos with gripper rotation rot: (q, position
        error m, rotation error rad). Steps are capped, so it stays on the seed's branch."""
        mj = self.mj
        q = np.array(seed, float)
        jp, jr = np.zeros((3, self.model.nv)), np.zeros((3, self.model.nv))
        quat, er = np.zeros(4), np.zeros(3)
        w = 0.3  # m per rad: weighs rotation against position
        for _ in range(iters):
            p, r = self.fk(side, q)
            ep = pos - p
            mj.mju_mat2Quat(quat, np.ascontiguousarray(rot @ r.T).ravel())
            mj.mju_quat2Vel(er, quat, 1.0)
            if np.linalg.norm(ep) < 1e-6 and np.linalg.norm(er) < 1e-5:
                break
            mj.mj_jac(self.model, self.data, jp, jr, p, self.body[side])
            jac = np.vstack([jp[:, self.dofs[side]], w * jr[:, self.dofs[side]]])
            dq = jac.T @ np.linalg.solve(jac @ jac.T + 1e-6 * np.eye(6),
                                         np.concatenate([ep, w * er]))
            dq *= min(1.0, 0.1 / max(np.abs(dq).max(), 1e-12))
            q = np.clip(q + dq, self.range[side][:, 0], self.range[side][:, 1])
        return q, float(np.linalg.norm(ep)), float(np.linalg.norm(er))

    def solve(self, side: str, prev, pos, rot) -> np.ndarray:
        """A waypoint's joints: of the solutions from the previous waypoint's joints and from
        a few canonical postures, the nearest to the previous one with the forearm least
        rolled (the other branch rolls it half a turn, which its weak servo follows badly)."""
        seeds = [prev, [0, 0, 0.8, 0, 0.8, 0], [0, -0.5, 1.0, 0, 0.5, 0],
                 [0, 0, 0.8, 0, 0, 0]]
        best = None
        for seed in seeds:
            q, ep, er = self.ik(side, seed, pos, rot)
            if ep < 1e-4 and er < 1e-3:
                cost = np.abs(q - prev).sum() + 2 * abs(q[3])
                if best is None or cost < best[0]:
                    best = (cost, q)
        if best is None:
            raise PlanError(f'the {side} gripper cannot reach {np.round(pos, 3).tolist()}')
        return best[1]


@dataclass
class Key:
    """A waypoint of one arm, reached at the end of `step`."""

    step: int
    pos: np.ndarray | None  # TCP (world, m); None: where the arm starts
    rot: np.ndarray | None  # gripper rotation (world); None: as at the start
    grip: float  # normalised gripper: 0 closed .. 1 open
    line: bool = False  # a straight TCP line from the previous key (IK every step), else
    # joint-space interpolation between the two keys' IK solutions (long moves)


def transfer_cube_plan(cube) -> dict[str, list[Key]]:
    """Both arms' waypoints for a cube resting with its centre at `cube` (world, m)."""
    c = np.asarray(cube, float)
    up = np.array([0.0, 0.0, 1.0])
    end = dict(PHASES)
    reached = end['reaching for the cube']  # above the cube by step 70, then down around it
    grasped = end['grasping the cube']  # closed by step 130: the command is the finger's
    # lower stop, so it keeps squeezing
    met = end['lifting the cube']  # up 6 cm, then to the meeting point
    handed = end['handing the cube over']  # the left gripper in by 245, closed by 265
    released = end['releasing the cube']  # open by 288, then 4 cm up
    away = MEET + [0.12, 0, 0]
    right = [Key(0, None, None, 1),
             Key(70, c + ABOVE * up, RIGHT_GRIP, 1),
             Key(reached, c, RIGHT_GRIP, 1, True),
             Key(130, c, RIGHT_GRIP, 0, True),
             Key(grasped, c, RIGHT_GRIP, 0, True),
             Key(160, c + 0.06 * up, RIGHT_GRIP, 0, True),
             Key(met, MEET, RIGHT_GRIP, 0),
             Key(handed, MEET, RIGHT_GRIP, 0, True),
             Key(288, MEET, RIGHT_GRIP, 1, True),
             Key(released, MEET + 0.04 * up, RIGHT_GRIP, 1, True),
             Key(350, away, RIGHT_GRIP, 1),
             Key(STEPS, away, RIGHT_GRIP, 1, True)]
    # The left TCP goes to the cube's centre too: its fingers above and below the cube, clear
    # of the right ones on its sides (either way 12 mm off still succeeds).
    before = MEET - [0.10, 0, 0]
    left = [Key(0, None, None, 1),
            Key(150, before, LEFT_GRIP, 1),
            Key(met, before, LEFT_GRIP, 1, True),
            Key(245, MEET, LEFT_GRIP, 1, True),
            Key(265, MEET, LEFT_GRIP, 0, True),
            Key(320, MEET, LEFT_GRIP, 0, True),
            Key(STEPS, MEET + CARRY, LEFT_GRIP, 0, True)]
    return {'left': left, 'right': right}


def smooth(s: float) -> float:
    """Minimum-jerk profile: 0 -> 1 with zero velocity and acceleration at both ends."""
    return s * s * s * (10 - 15 * s + 6 * s * s)


def slerp(ra, rb, s: float) -> np.ndarray:
    """The rotation a fraction s of the way from ra to rb (about one fixed axis)."""
    import mujoco

    quat, w = np.zeros(4), np.zeros(3)
    mujoco.mju_mat2Quat(quat, np.ascontiguousarray(ra.T @ rb).ravel())
    mujoco.mju_quat2Vel(w, quat, 1.0)  # rotation vector of ra -> rb, in ra's frame
    angle = np.linalg.norm(w) * s
    if angle < 1e-12:
        return ra.copy()
    k = w / np.linalg.norm(w)
    kx = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    return ra @ (np.eye(3) + np.sin(angle) * kx + (1 - np.cos(angle)) * kx @ kx)


def arm_targets(kin: Kinematics, side: str, start, keys: list[Key],
                steps: int = STEPS) -> np.ndarray:
    """[steps, 7]: six joint targets and the normalised gripper for each action."""
    p0, r0 = kin.fk(side, start)
    pos = [p0 if k.pos is None else np.asarray(k.pos, float) for k in keys]
    rot = [r0 if k.rot is None else k.rot for k in keys]
    sol = [np.array(start, float)]
    for i in range(1, len(keys)):
        sol.append(kin.solve(side, sol[-1], pos[i], rot[i]))
    out = np.zeros((steps, 7))
    q = sol[0]
    for n in range(steps):
        t = n + 1  # action n takes the arm to where it should be at the end of step n + 1
        i = next((i for i in range(1, len(keys)) if keys[i].step >= t), len(keys) - 1)
        a, b = keys[i - 1], keys[i]
        s = smooth(min(max((t - a.step) / max(b.step - a.step, 1), 0.0), 1.0))
        if b.line:
            q, ep, er = kin.ik(side, q, pos[i - 1] + s * (pos[i] - pos[i - 1]),
                               slerp(rot[i - 1], rot[i], s))
            if ep > 1e-3 or er > 1e-2:
                raise PlanError(f'the {side} gripper leaves its line at step {n} '
                                f'({ep * 1000:.1f} mm, {er:.3f} rad off)')
        else:
            q = sol[i - 1] + s * (sol[i] - sol[i - 1])
        out[n, :6] = q
        out[n, 6] = a.grip + s * (b.grip - a.grip)
    return out


def phase_names(steps: int = STEPS) -> list[str]:
    names = []
    for name, last in PHASES:
        names += [name] * (min(last, steps) - len(names))
    return names


def normalized_finger(x):
    return (np.asarray(x, float) - GRIPPER_POSITION_CLOSE) / (
        GRIPPER_POSITION_OPEN - GRIPPER_POSITION_CLOSE)


class Observer:
    """What the scene's state says about the cube: contacts and positions."""

    def __init__(self, sim):
        import mujoco

        self.sim = sim
        m = sim.physics.model.ptr
        self.box = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_GEOM, 'red_box')
        self.box_body = int(m.geom_bodyid[self.box])
        self.half = m.geom_size[self.box].copy()
        self.names = {i: mujoco.mj_id2name(m, mujoco.mjtObj.mjOBJ_GEOM, i) or str(i)
                      for i in range(m.ngeom)}
        # (left_finger's geom, right_finger's geom) of each gripper, and as a set.
        self.pair = {s: tuple(mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_GEOM, g)
                              for g in FINGERS[s]) for s in SIDES}
        self.fingers = {s: set(p) for s, p in self.pair.items()}
        self.grip_body = {s: mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_BODY,
                                               f'vx300s_{s}/gripper_link') for s in SIDES}
        # Each finger's mesh vertices (geom frame): the extremes of its collision hull.
        self.verts = {}
        for g in set().union(*self.fingers.values()):
            mesh = m.geom_dataid[g]
            adr = m.mesh_vertadr[mesh]
            self.verts[g] = m.mesh_vert[adr:adr + m.mesh_vertnum[mesh]].copy()
        # The table's top: its mesh's bounding box, turned into the world.
        t = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_GEOM, 'table')
        d = sim.physics.data.ptr
        rot = d.geom_xmat[t].reshape(3, 3)
        self.table = float(d.geom_xpos[t][2] + rot[2] @ m.geom_aabb[t][:3]
                           + np.abs(rot[2]) @ m.geom_aabb[t][3:])

    def touching(self) -> set[int]:
        """Geoms in contact with the cube."""
        d = self.sim.physics.data.ptr
        g1, g2 = d.contact.geom1[:d.ncon], d.contact.geom2[:d.ncon]
        return {int(b if a == self.box else a) for a, b in zip(g1, g2, strict=True)
                if self.box in (a, b)}

    def pose(self) -> np.ndarray:
        """The cube's free joint: position, quaternion (wxyz)."""
        m = self.sim.physics.model.ptr
        adr = m.jnt_qposadr[m.body_jntadr[self.box_body]]
        return np.array(self.sim.physics.data.qpos[adr:adr + 7])

    def cube(self) -> tuple[np.ndarray, np.ndarray]:
        d = self.sim.physics.data.ptr
        return d.xpos[self.box_body].copy(), d.xmat[self.box_body].reshape(3, 3).copy()

    def lowest(self) -> float:
        """Height of the cube's lowest corner."""
        p, r = self.cube()
        return float(p[2] - np.abs(r[2]) @ self.half)

    def gaps(self, side: str) -> tuple[float, float]:
        """How far each finger's inner face is from the cube along the axis the fingers close
        on (negative: pressed into it). Planes, not mj_geomDistance: that returns 0 for some
        clearly separated mesh-box pairs (mujoco#3383)."""
        d = self.sim.physics.data.ptr
        n = d.xmat[self.grip_body[side]].reshape(3, 3)[:, 1]  # left_finger slides along +y
        c, r = self.cube()
        centre, reach = c @ n, np.abs(r.T @ n) @ self.half
        upper, lower = (self.face(g, n) for g in self.pair[side])
        return float(upper.min() - (centre + reach)), float((centre - reach) - lower.max())

    def face(self, geom: int, n) -> np.ndarray:
        """A finger's hull vertices along n (world)."""
        d = self.sim.physics.data.ptr
        rot = d.geom_xmat[geom].reshape(3, 3)
        return d.geom_xpos[geom] @ n + self.verts[geom] @ (rot.T @ n)

    def gripped(self, side: str, touch: set[int] | None = None) -> bool:
        """The gripper holds the cube: a finger touches it and both fingers' faces are on
        it (within GRIP_TOL; the one that does not touch is chattering)."""
        touch = self.touching() if touch is None else touch
        return bool(self.fingers[side] & touch) and max(self.gaps(side)) <= GRIP_TOL

    def answers(self, touch: set[int] | None = None) -> dict[str, bool]:
        touch = self.touching() if touch is None else touch
        return {'cube_in_left': self.gripped('left', touch),
                'cube_in_right': self.gripped('right', touch),
                'cube_lifted': self.lowest() >= self.table + LIFTED}

    def facts(self) -> dict[str, bool]:
        """answers, and whether anything but the left fingers touches the cube: at the end
        of a transfer the cube is held in the air by the left gripper alone."""
        touch = self.touching()
        return {**self.answers(touch),
                'cube_touched_elsewhere': bool(touch - self.fingers['left'])}

    def in_gripper(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """The cube's centre in the gripper's frame, and the gripper's position (world)."""
        d = self.sim.physics.data.ptr
        b = self.grip_body[side]
        rot = d.xmat[b].reshape(3, 3)
        return (self.cube()[0] - d.xpos[b]) @ rot, d.xpos[b].copy()


def transferred(facts: dict[str, bool]) -> bool:
    """The cube handed over: in the air, in the left gripper, touched by nothing else."""
    return (facts['cube_in_left'] and facts['cube_lifted'] and not facts['cube_in_right']
            and not facts['cube_touched_elsewhere'])


def phases_for(facts: dict[str, bool]) -> tuple[str, ...]:
    """The PHASES the scene's state agrees with. In closed loop no script's clock says which
    phase it is, so a narration is right when it names one of these: a phase agrees with the
    facts the script's own episodes show in it (reaching: the cube in neither gripper;
    grasping: not in the left, on the table; lifting: in the right, not the left; handing
    over: in the right, in the air; releasing: in the left, in the air; holding: in the left
    alone, in the air)."""
    left, right, up = facts['cube_in_left'], facts['cube_in_right'], facts['cube_lifted']
    agree = {'reaching for the cube': not left and not right,
             'grasping the cube': not left and not up,
             'lifting the cube': right and not left,
             'handing the cube over': right and up,
             'releasing the cube': left and up,
             'holding the cube': left and up and not right}
    return tuple(p for p, _ in PHASES if agree[p])


def closed_loop_phase(step: int, facts: dict[str, bool]) -> str:
    """What a step of a policy's own episode is narrated as, for training: the script's
    phase at that step when the scene agrees with it, else the agreeing phase nearest to it
    in PHASES' order (the earlier of two as near): a grasp that closed on air is still
    'grasping the cube' when the script's clock says 'lifting'. When no phase agrees (the
    cube in the left gripper on the table, say), the script's."""
    names = [p for p, _ in PHASES]
    clock = next((p for p, last in PHASES if step < last), PHASES[-1][0])
    agree = phases_for(facts)
    if not agree or clock in agree:
        return clock
    at = names.index(clock)
    return min(agree, key=lambda p: (abs(names.index(p) - at), names.index(p)))


def held_problem(trace: list[dict], names: dict[int, str], left: set[int]) -> str:
    """'' when, through the trace (the last steps), the cube is in the air, held by the left
    gripper with nothing else touching it, and moves with that gripper; else what was
    wrong."""
    for t in trace:
        if t['lowest'] < LIFTED:
            return f'step {t["step"]}: cube {t["lowest"] * 100:.1f} cm above the table'
        if t['touch'] - left:
            return f'step {t["step"]}: cube touches {sorted(names[g] for g in t["touch"] - left)}'
        if not t['gripped']:
            return f'step {t["step"]}: the left fingers are not both on the cube'
    rel = np.array([t['rel'] for t in trace])
    grip = np.array([t['grip'] for t in trace])
    slip = float(np.linalg.norm(rel - rel[0], axis=1).max())
    moved = float(np.linalg.norm(grip - grip[0], axis=1).max())
    if moved < 0.01:
        return f'the left gripper moved {moved * 1000:.1f} mm in the last steps: no proof'
    if slip > 0.003:
        return f'the cube slipped {slip * 1000:.1f} mm in the left gripper'
    return ''


@dataclass
class Episode:
    seed: int
    cube_pose: np.ndarray
    qpos: np.ndarray  # [T, 14] float32
    qvel: np.ndarray
    action: np.ndarray
    rewards: list[float]
    answers: dict[str, np.ndarray]
    images: dict[str, np.ndarray] = field(default_factory=dict)
    problem: str = ''  # '' = a success
    wall_s: float = 0.0
    # Who chose the actions: 'script' (phases: the script's timeline) or 'policy' (a closed
    # loop oxygen-eval --record kept; phases: closed_loop_phase of each step).
    source: str = 'script'
    phases: list[str] | None = None

    @property
    def success(self) -> bool:
        return not self.problem


def observe(sim) -> tuple[np.ndarray, np.ndarray]:
    """gym-aloha's qpos and qvel observations (ACT's): joints, normalised gripper."""
    span = GRIPPER_POSITION_OPEN - GRIPPER_POSITION_CLOSE
    q = np.concatenate([np.r_[sim.positions(s)[:6], normalized_finger(sim.positions(s)[6])]
                        for s in SIDES])
    v = np.concatenate([np.r_[sim.velocities(s)[:6], sim.velocities(s)[6] / span]
                        for s in SIDES])
    return q, v


def plan_actions(sim, kin: Kinematics, steps: int = STEPS) -> np.ndarray:
    """The script's [steps, 14] actions for the scene as it was just reset."""
    obs = Observer(sim)
    pos, _ = obs.cube()
    rest = np.array([pos[0], pos[1], obs.table + obs.half[2]])  # it drops onto the table
    keys = transfer_cube_plan(rest)
    arms = [arm_targets(kin, s, sim.positions(s)[:6], keys[s], steps) for s in SIDES]
    return np.concatenate(arms, axis=1)


class Views:
    """The cameras of AlohaSim.render, each kept from frame to frame (a new one per frame
    costs a fifth more on a software renderer); the same pictures."""

    def __init__(self, sim, cameras: tuple[str, ...]):
        from dm_control.mujoco import Camera

        self.cams = {c: Camera(sim.physics, sim.height, sim.width, CAMERAS.get(c, c))
                     for c in cameras}

    def render(self) -> dict[str, np.ndarray]:
        # A camera renders into one buffer of its own: the caller copies each picture.
        return {c: cam.render() for c, cam in self.cams.items()}


def run(sim, kin: Kinematics, seed: int, views: Views | None = None,
        steps: int = STEPS, actions: np.ndarray | None = None) -> Episode:
    """One episode of `seed`: the script's actions (or `actions`) played through
    AlohaSim.step, with what the dataset records (the cameras of `views`) and whether it
    succeeded."""
    from oxygen_ros.sim.aloha_sim import Unstable

    t0 = time.monotonic()
    cameras = tuple(views.cams) if views else ()
    sim.reset(seed)
    obs = Observer(sim)
    pose = obs.pose()  # as the reset set it
    problem = ''
    if actions is None:
        try:
            actions = plan_actions(sim, kin, steps)
        except PlanError as e:
            actions, problem = np.zeros((0, 14)), str(e)
    # Played as the file stores them (float32), so that replaying the file is this episode.
    actions = np.asarray(actions, np.float32).astype(float)
    n = len(actions)
    qpos, qvel = np.zeros((n, 14)), np.zeros((n, 14))
    answers = {k: np.zeros(n, bool) for k in QUESTIONS}
    images = {c: np.zeros((n, sim.height, sim.width, 3), np.uint8) for c in cameras}
    rewards, trace = [], []
    for t, a in enumerate(actions):
        qpos[t], qvel[t] = observe(sim)
        for k, v in obs.answers().items():
            answers[k][t] = v
        for c, img in (views.render() if views else {}).items():
            images[c][t] = img
        try:
            rewards.append(sim.step(a))
        except Unstable as e:
            problem = f'physics unstable at step {t}: {e}'
            break
        if t >= n - HOLD_STEPS:
            rel, grip = obs.in_gripper('left')
            trace.append({'step': t, 'lowest': obs.lowest() - obs.table,
                          'touch': obs.touching(), 'gripped': obs.gripped('left'),
                          'rel': rel, 'grip': grip})
    if not problem:
        if not rewards or rewards[-1] < SUCCESS_REWARD:
            problem = f'reward {rewards[-1] if rewards else 0:g} at the end'
        else:
            problem = held_problem(trace, obs.names, obs.fingers['left'])
    return Episode(seed, pose, qpos.astype(np.float32), qvel.astype(np.float32),
                   np.asarray(actions, np.float32), rewards, answers,
                   images, problem,
                   time.monotonic() - t0)


# -- files ----------------------------------------------------------------------------------

def write(path: Path, ep: Episode, compression: str | None = 'gzip'):
    """ACT's layout plus /language; written under a temporary name, then renamed, so a
    file named episode_*.hdf5 is always whole."""
    import h5py

    tmp = path.with_name(path.name + '.part')
    opts = {'compression': compression} if compression else {}
    if compression == 'gzip':
        opts['compression_opts'] = 1  # level 4 saves a fifth more for twice the time
    with h5py.File(tmp, 'w') as f:
        f.attrs['sim'] = True
        f.attrs['task'] = 'transfer_cube'
        f.attrs['prompt'] = PROMPT
        f.attrs['seed'] = ep.seed
        f.attrs['source'] = ep.source
        f.attrs['cube_pose'] = ep.cube_pose
        f.attrs['dt'] = DT
        f.attrs['max_reward'] = max(ep.rewards)
        f.attrs['final_reward'] = ep.rewards[-1]
        # The first action after which gym-aloha's reward is 4 (-1: never).
        f.attrs['success_step'] = next(
            (t for t, r in enumerate(ep.rewards) if r >= SUCCESS_REWARD), -1)
        f.create_dataset('observations/qpos', data=ep.qpos)
        f.create_dataset('observations/qvel', data=ep.qvel)
        images = f.create_group('observations/images')
        for cam, frames in ep.images.items():
            # One frame a chunk, as ACT: a reader of one step decompresses one frame.
            images.create_dataset(cam, data=frames, chunks=(1, *frames.shape[1:]), **opts)
        f.create_dataset('action', data=ep.action)
        lang = f.create_group('language')
        phases = lang.create_dataset('phase', data=ep.phases or phase_names(len(ep.action)),
                                     dtype=h5py.string_dtype())
        phases.attrs['phases'] = [p for p, _ in PHASES]
        for k, q in QUESTIONS.items():
            lang.create_dataset(k, data=ep.answers[k]).attrs['question'] = q
    os.replace(tmp, path)


def check(path: Path) -> list[str]:
    """What is wrong with an episode file's layout ([] when it reads as ACT's and ours)."""
    import h5py

    bad = []
    with h5py.File(path, 'r') as f:
        sim = f.attrs.get('sim')
        if not (isinstance(sim, bool | np.bool_) and sim):
            bad.append(f'attribute sim is {sim!r}, not True')
        for a in ('seed', 'cube_pose', 'task'):
            if a not in f.attrs:
                bad.append(f'no attribute {a}')
        for name in ('observations/qpos', 'observations/qvel', 'action'):
            if name not in f:
                bad.append(f'no /{name}')
        if bad:
            return bad
        n = f['action'].shape[0]
        for name in ('observations/qpos', 'observations/qvel', 'action'):
            d = f[name]
            if d.shape != (n, 14) or d.dtype != np.float32:
                bad.append(f'/{name} is {d.shape} {d.dtype}, not ({n}, 14) float32')
        cams = list(f['observations/images']) if 'observations/images' in f else []
        for c in cams:
            d = f[f'observations/images/{c}']
            if d.ndim != 4 or d.shape[0] != n or d.shape[3] != 3 or d.dtype != np.uint8:
                bad.append(f'/observations/images/{c} is {d.shape} {d.dtype}, not '
                           f'({n}, H, W, 3) uint8')
        g = np.asarray(f['action'][:, [6, 13]])
        # A policy's commands are stored as played, and a policy may ask a little past ACT's
        # range (the shipped one up to 1.02).
        if g.size and (g.min() < 0 or g.max() > 1) and f.attrs.get('source') != 'policy':
            bad.append('action grippers outside 0..1 (ACT: normalised)')
        for k in QUESTIONS:
            d = f.get(f'language/{k}')
            if d is None or d.shape != (n,) or d.dtype != np.bool_:
                bad.append(f'/language/{k} missing or not ({n},) bool')
        source = str(f.attrs.get('source', 'script'))
        if 'language/phase' not in f:
            bad.append('no /language/phase')
        elif source not in ('script', 'policy'):
            bad.append(f"attribute source is {source!r}, not 'script' or 'policy'")
        else:
            got = [s.decode() if isinstance(s, bytes) else s for s in f['language/phase'][:]]
            if source == 'script' and got != phase_names(n):
                bad.append('/language/phase does not follow PHASES in order')
            if source == 'policy' and not bad:
                facts = {k: f[f'language/{k}'][()] for k in QUESTIONS}
                want = [closed_loop_phase(t, {k: bool(v[t]) for k, v in facts.items()})
                        for t in range(n)]
                wrong = [t for t in range(n) if got[t] != want[t]]
                if wrong:
                    bad.append(f'/language/phase at step {wrong[0]} is {got[wrong[0]]!r}, '
                               f'the scene says {want[wrong[0]]!r} ({len(wrong)} steps)')
    return bad


def episode_files(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(p.glob('episode_*.hdf5')) if p.is_dir() else [p]
    return out


def parse_size(text: str) -> tuple[int, int]:
    """'480x640' -> (height, width)."""
    try:
        h, w = (int(x) for x in text.lower().split('x'))
    except ValueError:
        raise argparse.ArgumentTypeError(f'{text!r} is not HEIGHTxWIDTH (e.g. 240x320)') from None
    if h < 8 or w < 8:
        raise argparse.ArgumentTypeError(f'{text!r}: at least 8x8')
    return h, w


_worker: dict = {}  # one process's simulation, kinematics, cameras and settings


def _start(setup):
    """Make this process's simulation (in a worker of the pool, or in the main process)."""
    from oxygen_ros.sim.aloha_sim import AlohaSim, egl

    egl()
    task, h, w, cameras, compression, keep, out = setup
    sim = AlohaSim(task, w, h)
    _worker.update(sim=sim, kin=Kinematics(sim.physics.model.ptr), views=Views(sim, cameras),
                   compression=compression, keep=keep, out=out)


def _episode(seed: int) -> dict:
    """Run one seed; a success (or, with --keep-failures, any whole episode) is written
    under a hidden name the main process gives its final one."""
    t0 = time.monotonic()
    k = _worker
    ep = run(k['sim'], k['kin'], seed, k['views'])
    path = k['out'] / f'.seed{seed}.hdf5'
    whole = len(ep.rewards) == len(ep.action) > 0
    if ep.success or (k['keep'] and whole):
        write(path, ep, k['compression'])
    else:
        path = None
    return {'seed': seed, 'problem': ep.problem, 'run_s': ep.wall_s,
            'wall_s': time.monotonic() - t0, 'file': str(path) if path else None,
            'bytes': path.stat().st_size if path else 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--task', default='transfer_cube', choices=['transfer_cube'],
                    help='the scripted task (insertion has no script)')
    ap.add_argument('--episodes', type=int, default=50, help='seeds to try')
    ap.add_argument('--seed', type=int, default=0, help='episode i has seed SEED + i')
    ap.add_argument('--out', default='', help='directory for episode_<k>.hdf5 and '
                    "summary.json (LeRobot's converter reads images uncompressed-style only "
                    "from a directory whose name contains 'sim')")
    ap.add_argument('--cameras', nargs='+', default=['top'],
                    help=f'gym-aloha or ROS camera names ({", ".join(CAMERAS.values())} / '
                    f'{", ".join(CAMERAS)}); "none": no images')
    ap.add_argument('--image-size', type=parse_size, default=(480, 640),
                    help="HEIGHTxWIDTH of every camera (ACT's: 480x640)")
    ap.add_argument('--compression', default='gzip', choices=['gzip', 'lzf', 'none'],
                    help='of the image datasets (gzip: level 1; h5py reads all transparently; '
                    "none = ACT's bytes)")
    ap.add_argument('--keep-failures', action='store_true',
                    help='also write failed episodes (as failed_seed<S>.hdf5)')
    ap.add_argument('--jobs', type=int, default=1,
                    help='episodes simulated at once, one process each')
    ap.add_argument('--check', nargs='+', metavar='PATH',
                    help='verify episode files (or directories of them) and exit')
    args = ap.parse_args(argv)
    if args.check:
        files = episode_files(args.check)
        if not files:
            print(f'oxygen-demos: no episode files in {args.check}', file=sys.stderr)
            return 1
        worst = 0
        for p in files:
            try:
                bad = check(p)
            except OSError as e:  # not HDF5, unreadable, missing
                bad = [f'cannot read it: {e}']
            print(f'{p}: ' + ('ok' if not bad else '; '.join(bad)))
            worst = worst or bool(bad)
        return int(worst)
    if not args.out:
        ap.error('--out is required (or --check)')
    if args.episodes < 1 or args.jobs < 1:
        ap.error('--episodes and --jobs must be >= 1')
    cameras = () if args.cameras == ['none'] else tuple(args.cameras)
    known = set(CAMERAS) | set(CAMERAS.values())
    if set(cameras) - known:
        ap.error(f'unknown cameras {sorted(set(cameras) - known)}; choose from {sorted(known)}')
    from tqdm import tqdm

    from oxygen_ros.sim.aloha_sim import require

    require()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = (args.task, *args.image_size, cameras,
             None if args.compression == 'none' else args.compression, args.keep_failures, out)
    seeds = range(args.seed, args.seed + args.episodes)
    t0 = time.monotonic()
    kept, failed, results = 0, [], []
    bar = tqdm(total=args.episodes, desc='oxygen-demos', unit='ep')
    pool = None
    try:
        if args.jobs > 1:
            import multiprocessing

            # Spawned: each worker makes its own simulation and GL context.
            pool = multiprocessing.get_context('spawn').Pool(args.jobs, _start, (setup,))
            done = pool.imap(_episode, seeds)
        else:
            _start(setup)
            done = map(_episode, seeds)
        for r in done:  # in seed order, so the kept ones are numbered in seed order
            results.append(r)
            if r['problem']:
                failed.append({'seed': r['seed'], 'why': r['problem']})
                name = f'failed_seed{r["seed"]}.hdf5'
            else:
                name = f'episode_{kept}.hdf5'
                kept += 1
            if r['file']:
                os.replace(r['file'], out / name)
            bar.update()
            bar.set_postfix(kept=kept, failed=len(failed))
    except KeyboardInterrupt:
        print(f'oxygen-demos: interrupted after {len(results)} seeds ({kept} kept in {out})',
              file=sys.stderr)
        return 130
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
        for left in out.glob('.seed*.hdf5*'):  # an interrupted run's
            left.unlink()
    runs = [r['run_s'] for r in results]
    walls = [r['wall_s'] for r in results]
    sizes = [r['bytes'] for r in results if r['file'] and not r['problem']]
    summary = {'task': args.task, 'seeds': [args.seed, args.seed + args.episodes - 1],
               'tried': args.episodes, 'kept': kept,
               'success_rate': kept / args.episodes, 'failed': failed,
               'cameras': list(cameras), 'image_size': list(args.image_size),
               'compression': args.compression,
               'jobs': args.jobs,
               'run_s_per_episode': float(np.mean(runs)),  # plan, physics, pictures
               'wall_s_per_episode': float(np.mean(walls)),  # and writing (per process)
               'bytes_per_episode': float(np.mean(sizes)) if sizes else 0.0,
               'wall_s': time.monotonic() - t0}
    (out / 'summary.json').write_text(json.dumps(summary, indent=1))
    for f in failed:
        print(f'oxygen-demos: seed {f["seed"]} failed: {f["why"]}')
    print(f'oxygen-demos: {kept}/{args.episodes} episodes succeeded '
          f'({100 * kept / args.episodes:.0f} %), {summary["wall_s_per_episode"]:.2f} s and '
          f'{summary["bytes_per_episode"] / 1e6:.1f} MB per episode; {out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
