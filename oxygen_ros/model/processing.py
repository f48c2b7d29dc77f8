"""Image preparation and state/action normalisation, in openpi's or LeRobot's conventions.

The two implementations of pi0.5 prepare the same inputs slightly differently, and a
checkpoint is only reproduced by the conventions it was trained and exported with:
  openpi:  images resized as uint8 with PIL's antialiased bilinear filter; normalisation in
           float64 with 1e-6 added to every denominator (q01/q99 or mean/std);
  lerobot: images resized as float [0, 1] with plain bilinear interpolation (no antialias),
           clamped; normalisation in float32 with LeRobot's modes (QUANTILES, QUANTILE10,
           MEAN_STD, MIN_MAX, IDENTITY), eps only where LeRobot adds it.
Both pad images centred with black and bin the state at the robot's own dims.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

EPS = 1e-6  # openpi's
CONVENTIONS = ("openpi", "lerobot")


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


def crop(image: np.ndarray, box: tuple[float, float, float, float] | None) -> np.ndarray:
    """The part of an HxWxC image inside `box` (fractions x0, y0, x1, y1 of its width and
    height, edges rounded to the nearest pixel, at least one pixel); None: the whole image."""
    if box is None:
        return image
    if image.ndim != 3:
        raise ValueError(f"expected an HxWxC image to crop, got shape {image.shape}")
    h, w = image.shape[:2]
    x0, y0, x1, y1 = box
    left, top = min(round(x0 * w), w - 1), min(round(y0 * h), h - 1)
    right, bottom = max(round(x1 * w), left + 1), max(round(y1 * h), top + 1)
    return image[top:bottom, left:right]


def resize_with_pad_float(image: np.ndarray, height: int, width: int) -> torch.Tensor:
    """LeRobot's path: uint8 HxWx3 -> float 3xHxW in [0, 1], resized with plain bilinear
    interpolation (no antialias), clamped, and padded centred with 0 (same geometry as
    resize_with_pad)."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 HxWx3 image, got {image.dtype} {image.shape}")
    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float().div(255.0)
    cur_h, cur_w = image.shape[:2]
    if (cur_h, cur_w) == (height, width):
        return x
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    x = F.interpolate(x[None], size=(new_h, new_w), mode="bilinear", align_corners=False)
    x = x.clamp(0.0, 1.0)[0]
    top, left = (height - new_h) // 2, (width - new_w) // 2
    return F.pad(x, (left, width - new_w - left, top, height - new_h - top), value=0.0)


def to_model_image(image: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 HxWx3 -> float32 3xHxW in [-1, 1], the range SigLIP was trained on."""
    x = torch.as_tensor(np.asarray(image))
    if x.dtype != torch.uint8 or x.ndim != 3 or x.shape[2] != 3:
        raise ValueError(f"expected a uint8 HxWx3 image, got {x.dtype} {tuple(x.shape)}")
    return x.permute(2, 0, 1).float().div(255.0).mul(2.0).sub(1.0).contiguous()


def prepare_image(image: np.ndarray, height: int = 224, width: int = 224,
                  conventions: str = "openpi") -> torch.Tensor:
    """uint8 HxWx3 of any size -> float32 3 x height x width in [-1, 1]."""
    if conventions == "lerobot":
        return resize_with_pad_float(image, height, width).mul(2.0).sub(1.0).contiguous()
    if conventions != "openpi":
        raise ValueError(f"conventions must be one of {CONVENTIONS}, got {conventions!r}")
    return to_model_image(resize_with_pad(image, height, width))


MODES = ("QUANTILES", "QUANTILE10", "MEAN_STD", "MIN_MAX", "IDENTITY")
# The two statistics each mode maps to [-1, 1] (or centres and scales by).
_NEEDS = {"QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90"), "MIN_MAX": ("min", "max"),
          "MEAN_STD": ("mean", "std"), "IDENTITY": ()}


@dataclass(frozen=True)
class Stats:
    """One feature's statistics and the mode they are applied with."""

    values: dict[str, np.ndarray]
    mode: str = "QUANTILES"

    @classmethod
    def from_dict(cls, d: dict[str, Any], mode: str = "QUANTILES", what: str = "") -> Stats:
        if mode not in MODES:
            raise ValueError(f"unknown normalisation mode {mode!r}; known: {MODES}")
        values = {k: np.asarray(v, dtype=np.float64) for k, v in d.items() if v is not None}
        need = _NEEDS[mode]
        missing = [k for k in need if k not in values]
        if missing:
            raise ValueError(f"{mode} normalisation{' of ' + what if what else ''} needs "
                             f"{list(need)}; the stats have {sorted(values)}")
        shapes = {values[k].shape for k in need}
        if len(shapes) > 1 or any(len(s) != 1 for s in shapes):
            raise ValueError(f"stats {list(need)}{' of ' + what if what else ''} must be "
                             f"vectors of one length, got shapes {sorted(shapes)}")
        return cls(values, mode)

    @property
    def dim(self) -> int | None:
        need = _NEEDS[self.mode]
        return self.values[need[0]].shape[0] if need else None

    def pair(self, dtype) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = _NEEDS[self.mode]
        return self.values[lo].astype(dtype), self.values[hi].astype(dtype)


class NormStats:
    """State and action normalisation in one of the CONVENTIONS.

    openpi: QUANTILES (pi0.5) or MEAN_STD (pi0), float64, 1e-6 in every denominator; the
    stats cover the robot's dims, dims past them pass through (openpi pads the stats with
    the identity) and a shorter vector uses the first ones (openpi slices them).
    lerobot: any of MODES, float32 with LeRobot's order of operations and its eps (1e-8,
    from the processor file) where LeRobot adds one; the vector must have the stats' dims.
    ``state`` None: the state is not normalised (IDENTITY).
    """

    def __init__(self, state: Stats | None, actions: Stats, conventions: str = "openpi",
                 eps: float = 1e-8):
        if conventions not in CONVENTIONS:
            raise ValueError(f"conventions must be one of {CONVENTIONS}, got {conventions!r}")
        if conventions == "openpi":
            for name, s in (("state", state), ("actions", actions)):
                if s is not None and s.mode not in ("QUANTILES", "MEAN_STD", "IDENTITY"):
                    raise ValueError(f"openpi normalises with QUANTILES or MEAN_STD, not "
                                     f"{s.mode} ({name})")
        self.state = state
        self.actions = actions
        self.conventions = conventions
        self.eps = float(eps)

    @classmethod
    def from_dict(cls, d: dict[str, Any], quantile: bool = True) -> NormStats:
        """openpi's norm_stats.json content: {"state": {...}, "actions": {...}}."""
        d = d.get("norm_stats", d)
        missing = [k for k in ("state", "actions") if k not in d]
        if missing:
            raise ValueError(f"norm stats lack {missing}; keys are {sorted(d)}")
        mode = "QUANTILES" if quantile else "MEAN_STD"
        return cls(Stats.from_dict(d["state"], mode, "state"),
                   Stats.from_dict(d["actions"], mode, "actions"))

    @classmethod
    def from_json(cls, path: str | Path, quantile: bool = True) -> NormStats:
        with open(path) as f:
            return cls.from_dict(json.load(f), quantile)

    @property
    def modes(self) -> dict[str, str]:
        return {"state": self.state.mode if self.state else "IDENTITY",
                "actions": self.actions.mode}

    def _apply(self, x: np.ndarray, s: Stats | None, name: str, inverse: bool) -> np.ndarray:
        if s is None or s.mode == "IDENTITY":
            return np.array(x, dtype=np.float32 if self.conventions == "lerobot" else None)
        if self.conventions == "openpi":
            return self._openpi(x, s, inverse)
        x = np.array(x, dtype=np.float32)
        if x.shape[-1] != s.dim:
            raise ValueError(f"{name} has {x.shape[-1]} dims but its stats {s.dim}")
        return self._lerobot(x, s, inverse)

    @staticmethod
    def _openpi(x: np.ndarray, s: Stats, inverse: bool) -> np.ndarray:
        x = np.array(x, dtype=np.float64)
        k = min(s.dim, x.shape[-1])
        lo, hi = (a[:k] for a in s.pair(np.float64))
        v = x[..., :k]
        if s.mode == "QUANTILES":
            span = hi - lo + EPS
            x[..., :k] = (v + 1.0) / 2.0 * span + lo if inverse else (v - lo) / span * 2.0 - 1.0
        else:  # MEAN_STD: lo, hi are mean, std
            x[..., :k] = v * (hi + EPS) + lo if inverse else (v - lo) / (hi + EPS)
        return x

    def _lerobot(self, x: np.ndarray, s: Stats, inverse: bool) -> np.ndarray:
        lo, hi = s.pair(np.float32)
        eps = np.float32(self.eps)
        if s.mode == "MEAN_STD":
            return x * hi + lo if inverse else (x - lo) / (hi + eps)
        denom = hi - lo
        denom = np.where(denom == 0, eps, denom)
        if s.mode == "MIN_MAX":
            return (x + 1) / 2 * denom + lo if inverse else 2 * (x - lo) / denom - 1
        return (x + 1.0) * denom / 2.0 + lo if inverse else 2.0 * (x - lo) / denom - 1.0

    def normalize_state(self, x: np.ndarray) -> np.ndarray:
        return self._apply(x, self.state, "state", False)

    def unnormalize_state(self, x: np.ndarray) -> np.ndarray:
        return self._apply(x, self.state, "state", True)

    def normalize_actions(self, a: np.ndarray) -> np.ndarray:
        return self._apply(a, self.actions, "actions", False)

    def unnormalize_actions(self, a: np.ndarray) -> np.ndarray:
        return self._apply(a, self.actions, "actions", True)


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
