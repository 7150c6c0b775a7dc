"""The middle of the daemon: takes each sampler Tick, keeps the state that learning needs, and derives the
typed figures of the tick once (exporter.figures.Snapshot). Scrapes only read the snapshot.

    model = Model(cfg)
    model.ingest(tick)          # energy attribution, histories, windows, learners
    snap = model.snapshot()     # ServerFigures per server, device figures, source health

Used by `kvwatt run` (exporter.daemon), `kvwatt baseline record` and the experiment's measurement; importable as
``exporter.model.Model``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from exporter.config import Config
from exporter.energy.baseline import BaselineBook
from exporter.figures import Snapshot
from exporter.model.cost import Prices
from exporter.model.energy import EnergyLedger, is_idle
from exporter.model.evidence_book import EvidenceBook
from exporter.model.reference_book import ReferenceBook
from exporter.model.server import ServerModel
from exporter.samples import Tick


class Model:
    def __init__(self, cfg: Config, book: BaselineBook | None = None, wall_clock: Callable[[], float] = time.time,
                 keep_seconds: float | None = None, learn_idle: bool = True,
                 references: ReferenceBook | None = None) -> None:
        """``references``: where the learned reference shares persist (the daemon's state directory); None
        keeps them in memory only (the experiment, `baseline record`)."""
        self.cfg = cfg
        self.wall_clock = wall_clock
        self.servers = {s.name: ServerModel(s, cfg, keep_seconds) for s in cfg.servers}
        self.energy = EnergyLedger(cfg, book, wall_clock, learn_idle)
        self.prices = Prices(cfg)
        self.references = references
        # the evidence windows persist beside the reference shares, in the same state directory
        self.evidence = None if references is None else EvidenceBook(references.state_dir, references.wall_clock,
                                                                      references.read_only_reason)
        if references is not None:
            for name, samples in references.load().items():
                if name in self.servers:
                    self.servers[name].reference.restore(samples)
            self._restore_evidence()
        self.last_t: float | None = None

    def ingest(self, tick: Tick) -> None:
        t = tick.t
        self.energy.ingest(tick)
        self.prices.ingest(tick)
        for name, sm in self.servers.items():
            self.energy.attribute(name, sm.history)  # before the read: the interval ending at t gets it
            read = tick.servers.get(name)
            if read is not None:
                sm.read(t, read.status, read.reading)
            sm.learn(t, self.wall_clock())
        self.energy.learn(t, {name: is_idle(sm.status, _last(sm), t) for name, sm in self.servers.items()})
        self._persist_references()
        self._persist_evidence()
        self.last_t = t

    def _restore_evidence(self) -> None:
        """Each server's stored epoch and windows, less those older than its history (they had aged out)."""
        now = self.wall_clock()
        for name, (epoch, points) in self.evidence.load().items():
            sm = self.servers.get(name)
            if sm is not None:
                horizon = now - sm.pressure.history_seconds
                sm.pressure.restore(epoch, [p for p in points if p.wall is not None and p.wall >= horizon])

    def _persist_evidence(self) -> None:
        """Write the evidence windows when a server added or set aside one (at most once per window each)."""
        changed = [sm.pressure for sm in self.servers.values() if sm.pressure.changed]
        if not changed:
            return
        for pl in changed:
            pl.changed = False
        if self.evidence is not None:
            self.evidence.save({name: (sm.pressure.epoch, list(sm.pressure.points))
                                for name, sm in self.servers.items() if sm.pressure.epoch.started_wall is not None})

    def _persist_references(self) -> None:
        """Write the reference shares when one learned a window (at most once per threshold window each)."""
        changed = [sm.reference for sm in self.servers.values() if sm.reference.changed]
        if not changed:
            return
        for ref in changed:
            ref.changed = False
        if self.references is not None:
            self.references.save({name: sm.reference.samples for name, sm in self.servers.items()
                                  if sm.reference.samples})

    def snapshot(self) -> Snapshot:
        t = self.last_t if self.last_t is not None else time.monotonic()
        servers = tuple(sm.figures(t, self.servers, self.prices) for sm in self.servers.values())
        now_wall = self.wall_clock()
        state = self.energy.book.status()  # the state directory's health sits with the host-wide sources
        more = self.references.problems() if self.references is not None else []
        more += self.evidence.problems() if self.evidence is not None else []
        if state is not None and more:
            reason = "; ".join(p for p in (state.reason, *more) if p)
            state = replace(state, reason=reason, state="degraded")
        sources = tuple(self.energy.statuses) + (() if state is None else (state,)) + self.prices.statuses()
        return Snapshot(t, now_wall, servers, sources, self.energy.devices(now_wall),
                        notice=self.cfg.notice, prices=self.prices.figures())


def _last(sm: ServerModel):
    ivs = sm.history.intervals
    return ivs[-1] if ivs else None
