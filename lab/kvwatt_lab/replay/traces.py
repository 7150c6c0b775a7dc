"""Trace files: the Applied Compute agentic-trace JSONL and kvwatt's per-session turns JSONL (docs/replay.md).

Both load into the same shape: a ``Session`` is a list of ``Turn``s, each turn appending ``input_tokens`` new
tokens (the user prompt on turn 0, the previous tool call's output after that), asking for exactly
``output_tokens``, then waiting ``tool_latency_seconds`` before the next turn. Any problem raises ConfigError
naming the file and line.

A trace is read the way kvwatt reads its state files (exporter.runtime.atomic.open_regular): only a regular file (a link
to one is followed; a FIFO, a device such as /dev/zero or a directory is refused at once, never waited on or read
forever), streamed line by line, each line at most TRACE_LINE_MAX_BYTES, JSON nested too deeply refused. The
file as a whole has no size limit of its own: MAX_TRACE_TURNS ends a too-large trace early.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

from exporter.config import ConfigError, finite_number, shown
from exporter.rules.limits import MAX_CONTEXT_TOKENS, MAX_TRACE_TURNS
from exporter.runtime.atomic import open_regular

FORMATS = ("auto", "applied-compute", "sessions")
_AC_KEYS = ("num_turns", "input_prompt_length", "assistant_response_length", "tool_call_output_length",
            "tool_call_latency", "final_assistant_response_length")
# One JSONL line (one session) at most: the largest line of the Applied Compute sample is 1.7 KB; a sessions line
# of 16 MiB holds ~250,000 turns. A longer line is refused before it is held in memory whole.
TRACE_LINE_MAX_BYTES = 16 << 20
# --length-scale / workload.length_scale at most: 1e308 overflowed (OverflowError in scale_tokens). Beyond 1e7
# every non-zero length exceeds MAX_CONTEXT_TOKENS anyway; up to this cap such a scale is still refused by the
# session or system prompt it makes (naming their token counts), above it by the key: count x scale stays a
# finite float (at most 1e7 x 1e15 tokens).
MAX_LENGTH_SCALE = 1e15


@dataclass(frozen=True)
class Turn:
    input_tokens: int
    output_tokens: int
    tool_latency_seconds: float = 0.0  # wait after this turn's response, before the next turn


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    system_prompt_tokens: int | None = None  # None: the replay's shared --system-prompt-tokens


def load_sessions(path: str | Path, trace_format: str = "auto") -> list[Session]:
    """Every session in ``path`` (blank lines skipped). Raises ConfigError on the first bad line, or at the line
    where the file passes MAX_TRACE_TURNS turns (it is read line by line, so a huge file is refused early)."""
    if trace_format not in FORMATS:
        raise ConfigError(f"--format: expected one of {', '.join(FORMATS)}, got {trace_format!r}")
    p = Path(path)
    try:
        with open_regular(str(p), follow_links=True) as f:
            sessions = _read_sessions(_lines(f, p), p, trace_format)
    except ConfigError:
        raise
    except OSError as e:
        raise ConfigError(f"trace file {p}: cannot read ({e.strerror or e})") from None
    except ValueError as e:  # open_regular: a FIFO, a device, a directory
        raise ConfigError(f"trace file {p}: {e} (a trace is a JSONL file)") from None
    if not sessions:
        raise ConfigError(f"trace file {p}: no sessions")
    _check_unique_ids(sessions, p)
    return sessions


def _lines(f: BinaryIO, p: Path) -> Iterator[bytes]:
    """The file's lines, each refused (ConfigError naming it) when longer than TRACE_LINE_MAX_BYTES."""
    line_number = 0
    while True:
        raw = f.readline(TRACE_LINE_MAX_BYTES + 1)
        if not raw:
            return
        line_number += 1
        if len(raw) > TRACE_LINE_MAX_BYTES:
            raise ConfigError(f"{p} line {line_number}: longer than {TRACE_LINE_MAX_BYTES} bytes (the limit of "
                              "one trace line)")
        yield raw


def _read_sessions(lines: Iterable[bytes], p: Path, trace_format: str) -> list[Session]:
    sessions: list[Session] = []
    turns = 0
    for line_number, raw in enumerate(lines, start=1):
        where = f"{p} line {line_number}"
        line = _decode(raw, where)
        if not line.strip():
            continue
        sessions.append(_parse_line(line, trace_format, where, line_number))
        turns += len(sessions[-1].turns)
        if turns > MAX_TRACE_TURNS:
            raise ConfigError(f"{where}: the trace holds more than {MAX_TRACE_TURNS} turns (the limit; split it)")
    return sessions


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None


def _parse_line(line: str, trace_format: str, where: str, line_number: int) -> Session:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise ConfigError(f"{where}: not usable JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise ConfigError(f"{where}: not usable JSON ({str(e).split(';')[0]})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kind = trace_format if trace_format != "auto" else _detect(obj, where)
    if kind == "applied-compute":
        return _applied_compute(obj, where, f"trace-{line_number}")
    return _sessions_line(obj, where)


def _detect(obj: dict, where: str) -> str:
    if "num_turns" in obj:
        return "applied-compute"
    if "turns" in obj:
        return "sessions"
    raise ConfigError(f"{where}: neither an Applied Compute trace (num_turns) nor a session (turns)")


def _applied_compute(obj: dict, where: str, session_id: str) -> Session:
    missing = [k for k in _AC_KEYS if k not in obj]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    n = _count(obj["num_turns"], f"{where}: num_turns", minimum=0)
    responses = _list(obj, "assistant_response_length", n, where)
    tool_outputs = _list(obj, "tool_call_output_length", n, where)
    latencies = _list(obj, "tool_call_latency", n, where)
    inputs = [_count(obj["input_prompt_length"], f"{where}: input_prompt_length", 1)]
    inputs += [_count(v, f"{where}: tool_call_output_length[{i}]", 0) for i, v in enumerate(tool_outputs)]
    outputs = [_count(v, f"{where}: assistant_response_length[{i}]", 1) for i, v in enumerate(responses)]
    outputs.append(_count(obj["final_assistant_response_length"], f"{where}: final_assistant_response_length", 1))
    waits = [_seconds(v, f"{where}: tool_call_latency[{i}]") for i, v in enumerate(latencies)] + [0.0]
    return Session(session_id, tuple(Turn(i, o, w) for i, o, w in zip(inputs, outputs, waits)))


def _sessions_line(obj: dict, where: str) -> Session:
    session_id = obj.get("session")
    if not isinstance(session_id, (str, int)) or isinstance(session_id, bool) or str(session_id) == "":
        raise ConfigError(f"{where}: session: expected a non-empty string")
    system = obj.get("system_prompt_tokens")
    if system is not None:
        system = _count(system, f"{where}: system_prompt_tokens", 0)
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}: turns: expected a non-empty list")
    parsed = tuple(_turn(t, f"{where}: turns[{i}]") for i, t in enumerate(turns))
    return Session(str(session_id), parsed, system)


def _turn(obj: Any, where: str) -> Turn:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected an object")
    unknown = set(obj) - {"input_tokens", "output_tokens", "tool_latency_seconds"}
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    for key in ("input_tokens", "output_tokens"):
        if key not in obj:
            raise ConfigError(f"{where}: missing {key}")
    return Turn(_count(obj["input_tokens"], f"{where}.input_tokens", 0),
                _count(obj["output_tokens"], f"{where}.output_tokens", 1),
                _seconds(obj.get("tool_latency_seconds", 0.0), f"{where}.tool_latency_seconds"))


def _list(obj: dict, key: str, length: int, where: str) -> list:
    value = obj[key]
    if not isinstance(value, list):
        raise ConfigError(f"{where}: {key}: expected a list")
    if len(value) != length:
        raise ConfigError(f"{where}: {key}: has {len(value)} entries, num_turns is {length}")
    return value


def _count(value: Any, what: str, minimum: int) -> int:
    """A token (or turn) count from ``minimum`` to MAX_CONTEXT_TOKENS: no session holds more tokens."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what}: expected an integer >= {minimum}, got {shown(value)}")
    if value > MAX_CONTEXT_TOKENS:
        raise ConfigError(f"{what}: {shown(value)} is more than the limit of {MAX_CONTEXT_TOKENS} tokens")
    return value


def _seconds(value: Any, what: str) -> float:
    seconds = finite_number(value, what, "seconds >= 0")
    if seconds < 0:
        raise ConfigError(f"{what}: expected seconds >= 0, got {shown(value)}")
    return seconds


def _check_unique_ids(sessions: list[Session], path: Path) -> None:
    seen: set[str] = set()
    for s in sessions:
        if s.session_id in seen:
            raise ConfigError(f"trace file {path}: session {s.session_id!r} appears twice")
        seen.add(s.session_id)


def scale_tokens(count_tokens: int, length_scale: float, minimum: int = 0) -> int:
    """``count_tokens * length_scale`` rounded to the nearest integer, halves up (``floor(x + 0.5)`` on the
    floating-point product: 2.5 -> 3, where Python's round() would give 2); a non-zero length stays >= 1, and
    never below ``minimum``."""
    if count_tokens == 0:
        return max(0, minimum)
    return max(1, minimum, math.floor(count_tokens * length_scale + 0.5))


def scale_session(session: Session, length_scale: float) -> Session:
    """Every token length times ``length_scale`` (outputs stay >= 1); latencies untouched."""
    if length_scale == 1.0:
        return session
    turns = tuple(Turn(scale_tokens(t.input_tokens, length_scale), scale_tokens(t.output_tokens, length_scale, 1),
                       t.tool_latency_seconds) for t in session.turns)
    system = None if session.system_prompt_tokens is None else scale_tokens(session.system_prompt_tokens,
                                                                            length_scale)
    return replace(session, turns=turns, system_prompt_tokens=system)
