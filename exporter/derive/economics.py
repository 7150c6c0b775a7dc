"""Energy saving and throughput gain of offloading (methods.md s2), three ways. docs/offload.md "Energy saving and
throughput gain" (the dE kinds).

    dE   = 1 - J/tok_ON / J/tok_OFF, J/tok = total energy / total tokens   (positive = offloading saves energy)
    dTPS = TPS_ON / TPS_OFF - 1,        TPS   = total tokens / total seconds
    SE   = jackknife over the repeat windows (leave one window out), sqrt((n-1)/n sum (theta_-i - theta_.)^2)

Over a window each side's J/token is a ratio of sums over its repeat windows, as the study's per run (a window
in which load starts or stops weighs by its tokens, not as much as a full one); the per-window ratios are the
spread the jackknife reads. The repeat unit is a non-overlapping window (``window_stats``): a bucket of the
store's fixed grid on the shared monotonic clock (exporter/store/buckets.py), so two servers read by the same
daemon tick have the same windows. J/token is the marginal GPU figure of methods.md s1 by default. Every
result carries the number of windows it rests on; SE is None without repeats (fewer than two windows).

- paired:    ON and OFF servers on one node serving the same traffic, compared over the same windows, only
             windows where both carry load.
- recorded:  the live ON server against an OFF profile (`kvwatt baseline record`), band by band of KV p95:
             the ON energy over what the profile's J/token of each window's band gives for the same tokens.
- estimated: no OFF reference. A MODEL, not a measurement: tokens reloaded from the offload tier would
             have been recomputed without it, each priced at J per computed prompt token, minus the cost of
             loading them: the saving of derive/energy.tax_in_energy over the same tokens, seconds and energy.
             ``potential`` likewise prices the tax of a server without offloading. No dTPS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Iterable, NamedTuple, Sequence

from exporter import rules
from exporter.derive.energy import priced_scope
from exporter.derive.marginal import above_idle
from exporter.derive.phase_energy import PhaseCosts, offload_saved_watts, within_energy
from exporter.derive.pressure import kv_usage_quantile
from exporter.derive.recompute import recompute_tax, token_counts
from exporter.store import Bucket, WindowAggregate

DEFAULT_BANDS: tuple[tuple[float, float], ...] = ((0.0, 0.8), (0.8, 0.9), (0.9, 0.95), (0.95, 1.0))


@dataclass(frozen=True, kw_only=True)
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

    @cached_property
    def summed(self) -> "Summed":
        """The summed fields as a pricing reads them (None as 0.0); kept: a repeat window is priced every tick
        for the hour it stays in the window (model/repeat.py keeps the one WindowStat)."""
        return Summed(covered_seconds=self.covered_seconds or 0.0, generated_tokens=self.generated_tokens or 0.0,
                      joules=self.joules or 0.0, computed_prompt_tokens=self.computed_prompt_tokens or 0.0,
                      loaded_prompt_tokens=self.loaded_prompt_tokens or 0.0, prompt_tokens=self.prompt_tokens or 0.0)


@dataclass(frozen=True, kw_only=True)
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
            joules = None if idle is None else above_idle(joules, idle)
    counts = token_counts(agg)
    if counts is None:
        computed = loaded_tokens = prompt = None
    else:
        computed, loaded_tokens = counts["local_compute"], counts["external_kv_transfer"]
        prompt = sum(counts.values())
    return WindowStat(t0=t0, t1=t1, covered_seconds=covered, generated_tokens=gen, joules=joules,
                      kv_p95=kv_usage_quantile(agg, 0.95), computed_prompt_tokens=computed,
                      loaded_prompt_tokens=loaded_tokens,
                      loaded=covered >= rules.REPEAT_MIN_COVERED.default * width and gen > 0, prompt_tokens=prompt)


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


def jackknife_stderr(rows: Sequence[Sequence[float]],
                     estimate: Callable[[Sequence[float]], "float | None"]) -> float | None:
    """Leave-one-window-out (jackknife) SE of ``estimate`` over the column sums of ``rows`` (one row per repeat
    window): SE^2 = (n-1)/n x sum_i (theta_-i - mean theta_-i)^2, theta_-i the estimate from every window but
    the i-th. Deterministic; None below 2 windows or where a leave-one-out estimate is undefined."""
    n = len(rows)
    if n < 2:
        return None
    totals = [math.fsum(col) for col in zip(*rows)]
    return _jackknife([estimate([t - x for t, x in zip(totals, row)]) for row in rows])


def _jackknife(thetas: Sequence["float | None"]) -> float | None:
    """sqrt((n-1)/n x sum (theta_i - mean)^2) of the leave-one-out estimates; None below 2 or with one undefined."""
    n = len(thetas)
    if n < 2 or any(t is None for t in thetas):
        return None
    m = math.fsum(thetas) / n
    return math.sqrt((n - 1) / n * math.fsum((t - m) ** 2 for t in thetas))


def _sum_ratio(rows: Sequence[Sequence[float]], estimate: Callable[[Sequence[float]], "float | None"], kind: str
               ) -> Estimate:
    """``estimate`` of the rows' column sums (a ratio of sums over the repeat windows) and its jackknife SE."""
    value = estimate([math.fsum(col) for col in zip(*rows)]) if rows else None
    if value is None:
        return Estimate(value=None, stderr=None, windows=len(rows), reference_windows=len(rows), kind=kind,
                        note="no comparable windows")
    return Estimate(value=value, stderr=jackknife_stderr(rows, estimate), windows=len(rows),
                    reference_windows=len(rows), kind=kind)


def _energy_saving(sums: Sequence[float]) -> float | None:
    """dE = 1 - (E_ON / N_ON) / (E_OFF / N_OFF) from (E_ON, N_ON, E_OFF, N_OFF): total energy over total tokens
    on each side."""
    e_on, n_on, e_off, n_off = sums
    return 1.0 - (e_on * n_off) / (n_on * e_off) if n_on > 0 and e_off > 0 and n_off > 0 else None


def _throughput_gain(sums: Sequence[float]) -> float | None:
    """dTPS = (N_ON / s_ON) / (N_OFF / s_OFF) - 1 from (N_ON, s_ON, N_OFF, s_OFF)."""
    n_on, s_on, n_off, s_off = sums
    return (n_on * s_off) / (s_on * n_off) - 1.0 if s_on > 0 and n_off > 0 and s_off > 0 else None


def _spent(w: WindowStat) -> bool:
    """A window that can enter dE: a J/token from energy above idle. A window with E <= 0 (a stale P_idle above
    the loaded power) stays out, on every side and in every kind (estimated already did): with it, 1 - on/off
    has no meaning (dE 3.6 against an OFF side at -0.2 J/token)."""
    return w.joules_per_token is not None and w.joules is not None and w.joules > 0


# --------------------------------------------------------------------------------------------------------
# paired
# --------------------------------------------------------------------------------------------------------
def paired(on: Sequence[WindowStat], off: Sequence[WindowStat]) -> tuple[Estimate, Estimate]:
    """(dE, dTPS) over the windows both servers have and in which both carry load: total energy over total
    tokens (tokens over seconds) on each side, a ratio of sums over the pairs, its SE the jackknife over the
    pairs (leave one pair out: the pairing's correlation is kept)."""
    off_by_t0 = {round(w.t0, 6): w for w in off}
    pairs = [(w, off_by_t0[round(w.t0, 6)]) for w in on if round(w.t0, 6) in off_by_t0]
    pairs = [(a, b) for a, b in pairs if a.loaded and b.loaded]
    energy = _sum_ratio([(a.joules, a.generated_tokens, b.joules, b.generated_tokens)
                         for a, b in pairs if _spent(a) and _spent(b)], _energy_saving, "paired")
    tput = _sum_ratio([(a.generated_tokens, a.covered_seconds, b.generated_tokens, b.covered_seconds)
                       for a, b in pairs], _throughput_gain, "paired")
    return energy, tput


# --------------------------------------------------------------------------------------------------------
# recorded (profile bands)
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class BandProfile:
    """One KV-pressure band of an OFF profile: J/token (total energy over total tokens of the band's windows) and
    tokens/s (total tokens over total seconds), each with its jackknife SE over the band's windows. A profile
    recorded before kvwatt 0.x stored per-window means here; the fields are read the same way."""

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


def _per(sums: Sequence[float]) -> float | None:
    """sums[0] / sums[1] (J per token, tokens per second), None over nothing."""
    return sums[0] / sums[1] if sums[1] > 0 else None


def build_bands(windows: Sequence[WindowStat], bands: Sequence[tuple[float, float]] = DEFAULT_BANDS
                ) -> list[BandProfile]:
    """Aggregate loaded windows into per-band ratios of sums (what `kvwatt baseline record` stores)."""
    out = []
    for i, (lo, hi) in enumerate(bands):
        ws = [w for w in windows if w.loaded and band_of(bands, w.kv_p95) == i]
        j = _sum_ratio([(w.joules, w.generated_tokens) for w in ws if _spent(w)], _per, "")  # never <= 0
        t = _sum_ratio([(w.generated_tokens, w.covered_seconds) for w in ws], _per, "")
        out.append(BandProfile(lo=lo, hi=hi, windows=len(ws), joules_per_token=j.value,
                               joules_per_token_stderr=j.stderr, tokens_per_second=t.value,
                               tokens_per_second_stderr=t.stderr))
    return out


def _against_profile(rows: Sequence[tuple[float, float, int]], reference: dict[int, tuple[float, float | None]]
                     ) -> tuple[float | None, float | None]:
    """r = sum(num) / sum_b(den_b x x_b) over the ON windows ``rows`` (num, den, band): what the ON server did
    against what the OFF profile's band x_b (J/token, tokens/s) gives for the same tokens (seconds). SE^2 = the
    jackknife's over the ON windows + sum_b (dr/dx_b SE_b)^2 (the profile independent of the live run)."""
    bands = sorted(reference)

    def ratio(sums: Sequence[float]) -> float | None:
        base = math.fsum(sums[1 + k] * reference[b][0] for k, b in enumerate(bands))
        return sums[0] / base if base > 0 else None

    table = [(num, *(den if band == b else 0.0 for b in bands)) for num, den, band in rows]
    sums = [math.fsum(col) for col in zip(*table)]
    r = ratio(sums) if table else None
    if r is None:
        return None, None
    se = jackknife_stderr(table, ratio)
    if se is None or any(reference[b][1] is None for b in bands):
        return r, None
    base = math.fsum(sums[1 + k] * reference[b][0] for k, b in enumerate(bands))
    var = se * se + math.fsum((r * sums[1 + k] / base * reference[b][1]) ** 2 for k, b in enumerate(bands))
    return r, math.sqrt(var)


def recorded(on: Sequence[WindowStat], profile: Sequence[BandProfile]) -> tuple[Estimate, Estimate]:
    """(dE, dTPS) of the live ON windows against the OFF profile, band by band of the ON window's KV p95: the ON
    server's total energy over the energy the profile's J/token of each window's band gives for the same tokens
    (tokens/s likewise over seconds), so a band weighs by its tokens (seconds); ``bands`` gives each band's own.
    A band without profile data is skipped (and named in ``note``)."""
    results = {}
    for what, num_den, get_off, sign in (
            ("energy", lambda w: (w.joules, w.generated_tokens) if _spent(w) else None,
             lambda b: (b.joules_per_token, b.joules_per_token_stderr), 1.0),
            ("throughput", lambda w: (w.generated_tokens, w.covered_seconds),
             lambda b: (b.tokens_per_second, b.tokens_per_second_stderr), -1.0)):
        rows, reference, bands, skipped, ref = [], {}, {}, [], 0
        for i, b in enumerate(profile):
            mine = [num_den(w) for w in on if w.loaded and band_of(profile, w.kv_p95) == i]
            mine = [(num, den, i) for num, den in (x for x in mine if x is not None)]
            if not mine:
                continue
            x_off, se_off = get_off(b)
            if x_off is None or x_off <= 0:  # an OFF band with no energy above idle (or a rate of 0) compares nothing
                skipped.append(b.label)
                continue
            v, se = _against_profile(mine, {i: (x_off, se_off)})
            rows += mine
            reference[i] = (x_off, se_off)
            ref += b.windows
            bands[b.label] = {"value": None if v is None else sign * (1.0 - v), "stderr": se, "windows": len(mine),
                              "reference_windows": b.windows}
        r, se = _against_profile(rows, reference) if rows else (None, None)
        note = f"no OFF profile data for band(s) {', '.join(skipped)}" if skipped else ""
        if r is None and not note:
            note = "no comparable windows"
        results[what] = Estimate(value=None if r is None else sign * (1.0 - r), stderr=se, windows=len(rows),
                                 reference_windows=ref, kind="recorded", note=note, bands=bands)
    return results["energy"], results["throughput"]


# --------------------------------------------------------------------------------------------------------
# estimated and potential (token-source model), priced as the tax and the saving are (derive/energy.tax_in_energy)
# --------------------------------------------------------------------------------------------------------
def scope_stat(agg: WindowAggregate, scope: str = "gpu") -> WindowStat | None:
    """The whole window as the recomputation tax and the saving price it (derive/energy.tax_in_energy, rule 10):
    tokens, seconds and marginal energy of the intervals carrying the scope's energy and P_idle. None when the
    scope has no such intervals or no prompt tokens by source."""
    scoped = priced_scope(agg, scope)
    if scoped is None:
        return None
    used, counts = scoped
    return WindowStat(t0=0.0, t1=used.covered_seconds, covered_seconds=used.covered_seconds,
                      generated_tokens=used.delta("generation_tokens") or 0.0,
                      joules=above_idle(used.energy_joules, used.idle_joules), kv_p95=None,
                      computed_prompt_tokens=counts["local_compute"],
                      loaded_prompt_tokens=counts["external_kv_transfer"], loaded=True,
                      prompt_tokens=sum(counts.values()))


_SUMMED = ("covered_seconds", "generated_tokens", "joules", "computed_prompt_tokens", "loaded_prompt_tokens",
           "prompt_tokens")


class Summed(NamedTuple):
    """A window's summed fields (_SUMMED, None read as 0.0): what a pricing (``saving``, ``price``) reads of a
    WindowStat. The jackknife prices ``whole`` less each repeat window: at 64 servers and a 1 h window that is
    ~7,700 leave-one-out sums a tick, so they are plain tuples, not WindowStat copies (dataclasses.replace cost
    a third of the tick at 64 servers, bench/tick_phases.py)."""

    covered_seconds: float
    generated_tokens: float
    joules: float
    computed_prompt_tokens: float
    loaded_prompt_tokens: float
    prompt_tokens: float


def _summed(w: WindowStat | Summed) -> Summed:
    return w if type(w) is Summed else w.summed


PriceOf = Callable[[WindowStat], "float | None"]
Saving = Callable[[WindowStat, PhaseCosts], "tuple[float, float] | None"]  # (joules saved, OFF joules)


def estimated(on: Sequence[WindowStat], price: float | PriceOf | None, load_to_compute_cost_ratio: float,
              costs: PhaseCosts | None = None, whole: WindowStat | None = None) -> Estimate:
    """ESTIMATE. saved = reloaded tokens x (J_c - J_r), the saving of derive/energy.tax_in_energy
    (kvwatt_offload_saved_watts x seconds); E_OFF(est) = E_ON + saved; dE = saved / (E_ON + saved), each a sum
    over the window (``whole``: scope_stat of the window, the saving's own tokens and energy; else the sum of
    the repeat windows ``on``). J_c and J_r: ``costs`` (measured or prior, the tax's), capped at the window's
    energy (phase_energy.within_energy); without usable costs ``price`` (a number or per window,
    price_from_roofline) and J_r = ratio x J_c. SE: the jackknife over the repeat windows, with a measured
    cost's SE carried in (the delta method). Assumptions in docs/offload.md."""
    def saving(s: WindowStat, c: PhaseCosts) -> tuple[float, float] | None:
        if s.joules is None or s.loaded_prompt_tokens is None:
            return None
        priced = within_energy(c, s.joules, s.computed_prompt_tokens or 0.0, s.loaded_prompt_tokens)
        saved = offload_saved_watts(s.loaded_prompt_tokens, priced, load_to_compute_cost_ratio)
        return None if saved is None else (saved, s.joules + saved)

    usable = [w for w in on if w.loaded and w.joules is not None and w.joules > 0
              and w.loaded_prompt_tokens is not None]
    return _priced(usable, whole, saving, price, costs, "model estimate: reloaded tokens priced as recomputation")


def potential(off: Sequence[WindowStat], reference_share: float | None, price: float | PriceOf | None,
              load_to_compute_cost_ratio: float, costs: PhaseCosts | None = None,
              whole: WindowStat | None = None) -> Estimate:
    """ESTIMATE for a server running WITHOUT offloading: what enabling it would save. The prompt tokens it
    computed above its low-pressure local_compute share (the recomputation tax, methods.md s4) are the ones an
    offload tier would have reloaded instead (the study saw offloading move exactly that share into
    external_kv_transfer). saved = tax tokens x (J_c - J_r), the tax of derive/energy.tax_in_energy at the same
    capped price (so saved = (1 - J_r/J_c) x the tax's joules) and, since the measured server is the OFF one,
    dE = saved / E_OFF = (1 - J_r/J_c) x kvwatt_recompute_energy_share_ratio of the same window and scope. Sums
    over ``whole`` (else the repeat windows); SE as ``estimated``. Needs a reference share (learned from
    low-pressure windows, or configured) and a J_c price."""
    if reference_share is None:
        return Estimate(value=None, stderr=None, windows=0, reference_windows=0, kind="estimated",
                        note="no low-pressure reference share yet (learned or configured)")

    def saving(s: WindowStat, c: PhaseCosts) -> tuple[float, float] | None:
        if s.joules is None or s.computed_prompt_tokens is None or not s.prompt_tokens or s.prompt_tokens <= 0:
            return None
        priced = within_energy(c, s.joules, s.computed_prompt_tokens, s.loaded_prompt_tokens or 0.0)
        tax_share = recompute_tax(s.computed_prompt_tokens / s.prompt_tokens, reference_share)
        saved = offload_saved_watts(max(tax_share, 0.0) * s.prompt_tokens, priced, load_to_compute_cost_ratio)
        return None if saved is None else (saved, s.joules)

    usable = [w for w in off if w.loaded and w.joules is not None and w.joules > 0
              and w.computed_prompt_tokens is not None and w.prompt_tokens]
    return _priced(usable, whole, saving, price, costs,
                   "model estimate: the recomputation tax priced as what offloading would reload")


def _priced(windows: Sequence[WindowStat], whole: WindowStat | None, saving: Saving, price, costs: PhaseCosts | None,
            note: str) -> Estimate:
    """dE = saved / E_OFF over ``whole`` (None: the sum of ``windows``) at the costs; SE^2 = the jackknife's over
    ``windows`` (leave one repeat window out of the whole) + g' V g with measured costs: g the gradient of dE in
    (J_c, J_r) by finite differences, V their covariance from the regression (the delta method; J_r = ratio x
    J_c where the reload cost is not fitted)."""
    if (costs is None or not costs.usable) and price is None:
        return Estimate(value=None, stderr=None, windows=0, reference_windows=0, kind="estimated",
                        note="no J per computed prompt token (needs GPU energy and P_idle)")
    if not windows and whole is None:
        return Estimate(value=None, stderr=None, windows=0, reference_windows=0, kind="estimated",
                        note="no comparable windows")
    # With ``whole`` the value needs no repeat window: it is priced on the window's own sums, as the tax share
    # beside it is (a 30 s window often holds no whole repeat window; dE unknown beside a tax shown broke the
    # relation dE = (1 - J_r/J_c) x share). The SE needs two (the jackknife), so it is unknown below that.
    if whole is None and len(windows) == 1:
        whole = windows[0]
    elif whole is None:  # the windows' sum, field by field in their order
        c, g, j, p, r, t = windows[0].summed
        for w in [w.summed for w in windows[1:]]:
            c, g, j, p, r, t = c + w[0], g + w[1], j + w[2], p + w[3], r + w[4], t + w[5]
        whole = Summed(covered_seconds=c, generated_tokens=g, joules=j, computed_prompt_tokens=p,
                       loaded_prompt_tokens=r, prompt_tokens=t)

    usable = costs is not None and costs.usable
    # the costs every window is priced at, built once (a window per tick of the hour is priced; see Summed)
    fixed = (costs if usable else None if price is None or callable(price)
             else PhaseCosts(scope="gpu", prompt_computed_j=price))

    def at(s: WindowStat | Summed, c_j: float | None = None, r_j: float | None = None) -> float | None:
        """dE over ``s``; ``c_j``, ``r_j``: the costs moved (finite differences)."""
        if fixed is not None and c_j is None and r_j is None:
            c = fixed
        elif usable:
            c = costs if c_j is None and r_j is None else replace(
                costs, prompt_computed_j=c_j if c_j is not None else costs.prompt_computed_j,
                reloaded_j=r_j if r_j is not None else costs.reloaded_j)
        else:
            p = price(s) if callable(price) else price
            if p is None:
                return None
            c = PhaseCosts(scope="gpu", prompt_computed_j=p)
        x = saving(s, c)
        return x[0] / x[1] if x is not None and x[1] > 0 else None

    value = at(whole)
    if value is None:
        return Estimate(value=None, stderr=None, windows=len(windows), reference_windows=0, kind="estimated",
                        note="no comparable windows")
    c, g, j, p, r, t = _summed(whole)
    se = _jackknife([at(Summed(covered_seconds=c - w[0], generated_tokens=g - w[1], joules=j - w[2],
                               computed_prompt_tokens=p - w[3], loaded_prompt_tokens=r - w[4], prompt_tokens=t - w[5]))
                     for w in [w.summed for w in windows]])  # the whole less each window
    if se is not None and costs is not None and costs.source == "measured":
        se = math.sqrt(se * se + _price_variance(costs, value, at, whole))
    return Estimate(value=value, stderr=se, windows=len(windows), reference_windows=0, kind="estimated", note=note)


def _price_variance(costs: PhaseCosts, value: float, at, whole: WindowStat) -> float:
    """g' V g: dE's variance from the measured costs' (finite differences in J_c and, where fitted, J_r)."""
    fitted_r = costs.reloaded_j is not None and costs.reloaded_se is not None
    c0, r0 = costs.prompt_computed_j, costs.reloaded_j
    h = max(abs(c0), 1e-12) * 1e-3
    g_c = ((at(whole, c_j=c0 + h) or value) - value) / h
    g_r = ((at(whole, r_j=r0 + h) or value) - value) / h if fitted_r else 0.0
    se_c, se_r = costs.prompt_computed_se or 0.0, (costs.reloaded_se or 0.0) if fitted_r else 0.0
    return max(g_c * g_c * se_c * se_c + g_r * g_r * se_r * se_r + 2 * g_c * g_r * costs.cov_prompt_reloaded, 0.0)


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

