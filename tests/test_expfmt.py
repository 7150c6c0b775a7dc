"""The exposition parser: robustness on malformed input and agreement with prometheus_client's parser."""

import math

from prometheus_client.parser import text_string_to_metric_families

from exporter.sources.expfmt import KEPT_BUCKETS, parse
from tests.conftest import FIXTURES


def test_labels_in_any_order_are_the_same_series():
    exp = parse('vllm:x_total{b="2",a="1"} 3\nvllm:x_total{a="1",b="2"} 4\n')
    assert exp.get("vllm:x_total") == {(("a", "1"), ("b", "2")): 3.0}
    assert exp.duplicates == 1


def test_escaped_quotes_commas_and_braces_in_label_values():
    exp = parse('vllm:info{a="x\\"y,}{z",b="new\\nline"} 1\n')
    (labels,) = exp.get("vllm:info")
    assert dict(labels) == {"a": 'x"y,}{z', "b": "new\nline"}


def test_nan_and_inf_values_and_timestamps():
    exp = parse("vllm:a NaN\nvllm:b +Inf\nvllm:c -Inf\nvllm:d 2.5 1700000000000\n")
    assert math.isnan(exp.get("vllm:a")[()])
    assert exp.get("vllm:b")[()] == math.inf and exp.get("vllm:c")[()] == -math.inf
    assert exp.get("vllm:d")[()] == 2.5


def test_malformed_lines_are_counted_and_skipped_not_fatal():
    text = ('vllm:good 1\nvllm:bad{a="1" 2\nvllm:worse{a=1} 3\nvllm:novalue\nvllm:text abc\n'
            'vllm:toomany 1 2 3\nvllm:also_good{a="x"} 7\n')
    exp = parse(text)
    assert exp.get("vllm:good") == {(): 1.0}
    assert exp.get("vllm:also_good") == {(("a", "x"),): 7.0}
    assert exp.errors == 5


def test_buckets_created_and_foreign_series_skipped():
    exp = parse('vllm:h_bucket{le="1"} 2\nvllm:c_created 1.7e9\nprocess_cpu_seconds_total 3\nvllm:h_sum 4\n')
    assert set(exp.series) == {"vllm:h_sum"}


def test_agrees_with_prometheus_client_on_real_expositions():
    for path in sorted(FIXTURES.glob("*/*.prom")):
        text = path.read_text()
        ours = parse(text)
        theirs = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                skipped = s.name.endswith(("_bucket", "_created")) and s.name not in KEPT_BUCKETS
                if s.name.startswith("vllm:") and not skipped:
                    theirs.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        assert ours.errors == 0, path
        assert ours.series == theirs, path


def test_parse_families_reads_only_the_named_families_including_the_first_line():
    from exporter.sources.expfmt import parse_families
    text = ('vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting_by_reason{reason="capacity"} 1\n'
            'vllm:num_requests_waitingx 9\nvllm:other 3\nvllm:num_requests_waiting{engine="0"} 5\n'
            'vllm:num_requests_waiting{engine="1" 4\nvllm:other{ 1\n')
    exp = parse_families(text, ["vllm:num_requests_waiting"])
    assert exp.series == {"vllm:num_requests_waiting": {(("engine", "0"),): 2.0}}
    assert exp.duplicates == 1 and exp.errors == 1  # vllm:other's bad line is not looked at
    both = parse_families(text, {"vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason"})
    assert list(both.series) == ["vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason"]
    assert parse_families(text, []).series == {}


def test_tabs_separate_tokens_as_the_text_format_allows():
    """Hardening issue item 11a: blanks or tabs separate a sample's tokens (prometheus_client agrees)."""
    from exporter.sources.expfmt import parse_families
    text = ('vllm:generation_tokens_total\t5\nvllm:prompt_tokens_total{engine="0"}\t7\t1700000000000\n'
            'vllm:num_requests_running \t 2\nvllm:num_requests_waiting\t{engine="0",model_name="a\tb"} 3\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.5\n')
    want = {"vllm:generation_tokens_total": {(): 5.0}, "vllm:prompt_tokens_total": {(("engine", "0"),): 7.0},
            "vllm:num_requests_running": {(): 2.0},
            "vllm:num_requests_waiting": {(("engine", "0"), ("model_name", "a\tb")): 3.0},
            "vllm:kv_cache_usage_perc": {(("engine", "0"),): 0.5}}
    theirs = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            theirs.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    assert theirs == want
    for exp in (parse(text), parse_families(text, set(want))):
        assert exp.series == want and exp.errors == 0
    assert parse("vllm:x\t\n").errors == 1 and parse("vllm:x y\t5\n").errors == 1  # still malformed
