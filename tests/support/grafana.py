"""What the dashboard tests need to read Grafana dashboard JSON as Grafana and its linter do.

- ``load_dashboards()`` / ``panels()`` / ``targets()``: walk the committed JSON (rows' nested panels included).
- ``selectors()`` / ``ranges()``: a small PromQL lexer that finds every vector selector (name and matchers) and
  every range ``[...]`` with the function it is passed to. It knows the PromQL our dashboards use; anything it
  cannot place raises, so a query it does not understand fails the lint instead of slipping through.
- ``expand()``: substitute template variables the way Grafana's Prometheus datasource does (All -> allValue,
  several values -> ``(a|b)`` regex-escaped, ``$__rate_interval`` -> a duration).
- ``displayed()``: what a stat panel shows for a value: its value mappings (exact values, null/NaN), else the
  number in the panel's unit.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = ROOT / "dashboards"
QUERY_PANEL_TYPES = frozenset({"timeseries", "stat", "state-timeline", "table", "gauge", "bargauge", "graph",
                               "singlestat", "heatmap", "piechart"})


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARD_DIR.glob("*.json"))


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in dashboard_files()}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels nested in collapsed rows included."""
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for p in panels(dashboard):
        for t in p.get("targets", []):
            yield p, t


def variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return dashboard.get("templating", {}).get("list", [])


# --- PromQL lexing -----------------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<number>(?:\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?:[a-z]+)?)
  | (?P<var>\$\{[^}]+\}|\$[A-Za-z_]\w*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}])
""", re.X)
_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_OTHER_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})  # case-insensitive


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str


@dataclass(frozen=True)
class Selector:
    name: str | None
    matchers: tuple[Matcher, ...]

    def matcher(self, label: str) -> Matcher | None:
        return next((m for m in self.matchers if m.label == label), None)

    def names(self) -> list[str]:
        """Metric names this selector reads: its name, or the alternatives of a literal __name__ regex."""
        if self.name:
            return [self.name]
        m = self.matcher("__name__")
        if m is None:
            return []
        if m.op == "=":
            return [m.value]
        if m.op == "=~" and re.fullmatch(r"[A-Za-z0-9_:|]+", m.value):
            return m.value.split("|")
        raise ValueError(f"cannot list the names a __name__ matcher reads: {m}")


def _tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot lex PromQL at {expr[pos:pos + 20]!r} in {expr!r}")
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append((kind, m.group()))
        pos = m.end()
    return out


def _unquote(s: str) -> str:
    if s[0] == "`":
        return s[1:-1]
    return json.loads('"' + s[1:-1].replace('\\"', '"').replace('"', '\\"') + '"') if s[0] == "'" else json.loads(s)


def _parse(expr: str) -> tuple[list[Selector], list[tuple[str | None, str]]]:
    toks = _tokens(expr)
    sels: list[Selector] = []
    rngs: list[tuple[str | None, str]] = []
    calls: list[str | None] = []  # function owning each open parenthesis
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "")
        if kind == "ident" and nxt[0] == "ident" and nxt[1] in ("by", "without"):  # sum by (x) (...)
            j = toks.index(("op", ")"), i + 2)
            if toks[j + 1] != ("op", "("):
                raise ValueError(f"cannot read aggregation {text} in {expr!r}")
            calls.append(text)
            i = j + 2
            continue
        if kind == "ident" and text in _LABEL_LIST_KEYWORDS:
            if nxt[1] == "(":  # skip the label list
                j = toks.index(("op", ")"), i + 1)
                i = j + 1
                continue
            i += 1
            continue
        if kind == "ident" and nxt[1] == "(":
            calls.append(text)
            i += 2
            continue
        if kind == "op" and text == "(":
            calls.append(None)
        elif kind == "op" and text == ")":
            if not calls:
                raise ValueError(f"unbalanced ) in {expr!r}")
            calls.pop()
        elif kind == "range":
            rngs.append((calls[-1] if calls else None, text[1:-1]))
        elif (kind == "ident" and text.lower() not in _OTHER_KEYWORDS) or (kind == "op" and text == "{"):
            name = text if kind == "ident" else None
            matchers: list[Matcher] = []
            j = i + 1 if kind == "ident" else i
            if j < len(toks) and toks[j] == ("op", "{"):
                j += 1
                while toks[j] != ("op", "}"):
                    (lk, label), (ok, op), (vk, value) = toks[j], toks[j + 1], toks[j + 2]
                    if lk != "ident" or ok != "op" or op not in ("=", "!=", "=~", "!~") or vk != "string":
                        raise ValueError(f"cannot read matchers of {name} in {expr!r}")
                    matchers.append(Matcher(label, op, _unquote(value)))
                    j += 3
                    if toks[j] == ("op", ","):
                        j += 1
                j += 1
            sels.append(Selector(name, tuple(matchers)))
            i = j
            continue
        i += 1
    if calls:
        raise ValueError(f"unbalanced ( in {expr!r}")
    return sels, rngs


def selectors(expr: str) -> list[Selector]:
    return _parse(expr)[0]


def ranges(expr: str) -> list[tuple[str | None, str]]:
    """(function the range vector is passed to, text inside the brackets) for each [...]."""
    return _parse(expr)[1]


def series_names(expr: str) -> list[str]:
    return [n for s in selectors(expr) for n in s.names()]


# --- template variables ------------------------------------------------------------------------------------

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_REGEX_SPECIAL = re.compile(r"([\\^$*+?.()|{}\[\]])")


def regex_escape(value: str) -> str:
    """Grafana's prometheusSpecialRegexEscape for values put into =~ matchers."""
    return _REGEX_SPECIAL.sub(r"\\\\\1", value)


def format_value(variable: dict[str, Any], values: list[str] | None) -> str:
    """What Grafana puts in place of $var. ``None`` means All."""
    if values is None:
        return variable.get("allValue") or ".+"
    if len(values) == 1 and not (variable.get("multi") or variable.get("includeAll")):
        return values[0]
    escaped = [regex_escape(v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def expand(expr: str, values: dict[str, str]) -> str:
    """Replace $var / ${var} by ``values[var]`` (already formatted); unknown variables raise."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]
    return _VAR.sub(sub, expr)


def referenced_variables(text: str) -> set[str]:
    return {m.group(1) or m.group(2) for m in _VAR.finditer(text)}


# --- what a stat shows ------------------------------------------------------------------------------------

def _mapped(mappings: list[dict[str, Any]], value: float) -> str | None:
    """Grafana's value mappings: exact values (``String(value)``) and the special null/NaN match."""
    for m in mappings:
        if m["type"] == "value" and not math.isnan(value):
            hit = m["options"].get(f"{value:g}")
            if hit:
                return hit["text"]
        if m["type"] == "special" and m["options"]["match"] in ("nan", "null+nan") and math.isnan(value):
            return m["options"]["result"]["text"]
    return None


def _formatted(unit: str, value: float) -> str:
    """The few Grafana units a stat of ours shows, roughly as Grafana formats them (enough to tell a number
    in its unit from a mapped word)."""
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "joule":
        for factor, prefix in ((1e3, "k"), (1.0, ""), (1e-3, "m")):
            if abs(value) >= factor or prefix == "m":
                return f"{value / factor:.3g} {prefix}J"
    return f"{value:g}"


def displayed(panel: dict[str, Any], value: str) -> str:
    """What a stat panel shows for one value as Prometheus returns it ("0.25", "NaN"): a value mapping's text
    where one matches, else the value in the panel's unit."""
    defaults = panel["fieldConfig"]["defaults"]
    number = float(value)
    mapped = _mapped(defaults.get("mappings", []), number)
    return mapped if mapped is not None else _formatted(defaults.get("unit", ""), number)
