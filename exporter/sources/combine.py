"""One reading from an exposition that may hold an engine and its add-ons (LMCache beside vLLM, Dynamo's KV
statistics and KVBM beside the engine a Dynamo worker runs).

The primary engine is the first registered non-add-on adapter that recognises the text (vLLM when none does:
its read then says parse_error); every add-on adapter that recognises it reads it too, and its keys are merged
in where the primary has none (the engine's own series win: vLLM counts LMCache's hits in its token sources
already). A text made of several expositions (a server's /metrics and its sidecars', sources/vllm.py) is read
the same way. The reading's engine is the primary's name joined with the add-ons', e.g. ``vllm+lmcache``; an
exposition holding only an add-on is read as that add-on alone.

Block counters (KVBM counts blocks) become tokens once the merged reading knows the engine's block size.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache

from exporter.samples import EngineInfo, EngineReading
from exporter.sources.engine import EngineAdapter, SourceError, adapters, capabilities_of
from exporter.sources.shapes import known_shape, unknown_shape

BLOCKS_TO_TOKENS = {"offload_store_blocks": "offload_store_tokens", "offload_load_blocks": "offload_load_tokens"}


def is_addon(adapter: EngineAdapter) -> bool:
    return bool(getattr(adapter, "addon", False))


def pick(text: str) -> tuple[EngineAdapter | None, list[EngineAdapter]]:
    """(the primary engine's adapter or None, the add-ons present). Each ``detect`` scans the whole text (a
    50k-series exposition is megabytes): engines are tried until one answers, and the add-ons' prefixes are
    looked for in one scan first, so a plain vLLM exposition costs two scans, not one per adapter."""
    registered = adapters()
    primary = next((a for a in registered if not is_addon(a) and a.detect(text)), None)
    addons = tuple(a for a in registered if is_addon(a))
    prefixes, scan = _addon_scan(addons)
    if not text.startswith(prefixes) and not scan.search(text):  # none of the declared prefixes: skip those
        addons = tuple(a for a in addons if not getattr(a, "detect_prefixes", ()))
    return primary, [a for a in addons if a.detect(text)]


@lru_cache(maxsize=8)
def _addon_scan(addons: tuple[EngineAdapter, ...]) -> tuple[tuple[str, ...], re.Pattern]:
    """The add-ons' declared line prefixes, and one pattern finding a line (after the first) starting with one."""
    prefixes = tuple(sorted({p for a in addons for p in getattr(a, "detect_prefixes", ())})) or ("\x00",)
    return prefixes, re.compile("\n(?:" + "|".join(re.escape(p) for p in prefixes) + ")")


def read_exposition(text: str, problems: list[str] | None = None) -> EngineReading:
    """The reading of ``text``: the primary engine's, with its add-ons' keys merged in. Raises SourceError
    (parse_error) when nothing usable is there."""
    primary, addons = pick(text)
    if primary is None and not addons:
        return _unrecognised(text, problems)
    if primary is None:  # an add-on alone (LMCache's own port read as the server's only URL)
        readings = [a.read(text, problems) for a in addons]
    else:
        readings = [primary.read(text, problems)] + [r for r in (_addon(a, text, problems) for a in addons) if r]
    out = readings[0]
    for addon in readings[1:]:
        out = merge(out, addon)
    return blocks_as_tokens(out)


def _unrecognised(text: str, problems: list[str] | None) -> EngineReading:
    """No adapter recognised the text: a known unusable shape (JSON, a Dynamo frontend, trtllm-serve's
    latency-only series) says so; otherwise vLLM reads it (a registry without vLLM's prefix detection) and,
    finding nothing, the reason names what the text starts with (sources/shapes.py)."""
    shape = known_shape(text)
    if shape is not None:
        raise SourceError("parse_error", shape)
    try:
        return blocks_as_tokens(adapters()[0].read(text, problems))
    except SourceError as e:
        if e.reason == "parse_error" and "malformed" not in str(e):
            raise SourceError("parse_error", unknown_shape(text)) from None
        raise


def _addon(adapter: EngineAdapter, text: str, problems: list[str] | None) -> EngineReading | None:
    """An add-on beside a primary engine: its failure degrades the read (a problem), never fails it."""
    try:
        return adapter.read(text, problems)
    except SourceError as e:
        if problems is not None:
            problems.append(f"{e.reason}: {adapter.name}: {e}")
        return None


def _ranks(reading: EngineReading) -> dict[str, dict[str, float]]:
    return {e: dict(c) for e, c in reading.engine_counters.items()} or {"": dict(reading.counters)}


def merge(base: EngineReading, addon: EngineReading) -> EngineReading:
    """``base`` with ``addon``'s counters and gauges where ``base`` has none. The add-on's per-rank counters
    keep their own rank ids under its name (``lmcache:0``), so the store tracks their resets apart."""
    new_counters = {k: v for k, v in addon.counters.items() if k not in base.counters and k not in base.rejected}
    counters = {**base.counters, **new_counters}
    gauges = {**base.gauges, **{k: v for k, v in addon.gauges.items()
                                if k not in base.gauges and k not in base.rejected}}
    ranks = _ranks(base)
    for rank, values in _ranks(addon).items():
        kept = {k: v for k, v in values.items() if k in new_counters}
        if kept:
            ranks[f"{addon.engine}:{rank}"] = kept
    rejected = {**addon.rejected, **base.rejected}
    info = _merge_info(base.info, addon.info)
    caps = base.capabilities | addon.capabilities | capabilities_of(counters, gauges, info)
    return EngineReading(counters=counters, gauges=gauges, info=info, capabilities=frozenset(caps),
                         engine=f"{base.engine}+{addon.engine}", engine_counters=ranks, rejected=rejected,
                         spellings=dict(base.spellings))


def _merge_info(base: EngineInfo, addon: EngineInfo) -> EngineInfo:
    """The primary's facts; offloading is on when the add-on offloads (vLLM's cache_config_info says "off"
    when LMCache, not its native offloading, holds the KV)."""
    if not addon.offload_enabled or base.offload_enabled:
        return base
    return replace(base, offload_enabled=True, offload_backend=addon.offload_backend,
                   offload_buffer_bytes=base.offload_buffer_bytes if base.offload_buffer_bytes is not None
                   else addon.offload_buffer_bytes, model_name=base.model_name or addon.model_name)


def blocks_as_tokens(reading: EngineReading) -> EngineReading:
    """Block counters as tokens (block size x blocks) where no token counter says it already; without a block
    size the blocks stay (no figure reads them: absent, not guessed)."""
    size = reading.info.block_size
    todo = {b: t for b, t in BLOCKS_TO_TOKENS.items() if b in reading.counters and t not in reading.counters}
    if not size or not todo:
        return reading
    counters = dict(reading.counters)
    ranks = _ranks(reading)
    for blocks, tokens in todo.items():
        counters[tokens] = counters[blocks] * size
        for values in ranks.values():
            if blocks in values:
                values[tokens] = values[blocks] * size
    caps = reading.capabilities | capabilities_of(counters, reading.gauges, reading.info)
    return replace(reading, counters=counters, engine_counters=ranks, capabilities=frozenset(caps))
