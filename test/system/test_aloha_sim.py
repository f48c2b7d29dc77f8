"""The MuJoCo ALOHA without ROS (oxygen_ros.sim.aloha_sim) against gym-aloha itself: the same
physics step for the same action, the gripper mapping against gym-aloha's constants and the
ALOHA profile's, the shipped joint limits against the model's joint ranges, and the
trajectory controllers against an independent spline.

Needs the simulator (requirements-mujoco.txt: tools/ws.sh sim-setup; make test installs it
where skips fail the run)."""
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

os.environ.setdefault('MUJOCO_GL', 'egl')
gym_aloha = pytest.importorskip('gym_aloha', reason='the simulator is not installed '
                                '(tools/ws.sh sim-setup)')
from gym_aloha import constants as gc  # noqa: E402
from scipy.interpolate import CubicHermiteSpline  # noqa: E402 (a dm-control dependency)
from support.paths import ROOT  # noqa: E402

from oxygen_ros.robot.aloha import (  # noqa: E402
    ARM_JOINTS,
    finger_from_gripper,
    gripper_from_finger,
    normalized_from_gripper,
)
from oxygen_ros.robot.profiles import make_profile  # noqa: E402
from oxygen_ros.sim import aloha_sim  # noqa: E402
from oxygen_ros.sim.aloha_sim import AlohaSim, Controller  # noqa: E402

ALOHA = yaml.safe_load((ROOT / 'config' / 'aloha.yaml').read_text())['/**']['ros__parameters']


@pytest.fixture(scope='module')
def sim():
    return AlohaSim('insertion', 160, 120)


def test_a_step_is_gym_alohas_step(sim):
    """Same seed, same actions: the same joint and object positions and the same reward as
    gym-aloha's own env (which renders three cameras with shadows each step: a few steps)."""
    import gymnasium as gym

    env = gym.make('gym_aloha/AlohaTransferCube-v0', obs_type='pixels_agent_pos')
    ours = AlohaSim('transfer_cube', 64, 48)
    obs, _ = env.reset(seed=5)
    ours.reset(5)
    theirs = env.unwrapped._env.physics
    np.testing.assert_array_equal(ours.physics.data.qpos, theirs.data.qpos)
    rng = np.random.default_rng(1)
    for _ in range(3):
        a = obs['agent_pos'] + rng.normal(0, 0.05, 14)
        a[[6, 13]] = rng.uniform(0, 1, 2)
        obs, reward, *_ = env.step(a)
        assert ours.step(a) == reward
        np.testing.assert_array_equal(ours.physics.data.qpos, theirs.data.qpos)
    # The state the profile reads: gym-aloha's observation with the finger in metres.
    state = ours.state()
    np.testing.assert_allclose(state[[0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]],
                               obs['agent_pos'][[0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]])
    np.testing.assert_allclose(gc.normalize_puppet_gripper_position(state[[6, 13]]),
                               obs['agent_pos'][[6, 13]])
    env.close()


def test_gripper_mapping_is_gym_alohas_and_the_profiles():
    """The ALOHA profile's gripper constants are gym-aloha's puppet ones; an action the
    profile decodes to a servo angle lands on the finger position gym-aloha maps the same
    normalised action to; the state the profile normalises is gym-aloha's observation."""
    from oxygen_ros.robot import profiles

    assert profiles.GRIPPER_POSITION_OPEN == gc.PUPPET_GRIPPER_POSITION_OPEN
    assert profiles.GRIPPER_POSITION_CLOSE == gc.PUPPET_GRIPPER_POSITION_CLOSE
    assert profiles.GRIPPER_JOINT_OPEN == gc.PUPPET_GRIPPER_JOINT_OPEN
    assert profiles.GRIPPER_JOINT_CLOSE == gc.PUPPET_GRIPPER_JOINT_CLOSE
    x = np.linspace(0, 1, 11)
    # The profile without the pi0 adaptation: normalised model gripper -> servo angle (rad).
    p = make_profile('aloha', adapt_to_pi=False, delta=False, normalized_gripper=False)
    actions = np.zeros((len(x), 14))
    actions[:, 6] = actions[:, 13] = x
    angle = p.decode_actions(actions, np.zeros(14))[:, 6]
    np.testing.assert_allclose(angle, gc.unnormalize_puppet_gripper_joint(x))
    np.testing.assert_allclose(normalized_from_gripper(angle), x, atol=1e-12)
    np.testing.assert_allclose(finger_from_gripper(angle),
                               gc.unnormalize_puppet_gripper_position(x), atol=1e-12)
    np.testing.assert_allclose(finger_from_gripper(angle),
                               gc.convert_puppet_from_joint_to_position(angle), atol=1e-12)
    np.testing.assert_allclose(gripper_from_finger(finger_from_gripper(angle)), angle)
    finger = gc.unnormalize_puppet_gripper_position(x)
    state = np.zeros(14)
    for f, xi in zip(finger, x, strict=True):
        state[6] = f
        assert p.encode_state(state)[6] == pytest.approx(xi)


def test_finger_range_narrower_than_the_mapping(sim):
    """gym-aloha maps 0..1 onto 0.01844..0.058 m, but its fingers' joint and actuator
    ranges are 0.021..0.057: the ends of the gripper command saturate (0 closes as far as
    0.065 does, 1 opens as far as 0.975)."""
    lo, hi = sim.joint_range('left', 'left_finger')
    assert (lo, hi) == pytest.approx((0.021, 0.057))
    assert gc.PUPPET_GRIPPER_POSITION_CLOSE < lo < hi < gc.PUPPET_GRIPPER_POSITION_OPEN
    assert sim.joint_range('right', 'right_finger') == pytest.approx((-0.057, -0.021))


def test_joint_limits_match_the_model(sim):
    """aloha.yaml's arm limits (Interbotix's URDF, whole degrees) against the MuJoCo model's
    joint ranges (gym-aloha, rounded to 5 decimals): every joint of both arms differs by the
    rounding only (< 5e-6 rad), and the URDF's are the exact degree values."""
    degrees = {'shoulder': (-106, 72), 'elbow': (-101, 92), 'wrist_angle': (-107, 128)}
    for side in ('left', 'right'):
        limits = ALOHA['joint_limits'][f'{side}_arm']
        for j in ARM_JOINTS:
            lo, hi = sim.joint_range(side, j)
            assert abs(limits[j]['lower'] - lo) < 5e-6, (side, j, limits[j], lo)
            assert abs(limits[j]['upper'] - hi) < 5e-6, (side, j, limits[j], hi)
            if j in degrees:
                assert limits[j]['lower'] == pytest.approx(math.radians(degrees[j][0]), abs=5e-9)
                assert limits[j]['upper'] == pytest.approx(math.radians(degrees[j][1]), abs=5e-9)
            else:
                assert limits[j]['upper'] == pytest.approx(math.pi - 1e-5, abs=5e-9)
    # The position actuators clamp their targets to the same ranges, joint by joint.
    model = sim.physics.model
    assert model.nu == 16
    for i in range(model.nu):
        np.testing.assert_array_equal(model.actuator_ctrlrange[i],
                                      model.jnt_range[model.actuator_trnid[i, 0]])


def traj(names, points, stamp=0.0):
    """A trajectory_msgs/JointTrajectory look-alike: points are (t, positions, velocities)."""
    def dur(t):
        return SimpleNamespace(sec=int(t), nanosec=int(round((t - int(t)) * 1e9)))
    return SimpleNamespace(
        joint_names=list(names),
        header=SimpleNamespace(stamp=dur(stamp)),
        points=[SimpleNamespace(positions=list(p), velocities=list(v), accelerations=[],
                                time_from_start=dur(t)) for t, p, v in points])


def test_controller_follows_the_cubic_from_where_it_is():
    """From the measured state at arrival through each point: scipy's cubic Hermite spline
    through the same knots; the last point held after the end."""
    c = Controller(['a', 'b'], [0.0, 0.0])
    now = 10.0
    pts = [(0.1, [0.2, -0.1], [1.0, 0.0]), (0.3, [0.5, -0.4], [0.0, 0.0])]
    assert c.receive(traj(['b', 'a'], [(t, p[::-1], v[::-1]) for t, p, v in pts]), now,
                     [0.05, 0.01], [0.3, -0.2]) == ''
    knots = [now, now + 0.1, now + 0.3]
    ref = CubicHermiteSpline(knots, [[0.05, 0.01], [0.2, -0.1], [0.5, -0.4]],
                             [[0.3, -0.2], [1.0, 0.0], [0.0, 0.0]])
    for t in np.linspace(now, now + 0.3, 31):
        np.testing.assert_allclose(c.sample(t), ref(t), atol=1e-12)
    np.testing.assert_allclose(c.sample(now + 5.0), [0.5, -0.4])


def test_controller_rejects_what_jtc_rejects_and_goes_on():
    """Empty, partial, unknown-joint, non-finite and late trajectories are refused with the
    reason; the trajectory being executed (or the hold) continues."""
    c = Controller(['a', 'b'], [0.1, 0.2])
    good = traj(['a', 'b'], [(0.2, [0.3, 0.4], [0.0, 0.0])], stamp=1.0)
    assert c.receive(good, 1.0, [0.1, 0.2], [0, 0]) == ''
    mid = c.sample(1.1).copy()
    bad = {
        'no points': traj(['a', 'b'], []),
        'partial joint set': traj(['a'], [(0.1, [1.0], [0.0])]),
        'unknown joints': traj(['a', 'z'], [(0.1, [1.0, 1.0], [0.0, 0.0])]),
        'non-finite': traj(['a', 'b'], [(0.1, [math.nan, 1.0], [0.0, 0.0])]),
        'in the past': traj(['a', 'b'], [(0.1, [1.0, 1.0], [0.0, 0.0])], stamp=0.5),
        'non-zero velocity': traj(['a', 'b'], [(0.1, [1.0, 1.0], [1.0, 0.0])]),
    }
    for what, m in bad.items():
        why = c.receive(m, 1.1, [0, 0], [0, 0])
        assert what in why, (what, why)
    np.testing.assert_allclose(c.sample(1.1), mid)
    np.testing.assert_allclose(c.sample(2.0), [0.3, 0.4])
    assert c.accepted == 1 and len(c.rejected) == len(bad)


def test_open_loop_controller_starts_from_its_command():
    """JTC's open_loop_control: a new trajectory starts from where the last one's command is
    at its arrival, moving as it moves (scipy's spline of the first trajectory gives both),
    whatever the measured state; closed loop starts from the measured state."""
    first = CubicHermiteSpline([1.0, 1.2], [[0.0], [1.0]], [[0.0], [0.0]])
    ref = CubicHermiteSpline([1.1, 1.3], [first(1.1), [2.0]], [first(1.1, 1), [0.0]])
    for open_loop in (True, False):
        c = Controller(['a'], [0.0], open_loop=open_loop)
        assert c.receive(traj(['a'], [(0.2, [1.0], [0.0])]), 1.0, [0.0], [0.0]) == ''
        # The arm lags far behind its command.
        assert c.receive(traj(['a'], [(0.2, [2.0], [0.0])]), 1.1, [-3.0], [0.5]) == ''
        if open_loop:
            for t in np.linspace(1.1, 1.3, 21):
                np.testing.assert_allclose(c.sample(t), ref(t), atol=1e-12)
        else:
            np.testing.assert_allclose(c.state(1.1)[0], [-3.0])
            np.testing.assert_allclose(c.state(1.1)[1], [0.5])


def test_controller_future_stamp_and_positions_only():
    """A trajectory stamped ahead runs, as JTC's, from the state at its arrival (4.0) to its
    first point (stamp 5.0 + 0.1); with positions only, linearly."""
    c = Controller(['a'], [0.0])
    assert c.receive(traj(['a'], [(0.1, [1.0], [])], stamp=5.0), 4.0, [0.0], [0.0]) == ''
    assert c.sample(4.0)[0] == 0.0
    assert c.sample(4.55)[0] == pytest.approx(0.5)
    assert c.sample(5.1)[0] == 1.0


def test_reset_lays_out_gym_alohas_episode(sim):
    """Start pose and seeded object poses as gym-aloha's reset; time keeps running."""
    from gym_aloha.utils import sample_insertion_pose

    t = sim.time
    sim.step(np.zeros(14))
    sim.reset(7)
    assert sim.time >= t + aloha_sim.DT - 1e-9
    np.testing.assert_allclose(sim.physics.data.qpos[:16], gc.START_ARM_POSE)
    np.testing.assert_allclose(sim.physics.data.qpos[-14:],
                               np.concatenate(sample_insertion_pose(7)))
    img = sim.render('cam_high')
    assert img.shape == (120, 160, 3) and img.dtype == np.uint8 and img.std() > 5


def test_stamps_never_step_back():
    """The clock's stamps of step times (sums of 2 ms substeps) rise monotonically."""
    pytest.importorskip('builtin_interfaces')
    from oxygen_ros.sim.mujoco_aloha import stamp_msg

    t, last = 0.0, -1.0
    for _ in range(5000):
        t += 0.002
        m = stamp_msg(t)
        assert m.nanosec < 1_000_000_000
        now = m.sec + m.nanosec * 1e-9
        assert now > last and abs(now - t) < 1e-9
        last = now
