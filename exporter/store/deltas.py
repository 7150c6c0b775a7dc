"""Counter increases between readings, energy between successful reads, and per-device joules between ticks:
what ServerHistory turns successive readings into Intervals with (its module docstring has the rules)."""

from __future__ import annotations

from dataclasses import dataclass, field

from exporter.samples import DeviceReading


def counter_deltas(prev: dict[str, float], cur: dict[str, float], restarted: bool) -> dict[str, float]:
    """One engine's counter increases since its previous reading. A counter seen for the first time, or one
    that went down, re-bases: no delta (a decrease is a reset or a partial sum, and its value is not an
    increase we can trust). After a whole-server restart (``restarted``) a value is its increase only where the
    counter went down (the new process counts from zero); one that did not go down counts its rise, never its
    whole value (a whole counter of hours counted in one step is a rate of 1e8 tokens/s)."""
    out = {}
    for key, value in cur.items():
        before = prev.get(key)
        if before is None:
            continue  # first sight of this counter: no interval yet
        if value >= before:
            out[key] = value - before
        elif restarted:
            out[key] = value
    return out


def engine_deltas(prev: dict[str, dict[str, float]], cur: dict[str, dict[str, float]],
                  restarted: bool) -> dict[str, float]:
    """The server's counter increases: per key, the sum of each engine's own increase (``counter_deltas``).
    Engines missing from ``cur`` contribute nothing; a key no engine gives an increase for is absent."""
    total: dict[str, float] = {}
    for engine, counters in cur.items():
        for key, d in counter_deltas(prev.get(engine, {}), counters, restarted).items():
            total[key] = total[key] + d if key in total else d
    return total


def reset_engines(prev: dict[str, dict[str, float]], cur: dict[str, dict[str, float]]) -> list[str]:
    """Engines with a counter that went down since the previous reading."""
    return [e for e, counters in cur.items()
            if any(v < prev[e][k] for k, v in counters.items() if k in prev.get(e, {}))]


@dataclass
class EnergyAccumulator:
    """Energy (and idle energy) per scope since the server's last successful read; None once a gap hit."""

    joules: dict[str, float | None] = field(default_factory=dict)
    idle_joules: dict[str, float | None] = field(default_factory=dict)

    def add(self, scope: str, joules: float | None, idle: float | None) -> None:
        for target, value in ((self.joules, joules), (self.idle_joules, idle)):
            if scope in target and target[scope] is None:
                continue
            target[scope] = None if value is None else target.get(scope, 0.0) + value

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        e = {k: v for k, v in self.joules.items() if v is not None}
        i = {k: v for k, v in self.idle_joules.items() if v is not None and k in e}
        self.joules, self.idle_joules = {}, {}
        return e, i



class DeviceTracker:
    """Per-device joules between ticks from the sources' corrected cumulative counters."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.last_read_at: dict[str, float | None] = {}

    def deltas(self, readings: list[DeviceReading]) -> dict[str, float | None]:
        """device -> joules since the previous tick, or None when that device has no sample for the step."""
        out: dict[str, float | None] = {}
        for r in readings:
            prev = self.last.get(r.device)
            if r.joules_total is None:
                out[r.device] = None
                self.last.pop(r.device, None)  # re-base on the next good read: no catch-up delta
                self.last_read_at.pop(r.device, None)
                continue
            if prev is None or not r.continuous or r.joules_total < prev:
                out[r.device] = None
            else:
                out[r.device] = r.joules_total - prev
            self.last[r.device], self.last_read_at[r.device] = r.joules_total, r.read_at
        return out

    def spans(self, readings: list[DeviceReading]) -> dict[str, tuple[float, float] | None]:
        """device -> (joules, seconds) since its previous reading, the seconds taken between the two readings'
        own read_at (energy and time over the same interval), or None when the step has no sample."""
        before = dict(self.last_read_at)
        deltas = self.deltas(readings)
        out: dict[str, tuple[float, float] | None] = {}
        for r in readings:
            d, prev_at = deltas[r.device], before.get(r.device)
            ok = d is not None and r.read_at is not None and prev_at is not None
            out[r.device] = (d, r.read_at - prev_at) if ok else None
        return out
