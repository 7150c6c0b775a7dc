"""One watched server at tick time: its history and windows, its learners (located threshold and low-pressure
reference share: model/pressure/; collapse latch), and the typed figures derived from them once per tick."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Mapping

from exporter.config import Config, ServerConfig, format_window, redacted_url
from exporter.derive import (
    collapse,
    economics,
    kappa,
    offload,
    preemption,
    pressure,
    recompute,
    residency,
    tier_energy,
)
from exporter.derive import energy as derive_energy
from exporter.derive.pressure_evidence import window_evidence
from exporter.figures import EnergyFigure, ServerFigures, WindowFigures, engine_name
from exporter.keys import labelled
from exporter.model import advice as advice_model
from exporter.model import offload as offload_figures
from exporter.model import pressure as pressure_model
from exporter.model.cost import Prices
from exporter.model.energy import PhaseLearner
from exporter.model.plausible import ImplausibleCounts
from exporter.model.repeat import RepeatWindows
from exporter.model.write_model import WriteModelLearner
from exporter.samples import EngineInfo, EngineReading, SourceStatus
from exporter.store import ServerHistory, WindowAggregate, identity

log = logging.getLogger("kvwatt.model")

SCOPES = ("gpu", "host")
# a server unread for this long (intervals, and at least seconds) was out: the windows restart when it is back
OUTAGE_INTERVALS, OUTAGE_MIN_SECONDS = 5, 10.0


class ServerModel:
    def __init__(self, server: ServerConfig, cfg: Config, keep_seconds: float | None = None) -> None:
        self.cfg, self.server = cfg, server
        self._wall: float | None = None  # the wall clock at the last learn (the engine's process age)
        self.collapse_th = collapse.CollapseThresholds.from_config(cfg)
        self.repeat_seconds = max(cfg.min_load_seconds, 1.0)  # dE/dTPS repeat windows (methods.md s2)
        keep = keep_seconds if keep_seconds is not None else \
            max(max(cfg.windows_seconds), cfg.collapse_reference_seconds + self.collapse_th.recent_seconds) + 60
        self.history = ServerHistory(keep, windows=tuple(cfg.windows_seconds),
                                     grids=(self.repeat_seconds, self.collapse_th.recent_seconds,
                                            cfg.threshold_window_seconds), name=server.name)
        self.reference = pressure_model.LowPressureReference(server.reference_local_compute_share)
        self.pressure = pressure_model.ThresholdLearner(
            width_seconds=cfg.threshold_window_seconds,
            keep_windows=max(int(cfg.threshold_history_seconds // cfg.threshold_window_seconds), 1),
            min_windows=cfg.threshold_min_windows, onset_per_minute=cfg.preemption_onset_per_minute,
            configured_threshold=cfg.kv_pressure_threshold_ratio,
            use_located=cfg.kv_pressure_threshold_source == "located", reference=self.reference, name=server.name,
            sample_share=server.kv_cache_metrics_sample, p99_tool_latency_seconds=cfg.p99_tool_latency_seconds)
        self._p95: dict[float, pressure_model.P95] = {}  # per window length, as of the last learn()
        self._per_minute: dict[float, float | None] = {}  # per window length: preemptions/min, as of learn()
        self._predicted: dict[float, bool | None] = {}  # per window length: the threshold's prediction (hysteresis)
        self._regime: dict[float, bool | None] = {}  # per window length: the regime (methods.md s10)
        self._regime_why: dict[float, tuple[str, str]] = {}  # per window length: the regime's state, reason
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
        self.phase = PhaseLearner(name=server.name, width=self.repeat_seconds,
                                  history_seconds=cfg.phase_history_seconds, min_windows=cfg.phase_min_windows,
                                  max_condition=cfg.phase_max_condition,
                                  load_to_compute_cost_ratio=cfg.load_to_compute_cost_ratio)

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
        self._predicted.clear()
        self._regime.clear()
        self._regime_why.clear()

    def learn(self, now: float, wall: float | None = None) -> None:
        """Once per tick, after every read: slide the windows, then feed the learners (all O(1) in window
        length: they read running aggregates and the buckets completed since the last tick)."""
        self._wall = wall
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
            self._learn_regime(seconds, tax_state)
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

    def _again(self, agg: WindowAggregate, seconds: float) -> recompute.PreemptionRecompute:
        """The window's post-preemption recomputation over the write model in use, judged by its state."""
        m = self.writes.model
        r = recompute.preemption_recompute(agg, m.bytes_per_token, m.bytes_per_logits_token, seconds,
                                           m.reason or recompute.NO_WRITE_MODEL)
        return recompute.judged(r, m)

    def _learn_regime(self, seconds: float, tax_state: str) -> None:
        """The window's regime on positive evidence both ways, its state and reason (methods.md s10); the
        threshold in use only predicts (with hysteresis on the p95's interval)."""
        pl, agg = self.pressure, self.history.aggregate(seconds)
        ev = window_evidence(agg, window_seconds=seconds, reference_share=self.reference.value,
                             reference_spread=self.reference.spread, tax_state=tax_state,
                             residency=pl.residency_of(agg),  # the engine's own eviction record
                             onset_per_minute=self.cfg.preemption_onset_per_minute)
        p = self._p95[seconds] = ev.p95
        self._per_minute[seconds] = ev.preemptions_per_minute  # window() reuses it
        over = self._predicted[seconds] = pressure_model.predicted_regime(p, pl.threshold,
                                                                          self._predicted.get(seconds))
        th = pressure_model.threshold_in_use(pl.threshold, pl.source, pl.located)
        v = pressure_model.regime(ev, th, bool(over), pl.quiet_streak)
        self._regime[seconds] = v.above
        self._regime_why[seconds] = (v.state, v.reason)

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
        """The window's figures, built once (with their money and carbon when ``prices`` has a setting)."""
        cfg = self.cfg
        agg: WindowAggregate = self.history.aggregate(seconds)
        covered = agg.covered_seconds
        if agg.n == 0 or not self.status.up:  # down: nothing of it is known now (model/advice.py says so too)
            why = self._regime_why.get(seconds, self._unknown_regime())
            return WindowFigures(window=format_window(seconds), seconds=seconds, covered_seconds=covered,
                                 regime_state=why[0], regime_reason=why[1])
        p95_interval = self._p95.get(seconds) or pressure_model.p95_of(agg)  # learn() computed it this tick
        p95 = p95_interval.value
        per_minute = self._per_minute[seconds] if seconds in self._per_minute else \
            pressure.preemptions_per_minute(agg)  # learn() derived it this tick
        shares = recompute.token_shares(recompute.token_counts(agg))
        flops, flops_per_token = recompute.mfu_view(agg, agg.delta("generation_tokens"))
        rates = offload.transfer_rates(agg)
        tokens = offload.token_rates(agg)
        buffer_bytes = self.info.offload_buffer_bytes if self.info else None
        capacity = pressure.waiting_for_capacity(agg)
        regime_state, regime_reason = self._regime_why.get(seconds, self._unknown_regime())
        again = self._again(agg, seconds)
        again_watts = {c.scope: w for c in self.phase.figures() if (w := recompute.preemption_recompute_watts(
            again, derive_energy.priced_with_recomputation(agg, c, again.tokens_per_second))) is not None}
        energy = self._energy(agg)
        priced = derive_energy.tax_in_energy(agg, self.reference.value, self.phase.figures(),
                                             self.info.offload_enabled if self.info else None,
                                             cfg.load_to_compute_cost_ratio)
        costs = prices.costs(energy, priced["recompute_tax_watts"], priced["offload_saved_watts"]) if prices else ()
        tiers_priced = self._tier_energy(agg)
        return WindowFigures(
            regime_state=regime_state, regime_reason=regime_reason,
            requests_waiting_for_kv_capacity=capacity.mean if capacity else None,
            requests_waiting_for_kv_capacity_share=capacity.share if capacity else None,
            window=format_window(seconds), seconds=seconds, covered_seconds=covered,
            kv_usage_p95=p95, kv_usage_max=pressure.kv_usage_quantile(agg, 1.0),
            kv_usage_p95_low=p95_interval.low, kv_usage_p95_high=p95_interval.high,
            above_threshold=self._regime.get(seconds), preemptions_per_minute=per_minute,
            kv_pools_above_threshold=pressure.pools_above_threshold(agg, self.pressure.threshold),
            preemption_onset=pressure.preemption_onset(per_minute, covered, seconds, cfg.preemption_onset_per_minute),
            generation_tokens_per_second=pressure.rate_per_second(agg, "generation_tokens"),
            token_shares=shares, cached_tier_shares=recompute.cached_tier_shares(agg),
            recompute_tax=recompute.window_tax(shares, self.reference.value),
            flops_per_second=flops, flops_per_generated_token=flops_per_token,
            energy=energy, costs=costs,
            prompt_energy_per_token=derive_energy.prompt_attribution(agg, cfg.min_load_seconds,
                                                                     cfg.load_to_compute_cost_ratio),
            offload_write_bytes_per_second=rates.write_bytes_per_second,
            offload_read_bytes_per_second=rates.read_bytes_per_second,
            offload_write_tokens_per_second=tokens.write_tokens_per_second,
            offload_read_tokens_per_second=tokens.read_tokens_per_second,
            offload_buffer_residency_seconds=self._residency(buffer_bytes, rates, tokens),
            cached_to_prefill_ratio=kappa.observed(agg),
            savings=self._savings(agg, now, seconds, peers), **self._newest_series(agg),
            preemption_recompute=again, preemption_recompute_watts=again_watts or None,
            implausible_counts=self.implausible.within(now, seconds),
            offload_tier_energy=tiers_priced,
            second_tier_energy_saving=tier_energy.second_tier_saving(tiers_priced, agg, "gpu"),
            **self._residency_figures(agg), **priced)

    def _tier_energy(self, agg: WindowAggregate) -> tuple:
        """Each offload tier's reloads (methods.md s14): kappa, bytes and hop energy per token from the counters and
        the configured energy per byte of each hop, priced against a recompute on the GPU scope where it has
        per-phase costs; only on a server that offloads."""
        gpu = next((c for c in self.phase.figures() if c.scope == "gpu"), None)
        if not (self.info and self.info.offload_enabled):
            return ()
        cfg = self.cfg
        hops = tier_energy.HopEnergy(host_memory=cfg.host_memory_joules_per_byte,
                                     host_link=cfg.host_link_joules_per_byte, disk=cfg.disk_joules_per_byte)
        return tier_energy.tier_energy(agg, gpu, hops, cfg.load_to_compute_cost_ratio)

    def _residency(self, buffer_bytes: float | None, rates: offload.TransferRates,
                   tokens: offload.TokenRates) -> float | None:
        """Buffer / write rate in bytes; for an engine that sizes its buffer and counts its stores in tokens
        (SGLang HiCache), in tokens (methods.md s6)."""
        if buffer_bytes is not None:
            return offload.residency(buffer_bytes, rates.write_bytes_per_second)
        return offload.residency((self.gauges or {}).get("offload_buffer_tokens"), tokens.write_tokens_per_second)

    def _newest_series(self, agg: WindowAggregate) -> dict:
        """The figures from vLLM's newest series (0.30+, docs/vllm-metrics.md): preemptions per request, admission rejections,
        offload tiers; each absent where the engine does not export its series."""
        hist = preemption.histogram(agg)
        return {"preemptions_per_request": preemption.quantiles(hist),
                "preempted_requests_share": preemption.preempted_share(hist),
                "admission_rejections_per_minute": pressure.labelled_per_minute(agg, "admission_rejections"),
                "preemptions_by_reason_per_minute": pressure.labelled_per_minute(agg, "preemptions_by_reason"),
                "offload_tiers": offload.tier_flows(agg, self.server.offload_tier_bytes,
                                                    self.cfg.p99_tool_latency_seconds, self._link_critical())}

    def _link_critical(self) -> tuple[float, float] | None:
        """(s7's kappa_crit over the host link, the link's bytes/s) for each tier's own (methods.md s14)."""
        crit, hw = self.offload.kappa.critical, self.offload.hardware
        return None if crit is None or hw is None else (crit, hw.host_device_bytes_per_second)

    def _residency_figures(self, agg: WindowAggregate) -> dict:
        """KV-block residency from vLLM's --kv-cache-metrics histograms and the evidence it gives (methods.md
        s11); all absent where the engine does not export them."""
        r = residency.window_residency(agg, self.info.block_size if self.info else None,
                                       self.server.kv_cache_metrics_sample, self.cfg.p99_tool_latency_seconds,
                                       self._process_age_seconds())
        ev = residency.residency_evidence(r)
        return {"kv_evicted_blocks_per_second": r.evicted_blocks_per_second,
                "kv_evictions_per_prompt_block": r.evictions_per_prompt_block,
                "kv_idle_before_evict_seconds": r.idle_before_evict_seconds,
                "kv_reuse_gap_seconds": r.reuse_gap_seconds,
                "kv_evicted_before_reuse_ratio": r.evicted_before_reuse_ratio,
                "kv_before_reuse_yardstick": r.yardstick, "kv_before_reuse_yardstick_seconds": r.yardstick_seconds,
                "residency_evidence": ev.kind, "residency_evidence_reason": ev.reason}

    def _process_age_seconds(self) -> float | None:
        """Wall seconds since the engine's process started (process_start_time_seconds), plus the clock slack
        between the engine's host and kvwatt's; None when unknown or when the start lies ahead of kvwatt's clock
        (two clocks that disagree: no age to bound anything by)."""
        start, wall = self.history.identity.process_start, self._wall
        if start is None or wall is None or wall <= start:
            return None
        return wall - start + identity.CLOCK_SLACK_SECONDS

    def _energy(self, agg: WindowAggregate) -> tuple[EnergyFigure, ...]:
        out = []
        for scope in SCOPES:
            basis = derive_energy.window_energy(agg, scope)
            if basis is None:
                continue
            fig = derive_energy.qualified(basis, self.cfg.min_load_seconds)
            out.append(EnergyFigure(scope, basis, fig.joules_per_token if fig else None,
                                    fig.marginal_joules_per_token if fig else None))
        return tuple(out)

    def _savings(self, agg: WindowAggregate, now: float, seconds: float, peers: Mapping[str, "ServerModel"]):
        enabled = self.info.offload_enabled if self.info else None
        if enabled is None:
            return ()
        on = self.repeat_windows(now, seconds)
        total = self.repeat_windows(now, seconds, marginal=False) if self.offload.profile is not None else on
        pair = peers.get(self.server.pair_off_server or "")
        off = pair.repeat_windows(now, seconds) if pair is not None and enabled else None
        collapsed = bool(enabled and self.collapse is not None and self.collapse.signature)  # learn() judged it
        return offload_figures.savings(agg, on, total, off, enabled, self.reference.value, self.cfg, self.offload,
                                       self.phase.costs.get("gpu"), collapse_holds=collapsed)

    def figures(self, now: float, peers: Mapping[str, "ServerModel"], prices: Prices | None = None) -> ServerFigures:
        """The server's figures of this tick, each built once: every window (costs included), then the server's
        figures, then the advice read from them (set while they are built: advice_model.advisor)."""
        windows = tuple(self.window(now, s, peers, prices) for s in self.cfg.windows_seconds)
        enabled = self.info.offload_enabled if self.info else None
        buf = None
        if enabled and windows:
            short = min(self.cfg.windows_seconds)
            buf = offload_figures.buffer(windows, offload.store_failures(self.history.aggregate(short)), self.cfg,
                                         self.info.offload_buffer_bytes,
                                         sized_by=offload_figures.buffer_setting(self.info, self.server))
        return ServerFigures(
            name=self.name, url=redacted_url(self.server.url), status=self.status, info=self.info,
            engine=self.engine, capabilities=self.capabilities,
            threshold=self.cfg.kv_pressure_threshold_ratio, reference_share=self.reference.value,
            reference_kind=self.reference.kind, windows=windows, collapse=self.collapse, buffer=buf,
            kappa=self.offload.kappa,
            tiers=offload.tier_state(self.gauges), kv_fetch_waiting=labelled(self.gauges or {}, "kv_fetch") or None,
            located=self.pressure.located, threshold_in_use=self.pressure.threshold,
            threshold_source=self.pressure.source, evidence_windows=len(self.pressure.points),
            reference_windows=self.reference.windows, reference_spread=self.reference.spread,
            phase_costs=self.phase.figures(), engines=self.engines, gpu_ids=self.server.gpus,
            **self._judgements(windows), advise=advice_model.advisor(self.cfg))  # "what do I do?", read from them

    def unknown_figures(self, why: str) -> ServerFigures:
        """The server's figures when learning or deriving them failed (exporter.model.Model): every figure
        unknown, the source degraded with reason ``derivation_failed: <why>``; what was read stays shown."""
        status = replace(self.status, state="degraded" if self.status.up else self.status.state,
                         reason="; ".join(r for r in (f"derivation_failed: {why}", self.status.reason) if r))
        return ServerFigures(
            name=self.name, url=redacted_url(self.server.url), status=status, info=self.info, engine=self.engine,
            capabilities=self.capabilities, threshold=self.cfg.kv_pressure_threshold_ratio, reference_share=None,
            reference_kind=self.reference.kind, windows=(), regime_reason=f"figures not derived ({why})",
            threshold_reason=why, reference_reason=why, tax_reason=why)

    def _unknown_regime(self) -> tuple[str, str]:
        if not self.status.up:
            return "unknown", f"kvwatt cannot read the server ({self.status.reason or self.status.state})"
        return "unknown", "no window with a KV p95"

    def _judgements(self, windows) -> dict:
        """Each learned figure's state and reason, and the evidence and epoch they rest on (methods.md s10)."""
        pl = self.pressure
        threshold_state, threshold_reason = pl.judgement()
        reference_state, reference_reason = self.reference.judgement(pl.points)
        tax_state, tax_reason = pl.tax_judgement(reference_state, reference_reason)
        if not self.status.up:  # down: the tax of now is not known, whatever the reference
            tax_state, tax_reason = self._unknown_regime()
        regime_seconds = next((w.seconds for w in windows if w.above_threshold is not None), None)
        # no window has a regime: the first window's own reason (why neither answer is shown)
        unknown = self._regime_why.get(windows[0].seconds if windows else None, self._unknown_regime())
        regime_state, regime_reason = self._regime_why.get(regime_seconds, unknown)
        return {"threshold_state": threshold_state, "threshold_reason": threshold_reason,
                "reference_state": reference_state, "reference_reason": reference_reason,
                "tax_state": tax_state, "tax_reason": tax_reason,  # the reference's, told the residency evidence
                "regime_state": regime_state, "regime_reason": regime_reason, "evidence": pl.evidence(),
                "epoch_started_wall": pl.epoch.started_wall, "epoch_cause": pl.epoch.cause}
