#!/usr/bin/env python3
"""Two oxygen-eval runs on the same seeds, paired by seed: each run's success with its 95%
interval, the seeds that succeeded in one run only, and the two-sided exact sign test on
those (are the discordant seeds more one-sided than a fair coin would make them?).

  python tools/paired.py A/ros_report.json B/ros_report.json [--names none oxygen]

A run given as several reports (comma-separated: one run made in blocks of seeds) is their
episodes together.
"""

import argparse
import json
from math import comb
from pathlib import Path


def sign_test(a_only: int, b_only: int) -> float:
    """Two-sided exact binomial test of a_only against b_only at p = 1/2."""
    n, k = a_only + b_only, min(a_only, b_only)
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('a')
    ap.add_argument('b')
    ap.add_argument('--names', nargs=2, default=None)
    args = ap.parse_args()
    names = args.names or [Path(args.a.split(',')[0]).parent.name,
                           Path(args.b.split(',')[0]).parent.name]
    runs = [{e['seed']: e['success'] for p in paths.split(',')
             for e in json.loads(Path(p).read_text())['per_episode']}
            for paths in (args.a, args.b)]
    seeds = sorted(set(runs[0]) & set(runs[1]))
    if len(seeds) != len(runs[0]) or len(seeds) != len(runs[1]):
        print(f'paired on the {len(seeds)} seeds both runs have')
    for name, run in zip(names, runs):
        k = sum(run[s] for s in seeds)
        lo, hi = wilson(k, len(seeds))
        print(f'{name}: {k}/{len(seeds)} ({100 * k / len(seeds):.0f}%, 95% interval '
              f'{100 * lo:.0f}-{100 * hi:.0f}%)')
    a_only = sum(runs[0][s] and not runs[1][s] for s in seeds)
    b_only = sum(runs[1][s] and not runs[0][s] for s in seeds)
    print(f'succeeded only under {names[0]}: {a_only}; only under {names[1]}: {b_only}; '
          f'two-sided sign test p = {sign_test(a_only, b_only):.3f}')


if __name__ == '__main__':
    main()
