"""One window length of one server between ticks (model/server.py keeps one per configured window): what learn()
derived from the window's aggregate this tick (its KV p95, preemptions/min), the regime with the threshold's
prediction it latches across ticks (methods.md s10), and the window's figures of the tick they were last built
(model/window_figures.py), with when, so that a long window may be rebuilt every few ticks and say its age
(docs/architecture.md "Windows": the staggered long windows)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from exporter.derive.pressure_evidence import window_evidence
from exporter.figures import WindowFigures
from exporter.model import pressure as pressure_model
from exporter.model.pressure import LowPressureReference, ThresholdLearner
from exporter.store import WindowAggregate


@dataclass(kw_only=True, slots=True)
class WindowState:
    """A window's state, mutable: set by learn() every tick it is learned, the regime cleared by restart()."""

    seconds: float
    p95: pressure_model.P95 | None = None     # as of the last learn()
    per_minute: float | None = None           # preemptions/min, as of the last learn()
    learned: bool = False                     # p95 and per_minute were derived (learn() ran on this window)
    predicted: bool | None = None             # the threshold's prediction (hysteresis)
    above: bool | None = None                 # the regime (methods.md s10)
    why: tuple[str, str] | None = None        # the regime's state, reason
    built: WindowFigures | None = None        # the figures last built (model/window_figures.py), kept for reuse
    built_t: float | None = None              # the tick they were built at
    every: int = 1                            # rebuilt every this many ticks (1: every tick, not kept)
    turn: int = 0                             # at the ticks k with k % every == turn (servers take turns)

    def restart(self) -> None:
        """A new epoch, an outage, the server down: no regime is known and no kept figures may be reused."""
        self.predicted = self.above = self.why = None
        self.built = self.built_t = None

    def figures(self, now: float, interval: float, up: bool, build: Callable[[], WindowFigures]) -> WindowFigures:
        """The window's figures of the tick ``now``: built (``build()``) at its turn, else the ones kept, with their
        age. Built whatever the turn when none is kept or they are ``every`` intervals old (a tick was skipped)."""
        kept = self.built
        if kept is not None and self.every > 1 and now - self.built_t < self.every * interval * 0.999 \
                and round(now / interval) % self.every != self.turn:
            return replace(kept, age_seconds=now - self.built_t)
        fig = build()
        keep = self.every > 1 and up and fig.covered_seconds > 0  # an unknown window is not kept: built next tick
        self.built, self.built_t = (fig, now) if keep else (None, None)
        return fig

    def learn(self, agg: WindowAggregate, cfg, pl: ThresholdLearner, reference: LowPressureReference,
              tax_state: str) -> None:
        """The window's regime on positive evidence both ways, its state and reason (methods.md s10); the
        threshold in use only predicts (with hysteresis on the p95's interval)."""
        seconds = self.seconds
        ev = window_evidence(agg, window_seconds=seconds, reference_share=reference.value,
                             reference_spread=reference.spread, tax_state=tax_state,
                             residency=pl.residency_of(agg),  # the engine's own eviction record
                             onset_per_minute=cfg.preemption_onset_per_minute)
        p = self.p95 = ev.p95
        self.per_minute = ev.preemptions_per_minute  # the window's figures reuse it
        self.learned = True
        over = self.predicted = pressure_model.predicted_regime(p, pl.threshold, self.predicted)
        th = pressure_model.threshold_in_use(pl.threshold, pl.source, pl.located)
        v = pressure_model.regime(ev, th, bool(over), pl.quiet_streak)
        self.above = v.above
        self.why = (v.state, v.reason)
