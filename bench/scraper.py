"""Child process for the benchmarks: scrapes BASE/metrics at METRICS_HZ and BASE/healthz at HEALTHZ_HZ,
interleaved on one fixed schedule, each path on its own keep-alive connection, for SECONDS.

    python bench/scraper.py BASE SECONDS [METRICS_HZ=10] [HEALTHZ_HZ=20]

Prints one JSON object: {"/metrics": [ms, ...], "/healthz": [ms, ...], "errors": n, "metrics_bytes": n,
"slow": [[seconds since start, path, ms], ...] for requests over 20 ms}.
A request's latency runs from sending it to having read the whole body; the schedule never drifts (a slow
request delays the next one, it does not shift the grid).
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from urllib.parse import urlparse


def main() -> None:
    base, seconds = sys.argv[1], float(sys.argv[2])
    metrics_hz = float(sys.argv[3]) if len(sys.argv) > 3 else 10.0
    healthz_hz = float(sys.argv[4]) if len(sys.argv) > 4 else 20.0
    u = urlparse(base)
    conns = {p: http.client.HTTPConnection(u.hostname, u.port, timeout=10) for p in ("/metrics", "/healthz")}
    t0 = time.perf_counter() + 0.01
    plan = sorted([(t0 + k / metrics_hz, "/metrics") for k in range(int(seconds * metrics_hz))] +
                  [(t0 + 0.5 / healthz_hz + k / healthz_hz, "/healthz") for k in range(int(seconds * healthz_hz))])
    out: dict = {"/metrics": [], "/healthz": [], "errors": 0, "metrics_bytes": 0, "slow": []}
    for at, path in plan:
        delay = at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        start = time.perf_counter()
        try:
            conns[path].request("GET", path)
            resp = conns[path].getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException):
            out["errors"] += 1
            conns[path].close()
            continue
        ms = (time.perf_counter() - start) * 1e3
        out[path].append(ms)
        if ms > 20:
            out["slow"].append([round(start - t0, 2), path, round(ms, 1)])
        if path == "/metrics":
            out["metrics_bytes"] = len(body)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
