"""The model runner: runs what the scheduler decided, on the fastest path the device has.

The scheduler decides a frame (which KV rows, which requests, how many decode steps) and
never touches the model; the runner turns each decision into model calls and owns how they
run, as vLLM's model runner owns its CUDA graphs:

- ``eager``: the model's own phases, op by op (the reference every other path is tested
  against);
- ``graphs`` (CUDA): the unguided denoise and the decode step at static shapes, captured as
  CUDA graphs at start-up and replayed (graphs.py; elsewhere the same static calls run
  eagerly, which is how the CPU tests check them);
- ``compiled`` (CPU): the image tower, prefill's layers, each denoise step and the decode
  step as AOTInductor programs, built ahead of time and cached on disk (compiled.py).

On every path the guided denoise of real-time chunking (it differentiates through the
expert) and a question's extension of its row (rare, and of any length) run eagerly. The
runner also owns sampling: the tied output layer and the choice of each request's token.
"""

from __future__ import annotations

import torch

from ..model.denoise import flow_times
from .compiled import Programs, stack_mods
from .graphs import StaticPhases
from .kv_cache import KVCache
from .requests import Request, sample

BACKENDS = ('eager', 'graphs', 'compiled')


class ModelRunner:
    """``backend``: one of BACKENDS. ``robots``: the most observations in one frame (the
    static denoise's batch buckets). ``programs``: the compiled backend's, loaded by the
    caller (it takes long the first time, and says so)."""

    def __init__(self, model, cache: KVCache, denoise_steps: int, backend: str = 'eager',
                 robots: int = 1, programs: Programs | None = None):
        if backend not in BACKENDS:
            raise ValueError(f'backend must be one of {BACKENDS}, got {backend!r}')
        if (backend == 'compiled') != (programs is not None):
            raise ValueError('the compiled backend runs programs, and only it does')
        self.model, self.cache, self.steps = model, cache, denoise_steps
        self.backend = backend
        self.programs = programs
        self.static = StaticPhases(model, cache, denoise_steps, robots) \
            if backend == 'graphs' else None
        self._schedule = None  # (stacked modulations per step, dt) of the compiled denoise

    @property
    def kv(self):
        return self.cache.kv

    # -- the action path -------------------------------------------------------------------

    def prefill(self, images, image_mask, tokens, token_mask, rows: slice) -> torch.Tensor:
        """Observations into the KV ``rows``; the hidden state after each one's prompt."""
        p = self.programs
        if p is None:
            return self.model.prefill(images, image_mask, tokens, token_mask, self.kv, rows)
        return self.model.prefill(images, image_mask, tokens, token_mask, self.kv, rows,
                                  vision=p.vision, layers=p.layers)

    def denoise(self, rows: slice, noise: torch.Tensor, guide=None) -> torch.Tensor:
        """The chunks [B, horizon, action_dim] of the prefixes in ``rows`` (as prefill left
        them), from ``noise``; guided by ``guide`` (real-time chunking) when given."""
        if guide is not None:
            return self.model.denoise(self.kv, rows, noise, self.steps, guide=guide)
        if self.static is not None:
            return self.static.denoise_rows(list(range(rows.start, rows.stop)), noise)
        if self.programs is None:
            return self.model.denoise(self.kv, rows, noise, self.steps)
        return self._compiled_denoise(rows, noise)

    def _compiled_denoise(self, rows: slice, noise: torch.Tensor) -> torch.Tensor:
        model, kv = self.model, self.kv
        if self._schedule is None:
            # The expert's time modulations depend on the weights and the steps only:
            # once per runner (the weights of an engine never change).
            times, dt = flow_times(self.steps, model.cfg.time_grid)
            self._schedule = [stack_mods(m) for m in model._modulations(times)], dt
        mods, dt = self._schedule
        lp = int(kv.length[rows].max())
        prefix, bias, cos, sin, _ = model._denoise_inputs(kv, rows, noise.shape[1], lp)
        # One copy of the prefix per chunk, laid out as the steps read it.
        keys = [k.transpose(-1, -2).contiguous() for k, _ in prefix]
        values = [v.contiguous() for _, v in prefix]
        x = noise.to(model.device, torch.float32)
        velocity = self.programs.velocity
        for mod in mods:
            x = x + dt * velocity(x, mod, keys, values, bias, cos, sin)
        return x

    # -- language --------------------------------------------------------------------------

    def extend(self, row: int, tokens: list[int]) -> torch.Tensor:
        """A question's tokens appended to ``row``; the hidden state after the last."""
        t = torch.tensor(tokens, device=self.kv.device)
        return self.model.extend(self.kv, row, t)

    def copy_row(self, src: int, dst: int) -> None:
        self.kv.copy_row(src, dst)

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """One pass of ``tokens`` into ``rows`` (one each): the hidden states [b, width]."""
        if self.static is not None:
            return self.static.decode_hidden(rows, tokens)
        kv = self.kv
        r = torch.tensor(rows, device=kv.device)
        t = torch.tensor(tokens, device=kv.device)
        if self.programs is None:
            return self.model.decode_hidden(kv, r, t)
        # The program reads every column of a row: the eager pass's check that one is left.
        if int(kv.length[r].max()) >= kv.max_len:
            raise ValueError(f'KV rows are full ({kv.max_len} columns)')
        return self.programs.decode(kv, r, t)

    def sample(self, hidden: torch.Tensor, requests: list[Request],
               vocab_limit: int | None = None) -> list[int]:
        """Each request's next token from its hidden state (one row of ``hidden`` each)."""
        return sample(self.model.logits(hidden), requests, vocab_limit)
