"""`kvwatt run`: the asyncio loop. It only orchestrates: each tick reads every source back to back on one
monotonic clock, hands readings to the window store and the learners, and the web server renders the
current state on request. Sources never raise into the loop; a failing one reports a reason."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from dataclasses import dataclass

import aiohttp

from exporter.config import Config, ServerConfig, resolve
from exporter.derive.recompute import ReferenceShare, token_counts
from exporter.derive.pressure import kv_usage_quantile
from exporter.derive.window import covered_seconds
from exporter.energy.runtime import EnergyRuntime
from exporter.offload.runtime import OffloadRuntime
from exporter.samples import SourceStatus, VllmInfo
from exporter.sources.vllm import VllmSource
from exporter.store import ServerHistory
from exporter.view import ServerView, server_view

log = logging.getLogger("kvwatt")


@dataclass
class ServerState:
    cfg: ServerConfig
    source: VllmSource
    history: ServerHistory
    reference: ReferenceShare
    status: SourceStatus
    info: VllmInfo | None = None


class Daemon:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        keep = max(max(cfg.windows_seconds), cfg.collapse_reference_seconds) + 60
        self.servers = [
            ServerState(s, VllmSource(s.name, s.url, cfg.http_timeout_seconds, cfg.max_body_bytes),
                        ServerHistory(keep), ReferenceShare(s.reference_local_compute_share),
                        SourceStatus("vllm", s.name, False, "not_read_yet", 0.0, "down"))
            for s in cfg.servers
        ]
        self.energy = EnergyRuntime(cfg)  # NVML + RAPL, attribution, idle baselines (docs/energy.md)
        self.offload = OffloadRuntime(cfg)  # collapse, buffer, kappa, dE (reads config.json/profile files)
        self.last_tick_t: float | None = None
        self.ticks = 0
        self._stop = asyncio.Event()

    # --- one tick -------------------------------------------------------------------------------------
    async def tick(self, session: aiohttp.ClientSession, t: float) -> None:
        energy_deltas = self.energy.read(t)
        results = await asyncio.gather(*(s.source.read(session) for s in self.servers))
        for state, (status, reading) in zip(self.servers, results):
            state.status = status
            self.energy.attribute(state, energy_deltas)
            if reading is None:
                continue
            state.info = reading.info
            if state.history.add_reading(t, reading) is not None:
                self._learn(state, t)
                self.offload.observe(state, t)
        self.energy.after_tick(t, self.servers)
        self.last_tick_t, self.ticks = t, self.ticks + 1

    def _learn(self, state: ServerState, now: float) -> None:
        seconds = max(self.cfg.windows_seconds)
        ivs = state.history.window(now, seconds)
        state.reference.observe(now, seconds, covered_seconds(ivs), kv_usage_quantile(ivs, 0.95),
                                self.cfg.kv_pressure_threshold_ratio, token_counts(ivs))

    async def run_loop(self) -> None:
        interval = self.cfg.interval_seconds
        async with aiohttp.ClientSession() as session:
            while not self._stop.is_set():
                t = time.monotonic()
                await self.tick(session, t)
                # schedule from this tick's real start, not from a fixed grid: after a late wake-up (a
                # starved process) a grid would put the next tick a few ms later, and a few ms of energy is
                # noise (energy-measurement.md rule 9). Ticks are >= one interval apart; missed ones skipped.
                delay = max(t + interval - time.monotonic(), 0.0)
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=delay)
                except asyncio.TimeoutError:
                    pass

    def stop(self) -> None:
        self._stop.set()

    # --- views for the collector and the web pages -----------------------------------------------------
    def views(self, now: float | None = None) -> list[ServerView]:
        now = time.monotonic() if now is None else now
        out = []
        by_name = {s.cfg.name: s for s in self.servers}
        for s in self.servers:
            v = server_view(s.cfg, s.history, s.status, s.info, s.reference, now, self.cfg)
            self.energy.extend_view(v, s, now, self.cfg)
            self.offload.extend_view(v, s, now, self.cfg, by_name)
            out.append(v)
        return out

    def snapshot(self):
        views = self.views()
        return views, self.energy.renderers()

    def healthy(self) -> bool:
        if self.last_tick_t is None:
            return False
        return time.monotonic() - self.last_tick_t < max(5 * self.cfg.interval_seconds, 10.0)


async def serve(cfg: Config) -> None:
    from exporter.web import start_web

    daemon = Daemon(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stop)
    runner = await start_web(daemon, cfg.host, cfg.port)
    log.info("kvwatt listening on %s, watching %s", cfg.listen,
             ", ".join(f"{s.name}={s.url}" for s in cfg.servers))
    try:
        await daemon.run_loop()
    finally:
        await runner.cleanup()
        daemon.energy.close()
    log.info("kvwatt stopped")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML configuration file (also $KVWATT_CONFIG)")
    p.add_argument("--server", action="append", metavar="NAME=URL",
                   help="a vLLM server root URL to watch (repeatable; replaces the file's server list)")
    p.add_argument("--listen", metavar="HOST:PORT", help="address to serve /metrics on (default 0.0.0.0:8492)")
    p.add_argument("--interval", metavar="SECONDS", help="sampling interval (default 1s)")
    p.add_argument("--powercap-root", metavar="DIR", help="powercap tree for RAPL (default /sys/class/powercap)")
    p.add_argument("--state-dir", metavar="DIR", help="where baselines are persisted (default /var/lib/kvwatt)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> Config:
    return resolve(args.config, servers=args.server, listen=args.listen, interval=args.interval,
                   powercap_root=args.powercap_root, state_dir=args.state_dir)


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(cfg))
    except OSError as e:  # e.g. the port is taken
        log.error("cannot serve on %s: %s", cfg.listen, e.strerror or e)
        return 2
    return 0
