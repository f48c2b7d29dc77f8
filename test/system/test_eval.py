"""oxygen-eval end to end: two short episodes through the ROS path (oxygen_node +
oxygen_mujoco_aloha on simulated time) and two through the direct loop, each writing its
JSON report, a reward plot and a video of the top camera per episode.

Needs the simulator (requirements-mujoco.txt: tools/ws.sh sim-setup; make test installs it
where skips fail the run)."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.paths import ROOT  # noqa: E402

os.environ.setdefault('MUJOCO_GL', 'egl')
pytest.importorskip('gym_aloha', reason='the simulator is not installed (tools/ws.sh sim-setup)')
STEPS = 25  # 0.5 s of simulated time per episode




def run_eval(tmp_path, *args, installed=False):
    """oxygen-eval on two short episodes. installed: the installed executable, run from the
    repository root as the README's lines are (`ros2 run oxygen_ros oxygen_eval` after
    `source install/setup.bash`), where `python -m` children would import the sources."""
    out = tmp_path / 'out'
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    if installed:
        from ament_index_python.packages import get_package_prefix

        cmd = [sys.executable, str(Path(get_package_prefix('oxygen_ros')) / 'lib' / 'oxygen_ros'
                                   / 'oxygen_eval')]
        assert (ROOT / 'oxygen_ros' / '__init__.py').is_file()  # the sources are right here
    else:
        cmd = [sys.executable, '-m', 'oxygen_ros.sim.eval']
    # Eager: what is checked is eval's wiring; test_policy runs the shipped policy compiled.
    r = subprocess.run([*cmd, '--episodes', '2', '--no-compile',
                        '--seed', '10', '--steps', str(STEPS), '--model', 'small',
                        '--width', '160', '--height', '120', '--out', str(out), *args],
                       capture_output=True, text=True, env=env, timeout=600,
                       cwd=ROOT if installed else None)
    logs = ''.join(f'\n== {p.name}\n{p.read_text()[-2000:]}' for p in out.glob('*.log'))
    assert r.returncode == 0, r.stdout + r.stderr + logs
    return out, r.stdout


def check(out, mode, task):
    import imageio.v2 as imageio

    report = json.loads((out / f'{mode}_report.json').read_text())
    assert report['mode'] == mode and report['task'] == task
    assert report['episodes'] == 2 and len(report['per_episode']) == 2
    seeds = [e['seed'] for e in report['per_episode']]
    assert seeds == [10, 11]
    for e in report['per_episode']:
        assert len(e['rewards']) == STEPS == e['steps']
        assert all(0 <= r <= 4 for r in e['rewards'])
        assert e['max_reward'] == max(e['rewards'])
        assert e['success'] == (e['max_reward'] >= 4)
        assert e['wall_s'] > 0
        frames = imageio.mimread(e['video'])
        assert len(frames) >= 3 and frames[0].shape == (120, 160, 3), (len(frames), e)
        assert np.asarray(frames[0]).std() > 5  # a picture, not a blank
    successes = sum(e['success'] for e in report['per_episode'])
    assert report['success_rate'] == successes / 2
    assert report['avg_max_reward'] == pytest.approx(
        np.mean([e['max_reward'] for e in report['per_episode']]))
    assert (out / f'{mode}_rewards.png').stat().st_size > 1000
    return report


def test_eval_through_ros(tmp_path):
    domain = str(random.randint(126, 140))
    out, stdout = run_eval(tmp_path, '--env', 'aloha-insertion', '--domain', domain,
                           installed=True)
    report = check(out, 'ros', 'insertion')
    assert 'transfers' not in report  # no cube to hand over in the insertion
    # The node ran each episode: its log says it was activated twice.
    assert (out / 'node.log').read_text().count('active: commanding') == 2
    assert 'trajectory rejected' not in (out / 'robot.log').read_text()
    print(stdout, {k: v for k, v in report.items() if k != 'per_episode'})


def test_eval_direct(tmp_path):
    out, stdout = run_eval(tmp_path, '--env', 'aloha-transfer-cube', '--direct')
    report = check(out, 'direct', 'transfer_cube')
    # Random weights transfer nothing: the cube is still on the table at the end.
    for e in report['per_episode']:
        assert e['transferred'] is False
        assert e['final_facts']['cube_touched_elsewhere'] and not e['final_facts']['cube_lifted']
    assert report['transfers'] == 0 and report['transfer_95'][0] == 0.0
    lo, hi = report['success_95']
    assert lo <= report['success_rate'] <= hi
    assert not (out / 'node.log').exists()


@pytest.mark.parametrize('delay', [0, 2])
def test_the_direct_path_plays_chunks_as_the_node_times_them(delay):
    # Chunk c's action i is 10 * c + i; play 4 a chunk. Without a delay: actions 0..3 of each
    # chunk, observed as the last one ends. With 2 steps of delay, as the node plays a chunk
    # from its observation's stamp: hold for the first chunk's 2 steps, play it from action
    # 2; the next is observed once action 4 is out and arrives 2 steps later, the old chunk
    # playing on (4, 5), and starts at its own action 2.
    from oxygen_ros.sim.eval import Plan

    plan, played, observed, c = Plan(4, delay), [], [], 0
    for step in range(14):
        if plan.due():
            observed.append(step)
            plan.got(np.array([[10.0 * c + i] for i in range(6)]))
            c += 1
        a = plan.next()
        played.append(None if a is None else int(a[0]))
    if delay == 0:
        assert observed == [0, 4, 8, 12]
        assert played == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 30, 31]
    else:
        assert observed == [0, 4, 8, 12]
        assert played == [None, None, 2, 3, 4, 5, 12, 13, 14, 15, 22, 23, 24, 25]
    with pytest.raises(ValueError, match='delay-steps'):
        Plan(4, 4)


@pytest.mark.parametrize('k, n, lo, hi', [(5, 10, 0.2366, 0.7634), (0, 50, 0.0, 0.0714),
                                          (50, 50, 0.9286, 1.0)])
def test_wilson_intervals_are_the_textbooks(k, n, lo, hi):
    # Wilson's score interval at z = 1.96: 0.2366..0.7634 for 5 of 10, and 0..0.0714 for 0 of
    # 50 (where the normal approximation's interval is 0..0), as statistics texts give them;
    # n of n mirrors 0 of n.
    from oxygen_ros.sim.eval import wilson

    assert wilson(k, n) == pytest.approx((lo, hi), abs=1e-4)
    (a, b), (c, d) = wilson(n - k, n), wilson(k, n)
    assert (a, b) == pytest.approx((1 - d, 1 - c), abs=1e-12)


def test_narrations_and_answers_are_judged_by_the_scene_at_their_frame():
    from oxygen_ros.sim.eval import facts_at, judge_answers, judge_narrations

    def facts(left, right, up):
        return {'cube_in_left': left, 'cube_in_right': right, 'cube_lifted': up,
                'cube_touched_elsewhere': right}

    # Steps of 0.02 s: on the table, in the right gripper in the air, in the left alone.
    scene = [(0.02, facts(False, False, False)), (0.04, facts(False, True, True)),
             (0.06, facts(True, False, True))]
    assert facts_at(scene, 0.01) is None  # before the first step: nothing to judge by
    assert facts_at(scene, 0.02) == scene[0][1] and facts_at(scene, 0.05) == scene[1][1]
    assert facts_at(scene, 0.0400000001) == scene[1][1]  # a stamp rounded to nanoseconds
    got = judge_narrations([(0.02, 'reaching for the cube'), (0.02, 'holding the cube'),
                            (0.045, ' Lifting the cube\n'), (0.06, 'releasing the cube'),
                            (0.06, 'releasing the cube.'), (0.001, 'anything')], scene)
    assert got['narrations'] == 5 and got['narrations_right'] == 3
    assert [j['right'] for j in got['narrations_judged']] == [True, False, True, True, False]
    # A narration ended early (dropped for a newer request: cut short) is counted, not judged.
    got = judge_narrations([(0.02, 'reaching for the cube', 'done'),
                            (0.02, 'reaching for', 'dropped'),
                            (0.045, 'lifting the cube', 'budget'),
                            (0.06, 'releasing', 'cancelled')], scene)
    assert got['narrations'] == 2 and got['narrations_right'] == 2
    assert got['narrations_ended_early'] == 2
    got = judge_answers([(0.02, 'cube_lifted', 'no'), (0.04, 'cube_in_right', 'yes'),
                         (0.04, 'cube_in_left', 'yes'), (0.06, 'cube_in_left', 'yes '),
                         (0.06, 'cube_lifted', 'maybe')], scene)
    assert got['answers'] == 5 and got['answers_right'] == 3
    assert [j['truth'] for j in got['answers_judged']] == ['no', 'yes', 'no', 'yes', 'yes']


def test_the_summary_counts_narrations_answers_and_the_nodes_figures():
    from oxygen_ros.sim.eval import episode_result, summary

    eps = []
    for seed, (n, k, lat) in enumerate([(10, 9, 40.0), (6, 3, 60.0), (0, 0, 500.0)]):
        e = episode_result(seed, [0.0, 2.0, 4.0], 1.0, 0, None)
        e.update(narrations=n, narrations_right=k, answers=2, answers_right=1,
                 narrations_ended_early=seed, node={'action_latency_ms_p50': lat})
        eps.append(e)
    s = summary(eps)
    assert (s['narrations'], s['narrations_right']) == (16, 12)
    assert s['narrations_ended_early'] == 0 + 1 + 2
    assert s['narrations_accuracy'] == 0.75 and s['answers_accuracy'] == 0.5
    assert s['narrations_95'][0] < 0.75 < s['narrations_95'][1]
    assert s['node'] == {'action_latency_ms_p50': 60.0}  # the median episode's


def test_the_ros_path_asks_one_question_at_a_time_in_turn():
    from oxygen_ros.sim.demos import QUESTIONS
    from oxygen_ros.sim.eval import Asker

    a = Asker(every=25)
    assert a.due(episode=1, step=0, done=False) is None  # no episode started
    a.start(1)
    assert a.due(2, 0, False) is None  # another episode's step
    first = a.due(1, 0, False)
    assert first == sorted(QUESTIONS)[0]
    assert a.due(1, 25, False) is None  # the first is still out
    a.answered(0.0, first, 'no')
    assert a.due(1, 30, False) is None and a.due(1, 50, True) is None  # not due; ended
    second = a.due(1, 75, False)
    assert second == sorted(QUESTIONS)[1]
    # No answer within a second of simulated time (50 steps): unanswered, the next goes out.
    assert a.due(1, 100, False) is None and a.due(1, 125, False) is None
    assert a.due(1, 150, False) == sorted(QUESTIONS)[2]
    a.unanswered()  # refused
    assert a.end() == ([(0.0, first, 'no')], 2)
    assert a.due(1, 175, False) is None  # ended: no more questions


def test_the_direct_path_records_its_episodes_in_the_demos_layout(tmp_path):
    """--record: each direct episode in oxygen-demos' layout (source: policy), which
    oxygen-demos --check passes (its phases those the scene's facts give); its /action
    replayed in a fresh scene of the same seed gives its observations (the actions are stored
    as float32, the loop played them as float64: within 1e-4), and its first picture is the
    scene's at the reset."""
    from oxygen_ros.sim import demos
    from oxygen_ros.sim.aloha_sim import AlohaSim

    h5py = pytest.importorskip('h5py')
    rec = tmp_path / 'rec'
    out, _ = run_eval(tmp_path, '--env', 'aloha-transfer-cube', '--direct', '--record',
                      str(rec), '--no-video')
    report = json.loads((out / 'direct_report.json').read_text())
    files = sorted(rec.glob('episode_*.hdf5'))
    assert [f.name for f in files] == ['episode_0.hdf5', 'episode_1.hdf5']
    sim = AlohaSim('transfer_cube', 160, 120)
    for path, e in zip(files, report['per_episode'], strict=True):
        assert demos.check(path) == [], path
        with h5py.File(path, 'r') as f:
            assert f.attrs['source'] == 'policy' and f.attrs['seed'] == e['seed']
            assert f.attrs['max_reward'] == e['max_reward']
            assert f['observations/images/top'].shape == (STEPS, 120, 160, 3)
            sim.reset(e['seed'])
            np.testing.assert_array_equal(f['observations/images/top'][0],
                                          sim.render('cam_high'))
            qpos = []
            for a in f['action'][:]:
                qpos.append(demos.observe(sim)[0])
                sim.step(a.astype(float))
            np.testing.assert_allclose(np.array(qpos), f['observations/qpos'][:], atol=1e-4)
    r = subprocess.run([sys.executable, '-m', 'oxygen_ros.sim.eval', '--env',
                        'aloha-transfer-cube', '--record', str(rec)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and '--record records the direct path' in r.stderr
