"""The recorded OFF-condition profile (`kvwatt baseline record`, read by the `recorded` dE kind).

JSON, versioned, written atomically (exporter.runtime.atomic). Example:

    {"format": "kvwatt-offload-profile", "version": 1,
     "server": "llama-off", "model_name": "meta-llama/Llama-3.1-8B-Instruct", "offload_enabled": false,
     "recorded_at": "2026-01-31T12:00:00Z", "duration_seconds": 1800.0, "window_seconds": 60.0,
     "scope": "gpu", "energy": "marginal",
     "bands": [{"lo": 0.0, "hi": 0.8, "windows": 12, "joules_per_token": 0.151,
                "joules_per_token_stderr": 0.004, "tokens_per_second": 1985.0,
                "tokens_per_second_stderr": 21.0}, ...]}

Bands are KV-usage p95 ranges [lo, hi) (the last one includes 1.0); a band with no windows has nulls.
Loading validates everything and raises ConfigError naming the file and the problem (exit status 2).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Sequence

from exporter.config import ConfigError, ServerConfig, is_finite, read_json, shown
from exporter.derive.economics import DEFAULT_BANDS, BandProfile, build_bands, window_stats
from exporter.runtime import atomic
from exporter.samples import EngineInfo, Interval
from exporter.store import buckets_of

FORMAT = "kvwatt-offload-profile"
VERSION = 1


@dataclass(frozen=True)
class Profile:
    server: str
    model_name: str
    offload_enabled: bool | None
    recorded_at: str
    duration_seconds: float
    window_seconds: float
    bands: tuple[BandProfile, ...]
    scope: str = "gpu"
    energy: str = "marginal"

    @property
    def windows(self) -> int:
        return sum(b.windows for b in self.bands)


def build_profile(intervals: Sequence[Interval], info: EngineInfo | None, server: ServerConfig,
                  duration_seconds: float, window_seconds: float) -> Profile:
    """The profile of a recording: its intervals cut into non-overlapping windows, J/token and tokens/s per
    KV-pressure band (docs/methods.md §1 and §3). J/token is marginal when every interval with GPU energy
    also has an idle baseline, else total."""
    with_energy = [iv for iv in intervals if "gpu" in iv.energy_joules]
    marginal = bool(with_energy) and all("gpu" in iv.idle_joules for iv in with_energy)
    windows = window_stats(buckets_of(intervals, window_seconds), window_seconds, "gpu", marginal=marginal)
    return Profile(
        server=server.name, model_name=info.model_name if info else "",
        offload_enabled=info.offload_enabled if info else None,
        recorded_at=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        duration_seconds=duration_seconds, window_seconds=window_seconds,
        bands=tuple(build_bands(windows, DEFAULT_BANDS)), scope="gpu",
        energy="marginal" if marginal else "total")


def to_json(p: Profile) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "server": p.server, "model_name": p.model_name,
            "offload_enabled": p.offload_enabled, "recorded_at": p.recorded_at,
            "duration_seconds": p.duration_seconds, "window_seconds": p.window_seconds, "scope": p.scope,
            "energy": p.energy,
            "bands": [{"lo": b.lo, "hi": b.hi, "windows": b.windows, "joules_per_token": b.joules_per_token,
                       "joules_per_token_stderr": b.joules_per_token_stderr,
                       "tokens_per_second": b.tokens_per_second,
                       "tokens_per_second_stderr": b.tokens_per_second_stderr} for b in p.bands]}


def write(path: str, p: Profile) -> None:
    atomic.write_json(path, to_json(p))


def _num(d: dict, key: str, where: str, optional: bool = False, minimum: float = 0.0) -> float | None:
    v = d.get(key)
    if v is None and optional:
        return None
    if not is_finite(v) or v < minimum:  # is_finite: also an integer too large for a float
        raise ConfigError(f"{where}.{key}: expected a finite number >= {minimum:g}, got {shown(v)}")
    return float(v)


def from_json(data: Any, where: str) -> Profile:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    if data.get("format") != FORMAT:
        raise ConfigError(f"{where}: not a kvwatt offload profile (format {data.get('format')!r})")
    if data.get("version") != VERSION:
        raise ConfigError(f"{where}: unsupported profile version {data.get('version')!r} (this kvwatt reads {VERSION})")
    if data.get("scope") not in ("gpu", "host") or data.get("energy") not in ("marginal", "total"):
        raise ConfigError(f"{where}: scope must be gpu|host and energy marginal|total")
    if data.get("offload_enabled") is True:
        raise ConfigError(f"{where}: recorded with offloading ON; an OFF profile is needed")
    raw = data.get("bands")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}.bands: expected a non-empty list")
    bands, prev_hi = [], None
    for i, b in enumerate(raw):
        w = f"{where}.bands[{i}]"
        if not isinstance(b, dict):
            raise ConfigError(f"{w}: expected an object")
        lo, hi = _num(b, "lo", w), _num(b, "hi", w)
        if not lo < hi <= 1.0 or (prev_hi is not None and abs(lo - prev_hi) > 1e-9):
            raise ConfigError(f"{w}: bands must be contiguous ranges within [0, 1], got [{lo}, {hi})")
        n = b.get("windows")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"{w}.windows: expected a count, got {n!r}")
        vals = {k: _num(b, k, w, optional=True) for k in ("joules_per_token", "joules_per_token_stderr",
                                                          "tokens_per_second", "tokens_per_second_stderr")}
        if n > 0 and vals["tokens_per_second"] is None:
            raise ConfigError(f"{w}: {n} windows but no tokens_per_second")
        bands.append(BandProfile(lo=lo, hi=hi, windows=n, **vals))
        prev_hi = hi
    return Profile(server=str(data.get("server", "")), model_name=str(data.get("model_name", "")),
                   offload_enabled=data.get("offload_enabled"), recorded_at=str(data.get("recorded_at", "")),
                   duration_seconds=_num(data, "duration_seconds", where),
                   window_seconds=_num(data, "window_seconds", where, minimum=1.0), bands=tuple(bands),
                   scope=data["scope"], energy=data["energy"])


def load(path: str) -> Profile:
    return from_json(read_json(path), path)
