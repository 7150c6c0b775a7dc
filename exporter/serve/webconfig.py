"""The web configuration file: TLS and basic auth for every endpoint, in the Prometheus exporter-toolkit format.

    tls_server_config:
      cert_file: server.crt            # paths relative to this file's directory
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional: NoClientCert (default),
      client_ca_file: ca.crt                          #   VerifyClientCertIfGiven, RequireAndVerifyClientCert
      min_version: TLS12               # optional: TLS10 .. TLS13 (default TLS12); max_version likewise
    basic_auth_users:
      prometheus: $2y$10$...           # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\\n')

The file is read once at start; a problem is a ConfigError naming the file and the key (one line, exit 2).
Keys of the toolkit format that kvwatt does not implement are refused, not ignored: a setting that silently
does nothing (a cipher list, a header) is worse than a clear error.

``BasicAuth.check`` runs bcrypt (~60 ms at cost 10, ~0.9 s at the maximum cost 14) in its own worker thread,
never on the event loop nor in the pool the sampler uses, and remembers successful checks (an HMAC of user and
password under a key drawn at start, at most ``AUTH_CACHE_SIZE``), as the exporter-toolkit does: a scrape with
the right password costs one bcrypt per process lifetime. Checks not remembered are admitted in a bounded
queue (``AUTH_QUEUE_MAX``, ``AUTH_QUEUE_PER_CLIENT`` per (client address, user)) served fairly: configured users
before unknown names, then the (address, user) served least recently first, and a queued check whose client
has gone is skipped: a flood of wrong passwords (2,400 pipelined once delayed a first good login by 41 s; one
address once kept every other first login out with 429) costs at most a few seconds of one thread, lets
another (address, user)'s first login in after about one check per flooding key, and never delays a
remembered login.

A flood from the scraper's own address and user name holds that key's one place at every moment, so its place
alone would answer every first good login 429 (57 of 57 over 18 s once). What tells the scraper from such a flood
is that it sends the same password again, where a flood of guesses sends a new one each time: a password answered
429 is counted (``_RefusalCounts``, keyed by the same HMAC; fixed memory), and a check whose password was refused
more often than every check its key holds takes the key's waiting place (that check is answered 429), or waits
beside the key's running one. A first login thus gets in on its first retry after one check of the key. A
password checked and found wrong is remembered too (``AUTH_DENIED_REMEMBERED``) and answered 401 without a
check, so a wrong password cannot pile up refusals to outrank the scraper: each is checked once. The flood's
bcrypt cost is unchanged: one thread, at most ``AUTH_QUEUE_MAX`` admitted, at most one more per key.
Nothing is hashed at start.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import enum
import hashlib
import hmac
import logging
import os
import re
import ssl
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from exporter.config import ConfigError, read_yaml, unknown_key

log = logging.getLogger("kvwatt.web")

TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version")
TOP_KEYS = ("tls_server_config", "basic_auth_users")
TOOLKIT_UNSUPPORTED = ("http_server_config", "rate_limit", "cert", "key", "client_ca", "cipher_suites",
                       "curve_preferences", "prefer_server_cipher_suites", "client_allowed_sans")
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# client_auth_type -> verify mode. Go's RequestClientCert and RequireAnyClientCert ask for a certificate
# without verifying it, which Python's ssl cannot do: refused rather than silently verified.
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
BCRYPT_RE = re.compile(r"\$2[aby]\$(?P<cost>\d\d)\$[./A-Za-z0-9]{53}")  # matched whole (fullmatch)
# bcrypt's minimum cost, and the highest kvwatt accepts. One check at cost 14 took 0.90 s on a 2-core test
# machine (cost 12: 0.24 s, 15: 1.8 s; each step doubles it); with at most AUTH_QUEUE_MAX checks admitted
# at once, an admitted first login waits at most ~8 x 0.9 = 7 s, inside Prometheus' default 10 s scrape
# timeout. Cost 18 held the daemon 13 s before it listened; 31 would take days.
MIN_BCRYPT_COST, MAX_BCRYPT_COST = 4, 14
AUTH_CACHE_SIZE = 100
# bcrypt checks admitted at once (one running, the rest waiting for the one bcrypt thread), and the share of
# them one (client address, user) may hold: past the share, a request is answered 429 at once (a scraper sends
# one request at a time). The waiting checks are not served first come, first served: the next to run is a
# configured user's before an unknown name's, then the one whose (address, user) ran least recently (one never
# served first), so a flood of wrong passwords, from one address or eight, for a configured user or made-up
# ones, keeps no other (address, user)'s first login out: it waits about one check per flooding key ahead of
# it. When every place is taken, a newcomer that would run sooner than the last in line takes its place (that
# one is answered 429); otherwise it is answered 429 at once. Measured with bench/bench_auth_flood.py (docs).
AUTH_QUEUE_MAX = 8
AUTH_QUEUE_PER_CLIENT = 1
AUTH_RETRY_AFTER_SECONDS = 1
AUTH_LOG_INTERVAL_SECONDS = 60.0  # the "at their limit" warning at most this often (a flood comes in waves)
# wrong passwords remembered (an HMAC each, LRU): answered 401 at once, never checked twice
AUTH_DENIED_REMEMBERED = 4096
# the refusal counts: 2 rows of 2**20 byte counters (2 MiB, whatever the flood), each halved every minute. A
# scraper retrying every 15 s counts ~4 a minute; a flood of 5,000 new guesses a second adds ~0.4 per counter,
# and a collision only over-counts (the scraper's count is never lowered by a flood)
REFUSAL_COUNTERS, REFUSAL_ROWS, REFUSAL_HALF_LIFE_SECONDS = 1 << 20, 2, 60.0
_HALVED = bytes(b >> 1 for b in range(256))


@dataclass(frozen=True)
class WebConfig:
    path: str
    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash

    def describe(self) -> str:
        scheme = "https" if self.tls else "http"
        auth = f"basic auth ({len(self.users)} users)" if self.users else "no auth"
        return f"{scheme}, {auth} ({self.path})"


def _mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(data: dict, allowed: tuple[str, ...], where: str) -> None:
    for key in data:
        if key in TOOLKIT_UNSUPPORTED:
            raise ConfigError(f"{where}{key}: not supported by kvwatt (supported: {', '.join(allowed)})")
        if key not in allowed:
            raise unknown_key(f"{where}{key}", key, allowed)


def _text(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _version(tls: dict, key: str, default: str | None, where: str) -> ssl.TLSVersion | None:
    name = tls.get(key, default)
    if name is None:
        return None
    if name not in TLS_VERSIONS:
        raise ConfigError(f"{where}{key}: expected one of {', '.join(TLS_VERSIONS)}, got {name!r}")
    return TLS_VERSIONS[name]


def _tls_context(tls: dict, base_dir: str, where: str) -> ssl.SSLContext | None:
    _check_keys(tls, TLS_KEYS, where)
    if "cert_file" not in tls and "key_file" not in tls:
        if tls:
            raise ConfigError(f"{where}cert_file: missing (TLS settings without a certificate)")
        return None  # like the toolkit: an empty tls_server_config serves plain HTTP
    files = {}
    for key in ("cert_file", "key_file"):
        if key not in tls:
            raise ConfigError(f"{where}{key}: missing")
        files[key] = os.path.join(base_dir, _text(tls[key], f"{where}{key}"))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # called by OpenSSL only for an encrypted key: without it OpenSSL prompts on the terminal and blocks
        ctx.load_cert_chain(files["cert_file"], files["key_file"], password=_refuse_passphrase)
    except _PassphraseKey:
        raise ConfigError(f"{where}key_file: {files['key_file']} is protected by a passphrase, which kvwatt cannot "
                          "be given: store it decrypted (openssl pkey -in KEY -out KEY.plain) with mode 0600") from None
    except OSError as e:  # ssl.SSLError is an OSError; a missing file too
        detail = e.strerror or getattr(e, "reason", None) or str(e)
        raise ConfigError(f"{where}cert_file/key_file: cannot load {files['cert_file']} with "
                          f"{files['key_file']} ({detail})") from None
    ctx.minimum_version = _version(tls, "min_version", "TLS12", where)
    maximum = _version(tls, "max_version", None, where)
    if maximum is not None:
        if maximum < ctx.minimum_version:
            raise ConfigError(f"{where}max_version: lower than min_version")
        ctx.maximum_version = maximum
    ctx.set_alpn_protocols(["http/1.1"])
    _client_auth(ctx, tls, base_dir, where)
    return ctx


class _PassphraseKey(Exception):
    pass


def _refuse_passphrase():
    raise _PassphraseKey


def _client_auth(ctx: ssl.SSLContext, tls: dict, base_dir: str, where: str) -> None:
    kind = tls.get("client_auth_type", "NoClientCert")
    if kind not in CLIENT_AUTH:
        raise ConfigError(f"{where}client_auth_type: expected one of {', '.join(CLIENT_AUTH)} "
                          f"(Python's ssl verifies every client certificate it asks for), got {kind!r}")
    ca = tls.get("client_ca_file")
    if CLIENT_AUTH[kind] == ssl.CERT_NONE:
        if ca is not None:
            raise ConfigError(f"{where}client_ca_file: set without a client_auth_type that verifies")
        return
    if ca is None:
        raise ConfigError(f"{where}client_ca_file: required by client_auth_type {kind}")
    path = os.path.join(base_dir, _text(ca, f"{where}client_ca_file"))
    try:
        ctx.load_verify_locations(cafile=path)
    except OSError as e:
        raise ConfigError(f"{where}client_ca_file: cannot load {path} ({e.strerror or e})") from None
    ctx.verify_mode = CLIENT_AUTH[kind]


def _users(value, path: str) -> dict[str, bytes]:
    users, where = {}, f"{path}: basic_auth_users."
    for user, hashed in _mapping(value, f"{path}: basic_auth_users").items():
        if not isinstance(user, str) or not user or ":" in user:
            raise ConfigError(f"{where}{user!r}: a user name is a non-empty string without ':'")
        users[user] = _bcrypt_hash(hashed, f"{where}{user}")
    return users


def _bcrypt_hash(hashed, where: str) -> bytes:
    """The hash as bcrypt takes it, or ConfigError. Whitespace around it (a YAML block scalar keeps the line
    break) would make every login fail with 401 and nothing logged: refused here instead."""
    if isinstance(hashed, str) and hashed.strip() != hashed and BCRYPT_RE.fullmatch(hashed.strip()):
        raise ConfigError(f"{where}: the bcrypt hash has a line break or spaces around it: remove them")
    m = BCRYPT_RE.fullmatch(hashed) if isinstance(hashed, str) else None
    if m is None:
        raise ConfigError(f"{where}: expected a bcrypt hash ($2y$10$... from htpasswd -nB), "
                          "got something else (the value is not shown)")
    cost = int(m["cost"])
    if not MIN_BCRYPT_COST <= cost <= MAX_BCRYPT_COST:
        raise ConfigError(f"{where}: bcrypt cost {cost} is outside {MIN_BCRYPT_COST}..{MAX_BCRYPT_COST} (each step "
                          f"doubles the time of a check; {MAX_BCRYPT_COST} takes ~1 s): hash it again with "
                          f"htpasswd -nBC 10")
    return hashed.encode()


def load(path: str) -> WebConfig:
    """The web configuration at ``path``, or ConfigError with one line naming the file and the key."""
    data = _mapping(read_yaml(path), f"{path}: (top level)")
    _check_keys(data, TOP_KEYS, f"{path}: ")
    base_dir = os.path.dirname(os.path.abspath(path))
    tls = _tls_context(_mapping(data.get("tls_server_config"), f"{path}: tls_server_config"), base_dir,
                       f"{path}: tls_server_config.")
    return WebConfig(path, tls, _users(data.get("basic_auth_users"), path))


def _credentials(header: str | None) -> tuple[str, str] | None:
    """(user, password) of an 'Authorization: Basic ...' header, None when absent or malformed."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


def _checkpw(password: str, hashed: bytes) -> bool:
    import bcrypt

    try:
        return bcrypt.checkpw(password.encode(), hashed)
    except ValueError:  # longer than bcrypt's 72 bytes
        return False


class Verdict(enum.Enum):
    ALLOWED = "allowed"
    DENIED = "denied"  # 401
    BUSY = "busy"  # 429: too many bcrypt checks admitted, or this client holds its share of them
    GONE = "gone"  # the client closed its connection before its check began: no check, nobody to answer


def _cost(hashed: bytes) -> int:
    return int(hashed[4:6])


AUTH_SERVED_REMEMBERED = 4096  # (address, user) keys whose last turn is remembered (LRU): the fairness order


class _RefusalCounts:
    """How often each password (its HMAC) was answered 429 lately: a count-min sketch with conservative update
    (REFUSAL_ROWS rows of saturating byte counters), every counter halved each REFUSAL_HALF_LIFE_SECONDS."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._rows = [bytearray(REFUSAL_COUNTERS) for _ in range(REFUSAL_ROWS)]
        self._halved_at = clock()

    def _cells(self, digest: bytes) -> list[int]:
        return [int.from_bytes(digest[4 * i:4 * i + 4], "little") % REFUSAL_COUNTERS for i in range(REFUSAL_ROWS)]

    def _decay(self) -> None:
        now = self._clock()
        halvings = int((now - self._halved_at) // REFUSAL_HALF_LIFE_SECONDS)
        if halvings <= 0:
            return
        self._halved_at += halvings * REFUSAL_HALF_LIFE_SECONDS
        for _ in range(min(halvings, 8)):  # 8 halvings empty a byte counter
            self._rows = [row.translate(_HALVED) for row in self._rows]

    def count(self, digest: bytes) -> int:
        self._decay()
        return min(row[i] for row, i in zip(self._rows, self._cells(digest)))

    def add(self, digest: bytes) -> None:
        cells = self._cells(digest)
        least = min(row[i] for row, i in zip(self._rows, cells))
        if least < 255:
            for row, i in zip(self._rows, cells):
                if row[i] == least:  # conservative update: only the counters at the estimate grow
                    row[i] += 1


@dataclass(eq=False)
class _Waiting:
    """One admitted check waiting for (or holding) the bcrypt thread. ``rank``: lower runs sooner."""

    key: tuple[str, str]
    rank: tuple[bool, int, int]  # (unknown user, when its key last ran (-1: never), arrival)
    turn: asyncio.Future  # True: its turn; False: displaced by a newcomer that runs sooner (429)
    refused: int = 0  # how often its password had been answered 429 when it came (_RefusalCounts)


class BasicAuth:
    def __init__(self, users: dict[str, bytes], clock: Callable[[], float] = time.monotonic):
        import bcrypt  # noqa: F401  (fails at start, not at the first request, if the package is missing)

        self.users = users
        # An unknown user's password is checked against the costliest configured hash (the result thrown
        # away), so the answer takes as long as for a known user and nothing is hashed at start: a hashpw
        # here ran on the event loop before the daemon listened (13 s at cost 18, SIGTERM unanswered).
        self._unknown_user_hash = max(users.values(), key=_cost, default=None)
        self._key = os.urandom(32)
        self._good: OrderedDict[bytes, None] = OrderedDict()
        self._denied: OrderedDict[bytes, None] = OrderedDict()  # wrong passwords checked (LRU)
        self._refusals = _RefusalCounts(clock)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvwatt-bcrypt")
        self._waiting: list[_Waiting] = []  # admitted, not yet running (at most AUTH_QUEUE_MAX - 1)
        self._running: _Waiting | None = None  # the check holding the bcrypt thread
        self._admitted: dict[tuple[str, str], int] = {}  # (client address, user) -> checks admitted
        self._served: OrderedDict[tuple[str, str], int] = OrderedDict()  # key -> when it last ran (LRU)
        self._seq = 0
        self.refused = 0  # answered BUSY since the last line logged about it
        self._clock = clock
        self._warned_at: float | None = None  # when the limit was last logged
        self._warned = False  # a warning logged, its drain not yet
        self.abandoned = 0  # GONE: checks skipped because their client left

    def _cache_key(self, user: str, password: str) -> bytes:
        return hmac.new(self._key, f"{user}\0{password}".encode(), hashlib.sha256).digest()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _refuse(self) -> None:
        self.refused += 1
        now = self._clock()
        if not self._warned and (self._warned_at is None or now - self._warned_at >= AUTH_LOG_INTERVAL_SECONDS):
            log.warning("password checks at their limit (%d at once, %d per client address and user): answering "
                        "429 until they drain", AUTH_QUEUE_MAX, AUTH_QUEUE_PER_CLIENT)
            self._warned, self._warned_at = True, now

    def _outranks(self, key: tuple[str, str], refused: int) -> bool:
        """Whether a check of ``key`` past its share goes in: its password refused more often than every check the
        key holds. The key's waiting checks then give it their place (each answered 429)."""
        held = [w for w in self._waiting if w.key == key]
        running = [self._running] if self._running is not None and self._running.key == key else []
        if refused <= max((w.refused for w in held + running), default=-1):
            return False
        for w in held:
            self._waiting.remove(w)
            w.turn.set_result(False)
            self._refuse()
        return True

    def _admit(self, key: tuple[str, str], refused: int = 0) -> _Waiting | None:
        """A place for the check of ``key`` (its turn resolved at once when the thread is free), or None (429)."""
        if self._admitted.get(key, 0) >= AUTH_QUEUE_PER_CLIENT and not self._outranks(key, refused):
            self._refuse()
            return None
        w = _Waiting(key, (key[1] not in self.users, self._served.get(key, -1), self._next_seq()),
                     asyncio.get_running_loop().create_future(), refused)
        if self._running is not None and len(self._waiting) + 1 >= AUTH_QUEUE_MAX:
            last = max(self._waiting, key=lambda x: x.rank, default=None)
            if last is None or last.rank < w.rank:
                self._refuse()
                return None
            self._waiting.remove(last)  # a newcomer that runs sooner takes the last one's place
            last.turn.set_result(False)
            self._refuse()
        self._admitted[key] = self._admitted.get(key, 0) + 1
        self._waiting.append(w)
        self._pass_turn()
        return w

    def _pass_turn(self) -> None:
        """The bcrypt thread free: the best-ranked waiting check runs next."""
        while self._running is None and self._waiting:
            w = min(self._waiting, key=lambda x: x.rank)
            self._waiting.remove(w)
            if w.turn.done():  # its request was cancelled while waiting
                continue
            self._running = w
            self._served[w.key] = self._next_seq()
            self._served.move_to_end(w.key)
            while len(self._served) > AUTH_SERVED_REMEMBERED:
                self._served.popitem(last=False)
            w.turn.set_result(True)

    def _release(self, w: _Waiting) -> None:
        if w in self._waiting:
            self._waiting.remove(w)
        left = self._admitted.pop(w.key) - 1
        if left:
            self._admitted[w.key] = left
        if self._running is w:
            self._running = None
            self._pass_turn()
        if self._warned and not self._admitted:
            log.info("password checks drained; %d requests answered 429 since the limit was reached", self.refused)
            self._warned, self.refused = False, 0

    async def check(self, header: str | None, client: str = "", gone: Callable[[], bool] = lambda: False) -> Verdict:
        """Whether the Authorization header's user and password are right. A remembered good pair answers at
        once; any other pair is checked by bcrypt in its turn (configured users first, then the (address,
        user) served least recently), unless no place is left for it (BUSY), or its client (``gone()``) has
        left before its turn (GONE)."""
        creds = _credentials(header)
        if creds is None:
            return Verdict.DENIED
        user, password = creds
        key = self._cache_key(user, password)
        if key in self._good:
            self._good.move_to_end(key)
            return Verdict.ALLOWED
        if self._unknown_user_hash is None or key in self._denied:
            return Verdict.DENIED  # a wrong password is checked once
        w = self._admit((client, user), self._refusals.count(key))
        if w is None:
            self._refusals.add(key)
            return Verdict.BUSY
        try:
            if not await w.turn:
                self._refusals.add(key)
                return Verdict.BUSY
            if gone():
                self.abandoned += 1
                return Verdict.GONE
            hashed = self.users.get(user)
            ok = await asyncio.get_running_loop().run_in_executor(
                self._pool, _checkpw, password, hashed or self._unknown_user_hash)
        finally:
            self._release(w)
        if ok and hashed is not None:
            self._good[key] = None
            while len(self._good) > AUTH_CACHE_SIZE:
                self._good.popitem(last=False)
            return Verdict.ALLOWED
        self._denied[key] = None
        while len(self._denied) > AUTH_DENIED_REMEMBERED:
            self._denied.popitem(last=False)
        return Verdict.DENIED

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
