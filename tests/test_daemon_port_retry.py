"""The test harness's `kvwatt run` (tests/support/daemon.py) on a port that something took after free_port() chose
it (another test's connection can get it as its ephemeral port): kvwatt refuses in one line, and the harness starts
it again on another port instead of failing the test (a waiting-tier test failed that way in a CI-like run)."""

from __future__ import annotations

import socket

from tests.support.daemon import KvwattDaemon


def test_a_taken_port_is_retried_on_another():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        d = KvwattDaemon(servers={"a": "http://127.0.0.1:1"})
        d.port = taken.getsockname()[1]  # as if the race had been lost
        d.url = f"http://127.0.0.1:{d.port}"
        d._write_config()
        with d:
            assert d.port != taken.getsockname()[1]
            assert d.get("/healthz").status_code in (200, 503)  # up on its new port
    finally:
        taken.close()
