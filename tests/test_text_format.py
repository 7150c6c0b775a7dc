"""exporter.serve.exposition.text_format writes what prometheus_client's generate_latest writes, byte for byte:
on the golden scenario's families (every catalog family, the process' own ones) and on the values and
families its fast path must hand back to generate_latest."""

from __future__ import annotations

import math

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.exposition import generate_latest

from exporter.serve.collector import exposition, families, runtime_families
from exporter.serve.exposition import Exposition, _Families, _fast_lines, text_format
from tests.test_golden import run_scenario


def reference(fams) -> bytes:
    return generate_latest(_Families(fams))


def test_the_golden_scenario_families_byte_for_byte(tmp_path):
    daemon = run_scenario(tmp_path)
    fams = families(daemon.snapshot) + runtime_families()
    assert len(fams) > 60
    assert all(_fast_lines(f) is not None for f in fams)  # all on the fast path: the test compares it
    assert text_format(fams) == reference(fams)
    assert Exposition(fams).text == reference(fams)


def test_awkward_values_and_labels():
    g = GaugeMetricFamily("kvwatt_x_ratio", 'help with \\ backslash\nand "quotes"', labels=["server", "a_b"])
    for i, v in enumerate([0.0, -0.0, 1.0, -2.5, 1e-300, 123456789.0, 1234567.0, 12345678901234.5, math.inf,
                           -math.inf, math.nan, 0.1 + 0.2, 7e22]):
        g.add_metric([f's{i}"\\\n\u00e9', "b" * i], v)
    c = CounterMetricFamily("kvwatt_y", "a counter", labels=["z"])
    c.add_metric(["1"], 3.0)
    empty = GaugeMetricFamily("kvwatt_empty", "no sample")
    nolabels = GaugeMetricFamily("kvwatt_plain", "no labels", value=4.0)
    fams = [g, c, empty, nolabels]
    assert text_format(fams) == reference(fams)


@pytest.mark.parametrize("make", [
    lambda: InfoMetricFamily("kvwatt_i", "info", value={"a": "b"}),
    lambda: HistogramMetricFamily("kvwatt_h", "hist", buckets=[("1.0", 1.0), ("+Inf", 2.0)], sum_value=3.0),
    lambda: CounterMetricFamily("kvwatt_c", "with created", value=1.0, created=1700000000.0),
    lambda: GaugeMetricFamily("kvwatt.dotted", "utf-8 name", value=1.0),
])
def test_families_off_the_fast_path_go_through_generate_latest(make):
    fam = make()
    assert _fast_lines(fam) is None
    fams = [GaugeMetricFamily("kvwatt_before", "b", value=1.0), fam, GaugeMetricFamily("kvwatt_after", "a", value=2.0)]
    assert text_format(fams) == reference(fams)  # the order kept around the fallback


def test_the_tick_writes_the_text_from_the_samples_byte_for_byte_and_builds_families_only_when_asked(tmp_path):
    """collector.exposition writes the text format straight from the catalog's samples: the same bytes as
    generate_latest over the families (every catalog family of the golden scenario, the process' own ones), and
    the families for the other forms are built on the first scrape that asks for one."""
    daemon = run_scenario(tmp_path)
    built = []
    exp = exposition(daemon.snapshot, frozenset({"all"}))
    exp._families = (lambda make: lambda: built.append(1) or make())(exp._families)
    fams = families(daemon.snapshot) + runtime_families()
    # the process' own families change between two reads (CPU seconds, GC counts): compare the catalog's part
    text, ref = exp.text.decode(), reference(fams).decode()
    assert text[:text.index("# HELP process_")] == ref[:ref.index("# HELP process_")]
    assert "# HELP python_gc_objects_collected_total" in text and text.endswith("\n")
    assert built == []
    om = exp.serve("application/openmetrics-text; version=1.0.0", None, None)
    assert built == [1] and om.body.startswith(b"# HELP kvwatt_") and om.body.endswith(b"# EOF\n")
    subset = exp.serve(None, None, {"kvwatt_build_info"})
    assert subset.body.startswith(b"# HELP kvwatt_build_info") and built == [1]  # built once


def test_label_values_rendered_once_are_reused_and_still_escaped():
    from exporter.serve.exposition import sample_lines
    rows = [(("s1", 'a"b\\c\nd'), 1.5), (("s2", "w"), 2.0)]
    first = sample_lines("kvwatt_t_ratio", "gauge", "h", ("server", "window"), rows)
    again = sample_lines("kvwatt_t_ratio", "gauge", "h", ("server", "window"), rows)
    g = GaugeMetricFamily("kvwatt_t_ratio", "h", labels=["server", "window"])
    for labels, v in rows:
        g.add_metric(list(labels), v)
    assert "".join(first) == "".join(again) == reference([g]).decode()
    # label names declared out of alphabetical order: written sorted, as generate_latest does
    swapped = sample_lines("kvwatt_u", "counter", "c", ("zone", "domain"), [(("z", "d"), 3.0)])
    c = CounterMetricFamily("kvwatt_u", "c", labels=["zone", "domain"])
    c.add_metric(["z", "d"], 3.0)
    assert "".join(swapped) == reference([c]).decode()


def test_values_written_once_are_reused_yet_signed_zero_and_equal_numbers_stay_exact():
    """The Go strings of the values are kept from tick to tick (exposition._go): 0.0 and -0.0 are equal keys
    whose strings differ, 1, 1.0 and True one key written alike; whichever order they come in, every tick's
    bytes are generate_latest's."""
    from exporter.serve import exposition as x
    values = [0.0, -0.0, 1.0, 1, True, 2.5e-7, 1234567.0, math.inf, -math.inf, -0.0, 0.0, 7e22]
    for order in (values, values[::-1], values):
        rows = [((f"s{i}",), v) for i, v in enumerate(order)]
        g = GaugeMetricFamily("kvwatt_v_ratio", "h", labels=["server"])
        for labels, v in rows:
            g.add_metric(list(labels), v)
        assert "".join(x.sample_lines("kvwatt_v_ratio", "gauge", "h", ("server",), rows)) == reference([g]).decode()
    assert 0.0 not in x._go and x._go[1.0] == "1.0"


def test_label_tuples_bounded_once_are_reused_and_numbers_are_never_confused_with_strings():
    """The collector keeps each all-str label tuple's bounded form (collector._bounded): a long value is cut
    (with its hash) the same at every tick, and a number label (1 vs 1.0, written "1" and "1.0") never takes
    a kept tuple."""
    from exporter.serve import collector as col
    long = "m" * 300
    d = type("D", (), {"name": "kvwatt_fake", "labels": ("server", "key"),
                       "fill": staticmethod(lambda snap: [(("s", long), 1.0), (("s", 1), 2.0), (("s", 1.0), 3.0)])})()
    snap = type("S", (), {"implausible": ()})()
    for _ in range(2):
        got = col.samples(d, snap)
        assert got[0][0] == ("s", col.bounded_label(long)) and len(got[0][0][1]) == col.MAX_LABEL_CHARS
        assert got[1][0] == ("s", "1") and got[2][0] == ("s", "1.0")
    assert ("s", long) in col._bounded and ("s", 1.0) not in col._bounded
