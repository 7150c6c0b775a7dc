"""Generated engine sequences for the bounds fuzzer (tests/test_fuzz_bounds.py, bench/fuzz_bounds.py): each tick a
vLLM 0.32 exposition (a real capture's text with its counters and gauges rewritten) decoded by the real vLLM
adapter (EngineSource.decode), a GPU energy reading, and the real Model; after every tick every family of the
checked snapshot is held to its declared bound (exporter/catalog/bounds.py).

What a sequence may do, tick by tick: counters that reset, jump, go back or stall; a second process behind the same
URL (its own counters and start time); a start time that moves (forward, into the future, back); GPU energy
missing for some ticks, or power below the configured idle (a stale P_idle); the token mix shifting from
decode-heavy to prompt-heavy; offloading switched on and off; KV usage NaN, +-Inf, negative or above 1. With
offloading on, the reloaded prompt tokens come from the host or the disk tier (vLLM 0.32's
``prompt_tokens_cached_by_source``) and vLLM's tiering counters move (``kv_offload_tiering_*{tier="0:primary"|"1:fs"}``:
bytes written and read, chunk queries and hits, back-pressure drops, promotion and cascade job failures), on a
server with a configured fs tier capacity (servers[].offload_tier_bytes) and a disk priced, by the sequence's length,
cheaper or dearer than a recompute (disk_joules_per_byte): the per-tier figures (kvwatt_offload_tier_*,
kvwatt_offload_second_tier_energy_saving_ratio) are served and held to their bounds and relations. Beside
the fuzzed server ``s`` a second, unread server ``q`` whose learning or derivation raises at a "derive_fail" or
"learn_fail" event (issue 38 item 1: one server's failure is that server's, never the tick's): ``q`` is then
served unknown with ``derivation_failed``, and ``s``'s figures and the snapshot's time go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from exporter import catalog
from exporter.catalog import bounds
from exporter.config import from_mapping
from exporter.model import Model
from exporter.samples import DeviceReading, ServerRead, SourceStatus, Tick
from exporter.serve.collector import render
from exporter.serve.web import status_json
from exporter.sources.endpoint import EngineSource
from exporter.sources.engine import SourceError
from exporter.sources.vllm import NEEDED_FAMILIES
from tests.conftest import FIXTURES

TEMPLATE = (FIXTURES / "idle" / "000.prom").read_text()
WALL = 1.75e9
IDLE_WATTS = 60.0
POWER_LIMIT_WATTS = 700.0  # the GPU's enforced limit (NVML): a step drawing more is an impossible input
LIMIT_RELATIONS = frozenset({"gpu_power_within_limit", "window_power_within_limit"})
EVENTS = ("normal", "normal", "normal", "normal", "reset", "jump", "gen_jump", "back", "stall", "flap",
          "start_forward", "start_future", "start_back", "offload_toggle", "derive_fail", "learn_fail")
FAILURES = {"derive_fail": "figures", "learn_fail": "learn"}  # the bystander q's method that raises that tick
JUMPS = frozenset({"jump", "gen_jump"})  # a counter up by more than any engine counts in one read
# the defects item 3 leaves to the identity store (store/identity.py, another change): a start time that moves
# forward or into the future, and a second process, are counted whole today; the bounds check rejects the
# figures that follows (token_rate and the figures priced from them) instead of serving them
IDENTITY_EVENTS = frozenset({"start_forward", "start_future", "flap"})
KV_VALUES = (0.0, 0.3, 0.5, 0.8, 0.92, 0.97, 1.0, float("nan"), float("inf"), float("-inf"), -0.5, 1.7)


@dataclass(frozen=True)
class Step:
    event: str
    generated: float  # tokens this second
    prompt: float
    computed_share: float  # of the prompt tokens
    reloaded_share: float  # of the rest, when offloading
    watts: float  # GPU power this second
    energy: bool  # a GPU energy sample this tick
    kv: float
    preemptions: float
    disk_share: float = 0.0  # of the reloaded prompt tokens, served from the fs tier (the rest from host memory)
    tier_faults: float = 0.0  # back-pressure drops and failed promotion/cascade jobs of the fs tier this tick


steps = st.builds(
    Step, event=st.sampled_from(EVENTS), generated=st.floats(0, 4000), prompt=st.floats(0, 40_000),
    computed_share=st.floats(0, 1), reloaded_share=st.floats(0, 1),
    watts=st.one_of(st.floats(0, 1000), st.sampled_from((0.0, 30.0, IDLE_WATTS, 700.0))),
    energy=st.sampled_from((True, True, True, True, False)), kv=st.sampled_from(KV_VALUES),
    preemptions=st.sampled_from((0.0, 0.0, 0.0, 1.0, 5.0)), disk_share=st.sampled_from((0.0, 0.3, 0.5, 1.0)),
    tier_faults=st.sampled_from((0.0, 0.0, 0.0, 1.0, 3.0)))
sequences = st.lists(steps, min_size=3, max_size=30)


# vLLM's tiering (0.28+; tier "<index>:<type>") and 0.32's cached tokens by tier: Process counter -> series
_T = 'engine="0",model_name="tiny"'
TIER_SERIES = {
    "host": f'vllm:prompt_tokens_cached_by_source_total{{{_T},source="host"}}',
    "disk": f'vllm:prompt_tokens_cached_by_source_total{{{_T},source="disk"}}',
    "load": f"vllm:kv_offload_load_bytes_total{{{_T}}}"} | {
    f"{key}@{tier}": f'vllm:kv_offload_tiering_{series}_total{{{_T},tier="{tier}"}}'
    for tier in ("0:primary", "1:fs")
    for key, series in (("write", "write_bytes"), ("read", "read_bytes"), ("queries", "chunk_queries"),
                        ("hits", "chunk_hits"))} | {
    f"{key}@1:fs": f'vllm:kv_offload_tiering_{series}_total{{{_T},tier="1:fs"}}'
    for key, series in (("drop_stores", "backpressure_stores_dropped"), ("drop_blocks", "backpressure_blocks_dropped"),
                        ("promo_fail", "promotion_job_failures"), ("cascade_fail", "cascade_job_failures"))}
TIER_COUNTERS = tuple(TIER_SERIES)
# created at their first increment in vLLM (a tier's chunk hits, its job failures): no sample while 0
_LAZY = frozenset(k for k in TIER_COUNTERS if k.startswith(("hits@", "promo_fail@", "cascade_fail@")))
BYTES_PER_TOKEN = 65536.0  # what a reloaded token moves over the link
FS_CAPACITY_BYTES = 2e9  # servers[].offload_tier_bytes of the fs tier
# the fs tier's J/byte, by the sequence's length: a disk reload cheaper, dearer, far dearer than a recompute
DISK_JOULES_PER_BYTE = (2e-9, 2e-6, 1e-3)
# the families served only by an offloading server with tiering counters: the generator must reach each one
# (tests/test_fuzz_bounds.py asserts it, bench/fuzz_bounds.py prints the families never served)
TIER_FAMILIES = frozenset({
    "kvwatt_offload_tier_write_bytes_per_second", "kvwatt_offload_tier_read_bytes_per_second",
    "kvwatt_offload_tier_chunk_hit_ratio", "kvwatt_offload_tier_job_failures",
    "kvwatt_offload_tier_residency_seconds", "kvwatt_offload_tier_undersized",
    "kvwatt_offload_tier_dropped_stores_per_second", "kvwatt_offload_tier_dropped_blocks_per_second",
    "kvwatt_offload_tier_failed_promotions_per_second", "kvwatt_offload_tier_failed_cascades_per_second",
    "kvwatt_offload_tier_reload_joules_per_token", "kvwatt_offload_tier_breakeven_ratio",
    "kvwatt_offload_tier_cached_to_prefill_ratio", "kvwatt_offload_tier_reload_watts",
    "kvwatt_offload_tier_saved_watts", "kvwatt_offload_second_tier_energy_saving_ratio"})


@dataclass
class Process:
    start: float
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("gen", "computed", "cached", "reloaded", "preempt", "store", *TIER_COUNTERS), 0.0))


def _name(line: str) -> str:
    parts = line.split()
    if line.startswith("#"):
        return parts[2] if len(parts) > 2 else ""
    return line.split("{", 1)[0].split(" ", 1)[0]


# the capture, less the families the vLLM adapter does not read (a faster decode; the same code path)
_KEEP = NEEDED_FAMILIES | {"process_start_time_seconds"}
_LINES = [ln for ln in TEMPLATE.split("\n") if ln and _name(ln) in _KEEP]
_E = '{engine="0",model_name="tiny"}'
_SERIES = {"start": "process_start_time_seconds", "gen": f"vllm:generation_tokens_total{_E}",
           "prompt": f"vllm:prompt_tokens_total{_E}", "preempt": f"vllm:num_preemptions_total{_E}",
           "kv": f"vllm:kv_cache_usage_perc{_E}"} | {
    key: f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="tiny",source="{source}"}}'
    for source, key in (("local_compute", "computed"), ("local_cache_hit", "cached"),
                        ("external_kv_transfer", "reloaded"))}
_SERIES["device"] = f'vllm:prompt_tokens_cached_by_source_total{{{_T},source="device"}}'
_AT = {key: next(i for i, ln in enumerate(_LINES) if ln.startswith(series + " "))
       for key, series in (_SERIES | TIER_SERIES).items() if any(ln.startswith(series + " ") for ln in _LINES)}
_CACHE_CONFIG = next(i for i, ln in enumerate(_LINES) if ln.startswith("vllm:cache_config_info{"))


def exposition(p: Process, kv: float, offload: bool) -> str:
    c = p.counters
    lines = list(_LINES)
    values = {"start": p.start, "prompt": c["computed"] + c["cached"] + c["reloaded"], "kv": kv} | {
        k: c[k] for k in ("gen", "computed", "cached", "reloaded")} | {"preempt": c["preempt"]}
    for key, value in values.items():
        lines[_AT[key]] = f"{_SERIES[key]} {value!r}"
    lines[_AT["device"]] = f'{_SERIES["device"]} {c["cached"]!r}'
    if offload:
        lines[_CACHE_CONFIG] = lines[_CACHE_CONFIG].replace('kv_offloading_size="None"', 'kv_offloading_size="8"')
        lines.append(f'vllm:kv_offload_store_bytes_total{_E} {c["store"]!r}')
    for key in TIER_COUNTERS:  # the tier series stay once offloading was on (counters of the same process)
        if key in _AT:
            lines[_AT[key]] = f"{TIER_SERIES[key]} {c[key]!r}"
        elif (offload or c[key]) and not (key in _LAZY and c[key] <= 0):
            lines.append(f"{TIER_SERIES[key]} {c[key]!r}")
    return "\n".join(lines) + "\n"


def config(tmp_path, disk_joules_per_byte: float = DISK_JOULES_PER_BYTE[0]):
    return from_mapping({
        "servers": [{"name": "s", "url": "http://s.invalid:8000", "gpus": ["GPU-0"],
                     "reference_local_compute_share": 0.05, "offload_tier_bytes": {"1:fs": FS_CAPACITY_BYTES}},
                    {"name": "q", "url": "http://q.invalid:8000"}],  # the bystander that fails (FAILURES)
        "windows": ["5s", "20s"], "min_load_duration": "2s", "collapse_reference_window": "6s",
        "threshold_window": "4s", "phase_min_windows": 4,
        "idle_power_watts": {"GPU-0": IDLE_WATTS}, "electricity_price_per_kwh": 0.25, "electricity_currency": "EUR",
        "carbon_intensity_g_per_kwh": 380,
        "host_memory_joules_per_byte": 1.5e-10, "host_link_joules_per_byte": 6e-11,
        "disk_joules_per_byte": disk_joules_per_byte,
        "state_dir": str(tmp_path / "state"), "powercap_root": str(tmp_path / "no-powercap"), "nvml": False})


# What an implausible input explains: a figure of these bound kinds rejected after that input is the check doing
# its job (the input itself was impossible); any other rejection is a figure kvwatt derived wrongly, a defect.
EXPLAINS = {
    # counters counted whole by store/identity.py (another change), and what is computed from those counts
    "identity": frozenset({"token_rate", bounds.DEPENDENT}),
    # 1e7 tokens in one read (3e8 generated tokens: the generation counter alone): more than any engine generates,
    # and the figures computed from the same counts (bounds.DEPENDENCIES)
    "jump": frozenset({"token_rate", bounds.DEPENDENT}),
    "stale_idle": frozenset({"joules_per_token", "priced"}),  # P_idle above the power: marginal J/token < 0
    # the GPU above its enforced limit: the relations LIMIT_RELATIONS (attributed where they are counted) and the
    # money and CO2 priced from the J/token they take
    "over_limit": frozenset({"priced"}),
}


# Relations today's derivations break, each to be fixed on another branch: a figure the relation serves as unknown
# after such a breach is the relation doing its job, counted apart (bench/fuzz_bounds.py prints them under
# "pending:<relation>"); any other breach is a defect. Empty since issue 37's fixes merged (dE as a ratio of sums,
# the recommendation in fractional GiB, the advice on the regime's window): every breach is a defect now.
PENDING_RELATIONS: dict[str, str] = {}


@dataclass
class Outcome:
    """What one sequence gave: violations of the served figures (must be none), and the raw figures the check
    rejected, by family, bound kind and cause: the implausible inputs seen so far whose EXPLAINS cover the kind
    ("identity", "jump", "stale_idle", joined by "+"), or "" when none does (a defect of kvwatt's own)."""

    served: list[str] = field(default_factory=list)
    rejected: dict[tuple[str, str, str], int] = field(default_factory=dict)
    ticks: int = 0
    covered: set[str] = field(default_factory=set)  # the families served with a value at some tick
    snapshot: object = None  # the last tick's checked snapshot


def advance(step: Step, p: Process, offload: bool) -> None:
    c = p.counters
    computed = step.prompt * step.computed_share
    rest = step.prompt - computed
    reloaded = rest * step.reloaded_share if offload else 0.0
    c["gen"] += round(step.generated)
    c["computed"] += round(computed)
    c["reloaded"] += round(reloaded)
    c["cached"] += round(rest - reloaded)
    c["preempt"] += step.preemptions
    c["store"] += reloaded * BYTES_PER_TOKEN if offload else 0.0
    if offload:
        _advance_tiers(step, c, round(reloaded))


def _advance_tiers(step: Step, c: dict[str, float], reloaded: float) -> None:
    """The reloaded tokens by tier and what vLLM's tiering counts for them: the CPU tier (0:primary) loads every
    reloaded token to the GPU, the fs tier (1:fs) promotes the disk tokens into it (whole chunks: twice the bytes)
    and takes the cascaded stores; its back-pressure drops and failed jobs with the step's faults."""
    disk = round(reloaded * step.disk_share)
    c["host"] += reloaded - disk
    c["disk"] += disk
    c["load"] += reloaded * BYTES_PER_TOKEN
    c["read@0:primary"] += reloaded * BYTES_PER_TOKEN
    c["write@0:primary"] += step.prompt * step.computed_share * BYTES_PER_TOKEN
    if step.disk_share != 0.3:  # at 0.3 the disk tokens come with no promotion read: priced at the link's bytes
        c["read@1:fs"] += disk * 2 * BYTES_PER_TOKEN
    c["write@1:fs"] += step.prompt * step.computed_share * BYTES_PER_TOKEN * (1 - step.disk_share)
    for tier, hit in (("0:primary", reloaded - disk), ("1:fs", disk)):
        c[f"queries@{tier}"] += reloaded // 16 + 1
        c[f"hits@{tier}"] += hit // 16
    c["drop_stores@1:fs"] += step.tier_faults
    c["drop_blocks@1:fs"] += step.tier_faults * 4
    c["promo_fail@1:fs"] += step.tier_faults if step.disk_share > 0.4 else 0.0
    c["cascade_fail@1:fs"] += step.tier_faults if step.disk_share < 0.6 else 0.0


def run(seq: list[Step], tmp_path) -> Outcome:
    t_now = [0.0]
    disk_price = DISK_JOULES_PER_BYTE[len(seq) % len(DISK_JOULES_PER_BYTE)]
    model = Model(config(tmp_path, disk_price), wall_clock=lambda: WALL + t_now[0])
    check = bounds.BoundsCheck(catalog.METRICS)
    src = EngineSource("s", "http://s.invalid:8000", 2.0, 1 << 24)
    procs = [Process(WALL - 3600.0), Process(WALL - 1800.0)]
    procs[1].counters = {k: 1e6 for k in procs[1].counters}
    active, offload, joules, causes = 0, False, 0.0, set()
    out = Outcome()
    for i, step in enumerate(seq):
        t = float(i + 1)
        t_now[0] = t
        p = procs[active]
        ev = step.event
        if ev in IDENTITY_EVENTS:
            causes.add("identity")
        if ev in JUMPS:
            causes.add("jump")
        if step.energy and step.watts < IDLE_WATTS:
            causes.add("stale_idle")
        if step.watts > POWER_LIMIT_WATTS * (1 + bounds.POWER_LIMIT_TOLERANCE):
            causes.add("over_limit")
        if ev == "reset":
            p.counters = dict.fromkeys(p.counters, 0.0)
            p.start = WALL + t - 0.5
        elif ev == "jump":  # 1e7 tokens in one read: more than any engine generates, the check's to reject
            p.counters = {k: v + 1e7 for k, v in p.counters.items()}
        elif ev == "gen_jump":  # issue 38 item 3: a one-off 3e8 jump of the generation counter alone
            p.counters["gen"] += 3e8
        elif ev == "back":
            p.counters = {k: max(v - 500.0, 0.0) for k, v in p.counters.items()}
        elif ev == "flap":
            active = 1 - active
            p = procs[active]
        elif ev == "start_forward":
            p.start += 7200.0 if p.start + 7200.0 < WALL + t else 1.0
        elif ev == "start_future":
            p.start = WALL + t + 7200.0
        elif ev == "start_back":
            p.start -= 100.0
        elif ev == "offload_toggle":
            offload = not offload
        if ev != "stall":
            advance(step, p, offload)
        _inject_failure(model.servers["q"], FAILURES.get(ev))
        joules += step.watts
        text = exposition(p, step.kv, offload)
        problems: list[str] = []
        try:
            reading = src.decode(text, problems)
            status = src.status(problems, 0.01)
        except SourceError as e:
            reading, status = None, src.down(e, 0.01)
        gpu = DeviceReading(device="gpu:GPU-0", kind="gpu", labels={"gpu": "0", "uuid": "GPU-0"},
                            joules_total=joules if step.energy else None, continuous=step.energy,
                            power_watts=step.watts, method="counter", temperature_celsius=40.0,
                            read_at=t if step.energy else None, power_limit_watts=POWER_LIMIT_WATTS)
        model.ingest(Tick(t, {"s": ServerRead("s", status, reading)},
                          (SourceStatus(source="nvml", server="", up=True, reason="", duration_seconds=0.003,
                                        state="ok"),), (gpu,)))
        raw = model.snapshot()
        out.served += [f"tick {i}: {v}" for v in isolation_broken(raw, t, FAILURES.get(ev))]
        snap = check.apply(raw)
        for r in snap.implausible:
            key = (r.figure, r.kind, "+".join(sorted(c for c in causes if r.kind in EXPLAINS[c])))
            if r.kind == bounds.RELATION:
                name = r.reason.removeprefix("inconsistent: ").split(":", 1)[0]
                cause = f"pending:{name}" if name in PENDING_RELATIONS else ""
                if name in LIMIT_RELATIONS and "over_limit" in causes:
                    cause = "over_limit"  # the GPU drew more than its enforced limit: an impossible input
                key = (r.figure, r.kind, cause)
            out.rejected[key] = out.rejected.get(key, 0) + 1
        out.served += [f"tick {i}: {r.reason} {dict(r.labels)}" for r in bounds.violations(catalog.METRICS, snap)]
        out.served += [f"tick {i}: {v}" for v in relations_served(snap)]
        out.served += [f"tick {i}: {v}" for v in dependents_served(snap)]
        out.served += [f"tick {i}: {v}" for v in learned_from_implausible(model)]
        out.covered |= served_families(snap)
        out.ticks += 1
    out.snapshot = snap
    render(snap)  # the renderers take what is served without error (once: they only serialise)
    status_json(snap)
    return out


def served_families(snap) -> set[str]:
    """The families with at least one value served in ``snap``."""
    return {m.name for m in catalog.METRICS if any(v is not None for _labels, v in m.fill(snap))}


def _fail(*_args, **_kwargs):
    raise ArithmeticError("injected by the fuzzer")


def _inject_failure(sm, method: str | None) -> None:
    """The bystander's ``method`` raises this tick (an instance attribute shadows it); the others are its own."""
    for name in FAILURES.values():
        sm.__dict__.pop(name, None)
    if method is not None:
        setattr(sm, method, _fail)


def isolation_broken(raw, t: float, failing: str | None) -> list[str]:
    """What a failure of the bystander q did beyond q: the snapshot not of this tick, s degraded by it, or q's
    failure not said."""
    by_name = {f.name: f for f in raw.servers}
    out = [] if raw.t == t else [f"snapshot of t={raw.t}, not this tick's {t}"]
    if "derivation_failed" in (by_name["s"].status.reason or ""):
        out.append(f"s degraded by q's failure: {by_name['s'].status.reason}")
    if failing and "derivation_failed" not in (by_name["q"].status.reason or ""):
        out.append(f"q's failing {failing} not said: {by_name['q'].status.reason!r}")
    return out


def own_rejections(o: Outcome) -> dict[tuple[str, str], int]:
    """Raw figures rejected with no implausible input to explain them: defects of kvwatt's own derivations."""
    return {(fig, kind): n for (fig, kind, cause), n in o.rejected.items() if not cause}


def relations_served(snap) -> list[str]:
    """Declared relations (bounds.RELATIONS) the served snapshot still breaks: must be none."""
    broken, _clears = bounds.relation_breaks(snap, catalog.BY_NAME, [])
    return [f"{r.figure}{dict(r.labels)}: {r.reason}" for r in broken
            if r.figure in catalog.BY_NAME or not _cleared_elsewhere(r, snap)]


def _cleared_elsewhere(r, snap) -> bool:
    """A relation's figure with no family (Relation.clear) is served unknown when its server's figure is None."""
    rel = next(rel for rel in bounds.RELATIONS if rel.name == r.figure)
    if rel.clear is None:
        return True  # listed only (the advice's words: another change words them)
    server = next(s for s in snap.servers if s.name == dict(r.labels).get("server"))
    return rel.clear(server, "") == server


def dependents_served(snap) -> list[str]:
    """Figures served although computed from counts shown implausible in their window (bounds.DEPENDENCIES): by a
    rejected witness or by the model's own finding (WindowFigures.implausible_counts). Must be none."""
    rejected = {(r.figure, dict(r.labels).get("server"), dict(r.labels).get("window")) for r in snap.implausible}
    out = []
    for s in snap.servers:
        for w in s.windows:
            for dep in bounds.DEPENDENCIES:
                if (dep.witness, s.name, w.window) not in rejected and dep.counts not in (w.implausible_counts or {}):
                    continue
                for name in (dep.witness, *dep.dependents):
                    d = catalog.BY_NAME[name]
                    out += [f"{name}{labels} = {value!r} served, computed from {dep.words} shown implausible"
                            for labels, value in d.fill(snap)
                            if value is not None and labels[d.labels.index("server")] == s.name
                            and labels[d.labels.index("window")] == w.window]
    return out


def learned_from_implausible(model) -> list[str]:
    """Windows of a learner's history with more generated tokens than any server produces: nothing learned from
    counts the check would reject (the per-phase costs' history; model/plausible.py). Must be none."""
    out = []
    for name, sm in model.servers.items():
        ceiling = bounds.token_rate_ceiling(sm.engines, len(sm.server.gpus))
        for scope, kept in sm.phase.windows.items():
            out += [f"{name} {scope} phase history holds {o.generated:.4g} generated tokens in {sm.phase.width:g} s"
                    for o in kept if o.generated / sm.phase.width > ceiling]
    return out
