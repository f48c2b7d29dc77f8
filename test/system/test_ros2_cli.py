"""The `ros2` command lines the README shows, run as a user runs them against a real
oxygen_node (lifecycle, not autostarted) fed by a fake robot: what each prints, and what it
does to the trajectories and narration received here over rclpy.

The tests run in order on one node process: configure, activate, parameters, a question,
the trajectory rate, deactivate.
"""
import importlib.util
import math
import re
import shlex
import shutil
import signal
import subprocess
import time

import pytest
import yaml

pytestmark = pytest.mark.skipif(
    shutil.which('ros2') is None or importlib.util.find_spec('ros2lifecycle') is None
    or importlib.util.find_spec('ros2action') is None,
    reason='the ros2 command line with its lifecycle and action verbs is not installed '
           '(built from OXYGEN_ROS_OVERLAY_SRC, see shared/ros-overlay)')

rclpy = pytest.importorskip('rclpy')
from support.node import ARM, PARAMS, Robot, keeps_commanding, node_process, on_path  # noqa: E402
from support.paths import ROOT  # noqa: E402
from support.process import node_env, wait_for  # noqa: E402

import oxygen_ros.msg  # noqa: E402,F401 (built by colcon; must import)

NODE = '/oxygen_node'
TOPIC = '/arm_controller/joint_trajectory'
CLI = dict(PARAMS, autostart=False)
# What the fake robot measures for the arm: joint i reads 0.1 * i.
MEASURED = [0.1 * i for i in range(len(ARM))]


def documented():
    return (ROOT / 'README.md').read_text() + (ROOT / 'docs' / 'robots.md').read_text()


def readme_command(start):
    """The README's command line that begins with `start`, as its words."""
    lines = [ln.strip() for ln in (ROOT / 'README.md').read_text().splitlines()
             if ln.strip().startswith(start)]
    assert lines, f'the README shows no `{start} ...` line'
    return shlex.split(lines[0], comments=True)


def ros2(domain, *args, timeout=90):
    """`ros2 args...` run to its end: (exit status, stdout, stderr). Killed past `timeout`."""
    out = subprocess.run(['ros2', *args], capture_output=True, text=True, timeout=timeout,
                         env=node_env(domain), stdin=subprocess.DEVNULL)
    return out.returncode, out.stdout, out.stderr


@pytest.fixture(scope='module')
def user(domain, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('cli')
    # The CLI starts a daemon for the domain on first use, and a call made while that one
    # is still discovering answers "Node not found" although the call before it (made
    # without the daemon) found the node. Started first, the daemon is what every call
    # asks; it is stopped afterwards unless it was there already.
    _, status, _ = ros2(domain, 'daemon', 'status', timeout=30)
    had_daemon = 'is running' in status
    if not had_daemon:
        code, out, err = ros2(domain, 'daemon', 'start', timeout=60)
        assert code == 0, out + err
    try:
        with node_process(tmp, CLI, domain, 'cli_user', Robot,
                          '-r', 'front/image:=/remapped/front') as (proc, u):
            u.proc, u.domain = proc, domain
            u.leave_out = set()
            assert wait_for(lambda: 'unconfigured: waiting' in u.log() or proc.poll() is not None,
                            60), u.log()
            assert proc.poll() is None, u.log()
            # The lifecycle verbs address a node only once discovery has brought its
            # lifecycle services (before that, "Node not found"): wait, as a user would, for
            # `ros2 lifecycle nodes` to list it.
            assert wait_for(lambda: NODE in cli(u, 'lifecycle', 'nodes')[1].split(), 90, 1.0), (
                u.log())
            yield u
    finally:
        if not had_daemon:
            ros2(domain, 'daemon', 'stop', timeout=30)


def cli(user, *args, timeout=90):
    return ros2(user.domain, *args, timeout=timeout)


def state(user):
    code, out, err = cli(user, 'lifecycle', 'get', NODE)
    assert code == 0, err
    return out.strip()


def transition(user, label):
    code, out, err = cli(user, 'lifecycle', 'set', NODE, label)
    assert code == 0 and 'Transitioning successful' in out, (out, err, user.log()[-3000:])


def commanding(user, seconds=1.0):
    return user.rate(seconds) > 0


def test_interface_show_prints_the_action_definition(domain):
    words = readme_command('ros2 interface show')
    assert words == ['ros2', 'interface', 'show', 'oxygen_ros/action/Ask'], words
    code, out, err = ros2(domain, *words[1:], timeout=60)
    assert code == 0, err
    source = (ROOT / 'action' / 'Ask.action').read_text()
    # The file as written, with the nested builtin_interfaces/Time expanded under each
    # stamp (tab-indented).
    shown = out.splitlines()
    assert [ln for ln in shown if not ln.startswith('\t')] == source.splitlines()
    stamps = [i for i, ln in enumerate(shown) if ln.startswith('builtin_interfaces/Time stamp')]
    assert len(stamps) == 2
    for i in stamps:
        assert shown[i + 1:i + 3] == ['\tint32 sec', '\tuint32 nanosec']
    # Goal, result and feedback fields, in order.
    code, out, err = ros2(domain, 'interface', 'show', '--no-comments', 'oxygen_ros/action/Ask',
                          timeout=60)
    assert code == 0, err
    parts = [[ln.split()[1] for ln in part.splitlines()
              if ln.strip() and not ln.startswith(('\t', ' ')) and '=' not in ln]
             for part in out.split('---\n')]
    assert parts == [['question', 'max_new_tokens', 'prompt_format'],
                     ['request_id', 'stamp', 'text', 'tokens', 'reason', 'message'],
                     ['request_id', 'stamp', 'state', 'delta', 'text', 'tokens']]


def test_lifecycle_set_configure_then_activate_commands(user):
    doc = documented()
    for label in ('configure', 'activate', 'deactivate'):
        assert f'ros2 lifecycle set {NODE} {label}' in doc
    assert state(user) == 'unconfigured [1]'
    # Not a transition of this state: refused, with the ones there are.
    code, out, err = cli(user, 'lifecycle', 'set', NODE, 'activate')
    assert code == 1 and 'Unknown transition requested' in err and '- configure [1]' in err, (
        code, out, err)
    assert state(user) == 'unconfigured [1]'
    transition(user, 'configure')
    assert state(user) == 'inactive [2]'
    assert not commanding(user), 'commands while inactive'
    transition(user, 'activate')
    assert state(user) == 'active [3]'
    assert keeps_commanding(user.traj, CLI['control_rate_hz'], lambda: user.proc.poll() is None), (
        user.log()[-3000:])


def param_get(user, name):
    code, out, err = cli(user, 'param', 'get', NODE, name)
    assert code == 0, err
    return out.strip()


def param_set(user, name, value):
    """What `ros2 param set` printed, stdout and stderr together."""
    code, out, err = cli(user, 'param', 'set', NODE, name, value)
    assert code == 0, (out, err)
    return (out + err).strip()


def points_per_message(user, seconds=2.0):
    """The point counts of the trajectories sent from now on, the first few (in flight
    already) left out."""
    start = len(user.traj)
    time.sleep(seconds)
    return [len(m.points) for _, m in user.traj[start + 5:]]


def test_param_set_play_steps_acts_on_the_trajectories(user):
    # All of a chunk's actions ahead: several points per trajectory.
    assert max(points_per_message(user), default=0) > 1
    assert param_set(user, 'play_steps', '2') == 'Set parameter successful'
    assert param_get(user, 'play_steps') == 'Integer value is: 2'
    # Only action 1 of each chunk is ever ahead (action 0 is the frame's own time).
    sent = points_per_message(user)
    assert sent and set(sent) == {1}, sent
    assert param_set(user, 'play_steps', '0') == 'Set parameter successful'
    assert wait_for(lambda: max(points_per_message(user, 1.0), default=0) > 1, 20)


def stamp_of(m):
    return m.header.stamp.sec + m.header.stamp.nanosec * 1e-9


def narration_lengths(narration, after=0.0):
    """The final token count of each request seen from its first token to its end whose
    frame (its header stamp, the node's clock: this machine's time) is later than `after`."""
    started, out = set(), []
    for m in narration:
        if m.tokens == 1:
            started.add(m.request_id)
        if m.done and m.request_id in started and stamp_of(m) > after:
            out.append(m.tokens)
    return out


def test_param_set_max_new_tokens_shortens_the_narration(user):
    assert wait_for(lambda: len(narration_lengths(user.narration)) >= 3, 60), user.log()[-3000:]
    # Requests before the change run to the configured 8 tokens.
    assert max(narration_lengths(user.narration)) == CLI['max_new_tokens']
    assert param_set(user, 'max_new_tokens', '3') == 'Set parameter successful'
    # Every request started by a frame after the command returned has the new budget.
    # (Received messages lag behind the node: the count goes by the frames' stamps.)
    done = time.time()
    assert param_get(user, 'max_new_tokens') == 'Integer value is: 3'
    assert wait_for(lambda: len(narration_lengths(user.narration, done)) >= 4, 60), (
        user.log()[-3000:])
    got = narration_lengths(user.narration, done)
    assert max(got) == 3 and all(n <= 3 for n in got), got
    # Back up to the configured value, which the KV cache was sized for, but not past it.
    out = param_set(user, 'max_new_tokens', str(CLI['max_new_tokens'] + 1))
    n = CLI['max_new_tokens']
    assert out == ('Setting parameter failed: max_new_tokens may not exceed '
                   f'{n} while configured: the KV cache was sized for {n}'), out
    assert param_set(user, 'max_new_tokens', str(CLI['max_new_tokens'])) == \
        'Set parameter successful'
    done = time.time()
    assert wait_for(lambda: CLI['max_new_tokens'] in narration_lengths(user.narration, done),
                    60), user.log()[-3000:]


def test_param_set_refused_prints_the_reason_and_keeps_the_value(user):
    out = param_set(user, 'control_rate_hz', '50.0')
    assert out == 'Setting parameter failed: Trying to set a read-only parameter: ' \
                  'control_rate_hz.', out
    assert param_get(user, 'control_rate_hz') == 'Double value is: 70.0'
    # A live parameter refused by the node's own check says so in its words.
    out = param_set(user, 'decode_k', '0')
    assert out == 'Setting parameter failed: decode_k cannot switch between adaptive (0) and ' \
                  'fixed while running', out
    assert param_get(user, 'decode_k') == f'Integer value is: {CLI["decode_k"]}'
    out = param_set(user, 'temperature', 'hot')
    assert out == "Setting parameter failed: parameter temperature must be float, got 'hot'", out
    assert param_get(user, 'temperature') == 'Double value is: 0.0'


def blocks(out, title):
    """The YAML under each `title:` line of send_goal's output."""
    found = []
    for block in out.split('\n\n'):
        head, _, body = block.strip('\n').partition('\n')
        if head == f'{title}:':
            # The CLI indents the first line of the message only.
            found.append(yaml.safe_load(body.lstrip()))
    return found


def test_action_send_goal_answers_with_feedback(user):
    words = readme_command('ros2 action send_goal')
    assert words[1:5] == ['action', 'send_goal', f'{NODE}/ask', 'oxygen_ros/action/Ask'], words
    assert '--feedback' in words
    goal = yaml.safe_load(words[5])
    assert goal['question'] == 'is the cup in the gripper?'
    code, out, err = ros2(user.domain, *words[1:], timeout=120)
    assert code == 0, (out, err)
    assert 'Goal accepted with ID:' in out, out
    assert out.rstrip().endswith('Goal finished with status: SUCCEEDED'), out
    feedback, results = blocks(out, 'Feedback'), blocks(out, 'Result')
    assert feedback and len(results) == 1, out
    result = results[0]
    assert result['reason'] in ('done', 'budget') and result['message'] == '', result
    assert 1 <= result['tokens'] <= CLI['max_new_tokens'], result
    assert result['request_id'] > 0 and result['stamp']['sec'] > 0, result
    assert {f['state'] for f in feedback} <= {'waiting', 'queued', 'decoding'}
    assert {f['request_id'] for f in feedback} == {result['request_id']}
    # The printed deltas add up to the printed answer.
    assert ''.join(f['delta'] for f in feedback) == result['text'], out
    assert feedback[-1]['text'] == result['text'] and feedback[-1]['tokens'] == result['tokens']


def test_topic_hz_prints_a_rate(user, tmp_path):
    log = tmp_path / 'hz.log'
    with open(log, 'w') as f:
        proc = subprocess.Popen(['ros2', 'topic', 'hz', TOPIC], stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=node_env(user.domain))
        try:
            assert wait_for(lambda: log.read_text().count('average rate:') >= 3, 60), (
                log.read_text())
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    rates = [float(r) for r in re.findall(r'average rate: ([0-9.]+)', log.read_text())]
    # A rate, not a timing goal: the node ticks at 70 Hz while it has a chunk.
    assert rates and all(math.isfinite(r) and r > 5.0 for r in rates), rates


def test_lifecycle_set_deactivate_holds_then_silence(user):
    start = len(user.traj)
    transition(user, 'deactivate')
    assert state(user) == 'inactive [2]'
    time.sleep(0.5)
    sent = [m for _, m in user.traj[start:]]
    # Anything sent before the hold was in flight already; the hold comes last. (A loaded
    # machine may also have held for a used-up chunk while the command ran.)
    hold = sent[-1] if sent else None
    assert hold is not None and len(hold.points) == 1, sent[-1:]
    # At rest where the controller's setpoint can be: between the measured pose and where
    # it was sent.
    assert on_path(hold, ARM, [m for _, m in user.traj][:-1], MEASURED), hold
    assert list(hold.points[0].velocities) == [0.0] * len(ARM)
    assert user.log().count('holding: deactivated') == 1, user.log()[-3000:]
    assert not commanding(user), 'commands after deactivate'
