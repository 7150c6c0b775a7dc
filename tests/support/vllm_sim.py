"""A simulated vLLM engine that renders vLLM-shaped /metrics expositions, for offload-ON tests.

Offloading cannot run on the CPU engine here (docs/vllm-metrics.md), so the ON path is tested on expositions
built from the real metric definitions (0.15 -> 0.33, both offload spellings), in the layout of the real
0.32 fixtures (tests/data/vllm-0.32-cpu): ``_total`` + ``_created`` counters, ``engine``/``model_name``
labels, ``vllm:cache_config_info`` with ``kv_offloading_size``.

    from tests.support import vllm_sim as sim
    scn = sim.collapsing_on()                  # a Scenario: phases on a timeline + engine facts
    eng = sim.SimEngine(scn)
    eng.advance(30.0)                          # 30 simulated seconds (integrated in <= 1 s steps)
    text = eng.render()                        # the exposition at that instant ("0.33" by default)
    eng.phase.name, eng.phase.collapsed        # ground truth for detector tests
    eng.gpu_power_watts, eng.gpu_energy_joules # the GPU power/energy trajectory the scenario implies
    eng.totals()                               # wire counters under kvwatt's keys (generation_tokens, ...)
    eng.set_phase("collapse"); eng.restart()   # manual control; restart zeroes every counter

    ivs = sim.simulate_intervals(scn, seconds=600, step=1.0)   # exporter.samples.Interval list, no HTTP

Scenario builders (each takes ``version=`` and timing knobs): stable_high_pressure_on, collapsing_on,
recovering_on, undersized_buffer_on, low_pressure_off, high_pressure_off, idle_server, restarting_on,
table1_pair. Phase.collapsed marks the phases in which the collapse signature (methods.md s5) truly holds.

Versions: "0.33" (flat kv_offload_* series + the deprecated kv_offload_total_bytes{transfer_type} spelling,
allocation failures, kv_offload_config_info), "0.32", "0.26", "0.24" (flat series, stores_skipped, no
allocation failures, no kv_offload_config_info), "0.17"/"0.16" (deprecated spelling only), "0.15" (no
prompt_tokens_by_source, no offload series: prefix-cache counters only). Feature gates: FEATURES below.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field, replace
from typing import Iterator

GIB = 2 ** 30
START_EPOCH = 1_795_295_300.0  # fake unix time of the first process start (near the fixtures' own)

# feature -> first version that has it (docs/vllm-metrics.md)
FEATURES: dict[str, tuple[int, int]] = {
    "by_source": (0, 16),           # vllm:prompt_tokens_by_source_total
    "offload_deprecated": (0, 16),  # vllm:kv_offload_total_bytes_total{transfer_type}
    "mfu": (0, 17),                 # vllm:estimated_*_per_gpu_total
    "waiting_by_reason": (0, 20),
    "iteration_tokens": (0, 23),
    "offload_flat": (0, 24),        # kv_offload_{store,load}_{bytes,time}, stores_skipped, cpu_cache_usage
    "allocation_failure": (0, 26),
    "tiering": (0, 28),             # vllm:kv_offload_tiering_* {tier} (with Scenario.tiers)
    "request_num_preemptions": (0, 30),
    "cached_by_source": (0, 32),
    "kv_fetch_by_stage": (0, 32),   # vllm:num_requests_kv_fetch_by_stage{stage}, with a connector that loads
    "offload_config_info": (0, 33),
}

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
ITER_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
OFFLOAD_SIZE_BUCKETS = (2.0 ** 20, 2.0 ** 22, 2.0 ** 24, 2.0 ** 26, 2.0 ** 28, 2.0 ** 30)
# vLLM's kv_cache_residency buckets (--kv-cache-metrics; the 0.32 CPU captures in tests/data/kv-cache-metrics)
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0,
                     120.0, 300.0, 600.0, 1200.0, 1800.0)


def _floor(v: float) -> int:
    """Counters accumulate fractional rates; on the wire they are whole (1e-6 absorbs float drift)."""
    return math.floor(v + 1e-6)


def parse_version(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int(parts[1])


def has(version: str, feature: str) -> bool:
    return parse_version(version) >= FEATURES[feature]


# --------------------------------------------------------------------------------------------------------
# scenario description
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """Steady engine behaviour for a stretch of simulated time. Rates are server-wide, per second."""

    name: str
    duration_seconds: float | None = None  # None: lasts until switched (the last timeline entry)
    generation_tokens_per_second: float = 0.0
    prompt_tokens_per_second: float = 0.0
    local_compute_share: float = 1.0        # of prompt tokens; local_cache_hit = 1 - compute - external
    external_kv_transfer_share: float = 0.0
    preemptions_per_minute: float = 0.0
    kv_usage_ratio: float = 0.0             # mean of vllm:kv_cache_usage_perc
    kv_usage_jitter_ratio: float = 0.0      # uniform +- around the mean, clipped to [0, 1]
    running: int = 0
    waiting: int = 0
    waiting_deferred: int = 0               # part of ``waiting`` with reason="deferred"
    offload_store_bytes_per_second: float | None = None  # None: (computed prompt + generated) x KV bytes
    offload_load_bytes_per_second: float | None = None   # None: external tokens x KV bytes
    stores_skipped_per_second: float = 0.0
    allocation_failures_per_second: float = 0.0
    gpu_power_watts: float | None = None    # None: the scenario's idle power
    gpu_power_jitter_watts: float = 0.0
    marginal_joules_per_token: float | None = None  # set: power = P_idle + this x generation rate
    rate_jitter_ratio: float = 0.0          # per-step multiplicative noise on token rates
    ttft_seconds: float = 0.05
    itl_seconds: float = 0.02
    output_tokens_per_request: float = 300.0
    down: bool = False                      # the server does not answer (FakeVllm: refused / 500)
    restart_on_enter: bool = False          # entering this phase restarts vLLM (counters back to 0)
    collapsed: bool = False                 # ground truth: the collapse signature holds here
    # KV-block residency (rendered with Scenario.kv_cache_metrics_sample): evictions, idle time, reuse gaps
    kv_evictions_per_prompt_block: float = 0.0
    kv_idle_before_evict_seconds: float = 1.0
    kv_reuse_gap_seconds: float = 5.0
    kv_reuse_gaps_per_eviction: float = 0.5  # gaps recorded per evicted block (blocks reused before eviction)
    # tokens scheduled again after a preemption (a resumed request's context): they move the write-traffic
    # estimate only, no token counter (vLLM 0.16+ counts first prefills; methods.md s4)
    recomputed_tokens_per_second: float = 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    timeline: tuple[Phase, ...]
    extra_phases: tuple[Phase, ...] = ()    # reachable only through set_phase()
    version: str = "0.33"
    model_name: str = "meta-llama/Llama-3.1-8B-Instruct"
    offload_buffer_gib: float | None = 64.0  # None: offloading off (kv_offloading_size="None")
    gpu_idle_watts: float = 150.0           # P_idle with the model loaded (H200-class, assumed)
    kv_bytes_per_token: int = 131072        # Llama-3.1-8B bf16: 2*32*8*128*2
    active_parameters: float = 8.03e9
    num_gpu_blocks: int = 5000
    block_size: int = 16
    engines: int = 1
    seed: int = 0
    slow_jitter_seconds: float = 0.0        # >0: piecewise-constant noise blocks (window-to-window spread)
    slow_jitter_generation_ratio: float = 0.0  # coefficient of variation of the generation rate per block
    slow_jitter_joules_ratio: float = 0.0      # ... of marginal J/token per block (marginal_joules phases)
    tiers: tuple[str, ...] = ()             # vLLM tiering secondary tiers ("1:fs", ...): offload ON, 0.28+
    preemption_reasons: bool = False        # a build with vLLM PR #58037: num_preemptions_by_reason{reason}
    kv_cache_metrics_sample: float | None = None  # vLLM --kv-cache-metrics with this --kv-cache-metrics-sample
    # vLLM's write-traffic estimate (--enable-mfu-metrics): bytes per scheduled token (None: kv_bytes_per_token)
    # and per token that gets logits (a generated one); the tiny Llama's config.json gives 5,632 and 4,096
    write_bytes_per_token: float | None = None
    write_bytes_per_logits_token: float = 0.0

    def phase(self, name: str) -> Phase:
        for p in self.timeline + self.extra_phases:
            if p.name == name:
                return p
        raise KeyError(f"scenario {self.name!r} has no phase {name!r}")

    @property
    def offload_enabled(self) -> bool:
        return self.offload_buffer_gib is not None

    def phase_at(self, seconds: float) -> Phase:
        """The timeline's phase at simulated time ``seconds`` since start."""
        t = 0.0
        for p in self.timeline:
            if p.duration_seconds is None or seconds < t + p.duration_seconds:
                return p
            t += p.duration_seconds
        return self.timeline[-1]

    def collapsed_spans(self) -> list[tuple[float, float, str]]:
        """(start, end, phase) of the timeline's collapsed phases; end = inf for an open last phase."""
        out, t = [], 0.0
        for p in self.timeline:
            end = math.inf if p.duration_seconds is None else t + p.duration_seconds
            if p.collapsed:
                out.append((t, end, p.name))
            t = end
        return out

    def with_version(self, version: str) -> "Scenario":
        return replace(self, version=version)


# --------------------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------------------
COUNTER_KEYS = ("generation_tokens", "prompt_tokens", "preemptions", "prompt_local_compute",
                "prompt_local_cache_hit", "prompt_external_kv_transfer", "offload_store_bytes",
                "offload_load_bytes", "offload_allocation_failures", "offload_stores_skipped", "flops",
                "read_bytes", "write_bytes", "requests", "offload_store_seconds", "offload_load_seconds",
                "engine_steps", "step_tokens", "offload_stores", "offload_loads")


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # cumulative at render, per-bucket here
    total: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, n: int) -> None:
        if n <= 0:
            return
        i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += n
        self.total += n
        self.sum += value * n

    def cumulative(self) -> list[int]:
        out, acc = [], 0
        for c in self.counts:
            acc += c
            out.append(acc)
        return out


class SimEngine:
    """Engine state advanced in steps of simulated time. Not thread-safe (FakeVllm locks around it)."""

    HOST_LINK_BYTES_PER_SECOND = 25e9  # offload transfer time = bytes / this (time counters only)

    def __init__(self, scenario: Scenario, max_step_seconds: float = 1.0):
        self.scenario = scenario
        self.max_step = max_step_seconds
        self.rng = random.Random(scenario.seed)
        self.seconds = 0.0               # simulated time since the start
        self.manual: Phase | None = None  # set_phase() override
        self.restarts = 0
        self._last_phase: Phase | None = None
        self._reset_counters()
        first = self.phase
        self.kv_usage = first.kv_usage_ratio
        self.gpu_power_watts = self._power(first, first.generation_tokens_per_second)
        self.gpu_energy_joules = 0.0
        self._last_phase = first

    # -- state ---------------------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self.counters = {k: 0.0 for k in COUNTER_KEYS}
        self.created = START_EPOCH + self.seconds
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.iteration = _Histogram(ITER_BUCKETS)
        self.store_size = _Histogram(OFFLOAD_SIZE_BUCKETS)
        self.load_size = _Histogram(OFFLOAD_SIZE_BUCKETS)
        self.kv_idle, self.kv_reuse, self.kv_lifetime = (_Histogram(RESIDENCY_BUCKETS) for _ in range(3))
        self._carry = {"requests": 0.0, "itl": 0.0, "steps": 0.0, "stores": 0.0, "loads": 0.0, "evictions": 0.0,
                       "gaps": 0.0}

    @property
    def phase(self) -> Phase:
        return self.manual or self.scenario.phase_at(self.seconds)

    @property
    def running(self) -> int:
        return self.phase.running

    @property
    def waiting(self) -> int:
        return self.phase.waiting

    def set_phase(self, name: str | None) -> None:
        """Pin a phase (any timeline or extra phase) until called again; None resumes the timeline."""
        self.manual = self.scenario.phase(name) if name else None
        self._enter(self.phase)

    def restart(self) -> None:
        """vLLM restarted: every counter and histogram back to 0, new _created and process start times."""
        self.restarts += 1
        self._reset_counters()

    def totals(self) -> dict[str, float]:
        """Counters as they read on the wire (floored), under kvwatt's keys (sources/vllm.py), with the
        prefix-cache aliases the exposition derives from them."""
        t = {k: float(_floor(v)) for k, v in self.counters.items()}
        c = self.counters
        t["prefix_queries"] = t["prompt_tokens"]
        t["prefix_hits"] = t["prompt_local_cache_hit"]
        t["external_prefix_queries"] = float(_floor(c["prompt_tokens"] - c["prompt_local_cache_hit"]))
        t["external_prefix_hits"] = t["prompt_external_kv_transfer"]
        return t

    # -- time ----------------------------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        while seconds > 1e-12:
            dt = min(self.max_step, seconds)
            self._enter(self.phase)
            self._step(dt)
            self.seconds += dt
            seconds -= dt
        self._enter(self.phase)

    def _enter(self, phase: Phase) -> None:
        if phase is not self._last_phase:
            self._last_phase = phase
            if phase.restart_on_enter:
                self.restart()

    def _slow(self, which: str) -> float:
        """Piecewise-constant multiplier 1 + N(0, cv) for the current block (deterministic per seed)."""
        s = self.scenario
        cv = s.slow_jitter_generation_ratio if which == "gen" else s.slow_jitter_joules_ratio
        if s.slow_jitter_seconds <= 0 or cv <= 0:
            return 1.0
        block = int((self.seconds + 1e-9) // s.slow_jitter_seconds)
        return max(0.05, 1.0 + random.Random(f"{s.seed}:{which}:{block}").gauss(0.0, cv))

    def _observe_evictions(self, p: Phase, prompt_tokens: float) -> None:
        """vLLM observes a tracked (sampled) block once, at its eviction: idle time, lifetime, reuse gaps."""
        s = self.scenario
        self._carry["evictions"] += prompt_tokens / s.block_size * p.kv_evictions_per_prompt_block * \
            s.kv_cache_metrics_sample
        n = int(self._carry["evictions"])
        self._carry["evictions"] -= n
        self._carry["gaps"] += n * p.kv_reuse_gaps_per_eviction
        gaps = int(self._carry["gaps"])
        self._carry["gaps"] -= gaps
        self.kv_idle.observe(p.kv_idle_before_evict_seconds, n)
        self.kv_lifetime.observe(p.kv_idle_before_evict_seconds + p.kv_reuse_gap_seconds, n)
        self.kv_reuse.observe(p.kv_reuse_gap_seconds, gaps)

    def _power(self, p: Phase, gen_tokens_per_second: float) -> float:
        idle = self.scenario.gpu_idle_watts
        if p.marginal_joules_per_token is not None and not p.down:
            return idle + p.marginal_joules_per_token * self._slow("joules") * gen_tokens_per_second
        return idle if p.gpu_power_watts is None else p.gpu_power_watts

    def _step(self, dt: float) -> None:
        p, s, c = self.phase, self.scenario, self.counters
        rng = self.rng
        jitter = 1.0 + rng.uniform(-p.rate_jitter_ratio, p.rate_jitter_ratio)
        gen = 0.0 if p.down else p.generation_tokens_per_second * dt * jitter * self._slow("gen")
        # the GPU burns energy even while the server is down
        power = self._power(p, gen / dt) + rng.uniform(-p.gpu_power_jitter_watts, p.gpu_power_jitter_watts)
        self.gpu_power_watts = max(0.0, power)
        self.gpu_energy_joules += self.gpu_power_watts * dt
        if p.down:
            return
        prompt = p.prompt_tokens_per_second * dt * jitter
        compute = prompt * p.local_compute_share
        external = prompt * p.external_kv_transfer_share if s.offload_enabled else 0.0
        hit = max(0.0, prompt - compute - external)
        c["generation_tokens"] += gen
        c["prompt_tokens"] += prompt
        c["prompt_local_compute"] += compute
        c["prompt_local_cache_hit"] += hit
        c["prompt_external_kv_transfer"] += external
        c["preemptions"] += p.preemptions_per_minute / 60.0 * dt
        c["flops"] += 2.0 * s.active_parameters * (compute + gen)
        c["read_bytes"] += 2.0 * s.active_parameters * gen / max(1.0, p.running or 1.0)
        recomputed = p.recomputed_tokens_per_second * dt * jitter
        per_token = s.kv_bytes_per_token if s.write_bytes_per_token is None else s.write_bytes_per_token
        c["write_bytes"] += per_token * (compute + gen + recomputed) + s.write_bytes_per_logits_token * gen
        if s.offload_enabled:
            store = (p.offload_store_bytes_per_second * dt if p.offload_store_bytes_per_second is not None
                     else (compute + gen) * s.kv_bytes_per_token)
            load = (p.offload_load_bytes_per_second * dt if p.offload_load_bytes_per_second is not None
                    else external * s.kv_bytes_per_token)
            c["offload_store_bytes"] += store
            c["offload_load_bytes"] += load
            c["offload_store_seconds"] += store / self.HOST_LINK_BYTES_PER_SECOND
            c["offload_load_seconds"] += load / self.HOST_LINK_BYTES_PER_SECOND
            c["offload_stores_skipped"] += p.stores_skipped_per_second * dt
            c["offload_allocation_failures"] += p.allocation_failures_per_second * dt
            self._observe_transfers(store, load)
        if s.kv_cache_metrics_sample:
            self._observe_evictions(p, prompt)
        # histograms: completed requests, tokens, engine steps
        self._carry["requests"] += gen / max(1.0, p.output_tokens_per_request)
        done = int(self._carry["requests"])
        self._carry["requests"] -= done
        c["requests"] += done
        self.ttft.observe(p.ttft_seconds, done)
        self.e2e.observe(p.ttft_seconds + p.itl_seconds * p.output_tokens_per_request, done)
        self._carry["itl"] += gen
        n_itl = int(self._carry["itl"])
        self._carry["itl"] -= n_itl
        self.itl.observe(p.itl_seconds, n_itl)
        if gen > 0 or compute > 0:
            self._carry["steps"] += dt / max(1e-3, p.itl_seconds)
            steps = int(self._carry["steps"])
            self._carry["steps"] -= steps
            if steps:
                c["engine_steps"] += steps
                c["step_tokens"] += compute + gen
                self.iteration.observe((compute + gen) / steps, steps)
        # gauges at the end of the step
        self.kv_usage = min(1.0, max(0.0, p.kv_usage_ratio + rng.uniform(-p.kv_usage_jitter_ratio,
                                                                          p.kv_usage_jitter_ratio)))

    def _observe_transfers(self, store: float, load: float) -> None:
        chunk = 16 * self.scenario.block_size * self.scenario.kv_bytes_per_token  # bytes per transfer
        for key, amount, hist in (("stores", store, self.store_size), ("loads", load, self.load_size)):
            self._carry[key] += amount / chunk
            n = int(self._carry[key])
            self._carry[key] -= n
            self.counters["offload_" + key] += n
            hist.observe(chunk, n)

    # -- exposition ----------------------------------------------------------------------------------
    def render(self, version: str | None = None) -> str:
        return render(self, version or self.scenario.version)


# --------------------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------------------
try:
    from prometheus_client.utils import floatToGoString as _go
except ImportError:  # pragma: no cover
    def _go(v: float) -> str:
        return "+Inf" if v == math.inf else repr(float(v))


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    esc = (lambda v: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
    return "{" + ",".join(f'{k}="{esc(str(d[k]))}"' for k in sorted(d)) + "}"


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, type_: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {type_}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {_go(float(value))}")

    def counter(self, base: str, help_: str, samples: list[tuple[dict, float]], created: float) -> None:
        self.family(f"vllm:{base}_total", "counter", help_, samples)
        self.family(f"vllm:{base}_created", "gauge", help_, [(lab, created) for lab, _ in samples])

    def histogram(self, base: str, help_: str, per_engine: list[tuple[dict, _Histogram, float]],
                  created: float) -> None:
        name = f"vllm:{base}"
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} histogram")
        for labels, h, share in per_engine:
            cum = [_floor(x * share) for x in h.cumulative()]
            for le, v in zip([_go(b) for b in h.buckets] + ["+Inf"], cum):
                self.lines.append(f"{name}_bucket{_labels({**labels, 'le': le})} {_go(v)}")
            self.lines.append(f"{name}_count{_labels(labels)} {_go(cum[-1])}")
            self.lines.append(f"{name}_sum{_labels(labels)} {_go(h.sum * share)}")
        self.family(f"{name}_created", "gauge", help_, [(lab, created) for lab, _, _ in per_engine])


def _shares(n: int) -> list[float]:
    return [1.0 / n] * n


def render(eng: SimEngine, version: str) -> str:
    """The /metrics text of ``eng`` as vLLM ``version`` would write it (see FEATURES)."""
    s, c = eng.scenario, eng.counters
    out = _Out()
    base_labels = [{"engine": str(i), "model_name": s.model_name} for i in range(s.engines)]
    shares = _shares(s.engines)

    def split(value: float, floor: bool = True) -> list[tuple[dict, float]]:
        return [(lab, _floor(value * sh) if floor else value * sh) for lab, sh in zip(base_labels, shares)]

    def with_label(extra: dict[str, str], value: float, floor: bool = True) -> list[tuple[dict, float]]:
        return [({**lab, **extra}, v) for lab, v in split(value, floor)]

    # the API server's own series first, as in the real expositions
    out.family("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.",
               [({}, eng.created - 20.0)])
    out.family("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", [({}, 6.4e8)])
    p = eng.phase
    running, waiting = (0, 0) if p.down else (p.running, p.waiting)
    if has(version, "mfu"):
        for base, key, text in (("estimated_flops_per_gpu", "flops", "floating point operations"),
                                ("estimated_read_bytes_per_gpu", "read_bytes", "bytes read from memory"),
                                ("estimated_write_bytes_per_gpu", "write_bytes", "bytes written to memory")):
            out.counter(base, f"Estimated number of {text} per GPU (for Model Flops Utilization calculations).",
                        split(c[key]), eng.created)
    out.family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
               split(running, floor=False))
    out.family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               split(waiting, floor=False))
    if has(version, "waiting_by_reason"):
        deferred = min(p.waiting_deferred, waiting)
        out.family("vllm:num_requests_waiting_by_reason", "gauge",
                   "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                   "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
                   "status). Sum of all reasons equals vllm:num_requests_waiting.",
                   with_label({"reason": "capacity"}, waiting - deferred, False)
                   + with_label({"reason": "deferred"}, deferred, False))
    if has(version, "kv_fetch_by_stage") and s.offload_enabled:
        # the deferred waiting requests wait for an asynchronous KV load in progress
        out.family("vllm:num_requests_kv_fetch_by_stage", "gauge",
                   "Number of waiting requests by async KV load stage. Stage labels: 'waiting_to_start' = needs "
                   "an async KV load that has not started; 'in_progress' = load started and not yet reported "
                   "finished; 'completed_waiting' = load finished, request not running yet.",
                   with_label({"stage": "waiting_to_start"}, 0.0, False)
                   + with_label({"stage": "in_progress"}, min(p.waiting_deferred, waiting), False)
                   + with_label({"stage": "completed_waiting"}, 0.0, False))
    out.family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               [(lab, eng.kv_usage) for lab in base_labels])
    prompt, hit = c["prompt_tokens"], c["prompt_local_cache_hit"]
    out.counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                split(prompt), eng.created)
    out.counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                split(hit), eng.created)
    out.counter("external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance "
                "cache sharing, in terms of number of queried tokens.", split(prompt - hit), eng.created)
    out.counter("external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
                "sharing, in terms of number of cached tokens.", split(c["prompt_external_kv_transfer"]),
                eng.created)
    out.counter("num_preemptions", "Cumulative number of preemption from the engine.", split(c["preemptions"]),
                eng.created)
    if s.preemption_reasons:  # every preemption here is for lack of KV blocks
        out.counter("num_preemptions_by_reason", "Cumulative number of preemptions by reason.",
                    with_label({"reason": "kv_full"}, c["preemptions"])
                    + with_label({"reason": "priority"}, 0.0) + with_label({"reason": "prefix_cache_reset"}, 0.0),
                    eng.created)
    out.counter("prompt_tokens", "Number of prefill tokens processed.", split(prompt), eng.created)
    if has(version, "by_source"):
        out.counter("prompt_tokens_by_source", "Number of prompt tokens by source.",
                    with_label({"source": "local_compute"}, c["prompt_local_compute"])
                    + with_label({"source": "local_cache_hit"}, hit)
                    + with_label({"source": "external_kv_transfer"}, c["prompt_external_kv_transfer"]),
                    eng.created)
    if has(version, "cached_by_source"):
        cached = hit + c["prompt_external_kv_transfer"]
        out.counter("prompt_tokens_cached", "Number of cached prompt tokens (local + external).", split(cached),
                    eng.created)
        samples = []
        # with a disk tier behind the CPU one, a quarter of the reloaded tokens come from it (as its read bytes
        # are a quarter of the loads, _render_tiers)
        disk = c["prompt_external_kv_transfer"] / 4 if any(t.endswith(":fs") for t in s.tiers) else 0.0
        for src, v in (("device", hit), ("host", c["prompt_external_kv_transfer"] - disk), ("p2p", 0.0),
                       ("disk", disk), ("external_unspecified", 0.0)):
            samples += with_label({"source": src}, v)
        out.counter("prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that supplied "
                    "them.", samples, eng.created)
    out.counter("generation_tokens", "Number of generation tokens processed.", split(c["generation_tokens"]),
                eng.created)
    samples = []
    for reason in ("stop", "length", "abort", "error"):
        samples += with_label({"finished_reason": reason}, c["requests"] if reason == "length" else 0.0)
    out.counter("request_success", "Count of successfully processed requests.", samples, eng.created)
    hists = [("time_to_first_token_seconds", "Histogram of time to first token in seconds.", eng.ttft),
             ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", eng.itl),
             ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", eng.e2e)]
    if has(version, "iteration_tokens"):
        hists.insert(0, ("iteration_tokens_total", "Histogram of number of tokens per engine_step.", eng.iteration))
    if s.kv_cache_metrics_sample:
        hists += [("kv_block_idle_before_evict_seconds", "Idle time before eviction of sampled KV blocks.",
                   eng.kv_idle),
                  ("kv_block_reuse_gap_seconds", "Time between consecutive accesses of sampled KV blocks.",
                   eng.kv_reuse),
                  ("kv_block_lifetime_seconds", "Allocation to eviction of sampled KV blocks.", eng.kv_lifetime)]
    for base, help_, h in hists:
        out.histogram(base, help_, [(lab, h, sh) for lab, sh in zip(base_labels, shares)], eng.created)
    if s.offload_enabled:
        _render_offload(out, eng, version, split, with_label, base_labels, shares)
    _render_cache_config(out, eng, version)
    return "\n".join(out.lines) + "\n"


def _render_offload(out: _Out, eng: SimEngine, version: str, split, with_label, base_labels, shares) -> None:
    c, created = eng.counters, eng.created
    if has(version, "offload_deprecated"):
        out.counter("kv_offload_total_bytes", "Number of transferred bytes (deprecated).",
                    with_label({"transfer_type": "CPU_to_GPU"}, c["offload_load_bytes"])
                    + with_label({"transfer_type": "GPU_to_CPU"}, c["offload_store_bytes"]), created)
        out.counter("kv_offload_total_time", "Total transfer time in seconds (deprecated).",
                    with_label({"transfer_type": "CPU_to_GPU"}, c["offload_load_seconds"], False)
                    + with_label({"transfer_type": "GPU_to_CPU"}, c["offload_store_seconds"], False), created)
    if has(version, "offload_flat"):
        out.counter("kv_offload_load_bytes", "Bytes loaded from the offload tier to the GPU.",
                    split(c["offload_load_bytes"]), created)
        out.counter("kv_offload_load_time", "Seconds spent loading from the offload tier.",
                    split(c["offload_load_seconds"], False), created)
        out.counter("kv_offload_store_bytes", "Bytes stored from the GPU to the offload tier.",
                    split(c["offload_store_bytes"]), created)
        out.counter("kv_offload_store_time", "Seconds spent storing to the offload tier.",
                    split(c["offload_store_seconds"], False), created)
        out.counter("kv_offload_stores_skipped", "Stores skipped by the offload connector.",
                    split(c["offload_stores_skipped"]), created)
        out.histogram("kv_offload_load_size", "Bytes per offload load.",
                      [(lab, eng.load_size, sh) for lab, sh in zip(base_labels, shares)], created)
        out.histogram("kv_offload_store_size", "Bytes per offload store.",
                      [(lab, eng.store_size, sh) for lab, sh in zip(base_labels, shares)], created)
        pinned = 0.02 if eng.phase.generation_tokens_per_second > 0 else 0.0
        out.family("vllm:kv_offload_cpu_cache_usage_perc", "gauge",
                   "Fraction of the CPU cache pinned by in-flight transfers.", [(lab, pinned) for lab in base_labels])
    if has(version, "allocation_failure"):
        out.counter("kv_offload_allocation_failure", "Offload chunk allocation failures (cannot store).",
                    split(c["offload_allocation_failures"]), created)
    if has(version, "tiering") and eng.scenario.tiers:
        _render_tiers(out, eng, with_label)


# One MiB chunks; of what enters the CPU (primary) tier, each secondary tier i (1-based) gets 1/(2i) cascaded
# and gives back 1/(4i) of the loads; cascade jobs fail like the primary tier's allocations, and its
# back-pressure drops 1/i stores of 8 blocks as often. Tier i reads at 1/i of TIER_READ_BYTES_PER_SECOND and
# writes at 1/i of TIER_WRITE_BYTES_PER_SECOND per second of transfer (its _read_time/_write_time counters).
TIER_CHUNK_BYTES = 2 ** 20
TIER_READ_BYTES_PER_SECOND = 3e9  # an NVMe-class read (kv_offload_tiering_read_bytes / _read_time)
TIER_WRITE_BYTES_PER_SECOND = 1.5e9
TIER_LOOKUP_SECONDS = 2e-5  # the scheduler's blocking time per resolved chunk lookup
TIER_LOOKUP_WAIT_SECONDS = 0.004  # a lookup that answered "retry" until it resolved (the fs tier's async lookup)
TIER_LOOKUP_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10)


def _render_tiers(out: _Out, eng: SimEngine, with_label) -> None:
    """The tiering series as vLLM 0.32 defines them (vllm/v1/kv_offload/tiering/spec.py: counters with a
    ``tier`` label "<index>:<type>"; help texts copied from there)."""
    c, created = eng.counters, eng.created
    series: dict[str, tuple[str, list]] = {
        "kv_offload_tiering_write_bytes": ("Total bytes written from the primary tier to secondary tiers, "
                                           "labeled by tier.", []),
        "kv_offload_tiering_read_bytes": ("Total bytes read from secondary tiers into the primary tier, "
                                          "labeled by tier.", []),
        "kv_offload_tiering_read_time": ("Total time spent reading from secondary tiers into the primary tier, in "
                                         "seconds, labeled by tier.", []),
        "kv_offload_tiering_write_time": ("Total time spent writing from the primary tier to secondary tiers, in "
                                          "seconds, labeled by tier.", []),
        "kv_offload_tiering_chunk_queries": ("Number of chunk lookup queries sent to a tier, labeled by tier.", []),
        "kv_offload_tiering_chunk_hits": ("Number of chunk lookup hits in a tier, labeled by tier.", []),
        "kv_offload_tiering_promotion_job_failures": ("Number of failed secondary-tier promotion jobs, labeled "
                                                      "by tier.", []),
        "kv_offload_tiering_cascade_job_failures": ("Number of failed secondary-tier cascade jobs, labeled by "
                                                    "tier.", []),
        "kv_offload_tiering_backpressure_stores_dropped": ("Number of store operations dropped due to "
                                                           "back-pressure on a secondary tier.", []),
        "kv_offload_tiering_backpressure_blocks_dropped": ("Number of blocks dropped due to back-pressure on a "
                                                           "secondary tier.", []),
    }
    for i, tier in enumerate(eng.scenario.tiers, start=1):
        written = c["offload_store_bytes"] / (2 * i)
        read = c["offload_load_bytes"] / (4 * i)
        queries = c["offload_load_bytes"] / TIER_CHUNK_BYTES
        dropped = c["offload_allocation_failures"] / i  # back-pressure drops a store (of 8 blocks) as often
        values = (written, read, read / (TIER_READ_BYTES_PER_SECOND / i), written / (TIER_WRITE_BYTES_PER_SECOND / i),
                  queries, queries / (2 * i), 0.0, c["offload_allocation_failures"], dropped, 8 * dropped)
        for (name, (_, samples)), v in zip(series.items(), values):
            samples += with_label({"tier": tier}, v, floor=not name.endswith("_time"))  # seconds: fractional
    for name, (help_, samples) in series.items():
        out.counter(name, help_, samples, created)
    # the lookup histograms: every resolved chunk lookup blocks TIER_LOOKUP_SECONDS x i, half of them first wait
    # TIER_LOOKUP_WAIT_SECONDS x i on the tier's asynchronous lookup
    for base, help_, per_lookup, waited in (
            ("kv_offload_tiering_lookup_sync_delay_seconds", "Histogram of blocking time spent in a per-chunk tier "
             "lookup that resolved as a hit or miss, labeled by tier, in seconds.", TIER_LOOKUP_SECONDS, 1.0),
            ("kv_offload_tiering_lookup_async_delay_seconds", "Histogram of wall-clock time from a per-chunk tier "
             "lookup first returning retry until that same tier lookup resolves as a hit or miss, labeled by tier, "
             "in seconds.", TIER_LOOKUP_WAIT_SECONDS, 0.5)):
        per_engine = []
        for i, tier in enumerate(eng.scenario.tiers, start=1):
            h = _Histogram(TIER_LOOKUP_BUCKETS)
            h.observe(per_lookup * i, int(c["offload_load_bytes"] / TIER_CHUNK_BYTES * waited))
            per_engine += [(lab, h, share) for lab, share in with_label({"tier": tier}, 1.0, floor=False)]
        out.histogram(base, help_, per_engine, created)


def _render_cache_config(out: _Out, eng: SimEngine, version: str) -> None:
    s = eng.scenario
    size = "None" if s.offload_buffer_gib is None else str(float(s.offload_buffer_gib))
    samples = []
    for i in range(s.engines):
        samples.append(({"block_size": str(s.block_size), "cache_dtype": "auto", "enable_prefix_caching": "True",
                         "engine": str(i), "gpu_memory_utilization": "0.9", "kv_offloading_backend": "native",
                         "kv_offloading_size": size, "num_cpu_blocks": "None",
                         "num_gpu_blocks": str(s.num_gpu_blocks), "num_gpu_blocks_override": "None",
                         "prefix_caching_hash_algo": "sha256", "sliding_window": "None"}, 1.0))
    out.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", samples)
    if s.offload_enabled and has(version, "offload_config_info"):
        size_bytes = int(s.offload_buffer_gib * GIB)
        tokens = size_bytes // s.kv_bytes_per_token
        per_chunk = 16
        info = [({"cpu_kv_cache_size_bytes": str(size_bytes), "cpu_kv_cache_size_tokens": str(tokens),
                  "cpu_num_chunks": str(tokens // (s.block_size * per_chunk)),
                  "cpu_blocks_per_chunk": str(per_chunk), "engine": str(i), "model_name": s.model_name}, 1.0)
                for i in range(s.engines)]
        out.family("vllm:kv_offload_config_info", "gauge", "Configuration of the KV offloading CPU cache.", info)


# --------------------------------------------------------------------------------------------------------
# intervals without HTTP: what the lead's window store would hold
# --------------------------------------------------------------------------------------------------------
def simulate_intervals(scenario: Scenario, seconds: float, step: float = 1.0, version: str | None = None,
                       with_gpu_energy: bool = True, with_idle: bool = True,
                       engine: SimEngine | None = None) -> list:
    """Advance ``scenario`` for ``seconds`` in ``step`` ticks and return exporter.samples.Interval objects.

    Deltas are the floored wire counters (reset-corrected: a restart's delta is the new value), under the
    keys sources/vllm.py uses, only for the series ``version`` exports. A down tick breaks the chain: no
    interval spans an outage. energy_joules["gpu"] / idle_joules["gpu"] are filled unless disabled.
    """
    from exporter.samples import Interval

    version = version or scenario.version
    eng = engine or SimEngine(scenario)
    keys = _wire_keys(scenario, version)
    out: list[Interval] = []
    prev = None  # (t, totals, energy, restarts)
    n = int(round(seconds / step))
    for _ in range(n):
        eng.advance(step)
        t = eng.seconds
        if eng.phase.down:
            prev = None
            continue
        tot, energy = eng.totals(), eng.gpu_energy_joules
        if prev is not None:
            t0, ptot, penergy, prestarts = prev
            reset = eng.restarts != prestarts
            deltas = {k: (tot[k] if reset or tot[k] < ptot[k] else tot[k] - ptot[k]) for k in keys}
            gauges = {"kv_usage": eng.kv_usage, "running": float(eng.running), "waiting": float(eng.waiting)}
            if has(version, "waiting_by_reason"):
                gauges["waiting_deferred"] = float(min(eng.phase.waiting_deferred, eng.waiting))
                gauges["waiting_capacity"] = float(eng.waiting) - gauges["waiting_deferred"]
            e = {"gpu": energy - penergy} if with_gpu_energy else {}
            idle = {"gpu": scenario.gpu_idle_watts * (t - t0)} if (with_gpu_energy and with_idle) else {}
            out.append(Interval(t0=t0, t1=t, deltas=deltas, gauges=gauges, energy_joules=e, idle_joules=idle))
        prev = (t, tot, energy, eng.restarts)
    return out


def _wire_keys(scenario: Scenario, version: str) -> list[str]:
    keys = ["generation_tokens", "prompt_tokens", "preemptions", "prefix_queries", "prefix_hits",
            "external_prefix_queries", "external_prefix_hits"]
    if has(version, "by_source"):
        keys += ["prompt_local_compute", "prompt_local_cache_hit", "prompt_external_kv_transfer"]
    if has(version, "mfu"):
        keys.append("flops")
    if has(version, "iteration_tokens"):
        keys.append("engine_steps")  # vllm:iteration_tokens_total_count
    if scenario.offload_enabled and has(version, "offload_deprecated"):
        keys += ["offload_store_bytes", "offload_load_bytes"]
    if scenario.offload_enabled and has(version, "offload_flat"):
        keys.append("offload_stores_skipped")
    if scenario.offload_enabled and has(version, "allocation_failure"):
        keys.append("offload_allocation_failures")
    return keys


# --------------------------------------------------------------------------------------------------------
# scenario builders
# --------------------------------------------------------------------------------------------------------
# Llama-3.1-8B on an H200-class GPU, agentic multi-turn traffic (methods.md s2 and s5 magnitudes):
# loaded 446-565 W, 117-158k generated tokens per 60 s window ~ 2,000-2,600 tok/s, collapse at 177-182 W.
STEADY_GEN_TPS = 2400.0
STEADY_PROMPT_TPS = 24000.0
LOADED_WATTS = 500.0
COLLAPSE_WATTS = 180.0
IDLE_WATTS = 150.0


def _steady_on(name: str = "steady", duration: float | None = None, **kw) -> Phase:
    base = dict(name=name, duration_seconds=duration, generation_tokens_per_second=STEADY_GEN_TPS,
                prompt_tokens_per_second=STEADY_PROMPT_TPS, local_compute_share=0.032,
                external_kv_transfer_share=0.165, preemptions_per_minute=0.0, kv_usage_ratio=0.90,
                kv_usage_jitter_ratio=0.035, running=24, waiting=2, gpu_power_watts=LOADED_WATTS,
                gpu_power_jitter_watts=15.0, rate_jitter_ratio=0.05, ttft_seconds=0.25, itl_seconds=0.03)
    base.update(kw)
    return Phase(**base)


def _collapse(name: str = "collapse", duration: float | None = None) -> Phase:
    # methods.md s5: zero preemptions, output near zero, GPU power ~180 W, requests still in flight,
    # KV pinned high. The engine waits for pending block frees instead of preempting.
    return Phase(name=name, duration_seconds=duration, generation_tokens_per_second=20.0,
                 prompt_tokens_per_second=0.0, local_compute_share=0.0, external_kv_transfer_share=0.0,
                 preemptions_per_minute=0.0, kv_usage_ratio=0.99, kv_usage_jitter_ratio=0.005, running=28,
                 waiting=14, waiting_deferred=10, offload_store_bytes_per_second=0.0,
                 offload_load_bytes_per_second=0.0, gpu_power_watts=COLLAPSE_WATTS, gpu_power_jitter_watts=2.0,
                 rate_jitter_ratio=0.3, ttft_seconds=40.0, itl_seconds=5.0, collapsed=True)


def _idle(name: str = "idle", duration: float | None = None, kv: float = 0.0) -> Phase:
    return Phase(name=name, duration_seconds=duration, kv_usage_ratio=kv, gpu_power_watts=IDLE_WATTS,
                 gpu_power_jitter_watts=2.0)


def stable_high_pressure_on(version: str = "0.33", seed: int = 1) -> Scenario:
    """Offloading ON, p95 KV ~0.93, no preemptions (the offload tier absorbs eviction), good throughput."""
    return Scenario("stable_high_pressure_on", (_steady_on(),), extra_phases=(_collapse(), _idle()),
                    version=version, seed=seed)


def collapsing_on(version: str = "0.33", steady_seconds: float = 300.0, seed: int = 2) -> Scenario:
    """Steady ON under pressure, then the collapse (methods.md s5) for the rest of the run."""
    return Scenario("collapsing_on", (_steady_on(duration=steady_seconds), _collapse()),
                    extra_phases=(_idle(),), version=version, seed=seed)


def recovering_on(version: str = "0.33", steady_seconds: float = 300.0, collapse_seconds: float = 180.0,
                  seed: int = 3) -> Scenario:
    """Steady, collapse, then throughput returns (the stall clears)."""
    return Scenario("recovering_on", (_steady_on(duration=steady_seconds), _collapse(duration=collapse_seconds),
                                      _steady_on(name="recovered")),
                    extra_phases=(_idle(),), version=version, seed=seed)


def undersized_buffer_on(version: str = "0.33", seed: int = 4) -> Scenario:
    """8 GiB buffer at ~0.9 GiB/s write: residency ~9 s < 20 s p99 tool latency; allocation failures and
    skipped stores rising ("cannot store chunks"); preemption stays alive; external transfers small."""
    phase = _steady_on(local_compute_share=0.15, external_kv_transfer_share=0.03, preemptions_per_minute=6.0,
                       kv_usage_ratio=0.91, offload_store_bytes_per_second=0.9 * GIB,
                       stores_skipped_per_second=4.0, allocation_failures_per_second=4.0)
    return Scenario("undersized_buffer_on", (phase,), version=version, offload_buffer_gib=8.0, seed=seed)


def low_pressure_off(version: str = "0.33", seed: int = 5) -> Scenario:
    """Offloading OFF, p95 KV ~0.8, no preemptions, local_compute ~4 %."""
    phase = _steady_on(generation_tokens_per_second=1500.0, prompt_tokens_per_second=15000.0,
                       local_compute_share=0.039, external_kv_transfer_share=0.0, kv_usage_ratio=0.72,
                       kv_usage_jitter_ratio=0.08, running=8, waiting=0, gpu_power_watts=430.0)
    return Scenario("low_pressure_off", (phase,), extra_phases=(_idle(),), version=version,
                    offload_buffer_gib=None, seed=seed)


def high_pressure_off(version: str = "0.33", seed: int = 6) -> Scenario:
    """Offloading OFF under pressure: ~11 preemptions/min (55 per 5 min), local_compute share ~21 %."""
    phase = _steady_on(generation_tokens_per_second=1900.0, local_compute_share=0.213,
                       external_kv_transfer_share=0.0, preemptions_per_minute=11.0, kv_usage_ratio=0.92,
                       kv_usage_jitter_ratio=0.04, running=22, waiting=6, gpu_power_watts=540.0)
    return Scenario("high_pressure_off", (phase,), extra_phases=(_idle(),), version=version,
                    offload_buffer_gib=None, seed=seed)


def idle_server(version: str = "0.33", offload: bool = True, seed: int = 7) -> Scenario:
    """Model loaded, no requests: zero throughput, zero preemptions, power at idle; not a collapse."""
    return Scenario("idle_server", (_idle(),), extra_phases=(_steady_on(), _collapse()), version=version,
                    offload_buffer_gib=64.0 if offload else None, seed=seed)


def restarting_on(version: str = "0.33", steady_seconds: float = 300.0, down_seconds: float = 20.0,
                  quiet_seconds: float = 30.0, seed: int = 8) -> Scenario:
    """Steady ON, vLLM goes away (connection refused, GPU at a sub-idle power without the CUDA context),
    comes back with counters at 0 and no requests, then load returns. Not a collapse at any point."""
    down = Phase(name="down", duration_seconds=down_seconds, down=True, gpu_power_watts=90.0)
    back = _idle(name="restarted", duration=quiet_seconds)
    back = replace(back, restart_on_enter=True)
    return Scenario("restarting_on", (_steady_on(duration=steady_seconds), down, back,
                                      _steady_on(name="steady_again")), version=version, seed=seed)


ALL_DETECTOR_SCENARIOS = ("stable_high_pressure_on", "collapsing_on", "recovering_on", "undersized_buffer_on",
                          "low_pressure_off", "high_pressure_off", "idle_server", "restarting_on")


def build(name: str, **kw) -> Scenario:
    return globals()[name](**kw)


# --------------------------------------------------------------------------------------------------------
# Table 1 (methods.md s2) as synthetic ON/OFF pairs
# --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Table1Condition:
    """One condition of the energy study's Table 1: the dE% and dTPS% to encode and their SE (%).

    ``collapsed_fraction`` > 0 marks the extreme-pressure, large-buffer conditions in which ON runs collapsed
    (methods.md s5: 6 of 9 runs); their values are derived by collapsed_condition(), not printed in the study.
    """

    name: str
    kv_p95: float
    preemptions_per_window: float
    dE_pct: float
    dE_se_pct: float
    dTPS_pct: float
    dTPS_se_pct: float
    source: str = "methods.md s2 Table 1"
    collapsed_fraction: float = 0.0


TABLE1_OFF_JOULES_PER_TOKEN = 0.15   # marginal GPU J/token of the OFF runs (scale only; ratios matter)
TABLE1_OFF_TOKENS_PER_SECOND = 2000.0
TABLE1_WINDOWS = 12                  # repeats (non-overlapping windows) the synthetic pairs are built for

# methods.md s5 magnitudes for the collapsed runs, and the one assumption the study does not give (P_idle)
COLLAPSE_HEALTHY_WATTS = 505.0       # loaded ON power, middle of 446-565 W
COLLAPSE_STALLED_WATTS = 180.0       # 177-182 W
COLLAPSE_TOKEN_RATIO = 27.0 / 137.5  # ~27k tokens per window, from 117-158k (mean 137.5k)
COLLAPSE_IDLE_WATTS = IDLE_WATTS     # assumed P_idle (not reported by the study)


def collapsed_condition(name: str, kv_p95: float, collapsed_of_3: int, healthy: "Table1Condition | None" = None,
                        n_windows: int = TABLE1_WINDOWS) -> Table1Condition:
    """An extreme-pressure condition where ``collapsed_of_3`` of 3 ON runs (here: windows) collapsed; the
    three such conditions below collapse 1, 2 and 3 of 3 (6 of 9, methods.md s5). Derivation for 2 of 3, all ratios
    to the OFF run (x_OFF = 1), the healthy ON run behaving like coding c=6 (dE +31.9 %, dTPS +32.3 %):

      TPS_h = 1.323, J_h = 0.681 (marginal J/token); P_h - P_idle = 505 - 150 = 355 W
      collapsed window: tokens x 27/137.5 of healthy, marginal power 180 - 150 = 30 W
      TPS_c = 0.196 TPS_h = 0.259;  J_c = (30 / 355) / 0.196 x J_h = 0.294
      ON over the windows (1/3 healthy, 2/3 collapsed), total energy over total tokens: J = (0.681 x 1.323 +
      2 x 0.294 x 0.259) / (1.323 + 2 x 0.259) = 0.572 -> dE = +42.8 % (the mean of the windows' ratios, the
      study's per-run mean, gave +57.7 %: a collapsed window weighs by its few tokens); TPS = 0.614 -> -38.6 %
      SE from the two-point spread over n windows (sample sd, n - 1) plus the healthy condition's OFF noise.

    The positive dE is real arithmetic, not a saving: a stalled GPU sits near idle, so idle-subtracted J/token
    falls while throughput collapses. docs/offload.md ("dE under collapse") says why dE must be read together
    with dTPS and the collapse signature.
    """
    healthy = healthy or TABLE1[5]
    p = collapsed_of_3 / 3.0
    j_h, t_h = 1.0 - healthy.dE_pct / 100.0, 1.0 + healthy.dTPS_pct / 100.0
    t_c = COLLAPSE_TOKEN_RATIO * t_h
    j_c = ((COLLAPSE_STALLED_WATTS - COLLAPSE_IDLE_WATTS) / (COLLAPSE_HEALTHY_WATTS - COLLAPSE_IDLE_WATTS)
           / COLLAPSE_TOKEN_RATIO * j_h)
    t_on = (1 - p) * t_h + p * t_c
    j_on = ((1 - p) * j_h * t_h + p * j_c * t_c) / t_on  # total energy over total tokens (methods.md s2)
    spread = math.sqrt(p * (1 - p) * n_windows / (n_windows - 1))  # sample sd of a 0/1 mix, exact counts
    cv_off_e, cv_off_t = table1_noise_ratio(healthy, n_windows)
    # a ratio of sums' SE (delta method): the spread of E_w - J N_w over the mean N; tokens/s over equal seconds
    residual = abs((j_h - j_on) * t_h - (j_c - j_on) * t_c)
    se_on_e, se_on_t = spread * residual / t_on / math.sqrt(n_windows), spread * abs(t_h - t_c) / math.sqrt(n_windows)
    se_off = 1.0 / math.sqrt(n_windows)
    se_e = j_on * math.hypot(se_on_e / j_on, cv_off_e * se_off)
    se_t = t_on * math.hypot(se_on_t / t_on, cv_off_t * se_off)
    return Table1Condition(name, kv_p95, 0.0, round((1 - j_on) * 100, 1), round(se_e * 100, 1),
                           round((t_on - 1) * 100, 1), round(se_t * 100, 1),
                           source="derived from methods.md s5 (collapsed_condition)", collapsed_fraction=p)


def table1_noise_ratio(cond: Table1Condition, n_windows: int = TABLE1_WINDOWS) -> tuple[float, float]:
    """Per-window coefficient of variation of (J/token, tokens/s), the same for ON and OFF, such that the
    delta-method SE over ``n_windows`` repeats equals the condition's stated SE:
    SE = r * cv * sqrt(2/n)  =>  cv = SE * sqrt(n/2) / r, with r = x_ON/x_OFF (methods.md s2)."""
    r_e = 1.0 - cond.dE_pct / 100.0
    r_t = 1.0 + cond.dTPS_pct / 100.0
    k = math.sqrt(n_windows / 2.0)
    return cond.dE_se_pct / 100.0 * k / r_e, cond.dTPS_se_pct / 100.0 * k / r_t


TABLE1: tuple[Table1Condition, ...] = (
    Table1Condition("office c=2", 0.819, 0.0, 2.0, 0.6, -1.3, 1.4),
    Table1Condition("coding c=4", 0.788, 0.3, 2.1, 4.8, 1.2, 1.1),
    Table1Condition("office c=3", 0.874, 0.3, 3.9, 5.5, 0.5, 1.4),
    Table1Condition("coding c=5", 0.907, 13, 15.3, 0.3, 10.6, 0.4),
    Table1Condition("office c=4 (buf 32)", 0.925, 40, 26.5, 6.2, 16.9, 10.7),
    Table1Condition("coding c=6", 0.938, 55, 31.9, 0.9, 32.3, 1.4),
)
TABLE1 = TABLE1 + (  # the three extreme-pressure, large-buffer conditions: derived, see collapsed_condition
    collapsed_condition("extreme-1 (buf 64, 1 of 3 collapsed)", 0.96, 1),
    collapsed_condition("extreme-2 (buf 64, 2 of 3 collapsed)", 0.97, 2),
    collapsed_condition("extreme-3 (buf 64, 3 of 3 collapsed)", 0.98, 3),
)


def table1_pair(cond: Table1Condition, version: str = "0.33", window_seconds: float = 60.0,
                n_windows: int = TABLE1_WINDOWS, seed: int | None = None) -> tuple[Scenario, Scenario]:
    """(ON, OFF) scenarios whose per-window marginal GPU J/token and tokens/s have the encoded means and a
    window-to-window spread giving the condition's stated SE over ``n_windows`` windows.

    Power = P_idle + J x generation rate, with J and the rate drawn per ``window_seconds`` block (slow jitter),
    so a window aligned on the blocks has exactly that J/token. Collapsing conditions: the ON timeline
    repeats [healthy, collapsed, collapsed] windows (Phase.collapsed marks the latter); the OFF run has the
    healthy condition's noise. Conditions that did not collapse have no collapsed phase. ``seed`` defaults
    to one derived from the condition's name, so conditions get independent noise.
    """
    if seed is None:
        seed = zlib.crc32(cond.name.encode()) % 100_000
    tps_off, j_off = TABLE1_OFF_TOKENS_PER_SECOND, TABLE1_OFF_JOULES_PER_TOKEN
    lc_off = min(0.5, 0.04 + 0.2 * max(0.0, cond.kv_p95 - 0.85) / 0.1)
    common = dict(prompt_tokens_per_second=10 * tps_off, kv_usage_ratio=min(0.99, cond.kv_p95 - 0.03),
                  kv_usage_jitter_ratio=0.03, gpu_power_jitter_watts=0.0, rate_jitter_ratio=0.0)
    if cond.collapsed_fraction:
        healthy = TABLE1[5]
        cv_e, cv_t = table1_noise_ratio(healthy, n_windows)
        j_h, t_h = 1.0 - healthy.dE_pct / 100.0, 1.0 + healthy.dTPS_pct / 100.0
        t_c = COLLAPSE_TOKEN_RATIO * t_h
        j_c = ((COLLAPSE_STALLED_WATTS - COLLAPSE_IDLE_WATTS) / (COLLAPSE_HEALTHY_WATTS - COLLAPSE_IDLE_WATTS)
               / COLLAPSE_TOKEN_RATIO * j_h)
        h = _steady_on(name="on", duration=window_seconds, generation_tokens_per_second=t_h * tps_off,
                       local_compute_share=0.033, external_kv_transfer_share=0.2, preemptions_per_minute=0.0,
                       marginal_joules_per_token=j_h * j_off, **common)
        c = replace(_collapse(name="on_collapsed", duration=window_seconds),
                    generation_tokens_per_second=t_c * tps_off, marginal_joules_per_token=j_c * j_off,
                    gpu_power_watts=None)
        k = round(cond.collapsed_fraction * 3)
        on_timeline = tuple(ph for _ in range(n_windows // 3 + 1) for ph in (h,) * (3 - k) + (c,) * k)
        on_jitter = dict(slow_jitter_seconds=window_seconds)  # ON spread comes from the mixture
        off_preempt = healthy.preemptions_per_window / 5.0
    else:
        cv_e, cv_t = table1_noise_ratio(cond, n_windows)
        on_timeline = (_steady_on(name="on", generation_tokens_per_second=tps_off * (1 + cond.dTPS_pct / 100),
                                  local_compute_share=0.033,
                                  external_kv_transfer_share=min(0.3, max(0.004, lc_off - 0.033)),
                                  preemptions_per_minute=0.0,
                                  marginal_joules_per_token=j_off * (1 - cond.dE_pct / 100), **common),)
        on_jitter = dict(slow_jitter_seconds=window_seconds, slow_jitter_generation_ratio=cv_t,
                         slow_jitter_joules_ratio=cv_e)
        off_preempt = cond.preemptions_per_window / 5.0
    off = _steady_on(name="off", generation_tokens_per_second=tps_off, local_compute_share=lc_off,
                     external_kv_transfer_share=0.0, preemptions_per_minute=off_preempt,
                     marginal_joules_per_token=j_off, **common)
    off_jitter = dict(slow_jitter_seconds=window_seconds, slow_jitter_generation_ratio=cv_t,
                      slow_jitter_joules_ratio=cv_e)
    return (Scenario(f"table1 ON {cond.name}", on_timeline, version=version, seed=seed, **on_jitter),
            Scenario(f"table1 OFF {cond.name}", (off,), version=version, offload_buffer_gib=None,
                     seed=seed + 1000, **off_jitter))


def iter_phases(scenario: Scenario) -> Iterator[Phase]:
    yield from scenario.timeline
    yield from scenario.extra_phases
