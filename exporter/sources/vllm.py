"""vLLM source: fetch one server's /metrics and turn it into an EngineReading (the vLLM engine adapter).

Server-wide figures sum counters over ``engine`` (data-parallel ranks); KV usage takes the highest engine,
because the fullest engine is the one that preempts. Names and renames from vLLM 0.11 to 0.33 are handled
here and nowhere else (docs/vllm-metrics.md).

``VllmAdapter.read(text)`` parses only the families ``extract`` uses (``NEEDED_FAMILIES``, located by one
regex scan: exporter/expfmt.parse_families); ``extract(parse(text))`` -- the general parser -- gives exactly
the same reading (tests/test_engine_adapter.py holds them equal). ``VllmSource.read`` runs the decoding in
a worker thread so a large exposition never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import aiohttp
from yarl import URL

from exporter.expfmt import Exposition, parse, parse_families, process_start_time
from exporter.samples import EngineReading, SourceStatus, VllmInfo, VllmReading
from exporter.sources.engine import EngineAdapter, SourceError, adapter_for, capabilities_of
from exporter.vllm_names import RENAMES

__all__ = ["COUNTERS", "DEPRECATED_OFFLOAD", "GAUGES_SUM", "GIB", "NEEDED_FAMILIES", "SourceError", "VllmAdapter",
           "VllmReading", "VllmSource", "extract"]
log = logging.getLogger("kvwatt.vllm")

# counter key -> (series base name without "vllm:" and "_total", label filter)
COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "generation_tokens": ("generation_tokens", {}),
    "prompt_tokens": ("prompt_tokens", {}),
    "preemptions": ("num_preemptions", {}),
    "prompt_local_compute": ("prompt_tokens_by_source", {"source": "local_compute"}),
    "prompt_local_cache_hit": ("prompt_tokens_by_source", {"source": "local_cache_hit"}),
    "prompt_external_kv_transfer": ("prompt_tokens_by_source", {"source": "external_kv_transfer"}),
    "prefix_queries": ("prefix_cache_queries", {}),
    "prefix_hits": ("prefix_cache_hits", {}),
    "external_prefix_queries": ("external_prefix_cache_queries", {}),
    "external_prefix_hits": ("external_prefix_cache_hits", {}),
    "flops": ("estimated_flops_per_gpu", {}),
    "offload_store_bytes": ("kv_offload_store_bytes", {}),
    "offload_load_bytes": ("kv_offload_load_bytes", {}),
    "offload_allocation_failures": ("kv_offload_allocation_failure", {}),
    "offload_stores_skipped": ("kv_offload_stores_skipped", {}),
}
# deprecated spelling (0.16 -> now), used only when the flat 0.24+ series is absent
DEPRECATED_OFFLOAD = {
    "offload_store_bytes": ("kv_offload_total_bytes", {"transfer_type": "GPU_to_CPU"}),
    "offload_load_bytes": ("kv_offload_total_bytes", {"transfer_type": "CPU_to_GPU"}),
}
GAUGES_SUM = {
    "running": ("num_requests_running", {}),
    "waiting": ("num_requests_waiting", {}),
    "waiting_capacity": ("num_requests_waiting_by_reason", {"reason": "capacity"}),
    "waiting_deferred": ("num_requests_waiting_by_reason", {"reason": "deferred"}),
}
INFO_BASES = ("kv_cache_usage_perc", "cache_config_info", "kv_offload_config_info")
GIB = 2 ** 30


def _needed() -> tuple[frozenset[str], frozenset[str]]:
    bases = {base for base, _ in (*COUNTERS.values(), *DEPRECATED_OFFLOAD.values(), *GAUGES_SUM.values())}
    bases |= set(INFO_BASES)
    spellings = bases | {old for old, new in RENAMES.items() if new in bases}
    families = {f"vllm:{b}{suffix}" for b in spellings for suffix in ("", "_total")}
    return frozenset(bases), frozenset(families)


# NEEDED_BASES: the canonical base names extract() reads; NEEDED_FAMILIES: every wire name that maps onto
# one of them (with and without _total, old names before a rename). Nothing else is parsed on the fast path.
NEEDED_BASES, NEEDED_FAMILIES = _needed()


def _canonical(exp: Exposition) -> dict[str, dict]:
    """Series keyed by base name: strip 'vllm:', '_total'; apply renames. Newer names win over old ones.

    Only the bases extract() reads are kept, so a full parse and a parse of NEEDED_FAMILIES give the same."""
    out: dict[str, dict] = {}
    from_old_name: set[str] = set()
    for name, samples in exp.series.items():
        if not name.startswith("vllm:"):
            continue
        base = name[5:].removesuffix("_total")
        renamed = base in RENAMES
        if renamed:
            base = RENAMES[base]
        if base not in NEEDED_BASES:
            continue
        if renamed:
            if base not in out:
                out[base] = samples
                from_old_name.add(base)
        elif base not in out or base in from_old_name:  # the current name wins over an old one
            out[base] = samples
            from_old_name.discard(base)
        # else: both "x" and "x_total" on the wire, the same counter: keep the first
    return out


def _select(series: dict, base: str, match: dict[str, str]) -> list[float] | None:
    samples = series.get(base)
    if samples is None:
        return None
    vals = [v for labels, v in samples.items() if all(dict(labels).get(k) == want for k, want in match.items())]
    return vals or None


def _sum_finite(vals: list[float] | None) -> float | None:
    if vals is None:
        return None
    good = [v for v in vals if math.isfinite(v)]
    return sum(good) if good else None


def extract(exp: Exposition, process_start: float | None = None) -> EngineReading:
    """The reading from a parsed exposition (a full ``parse`` or ``parse_families(text, NEEDED_FAMILIES)``)."""
    series = _canonical(exp)
    counters: dict[str, float] = {}
    for key, (base, match) in COUNTERS.items():
        v = _sum_finite(_select(series, base, match))
        if v is None and key in DEPRECATED_OFFLOAD:
            v = _sum_finite(_select(series, *DEPRECATED_OFFLOAD[key]))
        if v is not None:
            counters[key] = v
    gauges: dict[str, float] = {}
    for key, (base, match) in GAUGES_SUM.items():
        v = _sum_finite(_select(series, base, match))
        if v is not None:
            gauges[key] = v
    usage = [v for v in (_select(series, "kv_cache_usage_perc", {}) or []) if math.isfinite(v)]
    if usage:
        gauges["kv_usage"] = max(usage)
    info = _info(series, counters, process_start)
    return EngineReading(counters=counters, gauges=gauges, info=info,
                         capabilities=capabilities_of(counters, gauges, info), engine="vllm")


def _info(series: dict, counters: dict[str, float], process_start: float | None) -> VllmInfo:
    model = ""
    for samples in series.values():
        for labels in samples:
            model = dict(labels).get("model_name", "")
            if model:
                break
        if model:
            break
    enabled, buffer_bytes, backend, blocks, block_size = _offload_from_cache_config(series.get("cache_config_info"))
    cfg = series.get("kv_offload_config_info")
    if cfg:
        sizes = [_float(dict(labels).get("cpu_kv_cache_size_bytes")) for labels in cfg]
        sizes = [s for s in sizes if s is not None]
        if sizes:
            buffer_bytes, enabled = sum(sizes), True
    if not enabled and any(k in counters for k in ("offload_store_bytes", "offload_load_bytes")):
        enabled = True  # a connector is emitting offload series
    return VllmInfo(model_name=model, offload_enabled=enabled, offload_buffer_bytes=buffer_bytes,
                    offload_backend=backend if enabled else ("none" if enabled is False else ""),
                    num_gpu_blocks=blocks, block_size=block_size,
                    has_token_sources="prompt_local_compute" in counters, has_mfu="flops" in counters,
                    process_start_time_seconds=process_start)


def _float(text: str | None) -> float | None:
    try:
        v = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _offload_from_cache_config(samples: dict | None):
    """vllm:cache_config_info: offloading is on when kv_offloading_size != "None" (GiB).

    kv_offloading_backend reads "native" even when off, so it is only meaningful with a size."""
    if not samples:
        return None, None, "", None, None
    enabled, buffer_bytes, backend, blocks, block_size = False, None, "", 0.0, None
    for labels in samples:
        lab = dict(labels)
        size = _float(lab.get("kv_offloading_size"))
        if size is not None and size > 0:
            enabled = True
            buffer_bytes = (buffer_bytes or 0.0) + size * GIB
            backend = lab.get("kv_offloading_backend", "native") or "native"
        nb = _float(lab.get("num_gpu_blocks"))
        blocks = max(blocks, nb) if nb is not None else blocks  # already summed over DP engines
        block_size = _float(lab.get("block_size")) or block_size
    return enabled, buffer_bytes, backend, (blocks or None), block_size


_process_start = process_start_time  # the old private name, still imported by tests


class VllmAdapter:
    """The vLLM engine adapter (exporter/sources/engine.py): only NEEDED_FAMILIES are parsed."""

    name = "vllm"

    def detect(self, text: str) -> bool:
        return text.startswith("vllm:") or "\nvllm:" in text

    def read(self, text: str, problems: list[str] | None = None) -> EngineReading:
        exp = parse_families(text, NEEDED_FAMILIES)
        if not exp.series:
            detail = f"{exp.errors} malformed lines" if exp.errors else "no usable vllm: series in the exposition"
            raise SourceError("parse_error", detail)
        if exp.errors and problems is not None:
            problems.append(f"parse_error: {exp.errors} bad lines skipped")
        return extract(exp, process_start_time(text))


class VllmSource:
    """Reads one server. ``read()`` returns (status, reading or None); it never raises.

    ``adapter`` fixes the engine adapter; by default each exposition picks its own (``adapter_for``: vLLM
    unless another registered engine recognises it)."""

    def __init__(self, name: str, url: str, timeout_seconds: float, max_body_bytes: int,
                 adapter: EngineAdapter | None = None):
        self.name = name
        # credentials in the URL go as basic auth and nowhere else: metrics_url is safe to show in a reason
        u = URL(url)
        self.auth = aiohttp.BasicAuth(u.user or "", u.password or "") if u.user or u.password else None
        self.metrics_url = str(u.with_user(None)).rstrip("/") + "/metrics"
        self.timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self.max_body_bytes = max_body_bytes
        self.adapter = adapter

    async def fetch(self, session: aiohttp.ClientSession) -> str:
        try:
            async with session.get(self.metrics_url, timeout=self.timeout, auth=self.auth) as resp:
                if resp.status != 200:
                    raise SourceError(f"http_{resp.status}", self.metrics_url)
                if (resp.content_length or 0) > self.max_body_bytes:
                    raise SourceError("body_too_large", f"more than {self.max_body_bytes} bytes")
                chunks, size = [], 0
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > self.max_body_bytes:  # chunked bodies announce no length: count as we go
                        raise SourceError("body_too_large", f"more than {self.max_body_bytes} bytes")
                    chunks.append(chunk)
                return b"".join(chunks).decode("utf-8", errors="replace")
        except asyncio.TimeoutError:
            raise SourceError("timeout", self.metrics_url) from None
        except aiohttp.ClientConnectorError as e:
            raise SourceError("unreachable", str(e.os_error or e)) from None
        except aiohttp.ClientError as e:
            raise SourceError("http_error", type(e).__name__) from None

    def decode(self, text: str, problems: list[str] | None = None) -> EngineReading:
        """Parse and extract one exposition (CPU only, no I/O: call it from a worker thread). Raises
        SourceError("parse_error", ...) when nothing usable; skipped bad lines are appended to ``problems``."""
        try:
            return (self.adapter or adapter_for(text)).read(text, problems)
        except SourceError:
            raise
        except Exception as e:  # a bug in an adapter must not take the daemon down: this server is down
            log.exception("%s: decoding the exposition failed", self.name)
            raise SourceError("parse_error", f"{type(e).__name__}: {e}") from None

    def status(self, problems: list[str], seconds: float) -> SourceStatus:
        """The status of a read that produced a reading: ok, or degraded with the problems as the reason."""
        if problems:
            return SourceStatus("vllm", self.name, True, "; ".join(problems), seconds, "degraded")
        return SourceStatus("vllm", self.name, True, "", seconds, "ok")

    def down(self, error: SourceError, seconds: float) -> SourceStatus:
        return SourceStatus("vllm", self.name, False, error.reason, seconds, "down")

    async def read(self, session: aiohttp.ClientSession) -> tuple[SourceStatus, EngineReading | None]:
        start = time.perf_counter()
        problems: list[str] = []
        try:
            text = await self.fetch(session)
            reading = await asyncio.to_thread(self.decode, text, problems)  # never on the event loop
        except SourceError as e:
            return self.down(e, time.perf_counter() - start), None
        return self.status(problems, time.perf_counter() - start), reading
