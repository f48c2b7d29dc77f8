"""The engine schedules the same model computations differently; results must not change."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from support.models import tiny_model  # noqa: E402

from oxygen_ros.engine import AdaptiveK, Engine, EngineConfig, KVCache, Observation
from oxygen_ros.engine.requests import Request, sample
from oxygen_ros.model import Pi05, load_config
from oxygen_ros.model.processing import NormStats
from oxygen_ros.model.tokenizer import Tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope='module')
def model():
    torch.manual_seed(0)
    return Pi05(load_config('tiny')).to_inference(torch.device('cpu'), torch.float32).eval()


@pytest.fixture(scope='module')
def tokenizer():
    return Tokenizer.default()


def make_engine(model, tokenizer, norm_stats=None, **kw):
    cfg = dict(model='tiny', mode='oxygen', decode_k=2, max_requests=4, max_new_tokens=5,
               stop_at_eos=False, prompt_format='subtask', seed=7, compile=False)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg), model=model, tokenizer=tokenizer, norm_stats=norm_stats)


PROMPTS = ['pick up the cup', 'open the drawer and put the towel inside', 'wave']


def observations(model_cfg, n, seed=0, missing=()):
    rng = np.random.default_rng(seed)
    size = model_cfg.vision.image_size
    for i in range(n):
        images = {s: None if s in missing else
                  rng.integers(0, 256, (size + 8, size, 3), dtype=np.uint8)
                  for s in model_cfg.image_slots}
        yield Observation(stamp=float(i), images=images,
                          state=rng.uniform(-1, 1, 6).astype(np.float32),
                          prompt=PROMPTS[i % len(PROMPTS)])


def run(engine, n, narrate=lambda i: True, missing=()):
    actions, texts, tokens, events = [], {}, {}, []
    for i, obs in enumerate(observations(engine.model_cfg, n, missing=missing)):
        r = engine.step(obs, narrate=narrate(i))
        actions.append(r.actions)
        events += r.events
    for e in events:
        texts[e.stamp] = e.text
        tokens.setdefault(e.stamp, []).append(e)
    return actions, texts, tokens, events


@pytest.mark.parametrize('k', [1, 2, 0])
def test_oxygen_matches_isolated(model, tokenizer, k):
    n = 9
    iso = make_engine(model, tokenizer, mode='isolated')
    # A budget no frame can miss: adaptive k then paces by the rows alone, whatever the
    # machine's speed (the deadline side has tests of its own below).
    oxy = make_engine(model, tokenizer, mode='oxygen', decode_k=k, max_requests=6,
                      frame_budget_ms=1e6)
    a_iso, t_iso, _, _ = run(iso, n, missing=('right_wrist_0_rgb',))
    a_oxy, t_oxy, by_stamp, _ = run(oxy, n + 6, missing=('right_wrist_0_rgb',))
    for i in range(n):
        np.testing.assert_allclose(a_oxy[i], a_iso[i], rtol=1e-5, atol=1e-5)
    # Every one of the first n requests finishes with the text isolated decoding gives,
    # although in oxygen mode they were decoded across frames, batched with others.
    for stamp in range(n):
        last = by_stamp[float(stamp)][-1]
        assert last.done and not last.cancelled and last.tokens == 5
        assert t_oxy[float(stamp)] == t_iso[float(stamp)]
    assert len(t_iso[0.0]) > 0


def test_requests_span_frames_and_batch(model, tokenizer):
    eng = make_engine(model, tokenizer, decode_k=2, max_new_tokens=6)
    seen_batches = []
    for obs in observations(eng.model_cfg, 6):
        r = eng.step(obs, narrate=True)
        seen_batches += r.timing['batches']
    # T=6, k=2: a request lives 3 frames, so steady state decodes 3 requests per step.
    assert max(seen_batches) == 3


def test_stream_deltas_concatenate(tokenizer):
    # Layers strong enough that the text depends on the frame (test_questions.make_model),
    # so a wrong token shows in the text.
    model = tiny_model(strong=True)
    eng = make_engine(model, tokenizer, max_new_tokens=7, decode_k=3)
    _, texts, by_stamp, _ = run(eng, 8)
    # The reference: each frame's text decoded whole within its own frame.
    _, whole, _, _ = run(make_engine(model, tokenizer, mode='isolated', max_new_tokens=7), 8)
    # 7 tokens at k=3 take 3 frames (3 + 3 + 1): the requests of frames 0-5 finish within the
    # 8 frames, the one of frame 6 has 6 tokens and the one of frame 7 has 3.
    assert sorted(by_stamp) == [float(i) for i in range(8)]
    assert [s for s, evs in by_stamp.items() if evs[-1].done] == [float(i) for i in range(6)]
    for stamp, evs in by_stamp.items():
        n = 7 if stamp < 6 else {6.0: 6, 7.0: 3}[stamp]
        assert [e.tokens for e in evs] == list(range(1, n + 1))
        assert [e.done for e in evs] == [False] * (n - 1) + [n == 7]
        assert not any(e.cancelled for e in evs)
        assert ''.join(e.delta for e in evs) == evs[-1].text == texts[stamp]
        if n == 7:
            assert texts[stamp] == whole[stamp]
        else:
            assert whole[stamp].startswith(texts[stamp])
    assert all(whole.values()) and len(set(whole.values())) > 2


def test_actions_identical_with_and_without_language(model, tokenizer):
    quiet = make_engine(model, tokenizer)
    busy = make_engine(model, tokenizer, max_requests=2, max_new_tokens=20, decode_k=1)
    a_quiet, *_ = run(quiet, 6, narrate=lambda i: False)
    a_busy, *_ = run(busy, 6)
    for x, y in zip(a_quiet, a_busy):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_slots_are_reused(model, tokenizer):
    eng = make_engine(model, tokenizer, max_requests=2, max_new_tokens=2, decode_k=2)
    ids = set()
    for obs in observations(eng.model_cfg, 10):
        r = eng.step(obs, narrate=True)
        ids |= {e.request_id for e in r.events}
        # Each request finishes inside the frame that started it: both rows free again.
        assert eng.cache.free_rows == 2
    assert len(ids) == 10
    assert eng.stats()['dropped_requests'] == 0


def test_flood_drop_oldest(model, tokenizer):
    eng = make_engine(model, tokenizer, max_requests=2, max_new_tokens=30, decode_k=1)
    _, _, by_stamp, events = run(eng, 6)
    s = eng.stats()
    assert s['active_requests'] == 2 and s['dropped_requests'] == 4
    cancelled = [e for e in events if e.cancelled]
    assert sorted(e.stamp for e in cancelled) == [0.0, 1.0, 2.0, 3.0]
    assert all(e.done for e in cancelled)


def test_flood_reject_newest(model, tokenizer):
    eng = make_engine(model, tokenizer, max_requests=2, max_new_tokens=30, decode_k=1,
                      admission='reject_newest')
    rejected = []
    for obs in observations(eng.model_cfg, 5):
        r = eng.step(obs, narrate=True)
        if r.rejected:
            rejected.append(obs.stamp)
            assert 'KV rows are busy' in r.rejected
    assert rejected == [2.0, 3.0, 4.0]
    assert sorted(r.stamp for r in eng.scheduler.active) == [0.0, 1.0]


def test_flood_wait_serves_later(model, tokenizer):
    eng = make_engine(model, tokenizer, max_requests=1, max_new_tokens=2, decode_k=1,
                      admission='wait')
    done = []
    for obs in observations(eng.model_cfg, 4):
        r = eng.step(obs, narrate=True)
        done += [e.stamp for e in r.events if e.done]
    for _ in range(8):
        r = eng.step(next(observations(eng.model_cfg, 1, seed=3)), narrate=False)
        done += [e.stamp for e in r.events if e.done]
    # One slot, two tokens per request, one token per frame: requests queue and all finish,
    # oldest first.
    assert done == [0.0, 1.0, 2.0, 3.0]


def test_kv_bytes_reported(model):
    cfg = model.cfg
    cache = KVCache(cfg, max_requests=3, max_new_tokens=10)
    max_len = cfg.prefix_len + 10
    per_row_kv = 2 * cfg.vlm.depth * cfg.vlm.kv_heads * max_len * cfg.vlm.head_dim * 4
    assert cache.kv.rows == 4  # three request rows and the scratch row
    assert cache.bytes_per_slot >= per_row_kv
    assert cache.total_bytes == cache.bytes_per_slot * 4
    rows = [cache.alloc() for _ in range(3)]
    assert rows == [0, 1, 2] and cache.alloc() is None
    cache.free(1)
    assert cache.alloc() == 1
    with pytest.raises(ValueError, match='not a request row'):
        cache.free(3)


def test_seeded_engines_agree(model, tokenizer):
    a, *_ = run(make_engine(model, tokenizer), 3)
    b, *_ = run(make_engine(model, tokenizer), 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    c, *_ = run(make_engine(model, tokenizer, seed=8), 1)
    assert not np.allclose(a[0], c[0])


def test_frame_noise_follows_the_stamp_not_the_stream(model, tokenizer):
    """Under frame_noise a frame's chunk depends on its inputs and stamp alone: an engine
    that skipped the frames before (as a replay that starts late does) gives the same chunk,
    while one random stream would not."""
    obs = list(observations(model.cfg, 3))

    def chunks(engine, frames):
        return [engine.step(o).actions for o in frames]

    a = chunks(make_engine(model, tokenizer, frame_noise=True), obs)
    b = chunks(make_engine(model, tokenizer, frame_noise=True), obs[2:])
    np.testing.assert_array_equal(a[2], b[0])
    c = chunks(make_engine(model, tokenizer), obs[2:])  # one stream: its first draw
    assert not np.allclose(a[2], c[0])
    d = chunks(make_engine(model, tokenizer, frame_noise=True, seed=8), obs[2:])
    assert not np.allclose(a[2], d[0])
    # Two frames with the same inputs but other stamps get other noise.
    moved = dataclasses.replace(obs[2], stamp=obs[2].stamp + 0.02)
    e = chunks(make_engine(model, tokenizer, frame_noise=True), [moved])
    assert not np.allclose(a[2], e[0])


def test_bad_config_values():
    with pytest.raises(ValueError, match='mode'):
        EngineConfig(mode='fast')
    with pytest.raises(ValueError, match='admission'):
        EngineConfig(admission='random')
    with pytest.raises(ValueError, match='unknown engine settings'):
        EngineConfig.from_dict({'decode_steps': 3})
    with pytest.raises(ValueError, match='max_new_tokens'):
        EngineConfig(max_new_tokens=0)


def test_adaptive_k_never_exceeds_budget():
    """A simulated frame: prefill + denoise with jitter, then decode steps whose cost grows
    with the batch, in a steady stream of requests of T tokens."""
    rng = np.random.default_rng(0)
    budget, T = 143.0, 30
    ak = AdaptiveK(budget, k_max=T)

    def step_ms(b):
        return 4.0 + 0.6 * b

    # Calibration, as the engine's first frames give it.
    for b in (1, 8):
        ak.observe(b, step_ms(b))
    active, total_tokens, frames = [], 0, 200
    for _ in range(frames):
        elapsed = 60.0 + rng.uniform(0, 25.0)
        active.append(T)
        k = 0
        while active and ak.fits(elapsed, k, len(active)):
            ms = step_ms(len(active))
            ak.observe(len(active), ms)
            elapsed += ms
            active = [n - 1 for n in active if n > 1]
            total_tokens += 1
            k += 1
        assert elapsed <= budget
        # The slack is used: stopping leaves less than two steps of time unused.
        if active:
            assert elapsed + 2 * step_ms(len(active)) > budget
    assert total_tokens > 0


def test_adaptive_k_first_frame_takes_one_step():
    ak = AdaptiveK(100.0, k_max=5)
    assert ak.fits(10.0, 0, 3)
    assert not ak.fits(10.0, 1, 3)
    ak.observe(3, 20.0)
    assert ak.estimate(3) == 20.0 and ak.estimate(2) == 20.0 and ak.estimate(6) == 40.0


def test_adaptive_k_paces_requests_to_the_rows(model, tokenizer):
    # 4 rows: each request must finish within 3 frames, so 9 tokens need k = 3 every frame.
    eng = make_engine(model, tokenizer, decode_k=0, max_requests=4, max_new_tokens=9,
                      frame_budget_ms=1e6)
    ks = [eng.step(obs, narrate=True).timing['k'] for obs in observations(eng.model_cfg, 8)]
    assert ks == [3] * 8
    assert eng.stats()['dropped_requests'] == 0


def test_adaptive_k_yields_to_the_deadline(model, tokenizer):
    # A budget already spent by prefill and denoising leaves language one learning step.
    eng = make_engine(model, tokenizer, decode_k=0, max_requests=4, max_new_tokens=9,
                      frame_budget_ms=1e-3)
    ks = [eng.step(obs, narrate=True).timing['k'] for obs in observations(eng.model_cfg, 4)]
    assert ks == [1, 0, 0, 0]


def test_eos_ends_a_request_only_when_asked():
    r = Request(stamp=0.0, max_new_tokens=5, stop_at_eos=True, eos_id=1)
    r.append(7)
    assert not r.finished and r.needs_pass
    r.append(1)
    assert r.finished and not r.needs_pass and r.tokens == [7, 1]
    r = Request(stamp=0.0, max_new_tokens=3, stop_at_eos=False, eos_id=1)
    r.append(1)
    r.append(1)
    assert not r.finished
    r.append(1)
    assert r.finished and len(r.tokens) == 3


def test_engine_stops_at_eos(tokenizer):
    torch.manual_seed(0)
    model = Pi05(load_config('tiny')).to_inference('cpu')
    logits = model.logits

    def eos_always(hidden):
        out = logits(hidden)
        out[:, tokenizer.eos_id] = out.max() + 1.0
        return out

    model.logits = eos_always
    for stop, tokens in ((True, 1), (False, 5)):
        eng = make_engine(model, tokenizer, stop_at_eos=stop, decode_k=5)
        evs = eng.step(next(observations(eng.model_cfg, 1)), narrate=True).events
        assert [e.tokens for e in evs] == list(range(1, tokens + 1))
        assert evs[-1].done and not evs[-1].cancelled and evs[-1].text == ''
        assert eng.cache.free_rows == eng.cache.max_requests


def test_sampling_follows_temperature_and_vocab_limit():
    # logits [0, ln 3]: temperature 1 gives p = (1/4, 3/4), temperature 0.5 squares the
    # odds: (1/10, 9/10).
    n = 2000
    logits = torch.tensor([[0.0, math.log(3.0)]]).repeat(n, 1)
    for temp, p1 in ((1.0, 0.75), (0.5, 0.9)):
        reqs = [Request(stamp=0.0, temperature=temp, seed=3) for _ in range(n)]
        freq = sum(sample(logits, reqs)) / n
        assert abs(freq - p1) < 0.04, (temp, freq)
    # Greedy, and never an id past the limit even where it scores highest.
    reqs = [Request(stamp=0.0), Request(stamp=0.0, temperature=2.0)]
    big = torch.tensor([[0.0, 1.0, 0.5, 9.0], [0.0, 0.0, 0.0, 50.0]])
    assert sample(big[:1], reqs[:1]) == [3]
    assert sample(big[:1], reqs[:1], vocab_limit=3) == [1]
    assert all(sample(big[1:], reqs[1:], vocab_limit=3)[0] < 3 for _ in range(50))
    # The same request seed gives the same draws whatever else is in the batch.
    a, b = Request(stamp=0.0, temperature=1.0, seed=5), Request(stamp=0.0, temperature=1.0)
    a2 = Request(stamp=0.0, temperature=1.0, seed=5, id=a.id)
    flat = torch.zeros(2, 64)
    draws = [sample(flat, [a, b])[0] for _ in range(5)]
    assert draws == [sample(flat[:1], [a2])[0] for _ in range(5)]
    assert len(set(draws)) > 1


def test_missing_camera_is_masked_not_encoded(model, tokenizer):
    eng = make_engine(model, tokenizer)
    obs = next(observations(eng.model_cfg, 1, missing=('left_wrist_0_rgb',)))
    f = eng.frame(obs)
    assert f.image_mask.tolist() == [[True, False, True]]
    assert (f.images[0, 1] == 0).all()
    with pytest.raises(ValueError, match='unknown image slots'):
        eng.frame(Observation(0.0, {'top': None}, np.zeros(6, np.float32), 'wave'))


# q01/q99 of -2/2 on every state dim: normalised state = state / 2 (the 1e-6 in the
# denominator moves nothing across a bin edge here).
NORM = {'state': {'mean': [0.0] * 6, 'std': [1.0] * 6, 'q01': [-2.0] * 6, 'q99': [2.0] * 6},
        'actions': {'mean': [0.0] * 3, 'std': [1.0] * 3, 'q01': [-1.0, 0.0, 10.0],
                    'q99': [1.0, 4.0, 20.0]}}


def test_pi05_prompt_carries_the_normalised_state(tokenizer):
    # Room for the whole prompt (the tiny config keeps 24 tokens).
    model = Pi05(load_config('tiny', max_token_len=80))
    eng = make_engine(model, tokenizer, prompt_format='pi05',
                      norm_stats=NormStats.from_dict(NORM))
    state = np.array([0.6, -1.1, 3.0, -3.0, 0.1, 1.9], np.float32)
    obs = Observation(0.0, {}, state, 'pick_up the cup')
    f = eng.frame(obs)
    text = tokenizer.decode(f.tokens[0][f.token_mask[0]].tolist())
    # state / 2 = 0.3 -0.55 1.5 -1.5 0.05 0.95 -> bins floor((x + 1) * 128), -1 below -1,
    # 255 from 1 up.
    assert text.startswith('Task: pick up the cup, State: 166 57 255 -1 134 249')
    assert text.endswith(';\nAction: ')


def test_actions_are_unnormalised(model, tokenizer):
    plain = make_engine(model, tokenizer)
    normed = make_engine(model, tokenizer, norm_stats=NormStats.from_dict(NORM))
    obs = next(observations(model.cfg, 1))
    raw = plain.step(obs).actions
    got = normed.step(obs).actions
    # (a + 1) / 2 * (q99 - q01 + 1e-6) + q01 on the 3 dims with stats, the rest untouched.
    expected = raw.astype(np.float64).copy()
    for i, (lo, hi) in enumerate(((-1.0, 1.0), (0.0, 4.0), (10.0, 20.0))):
        expected[:, i] = (raw[:, i] + 1.0) / 2.0 * (hi - lo + 1e-6) + lo
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got[:, :3], raw[:, :3])


def test_adaptive_k_paces_one_request_evenly(model, tokenizer):
    # 4 rows, 9 tokens: one request alone still spreads over 3 frames (3, 3, 3), then
    # nothing is left to decode.
    eng = make_engine(model, tokenizer, decode_k=0, max_requests=4, max_new_tokens=9,
                      frame_budget_ms=1e6)
    ks = [eng.step(obs, narrate=i == 0).timing['k']
          for i, obs in enumerate(observations(eng.model_cfg, 5))]
    assert ks == [3, 3, 3, 0, 0]


def test_mixed_lengths_share_a_batch(model, tokenizer):
    """Requests of different prompts and different token budgets decode together, each
    exactly as it would alone."""
    lengths = [6, 2, 4, 6, 3]
    batched = make_engine(model, tokenizer, decode_k=1, max_new_tokens=6, max_requests=6)
    texts, batches = {}, []
    for obs, n in zip(observations(batched.model_cfg, 5), lengths):
        r = batched.step(obs, narrate=True, max_new_tokens=n)
        batches += r.timing['batches']
        texts.update({e.stamp: e for e in r.events if e.done})
    for _ in range(6):
        r = batched.step(next(observations(batched.model_cfg, 1, seed=9)))
        texts.update({e.stamp: e for e in r.events if e.done})
    assert max(batches) >= 3
    for i, n in enumerate(lengths):
        alone = make_engine(model, tokenizer, mode='isolated', max_new_tokens=6)
        obs = list(observations(alone.model_cfg, i + 1))[-1]
        done = [e for e in alone.step(obs, narrate=True, max_new_tokens=n).events if e.done]
        assert texts[float(i)].tokens == n == done[0].tokens
        assert texts[float(i)].text == done[0].text
    with pytest.raises(ValueError, match='max_new_tokens'):
        batched.step(next(observations(batched.model_cfg, 1)), narrate=True, max_new_tokens=7)


def test_parallel_matches_isolated(model, tokenizer):
    """Two copies in two threads: the same actions and texts, and the caller's torch thread
    count restored after every frame."""
    threads = torch.get_num_threads()
    iso = make_engine(model, tokenizer, mode='isolated')
    par = make_engine(model, tokenizer, mode='parallel')
    a_iso, t_iso, _, _ = run(iso, 4)
    a_par, t_par, _, _ = run(par, 4)
    par.scheduler.close()
    for x, y in zip(a_iso, a_par):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    assert t_par == t_iso and len(t_iso) == 4
    assert par.scheduler.lang.runner.model is not model
    assert torch.get_num_threads() == threads


def test_bfloat16_engine_tracks_float32(tokenizer):
    """The CUDA precision policy (bf16 weights and KV, fp32 norms and embeddings), run on
    the CPU: the same frames give actions close to float32 and the text stream works."""
    actions = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        m = Pi05(load_config('tiny')).to_inference(torch.device('cpu'), dtype)
        eng = make_engine(m, tokenizer)
        assert eng.cache.kv.dtype == dtype
        a, texts, _, _ = run(eng, 4)
        actions[dtype] = np.stack(a)
        assert len(texts) == 4
    diff = np.abs(actions[torch.float32] - actions[torch.bfloat16]).max()
    assert diff < 0.05 * np.abs(actions[torch.float32]).max()
    assert diff > 0  # really ran in reduced precision


def test_every_mode_has_its_scheduler():
    from oxygen_ros.engine.baselines import SCHEDULERS
    from oxygen_ros.engine.scheduler import MODES

    assert tuple(SCHEDULERS) == MODES
    assert all(SCHEDULERS[m].mode == m for m in MODES)
