"""Host energy from the Linux powercap (RAPL) tree: package and dram zones, wrap-corrected.

Rules applied (../shared/docs/energy-measurement.md, copied to docs/energy-measurement.md):
- rule 7: only ``package-N`` / ``package-N-die-M`` zones and their ``dram`` subzone; never core/uncore (inside
  package), top-level psys (contains package) or ``intel-rapl-mmio:*`` (duplicates package). Zones are found
  by their ``name`` file, never by directory number (suffixes are hexadecimal and need not follow sockets).
- rule 4: ``delta = cur - prev`` if ``cur >= prev`` else ``cur + (max_energy_range_uj - prev)``; a delta that
  cannot be told apart from one with more wraps, or implies implausible power, is dropped and re-based.
- rules 3 and 8: an unreadable ``energy_uj`` (root-only since CVE-2020-8694, masked in containers) gives a
  reason (permission, masked, absent), and a reading with ``joules_total=None``, never 0 J.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from exporter.samples import DeviceReading, SourceStatus

log = logging.getLogger("kvwatt.rapl")
DEFAULT_ROOT = "/sys/class/powercap"
# No CPU socket or its DRAM draws 1 kW today; a delta implying more is a glitch (Scaphandre once showed 53 kW).
MAX_PLAUSIBLE_WATTS = 1000.0
RESCAN_SECONDS = 30.0

_PACKAGE_RE = re.compile(r"^package-\d+(-die-\d+)?$")
_ZONE_DIR_RE = re.compile(r"^intel-rapl(:[0-9a-fA-F]+)+$")


class _Unreadable(Exception):
    """energy_uj could not be read; ``kind`` is permission | masked | absent | unreadable."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass
class _Zone:
    zone: str  # "package-0"
    domain: str  # "package" | "dram"
    energy_path: str
    max_range_uj: int
    prev_uj: int | None = None
    prev_t: float | None = None
    total_joules: float = 0.0
    broken: bool = True  # the next step has no valid predecessor (first read, or after a failed read)

    @property
    def device(self) -> str:
        return f"rapl:{self.zone}:{self.domain}"


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("ascii", "replace").strip()


def _read_energy_uj(path: str) -> int:
    """One sysfs read. Raises _Unreadable with the reason; never returns a made-up value."""
    try:
        text = _read_text(path)
    except PermissionError:
        raise _Unreadable("permission", "energy_uj is root-only since CVE-2020-8694, see docs/energy.md") from None
    except FileNotFoundError:
        raise _Unreadable("absent", "energy_uj missing") from None
    except OSError as e:
        raise _Unreadable("unreadable", e.strerror or errno.errorcode.get(e.errno, str(e))) from None
    if not text:
        # /dev/null bind-mounted over the file, as container runtimes mask paths
        raise _Unreadable("masked", "energy_uj reads empty (masked by the container runtime?)")
    try:
        return int(text)
    except ValueError:
        raise _Unreadable("unreadable", f"energy_uj not a number: {text[:20]!r}") from None


def _zone_dirs(root: str) -> list[str]:
    """Real paths of every intel-rapl zone directory under root (class symlinks and nested subzones),
    each once. intel-rapl-mmio is skipped (rule 7: duplicates package)."""
    seen: dict[str, None] = {}

    def walk(directory: str, depth: int) -> None:
        try:
            entries = sorted(os.listdir(directory))
        except OSError:
            return
        for entry in entries:
            path = os.path.join(directory, entry)
            if entry == "intel-rapl" and depth == 0 and os.path.isdir(path):
                walk(path, depth + 1)  # a root at /sys/devices/virtual/powercap holds the control type
            elif _ZONE_DIR_RE.match(entry) and os.path.isdir(path):
                real = os.path.realpath(path)
                if real not in seen:
                    seen[real] = None
                    if depth < 4:
                        walk(real, depth + 1)

    walk(root, 0)
    return list(seen)


def _zone_name(directory: str) -> str | None:
    try:
        return _read_text(os.path.join(directory, "name"))
    except OSError:
        return None


def discover(root: str) -> tuple[list[_Zone], str]:
    """The package and dram zones under root, and a reason when there are none ('' when some were found)."""
    if not os.path.isdir(root):
        return [], f"absent: {root} not found (no RAPL, or not mounted in this container)"
    zones: list[_Zone] = []
    dirs = _zone_dirs(root)
    for d in dirs:
        name = _zone_name(d)
        if name is None:
            continue
        if _PACKAGE_RE.match(name):
            zone, domain = name, "package"
        elif name == "dram":
            parent = _zone_name(os.path.dirname(d)) or ""
            if not _PACKAGE_RE.match(parent):
                continue  # a dram zone outside a package: not a layout the kernel makes
            zone, domain = parent, "dram"
        else:
            continue  # core, uncore, psys (rule 7)
        try:
            max_uj = int(_read_text(os.path.join(d, "max_energy_range_uj")))
        except (OSError, ValueError):
            max_uj = 0  # unknown range: any decrease is then treated as a reset (dropped)
        zones.append(_Zone(zone, domain, os.path.join(d, "energy_uj"), max_uj))
    zones.sort(key=lambda z: (z.zone, z.domain != "package", z.domain))
    unique = {z.device: z for z in reversed(zones)}  # one per (zone, domain), first directory wins
    zones = [z for z in zones if unique[z.device] is z]
    if zones:
        return zones, ""
    if _dangling(root):
        return [], f"masked: {root} entries point nowhere (container runtime masks /sys/devices/virtual/powercap)"
    return [], f"absent: no RAPL package zone under {root}"


def _dangling(root: str) -> bool:
    try:
        return any(e.startswith("intel-rapl") and not os.path.exists(os.path.join(root, e))
                   for e in os.listdir(root))
    except OSError:
        return False


def step_joules(prev_uj: int, cur_uj: int, max_range_uj: int, seconds: float,
                max_watts: float = MAX_PLAUSIBLE_WATTS) -> float | None:
    """Energy between two counter reads, or None when it cannot be trusted (rule 4).

    One wrap is assumed when the counter went down. The step is rejected when the implied power exceeds
    ``max_watts`` or when one more wrap would also fit under ``max_watts`` (the reads are too far apart to
    tell how many wraps happened).
    """
    if cur_uj >= prev_uj:
        delta_uj = cur_uj - prev_uj
    elif max_range_uj > 0 and prev_uj <= max_range_uj:
        delta_uj = cur_uj + (max_range_uj - prev_uj)
    else:
        return None
    if seconds <= 0:
        return None if delta_uj else 0.0
    joules = delta_uj / 1e6
    if joules / seconds > max_watts:
        return None
    if max_range_uj > 0 and (joules + max_range_uj / 1e6) / seconds <= max_watts:
        return None  # ambiguous: k extra wraps are as plausible as none
    return joules


class RaplSource:
    """Reads the host's RAPL package/dram counters. ``read(t)`` is synchronous and cheap (one small file
    read per zone); ``t`` is the daemon's monotonic tick time.

    Thread-safe: the sampler calls ``read`` from a worker thread, and a read that outlived its tick may
    still run when the next one starts. Reads are serialised by a lock, so two reads never take the same
    counter step (no energy counted twice) and the zone table is never rescanned under a reader."""

    name = "rapl"

    def __init__(self, root: str = DEFAULT_ROOT, rescan_seconds: float = RESCAN_SECONDS,
                 max_plausible_watts: float = MAX_PLAUSIBLE_WATTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.clock = clock  # stamps read_at; the sampler's tick clock (a test's virtual one)
        self.rescan_seconds = rescan_seconds
        self.max_plausible_watts = max_plausible_watts
        self._zones: dict[str, _Zone] = {}
        self._scan_reason = ""
        self._last_scan_t: float | None = None
        self._lock = threading.Lock()

    def _rescan(self, t: float) -> None:
        """Pick up zones that appeared (module loaded, access granted); keep the state of known ones."""
        found, self._scan_reason = discover(self.root)
        for z in found:
            self._zones.setdefault(z.device, z)
        self._last_scan_t = t

    def read(self, t: float) -> tuple[SourceStatus, list[DeviceReading]]:
        with self._lock:
            return self._read(t)

    def _read(self, t: float) -> tuple[SourceStatus, list[DeviceReading]]:
        started = time.perf_counter()
        if self._last_scan_t is None or t - self._last_scan_t >= self.rescan_seconds:
            self._rescan(t)
        readings, failures = [], {}
        for z in self._zones.values():
            reading, failure = self._read_zone(z, t)
            readings.append(reading)
            if failure:
                failures.setdefault((failure.kind, failure.detail), []).append(z.device)
        reason = "; ".join(f"{kind}: {', '.join(devs)} ({detail})" for (kind, detail), devs in failures.items())
        return self._status(readings, reason, time.perf_counter() - started), readings

    def _read_zone(self, z: _Zone, t: float) -> tuple[DeviceReading, _Unreadable | None]:
        labels = {"zone": z.zone, "domain": z.domain}
        try:
            cur = _read_energy_uj(z.energy_path)
            read_at = self.clock()
        except _Unreadable as e:
            z.broken = True  # the next good read re-bases (rule 3: no sample, not 0 J)
            return DeviceReading(device=z.device, kind="host", labels=labels, joules_total=None, continuous=False,
                                 method="rapl"), e
        continuous = not z.broken
        if z.prev_uj is not None:
            step = step_joules(z.prev_uj, cur, z.max_range_uj, t - z.prev_t, self.max_plausible_watts)
            if step is None:
                continuous = False  # dropped and re-based (rule 4)
                log.warning("rapl %s: step dropped as implausible: %.1f J in %.3f s (counter %d -> %d)",
                            z.device, (cur - z.prev_uj) / 1e6, t - z.prev_t, z.prev_uj, cur)
            else:
                z.total_joules += step
        else:
            continuous = False
        z.prev_uj, z.prev_t, z.broken = cur, t, False
        return DeviceReading(device=z.device, kind="host", labels=labels, joules_total=z.total_joules,
                             continuous=continuous, method="rapl", read_at=read_at), None

    def _status(self, readings: list[DeviceReading], reason: str, seconds: float) -> SourceStatus:
        ok = sum(r.joules_total is not None for r in readings)
        if not readings:
            return SourceStatus(source="rapl", server="", up=False, reason=self._scan_reason, duration_seconds=seconds,
                                state="down")
        if ok == 0:
            return SourceStatus(source="rapl", server="", up=False, reason=reason, duration_seconds=seconds,
                                state="down")
        if reason:
            return SourceStatus(source="rapl", server="", up=True, reason=reason, duration_seconds=seconds,
                                state="degraded")
        return SourceStatus(source="rapl", server="", up=True, reason="", duration_seconds=seconds, state="ok")
