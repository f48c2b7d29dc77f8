"""Gemma building blocks shared by the VLM backbone and the action expert."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ExpertConfig

EPS = 1e-6
# Finite, so a fully masked row degrades to a uniform softmax instead of NaN.
NEG = -1e30


def rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), eps=EPS)


class Embedding(nn.Embedding):
    """nn.Embedding that draws no initial values on the meta device, where a model is built
    only for its parameters' shapes (checkpoint.expected_shapes): there torch's normal_
    goes through its Python reference, whose first call imports torch._dynamo, 2 s of every
    checkpoint load."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    """Gemma's norm: weights are stored as an offset from one."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms(x) * (1.0 + self.weight.float())).to(x.dtype)


def ada_norm(x: torch.Tensor, scale1: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """adaRMSNorm with precomputed (1 + scale) and shift, both fp32."""
    return torch.addcmul(shift, rms(x), scale1).to(x.dtype)


class Block(nn.Module):
    """One expert's weights in one layer of the mixture; attention is run by the caller."""

    def __init__(self, e: ExpertConfig, adaptive: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = e.heads, e.kv_heads, e.head_dim
        self.sizes = (e.heads * e.head_dim, e.kv_heads * e.head_dim, e.kv_heads * e.head_dim)
        if adaptive:
            # cond -> (scale, shift, gate); the expert's time conditioning.
            self.norm1 = nn.Linear(e.width, 3 * e.width)
            self.norm2 = nn.Linear(e.width, 3 * e.width)
        else:
            self.norm1 = RMSNorm(e.width)
            self.norm2 = RMSNorm(e.width)
        self.qkv = nn.Linear(e.width, sum(self.sizes), bias=False)
        self.o = nn.Linear(e.heads * e.head_dim, e.width, bias=False)
        self.gate_up = nn.Linear(e.width, 2 * e.mlp, bias=False)
        self.down = nn.Linear(e.mlp, e.width, bias=False)

    def qkv_heads(self, h: torch.Tensor):
        """[..., T, width] -> q [..., T, heads, d], k and v [..., T, kv_heads, d] (views)."""
        q, k, v = F.linear(h, self.qkv.weight).split(self.sizes, -1)
        d = self.head_dim
        return (q.unflatten(-1, (self.heads, d)), k.unflatten(-1, (self.kv_heads, d)),
                v.unflatten(-1, (self.kv_heads, d)))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, self.gate_up.weight).chunk(2, -1)
        return F.linear(F.gelu(gate, approximate="tanh") * up, self.down.weight)


def rope_table(n: int, dim: int, base: float, device, dtype):
    """cos and sign-folded sin for positions 0..n-1 (Gemma's half-split rotation)."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
    cos = torch.cat((ang.cos(), ang.cos()), -1)
    sin = torch.cat((-ang.sin(), ang.sin()), -1)
    return cos.to(device, dtype), sin.to(device, dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, d]; cos, sin [..., T, 1, d] from rope_table."""
    d = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., d:], x[..., :d]), -1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Grouped-query attention through SDPA.

    q [B, T, H, d]; k, v [B, KVH, S, d]; mask None or bool [B, 1, 1 or G*T, S] (True =
    attend). The query heads sharing a kv head are folded into the sequence axis, so the
    keys are never repeated. Returns [B, T, H*d].
    """
    b, t, h, d = q.shape
    kvh = k.shape[1]
    qf = q.transpose(1, 2).reshape(b, kvh, (h // kvh) * t, d)
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)
    return o.view(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-query mask [B, 1, T, S] -> [B, 1, groups*T, S], matching attend's folding."""
    b, _, t, s = mask.shape
    return mask.unsqueeze(2).expand(b, 1, groups, t, s).reshape(b, 1, groups * t, s)


def time_embedding(t: torch.Tensor, dim: int, lo: float = 4e-3, hi: float = 4.0):
    """sin/cos embedding of flow-matching time with periods from lo to hi; fp32 [n, dim]."""
    frac = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    scale = 2 * math.pi / (lo * (hi / lo) ** frac)
    x = t.to(torch.float64)[:, None] * scale
    return torch.cat((x.sin(), x.cos()), -1).float()
