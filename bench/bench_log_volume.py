"""Log lines per minute of a real `kvwatt run` in each failure mode of an upstream server.

One daemon (1 s sampling; no GPU and no RAPL here: one line each) watches one server per failure mode, all on loopback:
refused (nothing listens), blackholed (accepts, never answers), HTTP 500, a redirect to another port, a KV usage
of 1.7 (out of range), a bad-line count that changes on every answer, and a healthy control. After the
run, each log line is attributed to the server it names; the standard says a state is logged when it
changes, never once per tick, so every mode should stay at ~1 line however long the run.

    .venv/bin/python bench/bench_log_volume.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from _support import FIXTURE, REPO
from kvwatt_lab.experiment.server import free_port

TEXT = FIXTURE.read_text()


def serve(answer) -> str:
    """A loopback HTTP server whose GET is answered by ``answer(handler)``; returns its URL."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802
            answer(self)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}"


def send(h: BaseHTTPRequestHandler, code: int, body: str = "", headers: dict | None = None) -> None:
    data = body.encode()
    h.send_response(code)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def blackhole() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held = []
    threading.Thread(target=lambda: [held.append(sock.accept()[0]) for _ in itertools.count()],
                     daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def refused() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


def servers() -> dict[str, str]:
    healthy = serve(lambda h: send(h, 200, TEXT))
    counter = itertools.count(1)
    out_of_range = TEXT.replace('vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0',
                                'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 1.7')
    assert out_of_range != TEXT
    return {
        "healthy": healthy,
        "refused": refused(),
        "blackholed": blackhole(),
        "http500": serve(lambda h: send(h, 500, "boom")),
        "redirect": serve(lambda h: send(h, 302, "", {"Location": healthy + "/metrics"})),
        "outofrange": serve(lambda h: send(h, 200, out_of_range)),
        "badlines": serve(lambda h: send(h, 200,
                                         TEXT + 'vllm:num_preemptions_total{engine="1" 5\n' * (next(counter) % 7 + 1))),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args(argv)
    urls = servers()
    with tempfile.TemporaryDirectory(prefix="kvwatt-bench-") as tmp:
        cmd = [sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{free_port()}", "--interval", "1",
               "--powercap-root", os.path.join(tmp, "none"), "--state-dir", tmp]
        for name, url in urls.items():
            cmd += ["--server", f"{name}={url}"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(args.seconds)
        proc.terminate()
        log = proc.communicate(timeout=30)[0].splitlines()
    minutes = args.seconds / 60.0
    per_mode = {name: round(sum(f"'{name}'" in line or f" {name} " in line or f"{name}:" in line
                                for line in log) / minutes, 2) for name in urls}
    result = {"seconds": args.seconds, "log_lines_total": len(log),
              "log_lines_per_minute_total": round(len(log) / minutes, 2),
              "log_lines_per_minute_by_server": per_mode, "log": log[:40]}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
