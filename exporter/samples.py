"""What sources produce and what the window store keeps. Plain data, no behaviour.

Time is one monotonic clock: every source of a tick is read at the same tick time ``t`` (the daemon reads
them back to back), so a vLLM interval and the energy of the same interval cover the same span.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# The words a SourceStatus reason may start with: the only values of kvwatt_source_info{reason} (with
# http_<status>). Counts, messages and targets stay in the reason's detail (logs, /api/status), never in the
# label, so a source whose detail changes every tick (3, then 4 bad lines) keeps one series.
REASON_CODES = frozenset({
    "none",  # ok: no reason
    "not_read_yet",  # a server before its first read completed
    # vllm (exporter/sources/vllm.py)
    "timeout", "unreachable", "redirect", "http_error", "body_too_large", "parse_error", "out_of_range",
    "sidecar",  # a server's sidecar exposition (LMCache's, KVBM's port) failed; the server's own was read
    "label_values_capped",  # more distinct tier/reason/stage values than rules.MAX_LABEL_VALUES (sources/labelcap.py)
    # the store (exporter/store/identity.py): readings of more than one process behind one URL; the engine
    # alternating between two spellings of a counter; a counter going backwards alone while the others climb
    "identity_flapping", "spelling_switching", "counter_regression",
    # the model (exporter/model/model.py): learning or deriving this server's figures raised; they are unknown
    "derivation_failed",
    # the sampler (exporter/runtime/sampler.py)
    "deadline", "error",
    # the parent of several worker processes (exporter/runtime/workers.py): the worker of this server exited or stalled
    "worker_down",
    # nvml, rapl
    "disabled", "absent", "permission", "masked", "unreadable", "gpu_lost", "busy",
    # the state directory (exporter/idle/baseline.py, exporter/runtime/statedir.py)
    "not_persisted", "dropped",
    # a price or carbon-intensity series URL (exporter/sources/tariff.py); also timeout, unreachable, parse_error
    "stale", "no_sample",
})
_HTTP_STATUS = re.compile(r"http_[1-5][0-9][0-9]")
UNKNOWN_REASON_CODE = "error"  # the label of a reason whose first word is not in the vocabulary


def reason_code(reason: str) -> str:
    """The vocabulary word a reason starts with ("parse_error: 3 bad lines skipped" -> "parse_error"; "gpu
    lost: ..." -> "gpu_lost"); "none" for no reason, "error" for a word outside the vocabulary."""
    if not reason:
        return "none"
    word = re.split(r"[:;(]", reason, maxsplit=1)[0].strip().replace(" ", "_")
    if word in REASON_CODES or _HTTP_STATUS.fullmatch(word):
        return word
    return UNKNOWN_REASON_CODE


@dataclass(frozen=True, kw_only=True)
class SourceStatus:
    """Health of one source read. ``reason`` is a short machine-friendly word from REASON_CODES plus a
    detail ("parse_error: 3 bad lines skipped"), '' when up; ``code`` is that word alone (the label value)."""

    source: str  # "vllm" | "nvml" | "rapl" | "state_dir"
    server: str  # server name for vllm, "" for host-wide sources
    up: bool
    reason: str = ""
    duration_seconds: float | None = 0.0  # None: not a timed read (state_dir), no duration series
    state: str = "ok"  # ok | down | degraded

    @property
    def code(self) -> str:
        return reason_code(self.reason)


@dataclass(frozen=True)
class EngineInfo:
    """Slow-changing facts about a server, from vllm:cache_config_info and friends."""

    model_name: str = ""
    offload_enabled: bool | None = None  # None = cannot tell (no cache_config_info, no offload series)
    offload_buffer_bytes: float | None = None
    offload_backend: str = ""
    num_gpu_blocks: float | None = None
    block_size: float | None = None
    has_token_sources: bool = False  # vllm:prompt_tokens_by_source_total present (>= 0.16)
    has_mfu: bool = False
    process_start_time_seconds: float | None = None
    # the KV cache pool in tokens as the engine states it (vLLM kv_cache_size_tokens, SGLang max_total_num_tokens,
    # TensorRT-LLM max blocks x tokens per block); not num_gpu_blocks x block_size, which hybrid (Mamba, sliding
    # window) models and decode context parallelism break
    kv_capacity_tokens: float | None = None


@dataclass(frozen=True, kw_only=True)
class EngineReading:
    """One successful read of a server, engine-neutral: cumulative counters (summed over engines) and gauges
    under kvwatt's own keys (exporter/sources/engine.py lists them), slow-changing facts, and the set of
    capabilities the exposition showed (which figures can exist for this server at all).

    ``engine_counters`` holds the same counters before the sum, per data-parallel engine (the ``engine``
    label; "" for series without one), so the store tracks resets per engine: one engine vanishing or
    restarting is not a whole-server reset (store.engine_deltas). Empty means one engine: ``counters``.
    ``rejected`` maps each family refused as out of range (absent from counters/gauges/info) to a detail
    for the log; the source's status then says "out_of_range"."""

    counters: dict[str, float]
    gauges: dict[str, float]
    info: EngineInfo
    capabilities: frozenset[str] = frozenset()
    engine: str = "vllm"
    engine_counters: dict[str, dict[str, float]] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    read_wall: float | None = None  # wall-clock time of the read (time.time()); None when not read over HTTP
    # counter key -> the series it was read from, for keys an engine spells two ways (vLLM's offload counters:
    # the flat 0.24+ series or the deprecated one): a change of spelling is not a counter delta (store/identity.py)
    spellings: dict[str, str] = field(default_factory=dict)




@dataclass(frozen=True)
class ServerRead:
    """The outcome of one server read: its status, and the reading when it succeeded."""

    server: str
    status: SourceStatus
    reading: EngineReading | None = None


@dataclass(frozen=True)
class Tick:
    """Everything one sampler tick collected, on one monotonic clock.

    ``servers`` holds the server reads that completed since the previous tick (a read still in flight is
    absent and lands in a later tick); ``energy`` the device readings of this tick (a source that missed
    the deadline contributes none: a gap, never a guess); ``energy_statuses`` the nvml and rapl health."""

    t: float
    servers: dict[str, ServerRead]
    energy_statuses: tuple[SourceStatus, ...] = ()
    energy: tuple["DeviceReading", ...] = ()
    prices: tuple["PriceReading", ...] = ()  # the price and carbon-intensity URLs' last values (sources/tariff.py)


@dataclass(frozen=True)
class PriceReading:
    """The last value read from a price or carbon-intensity URL, as of one tick: ``value`` None when unknown
    (never read, or older than the staleness limit: ``status`` says why), ``age_seconds`` since it was read."""

    quantity: str  # electricity_price | carbon_intensity
    value: float | None
    age_seconds: float | None
    status: SourceStatus


@dataclass(frozen=True, kw_only=True)
class DeviceReading:
    """One energy device (a GPU or a RAPL zone) at one tick.

    ``joules_total`` is the source's corrected cumulative energy since kvwatt started watching this device
    (wraps added back, resets re-based), or None when it could not be read this tick. ``continuous`` is False
    when the step from the previous reading must not be used (reset, several wraps, implausible power):
    that interval then has no energy sample rather than a wrong one (energy-measurement.md rules 3-4).
    """

    device: str  # stable id: "gpu:<uuid>" or "rapl:<zone>:<domain>"
    kind: str  # "gpu" | "host"
    labels: dict[str, str]
    joules_total: float | None
    continuous: bool = True
    power_watts: float | None = None
    method: str = ""  # gpu: counter | power_integration; host: rapl
    temperature_celsius: float | None = None
    # time.monotonic() right after the energy was read (None without a sample). A command that divides
    # joules by seconds uses this, not the time its loop began: a slow first read (NVML init, a stalled
    # process) would otherwise count seconds with no energy in them (energy-measurement.md rule 10)
    read_at: float | None = None
    # the enforced power limit (NVML nvmlDeviceGetEnforcedPowerLimit), W; None: not a GPU or not given
    power_limit_watts: float | None = None


@dataclass(frozen=True, kw_only=True)
class Interval:
    """What happened on one server between two successful reads ``t0`` < ``t1``.

    ``deltas`` are counter increases (reset-corrected). ``gauges`` are the values read at ``t1``.
    ``energy_joules`` maps scope ("gpu", "host") to the energy of the server's devices over exactly
    (t0, t1], or is missing a scope when any of those devices lacked a sample in the span.
    ``idle_joules`` is P_idle * dt for the same devices when every one has a baseline.
    """

    t0: float
    t1: float
    deltas: dict[str, float]
    gauges: dict[str, float]
    energy_joules: dict[str, float] = field(default_factory=dict)
    idle_joules: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


# A served model's parameters (methods.md s7): read by sources/model_config.py, used by derive/kappa.py.
@dataclass(frozen=True, kw_only=True)
class ModelParams:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: float
    active_parameters: float | None = None  # N_act: parameters touched per token (incl. embeddings)
    hidden_size: int | None = None          # D_m (Tetris)
    attention_width: int | None = None      # heads * head_dim (attention FLOPs); hidden_size if unknown
    source: str = ""
    # vLLM's own estimate of bytes written per scheduled token and per token that gets logits (its MFU model,
    # vllm/v1/metrics/perf.py); None where kvwatt does not model it (MoE, a configured-only model)
    engine_write_bytes_per_token: float | None = None
    engine_write_bytes_per_logits_token: float | None = None

    @property
    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """K and V, every layer: 2 * layers * kv_heads * head_dim * dtype_bytes."""
    return 2.0 * layers * kv_heads * head_dim * dtype_bytes
