"""Idle baseline and marginal J/token (methods.md s1) end to end on a REAL vLLM engine (the shared 2000-block one):
the engine generates tokens; a powercap tree (the test double for RAPL, which no machine here has) is advanced by a
known power model, idle W plus J per generated token, from the engine's own token counter polled at 20 Hz. kvwatt
must learn the idle baseline within 1 % of the model's and report the marginal J/token within 1 % of the model's
given that baseline (computed independently of kvwatt; within 5 % of the model's own)."""

import multiprocessing
import threading
import time

import pytest
import requests

from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from tests.support.daemon import KvwattDaemon
from tests.support.niced import come_first
from tests.support.powercap import PowercapTree
from tests.support.workload import drive

# the plain 2000-block engine, not LARGE_CACHE: on the engine with its residency record the marginal J/token read
# 2.2 % off in one run of four (0.7 % in another; never beyond 1 % on this engine in the runs before), most likely
# the double's token poll lagging behind a busier engine
# its 4k context is test_replay_engine's (vLLM's CPU batch stays 2,048 tokens whatever the context): one start
pytestmark = [pytest.mark.engine, pytest.mark.shares_engine(blocks=2000, max_model_len=4096)]
# ~100 W at this engine's ~3k tok/s. The double is advanced by a Python thread that can stall for a second on
# 2 busy cores and then write a catch-up burst; kept well under RAPL's 1 kW plausibility guard so that no
# burst is dropped as implausible (a real RAPL counter never stalls like that).
IDLE_WATTS, JOULES_PER_TOKEN = 40.0, 0.02


def tokens_now(url):
    return extract(parse(requests.get(url + "/metrics", timeout=5).text)).counters["generation_tokens"]


def _power_model(tree, zone, engine_url, halt, errors):
    """Child process: writes IDLE_WATTS * dt every 20 ms plus JOULES_PER_TOKEN for each token the engine
    generated (polled at 20 Hz in a second thread). A process of its own, because threads in the test
    process share the GIL with the load driver and stalled for seconds, then wrote bursts that kvwatt
    (rightly) dropped as implausible (> 1 kW). Its own scheduler group at a raised priority (come_first): a RAPL
    counter does not wait for the CPU."""
    come_first()
    state = {"seen": None}

    def tokens():
        return extract(parse(requests.get(engine_url + "/metrics", timeout=5).text)).counters["generation_tokens"]

    def poll():
        while not halt.wait(0.05):
            try:
                state["seen"] = tokens()
            except requests.RequestException:
                with errors.get_lock():
                    errors.value += 1

    state["seen"] = tokens()
    threading.Thread(target=poll, daemon=True).start()
    last_t, credited = time.monotonic(), state["seen"]
    while not halt.wait(0.02):
        now, seen = time.monotonic(), state["seen"]
        tree.advance(zone, IDLE_WATTS * (now - last_t) + JOULES_PER_TOKEN * (seen - credited))
        last_t, credited = now, seen


class EnginePower:
    def __init__(self, tree, zone, engine_url):
        ctx = multiprocessing.get_context("fork")
        self.halt, self._errors = ctx.Event(), ctx.Value("i", 0)
        self.proc = ctx.Process(target=_power_model, args=(tree, zone, engine_url, self.halt, self._errors),
                                daemon=True)

    @property
    def errors(self):
        return self._errors.value

    def start(self):
        self.proc.start()

    def join(self, timeout):
        self.proc.join(timeout)


def test_marginal_joules_per_token_and_idle_baseline_within_one_percent(tmp_path, engines):
    tree = PowercapTree(tmp_path / "host")
    zone = tree.add_zone("package-0")
    config = {"powercap_root": tree.root, "state_dir": str(tmp_path / "state"), "nvml": False,
              "idle_settle": "2s", "idle_min_duration": "30s", "min_load_duration": "30s", "windows": ["5m"]}
    engine = engines.get(blocks=2000, max_model_len=4096)
    power = EnginePower(tree, zone, engine.url)
    power.start()
    try:
        # 1. kvwatt learns P_idle from an idle stretch of the running server and persists it
        with KvwattDaemon(servers={"local": engine.url}, config=config, interval="500ms") as d:
            idle = d.wait_for(lambda d: d.value("kvwatt_host_idle_power_watts", zone="package-0",
                                                domain="package"), timeout=90, what="a learned baseline")
        assert idle == pytest.approx(IDLE_WATTS, rel=0.01)
        # 2. a restarted kvwatt starts with the persisted baseline; its window holds idle, the whole load
        #    (> 30 s) and idle again, so both window edges fall where no tokens flow
        with KvwattDaemon(servers={"local": engine.url}, config=config, interval="500ms") as d:
            reloaded = d.value("kvwatt_host_idle_power_watts", zone="package-0", domain="package")
            raw0 = (time.monotonic(), tree.energy_uj(zone), tokens_now(engine.url),
                    d.value("kvwatt_host_energy_joules_total", zone="package-0", domain="package"))
            time.sleep(3)
            start, rounds = time.monotonic(), 0
            while time.monotonic() - start < 36:
                drive(engine.url, sessions=10, turns=2)
                rounds += 1
            time.sleep(3)
            raw1 = (time.monotonic(), tree.energy_uj(zone), tokens_now(engine.url),
                    d.value("kvwatt_host_energy_joules_total", zone="package-0", domain="package"))
            marginal = d.value("kvwatt_marginal_energy_per_token_joules", server="local", scope="host",
                               window="5m")
            total = d.value("kvwatt_energy_per_token_joules", server="local", scope="host", window="5m")
            tps = d.value("kvwatt_generation_tokens_per_second", server="local", window="5m")
            covered = d.value("kvwatt_window_covered_seconds", server="local", window="5m")
            kvwatt_log = d.log()
            basis = d.status()["servers"][0]["windows"]["5m"].get("energy")
            diag = "\n".join(l for l in d.metrics_text().splitlines() if "energy" in l or "idle" in l
                              or "covered" in l or "tokens_per" in l)
    finally:
        power.halt.set()
        power.join(5)
    tokens = tps * covered
    # kvwatt's J/token is over the intervals that have energy (its basis in /api/status: seconds and tokens); a
    # late read of the double leaves an interval out (CI once: 41.0 of 42.5 s, total 1.5 % off the whole window's)
    assert basis and basis.get("host"), f"no host energy basis in /api/status: {basis}"
    priced = basis["host"]
    assert priced["seconds"] >= 0.9 * covered, (priced, covered)
    expected_total = JOULES_PER_TOKEN + IDLE_WATTS * priced["seconds"] / priced["generated_tokens"]
    print(f"\nidle {idle:.3f} W (model {IDLE_WATTS}), marginal {marginal} J/token (model {JOULES_PER_TOKEN}), "
          f"total {total} vs {expected_total:.6f}, {tokens:.0f} tokens over {covered:.1f} s, {rounds} rounds, "
          f"driver errors {power.errors}\nbasis {basis}\n"
          f"raw file {(raw1[1] - raw0[1]) / 1e6:.1f} J, "
          f"model {IDLE_WATTS * (raw1[0] - raw0[0]) + JOULES_PER_TOKEN * (raw1[2] - raw0[2]):.1f} J, "
          f"kvwatt counter {raw1[3] - raw0[3]:.1f} J over {raw1[0] - raw0[0]:.1f} s\n{diag}\n{kvwatt_log}")
    assert reloaded == pytest.approx(idle, rel=1e-9), "the persisted baseline did not survive the restart"
    assert marginal is not None, f"no marginal figure with > 30 s of load:\n{diag}"
    # the marginal subtracts the LEARNED baseline over the priced seconds, so the baseline's own error (within 1 %,
    # asserted above) moves it by (model W - learned W) x seconds / tokens: 3-4x the baseline's relative error at
    # this load (CI once: a 40.19 W baseline, 0.5 % high, gave 0.019695 J/token; the model's, given 40.19 W:
    # 0.019688). The model's marginal given that baseline is what kvwatt must report within 1 %.
    expected_marginal = JOULES_PER_TOKEN + (IDLE_WATTS - idle) * priced["seconds"] / priced["generated_tokens"]
    assert marginal == pytest.approx(expected_marginal, rel=0.01), (marginal, expected_marginal)
    assert marginal == pytest.approx(JOULES_PER_TOKEN, rel=0.05)  # and the model's own, within its baseline's sway
    # total J/token from the model alone: idle power over the window plus J/token, per generated token
    assert total == pytest.approx(expected_total, rel=0.01)
