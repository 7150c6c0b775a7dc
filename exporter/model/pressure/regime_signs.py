"""Pure functions of the KV-pressure regime (methods.md s10): a window's KV p95 with its interval, the regime
with hysteresis, the signs of pressure and of its absence, and the verdict with its state and reason; and the
constants the learners share."""

from __future__ import annotations

from dataclasses import dataclass

from exporter import rules
from exporter.derive import compare, pressure
from exporter.derive.pressure_evidence import (  # noqa: F401 (their home; the package's face re-exports them)
    MIN_PROMPT_TOKENS,
    P95,
    ResidencySign,
    WindowEvidence,
    p95_of,
    residency_sign,
)
from exporter.derive.threshold import LOW_PRESSURE_MAX, LocatedThreshold, noise_bar, plural, taxed
from exporter.store import WindowAggregate

REFERENCE_MARGIN = 0.05     # a learning window's p95 stays this far under the threshold in force
LOW_PRESSURE_P95 = 0.50     # ... and under this absolute KV p95 (methods.md s10: below every onset seen)
# LOW_PRESSURE_MAX (derive/threshold.py): ... and its KV max under this (a window that touched 80 % came near
# preempting)
REFERENCE_KNOWN_WINDOWS = 3  # low-pressure windows before the reference is known (fewer: provisional)
SUSTAINED_PREEMPTIONS = 3.0  # preemptions in a window that make it a full window of pressure evidence
MAX_EVIDENCE_WEIGHT = 1.0   # a full window's weight: no window, live or stored, weighs more
# MIN_PROMPT_TOKENS (derive/pressure_evidence.py): fewer prompt tokens in a window: its share is not worth a point
MIN_BELOW_COVERAGE = 0.5    # a regime window less covered than this cannot say "below" (start, restart)
QUIET_KNOWN_WINDOWS = 3     # consecutive clean evidence windows before a "below" is known (methods.md s10)
MAX_EVIDENCE_WINDOWS = 10_000  # bounds memory and the sort in locate whatever history / window asks


def disagreement(sign: ResidencySign | None, preemptions_per_minute: float | None, taxed_: bool,
                 tax_known: bool = True) -> str:
    """Words for a window whose residency evidence contradicts its other signals; "" when they agree (an unknown
    tax, with no reference yet, contradicts nothing)."""
    if sign is None or sign.kind is None:
        return ""
    if sign.kind == "pressure" and not preemptions_per_minute and tax_known and not taxed_:
        return (f"the engine's KV-block residency shows pressure ({sign.reason}) in a window with no preemption "
                "and no tax above noise: counted pressured")
    if sign.kind == "low_pressure" and (preemptions_per_minute or taxed_):
        seen = f"{preemptions_per_minute:.1f} preemptions/min" if preemptions_per_minute else "a tax above noise"
        return (f"the engine's KV-block residency shows low pressure ({sign.reason}) in a window with {seen}: "
                "counted pressured")
    return ""


def predicted_regime(p: P95, threshold: float, previous: bool | None, covered_ratio: float = 1.0) -> bool | None:
    """The threshold's prediction of the regime (``regime`` decides it on the engine's evidence). Above (True)
    only when the p95's lower bound clears the threshold, below (False) only when its upper bound is under it;
    in between the previous regime holds (hysteresis: no flip on sampling noise). With no previous regime the
    point estimate decides (pressure.above_threshold). "Below" also needs the window at least
    MIN_BELOW_COVERAGE covered: the few samples right after kvwatt starts (or restarts beside a busy
    engine) cannot rule pressure out, so the previous regime holds, or none (unknown) after a start."""
    if p.value is None:
        return None
    if p.low > threshold:
        return True
    if p.high <= threshold:
        return False if covered_ratio >= MIN_BELOW_COVERAGE or previous is False else previous
    if covered_ratio < MIN_BELOW_COVERAGE and previous is None and not pressure.above_threshold(p.value, threshold):
        return None
    return previous if previous is not None else pressure.above_threshold(p.value, threshold)


def quiet(agg: WindowAggregate, p: P95, residency_kind: str | None = None) -> bool:
    """Positive signs of no pressure in a window (the threshold-relative test is the reference's): preemptions
    counted and zero, no residency evidence of pressure, KV max under LOW_PRESSURE_MAX (waived when the engine's
    residency record says low pressure: it measures what the level stands in for), nobody waiting for KV
    (waiting_capacity where the engine tells, else no request waiting for most of the window)."""
    if agg.delta("preemptions") != 0 or p.value is None or residency_kind == "pressure":
        return False
    kv_max = agg.gauge_max("kv_usage")
    if kv_max is None or (kv_max >= LOW_PRESSURE_MAX and residency_kind != "low_pressure"):
        return False
    if agg.gauge_count("waiting_capacity"):
        return not agg.gauge_max("waiting_capacity")
    return not agg.quantile("waiting", 0.5)


@dataclass(frozen=True)
class Verdict:
    above: bool | None  # True above, False below, None unknown
    state: str          # known | provisional | unknown
    reason: str


@dataclass(frozen=True, kw_only=True)
class ThresholdInUse:
    """The threshold the regime's prediction uses and what it rests on: a located one that is not known yet is
    worded as provisional with its interval (a located 0.345 in [0.000, 0.780] is no threshold to read a p95
    against as if it were the configured one)."""

    ratio: float
    source: str = "configured"  # located | configured
    state: str = "known"        # the located threshold's state (a configured one is known: it is a setting)
    low: float | None = None    # the located threshold's interval
    high: float | None = None

    @property
    def note(self) -> str:
        """"" for a known threshold; else "located, provisional, in [low, high]"."""
        if self.source != "located" or self.state == "known":
            return ""
        interval = f", in [{self.low:.3f}, {self.high:.3f}]" if self.low is not None else ""
        return f"located, {self.state}{interval}"


def threshold_in_use(ratio: float, source: str, located: LocatedThreshold | None) -> ThresholdInUse:
    """The threshold in force (ThresholdLearner.threshold, .source) with the located one's state and interval."""
    if source == "located" and located is not None:
        return ThresholdInUse(ratio=ratio, source=source, state=located.state, low=located.low, high=located.high)
    return ThresholdInUse(ratio=ratio, source=source)


def p95_words(p: P95, th: ThresholdInUse) -> str:
    """The window's p95 against the threshold in use, the word computed from the numbers printed (derive.compare):
    "p95 0.932 is above the threshold in use 0.900 but its interval [0.880, 0.950] reaches below it, so not yet
    clear"."""
    return compare.against("p95", p.value, (p.low, p.high), "the threshold in use", th.ratio, note=th.note)


def tax_words(tax: float, spread: float | None) -> str:
    """"a recompute tax of +5.0 points, above the noise bar +3.0 points": the word from the printed numbers."""
    t, word, bar = compare.side(tax * 100, noise_bar(spread) * 100, "+.1f")
    return f"a recompute tax of {t} points, {word} the noise bar {bar} points"


def pressure_signs(g: WindowEvidence) -> list[tuple[str, bool]]:
    """(words, known) for every sign of pressure the window shows, whatever the threshold in use."""
    out = []
    if g.capacity is not None and g.capacity.share > 0:
        mean = "" if g.capacity.mean is None else f" (mean {g.capacity.mean:.1f})"  # None: a recorded window
        out.append((f"requests waiting for KV capacity in {g.capacity.share * 100:.0f} % of samples{mean}",
                    g.capacity.share >= rules.CAPACITY_SUSTAINED.default))
    if g.preemptions_per_minute:
        out.append((f"{g.preemptions_per_minute:.1f} preemptions/min", bool(g.onset)))
    if taxed(g):
        # known on a known reference over a window covered enough to call it sustained (as the onset, s3)
        sustained = g.covered_ratio is not None and g.covered_ratio >= rules.SUSTAINED_MIN_COVERED.default
        out.append((tax_words(g.tax, g.tax_se), g.tax_state == "known" and sustained))
    if g.residency is not None and g.residency.kind == "pressure":
        out.append((f"the engine's KV-block residency shows pressure ({g.residency.reason})", True))
    return out


def low_pressure_signs(g: WindowEvidence, threshold: float) -> tuple[list[str], list[str], bool]:
    """(the positive signs of low pressure seen, what is missing for a "below", whether a sign rests on the
    engine's own record: a known tax, the residency evidence or the capacity gauge)."""
    seen, missing = [], []
    if g.preemptions_per_minute is None:
        missing.append("a preemption count")
    else:
        seen.append("no preemption")
    if g.capacity is not None:
        seen.append("no request waiting for KV capacity")
    elif g.waiting_median == 0:
        seen.append("no request waiting for most of the window")
    else:
        missing.append("requests waiting (the engine does not say for what)")
    levels = g.kv_max is not None and g.kv_max < min(LOW_PRESSURE_MAX, threshold - REFERENCE_MARGIN)
    if g.tax is not None:
        seen.append(tax_words(g.tax, g.tax_se) + ": within noise")
    if g.residency is not None and g.residency.kind == "low_pressure":
        seen.append(f"the engine's KV-block residency shows low pressure ({g.residency.reason})")
    if levels:
        seen.append(f"KV max {g.kv_max * 100:.0f} %")
    if g.tax is None and not levels and not (g.residency and g.residency.kind == "low_pressure"):
        top = "unknown" if g.kv_max is None else f"{g.kv_max * 100:.0f} %"
        missing.append(f"a known recompute tax, the engine's KV-block residency, or a KV max under "
                       f"{min(LOW_PRESSURE_MAX, threshold - REFERENCE_MARGIN) * 100:.0f} % (it reached {top})")
    if g.covered_ratio is None or g.covered_ratio < MIN_BELOW_COVERAGE:
        missing.append("a window at least half covered")
    engine_said = (g.capacity is not None or (g.tax is not None and g.tax_state == "known")
                   or bool(g.residency and g.residency.kind == "low_pressure"))
    return seen, missing, engine_said


def regime(g: WindowEvidence, threshold: ThresholdInUse, over: bool, quiet_streak: int) -> Verdict:
    """One window's regime on positive evidence both ways (methods.md s10): *above* on any sign of pressure
    (known when sustained: requests waiting for KV capacity in most samples, preemption onset, a tax above noise
    on a known reference, residency pressure), whatever the threshold in use; *below* only on positive signs of
    low pressure (known once the server showed them for QUIET_KNOWN_WINDOWS evidence windows and the KV p95 is
    not above the threshold in use); otherwise the threshold predicts (*above*, provisional, when the p95's lower
    bound clears it) or the regime is unknown, with what is missing. ``over``: the threshold's prediction
    (``predicted_regime``, with hysteresis on the p95's interval). The p95 and the threshold are worded by
    ``p95_words``: its comparison word is computed from the numbers it prints, never from ``over``."""
    if g.p95.value is None:
        return Verdict(None, "unknown", "no KV usage sampled in the window")
    seen = pressure_signs(g)
    if seen:
        known = any(k for _, k in seen)
        where = "" if over else f"; {p95_words(g.p95, threshold)}"
        v = Verdict(True, "known" if known else "provisional", "above: " + "; ".join(w for w, _ in seen) + where)
        if g.residency is not None and g.residency.kind == "low_pressure":
            v = Verdict(True, "provisional" if v.state == "known" else v.state, v.reason +
                        f"; contradicted by the engine's KV-block residency: low pressure ({g.residency.reason})")
        return v
    low, missing, engine_said = low_pressure_signs(g, threshold.ratio)
    if not missing:
        why = "below: " + ", ".join(low)
        if over:
            return Verdict(False, "provisional", f"{why}; although {p95_words(g.p95, threshold)}: the threshold "
                           "predicts pressure the engine does not show")
        if quiet_streak >= QUIET_KNOWN_WINDOWS and engine_said:
            quiet = plural(quiet_streak, "evidence window")
            return Verdict(False, "known", f"{why}; low pressure for the last {quiet}")
        need = [] if engine_said else ["a known recompute tax, the engine's KV-block residency or its count of "
                                       "requests waiting for KV capacity"]
        if quiet_streak < QUIET_KNOWN_WINDOWS:
            need.append(f"{QUIET_KNOWN_WINDOWS} evidence windows of low pressure in a row "
                        f"({quiet_streak} so far)")
        return Verdict(False, "provisional", f"{why}; known with {' and '.join(need)}")
    if over:
        return Verdict(True, "provisional", f"above (predicted): {p95_words(g.p95, threshold)}; the engine shows no "
                       "sign of pressure yet; missing for a below: " + "; ".join(missing))
    return Verdict(None, "unknown", "neither pressure nor low pressure shown: missing " + "; ".join(missing))
