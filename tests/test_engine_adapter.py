"""The engine seam (exporter/sources/engine.py) and the vLLM adapter's fast path.

The fast path (parse_families over NEEDED_FAMILIES) must give exactly what the general parser + extract
give: on every real exposition, and on randomly built ones full of the malformed lines a server or a proxy
can produce.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from exporter.samples import EngineInfo, EngineReading
from exporter.sources import combine, engine
from exporter.sources.endpoint import EngineSource
from exporter.sources.engine import (
    CAPABILITIES,
    CAPABILITY_KEYS,
    COUNTER_KEYS,
    GAUGE_KEYS,
    EngineAdapter,
    SourceError,
    adapters,
)
from exporter.sources.expfmt import parse, parse_families, process_start_time
from exporter.sources.vllm import COUNTERS, GAUGES_SUM, NEEDED_FAMILIES, VllmAdapter, extract
from exporter.sources.vllm_names import RENAMES
from tests.conftest import FIXTURES

SHARED = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
REAL = sorted(FIXTURES.glob("*/*.prom")) + sorted(SHARED.glob("*/*/*.prom"))
KV_CACHE_METRICS = sorted((FIXTURES.parent / "kv-cache-metrics").glob("*.prom"))  # --kv-cache-metrics captures


def general(text: str) -> EngineReading:
    return extract(parse(text), process_start_time(text))


def _norm(series: dict) -> dict:
    """NaN != NaN: compare with NaN spelled out, keeping family order."""
    return [(name, [(labels, "nan" if math.isnan(v) else v) for labels, v in samples.items()])
            for name, samples in series.items()]


# --- the seam ---------------------------------------------------------------------------------------------
def test_source_error_moved_and_still_importable_from_vllm():
    from exporter.sources.vllm import SourceError as FromVllm
    assert FromVllm is SourceError


def test_registry_has_vllm_first_and_auto_detects():
    assert adapters()[0].name == "vllm" and engine.adapters()[0].name == "vllm"
    assert isinstance(adapters()[0], EngineAdapter)
    text = (FIXTURES / "idle" / "000.prom").read_text()
    assert combine.pick(text)[0].name == "vllm"
    assert combine.pick("tgi_queue_size 1\n") == (None, [])  # nobody claims it: vLLM reads it, and says no
    with pytest.raises(SourceError) as e:
        combine.read_exposition("tgi_queue_size 1\n")
    assert e.value.reason == "parse_error"


def test_a_registered_adapter_is_detected(monkeypatch):
    class Fake:
        name = "fake"

        def detect(self, text):
            return text.startswith("fake:")

        def read(self, text, problems=None):
            return EngineReading(counters={"generation_tokens": 1.0}, gauges={}, info=EngineInfo(),
                                 capabilities=frozenset(), engine="fake")

    monkeypatch.setattr(engine, "_REGISTRY", list(engine._REGISTRY))
    engine.register(Fake())
    assert [a.name for a in adapters()] == ["vllm", "sglang", "trtllm", "lmcache", "dynamo", "fake"]
    assert combine.pick("fake:tokens 3\n")[0].name == "fake"
    assert combine.pick("vllm:generation_tokens_total 3\n")[0].name == "vllm"
    reading = EngineSource("s", "http://x", 1, 1).decode("fake:tokens 3\n")
    assert reading.engine == "fake"


def test_an_adapter_registered_with_an_order_takes_that_place(monkeypatch):
    class Fake:
        name = "fake"

        def detect(self, text):
            return False

        def read(self, text, problems=None):
            raise SourceError("parse_error")

    monkeypatch.setattr(engine, "_REGISTRY", list(engine._REGISTRY))
    engine.register(Fake(), order=engine.TRTLLM_ORDER + 1)  # an engine, tried before the add-ons
    assert [a.name for a in adapters()] == ["vllm", "sglang", "trtllm", "fake", "lmcache", "dynamo"]


def test_the_registry_is_complete_when_only_the_seam_is_imported():
    """The adapters register themselves at import and the package imports them: a fresh interpreter that
    imports nothing but engine.py already sees every built-in adapter, in order."""
    code = "import exporter.sources.engine as e; print(' '.join(a.name for a in e.adapters()))"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env)
    assert out.stdout.split() == ["vllm", "sglang", "trtllm", "lmcache", "dynamo"]


def test_neutral_keys_cover_what_the_vllm_adapter_produces():
    assert set(COUNTERS) <= set(COUNTER_KEYS)
    assert set(GAUGES_SUM) | {"kv_usage"} <= set(GAUGE_KEYS)
    assert set(CAPABILITY_KEYS) <= CAPABILITIES
    for keys in CAPABILITY_KEYS.values():
        assert set(keys) <= set(COUNTER_KEYS) | set(GAUGE_KEYS)


def test_needed_families_cover_every_spelling():
    for base, _ in (*COUNTERS.values(), *GAUGES_SUM.values()):
        assert f"vllm:{base}_total" in NEEDED_FAMILIES and f"vllm:{base}" in NEEDED_FAMILIES
    assert "vllm:gpu_cache_usage_perc" in NEEDED_FAMILIES and "vllm:cache_config_info" in NEEDED_FAMILIES
    assert all(f"vllm:{old}" not in NEEDED_FAMILIES for old, new in RENAMES.items()
               if new == "inter_token_latency_seconds")
    # no histogram buckets (the bulk of an exposition) but the preemptions-per-request ones (8 per engine) and
    # the KV-block residency ones (22 each per engine, only on the wire with --kv-cache-metrics)
    assert {n for n in NEEDED_FAMILIES if n.endswith(("_bucket", "_created"))} == {
        "vllm:request_num_preemptions_bucket", "vllm:kv_block_idle_before_evict_seconds_bucket",
        "vllm:kv_block_reuse_gap_seconds_bucket", "vllm:kv_block_lifetime_seconds_bucket"}


def test_capabilities_follow_the_series_present():
    r = VllmAdapter().read((FIXTURES / "low-pressure" / "005.prom").read_text())
    assert r.engine == "vllm"
    assert r.capabilities == {"kv_usage", "preemptions", "token_sources", "prefix_cache", "mfu", "requests",
                              "engine_steps", "cached_by_tier",  # iteration_tokens_total (0.23+), by source (0.32+)
                              "preemptions_per_request"}  # request_num_preemptions histogram (0.30+)
    assert r.counters["engine_steps"] == 1204 and r.counters["prompt_cached_device"] == 30720
    assert r.info.process_start_time_seconds == pytest.approx(1.79529530976e+09)
    old = VllmAdapter().read('vllm:gpu_cache_usage_perc{model_name="m"} 0.4\n'
                             'vllm:kv_offload_config_info{cpu_kv_cache_size_bytes="1024"} 1\n'
                             'vllm:kv_offload_store_bytes_total 5\n')
    assert old.capabilities == {"kv_usage", "offload_buffer", "offload_traffic"}


# --- the fast path equals the general one -----------------------------------------------------------------
@pytest.mark.parametrize("path", REAL, ids=lambda p: f"{p.parent.parent.parent.name}/{p.parent.name}/{p.name}")
def test_fast_path_equals_general_parser_on_real_expositions(path):
    text = path.read_text()
    fast = parse_families(text, NEEDED_FAMILIES)
    full = parse(text)
    assert _norm(fast.series) == _norm({n: s for n, s in full.series.items() if n in NEEDED_FAMILIES})
    assert fast.errors == 0 and fast.duplicates == full.duplicates == 0
    assert VllmAdapter().read(text) == general(text)


@pytest.mark.parametrize("path", KV_CACHE_METRICS, ids=lambda p: p.name)
def test_fast_path_equals_general_parser_with_kv_block_residency(path):
    text = path.read_text()
    fast = VllmAdapter().read(text)
    assert fast == general(text)
    assert "kv_block_residency" in fast.capabilities
    assert any(k.startswith("kv_idle_before_evict_hist_le@") for k in fast.counters)


def test_there_are_real_expositions():
    assert len(REAL) >= 7


_NEEDED = sorted(NEEDED_FAMILIES)
_OTHER = ["vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket", "vllm:foo",
          "vllm:prompt_tokens_created", "process_cpu_seconds_total", "python_info", "vllm:num_requests",
          "vllm:generation_tokens_totalx", "vllm:kv_cache_usage_perc_max"]
_VALUES = ["1", "0.0", "42.5", "NaN", "+Inf", "-Inf", "1e9", "3 1700000000000", "abc", "", "1 2 3", "  7  ",
           "1_000", "-0", "nan", "7\r", "0x10", "5 ts"]
_LABEL_VALUES = ["0", "tiny", 'x\\"y', "a,b", "}{", "{", "}", "new\\nline", "back\\\\slash", "", "sp ace",
                 "local_compute", "local_cache_hit", "capacity", "GPU_to_CPU", "CPU_to_GPU", "64", "None",
                 "8589934592", 'dangling\\']
_LABEL_NAMES = ["engine", "model_name", "source", "reason", "transfer_type", "kv_offloading_size",
                "cpu_kv_cache_size_bytes", "num_gpu_blocks", "block_size", "kv_offloading_backend", "le", "9bad"]


def _random_labels(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 4)):
        name, value = rng.choice(_LABEL_NAMES), rng.choice(_LABEL_VALUES)
        form = rng.random()
        if form < 0.8:
            parts.append(f'{name}="{value}"')
        elif form < 0.9:
            parts.append(f'{name} = "{value}" ')
        else:
            parts.append(f"{name}={value}")  # unquoted: malformed
    sep = rng.choice([",", ",", ", ", ""])
    body = sep.join(parts) + (rng.choice(["", ",", " "]) if rng.random() < 0.2 else "")
    shape = rng.random()
    if shape < 0.85:
        return "{" + body + "}"
    if shape < 0.92:
        return "{" + body  # no closing brace
    return body + "}"


def _random_line(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.1:
        return rng.choice(["", "# HELP vllm:x y", "# TYPE vllm:generation_tokens counter", "garbage",
                           "}{", "vllm:", "  vllm:generation_tokens_total 1", "\x00\x01"])
    name = rng.choice(_NEEDED) if roll < 0.8 else rng.choice(_OTHER)
    labels = _random_labels(rng) if rng.random() < 0.8 else ""
    gap = rng.choice([" ", " ", " ", "", "  ", "\t"])
    line = f"{name}{labels}{gap}{rng.choice(_VALUES)}"
    if rng.random() < 0.03:
        line = f"{name} 1 {labels}"  # a space before the braces
    return line


@pytest.mark.parametrize("seed", range(300))
def test_fast_path_equals_general_parser_on_random_lines(seed):
    rng = random.Random(seed)
    lines = [_random_line(rng) for _ in range(rng.randint(1, 60))]
    if rng.random() < 0.3:
        lines.append("process_start_time_seconds " + rng.choice(["1.7e9", "x", "", "NaN", "12 34"]))
    rng.shuffle(lines)
    text = "\n".join(lines) + rng.choice(["", "\n"])

    fast = parse_families(text, NEEDED_FAMILIES)
    full = parse(text)
    assert _norm(fast.series) == _norm({n: s for n, s in full.series.items() if n in NEEDED_FAMILIES})
    assert fast.duplicates == parse("\n".join(ln for ln in text.split("\n") if _family_of(ln))).duplicates
    # errors: the lines that start with a needed name (followed by "{", a space, a tab or the line's end) and that
    # the general parser, given that line alone, does not accept
    expected_errors = sum(1 for ln in text.split("\n") if _family_of(ln) and not parse(ln, prefix="").series)
    assert fast.errors == expected_errors

    try:
        reading = VllmAdapter().read(text)
    except SourceError as e:
        assert e.reason == "parse_error" and not fast.series
        return
    ref = general(text)
    assert reading == ref


def _family_of(line: str) -> str | None:
    for name in NEEDED_FAMILIES:
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in "{ \t"):
            return name
    return None


def test_problems_name_the_bad_lines():
    problems: list[str] = []
    r = VllmAdapter().read('vllm:generation_tokens_total 5\nvllm:prompt_tokens_total{a="1" 3\n'
                           "vllm:num_preemptions_total x\nvllm:foo{{{ 1\n", problems)
    assert r.counters == {"generation_tokens": 5.0}
    assert problems == ["parse_error: 2 bad lines skipped"]  # vllm:foo is not read at all


def test_process_start_time():
    assert process_start_time("process_start_time_seconds 12.5\nx 1") == 12.5
    assert process_start_time("a 1\nprocess_start_time_seconds 3e9") == 3e9
    assert process_start_time("a 1\nprocess_start_time_seconds NaN\n") is None
    assert process_start_time("a 1\nxprocess_start_time_seconds 1\n") is None


def test_a_large_exposition_is_fast():
    """50k series: the regex scan, not 50k Python iterations (the general parser takes ~0.2 s)."""
    text = synthetic_exposition(50_000)
    adapter = VllmAdapter()
    r = adapter.read(text)
    assert r == general(text)
    # relative to the general parser on the same text and machine, measured alongside (best of 3 each, so a
    # loaded machine slows both): 0.2 of it measured on 2 cores, an upper bound of half, not a speed target
    adapter_seconds = _best_of(3, lambda: adapter.read(text))
    general_seconds = _best_of(3, lambda: general(text))
    assert adapter_seconds < general_seconds / 2, (adapter_seconds, general_seconds)


def _best_of(n: int, run) -> float:
    took = []
    for _ in range(n):
        start = time.perf_counter()
        run()
        took.append(time.perf_counter() - start)
    return min(took)


def synthetic_exposition(series: int) -> str:
    """A vLLM exposition with ``series`` lines: the real one's families repeated over data-parallel engines."""
    base = [ln for ln in (FIXTURES / "low-pressure" / "005.prom").read_text().split("\n")
            if ln.startswith("vllm:")]
    out = ["process_start_time_seconds 1.7e9"]
    engine_id = 0
    while len(out) < series:
        out += [ln.replace('engine="0"', f'engine="{engine_id}"') for ln in base]
        engine_id += 1
    return "\n".join(out[:series]) + "\n"


# --- EngineSource: decoding off the event loop --------------------------------------------------------------
def test_decode_raises_and_status_is_degraded_on_bad_lines():
    src = EngineSource("s", "http://127.0.0.1:1", 1.0, 1 << 20)
    with pytest.raises(SourceError):
        src.decode("# nothing\n")
    problems: list[str] = []
    src.decode("vllm:generation_tokens_total 1\nvllm:generation_tokens_total{ 2\n", problems)
    status = src.status(problems, 0.01)
    assert status.up and status.state == "degraded" and status.reason == "parse_error: 1 bad lines skipped"


def test_adapter_bug_becomes_parse_error():
    class Broken:
        name = "broken"

        def detect(self, text):
            return True

        def read(self, text, problems=None):
            raise KeyError("oops")

    with pytest.raises(SourceError) as e:
        EngineSource("s", "http://x", 1, 1, adapter=Broken()).decode("vllm:x 1")
    assert e.value.reason == "parse_error"


def test_read_decodes_in_a_worker_thread_and_the_loop_keeps_running():
    threads: list[int] = []

    class Slow:
        name = "vllm"

        def detect(self, text):
            return True

        def read(self, text, problems=None):
            threads.append(threading.get_ident())
            time.sleep(0.3)  # a 50k-series exposition on a slow core
            return VllmAdapter().read(text, problems)

    src = EngineSource("s", "http://x", 1.0, 1 << 20, adapter=Slow())

    async def fetch(_session):
        return "vllm:generation_tokens_total 7\n"

    src.fetch = fetch  # type: ignore[method-assign]

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        status, reading = await src.read(None)
        task.cancel()
        return status, reading, ticks

    status, reading, ticks = asyncio.run(go())
    assert status.up and status.state == "ok" and reading.counters == {"generation_tokens": 7.0}
    assert threads and threads[0] != threading.get_ident()
    assert ticks >= 10  # the loop ran while the exposition was decoded
