"""Saying problems without flooding the log."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Reporter:
    """Says each distinct problem at most once per `period` seconds.

    Repeats inside the window are counted and the count is added to the next message, so a
    problem that happens at 30 Hz reads as one line with "(120 more since)" instead of a
    flood. Totals per key stay available for diagnostics.

    Keys name kinds of problems (inputs.problem_key keeps what a sender controls out of
    them). Should ever more keys come anyway, those past `max_keys` are counted under
    '<kind>:other' (kind: the key up to its first ':'), so the dictionaries stay bounded and
    the rate limit holds.
    """

    def __init__(
        self,
        say: Callable[[str], None],
        period: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        keep: int = 20,
        max_keys: int = 256,
    ):
        self.say = say
        self.period = period
        self.clock = clock
        self.keep = keep
        self.max_keys = max_keys
        self.totals: dict[str, int] = {}
        self.recent: list[str] = []  # the last messages said, newest last
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def report(self, key: str, message: str | None = None) -> bool:
        """Count a problem under `key` and say it unless it was said recently. Returns
        whether it was said."""
        message = message or key
        now = self.clock()
        with self._lock:
            if key not in self.totals and len(self.totals) >= self.max_keys:
                key = key.partition(':')[0] + ':other'
            self.totals[key] = self.totals.get(key, 0) + 1
            last = self._last.get(key)
            if last is not None and now - last < self.period:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            held = self._held.pop(key, 0)
            self._last[key] = now
            if held:
                message = f'{message} ({held} more since the last report)'
            self.recent = [*self.recent, message][-self.keep:]
        self.say(message)
        return True

    def clear(self, key: str) -> None:
        """Forget a key's window, so the problem is said at once if it comes back."""
        with self._lock:
            self._last.pop(key, None)
            self._held.pop(key, None)

    def count(self, prefix: str = '') -> int:
        with self._lock:
            return sum(n for k, n in self.totals.items() if k.startswith(prefix))
