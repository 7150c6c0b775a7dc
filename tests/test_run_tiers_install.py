"""scripts/run_tiers.py --install-rest (scripts/test.sh): the Debian and vLLM install steps run beside the first
pass's own-session run (the fast tier) and are waited for before a run that needs them (the waiting tiers, beside it)
and before the next pass; a failed install stops the run with its exit status, only the fast tier having run. Real
pytest runs over a throwaway tests/ directory, a throwaway scripts/install-deps.sh standing in for the real one (which
would apt-get and pip-install vLLM)."""

from __future__ import annotations

import os
import stat

from tests.test_engine_shards import _run_tiers

PASSING = "def test_ok():\n    assert True\n"
# records its process's niceness and whether it leads a session of its own (the own-session run's pytest does)
RECORDING = """import os, pathlib
def test_ok():
    with open(pathlib.Path(__file__).parent.parent / "ran.txt", "a") as f:
        f.write(f"{os.nice(0)} {os.getsid(0) == os.getpid()}\\n")
"""


def _run(tmp_path, monkeypatch, capsys, install_exit: int) -> tuple[int, str]:
    run_tiers = _run_tiers()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_one.py").write_text(RECORDING)
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "install-deps.sh"
    # says the steps it was asked for, then takes a second, as a real install would take minutes
    script.write_text(f"#!/bin/sh\necho \"install steps: $*\"\nsleep 1\nexit {install_exit}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(run_tiers, "REPO", tmp_path)
    one = run_tiers.Run(["-p", "no:cacheprovider", "tests"], {}, False)
    beside = [run_tiers.Run(one.args, {}, False, own_session=True), one._replace(after_install=True)]
    monkeypatch.setattr(run_tiers, "passes", lambda kind, expr: [("first pass", beside), ("second pass", [one])])
    code = run_tiers.main(["all", "--install-rest"])
    return code, capsys.readouterr().out


def test_the_install_runs_beside_the_first_pass_and_is_waited_for_before_the_second(tmp_path, monkeypatch, capsys):
    code, out = _run(tmp_path, monkeypatch, capsys, install_exit=0)
    assert code == 0, out
    started = out.index("=== installing the Debian packages and vLLM beside the fast tier")
    first, steps = out.index("=== first pass"), out.index("install steps: debian vllm")
    waited, second = out.index("=== install beside the fast tier: exit 0"), out.index("=== second pass")
    niced_started = out.index("(a session of its own)")
    waiting_started = out.index("--- started: pytest -p no:cacheprovider tests\n")
    assert started < first < niced_started < steps < waited < waiting_started < second, out
    assert out.rstrip().splitlines()[-1] == "tests: 3 passed, 0 failed, 0 skipped"
    base = os.nice(0)
    assert sorted((tmp_path / "ran.txt").read_text().splitlines()) == sorted(
        [f"{base} False", f"{base} False", f"{base} True"])


def test_a_failed_install_stops_the_run_with_its_status_before_the_second_pass(tmp_path, monkeypatch, capsys):
    code, out = _run(tmp_path, monkeypatch, capsys, install_exit=3)
    assert code == 3, out
    assert "=== install beside the fast tier: exit 3" in out and "=== second pass" not in out, out
    assert out.rstrip().splitlines()[-1] == ("tests: the install failed (exit 3): only the fast tier ran "
                                             "(1 passed, 0 failed)")
    assert (tmp_path / "ran.txt").read_text().count("\n") == 1  # the own-session run only


def test_without_the_flag_nothing_is_installed(tmp_path, monkeypatch, capsys):
    run_tiers = _run_tiers()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_one.py").write_text(PASSING)
    monkeypatch.setattr(run_tiers, "REPO", tmp_path)  # no scripts/install-deps.sh there: starting it would fail
    monkeypatch.setattr(run_tiers, "passes", lambda kind, expr: [("only pass", [run_tiers.Run(
        ["-p", "no:cacheprovider", "tests"], {}, False)])])
    code = run_tiers.main(["all"])
    out = capsys.readouterr().out
    assert code == 0 and "installing" not in out, out
