"""One home per figure: every series kvwatt exports and every figure key of /api/status has exactly one
declaration (exporter.catalog), and the page and the README take their rows from the same declarations.

The check walks a real /api/status: the golden scenario (tests/test_golden.py) through Daemon.step(), its
snapshot serialised by web.status_json. A key of a server's or a window's dict is owned by a declaration's
status key, by a JSON block of a catalog section (which names the declarations it serialises), or by the dict's
own structure (a window's length, a server's windows); it must have exactly one owner. A declaration must have
a status key found in that status, be named by a block, or say why it is elsewhere (catalog.Elsewhere).
The negative tests run the same check on a doctored catalog: a declaration without a JSON key, a JSON key
without a declaration, two owners for one key, a block naming a family the catalog lacks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from exporter import catalog
from exporter.catalog import SERVER, WINDOW, Elsewhere, MetricDef, StatusKey, Words
from exporter.serve import page
from exporter.serve.collector import families
from exporter.serve.web import status_json
from tests import test_golden as golden

STRUCTURE = {WINDOW: {"seconds"}, SERVER: {"windows"}}  # the dicts' own shape, not figures


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    snap = golden.run_scenario(tmp_path_factory.mktemp("figures")).snapshot
    return snap, status_json(snap)


def _owners(scope: str, key: str, metrics, blocks) -> list[str]:
    out = [d.name for d in metrics
           if isinstance(d.status, StatusKey) and (d.status.scope, d.status.key) == (scope, key)]
    out += [f"block({', '.join(b.serialises)})" for b in blocks if key in b.keys]
    return out + (["structure"] if key in STRUCTURE[scope] else [])


WINDOW_BLOCKS = tuple(b for b in catalog.BLOCKS if b.scope == WINDOW)
SERVER_BLOCKS = tuple(b for b in catalog.BLOCKS if b.scope == SERVER)


def problems(snap, status: dict, metrics=catalog.METRICS, window_blocks=WINDOW_BLOCKS,
             server_blocks=SERVER_BLOCKS) -> list[str]:
    out = []
    names = [d.name for d in metrics]
    out += [f"{n}: declared {names.count(n)} times" for n in sorted(set(names)) if names.count(n) > 1]
    exported = [f.name + ("_total" if f.type == "counter" else "") for f in families(snap)]  # as on the wire
    out += [f"{n}: exported without a declaration" for n in exported if n not in names]
    seen = {WINDOW: set(), SERVER: set()}
    blocks = {WINDOW: window_blocks, SERVER: server_blocks}
    for v, js in zip(snap.servers, status["servers"], strict=True):
        dicts = [(SERVER, v, js)] + [(WINDOW, w, wjs) for w, wjs in zip(v.windows, js["windows"].values(), strict=True)]
        for scope, fig, d in dicts:
            seen[scope] |= set(d)
            for key in d:
                owners = _owners(scope, key, metrics, blocks[scope])
                if len(owners) != 1:
                    out.append(f"{scope} key {key!r}: {len(owners)} owners {owners}, want exactly one declaration")
            for b in blocks[scope]:
                extra = set(b.write(fig)) - set(b.keys)
                if extra:
                    out.append(f"block of {b.serialises[0]}: writes undeclared keys {sorted(extra)}")
    in_blocks = {n for bs in blocks.values() for b in bs for n in b.serialises}
    for d in metrics:
        if isinstance(d.status, StatusKey):
            if d.status.key not in seen[d.status.scope]:
                out.append(f"{d.name}: its {d.status.scope} key {d.status.key!r} is nowhere in /api/status")
        elif isinstance(d.status, Elsewhere):
            if not d.status.why.strip():
                out.append(f"{d.name}: Elsewhere without a reason")
        elif d.name not in in_blocks:
            out.append(f"{d.name}: no /api/status key, no block serialises it, and no Elsewhere reason")
    out += [f"a block names {n}, which is not a catalog family"
            for bs in blocks.values() for b in bs for n in b.serialises if n not in names]
    return out


def test_every_family_and_every_status_key_has_exactly_one_declaration(scenario):
    snap, status = scenario
    assert problems(snap, status) == []


def test_the_status_keys_that_were_missing_are_there(scenario):
    """offload reads, FLOPs, kappa per window and prompt energy: in the catalog for long, in /api/status now."""
    _, status = scenario
    on = next(s for s in status["servers"] if s["server"] == "on")
    w = on["windows"]["1m"]
    assert w["offload_read_bytes_per_second"] > 0
    assert w["estimated_flops_per_second"] > 0 and w["estimated_flops_per_generated_token"] > 0
    assert w["cached_to_prefill_ratio"] == pytest.approx(0.2)
    assert set(w["prompt_energy_per_token_joules"]) == {"local_compute", "external_kv_transfer"}


def _doctor(name: str, **changes) -> tuple[MetricDef, ...]:
    return tuple(replace(d, **changes) if d.name == name else d for d in catalog.METRICS)


def test_a_declaration_without_a_json_key_fails(scenario):
    snap, status = scenario
    found = problems(snap, status, _doctor("kvwatt_kv_cache_usage_p95_ratio", status=None))
    assert any(p.startswith("kvwatt_kv_cache_usage_p95_ratio: no /api/status key") for p in found), found
    assert any("'kv_usage_p95': 0 owners" in p for p in found), found


def test_a_json_key_without_a_declaration_fails(scenario):
    snap, status = scenario
    fewer = tuple(d for d in catalog.METRICS if d.name != "kvwatt_offload_read_bytes_per_second")
    found = problems(snap, status, fewer)
    assert any("'offload_read_bytes_per_second': 0 owners" in p for p in found), found
    assert "kvwatt_offload_read_bytes_per_second: exported without a declaration" in found


def test_a_key_with_two_declarations_fails(scenario):
    snap, status = scenario
    twin = replace(catalog.get("kvwatt_kv_cache_usage_max_ratio"), name="kvwatt_twin_ratio",
                   status=catalog.window_key("kv_usage_p95", lambda w: w.kv_usage_p95))
    found = problems(snap, status, catalog.METRICS + (twin,))
    assert any("'kv_usage_p95': 2 owners" in p for p in found), found


def test_a_block_naming_a_family_outside_the_catalog_fails(scenario):
    snap, status = scenario
    ghost = MetricDef(name="kvwatt_ghost_ratio", type="gauge", labels=("server",), help="never exported",
                      computes=catalog.NotDerived("info", "runtime.build.build_info", "a test family"),
                      section="Exporter",
                      fill=lambda _snap: (), status=Elsewhere("test"))
    blocks = SERVER_BLOCKS + (catalog.server_block(("ghost",), (ghost.name,), lambda v: {}),)
    found = problems(snap, status, server_blocks=blocks)
    assert "a block names kvwatt_ghost_ratio, which is not a catalog family" in found


def test_a_block_writing_a_key_it_does_not_declare_fails(scenario):
    snap, status = scenario
    sloppy = catalog.server_block(("kappa",), SERVER_BLOCKS[0].serialises, lambda v: {"kappa": 1, "kappa_extra": 2})
    found = problems(snap, status, server_blocks=SERVER_BLOCKS + (sloppy,))
    assert any("writes undeclared keys ['kappa_extra']" in p for p in found), found


def test_a_declaration_names_its_formula_directly():
    """``where`` (the README's "computed in") is derived from ``computes``, so they cannot disagree: each kind's
    formula for dE, the producer of a figure with no formula in derive/."""
    d = catalog.get("kvwatt_energy_saving_ratio")
    assert d.wheres == tuple(f"derive.economics.{k}" for k in ("paired", "recorded", "estimated", "potential"))
    assert all(callable(catalog.formula(w)) for w in d.wheres)
    assert d.where == ", ".join(d.wheres)
    age = catalog.get("kvwatt_idle_baseline_age_seconds")
    assert age.where == "idle.baseline.Baseline.age_seconds" and age.computes.kind == "bookkeeping"


def test_one_declaration_is_enough_for_json_series_page_and_reference(scenario, monkeypatch):
    """Adding a figure = one declaration (plus its function): the series, the /api/status key, the page row and
    the README row all follow from it."""
    snap, _ = scenario
    new = MetricDef(name="kvwatt_test_covered_twice_seconds", type="gauge", labels=("server", "window"),
                    help="Twice the coverage.", computes="derive.pressure.rate_per_second", section="Sources",
                    status=catalog.window_key("test_covered_twice", lambda w: 2 * w.covered_seconds),
                    words=(Words("twice covered", "seconds"),))
    sources = next(s for s in catalog.SECTIONS if s.name == "Sources")  # the section of its idea
    sections = tuple(replace(s, metrics=s.metrics + (new,)) if s is sources else s for s in catalog.SECTIONS)
    monkeypatch.setattr(catalog, "SECTIONS", sections)
    monkeypatch.setattr(catalog, "METRICS", tuple(m for s in sections for m in s.metrics))
    fams = {f.name: f for f in families(snap)}
    assert {s.labels["window"] for s in fams[new.name].samples} == {"30s", "1m"}
    js = status_json(snap)
    w = js["servers"][0]["windows"]["1m"]
    assert w["test_covered_twice"] == 2 * w["covered_seconds"]
    keys = list(w)
    last = [m.status.key for m in sources.metrics
            if isinstance(m.status, catalog.StatusKey) and m.status.scope == "window"][-1]
    assert keys[keys.index(last) + 1] == "test_covered_twice"  # in its section's place, catalog order
    assert "<th>twice covered</th>" in page.windows_table(js["servers"][0])
    from exporter.tooling import readme_tables
    assert "`kvwatt_test_covered_twice_seconds`" in readme_tables.metric_table()
    assert "`windows.<window>.test_covered_twice`" in readme_tables.metric_table()


def test_status_keys_are_in_catalog_order(scenario):
    """Each dict of /api/status writes its keys in catalog order (catalog.SECTIONS): section by section, its
    figures' keys, then its blocks' (before: two hand-typed lists in serve/web.py kept a historical order)."""
    _, status = scenario
    for scope, dicts in ((SERVER, status["servers"]),
                         (WINDOW, [w for s in status["servers"] for w in s["windows"].values()])):
        want = []
        for section in catalog.SECTIONS:
            want += [d.status.key for d in section.metrics
                     if isinstance(d.status, StatusKey) and d.status.scope == scope]
            want += [k for b in section.blocks if b.scope == scope for k in b.keys]
        for d in dicts:
            got = [k for k in d if k not in STRUCTURE[scope]]
            assert got == [k for k in want if k in d], (scope, got)
    assert list(status["servers"][0])[-1] == "windows" and list(status["servers"][0]["windows"]["1m"])[0] == "seconds"


def test_page_rows_are_the_declared_words(scenario):
    _, status = scenario
    server = status["servers"][1]
    table = page.windows_table(server)
    declared = [w for d in catalog.METRICS for w in d.words]
    shown = [label for label, _ in page.window_rows(server)]
    # only a figure the server cannot have (declared absent_when_none, null in every window) has no row
    left_out = [w for w in declared if w.label not in shown]
    assert all(w.absent_when_none for w in left_out) and "KV pools above threshold" in [w.label for w in left_out]
    assert shown and all(f"<th>{label}</th>" in table for label in shown)
    assert table.count("<tr>") == len(shown) + 1  # the header row and one per declared row shown


def test_a_one_pool_server_has_no_pools_row_and_a_several_pool_one_has(scenario):
    _, status = scenario
    server = status["servers"][1]
    assert "KV pools above threshold" not in page.windows_table(server)  # one pool: the figure cannot exist
    for w in server["windows"].values():
        w["kv_pools_above_threshold"] = 1
    assert "<th>KV pools above threshold</th>" in page.windows_table(server)


def test_a_figure_without_a_fill_or_status_key_is_refused():
    with pytest.raises(ValueError, match="no fill and no status key"):
        MetricDef(name="kvwatt_x", type="gauge", labels=("server",), help="x", computes="runtime.build.build_info",
                  section="Exporter", status=None)
