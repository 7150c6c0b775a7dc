"""`kvwatt baseline idle`: a real subprocess against a stub vLLM /metrics, the NVML double and a powercap tree
whose counters a thread advances at a known power."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exporter.idle.baseline import STATE_FILE
from tests.support.fake_gpus import FakeGpus
from tests.support.loopback import MetricsServer
from tests.support.powercap import ConstantPower, PowercapTree

REPO = Path(__file__).resolve().parents[1]
A = "GPU-aaaa-idle"


class StubVllm:
    """A minimal vLLM exposition whose ``running`` and ``tokens`` the test changes while it is served."""

    def __init__(self):
        self.running, self.tokens = 0, 1000
        self.reads, self.bump_at_read = 0, None  # tokens += 10 on that read: "busy midway", whatever the clock
        self.server = MetricsServer(self.exposition).__enter__()
        self.url = self.server.url

    def exposition(self):
        self.reads += 1
        if self.reads == self.bump_at_read:
            self.tokens += 10
        return (f'vllm:num_requests_running{{model_name="m",engine="0"}} {self.running}\n'
                f'vllm:num_requests_waiting{{model_name="m",engine="0"}} 0\n'
                f'vllm:generation_tokens_total{{model_name="m",engine="0"}} {self.tokens}\n'
                f'vllm:prompt_tokens_total{{model_name="m",engine="0"}} 5000\n')

    def close(self):
        self.server.__exit__(None, None, None)


@pytest.fixture
def rig(tmp_path):
    vllm = StubVllm()
    gpus = FakeGpus(tmp_path / "gpus.json")
    gpus.add(A, energy_mj=0, power_mw=75_000, counter_follows_power=True, t0=time.monotonic(), temperature_c=31)
    tree = PowercapTree(tmp_path / "host")
    zone = tree.add_zone("package-0")
    load = ConstantPower(tree, zone, 40.0)
    load.start()
    yield vllm, gpus, tree, tmp_path / "state"
    load.stop.set()
    vllm.close()


def kvwatt(args, gpus, timeout=60):
    env = {**os.environ, **gpus.env()}
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO)])
    return subprocess.run([sys.executable, "-m", "exporter", "baseline", "idle", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_measures_persists_and_prints(rig):
    vllm, gpus, tree, state = rig
    out = kvwatt(["--duration", "3s", "--settle", "0", "--interval", "0.5s", "--server", f"a={vllm.url}",
                  "--state-dir", str(state), "--powercap-root", tree.root], gpus)
    assert out.returncode == 0, out.stderr
    assert f"gpu:{A}" in out.stdout and "rapl:package-0:package" in out.stdout and "saved to" in out.stdout
    data = json.loads((state / STATE_FILE).read_text())["devices"]
    g, h = data[f"gpu:{A}"], data["rapl:package-0:package"]
    assert g["watts"] == pytest.approx(75.0, rel=0.02) and g["method"] == "measured"
    # relative to the requested 3 s: the command stops at the first tick after it, so up to one 0.5 s interval
    # more (a loaded machine's late tick measured 3.50 s), with 0.3 s for reading and scheduling jitter
    assert g["temperature_celsius"] == 31.0 and 3.0 - 0.3 <= g["duration_seconds"] <= 3.0 + 0.5 + 0.3
    assert h["watts"] == pytest.approx(40.0, rel=0.05)
    assert abs(g["measured_at"] - time.time()) < 60


def test_busy_server_saves_nothing(rig):
    vllm, gpus, tree, state = rig
    vllm.running = 2
    out = kvwatt(["--duration", "1s", "--settle", "0", "--server", f"a={vllm.url}", "--state-dir", str(state),
                  "--powercap-root", tree.root], gpus)
    assert out.returncode == 1 and "not idle" in out.stderr
    assert not (state / STATE_FILE).exists()


def test_server_getting_busy_midway_voids_the_measurement(rig):
    vllm, gpus, tree, state = rig
    # the 4th read is inside the measurement (after the start-up check and its first ticks) on any machine;
    # a wall-clock timer fired before a loaded machine had even imported kvwatt
    vllm.bump_at_read = 4
    out = kvwatt(["--duration", "3s", "--settle", "0", "--interval", "0.25s", "--server", f"a={vllm.url}",
                  "--state-dir", str(state), "--powercap-root", tree.root], gpus)
    assert vllm.reads >= 4  # the bumped read happened (the check stops the measurement right there)
    assert out.returncode == 1 and "served tokens" in out.stderr
    assert not (state / STATE_FILE).exists()


def test_unreachable_server_and_unknown_name(rig, tmp_path):
    _, gpus, tree, state = rig
    out = kvwatt(["--duration", "1s", "--settle", "0", "--server", "a=http://127.0.0.1:9",
                  "--state-dir", str(state), "--powercap-root", tree.root], gpus)
    assert out.returncode == 1 and "not answering" in out.stderr and "--no-server-check" in out.stderr
    out = kvwatt(["--duration", "1s", "--server", "nosuch", "--state-dir", str(state)], gpus)
    assert out.returncode == 2 and "no configured server named 'nosuch'" in out.stderr
    out = kvwatt(["--duration", "soon", "--no-server-check"], gpus)
    assert out.returncode == 2 and "--duration" in out.stderr


def test_no_energy_source_exits_1_at_once(tmp_path):
    """NVML and RAPL are known absent at the first tick: no --settle and --duration wait (10 min here)."""
    gpus = FakeGpus(tmp_path / "gpus.json", library_found=False)
    started = time.monotonic()
    out = kvwatt(["--duration", "10m", "--settle", "30s", "--no-server-check", "--state-dir", str(tmp_path / "s"),
                  "--powercap-root", str(tmp_path / "none")], gpus)
    assert out.returncode == 1 and "not measured" in out.stderr and "absent" in out.stderr
    assert "measuring for" not in out.stdout and "waiting 30s" not in out.stdout, out.stdout
    assert time.monotonic() - started < 60  # it would have waited 630 s


def test_measurement_shows_its_progress(tmp_path):
    """Not a terminal: one progress line at each quarter and a last one, on stderr."""
    gpus = FakeGpus(tmp_path / "gpus.json")
    gpus.add(A, power_mw=75_000, counter_follows_power=True, t0=time.monotonic())
    out = kvwatt(["--duration", "2s", "--settle", "0", "--interval", "250ms", "--no-server-check",
                  "--state-dir", str(tmp_path / "s"), "--powercap-root", str(tmp_path / "none")], gpus)
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.startswith("measuring idle power:")]
    assert 2 <= len(lines) <= 4 and lines[-1].startswith("measuring idle power: 2 s of 2 s (100 %), 1 devices"), lines


class SlowInitNvml:
    """The NVML double with an nvmlInit that takes ``delay`` seconds, as a driver warming up (or a starved
    process) does: the measurement must not count those seconds, which hold no energy sample."""

    def __init__(self, module, delay: float):
        self._module, self._delay = module, delay

    def nvmlInit(self):
        time.sleep(self._delay)
        return self._module.nvmlInit()

    def __getattr__(self, name):
        return getattr(self._module, name)


def test_slow_first_read_does_not_dilute_the_power(tmp_path):
    import asyncio

    from exporter.config import Config
    from exporter.idle.measure import measure
    from exporter.sources.nvml import NvmlSource
    from exporter.sources.rapl import RaplSource
    from tests.support.fake_gpus import load_fake_nvml

    gpus = FakeGpus(tmp_path / "gpus.json")
    gpus.add(A, power_mw=75_000, counter_follows_power=True, t0=time.monotonic())
    nvml = NvmlSource(module=SlowInitNvml(load_fake_nvml(gpus.path), delay=0.5))
    rapl = RaplSource(str(tmp_path / "no-powercap"))
    estimates, missing = asyncio.run(measure(Config(), [], 1.5, 0.0, 0.25, nvml=nvml, rapl=rapl,
                                             out=open(os.devnull, "w")))
    (g,) = [e for e in estimates if e.device == f"gpu:{A}"]
    # counted from the loop's start instead, 0.5 s of the 2 s would hold no energy: 75 W x 1.5/2 = 56 W
    assert g.watts == pytest.approx(75.0, rel=0.01)
    assert g.duration_seconds == pytest.approx(1.5, abs=0.3)
