"""Tiered conditions (docs/experiment.md "Tiered conditions"; issue 41): what each tier of an offloading engine
moved in a run's measurement window, and the report's per-tier tables built from the finished runs.

Per run (``run_tiers``, stored in result.json's ``window.tiers``): the engine's own counters over the window,
through kvwatt's derivations (exporter.derive.offload.tier_flows, recompute.token_counts):
- the GPU <-> CPU link: bytes stored (GPU -> CPU tier) and loaded (CPU tier -> GPU), vllm:kv_offload_*_bytes;
- each tier of vLLM's tiering manager ("0:primary", "1:fs"): bytes written (cascades into a secondary tier) and
  read (promotions out of it), chunk lookups and hits, the back-pressure detector's dropped stores and blocks,
  failed jobs;
- the cached prompt tokens by source (device / host / disk, vllm:prompt_tokens_cached_by_source) and the computed
  and reloaded ones (vllm:prompt_tokens_by_source);
and, for every run (``phase_windows``, stored as ``window.phase_windows``), the window cut into
``PHASE_WINDOW_SECONDS`` slices of (marginal J, computed, generated, reloaded tokens) per energy scope, from which
the report fits the J per computed prompt token (exporter.derive.phase_energy, methods.md s12) over every run of
the experiment, OFF runs included.

Per report (``tier_analysis``): the break-even per tier (methods.md s7 in energy): the price of a token reloaded
from tier t is the bytes it moved on each hop times that hop's J per byte,

    price_host = b_link * e_link                       (CPU tier -> GPU)
    price_disk = b_disk * e_disk + b_link * e_link     (disk -> CPU tier, promoted, then CPU tier -> GPU)

with b_link = bytes loaded / reloaded tokens and b_disk = bytes read from disk / tokens served from disk, measured
over the ON runs, and e the power double's configured J per byte (the only energy per byte this machine has); a
reload from tier t pays when price_t < c_p, the fitted J per computed prompt token, i.e. when the break-even ratio
price_t / c_p < 1. The "all-in" price also charges the stores it took: every byte written into the tier (most never
read back) over the tokens the tier served. kappa_t = tokens served from tier t / computed prompt tokens (methods.md
s7's cached-to-prefill ratio per tier).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

from exporter import rules
from exporter.derive import offload
from exporter.derive.phase_energy import PhaseWindow, estimate
from exporter.derive.recompute import CACHE_TIERS, token_counts
from exporter.rules.keys import labelled
from exporter.samples import Interval
from exporter.store import WindowAggregate, aggregate_of
from kvwatt_lab.experiment import stats

GIB = 2 ** 30
PHASE_WINDOW_SECONDS = 5.0   # a slice of the window: one observation of the per-phase fit
MIN_PHASE_WINDOWS = 6        # the fit over the experiment's slices (the daemon's rule wants 20 over hours)
TIER_COUNTERS = ("tier_write_bytes", "tier_read_bytes", "tier_chunk_queries", "tier_chunk_hits",
                 "tier_dropped_stores", "tier_dropped_blocks", "tier_job_failures")
LINK = "link"                # the GPU <-> CPU tier hop (vllm:kv_offload_store_bytes / _load_bytes)


# ------------------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------------------
def run_tiers(intervals: Sequence[Interval]) -> dict | None:
    """The window's per-tier counters (module docstring), or None when the engine does not offload."""
    agg = aggregate_of(intervals)
    link = {"store_bytes": agg.delta("offload_store_bytes"), "load_bytes": agg.delta("offload_load_bytes")}
    tiers: dict[str, dict[str, float]] = {}
    for prefix in TIER_COUNTERS:
        for tier, value in labelled(_deltas(agg), prefix).items():
            tiers.setdefault(tier, {})[prefix.removeprefix("tier_")] = value
    if all(v is None for v in link.values()) and not tiers:
        return None
    flows = {f.tier: asdict(f) for f in offload.tier_flows(agg)}
    cached = {t: agg.delta(f"prompt_cached_{t}") for t in CACHE_TIERS}
    return {"covered_seconds": agg.covered_seconds, "link": link, "tiers": tiers, "flows": flows,
            "cached_tokens": {t: v for t, v in cached.items() if v is not None},
            "prompt_tokens": token_counts(agg)}


def _deltas(agg: WindowAggregate) -> dict[str, float]:
    return {k: v for k in agg.keys() if (v := agg.delta(k)) is not None}


def phase_windows(intervals: Sequence[Interval], scope: str) -> list[list[float]]:
    """[marginal J, computed, generated, reloaded] per consecutive slice of PHASE_WINDOW_SECONDS, for slices whose
    every interval has the scope's energy and idle energy and whose prompt tokens by source are known."""
    out, chunk = [], []
    for iv in intervals:
        chunk.append(iv)
        if chunk[-1].t1 - chunk[0].t0 < PHASE_WINDOW_SECONDS:
            continue
        if all(scope in c.energy_joules and scope in c.idle_joules for c in chunk):
            agg = aggregate_of(chunk)
            counts = token_counts(agg)
            if counts is not None:
                joules = sum(c.energy_joules[scope] - c.idle_joules[scope] for c in chunk)
                out.append([joules, counts["local_compute"], agg.delta("generation_tokens") or 0.0,
                            counts["external_kv_transfer"]])
        chunk = []
    return out


# ------------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------------
def _tiers(run: dict) -> dict | None:
    return (run.get("window") or {}).get("tiers")


def _sum(runs: list[dict], get) -> float | None:
    values = [v for v in (get(r) for r in runs) if v is not None]
    return sum(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def condition_tiers(runs: list[dict]) -> dict:
    """A condition's per-tier totals over its runs' windows (sums: ratios of sums, not means of ratios)."""
    tiered = [t for t in (_tiers(r) for r in runs) if t]
    names = sorted({name for t in tiered for name in t["tiers"]})
    out: dict[str, Any] = {"runs": len(tiered), "seconds": _sum(tiered, lambda t: t["covered_seconds"])}
    out[LINK] = {k: _sum(tiered, lambda t, k=k: t["link"].get(k)) for k in ("store_bytes", "load_bytes")}
    out["tiers"] = {}
    reloaded = _sum(runs, lambda r: ((r.get("window") or {}).get("prompt_tokens_by_source") or {}).get(
        "external_kv_transfer"))
    block_bytes = _block_bytes(runs, out[LINK], reloaded)
    for name in names:
        totals = {k.removeprefix("tier_"): _sum(tiered, lambda t, k=k: t["tiers"].get(name, {}).get(
            k.removeprefix("tier_"))) for k in TIER_COUNTERS}
        if totals["chunk_queries"] and totals["chunk_hits"] is None:
            totals["chunk_hits"] = 0.0   # vLLM creates a tier's hits series at its first hit
        totals["hit_ratio"] = offload.chunk_hit_ratio(totals["chunk_hits"], totals["chunk_queries"])
        # the blocks the back-pressure detector kept from the tier, of those bound for it (written + dropped)
        written_blocks = (None if totals["write_bytes"] is None or not block_bytes
                          else totals["write_bytes"] / block_bytes)
        bound = (written_blocks or 0.0) + (totals["dropped_blocks"] or 0.0)
        totals["dropped_block_share"] = _ratio(totals["dropped_blocks"], bound) if bound else None
        out["tiers"][name] = totals
    windows = [r.get("window") or {} for r in runs]
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        out[source] = _sum(windows, lambda w, s=source: (w.get("prompt_tokens_by_source") or {}).get(s))
    out["cached_tokens"] = {t: _sum(windows, lambda w, t=t: _cached(w).get(t)) for t in CACHE_TIERS}
    out["cached_tokens"] = {t: v for t, v in out["cached_tokens"].items() if v is not None}
    return out


def _cached(window: dict) -> dict:
    """The window's cached prompt tokens by source; an engine without offloading serves every cached token from
    the device (its local_cache_hit)."""
    if window.get("tiers"):
        return window["tiers"]["cached_tokens"]
    hits = (window.get("prompt_tokens_by_source") or {}).get("local_cache_hit")
    return {} if hits is None else {"device": hits}


def _block_bytes(runs: list[dict], link: dict, reloaded: float | None) -> float | None:
    """Bytes of one KV block (every tensor's page of it): the engine's block size (vllm:cache_config_info) x the
    KV bytes per token the link moved (bytes loaded / tokens reloaded)."""
    block_size = next((s["block_size"] for r in runs if (s := r.get("server") or {}).get("block_size")), None)
    per_token = _ratio(link.get("load_bytes"), reloaded)
    return None if block_size is None or per_token is None else block_size * per_token


def companion(conditions: list[dict], name: str) -> str | None:
    """For a tiered condition with a disk tier: the tiered condition without one that has the same CPU tier and
    baseline (the dE of adding the disk tier is against it), else None."""
    by = {c["name"]: c for c in conditions}
    c = by[name]
    t = c.get("tiered")
    if not t or not t.get("disk_dir"):
        return None
    for other in conditions:
        o = other.get("tiered")
        if o and not o.get("disk_dir") and o.get("cpu_mib") == t.get("cpu_mib") \
                and other.get("baseline") == c.get("baseline"):
            return other["name"]
    return None


def fitted_costs(finished: dict[str, dict], scope: str = "host"):
    """The per-phase costs (exporter.derive.phase_energy.estimate) over every run's phase windows pooled."""
    windows = [PhaseWindow(*w) for r in finished.values()
               for w in ((r.get("window") or {}).get("phase_windows") or {}).get(scope, [])]
    return estimate(windows, scope, MIN_PHASE_WINDOWS, rules.PHASE_MAX_CONDITION.default,
                    rules.LOAD_TO_COMPUTE_COST_RATIO.default)


def hop_costs(plan: dict) -> dict[str, float] | None:
    """J per byte of each hop: the power double's configured costs (None without a double: no machine here exposes
    an energy per byte, and a real node's would have to be configured the same way)."""
    double = (plan.get("energy") or {}).get("power_double")
    if not double:
        return None
    return {LINK: double.get("joules_per_gib_transferred", 0.0) / GIB,
            "disk": double.get("joules_per_gib_disk", 0.0) / GIB}


def break_even(totals: dict, hops: dict[str, float] | None, prompt_j: float | None) -> list[dict]:
    """One row per tier that served tokens in the condition: bytes per token per hop, the price of a token reloaded
    from it (read only, and all-in with the stores it took), kappa_t, and price / c_p."""
    reloaded = totals.get("external_kv_transfer")
    computed = totals.get("local_compute")
    cached = totals.get("cached_tokens") or {}
    link = totals[LINK]
    b_link = _ratio(link.get("load_bytes"), reloaded)
    e_link, e_disk = (hops or {}).get(LINK), (hops or {}).get("disk")
    link_price = None if b_link is None or e_link is None else b_link * e_link
    link_all_in = _ratio(None if e_link is None or link.get("load_bytes") is None else
                         ((link.get("store_bytes") or 0.0) + link["load_bytes"]) * e_link, reloaded)
    rows = []
    if cached.get("host"):
        rows.append(_row("host (CPU tier)", cached["host"], computed, {"link": b_link}, link_price, link_all_in,
                         prompt_j))
    disk = next((t for name, t in totals["tiers"].items() if name.endswith(":fs")), None)
    if disk is not None and cached.get("disk"):
        b_disk = _ratio(disk.get("read_bytes"), cached["disk"])
        read = None if b_disk is None or e_disk is None or link_price is None else b_disk * e_disk + link_price
        stored = None if e_disk is None or link_price is None else _ratio(
            ((disk.get("write_bytes") or 0.0) + (disk.get("read_bytes") or 0.0)) * e_disk, cached["disk"])
        rows.append(_row("disk (1:fs)", cached["disk"], computed, {"link": b_link, "disk": b_disk}, read,
                         None if stored is None or link_all_in is None else stored + link_all_in, prompt_j))
    return rows


def _row(tier: str, tokens: float, computed: float | None, bytes_per_token: dict, price: float | None,
         all_in: float | None, prompt_j: float | None) -> dict:
    return {"tier": tier, "tokens": tokens, "kappa": _ratio(tokens, computed), "bytes_per_token": bytes_per_token,
            "price_j": price, "all_in_price_j": all_in, "prompt_computed_j": prompt_j,
            "ratio": _ratio(price, prompt_j), "all_in_ratio": _ratio(all_in, prompt_j),
            "pays": None if price is None or prompt_j is None else price < prompt_j}


def tier_analysis(plan: dict, finished: dict[str, dict], summaries: list[dict]) -> dict | None:
    """The report's tier section, or None when no condition is tiered."""
    conditions = plan["conditions"]
    tiered = [c for c in conditions if c.get("tiered")]
    if not tiered:
        return None
    scope = next((s.get("energy_scope") for s in summaries if s.get("energy_scope")), None) or "host"
    costs = fitted_costs(finished, scope)
    hops = hop_costs(plan)
    out = {"conditions": {}, "costs": asdict(costs), "hops_j_per_byte": hops, "scope": scope}
    basis = plan["energy"]["basis"]
    for c in conditions:
        runs = stats.runs_of(finished, c["name"])
        totals = condition_tiers(runs)
        entry = {"totals": totals, "tiered": c.get("tiered"), "baseline": c.get("baseline"),
                 "ttft_p50_seconds": stats.mean_se(runs, lambda r: (r.get("replay") or {}).get("ttft_p50_seconds")),
                 "ttft_p95_seconds": stats.mean_se(runs, lambda r: (r.get("replay") or {}).get("ttft_p95_seconds")),
                 "break_even": break_even(totals, hops, costs.prompt_computed_j) if c.get("tiered") else []}
        other = companion(conditions, c["name"])
        if other:
            entry["versus"] = other
            entry["versus_comparison"] = stats.compare(runs, stats.runs_of(finished, other), scope, basis)
        out["conditions"][c["name"]] = entry
    return out
