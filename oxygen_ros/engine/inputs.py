"""Observations in the model's terms, and its chunks back in the robot's.

``ModelInputs`` checks one robot's inputs (images by slot, state, prompt, noise, where its
chunk joins the last one) and turns them into host tensors; ``batch`` stacks the robots of a
frame on the device. Chunks go back cut to the robot's action dims and unnormalised.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..model.processing import crop, prepare_image
from ..model.rtc import Guide, Handover
from ..model.tokenizer import action_prompt, subtask_prompt
from .fleet import BatchGuide
from .io import Observation, RobotInput
from .scheduler import Frame

# Model units per robot unit above which an action dim counts as constant in training.
UNGUIDED_GAIN = 100.0


class Prepared:
    """One robot's inputs, checked, as host tensors: its part of a frame."""

    def __init__(self, robot, inp: RobotInput, tensors: tuple, guide: Guide | None):
        self.robot = robot  # the engine's state of the robot (runner.RobotState)
        self.inp = inp
        self.tensors = tensors  # images [slots, 3, H, W], present, tokens, token mask, noise
        self.guide = guide


class ModelInputs:
    def __init__(self, cfg, checkpoint, tokenizer, device: torch.device, dtype: torch.dtype):
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.model_cfg = checkpoint.model.cfg
        self.norm = checkpoint.norm
        self._unguided: tuple[int, ...] | None = None
        self.tokenizer = tokenizer
        self.device, self.dtype = device, dtype
        size = self.model_cfg.vision.image_size
        self.slots = tuple(self.model_cfg.image_slots)
        self._blank = torch.zeros(3, size, size)
        # CUDA: images go up from a pinned buffer without waiting. The buffer is refilled
        # only by the next frame, after this frame's prefill has read its masks back (the
        # device has then finished the copy).
        self._pinned = torch.empty(cfg.robots, len(self.slots), 3, size, size,
                                   pin_memory=True) if device.type == 'cuda' else None

    @property
    def unguided(self) -> tuple[int, ...]:
        """Action dims real-time chunking leaves free: those the checkpoint's stats show
        (nearly) constant in training, whose normalisation multiplies a unit by more than
        UNGUIDED_GAIN (a span under ~0.02 rad or m). The model cannot follow a target there,
        and the gain turns a joint's jitter between two frames into a model-space error
        thousands of times the rest: its gradient through the expert threw whole chunks out
        of range (a scripted demo's ALOHA never turns its waist: q01 = q99, gain 2e6)."""
        if self.norm is None:
            return ()
        if self._unguided is None:
            n = self.action_dim
            gain = np.abs(self.norm.normalize_actions(np.ones((1, n)))
                          - self.norm.normalize_actions(np.zeros((1, n))))[0]
            self._unguided = tuple(int(i) for i in np.flatnonzero(gain > UNGUIDED_GAIN))
        return self._unguided

    @property
    def horizon(self) -> int:
        return self.model_cfg.action_horizon

    @property
    def action_dim(self) -> int:
        return self.checkpoint.action_dim

    def prepare(self, robot, name: str, inp: RobotInput) -> Prepared:
        """``robot``'s inputs checked (ValueError or TypeError saying what is wrong)."""
        if not isinstance(inp, RobotInput) or not isinstance(inp.obs, Observation):
            raise TypeError(f'robot {name!r}: expected a RobotInput holding an Observation')
        limit = self.cfg.max_new_tokens
        if inp.max_new_tokens is not None and not 1 <= inp.max_new_tokens <= limit:
            raise ValueError(f'max_new_tokens must be in [1, {limit}], got {inp.max_new_tokens}')
        for slot, img in inp.obs.images.items() if isinstance(inp.obs.images, dict) else ():
            shape = getattr(img, 'shape', None)
            if img is not None and (shape is None or len(shape) != 3 or shape[2] != 3
                                    or 0 in shape[:2]):
                raise ValueError(f'image {slot!r} must be HxWx3, got shape {shape}')
        images, present, text = self.observation(inp.obs)
        if robot.prompt is None or robot.prompt[0] != text:
            tokens, mask = self.tokenizer.tokenize(text, self.model_cfg.max_token_len)
            robot.prompt = (text, (torch.from_numpy(tokens), torch.from_numpy(mask)))
        noise = self.noise(inp.noise, robot.noise, inp.obs.stamp, name)[0]
        guide = self.guide(inp.handover, robot.last)
        return Prepared(robot, inp, (torch.stack(images), present, *robot.prompt[1], noise),
                        guide)

    def observation(self, obs: Observation) -> tuple[list[torch.Tensor], list[bool], str]:
        """An observation checked: images by slot (blank where missing), which are present,
        the prompt text. Raises ValueError saying what is wrong."""
        if not isinstance(obs.images, dict):
            raise ValueError(f'images must be a dict of slot -> image, got '
                             f'{type(obs.images).__name__}')
        unknown = sorted(set(obs.images) - set(self.slots))
        if unknown:
            raise ValueError(f'unknown image slots {unknown}; the model has {list(self.slots)}')
        size = self.model_cfg.vision.image_size
        conventions = self.checkpoint.conventions
        images, present = [], []
        for slot in self.slots:
            img = obs.images.get(slot)
            present.append(img is not None)
            if img is not None:
                img = prepare_image(crop(np.asarray(img), self.model_cfg.crop_of(slot)),
                                    size, size, conventions)
            images.append(self._blank if img is None else img)
        state = np.asarray(obs.state, dtype=np.float32)
        if state.ndim != 1 or not np.all(np.isfinite(state)):
            raise ValueError(f'state must be a finite vector, got shape {state.shape}')
        want = self.checkpoint.state_dim
        if want is not None and (len(state) > want or
                                 (conventions == 'lerobot' and len(state) != want)):
            raise ValueError(f'state has {len(state)} dims; the checkpoint expects {want}')
        if self.norm is not None:
            state = self.norm.normalize_state(state)
        if self.cfg.prompt_format == 'pi05':
            text = action_prompt(obs.prompt, state)
        else:
            text = subtask_prompt(obs.prompt)
        return images, present, text

    def noise(self, noise: np.ndarray | None, generator: torch.Generator, stamp: float,
              robot: str = '') -> torch.Tensor:
        """[1, horizon, model action width] on the host: ``noise`` checked, or drawn (from
        the frame's stamp with frame_noise, else from ``generator``)."""
        shape = (self.horizon, self.model_cfg.action_dim)
        if noise is None:
            if self.cfg.frame_noise:
                generator = frame_generator(self.cfg.seed, robot, stamp)
            return torch.randn(1, *shape, generator=generator)
        noise = np.asarray(noise, dtype=np.float32)
        if noise.shape != shape or not np.all(np.isfinite(noise)):
            raise ValueError(f'noise must be a finite {list(shape)} array (horizon x model '
                             f'action width), got shape {list(noise.shape)}')
        return torch.from_numpy(noise)[None]

    def guide(self, handover: Handover | None, last: torch.Tensor | None) -> Guide | None:
        """The guide joining the chunk to ``last`` (model space) where ``handover`` says."""
        if not self.cfg.rtc or handover is None or last is None:
            return None
        if handover.start < 0 or handover.delay < 0:
            raise ValueError(f'handover steps must be >= 0, got {handover}')
        h = self.horizon
        if handover.start >= h:
            return None  # the previous chunk has run out: there is nothing to join
        # Past the overlap there is nothing to freeze to.
        delay = min(handover.delay, h - handover.start)
        if handover.previous is None:
            return Guide.make(last, handover.start, delay, self.cfg.rtc_beta,
                              columns=self.action_dim, free=self.unguided)
        prev = np.asarray(handover.previous, dtype=np.float64)
        if prev.ndim != 2 or prev.shape[0] != h or not 1 <= prev.shape[1] <= self.action_dim:
            raise ValueError(f'handover.previous must be [{h}, <= {self.action_dim}], '
                             f'got {prev.shape}')
        return Guide.make(self.actions_in(prev), handover.start, delay, self.cfg.rtc_beta,
                          columns=prev.shape[1], free=self.unguided)

    def batch(self, parts: list[Prepared]) -> Frame:
        """The model's inputs of every robot of a frame, batched on the device."""
        b = len(parts)
        dev, dtype = self.device, self.dtype
        tensors = [p.tensors for p in parts]
        if self._pinned is not None:
            torch.stack([t[0] for t in tensors], out=self._pinned[:b])
            images = self._pinned[:b].to(dev, non_blocking=True).to(dtype)
        else:
            images = torch.stack([t[0] for t in tensors]).to(dev, dtype)
        guides = [p.guide for p in parts]
        return Frame(stamp=max(p.inp.obs.stamp for p in parts), images=images,
                     image_mask=torch.tensor([t[1] for t in tensors], device=dev),
                     tokens=torch.stack([t[2] for t in tensors]).to(dev),
                     token_mask=torch.stack([t[3] for t in tensors]).to(dev),
                     noise=torch.stack([t[4] for t in tensors]).to(dev, dtype),
                     guide=None if all(g is None for g in guides) else BatchGuide(
                         guides, self.horizon, self.model_cfg.action_dim,
                         self.cfg.rtc_beta))

    def actions_in(self, actions: np.ndarray) -> torch.Tensor:
        """The inverse of actions_out: the robot's dims, unnormalised -> model space, zero
        past the robot's dims."""
        a = np.asarray(actions, dtype=np.float64)
        if self.norm is not None:
            a = self.norm.normalize_actions(a)
        out = torch.zeros(a.shape[0], self.model_cfg.action_dim)
        out[:, :a.shape[1]] = torch.from_numpy(np.asarray(a, dtype=np.float32))
        return out

    def actions_out(self, actions: torch.Tensor) -> np.ndarray:
        """Model actions -> the robot's dims, unnormalised (cut first, as LeRobot does;
        openpi's unnormalisation leaves dims past its stats alone, so the order is moot)."""
        a = actions.float().cpu().numpy()[..., :self.action_dim]
        if self.norm is not None:
            a = self.norm.unnormalize_actions(a)
        return a


def frame_generator(seed: int, robot: str, stamp: float) -> torch.Generator:
    """The generator of a frame's noise under frame_noise: a hash of the seed, the robot's
    name ('' for a node's one robot) and the stamp to the microsecond (a stamp read from
    the same message is the same float live and offline; the rounding absorbs the last bit
    of two ways of computing it)."""
    key = f'{seed}/{robot}/{round(stamp * 1e6)}'.encode()
    return torch.Generator().manual_seed(
        int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), 'little'))


