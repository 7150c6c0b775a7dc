"""The write model learned from the engine (methods.md s4, "The write model, learned"): the post-preemption
recomputation needs the bytes vLLM's write-traffic estimate bills per scheduled token (a) and per token that
gets logits (b). Without preemption every scheduled token is a first-prefill (computed prompt) token or a
generated one, so over a window

    W = c_p x computed + c_g x generated,    c_p = a, c_g = a + b

and the engine's own windows without preemption fit (c_p, c_g) by least squares (no intercept, both >= 0:
phase_energy.nnls), no config.json needed. During preemption the recomputed tokens are then the writes the
counted tokens do not explain, in computed-token bytes: (W - c_p computed - c_g generated) / c_p.

A model's *check* is the median, over windows without preemption, of |W - its prediction| / c_p / scheduled
tokens (the recomputation it would invent where there was none): a config.json's on every window learned, the
fit's on held-out windows (each half of the windows, taken alternately, checked against the fit of the other
half). ``choose`` picks the model the figure uses and its state, re-judged each time a window arrives (a check
that failed passes again at half the tolerance: hysteresis, never a latch). Pure functions, no I/O.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Sequence

from exporter import rules
from exporter.derive import compare
from exporter.derive.phase_energy import condition_number, nnls
from exporter.derive.recompute import IDENTITY_MIN_TOKENS, IDENTITY_TOLERANCE, MIN_SCHEDULED_TOKENS, WriteModel

MIN_WINDOW_TOKENS = MIN_SCHEDULED_TOKENS  # fewer: the whole-token counters' rounding is > 1 % of the ratio
MAX_BYTES_PER_TOKEN = 1e9  # a 405B dense decoder's estimate bills ~54 MB per token: 1 GB/token is a broken counter
# a window ending less than this after one that preempted may hold the resumed requests' re-prefill (a preempted
# request waits for blocks, then computes its context again): not a window without recomputation
GUARD_SECONDS = 30.0
# a fit (provisional) needs this many windows without preemption: two coefficients and one degree of freedom
# (the demo's quiet act gives 3 by the time its engine comes under pressure)
FIT_MIN_WINDOWS = 3
FIT_CHECK_MIN_WINDOWS = 8  # and its held-out check two halves of at least 4
CHECK_MIN_WINDOWS = 3  # any check (passed or failed) rests on this many windows, and IDENTITY_MIN_TOKENS in all
# the mix of computed and generated tokens must vary for the two coefficients to be told apart; the estimate has
# no noise but the chunked-prefill logits rows (< 0.5 %), so a design far more collinear than the energy
# regression's (rules.PHASE_MAX_CONDITION) still fits; the held-out check and the SE say whether it did
MAX_CONDITION = 1e4
MAX_RELATIVE_SE = 0.02  # bytes per computed token known to 2 %: the recomputed tokens scale with its inverse
HALVES_AGREEMENT = 0.02  # and the two halves' fits give it within 2 % of each other (the real engine's: 0.5-0.7 %)
AGREEMENT = 0.05  # a fit and config.json agree when each coefficient is within 5 % (and both checks pass)
# a window the fit misses by 5 % of its tokens (the real engine's windows: under 0.5 %) holds something else: a
# counter glitch, or re-prefill the preemption counter did not show (a resumption the guard missed) ...
OUTLIER = 0.05
MAX_OUTLIER_SHARE = 0.1  # ... set aside while such windows are at most a tenth of them (more: the fit is wrong)
RECOVER = 0.5  # a failed check passes again only within half the tolerance (hysteresis)


@dataclass(frozen=True, kw_only=True)
class WriteWindow:
    """One window without preemption: the engine's estimated write bytes and its counted tokens."""

    writes_bytes: float
    computed: float
    generated: float

    @property
    def scheduled(self) -> float:
        return self.computed + self.generated


def observation(agg, width: float) -> WriteWindow | None:
    """The window's observation: None unless samples cover it, the preemption counter was read and did not move,
    the write estimate and both token counters moved, and its bytes per token could be a model's (a counter that
    jumped is no observation). The caller keeps the guard after a preempted window (GUARD_SECONDS)."""
    if agg.covered_seconds < rules.REPEAT_MIN_COVERED.default * width or agg.delta("preemptions") != 0:
        return None
    writes, computed = agg.delta("engine_write_bytes"), agg.delta("prompt_local_compute")
    generated = agg.delta("generation_tokens")
    if writes is None or computed is None or generated is None:
        return None
    w = WriteWindow(writes_bytes=writes, computed=computed, generated=generated)
    if not (math.isfinite(w.writes_bytes) and math.isfinite(w.scheduled) and w.scheduled >= MIN_WINDOW_TOKENS):
        return None
    return w if 0 < w.writes_bytes <= MAX_BYTES_PER_TOKEN * w.scheduled and min(computed, generated) >= 0 else None


def residual_share(coef: tuple[float, float], w: WriteWindow) -> float:
    """Tokens the model (c_p, c_g) would call recomputed in a window without preemption, per scheduled token."""
    return (w.writes_bytes - coef[0] * w.computed - coef[1] * w.generated) / coef[0] / w.scheduled


def check_residual(coef: tuple[float, float] | None, windows: Sequence[WriteWindow]) -> float | None:
    """The model's check over ``windows``: the median |residual_share| (one glitched window moves it little)."""
    if coef is None or not windows or coef[0] <= 0:
        return None
    return statistics.median(abs(residual_share(coef, w)) for w in windows)


@dataclass(frozen=True, kw_only=True)
class WriteFit:
    """The least-squares fit over the windows without preemption: (c_p, c_g), the windows it used and set aside,
    the design's condition, c_p's relative SE and the held-out check; ``reason`` where there is no fit or no
    held-out check."""

    coefficients: tuple[float, float] | None = None
    windows: int = 0
    set_aside: int = 0
    condition: float | None = None
    relative_se: float | None = None
    held_out: float | None = None
    halves_spread: float | None = None  # |c_p of one half - of the other| / the smaller
    reason: str = ""


def _least_squares(windows: Sequence[WriteWindow]) -> tuple[tuple[float, float], float | None, float] | str:
    """((c_p, c_g), c_p's relative SE, condition), or why there is none."""
    cols = [[w.computed for w in windows], [w.generated for w in windows]]
    cond = condition_number(cols)
    if not cond <= MAX_CONDITION:
        # "inf > 100" where the columns are collinear; NaN has no side of the bound to print
        bound = "undefined" if math.isnan(cond) else compare.op(cond, MAX_CONDITION, ".0f")
        return (f"the mix of computed and generated tokens does not vary enough over the windows without "
                f"preemption to tell their bytes apart (condition {bound})")
    fit = nnls(cols, [w.writes_bytes for w in windows])
    if fit is None or not all(fit.free) or min(fit.coef) <= 0:
        return "the write traffic does not rise with both computed and generated tokens (a coefficient at 0)"
    se = math.sqrt(fit.cov[0][0]) / fit.coef[0] if fit.cov is not None else None
    return (fit.coef[0], fit.coef[1]), se, cond


def fit(windows: Sequence[WriteWindow]) -> WriteFit:
    """The write model from the windows without preemption (oldest first): fitted, the window it misses most set
    aside and the rest fitted again while that window is missed by more than OUTLIER and at most
    MAX_OUTLIER_SHARE of them are set aside; then checked on held-out windows."""
    n = len(windows)
    if n < FIT_MIN_WINDOWS:
        return WriteFit(windows=n, reason=f"{_windows(n)} without preemption so far, a fit needs {FIT_MIN_WINDOWS}")
    kept = list(windows)
    first = _least_squares(kept)
    # the window missed most, set aside while it is missed by more than OUTLIER and few are (a glitch drags the
    # least squares towards itself, so one at a time, the worst first)
    while not isinstance(first, str) and n - len(kept) + 1 <= MAX_OUTLIER_SHARE * n:
        worst = max(range(len(kept)), key=lambda i: abs(residual_share(first[0], kept[i])))
        if abs(residual_share(first[0], kept[worst])) <= OUTLIER:
            break
        del kept[worst]
        first = _least_squares(kept)
    if isinstance(first, str):
        return WriteFit(windows=len(kept), set_aside=n - len(kept), reason=first)
    windows = kept
    coef, se, cond = first
    out = WriteFit(coefficients=coef, windows=len(windows), set_aside=n - len(windows), condition=cond,
                   relative_se=se)
    return _held_out(out, windows)


def _held_out(f: WriteFit, windows: Sequence[WriteWindow]) -> WriteFit:
    """The fit's check: each half of the windows (alternate ones) against the other half's fit."""
    if len(windows) < FIT_CHECK_MIN_WINDOWS:
        return replace(f, reason=f"fitted on {_windows(len(windows))} without preemption, checked on held-out "
                                 f"ones from {FIT_CHECK_MIN_WINDOWS}")
    halves = (windows[0::2], windows[1::2])
    residuals, per_token = [], []
    for fitted_on, held in (halves, halves[::-1]):
        half = _least_squares(fitted_on)
        if isinstance(half, str):
            return replace(f, reason=f"not checked on held-out windows: on half of them {half}")
        residuals += [abs(residual_share(half[0], w)) for w in held]
        per_token.append(half[0][0])
    return replace(f, held_out=statistics.median(residuals),
                   halves_spread=abs(per_token[0] - per_token[1]) / min(per_token))


# --- the model the figure uses ----------------------------------------------------------------------------
def _verdict(residual: float | None, windows: int, tokens: float, before: str) -> str:
    """"passed", "failed" or "" (not checked yet). Passing needs IDENTITY_MIN_TOKENS scheduled tokens (one full
    window can show the identity holds, as on the real engine); failing needs CHECK_MIN_WINDOWS windows too (one
    window holding a resumed request's re-prefill is no evidence against a model). A check that failed passes
    again only within RECOVER x the tolerance, one that passed fails beyond it: hysteresis, never a latch."""
    if residual is None or tokens < IDENTITY_MIN_TOKENS:
        return ""
    limit = IDENTITY_TOLERANCE * (RECOVER if before == "failed" else 1.0)
    if residual <= limit:
        return "passed"
    return "failed" if windows >= CHECK_MIN_WINDOWS else ""


def _coef_words(coef: tuple[float, float]) -> str:
    return f"{coef[0]:,.0f} B per computed token, {coef[1]:,.0f} per generated"


def _model(coef: tuple[float, float], **kw) -> WriteModel:
    """A model from (c_p, c_g): a = c_p, b = c_g - c_p."""
    return WriteModel(bytes_per_token=coef[0], bytes_per_logits_token=coef[1] - coef[0], **kw)


def choose(configured: tuple[float, float] | None, windows: Sequence[WriteWindow], fitted: WriteFit,
           previous: WriteModel | None = None) -> WriteModel:
    """The write model the figure uses (``configured``: config.json's (c_p, c_g), None without one), its state
    and reason, from the windows without preemption and their fit. config.json is used while its check holds
    (exact when it does); the fit replaces it when config.json's check fails, and stands alone without one."""
    before = previous or WriteModel()
    n, tokens = len(windows), sum(w.scheduled for w in windows)
    cfg_res = check_residual(configured, windows)
    cfg = _verdict(cfg_res, n, tokens, before.configured_check) if configured else ""
    fit_ready = (fitted.coefficients is not None and fitted.held_out is not None
                 and fitted.relative_se is not None and fitted.relative_se <= MAX_RELATIVE_SE
                 and fitted.halves_spread is not None and fitted.halves_spread <= HALVES_AGREEMENT)
    fit = _verdict(fitted.held_out, n, tokens, before.fitted_check) if fit_ready else ""
    agrees = None
    if cfg == "passed" and fit == "passed":
        agrees = all(abs(f - c) <= AGREEMENT * c for f, c in zip(fitted.coefficients, configured))
    common = dict(windows=len(windows), fitted=fitted.coefficients, fitted_residual=fitted.held_out,
                  fitted_check=fit, configured=configured, configured_residual=cfg_res, configured_check=cfg,
                  agrees=agrees)
    if cfg == "passed":
        return _model(configured, source="fitted and config.json agree" if agrees else "config.json",
                      state="known", reason=_differ(fitted, configured) if agrees is False else "", **common)
    disagree = (f"config.json's write model ({_coef_words(configured)}) leaves {cfg_res:.1%} of the tokens on "
                f"windows without preemption unexplained: not this engine's shape (tensor or pipeline parallel? "
                f"another KV-cache dtype?)") if cfg == "failed" else ""
    if fitted.coefficients is not None and fit != "failed":
        words = f"fitted ({_coef_words(fitted.coefficients)})"
        if fit == "passed":
            return _model(fitted.coefficients, source="fitted", state="known",
                          reason=f"{disagree}; {words} instead" if disagree else "", **common)
        if cfg == "" and configured:  # config.json not checked yet: it stands, provisional, as before the fit
            return _model(configured, source="config.json", state="provisional",
                          reason=_unchecked(windows, cfg_res), **common)
        why = f"the write model is {words}, not yet checked: {_not_checked(fitted, tokens)}"
        return _model(fitted.coefficients, source="fitted", state="provisional",
                      reason=f"{disagree}; {why}" if disagree else why, **common)
    if configured and cfg == "":
        return _model(configured, source="config.json", state="provisional", reason=_unchecked(windows, cfg_res),
                      **common)
    why = fitted.reason or ""
    if fit == "failed":
        why = (f"the write model fitted on windows without preemption ({_coef_words(fitted.coefficients)}) misses "
               f"held-out ones by {compare.op(100 * fitted.held_out, 100 * IDENTITY_TOLERANCE, '.1f')} % of "
               "their tokens (the most a check allows)")
    if not configured:
        why = f"{why} (or give the model's config.json as servers[].model_config)" if why else why
    return WriteModel(source="", state="unknown", reason="; ".join(x for x in (disagree, why) if x), **common)


def _unchecked(windows: Sequence[WriteWindow], residual: float | None) -> str:
    tokens = sum(w.scheduled for w in windows)
    if residual is not None and tokens >= IDENTITY_MIN_TOKENS:  # missed, on too few windows to say it is wrong
        return (f"config.json's write model misses the windows without preemption by {residual:.1%} of their tokens "
                f"so far ({_windows(len(windows))}; judged from {CHECK_MIN_WINDOWS})")
    return (f"the write model is not yet checked on windows without preemption ({_windows(len(windows))}, "
            f"{tokens:,.0f} of {IDENTITY_MIN_TOKENS:,.0f} tokens)")


def _windows(n: int) -> str:
    return f"{n} window{'' if n == 1 else 's'}"


def _not_checked(f: WriteFit, tokens: float) -> str:
    if f.held_out is None:
        return f.reason
    if tokens < IDENTITY_MIN_TOKENS:
        return f"too few tokens on the windows without preemption (under {IDENTITY_MIN_TOKENS:,.0f})"
    if f.relative_se is None or f.relative_se > MAX_RELATIVE_SE:
        se = "unknown" if f.relative_se is None else f"{f.relative_se:.1%}"
        return f"its bytes per computed token are known to {se}, not yet {MAX_RELATIVE_SE:.0%}"
    if f.halves_spread is not None and f.halves_spread > HALVES_AGREEMENT:
        return (f"the two halves of its windows give bytes per computed token apart by "
                f"{compare.op(100 * f.halves_spread, 100 * HALVES_AGREEMENT, '.1f')} % (the most they may be)")
    return f"it misses held-out windows by {f.held_out:.1%} of their tokens so far"


def _differ(f: WriteFit, configured: tuple[float, float]) -> str:
    return (f"config.json's write model is used; the fit ({_coef_words(f.coefficients)}) differs from it "
            f"({_coef_words(configured)}) by more than {AGREEMENT:.0%} though both explain the windows")
