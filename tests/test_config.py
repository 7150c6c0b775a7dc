"""Configuration: every bad key is one line naming the key, exit status 2; precedence file < env < flags."""

import subprocess
import sys

import pytest

from exporter.config import ConfigError, from_mapping, parse_duration, resolve
from tests.conftest import REPO


@pytest.mark.parametrize("data,key", [
    ({"listen": "nohostport"}, "listen"),
    ({"interval": "fast"}, "interval"),
    ({"interval": "0.01s"}, "interval"),
    ({"windows": []}, "windows"),
    ({"windows": ["1m", "60s"]}, "windows"),
    ({"kv_pressure_threshold": 1.5}, "kv_pressure_threshold"),
    ({"kv_pressure_threshold": "high"}, "kv_pressure_threshold"),
    ({"servers": [{"name": "a"}]}, "servers[0].url"),
    ({"servers": [{"name": "a", "url": "ftp://x"}]}, "servers[0].url"),
    ({"servers": [{"name": "a", "url": "http://x", "gpus": "all"}]}, "servers[0].gpus"),
    ({"servers": [{"name": "a", "url": "http://x", "colour": 1}]}, "servers[0].colour"),
    ({"servers": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]}, "servers"),
    ({"servers": [{"name": "a", "url": "http://x", "pair_off_server": "b"}]}, "servers[0].pair_off_server"),
    ({"servers": [{"name": "a", "url": "http://x", "model": {"layers": -1}}]}, "servers[0].model.layers"),
    ({"nvml": "yes"}, "nvml"),
    ({"unknown_key": 1}, "unknown_key"),
])
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        from_mapping(data)
    assert str(e.value).startswith(key + ":"), str(e.value)
    assert "\n" not in str(e.value)


def test_durations():
    assert parse_duration("5m", "k") == 300 and parse_duration("1.5h", "k") == 5400
    assert parse_duration(30, "k") == 30 and parse_duration("250ms", "k") == 0.25


def test_defaults_watch_localhost_8000_as_default():
    cfg = resolve(None, env={})
    assert [(s.name, s.url) for s in cfg.servers] == [("default", "http://127.0.0.1:8000")]
    assert cfg.listen == "0.0.0.0:8492" and cfg.interval_seconds == 1.0
    assert cfg.windows_seconds == (60.0, 300.0) and cfg.kv_pressure_threshold_ratio == 0.9


def test_precedence_file_then_environment_then_flags(tmp_path):
    f = tmp_path / "k.yaml"
    f.write_text("listen: 127.0.0.1:1111\ninterval: 2s\nservers:\n  - {name: a, url: 'http://f:1', gpus: [0]}\n")
    env = {"KVWATT_LISTEN": "127.0.0.1:2222", "KVWATT_INTERVAL": "3s"}
    cfg = resolve(str(f), env=env)
    assert cfg.listen == "127.0.0.1:2222" and cfg.interval_seconds == 3.0
    assert cfg.servers[0].gpus == ("0",)
    cfg = resolve(str(f), servers=["a=http://flag:2", "b=http://flag:3"], listen="127.0.0.1:3333",
                  interval="500ms", env=env)
    assert cfg.listen == "127.0.0.1:3333" and cfg.interval_seconds == 0.5
    assert [(s.name, s.url, s.gpus) for s in cfg.servers] == [("a", "http://flag:2", ("0",)),
                                                               ("b", "http://flag:3", ())]
    assert resolve(None, env={"KVWATT_SERVERS": "x=http://e:1"}).servers[0].url == "http://e:1"


def test_server_flag_and_environment_keep_the_files_per_server_settings(tmp_path):
    f = tmp_path / "k.yaml"
    f.write_text("servers:\n  - {name: a, url: 'http://f:1', gpus: [0], reference_local_compute_share: 0.04}\n"
                 "kv_pressure_threshold_source: configured\nthreshold_window: 30s\nthreshold_min_windows: 8\n")
    for cfg in (resolve(str(f), servers=["a=http://flag:2"], env={}),
                resolve(str(f), env={"KVWATT_SERVERS": "a=http://flag:2"}),
                resolve(str(f), servers=["a=http://flag:2"], env={"KVWATT_SERVERS": "b=http://e:1"})):
        (a,) = cfg.servers
        assert (a.url, a.gpus, a.reference_local_compute_share) == ("http://flag:2", ("0",), 0.04)
    assert (cfg.kv_pressure_threshold_source, cfg.threshold_window_seconds, cfg.threshold_min_windows) == \
        ("configured", 30.0, 8)
    assert resolve(None, env={}).kv_pressure_threshold_source == "located"
    with pytest.raises(ConfigError, match="^kv_pressure_threshold_source: expected one of located, configured, "
                                          "got 'auto'$"):
        from_mapping({"kv_pressure_threshold_source": "auto"})


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "exporter", *args], cwd=REPO, capture_output=True, text=True)


def test_check_config_cli_ok_and_bad(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("servers:\n  - {name: a, url: 'http://127.0.0.1:8000'}\nwindows: [30s, 5m]\n")
    r = run_cli("check-config", str(good))
    assert r.returncode == 0 and "ok" in r.stdout and "30s, 5m" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("servers:\n  - {name: a, url: 'http://127.0.0.1:8000', gpus: all}\n")
    r = run_cli("check-config", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["kvwatt: error: servers[0].gpus: expected a list of GPU indices or UUIDs, "
                                             "got 'all'"]
    broken = tmp_path / "broken.yaml"
    broken.write_text("servers: [\n")
    r = run_cli("check-config", str(broken))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not valid YAML" in r.stderr
    r = run_cli("check-config", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_run_with_bad_flags_exits_2_with_one_line():
    r = run_cli("run", "--server", "nourl")
    assert r.returncode == 2 and r.stderr.strip() == "kvwatt: error: --server: expected NAME=URL, got 'nourl'"
    r = run_cli("run", "--interval", "-1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_every_command_is_present():
    from exporter.cli import COMMANDS, _import
    missing = [m for m, _ in COMMANDS.values() if _import(m) is None]
    assert missing == []
