"""Start a real `kvwatt run` as a subprocess on a free loopback port and talk to it over HTTP.

    with KvwattDaemon(servers={"a": url}, config={"windows": ["30s"]}, env={...}) as d:
        d.metrics()            # parsed: {(name, frozenset(labels.items())): value}
        d.value("kvwatt_source_up", source="vllm", server="a")
        d.wait_for(lambda d: d.value(...) == 1, timeout=30)

``config`` entries are written to a YAML file in a temporary directory; ``env`` is added to the
environment (e.g. PYTHONPATH for the NVML test double, KVWATT_FAKE_NVML_STATE). ``preexec_fn`` runs in the
child before exec (e.g. lower its open-file limit). With ``https=True`` the daemon's URL is https://, and
``request_kwargs`` (verify=CA file, auth=(user, password), cert=...) go with every request made here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

from tests.support.engine import free_port  # noqa: F401 (re-exported: tests import it from here)

REPO = Path(__file__).resolve().parents[2]
ADDRESS_IN_USE = "address already in use"  # kvwatt's "cannot serve on ...: [Errno 98] ... address already in use"
BIND_TRIES = 3


def pick(metrics: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` in a parsed scrape whose labels include ``labels``; None if
    absent."""
    want = set(labels.items())
    hits = [v for (n, lab), v in metrics.items() if n == name and want <= lab]
    if len(hits) > 1:
        raise AssertionError(f"{name}{labels} matches {len(hits)} samples")
    return hits[0] if hits else None


def parse_exposition(text: str) -> dict[tuple[str, frozenset], float]:
    """Parse with prometheus_client's own parser (independent of kvwatt's). A sample that appears twice (same
    name and labels) fails: a dict would silently keep the last one and hide the duplicate."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            if key in out:
                raise AssertionError(f"duplicate sample {s.name}{dict(s.labels)} in the exposition")
            out[key] = s.value
    return out


class KvwattDaemon:
    def __init__(self, servers: dict[str, str] | None = None, config: dict | None = None,
                 env: dict[str, str] | None = None, interval: str = "1s", args: tuple[str, ...] = (),
                 preexec_fn=None, https: bool = False, request_kwargs: dict | None = None,
                 module: str = "exporter"):
        self.tmp = tempfile.TemporaryDirectory(prefix="kvwatt-test-")
        self.port = free_port()
        self.url = f"{'https' if https else 'http'}://127.0.0.1:{self.port}"
        self.preexec_fn = preexec_fn
        self.request_kwargs = dict(request_kwargs or {})
        cfg = dict(config or {})
        cfg.setdefault("state_dir", os.path.join(self.tmp.name, "state"))
        cfg.setdefault("powercap_root", os.path.join(self.tmp.name, "no-powercap"))
        if servers:  # a value is a URL, or a mapping of server keys (url, gpus, ...)
            cfg["servers"] = [{"name": n, **({"url": u} if isinstance(u, str) else u)} for n, u in servers.items()]
        cfg["interval"] = interval
        self.config_path = os.path.join(self.tmp.name, "kvwatt.yaml")
        self._cfg = cfg
        self._write_config()
        self.env = {**os.environ, **(env or {})}
        self.args = args
        self.module = module  # what `python -m` runs: kvwatt, or a launcher that injects a fault into it
        self.log_path = os.path.join(self.tmp.name, "kvwatt.log")
        self.proc: subprocess.Popen | None = None

    def _write_config(self) -> None:
        self._cfg["listen"] = f"127.0.0.1:{self.port}"
        with open(self.config_path, "w") as f:
            yaml.safe_dump(self._cfg, f)

    def start(self, timeout: float = 20.0) -> "KvwattDaemon":
        """Start kvwatt and wait for /healthz. free_port()'s port can be taken before kvwatt binds it (another
        test's connection got it as its ephemeral port): then kvwatt says so and exits, and it is started again
        on another port, up to BIND_TRIES times."""
        for attempt in range(BIND_TRIES):
            try:
                return self._start(timeout)
            except RuntimeError as e:
                if ADDRESS_IN_USE not in str(e) or attempt == BIND_TRIES - 1:
                    raise
                self._log.close()
                self.port = free_port()
                self.url = f"{self.url.split('://')[0]}://127.0.0.1:{self.port}"
                self._write_config()
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> "KvwattDaemon":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, "run", "--config", self.config_path,
                                      *self.args], cwd=REPO, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=self.preexec_fn)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvwatt exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.get("/healthz", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kvwatt did not become healthy in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text()[-4000:]
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        finally:
            self._log.close()

    def __enter__(self) -> "KvwattDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.tmp.cleanup()

    # --- reading --------------------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 5, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout, **{**self.request_kwargs, **kwargs})

    def metrics_text(self) -> str:
        return self.get("/metrics").text

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        return parse_exposition(self.metrics_text())

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the one sample of ``name`` whose labels include ``labels``; None if absent. Each call
        scrapes: values that must come from one tick are picked from one ``metrics()`` (``pick``)."""
        return pick(self.metrics(), name, **labels)

    def status(self) -> dict:
        return self.get("/api/status").json()

    def wait_for(self, predicate, timeout: float = 30.0, interval: float = 0.5, what: str = "condition"):
        deadline = time.monotonic() + timeout
        last_exc = None
        while time.monotonic() < deadline:
            try:
                result = predicate(self)
                if result:
                    return result
            except (requests.RequestException, AssertionError, KeyError) as e:
                last_exc = e
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})\n"
                             f"{self.log()}")
