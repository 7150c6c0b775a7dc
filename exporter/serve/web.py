"""HTTP endpoints: /metrics (the collector), / (landing page, exporter.serve.page), /healthz, /api/status (JSON),
/runbook (the alert runbook shipped with this version, exporter.serve.runbook).

Each serialises the daemon's latest Snapshot and nothing else: no figure is computed here, and a request
cannot change state. The metric families are collected once per tick, with the snapshot (exporter.daemon),
and each form of the exposition (text or OpenMetrics, plain or gzipped: negotiated as prometheus_client does,
exporter/serve/exposition.py) is serialised at most once per tick, the text format with the tick. A scrape of a
form already serialised costs the loop a dict lookup and a memory copy; a form not yet serialised, or a
``name[]`` subset, is serialised in a thread of its own (never the tick's), so a scrape flood never slows
sampling.
/api/status and the landing page follow the same pattern (``Views``): each is serialised at most once per
snapshot, in that render thread, on the first request that asks for it after a tick; every other request of the
tick is served the same bytes. Built on the loop for every request, 50 clients asking for them took the loop from
kvwatt's own engine reads (half the reads of 8 servers lost here, 4-6 of 8 servers marked down in the issue's
run; tests/test_web_page_flood.py, bench/bench_page_flood.py).

Connections are bounded (exporter/serve/connections.py: a cap, eviction of the least recently active, TLS per
connection); a connection that sends no complete request within ``read_timeout_seconds`` -- idle after a
response, or a client trickling its headers -- is closed by aiohttp's keep-alive timer, armed at connect and
after each response. With a web configuration file (exporter/serve/webconfig.py) every endpoint needs basic auth
and/or is served over TLS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from exporter import __version__, catalog
from exporter.figures import ServerFigures, Snapshot, WindowFigures
from exporter.samples import SourceStatus
from exporter.serve import page, runbook
from exporter.serve.connections import ConnectionGuard, GuardedSite
from exporter.serve.exposition import Exposition, wanted_names
from exporter.serve.webconfig import AUTH_RETRY_AFTER_SECONDS, BasicAuth, Verdict, WebConfig

log = logging.getLogger("kvwatt.web")
MALFORMED_LOG_INTERVAL_SECONDS = 60.0


@dataclass(frozen=True)
class Block:
    """A structured part of a server's or a window's /api/status dict that is not one figure (energy by scope,
    savings by baseline, ...): the keys it writes (one nested key, or a few flat ones), the catalog declarations
    it serialises, and its small serialiser, which returns those keys, or {} to leave them out."""

    keys: tuple[str, ...]
    serialises: tuple[catalog.MetricDef, ...]
    write: Callable[[object], dict]


def _named(*names: str) -> tuple[catalog.MetricDef, ...]:
    return tuple(catalog.get(n) for n in names)  # a name missing from the catalog fails at import


def _energy_json(w: WindowFigures) -> dict:
    return {"energy": {e.scope: {"joules": e.basis.energy_joules, "idle_joules": e.basis.idle_joules,
                                 "generated_tokens": e.basis.tokens, "seconds": e.basis.seconds,
                                 "loaded_seconds": e.basis.loaded_seconds, "joules_per_token": e.joules_per_token,
                                 "marginal_joules_per_token": e.marginal_joules_per_token} for e in w.energy}}


def _savings_json(w: WindowFigures) -> dict:
    savings = {sv.baseline: {"dE": sv.energy_saving, "dE_stderr": sv.energy_saving_stderr, "verdict": sv.verdict,
                             "answer": sv.answer,
                             "windows": sv.windows, "reference_windows": sv.reference_windows, "note": sv.note,
                             "dTPS": sv.throughput_gain, "dTPS_stderr": sv.throughput_gain_stderr}
               for sv in w.savings}
    return {"energy_saving": savings} if savings else {}


def _tiers_json(w: WindowFigures) -> dict:
    return {"offload_tiers": {t.tier: {"write_bytes_per_second": t.write_bytes_per_second,
                                       "read_bytes_per_second": t.read_bytes_per_second,
                                       "chunk_hit_ratio": t.chunk_hit_ratio, "job_failures": t.job_failures,
                                       "residency_seconds": t.residency_seconds, "undersized": t.undersized,
                                       "dropped_stores_per_second": t.dropped_stores_per_second,
                                       "dropped_blocks_per_second": t.dropped_blocks_per_second,
                                       "failed_promotions_per_second": t.failed_promotions_per_second,
                                       "failed_cascades_per_second": t.failed_cascades_per_second,
                                       "capacity_bytes": t.capacity_bytes, "capacity_reason": t.capacity_reason}
                              for t in w.offload_tiers}}


def _tier_energy_json(w: WindowFigures) -> dict:
    """Each offload tier's reloads priced against a recompute (methods.md s14), by cached-token source."""
    if not w.offload_tier_energy:
        return {}
    return {"offload_tier_energy": {t.tier: {
        "scope": t.scope or None, "tokens_per_second": t.tokens_per_second, "cached_to_prefill_ratio": t.cached_to_prefill,
        "bytes_per_token": t.bytes_per_token, "hop_joules_per_token": t.hop_joules_per_token,
        "reload_joules_per_token": t.reload_joules_per_token, "breakeven_ratio": t.breakeven_ratio,
        "gpu_saved_watts": t.gpu_saved_watts, "reload_watts": t.reload_watts, "saved_watts": t.saved_watts,
        "hop_source": t.hop_source, "price_reason": t.price_reason} for t in w.offload_tier_energy}}


def _cost_json(w: WindowFigures) -> dict:
    """Money and carbon of the marginal energy by scope; no key when no price or intensity is configured."""
    if not w.costs:
        return {}
    return {"cost": {c.scope: {"marginal_watts": c.marginal_watts,
                               "money_per_million_tokens": c.money_per_million_tokens,
                               "co2e_grams_per_thousand_tokens": c.co2e_grams_per_thousand_tokens,
                               "money_per_day": c.money_per_day,
                               "co2e_grams_per_day": c.co2e_grams_per_day, "currency": c.currency,
                               "recompute_tax_money_per_day": c.recompute_tax_money_per_day,
                               "recompute_tax_co2e_grams_per_day": c.recompute_tax_co2e_grams_per_day,
                               "offload_saved_money_per_day": c.offload_saved_money_per_day,
                               "offload_saved_co2e_grams_per_day": c.offload_saved_co2e_grams_per_day}
                     for c in w.costs}}


def prices_json(snap: Snapshot | None) -> dict:
    """The price and carbon intensity in force (top level): value, unit, source, age, or "not_configured"
    with how to set it."""
    out = {}
    for p in () if snap is None else snap.prices:
        unit = f"{p.currency or '?'} per kWh" if p.quantity == "electricity_price" else "g CO2e per kWh"
        out[p.quantity] = ({"state": "not_configured", "how": p.reason} if not p.configured else
                           {"state": "ok" if p.value is not None else "unknown", "value": p.value, "unit": unit,
                            "currency": p.currency, "source": p.source, "url": p.url,
                            "age_seconds": p.age_seconds, "reason": p.reason})
    return out


WINDOW_BLOCKS: tuple[Block, ...] = (
    Block(("energy",), _named("kvwatt_marginal_energy_per_token_joules", "kvwatt_energy_per_token_joules"),
          _energy_json),
    Block(("energy_saving",),
          _named("kvwatt_energy_saving_ratio", "kvwatt_energy_saving_stderr_ratio", "kvwatt_throughput_gain_ratio",
                 "kvwatt_throughput_gain_stderr_ratio", "kvwatt_comparison_windows"), _savings_json),
    Block(("offload_tiers",),
          _named("kvwatt_offload_tier_write_bytes_per_second", "kvwatt_offload_tier_read_bytes_per_second",
                 "kvwatt_offload_tier_chunk_hit_ratio", "kvwatt_offload_tier_job_failures",
                 "kvwatt_offload_tier_residency_seconds", "kvwatt_offload_tier_undersized",
                 "kvwatt_offload_tier_dropped_stores_per_second", "kvwatt_offload_tier_dropped_blocks_per_second",
                 "kvwatt_offload_tier_failed_promotions_per_second", "kvwatt_offload_tier_failed_cascades_per_second"),
          _tiers_json),
    Block(("offload_tier_energy",),
          _named("kvwatt_offload_tier_reload_joules_per_token", "kvwatt_offload_tier_breakeven_ratio",
                 "kvwatt_offload_tier_cached_to_prefill_ratio", "kvwatt_offload_tier_reload_watts",
                 "kvwatt_offload_tier_saved_watts"),
          _tier_energy_json),
    Block(("kv_evicted_before_reuse_ratio", "kv_before_reuse_yardstick", "kv_before_reuse_yardstick_seconds"),
          _named("kvwatt_kv_block_evicted_before_reuse_ratio"),  # methods.md s11
          lambda w: {"kv_evicted_before_reuse_ratio": w.kv_evicted_before_reuse_ratio,
                     "kv_before_reuse_yardstick": w.kv_before_reuse_yardstick,
                     "kv_before_reuse_yardstick_seconds": w.kv_before_reuse_yardstick_seconds}),
    Block(("residency_evidence", "residency_evidence_reason"), _named("kvwatt_kv_block_residency_pressure_evidence"),
          lambda w: {"residency_evidence": w.residency_evidence,
                     "residency_evidence_reason": w.residency_evidence_reason}),
    Block(("kv_usage_p95_interval",),  # methods.md s10
          _named("kvwatt_kv_cache_usage_p95_lower_ratio", "kvwatt_kv_cache_usage_p95_upper_ratio"),
          lambda w: {"kv_usage_p95_interval": [w.kv_usage_p95_low, w.kv_usage_p95_high]}),
    Block(("cost",),  # docs/energy.md, "Money and carbon"; the currency is the top-level prices' one
          _named("kvwatt_energy_cost_per_million_tokens", "kvwatt_co2e_grams_per_thousand_tokens",
                 "kvwatt_marginal_energy_cost_per_day", "kvwatt_marginal_co2e_grams_per_day",
                 "kvwatt_recompute_tax_cost_per_day", "kvwatt_recompute_tax_co2e_grams_per_day",
                 "kvwatt_offload_saved_cost_per_day", "kvwatt_offload_saved_co2e_grams_per_day"), _cost_json),
)


def _identity_json(v: ServerFigures) -> dict:
    return {"server": v.name, "url": v.url, "engine": v.engine, "capabilities": sorted(v.capabilities),
            "model_name": v.info.model_name if v.info else None}


def _source_status_json(v: ServerFigures) -> dict:
    return {"up": v.status.up, "state": v.status.state, "reason_code": v.status.code, "reason": v.status.reason}


# the keys _threshold_json writes: extend the two together (tests/test_figures_declared.py checks they agree)
THRESHOLD_KEYS = ("threshold_in_use", "threshold_source", "threshold_located", "evidence_windows",
                  "reference_windows", "reference_spread", "threshold_state", "threshold_reason",
                  "reference_state", "reference_reason", "tax_state", "tax_reason", "regime_state",
                  "regime_reason", "evidence", "epoch")


def _threshold_json(v: ServerFigures) -> dict:
    """The located threshold and the reference's evidence (methods.md s10)."""
    loc = v.located
    return {
        "threshold_in_use": v.threshold_in_use, "threshold_source": v.threshold_source,
        "threshold_located": None if loc is None else {
            "ratio": loc.ratio, "low": loc.low, "high": loc.high, "method": loc.method, "windows": loc.points,
            "clean_below": loc.clean_below, "pressured_above": loc.pressured_above, "misplaced": loc.misplaced},
        "evidence_windows": v.evidence_windows, "reference_windows": v.reference_windows,
        "reference_spread": v.reference_spread,
        "threshold_state": v.threshold_state, "threshold_reason": v.threshold_reason,
        "reference_state": v.reference_state, "reference_reason": v.reference_reason,
        "tax_state": v.tax_state, "tax_reason": v.tax_reason,
        "regime_state": v.regime_state, "regime_reason": v.regime_reason,
        "evidence": dict(vars(v.evidence)),
        "epoch": {"started": v.epoch_started_wall, "cause": v.epoch_cause},
    }


def _kappa_json(v: ServerFigures) -> dict:
    k = v.kappa
    return {"kappa": {"critical": k.critical, "breakeven_tokens_gqa": k.breakeven_tokens_gqa,
                      "breakeven_tokens_mha": k.breakeven_tokens_mha, "model": k.model_source,
                      "hardware": k.hardware_source}}


def _collapse_json(v: ServerFigures) -> dict:
    return {} if v.collapse is None else {"collapse": {**v.collapse.as_status(), "window": v.collapse_window}}


def _buffer_json(v: ServerFigures) -> dict:
    b = v.buffer
    return {} if b is None else {"offload_buffer": {
        "undersized": b.undersized, "recommended_bytes": b.recommended_bytes, "recommended_gib": b.recommended_gib,
        "store_failures": b.store_failures, "residency_seconds": b.residency_seconds,
        "write_bytes_per_second": b.write_bytes_per_second, "p99_tool_latency_seconds": b.p99_tool_latency_seconds,
        "headroom": b.headroom, "residency_target_seconds": b.residency_target_seconds,
        "residency_target_source": b.residency_target_source, "recommended_words": b.recommended_words,
        "recommended_note": b.recommended_note, "size_setting": b.size_setting}}


def _phase_costs_json(v: ServerFigures) -> dict:
    """Per-phase energy costs by scope (methods.md s12): each phase's J/token and SE, and what they rest on."""
    return {"phase_costs": {c.scope: {
        **{p: {"joules_per_token": c.joules(p), "stderr": c.stderr(p)} for p in c.phases},
        "windows": c.windows, "state": c.state, "reason": c.reason, "source": c.source,
        "condition": None if c.condition is None or math.isinf(c.condition) else c.condition}
        for c in v.phase_costs}}


def _advice_json(v: ServerFigures) -> dict:
    return {"advice": [{"kind": a.kind, "severity": a.severity, "text": a.text, "evidence": dict(a.evidence)}
                       for a in v.advice]}


SERVER_BLOCKS: tuple[Block, ...] = (
    Block(("server", "url", "engine", "capabilities", "model_name"),
          _named("kvwatt_server_info", "kvwatt_server_capability"), _identity_json),
    Block(("up", "state", "reason_code", "reason"), _named("kvwatt_source_up", "kvwatt_source_info"),
          _source_status_json),
    Block(("regime", "regime_window"), _named("kvwatt_kv_pressure_regime_above"),  # the shortest window's, in words
          lambda v: {"regime": v.regime, "regime_window": v.regime_window}),
    Block(("reference_kind",), _named("kvwatt_recompute_reference_share_ratio"),
          lambda v: {"reference_kind": v.reference_kind}),
    Block(("signatures",), _named("kvwatt_collapse_signature"), lambda v: {"signatures": v.signatures}),
    Block(("recommendations",),  # the advice's words (exporter.model.advice)
          _named("kvwatt_offload_buffer_undersized", "kvwatt_offload_recommended_buffer_bytes",
                 "kvwatt_collapse_signature"), lambda v: {"recommendations": list(v.recommendations)}),
    Block(("advice",),  # "what do I do?": each check's answer with the numbers it rests on
          _named("kvwatt_source_up", "kvwatt_kv_pressure_regime_above", "kvwatt_collapse_signature",
                 "kvwatt_offload_buffer_undersized", "kvwatt_offload_recommended_buffer_bytes"), _advice_json),
    Block(THRESHOLD_KEYS,
          _named("kvwatt_kv_pressure_threshold_in_use_ratio", "kvwatt_kv_pressure_threshold_located_ratio",
                 "kvwatt_kv_pressure_threshold_located_low_ratio", "kvwatt_kv_pressure_threshold_located_high_ratio",
                 "kvwatt_kv_pressure_threshold_located_windows", "kvwatt_recompute_reference_windows",
                 "kvwatt_verdict_state"),
          _threshold_json),
    Block(("kappa",), _named("kvwatt_critical_cached_to_prefill_ratio", "kvwatt_recompute_breakeven_tokens"),
          _kappa_json),
    Block(("collapse",),
          _named("kvwatt_collapse_signature", "kvwatt_collapse_condition_set", "kvwatt_collapse_condition"),
          _collapse_json),
    Block(("phase_costs",), _named("kvwatt_phase_joules_per_token", "kvwatt_phase_joules_per_token_stderr",
                                   "kvwatt_phase_cost_windows", "kvwatt_phase_cost_source"), _phase_costs_json),
    Block(("offload_buffer",), _named("kvwatt_offload_buffer_undersized", "kvwatt_offload_recommended_buffer_bytes",
                                      "kvwatt_offload_buffer_residency_target_seconds"),
          _buffer_json),
)


def status_paths(d: catalog.MetricDef) -> list[str]:
    """Where a declaration's figure is in /api/status (servers[].<path>), for the README's reference."""
    if isinstance(d.status, catalog.StatusKey):
        keys, scope = [d.status.key], d.status.scope
    else:
        keys, scope = [], catalog.SERVER
        for blocks, scope_of in ((WINDOW_BLOCKS, catalog.WINDOW), (SERVER_BLOCKS, catalog.SERVER)):
            for b in blocks:
                if d in b.serialises:
                    keys, scope = keys + list(b.keys), scope_of
    prefix = "windows.<window>." if scope == catalog.WINDOW else ""
    return [prefix + k for k in keys]

# The order /api/status has always written these keys in (clients and tests/data/golden/status.json read it
# as text); a key declared since is appended after them, in catalog order. Names only: no value comes from here.
WINDOW_KEY_ORDER = (
    "seconds", "covered_seconds", "kv_usage_p95", "kv_usage_max", "above_threshold", "preemptions_per_minute",
    "preemption_onset", "generation_tokens_per_second", "prompt_token_shares", "recompute_tax",
    "cached_prompt_token_shares", "preemptions_per_request", "preempted_requests_share",
    "admission_rejections_per_minute", "preemptions_by_reason_per_minute", "offload_tiers", "energy",
    "offload_write_bytes_per_second", "offload_buffer_residency_seconds", "offload_write_tokens_per_second",
    "offload_read_tokens_per_second", "energy_saving", "kv_usage_p95_interval", "offload_read_bytes_per_second",
    "estimated_flops_per_second", "estimated_flops_per_generated_token", "cached_to_prefill_ratio",
    "prompt_energy_per_token_joules", "kv_evicted_blocks_per_second", "kv_evictions_per_prompt_block",
    "kv_idle_before_evict_seconds", "kv_reuse_gap_seconds", "kv_evicted_before_reuse_ratio",
    "kv_before_reuse_yardstick", "kv_before_reuse_yardstick_seconds", "residency_evidence",
    "residency_evidence_reason", "cost")
SERVER_KEY_ORDER = (
    "server", "url", "up", "state", "reason_code", "reason", "engine", "capabilities", "model_name",
    "offload_enabled", "offload_buffer_bytes", "offload_buffer_used_ratio", "offload_buffer_used_bytes",
    "offload_tier_hit_ratio", "regime", "regime_window", "threshold", "reference_local_compute_share",
    "reference_kind", "signatures", "recommendations", "advice", "requests_in_kv_fetch", "windows", "kappa",
    *THRESHOLD_KEYS, "collapse", "offload_buffer", "phase_costs")


def _figures_json(fig, scope: str, blocks: tuple[Block, ...], order: tuple[str, ...], **fixed) -> dict:
    """The scope's figure keys from the catalog's declarations, then its blocks' keys, in ``order``."""
    out = dict(fixed)
    out.update((d.status.key, d.status.json_value(fig)) for d in catalog.METRICS
               if isinstance(d.status, catalog.StatusKey) and d.status.scope == scope)
    for b in blocks:
        out.update(b.write(fig))
    rank = {k: i for i, k in enumerate(order)}
    return dict(sorted(out.items(), key=lambda kv: rank.get(kv[0], len(rank))))  # stable: new keys in catalog order


def _window_json(w: WindowFigures) -> dict:
    return _figures_json(w, catalog.WINDOW, WINDOW_BLOCKS, WINDOW_KEY_ORDER, seconds=w.seconds)


def _server_json(v: ServerFigures) -> dict:
    return _figures_json(v, catalog.SERVER, SERVER_BLOCKS, SERVER_KEY_ORDER,
                         windows={w.window: _window_json(w) for w in v.windows})


def _source_json(st: SourceStatus) -> dict:
    """A host-wide source's health: ``reason_code`` is kvwatt_source_info's label, ``reason`` has the details."""
    return {"source": st.source, "up": st.up, "state": st.state, "reason_code": st.code, "reason": st.reason}


def status_json(snap: Snapshot | None) -> dict:
    """Per server: health, regime, active signatures, figures per window, recommendations; the health of the
    host-wide sources (nvml, rapl, state_dir); when the figures were derived (``as_of``: the tick's wall
    clock, null before the first tick). Strict JSON: a NaN or infinite figure is written null here, so no
    caller can serialise one (RFC 8259 has neither). The landing page (exporter.serve.page) renders this dict."""
    servers = [] if snap is None else [_server_json(v) for v in snap.servers]
    sources = [] if snap is None else [_source_json(st) for st in snap.sources]
    as_of = None if snap is None else snap.wall_time
    out = {"version": __version__, "as_of_unix_seconds": as_of, "as_of": _iso(as_of),
           "servers": servers, "sources": sources}
    if snap is not None and snap.notice:
        out["notice"] = snap.notice  # `kvwatt demo` says it is one
    if snap is not None:
        out["prices"] = prices_json(snap)
        # the figures served as unknown this tick for breaking their declared bounds, with why (exporter/bounds.py)
        out["implausible"] = [r.as_json() for r in snap.implausible]
    return _finite(out)


def _iso(unix_seconds: float | None) -> str | None:
    if unix_seconds is None:
        return None
    return datetime.fromtimestamp(unix_seconds, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _finite(x):
    """JSON has no NaN or Infinity: unknown or unbounded values are written null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


class RequestLog(logging.LoggerAdapter):
    """aiohttp's per-connection logger. A malformed request (a bad request line or header, a line too long,
    TLS or other non-HTTP bytes on a plain port) is the client's doing, answered 400: aiohttp logged each one
    at ERROR with a traceback, so a scanner filled the log. Here it is one info line without traceback at most
    every ``interval_seconds``, with how many there were; anything else keeps aiohttp's level and traceback."""

    def __init__(self, interval_seconds: float = MALFORMED_LOG_INTERVAL_SECONDS, clock=time.monotonic):
        super().__init__(logging.getLogger("kvwatt.web.requests"), {})
        self.interval_seconds, self.clock = interval_seconds, clock
        self.malformed = 0  # since the last line logged
        self.logged_at: float | None = None

    def log(self, level, msg, *args, exc_info=None, **kwargs):
        if isinstance(exc_info, HttpProcessingError):
            self._malformed(args[0] if args else "unknown", exc_info)
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)

    def _malformed(self, remote, exc: HttpProcessingError) -> None:
        self.malformed += 1
        now = self.clock()
        if self.logged_at is not None and now - self.logged_at < self.interval_seconds:
            return
        # the class and code only: the exception's text quotes the client's bytes
        self.logger.info("malformed HTTP request from %s answered %s (%s); %d malformed in the last %s",
                         remote, exc.code, type(exc).__name__, self.malformed,
                         "start" if self.logged_at is None else f"{now - self.logged_at:.0f}s")
        self.malformed, self.logged_at = 0, now


def _client_gone(request: web.Request) -> bool:
    transport = request.transport  # None once the connection is lost
    return transport is None or transport.is_closing()


def auth_middleware(auth: BasicAuth):
    @web.middleware
    async def check(request: web.Request, handler):
        verdict = await auth.check(request.headers.get("Authorization"), request.remote or "",
                                   lambda: _client_gone(request))
        if verdict is Verdict.ALLOWED:
            return await handler(request)
        if verdict is Verdict.BUSY:
            return web.Response(status=429, text="Too many password checks in progress: retry later\n",
                                headers={"Retry-After": str(AUTH_RETRY_AFTER_SECONDS)})
        return web.Response(status=401, text="Unauthorized\n",  # DENIED, or GONE: nobody reads it
                            headers={"WWW-Authenticate": 'Basic realm="kvwatt", charset="UTF-8"'})
    return check


NOTHING_YET = Exposition([])  # before the first tick: no family, in whatever format is asked for


class Views:
    """One snapshot's /api/status JSON and landing page, each serialised at most once (``render``: in the render
    thread, never on the loop), then served as the same bytes until the snapshot is replaced: the pattern of
    exporter/serve/exposition.py's Exposition, for the two pages."""

    def __init__(self, snapshot: Snapshot | None, telemetry_path: str):
        self.snapshot, self.telemetry_path = snapshot, telemetry_path
        self._lock = threading.Lock()
        self._status: dict | None = None
        self.body: dict[str, bytes] = {}  # "status" / "page" -> bytes, once serialised

    def render(self, which: str) -> bytes:
        """The bytes of ``which`` ("status" or "page"), serialising them if no request has yet (call it off the
        loop). Two first requests at once: the second waits for the first's bytes."""
        with self._lock:
            body = self.body.get(which)
            if body is None:
                if self._status is None:
                    self._status = status_json(self.snapshot)
                text = (json.dumps(self._status, indent=2, allow_nan=False) if which == "status"
                        else page.render(self._status, self.telemetry_path))
                body = self.body[which] = text.encode("utf-8")
            return body


def build_app(daemon, auth: BasicAuth | None = None, telemetry_path: str = "/metrics") -> web.Application:
    # serialises what a tick has not yet (exporter/serve/exposition.py); one thread, apart from the tick's
    render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvwatt-render")

    async def metrics(request: web.Request):
        published = daemon.published
        exposition = NOTHING_YET if published is None else published.rendered
        accept, encoding = request.headers.get("Accept"), request.headers.get("Accept-Encoding")
        names = wanted_names(request.query.getall("name[]", None))
        served = exposition.cached(accept, encoding, names)
        if served is None:
            served = await asyncio.get_running_loop().run_in_executor(
                render_pool, exposition.serve, accept, encoding, names)
        return web.Response(body=served.body, headers=served.headers())

    async def healthz(_request):
        ok = daemon.healthy()
        return web.Response(text="ok\n" if ok else "sampling loop stalled\n", status=200 if ok else 503)

    views = Views(None, telemetry_path)

    async def serialised(which: str) -> bytes:
        """The current snapshot's page ``which``: a lookup on the loop once a request of this tick serialised it,
        else serialised in the render thread (once per snapshot: exporter/serve/web.py, Views)."""
        nonlocal views
        snap = daemon.snapshot
        if views.snapshot is not snap:  # a new tick: the previous snapshot's bytes are dropped with it
            views = Views(snap, telemetry_path)
        current = views
        body = current.body.get(which)
        if body is None:
            body = await asyncio.get_running_loop().run_in_executor(render_pool, current.render, which)
        return body

    async def status(_request):
        return web.Response(body=await serialised("status"), content_type="application/json", charset="utf-8")

    async def index(_request):
        return web.Response(body=await serialised("page"), content_type="text/html", charset="utf-8")

    async def runbook_page(_request):
        text = runbook.page()
        if text is None:  # an install without package data: say so rather than serve an empty page
            return web.Response(status=404, text=f"no runbook in this install ({runbook.RUNBOOK_PATH})\n")
        return web.Response(text=text, content_type="text/html")

    app = web.Application(middlewares=[auth_middleware(auth)] if auth else [])
    app.on_cleanup.append(lambda _app: _shutdown(render_pool))
    app.router.add_get(telemetry_path, metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/status", status)
    app.router.add_get("/", index)
    app.router.add_get("/runbook", runbook_page)  # each alert's runbook_url points here (alerts/generate.py)
    return app


@dataclass(frozen=True)
class WebLimits:
    max_connections: int = 512
    read_timeout_seconds: float = 30.0  # idle keep-alive, request headers, TLS handshake


async def start_web(daemon, host: str, port: int, limits: WebLimits = WebLimits(),
                    web_config: WebConfig | None = None, telemetry_path: str = "/metrics") -> web.AppRunner:
    auth = BasicAuth(web_config.users) if web_config and web_config.users else None
    app = build_app(daemon, auth, telemetry_path)
    if auth is not None:
        app.on_cleanup.append(lambda _app: _close(auth))
    runner = web.AppRunner(app, access_log=None, logger=RequestLog(),
                           keepalive_timeout=limits.read_timeout_seconds)
    await runner.setup()
    guard = ConnectionGuard(limits.max_connections, web_config.tls if web_config else None,
                            limits.read_timeout_seconds)
    await GuardedSite(runner, host, port, guard).start()
    return runner


async def _close(auth: BasicAuth) -> None:
    auth.close()


async def _shutdown(pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=False, cancel_futures=True)
