"""The paper's baselines, as variants of OxyGen's scheduler, for measuring what it buys.

- ``shared_kv``: one prefill per frame serves the chunk and the frame's language, as in
  OxyGen, but the frame decodes its language to the end before it ends: no request runs
  across frames, so narration adds its whole length to every frame it is asked in.
- ``isolated``: as shared_kv, with language's own second prefill after the chunk, as two
  separate programs sharing one model would run.

The two-copies-in-two-threads baseline is parallel.py. The node can select any of them
(``mode``); it runs OxyGen's unless told.
"""

from __future__ import annotations

from .requests import Request
from .scheduler import Frame, FrameOutput, Scheduler


class SharedKV(Scheduler):
    mode = 'shared_kv'

    def _language(self, out: FrameOutput, t0: float) -> tuple[int, list[int]]:
        batches = self.decode_to_end(out)
        return len(batches), batches


class Isolated(SharedKV):
    mode = 'isolated'

    def _shared(self, requests: list[list[Request]], out: FrameOutput) -> list[tuple]:
        return []  # language never reads the chunk's prefill

    def _own_prefills(self, f: Frame, requests: list[list[Request]], out: FrameOutput) -> None:
        for i, rs in enumerate(requests):
            for r in rs:
                row = self._admit(r, out)
                if row is not None:
                    self._start(r, row, self._prefill(f.part(i), row))


# mode -> scheduler, in MODES' order (test_engine checks they agree).
SCHEDULERS = {cls.mode: cls for cls in (Scheduler, SharedKV, Isolated)}
