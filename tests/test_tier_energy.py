"""When a disk reload beats a recompute (methods.md s14, derive/tier_energy.py), and the second tier's sizing and
failures (derive/offload.py, model/offload.py): expected values worked by hand from the formulas."""

from __future__ import annotations

import pytest

from exporter.config import ServerConfig, from_mapping
from exporter.derive import energy as derive_energy
from exporter.derive import offload as O
from exporter.derive import phase_energy as pe
from exporter.derive import tier_energy as te
from exporter.model import offload as offload_model
from exporter.samples import EngineInfo, Interval
from tests.support.aggregates import aggregate_of

RATIO = 0.1
# measured costs: 0.05 J per computed prompt token, 0.005 J per reloaded one (the GPU's side of a reload)
COSTS = pe.PhaseCosts(scope="gpu", prompt_computed_j=0.05, prompt_computed_se=0.001, generated_j=1.0, generated_se=0.01,
                      reloaded_j=0.005, reloaded_se=0.0005, windows=120, state="known", reason="", source="measured")
HOPS = te.HopEnergy(host_memory=1e-10, host_link=5e-11, disk=2e-9)
BLOCK_BYTES_PER_TOKEN = 16384.0  # what a reloaded token moves over the link (offload load bytes / reloaded)
DISK_BYTES_PER_TOKEN = 32768.0  # what the fs tier reads per disk token (whole chunks)


def iv(t: float, *, host: float = 300.0, disk: float = 100.0, p2p: float = 0.0, disk_reads: bool = True,
       joules: float = 400.0, idle: float = 340.0) -> Interval:
    """One 1 s interval: 100 computed prompt tokens, 10 generated, host + disk (+ p2p) reloaded; 60 W marginal."""
    reloaded = host + disk + p2p
    deltas = {"generation_tokens": 10.0, "prompt_local_compute": 100.0, "prompt_local_cache_hit": 50.0,
              "prompt_external_kv_transfer": reloaded, "prompt_cached_device": 50.0, "prompt_cached_host": host,
              "prompt_cached_disk": disk, "prompt_cached_p2p": p2p,
              "offload_load_bytes": reloaded * BLOCK_BYTES_PER_TOKEN}
    if disk_reads:
        deltas["tier_read_bytes@1:fs"] = disk * DISK_BYTES_PER_TOKEN
    return Interval(t0=t, t1=t + 1.0, deltas=deltas, gauges={}, energy_joules={"gpu": joules},
                    idle_joules={"gpu": idle})


def by_tier(tiers):
    return {t.tier: t for t in tiers}


def test_each_tier_is_priced_from_its_hops():
    agg = aggregate_of([iv(float(t)) for t in range(30)])
    tiers = by_tier(te.tier_energy(agg, COSTS, HOPS, RATIO))
    assert set(tiers) == {"host", "disk"}
    host, disk = tiers["host"], tiers["disk"]
    # host: 16384 B x (DRAM 1e-10 + link 5e-11) = 2.4576e-6 J; disk adds 32768 B x (drive 2e-9 + DRAM 1e-10)
    assert host.hop_joules_per_token == pytest.approx(2.4576e-6)
    assert disk.hop_joules_per_token == pytest.approx(2.4576e-6 + 6.88128e-5)
    assert host.bytes_per_token == 16384 and disk.bytes_per_token == 16384 + 32768
    assert host.reload_joules_per_token == pytest.approx(0.0050024576)
    assert disk.reload_joules_per_token == pytest.approx(0.0050712704)
    assert host.breakeven_ratio == pytest.approx(0.0050024576 / 0.05)
    assert disk.breakeven_ratio == pytest.approx(0.0050712704 / 0.05)
    # kappa per tier: 300 and 100 tokens per 100 computed
    assert host.cached_to_prefill == pytest.approx(3.0) and disk.cached_to_prefill == pytest.approx(1.0)
    # 300 and 100 tokens/s x (0.05 - 0.005) J on the GPU; less their hops
    assert host.tokens_per_second == pytest.approx(300.0) and disk.tokens_per_second == pytest.approx(100.0)
    assert host.gpu_saved_watts == pytest.approx(13.5) and disk.gpu_saved_watts == pytest.approx(4.5)
    assert host.reload_watts == pytest.approx(300 * 2.4576e-6)
    assert disk.saved_watts == pytest.approx(4.5 - 100 * 7.12704e-5)
    assert host.hop_source == "configured"
    # dE of the disk tier: its net saving / (60 W marginal + the 4.5 W its tokens' recompute would add)
    assert te.second_tier_saving(tuple(tiers.values()), agg, "gpu") == pytest.approx(
        (4.5 - 100 * 7.12704e-5) / 64.5)


def test_a_disk_dearer_than_a_recompute_has_a_break_even_above_one_and_a_negative_saving():
    """A disk at 2 uJ/byte: 32768 B x 2.0001e-6 J = 0.0655 J of hops a token, more than the 0.045 J it saves."""
    dear = te.HopEnergy(host_memory=1e-10, host_link=5e-11, disk=2e-6)
    agg = aggregate_of([iv(float(t)) for t in range(30)])
    tiers = te.tier_energy(agg, COSTS, dear, RATIO)
    disk = by_tier(tiers)["disk"]
    hops = 2.4576e-6 + 32768 * (2e-6 + 1e-10)
    assert disk.breakeven_ratio == pytest.approx((0.005 + hops) / 0.05) and disk.breakeven_ratio > 1
    assert disk.saved_watts == pytest.approx(100 * (0.045 - hops)) and disk.saved_watts < 0
    assert te.second_tier_saving(tiers, agg, "gpu") == pytest.approx(100 * (0.045 - hops) / 64.5)
    assert by_tier(tiers)["host"].breakeven_ratio < 1  # the host tier still pays


def test_the_tiers_savings_and_reload_energy_sum_to_the_gpu_saving():
    """The relation tier_savings_sum_to_the_saving: the same capped costs, the reloaded tokens split by tier."""
    agg = aggregate_of([iv(float(t)) for t in range(30)])
    saved = derive_energy.tax_in_energy(agg, 0.05, [COSTS], True, RATIO)["offload_saved_watts"]["gpu"]
    assert saved == pytest.approx(400 * 0.045)
    tiers = te.tier_energy(agg, COSTS, HOPS, RATIO)
    assert sum(t.saved_watts + t.reload_watts for t in tiers) == pytest.approx(saved, rel=1e-12)


def test_without_the_disk_tiers_read_counter_a_disk_token_moves_a_block_on_every_hop():
    agg = aggregate_of([iv(float(t), disk_reads=False) for t in range(10)])
    disk = by_tier(te.tier_energy(agg, COSTS, HOPS, RATIO))["disk"]
    assert disk.hop_joules_per_token == pytest.approx(2.4576e-6 + 16384 * 2.1e-9)


def test_a_tier_without_hop_prices_is_unknown_but_keeps_its_gpu_side_saving():
    agg = aggregate_of([iv(float(t), p2p=100.0) for t in range(10)])
    p2p = by_tier(te.tier_energy(agg, COSTS, HOPS, RATIO))["p2p"]
    assert p2p.reload_joules_per_token is None and p2p.breakeven_ratio is None and p2p.saved_watts is None
    assert p2p.gpu_saved_watts == pytest.approx(100 * 0.045)


def test_no_energy_above_idle_leaves_the_counts_and_hops_and_no_price():
    agg = aggregate_of([iv(float(t), joules=300.0) for t in range(10)])  # below P_idle: a stale baseline
    for costs in (COSTS, None):  # no energy above idle; no per-phase costs at all (no GPU energy)
        tiers = te.tier_energy(agg, costs, HOPS, RATIO)
        disk = by_tier(tiers)["disk"]
        # the counts and the configured hops stand: kappa 1, 100 disk tokens/s x 7.12704e-5 J
        assert disk.cached_to_prefill == pytest.approx(1.0) and disk.scope == ""
        assert disk.hop_joules_per_token == pytest.approx(7.12704e-5)
        assert disk.reload_watts == pytest.approx(100 * 7.12704e-5)
        assert disk.reload_joules_per_token is None and disk.saved_watts is None and disk.gpu_saved_watts is None
        assert disk.price_reason
        assert te.second_tier_saving(tiers, agg, "gpu") is None


def flows_interval(t: float, failures: dict[str, float]) -> Interval:
    deltas = {"tier_write_bytes@1:fs": 1000.0, "tier_read_bytes@1:fs": 500.0, "tier_chunk_queries@0:primary": 4.0,
              "tier_chunk_hits@0:primary": 3.0, **failures}
    return Interval(t0=t, t1=t + 1.0, deltas=deltas, gauges={}, energy_joules={}, idle_joules={})


def test_failed_promotions_and_cascades_per_tier():
    """Per second over the covered seconds; 0 for a tier that moved data while vLLM has no sample yet."""
    ivs = [flows_interval(float(t), {"tier_promotion_failures@1:fs": 2.0} if t < 5 else {}) for t in range(20)]
    tiers = {f.tier: f for f in O.tier_flows(aggregate_of(ivs))}
    assert tiers["1:fs"].failed_promotions_per_second == pytest.approx(10 / 20)
    assert tiers["1:fs"].failed_cascades_per_second == 0.0
    assert tiers["0:primary"].failed_promotions_per_second == 0.0


def test_the_disk_tiers_size_is_unknown_with_a_reason_unless_configured():
    ivs = [flows_interval(float(t), {}) for t in range(10)]
    unset = {f.tier: f for f in O.tier_flows(aggregate_of(ivs))}
    assert unset["1:fs"].capacity_bytes is None and "no capacity of its own" in unset["1:fs"].capacity_reason
    assert "cpu_bytes_to_use" in unset["0:primary"].capacity_reason
    sized = {f.tier: f for f in O.tier_flows(aggregate_of(ivs), {"1:fs": 2e12})}
    assert sized["1:fs"].capacity_bytes == 2e12 and sized["1:fs"].capacity_reason == ""
    assert sized["1:fs"].residency_seconds == pytest.approx(2e12 / 1000.0)


def test_the_cpu_tier_sizes_the_buffer_from_cpu_bytes_to_use():
    """vLLM's tiered spec has no --kv-offloading-size: the CPU tier's configured size is the buffer, and the
    advice names the setting that sizes it."""
    server = ServerConfig(name="t", url="http://x", offload_tier_bytes={"0:primary": 4 * 2.0 ** 20})
    info = EngineInfo(model_name="m", offload_enabled=True, offload_buffer_bytes=None)
    sized = offload_model.with_tier_buffer(info, server)
    assert sized.offload_buffer_bytes == 4 * 2.0 ** 20
    assert offload_model.buffer_setting(sized, server) == "cpu_bytes_to_use"
    stated = EngineInfo(model_name="m", offload_enabled=True, offload_buffer_bytes=8.0 * 2 ** 30)
    assert offload_model.with_tier_buffer(stated, server) is stated  # the engine's own size wins
    off = EngineInfo(model_name="m", offload_enabled=False)
    assert offload_model.with_tier_buffer(off, server).offload_buffer_bytes is None
    assert offload_model.buffer_setting(stated, server) == "--kv-offloading-size"


def test_an_undersized_cpu_tier_is_told_in_cpu_bytes_to_use():
    cfg = from_mapping({})
    buf = offload_model.BufferFigures(undersized=True, recommended_bytes=25_000_000.4, recommended_gib=0.024,
                                      store_failures=0.0, residency_seconds=2.0, write_bytes_per_second=1e7,
                                      p99_tool_latency_seconds=20.0, headroom=1.5, residency_target_seconds=20.0,
                                      size_setting="cpu_bytes_to_use")
    words = offload_model.undersized_words(buf, cfg)
    assert "cpu_bytes_to_use to 25000001 or more (bytes)" in words and "--kv-offloading-size" not in words


def test_hop_energies_are_configured_with_their_defaults_and_refused_out_of_range():
    from exporter import rules
    from exporter.config import ConfigError
    cfg = from_mapping({})
    assert (cfg.host_memory_joules_per_byte, cfg.host_link_joules_per_byte, cfg.disk_joules_per_byte) == (
        rules.HOST_MEMORY_JOULES_PER_BYTE.default, rules.HOST_LINK_JOULES_PER_BYTE.default,
        rules.DISK_JOULES_PER_BYTE.default)
    assert from_mapping({"disk_joules_per_byte": 5e-9}).disk_joules_per_byte == 5e-9
    with pytest.raises(ConfigError, match="disk_joules_per_byte"):
        from_mapping({"disk_joules_per_byte": -1})
