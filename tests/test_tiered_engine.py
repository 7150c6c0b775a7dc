"""A REAL second tier: vLLM's TieringOffloadingSpec on the CPU engine (the lab's tiered engine,
lab/kvwatt_lab/cpu_tiering.py): GPU blocks -> a 4 MiB CPU primary tier -> an ``fs`` disk tier, watched by kvwatt.

ONE engine start (66 blocks of 32 tokens; CPU tier 4 MiB = 256 chunks of the tiny model's 16 KiB blocks) and ONE
run: a 1,500-token prompt, seven others of 1,500 tokens (they evict it from the device and, 8 x 47 blocks > 256,
from the CPU tier), a few short fresh prompts, then the first prompt again: it comes back from disk (the engine's
own ``prompt_tokens_cached_by_source{source="disk"}`` and ``kv_offload_tiering_read_bytes{tier="1:fs"}``); the
last long prompt again comes from the CPU tier (``host``), the first one a third time from the device.

The disk is a modelled slow disk (DISK_GIB_PER_SECOND over a RAM-backed directory: each batch of block files
takes as long as that disk would carry its bytes, ~0.05 s/MiB, five times vLLM's local back-pressure high-water
mark of 0.010 s/MiB): the first prompt's blocks reach disk while vLLM's EMABackpressureDetector warms up (its
first 10 completed stores), after which its policy drops the cascades bound for disk, which vLLM counts in
``kv_offload_tiering_backpressure_{stores,blocks}_dropped``.

kvwatt (a real ``kvwatt run``, 1 s ticks, a 10 m window holding the whole run) is checked against an independent
scrape of the engine's /metrics (prometheus_client's parser): per-tier read/write bytes/s x the window's covered
seconds, per-tier chunk hit ratios, cached-token shares by source, the back-pressure drops; all within 1 %.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

import pytest
import requests

from tests.support.daemon import KvwattDaemon, parse_exposition
from tests.support.engine import VllmEngine, build_tiny_model

pytestmark = [pytest.mark.engine]
BLOCKS, CPU_MIB, LONG, OTHERS, SHORT, SHORT_TOKENS = 66, 4, 1500, 7, 6, 200
DISK_GIB_PER_SECOND = 0.02  # 20.5 MiB/s: ~0.049 s/MiB, over the back-pressure high-water mark (0.010 s/MiB)
WINDOW = "10m"  # longer than the run: the window's deltas are the run's
TIERS = ("0:primary", "1:fs")
SOURCES = ("device", "host", "disk")


def counters(url: str) -> dict[tuple[str, str], float]:
    """The engine's counters by (name, tier or source label), summed over other labels."""
    out: dict[tuple[str, str], float] = {}
    for (name, labels), v in parse_exposition(requests.get(url + "/metrics", timeout=10).text).items():
        if name.endswith(("_created", "_bucket")) or not name.startswith("vllm:"):
            continue
        lab = dict(labels)
        key = (name, lab.get("tier") or lab.get("source") or "")
        out[key] = out.get(key, 0.0) + v
    return out


def _complete(url: str, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "min_tokens": 8, "ignore_eos": True,
            "temperature": 0.0}
    requests.post(url + "/v1/completions", json=body, timeout=300).raise_for_status()


@pytest.fixture(scope="module")
def run():
    disk = tempfile.mkdtemp(prefix="kvwatt-disk-", dir="/dev/shm")  # RAM-backed: the model sets the disk's time
    engine = VllmEngine(build_tiny_model(), num_gpu_blocks=BLOCKS, max_model_len=2048,
                        extra_args=["--enable-prefix-caching"],
                        tiered=dict(cpu_mib=CPU_MIB, disk_dir=disk, disk=DISK_GIB_PER_SECOND))
    try:
        engine.start()
        config = {"windows": [WINDOW], "metrics_opt_in": ["all"]}
        with KvwattDaemon(servers={"tiered": {"url": engine.url, "gpus": []}}, config=config, interval="1s") as d:
            d.wait_for(lambda d: d.value("kvwatt_offload_enabled", server="tiered") is not None, timeout=30)
            before = counters(engine.url)
            rng = random.Random(41)
            first = [rng.randrange(4, 2048) for _ in range(LONG)]
            _complete(engine.url, first)
            others = [[rng.randrange(4, 2048) for _ in range(LONG)] for _ in range(OTHERS)]
            for prompt in others:
                _complete(engine.url, prompt)
            for _ in range(SHORT):
                _complete(engine.url, [rng.randrange(4, 2048) for _ in range(SHORT_TOKENS)])
            _complete(engine.url, first)  # from disk
            _complete(engine.url, others[-1])  # from the CPU tier (the last long one: evicted from the device only)
            _complete(engine.url, first)  # from the device
            time.sleep(1.5)  # the engine's stats reach /metrics at its next step; the disk's last writes finish
            after = counters(engine.url)
            time.sleep(2.2)  # a tick has read the engine after ``after`` and one more derived

            def settled(d):
                m = d.metrics()
                return m if m.get(("kvwatt_source_up", frozenset({("source", "vllm"), ("server", "tiered")}))) \
                    == 1 else None
            kvwatt = d.wait_for(settled, timeout=60, what="the engine read at one tick")
            yield {"before": before, "after": after, "kvwatt": kvwatt, "status": d.status(),
                   "shm": engine.engine_id, "log": engine.log_path}
    finally:
        engine.stop()
        shutil.rmtree(disk, ignore_errors=True)


def delta(run: dict, name: str, label: str = "") -> float:
    return run["after"].get((name, label), 0.0) - run["before"].get((name, label), 0.0)


def kv(run: dict, name: str, **labels) -> float | None:
    want = set(labels.items())
    hits = [v for (n, lab), v in run["kvwatt"].items() if n == name and want <= lab]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else None


def test_an_evicted_prompt_comes_back_from_disk(run):
    disk = delta(run, "vllm:prompt_tokens_cached_by_source_total", "disk")
    read = delta(run, "vllm:kv_offload_tiering_read_bytes_total", "1:fs")
    print(f"\ndisk tokens {disk:.0f}, 1:fs read {read:.0f} B, written "
          f"{delta(run, 'vllm:kv_offload_tiering_write_bytes_total', '1:fs'):.0f} B")
    # the 1,500-token prompt's 46 whole blocks (46 x 32 tokens, 46 x 16 KiB) come back from the disk tier
    assert disk >= 46 * 32 and read >= 46 * 16 * 1024, (disk, read)
    assert delta(run, "vllm:kv_offload_tiering_chunk_hits_total", "1:fs") >= 46


def test_the_slow_disk_trips_back_pressure(run):
    stores = delta(run, "vllm:kv_offload_tiering_backpressure_stores_dropped_total", "1:fs")
    blocks = delta(run, "vllm:kv_offload_tiering_backpressure_blocks_dropped_total", "1:fs")
    print(f"\nback-pressure dropped {stores:.0f} stores, {blocks:.0f} blocks")
    assert stores >= 1 and blocks >= stores, (stores, blocks)


def test_kvwatt_reads_the_drops_and_says_the_disk_is_too_slow(run):
    """The figure (per tier and window, opt-in) x the covered seconds = the engine's counters (1 %), and the
    advice names the tier."""
    covered = _covered(run)
    for what in ("stores", "blocks"):
        engine = delta(run, f"vllm:kv_offload_tiering_backpressure_{what}_dropped_total", "1:fs")
        got = kv(run, f"kvwatt_offload_tier_dropped_{what}_per_second", server="tiered", tier="1:fs", window=WINDOW)
        print(f"\n1:fs {what} dropped: engine {engine:.0f}, kvwatt {got:.3f}/s x {covered:.1f} s = {got * covered:.1f}")
        assert engine > 0 and got * covered == pytest.approx(engine, rel=0.01)
    [server] = run["status"]["servers"]
    advice = [a for a in server["advice"] if a["kind"] == "tier_dropping_stores"]
    assert advice and advice[0]["evidence"]["tier"] == "1:fs", server["advice"]
    assert advice[0]["text"].startswith("The 1:fs tier is dropping stores: too slow for the write rate.")


def test_the_shared_region_is_gone_while_the_engine_runs(run):
    """The worker removed the region's name at its first transfer (kvwatt_lab/cpu_tiering.py): no exit can
    leave it in /dev/shm."""
    assert not os.path.exists(f"/dev/shm/vllm_offload_{run['shm']}.mmap")


def _covered(run: dict) -> float:
    return kv(run, "kvwatt_window_covered_seconds", server="tiered", window=WINDOW)


def test_per_tier_bytes_per_second_equal_the_engines_counters(run):
    covered = _covered(run)
    for direction in ("read", "write"):
        engine = delta(run, f"vllm:kv_offload_tiering_{direction}_bytes_total", "1:fs")
        got = kv(run, f"kvwatt_offload_tier_{direction}_bytes_per_second", server="tiered", tier="1:fs",
                 window=WINDOW)
        print(f"\n1:fs {direction}: engine {engine:.0f} B, kvwatt {got:.1f} B/s x {covered:.1f} s = "
              f"{got * covered:.0f} B")
        assert engine > 0 and got * covered == pytest.approx(engine, rel=0.01)


def test_per_tier_hit_ratios_equal_the_engines_counters(run):
    for tier in TIERS:
        queries = delta(run, "vllm:kv_offload_tiering_chunk_queries_total", tier)
        hits = delta(run, "vllm:kv_offload_tiering_chunk_hits_total", tier)
        got = kv(run, "kvwatt_offload_tier_chunk_hit_ratio", server="tiered", tier=tier, window=WINDOW)
        print(f"\n{tier}: {hits:.0f} hits of {queries:.0f} queries, kvwatt {got}")
        assert queries > 0 and got == pytest.approx(hits / queries, rel=0.01), (tier, hits, queries, got)


def test_cached_token_shares_by_source_equal_the_engines_counters(run):
    counts = {s: delta(run, "vllm:prompt_tokens_cached_by_source_total", s) for s in SOURCES}
    assert all(counts.values()), counts  # device, host and disk each served a repeated prompt
    total = sum(delta(run, "vllm:prompt_tokens_cached_by_source_total", s)
                for s in (*SOURCES, "p2p", "external_unspecified"))
    print(f"\ncached tokens by source {counts}")
    for source in SOURCES:
        got = kv(run, "kvwatt_cached_prompt_token_share_ratio", server="tiered", tier=source, window=WINDOW)
        assert got == pytest.approx(counts[source] / total, rel=0.01, abs=1e-9), (source, counts, got)
