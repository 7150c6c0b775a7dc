"""Offload buffer sizing (methods.md s6).

    write rate  = offload_store_bytes increase / covered seconds      (GPU -> host tier)
    read rate   = offload_load_bytes increase / covered seconds       (host tier -> GPU)
    residency   = buffer bytes / write rate                           (how long an offloaded block survives;
                  buffer tokens / write tokens per second for an engine that counts tokens: SGLang HiCache)
    undersized  = residency < p99 tool-call latency  OR  allocation failures / skipped stores rose
    recommended = write rate x p99 tool-call latency x headroom
Per vLLM tiering tier (methods.md s14): bandwidth = tier bytes / tier transfer seconds, busy = transfer seconds /
covered seconds, kappa_crit_t = kappa_crit x B_t / (B_t + B).

The store counter is vllm:kv_offload_store_bytes_total (0.24+) or, before that, the deprecated
vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"}; sources/vllm.py maps both to
``offload_store_bytes``. Unknown stays None: no offload series -> no rate; no buffer size -> no residency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exporter import rules
from exporter.derive import kappa
from exporter.derive.pressure import rate_per_second
from exporter.results import TierFlows, TierState
from exporter.rules.keys import labelled_key
from exporter.store import WindowAggregate

# native connector (0.24+ / 0.26+), and the SimpleCPU connector's stores dropped because its pool was full
FAILURE_KEYS = ("offload_allocation_failures", "offload_stores_skipped", "offload_stores_dropped_full")


@dataclass(frozen=True)
class TransferRates:
    write_bytes_per_second: float | None
    read_bytes_per_second: float | None


def transfer_rates(x: WindowAggregate) -> TransferRates:
    return TransferRates(rate_per_second(x, "offload_store_bytes"),
                         rate_per_second(x, "offload_load_bytes"))


@dataclass(frozen=True)
class TokenRates:
    """Offload traffic counted in tokens (engines that count tokens, not bytes: SGLang, LMCache, KVBM)."""

    write_tokens_per_second: float | None
    read_tokens_per_second: float | None


def token_rates(x: WindowAggregate) -> TokenRates:
    return TokenRates(rate_per_second(x, "offload_store_tokens"), rate_per_second(x, "offload_load_tokens"))


TIER_HIT_KEYS = {"host": "offload_host_hit_ratio", "disk": "offload_disk_hit_ratio"}


def tier_state(gauges: dict[str, float] | None) -> TierState:
    """From the last reading's gauges; all None when the server is not up (a stale value is not shown as
    current). Never vLLM's kv_offload_cpu_cache_usage_perc: that is the share pinned by transfers in flight,
    not occupancy (vllm #45737)."""
    if not gauges:
        return TierState()
    hits = {tier: gauges[key] for tier, key in TIER_HIT_KEYS.items() if key in gauges}
    return TierState(gauges.get("offload_buffer_used_ratio"), gauges.get("offload_buffer_used_bytes"),
                     hits or None)


def residency(buffer_bytes: float | None, write_bytes_per_second: float | None) -> float | None:
    """Residency in seconds: buffer bytes / write bytes per second. None when either is unknown, or when
    nothing is written (residency unbounded: exported as absent rather than +Inf), or so little that the
    quotient overflows."""
    if buffer_bytes is None or write_bytes_per_second is None or write_bytes_per_second <= 0:
        return None
    seconds = buffer_bytes / write_bytes_per_second
    return seconds if math.isfinite(seconds) else None


def store_failures(x: WindowAggregate) -> float | None:
    """Allocation failures (0.26+) plus skipped stores (0.24+) plus the SimpleCPU connector's stores dropped
    with its pool full, in the window; None when none is exported."""
    parts = [x.delta(k) for k in FAILURE_KEYS]
    known = [p for p in parts if p is not None]
    return sum(known) if known else None


def undersized(residency: float | None, write_bytes_per_second: float | None, failures: float | None,
               p99_tool_latency_seconds: float) -> bool | None:
    """True when residency < p99 tool-call latency or stores failed in the window; False when every known
    part says no; None when neither part is known.

    The residency part is False when nothing is written (no pressure on the buffer) and unknown without a
    buffer size or write rate. The failure part is unknown before 0.24 (no counters): then the residency
    alone decides, rather than the whole answer becoming unknown."""
    if residency is not None:
        short: bool | None = residency < p99_tool_latency_seconds
    elif write_bytes_per_second is not None and write_bytes_per_second <= 0:
        short = False
    else:
        short = None
    failing = None if failures is None else failures > 0
    known = [x for x in (short, failing) if x is not None]
    if not known:
        return None
    return any(known)


def recommended_buffer(write_bytes_per_second: float | None, p99_tool_latency_seconds: float,
                       headroom: float) -> float | None:
    """Bytes: the buffer that keeps residency >= headroom x p99 tool-call latency at this write rate. Feed
    it the highest write rate over the configured windows (size for the busy minute, not the average). None
    (unknown) when nothing is written, or when the product is not a finite number."""
    if write_bytes_per_second is None or write_bytes_per_second <= 0:
        return None
    n_bytes = write_bytes_per_second * p99_tool_latency_seconds * headroom
    return n_bytes if math.isfinite(n_bytes) else None


FLAG_SIGNIFICANT_DIGITS = 2  # the flag's value rounds up to this many digits: at most 1.1x the bytes


def flag_gib(n_bytes: float | None) -> float | None:
    """The --kv-offloading-size value (GiB, which takes fractions: 0.0625 runs) for ``n_bytes``: the GiB
    rounded up to FLAG_SIGNIFICANT_DIGITS significant digits, so never below the bytes and at most 10 % above
    (18 MiB -> 0.018; 27.3 GiB -> 28; whole GiB had made 18 MiB a 1 GiB flag, 57x). None when unknown."""
    if n_bytes is None or not math.isfinite(n_bytes) or n_bytes <= 0:
        return None
    gib = n_bytes / 2 ** 30
    exponent = math.floor(math.log10(gib)) - (FLAG_SIGNIFICANT_DIGITS - 1)
    steps = math.ceil(gib / 10.0 ** exponent * (1 - 1e-12))  # a value already on the grid stays
    digits = FLAG_SIGNIFICANT_DIGITS + 1  # the float of 0.018 without 0.018000000000000002's tail
    value = float(f"{steps * 10.0 ** exponent:.{digits}g}")
    if value * 2 ** 30 < n_bytes * (1 - 1e-9):  # a float rounded under the bytes: the next step up
        value = float(f"{(steps + 1) * 10.0 ** exponent:.{digits}g}")
    return value


def size_words(n_bytes: float) -> str:
    """Bytes in the largest binary unit they fill, 3 significant digits: 18874368 -> '18 MiB'."""
    for unit, power in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n_bytes >= 2 ** power:
            return f"{n_bytes / 2 ** power:.3g} {unit}"
    return f"{n_bytes:.3g} B"


def flag_words(n_bytes: float | None) -> str | None:
    """'0.018 (18 MiB)': the flag's value with the bytes it stands for, None when unknown."""
    gib = flag_gib(n_bytes)
    return None if gib is None else f"{gib:.12g} ({size_words(n_bytes)})"


def chunk_hit_ratio(hits: float | None, queries: float | None) -> float | None:
    """Hits / lookups; unknown when the counters disagree (more hits than lookups: a reset or a skew between the
    two counters' reads), never a ratio above 1."""
    if not queries or hits is None or hits > queries:
        return None
    return hits / queries


def _per_covered_second(agg: WindowAggregate, key: str) -> float | None:
    """A tiering counter's increase / the window's covered seconds: vLLM creates each tier's series at its first
    observation (the store counts that first value, store/history.py), so before it the tier moved nothing; a
    rate over the seconds that carry the series alone would spread a single promotion over one interval."""
    total = agg.delta(key)
    if total is None or agg.covered_seconds <= 0:
        return None
    return total / agg.covered_seconds


def _dropped(agg: WindowAggregate, keys, prefix: str, tier: str) -> float | None:
    """Drops per second over the window. vLLM's back-pressure counters have a HELP line and no sample until
    their first drop (the tiered engine, tests/test_tiered_engine.py): a tier without a sample is 0 where
    another tier's drops show the engine counts them, else unknown (never a zero kvwatt cannot see)."""
    rate = _per_covered_second(agg, labelled_key(prefix, tier))
    if rate is None and any(k.startswith(prefix + "@") for k in keys):
        return 0.0
    return rate


def _failed(agg: WindowAggregate, prefix: str, tier: str, moved: bool) -> float | None:
    """Failed jobs per second over the window. vLLM's job-failure counters (tiering, 0.28+) have a HELP line and
    no sample until their first failure: a tier that moved data without one failed none; unknown otherwise."""
    rate = _per_covered_second(agg, labelled_key(prefix, tier))
    return 0.0 if rate is None and moved and agg.covered_seconds > 0 else rate


def capacity_unknown(tier: str) -> str:
    """Why a tier's size is unknown: vLLM (0.32) exports no tier capacity, and its fs tier has none of its own."""
    where = f'servers[].offload_tier_bytes["{tier}"]'
    if tier.endswith(":primary"):
        return ("the CPU tier's size is kv_connector_extra_config.cpu_bytes_to_use, which vLLM exports nowhere: "
                f"set {where}")
    if tier.endswith(":fs"):
        return (f"vLLM's fs tier has no capacity of its own (it fills its root_dir's filesystem) and exports none: "
                f"set {where} to the space it may use")
    return f"vLLM exports no tier capacity: set {where}"


def _bandwidth(agg: WindowAggregate, direction: str, tier: str) -> tuple[float | None, float | None, str]:
    """(bytes per second of transfer, seconds of transfer per covered second, why unknown) of one direction
    ("read": promotions, "write": cascades). vLLM counts the bytes of the finished jobs (of a partly failed
    promotion, its loaded keys) and their time only where the tier reports one (fs, obj; p2p none)."""
    moved = agg.delta(labelled_key(f"tier_{direction}_bytes", tier))
    seconds = agg.delta(labelled_key(f"tier_{direction}_seconds", tier))
    busy = _per_covered_second(agg, labelled_key(f"tier_{direction}_seconds", tier))
    if seconds is None:
        if not moved:
            return None, busy, f"no {direction}s from the tier in the window"
        return None, busy, f"vLLM reports no {direction} time for the tier (kv_offload_tiering_{direction}_time)"
    if not moved or seconds <= 0:
        return None, busy, f"no timed {direction}s from the tier in the window"
    rate = moved / seconds
    return (rate, busy, "") if math.isfinite(rate) else (None, busy, f"the tier's {direction} time is ~0 s")


def tier_flows(agg: WindowAggregate, capacities: dict[str, float] | None = None,
               p99_tool_latency_seconds: float = rules.P99_TOOL_LATENCY.default,
               critical: tuple[float, float] | None = None) -> tuple[TierFlows, ...]:
    """Every tier that carries a tiering counter in the window, sorted by tier label; ``capacities``: the
    configured bytes of each tier; ``critical``: (s7's kappa_crit over the host link, that link's bytes/s), None
    without the model and hardware parameters."""
    keys = agg.keys()
    tiers = sorted({k.split("@", 1)[1] for k in keys if k.startswith(("tier_write_bytes@", "tier_read_bytes@",
                                                                       "tier_chunk_queries@", "tier_job_failures@",
                                                                       "tier_dropped_blocks@"))})
    out = []
    for tier in tiers:
        queries = agg.delta(labelled_key("tier_chunk_queries", tier))
        hits = agg.delta(labelled_key("tier_chunk_hits", tier))
        if queries and hits is None and any(k.startswith("tier_chunk_hits@") for k in keys):
            hits = 0.0  # vLLM creates a tier's hits series at its first hit: queried, never hit
        failures = agg.delta(labelled_key("tier_job_failures", tier))
        write = _per_covered_second(agg, labelled_key("tier_write_bytes", tier))
        held = residency((capacities or {}).get(tier), write)
        read = _per_covered_second(agg, labelled_key("tier_read_bytes", tier))
        moved = any(v is not None for v in (write, read, queries))
        cap = (capacities or {}).get(tier)
        flows = TierFlows(tier=tier, write_bytes_per_second=write, read_bytes_per_second=read,
                          chunk_hit_ratio=chunk_hit_ratio(hits, queries), job_failures=failures,
                          undersized=undersized(held, write, failures, p99_tool_latency_seconds),
                          residency_seconds=held,
                          dropped_stores_per_second=_dropped(agg, keys, "tier_dropped_stores", tier),
                          dropped_blocks_per_second=_dropped(agg, keys, "tier_dropped_blocks", tier),
                          failed_promotions_per_second=_failed(agg, "tier_promotion_failures", tier, moved),
                          failed_cascades_per_second=_failed(agg, "tier_cascade_failures", tier, moved),
                          capacity_bytes=cap, capacity_reason="" if cap is not None else capacity_unknown(tier),
                          **_transfer_times(agg, tier, critical))
        if any(v is not None for v in (flows.write_bytes_per_second, flows.read_bytes_per_second,
                                       flows.chunk_hit_ratio, flows.job_failures, flows.dropped_blocks_per_second)):
            out.append(flows)  # a tier whose samples all left the window is gone from it
    return tuple(out)


def _transfer_times(agg: WindowAggregate, tier: str, critical: tuple[float, float] | None) -> dict:
    """The tier's read and write bandwidth and busy seconds per second (vLLM's transfer-time counters), the
    critical cached-to-prefill ratio of a reload from it (methods.md s14) and its lookup delay: TierFlows' fields."""
    read, read_busy, read_why = _bandwidth(agg, "read", tier)
    write, write_busy, write_why = _bandwidth(agg, "write", tier)
    if critical is None:
        crit, crit_why = None, "kappa_crit needs the model's config.json and the hardware (methods.md s7)"
    elif read is None:
        crit, crit_why = None, f"no measured read bandwidth: {read_why}"
    else:
        crit, crit_why = kappa.tier_critical(critical[0], critical[1], read), ""
    lookup, lookup_why = _mean(agg, "tier_lookup_seconds", tier, "no chunk lookups resolved by the tier")
    wait, wait_why = _mean(agg, "tier_lookup_wait_seconds", tier, "no lookup waited on the tier")
    return {"read_bandwidth_bytes_per_second": read, "write_bandwidth_bytes_per_second": write,
            "read_seconds_per_second": read_busy, "write_seconds_per_second": write_busy,
            "transfer_time_reason": "; ".join(w for w in (read_why, write_why) if w),
            "critical_cached_to_prefill": crit, "critical_reason": crit_why,
            "lookup_seconds": lookup, "lookup_wait_seconds": wait,
            "lookup_reason": "; ".join(w for w in (lookup_why, wait_why) if w)}


def _mean(agg: WindowAggregate, prefix: str, tier: str, none: str) -> tuple[float | None, str]:
    """A tiering histogram's mean over the window (its _sum / _count increases) and, unknown, why. vLLM creates a
    tier's series at its first observation: without a sample nothing was observed (``none``)."""
    total = agg.delta(labelled_key(prefix + "_sum", tier))
    count = agg.delta(labelled_key(prefix + "_count", tier))
    if total is None or not count:
        return None, f"{none} in the window"
    return (total / count, "") if total >= 0 else (None, f"{prefix} fell in the window")
