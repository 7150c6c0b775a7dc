"""The longer windows of a node with many servers are rebuilt in turn (model/window_state.py WindowState.figures,
rules.LONG_WINDOWS_BUILT_PER_TICK; docs/architecture.md "Windows"): a long window's figures are, at the tick they
are built, exactly the figures built every tick; between builds they are the last ones, served with their age
(/api/status ``age_seconds``, kvwatt_window_age_seconds); the shortest window is built every tick; the servers
take turns, so a tick builds the long windows of 1/N of them; a server that goes down keeps nothing."""

from __future__ import annotations

from dataclasses import replace

from exporter import rules
from exporter.model import Model
from exporter.model import server as server_model
from exporter.serve.web import status_json
from tests import test_golden as golden

TICKS = 80  # the golden scenario's first 80 s: servers loaded, one down for a while, the windows filling


def _models(tmp_path, monkeypatch):
    """The golden scenario's ticks into two models: every window built every tick (4 servers: the default), and
    staggered (one server's long windows a tick: every 4 ticks each)."""
    sc = golden.Scenario(tmp_path)
    every_tick = Model(sc.cfg, wall_clock=lambda: golden.WALL)
    monkeypatch.setattr(server_model, "_PER_TICK", 1)
    staggered = Model(sc.cfg, wall_clock=lambda: golden.WALL)
    return sc, every_tick, staggered


def test_a_long_window_rebuilt_in_turn_is_the_every_tick_figures_of_the_tick_it_was_built(tmp_path, monkeypatch):
    sc, every_tick, staggered = _models(tmp_path, monkeypatch)
    servers = len(sc.cfg.servers)
    short, long_ = sorted(sc.cfg.windows_seconds)
    history: dict[tuple[str, int], object] = {}  # (server, tick) -> the every-tick long window's figures
    ages_seen, reused = set(), 0
    for t in range(1, TICKS + 1):
        tick = sc.tick(t)
        every_tick.ingest(tick)
        staggered.ingest(tick)
        want, got = every_tick.snapshot(), staggered.snapshot()
        built_now = 0
        for w_srv, g_srv in zip(want.servers, got.servers, strict=True):
            assert [w.seconds for w in g_srv.windows] == [short, long_]
            assert g_srv.windows[0] == w_srv.windows[0]  # the shortest window: every tick, as before
            history[(w_srv.name, t)] = w_srv.windows[1]
            g = g_srv.windows[1]
            age = g.age_seconds
            assert 0 <= age < servers * sc.cfg.interval_seconds  # at most every - 1 intervals old
            built_at = round(t - age)
            # at the tick it was built it is exactly the figures built every tick (the age aside)
            assert replace(g, age_seconds=0.0) == history[(w_srv.name, built_at)], (w_srv.name, t, age)
            built_now += age == 0
            reused += age > 0
            ages_seen.add(age)
            if not g_srv.status.up:
                assert age == 0  # down: nothing kept, the window's unknown figures of now
        if t > servers:  # the servers take turns: one server's long window a tick (those up with data)
            assert built_now <= 1 + sum(not s.status.up for s in got.servers)
    assert reused > TICKS  # most long windows were served kept
    assert ages_seen >= {0.0, 1.0, 2.0, 3.0}


def test_the_age_is_said_in_api_status(tmp_path, monkeypatch):
    sc, _, staggered = _models(tmp_path, monkeypatch)
    for t in range(1, 40):
        staggered.ingest(sc.tick(t))
        snap = staggered.snapshot()  # a tick's figures, as Daemon.step builds them
    st = status_json(snap)
    ages = {(s["server"], label): w["age_seconds"] for s in st["servers"] for label, w in s["windows"].items()}
    assert {a for (_, label), a in ages.items() if label == "30s"} == {0.0}  # the shortest: this tick's
    assert max(a for (_, label), a in ages.items() if label == "1m") > 0  # a long one kept from an earlier tick


def test_a_node_of_at_most_the_rule_builds_every_window_every_tick(tmp_path):
    """The default golden scenario (4 servers <= rules.LONG_WINDOWS_BUILT_PER_TICK): nothing kept, no age."""
    sc = golden.Scenario(tmp_path)
    assert len(sc.cfg.servers) <= rules.LONG_WINDOWS_BUILT_PER_TICK.default
    model = Model(sc.cfg, wall_clock=lambda: golden.WALL)
    for t in range(1, 30):
        model.ingest(sc.tick(t))
        assert all(w.age_seconds == 0.0 for s in model.snapshot().servers for w in s.windows)
