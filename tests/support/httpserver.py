"""A loopback HTTP server in a thread serving /metrics from a callable, for tests of the daemon.

    with MetricsServer(lambda: text) as srv: srv.url
``body`` may return None to answer 503, or raise to drop the connection. With ``basic_auth=(user, password)``
a request without exactly those credentials is answered 401 (``unauthorized`` counts them).
"""

from __future__ import annotations

import base64
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


class MetricsServer:
    def __init__(self, body: Callable[[], str | None], basic_auth: tuple[str, str] | None = None):
        self.body = body
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
