"""The engines' current series: each engine's newer exposition, built from its metric definitions at a
cited commit (the section "Series added since the adapter was written" of tests/data/<engine>/README.md), read through
its adapter, the values worked out by hand from the file; one read per engine over loopback HTTP; and ``_created``
samples never taken as a counter's value.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest

from exporter.sources import combine
from exporter.sources.endpoint import EngineSource
from exporter.sources.vllm import VllmAdapter
from tests.support.engine_expositions import ENGINES, KINDS, Sequence
from tests.support.loopback import MetricsServer

DATA = Path(__file__).resolve().parent / "data"


def _text(engine: str, name: str) -> str:
    return (DATA / engine / name).read_text()


def _reading(engine: str, name: str):
    text = _text(engine, name)
    primary, addons = combine.pick(text)  # an add-on's own port: no primary engine, the add-on alone
    adapter = primary if primary is not None else addons[0]
    assert adapter.name == engine
    return adapter.read(text)


# --- SGLang -------------------------------------------------------------------------------------------------
def test_sglang_per_pool_host_occupancy_is_the_kv_pool_where_the_anchor_gauges_are_absent():
    r = _reading("sglang", "current-series.prom")
    # hicache_host_pool_used_tokens{pool="kv"} 300000 / hicache_host_pool_total_tokens{pool="kv"} 400000; the
    # mamba pool (650 / 676 checkpoint slots) is another resource, not the KV buffer
    assert r.gauges["offload_buffer_used_ratio"] == pytest.approx(300000 / 400000)
    assert r.gauges["offload_buffer_tokens"] == 400000
    assert r.info.offload_enabled is True and r.info.offload_backend == "hicache"
    # eviction / load-back accounting: the _total values, not the _created timestamps (1.79e9)
    assert r.counters["offload_store_tokens"] == 1200000 and r.counters["offload_load_tokens"] == 300000
    assert r.counters["preemptions"] == 4
    assert {"offload_occupancy", "offload_buffer", "offload_tokens"} <= r.capabilities


def test_sglang_anchor_gauges_win_over_the_per_pool_series():
    text = _text("sglang", "current-series.prom") + (
        'sglang:hicache_host_used_tokens{model_name="Qwen/Qwen3-8B",tp_rank="0"} 100.0\n'
        'sglang:hicache_host_total_tokens{model_name="Qwen/Qwen3-8B",tp_rank="0"} 1000.0\n')
    r = combine.pick(text)[0].read(text)
    assert r.gauges["offload_buffer_used_ratio"] == pytest.approx(0.1)
    assert r.gauges["offload_buffer_tokens"] == 1000


def test_sglang_016d8605_offload_is_the_kv_pools_backups_and_load_backs_not_every_freed_slot():
    """At 016d8605 ``evicted_tokens`` counts every device slot freed (backed up or destroyed, 2,000,000): the
    D->H traffic is ``hicache_backup_tokens{pool="kv"}`` and the H->D ``load_back_tokens{pool="kv"}``."""
    r = _reading("sglang", "current-series-016d8605.prom")
    assert r.counters["offload_store_tokens"] == 1500000  # not 2,000,000 evicted, not + the mamba pool's 900
    assert r.counters["offload_load_tokens"] == 400000  # not + the mamba pool's 300
    assert r.counters["offload_store_bytes"] == 3.0e10 and r.counters["offload_load_bytes"] == 8.0e9
    # device KV destroyed because the host pool could not take it: the KV pool's, host_pressure
    assert r.counters["offload_stores_dropped_full"] == 500
    assert r.engine_counters[""]["offload_store_tokens"] == 1500000
    assert {"offload_traffic", "offload_failures", "offload_tokens"} <= r.capabilities
    # the device pool: token_usage 0.5 and max_total_num_tokens; kv_*_tokens (40,000 free + 10,000 evictable +
    # 50,000 used) say the same in tokens and are not read
    assert r.gauges["kv_usage"] == 0.5 and r.info.kv_capacity_tokens == 100000
    assert r.gauges["offload_buffer_used_ratio"] == pytest.approx(300000 / 400000)
    assert r.counters["preemptions"] == 4


def test_sglang_radix_cache_evictions_without_hicache_are_no_offload():
    """Without HiCache (no host pool, backup or dropped series) the 016d8605 scheduler still counts the radix
    cache's evictions in evicted_tokens: slots freed, nothing copied to a host tier."""
    text = "\n".join(line for line in _text("sglang", "current-series-016d8605.prom").splitlines()
                     if "hicache" not in line and "load_back" not in line)
    assert "sglang:evicted_tokens_total{" in text and "hicache" not in text
    r = combine.pick(text)[0].read(text)
    assert "offload_store_tokens" not in r.counters and "offload_load_tokens" not in r.counters
    assert r.info.offload_enabled is False and r.info.offload_backend == "none"


def test_sglang_before_016d8605_evicted_tokens_stay_the_store_traffic_and_unlabelled_load_backs_count():
    r = _reading("sglang", "current-series.prom")  # no hicache_dropped / backup series: the older meaning
    assert r.counters["offload_store_tokens"] == 1200000 and r.counters["offload_load_tokens"] == 300000
    assert "offload_store_bytes" not in r.counters and "offload_stores_dropped_full" not in r.counters


# --- TensorRT-LLM -------------------------------------------------------------------------------------------
def test_trtllm_cached_tokens_by_tier_sum_the_levels_of_each_tier():
    r = _reading("trtllm", "current-series.prom")
    # cache_level 0 and 1 are both gpu (600 + 100); level 2 host 250; level 3 disk 50
    assert r.counters["prompt_cached_device"] == 700
    assert r.counters["prompt_cached_host"] == 250
    assert r.counters["prompt_cached_disk"] == 50
    assert "cached_by_tier" in r.capabilities
    # prompt 2000 - cached 1000 computed; disk -> host prefetch blocks are no GPU traffic
    assert r.counters["prompt_local_compute"] == 1000
    assert r.counters["offload_store_bytes"] == 4194304000 and r.counters["offload_load_bytes"] == 1048576000
    assert r.gauges["offload_buffer_used_ratio"] == pytest.approx(0.4)
    assert not any("prefetch" in k for k in r.counters)


# --- Dynamo KVBM --------------------------------------------------------------------------------------------
def test_dynamo_kvbm_v2_disk_to_host_staging_is_not_counted_as_a_load():
    """A guard: KVBM v2's onboard_blocks_d2h (disk -> host staging, 7) is followed by onboard_blocks_h2d for the
    same blocks; counting both would double a disk hit's load."""
    r = _reading("dynamo", "current-series.sidecar.prom")
    assert r.counters["offload_store_blocks"] == 100 + 20  # d2h + d2d; h2d (30) moves host -> disk
    assert r.counters["offload_load_blocks"] == 40 + 6  # h2d + d2d, without the staging step
    assert r.gauges["offload_host_hit_ratio"] == pytest.approx(0.8)
    assert r.gauges["offload_disk_hit_ratio"] == pytest.approx(0.3)


def test_dynamo_kvbm_object_tier_blocks_count_and_its_write_failures_are_skipped_stores():
    r = _reading("dynamo", "current-series-04070c75.sidecar.prom")
    assert r.counters["offload_store_blocks"] == 100 + 20 + 15  # d2h + d2d + d2o; h2d (30) host -> disk
    assert r.counters["offload_load_blocks"] == 40 + 6 + 4  # h2d + d2d + o2d
    assert r.counters["offload_stores_skipped"] == 2  # object writes failed; read failures (1) are no store
    assert "offload_store_bytes" not in r.counters  # the object tier's bytes alone would hide host and disk
    assert "offload_buffer_used_ratio" not in r.gauges  # no host / disk occupancy at 04070c75


# --- LMCache multiprocess mode ------------------------------------------------------------------------------
def test_lmcache_multiprocess_l1_occupancy_and_failed_writes():
    r = _reading("lmcache", "current-series.sidecar.prom")
    assert r.gauges["offload_buffer_used_ratio"] == pytest.approx(0.6)
    assert r.gauges["offload_buffer_used_bytes"] == 6.0e9  # L1 only: l2_usage_bytes (2e10) is another tier
    assert r.counters["offload_stores_skipped"] == 3
    assert {"offload_occupancy", "offload_used_bytes", "offload_failures"} <= r.capabilities


def test_lmcache_multiprocess_lookup_tokens_are_the_external_prefix_cache():
    """lookup_requested / lookup_hit (OTel unit tokens) summed over cache_salt: 8000 + 2000 looked up, 5000 + 1000
    found in L1 + L2; the per-tier split and the in-flight transfer counts are not read."""
    r = _reading("lmcache", "current-series.sidecar.prom")
    assert r.counters["external_prefix_queries"] == 10000
    assert r.counters["external_prefix_hits"] == 6000
    assert not any("l1" in k or "l2" in k or "flight" in k for k in r.counters)


def test_lmcache_multiprocess_merges_into_the_vllm_reading():
    vllm = Sequence("lmcache", "normal").texts(10.0)[""]
    r = combine.read_exposition(vllm + _text("lmcache", "current-series.sidecar.prom"))
    assert r.engine == "vllm+lmcache" and r.gauges["offload_buffer_used_ratio"] == pytest.approx(0.6)


# --- vLLM SimpleCPU offload ----------------------------------------------------------------------------------
def test_vllm_simple_cpu_finished_loads_are_offload_traffic_in_blocks_then_tokens():
    """simple_kv_offload_load_blocks{phase} at 222790a9: completed (12), not issued (15); x block_size 16."""
    r = combine.read_exposition(_text("vllm-0.32-definitions", "simple-cpu-222790a9.prom"))
    assert r.counters["offload_load_blocks"] == 12
    assert r.counters["offload_load_tokens"] == 12 * 16
    assert r.counters["offload_stores_dropped_full"] == 6
    assert r.info.kv_capacity_tokens == 36864  # kv_cache_max_concurrency (4.5) is read-and-not-needed


def test_vllm_simple_cpu_0_32_0_unlabelled_load_blocks_still_count():
    r = VllmAdapter().read(_text("vllm-0.32-definitions", "simple-cpu-001.prom"))
    assert r.counters["offload_load_blocks"] == 12


# --- _created samples ---------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})? \S+$")


def _with_created(text: str, created: float = 1.79e9) -> str:
    """Each counter sample followed by its ``_created`` sample, as prometheus_client writes them (``x_total``
    -> ``x_created``; a counter named without ``_total``, as KVBM's Rust registry writes them, -> ``x_created``)."""
    counters = set(re.findall(r"^# TYPE (\S+) counter$", text, re.M))
    out = []
    for line in text.splitlines():
        out.append(line)
        m = _SAMPLE.match(line)
        if m and (m.group("name") in counters or m.group("name").removesuffix("_total") in counters):
            out.append(f"{m.group('name').removesuffix('_total')}_created{m.group('labels') or ''} {created}")
    return "\n".join(out) + "\n"


def _frames():
    for engine in ENGINES:
        texts = Sequence(engine, KINDS[0]).texts(20.0)
        for part, text in texts.items():
            yield f"{engine}/{part or 'main'}", text


@pytest.mark.parametrize("name,text", list(_frames()))
def test_created_samples_are_never_a_counters_value(name, text):
    plain, created = combine.read_exposition(text), combine.read_exposition(_with_created(text))
    assert "_created" in _with_created(text)
    assert created.counters == plain.counters and created.gauges == plain.gauges, name


def test_created_samples_are_ignored_by_the_vllm_adapter_on_a_real_capture():
    text = (DATA / "vllm-0.32-cpu" / "low-pressure" / "005.prom").read_text()
    assert "_created" in text  # the capture carries them already
    doubled = _with_created(text.replace("_created", "_gone"), 3.0e9)
    a, b = VllmAdapter().read(text), VllmAdapter().read(doubled)
    assert a.counters == b.counters and a.counters["prompt_tokens"] < 1e6


# --- over loopback HTTP -------------------------------------------------------------------------------------
def _read(src: EngineSource):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await src.read(session)
    return asyncio.run(go())


@pytest.mark.parametrize("engine,name,key", [
    ("sglang", "current-series.prom", "offload_buffer_used_ratio"),
    ("sglang", "current-series-016d8605.prom", "offload_stores_dropped_full"),
    ("trtllm", "current-series.prom", "prompt_cached_host"),
])
def test_an_engine_exposition_over_loopback(engine, name, key):
    text = _text(engine, name)
    with MetricsServer(lambda: text) as server:
        status, reading = _read(EngineSource("s", server.url, 2.0, 1 << 20))
    assert status.state == "ok" and reading.engine == engine
    assert key in reading.counters or key in reading.gauges


@pytest.mark.parametrize("addon,key", [("dynamo", "offload_host_hit_ratio"),
                                       ("lmcache", "offload_buffer_used_ratio")])
def test_an_addon_sidecar_over_loopback(addon, key):
    main = Sequence(addon, "normal").texts(10.0)[""]
    side = _text(addon, "current-series.sidecar.prom")
    with MetricsServer(lambda: main) as m, MetricsServer(lambda: side) as s:
        status, reading = _read(EngineSource("s", m.url, 2.0, 1 << 20, sidecar_urls=(s.url,)))
    assert status.state == "ok" and reading.engine == f"vllm+{addon}" and key in reading.gauges


# --- KV capacity in tokens ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,tokens", [("idle", 2097152), ("low-pressure", 64000)])
def test_vllm_kv_capacity_is_cache_config_infos_kv_cache_size_tokens(kind, tokens):
    """The real 0.32 captures: default pool 2,097,152 tokens; --num-gpu-blocks-override 2000 x 32 = 64,000."""
    text = (DATA / "vllm-0.32-cpu" / kind / "000.prom").read_text()
    assert VllmAdapter().read(text).info.kv_capacity_tokens == tokens


def test_vllm_kv_capacity_is_not_blocks_times_block_size():
    """A hybrid model's pool (block_size 544, 556 blocks) holds more tokens than blocks x block size: the stated
    size is taken, never the product."""
    line = ('vllm:cache_config_info{block_size="544",engine="0",kv_cache_size_tokens="5205333",'
            'num_gpu_blocks="556"} 1.0\n')
    assert VllmAdapter().read(line).info.kv_capacity_tokens == 5205333


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "0"])
def test_vllm_kv_capacity_out_of_range_is_refused(value):
    line = f'vllm:cache_config_info{{engine="0",kv_cache_size_tokens="{value}",num_gpu_blocks="10"}} 1.0\n'
    r = VllmAdapter().read(line)
    assert r.info.kv_capacity_tokens is None and "kv_capacity_tokens" in r.rejected


def test_vllm_kv_capacity_none_is_unknown_not_refused():
    r = VllmAdapter().read('vllm:cache_config_info{engine="0",kv_cache_size_tokens="None"} 1.0\n')
    assert r.info.kv_capacity_tokens is None and "kv_capacity_tokens" not in r.rejected


def test_sglang_and_trtllm_kv_capacity():
    assert _reading("sglang", "current-series.prom").info.kv_capacity_tokens == 100000  # max_total_num_tokens
    assert _reading("trtllm", "current-series.prom").info.kv_capacity_tokens == 4096 * 32  # blocks x per block
