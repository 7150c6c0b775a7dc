"""Data-parallel engines (hardening issue item 5): counter resets are tracked per engine, so one engine
vanishing, reappearing or restarting is not a whole-server restart. Before, the sum over engines dropped,
the store took the whole new sum as the step's increase, and a long-running server reported millions of
tokens per second for a true few thousand.

Real vLLM 0.32 expositions (tests/data/vllm-0.32-cpu/low-pressure), made data-parallel by relabelling
(tests/support/expositions.py), served over real loopback HTTP and read by the real EngineSource into the real
Model; the figures are the snapshot's."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from exporter.config import from_mapping
from exporter.model import Model
from exporter.samples import ServerRead, Tick
from exporter.sources.endpoint import EngineSource
from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from tests.conftest import FIXTURES
from tests.support.expositions import data_parallel, offset_counters
from tests.support.loopback import MetricsServer

LOW = [p.read_text() for p in sorted((FIXTURES / "low-pressure").glob("*.prom"))]
IDLE = (FIXTURES / "idle" / "000.prom").read_text()
SERVED_BEFORE = 1e7  # both engines had served 10M tokens (and preempted 10M times) before the captures

# engine "0" runs through the captures; engine "1" is there, vanishes, reappears, restarts (idle capture:
# counters from zero, no offset) and serves again
ENGINE1 = ["low0", "low1", None, "low3", "restart", "restart+low1"]


def _engine1(step: int) -> str | None:
    which = ENGINE1[step]
    if which is None:
        return None
    if which == "restart":
        return IDLE
    if which == "restart+low1":
        return LOW[1]
    return offset_counters(LOW[int(which[3:])], SERVED_BEFORE)


def exposition(step: int) -> str:
    return data_parallel(offset_counters(LOW[step], SERVED_BEFORE), _engine1(step))


def generated(text: str) -> float:
    return extract(parse(text)).counters["generation_tokens"]


def expected_deltas() -> list[float]:
    """Per interval: engine 0's increase, plus engine 1's where it was there at both ends and did not reset."""
    out = []
    for i in range(1, len(LOW)):
        d = generated(LOW[i]) - generated(LOW[i - 1])
        if ENGINE1[i] == "low1" or ENGINE1[i] == "restart+low1":
            d += generated(_engine1(i)) - generated(_engine1(i - 1))
        out.append(d)
    return out


def _read(src: EngineSource):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await src.read(session)
    return asyncio.run(go())


def test_the_data_parallel_exposition_has_two_engines():
    r = extract(parse(exposition(0)))
    assert set(r.engine_counters) == {"0", "1", ""}
    # "": the API server's own series, which carry no engine label (vllm:admission_rejections_total, 0.32)
    assert all(k.startswith("admission_rejections@") for k in r.engine_counters[""])
    assert r.counters["generation_tokens"] == 2 * (generated(LOW[0]) + SERVED_BEFORE)


def test_an_engine_vanishing_reappearing_or_restarting_gives_no_huge_rate(tmp_path):
    cfg = from_mapping({"servers": [{"name": "dp", "url": "http://127.0.0.1:1"}], "windows": ["1m"],
                        "state_dir": str(tmp_path), "powercap_root": str(tmp_path / "none"), "nvml": False})
    model = Model(cfg, wall_clock=lambda: 1.75e9)
    step = {"i": 0}
    with MetricsServer(lambda: exposition(step["i"])) as srv:
        src = EngineSource("dp", srv.url, 5.0, 1 << 24)
        for i in range(len(LOW)):
            step["i"] = i
            status, reading = _read(src)
            assert status.up and status.state == "ok", status
            model.ingest(Tick(float(i + 1), {"dp": ServerRead("dp", status, reading)}))
    history = model.servers["dp"].history
    got = [iv.deltas["generation_tokens"] for iv in history.intervals]
    assert got == pytest.approx(expected_deltas())
    assert max(got) < 2 * 3300  # one capture step is at most 3,224 tokens per engine; 1 s per interval
    assert all(iv.deltas["preemptions"] == 0 for iv in history.intervals)  # no preemption in the captures
    w = model.snapshot().servers[0].windows[0]
    assert w.generation_tokens_per_second == pytest.approx(sum(expected_deltas()) / (len(LOW) - 1))
    assert w.preemptions_per_minute == 0
