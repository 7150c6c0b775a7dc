"""Exposition values end to end (hardening issue items 5, 6, 11a): real vLLM expositions with single values,
lines and labels mutated, pushed in sequences through the real decode path (EngineSource.decode, the vLLM
adapter), the real Model, the collector and /api/status, as tests/test_golden.py pushes its fixtures.

Whatever a server writes: no exception; every exported value finite or absent; rates >= 0; ratios, shares
and quantiles within [0, 1]; /api/status strict JSON; /metrics parseable by prometheus_client with no
duplicate sample. The fuzz runs in CI: a fixed seed, a few thousand mutated expositions, well under 20 s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter import catalog
from exporter.config import from_mapping
from exporter.model import Model
from exporter.samples import DeviceReading, ServerRead, SourceStatus, Tick
from exporter.serve.collector import render
from exporter.serve.web import status_json
from exporter.sources.endpoint import EngineSource
from exporter.sources.engine import SourceError
from exporter.sources.vllm import NEEDED_FAMILIES
from tests.conftest import FIXTURES
from tests.support.expositions import data_parallel, offset_counters

LOW = [p.read_text() for p in sorted((FIXTURES / "low-pressure").glob("*.prom"))]
IDLE = (FIXTURES / "idle" / "000.prom").read_text()
SEED = 20261123
SEQUENCES = 500  # x len(LOW) ticks: 3,000 expositions, each decoded, ingested, rendered and checked
WALL = 1.75e9

# every family, by what its values may be (a new family must be placed here: the fuzz then covers it)
UNIT = {"kvwatt_kv_cache_usage_p95_ratio", "kvwatt_kv_cache_usage_max_ratio", "kvwatt_prompt_token_share_ratio",
        "kvwatt_recompute_reference_share_ratio", "kvwatt_kv_pressure_threshold_ratio",
        "kvwatt_cached_prompt_token_share_ratio", "kvwatt_preempted_requests_ratio",
        "kvwatt_offload_tier_chunk_hit_ratio", "kvwatt_offload_buffer_used_ratio", "kvwatt_offload_tier_hit_ratio",
        "kvwatt_kv_cache_usage_p95_lower_ratio", "kvwatt_kv_cache_usage_p95_upper_ratio",
        "kvwatt_kv_pressure_threshold_located_ratio", "kvwatt_kv_pressure_threshold_located_low_ratio",
        "kvwatt_kv_pressure_threshold_located_high_ratio", "kvwatt_kv_pressure_threshold_in_use_ratio",
        "kvwatt_kv_block_evicted_before_reuse_ratio", "kvwatt_requests_waiting_for_kv_capacity_samples_ratio",
        "kvwatt_preemption_recompute_share_ratio"}
BOOLEAN = {"kvwatt_source_up", "kvwatt_kv_pressure_regime_above", "kvwatt_kv_pressure_above_threshold",
           "kvwatt_preemption_onset",
           "kvwatt_offload_enabled", "kvwatt_offload_buffer_undersized", "kvwatt_collapse_signature",
           "kvwatt_collapse_condition", "kvwatt_collapse_condition_set", "kvwatt_offload_tier_undersized",
           "kvwatt_kv_block_residency_pressure_evidence", "kvwatt_kv_pressure_regime_state", "kvwatt_verdict_state"}
INFO = {"kvwatt_source_info", "kvwatt_server_info", "kvwatt_gpu_energy_method_info", "kvwatt_build_info",
        "kvwatt_server_capability", "kvwatt_phase_cost_source"}
NON_NEGATIVE = {"kvwatt_sample_duration_seconds", "kvwatt_window_covered_seconds", "kvwatt_window_age_seconds",
                "kvwatt_gpu_energy_joules_total",
                "kvwatt_gpu_power_watts", "kvwatt_host_energy_joules_total", "kvwatt_gpu_idle_power_watts",
                "kvwatt_host_idle_power_watts", "kvwatt_idle_baseline_age_seconds", "kvwatt_energy_per_token_joules",
                "kvwatt_preemptions_per_minute", "kvwatt_generation_tokens_per_second",
                "kvwatt_preemption_recompute_watts", "kvwatt_preemption_recompute_tokens_per_second",
                "kvwatt_estimated_flops_per_second", "kvwatt_estimated_flops_per_generated_token",
                "kvwatt_offload_buffer_bytes", "kvwatt_kv_capacity_tokens", "kvwatt_offload_write_bytes_per_second",
                "kvwatt_offload_read_bytes_per_second", "kvwatt_offload_buffer_residency_seconds",
                "kvwatt_offload_recommended_buffer_bytes", "kvwatt_comparison_windows",
                "kvwatt_cached_to_prefill_ratio", "kvwatt_critical_cached_to_prefill_ratio",
                "kvwatt_recompute_breakeven_tokens", "kvwatt_prompt_energy_per_token_joules",
                "kvwatt_preemptions_per_request", "kvwatt_admission_rejections_per_minute",
                "kvwatt_offload_tier_write_bytes_per_second", "kvwatt_offload_tier_read_bytes_per_second",
                "kvwatt_offload_tier_job_failures", "kvwatt_requests_in_kv_fetch",
                "kvwatt_offload_tier_dropped_stores_per_second", "kvwatt_offload_tier_dropped_blocks_per_second",
                "kvwatt_requests_waiting_for_kv_capacity",
                # issue 41: the tiers' failures, counts and hop energy (a tier's net saving and the second tier's dE
                # may be negative: SIGNED)
                "kvwatt_offload_tier_failed_promotions_per_second", "kvwatt_offload_tier_failed_cascades_per_second",
                "kvwatt_offload_tier_reload_joules_per_token", "kvwatt_offload_tier_breakeven_ratio",
                "kvwatt_offload_tier_cached_to_prefill_ratio", "kvwatt_offload_tier_reload_watts",
                # issue 41 item 2: each tier's transfer times and kappa_crit
                "kvwatt_offload_tier_read_bandwidth_bytes_per_second",
                "kvwatt_offload_tier_write_bandwidth_bytes_per_second",
                "kvwatt_offload_tier_read_seconds_per_second", "kvwatt_offload_tier_write_seconds_per_second",
                "kvwatt_offload_tier_critical_cached_to_prefill_ratio", "kvwatt_offload_tier_lookup_seconds",
                "kvwatt_offload_tier_lookup_wait_seconds",
                "kvwatt_preemptions_by_reason_per_minute", "kvwatt_offload_tier_residency_seconds",
                "kvwatt_offload_write_tokens_per_second", "kvwatt_offload_read_tokens_per_second",
                "kvwatt_offload_buffer_used_bytes",
                "kvwatt_kv_pressure_threshold_located_windows", "kvwatt_recompute_reference_windows",
                "kvwatt_kv_block_evictions_per_second", "kvwatt_kv_block_evictions_per_prompt_block_ratio",
                "kvwatt_kv_block_idle_before_evict_seconds", "kvwatt_kv_block_reuse_gap_seconds",
                "kvwatt_offload_buffer_residency_target_seconds", "kvwatt_kv_pools_above_threshold",
                # money and carbon: the configured or read price and intensity are refused below 0
                "kvwatt_electricity_price_per_kwh", "kvwatt_carbon_intensity_grams_per_kwh",
                "kvwatt_price_age_seconds",
                "kvwatt_phase_joules_per_token", "kvwatt_phase_joules_per_token_stderr", "kvwatt_phase_cost_windows",
                "kvwatt_recompute_tax_watts", "kvwatt_recompute_energy_share_ratio",
                "kvwatt_recompute_tax_cost_per_day", "kvwatt_recompute_tax_co2e_grams_per_day",
                "kvwatt_figures_rejected_total"}
# differences and stale-baseline figures: any finite sign (marginal J/token < 0 when P_idle is stale)
SIGNED = {"kvwatt_offload_tier_saved_watts", "kvwatt_offload_second_tier_energy_saving_ratio",
          "kvwatt_marginal_energy_per_token_joules", "kvwatt_recompute_tax_ratio", "kvwatt_energy_saving_ratio",
          "kvwatt_energy_saving_stderr_ratio", "kvwatt_throughput_gain_ratio",
          "kvwatt_throughput_gain_stderr_ratio",
          # money and carbon of the marginal energy: negative with it (a stale P_idle)
          "kvwatt_energy_cost_per_million_tokens", "kvwatt_co2e_grams_per_thousand_tokens",
          "kvwatt_marginal_energy_cost_per_day", "kvwatt_marginal_co2e_grams_per_day",
          "kvwatt_offload_saved_watts", "kvwatt_offload_saved_cost_per_day",
          "kvwatt_offload_saved_co2e_grams_per_day"}  # negative when a measured reload costs more than recomputing

BAD_VALUES = ["-1", "-0.5", "1.7", "-1e308", "1e308", "6e29", "1e400", "NaN", "+Inf", "-Inf", "", "abc",
              "\x00\xff\ufffd", "0x10", "1 2 3", "-0", "5e-324", "1e-300", "0.5", "2", "1e29"]
BAD_LABEL_VALUES = ["-32", "0", "inf", "-inf", "NaN", "1e308", "-8", "", "abc", "8"]


def test_every_family_is_classified():
    assert UNIT | BOOLEAN | INFO | NON_NEGATIVE | SIGNED == set(catalog.BY_NAME)
    assert len(UNIT) + len(BOOLEAN) + len(INFO) + len(NON_NEGATIVE) + len(SIGNED) == len(catalog.BY_NAME)


# --- mutations of one exposition --------------------------------------------------------------------------
def _sample_lines(lines: list[str], needed_only: bool) -> list[int]:
    names = NEEDED_FAMILIES if needed_only else None
    return [i for i, ln in enumerate(lines) if ln.startswith("vllm:")
            and (names is None or ln.split("{", 1)[0].split(" ", 1)[0] in names)]


def _series(line: str) -> str:
    """A sample line without its value (the whole line when it has no blank: an earlier mutation broke it)."""
    return line.rsplit(" ", 1)[0]


def _set_value(rng: random.Random, lines: list[str]) -> None:
    i = rng.choice(_sample_lines(lines, needed_only=rng.random() < 0.8))
    lines[i] = _series(lines[i]) + " " + rng.choice(BAD_VALUES)


def _duplicate_line(rng: random.Random, lines: list[str]) -> None:
    i = rng.choice(_sample_lines(lines, needed_only=True))
    lines.insert(i + rng.choice([0, 1, 5]), _series(lines[i]) + " " + rng.choice(["7", "-7", "NaN"]))


def _drop_line(rng: random.Random, lines: list[str]) -> None:
    del lines[rng.choice(_sample_lines(lines, needed_only=True))]


def _tabs(rng: random.Random, lines: list[str]) -> None:
    for i in rng.sample(_sample_lines(lines, needed_only=True), 5):
        value = lines[i].rsplit(" ", 1)[-1]
        lines[i] = _series(lines[i]) + rng.choice(["\t", " \t", "\t\t"]) + value


def _garbage(rng: random.Random, lines: list[str]) -> None:
    i = rng.randrange(len(lines))
    lines[i] = rng.choice([lines[i][: rng.randrange(len(lines[i]) + 1)], "\x00\x01\ufffd", "vllm:", "}{",
                           lines[i].replace('"', "", 1), lines[i] + " 1 2"])


def _engine_label(rng: random.Random, lines: list[str]) -> None:
    new = rng.choice(['engine="1"', 'engine="2"', 'engine=""', 'engine="0",engine="1"'])
    for i in rng.sample(_sample_lines(lines, needed_only=True), rng.choice([1, 3, 10])):
        lines[i] = lines[i].replace('engine="0"', new)


def _cache_config(rng: random.Random, lines: list[str]) -> None:
    i = rng.choice([i for i, ln in enumerate(lines) if ln.startswith("vllm:cache_config_info{")])
    field = rng.choice(["block_size", "num_gpu_blocks", "kv_offloading_size"])
    start = lines[i].index(f'{field}="') + len(field) + 2
    lines[i] = lines[i][:start] + rng.choice(BAD_LABEL_VALUES) + lines[i][lines[i].index('"', start):]


def _offload_config(rng: random.Random, lines: list[str]) -> None:
    lines.append(f'vllm:kv_offload_config_info{{engine="0",cpu_kv_cache_size_bytes="{rng.choice(BAD_LABEL_VALUES)}"}}'
                 f' 1.0')


MUTATIONS = (_set_value, _set_value, _set_value, _duplicate_line, _drop_line, _tabs, _garbage, _engine_label,
             _cache_config, _offload_config)


def mutate(rng: random.Random, text: str) -> str:
    lines = text.split("\n")
    for _ in range(rng.choice([1, 1, 2, 3])):
        rng.choice(MUTATIONS)(rng, lines)
    return "\n".join(lines)


# --- a fuzzed server: one sequence of the real captures -----------------------------------------------------
@dataclass
class Shape:
    """How one sequence's clean expositions look: data-parallel, long-running, offloading."""

    dp: bool
    served_before: float
    offload: bool

    def clean(self, i: int, rng: random.Random) -> str:
        text = offset_counters(LOW[i], self.served_before) if self.served_before else LOW[i]
        if self.offload:  # an offloading engine: a buffer and a store counter that climbs
            text = text.replace('kv_offloading_size="None"', 'kv_offloading_size="8"')
            text += f'\nvllm:kv_offload_store_bytes_total{{engine="0",model_name="tiny"}} {i * 3e9!r}\n'
        if self.dp:
            other = rng.choice([LOW[i], LOW[max(i - 1, 0)], IDLE, None])  # engine 1 flaps, restarts, vanishes
            text = data_parallel(text, other)
        return text


def config(tmp_path):
    return from_mapping({
        "servers": [{"name": "s", "url": "http://s.invalid:8000", "gpus": ["GPU-0"],
                     "reference_local_compute_share": 0.039,
                     "model": {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2,
                               "active_parameters": 8.0e9, "hidden_size": 4096},
                     "hardware": {"gpu_model": "H100-SXM"}}],
        "windows": ["2s", "1m"], "min_load_duration": "1s", "collapse_reference_window": "4s",
        "idle_power_watts": {"GPU-0": 60.0}, "state_dir": str(tmp_path / "state"),
        "powercap_root": str(tmp_path / "no-powercap"), "nvml": False})


def gpu(t: float) -> DeviceReading:
    return DeviceReading(device="gpu:GPU-0", kind="gpu", labels={"gpu": "0", "uuid": "GPU-0"}, joules_total=300.0 * t,
                         continuous=True, power_watts=300.0, method="counter", temperature_celsius=40.0, read_at=t)


def check_metrics(text: str, tag: str) -> None:
    seen = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in seen, f"{tag}: duplicate sample {key}"
            seen.add(key)
            v, name = s.value, s.name
            assert math.isfinite(v) or (name == UNBOUNDED and v == math.inf), f"{tag}: {name}{s.labels} = {v}"
            if name in UNIT:
                assert 0.0 <= v <= 1.0, f"{tag}: {name}{s.labels} = {v} outside [0, 1]"
            elif name in BOOLEAN or name in INFO:
                assert v in (0.0, 1.0), f"{tag}: {name}{s.labels} = {v}"
            elif name in NON_NEGATIVE:
                assert v >= 0.0, f"{tag}: {name}{s.labels} = {v} negative"
            else:
                assert name in SIGNED, f"{tag}: {name} not in the catalog"


# The one documented infinity (derive/kappa.py observed, methods.md s7): prompt tokens were loaded and none
# computed, kappa is unbounded; Prometheus carries +Inf, /api/status null. No out-of-range input gives it.
UNBOUNDED = "kvwatt_cached_to_prefill_ratio"


def non_finite(x, path: str = "snapshot"):
    """Paths of the NaN or infinite floats anywhere in the typed figures (dataclasses, dicts, tuples)."""
    if isinstance(x, float):
        ok = math.isfinite(x) or (x == math.inf and path.endswith(".cached_to_prefill_ratio"))
        return [] if ok else [f"{path} = {x}"]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [p for f in dataclasses.fields(x) for p in non_finite(getattr(x, f.name), f"{path}.{f.name}")]
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in non_finite(v, f"{path}[{k!r}]")]
    if isinstance(x, (list, tuple)):
        return [p for i, v in enumerate(x) for p in non_finite(v, f"{path}[{i}]")]
    return []


def _no_constant(name: str):
    raise AssertionError(f"/api/status holds {name}: not JSON")


def check_status(snap, tag: str) -> None:
    text = json.dumps(status_json(snap), allow_nan=False)
    js = json.loads(text, parse_constant=_no_constant)
    for server in js["servers"]:
        for w in server["windows"].values():
            for key in ("kv_usage_p95", "kv_usage_max"):
                assert w[key] is None or 0.0 <= w[key] <= 1.0, f"{tag}: {key} = {w[key]}"
            for key in ("generation_tokens_per_second", "preemptions_per_minute",
                        "offload_write_bytes_per_second"):
                assert w[key] is None or w[key] >= 0.0, f"{tag}: {key} = {w[key]}"
            for share in (w["prompt_token_shares"] or {}).values():
                assert 0.0 <= share <= 1.0, f"{tag}: share {share}"


def run_sequence(seq: int, tmp_path) -> int:
    """One server through the six captures, most of them mutated; checks after every tick. Returns the
    number of expositions refused as out of range (the status said so)."""
    rng = random.Random(SEED * 1000 + seq)
    shape = Shape(dp=rng.random() < 0.4, served_before=rng.choice([0.0, 0.0, 1e7, 1e12]), offload=rng.random() < 0.4)
    model = Model(config(tmp_path), wall_clock=lambda: WALL)
    src = EngineSource("s", "http://s.invalid:8000", 2.0, 1 << 24)
    refused = 0
    for i in range(len(LOW)):
        tag = f"sequence {seq} tick {i}"
        text = shape.clean(i, rng)
        if rng.random() < 0.7:
            text = mutate(rng, text)
        problems: list[str] = []
        try:
            reading = src.decode(text, problems)
            status = src.status(problems, 0.01)
        except SourceError as e:
            reading, status = None, src.down(e, 0.01)
        if reading is not None and reading.rejected:
            assert "out_of_range" in status.reason.split("; "), f"{tag}: {status}"
            refused += 1
        t = float(i + 1)
        model.ingest(Tick(t, {"s": ServerRead("s", status, reading)},
                          (SourceStatus(source="nvml", server="", up=True, reason="", duration_seconds=0.003,
                                        state="ok"),), (gpu(t),)))
        snap = model.snapshot()
        assert not non_finite(snap.servers), f"{tag}: {non_finite(snap.servers)}"  # the figures, not only the output
        check_metrics(render(snap).decode(), tag)
        check_status(snap, tag)
    return refused


@pytest.mark.slow
def test_fuzzed_real_expositions_give_finite_bounded_figures_and_strict_json(tmp_path):
    refused = sum(run_sequence(seq, tmp_path) for seq in range(SEQUENCES))
    assert refused > 100  # the mutations do reach the range checks (not all swallowed as parse errors)


@pytest.mark.parametrize("seq", [0, 1, 2])
def test_a_sequence_is_reproducible(seq, tmp_path):
    assert run_sequence(seq, tmp_path) == run_sequence(seq, tmp_path)


# --- the cases, one by one (each failed before the range checks) -----------------------------------
GEN = 'vllm:generation_tokens_total{engine="0",model_name="tiny"} '
PREEMPT = 'vllm:num_preemptions_total{engine="0",model_name="tiny"} '
KV = 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} '


def _replace_value(text: str, prefix: str, value: str) -> str:
    (line,) = [ln for ln in text.split("\n") if ln.startswith(prefix)]
    return text.replace(line, prefix + value)


def run_texts(texts: list[str], tmp_path):
    """The texts as one server's reads at t = 1, 2, ...: the statuses and the snapshot after each tick."""
    model = Model(config(tmp_path), wall_clock=lambda: WALL)
    src = EngineSource("s", "http://s.invalid:8000", 2.0, 1 << 24)
    out = []
    for i, text in enumerate(texts):
        problems: list[str] = []
        reading = src.decode(text, problems)
        status = src.status(problems, 0.01)
        t = float(i + 1)
        model.ingest(Tick(t, {"s": ServerRead("s", status, reading)}, (), (gpu(t),)))
        out.append((status, model.snapshot()))
    return out


@pytest.mark.parametrize("case", ["negative_counter", "negative_preemptions", "kv_usage_1.7", "kv_usage_-0.5",
                                  "sum_overflows", "tiny_token_step"])
def test_out_of_range_values_never_reach_the_figures(case, tmp_path):
    texts = list(LOW)
    bad = 3  # the capture that is mutated
    if case == "negative_counter":
        texts[bad] = _replace_value(texts[bad], GEN, "-5")
    elif case == "negative_preemptions":
        texts[bad] = _replace_value(texts[bad], PREEMPT, "-3")
    elif case.startswith("kv_usage"):
        texts = [_replace_value(t, KV, case.split("_")[-1]) for t in texts]
    elif case == "sum_overflows":  # two engines' finite counters whose sum is +Inf
        texts[bad] = data_parallel(_replace_value(texts[bad], GEN, "1e308"), _replace_value(texts[bad], GEN, "1e308"))
    else:  # a counter step far below one token: J/token and FLOPs/token would be +Inf
        texts[1] = _replace_value(texts[1], GEN, "5e-324")
    results = run_texts(texts, tmp_path)
    for i, (status, snap) in enumerate(results):
        assert not non_finite(snap.servers), f"tick {i}: {non_finite(snap.servers)}"
        check_metrics(render(snap).decode(), f"tick {i}")
        check_status(snap, f"tick {i}")
        for w in snap.servers[0].windows:
            # the captures never pass 0.9 KV usage: an "above" never rests on the threshold's prediction (a cold
            # prefix cache's tax against the configured reference is a sign of its own, methods.md s10)
            assert not w.regime_reason.startswith("above (predicted)"), w.regime_reason
            assert w.generation_tokens_per_second is None or w.generation_tokens_per_second >= 0
            assert w.preemptions_per_minute in (None, 0.0)  # no preemption in the captures
        refused = case != "tiny_token_step" and (case.startswith("kv_usage") or i == bad)
        assert status.reason == ("out_of_range" if refused else ""), (i, status)


def test_a_window_stat_of_less_than_one_token_has_no_joules_per_token():
    from exporter.derive.economics import WindowStat
    w = WindowStat(t0=0.0, t1=1.0, covered_seconds=1.0, generated_tokens=5e-324, joules=240.0, kv_p95=None,
                   computed_prompt_tokens=None, loaded_prompt_tokens=None, loaded=True)
    assert w.joules_per_token is None
    assert WindowStat(t0=0.0, t1=1.0, covered_seconds=1.0, generated_tokens=2.0, joules=240.0, kv_p95=None,
                      computed_prompt_tokens=None, loaded_prompt_tokens=None, loaded=True).joules_per_token == 120.0
