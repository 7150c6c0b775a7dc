"""The test tiers' guard (a pytest plugin, loaded by tests/conftest.py): a test that starts a real slow
dependency must carry its marker, so that `-m "not engine and not prom and not browser"` (make test-fast)
stays the fast tier and a new slow test cannot silently join it.

The markers are declared in pyproject.toml ([tool.pytest.ini_options], with --strict-markers):
    engine   the real vLLM engine: any process run by the vLLM venv's python (KVWATT_VLLM_PYTHON)
    prom     prometheus, alertmanager, promtool, amtool
    browser  chromium

The check is made where the process starts (the "subprocess.Popen" audit event, which asyncio's subprocesses
raise too), not on fixture or helper names: a test that reaches the binary through any helper is caught.
The start is refused (the test errors with the reason) and the test is reported failed even if it swallowed
that error. Processes started by a child process (e.g. the engine a `kvwatt experiment` subprocess starts)
are out of its sight.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

PROM_BINARIES = {"prometheus", "promtool", "amtool", "alertmanager", "prometheus-alertmanager"}
BROWSER_BINARIES = {"chromium", "chromium-browser"}
REPO = Path(__file__).resolve().parents[2]

_running: list[pytest.Item] = []  # the item whose setup/call/teardown runs now (at most one)
_VIOLATIONS = pytest.StashKey[list]()


def vllm_python() -> str:
    # as tests/support/engine.vllm_python (not imported: it pulls in the lab)
    return os.environ.get("KVWATT_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def tier_of(argv0: str) -> str | None:
    """The marker a process needs, from the program it runs."""
    if os.path.abspath(argv0) == os.path.abspath(vllm_python()):
        return "engine"
    name = os.path.basename(argv0)
    if name in PROM_BINARIES:
        return "prom"
    if name in BROWSER_BINARIES:
        return "browser"
    return None


def _program(executable, args) -> str | None:
    if executable:
        return os.fsdecode(executable)
    if isinstance(args, (str, bytes, os.PathLike)):
        return os.fsdecode(args).split()[0] if os.fsdecode(args).split() else None
    args = list(args)
    return os.fsdecode(args[0]) if args else None


def _audit(event: str, args: tuple) -> None:
    if event != "subprocess.Popen" or not _running:
        return
    program = _program(args[0], args[1])
    tier = tier_of(program) if program else None
    item = _running[-1]
    if tier is None or item.get_closest_marker(tier) is not None:
        return
    reason = (f"{item.nodeid} starts {os.path.basename(program)} without @pytest.mark.{tier}: "
              f"mark it (tests/support/tiers.py) so the fast tier stays fast")
    item.stash.setdefault(_VIOLATIONS, []).append(reason)
    raise RuntimeError(reason)


def pytest_configure(config: pytest.Config) -> None:
    if not getattr(sys, "_kvwatt_tiers_audit", False):  # audit hooks cannot be removed: add it once
        sys.addaudithook(_audit)
        sys._kvwatt_tiers_audit = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _running.append(item)
    try:
        yield
    finally:
        _running.remove(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    violations = item.stash.get(_VIOLATIONS, [])
    if violations and report.when == "call" and not report.failed:
        report.outcome = "failed"
        report.longrepr = "\n".join(violations)
