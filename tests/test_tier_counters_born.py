"""What the real tiered engine (tests/test_tiered_engine.py) showed about vLLM 0.32's counters, at unit level:

- vLLM's ``kv_offload_tiering_*{tier}`` series (and any labelled child) appear at their first observation, with
  that observation's value: a disk tier's single promotion of 753,664 bytes came as one new series and never
  moved again, so a store that re-bases every first sight read 0 B/s of disk reads. A labelled counter that an
  engine already read shows for the first time in the same process counts its value as its increase; one seen
  before (a family refused for a read, then back) re-bases as before; a new engine's or a new process's do not.
- vLLM 0.32 exports the deprecated ``kv_offload_total_bytes{transfer_type}`` at 0 from start-up and each flat
  ``kv_offload_{store,load}_bytes`` from its first transfer on: the store's and the load's switches a few reads
  apart are one switch each, not an engine alternating spellings (``spelling_switching`` made the tiered engine's
  server "degraded" two seconds into its run).
"""

from __future__ import annotations

from exporter.samples import EngineInfo, EngineReading
from exporter.store import ServerHistory

READ = "tier_read_bytes@1:fs"
START = 1.7e9


def reading(t: int, extra: dict[str, float] | None = None, start: float = START, engine: str = "0",
            spellings: dict[str, str] | None = None) -> EngineReading:
    counters = {"generation_tokens": 100.0 * t, "prompt_tokens": 400.0 * t, **(extra or {})}
    return EngineReading(counters=counters, gauges={"running": 1.0, "waiting": 0.0},
                         info=EngineInfo(model_name="m", process_start_time_seconds=start),
                         engine_counters={engine: counters}, spellings=dict(spellings or {}))


def run(extras: list[dict], **kw) -> list:
    h = ServerHistory(600, name="svc", windows=(60.0,))
    return [h.add_reading(float(t), reading(t, x, **kw)) for t, x in enumerate(extras, start=1)]


def test_a_labelled_counter_born_in_the_process_counts_its_first_value():
    ivs = run([{}, {}, {READ: 753664.0}, {READ: 753664.0}])
    assert ivs[2].deltas[READ] == 753664.0  # old code: absent (first sight re-based), the promotion never counted
    assert ivs[3].deltas[READ] == 0.0


def test_a_labelled_counter_seen_before_re_bases_when_it_comes_back():
    ivs = run([{READ: 10.0}, {READ: 20.0}, {}, {READ: 5e6}, {READ: 5e6 + 30}])
    assert ivs[1].deltas[READ] == 10.0
    assert READ not in ivs[3].deltas  # back after a read without it: its level is not an increase
    assert ivs[4].deltas[READ] == 30.0


def test_an_unlabelled_counter_or_the_first_reading_never_counts_its_level():
    ivs = run([{READ: 9e9}, {READ: 9e9, "engine_write_bytes": 4e9}, {READ: 9e9 + 1, "engine_write_bytes": 4e9 + 2}])
    assert ivs[0] is None and ivs[1].deltas[READ] == 0.0 and "engine_write_bytes" not in ivs[1].deltas
    assert ivs[2].deltas == {"generation_tokens": 100.0, "prompt_tokens": 400.0, READ: 1.0, "engine_write_bytes": 2.0}


def test_a_new_process_s_labelled_counters_are_not_born_in_the_old_one():
    h = ServerHistory(600, name="svc", windows=(60.0,))
    h.add_reading(1.0, reading(100))
    h.add_reading(2.0, reading(101))
    iv = h.add_reading(3.0, reading(1, {READ: 4096.0}, start=START + 2.5))  # restarted: counters from zero
    assert h.restarts == 1
    assert iv.deltas.get(READ) in (None, 4096.0)  # never more than the new process's own value
    later = h.add_reading(4.0, reading(2, {READ: 4096.0, "tier_write_bytes@1:fs": 8192.0}, start=START + 2.5))
    assert later.deltas[READ] == 0.0 and later.deltas["tier_write_bytes@1:fs"] == 8192.0


DEPRECATED_STORE = 'vllm:kv_offload_total_bytes{transfer_type="GPU_to_CPU"}'
DEPRECATED_LOAD = 'vllm:kv_offload_total_bytes{transfer_type="CPU_to_GPU"}'


def test_vllm_0_32_s_flat_offload_series_appearing_reads_apart_are_no_spelling_condition(caplog):
    h = ServerHistory(600, name="svc", windows=(60.0,))
    with caplog.at_level("INFO", logger="kvwatt.store"):
        for t in range(1, 12):
            store_flat, load_flat = t >= 3, t >= 5  # the first store at read 3, the first load at read 5
            counters = {"offload_store_bytes": 1000.0 * t if store_flat else 0.0,
                        "offload_load_bytes": 500.0 * t if load_flat else 0.0}
            spellings = {"offload_store_bytes": "vllm:kv_offload_store_bytes" if store_flat else DEPRECATED_STORE,
                         "offload_load_bytes": "vllm:kv_offload_load_bytes" if load_flat else DEPRECATED_LOAD}
            h.add_reading(float(t), reading(t, counters, spellings=spellings))
            assert not h.spelling.problem, (t, h.spelling.problem)  # old code: spelling_switching from read 5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("switched the spelling of" in m for m in lines), lines
    # switching back and forth still is the condition
    for t, flat in ((12, False), (13, True), (14, False)):
        spellings = {"offload_store_bytes": "vllm:kv_offload_store_bytes" if flat else DEPRECATED_STORE,
                     "offload_load_bytes": "vllm:kv_offload_load_bytes"}
        h.add_reading(float(t), reading(t, {"offload_store_bytes": 1000.0 * t, "offload_load_bytes": 500.0 * t},
                                        spellings=spellings))
    assert h.spelling.problem.startswith("spelling_switching: "), h.spelling.problem


# --- the per-tier flows over a window that the tier's series were born in ----------------------------------------
def _window(extras: list[dict]):
    h = ServerHistory(600, name="svc", windows=(60.0,))
    for t, x in enumerate(extras, start=1):
        h.add_reading(float(t), reading(t, x))
    return h.aggregate(60.0)


def test_a_promotion_born_mid_window_is_its_bytes_over_the_covered_seconds():
    from exporter.derive.offload import tier_flows
    # 5 intervals covered; the disk tier's one promotion (753,664 B) came at the 4th read and never again
    agg = _window([{}, {}, {}, {READ: 753664.0, "tier_chunk_queries@1:fs": 54.0, "tier_chunk_hits@1:fs": 46.0},
                   {READ: 753664.0, "tier_chunk_queries@1:fs": 54.0, "tier_chunk_hits@1:fs": 46.0}, {READ: 753664.0}])
    [fs] = tier_flows(agg)
    assert agg.covered_seconds == 5.0
    assert fs.read_bytes_per_second == 753664.0 / 5.0  # old code: 0 (the first value re-based)
    assert fs.chunk_hit_ratio == 46.0 / 54.0


def test_a_tier_queried_and_never_hit_has_a_hit_ratio_of_zero():
    from exporter.derive.offload import tier_flows
    # vLLM's 0:primary tier: queries counted, its hits series not created until its first hit
    agg = _window([{}, {"tier_chunk_queries@0:primary": 10.0, "tier_chunk_hits@1:fs": 2.0,
                        "tier_chunk_queries@1:fs": 4.0},
                   {"tier_chunk_queries@0:primary": 450.0, "tier_chunk_hits@1:fs": 2.0,
                    "tier_chunk_queries@1:fs": 4.0}])
    primary, fs = tier_flows(agg)
    assert primary.tier == "0:primary" and primary.chunk_hit_ratio == 0.0  # old code: None (no hits series)
    assert fs.chunk_hit_ratio == 0.5
    # an engine exporting no hits family at all: unknown, not 0 (and a tier with nothing known is left out)
    assert tier_flows(_window([{}, {"tier_chunk_queries@1:fs": 4.0}, {"tier_chunk_queries@1:fs": 8.0}])) == ()


def test_back_pressure_drops_per_tier_and_second():
    from exporter.derive.offload import tier_flows
    # vLLM counts drops from the first one on (no sample before): 131 blocks in 11 stores born at the 3rd read
    drops = {"tier_dropped_blocks@1:fs": 131.0, "tier_dropped_stores@1:fs": 11.0}
    writes = {"tier_write_bytes@1:fs": 4e6, "tier_write_bytes@2:obj": 1e6}
    agg = _window([writes, writes, {**writes, **drops}, {**writes, **drops}, {**writes, **drops}])
    fs, obj = tier_flows(agg)
    assert fs.dropped_blocks_per_second == 131.0 / 4.0 and fs.dropped_stores_per_second == 11.0 / 4.0
    assert obj.dropped_blocks_per_second == 0.0  # the engine counts drops (the fs tier's show it): none here
    # an engine showing no drop series at all: unknown, not 0
    [quiet] = tier_flows(_window([{"tier_write_bytes@1:fs": 1.0}, {"tier_write_bytes@1:fs": 2.0}]))
    assert quiet.dropped_blocks_per_second is None and quiet.dropped_stores_per_second is None
