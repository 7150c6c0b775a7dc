"""The fleet roll-up of docs/fleet.md on real parts, all on loopback:

    cluster gpu-a: kvwatt node-a1, node-a2 ──scrape──▶ Prometheus gpu-a/replica a ─┐  ─remote_write─▶ VictoriaMetrics
                                          └─scrape──▶ Prometheus gpu-a/replica b ─┤  ─remote_write─▶   (long-term
    cluster gpu-b: kvwatt node-b1, node-b2 ──scrape──▶ Prometheus gpu-b           ─┤  ─remote_write─▶    store)
                                                                                   └─/federate─▶ global Prometheus

- four real ``kvwatt run`` daemons (tests/support/daemon.py), each watching an offloading server paired with its
  OFF twin (tests/support/loopback.py's simulated vLLM) on NVML test-double GPUs of constant, known power and
  configured idle power, so every figure summed below is known (J/token, the recompute tax's watts, paired dE);
- three cluster Prometheus servers (the Debian ``prometheus``): an HA pair for gpu-a (external labels
  ``cluster``, ``replica``) and one for gpu-b, each scraping its cluster's kvwatt with a ``node`` target label,
  evaluating alerts/kvwatt-rules.yaml and remote-writing what docs/fleet.md option A ships to
- VictoriaMetrics' single-node server (Debian ``victoria-metrics``), the long-term store;
- a global Prometheus configured from deploy/fleet/prometheus-federation.yml (its federation scrape and rule
  file, the targets pointed at the three cluster servers), evaluating deploy/fleet/kvwatt-fleet-rules.yaml.

Each figure is read from the global server's and the store's own query APIs and compared with what the four
kvwatt instances serve in /api/status, summed: energy per second over tokens per second, never a mean of the
per-server ratios. Then one replica of gpu-a stops (nothing changes), then gpu-b's Prometheus stops: the fleet
figures must say a cluster is missing and drop, never halve.
"""

from __future__ import annotations

import json
import re
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from tests.support import prom, vllm_sim
from tests.support.daemon import KvwattDaemon
from tests.support.fake_gpus import FakeGpus
from tests.support.loopback import FakeVllm

pytestmark = pytest.mark.prom

REPO = Path(__file__).resolve().parents[1]
FLEET = REPO / "deploy" / "fleet"
CLUSTER_RULES = REPO / "alerts" / "kvwatt-rules.yaml"
TOLERANCE = 0.01
WINDOW = "5m"  # the window the shipped rules read (kvwatt's longest default); its figures exist from the start
# docs/fleet.md option A: ship kvwatt's raw series and every recorded (level:metric:op) series
REMOTE_WRITE_KEEP = r"kvwatt_.*|[a-z_]*:.+|up"
MODEL = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "active_parameters": 8.03e9,
         "hidden_size": 4096}
HARDWARE = {"flops_per_second": 4.0e14, "host_device_bytes_per_second": 5.0e10}
IDLE_WATTS = 100.0
# node -> (cluster, GPU watts of its ON server, of its OFF server): the clusters' J/token differ, so a doubled
# or missing cluster moves the fleet's ratio, not only its sums
NODES = {"node-a1": ("gpu-a", 400, 540), "node-a2": ("gpu-a", 420, 560),
         "node-b1": ("gpu-b", 250, 300), "node-b2": ("gpu-b", 260, 320)}


@dataclass
class Fleet:
    daemons: dict[str, KvwattDaemon]
    clusters: dict[str, prom.Prometheus]  # "gpu-a/a", "gpu-a/b", "gpu-b/a"
    global_: prom.Prometheus
    store: prom.VictoriaMetrics
    started: float


def _node_servers(node: str, on: FakeVllm, off: FakeVllm) -> dict[str, dict]:
    common = {"reference_local_compute_share": 0.04, "model": MODEL, "hardware": HARDWARE}
    return {f"{node}-on": {"url": on.url, "gpus": [f"GPU-{node}-on"], "pair_off_server": f"{node}-off", **common},
            f"{node}-off": {"url": off.url, "gpus": [f"GPU-{node}-off"], **common}}


def _start_node(stack: ExitStack, tmp: Path, node: str, on_w: int, off_w: int) -> KvwattDaemon:
    on = stack.enter_context(FakeVllm(vllm_sim.undersized_buffer_on()))
    off = stack.enter_context(FakeVllm(vllm_sim.high_pressure_off()))
    gpus = FakeGpus(tmp / f"{node}-gpus.json")  # one state file per node, written once: constant power
    for name, watts in ((f"GPU-{node}-on", on_w), (f"GPU-{node}-off", off_w)):
        gpus.add(name, power_mw=watts * 1000, counter_follows_power=True, t0=time.monotonic())
    config = {"windows": [WINDOW], "min_load_duration": "3s",
              "idle_power_watts": {f"GPU-{node}-on": IDLE_WATTS, f"GPU-{node}-off": IDLE_WATTS}}
    return stack.enter_context(KvwattDaemon(servers=_node_servers(node, on, off), config=config, env=gpus.env()))


def _global_prometheus(tmp: Path, cluster_addresses: list[str]) -> prom.Prometheus:
    """deploy/fleet/prometheus-federation.yml's federation scrape and rule file, pointed at the test's clusters
    and run at the test's 1 s interval."""
    shipped = yaml.safe_load((FLEET / "prometheus-federation.yml").read_text(encoding="utf-8"))
    (job,) = shipped["scrape_configs"]
    options = {k: v for k, v in job.items() if k not in ("job_name", "static_configs")}
    rule_files = [FLEET / f for f in shipped["rule_files"]]
    return prom.Prometheus(tmp, {job["job_name"]: cluster_addresses}, rule_files=rule_files,
                           job_options={job["job_name"]: options})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    prom.require_binaries()
    if prom.shutil.which(prom.VictoriaMetrics.BINARY) is None:
        pytest.skip(f"{prom.VictoriaMetrics.BINARY} not installed: the Debian package victoria-metrics "
                    "(scripts/install-deps.sh)")
    tmp = tmp_path_factory.mktemp("fleet-live")
    with ExitStack() as stack:
        started = time.monotonic()
        daemons = {node: _start_node(stack, tmp, node, on_w, off_w) for node, (_, on_w, off_w) in NODES.items()}
        store = stack.enter_context(prom.VictoriaMetrics(tmp))
        remote_write = [{"url": store.write_url, "queue_config": {"batch_send_deadline": "1s"},
                         "write_relabel_configs": [
            {"source_labels": ["__name__"], "regex": REMOTE_WRITE_KEEP, "action": "keep"}]}]
        clusters = {}
        for cluster, replica in (("gpu-a", "a"), ("gpu-a", "b"), ("gpu-b", "a")):
            targets = [{"targets": [d.url.removeprefix("http://")], "labels": {"node": node}}
                       for node, d in daemons.items() if NODES[node][0] == cluster]
            clusters[f"{cluster}/{replica}"] = stack.enter_context(prom.Prometheus(
                tmp, {"kvwatt": targets}, rule_files=[CLUSTER_RULES],
                external_labels={"cluster": cluster, "replica": replica}, remote_write=remote_write))
        global_ = stack.enter_context(_global_prometheus(tmp, [p.address for p in clusters.values()]))
        yield Fleet(daemons, clusters, global_, store, started)


# --- what the four kvwatt instances say, summed ---------------------------------------------------------

def expected(daemons: dict[str, KvwattDaemon]) -> dict[str, float]:
    """The fleet's figures from every server's /api/status window: each a sum over servers divided by a sum.
    Energy and tokens are taken per second (J/token x tokens/s = W): the four windows started a few seconds
    apart, so their raw joules and tokens cover different spans."""
    windows = [s["windows"][WINDOW] for d in daemons.values() for s in d.get("/api/status").json()["servers"]]
    gpu = [w["energy"]["gpu"] for w in windows]
    watts = sum(e["joules_per_token"] * w["generation_tokens_per_second"] for e, w in zip(gpu, windows))
    marginal = [e["marginal_joules_per_token"] * w["generation_tokens_per_second"] for e, w in zip(gpu, windows)]
    paired = [(m, w["energy_saving"]["paired"]["dE"]) for m, w in zip(marginal, windows)
              if w.get("energy_saving", {}).get("paired", {}).get("dE") is not None]
    assert len(paired) == len(daemons), f"paired dE of every ON server: {paired}"
    tax = sum(w["recompute_tax_watts"]["gpu"] for w in windows)
    return {
        "servers": float(len(windows)),
        "gpu_watts": watts,
        "joules_per_token": watts / sum(w["generation_tokens_per_second"] for w in windows),
        "recompute_tax_watts": tax,
        "recompute_energy_share": tax / sum(marginal),
        "dE": 1 - sum(m for m, _ in paired) / sum(m / (1 - de) for m, de in paired),
    }


# the global server's recorded fleet figures (deploy/fleet/kvwatt-fleet-rules.yaml)
GLOBAL = {
    "servers": "fleet:kvwatt_servers:count",
    "gpu_watts": 'fleet_scope:kvwatt_energy_joules:rate_window5m{scope="gpu"}',
    "joules_per_token": 'fleet_scope:kvwatt_energy_per_token_joules:ratio_window5m{scope="gpu"}',
    "recompute_tax_watts": 'fleet_scope:kvwatt_recompute_tax_watts:sum_window5m{scope="gpu"}',
    "recompute_energy_share": 'fleet_scope:kvwatt_recompute_energy_share:ratio_window5m{scope="gpu"}',
    "dE": 'fleet_baseline:kvwatt_energy_saving:ratio_window5m{baseline="paired"}',
}


def fleet_rules() -> dict[str, str]:
    groups = yaml.safe_load((FLEET / "kvwatt-fleet-rules.yaml").read_text(encoding="utf-8"))["groups"]
    return {r["record"]: r["expr"] for g in groups for r in g["rules"]}


def inline(expr: str, rules: dict[str, str]) -> str:
    """``expr`` with every series the fleet rules record replaced by its expression, recursively: what a store
    without a ruler answers for a recorded figure (MetricsQL takes a range over an expression)."""
    names = sorted(rules, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w:])(" + "|".join(map(re.escape, names)) + r")(?![\w:])(\{[^}]*\})?")

    def replace(m: re.Match) -> str:
        out = "(" + rules[m.group(1)] + ")"
        # a selector on a recorded name, {k="v", ...}, becomes `and on (k) <a vector of k="v">`
        for k, v in re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""):
            out = f'({out} and on ({k}) label_replace(vector(1), "{k}", "{v}", "", ""))'
        return out

    for _ in range(10):
        new = pattern.sub(replace, expr)
        if new == expr:
            return expr
        expr = new
    raise AssertionError("recording rules nested too deep")


def store_queries() -> dict[str, str]:
    rules = fleet_rules()
    return {k: inline(q, rules) for k, q in GLOBAL.items()}


def value(query: Callable[[str], list[dict[str, Any]]], expr: str) -> float | None:
    result = query(expr)
    assert len(result) <= 1, f"{expr} returned {len(result)} series: {result}"
    return float(result[0]["value"][1]) if result else None


def mismatches(query: Callable[[str], list[dict[str, Any]]], exprs: dict[str, str],
               want: dict[str, float]) -> list[str]:
    out = []
    for key, expr in exprs.items():
        got = value(query, expr)
        if got is None or abs(got - want[key]) > TOLERANCE * abs(want[key]):
            out.append(f"{key}: {got} from the query API, {want[key]:.6g} summed from /api/status")
    return out


def agree(fleet: Fleet, query: Callable[[str], list[dict[str, Any]]], exprs: dict[str, str], where: str,
          timeout: float = 40.0) -> None:
    """Poll until every figure agrees within TOLERANCE: samples cross scrape, rule, federation and rule
    intervals (~4 s) before the global server has them, and the windows fill meanwhile."""
    last: list[str] = []

    def ok() -> bool:
        nonlocal last
        try:
            want = expected(fleet.daemons)
        except (TypeError, KeyError) as e:  # a figure still unknown (None) in some server's window
            last = [f"/api/status not complete yet: {e!r}"]
            return False
        last = mismatches(query, exprs, want)
        return not last

    prom.wait_until(ok, timeout, f"{where}'s fleet figures to match the kvwatt instances'",
                    detail=lambda: "\n".join(last))


# --- the tests ---------------------------------------------------------------------------------------------

def test_global_prometheus_sums_the_fleet(fleet: Fleet) -> None:
    agree(fleet, fleet.global_.query, GLOBAL, "the global Prometheus", timeout=60)
    assert not fleet.global_.rule_health(), fleet.global_.rule_health()
    for p in fleet.clusters.values():
        assert not p.rule_health(), p.rule_health()


def test_ha_pair_counted_once(fleet: Fleet) -> None:
    """gpu-a's two replicas both reach the global server; its totals count the cluster's servers once."""
    g = fleet.global_
    replicas = lambda: sorted(s["metric"]["replica"]  # noqa: E731
                              for s in g.query('job:kvwatt_servers:count{cluster="gpu-a"}'))
    g.wait_for(lambda: replicas() == ["a", "b"], 20, "both replicas of gpu-a federated")
    assert g.value('cluster:kvwatt_servers:count{cluster="gpu-a"}') == 4
    assert g.value('cluster:kvwatt_servers:count{cluster="gpu-b"}') == 4
    assert g.value("fleet:kvwatt_clusters_missing:count") == 0


def test_fleet_dashboard_queries_return_data_on_the_global_server(fleet: Fleet) -> None:
    """deploy/fleet/kvwatt-fleet.json (dashboards/generate.py) as Grafana runs it against the global server:
    the cluster variable resolves, every target returns series, and every {{label}} of a legend is one of
    theirs (tests/test_dashboards_queries.py does the same for the node dashboards on a cluster Prometheus)."""
    from tests.support.grafana import targets
    from tests.test_dashboards_queries import LEGEND_LABEL, resolve_variables, run_target

    dashboard = json.loads((FLEET / "kvwatt-fleet.json").read_text(encoding="utf-8"))
    assert dashboard["uid"] == "kvwatt-fleet"
    agree(fleet, fleet.global_.query, GLOBAL, "the global Prometheus")  # every fleet: figure recorded

    def problems() -> list[str]:
        found: list[str] = []
        values = resolve_variables(fleet.global_, dashboard, {}, True, found)
        for panel, target in targets(dashboard):
            result = run_target(fleet.global_, target, values)
            if not result:
                found.append(f"panel {panel['title']!r} {target['refId']}: no series for {target['expr']}")
                continue
            labels = set().union(*(r["metric"] for r in result))
            missing = set(LEGEND_LABEL.findall(target.get("legendFormat", ""))) - labels
            if missing:
                found.append(f"panel {panel['title']!r}: legend uses {sorted(missing)}, result has {sorted(labels)}")
        return found

    last: list[str] = []

    def ok() -> bool:
        nonlocal last
        last = problems()
        return not last

    prom.wait_until(ok, 20, "every fleet dashboard query to return data", detail=lambda: "\n".join(last))
    assert sum(1 for _ in targets(dashboard)) >= 10


def test_long_term_store_answers_the_same(fleet: Fleet) -> None:
    """VictoriaMetrics holds what the cluster servers remote-wrote (both replicas of gpu-a): the fleet rules'
    expressions, run by its own query API, give the same fleet figures."""
    replicas = lambda: sorted(s["metric"].get("replica")  # noqa: E731
                              for s in fleet.store.query('job:kvwatt_servers:count{cluster="gpu-a"}'))
    fleet.store.wait_for(lambda: replicas() == ["a", "b"], 30, "both replicas' series in the store")
    agree(fleet, fleet.store.query, store_queries(), "VictoriaMetrics")


def test_a_lost_cluster_makes_the_fleet_partial_never_halved(fleet: Fleet) -> None:
    g = fleet.global_
    full = expected(fleet.daemons)
    agree(fleet, g.query, GLOBAL, "the global Prometheus")
    # one replica of the pair stops: the other carries gpu-a, nothing is missing
    fleet.clusters["gpu-a/b"].stop()
    g.wait_for(lambda: all(t["health"] == "down" for t in g.targets("federate-kvwatt")
                           if t["labels"]["instance"] == fleet.clusters["gpu-a/b"].address), 20,
               "the stopped replica's federation target down")
    agree(fleet, g.query, GLOBAL, "the global Prometheus with one replica of gpu-a")
    # gpu-b's only Prometheus stops: the fleet figures say a cluster is missing and drop; until they do, each
    # one read is the whole fleet's, never gpu-a's alone passed off as the fleet
    fleet.clusters["gpu-b/a"].stop()
    deadline = time.monotonic() + 30
    while g.value("fleet:kvwatt_clusters_missing:count") != 1:
        assert time.monotonic() < deadline, "fleet:kvwatt_clusters_missing:count never became 1"
        servers, jpt = g.value(GLOBAL["servers"]), g.value(GLOBAL["joules_per_token"])
        assert servers in (None, full["servers"]), f"the fleet's server count became {servers}"
        assert jpt is None or abs(jpt - full["joules_per_token"]) <= 0.05 * full["joules_per_token"], jpt
        time.sleep(0.2)
    for key, expr in GLOBAL.items():
        assert g.value(expr) is None, f"{key} still recorded with a cluster missing: {g.value(expr)}"
    # the cluster still reporting keeps its own figures
    assert g.value('cluster:kvwatt_servers:count{cluster="gpu-a"}') == 4
    assert g.value('cluster_scope:kvwatt_energy_per_token_joules:ratio_window5m{cluster="gpu-a", scope="gpu"}')
    assert g.value('cluster:kvwatt_servers:count{cluster="gpu-b"}') is None

