"""'What do I do?' (exporter.model.advice) over hand-built figures, as /api/status serialises them and the page
renders them: every advice kind, and "Nothing to do" only where every check is known and clear.

The figures are built as ServerModel.figures builds them (the typed ServerFigures, then ``advise``), so each test
reads /api/status's ``advice`` and ``recommendations`` and the page's "What do I do?" from one status dict.
"""

from __future__ import annotations

import html.parser
from dataclasses import replace

from exporter.config import DEFAULT_SERVER_URL, Config
from exporter.derive.collapse import CONDITIONS, CollapseResult
from exporter.figures import KV_CACHE_METRICS_HINT, BufferFigures, ServerFigures, Snapshot, WindowFigures
from exporter.model import advice as advice_model
from exporter.model.pressure import QUIET_KNOWN_WINDOWS
from exporter.results import Evidence
from exporter.samples import EngineInfo, SourceStatus
from exporter.serve import page
from exporter.serve.web import status_json

CFG = Config()
UP = SourceStatus(source="vllm", server="s", up=True, reason="", duration_seconds=0.01, state="ok")
CLEAR = CollapseResult(conditions=dict.fromkeys(CONDITIONS, False), signature=False, reason="no: conditions false")
QUIET = WindowFigures("1m", 60.0, 60.0, kv_usage_p95=0.4, above_threshold=False, preemptions_per_minute=0.0,
                      preemption_onset=False, recompute_tax=0.001, token_shares={"local_compute": 0.3})
BUF_OK = BufferFigures(undersized=False, recommended_bytes=8 * 2 ** 30, recommended_gib=8, store_failures=0.0,
                       residency_seconds=60.0, write_bytes_per_second=1e8, p99_tool_latency_seconds=20.0, headroom=1.5)


def _fig(**kw) -> ServerFigures:
    """A server where every check is known and clear, with ``kw`` changed; its advice as the model builds it."""
    base = dict(name="s", url="http://s.invalid:8000", status=UP, info=EngineInfo("m", True, 8 * 2 ** 30),
                threshold=0.9, threshold_in_use=0.9, reference_share=0.3, reference_kind="learned", windows=(QUIET,),
                collapse=CLEAR, buffer=BUF_OK, threshold_state="known", regime_state="known",
                regime_reason="on the threshold", tax_state="known", tax_reason="median of 3 low-pressure windows",
                reference_windows=3,
                reference_spread=0.01, evidence=Evidence(windows=10, clean=5, pressured=5, unknown=0, rejected=0,
                                                         span_seconds=540.0, oldest_wall=None, newest_wall=None,
                                                         low_pressure=3))
    base.update(kw)
    fig = ServerFigures(**base)
    advice = advice_model.advise(fig, CFG)
    return replace(fig, advice=advice, recommendations=advice_model.recommendations(advice))


def _status(fig: ServerFigures) -> dict:
    return status_json(Snapshot(1.0, 1.7e9, (fig,)))["servers"][0]


class _Text(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts: list[str] = []

    def handle_data(self, data):
        self.parts.append(data)


def _words(html_text: str) -> str:
    p = _Text()
    p.feed(html_text)
    return " ".join(" ".join(p.parts).split())


def _kinds(fig: ServerFigures) -> list[str]:
    return [a["kind"] for a in _status(fig)["advice"]]


def test_nothing_to_do_only_when_every_check_is_known_and_clear():
    st = _status(_fig())
    assert [a["kind"] for a in st["advice"]] == ["nothing_to_do"] and st["advice"][0]["severity"] == "info"
    assert st["recommendations"] == []
    assert "Nothing to do" in _words(page.todo(st))
    not_clear = {
        "regime provisional": dict(regime_state="provisional", regime_reason="none located yet"),
        "tax provisional": dict(tax_state="provisional", tax_reason="1 low-pressure window"),
        "collapse unknown": dict(collapse=CollapseResult(conditions=dict.fromkeys(CONDITIONS), signature=None,
                                                         reason="unknown")),
        "collapse not evaluated": dict(collapse=None),
        "buffer unknown": dict(buffer=replace(BUF_OK, undersized=None)),
        "buffer not sized": dict(buffer=None),
        "offloading unknown": dict(info=EngineInfo("m", None)),
        "server down": dict(status=SourceStatus(source="vllm", server="s", up=False, reason="unreachable: refused",
                                                duration_seconds=0.0, state="down")),
    }
    for what, kw in not_clear.items():
        st = _status(_fig(**kw))
        kinds = [a["kind"] for a in st["advice"]]
        assert "nothing_to_do" not in kinds and st["recommendations"], what
        assert "Nothing to do" not in _words(page.todo(st)), what


def test_an_off_server_needs_no_buffer_check():
    assert _kinds(_fig(info=EngineInfo("m", False), buffer=None)) == ["nothing_to_do"]


def test_a_down_server_gets_the_down_advice_and_nothing_else():
    down = SourceStatus(source="vllm", server="s", up=False, reason="unreachable: connection refused",
                        duration_seconds=0.0, state="down")
    st = _status(_fig(status=down))
    (a,) = st["advice"]
    assert a["kind"] == "server_down" and a["severity"] == "bad"
    assert "--server NAME=URL" in a["text"] and "engine process" in a["text"] and "http://s.invalid:8000" in a["text"]
    assert "connection refused" in a["text"] and a["evidence"]["reason_code"] == "unreachable"
    words = _words(page.todo(st))
    assert "cannot read http://s.invalid:8000/metrics" in words and "Nothing to do" not in words


def test_preemption_onset_gives_the_pressure_advice_with_its_numbers():
    w = replace(QUIET, kv_usage_p95=0.95, above_threshold=True, preemptions_per_minute=2.5, preemption_onset=True)
    st = _status(_fig(windows=(w,), info=EngineInfo("m", False), buffer=None))
    (a,) = [a for a in st["advice"] if a["kind"] == "kv_pressure"]
    assert a["severity"] == "bad" and a["evidence"]["preemptions_per_minute"] == 2.5
    assert a["evidence"]["kv_usage_p95"] == 0.95
    assert "2.5 preemptions/min" in a["text"] and "p95 95 %" in a["text"]
    assert "--max-num-seqs" in a["text"] and "--kv-offloading-size" in a["text"]  # OFF: enable offloading


def test_a_known_tax_above_noise_gives_the_pressure_advice():
    w = replace(QUIET, recompute_tax=0.14)
    (a,) = [a for a in _status(_fig(windows=(w,)))["advice"] if a["kind"] == "kv_pressure"]
    assert a["evidence"]["recompute_tax"] == 0.14 and "+14.0 points" in a["text"]
    assert _kinds(_fig(windows=(replace(QUIET, recompute_tax=0.02),))) == ["nothing_to_do"]  # within noise


def test_the_pressure_advice_names_the_window_of_its_p95_where_the_header_names_another():
    """The advice's header is the regime's window (30s); a sign from a longer window (2m) names its window, and so
    does the p95 printed beside it (before: "KV pressure over the last 30s: requests waiting for KV capacity in 77 %
    of samples over the last 2m (mean 2.7), KV-cache usage p95 93 %", the 2m's p95 under the 30s's header)."""
    w30 = WindowFigures("30s", 30.0, 30.0, kv_usage_p95=0.61, above_threshold=True, preemptions_per_minute=0.0,
                        preemption_onset=False, requests_waiting_for_kv_capacity_share=0.2,
                        requests_waiting_for_kv_capacity=0.3)
    w2m = WindowFigures("2m", 120.0, 120.0, kv_usage_p95=0.93, above_threshold=True, preemptions_per_minute=0.0,
                        preemption_onset=False, requests_waiting_for_kv_capacity_share=0.77,
                        requests_waiting_for_kv_capacity=2.7)
    (a,) = [a for a in _status(_fig(windows=(w30, w2m)))["advice"] if a["kind"] == "kv_pressure"]
    assert a["text"].startswith("KV pressure over the last 30s: ")
    assert "77 % of samples over the last 2m" in a["text"] and "KV-cache usage p95 93 % over the last 2m." in a["text"]
    # the header's own window: no label (the golden texts keep their words)
    (b,) = [a for a in _status(_fig(windows=(replace(w30, requests_waiting_for_kv_capacity_share=0.8), w2m)))["advice"]
            if a["kind"] == "kv_pressure"]
    assert "KV-cache usage p95 61 %." in b["text"]


def test_a_provisional_tax_gives_the_evidence_advice_not_a_verdict():
    w = replace(QUIET, recompute_tax=0.14)
    st = _status(_fig(windows=(w,), tax_state="provisional", tax_reason="1 low-pressure window (3 needed)",
                      reference_windows=1))
    kinds = [a["kind"] for a in st["advice"]]
    assert "kv_pressure" not in kinds  # a tax on a reference not yet known is no evidence of pressure
    (a,) = [a for a in st["advice"] if a["kind"] == "evidence"]
    assert a["severity"] == "unknown" and a["evidence"]["figure"] == "tax"
    assert a["evidence"]["windows_needed"] == 2 and a["evidence"]["eta_seconds"] > 0
    assert "Recompute tax provisional: 1 low-pressure window (3 needed)" in a["text"]
    assert "configuring this server's low-pressure recomputed share" in a["text"] and "min" in a["text"]
    assert "reference_local_compute_share" not in a["text"]  # no setting name in prose


def test_a_provisional_regime_says_how_long_and_what_would_make_it_known_now():
    # below on low-pressure signs for one evidence window: known after QUIET_KNOWN_WINDOWS in a row
    ev = Evidence(windows=2, clean=1, pressured=1, unknown=0, rejected=0, span_seconds=60.0, oldest_wall=None,
                  newest_wall=None, low_pressure=1, quiet_streak=1)
    st = _status(_fig(regime_state="provisional", regime_reason="below: no preemption", evidence=ev))
    (a,) = [a for a in st["advice"] if a["kind"] == "evidence"]
    assert a["evidence"]["figure"] == "regime" and a["evidence"]["windows_needed"] == QUIET_KNOWN_WINDOWS - 1
    assert a["evidence"]["eta_seconds"] == 60.0 * (QUIET_KNOWN_WINDOWS - 1)
    assert "It needs 2 more low-pressure windows of 60 s in a row" in a["text"]
    one = _status(_fig(regime_state="provisional", regime_reason="below", evidence=replace(ev, quiet_streak=2)))
    assert "It needs 1 more low-pressure window of 60 s in a row" in one["advice"][0]["text"]  # agrees in number
    assert "--kv-cache-metrics" in a["text"] and a["evidence"]["kv_cache_metrics"] is False
    with_residency = (replace(QUIET, kv_evictions_per_prompt_block=0.2),)
    (a,) = [a for a in _status(_fig(regime_state="provisional", regime_reason="x", windows=with_residency,
                                    evidence=ev))["advice"] if a["kind"] == "evidence"]
    assert "--kv-cache-metrics" not in a["text"]


def test_collapse_and_stalled_engine():
    sig = CollapseResult(conditions=dict.fromkeys(CONDITIONS, True), signature=True, reason="yes",
                         recent_tokens_per_second=0.1, reference_tokens_per_second=50.0,
                         condition_sets={"classic": True, "stalled_engine": False})
    (a,) = [a for a in _status(_fig(collapse=sig))["advice"] if a["kind"] == "collapse"]
    assert a["severity"] == "bad" and "Collapse signature" in a["text"]
    assert a["evidence"]["reference_tokens_per_second"] == 50.0
    stalled = replace(sig, condition_sets={"classic": False, "stalled_engine": True})
    (a,) = [a for a in _status(_fig(collapse=stalled))["advice"] if a["kind"] == "stalled_engine"]
    assert "Restart" in a["text"] and a["evidence"]["condition_set"] == "stalled_engine"


def test_undersized_buffer_names_the_size_to_use():
    buf = replace(BUF_OK, undersized=True, recommended_bytes=27 * 2 ** 30, recommended_gib=27, residency_seconds=8.9)
    st = _status(_fig(buffer=buf))
    (a,) = [a for a in st["advice"] if a["kind"] == "undersized_buffer"]
    assert "--kv-offloading-size 27 (27 GiB)" in a["text"] and a["evidence"]["recommended_gib"] == 27
    assert a["text"] in st["recommendations"]
    # 18 MiB recommended: the flag in fractional GiB with the bytes beside it (whole GiB said 1, 57x the bytes)
    small = replace(buf, recommended_bytes=18 * 2 ** 20, recommended_gib=0.018)
    (a,) = [a for a in _status(_fig(buffer=small))["advice"] if a["kind"] == "undersized_buffer"]
    assert "--kv-offloading-size 0.018 (18 MiB) or more" in a["text"]


# --- the page's words for the evidence states ---------------------------------------------------------------------
def _measured_failure() -> dict:
    """The failure measured on a real engine: 86 % of prompts recomputed, 1-3 preemptions/min, a tax of +1.4
    points on a provisional reference, KV p95 under the configured threshold."""
    w = replace(QUIET, kv_usage_p95=0.7, preemptions_per_minute=2.0, preemption_onset=True, above_threshold=True,
                recompute_tax=0.014, token_shares={"local_compute": 0.86})
    return _status(_fig(windows=(w,), reference_share=0.846, tax_state="provisional",
                        tax_reason="1 low-pressure window (3 needed before it is known)", reference_windows=1,
                        regime_state="known",
                        regime_reason="above: 2.0 preemptions/min at p95 0.700, under the threshold in use 0.900"))


def test_a_provisional_tax_is_never_shown_as_a_plain_number():
    st = _measured_failure()
    tax = _words(page._tax_sentence(st))
    assert "provisional: 1 low-pressure window (3 needed before it is known)" in tax
    assert "+1.4" not in tax and "points" not in tax.split("The tax is")[0]
    assert "86.0 %" in tax  # the measured share is a fact
    table = _words(page.windows_table(st))
    assert "+1.4" not in table and "recompute tax (points) provisional" in table
    unknown = _status(_fig(windows=(replace(QUIET, recompute_tax=None),), tax_state="unknown",
                           tax_reason="no low-pressure window seen yet", reference_share=None))
    assert "unknown: no low-pressure window seen yet" in _words(page._tax_sentence(unknown))


def test_the_measured_failure_reads_as_pressure_not_as_nothing_to_do():
    st = _measured_failure()
    words = _words(page.server_panel(st))
    assert "saves nothing" not in words and "Nothing to do" not in words
    # the regime says why it is above although the p95 is under the threshold: the words match the numbers
    assert "KV pressure over the last 1m: above : 2.0 preemptions/min at p95 0.700, under the threshold in use 0.900" \
        in words
    assert "KV-cache usage p95 70.0 %" in words and "threshold in use 90.0 %" in words
    assert "is above the" not in words and "is under the" not in words  # no side claimed beside the verdict
    kinds = [a["kind"] for a in st["advice"]]
    assert kinds[0] == "kv_pressure" and "evidence" in kinds


def test_below_saves_nothing_only_when_the_regime_is_known_and_unpreempted():
    assert "Offloading saves nothing beyond noise in this regime" in _words(page._pressure(_status(_fig())))
    words = _words(page._pressure(_status(_fig(regime_state="provisional",
                                                regime_reason="below: no preemption; known with 3 windows"))))
    assert "saves nothing" not in words and "threshold in use 90.0 %" in words
    assert "below ( provisional: no preemption; known with 3 windows )" in words


def test_chips_are_coloured_by_meaning():
    c = {"signature": False, "conditions": {"requests_pending": False}}
    assert page.condition_meaning("offload_enabled", True, c) == "neutral"  # a fact
    assert page.condition_meaning("zero_preemptions", True, c) == "good"
    assert page.condition_meaning("engine_steps_stopped", True, c) == "neutral"  # idle, nothing pending
    assert page.condition_meaning("engine_steps_stopped", True, {**c, "conditions": {"requests_pending": True}}) \
        == "bad"
    assert page.condition_meaning("throughput_collapsed", None, c) == "unknown"
    assert page.condition_meaning("power_near_idle", True, {**c, "signature": True}) == "bad"
    html_text = page.server_panel(_status(_fig()))
    assert 'class="chip good" data-meaning="good">up<' in html_text
    assert "state-true alarm" not in html_text and "chip ok" not in html_text


def test_nothing_configured_and_nothing_answering_says_what_to_do():
    """kvwatt run with no server anywhere watches the default URL; down there, the advice names three ways on."""
    down = SourceStatus(source="vllm", server="default", up=False, reason="unreachable: connection refused",
                        duration_seconds=0.0, state="down")
    (a,) = _status(_fig(name="default", url=DEFAULT_SERVER_URL, status=down))["advice"]
    assert "No server is configured" in a["text"] and "vllm serve" in a["text"]
    assert "--server NAME=URL" in a["text"] and "kvwatt demo" in a["text"]
    (configured,) = _status(_fig(name="default", url="http://elsewhere:8000", status=down))["advice"]
    assert "kvwatt demo" not in configured["text"]


def test_the_page_asks_for_kv_cache_metrics_where_the_advice_does_and_only_there():
    """The page renders the model's --kv-cache-metrics hint beside the regime; it has no rule of its own (before:
    page.py decided with its own copy of the model's rule, and showed it whatever the advice said)."""
    ev = Evidence(windows=2, clean=1, pressured=1, unknown=0, rejected=0, span_seconds=60.0, oldest_wall=None,
                  newest_wall=None, low_pressure=1, quiet_streak=1)
    st = _status(_fig(regime_state="provisional", regime_reason="below: no preemption", evidence=ev))
    (a,) = [a for a in st["advice"] if a["kind"] == "evidence" and a["evidence"]["figure"] == "regime"]
    assert KV_CACHE_METRICS_HINT in a["text"]  # the model asks: a vLLM server without residency figures
    hint = 'data-field="kv-cache-metrics"'
    assert hint in page._pressure(st)
    a["text"] = a["text"].replace(KV_CACHE_METRICS_HINT, "")  # the model does not ask: the page does not either
    assert st["regime_state"] == "provisional" and hint not in page._pressure(st)
    with_residency = (replace(QUIET, kv_evictions_per_prompt_block=0.2),)
    st = _status(_fig(regime_state="provisional", regime_reason="x", windows=with_residency, evidence=ev))
    assert hint not in page._pressure(st)
    (a,) = [a for a in st["advice"] if a["kind"] == "evidence" and a["evidence"]["figure"] == "regime"]
    a["text"] += " " + KV_CACHE_METRICS_HINT  # whatever the advice says is what the page shows
    assert hint in page._pressure(st)
