"""Plays a host's RAPL package counter for tests (no machine here has RAPL): a powercap zone
(tests/support/powercap.py) advanced by a known power model driven by a server's own counters:

    energy = idle_watts * elapsed + joules_per_token * generated tokens + joules_per_prefill_token * local_compute

A child process (a session and scheduler group of its own at a raised priority where allowed,
tests/support/niced.py come_first, so busy cores and other sessions do not stall it for seconds) runs two threads:
a writer puts the cumulative energy into ``energy_uj`` every 20 ms (idle energy accrues with the clock,
whatever the server does), and a poller reads the server's /metrics every 0.2 s and credits the tokens
generated since its last answer, so a slow /metrics delays only the token energy, by one poll. Servers come
and go (an experiment restarts its server per run): a counter that went down is a new server, re-based and
never credited negatively.

    driver = PowerDriver(tree, zone, "http://127.0.0.1:PORT", idle_watts=10, joules_per_token=0.02,
                         joules_per_prefill_token=0.005)
    driver.start(); ...; driver.stop()
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import requests

from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from tests.support.niced import come_first

WRITE_SECONDS = 0.02
POLL_SECONDS = 0.2  # each /metrics costs the API server ~50 KB of rendering: do not starve it
NICE = -10


class PowerDriver:
    def __init__(self, tree, zone: str, url: str, idle_watts: float, joules_per_token: float,
                 joules_per_prefill_token: float = 0.0):
        ctx = multiprocessing.get_context("fork")
        self.halt = ctx.Event()
        self.process = ctx.Process(target=_drive, daemon=True, args=(
            tree, zone, url.rstrip("/"), idle_watts, joules_per_token, joules_per_prefill_token, self.halt))

    def start(self) -> None:
        self.process.start()

    def stop(self) -> None:
        self.halt.set()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


def _drive(tree, zone, url, idle_watts, joules_per_token, joules_per_prefill_token, halt) -> None:
    come_first(NICE)  # its own scheduler group, raised: busy cores and other sessions do not stall it for seconds
    lock = threading.Lock()
    token_joules = [0.0]
    started, start_uj, max_uj = time.monotonic(), tree.energy_uj(zone), tree.max_range_uj(zone)

    def write() -> None:
        while not halt.wait(WRITE_SECONDS):
            with lock:
                joules = idle_watts * (time.monotonic() - started) + token_joules[0]
            tree.set_energy(zone, (start_uj + int(round(joules * 1e6))) % max_uj)

    def poll() -> None:
        last = _counters(url)
        while not halt.wait(POLL_SECONDS):
            now = _counters(url)
            if now is None:
                continue
            if last is not None and all(a >= b for a, b in zip(now, last)):
                with lock:
                    token_joules[0] += (joules_per_token * (now[0] - last[0])
                                        + joules_per_prefill_token * (now[1] - last[1]))
            last = now

    threads = [threading.Thread(target=write, daemon=True), threading.Thread(target=poll, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _counters(url: str) -> tuple[float, float] | None:
    try:
        text = requests.get(url + "/metrics", timeout=5).text
    except requests.RequestException:
        return None
    c = extract(parse(text)).counters
    if "generation_tokens" not in c:
        return None
    return c["generation_tokens"], c.get("prompt_local_compute", 0.0)
