"""The daemon as a service (`kvwatt run`): the state directory, the idle and reference books, the model, the
signal handlers, the web server and the daemon's loop (exporter.runtime.daemon), for the life of the process."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import signal
import sys
import time
from dataclasses import replace

from exporter.config import Config, is_unconfigured_default, shown_server
from exporter.idle.baseline import BaselineBook
from exporter.model import Model
from exporter.model.reference_book import ReferenceBook
from exporter.runtime.build import build_info
from exporter.runtime.daemon import Daemon
from exporter.runtime.gcpolicy import FreezePolicy, limit_malloc
from exporter.runtime.logsetup import setup as setup_logging
from exporter.runtime.sampler import Sampler
from exporter.runtime.statedir import open_state_dir
from exporter.runtime.workers import (
    GroupGpus,
    NotRead,
    Supervisor,
    WorkerSpec,
    hand_over,
    processes_for,
    watch_parent,
    worker_state_dir,
)
from exporter.serve.web import WebLimits, start_web
from exporter.serve.webconfig import WebConfig
from exporter.sources.nvml import NvmlSource
from exporter.sources.rapl import RaplSource

log = logging.getLogger("kvwatt")


class CannotListen(Exception):
    """Binding the HTTP address failed (port taken, address not local): the one start failure that exits."""


# A tick is derived in a worker thread (daemon.run_loop) while the loop answers scrapes; with CPython's default
# 5 ms switch interval a scrape waited up to a whole slice of the tick's thread for the GIL
SWITCH_INTERVAL_SECONDS = 0.0005
DEFAULT_REFRESH_SECONDS = 3600.0  # a history kept without an age bound: check for a leak hourly


def tune_runtime(daemon: Daemon | None = None) -> None:
    """Once start-up is done. The start-up objects (modules, catalog, configuration: ~43,500) live as long as the
    process: frozen out of the collector's walks, a full collection's pause fell from 23-96 ms to 11-14 ms; a
    0.5 ms switch interval put /metrics' p99 at 2.2 ms instead of 12.4 ms while ticks are derived (bench/soak.py,
    8 servers x 8 GPUs at 0.25 s, windows [1m, 1h], load 0.6-0.8; docs/architecture.md "Windows"). The hour's
    history is frozen as it ages by the ``daemon``'s FreezePolicy (exporter/runtime/gcpolicy.py), one span of history
    between the checks for a leak."""
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    if daemon is not None:
        spans = [sm.history.max_age_seconds for sm in daemon.model.servers.values()]
        span = max((s for s in spans if math.isfinite(s)), default=DEFAULT_REFRESH_SECONDS)
        daemon.gc_policy = FreezePolicy(refresh_seconds=span)


async def _listen(source, cfg: Config, limits: WebLimits | None, web_config: WebConfig | None,
                  telemetry_path: str, notes: tuple[str, ...]):
    """Serve the web endpoints of ``source`` (the daemon, or the workers' supervisor) and say so once, with what
    start-up changed. CannotListen when the address cannot be bound."""
    try:
        runner = await start_web(source, cfg.host, cfg.port, limits or WebLimits(), web_config, telemetry_path)
    except OSError as e:  # only here: an OSError elsewhere (e.g. the state dir) is not about serving
        raise CannotListen(e.strerror or str(e)) from e
    log.info("%s listening on %s%s (%s), watching %s", build_info().line(), cfg.listen, telemetry_path,
             web_config.describe() if web_config else "http, no auth",
             ", ".join(shown_server(s) for s in cfg.servers))
    for note in notes:
        log.info("%s", note)
    return runner


async def serve(cfg: Config, limits: WebLimits | None = None, web_config: WebConfig | None = None,
                telemetry_path: str = "/metrics", sampler: Sampler | None = None, notes: tuple[str, ...] = ()) -> None:
    """Open the state directory, build the model with its books, serve the web endpoints and run the
    daemon's loop until SIGTERM or SIGINT. CannotListen when the address cannot be bound. ``sampler``: the
    daemon's own by default (`kvwatt demo` gives one with its simulated GPUs). ``notes``: what start-up changed
    (the open-file limit), logged once kvwatt listens."""
    limit_malloc()  # before the threads (exporter.runtime.gcpolicy)
    state = open_state_dir(cfg.state_dir)  # locked for the daemon's life; never fatal (exporter.runtime.statedir)
    try:
        cfg = replace(cfg, state_dir=state.path)
        processes = 1 if sampler is not None else processes_for(cfg)  # `kvwatt demo` brings its own sampler
        if processes > 1:
            await _serve_workers(cfg, processes, limits, web_config, telemetry_path, notes)
            return
        book = BaselineBook(state.path, cfg.idle_power_watts, read_only_reason=state.reason)
        refs = ReferenceBook(state.path, time.time, read_only_reason=state.reason)
        daemon = Daemon(cfg, sampler=sampler, model=Model(cfg, book=book, references=refs))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        runner = await _listen(daemon, cfg, limits, web_config, telemetry_path, notes)
        tune_runtime(daemon)
        if any(is_unconfigured_default(s) for s in cfg.servers):
            log.info("no server configured: watching %s; if nothing answers there, start vLLM on it, pass "
                     "--server NAME=URL, or run `kvwatt demo` to see kvwatt on a real engine's capture",
                     cfg.servers[0].url)
        try:
            await daemon.run_loop()
        finally:
            await runner.cleanup()
    finally:
        state.close()
    log.info("kvwatt stopped")


async def _serve_workers(cfg: Config, processes: int, limits: WebLimits | None, web_config: WebConfig | None,
                         telemetry_path: str, notes: tuple[str, ...]) -> None:
    """`kvwatt run` with several processes (exporter/runtime/workers.py): group 0 is derived here, every other
    group in a worker process; this process serves their merged /metrics and /api/status until SIGTERM or SIGINT,
    then stops the workers (no orphan)."""
    sup = Supervisor(cfg, processes, worker_main, in_process=True)
    spec = sup.workers[0].spec
    state = open_state_dir(worker_state_dir(cfg.state_dir, spec.index, spec.count))
    try:
        daemon = _group_daemon(spec, state)
        daemon.on_publish = sup.local_hand_over(daemon)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        runner = await _listen(sup, cfg, limits, web_config, telemetry_path, notes)
        sup.start()
        log.info("%d processes: %s", len(sup.workers), sup.describe())
        tune_runtime(daemon)  # the merge runs in the pipe readers' threads, the tick in its own: scrapes wait 0.5 ms
        try:
            await daemon.run_loop()
        finally:
            await runner.cleanup()
            await loop.run_in_executor(None, sup.stop)
    finally:
        state.close()


def worker_main(spec: WorkerSpec, conn) -> None:
    """A worker process' entry (spawned by exporter.runtime.workers.Supervisor): a Daemon over its group of
    servers, handing each tick to the parent, until SIGTERM or the parent is gone."""
    limit_malloc()
    setup_logging(spec.cfg.log_level, spec.cfg.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the parent stops the workers
    try:
        asyncio.run(_worker(spec, conn))
    except KeyboardInterrupt:
        pass


def _group_daemon(spec: WorkerSpec, state) -> Daemon:
    """The Daemon of one group of servers (a worker's, or group 0's in the parent), its state in ``state``: its
    servers' GPUs only, RAPL and the GPUs no server lists in group 0 only."""
    full = spec.cfg
    cfg = replace(full, servers=tuple(s for s in full.servers if s.name in spec.names), state_dir=state.path)
    nvml = GroupGpus(NvmlSource(cfg.nvml_enabled), full.servers, spec.names, shared=spec.index == 0)
    rapl = RaplSource(cfg.powercap_root) if spec.index == 0 else NotRead()
    book = BaselineBook(state.path, cfg.idle_power_watts, read_only_reason=state.reason)
    refs = ReferenceBook(state.path, time.time, read_only_reason=state.reason)
    model = Model(cfg, book=book, references=refs)
    model.energy.split_host = False  # no group knows the others' GPU energy (exporter/runtime/workers.py)
    model.energy.assign_servers = full.servers
    return Daemon(cfg, sampler=Sampler(cfg, nvml=nvml, rapl=rapl), model=model)


async def _worker(spec: WorkerSpec, conn) -> None:
    state = open_state_dir(worker_state_dir(spec.cfg.state_dir, spec.index, spec.count))
    try:
        daemon = _group_daemon(spec, state)
        daemon.on_publish = send = hand_over(conn, spec.index, daemon)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, daemon.stop)
        watch_parent(conn, loop, daemon.stop, send.answer_status)
        tune_runtime(daemon)
        await daemon.run_loop()
    finally:
        state.close()
