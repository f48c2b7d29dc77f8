"""What real-time chunking does to the executed trajectory, and what it costs per frame.

A scripted closed loop in action steps: a frame is observed every ``s`` steps (the
execution horizon) and its chunk is out ``d`` steps later (the inference delay), so the
robot executes steps d .. s + d - 1 of each chunk and switches chunks at step s + d of the
old one. The observed state is the last executed action. At each switch the jump is
|new[d] - old[s + d]|: what the robot is told to do at that step by the new chunk against
the old. Jerk is the third difference of the executed trajectory over the action period
cubed. Random weights are enough to see the effect: without RTC every chunk starts from
fresh noise, so the jump is what two independent samples differ by.

  python -m oxygen_ros.bench.rtc --config small --delays 2 4
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np
import torch

from ..engine import Engine, EngineConfig, Observation
from ..model.rtc import Handover
from .workload import bench_model

PROMPT = 'pick up the red cube and place it in the bowl'


def scene(model_cfg, seed: int = 0):
    """Camera images that change a little from frame to frame, as a real scene does."""
    rng = np.random.default_rng(seed)
    size = model_cfg.vision.image_size
    base = {s: rng.integers(0, 256, (size, size, 3)) for s in model_cfg.image_slots}

    def images():
        return {s: np.clip(b + rng.integers(-8, 9, b.shape), 0, 255).astype(np.uint8)
                for s, b in base.items()}
    return images


def run(engine: Engine, frames: int, warmup: int, s: int, d: int, dims: int,
        period: float) -> dict:
    h = engine.action_horizon
    if not (s > 0 and d >= 0 and s + d < h):
        raise ValueError(f'need s > 0, d >= 0 and s + d < horizon ({h}), got s={s} d={d}')
    images = scene(engine.model_cfg)
    executed, chunk_of = [], []  # [steps, dims]; which chunk each step came from
    jumps, frame_ms = [], []
    old = None
    for k in range(warmup + frames):
        state = executed[-1] if executed else np.zeros(dims)
        obs = Observation(stamp=k * s * period, images=images(), state=state, prompt=PROMPT)
        handover = Handover(start=s, delay=d) if old is not None else None
        r = engine.step(obs, narrate=True, handover=handover)
        new = r.actions[:, :dims]
        if old is None:
            executed += list(new[:d])  # the first chunk runs from its start
            chunk_of += [k] * d
        elif k >= warmup:
            jumps.append(np.abs(new[d] - old[s + d]))
            frame_ms.append(r.timing['frame_ms'])
        executed += list(new[d:s + d])
        chunk_of += [k] * s
        old = new
    engine.cancel_all()
    x = np.array(executed[warmup * s:])
    chunk_of = np.array(chunk_of[warmup * s:])
    jerk = np.abs(np.diff(x, n=3, axis=0)) / period ** 3
    # Jerk over the four steps around a switch, apart from the jerk inside a chunk.
    spans = chunk_of[:-3] != chunk_of[3:]
    jumps = np.array(jumps)
    return dict(rtc=engine.cfg.rtc, delay=d, execution_horizon=s,
                switch_jump_max=float(jumps.max()),
                switch_jump_p95=float(np.percentile(jumps, 95)),
                jerk_p95=float(np.percentile(jerk, 95)),
                switch_jerk_p95=float(np.percentile(jerk[spans], 95)),
                frame_ms_p50=float(np.median(frame_ms)),
                switches=len(jumps), trajectory=x[:, 0].tolist())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog='python -m oxygen_ros.bench.rtc',
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--config', default='small', help='model config name or YAML path')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--delays', type=int, nargs='+', default=[2, 4])
    p.add_argument('--s', type=int, default=4, help='execution horizon: steps per frame')
    p.add_argument('--beta', type=float, default=5.0, help='largest guidance weight')
    p.add_argument('--frames', type=int, default=30)
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--dims', type=int, default=14, help='action dims executed (a robot)')
    p.add_argument('--action-rate', type=float, default=50.0, help='actions per second')
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--out', default='', help='folder (default benchmarks/<config>-<device>)')
    p.add_argument('--plot', action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)

    model, tok, device = bench_model(args.config, args.device, args.threads)
    rows = []
    for d in args.delays:
        for rtc in (False, True):
            cfg = EngineConfig(device=args.device, decode_k=5, max_new_tokens=20,
                               stop_at_eos=False, prompt_format='subtask', rtc=rtc,
                               rtc_beta=args.beta)
            e = Engine(cfg, model=model, tokenizer=tok)
            rows.append(run(e, args.frames, args.warmup, args.s, d, args.dims,
                            1.0 / args.action_rate))
            r = rows[-1]
            print(f"rtc {'on ' if rtc else 'off'} delay {d}: switch jump max "
                  f"{r['switch_jump_max']:.3f} p95 {r['switch_jump_p95']:.3f}, jerk p95 "
                  f"{r['jerk_p95']:.4g} (at switches {r['switch_jerk_p95']:.4g}), frame "
                  f"{r['frame_ms_p50']:.1f} ms p50")
    out = Path(args.out or f"benchmarks/{Path(args.config).stem}-{device.type}")
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(config=args.config, device=str(device), threads=torch.get_num_threads(),
                cpu=platform.processor() or platform.machine(), beta=args.beta,
                action_rate_hz=args.action_rate)
    table = [{k: v for k, v in r.items() if k != 'trajectory'} | meta for r in rows]
    (out / 'rtc.json').write_text(json.dumps(table, indent=2))
    print(f'wrote {out / "rtc.json"}')
    if args.plot:
        plot(rows, out / 'rtc.png', args)
        print(f'wrote {out / "rtc.png"}')
    return 0


def plot(rows, path: Path, args) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    d = args.delays[0]
    for r in rows:
        if r['delay'] == d:
            steps = np.arange(len(r['trajectory'])) / args.action_rate
            a.plot(steps, r['trajectory'], label='RTC' if r['rtc'] else 'no RTC', lw=1.2)
    a.set(xlabel='time (s)', ylabel='action 0 (executed)',
          title=f'Executed trajectory, delay {d} steps, a frame every {args.s}')
    labels = [f"d={r['delay']}\n{'RTC' if r['rtc'] else 'off'}" for r in rows]
    b.bar(labels, [r['switch_jump_p95'] for r in rows],
          color=['tab:blue' if not r['rtc'] else 'tab:orange' for r in rows])
    b.set(ylabel='switch jump p95 (action units)', title='Jump at each chunk switch')
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend()
    fig.suptitle(f'real-time chunking: {args.config} config on {args.device}, random weights')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == '__main__':
    raise SystemExit(main())
