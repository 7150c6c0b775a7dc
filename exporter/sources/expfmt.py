"""A small, fast parser for the Prometheus text exposition format, limited to what kvwatt reads.

Why not prometheus_client's parser: it builds objects for every bucket of every histogram (a vLLM
exposition is ~590 lines, mostly buckets) and stops at the first malformed line. kvwatt only needs a few
``vllm:`` series, wants to skip the rest cheaply, and must keep going past one bad line (the bad line is
counted, not fatal). bench/bench_parse.py compares both.

Two entry points with the same line semantics:

- ``parse(text, prefix)``: every family whose name starts with ``prefix`` (a Python loop over every line;
  the general path, used by tests and tools).
- ``parse_families(text, names)``: only the named families, found by one compiled regex scanning the whole
  text in C (a pattern opening with a literal newline and the names' common prefix lets the regex engine
  jump between candidate lines without Python). Only the lines of those families reach Python. This is
  what the engine adapters use: a 50k-series exposition costs the scan, not 50k Python iterations. A
  malformed line of a named family is counted in ``errors``; lines of other families are not looked at.
"""

from __future__ import annotations

import math
import os
import re
from functools import lru_cache

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


def parse_labels(text: str) -> Labels | None:
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


# histogram buckets parsed all the same: a small histogram whose bucket counts a figure needs (0.30+)
KEPT_BUCKETS = frozenset({"vllm:request_num_preemptions_bucket",
                          # KV-block residency (--kv-cache-metrics): derive/residency.py
                          "vllm:kv_block_idle_before_evict_seconds_bucket", "vllm:kv_block_reuse_gap_seconds_bucket",
                          "vllm:kv_block_lifetime_seconds_bucket"})


def parse(text: str, prefix: str = "vllm:", skip_suffixes: tuple[str, ...] = ("_bucket", "_created"),
          keep: frozenset[str] = KEPT_BUCKETS) -> Exposition:
    """Parse the lines whose metric name starts with ``prefix``; others are skipped unparsed, and so are the
    names ending in ``skip_suffixes`` unless named in ``keep``.

    NaN values are kept (the caller decides); duplicate series keep the first value and are counted.
    """
    exp = Exposition()
    for line in text.split("\n"):
        if not line.startswith(prefix):
            continue
        parts = split_sample_line(line)
        if parts is not None and parts[0].endswith(skip_suffixes) and parts[0] not in keep:
            continue
        _store(exp, parts, parts is not None and " " not in parts[0] and "\t" not in parts[0])
    return exp


def split_sample_line(line: str) -> tuple[str, tuple | None, float | None] | None:
    """(name, labels, value) of one sample line (labels or value None when malformed), or None when a
    closing brace comes before the opening one.

    Tokens are separated by blanks or tabs (the text format allows both, so does prometheus_client): a name
    may be followed by spaces or tabs before its value or its ``{``. A name that still holds a blank is
    malformed (callers count it)."""
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            return None
        name, labels, rest = line[:brace].rstrip(" \t"), parse_labels(line[brace + 1:close]), line[close + 1:]
    else:
        end = line.find(" ")
        tab = line.find("\t", 0, end if end >= 0 else len(line))  # one C scan, bounded by the first space
        if tab >= 0:
            end = tab
        name, rest = (line, "") if end < 0 else (line[:end], line[end + 1:])
        labels = ()
    return name, labels, _parse_value(rest)


def _store(exp: Exposition, parts, name_ok: bool) -> None:
    """Keep one split line in ``exp``: a malformed line is an error, a repeated series keeps its first value."""
    if parts is None or not name_ok or parts[1] is None or parts[2] is None:
        exp.errors += 1
        return
    name, labels, value = parts
    fam = exp.series.setdefault(name, {})
    if labels in fam:
        exp.duplicates += 1
        return
    fam[labels] = value


def _accept(exp: Exposition, names: frozenset[str], line: str) -> None:
    """One line of a named family into ``exp``, with ``parse``'s rules; a line it rejects is an error
    (e.g. "name 1 {..}": a space before the brace makes the name not one of ``names``)."""
    parts = split_sample_line(line)
    _store(exp, parts, parts is not None and parts[0] in names)


@lru_cache(maxsize=64)
def _family_regexes(names: frozenset[str]) -> tuple[re.Pattern, re.Pattern]:
    """(a pattern finding every line after a newline, one matching the first line) for these names.

    A line belongs to a family when it starts with the name followed by ``{``, a space, a tab or its end."""
    ordered = sorted(names, key=len, reverse=True)  # longest first: "x_total" before "x"
    common = os.path.commonprefix(ordered)
    alt = "|".join(re.escape(n[len(common):]) for n in ordered)
    body = rf"{re.escape(common)}(?:{alt})(?![^{{ \t\n])[^\n]*"
    return re.compile(rf"\n({body})"), re.compile(body)


def parse_families(text: str, names) -> Exposition:
    """Parse only the lines of the families named in ``names`` (full names as on the wire, e.g.
    ``"vllm:generation_tokens_total"``). The same result as ``parse(text)`` restricted to those names
    (same values, labels, duplicate handling and family order), with ``errors`` counting the lines that
    start with one of the names but are malformed."""
    names = frozenset(names)
    exp = Exposition()
    if not names:
        return exp
    scan, first = _family_regexes(names)
    m = first.match(text)
    if m:
        _accept(exp, names, m.group(0))
    for line in scan.findall(text):
        _accept(exp, names, line)
    return exp


def process_start_time(text: str) -> float | None:
    """``process_start_time_seconds`` (the server process's start, Unix seconds), or None when absent."""
    key = "process_start_time_seconds "
    if text.startswith(key):
        i = 0
    else:
        i = text.find("\n" + key)
        if i < 0:
            return None
        i += 1
    end = text.find("\n", i)
    parts = text[i + len(key):end if end >= 0 else len(text)].split()
    if not parts:
        return None
    try:
        v = float(parts[0])
    except ValueError:
        return None
    return v if math.isfinite(v) else None


