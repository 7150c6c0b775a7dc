"""A REAL offloading engine: vLLM's own OffloadingConnector on the CPU engine (the lab's tier,
lab/kvwatt_lab/cpu_offload.py), watched by kvwatt, against an OFF twin with the same KV cache.

ONE start of each engine serves every test here (module fixture ``lab``: an ON engine with a 16 MiB host pool
and an OFF engine, both 130 blocks of 32 tokens, started side by side) and ONE workload run feeds every check:
  1. an evict-and-reload: a 1,500-token prompt, five other prompts that evict it from the device, the same
     prompt again (ON: reloaded from the host tier; OFF: computed again);
  2. preemption: four concurrent 700-token requests generating 600 tokens each, needing 164 blocks of 130
     (ON: preempted requests resume from the host tier; OFF: recomputed).
Every figure is compared with an independent scrape of the engine's own /metrics (parsed with
prometheus_client's parser, not kvwatt's), with the tolerance each test states.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import pytest
import requests

from tests.support.daemon import parse_exposition
from tests.support.engine import VllmEngine, build_tiny_model

pytestmark = pytest.mark.engine
BLOCKS = 130
HOST_POOL_GIB = 1 / 64  # 16 MiB: 1,024 blocks of the tiny model's 16 KiB
LONG, OTHERS, PRESSURE, PRESSURE_PROMPT, PRESSURE_OUTPUT = 1500, 5, 4, 700, 600


def engine_counters(url: str) -> dict[str, float]:
    """The engine's own counters, parsed by prometheus_client (independent of kvwatt), summed over labels
    other than ``source``: ``{"vllm:prompt_tokens_by_source_total{local_compute}": ...}``."""
    out: dict[str, float] = {}
    for (name, labels), v in parse_exposition(requests.get(url + "/metrics", timeout=10).text).items():
        if not name.startswith("vllm:") or name.endswith("_created") or name.endswith("_bucket"):
            continue
        lab = dict(labels)
        key = name + (f"{{{lab['source']}}}" if "source" in lab else "") + (
            f"{{{lab['transfer_type']}}}" if "transfer_type" in lab else "")
        out[key] = out.get(key, 0.0) + v
    return out


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _complete(url: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
            "temperature": 0.0, "return_token_ids": True}
    r = requests.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def workload(url: str) -> dict[str, list]:
    """The same token ids for ON and OFF (seeded), so their outputs can be compared token for token."""
    rng = random.Random(27)
    long_prompt = [rng.randrange(4, 2048) for _ in range(LONG)]
    others = [[rng.randrange(4, 2048) for _ in range(LONG)] for _ in range(OTHERS)]
    pressure = [[rng.randrange(4, 2048) for _ in range(PRESSURE_PROMPT)] for _ in range(PRESSURE)]
    out: dict[str, list] = {"first": _complete(url, long_prompt, 8)}
    out["others"] = [_complete(url, p, 8) for p in others]
    out["again"] = _complete(url, long_prompt, 8)
    results: list = [None] * PRESSURE

    def one(i):
        results[i] = _complete(url, pressure[i], PRESSURE_OUTPUT)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(PRESSURE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["pressure"] = results
    return out


@dataclass
class Side:
    engine: VllmEngine
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    error: BaseException | None = None


@dataclass
class Lab:
    on: Side
    off: Side


def _start(engines: list[VllmEngine]) -> None:
    """Start the engines side by side (each start is 80-140 s of compile on a loaded 2-core machine)."""
    errors: list[BaseException] = []

    def go(e):
        try:
            e.start(timeout=420)
        except BaseException as exc:  # noqa: BLE001 (re-raised below, with the engine's log tail)
            errors.append(exc)
    threads = [threading.Thread(target=go, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _run(side: Side) -> None:
    try:
        side.before = engine_counters(side.engine.url)
        side.outputs = workload(side.engine.url)
        time.sleep(1.0)  # the engine's stats reach /metrics at its next logging step
        side.after = engine_counters(side.engine.url)
    except BaseException as exc:  # noqa: BLE001 (reported by the tests that read this side)
        side.error = exc


@pytest.fixture(scope="module")
def lab():
    model = build_tiny_model()
    common = dict(num_gpu_blocks=BLOCKS, max_model_len=2048, extra_args=["--enable-prefix-caching"])
    on = VllmEngine(model, offload_gib=HOST_POOL_GIB, offload_link="pcie4x16", **common)
    off = VllmEngine(model, **common)
    try:
        _start([on, off])
        sides = Lab(Side(on), Side(off))
        threads = [threading.Thread(target=_run, args=(s,)) for s in (sides.on, sides.off)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in (sides.on, sides.off):
            if s.error is not None:
                raise AssertionError(f"workload failed: {s.error!r}\n{s.engine.log_tail()}")
        yield sides
    finally:
        on.stop()
        off.stop()


def test_an_evicted_prompt_reloads_from_the_host_tier_with_outputs_identical_to_off(lab):
    on_b, on_a, off_b, off_a = lab.on.before, lab.on.after, lab.off.before, lab.off.after
    reloaded = delta(on_a, on_b, "vllm:prompt_tokens_by_source_total{external_kv_transfer}")
    host = delta(on_a, on_b, "vllm:prompt_tokens_cached_by_source_total{host}")
    # the 1,500-token prompt's whole blocks (46 x 32 = 1,472) come back from the host pool; with temperature 0
    # every token of every request equals the OFF engine's, which computed them all again
    assert reloaded >= 46 * 32 and host == reloaded, (reloaded, host)
    assert delta(off_a, off_b, "vllm:prompt_tokens_by_source_total{external_kv_transfer}") == 0
    assert delta(on_a, on_b, "vllm:kv_offload_load_bytes_total") > 0
    assert delta(on_a, on_b, "vllm:kv_offload_store_bytes_total") > 0
    assert lab.on.outputs == lab.off.outputs
    # fewer prompt tokens computed ON than OFF by at least the reloaded prompt
    computed_on = delta(on_a, on_b, "vllm:prompt_tokens_by_source_total{local_compute}")
    computed_off = delta(off_a, off_b, "vllm:prompt_tokens_by_source_total{local_compute}")
    assert computed_off - computed_on >= 46 * 32, (computed_on, computed_off)


def test_preempted_requests_resume_from_the_host_tier(lab):
    """The four concurrent requests outgrow the 130 blocks: both engines preempt; ON reloads the preempted
    context (kv_offload_load_bytes beyond the evicted prompt's), OFF recomputes it. vLLM 0.32 counts neither in
    prompt_tokens_by_source (first prefills only, vllm/v1/core/sched/scheduler.py)."""
    for side in (lab.on, lab.off):
        assert delta(side.after, side.before, "vllm:num_preemptions_total") >= 1, side.engine.log_tail()
    block_bytes = 16 * 1024  # 2 layers x (K, V) x 2 KV heads x 32 dims x 32 tokens x 2 bytes
    loaded = delta(lab.on.after, lab.on.before, "vllm:kv_offload_load_bytes_total")
    assert loaded > 46 * block_bytes, loaded  # more than the evicted prompt alone
