"""Persistence of the evidence windows and their epoch (model/pressure/learner.py, model/epoch.py), beside the reference
shares (model/reference_book.py): ``<state_dir>/evidence-windows.json``, written atomically (exporter.runtime.atomic)
when a server added or set aside a window (at most once per threshold window), read back at start, so a
restarted daemon has its located threshold, and the regime resting on it, at once: within its epoch only (the
first reading whose engine facts differ from the stored ones sets them aside, model/pressure/learner.py).

Hardened as the other state files: a regular file only (not a link, a FIFO or a device), at most
``MAX_FILE_BYTES``; entries that fail validation are dropped with a reason; windows older than the history
are dropped silently (they would have aged out). Never fatal: problems are reasons on the ``state_dir`` source.

Only what kvwatt writes is accepted, since a stored window votes for the threshold and the regime as a live
one does: a weight in [0, MAX_EVIDENCE_WEIGHT] (a crafted 1e6 outvoted every live window), times (the epoch's
start, a window's ``at``) not after now + ``CLOCK_SLACK_SECONDS`` (kvwatt writes them before it writes the
file; a day ahead kept a crafted verdict ~30 h), and an epoch with engine facts (the first reading always
has some; an epoch without any matched every engine).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from exporter.derive.pressure_evidence import recorded_evidence
from exporter.derive.threshold import PressurePoint
from exporter.idle.baseline import bounded_number, entry_at
from exporter.model.epoch import FACTS, Epoch
from exporter.model.pressure import MAX_EVIDENCE_WEIGHT
from exporter.runtime import atomic

log = logging.getLogger("kvwatt.evidence")

STATE_FILE = "evidence-windows.json"
# 2: a window is clean only on positive signs of low pressure, and carries its share of samples with requests
# waiting for KV capacity (methods.md s10). Version 1 files were classified by the old rule (an unknown tax could
# make a busy window clean): they are set aside at start, not trusted.
FORMAT_VERSION = 2
SET_ASIDE_VERSIONS = (1,)
MAX_FILE_BYTES = 8 << 20   # 10,000 windows x a few servers at ~250 bytes each; more is not ours
MAX_WINDOWS = 10_000       # per server (model.pressure.MAX_EVIDENCE_WINDOWS)
CLOCK_SLACK_SECONDS = 300.0  # a stored time this far after now is accepted (the wall clock stepped back)
RESIDENCY_KINDS = (None, "pressure", "low_pressure")  # a window's KV-block residency evidence (methods.md s11)

Stored = dict[str, tuple[Epoch, list[PressurePoint]]]


class EvidenceBook(atomic.StateBook):
    def __init__(self, state_dir: str | None, wall_clock: Callable[[], float],
                 read_only_reason: str = "") -> None:
        super().__init__(state_dir, STATE_FILE, wall_clock, read_only_reason)

    def load(self) -> Stored:
        """server -> (its epoch, its windows oldest first); {} without a file."""
        if not self.path:
            return {}
        good, problem = atomic.read_state_json(self.path, parse_file, self.wall_clock(), MAX_FILE_BYTES)
        if problem and problem != self.load_error:
            log.warning("evidence windows: %s", problem)
        self.load_error = problem
        return good or {}

    def save(self, servers: Mapping[str, tuple[Epoch, list[PressurePoint]]]) -> None:
        if not self.path or self.read_only_reason:
            return
        now = self.wall_clock()
        body = {"version": FORMAT_VERSION, "servers": {
            name: {"epoch": {"started": ep.started_wall, "cause": ep.cause, "engine": dict(ep.facts)},
                   "windows": [_entry(p, now) for p in points[-MAX_WINDOWS:]]}
            for name, (ep, points) in sorted(servers.items())}}
        self.write_error = atomic.persist_json(self.path, body, "evidence windows", self.write_error, log)


def _entry(p: PressurePoint, now: float) -> dict:
    ev = p.evidence
    return {"p95": ev.p95.value, "low": ev.p95.low, "high": ev.p95.high, "max": ev.kv_max,
            "preemptions_per_minute": ev.preemptions_per_minute, "tax": ev.tax, "tax_se": ev.tax_se,
            "weight": p.weight, "at": p.wall if p.wall is not None else now,
            **({"residency": ev.residency_kind} if ev.residency_kind else {}),
            **({"capacity_share": ev.capacity_share} if ev.capacity_share is not None else {})}


def parse_file(data: Any, now_wall: float) -> tuple[Stored, list[str]]:
    """The file's JSON -> (server -> (epoch, valid windows), 'server[i]: why' per dropped one). ValueError when
    the file as a whole is not an evidence file."""
    if isinstance(data, dict) and type(data.get("version")) is int and data["version"] in SET_ASIDE_VERSIONS:
        log.warning("evidence windows: the file was written by version %s of the rule (a window could be kept clean "
                    "on no evidence): set aside; the windows are learned again", data.get("version"))
        return {}, []
    servers = atomic.versioned_mapping(data, FORMAT_VERSION, "servers")
    good: Stored = {}
    bad: list[str] = []
    for name, item in servers.items():
        try:
            ep = parse_epoch(item.get("epoch") if isinstance(item, dict) else None, now_wall)
        except ValueError as e:
            bad.append(f"{name}: {e}")
            continue
        windows = item.get("windows")
        if not isinstance(windows, list):
            bad.append(f"{name}: windows is not a list")
            continue
        points = []
        for i, entry in enumerate(windows[-MAX_WINDOWS:]):
            try:
                points.append(parse_entry(entry, now_wall))
            except ValueError as e:
                bad.append(f"{name}[{i}]: {e}")
        good[name] = (ep, points)
    return good, bad


def parse_epoch(entry: Any, now_wall: float) -> Epoch:
    if not isinstance(entry, dict):
        raise ValueError("no epoch")
    started = entry.get("started")
    started = None if started is None else bounded_number(started, "started", 0.0, now_wall + CLOCK_SLACK_SECONDS)
    cause, engine = entry.get("cause", ""), entry.get("engine", {})
    if not isinstance(cause, str) or not isinstance(engine, dict):
        raise ValueError("epoch cause or engine malformed")
    facts = {k: v for k, v in engine.items()
             if k in FACTS and isinstance(v, (str, int, float, bool)) and not (isinstance(v, str) and len(v) > 512)
             and v != ""}
    if not facts:
        raise ValueError("epoch without engine facts (it would match any engine)")
    return Epoch(started, cause[:512], facts)


def _optional(entry: dict, key: str, lo: float, hi: float) -> float | None:
    return None if entry.get(key) is None else bounded_number(entry[key], key, lo, hi)


def parse_entry(entry: Any, now_wall: float) -> PressurePoint:
    at = entry_at(entry, ("p95", "weight", "at"), now_wall, CLOCK_SLACK_SECONDS)
    kind = entry.get("residency")  # absent in files written before the residency evidence: unknown
    if kind not in RESIDENCY_KINDS:
        raise ValueError(f"residency {kind!r} is not one of {', '.join(k for k in RESIDENCY_KINDS if k)}")
    p95 = bounded_number(entry["p95"], "p95", 0.0, 1.0)  # validated in the order the file's entries were always read
    per_minute = _optional(entry, "preemptions_per_minute", 0.0, 1e9)
    tax, tax_se = _optional(entry, "tax", -1.0, 1.0), _optional(entry, "tax_se", 0.0, 1.0)
    weight = bounded_number(entry["weight"], "weight", 0.0, MAX_EVIDENCE_WEIGHT)
    evidence = recorded_evidence(p95=p95, p95_low=_optional(entry, "low", 0.0, 1.0),
                                 p95_high=_optional(entry, "high", 0.0, 1.0), preemptions_per_minute=per_minute,
                                 tax=tax, tax_se=tax_se, kv_max=_optional(entry, "max", 0.0, 1.0), residency=kind,
                                 capacity_share=_optional(entry, "capacity_share", 0.0, 1.0))
    return PressurePoint(evidence=evidence, weight=weight, wall=at)
