"""One tick's /metrics in each form a scrape may ask for, each serialised at most once per tick.

Negotiated as prometheus_client's own handler does (prometheus_client.exposition._bake_output): the format
from ``Accept`` (``choose_encoder``: OpenMetrics when asked for, else the text format), gzip when
``Accept-Encoding`` names it, and ``name[]`` query parameters restricting the output to those sample names
(``registry.restricted_registry``). The families are collected once, at tick time (Daemon.step); here they
are only serialised: the text format at once (in the tick's worker thread), any other form on the first
scrape that asks for it, then kept with the tick. A ``name[]`` subset is serialised per request (from the
same families, no figure recomputed).
"""

from __future__ import annotations

import gzip
import threading
from typing import Iterable, NamedTuple

from prometheus_client.openmetrics.exposition import UNDERSCORES
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest, gzip_accepted
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry


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


def negotiate(accept: str | None):
    """(encoder, content type) for an Accept header, as prometheus_client chooses them. Its version check
    raises on a version like '1.x' (it compares a str with an int): such a header gets the text format."""
    try:
        return choose_encoder(accept or "")
    except (TypeError, ValueError):
        return generate_latest, CONTENT_TYPE_PLAIN_0_0_4


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


class Exposition:
    def __init__(self, families: list[Metric]):
        # without names: restricted_registry (name[]) then filters this collector's families by sample name
        self.registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
        self.registry.register(_Families(families))
        self._cache: dict[tuple, bytes] = {}
        self._lock = threading.RLock()
        self.text = self._once((*_variant(generate_latest), False), lambda: generate_latest(self.registry))

    def cached(self, accept: str | None, accept_encoding: str | None, names: set[str] | None) -> Served | None:
        """The response if it is serialised already (a dict lookup: fine on the event loop), else None."""
        if names is not None:
            return None
        encoder, content_type = negotiate(accept)
        gz = gzip_accepted(accept_encoding or "")
        body = self._cache.get((*_variant(encoder), gz))
        return None if body is None else Served(body, content_type, gz)

    def serve(self, accept: str | None, accept_encoding: str | None, names: set[str] | None) -> Served:
        """The response, serialising what is missing (call it off the event loop)."""
        encoder, content_type = negotiate(accept)
        gz = gzip_accepted(accept_encoding or "")
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
