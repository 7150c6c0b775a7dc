"""A real `kvwatt run` subprocess with the NVML double (PYTHONPATH) and a powercap tree: energy series on
/metrics, J/token against known power and token rate, a GPU lost mid-run, promtool-clean output."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from tests.support.daemon import KvwattDaemon
from tests.support.fake_gpus import FakeGpus
from tests.support.loopback import MetricsServer
from tests.support.powercap import ConstantPower, PowercapTree

A, B = "GPU-aaaa-e2e", "GPU-bbbb-e2e"
TOKENS_PER_SECOND = 500.0
GPU_WATTS = 300.0


def exposition(start: float) -> str:
    """A busy server whose generated tokens grow at exactly TOKENS_PER_SECOND on the monotonic clock."""
    tokens = int(TOKENS_PER_SECOND * (time.monotonic() - start))
    return (f'vllm:num_requests_running{{model_name="m",engine="0"}} 4\n'
            f'vllm:num_requests_waiting{{model_name="m",engine="0"}} 0\n'
            f'vllm:generation_tokens_total{{model_name="m",engine="0"}} {tokens}\n'
            f'vllm:prompt_tokens_total{{model_name="m",engine="0"}} {tokens * 3}\n')


@pytest.mark.prom
def test_daemon_exports_energy_and_isolates_a_lost_gpu(tmp_path):
    t0 = time.monotonic()
    gpus = FakeGpus(tmp_path / "gpus.json")
    gpus.add(A, power_mw=GPU_WATTS * 1000, counter_follows_power=True, t0=t0)
    gpus.add(B, power_mw=100_000, counter_follows_power=True, t0=t0)
    tree = PowercapTree(tmp_path / "host")
    host = ConstantPower(tree, tree.add_zone("package-0"), 80.0)
    host.start()
    config = {"powercap_root": tree.root, "windows": ["30s"], "min_load_duration": "3s",
              "idle_power_watts": {f"gpu:{A}": 50.0}}
    try:
        with MetricsServer(lambda: exposition(t0)) as vllm, \
                KvwattDaemon(servers={"a": {"url": vllm.url, "gpus": ["0"]}}, config=config, env=gpus.env(),
                             interval="250ms") as d:
            d.wait_for(lambda d: d.value("kvwatt_energy_per_token_joules", scope="gpu") is not None,
                       timeout=30, what="a J/token figure")
            time.sleep(2.0)
            assert d.value("kvwatt_source_up", source="nvml") == 1
            assert d.value("kvwatt_source_up", source="rapl") == 1
            assert d.value("kvwatt_gpu_energy_method_info", uuid=A, method="counter") == 1
            assert d.value("kvwatt_gpu_power_watts", uuid=A) == pytest.approx(GPU_WATTS)
            assert d.value("kvwatt_gpu_idle_power_watts", uuid=A) == 50.0
            assert d.value("kvwatt_host_energy_joules_total", zone="package-0", domain="package") > 0
            # GPU 0 only (server a lists it): 300 W / 500 tokens/s = 0.6 J/token; marginal (300-50)/500 = 0.5
            assert d.value("kvwatt_energy_per_token_joules", scope="gpu") == pytest.approx(0.6, rel=0.05)
            assert d.value("kvwatt_marginal_energy_per_token_joules", scope="gpu") == pytest.approx(0.5, rel=0.05)
            assert d.value("kvwatt_energy_per_token_joules", scope="host") == pytest.approx(80 / 500, rel=0.1)
            assert d.value("kvwatt_marginal_energy_per_token_joules", scope="host") is None  # no host baseline

            before = d.value("kvwatt_gpu_energy_joules_total", uuid=B)
            gpus.update(A, lost=True)
            d.wait_for(lambda d: d.value("kvwatt_source_info", source="nvml", state="degraded") is not None,
                       timeout=10, what="nvml degraded")
            info = [lab for (n, lab), v in d.metrics().items() if n == "kvwatt_source_info" and
                    ("source", "nvml") in lab]
            assert [dict(lab)["reason"] for lab in info] == ["gpu_lost"]  # the word; the details in /api/status
            nvml = {s["source"]: s for s in d.status()["sources"]}["nvml"]
            assert A in nvml["reason"] and "gpu lost" in nvml["reason"] and nvml["reason_code"] == "gpu_lost"
            assert d.value("kvwatt_gpu_energy_joules_total", uuid=A) is None  # not exported as 0 or frozen
            time.sleep(1.0)
            assert d.value("kvwatt_gpu_energy_joules_total", uuid=B) > before  # the other GPU goes on
            assert d.value("kvwatt_source_up", source="vllm", server="a") == 1  # and so does the daemon

            promtool = shutil.which("promtool")
            if promtool:
                r = subprocess.run([promtool, "check", "metrics"], input=d.metrics_text(), capture_output=True,
                                   text=True)
                assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    finally:
        host.stop.set()


def test_daemon_without_nvml_or_rapl_runs_on(tmp_path):
    gpus = FakeGpus(tmp_path / "gpus.json", library_found=False)
    with MetricsServer(lambda: exposition(time.monotonic())) as vllm, \
            KvwattDaemon(servers={"a": vllm.url}, env=gpus.env(), interval="250ms") as d:
        d.wait_for(lambda d: d.value("kvwatt_source_up", source="nvml") is not None, what="nvml status")
        assert d.value("kvwatt_source_up", source="nvml") == 0
        assert d.value("kvwatt_source_info", source="nvml", state="down", reason="absent") == 1
        nvml = {s["source"]: s for s in d.status()["sources"]}["nvml"]
        assert nvml["reason"] == "absent: NVML library (libnvidia-ml.so.1) not found"
        assert d.value("kvwatt_source_up", source="rapl") == 0
        assert d.value("kvwatt_source_up", source="vllm", server="a") == 1
        assert d.value("kvwatt_energy_per_token_joules", scope="gpu") is None
