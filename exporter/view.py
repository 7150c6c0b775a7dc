"""Everything kvwatt knows about one server at one instant, computed from its history by the pure
derivations. The collector renders it as /metrics, the web module as /api/status and the landing page,
so both always agree. None means unknown: the collector omits the series rather than print a fake 0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exporter.config import Config, ServerConfig, format_window
from exporter.derive import pressure, recompute
from exporter.derive.window import covered_seconds, sum_delta
from exporter.samples import SourceStatus, VllmInfo
from exporter.store import ServerHistory


@dataclass
class WindowView:
    window: str
    seconds: float
    covered_seconds: float
    kv_usage_p95: float | None = None
    kv_usage_max: float | None = None
    above_threshold: bool | None = None
    preemptions_per_minute: float | None = None
    preemption_onset: bool | None = None
    generation_tokens_per_second: float | None = None
    token_shares: dict[str, float] | None = None
    recompute_tax: float | None = None
    flops_per_second: float | None = None
    flops_per_generated_token: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # figures added by the energy/offload derivations


@dataclass
class ServerView:
    name: str
    url: str
    status: SourceStatus
    info: VllmInfo | None
    threshold: float
    reference_share: float | None
    reference_kind: str
    windows: list[WindowView]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def regime(self) -> str:
        """'above' / 'below' threshold on the shortest window with a p95, else 'unknown'."""
        for w in self.windows:
            if w.above_threshold is not None:
                return "above" if w.above_threshold else "below"
        return "unknown"


def window_view(history: ServerHistory, now: float, seconds: float, cfg: Config,
                reference: float | None) -> WindowView:
    ivs = history.window(now, seconds)
    covered = covered_seconds(ivs)
    w = WindowView(format_window(seconds), seconds, covered)
    if not ivs:
        return w
    w.kv_usage_p95 = pressure.kv_usage_quantile(ivs, 0.95)
    w.kv_usage_max = pressure.kv_usage_quantile(ivs, 1.0)
    w.above_threshold = pressure.above_threshold(w.kv_usage_p95, cfg.kv_pressure_threshold_ratio)
    per_second = pressure.rate_per_second(ivs, "preemptions")
    w.preemptions_per_minute = None if per_second is None else per_second * 60.0
    w.preemption_onset = pressure.preemption_onset(w.preemptions_per_minute, covered, seconds,
                                                   cfg.preemption_onset_per_minute)
    w.generation_tokens_per_second = pressure.rate_per_second(ivs, "generation_tokens")
    w.token_shares = recompute.token_shares(recompute.token_counts(ivs))
    w.recompute_tax = recompute.recompute_tax(
        w.token_shares["local_compute"] if w.token_shares else None, reference)
    w.flops_per_second, w.flops_per_generated_token = recompute.mfu_view(
        ivs, sum_delta(ivs, "generation_tokens"))
    return w


def server_view(server: ServerConfig, history: ServerHistory, status: SourceStatus, info: VllmInfo | None,
                reference: recompute.ReferenceShare, now: float, cfg: Config) -> ServerView:
    ref = reference.value
    windows = [window_view(history, now, s, cfg, ref) for s in cfg.windows_seconds]
    return ServerView(server.name, server.url, status, info, cfg.kv_pressure_threshold_ratio, ref,
                      reference.kind, windows)
