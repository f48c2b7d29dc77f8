"""The DROID profile against openpi's DROID client and DROID's controller, restated here
from their public code: examples/droid/main.py (openpi) and FrankaRobot.create_action_dict
with RobotIKSolver (droid-dataset/droid), and PickNik's ros2_robotiq_gripper for the
knuckle joint. The shipped config/droid.yaml is what is checked, last by the node itself
driving oxygen_sim_robot."""
import random

import numpy as np
import pytest
import yaml
from support.paths import ROOT  # noqa: E402
from support.process import new_domain  # noqa: E402

from oxygen_ros.robot.params import BY_NAME
from oxygen_ros.robot.profiles import Droid, make_profile

CONFIG = ROOT / 'config' / 'droid.yaml'

# Franka Panda joint limits (rad), to draw realistic states from.
Q_LOW = np.array([-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973])
Q_HIGH = np.array([2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973])
# PickNik's driver: knuckle angle = closed position * (register - 3) / 227.
KNUCKLE_CLOSED = 0.7929
REG_OPEN, REG_CLOSED = 3, 230


def shipped_profile():
    params = yaml.safe_load(CONFIG.read_text())['/**']['ros__parameters']
    assert params['robot'] == 'droid'
    return make_profile(params['robot'], **yaml.safe_load(params['profile_options']))


def test_rcl_reads_the_same_profile_options():
    # The node gets profile_options from rcl's YAML parser, not PyYAML: the folded string
    # must come through whole.
    rclpy = pytest.importorskip('rclpy')
    from rclpy.node import Node

    context = rclpy.Context()
    rclpy.init(args=['--ros-args', '--params-file', str(CONFIG)], context=context,
               domain_id=random.randint(120, 220))
    try:
        node = Node('droid_params', context=context,
                    automatically_declare_parameters_from_overrides=True)
        value = node.get_parameter('profile_options').value
        node.destroy_node()
    finally:
        rclpy.shutdown(context=context)
    params = yaml.safe_load(CONFIG.read_text())['/**']['ros__parameters']
    assert value == params['profile_options']


def openpi_client(row):
    """examples/droid/main.py: the first 8 dims, gripper to 1 above 0.5 else 0, clip all."""
    action = np.array(row[:8], dtype=np.float64)
    action[-1] = 1.0 if action[-1] > 0.5 else 0.0
    return np.clip(action, -1, 1)


def droid_controller(action, joints):
    """create_action_dict for joint_velocity with a gripper position: the joint target from
    the measured joints and the gripper command in DROID's 0 (open) .. 1 (closed)."""
    v = np.array(action[:-1], dtype=np.float64)
    # joint_velocity_to_delta: 0.2 rad per step on every joint, the vector scaled into range.
    peak = np.max(np.abs(v) / (np.full(7, 0.2) / 0.2))
    if peak > 1:
        v = v / peak
    return np.asarray(joints) + v * 0.2, float(np.clip(action[-1], 0, 1))


def knuckle_from_droid(g):
    """The knuckle angle the driver reports for DROID's gripper value g, taking the position
    register as linear in finger width (register 3 fully open, 230 fully closed)."""
    register = REG_OPEN + (REG_CLOSED - REG_OPEN) * g
    return KNUCKLE_CLOSED * (register - REG_OPEN) / (REG_CLOSED - REG_OPEN)


def random_case(rng):
    q = rng.uniform(Q_LOW, Q_HIGH)
    knuckle = KNUCKLE_CLOSED * rng.uniform()
    chunk = rng.normal(0.0, 0.7, size=(15, 32))  # pi05_droid: 15 actions, 32 padded dims
    chunk[:, 7] = rng.uniform(-0.3, 1.3, size=15)
    return np.concatenate([q, [knuckle]]), chunk


def test_shipped_config_gives_droids_first_target():
    p = shipped_profile()
    rng = np.random.default_rng(14)
    cases = [random_case(rng) for _ in range(64)]
    cases[0][1][0, 7] = 0.5  # exactly at the threshold: openpi sends 0
    sent = []
    for state, chunk in cases:
        joints, gripper = droid_controller(openpi_client(chunk[0]), state[:7])
        out = p.decode_actions(chunk, state)
        np.testing.assert_allclose(out[0, :7], joints, rtol=0, atol=1e-9)
        assert out[0, 7] == pytest.approx(knuckle_from_droid(gripper), abs=1e-9)
        # Re-anchored on the frame's own joints, the first target is the same.
        np.testing.assert_allclose(p.reanchor(chunk, state, 0)[0], out[0], rtol=0, atol=1e-12)
        sent.append(gripper)
    assert set(sent) == {0.0, 1.0} and sent[0] == 0.0
    # The draws do exercise the clipping: some velocities were outside [-1, 1].
    assert max(np.abs(c[0, :7]).max() for _, c in cases) > 1


def test_shipped_config_state_gripper_is_droids():
    # DROID observes 1 - width / max width; the driver reports the register as an angle.
    p = shipped_profile()
    rng = np.random.default_rng(3)
    for register in [3, 50, 117, 200, 230]:
        q = rng.uniform(Q_LOW, Q_HIGH)
        knuckle = KNUCKLE_CLOSED * (register - REG_OPEN) / (REG_CLOSED - REG_OPEN)
        s = p.encode_state(np.concatenate([q, [knuckle]]))
        np.testing.assert_array_equal(s[:7], q)
        assert s[7] == pytest.approx((register - REG_OPEN) / (REG_CLOSED - REG_OPEN), abs=1e-12)


def run_lagging_arm(profile, state, chunk, reach, reanchored):
    """DROID's loop on an arm that covers only `reach` of the way to each target per step.
    Returns the targets the profile gives, DROID's targets and the measured joints."""
    q = state[:7].copy()
    open_loop = profile.decode_actions(chunk, state)
    ours, droids, measured = [], [], []
    for i in range(len(chunk)):
        measured.append(q.copy())
        target, _ = droid_controller(openpi_client(chunk[i]), q)
        droids.append(target)
        if reanchored:
            now = np.concatenate([q, state[7:]])
            ours.append(profile.reanchor(chunk, now, i)[0, :7])
        else:
            ours.append(open_loop[i, :7])
        q = q + reach * (target - q)
    return np.array(ours), np.array(droids), np.array(measured)


@pytest.mark.parametrize('reach', [0.3, 0.7])
def test_reanchored_targets_follow_droid_on_a_lagging_arm(reach):
    p = shipped_profile()
    state, chunk = random_case(np.random.default_rng(int(reach * 10)))
    ours, droids, _ = run_lagging_arm(p, state, chunk, reach, reanchored=True)
    np.testing.assert_allclose(ours, droids, rtol=0, atol=1e-12)


def test_open_loop_runs_ahead_by_the_accumulated_lag():
    p = Droid(velocity_scale=0.2, open_loop=True)
    assert p.reanchor(np.zeros((3, 8)), np.zeros(8), 1) is None
    state, chunk = random_case(np.random.default_rng(5))
    ours, droids, measured = run_lagging_arm(p, state, chunk, 0.5, reanchored=False)
    # Open loop: q0 + 0.2 sum v; DROID: q_measured + 0.2 v. They differ by how far the arm
    # is behind the targets integrated so far.
    steps = 0.2 * np.clip(chunk[:, :7], -1, 1)
    behind = state[:7] + np.cumsum(steps, axis=0) - steps - measured
    np.testing.assert_allclose(ours - droids, behind, rtol=0, atol=1e-12)
    assert np.abs(behind[-1]).max() > 0.05
    # An arm that reaches every target makes the two the same.
    ours, droids, _ = run_lagging_arm(p, state, chunk, 1.0, reanchored=False)
    np.testing.assert_allclose(ours, droids, rtol=0, atol=1e-12)


def test_reanchor_extends_from_the_measured_joints_by_hand():
    p = Droid()
    a = np.array([[1.0] * 7 + [0.2], [0.5] * 7 + [0.7], [-2.0] * 7 + [0.9]])
    measured = np.array([1.0, 0, 0, 0, 0, 0, 0, 0.5])
    out = p.reanchor(a, measured, 1)
    assert out.shape == (2, 8)
    # From step 1 on: 1 + 0.2 * 0.5, then + 0.2 * (-1) (clipped); the gripper is absolute.
    assert out[:, 0].tolist() == pytest.approx([1.1, 0.9])
    assert out[:, 1].tolist() == pytest.approx([0.1, -0.1])
    assert out[:, 7].tolist() == pytest.approx([0.7, 0.9])
    assert p.reanchor(a, measured, 3).shape == (0, 8)
    with pytest.raises(ValueError, match='first action 4 outside a 3-action chunk'):
        p.reanchor(a, measured, 4)
    with pytest.raises(ValueError, match='shape'):
        p.reanchor(a, measured[:7], 0)


def test_droids_own_velocity_limit_without_clipping():
    # Unclipped, DROID's controller scales the whole vector so its largest component is 1.
    p = Droid(clip_velocities=False)
    a = np.array([[2.0, -1.0, 0.5, 0, 0, 0, 0, 0], [0.5, 0, 0, 0, 0, 0, 0, 0]])
    out = p.decode_actions(a, np.zeros(8))
    assert out[0, :3].tolist() == pytest.approx([0.2, -0.1, 0.05])
    assert out[1, :3].tolist() == pytest.approx([0.3, -0.1, 0.05])
    assert Droid().decode_actions(a, np.zeros(8))[0, :3].tolist() == pytest.approx(
        [0.2, -0.2, 0.1])


def test_delta_adds_the_joints_back_by_hand():
    # openpi's joint-position configs: AbsoluteActions(make_bool_mask(7, -1)).
    p = Droid(velocity=False, delta=True, gripper_closed=0.8)
    state = np.array([0.1, -0.5, 0.2, -2.0, 0.3, 1.9, -0.7, 0.4])
    a = np.zeros((2, 32))
    a[0, :8] = [0.01, 0.02, -0.03, 0.04, 0.0, -0.05, 0.06, 0.25]
    a[1, :8] = [-0.01, 0.0, 0.0, 0.1, 0.2, 0.0, 0.0, 1.0]
    out = p.decode_actions(a, state)
    assert out[0, :7].tolist() == pytest.approx([0.11, -0.48, 0.17, -1.96, 0.3, 1.85, -0.64])
    assert out[1, :7].tolist() == pytest.approx([0.09, -0.5, 0.2, -1.9, 0.5, 1.9, -0.7])
    # The gripper is not a delta: 0.25 and 1.0 of the 0.8 rad knuckle range.
    assert out[:, 7].tolist() == pytest.approx([0.2, 0.8])
    # Absolute positions would be off by exactly the joints.
    absolute = Droid(velocity=False, gripper_closed=0.8).decode_actions(a, state)
    np.testing.assert_allclose(out[:, :7] - absolute[:, :7], [state[:7]] * 2, atol=1e-15)
    # Position targets are absolute already: nothing to re-anchor.
    assert p.reanchor(a, state, 0) is None


def test_option_conflicts_and_bad_actions():
    with pytest.raises(ValueError, match='delta is for joint-position checkpoints'):
        Droid(velocity=True, delta=True)
    a = np.zeros((2, 8))
    a[1, 7] = np.nan  # binarised, NaN would read as an open gripper
    with pytest.raises(ValueError, match='non-finite actions'):
        Droid(binarize_gripper=True).decode_actions(a, np.zeros(8))


def test_reanchors_says_which_options_reanchor():
    assert Droid().reanchors
    assert not Droid(open_loop=True).reanchors
    assert not Droid(velocity=False).reanchors
    assert not Droid(velocity=False, delta=True).reanchors


class DroidWatcher:
    """What the test sees of a DROID node driving the lagging sim robot: every joint state
    (state order), trajectory and predicted chunk."""

    def __init__(self, node):
        from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
        from sensor_msgs.msg import JointState
        from trajectory_msgs.msg import JointTrajectory

        params = yaml.safe_load(CONFIG.read_text())['/**']['ros__parameters']
        self.joints = params['joints']
        self.states = []  # positions in state order
        self.stamps = []
        self.traj = {g: [] for g in params['output_groups']}
        self.predicted = []
        # Deep, so none of the 100 Hz stream is dropped while this process is busy.
        best = QoSProfile(depth=1000, reliability=qos_profile_sensor_data.reliability)
        node.create_subscription(JointState, '/joint_states', self._on_state, best)
        reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        for g in self.traj:
            node.create_subscription(JointTrajectory, params['outputs'][g]['topic'],
                                     lambda m, g=g: self.traj[g].append(m), reliable)
        node.create_subscription(JointTrajectory, '/oxygen_node/predicted_trajectory',
                                 self.predicted.append, reliable)

    def _on_state(self, m):
        by_name = dict(zip(m.name, m.position, strict=True))
        self.states.append([by_name[j] for j in self.joints])
        self.stamps.append(m.header.stamp.sec + m.header.stamp.nanosec * 1e-9)


def jtc_checker():
    """tools/node_load.py's joint_trajectory_controller acceptance rules."""
    import importlib.util

    path = CONFIG.parents[1] / 'tools' / 'node_load.py'
    spec = importlib.util.spec_from_file_location('node_load', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.jtc_problems


def test_node_reanchors_droid_targets_on_the_lagging_sim_robot(tmp_path):
    """The node on config/droid.yaml (tiny random model) drives oxygen_sim_robot, whose arm
    moves at most 0.3 rad/s and so falls behind the velocity targets. Every arm trajectory
    must start at DROID's target for its first action, joints measured + 0.2 v, and every
    trajectory must pass the joint_trajectory_controller checks.

    The test knows v exactly: the published chunk (~/predicted_trajectory) integrates 0.2 v
    from the frame's joints, so its consecutive differences are 0.2 v. Which joint reading
    the node took as "measured" depends on when its control tick ran, which the test cannot
    know; but the node took it from the same /joint_states stream the test records, so the
    measured joints recovered from a trajectory (its first point - 0.2 v) must be one of the
    readings seen, to rounding. Only where this process missed readings (a gap in their
    stamps) may it lie between two seen ones: within the arm's 0.3 rad/s of the gap."""
    pytest.importorskip('rclpy')
    import signal
    import subprocess
    import sys

    from support.node import node_process
    from support.process import node_env, wait_for, write_params

    import oxygen_ros.msg  # noqa: F401 (built by colcon; must import)

    params = yaml.safe_load(CONFIG.read_text())['/**']['ros__parameters']
    # The targets checked here are DROID's own; joint limits, which would clamp some of
    # them, are a layer of their own (test_limits.py, test_node_limits.py).
    del params['joint_limits']
    params['allow_unlimited'] = True  # on purpose: the node refuses DROID without limits
    # The subtask format: a pi05 prompt with the 8-d state does not fit the tiny model.
    # Eager: what is checked is the targets; the compiled path has its own tests, and a cold
    # compile of this model's programs (85 s on a slow 2-core machine) outlasted the wait.
    params.update(model='tiny', prompt_format='subtask', allow_random_weights=True,
                  autostart=True, threads=1, seed=0, publish_predicted=True, compile=False,
                  narration_every_n_frames=0,
                  # the sim robot's: small images for the tiny model, a slow arm
                  image_width=64, image_height=48, max_joint_speed=0.3, joint_rate_hz=100.0,
                  report_every_s=60.0)
    domain = new_domain(120, 220)
    sim_log = open(tmp_path / 'sim.log', 'w')
    sim = subprocess.Popen([sys.executable, '-m', 'oxygen_ros.sim.sim_robot', '--ros-args',
                            '--params-file', write_params(tmp_path / 'sim.yaml', params)],
                           stdout=sim_log, stderr=subprocess.STDOUT, env=node_env(domain))
    try:
        with node_process(tmp_path, params, domain, 'droid_watcher', DroidWatcher) as (
                proc, w):
            arm = w.traj['arm']
            ok = wait_for(lambda: len(arm) >= 150 and len(w.predicted) >= 10
                          or proc.poll() is not None, 90)
            assert ok and proc.poll() is None, w.log()[-3000:]
            log = w.log()
    finally:
        sim.send_signal(signal.SIGINT)
        try:
            sim.wait(20)
        except subprocess.TimeoutExpired:
            sim.kill()
        sim_log.close()
    assert 'Traceback' not in log, log[-3000:]

    jtc_problems = jtc_checker()
    arm_joints = params['outputs']['arm']['joints']
    for g, received in w.traj.items():
        joints = params['outputs'][g]['joints']
        for m in received:
            assert jtc_problems(m, joints, 0.0) == [], (g, jtc_problems(m, joints, 0.0))
    hold_after = 1.0 / params.get('control_rate_hz', BY_NAME['control_rate_hz'].default)

    def is_hold(m):
        t = m.points[0].time_from_start.sec + m.points[0].time_from_start.nanosec * 1e-9
        return len(m.points) == 1 and not any(m.points[0].velocities) and abs(
            t - hold_after) < 1e-6

    gaps = np.diff(w.stamps)
    missed = gaps.max() > 1.5 / params['joint_rate_hz']
    tol = params['max_joint_speed'] * gaps.max() if missed else 0.0
    tol += 1e-9  # rounding: the test subtracts what the node added

    def distance(q, seen):
        return np.abs(seen - q).max(axis=-1).min()

    # The gripper command is binarised; a hold keeps the gripper where its setpoint is: among
    # where it was measured and where it was sent, or past them by as much as the
    # controller's cubic between two points overshoots them. A Hermite segment of length h
    # reaches at most 4/27 h (|v_a| + |v_b|) beyond its ends; v_a of a trajectory's first
    # segment is the speed it was moving at, at most 1.5 times a segment's mean speed or a
    # point's velocity (seen: a hold at -0.072, the setpoint swinging past 0 between steps).
    closed = yaml.safe_load(params['profile_options'])['gripper_closed']
    gripper_seen = np.array(w.states)[:, 7]
    lo, hi = min(gripper_seen.min(), 0.0, closed), max(gripper_seen.max(), 0.0, closed)
    swing = 0.0
    sent = [m for m in w.traj['gripper'] if not is_hold(m)]
    fastest = max((abs(p.velocities[0]) for m in sent for p in m.points), default=0.0)
    timed = [([p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in m.points],
              [p.positions[0] for p in m.points], [abs(p.velocities[0]) for p in m.points])
             for m in sent]
    for t, q, _ in timed:
        h = np.diff(t)
        mean = np.abs(np.diff(q)) / np.where(h > 0, h, np.inf)
        fastest = max(fastest, 1.5 * float(mean.max(initial=0.0)))
    for t, _, v in timed:
        swing = max(swing, 4 / 27 * t[0] * (fastest + v[0]))
        for k in range(1, len(t)):
            swing = max(swing, 4 / 27 * (t[k] - t[k - 1]) * (v[k - 1] + v[k]))
    for m in w.traj['gripper']:
        for p in m.points:
            assert (lo - tol - swing <= p.positions[0] <= hi + tol + swing if is_hold(m)
                    else p.positions[0] in (0.0, closed)), (m, swing)

    seen = np.array(w.states)[:, :7]
    chunks = [np.array([p.positions for p in m.points])[:, :7] for m in w.predicted]
    # 0.2 v of actions 1.. of each chunk, and v clipped to [-1, 1] by the client's rule.
    steps = [np.diff(c, axis=0) for c in chunks]
    assert all(np.abs(s).max() <= 0.2 + 1e-9 for s in steps)

    def measured(step, first_point):
        """The joints q from which DROID's controller gives `first_point` for the velocity
        of `step`: its target is q + 0.2 v, the one from q = 0 is 0.2 v."""
        from_zero, _ = droid_controller(openpi_client(np.append(step / 0.2, 0.0)), np.zeros(7))
        return first_point - from_zero

    matched = behind = 0
    for k, m in enumerate(arm):
        assert list(m.joint_names) == arm_joints
        pts = np.array([p.positions for p in m.points])
        if is_hold(m):
            # A hold: where the controller's setpoint is, which lies among the joints seen
            # and the points sent before (the arm moved on after its last reading).
            box = np.concatenate([seen, *(np.array([p.positions for p in a.points])
                                          for a in arm[:k])])
            matched += bool(np.all((box.min(0) - tol <= pts[0]) & (pts[0] <= box.max(0) + tol)))
            continue
        else:
            # The chunk and first action (f >= 1: action 0 is the frame's own time) whose
            # steps the points take after the first; n points are actions f .. f + n - 1.
            n = len(pts)
            candidates = []
            for c, s in enumerate(steps):
                f = len(chunks[c]) - n
                if f >= 1 and np.allclose(np.diff(pts, axis=0), s[f:f + n - 1], rtol=0,
                                          atol=1e-9):
                    candidates.append(measured(s[f - 1], pts[0]))
                    if n > 1:  # the chunk is known (one point fits any)
                        behind = max(behind, np.abs(pts[0] - chunks[c][f]).max())
        dist = [distance(q, seen) for q in candidates]
        matched += bool(dist) and min(dist) <= tol
    assert matched == len(arm), f'{matched} of {len(arm)} at a reading seen (tolerance {tol})'
    # The arm did lag: targets integrated from the frame's joints (open loop) would have
    # been this far off, far beyond the tolerance.
    assert behind > 10 * tol, (behind, tol)
