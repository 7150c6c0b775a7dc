"""The endpoints under connection floods and malformed requests: a real `kvwatt run` subprocess with a low
open-file limit, real sockets, a simulated vLLM server sampled all along (hardening issue items 2 and 12)."""

import errno
import io
import logging
import os
import re
import resource
import socket
import time

import requests
import yaml

from tests.support import vllm_sim as sim
from tests.support.daemon import KvwattDaemon
from tests.support.loopback import FakeVllm
from tests.support.tls import Pki

FD_LIMIT = 256


def nofile(soft: int, hard: int):
    """preexec_fn: the child's RLIMIT_NOFILE (set before exec, so the daemon starts with it)."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_idle(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections that never send a byte; non-blocking connects, so a server that stopped
    accepting cannot stall the test."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        assert s.connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS)
        socks.append(s)
    return socks


def timed_get(url: str, timeout: float = 2.0) -> tuple[float, int | str]:
    start = time.perf_counter()
    try:
        status: int | str = requests.get(url, timeout=timeout).status_code
    except requests.RequestException as e:
        status = type(e).__name__
    return time.perf_counter() - start, status


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_connections_beyond_the_fd_limit_leave_metrics_sampling_and_log_intact():
    """Before: accept() hit EMFILE, /metrics timed out and asyncio logged a traceback per accept attempt
    (174 MB in a minute at a 256 fd limit). Now the connections are capped below the limit and a new one
    closes the least recently active."""
    with FakeVllm(sim.stable_high_pressure_on()) as fv, \
            KvwattDaemon(servers={"a": fv.url}, interval="200ms", preexec_fn=nofile(FD_LIMIT, FD_LIMIT)) as d:
        d.wait_for(lambda d: d.value("kvwatt_source_up", source="vllm", server="a") == 1, what="vllm up")
        scrapes_before, t0 = fv.scrapes, time.monotonic()
        socks = open_idle(d.port, 2 * FD_LIMIT)
        try:
            time.sleep(1.0)  # let the daemon accept them all
            answers = [timed_get(d.url + "/metrics") for _ in range(10)]
            assert all(status == 200 for _, status in answers), answers
            # relative to the failure (before the fix /metrics timed out: the 2 s client timeout), not a speed target
            assert max(seconds for seconds, _ in answers) < 1.5, answers
            assert open_fds(d.proc.pid) < FD_LIMIT
            time.sleep(1.0)
            rate = (fv.scrapes - scrapes_before) / (time.monotonic() - t0)
            # relative to the configured 5/s: half of it, so a loaded machine passes and a stalled loop does not
            assert rate > 2.5, f"sampling at {rate:.2f}/s during the flood (interval 200ms: 5/s)"
            assert d.value("kvwatt_source_up", source="vllm", server="a") == 1
        finally:
            for s in socks:
                s.close()
        log = open(d.log_path).read()
        assert len(log) < 4000 and "Traceback" not in log, log[-3000:]
        assert "lowered from 512 to 64 to fit the open-file limit 256" in log and "Too many open files" not in log
        assert log.count("connections open (the --web.max-connections limit)") == 1, log


def test_connections_stuck_before_their_tls_handshake_are_capped_too(tmp_path):
    """The handshake runs after the connection is counted: silent clients on the TLS port are evicted like
    any other, and an HTTPS scrape gets in."""
    pki = Pki(tmp_path / "pki")
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": str(pki.server_cert),
                                                         "key_file": str(pki.server_key)}}))
    with KvwattDaemon(args=("--web.config.file", str(web)), https=True, request_kwargs={"verify": str(pki.ca)},
                      preexec_fn=nofile(FD_LIMIT, FD_LIMIT)) as d:
        socks = open_idle(d.port, 2 * FD_LIMIT)
        try:
            time.sleep(1.0)
            for _ in range(5):
                start = time.perf_counter()
                assert d.get("/metrics", timeout=2).status_code == 200
                assert time.perf_counter() - start < 1.0  # relative to the 2 s timeout a blocked accept hits
            assert open_fds(d.proc.pid) < FD_LIMIT
        finally:
            for s in socks:
                s.close()
        assert "Too many open files" not in d.log() and "Traceback" not in d.log(), d.log()


def test_max_connections_fit_the_open_file_limit():
    from exporter.serve.connections import fit_max_connections

    assert fit_max_connections(512, 256) == 64  # 256 - 2 accept batches of 64 - 64 reserved
    assert fit_max_connections(512, 1024) == 512
    assert fit_max_connections(512, resource.RLIM_INFINITY) == 512
    assert fit_max_connections(512, 100) == 8  # a floor: a daemon that cannot serve helps no one


def test_soft_fd_limit_is_raised_to_the_hard_limit_at_start():
    with KvwattDaemon(preexec_fn=nofile(FD_LIMIT, 2 * FD_LIMIT)) as d:
        limits = open(f"/proc/{d.proc.pid}/limits").read()
        row = re.search(r"Max open files\s+(\d+)\s+(\d+)", limits)
        assert row and row.groups() == (str(2 * FD_LIMIT), str(2 * FD_LIMIT)), limits
        assert "open-file limit raised from 256 to 512" in d.log()


def test_idle_and_slow_header_connections_are_closed_after_the_read_timeout():
    with KvwattDaemon(args=("--web.read-timeout", "1s")) as d:
        idle = socket.create_connection(("127.0.0.1", d.port))
        slow = socket.create_connection(("127.0.0.1", d.port))
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")
        start = time.monotonic()
        closed_after: dict[str, float] = {}
        for s in (idle, slow):
            s.settimeout(0.3)
        while len(closed_after) < 2 and time.monotonic() - start < 6:
            for name, s in (("idle", idle), ("slow", slow)):
                if name in closed_after:
                    continue
                if name == "slow":
                    try:
                        s.sendall(b"X")  # one header byte at a time, forever (slowloris)
                    except OSError:
                        closed_after[name] = time.monotonic() - start
                        continue
                try:
                    if s.recv(1024) == b"":
                        closed_after[name] = time.monotonic() - start
                except socket.timeout:
                    pass
                except OSError:
                    closed_after[name] = time.monotonic() - start
        idle.close()
        slow.close()
        assert set(closed_after) == {"idle", "slow"}, f"still open after 6 s: {closed_after}"
        assert max(closed_after.values()) < 3.0, closed_after  # the 1 s read timeout plus 2 s of slack
        assert d.get("/metrics").status_code == 200


MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nno colon in this header\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32),  # a TLS ClientHello on the plain port
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
]


def test_malformed_requests_are_logged_once_per_interval_without_traceback():
    with KvwattDaemon() as d:
        answers = []
        for i in range(40):
            with socket.create_connection(("127.0.0.1", d.port), timeout=3) as s:
                s.sendall(MALFORMED[i % len(MALFORMED)])
                answers.append(s.recv(64))
        assert all(re.match(rb"HTTP/1\.[01] 400 ", a) for a in answers), [a for a in answers if b" 400 " not in a]
        assert d.get("/metrics").status_code == 200
        time.sleep(0.5)
        log = d.log()
        assert "Traceback" not in log and " level=error " not in log, log[-3000:]
        lines = [line for line in log.splitlines() if "malformed HTTP request" in line]
        assert len(lines) == 1 and " level=info " in lines[0], log


def test_repeat_filter_lets_one_identical_message_through_per_interval_with_a_count():
    from exporter.runtime.logfilter import RepeatFilter

    now = [0.0]
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RepeatFilter(60.0, clock=lambda: now[0]))
    logger = logging.getLogger("kvwatt.test.repeat")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for _ in range(1000):
            logger.error("accept failed: %s", "EMFILE")
        logger.error("accept failed: %s", "ENFILE")  # a different message passes at once
        now[0] = 61.0
        logger.error("accept failed: %s", "EMFILE")
        logger.error("accept failed: %s", "EMFILE")
    finally:
        logger.removeHandler(handler)
    assert out.getvalue().splitlines() == ["accept failed: EMFILE", "accept failed: ENFILE",
                                           "accept failed: EMFILE (repeated 999 times)"]
