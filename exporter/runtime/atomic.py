"""Crash-safe file writes: write a temporary file in the same directory, fsync it, rename over the target,
fsync the directory. A kill -9 at any point leaves either the old file or the new one, never half of one.

A kill between creating the temporary file and the rename leaves the temporary file behind. Its name says
whose it is (``.tmp-kvwatt-<pid>-<random>``), so ``remove_orphans`` can clear the ones whose writer is gone
(`kvwatt run` does it for its state directory at start) and never touches another program's files.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import tempfile
import time
from typing import Any, BinaryIO, Callable

TMP_PREFIX = ".tmp-kvwatt-"
_OURS = re.compile(r"^\.tmp-kvwatt-(\d+)-[a-z0-9_]+$")
_LEGACY = re.compile(r"^\.tmp-[a-z0-9_]{8}$")  # mkstemp(prefix=".tmp-") of kvwatt <= 428d7ec: no pid
STATE_FILE_MAX_BYTES = 8 << 20  # a state file larger than this is not one of ours (the largest, 10,000 evidence
                                # windows for a few servers, is a few MiB)
FRESH_SECONDS = 2.0  # younger: a write may be in flight, even one from another pid namespace (a write takes ms)
STALE_SECONDS = 600.0  # older: orphaned whatever the pid says (pid reused, another pid namespace, no pid)


def write_bytes(path: str, data: bytes, mode: int = 0o644) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_state_json(path: str, parse: Callable[[Any, float], tuple[Any, list[str]]],
                    now_wall: float, max_bytes: int = STATE_FILE_MAX_BYTES) -> tuple[Any, str]:
    """A state-directory file through ``parse(data, now_wall) -> (good entries, 'why' per dropped entry)``:
    (good, problem or ""). No file: (None, ""); an unreadable or foreign file: (None, "ignored: ..."). Only a
    regular file is read (not a link, a FIFO or a device: opened without following links or blocking), at most
    ``max_bytes`` of it, and JSON nested too deeply is refused, so no state file can stop the daemon at start."""
    try:
        text = _read_regular(path, max_bytes)
        data = json.loads(text)
        good, bad = parse(data, now_wall)
    except (FileNotFoundError, NotADirectoryError):  # a directory that is not one: exporter.runtime.statedir says it
        return None, ""
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError, parse's own
        return None, f"ignored: {path} ({e})"
    except RecursionError:
        return None, f"ignored: {path} (nested too deeply)"
    more = " ..." if len(bad) > 3 else ""
    return good, (f"dropped: {path}: {len(bad)} bad entries ({'; '.join(bad[:3])}{more})" if bad else "")


def versioned_mapping(data: Any, version: int, key: str) -> dict:
    """The ``key`` mapping of a state file's JSON, after its header is checked: ValueError when the file as a whole
    is not one of ours (not an object, another version, ``key`` not a mapping)."""
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object but {type(data).__name__}")
    if data.get("version") != version or isinstance(data.get("version"), bool):
        raise ValueError(f"unknown version {data.get('version')!r}")
    entries = data.get(key, {})
    if not isinstance(entries, dict):
        raise ValueError(f"{key} is not a mapping but {type(entries).__name__}")
    return entries


def open_regular(path: str, follow_links: bool = False) -> BinaryIO:
    """``path`` opened for reading if it is a regular file: opened without blocking (a FIFO with no writer would
    wait forever, a device is not a file) and, unless ``follow_links``, without following a symbolic link.
    OSError when it cannot be opened, ValueError when it is not a regular file (a FIFO, a device, a directory).
    The state files (read_state_json) and the lab's replay traces are read through it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW))
    f = os.fdopen(fd, "rb")
    try:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
    except BaseException:
        f.close()
        raise
    return f


def _read_regular(path: str, max_bytes: int) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``; OSError or ValueError otherwise."""
    with open_regular(path) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"over the {max_bytes} bytes limit")
    return data.decode("utf-8")


def persist_json(path: str, obj: Any, what: str, previous_error: str, log: logging.Logger) -> str:
    """write_json for the state directory's files: a failure is kept in memory and logged once per change (a
    full disk would otherwise log every tick), a recovery once. Returns the write error, "" when written."""
    try:
        write_json(path, obj)
    except OSError as e:
        error = f"not persisted: writing {path} failed ({e.strerror or e})"
        if error != previous_error:
            log.warning("%s: %s; kept in memory", what, error)
        return error
    if previous_error:
        log.info("%s: %s written again", what, path)
    return ""


class StateBook:
    """One state-directory file of the model's (reference shares, evidence windows): where it is (None without a
    state directory), why writing is refused, and the last read's and write's problems, which are reasons on the
    ``state_dir`` source (the read-only reason is the idle baselines' too: not repeated)."""

    def __init__(self, state_dir: str | None, name: str, wall_clock: Callable[[], float],
                 read_only_reason: str = "") -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, name) if state_dir else None
        self.wall_clock = wall_clock
        self.read_only_reason = read_only_reason
        self.load_error = ""
        self.write_error = ""

    def problems(self) -> list[str]:
        return [p for p in (self.write_error, self.load_error) if p]


def _writer_gone(pid: int) -> bool:
    """True when no process ``pid`` runs here, or it is this one (which has written nothing yet: it is a
    restarted daemon whose earlier life had the same pid, e.g. pid 1 in a container)."""
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False  # not a pid kvwatt writes
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def is_orphan(name: str, age_seconds: float) -> bool:
    """Whether ``name`` is a temporary file of exporter.runtime.atomic left by a killed write."""
    if age_seconds < FRESH_SECONDS:
        return False
    ours = _OURS.match(name)
    if ours:
        return _writer_gone(int(ours.group(1))) or age_seconds > STALE_SECONDS
    return bool(_LEGACY.match(name)) and age_seconds > STALE_SECONDS


def remove_orphans(directory: str, now_wall: float | None = None) -> int:
    """Remove the orphaned temporary files of exporter.runtime.atomic in ``directory`` (not below it); how many.
    Call it only where no other kvwatt daemon writes (the caller holds the directory's lock)."""
    now_wall = time.time() if now_wall is None else now_wall
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for e in entries:
        try:
            if not e.is_file(follow_symlinks=False):
                continue
            if is_orphan(e.name, now_wall - e.stat(follow_symlinks=False).st_mtime):
                os.unlink(e.path)
                removed += 1
        except OSError:
            continue  # gone meanwhile, or not ours to remove: leave it
    return removed
