"""oxygen_node on the shipped config/pi05.yaml + config/aloha.yaml (joint limits on, the
default limit_hold_margin) commanding a fake ALOHA (aloha_robot.py) over rclpy: both arms
and both grippers get openpi's ALOHA targets, as joint_trajectory_controller takes them,
and a hold at the measured positions when the node is deactivated.

The model's actions are known. The checkpoint is the tiny model with a 50-action chunk
whose action expert cannot see the noise (action_in weight zero) and attends evenly to
every key (its query projections zero), so each action of a chunk is the same vector; the
action output projection is zero except for the two waist rows, and the action stats
have q99 = q01, so every other dim unnormalises to its q01 (the noise enters only through
openpi's 1e-6, below 3e-6 in the action). The two waist dims read the expert's hidden
state through a large gain, so they depend on the state tokens of the prompt: they are
what shows the measured state (grippers included) reaching the model as openpi forms it.
Their value comes from the same checkpoint run in this process on the state computed
here; everything after the model (adding the state back, the flips, the gripper maps) is
openpi's arithmetic restated below.
"""
import contextlib
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

rclpy = pytest.importorskip('rclpy')
import torch  # noqa: E402
from ament_index_python.packages import get_package_share_directory  # noqa: E402
from lifecycle_msgs.msg import Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState  # noqa: E402
from support.aloha import (  # noqa: E402
    CAMERAS,
    CONTROLLERS,
    AlohaRobot,
    Pose,
    camera_images,
    camera_topic,
    joint_topic,
)
from support.node import node_process  # noqa: E402
from support.paths import TOOLS  # noqa: E402
from support.process import new_domain, wait_for  # noqa: E402

import oxygen_ros.msg  # noqa: E402, F401 (built by colcon; must import)
from oxygen_ros.engine import Engine, EngineConfig, Observation  # noqa: E402
from oxygen_ros.model.checkpoint import save_checkpoint  # noqa: E402
from oxygen_ros.model.config import load_config  # noqa: E402
from oxygen_ros.model.pi05 import Pi05  # noqa: E402
from oxygen_ros.model.tokenizer import Tokenizer  # noqa: E402
from oxygen_ros.robot.params import BY_NAME  # noqa: E402
from oxygen_ros.robot.playback import RECENT_S  # noqa: E402
from oxygen_ros.robot.stamps import seconds  # noqa: E402

sys.path.insert(0, str(TOOLS))
from node_load import jtc_problems  # noqa: E402

CONFIG = Path(get_package_share_directory('oxygen_ros')) / 'config'

# -- openpi's ALOHA transform, restated -------------------------------------------------
# Physical-Intelligence/openpi, commit 15a9616a00943ada6c20a0f158e3adb39df2ccac:
# src/openpi/policies/aloha_policy.py (_joint_flip_mask, _gripper_to_angular,
# _gripper_from_angular, _decode_state, _encode_actions; AlohaInputs/AlohaOutputs default
# adapt_to_pi=True), src/openpi/training/config.py (LeRobotAlohaDataConfig: delta joint
# actions on the 6 + 6 arm joints, make_bool_mask(6, -1, 6, -1), AbsoluteActions before
# AlohaOutputs), src/openpi/transforms.py (AbsoluteActions adds the model-space state), and
# examples/aloha_real/constants.py + real_env.py (the runtime's finger normalisation of
# qpos[7], left_finger, and PUPPET_GRIPPER_JOINT_UNNORMALIZE_FN for the gripper command).
FLIP = np.array([1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, 1, 1, 1], dtype=np.float64)
GRIPPERS = [6, 13]
DELTA = np.array([True] * 6 + [False] + [True] * 6 + [False])
FINGER_OPEN, FINGER_CLOSE = 0.05800, 0.01844  # PUPPET_GRIPPER_POSITION_*, m
SERVO_OPEN, SERVO_CLOSE = 1.4910, -0.6213  # PUPPET_GRIPPER_JOINT_*, rad
ARM_LINK, HORN = 0.036, 0.022
PI_LOW, PI_HIGH = 0.5476, 1.6296


def gripper_state(finger_m):
    """Measured left_finger (m) -> pi0's gripper state."""
    x = (finger_m - FINGER_CLOSE) / (FINGER_OPEN - FINGER_CLOSE)  # the ALOHA runtime's qpos
    d = x * (FINGER_OPEN - FINGER_CLOSE) + FINGER_CLOSE  # openpi undoes it
    angle = np.arcsin(np.clip((HORN ** 2 + d ** 2 - ARM_LINK ** 2) / (2 * HORN * d), -1, 1))
    return (angle - PI_LOW) / (PI_HIGH - PI_LOW)


def gripper_command(action):
    """pi0's gripper action -> the gripper servo angle (rad) the follower is sent."""
    normalized = (action + PI_LOW - SERVO_CLOSE) / (SERVO_OPEN - SERVO_CLOSE)
    return normalized * (SERVO_OPEN - SERVO_CLOSE) + SERVO_CLOSE


def openpi_state(left: Pose, right: Pose, finger=lambda p: p.finger):
    raw = np.array([*left.arm, finger(left), *right.arm, finger(right)], dtype=np.float64)
    s = FLIP * raw
    s[GRIPPERS] = gripper_state(s[GRIPPERS])
    return s


def openpi_targets(actions, state):
    """Model actions [H, 14] (unnormalised) -> robot targets, from the model-space state."""
    a = np.array(actions, dtype=np.float64)
    a[:, DELTA] += state[DELTA]
    a = FLIP * a
    a[:, GRIPPERS] = gripper_command(a[:, GRIPPERS])
    return a


# -- the robot and the model's actions ------------------------------------------------------
LEFT = Pose(arm=(0.12, -0.55, 0.75, -0.20, 0.30, 0.15), gripper=0.25, finger=0.035)
RIGHT = Pose(arm=(-0.15, -0.45, 0.65, 0.25, -0.35, -0.10), gripper=1.00, finger=0.047)
# Model-space actions: arm deltas, grippers absolute; the waists (0, 7) are set by the gain.
ACTIONS = np.array([0.0, 0.08, -0.06, 0.05, -0.07, 0.09, -0.20,
                    0.0, 0.06, 0.07, -0.05, 0.08, -0.04, 0.35])
WAISTS = [0, 7]
WAIST_AIM = np.array([-0.12, 0.10])  # roughly where the gain puts the waist actions
GAIN = 5e7
HORIZON = 50
STATE_LOW, STATE_HIGH = -1.43, 1.57
SPAN = 1e-6  # openpi's quantile span: q99 - q01 + 1e-6
TOL = 2e-5  # the noise moves an action by < 3e-6
SETTLED = 0.2  # s: points this far ahead are past any approach from the measured pose


def wrong_states():
    """States a mistaken gripper or flip mapping would give the model instead."""
    no_angular = openpi_state(LEFT, RIGHT)
    no_angular[GRIPPERS] = [(p.finger - FINGER_CLOSE) / (FINGER_OPEN - FINGER_CLOSE)
                            for p in (LEFT, RIGHT)]
    unflipped = openpi_state(LEFT, RIGHT) * FLIP
    unflipped[GRIPPERS] = openpi_state(LEFT, RIGHT)[GRIPPERS]
    return {
        'finger not mapped to the angular space': no_angular,
        'gripper servo angle as the finger': openpi_state(LEFT, RIGHT, lambda p: p.gripper),
        'right_finger (mirrored) as the finger': openpi_state(LEFT, RIGHT, lambda p: -p.finger),
        'fingers of the two arms swapped': openpi_state(
            Pose(LEFT.arm, LEFT.gripper, RIGHT.finger), Pose(RIGHT.arm, RIGHT.gripper,
                                                             LEFT.finger)),
        'arm joints not flipped': unflipped,
    }


def oracle(root: Path, prompt: str):
    """The checkpoint's actions [H, 14] (zero noise) for the right state and the wrong ones."""
    # Eager like the node here (test_compiled holds compiled to eager).
    eng = Engine(EngineConfig(checkpoint=str(root), device='cpu', denoise_steps=10, threads=1,
                              compile=False))
    images = camera_images()
    p = aloha_params()
    obs = {s: images[c] for c, s in zip(p['cameras'], p['camera_slots'], strict=True)}
    zero = np.zeros((HORIZON, eng.model_action_dim))

    def run(state):
        o = Observation(0.0, obs, np.asarray(state, dtype=np.float32), prompt)
        return eng.step(o, noise=zero).actions

    return run(openpi_state(LEFT, RIGHT)), {k: run(s) for k, s in wrong_states().items()}


def write_policy(root: Path, model, waist_q01=(0.0, 0.0)):
    q01 = ACTIONS.copy()
    q01[WAISTS] = waist_q01
    stats = {'state': {'q01': [STATE_LOW] * 14, 'q99': [STATE_HIGH] * 14},
             'actions': {'q01': q01.tolist(), 'q99': q01.tolist()}}
    return save_checkpoint(model, root, stats, asset_id='trossen')


def builtin_vocab(model: Pi05) -> Pi05:
    """`model` with its embedding cut to the built-in tokenizer's rows, so that a checkpoint
    of it runs without a tokenizer of its own. It computes what it did: the prompt ids and
    the tokens sampled lie below them either way."""
    n = Tokenizer.default().vocab_size
    with torch.device('meta'):
        out = Pi05(model.cfg.replace(vocab=n))
    state = dict(model.state_dict(), **{'embed.weight': model.embed.weight[:n].clone()})
    out.load_state_dict(state, strict=True, assign=True)
    return out.to_inference('cpu')


@pytest.fixture(scope='module')
def policy(tmp_path_factory):
    cfg = load_config('tiny', action_dim=32, action_horizon=HORIZON, max_token_len=96)
    torch.manual_seed(0)
    model = builtin_vocab(Pi05(cfg).to_inference('cpu'))
    params = dict(model.named_parameters())
    queries = cfg.expert.heads * cfg.expert.head_dim
    with torch.no_grad():
        for i in range(cfg.expert.depth):
            params[f'expert.{i}.qkv.weight'][:queries] = 0.0
        model.action_in.weight.zero_()
        readout = model.action_out.weight[WAISTS].clone()
        model.action_out.weight.zero_()
        model.action_out.bias.zero_()
        model.action_out.weight[WAISTS] = readout
    tmp = tmp_path_factory.mktemp('aloha_policy')
    prompt = BY_NAME['prompt'].default
    # With zero noise a waist action is (1 - S) / 2 * SPAN, S the summed velocity, linear in
    # the readout: scale it by GAIN and centre it with the bias on WAIST_AIM.
    plain, _ = oracle(write_policy(tmp / 'plain', model), prompt)
    s = 1.0 - 2.0 * plain[0, WAISTS] / SPAN
    with torch.no_grad():
        model.action_out.weight[WAISTS] *= GAIN
        aim = 1.0 - 2.0 * WAIST_AIM / SPAN
        model.action_out.bias[WAISTS] = torch.tensor(aim - GAIN * s, dtype=torch.float32)
    root = write_policy(tmp / 'pi05_aloha', model)
    actions, wrong = oracle(root, prompt)
    return root, actions, wrong


def test_the_checkpoints_actions_are_known_and_see_the_state(policy):
    _, actions, wrong = policy
    # The same action throughout the chunk, q01 on the dims without a readout.
    np.testing.assert_allclose(actions, np.broadcast_to(actions[0], actions.shape), atol=1e-9)
    rest = [i for i in range(14) if i not in WAISTS]
    np.testing.assert_allclose(actions[0, rest], ACTIONS[rest], atol=1e-6)
    np.testing.assert_allclose(actions[0, WAISTS], WAIST_AIM, atol=0.02)
    # Each wrong mapping moves the waist actions far beyond the tolerance: the node's
    # waists tell whether its state is openpi's.
    for why, a in wrong.items():
        assert np.abs(a[0, WAISTS] - actions[0, WAISTS]).max() > 10 * TOL, why
    # No state value sits so close to a bin edge that rounding could change its token.
    s = openpi_state(LEFT, RIGHT)
    x = (s - STATE_LOW) / (STATE_HIGH - STATE_LOW + 1e-6) * 2.0 - 1.0
    edges = np.linspace(-1.0, 1.0, 257)
    assert np.abs(x[:, None] - edges[None]).min() > 1e-4
    assert np.all(np.abs(x) < 1)


def targets(actions):
    return openpi_targets(actions, openpi_state(LEFT, RIGHT))[0]


def aloha_params():
    return yaml.safe_load((CONFIG / 'aloha.yaml').read_text())['/**']['ros__parameters']


def test_aloha_yaml_names_the_robots_topics_and_joints():
    p = aloha_params()
    assert [t for t in p['camera_topics']] == [camera_topic(c) for c in p['cameras']]
    assert set(p['cameras']) < set(CAMERAS)
    assert p['joint_topics'] == [joint_topic(s) for s in p['joint_sources']]
    assert {g: (o['topic'], o['joints']) for g, o in p['outputs'].items()} == CONTROLLERS


@contextlib.contextmanager
def aloha_node(tmp: Path, overrides: dict, domain: str):
    """oxygen_node on the installed pi05.yaml and aloha.yaml, then `overrides`, and the fake
    robot spun in a thread of this process."""
    def make(node):
        robot = AlohaRobot(node, {'left': LEFT, 'right': RIGHT}, camera_images())
        robot.change = node.create_client(ChangeState, '/oxygen_node/change_state')
        return robot

    with node_process(tmp, overrides, domain, 'fake_aloha', make,
                      files=(CONFIG / 'pi05.yaml', CONFIG / 'aloha.yaml')) as (proc, robot):
        robot.proc = proc
        yield robot


def moving(received):
    return [m for _, m in list(received) if len(m.points) > 1]


@pytest.fixture(scope='module')
def robot(policy, tmp_path_factory):
    root, _, _ = policy
    domain = new_domain(120, 220)
    # Only what a test must change: the checkpoint (its dims from its config.json), the CPU,
    # and configure + activate at start; eager, as the oracle (test_node checks the node's
    # compiled default, test_policy the shipped ALOHA files compiled through ROS).
    overrides = {'checkpoint': str(root), 'model': '', 'device': 'cpu', 'autostart': True,
                 'compile': False}
    with aloha_node(tmp_path_factory.mktemp('aloha_node'), overrides, domain) as r:
        ok = wait_for(lambda: all(len(moving(r.traj[g])) >= 40 for g in CONTROLLERS)
                      or r.proc.poll() is not None, 180)
        assert ok and r.proc.poll() is None, r.log()[-4000:]
        yield r


def measured(group):
    pose = LEFT if group.startswith('left') else RIGHT
    return np.array(pose.arm if group.endswith('arm') else [pose.gripper])


HOLD_AFTER = 1.0 / 70.0


def is_hold(m, group):
    """One point at rest one control period ahead, near the measured pose: where the node
    estimates the arm to be, a recent reading moved on along the setpoint, for this arm
    that never moves at most RECENT_S of motion at the speed limit away."""
    if len(m.points) != 1 or any(m.points[0].velocities):
        return False
    if abs(seconds(m.points[0].time_from_start) - HOLD_AFTER) > 1e-6:
        return False
    limits = aloha_params()['joint_limits'][group]
    speed = np.array([limits[j]['velocity'] for j in CONTROLLERS[group][1]])
    return bool(np.all(np.abs(np.array(m.points[0].positions) - measured(group))
                       <= speed * (RECENT_S + 0.02) + 1e-12))


def test_every_controller_gets_openpi_targets(robot, policy):
    root, actions, _ = policy
    want = targets(actions)
    p = aloha_params()
    assert f'configured: openpi checkpoint {root} ' in robot.log(), robot.log()[-3000:]
    settled = {}
    for g, (_, joints) in CONTROLLERS.items():
        idx = p['outputs'][g]['indices']
        limits = p['joint_limits'][g]
        lower = np.array([limits[j].get('lower', -np.inf) for j in joints])
        upper = np.array([limits[j].get('upper', np.inf) for j in joints])
        speed = np.array([limits[j]['velocity'] for j in joints])
        start, target = measured(g), want[idx]
        # The targets need no clamping into range, so the settled points are openpi's.
        assert np.all((lower < target) & (target < upper)), (g, target)
        lo, hi = np.minimum(start, target), np.maximum(start, target)
        settled[g] = 0
        received = [m for _, m in list(robot.traj[g])]
        for m in received:
            assert list(m.joint_names) == joints, m
            assert jtc_problems(m, joints, 0.0) == [], (g, jtc_problems(m, joints, 0.0))
            # A hold (a chunk used up) is where the setpoint is, within reach of the
            # measured pose: it passes the same checks but the one of the way to the target.
            hold = is_hold(m, g)
            prev, t0 = start, 0.0
            for pt in m.points:
                x, t = np.array(pt.positions), seconds(pt.time_from_start)
                assert np.all((lower <= x) & (x <= upper)), (g, x)
                # Reachable at the joint's speed from where the node estimates the arm
                # to be, point by point (time_from_start is cut to whole nanoseconds): a
                # recent reading of it moved on along the setpoint, which for this arm
                # that never moves is up to RECENT_S of motion beyond the measured pose.
                drift = speed * (RECENT_S + 0.02)
                ahead = drift if t0 == 0.0 else 0.0
                assert np.all(np.abs(x - prev) <= speed * (t - t0 + 2e-9) + ahead + 1e-12), (
                    g, x, prev)
                # On the way from the measured pose to the target, never past it (but for
                # the noise in the target).
                assert hold or np.all((lo - TOL - drift <= x) & (x <= hi + TOL + drift)), (
                    g, x, start, target)
                if t >= SETTLED:
                    np.testing.assert_allclose(x, target, rtol=0, atol=TOL, err_msg=g)
                    settled[g] += 1
                prev, t0 = x, t
    assert all(n >= 100 for n in settled.values()), settled


def test_deactivate_holds_every_controller_at_the_measured_pose(robot):
    mark = time.monotonic()
    req = ChangeState.Request()
    req.transition = Transition(label='deactivate')
    assert robot.change.wait_for_service(timeout_sec=30)
    future = robot.change.call_async(req)
    assert wait_for(future.done, 30) and future.result().success, robot.log()[-3000:]

    def after(g):
        return [m for at, m in list(robot.traj[g]) if at >= mark]

    assert wait_for(lambda: all(after(g) and is_hold(after(g)[-1], g) for g in CONTROLLERS),
                    10), {g: (measured(g), after(g)[-1:]) for g in CONTROLLERS}
    time.sleep(1.0)  # and nothing after it: an inactive node commands nothing
    for g in CONTROLLERS:
        got = after(g)
        assert is_hold(got[-1], g), g
        assert sum(is_hold(m, g) for m in got) == 1, (g, [len(m.points) for m in got])
        # Near the measured pose at rest (is_hold); the gripper near its servo angle, not
        # at the finger position (m) the state reads.
        hold = got[-1].points[0]
        assert list(hold.velocities) == [0.0] * len(hold.positions), g
