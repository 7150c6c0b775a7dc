"""A loopback HTTP server that serves a simulated vLLM's /metrics (tests/support/vllm_sim.py).

    from tests.support import vllm_sim as sim
    from tests.support.fakevllm import FakeVllm

    with FakeVllm(sim.collapsing_on(steady_seconds=60), time_scale=10) as fv:   # auto: 1 wall s = 10 sim s
        fv.url                      # "http://127.0.0.1:PORT" (also /metrics, /health, /version)
        fv.phase                    # current phase name; fv.collapsed: its ground-truth collapse flag
        fv.gpu_power_watts()        # the GPU power the scenario implies now (drive an NVML double with it)
        fv.gpu_energy_joules()      # cumulative GPU energy since start (J); gpu_energy_millijoules() for NVML
        fv.attach_gpu(gpus, "GPU-a")  # keep a tests/support/fake_gpus.FakeGpus entry (the NVML double's
                                      # state file) in step: energy_mj and power_mw follow the scenario

    with FakeVllm(sim.stable_high_pressure_on(), auto=False) as fv:             # manual clock
        fv.step(5.0)                # advance 5 simulated seconds now
        fv.set_phase("collapse")    # pin any phase of the scenario (None: back to the timeline)
        fv.set_down("refuse")       # connection refused until set_down(None); also "500", "timeout"
        fv.restart()                # vLLM restarted: counters back to 0, new _created times
        fv.exposition()             # the text /metrics would return now

Auto mode advances the simulation with wall time x ``time_scale`` (a ticker thread every ``tick_seconds``,
and before answering each request), so the NVML double and /metrics see one consistent clock. A timeline
phase with ``down=True`` refuses connections for its duration (``down_mode`` chooses how), and a phase with
``restart_on_enter`` zeroes the counters. ``fv.scrapes`` counts /metrics answers served. Thread-safe.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvwatt_lab.experiment.server import free_port
from tests.support.vllm_sim import Scenario, SimEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DOWN_MODES = ("refuse", "500", "timeout")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class FakeVllm:
    def __init__(self, scenario: Scenario, port: int | None = None, host: str = "127.0.0.1",
                 time_scale: float = 1.0, auto: bool = True, tick_seconds: float = 0.05,
                 down_mode: str = "refuse", timeout_hold_seconds: float = 5.0, version: str | None = None):
        if down_mode not in DOWN_MODES:
            raise ValueError(f"down_mode must be one of {DOWN_MODES}")
        self.scenario = scenario
        self.engine = SimEngine(scenario)
        self.host = host
        self.port = port or free_port()
        self.time_scale = time_scale
        self.auto = auto
        self.tick_seconds = tick_seconds
        self.down_mode = down_mode
        self.timeout_hold_seconds = timeout_hold_seconds
        self.version = version or scenario.version
        self.scrapes = 0
        self._lock = threading.RLock()
        self._forced_down: str | None = None
        self._server: _Server | None = None
        self._serve_thread: threading.Thread | None = None
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self._wall0 = 0.0
        self._wall_consumed = 0.0
        self._gpus: list[tuple[object, str, int]] = []  # (FakeGpus, uuid, energy offset mJ)
        self._gpu_push_seconds = 0.05
        self._gpu_pushed_at = 0.0

    # -- lifecycle ------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "FakeVllm":
        self._wall0 = time.monotonic()
        self._sync_listener()
        if self.auto:
            self._ticker = threading.Thread(target=self._tick_loop, name="fakevllm-ticker", daemon=True)
            self._ticker.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._ticker:
            self._ticker.join(timeout=5)
        self._close_listener()

    def __enter__(self) -> "FakeVllm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- control --------------------------------------------------------------------------------------
    def step(self, seconds: float, push_gpus: bool = True) -> None:
        """Advance the simulation by ``seconds`` of simulated time (in addition to auto time, if any).
        ``push_gpus=False`` leaves the attached GPU state file alone (see push_gpus() to batch writes)."""
        with self._lock:
            self.engine.advance(seconds)
        self._sync_listener()
        if push_gpus:
            self._push_gpus(force=True)

    def set_phase(self, name: str | None) -> None:
        with self._lock:
            self._catch_up()
            self.engine.set_phase(name)
        self._sync_listener()
        self._push_gpus(force=True)

    def set_down(self, mode: str | None) -> None:
        """Force the server down ("refuse", "500", "timeout") or back up (None), whatever the phase says."""
        if mode is not None and mode not in DOWN_MODES:
            raise ValueError(f"mode must be one of {DOWN_MODES} or None")
        with self._lock:
            self._catch_up()
            self._forced_down = mode
        self._sync_listener()

    def restart(self) -> None:
        with self._lock:
            self._catch_up()
            self.engine.restart()

    def attach_gpu(self, gpus, uuid: str, energy_offset_mj: int = 1_000_000) -> None:
        """Mirror the scenario's GPU energy and power into a FakeGpus state file (tests/support/fake_gpus):
        energy_mj = offset + simulated energy / time_scale (auto mode: so that energy over WALL time gives the
        scenario's watts; token rates on the wall clock are time_scale x faster, ratios are unchanged),
        power_mw = current power. Updated every 0.05 s in auto mode and after every step() / set_phase() in
        manual mode. The GPU entry is added if missing."""
        if not any(g["uuid"] == uuid for g in gpus.state["gpus"]):
            gpus.add(uuid=uuid, name="NVIDIA H200")
        with self._lock:
            self._gpus.append((gpus, uuid, energy_offset_mj))
        self._push_gpus(force=True)

    def _push_gpus(self, force: bool = False, write: bool = True) -> list:
        if not self._gpus:
            return []
        now = time.monotonic()
        if not force and now - self._gpu_pushed_at < self._gpu_push_seconds:
            return []
        self._gpu_pushed_at = now
        with self._lock:
            self._catch_up()
            scale = self.time_scale if self.auto else 1.0
            mj = int(self.engine.gpu_energy_joules / scale * 1000.0)
            mw = int(self.engine.gpu_power_watts * 1000.0)
            for gpus, uuid, offset in self._gpus:
                gpus.gpu(uuid).update(energy_mj=offset + mj, power_mw=mw)
            targets = list({id(g): g for g, _, _ in self._gpus}.values())
        if write:
            for g in targets:
                g.write()
        return targets


    # -- readings -------------------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        with self._lock:
            self._catch_up()
            return self.engine.phase.name

    @property
    def collapsed(self) -> bool:
        with self._lock:
            self._catch_up()
            return self.engine.phase.collapsed

    @property
    def sim_seconds(self) -> float:
        with self._lock:
            self._catch_up()
            return self.engine.seconds

    def gpu_power_watts(self) -> float:
        with self._lock:
            self._catch_up()
            return self.engine.gpu_power_watts

    def gpu_energy_joules(self) -> float:
        with self._lock:
            self._catch_up()
            return self.engine.gpu_energy_joules

    def gpu_energy_millijoules(self) -> int:
        """As NVML's nvmlDeviceGetTotalEnergyConsumption reports it (integer mJ)."""
        return int(self.gpu_energy_joules() * 1000.0)

    def totals(self) -> dict[str, float]:
        with self._lock:
            self._catch_up()
            return self.engine.totals()

    def exposition(self) -> str:
        with self._lock:
            self._catch_up()
            return self.engine.render(self.version)

    def down_state(self) -> str | None:
        """How the server is down right now ("refuse", "500", "timeout") or None when it answers."""
        with self._lock:
            self._catch_up()
            if self._forced_down:
                return self._forced_down
            return self.down_mode if self.engine.phase.down else None

    # -- internals ------------------------------------------------------------------------------------
    def _catch_up(self) -> None:
        if not self.auto or not self._wall0:
            return
        wall = time.monotonic() - self._wall0
        lag = wall - self._wall_consumed
        if lag > 0:
            self._wall_consumed = wall
            self.engine.advance(lag * self.time_scale)

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.tick_seconds):
            with self._lock:
                self._catch_up()
            self._sync_listener()
            self._push_gpus()

    def _sync_listener(self) -> None:
        want = self.down_state() != "refuse"
        if want and self._server is None:
            self._open_listener()
        elif not want and self._server is not None:
            self._close_listener()

    def _open_listener(self) -> None:
        deadline = time.monotonic() + 5
        while True:
            try:
                server = _Server((self.host, self.port), _handler(self))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._server = server
        self._serve_thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                              name="fakevllm-http", daemon=True)
        self._serve_thread.start()

    def _close_listener(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            if self._serve_thread:
                self._serve_thread.join(timeout=5)


def _handler(fake: FakeVllm):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            down = fake.down_state()
            if down == "refuse":  # the listener closes on the next tick; drop this connection now
                self.close_connection = True
                return
            if down == "timeout":
                time.sleep(fake.timeout_hold_seconds)
                self.close_connection = True
                return
            if down == "500":
                self._send(500, b"Internal Server Error")
                return
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                text = fake.exposition()
                with fake._lock:
                    fake.scrapes += 1
                self._send(200, text.encode("utf-8"), CONTENT_TYPE)
            elif path == "/health":
                self._send(200, b"")
            elif path == "/version":
                self._send(200, json.dumps({"version": fake.version + ".0"}).encode(), "application/json")
            else:
                self._send(404, b'{"detail":"Not Found"}', "application/json")

    return Handler


def push_gpus(*fakes: FakeVllm) -> None:
    """Update every attached GPU of ``fakes`` and write each state file once (after step(push_gpus=False))."""
    files = {}
    for f in fakes:
        for g in f._push_gpus(force=True, write=False):
            files[id(g)] = g
    for g in files.values():
        g.write()
