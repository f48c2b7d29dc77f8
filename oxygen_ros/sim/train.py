"""oxygen-train: a pi0.5 trained on scripted ALOHA demonstrations (oxygen-demos), here.

    oxygen-train --data DIR --out DIR [--recipe config/train_transfer_cube.yaml]
                 [--steps N] [--resume] [--threads 2]

The model is the project's own Pi05, trained through the code inference runs: prefill
writes the observation's prefix into KV rows, Pi05.velocity (what each denoise step
computes) reads them for the flow-matching loss, and Pi05.extend_rows appends text after
them for the language loss, teacher-forced. Nothing here is a second model.

Flow matching as openpi and LeRobot train pi0.5: noise ~ N(0, I), t = Beta(1.5, 1) * 0.999 +
0.001, x_t = t * noise + (1 - t) * actions, the target velocity noise - actions, MSE.
Language from the same prefix: the narration target is the script's phase at that step
("reaching for the cube", ...) followed by EOS, as the engine decodes a narration right after
the prefix; a yes/no question about the scene ("Is the cube in the left gripper?", answered
from the simulator's contacts) is appended in the engine's question format and its answer
and EOS are the target. Cross-entropy over the target tokens, weighted by `text_weight`.
A recipe with `train: language` trains the text alone on the readout alone
(Pi05.readout_parameters), from --init-from's policy and its norm stats: its actions stay
bit for bit what they were (the export checks it).

Inputs are built with the functions the engine uses (resize_with_pad, to_model_image, the
ALOHA profile, NormStats, action_prompt, the tokenizer), from the demonstrations' top
camera, joint positions and actions in the units the robot reports and takes (the profile's
encode_actions turns targets into model actions). Norm stats are openpi's QUANTILES, computed
on the training episodes.

Writes into --out:
  checkpoint/          the policy in openpi's layout: model.safetensors, config.json,
                       assets/<asset_id>/norm_stats.json, tokenizer.model (so it loads with
                       checkpoint:= and never falls back to another tokenizer)
  state.safetensors    everything to resume: weights, their moving average, AdamW's moments,
                       the sampler's generator (tensors only: no pickle)
  log.jsonl            one line per logged step: losses, learning rate, seconds
  loss.png             training and validation losses
Seeded: the same data, recipe and seed give the same run; --resume continues one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

from oxygen_ros.engine import QUESTION_FORMAT
from oxygen_ros.model import Pi05
from oxygen_ros.model.checkpoint import save_checkpoint
from oxygen_ros.model.config import ModelConfig, load_config
from oxygen_ros.model.kv import KV
from oxygen_ros.model.processing import NormStats, crop, resize_with_pad, to_model_image
from oxygen_ros.model.tokenizer import Tokenizer, action_prompt
from oxygen_ros.robot.aloha import finger_from_normalized
from oxygen_ros.robot.profiles import GRIPPER_JOINT_CLOSE, GRIPPER_JOINT_OPEN, make_profile
from oxygen_ros.robot.share import config_dir
from oxygen_ros.sim.demos import ANSWERS

RECIPE = 'train_transfer_cube.yaml'  # in the package's config directory


@dataclass
class Recipe:
    model: dict  # a model config: a name or a path under 'config', overrides beside it
    cameras: dict  # HDF5 camera -> model image slot
    profile_options: dict  # the ALOHA profile's, as the robot file gives them
    frame_every: int = 2  # observations at every k-th step
    batch: int = 32
    steps: int = 4000
    lr: float = 5e-4
    min_lr: float = 5e-5
    warmup: int = 300
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    ema: float = 0.999
    text_weight: float = 0.2
    narrate_share: float = 0.5  # of the text targets, the rest are questions
    # A share of each batch drawn from the first `early_steps` steps of the episodes only:
    # the reach is decided there, from frames that differ only in where the cube is, and
    # drawn evenly they are a few in a hundred of what training sees.
    early_share: float = 0.0
    early_steps: int = 0
    val_episodes: int = 5  # the last episode files, held out
    log_every: int = 50
    val_every: int = 500
    save_every: int = 500
    seed: int = 0
    asset_id: str = 'aloha_sim'
    # 'all', or 'language': the text loss alone, on the readout alone
    # (Pi05.readout_parameters), from a trained policy (--init-from) and its norm stats: the
    # narration and answers learn, every action stays what it was.
    train: str = 'all'

    @classmethod
    def read(cls, path: Path, **over) -> Recipe:
        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f'{path}: a recipe is a mapping')
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f'{path}: unknown recipe keys {sorted(unknown)}')
        data.update({k: v for k, v in over.items() if v is not None})
        recipe = cls(**data)
        if recipe.train not in ('all', 'language'):
            raise ValueError(f"{path}: train is 'all' or 'language', got {recipe.train!r}")
        # A run stops and resumes where it saved: there the losses since the last log line
        # must have been logged, or the resumed log would differ from an uninterrupted one.
        if recipe.save_every % recipe.log_every or recipe.val_every % recipe.log_every:
            raise ValueError(f'{path}: save_every and val_every must be multiples of '
                             f'log_every ({recipe.log_every})')
        if not 0.0 <= recipe.early_share < 1.0 or (recipe.early_share > 0) != (
                recipe.early_steps > 0):
            raise ValueError(f'{path}: early_share must be in [0, 1) and given together with '
                             f'early_steps > 0, got {recipe.early_share} and '
                             f'{recipe.early_steps}')
        return recipe

    def model_config(self) -> ModelConfig:
        spec = dict(self.model)
        base = spec.pop('config')
        return load_config(base, **spec)


def gripper_angle(normalized):
    """ALOHA's normalised gripper command -> the servo angle (rad) the robot file commands:
    the inverse of aloha_sim.normalized_from_gripper."""
    return GRIPPER_JOINT_CLOSE + np.asarray(normalized, float) * (
        GRIPPER_JOINT_OPEN - GRIPPER_JOINT_CLOSE)


def robot_state(qpos: np.ndarray) -> np.ndarray:
    """ACT's qpos (gripper normalised) -> what the robot's JointStates give the profile
    (AlohaSim.state: the gripper as left_finger travel in metres)."""
    s = np.array(qpos, dtype=np.float64)
    s[:, [6, 13]] = finger_from_normalized(s[:, [6, 13]])
    return s


def robot_targets(action: np.ndarray) -> np.ndarray:
    """ACT's action (gripper normalised) -> the targets the node publishes (rad)."""
    a = np.array(action, dtype=np.float64)
    a[:, [6, 13]] = gripper_angle(a[:, [6, 13]])
    return a


class Episodes:
    """Demonstrations in memory, as the model takes them: images at the model's size
    (uint8, resized with padding), model-space states and action chunks, language."""

    def __init__(self, files: list[Path], recipe: Recipe, cfg: ModelConfig, profile,
                 progress: bool = True):
        import h5py

        self.files = files
        size = cfg.vision.image_size
        horizon = cfg.action_horizon
        self.slots = [recipe.cameras[c] for c in recipe.cameras]
        images, states, chunks, phases, answers, index = [], [], [], [], [], []
        it = files
        if progress:
            from tqdm import tqdm
            it = tqdm(files, desc='reading episodes', unit='ep', file=sys.stderr)
        self.prompt = None
        self.seeds: list[int] = []  # each episode's (oxygen-demos' seed)
        self.questions: dict[str, str] = {}
        for e, path in enumerate(it):
            with h5py.File(path, 'r') as f:
                self.seeds.append(int(f.attrs['seed']))
                prompt = str(f.attrs['prompt'])
                if self.prompt not in (None, prompt):
                    raise ValueError(f'{path}: prompt {prompt!r}, not {self.prompt!r}')
                self.prompt = prompt
                qpos = f['observations/qpos'][()]
                action = f['action'][()]
                t_all = np.arange(0, len(action), recipe.frame_every)
                cams = {}
                for cam in recipe.cameras:
                    key = f'observations/images/{cam}'
                    if key not in f:
                        raise ValueError(f'{path} has no camera {cam!r} (it has '
                                         f'{sorted(f["observations/images"])})')
                    box = cfg.crop_of(recipe.cameras[cam])
                    cams[cam] = np.stack([resize_with_pad(crop(f[key][t], box), size, size)
                                          for t in t_all])
                phase = [p.decode() if isinstance(p, bytes) else str(p)
                         for p in f['language/phase'][()]]
                ans = {}
                for k, ds in f['language'].items():
                    if k == 'phase':
                        continue
                    self.questions[k] = str(ds.attrs['question'])
                    ans[k] = ds[()].astype(bool)
            state = robot_state(qpos)
            targets = robot_targets(action)
            for i, t in enumerate(t_all):
                # Past the episode's end the chunk repeats its last target (the arm holds).
                rows = np.minimum(np.arange(t, t + horizon), len(targets) - 1)
                states.append(profile.encode_state(state[t]))
                chunks.append(profile.encode_actions(targets[rows], state[t]))
                phases.append(phase[t])
                answers.append({k: bool(v[t]) for k, v in ans.items()})
                index.append((e, int(t)))
                images.append(np.stack([cams[c][i] for c in recipe.cameras]))
        self.images = np.stack(images)  # [N, slots, S, S, 3] uint8
        self.states = np.stack(states)  # [N, 14] encoded (model space, not normalised)
        self.chunks = np.stack(chunks)  # [N, H, 14] model actions, not normalised
        self.phases = phases
        self.answers = answers
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def norm_stats(self) -> dict:
        """openpi's norm_stats.json content for these states and actions."""
        def stats(x):
            x = x.reshape(-1, x.shape[-1])
            return {'mean': x.mean(0).tolist(), 'std': x.std(0).tolist(),
                    'q01': np.quantile(x, 0.01, axis=0).tolist(),
                    'q99': np.quantile(x, 0.99, axis=0).tolist()}
        return {'state': stats(self.states), 'actions': stats(self.chunks)}


class Batches:
    """Tensors of sampled batches: exactly what Engine.frame builds for an observation."""

    def __init__(self, data: Episodes, norm: NormStats, tokenizer: Tokenizer,
                 cfg: ModelConfig, recipe: Recipe):
        self.data, self.norm, self.tok, self.cfg, self.recipe = data, norm, tokenizer, cfg, recipe
        self.states = norm.normalize_state(data.states).astype(np.float32)
        self.actions = norm.normalize_actions(data.chunks).astype(np.float32)
        self._narration = {p: tokenizer.encode(p, bos=False) + [tokenizer.eos_id]
                           for p in set(data.phases)}
        self._questions = {k: tokenizer.encode(QUESTION_FORMAT.replace('{question}', q),
                                               bos=False)
                           for k, q in data.questions.items()}
        self._answers = {v: tokenizer.encode(a, bos=False) + [tokenizer.eos_id]
                         for v, a in ANSWERS.items()}
        self.keys = sorted(data.questions)

    def make(self, idx: np.ndarray, g: torch.Generator) -> dict:
        cfg, d = self.cfg, self.data
        b = len(idx)
        images = torch.stack([torch.stack([to_model_image(im) for im in d.images[i]])
                              for i in idx])
        tokens, masks = zip(*(self.tok.tokenize(action_prompt(d.prompt, self.states[i]),
                                                cfg.max_token_len) for i in idx))
        # The text after the prefix: the narration, or a question and its answer.
        texts, starts = [], []
        pick = torch.rand(b, generator=g).numpy()
        which = torch.randint(len(self.keys), (b,), generator=g).numpy()
        for j, i in enumerate(idx):
            if pick[j] < self.recipe.narrate_share or not self.keys:
                ctx, target = [], self._narration[d.phases[i]]
            else:
                k = self.keys[which[j]]
                ctx, target = self._questions[k], self._answers[d.answers[i][k]]
            texts.append(ctx + target)
            starts.append(len(ctx))
        n = max(len(t) for t in texts)
        seq = torch.zeros(b, n, dtype=torch.long)
        loss_mask = torch.zeros(b, n, dtype=torch.bool)
        for j, (t, s) in enumerate(zip(texts, starts, strict=True)):
            seq[j, :len(t)] = torch.tensor(t)
            loss_mask[j, s:len(t)] = True
        return dict(images=images, image_mask=torch.ones(b, images.shape[1], dtype=torch.bool),
                    tokens=torch.from_numpy(np.stack(tokens)),
                    token_mask=torch.from_numpy(np.stack(masks)),
                    actions=torch.from_numpy(self.actions[idx]), text=seq, text_mask=loss_mask)


def init_weights(model: Pi05) -> None:
    """A start for training from scratch. PyTorch's N(0, 1) embedding, scaled by sqrt(width)
    on the way in (as Gemma's) and read back as the tied LM head, would make the text
    tokens ~11 times the size of everything else in the residual stream and the first
    logits ~11 wide (a cross-entropy of 100 at the start): N(0, 1/width) keeps both near one.
    The rest keeps PyTorch's defaults, and the norms their zero (a scale of one)."""
    with torch.no_grad():
        model.embed.weight.normal_(0.0, model.cfg.vlm.width ** -0.5)


def flow_time(b: int, g: torch.Generator) -> torch.Tensor:
    """openpi's and LeRobot's training times: Beta(1.5, 1) * 0.999 + 0.001. Beta(a, 1) is
    U ** (1 / a), drawn from the generator so that a run is reproducible."""
    return torch.rand(b, generator=g).pow(1.0 / 1.5) * 0.999 + 0.001


def losses(model: Pi05, batch: dict, noise: torch.Tensor, t: torch.Tensor,
           flow: bool = True) -> dict:
    """Flow-matching MSE and text cross-entropy of one batch, through prefill, velocity and
    extend_rows on one KV store sized for it (flow=False: the text's alone)."""
    cfg = model.cfg
    b = batch['actions'].shape[0]
    n = batch['text'].shape[1]
    kv = KV.allocate(cfg, b, cfg.prefix_len + n, device=model.device)
    rows = slice(0, b)
    h = model.prefill(batch['images'], batch['image_mask'], batch['tokens'],
                      batch['token_mask'], kv, rows)
    out = {}
    if flow:
        actions = batch['actions']
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
        v = model.velocity(kv, rows, x_t, t)
        out['flow'] = F.mse_loss(v, noise - actions)
    # Text: the prefix's last hidden state predicts the first token after it; each appended
    # token's, the next. The velocity above has read the prefix already: the text goes into
    # a copy, so that nothing it read changes under autograd.
    text = KV([k.clone() for k in kv.k], [v_.clone() for v_ in kv.v], kv.valid.clone(),
              kv.length.clone(), kv.next_pos.clone())
    hidden = [h[:, None]]
    if n > 1:
        hidden.append(model.extend_rows(text, rows, batch['text'][:, :-1]))
    logits = model.logits(torch.cat(hidden, 1).reshape(b * n, -1))
    mask = batch['text_mask'].reshape(-1)
    out['text'] = F.cross_entropy(logits[mask], batch['text'].reshape(-1)[mask])
    return out


class Trainer:
    def __init__(self, recipe: Recipe, data_dir: Path, out: Path, threads: int = 2,
                 progress: bool = True):
        torch.set_num_threads(threads)
        self.recipe, self.out, self.progress = recipe, out, progress
        self.cfg = recipe.model_config()
        # One directory or several (oxygen-demos runs with other seeds), in the order given;
        # the last directory's last episodes are the held-out ones.
        dirs = [Path(d) for d in (data_dir if isinstance(data_dir, (list, tuple))
                                  else [data_dir])]
        files = [f for d in dirs for f in sorted(d.glob('episode_*.hdf5'),
                                                 key=lambda p: int(p.stem.split('_')[1]))]
        if len(files) <= recipe.val_episodes:
            raise ValueError(f'{", ".join(map(str, dirs))}: {len(files)} episodes; the recipe '
                             f'holds out {recipe.val_episodes} for validation')
        self.profile = make_profile('aloha', **recipe.profile_options)
        train_files, val_files = files[:-recipe.val_episodes], files[-recipe.val_episodes:]
        self.tokenizer = Tokenizer.default()
        if self.tokenizer.vocab_size != self.cfg.vocab:
            raise ValueError(f'the model has a {self.cfg.vocab}-entry vocabulary, the built-in '
                             f'tokenizer {self.tokenizer.vocab_size}')
        self.train = Episodes(train_files, recipe, self.cfg, self.profile, progress)
        self.val = Episodes(val_files, recipe, self.cfg, self.profile, progress)
        if list(self.cfg.image_slots) != self.train.slots:
            raise ValueError(f'the recipe maps cameras to {self.train.slots}, the model has '
                             f'slots {list(self.cfg.image_slots)}')
        self._use_stats(self.train.norm_stats())
        self.early = np.array([i for i, (_, t) in enumerate(self.train.index)
                               if t < recipe.early_steps], dtype=np.int64)
        if recipe.early_share and not len(self.early):
            raise ValueError(f'early_steps {recipe.early_steps}: no observation that early '
                             f'(one every {recipe.frame_every} steps)')
        torch.manual_seed(recipe.seed)
        self.model = Pi05(self.cfg)
        init_weights(self.model)
        self.model.pack_head = False  # the packed CPU head is for inference, not autograd
        self.ema = {k: p.detach().clone() for k, p in self.model.named_parameters()}
        # The language stage: the readout's entries train, the rest keeps the weights the
        # run started from (self.kept, taken when they are loaded).
        self.readout = self.model.readout_parameters() if recipe.train == 'language' else None
        self.kept: dict[str, torch.Tensor] | None = None
        self.trained = {k: p for k, p in self.model.named_parameters()
                        if self.readout is None or k in self.readout}
        for k, p in self.model.named_parameters():
            p.requires_grad_(k in self.trained)
        # A partly trained tensor takes no weight decay: its other entries get no gradient
        # and must not shrink either.
        partial = {k for k, m in (self.readout or {}).items() if m is not None}
        decay = [p for n, p in self.trained.items() if p.ndim >= 2 and n not in partial]
        plain = [p for n, p in self.trained.items() if p.ndim < 2 or n in partial]
        self.opt = torch.optim.AdamW([{'params': decay, 'weight_decay': recipe.weight_decay},
                                      {'params': plain, 'weight_decay': 0.0}],
                                     lr=recipe.lr, betas=(0.9, 0.95))
        self.g = torch.Generator().manual_seed(recipe.seed)
        self.step = 0
        self.log: list[dict] = []
        self.init: dict | None = None  # the checkpoint a fine-tuning run started from
        # Where --start-from went on from an export: [{step, the schedule's steps then}].
        self.went_on: list[dict] = []

    def _use_stats(self, stats: dict) -> None:
        """The norm stats the inputs are made with (and the export carries)."""
        self.stats = stats
        norm = NormStats.from_dict(stats)
        self.batches = Batches(self.train, norm, self.tokenizer, self.cfg, self.recipe)
        self.val_batches = Batches(self.val, norm, self.tokenizer, self.cfg, self.recipe)

    def _keep(self, stats: dict | None, where: str) -> None:
        """The language stage starts from a trained policy: what it must not change (its
        weights outside the readout, its norm stats) is taken here."""
        if self.readout is None:
            return
        if not stats:
            raise ValueError(f'{where} has no norm stats: the language stage keeps a trained '
                             f"policy's")
        self._use_stats(stats)
        self.kept = {k: p.detach().clone() for k, p in self.model.named_parameters()}

    def _restore_kept(self) -> None:
        """Entries outside the readout back to the kept weights, in the model and its average
        (they get no gradient and no decay; this makes sure of it)."""
        with torch.no_grad():
            for k, mask in self.readout.items():
                if mask is not None:
                    self.trained[k][~mask] = self.kept[k][~mask]
                    self.ema[k][~mask] = self.kept[k][~mask]

    def changed_outside_readout(self, weights: dict[str, torch.Tensor]) -> list[str]:
        """The tensors of `weights` that differ from the kept ones outside the readout."""
        bad = []
        for k, kept in self.kept.items():
            mask = self.readout.get(k, False)
            if mask is None:  # readout through and through
                continue
            same = (weights[k].detach().to(kept.dtype) == kept) | mask
            if not bool(same.all()):
                bad.append(k)
        return bad

    # -- schedule ---------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        r = self.recipe
        if step < r.warmup:
            return r.lr * (step + 1) / r.warmup
        frac = min(1.0, (step - r.warmup) / max(1, r.steps - r.warmup))
        return r.min_lr + 0.5 * (r.lr - r.min_lr) * (1 + math.cos(math.pi * frac))

    # -- one step ---------------------------------------------------------------------------
    def train_step(self) -> dict:
        r, model = self.recipe, self.model
        model.train()
        idx = torch.randint(len(self.train), (r.batch,), generator=self.g).numpy()
        n = round(r.batch * r.early_share)
        if n:  # drawn only when asked, so that recipes without it train as they always did
            idx[:n] = self.early[torch.randint(len(self.early), (n,), generator=self.g).numpy()]
        batch = self.batches.make(idx, self.g)
        noise = torch.randn(batch['actions'].shape, generator=self.g)
        t = flow_time(r.batch, self.g)
        language = self.readout is not None
        out = losses(model, batch, noise, t, flow=not language)
        loss = out['text'] if language else out['flow'] + r.text_weight * out['text']
        for group in self.opt.param_groups:
            group['lr'] = self.lr_at(self.step)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(list(self.trained.values()), r.grad_clip)
        self.opt.step()
        with torch.no_grad():
            for k, p in self.trained.items():
                self.ema[k].lerp_(p.detach(), 1.0 - r.ema)
        if language:
            self._restore_kept()
        self.step += 1
        return {**{k: v.item() for k, v in out.items()}, 'grad': float(grad)}

    @torch.no_grad()
    def validate(self, n: int = 256, batch: int = 32) -> dict:
        """Losses on held-out episodes with the moving-average weights, at fixed samples,
        noise and times (the same every time), so that the curve compares."""
        g = torch.Generator().manual_seed(12345)
        idx = torch.randint(len(self.val), (n,), generator=g).numpy()
        model = self._ema_model()
        flow = text = 0.0
        for s in range(0, n, batch):
            part = idx[s:s + batch]
            b = self.val_batches.make(part, g)
            noise = torch.randn(b['actions'].shape, generator=g)
            t = flow_time(len(part), g)
            out = losses(model, b, noise, t)
            flow += float(out['flow']) * len(part)
            text += float(out['text']) * len(part)
        return dict(val_flow=flow / n, val_text=text / n)

    def _ema_model(self) -> Pi05:
        m = Pi05(self.cfg)
        m.load_state_dict(self.ema, strict=True)
        m.pack_head = False
        return m.eval().requires_grad_(False)

    # -- files ------------------------------------------------------------------------------
    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tensors = {f'model.{k}': p.detach().contiguous() for k, p in
                   self.model.named_parameters()}
        tensors.update({f'ema.{k}': v.contiguous() for k, v in self.ema.items()})
        names = {id(p): k for k, p in self.model.named_parameters()}
        for p, s in self.opt.state.items():
            for key in ('exp_avg', 'exp_avg_sq'):
                tensors[f'opt.{names[id(p)]}.{key}'] = s[key].contiguous()
            tensors[f'opt.{names[id(p)]}.step'] = torch.as_tensor(s['step']).reshape(1).float()
        tensors['generator'] = self.g.get_state()
        tmp = self.out / 'state.safetensors.part'
        save_file(tensors, str(tmp), metadata={'step': str(self.step)})
        tmp.replace(self.out / 'state.safetensors')
        (self.out / 'state.json').write_text(json.dumps(
            {'step': self.step, 'recipe': self.recipe.__dict__, 'init_from': self.init,
             'went_on_from': self.went_on, 'norm_stats': self.stats,
             'train_files': [f'{p.parent.name}/{p.name}' for p in self.train.files],
             'val_files': [f'{p.parent.name}/{p.name}' for p in self.val.files]}, indent=1))
        self.export(self.out / 'checkpoint')

    def resume(self) -> bool:
        path = self.out / 'state.safetensors'
        if not path.is_file():
            return False
        saved = json.loads((self.out / 'state.json').read_text())
        if saved['recipe'] != self.recipe.__dict__:
            raise ValueError(f'{path} was trained with another recipe: '
                             f'{saved["recipe"]} (now {self.recipe.__dict__})')
        self.init = saved.get('init_from')
        self.went_on = saved.get('went_on_from', [])
        t = load_file(str(path))
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(t[f'model.{k}'])
                self.ema[k].copy_(t[f'ema.{k}'])
        for k, p in params.items():
            if f'opt.{k}.exp_avg' in t:
                self.opt.state[p] = {'step': torch.tensor(float(t[f'opt.{k}.step'][0])),
                                     'exp_avg': t[f'opt.{k}.exp_avg'].clone(),
                                     'exp_avg_sq': t[f'opt.{k}.exp_avg_sq'].clone()}
        self.g.set_state(t['generator'])
        self.step = saved['step']
        self._keep(saved.get('norm_stats'), str(path))
        log = self.out / 'log.jsonl'
        if log.is_file():
            self.log = [json.loads(line) for line in log.read_text().splitlines() if line]
            self.log = [e for e in self.log if e['step'] <= self.step]
            log.write_text(''.join(json.dumps(e) + '\n' for e in self.log))
        return True

    def _take_weights(self, model: Pi05) -> None:
        """A loaded model's weights become this run's, and their average."""
        weights = dict(model.named_parameters())
        with torch.no_grad():
            for k, p in self.model.named_parameters():
                p.copy_(weights[k])
                self.ema[k].copy_(weights[k])

    def init_from(self, checkpoint: Path) -> None:
        """Fine-tune: the weights and their average start from an exported checkpoint of the
        same model dims (trained on other inputs, say the whole camera image instead of a
        crop); the step, the schedule and AdamW start afresh."""
        from oxygen_ros.model.checkpoint import load_checkpoint

        path = Path(checkpoint)
        meta = json.loads((path / 'config.json').read_text()) if (
            path / 'config.json').is_file() else {}
        crops = (meta.get('oxygen') or {}).get('image_crops') or {}
        model, stats, _ = load_checkpoint(path, self.cfg.replace(image_crops=crops))
        self._take_weights(model)
        self._keep(stats, str(path))
        trained = meta.get('training') or {}
        self.init = {'checkpoint': path.name, 'step': trained.get('step'),
                     'recipe': trained.get('recipe'),
                     'image_crops': crops,
                     # Seeds its weights have seen: no evaluation may call them held out.
                     'seeds': sorted({*trained.get('seeds', []),
                                      *((trained.get('init_from') or {}).get('seeds') or [])})}

    def start_from(self, checkpoint: Path) -> None:
        """Go on from an exported checkpoint (the one kept in the repository, say) instead of
        state.safetensors: its weights become the model and the average, its step the
        schedule's; AdamW's moments start afresh and the sampler is seeded anew from the
        step, so the run is not the one that was interrupted, only its continuation."""
        from oxygen_ros.model.checkpoint import load_checkpoint

        meta = json.loads((Path(checkpoint) / 'config.json').read_text())
        trained = meta.get('training')
        if not trained:
            raise ValueError(f'{checkpoint} was not exported by oxygen-train')
        # Only the schedule's length may differ: going on for more steps than the run that
        # exported it had is what this is for.
        # A key an older export lacks was added since with its default: the same recipe.
        defaults = {f.name: f.default for f in dataclasses.fields(Recipe)
                    if f.default is not dataclasses.MISSING}
        theirs = {k: v for k, v in {**defaults, **trained.get('recipe', {})}.items()
                  if k != 'steps'}
        ours = {k: v for k, v in self.recipe.__dict__.items() if k != 'steps'}
        if theirs != ours:
            diff = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
            raise ValueError(f'{checkpoint} was exported by a run of another recipe '
                             f'(differs in {", ".join(diff)})')
        if int(trained['step']) >= self.recipe.steps:
            raise ValueError(f'{checkpoint} is at step {trained["step"]}, the recipe ends at '
                             f'{self.recipe.steps}: give --steps beyond it')
        model, stats, _ = load_checkpoint(checkpoint, self.cfg)
        self._take_weights(model)
        self._keep(stats, str(checkpoint))
        self.step = int(trained['step'])
        # The lineage goes on with the run: what it was fine-tuned from, and where its
        # schedule was lengthened.
        self.init = trained.get('init_from')
        self.went_on = [*trained.get('went_on_from', []),
                        {'step': self.step, 'schedule_steps': trained['recipe'].get('steps')}]
        self.g.manual_seed(self.recipe.seed * 1_000_003 + self.step)
        log = Path(checkpoint) / 'training_log.jsonl'
        if log.is_file():  # the curve so far goes on in this run's log
            self.log = [json.loads(x) for x in log.read_text().splitlines() if x]
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / 'log.jsonl').write_text(log.read_text())

    def export(self, path: Path) -> Path:
        """The moving-average weights as an openpi checkpoint directory, with its norm stats
        and tokenizer."""
        if self.readout is not None:
            changed = self.changed_outside_readout(self.ema)
            if changed:
                raise RuntimeError(f'the language stage changed weights outside the readout: '
                                   f'{changed}')
        root = save_checkpoint(self._ema_model(), path, self.stats, self.recipe.asset_id)
        (root / 'tokenizer.model').write_bytes(self.tokenizer.model_proto())
        meta = json.loads((root / 'config.json').read_text())
        meta['training'] = {'step': self.step, 'recipe': self.recipe.__dict__,
                            'data': [f'{p.parent.name}/{p.name}' for p in self.train.files],
                            'seeds': sorted({*self.train.seeds,
                                             *((self.init or {}).get('seeds') or [])}),
                            'prompt': self.train.prompt, 'cameras': self.recipe.cameras,
                            'profile_options': self.recipe.profile_options,
                            'init_from': self.init, 'went_on_from': self.went_on}
        (root / 'config.json').write_text(json.dumps(meta, indent=2))
        # The learning curve travels with the weights (a run may go on elsewhere from them).
        (root / 'training_log.jsonl').write_text(''.join(json.dumps(e) + '\n'
                                                         for e in self.log))
        return root

    # -- the loop ---------------------------------------------------------------------------
    def run(self, until: int | None = None) -> None:
        """Train to the recipe's last step, or stop after step `until` (resume later)."""
        r = self.recipe
        if self.readout is not None and self.kept is None:
            raise ValueError("the language stage trains a trained policy's readout: give "
                             '--init-from CHECKPOINT')
        until = r.steps if until is None else min(until, r.steps)
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=r.steps, initial=self.step, desc='training', unit='step',
                       file=sys.stderr)
        t0, recent = time.monotonic(), []
        while self.step < until:
            recent.append(self.train_step())
            if bar is not None:
                bar.update(1)
                bar.set_postfix({k: f'{v:.4f}' for k, v in recent[-1].items() if k != 'grad'})
            last = self.step == r.steps
            entry = None
            if self.step % r.log_every == 0 or last:
                entry = {'step': self.step, 'lr': self.lr_at(self.step - 1),
                         's': time.monotonic() - t0,
                         **{k: float(np.mean([x[k] for x in recent])) for k in recent[0]}}
                recent = []
            if self.step % r.val_every == 0 or last:
                entry = {**(entry or {'step': self.step}), **self.validate()}
            if entry is not None:
                self.log.append(entry)
                with open(self.out / 'log.jsonl', 'a') as f:
                    f.write(json.dumps(entry) + '\n')
            if self.step % r.save_every == 0 or last or self.step == until:
                self.save()
                self.plot()
        if bar is not None:
            bar.close()

    def plot(self) -> None:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        for i, (key, label) in enumerate((('flow', 'flow-matching MSE'),
                                          ('text', 'text cross-entropy'))):
            tr = [(e['step'], e[key]) for e in self.log if key in e]
            va = [(e['step'], e['val_' + key]) for e in self.log if 'val_' + key in e]
            if tr:
                ax[i].plot(*zip(*tr), label='train')
            if va:
                ax[i].plot(*zip(*va), 'o-', label='validation (EMA)')
            ax[i].set_yscale('log')
            ax[i].set_xlabel('step')
            ax[i].set_title(label)
            ax[i].legend()
        fig.tight_layout()
        fig.savefig(self.out / 'loss.png', dpi=100)
        plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--data', required=True, nargs='+', metavar='DIR',
                    help='directories of episode_<k>.hdf5 files (the last ones of the last '
                    'are held out for validation)')
    ap.add_argument('--out', required=True)
    ap.add_argument('--recipe', default='', help=f"a recipe YAML; '' = the package's {RECIPE}")
    ap.add_argument('--steps', type=int, default=None, help="the recipe's steps, unless given")
    ap.add_argument('--batch', type=int, default=None)
    ap.add_argument('--seed', type=int, default=None)
    ap.add_argument('--resume', action='store_true', help='continue the run in --out')
    ap.add_argument('--start-from', default='', metavar='CHECKPOINT',
                    help="go on from an exported checkpoint of this recipe (weights and step; "
                    "AdamW's moments start afresh) when --out holds no run")
    ap.add_argument('--init-from', default='', metavar='CHECKPOINT',
                    help='fine-tune: start a new run from the weights of an exported '
                    'checkpoint of the same model dims (step, schedule and AdamW afresh)')
    ap.add_argument('--stop-at', type=int, default=None,
                    help='stop after this step (saved; --resume goes on)')
    ap.add_argument('--threads', type=int, default=2)
    ap.add_argument('--no-progress', dest='progress', action='store_false')
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        recipe = Recipe.read(Path(args.recipe or config_dir() / RECIPE), steps=args.steps,
                             batch=args.batch, seed=args.seed)
        if args.stop_at is not None and (args.stop_at < 1 or args.stop_at % recipe.log_every):
            raise ValueError(f'--stop-at must be a positive multiple of log_every '
                             f'({recipe.log_every}), got {args.stop_at}')
        trainer = Trainer(recipe, [Path(d) for d in args.data], out, args.threads,
                          args.progress)
        if (out / 'state.safetensors').is_file() and not args.resume:
            print(f'oxygen-train: {out} holds a run; --resume continues it', file=sys.stderr)
            return 2
        if args.resume and trainer.resume():
            print(f'oxygen-train: resumed at step {trainer.step}', file=sys.stderr)
        elif args.init_from:
            if args.start_from:
                raise ValueError('--init-from starts a new run, --start-from goes on with '
                                 'one: give one of them')
            trainer.init_from(Path(args.init_from))
            print(f'oxygen-train: fine-tuning from {args.init_from}', file=sys.stderr)
        elif args.start_from:
            trainer.start_from(Path(args.start_from))
            print(f'oxygen-train: going on from {args.start_from} at step {trainer.step}',
                  file=sys.stderr)
        out.mkdir(parents=True, exist_ok=True)
        counts = trainer.model.param_counts()
        print(f'oxygen-train: {len(trainer.train)} training samples from '
              f'{len(trainer.train.files)} episodes, {len(trainer.val)} validation from '
              f'{len(trainer.val.files)}; {counts["total"] / 1e6:.2f} M parameters',
              file=sys.stderr)
        trainer.run(args.stop_at)
    except ValueError as e:
        print(f'oxygen-train: {e}', file=sys.stderr)
        return 2
    print(f'oxygen-train: step {trainer.step}; checkpoint {out / "checkpoint"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
