"""The one sampler: reads every source once per tick, each with its own deadline, never blocking the event loop.

Used by `kvwatt run`, `kvwatt baseline idle`, `kvwatt baseline record` and the experiment's measurement:

    async with Sampler(cfg, servers) as sampler:
        async for tick in sampler.ticks(interval, stop):   # scheduled from each tick's real start (rule 9)
            ...

- vLLM servers: one read task per server (fetch on the loop, parse and extract in a worker thread). A tick
  waits for them at most ``deadline`` seconds; a read still running then is left to finish and its result
  goes to the first tick after it completes. Counters are cumulative, so a late reading lands in a later
  interval: nothing is lost or invented. A server is not read again while its read is in flight (it ends
  by its own http_timeout), so a blackholed server never delays the others or piles up connections.
- NVML and RAPL: each in its own worker thread (the NVML calls release the GIL, like every ctypes call; the
  GPUs are read concurrently inside NvmlSource). An energy read that misses the deadline gives that tick a
  no-sample reading for each of the source's devices (a gap, energy-measurement.md rule 3) and its late
  result is dropped, so the next step re-bases instead of inventing energy.

Every read's status passes through ``Sampler.tick``, so this is where a source's changes of health are
logged (HealthLog): once when it goes down or degraded (with the reason), once when it is back up; never once
per tick (a detail that changes every tick, a count of bad lines, is not a change).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, AsyncIterator, Sequence

import aiohttp

from exporter.config import Config, ServerConfig
from exporter.samples import DeviceReading, ServerRead, SourceStatus, Tick
from exporter.sources.endpoint import EngineSource
from exporter.sources.nvml import NvmlSource
from exporter.sources.rapl import RaplSource
from exporter.sources.tariff import PriceSource, PriceTracker

log = logging.getLogger("kvwatt.sampler")

MIN_DEADLINE_SECONDS = 0.05
ENERGY_DEADLINE_FRACTION = 0.8
DEADLINE_REASON = "deadline: read still running at the tick's deadline"


def missed_deadline(status: SourceStatus) -> bool:
    return status.reason.startswith(DEADLINE_REASON)


def read_deadline(interval_seconds: float, http_timeout_seconds: float) -> float:
    """How long a tick waits for its reads: half the interval (the other half is for deriving and serving),
    never more than the HTTP timeout."""
    return max(min(0.5 * interval_seconds, http_timeout_seconds), MIN_DEADLINE_SECONDS)


class _EnergySource:
    """One energy source (nvml or rapl) read in its own thread, at most one read in flight."""

    def __init__(self, name: str, source: Any) -> None:
        self.name, self.source = name, source
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvwatt-{name}")
        self.future: Future | None = None
        self.known: dict[str, DeviceReading] = {}  # last reading of each device (for gap readings)
        # RAPL takes no deadline: its sysfs reads take microseconds
        self.takes_deadline = "deadline_seconds" in inspect.signature(source.read).parameters

    def start(self, t: float, deadline: float) -> asyncio.Future | None:
        if self.future is not None and not self.future.done():
            return None  # the previous read is still running: this tick gets gaps
        self.future = self.pool.submit(self._read, t, deadline)
        return asyncio.wrap_future(self.future)

    def _read(self, t: float, deadline: float):
        if self.takes_deadline:
            return self.source.read(t, deadline_seconds=deadline)
        return self.source.read(t)

    def result(self, started: asyncio.Future | None, deadline: float) -> tuple[SourceStatus, list[DeviceReading]]:
        if started is not None and started.done() and not started.cancelled():
            try:
                status, readings = started.result()
            except Exception as e:  # a source must never raise into the loop; if it does, it is down
                log.exception("%s read failed", self.name)
                return SourceStatus(source=self.name, server="", up=False, reason=f"error: {type(e).__name__}: {e}",
                                    duration_seconds=0.0, state="down"), []
            self.known = {r.device: r for r in readings}
            return status, readings
        gaps = [DeviceReading(device=r.device, kind=r.kind, labels=dict(r.labels), joules_total=None, continuous=False,
                              power_watts=None, method=r.method)
                for r in self.known.values()]
        return SourceStatus(source=self.name, server="", up=False, reason=f"{DEADLINE_REASON} ({deadline:.3g}s)",
                            duration_seconds=deadline, state="down"), gaps

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        try:
            close = getattr(self.source, "close", None)
            if close:
                close()
        except Exception:  # closing: nothing useful to do with an error
            pass


class HealthLog:
    """Logs each source's changes of health, once each: going down or degraded (warning, with the reason),
    back up (info). A new reason word while the state stays is logged at debug (a refused connection after a
    dropped one); a new detail (3, then 4 bad lines) is not logged at all. A source fine from its first read
    is not logged; one that starts down is, once.

    A loss the source logs itself, per device, is not logged again here: NVML logs each GPU that is lost
    (naming it) and each that is back (sources/nvml.py), so a GPU lost is one line, not two, and a second GPU
    lost while the source is already degraded by the first is still a line of its own."""

    SELF_LOGGED = frozenset({"gpu_lost"})  # reason words whose changes the source logs per device

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], tuple[str, str]] = {}  # (source, server) -> (state, reason word)

    def note(self, status: SourceStatus) -> None:
        key, now = (status.source, status.server), (status.state, status.code)
        before = self.last.get(key)
        self.last[key] = now
        if now == before or (before is None and status.state == "ok"):
            return
        if status.code in self.SELF_LOGGED or (status.state == "ok" and before[1] in self.SELF_LOGGED):
            return
        what = f"{status.source} server {status.server!r}" if status.server else status.source
        if before is not None and before[0] == status.state:
            log.debug("%s still %s, now: %s", what, status.state, status.reason)
        elif status.state == "ok":
            log.info("%s is %s", what, "back up" if before[0] == "down" else "ok again")
        else:
            log.warning("%s is %s: %s", what, status.state, status.reason or status.code)


def price_trackers(cfg: Config) -> list[PriceTracker]:
    """A tracker for each price or carbon intensity configured as a URL (a configured number needs none)."""
    settings = (("electricity_price", cfg.electricity_price), ("carbon_intensity", cfg.carbon_intensity))
    return [PriceTracker(PriceSource(q, s, cfg.http_timeout_seconds, cfg.max_body_bytes),
                         cfg.price_refresh_seconds, cfg.price_max_age_seconds)
            for q, s in settings if s is not None and s.url is not None]


class Sampler:
    def __init__(self, cfg: Config, servers: Sequence[ServerConfig] | None = None, nvml: Any = None,
                 rapl: Any = None, energy: bool = True, deadline_seconds: float | None = None) -> None:
        self.cfg = cfg
        servers = cfg.servers if servers is None else servers
        self.engines = {s.name: EngineSource(s.name, s.url, cfg.http_timeout_seconds, cfg.max_body_bytes,
                                          sidecar_urls=s.sidecar_urls) for s in servers}
        self.energy: list[_EnergySource] = []
        if energy:
            if nvml is None:
                nvml = NvmlSource(cfg.nvml_enabled)
            if rapl is None:
                rapl = RaplSource(cfg.powercap_root)
            self.energy = [_EnergySource("nvml", nvml), _EnergySource("rapl", rapl)]
        self.deadline = deadline_seconds if deadline_seconds is not None else \
            read_deadline(cfg.interval_seconds, cfg.http_timeout_seconds)
        # Energy reads may finish later in the tick than engine reads (up to 80 % of the interval): a gap costs
        # the interval and the next one (the counter re-bases), and only the tick waits; /metrics is served from
        # the published snapshot meanwhile.
        self.energy_grace = max(ENERGY_DEADLINE_FRACTION * cfg.interval_seconds - self.deadline, 0.0)
        self.pending: dict[str, asyncio.Task] = {}
        self.session: aiohttp.ClientSession | None = None
        self.health = HealthLog()
        self.prices = price_trackers(cfg)

    async def __aenter__(self) -> "Sampler":
        # one connection per server at most (a read in flight is never doubled)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit_per_host=1))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for task in self.pending.values():
            task.cancel()
        if self.pending:
            await asyncio.gather(*self.pending.values(), return_exceptions=True)
        self.pending.clear()
        if self.session is not None:
            await self.session.close()
            self.session = None
        for e in self.energy:
            e.close()
        for p in self.prices:
            await p.close()

    async def tick(self, t: float) -> Tick:
        """Read every source for the tick at monotonic time ``t``; returns within ~``deadline`` seconds, or up
        to 80 % of the interval while an energy read is still running (``energy_grace``)."""
        assert self.session is not None, "use `async with Sampler(...)`"
        for name, src in self.engines.items():
            if name not in self.pending:
                self.pending[name] = asyncio.create_task(src.read(self.session))
        started = [(e, e.start(t, self.deadline)) for e in self.energy]
        waiting = list(self.pending.values()) + [f for _, f in started if f is not None]
        if waiting:
            await asyncio.wait(waiting, timeout=self.deadline)
        energy = [f for _, f in started if f is not None and not f.done()]
        if energy:  # a RAPL/NVML thread starved by a busy machine: a little longer before it becomes a gap
            await asyncio.wait(energy, timeout=self.energy_grace)
        servers = {}
        for name, task in list(self.pending.items()):
            if task.done():
                del self.pending[name]
                status, reading = task.result()
                servers[name] = ServerRead(name, status, reading)
                self.health.note(status)
        statuses, devices = [], []
        for e, fut in started:
            status, readings = e.result(fut, self.deadline)
            statuses.append(status)
            self.health.note(status)
            devices += readings
        return Tick(t, servers, tuple(statuses), tuple(devices), self._prices(t))

    def _prices(self, t: float) -> tuple:
        """The price URLs' values in use at ``t``; a read due is started, never waited for (its result is
        taken at a later tick), so a slow or dead URL costs a tick nothing."""
        out = []
        for p in self.prices:
            p.poll(self.session, t)
            reading = p.reading(t)
            if reading.status.code != "not_read_yet":  # HealthLog logs its changes only
                self.health.note(reading.status)
            out.append(reading)
        return tuple(out)

    async def ticks(self, interval: float, stop: asyncio.Event | None = None,
                    until: float | None = None) -> AsyncIterator[Tick]:
        """Ticks every ``interval`` seconds until ``stop`` is set or monotonic time ``until`` passes.

        Scheduled from each tick's real start, not a fixed grid: after a late wake-up (a starved process) a
        grid would put the next tick a few ms later, and a few ms of energy is noise (energy-measurement.md
        rule 9). Ticks are >= one interval apart; missed ones are skipped."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            t = time.monotonic()
            yield await self.tick(t)
            if until is not None and time.monotonic() >= until:
                return
            delay = max(t + interval - time.monotonic(), 0.0)
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass
