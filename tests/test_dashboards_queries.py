"""Every dashboard query returns data on a real Prometheus that scraped a real kvwatt daemon.

The stack, all on loopback:
- two simulated vLLM servers (tests/support/loopback.py over vllm_sim.py, in wall-clock time): ``on``
  offloads with an undersized buffer under high pressure (preemptions, failing stores, external KV transfers),
  ``off`` is its high-pressure OFF twin;
- the NVML test double (GPU 0 follows the ON scenario's power, GPU 1 the OFF server's) and a RAPL powercap
  tree whose counters a thread advances, with configured idle baselines;
- a real ``kvwatt run`` watching both servers (``on`` paired with ``off``, model and hardware configured) and a
  third, ``down``, whose address nothing listens on: every figure of it is unknown, which the first row must
  show as "unknown", never as clear or off;
- the Debian ``prometheus`` (tests/support/prom.py) scraping kvwatt (job ``kvwatt``) and both servers (job
  ``vllm``, each target labelled ``server`` with kvwatt's name of it, as deploy/ does: docs/fleet.md) every
  second, with kvwatt's alert rules loaded plus one probe alert: kvwatt's own alerts wait minutes in ``for:``,
  so without it the alerts table would be legitimately empty here.

Then, as Grafana would: each query variable is resolved by its own ``label_values`` query (a variable without
options fails), multi variables are substituted as All (``.+``) and, in a second pass, as a user's selection
(kvwatt's job and instance, the ON server, regex-escaped), single variables take their default or first option,
``$__rate_interval`` is 4 x the scrape interval; time-series targets run as range queries over the last 30 s, table
targets as instant queries. Every target must return at least one series, and every ``{{label}}`` of its legend must be
a label of what it returns; with one server picked, every series returned must be that server's (the variables are
chained: picking the server is enough, vLLM's series included). Failures name the dashboard, the panel title and the
refId, and say whether the series is missing from Prometheus altogether. Last, the overview's first row is read as
Grafana shows it (values through the panel's value mappings) for each of the three servers.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator

import pytest
import yaml

from tests.support import powercap, prom, vllm_sim
from tests.support.daemon import KvwattDaemon, free_port
from tests.support.fake_gpus import FakeGpus
from tests.support.grafana import ROOT, displayed, expand, format_value, load_dashboards, panels, targets, variables
from tests.support.loopback import FakeVllm

pytestmark = pytest.mark.prom

SCRAPE_SECONDS = 1
# Grafana: $__rate_interval = max($__interval + scrape interval, 4 x scrape interval); $__interval is never
# below the datasource's scrape interval (jsonData.timeInterval), so with a short range it is 4 x scrape.
RATE_INTERVAL = f"{4 * SCRAPE_SECONDS}s"
RANGE_SECONDS = 30  # the panel time range the range queries cover (ending now)
DEADLINE_SECONDS = 100  # from the stack's start: windows fill, min load duration passes, rates get 2 samples
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
SERIES = re.compile(r"\b(?:kvwatt_[a-z0-9_]+|vllm:[a-z0-9_:]+|ALERTS)\b")
GPU_ON, GPU_OFF = "GPU-00000000-kvwatt-on", "GPU-11111111-kvwatt-off"
PROBE_RULES = {"groups": [{"name": "kvwatt-dashboard-test", "rules": [{
    "alert": "KVWattDashboardProbe", "expr": "kvwatt_server_info", "for": "0s",
    "labels": {"severity": "info"}, "annotations": {"summary": "Dashboard query test probe."}}]}]}


# --- the stack ---------------------------------------------------------------------------------------------

class RaplTicker:
    """Advances the powercap tree's package and dram counters as a loaded two-socket host would."""

    WATTS = {"intel-rapl:0": 120.0, "intel-rapl:1": 95.0, "intel-rapl:0:1": 12.0, "intel-rapl:1:1": 10.0}
    IDLE_WATTS = {"rapl:package-0:package": 40.0, "rapl:package-1:package": 35.0,
                  "rapl:package-0:dram": 4.0, "rapl:package-1:dram": 3.0}

    def __init__(self, tree: powercap.PowercapTree):
        self.tree = tree
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(0.1):
            now = time.monotonic()
            for zone, watts in self.WATTS.items():
                self.tree.advance(zone, joules=watts * (now - last))
            last = now


@dataclass
class Stack:
    prometheus: prom.Prometheus
    daemon: KvwattDaemon
    on: FakeVllm
    off: FakeVllm
    started: float

    @property
    def kvwatt_instance(self) -> str:
        return self.daemon.url.removeprefix("http://")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prom.require_binaries()
    tmp = tmp_path_factory.mktemp("dashboards-queries")
    gpus = FakeGpus(tmp / "gpus.json")
    tree = powercap.intel_two_socket(tmp / "rapl", psys=False, mmio=False)
    ticker = RaplTicker(tree)
    model = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "active_parameters": 8.03e9,
             "hidden_size": 4096}
    hardware = {"flops_per_second": 4.0e14, "host_device_bytes_per_second": 5.0e10}
    rules = tmp / "probe-rules.yml"
    rules.write_text(yaml.safe_dump(PROBE_RULES), encoding="utf-8")
    rule_files = [rules, *sorted((ROOT / "alerts").glob("kvwatt-rules.y*ml"))]
    # the ON server runs vLLM's tiering with a disk tier behind its CPU one: the tier row reads its series
    on_scenario = replace(vllm_sim.undersized_buffer_on(), tiers=("1:fs",))
    with FakeVllm(on_scenario) as on, FakeVllm(vllm_sim.high_pressure_off()) as off:
        # GPU 0 follows the ON scenario's power; GPU 1 (OFF) burns a constant 540 W. One writer only: two
        # FakeVllm tickers rewriting the same NVML state file would race on its temporary file.
        gpus.add(GPU_OFF, power_mw=540_000, counter_follows_power=True, t0=time.monotonic())
        on.attach_gpu(gpus, GPU_ON)
        servers = {
            "on": {"url": on.url, "gpus": [GPU_ON], "pair_off_server": "off", "reference_local_compute_share": 0.04,
                   "model": model, "hardware": hardware},
            "off": {"url": off.url, "gpus": [GPU_OFF], "reference_local_compute_share": 0.04, "model": model,
                    "hardware": hardware},
            "down": {"url": f"http://127.0.0.1:{free_port()}"},  # nothing listens: all its figures unknown
        }
        vllm_targets = [{"targets": [server.url.removeprefix("http://")], "labels": {"server": name}}
                        for name, server in (("on", on), ("off", off))]
        config = {"windows": ["10s", "30s"], "powercap_root": tree.root, "min_load_duration": "3s",
                  "idle_power_watts": {GPU_ON: vllm_sim.IDLE_WATTS, GPU_OFF: vllm_sim.IDLE_WATTS,
                                       **RaplTicker.IDLE_WATTS},
                  # the money-and-carbon panels' series exist only when these are configured
                  "electricity_price_per_kwh": 0.25, "electricity_currency": "EUR",
                  "carbon_intensity_g_per_kwh": 400}
        ticker.thread.start()
        try:
            with KvwattDaemon(servers=servers, config=config, env=gpus.env()) as daemon, \
                    prom.Prometheus(tmp, {"kvwatt": [daemon.url.removeprefix("http://")], "vllm": vllm_targets},
                                    rule_files=rule_files, interval=f"{SCRAPE_SECONDS}s") as p:
                yield Stack(p, daemon, on, off, time.monotonic())
        finally:
            ticker.stop.set()


# --- Grafana's side ----------------------------------------------------------------------------------------

DASHBOARDS = load_dashboards()


Picks = dict[str, "str | list[str]"]


def resolve_variables(p: prom.Prometheus, dashboard: dict[str, Any], picks: Picks, all_multi: bool,
                      problems: list[str]) -> dict[str, str]:
    """Variable -> its text in a query, as Grafana substitutes it. Multi variables are All (``all_multi``) or
    the user's pick from ``picks`` (else the first option); single variables take the pick, else their default
    when it is an option, else the first option (Grafana's behaviour on load)."""
    values = {"__rate_interval": RATE_INTERVAL}
    for v in variables(dashboard):
        if v["type"] != "query":
            continue
        m = LABEL_VALUES.match(v["query"])
        assert m, f"unexpected variable query {v['query']!r}"
        selector, label = expand(m.group(1), values), m.group(2)
        now = time.time()
        found = p.api("series", **{"match[]": selector, "start": now - RANGE_SECONDS, "end": now})
        options = sorted({s[label] for s in found if s.get(label)})
        if not options:
            problems.append(f"variable {v['name']!r}: no values from {selector}")
            values[v["name"]] = "no-value-for-" + v["name"]
            continue
        if v.get("multi") and all_multi:
            chosen = None
        else:
            pick = picks.get(v["name"]) or (None if v.get("multi") else (v.get("current") or {}).get("value"))
            wanted = [pick] if isinstance(pick, str) else list(pick or [])
            chosen = [w for w in wanted if w in options] or options[:1]
        values[v["name"]] = format_value(v, chosen)
    return values


def run_target(p: prom.Prometheus, target: dict[str, Any], values: dict[str, str]) -> list[dict[str, Any]]:
    """A table target as an instant query, a time-series target as a range query over the panel's range."""
    expr = expand(target["expr"], values)
    if target.get("instant") or target.get("format") == "table":
        return p.query(expr)
    now = time.time()
    result = p.api("query_range", query=expr, start=now - RANGE_SECONDS, end=now, step=SCRAPE_SECONDS)["result"]
    return [s for s in result if s.get("values")]


def _hint(p: prom.Prometheus, expr: str) -> str:
    """Tell a dashboard bug from a series kvwatt/vLLM does not export at all."""
    absent = [n for n in SERIES.findall(expr) if not p.query(f'count({{__name__="{n}"}})')]
    if absent:
        return f" [not in Prometheus at all: {', '.join(absent)}]"
    return " [series exist, not with these labels]"


# families a target may find empty in this stack, each with why; test_absent_families_are_declared keeps the list
# honest (every name a catalog family, every reason said)
ABSENT_IN_THIS_STACK = {
    "kvwatt_phase_joules_per_token_stderr": "the simulated engines serve a constant token mix, so the per-phase "
    "costs stay the attribution prior, which has no standard error (the measured path and its SE are tested in "
    "tests/test_phase_energy.py and tests/test_phase_energy_engine.py)",
}


def test_absent_families_are_declared():
    from exporter import catalog
    declared = {d.name for d in catalog.METRICS}
    assert set(ABSENT_IN_THIS_STACK) <= declared and all(ABSENT_IN_THIS_STACK.values())


SERVER_VARIABLES = ("server_on", "server_off", "server")  # longest first: $server is a prefix of the others


def allowed_servers(target: dict[str, Any], picks: Picks) -> set[str]:
    """The server label values a target's series may carry when one server is picked: the pick of the server
    variable the target uses, else (a target that follows no server variable) the dashboard's `server` pick."""
    name = next((n for n in SERVER_VARIABLES if f"${n}" in target["expr"]), "server")
    pick = picks[name]
    allowed = {pick} if isinstance(pick, str) else set(pick)
    # kvwatt_source_up and ALERTS also keep host-wide series (empty server): server=~"$server|"
    return allowed | ({""} if f"${name}|" in target["expr"] else set())


def problems_of(p: prom.Prometheus, picks: Picks, all_multi: bool) -> list[str]:
    problems: list[str] = []
    for filename, dashboard in DASHBOARDS.items():
        var_problems: list[str] = []
        values = resolve_variables(p, dashboard, picks, all_multi, var_problems)
        problems += [f"{filename}: {problem}" for problem in var_problems]
        for panel, target in targets(dashboard):
            at = f"{filename}: panel {panel['title']!r} target {target['refId']}"
            try:
                result = run_target(p, target, values)
            except AssertionError as e:
                problems.append(f"{at}: query failed: {e}")
                continue
            if not result:
                expr = expand(target["expr"], values)
                if set(SERIES.findall(expr)) & set(ABSENT_IN_THIS_STACK):
                    continue  # absent here by design (ABSENT_IN_THIS_STACK says why); declared in the catalog
                problems.append(f"{at}: no series for {expr}{_hint(p, expr)}")
                continue
            labels = set().union(*(s["metric"] for s in result))
            missing = set(LEGEND_LABEL.findall(target.get("legendFormat", ""))) - labels
            if missing:
                problems.append(f"{at}: legend uses {sorted(missing)} but the result only has {sorted(labels)}")
            if not all_multi:
                allowed = allowed_servers(target, picks)
                strays = {s["metric"]["server"] for s in result if "server" in s["metric"]} - allowed
                if strays:
                    problems.append(f"{at}: picked {sorted(allowed)}, got series of {sorted(strays)}")
    return problems


def wait_for_data(stack: Stack, picks: Picks, all_multi: bool) -> list[str]:
    """Re-run everything until nothing is missing or the deadline passes; return what is still missing."""
    while True:
        problems = problems_of(stack.prometheus, picks, all_multi)
        if not problems or time.monotonic() - stack.started > DEADLINE_SECONDS:
            return problems
        time.sleep(3)


PAIR: Picks = {"server_on": "on", "server_off": "off"}  # the experiment's two single-value variables


def test_every_query_returns_data_with_all_selected(stack: Stack):
    problems = wait_for_data(stack, PAIR, all_multi=True)
    assert not problems, f"{len(problems)} dashboard query problems:\n" + "\n".join(problems) + \
        f"\n--- kvwatt log ---\n{stack.daemon.log()}"


def test_every_query_returns_data_for_one_server(stack: Stack):
    """A user looking at the offloading server picks kvwatt's job, its exporter and the server ``on``, nothing
    else: every query, vLLM's included, returns data and only that server's series."""
    picks: Picks = {**PAIR, "job": "kvwatt", "instance": stack.kvwatt_instance, "server": "on"}
    problems = wait_for_data(stack, picks, all_multi=False)
    assert not problems, f"{len(problems)} dashboard query problems:\n" + "\n".join(problems)


def _options(p: prom.Prometheus, query: str) -> list[str]:
    m = LABEL_VALUES.match(query)
    assert m, query
    now = time.time()
    found = p.api("series", **{"match[]": m.group(1), "start": now - RANGE_SECONDS, "end": now})
    return sorted({s[m.group(2)] for s in found if s.get(m.group(2))})


def test_variables_are_chained(stack: Stack):
    """job -> instance -> server: each variable's options are what the ones before it select. The instance is
    kvwatt's exporter (not a vLLM address to match by hand), and an instance that is not picked hides its
    servers."""
    overview = DASHBOARDS["kvwatt-overview.json"]
    queries = {v["name"]: v["query"] for v in variables(overview) if v["type"] == "query"}
    p = stack.prometheus
    assert _options(p, expand(queries["job"], {})) == ["kvwatt"]
    assert _options(p, expand(queries["instance"], {"job": "kvwatt"})) == [stack.kvwatt_instance]
    picked = {"job": "kvwatt", "instance": format_value({"multi": True}, [stack.kvwatt_instance])}
    assert _options(p, expand(queries["server"], picked)) == ["down", "off", "on"]
    elsewhere = format_value({"multi": True}, ["127.0.0.1:1"])  # an exporter that is not there
    assert _options(p, expand(queries["server"], {**picked, "instance": elsewhere})) == []
    assert _options(p, expand(queries["server"], {**picked, "job": "vllm"})) == []


# --- the first row, as Grafana shows it ---------------------------------------------------------------------

FIRST_ROW = "Is offloading paying right now?"


def first_row(p: prom.Prometheus, values: dict[str, str]) -> dict[tuple[str, str], str]:
    """(panel title, legend) -> the text Grafana shows: each instant target's value through its panel's value
    mappings and unit (tests.support.grafana.displayed)."""
    overview = DASHBOARDS["kvwatt-overview.json"]
    all_panels = list(panels(overview))
    start = next(i for i, q in enumerate(all_panels) if q["type"] == "row" and q["title"] == FIRST_ROW)
    shown: dict[tuple[str, str], str] = {}
    for panel in all_panels[start + 1:]:
        if panel["type"] == "row":
            break
        for target in panel["targets"]:
            for s in run_target(p, target, values):
                legend = LEGEND_LABEL.sub(lambda m: s["metric"].get(m.group(1), ""), target["legendFormat"])
                shown[(panel["title"], legend)] = displayed(panel, s["value"][1])
    return shown


def test_first_row_shows_each_server_and_unknown_as_unknown(stack: Stack):
    overview = DASHBOARDS["kvwatt-overview.json"]
    values = resolve_variables(stack.prometheus, overview, {}, True, [])
    want = {
        # the offloading server: paired with its OFF twin, an undersized buffer under high pressure
        ("Energy saving dE now", "on dE (paired)"): "number",
        ("Energy saving dE now", "on SE (paired)"): "number",
        ("Offloading", "on"): "on",
        ("Marginal energy per token now", "on gpu"): "number",
        ("Failure signatures now", "on buffer undersized"): "active",
        # its OFF twin: no offloading, so no buffer to be undersized
        ("Offloading", "off"): "off",
        ("Failure signatures now", "off buffer undersized"): "no offloading",
        ("Failure signatures now", "off collapse"): "clear",
        # unreachable: everything unknown, nothing clear or off
        ("Energy saving dE now", "down dE (unknown)"): "unknown",
        ("Offloading", "down"): "unknown",
        ("Marginal energy per token now", "down unknown"): "unknown",
        ("Failure signatures now", "down collapse"): "unknown",
        ("Failure signatures now", "down preemption onset"): "unknown",
        ("Failure signatures now", "down buffer undersized"): "unknown",
    }
    deadline = stack.started + DEADLINE_SECONDS
    while True:
        shown = first_row(stack.prometheus, values)
        got = {k: ("number" if re.fullmatch(r"-?[0-9.]+ ?(%|mJ|J|kJ)", shown.get(k, "")) else shown.get(k))
               for k in want}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert got == want, "first row as shown:\n" + "\n".join(f"{k}: {v}" for k, v in sorted(shown.items()))
