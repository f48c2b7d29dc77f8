"""SigLIP vision encoder (no pooling head), as used by PaliGemma."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig
from .gemma import Embedding

EPS = 1e-6


class VisionLayer(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.width, eps=EPS)
        # q, k and v fused in one projection; the checkpoint code splits them.
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.out = nn.Linear(c.width, c.width)
        self.ln2 = nn.LayerNorm(c.width, eps=EPS)
        self.fc1 = nn.Linear(c.width, c.mlp)
        self.fc2 = nn.Linear(c.mlp, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, w = x.shape
        h = F.layer_norm(x, (w,), self.ln1.weight, self.ln1.bias, EPS)
        qkv = F.linear(h, self.qkv.weight, self.qkv.bias)
        q, k, v = qkv.view(n, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + F.linear(a.transpose(1, 2).reshape(n, t, w), self.out.weight, self.out.bias)
        h = F.layer_norm(x, (w,), self.ln2.weight, self.ln2.bias, EPS)
        h = F.gelu(F.linear(h, self.fc1.weight, self.fc1.bias), approximate="tanh")
        return x + F.linear(h, self.fc2.weight, self.fc2.bias)


class Siglip(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.cfg = c
        self.patch = nn.Conv2d(3, c.width, c.patch, stride=c.patch)
        self.pos = Embedding(c.tokens, c.width)
        self.layers = nn.ModuleList(VisionLayer(c) for _ in range(c.depth))
        self.post_ln = nn.LayerNorm(c.width, eps=EPS)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] in [-1, 1] -> [n, tokens, width] in the layers' dtype."""
        c = self.cfg
        n = images.shape[0]
        g, p = c.image_size // c.patch, c.patch
        if tuple(images.shape[1:]) != (3, c.image_size, c.image_size):
            raise ValueError(f"images must be [n, 3, {c.image_size}, {c.image_size}], "
                             f"got {tuple(images.shape)}")
        # A stride-p convolution is a matmul over flattened patches; this avoids the
        # convolution's layout conversions. The embedding stays in fp32 like the weights.
        w = self.patch.weight
        x = images.to(w.dtype).view(n, 3, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        x = F.linear(x.reshape(n, g * g, 3 * p * p), w.view(w.shape[0], -1), self.patch.bias)
        x = (x + self.pos.weight).to(self.post_ln.weight.dtype)
        for layer in self.layers:
            x = layer(x)
        return F.layer_norm(x, (c.width,), self.post_ln.weight, self.post_ln.bias, EPS)
