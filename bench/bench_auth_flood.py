"""A valid scrape's latency while a flood of wrong passwords hits kvwatt's basic auth (before its bounded queue, 2,400
pipelined wrong passwords once delayed a first good login by 41 s).

    .venv/bin/python bench/bench_auth_flood.py [--cost 10] [--flood 500] [--seconds 10] [--same-address]
        [--addresses N] [--flood-user u0|random] [--own-user]

A real `kvwatt run` with a web configuration file of --users users (bcrypt at --cost). For --seconds,
--flood concurrent clients send wrong passwords as fast as they are answered, from 127.0.0.2 (or from
127.0.0.1 with --same-address: the scraper's own address, as behind a proxy), spread over --addresses
source addresses (127.0.0.2, 127.0.0.3, ...; the first is 127.0.0.1 with --same-address), as user u0 (a
configured user) or, with --flood-user random, a new unknown user name each request. Meanwhile the scraper, from
127.0.0.1, logs in twice a second: alternately as a user not yet logged in (a first, not remembered login:
one bcrypt check) and as the first user again (remembered). Reported: latency p50/p99/max and statuses of
both kinds of scrape, and the flood's answers per second by status.
With --own-user the flood is for user u1 from 127.0.0.1, and the scraper's first login is u1's, tried again
after each answer that is not 200 until one is (issue 38.5: before, 57 of 57 such tries were answered 429).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import bcrypt
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import summary, table  # noqa: E402

from tests.support.daemon import KvwattDaemon  # noqa: E402


def auth_header(user: str, password: str) -> dict[str, str]:
    return {"Authorization": aiohttp.encode_basic_auth(user, password)}


async def flood(url: str, clients: int, until: float, source: str, answers: collections.Counter,
                user: str = "u0") -> None:
    connector = aiohttp.TCPConnector(limit=clients, local_addr=(source, 0))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(i: int) -> None:
            n = 0
            while time.monotonic() < until:
                n += 1
                name = user if user != "random" else f"nobody-{source}-{i}-{n}"
                try:
                    async with s.get(url, headers=auth_header(name, f"wrong-{i}-{n}")) as r:
                        await r.read()
                        answers[r.status] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    answers[type(e).__name__] += 1
        await asyncio.gather(*(one(i) for i in range(clients)))


async def scraper(url: str, users: int, until: float, own_user: bool = False) -> dict[str, list]:
    out = {"first login": [], "remembered": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def get(user: str) -> tuple[int | str, float]:
            start = time.perf_counter()
            try:
                async with s.get(url, headers=auth_header(user, f"pw-{user}")) as r:
                    await r.read()
                    return r.status, (time.perf_counter() - start) * 1e3
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return type(e).__name__, (time.perf_counter() - start) * 1e3

        assert (await get("u0"))[0] == 200  # u0 is remembered from here on
        await asyncio.sleep(0.5)  # the flood under way
        n = 1
        in_yet = False  # --own-user: u1 got its 200 (then remembered: no first login left to try)
        while time.monotonic() < until:
            if not (own_user and in_yet):
                out["first login"].append(await get("u1" if own_user else f"u{n % users or 1}"))
                in_yet = out["first login"][-1][0] == 200
            n += 1
            await asyncio.sleep(0.25)
            out["remembered"].append(await get("u0"))
            await asyncio.sleep(0.25)
    return out


async def run(url: str, args) -> tuple[dict, collections.Counter, float]:
    answers: collections.Counter = collections.Counter()
    start = time.monotonic()
    until = start + args.seconds
    sources = [f"127.0.0.{i + 2}" for i in range(args.addresses)]
    if args.same_address:
        sources[0] = "127.0.0.1"
    per = max(args.flood // len(sources), 1)
    scraped, *_ = await asyncio.gather(scraper(url, args.users, until, args.own_user),
                                       *(flood(url, per, until, src, answers, args.flood_user) for src in sources))
    return scraped, answers, time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cost", type=int, default=10)
    p.add_argument("--users", type=int, default=40, help="users configured (each scraped once uncached)")
    p.add_argument("--flood", type=int, default=500, help="concurrent wrong-password clients")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--same-address", action="store_true", help="flood from the scraper's address")
    p.add_argument("--addresses", type=int, default=1, help="source addresses the flood is spread over")
    p.add_argument("--flood-user", default="u0", help="u0 (a configured user) or random (unknown names)")
    p.add_argument("--own-user", action="store_true",
                   help="the flood for u1 from the scraper's address; the scraper's first login is u1's, retried")
    args = p.parse_args()
    if args.own_user:
        args.same_address, args.flood_user, args.addresses = True, "u1", 1
    with tempfile.TemporaryDirectory() as tmp:
        users = {f"u{i}": bcrypt.hashpw(f"pw-u{i}".encode(), bcrypt.gensalt(args.cost)).decode()
                 for i in range(args.users)}
        web = Path(tmp) / "web.yml"
        web.write_text(yaml.safe_dump({"basic_auth_users": users}))
        with KvwattDaemon(args=("--web.config.file", str(web)), request_kwargs={"auth": ("u0", "pw-u0")}) as d:
            scraped, answers, seconds = asyncio.run(run(d.url + "/metrics", args))
    rows = []
    for kind, results in scraped.items():
        statuses = collections.Counter(status for status, _ms in results)
        s = summary([ms for _status, ms in results])
        rows.append([kind, s["n"], s["p50_ms"], s["p99_ms"], s["max_ms"],
                     " ".join(f"{k}:{v}" for k, v in sorted(statuses.items(), key=str))])
    where = "127.0.0.1 (same address)" if args.same_address else "127.0.0.2"
    if args.addresses > 1:
        where += f" and {args.addresses - 1} more addresses"
    print(f"cost {args.cost}, {args.flood} wrong-password clients (user {args.flood_user}) from {where} "
          f"for {seconds:.1f} s")
    print(table(rows, ["scrape", "n", "p50_ms", "p99_ms", "max_ms", "statuses"]))
    print("flood answers/s: " + ", ".join(f"{k}: {v / seconds:.0f}" for k, v in sorted(answers.items(), key=str)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
