"""The SGLang, TensorRT-LLM, LMCache and Dynamo adapters (exporter/sources/sglang.py, trtllm.py, lmcache.py,
dynamo.py), the merge of add-ons into an engine's reading (sources/combine.py) and sidecar expositions.

None of these engines can run on this CPU-only machine (SGLang's PyPI builds and TensorRT-LLM need CUDA, the
SGLang CPU backend needs Intel AMX, which this AMD EPYC lacks; LMCache's connector and Dynamo's KVBM need CUDA:
tests/data/<engine>/README.md), so their expositions are built from their own metric definitions
(tests/support/engine_expositions.py, sample frames under tests/data/<engine>/) and read here as the real
exporter reads them: through the registry's auto-detection, and over loopback HTTP for the sidecars.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import subprocess
import sys

import aiohttp
import pytest

from exporter.config import ConfigError, from_mapping
from exporter.sources import combine
from exporter.sources.endpoint import EngineSource
from exporter.sources.engine import CAPABILITIES, CAPABILITY_KEYS, COUNTER_KEYS, GAUGE_KEYS, SourceError, adapters
from tests.support.daemon import REPO, parse_exposition
from tests.support.engine_expositions import (
    BLOCK_TOKENS,
    ENGINES,
    HOST_TOKENS,
    KINDS,
    KV_BYTES_PER_TOKEN,
    LOADS,
    STALL_AT,
    Sequence,
)
from tests.support.loopback import MetricsServer

DATA = REPO / "tests" / "data"
LOADS_HIGH = LOADS["high-pressure"]


def joined(texts: dict[str, str]) -> str:
    """The server's exposition and its sidecar's, as EngineSource hands them to the adapters."""
    return "\n".join(t.rstrip("\n") for t in texts.values()) + "\n"


def read(engine: str, kind: str, t: float):
    seq = Sequence(engine, kind)
    return combine.read_exposition(joined(seq.texts(t))), seq.state(t)


# --- the registry and the vocabulary ----------------------------------------------------------------------
def test_every_engine_is_registered_and_detected():
    assert [a.name for a in adapters()][:5] == ["vllm", "sglang", "trtllm", "lmcache", "dynamo"]
    expected = {"sglang": "sglang", "trtllm": "trtllm", "lmcache": "vllm+lmcache", "dynamo": "vllm+dynamo"}
    for engine in ENGINES:
        r, _ = read(engine, "normal", 5.0)
        assert r.engine == expected[engine]
    sidecar_only = Sequence("lmcache", "normal").texts(5.0)["sidecar"]  # LMCache's port as the only URL
    primary, addons = combine.pick(sidecar_only)
    assert primary is None and [a.name for a in addons] == ["lmcache"]
    assert combine.read_exposition(sidecar_only).engine == "lmcache"


def test_the_vocabulary_is_consistent():
    assert set(CAPABILITY_KEYS) <= CAPABILITIES
    for keys in CAPABILITY_KEYS.values():
        assert set(keys) <= set(COUNTER_KEYS) | set(GAUGE_KEYS)
    for adapter in adapters()[1:5]:
        assert set(adapter.spec.counters) <= set(COUNTER_KEYS), adapter.name
        assert set(adapter.spec.gauges) | set(adapter.spec.fractions) <= set(GAUGE_KEYS), adapter.name


# --- what each engine's series become -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_sglang(kind):
    r, s = read("sglang", kind, 30.0)
    c, g = r.counters, r.gauges
    # tp_rank 1 repeats rank 0's scheduler figures: counted once
    assert c["preemptions"] == s["preemptions"] and c["engine_steps"] == s["steps"]
    assert c["prompt_local_compute"] == s["compute"] and c["prompt_local_cache_hit"] == s["cached"]
    assert c["prompt_cached_host"] == s["cached_host"] and c["prompt_cached_device"] == s["cached_device"]
    assert c["offload_store_tokens"] == s["store"] and c["offload_load_tokens"] == s["load"]
    assert g["kv_usage"] == s["kv_usage"] and g["waiting"] == s["waiting"] and g["running"] == s["running"]
    assert g["offload_buffer_used_ratio"] == round(s["occupancy"] * HOST_TOKENS) / HOST_TOKENS
    assert g["offload_buffer_tokens"] == HOST_TOKENS  # the host pool: residency in tokens
    assert r.capabilities == {"kv_usage", "preemptions", "token_sources", "cached_by_tier", "engine_steps",
                              "offload_tokens", "offload_occupancy", "offload_buffer", "requests"}
    assert r.info.offload_enabled and r.info.offload_backend == "hicache" and r.info.block_size == 64
    assert set(r.engine_counters) == {""} and r.engine_counters[""] == c


def test_sglang_underscore_spelling_and_storage_tiers():
    text = Sequence("sglang", "normal").texts(10.0)[""]
    colon = combine.read_exposition(text)
    underscore = combine.read_exposition(text.replace("sglang:", "sglang_"))
    assert underscore == colon
    storage = text + ('sglang:cached_tokens_total{cache_source="storage_file",model_name="m"} 30.0\n'
                      'sglang:cached_tokens_total{cache_source="storage_mooncake",model_name="m"} 12.0\n')
    r = combine.read_exposition(storage)
    assert r.counters["prompt_cached_disk"] == 30.0 and r.counters["prompt_cached_external"] == 12.0


def test_sglang_before_realtime_tokens_takes_shares_from_cached_tokens():
    seq = Sequence("sglang", "normal")
    old = "".join(ln + "\n" for ln in seq.texts(10.0)[""].splitlines() if "realtime_tokens" not in ln)
    r, s = combine.read_exposition(old), seq.state(10.0)
    assert r.counters["prompt_local_cache_hit"] == pytest.approx(s["cached"])
    assert r.counters["prompt_local_compute"] == pytest.approx(s["compute"])
    assert "token_sources" in r.capabilities


def test_sglang_data_parallel_ranks():
    text = "".join(f'sglang:{name}{{dp_rank="{r}",tp_rank="{tp}"}} {v}\n'
                   for r, used, usage in ((0, 10, 0.3), (1, 30, 0.8))
                   for tp in (0, 1) for name, v in (("hicache_host_used_tokens", used),
                                                    ("hicache_host_total_tokens", 100), ("token_usage", usage),
                                                    ("num_retracted_requests_total", used // 10)))
    r = combine.read_exposition(text)
    assert r.gauges["offload_buffer_used_ratio"] == 0.2  # 40 of 200 host tokens, tp_rank 1 not counted again
    assert r.gauges["kv_usage"] == 0.8  # the fullest rank
    assert r.counters["preemptions"] == 4 and r.engine_counters == {"0": {"preemptions": 1}, "1": {"preemptions": 3}}


def test_sglang_without_hicache_says_offloading_is_off():
    text = "".join(line + "\n" for line in Sequence("sglang", "normal").texts(10.0)[""].splitlines()
                   if "hicache" not in line and "evicted" not in line and "load_back" not in line)
    r = combine.read_exposition(text)
    assert r.info.offload_enabled is False and "offload_occupancy" not in r.capabilities


@pytest.mark.parametrize("kind", KINDS)
def test_trtllm(kind):
    r, s = read("trtllm", kind, 30.0)
    c, g = r.counters, r.gauges
    assert c["prompt_local_compute"] == s["compute"] and c["prompt_local_cache_hit"] == s["cached"]
    assert c["offload_store_bytes"] == s["store"] * KV_BYTES_PER_TOKEN
    assert c["offload_load_bytes"] == s["load"] * KV_BYTES_PER_TOKEN
    assert c["prefix_hits"] == (s["cached"] // 32) * 32
    assert g["kv_usage"] == s["kv_usage"] and g["offload_buffer_used_ratio"] == s["occupancy"]
    assert r.capabilities == {"kv_usage", "token_sources", "prefix_cache", "offload_traffic", "offload_occupancy",
                              "requests"}  # no preemption counter, no step counter in TensorRT-LLM
    assert "preemptions" not in c and "engine_steps" not in c
    assert r.info.block_size == 32 and r.info.num_gpu_blocks == 31_250


def test_trtllm_colon_spelling_and_no_host_tier():
    text = Sequence("trtllm", "normal").texts(10.0)[""]
    assert combine.read_exposition(text.replace("trtllm_", "trtllm:")) == combine.read_exposition(text)
    no_host = text.replace("trtllm_kv_cache_host_max_blocks{model_name", "trtllm_other{model_name")
    no_host = "\n".join(ln for ln in no_host.splitlines() if "offload_bytes" not in ln and "onboard_bytes" not in ln)
    r = combine.read_exposition(no_host + "\n")
    assert "offload_buffer_used_ratio" not in r.gauges  # a 0 % utilization of a tier that is not there


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_with_lmcache(kind):
    r, s = read("lmcache", kind, 30.0)
    c, g = r.counters, r.gauges
    # vLLM's own series win; LMCache adds what vLLM does not have (worker 0's tokens, every worker's bytes)
    assert c["prompt_external_kv_transfer"] == s["cached_host"] and c["generation_tokens"] == s["generation"]
    assert c["offload_store_tokens"] == s["store"] and c["offload_load_tokens"] == s["load"]
    assert c["external_prefix_hits"] == s["load"]
    assert g["offload_buffer_used_bytes"] == 2 * (s["occupancy"] * HOST_TOKENS * KV_BYTES_PER_TOKEN / 2)
    assert "offload_buffer_used_ratio" not in g  # LMCache exports no capacity
    assert r.info.offload_enabled and r.info.offload_backend == "lmcache"
    assert r.engine_counters["lmcache:"] == {k: c[k] for k in ("offload_store_tokens", "offload_load_tokens",
                                                                "external_prefix_queries", "external_prefix_hits",
                                                                "offload_stores_skipped")}
    assert {"offload_used_bytes", "offload_tokens", "offload_failures"} <= r.capabilities
    assert "offload_occupancy" not in r.capabilities


@pytest.mark.parametrize("kind", KINDS)
def test_dynamo_worker_with_kvbm(kind):
    r, s = read("dynamo", kind, 30.0)
    c, g = r.counters, r.gauges
    assert c["offload_store_tokens"] == (s["store"] // BLOCK_TOKENS) * BLOCK_TOKENS  # KVBM blocks x vLLM's size
    assert c["offload_load_tokens"] == s["load"]  # matched tokens, not blocks
    assert g["offload_host_hit_ratio"] == s["host_hit"] and g["offload_disk_hit_ratio"] == s["host_hit"] / 4
    assert r.info.offload_backend == "kvbm"
    assert {"offload_hit_rate", "offload_tokens"} <= r.capabilities
    assert not {"offload_occupancy", "offload_used_bytes", "offload_traffic"} & r.capabilities


def set_value(text: str, family: str, value: str, first_only: bool = True) -> str:
    """``text`` with the value of ``family``'s first sample (or every one) replaced."""
    pattern = re.compile(rf"^({re.escape(family)}(?:{{[^}}]*}})?) \S+$", re.M)
    out, n = pattern.subn(rf"\g<1> {value}", text, count=1 if first_only else 0)
    assert n, family
    return out


def test_the_engine_wins_over_an_addon_saying_the_same():
    worker = Sequence("dynamo", "normal").texts(10.0)[""]
    lower = set_value(worker, "dynamo_component_kvstats_gpu_cache_usage_percent", "0.01")
    assert combine.pick(lower)[0].name == "vllm"
    r = combine.read_exposition(lower)
    assert r.gauges["kv_usage"] == Sequence("dynamo", "normal").state(10.0)["kv_usage"]  # vLLM's, not 0.01
    kvstats = "\n".join(ln for ln in lower.splitlines() if not ln.startswith("vllm:kv_cache_usage_perc")) + "\n"
    assert combine.read_exposition(kvstats).gauges["kv_usage"] == 0.01  # without vLLM's gauge: Dynamo's
    alone = combine.read_exposition("dynamo_component_kvstats_gpu_cache_usage_percent{dp_rank=\"0\"} 0.25\n"
                                    "dynamo_component_kvstats_gpu_cache_usage_percent{dp_rank=\"1\"} 0.75\n")
    assert alone.engine == "dynamo" and alone.gauges == {"kv_usage": 0.75,  # the fullest data-parallel rank
                                                         "kv_pool_usage@0": 0.25, "kv_pool_usage@1": 0.75}


@pytest.mark.parametrize("engine", ENGINES)
def test_stalled_counters_freeze_while_requests_wait(engine):
    before, s1 = read(engine, "stalled", STALL_AT + 2)
    after, s2 = read(engine, "stalled", STALL_AT + 12)
    assert after.counters == before.counters  # nothing moves: no step, no token
    assert after.gauges["waiting"] > before.gauges["waiting"] > 0 and after.gauges["running"] > 0
    going, _ = read(engine, "high-pressure", STALL_AT + 12)
    assert going.counters["generation_tokens"] > after.counters["generation_tokens"]


FIRST_USE = """
import threading
from exporter.sources.combine import read_exposition
texts = [open(p).read() for p in %r]
barrier, errors = threading.Barrier(len(texts)), []
def go(text):
    barrier.wait()
    try:
        read_exposition(text)
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=go, args=(t,)) for t in texts]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
"""


def test_the_first_reads_in_several_threads_all_find_the_adapters():
    """A fresh daemon decodes its servers' first expositions in worker threads at once: none may see the
    registry before the built-in adapters are in it (it used to raise IndexError for some servers)."""
    frames = [str(p) for p in sorted(DATA.glob("*/high-pressure/005.prom"))] * 4
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", FIRST_USE % frames], capture_output=True, text=True, cwd=REPO,
                           timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_a_sidecar_gap_re_bases_the_addon_counters_instead_of_a_catch_up():
    """The add-on's counters are tracked under their own rank ids: when its sidecar misses reads, the engine's
    counters go on, and the add-on's first reading back adds nothing (no jump of everything stored meanwhile)."""
    from exporter.store import ServerHistory

    seq = Sequence("lmcache", "high-pressure")
    history = ServerHistory(3600.0, name="s")
    deltas = {}
    for t in range(1, 11):
        texts = seq.texts(float(t))
        text = texts[""] if 4 <= t <= 6 else joined(texts)  # the sidecar down at t = 4, 5, 6
        interval = history.add_reading(float(t), combine.read_exposition(text))
        if interval is not None:
            deltas[t] = interval.deltas
    per_second = LOADS_HIGH.store_tps
    assert deltas[3]["offload_store_tokens"] == pytest.approx(per_second)
    assert all("offload_store_tokens" not in deltas[t] for t in (4, 5, 6, 7))  # gone, then re-based on return
    assert deltas[8]["offload_store_tokens"] == pytest.approx(per_second)
    assert all(deltas[t]["generation_tokens"] == pytest.approx(LOADS_HIGH.generation_tps) for t in range(2, 11))


# --- values out of range ----------------------------------------------------------------------------------
def test_out_of_range_values_make_their_key_unknown():
    text = Sequence("sglang", "normal").texts(10.0)[""]
    r = combine.read_exposition(set_value(text, "sglang:token_usage", "1.5"))
    assert "kv_usage" not in r.gauges and "kv_usage" in r.rejected and "kv_usage" in r.capabilities
    neg = combine.read_exposition(set_value(text, "sglang:num_retracted_requests_total", "-4"))
    assert "preemptions" not in neg.counters and "preemptions" in neg.rejected
    assert neg.counters["engine_steps"] > 0  # the other families stay
    nan = combine.read_exposition(set_value(Sequence("trtllm", "normal").texts(10.0)[""], "trtllm_kv_cache_utilization",
                                            "NaN"))
    assert "kv_usage" in nan.rejected and "kv_usage" not in nan.gauges
    # a replica's value is not read, so it cannot be refused either
    nine = text.replace('tp_rank="1",pp_rank="0",moe_ep_rank="0"} 0.', 'tp_rank="1",pp_rank="0",moe_ep_rank="0"} 9.')
    assert nine != text
    replica = combine.read_exposition(nine)
    assert replica.gauges["kv_usage"] < 1 and not replica.rejected


BAD_VALUES = ["-1", "1.7", "1e308", "1e400", "NaN", "+Inf", "-Inf", "", "abc", "0x10", "1 2 3", "-0", "5e-324"]


@pytest.mark.parametrize("seed", range(200))
def test_random_bad_values_never_give_a_value_out_of_range(seed):
    """Any sample of any engine's families set to a bad value: the reading holds only finite counters in
    [0, 1e30] and fractions in [0, 1] (the family refused, or the line skipped), or the read says parse_error."""
    rng = random.Random(seed)
    engine, kind = rng.choice(ENGINES), rng.choice(KINDS)
    lines = joined(Sequence(engine, kind).texts(rng.uniform(1, 40))).split("\n")
    samples = [i for i, ln in enumerate(lines) if ln and not ln.startswith("#")]
    for i in rng.sample(samples, rng.choice([1, 2, 5])):
        lines[i] = lines[i].rsplit(" ", 1)[0] + " " + rng.choice(BAD_VALUES)
    try:
        r = combine.read_exposition("\n".join(lines), [])
    except SourceError as e:
        assert e.reason == "parse_error"
        return
    for key, v in {**r.counters, **r.gauges}.items():
        assert math.isfinite(v) and 0.0 <= v <= 1e30, (key, v)
    for key in ("kv_usage", "offload_buffer_used_ratio", "offload_host_hit_ratio", "offload_disk_hit_ratio"):
        assert 0.0 <= r.gauges.get(key, 0.0) <= 1.0, (key, r.gauges[key])
    for values in r.engine_counters.values():
        assert all(math.isfinite(v) and 0.0 <= v <= 1e30 for v in values.values()), values


def test_an_addon_with_only_malformed_lines_degrades_the_read():
    text = Sequence("lmcache", "normal").texts(10.0)[""] + "lmcache:num_hit_tokens_total{worker_id=0 12\n"
    problems: list[str] = []
    r = combine.read_exposition(text, problems)
    assert r.engine == "vllm" and problems and problems[0].startswith("parse_error")
    with pytest.raises(SourceError):
        combine.read_exposition("lmcache:num_hit_tokens_total{worker_id=0 12\n")


# --- the sample frames are the generator's and well formed --------------------------------------------------
def test_committed_frames_are_current_and_parse():
    r = subprocess.run([sys.executable, str(DATA / "engines" / "generate.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    frames = sorted(DATA.glob("*/*/*.prom"))
    assert len([f for f in frames if f.parts[-3] in ENGINES]) == len(ENGINES) * len(KINDS) * 2 + 2 * len(KINDS) * 2
    for path in frames:
        if path.parts[-3] in ENGINES:
            assert parse_exposition(path.read_text()), path  # prometheus_client's own parser: no duplicate
    for engine in ENGINES:
        assert (DATA / engine / "README.md").read_text().count("commit") >= 1


# --- sidecars over loopback ---------------------------------------------------------------------------------
def _read(src: EngineSource):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await src.read(session)
    return asyncio.run(go())


def test_a_sidecar_is_fetched_and_merged_and_its_failure_only_degrades():
    texts = Sequence("lmcache", "high-pressure").texts(20.0)
    sidecar_up = [True]
    with MetricsServer(lambda: texts[""]) as main, \
            MetricsServer(lambda: texts["sidecar"] if sidecar_up[0] else None) as side:
        src = EngineSource("s", main.url, 2.0, 1 << 20, sidecar_urls=(side.url,))
        status, reading = _read(src)
        assert status.state == "ok" and reading.engine == "vllm+lmcache"
        assert reading.gauges["offload_buffer_used_bytes"] > 0
        sidecar_up[0] = False
        status, reading = _read(src)
        assert status.up and status.state == "degraded" and status.code == "sidecar"
        assert side.url in status.reason and "http_503" in status.reason
        assert reading.engine == "vllm" and "offload_buffer_used_bytes" not in reading.gauges
    status, reading = _read(src)  # both gone: the server is down, whatever the sidecar says
    assert not status.up and reading is None and status.code == "unreachable"


def test_a_sidecar_url_credentials_go_as_basic_auth():
    texts = Sequence("dynamo", "normal").texts(8.0)
    with MetricsServer(lambda: texts[""]) as main, \
            MetricsServer(lambda: texts["sidecar"], basic_auth=("kv", "s3cret")) as side:
        authed = side.url.replace("://", "://kv:s3cret@")
        status, reading = _read(EngineSource("s", main.url, 2.0, 1 << 20, sidecar_urls=(authed,)))
        assert status.state == "ok" and reading.engine == "vllm+dynamo" and side.unauthorized == 0
        status, _ = _read(EngineSource("s", main.url, 2.0, 1 << 20, sidecar_urls=(side.url,)))
        assert status.code == "sidecar" and "http_401" in status.reason and "s3cret" not in status.reason


def test_check_config_shows_sidecars_with_passwords_masked(tmp_path):
    path = tmp_path / "kvwatt.yaml"
    path.write_text("servers: [{name: a, url: 'http://h:8000', sidecar_urls: ['http://u:secret@h:9000']}]\n")
    r = subprocess.run([sys.executable, "-m", "exporter", "check-config", str(path)], capture_output=True,
                       text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and "servers: a=http://h:8000+http://u:xxxxx@h:9000;" in r.stdout, r.stdout + r.stderr
    assert "secret" not in r.stdout + r.stderr


def test_sidecar_urls_are_validated():
    cfg = from_mapping({"servers": [{"name": "a", "url": "http://h:8000", "sidecar_urls": ["http://h:9000/"]}]})
    assert cfg.servers[0].sidecar_urls == ("http://h:9000",)
    for bad, says in ((["ftp://h:1"], "sidecar_urls[0]"), ("http://h:9000", "expected a list"), ([], "1 to 4"),
                      (["http://h:1"] * 5, "1 to 4")):
        with pytest.raises(ConfigError) as e:
            from_mapping({"servers": [{"name": "a", "url": "http://h:8000", "sidecar_urls": bad}]})
        assert says in str(e.value) and "servers[0].sidecar_urls" in str(e.value)
