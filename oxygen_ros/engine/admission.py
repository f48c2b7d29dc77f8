"""Admission: which language requests get a KV row, and what becomes of the others.

A request takes a free row of the pool while its robot is under its cap. Otherwise a row
must be given up: by the robot itself when it is at its cap (never another robot's), or,
with the pool full, by the robot holding the most. The policy says what happens then:

- ``drop_oldest``: the oldest of those requests ends (dropped) and the newcomer takes its
  row: the newest words are the ones worth having on a robot that keeps moving;
- ``reject_newest``: the newcomer is refused and the running ones go on;
- ``wait``: the newcomer queues (at most ``max_pending`` per robot, the oldest dropped past
  that) and is prefilled again when a row frees, in language time, never the actions'. A
  robot with requests waiting queues behind them: first come, first served.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from .kv_cache import KVCache
from .requests import Request

ADMISSION = ('drop_oldest', 'reject_newest', 'wait')


class Admission:
    """``finish(request, out, reason)`` ends an active request and frees its row (the
    scheduler's, which owns the active list)."""

    def __init__(self, policy: str, max_pending: int, cache: KVCache):
        if policy not in ADMISSION:
            raise ValueError(f'admission must be one of {ADMISSION}, got {policy!r}')
        self.policy, self.max_pending, self.cache = policy, max_pending, cache
        self.pending: collections.deque[tuple[Request, object]] = collections.deque()
        self.rejected = 0
        self.dropped = 0

    def row(self, request: Request, out, active: list[Request],
            finish: Callable) -> int | None:
        """A KV row for ``request`` now, or None (refused: it is finished, with a note; or
        to wait: the caller queues it)."""
        robot, cache = request.robot, self.cache
        if self.policy == 'wait' and any(r.robot == robot for r, _ in self.pending):
            return None
        capped = cache.at_cap(robot)
        if not capped:
            row = cache.alloc(robot)
            if row is not None:
                return row
        if capped:
            victims = [r for r in active if r.robot == robot]
        else:
            most = max((cache.held(r.robot) for r in active), default=0)
            victims = [r for r in active if cache.held(r.robot) == most]
        if self.policy == 'drop_oldest' and victims:
            oldest = min(victims, key=lambda r: r.stamp)
            oldest.note = 'dropped to free a KV row for a newer request (admission drop_oldest)'
            finish(oldest, out, 'dropped')
            self.dropped += 1
            return cache.alloc(robot)
        if self.policy == 'wait':
            return None
        self.rejected += 1
        request.end('rejected')
        request.note = (f'robot {robot!r} holds its cap of {cache.cap(robot)} KV rows '
                        f'(admission {self.policy})' if capped else
                        f'all {cache.max_requests} KV rows are busy (admission '
                        f'{self.policy})')
        out.rejected.append(request)
        out.finished.append(request)
        return None

    def queue(self, request: Request, frame, out) -> None:
        """``request`` waits for a row with the observation (``frame``) it grows from."""
        self.pending.append((request, frame))
        mine = [p for p in self.pending if p[0].robot == request.robot]
        while len(mine) > self.max_pending:
            old, _ = entry = mine.pop(0)
            self._unqueue(entry)
            old.end('dropped')
            old.note = f'dropped from the wait queue, which holds {self.max_pending}'
            out.finished.append(old)
            self.dropped += 1
        if not request.finished:
            out.queued.append(request)

    def _unqueue(self, entry: tuple) -> None:
        # By identity: requests and frames compare by value (tensors among them).
        self.pending = collections.deque(p for p in self.pending if p is not entry)

    def admit_waiting(self) -> Iterator[tuple[Request, object, int]]:
        """The waiting requests that get a row now, in arrival order, each with its frame
        and row; robots at their cap are skipped (their turn comes when they free one)."""
        for entry in list(self.pending):
            if not self.cache.free_rows:
                break
            request, frame = entry
            if self.cache.at_cap(request.robot):
                continue
            self._unqueue(entry)
            yield request, frame, self.cache.alloc(request.robot)

    def cancel(self, request_id: int) -> Request | None:
        for i, (r, _) in enumerate(self.pending):
            if r.id == request_id:
                del self.pending[i]
                r.end('cancelled')
                r.note = 'cancelled by its caller while waiting for a KV row'
                return r
        return None

    def cancel_all(self) -> list[Request]:
        ended = [r for r, _ in self.pending]
        for r in ended:
            r.end('cancelled')
        self.pending.clear()
        return ended
