"""ThresholdLearner.evidence() is read every tick and recounted only when what it reads changed
(model/pressure/learner.py): whatever happens to the evidence windows, it equals a fresh count."""

from __future__ import annotations

import random

from exporter.derive.pressure_evidence import recorded_evidence
from exporter.derive.threshold import PressurePoint
from exporter.model.pressure import LowPressureReference, ThresholdLearner


def fresh(pl: ThresholdLearner):
    return pl._count_evidence()


def test_evidence_follows_every_change_of_what_it_counts():
    rng = random.Random(4)
    pl = ThresholdLearner(width_seconds=60.0, keep_windows=12, min_windows=3, onset_per_minute=0.5,
                          configured_threshold=0.9, use_located=True, reference=LowPressureReference(), name="s")
    assert pl.evidence() == fresh(pl)
    seen = set()
    for k in range(40):  # past the 12 kept: the oldest leave as new ones come
        clean = PressurePoint(evidence=recorded_evidence(p95=0.3, preemptions_per_minute=0.0, tax=0.0, tax_se=None),
                              wall=1000.0 + k)
        pressured = PressurePoint(evidence=recorded_evidence(p95=0.3, preemptions_per_minute=3.0, tax=0.2, tax_se=None),
                                  wall=1000.0 + k)
        pl.points.append(clean if rng.random() < 0.6 else pressured)  # equal values, other objects: still counted
        assert pl.evidence() == fresh(pl)
        ev = pl.evidence()
        seen.add((ev.clean, ev.pressured, ev.low_pressure))
        if k == 20:
            pl.rejected += 1
            assert pl.evidence() == fresh(pl)
        if k == 30:
            pl.reference.threshold = 0.2  # the low-pressure limit moves under the points' p95
            assert pl.evidence() == fresh(pl)
    assert len(seen) > 2
    pl.points.clear()
    assert pl.evidence() == fresh(pl) and pl.evidence().windows == 0
