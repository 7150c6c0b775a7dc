"""A stand-in for `vllm serve` that starts in a fraction of a second: /health, /v1/models, streamed
/v1/completions with token ids and usage (what kvwatt_lab.replay.client reads) and a vLLM 0.32-style /metrics
whose counters follow the requests it served. Standard library only; run it as a server command:

    python tests/support/fake_openai_server.py --port 8123 --kv-usage 0.95 --cache-hit-ratio 0.2 \\
        --external-ratio 0.3 --preempt-every 5 --seconds-per-token 0.002

``--fail-start`` exits at once with status 2 and an argparse-like message (a bad flag), ``--startup-seconds``
delays listening. Exits on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
        lines.append("# TYPE vllm:prompt_tokens_by_source_total counter")
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            lines.append(f'vllm:prompt_tokens_by_source_total{{{labels},source="{source}"}} {float(c.get(source, 0))}')
        lines.append(f"process_start_time_seconds {self.started}")
        return "\n".join(lines) + "\n"


def handler(engine: Engine):
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
    p.add_argument("--startup-seconds", type=float, default=0.0)
    p.add_argument("--fail-start", action="store_true")
    args = p.parse_args()
    if args.fail_start:
        print("fake_openai_server: error: unrecognized arguments: --fail-start", file=sys.stderr, flush=True)
        return 2
    time.sleep(args.startup_seconds)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(Engine(args)))
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
