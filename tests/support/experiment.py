"""Helpers for `kvwatt experiment` tests: write a plan, run the command as a real subprocess (watching its
progress lines), find and kill the server it started, read its state and report.

    plan = write_plan(tmp_path / "plan.yaml", server={...}, workload={...}, conditions=[...])
    proc = run_experiment(plan, "--out", out, on_line=lambda line, p: ...)   # CompletedRun(rc, stderr)
    kill_server_group(port)                       # SIGKILL the process group serving on that port
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from tests.support.engine import VllmEngine, niced_command

REPO = Path(__file__).resolve().parents[2]
FAKE_SERVER = REPO / "tests" / "support" / "loopback.py"
SAMPLE_TRACES = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"


def write_plan(path: Path, **plan) -> Path:
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


@dataclass
class CompletedRun:
    returncode: int
    stderr: str
    pid: int


def run_experiment(plan: Path, *flags: str, timeout: float = 600,
                   on_line: Callable[[str, subprocess.Popen], None] | None = None) -> CompletedRun:
    """`python -m exporter experiment PLAN FLAGS`; ``on_line(line, proc)`` sees each stderr line as it comes."""
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "experiment", str(plan), *flags], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stderr:
            lines.append(line)
            if on_line is not None:
                on_line(line, proc)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
    return CompletedRun(proc.returncode, "".join(lines), proc.pid)


def pids_serving(port: int) -> list[int]:
    """Processes whose command line has ``--port PORT`` (the servers our plans start)."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if arg == b"--port" and argv[i + 1] == str(port).encode():
                out.append(int(cmdline.parent.name))
    return out


def kill_server_group(port: int) -> list[int]:
    """SIGKILL the process group(s) of whatever serves ``port``; the group ids killed."""
    groups = set()
    for pid in pids_serving(port):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return sorted(groups)


def load_state(out: Path) -> dict:
    return json.loads((out / "state.json").read_text())


def report_json(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(b"\x89PNG\r\n\x1a\n")


ENGINE_MAX_MODEL_LEN = 2048


def server_command(model_dir: str, blocks: bool = True) -> list[str]:
    """The engine tier's experiments' server: tests/support/engine.py's exact vLLM command, with {port} and
    {blocks} for the plan, or without the KV-size flag, which a sweep appends (``blocks=False``).
    (--enforce-eager would halve the start-up, 24 s instead of 47 s, but the eager CPU engine runs at a third
    of the speed and the small cache then saw p95 0.45-0.80.)"""
    cmd = VllmEngine(model_dir, port=1, num_gpu_blocks=1 if blocks else None,
                     max_model_len=ENGINE_MAX_MODEL_LEN).command()
    cmd[cmd.index("--port") + 1] = "{port}"
    if blocks:
        cmd[cmd.index("--num-gpu-blocks-override") + 1] = "{blocks}"
    return niced_command(cmd)  # as the test harness's engines when the engine tier's shards nice them
