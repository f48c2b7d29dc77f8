#!/usr/bin/env python3
"""The CPU path before and after, back to back on one machine: oxygen-bench at T = 30 for
each model config, each mode and each runner, in rounds that alternate the revisions, so that
a machine that drifts (they do) drifts for all of them alike. Writes every run's bench.json
under OUT/<config>/<runner>-<round>/ and OUT/README.md with the table of medians over the
rounds: phases, frame p50/p99, the action path's FLOPs and its rate against the 2048^3
product rate measured in the same run.

  python tools/bench_cpu.py --out benchmarks/epyc-2core --before /tmp/before
     [--configs aloha_sim small] [--rounds 2] [--threads 2]

--before: a checkout of the revision to compare with (its oxygen-bench runs eagerly: it
predates the compiled runner); the runners here are `eager` (--no-compile) and `compiled`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAMERAS = {'aloha_sim': 1, 'small': 3}


def bench(tree: Path, config: str, out: Path, args, extra=()) -> dict:
    cfg = tree / 'oxygen_ros' / 'model' / 'configs' / f'{config}.yaml'
    cmd = [sys.executable, '-m', 'oxygen_ros.bench.engine', '--config', str(cfg),
           '--cameras', str(CAMERAS.get(config, 3)), '--T', '30', '--modes', 'oxygen',
           'isolated', '--frames', str(args.frames), '--warmup', '8', '--threads',
           str(args.threads), '--no-plot', '--out', str(out), *extra]
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run(cmd, check=True, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return json.loads((out / 'bench.json').read_text())


def row(reports: list[dict], mode: str) -> dict:
    """Medians over the rounds of one runner's figures for ``mode``."""
    med = statistics.median
    runs = [next(r for r in rep['results'] if r['mode'] == mode) for rep in reports]
    out = dict(frame_p50=med(r['frame_ms_p50'] for r in runs),
               frame_lo=min(r['frame_ms_p50'] for r in runs),
               frame_hi=max(r['frame_ms_p50'] for r in runs),
               frame_p99=med(r['frame_ms_p99'] for r in runs),
               prefill=med(rep['phases']['prefill_ms'] for rep in reports),
               denoise=med(rep['phases']['denoise_ms'] for rep in reports),
               decode1=med(rep['phases']['decode_ms']['1'] if '1' in rep['phases']['decode_ms']
                           else rep['phases']['decode_ms'][1] for rep in reports))
    arith = [rep.get('arithmetic') for rep in reports if rep.get('arithmetic')]
    if arith:
        out['mflop'] = arith[0]['flops']['action_path'] / 1e6
        out['gflops'] = med(a['action_path_gflops'] for a in arith)
        out['of_gemm'] = med(a['of_gemm'] for a in arith)
        out['gemm'] = med(g for a in arith for g in a['gemm_gflops'])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--out', required=True)
    ap.add_argument('--before', required=True, help='a checkout of the revision before')
    ap.add_argument('--configs', nargs='+', default=['aloha_sim', 'small'])
    ap.add_argument('--rounds', type=int, default=2)
    ap.add_argument('--threads', type=int, default=2)
    ap.add_argument('--frames', type=int, default=30)
    args = ap.parse_args()
    out, before = Path(args.out).resolve(), Path(args.before).resolve()
    runners = {'before': (before, ()), 'eager': (ROOT, ('--no-compile',)),
               'compiled': (ROOT, ('--compile',))}
    reports = {(c, r): [] for c in args.configs for r in runners}
    for k in range(args.rounds):
        # Alternate the order too: the first of a round is not always the same runner.
        order = list(runners) if k % 2 == 0 else list(runners)[::-1]
        for config in args.configs:
            for name in order:
                tree, extra = runners[name]
                dest = out / config / f'{name}-{k}'
                print(f'round {k}: {config} {name}', flush=True)
                reports[config, name].append(bench(tree, config, dest, args, extra))
    lines = ['# The CPU path, before and after', '',
             f'`python tools/bench_cpu.py --out {args.out} --before <checkout> --configs '
             f'{" ".join(args.configs)} --rounds {args.rounds} --threads {args.threads}`: '
             f'oxygen-bench at T = 30 (N = 10, k = 5), random weights, {args.threads} torch '
             f'threads, medians of {args.rounds} rounds run alternately. `before`: the '
             f'revision in --before, eager; `eager` and `compiled`: this one. FLOPs: torch\'s '
             f'counter on the action path (prefill + 10 denoise steps); its rate against a '
             f'2048^3 float32 product timed before and after each run.', '',
             '| config | runner | mode | prefill ms | denoise ms | decode step b=1 ms | '
             'frame p50 ms (rounds\' range) | frame p99 ms | action path GFLOP/s | '
             'of the product rate |',
             '|---|---|---|---|---|---|---|---|---|---|']
    for config in args.configs:
        for name in runners:
            for mode in ('oxygen', 'isolated'):
                r = row(reports[config, name], mode)
                rate = (f"{r['gflops']:.1f} | {r['of_gemm']:.2f}" if 'gflops' in r
                        else '- | -')
                lines.append(f"| {config} | {name} | {mode} | {r['prefill']:.1f} | "
                             f"{r['denoise']:.1f} | {r['decode1']:.2f} | {r['frame_p50']:.1f} "
                             f"({r['frame_lo']:.1f}-{r['frame_hi']:.1f}) | "
                             f"{r['frame_p99']:.1f} | {rate} |")
    for config in args.configs:
        r = row(reports[config, 'compiled'], 'oxygen')
        if 'mflop' in r:
            lines.append(f"\n{config}: action path {r['mflop']:.0f} MFLOP; the product rate "
                         f"{r['gemm']:.0f} GFLOP/s (median of the runs).")
    (out / 'README.md').write_text('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
