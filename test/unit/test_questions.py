"""Questions: extra language requests born from a frame's one prefill, each with its own
tokens appended after the shared prefix, decoded with narration, cancelled by id."""

import threading

import numpy as np
import pytest
import torch
from support.models import tiny_model  # noqa: E402

from oxygen_ros.engine import QUESTION_FORMAT, Engine, EngineConfig, Observation
from oxygen_ros.model import KV, Pi05, load_config
from oxygen_ros.model.tokenizer import Tokenizer

torch.set_num_threads(1)

ATTENTION = ['bidirectional', 'causal']


@pytest.fixture(scope='module')
def model():
    return tiny_model(strong=True)


@pytest.fixture(scope='module')
def tokenizer():
    return Tokenizer.default()


def make_engine(model, tokenizer, **kw):
    cfg = dict(model='tiny', mode='oxygen', decode_k=2, max_requests=4, max_new_tokens=6,
               stop_at_eos=False, prompt_format='subtask', seed=7, admission='reject_newest',
               max_question_tokens=48, compile=False)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg), model=model, tokenizer=tokenizer)


def observation(model_cfg, i=0, missing=()):
    rng = np.random.default_rng(i)
    size = model_cfg.vision.image_size
    images = {s: None if s in missing else rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
              for s in model_cfg.image_slots}
    return Observation(stamp=float(i), images=images,
                       state=rng.uniform(-1, 1, 6).astype(np.float32), prompt='pick up the cup')


def collect(events, new):
    for e in new:
        events.setdefault(e.request_id, []).append(e)
    return events


def run_until_done(engine, ids, events=None, frames=20):
    """Frames until every id has had its last event; returns all events by id."""
    events = {} if events is None else events
    for i in range(frames):
        if all(i in events and events[i][-1].done for i in ids):
            break
        collect(events, engine.step(observation(engine.model_cfg, 100 + i)).events)
    return events


def reference_greedy(model, frame, extension, n, vocab):
    """Greedy tokens after [prefix | extension] by whole-sequence recomputation, no cache."""
    args = (frame.images, frame.image_mask, frame.tokens, frame.token_mask)
    seq = list(extension)
    out = []
    for _ in range(n):
        logits = model.forward_text(*args, torch.tensor([seq], dtype=torch.long))[0, -1]
        t = int(logits[:vocab].argmax())
        out.append(t)
        seq.append(t)
    return out


# -- the model: row copy and the extension pass --------------------------------------------

@pytest.mark.parametrize('attention', ATTENTION)
def test_extension_equals_full_sequence(attention):
    """Two questions grow from one prefilled row (one of them in that row itself, after the
    other's copy); each one's logits, and those of the answer decoded after it, equal the
    whole [prefix | question | answer] sequence recomputed without a cache."""
    model = tiny_model(strong=True, prompt_attention=attention)
    cfg = model.cfg
    g = torch.Generator().manual_seed(1)
    size, n = cfg.vision.image_size, cfg.max_token_len
    images = torch.rand(1, 3, 3, size, size, generator=g) * 2 - 1
    image_mask = torch.tensor([[True, False, True]])
    tokens = torch.randint(2, cfg.vocab, (1, n), generator=g)
    token_mask = torch.arange(n)[None] < 9
    tokens[~token_mask] = 0
    obs = (images, image_mask, tokens, token_mask)
    questions = [torch.randint(2, cfg.vocab, (5,), generator=g),
                 torch.randint(2, cfg.vocab, (2,), generator=g)]
    answers = torch.randint(2, cfg.vocab, (2, 3), generator=g)

    kv = KV.allocate(cfg, 4, cfg.prefix_len + 12)
    shared, other = 1, 3
    model.prefill(*obs, kv, slice(shared, shared + 1))
    prefix_len, prefix_pos = int(kv.length[shared]), int(kv.next_pos[shared])
    kv.copy_row(shared, other)
    for layer in range(cfg.vlm.depth):
        for t in (kv.k[layer], kv.v[layer]):
            torch.testing.assert_close(t[other, :, :prefix_len], t[shared, :, :prefix_len],
                                       rtol=0, atol=0)
    assert kv.valid[other].tolist() == kv.valid[shared].tolist()
    hidden = {other: model.extend(kv, other, questions[0]),
              shared: model.extend(kv, shared, questions[1])}
    for row, q, a in ((other, questions[0], answers[0]), (shared, questions[1], answers[1])):
        got = [model.logits(hidden[row])[0]]
        for t in a[:-1]:
            got.append(model.decode_step(kv, torch.tensor([row]), t[None])[0])
        ref = model.forward_text(*obs, torch.cat((q, a))[None])[0]
        # ref[j] follows generated token j: ref[len(q)] predicts the answer's first token.
        torch.testing.assert_close(torch.stack(got), ref[len(q):-1], atol=1e-4, rtol=1e-5)
        # Positions continue from the valid prefix, columns from the written ones.
        assert int(kv.next_pos[row]) == prefix_pos + len(q) + len(a) - 1
        assert int(kv.length[row]) == prefix_len + len(q) + len(a) - 1


def test_extension_refuses_what_does_not_fit(model):
    kv = KV.allocate(model.cfg, 1, 8)
    kv.length[0] = kv.next_pos[0] = 6
    with pytest.raises(ValueError, match='do not fit'):
        model.extend(kv, 0, torch.tensor([5, 6, 7]))
    with pytest.raises(ValueError, match='at least one token'):
        model.extend(kv, 0, torch.tensor([], dtype=torch.long))


# -- the engine ----------------------------------------------------------------------------

def test_two_questions_and_narration_from_one_frame(model, tokenizer):
    """One frame starts narration and two questions. Each answer is the greedy text of its
    own [prefix | question] sequence recomputed without a cache, the action chunk equals
    that of a frame without questions, and the prefill ran once."""
    eng = make_engine(model, tokenizer)
    obs = observation(eng.model_cfg, missing=('right_wrist_0_rgb',))
    frame = make_engine(model, tokenizer).frame(obs)  # the tensors the step builds
    qs = ['is the cup in the gripper?', 'what is left to do?']
    ids = [eng.ask(qs[0]), eng.ask(qs[1], max_new_tokens=4)]
    assert len(set(ids)) == 2
    prefills = []
    prefill = model.prefill

    def counted(*a, **kw):
        prefills.append(1)
        return prefill(*a, **kw)

    model.prefill = counted
    try:
        first = eng.step(obs, narrate=True)
    finally:
        del model.prefill
    assert len(prefills) == 1
    narration_id = next(e.request_id for e in first.events if e.kind == 'narration')
    by_id = run_until_done(eng, ids + [narration_id], collect({}, first.events))
    vocab = tokenizer.vocab_size
    for rid, q, n in ((ids[0], qs[0], 6), (ids[1], qs[1], 4)):
        evs = by_id[rid]
        assert {e.kind for e in evs} == {'question'}
        assert all(e.stamp == obs.stamp for e in evs)
        ext = tokenizer.encode(QUESTION_FORMAT.replace('{question}', q), bos=False)
        want = tokenizer.decode(reference_greedy(model, frame, ext, n, vocab))
        assert evs[-1].done and not evs[-1].cancelled and evs[-1].reason == 'budget'
        assert evs[-1].tokens == n and evs[-1].text == want
        assert ''.join(e.delta for e in evs) == want
    # Narration is the plain prefix continued, as before questions existed.
    want = tokenizer.decode(reference_greedy(model, frame, [], 6, vocab))
    assert by_id[narration_id][-1].text == want
    quiet = make_engine(model, tokenizer)
    np.testing.assert_allclose(quiet.step(obs, narrate=True).actions, first.actions,
                               rtol=1e-6, atol=1e-6)
    assert eng.cache.free_rows == eng.cache.max_requests


def test_question_alone_equals_question_batched(model, tokenizer):
    """Asked on its own in a quiet engine or among others in a busy one: the same text."""
    obs = observation(model.cfg, 3)
    alone = make_engine(model, tokenizer, mode='isolated')
    rid = alone.ask('where is the towel?')
    want = next(e for e in alone.step(obs).events if e.request_id == rid and e.done)
    busy = make_engine(model, tokenizer, decode_k=1, max_requests=5)
    for i in range(3):  # narration already in flight from earlier frames
        busy.step(observation(model.cfg, 10 + i), narrate=True)
    other = busy.ask('open the drawer?', max_new_tokens=2)
    rid = busy.ask('where is the towel?')
    events = run_until_done(busy, [rid, other], collect({}, busy.step(obs).events))
    assert events[rid][-1].text == want.text and events[rid][-1].tokens == want.tokens == 6


def test_cancel_between_frames_frees_the_row(model, tokenizer):
    eng = make_engine(model, tokenizer, max_requests=2, max_new_tokens=20, decode_k=1)
    a, b = eng.ask('first?'), eng.ask('second?')
    r = eng.step(observation(model.cfg, 0))
    assert eng.cache.free_rows == 0 and {e.request_id for e in r.events} == {a, b}
    c = eng.ask('third?')
    rejected = [e for e in eng.step(observation(model.cfg, 1)).events if e.request_id == c]
    assert [(e.reason, e.done, e.cancelled) for e in rejected] == [('rejected', True, True)]
    assert 'all 2 KV rows are busy' in rejected[0].message
    text_so_far = [e for e in r.events if e.request_id == a][-1].text
    (ev,) = eng.cancel(a)
    assert (ev.request_id, ev.reason, ev.done, ev.cancelled) == (a, 'cancelled', True, True)
    assert ev.tokens == 2 and ev.text.startswith(text_so_far)
    assert eng.cache.free_rows == 1
    assert eng.cancel(a) == []  # nothing left to cancel
    d = eng.ask('fourth?')
    events = eng.step(observation(model.cfg, 2)).events
    assert a not in {e.request_id for e in events}
    assert [e.tokens for e in events if e.request_id == d] == [1]


def test_cancel_during_a_frame_ends_it_in_that_frame(model, tokenizer):
    eng = make_engine(model, tokenizer, max_requests=1, max_new_tokens=20, decode_k=2)
    a = eng.ask('first?')
    eng.step(observation(model.cfg, 0))
    out = []
    # The action hook runs inside the frame, while the engine owns the scheduler.
    r = eng.step(observation(model.cfg, 1), on_actions=lambda _: out.append(eng.cancel(a)))
    assert out == [[]]
    mine = [e for e in r.events if e.request_id == a]
    assert mine[-1].reason == 'cancelled' and mine[-1].tokens == 4
    assert [e.tokens for e in mine[:-1]] == [3, 4]
    assert eng.cache.free_rows == 1


def test_cancel_from_another_thread_while_stepping(model, tokenizer):
    eng = make_engine(model, tokenizer, max_requests=2, max_new_tokens=30, decode_k=1)
    ids = [eng.ask('first?'), eng.ask('second?')]
    done = threading.Event()
    ended = []

    def cancel_all_soon():
        for rid in ids:
            ended.extend(eng.cancel(rid))
        done.set()

    events = list(eng.step(observation(model.cfg, 0)).events)
    threading.Thread(target=cancel_all_soon).start()
    for i in range(5):
        events += eng.step(observation(model.cfg, i + 1)).events
        if done.is_set():
            break
    assert done.wait(5)
    events += eng.step(observation(model.cfg, 9)).events
    last = {e.request_id: e for e in events + ended}
    assert {i: last[i].reason for i in ids} == {i: 'cancelled' for i in ids}
    assert eng.cache.free_rows == 2


def test_cancel_before_the_frame(model, tokenizer):
    eng = make_engine(model, tokenizer)
    a = eng.ask('first?')
    (ev,) = eng.cancel(a)
    assert (ev.reason, ev.tokens, ev.text, ev.kind) == ('cancelled', 0, '', 'question')
    assert eng.step(observation(model.cfg)).events == []


def test_flood_gets_reasons(model, tokenizer):
    """More questions than rows, under each admission policy: every one ends with a reason
    or its answer, none is lost."""
    for admission in ('reject_newest', 'drop_oldest', 'wait'):
        eng = make_engine(model, tokenizer, max_requests=2, max_new_tokens=3, decode_k=1,
                          admission=admission, max_pending=2)
        ids = [eng.ask(f'question {i}?') for i in range(6)]
        first = eng.step(observation(model.cfg, 0)).events
        events = run_until_done(eng, ids, collect({}, first))
        ends = {i: events[i][-1].reason for i in ids}
        if admission == 'reject_newest':
            assert ends == dict(zip(ids, ['budget'] * 2 + ['rejected'] * 4))
        elif admission == 'drop_oldest':
            # Nothing runs yet when the frame admits them: the first two take the rows,
            # the others find nothing older to drop and are refused.
            assert ends == dict(zip(ids, ['budget'] * 2 + ['rejected'] * 4))
        else:
            # Two rows, two waiting places: the fifth and sixth push the third and fourth
            # out of the queue.
            queued = {e.request_id for e in first if e.reason == 'queued'}
            assert queued == set(ids[2:])
            assert ends == dict(zip(ids, ['budget'] * 2 + ['dropped'] * 2 + ['budget'] * 2))
        for i in ids:
            last = events[i][-1]
            assert last.done
            if last.cancelled:
                assert last.message and last.tokens == 0


def test_drop_oldest_drops_older_questions(model, tokenizer):
    eng = make_engine(model, tokenizer, max_requests=2, max_new_tokens=20, decode_k=1,
                      admission='drop_oldest')
    old = [eng.ask('first?'), eng.ask('second?')]
    eng.step(observation(model.cfg, 0))
    new = eng.ask('third?')
    events = eng.step(observation(model.cfg, 1)).events
    dropped = [e for e in events if e.reason == 'dropped']
    assert [e.request_id for e in dropped] == [old[0]]
    assert 'newer request' in dropped[0].message and dropped[0].tokens == 1
    assert [e.tokens for e in events if e.request_id == new] == [1]


def test_budget_and_end_of_sequence(tokenizer):
    torch.manual_seed(0)
    model = Pi05(load_config('tiny')).to_inference('cpu')
    eng = make_engine(model, tokenizer, stop_at_eos=True)
    logits = model.logits

    def eos_always(hidden):
        out = logits(hidden)
        out[:, tokenizer.eos_id] = out.max() + 1.0
        return out

    model.logits = eos_always
    rid = eng.ask('is it done?')
    (ev,) = [e for e in eng.step(observation(model.cfg)).events if e.request_id == rid]
    assert (ev.done, ev.cancelled, ev.reason, ev.tokens) == (True, False, 'done', 1)
    model.logits = logits
    rid = eng.ask('is it done?', max_new_tokens=2)
    evs = [e for e in eng.step(observation(model.cfg)).events if e.request_id == rid]
    assert [e.tokens for e in evs] == [1, 2] and evs[-1].reason == 'budget'


def test_bad_questions_are_refused_at_once(model, tokenizer):
    eng = make_engine(model, tokenizer, max_question_tokens=8)
    with pytest.raises(ValueError, match='empty'):
        eng.ask('  ')
    with pytest.raises(ValueError, match=r'max_new_tokens must be in \[0, 6\]'):
        eng.ask('why?', max_new_tokens=7)
    with pytest.raises(ValueError, match='exactly once'):
        eng.ask('why?', prompt_format='Q: A:')
    with pytest.raises(ValueError, match='at most 8 fit'):
        eng.ask('pick up the red cup and place it in the bowl')
    # Longer than 8 tokens of the longest piece can be: refused on its characters.
    longest = tokenizer.longest_piece
    with pytest.raises(ValueError, match=rf'over the {8 * longest} taken for '
                       r'max_question_tokens 8 .* refused before tokenizing'):
        eng.ask('pick up the red cup and place it in the bowl on the left please')
    with pytest.raises(ValueError, match='takes no questions'):
        make_engine(model, tokenizer, max_question_tokens=0).ask('why?')
    # A format of its own: the tokens that go after the prefix are exactly its text.
    rid = eng.ask('why?', prompt_format='{question}')
    assert eng._robots[''].inbox[-1].extension == tokenizer.encode('why?', bos=False)
    assert eng._robots[''].inbox[-1].id == rid and eng.stats()['questions_waiting'] == 1


def test_rows_hold_the_longest_question(model, tokenizer):
    """Rows are sized for prefix + question + answer: a question of max_question_tokens
    after the longest prompt still leaves room for the whole answer."""
    eng = make_engine(model, tokenizer, max_question_tokens=12, max_new_tokens=6)
    assert eng.cache.kv.max_len == model.cfg.prefix_len + 12 + 6
    obs = observation(model.cfg)
    obs.prompt = ' '.join(['cup'] * 60)  # truncated to max_token_len
    rid = eng.ask(' '.join(['cup'] * 12), prompt_format='{question}')
    assert len(eng._robots[''].inbox[-1].extension) == 12
    events = run_until_done(eng, [rid], collect({}, eng.step(obs).events))
    assert events[rid][-1].tokens == 6 and events[rid][-1].reason == 'budget'


def test_parallel_mode_answers_questions(model, tokenizer):
    par = make_engine(model, tokenizer, mode='parallel')
    iso = make_engine(model, tokenizer, mode='isolated')
    obs = observation(model.cfg, 4)
    answers = {}
    for eng in (par, iso):
        for q in ('is the cup in the gripper?', 'where is the towel?'):
            rid = eng.ask(q)
            # Both decode a frame's requests to the end within the frame.
            evs = [e for e in eng.step(obs).events if e.request_id == rid]
            # The whole answer as streamed: every delta, the count, how it ended.
            answers[eng.cfg.mode, q] = ([e.delta for e in evs], evs[-1].text, evs[-1].tokens,
                                        evs[-1].done, evs[-1].reason)
    par.scheduler.close()
    for q in ('is the cup in the gripper?', 'where is the towel?'):
        deltas, text, tokens, done, reason = answers['parallel', q]
        assert answers['parallel', q] == answers['isolated', q]
        assert ''.join(deltas) == text and (tokens, done, reason) == (6, True, 'budget')
    # The answers depend on the question, so the comparison above can tell them apart.
    assert answers['isolated', 'is the cup in the gripper?'][1] != \
        answers['isolated', 'where is the towel?'][1]
