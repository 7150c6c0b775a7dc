"""Bad input to every CLI that reads files or flags: the real `kvwatt` as a subprocess must exit 2 with exactly
one line on stderr naming the problem, never a traceback, and before it allocates what the input asks for.

Each subprocess runs under a 3 GiB address-space limit, so a case that would allocate without bound (a 1e12-token
turn, 100,000,000 repeats) fails fast here instead of taking the machine down.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from exporter.config import ConfigError, from_mapping
from tests.conftest import REPO

SAMPLE = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"
MEMORY_LIMIT_BYTES = 3 * 2**30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def kvwatt(*argv: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """The real CLI, on this tree's code (PYTHONPATH), with a memory ceiling."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full_env.pop("KVWATT_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "exporter", *argv], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=_limit_memory)


def closed_port() -> int:
    with socket.socket() as s:  # bound and closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------
def config(tmp: Path, text: str | bytes) -> list[str]:
    path = tmp / "kvwatt.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return ["check-config", str(path)]


def run_config(tmp: Path, extra: str, servers: str = "") -> list[str]:
    """`kvwatt run` on a config that would otherwise serve (loopback, no NVML, empty powercap); ``extra`` keys,
    ``servers`` more server list items."""
    (tmp / "powercap").mkdir()
    path = tmp / "kvwatt.yaml"
    path.write_text(f"listen: 127.0.0.1:{closed_port()}\nnvml: false\nstate_dir: {tmp / 'state'}\n"
                    f"powercap_root: {tmp / 'powercap'}\n{extra}"
                    f"servers:\n  - {{name: a, url: 'http://127.0.0.1:1'}}\n{servers}")
    return ["run", "--config", str(path)]


def server_file(tmp: Path, key: str, name: str, data: dict) -> str:
    """Config text giving server b a JSON file under ``key`` (model_config, recorded_baseline)."""
    (tmp / name).write_text(json.dumps(data))
    return f"  - {{name: b, url: 'http://127.0.0.1:2', {key}: '{tmp / name}'}}\n"


def plan(tmp: Path, change: Callable[[dict], None] = lambda p: None, *flags: str,
         text: bytes | None = None) -> list[str]:
    """`kvwatt experiment` on a valid plan after ``change`` (``--dry-run`` unless other flags are given)."""
    data = {"server": {"command": ["vllm", "serve", "--port", "{port}"], "port": 8000},
            "workload": {"trace": str(SAMPLE), "length_scale": 0.05},
            "conditions": [{"name": "off"}]}
    change(data)
    path = tmp / "plan.yaml"
    if text is not None:
        path.write_bytes(text)
    else:
        path.write_text(yaml.safe_dump(data))
    return ["experiment", str(path), *(flags or ("--dry-run",))]


def trace_file(tmp: Path, text: str | bytes) -> Path:
    path = tmp / "trace.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def trace(tmp: Path, text: str | bytes, *flags: str) -> list[str]:
    """`kvwatt replay` against a closed port: any input that passes validation would exit 1 (unreachable)."""
    return ["replay", str(trace_file(tmp, text)), "--url", f"http://127.0.0.1:{closed_port()}", *flags]


def session(*turns: tuple[int, int], session_id: str = "s") -> str:
    return json.dumps({"session": session_id, "turns": [{"input_tokens": i, "output_tokens": o}
                                                          for i, o in turns]}) + "\n"


def a_file(tmp: Path) -> Path:
    path = tmp / "a-file"
    path.write_text("not a directory\n")
    return path


def state_dir(tmp: Path, state_json: str) -> Path:
    out = tmp / "out"
    out.mkdir()
    (out / "state.json").write_text(state_json)
    return out


def billion_laughs(key: str) -> str:
    """~400 bytes of YAML whose value is 9**9 strings through aliases."""
    text = f"{key}: [&a0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]"
    for i in range(1, 9):
        text += f", &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]"
    return text + "]\n"


DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "9" * 5000  # beyond Python's 4,300-digit int/str conversion limit

# (what, argv for a tmp dir, what the one error line says: a string, or several that must all appear)
CASES: list[tuple[str, Callable[[Path], list[str]], str | tuple[str, ...]]] = [
    # check-config
    ("config invalid UTF-8", lambda t: config(t, b"listen: 0.0.0.0:8492\nstate_dir: \xff\xfe\n"),
     "kvwatt.yaml: line 2: not valid UTF-8 (byte 0xff)"),
    ("windows .inf", lambda t: config(t, "windows: [.inf]\n"), "windows[0]: expected a finite number"),
    ("http_timeout .inf", lambda t: config(t, "http_timeout: .inf\n"), "http_timeout: expected a finite number"),
    ("duration of 400 digits", lambda t: config(t, f"idle_settle: {'9' * 400}s\n"),
     "idle_settle: expected a finite number"),
    ("ratio of 400 digits", lambda t: config(t, f"kv_pressure_threshold: {'9' * 400}\n"),
     "kv_pressure_threshold: expected a finite number, got an integer of about 40"),
    ("server port 99999", lambda t: config(t, "servers: [{name: a, url: 'http://127.0.0.1:99999'}]\n"),
     "servers[0].url: the port must be 1-65535"),
    ("server port abc", lambda t: config(t, "servers: [{name: a, url: 'http://127.0.0.1:abc'}]\n"),
     "servers[0].url: the port must be 1-65535"),
    ("server port 0", lambda t: config(t, "servers: [{name: a, url: 'http://127.0.0.1:0'}]\n"),
     "servers[0].url: the port must be 1-65535"),
    ("unclosed IPv6 URL", lambda t: config(t, "servers: [{name: a, url: 'http://[::1:8000'}]\n"),
     "servers[0].url: expected an http(s) URL"),
    ("sidecar URL not http", lambda t: config(t, "servers: [{name: a, url: 'http://h:1', sidecar_urls: ['ftp://h:2']}]\n"),
     "servers[0].sidecar_urls[0]: expected an http(s) URL"),
    ("sidecar_urls not a list", lambda t: config(t, "servers: [{name: a, url: 'http://h:1', sidecar_urls: 'http://h:2'}]\n"),
     "servers[0].sidecar_urls: expected a list of 1 to 4 URLs"),
    ("listen port in superscript digits", lambda t: config(t, "listen: '0.0.0.0:\u00b2'\n"),
     "listen: expected HOST:PORT with a port in 1-65535"),
    ("state_dir with NUL", lambda t: config(t, 'state_dir: "/var/lib/a\\0b"\n'), "state_dir: contains a NUL"),
    ("YAML nested too deeply", lambda t: config(t, f"windows: {DEEP}\n"), "not usable YAML (nested too deeply)"),
    ("YAML integer of 5000 digits", lambda t: config(t, f"max_body_bytes: {HUGE_INT}\n"),
     "kvwatt.yaml: not usable YAML (Exceeds the limit (4300 digits)"),
    ("YAML impossible date", lambda t: config(t, "state_dir: 2024-13-45\n"), "not usable YAML (month must be in"),
    ("YAML billion laughs", lambda t: config(t, billion_laughs("listen")), "listen: expected a non-empty string"),
    ("config is /dev/zero", lambda t: ["check-config", "/dev/zero"], "/dev/zero: larger than 64 MiB (the limit)"),
    # run: the same parsers as check-config, before anything starts
    ("run with http_timeout .inf", lambda t: run_config(t, "http_timeout: .inf\n"),
     "http_timeout: expected a finite number"),
    ("run --server with port 99999", lambda t: run_config(t, "") + ["--server", "b=http://127.0.0.1:99999"],
     "--server b.url: the port must be 1-65535"),
    ("run with a model config.json of hidden_size 1e400", lambda t: run_config(t, "", server_file(
        t, "model_config", "config.json", {"hidden_size": 1e400, "num_attention_heads": 8, "num_hidden_layers": 2})),
     "config.json: hidden_size: expected a positive integer"),
    ("run with a profile of a 400-digit window", lambda t: run_config(t, "", server_file(
        t, "recorded_baseline", "p.json", {
        "format": "kvwatt-offload-profile", "version": 1, "scope": "gpu", "energy": "total", "duration_seconds": 1,
        "window_seconds": int("9" * 400), "bands": [{"lo": 0, "hi": 1, "windows": 1, "tokens_per_second": 1}]})),
     "p.json.window_seconds: expected a finite number >= 1, got an integer of about 40"),
    # experiment plans
    ("plan env name A=B", lambda t: plan(t, lambda p: p["server"].update(env={"A=B": "x"})),
     "server.env: 'A=B' is not an environment variable name"),
    ("plan env value with NUL", lambda t: plan(t, lambda p: p["conditions"][0].update(env={"A": "x\0y"})),
     "conditions[0].env.A: contains a NUL character"),
    ("plan argv with NUL", lambda t: plan(t, lambda p: p["server"]["command"].append("a\0b")),
     "server.command[4]: contains a NUL character"),
    ("plan var with NUL", lambda t: plan(t, lambda p: p.update(vars={"v": "a\0"})),
     "vars.v: contains a NUL character"),
    ("plan invalid UTF-8", lambda t: plan(t, text=b"server: {command: [a]}\nname: \xff\n"),
     "plan.yaml: line 2: not valid UTF-8 (byte 0xff)"),
    ("plan out is a file", lambda t: plan(t, lambda p: p.update(out=str(a_file(t))), "--resume"),
     "/a-file is not a directory"),
    ("--out is a file", lambda t: plan(t, lambda p: None, "--out", str(a_file(t))), "/a-file is not a directory"),
    ("state.json nested too deeply", lambda t: plan(t, lambda p: None, "--report-only", "--out", str(
        state_dir(t, "[" * 100_000))), "state.json: unreadable state file (nested too deeply)"),
    ("plan repeats 100000000", lambda t: plan(t, lambda p: p.update(repeats=100_000_000)),
     "repeats: must be <= 10000 (the limit)"),
    ("plan repeats x conditions", lambda t: plan(t, lambda p: p.update(
        repeats=5001, conditions=[{"name": "a"}, {"name": "b"}])),
     "repeats: 5001 repeats x 2 conditions is 10002 runs, more than the limit of 10000"),
    ("plan length_scale .inf", lambda t: plan(t, lambda p: p["workload"].update(length_scale=float("inf"))),
     "workload.length_scale: expected a finite number"),
    ("plan length_scale 1e12", lambda t: plan(t, lambda p: p["workload"].update(length_scale=1e12)),
     "conditions[0].workload: system prompt of 1024000000000000 tokens (after the length scale) is more than"),
    ("plan concurrency 100000000", lambda t: plan(t, lambda p: p["workload"].update(concurrency=100_000_000)),
     "workload.concurrency: must be <= 10000 (the limit)"),
    ("plan url port from a var", lambda t: plan(t, lambda p: (p["server"].update(url="http://127.0.0.1:{p}"),
                                                               p.update(vars={"p": 99999}))),
     "server.url (condition off): the port must be 1-65535"),
    ("plan trace with a 1e12-token turn", lambda t: plan(t, lambda p: p["workload"].update(
        trace=str(trace_file(t, session((10**12, 1)))))),
     ("workload.trace: /", "trace.jsonl line 1: turns[0].input_tokens: 1000000000000 is more than the limit")),
    # replay
    ("trace nested too deeply", lambda t: trace(t, '{"turns": ' + DEEP + "}\n"),
     "trace.jsonl line 1: not usable JSON (nested too deeply)"),
    ("trace integer of 5000 digits", lambda t: trace(t, '{"session": "s", "turns": [{"input_tokens": '
                                                        + HUGE_INT + ', "output_tokens": 1}]}\n'),
     "trace.jsonl line 1: not usable JSON"),
    ("trace latency of 400 digits", lambda t: trace(t, '{"session": "s", "turns": [{"input_tokens": 1, '
                                                       '"output_tokens": 1, "tool_latency_seconds": '
                                                       + "9" * 400 + "}]}\n"),
     "turns[0].tool_latency_seconds: expected a finite number"),
    ("trace turn of 1e12 tokens", lambda t: trace(t, session((10**12, 1))),
     "trace.jsonl line 1: turns[0].input_tokens: 1000000000000 is more than the limit of 10000000 tokens"),
    ("trace session beyond the context limit", lambda t: trace(t, session(*[(4_000_000, 1)] * 3)),
     "trace session 's' needs 12001027 tokens of context"),
    ("--length-scale makes a session too long", lambda t: trace(t, session((1000, 10)), "--length-scale", "1e5"),
     "more than the limit of 10000000"),
    ("--system-prompt-tokens scaled too long", lambda t: trace(t, session((10, 10)), "--length-scale", "1e9"),
     "--system-prompt-tokens: 1024 x --length-scale 1e+09 is 1024000000000 tokens"),
    ("--summary under a file", lambda t: trace(t, session((10, 10)), "--summary", str(a_file(t) / "s.json")),
     "--summary: cannot write"),
    ("--summary is a directory", lambda t: trace(t, session((10, 10)), "--summary", str(t)),
     "--summary: "),
    ("--url port 99999", lambda t: trace(t, session((10, 10))) + ["--url", "http://127.0.0.1:99999"],
     "--url: the port must be 1-65535"),
    ("--url port abc", lambda t: trace(t, session((10, 10))) + ["--url", "http://127.0.0.1:abc"],
     "--url: the port must be 1-65535"),
    ("--concurrency 100000000", lambda t: trace(t, session((10, 10)), "--concurrency", "100000000"),
     "--concurrency: must be <= 10000 (the limit)"),
    ("--max-context beyond the limit", lambda t: trace(t, session((10, 10)), "--max-context", "100000000000"),
     "--max-context: must be <= 10000000 (the limit)"),
    ("--token-id-range beyond 32 bits", lambda t: trace(t, session((10, 10)), "--token-id-range", "0:" + "9" * 20),
     "--token-id-range: HIGH must be <= 2147483648"),
    # baseline
    ("baseline record --out under a file", lambda t: [
        "baseline", "record", "--server", "a=http://127.0.0.1:1", "--duration", "1s", "--window", "1s",
        "--out", str(a_file(t) / "p.json"), "--state-dir", str(t), "--powercap-root", str(t)],
     "--out: cannot write"),
    ("baseline idle --state-dir is a file", lambda t: [
        "baseline", "idle", "--no-server-check", "--duration", "1s", "--settle", "0", "--state-dir",
        str(a_file(t)), "--powercap-root", str(t)],
     ("state_dir: cannot write", "a-file")),
    ("baseline idle --duration of 400 digits", lambda t: [
        "baseline", "idle", "--no-server-check", "--duration", "9" * 400 + "s", "--settle", "0",
        "--state-dir", str(t), "--powercap-root", str(t)],
     "--duration: expected a finite number"),
]


@pytest.mark.parametrize("what, argv, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(tmp_path, what, argv, message):
    proc = kvwatt(*argv(tmp_path))
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    parts = (message,) if isinstance(message, str) else message
    assert lines[0].startswith("kvwatt: error: ") and all(p in lines[0] for p in parts), lines[0]


def test_context_cap_admits_a_session_beyond_the_limit(tmp_path):
    """The limit is on what is replayed: --max-context cuts the long session, so it passes validation (and the
    replay then fails to reach the closed port: exit 1)."""
    proc = kvwatt(*trace(tmp_path, session(*[(4_000_000, 1)] * 3), "--max-context", "8000002"))
    assert proc.returncode == 1 and "is unreachable" in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------
# duplicate server names: linear
# ---------------------------------------------------------------------------------------------------------
def _servers(n: int, name=str) -> list[dict]:
    return [{"name": name(f"s{i}"), "url": f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000"}
            for i in range(n)]


def test_forty_thousand_servers_with_one_duplicate(tmp_path):
    servers = _servers(40_000) + [{"name": "s123", "url": "http://h:1"}]
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        from_mapping({"servers": servers})
    elapsed = time.monotonic() - start
    assert str(e.value) == "servers: duplicate server name 's123' (servers[123] and servers[40000])"
    # an upper bound, not a speed target: relative to the quadratic check it replaced (31 s on this 2-core
    # machine), 25x the 0.4 s measured here, so a loaded machine passes and the quadratic one cannot
    assert elapsed < 10, f"{elapsed:.1f} s"


class _CountingName(str):
    """A server name that counts the equality comparisons made on it."""
    comparisons = 0

    def __eq__(self, other):
        _CountingName.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_duplicate_check_compares_names_a_linear_number_of_times():
    _CountingName.comparisons = 0
    from_mapping({"servers": _servers(3000, _CountingName)})
    assert _CountingName.comparisons < 3 * 3000, _CountingName.comparisons  # quadratic: 9,000,000


def test_trace_turn_limit_is_checked_line_by_line(tmp_path, monkeypatch):
    """A trace holding more turns than MAX_TRACE_TURNS is refused at the line that passes it (the real limit,
    10,000,000 turns, is lowered here so the file stays small)."""
    from kvwatt_lab.replay import traces

    monkeypatch.setattr(traces, "MAX_TRACE_TURNS", 5)
    path = trace_file(tmp_path, session((1, 1), (1, 1), (1, 1), session_id="a")
                      + session((1, 1), (1, 1), (1, 1), session_id="b") + "{not even JSON\n")
    with pytest.raises(ConfigError, match=r"trace.jsonl line 2: the trace holds more than 5 turns"):
        traces.load_sessions(path)
