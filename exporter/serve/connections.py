"""Bounded connections for the HTTP endpoints: a cap, least-recently-active eviction, TLS per connection.

Without a bound, ~1,100 idle TCP connections exhausted a 1,024 open-file limit: accept() failed in a loop,
/metrics became unreachable and the asyncio accept error filled the log. Here:

- the soft open-file limit is raised toward the hard one at start (``raise_fd_limit``);
- at most ``max_connections`` accepted connections are open at once, a number kept below the open-file
  limit with room for the daemon's own files and for the sockets accepted before an eviction takes effect
  (``fit_max_connections``); a new connection beyond it closes the least recently active one (the one that
  sent nothing for the longest time: an idle or stalled client, not a request being read), so a scraper
  always gets in and accept() does not hit the limit;
- the TLS handshake is done per connection after it is counted (``loop.start_tls``), so connections stuck
  in a handshake are capped and evicted like any other, and a handshake has the read timeout as deadline;
- idle and slow-header connections are closed by aiohttp's keep-alive timer (exporter/serve/web.py), armed at
  connect and after each response.

``GuardProtocol`` sits between the socket transport and aiohttp's ``RequestHandler``, forwarding every
protocol callback; aiohttp writes to the transport directly.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import ssl
from collections import OrderedDict

from aiohttp import web

log = logging.getLogger("kvwatt.web")

# The number of sockets asyncio accepts per readiness event. A socket accepted in one loop iteration reaches
# the protocol factory (where it is counted and evicts) in the next, and the evicted socket is closed in the
# one after: up to two more batches are accepted meanwhile, so 2 * ACCEPT_BATCH sockets beyond the cap can
# be open for an instant.
ACCEPT_BATCH = 64
# The kernel's queue of connections not yet accepted (they hold no file of ours). asyncio listen()s with the
# accept batch; a burst beyond that queue has its SYNs dropped and retried a second later, scrapers included.
LISTEN_BACKLOG = 1024
FD_RESERVE = 64  # open files kept for everything else: the sampler's connections, NVML, RAPL, logs, state
MIN_CONNECTIONS = 8
FD_TARGET_MAX = 1 << 20  # never ask for more than this even when the hard limit is unlimited


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one where allowed; returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_TARGET_MAX if hard == resource.RLIM_INFINITY else min(hard, FD_TARGET_MAX)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:  # e.g. above fs.nr_open: keep what we have
            log.info("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
            return soft, soft
        return soft, target
    return soft, soft


def fit_max_connections(requested: int, soft_fd_limit: int) -> int:
    """``requested`` lowered so that connections + two accept batches + the reserve fit the open-file limit."""
    if soft_fd_limit == resource.RLIM_INFINITY:
        return requested
    room = soft_fd_limit - 2 * ACCEPT_BATCH - FD_RESERVE
    return max(MIN_CONNECTIONS, min(requested, room))


class ConnectionGuard:
    """The open connections of one listening site, least recently active first."""

    def __init__(self, max_connections: int, tls: ssl.SSLContext | None = None,
                 handshake_timeout_seconds: float = 30.0):
        self.max_connections = max_connections
        self.tls = tls
        self.handshake_timeout_seconds = handshake_timeout_seconds
        self.open: OrderedDict[GuardProtocol, None] = OrderedDict()
        self.evicted = 0
        self.saturated = False

    def admit(self, conn: "GuardProtocol") -> None:
        if len(self.open) >= self.max_connections:
            oldest = next(iter(self.open))
            self.forget(oldest)
            oldest.abort()
            self.evicted += 1
            if not self.saturated:
                self.saturated = True
                log.warning("%d connections open (the --web.max-connections limit): each new one closes the "
                            "least recently active", self.max_connections)
        self.open[conn] = None

    def touch(self, conn: "GuardProtocol") -> None:
        if conn in self.open:
            self.open.move_to_end(conn)

    def forget(self, conn: "GuardProtocol") -> None:
        self.open.pop(conn, None)
        if self.saturated and len(self.open) < self.max_connections // 2:
            self.saturated = False
            log.info("connections back to %d, under half the limit; %d closed to make room since start",
                        len(self.open), self.evicted)

    def close_not_handed_over(self) -> None:
        """At shutdown: close the connections still in their TLS handshake; aiohttp's shutdown lets the
        requests of the others finish."""
        for conn in [c for c in self.open if not c.connected]:
            self.forget(conn)
            conn.abort()


class GuardProtocol(asyncio.Protocol):
    """One accepted connection: counted by the guard, TLS if configured, then aiohttp's handler."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol):
        self.guard = guard
        self.inner = inner
        self.raw: asyncio.Transport | None = None
        self.connected = False  # the inner handler has had connection_made
        self.aborted = False
        self.handshake: asyncio.Task | None = None
        # bytes that arrive between the end of the TLS handshake and the resumption of _start_tls (a client
        # sends its request with its last handshake message)
        self.early: list[bytes] = []
        guard.admit(self)  # counted from accept (one loop iteration before connection_made)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.raw = transport  # type: ignore[assignment]
        if self.aborted:  # evicted before it was connected
            transport.abort()
            return
        if self.guard.tls is None:
            self._connect_inner(transport)
        else:
            self.handshake = asyncio.get_running_loop().create_task(self._start_tls())

    async def _start_tls(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            tls_transport = await loop.start_tls(self.raw, self, self.guard.tls, server_side=True,
                                                 ssl_handshake_timeout=self.guard.handshake_timeout_seconds)
        except OSError as e:  # plain HTTP on the TLS port, an untrusted certificate, the read timeout
            log.debug("TLS handshake failed: %s", type(e).__name__)
            self.guard.forget(self)
            self.abort()
            return
        if tls_transport is None or tls_transport.is_closing():  # closed during the handshake
            self.guard.forget(self)
            return
        self._connect_inner(tls_transport)

    def _connect_inner(self, transport: asyncio.BaseTransport) -> None:
        self.connected = True
        self.inner.connection_made(transport)
        early, self.early = self.early, []
        for data in early:
            self.inner.data_received(data)

    def abort(self) -> None:
        self.aborted = True
        if self.raw is not None:
            self.raw.abort()

    def data_received(self, data: bytes) -> None:
        self.guard.touch(self)
        if self.connected:
            self.inner.data_received(data)
        else:
            self.early.append(data)

    def eof_received(self):
        return self.inner.eof_received() if self.connected else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        if self.handshake is not None and not self.handshake.done():
            self.handshake.cancel()
        if self.connected:
            self.connected = False
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.connected:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.connected:
            self.inner.resume_writing()


class GuardedSite(web.BaseSite):
    """aiohttp's TCPSite with every accepted connection passing through a ConnectionGuard."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard):
        super().__init__(runner, backlog=ACCEPT_BATCH)  # TLS is the guard's: no ssl_context for the server
        self.web_server = runner.server
        self.host, self.port, self.guard = host, port, guard

    @property
    def name(self) -> str:
        return f"{'https' if self.guard.tls else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: GuardProtocol(self.guard, self.web_server()),
                                                self.host, self.port, backlog=ACCEPT_BATCH, reuse_address=True)
        for listening in self._server.sockets:  # a dup of the fd: the backlog belongs to the socket
            with socket.fromfd(listening.fileno(), listening.family, listening.type) as s:
                s.listen(LISTEN_BACKLOG)

    async def stop(self) -> None:
        await super().stop()
        self.guard.close_not_handed_over()
