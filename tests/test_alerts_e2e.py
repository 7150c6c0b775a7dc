"""End to end on loopback: a collapse pages through PagerDuty Events v2 and resolves after recovery.

The stack (tests/support/prom.py, loopback.py, daemon.py, fake_gpus.py):
- two simulated vLLM servers under high pressure with offloading on, on one host (``node="n1"``):
  ``box-a``, watched by a real ``kvwatt run``, and ``solo``, which kvwatt does not watch; both replay the
  collapse (methods.md s5) when the test says so, then recover. The host's one GPU (the NVML double) follows
  ``box-a``'s power; the fallback reads it for ``solo`` through the shared ``node`` label. (One GPU only:
  FakeGpus.write uses one temporary file name, so two simulators feeding one state file race.)
- the Debian ``prometheus`` scraping kvwatt (job ``kvwatt``) and both vLLM servers (job ``vllm``, with the
  ``server`` and ``node`` target labels the rules expect) every second, loading a test copy of the rules
  generated with short windows and ``for:`` (``--set``);
- the Debian ``prometheus-alertmanager`` with a test copy of alerts/alertmanager.yml: ``global.pagerduty_url``,
  the webhook URLs and the ``routing_key_file`` point at the loopback receiver / a temporary file, group timings
  are 1 s;
- a loopback receiver standing in for PagerDuty (and the webhooks).

One run checks: kvwatt's detector pages for ``box-a`` (``detector=kvwatt``) and the PromQL fallback for
``solo`` (``detector=promql``: vLLM series plus kvwatt's GPU power joined by ``node``), as two incidents
(group_by alertname, server) whose Events v2 trigger carries the routing key from the file, severity critical,
the rule's summary, links and details (the runbook link: kvwatt's own /runbook, which answers with the
alert's section), and a dedup_key derived from the group key; warnings go to the
non-paging webhook and are inhibited while the page fires; Watchdog reaches the heartbeat webhook, never
PagerDuty; after recovery each incident gets a resolve with the same dedup_key; no rule fails to evaluate.
"""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support import prom
from tests.support import vllm_sim as sim
from tests.support.daemon import KvwattDaemon
from tests.support.fake_gpus import FakeGpus
from tests.support.loopback import FakeVllm

pytestmark = pytest.mark.prom

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "alerts"
COLLAPSE = "KVOffloadCollapse"
WATCHED, UNWATCHED = "box-a", "solo"
# Generation-time settings of the test copy: windows of 10 s at a 1 s scrape, short for:, a 20 s reference.
SHORT = {"window": "10s", "kvwatt_window": "10s", "collapse_for": "3s", "collapse_reference_offset": "20s",
         "kv_pressure_for": "1s", "watchdog_for": "1s"}
KVWATT_CONFIG = {"windows": ["10s"], "collapse_reference_window": "20s", "min_load_duration": "5s",
                 "idle_power_watts": {"gpu:0": sim.IDLE_WATTS}}
GROUP_TIMING = {"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"}


def short_rules(tmp: Path) -> Path:
    """alerts/generate.py with SHORT overrides into ``tmp``; returns the rules file."""
    sets = [a for k, v in SHORT.items() for a in ("--set", f"{k}={v}")]
    out = subprocess.run([sys.executable, str(ALERTS / "generate.py"), "--out-dir", str(tmp), *sets],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tmp / "kvwatt-rules.yaml"


def alertmanager_test_config(receiver_url: str, key_file: Path) -> dict:
    """alerts/alertmanager.yml pointed at the loopback receiver, with 1 s group timings."""
    cfg = yaml.safe_load((ALERTS / "alertmanager.yml").read_text(encoding="utf-8"))
    cfg["global"]["pagerduty_url"] = f"{receiver_url}/v2/enqueue"
    for route in [cfg["route"], *cfg["route"]["routes"]]:
        route.update(GROUP_TIMING)
    for receiver in cfg["receivers"]:
        for pd in receiver.get("pagerduty_configs", []):
            pd["routing_key_file"] = str(key_file)
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{receiver_url}/{receiver['name']}"
    return cfg


def group_key_hash(route_matchers: str, labels: dict[str, str]) -> str:
    """Alertmanager's dedup_key: sha256 of '<route key>:<group labels>' (notify.Key.Hash)."""
    group = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return hashlib.sha256(f"{{}}/{route_matchers}:{{{group}}}".encode()).hexdigest()


def rule(path: Path, name: str) -> dict:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    return next(r for g in doc["groups"] for r in g["rules"] if r.get("alert") == name)


def is_event(action: str, server: str):
    """An Events v2 message with this event_action about this server (payload.source is the server)."""
    return lambda r: (r.path == "/v2/enqueue" and r.json.get("event_action") == action
                      and (r.json.get("payload") or {}).get("source") == server)


def assert_runbook_link(url: str, kvwatt_url: str) -> None:
    """The link names kvwatt's own /runbook (the one kvwatt Prometheus scrapes; alerts/README.md), and that page
    has the alert's section."""
    assert url == f"{kvwatt_url}/runbook#kvoffloadcollapse", url
    page = urllib.request.urlopen(url.partition("#")[0], timeout=10).read().decode()
    assert '<h2 id="kvoffloadcollapse">' in page


def assert_trigger(event: prom.Received, key: str, server: str, detector: str, collapse: dict,
                   kvwatt_url: str) -> None:
    body = event.json
    assert body["routing_key"] == key, "the routing key is read from routing_key_file"
    assert body["dedup_key"] == group_key_hash('{severity="critical"}', {"alertname": COLLAPSE, "server": server})
    p = body["payload"]
    assert p["severity"] == "critical"
    assert p["summary"] == f"{collapse['annotations']['summary']} Server: {server}."
    assert (p["source"], p["class"], p["component"], p["group"]) == (server, COLLAPSE, "vllm-kv-cache", "kvwatt")
    details = p["custom_details"]
    assert details["detector"] == detector, f"{server} was paged by the {details['detector']} detector"
    assert_runbook_link(details["runbook_url"], kvwatt_url)
    assert f"server {server}" in details["description"].lower()
    assert {"firing", "num_firing", "dashboard"} <= set(details)
    assert {"href": details["runbook_url"], "text": f"Runbook: {COLLAPSE}"} in body["links"]


def inhibited_warnings(am: prom.Alertmanager, server: str) -> list[str]:
    return [a["labels"]["alertname"] for a in am.alerts()
            if a["labels"].get("server") == server and a["labels"]["severity"] == "warning"
            and a["status"]["state"] == "suppressed" and a["status"]["inhibitedBy"]]


@pytest.fixture
def fakes(tmp_path):
    gpus = FakeGpus(tmp_path / "gpus.json")
    with FakeVllm(sim.stable_high_pressure_on()) as a, FakeVllm(sim.stable_high_pressure_on(seed=11)) as s:
        a.attach_gpu(gpus, "GPU-e2e-n1")
        yield gpus, a, s


def test_collapse_pages_pagerduty_and_resolves(tmp_path, fakes):
    prom.require_binaries()
    gpus, box_a, solo = fakes
    rules = short_rules(tmp_path / "rules")
    collapse = rule(rules, COLLAPSE)
    key = secrets.token_hex(16)
    key_file = tmp_path / "pagerduty-routing-key"
    key_file.write_text(key + "\n")
    daemon = KvwattDaemon(servers={WATCHED: {"url": box_a.url, "gpus": ["0"]}}, config=KVWATT_CONFIG,
                          env=gpus.env())
    with daemon, prom.Receiver() as pd, \
            prom.Alertmanager(tmp_path, alertmanager_test_config(pd.url, key_file)) as am, \
            prom.Prometheus(tmp_path, {
                "kvwatt": {"targets": [daemon.url.removeprefix("http://")], "labels": {"node": "n1"}},
                "vllm": [{"targets": [fake.url.removeprefix("http://")], "labels": {"node": "n1", "server": name}}
                         for name, fake in ((WATCHED, box_a), (UNWATCHED, solo))],
            }, rule_files=[rules], alertmanagers=[am.address]) as p:
        # healthy: the fallback's 20 s-old reference exists; kvwatt has one too (its signature reads 0)
        p.wait_for(lambda: p.value(f'sum(rate(vllm:generation_tokens_total{{server="{UNWATCHED}"}}[10s] offset 20s))'),
                   timeout=90, what="30 s of healthy history in Prometheus")
        kvwatt_signature = f'kvwatt_collapse_signature{{server="{WATCHED}"}}'
        try:
            p.wait_for(lambda: p.value(kvwatt_signature) == 0, timeout=20, what="kvwatt's signature at 0")
        except AssertionError:
            pass  # judged below: the page for box-a must come from kvwatt's detector
        heartbeat = pd.wait_for(lambda r: r.path == "/heartbeat", timeout=30, what="Watchdog at the heartbeat")
        assert heartbeat.json["alerts"][0]["labels"]["alertname"] == "Watchdog"

        box_a.set_phase("collapse")
        solo.set_phase("collapse")
        page_solo = pd.wait_for(is_event("trigger", UNWATCHED), timeout=90, what=f"the page for {UNWATCHED}")
        assert_trigger(page_solo, key, UNWATCHED, "promql", collapse, daemon.url)
        am.wait_for(lambda: "KVPressureAboveThreshold" in inhibited_warnings(am, UNWATCHED), timeout=20,
                    what="the pressure warning inhibited while the page fires")
        page_a = pd.wait_for(is_event("trigger", WATCHED), timeout=60, what=f"the page for {WATCHED}")
        assert p.query(f"max_over_time({kvwatt_signature}[1m])"), \
            f"kvwatt exports no {kvwatt_signature}: is derive.collapse wired into the collector?"
        assert_trigger(page_a, key, WATCHED, "kvwatt", collapse, daemon.url)

        box_a.set_phase(None)
        solo.set_phase(None)
        for page in (page_solo, page_a):
            resolve = pd.wait_for(lambda r: r.path == "/v2/enqueue" and r.json["event_action"] == "resolve"
                                  and r.json["dedup_key"] == page.json["dedup_key"], timeout=90,
                                  what=f"the resolve of {page.json['payload']['source']}")
            assert resolve.json["routing_key"] == key

        pages = pd.received("/v2/enqueue")
        assert {e.json["payload"]["class"] for e in pages if e.json.get("payload")} == {COLLAPSE}
        assert any(r.json["alerts"][0]["labels"]["alertname"] == "KVPressureAboveThreshold"
                   for r in pd.received("/kvwatt-warnings")), "warnings reach the non-paging webhook"
        assert p.rule_health() == []
