"""The middle of the daemon: takes each sampler Tick, keeps the state that learning needs, and derives the
typed figures of the tick once (exporter.figures.Snapshot). Scrapes only read the snapshot.

    model = Model(cfg)
    model.ingest(tick)          # energy attribution, histories, windows, learners
    snap = model.snapshot()     # ServerFigures per server, device figures, source health

Used by `kvwatt run` (exporter.runtime.daemon), `kvwatt baseline record` and the experiment's measurement; importable as
``exporter.model.Model``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

from exporter.config import Config
from exporter.figures import Snapshot
from exporter.idle.baseline import BaselineBook
from exporter.model.cost import Prices
from exporter.model.energy import EnergyLedger, is_idle
from exporter.model.evidence_book import EvidenceBook
from exporter.model.reference_book import ReferenceBook
from exporter.model.server import ServerModel
from exporter.samples import Tick

log = logging.getLogger("kvwatt")


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
        # server -> stage (learning, deriving) -> why it failed at the last tick; logged when it changes
        self.failures: dict[str, dict[str, str]] = {}

    def ingest(self, tick: Tick) -> None:
        t = tick.t
        self.energy.ingest(tick)
        self.prices.ingest(tick)
        for name, sm in self.servers.items():
            self._isolated(name, "learning", self._ingest_server, t, name, sm, tick)
        self.energy.learn(t, {name: is_idle(sm.status, _last(sm), t) for name, sm in self.servers.items()})
        self._persist_references()
        self._persist_evidence()
        self.last_t = t

    def _ingest_server(self, t: float, name: str, sm: ServerModel, tick: Tick) -> None:
        self.energy.attribute(name, sm.history)  # before the read: the interval ending at t gets it
        read = tick.servers.get(name)
        if read is not None:
            sm.read(t, read.status, read.reading)
        sm.learn(t, self.wall_clock())

    def _isolated(self, name: str, stage: str, fn, *args):
        """``fn(*args)`` for one server: an exception in it is that server's failure (its figures unknown, with
        the reason), never the tick's: the other servers, the host-wide sources and ``as_of`` go on. Logged
        once when the failure starts or changes, and once when the stage succeeds again."""
        failed = self.failures.setdefault(name, {})
        try:
            out = fn(*args)
        except Exception as e:  # a bug or an unforeseen value in one server's learning or derivation
            why = f"{type(e).__name__} while {stage} its figures: {e}"[:300]
            if failed.get(stage) != why:
                log.warning("server %s: %s; its figures are unknown until it succeeds", name, why,
                            exc_info=True)  # once per change: where the bug is
            failed[stage] = why
            return None
        if failed.pop(stage, None):
            log.info("server %s: %s its figures succeeds again", name, stage)
        return out

    def _figures(self, t: float, sm: ServerModel):
        """The server's figures, or its figures unknown with the reason when learning or deriving failed."""
        figs = self._isolated(sm.name, "deriving", sm.figures, t, self.servers, self.prices)
        failed = self.failures.get(sm.name)
        return figs if not failed else sm.unknown_figures("; ".join(failed.values()))

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
        servers = tuple(self._figures(t, sm) for sm in self.servers.values())
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
