"""The model's phases compiled for the CPU: AOTInductor programs, built once and cached.

On a CPU a small model's frame is bound by running thousands of tiny operations one by one
from Python (a 64-wide expert layer is a dozen calls of 5-20 us each), not by arithmetic.
Inductor compiles a phase into C++: elementwise work fused into loops, matrix products through
MKL, and a C++ wrapper that runs them without Python in between. Four programs, each with
dynamic shapes so that one program serves every batch, prefix length and cache size:

- ``vision``: the SigLIP tower and projector over n images;
- ``layers``: the VLM layers over a laid-out prefix (prefill's part that runs the weights);
- ``velocity``: one denoise step of the action expert, the flow's velocity;
- ``decode``: one token into each of a batch of KV rows, in place, up to the final norm.

A program takes the weights it reads as inputs, not as constants: it depends on the model's
dims, the torch build, the CPU's instruction set, the thread count and this code, never on a
checkpoint. It is compiled once per those (tens of seconds each on two cores) and cached on
disk, where every checkpoint of the same dims finds it (milliseconds to load). Prefill's
layout and masks, the guided denoise of real-time chunking and a question's extension stay
eager: the model runner (model_runner.py) decides what runs where.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim
from torch.func import functional_call

from ..model import KV
from . import aoti

log = logging.getLogger('oxygen_ros.engine')

# The weights each program reads (the rest of the model is not its input).
WEIGHTS = {
    'vision': re.compile(r'^(vision|projector)\.'),
    'layers': re.compile(r'^(vlm|vlm_norm)\.'),
    'velocity': re.compile(r'^(expert\.\d+\.(qkv|o|gate_up|down)|action_(in|out))\.'),
    'decode': re.compile(r'^(embed|vlm|vlm_norm)\.'),
}
PROGRAMS = tuple(WEIGHTS)
# The code a program is built from: a change to any of it builds the programs anew.
_MODEL_DIR = Path(__file__).resolve().parent.parent / 'model'
_SOURCES = (Path(__file__).resolve(), *sorted(_MODEL_DIR.glob('*.py')))
_BIG = 1 << 16  # the largest batch, prefix or cache dimension a program is built for
# Models up to this many parameters are built side by side in worker processes (each makes
# random weights of the model's dims); bigger ones one program after another, here.
_WORKER_PARAMS = 200_000_000


@functools.cache
def _code_digest() -> bytes:
    h = hashlib.sha256()
    for path in _SOURCES:
        h.update(path.read_bytes())
    return h.digest()


def default_cache_dir() -> Path:
    """$OXYGEN_COMPILE_CACHE, else ~/.cache/oxygen_ros/compiled."""
    env = os.environ.get('OXYGEN_COMPILE_CACHE')
    return Path(env) if env else Path.home() / '.cache' / 'oxygen_ros' / 'compiled'


class _Call(nn.Module):
    def __init__(self, model, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args):
        return self.fn(self.model, *args)


class _Program(nn.Module):
    """``fn(model, *args)`` with the weights named ``names`` taken from the first input."""

    def __init__(self, model, fn, names: list[str]):
        super().__init__()
        self.call, self.names = _Call(model, fn), names

    def forward(self, weights, *args):
        return functional_call(self.call, {f'model.{n}': w for n, w in
                                           zip(self.names, weights, strict=True)}, args)


# -- what each program computes (the model's own code, so eager and compiled agree) --------

def _vision(model, images):
    return model.embed_images(images)


def _layers(model, x, cos, sin, last, masks):
    return model.prefill_layers(x, cos, sin, last, masks)


def _velocity(model, x, mod, keys, values, bias, cos, sin):
    """One step's velocity; ``mod`` [norms, 3, width] holds each expert norm's
    (1 + scale, shift, gate) at the step's time, ``keys``/``values`` the prefix per layer
    [B, kv_heads, L, head_dim]."""
    mods = [(m[0], m[1], m[2].to(model.dtype)) for m in mod.unbind(0)]
    prefix = [(k.transpose(-1, -2), v) for k, v in zip(keys, values, strict=True)]
    return model._velocity(x, mods, prefix, bias, cos, sin, keys[0].shape[2])


def _decode(model, k, v, valid, length, next_pos, rows, tokens, cos_t, sin_t):
    kv = KV(list(k), list(v), valid, length, next_pos)
    return model.decode_hidden(kv, rows, tokens, kv.max_len, rope_tables=(cos_t, sin_t))


def _build_one(config: dict, name: str, cache_dir: str, threads: int) -> float:
    """A worker's part of Programs.load: program ``name`` for a model of ``config``'s dims
    built into ``cache_dir``; the seconds it took."""
    from ..model import ModelConfig, Pi05

    torch.set_num_threads(threads)
    model = Pi05(ModelConfig.from_dict(config)).to_inference('cpu', torch.float32)
    t0 = time.monotonic()
    Programs(model, cache_dir, threads, say=lambda _: None).load([name], workers=1)
    return time.monotonic() - t0


def stack_mods(mods) -> torch.Tensor:
    """One step's modulations (Pi05._modulations: [norm] -> (1 + scale, shift, gate)) as the
    velocity program takes them: [norms, 3, width], fp32."""
    return torch.stack([torch.stack([t.float() for t in m]) for m in mods])


class Programs:
    """The compiled phases of one model (CPU, float32), loaded from ``cache_dir`` or built
    there. ``say`` reports what is built and how long it took (the node's log)."""

    def __init__(self, model, cache_dir: str | Path | None = None, threads: int | None = None,
                 say: Callable[[str], None] | None = None):
        if model.device.type != 'cpu' or model.dtype != torch.float32:
            raise ValueError(f'compiled programs are for float32 models on the CPU, not '
                             f'{model.dtype} on {model.device}')
        self.model = model
        self.dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.threads = threads or torch.get_num_threads()
        self.say = say or log.info
        params = dict(model.named_parameters())
        self.names = {p: [n for n in params if WEIGHTS[p].match(n)] for p in PROGRAMS}
        self.weights = {p: [params[n] for n in self.names[p]] for p in PROGRAMS}
        self.built: dict[str, float] = {}  # program -> seconds it took to build (0: loaded)
        self._run: dict[str, Callable] = {}

    # -- building --------------------------------------------------------------------------

    def _digest(self, name: str) -> str:
        """What program ``name`` is built from: the dims it runs (its weights' shapes and the
        config's sections it reads; not the config's name, time grid, cameras or prompt
        length, which it does not), the torch build, the CPU, the threads and the code."""
        cfg = self.model.cfg.to_dict()
        reads = {'vision': ('vision',), 'layers': ('vlm', 'prompt_attention'),
                 'velocity': ('vlm', 'expert', 'action_dim', 'action_horizon'),
                 'decode': ('vlm', 'vocab')}[name]
        h = hashlib.sha256()
        h.update(json.dumps(dict(
            program=name, torch=torch.__version__, cpu=torch.backends.cpu.get_cpu_capability(),
            threads=self.threads, config={k: cfg[k] for k in reads},
            weights=[(n, list(w.shape), str(w.dtype)) for n, w in
                     zip(self.names[name], self.weights[name], strict=True)]),
            sort_keys=True).encode())
        h.update(_code_digest())
        return h.hexdigest()[:20]

    def path(self, name: str) -> Path:
        return self.dir / f'{name}-{self._digest(name)}.pt2'

    def cached(self) -> list[str]:
        """The programs already on disk."""
        return [p for p in PROGRAMS if self.path(p).is_file()]

    def load(self, names=PROGRAMS, workers: int | None = None) -> None:
        """Every program in ``names``, from the cache or built into it now (one process at
        a time per program: another that builds the same waits and loads it). Several
        missing programs are built side by side in ``workers`` processes (default: one per
        core, at most one per program); each spends most of its time in the C++ compiler."""
        missing = [n for n in names if n not in self._run and not self.path(n).is_file()]
        self.dir.mkdir(parents=True, exist_ok=True)
        if missing:
            workers = min(len(missing), workers or os.cpu_count() or 1)
            self.say(f'compiling the model for this CPU ({", ".join(missing)}), once for '
                     f'these dims: about {15 * len(missing) // workers + 10} s on '
                     f'{workers} core(s); cached in {self.dir}')
            if workers > 1 and self._buildable_elsewhere():
                self._build_side_by_side(missing, workers)
        for name in names:
            if name in self._run:
                continue
            path = self.path(name)
            with open(path.with_suffix('.lock'), 'w') as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                t0 = time.monotonic()
                fresh = not path.is_file()
                if fresh:
                    self._build(name, path)
                self._run[name] = aoti.Program(path)
                if fresh:
                    self.built[name] = time.monotonic() - t0
                    self.say(f'compiled {name} in {self.built[name]:.1f} s')
                else:
                    self.built.setdefault(name, 0.0)

    def _buildable_elsewhere(self) -> bool:
        """Whether a worker process may make a model of these dims to trace: the programs
        depend on the dims only, so a worker builds from random weights of its own, which
        must fit beside this process's."""
        return sum(w.numel() for w in self.model.parameters()) <= _WORKER_PARAMS

    def _build_side_by_side(self, names: list[str], workers: int) -> None:
        """``names`` built by ``workers`` fresh interpreters at a time (not forked: this
        process may run threads; not multiprocessing's spawn either, which would import
        this process's main module again)."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        config = json.dumps(self.model.cfg.to_dict())
        waiting, running = list(names), {}
        while waiting or running:
            while waiting and len(running) < workers:
                name = waiting.pop(0)
                proc = subprocess.Popen(
                    [sys.executable, '-m', 'oxygen_ros.engine.compiled', name, str(self.dir),
                     str(self.threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, env=env, text=True)
                proc.stdin.write(config)
                proc.stdin.close()
                running[name] = proc
            name = next(iter(running))
            proc = running.pop(name)
            out = proc.stdout.read()
            if proc.wait() != 0:
                for other in running.values():
                    other.kill()
                raise RuntimeError(f'building program {name} failed:\n{out[-2000:]}')
            self.built[name] = float(out.strip().splitlines()[-1])
            self.say(f'compiled {name} in {self.built[name]:.1f} s')

    def _build(self, name: str, path: Path) -> None:
        args, dims = self._example(name)
        fn = {'vision': _vision, 'layers': _layers, 'velocity': _velocity,
              'decode': _decode}[name]
        program = _Program(self.model, fn, self.names[name])
        with torch.no_grad():
            ep = torch.export.export(program, (self.weights[name], *args),
                                     dynamic_shapes=([None] * len(self.weights[name]), tuple(dims)),
                                     strict=False)
        sig = ep.graph_signature
        # The model's own tensors are lifted as inputs of the program; any that is read
        # (rather than the weights passed in) would be frozen into it.
        own = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
        own.update((k, v) for k, v in sig.inputs_to_lifted_tensor_constants.items()
                   if ep.constants[v].numel() > 1)  # a scalar written into the cache is not
        baked = [own[n.name] for n in ep.graph.nodes
                 if n.op == 'placeholder' and n.name in own and n.users]
        if baked:
            # A weight read but not passed would be frozen into the program: a later
            # checkpoint of the same dims would silently run with this one's.
            raise RuntimeError(f'program {name} reads tensors it does not take as inputs: '
                               f'{baked[:5]}')
        tmp = path.with_name(f'{path.stem}.{os.getpid()}.tmp.pt2')
        try:
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _example(self, name: str):
        """Inputs to trace ``name`` with, and which of their dimensions are dynamic. The
        sizes are picked to equal no fixed dimension of the model."""
        m, cfg = self.model, self.model.cfg
        e, x = cfg.vlm, cfg.expert
        batch = Dim('batch', min=1, max=_BIG)
        length = Dim('length', min=2, max=_BIG)
        if name == 'vision':
            size = cfg.vision.image_size
            return (torch.rand(3, 3, size, size) * 2 - 1,), ({0: batch},)
        if name == 'layers':
            b, n = 2, 37
            xs = torch.randn(b, n, e.width)
            cos, sin = (t[None, :n, None].expand(b, n, 1, e.head_dim).contiguous()
                        for t in m._rope_for(n))
            last = torch.tensor([n - 1, n - 3])
            if cfg.prompt_attention == 'bidirectional':
                full = torch.ones(b, 1, 1, n, dtype=torch.bool)
                masks, mdims = (full, full), ({0: batch, 3: length}, {0: batch, 3: length})
            else:
                # Traced with at least two image and two text columns (export's guards:
                # a dimension of one broadcasts); layers() runs the others eagerly.
                images = Dim('images', min=2, max=_BIG - 2)
                length = Dim('length', min=4, max=_BIG)
                li, g = 23, e.heads // e.kv_heads
                masks = (torch.ones(b, 1, 1, li, dtype=torch.bool),
                         torch.ones(b, 1, g * (n - li), n, dtype=torch.bool),
                         torch.ones(b, 1, 1, n, dtype=torch.bool))
                # The text rows' count is the length less the images, folded per group:
                # export works the relation out (Dim.AUTO), a Dim cannot say it.
                mdims = ({0: batch, 3: images}, {0: batch, 2: Dim.AUTO, 3: length},
                         {0: batch, 3: length})
            seq = {0: batch, 1: length}
            return ((xs, cos, sin, last, masks),
                    (seq, seq, seq, {0: batch}, mdims))
        if name == 'velocity':
            b, n, h = 2, 37, cfg.action_horizon
            keys = [torch.randn(b, x.kv_heads, n, x.head_dim) for _ in range(x.depth)]
            values = [torch.randn(b, x.kv_heads, n, x.head_dim) for _ in range(x.depth)]
            bias = torch.zeros(b, 1, 1, n + h)
            cos, sin = (t[None, n:n + h, None].expand(b, h, 1, x.head_dim).contiguous()
                        for t in m._rope_for(n + h))
            mod = torch.randn(2 * x.depth + 1, 3, x.width)
            kd = [{0: batch, 2: length}] * x.depth
            return ((torch.randn(b, h, cfg.action_dim), mod, keys, values, bias, cos, sin),
                    ({0: batch}, None, kd, kd, {0: batch, 3: length + h}, {0: batch},
                     {0: batch}))
        if name == 'decode':
            rows, cols = 7, 41
            cache_rows = Dim('rows', min=2, max=_BIG)
            kv = KV.allocate(cfg, rows, cols)
            kv.valid[:, :20] = True
            kv.length[:] = 20
            kv.next_pos[:] = 20
            cos_t, sin_t = m._rope_for(cols + 1)
            table = Dim('table', min=2, max=_BIG)
            cd = {0: cache_rows, 2: length}
            return ((kv.k, kv.v, kv.valid, kv.length, kv.next_pos, torch.tensor([4, 1, 2]),
                     torch.tensor([5, 6, 7]), cos_t, sin_t),
                    ([cd] * e.depth, [cd] * e.depth, {0: cache_rows, 1: length},
                     {0: cache_rows}, {0: cache_rows}, {0: batch}, {0: batch}, {0: table},
                     {0: table}))
        raise ValueError(f'unknown program {name!r}; the programs are {PROGRAMS}')

    # -- running ---------------------------------------------------------------------------

    def _call(self, name: str, *inputs) -> list[torch.Tensor]:
        """Run program ``name`` on its inputs in the order export flattened them (its
        weights, then each argument, lists spread out); its outputs, flat. Through its C
        entry point (aoti.py), with the GIL released: the package's own call keeps it for
        the whole program, and the control thread waits."""
        return self._run[name]([*self.weights[name], *inputs])

    def vision(self, images: torch.Tensor) -> torch.Tensor:
        return self._call('vision', images.contiguous())[0]

    def layers(self, x, cos, sin, last, masks):
        """Model.prefill_layers, compiled where its shapes were traced (with causal prefix
        attention, two columns or more of images and of text); eager otherwise."""
        if masks[0] is None or (len(masks) == 3 and not 2 <= masks[0].shape[-1]
                                <= x.shape[1] - 2):
            return self.model.prefill_layers(x, cos, sin, last, masks)
        out = self._call('layers', x.contiguous(), cos.contiguous(), sin.contiguous(),
                         last.contiguous(), *(t.contiguous() for t in masks))
        depth = self.model.cfg.vlm.depth
        return out[0], out[1:1 + depth], out[1 + depth:]

    def velocity(self, x, mod, keys, values, bias, cos, sin) -> torch.Tensor:
        return self._call('velocity', x, mod, *keys, *values, bias, cos, sin)[0]

    def decode(self, kv: KV, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Model.decode_hidden(kv, rows, tokens, kv.max_len): one token into each row, in
        place."""
        cos_t, sin_t = self.model._rope_for(kv.max_len + 1)
        return self._call('decode', *kv.k, *kv.v, kv.valid, kv.length, kv.next_pos, rows,
                          tokens, cos_t, sin_t)[0]


if __name__ == '__main__':
    # A worker of Programs._build_side_by_side: NAME DIR THREADS, the config as JSON on stdin;
    # the seconds the build took, last on stdout.
    print(_build_one(json.loads(sys.stdin.read()), sys.argv[1], sys.argv[2], int(sys.argv[3])))
