"""pi0.5: PaliGemma backbone plus a time-conditioned Gemma action expert, run in phases.

The phases share one KV store (see kv.py):
  prefill      encodes an observation, writes every VLM layer's prefix keys and values;
  denoise      runs flow matching with the action expert, only reading the prefix;
  decode_step  appends one text token per request and returns its next-token logits;
  extend       appends a run of text tokens (a question) to one row after what it holds.
forward_full and forward_text recompute whole sequences without a cache; they are the
reference the phases are checked against, not a fast path.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .gemma import (
    NEG,
    Block,
    RMSNorm,
    ada_norm,
    attend,
    fold_mask,
    rms,
    rope,
    rope_table,
    time_embedding,
)
from .kv import KV
from .rtc import Guide
from .siglip import Siglip

# Kept in fp32 when the rest runs in bf16: embeddings of pixels, every Gemma norm (the
# adaptive ones included), and the small action/time projections.
FP32_PARAMS = re.compile(
    r"^(vision\.(patch|pos)\.|vlm_norm\.|expert_norm\.|(vlm|expert)\.\d+\.norm[12]\.|"
    r"action_(in|out)\.|time_(in|out)\.)")


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


def _contiguous_rows(rows, kv: KV, batch: int) -> slice:
    if not isinstance(rows, slice):
        raise TypeError(f"rows must be a slice of KV rows, got {type(rows).__name__}")
    r = range(*rows.indices(kv.rows))
    if r.step != 1 or len(r) != batch:
        raise ValueError(f"rows {rows} select {len(r)} KV rows (step {r.step}); "
                         f"expected {batch} consecutive rows")
    return slice(r.start, r.stop)


class Pi05(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        v, e = cfg.vlm, cfg.expert
        # First, so that next(parameters()) reports the compute dtype, not an fp32 one.
        self.embed = nn.Embedding(cfg.vocab, v.width)  # also the (tied) LM head
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
                token_mask: torch.Tensor, kv: KV, rows: slice = slice(None)) -> torch.Tensor:
        """Encode observations into KV rows; returns the final-normed hidden state [B, width]
        at each observation's last valid prefix token.

        Physical layout per row: the row's present cameras packed to the front (missing
        cameras are never encoded), empty image slots up to the batch's most cameras, then
        text up to the batch's last valid token. Positions, masks and results equal those of
        the full [S cameras | max_token_len] layout; kv.length holds the columns used.
        """
        cfg, e = self.cfg, self.cfg.vlm
        dev, dt, width = self.device, self.dtype, e.width
        b, s = image_mask.shape
        if images.shape[:2] != (b, s) or tokens.shape != token_mask.shape \
                or tokens.shape[0] != b:
            raise ValueError(f"inconsistent shapes: images {tuple(images.shape)}, image_mask "
                             f"{tuple(image_mask.shape)}, tokens {tuple(tokens.shape)}, "
                             f"token_mask {tuple(token_mask.shape)}")
        rows = _contiguous_rows(rows, kv, b)
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
            xi[slot_ok] = self.embed_images(images[image_mask.to(images.device)]).to(dt)
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
        groups = e.heads // e.kv_heads
        if cfg.prompt_attention == "bidirectional":
            mask = None if bool(key.all()) else key[:, None, None, :]
            last_mask = mask

            def attention(q, kc, vc):
                return attend(q, kc, vc, mask)
        else:
            # Image queries see the valid images; text queries see them and earlier text.
            # Two calls keep the per-query mask to the text rows.
            img = torch.arange(lp, device=dev) < li
            img_key = key[:, :li] | ~key[:, :li].any(1, keepdim=True)
            img_mask = img_key[:, None, None, :]
            ptxt = pos[:, li:, None]
            txt = key[:, None, :] & (img[None, None, :] | (pos[:, None, :] <= ptxt))
            txt |= (torch.arange(lp, device=dev) == torch.arange(li, lp, device=dev)[:, None])
            txt_mask = fold_mask(txt[:, None], groups)
            last_img = (last < li)[:, None]
            last_mask = key & (img | (~last_img & (pos <= pos[ar, last, None])))
            last_mask[ar, last] = True
            last_mask = last_mask[:, None, None, :]

            def attention(q, kc, vc):
                parts = []
                if li:
                    parts.append(attend(q[:, :li], kc[:, :, :li], vc[:, :, :li], img_mask))
                if lt:
                    parts.append(attend(q[:, li:], kc, vc, txt_mask))
                return torch.cat(parts, 1) if len(parts) > 1 else parts[0]

        for layer, blk in enumerate(self.vlm):
            q, k, v = blk.qkv_heads(blk.norm1(x))
            kc, vc = kv.k[layer][rows, :, :lp], kv.v[layer][rows, :, :lp]
            kc.copy_(rope(k, cos, sin).transpose(1, 2))
            vc.copy_(v.transpose(1, 2))
            if layer == e.depth - 1:
                # Only the last valid token's output is needed past the last layer's keys.
                x, q = x[ar, last, None], q[ar, last, None]
                q = rope(q, cos[ar, last, None], sin[ar, last, None])
                o = attend(q, kc, vc, last_mask)
            else:
                o = attention(rope(q, cos, sin), kc, vc)
            x = x + F.linear(o, blk.o.weight)
            x = x + blk.mlp(blk.norm2(x))

        kv.valid[rows] = False
        kv.valid[rows, :lp] = valid
        kv.length[rows] = lp
        kv.next_pos[rows] = valid.sum(1)
        return self.vlm_norm(x[:, 0])

    # ------------------------------------------------------------------ denoise
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
        rows = _contiguous_rows(rows, kv, b)
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
        rows = _contiguous_rows(rows, kv, b)
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
            # One softmax over [prefix | chunk] keys; the prefix is only read, never copied.
            kp, vp = prefix[i]
            s = torch.cat((q @ kp, q @ k), -1)
            p = torch.softmax(s.float() + bias, -1).to(self.dtype)
            o = p[..., :lp] @ vp + p[..., lp:] @ v
            o = o.view(b, e.heads, t, d).transpose(1, 2).reshape(b, t, e.heads * d)
            h = h + F.linear(o, blk.o.weight) * gate
            scale, shift, gate = mods[2 * i + 1]
            h = h + blk.mlp(ada_norm(h, scale, shift)) * gate
        scale, shift, _ = mods[-1]
        h = ada_norm(h, scale, shift)
        return F.linear(h.float(), self.action_out.weight, self.action_out.bias)

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode_step(self, kv: KV, rows: torch.Tensor, tokens: torch.Tensor,
                    cols: int | None = None) -> torch.Tensor:
        """Append one token to each of ``rows`` and return fp32 next-token logits [b, vocab]."""
        return self.logits(self.decode_hidden(kv, rows, tokens, cols))

    @torch.no_grad()
    def decode_hidden(self, kv: KV, rows: torch.Tensor, tokens: torch.Tensor,
                      cols: int | None = None, live: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """decode_step without the LM head: the final-normed hidden state [b, width].

        Rows may differ in prefix layout, valid columns and tokens generated so far; each
        token's key/value goes to column kv.length[row] at position kv.next_pos[row]. Keys
        are gathered for the first ``cols`` columns (default: longest row after appending;
        pass a fixed value for static shapes).

        ``live`` [b] bool pads a batch to a fixed size: a False entry points at a row
        nobody reads (the cache's scratch row), attends to every column (a fully masked
        query is NaN on some attention kernels, and NaN keys written there would poison
        later reads of the row), and neither advances its row nor marks a column valid.
        With ``cols`` and ``live`` given nothing here waits for the device (CUDA graph
        capture).
        """
        dev = self.device
        rows, tokens = rows.to(dev), tokens.to(dev)
        col, pos = kv.length[rows], kv.next_pos[rows]
        if cols is None:
            cols = int(col.max()) + 1
            if cols > kv.max_len:
                raise ValueError(f"KV rows are full ({kv.max_len} columns)")
        if live is None:
            kv.valid[rows, col] = True
            mask = kv.valid[:, :cols].index_select(0, rows)
            step = 1
        else:
            kv.valid[rows, col] = live
            mask = kv.valid[:, :cols].index_select(0, rows) | ~live[:, None]
            step = live.long()
        mask = mask[:, None, None, :]
        cos_t, sin_t = self._rope_for(int(kv.max_len) + 1)
        cos, sin = cos_t[pos][:, None, None], sin_t[pos][:, None, None]

        x = self.embed_tokens(tokens)[:, None]
        for i, blk in enumerate(self.vlm):
            q, k, v = blk.qkv_heads(blk.norm1(x))
            kv.k[i][rows, :, col] = rope(k, cos, sin)[:, 0]
            kv.v[i][rows, :, col] = v[:, 0]
            kc = kv.k[i][:, :, :cols].index_select(0, rows)
            vc = kv.v[i][:, :, :cols].index_select(0, rows)
            x = x + F.linear(attend(rope(q, cos, sin), kc, vc, mask), blk.o.weight)
            x = x + blk.mlp(blk.norm2(x))
        kv.length[rows] = col + step
        kv.next_pos[rows] = pos + step
        return self.vlm_norm(x[:, 0])

    @torch.no_grad()
    def extend(self, kv: KV, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Append text ``tokens`` [n] to one row in one pass; returns the final-normed hidden
        state [1, width] after the last of them.

        Each token attends to the row's valid columns and to the tokens before it, at
        positions continuing from kv.next_pos, exactly as if they had been decoded one by
        one: a question enters a request after the frame's prefix without a second prefill.
        """
        return self.extend_rows(kv, slice(row, row + 1), tokens.reshape(1, -1))[:, -1]

    def extend_rows(self, kv: KV, rows: slice, tokens: torch.Tensor) -> torch.Tensor:
        """extend for the rows of one prefill (they share its column layout): ``tokens``
        [b, n] appended to each; returns the final-normed hidden state after each token
        [b, n, width]. Gradients flow where the parameters take them (training's text loss
        runs through it, teacher-forced)."""
        dev = self.device
        tokens = tokens.to(dev)
        b, n = tokens.shape
        rows = _contiguous_rows(rows, kv, b)
        if n == 0:
            raise ValueError("extend needs at least one token")
        lengths = kv.length[rows]
        start = int(lengths[0])
        if bool((lengths != start).any()):
            raise ValueError(f"rows of different lengths {lengths.tolist()} cannot be extended "
                             f"together")
        end = start + n
        if end > kv.max_len:
            raise ValueError(f"{n} tokens after {start} columns do not fit KV rows of "
                             f"{kv.max_len}")
        kv.valid[rows, start:end] = True
        cols = torch.arange(end, device=dev)
        new = torch.arange(start, end, device=dev)[:, None]
        mask = kv.valid[rows, None, :end] & ((cols < start) | (cols <= new))  # [b, n, end]
        mask = fold_mask(mask[:, None], self.cfg.vlm.heads // self.cfg.vlm.kv_heads)
        pos = kv.next_pos[rows, None] + torch.arange(n, device=dev)
        cos_t, sin_t = self._rope_for(int(kv.max_len) + 1)
        cos, sin = cos_t[pos][:, :, None], sin_t[pos][:, :, None]

        x = self.embed_tokens(tokens)
        for i, blk in enumerate(self.vlm):
            q, k, v = blk.qkv_heads(blk.norm1(x))
            kv.k[i][rows, :, start:end] = rope(k, cos, sin).transpose(1, 2)
            kv.v[i][rows, :, start:end] = v.transpose(1, 2)
            kc, vc = kv.k[i][rows, :, :end], kv.v[i][rows, :, :end]
            x = x + F.linear(attend(rope(q, cos, sin), kc, vc, mask), blk.o.weight)
            x = x + blk.mlp(blk.norm2(x))
        kv.length[rows] = end
        kv.next_pos[rows] += n
        return self.vlm_norm(x)

    # ------------------------------------------------------------------ reference
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
