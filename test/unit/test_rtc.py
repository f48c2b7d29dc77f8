"""Real-time chunking: the soft mask and guidance weight by hand, the guidance as a full
Jacobian computes it, and what it does to a sample on the tiny model."""

import json
import math

import numpy as np
import pytest
import torch
from support.models import LENGTHS, MASKS, observation, tiny_model  # noqa: E402

from oxygen_ros.engine import Engine, EngineConfig, Observation
from oxygen_ros.model import KV, Pi05, load_config
from oxygen_ros.model.processing import NormStats
from oxygen_ros.model.rtc import Guide, Handover, guidance_scale, weights
from oxygen_ros.model.tokenizer import Tokenizer

H = 10


def test_weights_by_hand():
    w = weights(H, delay=2, overlap=7)
    want = [1.0, 1.0]
    for i in range(2, 7):
        c = (7 - i) / (7 - 2 + 1)
        want.append(c * (math.exp(c) - 1) / (math.e - 1))
    want += [0.0] * 3
    assert w.tolist() == pytest.approx(want, abs=1e-7)
    # No delay and no overlap are both allowed; impossible splits are errors.
    assert weights(H, 0, 0).sum() == 0
    assert weights(H, 3, 3).tolist() == [1.0] * 3 + [0.0] * 7
    for d, o in ((4, 3), (-1, 3), (2, 11)):
        with pytest.raises(ValueError):
            weights(H, d, o)


def test_guidance_scale_by_hand():
    assert guidance_scale(1.0, 5.0) == 5.0  # pure noise: the clip
    # t = 0.5: tau = 0.5, r^2 = 0.25 / 0.5 = 0.5, (1 - tau) / (tau r^2) = 2.
    assert guidance_scale(0.5, 5.0) == pytest.approx(2.0)
    # t = 0.1: tau = 0.9, r^2 = 0.01 / 0.82, 0.1 / (0.9 * 0.01 / 0.82) = 9.11 -> clipped.
    assert guidance_scale(0.1, 5.0) == 5.0
    assert guidance_scale(0.1, 20.0) == pytest.approx(0.1 / (0.9 * 0.01 / 0.82))
    assert guidance_scale(0.5, 0.0) == 0.0


def test_guide_make_aligns_the_previous_chunk():
    prev = torch.arange(H * 2, dtype=torch.float32).view(H, 2)
    g = Guide.make(prev, start=3, delay=2, beta=4.0)
    assert torch.equal(g.target[:7], prev[3:])
    assert torch.equal(g.target[7:], torch.zeros(3, 2))
    assert torch.equal(g.weights, weights(H, 2, 7))
    with pytest.raises(ValueError, match='start'):
        Guide.make(prev, start=H, delay=0)
    with pytest.raises(ValueError, match='delay'):
        Guide.make(prev, start=8, delay=3)


def setup(seed=0):
    model = tiny_model(seed, action_horizon=H)
    cfg = model.cfg
    kv = KV.allocate(cfg, 1)
    with torch.inference_mode():  # as the scheduler runs it
        model.prefill(*observation(cfg, MASKS[:1], LENGTHS[:1]), kv, slice(0, 1))
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(1, H, cfg.action_dim, generator=g)
    prev = torch.randn(H, cfg.action_dim, generator=g)
    return model, kv, noise, prev


def test_guidance_matches_the_full_jacobian():
    model, kv, noise, prev = setup()
    guide = Guide.make(prev, start=2, delay=3, beta=5.0)

    def velocity(x):  # the expert's velocity at t = 1, differentiable in x
        out = []
        model._denoise(kv, slice(0, 1), x, 1, None, out, None)
        return out[0]

    # One guided step from pure noise (t = 1, clean estimate x - v, weight beta):
    # v - beta * J^T e, with the Jacobian J of the clean estimate built whole.
    with torch.no_grad():
        v = velocity(noise)
    jac = torch.autograd.functional.jacobian(lambda x: x - velocity(x), noise)[0, :, :, 0]
    e = (guide.target - (noise - v)[0]) * guide.weights[:, None]
    want = v[0] - 5.0 * torch.einsum('ij,ijkl->kl', e, jac)
    got = []
    model.denoise(kv, slice(0, 1), noise, steps=1, trace=got, guide=guide)
    torch.testing.assert_close(got[0][0], want, atol=1e-5, rtol=1e-4)
    assert (want - v[0]).abs().max() > 1e-2  # the guidance is not negligible here


def test_beta_zero_is_todays_sampling_bit_for_bit():
    model, kv, noise, prev = setup()
    with torch.inference_mode():
        plain = model.denoise(kv, slice(0, 1), noise)
        off = model.denoise(kv, slice(0, 1), noise, guide=Guide.make(prev, 2, 3, beta=0.0))
    assert torch.equal(plain, off)


def test_frozen_steps_are_the_previous_chunks_and_the_overlap_moves_towards_it():
    model, kv, noise, prev = setup()
    start, delay = 3, 2
    with torch.inference_mode():
        plain = model.denoise(kv, slice(0, 1), noise)[0]
        guided = model.denoise(kv, slice(0, 1), noise, guide=Guide.make(prev, start, delay))[0]
    assert torch.equal(guided[:delay], prev[start:start + delay])
    # The error the guidance minimises: weighted by the soft mask over the overlap.
    w = weights(H, delay, H - start)[:, None]
    w[:delay] = 0  # exact by construction (checked above)
    target = torch.cat((prev[start:], torch.zeros(start, prev.shape[1])))
    before = ((plain - target) * w).abs().sum()
    after = ((guided - target) * w).abs().sum()
    assert after < 0.5 * before, (float(before), float(after))
    # Past the overlap the chunk is free: guidance changes it only through the expert.
    assert not torch.equal(guided[H - start:], plain[H - start:])


# -- through the engine ---------------------------------------------------------------------

def engine(rtc=True, beta=5.0, norm=None, mode='oxygen'):
    torch.manual_seed(0)
    model = Pi05(load_config('tiny', action_horizon=H)).to_inference('cpu')
    cfg = EngineConfig(model='tiny', compile=False, mode=mode, decode_k=1, max_requests=2,
                       max_new_tokens=3, prompt_format='subtask', seed=3, rtc=rtc,
                       rtc_beta=beta)
    return Engine(cfg, model=model, tokenizer=Tokenizer.default(), norm_stats=norm)


def frames(n, seed=0):
    rng = np.random.default_rng(seed)
    size = load_config('tiny').vision.image_size
    for i in range(n):
        images = {s: rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                  for s in load_config('tiny').image_slots}
        yield Observation(stamp=0.1 * i, images=images, state=rng.uniform(-1, 1, 8),
                          prompt='stack the blocks')


def stats():
    rng = np.random.default_rng(9)
    lo = rng.uniform(-2, -1, 8)
    hi = rng.uniform(1, 3, 8)
    s = dict(q01=lo.tolist(), q99=hi.tolist(), mean=[0.0] * 8, std=[1.0] * 8)
    return NormStats.from_dict(dict(state=s, actions=s))


def test_engine_without_rtc_ignores_the_handover():
    plain, off = engine(rtc=False), engine(rtc=False)
    for i, obs in enumerate(frames(3)):
        a = plain.step(obs, narrate=i == 0).actions
        b = off.step(obs, narrate=i == 0, handover=Handover(2, 1)).actions
        assert np.array_equal(a, b)
    assert off.stats()['rtc_frames'] == 0


@pytest.mark.parametrize('mode', ['oxygen', 'parallel'])
def test_engine_joins_its_last_chunk(mode):
    free, rtc = engine(rtc=False, norm=stats(), mode=mode), engine(norm=stats(), mode=mode)
    obs = list(frames(4))
    first = rtc.step(obs[0]).actions
    assert np.array_equal(first, free.step(obs[0]).actions)  # nothing to join yet
    prev = first
    for o in obs[1:]:
        start, delay = 3, 2
        a = rtc.step(o, narrate=True, handover=Handover(start, delay)).actions
        b = free.step(o, narrate=True).actions
        # Executed before the chunk is out: the previous chunk's actions, exactly.
        assert np.array_equal(a[:delay], prev[start:start + delay])
        w = weights(H, delay, H - start)[:, None].numpy()
        w[:delay] = 0
        target = np.concatenate((prev[start:], np.zeros((start, 8))))
        assert (np.abs(a - target) * w).sum() < 0.5 * (np.abs(b - target) * w).sum()
        prev = a
    assert rtc.stats()['rtc_frames'] == 3
    # A previous chunk that has run out leaves nothing to join: a free sample.
    late = engine(norm=stats(), mode=mode)
    late.step(obs[0])
    free2 = engine(rtc=False, norm=stats(), mode=mode)
    free2.step(obs[0])
    assert np.array_equal(late.step(obs[1], handover=Handover(H, 2)).actions,
                          free2.step(obs[1]).actions)


def test_engine_joins_a_chunk_given_in_this_frames_terms():
    # For state-relative actions the caller re-expresses the chunk being executed; the
    # engine then guides the robot's columns only, towards those numbers.
    rtc = engine(norm=stats())
    obs = list(frames(2))
    rtc.step(obs[0])
    given = np.random.default_rng(4).uniform(-1, 1, (H, 6))
    a = rtc.step(obs[1], handover=Handover(4, 3, previous=given)).actions
    np.testing.assert_allclose(a[:3, :6], given[4:7], atol=1e-5)
    with pytest.raises(ValueError, match='previous'):
        rtc.step(obs[1], handover=Handover(4, 3, previous=given[:5]))


def test_a_dim_constant_in_training_is_left_unguided():
    # Dim 2's stats say it never moved in training (q01 == q99, as a scripted ALOHA's waist):
    # normalising multiplies it by ~2e6, so 1e-4 of jitter between two frames would be an
    # error of ~200 model units, and its gradient through the expert threw whole chunks out
    # of range. It is left free: the jitter changes no other dim, and its own frozen steps
    # are still the previous chunk's.
    rng = np.random.default_rng(9)
    lo, hi = rng.uniform(-2, -1, 8), rng.uniform(1, 3, 8)
    lo[2] = hi[2] = 0.3
    s = dict(q01=lo.tolist(), q99=hi.tolist(), mean=[0.0] * 8, std=[1.0] * 8)
    norm = NormStats.from_dict(dict(state=s, actions=s))
    steady, jittery = engine(norm=norm), engine(norm=norm)
    assert steady.rtc_unguided == (2,)
    assert engine(norm=stats()).rtc_unguided == ()
    obs = list(frames(2))
    steady.step(obs[0])
    jittery.step(obs[0])
    given = rng.uniform(lo, hi, (H, 8))
    given[:, 2] = 0.3
    shaken = given.copy()
    shaken[:, 2] += 1e-4
    a = steady.step(obs[1], handover=Handover(4, 3, previous=given)).actions
    b = jittery.step(obs[1], handover=Handover(4, 3, previous=shaken)).actions
    others = [i for i in range(8) if i != 2]
    np.testing.assert_allclose(b[:, others], a[:, others], atol=1e-6)
    np.testing.assert_allclose(b[:3, 2], shaken[4:7, 2], atol=1e-5)
    np.testing.assert_allclose(a[:3, others], given[4:7, others], atol=1e-5)


def test_the_node_guides_towards_the_targets_it_sent_clamped_into_the_limits():
    # The ALOHA of aloha.yaml, its right wrist_angle (action 11) asked 0.4 rad past its
    # upper limit: the node clamps the target and the robot never gets there. The chunk the
    # next one is guided towards is the clamped one, expressed for the new state; guided
    # towards the model's own targets, each chunk went further past the limit than the last.
    import threading
    from types import SimpleNamespace

    from support.robots import robot_config

    from oxygen_ros.robot.intake import Intake
    from oxygen_ros.robot.playback import Player

    cfg = robot_config('aloha.yaml', rtc=True)
    profile, upper = cfg.profile, cfg.limits.upper[11]
    intake = Intake(cfg, SimpleNamespace(assembler=None), None, lambda: 0.0, None, None,
                    [0.05], threading.Lock())
    intake.player = Player(1.0, limits=cfg.limits)
    old = np.zeros(14)
    old[[6, 13]] = 0.03  # fingers (m)
    old[11] = upper - 0.1
    actions = np.zeros((50, 14))
    actions[:, 11] = np.linspace(0.0, 0.5, 50)  # delta: from 0.1 inside to 0.4 past it
    chunk = intake.chunk(1.0, old, actions)
    assert chunk.positions[:, 11].max() == pytest.approx(upper + 0.4)
    intake.player.play(chunk)
    new = old.copy()
    new[11] = upper - 0.02
    ho = intake.handover(1.0 + 20 * cfg.action_period, new)
    assert (ho.start, ho.delay) == (20, 3)
    got = profile.decode_actions(ho.previous, new)
    want = np.clip(chunk.positions, cfg.limits.lower, cfg.limits.upper)
    np.testing.assert_allclose(got[:, :6], want[:, :6], atol=1e-12)
    np.testing.assert_allclose(got[:, 7:13], want[:, 7:13], atol=1e-12)
    assert got[:, 11].max() == pytest.approx(upper)


def test_rtc_bench_writes_its_table(tmp_path):
    from oxygen_ros.bench import rtc as rtc_bench

    assert rtc_bench.main(['--config', 'tiny', '--frames', '4', '--warmup', '1', '--s', '1',
                           '--delays', '1', '2', '--dims', '8', '--threads', '1',
                           '--out', str(tmp_path), '--no-plot']) == 0
    rows = json.loads((tmp_path / 'rtc.json').read_text())
    assert [(r['rtc'], r['delay']) for r in rows] == [(False, 1), (True, 1), (False, 2),
                                                      (True, 2)]
    for r in rows:
        assert r['switches'] == 4
        assert r['switch_jump_max'] >= r['switch_jump_p95'] >= 0
        assert r['jerk_p95'] > 0 and r['frame_ms_p50'] > 0
    # Seeded, so not a matter of luck: guidance shrinks the jump at every delay.
    for off, on in zip(rows[::2], rows[1::2]):
        assert on['switch_jump_max'] < off['switch_jump_max']
