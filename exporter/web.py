"""HTTP endpoints: /metrics (the collector), / (landing page), /healthz, /api/status (JSON)."""

from __future__ import annotations

import html
import json

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from exporter import __version__
from exporter.collector import KvwattCollector
from exporter.view import ServerView


def status_json(views: list[ServerView]) -> dict:
    """Per server: regime, active signatures, figures per window, recommendations."""
    out = []
    for v in views:
        out.append({
            "server": v.name, "url": v.url, "up": v.status.up, "reason": v.status.reason,
            "model_name": v.info.model_name if v.info else None,
            "offload_enabled": v.info.offload_enabled if v.info else None,
            "offload_buffer_bytes": v.info.offload_buffer_bytes if v.info else None,
            "regime": v.regime, "threshold": v.threshold,
            "reference_local_compute_share": v.reference_share, "reference_kind": v.reference_kind,
            "signatures": v.extra.get("signatures", {}),
            "recommendations": v.extra.get("recommendations", []),
            "windows": {w.window: {
                "covered_seconds": round(w.covered_seconds, 3), "kv_usage_p95": w.kv_usage_p95,
                "kv_usage_max": w.kv_usage_max, "above_threshold": w.above_threshold,
                "preemptions_per_minute": w.preemptions_per_minute, "preemption_onset": w.preemption_onset,
                "generation_tokens_per_second": w.generation_tokens_per_second,
                "prompt_token_shares": w.token_shares, "recompute_tax": w.recompute_tax,
                **w.extra.get("status", {}),
            } for w in v.windows},
            **v.extra.get("status", {}),
        })
    return {"version": __version__, "servers": out}


def _fmt(x, pct=False) -> str:
    if x is None:
        return "unknown"
    return f"{x * 100:.1f} %" if pct else f"{x:.3g}"


def landing_html(views: list[ServerView]) -> str:
    rows = []
    for v in views:
        w = v.windows[-1] if v.windows else None
        sig = ", ".join(k for k, on in v.extra.get("signatures", {}).items() if on) or "none"
        recs = "<br>".join(html.escape(r) for r in v.extra.get("recommendations", [])) or "none"
        shares = w.token_shares if w else None
        rows.append(
            f"<tr><td>{html.escape(v.name)}</td><td>{'up' if v.status.up else 'DOWN: ' + html.escape(v.status.reason)}"
            f"</td><td>{v.regime}</td><td>{_fmt(w.kv_usage_p95 if w else None, True)}</td>"
            f"<td>{_fmt(w.preemptions_per_minute if w else None)}</td>"
            f"<td>{_fmt(shares['local_compute'] if shares else None, True)}</td>"
            f"<td>{html.escape(sig)}</td><td>{recs}</td></tr>")
    return f"""<!doctype html><html><head><title>kvwatt</title></head><body>
<h1>kvwatt {__version__}</h1>
<p>KV pressure, recomputation and energy per token of vLLM servers. <a href="/metrics">Metrics</a> ·
<a href="/api/status">Status (JSON)</a> · <a href="/healthz">Health</a></p>
<table border="1" cellpadding="4"><tr><th>server</th><th>source</th><th>regime</th><th>KV p95</th>
<th>preemptions/min</th><th>local_compute share</th><th>active signatures</th><th>recommendations</th></tr>
{''.join(rows)}</table><p>Figures over the longest configured window.</p></body></html>"""


def build_app(daemon) -> web.Application:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvwattCollector(daemon.snapshot))

    async def metrics(_request):
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request):
        ok = daemon.healthy()
        return web.Response(text="ok\n" if ok else "sampling loop stalled\n", status=200 if ok else 503)

    async def status(_request):
        return web.Response(text=json.dumps(status_json(daemon.views()), indent=2),
                            content_type="application/json")

    async def index(_request):
        return web.Response(text=landing_html(daemon.views()), content_type="text/html")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/status", status)
    app.router.add_get("/", index)
    return app


async def start_web(daemon, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(build_app(daemon), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

