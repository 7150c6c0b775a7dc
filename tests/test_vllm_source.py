"""The vLLM source: extraction from real and constructed expositions, and HTTP failure modes."""

import asyncio
import socket
import threading

import aiohttp
import pytest
from aiohttp import web

from exporter.sources.endpoint import EngineSource
from exporter.sources.expfmt import parse
from exporter.sources.vllm import GIB, extract
from tests.conftest import FIXTURES


def reading_of(text):
    return extract(parse(text))


def test_real_low_pressure_exposition():
    r = reading_of((FIXTURES / "low-pressure" / "005.prom").read_text())
    assert r.counters["prompt_local_compute"] == 8280
    assert r.counters["prompt_local_cache_hit"] == 30720
    assert r.counters["prompt_external_kv_transfer"] == 0
    assert r.counters["generation_tokens"] == 12000
    assert r.counters["preemptions"] == 0
    assert r.gauges["running"] == 0 and r.gauges["kv_usage"] == 0
    assert r.info.model_name == "tiny"
    assert r.info.offload_enabled is False and r.info.offload_buffer_bytes is None
    assert r.info.has_token_sources and r.info.has_mfu
    assert r.info.num_gpu_blocks == 2000


def test_engines_are_summed_and_kv_usage_takes_the_fullest_engine():
    text = "\n".join([
        'vllm:generation_tokens_total{engine="0",model_name="m"} 10',
        'vllm:generation_tokens_total{model_name="m",engine="1"} 32',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.97',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 3',
    ])
    r = reading_of(text)
    assert r.counters["generation_tokens"] == 42
    assert r.gauges["kv_usage"] == 0.97
    assert r.gauges["waiting"] == 5


def test_old_names_are_renamed_and_new_names_win():
    old = reading_of('vllm:gpu_cache_usage_perc{model_name="m"} 0.4\nvllm:num_preemptions_total{model_name="m"} 3')
    assert old.gauges["kv_usage"] == 0.4 and old.counters["preemptions"] == 3
    both = reading_of('vllm:gpu_cache_usage_perc{model_name="m"} 0.4\nvllm:kv_cache_usage_perc{model_name="m"} 0.6')
    assert both.gauges["kv_usage"] == 0.6


def test_nan_counter_values_are_not_summed_the_family_is_unknown():
    r = reading_of('vllm:generation_tokens_total{engine="0"} NaN\nvllm:generation_tokens_total{engine="1"} 5')
    assert "generation_tokens" not in r.counters and "generation_tokens" in r.rejected


def test_offload_detected_from_cache_config_info_and_both_store_spellings():
    base = ('vllm:cache_config_info{engine="0",kv_offloading_backend="native",kv_offloading_size="64",'
            'num_gpu_blocks="100"} 1\n')
    deprecated = base + 'vllm:kv_offload_total_bytes_total{engine="0",transfer_type="GPU_to_CPU"} 1000\n' \
                        'vllm:kv_offload_total_bytes_total{engine="0",transfer_type="CPU_to_GPU"} 400\n'
    r = reading_of(deprecated)
    assert r.info.offload_enabled is True and r.info.offload_buffer_bytes == 64 * GIB
    assert r.info.offload_backend == "native"
    assert r.counters["offload_store_bytes"] == 1000 and r.counters["offload_load_bytes"] == 400
    flat = deprecated + 'vllm:kv_offload_store_bytes_total{engine="0"} 1500\n'
    assert reading_of(flat).counters["offload_store_bytes"] == 1500  # the flat 0.24+ series wins


def test_offload_off_reads_native_backend_as_off():
    r = reading_of('vllm:cache_config_info{engine="0",kv_offloading_backend="native",kv_offloading_size="None"} 1')
    assert r.info.offload_enabled is False and r.info.offload_backend == "none"


def test_kv_offload_config_info_gives_the_buffer_in_bytes():
    r = reading_of('vllm:kv_offload_config_info{engine="0",cpu_kv_cache_size_bytes="8589934592"} 1')
    assert r.info.offload_enabled is True and r.info.offload_buffer_bytes == 8 * GIB


def test_without_cache_config_offload_is_unknown_not_off():
    assert reading_of('vllm:generation_tokens_total 1').info.offload_enabled is None


# --- HTTP failure modes, over real loopback sockets ------------------------------------------------------

def _serve(handler):
    """Run an aiohttp app on a free loopback port in a thread; returns (url, stop)."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()

    def stop():
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
    return f"http://127.0.0.1:{port}", stop


def _read(url, timeout=0.5, max_body=1_000_000):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await EngineSource("s", url, timeout, max_body).read(s)
    return asyncio.run(go())


@pytest.mark.parametrize("case,reason", [("slow", "timeout"), ("500", "http_500"), ("big", "body_too_large"),
                                         ("empty", "parse_error")])
def test_failures_become_reasons(case, reason):
    async def handler(_req):
        if case == "slow":
            await asyncio.sleep(3)
        if case == "500":
            return web.Response(status=500)
        if case == "big":
            return web.Response(text="vllm:x 1\n" * 200_000)
        return web.Response(text="# nothing here\n")
    url, stop = _serve(handler)
    try:
        status, reading = _read(url)
    finally:
        stop()
    assert reading is None and status.up is False and status.code == reason and status.reason.startswith(reason)


def test_a_server_that_accepts_but_never_answers_times_out():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    try:
        status, reading = _read(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=0.3)
    finally:
        sock.close()
    assert reading is None and status.code == "timeout"


def test_refused_connection_is_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status, reading = _read(f"http://127.0.0.1:{port}")
    assert reading is None and status.code == "unreachable"


def test_bad_lines_make_the_read_degraded_not_down():
    async def handler(_req):
        return web.Response(text='vllm:generation_tokens_total{engine="0"} 12\n'
                                 'vllm:prompt_tokens_total{engine="0" 3\n')
    url, stop = _serve(handler)
    try:
        status, reading = _read(url)
    finally:
        stop()
    assert status.up and status.state == "degraded" and status.reason == "parse_error: 1 bad lines skipped"
    assert reading.counters == {"generation_tokens": 12.0} and reading.engine == "vllm"


# --- out-of-range values (hardening issue item 6): refused per family, a fixed reason, logged once ---------
REAL = (FIXTURES / "low-pressure" / "004.prom").read_text()
GEN = 'vllm:generation_tokens_total{engine="0",model_name="tiny"} '
LOCAL = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} '
KV = 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} '
CACHE_CONFIG = next(ln for ln in REAL.split("\n") if ln.startswith("vllm:cache_config_info{"))


def _with_value(text: str, prefix: str, value: str) -> str:
    (line,) = [ln for ln in text.split("\n") if ln.startswith(prefix)]
    return text.replace(line, prefix + value)


def _dp_gen(a: str, b: str) -> str:
    """The real exposition with a second engine's generation-token counter (data-parallel)."""
    second = GEN.replace('engine="0"', 'engine="1"')
    return _with_value(REAL, GEN, a).replace(GEN + a, f"{GEN}{a}\n{second}{b}")


@pytest.mark.parametrize("text,family", [
    (_with_value(REAL, GEN, "-5"), "generation_tokens"),
    (_with_value(REAL, GEN, "NaN"), "generation_tokens"),
    (_with_value(REAL, 'vllm:num_preemptions_total{engine="0",model_name="tiny"} ', "-1"), "preemptions"),
    (_with_value(REAL, LOCAL, "+Inf"), "prompt_local_compute"),
    (_with_value(REAL, LOCAL, "1e400"), "prompt_local_compute"),  # overflows to inf when parsed
    (_with_value(REAL, 'vllm:num_requests_running{engine="0",model_name="tiny"} ', "-2"), "running"),
    (_with_value(REAL, KV, "1.7"), "kv_usage"),
    (_with_value(REAL, KV, "-0.5"), "kv_usage"),
    (_dp_gen("1e308", "1e308"), "generation_tokens"),  # summed: +Inf from finite values
    (_dp_gen("6e29", "6e29"), "generation_tokens"),  # each in range, the sum above MAX_VALUE
    (REAL.replace(CACHE_CONFIG, CACHE_CONFIG.replace('block_size="32"', 'block_size="-32"')), "block_size"),
    (REAL.replace(CACHE_CONFIG, CACHE_CONFIG.replace('num_gpu_blocks="2000"', 'num_gpu_blocks="-inf"')),
     "num_gpu_blocks"),
    (REAL.replace(CACHE_CONFIG, CACHE_CONFIG.replace('kv_offloading_size="None"', 'kv_offloading_size="inf"')),
     "offload_buffer_bytes"),
    (REAL + '\nvllm:kv_offload_config_info{engine="0",cpu_kv_cache_size_bytes="-8589934592"} 1.0\n',
     "offload_buffer_bytes"),
    # absurd sizes (issue 38) were taken: a residency of 5e20 s, "not undersized"; now outside [4 KiB, 1 PiB]
    (REAL + '\nvllm:kv_offload_config_info{engine="0",cpu_kv_cache_size_bytes="1e30"} 1.0\n',
     "offload_buffer_bytes"),
    (REAL + '\nvllm:kv_offload_config_info{engine="0",cpu_kv_cache_size_bytes="1e-291"} 1.0\n',
     "offload_buffer_bytes"),
    (REAL.replace(CACHE_CONFIG, CACHE_CONFIG.replace('kv_offloading_size="None"', 'kv_offloading_size="9e20"')),
     "offload_buffer_bytes"),
], ids=lambda x: x if len(x) < 40 else None)
def test_an_out_of_range_value_makes_its_family_unknown_with_a_fixed_reason(text, family, caplog):
    src = EngineSource("s", "http://x", 1.0, 1 << 24)
    good = src.decode(REAL)
    with caplog.at_level("INFO", logger="kvwatt.engine"):
        for _ in range(3):
            problems = []
            r = src.decode(text, problems)
            assert set(r.rejected) == {family}
            assert problems == ["out_of_range"]
            status = src.status(problems, 0.01)
            assert status.up and status.state == "degraded" and status.reason == "out_of_range"
        src.decode(REAL)
    values = {**r.counters, **r.gauges, "block_size": r.info.block_size, "num_gpu_blocks": r.info.num_gpu_blocks,
              "offload_buffer_bytes": r.info.offload_buffer_bytes}
    assert values.get(family) is None  # unknown, not the bad value, not zero
    for key, v in {**good.counters, **good.gauges}.items():  # every other family as read before
        assert key == family or values[key] == v, key
    assert r.capabilities == good.capabilities | ({"offload_buffer"} if family == "offload_buffer_bytes" else set())
    logged = [rec.getMessage() for rec in caplog.records]
    assert len(logged) == 2, logged  # once when refused (with the detail), once when back in range
    assert family in logged[0] and "out of range" in logged[0] and "back in range" in logged[1]
