"""When a reload from each offload tier beats a recompute, in energy (methods.md s14; s7's kappa per tier, s12's
per-phase costs).

A prompt token served from offload tier t (vLLM 0.32's ``prompt_tokens_cached_by_source{source=t}``: host, disk)
costs the GPU what any reloaded token costs it (c_r, s12: measured, or the configured ratio of c_p) plus the
energy of the hops its KV takes to the GPU, outside the GPU's energy counter:

    host:  b x (e_mem + e_link)                          host DRAM read, then the host-device link
    disk:  b_disk x (e_disk + e_mem) + b x (e_mem + e_link)   the drive's read into host DRAM, then as host
    price_t = c_r + hops_t                               (J per token reloaded from t)
    break-even ratio_t = price_t / c_p                   (< 1: a reload from t beats recomputing the token)
    kappa_t = C_t / P                                    (tokens from t per computed prompt token, s7 per tier)

b = offload load bytes / reloaded tokens (the bytes a reloaded token moves over the link, measured from the
engine's counters), b_disk = the secondary tiers' read bytes / disk tokens (b where not counted); e_* the
configured joules per byte (rules.HOST_MEMORY_/HOST_LINK_/DISK_JOULES_PER_BYTE: no device exposes a transfer's
energy). Per scope, tokens/s from the intervals that carry its energy (the scope's reloaded tokens split by the
window's shares of the cached tokens by tier), priced with the same capped costs as s12's saving:

    gpu-side saving_t = tokens_t/s x (c_p - c_r)         (sums over the tiers to kvwatt_offload_saved_watts)
    reload W_t        = tokens_t/s x hops_t              (what the tier's reloads cost beyond the GPU)
    saved W_t         = gpu-side saving_t - reload W_t   (the tier's net saving; < 0: dearer than recomputing)
    dE of the second tier = saved W_disk / (marginal W + gpu-side saving_disk)

the last one the saving attributable to disk reloads against the energy without the disk tier (those tokens
recomputed: the GPU's marginal power plus their computation less their reload, s2's estimated form).
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.derive.marginal import above_idle
from exporter.derive.phase_energy import PhaseCosts, within_energy
from exporter.derive.recompute import CACHE_TIERS, token_counts
from exporter.results import TierEnergy
from exporter.store import WindowAggregate

SECONDARY_READ_PREFIX = "tier_read_bytes@"  # vLLM tiering: bytes read from a secondary tier into the CPU tier
# vLLM tiering's CPU tier (TieringOffloadingSpec: kv_connector_extra_config.cpu_bytes_to_use)
PRIMARY_TIER = "0:primary"


@dataclass(frozen=True, kw_only=True)
class HopEnergy:
    """Joules per byte of each hop (configured)."""

    host_memory: float
    host_link: float
    disk: float


def bytes_per_reloaded_token(agg: WindowAggregate) -> float | None:
    """Offload load bytes / reloaded prompt tokens over the window: the KV a reloaded token moves over the link.
    None without the load counter or reloaded tokens."""
    loaded, tokens = agg.delta("offload_load_bytes"), agg.delta("prompt_external_kv_transfer")
    if loaded is None or not tokens or loaded <= 0:
        return None
    return loaded / tokens


def bytes_per_disk_token(agg: WindowAggregate) -> float | None:
    """The secondary tiers' read bytes (promotions into the CPU tier) / tokens served from disk; None when
    either is not counted."""
    reads = [agg.delta(k) for k in agg.keys() if k.startswith(SECONDARY_READ_PREFIX)
             and not k.endswith("@" + PRIMARY_TIER)]
    known = [r for r in reads if r is not None]
    tokens = agg.delta("prompt_cached_disk")
    if not known or not tokens or sum(known) <= 0:
        return None
    return sum(known) / tokens


def hop_joules_per_token(tier: str, link_bytes: float | None, disk_bytes: float | None,
                         hops: HopEnergy) -> tuple[float | None, float | None]:
    """(bytes moved, J) per token reloaded from ``tier`` over its hops; (None, None) for a tier without hop
    prices (p2p, external) or without the bytes."""
    if tier not in ("host", "disk") or link_bytes is None:
        return None, None
    moved, joules = link_bytes, link_bytes * (hops.host_memory + hops.host_link)
    if tier == "disk":
        drive = disk_bytes if disk_bytes is not None else link_bytes  # a block is a block on every hop
        moved, joules = moved + drive, joules + drive * (hops.disk + hops.host_memory)
    return moved, joules


def tier_energy(agg: WindowAggregate, costs: PhaseCosts | None, hops: HopEnergy,
                load_to_compute_cost_ratio: float) -> tuple[TierEnergy, ...]:
    """Every tier that served cached prompt tokens over the window (methods.md s14). Its kappa, bytes per token,
    hop J per token and reload W rest on the counters and the configured J/byte alone; the price against a
    recompute (and the savings) on ``costs.scope``'s energy: without its energy and P_idle or a price (``costs``
    None, no energy above idle) they are unknown, ``scope`` "" and ``price_reason`` says why. Empty without
    cached tokens by tier (vLLM < 0.32) or reloaded ones."""
    window = token_counts(agg)
    cached = {t: agg.delta(f"prompt_cached_{t}") or 0.0 for t in CACHE_TIERS if t != "device"}
    served = sum(cached.values())
    if not window or served <= 0 or agg.covered_seconds <= 0:
        return ()
    priced, why = _priced(agg, costs)
    link, drive = bytes_per_reloaded_token(agg), bytes_per_disk_token(agg)
    out = []
    for tier, n in cached.items():
        if n <= 0:
            continue
        moved, hop = hop_joules_per_token(tier, link, drive, hops)
        kappa = n / window["local_compute"] if window["local_compute"] > 0 else None
        if priced is None:
            rate = n / agg.covered_seconds
            out.append(TierEnergy(tier=tier, scope="", tokens_per_second=rate, cached_to_prefill=kappa,
                                  bytes_per_token=moved, hop_joules_per_token=hop, reload_joules_per_token=None,
                                  breakeven_ratio=None, gpu_saved_watts=None,
                                  reload_watts=None if hop is None else rate * hop, saved_watts=None,
                                  price_reason=why))
            continue
        scope_costs, used, reloaded = priced
        j_c = scope_costs.prompt_computed_j
        j_r = scope_costs.reloaded_j if scope_costs.reloaded_j is not None else load_to_compute_cost_ratio * j_c
        rate = reloaded * (n / served) / used.covered_seconds
        gpu_saved = rate * (j_c - j_r)
        price = None if hop is None else j_r + hop
        out.append(TierEnergy(
            tier=tier, scope=scope_costs.scope, tokens_per_second=rate, cached_to_prefill=kappa,
            bytes_per_token=moved, hop_joules_per_token=hop, reload_joules_per_token=price,
            breakeven_ratio=None if price is None or j_c <= 0 else price / j_c, gpu_saved_watts=gpu_saved,
            reload_watts=None if hop is None else rate * hop,
            saved_watts=None if hop is None else gpu_saved - rate * hop,
            price_reason="" if hop is not None else f"no hop prices for the {tier} tier"))
    return tuple(out)


def _priced(agg: WindowAggregate, costs: PhaseCosts | None):
    """((the costs capped at the scope's energy, the scope's sums, its reloaded tokens), "") or (None, why)."""
    if costs is None:
        return None, "no per-phase costs for the gpu scope (no GPU energy with P_idle)"
    used = agg.scope(costs.scope)
    if used is None or used.idle_joules is None or used.covered_seconds <= 0:
        return None, f"no {costs.scope} energy with P_idle in the window"
    counts = token_counts(used)
    if not counts or counts["external_kv_transfer"] <= 0:
        return None, f"no reloaded prompt tokens in the intervals with {costs.scope} energy"
    capped = within_energy(costs, above_idle(used.energy_joules, used.idle_joules), counts["local_compute"],
                           counts["external_kv_transfer"])
    if capped is None:
        return None, (f"the window's {costs.scope} marginal energy is not positive (a stale P_idle?), or no price for "
                      "a computed prompt token")
    return (capped, used, counts["external_kv_transfer"]), ""


def second_tier_saving(tiers: tuple[TierEnergy, ...], agg: WindowAggregate, scope: str) -> float | None:
    """dE of adding the disk tier (methods.md s14): its net saving / the energy without it (the scope's marginal
    power plus the disk tokens' computation less their reload on the GPU). None without a priced disk tier or a
    positive marginal power."""
    disk = next((t for t in tiers if t.tier == "disk" and t.scope == scope), None)
    used = agg.scope(scope)
    if disk is None or disk.saved_watts is None or disk.gpu_saved_watts is None or used is None \
            or used.idle_joules is None or used.covered_seconds <= 0:
        return None
    power = above_idle(used.energy_joules, used.idle_joules) / used.covered_seconds
    without = power + disk.gpu_saved_watts
    return disk.saved_watts / without if power > 0 and without > 0 else None
