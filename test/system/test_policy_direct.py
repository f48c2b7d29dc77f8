"""The shipped checkpoint (models/aloha_sim_transfer_cube: pi0.5 trained by oxygen-train on
oxygen-demos' scripted episodes; its README is the model card) without ROS: it loads like any
checkpoint and predicts what the script does on an episode it was never trained on. The
chain from the checkpoint's files to the robot's joint targets (norm stats, tokenizer, the
ALOHA profile's joint flips, deltas and gripper map, the image resize) has to be whole for the
chunks to follow the script; a policy blind to the scene does far worse. In closed loop on
the direct path it transfers the cube: a floor on its success, set from the model card's
measured rates with margin. test_policy.py runs it through ROS.

Needs the simulator (requirements-mujoco.txt: tools/ws.sh sim-setup; make test installs it
where skips fail the run)."""
import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault('MUJOCO_GL', 'egl')
pytest.importorskip('gym_aloha', reason='the simulator is not installed (tools/ws.sh sim-setup)')

from support.policy import POLICY, evaluate  # noqa: E402

OPEN_LOOP_SHARE = 0.25  # of a blind policy's error


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


# A fixed held-out seed range (training used 1000 and up); on seeds 0..9 the policy
# transferred the cube (reward 4) on 8 (all but 4 and 8; the model card): the direct path is
# deterministic (seeded noise), the floor leaves room for another CPU's rounding.
DIRECT_SEEDS, DIRECT_SUCCESSES = 10, 5


def test_it_transfers_the_cube_directly(tmp_path):
    report, _ = evaluate(tmp_path, '--direct', '--seed', '0', '--episodes', str(DIRECT_SEEDS))
    assert report['successes'] >= DIRECT_SUCCESSES, report['successes']
