"""What physics and arithmetic allow each figure (declared with its family in exporter.catalog, ``bounds=``), and
the one check that holds the typed figures to it before anything is served (docs/methods.md "Bounds declared with
every figure").

A share lies in [0, 1]; dE <= 1 (a saving of more than all the energy is impossible); a power part of a scope's
marginal power (the recomputation tax) is no larger than that power; J/token >= 0; generated tokens/s no larger
than an engine can produce; money and CO2 per day finite and equal to the watts they price at the price in force.

``BoundsCheck.apply(snapshot)`` runs once per tick in exporter.runtime.daemon.Daemon.step, on the model's snapshot and
before it is published (so before /metrics, /api/status and the page read it): every sample of every family is
checked against its family's bound; a figure outside it is replaced by None in the typed figures (unknown: absent
from /metrics, null in the JSON, "unknown" on the page), and so are the figures computed from the same counts
(``DEPENDENCIES``, reason "dependent"); a derived figure that breaks a declared relation with another
(``RELATIONS``: shares that do not sum to 1, a GPU above its power limit, a dE that disagrees with the tax it
prices, ...) becomes unknown with an "inconsistent: ..." reason, the measured one staying. Each reason
("implausible: ...", naming the figure's inputs, or "inconsistent: ...") goes into ``Snapshot.implausible``
(/api/status, the page), is counted in ``kvwatt_figures_rejected_total{figure, reason}`` (reason: the bound's
kind, ``dependent`` or ``relation``) and logged once when it starts and once when it ends, never per tick.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from exporter import rules

log = logging.getLogger("kvwatt.bounds")

# A ceiling on the generated tokens/s of one engine (a data-parallel rank) or one GPU, far above any: the fastest
# decode published for a whole 8-GPU node is of the order of 1e5 tokens/s (vLLM/SGLang H100 and B200 benchmarks); a
# rate 10x that per engine can only come from a counter counted whole (a false restart, store/identity.py) or a
# counter that jumped. A server's ceiling is this times what it can be (token_rate_ceiling): its data-parallel
# engines or the GPUs attributed to it, whichever are more, at least one.
MAX_GENERATION_TOKENS_PER_SECOND = 1.0e6
# A value computed at a bound may land a few ulps outside it (a share of exactly 1 computed as 1.0000000000000002):
# within this many units in the last place of the bound it is rounding, served clamped onto the bound
ROUNDING_ULPS = 4
_KWH_JOULES = 3.6e6
_DAY_HOURS = 24.0
_REL_TOL = 1e-6  # priced figures: equal to watts x price up to rounding


class Where:
    """A sample being checked: its family's labels by name, and the snapshot it belongs to (for the bounds that
    compare a figure with another one: a power part with the power, money with the watts it prices)."""

    __slots__ = ("figure", "snap", "_labels", "_names", "_values")

    def __init__(self, figure: str, labels: dict[str, str], snap: object) -> None:
        self.figure = figure
        self._labels = labels
        self.snap = snap  # exporter.figures.Snapshot (not imported: the catalog imports this module)

    @classmethod
    def of(cls, figure: str, names: tuple[str, ...], values: tuple, snap: object) -> "Where":
        """A sample's Where whose labels dict is built only if its bound reads it (most test the value alone:
        every sample of every family is checked each tick)."""
        where = cls(figure, None, snap)  # type: ignore[arg-type]
        where._names, where._values = names, values
        return where

    @property
    def labels(self) -> dict[str, str]:
        if self._labels is None:
            self._labels = dict(zip(self._names, map(str, self._values)))
        return self._labels

    def server(self):
        """The ServerFigures of the sample's server, or None."""
        return next((s for s in self.snap.servers if s.name == self.labels.get("server")), None)

    def window(self):
        """The WindowFigures of the sample's server and window, or None."""
        s = self.server()
        return None if s is None else next((w for w in s.windows if w.window == self.labels.get("window")), None)

    def marginal_watts(self) -> tuple[float | None, str]:
        """The scope's marginal power (E - P_idle*dt)/dt over the window, and its inputs in words."""
        w = self.window()
        e = next((e for e in (w.energy if w else ()) if e.scope == self.labels.get("scope")), None)
        if e is None or e.basis.idle_joules is None or e.basis.seconds <= 0:
            return None, f"no {self.labels.get('scope')} energy with P_idle in the window"
        b = e.basis
        watts = (b.energy_joules - b.idle_joules) / b.seconds
        return watts, (f"{self.labels.get('scope')} marginal power {watts:.4g} W = (E {b.energy_joules:.4g} J - "
                       f"P_idle*dt {b.idle_joules:.4g} J) / {b.seconds:.4g} s")

    def price(self, quantity: str) -> float | None:
        p = self.snap.price(quantity)
        return p.value if p is not None else None


Test = Callable[[float, Where], "str | None"]


@dataclass(frozen=True)
class Bound:
    """One kind of bound: ``kind`` is the label value of kvwatt_figures_rejected_total{reason}, ``allows`` says
    it in words (README, docs), ``test`` returns why a finite value breaks it (None: within)."""

    kind: str
    allows: str
    test: Test
    infinite: bool = False  # +Inf is a documented value (kappa observed with no computed prompt token)

    # a range's ends: a value within ROUNDING_ULPS of one is served clamped onto it (``clamped``)
    limits: tuple[float, float] | None = None
    # a float certainly within the bound, by its value alone (no Where, nothing to clamp): the tick checks
    # every sample of every family, and most are such (issue 39: ~20 % of a 64-server tick was this check);
    # False says nothing: ``violation`` decides (tests/test_bounds.py holds within => no violation, no clamp)
    within: Callable[[float], bool] | None = None

    def violation(self, value: float, where: Where) -> str | None:
        if isinstance(value, bool):
            value = float(value)
        if math.isnan(value) or (math.isinf(value) and not (self.infinite and value > 0)):
            return f"{value} is not a number kvwatt can serve"
        return self.test(value, where)

    def clamped(self, value: float) -> float | None:
        """The bound's end where ``value`` lies outside the range by rounding only (None: nothing to clamp)."""
        if self.limits is None or isinstance(value, bool) or not math.isfinite(value):
            return None
        lo, hi = self.limits
        return lo if value < lo else hi if value > hi else None


def rounding_slack(bound: float) -> float:
    """How far outside ``bound`` a computed value may land by rounding alone: a few ulps of the bound (of 1 at 0:
    a share computed as 1 - (a + b + c) lands at -1e-16, not at -1e-300)."""
    return ROUNDING_ULPS * math.ulp(max(abs(bound), 1.0))


def _range(lo: float, hi: float) -> Test:
    def test(v: float, _w: Where) -> str | None:
        if lo - rounding_slack(lo) <= v <= hi + rounding_slack(hi):
            return None
        return f"{v!r} outside [{lo:g}, {hi:g}]"
    return test


def _non_negative(v: float, _w: Where) -> str | None:
    return None if v >= 0 else f"{v:.6g} < 0"


def _at_most_one(v: float, _w: Where) -> str | None:
    return None if v <= 1.0 else f"dE {v:.6g} > 1: a saving of more than all the energy"


def _gain(v: float, _w: Where) -> str | None:
    return None if v >= -1.0 else f"dTPS {v:.6g} < -1: fewer than no tokens"


def _one_of(*allowed: float) -> Test:
    def test(v: float, _w: Where) -> str | None:
        return None if v in allowed else f"{v:.6g} not one of {', '.join(f'{a:g}' for a in allowed)}"
    return test


def _power_part(v: float, where: Where) -> str | None:
    """The recomputation tax's W is a part of the scope's marginal power over the window: 0 <= v <= it."""
    if v < 0:
        return f"{v:.6g} W < 0"
    if v == 0:
        return None
    marginal, inputs = where.marginal_watts()
    if marginal is None or v > marginal * (1 + _REL_TOL):
        return f"{v:.4g} W > the {inputs}"
    return None


def _saved_power(v: float, where: Where) -> str | None:
    """What offloading saved, priced with per-phase costs no higher than the window's energy allows (methods.md
    s12): no more (in either sign) than the scope's marginal power."""
    if v == 0:
        return None
    marginal, inputs = where.marginal_watts()
    if marginal is None or abs(v) > max(marginal, 0.0) * (1 + _REL_TOL):
        return f"|{v:.4g}| W > the {inputs}"
    return None


def _gpu_saved_power(v: float, where: Where) -> str | None:
    """A tier's net saving (methods.md s14): its GPU-side part is within the GPU's marginal power (s12's capped
    costs), its reload energy only lowers it, so it is at most that power; below 0 is a tier dearer than a
    recompute."""
    if v <= 0:
        return None
    w = where.window()
    e = next((e for e in (w.energy if w else ()) if e.scope == "gpu"), None)
    if e is None or e.basis.idle_joules is None or e.basis.seconds <= 0:
        return f"{v:.4g} W with no gpu energy with P_idle in the window"
    marginal = (e.basis.energy_joules - e.basis.idle_joules) / e.basis.seconds
    return None if v <= max(marginal, 0.0) * (1 + _REL_TOL) else f"{v:.4g} W > the gpu marginal power {marginal:.4g} W"


def token_rate_ceiling(engines: int, gpus: int) -> float:
    """The most tokens/s a server with ``engines`` data-parallel engines and ``gpus`` GPUs attributed can be:
    MAX_GENERATION_TOKENS_PER_SECOND per engine or GPU, whichever are more (at least one)."""
    return MAX_GENERATION_TOKENS_PER_SECOND * max(1, engines, gpus)


def server_units(server, snap) -> tuple[int, int]:
    """(engines, GPUs) of a ServerFigures: the GPUs configured for it, or every GPU read when it is the only
    server and names none (the configuration's rule, config/schema.py)."""
    gpus = len(server.gpu_ids)
    if not gpus and len(snap.servers) == 1:
        gpus = sum(1 for d in snap.devices if d.reading.kind == "gpu")
    return server.engines, gpus


def _token_rate(v: float, where: Where) -> str | None:
    if v < 0:
        return f"{v:.6g} tokens/s < 0"
    server = where.server()
    engines, gpus = server_units(server, where.snap) if server is not None else (1, 0)
    ceiling = token_rate_ceiling(engines, gpus)
    if v > ceiling:
        return (f"{v:.4g} tokens/s > {ceiling:g} ({MAX_GENERATION_TOKENS_PER_SECOND:g} x max({engines} engines, "
                f"{gpus} GPUs, 1)), more than the server generates (a counter counted whole or a jump)")
    return None


def _cost(where: Where):
    """The CostFigure of the sample's server, window and scope, or None."""
    w = where.window()
    return next((c for c in (w.costs if w else ()) if c.scope == where.labels.get("scope")), None)


def priced_watts(watts_of: Callable[[object, Where], "float | None"], quantity: str, factor: float,
                 watts_words: str) -> Test:
    """Money or CO2 per day = the watts it prices x 24 h / 1000 x the price (or intensity) per kWh: finite,
    and equal to it (so it is unknown when the watts are)."""
    def test(v: float, where: Where) -> str | None:
        cost, price = _cost(where), where.price(quantity)
        watts = None if cost is None else watts_of(cost, where)
        if watts is None or price is None:
            return f"{v:.6g} prices {watts_words} that are unknown (or no {quantity})"
        expected = watts * factor * price
        if not math.isfinite(expected) or abs(v - expected) > _REL_TOL * max(abs(expected), 1e-12):
            return f"{v:.6g} is not {watts_words} {watts:.4g} W x {factor:g} x {quantity} {price:.4g}"
        return None
    return test


def _window_dict(key: str) -> Callable[[object, Where], "float | None"]:
    def get(_cost, where: Where) -> float | None:
        w = where.window()
        return (getattr(w, key) or {}).get(where.labels.get("scope")) if w else None
    return get


def _marginal_of(cost, _where: Where) -> float | None:
    return cost.marginal_watts


def _per_token(quantity: str, factor: float) -> Test:
    """Money per million / CO2 per thousand tokens = marginal J/token x factor x price: >= 0 and equal to it."""
    def test(v: float, where: Where) -> str | None:
        w = where.window()
        e = next((e for e in (w.energy if w else ()) if e.scope == where.labels.get("scope")), None)
        j, price = (e.marginal_joules_per_token if e else None), where.price(quantity)
        if j is None or price is None:
            return f"{v:.6g} prices a marginal J/token that is unknown (or no {quantity})"
        expected = j * factor * price
        if v < 0 or abs(v - expected) > _REL_TOL * max(abs(expected), 1e-12):
            return f"{v:.6g} is not marginal J/token {j:.4g} x {factor:g} x {quantity} {price:.4g} (>= 0)"
        return None
    return test


def implausible_counts(deltas: Mapping[str, float], seconds: float, engines: int, gpus: int) -> dict[str, str]:
    """The counts of one interval (its counter deltas over ``seconds``) no server of ``engines`` data-parallel
    engines and ``gpus`` GPUs can produce, by DEPENDENCIES' name, with why (empty: all plausible)."""
    generated = deltas.get("generation_tokens")
    ceiling = token_rate_ceiling(engines, gpus)
    if generated is None or seconds <= 0 or generated / seconds <= ceiling:
        return {}
    return {"generation_tokens": f"{generated:.4g} generated tokens in {seconds:.3g} s = {generated / seconds:.4g}/s "
                                 f"> {ceiling:g}, more than the server generates (a counter that jumped)"}


@dataclass(frozen=True, kw_only=True)
class Dependency:
    """Figures computed from the same counts over the same window: when ``witness`` (the family that states those
    counts as a rate) is rejected, or the model found the window's counts implausible
    (WindowFigures.implausible_counts[``counts``]), every ``dependents`` family of that server and window is served
    as unknown with the witness' reason (methods.md s13)."""

    counts: str  # the counts' name (implausible_counts)
    words: str  # the counts in words, for the reason
    witness: str
    dependents: tuple[str, ...]


DEPENDENCIES = (
    Dependency(counts="generation_tokens", words="the generation token counter's delta",
               witness="kvwatt_generation_tokens_per_second",
               dependents=("kvwatt_energy_per_token_joules", "kvwatt_marginal_energy_per_token_joules",
                           "kvwatt_prompt_energy_per_token_joules", "kvwatt_energy_cost_per_million_tokens",
                           "kvwatt_co2e_grams_per_thousand_tokens", "kvwatt_estimated_flops_per_generated_token",
                           "kvwatt_preemption_recompute_tokens_per_second", "kvwatt_preemption_recompute_share_ratio",
                           "kvwatt_preemption_recompute_watts", "kvwatt_energy_saving_ratio",
                           "kvwatt_energy_saving_stderr_ratio", "kvwatt_throughput_gain_ratio",
                           "kvwatt_throughput_gain_stderr_ratio")),
    Dependency(counts="engine_write_bytes", words="the write-traffic counter's delta",
               witness="kvwatt_preemption_recompute_tokens_per_second",
               dependents=("kvwatt_preemption_recompute_share_ratio", "kvwatt_preemption_recompute_watts")),
)


# --- relations between figures (methods.md s13 "Relations between figures") ------------------------------------
RELATION = "relation"  # kvwatt_figures_rejected_total{reason}: breaks a declared relation with another figure
SHARE_SUM_TOLERANCE = 1e-6  # shares of one whole sum to 1 up to rounding
POWER_LIMIT_TOLERANCE = 0.10  # NVML's 1 s power average may overshoot the enforced limit briefly (boost, sensor lag)
DE_TOLERANCE_STDERRS = rules.NOISE_STDERRS.default  # dE within this many of its SE of the tax it prices agrees
DE_TOLERANCE_ABSOLUTE = 0.02  # and within this much (the pricing's own rounding, a window's edges)
RECOMMENDATION_MAX_ROUNDING = 1.5  # --kv-offloading-size at most this times the recommended bytes (issue 37)
GIB = 1024.0 ** 3
Broken = tuple[str, dict]  # why, the labels the figures served as unknown carry (server, window added)


@dataclass(frozen=True, kw_only=True)
class Relation:
    """A relation between figures (declared as data, beside the bounds): ``relates`` names the figures it
    relates, ``check`` yields each breach (why, and labels narrowing the figures it takes: scope, baseline,
    uuid), ``unknown`` the families served as unknown when it breaks (the derived figure, never the measured
    one: methods.md s13) and ``says`` the relation in words (README, docs). ``per``: what one check covers
    (window: a server's window; server: a server; snapshot: the host's devices)."""

    name: str
    relates: tuple[str, ...]
    unknown: tuple[str, ...]
    per: str
    check: Callable[..., Iterable[Broken]]
    says: str
    # a figure with no family of its own (a server's words, a rounded size): how the server serves it unknown
    clear: Callable[[object, str], object] | None = None


def _shares_sum(_s, w, _snap) -> Iterable[Broken]:
    shares = w.token_shares
    if shares and all(v is not None for v in shares.values()):
        total = sum(shares.values())
        if abs(total - 1.0) > SHARE_SUM_TOLERANCE:
            yield f"the prompt token shares sum to {total!r}, not 1", {}


def _tax_within_recomputed(_s, w, _snap) -> Iterable[Broken]:
    computed = (w.token_shares or {}).get("local_compute")
    if w.recompute_tax is not None and computed is not None and w.recompute_tax > computed + rounding_slack(1.0):
        yield (f"the recomputation tax {w.recompute_tax:.4g} is more than the recomputed share {computed:.4g} "
               "(the tax is the recomputed share less the reference)"), {}


def _gpu_power_within_limit(snap) -> Iterable[Broken]:
    for d in snap.devices:
        r = d.reading
        limit = r.power_limit_watts
        if r.kind == "gpu" and limit and r.power_watts is not None and \
                r.power_watts > limit * (1 + POWER_LIMIT_TOLERANCE):
            yield (f"GPU {r.labels.get('gpu')} draws {r.power_watts:.4g} W above its enforced power limit "
                   f"{limit:.4g} W (+{POWER_LIMIT_TOLERANCE:.0%})"), {"uuid": r.labels.get("uuid", "")}


def server_power_limit_watts(server, snap) -> float | None:
    """The sum of the enforced power limits of the GPUs attributed to a server (its configured ``gpus`` by index or
    UUID; every GPU when it is the only server and names none); None when any lacks one or none is known."""
    ids = set(server.gpu_ids)
    gpus = [d.reading for d in snap.devices if d.reading.kind == "gpu"
            and (d.reading.labels.get("gpu") in ids or d.reading.labels.get("uuid") in ids
                 or (not ids and len(snap.servers) == 1))]
    if not gpus or any(not g.power_limit_watts for g in gpus):
        return None
    return sum(g.power_limit_watts for g in gpus)


def _window_power_within_limit(s, w, snap) -> Iterable[Broken]:
    limit = server_power_limit_watts(s, snap)
    gpu = next((e for e in w.energy if e.scope == "gpu"), None)
    if limit is None or gpu is None or not gpu.basis.seconds or gpu.basis.seconds <= 0:
        return
    watts = gpu.basis.energy_joules / gpu.basis.seconds
    if watts > limit * (1 + POWER_LIMIT_TOLERANCE):
        yield (f"the GPU energy over the window averages {watts:.4g} W, above the enforced power limit "
               f"{limit:.4g} W of the server's GPUs (+{POWER_LIMIT_TOLERANCE:.0%})"), {"scope": "gpu"}


def _reload_ratio(s) -> float | None:
    c = next((c for c in s.phase_costs if c.scope == "gpu"), None)
    if c is None or not c.prompt_computed_j or c.reloaded_j is None:
        return None
    return max(c.reloaded_j / c.prompt_computed_j, 0.0)


def _de_prices_the_tax(s, w, _snap) -> Iterable[Broken]:
    """Potential dE (offloading off) = the tax's share of the marginal energy x (1 - reload price); estimated dE
    (on) = saved W / (marginal W + saved W): each within DE_TOLERANCE_STDERRS of its SE (half the expected value
    where the SE is unknown), less the reload price (potential), plus DE_TOLERANCE_ABSOLUTE."""
    ratio = _reload_ratio(s)
    if ratio is None:
        return
    share = (w.recompute_energy_share or {}).get("gpu")
    saved = (w.offload_saved_watts or {}).get("gpu")
    cost = next((c for c in w.costs if c.scope == "gpu"), None)
    gpu = next((e for e in w.energy if e.scope == "gpu"), None)
    marginal = None
    if gpu is not None and gpu.basis.idle_joules is not None and gpu.basis.seconds > 0:
        marginal = (gpu.basis.energy_joules - gpu.basis.idle_joules) / gpu.basis.seconds
    elif cost is not None:
        marginal = cost.marginal_watts
    for f in w.savings:
        if f.energy_saving is None:
            continue
        if f.baseline == "potential" and share is not None:
            low, high, words = share * (1 - min(ratio, 1.0)), share, f"the tax's share of the energy {share:.3g}"
        elif f.baseline == "estimated" and saved is not None and marginal and marginal + saved > 0:
            expected = saved / (marginal + saved)
            low, high, words = expected, expected, f"saved {saved:.4g} W / (marginal {marginal:.4g} W + saved)"
        else:
            continue
        se = f.energy_saving_stderr
        slack = (DE_TOLERANCE_STDERRS * se if se is not None else 0.5 * abs(high)) + DE_TOLERANCE_ABSOLUTE
        if not low - slack <= f.energy_saving <= high + slack:
            yield (f"{f.baseline} dE {f.energy_saving:+.3g} (SE {se if se is None else f'{se:.2g}'}) disagrees with "
                   f"{words}: expected [{low:.3g}, {high:.3g}] +/- {slack:.2g}"), {"baseline": f.baseline}


def _tier_savings_sum(_s, w, _snap) -> Iterable[Broken]:
    """Each tier's net saving plus its reload energy is its GPU-side saving, and those sum over the tiers to what
    offloading saved on the GPU (methods.md s14: the same capped costs, the reloaded tokens split by tier)."""
    saved = (w.offload_saved_watts or {}).get("gpu")
    tiers = [t for t in w.offload_tier_energy if t.scope == "gpu"]
    if saved is None or not tiers or len(tiers) != len(w.offload_tier_energy) \
            or any(t.saved_watts is None or t.reload_watts is None for t in tiers):
        return
    total = sum(t.saved_watts + t.reload_watts for t in tiers)
    if abs(total - saved) > _REL_TOL * max(abs(saved), abs(total)) + 1e-9:
        yield (f"the tiers' savings plus their reload energy sum to {total:.6g} W, not what offloading saved on the "
               f"gpu {saved:.6g} W"), {}


def _buffer_matches_verdict(s, _w, _snap) -> Iterable[Broken]:
    """An undersized buffer is never recommended at its own size or less."""
    b, size = s.buffer, (s.info.offload_buffer_bytes if s.info else None)
    if b is not None and b.recommended_bytes is not None and b.undersized and size and b.recommended_bytes <= size:
        yield (f"the buffer of {size:.4g} B is called undersized but {b.recommended_bytes:.4g} B is recommended"), {}


def _size_rounds_the_bytes(s, _w, _snap) -> Iterable[Broken]:
    """The size in the flag's unit (GiB) is at most RECOMMENDATION_MAX_ROUNDING x the recommended bytes (a
    rounding, not a different answer: 1 GiB for 18 MiB recommended is not)."""
    b = s.buffer
    if b is None or b.recommended_bytes is None:
        return
    gib = b.recommended_gib
    if gib is not None and b.recommended_bytes > 0 and gib * GIB > RECOMMENDATION_MAX_ROUNDING * b.recommended_bytes:
        yield (f"the recommended size {gib:g} GiB is {gib * GIB / b.recommended_bytes:.3g}x the recommended "
               f"{b.recommended_bytes:.4g} B (rounded beyond {RECOMMENDATION_MAX_ROUNDING:g}x)"), {}


def _no_gib(s, _why: str):
    return dataclasses.replace(s, buffer=dataclasses.replace(s.buffer, recommended_gib=None))


def _advice_window(s, _w, _snap) -> Iterable[Broken]:
    """The KV-pressure advice rests on the regime's window (the shortest with a verdict); a longer window's
    pressure after the regime's window reads below is advice about a pressure that has ended."""
    regime_window = s.regime_window
    for a in s.advice:
        window = a.evidence.get("window") if a.kind == "kv_pressure" else None
        if window is not None and regime_window is not None and window != regime_window and s.regime == "below":
            yield (f"the KV-pressure advice rests on the {window} window while the regime's {regime_window} "
                   "window reads below: the pressure has ended"), {}


RELATIONS = (
    Relation(name="token_shares_sum_to_one", relates=("kvwatt_prompt_token_share_ratio",),
             unknown=("kvwatt_prompt_token_share_ratio", "kvwatt_recompute_tax_ratio"), per="window",
             check=_shares_sum, says="the prompt token shares by source sum to 1"),
    Relation(name="tax_within_recomputed_share",
             relates=("kvwatt_recompute_tax_ratio", "kvwatt_prompt_token_share_ratio"),
             unknown=("kvwatt_recompute_tax_ratio",), per="window", check=_tax_within_recomputed,
             says="the recomputation tax is at most the recomputed (local_compute) share"),
    Relation(name="gpu_power_within_limit", relates=("kvwatt_gpu_power_watts",),
             unknown=("kvwatt_gpu_power_watts",), per="snapshot", check=_gpu_power_within_limit,
             says=f"a GPU's power is at most its enforced power limit (NVML, +{POWER_LIMIT_TOLERANCE:.0%})"),
    Relation(name="window_power_within_limit",
             relates=("kvwatt_energy_per_token_joules", "kvwatt_gpu_power_watts"),
             unknown=("kvwatt_energy_per_token_joules", "kvwatt_marginal_energy_per_token_joules",
                      "kvwatt_recompute_tax_watts", "kvwatt_offload_saved_watts",
                      "kvwatt_recompute_energy_share_ratio", "kvwatt_preemption_recompute_watts",
                      "kvwatt_offload_tier_saved_watts", "kvwatt_offload_second_tier_energy_saving_ratio"),
             per="window", check=_window_power_within_limit,
             says="a server's GPU energy over a window averages at most its GPUs' enforced power limits"),
    Relation(name="de_prices_the_tax",
             relates=("kvwatt_energy_saving_ratio", "kvwatt_recompute_energy_share_ratio",
                      "kvwatt_offload_saved_watts"),
             unknown=("kvwatt_energy_saving_ratio", "kvwatt_energy_saving_stderr_ratio"), per="window",
             check=_de_prices_the_tax,
             says="potential and estimated dE agree with the tax and the saving they price (within 2 SE and the "
                  "reload price)"),
    Relation(name="tier_savings_sum_to_the_saving",
             relates=("kvwatt_offload_tier_saved_watts", "kvwatt_offload_tier_reload_watts",
                      "kvwatt_offload_saved_watts"),
             unknown=("kvwatt_offload_tier_saved_watts", "kvwatt_offload_tier_reload_watts",
                      "kvwatt_offload_second_tier_energy_saving_ratio"), per="window", check=_tier_savings_sum,
             says="each offload tier's net saving plus its reload energy sums over the tiers to what offloading "
                  "saved on the GPU (methods.md s14)"),
    Relation(name="buffer_matches_verdict",
             relates=("kvwatt_offload_recommended_buffer_bytes", "kvwatt_offload_buffer_undersized"),
             unknown=("kvwatt_offload_recommended_buffer_bytes",), per="server", check=_buffer_matches_verdict,
             says="an undersized buffer is recommended larger than it is"),
    Relation(name="recommended_size_rounds_the_bytes",
             relates=("kvwatt_offload_recommended_buffer_bytes",), unknown=(), per="server",
             check=_size_rounds_the_bytes, clear=_no_gib,
             says=f"the recommended size in GiB (--kv-offloading-size) is at most {RECOMMENDATION_MAX_ROUNDING:g}x "
                  "the recommended bytes (the GiB figure served unknown)"),
    Relation(name="advice_on_regime_window", relates=("kvwatt_kv_pressure_above_threshold",),
             unknown=(), per="server", check=_advice_window,
             says="the KV-pressure advice rests on the regime's window, or the pressure has ended"),
)


def relation_breaks(snap, defs_by_name: dict, found: list[Rejection]) -> tuple[list[Rejection], list]:
    """The figures that break a declared relation (RELATIONS), each the relation's ``unknown`` families of the
    server (and window) where it broke, narrowed by the breach's labels; none already in ``found``."""
    seen, out = {r.key for r in found}, []

    clears: list[tuple[str, Callable, str]] = []

    def take(rel: Relation, why: str, where: dict) -> None:
        for name in rel.unknown:
            d = defs_by_name[name]
            for labels, value in d.fill(snap):
                lab = dict(zip(d.labels, map(str, labels)))
                if value is None or any(lab.get(k, v) != v for k, v in where.items()):
                    continue
                r = Rejection(name, tuple(lab.items()), RELATION, f"inconsistent: {rel.name}: {why}")
                if r.key not in seen:
                    seen.add(r.key)
                    out.append(r)
        r = Rejection(rel.name, tuple(where.items()), RELATION, f"inconsistent: {rel.name}: {why}")
        if not rel.unknown and r.key not in seen:  # a figure with no family: listed under the relation's name
            seen.add(r.key)
            out.append(r)
        if rel.clear is not None:
            clears.append((where.get("server", ""), rel.clear, r.reason))

    for rel in RELATIONS:
        if rel.per == "snapshot":
            for why, where in rel.check(snap):
                take(rel, why, where)
            continue
        for s in snap.servers:
            for w in (s.windows if rel.per == "window" else (None,)):
                for why, where in rel.check(s, w, snap):
                    take(rel, why, {"server": s.name, **({"window": w.window} if w else {}), **where})
    return out, clears


def relation_cleared(snap, clears: list):
    """The snapshot with each relation's figure that has no family served unknown (Relation.clear)."""
    for server, clear, why in clears:
        snap = dataclasses.replace(snap, servers=tuple(clear(s, why) if s.name == server else s
                                                       for s in snap.servers))
    return snap


DAY_KWH_PER_WATT = _DAY_HOURS / 1000.0  # W held for a day in kWh

SHARE = Bound("share", "a share in [0, 1] (a few ulps outside by rounding: served clamped)", _range(0.0, 1.0),
              limits=(0.0, 1.0), within=lambda v: 0.0 <= v <= 1.0)
SHARE_DIFFERENCE = Bound("share_difference", "a difference of two shares, in [-1, 1]", _range(-1.0, 1.0),
                         limits=(-1.0, 1.0), within=lambda v: -1.0 <= v <= 1.0)
BOOLEAN = Bound("boolean", "0 or 1", _one_of(0.0, 1.0), within=lambda v: v == 0.0 or v == 1.0)
INFO = Bound("info", "1 (an info series)", _one_of(1.0), within=lambda v: v == 1.0)
NON_NEGATIVE = Bound("non_negative", "finite, >= 0", _non_negative, within=lambda v: 0.0 <= v < math.inf)
UNBOUNDED_RATIO = Bound("non_negative", ">= 0; +Inf when nothing was computed (methods.md s7)", _non_negative,
                        infinite=True, within=lambda v: v >= 0.0)
JOULES_PER_TOKEN = Bound("joules_per_token", "J/token >= 0 (a marginal figure below 0 means a stale P_idle)",
                         _non_negative)
SAVING = Bound("saving", "dE <= 1: offloading cannot save more than all the energy", _at_most_one)
GAIN = Bound("gain", "dTPS >= -1: throughput cannot fall below zero", _gain)
POWER_PART = Bound("power_part", "a part of the scope's marginal power: 0 <= W <= (E - P_idle*dt)/dt",
                   _power_part)
TIER_SAVED_POWER = Bound("saved_power", "at most the GPU's marginal power (its GPU-side part is capped at it, its "
                         "reload energy only lowers it); below 0: the tier is dearer than recomputing",
                         _gpu_saved_power)
SAVED_POWER = Bound("saved_power", "|W| <= the scope's marginal power (costs capped at the window's energy, "
                    "methods.md s12)", _saved_power)
TOKEN_RATE = Bound("token_rate", f"0 <= tokens/s <= {MAX_GENERATION_TOKENS_PER_SECOND:g} x max(data-parallel "
                   "engines, GPUs attributed, 1) (more than the server generates)", _token_rate)


def money_per_day(watts: str) -> Bound:
    get = _marginal_of if watts == "marginal_watts" else _window_dict(watts)
    return Bound("priced", f"finite, = {watts} x 24 h / 1000 x the price per kWh",
                 priced_watts(get, "electricity_price", DAY_KWH_PER_WATT, watts))


def co2e_per_day(watts: str) -> Bound:
    get = _marginal_of if watts == "marginal_watts" else _window_dict(watts)
    return Bound("priced", f"finite, = {watts} x 24 h / 1000 x the carbon intensity per kWh",
                 priced_watts(get, "carbon_intensity", DAY_KWH_PER_WATT, watts))


MONEY_PER_MILLION_TOKENS = Bound("priced", ">= 0, = marginal J/token x 1e6 / 3.6e6 x the price per kWh",
                                 _per_token("electricity_price", 1e6 / _KWH_JOULES))
CO2E_PER_THOUSAND_TOKENS = Bound("priced", ">= 0, = marginal J/token x 1e3 / 3.6e6 x the intensity per kWh",
                                 _per_token("carbon_intensity", 1e3 / _KWH_JOULES))

KINDS = ("share", "share_difference", "boolean", "info", "non_negative", "joules_per_token", "saving",
         "gain", "power_part", "saved_power", "token_rate", "priced")
DEPENDENT = "dependent"  # kvwatt_figures_rejected_total{reason}: computed from counts another figure showed implausible


# --- the one check ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rejection:
    """A figure served as unknown: its family, labels, the bound's kind and the reason in words."""

    figure: str
    labels: tuple[tuple[str, str], ...]
    kind: str
    reason: str

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.figure, self.labels

    def as_json(self) -> dict:
        return {"figure": self.figure, "labels": dict(self.labels), "bound": self.kind, "reason": self.reason}


def violations(defs: Iterable, snap, clamps: list | None = None) -> list[Rejection]:
    """Every sample of every declaration (exporter.catalog.MetricDef) outside its family's bound; ``clamps``
    (when given) collects (value, the bound's end) for each value outside its range by rounding only."""
    out = []
    for d in defs:
        if d.bounds is None:
            continue
        within = d.bounds.within
        for labels, value in d.fill(snap):
            if value is None or (within is not None and type(value) is float and within(value)):
                continue
            where = Where.of(d.name, d.labels, labels, snap)
            why = d.bounds.violation(float(value), where)
            if why is not None:
                out.append(Rejection(d.name, tuple(where.labels.items()), d.bounds.kind,
                                     f"implausible: {d.name} {why}"))
            elif clamps is not None and isinstance(value, float):
                end = d.bounds.clamped(value)
                if end is not None:
                    clamps.append((value, end))
    return out


def _cleared(x, target: float, new_value: float | None = None, reason: str = ""):
    """``x`` with every reference to the float object ``target`` replaced by ``new_value`` (None: unknown;
    dataclasses, dicts, tuples rebuilt; identity, not equality: a figure is the object its fill read). A figure
    with a state of its own (STATED) whose value becomes unknown says so: state "unknown", ``reason``."""
    if x is target:
        return new_value
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changes = {}
        for f in dataclasses.fields(x):
            if not f.init:
                continue
            old = getattr(x, f.name)
            new = _cleared(old, target, new_value, reason)
            if new is not old:
                changes[f.name] = new
        if changes and new_value is None and type(x).__name__ in STATED:
            changes |= {"state": "unknown", "reason": reason}
        return dataclasses.replace(x, **changes) if changes else x
    if isinstance(x, dict):
        new = {k: _cleared(v, target, new_value, reason) for k, v in x.items()}
        return new if any(new[k] is not v for k, v in x.items()) else x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        new = tuple(_cleared(v, target, new_value, reason) for v in x)
        return new if any(a is not b for a, b in zip(new, x)) else x
    return x


# figures that carry their own state and reason (known | provisional | unknown): one of their values served as
# unknown makes the figure unknown, with the rejection's reason (the post-preemption share is not "known" beside
# its rejected tokens/s)
STATED = frozenset({"PreemptionRecompute"})


def clamped(snap, clamps: list):
    """The snapshot with each value outside its range by rounding only served on the range's end."""
    for value, end in clamps:
        snap = _cleared(snap, value, end)
    return snap


def _value_of(d, labels: tuple, snap):
    for ls, value in d.fill(snap):
        if tuple(map(str, ls)) == labels:
            return value
    return None


def cleared(snap, defs_by_name: dict, rejections: list[Rejection]):
    """The snapshot with each rejected figure None in its typed figures (only inside its own server where the
    family has a server label, so a float shared by two servers stays for the other)."""
    for r in rejections:
        d = defs_by_name.get(r.figure)
        if d is None:
            continue  # a relation's figure with no family (Relation.clear serves it unknown)
        labels = tuple(v for _, v in r.labels)
        value = _value_of(d, labels, snap)
        if not isinstance(value, float):
            continue  # computed by the fill (a bool, a count): the collector leaves the sample out (rejected keys)
        server = dict(r.labels).get("server")
        if server is not None:
            servers = tuple(_cleared(s, value, None, r.reason) if s.name == server else s for s in snap.servers)
            snap = dataclasses.replace(snap, servers=servers)
        else:
            snap = _cleared(snap, value, None, r.reason)
    return snap


def dependents(snap, defs_by_name: dict, found: list[Rejection]) -> list[Rejection]:
    """The figures computed from counts shown implausible (DEPENDENCIES): by a rejected witness, or by the model
    (WindowFigures.implausible_counts), in the same server and window; not already in ``found``."""
    broken: dict[tuple[str, str], dict[str, str]] = {}  # (server, window) -> counts -> reason
    for r in found:
        lab = dict(r.labels)
        for dep in DEPENDENCIES:
            if r.figure == dep.witness and "window" in lab:
                broken.setdefault((lab["server"], lab["window"]), {}).setdefault(dep.counts, r.reason)
    for s in snap.servers:
        for w in s.windows:
            for counts, why in (w.implausible_counts or {}).items():
                broken.setdefault((s.name, w.window), {}).setdefault(counts, f"implausible: {why}")
    if not broken:
        return []
    seen, out = {r.key for r in found}, []
    for dep in DEPENDENCIES:  # in order: a dependent that is itself a witness breaks the counts it states
        for (server, window), counts in list(broken.items()):
            why = counts.get(dep.counts)
            if why is None:
                continue
            for name in (dep.witness, *dep.dependents):
                d = defs_by_name[name]
                kind = d.bounds.kind if name == dep.witness else DEPENDENT
                for labels, value in d.fill(snap):
                    lab = dict(zip(d.labels, map(str, labels)))
                    if value is None or lab.get("server") != server or lab.get("window") != window:
                        continue
                    r = Rejection(name, tuple(lab.items()), kind,
                                  f"implausible: {name} computed from {dep.words}: {why.removeprefix('implausible: ')}")
                    if r.key not in seen:
                        seen.add(r.key)
                        out.append(r)
                    for other in DEPENDENCIES:
                        if other.witness == name:
                            counts.setdefault(other.counts, r.reason)
    return out


class BoundsCheck:
    """Holds the figures to their bounds once per tick; counts and logs rejections (once per change)."""

    def __init__(self, defs: Iterable) -> None:
        self.defs = tuple(defs)
        self.by_name = {d.name: d for d in self.defs}
        # (figure, kind) -> figures rejected so far; every family's series from 0 (Prometheus' advice for a
        # labelled counter: rate() and increase() see the first rejection)
        self.counts: dict[tuple[str, str], float] = {(d.name, d.bounds.kind): 0.0 for d in self.defs if d.bounds}
        self.current: dict[tuple, Rejection] = {}
        self._last_t: float | None = None

    def apply(self, snap):
        found: list[Rejection] = []
        for _ in range(3):  # a rejected figure makes the figures priced from it implausible in turn
            seen, clamps = {r.key for r in found}, []
            new = [r for r in violations(self.defs, snap, clamps) if r.key not in seen]
            snap = clamped(snap, clamps)
            new += dependents(snap, self.by_name, found + new)  # and what was computed from the same counts
            broken, clears = relation_breaks(snap, self.by_name, found + new)  # and what contradicts another
            new += broken
            snap = relation_cleared(snap, clears)
            if not new:
                break
            found += new
            snap = cleared(snap, self.by_name, new)
        if snap.t != self._last_t:  # count once per tick (a second snapshot of the same tick counts nothing)
            self._last_t = snap.t
            for r in found:
                self.counts[(r.figure, r.kind)] = self.counts.get((r.figure, r.kind), 0.0) + 1.0
            self._log_changes(found)
        return dataclasses.replace(snap, implausible=tuple(found), rejected_counts=dict(self.counts))

    def _log_changes(self, found: list[Rejection]) -> None:
        now = {r.key: r for r in found}
        for key, r in now.items():
            if key not in self.current:
                log.warning("%s%s served as unknown: %s", r.figure, dict(r.labels), r.reason)
        for key, r in self.current.items():
            if key not in now:
                log.info("%s%s within its bounds again", r.figure, dict(r.labels))
        self.current = now
