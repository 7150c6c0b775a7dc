"""The page in plain words: no internal term (a condition's or a condition set's identifier, a figure's JSON key,
"None"/"NaN") reaches the text a person reads, over every golden server and an all-unknown snapshot. Settings a
person may change are named as settings ("... in the configuration"), which is allowed."""

from __future__ import annotations

import html.parser
import json
import re
from pathlib import Path

from exporter.derive.collapse import CONDITION_SETS, CONDITIONS
from exporter.serve import page
from exporter.serve.web import status_json
from tests.test_page import _all_unknown_snapshot

GOLDEN_STATUS = Path(__file__).resolve().parent / "data" / "golden" / "status.json"
INTERNAL = (*CONDITIONS, *CONDITION_SETS, "condition set", "condition_set", "the study's", "threshold_in_use",
            "regime_state", "tax_state", "None", "NaN", "null", "undefined")


class _Text(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self._skip -= tag in ("script", "style")

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def visible_text(status: dict) -> str:
    p = _Text()
    p.feed(page.render(status))
    return " ".join(" ".join(p.parts).split())


def internal_terms(text: str) -> list[str]:
    return [t for t in INTERNAL if re.search(rf"(?<![\w-]){re.escape(t)}(?![\w-])", text)]


def statuses() -> list[dict]:
    return [json.loads(GOLDEN_STATUS.read_text()), status_json(_all_unknown_snapshot())]


def test_no_internal_term_on_the_page():
    for status in statuses():
        text = visible_text(status)
        assert "Throughput collapse" in text  # the text was read
        assert not internal_terms(text), (internal_terms(text), text[:3000])


def test_the_check_sees_an_internal_term():
    status = statuses()[0]
    status["servers"][0]["collapse"]["condition_sets"] = {}
    status["servers"][0]["collapse"]["signature"] = False
    status["servers"][0]["collapse"]["conditions"] = {"requests_pending": False}
    assert internal_terms(visible_text(status)) == []  # ruled out in words
    assert internal_terms("ruled out: requests_pending") == ["requests_pending"]


def test_why_a_collapse_is_ruled_out_is_said_in_words():
    c = {"signature": False, "condition_sets": {"classic": False, "stalled_engine": False},
         "conditions": {"offload_enabled": False, "zero_preemptions": True, "engine_steps_stopped": False}}
    assert page.collapse_words(c) == "ruled out: offloading is off; the engine ran steps"
    c.update(signature=True, condition_sets={"stalled_engine": True})
    assert page.collapse_words(c).startswith("a stalled engine")


def test_the_saving_and_the_recompute_share_say_they_are_of_the_energy_above_idle():
    """dE and the recompute energy share are shares of the GPU energy above idle (marginal, methods.md s1): a
    real ON engine's page said "saves +46.1 % of GPU energy" from 5.2 W saved beside 76 W drawn, and "86.9 %
    recomputation share of GPU energy" beside a 160 W tax in a 254 W window. Every golden server whose dE the
    page words says which energy it is a share of."""
    text = visible_text(statuses()[0])
    leads = re.findall(r"(?:offloading saves|would save about) .{0,80}? per generated token", text)
    assert leads and all("above idle" in lead for lead in leads), leads
    assert "recomputation share of GPU energy above idle" in text
    assert not re.search(r"recomputation share of GPU energy(?! above idle)", text)
