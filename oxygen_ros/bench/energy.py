"""Energy per frame from the GPU's own counter (NVML's total energy, through nvidia-ml-py).

The counter is the board's energy in millijoules since the driver loaded, updated every
20-100 ms, so a measurement repeats the work for at least ``min_seconds`` and divides the
difference by the repetitions. Where there is no counter (a CPU, no nvidia-ml-py, a GPU
older than Volta) ``Meter.why`` says so and ``per_call`` returns None: the benchmarks then
report no energy rather than a made-up one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class Meter:
    def __init__(self, device: torch.device):
        self.handle, self.nvml, self.why = None, None, ''
        if device.type != 'cuda':
            self.why = 'not a CUDA device'
            return
        try:
            import pynvml
        except ImportError:
            self.why = 'nvidia-ml-py is not installed (requirements-gpu.txt)'
            return
        try:
            pynvml.nvmlInit()
            # NVML numbers GPUs its own way; the UUID names the one torch uses.
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            try:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(f'GPU-{uuid}')
            except pynvml.NVMLError:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception as e:  # noqa: BLE001 - any NVML failure means: no counter here
            self.handle, self.why = None, f'no NVML energy counter: {e}'
            return
        self.nvml = pynvml
        self.device = device

    def read_mj(self) -> int:
        return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def per_call(self, fn: Callable[[], object], min_seconds: float = 2.0,
                 max_calls: int = 100_000) -> dict | None:
        """Millijoules per call of ``fn`` (the device waited on around it), with the calls
        and seconds it took; None without a counter."""
        if self.handle is None:
            return None
        torch.cuda.synchronize(self.device)
        e0, t0, n = self.read_mj(), time.perf_counter(), 0
        while n < max_calls:
            fn()
            n += 1
            if time.perf_counter() - t0 >= min_seconds:
                torch.cuda.synchronize(self.device)
                if time.perf_counter() - t0 >= min_seconds:
                    break
        torch.cuda.synchronize(self.device)
        e1, t1 = self.read_mj(), time.perf_counter()
        return dict(mj_per_call=(e1 - e0) / n, calls=n, seconds=t1 - t0,
                    watts=(e1 - e0) / 1e3 / (t1 - t0))
