import math

import numpy as np
import pytest

from oxygen_ros.robot.profiles import Aloha, Droid, Identity, JointMap, make_profile, readings


def test_identity():
    p = Identity(3)
    assert p.encode_state([1, 2, 3]).tolist() == [1.0, 2.0, 3.0]
    acts = np.arange(10.0).reshape(2, 5)
    assert p.decode_actions(acts, [0, 0, 0]).tolist() == [[0, 1, 2], [5, 6, 7]]
    with pytest.raises(ValueError, match="shape"):
        p.encode_state([1, 2])
    with pytest.raises(ValueError, match=">=3"):
        p.decode_actions(np.zeros((2, 2)), [0, 0, 0])


ARMS_L = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
ARMS_R = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]


def _aloha_state(gripper_l, gripper_r):
    return np.array([*ARMS_L, gripper_l, *ARMS_R, gripper_r])


# For a finger at 36 mm: (0.022^2 + 0.036^2 - 0.036^2) / (2 * 0.022 * 0.036) = 11/36.
ANGULAR_36MM = (math.asin(11 / 36) - 0.5476) / (1.6296 - 0.5476)
# Fully open, 58 mm: (0.022^2 + 0.058^2 - 0.036^2) / (2 * 0.022 * 0.058) = 1, asin = pi/2.
ANGULAR_OPEN = (math.pi / 2 - 0.5476) / (1.6296 - 0.5476)


def test_aloha_state_flip_and_gripper_by_hand():
    s = Aloha().encode_state(_aloha_state(0.036, 0.058))
    assert s[:6].tolist() == pytest.approx([0.1, -0.2, -0.3, 0.4, 0.5, 0.6])
    assert s[7:13].tolist() == pytest.approx([-0.1, 0.2, 0.3, -0.4, -0.5, -0.6])
    assert s[6] == pytest.approx(ANGULAR_36MM)
    assert s[13] == pytest.approx(ANGULAR_OPEN)


def test_aloha_normalized_gripper_state():
    # (0.036 - 0.01844) / (0.058 - 0.01844) is 36 mm in ALOHA's normalised units
    g = (0.036 - 0.01844) / (0.058 - 0.01844)
    s = Aloha(normalized_gripper=True).encode_state(_aloha_state(g, 1.0))
    assert s[6] == pytest.approx(ANGULAR_36MM)
    assert s[13] == pytest.approx(ANGULAR_OPEN)


def _model_actions(deltas, gripper):
    a = np.full((len(deltas), 32), 9.0)  # padding dims must be ignored
    for i, d in enumerate(deltas):
        a[i, :14] = [d] * 6 + [gripper] + [d] * 6 + [gripper]
    return a


def test_aloha_delta_actions_by_hand():
    # Delta is added to the flipped state, then the flip is undone: q + flip * delta.
    out = Aloha().decode_actions(_model_actions([0.01, 0.02], 0.5), _aloha_state(0.036, 0.04))
    assert out.shape == (2, 14)
    assert out[0, :6].tolist() == pytest.approx([0.11, 0.19, 0.29, 0.41, 0.51, 0.61])
    assert out[0, 7:13].tolist() == pytest.approx([-0.09, -0.21, -0.31, -0.39, -0.49, -0.59])
    assert out[1, :6].tolist() == pytest.approx([0.12, 0.18, 0.28, 0.42, 0.52, 0.62])
    assert out[1, 7:13].tolist() == pytest.approx([-0.08, -0.22, -0.32, -0.38, -0.48, -0.58])
    # grippers are absolute: 0.5 + 0.5476 rad on the gripper joint
    assert np.allclose(out[:, [6, 13]], 1.0476)


def test_aloha_zero_delta_holds_position():
    state = _aloha_state(0.03, 0.05)
    out = Aloha().decode_actions(_model_actions([0.0], 0.0), state)
    assert out[0, :6].tolist() == pytest.approx(ARMS_L)
    assert out[0, 7:13].tolist() == pytest.approx(ARMS_R)


def test_aloha_gripper_out_normalized():
    out = Aloha(normalized_gripper=True).decode_actions(
        _model_actions([0.0], 0.5), _aloha_state(0.03, 0.03)
    )
    expected = (0.5 + 0.5476 - (-0.6213)) / (1.4910 - (-0.6213))
    assert out[0, 6] == pytest.approx(expected)
    assert out[0, 13] == pytest.approx(expected)


def test_aloha_absolute_actions():
    a = _model_actions([0.3], 0.0)
    out = Aloha(delta=False).decode_actions(a, _aloha_state(0.03, 0.03))
    assert out[0, :6].tolist() == pytest.approx([0.3, -0.3, -0.3, 0.3, 0.3, 0.3])
    assert out[0, 7:13].tolist() == pytest.approx([0.3, -0.3, -0.3, 0.3, 0.3, 0.3])


def test_aloha_without_adaptation_is_identity():
    p = Aloha(adapt_to_pi=False, delta=False, normalized_gripper=True)
    state = _aloha_state(0.2, 0.7)
    assert p.encode_state(state).tolist() == pytest.approx(state.tolist())
    a = np.random.default_rng(0).normal(size=(3, 14))
    assert np.allclose(p.decode_actions(a, state), a)


def test_aloha_joint_names():
    joints = Aloha.joints("left", "right")
    assert len(joints) == 14
    assert joints[0] == ("left", "waist")
    assert joints[6] == ("left", "left_finger")
    assert joints[12] == ("right", "wrist_rotate")


DROID_Q = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.3]
DROID_A = np.array([[1.0] * 7 + [1.4, 9], [0.5] * 7 + [-0.2, 9], [-2.0] * 7 + [0.6, 9]])


def test_droid_integrates_velocities_by_hand():
    out = Droid().decode_actions(DROID_A, DROID_Q)
    q = np.array(DROID_Q[:7])
    assert out.shape == (3, 8)
    # 0.2 * 1, then + 0.2 * 0.5, then + 0.2 * (-1) after clipping -2 to -1
    assert np.allclose(out[0, :7], q + 0.2)
    assert np.allclose(out[1, :7], q + 0.3)
    assert np.allclose(out[2, :7], q + 0.1)
    assert out[:, 7].tolist() == pytest.approx([1.0, 0.0, 0.6])


def test_droid_options():
    q = np.array(DROID_Q[:7])
    out = Droid(velocity_scale=0.1).decode_actions(DROID_A, DROID_Q)
    assert np.allclose(out[:, :7], [q + 0.1, q + 0.15, q + 0.05])
    out = Droid(velocity=False).decode_actions(DROID_A, DROID_Q)
    assert np.allclose(out[:, :7], DROID_A[:, :7])
    out = Droid(binarize_gripper=True).decode_actions(DROID_A, DROID_Q)
    assert out[:, 7].tolist() == [1.0, 0.0, 1.0]


def test_droid_gripper_units():
    p = Droid(gripper_open=0.0, gripper_closed=0.8)
    assert p.encode_state([0, 0, 0, 0, 0, 0, 0, 0.4])[7] == pytest.approx(0.5)
    a = np.zeros((2, 8))
    a[:, 7] = [0.25, 1.4]
    assert p.decode_actions(a, np.zeros(8))[:, 7].tolist() == pytest.approx([0.2, 0.8])


def test_droid_joint_names():
    joints = Droid.joints("js", gripper="finger")
    assert joints[0] == ("js", "fr3_joint1") and joints[6] == ("js", "fr3_joint7")
    assert joints[7] == ("js", "finger")


def test_make_profile():
    assert isinstance(make_profile("aloha"), Aloha)
    assert make_profile("droid", velocity_scale=0.1).velocity_scale == 0.1
    assert make_profile("Identity", dim=5).state_dim == 5
    with pytest.raises(ValueError, match="unknown robot profile 'ur5'"):
        make_profile("ur5")


@pytest.mark.parametrize("name, options, message", [
    ("droid", {"velocity_scale": math.nan}, r"velocity_scale must be finite and in \(0, 1\]"),
    ("droid", {"velocity_scale": 1e300}, r"velocity_scale .* got 1e\+300"),
    ("droid", {"velocity_scale": 0.0}, "velocity_scale must be finite"),
    ("droid", {"velocity_scale": -0.2}, "velocity_scale must be finite"),
    ("droid", {"velocity_scale": "0.2"}, "velocity_scale must be a number, got '0.2'"),
    ("droid", {"velocity_scale": True}, "velocity_scale must be a number, got True"),
    ("droid", {"gripper_open": math.inf}, r"gripper_open must be finite and in \[-10, 10\]"),
    ("droid", {"gripper_closed": -11.0}, "gripper_closed must be finite"),
    ("droid", {"binarize_gripper": "false"}, "binarize_gripper must be true or false"),
    ("droid", {"velocity": 0}, "velocity must be true or false, got 0"),
    ("aloha", {"delta": "no"}, "delta must be true or false, got 'no'"),
    ("aloha", {"adapt_to_pi": None}, "adapt_to_pi must be true or false, got None"),
    ("identity", {"dim": 0}, r"dim must be an integer in \[1, 1024\], got 0"),
    ("identity", {"dim": 7.0}, "dim must be an integer"),
    ("identity", {"dim": True}, "dim must be an integer"),
])
def test_profile_options_must_be_finite_and_within_bounds(name, options, message):
    with pytest.raises(ValueError, match=f"option {message}"):
        make_profile(name, **options)


def test_profile_options_at_their_bounds():
    assert Droid(velocity_scale=1.0).velocity_scale == 1.0
    assert Droid(velocity_scale=np.float32(0.25)).velocity_scale == 0.25
    p = Droid(gripper_open=-10, gripper_closed=10, binarize_gripper=np.bool_(True))
    assert (p.gripper_open, p.gripper_closed, p.binarize_gripper) == (-10.0, 10.0, True)
    assert Identity(1024).state_dim == 1024 and Identity(np.int64(3)).action_dim == 3


def _arm(offset):
    names = ["waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate"]
    r = {n: offset + i for i, n in enumerate(names)}
    r["left_finger"] = offset + 0.5
    r["gripper"] = -1.0
    return r


def test_joint_map_merges_sources_in_order():
    jm = JointMap(Aloha.joints())
    inputs = {"right": _arm(10), "left": _arm(0)}
    v = jm.vector(inputs)
    assert v.tolist() == [0, 1, 2, 3, 4, 5, 0.5, 10, 11, 12, 13, 14, 15, 10.5]
    assert jm.missing(inputs) == []
    assert jm.unknown(inputs) == ["right/gripper", "left/gripper"]


def test_joint_map_missing_names_listed():
    jm = JointMap(Aloha.joints())
    right = _arm(10)
    del right["elbow"]
    inputs = {"left": _arm(0), "right": right}
    assert jm.missing(inputs) == ["right/elbow"]
    with pytest.raises(ValueError, match="missing joint readings: right/elbow"):
        jm.vector(inputs)
    with pytest.raises(ValueError, match=r"right/waist.*right/left_finger"):
        jm.vector({"left": _arm(0)})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_joint_map_rejects_non_finite(bad):
    jm = JointMap(Aloha.joints())
    left = _arm(0)
    left["shoulder"] = bad
    with pytest.raises(ValueError, match="joint left/shoulder reads"):
        jm.vector({"left": left, "right": _arm(10)})


def test_joint_map_single_source_flat_input():
    jm = JointMap(["a", "b"])
    assert jm.labels == ["a", "b"]
    assert jm.vector({"b": 2.0, "a": 1.0, "c": 3.0}).tolist() == [1.0, 2.0]
    assert jm.unknown({"b": 2.0, "a": 1.0, "c": 3.0}) == ["c"]
    assert jm.missing({"a": 1.0}) == ["b"]


def test_joint_map_rejects_duplicates():
    with pytest.raises(ValueError, match="left/waist"):
        JointMap([("left", "waist"), ("left", "waist")])


def test_readings():
    assert readings(["a", "b"], [1, 2]) == {"a": 1.0, "b": 2.0}
    with pytest.raises(ValueError, match="2 names but 1 positions"):
        readings(["a", "b"], [1])


@pytest.mark.parametrize('profile', [
    Identity(8), Aloha(), Aloha(delta=False), Aloha(adapt_to_pi=False),
    Droid(), Droid(velocity=False), Droid(velocity=False, delta=True)],
    ids=['identity', 'aloha', 'aloha-absolute', 'aloha-unadapted', 'droid', 'droid-position',
         'droid-delta'])
def test_rebase_commands_the_same_targets_from_the_new_state(profile):
    # What real-time chunking relies on: the rebased chunk, decoded at the new state,
    # commands what the old chunk commanded from the old state (the motion the robot is on).
    rng = np.random.default_rng(3)
    n = profile.state_dim
    old, new = rng.uniform(-1, 1, n), rng.uniform(-1, 1, n)
    if isinstance(profile, Aloha):
        old[[6, 13]] = new[[6, 13]] = 0.03  # finger positions in metres
    a = rng.uniform(-0.9, 0.9, (10, 32))
    b = profile.rebase(a, old, new)
    assert b.shape == (10, profile.action_dim)
    if not isinstance(profile, Droid) or not profile.velocity:
        np.testing.assert_allclose(profile.decode_actions(b, new),
                                   profile.decode_actions(a, old), atol=1e-12)
    if not getattr(profile, 'delta', False):
        np.testing.assert_array_equal(b, a[:, :profile.action_dim])
    with pytest.raises(ValueError):
        profile.rebase(a, old[:-1], new)


@pytest.mark.parametrize('profile, dims', [
    (Identity(8), list(range(8))), (Aloha(), [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]),
    (Aloha(adapt_to_pi=False, delta=False), [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]),
    (Droid(velocity=False), list(range(7))), (Droid(velocity=False, delta=True), list(range(7))),
    (Droid(), [])], ids=['identity', 'aloha', 'aloha-plain', 'droid-position', 'droid-delta',
                         'droid'])
def test_shifted_actions_decode_to_the_moved_targets(profile, dims):
    # Real-time chunking guides towards the targets sent, clamped into the joint limits:
    # the actions that decode (from any state) to the targets moved by that much.
    rng = np.random.default_rng(5)
    state = rng.uniform(-1, 1, profile.state_dim)
    if isinstance(profile, Aloha):
        state[[6, 13]] = 0.03
    a = rng.uniform(-0.9, 0.9, (10, profile.action_dim))
    moved = np.zeros((10, profile.action_dim))
    moved[:, dims] = rng.uniform(-0.5, 0.5, (10, len(dims)))
    b = profile.shifted(a, moved)
    if not dims:
        assert b is None  # velocities: a clamped target is not one action moved
        return
    np.testing.assert_allclose(profile.decode_actions(b, state),
                               profile.decode_actions(a, state) + moved, atol=1e-12)


def test_rebase_keeps_droid_velocities():
    # A velocity is a velocity wherever the arm is: the same numbers, so the executed
    # (re-anchored) steps stay the same.
    p = Droid()
    a = np.random.default_rng(0).uniform(-1, 1, (15, 8))
    np.testing.assert_array_equal(p.rebase(a, np.zeros(8), np.ones(8)), a)
