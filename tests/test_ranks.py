"""Engines as they run in production: parallel ranks, routers, metrics paths, expositions no adapter
can use, and the engine name of a down server -- through the real HTTP read (loopback) and the daemon's model.

The expositions are tests/support/rank_expositions.py's (committed frames under tests/data/<engine>/, the
READMEs there say what each is shaped after); a frame at t seconds scales the counters of the one at T0.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from exporter.config import from_mapping
from exporter.model import Model
from exporter.runtime.daemon import Daemon
from exporter.runtime.sampler import Sampler
from exporter.samples import ServerRead, Tick
from exporter.serve import page
from exporter.serve.web import status_json
from exporter.sources import combine
from exporter.sources.endpoint import EngineSource, metrics_url
from tests.support import rank_expositions as rx
from tests.support.daemon import REPO
from tests.support.engine import free_port
from tests.support.loopback import MetricsServer
from tests.test_golden import WALL, samples

DATA = REPO / "tests" / "data"


def _read(src: EngineSource):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await src.read(session)
    return asyncio.run(go())


def run(tmp_path, urls: dict[str, str], frames: dict[str, object], ticks: int) -> Daemon:
    """The daemon's model fed by real HTTP reads: at tick t each server serves ``frames[name](t)`` (None:
    answer 503) over loopback, read by EngineSource as the sampler reads it."""
    cfg = from_mapping({
        "servers": [{"name": n, "url": u, "gpus": []} for n, u in urls.items()],
        "windows": ["30s"], "min_load_duration": "5s", "collapse_reference_window": "30s",
        "threshold_window": "10s", "state_dir": str(tmp_path / "state"),
        "powercap_root": str(tmp_path / "no-powercap"), "nvml": False,
        "metrics_opt_in": ["kvwatt_kv_pools_above_threshold"],  # opt-in since issue 39 (exporter/rules/optin.py)
    })
    daemon = Daemon(cfg, sampler=Sampler(cfg, energy=False), model=Model(cfg, wall_clock=lambda: WALL))
    sources = {s.name: EngineSource(s.name, s.url, 2.0, 1 << 24) for s in cfg.servers}
    for t in range(1, ticks + 1):
        frames["now"] = t
        reads = {}
        for name, src in sources.items():
            status, reading = _read(src)
            reads[name] = ServerRead(name, status, reading)
        daemon.step(Tick(float(t), reads))
    return daemon


def window(daemon: Daemon, server: str):
    s = next(s for s in daemon.snapshot.servers if s.name == server)
    return s.windows[0]


def served(text_at):
    """A MetricsServer body following the run's clock: the frame at T0 + tick seconds."""
    clock = {"now": 0}
    return clock, (lambda: text_at(rx.T0 + clock["now"]))


# --- SGLang with DP attention: 8 ranks ---------------------------------------------------------------------
def test_dp_attention_tokens_per_second_is_the_sum_of_the_ranks_and_kv_reflects_every_pool(tmp_path):
    frame = rx.sglang_dp_attention()
    clock, body = served(lambda t: rx.at(frame, t))
    with MetricsServer(body) as srv:
        daemon = run(tmp_path, {"dp": srv.url}, clock, ticks=12)
    w = window(daemon, "dp")
    assert w.generation_tokens_per_second == pytest.approx(sum(rx.DP_GEN))  # 3600/s, not rank 0's 100/s
    assert w.preemptions_per_minute == pytest.approx(60 * sum(rx.DP_RETRACT))
    assert w.kv_usage_max == pytest.approx(max(rx.DP_USAGE))  # the fullest pool, not rank 0's 0.30
    assert w.kv_usage_p95 == pytest.approx(max(rx.DP_USAGE))
    assert w.kv_pools_above_threshold == rx.DP_POOLS_ABOVE_090
    text = daemon.published.exposition.decode()
    got = samples(text)
    assert got[("kvwatt_kv_pools_above_threshold", frozenset({("server", "dp"), ("window", "30s")}))] == 2
    assert status_json(daemon.snapshot)["servers"][0]["windows"]["30s"]["kv_pools_above_threshold"] == 2


def test_dp_attention_ranks_are_each_read_with_tp_rank_equal_to_dp_rank():
    r = combine.read_exposition((DATA / "sglang" / "dp-attention-8.prom").read_text())
    assert r.counters["generation_tokens"] == pytest.approx(sum(rx.DP_GEN) * rx.T0)
    assert sorted(r.engine_counters) == [str(i) for i in range(rx.DP_RANKS)]  # each rank's resets tracked
    assert r.gauges["running"] == 16 * rx.DP_RANKS
    assert [r.gauges[f"kv_pool_usage@{i}"] for i in range(rx.DP_RANKS)] == list(rx.DP_USAGE)


def test_a_tp_replica_inside_a_dp_rank_is_still_counted_once():
    """--tp 16 --dp 8: two attention-TP ranks per DP rank; the second (tp_rank 2r+1) repeats the first."""
    lines = []
    for r in range(2):
        for tp in (2 * r, 2 * r + 1):
            lab = f'dp_rank="{r}",tp_rank="{tp}"'
            lines += [f"sglang:generation_tokens_total{{{lab}}} {100.0 * (r + 1)}",
                      f"sglang:token_usage{{{lab},pid=\"{tp}\"}} {0.5 + 0.1 * r}"]
    r = combine.read_exposition("\n".join(lines) + "\n")
    assert r.counters["generation_tokens"] == 300.0
    assert r.gauges["kv_usage"] == 0.6 and r.gauges["kv_pool_usage@0"] == 0.5


# --- pipeline stages, a router -----------------------------------------------------------------------------
def test_pipeline_stages_are_not_double_counted(tmp_path):
    frame = rx.sglang_pipeline()
    clock, body = served(lambda t: rx.at(frame, t))
    with MetricsServer(body) as srv:
        daemon = run(tmp_path, {"pp": srv.url}, clock, ticks=8)
    w = window(daemon, "pp")
    assert w.generation_tokens_per_second == pytest.approx(rx.PP_GEN)
    assert w.kv_pools_above_threshold is None  # one engine: one pool figure, its usage p95 says it


def test_a_later_pipeline_stage_alone_is_still_read():
    r = combine.read_exposition(rx.sglang_pipeline((1,)))
    assert r.counters["generation_tokens"] == rx.PP_GEN * rx.T0 and r.gauges["kv_usage"] == rx.PP_USAGE[1]


def test_a_router_sums_its_workers_and_keeps_each_pool(tmp_path):
    frame = (DATA / "sglang" / "router-3-workers.prom").read_text()
    clock, body = served(lambda t: rx.at(frame, t))
    with MetricsServer(body) as srv:
        daemon = run(tmp_path, {"router": srv.url}, clock, ticks=8)
    w = window(daemon, "router")
    assert w.generation_tokens_per_second == pytest.approx(sum(rx.ROUTER_GEN))  # TP rank 1 not counted again
    assert w.kv_usage_max == pytest.approx(max(rx.ROUTER_USAGE))
    assert w.kv_pools_above_threshold == 1


def test_vllm_data_parallel_engines_are_pools_too():
    text = "".join(f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {u}\n'
                   f'vllm:generation_tokens_total{{engine="{e}",model_name="m"}} 10.0\n'
                   for e, u in ((0, 0.2), (1, 0.95)))
    r = combine.read_exposition(text)
    assert r.gauges["kv_usage"] == 0.95 and r.gauges["kv_pool_usage@1"] == 0.95 and r.gauges["kv_pool_usage@0"] == 0.2


# --- metrics paths and the shapes no adapter can use --------------------------------------------------------
@pytest.mark.parametrize("url, want", [
    ("http://h:8000", "http://h:8000/metrics"),
    ("http://h:8000/", "http://h:8000/metrics"),
    ("http://h:8000/prometheus/metrics", "http://h:8000/prometheus/metrics"),
    ("http://gw/vllm-a", "http://gw/vllm-a/metrics"),  # a proxy's prefix keeps meaning its /metrics
    ("http://h:8000/metrics", "http://h:8000/metrics"),
])
def test_a_server_url_may_name_its_metrics_path(url, want):
    assert metrics_url(url) == want


def test_trtllm_serve_json_on_metrics_and_the_exposition_on_its_prometheus_path():
    trt = ("# HELP trtllm_kv_cache_utilization x\n# TYPE trtllm_kv_cache_utilization gauge\n"
           'trtllm_kv_cache_utilization{model_name="m",engine_type="trtllm"} 0.4\n'
           'trtllm_generation_tokens_total{model_name="m",engine_type="trtllm"} 100.0\n')
    json_body = (DATA / "trtllm" / "metrics.json").read_text()
    with MetricsServer(lambda: json_body, paths={"/prometheus/metrics": lambda: trt}) as srv:
        status, reading = _read(EngineSource("t", srv.url, 2.0, 1 << 20))
        assert not status.up and status.code == "parse_error"
        assert "JSON" in status.reason and "/prometheus/metrics" in status.reason
        status, reading = _read(EngineSource("t", srv.url + "/prometheus/metrics", 2.0, 1 << 20))
        assert status.state == "ok" and reading.engine == "trtllm" and reading.gauges["kv_usage"] == 0.4


@pytest.mark.parametrize("name, words", [
    ("trtllm/latency-only.prom", ("TensorRT-LLM latency series only", "no KV-cache series", "start trtllm-serve")),
    ("dynamo/frontend.prom", ("Dynamo frontend", "DYN_SYSTEM_PORT")),
    ("trtllm/metrics.json", ("JSON",)),
])
def test_an_unusable_exposition_says_what_it_looks_like(name, words):
    text = (DATA / name).read_text()
    with MetricsServer(lambda: text) as srv:
        status, reading = _read(EngineSource("s", srv.url, 2.0, 1 << 20))
    assert reading is None and status.code == "parse_error"
    assert "vllm" not in status.reason
    for w in words:
        assert w in status.reason


def test_an_unknown_exposition_names_what_it_starts_with():
    with pytest.raises(Exception) as e:
        combine.read_exposition("# TYPE foo_requests counter\nfoo_requests_total 3\n")
    assert "foo_requests" in str(e.value) and "no usable vllm" not in str(e.value)


# --- the engine name of a down server ----------------------------------------------------------------------
def test_a_down_server_has_one_engine_name_in_metrics_status_and_page(tmp_path):
    frame = rx.sglang_dp_attention()
    clock, body = served(lambda t: rx.at(frame, t) if clock["now"] <= 3 else None)  # up 3 ticks, then 503
    never = f"http://127.0.0.1:{free_port()}"  # nothing listens: never read
    with MetricsServer(body) as srv:
        daemon = run(tmp_path, {"gone": srv.url, "never": never}, clock, ticks=6)
    got = samples(daemon.published.exposition.decode())
    info = {dict(labels)["server"]: dict(labels)["engine"] for name, labels in got if name == "kvwatt_server_info"}
    js = status_json(daemon.snapshot)
    status = {s["server"]: s["engine"] for s in js["servers"]}
    html = page.render(json.loads(json.dumps(js, default=str)))
    assert info == status == {"gone": "sglang", "never": "unknown"}
    assert all(not s["up"] for s in js["servers"])
    assert "· unknown ·" in html and "· sglang ·" in html and "· vllm ·" not in html


def test_the_shape_frames_are_current():
    r = subprocess.run([sys.executable, str(DATA / "engines" / "shapes.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
