"""`kvwatt demo` over its whole story (quiet, pressure, stalled, recovered; 150 s at --speed 1, played here at
--speed 3: every frame still passes through the daemon, in a third of the CI's time) shows no figure
outside its declared bounds: a real headless chromium reads the page every few seconds (every share on it within
0-100 %), /api/status lists no implausible figure, and at the end kvwatt_figures_rejected_total is 0 for every
family (the one check, exporter/catalog/bounds.py, saw every figure of every tick). Before the bounds and the pricing
fix
the first screen said "recomputation share of GPU energy 261.6 %" (up to 3,093 % in the pressure act).

The demo's engines replay a real capture and its GPUs are simulated BY DESIGN (docs/demo.md). Its tiered server's
disk tier (tier="1:fs", the engine's own tiering series) shows read traffic on /metrics over the story."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest
import requests

from exporter import catalog
from exporter.catalog import bounds
from exporter.commands.demo import OFF  # the demo's server without offloading: the one a potential dE prices
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
            seen["reference_of"].update({x["server"]: x.get("reference_state")
                                         for x in status["servers"]})
            metrics = parse_exposition(requests.get(url + "/metrics", timeout=5).text)
            seen["energy_share"] += [v for (n, _), v in metrics.items() if n == "kvwatt_recompute_energy_share_ratio"]
            _read_de_against_the_tax(metrics, seen)
            seen["gpu"].append((time.monotonic(), {dict(lb)["uuid"]: v for (n, lb), v in metrics.items()
                                                   if n == "kvwatt_gpu_energy_joules_total"}))
            seen["gpu_watts"] += [v for (n, _), v in metrics.items() if n == "kvwatt_gpu_power_watts"]
            seen["disk_reads"] += [v for (n, lb), v in metrics.items()
                                   if n == "kvwatt_offload_tier_read_bytes_per_second"
                                   and dict(lb).get("server") == "demo-tiered" and dict(lb).get("tier") == "1:fs"]
            await asyncio.sleep(1.5)


def _read_de_against_the_tax(metrics: dict, seen: dict) -> None:
    """Each (server, window) read with both: the potential dE over the recompute energy share it prices (the tax
    in GPU energy, kvwatt_recompute_energy_share_ratio{scope="gpu"}). By construction dE = (1 - J_r/J_c) x the
    share (exporter/derive/economics.potential); the first demo read under half of it in 70 of 70 reads."""
    de = {(dict(lb)["server"], dict(lb)["window"]): v for (n, lb), v in metrics.items()
          if n == "kvwatt_energy_saving_ratio" and dict(lb).get("baseline") == "potential"}
    for (n, lb), share in metrics.items():
        lb = dict(lb)
        key = (lb.get("server"), lb.get("window"))
        if n == "kvwatt_recompute_energy_share_ratio" and lb.get("scope") == "gpu" and share > 0.01:
            if key in de:
                seen["de_over_share"].append((de[key] / share, key, de[key], share))
            if key[0] == OFF:  # the server without offloading: its dE is the potential one
                seen["off_taxed"].append((key, share, key in de))


def _gpu_watts_over_windows(reads: list, seconds: float = 10.0) -> float:
    """The highest mean power of any simulated GPU between two reads at least ``seconds`` apart (its energy
    counter's difference), over the whole story."""
    best = 0.0
    for i, (t0, e0) in enumerate(reads):
        later = [(t, e) for t, e in reads[i + 1:] if t - t0 >= seconds]
        if later:
            t1, e1 = later[0]
            best = max([best] + [(e1[u] - e0[u]) / (t1 - t0) for u in e0 if u in e1])
    return best


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
    seen: dict = {"shares": 0, "bad": [], "energy_share": [], "references": set(), "de_over_share": [], "gpu": [],
                  "gpu_watts": [], "disk_reads": [], "off_taxed": [], "reference_of": {}}
    try:
        asyncio.run(_read_page_over_the_story(url, seen))
        metrics = parse_exposition(requests.get(url + "/metrics", timeout=5).text)
    finally:
        proc.terminate()
        proc.wait(30)
    log = log_path.read_text()
    # a relation today's derivations break, to be fixed on another branch (fuzz_engine.PENDING_RELATIONS, empty
    # since issue 37's fixes merged), serves its derived figure as unknown: the check doing its job
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
    # issue 37: no read shows the potential dE under half of the tax share it prices; no simulated GPU above
    # 1,000 W (its enforced limit 700 W) over any 10 s, nor in its power reading (on the code before: no read had
    # a reference share in one run on this loaded machine; the unit test is tests/test_economics_sums.py)
    # Read beside every tax the server without offloading showed: the potential is its dE (the offloading
    # servers' dE is paired or estimated, never potential, so their shares are no premise here; counting them
    # failed the test on a loaded runner where the no-offload server's reference stayed unknown all story).
    ratios, off_taxed = seen["de_over_share"], seen["off_taxed"]
    # every such read, not one: a 30 s window holding no whole repeat window once showed the tax alone (3 of 64)
    assert all(beside for *_, beside in off_taxed), ([t for t in off_taxed if not t[2]][:5], seen["reference_of"])
    assert all(r >= 0.5 for r, *_ in ratios), min(ratios)
    watts = _gpu_watts_over_windows(seen["gpu"])
    assert 0 < watts <= 1000.0 and 0 < max(seen["gpu_watts"]) <= 1000.0, (watts, max(seen["gpu_watts"]))
    # the power reading and the energy counter tell one story (the first demo: 859 W over 10 s beside 70 W)
    assert watts <= 1.5 * max(seen["gpu_watts"]), (watts, max(seen["gpu_watts"]))
    # issue 41 item 5: the tiered server's disk tier ("1:fs", the engine's own tiering series) reads on /metrics
    assert seen["disk_reads"] and max(seen["disk_reads"]) > 0, seen["disk_reads"][-5:]
    print(f"\ndE/share over {len(ratios)} reads: min {min(ratios)[0] if ratios else None}, max "
          f"{max(ratios)[0] if ratios else None}; GPU W over 10 s: max {watts:.0f}; power reading max "
          f"{max(seen['gpu_watts']):.0f} W; {OFF} taxed in {len(off_taxed)} reads; references {seen['reference_of']}")


def _pending(text: str) -> bool:
    return any(f"inconsistent: {name}:" in text for name in PENDING_RELATIONS)


def _pending_series(labels: dict) -> bool:
    pending = {f for rel in bounds.RELATIONS if rel.name in PENDING_RELATIONS for f in (rel.name, *rel.unknown)}
    return labels.get("reason") == bounds.RELATION and labels.get("figure") in pending
