"""One place per setting: the table in exporter/config/settings.py (SETTINGS) declares every configuration key,
environment variable and flag of `kvwatt run`; KEYS, the environment, the flags and the README's configuration
table are derived from it. These tests fail when a setting is declared anywhere else: a flag added in
commands/run.py, an environment variable read by name in the daemon, a Config attribute without a row."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

from exporter import config, rules
from exporter.commands import run
from exporter.config import settings
from exporter.tooling import readme_tables

ROOT = Path(__file__).resolve().parents[1]
NOT_SETTINGS = {"-h", "--help", "--version"}  # argparse's own and the build's version: no setting


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvwatt run")
    run.add_arguments(p)
    return p


def test_every_flag_of_kvwatt_run_is_a_row_of_the_table():
    table = {f for s in settings.SETTINGS for f in s.flags}
    options = {o for a in _run_parser()._actions for o in a.option_strings} - NOT_SETTINGS
    assert options == table, f"flags without a row: {options - table}; rows without a flag: {table - options}"


def test_commands_run_declares_no_flag_of_its_own():
    """commands/run.py may add only --version; every other flag comes from settings.add_flags."""
    tree = ast.parse((ROOT / "exporter" / "commands" / "run.py").read_text())
    declared = [c.args[0].value for c in ast.walk(tree)
                if isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "add_argument"
                and c.args and isinstance(c.args[0], ast.Constant)]
    assert declared == ["--version"], declared


def test_no_environment_variable_is_read_outside_the_table():
    """A string that is exactly a KVWATT_ variable name (a lookup key, not prose) appears only in the table."""
    name = re.compile(r"^KVWATT_[A-Z0-9_]+$")
    found = []
    for path in (ROOT / "exporter").rglob("*.py"):
        if path == ROOT / "exporter" / "config" / "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and name.match(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert not found, found
    envs = [s.env for s in settings.SETTINGS if s.env]
    assert len(envs) == len(set(envs))


def test_the_environment_sets_what_the_table_says():
    """Each variable of the table, set alone, changes its row's attribute (and nothing reads a variable that is
    not in the table: the layer iterates the table)."""
    values = {"listen": "127.0.0.1:1234", "interval_seconds": "2s", "state_dir": "/tmp/x", "powercap_root": "/tmp/p",
              "log_level": "debug", "log_format": "json", "electricity_price": "0.3", "electricity_currency": "eur",
              "carbon_intensity": "200", "servers": "a=http://127.0.0.1:9", "processes": "3"}
    rows = [s for s in settings.ENVIRONMENT if s.attribute is not None]
    assert {s.attribute for s in rows} == set(values)
    for s in rows:
        cfg = config.apply_environment(config.Config(), {s.env: values[s.attribute]})
        assert getattr(cfg, s.attribute) != getattr(config.Config(), s.attribute), s.env


def test_config_attributes_and_keys_are_the_tables():
    attributes = {s.attribute for s in settings.SETTINGS if s.attribute is not None}
    fields = {f.name for f in dataclasses.fields(config.Config)}
    assert fields - attributes == {"notice"}  # not a setting: the sentence `kvwatt demo` shows
    assert attributes <= fields
    assert list(config.KEYS) == [s.key for s in settings.SETTINGS if s.key is not None]
    for s in settings.SETTINGS:  # a shared rule's row takes its key, attribute and meaning from rules.py
        if s.key in rules.RULES:
            r = rules.RULES[s.key]
            assert (s.attribute, s.meaning) == (r.attribute, r.meaning)
            assert getattr(config.Config(), s.attribute) == r.default


def test_the_readme_table_has_a_row_per_key_of_the_table():
    table = readme_tables.config_table()
    keys = re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.M)
    assert keys == [s.key for s in settings.SETTINGS if s.key is not None]


def _declared_flags(module: str) -> list[str]:
    tree = ast.parse((ROOT / "exporter" / "commands" / f"{module}.py").read_text())
    return [c.args[0].value for c in ast.walk(tree)
            if isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "add_argument"
            and c.args and isinstance(c.args[0], ast.Constant)]


def test_other_commands_take_the_shared_flags_from_the_table():
    """kvwatt baseline idle / record read the daemon's configuration: their --config, --state-dir,
    --powercap-root and --interval are the table's rows (settings.add_shared_flags), with the table's help; none
    is typed again in the command (the --server of these commands is a selector of one server, their own)."""
    from exporter.commands import baseline_idle, baseline_record
    table = {s.dest: s for s in settings.FLAGS}
    for module in (baseline_idle, baseline_record):
        name = module.__name__.rsplit(".", 1)[1]
        redeclared = set(_declared_flags(name)) & {table[d].flags[0] for d in settings.SHARED_FLAGS}
        assert not redeclared, f"{name} declares {redeclared} itself"
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        actions = {a.dest: a for a in p._actions}
        for dest in settings.SHARED_FLAGS:
            assert actions[dest].help == table[dest].help and actions[dest].default is None, (name, dest)


def test_baseline_idle_samples_at_the_configured_interval(tmp_path):
    """--interval unset: the configuration's interval (a flag no longer carries its own default of 1s)."""
    from exporter.commands import baseline_idle
    cfg_file = tmp_path / "kvwatt.yaml"
    cfg_file.write_text(f"interval: 2s\nstate_dir: {tmp_path}\n")
    p = argparse.ArgumentParser()
    baseline_idle.add_arguments(p)
    cfg, _ = baseline_idle._config(p.parse_args(["--config", str(cfg_file), "--no-server-check"]))
    assert cfg.interval_seconds == 2.0
    cfg, _ = baseline_idle._config(p.parse_args(["--config", str(cfg_file), "--no-server-check",
                                                 "--interval", "500ms"]))
    assert cfg.interval_seconds == 0.5
