"""Static-shape denoise and decode phases, replayed as CUDA graphs on a GPU.

On a GPU the small phases (N denoise steps; one token per request per decode step) are
bound by launching kernels from Python, not by arithmetic. Here both run with fixed shapes:
the denoise over a fixed number of key columns per prefix-length bucket (masked past the
row's valid columns), at a fixed batch per batch bucket for frames of several robots; the
decode step over every column of a KV row at a fixed batch per batch-size bucket, padded
entries pointing at the scratch row (Pi05.decode_hidden's ``live``). On CUDA each bucket
is captured once, when this object is built (the engine's start-up), and replayed from then
on; elsewhere the same static calls run eagerly, which is what the CPU tests compare with
the dynamic path.

Prefill stays eager: it is one pass of large matmuls over the whole prefix, its kernel
launches overlap its arithmetic, and its shapes (cameras x text length) would multiply the
buckets. The guided denoise (real-time chunking) differentiates through the expert and also
stays eager.
"""

from __future__ import annotations

import torch

from ..model import Pi05
from .kv_cache import KVCache


def denoise_buckets(cfg, max_len: int) -> list[int]:
    """Key columns a denoise may be run at: each camera count's image columns plus the
    text in quarters of max_token_len (prefill's layout), never past the KV rows."""
    n, text = cfg.image_tokens, cfg.max_token_len
    quarter = -(-text // 4)
    return sorted({min(c * n + min(text, j * quarter), max_len)
                   for c in range(len(cfg.image_slots) + 1) for j in range(1, 5)})


def batch_buckets(max_requests: int) -> list[int]:
    """Decode batch sizes with a graph: powers of two, and the most requests there are."""
    sizes = {max_requests}
    b = 1
    while b < max_requests:
        sizes.add(b)
        b *= 2
    return sorted(sizes)


def power_buckets(n: int) -> list[int]:
    """Batch sizes 1, 2, 4, ... up to the first at or past ``n``."""
    sizes, b = [1], 1
    while b < n:
        b *= 2
        sizes.append(b)
    return sizes


def _smallest(buckets: list[int], n: int, what: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f'{what} {n} is past the largest bucket {buckets[-1]}')


class _Call:
    """One static call: values are copied into fixed input buffers, then the captured graph
    is replayed (CUDA) or the call is run on the buffers (elsewhere)."""

    def __init__(self, fn, inputs: tuple, capture: bool, pool=None):
        self.fn, self.inputs = fn, inputs
        self.graph = None
        if capture:
            # Warm-up on a side stream first (allocator, rotary tables, cuBLAS handles).
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn(*inputs)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: the node's other threads may use CUDA while the engine starts.
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode='thread_local'):
                self.out = fn(*inputs)

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.fn(*self.inputs)
        self.graph.replay()
        return self.out


class StaticPhases:
    """The unguided denoise and the batched decode step of one model and KV cache.

    ``robots`` > 1 adds denoise batch buckets (powers of two up to the first at or past it)
    for frames of several robots; a batch between buckets is padded with copies of its
    first row (the denoise gathers its rows, so padding reads a row but writes nothing).
    """

    def __init__(self, model: Pi05, cache: KVCache, denoise_steps: int, robots: int = 1):
        kv = cache.kv
        self.model, self.cache = model, cache
        self.capture = kv.device.type == 'cuda'
        cfg = model.cfg
        self.columns = denoise_buckets(cfg, kv.max_len)
        self.batches = batch_buckets(max(1, cache.max_requests))
        self.denoise_batches = power_buckets(robots)
        dev = kv.device
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        with torch.inference_mode():
            # The expert's time modulations are fixed by the weights and the steps:
            # computed once here, inputs of every replay. Weights replaced after this (not
            # copied into in place) would leave the graphs reading the old ones.
            mods, dtime = model.flow_schedule(denoise_steps)
            # Captured against the scratch row, which always exists; the engine's noise
            # comes in the cache's dtype.
            self._rows, self._noises, self._denoise = {}, {}, {}
            for b in self.denoise_batches:
                self._rows[b] = rows = torch.full((b,), cache.scratch, dtype=torch.long,
                                                  device=dev)
                self._noises[b] = noise = torch.zeros(b, cfg.action_horizon, cfg.action_dim,
                                                      device=dev, dtype=kv.dtype)
                for c in self.columns:
                    self._denoise[b, c] = _Call(
                        lambda row, noise, c=c: model.denoise_static(
                            kv, row, noise, c, mods, dtime), (rows, noise), self.capture, pool)
            # Per batch bucket: rows, tokens and liveness as one [3, b] upload, from a
            # pinned host buffer on CUDA. Captured all padding: nothing in the cache moves.
            self._host, self._packed, self._decode = {}, {}, {}
            for b in self.batches:
                packed = torch.zeros(3, b, dtype=torch.long, device=dev)
                packed[0] = cache.scratch
                self._packed[b] = packed
                self._host[b] = torch.zeros(3, b, dtype=torch.long, pin_memory=True) \
                    if self.capture else None
                self._decode[b] = _Call(
                    lambda p: model.decode_hidden(kv, p[0], p[1], kv.max_len, p[2].bool()),
                    (packed,), self.capture, pool)
        # The rotary tables the graphs read: kept alive should the model grow new ones.
        self._tables = model._rope

    def denoise(self, row: int, noise: torch.Tensor) -> torch.Tensor:
        """Actions [1, horizon, action_dim] from the prefix in ``row`` (as prefill left it)."""
        return self.denoise_rows([row], noise)

    def denoise_rows(self, rows: list[int], noise: torch.Tensor) -> torch.Tensor:
        """Actions [len(rows), horizon, action_dim] from the prefixes in ``rows``, one noise
        row each; padded to the next batch bucket."""
        n = len(rows)
        b = _smallest(self.denoise_batches, n, 'denoise batch')
        # The one read of the device per call, before anything is launched: prefill has
        # just waited for its own masks, so it costs the gap of one launch.
        length = int(self.cache.kv.length[rows].max()) if n > 1 \
            else int(self.cache.kv.length[rows[0]])
        call = self._denoise[b, _smallest(self.columns, length, 'prefix length')]
        if n == 1:
            self._rows[b].fill_(rows[0])
        else:
            self._rows[b].copy_(torch.tensor(rows + [rows[0]] * (b - n)))
        self._noises[b][:n].copy_(noise)
        if n < b:
            self._noises[b][n:].zero_()
        return call()[:n].clone()

    def decode_hidden(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        """One decode pass of ``tokens`` into ``rows``: hidden states [len(rows), width]."""
        n = len(rows)
        b = _smallest(self.batches, n, 'decode batch')
        packed, host = self._packed[b], self._host[b]
        # Written on the host; on CUDA a pinned buffer uploaded without waiting. It is
        # rewritten only after the step's tokens were read back, so the copy is done.
        values = packed if host is None else host
        values[0, :n] = torch.tensor(rows)
        values[0, n:] = self.cache.scratch
        values[1, :n] = torch.tensor(tokens)
        values[1, n:] = 0
        values[2, :n] = 1
        values[2, n:] = 0
        if host is not None:
            packed.copy_(host, non_blocking=True)
        return self._decode[b]()[:n].clone()
