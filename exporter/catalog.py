"""Every figure kvwatt exports, declared once: its series (name, type, labels, HELP), the function that
computes it, where it appears in /api/status and how the landing page words it, side by side.

Derived from these declarations, never copied by hand: the collector (exporter.serve.collector walks
METRICS), /api/status's per-window and per-server figure keys (exporter.serve.web), the landing page's table
of figures per window (exporter.serve.page), and the README's metric reference (exporter.reference). The
alert/dashboard generators refuse a query naming a ``kvwatt_`` series missing from it. To find a metric's
computation: search its name here; ``computes`` is the function itself (tests/test_catalog.py proves it is
really called for its series). Formulas cite docs/methods.md sections.

A fill yields ``(label values in the order of labels, value)``; a None value is left out (unknown, never 0).
A declaration with a ``status`` key fills its series from the same getter as its JSON value; structured JSON
blocks that are not one figure each (energy by scope, savings by baseline, ...) are serialised in
exporter.serve.web, each naming the declarations it serialises; a figure in neither says so with ``Elsewhere``
(tests/test_figures_declared.py walks a real /api/status and proves each key has exactly one owner).

The one exception: /metrics also carries prometheus_client's standard ``process_*`` and ``python_*`` families
(ProcessCollector, PlatformCollector, GCCollector; exporter.serve.collector.runtime_families), which describe the
kvwatt process itself, as every Prometheus client library's do. They are not listed here because their
names, help and labels are the library's, the same in every exporter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

# the modules whose functions compute the figures: each declaration names its function directly
import exporter.bounds
import exporter.build
from exporter import bounds
import exporter.config
import exporter.derive.collapse
import exporter.derive.cost
import exporter.derive.energy
import exporter.derive.kappa
import exporter.derive.offload
import exporter.derive.phase_energy
import exporter.derive.preemption
import exporter.derive.pressure
import exporter.derive.recompute
import exporter.derive.residency
import exporter.derive.threshold
import exporter.energy.baseline
import exporter.model.cost
import exporter.model.energy
import exporter.model.offload
import exporter.model.pressure
import exporter.model.server
import exporter.rules
import exporter.sampler
import exporter.sources.combine
import exporter.sources.engine
import exporter.sources.nvml
import exporter.sources.rapl
import exporter.sources.tariff
import exporter.sources.vllm
from exporter.build import build_info
from exporter.figures import ServerFigures, Snapshot, WindowFigures

Sample = tuple[tuple[str, ...], "float | bool | None"]
Fill = Callable[[Snapshot], Iterable[Sample]]

WINDOW, SERVER = "window", "server"  # scopes of /api/status: servers[].windows.<label>, servers[]


@dataclass(frozen=True)
class StatusKey:
    """Where a figure appears in /api/status: ``key`` in the dict of its scope (WINDOW or SERVER). ``value`` reads
    it from the figures (WindowFigures or ServerFigures) for the JSON and, unless the declaration has a fill of its
    own, for the series; ``json`` when the JSON writes it differently (rounded)."""

    scope: str
    key: str
    value: Callable[[object], object]
    json: Callable[[object], object] | None = None

    def json_value(self, fig) -> object:
        return (self.json or self.value)(fig)


def window_key(key: str, value: Callable[[WindowFigures], object], json=None) -> StatusKey:
    return StatusKey(WINDOW, key, value, json)


def server_key(key: str, value: Callable[[ServerFigures], object], json=None) -> StatusKey:
    return StatusKey(SERVER, key, value, json)


@dataclass(frozen=True)
class Elsewhere:
    """A series with no key among /api/status's per-server and per-window figures, and why."""

    why: str


@dataclass(frozen=True)
class Words:
    """A row of the landing page's table of figures per window: its label, the unit it is formatted in (one of
    exporter.serve.page.FORMATS) and, when the figure's JSON value is a dict, the path to the value shown
    (default: the figure's own key)."""

    label: str
    unit: str
    path: tuple[str, ...] = ()
    absent_when_none: bool = False  # no row when no window has it (a figure the server cannot have, not unknown)


@dataclass(frozen=True)
class MetricDef:
    name: str
    type: str  # "gauge" | "counter" | "info"
    labels: tuple[str, ...]
    help: str
    computes: Callable  # the function (or method) that computes the value
    section: str
    fill: Fill | None = None  # None: derived from status.value (one sample per window or server, or per dict key)
    # where the figure is in /api/status; None: a block of exporter.serve.web names it (the test checks that)
    status: StatusKey | Elsewhere | None = None
    words: tuple[Words, ...] = ()  # rows of the page's table of figures per window
    # what physics and arithmetic allow its values (exporter/bounds.py); checked once per tick before serving
    bounds: "bounds.Bound | None" = None

    def __post_init__(self):
        if self.fill is None:
            if not isinstance(self.status, StatusKey):
                raise ValueError(f"{self.name}: no fill and no status key to derive it from")
            object.__setattr__(self, "fill", _fill_from(self.status, len(self.labels)))

    @property
    def where(self) -> str:
        """The dotted path of ``computes`` under exporter. (the README's "computed in" column)."""
        fn = self.computes.fget if isinstance(self.computes, property) else self.computes
        return f"{fn.__module__.removeprefix('exporter.')}.{fn.__qualname__}"


def _again(w: WindowFigures, attr: str) -> float | None:
    """A field of the window's post-preemption recomputation (None when the window has none)."""
    return getattr(w.preemption_recompute, attr) if w.preemption_recompute is not None else None


def _again_json(r) -> dict | None:
    if r is None:
        return None
    return {"tokens_per_second": r.tokens_per_second, "share": r.share,
            "scheduled_tokens_per_second": r.scheduled_tokens_per_second, "residual_share": r.residual_share,
            "state": r.state, "reason": r.reason}


def _b(v: bool | None) -> float | None:
    return None if v is None else (1.0 if v else 0.0)


def _series(v):
    return _b(v) if isinstance(v, bool) else v


# --- fill helpers: walk the snapshot -------------------------------------------------------------------
def per_server(get: Callable[[ServerFigures], "float | bool | None"]) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            yield (s.name,), _series(get(s))
    return fill


def per_window(get: Callable[[WindowFigures], "float | bool | None"]) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for w in s.windows:
                yield (s.name, w.window), _series(get(w))
    return fill


def per_server_key(get: Callable[[ServerFigures], "dict | None"]) -> Fill:
    """A dict-valued server figure: one sample per key (the second label)."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for key, value in (get(s) or {}).items():
                yield (s.name, key), _series(value)
    return fill


def per_window_key(get: Callable[[WindowFigures], "dict | None"]) -> Fill:
    """A dict-valued window figure: one sample per key (the label between server and window)."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for w in s.windows:
                for key, value in (get(w) or {}).items():
                    yield (s.name, key, w.window), value
    return fill


def _fill_from(status: StatusKey, n_labels: int) -> Fill:
    plain, keyed = (per_window, per_window_key) if status.scope == WINDOW else (per_server, per_server_key)
    one = 2 if status.scope == WINDOW else 1  # labels of a one-value figure: (server, window) or (server,)
    return plain(status.value) if n_labels == one else keyed(status.value)


def _build_info(_snap: Snapshot) -> Iterator[Sample]:
    b = build_info()
    yield (b.version, b.revision, b.python_version), 1.0


def _statuses(snap: Snapshot):
    return [s.status for s in snap.servers] + list(snap.sources)


def _source_up(snap: Snapshot) -> Iterator[Sample]:
    for st in _statuses(snap):
        yield (st.source, st.server), _b(st.up)


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


def _tier_hits(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        for tier, ratio in sorted((s.tiers.hit_ratio or {}).items()):
            yield (s.name, tier), ratio


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


def _evicted_before_reuse(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        for w in s.windows:
            if w.kv_before_reuse_yardstick is not None:
                yield (s.name, w.kv_before_reuse_yardstick, w.window), w.kv_evicted_before_reuse_ratio


def _evidence(w: WindowFigures) -> float | None:
    return {"pressure": 1.0, "low_pressure": 0.0}.get(w.residency_evidence or "")


def _residency_target(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        if s.buffer is not None and s.info and s.info.offload_enabled:
            yield (s.name, s.buffer.residency_target_source), s.buffer.residency_target_seconds


def _tiers(attr: str) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for w in s.windows:
                for t in w.offload_tiers:
                    yield (s.name, t.tier, w.window), _series(getattr(t, attr))
    return fill


def _buffer(attr: str) -> Fill:
    return per_server(lambda s: getattr(s.buffer, attr) if s.buffer and s.info and s.info.offload_enabled else None)


def _located(attr: str) -> Fill:
    """A located threshold's figure, labelled with its method; nothing before there is evidence."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            if s.located is not None:
                yield (s.name, s.located.method), getattr(s.located, attr)
    return fill


def _threshold_in_use(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        yield (s.name, s.threshold_source), s.threshold_in_use


STATES = ("known", "provisional", "unknown")  # a verdict's state (methods.md s10): one series each, 1 for the current
VERDICTS = ("regime", "tax", "reference", "threshold")


def _verdict_states(snap: Snapshot) -> Iterator[Sample]:
    """A stateset: per server and verdict, 1 for its current state and 0 for the others."""
    for s in snap.servers:
        for verdict in VERDICTS:
            now = getattr(s, f"{verdict}_state")
            for state in STATES:
                yield (s.name, verdict, state), 1.0 if state == now else 0.0


def _regime_states(snap: Snapshot) -> Iterator[Sample]:
    """A stateset per window: 1 for the state of the window's regime, 0 for the others."""
    for s in snap.servers:
        for w in s.windows:
            for state in STATES:
                yield (s.name, state, w.window), 1.0 if state == w.regime_state else 0.0


def _conditions(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        if s.collapse is not None:
            for name, value in s.collapse.conditions.items():
                yield (s.name, name), _b(value)


def _condition_sets(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        if s.collapse is not None:
            for name, value in s.collapse.condition_sets.items():
                yield (s.name, name), _b(value)


def _savings(get, throughput: bool = False) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for w in s.windows:
                for sv in w.savings:
                    if not throughput or sv.has_throughput:
                        yield (s.name, sv.baseline, w.window), get(sv)
    return fill


def _currency(snap: Snapshot) -> str:
    p = snap.price("electricity_price")
    return (p.currency if p is not None else None) or ""


def _costs(attr: str, money: bool = False) -> Fill:
    """One sample per server, scope and window of a CostFigure attribute; money series carry the currency."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        currency = (_currency(snap),) if money else ()
        for s in snap.servers:
            for w in s.windows:
                for c in w.costs:
                    yield (s.name, c.scope, w.window, *currency), getattr(c, attr)
    return fill


def _price(quantity: str, with_currency: bool) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        p = snap.price(quantity)
        if p is not None and p.configured:
            yield ((p.currency or "",) if with_currency else ()) + (p.source,), p.value
    return fill


def _price_age(snap: Snapshot) -> Iterator[Sample]:
    for p in snap.prices:
        if p.source == "url":
            yield (p.quantity,), p.age_seconds


PRICES = Elsewhere("host-wide, not a server's figure: /api/status's top-level prices")


def _phase(attr: str) -> Fill:
    """A per-phase cost figure of each scope (methods.md s12): one sample per phase that has a value."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for c in s.phase_costs:
                for phase in exporter.derive.phase_energy.PHASES:
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


DEVICES = Elsewhere("a host-wide device reading (GPU, RAPL zone), not a server's figure: /metrics only")

_H = "Sources"
_E = "Energy"
_K = "KV pressure and recomputation"
_O = "Offloading"
_M = "Money and carbon"

METRICS: tuple[MetricDef, ...] = (
    MetricDef("kvwatt_build_info", "info", ("version", "revision", "python_version"),
              "The running kvwatt: version, source revision (git commit, or unknown) and Python version; "
              "value 1 (as `kvwatt --version` prints them).", exporter.build.build_info, "Exporter", _build_info,
              status=Elsewhere("the running kvwatt, not a server's figure: /api/status's top-level version"),
              bounds=bounds.INFO),
    # --- health of the sources -------------------------------------------------------------------------
    MetricDef("kvwatt_source_up", "gauge", ("source", "server"),
              "1 if the last read of this source succeeded, 0 if not (see kvwatt_source_info for the reason). "
              "server is empty for host-wide sources (nvml, rapl, state_dir: where idle baselines persist).",
              exporter.sampler.Sampler.tick, _H, _source_up,
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_source_info", "info", ("source", "server", "state", "reason"),
              "Why a source is down or degraded: one word from a fixed list (README, Metrics), e.g. timeout, "
              "unreachable, redirect, http_503, parse_error, deadline, permission, absent, gpu_lost, "
              "not_persisted; the details are in /api/status and the log; value 1.",
              exporter.sampler.Sampler.tick, _H, _source_info,
              bounds=bounds.INFO),
    MetricDef("kvwatt_figures_rejected_total", "counter", ("figure", "reason"),
              "Figures served as unknown because they broke their family's declared bound (reason: the bound's "
              "kind: share, power_part, saving, token_rate, priced, ...; exporter/bounds.py), counted once per tick "
              "each; the figure and its inputs are in /api/status's implausible list and the log.",
              exporter.bounds.BoundsCheck.apply, _H, _rejected,
              status=Elsewhere("a count of the bounds check: /api/status lists the figures rejected this tick"),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_sample_duration_seconds", "gauge", ("source", "server"),
              "How long the last read of this source took.", exporter.sampler.Sampler.tick, _H, _sample_duration,
              status=Elsewhere("a read timing: /metrics only"),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_server_info", "info", ("server", "url", "model_name", "offload_backend", "engine"),
              "What kvwatt knows of each watched server: the engine detected from its exposition (vllm, sglang, "
              "trtllm, with +lmcache / +dynamo when those add-ons' series are there, docs/engines.md), the model "
              "and the offload backend (vLLM: from vllm:cache_config_info); value 1.",
              exporter.sources.combine.read_exposition, _H, _server_info,
              bounds=bounds.INFO),
    MetricDef("kvwatt_server_capability", "info", ("server", "capability"),
              "One series per figure group the server's engine supports (kv_usage, preemptions, token_sources, "
              "engine_steps, offload_traffic, offload_occupancy, ...): a kvwatt figure absent for a server "
              "whose engine lacks its capability is absent by design, not missing (docs/engines.md); value 1.",
              exporter.sources.engine.capabilities_of, _H, _capabilities,
              bounds=bounds.INFO),
    MetricDef("kvwatt_window_covered_seconds", "gauge", ("server", "window"),
              "Seconds of gap-free samples the window actually holds (less than the window right after start "
              "or after a server outage).", exporter.model.server.ServerModel.window, _H,
              status=window_key("covered_seconds", lambda w: w.covered_seconds,
                                 json=lambda w: round(w.covered_seconds, 3)),
              words=(Words("covered", "coverage"),),
              bounds=bounds.NON_NEGATIVE),
    # --- energy ---------------------------------------------------------------------------------------
    MetricDef("kvwatt_gpu_energy_joules_total", "counter", ("gpu", "uuid"),
              "GPU energy since kvwatt started watching it (NVML total-energy counter, or integrated instant "
              "power where the counter is missing). rate() gives watts.", exporter.sources.nvml.NvmlSource.read, _E,
              _devices("gpu", lambda d: (_gpu_labels(d), d.reading.joules_total)), status=DEVICES,
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_gpu_energy_method_info", "info", ("gpu", "uuid", "method"),
              "How that GPU's energy is measured: counter or power_integration; value 1.",
              exporter.sources.nvml.NvmlSource.read, _E,
              _devices("gpu", lambda d: ((*_gpu_labels(d), d.reading.method), 1.0)), status=DEVICES,
              bounds=bounds.INFO),
    MetricDef("kvwatt_gpu_power_watts", "gauge", ("gpu", "uuid"),
              "Current board power (NVML power usage; a 1 s trailing average on Ampere and newer).",
              exporter.sources.nvml.NvmlSource.read, _E,
              _devices("gpu", lambda d: (_gpu_labels(d), d.reading.power_watts)), status=DEVICES,
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_host_energy_joules_total", "counter", ("zone", "domain"),
              "RAPL energy of a package or dram zone since kvwatt started watching it, wrap-corrected.",
              exporter.sources.rapl.RaplSource.read, _E,
              _devices("host", lambda d: (_host_labels(d), d.reading.joules_total)), status=DEVICES,
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_gpu_idle_power_watts", "gauge", ("gpu", "uuid"),
              "Idle baseline P_idle of this GPU (learned, measured or configured).",
              exporter.energy.baseline.BaselineBook.get, _E,
              _devices("gpu", lambda d: (_gpu_labels(d), d.baseline.watts if d.baseline else None)), status=DEVICES,
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_host_idle_power_watts", "gauge", ("zone", "domain"),
              "Idle baseline P_idle of this RAPL zone.", exporter.energy.baseline.BaselineBook.get, _E,
              _devices("host", lambda d: (_host_labels(d), d.baseline.watts if d.baseline else None)), status=DEVICES,
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_idle_baseline_age_seconds", "gauge", ("device",),
              "Seconds since that device's idle baseline was measured.", exporter.energy.baseline.Baseline.age_seconds,
              _E, _idle_age, status=DEVICES,
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_marginal_energy_per_token_joules", "gauge", ("server", "scope", "window"),
              "(E - P_idle*dt) / generated tokens over the window (methods.md s1). Absent without >= 30 s of "
              "load or without tokens.", exporter.derive.energy.qualified, _E,
              _energy("marginal_joules_per_token"),
              words=(Words("GPU J/token, marginal", "joules", ("energy", "gpu", "marginal_joules_per_token")),
                     Words("host J/token, marginal", "joules", ("energy", "host", "marginal_joules_per_token"))),
              bounds=bounds.JOULES_PER_TOKEN),
    MetricDef("kvwatt_energy_per_token_joules", "gauge", ("server", "scope", "window"),
              "E / generated tokens over the window, no idle subtraction. Absent without enough load.",
              exporter.derive.energy.qualified, _E, _energy("joules_per_token"),
              words=(Words("GPU J/token, total", "joules", ("energy", "gpu", "joules_per_token")),
                     Words("host J/token, total", "joules", ("energy", "host", "joules_per_token"))),
              bounds=bounds.JOULES_PER_TOKEN),
    MetricDef("kvwatt_prompt_energy_per_token_joules", "gauge", ("server", "source", "window"),
              "Attribution model, not a measurement: marginal GPU joules per prompt token by token source, "
              "pricing reloaded tokens at the configured load/compute cost ratio (docs/energy.md).",
              exporter.derive.energy.prompt_attribution, _E,
              status=window_key("prompt_energy_per_token_joules", lambda w: w.prompt_energy_per_token),
              bounds=bounds.JOULES_PER_TOKEN),
    # --- money and carbon (docs/energy.md): absent unless a price or carbon intensity is configured ---------
    MetricDef("kvwatt_electricity_price_per_kwh", "gauge", ("currency", "source"),
              "The electricity price per kWh in force (source=configured: a number set; source=url: read from "
              "a series URL every price_refresh, absent once older than price_max_age). Absent when not "
              "configured.", exporter.model.cost.Prices.value, _M, _price("electricity_price", True),
              status=PRICES,
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_carbon_intensity_grams_per_kwh", "gauge", ("source",),
              "The grid's carbon intensity in g CO2e per kWh in force (source=configured or url, as the price). "
              "Absent when not configured.", exporter.model.cost.Prices.value, _M,
              _price("carbon_intensity", False), status=PRICES,
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_price_age_seconds", "gauge", ("quantity",),
              "Seconds since the value of a price or carbon-intensity URL (quantity=electricity_price | "
              "carbon_intensity) was read; absent before its first good read.",
              exporter.sources.tariff.PriceTracker.reading, _M, _price_age, status=PRICES,
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_energy_cost_per_million_tokens", "gauge", ("server", "scope", "window", "currency"),
              "The marginal energy (kvwatt_marginal_energy_per_token_joules) of a million generated tokens at "
              "the electricity price, in its currency. Absent without a price or a marginal figure.",
              exporter.derive.cost.money_per_million_tokens, _M, _costs("money_per_million_tokens", True),
              bounds=bounds.MONEY_PER_MILLION_TOKENS),
    MetricDef("kvwatt_co2e_grams_per_thousand_tokens", "gauge", ("server", "scope", "window"),
              "The marginal energy of 1,000 generated tokens in g CO2e at the grid's carbon intensity. Absent "
              "without an intensity or a marginal figure.", exporter.derive.cost.co2e_grams_per_thousand_tokens,
              _M, _costs("co2e_grams_per_thousand_tokens"),
              bounds=bounds.CO2E_PER_THOUSAND_TOKENS),
    MetricDef("kvwatt_marginal_energy_cost_per_day", "gauge", ("server", "scope", "window", "currency"),
              "The window's power above idle, (E - P_idle*dt)/dt, held for a day, at the electricity price: "
              "money per day at this load. Absent without a price or a marginal figure.",
              exporter.derive.cost.money_per_day, _M, _costs("money_per_day", True),
              bounds=bounds.money_per_day("marginal_watts")),
    MetricDef("kvwatt_marginal_co2e_grams_per_day", "gauge", ("server", "scope", "window"),
              "The window's power above idle held for a day, in g CO2e at the grid's carbon intensity. Absent "
              "without an intensity or a marginal figure.", exporter.derive.cost.co2e_grams_per_day, _M,
              _costs("co2e_grams_per_day"),
              bounds=bounds.co2e_per_day("marginal_watts")),
    MetricDef("kvwatt_recompute_tax_cost_per_day", "gauge", ("server", "scope", "window", "currency"),
              "The recomputation tax's power (kvwatt_recompute_tax_watts) held for a day at the electricity "
              "price: what recomputing evicted prompts costs per day at this load. Absent without a price or a "
              "tax figure.", exporter.derive.cost.money_per_day, _M, _costs("recompute_tax_money_per_day", True),
              bounds=bounds.money_per_day("recompute_tax_watts")),
    MetricDef("kvwatt_recompute_tax_co2e_grams_per_day", "gauge", ("server", "scope", "window"),
              "The recomputation tax's power held for a day, in g CO2e at the grid's carbon intensity. Absent "
              "without an intensity or a tax figure.", exporter.derive.cost.co2e_grams_per_day, _M,
              _costs("recompute_tax_co2e_grams_per_day"),
              bounds=bounds.co2e_per_day("recompute_tax_watts")),
    MetricDef("kvwatt_offload_saved_cost_per_day", "gauge", ("server", "scope", "window", "currency"),
              "What offloading saved (kvwatt_offload_saved_watts) held for a day at the electricity price; "
              "negative when a reload cost more than recomputing. Absent without a price or a saving figure.",
              exporter.derive.cost.money_per_day, _M, _costs("offload_saved_money_per_day", True),
              bounds=bounds.money_per_day("offload_saved_watts")),
    MetricDef("kvwatt_offload_saved_co2e_grams_per_day", "gauge", ("server", "scope", "window"),
              "What offloading saved held for a day, in g CO2e at the grid's carbon intensity. Absent without an "
              "intensity or a saving figure.", exporter.derive.cost.co2e_grams_per_day, _M,
              _costs("offload_saved_co2e_grams_per_day"),
              bounds=bounds.co2e_per_day("offload_saved_watts")),
    MetricDef("kvwatt_phase_joules_per_token", "gauge", ("server", "scope", "phase"),
              "Marginal joules per token by phase (prompt_computed: a prompt token the server computed; generated; "
              "reloaded: a prompt token loaded from the offload tier), measured by a non-negative regression of "
              "each repeat window's marginal energy on its token counts over the last phase_history (methods.md "
              "s12); until identifiable, the configured attribution model (see kvwatt_phase_cost_source). "
              "reloaded is absent where the server reloads nothing.",
              exporter.derive.phase_energy.estimate, _E, _phase("j"),
              bounds=bounds.JOULES_PER_TOKEN),
    MetricDef("kvwatt_phase_joules_per_token_stderr", "gauge", ("server", "scope", "phase"),
              "Standard error of kvwatt_phase_joules_per_token from the regression's residual variance; absent "
              "for the prior and for a cost pinned at 0.", exporter.derive.phase_energy.estimate, _E,
              _phase("se"),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_phase_cost_windows", "gauge", ("server", "scope"),
              "Repeat windows the per-phase costs rest on.", exporter.model.energy.PhaseLearner.observe, _E,
              _phase_windows,
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_phase_cost_source", "info", ("server", "scope", "source", "state"),
              "Which per-phase costs are in use: source=measured (state=known) or source=prior (the configured "
              "attribution model; state=not_identifiable with the reason in /api/status, or unknown); value 1.",
              exporter.derive.phase_energy.estimate, _E, _phase_source,
              bounds=bounds.INFO),
    MetricDef("kvwatt_recompute_tax_watts", "gauge", ("server", "scope", "window"),
              "Power spent recomputing the recomputation tax's prompt tokens: tax share x prompt tokens/s x J per "
              "computed prompt token (kvwatt_phase_joules_per_token, measured or prior), methods.md s12. "
              "x 24 h / 1000 = kWh per day.", exporter.derive.phase_energy.recompute_tax_watts, _E,
              status=window_key("recompute_tax_watts", lambda w: w.recompute_tax_watts),
              words=(Words("recomputation energy (GPU)", "kwh_per_day", ("recompute_tax_watts", "gpu")),
                     Words("recomputation energy (host)", "kwh_per_day", ("recompute_tax_watts", "host"))),
              bounds=bounds.POWER_PART),
    MetricDef("kvwatt_recompute_energy_share_ratio", "gauge", ("server", "scope", "window"),
              "kvwatt_recompute_tax_watts over the scope's marginal power (E - P_idle*dt)/dt in the window "
              "(alert KVRecomputeEnergyHigh; methods.md s12).", exporter.derive.energy.tax_in_energy, _E,
              status=window_key("recompute_energy_share", lambda w: w.recompute_energy_share),
              words=(Words("recomputation share of GPU energy", "percent", ("recompute_energy_share", "gpu")),),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_offload_saved_watts", "gauge", ("server", "scope", "window"),
              "Power offloading saved on an offloading server: reloaded tokens/s x (J per computed - J per "
              "reloaded prompt token), per-phase costs measured or prior (methods.md s12).",
              exporter.derive.phase_energy.offload_saved_watts, _E,
              status=window_key("offload_saved_watts", lambda w: w.offload_saved_watts),
              words=(Words("energy offloading saved (GPU)", "kwh_per_day", ("offload_saved_watts", "gpu")),),
              bounds=bounds.SAVED_POWER),
    # --- KV pressure and recomputation ------------------------------------------------------------------
    MetricDef("kvwatt_kv_capacity_tokens", "gauge", ("server",),
              "The engine's KV-cache pool in tokens as the engine states it (vllm:cache_config_info "
              "kv_cache_size_tokens, 0.32+; sglang:max_total_num_tokens; trtllm_kv_cache_max_blocks x "
              "trtllm_kv_cache_tokens_per_block): the whole the KV-usage ratios are shares of. Absent where the "
              "engine states none.", exporter.sources.vllm.extract, _K,
              status=server_key("kv_capacity_tokens", lambda s: s.info.kv_capacity_tokens if s.info else None),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_kv_cache_usage_p95_ratio", "gauge", ("server", "window"),
              "95th percentile of the engine's KV-cache usage (vllm:kv_cache_usage_perc, sglang:token_usage, "
              "trtllm_kv_cache_utilization) over the window from kvwatt's dense samples (methods.md s3); a 15 s "
              "scrape misses the peaks.", exporter.derive.pressure.kv_usage_quantile, _K,
              status=window_key("kv_usage_p95", lambda w: w.kv_usage_p95),
              words=(Words("KV-cache usage p95", "percent"),),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_cache_usage_max_ratio", "gauge", ("server", "window"),
              "Maximum of the engine's KV-cache usage over the window from dense samples.",
              exporter.derive.pressure.kv_usage_quantile, _K,
              status=window_key("kv_usage_max", lambda w: w.kv_usage_max),
              words=(Words("KV-cache usage max", "percent"),),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_pressure_threshold_ratio", "gauge", ("server",),
              f"The configured KV-pressure regime threshold on p95 usage (default "
              f"{exporter.rules.KV_PRESSURE_THRESHOLD.default:.2f}, methods.md s3).",
              exporter.config.resolve, _K, status=server_key("threshold", lambda s: s.threshold),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_cache_usage_p95_lower_ratio", "gauge", ("server", "window"),
              "Lower bound of the ~95 % order-statistic interval of the window's p95 KV usage (methods.md s10; "
              "assumes independent samples, so the real uncertainty is larger).",
              exporter.derive.threshold.quantile_bounds, _K, per_window(lambda w: w.kv_usage_p95_low),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_cache_usage_p95_upper_ratio", "gauge", ("server", "window"),
              "Upper bound of the ~95 % order-statistic interval of the window's p95 KV usage (methods.md s10).",
              exporter.derive.threshold.quantile_bounds, _K, per_window(lambda w: w.kv_usage_p95_high),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_pressure_threshold_located_ratio", "gauge", ("server", "method"),
              "KV-p95 threshold located from this server's own history: the p95 cut between clean windows and "
              "windows with sustained preemptions (method=preemption_onset) or a recomputation tax above noise "
              "(method=tax_onset), methods.md s10. Absent until the evidence is there.",
              exporter.derive.threshold.locate, _K, _located("ratio"),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_pressure_threshold_located_low_ratio", "gauge", ("server", "method"),
              "Lower end of the located threshold's interval: the highest clean window's p95 (its lower bound).",
              exporter.derive.threshold.locate, _K, _located("low"),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_pressure_threshold_located_high_ratio", "gauge", ("server", "method"),
              "Upper end of the located threshold's interval: the lowest pressured window's p95 (its upper bound).",
              exporter.derive.threshold.locate, _K, _located("high"),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_pressure_threshold_located_windows", "gauge", ("server", "method"),
              "Number of evidence windows (threshold_window each, clean or pressured) the located threshold "
              "rests on.", exporter.derive.threshold.locate, _K, _located("points"),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_kv_pressure_threshold_in_use_ratio", "gauge", ("server", "source"),
              "The threshold the regime's prediction uses (it never overrules a sign the engine shows): "
              "source=located once located (kv_pressure_threshold_source: located), else source=configured.", exporter.model.pressure.ThresholdLearner.observe, _K,
              _threshold_in_use,
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_pressure_above_threshold", "gauge", ("server", "window"),
              "The window's KV-pressure regime: 1 on any sign of pressure the engine shows (requests waiting for "
              "KV capacity, preemptions, a recompute tax above noise, KV-block residency), whatever the threshold "
              "in use; 0 only on positive signs of low pressure; else the threshold's prediction (1 when the p95's "
              "lower bound clears it) or absent (unknown). Its state is kvwatt_kv_pressure_regime_state "
              "(methods.md s10).",
              exporter.model.pressure.verdict, _K, status=window_key("above_threshold", lambda w: w.above_threshold),
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_kv_pressure_regime_state", "gauge", ("server", "state", "window"),
              "State of the window's regime verdict (kvwatt_kv_pressure_above_threshold), a stateset: 1 for its "
              "current state (known, provisional, unknown), 0 for the others; the why is in /api/status "
              "(windows.<window>.regime). Read the regime with its state: a provisional one may still change, an "
              "unknown one has no value (methods.md s10).",
              exporter.model.pressure.verdict, _K, _regime_states,
              status=window_key("regime", lambda w: {"state": w.regime_state, "reason": w.regime_reason}),
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_verdict_state", "gauge", ("server", "verdict", "state"),
              "State of each of the server's learned verdicts, a stateset: verdict=regime (the shortest window with "
              "one, as /api/status regime), tax (kvwatt_recompute_tax_ratio), reference "
              "(kvwatt_recompute_reference_share_ratio), threshold (kvwatt_kv_pressure_threshold_located_ratio); 1 "
              "for the current state (known, provisional, unknown), 0 for the others (methods.md s10).",
              exporter.model.server.ServerModel.figures, _K, _verdict_states,
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_requests_waiting_for_kv_capacity", "gauge", ("server", "window"),
              "Requests waiting because the KV cache has no room for them, averaged over the window's samples, from "
              "vllm:num_requests_waiting_by_reason{reason=\"capacity\"} (vLLM 0.20+): the most direct sign of KV "
              "pressure (methods.md s10). Absent where the engine does not export it.",
              exporter.derive.pressure.waiting_for_capacity, _K,
              status=window_key("requests_waiting_for_kv_capacity", lambda w: w.requests_waiting_for_kv_capacity),
              words=(Words("requests waiting for KV capacity (mean)", "number", absent_when_none=True),),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_requests_waiting_for_kv_capacity_samples_ratio", "gauge", ("server", "window"),
              "Share of the window's samples with at least one request waiting for KV capacity (vLLM 0.20+): in "
              "most samples (>= 0.5) it is known pressure, in any it rules out low pressure (methods.md s10).",
              exporter.derive.pressure.waiting_for_capacity, _K,
              status=window_key("requests_waiting_for_kv_capacity_share",
                                lambda w: w.requests_waiting_for_kv_capacity_share),
              words=(Words("samples with requests waiting for KV capacity", "percent", absent_when_none=True),),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_pools_above_threshold", "gauge", ("server", "window"),
              "Number of the server's KV pools (data-parallel ranks, a router's workers: docs/engines.md) whose "
              "own p95 usage over the window is above the threshold in use. Absent for a server with one pool; "
              "kvwatt_kv_cache_usage_p95_ratio is the fullest pool's.",
              exporter.derive.pressure.pools_above_threshold, _K,
              status=window_key("kv_pools_above_threshold", lambda w: w.kv_pools_above_threshold),
              words=(Words("KV pools above threshold", "number", absent_when_none=True),),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_preemptions_per_minute", "gauge", ("server", "window"),
              "Preemptions per minute over the window, from vllm:num_preemptions_total deltas (SGLang: "
              "retractions, sglang:num_retracted_requests_total; absent for engines without such a counter).",
              exporter.derive.pressure.rate_per_second, _K,
              status=window_key("preemptions_per_minute", lambda w: w.preemptions_per_minute),
              words=(Words("preemptions per minute", "number"),),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_preemption_onset", "gauge", ("server", "window"),
              f"1 when preemptions are sustained at >= the onset rate (default "
              f"{exporter.rules.PREEMPTION_ONSET_PER_MINUTE.default:g}/min, methods.md s3).",
              exporter.derive.pressure.preemption_onset, _K,
              status=window_key("preemption_onset", lambda w: w.preemption_onset),
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_generation_tokens_per_second", "gauge", ("server", "window"),
              "Generated tokens per second over the window.", exporter.derive.pressure.rate_per_second, _K,
              status=window_key("generation_tokens_per_second", lambda w: w.generation_tokens_per_second),
              words=(Words("generated tokens/s", "number"),),
              bounds=bounds.TOKEN_RATE),
    MetricDef("kvwatt_prompt_token_share_ratio", "gauge", ("server", "source", "window"),
              "Share of prompt tokens by source (local_compute, local_cache_hit, external_kv_transfer) over the "
              "window; sums to 1. vLLM < 0.16: estimated from prefix-cache counters. First prefills only: "
              "re-prefill after preemption is not counted (see kvwatt_estimated_flops_per_generated_token).",
              exporter.derive.recompute.token_shares, _K,
              status=window_key("prompt_token_shares", lambda w: w.token_shares),
              words=(Words("prompt tokens recomputed", "percent", ("prompt_token_shares", "local_compute")),
                     Words("prompt tokens from prefix cache", "percent",
                           ("prompt_token_shares", "local_cache_hit")),
                     Words("prompt tokens reloaded (offload)", "percent",
                           ("prompt_token_shares", "external_kv_transfer"))),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_cached_prompt_token_share_ratio", "gauge", ("server", "tier", "window"),
              "Share of the prompt tokens served from a cache by the tier that supplied them (device, host, "
              "disk, p2p, external) over the window; sums to 1 (vllm:prompt_tokens_cached_by_source_total, "
              "0.32+): a reload from host memory and one from disk are told apart.",
              exporter.derive.recompute.cached_tier_shares, _K,
              status=window_key("cached_prompt_token_shares", lambda w: w.cached_tier_shares),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_preemptions_per_request", "gauge", ("server", "percentile", "window"),
              "Preemptions per request finished in the window at the percentile (p50, p99), from the histogram "
              "vllm:request_num_preemptions (0.30+): the upper edge of the bucket holding it (at most this "
              "many; vLLM's first bucket holds 0 and 1 together); absent above the largest bucket.",
              exporter.derive.preemption.quantiles, _K,
              status=window_key("preemptions_per_request", lambda w: w.preemptions_per_request),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_preempted_requests_ratio", "gauge", ("server", "bound", "window"),
              "Share of the requests finished in the window that were preempted at least once, as a lower and "
              "an upper bound (equal when the histogram's buckets and sum tell it exactly), from "
              "vllm:request_num_preemptions (0.30+).", exporter.derive.preemption.preempted_share, _K,
              status=window_key("preempted_requests_share", lambda w: w.preempted_requests_share),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_preemptions_by_reason_per_minute", "gauge", ("server", "reason", "window"),
              "Preemptions per minute over the window by reason (kv_full, priority, prefix_cache_reset) where "
              "vLLM exports vllm:num_preemptions_by_reason_total (vLLM PR #58037, not in a release yet): only "
              "kv_full is KV pressure.", exporter.derive.pressure.labelled_per_minute, _K,
              status=window_key("preemptions_by_reason_per_minute", lambda w: w.preemptions_by_reason_per_minute),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_admission_rejections_per_minute", "gauge", ("server", "reason", "window"),
              "Requests refused at admission per minute over the window, by reason (a queue limit: "
              "max_num_queued_reqs, max_num_queued_tokens), from vllm:admission_rejections_total (0.32+).",
              exporter.derive.pressure.labelled_per_minute, _K, status=window_key("admission_rejections_per_minute",
                                                    lambda w: w.admission_rejections_per_minute),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_requests_in_kv_fetch", "gauge", ("server", "stage"),
              "Requests in an asynchronous KV fetch, by stage (waiting_to_start, in_progress, completed_waiting) at "
              "the last read, from vllm:num_requests_kv_fetch_by_stage (0.32, with a connector that loads KV): not "
              "requests waiting for KV capacity (kvwatt_requests_waiting_for_kv_capacity). Requests held "
              "in_progress while nothing runs point at the async-load stall (vLLM #57841).",
              exporter.sources.vllm.extract, _K,
              status=server_key("requests_in_kv_fetch", lambda s: s.kv_fetch_waiting),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_recompute_tax_ratio", "gauge", ("server", "window"),
              "local_compute share minus this server's low-pressure reference share (methods.md s4).",
              exporter.derive.recompute.recompute_tax, _K,
              status=window_key("recompute_tax", lambda w: w.recompute_tax),
              words=(Words("recompute tax (points)", "points"),),
              bounds=bounds.SHARE_DIFFERENCE),
    MetricDef("kvwatt_recompute_reference_share_ratio", "gauge", ("server",),
              "The low-pressure local_compute reference share the tax is measured against (learned or "
              "configured). Learned from windows of true low pressure only: no preemption, no tax above "
              "noise, p95 well under the threshold in use (methods.md s10); persisted in the state directory.",
              exporter.model.pressure.LowPressureReference.offer, _K,
              status=server_key("reference_local_compute_share", lambda s: s.reference_share),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_recompute_reference_windows", "gauge", ("server",),
              "Number of low-pressure windows (threshold_window each) the learned reference share rests on; 0 "
              "when configured.", exporter.model.pressure.LowPressureReference.offer, _K,
              per_server(lambda s: s.reference_windows),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_estimated_flops_per_second", "gauge", ("server", "window"),
              "FLOP/s vLLM estimated for the tokens it actually scheduled (MFU counters, --enable-mfu-metrics); "
              "includes re-prefill after preemption, which the token counters miss.",
              exporter.derive.recompute.mfu_view, _K,
              status=window_key("estimated_flops_per_second", lambda w: w.flops_per_second),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_estimated_flops_per_generated_token", "gauge", ("server", "window"),
              "Estimated FLOPs per generated token over the window (MFU counters): rises with every kind of "
              "recomputation, preemption re-prefill included.", exporter.derive.recompute.mfu_view, _K,
              status=window_key("estimated_flops_per_generated_token", lambda w: w.flops_per_generated_token),
              words=(Words("FLOPs per generated token (estimated)", "gigaflops"),),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_preemption_recompute_tokens_per_second", "gauge", ("server", "window"),
              "Tokens computed again after a preemption (a resumed request's prompt and generated context), per "
              "second: every token vLLM scheduled (its write-traffic estimate, --enable-mfu-metrics, over the "
              "model's bytes per token from config.json) less the first prefills and generated tokens its counters "
              "see (methods.md s4). vLLM 0.16+ counts prompt tokens by source on first prefills only, so the "
              "recomputation tax misses this work. State and reason in /api/status.",
              exporter.derive.recompute.preemption_recompute, _K,
              status=window_key("preemption_recompute", lambda w: _again(w, "tokens_per_second"),
                                json=lambda w: _again_json(w.preemption_recompute)),
              bounds=bounds.TOKEN_RATE),
    MetricDef("kvwatt_preemption_recompute_share_ratio", "gauge", ("server", "window"),
              "The post-preemption recomputation's share of the tokens the engine scheduled in the window "
              "(kvwatt_preemption_recompute_tokens_per_second over all scheduled tokens/s, methods.md s4).",
              exporter.derive.recompute.preemption_recompute, _K,
              status=window_key("preemption_recompute_share", lambda w: _again(w, "share")),
              words=(Words("recomputed after preemption (of scheduled tokens)", "percent"),),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_preemption_recompute_watts", "gauge", ("server", "scope", "window"),
              "Power spent on the post-preemption recomputation: its tokens/s x J per computed prompt token "
              "(kvwatt_phase_joules_per_token, measured or prior; methods.md s12).",
              exporter.derive.recompute.preemption_recompute_watts, _E,
              status=window_key("preemption_recompute_watts", lambda w: w.preemption_recompute_watts),
              bounds=bounds.POWER_PART),
    # --- offloading ------------------------------------------------------------------------------------
    MetricDef("kvwatt_offload_enabled", "gauge", ("server",),
              "1 when the server offloads KV to host memory (vLLM: cache_config_info or offload series; SGLang "
              "HiCache, TensorRT-LLM host tier, LMCache, Dynamo KVBM series: docs/engines.md).",
              exporter.sources.vllm.extract, _O,
              status=server_key("offload_enabled", lambda s: s.info.offload_enabled if s.info else None),
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_offload_buffer_bytes", "gauge", ("server",),
              "Configured host offload buffer (kv_offloading_size GiB, or kv_offload_config_info on 0.33).",
              exporter.sources.vllm.extract, _O,
              status=server_key("offload_buffer_bytes", lambda s: s.info.offload_buffer_bytes if s.info else None),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_write_bytes_per_second", "gauge", ("server", "window"),
              "Store rate GPU -> offload tier over the window.", exporter.derive.offload.transfer_rates, _O,
              status=window_key("offload_write_bytes_per_second", lambda w: w.offload_write_bytes_per_second),
              words=(Words("offload writes", "bytes_per_second"),),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_read_bytes_per_second", "gauge", ("server", "window"),
              "Load rate offload tier -> GPU over the window.", exporter.derive.offload.transfer_rates, _O,
              status=window_key("offload_read_bytes_per_second", lambda w: w.offload_read_bytes_per_second),
              words=(Words("offload reads", "bytes_per_second"),),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_write_tokens_per_second", "gauge", ("server", "window"),
              "Offload stores counted in tokens over the window (engines that count tokens: SGLang HiCache "
              "evictions to host, LMCache stored tokens, Dynamo KVBM blocks x block size).",
              exporter.derive.offload.token_rates, _O,
              status=window_key("offload_write_tokens_per_second", lambda w: w.offload_write_tokens_per_second),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_read_tokens_per_second", "gauge", ("server", "window"),
              "Offload loads counted in tokens over the window (SGLang load-back, LMCache hits retrieved, "
              "Dynamo KVBM matched tokens).", exporter.derive.offload.token_rates, _O,
              status=window_key("offload_read_tokens_per_second", lambda w: w.offload_read_tokens_per_second),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_buffer_used_ratio", "gauge", ("server",),
              "Offload buffer occupancy as the engine last reported it: used / capacity (SGLang "
              "hicache_host_used_tokens / hicache_host_total_tokens, TensorRT-LLM kv_cache_host_utilization). "
              "Never vLLM's kv_offload_cpu_cache_usage_perc, which is the share pinned by transfers.",
              exporter.derive.offload.tier_state, _O,
              status=server_key("offload_buffer_used_ratio", lambda s: s.tiers.used_ratio),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_offload_buffer_used_bytes", "gauge", ("server",),
              "Bytes of KV held in the offload buffer as the engine last reported them (LMCache "
              "local_cache_usage, summed over workers; LMCache exports no capacity, so no ratio).",
              exporter.derive.offload.tier_state, _O,
              status=server_key("offload_buffer_used_bytes", lambda s: s.tiers.used_bytes),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_tier_hit_ratio", "gauge", ("server", "tier"),
              "The engine's own recent hit rate of an offload tier (host, disk), as last reported (Dynamo "
              "KVBM's sliding window).", exporter.derive.offload.tier_state, _O, _tier_hits,
              status=server_key("offload_tier_hit_ratio", lambda s: s.tiers.hit_ratio),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_offload_buffer_residency_seconds", "gauge", ("server", "window"),
              "Buffer bytes / write rate: how long an offloaded block survives (methods.md s6); in tokens for "
              "an engine that counts them (SGLang HiCache host pool / tokens backed up to it per second).",
              exporter.derive.offload.residency, _O,
              status=window_key("offload_buffer_residency_seconds", lambda w: w.offload_buffer_residency_seconds),
              words=(Words("buffer residency", "seconds"),),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_tier_write_bytes_per_second", "gauge", ("server", "tier", "window"),
              "vLLM tiering (0.28+): bytes/s written from the primary CPU tier to a secondary tier (tier = "
              '"<index>:<type>", e.g. "1:fs") over the window (vllm:kv_offload_tiering_write_bytes_total).',
              exporter.derive.offload.tier_flows, _O, _tiers("write_bytes_per_second"),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_tier_read_bytes_per_second", "gauge", ("server", "tier", "window"),
              "vLLM tiering: bytes/s read from a secondary tier back into the primary tier (promotions) over "
              "the window (vllm:kv_offload_tiering_read_bytes_total).", exporter.derive.offload.tier_flows, _O,
              _tiers("read_bytes_per_second"),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_tier_chunk_hit_ratio", "gauge", ("server", "tier", "window"),
              "vLLM tiering: chunk lookups that hit in the tier / lookups sent to it over the window.",
              exporter.derive.offload.tier_flows, _O, _tiers("chunk_hit_ratio"),
              bounds=bounds.SHARE),
    MetricDef("kvwatt_offload_tier_job_failures", "gauge", ("server", "tier", "window"),
              "vLLM tiering: failed promotion (read) and cascade (write) jobs of the tier in the window.",
              exporter.derive.offload.tier_flows, _O, _tiers("job_failures"),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_tier_residency_seconds", "gauge", ("server", "tier", "window"),
              "vLLM tiering: the tier's configured capacity (servers[].offload_tier_bytes: vLLM exports none) / "
              "its write rate: how long a block written to it survives (methods.md s6).",
              exporter.derive.offload.tier_flows, _O, _tiers("residency_seconds"),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_offload_tier_undersized", "gauge", ("server", "tier", "window"),
              "vLLM tiering: 1 when the tier's residency is below the p99 tool-call latency or one of its "
              "promotion or cascade jobs failed in the window (the CPU tier's flag is "
              "kvwatt_offload_buffer_undersized).", exporter.derive.offload.tier_flows, _O, _tiers("undersized"),
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_offload_buffer_undersized", "gauge", ("server",),
              "1 when residency is below the configured p99 tool-call latency, or stores fail.",
              exporter.derive.offload.undersized, _O, _buffer("undersized"),
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_offload_recommended_buffer_bytes", "gauge", ("server",),
              "Buffer size that keeps residency above the p99 tool-call latency with the configured headroom.",
              exporter.derive.offload.recommended_buffer, _O, _buffer("recommended_bytes"),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_collapse_signature", "gauge", ("server",),
              "1 while the collapse signature holds (methods.md s5): one of its condition sets holds "
              "(kvwatt_collapse_condition_set says which).",
              exporter.derive.collapse.evaluate_aggregates, _O,
              per_server(lambda s: _b(s.collapse.signature) if s.collapse else None),
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_collapse_condition_set", "gauge", ("server", "condition_set"),
              "Each condition set of the collapse signature: stalled_engine (engine steps stopped while "
              "requests are pending; only where the engine exports a step counter) and classic (all five "
              "throughput conditions). 1 holds, 0 not; absent while unknown.",
              exporter.derive.collapse.evaluate_aggregates, _O, _condition_sets,
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_collapse_condition", "gauge", ("server", "condition"),
              "Each collapse condition on its own: offload_enabled, zero_preemptions, throughput_collapsed, "
              "power_near_idle, requests_pending (classic), engine_steps_stopped (stalled_engine, with "
              "requests_pending).", exporter.derive.collapse.evaluate_aggregates, _O, _conditions,
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_energy_saving_ratio", "gauge", ("server", "baseline", "window"),
              "dE as a ratio (0.26 = 26 % less energy per token with offloading, methods.md s2). "
              "baseline=estimated is a model estimate, baseline=potential the saving a server without "
              "offloading would see with it (a model estimate too), see docs/offload.md.",
              exporter.model.offload.savings, _O, _savings(lambda sv: sv.energy_saving),
              bounds=bounds.SAVING),
    MetricDef("kvwatt_energy_saving_stderr_ratio", "gauge", ("server", "baseline", "window"),
              "Standard error of dE (delta method, methods.md s2), where there are repeats.",
              exporter.model.offload.savings, _O, _savings(lambda sv: sv.energy_saving_stderr),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_throughput_gain_ratio", "gauge", ("server", "baseline", "window"),
              "dTPS as a ratio (methods.md s2).", exporter.model.offload.savings, _O,
              _savings(lambda sv: sv.throughput_gain, throughput=True),
              bounds=bounds.GAIN),
    MetricDef("kvwatt_throughput_gain_stderr_ratio", "gauge", ("server", "baseline", "window"),
              "Standard error of dTPS, where there are repeats.", exporter.model.offload.savings, _O,
              _savings(lambda sv: sv.throughput_gain_stderr, throughput=True),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_comparison_windows", "gauge", ("server", "baseline", "window"),
              "Number of windows the dE/dTPS comparison rests on.", exporter.model.offload.savings, _O,
              _savings(lambda sv: sv.windows if sv.energy_saving is not None else None),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_cached_to_prefill_ratio", "gauge", ("server", "window"),
              "kappa observed: external_kv_transfer / local_compute prompt tokens over the window "
              "(methods.md s7).", exporter.derive.kappa.observed, _O,
              status=window_key("cached_to_prefill_ratio", lambda w: w.cached_to_prefill_ratio),
              words=(Words("cached-to-prefill ratio (kappa)", "number"),),
              bounds=bounds.UNBOUNDED_RATIO),
    MetricDef("kvwatt_critical_cached_to_prefill_ratio", "gauge", ("server",),
              "kappa_crit from model and hardware parameters (roofline form, methods.md s7).",
              exporter.derive.kappa.critical, _O, per_server(lambda s: s.kappa.critical),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_recompute_breakeven_tokens", "gauge", ("server",),
              "Sequence length above which reloading KV beats recomputing it (Tetris form with GQA width, "
              "methods.md s7).", exporter.derive.kappa.breakeven, _O, per_server(lambda s: s.kappa.breakeven_tokens),
              bounds=bounds.NON_NEGATIVE),
    # --- KV-block residency (vLLM --kv-cache-metrics, methods.md s11) ------------------------------------
    MetricDef("kvwatt_kv_block_evictions_per_second", "gauge", ("server", "window"),
              "KV blocks evicted per second over the window: sampled evictions "
              "(vllm:kv_block_idle_before_evict_seconds_count, vLLM --kv-cache-metrics) / the configured "
              "servers[].kv_cache_metrics_sample (the engine's --kv-cache-metrics-sample, default 0.01).",
              exporter.derive.residency.window_residency, _K,
              status=window_key("kv_evicted_blocks_per_second", lambda w: w.kv_evicted_blocks_per_second),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_kv_block_evictions_per_prompt_block_ratio", "gauge", ("server", "window"),
              "KV blocks evicted per prompt block processed (prompt tokens / block size) over the window "
              "(methods.md s11): >= 0.25 with the evictions before reuse is pressure evidence, <= 0.1 "
              "low-pressure evidence.", exporter.derive.residency.window_residency, _K,
              status=window_key("kv_evictions_per_prompt_block", lambda w: w.kv_evictions_per_prompt_block),
              words=(Words("KV blocks evicted per prompt block", "number"),),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_kv_block_idle_before_evict_seconds", "gauge", ("server", "percentile", "window"),
              "How long evicted KV blocks sat unused before eviction, at the percentile (p50, p99) over the "
              "window: the upper edge of the bucket of vllm:kv_block_idle_before_evict_seconds holding it.",
              exporter.derive.residency.quantiles, _K,
              status=window_key("kv_idle_before_evict_seconds", lambda w: w.kv_idle_before_evict_seconds),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_kv_block_reuse_gap_seconds", "gauge", ("server", "percentile", "window"),
              "Time between consecutive accesses of a KV block, at the percentile (p50, p99) over the window, "
              "from vllm:kv_block_reuse_gap_seconds (upper bucket edge). Only blocks reused before their eviction "
              "are seen: the gaps the cache survived.", exporter.derive.residency.quantiles, _K,
              status=window_key("kv_reuse_gap_seconds", lambda w: w.kv_reuse_gap_seconds),
              bounds=bounds.NON_NEGATIVE),
    MetricDef("kvwatt_kv_block_evicted_before_reuse_ratio", "gauge", ("server", "yardstick", "window"),
              "Share of the window's KV-block evictions that came before the block's reuse was due: idle at most "
              "the reuse-gap p50 (yardstick=reuse_gap_p50, with >= 10 gaps in the window) or the configured p99 "
              "tool-call latency (yardstick=p99_tool_latency); methods.md s11.",
              exporter.derive.residency.window_residency, _K, _evicted_before_reuse,
              bounds=bounds.SHARE),
    MetricDef("kvwatt_kv_block_residency_pressure_evidence", "gauge", ("server", "window"),
              "The engine's own eviction record as KV-pressure evidence over the window (methods.md s11): 1 = "
              "pressure (evictions per prompt block >= 0.25, mostly before reuse), 0 = low pressure (<= 0.1); "
              "absent when unknown (no --kv-cache-metrics, too few prompt blocks for the sample share, between).",
              exporter.derive.residency.residency_evidence, _K, per_window(_evidence),
              bounds=bounds.BOOLEAN),
    MetricDef("kvwatt_offload_buffer_residency_target_seconds", "gauge", ("server", "source"),
              "The residency the offload buffer must outlast in kvwatt_offload_buffer_undersized and "
              "kvwatt_offload_recommended_buffer_bytes: the measured KV-block reuse-gap p99 (source=reuse_gap_p99, "
              "vLLM --kv-cache-metrics) or the configured p99 tool-call latency (source=p99_tool_latency).",
              exporter.model.offload.residency_target, _O, _residency_target,
              bounds=bounds.NON_NEGATIVE),
)

BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}


def get(name: str) -> MetricDef:
    return BY_NAME[name]

