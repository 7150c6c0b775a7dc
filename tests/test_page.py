"""The landing page (`/`, exporter.serve.page) in a real headless Debian chromium (tests/support/browser.py).

A real kvwatt Daemon (model, collector, aiohttp app with its connection guard) serves on a loopback port. It
is fed tick by tick with what the Sampler would hand it, built as tests/test_golden.py builds them: simulated
vLLM 0.33 expositions (tests/support/vllm_sim.py: no offloading vLLM runs on this CPU-only machine) and the
real vLLM 0.32 CPU captures, decoded by the real vLLM adapter, GPU energy from the simulation, a RAPL zone at
80 W. Replayed ticks, not the wall clock, so the figures on the page (and the screenshots) are exact.

(a) offload ON: the golden scenario (``on`` paired with its OFF twin ``off``, undersized buffer; ``cpu``
    down, then up with a few seconds of a 1-minute window covered);
(b) collapse: two ON servers that collapse after a steady stretch, one with its GPU's energy (the signature
    holds) and one without (power unknown: four conditions true, the signature unknown).

The assertions compare the rendered DOM with /api/status fetched over HTTP from the same daemon: one source
of truth. ``KVWATT_SCREENSHOTS=docs/images pytest tests/test_page.py`` also writes the README's screenshots.
"""

from __future__ import annotations

import asyncio
import html.parser
import io
import json
import os
import time
from pathlib import Path

import aiohttp
import pytest

from exporter.derive.collapse import CLASSIC, CONDITIONS, CollapseResult
from exporter.figures import ServerFigures, Snapshot, WindowFigures
from exporter.model import Model
from exporter.runtime.daemon import Daemon
from exporter.runtime.sampler import Sampler
from exporter.samples import SourceStatus
from exporter.serve import page
from exporter.serve.web import start_web, status_json
from tests import test_golden as golden
from tests.support import vllm_sim as sim
from tests.support.browser import Chromium
from tests.support.daemon import KvwattDaemon
from tests.support.engine import free_port
from tests.support.fake_gpus import FakeGpus
from tests.support.loopback import FakeVllm

SCREENSHOTS = os.environ.get("KVWATT_SCREENSHOTS")  # a directory: write the README's screenshots there
COLLAPSE_TICKS, STEADY_SECONDS = 240, 170.0


def _wall(t: float) -> float:
    return golden.WALL + t  # the daemon's wall clock follows the replayed ticks


class Replayed:
    """A Daemon stepped through a golden-style Scenario, serving its real web app on loopback."""

    def __init__(self, scenario: golden.Scenario):
        self.sc, self.t = scenario, 0
        self.daemon = Daemon(scenario.cfg, sampler=Sampler(scenario.cfg, energy=False),
                             model=Model(scenario.cfg, wall_clock=lambda: _wall(self.t)))
        self.url = ""

    def step_to(self, t: int) -> None:
        while self.t < t:
            self.t += 1
            self.daemon.step(self.sc.tick(self.t))

    async def __aenter__(self) -> "Replayed":
        port = free_port()
        self.runner = await start_web(self.daemon, "127.0.0.1", port)
        self.url = f"http://127.0.0.1:{port}/"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()

    async def status(self) -> dict:
        async with aiohttp.ClientSession() as s, s.get(self.url + "api/status") as r:
            return await r.json()


def _server(status: dict, name: str) -> dict:
    return next(s for s in status["servers"] if s["server"] == name)


async def _screenshot(b: Chromium, tmp_path: Path, name: str) -> None:
    """Always taken (a real PNG of the rendered page); kept in the docs when KVWATT_SCREENSHOTS says where."""
    png = await b.screenshot(tmp_path / name)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    if SCREENSHOTS:
        from PIL import Image  # matplotlib's dependency (the test extra)

        # a 128-colour palette keeps the page's colours (octree: median cut loses the few red text pixels) and
        # each file under 300 KB
        img = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=128, method=Image.Quantize.FASTOCTREE,
                                                                   dither=Image.Dither.NONE)
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        img.save(Path(SCREENSHOTS) / name, optimize=True)


def _pct(x: float, signed: bool = False) -> str:
    return f"{x * 100:{'+' if signed else ''}.1f} %"


# --- (a) offload ON -------------------------------------------------------------------------------------------
@pytest.mark.browser
def test_offload_on_page_in_chromium(tmp_path):
    asyncio.run(_offload_on(tmp_path))


async def _offload_on(tmp_path):
    rep = Replayed(golden.Scenario(tmp_path))
    rep.step_to(golden.CPU_FROM - 1)  # cpu not answering yet
    async with rep, Chromium() as b:
        await b.goto(rep.url + "?cpu-down")
        await _down_panel(b, await rep.status(), "cpu")
        await _chips_match_meaning(b, await rep.status())
        rep.step_to(golden.CPU_FROM + 1)  # cpu: two captures, one interval of its 1m window
        await b.goto(rep.url)
        await b.eval("window.notReloaded = true")
        st = await rep.status()
        assert await b.text("#as-of") == f"Figures as of {st['as_of']} (the daemon's last tick)."
        cpu = "#server-cpu "
        assert "1 of 60 s covered" in await b.text(cpu + "[data-field=joules-per-token]")

        # the page refreshes itself: the daemon moves on, the DOM follows without a reload
        rep.step_to(golden.TICKS)
        st = await rep.status()
        await b.wait_for(f"document.getElementById('as-of').innerText.includes({json.dumps(st['as_of'])})",
                         what="the page to refresh itself")
        assert await b.eval("window.notReloaded === true")
        assert "5 of 60 s covered" in await b.text(cpu + "[data-field=joules-per-token]")

        on, s_on = "#server-on ", _server(st, "on")
        paired = s_on["windows"]["1m"]["energy_saving"]["paired"]
        assert await b.text(on + "[data-field=dE]") == (f"Yes: offloading saves {_pct(paired['dE'], True)} ± "
                                                        f"{_pct(paired['dE_stderr'])} (standard error) of the "
                                                        "GPU energy above idle per generated token.")
        basis = await b.text(on + "[data-field=dE-basis]")
        assert basis.startswith("paired: measured against the paired OFF server")
        assert f"{paired['windows']} repeat windows over the last 1m (60 of 60 s covered)" in basis
        assert f"Throughput {_pct(paired['dTPS'], True)} ± {_pct(paired['dTPS_stderr'])}" in basis
        estimated = s_on["windows"]["1m"]["energy_saving"]["estimated"]
        assert f"estimated: {_pct(estimated['dE'], True)} ± {estimated['dE_stderr'] * 100:.2g} %" in \
            await b.text(on + "[data-field=other-dE]")
        gpu = s_on["windows"]["1m"]["energy"]["gpu"]
        jpt = await b.text(on + "[data-field=joules-per-token]")
        assert f"GPU {gpu['marginal_joules_per_token']:.3g} J marginal" in jpt
        host = s_on["windows"]["1m"]["energy"]["host"]
        assert f"{gpu['joules_per_token']:.3g} J in total; host {host['marginal_joules_per_token']:.3g} J" in jpt

        buf = s_on["offload_buffer"]
        assert buf["recommended_gib"] == 27
        assert await b.text(on + "[data-field=recommended-buffer]") == "27 GiB"
        text = await b.text(on + "[data-field=buffer]")
        assert f"{buf['residency_seconds']:.1f}" == "8.9" and buf["p99_tool_latency_seconds"] == 20
        assert await b.text(on + "[data-field=buffer-verdict]") == "Offload buffer: undersized"
        assert "8 GiB holds 8.9 s of writes at 0.9 GiB/s" in text
        assert "tool-call latency it must outlast is 20 s" in text
        assert "--kv-offloading-size 27" in await b.text(on + "[data-field=recommendations]")
        pressure = await b.text(on + "[data-field=pressure]")
        w30 = s_on["windows"]["30s"]
        lo, hi = w30["kv_usage_p95_interval"]
        # the regime with what it rests on, then the p95 and the threshold as facts beside it
        assert pressure.startswith("KV pressure over the last 30s: above: requests waiting for KV capacity in 100 % "
                                   "of samples (mean 2.0); 6.0 preemptions/min.")
        assert (f"KV-cache usage p95 {_pct(w30['kv_usage_p95'])} ({_pct(lo)}–{_pct(hi)}) over the last 30s; "
                "threshold in use 90.0 %.") in pressure and "the configured one" in pressure
        assert "Requests waiting for KV capacity: 2 on average, in 100.0 % of samples." in pressure
        assert "Preemptions: 6 per minute (preemption onset" in pressure

        assert await b.text(on + "[data-field=signature]") == "no"
        for name, want in s_on["collapse"]["conditions"].items():
            state = await b.text(f"{on}tr[data-condition={name}] .state")
            assert state == {True: "true", False: "false", None: "unknown"}[want], (name, state)

        off = "#server-off "
        potential = _server(st, "off")["windows"]["1m"]["energy_saving"]["potential"]
        text = await b.text(off + "[data-field=dE]")
        assert text.startswith("Offloading is off here") and _pct(potential["dE"], True) in text
        tax = await b.text(off + "[data-field=recompute-tax]")
        w = _server(st, "off")["windows"]["1m"]
        assert f"{w['recompute_tax'] * 100:+.1f} points" in tax and "3.9 %" in tax and "configured" in tax

        # off ramps from low to high pressure: its own threshold is located and the regime flag uses it
        s_off = _server(st, "off")
        loc = s_off["threshold_located"]
        assert s_off["threshold_source"] == "located" and loc["method"] == "preemption_onset"
        pressure = await b.text(off + "[data-field=pressure]")
        assert (f"this server's own, located at {_pct(loc['ratio'])} ({_pct(loc['low'])}–{_pct(loc['high'])}) "
                f"from {loc['windows']} windows of its history: the KV-usage p95 above which preemptions began"
                ) in pressure
        assert f"threshold in use {_pct(s_off['threshold_in_use'])}" in pressure

        for src in ("nvml", "rapl", "state_dir"):
            assert (await b.text(f"[data-source={src}]")).endswith(": ok")
        await _chips_match_meaning(b, st)
        assert await b.text("#server-cpu [data-field=dE]") == \
            "Unknown (potential dE): no low-pressure reference share yet (learned or configured)."
        await _screenshot(b, tmp_path, "landing-offload-on.png")


# --- what the colours mean ------------------------------------------------------------------------------------
SOURCE_MEANING = {"ok": "good", "down": "bad", "degraded": "unknown"}


def _condition_meaning(name: str, v, c: dict) -> str:
    """What a collapse condition's value means to an operator (methods.md s5), stated here independently of
    the page: a fact is neutral; while the signature holds every true condition but a fact is part of it."""
    if v is None:
        return "unknown"
    if name == "offload_enabled":
        return "neutral"
    if v and c["signature"]:
        return "bad"
    if name == "zero_preemptions":
        return "good" if v else "bad"
    if name == "throughput_collapsed":
        return "bad" if v else "good"
    if name == "engine_steps_stopped":  # steps stopped on an idle server (nothing pending) is no stall
        return ("bad" if c["conditions"].get("requests_pending") else "neutral") if v else "good"
    return "neutral"


CHIPS_JS = """Array.from(document.querySelectorAll('.chip'), e => ({
  classes: Array.from(e.classList), meaning: e.dataset.meaning || null, text: e.innerText,
  server: (e.closest('article.server') || {dataset: {}}).dataset.server || null,
  condition: (e.closest('tr[data-condition]') || {dataset: {}}).dataset.condition || null,
  source: e.dataset.source || null, health: !!e.closest('[data-field=health]'),
  background: getComputedStyle(e).backgroundColor, color: getComputedStyle(e).color}))"""


async def _chips_match_meaning(b: Chromium, st: dict) -> None:
    """Every chip on the page has one meaning class, the one its value means in /api/status, and each meaning
    has one colour of its own."""
    servers = {s["server"]: s for s in st["servers"]}
    sources = {x["source"]: x for x in st["sources"]}
    colours: dict[str, set] = {}
    chips = await b.eval(CHIPS_JS)
    assert chips
    for chip in chips:
        meanings = [c for c in chip["classes"] if c in page.MEANINGS]
        assert len(meanings) == 1 and meanings[0] == chip["meaning"], chip
        if chip["source"]:
            want = SOURCE_MEANING[sources[chip["source"]]["state"]]
        elif chip["condition"]:
            c = servers[chip["server"]]["collapse"]
            want = _condition_meaning(chip["condition"], c["conditions"][chip["condition"]], c)
        elif chip["server"]:  # the panel's up/DOWN chip and its vLLM /metrics health chip
            want = SOURCE_MEANING[servers[chip["server"]]["state"]]
        else:
            want = "unknown"  # "no energy source read"
        assert chip["meaning"] == want, chip
        colours.setdefault(want, set()).add((chip["background"], chip["color"]))
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({next(iter(c)) for c in colours.values()}) == len(colours), colours  # a colour per meaning


async def _down_panel(b: Chromium, st: dict, name: str) -> None:
    """A server kvwatt cannot read: DOWN in red, and What do I do? says what to check, never Nothing to do."""
    s = _server(st, name)
    assert not s["up"] and [a["kind"] for a in s["advice"]] == ["server_down"]
    panel = f"#server-{name} "
    assert await b.text(panel + "h2 .chip") == "DOWN"
    todo = await b.text(panel + "[data-field=recommendations]")
    assert "Nothing to do" not in todo and "--server NAME=URL" in todo and "engine process" in todo
    assert s["reason"] in todo
    assert await b.eval(f"document.querySelector('{panel}[data-kind=server_down]').className") == "bad"


# --- (b) collapse ---------------------------------------------------------------------------------------------
def _collapse_scenario(tmp_path) -> golden.Scenario:
    gpu = ("0", "GPU-stalled")
    mapping = {
        "servers": [{"name": "stalled", "url": "http://stalled.invalid:8000", "gpus": [gpu[1]]},
                    {"name": "stalled-no-gpu", "url": "http://stalled-no-gpu.invalid:8000", "gpus": []}],
        "windows": ["30s", "2m"], "min_load_duration": "10s", "collapse_reference_window": "2m",
        "idle_power_watts": {gpu[1]: sim.IDLE_WATTS}, "state_dir": str(tmp_path / "state"),
        "powercap_root": str(tmp_path / "no-powercap"), "nvml": False,
    }
    inputs = golden.Inputs({"stalled": sim.collapsing_on(steady_seconds=STEADY_SECONDS),
                            "stalled-no-gpu": sim.collapsing_on(steady_seconds=STEADY_SECONDS, seed=12)},
                           cpu=False, sgl=False)
    return golden.Scenario(tmp_path, mapping, inputs, gpus={"stalled": gpu})


@pytest.mark.browser
def test_collapse_page_in_chromium(tmp_path):
    asyncio.run(_collapse(tmp_path))


async def _collapse(tmp_path):
    rep = Replayed(_collapse_scenario(tmp_path))
    rep.step_to(COLLAPSE_TICKS)
    async with rep, Chromium() as b:
        await b.goto(rep.url)
        st = await rep.status()
        stalled, blind = _server(st, "stalled"), _server(st, "stalled-no-gpu")
        assert stalled["collapse"]["signature"] is True and blind["collapse"]["signature"] is None

        s = "#server-stalled "
        assert await b.text(s + "[data-field=signature]") == "YES"
        de = await b.text(s + "[data-field=dE]")  # a stalled GPU's cheap marginal J/token is not a saving
        assert de.startswith("No, whatever dE says: dE +") and "the collapse signature holds" in de
        assert [await b.text(f"{s}tr[data-condition={c}] .state") for c in CLASSIC] == ["true"] * 5
        # the simulated stall still steps (a trickle of tokens): the classic set fired, not stalled_engine
        assert await b.text(f"{s}tr[data-condition=engine_steps_stopped] .state") == "false"
        assert stalled["collapse"]["condition_set"] == "classic"
        assert "Collapse signature" in await b.text(s + "[data-field=recommendations]")
        assert "GPU 180 W, idle 150 W" in await b.text(f"{s}tr[data-condition=power_near_idle]")
        assert await b.text(s + "[data-field=buffer-verdict]") == "Offload buffer: not undersized"
        assert "64 GiB, no offload writes in the shortest window" in await b.text(s + "[data-field=buffer]")

        n = "#server-stalled-no-gpu "
        assert await b.text(n + "[data-field=signature]") == "unknown"
        states = {c: await b.text(f"{n}tr[data-condition={c}] .state") for c in CONDITIONS}
        assert states == {**dict.fromkeys(CLASSIC, "true"), "power_near_idle": "unknown",
                          "engine_steps_stopped": "false"}, states
        row = await b.text(f"{n}tr[data-condition=power_near_idle]")
        assert "no GPU energy or no idle baseline" in row
        banner = await b.text(n + "[data-field=collapse]")
        assert "none" not in banner.lower() and "unknown" in banner
        assert "GPU unknown (no GPU energy samples" in await b.text(n + "[data-field=joules-per-token]")
        assert "Some checks are unknown (collapse signature)" in await b.text(n + "[data-field=recommendations]")
        assert "Nothing to do" not in await b.text(n + "[data-field=recommendations]")
        await _chips_match_meaning(b, st)
        await _screenshot(b, tmp_path, "landing-collapse.png")


# --- the page of a `kvwatt run` subprocess ---------------------------------------------------------------------
@pytest.mark.browser
def test_page_of_kvwatt_run_refreshes_in_chromium(tmp_path):
    """The whole path in real time: a simulated offloading vLLM on loopback (tests/support/loopback.py), the NVML
    double driven by it, `kvwatt run` as a subprocess, chromium loading `/` before the figures exist and
    following them as the page refreshes itself."""
    gpus = FakeGpus(tmp_path / "gpus.json")
    cfg = {"windows": ["10s", "30s"], "min_load_duration": "5s", "idle_power_watts": {"GPU-on": sim.IDLE_WATTS}}
    with FakeVllm(sim.undersized_buffer_on()) as fv:
        fv.attach_gpu(gpus, "GPU-on")
        with KvwattDaemon(servers={"on": {"url": fv.url, "gpus": ["GPU-on"]}}, config=cfg, env=gpus.env(),
                          interval="250ms") as d:
            asyncio.run(_live(d))


async def _live(d: KvwattDaemon):
    async with Chromium() as b:
        await b.goto(d.url + "/")
        await b.eval("window.notReloaded = true")
        first = await b.text("#as-of")
        await b.wait_for(f"document.getElementById('as-of').innerText != {json.dumps(first)}", timeout=90,
                         what="the page to refresh itself")
        await b.wait_for("(e => e && e.innerText == 'Offload buffer: undersized')"
                         "(document.querySelector('#server-on [data-field=buffer-verdict]'))", timeout=90,
                         what="the undersized buffer on the page")
        assert await b.eval("window.notReloaded === true")  # followed by the page's own refresh
        shown, seen = await _shown_and_served(
            b, d, "#server-on [data-field=recommended-buffer]",
            lambda st: f"{_server(st, 'on')['offload_buffer']['recommended_gib']:.12g} GiB")
        assert shown in seen, (shown, seen)  # the page shows what /api/status served for the same tick
        assert (await b.text("[data-source=nvml]")) == "GPU energy (NVML): ok"
        assert "of 30 s covered" in await b.text("#server-on [data-field=joules-per-token]")
        assert (await b.text("#as-of")).startswith("Figures as of 20")
        from tests.test_page_words import internal_terms  # (that module imports this one)
        assert internal_terms(await b.eval("document.body.innerText")) == []  # plain words, as chromium shows them


async def _shown_and_served(b, d: KvwattDaemon, selector: str, served, seconds: float = 30.0):
    """(the page's text at ``selector``, the values /api/status served in the second the page's figures are as
    of). The page shows the snapshot of its last refresh, /api/status the latest tick's (every 250 ms here): the
    two are compared within one as-of second (it names no finer time), status read every 0.1 s so that every
    tick of that second is seen (a figure read once from each moved from 27 to 28 GiB between them in a CI-like
    run here)."""
    seen: dict[str, set] = {}
    deadline = time.monotonic() + seconds
    while True:
        st = d.status()
        seen.setdefault(st["as_of"], set()).add(served(st))
        as_of, shown = await b.text("#as-of b"), await b.text(selector)
        if (as_of in seen and shown in seen[as_of]) or time.monotonic() > deadline:
            return shown, seen.get(as_of, set())
        await asyncio.sleep(0.1)


# --- without a browser: every figure unknown ------------------------------------------------------------------
class _Parser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.text: list[str] = []

    def handle_data(self, data):
        self.text.append(data)


def _all_unknown_snapshot() -> Snapshot:
    down = SourceStatus(source="vllm", server="x", up=False, reason="unreachable: connection refused",
                        duration_seconds=0.0, state="down")
    collapse = CollapseResult(conditions=dict.fromkeys(CONDITIONS), signature=None, reason="unknown: everything",
                              details={c: "not enough samples in the recent window" for c in CONDITIONS})
    server = ServerFigures("x", "http://x.invalid:8000", down, None, 0.9, None, "none",
                           (WindowFigures("1m", 60.0, 0.0), WindowFigures("5m", 300.0, 0.0)), collapse)
    sources = (SourceStatus(source="nvml", server="", up=False, reason="no NVML library", duration_seconds=0.0,
                            state="down"),)
    return Snapshot(1.0, golden.WALL, (server,), sources)


def test_page_survives_a_snapshot_of_unknowns():
    text = page.render(status_json(_all_unknown_snapshot()))
    p = _Parser()
    p.feed(text)
    words = " ".join(" ".join(p.text).split())
    assert "DOWN" in words and "unreachable: connection refused" in words
    assert "Throughput collapse: unknown" in words
    assert words.count("unknown") >= 20  # every figure of both windows and every condition
    assert "Unknown: kvwatt cannot tell whether this server offloads (the server has not answered yet)" in words
    assert "0 of 300 s covered" in words and "GPU energy (NVML): down (no NVML library)" in words
    assert "none" not in words.lower()  # an unknown never reads "none"


def test_page_escapes_what_it_shows():
    snap = _all_unknown_snapshot()
    bad = "<script>alert(1)</script>"
    server = snap.servers[0]
    status = SourceStatus(source="vllm", server="x", up=False, reason=f"unreachable: {bad}", duration_seconds=0.0,
                          state="down")
    snap = Snapshot(1.0, golden.WALL, (ServerFigures(f"x{bad}", server.url, status, None, 0.9, None, "none",
                                                    server.windows, server.collapse),), snap.sources)
    text = page.render(status_json(snap))
    assert bad not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text


def test_page_before_the_first_tick():
    text = page.render(status_json(None))
    assert "has not completed its first sampling tick" in text and "<script>" in text


def test_dE_verdict_words():
    from exporter.figures import SavingFigure

    def verdict(de, se):
        return SavingFigure(baseline="paired", energy_saving=de, energy_saving_stderr=se, windows=6).verdict

    assert verdict(None, None) == "unknown"
    assert verdict(0.02, 0.011) == "within_noise" and verdict(-0.02, 0.011) == "within_noise"
    assert verdict(0.02, 0.0099) == "saves" and verdict(-0.02, 0.0099) == "costs"
    assert verdict(0.3, None) == "saves"  # no SE (one window): the sign, and the page says the SE is unknown
    # a dE of exactly 0 (the demo's offloading twin before it reloaded anything: estimated dE 0.0 ± 0.0) saves
    # nothing and costs nothing: never "offloading costs energy ... (more GPU energy per generated token)"
    assert verdict(0.0, 0.0) == "within_noise" and verdict(0.0, None) == "within_noise"
    assert verdict(-1e-9, 0.0) == "costs" and verdict(1e-9, 0.0) == "saves"
