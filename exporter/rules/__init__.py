"""Every threshold, window and rate kvwatt's artefacts share, defined once (kubernetes-mixin ``_config`` style).

The daemon's Config defaults (exporter/config/), the alert rules' settings (alerts/generate.py), the dashboards
(dashboards/generate.py), the experiment plan's default (kvwatt_lab) and the README's configuration table
(exporter/tooling/readme_tables.py) all read the entries below; none types a value of its own. ``key`` is the YAML key
of
the daemon's configuration (and the alert setting of the same name); ``field`` the Config attribute where it
differs. exporter/tooling/rulecopies.py (run by each generator's ``--check`` and tests/test_rules.py) refuses a
literal copy of a rule in the modules that use them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Rule:
    key: str
    default: float | tuple[float, ...]
    unit: str  # ratio | per minute | seconds | factor | count
    meaning: str
    section: str  # docs/methods.md section ("s3"), "" where the rule is operational
    field: str = ""  # Config attribute, when it is not the key
    most: float | None = None  # the largest value the configuration accepts, where one is needed
    words: tuple[str, ...] = ()  # a method constant's (METHODS): words of the names a literal copy would take

    @property
    def attribute(self) -> str:
        return self.field or self.key


INTERVAL = Rule(key="interval", default=1.0, unit="seconds",
                meaning="sampling interval of every source (dense samples for the p95)", section="s3",
                field="interval_seconds")
WINDOWS = Rule(key="windows", default=(60.0, 300.0), unit="seconds",
               meaning="rolling windows of the derived figures (label `window`); "
               "the alerts read the longest", section="s3", field="windows_seconds")
KV_PRESSURE_THRESHOLD = Rule(
    key="kv_pressure_threshold", default=0.90, unit="ratio",
    meaning="configured p95 KV usage above which offloading pays (methods.md s3); "
    "the regime flag uses it until a threshold is located", section="s3", field="kv_pressure_threshold_ratio")
THRESHOLD_WINDOW = Rule(
    key="threshold_window", default=60.0, unit="seconds",
    meaning="one evidence point per completed window of this fixed grid "
    "(KV p95, preemptions, tax; methods.md s10); the reference share learns from the same", section="s10",
    field="threshold_window_seconds")
THRESHOLD_HISTORY = Rule(key="threshold_history", default=6 * 3600.0, unit="seconds",
                         meaning="how long evidence windows are kept for locating the threshold", section="s10",
                         field="threshold_history_seconds")
THRESHOLD_MIN_WINDOWS = Rule(key="threshold_min_windows", default=6, unit="count",
                             meaning="evidence windows (clean and pressured, at "
                             "least 2 of each) a located threshold needs", section="s10")
PREEMPTION_ONSET_PER_MINUTE = Rule(key="preemption_onset_per_minute", default=0.5, unit="per minute",
                                   meaning="sustained preemption rate that marks onset (methods.md s3)", section="s3")
RECOMPUTE_TAX_THRESHOLD = Rule(key="recompute_tax_threshold", default=0.10, unit="ratio",
                               meaning="local_compute share of prompt tokens above the reference share that counts "
                               "as a high recomputation tax (alert KVRecomputeTaxHigh; methods.md s4)", section="s4")
IDLE_SETTLE = Rule(key="idle_settle", default=30.0, unit="seconds",
                   meaning="settle delay after load before an idle stretch counts", section="s1",
                   field="idle_settle_seconds")
IDLE_MIN_DURATION = Rule(key="idle_min_duration", default=30.0, unit="seconds",
                         meaning="idle stretch needed to learn P_idle", section="s1", field="idle_min_seconds")
MIN_LOAD_DURATION = Rule(key="min_load_duration", default=30.0, unit="seconds",
                         meaning="load needed in a window before a J/token figure is given", section="s1",
                         field="min_load_seconds")
# the buffer recommendation is write rate x p99 tool-call latency x headroom (methods.md s6): 1e300 s or a
# headroom of 1e308 made it infinite and every tick failed (issue 38). A day of tool call and a hundredfold
# headroom are far beyond any workload; with the largest write rate taken (MAX_VALUE) the product stays finite.
P99_TOOL_LATENCY = Rule(key="p99_tool_latency", default=20.0, unit="seconds",
                        meaning="the workload's p99 tool-call latency, for buffer sizing (methods.md s6); at most 24h",
                        section="s6", field="p99_tool_latency_seconds", most=86400.0)
BUFFER_HEADROOM = Rule(key="buffer_headroom", default=1.5, unit="factor",
                       meaning="factor on the recommended buffer size (methods.md s6); 1 to 100", section="s6",
                       most=100.0)
# 0.35 and 2.0 cover the study's collapse with margin (methods.md s5: 17-23 % of the healthy output, GPU power
# ~1.4-1.8x a model-loaded idle), where 0.2 / 1.5 sat inside that range and would miss part of it; healthy load
# draws >= 3.4x idle, and every other condition (offloading on, zero preemptions, requests pending) must hold too.
COLLAPSE_THROUGHPUT_DROP_RATIO = Rule(
    key="collapse_throughput_drop_ratio", default=0.35, unit="ratio",
    meaning="throughput below this share of its recent level = collapsed (methods.md s5)", section="s5")
COLLAPSE_POWER_NEAR_IDLE_RATIO = Rule(key="collapse_power_near_idle_ratio", default=2.0, unit="factor",
                                      meaning="GPU power below this multiple of P_idle = near idle (methods.md s5)",
                                      section="s5")
COLLAPSE_REFERENCE_WINDOW = Rule(key="collapse_reference_window", default=600.0, unit="seconds",
                                 meaning="how far back the recent throughput level is taken (methods.md s5)",
                                 section="s5", field="collapse_reference_seconds")
LOAD_TO_COMPUTE_COST_RATIO = Rule(
    key="load_to_compute_cost_ratio", default=0.1, unit="ratio",
    meaning="energy of reloading a token vs recomputing it (attribution model, methods.md s7)", section="s7")
# electricity price and carbon intensity read from a series URL (exporter/sources/tariff.py): both change
# hourly at most (day-ahead tariffs, grid-intensity feeds), so a read every 5 min follows them; a value older
# than 2 h is no longer the grid's and the money and CO2 figures go unknown (docs/energy.md, "Money and carbon")
PRICE_REFRESH = Rule(key="price_refresh", default=300.0, unit="seconds",
                     meaning="how often a price or carbon-intensity series URL is read", section="s1",
                     field="price_refresh_seconds")
PRICE_MAX_AGE = Rule(key="price_max_age", default=7200.0, unit="seconds",
                     meaning="a price or carbon intensity read from a URL older than "
                     "this is unknown (the money and CO2 figures with it)", section="s1", field="price_max_age_seconds")

PHASE_MIN_WINDOWS = Rule(key="phase_min_windows", default=20, unit="count",
                         meaning="repeat windows a measured per-phase energy cost needs (regression, methods.md s12)",
                         section="s12")
# 100 = the prompt and generated columns may share a cosine of up to ~0.98: beyond it the SEs blow up and a
# cost rests on a few windows (the double's agentic mix sits at 8-16; a constant mix is infinite)
PHASE_MAX_CONDITION = Rule(key="phase_max_condition", default=100.0, unit="factor",
                           meaning="condition number of the normalised token design above which the per-phase "
                           "costs are not identifiable (the mix of prompt and generated tokens does not vary enough, "
                           "s12)",
                           section="s12")
PHASE_HISTORY = Rule(key="phase_history", default=6 * 3600.0, unit="seconds",
                     meaning="how long repeat windows are kept for the per-phase energy regression (methods.md s12)",
                     section="s12",
                     field="phase_history_seconds",
                     # one row per repeat window (a week of 1 s windows: 6e5 rows a scope); 1e21 s overflowed the
                     # rows' bound at start (a traceback, where check-config said ok)
                     most=7 * 86400.0)
RECOMPUTE_ENERGY_SHARE_THRESHOLD = Rule(
    key="recompute_energy_share_threshold", default=0.10, unit="ratio",
    meaning="share of the server's marginal GPU power spent recomputing the tax's prompt tokens above which the alert "
    "KVRecomputeEnergyHigh fires (methods.md s12)", section="s12")

# The energy per byte of each hop a reloaded token's KV takes to the GPU (methods.md s14), configured: no device
# exposes a per-transfer energy (RAPL's DRAM domain, where present, is the whole memory's power, and an NVMe
# drive states its power states, not J/byte). Orders of magnitude from public figures: DDR5 access with its I/O
# ~10-20 pJ/bit (~0.15 nJ/byte), a PCIe Gen5 x16 link's two PHYs ~5-8 pJ/bit (~0.06 nJ/byte), an enterprise
# Gen5 NVMe drive ~25 W above idle while reading ~13 GB/s (~2 nJ/byte). Set them from a measurement where one
# exists (bench/, a power meter on the drive).
HOST_MEMORY_JOULES_PER_BYTE = Rule(
    key="host_memory_joules_per_byte", default=1.5e-10, unit="joules per byte",
    meaning="energy of one host-DRAM access (read or write) per byte of KV, priced into a token reloaded from an "
            "offload tier (methods.md s14; configured, not measured)", section="s14")
HOST_LINK_JOULES_PER_BYTE = Rule(
    key="host_link_joules_per_byte", default=6e-11, unit="joules per byte",
    meaning="energy per byte of KV over the host-device link (PCIe), priced into a reloaded token (methods.md s14; "
            "configured, not measured)", section="s14")
DISK_JOULES_PER_BYTE = Rule(
    key="disk_joules_per_byte", default=2e-9, unit="joules per byte",
    meaning="energy per byte an offload disk tier (NVMe) reads, priced into a token reloaded from disk (methods.md "
            "s14; configured, not measured)", section="s14")

RULES: dict[str, Rule] = {r.key: r for r in (
    INTERVAL, WINDOWS, KV_PRESSURE_THRESHOLD, THRESHOLD_WINDOW, THRESHOLD_HISTORY, THRESHOLD_MIN_WINDOWS,
    PREEMPTION_ONSET_PER_MINUTE, RECOMPUTE_TAX_THRESHOLD, IDLE_SETTLE, IDLE_MIN_DURATION, MIN_LOAD_DURATION,
    P99_TOOL_LATENCY, BUFFER_HEADROOM, COLLAPSE_THROUGHPUT_DROP_RATIO, COLLAPSE_POWER_NEAR_IDLE_RATIO,
    COLLAPSE_REFERENCE_WINDOW, LOAD_TO_COMPUTE_COST_RATIO, PRICE_REFRESH, PRICE_MAX_AGE, PHASE_MIN_WINDOWS,
    PHASE_MAX_CONDITION, PHASE_HISTORY, RECOMPUTE_ENERGY_SHARE_THRESHOLD, HOST_MEMORY_JOULES_PER_BYTE,
    HOST_LINK_JOULES_PER_BYTE, DISK_JOULES_PER_BYTE)}


def longest_window_seconds() -> float:
    """The default window the alerts and dashboards read kvwatt's per-window series at."""
    return max(WINDOWS.default)


# vLLM's --kv-cache-metrics-sample default: the share of KV blocks its residency histograms track (exported
# nowhere, so kvwatt assumes it unless servers[].kv_cache_metrics_sample says otherwise; derive/residency.py)
VLLM_KV_CACHE_METRICS_SAMPLE = 0.01

# Operational bounds (not configuration keys: not in RULES). Documented in docs/architecture.md "Limits".
# A labelled family (tier, reason, stage) has a handful of values in every engine; 64 leaves room for many
# tiers while 10,000 upstream values (a label carrying an id) stay 64 series per family and server instead of
# 70,151 /metrics lines and ~700 MB more RSS per hour of window.
MAX_LABEL_VALUES = Rule(key="max_label_values", default=64, unit="count",
                        meaning="distinct values of one labelled family (tier, reason, stage) kept per server: the "
                        "first seen; further values are dropped with reason label_values_capped", section="")
# The long windows' figures of a node watching many servers (docs/architecture.md "Windows": staggered): each tick
# every server's shortest window is built, and the longer windows of at most this many servers, in turn; with
# more servers each long window is rebuilt every ceil(servers / this) ticks and served with its age. A long window
# moves little in a few ticks (its figures read an hour), and its figures (dE's jackknife over ~120 repeat windows)
# cost most of a server's tick: 64 servers thus build 16 long windows a tick, not 64.
LONG_WINDOWS_BUILT_PER_TICK = Rule(key="long_windows_built_per_tick", default=16, unit="count",
                                   meaning="servers whose longer windows' figures are rebuilt each tick (the others "
                                           "serve theirs with their age, kvwatt_window_age_seconds)", section="")
# `kvwatt run` with processes=auto: one process up to this many servers, else ceil(servers / this), each on a core of
# its own (exporter/runtime/workers.py). A server costs ~1.5 ms of CPU a tick (bench/soak.py, 64 servers x 1 GPU at
# 1 s): 32 servers keep a worker's tick near 50 ms, half the 100 ms budget of a 1 s interval.
SERVERS_PER_PROCESS = Rule(key="servers_per_process", default=32, unit="count",
                           meaning="servers per worker process when `processes` is auto", section="")
# The host offload buffer's size as the engine states it (vllm:cache_config_info kv_offloading_size,
# vllm:kv_offload_config_info cpu_kv_cache_size_bytes): at least one KV block of the smallest model (16 tokens x
# K and V x 64 dimensions x 2 bytes = 4 KiB), at most 1 PiB (2**50 B, hundreds of times the host memory of the
# largest servers). Outside (1e30 B, 9e20 GiB, 1e-291 B were accepted: a residency of 5e20 s, "not undersized")
# the size is refused: unknown, reason out_of_range, never a residency.
OFFLOAD_BUFFER_MIN_BYTES = Rule(key="offload_buffer_min_bytes", default=4096.0, unit="bytes",
                                meaning="smallest host offload buffer size taken from an engine (one KV block)",
                                section="s6")
OFFLOAD_BUFFER_MAX_BYTES = Rule(key="offload_buffer_max_bytes", default=2.0 ** 50, unit="bytes",
                                meaning="largest host offload buffer size taken from an engine (1 PiB)", section="s6")


def offload_buffer_size_ok(n_bytes: float) -> bool:
    """A host offload buffer size within [OFFLOAD_BUFFER_MIN_BYTES, OFFLOAD_BUFFER_MAX_BYTES] (NaN is not)."""
    return OFFLOAD_BUFFER_MIN_BYTES.default <= n_bytes <= OFFLOAD_BUFFER_MAX_BYTES.default


# Method constants (docs/methods.md): not configuration keys (not in RULES), each named here once because more
# than one module, or a metric's HELP, states it; every use reads the entry (``rules.X.default``) and the HELP
# texts format it. ``words``: what a name holding a literal copy of it would contain (exporter/tooling/rulecopies.py).
SUSTAINED_MIN_COVERED = Rule(key="sustained_min_covered", default=0.8, unit="ratio",
                             meaning="share of a window its samples must cover for what it shows to count as "
                             "sustained: the preemption onset (methods.md s3), a known recomputation tax (s4), an "
                             "evidence window of the threshold and the regime (s10)", section="s10",
                             words=("covered", "coverage"))
REPEAT_MIN_COVERED = Rule(key="repeat_min_covered", default=0.9, unit="ratio",
                          meaning="share of a repeat window (the fixed grid of min_load_duration) its samples must "
                          "cover for it to count: dE's pairs (methods.md s2), the per-phase energy (s12), the write "
                          "model (s4)",
                          section="s2", words=("covered", "coverage"))
CAPACITY_SUSTAINED = Rule(key="capacity_sustained", default=0.5, unit="ratio",
                          meaning="share of a window's samples with a request waiting for KV capacity that is known "
                          "pressure (methods.md s10)", section="s10", words=("capacity",))
# levels in evictions per prompt block (derive/residency.py): the captures gave 0.84 (pressure) and 0.037 (none);
# each level sits a factor ~3 inside its side, and the band between says nothing
PRESSURE_EVICTIONS_PER_PROMPT_BLOCK = Rule(
    key="pressure_evictions_per_prompt_block", default=0.25, unit="ratio",
    meaning="KV blocks evicted per prompt block at or above which the engine's residency record is pressure evidence "
    "(with most evictions before reuse; methods.md s11)", section="s11", words=("evictions_per_prompt_block",))
LOW_PRESSURE_EVICTIONS_PER_PROMPT_BLOCK = Rule(
    key="low_pressure_evictions_per_prompt_block", default=0.1, unit="ratio",
    meaning="KV blocks evicted per prompt block at or below which the residency record is low-pressure evidence "
    "(methods.md s11)", section="s11", words=("evictions_per_prompt_block",))
MIN_REUSE_GAPS = Rule(key="min_reuse_gaps", default=10, unit="count",
                      meaning="reuse gaps a window needs for their p50 to be the residency yardstick (methods.md s11)",
                      section="s11", words=("reuse_gaps", "reuse_samples"))

# a difference under this many standard errors is noise: dE against zero ("within noise", figures.SavingFigure)
# and a priced dE against the tax it prices (the relation de_prices_the_tax, bounds.py)
NOISE_STDERRS = Rule(key="noise_stderrs", default=2.0, unit="count",
                     meaning="standard errors within which a difference is noise: dE "
                     "against zero, and against the tax it prices (methods.md s2, s13)", section="s2",
                     words=("stderrs",))
METHODS: dict[str, Rule] = {r.key: r for r in (
    NOISE_STDERRS, SUSTAINED_MIN_COVERED, REPEAT_MIN_COVERED, CAPACITY_SUSTAINED, PRESSURE_EVICTIONS_PER_PROMPT_BLOCK,
    LOW_PRESSURE_EVICTIONS_PER_PROMPT_BLOCK, MIN_REUSE_GAPS)}
