"""Energy, two sections: the devices' readings and idle baselines with joules per token (methods.md s1), and the
per-phase costs (s12) with the power they put on recomputation and offloading."""

from __future__ import annotations

import math
from typing import Iterator

from exporter import rules
from exporter.catalog import bounds
from exporter.catalog.declare import (
    Elsewhere,
    Fill,
    MetricDef,
    Sample,
    Section,
    Words,
    bookkeeping,
    info,
    learned,
    reading,
    server_block,
    window_block,
    window_key,
)
from exporter.figures import PHASES, ServerFigures, Snapshot, WindowFigures

ENERGY_SECTION = "Energy"
PHASE_SECTION = "Energy per phase"

DEVICES = Elsewhere("a host-wide device reading (GPU, RAPL zone), not a server's figure: /metrics only")


def _devices(kind: str, get) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for d in snap.devices:
            if d.reading.kind == kind:
                yield get(d)
    return fill


def _gpu_labels(d) -> tuple[str, str]:
    return d.reading.labels.get("gpu", ""), d.reading.labels.get("uuid", "")


def _host_labels(d) -> tuple[str, str]:
    return d.reading.labels.get("zone", ""), d.reading.labels.get("domain", "")


def _idle_age(snap: Snapshot) -> Iterator[Sample]:
    for d in snap.devices:
        yield (d.reading.device,), d.baseline_age_seconds


def _energy(attr: str) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for w in s.windows:
                for e in w.energy:
                    yield (s.name, e.scope, w.window), getattr(e, attr)
    return fill


def _phase(attr: str) -> Fill:
    """A per-phase cost figure of each scope (methods.md s12): one sample per phase that has a value."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for c in s.phase_costs:
                for phase in PHASES:
                    yield (s.name, c.scope, phase), getattr(c, f"{phase}_{attr}")
    return fill


def _phase_source(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        for c in s.phase_costs:
            yield (s.name, c.scope, c.source, c.state), 1.0


def _phase_windows(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        for c in s.phase_costs:
            yield (s.name, c.scope), float(c.windows)


# the devices' readings and idle baselines, and joules per token (methods.md s1)
ENERGY: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_gpu_energy_joules_total", type="counter", labels=("gpu", "uuid"),
        help="GPU energy since kvwatt started watching it (NVML total-energy counter, or integrated instant power "
             "where the counter is missing). rate() gives watts.",
        computes=reading("sources.nvml.NvmlSource.read"),
        section=ENERGY_SECTION,
        fill=_devices("gpu", lambda d: (_gpu_labels(d), d.reading.joules_total)),
        status=DEVICES,
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_gpu_energy_method_info", type="info", labels=("gpu", "uuid", "method"),
        help="How that GPU's energy is measured: counter or power_integration; value 1.",
        computes=info("sources.nvml.NvmlSource.read"),
        section=ENERGY_SECTION,
        fill=_devices("gpu", lambda d: ((*_gpu_labels(d), d.reading.method), 1.0)),
        status=DEVICES,
        bounds=bounds.INFO,
    ),
    MetricDef(
        name="kvwatt_gpu_power_watts", type="gauge", labels=("gpu", "uuid"),
        help="Current board power (NVML power usage; a 1 s trailing average on Ampere and newer).",
        computes=reading("sources.nvml.NvmlSource.read"),
        section=ENERGY_SECTION,
        fill=_devices("gpu", lambda d: (_gpu_labels(d), d.reading.power_watts)),
        status=DEVICES,
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_host_energy_joules_total", type="counter", labels=("zone", "domain"),
        help="RAPL energy of a package or dram zone since kvwatt started watching it, wrap-corrected.",
        computes=reading("sources.rapl.RaplSource.read"),
        section=ENERGY_SECTION,
        fill=_devices("host", lambda d: (_host_labels(d), d.reading.joules_total)),
        status=DEVICES,
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_gpu_idle_power_watts", type="gauge", labels=("gpu", "uuid"),
        help="Idle baseline P_idle of this GPU (learned, measured or configured).",
        computes=learned("idle.baseline.BaselineBook.get",
                         why="P_idle learned across ticks, measured or configured, kept in the state directory "
                             "(docs/energy.md)"),
        section=ENERGY_SECTION,
        fill=_devices("gpu", lambda d: (_gpu_labels(d), d.baseline.watts if d.baseline else None)),
        status=DEVICES,
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_host_idle_power_watts", type="gauge", labels=("zone", "domain"),
        help="Idle baseline P_idle of this RAPL zone.",
        computes=learned("idle.baseline.BaselineBook.get",
                         why="P_idle learned across ticks, measured or configured, kept in the state directory "
                             "(docs/energy.md)"),
        section=ENERGY_SECTION,
        fill=_devices("host", lambda d: (_host_labels(d), d.baseline.watts if d.baseline else None)),
        status=DEVICES,
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_idle_baseline_age_seconds", type="gauge", labels=("device",),
        help="Seconds since that device's idle baseline was measured.",
        computes=bookkeeping("idle.baseline.Baseline.age_seconds",
                             why="the age of a stored idle baseline (docs/energy.md)"),
        section=ENERGY_SECTION,
        fill=_idle_age,
        status=DEVICES,
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_marginal_energy_per_token_joules", type="gauge", labels=("server", "scope", "window"),
        help="(E - P_idle*dt) / generated tokens over the window (methods.md s1). Absent without >= "
             f"{rules.MIN_LOAD_DURATION.default:g} s of load or "
             "without tokens.",
        computes="derive.energy.window_energy",
        section=ENERGY_SECTION,
        fill=_energy("marginal_joules_per_token"),
        words=(Words("GPU J/token, marginal", "joules", ("energy", "gpu", "marginal_joules_per_token")),
               Words("host J/token, marginal", "joules", ("energy", "host", "marginal_joules_per_token"))),
        bounds=bounds.JOULES_PER_TOKEN,
    ),
    MetricDef(
        name="kvwatt_energy_per_token_joules", type="gauge", labels=("server", "scope", "window"),
        help="E / generated tokens over the window, no idle subtraction. Absent without enough load.",
        computes="derive.energy.window_energy",
        section=ENERGY_SECTION,
        fill=_energy("joules_per_token"),
        words=(Words("GPU J/token, total", "joules", ("energy", "gpu", "joules_per_token")),
               Words("host J/token, total", "joules", ("energy", "host", "joules_per_token"))),
        bounds=bounds.JOULES_PER_TOKEN,
    ),
    MetricDef(
        name="kvwatt_prompt_energy_per_token_joules", type="gauge", labels=("server", "source", "window"),
        help="Attribution model, not a measurement: marginal GPU joules per prompt token by token source, pricing "
             "reloaded tokens at the configured load/compute cost ratio (docs/energy.md).",
        computes="derive.energy.prompt_attribution",
        section=ENERGY_SECTION,
        status=window_key("prompt_energy_per_token_joules", lambda w: w.prompt_energy_per_token),
        bounds=bounds.JOULES_PER_TOKEN,
    ),
)


# the per-phase costs (methods.md s12) and the power they price: the recomputation's, the offloading's saving
PHASE_COSTS: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_phase_joules_per_token", type="gauge", labels=("server", "scope", "phase"),
        help="Marginal joules per token by phase (prompt_computed: a prompt token the server computed; generated; "
             "reloaded: a prompt token loaded from the offload tier), measured by a non-negative regression of each "
             "repeat window's marginal energy on its token counts over the last phase_history (methods.md s12); "
             "until identifiable, the configured attribution model (see kvwatt_phase_cost_source). reloaded is "
             "absent where the server reloads nothing.",
        computes=("derive.phase_energy.estimate", "derive.phase_energy.prior_costs"),  # source=measured, prior
        section=PHASE_SECTION,
        fill=_phase("j"),
        bounds=bounds.JOULES_PER_TOKEN,
    ),
    MetricDef(
        name="kvwatt_phase_joules_per_token_stderr", type="gauge", labels=("server", "scope", "phase"),
        help="Standard error of kvwatt_phase_joules_per_token from the regression's residual variance; absent for "
             "the prior and for a cost pinned at 0.",
        computes="derive.phase_energy.estimate",
        section=PHASE_SECTION,
        fill=_phase("se"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_phase_cost_windows", type="gauge", labels=("server", "scope"),
        help="Repeat windows the per-phase costs rest on.",
        computes=bookkeeping("model.energy.PhaseLearner.observe",
                             why="a count of the repeat windows the per-phase learner holds"),
        section=PHASE_SECTION,
        fill=_phase_windows,
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_phase_cost_source", type="info", labels=("server", "scope", "source", "state"),
        help="Which per-phase costs are in use: source=measured (state=known) or source=prior (the configured "
             "attribution model; state=not_identifiable with the reason in /api/status, or unknown); value 1.",
        computes=("derive.phase_energy.estimate", "derive.phase_energy.prior_costs"),  # source=measured, prior
        section=PHASE_SECTION,
        fill=_phase_source,
        bounds=bounds.INFO,
    ),
    MetricDef(
        name="kvwatt_recompute_tax_watts", type="gauge", labels=("server", "scope", "window"),
        help="Power spent recomputing the recomputation tax's prompt tokens: tax share x prompt tokens/s x J per "
             "computed prompt token (kvwatt_phase_joules_per_token, measured or prior), methods.md s12. x 24 h / "
             "1000 = kWh per day.",
        computes="derive.phase_energy.recompute_tax_watts",
        section=PHASE_SECTION,
        status=window_key("recompute_tax_watts", lambda w: w.recompute_tax_watts),
        words=(Words("recomputation energy (GPU)", "kwh_per_day", ("recompute_tax_watts", "gpu")),
               Words("recomputation energy (host)", "kwh_per_day", ("recompute_tax_watts", "host"))),
        bounds=bounds.POWER_PART,
    ),
    MetricDef(
        name="kvwatt_recompute_energy_share_ratio", type="gauge", labels=("server", "scope", "window"),
        help="kvwatt_recompute_tax_watts over the scope's marginal power (E - P_idle*dt)/dt in the window (alert "
             "KVRecomputeEnergyHigh; methods.md s12).",
        computes="derive.energy.tax_in_energy",
        section=PHASE_SECTION,
        status=window_key("recompute_energy_share", lambda w: w.recompute_energy_share),
        words=(Words("recomputation share of GPU energy above idle", "percent", ("recompute_energy_share", "gpu")),),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_preemption_recompute_watts", type="gauge", labels=("server", "scope", "window"),
        help="Power spent on the post-preemption recomputation: its tokens/s x J per computed prompt token "
             "(kvwatt_phase_joules_per_token, measured or prior; methods.md s12).",
        computes="derive.recompute.preemption_recompute_watts",
        section=PHASE_SECTION,
        status=window_key("preemption_recompute_watts", lambda w: w.preemption_recompute_watts),
        bounds=bounds.POWER_PART,
    ),
    MetricDef(
        name="kvwatt_offload_saved_watts", type="gauge", labels=("server", "scope", "window"),
        help="Power offloading saved on an offloading server: reloaded tokens/s x (J per computed - J per reloaded "
             "prompt token), per-phase costs measured or prior (methods.md s12).",
        computes="derive.phase_energy.offload_saved_watts",
        section=PHASE_SECTION,
        status=window_key("offload_saved_watts", lambda w: w.offload_saved_watts),
        words=(Words("energy offloading saved (GPU)", "kwh_per_day", ("offload_saved_watts", "gpu")),),
        bounds=bounds.SAVED_POWER,
    ),
)


# --- the sections' JSON and the sections ----------------------------------------------------------------------------
def _energy_json(w: WindowFigures) -> dict:
    return {"energy": {e.scope: {"joules": e.basis.energy_joules, "idle_joules": e.basis.idle_joules,
                                 "generated_tokens": e.basis.tokens, "seconds": e.basis.seconds,
                                 "loaded_seconds": e.basis.loaded_seconds, "joules_per_token": e.joules_per_token,
                                 "marginal_joules_per_token": e.marginal_joules_per_token} for e in w.energy}}


def _phase_costs_json(v: ServerFigures) -> dict:
    """Per-phase energy costs by scope (methods.md s12): each phase's J/token and SE, and what they rest on."""
    return {"phase_costs": {c.scope: {
        **{p: {"joules_per_token": c.joules(p), "stderr": c.stderr(p)} for p in c.phases},
        "windows": c.windows, "state": c.state, "reason": c.reason, "source": c.source,
        "condition": None if c.condition is None or math.isinf(c.condition) else c.condition}
        for c in v.phase_costs}}


ENERGY_SEC = Section(name=ENERGY_SECTION, metrics=ENERGY, blocks=(
    window_block(("energy",), ("kvwatt_marginal_energy_per_token_joules", "kvwatt_energy_per_token_joules"),
                 _energy_json),
))
PHASE_SEC = Section(name=PHASE_SECTION, metrics=PHASE_COSTS, blocks=(
    server_block(("phase_costs",), ("kvwatt_phase_joules_per_token", "kvwatt_phase_joules_per_token_stderr",
                                    "kvwatt_phase_cost_windows", "kvwatt_phase_cost_source"), _phase_costs_json),
))
