"""A one-line live progress bar on stderr, redrawn in place twice a second."""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from kvwatt_lab.replay.runner import Replay

_WIDTH = 24


def progress_line(replay: Replay) -> str:
    stats, counts = replay.sink.stats, replay.counts
    elapsed_seconds = replay.elapsed_seconds()
    duration, total = replay.options.duration_seconds, replay.queue.max_sessions
    if duration:
        fraction = min(1.0, elapsed_seconds / duration)
    elif total:
        fraction = min(1.0, counts["sessions_finished"] / total)
    else:
        fraction = 0.0
    filled = int(fraction * _WIDTH)
    bar = "#" * filled + "-" * (_WIDTH - filled)
    of_total = f"/{total}" if total else ""
    rate = stats.output_tokens / elapsed_seconds if elapsed_seconds > 0 else 0.0
    return (f"[{bar}] {elapsed_seconds:6.1f}s sessions {counts['sessions_finished']}{of_total} "
            f"req {stats.ok} ok {stats.failed} failed, {replay.in_flight_requests} in flight, "
            f"{rate:.0f} out tok/s")


async def show_progress(replay: Replay, stream: TextIO = sys.stderr, interval_seconds: float = 0.5) -> None:
    """Redraw until cancelled, then leave the last line in place."""
    try:
        while True:
            stream.write("\r" + progress_line(replay) + "\x1b[K")
            stream.flush()
            await asyncio.sleep(interval_seconds)
    finally:
        stream.write("\r" + progress_line(replay) + "\x1b[K\n")
        stream.flush()
