"""Robot profiles: how a robot's joint readings become the model's state and how the
model's action chunk becomes joint targets the robot can follow.

encode_state runs before normalisation and decode_actions after unnormalisation, so
both work in physical units on one side and in the units the checkpoint was trained
on (openpi's per-robot policies) on the other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def _flag(name: str, value) -> bool:
    # A profile option usually comes from YAML text, where "false" in quotes is a string
    # and would be true.
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"option {name} must be true or false, got {value!r}")
    return bool(value)


def _number(name: str, value, low: float, high: float, above: bool = False) -> float:
    """`value` as a float in [low, high] ((low, high] with `above`), or ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise ValueError(f"option {name} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or x < low or (above and x == low) or x > high:
        raise ValueError(f"option {name} must be finite and in {'(' if above else '['}"
                         f"{low:g}, {high:g}], got {value!r}")
    return x


# Gripper readings in REP 103 units (rad or m): a gripper's joint stays well within a turn.
GRIPPER_READING = 10.0


class Profile:
    name = "profile"
    state_dim: int
    action_dim: int

    def encode_state(self, state: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def decode_actions(self, actions: np.ndarray, state: np.ndarray) -> np.ndarray:
        """actions: [H, >= action_dim] model actions; state: the raw robot state they were
        predicted from. Returns [H, action_dim] targets in robot units."""
        raise NotImplementedError

    def rebase(self, actions: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        """A chunk of model actions predicted at state `old`, expressed for a frame observed
        at state `new`: the numbers that command the same targets from there. Real-time
        chunking guides the next chunk towards the one being executed in these terms.
        Absolute actions are the same numbers anywhere."""
        self._state(old)
        self._state(new)
        return self._actions(actions)

    def shifted(self, actions: np.ndarray, moved: np.ndarray) -> np.ndarray | None:
        """Model actions whose targets (decoded from any one state) are those of `actions`
        moved by `moved` ([H, action_dim], robot units), or None where the profile's map is
        not a shift. Real-time chunking guides towards the targets the robot was sent,
        clamped into its joint limits, not those the model asked for. This base (and
        Identity) maps actions to targets one to one."""
        return self._actions(actions) + np.asarray(moved, dtype=np.float64)

    @property
    def reanchors(self) -> bool:
        """Whether this profile's targets depend on where the robot is (see reanchor)."""
        return False

    def reanchor(
        self, actions: np.ndarray, measured: np.ndarray, first: int
    ) -> np.ndarray | None:
        """Targets [H - first, action_dim] for actions first..H-1 of a chunk, recomputed
        from `measured` (the raw robot state read when action `first` starts), or None when
        the profile does not re-anchor (`reanchors`): then the chunk's targets from
        decode_actions stand."""
        return None

    def _state(self, state: np.ndarray) -> np.ndarray:
        s = np.asarray(state, dtype=np.float64)
        if s.shape != (self.state_dim,):
            raise ValueError(
                f"{self.name}: state must have shape ({self.state_dim},), got {s.shape}"
            )
        return s

    def _actions(self, actions: np.ndarray) -> np.ndarray:
        a = np.asarray(actions, dtype=np.float64)
        if a.ndim != 2 or a.shape[1] < self.action_dim:
            raise ValueError(
                f"{self.name}: actions must be [H, >={self.action_dim}], got {a.shape}"
            )
        return a[:, : self.action_dim].copy()


class Identity(Profile):
    """No adaptation: the robot speaks the model's units already."""

    name = "identity"

    def __init__(self, dim: int):
        # pi0.5 checkpoints are 32 wide; a wider identity robot fits no model.
        if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)) \
                or not 1 <= dim <= 1024:
            raise ValueError(f"option dim must be an integer in [1, 1024], got {dim!r}")
        self.state_dim = int(dim)
        self.action_dim = int(dim)

    def encode_state(self, state: np.ndarray) -> np.ndarray:
        return self._state(state)

    def decode_actions(self, actions: np.ndarray, state: np.ndarray) -> np.ndarray:
        self._state(state)
        return self._actions(actions)


# ALOHA constants (Interbotix ViperX follower arms), as used by openpi's aloha_policy.
GRIPPER_POSITION_OPEN = 0.05800  # left_finger, metres
GRIPPER_POSITION_CLOSE = 0.01844
GRIPPER_JOINT_OPEN = 1.4910  # gripper joint, rad
GRIPPER_JOINT_CLOSE = -0.6213
# The gripper horn and linkage turn the servo angle into finger travel.
GRIPPER_ARM_LENGTH = 0.036
GRIPPER_HORN_RADIUS = 0.022
# Angular gripper range of the data pi0 was pre-trained on.
PI_GRIPPER_MIN = 0.5476
PI_GRIPPER_MAX = 1.6296

ALOHA_ARM_JOINTS = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate")
ALOHA_FLIP = np.array([1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, 1, 1, 1], dtype=np.float64)
ALOHA_GRIPPERS = [6, 13]
ALOHA_ARMS = np.array([True] * 6 + [False] + [True] * 6 + [False])


def _normalize(x, lo, hi):
    return (x - lo) / (hi - lo)


def _unnormalize(x, lo, hi):
    return x * (hi - lo) + lo


def gripper_to_angular(x: np.ndarray) -> np.ndarray:
    """ALOHA normalised finger position [0, 1] -> pi0's normalised servo angle."""
    d = _unnormalize(x, GRIPPER_POSITION_CLOSE, GRIPPER_POSITION_OPEN)
    r, a = GRIPPER_HORN_RADIUS, GRIPPER_ARM_LENGTH
    # d = 0 (fingers fully closed past the calibrated range) is the limit the clip gives.
    with np.errstate(divide='ignore'):
        angle = np.arcsin(np.clip((r**2 + d**2 - a**2) / (2 * r * d), -1.0, 1.0))
    return _normalize(angle, PI_GRIPPER_MIN, PI_GRIPPER_MAX)


def gripper_from_angular(x: np.ndarray) -> np.ndarray:
    """pi0's gripper action -> ALOHA normalised gripper joint [0, 1].

    Not the inverse of gripper_to_angular: openpi reads the model's gripper output as an
    angle in radians less PI_GRIPPER_MIN and only undoes that offset; we do the same.
    """
    return _normalize(x + PI_GRIPPER_MIN, GRIPPER_JOINT_CLOSE, GRIPPER_JOINT_OPEN)


class Aloha(Profile):
    """Bimanual ALOHA, 14-d: [left 6 joints, left gripper, right 6 joints, right gripper].

    State grippers are finger positions in metres (the `left_finger` joint of each arm's
    JointState); action grippers are gripper joint angles in rad, what the Interbotix
    gripper command takes. With normalized_gripper=True both are ALOHA's normalised [0, 1]
    values instead (the units of ALOHA datasets and of ALOHA's own env).

    adapt_to_pi flips joints and maps grippers into the space pi0 was pre-trained in;
    delta means the model predicts the 6 arm joints of each arm relative to the observed
    state, in that model space (grippers stay absolute).
    """

    name = "aloha"
    state_dim = 14
    action_dim = 14

    def __init__(
        self, adapt_to_pi: bool = True, delta: bool = True, normalized_gripper: bool = False
    ):
        self.adapt_to_pi = _flag("adapt_to_pi", adapt_to_pi)
        self.delta = _flag("delta", delta)
        self.normalized_gripper = _flag("normalized_gripper", normalized_gripper)

    @staticmethod
    def joints(
        left: str = "left", right: str = "right", gripper: str = "left_finger"
    ) -> list[tuple[str, str]]:
        """(source, joint) pairs in state order, for JointMap."""
        arm = [*ALOHA_ARM_JOINTS, gripper]
        return [(left, j) for j in arm] + [(right, j) for j in arm]

    def encode_state(self, state: np.ndarray) -> np.ndarray:
        s = self._state(state).copy()
        if not self.normalized_gripper:
            s[ALOHA_GRIPPERS] = _normalize(
                s[ALOHA_GRIPPERS], GRIPPER_POSITION_CLOSE, GRIPPER_POSITION_OPEN
            )
        if self.adapt_to_pi:
            s = ALOHA_FLIP * s
            s[ALOHA_GRIPPERS] = gripper_to_angular(s[ALOHA_GRIPPERS])
        return s

    def rebase(self, actions: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        a = self._actions(actions)
        if self.delta:
            a[:, ALOHA_ARMS] += (self.encode_state(old) - self.encode_state(new))[ALOHA_ARMS]
        else:
            self._state(old)
            self._state(new)
        return a

    def shifted(self, actions: np.ndarray, moved: np.ndarray) -> np.ndarray | None:
        # The arms' map is a shift (and a sign); the grippers' is not, and they keep the
        # model's value (aloha.yaml gives them no position limits to clamp into).
        a = self._actions(actions)
        m = np.asarray(moved, dtype=np.float64)
        if self.adapt_to_pi:
            m = ALOHA_FLIP * m
        a[:, ALOHA_ARMS] += m[:, ALOHA_ARMS]
        return a

    def decode_actions(self, actions: np.ndarray, state: np.ndarray) -> np.ndarray:
        a = self._actions(actions)
        if self.delta:
            # openpi adds the state back in model space, before undoing the flip.
            a[:, ALOHA_ARMS] += self.encode_state(state)[ALOHA_ARMS]
        else:
            self._state(state)
        if self.adapt_to_pi:
            a = ALOHA_FLIP * a
            a[:, ALOHA_GRIPPERS] = gripper_from_angular(a[:, ALOHA_GRIPPERS])
        if not self.normalized_gripper:
            a[:, ALOHA_GRIPPERS] = _unnormalize(
                a[:, ALOHA_GRIPPERS], GRIPPER_JOINT_CLOSE, GRIPPER_JOINT_OPEN
            )
        return a

    def encode_actions(self, targets: np.ndarray, state: np.ndarray) -> np.ndarray:
        """The inverse of decode_actions, for training: [H, 14] targets in robot units
        commanded from raw `state` -> the model actions that decode to them (openpi trains
        ALOHA policies so: its _encode_actions_inv, then DeltaActions against the encoded
        state)."""
        a = np.array(targets, dtype=np.float64)
        if a.ndim != 2 or a.shape[1] != self.action_dim:
            raise ValueError(f"{self.name}: targets must be [H, {self.action_dim}], got "
                             f"{a.shape}")
        if not self.normalized_gripper:
            a[:, ALOHA_GRIPPERS] = _normalize(
                a[:, ALOHA_GRIPPERS], GRIPPER_JOINT_CLOSE, GRIPPER_JOINT_OPEN
            )
        if self.adapt_to_pi:
            a[:, ALOHA_GRIPPERS] = _unnormalize(
                a[:, ALOHA_GRIPPERS], GRIPPER_JOINT_CLOSE, GRIPPER_JOINT_OPEN
            ) - PI_GRIPPER_MIN
            a = ALOHA_FLIP * a
        if self.delta:
            a[:, ALOHA_ARMS] -= self.encode_state(state)[ALOHA_ARMS]
        else:
            self._state(state)
        return a


class Droid(Profile):
    """Franka + Robotiq as in DROID: 7 joint positions + gripper (0 open .. 1 closed).

    pi05_droid predicts 7 joint velocities plus a gripper position. openpi's DROID client
    clips each command to [-1, 1] and binarises the gripper (binarize_gripper, 1 above 0.5
    else 0); DROID's controller runs
    at 15 Hz and turns a velocity v into the target q + 0.2 * v from the joints q measured
    as that step starts. decode_actions integrates a chunk from the observed joints,
    target_i = q + velocity_scale * sum_{j <= i} v_j, which is DROID's target only while the
    arm reaches every one; reanchor redoes it from the joints measured when step i starts,
    giving DROID's q_measured + 0.2 * v_i (open_loop=True keeps the integrated targets).

    clip_velocities=False leaves out the client's clipping and applies DROID's own limit
    instead (a velocity whose largest component exceeds 1 is scaled down as a whole).

    velocity=False reads the joint dims as positions (openpi's joint-position DROID
    configs): absolute, or with delta=True relative to the observed joints, as those
    configs train them (the gripper stays absolute).

    gripper_open/gripper_closed map the robot's gripper reading (e.g. a Robotiq knuckle
    angle) linearly to DROID's [0, 1] and back; the defaults assume it is already in [0, 1].
    """

    name = "droid"
    state_dim = 8
    action_dim = 8

    def __init__(
        self,
        velocity: bool = True,
        velocity_scale: float = 0.2,
        gripper_open: float = 0.0,
        gripper_closed: float = 1.0,
        binarize_gripper: bool = False,
        clip_velocities: bool = True,
        open_loop: bool = False,
        delta: bool = False,
    ):
        self.velocity = _flag("velocity", velocity)
        # Radians per 1/15 s step at velocity 1: DROID's 0.2 is 3 rad/s, about a Franka's
        # top joint speed; 1 would be 15 rad/s.
        self.velocity_scale = _number("velocity_scale", velocity_scale, 0.0, 1.0, above=True)
        self.gripper_open = _number("gripper_open", gripper_open, -GRIPPER_READING,
                                    GRIPPER_READING)
        self.gripper_closed = _number("gripper_closed", gripper_closed, -GRIPPER_READING,
                                      GRIPPER_READING)
        self.binarize_gripper = _flag("binarize_gripper", binarize_gripper)
        self.clip_velocities = _flag("clip_velocities", clip_velocities)
        self.open_loop = _flag("open_loop", open_loop)
        self.delta = _flag("delta", delta)
        if self.gripper_open == self.gripper_closed:
            raise ValueError("gripper_open and gripper_closed must differ")
        if self.velocity and self.delta:
            raise ValueError("delta is for joint-position checkpoints: set velocity: false")

    @staticmethod
    def joints(
        source: str = "", prefix: str = "fr3", gripper: str = "robotiq_85_left_knuckle_joint"
    ) -> list[tuple[str, str]]:
        return [(source, f"{prefix}_joint{i}") for i in range(1, 8)] + [(source, gripper)]

    def encode_state(self, state: np.ndarray) -> np.ndarray:
        s = self._state(state).copy()
        s[7] = _normalize(s[7], self.gripper_open, self.gripper_closed)
        return s

    def decode_actions(self, actions: np.ndarray, state: np.ndarray) -> np.ndarray:
        a = self._actions(actions)
        q = self._state(state)[:7]
        if not np.all(np.isfinite(a)):
            # Binarising would turn a NaN gripper into a valid-looking 0.
            raise ValueError(f"{self.name}: non-finite actions")
        if self.velocity:
            a[:, :7] = q + np.cumsum(self._joint_steps(a[:, :7]), axis=0)
        elif self.delta:
            a[:, :7] += q
        g = np.clip(a[:, 7], 0.0, 1.0)
        if self.binarize_gripper:
            g = (g > 0.5).astype(np.float64)
        a[:, 7] = _unnormalize(g, self.gripper_open, self.gripper_closed)
        return a

    def shifted(self, actions: np.ndarray, moved: np.ndarray) -> np.ndarray | None:
        # A velocity's target is the sum of those before it, and the gripper is binarised:
        # only joint positions (absolute or delta) shift.
        if self.velocity:
            return None
        a = self._actions(actions)
        a[:, :7] += np.asarray(moved, dtype=np.float64)[:, :7]
        return a

    def rebase(self, actions: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        # Velocities (re-anchored or not) and absolute positions mean the same anywhere.
        a = self._actions(actions)
        q0, q1 = self._state(old)[:7], self._state(new)[:7]
        if self.delta:
            a[:, :7] += q0 - q1
        return a

    @property
    def reanchors(self) -> bool:
        return self.velocity and not self.open_loop

    def reanchor(
        self, actions: np.ndarray, measured: np.ndarray, first: int
    ) -> np.ndarray | None:
        if not self.reanchors:
            return None
        a = self._actions(actions)
        if not 0 <= first <= len(a):
            raise ValueError(f"{self.name}: first action {first} outside a {len(a)}-action chunk")
        # The rest of the chunk integrated from where the arm is now: DROID's target for the
        # step now starting, and the same extension as decode_actions beyond it.
        return self.decode_actions(a[first:], measured)

    def _joint_steps(self, v: np.ndarray) -> np.ndarray:
        """Joint change per 1/15 s step for velocity commands v [n, 7]."""
        if self.clip_velocities:
            v = np.clip(v, -1.0, 1.0)
        else:
            v = v / np.abs(v).max(axis=1, keepdims=True, initial=1.0)
        return self.velocity_scale * v


def make_profile(name: str, **kw) -> Profile:
    makers = {"identity": Identity, "aloha": Aloha, "droid": Droid}
    try:
        maker = makers[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown robot profile {name!r}; choose one of {sorted(makers)}"
        ) from None
    return maker(**kw)


class JointMap:
    """Assembles an ordered state vector from several JointState-like readings.

    Joints are (source, name) pairs: a source is whatever the caller keys its inputs by,
    usually one per topic (e.g. "left" for /follower_left/joint_states). A bare name means
    source "". Inputs are {source: {joint name: position}}; with a single "" source a
    flat {joint name: position} is accepted too.
    """

    def __init__(self, joints: Sequence[tuple[str, str] | str]):
        self.joints = [("", j) if isinstance(j, str) else (str(j[0]), str(j[1])) for j in joints]
        if not self.joints:
            raise ValueError("JointMap needs at least one joint")
        labels = self.labels
        dups = sorted({x for x in labels if labels.count(x) > 1})
        if dups:
            raise ValueError(f"joints listed twice: {', '.join(dups)}")

    def __len__(self) -> int:
        return len(self.joints)

    @property
    def labels(self) -> list[str]:
        return [_label(s, n) for s, n in self.joints]

    def _inputs(self, inputs: Mapping) -> Mapping[str, Mapping[str, float]]:
        if inputs and not all(isinstance(v, Mapping) for v in inputs.values()):
            return {"": inputs}
        return inputs

    def missing(self, inputs: Mapping) -> list[str]:
        """Labels of mapped joints that no input provides."""
        inputs = self._inputs(inputs)
        return [_label(s, n) for s, n in self.joints if n not in inputs.get(s, {})]

    def unknown(self, inputs: Mapping) -> list[str]:
        """Labels of provided joints the map does not use (normal for extra joints)."""
        inputs = self._inputs(inputs)
        known = set(self.joints)
        return [
            _label(s, n) for s, readings in inputs.items() for n in readings if (s, n) not in known
        ]

    def vector(self, inputs: Mapping) -> np.ndarray:
        inputs = self._inputs(inputs)
        missing = self.missing(inputs)
        if missing:
            have = ", ".join(_label(s, n) for s, r in inputs.items() for n in r) or "nothing"
            raise ValueError(f"missing joint readings: {', '.join(missing)} (have: {have})")
        out = np.empty(len(self.joints), dtype=np.float64)
        for i, (s, n) in enumerate(self.joints):
            x = float(inputs[s][n])
            if not math.isfinite(x):
                raise ValueError(f"joint {_label(s, n)} reads {x}")
            out[i] = x
        return out


def readings(names: Sequence[str], positions: Sequence[float]) -> dict[str, float]:
    """{name: position} from a JointState's parallel name/position lists."""
    if len(names) != len(positions):
        raise ValueError(f"JointState has {len(names)} names but {len(positions)} positions")
    return dict(zip(names, (float(p) for p in positions), strict=True))


def _label(source: str, name: str) -> str:
    return f"{source}/{name}" if source else name
