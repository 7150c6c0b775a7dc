"""Energy saving and throughput gain of offloading (methods.md s2), three ways. docs/offload.md "Energy saving and
throughput gain" (the dE kinds).

    dE   = (J/tok_OFF - J/tok_ON) / J/tok_OFF         (ratio; positive = offloading saves energy)
    dTPS = (TPS_ON - TPS_OFF) / TPS_OFF
    SE   = (x_ON/x_OFF) * sqrt((SE_ON/x_ON)^2 + (SE_OFF/x_OFF)^2)   delta method, ratio of independent means

The repeat unit is a non-overlapping window (``window_stats``): a bucket of the store's fixed grid on the
shared monotonic clock (exporter/store/buckets.py), so two servers read by the same daemon tick have the
same windows. J/token is the marginal GPU figure
of methods.md s1 by default. Every result carries the number of windows it rests on; SE is None without
repeats (fewer than two windows on a side).

- paired:    ON and OFF servers on one node serving the same traffic, compared over the same windows, only
             windows where both carry load.
- recorded:  the live ON server against an OFF profile (`kvwatt baseline record`), band by band of KV p95;
             bands are combined weighted by the ON windows in each.
- estimated: no OFF reference. A MODEL, not a measurement: tokens reloaded from the offload tier would
             have been recomputed without it, each priced at the measured J per computed prompt token, minus
             the cost of loading them. No dTPS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from exporter.derive.phase_energy import PhaseCosts
from exporter.derive.pressure import kv_usage_quantile
from exporter.derive.recompute import token_counts
from exporter.store import Bucket, WindowAggregate

DEFAULT_BANDS: tuple[tuple[float, float], ...] = ((0.0, 0.8), (0.8, 0.9), (0.9, 0.95), (0.95, 1.0))
MIN_COVERAGE_RATIO = 0.9  # a window counts when samples cover 90 % of it


@dataclass(frozen=True)
class WindowStat:
    """One non-overlapping window of one server."""

    t0: float
    t1: float
    covered_seconds: float
    generated_tokens: float
    joules: float | None                 # scope energy (marginal: minus P_idle*dt), None if any sample missing
    kv_p95: float | None
    computed_prompt_tokens: float | None  # local_compute
    loaded_prompt_tokens: float | None    # external_kv_transfer
    loaded: bool                          # covered, and generated tokens in it
    prompt_tokens: float | None = None    # all three token sources

    @property
    def joules_per_token(self) -> float | None:
        if self.joules is None or self.generated_tokens < 1:  # < 1 token: no per-token figure (as derive.energy)
            return None
        return self.joules / self.generated_tokens

    @property
    def tokens_per_second(self) -> float | None:
        return self.generated_tokens / self.covered_seconds if self.covered_seconds > 0 else None


@dataclass(frozen=True)
class Estimate:
    value: float | None
    stderr: float | None
    windows: int                 # windows (paired: pairs) the value rests on
    reference_windows: int = 0   # OFF windows (paired: = windows; recorded: profile windows used)
    kind: str = ""
    note: str = ""
    bands: dict[str, dict] = field(default_factory=dict)


def window_stat(agg: WindowAggregate, t0: float, t1: float, width: float, scope: str = "gpu",
                marginal: bool = True) -> WindowStat:
    """One repeat window [t0, t1) of ``width`` seconds from the aggregate of the intervals that ended in it
    (a store.Bucket's ``agg``). Token sources follow recompute.token_counts (vLLM < 0.16: the prefix-cache
    estimate). Energy is known only when every interval of the window has it (marginal: and its idle
    energy)."""
    covered = agg.covered_seconds
    gen = agg.delta("generation_tokens") or 0.0
    joules = None
    used = agg.scope(scope)
    if used is not None and used.n == agg.n:
        joules = used.energy_joules
        if marginal:
            idle = used.idle_joules
            joules = None if idle is None else joules - idle
    counts = token_counts(agg)
    if counts is None:
        computed = loaded_tokens = prompt = None
    else:
        computed, loaded_tokens = counts["local_compute"], counts["external_kv_transfer"]
        prompt = sum(counts.values())
    return WindowStat(t0, t1, covered, gen, joules, kv_usage_quantile(agg, 0.95), computed, loaded_tokens,
                      covered >= MIN_COVERAGE_RATIO * width and gen > 0, prompt)


def window_stats(buckets: Iterable[Bucket], width: float, scope: str = "gpu",
                 marginal: bool = True) -> list[WindowStat]:
    """WindowStats of grid buckets of ``width`` seconds (ServerHistory.buckets, or store.buckets_of over a
    recorded list of intervals): the same windows for every server read at the same ticks."""
    return [window_stat(b.agg, b.t0, b.t1, width, scope, marginal) for b in buckets]


def mean_and_stderr(values: Sequence[float]) -> tuple[float | None, float | None]:
    n = len(values)
    if n == 0:
        return None, None
    m = sum(values) / n
    if n < 2:
        return m, None
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    return m, math.sqrt(var / n)


def ratio_stderr(x_on: float, se_on: float | None, x_off: float, se_off: float | None) -> float | None:
    """Delta method SE of x_ON/x_OFF for independent means (also the SE of dE and of dTPS)."""
    if se_on is None or se_off is None or x_on == 0 or x_off == 0:
        return None
    return abs(x_on / x_off) * math.sqrt((se_on / x_on) ** 2 + (se_off / x_off) ** 2)


def saving(x_on: float, se_on: float | None, x_off: float, se_off: float | None) -> tuple[float, float | None]:
    """dE = 1 - x_ON/x_OFF (x = J/token) and its SE."""
    return 1.0 - x_on / x_off, ratio_stderr(x_on, se_on, x_off, se_off)


def gain(x_on: float, se_on: float | None, x_off: float, se_off: float | None) -> tuple[float, float | None]:
    """dTPS = x_ON/x_OFF - 1 (x = tokens/s) and its SE."""
    return x_on / x_off - 1.0, ratio_stderr(x_on, se_on, x_off, se_off)


def _compare(on: Sequence[float], off: Sequence[float], fn, kind: str, note: str = "") -> Estimate:
    m_on, se_on = mean_and_stderr(on)
    m_off, se_off = mean_and_stderr(off)
    if m_on is None or m_off is None or m_off == 0:
        return Estimate(None, None, len(on), len(off), kind, note or "no comparable windows")
    value, se = fn(m_on, se_on, m_off, se_off)
    return Estimate(value, se, len(on), len(off), kind, note)


def _spent(w: WindowStat) -> bool:
    """A window that can enter dE: a J/token from energy above idle. A window with E <= 0 (a stale P_idle above
    the loaded power) stays out, on every side and in every kind (estimated already did): with it, 1 - on/off
    has no meaning (dE 3.6 against an OFF side at -0.2 J/token)."""
    return w.joules_per_token is not None and w.joules is not None and w.joules > 0


# --------------------------------------------------------------------------------------------------------
# paired
# --------------------------------------------------------------------------------------------------------
def paired(on: Sequence[WindowStat], off: Sequence[WindowStat]) -> tuple[Estimate, Estimate]:
    """(dE, dTPS) over the windows both servers have and in which both carry load."""
    off_by_t0 = {round(w.t0, 6): w for w in off}
    pairs = [(w, off_by_t0[round(w.t0, 6)]) for w in on if round(w.t0, 6) in off_by_t0]
    pairs = [(a, b) for a, b in pairs if a.loaded and b.loaded]
    e_pairs = [(a.joules_per_token, b.joules_per_token) for a, b in pairs if _spent(a) and _spent(b)]
    energy = _compare([a for a, _ in e_pairs], [b for _, b in e_pairs], saving, "paired")
    tput = _compare([a.tokens_per_second for a, _ in pairs], [b.tokens_per_second for _, b in pairs], gain,
                    "paired")
    return energy, tput


# --------------------------------------------------------------------------------------------------------
# recorded (profile bands)
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BandProfile:
    """One KV-pressure band of an OFF profile: means and SEs of per-window J/token and tokens/s."""

    lo: float
    hi: float
    windows: int
    joules_per_token: float | None
    joules_per_token_stderr: float | None
    tokens_per_second: float | None
    tokens_per_second_stderr: float | None

    @property
    def label(self) -> str:
        return f"{self.lo:g}-{self.hi:g}"


def band_of(bands: Sequence[BandProfile | tuple[float, float]], kv: float | None) -> int | None:
    if kv is None:
        return None
    for i, b in enumerate(bands):
        lo, hi = (b.lo, b.hi) if isinstance(b, BandProfile) else b
        if lo <= kv < hi or (hi >= 1.0 and kv >= hi):
            return i
    return None


def build_bands(windows: Sequence[WindowStat], bands: Sequence[tuple[float, float]] = DEFAULT_BANDS
                ) -> list[BandProfile]:
    """Aggregate loaded windows into per-band means (what `kvwatt baseline record` stores)."""
    out = []
    for i, (lo, hi) in enumerate(bands):
        ws = [w for w in windows if w.loaded and band_of(bands, w.kv_p95) == i]
        j, j_se = mean_and_stderr([w.joules_per_token for w in ws if _spent(w)])  # a band never goes <= 0
        t, t_se = mean_and_stderr([w.tokens_per_second for w in ws])
        out.append(BandProfile(lo, hi, len(ws), j, j_se, t, t_se))
    return out


def _combine(per_band: list[tuple[int, float, float | None]]) -> tuple[float | None, float | None]:
    """Weighted by ON windows per band: value = sum w_b v_b; SE = sqrt(sum w_b^2 SE_b^2) (bands independent)."""
    n = sum(k for k, _, _ in per_band)
    if n == 0:
        return None, None
    value = sum(k * v for k, v, _ in per_band) / n
    if any(se is None for _, _, se in per_band):
        return value, None
    return value, math.sqrt(sum((k / n) ** 2 * se ** 2 for k, _, se in per_band))


def recorded(on: Sequence[WindowStat], profile: Sequence[BandProfile]) -> tuple[Estimate, Estimate]:
    """(dE, dTPS) of the live ON windows against the OFF profile, band by band of the ON window's KV p95.
    A band without profile data is skipped (and named in ``note``)."""
    results = {}
    for what, get_on, get_off, fn in (
            ("energy", lambda w: w.joules_per_token if _spent(w) else None,
             lambda b: (b.joules_per_token, b.joules_per_token_stderr), saving),
            ("throughput", lambda w: w.tokens_per_second,
             lambda b: (b.tokens_per_second, b.tokens_per_second_stderr), gain)):
        per_band, bands, skipped, ref = [], {}, [], 0
        for i, b in enumerate(profile):
            vals = [get_on(w) for w in on if w.loaded and band_of(profile, w.kv_p95) == i]
            vals = [v for v in vals if v is not None]
            if not vals:
                continue
            x_off, se_off = get_off(b)
            if x_off is None or x_off <= 0:  # an OFF band with no energy above idle (or a rate of 0) compares nothing
                skipped.append(b.label)
                continue
            m_on, se_on = mean_and_stderr(vals)
            v, se = fn(m_on, se_on, x_off, se_off)
            per_band.append((len(vals), v, se))
            ref += b.windows
            bands[b.label] = {"value": v, "stderr": se, "windows": len(vals), "reference_windows": b.windows}
        value, se = _combine(per_band)
        note = f"no OFF profile data for band(s) {', '.join(skipped)}" if skipped else ""
        if value is None and not note:
            note = "no comparable windows"
        results[what] = Estimate(value, se, sum(k for k, _, _ in per_band), ref, "recorded", note, bands)
    return results["energy"], results["throughput"]


# --------------------------------------------------------------------------------------------------------
# estimated (token-source model)
# --------------------------------------------------------------------------------------------------------
def estimated(on: Sequence[WindowStat], price: float | Callable[[WindowStat], float | None] | None,
              load_to_compute_cost_ratio: float, costs: PhaseCosts | None = None) -> Estimate:
    """ESTIMATE. Per loaded window: saved = loaded tokens x (J_c - J_r); J/tok_OFF(est) = (E_ON + saved) /
    generated; dE_w = saved / (E_ON + saved). J_c, the J per computed prompt token, and J_r, per reloaded
    token: the measured per-phase costs (``costs``, methods.md s12) when given, their SE propagated into dE's;
    else ``price`` (a number or per window, price_from_roofline) and J_r = ratio x J_c. Value and SE are the
    mean and standard error of dE_w over the windows (ON and estimated OFF share their windows, so the
    independent-means delta method does not apply). Assumptions in docs/offload.md."""
    def values(j_c: PriceOf, kept: float) -> list[float]:
        vals = []
        for w in on:
            if not w.loaded or w.joules is None or w.loaded_prompt_tokens is None or w.joules <= 0:
                continue
            c = _within(j_c(w), w)
            if c is None:
                continue
            saved = w.loaded_prompt_tokens * c * kept
            if w.joules + saved <= 0:  # reloads dearer than the window's energy: no OFF energy left to compare
                continue
            vals.append(saved / (w.joules + saved))
        return vals
    return _priced(values, price, load_to_compute_cost_ratio, costs, "model estimate: reloaded tokens priced as "
                   "recomputation")


def potential(off: Sequence[WindowStat], reference_share: float | None,
              price: float | Callable[[WindowStat], float | None] | None,
              load_to_compute_cost_ratio: float, costs: PhaseCosts | None = None) -> Estimate:
    """ESTIMATE for a server running WITHOUT offloading: what enabling it would save. The prompt tokens it
    computed above its low-pressure local_compute share (the recomputation tax, methods.md s4) are the ones an
    offload tier would have reloaded instead (the study saw offloading move exactly that share into
    external_kv_transfer). Per loaded window: saved = tax tokens x (J_c - J_r) and, since the measured server
    is the OFF one, dE_w = saved / E_OFF. Needs a reference share (learned from low-pressure windows, or
    configured) and a J_c price: the measured per-phase cost when ``costs`` is given (an OFF server reloads
    nothing, so J_r stays ratio x J_c), else ``price``."""
    if reference_share is None:
        return Estimate(None, None, 0, 0, "estimated", "no low-pressure reference share yet (learned or configured)")

    def values(j_c: PriceOf, kept: float) -> list[float]:
        vals = []
        for w in off:
            if not w.loaded or w.joules is None or w.joules <= 0 or w.computed_prompt_tokens is None \
                    or not w.prompt_tokens:
                continue
            c = _within(j_c(w), w)
            if c is None:
                continue
            tax_tokens = max(w.computed_prompt_tokens - reference_share * w.prompt_tokens, 0.0)
            vals.append(tax_tokens * c * kept / w.joules)
        return vals
    return _priced(values, price, load_to_compute_cost_ratio, costs,
                   "model estimate: the recomputation tax priced as what offloading would reload")


PriceOf = Callable[[WindowStat], "float | None"]


def _within(price: float | None, w: WindowStat) -> float | None:
    """J per computed prompt token as the window may price it: at most its marginal joules over its computed +
    reloaded prompt tokens (phase_energy.within_energy), so a potential dE stays <= 1 - J_r/J_c."""
    if price is None or w.joules is None:
        return price
    tokens = (w.computed_prompt_tokens or 0.0) + (w.loaded_prompt_tokens or 0.0)
    return min(price, w.joules / tokens) if tokens > 0 else price


def _priced(values: Callable[[PriceOf, float], list[float]], price, ratio: float, costs: PhaseCosts | None,
            note: str) -> Estimate:
    """Mean and SE of the per-window dE at the prices; ``values(J_c, kept)`` prices a token J_c x kept, kept =
    1 - J_r/J_c the share of the computed cost a reload saves. With measured costs, SE^2 = SE_windows^2 + g' V g: g the
    gradient of the mean dE in (J_c, J_r) (finite differences), V their covariance from the regression (the
    delta method; J_r = ratio x J_c where the reload cost is not fitted)."""
    if costs is None and price is None:
        return Estimate(None, None, 0, 0, "estimated", "no J per computed prompt token (needs GPU energy and P_idle)")
    if costs is None:
        def j_c(w, p=price):
            return p(w) if callable(p) else p
        vals = values(j_c, 1.0 - ratio)
        m, se = mean_and_stderr(vals)
        return Estimate(m, se, len(vals), 0, "estimated", note if vals else "no comparable windows")
    fitted_r = costs.reloaded_j is not None and costs.reloaded_se is not None

    def mean_at(c: float, r: float | None) -> tuple[float | None, float | None, int]:
        kept = (1.0 - r / c if c > 0 else 0.0) if fitted_r else 1.0 - ratio
        vals = values(lambda _w: c, kept)
        m, se = mean_and_stderr(vals)
        return m, se, len(vals)
    c0, r0 = costs.prompt_computed_j, costs.reloaded_j
    m, se, n = mean_at(c0, r0)
    if m is None:
        return Estimate(None, None, 0, 0, "estimated", "no comparable windows")
    var = 0.0 if se is None else se * se
    se_c = costs.prompt_computed_se or 0.0
    se_r = costs.reloaded_se or 0.0 if fitted_r else 0.0
    h = max(abs(c0), 1e-12) * 1e-3
    g_c = (mean_at(c0 + h, r0)[0] - m) / h
    g_r = (mean_at(c0, r0 + h)[0] - m) / h if fitted_r else 0.0
    var += g_c * g_c * se_c * se_c + g_r * g_r * se_r * se_r + 2 * g_c * g_r * costs.cov_prompt_reloaded
    return Estimate(m, math.sqrt(max(var, 0.0)) if se is not None else None, n, 0, "estimated", note)


def price_from_roofline(active_parameters: float, flops_per_second: float) -> Callable[[WindowStat], float | None]:
    """J_c per window = (2 * N_act / F) x the window's marginal GPU power: the time the GPU would spend
    recomputing one prompt token at its achieved FLOP rate, at the power it draws above idle while busy.
    Prefill runs near the achieved FLOP rate, so this prices recomputation as compute-bound work, far below
    a decode token's J (docs/offload.md "Energy saving and throughput gain", the `estimated` kind)."""
    seconds_per_token = 2.0 * active_parameters / flops_per_second

    def price(w: WindowStat) -> float | None:
        if w.joules is None or w.covered_seconds <= 0:
            return None
        return seconds_per_token * (w.joules / w.covered_seconds)
    return price

