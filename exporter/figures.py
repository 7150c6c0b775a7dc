"""Typed figures: everything kvwatt knows at one tick, computed once by exporter.model and only read after.

/metrics, /api/status and the landing page (exporter.serve) serialise the same Snapshot, each through the
figure's one declaration in exporter.catalog, so they always agree. None means unknown: the exposition omits
the series and the JSON says null, never a fake 0. Frozen: a scrape cannot change what it reads.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Callable

from exporter import rules
from exporter.idle.baseline import Baseline
from exporter.results import (
    PHASES,  # noqa: F401 (for the catalog)
    CollapseResult,
    Evidence,
    LocatedThreshold,
    PhaseCosts,
    PreemptionRecompute,
    TierEnergy,
    TierFlows,
    TierState,
)
from exporter.samples import DeviceReading, EngineInfo, SourceStatus

if TYPE_CHECKING:  # a type only: its properties are formulas (derive/marginal.py), which serving never loads
    from exporter.derive.energy import EnergyPerToken

UNKNOWN_ENGINE = "unknown"  # a server never read yet: no exposition has said which engine it runs


def engine_name(last_read: str | None) -> str:
    """The engine a server runs, for every renderer: the engine of its last successful read (kept while it
    is down: a restart does not change the engine), "unknown" before the first."""
    return last_read or UNKNOWN_ENGINE


@dataclass(frozen=True)
class EnergyFigure:
    """One scope's J/token over a window (methods.md s1); ``basis`` is what it rests on (for /api/status)."""

    scope: str  # gpu | host
    basis: EnergyPerToken
    joules_per_token: float | None  # None: not enough load or tokens (the basis is still reported)
    marginal_joules_per_token: float | None


@dataclass(frozen=True, kw_only=True)
class CostFigure:
    """One scope's marginal energy in money and carbon over a window (derive/cost.py, docs/energy.md). None:
    unknown (no marginal energy figure) or not configured (no price, no carbon intensity)."""

    scope: str  # gpu | host
    marginal_watts: float | None  # (E - P_idle*dt) / dt: the power the money and CO2 per day hold for a day
    money_per_million_tokens: float | None
    co2e_grams_per_thousand_tokens: float | None
    money_per_day: float | None
    co2e_grams_per_day: float | None
    currency: str | None = None  # of the money figures (the configured electricity_currency)
    # the recomputation tax and what offloading saved (kvwatt_recompute_tax_watts, kvwatt_offload_saved_watts,
    # methods.md s12), each held for a day at the price and the carbon intensity
    recompute_tax_money_per_day: float | None = None
    recompute_tax_co2e_grams_per_day: float | None = None
    offload_saved_money_per_day: float | None = None
    offload_saved_co2e_grams_per_day: float | None = None


@dataclass(frozen=True, kw_only=True)
class PriceFigure:
    """The electricity price or the carbon intensity in force: configured, read from a URL, or not configured."""

    quantity: str  # electricity_price | carbon_intensity
    value: float | None  # per kWh (price, in ``currency``) or g CO2e per kWh; None: not configured or unknown
    source: str  # configured | url | not_configured
    currency: str | None = None  # the price's ISO 4217 code
    url: str | None = None  # password masked, with its #series
    age_seconds: float | None = None  # since the URL's value was read
    reason: str = ""  # why a URL's value is unknown or degraded

    @property
    def configured(self) -> bool:
        return self.source != "not_configured"


NOISE_STDERRS = rules.NOISE_STDERRS.default  # a dE within two standard errors of zero is "within noise"


@dataclass(frozen=True, kw_only=True)
class SavingFigure:
    """dE and dTPS of offloading against one baseline kind (methods.md s2)."""

    baseline: str  # paired | recorded | estimated | potential
    energy_saving: float | None
    energy_saving_stderr: float | None
    windows: int
    reference_windows: int = 0
    note: str = ""
    throughput_gain: float | None = None
    throughput_gain_stderr: float | None = None
    has_throughput: bool = False  # paired and recorded compare throughput; the model estimates do not
    # the server offloads and its collapse signature holds (methods.md s5): a stalled GPU near idle makes marginal
    # J/token look cheap, so dE answers nothing (``answer``)
    collapse_holds: bool = False

    @property
    def verdict(self) -> str:
        """In words, for the landing page and /api/status: ``unknown`` (no dE), ``within_noise`` (|dE| under
        NOISE_STDERRS standard errors: the study's "offloading inert"), else ``saves`` or ``costs`` by the sign
        (also when the SE is unknown, with fewer than two windows: the page then says so). A dE of exactly 0 is
        ``within_noise`` whatever its SE: an estimate that priced no saving (an offloading server that reloaded
        nothing, SE 0) read "costs" and the page said "offloading costs energy: dE +0.0 % ± 0.0 % (more GPU
        energy per generated token)"."""
        if self.energy_saving is None:
            return "unknown"
        se = self.energy_saving_stderr
        if self.energy_saving == 0.0 or (se is not None and abs(self.energy_saving) < NOISE_STDERRS * se):
            return "within_noise"
        return "saves" if self.energy_saving > 0 else "costs"

    @property
    def answer(self) -> str:
        """The answer to "is offloading paying?" that every screen shows (/api/status ``answer``; the page only
        words it): ``collapse`` where dE is known but the collapse signature holds (no, whatever dE says),
        else ``verdict``."""
        return "collapse" if self.collapse_holds and self.energy_saving is not None else self.verdict


@dataclass(frozen=True)
class WindowFigures:
    window: str  # label value: "1m"
    seconds: float
    covered_seconds: float
    kv_usage_p95: float | None = None
    kv_usage_max: float | None = None
    above_threshold: bool | None = None
    kv_pools_above_threshold: int | None = None  # pools whose own p95 is above the threshold (several pools)
    preemptions_per_minute: float | None = None
    preemption_onset: bool | None = None
    generation_tokens_per_second: float | None = None
    token_shares: dict[str, float] | None = None
    recompute_tax: float | None = None
    flops_per_second: float | None = None
    flops_per_generated_token: float | None = None
    energy: tuple[EnergyFigure, ...] = ()
    prompt_energy_per_token: dict[str, float] | None = None
    offload_write_bytes_per_second: float | None = None
    offload_read_bytes_per_second: float | None = None
    offload_buffer_residency_seconds: float | None = None
    cached_to_prefill_ratio: float | None = None
    savings: tuple[SavingFigure, ...] = ()
    offload_write_tokens_per_second: float | None = None  # engines counting offload traffic in tokens
    offload_read_tokens_per_second: float | None = None
    cached_tier_shares: dict[str, float] | None = None  # cached prompt tokens by tier (device, host, disk, ...)
    preemptions_per_request: dict[str, float] | None = None  # "p50", "p99" -> preemptions (upper edge)
    preempted_requests_share: dict[str, float] | None = None  # "lower" / "upper" bound of the share preempted
    admission_rejections_per_minute: dict[str, float] | None = None  # reason -> rejections per minute
    preemptions_by_reason_per_minute: dict[str, float] | None = None  # reason -> preemptions per minute
    offload_tiers: tuple[TierFlows, ...] = ()  # vLLM tiering: each secondary tier's flows
    # the p95's order-statistic interval (methods.md s10); above_threshold flips only outside it
    kv_usage_p95_low: float | None = None
    kv_usage_p95_high: float | None = None
    # KV-block residency from vLLM's --kv-cache-metrics histograms (derive/residency.py, methods.md s11)
    kv_evicted_blocks_per_second: float | None = None  # sampled evictions / sample share
    kv_evictions_per_prompt_block: float | None = None
    kv_idle_before_evict_seconds: dict[str, float] | None = None  # "p50", "p99" -> upper bucket edge
    kv_reuse_gap_seconds: dict[str, float] | None = None  # "p50", "p99" -> upper bucket edge
    kv_evicted_before_reuse_ratio: float | None = None  # share of evictions idle <= the yardstick
    kv_before_reuse_yardstick: str | None = None  # reuse_gap_p50 | p99_tool_latency
    kv_before_reuse_yardstick_seconds: float | None = None  # the idle bucket bound it was counted at
    residency_evidence: str | None = None  # pressure | low_pressure | None (unknown)
    residency_evidence_reason: str = ""
    # money and carbon of the marginal energy (model/cost.py); empty when neither price nor intensity is set
    costs: tuple[CostFigure, ...] = ()
    # the recomputation tax and what offloading saved, in energy (methods.md s12): scope -> W, and the tax's
    # share of the window's marginal power; priced with the server's per-phase costs (measured or prior)
    recompute_tax_watts: dict[str, float] | None = None
    offload_saved_watts: dict[str, float] | None = None
    recompute_energy_share: dict[str, float] | None = None
    # the regime's state (known | provisional | unknown) and why, for this window (methods.md s10)
    regime_state: str = "unknown"
    regime_reason: str = ""
    # requests waiting because the KV cache has no room (vllm:num_requests_waiting_by_reason{reason="capacity"})
    requests_waiting_for_kv_capacity: float | None = None  # mean over the window's samples
    requests_waiting_for_kv_capacity_share: float | None = None  # share of samples with at least one
    # tokens computed again after a preemption, which no token counter shows (methods.md s4), and their power
    preemption_recompute: PreemptionRecompute | None = None
    preemption_recompute_watts: dict[str, float] | None = None  # scope -> W (per-phase costs, methods.md s12)
    # counts the window holds that no server can produce (model/plausible.py): counts name -> why; every figure
    # computed from them is served as unknown (exporter/catalog/bounds.py DEPENDENCIES)
    implausible_counts: dict[str, str] | None = None
    # each offload tier's reloads priced against a recompute (methods.md s14; GPU scope, hops configured), and dE of
    # adding the disk tier (its net saving / the energy without it)
    offload_tier_energy: tuple[TierEnergy, ...] = ()
    second_tier_energy_saving: float | None = None
    # seconds since these figures were derived: 0 unless the window is a long one of a node with more servers than
    # rules.LONG_WINDOWS_BUILT_PER_TICK, rebuilt in turn every few ticks (model/window_state.py)
    age_seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class BufferFigures:
    """Offload buffer sizing (methods.md s6), from the shortest window (undersized) and the busiest one."""

    undersized: bool | None
    recommended_bytes: float | None
    recommended_gib: float | None  # the --kv-offloading-size value: GiB, 2 significant digits rounded up
    store_failures: float | None
    residency_seconds: float | None
    write_bytes_per_second: float | None
    p99_tool_latency_seconds: float | None = None  # what the residency is held against (configured)
    headroom: float | None = None  # the factor in the recommendation (configured)
    # the residency the buffer must outlast: the measured KV-block reuse-gap p99 when vLLM exports it
    # (--kv-cache-metrics), else the configured p99 tool-call latency
    residency_target_seconds: float | None = None
    residency_target_source: str = "p99_tool_latency"  # reuse_gap_p99 | p99_tool_latency
    recommended_words: str | None = None  # the flag's value with the bytes beside it: "0.018 (18 MiB)"
    # why the recommendation exceeds a pool the verdict calls not undersized (the busiest window, the headroom);
    # '' when it does not
    recommended_note: str = ""
    # the engine setting that sizes the buffer: --kv-offloading-size, or the tiered spec's cpu_bytes_to_use (the CPU
    # tier's size configured as servers[].offload_tier_bytes["0:primary"]: vLLM exports none)
    size_setting: str = "--kv-offloading-size"


# The advice's words asking for vLLM's --kv-cache-metrics (methods.md s11): exporter.model.advice decides when they
# would help (a vLLM server without KV-block residency figures, its regime not yet known) and appends them to the
# regime's "evidence" advice; the page shows them where that advice carries them, and never decides it itself.
KV_CACHE_METRICS_HINT = ("Enabling --kv-cache-metrics on the vLLM server would make the pressure verdict certain from "
                         "the first minutes (KV-block evictions per prompt block, evicted-before-reuse share).")


@dataclass(frozen=True)
class Advice:
    """One answer to "what do I do?" (exporter.model.advice): ``kind`` names the check, ``severity`` says what
    it means (bad: act; unknown: kvwatt cannot tell yet, and what would tell; info: nothing to do), ``evidence``
    the numbers the words rest on (JSON-ready)."""

    kind: str  # server_down | source_degraded | collapse | stalled_engine | kv_pressure | undersized_buffer |
    #            tier_dropping_stores | evidence | checks_unknown | nothing_to_do
    severity: str  # bad | unknown | info
    text: str
    evidence: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class KappaFigures:
    """kappa_crit and the recompute break-even (methods.md s7): constants per server."""

    critical: float | None = None
    breakeven_tokens: float | None = None
    breakeven_tokens_gqa: float | None = None
    breakeven_tokens_mha: float | None = None
    model_source: str | None = None
    hardware_source: str | None = None


@dataclass(frozen=True)
class ServerFigures:
    name: str
    url: str  # password masked (config.redacted_url): figures are for showing
    status: SourceStatus
    info: EngineInfo | None
    threshold: float
    reference_share: float | None
    reference_kind: str
    windows: tuple[WindowFigures, ...]
    collapse: CollapseResult | None = None
    buffer: BufferFigures | None = None
    kappa: KappaFigures = KappaFigures()
    recommendations: tuple[str, ...] = ()
    engine: str = "vllm"  # the one name /metrics, /api/status and the page show (ServerModel: engine_name)
    capabilities: frozenset[str] = frozenset()
    tiers: TierState = TierState()  # offload tiers' occupancy and hit rates as the engine reports them
    kv_fetch_waiting: dict[str, float] | None = None  # stage -> requests in asynchronous KV fetch, last read
    # the threshold located from the server's own history (methods.md s10) and the one the regime flag uses
    located: LocatedThreshold | None = None
    threshold_in_use: float | None = None
    threshold_source: str = "configured"  # located | configured
    evidence_windows: int = 0  # evidence windows held (clean, pressured or unknown)
    reference_windows: int = 0  # windows the learned reference share rests on
    reference_spread: float | None = None  # their standard deviation: the noise of one window's tax
    # evidence before judgement (methods.md s10): each learned figure's state (known | provisional | unknown)
    # and why, the evidence windows they rest on, and the evidence epoch (set aside when the engine changed)
    threshold_state: str = "unknown"
    threshold_reason: str = ""
    reference_state: str = "unknown"
    reference_reason: str = ""
    tax_state: str = "unknown"
    tax_reason: str = ""
    regime_state: str = "unknown"
    regime_reason: str = ""
    evidence: Evidence = Evidence()
    epoch_started_wall: float | None = None
    epoch_cause: str = ""
    # "what do I do?" in order of urgency (exporter.model.advice); ``recommendations`` are their words
    advice: tuple[Advice, ...] = ()
    # measured per-phase energy costs by scope (methods.md s12), or the attribution prior until identifiable
    phase_costs: tuple[PhaseCosts, ...] = ()
    # what the server can be, for the bound on its token rates (exporter/catalog/bounds.py): the data-parallel engines
    # of its last read (the ``engine`` label) and the GPUs configured for it (empty: none named)
    engines: int = 1
    gpu_ids: tuple[str, ...] = ()
    # the model's advisor (exporter.model.advice.advisor): ``advice`` and ``recommendations`` read the finished
    # figures, so they are set from it while the figures are built, before anyone holds them (built once,
    # tests/test_figures_once.py); None: as given
    advise: InitVar[Callable[[ServerFigures], tuple[tuple[Advice, ...], tuple[str, ...]]] | None] = None

    def __post_init__(self, advise: Callable[[ServerFigures], tuple[tuple[Advice, ...], tuple[str, ...]]] | None):
        if advise is not None:
            advice, words = advise(self)
            object.__setattr__(self, "advice", advice)
            object.__setattr__(self, "recommendations", words)

    @property
    def regime(self) -> str:
        """'above' / 'below' threshold on the shortest window with a p95, else 'unknown'."""
        for w in self.windows:
            if w.above_threshold is not None:
                return "above" if w.above_threshold else "below"
        return "unknown"

    @property
    def regime_window(self) -> str | None:
        """The window ``regime`` rests on (its label), None when the regime is unknown."""
        for w in self.windows:
            if w.above_threshold is not None:
                return w.window
        return None

    @property
    def collapse_window(self) -> str | None:
        """The window the collapse conditions are evaluated over: the shortest (CollapseThresholds.from_config)."""
        return min(self.windows, key=lambda w: w.seconds).window if self.windows else None

    @property
    def signatures(self) -> dict[str, bool | None]:
        return {} if self.collapse is None else {"collapse": self.collapse.signature}


@dataclass(frozen=True)
class DeviceFigures:
    """One energy device as last read, with the idle baseline in force."""

    reading: DeviceReading
    baseline: Baseline | None
    baseline_age_seconds: float | None


@dataclass(frozen=True)
class Snapshot:
    t: float  # the tick's monotonic time
    wall_time: float  # unix seconds at the tick
    servers: tuple[ServerFigures, ...]
    sources: tuple[SourceStatus, ...] = ()  # host-wide sources: nvml, rapl, state_dir, price URLs
    devices: tuple[DeviceFigures, ...] = ()
    notice: str = ""  # Config.notice: shown above the figures on every screen
    prices: tuple[PriceFigure, ...] = ()  # electricity price and carbon intensity (model/cost.py)
    # the figures of this tick served as unknown for breaking their bounds (exporter/catalog/bounds.py Rejection), and
    # how many each family has had rejected since start, by the bound's kind: (figure, kind) -> count
    implausible: tuple = ()
    rejected_counts: dict = field(default_factory=dict)

    def price(self, quantity: str) -> PriceFigure | None:
        return next((p for p in self.prices if p.quantity == quantity), None)
