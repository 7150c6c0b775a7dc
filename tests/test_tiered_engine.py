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
seconds, per-tier chunk hit ratios, cached-token shares by source, the back-pressure drops, each tier's read/write
bandwidth and busy seconds (vLLM's _time counters), its kappa_crit and its lookup delays; all within 1 %.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

import pytest
import requests

from exporter import rules
from tests.support.daemon import KvwattDaemon, parse_exposition
from tests.support.engine import VllmEngine, build_tiny_model

pytestmark = [pytest.mark.engine]
BLOCKS, CPU_MIB, LONG, OTHERS, SHORT, SHORT_TOKENS = 66, 4, 1500, 7, 6, 200
DISK_GIB_PER_SECOND = 0.02  # 20.5 MiB/s: ~0.049 s/MiB, over the back-pressure high-water mark (0.010 s/MiB)
WINDOW = "10m"  # longer than the run: the window's deltas are the run's
TIERS = ("0:primary", "1:fs")
SOURCES = ("device", "host", "disk")
# F and the host link B for s7's roofline (configured: the CPU engine has no GPU); B of the order of the modelled
# disk's so that the disk's read visibly lowers the tier's kappa_crit
HARDWARE = {"flops_per_second": 1e11, "host_device_bytes_per_second": 1e8}


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
    model = build_tiny_model()
    engine = VllmEngine(model, num_gpu_blocks=BLOCKS, max_model_len=2048,
                        extra_args=["--enable-prefix-caching"],
                        tiered=dict(cpu_mib=CPU_MIB, disk_dir=disk, disk=DISK_GIB_PER_SECOND))
    try:
        engine.start()
        config = {"windows": [WINDOW], "metrics_opt_in": ["all"]}
        # the CPU tier's size as kvwatt's configuration states it (vLLM exports its cpu_bytes_to_use nowhere); the
        # served model's config.json and a configured host link give kappa_crit (methods.md s7), per tier (s14)
        server = {"url": engine.url, "gpus": [], "offload_tier_bytes": {"0:primary": CPU_MIB * 2 ** 20},
                  "model_config": os.path.join(model, "config.json"), "hardware": HARDWARE}
        with KvwattDaemon(servers={"tiered": server}, config=config, interval="1s") as d:
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


# --- issue 41 items 2-3 on the same run: failures, kappa and the hops' energy per tier, the CPU tier's size ---------
def _window(run: dict) -> dict:
    [server] = run["status"]["servers"]
    return server["windows"][WINDOW]


def test_failed_promotions_and_cascades_equal_the_engines_counters(run):
    """vLLM has no sample of a failure counter until its first failure: kvwatt says 0 for a tier that moved data,
    and the engine's delta (0 on a healthy RAM-backed tier, whatever it counted otherwise) is what it read."""
    covered = _covered(run)
    for what, kind in (("promotions", "promotion"), ("cascades", "cascade")):
        engine = delta(run, f"vllm:kv_offload_tiering_{kind}_job_failures_total", "1:fs")
        got = kv(run, f"kvwatt_offload_tier_failed_{what}_per_second", server="tiered", tier="1:fs", window=WINDOW)
        print(f"\n1:fs failed {what}: engine {engine:.0f}, kvwatt {got} /s x {covered:.1f} s")
        assert got is not None and got * covered == pytest.approx(engine, rel=0.01, abs=1e-9)


def test_kappa_per_tier_equals_the_engines_counters(run):
    computed = delta(run, "vllm:prompt_tokens_by_source_total", "local_compute")
    for tier in ("host", "disk"):
        engine = delta(run, "vllm:prompt_tokens_cached_by_source_total", tier) / computed
        got = kv(run, "kvwatt_offload_tier_cached_to_prefill_ratio", server="tiered", tier=tier, window=WINDOW)
        print(f"\nkappa {tier}: engine {engine:.4f}, kvwatt {got}")
        assert got == pytest.approx(engine, rel=0.01)


def test_a_disk_tokens_hops_are_the_engines_bytes_at_the_configured_joules(run):
    """bytes a reloaded token moves over the link (load bytes / reloaded tokens) x (DRAM + link) plus the fs
    tier's read bytes per disk token x (disk + DRAM), at rules.py's defaults (methods.md s14); the reload W x the
    covered seconds is the disk tokens x that. No energy here (the CPU engine has none): the price is unknown,
    with its reason."""
    loaded = delta(run, "vllm:kv_offload_load_bytes_total")
    reloaded = delta(run, "vllm:prompt_tokens_by_source_total", "external_kv_transfer")
    disk = delta(run, "vllm:prompt_tokens_cached_by_source_total", "disk")
    read = delta(run, "vllm:kv_offload_tiering_read_bytes_total", "1:fs")
    mem, link, drive = (rules.HOST_MEMORY_JOULES_PER_BYTE.default, rules.HOST_LINK_JOULES_PER_BYTE.default,
                        rules.DISK_JOULES_PER_BYTE.default)
    hop = loaded / reloaded * (mem + link) + read / disk * (drive + mem)
    tier = _window(run)["offload_tier_energy"]["disk"]
    print(f"\ndisk: {loaded:.0f} B loaded / {reloaded:.0f} reloaded, {read:.0f} B read / {disk:.0f} disk tokens: "
          f"hops {hop:.4g} J, kvwatt {tier}")
    assert loaded > 0 and tier["hop_joules_per_token"] == pytest.approx(hop, rel=0.01)
    got = kv(run, "kvwatt_offload_tier_reload_watts", server="tiered", tier="disk", window=WINDOW)
    assert got * _covered(run) == pytest.approx(disk * hop, rel=0.01)
    assert tier["hop_source"] == "configured" and tier["reload_joules_per_token"] is None and tier["price_reason"]


def test_the_cpu_tier_sizes_the_buffer_and_the_disk_tiers_size_is_unknown_with_its_reason(run):
    """The CPU tier's cpu_bytes_to_use (configured as offload_tier_bytes["0:primary"]) is the buffer: residency =
    its bytes / the store rate; vLLM's fs tier has no capacity of its own."""
    assert kv(run, "kvwatt_offload_buffer_bytes", server="tiered") == CPU_MIB * 2 ** 20
    write = kv(run, "kvwatt_offload_write_bytes_per_second", server="tiered", window=WINDOW)
    residency = kv(run, "kvwatt_offload_buffer_residency_seconds", server="tiered", window=WINDOW)
    print(f"\nCPU tier {CPU_MIB} MiB at {write:.0f} B/s: residency {residency} s")
    assert write > 0 and residency == pytest.approx(CPU_MIB * 2 ** 20 / write, rel=1e-6)
    [server] = run["status"]["servers"]
    assert server["offload_buffer"]["size_setting"] == "cpu_bytes_to_use"
    fs = _window(run)["offload_tiers"]["1:fs"]
    assert fs["capacity_bytes"] is None and "no capacity of its own" in fs["capacity_reason"]


def test_per_tier_transfer_times_equal_the_engines_counters(run):
    """vLLM's kv_offload_tiering_{read,write}_time (seconds summed over the tier's finished jobs): the tier's
    bandwidth = its bytes / those seconds, its busy seconds per second x the covered seconds = those seconds (1 %);
    the modelled disk (DISK_GIB_PER_SECOND) bounds the bandwidth a job sees."""
    covered = _covered(run)
    for direction in ("read", "write"):
        moved = delta(run, f"vllm:kv_offload_tiering_{direction}_bytes_total", "1:fs")
        seconds = delta(run, f"vllm:kv_offload_tiering_{direction}_time_total", "1:fs")
        bandwidth = kv(run, f"kvwatt_offload_tier_{direction}_bandwidth_bytes_per_second", server="tiered",
                       tier="1:fs", window=WINDOW)
        busy = kv(run, f"kvwatt_offload_tier_{direction}_seconds_per_second", server="tiered", tier="1:fs",
                  window=WINDOW)
        print(f"\n1:fs {direction}: engine {moved:.0f} B in {seconds:.4f} s = {moved / seconds:.4g} B/s; kvwatt "
              f"{bandwidth:.4g} B/s, {busy:.5f} s/s x {covered:.1f} s = {busy * covered:.4f} s "
              f"(the modelled disk: {DISK_GIB_PER_SECOND * 2 ** 30:.4g} B/s)")
        assert moved > 0 and seconds > 0
        assert bandwidth == pytest.approx(moved / seconds, rel=0.01)
        assert busy * covered == pytest.approx(seconds, rel=0.01)
        assert bandwidth <= DISK_GIB_PER_SECOND * 2 ** 30 * 1.01  # the model holds each batch to its bandwidth


def test_kappa_crit_per_tier_is_the_links_with_the_tiers_measured_read_in_series(run):
    """methods.md s14: kappa_crit_t = kappa_crit x B_t / (B_t + B), B_t the engine's read bytes / read seconds."""
    link = kv(run, "kvwatt_critical_cached_to_prefill_ratio", server="tiered")
    read = delta(run, "vllm:kv_offload_tiering_read_bytes_total", "1:fs") / \
        delta(run, "vllm:kv_offload_tiering_read_time_total", "1:fs")
    want = link * read / (read + HARDWARE["host_device_bytes_per_second"])
    got = kv(run, "kvwatt_offload_tier_critical_cached_to_prefill_ratio", server="tiered", tier="1:fs",
             window=WINDOW)
    print(f"\nkappa_crit: link {link:.4g}, 1:fs {got} (engine's read {read:.4g} B/s: {want:.4g})")
    assert link > 0 and got == pytest.approx(want, rel=0.01)
    primary = _window(run)["offload_tiers"]["0:primary"]  # vLLM counts no bytes for the CPU tier itself
    assert primary["critical_cached_to_prefill_ratio"] is None and primary["critical_reason"]


def test_per_tier_lookup_delays_equal_the_engines_histograms(run):
    """vLLM's lookup histograms per tier: the mean blocking time of a resolved lookup and the mean wait of one the
    tier answered 'retry' (the fs tier's asynchronous lookup: each new prompt waits a step for it), within 1 %."""
    fs = _window(run)["offload_tiers"]["1:fs"]
    for figure, base in (("lookup_seconds", "sync"), ("lookup_wait_seconds", "async")):
        name = f"vllm:kv_offload_tiering_lookup_{base}_delay_seconds"
        total, count = delta(run, name + "_sum", "1:fs"), delta(run, name + "_count", "1:fs")
        got = kv(run, f"kvwatt_offload_tier_{figure}", server="tiered", tier="1:fs", window=WINDOW)
        print(f"\n1:fs {base} lookups: engine {count:.0f} in {total:.5f} s = {total / count:.6f} s each; kvwatt {got}")
        assert count > 0 and got == pytest.approx(total / count, rel=0.01)
        assert fs[figure] == pytest.approx(got, rel=1e-9)
