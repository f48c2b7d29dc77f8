#!/usr/bin/env python3
"""How long a thread that wants the GIL every millisecond waits while the engine runs
frames, compiled against eager, alternately (a control thread is such a thread).

    python tools/gil_wait.py --config small --cameras 3

Random weights, 2 torch threads, oxygen frames narrating; prints each run's frame time and
the sleeper's gaps (p50, p99, max, how many over 10 ms).
"""
import argparse
import threading
import time

import numpy as np

from oxygen_ros.bench.workload import bench_model, observations
from oxygen_ros.engine import Engine, EngineConfig


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--config', default='small')
    ap.add_argument('--cameras', type=int, default=3)
    ap.add_argument('--frames', type=int, default=40)
    ap.add_argument('--rounds', type=int, default=2)
    args = ap.parse_args()
    model, tok, _ = bench_model(args.config, 'cpu', 2)
    for compiled in (True, False) * args.rounds:
        e = Engine(EngineConfig(mode='oxygen', compile=compiled, max_new_tokens=30,
                                stop_at_eos=False, prompt_format='subtask', max_requests=8),
                   model=model, tokenizer=tok)
        obs = observations(e.model_cfg, args.frames, args.cameras)
        first = next(obs)
        for _ in range(3):  # warm-up
            e.step(first, narrate=True)
        gaps, stop = [], threading.Event()

        def sleeper(gaps=gaps, stop=stop):
            last = time.perf_counter()
            while not stop.is_set():
                time.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        t = threading.Thread(target=sleeper)
        t.start()
        start, n = time.perf_counter(), 0
        for o in obs:
            e.step(o, narrate=True)
            n += 1
        frame = (time.perf_counter() - start) / n
        stop.set()
        t.join()
        g = np.array(gaps) * 1e3
        print(f'{"compiled" if compiled else "eager"}: frame {frame * 1e3:.1f} ms; 1 ms '
              f'sleeper gaps p50 {np.percentile(g, 50):.2f} p99 {np.percentile(g, 99):.2f} '
              f'max {g.max():.2f} ms, {int((g > 10).sum())} of {len(g)} over 10 ms', flush=True)


if __name__ == '__main__':
    main()
