"""oxygen-bench --robots K...: one engine serving K robots against the alternatives.

Each round every robot has a new observation and starts one narration request (T tokens,
end-of-sequence off); the round starts when the observations are there. Modes:
- ``fleet``: one engine, one batched frame of all K robots (Engine.step_fleet);
- ``sliced``: one engine, the K robots' frames one after another (each a frame of one
  robot; the language of all of them decodes in every frame);
- ``separate``: K engines, one model copy each, their frames one after another on the
  same cores.
Metrics over the measured rounds: aggregate action rate (K x horizon x rounds / wall time),
per-robot chunk latency from the round's start to that robot's chunk (p50, p99 over robots
and rounds), language tokens/s, peak RSS of the process (each mode and K runs in a fresh
subprocess, so that peaks are its own) and the bytes of weights and KV caches held.
The phases say what batching allows: a batched prefill + denoise of K observations against
K single ones, timed in rounds between the mode's own rounds.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..engine import Engine, EngineConfig, RobotInput
from .workload import times

FLEET_MODES = ('fleet', 'sliced', 'separate')


def _rss_mb() -> float:
    """Peak resident set of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _held_mb(engines) -> float:
    """Weights and KV caches the engines hold (each model counted once)."""
    models = {id(e.model): e.model for e in engines}
    n = sum(p.numel() * p.element_size() for m in models.values() for p in m.parameters())
    n += sum(e.cache.total_bytes for e in engines)
    return n / 2**20


def _sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


def _robot_observations(model_cfg, k: int, n: int, cameras: int):
    from .workload import observations  # the single-robot benchmark's observations
    return {f'r{i}': list(observations(model_cfg, n, cameras, seed=i)) for i in range(k)}


class FleetPhases:
    """Prefill + denoise of ``k`` observations in one batch against each alone, with the
    kernels the fleet frame calls, in the engine's scratch rows (which every frame's
    prefill rewrites), between the engine's own frames."""

    def __init__(self, engine: Engine, obs: list, steps: int):
        self.engine, self.steps = engine, steps
        g = torch.Generator().manual_seed(0)
        self.parts = []
        for o in obs:
            images, present, text = engine.inputs.observation(o)
            tokens, mask = engine.tokenizer.tokenize(text, engine.model_cfg.max_token_len)
            self.parts.append((torch.stack(images), present, torch.from_numpy(tokens),
                               torch.from_numpy(mask), engine.inputs.noise(None, g, o.stamp)[0]))
        self.times = {'batched': [], 'single': []}

    def _run(self, parts) -> None:
        e, b = self.engine, len(parts)
        dev, dtype = e.device, e.cache.kv.dtype
        images = torch.stack([p[0] for p in parts]).to(dev, dtype)
        mask = torch.tensor([p[1] for p in parts], device=dev)
        tokens = torch.stack([p[2] for p in parts]).to(dev)
        tmask = torch.stack([p[3] for p in parts]).to(dev)
        noise = torch.stack([p[4] for p in parts]).to(dev, dtype)
        block = slice(e.cache.scratch, e.cache.scratch + b)
        runner = e.scheduler.runner
        runner.prefill(images, mask, tokens, tmask, block)
        runner.denoise(block, noise)

    @torch.inference_mode()
    def round(self) -> None:
        dev = self.engine.device
        _sync(dev)
        t = time.perf_counter()
        self._run(self.parts)
        _sync(dev)
        t1 = time.perf_counter()
        for p in self.parts:
            self._run([p])
        _sync(dev)
        t2 = time.perf_counter()
        self.times['batched'].append((t1 - t) * 1e3)
        self.times['single'].append((t2 - t1) * 1e3)

    def result(self) -> dict:
        b, s = (float(np.median(v)) for v in (self.times['batched'], self.times['single']))
        return dict(batched_ms=b, singles_ms=s, ratio=s / b, rounds=len(self.times['batched']))


def child(mode: str, k: int, T: int, config: str, device: str, threads: int, N: int,
          decode_k: int, frames: int, warmup: int, cameras: int, repeats: int,
          graphs: bool = False, control_rate: float = 70.0) -> dict:
    """One mode at K robots, in this process; returns its row."""
    from .workload import bench_model
    rss0 = _rss_mb()
    model, tok, dev = bench_model(config, device, threads)
    # Rows for every request a robot has in flight: one a round, each lasting T/k rounds.
    per_robot = math.ceil(T / decode_k) + 1

    def make(robots: int, served: int, model):
        """An engine for frames of ``robots`` robots, with rows for ``served`` robots."""
        cfg = EngineConfig(mode='oxygen', device=device, denoise_steps=N, decode_k=decode_k,
                           max_requests=per_robot * served, max_new_tokens=T,
                           stop_at_eos=False, prompt_format='subtask',
                           control_rate_hz=control_rate, graphs=graphs, robots=robots,
                           robot_rows=per_robot)
        return Engine(cfg, model=model, tokenizer=tok)

    names = [f'r{i}' for i in range(k)]
    if mode == 'separate':
        models = [model] + [bench_model(config, device, threads)[0] for _ in range(k - 1)]
        engines = {n: make(1, 1, m) for n, m in zip(names, models, strict=True)}
        for n, e in engines.items():
            e.add_robot(n)
    else:
        one = make(k if mode == 'fleet' else 1, k, model)
        engines = {n: one for n in names}
        for n in names:
            one.add_robot(n)
    obs = _robot_observations(model.cfg, k, warmup + frames, cameras)
    phases = None
    if repeats and mode == 'fleet':
        phases = FleetPhases(engines[names[0]], [obs[n][0] for n in names], N)
    latency, tokens, wall, batch = [], 0, 0.0, []
    horizon = model.cfg.action_horizon
    for i in range(warmup + frames):
        _sync(dev)
        t0 = time.perf_counter()
        out = {}

        def got(robot, actions, out=out):
            out[robot] = time.perf_counter()

        results = []
        if mode == 'fleet':
            results.append(engines[names[0]].step_fleet(
                {n: RobotInput(obs[n][i], narrate=True) for n in names}, on_actions=got))
        else:
            for n in names:
                results.append(engines[n].step_fleet(
                    {n: RobotInput(obs[n][i], narrate=True)}, on_actions=got))
        _sync(dev)
        t1 = time.perf_counter()
        if i < warmup:
            continue
        if phases is not None and len(phases.times['batched']) < repeats:
            phases.round()
        for r in results:
            if r.errors:
                raise RuntimeError(f'robots failed: {r.errors}')
        wall += t1 - t0
        batch += [r.timing['robots'] for r in results]
        latency += [(out[n] - t0) * 1e3 for n in names]
        tokens += sum(1 for r in results for evs in r.events.values() for e in evs
                      if not e.cancelled)
    unique = list({id(e): e for e in engines.values()}.values())
    for e in unique:
        e.cancel_all()
    energy = None
    if dev.type == 'cuda':  # a round as measured, repeated for the counter (energy.py)
        from .energy import Meter

        count = iter(range(1 << 62))

        def one_round():
            i = warmup + next(count) % frames
            if mode == 'fleet':
                engines[names[0]].step_fleet({n: RobotInput(obs[n][i], narrate=True)
                                              for n in names})
            else:
                for n in names:
                    engines[n].step_fleet({n: RobotInput(obs[n][i], narrate=True)})

        energy = Meter(dev).per_call(one_round)
        for e in unique:
            e.cancel_all()
    lat = np.array(latency)
    row = dict(mode=mode, robots=k, T=T, N=N, k=decode_k, rounds=frames,
               round_ms_mean=wall * 1e3 / frames,
               action_hz=k * horizon * frames / wall,
               latency_ms_p50=float(np.percentile(lat, 50)),
               latency_ms_p99=float(np.percentile(lat, 99)),
               tokens_per_s=tokens / wall, tokens=tokens,
               robots_per_frame=float(np.mean(batch)),
               held_mb=_held_mb(unique), rss_peak_mb=_rss_mb(), rss_start_mb=rss0,
               engines=len(unique))
    # Peak memory: the process's RSS, and on CUDA the device's peak allocated (each mode and
    # K in its own process, so the peak is its own).
    row['peak_mb'] = row['rss_peak_mb']
    if dev.type == 'cuda':
        row['peak_mb'] = row['cuda_peak_mb'] = torch.cuda.max_memory_allocated(dev) / 2**20
    if phases is not None:
        row['phases'] = phases.result()
    if energy is not None:
        # Per robot's frame, to set beside a single robot's frame.
        row['energy_mj_per_round'] = energy['mj_per_call']
        row['energy_mj_per_robot_frame'] = energy['mj_per_call'] / k
        row['watts'] = energy['watts']
    return row


def run(args) -> dict:
    """Every mode at every K (and T), each in a fresh subprocess unless --no-fresh."""
    rows = []
    plan = [(T, k, m) for T in args.T for k in args.robots for m in FLEET_MODES]
    for T, k, mode in plan:
        kw = dict(mode=mode, k=k, T=T, config=args.config, device=args.device,
                  threads=args.threads, N=args.N, decode_k=args.k, frames=args.frames,
                  warmup=args.warmup, cameras=args.cameras, repeats=args.repeats,
                  graphs=args.graphs, control_rate=args.control_rate)
        if args.fresh:
            # The child imports the package this one did.
            root = str(Path(__file__).resolve().parents[2])
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                       PYTHONPATH=os.pathsep.join([root, os.environ.get('PYTHONPATH', '')]))
            done = subprocess.run([sys.executable, '-m', 'oxygen_ros.bench.fleet',
                                   json.dumps(kw)], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f'{mode} at {k} robots failed:\n{done.stderr[-3000:]}')
            row = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            row = child(**kw)
        print(f"{mode} robots={k} T={T}: {row['action_hz']:.1f} Hz, latency p50 "
              f"{row['latency_ms_p50']:.1f} ms", flush=True)
        rows.append(row)
    for r in rows:
        same = {m: x for x in rows if x['robots'] == r['robots'] and x['T'] == r['T']
                for m in [x['mode']]}
        if 'sliced' in same:
            r['vs_sliced'] = r['action_hz'] / same['sliced']['action_hz']
        one = next((x for x in rows if x['robots'] == 1 and x['T'] == r['T']
                    and x['mode'] == 'fleet'), None)
        if one is not None:
            r['rss_vs_one'] = r['rss_peak_mb'] / one['rss_peak_mb']
            r['peak_vs_one'] = r['peak_mb'] / one['peak_mb']
            r['held_vs_one'] = r['held_mb'] / one['held_mb']
    return dict(rows=rows, fresh=args.fresh)


def table(rows) -> str:
    """The rows as markdown; peak memory is RSS on a CPU, peak allocated on CUDA, and energy
    (mJ per robot's frame, from the GPU's counter) shows where there is one."""
    energy = any('energy_mj_per_robot_frame' in r for r in rows)
    lines = ['| mode | robots | T | action Hz (all) | vs sliced | chunk latency p50 | p99 '
             '| tokens/s | peak MB | x 1 robot | weights+KV MB | x 1 robot |'
             + (' mJ per robot frame |' if energy else ''),
             '|---|---|---|---|---|---|---|---|---|---|---|---|' + ('---|' if energy else '')]
    for r in rows:
        e = r.get('energy_mj_per_robot_frame')
        lines.append(
            f"| {r['mode']} | {r['robots']} | {r['T']} | {r['action_hz']:.1f} | "
            f"{times(r.get('vs_sliced'))} | {r['latency_ms_p50']:.1f} | "
            f"{r['latency_ms_p99']:.1f} | {r['tokens_per_s']:.0f} | {r['peak_mb']:.0f} | "
            f"{times(r.get('peak_vs_one'))} | {r['held_mb']:.1f} | "
            f"{times(r.get('held_vs_one'))} |"
            + ((f' {e:.0f} |' if e is not None else ' |') if energy else ''))
    return '\n'.join(lines)


def phase_lines(rows) -> str:
    out = []
    for r in rows:
        ph = r.get('phases')
        if ph:
            out.append(f"robots={r['robots']} T={r['T']}: prefill+denoise of {r['robots']} "
                       f"in one batch {ph['batched_ms']:.1f} ms, {r['robots']} alone "
                       f"{ph['singles_ms']:.1f} ms: batching allows {ph['ratio']:.2f}x on the "
                       f"action phases (medians of {ph['rounds']} rounds)")
    return '\n'.join(out)


def plot(rows, path: Path, args) -> None:
    """Robots against aggregate action rate and against each robot's chunk latency."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in FLEET_MODES:
        rs = sorted((r for r in rows if r['mode'] == mode), key=lambda r: r['robots'])
        if not rs:
            continue
        k = [r['robots'] for r in rs]
        a.plot(k, [r['action_hz'] for r in rs], 'o-', label=mode)
        line, = b.plot(k, [r['latency_ms_p50'] for r in rs], 'o-', label=f'{mode} p50')
        b.plot(k, [r['latency_ms_p99'] for r in rs], 'x:', color=line.get_color(),
               label=f'{mode} p99')
    a.set(xlabel='robots', ylabel='action Hz, all robots together',
          title='Aggregate action rate')
    b.set(xlabel='robots', ylabel='ms, round start to the robot\'s chunk',
          title='Per-robot chunk latency')
    for ax in (a, b):
        ax.set_xticks(sorted({r['robots'] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    T = sorted({r['T'] for r in rows})
    fig.suptitle(f'oxygen-bench --robots: {args.config} config on {args.device}, T = '
                 f'{", ".join(map(str, T))}')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == '__main__':
    print(json.dumps(child(**json.loads(sys.argv[1]))))
