"""The published pi0.5 widths (Gemma 2B, Gemma 300M expert with head_dim 256, SigLIP So400m)
run through all three phases, shortened in depth and vocabulary to fit a unit test."""
import pytest
import torch

from oxygen_ros.model import KV, Pi05, load_config

torch.set_num_threads(2)


@pytest.fixture(scope='module')
def model():
    cfg = load_config('pi05', vocab=1024, vlm={'depth': 2}, expert={'depth': 2},
                      vision={'depth': 1}, max_token_len=16)
    torch.manual_seed(0)
    m = Pi05(cfg).to_inference('cpu', torch.float32)
    with torch.no_grad():  # zero-initialised layers (adaRMS) would hide mistakes
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m


def test_published_widths_match_the_uncached_reference(model):
    cfg = model.cfg
    assert (cfg.vlm.width, cfg.expert.width, cfg.vlm.head_dim, cfg.vision.width) == \
        (2048, 1024, 256, 1152)
    kv = KV.allocate(cfg, 1, cfg.prefix_len + 4)
    g = torch.Generator().manual_seed(1)
    images = torch.rand(1, 3, 3, 224, 224, generator=g) * 2 - 1
    image_mask = torch.tensor([[True, False, True]])
    tokens = torch.randint(3, 1000, (1, 16), generator=g)
    token_mask = torch.arange(16)[None] < 9
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g)
    with torch.inference_mode():
        model.prefill(images, image_mask, tokens, token_mask, kv, slice(0, 1))
        trace = []
        actions = model.denoise(kv, slice(0, 1), noise, 2, trace=trace)
        velocity = model.forward_full(images, image_mask, tokens, token_mask, noise, 1.0)
        logits = model.decode_step(kv, torch.tensor([0]), torch.tensor([5]))
        reference = model.forward_text(images, image_mask, tokens, token_mask,
                                       torch.tensor([[5]]))[:, -1]
    assert actions.shape == (1, 10, 32) and torch.isfinite(actions).all()
    assert velocity.abs().max() > 0.1
    torch.testing.assert_close(trace[0], velocity, rtol=1e-4, atol=1e-4)
    scale = reference.abs().max()
    assert scale > 1.0
    torch.testing.assert_close(logits / scale, reference / scale, rtol=1e-5, atol=1e-5)
