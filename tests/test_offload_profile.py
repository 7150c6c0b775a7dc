"""The recorded OFF profile: file format, validation, and `kvwatt baseline record` against a fake server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from exporter.config import ConfigError
from exporter.derive.economics import BandProfile
from exporter.recording import profile as P
from tests.conftest import REPO
from tests.support import vllm_sim as sim
from tests.support.fake_gpus import FakeGpus
from tests.support.loopback import FakeVllm


def _profile(**kw):
    base = dict(server="off", model_name="m", offload_enabled=False, recorded_at="2026-01-01T00:00:00Z",
                duration_seconds=600.0, window_seconds=60.0,
                bands=(BandProfile(lo=0.0, hi=0.8, windows=0, joules_per_token=None, joules_per_token_stderr=None,
                                   tokens_per_second=None, tokens_per_second_stderr=None),
                       BandProfile(lo=0.8, hi=1.0, windows=10, joules_per_token=0.15, joules_per_token_stderr=0.002,
                                   tokens_per_second=2000.0, tokens_per_second_stderr=12.0)))
    base.update(kw)
    return P.Profile(**base)


def test_round_trip(tmp_path):
    path = str(tmp_path / "p.json")
    P.write(path, _profile())
    back = P.load(path)
    assert back == _profile() and back.windows == 10
    assert json.loads(open(path).read())["format"] == "kvwatt-offload-profile"


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(format="other"), "not a kvwatt offload profile"),
    (lambda d: d.update(version=2), "unsupported profile version"),
    (lambda d: d.update(offload_enabled=True), "offloading ON"),
    (lambda d: d.update(bands=[]), "non-empty list"),
    (lambda d: d["bands"][1].update(lo=0.85), "contiguous"),
    (lambda d: d["bands"][1].update(windows=-1), "windows"),
    (lambda d: d["bands"][1].update(joules_per_token="x"), "joules_per_token"),
    (lambda d: d["bands"][1].update(tokens_per_second=None), "no tokens_per_second"),
    (lambda d: d.update(scope="rack"), "scope"),
])
def test_bad_profiles_raise_config_error(tmp_path, mutate, match):
    data = P.to_json(_profile())
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=match):
        P.load(str(path))


def test_unreadable_and_invalid_json(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        P.load(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        P.load(str(tmp_path / "bad.json"))


# --- the command ---------------------------------------------------------------------------------------------
def _run(args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "exporter", "baseline", "record", *args], cwd=REPO,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_record_command_writes_the_profile(tmp_path):
    gpus = FakeGpus(tmp_path / "gpus.json")
    cond = sim.TABLE1[3]  # coding c=5 OFF: 2000 tok/s at 0.15 marginal J/token
    _, off = sim.table1_pair(cond, window_seconds=2.0)
    out = tmp_path / "profile.json"
    with FakeVllm(off) as fv:
        fv.attach_gpu(gpus, "GPU-off")
        cfg = tmp_path / "kvwatt.yaml"
        cfg.write_text(yaml.safe_dump({"servers": [{"name": "off", "url": fv.url}], "interval": "250ms",
                                       "idle_power_watts": {"GPU-off": 150.0},
                                       "state_dir": str(tmp_path / "state"),
                                       "powercap_root": str(tmp_path / "none")}))
        # 10 s for >= 2 windows of 2 s: at 7 s, a start-up slowed by the other tiers' workers left one (CI-like run)
        r = _run(["--server", "off", "--duration", "10s", "--window", "2s", "--out", str(out), "--config", str(cfg)],
                 env=gpus.env())
    assert r.returncode == 0, r.stderr
    assert "marginal GPU J/token" in r.stdout
    prof = P.load(str(out))
    assert prof.energy == "marginal" and prof.offload_enabled is False and prof.windows >= 2
    used = [b for b in prof.bands if b.windows]
    mean_j = sum(b.joules_per_token * b.windows for b in used) / prof.windows
    mean_t = sum(b.tokens_per_second * b.windows for b in used) / prof.windows
    assert mean_j == pytest.approx(0.15, rel=0.05) and mean_t == pytest.approx(2000, rel=0.05)


def test_record_without_gpu_energy_keeps_tokens_per_second(tmp_path):
    out = tmp_path / "profile.json"
    with FakeVllm(sim.low_pressure_off()) as fv:
        r = _run(["--server", f"off={fv.url}", "--duration", "3s", "--window", "1s", "--interval", "200ms",
                  "--out", str(out), "--state-dir", str(tmp_path / "s"), "--powercap-root", str(tmp_path / "n")],
                 env={"KVWATT_FAKE_NVML_STATE": str(tmp_path / "absent.json"), "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr
    prof = P.load(str(out))
    assert prof.energy == "total" and all(b.joules_per_token is None for b in prof.bands)
    assert any(b.tokens_per_second for b in prof.bands if b.windows)
    # not a terminal: a progress line at each quarter and the last one, on stderr (stdout keeps the result)
    lines = [x for x in r.stderr.splitlines() if x.startswith("recording off:")]
    assert 2 <= len(lines) <= 4 and lines[-1].startswith("recording off: 3 s of 3 s (100 %)"), r.stderr
    assert "intervals" in lines[-1] and "recording off:" not in r.stdout


def test_record_refuses_an_offloading_server(tmp_path):
    out = tmp_path / "p.json"
    with FakeVllm(sim.stable_high_pressure_on()) as fv:
        r = _run(["--server", f"on={fv.url}", "--duration", "2s", "--window", "1s", "--out", str(out),
                  "--state-dir", str(tmp_path / "s"), "--powercap-root", str(tmp_path / "n")])
    assert r.returncode == 2 and "record the OFF twin" in r.stderr and not out.exists()


def test_record_bad_input_and_unreachable(tmp_path):
    r = _run(["--server", "nobody", "--duration", "2s", "--out", str(tmp_path / "p.json")])
    assert r.returncode == 2 and "no configured server named 'nobody'" in r.stderr
    r = _run(["--server", "x=http://127.0.0.1:9", "--duration", "2s", "--window", "5s", "--out", "p.json"])
    assert r.returncode == 2 and "--window" in r.stderr
    r = _run(["--server", "x=http://127.0.0.1:9", "--duration", "1s", "--window", "1s", "--interval", "200ms",
              "--out", str(tmp_path / "p.json"), "--state-dir", str(tmp_path / "s"),
              "--powercap-root", str(tmp_path / "n")])
    assert r.returncode == 1 and "not written" in r.stderr and not (tmp_path / "p.json").exists()
