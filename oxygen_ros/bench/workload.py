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
