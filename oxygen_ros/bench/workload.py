"""What every benchmark here runs: the model (random weights, seed 0) and its observations."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..engine import Observation, random_model
from ..model import load_config
from ..model.tokenizer import Tokenizer

PROMPT = 'pick up the red cube and place it in the bowl'


def _sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


def bench_model(config: str, device: str, threads: int):
    """What every benchmark here runs on: random weights (seed 0) in bfloat16 on CUDA, float32
    elsewhere, the built-in tokenizer, `threads` torch threads."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == 'cuda' else torch.float32
    torch.manual_seed(0)
    return random_model(load_config(config), dev, dtype).eval(), Tokenizer.default(), dev


def observations(model_cfg, n: int, cameras: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    size = model_cfg.vision.image_size
    for i in range(n):
        images = {slot: (rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                         if j < cameras else None)
                  for j, slot in enumerate(model_cfg.image_slots)}
        state = rng.uniform(-1, 1, 14).astype(np.float32)
        yield Observation(stamp=i * 0.1, images=images, state=state, prompt=PROMPT)


def _ms(fn, device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t) * 1e3


def _median_ms(fn, device, repeats: int) -> float:
    return float(np.median([_ms(fn, device) for _ in range(repeats)]))


def times(x) -> str:
    """A ratio for a table: '-' where it has no value (one mode run alone has nothing to be
    compared with), never 'nanx'."""
    return f'{x:.2f}x' if x is not None and np.isfinite(x) else '-'


def gemm_gflops(device, size: int = 2048, repeats: int = 5) -> float:
    """The machine's matrix-product rate at the current threads: the median of ``repeats``
    float32 [size x size] products, in GFLOP/s. What the model's own rate is compared with,
    measured in the same run (machines here differ and drift)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=g)
    b = torch.randn(size, size, device=device, generator=g)
    a @ b
    return 2 * size ** 3 / (_median_ms(lambda: a @ b, device, repeats) * 1e6)


def frame_flops(engine, obs) -> dict:
    """FLOPs of one frame's phases on ``engine`` (torch's FLOP counter on the eager model,
    whichever runner the engine has): the action path (prefill and denoise of ``obs``) and
    one decode step at batch 1."""
    from torch.utils.flop_counter import FlopCounterMode

    f = engine.frame(obs)
    m, kv = engine.model, engine.cache.kv
    row = engine.cache.scratch
    out = {}
    with torch.inference_mode():
        with FlopCounterMode(display=False) as c:
            m.prefill(f.images, f.image_mask, f.tokens, f.token_mask, kv, slice(row, row + 1))
        out['prefill'] = c.get_total_flops()
        with FlopCounterMode(display=False) as c:
            m.denoise(kv, slice(row, row + 1), f.noise, engine.denoise_steps)
        out['denoise'] = c.get_total_flops()
        with FlopCounterMode(display=False) as c:
            m.decode_step(kv, torch.tensor([row]), torch.tensor([5]))
        out['decode_step'] = c.get_total_flops()
    kv.clear(slice(row, row + 1))
    out['action_path'] = out['prefill'] + out['denoise']
    return out
