"""exporter.catalog's "computed in" is proven: for each MetricDef, each function its ``wheres`` name (under
``exporter.``) is wrapped by a spy, the golden scenario (tests/test_golden.py) runs through the real pipeline
-- config.resolve on a YAML file, the real Sampler reading the servers over loopback HTTP, the NVML double
and a powercap tree, Daemon.step -- and the test asserts that the spy was called in the phase that computes
the series (per tick, or at start-up for configuration constants) and that the family has samples.

A function imported by name into another module is patched there too (every exporter module binding the same
object), so a call through either name is seen. A ``where`` naming something that does not exist, or a
function the pipeline never calls, fails here: fix the catalog (or the code), never this test.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import sys
import threading

import pytest
import yaml

import exporter.config as config_module
from exporter import catalog
from exporter.model import Model
from exporter.runtime.daemon import Daemon
from exporter.runtime.sampler import Sampler
from exporter.serve.collector import families
from exporter.sources.nvml import NvmlSource
from exporter.sources.rapl import RaplSource
from tests import test_golden as golden
from tests.support.fake_gpus import FakeGpus, load_fake_nvml
from tests.support.loopback import MetricsServer
from tests.support.powercap import PowercapTree

# families whose value is fixed by the configuration: computed once at start-up (config load, model setup),
# not per tick
STARTUP = {"kvwatt_kv_pressure_threshold_ratio", "kvwatt_critical_cached_to_prefill_ratio",
           "kvwatt_recompute_breakeven_tokens"}


# --- resolving and spying on a `where` --------------------------------------------------------------------
def resolve_where(where: str):
    """'derive.pressure.kv_usage_quantile' -> (module, owner, attribute name): the longest importable module
    prefix under exporter., then attributes (a class, then its method)."""
    parts = where.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module("exporter." + ".".join(parts[:i]))
        except ImportError:
            continue
        owner = module
        for name in parts[i:-1]:
            owner = getattr(owner, name)
        if not hasattr(owner, parts[-1]):
            raise AttributeError(f"{where}: {owner!r} has no attribute {parts[-1]!r}")
        return module, owner, parts[-1]
    raise ImportError(f"{where}: no module under exporter.")


class Spy:
    """Counts calls per phase; thread-safe (NVML and RAPL are read in worker threads)."""

    def __init__(self, where: str):
        self.where = where
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def hit(self) -> None:
        with self.lock:
            self.calls[PHASE[0]] = self.calls.get(PHASE[0], 0) + 1


PHASE = ["import"]


def _wrap(fn, spy: Spy):
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def aw(*a, **k):
            spy.hit()
            return await fn(*a, **k)
        return aw

    @functools.wraps(fn)
    def w(*a, **k):
        spy.hit()
        return fn(*a, **k)
    return w


def install(monkeypatch, where: str, spies: dict[str, Spy]) -> Spy:
    if where in spies:
        return spies[where]
    spy = spies[where] = Spy(where)
    module, owner, name = resolve_where(where)
    if inspect.isclass(owner):
        static = inspect.getattr_static(owner, name)
        if isinstance(static, property):
            monkeypatch.setattr(owner, name, property(_wrap(static.fget, spy)))
        elif isinstance(static, staticmethod):
            monkeypatch.setattr(owner, name, staticmethod(_wrap(static.__func__, spy)))
        elif isinstance(static, classmethod):
            monkeypatch.setattr(owner, name, classmethod(_wrap(static.__func__, spy)))
        else:
            monkeypatch.setattr(owner, name, _wrap(static, spy))
        return spy
    original = getattr(owner, name)
    wrapped = _wrap(original, spy)
    # patch it where it is looked up: every exporter module that binds the same object (imported by name)
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "exporter" or mod_name.startswith("exporter.")):
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                monkeypatch.setattr(mod, attr, wrapped)
    return spy


# --- the golden scenario through the real sources ---------------------------------------------------------
def run_pipeline(tmp_path) -> tuple[Daemon, dict]:
    """Golden inputs served for real: vLLM texts over loopback, GPU energy through the NVML double, host
    energy through a powercap tree; config loaded by config.resolve. Returns the daemon and the families of
    its last snapshot by name."""
    inputs = golden.Inputs()
    current: dict[str, str | None] = {n: None for n in golden.SERVERS}
    servers = {n: MetricsServer(lambda n=n: current[n]) for n in golden.SERVERS}
    # the grid's carbon intensity, read by the price source (sources/tariff.py) from its own exposition
    series = golden.CARBON_URL.partition("#")[2]
    grid = MetricsServer(lambda: f"{series} {golden.CARBON_G_PER_KWH}\n")
    gpus = FakeGpus(tmp_path / "gpus.json", energy_read_latency=0)
    for name, (_, uuid) in golden.GPUS.items():
        gpus.add(uuid, energy_mj=0, power_mw=0, temperature_c=40)
    tree = PowercapTree(tmp_path / "host")
    zone = tree.add_zone("package-0")
    mapping = golden.config_mapping(tmp_path, {n: s.url for n, s in servers.items()})
    mapping.pop("nvml")
    mapping["powercap_root"] = tree.root
    mapping["carbon_intensity_g_per_kwh"] = f"{grid.url}/metrics#{series}"
    mapping["interval"] = "4s"  # the sampler waits min(interval / 2, http_timeout) for the loopback reads
    path = tmp_path / "kvwatt.yaml"
    path.write_text(yaml.safe_dump(mapping))
    golden.write_measured_host_baseline(mapping["state_dir"])
    t = [0.0]
    for s in (*servers.values(), grid):
        s.__enter__()
    try:
        PHASE[0] = "startup"
        cfg = config_module.resolve(str(path), env={})  # module-qualified: the spy sees it
        nvml = NvmlSource(module=load_fake_nvml(gpus.path), clock=lambda: t[0])
        daemon = Daemon(cfg, sampler=Sampler(cfg, nvml=nvml, rapl=RaplSource(tree.root)),
                        model=Model(cfg, wall_clock=lambda: golden.WALL))

        async def loop():
            prev_host = 0.0
            async with daemon.sampler as sampler:
                for i in range(1, golden.TICKS + 1):
                    PHASE[0] = "inputs"
                    texts, gpu_now, host_joules = inputs.step(i)
                    current.update(texts)
                    for name, (_, uuid) in golden.GPUS.items():
                        gpus.gpu(uuid).update(energy_mj=int(gpu_now[name][0] * 1000),
                                              power_mw=int(gpu_now[name][1] * 1000))
                    gpus.write()
                    tree.advance(zone, host_joules - prev_host)
                    prev_host = host_joules
                    t[0] = float(i)
                    PHASE[0] = "tick"
                    tick = await sampler.tick(t[0])
                    assert set(tick.servers) == set(golden.SERVERS), "a loopback read missed the deadline"
                    daemon.step(tick)
            PHASE[0] = "done"
        asyncio.run(loop())
    finally:
        PHASE[0] = "done"
        for s in (*servers.values(), grid):
            s.__exit__(None, None, None)
    return daemon, {f.name: f for f in families(daemon.snapshot)}


def _sample_names(fams: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in fams.values():
        for s in f.samples:
            out[s.name] = out.get(s.name, 0) + 1
    return out


@pytest.fixture(scope="module")
def spied(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    spies: dict[str, Spy] = {}
    errors = {}
    for d in catalog.METRICS:
        for where in d.wheres:
            try:
                install(mp, where, spies)
            except (ImportError, AttributeError) as e:
                errors[where] = f"{type(e).__name__}: {e}"
    try:
        _, fams = run_pipeline(tmp_path_factory.mktemp("catalog"))
    finally:
        mp.undo()
    return spies, errors, _sample_names(fams), _kinds(fams)


def _kinds(fams: dict) -> dict[str, set[str]]:
    """family -> the values of its ``baseline`` label in the scenario (dE's kinds: paired, recorded, ...)."""
    return {f.name: {s.labels["baseline"] for s in f.samples if "baseline" in s.labels} for f in fams.values()}


@pytest.mark.parametrize("d", catalog.METRICS, ids=lambda d: d.name)
def test_where_is_called_for_its_series(spied, d):
    """A family with one formula: it was called. A family with one formula per kind: where a ``baseline`` label
    names the kind (dE's paired, recorded, ...), each kind the scenario has was computed by its own formula;
    otherwise (per-phase costs: measured, prior) each formula was called."""
    spies, errors, samples, kinds = spied
    for where in d.wheres:
        assert where not in errors, f"{d.name}: where={where!r} does not resolve: {errors[where]}"
    phase = "startup" if d.name in STARTUP else "tick"
    if len(d.wheres) == 1:
        calls = spies[d.where].calls
        assert calls.get(phase, 0) > 0, f"{d.name}: exporter.{d.where} was never called ({phase}); calls: {calls}"
    elif "baseline" not in d.labels:
        for where in d.wheres:
            calls = spies[where].calls
            assert calls.get(phase, 0) > 0, f"{d.name}: exporter.{where} was never called ({phase}); calls: {calls}"
    else:
        by_kind = {w.rpartition(".")[2]: w for w in d.wheres}
        assert kinds[d.name] and kinds[d.name] <= set(by_kind), (d.name, kinds[d.name], d.wheres)
        for kind in kinds[d.name]:
            calls = spies[by_kind[kind]].calls
            assert calls.get(phase, 0) > 0, f"{d.name}{{baseline={kind}}}: exporter.{by_kind[kind]} never called"
    assert samples.get(d.name, 0) > 0, f"{d.name}: no sample in the scenario"


def test_startup_families_are_really_constants(spied):
    """The families exempted from the per-tick check are configuration constants: their where is not called
    per tick (if it were, the family belongs with the per-tick ones)."""
    spies, _, _, _ = spied
    for d in catalog.METRICS:
        if d.name in STARTUP:
            for where in d.wheres:
                assert spies[where].calls.get("tick", 0) == 0, (d.name, spies[where].calls)


def test_every_family_appears_in_the_golden_output():
    text = golden.METRICS_FILE.read_text()
    names = golden.family_names(text)
    missing = [m.name for m in catalog.METRICS if m.name not in names]
    assert not missing, f"catalog families never filled in tests/data/golden/metrics.prom: {missing}"
    assert names <= set(catalog.BY_NAME), names - set(catalog.BY_NAME)
