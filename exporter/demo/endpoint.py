"""The demo's engines: one loopback HTTP server per demo server, answering GET /metrics with its capture's frame for
the time since the demo started (exporter/demo/story.py), as the engine served it when it was captured."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web

from exporter.demo import story

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Playback:
    """Where the story is: the same clock for every capture (the engine, its offloading twin, its tiered twin)
    and their simulated GPUs."""

    frames: tuple[story.Frame, ...]
    offload_frames: tuple[story.Frame, ...]
    speed: float = 1.0
    started: float = field(default_factory=time.monotonic)
    tiered_frames: tuple[story.Frame, ...] = ()

    def elapsed_seconds(self) -> float:
        return (time.monotonic() - self.started) * self.speed

    def frame(self, offloading: bool = False, tiered: bool = False) -> story.Frame:
        frames = self.tiered_frames if tiered else self.offload_frames if offloading else self.frames
        return story.frame_at(frames, self.elapsed_seconds())

    @property
    def length_seconds(self) -> float:
        return max(f[-1].t for f in (self.frames, self.offload_frames, self.tiered_frames) if f)

    def token_counts(self, offloading: bool, tiered: bool = False) -> tuple[float, float, float]:
        """(generated, computed prompt, reloaded prompt) tokens so far by the capture's own counters, for the
        simulated GPU's energy counter."""
        f = self.frame(offloading, tiered)
        return f.counter("generation_tokens"), f.counter("local_compute"), f.counter("external_kv_transfer")


async def start_engine(text: Callable[[], str]) -> tuple[web.AppRunner, str]:
    """A loopback server whose /metrics answers ``text()``; (its runner, its root URL)."""
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=text().encode(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the port the kernel chose
    return runner, f"http://127.0.0.1:{port}"
