"""oxygen_node as a robot sees it: the installed node runs as its own process on the tiny
model; this process plays the robot (cameras, joint states) and listens to what comes back.

One node process serves the whole module, so the bad-input tests also show that a problem
does not leave anything behind for the next one.
"""
import contextlib
import math
import re
import signal
import subprocess
import sys
import time

import pytest

rclpy = pytest.importorskip('rclpy')
from std_msgs.msg import Empty, String  # noqa: E402
from support.node import (  # noqa: E402
    ARM,
    PARAMS,
    Robot,
    assert_alive_and_commanding,
    expect_log,
    node_process,
    on_path,
    run_node,
)
from support.process import new_domain, node_env, wait_for, write_params  # noqa: E402


@pytest.fixture(scope='module')
def robot(domain, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('node')
    with node_process(tmp, PARAMS, domain, 'fake_robot', Robot,
                      '-r', 'front/image:=/remapped/front') as (proc, r):
        r.proc = proc
        started = wait_for(lambda: 'missing joint readings' in r.log() or proc.poll() is not None,
                           60)
        assert started and proc.poll() is None, r.log()
        r.leave_out = set()
        assert wait_for(lambda: len(r.traj) > 20, 30), 'no trajectories:\n' + r.log()
        yield r


def test_missing_joint_at_start_is_reported(robot):
    assert re.search(r'missing joint readings: gripper', robot.log())


def test_trajectories_are_well_formed(robot):
    # At LIVE of the control rate or more; the rate itself is tools/node_load.py's.
    start = len(robot.traj)
    assert_alive_and_commanding(robot)
    for _, m in robot.traj[start:start + 50]:
        assert m.joint_names == ARM
        assert m.header.stamp.sec == 0 and m.header.stamp.nanosec == 0
        times = [p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in m.points]
        assert 1 <= len(times) <= 4
        assert times[0] > 0 and all(b > a for a, b in zip(times, times[1:], strict=False))
        assert all(abs(b - a - 0.1) < 1e-6 for a, b in zip(times, times[1:], strict=False))
        assert list(m.points[-1].velocities) == [0.0] * 7
        assert all(math.isfinite(x) for p in m.points for x in p.positions)


def test_remapped_camera_is_consumed(robot):
    # Both cameras are required, so commands flowing means the remapped topic is read.
    assert robot.node.count_subscribers('/remapped/front') >= 1
    assert robot.node.count_subscribers('/front/image') == 0
    mark = len(robot.log())
    robot.paused.add('front')
    try:
        expect_log(robot, mark, r'no frame: front stale')
        time.sleep(0.6)  # what is left of the last chunk runs out
        assert robot.rate(0.5) == 0, 'commands without the remapped camera'
    finally:
        robot.paused.discard('front')
    assert_alive_and_commanding(robot)


def test_narration_deltas_make_the_final_text(robot):
    robot.narrate.publish(Empty())
    assert wait_for(lambda: len(robot.texts) >= 3, 20), robot.log()[-2000:]
    by_id = {}
    for m in list(robot.narration):
        by_id.setdefault(m.request_id, []).append(m)
    finished = {i: ms for i, ms in by_id.items() if ms[-1].done and ms[0].tokens == 1}
    assert finished, 'no request seen from start to end'
    texts = set(robot.texts)
    # admission reject_newest never cancels a started request, so every finished one must
    # have streamed its whole text, one message per token.
    for ms in finished.values():
        assert ''.join(m.delta for m in ms) == ms[-1].text
        assert [m.tokens for m in ms] == list(range(1, len(ms) + 1))
        assert len(ms) <= PARAMS['max_new_tokens']
        assert not any(m.done for m in ms[:-1])
        # Only the last message says why it ended: here its end of sequence or its budget.
        assert [m.reason for m in ms[:-1]] == [''] * (len(ms) - 1)
        assert ms[-1].reason in ('done', 'budget') and ms[-1].message == '', ms[-1]
        assert ms[-1].reason == 'done' or len(ms) == PARAMS['max_new_tokens'], ms[-1]
        assert len({(m.header.stamp.sec, m.header.stamp.nanosec) for m in ms}) == 1
        assert ms[0].header.stamp.sec > 0
        assert ms[-1].text in texts


def test_unsupported_encoding(robot):
    mark = len(robot.log())

    def bad(m):
        m.encoding = '16UC1'
        return m

    robot.bad_image['wrist'] = bad
    try:
        expect_log(robot, mark, r"camera wrist: unsupported image encoding '16UC1'")
        assert_alive_and_commanding(robot)  # the good images in between keep it going
    finally:
        robot.bad_image.clear()
    assert_alive_and_commanding(robot)


def test_wrong_image_size(robot):
    mark = len(robot.log())

    def bad(m):
        m.height += 10  # the buffer no longer covers the rows the header promises
        return m

    robot.bad_image['front'] = bad
    try:
        expect_log(robot, mark, r'camera front: image data has \d+ bytes')
        assert_alive_and_commanding(robot)
    finally:
        robot.bad_image.clear()
    assert_alive_and_commanding(robot)


def test_missing_camera_holds_then_recovers(robot):
    mark = len(robot.log())
    robot.paused.add('wrist')
    try:
        expect_log(robot, mark, r'no frame: wrist stale')
        expect_log(robot, mark, r'holding', timeout=3)
    finally:
        robot.paused.discard('wrist')
    assert_alive_and_commanding(robot)


def test_skewed_inputs(robot):
    mark = len(robot.log())
    robot.lag['wrist'] = 0.3  # fresh enough (< 0.5 s) but 300 ms apart from the rest
    try:
        expect_log(robot, mark, r'inputs skewed: wrist is \d+ ms older')
    finally:
        robot.lag.clear()
    assert_alive_and_commanding(robot)


def _nan_first(m):
    m.position = [float('nan')] + list(m.position[1:])
    return m


def _renamed(m):
    m.name = [f'other_{n}' for n in m.name]
    return m


@pytest.mark.parametrize('breakage, report', [
    (_nan_first, r'joints fr3_joint1 read NaN/inf'),
    (_renamed, r'none of the joints .*other_fr3_joint1.* are used'),
], ids=['nan_joint', 'unknown_joint_names'])
def test_bad_joint_states(robot, breakage, report):
    mark = len(robot.log())
    robot.bad_joints = breakage
    try:
        expect_log(robot, mark, report)
        assert_alive_and_commanding(robot)
    finally:
        robot.bad_joints = None
    assert_alive_and_commanding(robot)


def test_bad_prompts_are_rejected_good_one_taken(robot):
    mark = len(robot.log())
    robot.prompt.publish(String(data='   '))
    expect_log(robot, mark, r"~/prompt: empty prompt; keeping 'pick up the cup'")
    robot.prompt.publish(String(data='x' * 5000))
    expect_log(robot, mark, r'prompt of 5000 characters is over the limit of 500')
    robot.prompt.publish(String(data='put the cup down'))
    expect_log(robot, mark, r"task prompt: 'put the cup down'")
    assert_alive_and_commanding(robot)


def prompts_of(tokens):
    """{tokens: prompt}: what the tiny model's prefix takes of each prompt in the subtask
    format, counted by the built-in tokenizer the node runs."""
    from oxygen_ros.model.tokenizer import Tokenizer, subtask_prompt

    tok = Tokenizer.default()
    prompts = ('pick up the cup' + ' a' * k for k in range(20))
    out = {len(tok.encode(subtask_prompt(p))): p for p in prompts}
    assert set(tokens) <= set(out), out
    return out


def test_a_prompt_the_model_would_cut_is_refused(robot):
    # The tiny model's prefix holds 24 prompt tokens.
    prompts = prompts_of([24, 25])
    before = robot.get_param('prompt')
    r = robot.set_param('prompt', prompts[25])
    assert not r.successful, r
    assert "prompt of 25 tokens is over the model's max_token_len of 24" in r.reason, r.reason
    assert robot.get_param('prompt') == before
    mark = len(robot.log())
    robot.prompt.publish(String(data=prompts[25]))
    expect_log(robot, mark, r"~/prompt: prompt of 25 tokens is over the model's max_token_len "
               r"of 24: it would be cut off; keeping '")
    with live(robot, prompt=prompts[24]):  # one token fewer fits
        expect_log(robot, mark, re.escape(f"parameter prompt = {prompts[24]!r}"))
        robot.prompt.publish(String(data=prompts[24]))
        expect_log(robot, mark, re.escape(f"task prompt: {prompts[24]!r}"))
    assert_alive_and_commanding(robot)


def test_more_narration_requests_than_slots(robot):
    mark = len(robot.log())
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        robot.narrate.publish(Empty())
        time.sleep(0.01)
    expect_log(robot, mark, r'narration request .* rejected: all 2 KV rows are busy')
    assert_alive_and_commanding(robot)


@contextlib.contextmanager
def live(robot, **values):
    """The node's parameters set to `values` over its parameter service, and back after."""
    old = {name: robot.get_param(name) for name in values}
    try:
        for name, value in values.items():
            r = robot.set_param(name, value)
            assert r.successful, (name, r.reason)
        yield
    finally:
        for name, value in old.items():
            assert robot.set_param(name, value).successful, name


def running_before(narration):
    """Per request that starts after another one in `narration`: the tokens the one started
    just before it has by then, when that one is still running (not ended by EOS)."""
    last = {}
    prev = None
    out = []
    for m in narration:
        if m.tokens == 1 and m.request_id not in last:
            if prev is not None and not last[prev].done:
                out.append(last[prev].tokens)
            prev = m.request_id
        last[m.request_id] = m
    return out


def expect_from_now(robot, values, want, n=4, timeout=60):
    """`values(narration since now)` settles on `want` and stays there for `n` values.

    A request or frame already under way when a parameter changed keeps the old value, so
    the first values may differ; a change not applied never gives `want`, one applied
    wrongly gives others after it."""
    start = len(robot.narration)

    def settled():
        got = values(robot.narration[start:])
        return got[got.index(want):] if want in got else []

    ok = wait_for(lambda: len(settled()) >= n, timeout)
    got = values(robot.narration[start:])
    assert ok and set(settled()) == {want}, (want, got, robot.log()[-2000:])


def test_live_decode_k_sets_the_tokens_per_frame(robot):
    """Each frame decodes decode_k tokens of every running request, and a request started by
    a frame gets its first token right after the running ones' first of that frame. With a
    narration every 2nd frame, the request before a new one has 2 * decode_k + 1 tokens when
    the new one begins. (Of 8 tokens, max_new_tokens: a request lasts 4 frames at decode_k 2
    and 3 at decode_k 3, so the one two before has ended and the 2 rows never run out.)"""
    every = 2
    with live(robot, narration_every_n_frames=every, decode_k=PARAMS['decode_k']):
        for k in (2, 3):
            r = robot.set_param('decode_k', k)
            assert r.successful, r.reason
            assert robot.get_param('decode_k') == k
            expect_from_now(robot, running_before, every * k + 1)
        for value, reason in [
            (-1, 'decode_k out of range'),  # rclpy's range check
            ('many', "parameter decode_k must be int, got 'many'"),
            (2.5, 'parameter decode_k must be int, got 2.5'),
            (0, 'decode_k cannot switch between adaptive (0) and fixed while running'),
        ]:
            r = robot.set_param('decode_k', value)
            assert not r.successful and reason in r.reason, (value, r.reason)
        # The refused values left 3 in effect.
        assert robot.get_param('decode_k') == 3
        expect_from_now(robot, running_before, every * 3 + 1)


def texts(narration):
    """The final text of every request seen from its first token to its end."""
    started = set()
    out = []
    for m in narration:
        if m.tokens == 1:
            started.add(m.request_id)
        if m.done and m.request_id in started:
            out.append(m.text)
    return out


def test_live_temperature_samples_then_greedy_again(robot):
    """The same images and joints every frame: greedy narration (temperature 0) is the same
    text every time; sampled (temperature > 0, each request its own seeded generator) it is
    not; set back to 0 it is the first text again. A refused value leaves 0 in effect."""
    robot.same_images = True
    try:
        with live(robot, narration_every_n_frames=2, temperature=0.0):
            start = len(robot.narration)
            # The first requests may have begun on the random images from before.
            assert wait_for(lambda: len(texts(robot.narration[start:])) >= 4, 60)
            greedy = texts(robot.narration[start:])[3]
            expect_from_now(robot, texts, greedy)
            # The tiny model's random logits are peaked (the top two ~39 apart, measured): at
            # 10 the greedy token keeps about a third of the mass, so a sampled 8-token text
            # is the greedy one with a chance of about 1e-4.
            assert robot.set_param('temperature', 10.0).successful
            start = len(robot.narration)
            assert wait_for(lambda: len(texts(robot.narration[start:])) >= 6, 60)
            sampled = texts(robot.narration[start:])[2:6]
            assert sum(t != greedy for t in sampled) >= 3, (greedy, sampled)
            assert robot.set_param('temperature', 0.0).successful
            expect_from_now(robot, texts, greedy)
            for value, reason in [(-1.0, 'temperature out of range'),
                                  ('hot', "parameter temperature must be float, got 'hot'")]:
                r = robot.set_param('temperature', value)
                assert not r.successful and reason in r.reason, (value, r.reason)
            assert robot.get_param('temperature') == 0.0
            expect_from_now(robot, texts, greedy)
    finally:
        robot.same_images = False


def test_diagnostics_count_the_problems(robot):
    assert wait_for(lambda: robot.diag, 3)
    time.sleep(1.1)  # one report after the tests above
    d = robot.diag
    # Commands went out in the last 5 s; how many per second is the benchmarks' business.
    assert float(d['control_publish_hz']) > 0 and int(d['published']) > 0
    for key in ('dropped_images', 'dropped_joint_states', 'rejected_prompts',
                'skipped_frames'):
        assert int(d[key]) > 0, (key, d)
    for key in ('frame_ms_p50', 'frame_ms_p99', 'tokens_per_s', 'active_requests',
                'kv_bytes', 'deadline_misses', 'tick_jitter_ms_p99', 'missed_ticks',
                'rejected_requests', 'dropped_requests'):
        assert key in d, key
    assert int(d['frames']) > 0
    # The tiny model's KV store: 2 request rows and a scratch row of 3 * 16 image tokens +
    # 24 text + 48 for a question (max_question_tokens' default) + 8 generated = 128 columns;
    # keys and values of 2 layers, 1 kv head of 16 fp32, plus a validity byte per column and
    # two int64 counters per row.
    per_row = 2 * 2 * 1 * 128 * 16 * 4 + 128 + 8 + 8
    assert int(d['kv_bytes_per_slot']) == per_row
    assert int(d['kv_bytes']) == 3 * per_row
    assert 0 <= int(d['active_requests']) <= PARAMS['max_requests']
    # The flood above was rejected, never dropped (admission reject_newest).
    assert int(d['rejected_requests']) > 0 and int(d['dropped_requests']) == 0


def test_sigterm_holds_and_stops_cleanly(robot):
    t = time.monotonic()
    robot.proc.send_signal(signal.SIGTERM)
    assert robot.proc.wait(15) == 0
    n = len(robot.traj)
    time.sleep(0.3)
    assert len(robot.traj) == n, 'commands after shutdown'
    assert 'Traceback' not in robot.log(), robot.log()[-3000:]
    # The last command replaces whatever the controller executes: one point, at rest, where
    # the controller's setpoint can be (between where the robot measured its joints, joint
    # i at 0.1 * i, and where it was sent).
    last = [m for at, m in robot.traj if at >= t][-1]
    assert on_path(last, ARM, [m for _, m in robot.traj][:-1], [0.1 * i for i in range(7)]), last
    assert 'holding: shutting down' in robot.log()


def test_missing_checkpoint_exits_with_a_clear_error(tmp_path, domain):
    out = run_node(tmp_path, domain, ['-p', f'checkpoint:={tmp_path / "nowhere"}'])
    assert out.returncode == 1, out.stderr
    assert 'checkpoint not found' in out.stderr and 'nowhere' in out.stderr
    assert 'Traceback' not in out.stderr + out.stdout


def test_corrupt_checkpoint_exits_with_a_clear_error(tmp_path, domain):
    ck = tmp_path / 'ck'
    ck.mkdir()
    (ck / 'model.safetensors').write_bytes(b'\xff' * 64 + b'not a checkpoint')
    out = run_node(tmp_path, domain, ['-p', f'checkpoint:={ck}'])
    assert out.returncode == 1, out.stderr
    assert 'cannot start the engine' in out.stderr
    assert 'Traceback' not in out.stderr + out.stdout


@pytest.mark.parametrize('extra, message', [
    (['-p', 'control_rate_hz:=-5.0'], 'control_rate_hz must be > 0'),
    (['-p', 'camera_slots:=[base_0_rgb]'], 'must have equal lengths'),
    (['-p', 'camera_slots:=[base_0_rgb, top_rgb]'],
     "camera_slots ['top_rgb'] are not slots of model 'tiny'"),
    (['-p', 'robot:=identity', '-p', 'profile_options:="{dim: 14}"'],
     '8 joints listed but the identity profile takes a 14-d state'),
    (['-p', 'image_qos:=fast'], 'image_qos must be one of'),
    (['-p', 'max_prompt_chars:=lots'], 'parameter max_prompt_chars must be int'),
    (['-p', 'checkpoint:=/nowhere', '--params-file', '/nowhere.yaml'], 'nowhere.yaml'),
    # pi0.5's prompt with DROID's 8-d state takes 48 tokens of the tiny model's 24.
    (['-p', 'prompt_format:=pi05'], "parameter prompt: prompt of 48 tokens with the 8-d state "
     "(each value at its longest) is over the model's max_token_len of 24"),
    (['-p', 'outputs.gripper.indices:=[6]'],
     'action index 6 is in outputs.arm.indices and outputs.gripper.indices'),
    (['-p', 'control_rate_hz:=1.0e+300'], 'parameter control_rate_hz must be > 0 and <= 1000'),
    (['-p', 'profile_options:="{velocity_scale: .nan}"'], 'option velocity_scale must be finite'),
])
def test_bad_parameters_exit_with_a_clear_error(tmp_path, domain, extra, message):
    out = run_node(tmp_path, domain, extra)
    assert out.returncode == 1, out.stderr
    assert message in out.stderr, out.stderr
    assert 'Traceback' not in out.stderr + out.stdout


@pytest.fixture(scope='module')
def paligemma_sized(tmp_path_factory):
    """An openpi checkpoint of the tiny model with PaliGemma's vocabulary, 257152 entries (a
    width of 8 keeps its embedding at 8 MB), and stats for DROID's 8 dims."""
    import torch

    from oxygen_ros.model import Pi05, load_config, save_checkpoint

    torch.manual_seed(0)
    model = Pi05(load_config('tiny', vocab=257152, vlm={'width': 8})).to_inference('cpu')
    stats = {'state': {'q01': [-1.0] * 8, 'q99': [1.0] * 8},
             'actions': {'q01': [-1.0] * 8, 'q99': [1.0] * 8}}
    return save_checkpoint(model, tmp_path_factory.mktemp('pg') / 'pi05_droid', stats, 'droid')


def test_a_checkpoint_without_its_tokenizer_fails_configure(tmp_path, domain, paligemma_sized):
    # The checkpoint's own dims (model: ''), no tokenizer given or in its directory.
    params = write_params(tmp_path / 'params.yaml',
                          dict(PARAMS, model='', checkpoint=str(paligemma_sized),
                               compile=False))
    out = subprocess.run([sys.executable, '-m', 'oxygen_ros.ros.node', '--ros-args',
                          '--params-file', params], capture_output=True, text=True, timeout=120,
                         env=node_env(domain))
    assert out.returncode == 1, out.stderr
    for part in ('configure failed: cannot start the engine', str(paligemma_sized),
                 "PaliGemma's 257152-entry vocabulary", 'paligemma_tokenizer.model',
                 'google/paligemma-3b-pt-224', 'as tokenizer'):
        assert part in out.stderr + out.stdout, (part, out.stderr + out.stdout)
    assert 'Traceback' not in out.stderr + out.stdout


def test_the_node_runs_the_model_compiled_by_default(tmp_path_factory):
    """On a CPU the node runs the compiled model unless told not to (compile: true is the
    default), and says so at configure. node_process builds the programs first, into the
    cache the node reads: the first build of a model's dims takes longer than the tests wait
    for a node to start, and the node only loads them."""
    import os

    tmp = tmp_path_factory.mktemp('compiled_node')
    cache = os.environ.get('OXYGEN_COMPILE_CACHE') or str(tmp / 'programs')
    params = {k: v for k, v in PARAMS.items() if k != 'compile'}  # the default
    params['compile_cache'] = cache
    with node_process(tmp, params, new_domain(102, 120), 'fake_robot', Robot,
                      '-r', 'front/image:=/remapped/front') as (proc, r):
        r.proc = proc
        assert wait_for(lambda: 'configured:' in r.log() or proc.poll() is not None, 60)
        assert re.search(r'configured: model tiny with RANDOM weights .*; run compiled', r.log())
        assert 'compiling the model' not in r.log()  # loaded, not built again
        r.leave_out = set()
        assert wait_for(lambda: len(r.traj) > 20, 30), 'no trajectories:\n' + r.log()
        assert_alive_and_commanding(r, params)
