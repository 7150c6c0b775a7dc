"""A real Prometheus and Alertmanager (the Debian packages) on loopback, and a receiver standing in for
PagerDuty, for end-to-end tests.

    from tests.support import prom

    prom.require_binaries()                       # pytest.skip (naming scripts/install-deps.sh) if missing
    with prom.Receiver() as pd, \\
         prom.Alertmanager(tmp, am_config) as am, \\
         prom.Prometheus(tmp, jobs={"kvwatt": ["127.0.0.1:8492"]}, rule_files=[rules],
                         alertmanagers=[am.address]) as p:
        p.query("up")                             # instant vector: [{"metric": {...}, "value": [t, "1"]}]
        p.value('up{job="kvwatt"}')               # the one sample's value as a float, None when empty
        p.alerts()                                # active alerts (pending and firing) from /api/v1/alerts
        p.wait_for(lambda: p.value("up") == 1, timeout=30, what="kvwatt scraped")
        am.alerts()                               # Alertmanager's view (/api/v2/alerts)
        pd.requests                               # every POST received: Received(path, headers, json)
        pd.wait_for(lambda r: r.path == "/v2/enqueue", timeout=60)

- ``Prometheus(workdir, jobs, rule_files=(), alertmanagers=(), interval="1s")``: ``jobs`` maps a job name to
  its targets (``["host:port"]``), to one static_config (``{"targets": [...], "labels": {...}}``) or to a list
  of static_configs (targets with different labels); ``job_options`` adds scrape_config keys per job
  (``{"kvwatt": {"scheme": "https", "tls_config": {...}, "basic_auth": {...}}}``). Scrape, rule evaluation
  and the re-sending of firing alerts to the Alertmanager (``--rules.alert.resend-delay``) all run every ``interval``.
  TSDB, config and log live under ``workdir/prometheus-PORT``.
- ``Alertmanager(workdir, config)``: ``config`` is a dict or a path; clustering is off
  (``--cluster.listen-address=``), storage is a temporary directory. Debian names the binary
  ``prometheus-alertmanager``; an upstream ``alertmanager`` on PATH is used when that one is absent.
- ``Receiver()``: records every POST (PagerDuty Events v2 at ``/v2/enqueue``, webhooks anywhere else) and
  answers as PagerDuty does (202 + JSON). Its ``url`` goes into ``global.pagerduty_url`` as
  ``f"{pd.url}/v2/enqueue"`` and into webhook URLs.

Every process runs in its own session and is stopped (SIGTERM, then SIGKILL) on exit; ``log()`` returns the
tail of its output for assertion messages.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import requests
import yaml

from tests.support.daemon import free_port

PROMETHEUS = "prometheus"
ALERTMANAGER = ("prometheus-alertmanager", "alertmanager")  # Debian's name first
INSTALL_HINT = "install the Debian packages prometheus and prometheus-alertmanager (scripts/install-deps.sh)"


def which_alertmanager() -> str | None:
    return next((p for p in map(shutil.which, ALERTMANAGER) if p), None)


def missing_binaries() -> list[str]:
    missing = [b for b in (PROMETHEUS, "promtool", "amtool") if shutil.which(b) is None]
    return missing + ([] if which_alertmanager() else [ALERTMANAGER[0]])


def require_binaries() -> None:
    """Skip the calling test when any of prometheus, promtool, amtool, alertmanager is not installed."""
    import pytest

    missing = missing_binaries()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: {INSTALL_HINT}")


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5,
               detail: Callable[[], str] = lambda: "") -> Any:
    """Poll ``predicate`` until it returns something truthy; AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except (requests.RequestException, AssertionError, KeyError, IndexError) as e:
            last_error = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last error: {last_error})\n"
                         f"{detail()}")


class _Process:
    """A server binary on a loopback port, ready when GET /-/ready answers 200."""

    name = "process"

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.dir = Path(workdir) / f"{self.name}-{self.port}"
        self.dir.mkdir(parents=True)
        self.log_path = self.dir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 30.0) -> "_Process":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_until(self._ready, timeout, f"{self.name} ready on {self.address}", interval=0.2, detail=self.log)
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
        return requests.get(self.url + "/-/ready", timeout=1).status_code == 200

    def log(self) -> str:
        try:
            return f"--- {self.name} log ---\n" + self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None:
            self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _get(self, path: str, **params: Any) -> Any:
        return requests.get(self.url + path, params=params, timeout=10).json()


def _static_configs(targets: Sequence[str] | Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[dict]:
    """["h:p", ...] | {"targets": [...], "labels": {...}} | a list of such mappings -> static_configs."""
    if isinstance(targets, Mapping):
        return [dict(targets)]
    if all(isinstance(t, str) for t in targets):
        return [{"targets": list(targets)}]
    return [dict(t) for t in targets]


class Prometheus(_Process):
    name = "prometheus"

    def __init__(self, workdir: Path, jobs: Mapping[str, Sequence[str] | Mapping[str, Any] | Sequence[Mapping]],
                 rule_files: Iterable[Path | str] = (), alertmanagers: Sequence[str] = (),
                 interval: str = "1s", job_options: Mapping[str, Mapping[str, Any]] | None = None,
                 external_labels: Mapping[str, str] | None = None,
                 remote_write: Sequence[Mapping[str, Any]] = ()):
        super().__init__(workdir)
        self.interval = interval
        config: dict[str, Any] = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       **({"external_labels": dict(external_labels)} if external_labels else {})},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": _static_configs(t),
                                **dict((job_options or {}).get(job, {}))} for job, t in jobs.items()],
        }
        if remote_write:
            config["remote_write"] = [dict(r) for r in remote_write]
        if alertmanagers:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]}
        self.config_path = self.dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")

    def command(self) -> list[str]:
        return [shutil.which(PROMETHEUS) or PROMETHEUS, f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.dir / 'tsdb'}", f"--web.listen-address={self.address}",
                # alerts sent before the Alertmanager is discovered are dropped and re-sent only after this
                # delay (1m by default): keep it at the evaluation interval
                f"--rules.alert.resend-delay={self.interval}", "--log.level=warn"]

    def api(self, path: str, **params: Any) -> Any:
        body = self._get("/api/v1/" + path, **params)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        """The value of the single sample ``expr`` returns; None when it returns nothing."""
        result = self.query(expr)
        if len(result) > 1:
            raise AssertionError(f"{expr} returned {len(result)} series, expected one")
        return float(result[0]["value"][1]) if result else None

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("alerts")["alerts"]

    def targets(self, job: str) -> list[dict[str, Any]]:
        """The active targets of ``job`` (health, lastError, ...) from /api/v1/targets."""
        return [t for t in self.api("targets")["activeTargets"] if t["labels"].get("job") == job]

    def rule_health(self) -> list[str]:
        """'group/rule: error' for every rule whose last evaluation failed."""
        return [f"{g['name']}/{r['name']}: {r.get('lastError')}" for g in self.api("rules")["groups"]
                for r in g["rules"] if r.get("health") == "err"]

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
        return wait_until(predicate, timeout, what, detail=self.log)


class VictoriaMetrics(_Process):
    """VictoriaMetrics' single-node server (Debian's ``victoria-metrics``): a long-term store that takes
    Prometheus ``remote_write`` at ``write_url`` and answers the Prometheus query API. Its default
    ``-search.latencyOffset`` (30 s) hides the newest samples from queries; here it is 1 s."""

    name = "victoria-metrics"
    BINARY = "victoria-metrics"

    @property
    def write_url(self) -> str:
        return self.url + "/api/v1/write"

    def command(self) -> list[str]:
        return [shutil.which(self.BINARY) or self.BINARY, f"-httpListenAddr={self.address}",
                f"-storageDataPath={self.dir / 'data'}", "-retentionPeriod=1d", "-search.latencyOffset=1s",
                "-loggerLevel=WARN"]

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
        return requests.get(self.url + "/health", timeout=1).status_code == 200

    def query(self, expr: str) -> list[dict[str, Any]]:
        # step: the resolution of a range over an expression (an implicit subquery), 5m by default
        body = self._get("/api/v1/query", query=expr, step="1s")
        if body.get("status") != "success":
            raise AssertionError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
        return wait_until(predicate, timeout, what, detail=self.log)


class Alertmanager(_Process):
    name = "alertmanager"

    def __init__(self, workdir: Path, config: Mapping[str, Any] | Path | str):
        super().__init__(workdir)
        self.config_path = self.dir / "alertmanager.yml"
        text = Path(config).read_text(encoding="utf-8") if isinstance(config, (str, Path)) else \
            yaml.safe_dump(dict(config), sort_keys=False)
        self.config_path.write_text(text, encoding="utf-8")

    def command(self) -> list[str]:
        return [which_alertmanager() or ALERTMANAGER[0], f"--config.file={self.config_path}",
                f"--storage.path={self.dir / 'data'}", f"--web.listen-address={self.address}",
                "--cluster.listen-address=", "--log.level=warn"]

    def alerts(self) -> list[dict[str, Any]]:
        return self._get("/api/v2/alerts")

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
        return wait_until(predicate, timeout, what, detail=self.log)


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    json: Any
    at: float  # time.monotonic() on arrival


class Receiver:
    """Loopback HTTP server recording every POST; answers /v2/enqueue like PagerDuty's Events API v2."""

    def __init__(self) -> None:
        self.requests: list[Received] = []
        self._lock = threading.Lock()
        self._new = threading.Condition(self._lock)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _handler(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw or b"null")
                except ValueError:
                    body = raw.decode(errors="replace")
                outer._record(Received(self.path, dict(self.headers), body, time.monotonic()))
                reply = {"status": "success", "message": "Event processed"}
                if self.path.endswith("/v2/enqueue") and isinstance(body, dict):
                    reply["dedup_key"] = body.get("dedup_key")
                data = json.dumps(reply).encode()
                self.send_response(202 if self.path.endswith("/v2/enqueue") else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        return Handler

    def _record(self, received: Received) -> None:
        with self._new:
            self.requests.append(received)
            self._new.notify_all()

    def received(self, path: str | None = None) -> list[Received]:
        with self._lock:
            return [r for r in self.requests if path is None or r.path == path]

    def wait_for(self, predicate: Callable[[Received], bool], timeout: float = 60.0,
                 what: str = "a matching request") -> Received:
        """The first request (received so far or later) for which ``predicate`` holds."""
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                hit = next((r for r in self.requests if predicate(r)), None)
                left = deadline - time.monotonic()
                if hit is not None or left <= 0:
                    break
                self._new.wait(left)
        if hit is None:
            got = "\n".join(f"{r.path}: {json.dumps(r.json)[:300]}" for r in self.requests[-10:]) or "(none)"
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; received:\n{got}")
        return hit

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
