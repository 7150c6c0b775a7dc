"""/metrics latency, sampling rate and log growth while 1,100 idle TCP connections are held open to kvwatt's port
(hardening issue item 2: at a 1,024 fd limit this once made /metrics unreachable).

    .venv/bin/python bench/bench_idle_connections.py [--connections 1100] [--fd-limit SOFT:HARD] [--seconds 10]

A real `kvwatt run` (interval 1 s) watches one fixture server (bench/fixture_servers.py, a child process).
First --seconds/2 of /metrics GETs without the flood, each on a new connection (the worst case: each one is
accepted past the flood and, at the connection cap, evicts the least recently active connection); then
--connections idle connections (connected, never sending a byte) are opened from this process, established
(up to 20 s: SYNs beyond a full listen queue are retried by the kernel) and held, and the GETs go on for
--seconds. ``--fd-limit`` sets the daemon's RLIMIT_NOFILE (default: inherited; kvwatt
raises the soft limit to the hard one itself). Reported: latency p50/p99/max and failures before and during
the flood, the fixture server's samples/s during it, the daemon's open files and log size.
"""

from __future__ import annotations

import argparse
import errno
import os
import resource
import select
import socket
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import FixtureServers, daemon_servers, summary, table  # noqa: E402

from tests.support.daemon import KvwattDaemon  # noqa: E402


def probe(url: str, seconds: float, hz: float = 10.0) -> tuple[list[float], int]:
    """GET ``url`` on a new connection ``hz`` times a second; (latencies in ms, failures)."""
    ms, failures = [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            requests.get(url, timeout=5, headers={"Connection": "close"}).raise_for_status()
            ms.append((time.perf_counter() - start) * 1e3)
        except requests.RequestException:
            failures += 1
        time.sleep(max(0.0, 1 / hz - (time.perf_counter() - start)))
    return ms, failures


def hold_idle(port: int, n: int, wait_seconds: float = 20.0) -> tuple[list[socket.socket], int]:
    """``n`` connections that never send; waits until the kernel has established them all (a full listen
    queue drops SYNs, retried 1, 3, 7 s later) or ``wait_seconds``. Returns (sockets, established)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        if s.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            s.close()
            continue
        socks.append(s)
    pending = {s.fileno(): s for s in socks}
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLOUT)
    end = time.monotonic() + wait_seconds
    established = 0
    while pending and time.monotonic() < end:
        for fd, _ in poller.poll(200):
            poller.unregister(fd)
            if pending.pop(fd).getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                established += 1
    return socks, established


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=1100)
    ap.add_argument("--fd-limit", metavar="SOFT:HARD", help="the daemon's RLIMIT_NOFILE (default: inherited)")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this process holds the idle sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.connections + 256)), hard))
    preexec = None
    if args.fd_limit:
        limit = tuple(int(x) for x in args.fd_limit.split(":"))
        preexec = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="kvwatt-bench-") as tmp, FixtureServers(1) as servers, \
            KvwattDaemon(servers=daemon_servers(servers.urls), config={"state_dir": tmp},
                         preexec_fn=preexec) as d:
        time.sleep(2)
        before, before_failures = probe(d.url + "/metrics", args.seconds / 2)
        count0, t0 = servers.counts()[0], time.monotonic()
        socks, established = hold_idle(d.port, args.connections)
        during, during_failures = probe(d.url + "/metrics", args.seconds)
        rate = (servers.counts()[0] - count0) / (time.monotonic() - t0)
        fds = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        limits = Path(f"/proc/{d.proc.pid}/limits").read_text()
        fd_limit = next(line.split()[3:5] for line in limits.splitlines() if line.startswith("Max open files"))
        for s in socks:
            s.close()
        log_bytes = os.path.getsize(d.log_path)
    result = {"idle_connections": len(socks), "established": established, "daemon_fd_limit": "/".join(fd_limit),
              "before": {**summary(before), "failures": before_failures},
              "during": {**summary(during), "failures": during_failures},
              "samples_per_s_during": round(rate, 2), "daemon_open_fds": fds, "log_bytes": log_bytes}
    rows = [[k, result[k]["n"], result[k]["failures"], result[k]["p50_ms"], result[k]["p99_ms"], result[k]["max_ms"]]
            for k in ("before", "during")]
    print(f"{len(socks)} idle connections ({established} established); "
          f"daemon fd limit soft/hard {result['daemon_fd_limit']}")
    print(table(rows, ["/metrics", "n", "failed", "p50 ms", "p99 ms", "max ms"]))
    print(f"sampling during the flood: {rate:.2f}/s (interval 1 s); daemon open files {fds}; log {log_bytes} bytes")
    result["pass"] = during_failures == 0 and rate >= 0.9
    return result


if __name__ == "__main__":
    main()
