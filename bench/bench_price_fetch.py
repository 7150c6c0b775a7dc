"""/metrics latency while kvwatt reads a large price (or carbon intensity) exposition from a URL.

    .venv/bin/python bench/bench_price_fetch.py [--megabytes 5.6] [--seconds 20] [--refresh 1s]

A real `kvwatt run` (no engine server) whose electricity price is the series ``price_eur_per_kwh{zone="FR"}``
of a text exposition of --megabytes (under the 8 MiB body limit; that sample is its last line) served on
loopback and read every --refresh. The ~100-byte lines before it are, by --shape: ``prefix`` (default), other
series whose name starts with the price's (``price_eur_per_kwh_by_feeder{...}``); ``zones``, the price's own
series for other zones; ``other``, unrelated names. For --seconds a scraper GETs /metrics 10 times a
second over real HTTP; reported: the latency p50/p99/max and the number of price reads. Before the answer was
decoded in a worker, a 5.6 MB answer held the event loop for seconds (/metrics 4.15 s against 9.7 ms).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import summary, table  # noqa: E402

from tests.support.daemon import KvwattDaemon  # noqa: E402
from tests.support.loopback import MetricsServer  # noqa: E402

SERIES = "price_eur_per_kwh"


SHAPES = {"prefix": SERIES + '_by_feeder{job="bench",instance="10.0.0.1:9100",feeder="%06d"} 0.2875\n',
          "zones": SERIES + '{job="bench",instance="10.0.0.1:9100",zone="Z%06d"} 0.2875\n',
          "other": 'filler_series_total{job="bench",instance="10.0.0.1:9100",shard="%06d"} 123456.789\n'}


def big_exposition(megabytes: float, shape: str) -> str:
    line = SHAPES[shape]
    n = int(megabytes * 1e6 / len(line % 0))
    return "".join(line % i for i in range(n)) + SERIES + '{job="bench",zone="FR"} 0.31\n'



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=5.6)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--refresh", default="1s")
    p.add_argument("--shape", choices=sorted(SHAPES), default="prefix")
    args = p.parse_args()
    text = big_exposition(args.megabytes, args.shape)
    with MetricsServer(lambda: text) as price:
        cfg = {"electricity_price_per_kwh": f'{price.url}/metrics#{SERIES}{{zone="FR"}}', "electricity_currency": "EUR",
               "price_refresh": args.refresh}
        with KvwattDaemon(config=cfg) as d:
            d.wait_for(lambda d: price.requests >= 1, what="the first price read")
            url, ms = d.url + "/metrics", []
            with requests.Session() as s:
                until = time.monotonic() + args.seconds
                while time.monotonic() < until:
                    start = time.perf_counter()
                    s.get(url, timeout=30).raise_for_status()
                    ms.append((time.perf_counter() - start) * 1e3)
                    time.sleep(0.1)
                value = d.value("kvwatt_electricity_price_per_kwh")
    s = summary(ms)
    print(f"price answer {len(text) / 1e6:.1f} MB ({args.shape}) read every {args.refresh}: {price.requests} reads, "
          f"price in use {value}")
    print(table([["/metrics", s["n"], s["p50_ms"], s["p99_ms"], s["max_ms"]]],
                ["scrape", "n", "p50_ms", "p99_ms", "max_ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
