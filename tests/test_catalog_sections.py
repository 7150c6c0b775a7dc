"""The catalog grouped by idea (issue 40 item 1): one Section per idea, in one declared order (catalog.SECTIONS);
METRICS, the README's tables, /metrics and /api/status's keys follow it, and nothing else orders them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from exporter import catalog
from exporter.catalog import SERVER, WINDOW, Section, StatusKey


def test_metrics_is_the_sections_concatenated_in_their_declared_order():
    assert catalog.METRICS == tuple(m for s in catalog.SECTIONS for m in s.metrics)
    assert catalog.BLOCKS == tuple(b for s in catalog.SECTIONS for b in s.blocks)
    names = [s.name for s in catalog.SECTIONS]
    assert len(names) == len(set(names)), names


def test_each_section_is_one_run_of_metrics_so_the_readme_tables_are_in_exposition_order():
    runs = [m.section for i, m in enumerate(catalog.METRICS) if i == 0 or catalog.METRICS[i - 1].section != m.section]
    assert runs == [s.name for s in catalog.SECTIONS if s.metrics]


def test_a_section_refuses_a_declaration_of_another_section():
    regime = next(s for s in catalog.SECTIONS if s.name == "KV pressure regime")
    stray = replace(catalog.get("kvwatt_recompute_tax_ratio"))  # says section="Recomputation tax"
    with pytest.raises(ValueError, match="kvwatt_recompute_tax_ratio"):
        Section(name=regime.name, metrics=regime.metrics + (stray,))


def test_a_figure_and_its_neighbours_share_an_idea():
    """The groups the golden files' order once forced are gone: FLOPs and the tax are not the regime's, collapse,
    dE and kappa not the traffic's."""
    where = {m.name: m.section for m in catalog.METRICS}
    assert where["kvwatt_estimated_flops_per_second"] == "Tokens and FLOPs"
    assert where["kvwatt_recompute_tax_ratio"] == where["kvwatt_recompute_reference_share_ratio"] == "Recomputation tax"
    assert where["kvwatt_kv_cache_usage_p95_ratio"] == where["kvwatt_kv_pressure_regime_above"] == "KV pressure regime"
    assert where["kvwatt_collapse_signature"] == "Collapse"
    assert (where["kvwatt_energy_saving_ratio"] == where["kvwatt_critical_cached_to_prefill_ratio"]
            == "Offload economics")
    assert where["kvwatt_offload_buffer_residency_target_seconds"] == where["kvwatt_offload_buffer_undersized"]


@pytest.mark.parametrize("scope", [WINDOW, SERVER])
def test_every_block_serialises_catalog_families_of_its_scope(scope):
    blocks = [b for b in catalog.BLOCKS if b.scope == scope]
    assert blocks and all(n in catalog.BY_NAME for b in blocks for n in b.serialises)
    keys = [k for b in blocks for k in b.keys] + [d.status.key for d in catalog.METRICS
                                                  if isinstance(d.status, StatusKey) and d.status.scope == scope]
    assert len(keys) == len(set(keys))  # one owner per key
