"""vLLM source: fetch one server's /metrics and turn it into a VllmReading.

Server-wide figures sum counters over ``engine`` (data-parallel ranks); KV usage takes the highest engine,
because the fullest engine is the one that preempts. Names and renames from vLLM 0.11 to 0.33 are handled
here and nowhere else (docs/vllm-metrics.md).
"""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp

from exporter.expfmt import Exposition, parse
from exporter.samples import SourceStatus, VllmInfo, VllmReading
from exporter.vllm_names import RENAMES

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
GIB = 2 ** 30


class SourceError(Exception):
    """A read failed; ``reason`` is a short word used as the label value (timeout, refused, http_503 ...)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def _canonical(exp: Exposition) -> dict[str, dict]:
    """Series keyed by base name: strip 'vllm:', '_total'; apply renames. Newer names win over old ones."""
    out: dict[str, dict] = {}
    from_old_name: set[str] = set()
    for name, samples in exp.series.items():
        base = name[5:]
        if base.endswith("_total"):
            base = base[:-6]
        if base in RENAMES:
            base = RENAMES[base]
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


def extract(exp: Exposition, process_start: float | None = None) -> VllmReading:
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
    return VllmReading(counters=counters, gauges=gauges, info=_info(series, counters, process_start))


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


def _process_start(text: str) -> float | None:
    i = text.find("\nprocess_start_time_seconds ")
    if i < 0:
        return None
    line = text[i + 1:text.find("\n", i + 1)]
    return _float(line.split()[1]) if len(line.split()) >= 2 else None


class VllmSource:
    """Reads one server. ``read()`` returns (status, reading or None); it never raises."""

    def __init__(self, name: str, url: str, timeout_seconds: float, max_body_bytes: int):
        self.name = name
        self.metrics_url = url.rstrip("/") + "/metrics"
        self.timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self.max_body_bytes = max_body_bytes

    async def fetch(self, session: aiohttp.ClientSession) -> str:
        try:
            async with session.get(self.metrics_url, timeout=self.timeout) as resp:
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

    async def read(self, session: aiohttp.ClientSession) -> tuple[SourceStatus, VllmReading | None]:
        start = time.perf_counter()
        try:
            text = await self.fetch(session)
            exp = parse(text)
            if not exp.series:
                raise SourceError("parse_error", "no vllm: series in the exposition")
            reading = extract(exp, _process_start(text))
        except SourceError as e:
            return SourceStatus("vllm", self.name, False, e.reason, time.perf_counter() - start, "down"), None
        status = SourceStatus("vllm", self.name, True, "", time.perf_counter() - start,
                              "degraded" if exp.errors else "ok")
        if exp.errors:
            status = SourceStatus("vllm", self.name, True, f"parse_error: {exp.errors} bad lines skipped",
                                  status.duration_seconds, "degraded")
        return status, reading
