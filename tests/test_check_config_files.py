"""`kvwatt check-config` says ok only for what `kvwatt run` would start with: the files the configuration names
(web config, a server's recorded baseline and model config.json) are loaded as run loads them, and a setting run
would fail on (phase_history 1e21: an OverflowError traceback at start) is refused by both with one line and
exit status 2. The real CLI in subprocesses (tests/test_bad_input.py's kvwatt, under its memory ceiling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_bad_input import closed_port, kvwatt


def _config(tmp: Path, extra: str, server_extra: str = "") -> Path:
    (tmp / "powercap").mkdir(exist_ok=True)
    path = tmp / "kvwatt.yaml"
    path.write_text(f"listen: 127.0.0.1:{closed_port()}\nnvml: false\nstate_dir: {tmp / 'state'}\n"
                    f"powercap_root: {tmp / 'powercap'}\n{extra}"
                    f"servers:\n  - {{name: a, url: 'http://127.0.0.1:1'{server_extra}}}\n")
    return path


def _one_line(r, *parts: str) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvwatt: error: ") and all(p in lines[0] for p in parts), lines
    return lines[0]


def _web(tmp: Path) -> tuple[str, str]:
    (tmp / "web.yml").write_text("basic_auth_users:\n  prometheus: not-a-bcrypt-hash\n")
    return f"web_config_file: {tmp / 'web.yml'}\n", ""


def _baseline(tmp: Path) -> tuple[str, str]:
    (tmp / "off.json").write_text("{")
    return "", f", recorded_baseline: '{tmp / 'off.json'}'"


def _model(tmp: Path) -> tuple[str, str]:
    (tmp / "config.json").write_text(json.dumps({"num_hidden_layers": "many"}))
    return "", f", model_config: '{tmp / 'config.json'}'"


def _phase_history(tmp: Path) -> tuple[str, str]:
    return "phase_history: 1.0e+21\n", ""


@pytest.mark.parametrize("make, says", [
    (_web, "web.yml"),
    (_baseline, "off.json"),
    (_model, "config.json"),
    (_phase_history, "phase_history: must be at most 168h"),
], ids=["web_config", "recorded_baseline", "model_config", "phase_history"])
def test_check_config_refuses_what_run_refuses(tmp_path, make, says):
    """Before: check-config printed 'ok' for each of these, and run exited 2 (or, phase_history, raised an
    OverflowError traceback at start)."""
    extra, server_extra = make(tmp_path)
    path = _config(tmp_path, extra, server_extra)
    checked = _one_line(kvwatt("check-config", str(path)), says)
    ran = _one_line(kvwatt("run", "--config", str(path)), says)
    assert checked == ran, (checked, ran)  # the same problem, in the same words


def test_check_config_names_the_files_it_loaded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
        "intermediate_size": 14336, "vocab_size": 128256,
        "torch_dtype": "bfloat16"}))
    path = _config(tmp_path, "", f", model_config: '{tmp_path / 'config.json'}'")
    r = kvwatt("check-config", str(path))
    assert r.returncode == 0, r.stderr
    assert "ok;" in r.stdout and f"loaded: a model_config {tmp_path / 'config.json'}" in r.stdout, r.stdout


@pytest.mark.parametrize("word", ["on", "off", "yes", "no"])
def test_a_server_named_like_a_yaml_boolean_is_told_to_quote_it(tmp_path, word):
    """YAML 1.1 reads these unquoted as booleans; the error said only 'expected a non-empty string, got True'."""
    import yaml

    from exporter.config import ConfigError, from_mapping
    text = f"servers:\n  - {{name: {word}, url: 'http://127.0.0.1:1'}}\n"
    with pytest.raises(ConfigError, match=r'^servers\[0\]\.name: .*boolean: quote it, e\.g\. "on"\)$'):
        from_mapping(yaml.safe_load(text))
    if word == "on":  # the CLI once: one line, exit 2
        path = tmp_path / "kvwatt.yaml"
        path.write_text(text)
        _one_line(kvwatt("check-config", str(path)), "servers[0].name: ", "quote it")
