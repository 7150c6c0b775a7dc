"""One window's KV-pressure evidence has one type and one builder (issue 40 item 2): ``WindowEvidence`` is
constructed only by ``derive/pressure_evidence.window_evidence`` in the daemon and the lab (an AST scan of every
production module), and the regime, the threshold learner and the lab's run figures all take it from there, so
each applies the same guards (the preemption counter's glitch guard, the prompt-token guard).

One other constructor is allowed, ``recorded_evidence``, because two readers hold a window's evidence with no
aggregate to build it from: the state file's parser (a held window read back from evidence-windows.json at start,
model/evidence_book.parse_entry) and the lab's sweep analysis (an OFF condition's means over its runs,
experiment/analysis.off_points, each run's figures built by ``window_evidence``). It fills only what was recorded
(every recorded figure came out of ``window_evidence``) and leaves the rest unknown; it is called from those two
places only. The threshold's ``PressurePoint`` holds the evidence as its ``evidence`` and repeats none of it."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from exporter.derive.pressure import plausible_preemptions
from exporter.derive.pressure_evidence import WindowEvidence, recorded_evidence, window_evidence
from exporter.derive.threshold import PressurePoint
from exporter.model import evidence_book
from exporter.samples import Interval
from exporter.store import aggregate_of

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = (ROOT / "exporter", ROOT / "lab" / "kvwatt_lab")
BUILDER = ("exporter/derive/pressure_evidence.py", "window_evidence")
RESTORE = ("exporter/derive/pressure_evidence.py", "recorded_evidence")  # figures recorded, no aggregate (above)
RESTORED_BY = {("exporter/model/evidence_book.py", "parse_entry"), ("lab/kvwatt_lab/experiment/analysis.py",
                                                                     "off_points")}
READERS = ("exporter/model/window_state.py", "exporter/model/pressure/learner.py",
           "lab/kvwatt_lab/experiment/measure.py")


def _called(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def constructions(source: str, name: str = "WindowEvidence") -> list[tuple[str, int]]:
    """(enclosing function, line) of every call of ``name`` (or a name it is imported as) in a module's source
    ("" at module level)."""
    tree = ast.parse(source)
    names = {name} | {a.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                      for a in node.names if a.name == name and a.asname}
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Call) and _called(child) in names:
                found.append((where, child.lineno))
            visit(child, inner)

    visit(tree, "")
    return found


def _production_files() -> list[Path]:
    return sorted(p for root in PRODUCTION for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_scan_finds_a_construction_and_its_function():
    source = ("from exporter.derive import pressure_evidence as pe\n"
              "def f(agg):\n    return pe.WindowEvidence(p95=None)\n"
              "class A:\n    def g(self):\n        return WindowEvidence(p95=None)\n"
              "from exporter.derive.pressure_evidence import WindowEvidence as E\nx = E(p95=None)\n")
    assert constructions(source) == [("f", 3), ("g", 6), ("", 8)]


def _calls(name: str) -> dict[str, list[tuple[str, int]]]:
    """path -> (function, line) of each call of ``name`` in the production modules that name it."""
    texts = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in _production_files()}
    return {path: constructions(text, name) for path, text in texts.items() if name in text}  # parse few


def test_only_the_builder_and_the_restore_construct_a_windows_evidence():
    where = _calls("WindowEvidence")
    assert sorted(f for f, _ in where.get(BUILDER[0], [])) == sorted([BUILDER[1], RESTORE[1]]), \
        "the builder or the restore no longer builds the evidence"
    others = sorted(f"{path}:{line} ({fn or 'module level'})" for path, calls in where.items()
                    for fn, line in calls if (path, fn) not in (BUILDER, RESTORE))
    assert not others, "WindowEvidence constructed outside window_evidence and recorded_evidence:\n" + \
        "\n".join(others)


def test_the_restore_is_used_only_where_there_is_no_aggregate():
    found = {(path, fn) for path, calls in _calls("recorded_evidence").items() for fn, _ in calls}
    assert found == RESTORED_BY, f"recorded_evidence called from {sorted(found - RESTORED_BY)}; " \
        "a window with an aggregate has its evidence built by window_evidence (its guards apply)"


def test_a_pressure_point_holds_the_evidence_and_repeats_none_of_it():
    own = {f.name for f in fields(PressurePoint)}
    assert own == {"evidence", "weight", "t", "wall"}
    assert not own & {f.name for f in fields(WindowEvidence)}


def test_a_held_window_reads_back_as_it_was_written():
    """The evidence file's entry of a live window's point, parsed back through the restore, writes the same
    entry (the file's keys and values are the evidence's figures, and only those)."""
    samples = [Interval(t0=t, t1=t + 1.0, deltas={"preemptions": 1.0 if t == 30 else 0.0,
                                                  "prompt_local_cache_hit": 150.0, "prompt_local_compute": 50.0},
                        gauges={"kv_usage": 0.4 + t / 200, "running": 1.0, "waiting": 0.0,
                         "waiting_capacity": 1.0 if t % 4 == 0 else 0.0}) for t in range(60)]
    ev = window_evidence(aggregate_of(samples), window_seconds=60.0, reference_share=0.1, reference_spread=0.02)
    point = PressurePoint(evidence=ev, weight=0.5, t=60.0, wall=1_000_060.0)
    entry = evidence_book._entry(point, 1_000_100.0)
    assert set(entry) == {"p95", "low", "high", "max", "preemptions_per_minute", "tax", "tax_se", "weight", "at",
                          "capacity_share"} and entry["capacity_share"] == 0.25 and entry["tax"] is not None
    back = evidence_book.parse_entry(entry, 1_000_100.0)
    assert evidence_book._entry(back, 1_000_100.0) == entry
    assert back.evidence == recorded_evidence(p95=ev.p95.value, p95_low=ev.p95.low, p95_high=ev.p95.high,
                                              preemptions_per_minute=ev.preemptions_per_minute, tax=ev.tax,
                                              tax_se=ev.tax_se, kv_max=ev.kv_max, capacity_share=0.25)


@pytest.mark.parametrize("path", READERS)
def test_the_regime_the_learner_and_the_lab_read_the_one_builder(path):
    assert constructions((ROOT / path).read_text(encoding="utf-8"), "window_evidence"), \
        f"{path} no longer builds its window's pressure evidence with window_evidence"


def test_the_type_is_frozen_and_keyword_only():
    ev = window_evidence(aggregate_of([Interval(t0=0.0, t1=1.0, deltas={}, gauges={"kv_usage": 0.5})]),
                         window_seconds=1.0)
    with pytest.raises(TypeError):
        WindowEvidence(*[None] * 14)  # positional arguments are refused
    with pytest.raises(AttributeError):
        ev.tax = 0.1  # frozen


def _window(preemptions_at_30: float) -> list[Interval]:
    return [Interval(t0=t, t1=t + 1.0, deltas={"preemptions": preemptions_at_30 if t == 30 else 0.0,
                                               "prompt_tokens": 10.0, "prompt_tokens_local_compute": 10.0},
                     gauges={"kv_usage": 0.5, "running": 1.0, "waiting": 0.0}) for t in range(60)]


def test_a_glitched_counter_is_marked_and_gives_no_rate():
    agg = aggregate_of(_window(1e9))
    ev = window_evidence(agg, window_seconds=60.0)
    assert agg.delta("preemptions") > plausible_preemptions(agg)
    assert (ev.preemptions, ev.preemptions_plausible, ev.preemptions_per_minute, ev.onset) == (1e9, False, None, None)


def test_a_plausible_count_is_a_rate_and_onset_over_a_covered_window():
    ev = window_evidence(aggregate_of(_window(6.0)), window_seconds=60.0, onset_per_minute=5.0)
    assert (ev.preemptions_plausible, ev.preemptions_per_minute, ev.onset, ev.covered_ratio) == (True, 6.0, True, 1.0)
    half = window_evidence(aggregate_of(_window(6.0)), window_seconds=240.0, onset_per_minute=5.0)
    assert half.covered_ratio == 0.25 and half.onset is None  # not covered enough to call it sustained
