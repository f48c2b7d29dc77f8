"""The unified KV cache: who owns which rows of one preallocated key/value store.

One store serves every task. Each language request owns one row (its prefix KV, then its
generated tokens). The newest frame's prefill writes straight into the row of the first
request it starts; the action expert reads that row in place, and the frame's other requests
start from copies of it. A frame that starts no request (or none admitted) prefills into a
reserved scratch row, so actions never wait for a free row. A frame of several robots
prefills into a block of scratch rows, one per observation, and its requests start from
copies of those.
"""

from __future__ import annotations

import torch

from ..model import KV, ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, max_requests: int, max_new_tokens: int,
                 device='cpu', dtype=torch.float32, prefix_len: int | None = None,
                 extension: int = 0, scratch_rows: int = 1):
        if max_requests < 0:
            raise ValueError(f'max_requests must be >= 0, got {max_requests}')
        if max_new_tokens < 1:
            raise ValueError(f'max_new_tokens must be >= 1, got {max_new_tokens}')
        self.max_requests = max_requests
        self.max_new_tokens = max_new_tokens
        if extension < 0:
            raise ValueError(f'extension must be >= 0, got {extension}')
        if scratch_rows < 1:
            raise ValueError(f'scratch_rows must be >= 1, got {scratch_rows}')
        self.prefix_len = prefix_len or cfg.prefix_len
        self.extension = extension
        # Rows 0..max_requests-1 are request slots; the rest are scratch rows. A row
        # holds a prefix, up to `extension` tokens of the request's own (a question), and its
        # generated tokens.
        self.kv = KV.allocate(cfg, max_requests + scratch_rows,
                              self.prefix_len + extension + max_new_tokens,
                              device=device, dtype=dtype)
        self.scratch = max_requests  # the first scratch row
        self.scratch_rows = scratch_rows
        self._free = list(range(max_requests))
        # KV rows a robot's requests may hold at once; 0 = a fair share of the pool. A robot
        # not named here (a fleet of one) may take every row.
        self.caps: dict[str, int] = {}
        self._owners: dict[int, str] = {}  # request row -> the robot whose request holds it

    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def used_rows(self) -> int:
        return self.max_requests - len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        return self.kv.row_nbytes

    @property
    def total_bytes(self) -> int:
        return self.kv.nbytes

    def alloc(self, robot: str = '') -> int | None:
        """A free request row for a request of ``robot``, or None when every row is taken."""
        if not self._free:
            return None
        # Rows start cleared and are cleared again when freed.
        row = self._free.pop(0)
        self._owners[row] = robot
        return row

    def cap(self, robot: str) -> int | None:
        """The most rows ``robot``'s requests may hold; None: no cap of its own."""
        if robot not in self.caps:
            return None
        return self.caps[robot] or max(1, self.max_requests // len(self.caps))

    def held(self, robot: str) -> int:
        """Rows ``robot``'s requests hold."""
        return sum(owner == robot for owner in self._owners.values())

    def at_cap(self, robot: str) -> bool:
        cap = self.cap(robot)
        return cap is not None and self.held(robot) >= cap

    def free(self, row: int) -> None:
        if not 0 <= row < self.max_requests:
            raise ValueError(f'row {row} is not a request row')
        if row in self._free:
            raise ValueError(f'row {row} is already free')
        self.kv.clear(slice(row, row + 1))
        self._owners.pop(row, None)
        self._free.append(row)
        self._free.sort()
