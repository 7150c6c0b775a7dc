"""Rate-limit repeated log lines: one identical message per interval, with a count of the ones held back.

A flood (a client opening thousands of connections, an fd limit reached, a malformed-request storm) must not
turn into a log flood: 292,415 identical accept() tracebacks in 38 s (130 MB) once cost the daemon its
sampling. ``RepeatFilter`` sits on the root handlers of `kvwatt run`, so it covers every logger (kvwatt's,
asyncio's, aiohttp's). A message is identical when its logger, level and formatted text are; the first one
passes, the same one again within ``interval_seconds`` is dropped and counted, and the next one after the
interval passes with " (repeated K times)" (K dropped since the last one shown).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

REPEAT_INTERVAL_SECONDS = 60.0
MAX_TRACKED_MESSAGES = 2048  # distinct messages remembered; the least recently seen is forgotten beyond


class RepeatFilter(logging.Filter):
    def __init__(self, interval_seconds: float = REPEAT_INTERVAL_SECONDS,
                 clock=time.monotonic, max_tracked: int = MAX_TRACKED_MESSAGES):
        super().__init__()
        self.interval_seconds = interval_seconds
        self.clock = clock
        self.max_tracked = max_tracked
        # (logger, level, text) -> [time the last one was shown, number dropped since]
        self._seen: OrderedDict[tuple[str, int, str], list] = OrderedDict()
        self._lock = threading.Lock()  # handlers call filters outside their own lock

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        key = (record.name, record.levelno, text)
        now = self.clock()
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.interval_seconds:
                entry[1] += 1
                self._seen.move_to_end(key)
                return False
            dropped = entry[1] if entry is not None else 0
            self._seen[key] = [now, 0]
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
        if dropped:
            record.msg, record.args = f"{text} (repeated {dropped} times)", None
        return True


def install(interval_seconds: float = REPEAT_INTERVAL_SECONDS) -> RepeatFilter:
    """Put one RepeatFilter on every handler of the root logger (call after logging.basicConfig)."""
    f = RepeatFilter(interval_seconds)
    for handler in logging.getLogger().handlers:
        handler.addFilter(f)
    return f
