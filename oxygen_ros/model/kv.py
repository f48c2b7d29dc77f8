"""Raw key/value storage shared by the model's phases; a cache manager decides the rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass
class KV:
    """Per-layer keys and values of [rows, kv_heads, max_len, head_dim].

    Keys are stored after RoPE. ``valid`` marks the columns a query may attend, ``length``
    counts the columns written per row, ``next_pos`` is the rotary position of the next
    appended token (valid prefix tokens plus generated tokens).
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    valid: torch.Tensor
    length: torch.Tensor
    next_pos: torch.Tensor

    @classmethod
    def allocate(cls, cfg: ModelConfig, rows: int, max_len: int | None = None,
                 device="cpu", dtype=torch.float32) -> KV:
        if max_len is None:
            max_len = cfg.prefix_len
        if rows <= 0 or max_len <= 0:
            raise ValueError(f"rows and max_len must be positive, got {rows}, {max_len}")
        e = cfg.vlm
        shape = (rows, e.kv_heads, max_len, e.head_dim)
        return cls(
            k=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(e.depth)],
            v=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(e.depth)],
            valid=torch.zeros(rows, max_len, device=device, dtype=torch.bool),
            length=torch.zeros(rows, device=device, dtype=torch.long),
            next_pos=torch.zeros(rows, device=device, dtype=torch.long),
        )

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    @property
    def depth(self) -> int:
        return len(self.k)

    @property
    def device(self) -> torch.device:
        return self.valid.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        tensors = [*self.k, *self.v, self.valid, self.length, self.next_pos]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def row_nbytes(self) -> int:
        return self.nbytes // self.rows

    def copy_row(self, src: int, dst: int) -> None:
        """Make row ``dst`` hold what row ``src`` holds (its written columns and bookkeeping),
        so a second request can grow from one prefill without encoding it again."""
        n = int(self.length[src])
        for t in (*self.k, *self.v):
            t[dst, :, :n] = t[src, :, :n]
        self.valid[dst] = self.valid[src]
        self.length[dst] = self.length[src]
        self.next_pos[dst] = self.next_pos[src]

    def clear(self, rows: slice | torch.Tensor | int = slice(None)) -> None:
        """Forget the given rows; their keys and values are left as garbage, never read."""
        self.valid[rows] = False
        self.length[rows] = 0
        self.next_pos[rows] = 0


def contiguous_rows(rows, kv: KV, batch: int) -> slice:
    if not isinstance(rows, slice):
        raise TypeError(f"rows must be a slice of KV rows, got {type(rows).__name__}")
    r = range(*rows.indices(kv.rows))
    if r.step != 1 or len(r) != batch:
        raise ValueError(f"rows {rows} select {len(r)} KV rows (step {r.step}); "
                         f"expected {batch} consecutive rows")
    return slice(r.start, r.stop)
