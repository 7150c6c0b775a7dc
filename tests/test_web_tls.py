"""TLS and basic auth on every endpoint through a web configuration file (Prometheus exporter-toolkit format):
a real `kvwatt run`, certificates made by the openssl command, real TLS clients and a real Prometheus."""

import statistics
import subprocess
import sys
import threading
import time

import bcrypt
import pytest
import requests
import yaml

from exporter.config import ConfigError
from tests.support import prom
from tests.support import vllm_sim as sim
from tests.support.daemon import REPO, KvwattDaemon, free_port
from tests.support.loopback import FakeVllm
from tests.support.tls import Pki

USER, PASSWORD = "prometheus", "s3cret-Pa55"
ENDPOINTS = ("/metrics", "/healthz", "/api/status", "/")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def password_hash():
    return bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()


def web_config(path, pki, users=None, **tls):
    data = {"tls_server_config": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), **tls}}
    if users:
        data["basic_auth_users"] = users
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.prom
def test_prometheus_scrapes_kvwatt_over_https_with_basic_auth(tmp_path, pki, password_hash):
    prom.require_binaries()
    wc = web_config(tmp_path / "web.yml", pki, {USER: password_hash})
    tls = {"ca_file": str(pki.ca)}
    with FakeVllm(sim.stable_high_pressure_on()) as fv, \
            KvwattDaemon(servers={"a": fv.url}, args=("--web.config.file", str(wc)), https=True,
                         request_kwargs={"verify": str(pki.ca), "auth": (USER, PASSWORD)}) as d:
        target = [f"127.0.0.1:{d.port}"]
        jobs = {"kvwatt": target, "wrong_password": target, "plain_http": target}
        options = {"kvwatt": {"scheme": "https", "tls_config": tls,
                              "basic_auth": {"username": USER, "password": PASSWORD}},
                   "wrong_password": {"scheme": "https", "tls_config": tls,
                                      "basic_auth": {"username": USER, "password": "wrong"}},
                   "plain_http": {"scheme": "http", "basic_auth": {"username": USER, "password": PASSWORD}}}
        with prom.Prometheus(tmp_path, jobs, job_options=options) as p:
            p.wait_for(lambda: p.value('up{job="kvwatt"}') == 1, timeout=60, what="kvwatt scraped over https")
            p.wait_for(lambda: p.value('kvwatt_source_up{job="kvwatt",source="vllm",server="a"}') == 1,
                       timeout=60, what="a kvwatt series in Prometheus")
            p.wait_for(lambda: all(t["lastError"] for j in ("wrong_password", "plain_http") for t in p.targets(j)),
                       timeout=60, what="the bad jobs scraped")
            assert p.value('up{job="wrong_password"}') == 0
            assert p.value('up{job="plain_http"}') == 0
            assert "401" in p.targets("wrong_password")[0]["lastError"]


def test_every_endpoint_needs_tls_and_the_password(tmp_path, pki, password_hash):
    wc = web_config(tmp_path / "web.yml", pki, {USER: password_hash})
    # the config-file key, not the flag
    with KvwattDaemon(config={"web_config_file": str(wc)}, https=True,
                      request_kwargs={"verify": str(pki.ca), "auth": (USER, PASSWORD)}) as d:
        for path in ENDPOINTS:
            assert d.get(path).status_code == 200, path
            no_auth = d.get(path, auth=None)
            assert no_auth.status_code == 401 and no_auth.headers["WWW-Authenticate"].startswith("Basic"), path
            assert d.get(path, auth=(USER, "wrong")).status_code == 401, path
            assert d.get(path, auth=("nobody", PASSWORD)).status_code == 401, path
        with pytest.raises(requests.ConnectionError):  # plain HTTP to the TLS port: no answer
            requests.get(f"http://127.0.0.1:{d.port}/metrics", auth=(USER, PASSWORD), timeout=5)
        with pytest.raises(requests.exceptions.SSLError):  # a client that does not trust the test CA
            requests.get(d.url + "/metrics", auth=(USER, PASSWORD), timeout=5, verify=True)
        assert d.get("/healthz").status_code == 200  # all of that left the daemon serving
        assert "Traceback" not in d.log() and PASSWORD not in d.log()


def test_a_good_password_is_checked_by_bcrypt_once_and_wrong_ones_do_not_stall_scrapes(tmp_path, pki):
    """bcrypt at cost 12 takes ~0.2-0.5 s: without the cache every scrape pays it, and on the event loop a
    flood of wrong passwords would stall everyone."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(12))
    start = time.perf_counter()
    bcrypt.checkpw(PASSWORD.encode(), hashed)
    bcrypt_seconds = time.perf_counter() - start
    wc = web_config(tmp_path / "web.yml", pki, {USER: hashed.decode()})
    with KvwattDaemon(args=("--web.config.file", str(wc)), https=True,
                      request_kwargs={"verify": str(pki.ca), "auth": (USER, PASSWORD)}) as d:
        session = requests.Session()  # one TLS connection: the time measured is the request's
        kw = {"verify": str(pki.ca), "auth": (USER, PASSWORD), "timeout": 10}
        assert session.get(d.url + "/metrics", **kw).status_code == 200
        cached = []
        for _ in range(10):
            t = time.perf_counter()
            assert session.get(d.url + "/metrics", **kw).status_code == 200
            cached.append(time.perf_counter() - t)
        assert statistics.median(cached) < bcrypt_seconds / 4, (cached, bcrypt_seconds)

        wrong = [threading.Thread(target=d.get, args=("/metrics",), kwargs={"auth": (USER, f"x{i}"), "timeout": 30})
                 for i in range(6)]
        for t in wrong:
            t.start()
        time.sleep(0.05)
        during = []
        for _ in range(5):
            t = time.perf_counter()
            assert session.get(d.url + "/metrics", **kw).status_code == 200
            during.append(time.perf_counter() - t)
        for t in wrong:
            t.join()
        assert max(during) < bcrypt_seconds, (during, bcrypt_seconds)


def test_client_certificates_are_required_when_configured(tmp_path, pki):
    wc = web_config(tmp_path / "web.yml", pki, client_auth_type="RequireAndVerifyClientCert",
                    client_ca_file=str(pki.ca), min_version="TLS13")
    client = (str(pki.client_cert), str(pki.client_key))
    with KvwattDaemon(args=("--web.config.file", str(wc)), https=True,
                      request_kwargs={"verify": str(pki.ca), "cert": client}) as d:
        assert d.get("/metrics").status_code == 200
        with pytest.raises(requests.ConnectionError):  # SSLError is one
            d.get("/metrics", cert=None)


BAD = [
    ("tls_server_config: {cert_file: server.crt}", "tls_server_config.key_file: missing"),
    ("tls_server_config: {cert_file: nope.crt, key_file: server.key}", "cannot load"),
    ("tls_server_config: {cert_file: server.crt, key_file: server.key, min_version: TLS9}", "min_version"),
    ("tls_server_config: {cert_file: server.crt, key_file: server.key, client_auth_type: RequireAnyClientCert}",
     "client_auth_type"),
    ("tls_server_config: {cert_file: server.crt, key_file: server.key, client_auth_type: "
     "RequireAndVerifyClientCert}", "client_ca_file: required"),
    ("tls_server_config: {cert_file: server.crt, key_file: server.key, client_ca_file: ca.crt}",
     "client_ca_file: set without"),
    ("tls_server_config: {cert_file: server.crt, key_file: server.key, cipher_suites: [x]}", "not supported"),
    ("http_server_config: {http2: true}", "http_server_config: not supported"),
    ("basic_auth_users: {prometheus: plaintext-password}", "basic_auth_users.prometheus: expected a bcrypt"),
    ("basic_auth_users: [prometheus]", "basic_auth_users: expected a mapping"),
    ("tls_server_confg: {}", "tls_server_confg: unknown key"),
    ("tls_server_config: [", "not valid YAML"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_invalid_web_config_files_name_the_key(tmp_path, pki, text, message):
    for name in ("server.crt", "server.key", "ca.crt"):  # relative paths are relative to the file
        (tmp_path / name).write_bytes(getattr(pki, {"server.crt": "server_cert", "server.key": "server_key",
                                                    "ca.crt": "ca"}[name]).read_bytes())
    path = tmp_path / "web.yml"
    path.write_text(text + "\n")
    from exporter.serve.webconfig import load

    with pytest.raises(ConfigError) as e:
        load(str(path))
    assert message in str(e.value) and "plaintext-password" not in str(e.value)


def test_kvwatt_run_with_an_invalid_web_config_exits_2_with_one_line(tmp_path):
    path = tmp_path / "web.yml"
    path.write_text("basic_auth_users: {prometheus: not-a-hash}\n")
    for args, says in ((["--web.config.file", str(path)], "basic_auth_users.prometheus: expected a bcrypt hash"),
                       (["--web.config.file", str(tmp_path / "missing.yml")], "missing.yml: cannot read"),
                       (["--web.read-timeout", "soon"], "--web.read-timeout: expected a duration"),
                       (["--web.max-connections", "0"], "--web.max-connections: expected a positive integer")):
        r = subprocess.run([sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{free_port()}",
                            "--state-dir", str(tmp_path / "state"), *args],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvwatt: error: ") and says in lines[0], (args, r.stderr)
