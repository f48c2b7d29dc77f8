"""Image preparation and state/action normalisation, with openpi's conventions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

EPS = 1e-6


def resize_with_pad(image: np.ndarray, height: int = 224, width: int = 224) -> np.ndarray:
    """Fit a uint8 HxWxC image into height x width without distortion, centred on black.

    Same geometry as openpi: the scale is set by the tighter side, sizes are truncated
    with int(), and an odd remainder of padding goes to the bottom/right.

    openpi resizes with PIL's bilinear filter, which widens its kernel when shrinking;
    interpolate(antialias=True) does the same, but PIL works in fixed point with its
    own rounding, so a pixel may differ from PIL's by one level (never more in our tests).
    """
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3:
        raise ValueError(f"expected a uint8 HxWxC image, got {image.dtype} {image.shape}")
    cur_h, cur_w = image.shape[:2]
    if (cur_h, cur_w) == (height, width):
        return image.copy()
    ratio = max(cur_w / width, cur_h / height)
    new_h = max(1, int(cur_h / ratio))
    new_w = max(1, int(cur_w / ratio))

    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float()
    if (new_h, new_w) != (cur_h, cur_w):
        x = F.interpolate(
            x, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True
        )
    resized = x.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0).numpy()

    out = np.zeros((height, width, image.shape[2]), dtype=np.uint8)
    top = (height - new_h) // 2
    left = (width - new_w) // 2
    out[top : top + new_h, left : left + new_w] = resized
    return out


def to_model_image(image: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 HxWx3 -> float32 3xHxW in [-1, 1], the range SigLIP was trained on."""
    x = torch.as_tensor(np.asarray(image))
    if x.dtype != torch.uint8 or x.ndim != 3 or x.shape[2] != 3:
        raise ValueError(f"expected a uint8 HxWx3 image, got {x.dtype} {tuple(x.shape)}")
    return x.permute(2, 0, 1).float().div(255.0).mul(2.0).sub(1.0).contiguous()


def prepare_image(image: np.ndarray, height: int = 224, width: int = 224) -> torch.Tensor:
    return to_model_image(resize_with_pad(image, height, width))


def pad_to(x: np.ndarray, dim: int) -> np.ndarray:
    """Zero-pad (or cut) the last axis to `dim`: the model works on a fixed 32-d vector."""
    x = np.asarray(x)
    n = x.shape[-1]
    if n >= dim:
        return x[..., :dim]
    widths = [(0, 0)] * (x.ndim - 1) + [(0, dim - n)]
    return np.pad(x, widths)


@dataclass(frozen=True)
class Stats:
    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray | None = None
    q99: np.ndarray | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Stats:
        def arr(key: str) -> np.ndarray | None:
            v = d.get(key)
            return None if v is None else np.asarray(v, dtype=np.float64)

        mean, std = arr("mean"), arr("std")
        if mean is None or std is None:
            raise ValueError(f"norm stats need 'mean' and 'std', got keys {sorted(d)}")
        return cls(mean, std, arr("q01"), arr("q99"))

    @property
    def dim(self) -> int:
        return self.mean.shape[-1]


def _split(x: np.ndarray, s: Stats) -> tuple[np.ndarray, int]:
    # Stats cover the robot's dims; dims past them are model padding and pass through.
    x = np.array(x, dtype=np.float64)
    return x, min(s.dim, x.shape[-1])


class NormStats:
    """State and action statistics from an openpi norm_stats.json.

    pi0.5 checkpoints use quantile normalisation (q01/q99 -> [-1, 1]); quantile=False
    gives the mean/std variant that pi0 used.
    """

    def __init__(self, state: Stats, actions: Stats, quantile: bool = True):
        if quantile:
            for name, s in (("state", state), ("actions", actions)):
                if s.q01 is None or s.q99 is None:
                    raise ValueError(f"quantile normalisation needs q01/q99 for {name!r}")
        self.state = state
        self.actions = actions
        self.quantile = quantile

    @classmethod
    def from_dict(cls, d: dict[str, Any], quantile: bool = True) -> NormStats:
        d = d.get("norm_stats", d)
        missing = [k for k in ("state", "actions") if k not in d]
        if missing:
            raise ValueError(f"norm stats lack {missing}; keys are {sorted(d)}")
        return cls(Stats.from_dict(d["state"]), Stats.from_dict(d["actions"]), quantile)

    @classmethod
    def from_json(cls, path: str | Path, quantile: bool = True) -> NormStats:
        with open(path) as f:
            return cls.from_dict(json.load(f), quantile)

    def _norm(self, x: np.ndarray, s: Stats) -> np.ndarray:
        x, k = _split(x, s)
        v = x[..., :k]
        if self.quantile:
            x[..., :k] = (v - s.q01[:k]) / (s.q99[:k] - s.q01[:k] + EPS) * 2.0 - 1.0
        else:
            x[..., :k] = (v - s.mean[:k]) / (s.std[:k] + EPS)
        return x

    def _unnorm(self, x: np.ndarray, s: Stats) -> np.ndarray:
        x, k = _split(x, s)
        v = x[..., :k]
        if self.quantile:
            x[..., :k] = (v + 1.0) / 2.0 * (s.q99[:k] - s.q01[:k] + EPS) + s.q01[:k]
        else:
            x[..., :k] = v * (s.std[:k] + EPS) + s.mean[:k]
        return x

    def normalize_state(self, x: np.ndarray) -> np.ndarray:
        return self._norm(x, self.state)

    def unnormalize_state(self, x: np.ndarray) -> np.ndarray:
        return self._unnorm(x, self.state)

    def normalize_actions(self, a: np.ndarray) -> np.ndarray:
        return self._norm(a, self.actions)

    def unnormalize_actions(self, a: np.ndarray) -> np.ndarray:
        return self._unnorm(a, self.actions)


def find_norm_stats(checkpoint_dir: str | Path, asset_id: str | None = None) -> Path:
    """Locate norm_stats.json in an openpi checkpoint (assets/<asset_id>/norm_stats.json)."""
    root = Path(checkpoint_dir)
    if asset_id is not None:
        path = root / "assets" / asset_id / "norm_stats.json"
        if not path.is_file():
            raise FileNotFoundError(f"no norm stats at {path}")
        return path
    found = sorted(root.glob("assets/*/norm_stats.json"))
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        ids = [p.parent.name for p in found]
        raise ValueError(f"{root} holds norm stats for several assets {ids}; pick one")
    if (root / "norm_stats.json").is_file():
        return root / "norm_stats.json"
    raise FileNotFoundError(f"no assets/*/norm_stats.json or norm_stats.json under {root}")
