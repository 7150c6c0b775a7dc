"""Idle baseline P_idle per device: learned from idle stretches, measured on demand, or configured.

docs/energy-measurement.md, "Idle baseline": P_idle is measured with the server up and the model loaded, no
running and no waiting requests, for >= 30 s, after a settle delay (clocks stay high after work ends);
refreshed in later idle stretches, persisted, with its age and temperature; a configured value overrides.

``IdleLearner`` is a pure state machine fed (t, idle, per-device joules of the interval ending at t): no clock,
no I/O, so tests drive it without time passing. ``BaselineBook`` holds the current baselines, applies the
configured overrides and persists ``<state_dir>/idle-baseline.json`` atomically (exporter.runtime.atomic: a kill -9
mid-write leaves the old file or the new one).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping

from exporter.runtime import atomic
from exporter.samples import SourceStatus

log = logging.getLogger("kvwatt.baseline")

STATE_FILE = "idle-baseline.json"
FORMAT_VERSION = 1
REFRESH_SECONDS = 600.0  # during one long idle stretch, re-commit the (longer) estimate this often
# a server that did not answer for up to this long leaves an idle stretch standing (those steps count for no
# device); its next answer's interval spans the gap, so work done meanwhile still ends the stretch. Longer: over.
UNKNOWN_HOLD_SECONDS = 10.0


@dataclass(frozen=True)
class IdleEstimate:
    """What the learner or the idle command measured for one device."""

    device: str
    watts: float
    duration_seconds: float
    temperature_celsius: float | None = None


@dataclass(frozen=True, kw_only=True)
class Baseline:
    device: str
    watts: float
    method: str  # learned | measured | configured
    measured_at: float | None = None  # wall clock (unix seconds); None when configured
    duration_seconds: float | None = None
    temperature_celsius: float | None = None

    def age_seconds(self, now_wall: float) -> float | None:
        return None if self.measured_at is None else max(now_wall - self.measured_at, 0.0)


@dataclass
class _Accum:
    joules: float = 0.0
    seconds: float = 0.0
    temp_sum: float = 0.0
    temp_n: int = 0
    emitted_seconds: float = 0.0  # seconds covered by the last estimate handed out

    def estimate(self, device: str) -> IdleEstimate:
        temp = self.temp_sum / self.temp_n if self.temp_n else None
        return IdleEstimate(device, self.joules / self.seconds, self.seconds, temp)


class IdleAccumulator:
    """THE P_idle arithmetic, shared by the daemon's learner, `kvwatt baseline idle` and the experiment's idle
    phase: per device, joules over the seconds between that device's OWN readings (DeviceReading.read_at,
    DeviceTracker.spans), so a slow read (NVML init, a stalled process) never counts seconds without their
    energy (energy-measurement.md rule 10). A step without a sample marks the device missing (rule 3): it gets
    no baseline rather than a wrong one."""

    def __init__(self) -> None:
        self.acc: dict[str, _Accum] = {}
        self.missing: set[str] = set()

    def add(self, device: str, span: tuple[float, float] | None, temperature: float | None = None) -> _Accum | None:
        if span is None:
            self.missing.add(device)
            return None
        a = self.acc.setdefault(device, _Accum())
        a.joules, a.seconds = a.joules + span[0], a.seconds + span[1]
        if temperature is not None:
            a.temp_sum, a.temp_n = a.temp_sum + temperature, a.temp_n + 1
        return a

    def estimates(self, min_seconds: float = 0.0) -> list[IdleEstimate]:
        return [a.estimate(d) for d, a in sorted(self.acc.items())
                if d not in self.missing and a.seconds > 0 and a.seconds >= min_seconds]


@dataclass
class IdleLearner:
    """busy -> settling (idle, waiting ``settle_seconds``) -> measuring (accumulating per device).

    ``feed(t, idle, joules)``: ``idle`` says whether the interval ending at ``t`` was idle (server up, no
    running or waiting requests, no tokens), None when that is unknown (the server did not answer at ``t``: the
    step counts for no device, and a stretch survives up to UNKNOWN_HOLD_SECONDS of them); ``joules`` maps device ->
    (joules, seconds between that device's own readings) from DeviceTracker.spans, or plain joules over the tick (None =
    no sample: that interval does not count for that device, rule 3). The arithmetic is IdleAccumulator's. Returns
    estimates to commit: when a device first reaches ``min_seconds`` of idle samples, every ``refresh_seconds`` after,
    and when the stretch ends.
    """

    settle_seconds: float = 30.0
    min_seconds: float = 30.0
    refresh_seconds: float = REFRESH_SECONDS
    state: str = "busy"
    idle_since: float | None = None
    prev_t: float | None = None
    unknown_since: float | None = None
    accum: IdleAccumulator = field(default_factory=IdleAccumulator)

    @property
    def acc(self) -> dict[str, _Accum]:
        return self.accum.acc

    def feed(self, t: float, idle: bool | None, joules: Mapping[str, float | None],
             temperatures: Mapping[str, float | None] | None = None) -> list[IdleEstimate]:
        prev_t, self.prev_t = self.prev_t, t
        if idle is None:  # the server did not answer: no sample, and the stretch holds for a short gap
            if self.unknown_since is None:
                self.unknown_since = prev_t if prev_t is not None else t
            return self._end() if self.state != "busy" and t - self.unknown_since > UNKNOWN_HOLD_SECONDS else []
        self.unknown_since = None
        if not idle or prev_t is None or t <= prev_t:
            return self._end() if not idle else []
        if self.state == "busy":
            self.state, self.idle_since = "settling", prev_t
        if self.state == "settling":
            if prev_t < self.idle_since + self.settle_seconds:
                return []  # clocks still high after work (settle delay)
            self.state = "measuring"
        return self._accumulate(t - prev_t, joules, temperatures or {})

    def _accumulate(self, seconds: float, joules: Mapping[str, float | tuple[float, float] | None],
                    temperatures: Mapping[str, float | None]) -> list[IdleEstimate]:
        out = []
        for device, j in joules.items():
            if j is None:
                continue  # no sample for this step: it does not count for this device (rule 3)
            span = j if isinstance(j, tuple) else (j, seconds)  # (joules, the device's own seconds)
            a = self.accum.add(device, span, temperatures.get(device))
            first = a.emitted_seconds == 0.0 and a.seconds >= self.min_seconds
            if first or (a.emitted_seconds and a.seconds - a.emitted_seconds >= self.refresh_seconds):
                a.emitted_seconds = a.seconds
                out.append(a.estimate(device))
        return out

    def _end(self) -> list[IdleEstimate]:
        """The stretch ended: hand out what grew since the last estimate, then start over."""
        out = [a.estimate(d) for d, a in self.accum.acc.items()
               if a.seconds >= self.min_seconds and a.seconds > a.emitted_seconds]
        self.state, self.idle_since, self.unknown_since, self.accum = "busy", None, None, IdleAccumulator()
        return out


def override_keys(device: str, labels: Mapping[str, str]) -> list[str]:
    """Keys a configured idle_power_watts entry may use for a device: its id, 'gpu:<index>', or the UUID."""
    keys = [device]
    if "uuid" in labels:
        keys += [f"gpu:{labels.get('gpu', '')}", labels["uuid"]]
    return keys


class BaselineBook:
    """The baselines in force: configured overrides first, then the newest learned/measured value.

    Persistence never stops the daemon: a state file that cannot be read, entries that fail validation
    (``parse_entry``) and a write that fails are each logged once and reported by ``status()``
    (kvwatt_source_info{source="state_dir"}); the baselines in memory keep working. ``read_only_reason``
    (exporter.runtime.statedir: directory not writable, or locked by another daemon) turns writing off."""

    def __init__(self, state_dir: str | None, overrides: Mapping[str, float] | None = None,
                 wall_clock: Callable[[], float] = time.time, read_only_reason: str = "") -> None:
        self.path = os.path.join(state_dir, STATE_FILE) if state_dir else None
        self.overrides = dict(overrides or {})
        self.wall_clock = wall_clock
        self.read_only_reason = read_only_reason
        self._stored: dict[str, Baseline] = {}
        self._file_sig: tuple | None = None
        self.load_error = ""  # the last read's problem ('' = none)
        self.write_error = ""  # the last write's problem ('' = none)

    # --- lookups ----------------------------------------------------------------------------------------
    def get(self, device: str, labels: Mapping[str, str] | None = None) -> Baseline | None:
        for key in override_keys(device, labels or {}):
            if key in self.overrides:
                return Baseline(device=device, watts=self.overrides[key], method="configured")
        return self._stored.get(device)

    def watts(self, device: str, labels: Mapping[str, str] | None = None) -> float | None:
        b = self.get(device, labels)
        return None if b is None else b.watts

    def stored(self) -> dict[str, Baseline]:
        return dict(self._stored)

    def status(self) -> SourceStatus | None:
        """Health of the persistence: degraded with the reasons while the baselines are not persisted or the
        file had to be (partly) ignored; None without a state directory. Not a timed read: no duration."""
        if not self.path:
            return None
        problems = [p for p in (self.read_only_reason, self.write_error, self.load_error) if p]
        return SourceStatus(source="state_dir", server="", up=True, reason="; ".join(problems), duration_seconds=None,
                            state="degraded" if problems else "ok")

    # --- persistence ------------------------------------------------------------------------------------
    def load(self) -> None:
        """Read the state file; a missing file is an empty book, an unreadable one is logged, not fatal."""
        self._stored = self._read_file()  # sets load_error
        self._file_sig = self._signature()

    def _signature(self) -> tuple | None:
        try:
            st = os.stat(self.path) if self.path else None
        except OSError:
            return None
        return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)

    def refresh_if_changed(self) -> bool:
        """Reload when another process (``kvwatt baseline idle``) replaced the file. One stat() per call.
        Baselines this book could not persist (read-only, failed write) are kept where newer than the file's."""
        if self.path and self._signature() != self._file_sig:
            unpersisted = self._stored if self.read_only_reason or self.write_error else {}
            self.load()
            self._stored = _merge_newer(self._stored, unpersisted.values())
            return True
        return False

    def _read_file(self) -> dict[str, Baseline]:
        """The file's valid entries. A bad entry is dropped, a bad file ignored; either is logged once."""
        if not self.path:
            return {}
        good, problem = atomic.read_state_json(self.path, parse_file, self.wall_clock())
        self._note_load_error(problem)
        return good or {}

    def _note_load_error(self, error: str) -> None:
        if error and error != self.load_error:
            log.warning("idle baseline: %s", error)
        self.load_error = error

    def record(self, estimates: Iterable[IdleEstimate], method: str) -> list[Baseline]:
        """Stamp estimates with the wall clock, keep them, persist atomically (merged with the file's newer
        entries, so a concurrent ``kvwatt baseline idle`` is not overwritten). A failed write is a reason
        (``write_error``), not an exception: the baselines stay in force in memory."""
        now = self.wall_clock()
        new = [Baseline(device=e.device, watts=e.watts, method=method, measured_at=now,
                        duration_seconds=e.duration_seconds, temperature_celsius=e.temperature_celsius)
               for e in estimates]
        if not new:
            return []
        merged = _merge_newer(self._read_file() if self.path else {}, self._stored.values())
        for b in new:
            merged[b.device] = b
        self._stored = merged
        if self.path and not self.read_only_reason:
            self._write(merged)
        return new

    def _write(self, baselines: Mapping[str, Baseline]) -> None:
        body = {"version": FORMAT_VERSION, "devices": {
            d: {k: v for k, v in asdict(b).items() if k != "device"} for d, b in sorted(baselines.items())}}
        self.write_error = atomic.persist_json(self.path, body, "idle baseline", self.write_error, log)
        if self.write_error:
            return
        self._file_sig = self._signature()
        self.load_error = ""  # the file is now what was just written: only valid entries


def _merge_newer(base: Mapping[str, Baseline], others: Iterable[Baseline]) -> dict[str, Baseline]:
    """``base`` with each of ``others`` that it lacks or holds an older measurement of."""
    out = dict(base)
    for b in others:
        if b.device not in out or (b.measured_at or 0) > (out[b.device].measured_at or 0):
            out[b.device] = b
    return out


MAX_IDLE_WATTS = 10_000.0  # no GPU board or RAPL zone idles near 10 kW: a larger value is a corrupt entry
FUTURE_SLACK_SECONDS = 86_400.0  # measured_at later than a day ahead: a broken clock, the age would read 0
STORED_METHODS = ("learned", "measured")  # "configured" values live in the configuration, never in the file


def parse_file(data: Any, now_wall: float) -> tuple[dict[str, Baseline], list[str]]:
    """The state file's JSON -> (valid baselines, 'device: why' per dropped entry). ValueError when the file
    as a whole is not a state file (not an object, another version, devices not a mapping)."""
    devices = atomic.versioned_mapping(data, FORMAT_VERSION, "devices")
    good: dict[str, Baseline] = {}
    bad: list[str] = []
    for device, entry in devices.items():
        try:
            good[device] = parse_entry(device, entry, now_wall)
        except ValueError as e:
            bad.append(f"{device}: {e}")
    return good, bad


def parse_entry(device: str, entry: Any, now_wall: float) -> Baseline:
    """One stored baseline with every field checked (type, finite, physical range); ValueError naming the
    field otherwise. Unknown keys are ignored (a newer kvwatt may add some)."""
    if not device or not isinstance(entry, dict):
        raise ValueError("not a device entry")
    missing = [k for k in ("watts", "method", "measured_at") if k not in entry]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing")
    if entry["method"] not in STORED_METHODS:
        raise ValueError(f"method {entry['method']!r} is not one of {', '.join(STORED_METHODS)}")
    return Baseline(
        device=device, watts=bounded_number(entry["watts"], "watts", 0.0, MAX_IDLE_WATTS), method=entry["method"],
        measured_at=bounded_number(entry["measured_at"], "measured_at", 0.0, now_wall + FUTURE_SLACK_SECONDS),
        duration_seconds=_optional(entry.get("duration_seconds"), "duration_seconds", 0.0, math.inf),
        temperature_celsius=_optional(entry.get("temperature_celsius"), "temperature_celsius", -273.15, math.inf))


def entry_at(entry: Any, required: tuple[str, ...], now_wall: float,
             future_slack: float = FUTURE_SLACK_SECONDS) -> float:
    """A stored entry of the model's state files checked for its shape: a mapping with every ``required`` key
    (``at`` among them); its ``at`` wall time, not after now + ``future_slack``. ValueError naming what is
    wrong."""
    if not isinstance(entry, dict):
        raise ValueError("not an entry")
    missing = [k for k in required if k not in entry]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing")
    return bounded_number(entry["at"], "at", 0.0, now_wall + future_slack)


def bounded_number(value: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} {value!r} is not a finite number")
    try:
        x = float(value)
    except OverflowError:  # a JSON integer beyond float range (10**400)
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"{name} {str(value)[:20]!s} is not a finite number")
    if not lo <= x <= hi:
        raise ValueError(f"{name} {value!r} is outside [{lo:g}, {hi:g}]")
    return x


def _optional(value: Any, name: str, lo: float, hi: float) -> float | None:
    return None if value is None else bounded_number(value, name, lo, hi)
