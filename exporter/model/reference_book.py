"""Persistence of the learned low-pressure reference shares (model/pressure/reference.py), like the idle baselines
(energy/baseline.py BaselineBook): ``<state_dir>/reference-share.json``, written atomically (exporter.runtime.atomic)
when a server learned a window, read back at start, so a restarted daemon has its reference (and its tax)
at once.

Only what kvwatt writes is accepted, as in the evidence file (model/evidence_book.py): a sample's ``at`` not after
now + ``CLOCK_SLACK_SECONDS`` (kvwatt dates a sample before it writes the file). A day's allowance kept a crafted
share 0.0 dated 23.9 h ahead as the "known" reference: every live window then looked taxed, so none could replace
it, and each save wrote it back. Such entries are dropped, with one warning and a reason.

Never fatal: an unreadable file, dropped entries, a failed write or a read-only state directory (locked by
another daemon, not writable) are reasons on the ``state_dir`` source (``problems``), logged once each; the
references keep working in memory.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping

from exporter.idle.baseline import bounded_number, entry_at
from exporter.model.evidence_book import CLOCK_SLACK_SECONDS
from exporter.model.pressure import ReferenceSample
from exporter.runtime import atomic

log = logging.getLogger("kvwatt.reference")

STATE_FILE = "reference-share.json"
FORMAT_VERSION = 1


class ReferenceBook(atomic.StateBook):  # its state_dir also holds the evidence windows (model/evidence_book.py)
    def __init__(self, state_dir: str | None, wall_clock: Callable[[], float],
                 read_only_reason: str = "") -> None:
        super().__init__(state_dir, STATE_FILE, wall_clock, read_only_reason)

    def load(self) -> dict[str, list[ReferenceSample]]:
        """server -> its stored samples, oldest first; {} without a file. Bad entries are dropped (a reason)."""
        if not self.path:
            return {}
        good, problem = atomic.read_state_json(self.path, parse_file, self.wall_clock())
        self._note(problem)
        return good or {}

    def _note(self, error: str) -> None:
        if error and error != self.load_error:
            log.warning("reference share: %s", error)
        self.load_error = error

    def save(self, samples: Mapping[str, Iterable[ReferenceSample]]) -> None:
        if not self.path or self.read_only_reason:
            return
        now = self.wall_clock()
        body = {"version": FORMAT_VERSION, "servers": {
            name: [{"share": s.share, "p95": s.p95, "at": s.wall if s.wall is not None else now,
                    **({"residency_low": True} if s.residency_low else {})}  # absent in older files: False
                   for s in items] for name, items in sorted(samples.items())}}
        self.write_error = atomic.persist_json(self.path, body, "reference share", self.write_error, log)


def parse_file(data: Any, now_wall: float) -> tuple[dict[str, list[ReferenceSample]], list[str]]:
    """The file's JSON -> (server -> valid samples, 'server[i]: why' per dropped one). ValueError when the file
    as a whole is not a reference file."""
    servers = atomic.versioned_mapping(data, FORMAT_VERSION, "servers")
    good: dict[str, list[ReferenceSample]] = {}
    bad: list[str] = []
    for name, items in servers.items():
        if not isinstance(items, list):
            bad.append(f"{name}: not a list")
            continue
        for i, entry in enumerate(items):
            try:
                good.setdefault(name, []).append(parse_entry(entry, now_wall))
            except ValueError as e:
                bad.append(f"{name}[{i}]: {e}")
    return good, bad


def parse_entry(entry: Any, now_wall: float) -> ReferenceSample:
    at = entry_at(entry, ("share", "p95", "at"), now_wall, CLOCK_SLACK_SECONDS)
    return ReferenceSample(bounded_number(entry["share"], "share", 0.0, 1.0),
                           bounded_number(entry["p95"], "p95", 0.0, 1.0),
                           -1.0, at, entry.get("residency_low") is True)
