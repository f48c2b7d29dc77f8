"""What runs each frame: one prefill, the action chunk by its deadline, then language.

A frame is decided first and then run: ``plan(frame, requests)`` chooses which requests get KV
rows and where the observations go (no model call); ``act(plan)`` prefills and denoises, giving
the chunks; the caller sends them out; ``speak(plan)`` starts the frame's requests and decodes.
The modes share that interface and the same model kernels, so they differ only in
scheduling. Every request a frame starts (narration,
questions) grows from that frame's one prefill: the first admitted one owns the prefilled
row, the others get a copy of it, and a request with tokens of its own (a question) has them
appended to its row in one extension pass, after the action chunk is out.

- ``isolated``: the baseline. Prefill for the actions, then a second prefill of the same
  observation for each of the frame's requests, decoded to the end inside the frame.
- ``shared_kv``: one prefill feeds the actions and the request, decoded to the end in-frame.
- ``oxygen``: one prefill feeds the actions and the request; then ``k`` decode steps for
  every active request in one batch, requests living across frames (continuous batching).
  With ``decode_k = 0`` k adapts each frame: as many steps as keep every active request on
  course to finish before the KV rows run out, never more than fit in what is left of the
  frame budget. The deadline comes first; language gets the slack it needs, and no more,
  so frames stay short and the action rate high.

A frame serves one robot or several: one prefill of all their observations
(one scratch row each), one denoise, every chunk out at once, then the same language phase
over every robot's requests. KV rows come from the one pool, each robot holding at most its
cap (``caps``), and the admission policy applies per robot: a robot at its cap drops,
refuses or queues its own requests, never another robot's.

(The naive two-copies-in-two-threads baseline lives in ``parallel.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.rtc import Guide
from .admission import Admission
from .budget import AdaptiveK, Clock
from .kv_cache import KVCache
from .model_runner import ModelRunner
from .requests import Request

MODES = ('oxygen', 'shared_kv', 'isolated')  # OxyGen, then the paper's baselines


@dataclass
class Frame:
    """Model-ready inputs of one observation (batch of one)."""

    stamp: float
    images: torch.Tensor  # [1, slots, 3, H, W] in [-1, 1]
    image_mask: torch.Tensor  # [1, slots] bool
    tokens: torch.Tensor  # [1, L] long
    token_mask: torch.Tensor  # [1, L] bool
    noise: torch.Tensor  # [1, horizon, action_dim]
    guide: Guide | None = None  # real-time chunking towards the chunk being executed

    def part(self, i: int) -> Frame:
        """Observation ``i`` of a batched frame, as a frame of its own (views, no copies)."""
        return Frame(self.stamp, self.images[i:i + 1], self.image_mask[i:i + 1],
                     self.tokens[i:i + 1], self.token_mask[i:i + 1], self.noise[i:i + 1])


@dataclass
class FrameOutput:
    actions: torch.Tensor  # [horizon, action_dim], normalised model space
    # (request, token, tokens so far, last) in emission order.
    tokens: list[tuple[Request, int, int, bool]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended this frame, any reason
    rejected: list[Request] = field(default_factory=list)  # refused a row (also in finished)
    queued: list[Request] = field(default_factory=list)  # waiting for a row (admission wait)
    timing: dict = field(default_factory=dict)


@dataclass
class FramePlan:
    """A frame as decided (Scheduler.plan), carried through its model calls (act, then
    speak). Between act and speak the chunks go out; nothing else runs the scheduler."""

    frame: Frame
    requests: list[list[Request]]  # the requests each observation starts
    born: list[tuple[int, Request, int]]  # (observation, request, KV row) admitted now
    block: slice  # the KV rows the observations are prefilled into
    out: FrameOutput
    t0: float  # ms, the scheduler's clock
    hidden: torch.Tensor | None = None  # after act: the state after each prompt
    times: list[float] = field(default_factory=list)  # after act: prefill and denoise ends
    language: object = None  # a variant's language under way since act (parallel.py)


class BatchError(RuntimeError):
    """A batched frame failed in the model; ``out`` holds what it had already ended
    (requests dropped or refused at admission), whose callers must still hear of it."""

    def __init__(self, out: FrameOutput):
        super().__init__('the batched frame failed')
        self.out = out


class Scheduler:
    """OxyGen's frame: one prefill per observation, its chunk, then its language requests
    from that same prefill, and k decode steps a frame for every open request of every frame
    in one batch. The paper's baselines are variants of it (baselines.py)."""

    mode = 'oxygen'

    def __init__(self, model, cache: KVCache, denoise_steps: int = 10,
                 decode_k: int = 5, frame_budget_ms: float = 1000 * 10 / 70,
                 admission: str = 'drop_oldest', max_pending: int = 4,
                 vocab_limit: int | None = None, graphs: bool = False,
                 phase_timing: bool = True, robots: int = 1,
                 runner: ModelRunner | None = None):
        """``runner`` runs the model calls (model_runner.py); None: an eager one for
        ``model`` (a CUDA-graph one with ``graphs``)."""
        if denoise_steps < 1:
            raise ValueError(f'denoise_steps must be >= 1, got {denoise_steps}')
        if decode_k < 0:
            raise ValueError(f'decode_k must be >= 0 (0 = adaptive), got {decode_k}')
        if runner is None:
            runner = ModelRunner(model, cache, denoise_steps,
                                 'graphs' if graphs else 'eager', robots)
        elif runner.steps != denoise_steps or runner.cache is not cache:
            raise ValueError('the runner must run this cache and these denoise steps')
        self.runner = runner
        self.cache = cache
        self.denoise_steps = denoise_steps
        self.decode_k = decode_k
        self.vocab_limit = vocab_limit
        self.frame_budget_ms = frame_budget_ms
        self.adaptive = AdaptiveK(frame_budget_ms, k_max=cache.max_new_tokens) \
            if decode_k == 0 else None
        self.admit = Admission(admission, max_pending, cache)
        self.active: list[Request] = []
        self._hidden: dict[int, torch.Tensor] = {}  # first-token hidden of new requests
        self.clock = Clock(cache.kv.device, phase_timing)
        self.deadline_misses = 0

    # -- requests --------------------------------------------------------------------------

    def _admit(self, request: Request, out: FrameOutput) -> int | None:
        return self.admit.row(request, out, self.active, self._finish)

    def _finish(self, r: Request, out: FrameOutput, reason: str | None = None) -> None:
        if reason is not None:
            r.end(reason)
        self.cache.free(r.row)
        r.row = None
        self.active.remove(r)
        self._hidden.pop(r.id, None)
        out.finished.append(r)

    def cancel(self, request_id: int) -> Request | None:
        """End a request now: its KV row (or its place in the wait queue) is free on return.
        None when no request of that id is active or waiting."""
        for r in self.active:
            if r.id == request_id:
                self._finish(r, FrameOutput(actions=torch.empty(0)), 'cancelled')
                r.note = 'cancelled by its caller'
                return r
        return self.admit.cancel(request_id)

    def cancel_all(self) -> list[Request]:
        out = FrameOutput(actions=torch.empty(0))
        for r in list(self.active):
            self._finish(r, out, 'cancelled')
        return out.finished + self.admit.cancel_all()

    # -- phases ----------------------------------------------------------------------------

    def _prefill(self, f: Frame, row: int) -> torch.Tensor:
        return self.runner.prefill(f.images, f.image_mask, f.tokens, f.token_mask,
                                   slice(row, row + 1))

    def _start(self, request: Request, row: int, hidden: torch.Tensor) -> None:
        """``row`` holds the request's prefix and ``hidden`` the state after its last token."""
        if request.extension:
            hidden = self.runner.extend(row, request.extension)
        request.row = row
        self.active.append(request)
        self._hidden[request.id] = hidden

    def _decode_step(self, out: FrameOutput) -> int:
        """One token for every active request in one batch; returns the batch size."""
        passes = [r for r in self.active if r.needs_pass]
        fresh = [r for r in self.active if not r.tokens]
        if not passes and not fresh:
            return 0
        hidden = []
        if passes:
            hidden.append(self.runner.decode([r.row for r in passes],
                                             [r.tokens[-1] for r in passes]))
        hidden += [self._hidden.pop(r.id) for r in fresh]
        # Fresh requests' first tokens share the batch's one pass over the output layer.
        batch = passes + fresh
        tokens = self.runner.sample(torch.cat(hidden) if len(hidden) > 1 else hidden[0],
                                    batch, self.vocab_limit)
        for r, t in zip(batch, tokens):
            r.append(t)
            out.tokens.append((r, t, len(r.tokens), r.finished))
            if r.finished:
                self._finish(r, out)
        return len(batch)

    def wanted_k(self) -> int:
        """Decode steps this frame so that each active request, at an even pace, finishes
        within as many frames as there are rows for the requests started after it."""
        frames = max(1, self.cache.max_requests - 1)
        k = 0
        for r in self.active:
            left = r.max_new_tokens - len(r.tokens)
            k = max(k, -(-left // max(1, frames - r.frames)))
        return k

    def decode_to_end(self, out: FrameOutput) -> list[int]:
        """Decode until no request is active (the in-frame language of the baselines)."""
        batches = []
        while self.active:
            batches.append(self._decode_step(out))
        return batches

    # -- one frame -------------------------------------------------------------------------

    def _shared(self, requests: list[list[Request]], out: FrameOutput) -> list[tuple]:
        """The requests that start from their observation's own prefill, with their rows:
        (observation, request, row) for each that gets a row."""
        born = []
        for i, rs in enumerate(requests):
            for r in rs:
                row = self._admit(r, out)
                if row is not None:
                    born.append((i, r, row))
        return born

    def _own_prefills(self, f: Frame, requests: list[list[Request]], out: FrameOutput) -> None:
        """Requests that prefill again for themselves once the chunks are out: none here."""

    def _language(self, out: FrameOutput, t0: float) -> tuple[int, list[int]]:
        """The frame's decode steps, after its chunks are out: (steps, batch sizes). k
        steps (fixed, or as many as the frame budget allows) over every open request."""
        clock = self.clock
        steps = 0
        batches = []
        k = self.decode_k if self.adaptive is None else self.wanted_k()
        while self.active and steps < k:
            # Adaptive k needs the time the device has really spent so far.
            now = clock(sync=self.adaptive is not None)
            batch = len(self.active)
            if self.adaptive is not None and not self.adaptive.fits(now - t0, steps, batch):
                break
            b = self._decode_step(out)
            if self.adaptive is not None:
                self.adaptive.observe(b, clock() - now)
            batches.append(b)
            steps += 1
        for r in self.active:
            r.frames += 1
        return steps, batches

    # -- one frame -------------------------------------------------------------------------

    def plan(self, f: Frame, requests: list[list[Request]]) -> FramePlan:
        """Decide a frame of ``b`` observations (``f`` batched [b, ...]; ``requests[i]`` are
        the requests observation ``i`` starts): which requests get KV rows now (admission)
        and the rows the observations are prefilled into. Nothing runs the model here.

        Each observation is prefilled into a scratch row of its own (a batch of one into
        the row of the first request it starts), later copied into the rows of the requests
        it starts, so each chunk is what its observation alone would give."""
        b = f.images.shape[0]
        if not 1 <= b <= self.cache.scratch_rows:
            raise ValueError(f'a batch of {b} observations; the cache has '
                             f'{self.cache.scratch_rows} scratch rows')
        if len(requests) != b:
            raise ValueError(f'{len(requests)} request lists for {b} observations')
        t0 = self.clock()
        out = FrameOutput(actions=torch.empty(0))
        born = self._shared(requests, out)
        block = slice(self.cache.scratch, self.cache.scratch + b)
        if b == 1 and born:
            # One robot: its prefill goes straight into its first request's row, which
            # saves copying it there (the other requests copy it from that row).
            block = slice(born[0][2], born[0][2] + 1)
        return FramePlan(f, requests, born, block, out, t0)

    @torch.inference_mode()
    def act(self, plan: FramePlan) -> torch.Tensor:
        """The planned frame's prefill and denoise: every chunk [b, horizon, action_dim]. A
        failure in the model raises BatchError, with the rows planned for its requests
        given back."""
        f, block, clock = plan.frame, plan.block, self.clock
        try:
            plan.hidden = self.runner.prefill(f.images, f.image_mask, f.tokens,
                                              f.token_mask, block)
            t1 = clock()
            actions = self.runner.denoise(block, f.noise, f.guide)
            t2 = clock()
        except Exception as e:
            self.abandon(plan)
            raise BatchError(plan.out) from e
        plan.out.actions = actions
        plan.times = [t1, t2]
        return actions

    def abandon(self, plan: FramePlan) -> None:
        """A planned frame that will not speak: the rows planned for its requests are free."""
        for _, _r, row in plan.born:
            self.cache.free(row)
        plan.born = []

    @torch.inference_mode()
    def speak(self, plan: FramePlan) -> FrameOutput:
        """The acted frame's language, after its chunks are out: its requests start from its
        prefill (copied into their rows), then the frame's decode steps over every active
        request, whichever robot's, in one batch."""
        f, block, out, clock = plan.frame, plan.block, plan.out, self.clock
        # Copies first: a request starting in its observation's own row may extend it.
        for i, _r, row in plan.born:
            if row != block.start + i:
                self.runner.copy_row(block.start + i, row)
        for i, r, row in plan.born:
            self._start(r, row, plan.hidden[i:i + 1])
        self._own_prefills(f, plan.requests, out)
        for i, rs in enumerate(plan.requests):
            for r in rs:
                if r.row is None and not r.finished:
                    self.admit.queue(r, f.part(i), out)
        for r, part, row in self.admit.admit_waiting():
            self._start(r, row, self._prefill(part, row))
        t3 = clock()
        steps, batches = self._language(out, plan.t0)
        t4 = clock(sync=True)
        t0, (t1, t2) = plan.t0, plan.times
        frame_ms = t4 - t0
        if frame_ms > self.frame_budget_ms:
            self.deadline_misses += 1
        out.timing = dict(prefill_ms=t1 - t0, denoise_ms=t2 - t1, decode_ms=t4 - t3,
                          language_prefill_ms=t3 - t2, frame_ms=frame_ms, chunk_ms=t2 - t0,
                          k=steps, batches=batches, robots=f.images.shape[0])
        return out

    def step_batch(self, f: Frame, requests: list[list[Request]], on_actions=None
                   ) -> FrameOutput:
        """plan, act, ``on_actions(chunks)``, speak: one whole frame, for callers with
        nothing to do between the chunks and language (benchmarks, tests)."""
        plan = self.plan(f, requests)
        actions = self.act(plan)
        if on_actions is not None:
            try:
                on_actions(actions)
            except BaseException:
                self.abandon(plan)
                raise
        return self.speak(plan)
