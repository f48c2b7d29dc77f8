"""Real-time chunking (Black, Galliker, Levine 2025, arXiv 2506.07339).

While the next chunk is sampled, the robot keeps executing the previous one. RTC treats the
switch as inpainting: the actions that will have run before the new chunk arrives (the
inference delay d) must equal the previous chunk's, the rest of the overlap should stay
close to it with a weight that decays towards the end, and the tail is free. Each Euler step
of flow matching adds a guidance term (pseudo-inverse guidance): the weighted error between
the previous actions and the step's predicted clean chunk, pulled back through the action
expert with one vector-Jacobian product.

Time here is openpi's: t runs from 1 (noise) to 0 (actions), x_t = t * noise + (1 - t) * a
and the expert predicts v = noise - a, so the clean estimate is x_t - t * v. The paper's
time is tau = 1 - t and its velocity is -v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def weights(horizon: int, delay: int, overlap: int) -> torch.Tensor:
    """Soft mask over the new chunk's steps: 1 for the first ``delay`` (they are already
    executed by the time the chunk arrives), an exponential decay over the rest of the
    ``overlap`` with the previous chunk, 0 after it."""
    if not 0 <= delay <= overlap <= horizon:
        raise ValueError(f'need 0 <= delay ({delay}) <= overlap ({overlap}) <= horizon '
                         f'({horizon})')
    w = torch.zeros(horizon, dtype=torch.float32)
    w[:delay] = 1.0
    i = torch.arange(delay, overlap, dtype=torch.float32)
    c = (overlap - i) / (overlap - delay + 1)
    w[delay:overlap] = c * torch.expm1(c) / (math.e - 1.0)
    return w


def guidance_scale(t: float, beta: float) -> float:
    """The paper's clipped weight min(beta, (1 - tau) / (tau * r^2)), with tau = 1 - t and
    r^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2)."""
    tau = 1.0 - t
    if tau <= 0.0:
        return beta
    r2 = (1.0 - tau) ** 2 / (tau ** 2 + (1.0 - tau) ** 2)
    if r2 == 0.0:
        return beta
    return min(beta, (1.0 - tau) / (tau * r2))


def guided(x: torch.Tensor, t: float, beta: float, velocity, error) -> torch.Tensor:
    """The expert's velocity ``velocity(x)`` less the guidance toward a target: the gradient
    of the clean estimate x - t v with respect to x, weighted by ``error(clean)`` (the
    weighted distance to the target, a constant of the product: only the Jacobian's path is
    recorded)."""
    scale = guidance_scale(t, beta)
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        v = velocity(x)
        if scale == 0.0:
            return v.detach()
        clean = x - t * v
        (g,) = torch.autograd.grad(clean, x, error(clean.detach()).to(clean.dtype))
    return v.detach() - scale * g


@dataclass(frozen=True)
class Handover:
    """Where a new chunk joins the one being executed, in action steps: step 0 of the new
    chunk is step ``start`` of the previous one, and ``delay`` steps will have been executed
    (from the previous chunk) by the time the new one is out.

    ``previous`` is the chunk being executed, in the engine's output units but expressed
    for the new frame ([horizon, n], n <= action dim). It is needed when actions are
    relative to the observed state (delta or velocity profiles), since the same motion is
    then different numbers in the new frame. Without it the engine reuses its own last
    chunk, which is right when actions are absolute."""

    start: int
    delay: int
    previous: np.ndarray | None = None


@dataclass
class Guide:
    """What a guided denoise needs: the previous chunk's actions aligned to the new chunk's
    steps (model space, [horizon, action_dim], anything past the overlap ignored), the mask
    from ``weights``, the delay whose steps are copied exactly, and beta, the largest
    guidance weight."""

    target: torch.Tensor
    weights: torch.Tensor
    delay: int
    beta: float = 5.0
    columns: int | None = None  # action dims guided (the robot's); the rest are free
    # Dims of those left free anyway (their frozen steps are still copied): see
    # ModelInputs.unguided.
    free: tuple[int, ...] = ()

    @classmethod
    def make(cls, previous: torch.Tensor, start: int, delay: int, beta: float = 5.0,
             columns: int | None = None, free: tuple[int, ...] = ()) -> Guide:
        """The guide for a chunk whose first step is step ``start`` of ``previous``
        ([horizon, action_dim]); ``delay`` steps of it run before the new chunk arrives."""
        h = previous.shape[0]
        if not 0 <= start < h:
            raise ValueError(f'start must be in [0, {h}), got {start}')
        overlap = h - start
        if not 0 <= delay <= overlap:
            raise ValueError(f'delay must be in [0, {overlap}] for start {start} of a '
                             f'{h}-step chunk, got {delay}')
        if beta < 0:
            raise ValueError(f'beta must be >= 0, got {beta}')
        target = torch.zeros_like(previous, dtype=torch.float32)
        target[:overlap] = previous[start:].float()
        return cls(target, weights(h, delay, overlap), delay, beta, columns, tuple(free))

    def velocity(self, x: torch.Tensor, t: float, velocity) -> torch.Tensor:
        """Guided velocity at ``x`` [b, horizon, dim], time ``t``; ``velocity(x)`` is the
        expert's."""
        return guided(x, t, self.beta, velocity, self._error)

    def _error(self, clean: torch.Tensor) -> torch.Tensor:
        err = (self.target.to(clean.device) - clean) * self.weights.to(clean.device)[:, None]
        if self.columns is not None:
            err[..., self.columns:] = 0.0
        if self.free:
            err[..., list(self.free)] = 0.0
        return err

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The steps that run before the chunk arrives are the previous chunk's, exactly.
        With beta 0 there is no guidance at all and the sample is left as it is."""
        if self.beta == 0.0:
            return x
        x = x.clone()
        x[:, : self.delay, : self.columns] = \
            self.target[: self.delay, : self.columns].to(x.device, x.dtype)
        return x
