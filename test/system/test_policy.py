"""The shipped checkpoint (models/aloha_sim_transfer_cube; its README is the model card)
through ROS: oxygen-eval's ROS path (oxygen_node, compiled as by default, and the MuJoCo
ALOHA node) transfers the cube, a floor on its success set from the model card's measured
rates with margin, which fails whenever anything in the chain from checkpoint to joints
breaks the robot's behaviour; a robot file with two joints swapped brings it to nothing; a
checkpoint named relative to where eval runs narrates and answers. test_policy_direct.py runs
it without ROS.

Needs the simulator (requirements-mujoco.txt: tools/ws.sh sim-setup; make test installs it
where skips fail the run)."""
import os

import pytest

os.environ.setdefault('MUJOCO_GL', 'egl')
pytest.importorskip('gym_aloha', reason='the simulator is not installed (tools/ws.sh sim-setup)')

from support.policy import POLICY, evaluate  # noqa: E402


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
# measured rates with margin.
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
