"""Attribution of device energy to servers, and the daemon's energy side tick by tick (NVML double + a
powercap tree, virtual tick times: nothing waits on the clock)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from exporter import catalog
from exporter.collector import Families, KvwattCollector
from exporter.config import Config, ServerConfig
from exporter.daemon import ServerState
from exporter.derive.recompute import ReferenceShare
from exporter.energy.attribution import assign_gpus, host_shares
from exporter.energy.baseline import BaselineBook
from exporter.energy.runtime import EnergyRuntime
from exporter.samples import DeviceReading, SourceStatus, VllmInfo, VllmReading
from exporter.sources.nvml import NvmlSource
from exporter.sources.rapl import RaplSource
from exporter.store import ServerHistory
from exporter.view import server_view
from tests.support.fake_gpus import FakeGpus, load_fake_nvml
from tests.support.powercap import PowercapTree

A, B = "GPU-aaaa", "GPU-bbbb"


def gpu(index, uuid):
    return DeviceReading(f"gpu:{uuid}", "gpu", {"gpu": str(index), "uuid": uuid}, 0.0)


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


# --- the runtime, tick by tick ----------------------------------------------------------------------------
class Rig:
    """One host: fake GPUs, a powercap tree, servers fed hand-made readings; t advances 1 s per tick."""

    def __init__(self, tmp_path, monkeypatch, servers, gpus=(A,), **cfg):
        self.gpus = FakeGpus(tmp_path / "gpus.json")
        monkeypatch.setenv("KVWATT_FAKE_NVML_STATE", self.gpus.path)
        for uuid in gpus:
            self.gpus.add(uuid, energy_mj=0, power_mw=60_000, temperature_c=35)
        self.tree = PowercapTree(tmp_path / "host")
        self.pkg = self.tree.add_zone("package-0")
        self.cfg = Config(servers=tuple(servers), state_dir=str(tmp_path / "state"),
                          powercap_root=self.tree.root, **cfg)
        self.rt = EnergyRuntime(self.cfg, nvml=NvmlSource(module=load_fake_nvml()),
                                rapl=RaplSource(self.tree.root), wall_clock=lambda: 1_700_000_000.0)
        self.states = [ServerState(s, None, ServerHistory(3600), ReferenceShare(),
                                   SourceStatus("vllm", s.name, True)) for s in servers]
        self.t, self.tokens = 0.0, {s.name: 0.0 for s in servers}

    def tick(self, gpu_watts: dict[str, float], host_watts: float, tokens: dict[str, float]):
        self.t += 1.0
        for uuid, w in gpu_watts.items():
            g = self.gpus.gpu(uuid)
            self.gpus.update(uuid, energy_mj=g["energy_mj"] + w * 1000)
        self.tree.advance(self.pkg, host_watts)
        tick = self.rt.read(self.t)
        for s in self.states:
            self.rt.attribute(s, tick)
            n = tokens.get(s.cfg.name, 0.0)
            self.tokens[s.cfg.name] += n
            reading = VllmReading({"generation_tokens": self.tokens[s.cfg.name], "prompt_tokens": 0.0},
                                  {"running": 1.0 if n else 0.0, "waiting": 0.0}, VllmInfo())
            s.history.add_reading(self.t, reading)
        self.rt.after_tick(self.t, self.states)

    def views(self):
        out = []
        for s in self.states:
            v = server_view(s.cfg, s.history, s.status, s.info, s.reference, self.t, self.cfg)
            self.rt.extend_view(v, s, self.t, self.cfg)
            out.append(v)
        return out

    def series(self, view, window="1m"):
        w = next(w for w in view.windows if w.window == window)
        return {(n, tuple(sorted(l.items()))): v for n, l, v in w.extra.get("series", [])}


def test_single_server_learns_idle_then_reports_marginal_and_total(tmp_path, monkeypatch):
    rig = Rig(tmp_path, monkeypatch, [ServerConfig("a", "http://x")], idle_settle_seconds=5.0,
              idle_min_seconds=10.0, min_load_seconds=30.0)
    for _ in range(20):  # idle: GPU 60 W, host 40 W
        rig.tick({A: 60.0}, 40.0, {})
    book = BaselineBook(rig.cfg.state_dir)
    book.load()
    assert book.get(f"gpu:{A}").watts == pytest.approx(60.0)
    assert book.get("rapl:package-0:package").watts == pytest.approx(40.0)
    assert book.get(f"gpu:{A}").temperature_celsius == 35.0 and book.get(f"gpu:{A}").method == "learned"
    for _ in range(40):  # loaded: GPU 300 W, host 100 W, 100 tokens/s
        rig.tick({A: 300.0}, 100.0, {"a": 100.0})
    s = rig.series(rig.views()[0])
    # the 1m window still holds 19 idle seconds: they add to the total; and its first seconds predate the
    # baseline (learned at t=16), so there is no marginal figure yet rather than one with a partial P_idle*dt
    assert s[("kvwatt_energy_per_token_joules", (("scope", "gpu"),))] == pytest.approx((19 * 60 + 40 * 300) / 4000)
    assert s[("kvwatt_marginal_energy_per_token_joules", (("scope", "gpu"),))] is None
    for _ in range(30):
        rig.tick({A: 300.0}, 100.0, {"a": 100.0})
    s = rig.series(rig.views()[0])
    assert s[("kvwatt_energy_per_token_joules", (("scope", "gpu"),))] == pytest.approx(3.0)
    assert s[("kvwatt_marginal_energy_per_token_joules", (("scope", "gpu"),))] == pytest.approx(2.4)
    assert s[("kvwatt_energy_per_token_joules", (("scope", "host"),))] == pytest.approx(1.0)
    assert s[("kvwatt_marginal_energy_per_token_joules", (("scope", "host"),))] == pytest.approx(0.6)


def test_not_enough_load_gives_no_figure(tmp_path, monkeypatch):
    rig = Rig(tmp_path, monkeypatch, [ServerConfig("a", "http://x")], min_load_seconds=30.0)
    for _ in range(25):
        rig.tick({A: 300.0}, 100.0, {"a": 100.0})
    assert rig.series(rig.views()[0]) == {}


def test_two_servers_split_host_energy_by_gpu_energy(tmp_path, monkeypatch):
    servers = [ServerConfig("a", "http://x", gpus=("0",)), ServerConfig("b", "http://y", gpus=(B,))]
    rig = Rig(tmp_path, monkeypatch, servers, gpus=(A, B), min_load_seconds=5.0)
    for _ in range(10):
        rig.tick({A: 300.0, B: 100.0}, 100.0, {"a": 100.0, "b": 50.0})
    ivs_a, ivs_b = rig.states[0].history.intervals, rig.states[1].history.intervals
    assert ivs_a[-1].energy_joules == {"gpu": pytest.approx(300.0), "host": pytest.approx(75.0)}
    assert ivs_b[-1].energy_joules == {"gpu": pytest.approx(100.0), "host": pytest.approx(25.0)}
    sa, sb = (rig.series(v) for v in rig.views())
    assert sa[("kvwatt_energy_per_token_joules", (("scope", "host"),))] == pytest.approx(0.75)
    assert sb[("kvwatt_energy_per_token_joules", (("scope", "gpu"),))] == pytest.approx(2.0)


def test_lost_gpu_leaves_a_gap_not_zero(tmp_path, monkeypatch):
    rig = Rig(tmp_path, monkeypatch, [ServerConfig("a", "http://x")])
    for _ in range(3):
        rig.tick({A: 300.0}, 100.0, {"a": 10.0})
    rig.gpus.update(A, lost=True)
    rig.tick({}, 100.0, {"a": 10.0})
    last = rig.states[0].history.intervals[-1]
    assert "gpu" not in last.energy_joules and last.energy_joules["host"] == pytest.approx(100.0)
    f = Families()
    rig.rt.render(f)
    fams = {m.name: m for m in f}
    up = {s.labels["source"]: s.value for s in fams["kvwatt_source_up"].samples}
    assert up == {"nvml": 0.0, "rapl": 1.0}
    assert "kvwatt_gpu_energy" not in fams  # a lost GPU's counter is not exported while it is down


def test_rendered_series_are_in_the_catalog_and_expose(tmp_path, monkeypatch):
    rig = Rig(tmp_path, monkeypatch, [ServerConfig("a", "http://x")], idle_power_watts={"gpu:0": 55.0},
              min_load_seconds=5.0)
    for _ in range(10):
        rig.tick({A: 200.0}, 80.0, {"a": 100.0})
    text = generate_latest(_registry(rig)).decode()
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


def _registry(rig):
    reg = CollectorRegistry()
    reg.register(KvwattCollector(lambda: (rig.views(), rig.rt.renderers())))
    return reg
