"""The daemon's loop (`kvwatt run` starts it through exporter/runtime/service.py). It only orchestrates: each tick
the Sampler reads every source (each with its own deadline, off the loop), the Model ingests the Tick and derives
the figures once, and the daemon publishes the Snapshot. /metrics, /api/status and / only serialise the latest snapshot
(docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from exporter import catalog
from exporter.catalog.bounds import BoundsCheck
from exporter.config import Config
from exporter.figures import Snapshot
from exporter.model import Model
from exporter.runtime.gcpolicy import FreezePolicy
from exporter.runtime.sampler import Sampler
from exporter.samples import Tick
from exporter.serve.collector import exposition
from exporter.serve.exposition import Exposition

log = logging.getLogger("kvwatt")


@dataclass(frozen=True)
class Published:
    """What the endpoints serve until the next tick: the snapshot and its families, collected once, with
    their serialisations (exporter.serve.exposition: the text format rendered at once, other forms on demand)."""

    snapshot: Snapshot
    rendered: Exposition

    @property
    def exposition(self) -> bytes:
        """The text format (what a scrape with no Accept header gets)."""
        return self.rendered.text


class Daemon:
    def __init__(self, cfg: Config, sampler: Sampler | None = None, model: Model | None = None):
        self.cfg = cfg
        self.model = model if model is not None else Model(cfg)
        # every figure held to its declared bound (exporter/catalog/bounds.py)
        self.bounds = BoundsCheck(catalog.METRICS)
        self.sampler = sampler if sampler is not None else Sampler(cfg)
        self.published: Published | None = None  # replaced whole at each tick, never mutated
        self.last_tick_t: float | None = None
        self.ticks = 0
        self.error = ""  # the last tick's failure, '' when it succeeded
        self.gc_policy: FreezePolicy | None = None  # `kvwatt run` sets it (service.tune_runtime)
        # a worker of several (exporter/runtime/workers.py) hands each published tick to the parent
        self.on_publish: Callable[[Published], None] | None = None
        self._stop = asyncio.Event()

    @property
    def snapshot(self) -> Snapshot | None:
        p = self.published
        return None if p is None else p.snapshot

    def step(self, tick: Tick) -> Snapshot:
        """One tick's work after the reads: learn, derive the figures once, collect the samples (the catalog's
        and the process' own) and write the text exposition, publish (one reference assignment, so a request
        sees the old tick or the new one, never a mix)."""
        self.model.ingest(tick)
        snap = self.bounds.apply(self.model.snapshot())  # the one check, before anything is served
        self.published = Published(snap, exposition(snap, self.cfg.metrics_opt_in))
        self.last_tick_t, self.ticks = tick.t, self.ticks + 1
        if self.on_publish is not None:
            self.on_publish(self.published)
        if self.gc_policy is not None:
            self.gc_policy.after_tick(tick.t)
        return snap

    async def run_loop(self) -> None:
        async with self.sampler:
            async for tick in self.sampler.ticks(self.cfg.interval_seconds, self._stop):
                # in a worker thread: the loop keeps answering requests while the tick is derived (the model
                # is only ever touched from here, one tick after the other)
                try:
                    await asyncio.to_thread(self.step, tick)
                    self.error = ""
                except Exception as e:  # a bug in a derivation must not stop sampling; /healthz says it
                    if not self.error:
                        log.exception("tick failed; serving the last good figures")
                    self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> None:
        self._stop.set()

    def healthy(self) -> bool:
        if self.last_tick_t is None or self.error:
            return False
        return time.monotonic() - self.last_tick_t < max(5 * self.cfg.interval_seconds, 10.0)
