"""pi0.5 model: the cached phases against whole-sequence recomputation, sizes, configs."""

import numpy as np
import pytest
import torch
from support.models import LENGTHS, MASKS, observation, tiny_model  # noqa: E402

from oxygen_ros.model import KV, ModelConfig, Pi05, load_config
from oxygen_ros.model.denoise import flow_times

torch.set_num_threads(2)

ATTENTION = ["bidirectional", "causal"]


def pick(obs, i):
    return tuple(t[i:i + 1] for t in obs)


@pytest.mark.parametrize("attention", ATTENTION)
def test_denoise_matches_joint_sequence(attention):
    model = tiny_model(prompt_attention=attention)
    cfg = model.cfg
    obs = observation(cfg, MASKS, LENGTHS)
    kv = KV.allocate(cfg, 5, cfg.prefix_len + 8)
    rows = slice(1, 4)
    model.prefill(*obs, kv, rows)
    before = [t[rows].clone() for t in kv.k + kv.v]
    state = kv.valid.clone(), kv.length.clone(), kv.next_pos.clone()

    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim, generator=torch.Generator()
                        .manual_seed(2))
    trace = []
    actions = model.denoise(kv, rows, noise, steps=5, trace=trace)
    times, dt = flow_times(5)
    assert len(trace) == len(times) == 5
    x = noise
    for t, v in zip(times, trace, strict=True):
        ref = model.forward_full(*obs, x, t)
        torch.testing.assert_close(v, ref, atol=2e-5, rtol=1e-5)
        x = x + dt * ref
    torch.testing.assert_close(actions, x, atol=2e-5, rtol=1e-5)

    # The prefix is only read.
    assert all(torch.equal(a, b[rows]) for a, b in zip(before, kv.k + kv.v, strict=True))
    after = (kv.valid, kv.length, kv.next_pos)
    assert all(torch.equal(a, b) for a, b in zip(state, after, strict=True))

    # Not vacuous: the velocity depends on the prompt and on each camera.
    images, image_mask, tokens, token_mask = obs
    other = tokens.clone()
    other[0, 0] += 1
    v_other = model.forward_full(images, image_mask, other, token_mask, noise, 1.0)
    assert (v_other[0] - trace[0][0]).abs().max() > 1e-3
    shaded = images.clone()
    shaded[1, 2] = 0
    v_other = model.forward_full(shaded, image_mask, tokens, token_mask, noise, 1.0)
    assert (v_other[1] - trace[0][1]).abs().max() > 1e-3


def test_masked_camera_content_is_ignored():
    model = tiny_model()
    cfg = model.cfg
    obs = observation(cfg, MASKS, LENGTHS)
    images, image_mask, tokens, token_mask = obs
    kv = KV.allocate(cfg, 3)
    h = model.prefill(*obs, kv, slice(0, 3))
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim)
    a = model.denoise(kv, slice(0, 3), noise)
    images = images.clone()
    images[~image_mask] = torch.rand_like(images[~image_mask])
    tokens = tokens.clone()
    tokens[~token_mask] = 7
    h2 = model.prefill(images, image_mask, tokens, token_mask, kv, slice(0, 3))
    assert torch.equal(h, h2)
    assert torch.equal(a, model.denoise(kv, slice(0, 3), noise))


@pytest.mark.parametrize("attention", ATTENTION)
def test_prefill_hidden_is_last_valid_token(attention):
    model = tiny_model(prompt_attention=attention)
    cfg = model.cfg
    obs = observation(cfg, MASKS, LENGTHS)
    kv = KV.allocate(cfg, 3)
    hidden = model.prefill(*obs, kv, slice(0, 3))
    assert hidden.shape == (3, cfg.vlm.width)
    ref = model.forward_text(*obs, torch.zeros(3, 0, dtype=torch.long))
    torch.testing.assert_close(model.logits(hidden), ref[:, 0], atol=1e-4, rtol=1e-5)
    # Rotary positions continue from the valid prefix, not the physical columns.
    n = cfg.image_tokens
    valid = torch.tensor(MASKS).sum(1) * n + torch.tensor(LENGTHS)
    assert kv.next_pos.tolist() == valid.tolist()
    # Missing cameras and trailing padding are not laid out: 3 cameras at most, 24 tokens.
    assert kv.length.tolist() == [3 * n + 24] * 3
    assert kv.valid.sum(1).tolist() == valid.tolist()


@pytest.mark.parametrize("attention", ATTENTION)
def test_batched_decode_matches_recompute_and_isolation(attention):
    model = tiny_model(prompt_attention=attention)
    cfg = model.cfg
    obs = observation(cfg, MASKS, LENGTHS)
    steps = [5, 2, 4]  # tokens decoded per request
    gen = torch.randint(2, cfg.vocab, (3, max(steps)), generator=torch.Generator()
                        .manual_seed(3))

    # Batched: rows 4, 1, 2 of a 6-row store, prefilled separately (different layouts).
    kv = KV.allocate(cfg, 6, cfg.prefix_len + 8)
    rows = [4, 1, 2]
    first = [model.logits(model.prefill(*pick(obs, i), kv, slice(r, r + 1)))
             for i, r in enumerate(rows)]
    batched = [[f[0]] for f in first]
    for j in range(max(steps)):
        active = [i for i in range(3) if steps[i] > j]
        logits = model.decode_step(kv, torch.tensor([rows[i] for i in active]), gen[active, j])
        for i, row in zip(active, logits, strict=True):
            batched[i].append(row)

    for i in range(3):
        ref = model.forward_text(*pick(obs, i), gen[i:i + 1, :steps[i]])[0]
        got = torch.stack(batched[i])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
        # Alone: its own store, one request per step.
        alone_kv = KV.allocate(cfg, 1, cfg.prefix_len + 8)
        alone = [model.logits(model.prefill(*pick(obs, i), alone_kv, slice(0, 1)))[0]]
        for j in range(steps[i]):
            alone.append(model.decode_step(alone_kv, torch.tensor([0]), gen[i, j:j + 1])[0])
        torch.testing.assert_close(got, torch.stack(alone), atol=1e-5, rtol=1e-6)
        columns = sum(MASKS[i]) * cfg.image_tokens + LENGTHS[i] + steps[i]
        assert kv.length[rows[i]] == alone_kv.length[0] == columns
        assert kv.next_pos[rows[i]] == alone_kv.next_pos[0]


def test_prefill_batch_equals_single():
    model = tiny_model()
    cfg = model.cfg
    obs = observation(cfg, MASKS, LENGTHS)
    kv = KV.allocate(cfg, 3)
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim)
    hb = model.prefill(*obs, kv, slice(0, 3))
    ab = model.denoise(kv, slice(0, 3), noise)
    for i in range(3):
        one = KV.allocate(cfg, 1)
        h = model.prefill(*pick(obs, i), one, slice(0, 1))
        torch.testing.assert_close(h[0], hb[i], atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(model.denoise(one, slice(0, 1), noise[i:i + 1])[0], ab[i],
                                   atol=1e-5, rtol=1e-6)


def test_grouped_heads_and_static_columns():
    """Two kv heads (groups of two query heads), and fixed column counts for static shapes."""
    model = tiny_model(vlm={"heads": 4, "kv_heads": 2}, expert={"heads": 4, "kv_heads": 2})
    cfg = model.cfg
    obs = observation(cfg, MASKS[:2], LENGTHS[:2])
    kv = KV.allocate(cfg, 2, cfg.prefix_len + 4)
    model.prefill(*obs, kv, slice(0, 2))
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim)
    trace = []
    model.denoise(kv, slice(0, 2), noise, steps=2, trace=trace)
    torch.testing.assert_close(trace[0], model.forward_full(*obs, noise, 1.0), atol=2e-5,
                               rtol=1e-5)
    static = model.denoise(kv, slice(0, 2), noise, steps=2, cols=kv.max_len)
    torch.testing.assert_close(static, model.denoise(kv, slice(0, 2), noise, steps=2),
                               atol=1e-5, rtol=1e-6)
    gen = torch.tensor([[5, 6], [7, 8]])
    ref = model.forward_text(*obs, gen)
    for j in range(2):
        got = model.decode_step(kv, torch.tensor([0, 1]), gen[:, j], cols=kv.max_len)
        torch.testing.assert_close(got, ref[:, j + 1], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("attention", ATTENTION)
def test_empty_observation_is_finite_and_isolated(attention):
    model = tiny_model(prompt_attention=attention)
    cfg = model.cfg
    obs = observation(cfg, [[1, 1, 0], [0, 0, 0]], [6, 0])
    kv = KV.allocate(cfg, 2, cfg.prefix_len + 4)
    hidden = model.prefill(*obs, kv, slice(0, 2))
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim)
    actions = model.denoise(kv, slice(0, 2), noise)
    logits = model.decode_step(kv, torch.tensor([0, 1]), torch.tensor([3, 3]))
    for t in (hidden, actions, logits):
        assert torch.isfinite(t).all()
    assert kv.next_pos.tolist() == [2 * cfg.image_tokens + 6 + 1, 1]
    # The empty row does not disturb the other one.
    one = KV.allocate(cfg, 1, cfg.prefix_len + 4)
    h = model.prefill(*pick(obs, 0), one, slice(0, 1))
    torch.testing.assert_close(h[0], hidden[0], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(model.denoise(one, slice(0, 1), noise[:1])[0], actions[0],
                               atol=1e-5, rtol=1e-6)
    # No camera at all in the whole batch: only text is laid out.
    obs = observation(cfg, [[0, 0, 0]], [5])
    kv = KV.allocate(cfg, 1)
    assert torch.isfinite(model.prefill(*obs, kv, slice(0, 1))).all()
    assert kv.length.tolist() == [5]


def test_seeded_noise_gives_deterministic_actions():
    model = tiny_model()
    cfg = model.cfg
    obs = observation(cfg, MASKS[:1], LENGTHS[:1])
    out = []
    for _ in range(2):
        kv = KV.allocate(cfg, 1)
        model.prefill(*obs, kv, slice(0, 1))
        g = torch.Generator().manual_seed(42)
        noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g)
        out.append(model.denoise(kv, slice(0, 1), noise))
    assert torch.equal(out[0], out[1])
    assert out[0].dtype == torch.float32
    assert out[0].shape == (1, cfg.action_horizon, cfg.action_dim)


def test_flow_times_accumulate_in_fp32():
    times, dt = flow_times(10)
    t, dt32, expected = np.float32(1.0), np.float32(-1.0 / 10), []
    while t >= -dt32 / 2:
        expected.append(float(t))
        t = np.float32(t + dt32)
    assert times == expected and len(times) == 10 and dt == float(dt32)
    assert times[2] == pytest.approx(0.79999995, abs=1e-8)
    assert len(flow_times(3)[0]) == 3 and len(flow_times(1)[0]) == 1


def test_flow_times_on_lerobots_grid():
    times, dt = flow_times(10, "lerobot")
    # 1 + k * (-0.1) in float64, each rounded to fp32: 0.8 is not 0.79999995 here
    assert times == [float(np.float32(1.0 + k * -0.1)) for k in range(10)]
    assert times[2] == float(np.float32(0.8)) != flow_times(10)[0][2]
    assert dt == float(np.float32(-0.1))
    with pytest.raises(ValueError, match="time grid"):
        flow_times(10, "jax")


def test_denoise_follows_the_configured_time_grid():
    model = tiny_model()
    lerobot = tiny_model(time_grid="lerobot")
    cfg = model.cfg
    obs = observation(cfg, MASKS[:2], LENGTHS[:2])
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim, generator=torch.Generator()
                        .manual_seed(4))
    out = []
    for m in (model, lerobot):
        kv = KV.allocate(cfg, 2, cfg.prefix_len)
        m.prefill(*obs, kv, slice(0, 2))
        trace: list = []
        out.append(m.denoise(kv, slice(0, 2), noise, steps=5, trace=trace))
        x = noise
        for t, v in zip(flow_times(5, m.cfg.time_grid)[0], trace, strict=True):
            torch.testing.assert_close(v, m.forward_full(*obs, x, t), atol=2e-5, rtol=1e-5)
            x = x + flow_times(5)[1] * v
    assert not torch.equal(out[0], out[1])


def test_bfloat16_keeps_norms_and_embeddings_fp32():
    model = tiny_model()
    cfg = model.cfg
    obs = observation(cfg, MASKS[:2], LENGTHS[:2])
    kv = KV.allocate(cfg, 2, cfg.prefix_len + 1)
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim)
    model.prefill(*obs, kv, slice(0, 2))
    ref = model.denoise(kv, slice(0, 2), noise)
    ref_logits = model.decode_step(kv, torch.tensor([0, 1]), torch.tensor([4, 5]))
    model.to_inference("cpu", torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["vision.patch.weight"] == dtypes["vision.pos.weight"] == torch.float32
    assert dtypes["vlm.0.norm1.weight"] == dtypes["expert.0.norm2.weight"] == torch.float32
    assert dtypes["vlm.0.qkv.weight"] == dtypes["embed.weight"] == torch.bfloat16
    assert next(model.parameters()).dtype == torch.bfloat16
    kv = KV.allocate(cfg, 2, cfg.prefix_len + 1, dtype=torch.bfloat16)
    model.prefill(*obs, kv, slice(0, 2))
    actions = model.denoise(kv, slice(0, 2), noise)
    logits = model.decode_step(kv, torch.tensor([0, 1]), torch.tensor([4, 5]))
    assert actions.dtype == logits.dtype == torch.float32
    assert (actions - ref).abs().max() < 0.02 * ref.abs().max()
    assert (logits - ref_logits).abs().max() < 0.02 * ref_logits.abs().max()


def test_kv_allocation_and_errors():
    model = tiny_model()
    cfg = model.cfg
    kv = KV.allocate(cfg, 3, 100)
    e = cfg.vlm
    assert len(kv.k) == len(kv.v) == e.depth
    assert kv.k[0].shape == (3, e.kv_heads, 100, e.head_dim)
    per_row = 2 * e.depth * e.kv_heads * 100 * e.head_dim * 4 + 100 + 16
    assert kv.nbytes == 3 * per_row and kv.row_nbytes == per_row
    obs = observation(cfg, MASKS[:1], LENGTHS[:1])
    model.prefill(*obs, kv, slice(2, 3))
    kv.clear(slice(2, 3))
    assert not kv.valid.any() and kv.length.sum() == 0 and kv.next_pos.sum() == 0

    small = KV.allocate(cfg, 1, cfg.prefix_len)
    model.prefill(*obs, small, slice(0, 1))
    with pytest.raises(ValueError, match="full"):
        model.decode_step(small, torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match="does not fit"):
        model.prefill(*obs, KV.allocate(cfg, 1, 10), slice(0, 1))
    with pytest.raises(ValueError, match="consecutive"):
        model.prefill(*obs, kv, slice(0, 2))
    with pytest.raises(TypeError):
        model.denoise(kv, torch.tensor([0]), torch.zeros(1, cfg.action_horizon, cfg.action_dim))


# ---------------------------------------------------------------------------- sizes


def gemma_layer(w, mlp, heads, kv_heads, d, adaptive):
    attention = w * heads * d + 2 * w * kv_heads * d + heads * d * w
    norms = 2 * (w * 3 * w + 3 * w) if adaptive else 2 * w
    return attention + 3 * w * mlp + norms


def siglip_layer(w, mlp):
    return 4 * (w * w + w) + (w * mlp + mlp) + (mlp * w + w) + 2 * 2 * w


def test_pi05_parameter_count():
    cfg = load_config("pi05")
    with torch.device("meta"):
        counts = Pi05(cfg).param_counts()
    vision = 3 * 14 * 14 * 1152 + 1152 + 256 * 1152 + 27 * siglip_layer(1152, 4304) + 2 * 1152
    projector = 1152 * 2048 + 2048
    vlm = 257152 * 2048 + 18 * gemma_layer(2048, 16384, 8, 1, 256, False) + 2048
    expert = 18 * gemma_layer(1024, 4096, 8, 1, 256, True) + 1024 * 3072 + 3072
    heads = (32 * 1024 + 1024) + (1024 * 32 + 32) + 2 * (1024 * 1024 + 1024)
    expected = dict(vision=vision, projector=projector, vlm=vlm, expert=expert, heads=heads,
                    total=vision + projector + vlm + expert + heads)
    assert counts == expected
    assert 3.3e9 < counts["total"] < 3.4e9
    assert 400e6 < vision < 420e6 and 2.50e9 < vlm < 2.52e9


def test_small_and_tiny_sizes():
    small = load_config("small")
    with torch.device("meta"):
        counts = Pi05(small).param_counts()
    assert (small.vlm.width, small.vlm.depth, small.vlm.mlp, small.vlm.heads,
            small.vlm.kv_heads, small.vlm.head_dim) == (64, 4, 128, 8, 1, 16)
    assert small.expert == small.vlm
    assert (small.vision.width, small.vision.depth, small.vision.mlp,
            small.vision.heads) == (64, 2, 128, 4)
    assert small.image_tokens == 256 and small.prefix_len == 3 * 256 + 100
    # The authors' code also holds the action expert's unused 257152 x 64 output layer;
    # with it the sizes match their 33.5M.
    assert counts["total"] + 257152 * 64 == pytest.approx(33.5e6, rel=2e-3)
    tiny = load_config("tiny")
    assert tiny.image_tokens == 16
    with torch.device("meta"):
        assert Pi05(tiny).param_counts()["total"] < 2e6


def test_config_loading_and_validation(tmp_path):
    cfg = load_config("pi05")
    assert (cfg.vlm.width, cfg.expert.width, cfg.vision.width) == (2048, 1024, 1152)
    assert cfg.prefix_len == 3 * 256 + 200 and cfg.prompt_attention == "bidirectional"
    over = load_config("tiny", prompt_attention="causal", action_horizon=6,
                       vlm={"kv_heads": 2}, expert={"kv_heads": 2})
    assert over.action_horizon == 6 and over.vlm.kv_heads == 2 and over.vlm.width == 64
    assert ModelConfig.from_dict(over.to_dict()) == over
    with pytest.raises(ValueError, match="share depth"):
        load_config("tiny", expert={"depth": 3})
    with pytest.raises(ValueError, match="kv_heads"):
        load_config("tiny", vlm={"kv_heads": 2})
    with pytest.raises(ValueError, match="prompt_attention"):
        load_config("tiny", prompt_attention="sideways")
    with pytest.raises(ValueError, match="unknown model config"):
        load_config("nope")
    with pytest.raises(ValueError, match="unknown config key"):
        load_config("tiny", widht=3)
    path = tmp_path / "mine.yaml"
    path.write_text("vlm: {width: 8, depth: 1, mlp: 8, heads: 2, kv_heads: 1, head_dim: 4}\n"
                    "expert: {width: 8, depth: 1, mlp: 8, heads: 2, kv_heads: 1, head_dim: 4}\n"
                    "vision: {width: 8, depth: 1, mlp: 8, heads: 2, image_size: 28}\n")
    mine = load_config(path)
    assert mine.name == "mine" and mine.image_tokens == 4
