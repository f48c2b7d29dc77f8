"""The ask logic without ROS: goals in, feedback and one result out, over a real engine."""

import numpy as np
import pytest
import torch
from support.models import asking_engine  # noqa: E402

from oxygen_ros.engine import Observation, TokenEvent
from oxygen_ros.engine.ask import DECODING, QUEUED, WAITING, Asks, Feedback, Goal, Result
from oxygen_ros.model import Pi05, load_config
from oxygen_ros.model.tokenizer import Tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope='module')
def model():
    torch.manual_seed(0)
    return Pi05(load_config('tiny')).to_inference('cpu')


@pytest.fixture(scope='module')
def tokenizer():
    return Tokenizer.default()


def frame(engine, asks, i=0, narrate=False):
    rng = np.random.default_rng(i)
    size = engine.model_cfg.vision.image_size
    obs = Observation(stamp=10.0 + i, images={
        s: rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        for s in engine.model_cfg.image_slots}, state=np.zeros(6, np.float32), prompt='wave')
    result = engine.step(obs, narrate=narrate)
    assert asks.deliver(result.events) == []
    return result


def drain(answer):
    items = []
    while (item := answer.next(timeout=0)) is not None:
        items.append(item)
    return items


def test_feedback_adds_up_to_the_result(model, tokenizer):
    engine, asks = asking_engine(model, tokenizer)
    a = asks.open(Goal('is the cup in the gripper?'))
    b = asks.open(Goal('what is left?', max_new_tokens=3))
    assert a.request_id != b.request_id and 0 not in (a.request_id, b.request_id)
    events = []
    for i in range(6):
        events += frame(engine, asks, i, narrate=i == 0).events
    for answer, n in ((a, 5), (b, 3)):
        items = drain(answer)
        assert items[0] == Feedback(answer.request_id, 0.0, WAITING)
        fb, result = items[1:-1], items[-1]
        assert isinstance(result, Result) and result is answer.result
        assert (result.reason, result.tokens, result.stamp) == ('budget', n, 10.0)
        assert result.succeeded and result.message == ''
        assert [f.tokens for f in fb] == list(range(1, n + 1))
        assert {f.state for f in fb} == {DECODING} and {f.stamp for f in fb} == {10.0}
        assert ''.join(f.delta for f in fb) == result.text == fb[-1].text
        # The engine's own last event of the request says the same.
        last = [e for e in events if e.request_id == answer.request_id][-1]
        assert (last.text, last.tokens, last.kind) == (result.text, n, 'question')


def test_cancel_mid_stream_frees_the_row(model, tokenizer):
    engine, asks = asking_engine(model, tokenizer, max_new_tokens=20, max_requests=1)
    a = asks.open(Goal('first?'))
    frame(engine, asks, 0)
    frame(engine, asks, 1)
    a.cancel()  # between frames: at once
    items = drain(a)
    result = items[-1]
    assert (result.reason, result.tokens) == ('cancelled', 2) and not result.succeeded
    assert ''.join(f.delta for f in items[1:-1]) == result.text
    assert engine.cache.free_rows == 1 and asks.open_count == 0
    b = asks.open(Goal('second?', max_new_tokens=2))
    for i in range(2, 5):
        frame(engine, asks, i)
    assert b.result.reason == 'budget'


def test_cancel_while_the_frame_runs(model, tokenizer):
    engine, asks = asking_engine(model, tokenizer, max_new_tokens=20, max_requests=1)
    a = asks.open(Goal('first?'))
    frame(engine, asks, 0)
    rng = np.random.default_rng(0)
    size = engine.model_cfg.vision.image_size
    obs = Observation(1.0, {s: rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                            for s in engine.model_cfg.image_slots}, np.zeros(6, np.float32),
                      'wave')
    result = engine.step(obs, on_actions=lambda _: a.cancel())
    assert a.result is None  # the frame owns the engine: the cancel is its to do
    asks.deliver(result.events)
    assert a.result.reason == 'cancelled' and engine.cache.free_rows == 1


def test_a_flood_gets_reasons(model, tokenizer):
    engine, asks = asking_engine(model, tokenizer, max_new_tokens=3)
    answers = [asks.open(Goal(f'question {i}?')) for i in range(5)]
    for i in range(5):
        frame(engine, asks, i)
    reasons = [a.result.reason for a in answers]
    assert reasons == ['budget', 'budget', 'rejected', 'rejected', 'rejected']
    for a in answers[2:]:
        assert a.result.message == 'all 2 KV rows are busy (admission reject_newest)'
        assert a.result.request_id == a.request_id and a.result.stamp == 10.0
    assert asks.stats() == dict(questions_open=0, questions_answered=2, questions_rejected=3,
                                questions_cancelled=0, questions_dropped=0, questions_timed_out=0)


def test_queued_under_admission_wait(model, tokenizer):
    engine, asks = asking_engine(model, tokenizer, max_new_tokens=2, max_requests=1,
                                 admission='wait')
    a, b = asks.open(Goal('first?')), asks.open(Goal('second?'))
    frame(engine, asks, 0)
    states = [f.state for f in drain(b)]
    assert states == [WAITING, QUEUED]
    for i in range(1, 5):
        frame(engine, asks, i)
    assert a.result.reason == b.result.reason == 'budget'
    assert [f.tokens for f in drain(b)[:-1]] == [1, 2]


def test_refusals_say_why(model, tokenizer):
    engine, asks = asking_engine(model, tokenizer, max_question_tokens=6)
    for goal, why in ((Goal(''), 'empty'), (Goal('why?', max_new_tokens=9), 'max_new_tokens'),
                      (Goal('why?', prompt_format='Q:'), '{question}'),
                      (Goal('pick up the red cup and put it in the bowl'),
                           'over the 54 taken for max_question_tokens 6')):
        (result,) = drain(asks.open(goal))
        assert result.reason == 'rejected' and why in result.message
        assert result.request_id == 0
    idle = Asks()
    (result,) = drain(idle.open(Goal('why?')))
    assert result.message == 'the node is not active: the node is not configured'


def test_a_lowered_budget_is_the_default_and_the_limit(model, tokenizer):
    # The node's live max_new_tokens lowers the engine's budget (Engine.apply): a goal's 0
    # means it, and more than it is refused, though the KV rows were sized for 5.
    engine, asks = asking_engine(model, tokenizer)
    engine.apply('max_new_tokens', 2)
    (refused,) = drain(asks.open(Goal('why?', max_new_tokens=3)))
    assert refused.reason == 'rejected' and '[0, 2]' in refused.message
    a = asks.open(Goal('what is left?'))
    for i in range(4):
        frame(engine, asks, i)
    result = drain(a)[-1]
    assert (result.reason, result.tokens) == ('budget', 2)
    # Raised back to what the rows were sized for, 0 means 5 again.
    engine.apply('max_new_tokens', 5)
    b = asks.open(Goal('what is left?'))
    for i in range(4, 10):
        frame(engine, asks, i)
    assert (drain(b)[-1].reason, b.result.tokens) == ('budget', 5)


def test_deactivate_ends_every_answer_and_refuses_new_goals(model, tokenizer):
    engine, asks = asking_engine(model, tokenizer, max_new_tokens=20)
    woken = []
    asks.wake = lambda: woken.append(1)
    a = asks.open(Goal('first?'))
    frame(engine, asks, 0)
    waiting = asks.open(Goal('second?'))  # not yet started by a frame
    asks.deactivate('deactivated')
    assert a.result.reason == 'cancelled' and a.result.message == 'deactivated'
    assert a.result.tokens == 1 and waiting.result.reason == 'cancelled'
    assert engine.cache.free_rows == 2 and engine.stats()['questions_waiting'] == 0
    assert drain(asks.open(Goal('third?')))[0].message == 'the node is not active: deactivated'
    assert asks.stats() == dict(questions_open=0, questions_answered=0, questions_rejected=1,
                                questions_cancelled=2, questions_dropped=0,
                                questions_timed_out=0)
    assert woken


def test_events_of_unknown_questions_are_returned(model, tokenizer):
    engine, asks = asking_engine(model, tokenizer)
    stray = TokenEvent(999_999, 0.0, 'x', 'x', 1, False, kind='question')
    narration = TokenEvent(5, 0.0, 'x', 'x', 1, False)
    assert asks.deliver([narration, stray]) == [stray]
