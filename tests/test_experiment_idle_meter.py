"""The experiment's idle phase meter (lab/kvwatt_lab/experiment/measure.py IdleMeter): a tick at which the server
did not answer is neither idle nor busy; its energy counts once the server's next answer (whose interval spans the
gap) says the gap was idle, and is reported busy when that answer shows work. Measured without it under a loaded
test run: a 3 s idle phase whose every tick came late gave no idle baseline at all."""

from __future__ import annotations

import pytest
from kvwatt_lab.experiment.measure import IdleMeter

DEV = "rapl:package-0:package"


def test_unanswered_ticks_count_once_an_idle_answer_spans_them():
    m = IdleMeter()
    m.add(1.0, None, {DEV: (40.0, 1.0)}, {})
    m.add(1.0, None, {DEV: (40.0, 1.0)}, {})
    assert m.accum.estimates() == []  # nothing known yet
    m.add(1.0, True, {DEV: (40.0, 1.0)}, {})
    (est,) = m.accum.estimates()
    assert est.device == DEV and est.watts == pytest.approx(40.0)
    assert (m.total_seconds, m.busy_seconds, m.pending) == (3.0, 0.0, [])


def test_unanswered_ticks_before_an_answer_showing_work_are_busy_and_not_measured():
    m = IdleMeter()
    m.add(1.0, True, {DEV: (40.0, 1.0)}, {})
    m.add(1.0, None, {DEV: (300.0, 1.0)}, {})
    m.add(1.0, False, {DEV: (300.0, 1.0)}, {})
    (est,) = m.accum.estimates()
    assert est.watts == pytest.approx(40.0)  # the busy gap's 300 W left out
    assert m.busy_seconds == 2.0 and m.total_seconds == 3.0


def test_unanswered_ticks_at_the_end_of_the_phase_are_left_out():
    m = IdleMeter()
    m.add(1.0, True, {DEV: (40.0, 1.0)}, {})
    m.add(1.0, None, {DEV: (500.0, 1.0)}, {})
    (est,) = m.accum.estimates()
    assert est.watts == pytest.approx(40.0) and m.busy_seconds == 0.0
