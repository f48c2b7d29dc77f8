"""Weights for the engine: a checkpoint opened, or random ones for timing and simulation."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..model import Pi05, load_config
from ..model.checkpoint import Checkpoint, open_checkpoint

if TYPE_CHECKING:
    from .config import EngineConfig


def random_model(model_cfg, device: torch.device, dtype: torch.dtype) -> Pi05:
    """Random weights (timing, demos), initialised where they will run: the full pi05
    config is 13 GB in float32, too much to build on the host first."""
    with torch.device(device):
        model = Pi05(model_cfg)
    return model.to_inference(device, dtype)


def load(cfg: EngineConfig, device: torch.device) -> Checkpoint:
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    if cfg.checkpoint:
        path = Path(cfg.checkpoint)
        if not path.exists():
            raise FileNotFoundError(f'checkpoint not found: {path}')
        ckpt = open_checkpoint(path, load_config(cfg.model) if cfg.model else None, device,
                               dtype, cfg.asset_id or None, cfg.normalize,
                               cfg.conventions or None)
    else:
        torch.manual_seed(cfg.seed)
        conventions = cfg.conventions or 'openpi'
        model = random_model(load_config(cfg.model or 'small', time_grid=conventions), device,
                             dtype)
        mc = model.cfg
        ckpt = Checkpoint(model, None, 'random', conventions, tuple(mc.image_slots), None,
                          mc.action_dim, mc.action_horizon, mc.action_horizon, None)
    ckpt.model.eval()
    return ckpt
