"""`kvwatt replay` bad input: one line on stderr, exit status 2, before any request is sent."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from exporter.cli import main

SAMPLE = Path(__file__).parent / "data" / "office_work_8k.sample.jsonl"


def _closed_port_url() -> str:
    with socket.socket() as s:  # bound and closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _run(capsys, *argv) -> tuple[int, str]:
    code = main(["replay", *argv])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "0"], "--concurrency: must be >= 1"),
    (["--rate", "-1"], "--rate: must be > 0"),
    (["--rate", "nan"], "--rate: must be > 0"),
    (["--rate", "2", "--concurrency", "2"], "--rate and --concurrency: choose one"),
    (["--length-scale", "0"], "--length-scale: must be > 0"),
    (["--latency-scale", "-0.5"], "--latency-scale: must be >= 0"),
    (["--max-context", "0"], "--max-context: must be >= 1"),
    (["--max-sessions", "0"], "--max-sessions: must be >= 1"),
    (["--retries", "-1"], "--retries: must be >= 0"),
    (["--duration", "soon"], "--duration: expected a duration"),
    (["--token-id-range", "5:5"], "--token-id-range: expected 0 <= LOW < HIGH"),
    (["--token-id-range", "abc"], "--token-id-range: expected LOW:HIGH"),
    (["--system-prompt-tokens", "-3"], "--system-prompt-tokens: must be >= 0"),
    (["--url", "localhost:8000"], "--url: expected http(s)://HOST:PORT"),
    (["--max-context", "10"], "--max-context: no session's first turn fits in 10 tokens"),
    (["--format", "sessions"], "line 1: session: expected a non-empty string"),
])
def test_bad_flags_exit_2_with_one_line(capsys, flags, message):
    code, err = _run(capsys, str(SAMPLE), "--url", _closed_port_url(), *flags)
    assert code == 2
    assert err.count("\n") == 1 and message in err


def test_missing_trace_file(capsys, tmp_path):
    code, err = _run(capsys, str(tmp_path / "absent.jsonl"), "--url", _closed_port_url())
    assert code == 2 and "absent.jsonl: cannot read" in err and err.count("\n") == 1


def test_malformed_line_names_its_number(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    good = SAMPLE.read_text().splitlines()[0]
    trace.write_text(f"{good}\n\n{good}\n{{\"num_turns\": 1}}\n")
    code, err = _run(capsys, str(trace), "--url", _closed_port_url())
    assert code == 2 and "t.jsonl line 4: missing input_prompt_length" in err


def test_unwritable_records_path(capsys, tmp_path):
    code, err = _run(capsys, str(SAMPLE), "--url", _closed_port_url(), "--records", str(tmp_path / "no" / "r.jsonl"))
    assert code == 2 and "--records: cannot write" in err


def test_unreachable_server_is_one_line_exit_1(capsys, tmp_path):
    code, err = _run(capsys, str(SAMPLE), "--url", _closed_port_url(), "--records", str(tmp_path / "r.jsonl"))
    assert code == 1 and "is unreachable" in err and "pass --model" not in err and err.count("\n") == 1


def test_requests_that_cannot_connect_are_retried_and_recorded(capsys, tmp_path):
    records, summary = tmp_path / "r.jsonl", tmp_path / "s.json"
    code = main(["replay", str(SAMPLE), "--url", _closed_port_url(), "--model", "m", "--max-sessions", "2",
                 "--concurrency", "2", "--retries", "2", "--retry-backoff", "0.01", "--length-scale", "0.01",
                 "--records", str(records), "--summary", str(summary)])
    assert code == 1
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(rows) == 2  # each session stops at its failed first turn; nothing silently dropped
    assert all(r["status"] == "error" and r["attempts"] == 3 and r["turn"] == 0 for r in rows)
    assert all("ClientConnectorError" in r["error"] or "Connect" in r["error"] for r in rows)
    s = json.loads(summary.read_text())
    assert (s["requests"], s["ok"], s["failed"], s["sessions_started"]) == (2, 0, 2, 2)
    assert "2 requests, 0 ok, 2 failed" in capsys.readouterr().out


def test_credentials_in_the_url_appear_in_no_message_or_summary(capsys, tmp_path):
    """The --url's password goes to the server (aiohttp sends URL userinfo as basic auth), never into the
    error line or the summary file (exporter.config.redacted_url)."""
    url = _closed_port_url().replace("http://", "http://user:s3cret@")
    code, err = _run(capsys, str(SAMPLE), "--url", url.replace("127.0.0.1:", "127.0.0.1:x"))
    assert code == 2 and "--url:" in err and "s3cret" not in err and "user:xxxxx@" in err
    summary = tmp_path / "s.json"
    code = main(["replay", str(SAMPLE), "--url", url, "--model", "m", "--max-sessions", "1", "--retries", "0",
                 "--length-scale", "0.01", "--records", str(tmp_path / "r.jsonl"), "--summary", str(summary)])
    out = capsys.readouterr()
    assert code == 1 and "s3cret" not in out.out + out.err
    s = json.loads(summary.read_text())
    assert s["url"] == url.replace("s3cret", "xxxxx") and "s3cret" not in summary.read_text()


def test_the_summary_line_names_cut_and_skipped_sessions():
    from kvwatt_lab.replay.records import Stats, summary_line
    counts = dict(sessions_started=739, sessions_finished=739, sessions_completed=233, sessions_cut_by_context=506,
                  sessions_skipped_by_context=4, max_in_flight_requests=8)
    line = summary_line(Stats().summary(10.0, **counts))
    assert line.count("\n") == 0 and line.endswith(
        "; sessions 739 started, 233 completed, 506 cut by --max-context, 4 skipped (first turn over --max-context)")
    counts.update(sessions_cut_by_context=0, sessions_skipped_by_context=0)
    assert summary_line(Stats().summary(10.0, **counts)).endswith("; sessions 739 started, 233 completed")
