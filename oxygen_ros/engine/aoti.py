"""An AOTInductor program run through its C entry point, with the GIL released.

torch's own loader (``torch._inductor.aoti_load_package``) runs a program from Python through
a binding that keeps the GIL for the whole call. A frame of the node is a handful of such
calls of a few milliseconds each, and every other Python thread of the process waits them
out: the control loop, which must publish every 1/70 s, was late by up to 37 ms beside them
(tools/gil_wait.py). ctypes releases the GIL while a foreign function runs, so the program's
shared library is called here through its C interface (torch's
``aoti_runtime/interface.h``: a model container, tensors passed as stolen handles), and other
threads run meanwhile, as they do between the eager path's operations.

The library comes out of the package torch wrote (a zip holding one ``.so``) and is kept
beside it. The programs take their weights as inputs and hold no constants of their own, so
the container needs nothing loaded into it.
"""

from __future__ import annotations

import ctypes
import os
import zipfile
from pathlib import Path

import torch

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_New.restype = ctypes.py_object
_p = ctypes.c_void_p
_size = ctypes.c_size_t


def library(package: Path) -> Path:
    """The shared library of ``package`` (an AOTInductor .pt2), unpacked beside it once (the
    caller holds the package's lock)."""
    lib = package.with_suffix('.so')
    if lib.is_file() and lib.stat().st_mtime >= package.stat().st_mtime:
        return lib
    with zipfile.ZipFile(package) as z:
        found = [n for n in z.namelist() if n.endswith('.so')]
        if len(found) != 1:
            raise ValueError(f'{package}: expected one shared library in the package, found '
                             f'{found or "none"}')
        tmp = lib.with_name(f'{lib.name}.{os.getpid()}.tmp')
        tmp.write_bytes(z.read(found[0]))
    tmp.replace(lib)
    return lib


class Program:
    """One program's library, called with a flat list of tensors; its outputs, flat."""

    def __init__(self, package: Path):
        self.path = library(Path(package))
        lib = ctypes.CDLL(str(self.path))
        for fn, args in (('AOTInductorModelContainerCreateWithDevice',
                          [ctypes.POINTER(_p), _size, ctypes.c_char_p, ctypes.c_char_p]),
                         ('AOTInductorModelContainerDelete', [_p]),
                         ('AOTInductorModelContainerGetNumInputs', [_p, ctypes.POINTER(_size)]),
                         ('AOTInductorModelContainerGetNumOutputs', [_p, ctypes.POINTER(_size)]),
                         ('AOTInductorModelContainerGetNumConstants',
                          [_p, ctypes.POINTER(_size)]),
                         ('AOTInductorModelContainerRun',
                          [_p, ctypes.POINTER(_p), _size, ctypes.POINTER(_p), _size, _p, _p])):
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, ctypes.c_int
        self._lib = lib
        self._run = lib.AOTInductorModelContainerRun
        self._handle = _p()
        self._check(lib.AOTInductorModelContainerCreateWithDevice(
            ctypes.byref(self._handle), 1, b'cpu', None), 'create its container')
        self.inputs, self.outputs = (self._count(f'GetNum{k}') for k in ('Inputs', 'Outputs'))
        if self._count('GetNumConstants'):
            raise ValueError(f'{self.path}: the program holds constants; these programs take '
                             f'every weight as an input')

    def _count(self, what: str) -> int:
        n = _size()
        self._check(getattr(self._lib, f'AOTInductorModelContainer{what}')(
            self._handle, ctypes.byref(n)), what)
        return n.value

    def _check(self, status: int, what: str) -> None:
        if status:
            raise RuntimeError(f'{self.path.name}: could not {what} (AOTInductor status '
                               f'{status}; the reason is on stderr)')

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(tensors) != self.inputs:
            raise ValueError(f'{self.path.name} takes {self.inputs} tensors, got {len(tensors)}')
        # New handles to the inputs, which the program takes over (and frees).
        handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(tensors)
        ins = (_p * len(handles))(*[_api.PyCapsule_GetPointer(h, None) for h in handles])
        outs = (_p * self.outputs)()
        # The GIL is released from here until the program returns.
        self._check(self._run(self._handle, ins, len(handles), outs, self.outputs, None, None),
                    'run')
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
            [_api.PyCapsule_New(h, None, None) for h in outs])

    def __del__(self):
        handle = getattr(self, '_handle', None)
        if handle:
            self._lib.AOTInductorModelContainerDelete(handle)
            self._handle = None
