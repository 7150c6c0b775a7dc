"""Hardening, the inputs: each input below gave a traceback, hung, or
was accepted or labelled wrongly. The real `kvwatt` as a subprocess must exit 2 with exactly one line on stderr
naming the problem, never a traceback; `experiment --dry-run` must refuse what the run itself would crash on.

The subprocesses import this tree's daemon *and* lab (PYTHONPATH), not the editable install's lab.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml
from kvwatt_lab.experiment import sweep

from exporter.config import ConfigError, format_window, from_mapping
from exporter.runtime import atomic
from tests.conftest import REPO

SAMPLE = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"
MEMORY_LIMIT_BYTES = 3 * 2**30
FIFO_SECONDS = 10.0  # a FIFO trace must be refused at once; the old reader waited for a writer forever


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def kvwatt(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "lab")])}
    env.pop("KVWATT_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "exporter", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=_limit_memory)


def assert_one_line(proc: subprocess.CompletedProcess, *says: str) -> None:
    lines = proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1, proc.stderr[-2000:]
    for text in says:
        assert text in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------------------
# item 5: experiment plans, in --dry-run and on the run path
# ---------------------------------------------------------------------------------------------------------
def write_plan(tmp: Path, change: Callable[[dict], None]) -> Path:
    """A plan whose server is a harmless command: on the run path, nothing valid gets past the first run."""
    data = {"server": {"command": [sys.executable, "-c", "pass", "{port}"], "port": "auto",
                       "startup_timeout": "5s"},
            "workload": {"trace": str(SAMPLE), "length_scale": 0.05},
            "energy": {"nvml": False},
            "phases": {"settle": "0s", "idle": "1s", "warmup": "0s", "measure": "1s", "cooldown": "0s"},
            "conditions": [{"name": "off"}]}
    change(data)
    path = tmp / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _sweep(**axes) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        d.pop("conditions")
        d["sweep"] = axes
    return change


def _set(section: str, key: str, value) -> Callable[[dict], None]:
    return lambda d: d[section].update({key: value})


PLAN_CASES = [
    ("buffer_gib 1e308", _sweep(buffer_gib=[1e308]), ("sweep.buffer_gib[0]", "must be <= 1048576")),
    ("condition name of 300 characters", lambda d: d.update(conditions=[{"name": "a" * 300}]),
     ("conditions[0].name", "300 characters", "limit of 100")),
    ("kv_cache_memory_bytes of 300 characters", _sweep(kv_cache_memory_bytes=["9" * 300]),
     ("sweep.kv_cache_memory_bytes[0]", "expected a byte count")),
    ("kv_cache_memory_bytes 'abc'", _sweep(kv_cache_memory_bytes=["abc"]),
     ("sweep.kv_cache_memory_bytes[0]", "expected a byte count", "'abc'")),
    ("workload.length_scale 1e308", _set("workload", "length_scale", 1e308),
     ("workload.length_scale", "must be <= 1e+15")),
    ("sweep value making a 156-character name", _sweep(kv_blocks=[int("7" * 150)]),
     ("sweep: expands into a condition name of 156 characters", "limit of 100")),
]


@pytest.mark.parametrize("change,says", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
@pytest.mark.parametrize("mode", ["dry-run", "run"])
def test_experiment_plan_input_is_refused(tmp_path: Path, change, says, mode: str) -> None:
    plan = write_plan(tmp_path, change)
    flags = ("--dry-run",) if mode == "dry-run" else ()
    assert_one_line(kvwatt("experiment", str(plan), "--out", str(tmp_path / "out"), *flags), *says)
    assert not (tmp_path / "out" / "runs").exists()  # refused before any run


@pytest.mark.parametrize("value,expected_bytes", [(8589934592, 8589934592), ("4G", 4 * 2**30),
                                                  ("25.6g", 25_600_000_000), ("1024", 1024), ("2K", 2048)])
def test_kv_cache_memory_bytes_accepts_what_vllm_reads(value, expected_bytes) -> None:
    axes = sweep.parse_axes({"kv_cache_memory_bytes": [value]})
    assert axes["kv_cache_memory_bytes"] == [value]  # passed on to vLLM as given
    assert sweep.kv_cache_bytes(value, "k") == expected_bytes


@pytest.mark.parametrize("value", [0, -1, "0", "abc", "1.5G", "4 GiB", "", 2**51, "2048T", True, 1.5, "9" * 5000])
def test_kv_cache_memory_bytes_must_be_a_positive_byte_count(value) -> None:
    with pytest.raises(ConfigError, match=r"^sweep\.kv_cache_memory_bytes\[0\]: "):
        sweep.parse_axes({"kv_cache_memory_bytes": [value]})


# ---------------------------------------------------------------------------------------------------------
# item 5: replay --length-scale; item 3: trace files read like state files
# ---------------------------------------------------------------------------------------------------------
def replay(trace: Path, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # a closed port: an input that passed validation would exit 1 (unreachable), not 2
    return kvwatt("replay", str(trace), "--url", "http://127.0.0.1:9", *flags, timeout=timeout)


def one_session(tmp: Path) -> Path:
    path = tmp / "trace.jsonl"
    path.write_text(json.dumps({"session": "s", "turns": [{"input_tokens": 5, "output_tokens": 3}]}) + "\n")
    return path


def test_replay_length_scale_that_overflows_is_refused(tmp_path: Path) -> None:
    assert_one_line(replay(one_session(tmp_path), "--length-scale", "1e308"),
                    "--length-scale", "must be <= 1e+15")


def test_replay_length_scale_at_the_limit_is_refused_by_the_tokens_it_makes(tmp_path: Path) -> None:
    # 1024 x 1e15 tokens of system prompt: the scale is allowed, the prompt it makes is not
    assert_one_line(replay(one_session(tmp_path), "--length-scale", "1e15"), "--system-prompt-tokens: 1024 x "
                    "--length-scale 1e+15", "more than the limit of 10000000")


def test_trace_that_is_a_link_to_dev_zero_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "zero.jsonl"
    link.symlink_to("/dev/zero")
    assert_one_line(replay(link), "zero.jsonl", "not a regular file")


def test_trace_that_is_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    try:
        proc = replay(fifo, timeout=FIFO_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"replay of a FIFO still waiting after {FIFO_SECONDS} s")
    assert time.monotonic() - started < FIFO_SECONDS
    assert_one_line(proc, "trace.fifo", "not a regular file")


def test_trace_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "traces"
    directory.mkdir()
    assert_one_line(replay(directory), "traces")


def test_trace_with_a_huge_line_is_refused_before_it_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as f:
        f.write(one_session(tmp_path).read_bytes())
        f.write(b'{"session": "' + b"x" * (17 << 20) + b'"}\n')
    assert_one_line(replay(path), "huge.jsonl line 2", "longer than 16777216 bytes")


def test_trace_with_a_deeply_nested_line_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 1_000_000 + "]" * 1_000_000 + "\n")
    assert_one_line(replay(path), "deep.jsonl line 1", "nested too deeply")


def test_trace_through_a_link_to_a_regular_file_still_loads(tmp_path: Path) -> None:
    link = tmp_path / "linked.jsonl"
    link.symlink_to(one_session(tmp_path))
    proc = replay(link)
    assert proc.returncode == 1 and "unreachable" in proc.stderr, proc.stderr  # loaded; the server is not there


def test_open_regular_refuses_a_fifo_at_once_and_follows_a_link_only_when_asked(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        atomic.open_regular(str(fifo), follow_links=True)
    target = tmp_path / "file"
    target.write_text("x")
    (tmp_path / "link").symlink_to(target)
    with atomic.open_regular(str(tmp_path / "link"), follow_links=True) as f:
        assert f.read() == b"x"
    with pytest.raises(OSError):  # state files: a link is not followed (ELOOP)
        atomic.open_regular(str(tmp_path / "link"))


# ---------------------------------------------------------------------------------------------------------
# item 5: windows labelled exactly, and none below 1s
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seconds,label", [(60.0, "1m"), (300.0, "5m"), (90.0, "90s"), (3600.0, "1h"),
                                           (30.0, "30s"), (1.0, "1s"), (86400.0, "24h"), (5400.0, "90m"),
                                           (1.5, "1500ms"), (0.001, "1ms"), (0.1, "100ms"), (90.4, "90400ms")])
def test_window_label_is_exact_in_every_unit(seconds: float, label: str) -> None:
    assert format_window(seconds) == label


def test_windows_that_differ_by_less_than_a_second_are_distinct() -> None:
    cfg = from_mapping({"windows": ["1500ms", "2s"]})
    assert [format_window(w) for w in cfg.windows_seconds] == ["1500ms", "2s"]


def test_window_below_one_second_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kvwatt.yaml"
    path.write_text("windows: [1m, 1ms]\nservers:\n  - {name: a, url: 'http://127.0.0.1:1'}\n")
    proc = kvwatt("check-config", str(path))
    assert "0h" not in proc.stdout
    assert_one_line(proc, "windows[1]", "at least 1s", "'1ms'")
