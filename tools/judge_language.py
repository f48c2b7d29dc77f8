"""A checkpoint's narration and yes/no answers on recorded episodes, judged by the scene.

    python tools/judge_language.py CHECKPOINT EVERY EPISODE.hdf5 [...]

At every EVERY-th step of each episode (oxygen-demos' layout; oxygen-eval --direct --record
for a policy's own closed loop) the frame's prefix is built as training builds it (the
engine's tensors, test_train), the narration and the answer to each of the three questions
are decoded greedily, and judged: a narration is right when it names a phase the step's facts
agree with (demos.phases_for, as oxygen-eval judges the ROS path), an answer when it is the
recorded fact. Offline and without timing: what the weights say about states the loop reached.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.engine import QUESTION_FORMAT
from oxygen_ros.model.checkpoint import load_checkpoint
from oxygen_ros.model.kv import KV
from oxygen_ros.model.processing import NormStats
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.robot.profiles import make_profile
from oxygen_ros.sim.demos import ANSWERS, phases_for
from oxygen_ros.sim.train import Batches, Episodes, Recipe

torch.set_num_threads(2)
ck, every, files = sys.argv[1], int(sys.argv[2]), [Path(f) for f in sys.argv[3:]]
RECIPE = Path(__file__).resolve().parents[1] / 'config' / 'train_transfer_cube_language.yaml'
recipe = Recipe.read(RECIPE, frame_every=every)
model, stats, _ = load_checkpoint(ck)
model.pack_head = False
cfg = model.cfg
eps = Episodes(files, recipe, cfg, make_profile('aloha', **recipe.profile_options), progress=False)
tok = Tokenizer(Path(ck) / 'tokenizer.model')  # the one the checkpoint names
bt = Batches(eps, NormStats.from_dict(stats), tok, cfg, recipe)

@torch.no_grad()
def greedy(batch, ctx, n=12):
    b = batch['images'].shape[0]
    kv = KV.allocate(cfg, b, cfg.prefix_len + len(ctx) + n + 1, device='cpu')
    rows = slice(0, b)
    h = model.prefill(batch['images'], batch['image_mask'], batch['tokens'],
                      batch['token_mask'], kv, rows)
    if ctx:
        h = model.extend_rows(kv, rows, torch.tensor([ctx] * b))[:, -1]
    out = []
    for _ in range(n):
        t = model.logits(h).argmax(-1)
        out.append(t)
        h = model.extend_rows(kv, rows, t[:, None])[:, -1]
    seqs = torch.stack(out, 1).tolist()
    texts = []
    for s in seqs:
        s = s[:s.index(tok.eos_id)] if tok.eos_id in s else s
        texts.append(tok.decode(s).strip().lower())
    return texts

qs = {k: tok.encode(QUESTION_FORMAT.replace('{question}', q), bos=False)
      for k, q in eps.questions.items()}
# Room for the longest answer and its end of text ('yes' is 4 pieces of this tokenizer).
answer_len = max(len(tok.encode(a, bos=False)) for a in ANSWERS.values()) + 1
nar_ok = nar_n = ans_ok = ans_n = 0
wrong = {}
per = {}  # (question, true answer) -> (right, asked)
g = torch.Generator().manual_seed(0)
idx_all = np.arange(len(eps))
for s in range(0, len(idx_all), 32):
    idx = idx_all[s:s + 32]
    batch = bt.make(idx, g)
    texts = greedy(batch, [])
    for i, t in zip(idx, texts):
        ok = t in phases_for(eps.answers[i])
        nar_ok += ok
        nar_n += 1
        if not ok:
            wrong[t] = wrong.get(t, 0) + 1
    for k, q in qs.items():
        texts = greedy(batch, q, answer_len)
        for i, t in zip(idx, texts):
            truth = ANSWERS[eps.answers[i][k]]
            ans_ok += t == truth
            ans_n += 1
            right, n = per.get((k, truth), (0, 0))
            per[k, truth] = (right + (t == truth), n + 1)
print(json.dumps({'checkpoint': ck, 'frames': nar_n, 'narration': f'{nar_ok}/{nar_n}',
                  'answers': f'{ans_ok}/{ans_n}',
                  'answers_by_question': {f'{k} {truth}': f'{r}/{n}'
                                          for (k, truth), (r, n) in sorted(per.items())},
                  'wrong': dict(sorted(wrong.items(), key=lambda x: -x[1])[:8])}))
