"""End to end: simulated vLLM 0.33 servers (tests/support/loopback.py) replayed on loopback to a real
`kvwatt run` subprocess, the NVML double driven by the scenario's GPU power.

The fake runs ``TIME_SCALE`` x faster than the wall clock; the daemon's windows are in wall seconds, so a
10 s window covers 60 simulated seconds. GPU energy is scaled back to the wall clock (FakeVllm.attach_gpu),
so the daemon sees the scenario's watts and P_idle ratios hold.
"""

from __future__ import annotations

import time

import pytest

from tests.support import vllm_sim as sim
from tests.support.daemon import KvwattDaemon, pick
from tests.support.fake_gpus import FakeGpus
from tests.support.loopback import FakeVllm

TIME_SCALE = 6.0


def _config(gpus_uuid: str) -> dict:
    # power ratio 1.4, not the default 1.25: the scenario's stall (180 W over 150 W idle) sits 4 % under the
    # default threshold, and the NVML double's energy advances in 50 ms file updates subject to thread
    # scheduling on a loaded 2-core runner, which moves a 10 s window's mean power by a few percent. The
    # threshold edges are unit-tested (test_offload_collapse.py); this test checks wiring and timing.
    return {"windows": ["10s", "30s"], "collapse_reference_window": "40s", "min_load_duration": "5s",
            "idle_power_watts": {gpus_uuid: sim.IDLE_WATTS}, "collapse_power_near_idle_ratio": 1.4}


@pytest.mark.slow
def test_collapse_signature_only_during_the_collapse_phase(tmp_path):
    # wall seconds: steady 0-30, collapse 30-60, recovered after 60
    scn = sim.recovering_on(steady_seconds=30 * TIME_SCALE, collapse_seconds=30 * TIME_SCALE)
    gpus = FakeGpus(tmp_path / "gpus.json")
    with FakeVllm(scn, time_scale=TIME_SCALE) as fv:
        fv.attach_gpu(gpus, "GPU-on")
        with KvwattDaemon(servers={"on": fv.url}, config=_config("GPU-on"), env=gpus.env(),
                          interval="200ms") as d:
            seen = []
            start = time.monotonic()
            while time.monotonic() - start < 80:
                phase, sig = fv.phase, d.value("kvwatt_collapse_signature", server="on")
                col = [s for s in d.status()["servers"] if s["server"] == "on"][0].get("collapse", {})
                watts = col.get("gpu_power_watts")
                seen.append((round(fv.sim_seconds / TIME_SCALE, 1), phase, sig,
                             None if watts is None else round(watts, 1), col.get("reason")))
                if sig == 1:
                    assert phase == "collapse" or (phase == "recovered" and
                                                   fv.sim_seconds / TIME_SCALE < 60 + 5), seen[-5:]
                time.sleep(1.0)
            m = d.metrics()
            names = {n for n, _ in m}
    in_collapse = [x for x in seen if x[1] == "collapse" and x[0] >= 30 + 15]
    watts = [x[3] for x in in_collapse if x[3] is not None]
    print(f"settled collapse: mean GPU power over the 10 s window {min(watts, default=None)}-"
          f"{max(watts, default=None)} W (threshold {1.4 * sim.IDLE_WATTS:.0f} W)")
    assert in_collapse and all(x[2] == 1 for x in in_collapse), in_collapse
    assert all(x[2] != 1 for x in seen if x[1] == "steady"), seen
    assert all(x[2] == 0 for x in seen if x[0] >= 60 + 5), [x for x in seen if x[0] >= 60 + 5]
    for name in ("kvwatt_collapse_condition", "kvwatt_offload_write_bytes_per_second",
                 "kvwatt_offload_buffer_residency_seconds", "kvwatt_cached_to_prefill_ratio",
                 "kvwatt_offload_buffer_undersized", "kvwatt_energy_saving_ratio"):
        assert name in names, name


@pytest.mark.slow  # real time: ~20 s for the 30 s window's rate to settle
def test_undersized_buffer_and_offload_series(tmp_path):
    gpus = FakeGpus(tmp_path / "gpus.json")
    with FakeVllm(sim.undersized_buffer_on(), time_scale=1.0) as fv:
        fv.attach_gpu(gpus, "GPU-on")
        with KvwattDaemon(servers={"on": fv.url}, config=_config("GPU-on"), env=gpus.env(),
                          interval="250ms") as d:
            d.wait_for(lambda d: d.value("kvwatt_offload_buffer_undersized", server="on") == 1, timeout=30,
                       what="undersized buffer")
            st = [s for s in d.status()["servers"] if s["server"] == "on"][0]
            assert any("--kv-offloading-size" in r for r in st["recommendations"])
            # unknown (absent) until the throughput reference exists, then denied: preemptions are alive
            d.wait_for(lambda d: d.value("kvwatt_collapse_signature", server="on") == 0, timeout=30,
                       what="collapse signature denied")
            # the rates from one scrape once the 30 s window covers 20 s: a scrape's latency on a starved runner
            # (a window's ends are tick starts, the counters are read when the fake answers) moved the rate of
            # a 10 s window covering a few seconds by 6 % in CI; over 20 s the same skew is ~1 %
            d.wait_for(lambda d: d.value("kvwatt_window_covered_seconds", server="on", window="30s") >= 20,
                       what="20 s in the 30 s window")
            scrape = d.metrics()
            rate = pick(scrape, "kvwatt_offload_write_bytes_per_second", server="on", window="30s")
            assert rate == pytest.approx(0.9 * 2 ** 30, rel=0.05)
            assert pick(scrape, "kvwatt_offload_buffer_residency_seconds", server="on", window="30s") == \
                pytest.approx(8 * 2 ** 30 / rate)
            # the advice sizes for the fastest window's writes over the p99 tool latency (20 s), x1.5 headroom
            fastest = max(pick(scrape, "kvwatt_offload_write_bytes_per_second", server="on", window=w)
                          for w in ("10s", "30s"))
            assert pick(scrape, "kvwatt_offload_recommended_buffer_bytes", server="on") == \
                pytest.approx(fastest * 20 * 1.5)
