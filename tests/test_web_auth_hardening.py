"""Basic auth and TLS must not become a denial of service: bcrypt costs
above webconfig.MAX_BCRYPT_COST, hashes with a line break and passphrase-protected keys are refused at start
(one line, exit 2, no terminal read); nothing is hashed before the daemon listens; password checks are
bounded (429 past the bound), skipped when their client has gone, and a good login is served promptly while
a flood of wrong passwords arrives from another address. Real `kvwatt run` processes and real HTTP on
loopback (the flood comes from 127.0.0.2, the scraper from 127.0.0.1)."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time

import aiohttp
import bcrypt
import pytest
import yaml

from exporter.config import ConfigError
from exporter.serve import webconfig
from exporter.serve.webconfig import AUTH_QUEUE_MAX, AUTH_QUEUE_PER_CLIENT, BasicAuth, Verdict
from tests.support.daemon import REPO, KvwattDaemon, free_port
from tests.support.tls import _openssl

USER, PASSWORD = "prometheus", "s3cret-Pa55"
FLOOD = 500
GOOD_LOGIN_BOUND_SECONDS = 2.0  # a 2-core machine shared with other test runs; unloaded it takes ~0.1 s


def header(user: str, password: str) -> str:
    return aiohttp.encode_basic_auth(user, password)


def fake_hash(cost: int) -> str:
    """A string of bcrypt's shape at ``cost`` (no hash at cost 31 can be made in a test's lifetime)."""
    return f"$2b${cost:02d}$" + "a" * 53


def kvwatt_run(tmp_path, web_yml, timeout=60) -> subprocess.CompletedProcess:
    """`kvwatt run` without a terminal: stdin closed, a session of its own (no controlling tty)."""
    return subprocess.run([sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{free_port()}",
                           "--state-dir", str(tmp_path / "state"), "--web.config.file", str(web_yml)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          start_new_session=True)


def assert_one_line_exit_2(r: subprocess.CompletedProcess, says: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith("kvwatt: error: ") and says in lines[0], r.stderr


# --- refused at start ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cost", [webconfig.MAX_BCRYPT_COST + 1, 18, 31])
def test_a_bcrypt_cost_above_the_maximum_is_refused(tmp_path, cost):
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump({"basic_auth_users": {USER: fake_hash(cost)}}))
    with pytest.raises(ConfigError, match=f"bcrypt cost {cost} is outside 4..{webconfig.MAX_BCRYPT_COST}"):
        webconfig.load(str(path))


def test_the_maximum_cost_is_accepted(tmp_path):
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump({"basic_auth_users": {USER: fake_hash(webconfig.MAX_BCRYPT_COST)}}))
    assert webconfig.load(str(path)).users[USER] == fake_hash(webconfig.MAX_BCRYPT_COST).encode()


def test_kvwatt_run_with_cost_31_exits_2_with_one_line_at_once(tmp_path):
    """Before: accepted, then a dummy hash at cost 31 on the event loop before listening (days)."""
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump({"basic_auth_users": {USER: fake_hash(31)}}))
    start = time.monotonic()
    r = kvwatt_run(tmp_path, path)
    assert_one_line_exit_2(r, f"basic_auth_users.{USER}: bcrypt cost 31 is outside")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("text", [
    f"basic_auth_users:\n  {USER}: |\n    {{hash}}\n",  # a block scalar keeps the line break
    f'basic_auth_users: {{{USER}: "{{hash}}\\n"}}\n',
    f'basic_auth_users: {{{USER}: " {{hash}}"}}\n',
])
def test_a_bcrypt_hash_with_a_line_break_is_refused_at_start(tmp_path, text):
    """Before: `$` matched before the trailing newline, the hash was accepted and every login got 401."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    path = tmp_path / "web.yml"
    path.write_text(text.replace("{hash}", hashed))
    assert yaml.safe_load(path.read_text())["basic_auth_users"][USER].strip() == hashed  # the premise
    with pytest.raises(ConfigError, match="line break or spaces around it"):
        webconfig.load(str(path))
    if text.endswith("|\n    {hash}\n"):  # the CLI once (a process start costs seconds on a loaded machine)
        assert_one_line_exit_2(kvwatt_run(tmp_path, path), "line break or spaces around it")


def test_a_passphrase_protected_tls_key_is_refused_without_reading_the_terminal(tmp_path):
    key, cert = tmp_path / "locked.key", tmp_path / "server.crt"
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-aes256",
             "-pass", "pass:hunter2", "-out", str(key))
    _openssl("req", "-x509", "-new", "-key", str(key), "-passin", "pass:hunter2", "-out", str(cert),
             "-days", "1", "-subj", "/CN=localhost")
    assert "ENCRYPTED" in key.read_text()  # the premise
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": "server.crt", "key_file": "locked.key"}}))
    with pytest.raises(ConfigError, match="protected by a passphrase"):
        webconfig.load(str(path))
    r = kvwatt_run(tmp_path, path, timeout=30)
    assert_one_line_exit_2(r, "tls_server_config.key_file: ")
    assert "passphrase" in r.stderr and "PEM pass phrase" not in r.stderr + r.stdout


# --- nothing blocks the start ---------------------------------------------------------------------------------

def test_nothing_is_hashed_at_start_even_at_the_maximum_cost():
    """Before: a dummy hash at the highest configured cost, on the event loop before listening (~0.9 s at 14)."""
    users = {USER: fake_hash(webconfig.MAX_BCRYPT_COST).encode(), "other": fake_hash(10).encode()}
    start = time.perf_counter()
    BasicAuth(users)
    assert time.perf_counter() - start < 0.1


def test_sigterm_during_start_is_honoured_promptly(tmp_path):
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump({"basic_auth_users": {USER: fake_hash(webconfig.MAX_BCRYPT_COST)}}))
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{free_port()}",
                             "--state-dir", str(tmp_path / "state"), "--web.config.file", str(path)],
                            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        time.sleep(1.5)  # importing and starting: the web server is being set up about now
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        print(f"SIGTERM answered in {time.monotonic() - sent:.2f} s")
        assert time.monotonic() - sent < 5
        assert proc.returncode in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# --- the bounded queue and cancellation (BasicAuth alone) ---------------------------------------------------

@pytest.fixture
def counted_checks(monkeypatch):
    calls = []
    real = webconfig._checkpw

    def checkpw(password, hashed):
        calls.append(password)
        time.sleep(0.05)  # bcrypt at cost ~10
        return real(password, hashed)

    monkeypatch.setattr(webconfig, "_checkpw", checkpw)
    return calls


def auth() -> BasicAuth:
    return BasicAuth({USER: bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4))})


def test_checks_past_the_bound_are_answered_busy_at_once(counted_checks):
    async def main():
        a = auth()
        one_client = await asyncio.gather(*(a.check(header(USER, f"x{i}"), "10.0.0.1") for i in range(10)))
        many = await asyncio.gather(*(a.check(header(USER, f"y{i}"), f"10.0.1.{i}") for i in range(20)))
        a.close()
        return one_client, many

    one_client, many = asyncio.run(main())
    assert one_client.count(Verdict.BUSY) == 10 - AUTH_QUEUE_PER_CLIENT
    assert one_client.count(Verdict.DENIED) == AUTH_QUEUE_PER_CLIENT
    assert many.count(Verdict.BUSY) == 20 - AUTH_QUEUE_MAX and many.count(Verdict.DENIED) == AUTH_QUEUE_MAX
    assert len(counted_checks) == AUTH_QUEUE_PER_CLIENT + AUTH_QUEUE_MAX


def test_a_check_whose_client_has_gone_is_not_run(counted_checks):
    async def main():
        a = auth()
        left = {"b": False}
        first = asyncio.ensure_future(a.check(header(USER, "wrong"), "a"))
        second = asyncio.ensure_future(a.check(header(USER, PASSWORD), "b", lambda: left["b"]))
        await asyncio.sleep(0.01)  # the first is in the bcrypt thread, the second waits for its turn
        left["b"] = True  # the second's client closes its connection
        verdicts = await asyncio.gather(first, second)
        good = await a.check(header(USER, PASSWORD), "c")
        a.close()
        return verdicts, good, a.abandoned

    verdicts, good, abandoned = asyncio.run(main())
    assert verdicts == [Verdict.DENIED, Verdict.GONE] and abandoned == 1
    assert good is Verdict.ALLOWED and counted_checks == ["wrong", PASSWORD]


def test_a_remembered_good_login_never_waits_for_the_queue(counted_checks):
    async def main():
        a = auth()
        assert await a.check(header(USER, PASSWORD), "p") is Verdict.ALLOWED
        flood = [asyncio.ensure_future(a.check(header(USER, f"x{i}"), f"10.0.2.{i}")) for i in range(50)]
        await asyncio.sleep(0)
        start = time.perf_counter()
        again = await a.check(header(USER, PASSWORD), "p")
        took = time.perf_counter() - start
        await asyncio.gather(*flood)
        a.close()
        return again, took

    again, took = asyncio.run(main())
    assert again is Verdict.ALLOWED and took < 0.01


async def _flooding(a: BasicAuth, stop: asyncio.Event, client: str, user: str, i: int) -> None:
    """One wrong-password client: sends again as soon as it is answered (429 included)."""
    n = 0
    while not stop.is_set():
        n += 1
        name = user if user != "random" else f"nobody-{i}-{n}"
        await a.check(header(name, f"wrong-{i}-{n}"), client)
        # a client sends again once its answer came back: a round trip. With none (sleep(0)), 120 clients spin
        # the event loop so hard that the bcrypt thread waits seconds for the GIL after each check (measured: one
        # check in 1.6 s, so the "flood" is a GIL convoy, not a queue); at 5 ms they offer ~24,000 checks/s.
        await asyncio.sleep(0.005)


def _first_logins_under_flood(sources: list[str], flood_user: str, login_from: str, checks: list[str],
                              logins: int = 6):
    """A flood of 10 clients per source address; meanwhile ``logins`` first logins of configured users (each
    a user not logged in yet) from ``login_from``, one after the other. Their verdicts and, for each, how many
    password checks began between its arrival and its own check (``checks``: the counted_checks fixture's list)."""
    users = {f"u{i}": bcrypt.hashpw(f"pw-u{i}".encode(), bcrypt.gensalt(4)) for i in range(logins + 1)}

    async def main():
        a = BasicAuth(users)
        stop = asyncio.Event()
        flood = [asyncio.ensure_future(_flooding(a, stop, src, flood_user, i))
                 for src in sources for i in range(10)]
        # the flood under way (every place taken) and each flooding key served once: a first login arriving
        # at the very start of a flood of more keys than places is one of many never served (429, retried)
        await asyncio.sleep(0.1 * len(sources) + 0.2)
        out = []
        for n in range(1, logins + 1):
            arrived = len(checks)
            verdict = await a.check(header(f"u{n}", f"pw-u{n}"), login_from)
            ran = checks[arrived:]
            out.append((verdict, ran.index(f"pw-u{n}") if f"pw-u{n}" in ran else None))  # None: never checked
        stop.set()
        await asyncio.gather(*flood)
        a.close()
        return out

    return asyncio.run(main())


@pytest.mark.parametrize("sources, flood_user, login_from", [
    (["10.0.0.1"], "u0", "10.0.0.1"),  # behind one proxy: the flood from the scraper's own address
    ([f"10.0.3.{i}" for i in range(12)], "u0", "10.0.0.1"),  # more flooding addresses than places
    ([f"10.0.3.{i}" for i in range(12)], "random", "10.0.0.1"),  # made-up user names, each request a new one
])
def test_a_first_login_gets_in_during_a_flood_of_wrong_passwords(counted_checks, sources, flood_user, login_from):
    """Before: one check per client address and 429 at once past it, so a flood from the scraper's address
    refused every first login (16 of 16) and eight flooding addresses filled every place (21 of 21)."""
    results = _first_logins_under_flood(sources, flood_user, login_from, counted_checks)
    verdicts = [v for v, _ in results]
    assert verdicts == [Verdict.ALLOWED] * len(results), verdicts
    # about one check per flooding key ahead of it, never the whole flood: counted, not timed (a loaded CI machine
    # took 0.96 s where a quiet one takes 0.3)
    assert max(ahead for _, ahead in results) <= len(sources) + 3, results  # ALLOWED: each was checked


def test_the_limit_is_logged_when_reached_and_drained_at_most_once_a_minute(counted_checks, caplog):
    now = [0.0]

    async def wave(a: BasicAuth, at: float) -> None:
        now[0] = at
        # new passwords each wave: a wrong password is checked once, then answered 401 without a place
        await asyncio.gather(*(a.check(header(USER, f"x{at}-{i}"), "10.0.0.9") for i in range(5)))

    async def main():
        a = BasicAuth({USER: bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4))}, clock=lambda: now[0])
        for at in (0.0, 10.0, 20.0, 100.0):  # the second and third waves within a minute of the first
            await wave(a, at)
        a.close()

    with caplog.at_level("INFO", logger="kvwatt.web"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "kvwatt.web"]
    assert [line.split(";")[0].split(" (")[0] for line in lines] == [
        "password checks at their limit", "password checks drained",
        "password checks at their limit", "password checks drained"], lines
    # the quiet waves' refusals are counted in the next line logged
    per_wave = 5 - AUTH_QUEUE_PER_CLIENT
    assert f" {per_wave} requests answered 429" in lines[1] and f" {3 * per_wave} requests answered" in lines[3], lines


# --- a flood over real HTTP ---------------------------------------------------------------------------------

async def flood_and_login(url: str, seconds_after: float = 0.3, flood_from: str = "127.0.0.2",
                          creds: tuple[str, str] = (USER, PASSWORD)):
    """FLOOD wrong-password requests for USER from ``flood_from`` at once; after ``seconds_after``, a first (not
    remembered) good login from 127.0.0.1, timed. Returns (the good login's status and seconds, the flood's
    statuses)."""
    flooder = aiohttp.TCPConnector(limit=200, local_addr=(flood_from, 0))
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=flooder, timeout=timeout) as bad, \
            aiohttp.ClientSession(timeout=timeout) as good:
        async def wrong(i):
            async with bad.get(url, headers={"Authorization": header(USER, f"wrong-{i}")}) as r:
                await r.read()
                return r.status

        async def login():
            await asyncio.sleep(seconds_after)
            start = time.perf_counter()
            async with good.get(url, headers={"Authorization": header(*creds)}) as r:
                await r.read()
                return r.status, time.perf_counter() - start

        *statuses, good_login = await asyncio.gather(*(wrong(i) for i in range(FLOOD)), login())
    return good_login, statuses


def test_a_first_good_login_is_served_promptly_under_a_wrong_password_flood(tmp_path):
    """Before: 2,400 wrong passwords queued behind one bcrypt thread and a first good login took 41 s."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump({"basic_auth_users": {USER: hashed}}))
    with KvwattDaemon(args=("--web.config.file", str(path)), request_kwargs={"auth": (USER, PASSWORD)}) as d:
        (status, seconds), flood = asyncio.run(flood_and_login(d.url + "/metrics"))
        print(f"first good login under {FLOOD} wrong passwords: {status} in {seconds:.3f} s; "
              f"flood: {flood.count(401)} x 401, {flood.count(429)} x 429")
        assert status == 200 and seconds < GOOD_LOGIN_BOUND_SECONDS, (status, seconds)
        assert set(flood) <= {401, 429}, set(flood)
        assert flood.count(429) >= FLOOD - 10 * AUTH_QUEUE_MAX, flood.count(429)  # bounded: most refused at once
        assert d.get("/metrics").status_code == 200  # the daemon serves on
        log = d.log()
        assert "answering 429" in log and log.count("answering 429") <= 3  # when it changes, not per request
        assert "Traceback" not in log


def test_a_first_login_from_the_flooding_address_gets_in_over_http(tmp_path):
    """Everyone behind one proxy: the flood and Prometheus' first login (another user) from 127.0.0.1. Before:
    one check per address, so the login was answered 429 at once (16 of 16 tries)."""
    users = {USER: bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode(),
             "scraper": bcrypt.hashpw(b"pw-scraper", bcrypt.gensalt(10)).decode()}
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump({"basic_auth_users": users}))
    with KvwattDaemon(args=("--web.config.file", str(path)), request_kwargs={"auth": (USER, PASSWORD)}) as d:
        (status, seconds), flood = asyncio.run(flood_and_login(d.url + "/metrics", flood_from="127.0.0.1",
                                                               creds=("scraper", "pw-scraper")))
        print(f"first login beside {FLOOD} wrong passwords from its own address: {status} in {seconds:.3f} s")
        assert status == 200 and seconds < GOOD_LOGIN_BOUND_SECONDS, (status, seconds)
        assert set(flood) <= {401, 429} and flood.count(429) >= FLOOD - 10 * AUTH_QUEUE_MAX


# --- the scraper's own address and user name flooded (issue 38.5) --------------------------------------------

async def _retrying_login(a: BasicAuth, client: str, tries: int, pause: float) -> list[Verdict]:
    """A scraper's first (not remembered) good login, sent again after each 429 as Prometheus does at its next
    scrape; the verdicts until the first that is not BUSY."""
    verdicts = []
    for _ in range(tries):
        verdicts.append(await a.check(header(USER, PASSWORD), client))
        if verdicts[-1] is not Verdict.BUSY:
            break
        await asyncio.sleep(pause)
    return verdicts


def test_a_good_login_gets_in_during_a_flood_from_its_own_address_and_user_name(counted_checks):
    """Before: the flood held the (address, user)'s one place at every moment, so each first login was answered 429
    at once (the issue's run: 57 of 57 over 18 s; here 10 of 10). Now a password refused for lack of a place counts
    for it: the next time it comes, it takes the place of the flood's waiting check (a flood of distinct passwords
    has none refused before), so it gets in on its first retry. The flood still gets at most one bcrypt check at a
    time, and a wrong password is never checked twice."""
    async def main():
        a = auth()
        stop = asyncio.Event()
        # 50 clients sending again 5 ms after each answer: the key's place is taken again within ~0.1 ms of each
        # check's end (the HTTP flood held it as tightly)
        flood = [asyncio.ensure_future(_flooding(a, stop, "10.0.0.1", USER, i)) for i in range(50)]
        await asyncio.sleep(0.3)
        verdicts = await _retrying_login(a, "10.0.0.1", tries=10, pause=0.1)
        again = await a.check(header(USER, PASSWORD), "10.0.0.1")  # remembered now
        repeated = [await a.check(header(USER, "wrong-0-1"), "10.0.0.9") for _ in range(3)]  # checked once
        stop.set()
        await asyncio.gather(*flood)
        a.close()
        return verdicts, again, repeated

    verdicts, again, repeated = asyncio.run(main())
    assert verdicts[-1] is Verdict.ALLOWED and len(verdicts) <= 3, verdicts
    assert again is Verdict.ALLOWED and repeated == [Verdict.DENIED] * 3
    assert counted_checks.count(PASSWORD) == 1 and counted_checks.count("wrong-0-1") == 1, counted_checks[:20]


async def _flood_until(url: str, stop: asyncio.Event, clients: int) -> collections.Counter:
    """``clients`` connections from 127.0.0.1 sending USER with a new wrong password as soon as answered."""
    answers: collections.Counter = collections.Counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients),
                                     timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def one(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                async with s.get(url, headers={"Authorization": header(USER, f"wrong-{i}-{n}")}) as r:
                    await r.read()
                    answers[r.status] += 1
        await asyncio.gather(*(one(i) for i in range(clients)))
    return answers


async def _scrape_under_own_flood(url: str, tries: int = 12,
                                 pause: float = 0.5) -> tuple[list[int], collections.Counter]:
    stop = asyncio.Event()
    flood = asyncio.ensure_future(_flood_until(url, stop, clients=100))
    await asyncio.sleep(1.0)  # the flood under way
    statuses = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for _ in range(tries):
            async with s.get(url, headers={"Authorization": header(USER, PASSWORD)}) as r:
                await r.read()
                statuses.append(r.status)
            if r.status != 429:
                break
            await asyncio.sleep(pause)
    stop.set()
    return statuses, await flood


def test_a_scrape_gets_in_over_http_during_a_flood_from_its_own_address_and_user(tmp_path):
    """The issue's setting over real HTTP: wrong passwords for Prometheus' user from Prometheus' address
    (127.0.0.1), Prometheus' first login retried every 0.5 s: 200 by the third try, the refusal counts and the
    remembered wrong passwords working end to end. (The issue's run saw 429 on 57 of 57 tries over 18 s; on this
    2-core machine the flood's 429s starve the loop so that the key's place is often free when the login comes,
    so the old code let it in here too: the deterministic before/after is the BasicAuth test above.)"""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump({"basic_auth_users": {USER: hashed}}))
    with KvwattDaemon(args=("--web.config.file", str(path)), request_kwargs={"auth": (USER, PASSWORD)}) as d:
        statuses, flood = asyncio.run(_scrape_under_own_flood(d.url + "/metrics"))
        print(f"scrape under a flood from its own address and user: {statuses}; flood {dict(flood)}")
        assert statuses[-1] == 200 and len(statuses) <= 3, (statuses, dict(flood))
        assert set(flood) <= {401, 429} and flood[401] >= 1, dict(flood)
        assert "Traceback" not in d.log()


def test_refusal_counts_grow_per_password_and_halve_each_half_life():
    now = [0.0]
    counts = webconfig._RefusalCounts(lambda: now[0])
    a, b = os.urandom(32), os.urandom(32)
    for _ in range(6):
        counts.add(a)
    counts.add(b)
    assert (counts.count(a), counts.count(b)) == (6, 1)
    now[0] = webconfig.REFUSAL_HALF_LIFE_SECONDS  # one half-life later
    assert (counts.count(a), counts.count(b)) == (3, 0)
    for _ in range(300):
        counts.add(a)
    assert counts.count(a) == 255  # saturates, never wraps to 0
    now[0] += 100 * webconfig.REFUSAL_HALF_LIFE_SECONDS  # idle for long: empty, at most 8 halvings of work
    assert counts.count(a) == 0
