"""/metrics as the Prometheus ecosystem expects it (the Prometheus exporter conventions): the format and the
compression negotiated as prometheus_client's own handler does (OpenMetrics when Accept asks for it, gzip when
Accept-Encoding names it, ``name[]`` filtering), the process' own process_*/python_* families and
kvwatt_build_info, the exposition on ``--web.telemetry-path``, JSON logs with ``--log.format json``.

A real `kvwatt run` over loopback HTTP watching a real vLLM 0.32 exposition, parsed with prometheus_client's
own text and OpenMetrics parsers; then a real Prometheus (Debian package) scraping it, and the headers that
Prometheus really sends replayed against kvwatt.
"""

from __future__ import annotations

import gzip
import json
import platform
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from exporter import __version__
from exporter.runtime.build import build_info
from tests.conftest import FIXTURES
from tests.support import prom
from tests.support.daemon import KvwattDaemon
from tests.support.loopback import MetricsServer

PATH = "/exposition"  # --web.telemetry-path: every request below goes there
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
IDENTITY = {"Accept-Encoding": "identity"}  # requests asks for gzip by default
RUNTIME = {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
           "process_start_time_seconds", "python_info", "python_gc_objects_collected_total"}


@pytest.fixture(scope="module")
def kvwatt():
    text = sorted((FIXTURES / "low-pressure").glob("*.prom"))[0].read_text()
    # a 60 s interval: the tests below see one tick (a tick between two reads is detected: same_tick)
    with MetricsServer(lambda: text) as vllm, \
         KvwattDaemon(servers={"a": vllm.url}, interval="60s",
                      args=("--web.telemetry-path", PATH, "--log.format", "json", "--log.level", "debug")) as d:
        yield d


def get(d: KvwattDaemon, headers: dict | None = None, params=None) -> requests.Response:
    """The response as sent: a gzipped body stays compressed (requests would inflate it silently)."""
    r = d.get(PATH, headers={**IDENTITY, **(headers or {})}, params=params, stream=True)
    r.raw_body = r.raw.read(decode_content=False)
    assert r.status_code == 200, (r.status_code, r.raw_body[:200])
    return r


def same_tick(d: KvwattDaemon, *requests_) -> list[requests.Response]:
    """The responses to ``requests_`` (header dicts) from one tick: the plain text is read before and after
    (process_cpu_seconds changes every tick), and the lot read again if a tick fell in between."""
    for _ in range(3):
        before = get(d).raw_body
        out = [get(d, h) for h in requests_]
        if get(d).raw_body == before:
            return out
    raise AssertionError("a tick between every pair of reads")


def samples(families) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in families:
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate sample {key}"
            out[key] = s.value
    return out


def names(families) -> set[str]:
    return {s.name for fam in families for s in fam.samples}


def test_default_is_the_text_format_with_build_info_and_the_process_families(kvwatt):
    r = get(kvwatt)
    assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "Content-Encoding" not in r.headers
    got = samples(parse_text(r.raw_body.decode()))
    b = build_info()  # the daemon runs from this checkout: the same revision
    assert got[("kvwatt_build_info", frozenset({"version": __version__, "revision": b.revision,
                                                 "python_version": platform.python_version()}.items()))] == 1
    assert RUNTIME <= {name for name, _ in got}
    assert got[("process_resident_memory_bytes", frozenset())] > 10 * 2**20
    assert got[("kvwatt_source_up", frozenset({"source": "vllm", "server": "a"}.items()))] == 1
    assert kvwatt.get("/metrics").status_code == 404  # the exposition moved to --web.telemetry-path
    assert f'<a href="{PATH}">Metrics</a>' in kvwatt.get("/").text  # the landing page links where it went


def test_openmetrics_when_accept_asks_for_it_same_samples_as_the_text(kvwatt):
    text, om = same_tick(kvwatt, {}, {"Accept": OPENMETRICS})
    assert om.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0; charset=utf-8")
    body = om.raw_body.decode()
    assert body.endswith("# EOF\n") and body.count("# EOF") == 1
    om_families = list(parse_openmetrics(body))  # prometheus_client's strict OpenMetrics parser
    assert samples(om_families) == samples(parse_text(text.raw_body.decode()))
    types = {f.name: f.type for f in om_families}
    assert types["process_cpu_seconds"] == "counter" and types["kvwatt_source_up"] == "gauge"


@pytest.mark.parametrize("accept", [None, OPENMETRICS])
def test_gzip_when_accept_encoding_names_it_decompresses_to_the_same_bytes(kvwatt, accept):
    want = {"Accept": accept} if accept else {}
    plain, zipped = same_tick(kvwatt, want, {**want, "Accept-Encoding": "deflate, gzip;q=0.9"})
    assert zipped.headers["Content-Encoding"] == "gzip"
    assert zipped.headers["Content-Type"] == plain.headers["Content-Type"]
    assert gzip.decompress(zipped.raw_body) == plain.raw_body
    assert len(zipped.raw_body) < len(plain.raw_body) / 3


@pytest.mark.parametrize("accept", [None, OPENMETRICS])
def test_name_filter_returns_only_those_families(kvwatt, accept):
    wanted = ["kvwatt_build_info", "process_open_fds", "kvwatt_source_up"]
    r = get(kvwatt, {"Accept": accept} if accept else {}, params=[("name[]", n) for n in wanted])
    body = r.raw_body.decode()
    families = list(parse_openmetrics(body) if accept else parse_text(body))
    assert names(families) == set(wanted)
    full = list(parse_text(get(kvwatt).raw_body.decode()))
    up = lambda fams: sorted(sorted(s.labels.items()) for f in fams for s in f.samples  # noqa: E731
                             if s.name == "kvwatt_source_up")
    assert len(up(families)) >= 3 and up(families) == up(full)  # every sample of a family named
    # gzipped too, and a name that matches nothing gives an empty (valid) exposition
    z = get(kvwatt, {"Accept-Encoding": "gzip"}, params=[("name[]", "process_open_fds")])
    assert z.headers["Content-Encoding"] == "gzip"
    assert names(parse_text(gzip.decompress(z.raw_body).decode())) == {"process_open_fds"}
    assert get(kvwatt, params={"name[]": "no_such_series"}).raw_body == b""


def test_an_accept_version_prometheus_client_cannot_compare_gets_the_text_format(kvwatt):
    """choose_encoder raises TypeError on version=1.x (it compares 'x' with 0): the text format, not a 500."""
    r = get(kvwatt, {"Accept": "application/openmetrics-text; version=1.x"})
    assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "kvwatt_build_info" in r.raw_body.decode()


def test_logs_are_json_lines_with_the_fixed_keys(kvwatt):
    lines = [line for line in open(kvwatt.log_path).read().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON record
    assert records and all({"ts", "level", "logger", "caller", "msg"} <= set(r) for r in records), lines
    assert {r["level"] for r in records} <= {"debug", "info", "warn", "error"}
    assert any("listening on" in r["msg"] and PATH in r["msg"] and build_info().revision in r["msg"]
               for r in records)
    assert any(r["level"] == "warn" and "nvml is down" in r["msg"] for r in records)  # no GPU here


class HeaderRecorder:
    """A scrape target that records the headers of each GET and answers a one-sample exposition."""

    def __init__(self):
        self.headers: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                outer.headers.append(dict(self.headers))
                body = b"# TYPE recorder_up gauge\nrecorder_up 1\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.prom
def test_prometheus_scrapes_it_and_its_own_accept_headers_get_openmetrics_gzipped(kvwatt, tmp_path):
    assert shutil.which("prometheus"), f"prometheus missing: {prom.INSTALL_HINT}"
    recorder = HeaderRecorder()
    try:
        with prom.Prometheus(tmp_path, jobs={"kvwatt": [f"127.0.0.1:{kvwatt.port}"], "recorder": [recorder.address]},
                             job_options={"kvwatt": {"metrics_path": PATH}}) as p:
            p.wait_for(lambda: p.value('up{job="kvwatt"}') == 1 and recorder.headers, timeout=60,
                       what="both targets scraped")
            assert p.value(f'kvwatt_build_info{{job="kvwatt",version="{__version__}"}}') == 1
            assert p.value('process_cpu_seconds_total{job="kvwatt"}') is not None
            assert p.value('kvwatt_source_up{job="kvwatt",source="vllm",server="a"}') == 1
            assert p.targets("kvwatt")[0]["lastError"] == ""
    finally:
        recorder.close()
    sent = recorder.headers[0]
    r = get(kvwatt, {"Accept": sent["Accept"], "Accept-Encoding": sent["Accept-Encoding"]})
    assert r.headers["Content-Type"].startswith("application/openmetrics-text"), sent
    assert r.headers["Content-Encoding"] == "gzip", sent
    assert gzip.decompress(r.raw_body).endswith(b"# EOF\n")
