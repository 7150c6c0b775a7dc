"""Measured per-phase energy costs (methods.md s12): marginal J per computed prompt token, per generated token
and per reloaded token, from a regression over non-overlapping windows.

Each completed window w of the repeat grid (store/buckets.py) is one observation:

    E_w - P_idle*dt_w = c_p * computed_w + c_g * generated_w + c_r * reloaded_w + e_w

computed = local_compute prompt tokens, reloaded = external_kv_transfer (recompute.token_counts), generated =
generation tokens; E the scope's energy (gpu or host). No intercept: the idle power is already subtracted
(a stale P_idle shows up as bias, methods.md s12 "failure modes"). The costs are constrained to be >= 0 (an
exact active-set NNLS: with at most 3 regressors every subset is tried); SE from the residual variance and
(X'X)^-1 of the coefficients left free. The reloaded column is fitted only when offloading moved tokens.

"Not identifiable" (with the reason) when there are too few windows or the prompt/generated mix does not vary
enough to tell the costs apart: the condition number of the column-normalised X'X is above a rule
(exporter/rules/__init__.py PHASE_MAX_CONDITION); a constant mix makes the columns proportional (condition -> inf).
Until then the configured attribution model (energy.prompt_attribution) is the documented ``prior``.
The fit reads only X'X, X'y and y'y (and one pass over the rows for the chosen fit's residual): the learner
keeps them as its windows come and go (PhaseSums), so a refit at a full history (720 windows of 30 s in 6 h)
costs about what one at 60 windows does (bench/phase_refit.py).
Pure functions, no numpy (not a daemon dependency).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from operator import add, mul, sub
from typing import Iterable, NamedTuple, Sequence

from exporter import rules
from exporter.derive import compare
from exporter.derive.marginal import above_idle
from exporter.derive.recompute import token_counts
from exporter.results import PhaseCosts
from exporter.store import Bucket

# The prior's price of a computed prompt token, as a fraction of a generated one (methods.md s12 "prior"): prefill
# is batched and compute-bound, decode memory-bound. On the roofline, a prompt token costs 2 N_act / F of GPU time
# and a generated one, at decode batch B, the weights' read 2 N_act bytes / (B x memory bandwidth) (bf16), so
# prompt / generated = B x bandwidth / F: an H100 SXM (3.35 TB/s, 989 dense bf16 TFLOP/s) at B = 64 gives 0.22;
# the power double of tests/phase_double.py (H100-like measured orders, 0.03 vs 0.4 J) 0.075. 0.2 sits between,
# leaning high (never cheaper than the roofline at a typical batch): the prior stays a guess until measured.
PRIOR_PROMPT_TO_GENERATED_COST_RATIO = 0.2


@dataclass(frozen=True)
class PhaseWindow:
    """One window's marginal energy (J) of one scope and its token counts by phase."""

    joules: float
    computed: float
    generated: float
    reloaded: float


def observation(bucket: Bucket, width: float, scope: str) -> PhaseWindow | None:
    """The bucket's observation for ``scope``: None unless samples cover the window, every interval has the
    scope's energy and idle energy, prompt tokens by source are known, and some token was processed."""
    agg = bucket.agg
    if agg.covered_seconds < rules.REPEAT_MIN_COVERED.default * width:
        return None
    used = agg.scope(scope)
    if used is None or used.n != agg.n or used.idle_joules is None:
        return None
    counts = token_counts(agg)
    if counts is None:
        return None
    gen = agg.delta("generation_tokens") or 0.0
    w = PhaseWindow(above_idle(used.energy_joules, used.idle_joules), counts["local_compute"], gen,
                    counts["external_kv_transfer"])
    return w if w.computed + w.generated + w.reloaded > 0 else None


def observations(buckets: Iterable[Bucket], width: float, scope: str) -> list[PhaseWindow]:
    return [o for o in (observation(b, width, scope) for b in buckets) if o is not None]


# --- small dense linear algebra (k <= 3) ---------------------------------------------------------------
def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gauss-Jordan with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12 * max(1.0, max(abs(x) for row in a for x in row)):
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _inverse(a: list[list[float]]) -> list[list[float]] | None:
    cols = [_solve(a, [1.0 if i == j else 0.0 for i in range(len(a))]) for j in range(len(a))]
    if any(c is None for c in cols):
        return None
    return [[cols[j][i] for j in range(len(a))] for i in range(len(a))]


def _gram(cols: Sequence[Sequence[float]]) -> list[list[float]]:
    """X'X: each sum once (the matrix is symmetric), added in row order."""
    g = [[0.0] * len(cols) for _ in cols]
    for i, a in enumerate(cols):
        for j in range(i, len(cols)):
            g[i][j] = g[j][i] = sum(map(mul, a, cols[j]))
    return g


def _eigen_sym(a: list[list[float]], sweeps: int = 50) -> list[float]:
    """Eigenvalues of a small symmetric matrix (cyclic Jacobi)."""
    n = len(a)
    m = [row[:] for row in a]
    for _ in range(sweeps):
        off = sum(m[i][j] ** 2 for i in range(n) for j in range(n) if i != j)
        if off < 1e-24:
            break
        for p in range(n):
            for q in range(p + 1, n):
                if abs(m[p][q]) < 1e-300:
                    continue
                theta = (m[q][q] - m[p][p]) / (2 * m[p][q])
                t = math.copysign(1.0, theta) / (abs(theta) + math.sqrt(theta * theta + 1))
                c = 1 / math.sqrt(t * t + 1)
                s = t * c
                for k in range(n):
                    mkp, mkq = m[k][p], m[k][q]
                    m[k][p], m[k][q] = c * mkp - s * mkq, s * mkp + c * mkq
                for k in range(n):
                    mpk, mqk = m[p][k], m[q][k]
                    m[p][k], m[q][k] = c * mpk - s * mqk, s * mpk + c * mqk
    return [m[i][i] for i in range(n)]


def condition_number(cols: Sequence[Sequence[float]]) -> float:
    """Condition number of X'X with each column scaled to unit length (scale-free); inf when singular."""
    return _condition_of(_gram(cols))


def _condition_of(g: list[list[float]]) -> float:
    """condition_number from X'X itself: the unit-length columns' Gram matrix is g_ij / sqrt(g_ii g_jj)."""
    norms = [math.sqrt(g[i][i]) for i in range(len(g))]
    if any(n == 0 for n in norms):
        return math.inf
    eig = _eigen_sym([[g[i][j] / (norms[i] * norms[j]) for j in range(len(g))] for i in range(len(g))])
    lo, hi = min(eig), max(eig)
    return math.inf if lo <= 1e-12 * hi else hi / lo


# --- the fit --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fit:
    coef: tuple[float, ...]
    cov: tuple[tuple[float, ...], ...] | None  # over all columns; 0 rows/cols for pinned coefficients
    free: tuple[bool, ...]
    rss: float


class Normal(NamedTuple):
    """The regression's sufficient statistics, one pass over the rows: X'X, X'y, y'y."""

    g: list[list[float]]
    xy: list[float]
    yy: float

    @classmethod
    def of(cls, cols: Sequence[Sequence[float]], y: Sequence[float]) -> "Normal":
        return cls(_gram(cols), [sum(map(mul, c, y)) for c in cols], sum(map(mul, y, y)))


class PhaseSums:
    """X'X, X'y and y'y of a learner's windows kept as they come and go (columns computed, generated, reloaded;
    y the joules), so a refit reads them instead of passing over up to PHASE_HISTORY / width rows (720 at the
    defaults) for every scope of every server each time a window completes. Added in row order, the sums are
    the very ones a pass over the rows gives; each removal's rounding is undone by a recount over the rows
    kept once as many windows have left as it holds (``recount``)."""

    __slots__ = ("g", "xy", "yy", "reloading", "removed")

    def __init__(self) -> None:
        self.g = [[0.0] * 3 for _ in range(3)]  # upper triangle
        self.xy, self.yy, self.reloading, self.removed = [0.0] * 3, 0.0, 0, 0

    @classmethod
    def of(cls, windows: Iterable[PhaseWindow]) -> "PhaseSums":
        sums = cls()
        for w in windows:
            sums.add(w)
        return sums

    def add(self, w: PhaseWindow) -> None:
        self._fold(w, 1.0)

    def remove(self, w: PhaseWindow) -> None:
        self._fold(w, -1.0)
        self.removed += 1

    def _fold(self, w: PhaseWindow, sign: float) -> None:
        """Each product added (sign 1) or taken away (-1): x * sign is exact, so adding is a pass's very sum."""
        x, g = (w.computed, w.generated, w.reloaded), self.g
        for i in range(3):
            for j in range(i, 3):
                g[i][j] += x[i] * x[j] * sign
            self.xy[i] += x[i] * w.joules * sign
        self.yy += w.joules * w.joules * sign
        self.reloading += int(sign) * (w.reloaded > 0)

    def recount(self, kept: Sequence[PhaseWindow]) -> "PhaseSums":
        """Itself, or the sums counted afresh over ``kept`` once len(kept) windows have been removed."""
        return PhaseSums.of(kept) if self.removed >= max(len(kept), 1) else self

    def normal(self, columns: Sequence[int]) -> Normal:
        g = self.g
        return Normal([[g[min(i, j)][max(i, j)] for j in columns] for i in columns], [self.xy[i] for i in columns],
                      self.yy)


def _ols(n: Normal, subset: Sequence[int]):
    """The OLS fit on ``subset`` from the normal equations: its X'X and X'y are the submatrices (the very sums a
    per-subset pass would add), its residual sum of squares y'y - b'X'y (b solves them; used to choose, not
    reported: its rounding is ~1e-16 y'y, see nnls)."""
    g = [[n.g[i][j] for j in subset] for i in subset]
    b = _solve(g, [n.xy[i] for i in subset])
    if b is None:
        return None
    return b, g, n.yy - sum(bi * n.xy[i] for bi, i in zip(b, subset))


def _rss(xs: Sequence[Sequence[float]], b: Sequence[float], y: Sequence[float]) -> float:
    """sum over the rows of (y - X b)^2, a row's fitted value added column by column as sum() adds it (the
    same rounding as the per-row sum, at a third of its cost: map, not a generator per row)."""
    fitted: Iterable[float] = [0.0] * len(y)
    for bi, c in zip(b, xs):
        fitted = list(map(add, fitted, map(mul, itertools.repeat(bi), c)))
    return sum(map(pow, map(sub, y, fitted), itertools.repeat(2)))


def nnls(cols: Sequence[Sequence[float]], y: Sequence[float], normal: Normal | None = None) -> Fit | None:
    """min ||y - X b|| subject to b >= 0, exactly, by trying every subset of free columns (k <= 3): the NNLS
    optimum is the OLS fit on its free set, and every non-negative subset fit is feasible, so the feasible
    fit with the least residual is it. Every subset is solved from one pass's normal equations (``normal``,
    made here when not given); the chosen fit's residual is then summed over the rows (the SEs rest on it)."""
    n = normal or Normal.of(cols, y)
    k, best = len(cols), None
    slack = 1e-13 * n.yy  # the normal-equation residuals' rounding: nearer than this is a tie, the larger set wins
    for size in range(k, 0, -1):
        for subset in itertools.combinations(range(k), size):
            r = _ols(n, subset)
            if r is None or any(v < 0 for v in r[0]):
                continue
            if best is None or r[2] < best[0][2] - 1e-12 * max(1.0, abs(r[2])) - slack:
                best = (r, subset)
    if best is None:
        return None
    (b, g, _), subset = best
    rss = _rss([cols[i] for i in subset], b, y)
    coef = [0.0] * k
    for i, v in zip(subset, b):
        coef[i] = v
    dof = len(y) - len(subset)
    inv = _inverse(g)
    cov = None
    if inv is not None and dof > 0:
        s2 = rss / dof
        full = [[0.0] * k for _ in range(k)]
        for a, i in enumerate(subset):
            for c, j in enumerate(subset):
                full[i][j] = s2 * inv[a][c]
        cov = tuple(tuple(r) for r in full)
    return Fit(tuple(coef), cov, tuple(i in subset for i in range(k)), rss)


def estimate(windows: Sequence[PhaseWindow], scope: str, min_windows: int, max_condition: float,
             load_to_compute_cost_ratio: float, sums: PhaseSums | None = None) -> PhaseCosts:
    """The measured costs when identifiable, else the prior with the reason (state not_identifiable, or
    unknown without any window). ``sums``: the windows' running sums when the caller keeps them (PhaseSums)."""
    n = len(windows)
    if n == 0:
        return PhaseCosts(scope=scope, state="unknown",
                          reason=f"no window with {scope} energy, P_idle and token sources")
    if n < min_windows:
        return _not(prior_costs(windows, scope, load_to_compute_cost_ratio), n, f"{n} windows, needs {min_windows}")
    sums = sums or PhaseSums.of(windows)
    with_reload = sums.reloading >= min_windows
    names = ["prompt_computed", "generated"] + (["reloaded"] if with_reload else [])
    normal = sums.normal(range(len(names)))  # the condition number and every subset's fit read it
    cond = _condition_of(normal.g)
    if not cond <= max_condition:
        return _not(prior_costs(windows, scope, load_to_compute_cost_ratio), n,
                    _collinear_reason(normal.g, names, cond, max_condition), cond)
    cols = [[w.computed for w in windows], [w.generated for w in windows]]
    if with_reload:
        cols.append([w.reloaded for w in windows])
    y = [w.joules for w in windows]
    fit = nnls(cols, y, normal)
    if fit is None or fit.cov is None:
        return _not(prior_costs(windows, scope, load_to_compute_cost_ratio), n, "the regression has no solution",
                    cond)
    if fit.coef[0] <= 0 and fit.coef[1] <= 0:
        return _not(prior_costs(windows, scope, load_to_compute_cost_ratio), n,
                    "no energy rises with tokens (P_idle above the loaded power?)", cond)
    se = [math.sqrt(fit.cov[i][i]) if fit.free[i] else None for i in range(len(names))]
    out = {f"{p}_j": fit.coef[i] for i, p in enumerate(names)} | {f"{p}_se": se[i] for i, p in enumerate(names)}
    return PhaseCosts(scope=scope, **out, windows=n, state="known", source="measured", condition=cond,
                      cov_prompt_reloaded=fit.cov[0][2] if with_reload else 0.0,
                      reason="" if with_reload else "no reloaded tokens in enough windows: reloaded cost not fitted")


def _not(prior: PhaseCosts, n: int, reason: str, cond: float | None = None) -> PhaseCosts:
    if not prior.usable and prior.reason:
        reason = f"{reason}; no prior either: {prior.reason}"
    return PhaseCosts(scope=prior.scope, prompt_computed_j=prior.prompt_computed_j, prompt_computed_se=None,
                      generated_j=prior.generated_j, generated_se=None, reloaded_j=prior.reloaded_j, reloaded_se=None,
                      windows=n, state="not_identifiable", reason=reason, source="prior", condition=cond)


def _collinear_reason(g: list[list[float]], names, cond: float, max_condition: float) -> str:
    """Name the pair of columns closest to proportional (cosine of the uncentred columns, from X'X)."""
    best, pair = -1.0, (names[0], names[1])
    for i, j in itertools.combinations(range(len(g)), 2):
        ni, nj = math.sqrt(g[i][i]), math.sqrt(g[j][j])
        c = 1.0 if ni == 0 or nj == 0 else g[i][j] / (ni * nj)
        if c > best:
            best, pair = c, (names[i], names[j])
    return (f"the token mix does not vary enough: {pair[0]} and {pair[1]} tokens move together "
            f"(cosine {best:.3f}, condition {compare.op(cond, max_condition, '.0f')})")


def prior_costs(windows: Sequence[PhaseWindow], scope: str, load_to_compute_cost_ratio: float) -> PhaseCosts:
    """The prior over the windows: a generated token costs one unit, a computed prompt token
    PRIOR_PROMPT_TO_GENERATED_COST_RATIO of a unit, a reloaded one ``load_to_compute_cost_ratio`` of a computed
    one; the windows' marginal energy is shared over the units. Not a measurement."""
    joules = sum(w.joules for w in windows)
    p = PRIOR_PROMPT_TO_GENERATED_COST_RATIO
    units = sum(w.generated + p * w.computed + p * load_to_compute_cost_ratio * w.reloaded for w in windows)
    if units <= 0:
        return PhaseCosts(scope=scope, state="unknown", reason="no tokens")
    if joules <= 0:  # no price, rather than a negative one
        return PhaseCosts(scope=scope, state="unknown", reason="marginal energy not positive (P_idle above the loaded "
                          "power: stale?)")
    u = joules / units
    return PhaseCosts(scope=scope, prompt_computed_j=p * u, prompt_computed_se=None, generated_j=u, generated_se=None,
                      reloaded_j=load_to_compute_cost_ratio * p * u, reloaded_se=None, windows=len(windows),
                      state="unknown", reason="", source="prior")


def within_energy(costs: PhaseCosts, marginal_joules: float, computed: float, reloaded: float) -> PhaseCosts | None:
    """The costs as a window may price its prompt tokens: never beyond its own energy. A computed or reloaded
    prompt token costs at most the window's marginal joules over its computed + reloaded prompt tokens (what each
    would cost if every joule had gone to them; both scaled by one factor), so the tax (tax tokens <= computed
    tokens) is at most the window's marginal energy, and the saving (reloaded tokens x the price difference)
    too. None: the window spent
    no energy above idle (a stale P_idle), so it prices nothing."""
    if marginal_joules <= 0 or not costs.usable:
        return None
    tokens = computed + reloaded
    top = max(costs.prompt_computed_j, costs.reloaded_j or 0.0)
    if tokens <= 0 or top * tokens <= marginal_joules:
        return costs
    f = marginal_joules / (tokens * top)  # both scaled alike: the reload keeps its ratio to the computation
    return replace(costs, prompt_computed_j=costs.prompt_computed_j * f,
                   reloaded_j=None if costs.reloaded_j is None else costs.reloaded_j * f)


# --- the tax in energy ----------------------------------------------------------------------------------
def recompute_tax_watts(tax_share: float | None, prompt_tokens_per_second: float | None,
                        costs: PhaseCosts | None) -> float | None:
    """W spent recomputing the tax's prompt tokens: tax share (of all prompt tokens, methods.md s4) x prompt
    tokens/s x J per computed prompt token. A negative tax (less recomputed than the reference) gives 0."""
    if tax_share is None or prompt_tokens_per_second is None or costs is None or not costs.usable:
        return None
    return max(tax_share, 0.0) * prompt_tokens_per_second * costs.prompt_computed_j


def offload_saved_watts(reloaded_tokens_per_second: float | None, costs: PhaseCosts | None,
                        load_to_compute_cost_ratio: float) -> float | None:
    """W offloading saves: reloaded tokens/s x (J per computed - J per reloaded prompt token); the reload cost
    is the measured one when fitted, else the configured ratio of the computed cost."""
    if reloaded_tokens_per_second is None or costs is None or not costs.usable:
        return None
    j_c = costs.prompt_computed_j
    j_r = costs.reloaded_j if costs.reloaded_j is not None else load_to_compute_cost_ratio * j_c
    return reloaded_tokens_per_second * (j_c - j_r)
