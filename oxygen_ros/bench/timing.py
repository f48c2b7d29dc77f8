"""Median latency of the model phases on this machine.

    python -m oxygen_ros.bench.timing --config small
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..model.config import available, load_config
from ..model.kv import KV
from ..model.pi05 import Pi05


def _median_ms(fn, repeats: int, warmup: int = 3, sync=lambda: None) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def param_table() -> list[str]:
    lines = []
    for name in available():
        cfg = load_config(name)
        with torch.device("meta"):
            counts = Pi05(cfg).param_counts()
        parts = ", ".join(f"{k} {v / 1e6:.3f}M" for k, v in counts.items() if k != "total")
        lines.append(f"{name:>6}: {counts['total'] / 1e6:9.3f}M  ({parts})")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="decode batch to compare with 1")
    ap.add_argument("--valid-tokens", type=int, default=None,
                    help="valid prompt tokens (default: all max_token_len)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(args.config)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = Pi05(cfg).to_inference(dev)

    s, size, n = len(cfg.image_slots), cfg.vision.image_size, cfg.max_token_len
    images = torch.rand(1, s, 3, size, size, device=dev) * 2 - 1
    image_mask = torch.ones(1, s, dtype=torch.bool, device=dev)
    tokens = torch.randint(2, cfg.vocab, (1, n), device=dev)
    valid = n if args.valid_tokens is None else args.valid_tokens
    token_mask = (torch.arange(n, device=dev) < valid)[None]
    rows = max(args.batch, 1)
    room = 4 * (args.repeats + 3) + 8
    kv = KV.allocate(cfg, rows, cfg.prefix_len + room, dev, model.dtype)

    def prefill():
        return model.prefill(images, image_mask, tokens, token_mask, kv, slice(0, 1))

    out = {"prefill (1 frame)": _median_ms(prefill, args.repeats, sync=sync)}
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, device=dev)
    out["denoise, 1 step"] = _median_ms(lambda: model.denoise(kv, slice(0, 1), noise, 1),
                                        args.repeats, sync=sync)
    out["denoise, 10 steps"] = _median_ms(lambda: model.denoise(kv, slice(0, 1), noise, 10),
                                          args.repeats, sync=sync)
    for i in range(1, rows):  # same frame in every row
        for lk, lv in zip(kv.k, kv.v, strict=True):
            lk[i].copy_(lk[0])
            lv[i].copy_(lv[0])
    kv.valid[1:] = kv.valid[0]
    kv.length[1:] = kv.length[0]
    kv.next_pos[1:] = kv.next_pos[0]
    for b in sorted({1, args.batch}):
        r = torch.arange(b, device=dev)
        tok = torch.randint(2, cfg.vocab, (b,), device=dev)
        out[f"decode step, batch {b}"] = _median_ms(lambda r=r, tok=tok:
                                                    model.decode_step(kv, r, tok),
                                                    args.repeats, sync=sync)
    print(f"config {cfg.name}, device {dev}, dtype {model.dtype}, threads "
          f"{torch.get_num_threads()}, {args.repeats} repeats, prompt {valid}/{n} tokens")
    for k, v in out.items():
        print(f"  {k:<22} {v:8.2f} ms")
    print("parameters:")
    for line in param_table():
        print("  " + line)


if __name__ == "__main__":
    main()
