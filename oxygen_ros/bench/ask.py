"""What a question costs, and what questions in flight do to the action rate.

1. Two ways for a question to enter its request, after the frame's action chunk is out:
   - extension (what the engine does): copy the frame's prefilled row (images + task) to the
     request's row and append the question's tokens in one extension pass;
   - second prefill: encode the images again with the question in the prompt.
   Each is timed as the engine runs it, up to the logits of the answer's first token, next
   to the frame's own prefill and denoising.
2. Frames of the engine (oxygen mode, one narration request per frame as oxygen-bench does)
   with 0, 1 and 4 questions kept in flight: frame time, the time from the frame's start to
   its action chunk, and action Hz = action_horizon x frames/s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..engine import QUESTION_FORMAT, Engine, EngineConfig
from ..model.tokenizer import subtask_prompt
from .workload import PROMPT, _median_ms, bench_model, observations

QUESTIONS = ['is the cup in the gripper?', 'what is left to do?',
             'which object is closest to the gripper?', 'is the drawer open?']


def question_costs(engine: Engine, question: str, repeats: int) -> dict:
    model, kv, dev, tok = engine.model, engine.cache.kv, engine.device, engine.tokenizer
    f = engine.frame(next(observations(engine.model_cfg, 1, 3)))
    shared, row = 0, 1
    ext = tok.encode(QUESTION_FORMAT.replace('{question}', question), bos=False)
    ext_t = torch.tensor(ext, device=dev)
    both, mask = tok.tokenize(subtask_prompt(PROMPT) + QUESTION_FORMAT.replace(
        '{question}', question), engine.model_cfg.max_token_len)
    both = torch.from_numpy(both)[None].to(dev)
    mask = torch.from_numpy(mask)[None].to(dev)
    with torch.inference_mode():
        def prefill():
            return model.prefill(f.images, f.image_mask, f.tokens, f.token_mask, kv,
                                 slice(shared, shared + 1))

        def extension():
            kv.copy_row(shared, row)
            model.logits(model.extend(kv, row, ext_t))

        def second_prefill():
            model.logits(model.prefill(f.images, f.image_mask, both, mask, kv,
                                       slice(row, row + 1)))

        out = dict(prefill_ms=_median_ms(prefill, dev, repeats))
        out['denoise_ms'] = _median_ms(lambda: model.denoise(
            kv, slice(shared, shared + 1), f.noise, engine.denoise_steps), dev, repeats)
        out['copy_row_ms'] = _median_ms(lambda: kv.copy_row(shared, row), dev, repeats)
        out['extension_ms'] = _median_ms(extension, dev, repeats)
        out['second_prefill_ms'] = _median_ms(second_prefill, dev, repeats)
    for r in (shared, row):
        kv.clear(slice(r, r + 1))
    out['question_tokens'] = len(ext)
    return out


def in_flight(engine: Engine, questions: int, frames: int, warmup: int) -> dict:
    """Frames with ``questions`` kept in flight: a new one is asked when one ends."""
    asked = itertools.cycle(QUESTIONS)
    open_ids: set[int] = set()
    frame_ms, actions_ms, q_tokens, n_tokens, born = [], [], 0, 0, 0
    for i, obs in enumerate(observations(engine.model_cfg, warmup + frames, 3)):
        while len(open_ids) < questions:
            open_ids.add(engine.ask(next(asked)))
            born += i >= warmup
        at = []
        t0 = time.perf_counter()
        r = engine.step(obs, narrate=True, on_actions=lambda _, at=at: at.append(
            time.perf_counter()))
        if r.rejected or any(e.cancelled for e in r.events):
            raise RuntimeError('a request was refused or dropped: raise max_requests')
        for e in r.events:
            if e.kind == 'question' and e.done:
                open_ids.discard(e.request_id)
        if i < warmup:
            continue
        frame_ms.append(r.timing['frame_ms'])
        actions_ms.append((at[0] - t0) * 1e3)
        q_tokens += sum(1 for e in r.events if e.kind == 'question')
        n_tokens += len(r.events)
    engine.cancel_all()
    ms, act = np.array(frame_ms), np.array(actions_ms)
    return dict(questions=questions, frames=frames, questions_started=born,
                frame_ms_p50=float(np.percentile(ms, 50)),
                frame_ms_p99=float(np.percentile(ms, 99)),
                actions_ms_p50=float(np.percentile(act, 50)),
                actions_ms_p99=float(np.percentile(act, 99)),
                action_hz=engine.action_horizon * 1000.0 / float(ms.mean()),
                question_tokens_per_s=q_tokens * 1000.0 / float(ms.sum()),
                tokens_per_s=n_tokens * 1000.0 / float(ms.sum()))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog='oxygen-ask-bench', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--config', default='small')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--T', type=int, default=30, help='tokens per request')
    p.add_argument('--k', type=int, default=5, help='decode steps per frame')
    p.add_argument('--frames', type=int, default=20)
    p.add_argument('--warmup', type=int, default=5)
    p.add_argument('--repeats', type=int, default=10)
    p.add_argument('--in-flight', type=int, nargs='+', default=[0, 1, 4])
    p.add_argument('--out', default='benchmarks/out')
    args = p.parse_args(argv)

    model, tok, device = bench_model(args.config, args.device, args.threads)
    # Narration lives T/k frames, so about T/k + 1 narration rows, plus the questions.
    rows = -(-args.T // args.k) + 1 + max(args.in_flight)
    cfg = EngineConfig(model=args.config, device=args.device, decode_k=args.k,
                       max_requests=rows, max_new_tokens=args.T, stop_at_eos=False,
                       prompt_format='subtask', admission='reject_newest',
                       max_question_tokens=48)

    costs = {q: question_costs(Engine(cfg, model=model, tokenizer=tok), q, args.repeats)
             for q in (QUESTIONS[0], ' '.join(['cup'] * 30))}
    print(f'{args.config} on {device}, {torch.get_num_threads()} threads')
    print('| question tokens | prefill ms | denoise ms | copy row ms | extension ms '
          '| second prefill ms |\n|---|---|---|---|---|---|')
    for c in costs.values():
        print(f"| {c['question_tokens']} | {c['prefill_ms']:.1f} | {c['denoise_ms']:.1f} | "
              f"{c['copy_row_ms']:.2f} | {c['extension_ms']:.1f} | "
              f"{c['second_prefill_ms']:.1f} |")
    runs = [in_flight(Engine(cfg, model=model, tokenizer=tok), n, args.frames, args.warmup)
            for n in args.in_flight]
    print('| questions in flight | frame ms p50 | p99 | chunk out ms p50 | p99 | action Hz '
          '| question tokens/s | all tokens/s |\n|---|---|---|---|---|---|---|---|')
    for r in runs:
        print(f"| {r['questions']} | {r['frame_ms_p50']:.1f} | {r['frame_ms_p99']:.1f} | "
              f"{r['actions_ms_p50']:.1f} | {r['actions_ms_p99']:.1f} | {r['action_hz']:.1f} | "
              f"{r['question_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} |")
    report = dict(config=args.config, device=str(device), threads=torch.get_num_threads(),
                  T=args.T, k=args.k, max_requests=rows, question_costs=list(costs.values()),
                  in_flight=runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / 'ask_bench.json').write_text(json.dumps(report, indent=2))
    return report


if __name__ == '__main__':
    main()
