"""~/ask across oxygen_node's end: the callers of open goals still get their results when it
stops, and after a cleanup the node configures and answers again.

On the real node (the installed node as its own process on the tiny model; this process
plays the robot and asks over real rclpy action clients): SIGINT, the lifecycle shutdown,
cleanup. In this process: AskServer.close, which sends those results, against a real
engine and an rclpy action client.
"""
import signal
import time

import pytest
import torch

rclpy = pytest.importorskip('rclpy')
from rclpy.action import ActionClient  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from support.ask import ABORTED, ASKING, ROWS, SUCCEEDED, Asker  # noqa: E402
from support.models import asking_engine  # noqa: E402
from support.node import ARM, after, is_hold, node_process  # noqa: E402  # noqa: E402
from support.process import new_domain, wait_for  # noqa: E402

import oxygen_ros.action as action_mod  # noqa: E402 (built by colcon; must import)
from oxygen_ros.model import Pi05, load_config  # noqa: E402
from oxygen_ros.model.tokenizer import Tokenizer  # noqa: E402
from oxygen_ros.ros.ask_server import AskServer  # noqa: E402

Ask = action_mod.Ask
# Far more tokens than the goals get to decode before the node stops.
BUDGET = 200
STARTED = dict(ASKING, autostart=True, max_new_tokens=BUDGET)


@pytest.fixture
def domain():
    # A domain of its own: other test runs on this machine use the same names.
    return new_domain(1, 230)


def started(tmp_path, domain, params=STARTED):
    return node_process(tmp_path, params, domain, 'asker', Asker,
                        '-r', 'front/image:=/remapped/front')


def wait_active(proc, a):
    a.leave_out = set()
    assert wait_for(lambda: 'active: commanding' in a.log() or proc.poll() is not None,
                    60), a.log()
    assert wait_for(lambda: a.rate(0.3) > 0.5 * 70, 30), a.log()[-3000:]


def streaming(a, n):
    """n goals, each with a few tokens decoded."""
    goals = a.send(*[f'tell me everything, {i}' for i in range(n)])
    assert wait_for(lambda: all(g.feedback and g.feedback[-1].tokens >= 3 for g in goals),
                    30), a.log()[-3000:]
    return goals


def assert_ended_by_shutdown(goals):
    for g in goals:
        status, r = g.result(timeout=5)
        assert status == ABORTED, (status, r.reason, r.message)
        assert (r.reason, r.message) == (Ask.Result.CANCELLED, 'shutting down')
        # What was decoded before the stop, as the feedback said it.
        assert 3 <= r.tokens < BUDGET and g.adds_up(r.text)
        assert {f.request_id for f in g.feedback} == {r.request_id}


def assert_clean_log(a):
    log = a.log()
    assert 'Traceback' not in log and 'KeyboardInterrupt' not in log, log[-3000:]


def test_sigint_sends_every_open_goal_its_result_after_the_hold(tmp_path, domain):
    with started(tmp_path, domain) as (proc, a):
        wait_active(proc, a)
        goals = streaming(a, ROWS)
        done_at = {}
        for i, g in enumerate(goals):
            g.future.add_done_callback(lambda _f, i=i: done_at.setdefault(i, time.monotonic()))
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, a.log()[-3000:]
        assert_ended_by_shutdown(goals)
        sent = [m for _, m in a.traj]
        holds = [at for at, m in a.traj if at >= t and is_hold(m, ARM, sent)]
        assert holds, after(a.traj, t)[-3:]
        # The robot is held before anyone is told the node has stopped.
        assert holds[-1] < min(done_at.values())
        assert_clean_log(a)


def test_lifecycle_shutdown_sends_open_goals_their_results(tmp_path, domain):
    with started(tmp_path, domain) as (proc, a):
        wait_active(proc, a)
        goals = streaming(a, 1)
        assert a.transition('shutdown')
        assert proc.wait(30) == 0, a.log()[-3000:]
        assert_ended_by_shutdown(goals)
        assert_clean_log(a)


def test_cleanup_and_configure_again_still_answers(tmp_path, domain):
    with started(tmp_path, domain, dict(STARTED, autostart=False)) as (proc, a):
        assert wait_for(lambda: 'unconfigured: waiting' in a.log() or proc.poll() is not None,
                        60), a.log()
        for step in ('configure', 'cleanup', 'configure', 'activate'):
            assert a.transition(step), (step, a.log()[-3000:])
        wait_active(proc, a)
        (goal,) = a.send('still there?', budget=3)
        status, r = goal.result()
        assert status == SUCCEEDED and 0 < r.tokens <= 3, (r.reason, r.message)
        assert proc.poll() is None
        assert_clean_log(a)


@pytest.fixture
def ask_here(domain):
    """An AskServer over a real engine (which no frame runs) and an action client, both on
    one executor in this process."""
    torch.manual_seed(0)
    engine, asks = asking_engine(Pi05(load_config('tiny')).to_inference('cpu'), Tokenizer.default(),
                        max_new_tokens=20)
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=int(domain))
    nodes = [rclpy.create_node(n, context=context) for n in ('oxygen_node', 'asker')]
    ex = SingleThreadedExecutor(context=context)
    for n in nodes:
        ex.add_node(n)
    server = AskServer(nodes[0], asks)
    client = ActionClient(nodes[1], Ask, '/oxygen_node/ask')
    assert wait_for(lambda: ex.spin_once(timeout_sec=0.01) or client.server_is_ready(), 10)
    try:
        yield ex, asks, server, client
    finally:
        client.destroy()
        for n in nodes:
            n.destroy_node()
        rclpy.try_shutdown(context=context)


def open_goal(ex, client):
    feedback = []
    sent = client.send_goal_async(Ask.Goal(question='what do you see?'),
                                  feedback_callback=lambda m: feedback.append(m.feedback))
    ex.spin_until_future_complete(sent, timeout_sec=10)
    result = sent.result().get_result_async()
    assert wait_for(lambda: ex.spin_once(timeout_sec=0.01) or feedback, 10)
    assert feedback[0].state == Ask.Feedback.WAITING
    return result


def test_close_sends_the_results_of_ended_goals(ask_here):
    ex, asks, server, client = ask_here
    results = [open_goal(ex, client) for _ in range(2)]
    asks.deactivate('shutting down')
    # Nothing else spins here: what close does is all the callers get.
    assert server.close(ex.spin_once, 1.0) == 0
    for result in results:
        assert result.done()
        r = result.result()
        assert r.status == ABORTED
        assert (r.result.reason, r.result.message) == (Ask.Result.CANCELLED, 'shutting down')
    assert wait_for(lambda: ex.spin_once(timeout_sec=0.01) or not client.server_is_ready(), 10)


def test_close_gives_up_on_a_goal_that_does_not_end(ask_here):
    ex, asks, server, client = ask_here
    result = open_goal(ex, client)
    # Still waiting for a frame, which never runs.
    assert server.close(ex.spin_once, 0.3) == 1
    assert not result.done() and asks.open_count == 1
