"""Per-turn records (JSONL, one line flushed as each turn ends) and the run summary built from them."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import IO

from exporter.runtime.atomic import write_text

STATUSES = ("ok", "retried", "error", "cancelled")  # ok/retried succeeded; error/cancelled did not


@dataclass
class TurnRecord:
    session: str
    iteration: int  # how many times this session had been replayed before (closed loop cycles the queue)
    turn: int
    status: str
    attempts: int
    prompt_tokens: int  # ids we sent
    expected_output_tokens: int  # max_tokens = min_tokens we asked for
    server_prompt_tokens: int | None = None  # usage.prompt_tokens
    output_tokens: int | None = None  # usage.completion_tokens (or ids received)
    ttft_seconds: float | None = None
    latency_seconds: float | None = None  # of the attempt that succeeded (or the last one)
    start_unix_seconds: float = 0.0  # wall clock at the first attempt
    start_offset_seconds: float = 0.0  # since the replay began (monotonic), first attempt
    end_offset_seconds: float = 0.0
    tool_latency_seconds: float = 0.0  # the (scaled) wait that follows this turn
    worker: int | None = None  # closed loop: the worker that replayed it
    error: str | None = None


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class Stats:
    requests: int = 0
    ok: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttfts_seconds: list[float] = field(default_factory=list)
    latencies_seconds: list[float] = field(default_factory=list)

    def add(self, record: TurnRecord) -> None:
        self.requests += 1
        self.retried += record.status == "retried"
        self.failed += record.status == "error"
        self.cancelled += record.status == "cancelled"
        if record.status in ("ok", "retried"):
            self.ok += 1
            self.prompt_tokens += record.prompt_tokens
            self.output_tokens += record.output_tokens or 0
            if record.ttft_seconds is not None:
                self.ttfts_seconds.append(record.ttft_seconds)
            self.latencies_seconds.append(record.latency_seconds or 0.0)

    def summary(self, duration_seconds: float, **extra) -> dict:
        rate = (lambda n: n / duration_seconds if duration_seconds > 0 else 0.0)
        return {
            "requests": self.requests, "ok": self.ok, "failed": self.failed, "cancelled": self.cancelled,
            "retried": self.retried, "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "duration_seconds": round(duration_seconds, 3),
            "requests_per_second": round(rate(self.ok), 4),
            "output_tokens_per_second": round(rate(self.output_tokens), 2),
            "ttft_p50_seconds": _percentile(self.ttfts_seconds, 50),
            "ttft_p95_seconds": _percentile(self.ttfts_seconds, 95),
            "latency_p50_seconds": _percentile(self.latencies_seconds, 50),
            "latency_p95_seconds": _percentile(self.latencies_seconds, 95),
            **extra,
        }


def summary_line(summary: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f} ms"
    return (f"replay: {summary['requests']} requests, {summary['ok']} ok, {summary['failed']} failed, "
            f"{summary['cancelled']} cancelled; {summary['prompt_tokens']} tokens in, "
            f"{summary['output_tokens']} out in {summary['duration_seconds']:.1f} s; "
            f"{summary['requests_per_second']:.2f} req/s, {summary['output_tokens_per_second']:.1f} out tok/s; "
            f"TTFT p50 {ms(summary['ttft_p50_seconds'])}, p95 {ms(summary['ttft_p95_seconds'])}"
            f"{sessions_words(summary)}")


def sessions_words(summary: dict) -> str:
    """What became of the sessions, in the one line (cut and skipped ones are not hidden in the JSON)."""
    if "sessions_started" not in summary:
        return ""
    cut, skipped = summary.get("sessions_cut_by_context", 0), summary.get("sessions_skipped_by_context", 0)
    words = f"; sessions {summary['sessions_started']} started, {summary.get('sessions_completed', 0)} completed"
    if cut:
        words += f", {cut} cut by --max-context"
    if skipped:
        words += f", {skipped} skipped (first turn over --max-context)"
    return words


class RecordSink:
    """Writes each record as one JSON line and flushes it at once; keeps the running Stats."""

    def __init__(self, path: str | None):
        self.stats = Stats()
        self._file: IO[str] | None = open(path, "w", encoding="utf-8") if path else None

    def write(self, record: TurnRecord) -> None:
        self.stats.add(record)
        if self._file is not None:
            self._file.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def write_summary(path: str, summary: dict) -> None:
    write_text(path, json.dumps(summary, indent=2) + "\n")
