"""`kvwatt check-config` refuses what `kvwatt run` cannot take (issue 38, items 1 and 7).

Each configuration below passed check-config and then crashed `run` (a UnicodeError traceback at the first read of
a host the resolver cannot encode; a ZeroDivisionError at start-up for a fractional or zero model shape), or was
taken and made every tick fail (settings whose buffer recommendation overflowed), or was refused without saying
why (YAML 1.1 reads 8.0e9 as text). Both commands, as real subprocesses: exit status 2, one line on stderr
naming the key, no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from exporter.config import ConfigError, from_mapping
from tests.conftest import REPO
from tests.support.loopback import free_port

HARDWARE = {"flops_per_second": 1.0e15, "host_device_bytes_per_second": 2.5e10}
SHAPE = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}


def _server(**more) -> str:
    return json.dumps({"servers": [{"name": "x", "url": "http://127.0.0.1:9", "hardware": HARDWARE, **more}]})


ZERO_LAYERS = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 0,
               "intermediate_size": 14336, "vocab_size": 128256}

# (id, the configuration file's text (JSON is YAML), the words its one line must hold); {dir}: the test's tmp_path
CASES = [
    ("empty-label", json.dumps({"servers": [{"name": "x", "url": "http://a..b:8000"}]}),
     ("servers[0].url", "labels 1 to 63")),
    ("64-char-label", json.dumps({"servers": [{"name": "x", "url": f"http://{'a' * 64}.example:8000"}]}),
     ("servers[0].url", "labels 1 to 63")),
    ("sidecar-host", json.dumps({"servers": [{"name": "x", "url": "http://127.0.0.1:9",
                                              "sidecar_urls": ["http://a..b:9000"]}]}),
     ("servers[0].sidecar_urls[0]", "labels 1 to 63")),
    ("half-a-layer", _server(model={**SHAPE, "layers": 0.5}), ("servers[0].model.layers", "positive integer")),
    ("half-a-hidden-size", _server(model={**SHAPE, "hidden_size": 0.5}),
     ("servers[0].model.hidden_size", "positive integer")),
    ("zero-layers-config-json", _server(model_config="{dir}/config.json"),
     ("config.json: num_hidden_layers", "positive integer")),
    ("headroom-1e308", "buffer_headroom: 1.0e+308\n", ("buffer_headroom", "<= 100")),
    ("p99-1e300", "p99_tool_latency: 1.0e+300\n", ("p99_tool_latency", "at most 24h")),
    ("exponent-as-text", "servers: [{name: x, url: 'http://127.0.0.1:9', model: {active_parameters: 8.0e9}}]\n",
     ("servers[0].model.active_parameters", "write 8.0e+9")),
    ("duration-exponent-as-text", "p99_tool_latency: 1e3\n", ("p99_tool_latency", "write 1.0e+3")),
]


def _kvwatt(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "lab")])}
    env.pop("KVWATT_CONFIG", None)
    # a configuration `run` takes would run until killed: the timeout fails the test
    return subprocess.run([sys.executable, "-m", "exporter", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=30)


def _assert_one_line(proc: subprocess.CompletedProcess, says: tuple[str, ...]) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    for text in says:
        assert text in lines[0], lines[0]


@pytest.mark.parametrize("text,says", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_config_and_run_refuse_alike(tmp_path, text, says):
    (tmp_path / "config.json").write_text(json.dumps(ZERO_LAYERS))
    path = tmp_path / "kvwatt.yaml"
    path.write_text(text.replace("{dir}", str(tmp_path)))
    _assert_one_line(_kvwatt("check-config", str(path)), says)
    _assert_one_line(_kvwatt("run", "--config", str(path), "--listen", f"127.0.0.1:{free_port()}",
                             "--state-dir", str(tmp_path / "state")), says)


def _config(**kw):
    return from_mapping({"servers": [{"name": "x", "url": "http://127.0.0.1:9", **kw}]})


def test_what_is_within_the_bounds_is_taken():
    """The bounds refuse the absurd only: a Unicode host, a trailing dot, IP addresses, integral floats for
    counts, a day of tool-call latency, a hundredfold headroom."""
    for url in ("http://bücher.example:8000", "http://host.:80", "http://[::1]:8000", "http://10.0.0.1:8000",
                f"http://{'a' * 63}.example"):
        assert _config(url=url).servers[0].url == url
    assert _config(model={**SHAPE, "layers": 32.0}).servers[0].model["layers"] == 32
    cfg = from_mapping({"p99_tool_latency": "24h", "buffer_headroom": 100})
    assert (cfg.p99_tool_latency_seconds, cfg.buffer_headroom) == (86400.0, 100.0)
    for bad in ({"p99_tool_latency": "25h"}, {"buffer_headroom": 100.5}):
        with pytest.raises(ConfigError):
            from_mapping(bad)
    with pytest.raises(ConfigError, match="remove the quotes"):
        _config(model={**SHAPE, "active_parameters": "8.0e+9"})
