"""HTTP endpoints: /metrics (the collector), / (landing page, exporter.serve.page), /healthz, /api/status (JSON).

Each serialises the daemon's latest Snapshot and nothing else: no figure is computed here, and a request
cannot change state. The metric families are collected once per tick, with the snapshot (exporter.daemon),
and each form of the exposition (text or OpenMetrics, plain or gzipped: negotiated as prometheus_client does,
exporter/serve/exposition.py) is serialised at most once per tick, the text format with the tick. A scrape of a
form already serialised costs the loop a dict lookup and a memory copy; a form not yet serialised, or a
``name[]`` subset, is serialised in a thread of its own (never the tick's), so a scrape flood never slows
sampling.

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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from exporter import __version__
from exporter.serve import page
from exporter.serve.connections import ConnectionGuard, GuardedSite
from exporter.serve.exposition import Exposition, wanted_names
from exporter.figures import ServerFigures, Snapshot, WindowFigures
from exporter.samples import SourceStatus
from exporter.serve.webconfig import BasicAuth, WebConfig

log = logging.getLogger("kvwatt.web")
MALFORMED_LOG_INTERVAL_SECONDS = 60.0


def _window_json(w: WindowFigures) -> dict:
    savings = {sv.baseline: {"dE": sv.energy_saving, "dE_stderr": sv.energy_saving_stderr, "verdict": sv.verdict,
                             "windows": sv.windows,
                             "reference_windows": sv.reference_windows, "note": sv.note,
                             "dTPS": sv.throughput_gain, "dTPS_stderr": sv.throughput_gain_stderr}
               for sv in w.savings}
    out = {
        "seconds": w.seconds, "covered_seconds": round(w.covered_seconds, 3), "kv_usage_p95": w.kv_usage_p95,
        "kv_usage_max": w.kv_usage_max, "above_threshold": w.above_threshold,
        "preemptions_per_minute": w.preemptions_per_minute, "preemption_onset": w.preemption_onset,
        "generation_tokens_per_second": w.generation_tokens_per_second,
        "prompt_token_shares": w.token_shares, "recompute_tax": w.recompute_tax,
        "cached_prompt_token_shares": w.cached_tier_shares,
        "preemptions_per_request": w.preemptions_per_request, "preempted_requests_share": w.preempted_requests_share,
        "admission_rejections_per_minute": w.admission_rejections_per_minute,
        "preemptions_by_reason_per_minute": w.preemptions_by_reason_per_minute,
        "offload_tiers": {t.tier: {"write_bytes_per_second": t.write_bytes_per_second,
                                   "read_bytes_per_second": t.read_bytes_per_second,
                                   "chunk_hit_ratio": t.chunk_hit_ratio, "job_failures": t.job_failures,
                                   "residency_seconds": t.residency_seconds, "undersized": t.undersized}
                          for t in w.offload_tiers},
        "energy": {e.scope: {"joules": e.basis.energy_joules, "idle_joules": e.basis.idle_joules,
                             "generated_tokens": e.basis.tokens, "seconds": e.basis.seconds,
                             "loaded_seconds": e.basis.loaded_seconds, "joules_per_token": e.joules_per_token,
                             "marginal_joules_per_token": e.marginal_joules_per_token} for e in w.energy},
        "offload_write_bytes_per_second": w.offload_write_bytes_per_second,
        "offload_buffer_residency_seconds": w.offload_buffer_residency_seconds,
        "offload_write_tokens_per_second": w.offload_write_tokens_per_second,
        "offload_read_tokens_per_second": w.offload_read_tokens_per_second,
        # KV-block residency (vLLM --kv-cache-metrics, methods.md s11)
        "kv_evicted_blocks_per_second": w.kv_evicted_blocks_per_second,
        "kv_evictions_per_prompt_block": w.kv_evictions_per_prompt_block,
        "kv_idle_before_evict_seconds": w.kv_idle_before_evict_seconds,
        "kv_reuse_gap_seconds": w.kv_reuse_gap_seconds,
        "kv_evicted_before_reuse_ratio": w.kv_evicted_before_reuse_ratio,
        "kv_before_reuse_yardstick": w.kv_before_reuse_yardstick,
        "kv_before_reuse_yardstick_seconds": w.kv_before_reuse_yardstick_seconds,
        "residency_evidence": w.residency_evidence, "residency_evidence_reason": w.residency_evidence_reason,
    }
    if savings:
        out["energy_saving"] = savings
    out["kv_usage_p95_interval"] = [w.kv_usage_p95_low, w.kv_usage_p95_high]  # methods.md s10
    return out


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
    }


def _server_json(v: ServerFigures) -> dict:
    out = {
        "server": v.name, "url": v.url, "up": v.status.up, "state": v.status.state,
        "reason_code": v.status.code, "reason": v.status.reason,
        "engine": v.engine, "capabilities": sorted(v.capabilities),
        "model_name": v.info.model_name if v.info else None,
        "offload_enabled": v.info.offload_enabled if v.info else None,
        "offload_buffer_bytes": v.info.offload_buffer_bytes if v.info else None,
        "offload_buffer_used_ratio": v.tiers.used_ratio, "offload_buffer_used_bytes": v.tiers.used_bytes,
        "offload_tier_hit_ratio": v.tiers.hit_ratio,
        "regime": v.regime, "regime_window": v.regime_window, "threshold": v.threshold,
        "reference_local_compute_share": v.reference_share, "reference_kind": v.reference_kind,
        "signatures": v.signatures, "recommendations": list(v.recommendations),
        "requests_waiting_for_kv": v.kv_fetch_waiting,
        "windows": {w.window: _window_json(w) for w in v.windows},
        "kappa": {"critical": v.kappa.critical, "breakeven_tokens_gqa": v.kappa.breakeven_tokens_gqa,
                  "breakeven_tokens_mha": v.kappa.breakeven_tokens_mha, "model": v.kappa.model_source,
                  "hardware": v.kappa.hardware_source},
    }
    out.update(_threshold_json(v))
    if v.collapse is not None:
        out["collapse"] = {**v.collapse.as_status(), "window": v.collapse_window}
    if v.buffer is not None:
        b = v.buffer
        out["offload_buffer"] = {"undersized": b.undersized, "recommended_bytes": b.recommended_bytes,
                                 "recommended_gib": b.recommended_gib, "store_failures": b.store_failures,
                                 "residency_seconds": b.residency_seconds,
                                 "write_bytes_per_second": b.write_bytes_per_second,
                                 "p99_tool_latency_seconds": b.p99_tool_latency_seconds, "headroom": b.headroom,
                                 "residency_target_seconds": b.residency_target_seconds,
                                 "residency_target_source": b.residency_target_source}
    return out


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
    return _finite({"version": __version__, "as_of_unix_seconds": as_of, "as_of": _iso(as_of),
                    "servers": servers, "sources": sources})


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


def auth_middleware(auth: BasicAuth):
    @web.middleware
    async def check(request: web.Request, handler):
        if not await auth.check(request.headers.get("Authorization")):
            return web.Response(status=401, text="Unauthorized\n",
                                headers={"WWW-Authenticate": 'Basic realm="kvwatt", charset="UTF-8"'})
        return await handler(request)
    return check


NOTHING_YET = Exposition([])  # before the first tick: no family, in whatever format is asked for


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

    async def status(_request):
        return web.Response(text=json.dumps(status_json(daemon.snapshot), indent=2, allow_nan=False),
                            content_type="application/json")

    async def index(_request):
        return web.Response(text=page.render(status_json(daemon.snapshot), telemetry_path), content_type="text/html")

    app = web.Application(middlewares=[auth_middleware(auth)] if auth else [])
    app.on_cleanup.append(lambda _app: _shutdown(render_pool))
    app.router.add_get(telemetry_path, metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/status", status)
    app.router.add_get("/", index)
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
