"""`kvwatt` command line. Each command lives in its own module exposing add_arguments(parser) and
main(args) -> exit status; this file only wires them. Bad input anywhere: one line on stderr, exit 2.

The daemon's commands are in exporter/commands/. The lab's (`replay`, `experiment`) belong to the separate
distribution in lab/ and register themselves through the ``kvwatt.commands`` entry points, so the daemon
never imports the lab; without it installed they answer with the one line that says how to install it."""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import entry_points

from exporter.config import ConfigError
from exporter.runtime.build import VersionAction

# command path -> (module, one-line help). Sub-commands of "baseline" are "baseline idle" etc.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("exporter.commands.run", "run the daemon: sample vLLM, NVML and RAPL and serve /metrics"),
    "check-config": ("exporter.commands.check_config", "validate a configuration file (exit 2 on the first problem)"),
    "baseline idle": ("exporter.commands.baseline_idle", "measure the idle power baseline now and persist it"),
    "baseline record": ("exporter.commands.baseline_record",
                        "record an OFF-condition profile (J/token, tokens/s by KV-pressure band)"),
    "demo": ("exporter.commands.demo", "see kvwatt at work on loopback: a real engine's capture replayed, energy "
                                       "simulated (no engine or GPU needed)"),
}
# The lab's commands (lab/pyproject.toml entry points): name -> help shown when the lab is not installed.
LAB_COMMANDS: dict[str, str] = {
    "replay": "replay agentic traces against an OpenAI-compatible server (kvwatt lab)",
    "experiment": "run a paired ON/OFF experiment plan and write its report (kvwatt lab)",
}
LAB_INSTALL = "pip install ./lab from a kvwatt checkout (or `make lab`)"


def lab_modules() -> dict[str, str]:
    """The installed lab's commands: name -> module (``kvwatt.commands`` entry points)."""
    return {ep.name: ep.value for ep in entry_points(group="kvwatt.commands") if ep.name in LAB_COMMANDS}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too; keep it short)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _import(name: str):
    """Import a command module; None only when that very module is absent (tests/test_config.py
    test_every_command_is_present requires every command to be present, so this never hides a missing command
    in a release)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):
            return None
        raise


def _missing(name: str) -> int:
    print(f"kvwatt: error: this build lacks {name}", file=sys.stderr)
    return 2


def _lab_missing(command: str) -> int:
    print(f"kvwatt: error: `kvwatt {command}` is part of the kvwatt lab, which is not installed: {LAB_INSTALL}",
          file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvwatt", description="Watch vLLM servers with KV offloading: KV pressure, recomputation and "
                                                "energy per token.")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (module_name, help_) in COMMANDS.items():
        head, _, tail = path.partition(" ")
        if tail:
            if head not in groups:
                g = sub.add_parser(head, help=f"{head} commands")
                groups[head] = g.add_subparsers(dest=f"{head}_command", required=True, parser_class=_Parser)
            p = groups[head].add_parser(tail, help=help_, description=help_)
        else:
            p = sub.add_parser(head, help=help_, description=help_)
        module = _import(module_name)
        if module is None:
            p.set_defaults(_main=lambda _a, m=module_name: _missing(m))
            continue
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    installed = lab_modules()
    for name, help_ in LAB_COMMANDS.items():
        if name not in installed:  # parse anything: the command itself then says how to get the lab
            p = sub.add_parser(name, help=f"{help_}; not installed", add_help=False)
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(_main=lambda _a, n=name: _lab_missing(n))
            continue
        p = sub.add_parser(name, help=help_, description=help_)
        module = importlib.import_module(installed[name])
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._main(args) or 0)
    except ConfigError as e:  # one line, whatever the message quotes (a path, a value with newlines)
        print("kvwatt: error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
