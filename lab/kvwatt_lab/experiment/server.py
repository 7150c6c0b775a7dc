"""The served model's process for one run: started from an argv list (never a shell) in its own process
group, watched, and stopped with everything it spawned (vLLM's engine core outlives its API server)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import aiohttp


class RunFailed(Exception):
    """The run cannot go on (server did not start, died, stopped answering): stops the experiment (exit 1)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def process_start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22): with the pid it names
    one process for good, so a recycled pid is never mistaken for it."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) process ids in process group ``pgid``, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def group_alive(pgid: int) -> bool:
    """Any live (not zombie) process left in process group ``pgid``."""
    return bool(group_members(pgid))


class ServerProcess:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: str):
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.adopted_pid: int | None = None

    def start(self) -> None:
        env = dict(os.environ, **self.env)
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            except OSError as e:
                raise RunFailed(f"cannot start the server command {self.argv[0]!r}: {e.strerror or e}") from None

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 8) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 8192))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def wait_healthy(self, url: str, timeout_seconds: float) -> float:
        """Seconds until GET url/health answered 200; RunFailed if the process exits or time runs out."""
        started = time.monotonic()
        health = url.rstrip("/") + "/health"
        async with aiohttp.ClientSession() as http:
            while time.monotonic() - started < timeout_seconds:
                rc = self.poll()
                if rc is not None:
                    raise RunFailed(f"server {describe_exit(rc)} before {health} answered")
                if await answers(http, health):
                    return time.monotonic() - started
                await asyncio.sleep(0.5)
        raise RunFailed(f"server did not answer {health} within {timeout_seconds:.0f} s")

    def adopt(self, pid: int) -> None:
        """Take charge of a server group this process did not start (left by an interrupted experiment)."""
        self.adopted_pid = pid

    def stop(self, grace_seconds: float) -> None:
        """SIGINT the group, SIGKILL it after ``grace_seconds``, and wait until no member is left."""
        proc, self.proc = self.proc, None
        pid = proc.pid if proc is not None else self.adopted_pid
        self.adopted_pid = None
        if pid is None:
            return
        leader_gone = (lambda: proc.poll() is not None) if proc is not None else (lambda: not group_alive(pid))
        _signal_group(pid, signal.SIGINT)
        _wait_for(leader_gone, grace_seconds)
        _signal_group(pid, signal.SIGKILL)  # workers may outlive the leader
        _wait_for(lambda: leader_gone() and not group_alive(pid), 10)


def _wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def answers(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def ensure_nothing_listening(url: str) -> None:
    """A server already answering at the run's URL would be measured instead of ours."""
    async with aiohttp.ClientSession() as http:
        if await answers(http, url.rstrip("/") + "/health"):
            raise RunFailed(f"something already answers at {url} before the server was started "
                            "(a server left from another run?)")


async def first_model(url: str) -> str:
    endpoint = url.rstrip("/") + "/v1/models"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(endpoint, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                body = await resp.json(content_type=None)
        return body["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
        raise RunFailed(f"cannot list models at {endpoint} ({type(e).__name__}); set server.model") from None
