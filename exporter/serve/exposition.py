"""One tick's /metrics in each form a scrape may ask for, each serialised at most once per tick.

Negotiated as prometheus_client's own handler does (prometheus_client.exposition._bake_output), with the
quality values that it ignores honoured as prometheus/common's expfmt.Negotiate does: the format from
``Accept`` (OpenMetrics when asked for with q > 0 and a version kvwatt produces, else the text format), gzip
when ``Accept-Encoding`` names it with q > 0, and ``name[]`` query parameters restricting the output to
those sample names (``registry.restricted_registry``). The families are collected once, at tick time
(Daemon.step); here they are only serialised: the text format at once (in the tick's worker thread), any other form on
the first scrape that asks for it, then kept with the tick. A ``name[]`` subset is serialised per request (from the
same families, no figure recomputed).
"""

from __future__ import annotations

import gzip
import re
import threading
from functools import partial
from typing import Callable, Iterable, NamedTuple

from prometheus_client.exposition import CONTENT_TYPE_LATEST, CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import ALLOWUTF8, DOTS, UNDERSCORES, VALUES
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OM_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString


class Served(NamedTuple):
    body: bytes
    content_type: str
    gzipped: bool

    def headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type, **({"Content-Encoding": "gzip"} if self.gzipped else {})}


class _Families(Collector):
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


# The versions kvwatt serves. A media range naming another version is not acceptable (it is skipped, as
# prometheus/common expfmt.Negotiate does), so a Content-Type never echoes a version that was not produced.
OPENMETRICS_VERSIONS = ("1.0.0",)
TEXT_VERSIONS = ("", "0.0.4", "1.0.0")


def _q(params: dict[str, str]) -> float | None:
    """The quality value of a media range or coding (RFC 9110 s12.4.2), 1 when absent, None when malformed."""
    try:
        q = float(params.get("q", "1"))
    except ValueError:
        return None
    return q if 0 <= q <= 1 else None


def _ranges(header: str | None) -> list[tuple[str, dict[str, str], float]]:
    """(lowercased type or coding, parameters, q) of each element of an Accept or Accept-Encoding header with
    q > 0, highest q first (ties in header order); q=0 means "not acceptable" and drops the element."""
    out = []
    for element in (header or "").split(","):
        kind, *toks = element.split(";")
        params = {}
        for tok in toks:
            key, _, value = tok.strip().partition("=")
            params[key.strip().lower()] = value.strip().strip('"')
        q = _q(params)
        if kind.strip() and q:
            out.append((kind.strip().lower(), params, q))
    return sorted(out, key=lambda r: -r[2])


def _escaping(params: dict[str, str]) -> str:
    """The name escaping asked for; underscores when absent or unknown (as prometheus_client decides)."""
    value = params.get("escaping")
    return value if value in (ALLOWUTF8, DOTS, VALUES) else UNDERSCORES


def negotiate(accept: str | None):
    """(encoder, content type) for an Accept header: the acceptable media range with the highest q that
    kvwatt can produce, in the form prometheus_client's choose_encoder gives it; the text format (0.0.4) when
    none is (Prometheus' own fallback). Unlike choose_encoder, a range with q=0 is not acceptable, and an
    OpenMetrics version kvwatt does not produce is skipped instead of echoed in the Content-Type."""
    for kind, params, _q_value in _ranges(accept):
        version = params.get("version", "")
        if kind == "application/openmetrics-text" and version in ("", *OPENMETRICS_VERSIONS):
            if not version:
                return partial(om_generate_latest, escaping=UNDERSCORES, version="1.0.0"), OM_CONTENT_TYPE
            escaping = _escaping(params)
            return (partial(om_generate_latest, escaping=escaping, version=version),
                    f"application/openmetrics-text; version={version}; charset=utf-8; escaping={escaping}")
        if kind == "text/plain" and version in TEXT_VERSIONS:
            if version == "1.0.0":
                escaping = _escaping(params)
                return partial(generate_latest, escaping=escaping), f"{CONTENT_TYPE_LATEST}; escaping={escaping}"
            return generate_latest, CONTENT_TYPE_PLAIN_0_0_4
        if kind in ("*/*", "text/*"):
            return generate_latest, CONTENT_TYPE_PLAIN_0_0_4
    return generate_latest, CONTENT_TYPE_PLAIN_0_0_4


def gzip_accepted(accept_encoding: str | None) -> bool:
    """Whether Accept-Encoding names gzip with q > 0 (``gzip;q=0`` refuses it; prometheus_client ignores q)."""
    return any(coding in ("gzip", "x-gzip") for coding, _params, _q_value in _ranges(accept_encoding))


def _variant(encoder) -> tuple:
    """What makes two encoders' bytes differ for kvwatt's families: the format and the name escaping. The
    requested version is left out (it only changes native histograms, which kvwatt has none of), so a client
    cannot grow the cache by inventing versions: at most 2 formats x 4 escapings, plain and gzipped."""
    func = getattr(encoder, "func", encoder)
    escaping = getattr(encoder, "keywords", {}).get("escaping", UNDERSCORES)
    return func, escaping


def wanted_names(values: list[str] | None) -> set[str] | None:
    """The ``name[]`` query values; None (no restriction) when there are none or all are blank, as
    prometheus_client's parse_qs drops blank values."""
    names = {v for v in values or () if v}
    return names or None


_LEGACY_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LEGACY_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _escape_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


# label names -> label values -> their rendering inside {...}: the same servers and windows come back every tick
_INNER: dict[tuple[str, ...], dict[tuple[str, ...], str]] = {}
_INNER_MAX = 65536  # entries per label-name tuple before that cache starts again (servers that came and went)


# value -> floatToGoString(value): many values repeat from tick to tick and across servers (flags, thresholds,
# configured sizes); equal numbers (1, 1.0, True) write alike, except 0.0 and -0.0, which are never kept
_go: dict[float, str] = {}
_GO_MAX = 8192  # ~1.5 MB at most: the values that change every tick only pass through


def sample_lines(name: str, mtype: str, doc: str, label_names: tuple[str, ...],
                 samples: Iterable[tuple[tuple[str, ...], float]]) -> list[str] | None:
    """generate_latest's lines for a gauge or counter family ``name`` (a counter's without or with its _total)
    given as (label values in ``label_names``' order, value); None when a name needs escaping (then
    generate_latest must write it)."""
    wire = (name if name.endswith("_total") else name + "_total") if mtype == "counter" else name
    if mtype not in ("gauge", "counter") or not _LEGACY_NAME.fullmatch(wire) \
            or not all(_LEGACY_LABEL.fullmatch(k) for k in label_names):
        return None
    order = sorted(range(len(label_names)), key=label_names.__getitem__)  # generate_latest sorts labels by name
    keys = [label_names[i] for i in order]
    cache = _INNER.setdefault(tuple(label_names), {})
    if len(cache) > _INNER_MAX:
        cache.clear()
    doc = doc.replace("\\", r"\\").replace("\n", r"\n")
    lines = [f"# HELP {wire} {doc}\n# TYPE {wire} {mtype}\n"]
    for values, value in samples:
        inner = cache.get(values)
        if inner is None:
            inner = cache[values] = ",".join([f'{k}="{_escape_value(values[i])}"' for k, i in zip(keys, order)])
        v = _go.get(value) if value else None  # (0.0 == -0.0 hash alike, their strings differ: not kept)
        if v is None:
            v = floatToGoString(value)
            if value:
                if len(_go) > _GO_MAX:
                    _go.clear()
                _go[value] = v
        lines.append(f"{wire}{{{inner}}} {v}\n" if keys else f"{wire} {v}\n")
    return lines


def _fast_lines(metric: Metric) -> list[str] | None:
    """sample_lines of a prometheus_client gauge or counter whose samples all share the family's label names
    (the catalog's, process_*, python_*); None for anything else."""
    mtype, name = metric.type, metric.name
    if mtype not in ("gauge", "counter"):
        return None
    wire = name + "_total" if mtype == "counter" else name
    names = tuple(metric.samples[0].labels) if metric.samples else ()
    rows = []
    for s in metric.samples:
        if s.name != wire or s.timestamp is not None or len(s.labels) != len(names):
            return None
        try:
            rows.append((tuple([s.labels[k] for k in names]), s.value))
        except KeyError:
            return None
    return sample_lines(name, mtype, metric.documentation, names, rows)


def text_format(families: list[Metric]) -> bytes:
    """The text format (0.0.4) of ``families``, byte for byte what prometheus_client's generate_latest writes
    (tests/test_text_format.py), in a third of its time: a family's label names are sorted and checked once,
    not per sample. A family outside the fast path (another type, names to escape) goes through
    generate_latest itself."""
    out: list[str] = []
    for metric in families:
        lines = _fast_lines(metric)
        if lines is None:
            out.append(generate_latest(_Families([metric])).decode("utf-8"))
        else:
            out += lines
    return "".join(out).encode("utf-8")


class Exposition:
    def __init__(self, families: list[Metric]):
        self._families, self._registry = (lambda: families), None
        self._cache: dict[tuple, bytes] = {}
        self._lock = threading.RLock()
        self.text = self._once((*_variant(generate_latest), False), lambda: text_format(families))

    @classmethod
    def lazy(cls, text: bytes, families: Callable[[], list[Metric]]) -> "Exposition":
        """An exposition whose text format is written already (``text``: generate_latest's bytes for the families
        ``families()`` returns) and whose families are built only when a scrape asks for another form."""
        self = cls([])
        self._families = families
        self._cache[(*_variant(generate_latest), False)] = self.text = text
        return self

    @property
    def registry(self) -> CollectorRegistry:
        with self._lock:
            if self._registry is None:
                # without names: restricted_registry (name[]) then filters this collector's families by sample name
                self._registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
                self._registry.register(_Families(self._families()))
            return self._registry

    def cached(self, accept: str | None, accept_encoding: str | None, names: set[str] | None) -> Served | None:
        """The response if it is serialised already (a dict lookup: fine on the event loop), else None."""
        if names is not None:
            return None
        encoder, content_type = negotiate(accept)
        gz = gzip_accepted(accept_encoding)
        body = self._cache.get((*_variant(encoder), gz))
        return None if body is None else Served(body, content_type, gz)

    def serve(self, accept: str | None, accept_encoding: str | None, names: set[str] | None) -> Served:
        """The response, serialising what is missing (call it off the event loop)."""
        encoder, content_type = negotiate(accept)
        gz = gzip_accepted(accept_encoding)
        if names is not None:
            body = encoder(self.registry.restricted_registry(names))
            return Served(gzip.compress(body) if gz else body, content_type, gz)
        plain = self._once((*_variant(encoder), False), lambda: encoder(self.registry))
        body = self._once((*_variant(encoder), True), lambda: gzip.compress(plain)) if gz else plain
        return Served(body, content_type, gz)

    def _once(self, key: tuple, make) -> bytes:
        with self._lock:  # two first scrapes of a form at once: the second waits and takes the first's bytes
            body = self._cache.get(key)
            if body is None:
                body = self._cache[key] = make()
            return body
