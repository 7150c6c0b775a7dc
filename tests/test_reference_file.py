"""The learned reference shares' state file (model/reference_book.py) is held to what kvwatt writes, as the evidence
file is (model/evidence_book.py): a stored sample dated after now + the clock-skew allowance is no sample of this
daemon's. Before: entries dated up to a day ahead were accepted, so a crafted ``reference-share.json`` with share 0.0
dated 23.9 h ahead made the reference 0.0 "known", every live window look taxed (so none could replace it), the regime
"above" and the KV-pressure advice "bad" on a healthy server, and was written back at every save."""

from __future__ import annotations

import json
import logging

import pytest

from exporter.model import evidence_book, reference_book
from exporter.model.reference_book import STATE_FILE, ReferenceBook
from tests.test_threshold_live import WALL, Run, model


def _crafted(at: float, share: float = 0.0) -> dict:
    """Five calm-looking samples (p95 0.10) with a reference share of ``share``."""
    return {"version": reference_book.FORMAT_VERSION,
            "servers": {"s": [{"share": share, "p95": 0.10, "at": at} for _ in range(5)]}}


def _state(tmp_path, body: dict):
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    (state / STATE_FILE).write_text(json.dumps(body))
    return state


def test_a_reference_file_dated_ahead_is_ignored_with_one_warning(tmp_path, caplog):
    state = _state(tmp_path, _crafted(WALL + 23.9 * 3600))
    caplog.set_level(logging.WARNING, logger="kvwatt.reference")
    run = Run(model(tmp_path, ReferenceBook(str(state), lambda: WALL)))
    run.seconds(3 * 60, 0.50, 0.06)  # a healthy server: p95 0.50, no preemption, a local share of 6 %
    f = run.fig()
    # the reference is the server's own (learned from its calm windows), never the file's 0.0
    assert f.reference_share == pytest.approx(0.06), (f.reference_share, f.reference_state)
    assert f.regime != "above" and all(a.severity != "bad" for a in f.advice), (f.regime, f.advice)
    st = next(s for s in run.m.snapshot().sources if s.source == "state_dir")
    assert "5 bad entries (s[0]: at " in st.reason and "is outside" in st.reason, st.reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "reference share: dropped" in warnings[0].getMessage()
    # not carried on by a restart: the next save wrote the server's own samples only
    stored = json.loads((state / STATE_FILE).read_text())["servers"]["s"]
    assert stored and all(e["at"] <= WALL and e["share"] == pytest.approx(0.06) for e in stored), stored


@pytest.mark.parametrize("ahead", [0.0, evidence_book.CLOCK_SLACK_SECONDS])
def test_a_sample_within_the_clock_skew_allowance_is_kept(tmp_path, ahead):
    """The wall clock stepped back a little after the file was written: its samples still count."""
    state = _state(tmp_path, _crafted(WALL + ahead, share=0.4))
    m = model(tmp_path, ReferenceBook(str(state), lambda: WALL))
    assert m.servers["s"].reference.value == pytest.approx(0.4)
    st = next(s for s in m.snapshot().sources if s.source == "state_dir")
    assert "bad entries" not in st.reason
