"""The experiment's state file, ``OUT/state.json``: the plan it belongs to, the run order, the finished runs
with their results, the run in progress and the failure that stopped the experiment, if any.

Every change rewrites the whole file with exporter.runtime.atomic (temporary file, fsync, rename), so a kill at any
moment leaves the previous state or the new one. A run is listed as finished only after its results are on
disk; a run found ``in_progress`` on resume was interrupted and is redone from the start.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from typing import Any

from exporter.config import ConfigError
from exporter.runtime import atomic
from kvwatt_lab.experiment.plan import Plan, RunSpec
from kvwatt_lab.experiment.server import ServerProcess, process_start_ticks

STATE_FILE = "state.json"
LOCK_FILE = ".lock"
FORMAT_VERSION = 1


class ExperimentState:
    def __init__(self, out_dir: str, data: dict[str, Any]):
        self.out_dir = out_dir
        self.data = data

    @property
    def path(self) -> str:
        return os.path.join(self.out_dir, STATE_FILE)

    # --- creation and loading ----------------------------------------------------------------------------
    @classmethod
    def new(cls, out_dir: str, plan: Plan, order: list[RunSpec]) -> "ExperimentState":
        return cls(out_dir, {"version": FORMAT_VERSION, "plan": plan.to_json(), "fingerprints": plan.fingerprints(),
                             "order": [vars(r) for r in order], "finished": {}, "in_progress": None,
                             "failed": None, "created_unix": time.time()})

    @classmethod
    def load(cls, out_dir: str) -> "ExperimentState | None":
        path = os.path.join(out_dir, STATE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: unreadable state file ({e})") from None
        except RecursionError:
            raise ConfigError(f"{path}: unreadable state file (nested too deeply)") from None
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ConfigError(f"{path}: not a kvwatt experiment state file (version {FORMAT_VERSION})")
        return cls(out_dir, data)

    def save(self) -> None:
        atomic.write_json(self.path, self.data)

    # --- queries ------------------------------------------------------------------------------------------
    @property
    def order(self) -> list[RunSpec]:
        return [RunSpec(**r) for r in self.data["order"]]

    @property
    def finished(self) -> dict[str, dict]:
        return self.data["finished"]

    @property
    def in_progress(self) -> str | None:
        entry = self.data.get("in_progress")
        return entry["run"] if entry else None

    def pending(self) -> list[RunSpec]:
        return [r for r in self.order if r.run_id not in self.finished]

    # --- transitions (each one saved at once) ------------------------------------------------------------
    def start(self, run: RunSpec) -> None:
        self.data["in_progress"] = {"run": run.run_id, "started_unix": time.time()}
        self.data["failed"] = None
        self.save()

    def note_server(self, pid: int) -> None:
        """The server of the run in progress (its process group leader), so a resume after kvwatt itself
        was killed can stop a server left behind."""
        self.data["in_progress"].update(server_pid=pid, server_start_ticks=process_start_ticks(pid))
        self.save()

    def finish(self, run: RunSpec, result: dict) -> None:
        self.finished[run.run_id] = result
        self.data["in_progress"] = None
        self.save()

    def fail(self, run: RunSpec, error: str) -> None:
        self.data["in_progress"] = None
        self.data["failed"] = {"run": run.run_id, "error": error, "unix": time.time()}
        self.save()


def open_state(out_dir: str, plan: Plan, order: list[RunSpec], resume: bool) -> ExperimentState:
    """A fresh state, or with --resume the stored one, updated to the plan as it is now when the changes
    touch no finished run (e.g. a fixed flag of the condition that failed)."""
    existing = ExperimentState.load(out_dir)
    if existing is not None and not resume:
        raise ConfigError(f"--out: {out_dir} already holds an experiment ({len(existing.finished)} runs "
                          "finished); pass --resume to continue it or choose another --out")
    if existing is not None:
        reap_leftover_server(existing.data.get("in_progress"))
    if existing is None or not existing.finished:
        state = ExperimentState.new(out_dir, plan, order)
        state.save()
        return state
    check_resumable(existing, plan)
    existing.data["plan"], existing.data["fingerprints"] = plan.to_json(), plan.fingerprints()
    existing.save()
    return existing


def check_resumable(state: ExperimentState, plan: Plan) -> None:
    """ConfigError when the plan changed in a way that would mix two setups in one result table."""
    stored, now = state.data["fingerprints"], plan.fingerprints()
    if stored["protocol"] != now["protocol"]:
        raise ConfigError(f"--resume: the plan's protocol (seed, repeats, phases, sample_interval, energy or the "
                          f"list of conditions) changed since {state.path} was written; restore it or use "
                          "another --out")
    done = {r["condition"] for r in state.finished.values()}
    for name in sorted(done):
        if stored["conditions"].get(name) != now["conditions"].get(name):
            raise ConfigError(f"--resume: condition {name!r} changed (server command, arguments, vars, env or "
                              "workload) but has finished runs; restore it or use another --out")


def reap_leftover_server(in_progress: dict | None) -> bool:
    """Stop the process group of an interrupted run's server if its leader is still the very process that
    was started (same pid and start time; a recycled pid is left alone). True when one was stopped."""
    if not in_progress or not in_progress.get("server_pid"):
        return False
    pid = in_progress["server_pid"]
    if process_start_ticks(pid) != in_progress.get("server_start_ticks"):
        return False
    server = ServerProcess([], {}, os.devnull)
    server.adopt(pid)
    server.stop(grace_seconds=10)
    return True


class DirectoryLock:
    """One experiment process per output directory (flock on OUT/.lock, released when the process ends)."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, LOCK_FILE)
        self.fd: int | None = None

    def __enter__(self) -> "DirectoryLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            raise ConfigError(f"--out: {os.path.dirname(self.path)} is in use by another kvwatt experiment") from None
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
