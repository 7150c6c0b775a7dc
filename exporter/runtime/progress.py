"""A progress line for the long commands (`baseline idle`, `baseline record`): on a terminal one line redrawn in
place (at most twice a second); otherwise (a log, a pipe) one line at each quarter, so a log is not flooded."""

from __future__ import annotations

import time
from typing import TextIO

REDRAW_SECONDS = 0.5
QUARTERS = (0.25, 0.5, 0.75)


class Progress:
    def __init__(self, out: TextIO, total_seconds: float, what: str) -> None:
        self.out, self.total, self.what = out, total_seconds, what
        self.live = bool(getattr(out, "isatty", lambda: False)())
        self._drawn_at = -REDRAW_SECONDS
        self._quarters = list(QUARTERS)

    def line(self, done_seconds: float, detail: str) -> str:
        pct = 100.0 * min(1.0, done_seconds / self.total) if self.total > 0 else 100.0
        tail = f", {detail}" if detail else ""
        return f"{self.what}: {done_seconds:.0f} s of {self.total:g} s ({pct:.0f} %){tail}"

    def update(self, done_seconds: float, detail: str = "") -> None:
        if self.live:
            now = time.monotonic()
            if now - self._drawn_at >= REDRAW_SECONDS:
                self._drawn_at = now
                self.out.write("\r" + self.line(done_seconds, detail) + "\x1b[K")
                self.out.flush()
            return
        fraction = done_seconds / self.total if self.total > 0 else 1.0
        if self._quarters and fraction >= self._quarters[0]:
            while self._quarters and fraction >= self._quarters[0]:
                self._quarters.pop(0)
            print(self.line(done_seconds, detail), file=self.out, flush=True)

    def finish(self, done_seconds: float, detail: str = "") -> None:
        """The last state, on its own line (a terminal's live line is closed with a newline)."""
        prefix = "\r" if self.live else ""
        suffix = "\x1b[K" if self.live else ""
        self.out.write(prefix + self.line(done_seconds, detail) + suffix + "\n")
        self.out.flush()
