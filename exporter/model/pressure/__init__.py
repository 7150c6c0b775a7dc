"""Per-server KV-pressure learners (methods.md s10): the threshold located from the server's own history, the
low-pressure reference share, and the regime flag with hysteresis on the p95's interval, each with the evidence
it rests on and a state ``known`` / ``provisional`` / ``unknown`` with a reason.

Every completed bucket of a fixed grid (``threshold_window``, 1 minute by default: the shared monotonic clock's
``k * W``, as the repeat windows), at least ``rules.SUSTAINED_MIN_COVERED`` covered and serving >= 100 prompt
tokens (or preempting), has its ``WindowEvidence`` built (derive/pressure_evidence.py ``window_evidence``, the
one builder the regime and the lab read too) and becomes one ``PressurePoint`` holding it (its KV p95 with the
order-statistic interval, its KV max, preemptions per minute, the tax against the reference in force and the
reference's spread as its noise, ...) with its weight and times, unless its preemption count is implausible for
the window
(``plausible_preemptions``: a counter glitch is no evidence). A window pressured by preemptions alone weighs
``preemptions / SUSTAINED_PREEMPTIONS`` (at most 1): one preemption is a third of a window of evidence. The
last ``threshold_history`` of points are kept; ``derive.threshold.locate_why`` runs when a point is added (the
points only change then).

The same bucket then teaches the reference share (``LowPressureReference``) only on positive signs of no
pressure (``quiet``): no preemption, nobody waiting for KV, KV max under ``LOW_PRESSURE_MAX``, p95 under both
``LOW_PRESSURE_P95`` and the threshold in force less ``REFERENCE_MARGIN``, no tax against the reference so far.
The reference is ``known`` from ``REFERENCE_KNOWN_WINDOWS`` such windows; a server first seen under load has
none, and its tax is unknown with the reason.

Where vLLM exports its KV-block residency histograms (``--kv-cache-metrics``), each window also carries the
engine's own, history-free evidence (derive/residency.py, methods.md s11): ``pressure`` makes the window
pressured even with no preemption and no reference, and keeps it from teaching the reference; ``low_pressure``
is a positive sign of no pressure that stands in for the absolute KV-usage levels (LOW_PRESSURE_P95 and
LOW_PRESSURE_MAX are proxies for "nothing the workload reuses was evicted", which the histograms measure).
Signals that disagree are stated in the reasons (the tax's, the regime's).

One idea per module: ``regime_signs`` (the pure regime functions and the shared constants), ``reference`` (the
low-pressure reference share), ``learner`` (the threshold learner). Every name stays importable from here.
"""

from __future__ import annotations

from exporter.derive.pressure import MAX_STEPS_PER_SECOND, plausible_preemptions  # noqa: F401 (their home)
from exporter.model.pressure.learner import ThresholdLearner, evidence_weight  # noqa: F401 (the package's face)
from exporter.model.pressure.reference import (  # noqa: F401 (the package's face)
    LowPressureReference,
    ReferenceSample,
    no_reference_reason,
)
from exporter.model.pressure.regime_signs import (  # noqa: F401 (the package's face)
    LOW_PRESSURE_P95,
    MAX_EVIDENCE_WEIGHT,
    MAX_EVIDENCE_WINDOWS,
    MIN_BELOW_COVERAGE,
    MIN_PROMPT_TOKENS,
    P95,
    QUIET_KNOWN_WINDOWS,
    REFERENCE_KNOWN_WINDOWS,
    REFERENCE_MARGIN,
    SUSTAINED_PREEMPTIONS,
    ResidencySign,
    ThresholdInUse,
    Verdict,
    WindowEvidence,
    disagreement,
    low_pressure_signs,
    p95_of,
    p95_words,
    predicted_regime,
    pressure_signs,
    quiet,
    regime,
    residency_sign,
    tax_words,
    threshold_in_use,
)
