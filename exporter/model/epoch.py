"""Evidence epochs (methods.md s10): the engine facts that the learned figures of a server hold for. When one of
them changes (a KV cache of another size, another model, offloading switched, the engine restarted), the
evidence windows and the reference share learned before describe another server: they are set aside, not mixed.

A fact the reading does not show (None, "") is no change: a scrape without cache_config_info says nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from exporter.samples import EngineInfo

FACTS = ("model_name", "num_gpu_blocks", "block_size", "offload_enabled", "offload_buffer_bytes",
         "offload_backend", "process_start_time_seconds")


@dataclass(frozen=True)
class Epoch:
    started_wall: float | None = None  # unix time the epoch began (None: before the first reading)
    cause: str = "no reading yet"
    facts: Mapping[str, Any] = field(default_factory=dict)


def facts_of(info: EngineInfo) -> dict[str, Any]:
    return {k: v for k in FACTS if (v := getattr(info, k, None)) is not None and v != ""}


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """'fact old -> new' for each fact both know and disagree on."""
    return [f"{k} {old[k]!r} -> {new[k]!r}" for k in FACTS if k in old and k in new and old[k] != new[k]]
