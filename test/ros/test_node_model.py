"""oxygen_node and what the model states: a LeRobot policy directory's cameras, dims and
horizon against the robot file, and real-time chunking seen on ~/predicted_trajectory."""
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file, save_file

rclpy = pytest.importorskip('rclpy')
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from support.lerobot import CHUNK, STATE_DIM, write_policy  # noqa: E402
from support.node import PARAMS, Robot, node_process, run_node  # noqa: E402
from support.process import node_env, wait_for, write_params  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

import oxygen_ros.msg  # noqa: E402, F401 (built by colcon; must import)
from oxygen_ros.model import load_config  # noqa: E402
from oxygen_ros.model.tokenizer import Tokenizer  # noqa: E402

DIMS = 'tiny_builtin_vocab.yaml'


# A robot that fits the policy of test_lerobot_policy: cameras named as its features, a
# 4-d state read from four joints, 4 of its 5 action dims commanded.
def identity(n, slots='[front, wrist]'):
    joints = ', '.join(f'fr3_joint{i}' for i in range(1, n + 1))
    return ['-p', 'robot:=identity', '-p', 'profile_options:=""',
            '-p', f'camera_slots:={slots}', '-p', f'joints:=[{joints}]',
            '-p', 'output_groups:=[arm]', '-p', f'outputs.arm.indices:={list(range(n))}',
            '-p', f'outputs.arm.joints:=[{joints}]']


@pytest.fixture(scope='module')
def policy(weights, tmp_path_factory):
    """The policy with its embedding cut to the built-in tokenizer's rows, so that the node
    takes it without a tokenizer of its own (the prompt ids and the tokens sampled lie below
    them either way), and the tiny dims of that vocabulary beside it (DIMS)."""
    n = Tokenizer.default().vocab_size
    tmp = tmp_path_factory.mktemp('policy')
    t = load_file(str(weights))
    for key in [k for k in t if k.endswith(('embed_tokens.weight', 'lm_head.weight'))]:
        t[key] = t[key][:n].clone()
    save_file(t, str(tmp / 'weights.safetensors'))
    (tmp / DIMS).write_text(yaml.safe_dump(load_config('tiny', vocab=n).to_dict()))
    return write_policy(tmp / 'pi05_policy', tmp / 'weights.safetensors')


def checkpoint_args(policy):
    # Eager: the policy's dims are not the tiny model's, whose programs are built.
    return ['-p', f'checkpoint:={policy}', '-p', f'model:={policy.parent / DIMS}',
            '-p', 'compile:=false']


def test_node_takes_the_checkpoints_cameras_dims_and_horizon(policy, tmp_path, domain):
    params = write_params(tmp_path / 'params.yaml', PARAMS)
    log = open(tmp_path / 'node.log', 'w')
    proc = subprocess.Popen(
        [sys.executable, '-m', 'oxygen_ros.ros.node', '--ros-args', '--params-file', params,
         *checkpoint_args(policy), *identity(STATE_DIM)], stdout=log, stderr=subprocess.STDOUT,
        env=node_env(domain))
    try:
        assert wait_for(lambda: 'configured:' in (tmp_path / 'node.log').read_text()
                        or proc.poll() is not None, 90)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        log.close()
    text = (tmp_path / 'node.log').read_text()
    assert code == 0, text
    line = re.search(r'configured: .*', text).group(0)
    assert f'lerobot checkpoint {policy}' in line
    assert f'chunks of {CHUNK} x 5 in 7 steps' in line  # chunk_size, action dim, steps
    assert "{'front': 'front', 'wrist': 'wrist'}" in line
    assert 'plays 3 of its 6 actions per chunk' in text  # n_action_steps


@pytest.mark.parametrize('extra, message', [
    # The model config's slot names are not the policy's cameras.
    (identity(STATE_DIM, '[base_0_rgb, left_wrist_0_rgb]'),
     r"camera_slots \['base_0_rgb', 'left_wrist_0_rgb'\] are not slots of .*: "
     r"\['front', 'wrist'\]"),
    # DROID's 8-d actions from a policy with 5.
    (['-p', 'camera_slots:=[front, wrist]'], 'droid profile needs 8-d actions but .* has 5'),
    # A 3-d state for a policy trained on 4 (LeRobot states must match exactly).
    (identity(3), f'3-d state but .* takes exactly {STATE_DIM}'),
])
def test_a_robot_file_that_disagrees_with_the_checkpoint_is_a_start_error(
        policy, tmp_path, domain, extra, message):
    out = run_node(tmp_path, domain, [*checkpoint_args(policy), *extra])
    assert out.returncode == 1, out.stderr
    assert re.search(message, out.stderr), out.stderr
    assert 'Traceback' not in out.stderr + out.stdout


class Watcher(Robot):
    def __init__(self, node):
        super().__init__(node)
        self.leave_out = set()
        self.predicted = []
        reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
        node.create_subscription(JointTrajectory, '/oxygen_node/predicted_trajectory',
                                 self.predicted.append, reliable)


def chunk_of(msg):
    stamp = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
    return stamp, np.array([p.positions for p in msg.points])


def test_real_time_chunking_continues_the_chunk_being_played(tmp_path, domain):
    # Identity profile: the published targets are the engine's actions, so each new chunk's
    # first rtc_delay actions must be, exactly, the actions of the chunk it replaced at
    # the same times.
    delay, period = 1, 0.1
    params = dict(PARAMS, robot='identity', profile_options='', rtc=True, rtc_delay=delay,
                  publish_predicted=True, narration_every_n_frames=0)
    with node_process(tmp_path, params, domain, 'rtc_watcher', Watcher,
                      '-r', 'front/image:=/remapped/front') as (proc, w):
        assert wait_for(lambda: len(w.predicted) >= 12 or proc.poll() is not None, 90), w.log()
        time.sleep(0.2)
        chunks = [chunk_of(m) for m in list(w.predicted)]
    pairs = 0
    for (t0, old), (t1, new) in zip(chunks, chunks[1:]):
        start = round((t1 - t0) / period)
        if start + delay > len(old):
            continue  # the previous chunk had run out: nothing to join
        np.testing.assert_allclose(new[:delay], old[start:start + delay], atol=1e-5,
                                   err_msg=f'chunk at {t1:.3f} after {t0:.3f}')
        pairs += 1
    assert pairs >= 8, (pairs, len(chunks))
