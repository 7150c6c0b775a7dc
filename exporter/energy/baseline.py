"""Idle baseline P_idle per device: learned from idle stretches, measured on demand, or configured.

docs/energy-measurement.md, "Idle baseline": P_idle is measured with the server up and the model loaded, no
running and no waiting requests, for >= 30 s, after a settle delay (clocks stay high after work ends);
refreshed in later idle stretches, persisted, with its age and temperature; a configured value overrides.

``IdleLearner`` is a pure state machine fed (t, idle, per-device joules of the interval ending at t): no clock,
no I/O, so tests drive it without time passing. ``BaselineBook`` holds the current baselines, applies the
configured overrides and persists ``<state_dir>/idle-baseline.json`` atomically (exporter.atomic: a kill -9
mid-write leaves the old file or the new one).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Mapping

from exporter import atomic

log = logging.getLogger("kvwatt.baseline")

STATE_FILE = "idle-baseline.json"
FORMAT_VERSION = 1
REFRESH_SECONDS = 600.0  # during one long idle stretch, re-commit the (longer) estimate this often


@dataclass(frozen=True)
class IdleEstimate:
    """What the learner or the idle command measured for one device."""

    device: str
    watts: float
    duration_seconds: float
    temperature_celsius: float | None = None


@dataclass(frozen=True)
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
    running or waiting requests, no tokens); ``joules`` maps device -> (joules, seconds between that device's
    own readings) from DeviceTracker.spans, or plain joules over the tick (None = no sample: that interval
    does not count for that device, rule 3). The arithmetic is IdleAccumulator's. Returns estimates to commit: when a
    device first reaches ``min_seconds`` of idle samples, every ``refresh_seconds`` after, and when the
    stretch ends.
    """

    settle_seconds: float = 30.0
    min_seconds: float = 30.0
    refresh_seconds: float = REFRESH_SECONDS
    state: str = "busy"
    idle_since: float | None = None
    prev_t: float | None = None
    accum: IdleAccumulator = field(default_factory=IdleAccumulator)

    @property
    def acc(self) -> dict[str, _Accum]:
        return self.accum.acc

    def feed(self, t: float, idle: bool, joules: Mapping[str, float | None],
             temperatures: Mapping[str, float | None] | None = None) -> list[IdleEstimate]:
        prev_t, self.prev_t = self.prev_t, t
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
        self.state, self.idle_since, self.accum = "busy", None, IdleAccumulator()
        return out


def override_keys(device: str, labels: Mapping[str, str]) -> list[str]:
    """Keys a configured idle_power_watts entry may use for a device: its id, 'gpu:<index>', or the UUID."""
    keys = [device]
    if "uuid" in labels:
        keys += [f"gpu:{labels.get('gpu', '')}", labels["uuid"]]
    return keys


class BaselineBook:
    """The baselines in force: configured overrides first, then the newest learned/measured value."""

    def __init__(self, state_dir: str | None, overrides: Mapping[str, float] | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.path = os.path.join(state_dir, STATE_FILE) if state_dir else None
        self.overrides = dict(overrides or {})
        self.wall_clock = wall_clock
        self._stored: dict[str, Baseline] = {}
        self._file_sig: tuple | None = None
        self.load_error = ""

    # --- lookups ----------------------------------------------------------------------------------------
    def get(self, device: str, labels: Mapping[str, str] | None = None) -> Baseline | None:
        for key in override_keys(device, labels or {}):
            if key in self.overrides:
                return Baseline(device, self.overrides[key], "configured")
        return self._stored.get(device)

    def watts(self, device: str, labels: Mapping[str, str] | None = None) -> float | None:
        b = self.get(device, labels)
        return None if b is None else b.watts

    def stored(self) -> dict[str, Baseline]:
        return dict(self._stored)

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
        """Reload when another process (``kvwatt baseline idle``) replaced the file. One stat() per call."""
        if self.path and self._signature() != self._file_sig:
            self.load()
            return True
        return False

    def _read_file(self) -> dict[str, Baseline]:
        self.load_error = ""
        if not self.path:
            return {}
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"unknown version {data.get('version')!r}")
            return {dev: Baseline(device=dev, **{k: v[k] for k in
                    ("watts", "method", "measured_at", "duration_seconds", "temperature_celsius")})
                    for dev, v in data.get("devices", {}).items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            self.load_error = f"{self.path}: ignored ({e})"
            log.warning("idle baseline: %s", self.load_error)
            return {}

    def record(self, estimates: Iterable[IdleEstimate], method: str) -> list[Baseline]:
        """Stamp estimates with the wall clock, keep them, persist atomically (merged with the file's newer
        entries, so a concurrent ``kvwatt baseline idle`` is not overwritten)."""
        now = self.wall_clock()
        new = [Baseline(e.device, e.watts, method, now, e.duration_seconds, e.temperature_celsius)
               for e in estimates]
        if not new:
            return []
        merged = self._read_file() if self.path else {}
        for dev, b in self._stored.items():
            if dev not in merged or (b.measured_at or 0) > (merged[dev].measured_at or 0):
                merged[dev] = b
        for b in new:
            merged[b.device] = b
        self._stored = merged
        if self.path:
            atomic.write_json(self.path, {"version": FORMAT_VERSION, "devices": {
                d: {k: v for k, v in asdict(b).items() if k != "device"} for d, b in sorted(merged.items())}})
            self._file_sig = self._signature()
        return new
