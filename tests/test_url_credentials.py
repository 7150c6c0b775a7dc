"""Credentials in a server URL (http://user:pass@host:port) are sent to the server as basic auth and shown
nowhere: not in the url label, /api/status, the landing page, the log or a configuration error."""

import subprocess
import sys

import pytest

from exporter import config
from tests.conftest import FIXTURES
from tests.support.daemon import REPO, KvwattDaemon, free_port
from tests.support.loopback import MetricsServer

PASSWORD = "Hunter2-secret"
EXPOSITION = sorted((FIXTURES / "low-pressure").glob("*.prom"))[0].read_text()


@pytest.mark.parametrize("url,shown", [
    (f"http://vllm:{PASSWORD}@10.0.0.1:8000", "http://vllm:xxxxx@10.0.0.1:8000"),
    (f"https://vllm:{PASSWORD}@[::1]:8000/base?x=1", "https://vllm:xxxxx@[::1]:8000/base?x=1"),
    ("http://vllm:p%40ss%3Aword@h:1", "http://vllm:xxxxx@h:1"),
    (f"http://:{PASSWORD}@h:1", "http://:xxxxx@h:1"),
    ("http://h:1", "http://h:1"),
    ("http://only-a-user@h:1", "http://only-a-user@h:1"),
    (f"http://u:{PASSWORD}@[::1:8000", "(unparsable URL)"),
])
def test_redacted_url_masks_the_password_only(url, shown):
    assert config.redacted_url(url) == shown


def test_a_rejected_url_is_not_echoed_with_its_password():
    with pytest.raises(config.ConfigError) as e:
        config.parse_url(f"ftp://vllm:{PASSWORD}@h:1", "servers[0].url")
    assert PASSWORD not in str(e.value) and "vllm:xxxxx@h:1" in str(e.value)


def test_url_credentials_authenticate_the_read_and_appear_nowhere(tmp_path):
    with MetricsServer(lambda: EXPOSITION, basic_auth=("vllm", PASSWORD)) as srv, \
            KvwattDaemon(servers={"good": srv.url.replace("://", f"://vllm:{PASSWORD}@"),
                                  "wrong": srv.url.replace("://", "://vllm:not-it@"),
                                  "dead": f"http://vllm:{PASSWORD}@127.0.0.1:{free_port()}"},
                         interval="200ms", args=("--log-level", "debug")) as d:
        d.wait_for(lambda d: d.value("kvwatt_source_up", source="vllm", server="good") == 1, what="good up")
        d.wait_for(lambda d: d.value("kvwatt_source_info", source="vllm", server="wrong", reason="http_401") == 1,
                   what="wrong password refused")
        assert srv.unauthorized > 0 and srv.requests > srv.unauthorized
        assert d.value("kvwatt_server_info", server="good", url=srv.url.replace("://", "://vllm:xxxxx@")) == 1
        pages = {path: d.get(path).text for path in ("/metrics", "/api/status", "/")}
        assert "vllm:xxxxx@" in pages["/api/status"]
        for path, text in pages.items():
            assert PASSWORD not in text and "not-it" not in text, path
        d.stop()
        log = open(d.log_path).read()
        assert "vllm:xxxxx@" in log and PASSWORD not in log and "not-it" not in log, log
    config = tmp_path / "kvwatt.yaml"
    config.write_text(f"servers:\n  - {{name: a, url: 'http://vllm:{PASSWORD}@127.0.0.1:8000'}}\n")
    r = subprocess.run([sys.executable, "-m", "exporter", "check-config", str(config)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "vllm:xxxxx@" in r.stdout and PASSWORD not in r.stdout + r.stderr
