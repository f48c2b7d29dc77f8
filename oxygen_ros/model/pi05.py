"""pi0.5: PaliGemma backbone plus a time-conditioned Gemma action expert, run in phases.

The phases share one KV store (see kv.py), each in a module of its own:
  prefill      (here) encodes an observation, writes every VLM layer's prefix keys and values;
  denoise      (denoise.py) runs flow matching with the action expert, only reading the prefix;
  decode_step  (decode.py) appends one text token per request and returns its next-token
               logits; extend appends a run of text tokens (a question) to one row after
               what it holds;
  forward_full and forward_text (reference.py) recompute whole sequences without a cache;
               they are the reference the phases are checked against, not a fast path.
Pi05 holds the weights and is all of them: the phases are its methods.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .decode import Decode
from .denoise import Denoise
from .gemma import Block, Embedding, RMSNorm, attend, fold_mask, rope, rope_table
from .kv import KV, contiguous_rows
from .reference import Reference
from .siglip import Siglip

# Kept in fp32 when the rest runs in bf16: embeddings of pixels, every Gemma norm (the
# adaptive ones included), and the small action/time projections.
FP32_PARAMS = re.compile(
    r"^(vision\.(patch|pos)\.|vlm_norm\.|expert_norm\.|(vlm|expert)\.\d+\.norm[12]\.|"
    r"action_(in|out)\.|time_(in|out)\.)")


class Pi05(Denoise, Decode, Reference, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        v, e = cfg.vlm, cfg.expert
        # First, so that next(parameters()) reports the compute dtype, not an fp32 one.
        self.embed = Embedding(cfg.vocab, v.width)  # also the (tied) LM head
        self.vision = Siglip(cfg.vision)
        self.projector = nn.Linear(cfg.vision.width, v.width)
        self.vlm = nn.ModuleList(Block(v, adaptive=False) for _ in range(v.depth))
        self.vlm_norm = RMSNorm(v.width)
        self.expert = nn.ModuleList(Block(e, adaptive=True) for _ in range(e.depth))
        self.expert_norm = nn.Linear(e.width, 3 * e.width)
        self.action_in = nn.Linear(cfg.action_dim, e.width)
        self.action_out = nn.Linear(e.width, cfg.action_dim)
        self.time_in = nn.Linear(e.width, e.width)
        self.time_out = nn.Linear(e.width, e.width)
        self._rope = None
        self._head = None
        self.pack_head = True

    # ----------------------------------------------------------------- housekeeping
    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def to_inference(self, device=None, dtype=None) -> Pi05:
        """Move for inference: fp32 on CPU, bf16 on CUDA unless told otherwise.

        In reduced precision the parameters matched by FP32_PARAMS stay fp32.
        """
        device = torch.device(device if device is not None else self.device)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        for name, p in self.named_parameters():
            p.data = p.data.to(device, torch.float32 if FP32_PARAMS.match(name) else dtype)
        self._rope = self._head = None
        return self.eval().requires_grad_(False)

    def readout_parameters(self) -> dict[str, torch.Tensor | None]:
        """The weights only language reads: the last VLM layer past its keys and values (its
        queries, its output and MLP) and the final norm. prefill writes every layer's keys
        and values before these act, and the action expert reads only those, so changing
        them cannot change an action (oxygen-train's language stage trains these alone).
        name -> a mask of the entries that are readout (None: all of them)."""
        last = len(self.vlm) - 1
        blk = self.vlm[last]
        queries = torch.zeros(blk.qkv.weight.shape, dtype=torch.bool)
        queries[:blk.sizes[0]] = True  # qkv's rows are [q | k | v]
        out = {f"vlm.{last}.qkv.weight": queries}
        for name in ("o.weight", "norm2.weight", "gate_up.weight", "down.weight"):
            out[f"vlm.{last}.{name}"] = None
        out["vlm_norm.weight"] = None
        return out

    def param_counts(self) -> dict[str, int]:
        groups = {"vision": self.vision, "projector": self.projector,
                  "vlm": [self.embed, self.vlm, self.vlm_norm],
                  "expert": [self.expert, self.expert_norm],
                  "heads": [self.action_in, self.action_out, self.time_in, self.time_out]}
        out = {}
        for key, mods in groups.items():
            mods = mods if isinstance(mods, list) else [mods]
            out[key] = sum(p.numel() for m in mods for p in m.parameters())
        out["total"] = sum(p.numel() for p in self.parameters())
        return out

    def _rope_for(self, n: int):
        """cos/sin tables covering positions < n, grown in steps to avoid rebuilding."""
        t = self._rope
        if t is None or t[0].shape[0] < n or t[0].device != self.device or t[0].dtype != self.dtype:
            size = max(n, self.cfg.prefix_len + 256)
            size = -(-size // 256) * 256
            self._rope = rope_table(size, self.cfg.vlm.head_dim, self.cfg.rope_base,
                                    self.device, self.dtype)
        return self._rope

    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, image_tokens, vlm width]; image features enter unscaled."""
        x = self.vision(images.to(self.device))
        return F.linear(x, self.projector.weight, self.projector.bias)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) * math.sqrt(self.cfg.vlm.width)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, width] -> fp32 [b, vocab] through the tied embedding."""
        w = self.embed.weight
        h = hidden.to(w.dtype)
        packed = self._packed_head() if w.device.type == "cpu" else None
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(h.contiguous(), packed, None, "none",
                                                      [], "")
        return F.linear(h, w).float()

    def _packed_head(self):
        """oneDNN-packed copy of the embedding for the CPU LM head, or None.

        The head is bound by reading the [vocab, width] matrix; BLAS on small batches reads
        it at a fraction of the memory bandwidth (3.5 ms vs 1.4 ms at batch 8 on the small
        config), the packed layout runs at about its speed at any batch up to ~16. It costs
        a second copy of the matrix; set ``pack_head = False`` to avoid that. Rebuilt when
        the weight is replaced or modified in place (not through ``.data``).
        """
        w = self.embed.weight
        if not self.pack_head or w.dtype != torch.float32:
            return None
        key = (w.data_ptr(), w._version, tuple(w.shape))
        if self._head is None or self._head[0] != key:
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
            except (AttributeError, RuntimeError):
                packed = None
            self._head = (key, packed)
        return self._head[1]

    # ------------------------------------------------------------------ prefill
    def prefill(self, images: torch.Tensor, image_mask: torch.Tensor, tokens: torch.Tensor,
                token_mask: torch.Tensor, kv: KV, rows: slice = slice(None), vision=None,
                layers=None) -> torch.Tensor:
        """Encode observations into KV rows; returns the final-normed hidden state [B, width]
        at each observation's last valid prefix token.

        Physical layout per row: the row's present cameras packed to the front (missing
        cameras are never encoded), empty image slots up to the batch's most cameras, then
        text up to the batch's last valid token. Positions, masks and results equal those of
        the full [S cameras | max_token_len] layout; kv.length holds the columns used.

        ``vision`` and ``layers`` stand in for embed_images and prefill_layers (the model
        runner's compiled programs); the layout, masks and bookkeeping stay here.
        """
        cfg, e = self.cfg, self.cfg.vlm
        dev, dt, width = self.device, self.dtype, e.width
        b, s = image_mask.shape
        if images.shape[:2] != (b, s) or tokens.shape != token_mask.shape \
                or tokens.shape[0] != b:
            raise ValueError(f"inconsistent shapes: images {tuple(images.shape)}, image_mask "
                             f"{tuple(image_mask.shape)}, tokens {tuple(tokens.shape)}, "
                             f"token_mask {tuple(token_mask.shape)}")
        rows = contiguous_rows(rows, kv, b)
        image_mask = image_mask.to(dev, torch.bool)
        token_mask = token_mask.to(dev, torch.bool)
        n_tok, n_txt = cfg.image_tokens, tokens.shape[1]

        n_img = image_mask.sum(1)
        last_txt = (token_mask * torch.arange(1, n_txt + 1, device=dev)).amax(1) if n_txt \
            else torch.zeros_like(n_img)
        max_img, lt = torch.stack((n_img.max(), last_txt.max())).tolist()
        li = max_img * n_tok
        if li + lt == 0:
            if n_txt == 0:
                raise ValueError("prefill needs images or tokens")
            lt = 1
        lp = li + lt
        if lp > kv.max_len:
            raise ValueError(f"prefix of {lp} columns does not fit KV rows of {kv.max_len}")

        x = torch.empty(b, lp, width, device=dev, dtype=dt)
        valid = torch.empty(b, lp, device=dev, dtype=torch.bool)
        if max_img:
            slot_ok = torch.arange(max_img, device=dev) < n_img[:, None]
            xi = x[:, :li].view(b, max_img, n_tok, width)
            xi[slot_ok] = (vision or self.embed_images)(images[image_mask.to(images.device)]).to(dt)
            xi[~slot_ok] = 0
            valid[:, :li] = slot_ok.repeat_interleave(n_tok, 1)
        if lt:
            x[:, li:] = self.embed_tokens(tokens[:, :lt].to(dev))
            valid[:, li:] = token_mask[:, :lt]

        pos = (valid.cumsum(1) - 1).clamp_(min=0)
        cos_t, sin_t = self._rope_for(lp)
        cos, sin = cos_t[pos].unsqueeze(2), sin_t[pos].unsqueeze(2)
        ar = torch.arange(b, device=dev)
        last = (valid * torch.arange(1, lp + 1, device=dev)).argmax(1)

        # Every query must see at least one key: a fully masked row would give NaN, and NaN
        # in an unused column still poisons valid rows through 0 * NaN in the value sum.
        key = valid | ~valid.any(1, keepdim=True)
        if cfg.prompt_attention == "bidirectional":
            full = None if bool(key.all()) and layers is None else key[:, None, None, :]
            masks = (full, full)
        else:
            # Image queries see the valid images; text queries see them and earlier text.
            # Two calls keep the per-query mask to the text rows.
            img = torch.arange(lp, device=dev) < li
            img_key = key[:, :li] | ~key[:, :li].any(1, keepdim=True)
            ptxt = pos[:, li:, None]
            txt = key[:, None, :] & (img[None, None, :] | (pos[:, None, :] <= ptxt))
            txt |= (torch.arange(lp, device=dev) == torch.arange(li, lp, device=dev)[:, None])
            last_img = (last < li)[:, None]
            last_mask = key & (img | (~last_img & (pos <= pos[ar, last, None])))
            last_mask[ar, last] = True
            masks = (img_key[:, None, None, :],
                     fold_mask(txt[:, None], e.heads // e.kv_heads), last_mask[:, None, None, :])
        hidden, keys, values = (layers or self.prefill_layers)(x, cos, sin, last, masks)
        for layer in range(e.depth):
            kv.k[layer][rows, :, :lp] = keys[layer]
            kv.v[layer][rows, :, :lp] = values[layer]

        kv.valid[rows] = False
        kv.valid[rows, :lp] = valid
        kv.length[rows] = lp
        kv.next_pos[rows] = valid.sum(1)
        return hidden

    def prefill_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       last: torch.Tensor, masks: tuple):
        """The VLM layers over a laid-out prefix ``x`` [B, L, width] (prefill's part that
        runs the weights): the final-normed hidden state [B, width] at each row's ``last``
        token, and every layer's keys (after RoPE) and values [B, kv_heads, L, head_dim].

        ``masks`` (True = attend): bidirectional, (full, full) with full [B, 1, 1, L] or
        None (every column valid); causal, (images [B, 1, 1, I] for the first I columns'
        queries, text [B, 1, G*(L-I), L] folded per query head group, last [B, 1, 1, L] for
        the last token's query).
        """
        e = self.cfg.vlm
        b = x.shape[0]
        ar = torch.arange(b, device=x.device)
        if len(masks) == 2:
            def attention(q, kc, vc):
                return attend(q, kc, vc, masks[0])
        else:
            li = masks[0].shape[-1]

            def attention(q, kc, vc):
                parts = []
                if li:
                    parts.append(attend(q[:, :li], kc[:, :, :li], vc[:, :, :li], masks[0]))
                if q.shape[1] > li:
                    parts.append(attend(q[:, li:], kc, vc, masks[1]))
                return torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        keys, values = [], []
        for layer, blk in enumerate(self.vlm):
            q, k, v = blk.qkv_heads(blk.norm1(x))
            kc, vc = rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)
            keys.append(kc)
            values.append(vc)
            if layer == e.depth - 1:
                # Only the last valid token's output is needed past the last layer's keys.
                x, q = x[ar, last, None], q[ar, last, None]
                q = rope(q, cos[ar, last, None], sin[ar, last, None])
                o = attend(q, kc, vc, masks[-1])
            else:
                o = attention(rope(q, cos, sin), kc, vc)
            x = x + F.linear(o, blk.o.weight)
            x = x + blk.mlp(blk.norm2(x))
        return self.vlm_norm(x[:, 0]), keys, values
