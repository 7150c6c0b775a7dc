"""Child process for the benchmarks (bench/_support.FixtureServers): N loopback vLLM servers serving one
fixture, plus blackholed listeners that accept connections and never answer.

Prints one JSON line {"urls": [...], "blackholes": [...]}; then each "counts" line on stdin is answered with
the healthy servers' request counts (JSON list); EOF on stdin stops it.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.loopback import MetricsServer  # noqa: E402


def blackhole() -> tuple[str, socket.socket]:
    """Accepts every connection and keeps it open without ever reading or answering."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    held = []

    def accept():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", sock


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--blackholes", type=int, default=0)
    ap.add_argument("--fixture", required=True)
    args = ap.parse_args()
    text = Path(args.fixture).read_text()
    servers = [MetricsServer(lambda: text).__enter__() for _ in range(args.count)]
    holes = [blackhole() for _ in range(args.blackholes)]
    print(json.dumps({"urls": [s.url for s in servers], "blackholes": [u for u, _ in holes]}), flush=True)
    for line in sys.stdin:
        if line.strip() == "counts":
            print(json.dumps([s.requests for s in servers]), flush=True)
    for s in servers:
        s.__exit__(None, None, None)


if __name__ == "__main__":
    main()
