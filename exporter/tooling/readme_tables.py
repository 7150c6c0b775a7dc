"""Generates the README's configuration and metric reference from the code (config.SETTINGS with its defaults
from Config() and the shared rules' meanings from exporter/rules/__init__.py, catalog.METRICS).

The metric reference also says where /api/status carries each figure (exporter.serve.web.status_paths).

    python -m exporter.tooling.readme_tables --write   # rewrite the README sections between the markers
    python -m exporter.tooling.readme_tables --check   # exit 1 when the README is stale (tests/test_readme_tables.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from exporter import catalog, config, rules
from exporter.rules import optin
from exporter.serve import web

README = Path(__file__).resolve().parents[2] / "README.md"

# Keys that are not shared rules: (default as written in YAML where Config's cannot say it, meaning), from the
# settings table (exporter/config/settings.py). The shared rules' defaults and meanings come from
# exporter/rules/__init__.py,
# every other default from Config() itself.
CONFIG_DOCS: dict[str, tuple[str | None, str]] = {s.key: (s.default, s.meaning) for s in config.SETTINGS
                                                  if s.key is not None and s.key not in rules.RULES}

_DURATION_PARSERS = (config.parse_duration, config.parse_interval)


def yaml_default(key: str) -> str:
    """Config()'s default of ``key`` as written in YAML: durations as 30s/1m/6h, booleans lower case."""
    attribute, parse = config.KEYS[key]
    value = getattr(config.Config(), attribute)
    if value is None:
        return "none"
    if parse in _DURATION_PARSERS or getattr(parse, "duration", False):
        text = config.format_window(value)
    elif isinstance(value, tuple):
        text = f"[{', '.join(config.format_window(v) for v in value)}]"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, dict):
        text = "{}" if not value else str(value)
    else:
        text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"`{text}`"


def config_row(key: str) -> tuple[str, str]:
    """(default, meaning) of one configuration key."""
    if key in rules.RULES:
        return yaml_default(key), rules.RULES[key].meaning
    default, meaning = CONFIG_DOCS[key]
    return default or yaml_default(key), meaning


def config_table() -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k}` | {' | '.join(config_row(k))} |" for k in config.KEYS]
    return "\n".join(rows)


def metric_table() -> str:
    """One row per catalog declaration; "in /api/status" is where servers[] carries the figure (web.status_paths:
    its own key, or the block that serialises it), "-" where it is in /metrics only."""
    out = []
    for section in dict.fromkeys(m.section for m in catalog.METRICS):
        out += [f"**{section}**", "", "| series | type | labels | meaning | computed in | in /api/status |",
                "|---|---|---|---|---|---|"]
        for m in catalog.METRICS:
            if m.section == section:
                labels = ", ".join(f"`{label}`" for label in m.labels)
                where = ", ".join(f"`{p}`" for p in web.status_paths(m)) or "-"
                opt = " *opt-in* (`metrics_opt_in`)" if m.name in optin.OPT_IN_FAMILIES else ""
                opt += f" *deprecated* (use `{m.deprecated}`)" if m.deprecated else ""
                computed = ", ".join(f"`{w}`" for w in m.wheres)  # each kind's formula, or what produces it
                out.append(f"| `{m.name}`{opt} | {m.type} | {labels} | {m.help.replace('|', '/')} | {computed} "
                           f"| {where} |")
        out.append("")
    return "\n".join(out).rstrip()


SECTIONS = {"config": config_table, "metrics": metric_table}


def render(readme: str) -> str:
    for name, fn in SECTIONS.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        head, sep, rest = readme.partition(begin)
        if not sep:
            raise SystemExit(f"README.md: marker {begin} missing")
        _, sep2, tail = rest.partition(end)
        if not sep2:
            raise SystemExit(f"README.md: marker {end} missing")
        readme = f"{head}{begin}\n{fn()}\n{end}{tail}"
    return readme


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    current = README.read_text()
    new = render(current)
    if args.check:
        if new != current:
            print("README.md reference is stale: run python -m exporter.tooling.readme_tables --write", file=sys.stderr)
            return 1
        return 0
    if args.write:
        README.write_text(new)
    else:
        print(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
