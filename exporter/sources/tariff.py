"""The electricity price and the grid's carbon intensity read from a URL (docs/energy.md, "Money and carbon").

Two forms, chosen by the configured URL (exporter.config.parse_price):

- ``http(s)://host/api/v1/query?query=...``: the Prometheus HTTP API, an instant query whose answer is one
  sample (a vector of one series, or a scalar);
- ``http(s)://host/metrics#name`` or ``#name{label="value"}``: any text exposition, the one sample of that
  series (with at least those labels). The fragment is never sent.

``PriceSource.read`` never raises: a failure is a SourceStatus (timeout, unreachable, http_<code>, parse_error,
no_sample). ``PriceTracker`` keeps the last good value with the monotonic time it was read: the sampler starts
a read every ``refresh_seconds`` without waiting for it (a slow URL never delays a tick or a scrape); the value
stays in use, with its age, through failed reads, and is unknown once older than ``max_age_seconds``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import aiohttp

from exporter.config import PRICE_MAXIMA, PriceSetting
from exporter.samples import PriceReading, SourceStatus
from exporter.sources import expfmt
from exporter.sources.endpoint import EngineSource
from exporter.sources.engine import SourceError


def value_from_query(text: str) -> float:
    """The one sample of a Prometheus HTTP API instant query answer; SourceError otherwise."""
    try:
        doc = json.loads(text)
        data = doc["data"]
        kind, result = data["resultType"], data["result"]
    except (ValueError, KeyError, TypeError):
        raise SourceError("parse_error", "not a Prometheus API answer (no data.resultType/result)") from None
    if isinstance(doc, dict) and doc.get("status") not in (None, "success"):
        raise SourceError("parse_error", f"query failed: {str(doc.get('error', ''))[:200]}")
    if kind == "scalar":
        pair = result
    elif kind == "vector":
        if len(result) != 1:
            raise SourceError("no_sample", f"the query returned {len(result)} series, want exactly 1")
        pair = result[0].get("value") if isinstance(result[0], dict) else None
    else:
        raise SourceError("parse_error", f"resultType {kind!r}, want vector or scalar")
    try:
        return _checked(float(pair[1]))
    except (TypeError, ValueError, IndexError):
        raise SourceError("parse_error", "the sample has no [time, \"value\"] pair") from None


def value_from_exposition(text: str, series: str) -> float:
    """The one sample of ``series`` (``name`` or ``name{label="value",...}``: those labels must match) in a
    text exposition; SourceError otherwise. Only that name's lines are parsed: the text is searched for them
    (a price next to a large exposition costs a scan of it, not a parse)."""
    name, _, selector = series.partition("{")
    wanted = set(expfmt.parse_labels(selector.rstrip("}")) or ()) if selector else set()
    # each wanted label's value as written (quoted), when it can only be written one way: a line without it
    # cannot match and is not parsed (the label name may have blanks around its "=": not part of the test)
    needles = [f'"{v}"' for _, v in wanted if "\\" not in v and '"' not in v and "\n" not in v]
    found = []
    for line in _lines_of(text, name):
        if line[len(name):len(name) + 1] not in ("{", " ", "\t") or not all(n in line for n in needles):
            continue  # another name sharing the prefix (name_total), or not the labels asked for
        parts = expfmt.split_sample_line(line)
        if parts is None or parts[0] != name or parts[1] is None or parts[2] is None:
            continue  # another name sharing the prefix, or a malformed line
        if wanted <= set(parts[1]):
            found.append(parts[2])
    if len(found) != 1:
        raise SourceError("no_sample", f"{len(found)} samples of {series} in the exposition, want exactly 1")
    return _checked(found[0])


def _lines_of(text: str, name: str):
    """The lines of ``text`` that start with ``name`` (str.find: C speed, no split of the whole text)."""
    at = 0 if text.startswith(name) else _next_line_with(text, name, 0)
    while at >= 0:
        end = text.find("\n", at)
        if end < 0:
            yield text[at:]
            return
        yield text[at:end]
        at = _next_line_with(text, name, end)


def _next_line_with(text: str, name: str, start: int) -> int:
    i = text.find("\n" + name, start)
    return -1 if i < 0 else i + 1


def _checked(value: float, most: float = math.inf) -> float:
    if not math.isfinite(value) or value < 0 or value > most:
        raise SourceError("out_of_range", f"value {value!r}, want a finite number in [0, {most:g}]")
    return value


class PriceSource:
    """One URL of a price or intensity, read with the servers' timeout and body limit (EngineSource.fetch:
    no redirect followed, the body bounded, credentials sent as basic auth and shown nowhere)."""

    def __init__(self, quantity: str, setting: PriceSetting, timeout_seconds: float, max_body_bytes: int):
        self.quantity, self.setting = quantity, setting
        self.http = EngineSource(quantity, setting.url, timeout_seconds, max_body_bytes)
        self.endpoint = _credentials(setting.url)

    async def read(self, session: aiohttp.ClientSession) -> tuple[SourceStatus, float | None]:
        started = time.monotonic()
        try:
            text = await self.http.fetch(session, self.endpoint)
            value = await asyncio.to_thread(self.value_of, text)  # never on the event loop: up to 8 MiB
        except SourceError as e:
            return self.status(False, str(e)[:300], time.monotonic() - started), None
        except Exception as e:  # a source never raises into the sampler
            return self.status(False, f"error: {type(e).__name__}: {e}"[:300], time.monotonic() - started), None
        return self.status(True, "", time.monotonic() - started), value

    def value_of(self, text: str) -> float:
        """The value in an answer, at most PRICE_MAXIMA of its quantity (CPU only: called in a worker thread)."""
        value = value_from_exposition(text, self.setting.series) if self.setting.series else value_from_query(text)
        return _checked(value, PRICE_MAXIMA.get(self.quantity, math.inf))

    def status(self, up: bool, reason: str, seconds: float | None, state: str | None = None) -> SourceStatus:
        return SourceStatus(source=self.quantity, server="", up=up, reason=reason, duration_seconds=seconds,
                            state=state or ("ok" if up else "down"))


def _credentials(url: str):
    """(basic auth, the URL without credentials) -- the URL is read as written, not as a server root."""
    from yarl import URL
    u = URL(url)
    auth = aiohttp.BasicAuth(u.user or "", u.password or "") if u.user or u.password else None
    return auth, str(u.with_user(None))


class PriceTracker:
    """The last good value of one PriceSource, its age, and the read in flight (at most one)."""

    def __init__(self, source: PriceSource, refresh_seconds: float, max_age_seconds: float):
        self.source, self.refresh_seconds, self.max_age_seconds = source, refresh_seconds, max_age_seconds
        self.value: float | None = None
        self.read_at: float | None = None  # monotonic time of the last good read
        self.started_at: float | None = None  # of the last read started
        self.task: asyncio.Task | None = None
        self.last_status = source.status(False, "not_read_yet", None)

    def poll(self, session: aiohttp.ClientSession, t: float) -> None:
        """Take a finished read's result; start the next one when due. Never waits."""
        if self.task is not None and self.task.done():
            status, value = self.task.result()
            self.task = None
            self.last_status = status
            if value is not None:
                self.value, self.read_at = value, t
        due = self.started_at is None or t - self.started_at >= self.refresh_seconds
        if self.task is None and due:
            self.started_at = t
            self.task = asyncio.create_task(self.source.read(session))

    def reading(self, t: float) -> PriceReading:
        """The value in use at ``t``: the last good one while younger than max_age_seconds. A failed read
        with a value still in use degrades the source; none (or a stale one) leaves it down."""
        age = None if self.read_at is None else t - self.read_at
        status = self.last_status
        if age is not None and age > self.max_age_seconds:
            detail = f"stale: last value read {age:.0f} s ago (limit {self.max_age_seconds:g} s)"
            if not status.up:
                detail += f"; last read: {status.reason}"
            return PriceReading(self.source.quantity, None, age, self.source.status(False, detail[:300],
                                                                                    status.duration_seconds))
        if age is not None and not status.up:
            status = self.source.status(True, f"{status.reason}; using the value read {age:.0f} s ago"[:300],
                                        status.duration_seconds, "degraded")
        return PriceReading(self.source.quantity, self.value if age is not None else None, age, status)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
