"""One hop from a metric to its formula: for every family of the catalog (all of them, each run: the check is
a few milliseconds a family; it once picked 8 a day at random), ``computes`` resolves to a
function defined in exporter/derive/ -- each kind's, where there are several -- or is a NotDerived whose kind
is a named exception with its reason and whose producer lives outside derive/; and the README reference's
"computed in" column for that family is exactly that. tests/test_catalog.py proves each is really called
for its series; this file proves it is the formula, not a dispatcher or a caller of it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from exporter import catalog

README = Path(__file__).resolve().parent.parent / "README.md"


def formula_problems(d: catalog.MetricDef) -> list[str]:
    """What keeps ``d`` from being one hop from its formula (empty: nothing)."""
    c = d.computes
    if isinstance(c, catalog.NotDerived):
        out = [] if c.kind in catalog.NOT_DERIVED else [f"{d.name}: {c.kind!r} is not a named exception"]
        out += [] if c.why.strip() else [f"{d.name}: a NotDerived without its reason"]
        if c.where.startswith("derive."):
            out.append(f"{d.name}: {c.where} is in derive/: name it as the formula, not as an exception")
        elif not callable(catalog.formula(c.where)):
            out.append(f"{d.name}: {c.where} is not callable")
        return out
    wheres = (c,) if isinstance(c, str) else c
    if not isinstance(wheres, tuple) or not wheres or not all(isinstance(w, str) for w in wheres):
        return [f"{d.name}: computes={c!r} is neither a dotted name, a tuple of them, nor a NotDerived"]
    out = []
    for where in wheres:
        fn = catalog.formula(where)
        if not inspect.isfunction(fn) or not fn.__module__.startswith("exporter.derive."):
            out.append(f"{d.name}: {where} is not a function defined in exporter/derive/")
        elif f"{fn.__module__.removeprefix('exporter.')}.{fn.__qualname__}" != where:
            out.append(f"{d.name}: {where} is {fn.__module__}.{fn.__qualname__} (imported from elsewhere)")
    return out


def readme_computed_in(name: str) -> list[str]:
    """The "computed in" cell of ``name``'s row in the README reference, as its dotted names."""
    rows = [line for line in README.read_text().splitlines() if line.startswith(f"| `{name}`")]
    assert len(rows) == 1, f"README.md: {len(rows)} rows for {name}"
    cell = rows[0].split(" | ")[4]
    return [part.strip().strip("`") for part in cell.split(",")]


@pytest.mark.parametrize("d", catalog.METRICS, ids=lambda d: d.name)
def test_every_family_is_one_hop_from_its_formula(d):
    assert not formula_problems(d), "; ".join(formula_problems(d))
    assert readme_computed_in(d.name) == list(d.wheres), f"README row of {d.name}"


def test_each_kind_of_de_names_its_own_formula():
    """dE's baselines are four formulas, not the dispatcher that picks among them; only paired and recorded
    measure a throughput."""
    kinds = ("paired", "recorded", "estimated", "potential")
    assert catalog.get("kvwatt_energy_saving_ratio").wheres == tuple(f"derive.economics.{k}" for k in kinds)
    assert catalog.get("kvwatt_throughput_gain_ratio").wheres == tuple(f"derive.economics.{k}" for k in kinds[:2])


@pytest.mark.parametrize("computes, complaint", [
    ("model.offload.savings", "not a function defined in exporter/derive/"),  # the dispatcher
    ("derive.energy.prompt_attribution.__call__", "not a function defined in exporter/derive/"),
    (catalog.NotDerived("reading", "derive.recompute.recompute_tax", "x"), "is in derive/"),
    (catalog.NotDerived("guess", "sources.vllm.extract", "x"), "not a named exception"),
    (catalog.NotDerived("reading", "sources.vllm.extract", " "), "without its reason"),
    (("derive.economics.paired", 3), "neither a dotted name"),
])
def test_the_check_refuses_what_is_not_the_formula(computes, complaint):
    from dataclasses import replace
    d = replace(catalog.get("kvwatt_recompute_tax_ratio"), computes=computes)
    assert any(complaint in p for p in formula_problems(d)), formula_problems(d)


def test_the_readme_column_is_read_right():
    assert readme_computed_in("kvwatt_recompute_tax_ratio") == ["derive.recompute.recompute_tax"]
