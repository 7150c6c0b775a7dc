"""The daemon's offload side: turns each server's history into the offloading series, signatures and
recommendations (methods.md s2, s5, s6, s7), in the shape the collector and web pages read.

Wiring (exporter/daemon.py), like EnergyRuntime:
    self.offload = OffloadRuntime(cfg)                       # __init__: reads config.json files and profiles
    self.offload.observe(state, t)                           # per tick, after add_reading (keeps the latch)
    self.offload.extend_view(v, state, now, self.cfg, {s.cfg.name: s for s in self.servers})   # in views()

``state`` is the daemon's ServerState (cfg, history, info). Everything is appended to ``view.extra`` and each
``WindowView.extra``: "series" rows (name, labels, value) for the collector (None values are left out),
"status" for /api/status, "signatures" and "recommendations" for the landing page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from exporter.config import Config, ServerConfig
from exporter.derive import collapse, economics, kappa, offload
from exporter.derive.energy import prompt_attribution
from exporter.offload import profile as profile_mod

OBSERVE_EVERY_SECONDS = 5.0


@dataclass
class _ServerOffload:
    model: kappa.ModelParams | None
    hardware: kappa.HardwareParams | None
    kappa_crit: float | None
    breakeven: kappa.Breakeven | None
    profile: profile_mod.Profile | None
    collapse: collapse.CollapseResult | None = None
    collapse_t: float | None = None


def _server_setup(s: ServerConfig) -> _ServerOffload:
    """Raises ConfigError for an unreadable config.json or profile (the daemon exits 2 at start-up)."""
    model = kappa.model_params(s.model_config_path, s.model)
    hw = kappa.hardware_params(s.hardware)
    crit = kappa.critical(model, hw) if model and hw else None
    be = kappa.breakeven(model, hw) if model and hw else None
    prof = profile_mod.load(s.recorded_baseline_path) if s.recorded_baseline_path else None
    return _ServerOffload(model, hw, crit, be, prof)


class OffloadRuntime:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.thresholds = collapse.CollapseThresholds.from_config(cfg)
        self.servers = {s.name: _server_setup(s) for s in cfg.servers}

    # --- per tick -------------------------------------------------------------------------------------
    def observe(self, state: Any, now: float, force: bool = False) -> collapse.CollapseResult:
        """Evaluate the collapse signature (at most every 5 s unless forced); keeps the previous result,
        which latches the reference level while the signature holds."""
        so = self.servers[state.cfg.name]
        if not force and so.collapse is not None and so.collapse_t is not None \
                and now - so.collapse_t < OBSERVE_EVERY_SECONDS:
            return so.collapse
        th = self.thresholds
        ivs = state.history.window(now, th.reference_seconds + th.recent_seconds)
        info = getattr(state, "info", None)
        so.collapse = collapse.evaluate(ivs, now, info.offload_enabled if info else None, th, so.collapse)
        so.collapse_t = now
        return so.collapse

    # --- scrape ---------------------------------------------------------------------------------------
    def extend_view(self, view: Any, state: Any, now: float, cfg: Config,
                    states: Mapping[str, Any] | None = None) -> None:
        so = self.servers[state.cfg.name]
        series = view.extra.setdefault("series", [])
        status = view.extra.setdefault("status", {})
        recs = view.extra.setdefault("recommendations", [])
        info = getattr(state, "info", None)
        enabled = info.offload_enabled if info else None

        # collapse signature (s5)
        res = self.observe(state, now, force=True)
        series.append(("kvwatt_collapse_signature", {}, _b(res.signature)))
        for name, value in res.conditions.items():
            series.append(("kvwatt_collapse_condition", {"condition": name}, _b(value)))
        view.extra.setdefault("signatures", {})["collapse"] = res.signature
        status["collapse"] = res.as_status()
        if res.signature:
            recs.append("Collapse signature: throughput stalled with zero preemptions and the GPU near idle "
                        "while requests wait. Interim mitigation (methods.md s5): a smaller offload buffer "
                        "keeps preemption alive; restart the server to clear the stall.")

        # kappa_crit and break-even (s7): constants per server
        series.append(("kvwatt_critical_cached_to_prefill_ratio", {}, so.kappa_crit))
        series.append(("kvwatt_recompute_breakeven_tokens", {}, so.breakeven.exported_tokens if so.breakeven
                       else None))
        status["kappa"] = {"critical": so.kappa_crit,
                           "breakeven_tokens_gqa": so.breakeven.gqa_tokens if so.breakeven else None,
                           "breakeven_tokens_mha": so.breakeven.mha_tokens if so.breakeven else None,
                           "model": so.model.source if so.model else None,
                           "hardware": so.hardware.source if so.hardware else None}

        # buffer (s6) and per-window figures
        buffer_bytes = info.offload_buffer_bytes if info else None
        peak_write, short = None, None
        for w in sorted(view.windows, key=lambda x: x.seconds):
            ivs = state.history.window(now, w.seconds)
            wseries = w.extra.setdefault("series", [])
            wstatus = w.extra.setdefault("status", {})
            rates = offload.transfer_rates(ivs)
            residency = offload.residency(buffer_bytes, rates.write_bytes_per_second)
            wseries += [("kvwatt_offload_write_bytes_per_second", {}, rates.write_bytes_per_second),
                        ("kvwatt_offload_read_bytes_per_second", {}, rates.read_bytes_per_second),
                        ("kvwatt_offload_buffer_residency_seconds", {}, residency),
                        ("kvwatt_cached_to_prefill_ratio", {}, kappa.observed(ivs))]
            wstatus["offload_write_bytes_per_second"] = rates.write_bytes_per_second
            wstatus["offload_buffer_residency_seconds"] = residency
            if rates.write_bytes_per_second is not None:
                peak_write = max(peak_write or 0.0, rates.write_bytes_per_second)
            if short is None:  # the shortest window decides "undersized" (most responsive)
                short = (residency, rates.write_bytes_per_second, offload.store_failures(ivs))
            if enabled is not None:  # ON: measured or estimated saving; OFF: the potential saving
                self._economics(w, ivs, state, now, cfg, so, states or {}, enabled)

        if enabled and short is not None:
            under = offload.undersized(short[0], short[1], short[2], cfg.p99_tool_latency_seconds)
            rec = offload.recommended_buffer(peak_write, cfg.p99_tool_latency_seconds, cfg.buffer_headroom)
            series.append(("kvwatt_offload_buffer_undersized", {}, _b(under)))
            series.append(("kvwatt_offload_recommended_buffer_bytes", {}, rec))
            status["offload_buffer"] = {"undersized": under, "recommended_bytes": rec,
                                        "recommended_gib": offload.gib_ceil(rec), "store_failures": short[2]}
            if under:
                why = (f"residency {short[0]:.0f} s < p99 tool-call latency {cfg.p99_tool_latency_seconds:.0f} s"
                       if short[0] is not None and short[0] < cfg.p99_tool_latency_seconds
                       else "stores failing (allocation failures / skipped stores)")
                recs.append(f"Offload buffer undersized ({why}): use --kv-offloading-size "
                            f"{offload.gib_ceil(rec) or '?'} (GiB) or more.")

    def _economics(self, w: Any, ivs: list, state: Any, now: float, cfg: Config, so: _ServerOffload,
                   states: Mapping[str, Any], enabled: bool = True) -> None:
        """dE / dTPS per window, for each baseline kind available (s2). Repeats: min_load_seconds windows."""
        repeat = max(cfg.min_load_seconds, 1.0)
        start = now - w.seconds

        def windows(intervals: list, marginal: bool = True) -> list[economics.WindowStat]:
            return economics.window_stats(intervals, repeat, "gpu", marginal=marginal, start=start, end=now,
                                          anchor=now)

        on = windows(ivs)
        results: list[tuple[economics.Estimate, economics.Estimate | None]] = []
        if not enabled:
            reference = getattr(getattr(state, "reference", None), "value", None)
            price, how = self._price(ivs, cfg, so)
            est = economics.potential(on, reference, price, cfg.load_to_compute_cost_ratio)
            results.append((economics.Estimate(est.value, est.stderr, est.windows, 0, "estimated",
                                               est.note + how if est.value is not None else est.note), None))
            self._export(w, results)
            return
        pair = state.cfg.pair_off_server
        if pair and pair in states:
            results.append(economics.paired(on, windows(states[pair].history.window(now, w.seconds))))
        if so.profile is not None:  # compare like with like: the profile says marginal or total J/token
            on_p = on if so.profile.energy == "marginal" else windows(ivs, marginal=False)
            results.append(economics.recorded(on_p, so.profile.bands))
        results.append((self._estimated(ivs, on, cfg, so), None))
        self._export(w, results)

    @staticmethod
    def _export(w: Any, results: list) -> None:
        wseries = w.extra["series"]
        status = w.extra["status"].setdefault("energy_saving", {})
        for energy, tput in results:
            lab = {"baseline": energy.kind}
            wseries += [("kvwatt_energy_saving_ratio", lab, energy.value),
                        ("kvwatt_energy_saving_stderr_ratio", lab, energy.stderr),
                        ("kvwatt_comparison_windows", lab, energy.windows if energy.value is not None else None)]
            if tput is not None:
                wseries += [("kvwatt_throughput_gain_ratio", lab, tput.value),
                            ("kvwatt_throughput_gain_stderr_ratio", lab, tput.stderr)]
            status[energy.kind] = {"dE": energy.value, "dE_stderr": energy.stderr, "windows": energy.windows,
                                   "reference_windows": energy.reference_windows, "note": energy.note,
                                   "dTPS": tput.value if tput else None, "dTPS_stderr": tput.stderr if tput else None}

    def _price(self, ivs: list, cfg: Config, so: _ServerOffload):
        """J per computed prompt token: the roofline (2 N_act / F at the window's marginal power) when the
        model and hardware are known, else the attribution model's local_compute price (leans high)."""
        if so.model and so.model.active_parameters and so.hardware:
            return economics.price_from_roofline(so.model.active_parameters, so.hardware.flops_per_second), \
                " (roofline price)"
        attr = prompt_attribution(ivs, cfg.min_load_seconds, cfg.load_to_compute_cost_ratio)
        return (attr["local_compute"] if attr else None), " (attribution price: an upper bound)"

    def _estimated(self, ivs: list, on: list, cfg: Config, so: _ServerOffload) -> economics.Estimate:
        price, how = self._price(ivs, cfg, so)
        est = economics.estimated(on, price, cfg.load_to_compute_cost_ratio)
        return economics.Estimate(est.value, est.stderr, est.windows, 0, "estimated",
                                  est.note + how if est.value is not None else est.note)


def _b(v: bool | None) -> float | None:
    return None if v is None else (1.0 if v else 0.0)
