"""Questions about a robot's next frame, and every request's text as it streams out.

A question may come from any thread: it waits in its robot's inbox for that robot's next
frame, which starts it from its own prefill. Whoever runs the scheduler holds the engine's
``owner`` lock; a cancel that finds it held is left for the running frame to do before it
lets go (``cancel_requested``), so no admission of that frame sees the row taken.
"""

from __future__ import annotations

import threading

from .config import QUESTION_FORMAT
from .io import TokenEvent
from .requests import Request


class Questions:
    """``robots``: name -> the engine's state of each robot ('' for step's robot), whose
    ``inbox`` holds its waiting questions; ``refresh()`` renews the engine's snapshot of the
    scheduler after a cancel between frames."""

    def __init__(self, cfg, tokenizer, scheduler, robots: dict, owner: threading.Lock,
                 refresh):
        self.cfg, self.tokenizer, self.scheduler = cfg, tokenizer, scheduler
        self.robots = robots
        self.owner = owner
        self.refresh = refresh
        self.lock = threading.Lock()  # the inboxes and the cancels asked for
        self.cancels: set[int] = set()
        self.ended: list[Request] = []  # cancelled during a frame: their events come with it
        self.streams = {}  # request id -> its detokenizer
        # Tokens a question may take; lowered while running (the node's live max_new_tokens),
        # never above what the KV rows were sized for.
        self.budget = cfg.max_new_tokens

    def ask(self, question: str, max_new_tokens: int = 0, prompt_format: str = '',
            robot: str | None = None) -> int:
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
        if robot is not None and (not robot or robot not in self.robots):
            added = sorted(n for n in self.robots if n)
            raise ValueError(f'unknown robot {robot!r}; this engine has {added}')
        # Stamped with the frame that starts it.
        r = Request(stamp=0.0, prompt=question, max_new_tokens=max_new_tokens or limit,
                    stop_at_eos=self.cfg.stop_at_eos, temperature=self.cfg.temperature,
                    seed=self.cfg.seed, eos_id=self.tokenizer.eos_id, kind='question',
                    extension=tokens, robot=robot or '')
        with self.lock:
            self.robots[robot or ''].inbox.append(r)
        return r.id

    def withdraw(self, request_id: int) -> bool:
        with self.lock:
            for rb in self.robots.values():
                for i, r in enumerate(rb.inbox):
                    if r.id == request_id:
                        del rb.inbox[i]
                        return True
        return False

    def cancel(self, request_id: int) -> list[TokenEvent]:
        with self.lock:
            for rb in self.robots.values():
                for i, r in enumerate(rb.inbox):
                    if r.id == request_id:
                        del rb.inbox[i]
                        r.end('cancelled')
                        r.note = 'cancelled by its caller before it started'
                        return [self.final(r)]
            if not self.owner.acquire(blocking=False):
                self.cancels.add(request_id)
                return []
        try:
            r = self.scheduler.cancel(request_id)
            self.refresh()  # its row is free now, not at the next frame
            return [self.final(r)] if r is not None else []
        finally:
            self.owner.release()

    def cancel_requested(self) -> None:
        """Cancels asked for during a frame; the caller owns the scheduler and holds lock."""
        for rid in self.cancels:
            r = self.scheduler.cancel(rid)
            if r is not None:
                self.ended.append(r)
        self.cancels.clear()

    def take_ended(self) -> list[TokenEvent]:
        """The last events of the requests cancelled during the frame now ending."""
        with self.lock:
            self.cancel_requested()
            ended, self.ended = self.ended, []
        return [self.final(r) for r in ended]

    def cancel_all(self) -> list[TokenEvent]:
        with self.owner, self.lock:
            ended = self.ended + self.scheduler.cancel_all()
            for rb in self.robots.values():
                for r in rb.inbox:
                    r.end('cancelled')
                    ended.append(r)
                rb.inbox = []
            self.ended = []
            self.cancels.clear()
            for r in ended:
                r.note = r.note or 'every request cancelled'
            self.refresh()  # diagnostics after a deactivate: no frame comes to do it
            return [self.final(r) for r in ended]

    def waiting(self) -> int:
        with self.lock:
            return sum(len(rb.inbox) for rb in self.robots.values())

    def events(self, out) -> list[TokenEvent]:
        """A frame's output as events: questions told they wait, tokens as text, ends."""
        events = []
        for r in out.queued:
            if r.kind == 'question':
                events.append(TokenEvent(r.id, r.stamp, '', '', 0, False, reason='queued',
                                         message='every KV row is busy: waiting for one '
                                         '(admission wait)', kind=r.kind, robot=r.robot))
        for r, t, n, last in out.tokens:
            stream = self.streams.setdefault(r.id, self.tokenizer.stream())
            delta = stream.feed(t)
            if last:
                delta += stream.finish()
                del self.streams[r.id]
            events.append(TokenEvent(r.id, r.stamp, delta, stream.text, n, last,
                                     reason=r.reason if last else '', kind=r.kind,
                                     robot=r.robot))
        for r in out.finished:
            # A refused narration is reported by FrameResult.rejected.
            if r.cancelled and (r.kind == 'question' or r.reason != 'rejected'):
                events.append(self.final(r))
        return events

    def final(self, r: Request) -> TokenEvent:
        """The last event of a request that ended early."""
        stream = self.streams.pop(r.id, None)
        return TokenEvent(r.id, r.stamp, '', stream.text if stream else '', len(r.tokens),
                          True, True, reason=r.reason, message=r.note, kind=r.kind,
                          robot=r.robot)
