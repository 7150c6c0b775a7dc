"""One server's failing derivation degrades that server only, never the tick (issue 38, item 1).

A residency histogram with a bucket le="1e300" on one offloading server made its buffer recommendation
2e9 B/s x 1e300 s x 1.5 = inf; the whole-GiB rounding raised OverflowError inside Model.snapshot, every tick
failed, /healthz turned 503 and the other server's figures and as_of froze. Now: (a) an exception in one server's
learning or derivation makes that server's figures unknown with the reason (logged once), the others go on;
(b) a bucket edge beyond the engine's process age reads as that age (a reuse gap is at most the process' age);
(c) settings that would overflow are refused by the configuration (tests/test_config_agreement.py).
"""

from __future__ import annotations

import logging
import math
import time

from exporter import catalog
from exporter.catalog.bounds import BoundsCheck
from exporter.config import from_mapping
from exporter.model import Model
from exporter.runtime.daemon import Daemon
from exporter.samples import ServerRead, SourceStatus, Tick
from exporter.serve.collector import exposition
from exporter.serve.page import render
from exporter.serve.web import status_json
from exporter.sources.vllm import VllmAdapter
from tests.support.daemon import KvwattDaemon
from tests.support.loopback import MetricsServer

EDGES = ("0.5", "1.0", "20.0", "1e300", "+Inf")
WRITE_BYTES_PER_SECOND = 2e9
PROCESS_AGE_SECONDS = 100.0


def _hist(name: str, n: float, edge: str) -> list[str]:
    """A histogram whose observations all lie in the bucket ``le=edge`` (and above)."""
    out = [f"# TYPE vllm:{name} histogram"]
    out += [f'vllm:{name}_bucket{{engine="0",le="{e}",model_name="m"}} {n if i >= EDGES.index(edge) else 0}'
            for i, e in enumerate(EDGES)]
    return out + [f'vllm:{name}_count{{engine="0",model_name="m"}} {n}',
                  f'vllm:{name}_sum{{engine="0",model_name="m"}} {n}']


def exposition_at(t: float, gap_edge: str, start: float) -> str:
    """An offloading vLLM at t seconds: 2e9 B/s written to a 1 GiB CPU pool, every reuse gap in ``gap_edge``."""
    lines = ["# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {start}",
             "# TYPE vllm:cache_config_info gauge",
             'vllm:cache_config_info{block_size="16",engine="0",kv_offloading_size="1",num_gpu_blocks="1000"} 1.0',
             "# TYPE vllm:kv_cache_usage_perc gauge", 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
             "# TYPE vllm:prompt_tokens_total counter",
             f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {1000 * t}',
             "# TYPE vllm:kv_offload_store_bytes_total counter",
             f'vllm:kv_offload_store_bytes_total{{engine="0",model_name="m"}} {WRITE_BYTES_PER_SECOND * t}']
    lines += _hist("kv_block_idle_before_evict_seconds", 20.0 * t, "0.5")
    lines += _hist("kv_block_reuse_gap_seconds", 20.0 * t, gap_edge)
    return "\n".join(lines) + "\n"


def _config():
    return from_mapping({"servers": [{"name": "bad", "url": "http://127.0.0.1:9"},
                                     {"name": "good", "url": "http://127.0.0.1:10"}],
                         "windows": ["10s"], "state_dir": "/nonexistent-kvwatt-state", "nvml": False})


def _tick(t: float, start: float, edges: dict[str, str]) -> Tick:
    return Tick(t, {name: ServerRead(name, SourceStatus(source="vllm", server=name, up=True, reason="",
                                                        duration_seconds=0.01, state="ok"),
                                     VllmAdapter().read(exposition_at(t, edge, start)))
                    for name, edge in edges.items()})


def test_a_bucket_edge_beyond_the_process_age_is_no_measurement():
    """le="1e300" holding the reuse-gap p99: the p99 reads as the process' age (plus the clock slack), the
    recommendation stays finite, and both servers' figures are known (the snapshot raised OverflowError)."""
    now = time.time()
    model = Model(_config(), wall_clock=lambda: now)
    start = now - PROCESS_AGE_SECONDS
    for t in range(1, 8):
        model.ingest(_tick(float(t), start, {"bad": "1e300", "good": "20.0"}))
        snap = model.snapshot()
    bad, good = snap.servers
    assert bad.status.state == "ok" and good.status.state == "ok"
    p99 = bad.windows[0].kv_reuse_gap_seconds["p99"]
    assert PROCESS_AGE_SECONDS <= p99 <= PROCESS_AGE_SECONDS + 10, p99
    assert bad.buffer.residency_target_seconds == p99
    assert math.isfinite(bad.buffer.recommended_bytes)
    assert bad.buffer.recommended_bytes <= WRITE_BYTES_PER_SECOND * (PROCESS_AGE_SECONDS + 10) * 1.5 * 1.01
    assert good.windows[0].kv_reuse_gap_seconds["p99"] == 20.0  # an edge within the age is kept as it is


def test_one_servers_failing_derivation_degrades_that_server_only(caplog):
    """Any exception in one server's derivation (here a bug in its window figures): that server's figures are
    unknown with the reason, served (/api/status, /metrics), logged once; the other server, as_of and /healthz
    go on."""
    now = time.time()
    cfg = _config()
    daemon = Daemon(cfg, sampler=object(), model=Model(cfg, wall_clock=lambda: now))
    sm = daemon.model.servers["bad"]

    def broken(*args, **kwargs):
        raise OverflowError("cannot convert float infinity to integer")
    sm.window = broken
    with caplog.at_level(logging.INFO, logger="kvwatt"):
        for t in range(1, 6):
            daemon.last_tick_t = None
            snap = daemon.step(_tick(float(t), now - 100, {"bad": "20.0", "good": "20.0"}))
            assert snap.t == float(t)  # as_of moves every tick
    bad, good = snap.servers
    assert bad.status.state == "degraded" and bad.status.code == "derivation_failed"
    assert "OverflowError" in bad.status.reason and bad.windows == () and bad.buffer is None
    assert good.status.state == "ok" and good.buffer is not None and good.buffer.recommended_bytes > 0
    warnings = [r for r in caplog.records if "cannot convert float infinity" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once, not per tick
    daemon.last_tick_t = time.monotonic()
    assert daemon.healthy()
    st = status_json(snap)
    (bad_js,) = [s for s in st["servers"] if s["server"] == "bad"]
    assert bad_js["reason_code"] == "derivation_failed" and "OverflowError" in bad_js["reason"]
    text = exposition(BoundsCheck(catalog.METRICS).apply(snap), cfg.metrics_opt_in).text.decode()
    assert 'kvwatt_offload_recommended_buffer_bytes{server="good"}' in text
    assert "derivation_failed" in render(st)  # the page says why, beside the other server's figures
    # the derivation works again: the server's figures come back, and that is logged once too
    del sm.window
    with caplog.at_level(logging.INFO, logger="kvwatt"):
        snap = daemon.step(_tick(6.0, now - 100, {"bad": "20.0", "good": "20.0"}))
    assert snap.servers[0].status.state == "ok" and snap.servers[0].windows
    assert any("succeeds again" in r.getMessage() for r in caplog.records)


def test_kvwatt_run_keeps_ticking_beside_a_server_with_a_1e300_bucket():
    """The issue's reproduction through a real `kvwatt run`: /healthz stays 200 and both servers are served."""
    t0, start = time.monotonic(), time.time() - PROCESS_AGE_SECONDS

    def body(edge):
        return lambda: exposition_at(time.monotonic() - t0 + 1.0, edge, start)
    with MetricsServer(body("1e300")) as bad, MetricsServer(body("20.0")) as good, \
            KvwattDaemon(servers={"bad": bad.url, "good": good.url}, config={"windows": ["5s"], "nvml": False}) as d:
        d.wait_for(lambda d: d.value("kvwatt_offload_recommended_buffer_bytes", server="bad") is not None
                   and d.value("kvwatt_offload_recommended_buffer_bytes", server="good") is not None,
                   timeout=30, what="both servers' recommendations")
        as_of = d.status()["as_of_unix_seconds"]
        time.sleep(2.5)
        assert d.get("/healthz").status_code == 200
        assert d.status()["as_of_unix_seconds"] > as_of  # still ticking
        rec = d.value("kvwatt_offload_recommended_buffer_bytes", server="bad")
        assert math.isfinite(rec) and rec < WRITE_BYTES_PER_SECOND * 1e4
        assert "Traceback" not in d.log() and "tick failed" not in d.log()


def test_one_servers_failing_learning_degrades_that_server_only(caplog):
    """The same for learning (Model.ingest): the energy ledger, the other server and the tick go on."""
    now = time.time()
    model = Model(_config(), wall_clock=lambda: now)

    def broken(*args, **kwargs):
        raise ValueError("math domain error")
    model.servers["bad"].learn = broken
    with caplog.at_level(logging.INFO, logger="kvwatt"):
        for t in range(1, 5):
            model.ingest(_tick(float(t), now - 100, {"bad": "20.0", "good": "20.0"}))
            snap = model.snapshot()
    bad, good = snap.servers
    assert bad.status.code == "derivation_failed" and "ValueError while learning" in bad.status.reason
    assert good.status.state == "ok" and good.buffer is not None
    assert len([r for r in caplog.records if "math domain error" in r.getMessage()]) == 1
