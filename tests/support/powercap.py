"""Powercap (RAPL) trees in the kernel's layout, written by tests, and a power model to drive them.

No machine here has RAPL (``/sys/class/powercap`` is absent), so tests and the end-to-end accuracy test
write the tree the kernel would show and point kvwatt at it (``--powercap-root`` / ``powercap_root``).

Layout written under ``base`` (the same shape as a real ``/sys``)::

    base/sys/devices/virtual/powercap/intel-rapl/            control type ("enabled")
        intel-rapl:0/  name=package-0  energy_uj  max_energy_range_uj
            intel-rapl:0:0/  name=core ...                   subzones nested in their package
            intel-rapl:0:2/  name=dram ...
    base/sys/devices/virtual/powercap/intel-rapl-mmio/intel-rapl-mmio:0/  name=package-0 (duplicate)
    base/sys/class/powercap/intel-rapl:0 -> ../../devices/virtual/powercap/intel-rapl/intel-rapl:0
    base/sys/class/powercap/intel-rapl:0:2 -> ...            (flat symlinks, as the kernel makes them)

``tree.root`` is ``base/sys/class/powercap``: pass it to kvwatt.

Usage::

    tree = intel_two_socket(tmp_path)                 # packages 0/1 (core + dram subzones), psys, mmio
    tree.advance("intel-rapl:0", joules=12.5)         # adds 12.5 J, wrapping at max_energy_range_uj
    tree.make_unreadable("intel-rapl:1", how="directory")
    model = PowerModel(idle_watts=40.0, joules_per_token=0.2)
    tree.advance("intel-rapl:0", model.joules(seconds=1.0, tokens=50))

Zones are named by their directory id (``intel-rapl:0``, ``intel-rapl:0:2``, ``intel-rapl-mmio:0``).
Directory ids are hexadecimal like the kernel's (``intel-rapl:a`` is the 11th zone); ``add_zone`` takes an
explicit id so a test can make directory numbers disagree with package numbers.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Values seen on real machines (Intel server; AMD Zen reports 2^32 units of 15.3 uJ).
INTEL_MAX_ENERGY_RANGE_UJ = 262_143_328_850
AMD_MAX_ENERGY_RANGE_UJ = 65_712_999_613


@dataclass(frozen=True)
class PowerModel:
    """Energy a zone uses: a constant idle power plus a fixed cost per generated token."""

    idle_watts: float
    joules_per_token: float = 0.0

    def joules(self, seconds: float, tokens: float = 0.0) -> float:
        return self.idle_watts * seconds + self.joules_per_token * tokens


class PowercapTree:
    """A writable powercap tree. All paths are real files; counters are integers in microjoules."""

    def __init__(self, base: str | os.PathLike) -> None:
        self.base = Path(base)
        self.devices = self.base / "sys/devices/virtual/powercap"
        self.root = str(self.base / "sys/class/powercap")
        os.makedirs(self.root, exist_ok=True)
        self._dirs: dict[str, Path] = {}

    # --- building ---------------------------------------------------------------------------------
    def add_zone(self, name: str, *, parent: str | None = None, zone_id: str | None = None,
                 energy_uj: int = 0, max_energy_range_uj: int = INTEL_MAX_ENERGY_RANGE_UJ,
                 mmio: bool = False) -> str:
        """Create a zone (or a subzone of ``parent``) and its class symlink; returns its directory id."""
        control = "intel-rapl-mmio" if mmio else "intel-rapl"
        if parent is None:
            ctl_dir = self.devices / control
            ctl_dir.mkdir(parents=True, exist_ok=True)
            (ctl_dir / "enabled").write_text("1\n")
            suffix = zone_id if zone_id is not None else format(self._count(ctl_dir, f"{control}:"), "x")
            dir_id, where = f"{control}:{suffix}", ctl_dir
        else:
            where = self._dirs[parent]
            suffix = zone_id if zone_id is not None else format(self._count(where, f"{parent}:"), "x")
            dir_id = f"{parent}:{suffix}"
        zone_dir = where / dir_id
        zone_dir.mkdir(parents=True)
        (zone_dir / "name").write_text(name + "\n")
        (zone_dir / "max_energy_range_uj").write_text(f"{max_energy_range_uj}\n")
        (zone_dir / "enabled").write_text("1\n")
        self._dirs[dir_id] = zone_dir
        self.set_energy(dir_id, energy_uj)
        link = Path(self.root) / dir_id
        link.symlink_to(os.path.relpath(zone_dir, self.root))
        return dir_id

    @staticmethod
    def _count(directory: Path, prefix: str) -> int:
        return sum(1 for p in directory.iterdir() if p.name.startswith(prefix) and p.name.count(":") ==
                   prefix.count(":"))

    # --- counters ---------------------------------------------------------------------------------
    def path(self, dir_id: str, file: str = "energy_uj") -> Path:
        return self._dirs[dir_id] / file

    def max_range_uj(self, dir_id: str) -> int:
        return int(self.path(dir_id, "max_energy_range_uj").read_text())

    def energy_uj(self, dir_id: str) -> int:
        return int(self.path(dir_id).read_text())

    def set_energy(self, dir_id: str, energy_uj: int) -> None:
        """Write the counter the way sysfs shows it (decimal and a newline), atomically: a read of a real
        energy_uj always returns a whole value (the kernel formats it per read), while truncate-then-write
        on a regular file lets a concurrent reader see it empty, which kvwatt rightly reports as masked."""
        target = self.path(dir_id)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(f"{int(energy_uj)}\n")
        os.replace(tmp, target)

    def advance(self, dir_id: str, joules: float) -> None:
        """Add ``joules`` to the zone's counter, wrapping at max_energy_range_uj like the hardware."""
        uj = self.energy_uj(dir_id) + int(round(joules * 1e6))
        self.set_energy(dir_id, uj % self.max_range_uj(dir_id))

    # --- failures ---------------------------------------------------------------------------------
    def make_unreadable(self, dir_id: str, how: str = "chmod") -> None:
        """Make energy_uj unreadable. how: chmod (0o000: only bites non-root), directory (a directory in
        place of the file: fails for root too), missing (file removed), empty (what a /dev/null bind mount
        reads as)."""
        p = self.path(dir_id)
        if how == "chmod":
            os.chmod(p, 0)
        elif how == "directory":
            p.unlink()
            p.mkdir()
        elif how == "missing":
            p.unlink()
        elif how == "empty":
            p.write_text("")
        else:
            raise ValueError(f"unknown how={how!r}")

    def mask(self) -> None:
        """What container runtimes do: /sys/devices/virtual/powercap masked by an empty tmpfs, so the class
        symlinks dangle."""
        shutil.rmtree(self.devices)
        self.devices.mkdir(parents=True)


def intel_two_socket(base: str | os.PathLike, dram: bool = True, psys: bool = True, mmio: bool = True,
                     energy_uj: int = 1_000_000) -> PowercapTree:
    """Two Intel packages (core + dram subzones), a top-level psys zone, an mmio duplicate of package-0.

    Zone ids: intel-rapl:0 (package-0) with intel-rapl:0:0 (core) and intel-rapl:0:1 (dram);
    intel-rapl:1 (package-1) likewise; intel-rapl:2 (psys); intel-rapl-mmio:0 (package-0 duplicate).
    """
    tree = PowercapTree(base)
    for socket in (0, 1):
        pkg = tree.add_zone(f"package-{socket}", energy_uj=energy_uj)
        tree.add_zone("core", parent=pkg, energy_uj=energy_uj // 2)
        if dram:
            tree.add_zone("dram", parent=pkg, energy_uj=energy_uj // 4, max_energy_range_uj=65_712_999_613)
    if psys:
        tree.add_zone("psys", energy_uj=energy_uj * 3)
    if mmio:
        tree.add_zone("package-0", mmio=True, energy_uj=energy_uj)
    return tree


def amd(base: str | os.PathLike, sockets: int = 1, energy_uj: int = 1_000_000) -> PowercapTree:
    """AMD Zen: the same intel-rapl paths, package zones only (a core subzone covering one core), no dram."""
    tree = PowercapTree(base)
    for socket in range(sockets):
        pkg = tree.add_zone(f"package-{socket}", energy_uj=energy_uj, max_energy_range_uj=AMD_MAX_ENERGY_RANGE_UJ)
        tree.add_zone("core", parent=pkg, energy_uj=energy_uj // 8, max_energy_range_uj=AMD_MAX_ENERGY_RANGE_UJ)
    return tree


class ConstantPower(threading.Thread):
    """Advances one zone at ``watts`` in 10 ms steps until ``stop`` is set (a host at constant power).

    Real RAPL counters update about every millisecond. A reader that takes its time right after reading
    (DeviceReading.read_at) sees the counter as of the last step, so the step bounds the double's error:
    50 ms steps, delayed further on a loaded machine, put 5 % into a 3 s measurement."""

    def __init__(self, tree: PowercapTree, zone: str, watts: float) -> None:
        super().__init__(daemon=True)
        self.tree, self.zone, self.watts, self.stop = tree, zone, watts, threading.Event()

    def run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(0.01):
            now = time.monotonic()
            self.tree.advance(self.zone, self.watts * (now - last))
            last = now
