"""Locating the KV-pressure threshold from evidence (methods.md s10): pure functions.

A ``PressurePoint`` is one observation of a server at one pressure level: a live window, or one experiment run or
condition, its evidence a ``WindowEvidence`` (derive/pressure_evidence.py). It is *pressured* when it shows
sustained preemptions (>= ``onset_per_minute``, methods.md s3), a recomputation tax above its noise (methods.md s4)
or, for a live window, requests waiting for KV capacity or the engine's KV-block residency evidence of pressure
(methods.md s11); *clean* only on positive signs of low pressure (preemptions counted and below onset, nobody
waiting for KV capacity, and a known tax within noise, the residency evidence of low pressure, or a KV max under
``LOW_PRESSURE_MAX`` with the capacity gauge read at zero); *unknown* (ignored) otherwise: an unknown tax never
makes a window clean. ``locate`` puts the threshold at the KV-p95 cut that best separates clean points (below) from
pressured ones (above): a one-dimensional decision stump, weighted by the evidence behind each point (windows or
runs; a live window with a single preemption weighs a third), ties going to the cut with the most evidence on its
thinner side, then the lowest. A cut at the idle floor is not a threshold; a located one is ``known`` only with
sustained evidence on both sides and a narrow interval, else ``provisional`` (``judge``; methods.md s10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from exporter import rules
from exporter.derive import compare
from exporter.derive.pressure_evidence import WindowEvidence
from exporter.results import LocatedThreshold

ONSET_PER_MINUTE = rules.PREEMPTION_ONSET_PER_MINUTE.default  # methods.md s3: sustained preemptions mark onset
TAX_Z = 2.0              # a tax is evidence when it exceeds TAX_Z times its noise ...
MIN_TAX = 0.05           # ... and at least 5 percentage points of the prompt tokens (methods.md s10)
MIN_TAX_UNKNOWN_SE = 0.05  # without a noise estimate: at least 5 points
# methods.md s10 "Evidence before judgement": the numbers and why they are what they are are stated there
IDLE_FLOOR = 0.10          # a cut under this KV p95 separates idle from busy, not low from high pressure
KNOWN_SIDE_WEIGHT = 3.0    # evidence weight each side of a known threshold needs (three full windows)
KNOWN_WIDTH = 0.30         # a known threshold's interval is at most this wide (in KV p95)
KNOWN_MISPLACED = 0.2      # ... and at most this share of its evidence weight lies on the wrong side
LOW_PRESSURE_MAX = 0.80    # a window whose KV max stayed under this came nowhere near preempting (methods.md s10)


@dataclass(frozen=True, kw_only=True, slots=True)  # slots: up to 10,000 held a server
class PressurePoint:
    """A point the threshold is located from: one window's pressure evidence (``WindowEvidence``,
    derive/pressure_evidence.py: a live window's as built, a held one's as read back from evidence.json, or an
    experiment condition's, the lab's analysis), weighted by the evidence behind it and timed. Only the weight and
    the times are the point's own: every figure of the evidence is read from ``evidence``."""

    evidence: WindowEvidence
    weight: float = 1.0                    # windows/runs behind the point
    t: float | None = None                 # when (live windows: the window's end); not used by locate
    wall: float | None = None              # live windows: the unix time of the window's end (persisted)

    @property
    def kv_p95(self) -> float:
        """The point's place on the KV-p95 axis (ratio 0..1): its evidence's p95."""
        return self.evidence.p95.value


def plural(n: int, noun: str) -> str:
    """'1 window', '2 windows': a count in words agrees with its number."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def preempting(p: PressurePoint, onset_per_minute: float = ONSET_PER_MINUTE) -> bool:
    per_minute = p.evidence.preemptions_per_minute
    return per_minute is not None and per_minute >= onset_per_minute


def taxed(ev: WindowEvidence, z: float = TAX_Z, min_tax: float = MIN_TAX,
          min_tax_unknown_se: float = MIN_TAX_UNKNOWN_SE) -> bool:
    """The window's tax is above noise: > z * SE and > min_tax (without an SE: > min_tax_unknown_se)."""
    return ev.tax is not None and ev.tax > noise_bar(ev.tax_se, z, min_tax, min_tax_unknown_se)


def noise_bar(tax_se: float | None, z: float = TAX_Z, min_tax: float = MIN_TAX,
              min_tax_unknown_se: float = MIN_TAX_UNKNOWN_SE) -> float:
    """The tax a window must exceed to be above noise (``taxed``), the bar its words print beside it."""
    return min_tax_unknown_se if tax_se is None else max(z * tax_se, min_tax)


def waited(p: PressurePoint) -> bool:
    """Some sample of the window had a request waiting for KV capacity."""
    return bool(p.evidence.capacity_share)


def classify(p: PressurePoint, onset_per_minute: float = ONSET_PER_MINUTE) -> bool | None:
    """True: pressured (sustained preemptions, a tax above noise, requests waiting for KV capacity, or the
    engine's residency evidence of pressure); False: clean, on positive signs of low pressure only (``headroom``);
    None: neither (an unknown tax, a window whose KV neared full with nothing else known)."""
    if preempting(p, onset_per_minute) or taxed(p.evidence) or p.evidence.residency_kind == "pressure" or waited(p):
        return True
    return False if headroom(p) else None


def headroom(p: PressurePoint) -> bool:
    """Positive signs of low pressure in a point that shows no pressure: preemptions counted, and a known tax (then
    within noise), the engine's residency evidence of low pressure, or the capacity gauge read at zero in every
    sample with a KV max under LOW_PRESSURE_MAX (methods.md s10)."""
    ev = p.evidence
    if ev.preemptions_per_minute is None:
        return False
    quiet_levels = ev.capacity_share == 0 and ev.kv_max is not None and ev.kv_max < LOW_PRESSURE_MAX
    return ev.tax is not None or ev.residency_kind == "low_pressure" or quiet_levels


def locate(points: Sequence[PressurePoint], min_points: int = 3, min_side: float = 1.0,
           onset_per_minute: float = ONSET_PER_MINUTE) -> LocatedThreshold | None:
    """The KV-p95 threshold the points show, or None when the evidence is not there (locate_why)."""
    return locate_why(points, min_points, min_side, onset_per_minute)[0]


def locate_why(points: Sequence[PressurePoint], min_points: int = 3, min_side: float = 1.0,
               onset_per_minute: float = ONSET_PER_MINUTE) -> tuple[LocatedThreshold | None, str]:
    """The located threshold and "", or None and why not (in words).

    Rule (methods.md s10): sort the known points by p95; among the cuts between two distinct p95 values, take
    the one with the least weight on the wrong side (pressured below, clean above); on a tie the one with the
    most weight on its thinner side (min of clean below, pressured above), then the lowest.
    It stands only when at least ``min_points`` points are known, the clean weight below the cut and the
    pressured weight above it are each at least ``min_side``, each side is mostly what it should be
    (pressured weight above > clean weight above; clean below > pressured below), and the cut is above the
    idle floor. The ratio is the middle of the gap at the cut; the interval runs from the highest clean point
    below the lowest optimal cut to the lowest pressured point above the highest optimal cut, widened by those
    points' own p95 intervals. The method names the evidence of the lowest pressured point above the cut:
    preemptions first. ``judge`` gives its state."""
    known = sorted(((p, c) for p in points if (c := classify(p, onset_per_minute)) is not None),
                   key=lambda pc: pc[0].kv_p95)
    if len(known) < max(min_points, 2):
        return None, f"{plural(len(known), 'window')} with known pressure ({max(min_points, 2)} needed)"
    total_clean = sum(p.weight for p, c in known if not c)
    pressured_below = clean_below = 0.0
    best, cuts = math.inf, []
    for i in range(1, len(known)):
        p, c = known[i - 1]
        if c:
            pressured_below += p.weight
        else:
            clean_below += p.weight
        if known[i][0].kv_p95 <= p.kv_p95:
            continue  # no cut between equal p95 values
        cost = pressured_below + (total_clean - clean_below)
        if cost < best - 1e-12:
            best, cuts = cost, [(i, clean_below, pressured_below)]
        elif cost <= best + 1e-12:
            cuts.append((i, clean_below, pressured_below))
    if not cuts:
        return None, "no cut between distinct KV p95 values"
    total_pressured = sum(p.weight for p, c in known if c)
    i, clean_w, pressured_w = _best_supported(cuts, total_pressured)
    above_pressured, above_clean = total_pressured - pressured_w, total_clean - clean_w
    if clean_w < min_side or above_pressured < min_side:
        return None, (f"evidence weight {clean_w:.3g} clean below and {above_pressured:.3g} pressured above the best "
                      f"cut ({min_side:g} needed each side)")
    if above_pressured <= above_clean or clean_w <= pressured_w:
        return None, "no cut with each side mostly what it should be"
    edge_clean = max((p for p, c in known[:i] if not c), key=lambda p: p.kv_p95)
    j = cuts[-1][0]
    first_pressured = min((p for p, c in known[i:] if c), key=lambda p: p.kv_p95)
    edge_pressured = min((p for p, c in known[j:] if c), key=lambda p: p.kv_p95, default=first_pressured)
    ratio = (known[i - 1][0].kv_p95 + known[i][0].kv_p95) / 2
    low = min(_lower(edge_clean), ratio)
    high = max(_upper(edge_pressured), ratio)
    if ratio < IDLE_FLOOR:
        return None, (f"degenerate cut at p95 {ratio:.3f}: the clean windows below it are idle (p95 <= "
                      f"{known[i - 1][0].kv_p95:.3f}, under the {IDLE_FLOOR:.2f} idle floor)")
    method = "preemption_onset" if preempting(first_pressured, onset_per_minute) else "tax_onset"
    found = LocatedThreshold(ratio=ratio, low=low, high=high, method=method, points=len(known), clean_below=clean_w,
                             pressured_above=above_pressured, misplaced=best)
    state, reason = judge(found)
    return replace(found, state=state, reason=reason), ""


def _best_supported(cuts: list[tuple[int, float, float]], total_pressured: float) -> tuple[int, float, float]:
    """Among equally good cuts, the one whose thinner side carries the most evidence (a cut resting on one
    window either side is the one a single new window would move), then the lowest (says "above" sooner)."""
    def support(cut):
        _, clean_w, pressured_w = cut
        return min(clean_w, total_pressured - pressured_w)
    top = max(support(c) for c in cuts)
    return next(c for c in cuts if support(c) >= top - 1e-12)


def _interval_wider(low: float, high: float, width: float) -> str:
    """"[0.340, 0.770]": printed with the digits that show it wider than ``width`` (its printed ends, read back,
    are as far apart as the words say; derive.compare)."""
    for digits in range(3, 3 + compare.EXTRA_DIGITS + 1):
        lo, hi = f"{low:.{digits}f}", f"{high:.{digits}f}"
        if round(float(hi) - float(lo), digits) > width:
            break
    return f"[{lo}, {hi}]"


def judge(loc: LocatedThreshold) -> tuple[str, str]:
    """``known`` when sustained evidence stands on both sides (KNOWN_SIDE_WEIGHT each), the interval is at most
    KNOWN_WIDTH wide and at most KNOWN_MISPLACED of the weight is misplaced; else ``provisional`` with why."""
    why = []
    if loc.clean_below < KNOWN_SIDE_WEIGHT:
        why.append(f"clean weight below {compare.op(loc.clean_below, KNOWN_SIDE_WEIGHT, '.3g')}")
    if loc.pressured_above < KNOWN_SIDE_WEIGHT:
        why.append(f"pressured weight above {compare.op(loc.pressured_above, KNOWN_SIDE_WEIGHT, '.3g')}")
    if loc.high - loc.low > KNOWN_WIDTH:
        why.append(f"interval {_interval_wider(loc.low, loc.high, KNOWN_WIDTH)} wider than {KNOWN_WIDTH:.2f}")
    total = loc.clean_below + loc.pressured_above + loc.misplaced
    if total and loc.misplaced > KNOWN_MISPLACED * total:
        why.append(f"{loc.misplaced:.3g} of {total:.3g} evidence weight on the wrong side")
    if why:
        return "provisional", "; ".join(why)
    return "known", (f"{loc.clean_below:.3g} clean below, {loc.pressured_above:.3g} pressured above, interval "
                     f"[{loc.low:.3f}, {loc.high:.3f}]")


def _lower(p: PressurePoint) -> float:
    p95 = p.evidence.p95  # an interval not recorded: the p95 itself
    return p95.value if p95.low is None else min(p95.low, p95.value)


def _upper(p: PressurePoint) -> float:
    p95 = p.evidence.p95
    return p95.value if p95.high is None else max(p95.high, p95.value)
