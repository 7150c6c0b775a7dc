"""The value types exporter/derive/ returns and exporter/figures.py holds: results only, each computed by the
derive/ module its section names (the formulas and their methods.md sections are there). They live here, not in
derive/, so that what only reads the figures (the catalog, the renderers in exporter/serve/) loads no computation
(tests/test_layers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

# --- computed by derive/collapse.py -----------------------------------------------------------------------------------
CLASSIC = ("offload_enabled", "zero_preemptions", "throughput_collapsed", "power_near_idle", "requests_pending")
STALLED_ENGINE = ("engine_steps_stopped", "requests_pending")
# condition set -> its conditions; the first that holds names the signature's condition_set
CONDITION_SETS: dict[str, tuple[str, ...]] = {"stalled_engine": STALLED_ENGINE, "classic": CLASSIC}


@dataclass(frozen=True, kw_only=True)
class CollapseResult:
    conditions: dict[str, bool | None]
    signature: bool | None
    reason: str
    recent_tokens_per_second: float | None = None
    reference_tokens_per_second: float | None = None
    gpu_power_watts: float | None = None
    gpu_idle_power_watts: float | None = None
    details: dict[str, str] = field(default_factory=dict)  # condition -> why it is None
    condition_sets: dict[str, bool | None] = field(default_factory=dict)  # the applicable sets, each's value
    stale_witnesses: dict[str, str] = field(default_factory=dict)  # a flat progress counter -> why it is stale

    @property
    def condition_set(self) -> str | None:
        """The condition set that fired (stalled_engine before classic), None while the signature does not hold."""
        return next((name for name in CONDITION_SETS if self.condition_sets.get(name)), None)

    def as_status(self) -> dict:
        """JSON-ready summary for /api/status."""
        return {"signature": self.signature, "condition_set": self.condition_set,
                "condition_sets": dict(self.condition_sets), "reason": self.reason,
                "conditions": dict(self.conditions),
                "recent_tokens_per_second": self.recent_tokens_per_second,
                "reference_tokens_per_second": self.reference_tokens_per_second,
                "gpu_power_watts": self.gpu_power_watts, "gpu_idle_power_watts": self.gpu_idle_power_watts,
                "details": dict(self.details), "stale_witnesses": dict(self.stale_witnesses)}


# --- computed by derive/offload.py ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TierState:
    """The offload tiers as the engine last reported them (gauges the engine computes itself)."""

    used_ratio: float | None = None  # true occupancy 0..1 (SGLang HiCache, TensorRT-LLM host pool)
    used_bytes: float | None = None  # bytes held (LMCache: no capacity exported, so no ratio)
    hit_ratio: dict[str, float] | None = None  # tier -> the engine's own recent hit rate (Dynamo KVBM)


@dataclass(frozen=True, kw_only=True)
class TierFlows:
    """One secondary offload tier of vLLM's tiering manager (0.28+, tier label "<index>:<type>", e.g. "1:fs")
    over a window. Writes go primary (CPU) tier -> this tier (cascade), reads this tier -> primary (promotion).
    vLLM exports no tier capacity: residency needs it from the configuration (servers[].offload_tier_bytes),
    and ``undersized`` is the CPU tier's rule (methods.md s6) with failed jobs as the failures."""

    tier: str
    write_bytes_per_second: float | None
    read_bytes_per_second: float | None
    chunk_hit_ratio: float | None  # chunk lookups that hit / lookups sent to this tier
    job_failures: float | None  # failed promotion + cascade jobs in the window
    undersized: bool | None  # residency < p99 tool-call latency, or a job failed (None: neither known)
    residency_seconds: float | None = None  # configured capacity / write rate
    # stores (cascade jobs) bound for this tier and their blocks that vLLM's back-pressure detector dropped, per
    # second over the window: blocks the tier will never serve (the tier too slow for the write rate)
    dropped_stores_per_second: float | None = None
    dropped_blocks_per_second: float | None = None
    # failed promotion (this tier -> CPU tier) and cascade (CPU tier -> this tier) jobs per second over the window;
    # 0 where the tier moved data and vLLM has no sample of the counter (it has none until its first failure)
    failed_promotions_per_second: float | None = None
    failed_cascades_per_second: float | None = None
    # the tier's capacity (configured: vLLM exports none) or, unknown, why
    capacity_bytes: float | None = None
    capacity_reason: str = ""
    # vLLM's transfer-time counters (kv_offload_tiering_{read,write}_time, seconds summed over the tier's finished
    # jobs, each job's I/O wall time without its queue wait; methods.md s14): bytes per second of transfer (the
    # bandwidth one job sees: with parallel I/O threads the tier's aggregate is higher), and seconds of transfer per
    # second of the window (the mean number of jobs transferring: above 1 with parallel jobs)
    read_bandwidth_bytes_per_second: float | None = None
    write_bandwidth_bytes_per_second: float | None = None
    read_seconds_per_second: float | None = None
    write_seconds_per_second: float | None = None
    transfer_time_reason: str = ""  # why the bandwidths are unknown, "" when both are known
    # s7's kappa_crit with a reload from this tier: the read hop at the tier's measured bandwidth, then the host
    # link (kappa.tier_critical); unknown with its reason
    critical_cached_to_prefill: float | None = None
    critical_reason: str = ""
    # vLLM's lookup histograms (seconds, means over the window): the scheduler's blocking time per resolved chunk
    # lookup, and the wait of a lookup that had to retry (the tier's asynchronous lookup) until it resolved
    lookup_seconds: float | None = None
    lookup_wait_seconds: float | None = None
    lookup_reason: str = ""  # why either is unknown, "" when both are known


# --- computed by derive/phase_energy.py -------------------------------------------------------------------------------
PHASES = ("prompt_computed", "generated", "reloaded")


@dataclass(frozen=True, kw_only=True)
class PhaseCosts:
    """Marginal J per token by phase for one scope; SE None for a cost pinned at 0 or from the prior."""

    scope: str
    prompt_computed_j: float | None = None
    prompt_computed_se: float | None = None
    generated_j: float | None = None
    generated_se: float | None = None
    reloaded_j: float | None = None
    reloaded_se: float | None = None
    windows: int = 0
    state: str = "unknown"  # known | not_identifiable | unknown
    reason: str = ""
    source: str = "prior"  # measured | prior
    condition: float | None = None  # condition number of the normalised design (identifiability)
    # covariance of (prompt_computed, reloaded) costs, for propagating into dE (0 where pinned or prior)
    cov_prompt_reloaded: float = 0.0
    phases: ClassVar[tuple[str, ...]] = PHASES

    def joules(self, phase: str) -> float | None:
        return getattr(self, f"{phase}_j")

    def stderr(self, phase: str) -> float | None:
        return getattr(self, f"{phase}_se")

    @property
    def usable(self) -> bool:
        """A price for computed prompt tokens is there (measured or prior)."""
        return self.prompt_computed_j is not None


# --- computed by derive/recompute.py ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PreemptionRecompute:
    """Prompt and generated tokens computed again after a preemption, over a window (methods.md s4).

    vLLM >= 0.16 counts prompt tokens by source on a request's first prefill only, so a preempted request that
    resumes (recomputed OFF, reloaded ON) moves no token counter. vLLM's write-traffic estimate
    (vllm:estimated_write_bytes_per_gpu_total, --enable-mfu-metrics) is built from every scheduled token:
        scheduled = (write bytes - bytes per logits token x generated) / bytes per token
    (the bytes per token: the write model, fitted from the engine's windows without preemption or config.json's,
    derive/write_model.py)
        recomputed = scheduled - prompt tokens computed (first prefills) - generated tokens
    ``residual_share`` is recomputed / scheduled before clipping at 0: with no preemption it is the identity's
    error (a logits row per chunked-prefill step the estimate also bills), measured below 0.5 % on the real
    engine (docs/offload.md)."""

    tokens_per_second: float | None = None
    share: float | None = None  # of the tokens the engine scheduled in the window
    scheduled_tokens_per_second: float | None = None
    residual_share: float | None = None
    state: str = "unknown"  # known | provisional | unknown
    reason: str = ""
    scheduled_tokens: float | None = None
    write_model: "WriteModel | None" = None  # the coefficients it used and where they came from (judged)


@dataclass(frozen=True, kw_only=True)
class WriteModel:
    """The write model the post-preemption figure uses (methods.md s4): bytes of the engine's write-traffic
    estimate per scheduled token (``bytes_per_token``, a) and per token that gets logits (b), the state of its
    check on windows without preemption, and where it came from (derive/write_model.py ``choose``).

    ``source``: "fitted" (least squares over the engine's own windows without preemption), "config.json" (the
    model's shapes, sources/model_config.engine_write_bytes), "fitted and config.json agree", or "" (none yet).
    ``fitted`` and ``configured``: each candidate's (bytes per computed prompt token, per generated token) =
    (a, a + b), None where it does not exist; ``*_residual``: each one's check, the median over the windows
    without preemption of |writes - its prediction| in tokens per scheduled token (the fit's on held-out
    windows), and ``*_check`` its verdict; ``agrees``: both checks passed and the coefficients are within
    write_model.AGREEMENT of each other."""

    bytes_per_token: float | None = None
    bytes_per_logits_token: float | None = None
    source: str = ""
    state: str = "unknown"  # known | provisional | unknown
    reason: str = ""
    windows: int = 0  # windows without preemption learned from
    fitted: tuple[float, float] | None = None
    fitted_residual: float | None = None
    fitted_check: str = ""  # passed | failed | "" (not checked yet)
    configured: tuple[float, float] | None = None
    configured_residual: float | None = None
    configured_check: str = ""
    agrees: bool | None = None


# --- computed by derive/threshold.py ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LocatedThreshold:
    ratio: float                # located KV-p95 threshold
    low: float                  # uncertainty interval
    high: float
    method: str                 # "preemption_onset" | "tax_onset"
    points: int                 # points it rests on (clean and pressured; unknown ones are not counted)
    clean_below: float = 0.0    # weight of the clean points below the cut
    pressured_above: float = 0.0  # weight of the pressured points above it
    misplaced: float = 0.0      # weight of the points on the wrong side (pressured below, clean above)
    state: str = "provisional"  # known | provisional (judge); an unlocated threshold is unknown: None
    reason: str = ""            # why the state is what it is, in words


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """What a server's learned figures rest on (methods.md s10): its evidence windows in the current epoch."""

    windows: int = 0            # evidence windows held
    clean: int = 0              # of them: clean, pressured, unknown (neither preemptions nor tax known)
    pressured: int = 0
    unknown: int = 0
    rejected: int = 0           # windows not taken as evidence: implausible counters (this run)
    span_seconds: float = 0.0   # from the oldest window's end to the newest's
    oldest_wall: float | None = None
    newest_wall: float | None = None
    low_pressure: int = 0       # windows with positive signs of no pressure (the reference's candidates)
    quiet_streak: int = 0       # the newest windows, all clean: how long the server has shown low pressure


# --- computed by derive/tier_energy.py ------------------------------------------------------------------------------
HOP_SOURCE = "configured"  # the energy per byte of each hop: configured, never measured (methods.md s14)


@dataclass(frozen=True, kw_only=True)
class TierEnergy:
    """One offload tier's reloads priced over a window and scope (methods.md s14). None: unknown."""

    tier: str  # the cached-token source: host, disk (p2p, external: no hop prices, the price unknown)
    scope: str
    tokens_per_second: float
    cached_to_prefill: float | None  # kappa_t: tokens from the tier / computed prompt tokens
    bytes_per_token: float | None  # bytes a token from the tier moves over its hops (summed)
    hop_joules_per_token: float | None  # hops_t
    reload_joules_per_token: float | None  # c_r + hops_t
    breakeven_ratio: float | None  # price_t / c_p
    gpu_saved_watts: float | None  # tokens/s x (c_p - c_r)
    reload_watts: float | None  # tokens/s x hops_t
    saved_watts: float | None  # gpu-side saving - reload W
    hop_source: str = HOP_SOURCE
    price_reason: str = ""  # why the price (and the savings) are unknown, "" when known
