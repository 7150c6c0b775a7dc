"""The bound on upstream label values (docs/architecture.md "Limits"): per labelled family ("<prefix>@<value>" keys:
tier, reason, stage) and server, the first ``rules.MAX_LABEL_VALUES`` values seen are kept, for the process' life
(stable: a value kept once is kept, the series do not swap at each read); a value beyond them is dropped from
the reading (its figures unknown, never folded into another value) and the read is degraded with reason
``label_values_capped``. Logged when the set of capped families changes, not at every read."""

from __future__ import annotations

import logging
from dataclasses import replace

from exporter.rules import MAX_LABEL_VALUES
from exporter.samples import EngineReading

log = logging.getLogger("kvwatt.engine")

REASON_CODE = "label_values_capped"


class LabelCap:
    """One server's kept label values per family. Not shared between threads: one read of a server is in
    flight at a time."""

    def __init__(self, name: str, max_values: int = int(MAX_LABEL_VALUES.default)) -> None:
        self.name, self.max_values = name, max_values
        self.kept: dict[str, set[str]] = {}  # family prefix -> values kept
        self.capped: frozenset[str] = frozenset()  # families capped at the last read

    def apply(self, reading: EngineReading, problems: list[str] | None) -> EngineReading:
        dropped: dict[str, set[str]] = {}  # prefix -> values dropped at this read
        keep = lambda key: self._keep(key, dropped)
        counters = {k: v for k, v in reading.counters.items() if keep(k)}
        gauges = {k: v for k, v in reading.gauges.items() if keep(k)}
        per_engine = {e: {k: v for k, v in c.items() if keep(k)} for e, c in reading.engine_counters.items()}
        self._note(dropped)
        if not dropped:
            return reading
        if problems is not None:
            problems.append(f"{REASON_CODE}: " + "; ".join(
                f"{p}: {len(v)} value(s) beyond the first {self.max_values} dropped"
                for p, v in sorted(dropped.items())))
        return replace(reading, counters=counters, gauges=gauges, engine_counters=per_engine)

    def _keep(self, key: str, dropped: dict[str, set[str]]) -> bool:
        prefix, at, value = key.partition("@")
        if not at:
            return True
        kept = self.kept.setdefault(prefix, set())
        if value in kept:
            return True
        if len(kept) < self.max_values:
            kept.add(value)
            return True
        dropped.setdefault(prefix, set()).add(value)
        return False

    def _note(self, dropped: dict[str, int]) -> None:
        families = frozenset(dropped)
        if families == self.capped:
            return
        self.capped = families
        if families:
            log.warning("%s: more than %d distinct label values in %s: the first %d seen are kept, the rest dropped",
                        self.name, self.max_values, ", ".join(sorted(families)), self.max_values)
        else:
            log.info("%s: label values within the bound of %d again", self.name, self.max_values)
