"""One watched server at tick time: its history and windows, its learners (located threshold and low-pressure
reference share: model/pressure/; collapse latch), and the typed figures derived from them once per tick."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Mapping

from exporter import rules
from exporter.config import Config, ServerConfig
from exporter.derive import collapse, economics
from exporter.figures import ServerFigures, WindowFigures, engine_name
from exporter.model import offload as offload_figures
from exporter.model import pressure as pressure_model
from exporter.model import server_figures, window_figures
from exporter.model.cost import Prices
from exporter.model.energy import PhaseLearner
from exporter.model.plausible import ImplausibleCounts
from exporter.model.repeat import RepeatWindows
from exporter.model.window_state import WindowState
from exporter.model.write_model import WriteModelLearner
from exporter.samples import EngineInfo, EngineReading, SourceStatus
from exporter.store import ServerHistory

log = logging.getLogger("kvwatt.model")

# a server unread for this long (intervals, and at least seconds) was out: the windows restart when it is back
OUTAGE_INTERVALS, OUTAGE_MIN_SECONDS = 5, 10.0
_PER_TICK = int(rules.LONG_WINDOWS_BUILT_PER_TICK.default)


class ServerModel:
    def __init__(self, server: ServerConfig, cfg: Config, keep_seconds: float | None = None) -> None:
        self.cfg, self.server = cfg, server
        self._index = next((i for i, s in enumerate(cfg.servers) if s.name == server.name), 0)  # its turn
        self.wall: float | None = None  # the wall clock at the last learn (the engine's process age)
        self.collapse_th = collapse.CollapseThresholds.from_config(cfg)
        self.repeat_seconds = max(cfg.min_load_seconds, 1.0)  # dE/dTPS repeat windows (methods.md s2)
        keep = keep_seconds if keep_seconds is not None else \
            max(max(cfg.windows_seconds), cfg.collapse_reference_seconds + self.collapse_th.recent_seconds) + 60
        self.history = ServerHistory(keep, windows=tuple(cfg.windows_seconds),
                                     grids=(self.repeat_seconds, self.collapse_th.recent_seconds,
                                            cfg.threshold_window_seconds), name=server.name)
        self.reference = pressure_model.LowPressureReference(server.reference_local_compute_share)
        self.pressure = pressure_model.ThresholdLearner.for_server(cfg, server, self.reference)
        self._windows: dict[float, WindowState] = {}  # per window length: its learned regime (model/window_state.py)
        # a read failed since the last good one, and when that was: the windows restart after an outage
        self._down_since: float | None = None
        self.outage_seconds = max(OUTAGE_INTERVALS * cfg.interval_seconds, OUTAGE_MIN_SECONDS)
        self.offload = offload_figures.setup(server)
        # the post-preemption recomputation's write model: fitted from windows without preemption, config.json's
        # coefficients (c_p, c_g) = (a, a + b) a cross-check where given (methods.md s4)
        m = self.offload.model
        a, b = (m.engine_write_bytes_per_token, m.engine_write_bytes_per_logits_token) if m else (None, None)
        self.writes = WriteModelLearner(server.name, self.repeat_seconds, cfg.phase_history_seconds,
                                        (a, a + b) if a and b is not None else None)
        self.status = SourceStatus(source="vllm", server=server.name, up=False, reason="not_read_yet",
                                   duration_seconds=0.0, state="down")
        self.info: EngineInfo | None = None
        self.engine, self.capabilities = engine_name(None), frozenset()
        self.engines = 1  # data-parallel engines of the last read
        self.implausible = ImplausibleCounts(keep)  # intervals with counts no server produces (a counter jump)
        self.gauges: dict[str, float] | None = None  # the last reading's, None while the server is not read
        self.collapse: collapse.CollapseResult | None = None
        self._stale_witnesses: frozenset[str] = frozenset()  # progress counters last seen stale (logged on change)
        self._repeat: dict[bool, RepeatWindows] = {}  # marginal or total J/token: the repeat windows' stats
        self.phase = PhaseLearner.for_server(cfg, server.name, self.repeat_seconds)

    @property
    def name(self) -> str:
        return self.server.name

    # --- tick time: learn -------------------------------------------------------------------------------
    def read(self, t: float, status: SourceStatus, reading: EngineReading | None) -> None:
        self.status = status
        self.gauges = reading.gauges if reading is not None else None  # down: no current value
        if reading is None and not status.up and self._down_since is None:
            self._down_since = t
        if reading is not None:
            self._back(t)
            self.info, self.engine, self.capabilities = (offload_figures.with_tier_buffer(reading.info, self.server),
                                                         engine_name(reading.engine), reading.capabilities)
            self.engines = max(1, sum(1 for e in reading.engine_counters if e))  # data-parallel ranks (bounds)
            self.implausible.observe(self.history.add_reading(t, reading), self.engines, len(self.server.gpus))
            h = self.history  # two processes behind one URL, a switching spelling, a counter going back alone
            problem = "; ".join(p for p in (h.identity.problem, h.spelling.problem, h.regression.problem) if p)
            if problem and status.up:  # (store/identity.py), the first named in the reason code
                joined = f"{problem}; {status.reason}" if status.reason else problem
                self.status = replace(status, reason=joined, state="degraded")

    def _back(self, t: float) -> None:
        """A good read after failed ones: after an outage (unread for ``outage_seconds``) the windows restart, so
        none spans it (docs/pressure.md "Windows, outages and epochs"); a short miss keeps them (the interval
        across it carries its counters and energy, energy-measurement.md rule 10)."""
        last = self.history.last_t
        if self._down_since is not None and last is not None and t - last >= self.outage_seconds:
            self.history.restart_windows(break_run=True)
            self._restart_regime()
        self._down_since = None

    def _restart_regime(self) -> None:
        for st in self._windows.values():
            st.restart()

    def learn(self, now: float, wall: float | None = None) -> None:
        """Once per tick, after every read: slide the windows, then feed the learners (all O(1) in window
        length: they read running aggregates and the buckets completed since the last tick)."""
        self.wall = wall
        self.history.advance(now)
        pl = self.pressure
        if self.info is not None:
            set_aside = pl.epochs_set_aside
            # the process start the store holds (store/identity.py): a start time re-derived at each scrape is
            # the same process, no new epoch per read
            info = replace(self.info, process_start_time_seconds=self.history.identity.process_start)
            pl.engine_facts(info, wall)  # a changed engine sets the evidence aside (model/epoch.py)
            if pl.epochs_set_aside != set_aside:
                self.phase.set_aside()  # and the per-phase costs measured on the old engine
                self.writes.set_aside()  # and its write model
                self.history.restart_windows()  # and no rolling window mixes the two engines
                self._restart_regime()
        pl.observe(self._learnable(pl.width, pl.last_t1, now), wall)
        self.phase.observe(self._learnable(self.repeat_seconds, self.phase.last_t1, now))
        self.writes.observe(self._learnable(self.repeat_seconds, self.writes.last_t1, now))
        if not self.status.up:  # down: no verdict is known, not the last one (every screen reads these)
            self._restart_regime()
            self.collapse = None
            return
        tax_state = self.reference.judgement(pl.points)[0]
        for seconds in self.cfg.windows_seconds:
            self._state(seconds).learn(self.history.aggregate(seconds), self.cfg, pl, self.reference, tax_state)
        self.collapse = self._collapse(now)
        self._note_stale_witnesses(self.collapse)

    def _learnable(self, width: float, last_t1: float, now: float) -> list:
        """The grid buckets completed since a learner's last, less those with implausible counts: nothing is
        learned from a counter jump (model/plausible.py)."""
        return self.implausible.clean(self.history.buckets(width, last_t1, now))

    def _note_stale_witnesses(self, c: collapse.CollapseResult) -> None:
        """One line when a progress counter turns stale (flat while the tokens move: derive/collapse.py), one
        when it moves again; never a line per tick."""
        now = frozenset(c.stale_witnesses)
        for key in sorted(now - self._stale_witnesses):
            log.warning("%s: %s; not a stall", self.name, c.stale_witnesses[key])
        for key in sorted(self._stale_witnesses - now):
            log.info("%s: the %s counter is no longer stale beside the token counters", self.name, key)
        self._stale_witnesses = now

    def _state(self, seconds: float) -> WindowState:
        st = self._windows.get(seconds)
        if st is None:  # the longer windows of many servers take turns (rules.LONG_WINDOWS_BUILT_PER_TICK)
            every = 1 if seconds <= min(self.cfg.windows_seconds) else -(-len(self.cfg.servers) // _PER_TICK)
            st = self._windows[seconds] = WindowState(seconds=seconds, every=every, turn=self._index % every)
        return st

    def _collapse(self, now: float) -> collapse.CollapseResult:
        """methods.md s5; the previous result latches the reference level while the signature holds."""
        th = self.collapse_th
        recent = self.history.aggregate(th.recent_seconds)
        buckets = self.history.buckets(th.recent_seconds, *collapse.reference_span(now, th))
        rates = collapse.reference_rates_from_buckets(buckets, th.recent_seconds)
        enabled = self.info.offload_enabled if self.info else None
        return collapse.evaluate_aggregates(recent, rates, now, enabled, th, self.collapse)

    # --- tick time: figures -----------------------------------------------------------------------------
    def repeat_windows(self, now: float, seconds: float, marginal: bool = True) -> list[economics.WindowStat]:
        """The completed repeat windows inside the last ``seconds`` (fixed grid: shared with a paired twin); each
        bucket's stat is computed once, as it completes, and a window is a slice (model/repeat.py)."""
        kept = self._repeat.get(marginal)
        if kept is None:
            kept = self._repeat[marginal] = RepeatWindows(self.repeat_seconds, marginal)
        return kept.within(self.history, now, seconds)

    def window(self, now: float, seconds: float, peers: Mapping[str, "ServerModel"],
               prices: Prices | None = None) -> WindowFigures:
        """The window's figures (model/window_figures.py; their money and carbon when ``prices`` has a setting),
        built once at its turn (model/window_state.py: a long window of many servers is rebuilt in turn)."""
        return self._state(seconds).figures(now, self.cfg.interval_seconds, self.status.up,
                                            lambda: window_figures.build(self, self._state(seconds), now, peers,
                                                                         prices))

    def figures(self, now: float, peers: Mapping[str, "ServerModel"], prices: Prices | None = None) -> ServerFigures:
        """The server's figures of this tick, each built once (model/server_figures.py)."""
        return server_figures.build(self, now, peers, prices)

    def unknown_figures(self, why: str) -> ServerFigures:
        """The server's figures when learning or deriving them failed (exporter.model.Model): every figure
        unknown, the source degraded with reason ``derivation_failed: <why>``; what was read stays shown."""
        return server_figures.unknown(self, why)

    def unknown_regime(self) -> tuple[str, str]:
        if not self.status.up:
            return "unknown", f"kvwatt cannot read the server ({self.status.reason or self.status.state})"
        return "unknown", "no window with a KV p95"
