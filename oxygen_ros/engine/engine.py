"""The engine: robot-agnostic observations in, action chunks and streamed text out.

It owns the model, the tokenizer, the KV cache and the scheduler; ``ModelInputs`` turns an
``Observation`` (images by model slot, state, prompt) into model tensors and chunks back into
the robot's numbers, the ``Runner`` runs frames, ``Questions`` takes questions from any
thread. Nothing here knows about ROS.

One engine serves one robot or several (``add_robot``): a frame batches every robot it is
given, and is two calls, ``actions`` (every robot's chunk) then ``language`` (one decode
batch over every robot's requests), so that the caller sends the chunks out between them.
``step_fleet`` and ``step`` (one robot, whose mistakes raise) make the two calls for callers
with nothing to do in between. Requests carry their robot; a robot's questions wait for
that robot's next frame.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import zlib

import numpy as np
import torch

from ..model.checkpoint import Checkpoint, checkpoint_tokenizer
from ..model.processing import NormStats
from ..model.rtc import Handover
from ..model.tokenizer import Tokenizer, prompt_tokens
from .baselines import SCHEDULERS
from .compiled import Programs
from .config import EngineConfig
from .inputs import ModelInputs
from .io import FleetResult, FrameResult, Observation, RobotInput, TokenEvent
from .kv_cache import KVCache
from .loading import load
from .model_runner import ModelRunner
from .parallel import ParallelScheduler
from .questions import Questions
from .runner import OpenFrame, RobotState, Runner
from .scheduler import Frame

logger = logging.getLogger('oxygen_ros.engine')

# What apply() may change while running, and what each changes.
LIVE = ('temperature', 'decode_k', 'max_new_tokens')


class Engine:
    """``model`` (with ``norm_stats``) bypasses loading: the model's slots and action width
    are used, in openpi's conventions unless the config says otherwise. ``log`` (anything
    with ``info`` and ``warning``, as logging's and rclpy's loggers) hears what start-up
    takes long for (compiling the model) and what fails there; default: logging's."""

    def __init__(self, cfg: EngineConfig | None = None, model=None, tokenizer=None,
                 norm_stats: NormStats | None = None, log=None):
        self.cfg = cfg = cfg or EngineConfig()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = torch.device(cfg.device)
        if model is None:
            self.checkpoint = load(cfg, self.device)
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
                phase_timing=cfg.phase_timing, runner=self._runner(log))
        self.inputs = ModelInputs(cfg, self.checkpoint, self.tokenizer, self.device, dtype)
        # The robots: '' is step's, a fleet of one on the same path as the added ones (it
        # is not one of them; its noise is the engine's seed's own stream).
        self._robots: dict[str, RobotState] = {'': RobotState('', cfg.seed)}
        # Whoever runs the scheduler holds _owner (a frame from actions() to language()).
        self._owner = threading.Lock()
        self.questions = Questions(cfg, self.tokenizer, self.scheduler, self._robots,
                                   self._owner, lambda: self.runner.refresh())
        self.runner = Runner(cfg, self.scheduler, self.cache, self.inputs, self.questions,
                             self._robots, self._owner, budget)

    def _runner(self, log=None) -> ModelRunner:
        """The model runner of the config: CUDA graphs with ``graphs``, compiled programs
        where ``compile`` pays (float32 on a CPU), else eager."""
        cfg, model = self.cfg, self.model
        if cfg.graphs:
            backend, programs = 'graphs', None
        elif cfg.compile and model.device.type == 'cpu' and model.dtype == torch.float32:
            backend = 'compiled'
            log = log or logger
            programs = Programs(model, cfg.compile_cache or None, torch.get_num_threads(),
                                log.info)
            try:
                programs.load()
            except Exception as e:  # noqa: BLE001 - no compiler, a full disk, torch's own
                # The model still runs, slower: said loudly rather than refusing to start.
                log.warning(f'compiling the model failed ({type(e).__name__}: {e}); it runs '
                            f'eagerly (compile: false skips compiling)')
                backend, programs = 'eager', None
        else:
            backend, programs = 'eager', None
        return ModelRunner(model, self.cache, self.denoise_steps, backend, cfg.robots,
                           programs)

    @property
    def backend(self) -> str:
        """How the model runs: 'eager', 'graphs' or 'compiled' (model_runner.py)."""
        runner = getattr(self.scheduler, 'runner', None)
        return runner.backend if runner is not None else 'eager'

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
    def rtc_unguided(self) -> tuple[int, ...]:
        """Action dims real-time chunking leaves unguided (ModelInputs.unguided)."""
        return self.inputs.unguided

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

    def frame(self, obs: Observation, noise: np.ndarray | None = None) -> Frame:
        """The model's inputs for one observation of step()'s robot, as a frame runs them
        (its noise drawn from that robot's stream unless given)."""
        return self.inputs.batch([self.runner.prepare('', RobotInput(obs, noise=noise))])

    def actions_in(self, actions: np.ndarray) -> torch.Tensor:
        return self.inputs.actions_in(actions)

    def actions_out(self, actions: torch.Tensor) -> np.ndarray:
        return self.inputs.actions_out(actions)

    # -- live settings ---------------------------------------------------------------------

    def apply(self, name: str, value) -> None:
        """A setting changed while running (one of LIVE), already checked by the caller:
        the temperature of requests started from now on, the decode steps of the next
        frame, the token budget of questions asked from now on (and their default)."""
        if name == 'temperature':
            self.cfg = dataclasses.replace(self.cfg, temperature=value)
            self.questions.cfg = self.runner.cfg = self.cfg
        elif name == 'decode_k':
            self.scheduler.decode_k = value
        elif name == 'max_new_tokens':
            self.questions.budget = value
        else:
            raise ValueError(f'{name} cannot change while running; live: {LIVE}')

    # -- frames ----------------------------------------------------------------------------

    def actions(self, inputs: dict[str, RobotInput]) -> OpenFrame:
        """The first half of a frame for every robot in ``inputs`` ('' is step's robot;
        added ones, at most cfg.robots): its ``chunks`` by robot, in the robot's units.
        Each robot's inputs are checked on their own: one whose observation, noise,
        handover or token cap is wrong is left out with its reason in ``result.errors``
        and the others run. ``language(frame)`` must follow (or ``abandon(frame)``): until
        then the frame owns the scheduler."""
        return self.runner.actions(inputs)

    def language(self, frame: OpenFrame) -> FleetResult:
        """The second half: the frame's requests (each robot's narration if ``narrate``, the
        questions asked about it) start from its prefill, then one decode batch over every
        robot's requests. The result has every robot's events of this frame, whether or
        not it was in the frame (requests decode across frames)."""
        return self.runner.language(frame)

    def abandon(self, frame: OpenFrame) -> None:
        """End a frame without its language: its questions wait for the next frame."""
        self.runner.abandon(frame)

    def step_fleet(self, inputs: dict[str, RobotInput], on_actions=None) -> FleetResult:
        """actions, ``on_actions(robot, chunk)`` for each robot (one that raises is that
        robot's error), language."""
        frame = self.actions(inputs)
        failed = {}
        for name, chunk in frame.chunks.items():
            try:
                if on_actions is not None:
                    on_actions(name, chunk)
            except Exception as e:  # noqa: BLE001 - one robot's, not the frame's
                failed[name] = f'on_actions failed: {e!r}'
        result = self.language(frame)
        for name, why in failed.items():
            result.results.pop(name, None)
            result.errors[name] = why
        return result

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
        frame = self.runner.actions({'': inp}, alone=True)
        if on_actions is not None:
            try:
                on_actions(frame.chunks[''])
            except BaseException:
                self.abandon(frame)
                raise
        result = self.language(frame)
        out = result.results['']
        out.events = result.events.get('', [])
        return out

    # -- robots ----------------------------------------------------------------------------

    def add_robot(self, name: str, max_rows: int | None = None, seed: int | None = None):
        """Serve ``name`` in frames. ``max_rows``: KV rows its requests may hold at once
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
        with self.questions.lock:
            self._robots[name] = RobotState(name, seed)
            self.cache.caps[name] = rows

    @property
    def robots(self) -> tuple[str, ...]:
        return tuple(n for n in self._robots if n)

    @property
    def guided(self) -> int:
        """Frames of step()'s robot sampled with real-time chunking's guidance."""
        return self._robots[''].guided

    def chunk_seconds(self, robots: int) -> float | None:
        """Expected seconds from a frame's start to its chunks, for a frame of ``robots``
        (the slowest of the recent frames of that size, or scaled from another size); None
        before any frame."""
        ms = self.runner.chunk_ms.estimate(robots)
        return None if ms is None else ms / 1e3

    # -- questions -------------------------------------------------------------------------

    def ask(self, question: str, max_new_tokens: int = 0, prompt_format: str = '',
            robot: str | None = None) -> int:
        """Ask a question about the next frame; returns its request id at once.

        The question, in ``prompt_format`` (``{question}`` marks where; '' = QUESTION_FORMAT),
        is appended after that frame's shared prefix in the request's own KV row, and the
        answer is decoded with the other requests; its events carry the id. ``max_new_tokens``
        0 means the budget, the most a question may take (``cfg.max_new_tokens`` unless
        lowered while running). ``robot`` (one added with add_robot) asks about that robot's
        next frame; None, about the next frame of step's robot. Raises ValueError, saying
        why, for a question that cannot be asked; a KV row is only sought at the frame (see
        the admission policy).
        """
        return self.questions.ask(question, max_new_tokens, prompt_format, robot)

    def withdraw(self, request_id: int) -> bool:
        """Take back a question that still waits for its frame: True when it was waiting
        (it is gone, with no event), False when a frame took it already (or it is unknown),
        whose events then come as usual."""
        return self.questions.withdraw(request_id)

    def cancel(self, request_id: int) -> list[TokenEvent]:
        """End a question or narration by id, freeing its KV row.

        Between frames this happens now and the request's last event is returned. During a
        frame the frame does it before it ends (no later admission sees the row taken) and
        the event comes with that frame's; then, as for an id that is not running, nothing
        is returned.
        """
        return self.questions.cancel(request_id)

    def cancel_all(self) -> list[TokenEvent]:
        return self.questions.cancel_all()

    # -- figures ---------------------------------------------------------------------------

    def robot_stats(self, name: str) -> dict:
        """One robot's part of the engine, for its diagnostics (safe from any thread)."""
        return self.runner.robot_stats(name)

    @property
    def frames(self) -> int:
        return self.runner.frames

    def stats(self) -> dict:
        """The engine's figures for diagnostics; safe from any thread (the scheduler's part
        is the snapshot taken as the last frame ended)."""
        return self.runner.stats(self.action_horizon)
