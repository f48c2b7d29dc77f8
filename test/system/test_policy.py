"""The shipped checkpoint (models/aloha_sim_transfer_cube: pi0.5 trained by oxygen-train on
oxygen-demos' scripted episodes; its README is the model card) loads like any checkpoint and
predicts what the script does on an episode it was never trained on. The chain from the
checkpoint's files to the robot's joint targets (norm stats, tokenizer, the ALOHA profile's
joint flips, deltas and gripper map, the image resize) has to be whole for the chunks to
follow the script; a policy blind to the scene does far worse. In closed loop it transfers
the cube: a floor on its success, set from the model card's measured rates with margin,
directly and through the ROS path, fails whenever anything in the chain breaks the robot's
behaviour; a robot file with two joints swapped brings it to nothing.

Needs the simulator (requirements-mujoco.txt: tools/ws.sh sim-setup; make test installs it
where skips fail the run)."""
import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault('MUJOCO_GL', 'egl')
pytest.importorskip('gym_aloha', reason='the simulator is not installed (tools/ws.sh sim-setup)')

from oxygen_ros.robot.share import shipped_policy  # noqa: E402

POLICY = shipped_policy()
OPEN_LOOP_SHARE = 0.25  # of a blind policy's error


def evaluate(tmp_path, *args, checkpoint=POLICY, cwd=None):
    out = tmp_path / 'out'
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    r = subprocess.run([sys.executable, '-m', 'oxygen_ros.sim.eval', '--env', 'aloha-transfer-cube',
                        '--checkpoint', str(checkpoint), '--no-video', '--out', str(out), *args],
                       capture_output=True, text=True, env=env, timeout=900, cwd=cwd)
    logs = ''.join(f'\n== {p.name}\n{p.read_text()[-3000:]}' for p in out.glob('*.log'))
    assert r.returncode == 0, r.stdout + r.stderr + logs
    [path] = out.glob('*_report.json')  # open_loop_, direct_ or ros_report.json
    report = json.loads(path.read_text())
    print(r.stdout)
    return report, out


def test_the_policy_is_shipped_as_a_checkpoint_with_its_tokenizer():
    meta = json.loads((POLICY / 'config.json').read_text())
    assert (POLICY / 'model.safetensors').stat().st_size <= 16 * 2**20
    assert (POLICY / 'tokenizer.model').is_file()
    assert (POLICY / 'assets' / meta['training']['recipe']['asset_id']
            / 'norm_stats.json').is_file()
    assert (POLICY / 'README.md').is_file()  # the model card


def test_open_loop_chunks_follow_the_script_on_a_held_out_episode(tmp_path):
    """One new scripted episode (a seed training never used), the policy's chunk at every
    50th step against the script's own targets: errors well under those of a policy that
    ignores the scene (the episode's mean target for every step)."""
    import h5py
    import numpy as np

    from oxygen_ros.sim.train import robot_targets

    demos = tmp_path / 'demos'
    env = dict(os.environ, OMP_NUM_THREADS='1')
    r = subprocess.run([sys.executable, '-m', 'oxygen_ros.sim.demos', '--episodes', '1',
                        '--seed', '5000', '--out', str(demos)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    report, out = evaluate(tmp_path, '--open-loop', str(demos), '--open-loop-every', '50')
    assert report['chunks'] == 8 and report['horizon'] == 50  # steps 0, 50, ..., 350
    with h5py.File(next(demos.glob('episode_*.hdf5'))) as f:
        targets = robot_targets(f['action'][()])
    blind = float(np.abs(targets - targets.mean(0)).mean())
    assert report['mean'] < OPEN_LOOP_SHARE * blind, (report['mean'], blind)


def test_a_relative_checkpoint_narrates_and_answers_through_ros(tmp_path):
    """oxygen-eval's ROS path given the checkpoint relative to where it is run (the node
    runs elsewhere, in the report directory): the node loads it, and narrations and ~/ask
    answers come back judged."""
    from support.process import new_domain

    here = POLICY.parent.parent
    report, out = evaluate(tmp_path, '--seed', '0', '--episodes', '1', '--steps', '150',
                           '--domain', new_domain(), '--narrate', '1', '--ask-every', '0.5',
                           checkpoint=POLICY.relative_to(here), cwd=here)
    assert report['narrations'] > 0 and report['answers'] > 0, report
    assert str(POLICY) in (out / 'eval_params.yaml').read_text()


# Fixed held-out seeds (training used 1000 and up) and floors set from the model card's
# measured rates with margin (see each test).
# Direct on seeds 0..9 the policy transferred the cube (reward 4) on 8 (all but 4 and 8; the
# model card): the direct path is deterministic (seeded noise), the floor leaves room for
# another CPU's rounding.
DIRECT_SEEDS, DIRECT_SUCCESSES = 10, 5
# Through ROS (replan_after 45; not deterministic: the frames fall where the node's timing
# puts them) about half of the seeds succeed, and which ones moves from run to run: over eight
# 50-seed runs of docs/simulation.md's shipped-weights sets, seeds 0..9 succeeded in 7, 8, 0,
# 4, 0, 7, 1, 5, 2 and 3 runs of the eight, yet one run of this test here (under ctest, the
# same machine) had none of seeds 0..4 succeed, each lifting the cube and never handing it
# over. So the floor is at least one success in ten seeds and, since lifting is what the
# policy nearly always does (48 of 50 lifted, paced, without narration), a lift on at least half: a
# broken chain (a swapped joint, an inverted gripper) does neither. On a CI machine 1.5 times
# slower than ours, unpaced, chunks played 100-120 ms after their frame (60 ms here) and
# seeds 0..2 never handed over. The floor is about the chain from checkpoint to joints, not
# the CPU's speed: the simulator runs at half real time (ROS_PACE), so a slower machine gets
# about the same latency in simulated time.
ROS_SEED, ROS_EPISODES, ROS_SUCCESSES, ROS_LIFTS, ROS_PACE = 0, 10, 1, 5, 0.5
SWAPPED_EPISODES = 5
# The ALOHA robot file with the right arm's shoulder and elbow swapped in its joint list: each
# reads the other's angle, and the delta actions are added to the wrong one.
SWAPPED = """oxygen_node:
  ros__parameters:
    joints: [left/waist, left/shoulder, left/elbow, left/forearm_roll, left/wrist_angle,
             left/wrist_rotate, left/left_finger,
             right/waist, right/elbow, right/shoulder, right/forearm_roll, right/wrist_angle,
             right/wrist_rotate, right/left_finger]
"""


def test_it_transfers_the_cube_directly(tmp_path):
    report, _ = evaluate(tmp_path, '--direct', '--seed', '0', '--episodes', str(DIRECT_SEEDS))
    assert report['successes'] >= DIRECT_SUCCESSES, report['successes']


def ros_run(tmp_path, *args, episodes=ROS_EPISODES):
    from support.process import new_domain

    report, _ = evaluate(tmp_path, '--seed', str(ROS_SEED), '--episodes', str(episodes),
                         '--replan-after', '45', '--domain', new_domain(), *args)
    return report


def rewards(report):
    """Each episode's seed and largest reward."""
    return [(e['seed'], e['max_reward']) for e in report['per_episode']]


def test_it_transfers_the_cube_through_ros(tmp_path):
    report = ros_run(tmp_path, '--real-time-factor', str(ROS_PACE))
    assert report['successes'] >= ROS_SUCCESSES, rewards(report)
    assert report['lifts'] >= ROS_LIFTS, rewards(report)


def test_a_robot_file_with_two_joints_swapped_transfers_nothing(tmp_path):
    swapped = tmp_path / 'swapped.yaml'
    swapped.write_text(SWAPPED)
    report = ros_run(tmp_path, '--params-file', str(swapped), episodes=SWAPPED_EPISODES)
    assert report['successes'] == 0 and report['lifts'] == 0, rewards(report)
