"""The loopback HTTP doubles of the test suite, in one module (standard library only at import time):

- ``MetricsServer``: a thread serving /metrics from a callable (any exposition text; the generic handler).

      with MetricsServer(lambda: text) as srv: srv.url

  ``body`` may return None to answer 503, or raise to drop the connection. With ``basic_auth=(user, password)``
  a request without exactly those credentials is answered 401 (``unauthorized`` counts them).

- ``FakeVllm``: a simulated vLLM's /metrics, /health, /version (tests/support/vllm_sim.py) on a clock.

      from tests.support import vllm_sim as sim
      from tests.support.loopback import FakeVllm

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

- The OpenAI-compatible stand-in for `vllm serve` (``Engine``, ``openai_handler``, ``main``), run as a server
  command: it starts in a fraction of a second and serves /health, /v1/models, streamed /v1/completions with
  token ids and usage (what kvwatt_lab.replay.client reads) and a vLLM 0.32-style /metrics whose counters
  follow the requests it served:

      python tests/support/loopback.py --port 8123 --kv-usage 0.95 --cache-hit-ratio 0.2 \\
          --external-ratio 0.3 --preempt-every 5 --seconds-per-token 0.002

  ``--fail-start`` exits at once with status 2 and an argparse-like message (a bad flag), ``--startup-seconds``
  delays listening, ``--flops-per-token F`` exports vLLM's FLOPs estimate (F per computed prompt or generated
  token). Exits on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # imported when a FakeVllm is made: the server command stays standard library only
    from tests.support.vllm_sim import Scenario


def free_port() -> int:
    """A port nothing listens on now (kvwatt_lab.experiment.server.free_port, without importing the lab)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- MetricsServer: /metrics from a callable -------------------------------------------------------------

class MetricsServer:
    def __init__(self, body: Callable[[], str | None], basic_auth: tuple[str, str] | None = None,
                 paths: dict[str, Callable[[], str | None]] | None = None):
        self.body = body
        self.paths = paths or {}  # further paths with their own body (trtllm-serve: /prometheus/metrics)
        self.requests = 0
        self.unauthorized = 0
        expected = None if basic_auth is None else \
            "Basic " + base64.b64encode(":".join(basic_auth).encode()).decode()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                outer.requests += 1
                if expected is not None and self.headers.get("Authorization") != expected:
                    outer.unauthorized += 1
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="vllm"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path in outer.paths:
                    text = outer.paths[self.path]()
                else:
                    text = outer.body() if self.path.startswith("/metrics") else "ok"
                if text is None:
                    self.send_response(503)
                    self.end_headers()
                    return
                data = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "MetricsServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# --- FakeVllm: a simulated vLLM (vllm_sim) on a clock ------------------------------------------------

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
        from tests.support.vllm_sim import SimEngine

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
                server = _Server((self.host, self.port), _fake_vllm_handler(self))
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


def _fake_vllm_handler(fake: FakeVllm):
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


# --- the OpenAI-compatible stand-in for `vllm serve` (run this file as a server command) ------------

MODEL = "fake"


class Engine:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.lock = threading.Lock()
        self.counters = {"generation_tokens": 0, "prompt_tokens": 0, "num_preemptions": 0, "requests": 0,
                         "local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        self.running = 0
        self.started = time.time()

    def begin(self, prompt_tokens: int) -> None:
        with self.lock:
            c = self.counters
            hit = int(prompt_tokens * self.args.cache_hit_ratio)
            external = int(prompt_tokens * self.args.external_ratio)
            c["prompt_tokens"] += prompt_tokens
            c["local_cache_hit"] += hit
            c["external_kv_transfer"] += external
            c["local_compute"] += prompt_tokens - hit - external
            c["requests"] += 1
            if self.args.preempt_every and c["requests"] % self.args.preempt_every == 0:
                c["num_preemptions"] += 1
            self.running += 1

    def generated(self, tokens: int) -> None:
        with self.lock:
            self.counters["generation_tokens"] += tokens

    def end(self) -> None:
        with self.lock:
            self.running -= 1

    def exposition(self) -> str:
        with self.lock:
            c, running = dict(self.counters), self.running
        labels = f'engine="0",model_name="{MODEL}"'
        lines = []

        def metric(name: str, kind: str, value: float, extra: str = "") -> None:
            lines.append(f"# TYPE vllm:{name} {kind}")
            lines.append(f"vllm:{name}{{{labels}{extra}}} {float(value)}")

        metric("num_requests_running", "gauge", running)
        metric("num_requests_waiting", "gauge", 0)
        metric("kv_cache_usage_perc", "gauge", self.args.kv_usage if running else 0.0)
        for name in ("generation_tokens", "prompt_tokens", "num_preemptions"):
            metric(f"{name}_total", "counter", c[name])
        if self.args.flops_per_token:   # vLLM's estimate (--enable-mfu-metrics): every computed token, both phases
            metric("estimated_flops_per_gpu_total", "counter",
                   self.args.flops_per_token * (c["local_compute"] + c["generation_tokens"]))
        lines.append("# TYPE vllm:prompt_tokens_by_source_total counter")
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            lines.append(f'vllm:prompt_tokens_by_source_total{{{labels},source="{source}"}} {float(c.get(source, 0))}')
        lines.append(f"process_start_time_seconds {self.started}")
        return "\n".join(lines) + "\n"


def openai_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/health":
                self._send(200, b"", "text/plain")
            elif self.path == "/metrics":
                self._send(200, engine.exposition().encode(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": MODEL}]}).encode(), "application/json")
            else:
                self._send(404, b"not found", "text/plain")

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            prompt, max_tokens = body.get("prompt") or [], int(body.get("max_tokens") or 1)
            engine.begin(len(prompt))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for i in range(max_tokens):
                    time.sleep(engine.args.seconds_per_token)
                    engine.generated(1)
                    self._chunk({"choices": [{"index": 0, "text": " t", "token_ids": [1000 + i % 900]}]})
                self._chunk({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": max_tokens}})
                self._raw(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                engine.end()

        def _chunk(self, obj: dict) -> None:
            self._raw(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def _raw(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--kv-usage", type=float, default=0.5)
    p.add_argument("--cache-hit-ratio", type=float, default=0.5)
    p.add_argument("--external-ratio", type=float, default=0.0)
    p.add_argument("--preempt-every", type=int, default=0)
    p.add_argument("--seconds-per-token", type=float, default=0.002)
    p.add_argument("--flops-per-token", type=float, default=0.0)
    p.add_argument("--startup-seconds", type=float, default=0.0)
    p.add_argument("--fail-start", action="store_true")
    args = p.parse_args()
    if args.fail_start:
        print("loopback: error: unrecognized arguments: --fail-start", file=sys.stderr, flush=True)
        return 2
    time.sleep(args.startup_seconds)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), openai_handler(Engine(args)))
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"fake server listening on {args.port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
