"""The write model one server's post-preemption figure uses (methods.md s4, "The write model, learned"): each
completed window of the repeat grid without preemption (and not just after one) is an observation, kept for a
bounded history; the fit and the choice between it and config.json (derive/write_model.py) are redone when a
window arrives. Logs when the model's source or state changes, never per tick."""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Iterable

from exporter.derive import write_model
from exporter.derive.recompute import WriteModel

log = logging.getLogger("kvwatt.recompute")


class WriteModelLearner:
    def __init__(self, name: str, width: float, history_seconds: float,
                 configured: tuple[float, float] | None) -> None:
        self.name, self.width, self.configured = name, width, configured
        self.keep = max(int(history_seconds // width), write_model.FIT_CHECK_MIN_WINDOWS)
        self.windows: deque[write_model.WriteWindow] = deque()
        self.last_t1 = -math.inf
        self._preempted_t1 = -math.inf  # the end of the latest window that preempted (or could not say)
        self.model: WriteModel = write_model.choose(configured, (), write_model.fit(()))

    def observe(self, buckets: Iterable) -> bool:
        """Feed the completed buckets not seen yet (oldest first); refit when one was kept. True when refitted.
        A window that preempted, or whose preemptions are unknown, starts the guard (write_model.GUARD_SECONDS):
        the windows in it may hold the resumed requests' re-prefill."""
        added = False
        for b in buckets:
            if b.t1 <= self.last_t1:
                continue
            self.last_t1 = b.t1
            if b.agg.delta("preemptions") != 0:
                self._preempted_t1 = b.t1
                continue
            if b.t0 < self._preempted_t1 + write_model.GUARD_SECONDS:
                continue
            o = write_model.observation(b.agg, self.width)
            if o is not None:
                self.windows.append(o)
                if len(self.windows) > self.keep:
                    self.windows.popleft()
                added = True
        if added:
            self._refit()
        return added

    def _refit(self) -> None:
        before = self.model
        windows = tuple(self.windows)
        now = self.model = write_model.choose(self.configured, windows, write_model.fit(windows), before)
        if (before.state, before.source) != (now.state, now.source):
            log.info("%s: the write model of the post-preemption recomputation is %s (%s, %d windows without "
                     "preemption)%s", self.name, now.state, now.source or "none", now.windows,
                     f": {now.reason}" if now.reason else "")

    def set_aside(self) -> None:
        """Another engine behind the server (a new evidence epoch): its windows described the old one's writes."""
        self.windows.clear()
        self._preempted_t1 = -math.inf
        self._refit()
