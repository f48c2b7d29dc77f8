"""The engine: robot-agnostic observations in, action chunks and streamed text out.

It owns the model, the tokenizer, the KV cache and the scheduler, and turns an
``Observation`` (images by model slot, state, prompt) into model tensors and the
scheduler's output back into numbers and text. Nothing here knows about ROS.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from ..model import Pi05, load_checkpoint, load_config
from ..model.processing import NormStats, pad_to, prepare_image
from ..model.rtc import Guide, Handover
from ..model.tokenizer import Tokenizer, action_prompt, subtask_prompt
from .kv_cache import KVCache
from .parallel import ParallelScheduler
from .requests import Request
from .scheduler import ADMISSION, MODES, Frame, Scheduler

PROMPT_FORMATS = ('pi05', 'subtask')


@dataclass
class EngineConfig:
    model: str = 'small'  # a built-in config name or a YAML path (ignored with a checkpoint)
    checkpoint: str = ''  # openpi/LeRobot safetensors directory or file; '' = random weights
    tokenizer: str = ''  # SentencePiece model path; '' = small built-in tokenizer
    device: str = 'cpu'
    mode: str = 'oxygen'
    denoise_steps: int = 10
    decode_k: int = 5  # decode steps per frame; 0 = adapt to the frame budget
    control_rate_hz: float = 70.0
    frame_budget_ms: float = 0.0  # 0 = action_horizon / control_rate_hz
    max_requests: int = 8
    max_new_tokens: int = 30
    admission: str = 'drop_oldest'
    max_pending: int = 4
    temperature: float = 0.0
    seed: int = 0
    stop_at_eos: bool = True
    prompt_format: str = 'pi05'  # pi05: openpi's action prompt with state; subtask: OxyGen's
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    compile: bool = False  # torch.compile the decode and denoise phases (CUDA)
    rtc: bool = False  # real-time chunking: guide each chunk towards the one being executed
    rtc_beta: float = 5.0  # largest guidance weight (the paper's beta); 0 = no guidance

    def __post_init__(self):
        if self.mode not in MODES + ('parallel',):
            raise ValueError(f'mode must be one of {MODES + ("parallel",)}, got {self.mode!r}')
        if self.admission not in ADMISSION:
            raise ValueError(f'admission must be one of {ADMISSION}, got {self.admission!r}')
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f'prompt_format must be one of {PROMPT_FORMATS}, '
                             f'got {self.prompt_format!r}')
        for name in ('denoise_steps', 'max_new_tokens'):
            if getattr(self, name) < 1:
                raise ValueError(f'{name} must be >= 1, got {getattr(self, name)}')
        for name in ('decode_k', 'max_requests', 'threads', 'max_pending'):
            if getattr(self, name) < 0:
                raise ValueError(f'{name} must be >= 0, got {getattr(self, name)}')
        if self.control_rate_hz <= 0:
            raise ValueError(f'control_rate_hz must be > 0, got {self.control_rate_hz}')
        if self.frame_budget_ms < 0:
            raise ValueError(f'frame_budget_ms must be >= 0, got {self.frame_budget_ms}')
        if self.temperature < 0:
            raise ValueError(f'temperature must be >= 0, got {self.temperature}')
        if self.rtc_beta < 0:
            raise ValueError(f'rtc_beta must be >= 0, got {self.rtc_beta}')
        if self.device.startswith('cuda') and not torch.cuda.is_available():
            raise ValueError(f'device {self.device!r} asked for but CUDA is not available')

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f'unknown engine settings {unknown}; known: {sorted(names)}')
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f) or {})


@dataclass
class Observation:
    stamp: float  # seconds
    images: dict  # model slot name -> HxWx3 uint8 RGB, or None when the camera is missing
    state: np.ndarray  # robot-convention state, not normalised
    prompt: str


@dataclass
class TokenEvent:
    request_id: int
    stamp: float  # observation time of the frame that started the request
    delta: str
    text: str
    tokens: int
    done: bool
    cancelled: bool = False


@dataclass
class FrameResult:
    stamp: float
    actions: np.ndarray  # [horizon, action_dim], unnormalised
    events: list[TokenEvent] = field(default_factory=list)
    timing: dict = field(default_factory=dict)
    rejected: str | None = None


class Engine:
    def __init__(self, cfg: EngineConfig | None = None, model=None, tokenizer=None,
                 norm_stats: NormStats | None = None):
        self.cfg = cfg = cfg or EngineConfig()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = torch.device(cfg.device)
        if model is None:
            model, norm_stats = _load_model(cfg, self.device)
        self.model = model
        self.model_cfg = model.cfg
        self.norm = norm_stats
        self.tokenizer = tokenizer or (Tokenizer(cfg.tokenizer) if cfg.tokenizer
                                       else Tokenizer.default())
        if self.tokenizer.vocab_size > self.model_cfg.vocab:
            raise ValueError(f'tokenizer has {self.tokenizer.vocab_size} pieces but the model '
                             f'only {self.model_cfg.vocab}')
        if cfg.compile:
            _compile(model)
        dtype = model.dtype
        budget = cfg.frame_budget_ms or 1000.0 * self.model_cfg.action_horizon / cfg.control_rate_hz
        if cfg.mode == 'parallel':
            self.scheduler = ParallelScheduler(
                model, cfg.max_requests, cfg.max_new_tokens, cfg.denoise_steps,
                vocab_limit=self.tokenizer.vocab_size, device=self.device, dtype=dtype,
                frame_budget_ms=budget)
            self.cache = self.scheduler.lang.cache
        else:
            self.cache = KVCache(self.model_cfg, cfg.max_requests, cfg.max_new_tokens,
                                 device=self.device, dtype=dtype)
            self.scheduler = Scheduler(
                model, self.cache, mode=cfg.mode, denoise_steps=cfg.denoise_steps,
                decode_k=cfg.decode_k, frame_budget_ms=budget, admission=cfg.admission,
                max_pending=cfg.max_pending, vocab_limit=self.tokenizer.vocab_size)
        self._noise = torch.Generator().manual_seed(cfg.seed)
        self._streams = {}
        self._prompt_cache: tuple[str, tuple] | None = None
        size = self.model_cfg.vision.image_size
        self._blank = torch.zeros(3, size, size)
        self._recent = collections.deque(maxlen=200)  # (wall time, frame ms, tokens)
        self.frames = 0
        self._last: torch.Tensor | None = None  # the last chunk, model space (for RTC)
        self.guided = 0

    @property
    def slots(self) -> tuple[str, ...]:
        return tuple(self.model_cfg.image_slots)

    @property
    def action_horizon(self) -> int:
        return self.model_cfg.action_horizon

    @property
    def action_dim(self) -> int:
        return self.model_cfg.action_dim

    # -- observation -> tensors ------------------------------------------------------------

    def _tokens(self, text: str):
        if self._prompt_cache is not None and self._prompt_cache[0] == text:
            return self._prompt_cache[1]
        tokens, mask = self.tokenizer.tokenize(text, self.model_cfg.max_token_len)
        out = (torch.from_numpy(tokens)[None].to(self.device),
               torch.from_numpy(mask)[None].to(self.device))
        self._prompt_cache = (text, out)
        return out

    def frame(self, obs: Observation) -> Frame:
        unknown = sorted(set(obs.images) - set(self.slots))
        if unknown:
            raise ValueError(f'unknown image slots {unknown}; the model has {list(self.slots)}')
        size = self.model_cfg.vision.image_size
        images, present = [], []
        for slot in self.slots:
            img = obs.images.get(slot)
            present.append(img is not None)
            images.append(self._blank if img is None else prepare_image(img, size, size))
        state = np.asarray(obs.state, dtype=np.float32)
        if not np.all(np.isfinite(state)):
            raise ValueError('state holds NaN or inf')
        if self.norm is not None:
            state = self.norm.normalize_state(state.copy())
        if self.cfg.prompt_format == 'pi05':
            text = action_prompt(obs.prompt, pad_to(state, self.action_dim))
        else:
            text = subtask_prompt(obs.prompt)
        tokens, mask = self._tokens(text)
        noise = torch.randn(1, self.action_horizon, self.action_dim, generator=self._noise)
        dtype = self.cache.kv.dtype
        return Frame(
            stamp=obs.stamp,
            images=torch.stack(images)[None].to(self.device, dtype),
            image_mask=torch.tensor([present], device=self.device),
            tokens=tokens, token_mask=mask,
            noise=noise.to(self.device, dtype))

    def actions_in(self, actions: np.ndarray) -> torch.Tensor:
        """The inverse of actions_out: output units -> model space, padded to the model's
        action dim."""
        a = np.asarray(actions, dtype=np.float64)
        if self.norm is not None:
            a = self.norm.normalize_actions(a)
        return torch.from_numpy(pad_to(a, self.action_dim)).float()

    def actions_out(self, actions: torch.Tensor) -> np.ndarray:
        a = actions.float().cpu().numpy()
        if self.norm is not None:
            a = self.norm.unnormalize_actions(a)
        return a

    # -- one frame -------------------------------------------------------------------------

    def step(self, obs: Observation, narrate: bool = False, on_actions=None,
             max_new_tokens: int | None = None,
             handover: Handover | None = None) -> FrameResult:
        """Run one frame. ``on_actions`` gets the chunk as soon as it exists, before language.

        ``narrate`` starts a language request from this frame's prefill; ``max_new_tokens``
        caps it below the configured maximum (the KV rows are sized for that maximum).
        With ``rtc`` on, ``handover`` says where this chunk joins the previous one (the
        last this engine returned), and the chunk is sampled to continue it.
        """
        limit = self.cfg.max_new_tokens
        if max_new_tokens is not None and not 1 <= max_new_tokens <= limit:
            raise ValueError(f'max_new_tokens must be in [1, {limit}], got {max_new_tokens}')
        f = self.frame(obs)
        f.guide = self._guide(handover)
        request = None
        if narrate:
            request = Request(stamp=obs.stamp, prompt=obs.prompt,
                              max_new_tokens=max_new_tokens or limit,
                              stop_at_eos=self.cfg.stop_at_eos,
                              temperature=self.cfg.temperature, seed=self.cfg.seed,
                              eos_id=self.tokenizer.eos_id)
        hook = None
        if on_actions is not None:
            def hook(a):
                on_actions(self.actions_out(a))
        out = self.scheduler.step(f, request, hook)
        # Cloned out of inference mode: the next frame's guidance differentiates near it.
        self._last = out.actions.clone()
        self.guided += f.guide is not None
        result = FrameResult(stamp=obs.stamp, actions=self.actions_out(out.actions),
                             timing=out.timing)
        result.events = self._events(out)
        if out.rejected is not None:
            result.rejected = (f'narration request of frame {obs.stamp:.3f} rejected: all '
                               f'{self.cache.max_requests} KV slots are busy')
        self.frames += 1
        self._recent.append((time.monotonic(), out.timing['frame_ms'], len(out.tokens)))
        return result

    def _guide(self, handover: Handover | None) -> Guide | None:
        if not self.cfg.rtc or handover is None or self._last is None:
            return None
        if handover.start < 0 or handover.delay < 0:
            raise ValueError(f'handover steps must be >= 0, got {handover}')
        h = self.action_horizon
        if handover.start >= h:
            return None  # the previous chunk has run out: there is nothing to join
        # Past the overlap there is nothing to freeze to.
        delay = min(handover.delay, h - handover.start)
        if handover.previous is None:
            return Guide.make(self._last, handover.start, delay, self.cfg.rtc_beta)
        prev = np.asarray(handover.previous, dtype=np.float64)
        if prev.ndim != 2 or prev.shape[0] != h or not 1 <= prev.shape[1] <= self.action_dim:
            raise ValueError(f'handover.previous must be [{h}, <= {self.action_dim}], '
                             f'got {prev.shape}')
        return Guide.make(self.actions_in(prev), handover.start, delay, self.cfg.rtc_beta,
                          columns=prev.shape[1])

    def _events(self, out) -> list[TokenEvent]:
        events = []
        for r, t, n, last in out.tokens:
            stream = self._streams.setdefault(r.id, self.tokenizer.stream())
            delta = stream.feed(t)
            if last:
                delta += stream.finish()
                del self._streams[r.id]
            events.append(TokenEvent(r.id, r.stamp, delta, stream.text, n, last))
        for r in out.finished:
            if r.cancelled:
                stream = self._streams.pop(r.id, None)
                text = stream.text if stream else ''
                events.append(TokenEvent(r.id, r.stamp, '', text, len(r.tokens), True, True))
        return events

    def cancel_all(self) -> list[TokenEvent]:
        events = []
        for r in self.scheduler.cancel_all():
            stream = self._streams.pop(r.id, None)
            events.append(TokenEvent(r.id, r.stamp, '', stream.text if stream else '',
                                     len(r.tokens), True, True))
        return events

    def stats(self) -> dict:
        ms = np.array([m for _, m, _ in self._recent]) if self._recent else np.zeros(1)
        tokens = sum(n for _, _, n in self._recent)
        s = self.scheduler
        return dict(
            frames=self.frames,
            action_hz=self.action_horizon * 1000.0 / ms.mean() if self._recent else 0.0,
            frame_ms_p50=float(np.percentile(ms, 50)),
            frame_ms_p99=float(np.percentile(ms, 99)),
            tokens_per_s=tokens * 1000.0 / ms.sum() if self._recent else 0.0,
            active_requests=len(s.active),
            pending_requests=len(s.pending),
            kv_bytes=self.cache.total_bytes,
            kv_bytes_per_slot=self.cache.bytes_per_slot,
            deadline_misses=s.deadline_misses,
            rtc_frames=self.guided,
            rejected_requests=s.rejected,
            dropped_requests=s.dropped,
        )


def _compile(model) -> None:
    """Compile the per-token and per-step work, the parts run many times per frame.

    Shapes vary with the batch and the cache length, so the graphs are dynamic; on CUDA the
    launch overhead these phases are made of is what compiling removes.
    """
    if getattr(model, 'compiled', False):
        return
    model.decode_hidden = torch.compile(model.decode_hidden, dynamic=True)
    model._velocity = torch.compile(model._velocity, dynamic=True)
    model.compiled = True


def random_model(model_cfg, device: torch.device, dtype: torch.dtype) -> Pi05:
    """Random weights (timing, demos), initialised where they will run: the full pi05
    config is 13 GB in float32, too much to build on the host first."""
    with torch.device(device):
        model = Pi05(model_cfg)
    return model.to_inference(device, dtype)


def _load_model(cfg: EngineConfig, device: torch.device):
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    norm = None
    if cfg.checkpoint:
        path = Path(cfg.checkpoint)
        if not path.exists():
            raise FileNotFoundError(f'checkpoint not found: {path}')
        model, stats, _ = load_checkpoint(path, device=device, dtype=dtype)
        if stats is not None:
            norm = NormStats.from_dict(stats)
    else:
        torch.manual_seed(cfg.seed)
        model = random_model(load_config(cfg.model), device, dtype)
    model.eval()
    return model, norm
