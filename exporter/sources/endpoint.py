"""The HTTP read of one watched server: its /metrics (and its sidecars'), bounded in time and size, decoded by
the engine adapters (sources/combine.py) in a worker thread. Never raises: a failure is a SourceStatus."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import replace

import aiohttp
from yarl import URL

from exporter.samples import EngineReading, SourceStatus
from exporter.sources.combine import read_exposition
from exporter.sources.engine import EngineAdapter, SourceError
from exporter.sources.labelcap import LabelCap
from exporter.sources.ranges import OUT_OF_RANGE

log = logging.getLogger("kvwatt.engine")


MAX_DETAIL_CHARS = 300  # a reason's detail may quote upstream data (an error message, a Location header)


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "..."


def _redirect_target(resp: aiohttp.ClientResponse) -> str:
    """Where a 3xx answer points, resolved against the URL read, without credentials, bounded."""
    location = resp.headers.get("Location", "")
    if not location:
        return "(no Location header)"
    try:
        target = str(resp.url.join(URL(location)).with_user(None))
    except ValueError:  # not a URL: quote it as it came
        target = location
    return _bounded(target)


def metrics_url(url: str) -> str:
    """The exposition's URL: ``url`` itself when its path names one (its last segment ends in ``metrics``:
    trtllm-serve's ``/prometheus/metrics``, docs/engines.md "Metrics paths"), else ``url`` + ``/metrics``
    (``http://host:8000`` and a proxy's prefix ``http://gw/vllm-a`` keep meaning their ``/metrics``)."""
    base = url.rstrip("/")
    path = URL(base).path
    return base if path.rsplit("/", 1)[-1].endswith("metrics") else base + "/metrics"


_SAMPLE_LINE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})?[ \t]+\S")
SNIFF_LINES = 20  # lines looked at to tell an exposition from something else


def not_exposition(text: str) -> str:
    """What a 200 answer looked like when it is not a Prometheus exposition ("HTML", "JSON", "binary data",
    "text without a sample line"); "" when it is one (or empty: nothing yet is not something else). Only the
    first ``SNIFF_LINES`` non-comment lines are looked at: the decision costs no more for a big body."""
    head = text.lstrip()[:4096]
    if not head:
        return ""
    if "\x00" in head or head.count("\ufffd") > 8:  # NULs, or bytes that are not UTF-8 (decoded with replace)
        return "binary data"
    if head.startswith("<"):
        return "HTML" if "html" in head[:512].lower() else "XML/HTML-like markup"
    if head[0] in "{[":
        return "JSON"
    lines = [ln.strip() for ln in head.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")][:SNIFF_LINES]
    if lines and not any(_SAMPLE_LINE.match(ln) for ln in lines):
        return "text without a sample line"
    return ""


def _endpoint(url: str) -> tuple[aiohttp.BasicAuth | None, str]:
    """(basic auth from the URL's credentials, the exposition's URL without them)."""
    u = URL(url)
    auth = aiohttp.BasicAuth(u.user or "", u.password or "") if u.user or u.password else None
    return auth, metrics_url(str(u.with_user(None)))


class EngineSource:
    """Reads one engine server's exposition (whichever engine it is: the adapters decide). ``read()`` returns
    (status, reading or None); it never raises.

    ``adapter`` fixes the engine adapter; by default each exposition picks its own (sources/combine.py: the
    engine a registered adapter recognises, vLLM when none does, with the add-ons found beside it).

    ``sidecar_urls``: further expositions of the same server (LMCache's port beside vLLM's, Dynamo KVBM's
    port), fetched at the same time as the server's with the same timeout and merged into its reading; one
    that fails degrades the read (reason ``sidecar``), it does not fail it."""

    def __init__(self, name: str, url: str, timeout_seconds: float, max_body_bytes: int,
                 adapter: EngineAdapter | None = None, sidecar_urls: tuple[str, ...] = ()):
        self.name = name
        # credentials in the URL go as basic auth and nowhere else: metrics_url is safe to show in a reason
        self.auth, self.metrics_url = _endpoint(url)
        self.sidecars = [_endpoint(u) for u in sidecar_urls]
        self.timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self.max_body_bytes = max_body_bytes
        self.adapter = adapter
        self._rejected: frozenset[str] = frozenset()  # families refused as out of range at the last read
        self.label_cap = LabelCap(name)

    async def fetch(self, session: aiohttp.ClientSession, endpoint: tuple | None = None) -> str:
        auth, url = endpoint or (self.auth, self.metrics_url)
        try:
            # a redirect is not followed: another host's or port's data must never pass as this server's
            async with session.get(url, timeout=self.timeout, auth=auth, allow_redirects=False) as resp:
                if 300 <= resp.status < 400:
                    raise SourceError("redirect", f"{resp.status} to {_redirect_target(resp)}")
                if resp.status != 200:
                    raise SourceError(f"http_{resp.status}", _bounded(resp.reason or ""))
                if (resp.content_length or 0) > self.max_body_bytes:
                    raise SourceError("body_too_large", f"more than {self.max_body_bytes} bytes")
                chunks, size = [], 0
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > self.max_body_bytes:  # chunked bodies announce no length: count as we go
                        raise SourceError("body_too_large", f"more than {self.max_body_bytes} bytes")
                    chunks.append(chunk)
                return b"".join(chunks).decode("utf-8", errors="replace")
        except asyncio.TimeoutError:
            raise SourceError("timeout", f"no answer within {self.timeout.total:g} s") from None
        except aiohttp.ClientConnectorError as e:
            raise SourceError("unreachable", str(e.os_error or e)) from None
        except aiohttp.ClientError as e:
            raise SourceError("http_error", type(e).__name__) from None

    def decode(self, text: str, problems: list[str] | None = None) -> EngineReading:
        """Parse and extract one exposition (CPU only, no I/O: call it from a worker thread). Raises
        SourceError("parse_error", ...) when nothing usable; skipped bad lines are appended to ``problems``."""
        try:
            reading = self.adapter.read(text, problems) if self.adapter else read_exposition(text, problems)
        except SourceError:
            raise
        except Exception as e:  # a bug in an adapter must not take the daemon down: this server is down
            log.exception("%s: decoding the exposition failed", self.name)
            raise SourceError("parse_error", f"{type(e).__name__}: {e}") from None
        self._note_rejected(reading.rejected)
        reading = self.label_cap.apply(reading, problems)  # upstream label values without bound: the first N
        if reading.rejected and problems is not None:
            problems.append(OUT_OF_RANGE)  # a fixed word: it becomes a label value (kvwatt_source_info)
        return reading

    def _note_rejected(self, rejected: dict[str, str]) -> None:
        """Log the refused values when the set of refused families changes, not at every read (one read of
        a server is in flight at a time, so this state is not shared between threads)."""
        families = frozenset(rejected)
        if families == self._rejected:
            return
        self._rejected = families
        if families:
            log.warning("%s: values out of range, these families are unknown until they are back in range: %s",
                        self.name, "; ".join(f"{k}: {d}" for k, d in sorted(rejected.items())))
        else:
            log.info("%s: values back in range", self.name)

    def status(self, problems: list[str], seconds: float) -> SourceStatus:
        """The status of a read that produced a reading: ok, or degraded with the problems as the reason."""
        if problems:
            return SourceStatus(source="vllm", server=self.name, up=True, reason=_bounded("; ".join(problems)),
                                duration_seconds=seconds, state="degraded")
        return SourceStatus(source="vllm", server=self.name, up=True, reason="", duration_seconds=seconds, state="ok")

    def down(self, error: SourceError, seconds: float) -> SourceStatus:
        """Down, the reason's word first (the label), then its detail (for the log and /api/status)."""
        return SourceStatus(source="vllm", server=self.name, up=False, reason=_bounded(str(error)),
                            duration_seconds=seconds, state="down")

    async def read(self, session: aiohttp.ClientSession) -> tuple[SourceStatus, EngineReading | None]:
        start = time.perf_counter()
        problems: list[str] = []
        try:
            text = await self._fetch_all(session, problems)
            wall = time.time()  # when this process was read: tells a restart from another process (store/identity.py)
            reading = await asyncio.to_thread(self.decode, text, problems)  # never on the event loop
            reading = replace(reading, read_wall=wall)
        except SourceError as e:
            return self.down(e, time.perf_counter() - start), None
        return self.status(problems, time.perf_counter() - start), reading

    async def _fetch_all(self, session: aiohttp.ClientSession, problems: list[str]) -> str:
        """The server's exposition followed by each sidecar's that answered (one text: the adapters read
        them together). The server failing fails the read; a sidecar failing is a problem."""
        if not self.sidecars:
            return await self.fetch(session)
        results = await asyncio.gather(self.fetch(session), *(self.fetch(session, e) for e in self.sidecars),
                                       return_exceptions=True)
        if isinstance(results[0], BaseException):
            raise results[0]
        texts = [results[0]]
        for (_, url), result in zip(self.sidecars, results[1:]):
            if isinstance(result, SourceError):
                problems.append(f"sidecar: {url} {result}")
            elif isinstance(result, BaseException):
                raise result
            elif looks := not_exposition(result):  # read as one, it would only lose its figures silently
                problems.append(f"sidecar: {url} answered 200 with {looks}, not a Prometheus exposition")
            else:
                texts.append(result)
        return "\n".join(t.rstrip("\n") for t in texts) + "\n"
