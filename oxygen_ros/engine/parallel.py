"""The naive-parallel baseline: two model copies, one per task, running concurrently.

The action worker prefills and denoises with its copy; the language worker prefills the same
observation with the other copy and decodes the frame's request to the end. Both start at the
frame and the frame ends when the slower one does (the paper ran the two on one GPU under
MPS). It costs twice the weights and shares nothing. On a CPU each worker gets half of
torch's threads for the frame: two workers each asking for every core were measured slower
(136 vs 113 ms per frame at T = 30 on two cores).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from .baselines import Isolated, SharedKV
from .kv_cache import KVCache
from .requests import Request
from .scheduler import Frame, FrameOutput, FramePlan, Scheduler


class ParallelScheduler:
    mode = 'parallel'

    def __init__(self, model, max_requests: int, max_new_tokens: int, denoise_steps: int = 10,
                 vocab_limit: int | None = None, device='cpu', dtype=torch.float32,
                 frame_budget_ms: float = 1000 * 10 / 70, extension: int = 0):
        # A second copy of the weights, as two independent workers would hold.
        second = type(model)(model.cfg)
        second.load_state_dict(model.state_dict())
        second.to_inference(model.device, model.dtype)
        self.actor = Isolated(model, KVCache(model.cfg, 0, 1, device, dtype),
                            denoise_steps=denoise_steps)
        self.lang = SharedKV(second, KVCache(model.cfg, max(1, max_requests), max_new_tokens,
                                             device, dtype, extension=extension),
                             admission='reject_newest', vocab_limit=vocab_limit)
        self.denoise_steps = denoise_steps
        self.clock = self.actor.clock
        self._pool = ThreadPoolExecutor(1, thread_name_prefix='oxygen-language')
        self.frame_budget_ms = frame_budget_ms
        self.deadline_misses = 0

    @property
    def admit(self):
        return self.lang.admit

    def cancel_all(self):
        return self.lang.cancel_all()

    @property
    def active(self):
        return self.lang.active

    @torch.inference_mode()
    def _actions(self, f: Frame):
        t0 = self.clock()
        row = self.actor.cache.scratch
        self.actor._prefill(f, row)
        actions = self.actor.runner.denoise(slice(row, row + 1), f.noise, f.guide)
        return actions, self.clock() - t0

    @torch.inference_mode()
    def _language(self, f: Frame, requests: list[Request]) -> FrameOutput:
        out = FrameOutput(actions=torch.empty(0))
        for r in requests:
            row = self.lang._admit(r, out)
            if row is not None:
                self.lang._start(r, row, self.lang._prefill(f, row))
        self.lang.decode_to_end(out)
        return out

    def cancel(self, request_id: int) -> Request | None:
        # Requests end inside the frame that starts them: none is left to cancel between frames.
        return self.lang.cancel(request_id)

    def plan(self, f: Frame, requests: list[list[Request]]) -> FramePlan:
        if len(requests) != 1 or f.images.shape[0] != 1:
            raise ValueError('the parallel baseline runs one robot a frame')
        return FramePlan(f, requests, [], slice(0, 1), FrameOutput(actions=torch.empty(0)),
                         self.clock())

    def act(self, plan: FramePlan) -> torch.Tensor:
        """The chunk [1, horizon, dim] from one copy while the other starts the frame's
        language, at the same time; speak waits for it."""
        plan.times = [torch.get_num_threads()]  # to restore; then the chunk's ms
        if self.actor.cache.kv.device.type == 'cpu':
            torch.set_num_threads(max(1, plan.times[0] // 2))  # process-wide, hence per frame
        plan.language = self._pool.submit(self._language, plan.frame, list(plan.requests[0]))
        try:
            actions, ms = self._actions(plan.frame)
        except BaseException:
            self.abandon(plan)
            raise
        plan.out.actions = actions
        plan.times.append(ms)
        return actions

    def abandon(self, plan: FramePlan) -> None:
        if plan.language is not None:
            plan.language.result()
            plan.language = None
            torch.set_num_threads(plan.times[0])

    def speak(self, plan: FramePlan) -> FrameOutput:
        try:
            out = plan.language.result()
        finally:
            plan.language = None
            torch.set_num_threads(plan.times[0])
        out.actions = plan.out.actions
        frame_ms = self.clock() - plan.t0
        if frame_ms > self.frame_budget_ms:
            self.deadline_misses += 1
        act_ms = plan.times[1]
        out.timing = dict(action_ms=act_ms, chunk_ms=act_ms, frame_ms=frame_ms,
                          k=len(out.tokens), robots=1)
        return out

    # The same three calls make a whole frame: the scheduler's own sequence serves.
    step_batch = Scheduler.step_batch

    def close(self) -> None:
        self._pool.shutdown()
