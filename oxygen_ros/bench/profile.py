"""oxygen-profile: where a frame's time goes, by phase and by operation.

Runs frames of one engine (the bench's workload: random weights, one narration per frame,
T tokens each, k decode steps a frame) under torch.profiler, each model-runner call inside a
range of its phase's name, and prints for each phase its wall time per frame split into
matrix products, attention, the compiled programs' fused loops, other operations run one by
one, and what is left: Python and dispatch between operations. With --compile the programs
are built with the kernel profiler on (into a cache of their own, so the normal cache never
holds instrumented code), which makes each fused loop and product visible by name.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

import numpy as np
from torch.profiler import ProfilerActivity, profile, record_function

from ..engine import Engine, EngineConfig
from .workload import bench_model, observations

PHASES = ('prefill', 'denoise', 'decode', 'sample', 'extend', 'copy_row')
PRODUCTS = ('mm', 'bmm', 'addmm', 'baddbmm', 'linear_pointwise', 'matmul')


def kind(name: str) -> str:
    """An operation's category in the summary."""
    base = name.split('::')[-1].removeprefix('aoti_torch_cpu_').removesuffix('_out')
    if base.lstrip('_') in PRODUCTS:
        return 'matrix products'
    if 'scaled_dot_product' in name or 'flash_attention' in name:
        return 'attention'
    if name.startswith(('graph_', 'cpp_fused')) or 'cpp_fused' in name:
        return 'fused loops (compiled)'
    return 'other ops'


class Timed:
    """The engine's model runner with each call in a profiler range named for its phase, and
    its wall time summed per phase."""

    def __init__(self, runner):
        self.wall = collections.Counter()
        for phase in PHASES:
            setattr(runner, phase, self._wrap(phase, getattr(runner, phase)))

    def _wrap(self, phase, fn):
        def call(*args, **kw):
            t = time.perf_counter()
            with record_function(f'phase::{phase}'):
                out = fn(*args, **kw)
            self.wall[phase] += time.perf_counter() - t
            return out
        return call


def summary(prof, timed: Timed, frames: int) -> dict:
    """Per phase: wall ms per frame, and the operations' own time in it by category."""
    events = prof.events()
    ranges = [e for e in events if e.name.startswith('phase::')]
    out = {}
    for phase in PHASES:
        mine = [r for r in ranges if r.name == f'phase::{phase}']
        if not mine:
            continue
        spans = [(r.time_range.start, r.time_range.end) for r in mine]
        cats, ops = collections.Counter(), collections.Counter()
        for e in events:
            if e.name.startswith('phase::') or e.thread != mine[0].thread:
                continue
            t = e.time_range.start
            if any(a <= t < b for a, b in spans):
                us = e.self_cpu_time_total
                cats[kind(e.name)] += us
                ops[e.name] += us
        wall = sum(b - a for a, b in spans)
        cats['Python, dispatch, wrappers'] = max(0.0, wall - sum(cats.values()))
        out[phase] = dict(wall_ms=wall / 1e3 / frames,
                          by_kind={k: v / 1e3 / frames for k, v in cats.most_common()},
                          top_ops=[(k, v / 1e3 / frames) for k, v in ops.most_common(8)])
    return out


def table(result: dict, title: str) -> str:
    kinds = ['matrix products', 'attention', 'fused loops (compiled)', 'other ops',
             'Python, dispatch, wrappers']
    lines = [f'### {title}', '', '| phase | ms a frame | ' + ' | '.join(kinds) + ' |',
             '|---' * (len(kinds) + 2) + '|']
    for phase, r in result.items():
        cells = [f"{r['by_kind'].get(k, 0.0):.2f}" for k in kinds]
        lines.append(f"| {phase} | {r['wall_ms']:.2f} | " + ' | '.join(cells) + ' |')
    lines.append('')
    for phase, r in result.items():
        ops = ', '.join(f'{name} {ms:.2f}' for name, ms in r['top_ops'])
        lines.append(f'- {phase}, largest operations (ms a frame): {ops}')
    return '\n'.join(lines)


def run(argv=None) -> str:
    p = argparse.ArgumentParser(prog='oxygen-profile', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--config', default='small', help='model config name or YAML path')
    p.add_argument('--cameras', type=int, default=3)
    p.add_argument('--T', type=int, default=30, help='tokens per request')
    p.add_argument('--k', type=int, default=5, help='decode steps per frame')
    p.add_argument('--N', type=int, default=10, help='denoise steps')
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--frames', type=int, default=20)
    p.add_argument('--warmup', type=int, default=10)
    p.add_argument('--mode', default='oxygen')
    p.add_argument('--compile', action=argparse.BooleanOptionalAction, default=True)
    p.add_argument('--out', default=None, help='write the summary (markdown) here')
    args = p.parse_args(argv)

    model, tok, device = bench_model(args.config, 'cpu', args.threads)
    cache = tempfile.mkdtemp(prefix='oxygen-profile-')
    if args.compile:
        # Instrumented code, in a cache of its own.
        import torch._inductor.config as inductor
        inductor.cpp.enable_kernel_profile = True
    cfg = EngineConfig(mode=args.mode, denoise_steps=args.N, decode_k=args.k,
                       max_requests=-(-args.T // args.k) + 2, max_new_tokens=args.T,
                       stop_at_eos=False, prompt_format='subtask', compile=args.compile,
                       compile_cache=cache)
    engine = Engine(cfg, model=model, tokenizer=tok)
    timed = Timed(engine.scheduler.runner)
    obs = list(observations(engine.model_cfg, args.warmup + args.frames, args.cameras))
    for o in obs[:args.warmup]:
        engine.step(o, narrate=True)
    timed.wall.clear()
    frame_ms = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for o in obs[args.warmup:]:
            frame_ms.append(engine.step(o, narrate=True).timing['frame_ms'])
    result = summary(prof, timed, args.frames)
    title = (f'{args.config}, {args.cameras} camera(s), {args.mode} at T = {args.T} (k = '
             f'{args.k}), {args.threads} threads, {engine.backend}: frame '
             f'{np.median(frame_ms):.1f} ms p50 under the profiler')
    text = table(result, title)
    print(text)
    if args.out:
        Path(args.out).write_text(text + '\n')
    return text


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
