"""The model without a cache: whole sequences through both experts in openpi's layout and
masks, the reference the phases are checked against. A part of Pi05 (pi05.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .gemma import NEG, rms, time_embedding


class Reference:
    """forward_full (one flow step's velocity) and forward_text (next-token logits)."""

    @torch.no_grad()
    def forward_full(self, images, image_mask, tokens, token_mask, x_t, time: float):
        """Velocity [B, horizon, action_dim] of one flow step from the whole [prefix | action
        chunk] sequence run jointly through both experts, without a cache."""
        return self._reference(images, image_mask, tokens, token_mask, x_t=x_t, time=time)

    @torch.no_grad()
    def forward_text(self, images, image_mask, tokens, token_mask, generated):
        """Logits [B, G+1, vocab] from the whole [prefix | generated] sequence, no cache:
        index 0 predicts the first generated token, index j follows generated token j."""
        return self._reference(images, image_mask, tokens, token_mask, generated=generated)

    def _reference(self, images, image_mask, tokens, token_mask, generated=None, x_t=None,
                   time=None):
        """openpi's layout and masks: every camera encoded, make_att_2d_masks-style mask."""
        cfg, ev, ee = self.cfg, self.cfg.vlm, self.cfg.expert
        dev, dt = self.device, self.dtype
        b, s = image_mask.shape
        n, n_txt = cfg.image_tokens, tokens.shape[1]
        image_mask, token_mask = image_mask.to(dev, torch.bool), token_mask.to(dev, torch.bool)
        feats = self.embed_images(images.flatten(0, 1)).to(dt).reshape(b, s * n, ev.width)
        xv = [feats, self.embed_tokens(tokens.to(dev))]
        pad = [image_mask.repeat_interleave(n, 1), token_mask]
        causal = cfg.prompt_attention == "causal"
        att = [torch.zeros(b, s * n, dtype=torch.long, device=dev),
               torch.full((b, n_txt), int(causal), dtype=torch.long, device=dev)]
        if generated is not None:
            g = generated.shape[1]
            xv.append(self.embed_tokens(generated.to(dev)))
            pad.append(torch.ones(b, g, dtype=torch.bool, device=dev))
            att.append(torch.ones(b, g, dtype=torch.long, device=dev))
        xv = torch.cat(xv, 1)
        nv = xv.shape[1]
        xa = None
        if x_t is not None:
            t = x_t.shape[1]
            xa = F.linear(x_t.to(dev, torch.float32), self.action_in.weight,
                          self.action_in.bias).to(dt)
            pad.append(torch.ones(b, t, dtype=torch.bool, device=dev))
            att.append(F.one_hot(torch.zeros(b, dtype=torch.long, device=dev), t))
            temb = time_embedding(torch.tensor([float(time)], device=dev), ee.width)
            cond = F.silu(self.time_out(F.silu(self.time_in(temb))))
        pad, att = torch.cat(pad, 1), torch.cat(att, 1)
        cum = att.cumsum(1)
        allowed = (cum[:, None, :] <= cum[:, :, None]) & pad[:, None, :] & pad[:, :, None]
        pos = pad.long().cumsum(1) - 1
        inv = 1.0 / cfg.rope_base ** (torch.arange(0, ev.head_dim, 2, device=dev).double()
                                      / ev.head_dim)
        ang = (pos.double()[..., None] * inv).repeat(1, 1, 2)[:, :, None]
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)

        def rot(x):
            x1, x2 = x.chunk(2, -1)
            return x * cos + torch.cat((-x2, x1), -1) * sin

        def ada(x, dense):
            scale, shift, gate = dense(cond).float().chunk(3, -1)
            return (rms(x) * (1 + scale[:, None]) + shift[:, None]).to(dt), gate[:, None].to(dt)

        groups = ev.heads // ev.kv_heads
        for i in range(ev.depth):
            bv, be = self.vlm[i], self.expert[i]
            q, k, v = bv.qkv_heads(bv.norm1(xv))
            if xa is not None:
                ha, ga1 = ada(xa, be.norm1)
                qa, ka, va = be.qkv_heads(ha)
                q, k, v = torch.cat((q, qa), 1), torch.cat((k, ka), 1), torch.cat((v, va), 1)
            q, k = rot(q), rot(k)
            k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
            sc = torch.einsum("bqhd,bkhd->bhqk", q, k).float() / math.sqrt(ev.head_dim)
            p = sc.masked_fill(~allowed[:, None], NEG).softmax(-1).to(dt)
            o = torch.einsum("bhqk,bkhd->bqhd", p, v).flatten(2)
            xv = xv + bv.o(o[:, :nv])
            xv = xv + bv.mlp(bv.norm2(xv))
            if xa is not None:
                xa = xa + be.o(o[:, nv:]) * ga1
                ha, ga2 = ada(xa, be.norm2)
                xa = xa + be.mlp(ha) * ga2
        if xa is not None:
            h, _ = ada(xa, self.expert_norm)
            return F.linear(h.float(), self.action_out.weight, self.action_out.bias)
        lp = s * n + n_txt
        last = (pad[:, :lp] * torch.arange(1, lp + 1, device=dev)).argmax(1)
        h = torch.cat((xv[torch.arange(b, device=dev), last, None], xv[:, lp:]), 1)
        return F.linear(self.vlm_norm(h), self.embed.weight).float()
