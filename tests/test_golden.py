"""Golden end to end (node_exporter style): fixture sequences in, the whole /metrics and /api/status out,
compared with committed files (tests/data/golden/). `UPDATE_GOLDEN=1 pytest tests/test_golden.py` rewrites
them; review the diff like code.

Deterministic: Daemon.step() is driven with Ticks built here at virtual times t = 1, 2, 3 ..., a fixed wall
clock and fixed read durations (kvwatt_sample_duration_seconds is a timing: its statuses are built with a fixed
duration_seconds). Four servers:

- ``cpu``: the real vLLM 0.32 CPU expositions (tests/data/vllm-0.32-cpu/low-pressure, offloading off by its
  cache_config_info), decoded by the vLLM adapter (EngineSource.decode). Down ("unreachable") until the last
  ticks, then its six captures one per tick. No GPU (a CPU engine).
- ``on``: a simulated offloading vLLM 0.33 (tests/support/vllm_sim undersized_buffer_on: no offloading fixture
  of a real engine exists), paired with ``off`` and with model + hardware parameters configured; with one
  secondary tier ``1:fs`` behind the CPU tier (vLLM tiering, 0.28+ series).
- ``off``: its simulated OFF twin, with a configured reference share (potential dE): low pressure
  (low_pressure_off) for its first 45 s, then high pressure (high_pressure_off), so that the threshold located
  from its 10 s evidence windows (methods.md s10) has clean windows below and pressured ones above; exporting
  preemptions by reason (vLLM PR #58037, unreleased), and KV-block residency histograms (--kv-cache-metrics,
  a 5 % sample): low-pressure, then pressure evidence from the engine's own evictions (methods.md s11).
- ``sgl``: SGLang with HiCache under high pressure, with LMCache's and Dynamo KVBM's series beside it, built
  from the engines' own metric definitions (tests/support/engine_expositions.py; none runs without CUDA): the
  figures only other engines have (occupancy, tier hit rates, offload tokens). No GPU.

Energy: DeviceReadings built here with read_at = t: one GPU per simulated server (the paired dE needs GPU
J/token on both sides; the joules are the simulation's own), one RAPL package zone at a constant 80 W. GPU
idle baselines are configured; the RAPL one is a measured baseline written to the state file an hour before
the (fixed) wall clock, so kvwatt_idle_baseline_age_seconds has a value.

Invariants checked besides the bytes: no duplicate (name, labels) sample, every family in exporter.catalog,
every catalog family present (a family that can never be filled fails here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter import __version__, catalog
from exporter.config import from_mapping
from exporter.idle.baseline import BaselineBook, IdleEstimate
from exporter.model import Model
from exporter.runtime.build import build_info
from exporter.runtime.daemon import Daemon
from exporter.runtime.sampler import Sampler
from exporter.samples import DeviceReading, PriceReading, ServerRead, SourceStatus, Tick
from exporter.serve.web import _finite, status_json
from exporter.sources.endpoint import EngineSource
from tests.conftest import FIXTURES
from tests.support import vllm_sim as sim
from tests.support.engine_expositions import Sequence

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
METRICS_FILE, STATUS_FILE = GOLDEN / "metrics.prom", GOLDEN / "status.json"
WALL = 1_750_000_000.0  # the fixed wall clock (unix seconds)
TICKS = 90
LOW = sorted((FIXTURES / "low-pressure").glob("*.prom"))
CPU_FROM = TICKS - len(LOW) + 1  # the cpu server answers from this tick on
HOST_WATTS = 80.0
GPU_IDLE_WATTS = sim.IDLE_WATTS
READ_SECONDS = {"vllm": 0.012, "nvml": 0.003, "rapl": 0.0002, "price": 0.02}  # fixed read durations
LLAMA_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "active_parameters": 8.0e9,
            "hidden_size": 4096}


def config_mapping(tmp_path, urls: dict[str, str] | None = None) -> dict:
    urls = urls or {n: f"http://{n}.invalid:8000" for n in SERVERS}
    return {
        "servers": [
            # the tiny Llama the real captures served: its config.json prices the engine's write traffic per
            # token, so the post-preemption recomputation is measured on the real counters (methods.md s4)
            {"name": "cpu", "url": urls["cpu"], "gpus": [], "model_config": str(FIXTURES / "model" / "config.json")},
            {"name": "on", "url": urls["on"], "gpus": ["GPU-on"], "pair_off_server": "off",
             "model": LLAMA_8B, "hardware": {"gpu_model": "H100-SXM"},
             "offload_tier_bytes": {"1:fs": 2 ** 40}},  # a 1 TiB file-system tier
            {"name": "off", "url": urls["off"], "gpus": ["GPU-off"], "reference_local_compute_share": 0.039,
             "kv_cache_metrics_sample": 0.05},  # the sim's --kv-cache-metrics-sample (ramping_off)
            {"name": "sgl", "url": urls["sgl"], "gpus": []},
        ],
        "windows": ["30s", "1m"], "min_load_duration": "5s", "collapse_reference_window": "30s",
        "threshold_window": "10s",
        "phase_min_windows": 6,  # 5 s repeat windows: the per-phase costs are measured within the 90 s
        "idle_power_watts": {"GPU-on": GPU_IDLE_WATTS, "GPU-off": GPU_IDLE_WATTS},
        "state_dir": str(tmp_path / "state"), "powercap_root": str(tmp_path / "no-powercap"), "nvml": False,
        # money and carbon (docs/energy.md): a configured price, a carbon intensity read from a series URL
        "electricity_price_per_kwh": ELECTRICITY_PRICE, "electricity_currency": "EUR",
        "carbon_intensity_g_per_kwh": CARBON_URL,
        # every family, the opt-in ones too (exporter/rules/optin.py): the golden files cover the whole catalog;
        # tests/test_series_budget.py runs the same scenario with the default (none)
        "metrics_opt_in": ["all"],
    }


ELECTRICITY_PRICE = 0.25  # EUR per kWh
CARBON_URL = 'http://grid.invalid:9100/metrics#grid_carbon_intensity_grams_per_kwh{zone="DE"}'
CARBON_G_PER_KWH = 380.0


SERVERS = ("cpu", "on", "off", "sgl")
# the sgl server: SGLang with HiCache, with LMCache's and Dynamo KVBM's series beside it (their own ports in a
# real deployment, read as sidecars; here one text: the adapters read it the same way, sources/combine.py)
SGL = [Sequence(e, "high-pressure", start_time=WALL - 600) for e in ("sglang", "lmcache", "dynamo")]
GPUS = {"on": ("0", "GPU-on"), "off": ("1", "GPU-off")}  # server -> (index, uuid)
HOST_DEVICE, HOST_LABELS = "rapl:package-0:package", {"zone": "package-0", "domain": "package"}


def write_measured_host_baseline(state_dir: str) -> None:
    """A RAPL baseline measured an hour before the wall clock (what `kvwatt baseline idle` leaves behind)."""
    BaselineBook(state_dir, wall_clock=lambda: WALL - 3600.0).record(
        [IdleEstimate(HOST_DEVICE, 40.0, 60.0, 45.0)], "measured")


def ramping_off() -> sim.Scenario:
    """high_pressure_off preceded by 45 s of low_pressure_off's phase (the same seed and engine).

    With --kv-cache-metrics at a 5 % sample (methods.md s11): under low pressure few evictions, of blocks idle
    well past their reuse gap; under high pressure 0.6 evictions per prompt block, idle under the reuse gap."""
    low, high = sim.low_pressure_off().timeline[0], sim.high_pressure_off()
    low = replace(low, duration_seconds=45.0, kv_evictions_per_prompt_block=0.02, kv_idle_before_evict_seconds=40.0)
    hot = replace(high.timeline[0], kv_evictions_per_prompt_block=0.6, kv_idle_before_evict_seconds=0.4)
    return replace(high, name="ramping_off", timeline=(low, hot, *high.timeline[1:]), kv_cache_metrics_sample=0.05)


class Inputs:
    """What the world looks like at each tick t = 1, 2, ...: each server's /metrics text (None: unreachable),
    each GPU's cumulative energy (J) and power (W), the host zone's cumulative energy (J)."""

    def __init__(self, scenarios: dict[str, sim.Scenario] | None = None, cpu: bool = True, sgl: bool = True):
        # default: "on" also runs vLLM's tiering with a file-system tier behind the CPU one, and "off" (low, then
        # high pressure) is a build with vLLM PR #58037 (preemptions by reason)
        scenarios = scenarios or {"on": replace(sim.undersized_buffer_on(), tiers=("1:fs",)),
                                  "off": replace(ramping_off(), preemption_reasons=True, engines=2)}
        self.sims = {name: sim.SimEngine(scn) for name, scn in scenarios.items()}
        self.cpu = cpu  # the ``cpu`` server's real captures (tests/test_page.py replays other servers alone)
        self.sgl = sgl  # the ``sgl`` server: SGLang with LMCache and Dynamo KVBM sidecars

    def step(self, t: int) -> tuple[dict[str, str | None], dict[str, tuple[float, float]], float]:
        texts: dict[str, str | None] = {}
        if self.cpu:
            texts["cpu"] = None if t < CPU_FROM else LOW[t - CPU_FROM].read_text()
        gpus = {}
        for name, eng in self.sims.items():
            if t > 1:
                eng.advance(1.0)
            texts[name] = eng.render()
            gpus[name] = (round(eng.gpu_energy_joules, 6), round(eng.gpu_power_watts, 6))
        if self.sgl:
            texts["sgl"] = SGL[0].texts(t)[""] + SGL[1].texts(t)["sidecar"] + SGL[2].texts(t)["sidecar"]
        return texts, gpus, HOST_WATTS * (t - 1)


class Scenario:
    """Builds the ticks the Sampler would hand the daemon, from Inputs, with fixed read durations."""

    def __init__(self, tmp_path, mapping: dict | None = None, inputs: Inputs | None = None,
                 gpus: dict[str, tuple[str, str]] | None = None):
        self.cfg = from_mapping(mapping or config_mapping(tmp_path))
        write_measured_host_baseline(self.cfg.state_dir)
        self.inputs = inputs or Inputs()
        self.gpus = GPUS if gpus is None else gpus  # server -> (index, uuid) of the GPU it runs on
        self.adapters = {s.name: EngineSource(s.name, f"http://{s.name}.invalid:8000", 2.0, 1 << 24)
                         for s in self.cfg.servers}

    def tick(self, t: int) -> Tick:
        texts, gpus, host_joules = self.inputs.step(t)
        servers = {}
        for name, text in texts.items():
            src = self.adapters[name]
            if text is None:
                servers[name] = ServerRead(name, SourceStatus(source="vllm", server=name, up=False,
                                                              reason="unreachable",
                                                              duration_seconds=READ_SECONDS["vllm"], state="down"))
                continue
            problems: list[str] = []
            reading = src.decode(text, problems)  # the vLLM adapter, as EngineSource.read runs it
            servers[name] = ServerRead(name, src.status(problems, READ_SECONDS["vllm"]), reading)
        energy = [DeviceReading(device=f"gpu:{uuid}", kind="gpu", labels={"gpu": index, "uuid": uuid},
                                joules_total=gpus[name][0], continuous=True, power_watts=gpus[name][1],
                                method="counter", temperature_celsius=40.0 + int(index), read_at=float(t))
                  for name, (index, uuid) in self.gpus.items()]
        energy.append(DeviceReading(device=HOST_DEVICE, kind="host", labels=dict(HOST_LABELS), joules_total=host_joules,
                                    continuous=t > 1, power_watts=None, method="rapl", read_at=float(t)))
        statuses = (SourceStatus(source="nvml", server="", up=True, reason="", duration_seconds=READ_SECONDS["nvml"],
                                 state="ok"),
                    SourceStatus(source="rapl", server="", up=True, reason="", duration_seconds=READ_SECONDS["rapl"],
                                 state="ok"))
        return Tick(float(t), servers, statuses, tuple(energy), self.prices(t))

    def prices(self, t: int) -> tuple[PriceReading, ...]:
        """The carbon-intensity URL as the sampler hands it over: read at t = 1, then every 60 s."""
        if self.cfg.carbon_intensity is None or self.cfg.carbon_intensity.url is None:
            return ()
        status = SourceStatus(source="carbon_intensity", server="", up=True, reason="",
                              duration_seconds=READ_SECONDS["price"], state="ok")
        return (PriceReading("carbon_intensity", CARBON_G_PER_KWH, float((t - 1) % 60), status),)


def run_scenario(tmp_path, ticks: int = TICKS, on_step=None) -> Daemon:
    """The golden scenario through Daemon.step(); returns the daemon (its published snapshot and bytes)."""
    sc = Scenario(tmp_path)
    daemon = Daemon(sc.cfg, sampler=Sampler(sc.cfg, energy=False), model=Model(sc.cfg, wall_clock=lambda: WALL))
    for t in range(1, ticks + 1):
        daemon.step(sc.tick(t))
        if on_step:
            on_step(t, daemon)
    return daemon


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Parsed with prometheus_client's parser; fails on a duplicate (name, labels) sample."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate sample {s.name}{dict(s.labels)}"
            out[key] = s.value
    return out


def family_names(text: str) -> set[str]:
    """Family names as written on the # TYPE lines (counters keep their _total)."""
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


BUILD_INFO_LINE = re.compile(r'^kvwatt_build_info\{.*\} 1\.0$', re.M)
BUILD_INFO_GOLDEN = ('kvwatt_build_info{python_version="<python_version>",revision="<revision>",'
                     'version="<version>"} 1.0')


def kvwatt_text(exposition: str) -> str:
    """The served exposition's kvwatt_* families, as the golden file holds them: the process' own process_*
    and python_* families (timings, memory) left out, kvwatt_build_info's labels (this checkout's version,
    revision and Python) replaced by placeholders after checking them."""
    kept, keep = [], True
    for line in exposition.splitlines(keepends=True):
        if line.startswith("# HELP "):
            keep = line.split()[2].startswith("kvwatt_")
        if keep:
            kept.append(line)
    text = "".join(kept)
    b = build_info()
    want = (f'kvwatt_build_info{{python_version="{b.python_version}",revision="{b.revision}",'
            f'version="{b.version}"}} 1.0')
    assert BUILD_INFO_LINE.findall(text) == [want], BUILD_INFO_LINE.findall(text)
    return BUILD_INFO_LINE.sub(BUILD_INFO_GOLDEN, text)


def status_text(snapshot) -> str:
    """/api/status as the endpoint writes it, the version replaced by a placeholder (a release is no diff) and the
    checkout's path by ``<fixtures>`` (the model's config.json is named by its path: a clone elsewhere is no diff)."""
    js = _finite(status_json(snapshot))
    assert js["version"] == __version__
    js["version"] = "<version>"
    return json.dumps(js, indent=2).replace(json.dumps(str(FIXTURES))[1:-1], "<fixtures>") + "\n"


def _compare(path: Path, got: str) -> None:
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
        return
    assert path.exists(), f"{path} missing: run UPDATE_GOLDEN=1 pytest {__file__}"
    want = path.read_text()
    if got != want:
        import difflib
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), str(path), "got", n=1))
        pytest.fail(f"{path.name} differs from the golden file (UPDATE_GOLDEN=1 rewrites it):\n{diff[:20000]}")


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    daemon = run_scenario(tmp_path_factory.mktemp("golden"))
    return kvwatt_text(daemon.published.exposition.decode()), daemon.snapshot


def test_metrics_match_the_golden_file(golden):
    text, _ = golden
    _compare(METRICS_FILE, text)


def test_status_matches_the_golden_file(golden):
    _, snap = golden
    _compare(STATUS_FILE, status_text(snap))


def test_no_duplicate_sample_and_every_family_in_the_catalog(golden):
    text, _ = golden
    smp = samples(text)
    assert smp
    names = family_names(text)
    assert names <= set(catalog.BY_NAME), names - set(catalog.BY_NAME)
    for name, _labels in smp:
        assert name in catalog.BY_NAME, name
    for name, labels in smp:  # each sample carries exactly its definition's labels
        assert {k for k, _ in labels} == set(catalog.BY_NAME[name].labels), (name, dict(labels))


def test_every_catalog_family_appears(golden):
    """The scenario is rich enough for every family: one that never appears can never be filled (or the
    scenario lost a feature: add it rather than dropping the family from this check)."""
    text, _ = golden
    missing = [m.name for m in catalog.METRICS if m.name not in family_names(text)]
    assert not missing, f"families with no sample in the golden scenario: {missing}"


def test_golden_scenario_figures(golden):
    """A few figures the golden bytes must carry, stated by meaning (so an UPDATE_GOLDEN cannot bless them
    wrong silently)."""
    text, snap = golden
    smp = samples(text)

    def v(name, **labels):
        hits = [val for (n, lab), val in smp.items() if n == name and set(labels.items()) <= lab]
        assert len(hits) <= 1, (name, labels)
        return hits[0] if hits else None

    assert v("kvwatt_source_up", source="vllm", server="cpu") == 1
    assert v("kvwatt_sample_duration_seconds", source="vllm", server="cpu") == READ_SECONDS["vllm"]
    assert v("kvwatt_offload_enabled", server="cpu") == 0 and v("kvwatt_offload_enabled", server="on") == 1
    assert v("kvwatt_host_energy_joules_total", zone="package-0") == HOST_WATTS * (TICKS - 1)
    assert v("kvwatt_idle_baseline_age_seconds", device="rapl:package-0:package") == 3600.0
    assert v("kvwatt_gpu_idle_power_watts", uuid="GPU-on") == GPU_IDLE_WATTS
    # the cpu server: its five intervals of real counters (the captures' own deltas, as in test_daemon.py)
    covered = v("kvwatt_window_covered_seconds", server="cpu", window="1m")
    assert covered == len(LOW) - 1
    # OFF server: potential only; ON server: paired (with dTPS), estimated; never potential
    assert {dict(lab)["baseline"] for (n, lab) in smp if n == "kvwatt_energy_saving_ratio"
            and ("server", "off") in lab} == {"potential"}
    assert {dict(lab)["baseline"] for (n, lab) in smp if n == "kvwatt_energy_saving_ratio"
            and ("server", "on") in lab} == {"paired", "estimated"}
    assert v("kvwatt_throughput_gain_ratio", server="on", baseline="paired", window="1m") is not None
    assert v("kvwatt_offload_buffer_undersized", server="on") == 1
    js = status_json(snap)
    assert [s["server"] for s in js["servers"]] == ["cpu", "on", "off", "sgl"]
    # engines and their add-ons detected from the expositions; figures only where the engine has the series
    assert v("kvwatt_server_info", server="on", engine="vllm") == 1
    assert v("kvwatt_server_info", server="sgl", engine="sglang+lmcache+dynamo", offload_backend="hicache") == 1
    assert v("kvwatt_server_capability", server="sgl", capability="offload_occupancy") == 1
    assert v("kvwatt_server_capability", server="on", capability="offload_occupancy") is None
    assert v("kvwatt_offload_buffer_used_ratio", server="sgl") == 0.92
    assert v("kvwatt_offload_buffer_used_ratio", server="on") is None  # vLLM exports no occupancy
    assert v("kvwatt_offload_tier_hit_ratio", server="sgl", tier="host") == 0.85
    assert v("kvwatt_offload_write_tokens_per_second", server="sgl", window="1m") == pytest.approx(400.0)


@pytest.mark.prom
def test_promtool_accepts_the_golden_exposition(golden):
    text, _ = golden
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/install-deps.sh installs Debian's prometheus"
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr
