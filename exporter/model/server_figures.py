"""One server's figures of a tick (``ServerFigures``), built from its model (model/server.py ServerModel): every
window once (model/window_figures.py, costs included), then the server's figures, then the advice read from them
(set while they are built: model/advice.py advisor). The model keeps the learners and latches; this module reads them
(``sm``: the server's ServerModel, not imported here: model/server.py imports this module)."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from exporter.config import redacted_url
from exporter.derive import offload
from exporter.figures import ServerFigures
from exporter.model import advice as advice_model
from exporter.model import offload as offload_figures
from exporter.model.cost import Prices
from exporter.rules.keys import labelled


def build(sm, now: float, peers: Mapping, prices: Prices | None) -> ServerFigures:
    """The server's figures of this tick, each built once: every window (costs included), then the server's
    figures, then the advice read from them."""
    cfg = sm.cfg
    windows = tuple(sm.window(now, s, peers, prices) for s in cfg.windows_seconds)
    enabled = sm.info.offload_enabled if sm.info else None
    buf = None
    if enabled and windows:
        short = min(cfg.windows_seconds)
        buf = offload_figures.buffer(windows, offload.store_failures(sm.history.aggregate(short)), cfg,
                                     sm.info.offload_buffer_bytes,
                                     sized_by=offload_figures.buffer_setting(sm.info, sm.server))
    return ServerFigures(
        name=sm.name, url=redacted_url(sm.server.url), status=sm.status, info=sm.info,
        engine=sm.engine, capabilities=sm.capabilities,
        threshold=cfg.kv_pressure_threshold_ratio, reference_share=sm.reference.value,
        reference_kind=sm.reference.kind, windows=windows, collapse=sm.collapse, buffer=buf,
        kappa=sm.offload.kappa,
        tiers=offload.tier_state(sm.gauges), kv_fetch_waiting=labelled(sm.gauges or {}, "kv_fetch") or None,
        located=sm.pressure.located, threshold_in_use=sm.pressure.threshold,
        threshold_source=sm.pressure.source, evidence_windows=len(sm.pressure.points),
        reference_windows=sm.reference.windows, reference_spread=sm.reference.spread,
        phase_costs=sm.phase.figures(), engines=sm.engines, gpu_ids=sm.server.gpus,
        **_judgements(sm, windows), advise=advice_model.advisor(cfg))  # "what do I do?", read from them


def unknown(sm, why: str) -> ServerFigures:
    """The server's figures when learning or deriving them failed: every figure unknown, the source degraded with
    reason ``derivation_failed: <why>``; what was read stays shown."""
    status = replace(sm.status, state="degraded" if sm.status.up else sm.status.state,
                     reason="; ".join(r for r in (f"derivation_failed: {why}", sm.status.reason) if r))
    return ServerFigures(
        name=sm.name, url=redacted_url(sm.server.url), status=status, info=sm.info, engine=sm.engine,
        capabilities=sm.capabilities, threshold=sm.cfg.kv_pressure_threshold_ratio, reference_share=None,
        reference_kind=sm.reference.kind, windows=(), regime_reason=f"figures not derived ({why})",
        threshold_reason=why, reference_reason=why, tax_reason=why)


def _judgements(sm, windows) -> dict:
    """Each learned figure's state and reason, and the evidence and epoch they rest on (methods.md s10)."""
    pl = sm.pressure
    threshold_state, threshold_reason = pl.judgement()
    reference_state, reference_reason = sm.reference.judgement(pl.points)
    tax_state, tax_reason = pl.tax_judgement(reference_state, reference_reason)
    if not sm.status.up:  # down: the tax of now is not known, whatever the reference
        tax_state, tax_reason = sm.unknown_regime()
    # the regime of the first window that has one, as of its figures (a long window's may be a few ticks old); no
    # window has a regime: the first window's own reason (why neither answer is shown)
    w = next((w for w in windows if w.above_threshold is not None), windows[0] if windows else None)
    regime_state, regime_reason = (w.regime_state, w.regime_reason) if w is not None else sm.unknown_regime()
    return {"threshold_state": threshold_state, "threshold_reason": threshold_reason,
            "reference_state": reference_state, "reference_reason": reference_reason,
            "tax_state": tax_state, "tax_reason": tax_reason,  # the reference's, told the residency evidence
            "regime_state": regime_state, "regime_reason": regime_reason, "evidence": pl.evidence(),
            "epoch_started_wall": pl.epoch.started_wall, "epoch_cause": pl.epoch.cause}
