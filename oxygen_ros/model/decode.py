"""The language phases: decode one token per request, or extend a row by a run of tokens
(a question), each after what the row's KV holds. A part of Pi05 (pi05.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gemma import attend, fold_mask, rope
from .kv import KV, contiguous_rows


class Decode:
    """Pi05's text side, on the KV rows prefill (and earlier tokens) filled."""

    @torch.no_grad()
    def decode_step(self, kv: KV, rows: torch.Tensor, tokens: torch.Tensor,
                    cols: int | None = None) -> torch.Tensor:
        """Append one token to each of ``rows`` and return fp32 next-token logits [b, vocab]."""
        return self.logits(self.decode_hidden(kv, rows, tokens, cols))

    @torch.no_grad()
    def decode_hidden(self, kv: KV, rows: torch.Tensor, tokens: torch.Tensor,
                      cols: int | None = None, live: torch.Tensor | None = None,
                      rope_tables: tuple | None = None) -> torch.Tensor:
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
        capture). ``rope_tables`` (cos, sin) covering every column's position replace the
        model's own (a compiled program takes them as inputs).
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
        cos_t, sin_t = rope_tables or self._rope_for(int(kv.max_len) + 1)
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
        rows = contiguous_rows(rows, kv, b)
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
