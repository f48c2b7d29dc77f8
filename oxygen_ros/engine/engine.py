"""The engine: robot-agnostic observations in, action chunks and streamed text out.

It owns the model, the tokenizer, the KV cache and the scheduler, and turns an
``Observation`` (images by model slot, state, prompt) into model tensors and the
scheduler's output back into numbers and text. Questions (``ask``) may come from any
thread: they wait for the next frame, which starts them from its own prefill. Nothing here
knows about ROS.

One engine serves several robots (``add_robot``, ``step_fleet``): one frame batches every
robot it is given, each robot's chunk is handed out when the batch's denoise ends, and the
language of all of them is decoded in one batch. Requests carry their robot; a robot's
questions wait for that robot's next frame. ``step`` is the same engine serving one robot.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from ..model import Pi05, load_config
from ..model.checkpoint import Checkpoint, checkpoint_tokenizer, open_checkpoint
from ..model.processing import CONVENTIONS, NormStats, crop, prepare_image
from ..model.rtc import Guide, Handover
from ..model.tokenizer import Tokenizer, action_prompt, prompt_tokens, subtask_prompt
from .baselines import SCHEDULERS
from .fleet import BatchGuide
from .kv_cache import KVCache
from .parallel import ParallelScheduler
from .requests import Request
from .scheduler import ADMISSION, MODES, AdaptiveK, BatchError, Frame

PROMPT_FORMATS = ('pi05', 'subtask')
# How a question follows the frame's prefix (images and task) in its request's row.
QUESTION_FORMAT = 'Question: {question}\nAnswer: '


@dataclass
class EngineConfig:
    # A built-in config name or a YAML path; '' = 'small' for random weights. With a
    # checkpoint it gives the transformer/vision/vocabulary dims instead of the variants its
    # config.json names; '' = those variants.
    model: str = ''
    checkpoint: str = ''  # LeRobot pi05 / openpi directory or .safetensors file; '' = random
    normalize: bool = True  # False: run a checkpoint without normalisation stats on purpose
    conventions: str = ''  # 'openpi' or 'lerobot'; '' = what the checkpoint directory is
    asset_id: str = ''  # openpi: which assets/<asset_id>/norm_stats.json; '' = the only one
    # SentencePiece model path; '' = a checkpoint's own (checkpoint_tokenizer), else the small
    # built-in tokenizer
    tokenizer: str = ''
    device: str = 'cpu'
    mode: str = 'oxygen'
    denoise_steps: int = 0  # 0 = the checkpoint's (LeRobot num_inference_steps), else 10
    decode_k: int = 5  # decode steps per frame; 0 = adapt to the frame budget
    control_rate_hz: float = 70.0
    frame_budget_ms: float = 0.0  # 0 = action_horizon / control_rate_hz
    max_requests: int = 8
    max_new_tokens: int = 30
    # KV columns per row for a question's own tokens; 0 = no questions (rows as small as
    # narration needs).
    max_question_tokens: int = 0
    admission: str = 'drop_oldest'
    max_pending: int = 4
    temperature: float = 0.0
    seed: int = 0
    # Each frame's flow-matching noise drawn from (seed, robot, the observation's stamp)
    # instead of one stream: the same inputs give the same chunk live and replayed.
    frame_noise: bool = False
    stop_at_eos: bool = True
    prompt_format: str = 'pi05'  # pi05: openpi's action prompt with state; subtask: OxyGen's
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    compile: bool = False  # torch.compile the decode and denoise phases (CUDA)
    # Static-shape denoise and decode, captured as CUDA graphs at start-up on CUDA
    # (engine/graphs.py); elsewhere the same static calls run eagerly.
    graphs: bool = False
    phase_timing: bool = False  # CUDA: wait for the device at each phase to time it
    rtc: bool = False  # real-time chunking: guide each chunk towards the one being executed
    rtc_beta: float = 5.0  # largest guidance weight (the paper's beta); 0 = no guidance
    robots: int = 1  # most robots in one frame (step_fleet): scratch rows, denoise buckets
    robot_rows: int = 0  # KV rows one robot's requests may hold; 0 = max_requests // robots

    def __post_init__(self):
        if self.mode not in MODES + ('parallel',):
            raise ValueError(f'mode must be one of {MODES + ("parallel",)}, got {self.mode!r}')
        if self.admission not in ADMISSION:
            raise ValueError(f'admission must be one of {ADMISSION}, got {self.admission!r}')
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f'prompt_format must be one of {PROMPT_FORMATS}, '
                             f'got {self.prompt_format!r}')
        if self.max_new_tokens < 1:
            raise ValueError(f'max_new_tokens must be >= 1, got {self.max_new_tokens}')
        if self.conventions not in ('',) + CONVENTIONS:
            raise ValueError(f'conventions must be one of {CONVENTIONS} or empty, '
                             f'got {self.conventions!r}')
        for name in ('denoise_steps', 'decode_k', 'max_requests', 'threads', 'max_pending',
                     'max_question_tokens', 'robot_rows'):
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
        if self.robots < 1:
            raise ValueError(f'robots must be >= 1, got {self.robots}')
        if self.robots > 1 and self.mode == 'parallel':
            raise ValueError('several robots per frame need a single-copy mode, not parallel')
        if self.graphs and self.compile:
            raise ValueError('graphs and compile are alternatives: set one of them')
        if self.graphs and self.mode == 'parallel':
            raise ValueError('graphs are for the single-copy modes, not parallel')
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
    cancelled: bool = False  # ended early: cancelled, dropped or rejected
    # On the last event, why it ended (requests.REASONS); 'queued' on a question's event
    # that says it waits for a KV row.
    reason: str = ''
    message: str = ''  # the reason in words when it ended early or waits
    kind: str = 'narration'  # or 'question'
    robot: str = ''  # whose frame started the request


@dataclass
class FrameResult:
    stamp: float
    actions: np.ndarray  # [horizon, action_dim] (the robot's dims), unnormalised
    events: list[TokenEvent] = field(default_factory=list)
    timing: dict = field(default_factory=dict)
    rejected: str | None = None
    robot: str = ''


@dataclass
class RobotInput:
    """What one robot brings to a frame of several (step_fleet); as step's arguments."""

    obs: Observation
    narrate: bool = False
    max_new_tokens: int | None = None
    noise: np.ndarray | None = None
    handover: Handover | None = None


@dataclass
class FleetResult:
    """One frame of several robots. ``results``: the robots whose chunk was computed;
    ``errors``: the robots that failed, and why (their inputs, or the model on them alone);
    ``events``: every robot's language events of this frame, whether or not it was in the
    frame (requests decode across frames); a result's ``events`` is its robot's list."""

    results: dict[str, FrameResult] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    events: dict[str, list[TokenEvent]] = field(default_factory=dict)
    timing: dict = field(default_factory=dict)


class _Robot:
    """An engine's state of one robot of a fleet."""

    def __init__(self, name: str, seed: int):
        self.name = name
        self.noise = torch.Generator().manual_seed(seed)
        self.inbox: list[Request] = []  # questions waiting for this robot's next frame
        self.last: torch.Tensor | None = None  # the last chunk, model space (RTC)
        self.guided = 0
        self.frames = 0
        self.errors = 0
        self.prompt: tuple[str, tuple] | None = None  # host tokens of the last prompt


class Engine:
    """``model`` (with ``norm_stats``) bypasses loading: the model's slots and action width
    are used, in openpi's conventions unless the config says otherwise."""

    def __init__(self, cfg: EngineConfig | None = None, model=None, tokenizer=None,
                 norm_stats: NormStats | None = None):
        self.cfg = cfg = cfg or EngineConfig()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = torch.device(cfg.device)
        if model is None:
            self.checkpoint = _load(cfg, self.device)
        else:
            mc = model.cfg
            self.checkpoint = Checkpoint(model, norm_stats, 'given', cfg.conventions or 'openpi',
                                         tuple(mc.image_slots), None, mc.action_dim,
                                         mc.action_horizon, mc.action_horizon, None)
        self.model = model = self.checkpoint.model
        self.model_cfg = model.cfg
        self.norm = self.checkpoint.norm
        # Where the tokenizer came from, for the start-up log. A checkpoint's must be the one
        # of its vocabulary (checkpoint_tokenizer refuses others); random weights take any.
        if tokenizer is not None:
            self.tokenizer, self.tokenizer_from = tokenizer, 'given'
        elif self.checkpoint.layout in ('random', 'given'):
            self.tokenizer = Tokenizer(cfg.tokenizer) if cfg.tokenizer else Tokenizer.default()
            self.tokenizer_from = 'tokenizer' if cfg.tokenizer else 'built-in'
        else:
            self.tokenizer, self.tokenizer_from = checkpoint_tokenizer(self.checkpoint,
                                                                       cfg.tokenizer)
        if self.tokenizer.vocab_size > self.model_cfg.vocab:
            raise ValueError(f'tokenizer has {self.tokenizer.vocab_size} pieces but the model '
                             f'only {self.model_cfg.vocab}')
        if cfg.compile:
            _compile(model)
        dtype = model.dtype
        budget = cfg.frame_budget_ms or 1000.0 * self.model_cfg.action_horizon / cfg.control_rate_hz
        if cfg.mode == 'parallel':
            self.scheduler = ParallelScheduler(
                model, cfg.max_requests, cfg.max_new_tokens, self.denoise_steps,
                vocab_limit=self.tokenizer.vocab_size, device=self.device, dtype=dtype,
                frame_budget_ms=budget, extension=cfg.max_question_tokens)
            self.cache = self.scheduler.lang.cache
        else:
            self.cache = KVCache(self.model_cfg, cfg.max_requests, cfg.max_new_tokens,
                                 device=self.device, dtype=dtype,
                                 extension=cfg.max_question_tokens, scratch_rows=cfg.robots)
            self.scheduler = SCHEDULERS[cfg.mode](
                model, self.cache, denoise_steps=self.denoise_steps,
                decode_k=cfg.decode_k, frame_budget_ms=budget, admission=cfg.admission,
                max_pending=cfg.max_pending, vocab_limit=self.tokenizer.vocab_size,
                graphs=cfg.graphs, phase_timing=cfg.phase_timing, robots=cfg.robots)
        # Tokens a question may take; lowered while running (the node's live max_new_tokens),
        # never above what the KV rows were sized for.
        self.budget = cfg.max_new_tokens
        # Questions arrive from other threads: they wait in the inbox for the next frame.
        # Whoever runs the scheduler holds _owner; a cancel that finds it held is left in
        # _cancels for the running frame to do before it lets go.
        self._lock = threading.Lock()
        self._owner = threading.Lock()
        self._cancels: set[int] = set()
        self._ended: list[Request] = []
        self._streams = {}
        size = self.model_cfg.vision.image_size
        self._blank = torch.zeros(3, size, size)
        # CUDA: images go up from a pinned buffer without waiting. The buffer is refilled
        # only by the next frame, after this frame's prefill has read its masks back (the
        # device has then finished the copy).
        self._pinned = torch.empty(cfg.robots, len(self.slots), 3, size, size,
                                   pin_memory=True) if self.device.type == 'cuda' else None
        self._recent = collections.deque(maxlen=200)  # (wall time, frame ms, tokens)
        self.frames = 0
        # What stats() and robot_stats() report of the scheduler, taken by the thread that
        # runs frames as each ends: diagnostics run on another thread, and the scheduler's
        # lists and row owners change under them while a frame runs.
        self._stats_lock = threading.Lock()
        # The robot of step(): a fleet of one, on the same path as the robots of step_fleet
        # (named '', it is not one of them; its noise is the engine's seed's own stream).
        self._one = _Robot('', cfg.seed)
        self._robots: dict[str, _Robot] = {}
        self._snap = self._scheduler_snapshot()
        # Frame start to chunks out, per robots in the frame (step_fleet), for planning.
        self._chunk_ms = AdaptiveK(budget, 1)

    # -- what the checkpoint states (the node checks the robot against these) -------------

    @property
    def slots(self) -> tuple[str, ...]:
        """Camera slot names in the model's order (LeRobot: its camera names)."""
        return tuple(self.model_cfg.image_slots)

    @property
    def action_horizon(self) -> int:
        return self.model_cfg.action_horizon

    @property
    def action_dim(self) -> int:
        """Columns of every action chunk returned: the robot's action dims."""
        return self.checkpoint.action_dim

    @property
    def model_action_dim(self) -> int:
        """Width the model works in (LeRobot's max_action_dim); the noise has it."""
        return self.model_cfg.action_dim

    @property
    def state_dim(self) -> int | None:
        """The state the checkpoint expects (openpi: at most this many); None: not stated."""
        return self.checkpoint.state_dim

    @property
    def n_action_steps(self) -> int:
        """How many actions of a chunk the checkpoint means to be played."""
        return self.checkpoint.n_action_steps

    @property
    def conventions(self) -> str:
        return self.checkpoint.conventions

    @property
    def denoise_steps(self) -> int:
        return self.cfg.denoise_steps or self.checkpoint.denoise_steps or 10

    @property
    def weights(self) -> dict:
        """What was loaded: layout ('lerobot', 'openpi', 'file', 'random', 'given'), path,
        normalisation modes and stats files."""
        c = self.checkpoint
        return dict(layout=c.layout, path=c.info.get('path'), asset_id=c.info.get('asset_id'),
                    stats_files=c.info.get('stats_files', []),
                    normalization=self.norm.modes if self.norm is not None else None)

    def prompt_tokens(self, task: str, state_dim: int) -> int:
        """The most tokens the prefix text of `task` takes with a `state_dim`-d state (any
        state, in this engine's prompt format); over model_cfg.max_token_len the tokenizer
        cuts the end, the state."""
        return prompt_tokens(self.tokenizer, task, state_dim, self.cfg.prompt_format)

    # -- observation -> tensors ------------------------------------------------------------

    def frame(self, obs: Observation, noise: np.ndarray | None = None) -> Frame:
        """The model's inputs for one observation of step()'s robot, as a frame runs them
        (its noise drawn from that robot's stream unless given)."""
        return self._batch({'': self._robot_inputs('', RobotInput(obs, noise=noise))})

    def _inputs(self, obs: Observation) -> tuple[list[torch.Tensor], list[bool], str]:
        """An observation checked: images by slot (blank where missing), which are present,
        the prompt text. Raises ValueError saying what is wrong."""
        if not isinstance(obs.images, dict):
            raise ValueError(f'images must be a dict of slot -> image, got '
                             f'{type(obs.images).__name__}')
        unknown = sorted(set(obs.images) - set(self.slots))
        if unknown:
            raise ValueError(f'unknown image slots {unknown}; the model has {list(self.slots)}')
        size = self.model_cfg.vision.image_size
        images, present = [], []
        for slot in self.slots:
            img = obs.images.get(slot)
            present.append(img is not None)
            if img is not None:
                img = prepare_image(crop(np.asarray(img), self.model_cfg.crop_of(slot)),
                                    size, size, self.conventions)
            images.append(self._blank if img is None else img)
        state = np.asarray(obs.state, dtype=np.float32)
        if state.ndim != 1 or not np.all(np.isfinite(state)):
            raise ValueError(f'state must be a finite vector, got shape {state.shape}')
        want = self.state_dim
        if want is not None and (len(state) > want or
                                 (self.conventions == 'lerobot' and len(state) != want)):
            raise ValueError(f'state has {len(state)} dims; the checkpoint expects {want}')
        if self.norm is not None:
            state = self.norm.normalize_state(state)
        if self.cfg.prompt_format == 'pi05':
            text = action_prompt(obs.prompt, state)
        else:
            text = subtask_prompt(obs.prompt)
        return images, present, text

    def _noise_for(self, noise: np.ndarray | None, generator: torch.Generator,
                   stamp: float, robot: str = '') -> torch.Tensor:
        """[1, horizon, model action width] on the host: ``noise`` checked, or drawn (from
        the frame's stamp with frame_noise, else from ``generator``)."""
        shape = (self.action_horizon, self.model_action_dim)
        if noise is None:
            if self.cfg.frame_noise:
                generator = frame_generator(self.cfg.seed, robot, stamp)
            return torch.randn(1, *shape, generator=generator)
        noise = np.asarray(noise, dtype=np.float32)
        if noise.shape != shape or not np.all(np.isfinite(noise)):
            raise ValueError(f'noise must be a finite {list(shape)} array (horizon x model '
                             f'action width), got shape {list(noise.shape)}')
        return torch.from_numpy(noise)[None]

    def actions_in(self, actions: np.ndarray) -> torch.Tensor:
        """The inverse of actions_out: the robot's dims, unnormalised -> model space, zero
        past the robot's dims."""
        a = np.asarray(actions, dtype=np.float64)
        if self.norm is not None:
            a = self.norm.normalize_actions(a)
        out = torch.zeros(a.shape[0], self.model_action_dim)
        out[:, :a.shape[1]] = torch.from_numpy(np.asarray(a, dtype=np.float32))
        return out

    def actions_out(self, actions: torch.Tensor) -> np.ndarray:
        """Model actions -> the robot's dims, unnormalised (cut first, as LeRobot does;
        openpi's unnormalisation leaves dims past its stats alone, so the order is moot)."""
        a = actions.float().cpu().numpy()[..., :self.action_dim]
        if self.norm is not None:
            a = self.norm.unnormalize_actions(a)
        return a

    # -- one frame -------------------------------------------------------------------------

    def step(self, obs: Observation, narrate: bool = False, on_actions=None,
             max_new_tokens: int | None = None, noise: np.ndarray | None = None,
             handover: Handover | None = None) -> FrameResult:
        """Run one frame of one robot: step_fleet for a fleet of one, whose mistakes raise.

        ``on_actions`` gets the chunk as soon as it exists, before language. ``narrate``
        starts a language request from this frame's prefill; ``max_new_tokens`` caps it
        below the configured maximum (the KV rows are sized for that maximum). The
        questions asked since the last frame start from the same prefill.
        ``noise`` [action_horizon, model_action_dim] replaces the seeded draw (which is then
        not advanced), to reproduce another implementation's sample. With ``rtc`` on,
        ``handover`` says where this chunk joins the previous one (the last this engine
        returned), and the chunk is sampled to continue it. A wrong input raises ValueError;
        an exception of the model or of ``on_actions`` is raised as it is.
        """
        inp = RobotInput(obs, narrate=narrate, max_new_tokens=max_new_tokens, noise=noise,
                         handover=handover)
        ready = {'': self._robot_inputs('', inp)}
        result = FleetResult()
        hook = None if on_actions is None else (lambda _name, chunk: on_actions(chunk))
        self._fleet_frame(ready, hook, result, alone=True)
        out = result.results['']
        out.events = result.events.get('', [])
        return out

    # -- frames of several robots ----------------------------------------------------------

    def add_robot(self, name: str, max_rows: int | None = None, seed: int | None = None):
        """Serve ``name`` in step_fleet. ``max_rows``: KV rows its requests may hold at once
        (None: the config's robot_rows; 0: max_requests // robots added); ``seed`` seeds its
        noise (None: derived from the engine's seed and the name)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f'a robot needs a non-empty name, got {name!r}')
        if name in self._robots:
            raise ValueError(f'robot {name!r} is already added')
        rows = self.cfg.robot_rows if max_rows is None else max_rows
        if not 0 <= rows <= self.cfg.max_requests:
            raise ValueError(f'max_rows must be in [0, {self.cfg.max_requests}], got {rows}')
        if seed is None:
            seed = self.cfg.seed * 1_000_003 + zlib.crc32(name.encode())
        with self._lock:
            self._robots[name] = _Robot(name, seed)
            self.scheduler.caps[name] = rows

    @property
    def robots(self) -> tuple[str, ...]:
        return tuple(self._robots)

    def _all(self) -> list[_Robot]:
        """step()'s robot and step_fleet's."""
        return [self._one, *self._robots.values()]

    @property
    def guided(self) -> int:
        """Frames of step()'s robot sampled with real-time chunking's guidance."""
        return self._one.guided

    def robot_stats(self, name: str) -> dict:
        """One robot's part of the engine, for its diagnostics (safe from any thread)."""
        rb = self._robots[name]
        with self._stats_lock:
            snap = self._snap['robots'].get(name) or dict(
                kv_rows=0, kv_row_cap=self.scheduler.cap(name), active_requests=0,
                pending_requests=0)
            out = dict(frames=rb.frames, errors=rb.errors, rtc_frames=rb.guided, **snap)
        with self._lock:
            out['questions_waiting'] = len(rb.inbox)
        return out

    def chunk_seconds(self, robots: int) -> float | None:
        """Expected seconds from a frame's start to its chunks, for a frame of ``robots``
        (the slowest of the recent frames of that size, or scaled from another size); None
        before any frame of step_fleet."""
        ms = self._chunk_ms.estimate(robots)
        return None if ms is None else ms / 1e3

    def step_fleet(self, inputs: dict[str, RobotInput], on_actions=None) -> FleetResult:
        """One frame for every robot in ``inputs`` (added robots, at most cfg.robots).

        Each robot's inputs are checked on their own: a robot whose observation, noise,
        handover or token cap is wrong is left out with its reason in ``errors`` and the
        others run. Then one prefill of every observation, one denoise, and
        ``on_actions(robot, chunk)`` for each robot as soon as the batch's denoise ends,
        then one decode batch over every robot's requests (each robot's narration, if
        ``narrate``, and the questions asked about it). Should the model fail on the batch,
        each robot is run alone, so that a failure stays with the robot it belongs to.
        Robots past ``cfg.robots`` valid ones are left out with an error.
        """
        result = FleetResult()
        ready = {}  # name -> (robot, input, host tensors, guide)
        for name, inp in inputs.items():
            try:
                ready[name] = self._robot_inputs(name, inp)
            except Exception as e:  # noqa: BLE001 - whatever it is, it is this robot's
                result.errors[name] = str(e)
                if name in self._robots:
                    self._robots[name].errors += 1
                continue
            if len(ready) > self.cfg.robots:
                del ready[name]
                result.errors[name] = (f'the frame is full: this engine takes at most '
                                       f'{self.cfg.robots} robots a frame (robots)')
        if ready:
            self._fleet_frame(ready, on_actions, result)
        for name, events in result.events.items():
            if name in result.results:
                result.results[name].events = events
        return result

    def _robot_inputs(self, name: str, inp: RobotInput):
        rb = self._one if name == '' else self._robots.get(name)
        if rb is None:
            raise ValueError(f'unknown robot {name!r}; this engine has {sorted(self._robots)}')
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
        images, present, text = self._inputs(inp.obs)
        if rb.prompt is None or rb.prompt[0] != text:
            tokens, mask = self.tokenizer.tokenize(text, self.model_cfg.max_token_len)
            rb.prompt = (text, (torch.from_numpy(tokens), torch.from_numpy(mask)))
        noise = self._noise_for(inp.noise, rb.noise, inp.obs.stamp, name)[0]
        guide = self._guide_to(inp.handover, rb.last)
        return rb, inp, (torch.stack(images), present, *rb.prompt[1], noise), guide

    def _batch(self, ready: dict) -> Frame:
        """The model's inputs of every robot in ``ready``, batched on the device."""
        names = list(ready)
        b = len(names)
        dev, dtype = self.device, self.cache.kv.dtype
        parts = [ready[n][2] for n in names]
        if self._pinned is not None:
            torch.stack([p[0] for p in parts], out=self._pinned[:b])
            images = self._pinned[:b].to(dev, non_blocking=True).to(dtype)
        else:
            images = torch.stack([p[0] for p in parts]).to(dev, dtype)
        guides = [ready[n][3] for n in names]
        return Frame(stamp=max(ready[n][1].obs.stamp for n in names), images=images,
                     image_mask=torch.tensor([p[1] for p in parts], device=dev),
                     tokens=torch.stack([p[2] for p in parts]).to(dev),
                     token_mask=torch.stack([p[3] for p in parts]).to(dev),
                     noise=torch.stack([p[4] for p in parts]).to(dev, dtype),
                     guide=None if all(g is None for g in guides) else BatchGuide(
                         guides, self.action_horizon, self.model_action_dim,
                         self.cfg.rtc_beta))

    def _fleet_frame(self, ready: dict, on_actions, result: FleetResult,
                     alone: bool = False) -> None:
        """One frame of the robots in ``ready``. ``alone`` (step's robot): an exception of
        the model or of ``on_actions`` is raised as it is instead of becoming the robot's
        error, and questions the frame did not start go back to its inbox."""
        names = list(ready)
        b = len(names)
        guides = [ready[n][3] for n in names]
        f = self._batch(ready)
        requests, narrations = [], {}
        limit = self.cfg.max_new_tokens
        self._owner.acquire()
        try:
            with self._lock:
                self._cancel_requested()
                for n in names:
                    rb, inp = ready[n][0], ready[n][1]
                    asks, rb.inbox = rb.inbox, []
                    for r in asks:
                        r.stamp = inp.obs.stamp
                    if inp.narrate:
                        narrations[n] = Request(
                            stamp=inp.obs.stamp, prompt=inp.obs.prompt,
                            max_new_tokens=inp.max_new_tokens or limit,
                            stop_at_eos=self.cfg.stop_at_eos, temperature=self.cfg.temperature,
                            seed=self.cfg.seed, eos_id=self.tokenizer.eos_id, robot=n)
                        asks = asks + [narrations[n]]
                    requests.append(asks)
            chunks, failed = {}, {}

            def hook(actions):
                for i, n in enumerate(names):
                    chunks[n] = self.actions_out(actions[i])
                if on_actions is not None:
                    for n in names:
                        if alone:
                            on_actions(n, chunks[n])
                            continue
                        try:
                            on_actions(n, chunks[n])
                        except Exception as e:  # noqa: BLE001 - one robot's, not the frame's
                            failed[n] = f'on_actions failed: {e!r}'

            try:
                out = self.scheduler.step_batch(f, requests, hook)
            except BatchError as e:
                self._batch_failed(ready, requests, e, result)
                if b == 1:
                    ready[names[0]][0].errors += 1
                    if alone:
                        raise e.__cause__ from None
                    result.errors[names[0]] = f'the model failed: {e.__cause__!r}'
                    return
                ok = False
            except BaseException:
                # on_actions of step's robot: the frame's questions not started wait again.
                self._requeue(ready, requests)
                raise
            else:
                ok = True
            if ok:
                events = self._events(out)
                with self._lock:
                    self._cancel_requested()
                    events += [self._final(r) for r in self._ended]
                    self._ended = []
        finally:
            self._owner.release()
        if not ok:
            # Each robot alone: the one the model fails on fails, the others run.
            for n in names:
                self._fleet_frame({n: ready[n]}, on_actions, result)
            return
        for ev in events:
            result.events.setdefault(ev.robot, []).append(ev)
        timing = dict(out.timing)
        for i, n in enumerate(names):
            rb, inp = ready[n][0], ready[n][1]
            if self.cfg.rtc:
                rb.last = out.actions[i].clone()
                rb.guided += guides[i] is not None
            rb.frames += 1
            r = FrameResult(stamp=inp.obs.stamp, actions=chunks.get(n), timing=timing,
                            robot=n)
            nr = narrations.get(n)
            if nr is not None and nr.reason == 'rejected':
                whose = f'robot {n!r} frame' if n else 'frame'
                r.rejected = (f'narration request of {whose} {inp.obs.stamp:.3f} rejected: '
                              f'{nr.note}')
            if n in failed:
                result.errors[n] = failed[n]
            else:
                result.results[n] = r
        result.timing = timing
        self._chunk_ms.observe(b, timing['chunk_ms'])
        self._frame_done(timing['frame_ms'], len(out.tokens))

    def _frame_done(self, frame_ms: float, tokens: int) -> None:
        with self._owner:  # a cancel from another thread may change the scheduler
            snap = self._scheduler_snapshot()
        with self._stats_lock:
            self.frames += 1
            self._recent.append((time.monotonic(), frame_ms, tokens))
            self._snap = snap

    def _refresh(self) -> None:
        """A new snapshot for stats(); the caller owns the scheduler."""
        snap = self._scheduler_snapshot()
        with self._stats_lock:
            self._snap = snap

    def _scheduler_snapshot(self) -> dict:
        s = self.scheduler
        active = [r.robot for r in s.active]
        pending = [r.robot for r, _ in s.pending]
        robots = {n: dict(kv_rows=s.held(n), kv_row_cap=s.cap(n),
                          active_requests=active.count(n), pending_requests=pending.count(n))
                  for n in self._robots}
        return dict(active_requests=len(active), pending_requests=len(pending),
                    deadline_misses=s.deadline_misses, rejected_requests=s.rejected,
                    dropped_requests=s.dropped, robots=robots)

    def _batch_failed(self, ready, requests, e: BatchError, result: FleetResult) -> None:
        """A failed batch: what it ended is reported, its questions not started go back to
        their robots' inboxes (a retry or the next frame starts them)."""
        for ev in self._events(e.out):
            result.events.setdefault(ev.robot, []).append(ev)
        self._requeue(ready, requests)

    def _requeue(self, ready, requests) -> None:
        waiting = {r.id for r, _ in self.scheduler.pending}
        with self._lock:
            for n, rs in zip(ready, requests, strict=True):
                again = [r for r in rs if r.kind == 'question' and r.row is None
                         and not r.finished and r.id not in waiting]
                ready[n][0].inbox[:0] = again

    def _guide_to(self, handover: Handover | None, last: torch.Tensor | None) -> Guide | None:
        """The guide joining the chunk to ``last`` (model space) where ``handover`` says."""
        if not self.cfg.rtc or handover is None or last is None:
            return None
        if handover.start < 0 or handover.delay < 0:
            raise ValueError(f'handover steps must be >= 0, got {handover}')
        h = self.action_horizon
        if handover.start >= h:
            return None  # the previous chunk has run out: there is nothing to join
        # Past the overlap there is nothing to freeze to.
        delay = min(handover.delay, h - handover.start)
        if handover.previous is None:
            return Guide.make(last, handover.start, delay, self.cfg.rtc_beta,
                              columns=self.action_dim)
        prev = np.asarray(handover.previous, dtype=np.float64)
        if prev.ndim != 2 or prev.shape[0] != h or not 1 <= prev.shape[1] <= self.action_dim:
            raise ValueError(f'handover.previous must be [{h}, <= {self.action_dim}], '
                             f'got {prev.shape}')
        return Guide.make(self.actions_in(prev), handover.start, delay, self.cfg.rtc_beta,
                          columns=prev.shape[1])

    # -- questions -------------------------------------------------------------------------

    def ask(self, question: str, max_new_tokens: int = 0, prompt_format: str = '',
            robot: str | None = None) -> int:
        """Ask a question about the next frame; returns its request id at once.

        The question, in ``prompt_format`` (``{question}`` marks where; '' = QUESTION_FORMAT),
        is appended after that frame's shared prefix in the request's own KV row, and the
        answer is decoded with the other requests; its events carry the id. ``max_new_tokens``
        0 means ``budget``, the most a question may take (``cfg.max_new_tokens`` unless
        lowered while running). ``robot`` (one added with add_robot) asks about that robot's
        next frame of step_fleet; None, about the next frame of step. Raises ValueError,
        saying why, for a question that cannot be asked; a KV row is only sought at the
        frame (see the admission policy).
        """
        question = question.strip()
        if not question:
            raise ValueError('the question is empty')
        limit = self.budget
        if not 0 <= max_new_tokens <= limit:
            raise ValueError(f'max_new_tokens must be in [0, {limit}] (0 = {limit}), got '
                             f'{max_new_tokens}')
        fmt = prompt_format or QUESTION_FORMAT
        room = self.cfg.max_question_tokens
        if room == 0:
            raise ValueError('this engine takes no questions (max_question_tokens is 0)')
        # Checked before tokenizing, which costs time in proportion to the text: no token
        # covers more than the tokenizer's longest piece, so longer text cannot fit (text
        # the tokenizer would normalise shorter, a run of spaces, is refused too).
        chars = len(question) + len(fmt) - len('{question}')
        most = room * self.tokenizer.longest_piece
        if chars > most:
            raise ValueError(f'the question takes {chars} characters with its format, over '
                             f'the {most} taken for max_question_tokens {room} (a token is '
                             f'{self.tokenizer.longest_piece} characters at most): refused '
                             'before tokenizing')
        if fmt.count('{question}') != 1:
            raise ValueError(f'prompt_format must hold {{question}} exactly once, got '
                             f'{fmt[:100]!r}')
        tokens = self.tokenizer.encode(fmt.replace('{question}', question), bos=False)
        if len(tokens) > room:
            raise ValueError(f'the question takes {len(tokens)} tokens; at most {room} fit '
                             f'(max_question_tokens)')
        if robot is not None and robot not in self._robots:
            raise ValueError(f'unknown robot {robot!r}; this engine has {sorted(self._robots)}')
        # Stamped with the frame that starts it.
        r = Request(stamp=0.0, prompt=question, max_new_tokens=max_new_tokens or limit,
                    stop_at_eos=self.cfg.stop_at_eos, temperature=self.cfg.temperature,
                    seed=self.cfg.seed, eos_id=self.tokenizer.eos_id, kind='question',
                    extension=tokens, robot=robot or '')
        with self._lock:
            (self._one if robot is None else self._robots[robot]).inbox.append(r)
        return r.id

    def withdraw(self, request_id: int) -> bool:
        """Take back a question that still waits for its frame: True when it was waiting
        (it is gone, with no event), False when a frame took it already (or it is unknown),
        whose events then come as usual."""
        with self._lock:
            for inbox in [rb.inbox for rb in self._all()]:
                for i, r in enumerate(inbox):
                    if r.id == request_id:
                        del inbox[i]
                        return True
        return False

    def cancel(self, request_id: int) -> list[TokenEvent]:
        """End a question or narration by id, freeing its KV row.

        Between frames this happens now and the request's last event is returned. During a
        frame the frame does it before it ends (no later admission sees the row taken) and
        the event comes with that frame's; then, as for an id that is not running, nothing
        is returned.
        """
        with self._lock:
            for inbox in [rb.inbox for rb in self._all()]:
                for i, r in enumerate(inbox):
                    if r.id == request_id:
                        del inbox[i]
                        r.end('cancelled')
                        r.note = 'cancelled by its caller before it started'
                        return [self._final(r)]
            if not self._owner.acquire(blocking=False):
                self._cancels.add(request_id)
                return []
        try:
            r = self.scheduler.cancel(request_id)
            self._refresh()  # its row is free now, not at the next frame
            return [self._final(r)] if r is not None else []
        finally:
            self._owner.release()

    def _cancel_requested(self) -> None:
        """Cancels asked for during a frame; the caller owns the scheduler and holds _lock."""
        for rid in self._cancels:
            r = self.scheduler.cancel(rid)
            if r is not None:
                self._ended.append(r)
        self._cancels.clear()

    def _events(self, out) -> list[TokenEvent]:
        events = []
        for r in out.queued:
            if r.kind == 'question':
                events.append(TokenEvent(r.id, r.stamp, '', '', 0, False, reason='queued',
                                         message='every KV row is busy: waiting for one '
                                         '(admission wait)', kind=r.kind, robot=r.robot))
        for r, t, n, last in out.tokens:
            stream = self._streams.setdefault(r.id, self.tokenizer.stream())
            delta = stream.feed(t)
            if last:
                delta += stream.finish()
                del self._streams[r.id]
            events.append(TokenEvent(r.id, r.stamp, delta, stream.text, n, last,
                                     reason=r.reason if last else '', kind=r.kind,
                                     robot=r.robot))
        for r in out.finished:
            # A refused narration is reported by FrameResult.rejected.
            if r.cancelled and (r.kind == 'question' or r.reason != 'rejected'):
                events.append(self._final(r))
        return events

    def _final(self, r: Request) -> TokenEvent:
        """The last event of a request that ended early."""
        stream = self._streams.pop(r.id, None)
        return TokenEvent(r.id, r.stamp, '', stream.text if stream else '', len(r.tokens),
                          True, True, reason=r.reason, message=r.note, kind=r.kind,
                          robot=r.robot)

    def cancel_all(self) -> list[TokenEvent]:
        with self._owner, self._lock:
            ended = self._ended + self.scheduler.cancel_all()
            for rb in self._all():
                for r in rb.inbox:
                    r.end('cancelled')
                    ended.append(r)
                rb.inbox = []
            self._ended = []
            self._cancels.clear()
            for r in ended:
                r.note = r.note or 'every request cancelled'
            self._refresh()  # diagnostics after a deactivate: no frame comes to do it
            return [self._final(r) for r in ended]

    def stats(self) -> dict:
        """The engine's figures for diagnostics; safe from any thread (the scheduler's part
        is the snapshot taken as the last frame ended)."""
        with self._stats_lock:
            recent = list(self._recent)
            snap = dict(self._snap)
            frames = self.frames
        with self._lock:
            waiting = sum(len(rb.inbox) for rb in self._all())
        ms = np.array([m for _, m, _ in recent]) if recent else np.zeros(1)
        tokens = sum(n for _, _, n in recent)
        return dict(
            frames=frames,
            action_hz=self.action_horizon * 1000.0 / ms.mean() if recent else 0.0,
            frame_ms_p50=float(np.percentile(ms, 50)),
            frame_ms_p99=float(np.percentile(ms, 99)),
            tokens_per_s=tokens * 1000.0 / ms.sum() if recent else 0.0,
            active_requests=snap['active_requests'],
            pending_requests=snap['pending_requests'],
            questions_waiting=waiting,
            kv_bytes=self.cache.total_bytes,
            kv_bytes_per_slot=self.cache.bytes_per_slot,
            deadline_misses=snap['deadline_misses'],
            rtc_frames=sum(rb.guided for rb in self._all()),
            rejected_requests=snap['rejected_requests'],
            dropped_requests=snap['dropped_requests'],
        )


def frame_generator(seed: int, robot: str, stamp: float) -> torch.Generator:
    """The generator of a frame's noise under frame_noise: a hash of the seed, the robot's
    name ('' for a node's one robot) and the stamp to the microsecond (a stamp read from
    the same message is the same float live and offline; the rounding absorbs the last bit
    of two ways of computing it)."""
    key = f'{seed}/{robot}/{round(stamp * 1e6)}'.encode()
    return torch.Generator().manual_seed(
        int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), 'little'))


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


def _load(cfg: EngineConfig, device: torch.device) -> Checkpoint:
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    if cfg.checkpoint:
        path = Path(cfg.checkpoint)
        if not path.exists():
            raise FileNotFoundError(f'checkpoint not found: {path}')
        ckpt = open_checkpoint(path, load_config(cfg.model) if cfg.model else None, device,
                               dtype, cfg.asset_id or None, cfg.normalize,
                               cfg.conventions or None)
    else:
        torch.manual_seed(cfg.seed)
        conventions = cfg.conventions or 'openpi'
        model = random_model(load_config(cfg.model or 'small', time_grid=conventions), device,
                             dtype)
        mc = model.cfg
        ckpt = Checkpoint(model, None, 'random', conventions, tuple(mc.image_slots), None,
                          mc.action_dim, mc.action_horizon, mc.action_horizon, None)
    ckpt.model.eval()
    return ckpt
