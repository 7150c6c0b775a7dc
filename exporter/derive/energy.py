"""Energy per token over a window (methods.md s1) and the prompt-token attribution model.

    marginal J/token = (E - P_idle * dt) / N_output        total J/token = E / N_output

Gap-free (energy-measurement.md rule 10): E, P_idle*dt, N and dt are summed over exactly the intervals that
carry an energy sample for the scope, so a missing sample never pairs one span's energy with another span's
tokens. No figure (None, exported as absent) when those intervals hold < ``min_load_seconds`` of load or no
generated tokens (rule 9: the counters are noise over short windows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from exporter.derive import phase_energy
from exporter.derive.marginal import above_idle
from exporter.derive.phase_energy import PhaseCosts
from exporter.derive.recompute import recompute_tax, token_counts, token_shares
from exporter.store import WindowAggregate

TOKENS_KEY = "generation_tokens"


@dataclass(frozen=True)
class EnergyPerToken:
    scope: str
    energy_joules: float
    idle_joules: float | None  # None when some interval lacked P_idle (no baseline for a device)
    tokens: float
    seconds: float
    loaded_seconds: float

    @property
    def joules_per_token(self) -> float:
        return self.energy_joules / self.tokens

    @property
    def marginal_joules_per_token(self) -> float | None:
        """May be negative when P_idle is stale (above today's idle power): reported, not clamped."""
        if self.idle_joules is None:
            return None
        return above_idle(self.energy_joules, self.idle_joules) / self.tokens


def window_energy(x: WindowAggregate, scope: str) -> EnergyPerToken | None:
    """The window's energy per generated token for ``scope`` (methods.md s1), summed over its intervals with an
    energy sample for the scope (None when there is none): total J/token = E / N (``joules_per_token`` above),
    marginal J/token = (E - P_idle x dt) / N (``marginal_joules_per_token``, the idle joules summed the same
    way). ``qualified`` then keeps it only on enough load and at least one token."""
    used = x.scope(scope)
    if used is None:
        return None
    return EnergyPerToken(
        scope=scope,
        energy_joules=used.energy_joules,
        idle_joules=used.idle_joules,
        tokens=used.delta(TOKENS_KEY) or 0.0,
        seconds=used.covered_seconds,
        loaded_seconds=used.loaded_seconds,
    )


def qualified(w: EnergyPerToken | None, min_load_seconds: float) -> EnergyPerToken | None:
    """``w`` when it rests on enough load and tokens to give a figure, else None. Fewer than one generated
    token is no basis for a per-token figure (a counter grows by whole tokens; a fraction near zero, which
    only a broken exposition can give, would make J/token infinite)."""
    if w is None or w.tokens < 1 or w.loaded_seconds < min_load_seconds:
        return None
    return w


def per_token(x: WindowAggregate, scope: str,
              min_load_seconds: float) -> EnergyPerToken | None:
    """The window's figure for ``scope`` ("gpu" | "host"), or None without enough load or tokens."""
    return qualified(window_energy(x, scope), min_load_seconds)


def prompt_attribution(agg: WindowAggregate, min_load_seconds: float,
                       load_to_compute_cost_ratio: float) -> dict[str, float] | None:
    """ATTRIBUTION MODEL, not a measurement: marginal GPU joules per prompt token by token source.

    The window's marginal GPU energy E - P_idle*dt is shared over work units where a generated token and a
    freshly computed prompt token (local_compute) each count 1 (one forward pass of the model's weights,
    ~2*N_active FLOPs), a token reloaded from the offload tier (external_kv_transfer) counts
    ``load_to_compute_cost_ratio`` (configured, default 0.1), and a local prefix-cache hit counts 0.
    Returns {"local_compute": u, "external_kv_transfer": r*u} with u = marginal / units, or None without
    a marginal figure or without prompt tokens by source. Energy, tokens and prompt tokens all come from
    the intervals with a GPU energy sample (the window's "gpu" scope).
    """
    w = per_token(agg, "gpu", min_load_seconds)
    if w is None or w.marginal_joules_per_token is None:
        return None
    counts = token_counts(agg.scope("gpu"))
    if not counts:
        return None
    units = w.tokens + counts["local_compute"] + load_to_compute_cost_ratio * counts["external_kv_transfer"]
    if units <= 0:
        return None
    unit = above_idle(w.energy_joules, w.idle_joules) / units
    return {"local_compute": unit, "external_kv_transfer": load_to_compute_cost_ratio * unit}


def priced_scope(agg: WindowAggregate, scope: str):
    """(the scope's sums, their prompt tokens by source) over the intervals carrying ``scope``'s energy and P_idle
    (rule 10): what the tax, the saving, the post-preemption price and dE's estimated and potential kinds all
    price. None without such intervals or without prompt tokens by source."""
    used = agg.scope(scope)
    if used is None or used.idle_joules is None or used.covered_seconds <= 0:
        return None
    counts = token_counts(used)
    return (used, counts) if counts else None


def priced_with_recomputation(agg: WindowAggregate, costs: PhaseCosts,
                              recomputed_tokens_per_second: float | None) -> PhaseCosts | None:
    """The scope's costs as the window may price its post-preemption recomputation (methods.md s4, s12): the
    recomputed tokens are computed prompt tokens beside the counted ones, so the price is capped at what the
    window's own energy allows for all of them (phase_energy.within_energy, as the tax): its power is then a
    part of the scope's marginal power. None without the scope's energy and P_idle or a positive marginal energy."""
    scoped = priced_scope(agg, costs.scope)
    if scoped is None:
        return None
    used, counts = scoped
    again = (recomputed_tokens_per_second or 0.0) * used.covered_seconds
    return phase_energy.within_energy(costs, above_idle(used.energy_joules, used.idle_joules),
                                      counts["local_compute"] + again,
                                      counts["external_kv_transfer"])


def tax_in_energy(agg: WindowAggregate, reference_share: float | None, costs: Sequence[PhaseCosts],
                  offload_enabled: bool | None, load_to_compute_cost_ratio: float) -> dict[str, dict | None]:
    """The recomputation tax and the offloading saving of the window in W per scope (methods.md s12), priced
    with the server's per-phase costs, and the tax's share of the scope's marginal power over the window. Each
    dict is None when no scope gives a figure; the saving only on a server that offloads.

    Per scope, tokens, seconds and energy all come from the intervals with the scope's energy and P_idle (rule
    10, as ``window_energy``): a burst the energy source missed is in none of them. The tax share is that of
    those intervals (their local_compute share minus ``reference_share``, methods.md s4), and the costs are
    capped at what the window's own energy allows (phase_energy.within_energy), so the tax is a part of the
    scope's marginal power and the saving no larger than it."""
    tax, saved, share = {}, {}, {}
    for c in costs:
        scoped = priced_scope(agg, c.scope)
        if scoped is None:
            continue
        used, counts = scoped
        seconds, marginal = used.covered_seconds, above_idle(used.energy_joules, used.idle_joules)
        priced = phase_energy.within_energy(c, marginal, counts["local_compute"], counts["external_kv_transfer"])
        if priced is None:
            continue
        shares = token_shares(counts)
        tax_share = recompute_tax(shares["local_compute"] if shares else None, reference_share)
        w = phase_energy.recompute_tax_watts(tax_share, sum(counts.values()) / seconds, priced)
        if w is not None:
            tax[c.scope] = w
            share[c.scope] = w / (marginal / seconds)
        if offload_enabled:
            s = phase_energy.offload_saved_watts(counts["external_kv_transfer"] / seconds, priced,
                                                 load_to_compute_cost_ratio)
            if s is not None:
                saved[c.scope] = s
    return {"recompute_tax_watts": tax or None, "offload_saved_watts": saved or None,
            "recompute_energy_share": share or None}
