"""`kvwatt replay` against a server that is down, comes back, or whose sessions the context cap cuts, over real
HTTP on loopback: a closed port is "down", tests/support/loopback.py is the server.

- a server that is down at the start is named unreachable (with its redacted URL), not "pass --model";
- one that answers /v1/models without a model list asks for --model;
- --duration against a dead server backs off (OUTAGE_BACKOFF_*) instead of writing hundreds of error records
  a second, and says once that the server is not answering and once that it answers again;
- a session cut by --max-context does not wait its last turn's tool latency before the next session starts.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kvwatt_lab.replay.runner import OUTAGE_BACKOFF_MAX_SECONDS

from exporter.cli import main
from tests.support.experiment import FAKE_SERVER, SAMPLE_TRACES


def _free_port() -> int:
    with socket.socket() as s:  # bound and closed: nothing listens there until someone binds it again
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _fake_server(port: int, *flags: str):
    proc = subprocess.Popen([sys.executable, str(FAKE_SERVER), "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_server_that_is_down_is_named_unreachable_with_its_redacted_url(capsys):
    url = f"http://user:s3cret@127.0.0.1:{_free_port()}"
    code = main(["replay", str(SAMPLE_TRACES), "--url", url])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert f"the server at {url.replace('s3cret', 'xxxxx')} is unreachable" in err
    assert "pass --model" not in err and "s3cret" not in err


def test_a_server_without_a_model_list_asks_for_model(capsys):
    class NoModels(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"detail": "Not Found"}')

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NoModels)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = main(["replay", str(SAMPLE_TRACES), "--url", f"http://127.0.0.1:{server.server_address[1]}"])
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert "cannot list models at" in err and "HTTP 404" in err and "pass --model" in err


def test_duration_against_a_dead_server_backs_off_and_says_so_once(capsys, tmp_path):
    records = tmp_path / "r.jsonl"
    code = main(["replay", str(SAMPLE_TRACES), "--url", f"http://127.0.0.1:{_free_port()}", "--model", "m",
                 "--duration", "4s", "--concurrency", "4", "--retries", "0", "--length-scale", "0.01",
                 "--records", str(records)])
    err = capsys.readouterr().err
    rows = _rows(records)
    assert code == 1 and rows and all(r["status"] == "error" for r in rows)
    # without the backoff: one refused connection per millisecond or so (1,401 records in 3 s were seen);
    # with it: 4 sessions at once, then pauses of 0.5, 1, 2, 4 ... s shared by the workers
    assert len(rows) <= 20, len(rows)
    assert err.count("is not answering") == 1 and "answers again" not in err
    assert f"up to {OUTAGE_BACKOFF_MAX_SECONDS:g} s" in err


def test_a_server_that_comes_back_is_replayed_again_and_the_return_is_said_once(capsys, tmp_path):
    records, port = tmp_path / "r.jsonl", _free_port()
    with _fake_server(port, "--startup-seconds", "1.5", "--seconds-per-token", "0"):
        code = main(["replay", str(SAMPLE_TRACES), "--url", f"http://127.0.0.1:{port}", "--model", "fake",
                     "--duration", "8s", "--concurrency", "2", "--retries", "0", "--length-scale", "0.01",
                     "--latency-scale", "0.01", "--records", str(records)])
    err = capsys.readouterr().err
    statuses = [r["status"] for r in _rows(records)]
    assert code == 1 and "error" in statuses and "ok" in statuses  # down first, then served
    first_ok = statuses.index("ok")
    assert all(s == "error" for s in statuses[:first_ok])
    assert err.count("is not answering") == 1 and err.count("answers again") == 1


def test_a_session_cut_by_the_context_cap_does_not_wait_its_last_tool_latency(tmp_path):
    turns = [{"input_tokens": 10, "output_tokens": 5, "tool_latency_seconds": 3.0},
             {"input_tokens": 10, "output_tokens": 5, "tool_latency_seconds": 3.0},
             {"input_tokens": 1000, "output_tokens": 5, "tool_latency_seconds": 0.0}]  # never fits in 100
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"session": f"s{i}", "system_prompt_tokens": 0, "turns": turns}) + "\n"
                             for i in range(2)))
    records, summary, port = tmp_path / "r.jsonl", tmp_path / "s.json", _free_port()
    with _fake_server(port, "--seconds-per-token", "0") as proc:
        _wait_listening(port, proc)
        code = main(["replay", str(trace), "--url", f"http://127.0.0.1:{port}", "--model", "fake",
                     "--concurrency", "1", "--max-context", "100", "--records", str(records), "--summary",
                     str(summary)])
    rows = _rows(records)
    assert code == 0 and [(r["turn"], r["status"]) for r in rows] == [(0, "ok"), (1, "ok")] * 2
    assert [r["tool_latency_seconds"] for r in rows] == [3.0, 0.0, 3.0, 0.0]
    assert json.loads(summary.read_text())["sessions_cut_by_context"] == 2
    gap = rows[2]["start_offset_seconds"] - rows[1]["end_offset_seconds"]
    # relative to the 3 s tool latency it must not sleep: half of it, not a speed target
    assert gap < 1.5, f"the next session started {gap:.2f} s after the cut one (it slept the tool latency)"
    waited = rows[1]["start_offset_seconds"] - rows[0]["end_offset_seconds"]
    assert waited >= 2.9  # the latency inside the session is still waited


def _wait_listening(port: int, proc: subprocess.Popen, timeout_seconds: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the fake server exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"the fake server did not listen on {port} within {timeout_seconds} s")
