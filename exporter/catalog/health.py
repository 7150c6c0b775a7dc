"""The exporter itself and the health of its sources: what is read, whether it answered and how long it took."""

from __future__ import annotations

from typing import Iterator

from exporter import rules
from exporter.catalog import bounds
from exporter.catalog.declare import (
    Elsewhere,
    MetricDef,
    Sample,
    Section,
    Words,
    bookkeeping,
    flag,
    info,
    reading,
    server_block,
    window_key,
)
from exporter.figures import ServerFigures, Snapshot
from exporter.runtime.build import build_info

EXPORTER_SECTION = "Exporter"
SOURCES_SECTION = "Sources"


def _build_info(_snap: Snapshot) -> Iterator[Sample]:
    b = build_info()
    yield (b.version, b.revision, b.python_version), 1.0


def _statuses(snap: Snapshot):
    return [s.status for s in snap.servers] + list(snap.sources)


def _source_up(snap: Snapshot) -> Iterator[Sample]:
    for st in _statuses(snap):
        yield (st.source, st.server), flag(st.up)


def _source_info(snap: Snapshot) -> Iterator[Sample]:
    for st in _statuses(snap):
        yield (st.source, st.server, st.state, st.code), 1.0  # the word only: details churn (samples.py)


def _rejected(snap: Snapshot) -> Iterator[Sample]:
    for (figure, kind), n in sorted(snap.rejected_counts.items()):
        yield (figure, kind), n


def _sample_duration(snap: Snapshot) -> Iterator[Sample]:
    for st in _statuses(snap):
        yield (st.source, st.server), st.duration_seconds


def _server_info(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        info = s.info
        yield (s.name, s.url, info.model_name if info else "",
               (info.offload_backend if info else "") or "unknown", s.engine), 1.0  # figures.engine_name


def _capabilities(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        for cap in sorted(s.capabilities):
            yield (s.name, cap), 1.0


# kvwatt itself: its build, and the figures its bounds check rejected
EXPORTER: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_build_info", type="info", labels=("version", "revision", "python_version"),
        help="The running kvwatt: version, source revision (git commit, or unknown) and Python version; value 1 (as "
             "`kvwatt --version` prints them).",
        computes=info("runtime.build.build_info"),
        section=EXPORTER_SECTION,
        fill=_build_info,
        status=Elsewhere("the running kvwatt, not a server's figure: /api/status's top-level version"),
        bounds=bounds.INFO,
    ),
    MetricDef(
        name="kvwatt_figures_rejected_total", type="counter", labels=("figure", "reason"),
        help="Figures served as unknown because they broke their family's declared bound (reason: the bound's kind: "
             "share, power_part, saving, token_rate, priced, ...; exporter/catalog/bounds.py), were computed from "
             "counts "
             "another figure showed implausible (reason=dependent) or broke a declared relation with another figure "
             "(reason=relation; figure: the relation's name where the figure has no family), counted once per tick "
             "each; the figure and its inputs are in /api/status's implausible list and the log.",
        computes=bookkeeping("catalog.bounds.BoundsCheck.apply",
                             why="a count of the figures the bounds check rejected, not a figure of a server"),
        section=EXPORTER_SECTION,
        fill=_rejected,
        status=Elsewhere("a count of the bounds check: /api/status lists the figures rejected this tick"),
        bounds=bounds.NON_NEGATIVE,
    ),
)


# what is read: each source's health and read time, each server's identity, how much of a window is held
SOURCES: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_source_up", type="gauge", labels=("source", "server"),
        help="1 if the last read of this source succeeded, 0 if not (see kvwatt_source_info for the reason). server "
             "is empty for host-wide sources (nvml, rapl, state_dir: where idle baselines persist).",
        computes=reading("runtime.sampler.Sampler.tick"),
        section=SOURCES_SECTION,
        fill=_source_up,
        bounds=bounds.BOOLEAN,
    ),
    MetricDef(
        name="kvwatt_source_info", type="info", labels=("source", "server", "state", "reason"),
        help="Why a source is down or degraded: one word from a fixed list (README, Metrics), e.g. timeout, "
             "unreachable, redirect, http_503, parse_error, deadline, permission, absent, gpu_lost, not_persisted; "
             "the details are in /api/status and the log; value 1.",
        computes=info("runtime.sampler.Sampler.tick"),
        section=SOURCES_SECTION,
        fill=_source_info,
        bounds=bounds.INFO,
    ),
    MetricDef(
        name="kvwatt_sample_duration_seconds", type="gauge", labels=("source", "server"),
        help="How long the last read of this source took.",
        computes=bookkeeping("runtime.sampler.Sampler.tick", why="how long the last read took"),
        section=SOURCES_SECTION,
        fill=_sample_duration,
        status=Elsewhere("a read timing: /metrics only"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_server_info", type="info", labels=("server", "url", "model_name", "offload_backend", "engine"),
        help="What kvwatt knows of each watched server: the engine detected from its exposition (vllm, sglang, "
             "trtllm, with +lmcache / +dynamo when those add-ons' series are there, docs/engines.md), the model and "
             "the offload backend (vLLM: from vllm:cache_config_info); value 1.",
        computes=info("sources.combine.read_exposition"),
        section=SOURCES_SECTION,
        fill=_server_info,
        bounds=bounds.INFO,
    ),
    MetricDef(
        name="kvwatt_server_capability", type="info", labels=("server", "capability"),
        help="One series per figure group the server's engine supports (kv_usage, preemptions, token_sources, "
             "engine_steps, offload_traffic, offload_occupancy, ...): a kvwatt figure absent for a server whose "
             "engine lacks its capability is absent by design, not missing (docs/engines.md); value 1.",
        computes=info("sources.engine.capabilities_of"),
        section=SOURCES_SECTION,
        fill=_capabilities,
        bounds=bounds.INFO,
    ),
    MetricDef(
        name="kvwatt_window_covered_seconds", type="gauge", labels=("server", "window"),
        help="Seconds of gap-free samples the window actually holds (less than the window right after start or after "
             "a server outage).",
        computes=bookkeeping("model.server.ServerModel.window",
                             why="how much of the window the store holds, counted when the window is cut"),
        section=SOURCES_SECTION,
        status=window_key("covered_seconds", lambda w: w.covered_seconds,
                           json=lambda w: round(w.covered_seconds, 3)),
        words=(Words("covered", "coverage"),),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_window_age_seconds", type="gauge", labels=("server", "window"),
        help="Seconds since the window's figures were derived: 0 but for the longer windows of a node watching more "
             f"than {rules.LONG_WINDOWS_BUILT_PER_TICK.default:g} servers, each rebuilt in turn every few ticks.",
        computes=bookkeeping("model.window_state.WindowState.figures",
                             why="when the window's figures were last built, counted when they are served"),
        section=SOURCES_SECTION,
        status=window_key("age_seconds", lambda w: w.age_seconds, json=lambda w: round(w.age_seconds, 3)),
        bounds=bounds.NON_NEGATIVE,
    ),
)


# --- the sections' JSON and the sections ----------------------------------------------------------------------------
def _identity_json(v: ServerFigures) -> dict:
    return {"server": v.name, "url": v.url, "engine": v.engine, "capabilities": sorted(v.capabilities),
            "model_name": v.info.model_name if v.info else None}


def _source_status_json(v: ServerFigures) -> dict:
    return {"up": v.status.up, "state": v.status.state, "reason_code": v.status.code, "reason": v.status.reason}


EXPORTER_SEC = Section(name=EXPORTER_SECTION, metrics=EXPORTER)
SOURCES_SEC = Section(name=SOURCES_SECTION, metrics=SOURCES, blocks=(
    server_block(("server", "url", "engine", "capabilities", "model_name"),
                 ("kvwatt_server_info", "kvwatt_server_capability"), _identity_json),
    server_block(("up", "state", "reason_code", "reason"), ("kvwatt_source_up", "kvwatt_source_info"),
                 _source_status_json),
))
