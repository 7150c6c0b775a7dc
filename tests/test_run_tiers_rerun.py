"""scripts/run_tiers.py's rerun: a test that failed beside other work runs once more at the end, alone, and
counts as passed (named "flaky") only when it passes there; a test that fails again, or more failures than
MAX_RERUNS, fail the run. Real pytest runs over a throwaway tests/ directory (one pass of one process)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.test_engine_shards import _run_tiers

FLAKY = '''
import pathlib
def test_flaky():
    mark = pathlib.Path(__file__).with_name("ran-once-" + "{name}")
    if not mark.exists():
        mark.write_text("")
        assert False, "fails the first time only"
'''
BROKEN = "def test_broken():\n    assert 1 == 2\n"


def _run(tmp_path, monkeypatch, capsys, files: dict[str, str]) -> tuple[int, str]:
    run_tiers = _run_tiers()
    (tmp_path / "tests").mkdir()
    for name, text in files.items():
        (tmp_path / "tests" / f"{name}.py").write_text(text)
    monkeypatch.setattr(run_tiers, "REPO", tmp_path)
    monkeypatch.setattr(run_tiers, "passes", lambda kind, expr: [("one pass", [run_tiers.Run(
        ["-p", "no:cacheprovider", "tests"], {}, False)])])
    code = run_tiers.main(["all"])
    return code, capsys.readouterr().out


def test_a_test_that_fails_beside_others_and_passes_alone_is_named_and_counted_passed(tmp_path, monkeypatch,
                                                                                       capsys):
    code, out = _run(tmp_path, monkeypatch, capsys, {"test_a": FLAKY.format(name="a")})
    assert code == 0, out
    assert "flaky: tests/test_a.py::test_flaky failed beside other work and passed alone" in out
    assert out.rstrip().splitlines()[-1] == ("tests: 1 passed, 0 failed, 0 skipped (1 of them flaky: passed on "
                                            "a rerun alone)")


def test_a_test_that_fails_again_fails_the_run(tmp_path, monkeypatch, capsys):
    code, out = _run(tmp_path, monkeypatch, capsys, {"test_a": FLAKY.format(name="a"), "test_b": BROKEN})
    assert code == 1, out
    assert "rerun alone: 2 test(s)" in out and "flaky: tests/test_a.py::test_flaky" in out
    assert "flaky: tests/test_b.py" not in out
    assert out.rstrip().splitlines()[-1].startswith("tests: 1 passed, 1 failed, 0 skipped")


def test_more_failures_than_the_rerun_limit_get_no_rerun(tmp_path, monkeypatch, capsys):
    limit = _run_tiers().MAX_RERUNS
    files = {f"test_{k}": FLAKY.format(name=k) for k in range(limit + 1)}
    code, out = _run(tmp_path, monkeypatch, capsys, files)
    assert code == 1 and "rerun alone" not in out and "flaky" not in out, out
    assert out.rstrip().splitlines()[-1] == f"tests: 0 passed, {limit + 1} failed, 0 skipped"


def test_a_parametrized_failure_reruns_by_its_node_id(tmp_path):
    """The node id comes back from the junit report whole (module, class, name with its parameters)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_p.py").write_text(
        "import pytest\nclass TestC:\n    @pytest.mark.parametrize('x', [1, 2])\n"
        "    def test_x(self, x):\n        assert x == 1\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                    "tests"], cwd=tmp_path, capture_output=True)
    run_tiers = _run_tiers()
    run_tiers.REPO = tmp_path
    assert run_tiers.failed_ids(junit) == ["tests/test_p.py::TestC::test_x[2]"], json.dumps(junit.read_text())
