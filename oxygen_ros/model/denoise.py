"""The denoise phase: flow-matching sampling with the action expert, which reads the prefix
keys and values prefill left and writes nothing. A part of Pi05 (pi05.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gemma import NEG, ada_norm, rope, time_embedding
from .kv import KV, contiguous_rows
from .rtc import Guide


def flow_times(steps: int, grid: str = "openpi") -> tuple[list[float], float]:
    """Time of each Euler step: "openpi" accumulates them in fp32 (1.0, 0.9, 0.79999995...);
    "lerobot" computes 1 + k*dt in float64 and rounds each to fp32 (1.0, 0.9, 0.8, ...)."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    dt = torch.tensor(-1.0 / steps, dtype=torch.float32)
    if grid == "lerobot":
        return [float(torch.tensor(1.0 + k * (-1.0 / steps), dtype=torch.float32))
                for k in range(steps)], float(dt)
    if grid != "openpi":
        raise ValueError(f"unknown time grid {grid!r}")
    t = torch.tensor(1.0, dtype=torch.float32)
    out = []
    while t >= -dt / 2:
        out.append(float(t))
        t = t + dt
    return out, float(dt)


class Denoise:
    """Pi05's action side: the flow's velocity, Euler sampling (guided or not, dynamic or
    static shapes)."""

    def _modulations(self, times: list[float]):
        """adaRMSNorm (1 + scale, shift, gate) of every expert norm at every step, computed
        once per call: they depend on the time only. Returns [step][norm] -> tuple."""
        t = torch.tensor(times, dtype=torch.float32, device=self.device)
        per_norm = [list(zip(*(x.unbind(0) for x in m), strict=True))
                    for m in self._norm_modulations(t)]
        return [list(m) for m in zip(*per_norm, strict=True)]

    def _norm_modulations(self, t: torch.Tensor) -> list[tuple]:
        """[norm] -> (1 + scale, shift, gate), each [len(t), width], at times ``t``."""
        e = self.cfg.expert
        c = F.silu(F.linear(time_embedding(t, e.width), self.time_in.weight, self.time_in.bias))
        c = F.silu(F.linear(c, self.time_out.weight, self.time_out.bias))
        dense = [n for blk in self.expert for n in (blk.norm1, blk.norm2)] + [self.expert_norm]
        out = []
        for d in dense:
            scale, shift, gate = F.linear(c.to(d.weight.dtype), d.weight, d.bias).float() \
                .chunk(3, -1)
            out.append((1.0 + scale, shift, gate.to(self.dtype)))
        return out

    def velocity(self, kv: KV, rows: slice, x_t: torch.Tensor,
                 t: torch.Tensor) -> torch.Tensor:
        """The flow's velocity [B, horizon, action_dim] at ``x_t`` and time ``t`` [B] (one per
        row), from the prefix that prefill left in ``rows``: what each denoise step computes
        (there all rows share one time), with gradients where the parameters take them.
        Training's flow-matching loss is on it."""
        b = x_t.shape[0]
        rows = contiguous_rows(rows, kv, b)
        if t.shape != (b,):
            raise ValueError(f"t must be [{b}], one time per row, got {tuple(t.shape)}")
        lp = int(kv.length[rows].max())
        mods = [tuple(x[:, None] for x in m)
                for m in self._norm_modulations(t.to(self.device, torch.float32))]
        inputs = self._denoise_inputs(kv, rows, x_t.shape[1], lp)
        return self._velocity(x_t.to(self.device, torch.float32), mods, *inputs)

    def denoise(self, kv: KV, rows: slice, noise: torch.Tensor, steps: int = 10,
                cols: int | None = None, trace: list | None = None,
                guide: Guide | None = None) -> torch.Tensor:
        """Flow-matching sampling from noise [B, horizon, action_dim] -> fp32 actions.

        Reads the prefix keys/values of ``rows`` in place and writes nothing, so it must see
        the rows as prefill left them (before any decoded token). ``cols`` fixes the number
        of key columns read (default: the rows' longest length) for static shapes. With a
        list as ``trace`` the velocity of every step is appended to it. A ``guide`` (rtc.py)
        steers the sample towards the chunk being executed (real-time chunking).
        """
        if guide is None:
            with torch.no_grad():
                return self._denoise(kv, rows, noise, steps, cols, trace, None)
        # The guidance differentiates through the expert: leave inference mode (callers run
        # in it) so that the tensors built here can be saved for the backward pass. The
        # prefix keys/values are views of the cache, which autograd may save as they are.
        with torch.inference_mode(False), torch.no_grad():
            return guide.finish(self._denoise(kv, rows, noise, steps, cols, trace, guide))

    def _denoise(self, kv, rows, noise, steps, cols, trace, guide):
        b = noise.shape[0]
        rows = contiguous_rows(rows, kv, b)
        times, dtime = flow_times(steps, self.cfg.time_grid)
        lp = int(kv.length[rows].max()) if cols is None else cols
        mods = self._modulations(times)
        inputs = self._denoise_inputs(kv, rows, noise.shape[1], lp)
        x = noise.to(self.device, torch.float32)
        for step in range(len(times)):
            if guide is None:
                v = self._velocity(x, mods[step], *inputs)
            else:
                v = guide.velocity(x, times[step], lambda y, m=mods[step]: self._velocity(
                    y, m, *inputs))
            if trace is not None:
                trace.append(v)
            x = x + dtime * v
        return x

    @torch.no_grad()
    def denoise_static(self, kv: KV, rows: torch.Tensor, noise: torch.Tensor, cols: int,
                       mods: list, dtime: float) -> torch.Tensor:
        """denoise with static shapes and no host synchronisation, for CUDA graph capture:
        ``rows`` is an index tensor [B] (the prefix is gathered once per call), ``cols``
        fixes the key columns (masked past each row's valid ones), ``mods`` and ``dtime``
        come from ``flow_schedule``. Unguided only: the guided path differentiates."""
        inputs = self._denoise_inputs(kv, rows, noise.shape[1], cols)
        x = noise.to(self.device, torch.float32)
        for m in mods:
            x = x + dtime * self._velocity(x, m, *inputs)
        return x

    def flow_schedule(self, steps: int) -> tuple[list, float]:
        """Per-step expert modulations and the Euler step size, for denoise_static."""
        times, dtime = flow_times(steps, self.cfg.time_grid)
        return self._modulations(times), dtime

    def _denoise_inputs(self, kv: KV, rows, t: int, lp: int):
        """What every denoise step reads: the prefix keys (transposed) and values, the key
        bias, the chunk's rotary tables. ``rows`` a slice reads the cache in place; an index
        tensor gathers copies (static addresses whichever rows are chosen)."""
        if isinstance(rows, slice):
            def take(x):
                return x[rows]
        else:
            def take(x):
                return x.index_select(0, rows)
        valid = take(kv.valid[:, :lp])
        b = valid.shape[0]
        bias = torch.zeros(b, 1, 1, lp + t, device=self.device)
        bias[:, 0, 0, :lp].masked_fill_(~valid, NEG)
        pos = take(kv.next_pos)[:, None] + torch.arange(t, device=self.device)
        cos_t, sin_t = self._rope_for(int(kv.max_len) + t + 1)
        cos, sin = cos_t[pos].unsqueeze(2), sin_t[pos].unsqueeze(2)
        prefix = [(take(kv.k[i][:, :, :lp]).transpose(-1, -2), take(kv.v[i][:, :, :lp]))
                  for i in range(self.cfg.expert.depth)]
        return prefix, bias, cos, sin, lp

    def _velocity(self, x, mods, prefix, bias, cos, sin, lp):
        e = self.cfg.expert
        b, t, _ = x.shape
        kvh, d = e.kv_heads, e.head_dim
        gt = (e.heads // kvh) * t
        h = F.linear(x, self.action_in.weight, self.action_in.bias).to(self.dtype)
        for i, blk in enumerate(self.expert):
            scale, shift, gate = mods[2 * i]
            q, k, v = blk.qkv_heads(ada_norm(h, scale, shift))
            q = (rope(q, cos, sin) * d ** -0.5).transpose(1, 2).reshape(b, kvh, gt, d)
            k = rope(k, cos, sin).permute(0, 2, 3, 1)  # [b, kvh, d, t]
            v = v.transpose(1, 2)
            # One softmax over [prefix | chunk] keys, in one product each for the scores
            # and the values: a copy of the prefix's keys and values per step costs less
            # than the two extra products and the scores' concatenation.
            kp, vp = prefix[i]
            s = q @ torch.cat((kp, k), -1)
            p = torch.softmax(s.float() + bias, -1).to(self.dtype)
            o = p @ torch.cat((vp, v), -2)
            o = o.view(b, e.heads, t, d).transpose(1, 2).reshape(b, t, e.heads * d)
            h = h + F.linear(o, blk.o.weight) * gate
            scale, shift, gate = mods[2 * i + 1]
            h = h + blk.mlp(ada_norm(h, scale, shift)) * gate
        scale, shift, _ = mods[-1]
        h = ada_norm(h, scale, shift)
        return F.linear(h.float(), self.action_out.weight, self.action_out.bias)
