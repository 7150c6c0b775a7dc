"""A sidecar that answers 200 with something that is not a Prometheus exposition (HTML, JSON, binary) degrades
the server with a reason that says what it looked like, instead of leaving it "ok" with its figures silently
missing."""

import asyncio

import aiohttp
import pytest

from exporter.sources.endpoint import EngineSource, not_exposition
from tests.support.engine_expositions import Sequence
from tests.support.loopback import MetricsServer

HTML = "<!DOCTYPE html>\n<html><head><title>Grafana</title></head><body>login</body></html>\n"
JSON = '{"status": "ok", "metrics": {"hit_rate": 0.4}}\n'
BINARY = "\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x01\x00"
PLAIN = "hello\nworld\n"


def _read(src: EngineSource):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await src.read(session)
    return asyncio.run(go())


@pytest.mark.parametrize("body, looks", [(HTML, "HTML"), (JSON, "JSON"), (BINARY, "binary data"),
                                         (PLAIN, "text without a sample line")])
def test_a_sidecar_answering_200_with_something_else_degrades_the_server(body, looks):
    texts = Sequence("lmcache", "high-pressure").texts(20.0)
    with MetricsServer(lambda: texts[""]) as main, MetricsServer(lambda: body) as side:
        status, reading = _read(EngineSource("s", main.url, 2.0, 1 << 20, sidecar_urls=(side.url,)))
    assert status.up and status.state == "degraded" and status.code == "sidecar", status
    assert side.url in status.reason and f"answered 200 with {looks}" in status.reason
    assert reading.engine == "vllm"  # the server's own figures are still read


def test_expositions_are_recognised_as_such():
    texts = Sequence("lmcache", "high-pressure").texts(20.0)
    assert not_exposition(texts["sidecar"]) == "" and not_exposition(texts[""]) == ""
    assert not_exposition("") == "" and not_exposition("# HELP x y\n# TYPE x counter\nx_total 1\n") == ""
    assert not_exposition('x{a="<html>"} 1\n') == ""
