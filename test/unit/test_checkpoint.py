"""Checkpoints: openpi / LeRobot key names in safetensors, round trips, clear refusals."""

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support.models import tiny_model  # noqa: E402
from support.paths import FIXTURES  # noqa: E402

from oxygen_ros.model import KV, Pi05, load_checkpoint, load_config, save_checkpoint
from oxygen_ros.model.checkpoint import (
    EMBED,
    EXP,
    LM,
    LM_HEAD,
    PG,
    VIT,
    CheckpointError,
    checkpoint_slots,
    config_from_json,
    expected_shapes,
    infer_config,
    open_checkpoint,
)
from oxygen_ros.model.tokenizer import Tokenizer, action_prompt

torch.set_num_threads(2)

STATS = {"state": {"q01": [-1.0, 0.0], "q99": [1.0, 2.0]},
         "actions": {"q01": [0.0] * 8, "q99": [1.0] * 8}}


def outputs(model: Pi05):
    cfg = model.cfg
    g = torch.Generator().manual_seed(1)
    size, n = cfg.vision.image_size, cfg.max_token_len
    images = torch.rand(2, 3, 3, size, size, generator=g) * 2 - 1
    image_mask = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    tokens = torch.randint(2, cfg.vocab, (2, n), generator=g)
    token_mask = torch.arange(n)[None] < torch.tensor([[n], [9]])
    kv = KV.allocate(cfg, 2, cfg.prefix_len + 2)
    hidden = model.prefill(images, image_mask, tokens, token_mask, kv, slice(0, 2))
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim, generator=g)
    actions = model.denoise(kv, slice(0, 2), noise)
    logits = model.decode_step(kv, torch.tensor([0, 1]), torch.tensor([5, 6]))
    return hidden, actions, logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny_model()
    path = save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "pi05_tiny", STATS)
    return model, path, outputs(model)


def rewrite(src, dst, edit):
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_round_trip_is_exact(saved):
    _, path, ref = saved
    assert (path / "model.safetensors").is_file()
    meta = json.loads((path / "config.json").read_text())
    assert meta["action_dim"] == 8 and meta["action_horizon"] == 4
    assert meta["precision"] == "float32"
    model, stats, info = load_checkpoint(path)
    assert stats == STATS and info["asset_id"] == "default" and info["tied"]
    assert model.cfg == load_config("tiny")
    for a, b in zip(ref, outputs(model), strict=True):
        assert torch.equal(a, b)


def test_key_names_follow_openpi(saved):
    _, path, _ = saved
    keys = set(load_file(str(path / "model.safetensors")))
    for key in (VIT + "embeddings.patch_embedding.weight",
                VIT + "encoder.layers.1.self_attn.q_proj.bias",
                VIT + "encoder.layers.0.mlp.fc2.weight", VIT + "post_layernorm.bias",
                "paligemma_with_expert.paligemma.model.multi_modal_projector.linear.weight",
                LM + "layers.1.self_attn.k_proj.weight", LM + "layers.0.mlp.gate_proj.weight",
                LM + "layers.0.post_attention_layernorm.weight", LM + "norm.weight", LM_HEAD,
                EXP + "model.layers.1.input_layernorm.dense.bias",
                EXP + "model.layers.0.mlp.up_proj.weight", EXP + "model.norm.dense.weight",
                "action_in_proj.weight", "action_out_proj.bias", "time_mlp_in.weight",
                "time_mlp_out.bias"):
        assert key in keys, key
    assert EMBED not in keys  # tied: stored once, as lm_head
    with torch.device("meta"):
        total = sum(p.numel() for p in Pi05(load_config("tiny")).parameters())
    assert sum(t.numel() for t in load_file(str(path / "model.safetensors")).values()) == total


def test_lerobot_prefix_and_explicit_embedding(saved, tmp_path):
    _, path, ref = saved

    def lerobot(t):
        t[EMBED] = t.pop(LM_HEAD)  # the untied name only
        for k in list(t):
            t["model." + k] = t.pop(k)
        t["model." + EXP + "lm_head.weight"] = torch.zeros(3, 3)  # present in some exports

    model, _, info = load_checkpoint(rewrite(path, tmp_path / "lerobot", lerobot))
    assert info["prefixed"] and not info["tied"]
    assert info["ignored"] == [EXP + "lm_head.weight"]
    for a, b in zip(ref, outputs(model), strict=True):
        assert torch.equal(a, b)


def test_single_file_with_config(saved):
    _, path, ref = saved
    model, stats, info = load_checkpoint(path / "model.safetensors", cfg=load_config("tiny"))
    assert stats is None and info["asset_id"] is None
    for a, b in zip(ref, outputs(model), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["missing", "extra", "shape"])
def test_mismatch_names_the_key(saved, tmp_path, case):
    _, path, _ = saved
    key = LM + "layers.1.mlp.down_proj.weight"

    def edit(t):
        if case == "missing":
            del t[key]
        elif case == "extra":
            t["action_mystery_proj.weight"] = torch.zeros(2)
        else:
            t[key] = torch.zeros(3, 5)

    with pytest.raises(CheckpointError) as err:
        load_checkpoint(rewrite(path, tmp_path / case, edit))
    message = str(err.value)
    label = {"missing": "missing", "extra": "unexpected", "shape": "wrong shape"}[case]
    assert label in message
    assert ("action_mystery_proj.weight" if case == "extra" else key) in message
    if case == "shape":
        assert "[3, 5]" in message and "[64, 128]" in message


def test_pickle_formats_are_refused(tmp_path):
    for name in ("model.pt", "model.bin", "model.pth"):
        f = tmp_path / name
        f.write_bytes(b"not loaded")
        with pytest.raises(CheckpointError, match="safetensors"):
            load_checkpoint(f)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(d)


def test_openpi_config_json_and_bf16(saved, tmp_path):
    model, path, ref = saved
    dst = rewrite(path, tmp_path / "openpi", lambda t: None)
    meta = json.loads((path / "config.json").read_text())
    del meta["oxygen"]
    meta.update(paligemma_variant="gemma_2b", action_expert_variant="gemma_300m",
                precision="bfloat16")
    (dst / "config.json").write_text(json.dumps(meta))
    # openpi's config names no vision dims; SigLIP's head count is known only for So400m.
    with pytest.raises(CheckpointError, match="give the dims as a model config"):
        load_checkpoint(dst)
    loaded, _, info = load_checkpoint(dst, cfg=model.cfg, dtype=torch.bfloat16)
    assert info["precision"] == "bfloat16"
    assert loaded.embed.weight.dtype == torch.bfloat16
    assert loaded.vlm[0].norm1.weight.dtype == torch.float32
    out = save_checkpoint(loaded, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["precision"] == "bfloat16"
    back, _, _ = load_checkpoint(out, dtype=torch.bfloat16)
    for a, b in zip(loaded.state_dict().values(), back.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


def test_openpi_config_names_published_dims():
    pi05 = load_config("pi05", action_horizon=50)
    shapes = expected_shapes(pi05)
    shapes[EXP + "lm_head.weight"] = (257152, 1024)
    meta = {"action_dim": 32, "action_horizon": 50, "paligemma_variant": "gemma_2b",
            "action_expert_variant": "gemma_300m", "precision": "bfloat16"}
    assert config_from_json(meta, shapes) == pi05
    # Without config.json the dims come from the tensors and the known variants.
    assert infer_config(load_config("pi05"), shapes) == load_config("pi05")
    with pytest.raises(CheckpointError, match="paligemma_variant"):
        config_from_json({**meta, "paligemma_variant": "gemma_7b"}, shapes)


# ------------------------------------------------------------- by hand, by openpi names
# The cached phases are checked against Pi05's own whole-sequence reference in
# test_model.py; that reference shares the building blocks (norms, MLPs, embeddings, time
# conditioning, SigLIP). Here a pi0.5 step is computed from the checkpoint's tensors by
# their openpi names with plain tensor algebra, so a wrong convention anywhere shows.


def _rms(x):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _lin(t, name, x):
    out = x @ t[name + ".weight"].T
    return out + t[name + ".bias"] if name + ".bias" in t else out


def _rope(x, pos, base):
    """HF Gemma: x * cos + rotate_half(x) * sin, frequencies over the two halves."""
    half = x.shape[-1] // 2
    inv = 1.0 / base ** (torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    ang = pos[:, None].double() * inv
    cos, sin = ang.cos()[:, None].float(), ang.sin()[:, None].float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def _sinusoid(time, dim):
    """openpi's create_sinusoidal_pos_embedding(time, dim, min_period=4e-3, max_period=4)."""
    half = dim // 2
    out = []
    for i in range(half):
        period = 4e-3 * (4.0 / 4e-3) ** (i / (half - 1))
        out.append(2 * math.pi * time / period)
    x = torch.tensor(out, dtype=torch.float64)
    return torch.cat((x.sin(), x.cos())).float()


def _velocity_by_hand(t, cfg, tokens, x_t, time):
    """(velocity [H, action_dim], logits at the last prompt token) for one text-only
    observation: prompt tokens attend each other, action tokens attend everything."""
    ev, ee = cfg.vlm, cfg.expert
    heads, d = ev.heads, ev.head_dim
    xv = t[LM_HEAD][tokens] * math.sqrt(ev.width)
    cond = F.silu(_lin(t, "time_mlp_in", _sinusoid(time, ee.width)))
    cond = F.silu(_lin(t, "time_mlp_out", cond))
    xa = _lin(t, "action_in_proj", x_t)
    n, h = len(tokens), len(x_t)
    pos = torch.arange(n + h)
    allowed = torch.ones(n + h, n + h, dtype=torch.bool)
    allowed[:n, n:] = False

    def mlp(name, x):
        return (_gelu_tanh(_lin(t, name + "mlp.gate_proj", x)) * _lin(t, name + "mlp.up_proj", x)
                ) @ t[name + "mlp.down_proj.weight"].T

    def ada(name, x):
        scale, shift, gate = _lin(t, name + ".dense", cond).chunk(3)
        return _rms(x) * (1 + scale) + shift, gate

    for i in range(ev.depth):
        lv, la = f"{LM}layers.{i}.", f"{EXP}model.layers.{i}."
        hv = _rms(xv) * (1 + t[lv + "input_layernorm.weight"])
        ha, gate1 = ada(la + "input_layernorm", xa)
        proj = {}
        for x in "qkv":
            proj[x] = torch.cat((_lin(t, lv + f"self_attn.{x}_proj", hv),
                                 _lin(t, la + f"self_attn.{x}_proj", ha))).view(n + h, -1, d)
        q, k, v = _rope(proj["q"], pos, cfg.rope_base), _rope(proj["k"], pos, cfg.rope_base), \
            proj["v"]
        per_kv = heads // k.shape[1]
        outs = []
        for j in range(heads):
            kj, vj = k[:, j // per_kv], v[:, j // per_kv]
            s = (q[:, j] @ kj.T) / math.sqrt(d)
            outs.append(torch.softmax(s.masked_fill(~allowed, -math.inf), -1) @ vj)
        o = torch.cat(outs, -1)
        xv = xv + o[:n] @ t[lv + "self_attn.o_proj.weight"].T
        xa = xa + (o[n:] @ t[la + "self_attn.o_proj.weight"].T) * gate1
        xv = xv + mlp(lv, _rms(xv) * (1 + t[lv + "post_attention_layernorm.weight"]))
        ha, gate2 = ada(la + "post_attention_layernorm", xa)
        xa = xa + mlp(la, ha) * gate2
    ha, _ = ada(EXP + "model.norm", xa)
    logits = (_rms(xv[-1]) * (1 + t[LM + "norm.weight"])) @ t[LM_HEAD].T
    return _lin(t, "action_out_proj", ha), logits


def test_pi05_step_by_hand_from_openpi_names(saved):
    model, path, _ = saved
    cfg = model.cfg
    t = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(4)
    n = cfg.max_token_len
    tokens = torch.randint(2, cfg.vocab, (1, n), generator=g)
    token_mask = torch.arange(n)[None] < 11
    size = cfg.vision.image_size
    images = torch.rand(1, 3, 3, size, size, generator=g)
    no_camera = torch.zeros(1, 3, dtype=torch.bool)
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g)

    kv = KV.allocate(cfg, 1, cfg.prefix_len)
    hidden = model.prefill(images, no_camera, tokens, token_mask, kv, slice(0, 1))
    trace = []
    model.denoise(kv, slice(0, 1), noise, steps=1, trace=trace)
    velocity, logits = _velocity_by_hand(t, cfg, tokens[0, :11], noise[0], 1.0)
    # Tight: GELU's exact form instead of the tanh one moves these by ~1e-4.
    torch.testing.assert_close(trace[0][0], velocity, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(model.logits(hidden)[0], logits, atol=2e-5, rtol=1e-7)
    # Not vacuous: the time matters.
    other, _ = _velocity_by_hand(t, cfg, tokens[0, :11], noise[0], 0.5)
    assert (other - velocity).abs().max() > 1e-3


def test_siglip_and_projector_by_hand_from_openpi_names(saved):
    model, path, _ = saved
    vis = model.cfg.vision
    t = load_file(str(path / "model.safetensors"))
    images = torch.rand(2, 3, vis.image_size, vis.image_size,
                        generator=torch.Generator().manual_seed(6)) * 2 - 1
    emb = VIT + "embeddings."
    x = F.conv2d(images, t[emb + "patch_embedding.weight"], t[emb + "patch_embedding.bias"],
                 stride=vis.patch)
    x = x.flatten(2).transpose(1, 2) + t[emb + "position_embedding.weight"]
    d = vis.width // vis.heads

    def ln(name, x):
        return F.layer_norm(x, (vis.width,), t[name + ".weight"], t[name + ".bias"], 1e-6)

    for i in range(vis.depth):
        p = f"{VIT}encoder.layers.{i}."
        hn = ln(p + "layer_norm1", x)
        q, k, v = (_lin(t, p + f"self_attn.{c}_proj", hn).unflatten(-1, (vis.heads, d))
                   .transpose(1, 2) for c in "qkv")
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1) @ v
        x = x + _lin(t, p + "self_attn.out_proj", a.transpose(1, 2).flatten(2))
        hn = _gelu_tanh(_lin(t, p + "mlp.fc1", ln(p + "layer_norm2", x)))
        x = x + _lin(t, p + "mlp.fc2", hn)
    x = _lin(t, PG + "model.multi_modal_projector.linear", ln(VIT + "post_layernorm", x))
    torch.testing.assert_close(model.embed_images(images), x, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- open_checkpoint

OPENPI_STATS = {"state": {"q01": [-1.0, 0.0, 2.0], "q99": [1.0, 2.0, 4.0],
                          "mean": [0.0] * 3, "std": [1.0] * 3},
                "actions": {"q01": [0.0, -1.0, 5.0, -2.0, 0.0], "q99": [1.0, 1.0, 9.0, 2.0, 4.0],
                            "mean": [0.0] * 5, "std": [1.0] * 5}}


def openpi_dir(tmp_path, stats=OPENPI_STATS, **overrides):
    cfg = load_config("tiny", **overrides)
    torch.manual_seed(0)
    return save_checkpoint(Pi05(cfg).to_inference("cpu"), tmp_path / "openpi", stats,
                           asset_id="trossen")


def test_openpi_directory_facts(tmp_path):
    ck = open_checkpoint(openpi_dir(tmp_path))
    assert (ck.layout, ck.conventions, ck.model.cfg.time_grid) == ("openpi", "openpi", "openpi")
    # openpi's stats hold the robot's dims (its robot transforms pad nothing)
    assert (ck.state_dim, ck.action_dim) == (3, 5)
    assert (ck.horizon, ck.n_action_steps, ck.denoise_steps) == (4, 4, None)
    assert ck.slots == load_config("tiny").image_slots and ck.info["asset_id"] == "trossen"
    assert checkpoint_slots(openpi_dir(tmp_path / "s", image_slots=["top"])) == ("top",)
    assert ck.norm.modes == {"state": "QUANTILES", "actions": "QUANTILES"}
    x = ck.norm.normalize_state(np.array([0.5, 1.0, 2.0], np.float32))
    np.testing.assert_allclose(x, [1.5 / (2 + 1e-6) * 2 - 1, 1 / (2 + 1e-6) * 2 - 1, -1.0])
    lerobot = open_checkpoint(openpi_dir(tmp_path / "b"), conventions="lerobot")
    assert lerobot.conventions == lerobot.norm.conventions == "lerobot"
    assert lerobot.model.cfg.time_grid == "lerobot"


def test_engine_on_an_openpi_directory_cuts_to_the_robot_dims(tmp_path):
    from oxygen_ros.engine import Engine, EngineConfig, Observation
    # The built-in tokenizer's vocabulary, which it then runs with.
    eng = Engine(EngineConfig(checkpoint=str(openpi_dir(tmp_path, vocab=512)), seed=0,
                              max_requests=1, max_new_tokens=2, compile=False))
    assert eng.tokenizer_from.startswith("built-in")
    assert (eng.state_dim, eng.action_dim, eng.model_action_dim) == (3, 5, 8)
    noise = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    state = np.array([0.3, 1.3, 2.9], np.float32)  # no normalised value near a bin edge
    obs = Observation(0.0, {}, state, "wave")
    got = eng.step(obs, noise=noise).actions
    # The same weights without stats: fed the state normalised by hand, it gives the model's
    # raw actions, all 8 dims.
    raw = Engine(EngineConfig(checkpoint=str(openpi_dir(tmp_path / "b", vocab=512)), seed=0,
                              max_requests=1, max_new_tokens=2, normalize=False,
                              prompt_format="pi05", compile=False))
    assert raw.action_dim == 8 and raw.state_dim is None  # no stats: the model's width
    st, ac = OPENPI_STATS["state"], OPENPI_STATS["actions"]
    lo, hi = np.array(st["q01"]), np.array(st["q99"])
    normed = ((state - lo) / (hi - lo + 1e-6) * 2 - 1).astype(np.float32)
    hand = Observation(0.0, {}, normed, "wave")
    assert raw.frame(hand).tokens.tolist() == eng.frame(obs).tokens.tolist()  # one prompt
    a = raw.step(hand, noise=noise).actions
    assert a.shape == (4, 8)
    # openpi's quantile unnormalisation of the robot's 5 dims; the 3 padded dims are cut.
    lo, hi = np.array(ac["q01"]), np.array(ac["q99"])
    expected = (a[:, :5].astype(np.float64) + 1) / 2 * (hi - lo + 1e-6) + lo
    assert got.shape == (4, 5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, a[:, :5], atol=1e-2)
    with pytest.raises(ValueError, match="state has 4 dims; the checkpoint expects 3"):
        eng.step(Observation(0.0, {}, np.zeros(4, np.float32), "wave"))


def test_missing_norm_stats_fail_loudly(tmp_path):
    path = openpi_dir(tmp_path, stats=None)
    with pytest.raises(CheckpointError, match=r"no normalisation stats \(looked for .*assets"):
        open_checkpoint(path)
    assert open_checkpoint(path, normalize=False).norm is None
    with pytest.raises(CheckpointError, match="bare .safetensors"):
        open_checkpoint(path / "model.safetensors", dims=load_config("tiny"))
    ck = open_checkpoint(path / "model.safetensors", dims=load_config("tiny"), normalize=False)
    assert ck.layout == "file" and ck.action_dim == 8


def test_model_dims_with_the_checkpoints_horizon(tmp_path):
    # a checkpoint whose config.json names variants its tensors do not have
    path = openpi_dir(tmp_path, action_horizon=6, max_token_len=30)
    meta = json.loads((path / "config.json").read_text())
    del meta["oxygen"]
    meta.update(paligemma_variant="gemma_2b", action_expert_variant="gemma_300m")
    (path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError):
        open_checkpoint(path)
    ck = open_checkpoint(path, dims=load_config("tiny"))
    assert (ck.model.cfg.action_horizon, ck.model.cfg.max_token_len) == (6, 30)
    # Without our config section the slots are the given dims', read without the weights.
    assert checkpoint_slots(path, load_config("tiny", image_slots=["a"])) == ("a",)
    assert checkpoint_slots(path) == load_config("pi05").image_slots
    assert load_config("tiny").action_horizon == 4
    with pytest.raises(CheckpointError, match="does not match config 'small'"):
        open_checkpoint(path, dims=load_config("small"))


# ------------------------------------------------------------------- the checkpoint's tokenizer
# A checkpoint's embedding rows are the vocabulary it was trained on: prompt ids of another
# tokenizer are meaningless to it, and its actions with them confidently wrong.

SPM_448 = FIXTURES / "openpi_pi05" / "tokenizer.model"  # 448 pieces; the built-in has 512


def engine_on(path, **kw):
    from oxygen_ros.engine import Engine, EngineConfig
    return Engine(EngineConfig(checkpoint=str(path), max_requests=1, max_new_tokens=2,
                               compile=False, **kw))


@pytest.fixture(scope="module")
def paligemma_sized(tmp_path_factory):
    """An openpi directory whose model has PaliGemma's vocabulary: a width of 8 keeps the
    embedding at 8 MB."""
    torch.manual_seed(0)
    model = Pi05(load_config("tiny", vocab=257152, vlm={"width": 8})).to_inference("cpu")
    return save_checkpoint(model, tmp_path_factory.mktemp("pg") / "pi05_pg", OPENPI_STATS)


def test_a_paligemma_vocabulary_without_its_tokenizer_names_the_file_to_give(paligemma_sized):
    with pytest.raises(CheckpointError) as err:
        engine_on(paligemma_sized)
    message = str(err.value)
    for part in (str(paligemma_sized), "PaliGemma's 257152-entry vocabulary",
                 "built-in tokenizer's 512 pieces", "paligemma_tokenizer.model",
                 "gs://big_vision/paligemma_tokenizer.model", "google/paligemma-3b-pt-224",
                 "put it in the checkpoint directory as tokenizer.model"):
        assert part in message, (part, message)
    # Given, a tokenizer of another vocabulary is named with both sizes.
    with pytest.raises(CheckpointError, match=rf"tokenizer {SPM_448} \(tokenizer\) has 448 "
                       r"pieces but .* has a 257152-entry vocabulary .*\(PaliGemma's has "
                       r"257152 pieces\)"):
        engine_on(paligemma_sized, tokenizer=str(SPM_448))


def test_another_vocabulary_without_its_tokenizer_is_refused(tmp_path):
    path = openpi_dir(tmp_path)  # tiny: 1024 rows
    with pytest.raises(CheckpointError, match=r"openpi has a 1024-entry vocabulary but no "
                       r"tokenizer .* built-in tokenizer's 512 pieces .* trained with \(1024 "
                       r"pieces\) as tokenizer"):
        engine_on(path)
    # One in its directory of another size is refused with both sizes too.
    shutil.copy(SPM_448, path / "paligemma_tokenizer.model")
    with pytest.raises(CheckpointError, match=r"paligemma_tokenizer.model \(found in the "
                       r"checkpoint directory\) has 448 pieces but .* 1024-entry vocabulary"):
        engine_on(path)


def test_a_smaller_tokenizer_given_on_purpose_runs_and_a_larger_one_is_refused(tmp_path):
    # LeRobot saves and runs a checkpoint whose embedding has more rows than its tokenizer has
    # pieces: every id it produces has a row. Given as the setting it runs, says so, and
    # language never samples an id past the tokenizer's pieces.
    from oxygen_ros.engine import Observation
    path = openpi_dir(tmp_path)  # tiny: 1024 rows
    eng = engine_on(path, tokenizer=str(SPM_448))
    assert eng.tokenizer.source == str(SPM_448)
    assert eng.tokenizer_from == ("tokenizer, 448 pieces for 1024 embedding rows: the rows "
                                  "past 448 are never read")
    obs = Observation(0.0, {}, np.array([0.3, 1.3, 2.9], np.float32), "wave")
    text = action_prompt("wave", eng.norm.normalize_state(obs.state))
    ids = Tokenizer(SPM_448).tokenize(text, eng.model_cfg.max_token_len)[0].tolist()
    assert eng.frame(obs).tokens[0].tolist() == ids
    assert eng.scheduler.vocab_limit == 448
    # Found in the directory (nobody chose it) it stays refused: test above. Larger than the
    # embedding, its ids past the last row would index nothing.
    big = tmp_path / "big.model"
    big.write_bytes(Tokenizer.default()._sp.serialized_model_proto())
    small = openpi_dir(tmp_path / "s", vocab=448)
    with pytest.raises(CheckpointError, match=r"big.model \(tokenizer\) has 512 pieces but "
                       r".* 448-entry vocabulary"):
        engine_on(small, tokenizer=str(big))


def test_the_tokenizer_in_the_checkpoint_directory_is_used(tmp_path):
    from oxygen_ros.engine import Observation
    path = openpi_dir(tmp_path, vocab=448)
    shutil.copy(SPM_448, path / "tokenizer.model")
    eng = engine_on(path)
    assert eng.tokenizer.source == str(path / "tokenizer.model")
    assert eng.tokenizer_from == "found in the checkpoint directory"
    obs = Observation(0.0, {}, np.array([0.3, 1.3, 2.9], np.float32), "wave")
    text = action_prompt("wave", eng.norm.normalize_state(obs.state))
    n = eng.model_cfg.max_token_len
    ids = Tokenizer(SPM_448).tokenize(text, n)[0].tolist()
    assert eng.frame(obs).tokens[0].tolist() == ids
    assert ids != Tokenizer.default().tokenize(text, n)[0].tolist()  # another tokenizer
    # Two different ones: which is meant is not guessed; the setting says.
    (path / "paligemma_tokenizer.model").write_bytes(Tokenizer.default().model_proto())
    with pytest.raises(CheckpointError, match="holds different tokenizers"):
        engine_on(path)
    assert engine_on(path, tokenizer=str(SPM_448)).tokenizer_from == "tokenizer"


def test_checking_a_checkpoints_shapes_imports_no_compiler():
    """The shapes a checkpoint must have come from the model built on the meta device;
    drawing initial values there would import torch._dynamo (2 s of every start-up of a
    node, eval or replay with a checkpoint). A fresh interpreter, as a node is."""
    code = ("import sys; from oxygen_ros.model import load_config; "
            "from oxygen_ros.model.checkpoint import expected_shapes; "
            "shapes = expected_shapes(load_config('pi05')); "
            "print(len(shapes), 'torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    n, dynamo = r.stdout.split()
    assert int(n) > 0 and dynamo == 'False', r.stdout
