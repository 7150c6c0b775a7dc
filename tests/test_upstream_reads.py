"""What kvwatt takes from upstream, bounded and reported once: a redirect is never followed (another host's
data never passes as the configured server's), label values are cut to a bounded length, the reason label
is one word from a fixed vocabulary whatever the details, and a source's changes of health are logged once
each, never per tick. Real loopback HTTP servers, a real `kvwatt run`, a real powercap tree."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest

from exporter.config import from_mapping
from exporter.runtime.sampler import Sampler
from exporter.samples import REASON_CODES, reason_code
from exporter.serve.collector import MAX_LABEL_CHARS, TRUNCATION_MARKER, bounded_label
from exporter.sources.endpoint import EngineSource
from exporter.sources.nvml import NvmlSource
from tests.conftest import FIXTURES
from tests.support import vllm_sim as sim
from tests.support.daemon import KvwattDaemon
from tests.support.fake_gpus import STATE_ENV, FakeGpus, load_fake_nvml
from tests.support.loopback import FakeVllm, MetricsServer
from tests.support.powercap import amd

LOW = [p.read_text() for p in sorted((FIXTURES / "low-pressure").glob("*.prom"))]


class Redirector:
    """Answers every request with ``status`` and ``Location: target + path``; counts the requests."""

    def __init__(self, target: str, status: int = 302):
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                outer.requests += 1
                self.send_response(status)
                self.send_header("Location", target + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self) -> "Redirector":
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _read(url: str):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await EngineSource("s", url, 2.0, 1_000_000).read(s)
    return asyncio.run(go())


def _whole_log(d: KvwattDaemon) -> str:
    return Path(d.log_path).read_text()


# --- 8. redirects ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_to_another_port_is_not_followed(status):
    with MetricsServer(lambda: LOW[0]) as other, Redirector(other.url, status) as redirecting:
        st, reading = _read(redirecting.url)
        assert redirecting.requests == 1 and other.requests == 0  # the other server's data was never read
    assert reading is None and not st.up and st.state == "down" and st.code == "redirect"
    assert st.reason == f"redirect: {status} to {other.url}/metrics"


def test_a_redirect_target_is_reported_without_its_credentials():
    with Redirector("http://kv:secret@127.0.0.1:9") as redirecting:
        st, _ = _read(redirecting.url)
    assert st.code == "redirect" and "secret" not in st.reason and "http://127.0.0.1:9/metrics" in st.reason


def test_a_redirecting_server_is_down_in_metrics_status_and_log():
    with MetricsServer(lambda: LOW[-1]) as other, Redirector(other.url) as redirecting, \
            KvwattDaemon(servers={"r": redirecting.url}, interval="100ms") as d:
        d.wait_for(lambda d: d.value("kvwatt_source_info", source="vllm", server="r", reason="redirect") == 1,
                   what="the redirect reason")
        time.sleep(0.5)  # a few more ticks: still down, still logged once
        assert d.value("kvwatt_source_up", source="vllm", server="r") == 0
        # nothing of the other server's exposition is shown as this server's
        assert d.value("kvwatt_server_info", server="r", model_name="tiny") is None
        status = {s["server"]: s for s in d.status()["servers"]}["r"]
        assert status["up"] is False and status["reason_code"] == "redirect"
        assert f"to {other.url}/metrics" in status["reason"]
        log = _whole_log(d)
        assert other.requests == 0
    down = [line for line in log.splitlines() if "vllm server 'r' is down" in line]
    assert len(down) == 1 and f"redirect: 302 to {other.url}/metrics" in down[0], log


# --- 9. bounded labels, a fixed reason vocabulary ----------------------------------------------------------

def test_a_300_kb_model_name_gives_a_bounded_label():
    model = "org/model-" + "x" * 300_000
    text = (f'vllm:generation_tokens_total{{engine="0",model_name="{model}"}} 12\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.5\n')
    with MetricsServer(lambda: text) as srv, KvwattDaemon(servers={"big": srv.url}, interval="200ms") as d:
        d.wait_for(lambda d: d.value("kvwatt_source_up", source="vllm", server="big") == 1, what="a read")
        body = d.metrics_text()
        info = [dict(lab) for (name, lab) in d.metrics() if name == "kvwatt_server_info"]
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    assert [i["model_name"] for i in info] == [model[:MAX_LABEL_CHARS - 12] + TRUNCATION_MARKER + digest]
    assert len(info[0]["model_name"]) == MAX_LABEL_CHARS
    assert len(body) < 100_000  # the whole exposition, not one 300 KB label


def test_long_label_values_with_the_same_head_stay_apart():
    a, b = "m" * 200 + "-a", "m" * 200 + "-b"
    assert bounded_label(a) != bounded_label(b)
    assert len(bounded_label(a)) == len(bounded_label(b)) == MAX_LABEL_CHARS
    assert bounded_label("m" * MAX_LABEL_CHARS) == "m" * MAX_LABEL_CHARS  # at the limit: untouched


def test_a_bad_line_count_changing_every_tick_keeps_one_reason_label():
    served = {"n": 0}

    def body():  # one more malformed line of a family kvwatt reads at every answer
        served["n"] += 1
        return LOW[-1] + 'vllm:prompt_tokens_total{engine="0" 3\n' * served["n"]

    reasons, details = set(), set()
    with MetricsServer(body) as srv, KvwattDaemon(servers={"s": srv.url}, interval="100ms") as d:
        d.wait_for(lambda d: d.value("kvwatt_source_up", source="vllm", server="s") == 1, what="a read")
        for _ in range(15):
            reasons |= {dict(lab)["reason"] for (name, lab) in d.metrics()
                        if name == "kvwatt_source_info" and dict(lab)["server"] == "s"}
            details.add({s["server"]: s for s in d.status()["servers"]}["s"]["reason"])
            time.sleep(0.15)
        log = _whole_log(d)
    assert reasons == {"parse_error"}
    assert len(details) >= 3 and all(x.startswith("parse_error: ") and "bad lines skipped" in x for x in details)
    degraded = [line for line in log.splitlines() if "vllm server 's' is degraded" in line]
    assert len(degraded) == 1 and "parse_error" in degraded[0], log


@pytest.mark.parametrize("reason,code", [
    ("", "none"), ("not_read_yet", "not_read_yet"),
    ("timeout: no answer within 2 s", "timeout"), ("unreachable: [Errno 111] Connect call failed", "unreachable"),
    ("redirect: 302 to http://b/metrics", "redirect"), ("http_503: Service Unavailable", "http_503"),
    ("http_error: ServerDisconnectedError", "http_error"), ("body_too_large: more than 8 bytes", "body_too_large"),
    ("parse_error: 3 bad lines skipped", "parse_error"), ("parse_error: 4 bad lines skipped", "parse_error"),
    ("deadline: read still running at the tick's deadline (0.5s)", "deadline"),
    ("error: RuntimeError: boom", "error"), ("disabled: nvml: false in the configuration", "disabled"),
    ("absent: NVML library (libnvidia-ml.so.1) not found", "absent"), ("permission: Insufficient Permissions",
                                                                        "permission"),
    ("gpu lost: GPU-a (gpu 0): GPU is lost; timeout: GPU-b (gpu 1): slow", "gpu_lost"),
    ("busy: GPU-a (gpu 0): a late read still runs", "busy"),
    ("masked: energy_uj reads empty", "masked"), ("unreadable: rapl:package-1:package (Is a directory)", "unreadable"),
    ("something new: 42", "error"), ("x" * 300_000, "error"), ("http_99999", "error"),
])
def test_every_reason_maps_to_one_word_of_the_vocabulary(reason, code):
    assert reason_code(reason) == code and code in REASON_CODES | {"http_503"}


# --- 12. changes of health logged once ---------------------------------------------------------------------

async def _ticks(sampler: Sampler, n: int, interval: float = 0.05) -> list:
    out = []
    for _ in range(n):
        out.append(await sampler.tick(time.monotonic()))
        await asyncio.sleep(interval)
    return out


def _lines(caplog, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()]


def _said(caplog, text: str) -> list[str]:
    """Every line at info or above that mentions ``text``."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and text in r.getMessage()]


def test_a_server_going_down_and_up_is_logged_once_each(caplog):
    caplog.set_level(logging.DEBUG, logger="kvwatt")
    with FakeVllm(sim.stable_high_pressure_on(), auto=False) as fv:
        # ticks are driven here; the interval only sets the reads' deadline (0.5 s: no miss on a loaded machine)
        cfg = from_mapping({"servers": [{"name": "a", "url": fv.url}], "interval": "1s", "http_timeout": "1s"})

        async def run():
            async with Sampler(cfg, energy=False) as sampler:
                up1 = await _ticks(sampler, 8)
                fv.set_down("refuse")
                down = await _ticks(sampler, 15)
                fv.set_down(None)
                up2 = await _ticks(sampler, 8)
            return up1, down, up2

        up1, down, up2 = asyncio.run(run())
    state = lambda ticks: [t.servers["a"].status.up for t in ticks if "a" in t.servers]  # noqa: E731
    assert all(state(up1)) and state(down).count(False) >= 10 and state(up2)[-1] is True
    went_down = _lines(caplog, logging.WARNING, "vllm server 'a' is down")
    came_up = _lines(caplog, logging.INFO, "vllm server 'a' is back up")
    assert len(went_down) == 1 and len(came_up) == 1, caplog.text
    assert "unreachable" in went_down[0] or "http_error" in went_down[0]  # refused, or the kept-alive one dropped
    assert len(_said(caplog, "'a'")) == 2, caplog.text  # nothing else at info or above, nothing per tick


def test_energy_sources_going_down_and_up_are_logged_once_each(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvwatt")
    tree = amd(tmp_path)
    cfg = from_mapping({"servers": [], "interval": "1s", "nvml": False, "powercap_root": tree.root})

    async def run():
        async with Sampler(cfg) as sampler:
            await _ticks(sampler, 5)
            tree.make_unreadable("intel-rapl:0", how="directory")
            down = await _ticks(sampler, 10)
            tree.path("intel-rapl:0").rmdir()
            tree.set_energy("intel-rapl:0", 5_000_000)
            up = await _ticks(sampler, 5)
        return down, up

    down, up = asyncio.run(run())
    rapl = lambda ticks: [s.up for t in ticks for s in t.energy_statuses if s.source == "rapl"]  # noqa: E731
    assert rapl(down).count(False) >= 8 and rapl(up)[-1] is True
    went_down = _lines(caplog, logging.WARNING, "rapl is down")
    assert len(went_down) == 1 and "unreadable: rapl:package-0:package" in went_down[0], caplog.text
    assert len(_lines(caplog, logging.INFO, "rapl is back up")) == 1, caplog.text
    assert len(_said(caplog, "rapl")) == 2, caplog.text  # nothing else at info or above, nothing per tick
    # NVML is off by configuration: down from the first tick, said once
    nvml = _lines(caplog, logging.WARNING, "nvml is down")
    assert len(nvml) == 1 and "disabled" in nvml[0], caplog.text


def test_a_gpu_lost_and_back_is_logged_once_each(tmp_path, caplog, monkeypatch):
    """NVML through its test double (no GPU here; tests/test_energy_nvml.py says why a double): one of two GPUs
    falls off the bus for many ticks (its retries back off meanwhile), then returns."""
    caplog.set_level(logging.DEBUG, logger="kvwatt")
    gpus = FakeGpus(tmp_path / "gpus.json", energy_read_latency=0)
    monkeypatch.setenv(STATE_ENV, gpus.path)
    a, b = "GPU-aaaaaaaa-0000-0000-0000-000000000001", "GPU-bbbbbbbb-0000-0000-0000-000000000002"
    gpus.add(a)
    gpus.add(b)
    cfg = from_mapping({"servers": [], "interval": "1s", "powercap_root": str(tmp_path / "no-powercap")})

    async def run():
        async with Sampler(cfg, nvml=NvmlSource(module=load_fake_nvml())) as sampler:
            await _ticks(sampler, 5)
            gpus.update(b, lost=True)
            lost = await _ticks(sampler, 40)  # 2 s and more: several back-off retries of the lost GPU
            gpus.update(b, lost=False)
            deadline = time.monotonic() + 30  # the next retry is due within the back-off (a few s)
            back = []
            while time.monotonic() < deadline and not (back and back[-1].energy_statuses[0].state == "ok"):
                back += await _ticks(sampler, 5, interval=0.2)
            back += await _ticks(sampler, 5)
        return lost, back

    lost, back = asyncio.run(run())
    nvml = lambda ticks: [s.state for t in ticks for s in t.energy_statuses if s.source == "nvml"]  # noqa: E731
    assert nvml(lost).count("degraded") >= 35 and nvml(back)[-1] == "ok", (nvml(lost), nvml(back))
    # one line when it is lost (naming it), one when it is back; nothing per tick, nothing said twice
    said = [line for line in _said(caplog, "nvml") if "measured by" not in line]
    assert len(said) == 2, caplog.text
    assert b in said[0] and "is down (GPU is lost)" in said[0], said
    assert b in said[1] and said[1].endswith("is back"), said
