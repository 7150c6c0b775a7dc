"""When the daemon's garbage collector walks what (docs/architecture.md "Garbage collection").

A full (generation 2) collection walks every tracked object that is not frozen, and holds the GIL while it
does: with an hour of history that is the hour's buckets, column chunks and learners' windows (~48,000 objects
at 8 servers x 8 GPUs, ~300,000 at 64 servers), 40-400 ms a collection while a scrape waits. Almost all of it
lives for the hour and is acyclic (freed by its reference count when it leaves), so walking it finds nothing.

``FreezePolicy.after_tick`` (Daemon.step calls it once the tick is published): every ``every_seconds`` of tick
time, a full collection of what is not frozen (what survived since the last one: a minute of buckets and
chunks, the live figures) then ``gc.freeze()``, so every collection, automatic or this one, walks at most
``every_seconds`` of survivors. The one thing freezing gives up: an object frozen while alive and then dropped
as part of a reference cycle is never collected (a read's exception with its traceback, a closed connection's
protocol): the frozen count (gc.get_freeze_count(), which objects freed by their count leave) then grows
beyond the plateau. So every ``refresh_seconds`` (the history's span: the first check finds the history full,
the plateau) the count is compared with the plateau's: more than ``REFRESH_GROWTH`` above it, everything is
unfrozen and collected once (the one long walk, only when something leaked) and the plateau is measured again;
a leak is thus bounded to that growth. bench/soak.py measures both and counts the cyclic garbage at its end."""

from __future__ import annotations

import ctypes
import gc
import time

FREEZE_EVERY_SECONDS = 60.0
REFRESH_GROWTH = 0.25  # frozen objects beyond the count after the last refresh that call for one


class FreezePolicy:
    def __init__(self, refresh_seconds: float, every_seconds: float = FREEZE_EVERY_SECONDS) -> None:
        self.every_seconds, self.refresh_seconds = every_seconds, max(refresh_seconds, every_seconds)
        self._last: float | None = None  # tick time of the last freeze
        self._last_refresh: float | None = None
        self._plateau: int | None = None  # frozen objects at the first check (the history full), or after a refresh
        self.freezes = self.refreshes = 0
        self.last_ms = self.last_refresh_ms = 0.0  # how long the last freeze / refresh held the GIL

    def after_tick(self, t: float) -> None:
        """``t``: the tick's monotonic time (a time-compressed replay runs the same policy)."""
        if self._last is None:
            self._last = self._last_refresh = t
            return
        if t - self._last_refresh >= self.refresh_seconds and self._grown():
            start = time.perf_counter()
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            self.last_refresh_ms = (time.perf_counter() - start) * 1e3
            self._last = self._last_refresh = t
            self._plateau = gc.get_freeze_count()
            self.refreshes += 1
            return
        if t - self._last_refresh >= self.refresh_seconds:
            self._last_refresh = t  # no growth: checked again a span later
            if self._plateau is None:
                self._plateau = gc.get_freeze_count()
        if t - self._last >= self.every_seconds:
            start = time.perf_counter()
            gc.collect()  # only the objects not frozen yet: cyclic garbage goes before it could be frozen
            gc.freeze()
            self.last_ms = (time.perf_counter() - start) * 1e3
            self._last = t
            self.freezes += 1

    def _grown(self) -> bool:
        return self._plateau is not None and gc.get_freeze_count() > self._plateau * (1.0 + REFRESH_GROWTH)


# glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's default, held: not raised as big blocks are freed
ARENA_MAX = 2


def limit_malloc() -> bool:
    """Hold the process' C heap to what it uses (glibc; elsewhere nothing is changed: False). A tick makes and drops
    texts of 0.1-0.4 MB (a group's exposition, the merged one, the lines of a merge) in several threads (the tick's,
    the merge's, the pipe readers'); glibc raises its mmap threshold as such blocks are freed, after which they come
    from the heap of the arena of the thread that made them and stay there: the parent of a 64-server node grew
    15.5 MiB in 6 minutes at the real pace (bench/soak.py --measure 300, issue 39). Blocks of 128 KiB and more stay
    mmapped (given back to the system when freed), and threads share at most two arenas."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_ARENA_MAX, ARENA_MAX))
