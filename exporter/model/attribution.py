"""Which energy devices belong to which watched server.

GPUs: ``servers[].gpus`` lists GPU indices ("0") or UUIDs ("GPU-8f0c...", case-insensitive). With one
server and no list, every GPU is that server's. With several servers, a GPU no list names is unassigned:
its energy counts for no server (a guess would put one server's energy into another's J/token); it is
still exported per device and its idle baseline is still learned (when every server is idle). A GPU named
by two servers goes to the first (servers share no GPU energy) and a warning says so.

Host (RAPL) energy is shared: kvwatt assumes the servers it watches run on the host it runs on. Each tick,
the host's energy is split across servers in proportion to the energy of each server's GPUs in that tick;
when that is unknown (a server without GPUs, a GPU without a sample, no GPU energy at all) the split is
equal. The idle part P_idle*dt is split with the same shares, so the servers' marginal host energies add
up to the host's. With one server the share is 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from exporter.config import ServerConfig
from exporter.samples import DeviceReading

log = logging.getLogger("kvwatt.attribution")


@dataclass(frozen=True)
class GpuAssignment:
    by_server: dict[str, tuple[str, ...]]  # server -> GPU device ids ("gpu:<uuid>")
    unassigned: tuple[str, ...]
    unmatched: dict[str, tuple[str, ...]]  # server -> configured entries that matched no GPU


def _matches(entry: str, labels: Mapping[str, str]) -> bool:
    entry = entry.strip()
    if entry.isdigit():
        return labels.get("gpu") == str(int(entry))
    return entry.lower() == labels.get("uuid", "").lower()


def assign_gpus(servers: Sequence[ServerConfig], gpus: Iterable[DeviceReading]) -> GpuAssignment:
    gpus = [g for g in gpus if g.kind == "gpu"]
    by_server: dict[str, list[str]] = {s.name: [] for s in servers}
    taken: dict[str, str] = {}
    unmatched: dict[str, tuple[str, ...]] = {}
    if len(servers) == 1 and not servers[0].gpus:
        by_server[servers[0].name] = [g.device for g in gpus]
        taken = {g.device: servers[0].name for g in gpus}
    else:
        for s in servers:
            missing = []
            for entry in s.gpus:
                hits = [g for g in gpus if _matches(entry, g.labels)]
                if not hits:
                    missing.append(entry)
                for g in hits:
                    if g.device in taken and taken[g.device] != s.name:
                        log.warning("GPU %s is listed by servers %s and %s; it counts for %s only",
                                    g.device, taken[g.device], s.name, taken[g.device])
                    elif g.device not in taken:
                        taken[g.device] = s.name
                        by_server[s.name].append(g.device)
            if missing:
                unmatched[s.name] = tuple(missing)
    unassigned = tuple(g.device for g in gpus if g.device not in taken)
    return GpuAssignment({k: tuple(v) for k, v in by_server.items()}, unassigned, unmatched)


def host_shares(servers: Sequence[str], gpu_joules: Mapping[str, float | None]) -> dict[str, float]:
    """Share of the host's energy per server for one tick (sums to 1; see the module docstring)."""
    if not servers:
        return {}
    values = [gpu_joules.get(s) for s in servers]
    if all(v is not None and v >= 0 for v in values):
        total = sum(values)
        if total > 0:
            return {s: v / total for s, v in zip(servers, values)}
    return {s: 1.0 / len(servers) for s in servers}
