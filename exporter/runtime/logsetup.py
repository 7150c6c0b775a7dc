"""Logging of `kvwatt run`: one line per record on stderr, in logfmt (the default, as Prometheus and its
exporters write it) or JSON, at the level of ``--log.level`` / ``log_level`` / ``$KVWATT_LOG_LEVEL``.

Every line carries ``ts`` (RFC 3339, UTC, milliseconds), ``level`` (debug, info, warn, error), ``logger``,
``caller`` (file:line), ``msg``, then the record's structured fields (``log.info("...", extra={"server": "a"})``)
and, for an exception, ``exc`` (the traceback, its newlines escaped: still one line). Repeated identical lines
are folded by exporter/runtime/logfilter.py (installed here on the one handler).
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

from exporter.runtime import logfilter

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}
_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error",
          logging.CRITICAL: "error"}
# attributes every LogRecord has: anything else on a record came from ``extra=`` (a structured field)
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
_BARE = re.compile(r'^[^\s="\\\x00-\x1f\x7f]+$')  # a logfmt value that needs no quotes
_KEY_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")


def level_name(levelno: int) -> str:
    return _NAMES.get(levelno) or ("error" if levelno > logging.ERROR else logging.getLevelName(levelno).lower())


def fields(record: logging.LogRecord) -> list[tuple[str, Any]]:
    """The record as ordered (key, value) pairs: the fixed keys, the structured fields, the exception."""
    ts = datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
    out: list[tuple[str, Any]] = [
        ("ts", ts.replace("+00:00", "Z")), ("level", level_name(record.levelno)), ("logger", record.name),
        ("caller", f"{record.filename}:{record.lineno}"), ("msg", record.getMessage())]
    out += [(_KEY_CHARS.sub("_", k), v) for k, v in vars(record).items()
            if k not in _STANDARD and not k.startswith("_")]
    if record.exc_info:
        out.append(("exc", logging.Formatter().formatException(record.exc_info)))
    if record.stack_info:
        out.append(("stack", record.stack_info))
    return out


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def logfmt_value(value: Any) -> str:
    text = _text(value)
    if _BARE.match(text):
        return text
    return json.dumps(text, ensure_ascii=False)  # quoted; quotes, backslashes and control characters escaped


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # JSON has no NaN or Infinity
    return str(value)


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={logfmt_value(v)}" for k, v in fields(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({k: _jsonable(v) for k, v in fields(record)}, ensure_ascii=False)


FORMATTERS = {"logfmt": LogfmtFormatter, "json": JsonFormatter}


def setup(level: str = "info", fmt: str = "logfmt", stream: TextIO | None = None) -> logging.Handler:
    """Replace the root logger's handlers by one writing ``fmt`` lines to ``stream`` (stderr) at ``level``,
    with the repeated-line filter. ``level`` and ``fmt`` are validated already (config.parse_log_level)."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(FORMATTERS[fmt]())
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
    logfilter.install()
    return handler
