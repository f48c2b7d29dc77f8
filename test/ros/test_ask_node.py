"""~/ask on the real oxygen_node: the installed node runs as its own process on the tiny
model (a lifecycle node, configured and activated here over its services), this process
plays the robot and asks over real rclpy action clients; the installed oxygen_ask command
is run against it too.

The tests run in order on one node process: inactive first, then active, then deactivated.
"""
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

rclpy = pytest.importorskip('rclpy')
ament = pytest.importorskip('ament_index_python.packages')
from support.ask import ABORTED, ASKING, BUDGET, CANCELED, ROWS, SUCCEEDED, Ask, Asker  # noqa: E402
from support.node import (  # noqa: E402
    assert_alive_and_commanding,
    node_process,
)
from support.process import node_env, wait_for  # noqa: E402


def stamp_of(t):
    return t.sec + t.nanosec * 1e-9


@pytest.fixture(scope='module')
def asker(domain, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('ask_node')
    with node_process(tmp, ASKING, domain, 'asker', Asker,
                      '-r', 'front/image:=/remapped/front') as (proc, a):
        a.proc = proc
        a.leave_out = set()
        assert wait_for(lambda: 'unconfigured: waiting' in a.log() or proc.poll() is not None,
                        60), a.log()
        assert proc.poll() is None, a.log()
        yield a


@pytest.fixture(autouse=True)
def alive(asker):
    yield
    assert asker.proc.poll() is None, asker.log()[-3000:]


def test_goal_while_inactive_is_refused_with_the_reason(asker):
    # Unconfigured: there is no action server at all.
    assert not asker.client.wait_for_server(timeout_sec=1.0)
    assert asker.transition('configure') and asker.state() == 'inactive'
    assert asker.client.wait_for_server(timeout_sec=30)
    (goal,) = asker.send('is anyone there?')
    status, r = goal.result()
    assert status == ABORTED and r.reason == Ask.Result.REJECTED
    assert r.message == 'the node is not active: configured, not yet activated'
    assert (r.request_id, r.tokens, r.text) == (0, 0, '')
    assert asker.transition('activate')
    assert_alive_and_commanding(asker, ASKING)


def test_feedback_adds_up_to_the_result(asker):
    (goal,) = asker.send('is the cup in the gripper?', budget=12)
    status, r = goal.result()
    assert status == SUCCEEDED, (r.reason, r.message)
    # Greedy decoding of random weights may meet end-of-sequence before the budget.
    assert (r.reason, r.tokens) == (Ask.Result.BUDGET, 12) or (
        r.reason == Ask.Result.DONE and 0 < r.tokens < 12)
    assert r.message == '' and r.request_id > 0
    assert goal.adds_up(r.text)
    assert {f.request_id for f in goal.feedback} == {r.request_id}
    assert goal.feedback[0].state == Ask.Feedback.WAITING
    streamed = [f for f in goal.feedback if f.state == Ask.Feedback.DECODING]
    assert [f.tokens for f in streamed] == list(range(1, r.tokens + 1))
    # The camera frame it answered, in every piece and the result: a frame of this run.
    assert {(f.stamp.sec, f.stamp.nanosec) for f in streamed} == {(r.stamp.sec, r.stamp.nanosec)}
    assert abs(time.time() - stamp_of(r.stamp)) < 60
    # Its tokens are the answer's, not narration.
    assert r.request_id not in {m.request_id for m in asker.narration}


def test_two_concurrent_goals_get_their_own_requests(asker):
    a, b = asker.send('where is the towel?', 'what is left to do?', budget=6)
    (sa, ra), (sb, rb) = a.result(), b.result()
    assert sa == sb == SUCCEEDED
    assert ra.request_id != rb.request_id
    assert {f.request_id for f in a.feedback} == {ra.request_id}
    assert {f.request_id for f in b.feedback} == {rb.request_id}
    assert a.adds_up(ra.text) and b.adds_up(rb.text)
    assert 0 < ra.tokens <= 6 and 0 < rb.tokens <= 6


def test_cancel_mid_stream_frees_the_row(asker):
    a, b = asker.send('first?', 'second?')  # BUDGET tokens each: both rows
    assert wait_for(lambda: any(f.tokens > 1 for f in a.feedback), 30), asker.log()[-3000:]
    assert wait_for(a.handle.cancel_goal_async().done, 30)
    status, ra = a.result()
    assert status == CANCELED and ra.reason == Ask.Result.CANCELLED
    assert ra.message == 'cancelled by its caller'
    assert 1 < ra.tokens < BUDGET and a.adds_up(ra.text)
    # Under reject_newest a third question is refused unless the cancel freed a row: it is
    # admitted while the second still streams.
    (c,) = asker.send('third?', budget=3)
    sc, rc = c.result()
    assert sc == SUCCEEDED and 0 < rc.tokens <= 3, (rc.reason, rc.message)
    assert not b.future.done()
    sb, rb = b.result()
    assert sb == SUCCEEDED and b.adds_up(rb.text)


def test_a_flood_gets_reasons_and_is_counted(asker):
    before = asker.fresh_diag()
    goals = asker.send(*[f'question {i}?' for i in range(5)], budget=20)
    results = [g.result() for g in goals]
    ok = [r for s, r in results if s == SUCCEEDED]
    refused = [r for s, r in results if s == ABORTED]
    assert len(ok) == ROWS and len(refused) == 5 - ROWS
    for r in refused:
        assert r.reason == Ask.Result.REJECTED and r.request_id > 0
        assert r.message == f'all {ROWS} KV rows are busy (admission reject_newest)'

    def grew(key):
        return int(asker.diag[key]) - int(before[key])
    assert wait_for(lambda: grew('questions_answered') == ROWS, 5), asker.diag
    d = asker.fresh_diag()
    assert grew('questions_rejected') == 5 - ROWS and grew('questions_cancelled') == 0
    assert (d['questions_open'], d['questions_waiting'], d['active_requests']) == ('0', '0', '0')


def test_the_oxygen_ask_command_prints_the_answer(asker, domain):
    exe = pathlib.Path(ament.get_package_prefix('oxygen_ros')) / 'lib' / 'oxygen_ros' / 'oxygen_ask'
    seen = len(asker.wire)
    proc = subprocess.run([sys.executable, str(exe), 'is the cup in the gripper?',
                           '--max-new-tokens', '7'], capture_output=True, text=True,
                          env=node_env(domain), timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = re.fullmatch(r'\[request (\d+), frame (\d+)\.(\d{9}), (\d+) tokens, (budget|done)\]\n',
                     proc.stderr)
    assert m, proc.stderr
    rid, tokens = int(m[1]), int(m[4])
    assert 0 < tokens <= 7 and (m[5] == 'budget') == (tokens == 7)
    # The answer it printed is what the node streamed for that request on the topic.
    assert wait_for(lambda: any(f.request_id == rid and f.tokens == tokens
                                for f in asker.wire[seen:]), 5)
    pieces = [f for f in asker.wire[seen:] if f.request_id == rid]
    assert proc.stdout == ''.join(f.delta for f in pieces) + '\n'
    assert (pieces[-1].stamp.sec, pieces[-1].stamp.nanosec) == (int(m[2]), int(m[3]))


def test_the_oxygen_ask_command_cancels_on_ctrl_c(asker, domain):
    exe = pathlib.Path(ament.get_package_prefix('oxygen_ros')) / 'lib' / 'oxygen_ros' / 'oxygen_ask'
    proc = subprocess.Popen([sys.executable, str(exe), 'tell me everything'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=node_env(domain))
    # Interrupted as soon as the command itself prints the answer's first piece: judged by
    # what this process receives, a loaded machine let the 40-token answer finish first.
    first = []
    reader = threading.Thread(target=lambda: first.append(proc.stdout.read(1)), daemon=True)
    reader.start()
    assert wait_for(lambda: bool(first), 60) and first[0], asker.log()[-3000:]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert re.search(r'tokens, cancelled\] cancelled by its caller', err), err
    assert wait_for(lambda: asker.fresh_diag()['questions_open'] == '0', 10), asker.diag


def test_deactivate_ends_open_goals_and_refuses_new_ones(asker):
    (a,) = asker.send('tell me everything')
    assert wait_for(lambda: any(f.tokens > 1 for f in a.feedback), 30), asker.log()[-3000:]
    assert asker.transition('deactivate')
    status, r = a.result()
    assert status == ABORTED and (r.reason, r.message) == (Ask.Result.CANCELLED, 'deactivated')
    assert 1 < r.tokens < BUDGET and a.adds_up(r.text)
    (b,) = asker.send('still there?')
    status, r = b.result()
    assert status == ABORTED and r.reason == Ask.Result.REJECTED
    assert r.message == 'the node is not active: deactivated'
    # Its row was freed with it.
    d = asker.fresh_diag()
    assert (d['active'], d['active_requests'], d['questions_open']) == ('False', '0', '0')
