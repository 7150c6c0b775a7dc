"""A small, fast parser for the Prometheus text exposition format, limited to what kvwatt reads.

Why not prometheus_client's parser: it builds objects for every bucket of every histogram (a vLLM
exposition is ~590 lines, mostly buckets) and stops at the first malformed line. kvwatt only needs a few
``vllm:`` series, wants to skip the rest cheaply, and must keep going past one bad line (the bad line is
counted, not fatal). bench/bench_parse.py compares both.
"""

from __future__ import annotations

import math
import re

# name{labels} value [timestamp]; label values may hold escaped quotes, commas and braces.
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESC_RE = re.compile(r'\\[\\"n]')

Labels = tuple[tuple[str, str], ...]  # sorted, so label order on the wire does not matter


class Exposition:
    """Parsed samples: ``series[name][labels] = value``; ``errors`` counts lines that were skipped."""

    __slots__ = ("series", "errors", "duplicates")

    def __init__(self) -> None:
        self.series: dict[str, dict[Labels, float]] = {}
        self.errors = 0
        self.duplicates = 0

    def get(self, name: str) -> dict[Labels, float]:
        return self.series.get(name, {})


def _unescape(v: str) -> str:
    return _ESC_RE.sub(lambda m: _ESCAPES[m.group(0)], v) if "\\" in v else v


def _parse_labels(text: str) -> Labels | None:
    pos, out = 0, []
    while pos < len(text):
        m = _LABEL_RE.match(text, pos)
        if not m:
            return None if text[pos:].strip() else tuple(sorted(out))
        out.append((m.group(1), _unescape(m.group(2))))
        pos = m.end()
    return tuple(sorted(out))


def _parse_value(text: str) -> float | None:
    parts = text.split()
    if not parts or len(parts) > 2:
        return None
    try:
        return float(parts[0])  # float() accepts NaN, +Inf, -Inf as Prometheus writes them
    except ValueError:
        return None


def parse(text: str, prefix: str = "vllm:", skip_suffixes: tuple[str, ...] = ("_bucket", "_created")) -> Exposition:
    """Parse the lines whose metric name starts with ``prefix``; others are skipped unparsed.

    NaN values are kept (the caller decides); duplicate series keep the first value and are counted.
    """
    exp = Exposition()
    for line in text.split("\n"):
        if not line.startswith(prefix):
            continue
        brace = line.find("{")
        if brace >= 0:
            close = line.rfind("}")
            if close < brace:
                exp.errors += 1
                continue
            name = line[:brace]
            labels = _parse_labels(line[brace + 1:close])
            rest = line[close + 1:]
        else:
            name, _, rest = line.partition(" ")
            labels = ()
        if name.endswith(skip_suffixes):
            continue
        value = _parse_value(rest)
        if labels is None or value is None or " " in name:
            exp.errors += 1
            continue
        fam = exp.series.setdefault(name, {})
        if labels in fam:
            exp.duplicates += 1
            continue
        fam[labels] = value
    return exp


def finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)
