"""HTTP endpoints: /metrics (the collector), / (landing page, exporter.serve.page), /healthz, /api/status (JSON),
/runbook (the alert runbook shipped with this version, exporter.serve.runbook).

Each serialises the daemon's latest Snapshot and nothing else: no figure is computed here, and a request
cannot change state. The metric families are collected once per tick, with the snapshot (exporter.runtime.daemon),
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


def status_paths(d: catalog.MetricDef) -> list[str]:
    """Where a declaration's figure is in /api/status (servers[].<path>), for the README's reference."""
    if isinstance(d.status, catalog.StatusKey):
        keys, scope = [d.status.key], d.status.scope
    else:
        keys, scope = [], catalog.SERVER
        for b in catalog.BLOCKS:
            if d.name in b.serialises:
                keys, scope = keys + list(b.keys), b.scope
    prefix = "windows.<window>." if scope == catalog.WINDOW else ""
    return [prefix + k for k in keys]


def _writers(scope: str) -> tuple:
    """What writes a scope's dict, in catalog order (exporter.catalog.SECTIONS): section by section, its figures'
    keys in declaration order, then its blocks."""
    out = []
    for section in catalog.SECTIONS:
        out += [d.status for d in section.metrics
                if isinstance(d.status, catalog.StatusKey) and d.status.scope == scope]
        out += [b for b in section.blocks if b.scope == scope]
    return tuple(out)


WRITERS: dict[str, tuple] = {}  # scope -> (the catalog's SECTIONS they were built from, the writers)


def writers(scope: str) -> tuple:
    """The scope's writers, built once per catalog (a test may give the catalog another section)."""
    built = WRITERS.get(scope)
    if built is None or built[0] is not catalog.SECTIONS:
        built = WRITERS[scope] = (catalog.SECTIONS, _writers(scope))
    return built[1]


def _figures_json(fig, scope: str) -> dict:
    out = {}
    for x in writers(scope):
        if isinstance(x, catalog.StatusKey):
            out[x.key] = x.json_value(fig)
        else:
            out.update(x.write(fig))
    return out


def _window_json(w: WindowFigures) -> dict:
    return {"seconds": w.seconds, **_figures_json(w, catalog.WINDOW)}


def _server_json(v: ServerFigures) -> dict:
    return {**_figures_json(v, catalog.SERVER), "windows": {w.window: _window_json(w) for w in v.windows}}


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
        # the figures served as unknown this tick for breaking their declared bounds, with why
        # (exporter/catalog/bounds.py)
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
                    # several worker processes (exporter/runtime/workers.py): their own /api/status, merged
                    merged = getattr(self.snapshot, "merged_status", None)
                    self._status = status_json(self.snapshot) if merged is None else merged()
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
