"""Attribution of device energy to servers, and the model's energy side tick by tick (NVML double + a
powercap tree, virtual tick times: nothing waits on the clock). The test builds each exporter.samples.Tick
itself, as the Sampler would, and feeds exporter.model.Model; figures come from its Snapshot and are
rendered by the collector (exporter.serve.collector.families)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exporter import catalog
from exporter.config import Config, ServerConfig
from exporter.idle.baseline import BaselineBook
from exporter.model import Model
from exporter.model.attribution import assign_gpus, host_shares
from exporter.samples import DeviceReading, EngineInfo, EngineReading, ServerRead, SourceStatus, Tick
from exporter.serve.collector import KvwattCollector, families
from exporter.sources.nvml import NvmlSource
from exporter.sources.rapl import RaplSource
from tests.support.fake_gpus import FakeGpus, load_fake_nvml
from tests.support.powercap import PowercapTree

A, B = "GPU-aaaa", "GPU-bbbb"


def gpu(index, uuid):
    return DeviceReading(device=f"gpu:{uuid}", kind="gpu", labels={"gpu": str(index), "uuid": uuid}, joules_total=0.0)


# --- attribution ------------------------------------------------------------------------------------------
def test_only_server_gets_every_gpu_by_default():
    a = assign_gpus([ServerConfig("a", "http://x")], [gpu(0, A), gpu(1, B)])
    assert a.by_server == {"a": (f"gpu:{A}", f"gpu:{B}")} and a.unassigned == ()


def test_servers_by_index_or_uuid_and_the_rest_unassigned():
    servers = [ServerConfig("a", "http://x", gpus=("0",)), ServerConfig("b", "http://y", gpus=("gpu-BBBB", "7")),
               ServerConfig("c", "http://z")]
    a = assign_gpus(servers, [gpu(0, A), gpu(1, B), gpu(2, "GPU-cccc")])
    assert a.by_server == {"a": (f"gpu:{A}",), "b": (f"gpu:{B}",), "c": ()}
    assert a.unassigned == ("gpu:GPU-cccc",) and a.unmatched == {"b": ("7",)}


def test_several_servers_without_mapping_leave_gpus_unassigned():
    a = assign_gpus([ServerConfig("a", "http://x"), ServerConfig("b", "http://y")], [gpu(0, A)])
    assert a.by_server == {"a": (), "b": ()} and a.unassigned == (f"gpu:{A}",)


def test_gpu_named_twice_goes_to_the_first_server():
    servers = [ServerConfig("a", "http://x", gpus=("0",)), ServerConfig("b", "http://y", gpus=(A,))]
    assert assign_gpus(servers, [gpu(0, A)]).by_server == {"a": (f"gpu:{A}",), "b": ()}


def test_host_shares():
    assert host_shares(["a", "b"], {"a": 300.0, "b": 100.0}) == {"a": 0.75, "b": 0.25}
    assert host_shares(["a", "b"], {"a": 300.0, "b": None}) == {"a": 0.5, "b": 0.5}
    assert host_shares(["a", "b"], {"a": 0.0, "b": 0.0}) == {"a": 0.5, "b": 0.5}
    assert host_shares(["a"], {}) == {"a": 1.0}


# --- the model's energy side, tick by tick ----------------------------------------------------------------
class Rig:
    """One host: fake GPUs, a powercap tree, servers fed hand-made readings; t advances 1 s per tick. Each
    tick is built here the way the Sampler builds it (energy readings of the tick, one ServerRead per
    server) and handed to the Model."""

    WALL = 1_700_000_000.0

    def __init__(self, tmp_path, monkeypatch, servers, gpus=(A,), **cfg):
        self.gpus = FakeGpus(tmp_path / "gpus.json", energy_read_latency=0)
        monkeypatch.setenv("KVWATT_FAKE_NVML_STATE", self.gpus.path)
        for uuid in gpus:
            self.gpus.add(uuid, energy_mj=0, power_mw=60_000, temperature_c=35)
        self.tree = PowercapTree(tmp_path / "host")
        self.pkg = self.tree.add_zone("package-0")
        self.cfg = Config(servers=tuple(servers), state_dir=str(tmp_path / "state"),
                          powercap_root=self.tree.root, **cfg)
        self.t = 0.0
        # both sources on the virtual clock: the idle learner divides each device's joules by the seconds
        # between that device's own read_at stamps, which must be tick seconds here, not the microseconds of
        # wall time between two virtual ticks
        self.nvml = NvmlSource(module=load_fake_nvml(), clock=lambda: self.t)
        self.rapl = RaplSource(self.tree.root, clock=lambda: self.t)
        self.model = Model(self.cfg, wall_clock=lambda: self.WALL)
        self.tokens = {s.name: 0.0 for s in servers}

    def close(self):
        self.nvml.close()

    def tick(self, gpu_watts: dict[str, float], host_watts: float, tokens: dict[str, float]):
        self.t += 1.0
        for uuid, w in gpu_watts.items():
            g = self.gpus.gpu(uuid)
            self.gpus.update(uuid, energy_mj=g["energy_mj"] + w * 1000)
        self.tree.advance(self.pkg, host_watts)
        nv_status, gpus = self.nvml.read(self.t)
        host_status, zones = self.rapl.read(self.t)
        reads = {}
        for s in self.cfg.servers:
            n = tokens.get(s.name, 0.0)
            self.tokens[s.name] += n
            reading = EngineReading(counters={"generation_tokens": self.tokens[s.name], "prompt_tokens": 0.0},
                                    gauges={"running": 1.0 if n else 0.0, "waiting": 0.0}, info=EngineInfo())
            reads[s.name] = ServerRead(s.name, SourceStatus(source="vllm", server=s.name, up=True), reading)
        self.model.ingest(Tick(self.t, reads, (nv_status, host_status), tuple(gpus + zones)))

    def history(self, name):
        return self.model.servers[name].history

    def snapshot(self):
        return self.model.snapshot()

    def series(self, server="a", window="1m"):
        """The energy-per-token samples of one server and window as rendered: {(name, (("scope", s),)): v}.
        A duplicate sample fails (the collector raises on one; this catches one from two families too)."""
        out = {}
        for fam in families(self.snapshot()):
            if fam.name not in ("kvwatt_energy_per_token_joules", "kvwatt_marginal_energy_per_token_joules"):
                continue
            for smp in fam.samples:
                lab = dict(smp.labels)
                if lab.pop("server") != server or lab.pop("window") != window:
                    continue
                key = (smp.name, tuple(sorted(lab.items())))
                assert key not in out, f"duplicate sample {key}"
                out[key] = smp.value
        return out


@pytest.fixture
def rig(tmp_path, monkeypatch):
    made = []

    def make(servers, **cfg):
        r = Rig(tmp_path, monkeypatch, servers, **cfg)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


def test_single_server_learns_idle_then_reports_marginal_and_total(rig):
    rig = rig([ServerConfig("a", "http://x")], idle_settle_seconds=5.0, idle_min_seconds=10.0,
              min_load_seconds=30.0)
    for _ in range(20):  # idle: GPU 60 W, host 40 W
        rig.tick({A: 60.0}, 40.0, {})
    book = BaselineBook(rig.cfg.state_dir)
    book.load()
    assert book.get(f"gpu:{A}").watts == pytest.approx(60.0)
    assert book.get("rapl:package-0:package").watts == pytest.approx(40.0)
    assert book.get(f"gpu:{A}").temperature_celsius == 35.0 and book.get(f"gpu:{A}").method == "learned"
    for _ in range(40):  # loaded: GPU 300 W, host 100 W, 100 tokens/s
        rig.tick({A: 300.0}, 100.0, {"a": 100.0})
    s = rig.series()
    # the 1m window still holds 19 idle seconds: they add to the total; and its first seconds predate the
    # baseline (learned at t=16), so there is no marginal figure yet rather than one with a partial P_idle*dt
    assert s[("kvwatt_energy_per_token_joules", (("scope", "gpu"),))] == pytest.approx((19 * 60 + 40 * 300) / 4000)
    assert ("kvwatt_marginal_energy_per_token_joules", (("scope", "gpu"),)) not in s
    gpu = next(e for e in rig.snapshot().servers[0].windows[0].energy if e.scope == "gpu")
    assert gpu.joules_per_token is not None and gpu.marginal_joules_per_token is None  # unknown, not 0
    for _ in range(30):
        rig.tick({A: 300.0}, 100.0, {"a": 100.0})
    s = rig.series()
    assert s[("kvwatt_energy_per_token_joules", (("scope", "gpu"),))] == pytest.approx(3.0)
    assert s[("kvwatt_marginal_energy_per_token_joules", (("scope", "gpu"),))] == pytest.approx(2.4)
    assert s[("kvwatt_energy_per_token_joules", (("scope", "host"),))] == pytest.approx(1.0)
    assert s[("kvwatt_marginal_energy_per_token_joules", (("scope", "host"),))] == pytest.approx(0.6)


def test_not_enough_load_gives_no_figure(rig):
    rig = rig([ServerConfig("a", "http://x")], min_load_seconds=30.0)
    for _ in range(25):
        rig.tick({A: 300.0}, 100.0, {"a": 100.0})
    assert rig.series() == {}
    names = {f.name for f in families(rig.snapshot())}
    assert "kvwatt_energy_per_token_joules" not in names and "kvwatt_marginal_energy_per_token_joules" not in names


def test_two_servers_split_host_energy_by_gpu_energy(rig):
    servers = [ServerConfig("a", "http://x", gpus=("0",)), ServerConfig("b", "http://y", gpus=(B,))]
    rig = rig(servers, gpus=(A, B), min_load_seconds=5.0)
    for _ in range(10):
        rig.tick({A: 300.0, B: 100.0}, 100.0, {"a": 100.0, "b": 50.0})
    ivs_a, ivs_b = rig.history("a").intervals, rig.history("b").intervals
    assert ivs_a[-1].energy_joules == {"gpu": pytest.approx(300.0), "host": pytest.approx(75.0)}
    assert ivs_b[-1].energy_joules == {"gpu": pytest.approx(100.0), "host": pytest.approx(25.0)}
    sa, sb = rig.series("a"), rig.series("b")
    assert sa[("kvwatt_energy_per_token_joules", (("scope", "host"),))] == pytest.approx(0.75)
    assert sb[("kvwatt_energy_per_token_joules", (("scope", "gpu"),))] == pytest.approx(2.0)


def _samples(snapshot) -> dict[str, list]:
    """Rendered samples by sample name (a counter family is named without _total; its sample carries it)."""
    out: dict[str, list] = {}
    for fam in families(snapshot):
        for smp in fam.samples:
            out.setdefault(smp.name, []).append(smp)
    return out


def test_lost_gpu_leaves_a_gap_not_zero(rig):
    rig = rig([ServerConfig("a", "http://x")])
    for _ in range(3):
        rig.tick({A: 300.0}, 100.0, {"a": 10.0})
    smp = _samples(rig.snapshot())
    assert [s.labels["uuid"] for s in smp["kvwatt_gpu_energy_joules_total"]] == [A]  # exported while up
    rig.gpus.update(A, lost=True)
    rig.tick({}, 100.0, {"a": 10.0})
    last = rig.history("a").intervals[-1]
    assert "gpu" not in last.energy_joules and last.energy_joules["host"] == pytest.approx(100.0)
    smp = _samples(rig.snapshot())
    up = {s.labels["source"]: s.value for s in smp["kvwatt_source_up"] if s.labels["server"] == ""}
    assert up == {"nvml": 0.0, "rapl": 1.0, "state_dir": 1.0}  # state_dir: the baselines are persisted
    # a lost GPU's counter is not exported while it is down (neither as 0 nor frozen at its last value)
    assert "kvwatt_gpu_energy_joules_total" not in smp
    assert [s.value for s in smp["kvwatt_host_energy_joules_total"]] == [pytest.approx(300.0)]  # RAPL goes on (3 steps)


def test_rendered_series_are_in_the_catalog_and_expose(rig):
    rig = rig([ServerConfig("a", "http://x")], idle_power_watts={"gpu:0": 55.0}, min_load_seconds=5.0)
    for _ in range(10):
        rig.tick({A: 200.0}, 80.0, {"a": 100.0})
    text = generate_latest(_registry(rig.snapshot())).decode()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            assert name in catalog.BY_NAME, name
    assert f'kvwatt_gpu_energy_joules_total{{gpu="0",uuid="{A}"}} 1800.0' in text
    assert f'kvwatt_gpu_energy_method_info{{gpu="0",method="counter",uuid="{A}"}} 1.0' in text
    assert f'kvwatt_gpu_idle_power_watts{{gpu="0",uuid="{A}"}} 55.0' in text
    assert 'kvwatt_host_energy_joules_total{domain="package",zone="package-0"} 720.0' in text
    assert 'kvwatt_marginal_energy_per_token_joules{scope="gpu",server="a",window="1m"} 1.45' in text
    assert "kvwatt_idle_baseline_age_seconds" not in text  # configured: no measurement time


def _registry(snapshot):
    reg = CollectorRegistry()
    reg.register(KvwattCollector(lambda: snapshot))
    return reg
