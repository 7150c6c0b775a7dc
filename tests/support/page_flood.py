"""A bounded flood of clients asking kvwatt for its pages, run as its own process (so the flood's CPU is not the
test's: the fake engines and the prober in the test process keep their GIL).

    python -m tests.support.page_flood URL --clients 50 --seconds 10 [--paths /api/status,/]

Each of ``--clients`` clients sends GETs one after the other (keep-alive), alternating over ``--paths``, until
``--seconds`` have passed (loopback only: refuses any other host); then prints one JSON line: answers by status,
requests per second, and the client-side latency p50/p99 in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from urllib.parse import urlsplit

import aiohttp


async def flood(url: str, clients: int, seconds: float, paths: list[str]) -> dict:
    answers: collections.Counter = collections.Counter()
    latencies: list[float] = []
    until = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def one(i: int) -> None:
            n = i
            while time.monotonic() < until:
                n += 1
                started = time.monotonic()
                try:
                    async with s.get(url + paths[n % len(paths)]) as r:
                        await r.read()
                        answers[str(r.status)] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    answers[type(e).__name__] += 1
                latencies.append(time.monotonic() - started)
        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(clients)))
        took = time.monotonic() - started
    latencies.sort()

    def q(p: float) -> float | None:
        return round(latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000, 1) if latencies else None

    return {"answers": dict(answers), "requests": len(latencies), "per_second": round(len(latencies) / took, 1),
            "p50_ms": q(0.5), "p99_ms": q(0.99)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--paths", default="/api/status,/")
    args = ap.parse_args(argv)
    if urlsplit(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        print("page_flood: loopback only", file=sys.stderr)
        return 2
    result = asyncio.run(flood(args.url.rstrip("/"), args.clients, args.seconds, args.paths.split(",")))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
