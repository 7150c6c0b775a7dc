"""A loopback HTTP server in a thread serving /metrics from a callable, for tests of the daemon.

    with MetricsServer(lambda: text) as srv: srv.url
``body`` may return None to answer 503, or raise to drop the connection.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


class MetricsServer:
    def __init__(self, body: Callable[[], str | None]):
        self.body = body
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                outer.requests += 1
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
