"""A process per group of servers (the setting ``processes``; docs/architecture.md "Ticks", "Serving").

A node watching many servers costs ~1.5 ms of CPU per server and tick, under the GIL: 64 servers at 1 s took
105-118 ms p50 of one core (bench/soak.py). With K > 1 processes, `kvwatt run` splits its servers into K groups,
each derived by a whole Daemon (sources -> store -> derive -> figures -> its own text exposition) on a core of
its own: group 0 in the parent itself (``in_process``), each other group in a worker process. After each tick a
worker hands the parent its rendered /metrics text through a pipe, and its /api/status JSON when the parent asks
for it (a request for /api/status or the page: ~8 ms of a 32-server worker's CPU, a quarter of its tick, not spent
every tick); the parent merges them with its own group's (``merge_texts``, ``merge_status``), never recomputes.
Group 0 in the parent, not in a worker of its own: one interpreter fewer (its modules, catalog and configuration,
~47 MiB), which kept a 64-server node under 200 MiB in all (issue 39, bench/soak.py); the parent's scrapes wait
for its tick's thread 0.5 ms at most (the switch interval), as in one process.

- Groups (``groups``): contiguous in the configured order, balanced by count; a server and its
  ``pair_off_server`` peer are one unit (paired dE reads the peer's history), never split.
- Host-wide sources: RAPL and the GPUs no server lists are read by group 0 only; every other GPU by the group
  of the server that lists it (``GroupGpus``), so no device series is doubled. The host's (RAPL) energy is split
  across servers by their GPUs' energy in the tick, which no worker knows for the others' servers: with K > 1
  it is attributed to no server (the host scope of the per-server figures is absent) rather than to group 0's.
- Merge: families by name, HELP/TYPE once, samples in group order; the same label set from several workers is
  summed for a counter (kvwatt_figures_rejected_total, process_cpu_seconds_total) and taken from the first
  worker (group 0, the host-wide sources' owner) for anything else.
- A worker that dies, or sends nothing for ``stall_seconds``: its servers read kvwatt_source_up 0 with
  kvwatt_source_info reason ``worker_down`` (never a frozen copy of its last figures), logged once; the worker is
  started again (killed first when it stalled). The parent's own group stalled reads down the same way until its
  next tick (nothing to restart: the parent is the process).
- Spawn, not fork: the parent runs an event loop with threads (the render pool, aiohttp's resolver, the pipe
  readers); a fork copies whatever locks those threads held, and a worker is restarted from that running
  parent. A spawned worker imports kvwatt afresh (~0.5 s, ~40 MiB).
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from prometheus_client.utils import floatToGoString

from exporter import rules
from exporter.config import Config, ServerConfig
from exporter.model.attribution import assign_gpus

log = logging.getLogger("kvwatt.workers")

SPAWN = multiprocessing.get_context("spawn")
WORKER_DOWN = "worker_down"
RESTART_DELAY_SECONDS = 1.0
STATUS_TIMEOUT_SECONDS = 2.0  # a worker's answer to a request for its /api/status


def processes_for(cfg: Config) -> int:
    """How many processes `kvwatt run` uses: the configured number (at most one per server), or with
    ``auto`` one up to rules.SERVERS_PER_PROCESS servers, else ceil(servers / that)."""
    n = len(cfg.servers)
    if cfg.processes == "auto":
        per = int(rules.SERVERS_PER_PROCESS.default)
        k = 1 if n <= per else math.ceil(n / per)
    else:
        k = int(cfg.processes)
    return max(1, min(k, len(units(cfg.servers))))


def units(servers: Sequence[ServerConfig]) -> list[list[ServerConfig]]:
    """The servers in configured order, a server and its pair_off_server peer (transitively) in one unit."""
    index = {s.name: i for i, s in enumerate(servers)}
    parent = list(range(len(servers)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, s in enumerate(servers):
        if s.pair_off_server in index:
            a, b = root(i), root(index[s.pair_off_server])
            parent[max(a, b)] = min(a, b)
    out: dict[int, list[ServerConfig]] = {}
    for i, s in enumerate(servers):
        out.setdefault(root(i), []).append(s)
    return list(out.values())


def groups(servers: Sequence[ServerConfig], k: int) -> list[tuple[ServerConfig, ...]]:
    """At most ``k`` groups (one per unit at most), contiguous in configured order, balanced by count: a unit
    opens the next group once the current one holds its share of the servers (or the groups after it need
    every unit left)."""
    us = units(servers)
    k = max(1, min(k, len(us)))
    n = len(servers)
    out: list[list[ServerConfig]] = [[] for _ in range(k)]
    g = placed = 0
    for i, unit in enumerate(us):
        if out[g] and g < k - 1 and (placed + len(unit) / 2 > n * (g + 1) / k or len(us) - i <= k - 1 - g):
            g += 1
        out[g] += unit
        placed += len(unit)
    return [tuple(x) for x in out]


class GroupGpus:
    """An NVML source seen by one group: the readings of the GPUs its servers list (over every configured
    server's lists, exporter.model.attribution.assign_gpus), and those no server lists when ``shared``."""

    def __init__(self, source: Any, servers: Sequence[ServerConfig], mine: Sequence[str], shared: bool) -> None:
        self.source, self.servers, self.mine, self.shared = source, tuple(servers), set(mine), shared
        self._gpus: frozenset[str] | None = None  # the GPUs of the last assignment (redone when they change)
        self._keep: set[str] = set()

    def read(self, t: float, deadline_seconds: float | None = None):
        status, readings = self.source.read(t, deadline_seconds=deadline_seconds)
        gpus = frozenset(r.device for r in readings if r.kind == "gpu")
        if gpus != self._gpus:  # assign_gpus warns of a GPU two servers list: once per change, not per tick
            a = assign_gpus(self.servers, readings)
            self._keep = {d for name, devs in a.by_server.items() if name in self.mine for d in devs}
            if self.shared:
                self._keep |= set(a.unassigned)
            self._gpus = gpus
        return status, [r for r in readings if r.kind != "gpu" or r.device in self._keep]

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close:
            close()


class NotRead:
    """RAPL in a group other than group 0 (worker 1: the parent with several processes): not read here, no
    device."""

    def read(self, t: float):
        from exporter.samples import SourceStatus

        return SourceStatus(source="rapl", server="", up=False, reason="absent: read by worker 1", duration_seconds=0.0,
                            state="down"), []


# --- the worker -------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What a worker needs: the whole configuration, its group's server names, its index, how many there are."""

    cfg: Config
    names: tuple[str, ...]
    index: int
    count: int


def worker_state_dir(state_dir: str, index: int, count: int) -> str:
    return os.path.join(state_dir, "workers", f"{index + 1}-of-{count}")


class hand_over:  # noqa: N801 (used as a function: Daemon.on_publish)
    """Daemon.on_publish of a worker: its text exposition (as rendered for its own scrape) sent to the parent at each
    tick (~150 KB for 32 servers: a memory copy through the pipe). Its /api/status JSON (~330 KB, ~8 ms of CPU for 32
    servers: a quarter of the tick's) only when the parent asks (``answer_status``, a request for /api/status or the
    page), from the worker's latest snapshot."""

    def __init__(self, conn, index: int, daemon) -> None:
        self.conn, self.index, self.daemon = conn, index, daemon
        self.lock = threading.Lock()  # the tick's thread and the parent's watcher both send

    def __call__(self, published) -> None:
        with self.lock:
            self.conn.send(("tick", self.index, published.rendered.text))

    def answer_status(self) -> None:
        from exporter.serve.web import status_json

        body = json.dumps(status_json(self.daemon.snapshot), separators=(",", ":")).encode("utf-8")
        with self.lock:
            self.conn.send(("status", self.index, body))


def watch_parent(conn, loop, stop, answer_status=None) -> None:
    """A worker's thread that answers the parent's requests for its /api/status and calls ``stop`` on ``loop`` once
    the parent is gone (its end of the pipe closed)."""

    def wait() -> None:
        try:
            while True:
                if conn.recv() == "status" and answer_status is not None:
                    answer_status()
        except (EOFError, OSError):
            pass
        loop.call_soon_threadsafe(stop)

    threading.Thread(target=wait, name="kvwatt-parent", daemon=True).start()


# --- the merge --------------------------------------------------------------------------------------------

def _families(text: str) -> list[tuple[str, str, str, list[str]]]:
    """(name, HELP line, TYPE line, sample lines) of a text exposition written family by family."""
    out = []
    for block in ("\n" + text).split("\n# HELP ")[1:]:
        lines = block.rstrip("\n").split("\n")
        name = lines[0].split(" ", 1)[0]
        out.append((name, "# HELP " + lines[0], lines[1], lines[2:]))
    return out


def merge_texts(texts: Sequence[str]) -> str:
    """One exposition of several workers' (in group order): families by name in first appearance, HELP and
    TYPE once, samples concatenated; one label set from several workers summed for a counter, else the
    first worker's."""
    merged: dict[str, tuple[str, str, list[list[str]]]] = {}
    for text in texts:
        for name, help_line, type_line, samples in _families(text):
            got = merged.get(name)
            if got is None:
                merged[name] = (help_line, type_line, [samples])
            else:
                got[2].append(samples)
    out: list[str] = []
    for name, (help_line, type_line, parts) in merged.items():
        out += [help_line, type_line]
        if len(parts) == 1:
            out += parts[0]
            continue
        counter = type_line.endswith(" counter")
        rows: dict[str, list] = {}
        for samples in parts:
            for line in samples:
                key, _, value = line.rpartition(" ")
                row = rows.get(key)
                if row is None:
                    rows[key] = [value, None]
                elif counter:
                    row[1] = (float(row[0]) if row[1] is None else row[1]) + float(value)
        out += [f"{k} {v if s is None else floatToGoString(s)}" for k, (v, s) in rows.items()]
    return "\n".join(out) + "\n" if out else ""


def down_text(names: Sequence[str], reason: str) -> str:
    """What a dead or stalled worker's servers read: source down, with the reason word ``worker_down`` (the
    details, ``reason``, are in /api/status and the log), written as the daemon writes its own lines."""
    from exporter import catalog
    from exporter.serve.exposition import sample_lines

    up = sample_lines("kvwatt_source_up", "gauge", catalog.get("kvwatt_source_up").help, ("server", "source"),
                      [((n, "vllm"), 0.0) for n in names])
    info = sample_lines("kvwatt_source_info", "gauge", catalog.get("kvwatt_source_info").help,
                        ("reason", "server", "source", "state"),
                        [((WORKER_DOWN, n, "vllm", "down"), 1.0) for n in names])
    return "".join(up + info)


def down_status(names: Sequence[str], reason: str) -> list[dict]:
    return [{"server": n, "up": False, "state": "down", "reason_code": WORKER_DOWN, "reason": reason, "windows": {}}
            for n in names]


def merge_status(statuses: Sequence[dict | None], downs: Sequence[list[dict] | None], order: Sequence[str]) -> dict:
    """One /api/status of the workers' (group order): servers in configured order, the rest from group 0."""
    first = next((s for s in statuses if s is not None), None)
    out = dict(first) if first is not None else {"servers": [], "sources": []}
    by_name: dict[str, dict] = {}
    implausible: list = []
    for st, down in zip(statuses, downs):
        for server in (down or []) + ([] if st is None else st.get("servers", [])):
            by_name.setdefault(server.get("server"), server)
        if st is not None and down is None:
            implausible += st.get("implausible", [])
    out["servers"] = [by_name[n] for n in order if n in by_name]
    if "implausible" in out:
        out["implausible"] = implausible
    return out


# --- the parent -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MergedView:
    """What the parent serves until a worker hands over its next tick: the merged text (as an Exposition) and
    the workers' /api/status, merged on the first request that asks (exporter/serve/web.py, Views)."""

    rendered: Any  # exporter.serve.exposition.Exposition
    fetch: Any  # () -> (each worker's /api/status dict or None, each down worker's server entries or None)
    order: tuple[str, ...]

    @property
    def snapshot(self) -> "MergedView":
        return self

    def merged_status(self) -> dict:
        statuses, downs = self.fetch()
        return merge_status(statuses, downs, self.order)


class _Worker:
    def __init__(self, spec: WorkerSpec, local: bool = False) -> None:
        self.spec = spec
        self.local = local  # derived in the parent (group 0 with ``in_process``): no process, no pipe
        self.daemon: Any = None  # the parent's own group's Daemon (``local``), for its /api/status
        self.process: Any = None
        self.conn: Any = None
        self.text = ""
        self.status: bytes | None = None  # its answer to the last request for its /api/status
        self.answered = threading.Event()
        self.send_lock = threading.Lock()
        self.last_at = 0.0  # monotonic time of its last hand-over (or start)
        self.down_reason = ""  # '' while it hands over its ticks
        self.generation = 0
        self.failures = 0  # exits or stalls since its last hand-over


class Supervisor:
    """The parent's side: starts the workers, reads their hand-overs (a thread per pipe), merges, restarts a
    worker that died or stalled. Its ``published`` and ``healthy`` are what exporter.serve.web reads."""

    def __init__(self, cfg: Config, k: int, target, stall_seconds: float | None = None,
                 in_process: bool = False) -> None:
        """``target(spec, conn)``: the workers' entry, exporter.runtime.service.worker_main (bench/soak.py gives
        its own, fed synthetic ticks). ``in_process``: group 0 is derived by the caller, in this process, which
        hands its ticks over through ``local_hand_over`` (`kvwatt run`); else every group is a worker process."""
        self.cfg = cfg
        self.target = target
        parts = groups(cfg.servers, k)
        self.workers = [_Worker(WorkerSpec(cfg=cfg, names=tuple(s.name for s in g), index=i, count=len(parts)),
                                local=in_process and i == 0) for i, g in enumerate(parts)]
        self.order = tuple(s.name for s in cfg.servers)
        self.stall_seconds = stall_seconds if stall_seconds is not None else max(5 * cfg.interval_seconds, 10.0)
        self.published: MergedView | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._own_ticks: queue.SimpleQueue | None = None  # the parent's own group's texts (local_hand_over)
        self.restarts = 0

    @property
    def snapshot(self):
        p = self.published
        return None if p is None else p.snapshot

    def describe(self) -> str:
        return "; ".join(f"worker {w.spec.index + 1}{' (this process)' if w.local else ''}: {', '.join(w.spec.names)}"
                         for w in self.workers)

    @property
    def local(self) -> _Worker | None:
        """The group derived in this process (``in_process``), or None."""
        return self.workers[0] if self.workers[0].local else None

    def local_hand_over(self, daemon):
        """Daemon.on_publish of the parent's own group: its text taken as a worker's hand-over is, by a thread of
        its own (``_take_own``), as a worker's is by its pipe reader: the merge (~5-7 ms for 64 servers) is not
        part of the parent's tick."""
        w = self.local
        assert w is not None, "no group is derived in this process"
        w.daemon, w.last_at = daemon, time.monotonic()
        handed = self._own_ticks = queue.SimpleQueue()
        threading.Thread(target=self._take_own, args=(w, handed), name="kvwatt-own-group", daemon=True).start()
        return lambda published: handed.put(published.rendered.text)

    def _take_own(self, w: _Worker, handed: "queue.SimpleQueue") -> None:
        while not self._stop.is_set():
            text = handed.get()
            while not handed.empty():  # only the latest tick counts
                text = handed.get_nowait()
            if text is None:
                return
            self._take(w, w.generation, text)

    def start(self) -> None:
        for w in self.workers:
            if not w.local:
                self._start(w)
        threading.Thread(target=self._watch, name="kvwatt-workers", daemon=True).start()

    def _start(self, w: _Worker) -> None:
        parent_end, child_end = SPAWN.Pipe()
        w.process = SPAWN.Process(target=self.target, args=(w.spec, child_end), daemon=True,
                                  name=f"kvwatt-worker-{w.spec.index + 1}")
        w.process.start()
        child_end.close()
        w.conn, w.last_at, w.generation = parent_end, time.monotonic(), w.generation + 1
        (log.debug if w.failures > 1 else log.info)("worker %d started (pid %d): %s", w.spec.index + 1,
                                                    w.process.pid, ", ".join(w.spec.names))
        threading.Thread(target=self._read, args=(w, parent_end, w.generation), daemon=True,
                         name=f"kvwatt-worker-{w.spec.index + 1}-pipe").start()

    def _read(self, w: _Worker, conn, generation: int) -> None:
        while not self._stop.is_set():
            try:
                kind, _, body = conn.recv()
            except (EOFError, OSError):
                return
            if kind == "status":
                w.status = body
                w.answered.set()
                continue
            if not self._take(w, generation, body):
                return

    def _take(self, w: _Worker, generation: int, text: bytes) -> bool:
        """A group's tick handed over: merged at once. False when it is from a generation since replaced."""
        with self._lock:
            if w.generation != generation:
                return False
            w.text, w.last_at = text.decode("utf-8"), time.monotonic()
            if w.down_reason:
                log.info("worker %d (%s) is back", w.spec.index + 1, ", ".join(w.spec.names))
                w.down_reason = ""
            w.failures = 0
            self._merge()
        return True

    def _merge(self) -> None:
        """Called holding the lock, after any worker's hand-over or change of health."""
        from exporter.serve.exposition import Exposition

        texts = [down_text(w.spec.names, w.down_reason) if w.down_reason else w.text for w in self.workers]
        text = merge_texts([t for t in texts if t])
        self.published = MergedView(
            rendered=Exposition.lazy(text.encode("utf-8"), lambda: _parse(text)),
            fetch=self.statuses, order=self.order)

    def statuses(self, timeout_seconds: float = STATUS_TIMEOUT_SECONDS) -> tuple[list, list]:
        """Each worker's /api/status, asked for now (in the render thread, never on the loop): (its dict or None,
        its servers' entries as down or None). A worker down, or not answering within ``timeout_seconds``: its
        servers down with the reason."""
        asked = []
        for w in self.workers:
            if w.down_reason:
                continue
            w.answered.clear()
            if w.local or w.conn is None:  # the parent's own group: read below; a worker not started yet
                continue
            try:
                with w.send_lock:
                    w.conn.send("status")
                asked.append(w)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_seconds
        for w in asked:
            w.answered.wait(max(0.0, deadline - time.monotonic()))
        statuses, downs = [], []
        for w in self.workers:
            if w.local and not w.down_reason:  # the parent's own group: its latest snapshot, as a dict (no JSON)
                from exporter.serve.web import status_json

                statuses.append(status_json(w.daemon.snapshot))
                downs.append(None)
                continue
            ok = w in asked and w.answered.is_set() and w.status is not None
            why = w.down_reason or f"worker process {w.spec.index + 1} did not answer within {timeout_seconds:g}s"
            statuses.append(json.loads(w.status) if ok else None)
            downs.append(None if ok else down_status(w.spec.names, why))
        return statuses, downs

    def _watch(self) -> None:
        """Once a second: a worker that exited or handed nothing over for stall_seconds is down (logged once,
        its servers read down) and started again."""
        while not self._stop.wait(RESTART_DELAY_SECONDS):
            for w in self.workers:
                self.check(w)

    def check(self, w: _Worker) -> None:
        now = time.monotonic()
        dead = not w.local and not w.process.is_alive()
        stalled = now - w.last_at > self.stall_seconds
        if not (dead or stalled) or self._stop.is_set() or (w.local and w.down_reason):
            return
        who = f"worker {w.spec.index + 1} (this process)" if w.local else f"worker process {w.spec.index + 1}"
        why = (f"{who} exited ({_exit(w.process.exitcode)})" if dead else
               f"{who} handed over no tick for {now - w.last_at:.0f}s")
        if w.local:  # nothing to restart: read down until its next tick clears it (``_take``)
            with self._lock:
                log.warning("%s: its servers (%s) read down", why, ", ".join(w.spec.names))
                w.down_reason = why
                self._merge()
            return
        with self._lock:
            # once when it goes down; a worker that fails again before handing over a tick is not logged again
            (log.debug if w.down_reason else log.warning)("%s: its servers (%s) read down; starting it again", why,
                                                          ", ".join(w.spec.names))
            w.down_reason, w.failures = why, w.failures + 1
            w.generation += 1  # its pipe reader stops
            self._merge()
        self._end(w)
        self.restarts += 1
        self._start(w)

    def _end(self, w: _Worker, grace_seconds: float = 5.0) -> None:
        p = w.process
        if p.is_alive():
            p.terminate()
            p.join(grace_seconds)
            if p.is_alive():
                p.kill()
        p.join(grace_seconds)
        try:
            w.conn.close()
        except OSError:
            pass

    def stop(self) -> None:
        """SIGTERM to every worker, a kill after 5 s, and wait for them: no orphan."""
        self._stop.set()
        if self._own_ticks is not None:
            self._own_ticks.put(None)  # its thread ends
        for w in self.workers:
            if w.process is not None and w.process.is_alive():
                w.process.terminate()
        for w in self.workers:
            if w.process is not None:
                self._end(w)

    def healthy(self) -> bool:
        p = self.published
        return p is not None and not any(w.down_reason for w in self.workers) and \
            all(time.monotonic() - w.last_at < self.stall_seconds for w in self.workers)


def _exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def _parse(text: str) -> list:
    """The families of a merged text (only for the forms other than the text format, or a name[] subset)."""
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))
