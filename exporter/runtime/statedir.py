"""The state directory (`state_dir`), where `kvwatt run` persists its idle baselines (README.md,
"Configuration"; docs/energy.md, "State directory").

``open_state_dir`` runs once when the daemon starts:

- The default ``/var/lib/kvwatt`` not writable (kvwatt is not root): the per-user ``$XDG_STATE_HOME/kvwatt``
  (or ``~/.local/state/kvwatt``) is used instead, and a log line says so.
- A directory that cannot be written (a configured one, or the per-user one too): the daemon runs on with its
  baselines in memory only; the reason is logged once and exported (kvwatt_source_info{source="state_dir"}).
- ``<dir>/kvwatt.lock`` is locked (flock) for the daemon's life. A second daemon on the same directory gets a
  warning and runs without persisting: it still reads the file (and follows the first daemon's baselines),
  it never writes it. Its metrics go on; only persistence is given up.
- Holding the lock, the orphaned temporary files of killed writes are removed (exporter.runtime.atomic).

The one-shot commands (`kvwatt baseline idle`) use ``resolve_dir``: same directory, no lock (their write is
merged with the daemon's, exporter.idle.baseline.BaselineBook.record).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from dataclasses import dataclass
from typing import Mapping

from exporter.config import DEFAULT_STATE_DIR
from exporter.runtime import atomic

log = logging.getLogger("kvwatt.state")

LOCK_FILE = "kvwatt.lock"


def user_state_dir(env: Mapping[str, str] | None = None) -> str:
    """$XDG_STATE_HOME/kvwatt, or ~/.local/state/kvwatt (the XDG base directory specification's default)."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):  # the specification: a relative value is invalid and ignored
        return os.path.join(xdg, "kvwatt")
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".local", "state", "kvwatt")


def unwritable(path: str) -> str:
    """'' when kvwatt can create and write files in ``path`` (created if missing), else why not."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    if not os.access(path, os.W_OK | os.X_OK):  # access() also reports a read-only file system
        return "Permission denied"
    return ""


def resolve_dir(configured: str, env: Mapping[str, str] | None = None,
                default: str = DEFAULT_STATE_DIR) -> tuple[str, str]:
    """(directory to use, '' or why it cannot be written). The default falls back to the per-user directory."""
    why = unwritable(configured)
    if not why or configured != default:
        return configured, why
    user = user_state_dir(env)
    if unwritable(user):
        return configured, why
    log.info("state dir %s is not writable (%s); using %s", configured, why, user)
    return user, ""


@dataclass
class StateDir:
    path: str
    reason: str = ""  # '' = the baselines are persisted here; else why they are not (exported, logged once)
    lock_fd: int | None = None

    def close(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the lock
            self.lock_fd = None


def open_state_dir(configured: str, env: Mapping[str, str] | None = None,
                   default: str = DEFAULT_STATE_DIR) -> StateDir:
    path, why = resolve_dir(configured, env, default)
    if why:
        return _read_only(path, f"cannot write {path} ({why})")
    lock = os.path.join(path, LOCK_FILE)
    try:
        # never through a symbolic link: its target (any file kvwatt's user can write) was truncated to the PID
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        why = "a symbolic link, not followed: remove it" if e.errno == errno.ELOOP else e.strerror
        return _read_only(path, f"cannot write {lock} ({why})")
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device is no lock file either
        os.close(fd)
        return _read_only(path, f"cannot write {lock} (not a regular file: remove it)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        return _read_only(path, f"{path} is in use by another kvwatt ({holder})")
    except OSError as e:  # a file system without flock: persist, unprotected against a second daemon
        log.warning("state dir %s: cannot lock %s (%s); persisting without the lock", path, lock, e.strerror)
    _write_pid(fd)
    removed = atomic.remove_orphans(path)
    if removed:
        log.info("state dir %s: removed %d orphaned temporary files of killed writes", path, removed)
    return StateDir(path, "", fd)


def _read_only(path: str, why: str) -> StateDir:
    log.warning("state dir: %s; idle baselines are kept in memory only, not persisted", why)
    return StateDir(path, f"not persisted: {why}")


def _holder(fd: int) -> str:
    """'pid N' as the lock holder wrote it, or 'pid unknown'."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "pid unknown"


def _write_pid(fd: int) -> None:
    """For the message of a second daemon (the lock, not this number, is what excludes it)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
