"""Flags, configuration keys and logs in the Prometheus ecosystem's spelling (the Prometheus exporter conventions):
``--web.listen-address``, ``--web.telemetry-path``, ``--log.level``, ``--log.format``, ``--version``; the
logging keys and environment variables (file < environment < flags); one line per log record in logfmt or
JSON with the repeated-line folding kept; every duration flag through the one parser; an unknown key
suggesting the closest known one. The commands run as real subprocesses where exit status and stderr matter.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from exporter import __version__
from exporter.cli import build_parser
from exporter.commands.run import config_from_args
from exporter.config import ConfigError, from_mapping, parse_duration, resolve
from exporter.runtime import logsetup
from exporter.runtime.build import build_info
from tests.conftest import REPO

VERSION_LINE = re.compile(r"^kvwatt, version (\S+) \(revision (\S+), python (\S+)\)$")


def kvwatt(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def one_error_line(r: subprocess.CompletedProcess, *parts: str) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and all(p in lines[0] for p in parts), lines
    return lines[0]


# --- --version ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [("--version",), ("run", "--version")])
def test_version_prints_version_revision_and_python_and_exits_0(argv):
    r = kvwatt(*argv)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    m = VERSION_LINE.match(r.stdout.strip())
    assert m, r.stdout
    assert m.group(1) == __version__ and m.group(3) == sys.version.split()[0]
    assert m.group(2) == build_info().revision and re.fullmatch(r"[0-9a-f]{12}|unknown", m.group(2))


# --- flags in the ecosystem's spelling --------------------------------------------------------------------
def run_args(*argv: str):
    return build_parser().parse_args(["run", *argv])


def test_web_listen_address_is_listen_and_log_flags_override_env_and_file(tmp_path, monkeypatch):
    f = tmp_path / "k.yaml"
    f.write_text("log_level: debug\nlog_format: json\nlisten: 127.0.0.1:1111\n")
    for k in ("KVWATT_LOG_LEVEL", "KVWATT_LOG_FORMAT", "KVWATT_LISTEN", "KVWATT_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    cfg = config_from_args(run_args("--config", str(f)))
    assert (cfg.log_level, cfg.log_format, cfg.listen) == ("debug", "json", "127.0.0.1:1111")
    monkeypatch.setenv("KVWATT_LOG_LEVEL", "WARNING")  # Python's spelling of warn is taken too, any case
    monkeypatch.setenv("KVWATT_LOG_FORMAT", "logfmt")
    cfg = config_from_args(run_args("--config", str(f)))
    assert (cfg.log_level, cfg.log_format) == ("warn", "logfmt")
    cfg = config_from_args(run_args("--config", str(f), "--log.level", "error", "--log.format", "json",
                                    "--web.listen-address", "127.0.0.1:2222"))
    assert (cfg.log_level, cfg.log_format, cfg.listen) == ("error", "json", "127.0.0.1:2222")
    assert config_from_args(run_args("--log-level", "info", "--listen", "127.0.0.1:3333")).listen == "127.0.0.1:3333"
    assert run_args().telemetry_path == "/metrics"


@pytest.mark.parametrize("argv, env, parts", [
    (("--log.level", "loud"), {}, ("--log.level: expected one of debug, info, warn, error", "'loud'")),
    (("--log.format", "xml"), {}, ("--log.format: expected one of logfmt, json",)),
    ((), {"KVWATT_LOG_LEVEL": "verbose"}, ("KVWATT_LOG_LEVEL: expected one of",)),
    ((), {"KVWATT_LOG_FORMAT": "text"}, ("KVWATT_LOG_FORMAT: expected one of logfmt, json",)),
    (("--web.telemetry-path", "/healthz"), {}, ("--web.telemetry-path: expected a path like /metrics",)),
    (("--web.telemetry-path", "metrics"), {}, ("--web.telemetry-path: expected a path",)),
    (("--web.telemetry-path", "/runbook"), {}, ("--web.telemetry-path: expected a path like /metrics",
                                                "/runbook")),  # once accepted: it hid the runbook
    (("--web.listen-address", "nohostport"), {}, ("--listen: expected HOST:PORT",)),
])
def test_bad_log_and_web_flags_are_one_line_and_exit_2(tmp_path, argv, env, parts):
    r = kvwatt("run", "--state-dir", str(tmp_path), *argv, env={"KVWATT_CONFIG": "", **env})
    one_error_line(r, *parts)


def test_every_other_endpoint_is_reserved_from_the_telemetry_path():
    """A path the exposition may not take is each route build_app serves besides it: a new endpoint left out
    of RESERVED_PATHS could be hidden by --web.telemetry-path, as /runbook was."""
    from exporter.config import RESERVED_PATHS
    from exporter.serve.web import build_app

    app = build_app(daemon=None, telemetry_path="/exposition")
    routes = {r.resource.canonical for r in app.router.routes() if r.method == "GET"}
    assert routes - {"/exposition"} == set(RESERVED_PATHS), routes


def test_a_bad_log_key_in_the_file_names_the_key():
    with pytest.raises(ConfigError, match=r"^log_format: expected one of logfmt, json, got 'text'$"):
        from_mapping({"log_format": "text"})
    with pytest.raises(ConfigError, match=r"^log_level: expected one of debug, info, warn, error, got 3$"):
        from_mapping({"log_level": 3})


# --- log lines --------------------------------------------------------------------------------------------
@pytest.fixture
def captured():
    """logsetup.setup on a string stream; the root logger's handlers and level restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    streams = []

    def setup(level: str, fmt: str) -> io.StringIO:
        streams.append(io.StringIO())
        logsetup.setup(level, fmt, streams[-1])
        return streams[-1]
    yield setup
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])


LOGFMT_PAIR = re.compile(r'(\w[\w.\-]*)=("(?:[^"\\]|\\.)*"|[^\s"]+)')


def parse_logfmt(line: str) -> dict[str, str]:
    pairs = LOGFMT_PAIR.findall(line)
    assert " ".join(f"{k}={v}" for k, v in pairs) == line, line  # nothing outside key=value pairs
    return {k: json.loads(v) if v.startswith('"') else v for k, v in pairs}


def test_logfmt_one_line_per_record_with_fixed_keys_fields_and_escaped_exceptions(captured):
    out = captured("info", "logfmt")
    log = logging.getLogger("kvwatt.test")
    log.debug("not shown at info")
    log.warning('server %s is "down"', "a b", extra={"server": "a b", "attempts": 3})
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        log.exception("tick failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    first, second = map(parse_logfmt, lines)
    assert list(first)[:5] == ["ts", "level", "logger", "caller", "msg"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert (first["level"], first["logger"], first["msg"]) == ("warn", "kvwatt.test", 'server a b is "down"')
    assert first["caller"].startswith("test_cli_conventions.py:")
    assert (first["server"], first["attempts"]) == ("a b", "3")
    assert second["level"] == "error" and "ValueError: bad\nvalue" in second["exc"]


def test_json_one_object_per_line_and_non_finite_numbers_as_strings(captured):
    out = captured("debug", "json")
    log = logging.getLogger("kvwatt.test")
    log.debug("x", extra={"ratio": float("nan"), "ok": True, "n": 2})
    (record,) = [json.loads(line) for line in out.getvalue().splitlines()]
    assert record["level"] == "debug" and record["msg"] == "x"
    assert (record["ratio"], record["ok"], record["n"]) == ("nan", True, 2)


def test_repeated_lines_are_still_folded_under_either_format(captured):
    for fmt in ("logfmt", "json"):
        out = captured("info", fmt)
        for _ in range(50):
            logging.getLogger("kvwatt.test").warning("accept failed: too many open files")
        assert len(out.getvalue().splitlines()) == 1, out.getvalue()


# --- durations: one parser for every command --------------------------------------------------------------
def duration_flags() -> list[tuple[str, str]]:
    """(command path, flag, metavar) of every option whose value is a duration (metavar DURATION, or SECONDS
    as some were once spelled), found in the parsers themselves."""
    found = []

    def walk(parser, path):
        for action in parser._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):  # sub-commands
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}".strip())
            elif action.option_strings and action.metavar in ("DURATION", "SECONDS"):
                found.append((path, action.option_strings[0], action.metavar))
    walk(build_parser(), "")
    return found


# the other arguments each command needs to get as far as reading its durations
BASE_ARGS = {
    "run": lambda t: ["--state-dir", str(t)],
    "baseline idle": lambda t: ["--no-server-check", "--state-dir", str(t), "--powercap-root", str(t),
                                "--duration", "1s", "--settle", "0"],
    "baseline record": lambda t: ["--server", "a=http://127.0.0.1:9", "--duration", "1s",
                                  "--out", str(t / "p.json"), "--state-dir", str(t), "--powercap-root", str(t)],
    "replay": lambda t: [str(t / "trace.jsonl")],
}


def test_no_duration_flag_is_spelled_in_seconds_only():
    flags = duration_flags()
    assert len(flags) >= 10, flags
    seconds = [(p, f) for p, f, metavar in flags if metavar == "SECONDS"]
    assert seconds == [], f"duration flags documented as SECONDS: {seconds}"


@pytest.mark.parametrize("path, flag", [f[:2] for f in duration_flags()], ids=lambda x: str(x).replace(" ", "-"))
def test_every_duration_flag_refuses_a_bad_value_with_the_one_parsers_line(tmp_path, path, flag):
    assert path in BASE_ARGS, f"{path}: add the arguments it needs to BASE_ARGS"
    r = kvwatt(*path.split(), *BASE_ARGS[path](tmp_path), flag, "5 parsecs", env={"KVWATT_CONFIG": ""})
    one_error_line(r, flag, "expected a duration like 30s or 5m (a bare number is seconds)", "'5 parsecs'")


@pytest.mark.parametrize("bare, suffixed", [("0.5", "500ms"), ("30", "30s"), ("300", "5m"), ("3600", "1h"),
                                            (0.25, "250ms")])
def test_bare_seconds_and_suffixed_durations_are_the_same(bare, suffixed):
    assert parse_duration(bare, "k") == parse_duration(suffixed, "k")
    assert run_args("--interval", str(bare)).interval is not None
    if parse_duration(bare, "k") <= 60:
        assert resolve(None, interval=str(bare), env={}).interval_seconds == \
            resolve(None, interval=suffixed, env={}).interval_seconds == parse_duration(suffixed, "k")


def test_zero_where_zero_means_none_and_only_there():
    assert parse_duration("0", "--settle", zero_ok=True) == 0.0 == parse_duration("0ms", "--settle", zero_ok=True)
    with pytest.raises(ConfigError, match=r"^--settle: must be zero or more, got -1$"):
        parse_duration(-1, "--settle", zero_ok=True)
    with pytest.raises(ConfigError, match=r"^--interval: must be greater than zero, got '0s'$"):
        parse_duration("0s", "--interval")
    args = build_parser().parse_args(["replay", "t.jsonl", "--retry-backoff", "0", "--request-timeout", "2m"])
    assert (args.retry_backoff, args.request_timeout) == (0.0, 120.0)


# --- an unknown key suggests the closest known one -------------------------------------------------------
@pytest.mark.parametrize("data, message", [
    ({"intervall": "1s"}, "intervall: unknown key (did you mean 'interval'? known: listen, interval,"),
    ({"log_levl": "info"}, "log_levl: unknown key (did you mean 'log_level'?"),
    ({"servers": [{"name": "a", "urll": "http://x"}]}, "servers[0].urll: unknown key (did you mean 'url'?"),
    ({"servers": [{"name": "a", "url": "http://x", "model": {"layer": 2}}]},
     "servers[0].model.layer: unknown key (did you mean 'layers'?"),
    ({"zzz": 1}, "zzz: unknown key (known: listen, interval,"),  # nothing close: no guess
])
def test_an_unknown_key_suggests_the_closest_known_one(data, message):
    with pytest.raises(ConfigError) as e:
        from_mapping(data)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_check_config_prints_the_suggestion_on_one_line(tmp_path):
    f = tmp_path / "k.yaml"
    f.write_text("servers:\n  - {name: a, url: 'http://127.0.0.1:8000'}\nwindow: [1m]\n")
    line = one_error_line(kvwatt("check-config", str(f)))
    assert line.startswith("kvwatt: error: window: unknown key (did you mean 'windows'?"), line
