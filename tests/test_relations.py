"""Declared relations between figures (exporter/catalog/bounds.py RELATIONS, methods.md s13; issue 37 item 2): checked
once per tick beside the bounds, the derived figure of a broken relation served as unknown with an
"inconsistent: ..." reason, counted (kvwatt_figures_rejected_total{reason="relation"}) and logged once per change.
The NVML source reads the enforced power limit the GPU relation rests on (on the fake pynvml)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from exporter import catalog
from exporter.catalog import bounds
from exporter.catalog.bounds import BoundsCheck
from exporter.derive.phase_energy import PhaseCosts
from exporter.figures import Advice, BufferFigures, DeviceFigures, SavingFigure
from exporter.samples import DeviceReading, EngineInfo
from exporter.serve.web import status_json
from exporter.sources.nvml import NvmlSource
from tests.support.fake_gpus import FakeGpus, load_fake_nvml
from tests.test_bounds import snapshot

PRIOR = PhaseCosts(scope="gpu", prompt_computed_j=0.05, prompt_computed_se=None, generated_j=0.3, generated_se=None,
                   reloaded_j=0.005, reloaded_se=None, windows=120, state="not_identifiable", reason="",
                   source="prior")  # reload 0.1


def _check(snap):
    return BoundsCheck(catalog.METRICS).apply(snap)


def _rejected(snap, figure):
    return [r for r in snap.implausible if r.figure == figure]


def test_shares_that_do_not_sum_to_one_are_served_unknown_with_the_tax(caplog):
    shares = {"local_compute": 0.5, "local_cache_hit": 0.3, "external_kv_transfer": 0.1}  # 0.9
    with caplog.at_level(logging.WARNING, logger="kvwatt.bounds"):
        snap = _check(snapshot(token_shares=shares))
    w = snap.servers[0].windows[0]
    assert w.token_shares == {k: None for k in shares} and w.recompute_tax is None
    (r, *_) = _rejected(snap, "kvwatt_prompt_token_share_ratio")
    assert r.kind == "relation" and r.reason.startswith("inconsistent: token_shares_sum_to_one")
    assert snap.rejected_counts[("kvwatt_prompt_token_share_ratio", "relation")] == 3.0
    assert any("inconsistent: token_shares_sum_to_one" in rec.getMessage() for rec in caplog.records)
    assert not bounds.violations(catalog.METRICS, snap)


def test_shares_summing_to_one_break_nothing():
    snap = _check(snapshot())
    assert not snap.implausible


def test_a_tax_above_the_recomputed_share_is_served_unknown():
    snap = _check(snapshot(recompute_tax=0.7))  # local_compute share 0.5
    assert snap.servers[0].windows[0].recompute_tax is None
    assert snap.servers[0].windows[0].token_shares["local_compute"] == 0.5  # the measured share stays
    (r,) = _rejected(snap, "kvwatt_recompute_tax_ratio")
    assert "more than the recomputed share" in r.reason


def _fresh():
    """test_bounds' snapshot with the tax's W a float of its own (the check clears a figure by identity, and the
    literal 60.0 there is one object for the tax's W and the basis' seconds)."""
    return snapshot(recompute_tax_watts={"gpu": float("60")})


def _with_gpu(snap, watts, limit):
    reading = DeviceReading(device="gpu:GPU-0", kind="gpu", labels={"gpu": "0", "uuid": "GPU-0"}, joules_total=1000.0,
                            continuous=True, power_watts=watts, method="counter", temperature_celsius=40.0,
                            power_limit_watts=limit)
    return dataclasses.replace(snap, devices=(DeviceFigures(reading, None, None),))


def test_a_gpu_above_its_enforced_power_limit_is_served_unknown():
    snap = _check(_with_gpu(_fresh(), 2274.0, 700.0))
    assert snap.devices[0].reading.power_watts is None
    assert _rejected(snap, "kvwatt_gpu_power_watts")[0].reason.startswith("inconsistent: gpu_power_within_limit")
    assert not _rejected(_check(_with_gpu(_fresh(), 690.0, 700.0)), "kvwatt_gpu_power_watts")
    assert not _rejected(_check(_with_gpu(_fresh(), 2274.0, None)), "kvwatt_gpu_power_watts")  # no limit given


def test_a_window_averaging_above_the_gpus_limits_serves_its_energy_figures_unknown():
    """The demo's simulated GPU averaged 2,274 W over a window (issue 37): 60 kJ in 60 s is 1,000 W > 700 W."""
    snap = _check(_with_gpu(_fresh(), 300.0, 700.0))
    w = snap.servers[0].windows[0]
    assert w.energy[0].joules_per_token is None and w.energy[0].marginal_joules_per_token is None
    assert w.recompute_tax_watts == {"gpu": None}
    assert _rejected(snap, "kvwatt_energy_per_token_joules")[0].reason.startswith(
        "inconsistent: window_power_within_limit")
    assert not _rejected(_check(_with_gpu(_fresh(), 300.0, 1200.0)), "kvwatt_energy_per_token_joules")


def _with_phase(snap):
    return dataclasses.replace(snap, servers=(dataclasses.replace(snap.servers[0], phase_costs=(PRIOR,)),))


def test_a_potential_de_far_below_the_tax_it_prices_is_served_unknown():
    """Issue 37: the tax 0.82 of the energy, potential dE +0.21 +/- 0.19 "within noise"."""
    kw = dict(recompute_energy_share={"gpu": 0.82}, savings=(SavingFigure(baseline="potential", energy_saving=0.21,
                                                                          energy_saving_stderr=0.019, windows=5),))
    snap = _check(_with_phase(snapshot(**kw)))
    (f,) = snap.servers[0].windows[0].savings
    assert f.energy_saving is None
    (r,) = _rejected(snap, "kvwatt_energy_saving_ratio")
    assert "potential dE +0.21" in r.reason and dict(r.labels)["baseline"] == "potential"
    agree = dict(kw, savings=(SavingFigure(baseline="potential", energy_saving=0.76, energy_saving_stderr=0.02,
                                           windows=5),))  # 0.82 x (1 - 0.1) = 0.738
    assert not _rejected(_check(_with_phase(snapshot(**agree))), "kvwatt_energy_saving_ratio")
    noisy = dict(kw, savings=(SavingFigure(baseline="potential", energy_saving=0.34, energy_saving_stderr=0.34,
                                           windows=5),))  # within 2 SE: noise, not a contradiction
    assert not _rejected(_check(_with_phase(snapshot(**noisy))), "kvwatt_energy_saving_ratio")


def test_an_estimated_de_prices_the_saving():
    # marginal 600 W, saved 30 W: dE = 30 / 630 = 0.048
    snap = _check(_with_phase(snapshot(savings=(SavingFigure(baseline="estimated", energy_saving=0.4,
                                                             energy_saving_stderr=0.01, windows=5),))))
    assert _rejected(snap, "kvwatt_energy_saving_ratio")
    ok = _check(_with_phase(snapshot(savings=(SavingFigure(baseline="estimated", energy_saving=0.05,
                                                           energy_saving_stderr=0.01, windows=5),))))
    assert not _rejected(ok, "kvwatt_energy_saving_ratio")


def _with_buffer(snap, size, undersized, recommended, gib):
    s = snap.servers[0]
    buf = BufferFigures(undersized=undersized, recommended_bytes=recommended, recommended_gib=gib, store_failures=0.0,
                        residency_seconds=54.0, write_bytes_per_second=1e6)
    return dataclasses.replace(snap, servers=(dataclasses.replace(
        s, buffer=buf, info=EngineInfo(offload_enabled=True, offload_buffer_bytes=size)),))


def test_an_undersized_buffer_recommended_no_larger_is_served_unknown():
    snap = _check(_with_buffer(snapshot(), 8e9, True, 4e9, 4))
    assert snap.servers[0].buffer.recommended_bytes is None
    assert _rejected(snap, "kvwatt_offload_recommended_buffer_bytes")


def test_a_size_rounded_far_beyond_the_recommended_bytes_is_served_unknown():
    """Issue 37: "Recommended size: 1 GiB" for 18 MiB recommended (whole GiB); the bytes stay."""
    snap = _check(_with_buffer(snapshot(), 0.0625 * bounds.GIB, False, 18 * 2**20, 1))
    b = snap.servers[0].buffer
    assert b.recommended_gib is None and b.recommended_bytes == 18 * 2**20
    (r,) = _rejected(snap, "recommended_size_rounds_the_bytes")
    assert "inconsistent" in r.reason
    assert status_json(snap)  # served whole
    fine = _check(_with_buffer(snapshot(), 0.0625 * bounds.GIB, False, 0.9 * bounds.GIB, 1))
    assert fine.servers[0].buffer.recommended_gib == 1


def test_advice_from_a_longer_window_after_the_pressure_ended_is_listed():
    s = snapshot().servers[0]
    w1 = dataclasses.replace(s.windows[0], above_threshold=False)
    w5 = dataclasses.replace(s.windows[0], window="5m", seconds=300.0, above_threshold=True)
    advice = (Advice("kv_pressure", "bad", "KV pressure ... Grow the KV cache", {"window": "5m"}),)
    snap = dataclasses.replace(snapshot(), servers=(dataclasses.replace(s, windows=(w1, w5), advice=advice),))
    (r,) = _rejected(_check(snap), "advice_on_regime_window")
    assert "the pressure has ended" in r.reason


def test_every_relation_names_declared_families():
    names = {r.name for r in bounds.RELATIONS}
    assert len(names) == len(bounds.RELATIONS) >= 7
    for rel in bounds.RELATIONS:
        assert set(rel.relates + rel.unknown) <= set(catalog.BY_NAME), rel.name
        assert rel.per in ("window", "server", "snapshot") and rel.says


@pytest.fixture
def gpus(tmp_path, monkeypatch):
    g = FakeGpus(tmp_path / "gpus.json")
    monkeypatch.setenv("KVWATT_FAKE_NVML_STATE", g.path)
    return g


def test_the_nvml_source_reads_the_enforced_power_limit(gpus):
    gpus.add("GPU-a", energy_mj=0, power_mw=350_000, power_limit_mw=700_000)
    gpus.add("GPU-b", energy_mj=0, power_mw=90_000)  # a board that does not give it
    src = NvmlSource(module=load_fake_nvml())
    _, readings = src.read(0.0)
    got = {r.labels["uuid"]: r for r in readings}
    assert got["GPU-a"].power_limit_watts == 700.0 and got["GPU-b"].power_limit_watts is None
    src.close()


def test_a_binding_without_the_power_limit_call_still_reads_the_gpu(gpus):
    """An nvidia-ml-py without nvmlDeviceGetEnforcedPowerLimit (or the demo's simulated NVML): no limit, not a GPU
    down (the call was first read as an attribute and failed every GPU)."""
    fake = load_fake_nvml()
    gpus.add("GPU-a", energy_mj=0, power_mw=350_000, power_limit_mw=700_000)

    class Old:
        def __getattr__(self, name):
            if name == "nvmlDeviceGetEnforcedPowerLimit":
                raise AttributeError(name)
            return getattr(fake, name)

    src = NvmlSource(module=Old())
    status, readings = src.read(0.0)
    assert status.up and readings[0].power_watts == 350.0 and readings[0].power_limit_watts is None
    src.close()
