"""The figures of a tick are assembled once (docs/architecture.md, data flow): Model.snapshot() constructs each
window's WindowFigures and each server's ServerFigures exactly once, money and carbon and advice included (none is
copied to add them); and the page's answer to "is offloading paying?" is the model's (the ``answer`` of
/api/status' energy_saving), which the page only words, never re-judges."""

from __future__ import annotations

import copy
from collections import Counter

from exporter.figures import SavingFigure, ServerFigures, WindowFigures
from exporter.model import Model
from exporter.runtime.daemon import Daemon
from exporter.runtime.sampler import Sampler
from exporter.serve import page
from exporter.serve.web import status_json
from tests import test_golden as golden


def _daemon(tmp_path, ticks: int = 40) -> Daemon:
    sc = golden.Scenario(tmp_path)  # prices configured: every window gets its costs
    daemon = Daemon(sc.cfg, sampler=Sampler(sc.cfg, energy=False), model=Model(sc.cfg, wall_clock=lambda: golden.WALL))
    for t in range(1, ticks + 1):
        daemon.step(sc.tick(t))
    return daemon


def _count_constructions(monkeypatch) -> Counter:
    """Counts every __init__ of the two figure types (dataclasses.replace constructs a new one too)."""
    counts: Counter = Counter()
    for cls in (WindowFigures, ServerFigures):
        def counted(self, *args, _init=cls.__init__, _name=cls.__name__, **kw):
            counts[_name] += 1
            _init(self, *args, **kw)
        monkeypatch.setattr(cls, "__init__", counted)
    return counts


def test_each_figure_is_built_once_per_tick(tmp_path, monkeypatch):
    daemon = _daemon(tmp_path)
    model = daemon.model
    counts = _count_constructions(monkeypatch)
    snap = model.snapshot()
    servers, windows = len(model.servers), len(model.cfg.windows_seconds)
    assert counts == Counter({"ServerFigures": servers, "WindowFigures": servers * windows})
    # what used to be added by copying is there: the costs of every window with energy, the advice
    assert any(w.costs for s in snap.servers for w in s.windows)
    assert all(w.costs or not w.energy for s in snap.servers for w in s.windows)
    assert all(s.advice for s in snap.servers)
    assert all(s.recommendations == tuple(a.text for a in s.advice if a.kind != "nothing_to_do")
               for s in snap.servers)


def test_the_answer_is_the_models_collapse_verdict():
    saves = SavingFigure(baseline="estimated", energy_saving=0.10, energy_saving_stderr=0.01, windows=5)
    assert saves.answer == "saves" == saves.verdict
    collapsed = SavingFigure(baseline="estimated", energy_saving=0.10, energy_saving_stderr=0.01, windows=5,
                             collapse_holds=True)
    assert collapsed.answer == "collapse" and collapsed.verdict == "saves"
    unknown = SavingFigure(baseline="estimated", energy_saving=None, energy_saving_stderr=None, windows=0,
                           collapse_holds=True)
    assert unknown.answer == "unknown"  # no dE: nothing for the collapse to override


def _with_saving(status: dict) -> dict:
    for s in status["servers"]:
        lw = page._longest(s)
        savings = (lw[1].get("energy_saving") or {}) if lw is not None else {}
        if savings and next(iter(savings.values()))["dE"] is not None:
            return s
    raise AssertionError("the golden scenario has a server with a known dE")


def test_the_page_words_the_answer_of_api_status_and_decides_nothing(tmp_path):
    status = status_json(_daemon(tmp_path).snapshot)
    s = _with_saving(status)
    _, kind, sv = page._first_saving(s)
    assert sv["answer"] == sv["verdict"] and not (s.get("collapse") or {}).get("signature")

    told_collapse = copy.deepcopy(s)  # /api/status says collapse; nothing else on the page says so
    page._first_saving(told_collapse)[2]["answer"] = "collapse"
    assert "No, whatever dE says" in page.paying(told_collapse)
    assert 'class="verdict costs"' in page.paying(told_collapse)

    told_saves = copy.deepcopy(s)  # a collapse signature in the JSON, but the answer says saves: the page follows it
    told_saves["collapse"] = dict(told_saves.get("collapse") or {}, signature=True)
    told_saves["offload_enabled"] = True
    page._first_saving(told_saves)[2]["answer"] = "saves"
    assert "whatever dE says" not in page.paying(told_saves)
    assert 'class="verdict saves"' in page.paying(told_saves)
