"""oxygen-bench: every scheduling mode on one model, measured the way the OxyGen paper does.

One frame = one new observation and one new language request. End-of-sequence is off, so
every request emits exactly T tokens. Metrics (warm-up frames excluded):
- action frequency = action_horizon x frames per second (frame time = the scheduler's own
  wall time of prefill, denoising and language decoding, direct model calls);
- language throughput = tokens emitted in a frame / frame time, averaged over frames;
- speedup = action frequency / that of `isolated` at the same T and N.
Phase times (prefill P, N denoise steps D, one decode step d_b at batch b) are timed in
rounds between each mode's own frames, giving each mode the sum of its phases and oxygen
the ratio its phases allow: (2P + D + T d_1) over isolated's frames against (P + D + k d_B)
over its own. A frame longer than its phases spends that time outside the model.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..engine import Engine, EngineConfig
from ..engine.requests import Request
from . import fleet as fleet_bench
from .energy import Meter
from .workload import _ms, bench_model, frame_flops, gemm_gflops, observations, times

MODES = ('isolated', 'shared_kv', 'parallel', 'oxygen')


class Phases:
    """P, D and d_b, measured with the same kernels the schedulers call (with graphs on,
    the static denoise and decode, replayed as CUDA graphs on a GPU), on an engine of their
    own so that they can be timed between another engine's frames.

    Each ``round()`` times the phases once each in the order a frame runs them: prefill,
    denoise, then for each batch size b in ``runs`` a run of ``runs[b]`` decode steps in a
    row; d_b is the time per step of that run. A phase's figure is its median over the
    rounds. Timing one phase many times in a row instead would start every repeat with that
    phase's own data in the CPU caches, which no frame does; and a run of steps is cheaper
    per step than a single step (the first after other work is the slowest), so a run of
    the frame's own length is what stands for the frame's decoding. Each run starts on rows
    holding as many generated tokens as make its rows ``length`` long on average, the
    length a frame's requests have on average; the rows are rewound after each run, outside
    the timing.
    """

    def __init__(self, engine: Engine, steps: int, runs: dict[int, int], length: int = 0,
                 cameras: int = 3):
        self.engine, self.steps, self.runs = engine, steps, dict(runs)
        rows = max(runs)
        if rows > engine.cache.max_requests:
            raise ValueError(f'a decode run of batch {rows} needs as many KV rows; the '
                             f'engine has {engine.cache.max_requests}')
        self.starts = {b: max(0, length - n // 2) for b, n in runs.items()}
        room = engine.cache.max_new_tokens
        if any(self.starts[b] + n > room for b, n in runs.items()):
            raise ValueError(f'decode runs {runs} at average length {length} do not fit '
                             f'in KV rows of {room} tokens')
        self.frame = engine.frame(next(observations(engine.model_cfg, 1, cameras)))
        self._requests = [Request(stamp=0.0) for _ in range(rows)]
        self.times = {'prefill': [], 'denoise': [], **{b: [] for b in runs}}
        kv, f = engine.cache.kv, self.frame
        # The rows' bookkeeping after each count of generated tokens a run starts at; the
        # keys and values written on the way stay valid for every shorter start.
        self._at = {}
        self.runner = engine.scheduler.runner
        with torch.inference_mode():
            for r in range(rows):
                self.runner.prefill(f.images, f.image_mask, f.tokens, f.token_mask,
                                    slice(r, r + 1))
            for n in range(max(self.starts.values()) + 1):
                if n:
                    self._decode(rows)
                if n in self.starts.values():
                    self._at[n] = kv.length.clone(), kv.next_pos.clone(), kv.valid.clone()
            self._prefill()  # warm-up

    def _decode(self, b: int) -> None:
        # A whole decode step: the pass, the output layer and choosing the tokens.
        hidden = self.runner.decode(list(range(b)), [5] * b)
        self.runner.sample(hidden, self._requests[:b], self.engine.tokenizer.vocab_size)

    def _prefill(self) -> None:
        f, row = self.frame, self.engine.cache.scratch
        self.runner.prefill(f.images, f.image_mask, f.tokens, f.token_mask,
                            slice(row, row + 1))

    def _denoise(self) -> None:
        row = self.engine.cache.scratch
        self.runner.denoise(slice(row, row + 1), self.frame.noise)

    @torch.inference_mode()
    def round(self) -> None:
        dev, kv = self.engine.device, self.engine.cache.kv
        self.times['prefill'].append(_ms(self._prefill, dev))
        self.times['denoise'].append(_ms(self._denoise, dev))
        for b, n in self.runs.items():
            kv.length[:], kv.next_pos[:], kv.valid[:] = self._at[self.starts[b]]
            ms = _ms(lambda b=b, n=n: [self._decode(b) for _ in range(n)], dev)
            self.times[b].append(ms / n)

    def result(self) -> dict:
        t = {key: float(np.median(v)) for key, v in self.times.items()}
        return dict(prefill_ms=t['prefill'], denoise_ms=t['denoise'],
                    decode_ms={b: t[b] for b in self.runs}, runs=self.runs,
                    rounds=len(self.times['prefill']), starts=self.starts)


def phase_times(engine: Engine, steps: int, repeats: int, runs: dict[int, int],
                length: int = 0, cameras: int = 3) -> dict:
    """``repeats`` rounds of Phases on ``engine``, back to back."""
    phases = Phases(engine, steps, runs, length, cameras)
    for _ in range(repeats):
        phases.round()
    return phases.result()


# The scheduler's timing of a frame's parts (language_prefill: the isolated baseline's
# second prefill and rows admitted from the wait queue).
PARTS = ('prefill_ms', 'denoise_ms', 'language_prefill_ms', 'decode_ms')


def run_mode(engine: Engine, frames: int, warmup: int, cameras: int,
             phases: Phases | None = None) -> dict:
    """``frames`` measured frames after ``warmup`` ones; with ``phases``, one round of phase
    timings after each measured frame (outside the frame's own timing)."""
    frame_ms, tok_rate, tokens, batches = [], [], 0, []
    parts = {key: [] for key in PARTS}
    for i, obs in enumerate(observations(engine.model_cfg, warmup + frames, cameras)):
        r = engine.step(obs, narrate=True)
        if i < warmup:
            continue
        if phases is not None:
            phases.round()
        for key, v in parts.items():
            if key in r.timing:
                v.append(r.timing[key])
        ms = r.timing['frame_ms']
        n = sum(1 for e in r.events if not e.cancelled)
        frame_ms.append(ms)
        tok_rate.append(n * 1000.0 / ms)
        tokens += n
        batches += r.timing.get('batches', [])
    engine.cancel_all()
    ms = np.array(frame_ms)
    return dict(
        frames=frames,
        frame_ms_mean=float(ms.mean()),
        frame_ms_p50=float(np.percentile(ms, 50)),
        frame_ms_p99=float(np.percentile(ms, 99)),
        action_hz=engine.action_horizon * 1000.0 / float(ms.mean()),
        tokens_per_s=float(np.mean(tok_rate)),
        tokens=tokens,
        mean_batch=float(np.mean(batches)) if batches else 0.0,
        budget_misses=int((ms > engine.scheduler.frame_budget_ms).sum()),
        # Medians of the frame's own parts, to set beside the phases measured alone.
        in_frame={key: float(np.median(v)) for key, v in parts.items() if v},
    )


def frame_energy(meter: Meter, engine: Engine, cameras: int) -> dict | None:
    """Energy per frame (mJ) at the engine's steady state: run_mode's frames, repeated for
    at least two seconds (the counter's resolution); None without a counter."""
    if meter.handle is None:
        return None
    obs = list(observations(engine.model_cfg, 8, cameras))
    count = iter(range(1 << 62))
    out = meter.per_call(lambda: engine.step(obs[next(count) % len(obs)], narrate=True))
    engine.cancel_all()
    return out


def memory_mb(engine: Engine) -> float:
    """Peak device memory on CUDA; on CPU the bytes of the weights and KV caches held."""
    if engine.device.type == 'cuda':
        return torch.cuda.max_memory_allocated(engine.device) / 2**20
    s = engine.scheduler
    models = [s.actor.runner.model, s.lang.runner.model] if s.mode == 'parallel' \
        else [engine.model]
    caches = [s.actor.cache, s.lang.cache] if s.mode == 'parallel' else [engine.cache]
    n = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
    n += sum(c.total_bytes for c in caches)
    return n / 2**20


def run(argv=None) -> dict:
    """The benchmark with command-line arguments `argv`; returns what bench.json holds."""
    p = argparse.ArgumentParser(prog='oxygen-bench', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--config', default='small', help='model config name or YAML path')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--T', type=int, nargs='+', default=[5, 10, 20, 30], help='tokens/request')
    p.add_argument('--N', type=int, default=10, help='denoise steps')
    p.add_argument('--k', type=int, default=5, help='decode steps per frame (oxygen)')
    p.add_argument('--modes', nargs='+', default=list(MODES), choices=MODES)
    p.add_argument('--frames', type=int, default=20)
    p.add_argument('--warmup', type=int, default=8)
    p.add_argument('--cameras', type=int, default=3)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--repeats', type=int, default=20, help='rounds of phase timings')
    p.add_argument('--adaptive', action='store_true',
                   help='also sweep fixed k against adaptive k at the largest T')
    p.add_argument('--control-rate', type=float, default=70.0)
    p.add_argument('--compile', action=argparse.BooleanOptionalAction, default=True,
                   help='the compiled model runner where it pays (float32 on a CPU); '
                        '--no-compile: eager')
    p.add_argument('--graphs', action='store_true',
                   help='static-shape denoise and decode, CUDA graphs on a GPU (graphs: true)')
    p.add_argument('--out', default='benchmarks/out')
    p.add_argument('--plot', action=argparse.BooleanOptionalAction, default=True)
    p.add_argument('--robots', type=int, nargs='+', default=None,
                   help='instead of the modes: one engine serving K robots (fleet) against '
                        'their frames one after another (sliced) and K engines (separate), '
                        'for each K given (fleet_bench.py)')
    p.add_argument('--fresh', action=argparse.BooleanOptionalAction, default=True,
                   help='with --robots: each mode and K in a fresh subprocess (its own '
                        'peak RSS)')
    args = p.parse_args(argv)
    if args.robots:
        return _fleet(args)

    model, tok, device = bench_model(args.config, args.device, args.threads)
    dtype = model.dtype
    params = sum(p.numel() for p in model.parameters())
    t_max = max(args.T)
    max_batch = math.ceil(t_max / args.k) + 1

    def engine(mode, T, k=args.k):
        cfg = EngineConfig(mode=mode, device=args.device, denoise_steps=args.N, decode_k=k,
                           max_requests=max_batch + 1, max_new_tokens=T, stop_at_eos=False,
                           prompt_format='subtask', control_rate_hz=args.control_rate,
                           compile=args.compile, graphs=args.graphs and mode != 'parallel')
        return Engine(cfg, model=model, tokenizer=tok)

    # The table's decode steps: runs of k at each batch size, rows half a request long.
    run, length = min(args.k, t_max), t_max // 2
    held = torch.cuda.memory_allocated(device) if device.type == 'cuda' else 0
    timer = engine('oxygen', t_max)  # the engine the phases are timed on
    rows_max = min(max_batch, timer.cache.max_requests)
    gemm = [gemm_gflops(device)]  # the machine's rate, before the model's and after
    phases = phase_times(timer, args.N, args.repeats, {b: run for b in range(1, rows_max + 1)},
                         length, args.cameras)
    flops = frame_flops(timer, next(observations(timer.model_cfg, 1, args.cameras)))
    if device.type == 'cuda':
        held = torch.cuda.memory_allocated(device) - held
    P, D, d = phases['prefill_ms'], phases['denoise_ms'], phases['decode_ms']
    print(f'model {args.config}: {params / 1e6:.1f}M params, {device}, {dtype}, '
          f'{torch.get_num_threads()} threads')
    print(f'phases: prefill {P:.1f} ms, {args.N} denoise steps {D:.1f} ms, decode step '
          + ', '.join(f'b={b} {v:.2f} ms' for b, v in d.items()))

    rows = []
    meter = Meter(device)
    if device.type == 'cuda' and meter.handle is None:
        print(f'energy: not measured ({meter.why})')
    plan = [(T, m) for T in args.T for m in args.modes]
    for T, mode in tqdm(plan, desc='oxygen-bench', unit='run'):
        e = engine(mode, T)
        # Each mode's phases are timed between its own frames, so a machine that slows
        # down during one mode's run slows that mode's phases too; its decoding as its frame
        # runs it: T steps at batch 1 (the baselines), or k steps at the batch that T
        # tokens per request at k a frame make. (parallel runs two models at once: no sum
        # of phases describes its frame.)
        b = min(math.ceil(T / args.k), rows_max) if mode == 'oxygen' else 1
        n = min(args.k, T) if mode == 'oxygen' else T
        own = Phases(timer, args.N, {b: n}, T // 2, args.cameras) \
            if mode != 'parallel' else None
        r = run_mode(e, args.frames, args.warmup, args.cameras, own)
        r.update(mode=mode, T=T, N=args.N, k=args.k if mode == 'oxygen' else T)
        if device.type == 'cuda':
            # Peak memory from a second pass without the phase rounds, whose work is not
            # the mode's; the phase engine's tensors are taken off.
            torch.cuda.empty_cache()  # what earlier engines left cached is not this one's
            torch.cuda.reset_peak_memory_stats(device)
            run_mode(e, args.frames, args.warmup, args.cameras)
            r['memory_mb'] = (torch.cuda.max_memory_allocated(device) - held) / 2**20
            # CUDA graphs replay in a private pool that the allocator does not count as
            # allocated; reserved memory includes it (and the phase engine's).
            r['memory_reserved_mb'] = torch.cuda.max_memory_reserved(device) / 2**20
            # At the largest T only: two seconds of frames per row add up on a GPU check.
            energy = frame_energy(meter, e, args.cameras) if T == t_max else None
            if energy is not None:
                r['energy_mj_per_frame'] = energy['mj_per_call']
                r['watts'] = energy['watts']
        else:
            r['memory_mb'] = memory_mb(e)
        if own is not None:
            # What the frame would take if it were nothing but its phases.
            r['phases'] = ph = own.result()
            r['phase_ms'] = (2 if mode == 'isolated' else 1) * ph['prefill_ms'] \
                + ph['denoise_ms'] + n * ph['decode_ms'][b]
        rows.append(r)
        if hasattr(e.scheduler, 'close'):
            e.scheduler.close()
    for r in rows:
        base = next((x for x in rows if x['T'] == r['T'] and x['mode'] == 'isolated'), None)
        r['speedup'] = r['action_hz'] / base['action_hz'] if base else float('nan')
        if r['mode'] == 'oxygen' and base is not None:
            # Both sums from phases timed during their own mode's run.
            r['phase_ratio'] = base['phase_ms'] / r['phase_ms']

    sweep = []
    if args.adaptive:
        for k in tqdm([1, 2, 3, 5, 6, 10, 0], desc='k sweep', unit='run'):
            e = engine('oxygen', t_max, k)
            r = run_mode(e, args.frames, args.warmup, args.cameras)
            r.update(mode='oxygen', T=t_max, k=k if k else 'adaptive',
                     budget_ms=e.scheduler.frame_budget_ms)
            sweep.append(r)

    gemm.append(gemm_gflops(device))
    rate = flops['action_path'] / ((P + D) * 1e6)
    arithmetic = dict(flops=flops, gemm_gflops=gemm, action_path_gflops=rate,
                      of_gemm=rate / float(np.median(gemm)))
    print(f"action path (prefill + {args.N} denoise steps): {flops['action_path'] / 1e6:.0f} "
          f"MFLOP in {P + D:.1f} ms = {rate:.1f} GFLOP/s, {arithmetic['of_gemm']:.2f} of the "
          f"machine's {2048}^3 product rate ({', '.join(f'{g:.0f}' for g in gemm)} GFLOP/s "
          f"before and after)")
    report = dict(config=args.config, params=params, device=str(device), dtype=str(dtype),
                  threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine(),
                  N=args.N, k=args.k, compile=args.compile, graphs=args.graphs,
                  backend=timer.backend, phases=phases, arithmetic=arithmetic, results=rows,
                  k_sweep=sweep)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / 'bench.json').write_text(json.dumps(report, indent=2))
    keys = ['mode', 'T', 'N', 'k', 'frame_ms_mean', 'frame_ms_p50', 'frame_ms_p99',
            'action_hz', 'tokens_per_s', 'speedup', 'phase_ratio', 'memory_mb', 'mean_batch']
    with open(out / 'bench.csv', 'w', newline='') as fh:
        w = csv.DictWriter(fh, keys, extrasaction='ignore')
        w.writeheader()
        w.writerows(rows)
    print(table(rows))
    print(phase_lines(rows))
    if sweep:
        print(sweep_table(sweep))
    if args.plot:
        plot(rows, out / 'bench.png', args)
        print(f'wrote {out / "bench.json"}, {out / "bench.csv"}, {out / "bench.png"}')
    return report


def _fleet(args) -> dict:
    if min(args.robots) < 1:
        raise SystemExit('--robots: each K must be >= 1')
    report = dict(config=args.config, device=args.device, threads=args.threads,
                  cpu=platform.processor() or platform.machine(), N=args.N, k=args.k,
                  graphs=args.graphs, **fleet_bench.run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / 'fleet.json').write_text(json.dumps(report, indent=2))
    keys = ['mode', 'robots', 'T', 'N', 'k', 'round_ms_mean', 'action_hz', 'vs_sliced',
            'latency_ms_p50', 'latency_ms_p99', 'tokens_per_s', 'rss_peak_mb', 'rss_vs_one',
            'peak_mb', 'peak_vs_one', 'held_mb', 'held_vs_one', 'cuda_peak_mb',
            'energy_mj_per_robot_frame', 'watts']
    with open(out / 'fleet.csv', 'w', newline='') as fh:
        w = csv.DictWriter(fh, keys, extrasaction='ignore')
        w.writeheader()
        w.writerows(report['rows'])
    print(fleet_bench.table(report['rows']))
    print(fleet_bench.phase_lines(report['rows']))
    wrote = [out / 'fleet.json', out / 'fleet.csv']
    if args.plot:
        fleet_bench.plot(report['rows'], out / 'fleet.png', args)
        wrote.append(out / 'fleet.png')
    print('wrote ' + ', '.join(str(p) for p in wrote))
    return report


def main(argv=None) -> int:
    """`oxygen-bench`: the console script exits with what this returns, so it must not be the
    report."""
    run(argv)
    return 0


def table(rows) -> str:
    lines = ['| mode | T | frame ms p50 | p99 | action Hz | tokens/s | speedup | phase ratio '
             '| memory MB |', '|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        lines.append(f"| {r['mode']} | {r['T']} | {r['frame_ms_p50']:.1f} | "
                     f"{r['frame_ms_p99']:.1f} | {r['action_hz']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {times(r['speedup'])} | "
                     f"{times(r.get('phase_ratio'))} | "
                     f"{r['memory_mb']:.0f} |")
    return '\n'.join(lines)


def phase_lines(rows) -> str:
    """Each frame against the sum of its phases, and oxygen's speedup against its ratio:
    what the frame spends outside the model phases shows here."""
    lines = []
    for r in rows:
        if 'phase_ms' not in r:
            continue
        parts = ', '.join(f"{k.removesuffix('_ms').replace('_', ' ')} {v:.1f}"
                          for k, v in r.get('in_frame', {}).items())
        line = (f"{r['mode']} T={r['T']}: frame {r['frame_ms_mean']:.1f} ms = "
                f"{r['frame_ms_mean'] / r['phase_ms']:.3f} x its phases ({r['phase_ms']:.1f} ms;"
                f" in the frame, medians: {parts})")
        if 'phase_ratio' in r:
            line += (f"; speedup {r['speedup']:.2f}x = {100 * r['speedup'] / r['phase_ratio']:.0f}%"
                     f" of the phase ratio {r['phase_ratio']:.2f}x")
        lines.append(line)
    return '\n'.join(lines)


def sweep_table(rows) -> str:
    lines = ['| k | frame ms p50 | p99 | budget ms | frames over budget | action Hz | tokens/s |',
             '|---|---|---|---|---|---|---|']
    for r in rows:
        lines.append(f"| {r['k']} | {r['frame_ms_p50']:.1f} | {r['frame_ms_p99']:.1f} | "
                     f"{r['budget_ms']:.0f} | {r['budget_misses']}/{r['frames']} | "
                     f"{r['action_hz']:.1f} | {r['tokens_per_s']:.0f} |")
    return '\n'.join(lines)


def plot(rows, path: Path, args) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in args.modes:
        rs = [r for r in rows if r['mode'] == mode]
        a.plot([r['T'] for r in rs], [r['speedup'] for r in rs], 'o-', label=mode)
        b.plot([r['tokens_per_s'] for r in rs], [r['action_hz'] for r in rs], 'o-', label=mode)
        for r in rs:
            b.annotate(f"T={r['T']}", (r['tokens_per_s'], r['action_hz']), fontsize=7,
                       xytext=(3, 3), textcoords='offset points')
    a.set(xlabel='decode length T (tokens per request)', ylabel='speedup over isolated',
          title=f'Action frequency speedup (N={args.N}, k={args.k})')
    b.axhline(args.control_rate, color='grey', ls='--', lw=0.8)
    b.set(xlabel='language throughput (tokens/s)', ylabel='action frequency (Hz)',
          title='Action Hz vs language tokens/s')
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f'oxygen-bench: {args.config} config on {args.device}')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == '__main__':
    raise SystemExit(main())
