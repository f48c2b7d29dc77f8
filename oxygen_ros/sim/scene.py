"""A synthetic table-top camera image for image tests and benchmarks.

Random noise is the worst case for JPEG and PNG and nothing like a camera's picture, so
compression is measured on this instead: a lit wall (smooth gradient), a wooden table (grain
texture), three shaded objects with hard edges and a highlight, a shadow, a dark gripper in
front, and sensor noise (sigma 2 levels). numpy only.
"""

from __future__ import annotations

import numpy as np


def render(width: int = 640, height: int = 480, seed: int = 0) -> np.ndarray:
    """An HxWx3 uint8 RGB image; `seed` moves the objects and the noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = x / width, y / height
    horizon = 0.45
    # Wall: warm grey, lit from the upper left.
    light = 0.75 + 0.25 * np.exp(-((u - 0.3) ** 2 + (v - 0.1) ** 2) / 0.15)
    img = np.stack([200 * light, 190 * light, 175 * light], axis=2)
    # Table: wood grain (waves along x, warped by a slow wave), darker further away.
    grain = 0.5 + 0.5 * np.sin(60 * u + 6 * np.sin(9 * v + 3 * u) + rng.uniform(0, 6))
    depth = np.clip((v - horizon) / (1 - horizon), 0, 1)
    wood = np.stack([150 + 40 * grain, 100 + 30 * grain, 60 + 20 * grain], axis=2)
    wood *= (0.7 + 0.3 * depth)[..., None]
    table = v >= horizon
    img[table] = wood[table]
    img[np.abs(v - horizon) < 2 / height] = (70, 50, 35)  # the table's edge

    cx, cy = rng.uniform(0.25, 0.4), rng.uniform(0.62, 0.72)
    # A shadow under the objects.
    shadow = np.exp(-(((u - cx - 0.15) / 0.25) ** 2 + ((v - cy - 0.08) / 0.06) ** 2))
    img *= (1 - 0.35 * shadow * table)[..., None]
    # A red box: a front face and a lighter top.
    bx, by, bw, bh = cx - 0.08, cy - 0.05, 0.12, 0.14
    front = (u > bx) & (u < bx + bw) & (v > by) & (v < by + bh)
    top = (v > by - 0.05) & (v <= by) & (u > bx + (by - v) * 0.8) & (u < bx + bw + (by - v) * 0.8)
    img[front] = (np.array([180, 30, 35]) * (0.8 + 0.2 * (u[front] - bx) / bw)[:, None])
    img[top] = (220, 70, 70)
    # A green ball, shaded, with a highlight.
    r2 = ((u - cx - 0.22) / 0.07) ** 2 + ((v - cy + 0.02) * height / width / 0.07) ** 2
    ball = r2 < 1
    shade = np.clip(1 - 0.6 * ((u - cx - 0.2) / 0.07 + (v - cy + 0.05) * 8), 0.3, 1.2)
    img[ball] = np.stack([40 * shade[ball], 160 * shade[ball], 60 * shade[ball]], axis=1)
    spot = ((u - cx - 0.2) ** 2 + ((v - cy + 0.04) * height / width) ** 2) < 0.012 ** 2
    img[spot] = (245, 250, 245)
    # A blue cup: vertical shading across it.
    ux = (u - cx - 0.4) / 0.05
    cup = (np.abs(ux) < 1) & (v > cy - 0.12) & (v < cy + 0.06)
    img[cup] = np.stack([30 + 30 * (1 - ux[cup] ** 2), 60 + 50 * (1 - ux[cup] ** 2),
                         150 + 80 * (1 - ux[cup] ** 2)], axis=1)
    # The gripper: two dark fingers coming in from the top.
    for fx in (0.55, 0.63):
        finger = (u > fx) & (u < fx + 0.03) & (v < 0.35)
        img[finger] = (45, 45, 50)
    img[(u > 0.53) & (u < 0.68) & (v < 0.08)] = (60, 60, 65)
    img += rng.normal(0, 2.0, img.shape)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)
