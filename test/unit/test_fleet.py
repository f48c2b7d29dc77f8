"""One engine, several robots: a batched frame gives each robot what its frame alone gives,
KV rows are shared under per-robot caps, and one robot's trouble stays its own."""

import numpy as np
import pytest
import torch
from support.models import tiny_model  # noqa: E402

from oxygen_ros.engine import Engine, EngineConfig, Observation, RobotInput
from oxygen_ros.engine.fleet import EveryFrame, Planner, RobotTimes
from oxygen_ros.engine.graphs import power_buckets
from oxygen_ros.model.rtc import Handover
from oxygen_ros.model.tokenizer import Tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope='module')
def model():
    return tiny_model(strong=True)


# Robots whose prefixes differ: cameras present (by slot index) and prompt length.
ROBOTS = {'a': ((0, 1, 2), 'wave'),
          'b': ((1,), 'open the drawer and put the towel inside it, then close it'),
          'c': ((0, 2), 'pick up the cup')}


def observations(cfg, robot, n, seed):
    cams, prompt = ROBOTS.get(robot, ((0,), 'hold'))
    rng = np.random.default_rng(seed)
    size = cfg.vision.image_size
    out = []
    for i in range(n):
        images = {s: rng.integers(0, 256, (size, size, 3), dtype=np.uint8) if j in cams
                  else None for j, s in enumerate(cfg.image_slots)}
        out.append(Observation(stamp=0.1 * i, images=images,
                               state=rng.uniform(-1, 1, 6).astype(np.float32), prompt=prompt))
    return out


def engine(model, **kw):
    cfg = dict(model='tiny', mode='oxygen', decode_k=2, max_requests=4, max_new_tokens=5,
               stop_at_eos=False, prompt_format='subtask', seed=7, compile=False)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg), model=model, tokenizer=Tokenizer.default())


def record_tokens(eng):
    """Greedy token ids per (robot, frame stamp), in emission order, as the scheduler
    emits them."""
    seen = {}
    events = eng.questions.events

    def spy(out):
        for r, t, _, _ in out.tokens:
            seen.setdefault((r.robot, r.stamp), []).append(t)
        return events(out)

    eng.questions.events = spy
    return seen


def handover(robot, i):
    # b and c join each new chunk to the one they execute from frame 2 on; a never does.
    return Handover(start=1, delay=1) if robot != 'a' and i >= 2 else None


@pytest.mark.parametrize('graphs,mode', [(False, 'oxygen'), (True, 'oxygen'),
                                         (False, 'shared_kv'), (False, 'isolated')])
def test_batched_frames_equal_each_robot_alone(model, graphs, mode):
    cfg, n = model.cfg, 5
    obs = {r: observations(cfg, r, n, seed=k) for k, r in enumerate(ROBOTS)}
    rng = np.random.default_rng(9)
    noise = {r: [rng.standard_normal((cfg.action_horizon, cfg.action_dim)).astype(np.float32)
                 for _ in range(n)] for r in ROBOTS}

    # Alone: one plain single-robot engine per robot, eager, the existing API.
    alone_chunks, alone_tokens = {}, {}
    for r in ROBOTS:
        e = engine(model, rtc=True, mode=mode)
        seen = record_tokens(e)
        alone_chunks[r] = [e.step(obs[r][i], narrate=True, noise=noise[r][i],
                                  handover=handover(r, i)).actions for i in range(n)]
        for _ in range(3):  # let the last requests finish
            e.step(obs[r][-1])
        alone_tokens.update({(r, s): t for (_, s), t in seen.items()})
        assert e.guided == (0 if r == 'a' else n - 2)

    fleet = engine(model, rtc=True, graphs=graphs, robots=3, max_requests=12, mode=mode)
    for r in ROBOTS:
        fleet.add_robot(r)
    seen = record_tokens(fleet)
    handed = []
    for i in range(n):
        res = fleet.step_fleet(
            {r: RobotInput(obs[r][i], narrate=True, noise=noise[r][i], handover=handover(r, i))
             for r in ROBOTS}, on_actions=lambda r, a: handed.append((r, a.copy())))
        assert res.errors == {}
        assert res.timing['robots'] == 3
        for r in ROBOTS:
            np.testing.assert_allclose(res.results[r].actions, alone_chunks[r][i],
                                       rtol=1e-5, atol=1e-5, err_msg=f'robot {r} frame {i}')
            assert res.results[r].robot == r
            assert all(ev.robot == r for ev in res.results[r].events)
    for _ in range(3):
        fleet.step_fleet({r: RobotInput(obs[r][-1]) for r in ROBOTS})
    # Every chunk was handed out, as computed, once per robot per frame.
    assert [r for r, _ in handed] == list(ROBOTS) * n
    assert set(seen) == set(alone_tokens) and len(seen) == 3 * n
    for key, tokens in alone_tokens.items():
        assert seen[key] == tokens, key
        assert len(tokens) == 5
    # The text depends on the robot and the frame, so a row mixed up would show.
    assert len({tuple(t) for t in seen.values()}) > 6
    assert fleet.stats()['rtc_frames'] == 2 * (n - 2)
    if graphs:
        static = fleet.scheduler.runner.static
        assert static.denoise_batches == [1, 2, 4]  # three robots run padded to four
        assert (4, static.columns[-1]) in static._denoise


def test_buckets():
    assert power_buckets(1) == [1]
    assert power_buckets(3) == [1, 2, 4]
    assert power_buckets(8) == [1, 2, 4, 8]
    assert power_buckets(5) == [1, 2, 4, 8]


@pytest.mark.parametrize('admission', ['drop_oldest', 'reject_newest', 'wait'])
def test_a_chatty_robot_keeps_to_its_cap(model, admission):
    """Two robots share 4 rows (a fair share of 2 each): the chatty one narrates every
    frame and asks questions, and still never holds more than 2; the quiet one's narration
    gets a row at once, whatever the policy."""
    cfg = model.cfg
    e = engine(model, robots=2, decode_k=1, max_new_tokens=5, max_question_tokens=32,
               admission=admission)
    e.add_robot('chatty')
    e.add_robot('quiet')
    chatty, quiet = observations(cfg, 'a', 10, 0), observations(cfg, 'b', 10, 1)
    events = {'chatty': [], 'quiet': []}
    for i in range(10):
        e.ask('where is the cup?', robot='chatty')
        inputs = {'chatty': RobotInput(chatty[i], narrate=True)}
        if i == 4:
            inputs['quiet'] = RobotInput(quiet[i], narrate=True)
        res = e.step_fleet(inputs)
        assert res.errors == {}
        for r, evs in res.events.items():
            events[r] += evs
        assert e.cache.held('chatty') <= 2
        if i == 4:
            assert res.results['quiet'].rejected is None
            assert e.cache.held('quiet') == 1
    assert e.cache.cap('chatty') == e.cache.cap('quiet') == 2
    ended = [ev for ev in events['chatty'] if ev.cancelled or ev.reason == 'queued']
    assert ended, 'the chatty robot was never held back'
    if admission == 'drop_oldest':
        assert {ev.reason for ev in ended} == {'dropped'}
    elif admission == 'reject_newest':
        assert {ev.reason for ev in ended} == {'rejected'}
        assert all("robot 'chatty' holds its cap of 2" in ev.message for ev in ended)
    else:
        assert 'queued' in {ev.reason for ev in ended}
    # Nothing of the quiet robot's was dropped, refused or queued.
    assert not [ev for ev in events['quiet'] if ev.cancelled or ev.reason == 'queued']
    assert [ev.tokens for ev in events['quiet'] if ev.done] == [5]


def test_cap_given_per_robot(model):
    e = engine(model, robots=2, max_requests=6, admission='reject_newest', decode_k=1)
    e.add_robot('big', max_rows=5)
    e.add_robot('small', max_rows=1)
    assert (e.cache.cap('big'), e.cache.cap('small')) == (5, 1)
    big, small = observations(e.model_cfg, 'a', 4, 0), observations(e.model_cfg, 'c', 4, 1)
    rejected = {'big': 0, 'small': 0}
    for i in range(4):
        res = e.step_fleet({'big': RobotInput(big[i], narrate=True),
                            'small': RobotInput(small[i], narrate=True)})
        for r in rejected:
            rejected[r] += res.results[r].rejected is not None
    assert rejected == {'big': 0, 'small': 3}
    assert e.cache.held('big') == 4 and e.cache.held('small') == 1
    with pytest.raises(ValueError, match='max_rows'):
        e.add_robot('huge', max_rows=7)


def test_a_robot_left_out_keeps_decoding_and_never_stalls_the_others(model):
    """A robot without a fresh observation is not in the frame; the others are, and its
    narration already running goes on in the shared decode batch."""
    cfg = model.cfg
    e = engine(model, robots=3, max_requests=9, decode_k=1)
    for r in ROBOTS:
        e.add_robot(r)
    obs = {r: observations(cfg, r, 4, k) for k, r in enumerate(ROBOTS)}
    three = e.step_fleet({r: RobotInput(obs[r][0], narrate=True) for r in ROBOTS})
    two = []
    for i in range(1, 4):
        res = e.step_fleet({r: RobotInput(obs[r][i], narrate=True) for r in ('a', 'c')})
        two.append(res.timing['chunk_ms'] / 1e3)
        assert set(res.results) == {'a', 'c'} and res.errors == {}
        # b's request of frame 0 still decodes with theirs.
        assert [ev.stamp for ev in res.events['b']] == [0.0]
    assert e._robots['b'].frames == 1 and e._robots['a'].frames == 4
    # The planner's estimate: the slowest measured frame of that many robots, else the
    # next larger size's, else scaled up from the largest.
    assert e.chunk_seconds(3) == pytest.approx(three.timing['chunk_ms'] / 1e3)
    assert e.chunk_seconds(2) == pytest.approx(max(two)) and min(two) > 0
    assert e.chunk_seconds(1) == e.chunk_seconds(2)
    assert e.chunk_seconds(6) == pytest.approx(2 * e.chunk_seconds(3))


def test_one_robots_bad_input_fails_only_that_robot(model):
    cfg = model.cfg
    good = {r: observations(cfg, r, 1, k)[0] for k, r in enumerate(ROBOTS)}
    rng = np.random.default_rng(3)
    noise = {r: rng.standard_normal((cfg.action_horizon, cfg.action_dim)).astype(np.float32)
             for r in ROBOTS}
    e = engine(model, robots=3, max_requests=8)
    for r in list(ROBOTS) + ['nan_state', 'gray', 'bad_noise', 'bad_tokens', 'bad_slot',
                             'extra']:
        e.add_robot(r)
    o = good['a']
    size = cfg.vision.image_size
    gray = dict(o.images, base_0_rgb=np.zeros((size, size), np.uint8))
    inputs = {r: RobotInput(good[r], narrate=True, noise=noise[r]) for r in ROBOTS}
    inputs.update(
        nan_state=RobotInput(Observation(0.0, o.images, np.array([0.1, np.nan]), o.prompt)),
        gray=RobotInput(Observation(0.0, gray, o.state, o.prompt)),
        bad_noise=RobotInput(o, noise=np.zeros((2, 2), np.float32)),
        bad_tokens=RobotInput(o, narrate=True, max_new_tokens=99),
        bad_slot=RobotInput(Observation(0.0, {'nose_cam': o.images['base_0_rgb']}, o.state,
                                        o.prompt)),
        stranger=RobotInput(o),
        extra=RobotInput(good['a']))  # valid, but past the engine's 3 robots a frame
    res = e.step_fleet(inputs)
    assert set(res.results) == set(ROBOTS)
    assert set(res.errors) == {'nan_state', 'gray', 'bad_noise', 'bad_tokens', 'bad_slot',
                               'stranger', 'extra'}
    assert 'full' in res.errors['extra']
    assert 'finite' in res.errors['nan_state'] and 'HxWx3' in res.errors['gray']
    assert 'noise' in res.errors['bad_noise'] and 'max_new_tokens' in res.errors['bad_tokens']
    assert 'nose_cam' in res.errors['bad_slot'] and 'unknown robot' in res.errors['stranger']
    for r in ROBOTS:
        alone = engine(model).step(good[r], noise=noise[r]).actions
        np.testing.assert_allclose(res.results[r].actions, alone, rtol=1e-5, atol=1e-5)
    # Only the good robots' narrations took rows.
    assert e.cache.held('a') == e.cache.held('b') == e.cache.held('c') == 1
    assert len(e.scheduler.active) == 3


def test_model_failure_on_one_robot_stays_with_it(model):
    """The model raising on a batch is retried robot by robot: the robot it fails on
    errors (its question waits for its next frame), the others get their chunks."""
    cfg = model.cfg
    e = engine(model, robots=3, max_requests=6, max_question_tokens=32)
    for r in ROBOTS:
        e.add_robot(r)
    obs = {r: observations(cfg, r, 1, k)[0] for k, r in enumerate(ROBOTS)}
    # The model fails on any batch holding c's observation (its prompt's tokens).
    poison = torch.from_numpy(e.tokenizer.tokenize(e.inputs.observation(obs['c'])[2],
                                                   cfg.max_token_len)[0])
    prefill = model.prefill

    def failing(images, image_mask, tokens, token_mask, kv, rows):
        if (tokens == poison).all(1).any():
            raise RuntimeError('device lost')
        return prefill(images, image_mask, tokens, token_mask, kv, rows)
    e.ask('where is the cup?', robot='c')
    e.ask('is the drawer open?', robot='b')
    model.prefill = failing
    try:
        res = e.step_fleet({r: RobotInput(obs[r], narrate=True) for r in ROBOTS})
    finally:
        del model.prefill
    assert set(res.results) == {'a', 'b'}
    assert list(res.errors) == ['c'] and 'device lost' in res.errors['c']
    assert e.stats()['questions_waiting'] == 1 and e._robots['c'].inbox
    # b's question and both narrations run; no row was lost to the failed batch.
    assert e.cache.held('b') == 2 and e.cache.held('a') == 1
    assert e.cache.free_rows == 6 - 3
    assert e.robot_stats('c') == dict(frames=0, errors=1, rtc_frames=0, kv_rows=0,
                                      kv_row_cap=2, active_requests=0, pending_requests=0,
                                      questions_waiting=1)
    assert e.robot_stats('b')['kv_rows'] == e.robot_stats('b')['active_requests'] == 2


# -- planning frames over robots, on a fake clock --------------------------------------

def times(runs_out, stamp):
    return RobotTimes(runs_out=runs_out, stamp=stamp)


def test_planner_takes_the_due_and_those_due_before_the_frame_ends():
    est = {1: 0.04, 2: 0.05, 3: 0.06}
    p = Planner(lambda n: est.get(n), max_input_age=0.1)
    now = 10.0
    robots = {'early': times(now + 0.039, now), 'soon': times(now + 0.07, now),
              'later': times(now + 0.2, now)}
    plan = p.plan(now, robots)
    # early is due (0.039 s left < 0.04 s to a chunk); soon would come due during the
    # frame (0.07 < 2 x 0.05 for a frame of two); later is not due.
    assert plan.take == ['early', 'soon'] and plan.estimate == pytest.approx(0.05)
    robots['early'] = times(now + 0.041, now)  # not due yet: wait until it is
    plan = p.plan(now, robots)
    assert plan.take == [] and plan.wait == pytest.approx(0.001)
    # A robot with no chunk yet is due at once; nothing known: `first` stands in.
    unknown = Planner(lambda n: None, max_input_age=0.1, first=0.02)
    assert unknown.plan(now, {'new': times(None, now)}).take == ['new']


def test_planner_leaves_stale_robots_out():
    p = Planner(lambda n: 0.04, max_input_age=0.1)
    now = 5.0
    plan = p.plan(now, {'fresh': times(now + 0.01, now - 0.05),
                        'stale': times(now + 0.01, now - 0.3),
                        'blind': times(None, None)})
    assert plan.take == ['fresh']
    assert 'old' in plan.left_out['stale'] and 'no observation' in plan.left_out['blind']
    # Only stale robots due: no frame, and the wait is a poll, not their deadline.
    plan = p.plan(now, {'stale': times(now + 0.01, now - 0.3)})
    assert plan.take == [] and plan.wait == p.poll
    # Due, only its next observation missing: look for it every `look`; not due yet: wait
    # until it is (its chunk runs out 0.08 s from now, a frame takes 0.04 s).
    plan = p.plan(now, {'waiting': times(now + 0.01, None)})
    assert plan.take == [] and plan.wait == p.look == 0.002
    plan = p.plan(now, {'waiting': times(now + 0.08, None), 'fresh': times(now + 0.3, now)})
    assert plan.take == [] and plan.wait == pytest.approx(0.04)
    with pytest.raises(ValueError, match='look'):
        Planner(lambda n: 0.04, max_input_age=0.1, look=0.1)
    full = Planner(lambda n: 0.04, max_input_age=0.1, max_robots=1)
    plan = full.plan(now, {'x': times(now, now), 'y': times(now + 0.01, now)})
    assert plan.take == ['x'] and 'full' in plan.left_out['y']


def test_planned_fleet_on_a_fake_clock():
    """Three robots at different control rates, frames whose duration grows with the
    batch; one robot's camera stops at t = 1 s. Every fresh robot gets each chunk before
    its last one runs out; the stopped robot is never taken once stale and holds; frames
    batch robots together."""
    period = {'a': 0.010, 'b': 0.014, 'c': 0.02}  # control periods
    chunk = {r: 10 * p for r, p in period.items()}  # seconds a chunk lasts
    cost = {1: 0.03, 2: 0.036, 3: 0.042}  # frame start to chunk, by robots in the frame
    seen = {}

    def estimate(n):
        return max(seen[n]) if n in seen else None

    p = Planner(estimate, max_input_age=0.05, first=0.05, max_robots=3)
    now, runs_out = 0.0, {r: None for r in period}
    sizes, served, misses = [], {r: 0 for r in period}, []
    while now < 4.0:
        stamps = {r: now - 0.003 if r != 'c' or now < 1.0 else 1.0 - 0.003 for r in period}
        plan = p.plan(now, {r: times(runs_out[r], stamps[r]) for r in period})
        if not plan.take:
            assert plan.wait > 0
            now += plan.wait
            continue
        assert plan.wait == 0.0
        took = cost[len(plan.take)]
        seen.setdefault(len(plan.take), []).append(took)
        now += took
        for r in plan.take:
            if runs_out[r] is not None and runs_out[r] < now:
                misses.append((r, runs_out[r], now))
            runs_out[r] = now + chunk[r]
            served[r] += 1
        sizes.append(len(plan.take))
    assert misses == []
    # c got frames until its camera stopped, then none (and it was left out, not waited on).
    assert 3 <= served['c'] <= 1.0 / chunk['c'] + 2
    assert served['a'] >= 3.9 / chunk['a'] - 1 and served['b'] >= 3.9 / chunk['b'] - 1
    assert max(sizes) >= 2  # robots were batched


def test_every_frame_takes_a_fresh_robot_at_once_whatever_its_chunk():
    # One robot: a frame starts as soon as its images are complete, though its chunk runs
    # on for seconds (the Planner would wait until it is due).
    now = 3.0
    robots = {'one': times(now + 5.0, now - 0.01)}
    assert Planner(lambda n: 0.04, max_input_age=0.1).plan(now, robots).take == []
    plan = EveryFrame(max_input_age=0.1).plan(now, robots)
    assert plan.take == ['one'] and plan.wait == 0.0
    # Nothing new, or only stale inputs: no frame, and it looks again after `look`.
    for t in (times(now + 5.0, None), times(now + 5.0, now - 0.3), times(None, now + 0.3)):
        plan = EveryFrame(max_input_age=0.1, look=0.003).plan(now, {'one': t})
        assert plan.take == [] and plan.wait == 0.003
    # Several fresh: the most urgent first, up to max_robots; the rest are said left out.
    plan = EveryFrame(max_input_age=0.1, max_robots=2).plan(
        now, {'a': times(now + 0.5, now), 'b': times(None, now), 'c': times(now + 0.2, now)})
    assert plan.take == ['b', 'c'] and 'full' in plan.left_out['a']
    with pytest.raises(ValueError):
        EveryFrame(max_input_age=0.0)


def test_a_frame_is_two_calls_with_the_chunks_out_between(model):
    # actions() gives the chunks before any language runs; language() then decodes. The
    # same frame in one call (step_fleet) gives the same chunks and text.
    one, two = engine(model, robots=2), engine(model, robots=2)
    for e in (one, two):
        e.add_robot('a')
        e.add_robot('b')
    obs = {r: observations(model.cfg, r, 3, seed=i) for i, r in enumerate('ab')}
    for i in range(3):
        inputs = {r: RobotInput(obs[r][i], narrate=True) for r in 'ab'}
        frame = one.actions(inputs)
        assert sorted(frame.chunks) == ['a', 'b'] and not frame.result.results
        assert one.scheduler.active == [] or i > 0  # nothing decoded before language
        split = one.language(frame)
        whole = two.step_fleet(inputs)
        for r in 'ab':
            np.testing.assert_array_equal(frame.chunks[r], whole.results[r].actions)
            assert split.results[r].actions is frame.chunks[r]
        assert [(ev.robot, ev.text) for evs in split.events.values() for ev in evs] == \
            [(ev.robot, ev.text) for evs in whole.events.values() for ev in evs]


def test_a_cancel_between_the_calls_waits_for_language_and_abandon_requeues(model):
    e = engine(model, max_question_tokens=32)
    e.add_robot('a')
    obs = observations(model.cfg, 'a', 4, seed=3)
    first = e.ask('what is here?', robot='a')
    frame = e.actions({'a': RobotInput(obs[0])})
    # The frame owns the scheduler: the cancel is left for it, and comes with its events.
    assert e.cancel(first) == []
    done = e.language(frame)
    assert [(ev.request_id, ev.reason) for ev in done.events['a'] if ev.done] == \
        [(first, 'cancelled')]
    # A frame abandoned after its chunks (its caller failed): its rows are free again and
    # its question waits for the next frame, which starts it.
    second = e.ask('and now?', robot='a')
    frame = e.actions({'a': RobotInput(obs[1])})
    rows = e.cache.free_rows
    e.abandon(frame)
    assert e.cache.free_rows == rows + 1 and e.robot_stats('a')['questions_waiting'] == 1
    out = e.step_fleet({'a': RobotInput(obs[2])})
    assert {ev.request_id for ev in out.events['a']} == {second}
    assert e.robot_stats('a')['questions_waiting'] == 0


def test_figures_without_samples_are_left_out(model):
    """Before a robot has ticked or had a chunk, and before the engine has run a frame,
    there is no jitter, latency or frame time to report: those figures are absent from
    the summaries (and so from /diagnostics and oxygen-eval's report), not 0 ms."""
    from oxygen_ros.robot.stats import RobotStats

    s = RobotStats()
    out = s.summary(50.0, 100.0)
    for key in ('tick_jitter_ms_p99', 'tick_gap_ms_max', 'action_latency_ms_p50',
                'action_latency_ms_p99', 'chunk_interval_ms_p99'):
        assert key not in out, key
    s.tick(0.0, 0.02)
    s.tick(0.023, 0.02)  # 3 ms late
    s.chunk(0.05)
    out = s.summary(50.0, 100.0)
    assert out['tick_gap_ms_max'] == pytest.approx(23.0)
    assert out['tick_jitter_ms_p99'] == pytest.approx(3.0)
    assert out['action_latency_ms_p50'] == out['action_latency_ms_p99'] == pytest.approx(50.0)
    assert 'chunk_interval_ms_p99' not in out  # one chunk: no interval yet
    e = engine(model, max_requests=1)
    assert not {'frame_ms_p50', 'frame_ms_p99', 'action_hz', 'tokens_per_s'} & e.stats().keys()
