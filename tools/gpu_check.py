"""The GPU check: one run that says whether the CUDA path is right and how fast it is.

    tools/gpu_check.sh            # on a CUDA machine: pi05 in bfloat16, random weights
    tools/gpu_check.sh --cpu      # the same steps on the small config on the CPU

Steps, all offline (random weights, the built-in tokenizer):
1. precision: the small config in bfloat16 against float32 on the device (actions, greedy
   tokens), and the graphs path against the eager one (float32; on CUDA bfloat16 too);
2. frame time of one request (prefill + denoise) for 1, 2 and 3 views, eager vs graphs;
3. oxygen-bench at T = 5, 10, 20, 30 (isolated, shared_kv, oxygen; N = 10, k = 5, and the k
   sweep with adaptive k) with graphs, and eager at T = 30, peak device memory per mode;
4. oxygen-bench --robots 1 2 4 8 at the largest T with graphs: one engine batching K robots
   (fleet) against their frames one after another (sliced) and K engines (separate);
5. energy per frame from the GPU's total-energy counter (NVML, nvidia-ml-py) for isolated,
   oxygen (step 3, T = 30) and the fleet (per robot's frame), where the GPU has one;
6. gpu_check.json and gpu_check.md under benchmarks/<device name>/ (or --out).
Exits 1 when a correctness check fails; the speed goals are reported, not enforced.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.bench import fleet as fleet_bench
from oxygen_ros.bench.energy import Meter
from oxygen_ros.bench.workload import observations
from oxygen_ros.engine import Engine, EngineConfig, random_model
from oxygen_ros.engine.requests import Request
from oxygen_ros.model import Pi05, load_config
from oxygen_ros.model.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
# Random weights put bfloat16 near float32 but not on it: actions within this fraction of
# their largest magnitude; greedy tokens from near-tied random logits may flip.
ACTION_TOL = 0.05
TOKEN_AGREEMENT = 0.5
# The goals for a data-centre GPU.
GOALS = dict(single_3_views_ms=20.0, oxygen_frame_ms=20.0, oxygen_tokens_per_s=1500.0,
             speedup=3.7, memory_overhead=0.15)


def device_name(device: torch.device) -> str:
    if device.type == 'cuda':
        name = torch.cuda.get_device_name(device)
    else:
        name = f'{platform.processor() or platform.machine()}-cpu'
    return re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def engine(model, **kw) -> Engine:
    cfg = dict(mode='shared_kv', max_requests=2, max_new_tokens=8, stop_at_eos=False,
               prompt_format='subtask', device=str(model.device))
    cfg.update(kw)
    return Engine(EngineConfig(**cfg), model=model, tokenizer=Tokenizer.default())


def run_frames(eng: Engine, frames: int, cameras: int = 3):
    """Actions (float64, model space) and greedy token ids of one request per frame; the
    same seeded noise and observations whatever the model's dtype."""
    g = torch.Generator().manual_seed(11)
    shape = (eng.action_horizon, eng.model_action_dim)
    actions, tokens = [], []
    for obs in observations(eng.model_cfg, frames, cameras):
        f = eng.frame(obs, noise=torch.randn(*shape, generator=g).numpy())
        req = Request(stamp=obs.stamp, max_new_tokens=eng.cfg.max_new_tokens,
                      stop_at_eos=False)
        out = eng.scheduler.step_batch(f, [[req]])
        actions.append(out.actions[0].double().cpu().numpy())
        tokens.append([t for r, t, _, _ in out.tokens if r is req])
    return np.stack(actions), tokens


def compare(a, b) -> dict:
    (xa, ta), (xb, tb) = a, b
    scale = float(np.abs(xa).max())
    same = sum(p == q for s, u in zip(ta, tb, strict=True) for p, q in zip(s, u, strict=True))
    total = sum(len(s) for s in ta)
    first = sum(s[0] == u[0] for s, u in zip(ta, tb, strict=True)) / len(ta)
    return dict(action_max_abs=float(np.abs(xa - xb).max()),
                action_rel=float(np.abs(xa - xb).max()) / scale, token_agreement=same / total,
                first_token_agreement=first, tokens_identical=ta == tb)


def precision(device: torch.device, frames: int, config: str) -> dict:
    cfg = load_config(config)
    torch.manual_seed(0)
    m32 = random_model(cfg, device, torch.float32).eval()
    with torch.device(device):
        m16 = Pi05(cfg)
    m16.load_state_dict(m32.state_dict())
    m16.to_inference(device, torch.bfloat16).eval()
    ref = run_frames(engine(m32), frames)
    out = dict(bf16_vs_fp32=compare(ref, run_frames(engine(m16), frames)))
    # Graphs against eager (on CUDA this runs the captures). In float32 they must agree;
    # in bfloat16 masked columns may round differently and flip a near-tied random token.
    oxygen = dict(mode='oxygen', decode_k=3, max_requests=4)
    out['graphs_vs_eager'] = compare(run_frames(engine(m32, **oxygen), frames),
                                     run_frames(engine(m32, graphs=True, **oxygen), frames))
    ok = out['graphs_vs_eager']['action_rel'] <= 1e-4 \
        and out['graphs_vs_eager']['tokens_identical']
    if device.type == 'cuda':
        out['graphs_vs_eager_bf16'] = compare(
            run_frames(engine(m16, **oxygen), frames),
            run_frames(engine(m16, graphs=True, **oxygen), frames))
        ok = ok and out['graphs_vs_eager_bf16']['action_rel'] <= ACTION_TOL
    out['ok'] = bool(ok and out['bf16_vs_fp32']['action_rel'] <= ACTION_TOL
                     and out['bf16_vs_fp32']['token_agreement'] >= TOKEN_AGREEMENT)
    return out


def frame_times(model, frames: int, warmup: int) -> list[dict]:
    """Frame time of one request without narration (prefill + denoise), as the robot sees
    it, and its two phases (timed with a device wait between them: why prefill stays eager
    shows in how little graphs change it against the denoise)."""
    rows = []
    dev = model.device
    for graphs in (False, True):
        eng = engine(model, mode='oxygen', graphs=graphs, phase_timing=True)
        for cameras in (1, 2, 3):
            t = {'frame_ms': [], 'prefill_ms': [], 'denoise_ms': []}
            for i, obs in enumerate(observations(model.cfg, warmup + frames, cameras)):
                r = eng.step(obs)
                if i >= warmup:
                    for key, v in t.items():
                        v.append(r.timing[key])
            rows.append(dict(graphs=graphs, cameras=cameras,
                             frame_ms_p50=float(np.median(t['frame_ms'])),
                             frame_ms_p90=float(np.percentile(t['frame_ms'], 90)),
                             prefill_ms_p50=float(np.median(t['prefill_ms'])),
                             denoise_ms_p50=float(np.median(t['denoise_ms']))))
        del eng
        sync(dev)
    return rows


def bench(config: str, device: torch.device, out: Path, args, graphs: bool, T, sweep: bool):
    cmd = [sys.executable, '-m', 'oxygen_ros.bench.engine', '--config', config,
           '--device', str(device), '--T', *map(str, T), '--modes', 'isolated', 'shared_kv',
           'oxygen', '--N', '10', '--k', '5', '--frames', str(args.frames), '--warmup',
           str(args.warmup), '--repeats', str(args.repeats), '--threads', str(args.threads),
           '--out', str(out), '--no-plot']
    cmd += ['--graphs'] if graphs else []
    cmd += ['--adaptive'] if sweep else []
    print('$ python', ' '.join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((out / 'bench.json').read_text())


def fleet(config: str, device: torch.device, out: Path, args, T: int):
    cmd = [sys.executable, '-m', 'oxygen_ros.bench.engine', '--config', config,
           '--device', str(device), '--robots', *map(str, args.robots), '--T', str(T),
           '--N', '10', '--k', '5', '--frames', str(args.frames), '--warmup',
           str(args.warmup), '--repeats', str(args.repeats), '--threads', str(args.threads),
           '--out', str(out), '--graphs', '--no-plot']
    print('$ python', ' '.join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads((out / 'fleet.json').read_text())


def energy(graphs: dict, fleet_report: dict, T: int) -> list[dict]:
    """mJ per robot's frame: isolated and oxygen (one robot) and the fleet at each K."""
    rows = [dict(what=r['mode'], robots=1, mj=r['energy_mj_per_frame'], watts=r['watts'])
            for r in graphs['results']
            if r['T'] == T and r['mode'] in ('isolated', 'oxygen') and 'energy_mj_per_frame' in r]
    rows += [dict(what='fleet', robots=r['robots'], mj=r['energy_mj_per_robot_frame'],
                  watts=r['watts'])
             for r in fleet_report['rows']
             if r['mode'] == 'fleet' and 'energy_mj_per_robot_frame' in r]
    base = next((r['mj'] for r in rows if r['what'] == 'isolated'), None)
    for r in rows:
        r['vs_isolated'] = 1 - r['mj'] / base if base else None
    return rows


def goals(single: list[dict], rows: list[dict]) -> list[tuple[str, str, bool]]:
    g3 = next(r for r in single if r['graphs'] and r['cameras'] == 3)
    t30 = {r['mode']: r for r in rows if r['T'] == 30}
    oxy, iso = t30['oxygen'], t30['isolated']
    overhead = oxy['memory_mb'] / iso['memory_mb'] - 1
    return [
        ('single request, 3 views', f"{g3['frame_ms_p50']:.1f} ms <= "
         f"{GOALS['single_3_views_ms']:.0f}", g3['frame_ms_p50'] <= GOALS['single_3_views_ms']),
        ('oxygen frame, T=30 k=5', f"{oxy['frame_ms_mean']:.1f} ms <= "
         f"{GOALS['oxygen_frame_ms']:.0f}", oxy['frame_ms_mean'] <= GOALS['oxygen_frame_ms']),
        ('oxygen tokens/s, T=30', f"{oxy['tokens_per_s']:.0f} >= "
         f"{GOALS['oxygen_tokens_per_s']:.0f}",
         oxy['tokens_per_s'] >= GOALS['oxygen_tokens_per_s']),
        ('speedup over isolated, T=30', f"{oxy['speedup']:.2f}x >= {GOALS['speedup']}x",
         oxy['speedup'] >= GOALS['speedup']),
        ('memory overhead over isolated', f"{100 * overhead:.1f}% <= "
         f"{100 * GOALS['memory_overhead']:.0f}%", overhead <= GOALS['memory_overhead']),
    ]


def markdown(report: dict) -> str:
    p = report['precision']
    lines = [f"# GPU check: {report['device_name']}", '',
             f"{report['config']} config, {report['dtype']}, torch {report['torch']}, "
             f"{report['seconds']:.0f} s in all; precision on the "
             f"{report['precision_config']} config.", '',
             '| precision | actions max abs | actions rel | tokens agree | first token | '
             'identical |', '|---|---|---|---|---|---|']
    for key in ('bf16_vs_fp32', 'graphs_vs_eager', 'graphs_vs_eager_bf16'):
        if key not in p:
            continue
        c = p[key]
        lines.append(f"| {key} | {c['action_max_abs']:.2e} | {c['action_rel']:.2e} | "
                     f"{c['token_agreement']:.2f} | {c['first_token_agreement']:.2f} | "
                     f"{c['tokens_identical']} |")
    lines += ['', '| one request (prefill + denoise) | views | frame ms p50 | p90 | '
              'prefill ms | denoise ms |', '|---|---|---|---|---|---|']
    for r in report['single']:
        lines.append(f"| {'graphs' if r['graphs'] else 'eager'} | {r['cameras']} | "
                     f"{r['frame_ms_p50']:.2f} | {r['frame_ms_p90']:.2f} | "
                     f"{r['prefill_ms_p50']:.2f} | {r['denoise_ms_p50']:.2f} |")
    for name in ('bench_graphs', 'bench_eager'):
        b = report[name]
        ph = b['phases']
        lines += ['', f"oxygen-bench, {'graphs' if b.get('graphs') else 'eager'}: prefill "
                  f"{ph['prefill_ms']:.2f} ms, 10 denoise steps {ph['denoise_ms']:.2f} ms, "
                  'decode step ' + ', '.join(f'b={k} {v:.2f} ms'
                                            for k, v in ph['decode_ms'].items()), '',
                  '| mode | T | frame ms mean | p99 | x its phases | action Hz | tokens/s | '
                  'speedup | phase ratio | memory MB | reserved MB |',
                  '|---|---|---|---|---|---|---|---|---|---|---|']
        for r in b['results']:
            ratio = f"{r['phase_ratio']:.2f}x" if 'phase_ratio' in r else ''
            reserved = f"{r['memory_reserved_mb']:.0f}" if 'memory_reserved_mb' in r else ''
            lines.append(f"| {r['mode']} | {r['T']} | {r['frame_ms_mean']:.2f} | "
                         f"{r['frame_ms_p99']:.2f} | {r['frame_ms_mean'] / r['phase_ms']:.3f} | "
                         f"{r['action_hz']:.1f} | {r['tokens_per_s']:.0f} | "
                         f"{r['speedup']:.2f}x | {ratio} | {r['memory_mb']:.0f} | {reserved} |")
        if b.get('k_sweep'):
            lines += ['', f"| k (T={b['k_sweep'][0]['T']}, graphs) | frame ms mean | "
                      'action Hz | tokens/s | over budget |', '|---|---|---|---|---|']
            for r in b['k_sweep']:
                lines.append(f"| {r['k']} | {r['frame_ms_mean']:.2f} | {r['action_hz']:.1f} | "
                             f"{r['tokens_per_s']:.0f} | {r['budget_misses']}/{r['frames']} |")
    f = report['fleet']
    lines += ['', f"oxygen-bench --robots, graphs, T = {f['rows'][0]['T']} (peak MB: CUDA "
              'allocated on a GPU, RSS on a CPU)', '', fleet_bench.table(f['rows'])]
    if report['energy']:
        lines += ['', '| energy per robot frame | robots | mJ | watts | less than isolated |',
                  '|---|---|---|---|---|']
        for r in report['energy']:
            less = f"{100 * r['vs_isolated']:.0f}%" if r['vs_isolated'] is not None else ''
            lines.append(f"| {r['what']} | {r['robots']} | {r['mj']:.1f} | {r['watts']:.0f} "
                         f'| {less} |')
    else:
        lines += ['', f"energy: not measured ({report['energy_why']})"]
    if report.get('goals'):
        lines += ['', '| goal (data-centre GPU) | measured | met |', '|---|---|---|']
        lines += [f'| {name} | {text} | {"yes" if ok else "no"} |'
                  for name, text, ok in report['goals']]
    return '\n'.join(lines) + '\n'


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--cpu', action='store_true', help='the small config on the CPU')
    p.add_argument('--config', default=None, help='model config (default pi05; small with '
                   '--cpu)')
    p.add_argument('--precision-config', default='small', help='config of step 1')
    p.add_argument('--T', type=int, nargs='+', default=[5, 10, 20, 30])
    p.add_argument('--frames', type=int, default=20)
    p.add_argument('--warmup', type=int, default=5)
    p.add_argument('--repeats', type=int, default=10)
    p.add_argument('--threads', type=int, default=2, help='torch threads on the CPU')
    p.add_argument('--robots', type=int, nargs='+', default=[1, 2, 4, 8],
                   help='robots of step 4')
    p.add_argument('--out', default=None, help='default benchmarks/<device name>')
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        p.error('no CUDA device here; --cpu runs the same steps on the CPU')
    device = torch.device('cpu' if args.cpu else 'cuda')
    config = args.config or ('small' if args.cpu else 'pi05')
    torch.set_num_threads(args.threads)
    name = device_name(device)
    out = Path(args.out) if args.out else ROOT / 'benchmarks' / name
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    print(f'1/5 precision ({args.precision_config} config) on {name}', flush=True)
    prec = precision(device, 4, args.precision_config)
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    print(f'2/5 one request, 1-3 views ({config}, {dtype}, eager and graphs)', flush=True)
    torch.manual_seed(0)
    model = random_model(load_config(config), device, dtype).eval()
    single = frame_times(model, args.frames, args.warmup)
    del model
    if device.type == 'cuda':
        torch.cuda.empty_cache()
    print('3/5 oxygen-bench, graphs and eager', flush=True)
    graphs = bench(config, device, out / 'bench-graphs', args, True, args.T, sweep=True)
    eager = bench(config, device, out / 'bench-eager', args, False, [max(args.T)], sweep=False)
    print(f'4/5 oxygen-bench --robots {" ".join(map(str, args.robots))}, graphs', flush=True)
    fleets = fleet(config, device, out / 'fleet', args, max(args.T))
    print('5/5 energy per frame', flush=True)
    report = dict(device_name=name, device=str(device), config=config, dtype=str(dtype),
                  precision_config=args.precision_config,
                  torch=torch.__version__, precision=prec, single=single,
                  bench_graphs=graphs, bench_eager=eager, fleet=fleets,
                  energy=energy(graphs, fleets, max(args.T)), energy_why=Meter(device).why)
    if device.type == 'cuda' and 30 in args.T:
        report['goals'] = goals(single, graphs['results'])
    report['seconds'] = time.perf_counter() - start
    (out / 'gpu_check.json').write_text(json.dumps(report, indent=2))
    md = markdown(report)
    (out / 'gpu_check.md').write_text(md)
    print(md)
    print(f'wrote {out / "gpu_check.json"} and {out / "gpu_check.md"}')
    if not prec['ok']:
        print('FAILED: precision check (see the first table)', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
