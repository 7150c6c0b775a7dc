"""How kvwatt's labelled keys are spelled: one counter or gauge per value of a label, keyed "<prefix>@<value>"
(e.g. "tier_write_bytes@1:fs"). The keys themselves are listed by the engine seam (exporter/sources/engine.py);
this module is the part the derivations need, so they read readings without importing the sources."""

from __future__ import annotations


def labelled_key(prefix: str, value: str) -> str:
    return f"{prefix}@{value}"


def labelled(counters: dict[str, float], prefix: str) -> dict[str, float]:
    """{label value: v} of one labelled counter family in a counters (or deltas) mapping."""
    head = prefix + "@"
    return {k[len(head):]: v for k, v in counters.items() if k.startswith(head)}
