"""oxygen_node's lifecycle, safe stop, input checks and live parameters, driven as a user
would: the lifecycle and parameter services over rclpy, a fake robot publishing cameras and
joint states, and every trajectory received on both output topics.

The tests run in order on one node process (configure, activate, the stop causes, ...).
"""
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy')
ament = pytest.importorskip('ament_index_python.packages')
from support.launch import tiny_sim_file  # noqa: E402
from support.node import (  # noqa: E402  # noqa: E402
    ARM,
    LIFECYCLE,
    PARAMS,
    User,
    after,
    assert_alive_and_commanding,
    is_hold,
    node_process,
    run_node,
)
from support.process import node_env, wait_for, write_params  # noqa: E402

import oxygen_ros.msg  # noqa: E402, F401 (built by colcon; must import)
from oxygen_ros.robot.stamps import seconds as seconds_of  # noqa: E402


@pytest.fixture(scope='module')
def user(domain, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('lifecycle')
    with node_process(tmp, LIFECYCLE, domain, 'user', User,
                      '-r', 'front/image:=/remapped/front') as (proc, u):
        u.proc = proc
        assert wait_for(lambda: 'unconfigured: waiting' in u.log() or proc.poll() is not None,
                        60), u.log()
        assert proc.poll() is None, u.log()
        yield u


def commanding(user, seconds=1.0):
    return user.rate(seconds) > 0


def test_unconfigured_and_inactive_publish_nothing(user):
    assert user.state() == 'unconfigured'
    assert not commanding(user)
    assert user.transition('configure')
    assert user.state() == 'inactive'
    assert re.search(r'configured: model tiny with RANDOM weights \(seed 0, no checkpoint\)',
                     user.log())
    assert not commanding(user), 'commands while inactive'


def test_active_commands_both_groups_and_the_predicted_chunk(user):
    assert user.transition('activate')
    assert user.state() == 'active'
    assert wait_for(lambda: len(user.traj) > 20 and len(user.grip) > 20, 30), user.log()[-3000:]
    resume(user)
    m = user.predicted[-1]
    assert m.joint_names == [f'arm/{j}' for j in ARM] + ['gripper/gripper']
    # The tiny model's 4 actions, 0.1 s apart from the frame stamp.
    assert [seconds_of(p.time_from_start) for p in m.points] == pytest.approx(
        [0.0, 0.1, 0.2, 0.3], abs=1e-6)
    assert m.header.stamp.sec > 0


def test_deactivate_holds_once_then_silence(user):
    t = time.monotonic()
    assert user.transition('deactivate')
    time.sleep(1.0)
    arm, grip = after(user.traj, t), after(user.grip, t)
    # Anything sent before the hold was in flight already; the hold comes last, once.
    sent, gsent = [m for _, m in user.traj], [m for _, m in user.grip]
    assert arm and is_hold(arm[-1], ARM, sent), arm[-1:]
    assert grip and is_hold(grip[-1], ['gripper'], gsent), grip[-1:]
    assert sum(is_hold(m, ARM, sent) for m in arm) == 1
    assert seconds_of(arm[-1].points[0].time_from_start) == pytest.approx(1 / 70, abs=1e-6)
    assert not commanding(user)
    assert re.search(r'holding: deactivated', user.log())


def wait_for_hold(user, t, pattern, timeout=5.0):
    assert wait_for(lambda: re.search(pattern, user.log()), timeout), user.log()[-3000:]
    def holds():
        sent = [m for _, m in user.traj]
        return sum(is_hold(m, ARM, sent) for m in after(user.traj, t))

    assert wait_for(holds, 2.0), 'no hold trajectory'
    time.sleep(0.5)
    assert holds() == 1
    assert not commanding(user, 0.5), 'commands after the hold'


def resume(user):
    assert_alive_and_commanding(user, LIFECYCLE)


def test_stale_camera_holds(user):
    assert user.transition('activate')
    resume(user)
    t = time.monotonic()
    user.paused.add('wrist')
    try:
        wait_for_hold(user, t, r'holding: inputs: wrist stale')
    finally:
        user.paused.clear()
    resume(user)


def test_future_stamps_are_rejected_not_played_late(user):
    t = time.monotonic()
    user.lag['wrist'] = -1.0  # stamped 1 s ahead
    try:
        wait_for_hold(user, t, r'camera wrist: stamp \d+ ms in the future \(limit 50 ms\); '
                      'message dropped')
        assert re.search(r'holding: inputs: wrist stale', user.log())
    finally:
        user.lag.clear()
    resume(user)


def test_joint_missing_from_its_topic_holds(user):
    t = time.monotonic()
    user.leave_out = {'fr3_joint2', 'fr3_joint3'}
    try:
        wait_for_hold(user, t, r'joint_states: joints fr3_joint2, fr3_joint3 missing from its '
                      r'messages for \d+ ms \(limit 250 ms\): stale')
    finally:
        user.leave_out = set()
    resume(user)


def test_model_failure_holds(user):
    t = time.monotonic()
    user.huge_gripper = True
    try:
        # The engine's own words for the infinite state follow "model failure: ".
        wait_for_hold(user, t, r'holding: model failure: ')
        assert 'frame failed: ' in user.log()
    finally:
        user.huge_gripper = False
    resume(user)


def test_parameters_set_live_or_refused_with_a_reason(user):
    ok = user.set_param('temperature', 0.5)
    assert ok.successful, ok.reason
    for name, value, reason in [
        ('control_rate_hz', 50.0, 'read-only'),
        ('device', 'cuda', 'read-only'),
        ('temperature', -1.0, 'temperature out of range Min: 0.0'),  # rclpy's range check
        ('temperature', 'hot', 'temperature must be float'),
        ('max_new_tokens', 100, 'sized for 8'),
    ]:
        r = user.set_param(name, value)
        assert not r.successful and reason in r.reason, (name, r.reason)
    # Live values act at once: the horizon bounds every point, play_steps the chunk. At the
    # default 0.5 s the tiny model's actions reach up to 0.3 s ahead (4 actions 0.1 s apart
    # from the frame stamp), so a 0.15 s horizon cuts most commands.
    resume(user)
    before = [max(seconds_of(p.time_from_start) for p in m.points)
              for m in after(user.traj, time.monotonic() - 1.0)]
    assert before and max(before) > 0.2, before
    assert user.set_param('max_command_horizon', 0.15).successful
    t = time.monotonic()
    resume(user)  # the cut chunk still commands at the control rate
    sent = after(user.traj, t)[5:]
    assert len(sent) >= 50, len(sent)
    furthest = [max(seconds_of(p.time_from_start) for p in m.points) for m in sent]
    assert max(furthest) <= 0.15, max(furthest)
    # Points 0.1 s apart: at most two of them lie within 0.15 s (one, when the chunks come
    # less than 50 ms after their frame).
    assert max(len(m.points) for m in sent) <= 2
    assert user.set_param('max_command_horizon', 0.5).successful
    # 3 of the 4 actions: action 3 is never sent (action 0 is the frame's own time, so
    # actions 1 and 2 are the most ever ahead). With 2, action 1 alone would often be past
    # already when its chunk came, and the robot would mostly hold.
    assert user.set_param('play_steps', 3).successful
    t = time.monotonic()
    resume(user)
    sent = after(user.traj, t)[5:]
    assert len(sent) >= 50, len(sent)
    assert max(len(m.points) for m in sent) <= 2
    assert max(seconds_of(p.time_from_start) for m in sent for p in m.points) <= 0.2 + 1e-9
    assert user.set_param('play_steps', 0).successful
    # replan_after: the next frame once 3 actions (0.3 s) of the chunk are out at the latest,
    # while the robot plays on. The tiny model's 4-action chunk runs out at 0.3 s too, so the
    # frame starts earlier, by the node's lead (replan_lead_ms: its frame-to-chunk latency
    # and a control period), and its chunk comes before the robot runs dry (at 0.3 s on the
    # dot, every chunk ran out and the robot held between chunks). Without it a frame starts
    # whenever new inputs come (about every 0.2 s: the tiny model on this CPU).
    def frame_gaps(seconds=2.5):
        n = len(user.predicted)
        time.sleep(seconds)
        return np.diff([seconds_of(m.header.stamp) for m in user.predicted[n:]])
    gaps = frame_gaps()
    assert len(gaps) >= 5 and np.median(gaps) < 0.25, gaps
    assert user.set_param('replan_after', 3).successful
    time.sleep(0.5)
    holds = int(user.fresh_diag()['holds'])
    t = time.monotonic()
    gaps = frame_gaps()
    d = user.fresh_diag()
    lead = float(d['replan_lead_ms']) / 1e3
    # A frame is stamped with its newest input, which came up to a camera period (1/30 s)
    # before the frame could start; the lead moves with each frame's latency (seen: 0.267 s
    # apart with a lead of 32 ms, 0.3 s before it).
    assert len(gaps) >= 3 and 0.0 < lead < 0.25, (gaps, d)
    assert np.median(gaps) == pytest.approx(0.3 - lead - 1 / 60, abs=1 / 60 + 0.02), (gaps, d)
    # Every chunk came in time (one late one is a hiccup of this machine, not the rule); at
    # 0.3 s the node held the robot 9 times meanwhile.
    assert int(d['holds']) - holds <= 1, d
    assert len(after(user.traj, t)) >= 50
    assert user.set_param('replan_after', 0).successful
    resume(user)


def test_sigint_twice_holds_and_exits_cleanly(user):
    resume(user)
    t = time.monotonic()
    # Again and again until it exits, as an impatient user (or `timeout` signalling the
    # process group under ros2 launch): later ones land while the first is being handled.
    end = time.monotonic() + 20
    while user.proc.poll() is None and time.monotonic() < end:
        try:
            user.proc.send_signal(signal.SIGINT)
        except ProcessLookupError:
            break
        time.sleep(0.005)
    assert user.proc.wait(5) == 0, user.log()[-3000:]
    log = user.log()
    assert 'Traceback' not in log and 'KeyboardInterrupt' not in log, log[-3000:]
    assert 'SIGINT again: already shutting down' in log
    time.sleep(0.3)
    arm = after(user.traj, t)
    assert arm and is_hold(arm[-1], ARM, [m for _, m in user.traj]), arm[-1:]


def test_random_weights_on_a_robot_refuse_to_activate(tmp_path, domain):
    out = run_node(tmp_path, domain, ['-p', 'allow_random_weights:=false'])
    assert out.returncode == 1, out.stderr
    assert 'refusing to activate: the droid robot would be driven by RANDOM weights' in (
        out.stderr + out.stdout)
    assert 'Traceback' not in out.stderr + out.stdout


def test_two_outputs_on_one_controller_by_resolved_name_do_not_configure(tmp_path, domain):
    # The robot file names two controllers; a remapping makes them one. Compared as written
    # they differ, resolved they are one topic, and two commanders on one controller fight.
    out = run_node(tmp_path, domain, ['-r', 'gripper_controller/joint_trajectory:='
                                      '/arm_controller/joint_trajectory'])
    assert out.returncode == 1, out.stderr
    assert ('outputs.arm and outputs.gripper both command /arm_controller/joint_trajectory: '
            'a controller follows one trajectory at a time') in out.stderr + out.stdout
    assert 'Traceback' not in out.stderr + out.stdout


def test_mistyped_command_line_value_is_an_error_next_to_a_params_file(tmp_path, domain):
    # ROS itself keeps the params file's 70.0 and drops the string without a word.
    out = run_node(tmp_path, domain, ['-p', 'control_rate_hz:=fast'])
    assert out.returncode == 1, out.stderr
    assert "parameter control_rate_hz must be float, got 'fast'" in out.stderr
    assert 'Traceback' not in out.stderr + out.stdout


def test_node_started_without_autostart_stays_unconfigured_on_sigterm(tmp_path, domain):
    params = write_params(tmp_path / 'p.yaml', dict(PARAMS, autostart=False))
    log = tmp_path / 'node.log'
    with open(log, 'w') as f:
        proc = subprocess.Popen([sys.executable, '-m', 'oxygen_ros.ros.node', '--ros-args',
                                 '--params-file', params], stdout=f,
                                stderr=subprocess.STDOUT, text=True, env=node_env(domain))
        # Signalled once it says it waits (a fixed 3 s was still inside torch's import on a
        # slow machine: SIGTERM's default action ended it, -15).
        waiting = 'unconfigured: waiting for lifecycle transitions'
        assert wait_for(lambda: waiting in log.read_text() or proc.poll() is not None, 60)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    out = log.read_text()
    assert proc.returncode == 0, out
    assert waiting in out
    assert 'Traceback' not in out


@pytest.mark.skipif(shutil.which('ros2') is None or importlib.util.find_spec('launch_ros') is None,
                    reason='ros2 launch is not installed (see shared/ros-overlay)')
def test_ros2_launch_survives_a_second_sigint(tmp_path, domain):
    """Ctrl-C twice in a terminal: the whole process group gets SIGINT twice, the nodes
    while they are already shutting down."""
    params = tiny_sim_file(tmp_path)
    log = tmp_path / 'launch.log'
    with open(log, 'w') as out:
        proc = subprocess.Popen(
            ['ros2', 'launch', 'oxygen_ros', 'pi05.launch.py', 'robot:=sim', 'sim:=true',
             f'params_file:={params}', 'device:=cpu'],
            stdout=out, stderr=subprocess.STDOUT, env=node_env(domain), start_new_session=True)
        try:
            assert wait_for(lambda: 'active: commanding' in log.read_text(), 90), log.read_text()
            time.sleep(1.0)
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert 'Traceback' not in text and 'KeyboardInterrupt' not in text, text[-3000:]
    assert text.count('process has finished cleanly') == 2, text[-3000:]
