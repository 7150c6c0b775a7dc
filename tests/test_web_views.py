"""/api/status and / are serialised once per snapshot, off the event loop, and served as bytes (exporter/serve/web.py,
Views; issue 38.4): what a request gets is exactly what status_json and page.render make of the current snapshot,
a flood of one tick costs one serialisation, and the next tick's snapshot is served at its first request (the
page's refresh sees it)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp

from exporter.figures import Snapshot
from exporter.serve import page, web
from tests.support.daemon import free_port


def _snap(wall: float) -> Snapshot:
    return Snapshot(1.0, wall, (), notice=f"tick at {wall:.0f}")


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[str, bytes]:
    async with session.get(url) as r:
        assert r.status == 200
        return r.headers["Content-Type"], await r.read()


async def _run(monkeypatch) -> None:
    made = []

    def counted(snap):
        made.append(snap)
        return web.status_json.__wrapped__(snap)

    counted.__wrapped__ = web.status_json
    monkeypatch.setattr(web, "status_json", counted)
    daemon = SimpleNamespace(snapshot=_snap(1.7e9))
    app = web.build_app(daemon, telemetry_path="/exposition")
    runner = web.web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.web.TCPSite(runner, "127.0.0.1", port).start()
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            answers = await asyncio.gather(*(_get(s, base + ("/api/status" if i % 2 else "/")) for i in range(40)))
            assert len(made) == 1  # forty requests of one tick: one status dict, one JSON, one page
            expected_json = json.dumps(counted.__wrapped__(daemon.snapshot), indent=2, allow_nan=False)
            expected_page = page.render(counted.__wrapped__(daemon.snapshot), "/exposition")
            for i, (ctype, body) in enumerate(answers):
                if i % 2:
                    assert ctype == "application/json; charset=utf-8" and body.decode() == expected_json
                else:
                    assert ctype == "text/html; charset=utf-8" and body.decode() == expected_page
            daemon.snapshot = _snap(1.7e9 + 1)  # the next tick
            _, body = await _get(s, base + "/api/status")
            assert json.loads(body)["notice"] == "tick at 1700000001" and len(made) == 2
            _, body = await _get(s, base + "/")
            assert b"tick at 1700000001" in body and len(made) == 2
    finally:
        await runner.cleanup()


def test_status_and_page_are_serialised_once_per_snapshot_and_follow_the_next(monkeypatch):
    asyncio.run(_run(monkeypatch))
