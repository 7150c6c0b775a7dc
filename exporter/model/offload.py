"""Offloading figures of one server at tick time (methods.md s2, s5, s6, s7): per-server constants, dE/dTPS
against each baseline kind, buffer sizing and the recommendations that follow. Pure functions of the server's
aggregates and repeat windows; the only state (the collapse latch) lives in exporter.model.server."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from exporter.config import Config, ServerConfig
from exporter.derive import compare, economics, kappa, offload
from exporter.derive.energy import prompt_attribution
from exporter.derive.phase_energy import PhaseCosts
from exporter.derive.tier_energy import PRIMARY_TIER
from exporter.figures import BufferFigures, KappaFigures, SavingFigure, WindowFigures
from exporter.recording import profile as profile_mod
from exporter.samples import EngineInfo
from exporter.sources import model_config


@dataclass(frozen=True)
class OffloadSetup:
    """What a server's configuration fixes: model and hardware parameters, kappa_crit, the OFF profile."""

    model: model_config.ModelParams | None
    hardware: kappa.HardwareParams | None
    kappa: KappaFigures
    profile: profile_mod.Profile | None


def setup(s: ServerConfig) -> OffloadSetup:
    """Raises ConfigError for an unreadable config.json or profile (the daemon exits 2 at start-up)."""
    model = model_config.model_params(s.model_config_path, s.model)
    hw = kappa.hardware_params(s.hardware)
    crit = kappa.critical(model, hw) if model and hw else None
    be = kappa.breakeven(model, hw) if model and hw else None
    prof = profile_mod.load(s.recorded_baseline_path) if s.recorded_baseline_path else None
    figures = KappaFigures(critical=crit, breakeven_tokens=be.exported_tokens if be else None,
                           breakeven_tokens_gqa=be.gqa_tokens if be else None,
                           breakeven_tokens_mha=be.mha_tokens if be else None,
                           model_source=model.source if model else None, hardware_source=hw.source if hw else None)
    return OffloadSetup(model, hw, figures, prof)


def _figure(kind: str, energy: economics.Estimate, tput: economics.Estimate | None,
            collapse_holds: bool = False) -> SavingFigure:
    return SavingFigure(baseline=kind, energy_saving=energy.value, energy_saving_stderr=energy.stderr,
                        windows=energy.windows, reference_windows=energy.reference_windows, note=energy.note,
                        throughput_gain=tput.value if tput else None,
                        throughput_gain_stderr=tput.stderr if tput else None, has_throughput=tput is not None,
                        collapse_holds=collapse_holds)


def price(agg, cfg: Config, so: OffloadSetup):
    """J per computed prompt token: the roofline (2 N_act / F at the window's marginal power) when the model
    and hardware are known, else the attribution model's local_compute price (leans high)."""
    if so.model and so.model.active_parameters and so.hardware:
        return (economics.price_from_roofline(so.model.active_parameters, so.hardware.flops_per_second),
                " (roofline price)")
    attr = prompt_attribution(agg, cfg.min_load_seconds, cfg.load_to_compute_cost_ratio)
    return (attr["local_compute"] if attr else None), " (attribution price: an upper bound)"


def savings(agg, on: Sequence[economics.WindowStat], on_total: Sequence[economics.WindowStat],
            off: Sequence[economics.WindowStat] | None, enabled: bool, reference_share: float | None,
            cfg: Config, so: OffloadSetup, costs: PhaseCosts | None = None,
            collapse_holds: bool = False) -> tuple[SavingFigure, ...]:
    """dE / dTPS of one window for each baseline kind available (methods.md s2; docs/offload.md "Energy saving
    and throughput gain").

    ``on``: this server's repeat windows (marginal GPU J/token); ``on_total`` the same with total J/token (for
    a profile recorded without P_idle); ``off``: the paired OFF twin's windows, when configured and watched.
    An OFF server gets ``potential``: the recomputation tax priced as what offloading would reload. ``costs``:
    the server's GPU per-phase costs (methods.md s12), measured or prior: the costs the tax and the saving are
    priced with (derive/energy.tax_in_energy), over the same tokens, seconds and energy (``agg``'s GPU scope), so
    a potential dE is (1 - J_r/J_c) x the window's recompute energy share, exactly; a measured cost's SE is
    carried into dE's. ``collapse_holds``: the (offloading) server's collapse signature holds; each figure's
    ``answer`` then says so whatever its dE."""
    priced = costs if costs is not None and costs.usable else None  # the tax's and the saving's own costs
    j_c, how = price(agg, cfg, so) if priced is None else (None, f" ({priced.source} per-phase price)")
    whole = economics.scope_stat(agg, "gpu")  # the tokens, seconds and energy the tax and the saving are priced on
    if not enabled:
        est = economics.potential(on, reference_share, j_c, cfg.load_to_compute_cost_ratio, priced, whole)
        return (_figure("potential", _noted(est, how), None),)
    out = []
    if off is not None:
        out.append(_figure("paired", *economics.paired(on, off), collapse_holds))
    if so.profile is not None:  # compare like with like: the profile says marginal or total J/token
        out.append(_figure("recorded", *economics.recorded(on if so.profile.energy == "marginal" else on_total,
                                                            so.profile.bands), collapse_holds))
    est = economics.estimated(on, j_c, cfg.load_to_compute_cost_ratio, priced, whole)
    out.append(_figure("estimated", _noted(est, how), None, collapse_holds))
    return tuple(out)


def _noted(est: economics.Estimate, how: str) -> economics.Estimate:
    note = est.note + how if est.value is not None else est.note
    return economics.Estimate(value=est.value, stderr=est.stderr, windows=est.windows, reference_windows=0,
                              kind=est.kind, note=note)


FLAG_SETTING = "--kv-offloading-size"
TIER_SETTING = "cpu_bytes_to_use"


def with_tier_buffer(info: EngineInfo, server: ServerConfig) -> EngineInfo:
    """The engine's info with the CPU tier's configured size as its offload buffer where the engine states none
    (methods.md s6): vLLM's tiered spec takes the CPU tier's size in kv_connector_extra_config.cpu_bytes_to_use
    (bytes; no --kv-offloading-size, and 0.32 exports it nowhere), so it comes from
    servers[].offload_tier_bytes["0:primary"]. Only on a server that offloads; the engine's own size wins."""
    size = server.offload_tier_bytes.get(PRIMARY_TIER)
    if size is None or info.offload_buffer_bytes is not None or not info.offload_enabled:
        return info
    return replace(info, offload_buffer_bytes=size)


def buffer_setting(info: EngineInfo | None, server: ServerConfig) -> str:
    """The engine setting that sizes the buffer: the tiered spec's cpu_bytes_to_use when its size came from
    servers[].offload_tier_bytes["0:primary"], else --kv-offloading-size."""
    tiered = info is not None and info.offload_buffer_bytes is not None and \
        info.offload_buffer_bytes == server.offload_tier_bytes.get(PRIMARY_TIER)
    return TIER_SETTING if tiered else FLAG_SETTING


def buffer(windows: Sequence[WindowFigures], failures: float | None, cfg: Config,
           buffer_bytes: float | None = None, *, sized_by: str = FLAG_SETTING) -> BufferFigures:
    """Undersized from the shortest window (most responsive); the recommendation from the busiest one (size
    for the busy minute, not the average), methods.md s6. ``buffer_bytes``: the pool the engine has."""
    short = min(windows, key=lambda w: w.seconds)
    busiest = max((w for w in windows if w.offload_write_bytes_per_second is not None),
                  key=lambda w: w.offload_write_bytes_per_second, default=None)
    write = short.offload_write_bytes_per_second  # only whether anything is written matters to undersized
    write = write if write is not None else short.offload_write_tokens_per_second
    target, source = residency_target(windows, cfg.p99_tool_latency_seconds)
    under = offload.undersized(short.offload_buffer_residency_seconds, write, failures, target)
    rec = offload.recommended_buffer(busiest.offload_write_bytes_per_second if busiest else None, target,
                                     cfg.buffer_headroom)
    fig = BufferFigures(undersized=under, recommended_bytes=rec, recommended_gib=offload.flag_gib(rec),
                        store_failures=failures, residency_seconds=short.offload_buffer_residency_seconds,
                        write_bytes_per_second=short.offload_write_bytes_per_second,
                        p99_tool_latency_seconds=cfg.p99_tool_latency_seconds, headroom=cfg.buffer_headroom,
                        residency_target_seconds=target, residency_target_source=source,
                        recommended_words=offload.flag_words(rec), size_setting=sized_by)
    return replace(fig, recommended_note=larger_note(fig, short, busiest, buffer_bytes))


def larger_note(b: BufferFigures, short: WindowFigures, busiest: WindowFigures | None,
                buffer_bytes: float | None) -> str:
    """Why the recommendation exceeds a pool the verdict does not call undersized: the verdict reads the
    shortest window's residency against the target, the recommendation the busiest window's write rate times
    the target times the headroom (methods.md s6). '' when it does not exceed it."""
    if b.undersized is not False or b.recommended_bytes is None or busiest is None or not buffer_bytes \
            or b.recommended_bytes <= buffer_bytes:
        return ""
    what = "KV-block reuse-gap p99" if b.residency_target_source == "reuse_gap_p99" else "p99 tool-call latency"
    rate, target = busiest.offload_write_bytes_per_second, b.residency_target_seconds
    parts = [f"the recommendation is larger than the {offload.size_words(buffer_bytes)} pool, which is not "
             f"undersized: it is sized for the busiest window ({busiest.window}, writes at "
             f"{offload.size_words(rate)}/s"]
    if busiest is not short and short.offload_write_bytes_per_second is not None:
        parts.append(f"against {offload.size_words(short.offload_write_bytes_per_second)}/s over the "
                     f"{short.window} the verdict reads")
    return ", ".join(parts) + (f") times the {what} {target:.3g} s times {b.headroom:g} headroom; the verdict "
                               f"needs only residency >= {target:.3g} s")


def residency_target(windows: Sequence[WindowFigures], p99_tool_latency_seconds: float) -> tuple[float, str]:
    """(seconds, source): the residency an offloaded block must outlast (methods.md s6, s11). The measured
    KV-block reuse-gap p99 of the longest window that has one (most samples; vLLM --kv-cache-metrics), else the
    configured p99 tool-call latency. The reuse gaps are those of blocks reused before their eviction, so
    under heavy eviction they lean short: the figure says which was used."""
    for w in sorted(windows, key=lambda w: -w.seconds):
        p99 = (w.kv_reuse_gap_seconds or {}).get("p99")
        if p99 is not None and p99 > 0:
            return p99, "reuse_gap_p99"
    return p99_tool_latency_seconds, "p99_tool_latency"


COLLAPSE_ADVICE = ("Collapse signature: throughput stalled with zero preemptions and the GPU near idle while "
                   "requests wait. Interim mitigation (methods.md s5): a smaller offload buffer keeps preemption "
                   "alive; restart the server to clear the stall.")


def recommendations(collapse_signature: bool | None, buf: BufferFigures | None, cfg: Config) -> tuple[str, ...]:
    """The collapse and buffer checks' words (the whole advice: exporter.model.advice)."""
    out = []
    if collapse_signature:
        out.append(COLLAPSE_ADVICE)
    if buf is not None and buf.undersized:
        out.append(undersized_words(buf, cfg))
    return tuple(out)


def _below(seconds: float, target: float, what: str) -> str:
    """"12 s < p99 tool-call latency 30 s", with the digits that tell 29.6 from 30 (derive.compare)."""
    a, b = compare.printed(seconds, target, ".0f")
    return f"{a} s {compare.OPERATORS[compare.relation(a, b)]} {what} {b} s"


def recommended_words(buf: BufferFigures | None) -> str | None:
    """The --kv-offloading-size value with its bytes ("0.018 (18 MiB)"), from the recommended bytes it states."""
    return None if buf is None else offload.flag_words(buf.recommended_bytes)


def undersized_words(buf: BufferFigures, cfg: Config) -> str:
    """Why the buffer is undersized and the --kv-offloading-size to use (methods.md s6)."""
    p99 = buf.residency_target_seconds or cfg.p99_tool_latency_seconds
    what = "KV-block reuse-gap p99" if buf.residency_target_source == "reuse_gap_p99" else "p99 tool-call latency"
    why = (f"residency {_below(buf.residency_seconds, p99, what)}"
           if buf.residency_seconds is not None and buf.residency_seconds < p99
           else "stores failing (allocation failures / skipped stores)")
    if buf.size_setting == TIER_SETTING:  # the tiered spec's CPU tier: bytes in kv_connector_extra_config
        size = "?" if buf.recommended_bytes is None else f"{math.ceil(buf.recommended_bytes):d}"
        return (f"Offload CPU tier undersized ({why}): set kv_connector_extra_config.cpu_bytes_to_use to {size} "
                "or more (bytes) and servers[].offload_tier_bytes[\"0:primary\"] with it.")
    return (f"Offload buffer undersized ({why}): use --kv-offloading-size {recommended_words(buf) or '?'} "
            "or more (the flag takes GiB).")
