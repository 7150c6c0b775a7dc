"""Whose counters a reading holds: the process identity behind a server's URL, and the steps no delta may
cross (docs/architecture.md "Data-parallel engines and value ranges").

The identity of a reading is (process_start_time_seconds, engine adapter, model name). Two processes behind one
URL (a Kubernetes Service in front of two replicas, an upstream alternating vLLM and SGLang) give readings of
alternating identity; taking a step between them as a restart counts the other process's whole counter as that
step's increase (242,000,000 tokens/s against 300). So:

- a changed identity is a restart only when nothing but the start time changed, the start moved forward, the
  new process started after the previous reading and not after the reading that shows it (when the readings'
  wall times are known, ``EngineReading.read_wall``, with ``CLOCK_SLACK_SECONDS`` for the two hosts' clocks),
  and some engine's counters went down (a new process counts from zero). Then a counter that went down counts
  its value as its increase; one that did not counts its rise (store/deltas.py). Any other change (engine,
  model, a start time going back, a process already running at the previous reading) is a switch: no delta
  for that step (unknown, never the other process's total);
- a start time that moves forward while every counter keeps climbing, or that lies after the read that saw it
  (an engine host's clock ahead, a start time re-derived at each scrape: 1 s later at every read), is the same
  process: ordinary deltas, the process start kvwatt holds for it (``process_start``, an evidence epoch fact)
  unchanged, one line when it starts and one when it settles, never a line per read;
- without an identity change, an engine whose counters went down and then came back to (about) where they
  were before the dip is another process's counters coming back: no delta for that engine on that step;
- without an identity change, an engine whose counters jumped up and then fell back to (about) where they were
  before the jump is another process's counters seen for a moment (two replicas with the same start time):
  the step that went up to the other level is voided after the fact (``Step.void_back``), since the counters
  could not tell it from a burst when it came;
- ``FLAP_EVENTS`` such switches or returns within the last ``RECENT_READINGS`` readings are the ``flapping``
  condition: the server is degraded (reason ``identity_flapping``, which says to point kvwatt at each replica)
  until ``RECENT_READINGS`` readings pass without one. It is logged when it starts and when it ends, once each.

What moves one counter alone is not another process (SpellingWatch, RegressionWatch below, run by
ServerHistory before the identity): a counter read from its other spelling (vLLM's offload counters), and one
counter going backwards while the engine's other counters climb. Each is its own condition when it recurs
(``spelling_switching``, ``counter_regression``: Recurring).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from exporter.samples import EngineReading
from exporter.store.deltas import reset_engines

log = logging.getLogger("kvwatt.store")

RECENT_READINGS = 8  # readings an identity (or a counter level) is remembered for, and a flap counts for
FLAP_EVENTS = 2  # switches or returns within RECENT_READINGS that make the server "flapping"
JUMP_RATIO = 8.0  # a jump this many times the climb around it is another process's level, not a burst
CLOCK_SLACK_SECONDS = 5.0  # a restarted process may seem to start this much before the previous read (skew)
START_TOLERANCE_SECONDS = 1e-3  # process_start_time_seconds printed with rounding
REASON_CODE = "identity_flapping"


@dataclass(frozen=True)
class Identity:
    start: float | None  # process_start_time_seconds; None when the exposition has none
    engine: str
    model: str

    def same_process(self, other: "Identity") -> bool:
        same_start = self.start is None or other.start is None or \
            abs(self.start - other.start) <= START_TOLERANCE_SECONDS
        same_model = not self.model or not other.model or self.model == other.model  # "": not said this read
        return same_start and same_model and self.engine == other.engine


def identity_of(reading: EngineReading) -> Identity:
    """The engine adapter without its add-ons ("vllm+lmcache" -> "vllm"): a sidecar missing a read is not
    another process."""
    engine = reading.engine.split("+", 1)[0]
    return Identity(reading.info.process_start_time_seconds, engine, reading.info.model_name)


@dataclass(frozen=True)
class Step:
    """What ServerHistory does with one reading: ``restarted`` (every value is its increase), and ``prev``:
    the previous counters deltas are taken from (engines left out of it get no delta this step)."""

    restarted: bool
    prev: dict[str, dict[str, float]]
    events: tuple[str, ...] = ()  # switches / returns seen at this step (for the log and the reason)
    void_back: int = 0  # > 0: the step of that many readings ago counted another process's counters: void it


@dataclass
class IdentityWatch:
    name: str = ""  # the server's, for the log
    last: Identity | None = None
    last_wall: float | None = None
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_READINGS))  # identities, newest last
    levels: dict[str, deque] = field(default_factory=dict)  # engine -> its recent counter sums
    flaps: deque = field(default_factory=lambda: deque(maxlen=RECENT_READINGS))  # per reading: its events
    problem: str = ""  # "identity_flapping: ..." while flapping, else ""
    process_start: float | None = None  # the start of the process whose counters are counted (epoch fact)
    start_moves: deque = field(default_factory=lambda: deque(maxlen=RECENT_READINGS))  # per reading: start moved?
    start_unsteady: bool = False  # logged once while the start time moves without a restart

    def observe(self, reading: EngineReading, counters: dict[str, dict[str, float]],
                prev: dict[str, dict[str, float]]) -> Step:
        ident = identity_of(reading)
        restarted, events, prev_used, void_back = False, [], prev, 0
        changed = self.last is not None and not ident.same_process(self.last)
        moved = changed and self._start_moved_only(ident, reading.read_wall, counters, prev)
        if self.last is None:
            self.process_start = ident.start
        elif changed and not moved:
            if self._is_restart(ident):
                restarted = True
            else:
                events.append(self._switch_words(ident))
                prev_used = {}
            self.process_start = ident.start
            self.levels.clear()  # another process: its counter levels are not comparable
        else:  # the same process (a start time that moved without a restart included)
            if self.process_start is None:
                self.process_start = ident.start  # the first reading that says it
            back = self._returned_engines(counters)
            fell, void_back = self._fell_back_engines(counters)
            if back:
                events.append(f"counters of engine(s) {back} went down and came back")
            if fell:
                events.append(f"counters of engine(s) {fell} jumped up and fell back: the step up "
                              f"({void_back} reading(s) ago) counted another process's counters, voided")
            if back or fell:
                prev_used = {e: c for e, c in prev.items() if e not in back and e not in fell}
        self._remember(ident, reading.read_wall, counters, events, moved)
        self._note_start_move(moved, ident)
        return Step(restarted, prev_used, tuple(events), void_back)

    def _start_moved_only(self, ident: Identity, wall: float | None, counters: dict[str, dict[str, float]],
                          prev: dict[str, dict[str, float]]) -> bool:
        """A start time that moved forward with nothing else changed, where the move cannot be a new process:
        the start lies after the read that saw it (a process cannot start after it was read), or no engine's
        counters went down (a new process counts from zero; one already past the old counters at its first
        read is not one that started after the previous read)."""
        last = self.last
        if ident.engine != last.engine or ident.start is None or last.start is None or \
                (ident.model and last.model and ident.model != last.model) or ident.start < last.start:
            return False
        if self.last_wall is not None and ident.start < self.last_wall - CLOCK_SLACK_SECONDS:
            return False  # a process already running at the previous read: a switch (or a rolling update)
        if wall is not None and ident.start > wall + CLOCK_SLACK_SECONDS:
            return True
        shared = any(k in prev.get(e, {}) for e, c in counters.items() for k in c)
        return shared and not reset_engines(prev, counters)

    def _note_start_move(self, moved: bool, ident: Identity) -> None:
        """One line when the start time starts moving without a restart, one when it has held still for
        RECENT_READINGS readings (a start re-derived at every scrape moves at every read)."""
        self.start_moves.append(moved)
        if moved and not self.start_unsteady:
            self.start_unsteady = True
            log.warning("%s: process_start_time_seconds moved forward to %.0f without the counters going down (or "
                        "after the read that saw it): the same process (an engine clock ahead, a start time "
                        "re-derived at each scrape); counted as before, not as a restart", self.name, ident.start)
        elif self.start_unsteady and len(self.start_moves) == RECENT_READINGS and not any(self.start_moves):
            self.start_unsteady = False
            log.info("%s: process_start_time_seconds steady again for %d readings", self.name, RECENT_READINGS)

    def _is_restart(self, ident: Identity) -> bool:
        last = self.last
        if ident.engine != last.engine or ident.start is None or last.start is None or \
                (ident.model and last.model and ident.model != last.model):
            return False
        if ident.start < last.start or any(ident.same_process(i) for i in self.recent):
            return False  # back in time, or a process seen a moment ago: not a new one
        return self.last_wall is None or ident.start >= self.last_wall - CLOCK_SLACK_SECONDS

    def _switch_words(self, ident: Identity) -> str:
        last, parts = self.last, []
        if ident.engine != last.engine:
            parts.append(f"engine {last.engine} -> {ident.engine}")
        if ident.model and last.model and ident.model != last.model:
            parts.append(f"model {last.model!r} -> {ident.model!r}")
        if ident.start is not None and last.start is not None and abs(ident.start - last.start) > 1e-3:
            parts.append(f"process start {last.start:.0f} -> {ident.start:.0f}")
        return "process identity changed (" + ", ".join(parts or ["start time"]) + ")"

    def _returned_engines(self, counters: dict[str, dict[str, float]]) -> list[str]:
        """Engines whose counter sum is back at (or just above) a level it had before a dip since: the sum
        rose from the dip past that level by less than half the dip (a genuine reset climbing back grows
        from zero, it does not jump over its old level in one step)."""
        back = []
        for engine, c in counters.items():
            seen = self.levels.get(engine)
            if not seen or len(seen) < 2:
                continue
            now, before = sum(c.values()), seen[-1]
            high = max(list(seen)[:-1])
            if before < high <= now and now - high < (high - before) / 2:
                back.append(engine)
        return sorted(back)

    def _fell_back_engines(self, counters: dict[str, dict[str, float]]) -> tuple[list[str], int]:
        """Engines whose counter sum fell back to (about) a level it had just before one jump since (a jump
        more than JUMP_RATIO times both the climb after it and any other step's rise: no burst looks like
        that), and how many readings ago the jump was (the step to void; the most recent one if several)."""
        fell, void_back = [], 0
        for engine, c in counters.items():
            seen = list(self.levels.get(engine) or ())
            now = sum(c.values())
            if len(seen) < 2 or now >= seen[-1]:
                continue
            j = max((i for i in range(len(seen) - 1) if seen[i] <= now), default=None)
            if j is None or seen[j] <= 0 or any(v <= now for v in seen[j + 1:]):
                continue  # back to zero is a reset of a process that had just started counting, not another
            jump = seen[j + 1] - seen[j]
            rises = [b - a for a, b in zip(seen, seen[1:]) if b > a]
            rises.remove(jump)
            if jump > JUMP_RATIO * max([now - seen[j], *rises]):
                fell.append(engine)
                back = len(seen) - (j + 1)
                void_back = back if not void_back else min(void_back, back)
        return sorted(fell), void_back

    def _remember(self, ident: Identity, wall: float | None, counters: dict[str, dict[str, float]],
                  events: list[str], moved: bool = False) -> None:
        if self.last is not None and not ident.same_process(self.last) and not moved:
            self.recent.append(self.last)
        self.last, self.last_wall = ident, wall
        for engine in [e for e in self.levels if e not in counters]:
            del self.levels[engine]  # bounded by the engines of one reading (an engine label may change each read)
        for engine, c in counters.items():
            self.levels.setdefault(engine, deque(maxlen=RECENT_READINGS)).append(sum(c.values()))
        self.flaps.append(tuple(events))
        self._update_problem()

    def _update_problem(self) -> None:
        events = [e for step in self.flaps for e in step]
        if self.flaps[-1] and len(events) < FLAP_EVENTS:  # one change alone: a line of its own
            log.info("%s: %s: no counter delta for this step", self.name, self.flaps[-1][0])
        if len(events) >= FLAP_EVENTS and not self.problem:
            self.problem = (f"{REASON_CODE}: readings of more than one process behind one URL ({events[-1]}); "
                            "no counter delta across a change: point kvwatt at each replica's own URL")
            log.warning("%s: %s", self.name, self.problem)
        elif not events and self.problem:
            self.problem = ""
            log.info("%s: one process identity again for %d readings: counters are counted again",
                     self.name, RECENT_READINGS)


CHURN_CHANGES = 3  # engine-set changes within RECENT_READINGS that make the per-change log lines one line


class EngineSetWatch:
    """Whether the set of data-parallel engines (the ``engine`` label) changes at nearly every read (an
    upstream putting an id in it): then the per-change lines (vanished, appeared, went down) would be two or
    three lines per tick; one line says it when it starts and one when the set has been stable for
    RECENT_READINGS readings."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.last: frozenset[str] | None = None
        self.changes: deque = deque(maxlen=RECENT_READINGS)
        self.churning = False

    def observe(self, engines) -> bool:
        """Note this reading's engine set; True while the per-change lines should stay quiet."""
        now = frozenset(engines)
        self.changes.append(self.last is not None and now != self.last)
        self.last = now
        n = sum(self.changes)
        if n >= CHURN_CHANGES and not self.churning:
            self.churning = True
            log.warning("%s: the engine label changes at nearly every read (%d of the last %d): each new engine "
                        "re-bases (no delta for it on that step); not logged per change until it settles",
                        self.name, n, len(self.changes))
        elif n == 0 and self.churning:
            self.churning = False
            log.info("%s: the engine label is stable again", self.name)
        return self.churning


@dataclass
class Recurring:
    """A per-reading event that is a condition of the server once it recurs: a lone event is one log line;
    events at FLAP_EVENTS readings within RECENT_READINGS set ``problem`` (the source's reason, ``code`` first;
    one warning), which clears, with one line, after RECENT_READINGS readings without one."""

    name: str  # the server's, for the log
    code: str  # a samples.REASON_CODES word
    words: str  # what the recurring condition is and what it costs
    events: deque = field(default_factory=lambda: deque(maxlen=RECENT_READINGS))  # per reading: its events
    problem: str = ""

    def note(self, events: list[str]) -> None:
        self.events.append(tuple(events))
        recent = [step for step in self.events if step]  # the readings with an event
        if events and not self.problem and len(recent) < FLAP_EVENTS:
            log.info("%s: %s", self.name, "; ".join(events))
        if len(recent) >= FLAP_EVENTS and not self.problem:
            self.problem = f"{self.code}: {self.words} ({'; '.join(recent[-1])})"
            log.warning("%s: %s", self.name, self.problem)
        elif not recent and self.problem:
            self.problem = ""
            log.info("%s: no %s for %d readings", self.name, self.code.replace("_", " "), RECENT_READINGS)


class SpellingWatch:
    """The series each counter with two spellings was read from (EngineReading.spellings: vLLM's offload
    counters, flat 0.24+ or the deprecated kv_offload_total_bytes{transfer_type}). The two are separate series
    whose values need not agree, so a counter whose spelling changed since it was last read gets no delta on
    that step (first sight again), whichever way it moved: the engine switched spelling, not process."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.last: dict[str, str] = {}  # key -> the series it was last read from
        self.seen: dict[str, set[str]] = {}  # key -> every series it was read from
        self.recurring = Recurring(name, "spelling_switching",
                                   "the engine alternates between vLLM's two spellings of the offload counters "
                                   "(the flat vllm:kv_offload_*_bytes series and the deprecated "
                                   "vllm:kv_offload_total_bytes{transfer_type}); no delta is taken across a "
                                   "switch, so the offload traffic figures miss those steps; the same process "
                                   "throughout")

    @property
    def problem(self) -> str:
        return self.recurring.problem

    def observe(self, spellings: dict[str, str]) -> set[str]:
        """The keys whose spelling changed since they were last read. Only a return to a spelling a key was
        read from before counts towards the condition: vLLM 0.32 exports the deprecated series at 0 from
        start-up and each flat one from its first transfer on (the store's and the load's a few reads apart on
        a real engine), a switch each key makes once, said in one line each."""
        switched = {k for k, s in spellings.items() if self.last.get(k, s) != s}
        returned = {k for k in switched if spellings[k] in self.seen.get(k, ())}

        def words(keys):
            which = ", ".join(f"{k} ({self.last[k]} -> {spellings[k]})" for k in sorted(keys))
            return f"the engine switched the spelling of {which}: separate series, no delta across the switch"
        if switched - returned and not self.recurring.problem:
            log.info("%s: %s", self.name, words(switched - returned))
        events = [words(returned)] if returned else []
        for k, s in spellings.items():
            self.seen.setdefault(k, set()).add(s)
        self.last.update(spellings)
        self.recurring.note(events)
        return switched


class RegressionWatch:
    """A counter that goes backwards alone, while its engine's other counters climb (one key down, at least
    one other up): a reset or regression of that counter (an estimate recomputed, a glitch of one series),
    not another process; another process moves every counter. The counter gets no delta on the step it went
    down; its level before the drop (the high-water mark) is held for RECENT_READINGS readings: while held,
    the identity's levels and restart tests see the held value (no dip, so no "went down and came back"), and
    a counter back at or above it counts only its rise past it (never the refill of the drop)."""

    def __init__(self, name: str = "") -> None:
        self.held: dict[tuple[str, str], list] = {}  # (engine, key) -> [high-water value, readings left]
        self.recurring = Recurring(name, "counter_regression",
                                   "a counter keeps going backwards while the engine's other counters climb (a "
                                   "reset or regression of that counter alone, not another process); no delta "
                                   "for it across a drop")

    @property
    def problem(self) -> str:
        return self.recurring.problem

    def clear(self) -> None:
        self.held.clear()

    def observe(self, prev: dict[str, dict[str, float]], counters: dict[str, dict[str, float]]
                ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """(the counters with held values, for the identity; ``prev`` with high-water marks where a held counter
        came back, for the deltas)."""
        events = []
        for engine, c in counters.items():
            before = prev.get(engine, {})
            shared = [k for k in c if k in before]
            down = [k for k in shared if c[k] < before[k]]
            if len(down) == 1 and any(c[k] > before[k] for k in shared):
                key = down[0]
                mark = max(before[key], self.held.get((engine, key), [0.0])[0])
                self.held[(engine, key)] = [mark, RECENT_READINGS]
                events.append(f"counter {key} of engine {engine!r} went backwards ({before[key]:.6g} -> "
                              f"{c[key]:.6g}) while the engine's other counters climbed: a reset or regression of "
                              "that counter, not another process; no delta for it on this step")
        held = {e: dict(c) for e, c in counters.items()}
        prev_used = {e: dict(c) for e, c in prev.items()}
        for (engine, key), state in list(self.held.items()):
            mark, value = state[0], counters.get(engine, {}).get(key)
            state[1] -= 1
            if value is None or state[1] <= 0:
                del self.held[(engine, key)]
                continue
            if value >= mark:  # back at its level: its rise past the mark is the increase
                if key in prev_used.get(engine, {}):
                    prev_used[engine][key] = max(prev_used[engine][key], mark)
                del self.held[(engine, key)]
            else:
                held[engine][key] = mark
        self.recurring.note(events)
        return held, prev_used
