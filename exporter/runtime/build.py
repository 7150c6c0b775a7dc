"""What this kvwatt is: version, source revision, Python version (``kvwatt --version``, kvwatt_build_info).

The revision is the git commit of the source tree kvwatt runs from (a checkout or an editable install), or
"unknown" (an installed wheel, a container image built without .git): looked up once, on first use.
"""

from __future__ import annotations

import argparse
import functools
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from exporter import __version__

SOURCE_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BuildInfo:
    version: str
    revision: str
    python_version: str

    def line(self) -> str:
        """`kvwatt, version X (revision R, python P)`, as Prometheus' own --version starts."""
        return f"kvwatt, version {self.version} (revision {self.revision}, python {self.python_version})"


def _revision() -> str:
    if not (SOURCE_ROOT / ".git").exists():  # installed into site-packages: that tree's git is not ours
        return "unknown"
    try:
        r = subprocess.run(["git", "-C", str(SOURCE_ROOT), "rev-parse", "--short=12", "HEAD"],
                           capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs
        return "unknown"
    rev = r.stdout.strip()
    return rev if r.returncode == 0 and rev.isalnum() else "unknown"


@functools.lru_cache(maxsize=1)
def build_info() -> BuildInfo:
    return BuildInfo(__version__, _revision(), platform.python_version())


class VersionAction(argparse.Action):
    """``--version``: print BuildInfo.line() on stdout and exit 0 (the revision is looked up only then, not
    whenever a parser is built)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "print the version, source revision and Python version, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(build_info().line(), file=sys.stdout, flush=True)
        parser.exit(0)
