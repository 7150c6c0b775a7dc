"""The tiers' guard (tests/support/tiers.py): a test that starts the engine's python, a Prometheus binary or
chromium without its marker fails, the same test with its marker runs; an unmarked test that runs longer than
the slow limit fails, marked slow it runs; an engine test without the engine fails with the install step.
Stand-in programs with those names are started in a separate pytest run, so no real slow dependency is
needed."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFTEST = "from tests.support.tiers import pytest_configure, pytest_runtest_makereport, pytest_runtest_protocol\n"
TESTS = '''
import asyncio, os, subprocess
import pytest

def run(name):
    return subprocess.run([name], capture_output=True, text=True).stdout

def test_unmarked_promtool():
    run("promtool")

@pytest.mark.prom
def test_marked_promtool():
    assert run("promtool") == "stand-in\\n"

def test_unmarked_amtool_error_swallowed():
    try:
        run("amtool")
    except RuntimeError:
        pass

def test_unmarked_engine():
    run(os.environ["KVWATT_VLLM_PYTHON"])

@pytest.mark.engine
def test_marked_engine():
    assert run(os.environ["KVWATT_VLLM_PYTHON"]) == "stand-in\\n"

def test_unmarked_chromium_through_asyncio():
    async def start():
        proc = await asyncio.create_subprocess_exec("chromium")
        await proc.wait()
    asyncio.run(start())

@pytest.mark.browser
def test_marked_chromium_through_asyncio():
    async def start():
        proc = await asyncio.create_subprocess_exec("chromium", stdout=subprocess.DEVNULL)
        return await proc.wait()
    assert asyncio.run(start()) == 0

def test_other_programs_need_no_marker():
    assert run("true") == ""
'''


def stand_in(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho stand-in\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_unmarked_starts_fail_and_marked_ones_run(tmp_path):
    bin_dir = tmp_path / "bin"
    for name in ("promtool", "amtool", "chromium"):
        stand_in(bin_dir / name)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               KVWATT_VLLM_PYTHON=stand_in(tmp_path / "venv-vllm" / "bin" / "python"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(CONFTEST)
    (project / "test_tiered.py").write_text(TESTS)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-W", "ignore", "."],
                       cwd=project, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    outcome = dict((name, word)
                   for word, name in re.findall(r"^(PASSED|FAILED|ERROR) test_tiered\.py::(\w+)", out, re.M))
    assert outcome == {
        "test_unmarked_promtool": "FAILED", "test_marked_promtool": "PASSED",
        "test_unmarked_amtool_error_swallowed": "FAILED",
        "test_unmarked_engine": "FAILED", "test_marked_engine": "PASSED",
        "test_unmarked_chromium_through_asyncio": "FAILED", "test_marked_chromium_through_asyncio": "PASSED",
        "test_other_programs_need_no_marker": "PASSED"}, out
    assert "test_unmarked_promtool starts promtool without @pytest.mark.prom" in out
    assert "test_unmarked_amtool_error_swallowed starts amtool without @pytest.mark.prom" in out
    assert "test_unmarked_engine starts python without @pytest.mark.engine" in out
    assert "starts chromium without @pytest.mark.browser" in out
    assert r.returncode == 1


ALL_HOOKS = ("from tests.support.tiers import pytest_collection_modifyitems, pytest_configure, "
             "pytest_runtest_makereport, pytest_runtest_protocol, pytest_runtest_setup\n")
TIMED = '''
import time
import pytest
from tests.support import tiers

def over_the_limit():
    time.sleep(tiers.slow_limit_seconds() + 0.5)

def test_unmarked_long():
    over_the_limit()

@pytest.mark.slow
def test_marked_long():
    over_the_limit()

def test_unmarked_short():
    pass

@pytest.mark.engine
def test_engine_without_the_engine():
    pass

def test_tier_timeout_applied(request):
    assert request.node.get_closest_marker("timeout").args == (tiers.TIMEOUT_SECONDS[None],)
'''


def test_long_unmarked_tests_fail_and_engine_tests_need_the_engine(tmp_path):
    env = dict(os.environ, KVWATT_SLOW_SECONDS="1",
               KVWATT_VLLM_PYTHON=str(tmp_path / "no-venv" / "bin" / "python"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(ALL_HOOKS)
    (project / "test_timed.py").write_text(TIMED)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-W", "ignore", "."],
                       cwd=project, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    outcome = dict((name, word) for word, name in
                   re.findall(r"^(PASSED|FAILED|ERROR) test_timed\.py::(\w+)", out, re.M))
    assert outcome == {"test_unmarked_long": "FAILED", "test_marked_long": "PASSED", "test_unmarked_short": "PASSED",
                       "test_engine_without_the_engine": "ERROR", "test_tier_timeout_applied": "PASSED"}, out
    assert re.search(r"test_unmarked_long ran \d+ s \(> \d+ s\) without a tier marker", out), out
    assert "the vLLM engine is not installed" in out and "make test" in out
    assert r.returncode == 1


def test_modules_with_a_real_time_scenario_are_collected_first_each_kept_whole(tmp_path):
    """The order parallel workers take modules in (--dist loadfile): a slow-marked module first, so the longest
    waits start first, each module's tests together and in their own order."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(ALL_HOOKS)
    (project / "test_a.py").write_text("def test_a1():\n    pass\n\ndef test_a2():\n    pass\n")
    (project / "test_b.py").write_text("import pytest\n\ndef test_b1():\n    pass\n\n"
                                       "@pytest.mark.slow\ndef test_b2():\n    pass\n\ndef test_b3():\n    pass\n")
    (project / "test_c.py").write_text("def test_c1():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                        "-m", "", "-o", "markers=slow", "."], cwd=project, env=env, capture_output=True, text=True,
                       timeout=120)
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert ids == ["test_b.py::test_b1", "test_b.py::test_b2", "test_b.py::test_b3", "test_a.py::test_a1",
                   "test_a.py::test_a2", "test_c.py::test_c1"], r.stdout + r.stderr
