"""Asking the robot: what the node's ``~/ask`` action server does, without ROS.

A goal becomes an engine question (Engine.ask), born from the next frame's prefill. The
engine's events for it become feedback while it streams and, at its end, one result with
the reason it ended. Goals while the node is not active, goals past ``max_open`` open
ones, and goals the engine refuses, end at once with reason 'rejected' and why; a question
still waiting for its frame ``timeout`` seconds after it came ends with reason 'timeout'
(``Asks.expire``, which the node calls from its watchdog). The action server only converts
between these and ROS messages: goal in, ``Answer.next()`` until the result,
``Answer.cancel()`` on a cancel request; the node's engine thread hands every frame's
question events to ``Asks.deliver``.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass

# Feedback states: accepted and waiting for the next frame; waiting for a KV row (admission
# wait); tokens streaming.
STATES = WAITING, QUEUED, DECODING = ('waiting', 'queued', 'decoding')
SUCCEEDED = ('done', 'budget')
TIMEOUT = 'timeout'  # a question whose frame did not come within Asks.timeout


@dataclass
class Goal:
    question: str
    max_new_tokens: int = 0  # 0 = the engine's max_new_tokens
    prompt_format: str = ''  # '' = the engine's QUESTION_FORMAT


@dataclass
class Feedback:
    request_id: int
    stamp: float  # the frame it answers; 0 until it starts
    state: str
    delta: str = ''
    text: str = ''
    tokens: int = 0


@dataclass
class Result:
    request_id: int  # 0 when no engine request was made
    stamp: float
    text: str
    tokens: int
    reason: str  # requests.REASONS
    message: str = ''

    @property
    def succeeded(self) -> bool:
        return self.reason in SUCCEEDED


class Answer:
    """One goal's answer as it comes: feedback, then exactly one Result."""

    def __init__(self, asks: Asks | None, request_id: int, opened: float = 0.0):
        self.request_id = request_id
        self.opened = opened  # time.monotonic() when the goal came
        self.last = Feedback(request_id, 0.0, WAITING)  # what the caller was last told
        self.result: Result | None = None
        self._asks = asks
        self._items: queue.Queue = queue.Queue()

    def next(self, timeout: float | None = None) -> Feedback | Result | None:
        """The next feedback or the result, in order; None when nothing came in time."""
        try:
            return self._items.get(timeout=timeout)
        except queue.Empty:
            return None

    def cancel(self) -> None:
        """Ask the engine to end it; the result (reason 'cancelled') follows through next()."""
        if self._asks is not None and self.result is None:
            self._asks.cancel(self.request_id)

    def _put(self, item) -> None:
        if isinstance(item, Result):
            self.result = item
        else:
            self.last = item
        self._items.put(item)

    def _end(self, reason: str, message: str, stamp: float) -> None:
        # Ended early: the result holds what the feedback said, so deltas add up to it even
        # when tokens of the last frame were still on their way.
        fb = self.last
        self._put(Result(self.request_id, stamp, fb.text, fb.tokens, reason, message))


class Asks:
    """The open answers of one node, routed by request id. Safe to call from any thread."""

    def __init__(self, remember: int = 1024, max_open: int = 16, timeout: float = 5.0):
        # Called after anything is added to an answer (from any thread): lets an action
        # server waiting for it know. Set by the server.
        self.wake = _nothing
        self._lock = threading.Lock()
        self._engine = None
        self._why = 'the node is not configured'
        self._open: dict[int, Answer] = {}
        # Answers already ended; events of theirs still on their way are expected, not lost.
        self._closed: dict[int, None] = {}
        self._remember = remember
        self.max_open = max_open  # goals open at once; one more is refused
        self.timeout = timeout  # s a question may wait for its frame
        self._ended = collections.Counter()  # results given, by reason

    def activate(self, engine) -> None:
        with self._lock:
            self._engine = engine

    def deactivate(self, why: str) -> None:
        """Refuse goals from now on, saying ``why``; every open answer ends 'cancelled' with
        it, and its engine request with it (the rows are freed at once when no frame runs)."""
        with self._lock:
            engine, self._engine, self._why = self._engine, None, why
            answers = list(self._open.values())
            for a in answers:
                self._close(a.request_id)
                a._end('cancelled', why, a.last.stamp)
            self._ended['cancelled'] += len(answers)
        self.wake()
        if engine is not None:
            for a in answers:
                engine.cancel(a.request_id)

    @property
    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def stats(self) -> dict:
        """For diagnostics: goals open now, and how many ended which way since the start."""
        with self._lock:
            n = self._ended
            return dict(questions_open=len(self._open),
                        questions_answered=n['done'] + n['budget'],
                        questions_rejected=n['rejected'], questions_cancelled=n['cancelled'],
                        questions_dropped=n['dropped'], questions_timed_out=n[TIMEOUT])

    def open(self, goal: Goal) -> Answer:
        """Start answering ``goal``; a goal that cannot be asked gets its result at once."""
        with self._lock:
            # Registered before the engine's next frame can start it, so no event of it
            # can arrive unclaimed.
            if self._engine is None:
                self._ended['rejected'] += 1
                return _refused(f'the node is not active: {self._why}')
            if len(self._open) >= self.max_open:
                self._ended['rejected'] += 1
                return _refused(f'{len(self._open)} questions are open, as many as '
                                'max_open_questions allows: ask again when one has ended')
            try:
                rid = self._engine.ask(goal.question, int(goal.max_new_tokens),
                                       goal.prompt_format)
            except ValueError as e:
                self._ended['rejected'] += 1
                return _refused(str(e))
            answer = Answer(self, rid, time.monotonic())
            self._open[rid] = answer
            answer._put(answer.last)
        self.wake()
        return answer

    def expire(self, now: float, why: str = '') -> int:
        """End the questions still waiting for their frame (no event of theirs came yet)
        that came more than ``timeout`` s before ``now`` (time.monotonic()): reason
        'timeout', with ``why`` no frame came when given. Returns how many ended."""
        ended = 0
        with self._lock:
            engine = self._engine
            late = [a for a in self._open.values()
                    if a.last.state == WAITING and now - a.opened > self.timeout]
            for a in late:
                # One a frame took meanwhile is no longer waiting: its events come.
                if engine is None or not engine.withdraw(a.request_id):
                    continue
                self._close(a.request_id)
                self._ended[TIMEOUT] += 1
                a._end(TIMEOUT, f'no frame came within {self.timeout:g} s (question_timeout)'
                       + (f': {why}' if why else ''), 0.0)
                ended += 1
        if ended:
            self.wake()
        return ended

    def cancel(self, request_id: int) -> None:
        with self._lock:
            engine = self._engine
        if engine is not None:
            self.deliver(engine.cancel(request_id))

    def deliver(self, events) -> list:
        """Route question events to their answers. Returns those of ids never opened here
        (a mistake worth reporting); narration events are not looked at."""
        unowned = []
        routed = False
        with self._lock:
            for e in events:
                if e.kind != 'question':
                    continue
                answer = self._open.get(e.request_id)
                if answer is None:
                    if e.request_id not in self._closed:
                        unowned.append(e)
                    continue
                routed = True
                if not e.done:
                    state = QUEUED if e.reason == 'queued' else DECODING
                    answer._put(Feedback(e.request_id, e.stamp, state, e.delta, e.text,
                                         e.tokens))
                    continue
                self._close(e.request_id)
                self._ended[e.reason] += 1
                if e.cancelled:
                    answer._end(e.reason, e.message, e.stamp)
                else:
                    # The last token's text is feedback too, so the deltas add up to the
                    # result.
                    answer._put(Feedback(e.request_id, e.stamp, DECODING, e.delta, e.text,
                                         e.tokens))
                    answer._put(Result(e.request_id, e.stamp, e.text, e.tokens, e.reason))
        if routed:
            self.wake()
        return unowned

    def _close(self, request_id: int) -> None:
        del self._open[request_id]
        self._closed[request_id] = None
        while len(self._closed) > self._remember:
            del self._closed[next(iter(self._closed))]


def _nothing() -> None:
    pass


def _refused(why: str) -> Answer:
    answer = Answer(None, 0)
    answer._put(Result(0, 0.0, '', 0, 'rejected', why))
    return answer
