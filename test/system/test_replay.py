"""oxygen-replay against what it replays.

A live run is recorded here over rclpy (the installed node on the tiny model with
frame_noise and a seed; a robot of this process whose cameras and moving joints publish
reliably, so the recorder misses nothing the node got; its joint topic held back for a
stretch) into an sqlite3 and an MCAP bag at once, with the node's ~/predicted_trajectory and
commands. Replayed, every chunk of the node must come out again for the same frame, and
the frames the node skipped while its joints were stale are skipped offline too. HDF5
episodes written here are replayed and the report's errors recomputed independently, from
the engine run on the file's arrays and the file's /action. Bad recordings end with one
clear line.
"""
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from support.paths import ROOT  # noqa: E402

from oxygen_ros.robot import replay

CONFIG = ROOT / 'config'
HOLD_S = 1.5  # how long the joint topic is held back
REMAP = 'front/image:=/remapped/front'


def path(t):
    """Where the recorded robot has joint i at time t (s)."""
    return [0.1 * i + 0.3 * math.sin(0.8 * t + i) for i in range(8)]


def seconds(stamp):
    return stamp.sec + stamp.nanosec * 1e-9


def bag_chunks(bag):
    """The node's chunks in a bag, read here with rosbags: stamp -> (joint names, [H, J])."""
    from rosbags.rosbag2 import Reader
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_JAZZY)
    out = {}
    with Reader(bag) as r:
        conns = [c for c in r.connections if c.topic == '/oxygen_node/predicted_trajectory']
        for c, _, raw in r.messages(connections=conns):
            m = store.deserialize_cdr(raw, c.msgtype)
            out[seconds(m.header.stamp)] = (list(m.joint_names),
                                            np.array([p.positions for p in m.points]))
    return out


@pytest.fixture(scope='module')
def recorded(tmp_path_factory):
    """(the params file, {storage: bag}, the hold-back's (start, end) on the system clock)."""
    pytest.importorskip('rclpy')
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image, JointState
    from support.node import JOINTS, PARAMS, image, joint_state, node_process
    from support.process import new_domain, wait_for
    from trajectory_msgs.msg import JointTrajectory

    from oxygen_ros.robot.record import Recorder

    tmp = tmp_path_factory.mktemp('recorded')
    bags = {'sqlite3': tmp / 'run_sqlite3', 'mcap': tmp / 'run_mcap'}
    topics = {'/remapped/front': 'sensor_msgs/msg/Image',
              '/wrist/image': 'sensor_msgs/msg/Image',
              '/joint_states': 'sensor_msgs/msg/JointState',
              '/oxygen_node/predicted_trajectory': 'trajectory_msgs/msg/JointTrajectory',
              '/arm_controller/joint_trajectory': 'trajectory_msgs/msg/JointTrajectory',
              '/gripper_controller/joint_trajectory': 'trajectory_msgs/msg/JointTrajectory'}

    class Robot:
        def __init__(self, node):
            self.node = node
            reliable = QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE)
            self.cams = {'front': node.create_publisher(Image, '/remapped/front', reliable),
                         'wrist': node.create_publisher(Image, '/wrist/image', reliable)}
            self.joints = node.create_publisher(JointState, '/joint_states', reliable)
            self.hold = False
            self.chunks = []
            node.create_subscription(JointTrajectory, '/oxygen_node/predicted_trajectory',
                                     self.chunks.append, reliable)
            self.recorder = Recorder(node, list(zip(bags.values(), bags, strict=True)),
                                     topics, QoSProfile(depth=1000,
                                                        reliability=ReliabilityPolicy.RELIABLE))
            # Nothing is sent before the recorder hears it: the node must not have inputs
            # the recording lacks.
            pubs = [*self.cams.values(), self.joints]
            assert wait_for(lambda: all(p.get_subscription_count() for p in pubs), 30)
            node.create_timer(1 / 30, self._images)
            node.create_timer(1 / 50, self._joints)

        def _images(self):
            stamp = self.node.get_clock().now().to_msg()
            for pub in self.cams.values():
                pub.publish(image(stamp=stamp))

        def _joints(self):
            if self.hold:
                return
            stamp = self.node.get_clock().now().to_msg()
            m = joint_state(stamp, JOINTS)
            m.position = path(seconds(stamp))
            self.joints.publish(m)

    # Eager, as the replay's engine runs: the chunks must agree to float32 rounding.
    params = dict(PARAMS, frame_noise=True, seed=7, publish_predicted=True, compile=False)
    with node_process(tmp, params, new_domain(120, 220), 'recorded_robot', Robot,
                      '-r', REMAP) as (proc, robot):
        assert wait_for(lambda: len(robot.chunks) > 25 or proc.poll() is not None, 120), \
            robot.log()
        assert proc.poll() is None, robot.log()
        start = time.time()
        robot.hold = True
        time.sleep(HOLD_S)
        robot.hold = False
        end = time.time()
        n = len(robot.chunks)
        assert wait_for(lambda: len(robot.chunks) > n + 15, 60), robot.log()
        robot.recorder.close()
        counts = dict(robot.recorder.counts)
    assert counts['/oxygen_node/predicted_trajectory'] > 40, counts
    assert counts['/arm_controller/joint_trajectory'] > 0, counts
    return tmp / 'params.yaml', bags, (start, end)


def replayed(params, bag, frames='auto', rate=10.0):
    """oxygen-replay's Run of `bag` with the node's parameters."""
    cfg = replay.robot_config(replay.node_values([params], []))
    engine = replay.make_engine(cfg, threads=1)
    plan = replay.Plan.of(cfg, '', replay.remap_rules([REMAP], ''))
    run = replay.replay_bag(Path(bag), cfg, engine, plan, frames, rate, 'auto',
                            progress=False, say=lambda m: None)
    run.bag.close()
    return run


@pytest.mark.parametrize('storage', ['sqlite3', 'mcap'])
def test_every_live_chunk_comes_out_again_for_its_frame(recorded, storage):
    params, bags, _ = recorded
    live = bag_chunks(bags[storage])
    run = replayed(params, bags[storage])
    assert run.mode == 'live' and run.live_frames == len(live) > 40
    assert run.unmatched == [], run.unmatched[:5]
    got = {p.stamp: p for p in run.frames}
    assert len(got) == len(live)
    names = list(replay.robot_config(replay.node_values([params], [])).output_names.values())
    worst = 0.0
    for stamp, (joints, chunk) in live.items():
        p = got.get(stamp) or next(q for s, q in got.items() if abs(s - stamp) < 1e-6)
        assert joints == names
        assert p.positions.shape == chunk.shape
        worst = max(worst, float(np.max(np.abs(p.positions - chunk))))
    # The same float32 model on the same inputs; the live engine also decoded narration.
    assert worst < 1e-5, worst
    # Where an input came between two looks of the node, its chunk tells which it had
    # taken; most frames are the inputs as recorded up to them.
    assert run.earlier <= 0.2 * len(live), run.earlier
    # Different noise would not pass: the chunks do move with it.
    spread = np.ptp(np.stack([c for _, c in live.values()]), axis=0).max()
    assert spread > 100 * max(worst, 1e-7)


def test_frames_skipped_live_while_the_joints_were_stale_are_skipped_offline(recorded):
    params, bags, (start, end) = recorded
    live = sorted(bag_chunks(bags['mcap']))
    # The node ran no frame while its joints were stale (0.5 s after the last reading).
    stale = [s for s in live if start + 0.6 < s < end]
    assert stale == [], stale
    run = replayed(params, bags['mcap'], frames='rate', rate=20.0)
    assert run.mode == 'rate' and len(run.frames) > 40
    skips = [(t, w) for t, w in run.skips if 'joints' in w and 'stale' in w]
    assert skips, run.skips[:5]
    first, last = skips[0][0], skips[-1][0]
    # Stale from max_input_age after the last reading before the hold, to the first after.
    assert start + 0.4 < first < start + 0.7, (first - start)
    assert end - 0.1 < last < end + 0.1, (last - end)
    assert [p.stamp for p in run.frames if first <= p.stamp <= last] == []
    # Up to the hold's end: after it the live node may run a frame on a reading the bag got a
    # few ms later than the node did (the recorder is another subscriber; seen: a live frame
    # 6 ms after the end, inside the offline window by the reading's later arrival).
    assert [s for s in live if first <= s <= min(last, end)] == []
    # Live mode runs nothing there either, and finds every frame the node ran.
    again = replayed(params, bags['mcap'])
    assert again.unmatched == [] and len(again.frames) == len(live)


def test_command_line_writes_the_report_plots_and_an_output_bag(recorded, tmp_path, capsys):
    params, bags, _ = recorded
    out = tmp_path / 'report'
    code = replay.main([str(bags['sqlite3']), '--params-file', str(params), '--remap', REMAP,
                        '--threads', '1', '--out', str(out), '--no-progress',
                        '--bag-out', str(tmp_path / 'replayed.mcap')])
    assert code == 0, capsys.readouterr()
    rep = json.loads((out / 'report.json').read_text())
    rec = rep['recordings'][0]
    assert rec['storage'] == 'sqlite3' and rec['frames'] == 'live'
    assert rec['live']['unmatched'] == [] and rec['live']['max_abs_diff'] < 1e-5
    # The node commanded: its commands are what followed.
    assert rep['against'] == ['commands'] and math.isfinite(rep['mae'])
    assert len(rep['mae_per_step']) == rep['horizon'] == 4
    assert set(rep['per_joint']) == set(rep['joints']) and len(rep['joints']) == 8
    for j in rep['per_joint'].values():
        assert abs(j['lead_s']) <= 0.5 and j['mae_at_lead'] <= j['mae'] + 1e-12
    assert len(rep['plots']) == 8 and all(Path(p).stat().st_size > 1000 for p in rep['plots'])
    assert rep['time_ratio'] > 0
    # The output bag: the recording as it was, the replayed chunks beside it.
    from rosbags.rosbag2 import Reader

    with Reader(tmp_path / 'replayed.mcap') as r:
        topics = {c.topic: c.msgcount for c in r.connections}
    with Reader(bags['sqlite3']) as r:
        before = {c.topic: c.msgcount for c in r.connections}
    assert topics.pop(replay.REPLAY_TOPIC) == rec['frames_run']
    assert topics == before
    replayed_chunks = {}
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_JAZZY)
    with Reader(tmp_path / 'replayed.mcap') as r:
        conns = [c for c in r.connections if c.topic == replay.REPLAY_TOPIC]
        for c, _, raw in r.messages(connections=conns):
            m = store.deserialize_cdr(raw, c.msgtype)
            replayed_chunks[seconds(m.header.stamp)] = np.array([p.positions for p in m.points])
    live = bag_chunks(bags['sqlite3'])
    for stamp, (_, chunk) in live.items():
        mine = next(v for s, v in replayed_chunks.items() if abs(s - stamp) < 2e-9)
        np.testing.assert_allclose(mine, chunk, atol=1e-5)


# -- HDF5 episodes ---------------------------------------------------------------------------

ALOHA_CAMS = ('cam_high', 'cam_left_wrist', 'cam_right_wrist')


def write_episode(path, steps, seed, cams=ALOHA_CAMS, with_action=True):
    """An ACT/ALOHA episode as oxygen-demos writes it: qpos with normalised grippers,
    /action, 32x24 images per camera (gym-aloha's name for cam_high, as oxygen-demos
    may write it)."""
    import h5py

    rng = np.random.default_rng(seed)
    t = np.arange(steps)[:, None] * 0.02
    # Joints well within ALOHA's speed limit (pi rad/s): faster readings are glitches.
    qpos = 0.2 * np.sin(t + np.arange(14)) + 0.002 * rng.standard_normal((steps, 14))
    qpos[:, [6, 13]] = 0.5 + 0.4 * np.sin(2 * t)
    action = np.roll(qpos, -3, axis=0) + 0.01 * rng.standard_normal((steps, 14))
    with h5py.File(path, 'w') as f:
        f.attrs['dt'] = 0.02
        f.create_dataset('observations/qpos', data=qpos.astype(np.float32))
        if with_action:
            f.create_dataset('action', data=action.astype(np.float32))
        for cam in cams:
            name = 'top' if cam == 'cam_high' else cam
            f.create_dataset(f'observations/images/{name}',
                             data=rng.integers(0, 256, (steps, 24, 32, 3), dtype=np.uint8))
    return qpos.astype(np.float32).astype(float), action.astype(np.float32).astype(float)


@pytest.fixture(scope='module')
def aloha_params(tmp_path_factory):
    """pi05.yaml and aloha.yaml with a small random model ALOHA's 14 dims fit."""
    import yaml

    tmp = tmp_path_factory.mktemp('aloha')
    from oxygen_ros.model.config import CONFIG_DIR

    model = yaml.safe_load((CONFIG_DIR / 'tiny.yaml').read_text())
    model.update(name='tiny14', action_dim=16, action_horizon=6, max_token_len=96)
    (tmp / 'tiny14.yaml').write_text(yaml.safe_dump(model))
    over = tmp / 'over.yaml'
    over.write_text(yaml.safe_dump({'/**': {'ros__parameters': {
        'model': str(tmp / 'tiny14.yaml'), 'device': 'cpu', 'threads': 1, 'seed': 3,
        'frame_noise': True, 'prompt_format': 'subtask', 'prompt': 'move the cube',
        'compile': False}}}))
    return [CONFIG / 'pi05.yaml', CONFIG / 'aloha.yaml', over]


def test_hdf5_episodes_report_the_error_an_independent_computation_gives(aloha_params,
                                                                          tmp_path):
    from oxygen_ros.engine import Engine, EngineConfig, Observation
    from oxygen_ros.robot.aloha import finger_from_normalized, gripper_from_finger

    files = {k: write_episode(tmp_path / f'episode_{k}.hdf5', 60, seed=k) for k in range(2)}
    out = tmp_path / 'report'
    assert replay.main([str(tmp_path), *[a for f in aloha_params for a in
                                         ('--params-file', str(f))],
                        '--rate', '10', '--out', str(out), '--no-progress']) == 0
    rep = json.loads((out / 'report.json').read_text())
    assert rep['against'] == ['action'] and len(rep['recordings']) == 2
    # The same runs through the API, to see each frame.
    cfg = replay.robot_config(replay.node_values(aloha_params, []))
    runs = [replay.replay_episode(tmp_path / f'episode_{k}.hdf5', cfg,
                                  replay.make_engine(cfg, threads=1), 10.0, 'auto',
                                  progress=False, say=lambda m: None) for k in range(2)]
    # Independently: the engine on the file's arrays, the profile's targets, /action.
    engine = Engine(EngineConfig(model=cfg.p.model, seed=3, frame_noise=True, threads=1,
                                 prompt_format='subtask', max_new_tokens=30, compile=False))
    profile = cfg.profile
    horizon = engine.action_horizon
    errors = []
    for k, run in enumerate(runs):
        qpos, action = files[k]
        steps = [round((p.stamp - replay.EPOCH) / 0.02) for p in run.frames]
        # A frame every 0.1 s (5 steps) from the first tick, 0.1 s after the first step.
        assert steps == list(range(5, 60, 5)), steps
        state = qpos.copy()
        state[:, [6, 13]] = finger_from_normalized(qpos[:, [6, 13]])
        want = action.copy()
        want[:, [6, 13]] = gripper_from_finger(finger_from_normalized(action[:, [6, 13]]))
        import h5py

        with h5py.File(tmp_path / f'episode_{k}.hdf5') as f:
            imgs = {c: f[f'observations/images/{"top" if c == "cam_high" else c}'][()]
                    for c in ALOHA_CAMS}
        slots = dict(zip(ALOHA_CAMS, ('base_0_rgb', 'left_wrist_0_rgb', 'right_wrist_0_rgb'),
                         strict=True))
        for p, t in zip(run.frames, steps, strict=True):
            obs = Observation(stamp=replay.EPOCH + t * 0.02,
                              images={slots[c]: imgs[c][t] for c in ALOHA_CAMS},
                              state=profile.encode_state(state[t]), prompt='move the cube')
            chunk = profile.decode_actions(engine.step(obs).actions, state[t])
            np.testing.assert_allclose(p.positions, chunk, atol=1e-6)
            rows = t + np.arange(horizon)
            err = np.full((horizon, 14), np.nan)
            inside = rows < len(want)
            err[inside] = np.abs(chunk[inside] - want[rows[inside]])
            errors.append(err)
    err = np.stack(errors)  # [frames, horizon, joints]
    names = rep['joints']
    assert len(names) == 14
    for j, name in enumerate(names):
        assert rep['per_joint'][name]['mae'] == pytest.approx(np.nanmean(err[..., j]),
                                                              rel=1e-6)
        np.testing.assert_allclose(rep['per_joint'][name]['mae_per_step'],
                                   np.nanmean(err[..., j], axis=0), rtol=1e-6)
    assert rep['mae'] == pytest.approx(np.nanmean(err), rel=1e-6)
    np.testing.assert_allclose(rep['mae_per_step'], np.nanmean(err, axis=(0, 2)), rtol=1e-6)


def test_lead_is_the_shift_that_aligns_the_prediction_with_what_followed():
    """A prediction that runs 0.1 s ahead of what followed is found to lead by 0.1 s."""
    period = 0.02
    t = np.arange(0, 10, 0.001)
    follow = np.sin(t)
    ref = replay.Reference.from_series([list(zip(t, follow, strict=True))])
    frames = [replay.Predicted(s, s, np.sin(s + 0.1 + period * np.arange(10))[:, None])
              for s in np.arange(1.0, 8.0, 0.1)]
    c = replay.compare(frames, ref, period, ['j'], max_shift=0.3)
    assert c['joints']['j']['lead_s'] == pytest.approx(0.1, abs=1e-9)
    assert c['joints']['j']['mae_at_lead'] < 1e-4 < c['joints']['j']['mae']


def test_commands_are_followed_as_a_controller_follows_them():
    """Each trajectory replaces the one before from its start, from where that one was."""
    ref = replay.Reference.from_commands(
        [(1.0, [0], np.array([1.0]), np.array([[1.0]])),
         (1.5, [0], np.array([0.5]), np.array([[0.0]]))], 1, 3.0)
    at = [ref.at(np.array([x]), 0)[0] for x in (0.5, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5)]
    np.testing.assert_allclose(at[1:], [1.0, 1.0, 1.0, 0.5, 0.0, 0.0])
    assert math.isnan(at[0])


# -- bad recordings ----------------------------------------------------------------------------

def run_cli(capsys, *args):
    code = replay.main([*args, '--no-progress'])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_bag_without_the_robots_topics_is_refused_by_name(tmp_path, capsys):
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_JAZZY)
    bag = tmp_path / 'other'
    with Writer(bag, version=9, storage_plugin=StoragePlugin.MCAP) as w:
        c = w.add_connection('/chatter', 'std_msgs/msg/String', typestore=store)
        w.write(c, 1, store.serialize_cdr(store.types['std_msgs/msg/String'](data='hi'),
                                          'std_msgs/msg/String'))
    code, text = run_cli(capsys, str(bag), '--robot', 'sim', '-p', 'model:=tiny',
                         '-p', 'prompt_format:=subtask', '-p', 'compile:=false',
                         '--out', str(tmp_path / 'r'))
    assert code == 1
    assert 'oxygen-replay: error:' in text and 'Traceback' not in text
    assert '/exterior_1/image_raw (sensor_msgs/msg/Image)' in text
    assert '/chatter (std_msgs/msg/String)' in text


def test_an_episode_without_images_is_refused_by_name(aloha_params, tmp_path, capsys):
    write_episode(tmp_path / 'episode_0.hdf5', 10, seed=0, cams=())
    args = [a for f in aloha_params for a in ('--params-file', str(f))]
    code, text = run_cli(capsys, str(tmp_path / 'episode_0.hdf5'), *args)
    assert code == 1 and 'Traceback' not in text
    assert 'no images of camera cam_high' in text and 'no images' in text


@pytest.mark.parametrize('what, args, says', [
    ('nothing there', ['/nonexistent/bag'], 'no such file or directory'),
    ('no robot', [], "say which robot"),
    ('not a recording', ['{tmp}'], 'neither a rosbag2 recording'),
    ('a broken bag', ['{tmp}/broken.mcap'], 'not a readable rosbag2 recording'),
    ('a broken episode', ['{tmp}/episode_0.hdf5'], 'not a readable HDF5 file'),
])
def test_bad_input_ends_with_one_line(tmp_path, capsys, what, args, says):
    (tmp_path / 'broken.mcap').write_bytes(b'not mcap at all')
    if 'episode' in what:
        (tmp_path / 'episode_0.hdf5').write_bytes(b'not hdf5')
    args = [a.format(tmp=tmp_path) for a in args]
    robot = [] if what == 'no robot' else ['--robot', 'sim']
    if what == 'no robot':
        args = [str(tmp_path)]
    code, text = run_cli(capsys, *args, *robot, '-p', 'model:=tiny', '-p',
                         'prompt_format:=subtask', '-p', 'compile:=false') if robot else \
        run_cli(capsys, *args)
    assert code == 1, text
    assert says in text and 'Traceback' not in text
    assert text.strip().startswith('oxygen-replay: error:'), text


def test_the_installed_command_replays_an_episode(aloha_params, tmp_path):
    """`ros2 run oxygen_ros oxygen_replay`: the installed script, run from the repository
    root, with --robot's files found in the installed share directory."""
    ament = pytest.importorskip('ament_index_python.packages')
    import os
    import subprocess
    import sys

    write_episode(tmp_path / 'episode_0.hdf5', 30, seed=5)
    script = Path(ament.get_package_prefix('oxygen_ros')) / 'lib' / 'oxygen_ros' / 'oxygen_replay'
    r = subprocess.run([sys.executable, str(script), str(tmp_path / 'episode_0.hdf5'),
                        '--robot', 'aloha', '--params-file', str(aloha_params[-1]),
                        '--out', str(tmp_path / 'out'), '--no-progress'],
                       capture_output=True, text=True, timeout=300,
                       cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((tmp_path / 'out' / 'report.json').read_text())
    assert rep['robot'] == 'aloha' and rep['frames_run'] == 5 and rep['against'] == ['action']
    assert [Path(p).name for p in rep['params_files'][:2]] == ['pi05.yaml', 'aloha.yaml']
    assert 'report' in r.stdout


def test_a_bag_on_simulated_time_with_compressed_cameras(tmp_path):
    """/clock is the recording's clock (not the log time), compressed cameras are decoded
    as the node decodes them, a camera that stops makes its frames stale, and the chunks
    are compared with the measured joints (recomputed here from what was written)."""
    pytest.importorskip('cv2')
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    from oxygen_ros.robot.images import encode

    store = get_typestore(Stores.ROS2_JAZZY)
    T = store.types
    joints = [f'fr3_joint{i}' for i in range(1, 8)] + ['gripper']

    def header(t):
        return T['std_msgs/msg/Header'](stamp=T['builtin_interfaces/msg/Time'](
            sec=int(t), nanosec=int(round((t - int(t)) * 1e9))), frame_id='')

    rng = np.random.default_rng(0)
    samples = []  # (sim time, positions)
    bag = tmp_path / 'sim_time'
    with Writer(bag, version=9, storage_plugin=StoragePlugin.SQLITE3) as w:
        conn = {t: w.add_connection(t, ty, typestore=store) for t, ty in (
            ('/clock', 'rosgraph_msgs/msg/Clock'),
            ('/exterior_1/image_raw/compressed', 'sensor_msgs/msg/CompressedImage'),
            ('/wrist/image_raw/compressed', 'sensor_msgs/msg/CompressedImage'),
            ('/joint_states', 'sensor_msgs/msg/JointState'))}

        def put(topic, msg, log_s):
            w.write(conn[topic], int(log_s * 1e9), store.serialize_cdr(msg, conn[topic].msgtype))

        for n in range(300):  # 10 ms steps of simulated time from 10 s; logged a day later
            t = 10.0 + n * 0.01
            log = 86400.0 + 2 * n * 0.01  # the simulation runs at half speed
            put('/clock', T['rosgraph_msgs/msg/Clock'](clock=header(t).stamp), log)
            # About sim.yaml's initial pose, inside the FR3's limits (outside: glitches).
            q = np.array([0.0, -0.6, 0.0, -2.4, 0.0, 1.9, 0.0, 0.5]) + 0.1 * np.sin(
                t + np.arange(8))
            samples.append((t, q))
            put('/joint_states', T['sensor_msgs/msg/JointState'](
                header=header(t), name=joints, position=q, velocity=np.zeros(0),
                effort=np.zeros(0)), log + 0.001)
            if n % 5 == 0 and not 100 <= n < 200:  # 20 Hz, none from 11 s to 12 s
                for topic in ('/exterior_1/image_raw/compressed', '/wrist/image_raw/compressed'):
                    fmt, data = encode(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8),
                                       'rgb8', 'png', 3)
                    put(topic, T['sensor_msgs/msg/CompressedImage'](
                        header=header(t), format=fmt,
                        data=np.frombuffer(data, np.uint8)), log + 0.002)
    cfg = replay.robot_config(replay.node_values(replay.params_files('sim', []), [
        'model:=tiny', 'prompt_format:=subtask', 'frame_noise:=true', 'compile:=false',
        'camera_transports:=[compressed, compressed]']))
    run = replay.replay_bag(bag, cfg, replay.make_engine(cfg, threads=1), replay.Plan.of(cfg),
                            'auto', 10.0, 'auto', progress=False, say=lambda m: None)
    run.bag.close()
    assert run.clock == '/clock' and run.mode == 'rate' and run.against == 'joints'
    assert run.problems == {}, run.problems  # every image decoded
    stamps = [p.stamp for p in run.frames]
    assert len(stamps) > 10 and all(10.0 < s < 13.0 for s in stamps)
    stale = [t for t, w in run.skips if 'exterior_image_1_left stale' in w]
    assert stale and 11.4 < min(stale) and max(stale) < 12.05, stale
    assert [s for s in stamps if 11.5 < s < 12.0] == []
    # Against the joints as written: linear between the samples.
    rep = replay.report([run], cfg, 0.5, 1.0, [])
    t = np.array([s for s, _ in samples])
    q = np.stack([x for _, x in samples])
    err = []
    for p in run.frames:
        when = p.stamp + cfg.action_period * np.arange(len(p.positions))
        want = np.stack([np.interp(when, t, q[:, j], right=np.nan) for j in range(8)], -1)
        err.append(np.abs(p.positions - want))
    err = np.stack(err)
    assert rep['mae'] == pytest.approx(np.nanmean(err), rel=1e-9)
    for j, name in enumerate(rep['joints']):
        assert rep['per_joint'][name]['mae'] == pytest.approx(np.nanmean(err[..., j]), rel=1e-9)


def test_a_joint_that_did_not_move_has_no_lead():
    ref = replay.Reference.from_series([[(0.0, 0.3), (10.0, 0.3)]])
    frames = [replay.Predicted(s, s, np.full((5, 1), 0.3)) for s in np.arange(1.0, 8.0, 0.1)]
    c = replay.compare(frames, ref, 0.02, ['j'], max_shift=0.5)
    assert c['joints']['j']['lead_s'] == 0.0 and c['joints']['j']['mae'] == 0.0
