"""Runs pytest in passes and closes with one line for all of them (scripts/test.sh, scripts/test-fast.sh).

    python scripts/run_tiers.py all  [pytest args...]   # the fast tier, then the prom, browser and slow tiers,
                                                        # each in parallel workers, then the engine tier serially
    python scripts/run_tiers.py fast [pytest args...]   # the fast tier, in parallel workers

Why three passes: the prom, browser and slow tiers mostly wait (on kvwatt daemons, Prometheus, chromium,
real-time scenarios), so pytest-xdist workers overlap them, more workers than cores (KVWATT_WAIT_WORKERS, default
4); the fast tier has tests that time themselves against a baseline measured alongside, so it gets one worker
per core (KVWATT_TEST_WORKERS, default 2); the real vLLM engine binds a core and its tests time real loads, so
that tier runs alone, one engine at a time. A ``-m EXPR`` among the arguments narrows every pass. Every pass prints
its slowest tests (--durations, pyproject.toml); the last line, "tests: N passed, N failed, N skipped", adds the
passes up (CI reads it). Exit status: the first failing pass's, else 5 when no pass ran a test (pytest's "no
tests"), else 0. """

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAST = "not engine and not prom and not browser and not slow"
NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def split_marker(args: list[str]) -> tuple[str | None, list[str]]:
    """The user's -m expression (the last one, as pytest takes it) and the other arguments."""
    expr, rest, i = None, [], 0
    while i < len(args):
        if args[i] == "-m" and i + 1 < len(args):
            expr, i = args[i + 1], i + 2
            continue
        if args[i].startswith("-m") and len(args[i]) > 2:
            expr = args[i][2:]
        else:
            rest.append(args[i])
        i += 1
    return expr, rest


def both(a: str, b: str | None) -> str:
    return a if not b else f"({a}) and ({b})"


def parallel(workers: str) -> list[str]:
    return ["-n", workers, "--dist", "loadfile"] if workers not in ("0", "1") else []


def passes(kind: str, user_expr: str | None) -> list[tuple[str, list[str]]]:
    fast = ("fast tier", ["-m", both(FAST, user_expr), *parallel(os.environ.get("KVWATT_TEST_WORKERS", "2"))])
    if kind == "fast":
        return [fast]
    waiting = parallel(os.environ.get("KVWATT_WAIT_WORKERS", "4"))
    return [fast,
            ("prom, browser and slow tiers", ["-m", both("not engine and (prom or browser or slow)", user_expr),
                                              *waiting]),
            ("engine tier (serial)", ["-m", both("engine", user_expr)])]


def counts(junit: Path) -> dict[str, int] | None:
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return None
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in root.iter("testsuite"):
        for k in out:
            out[k] += int(suite.get(k, 0))
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("all", "fast"):
        print("usage: run_tiers.py all|fast [pytest args...]", file=sys.stderr)
        return 2
    user_expr, rest = split_marker(argv[1:])
    total = {"passed": 0, "failed": 0, "skipped": 0}
    status, ran = 0, False
    with tempfile.TemporaryDirectory(prefix="kvwatt-junit-") as tmp:
        for n, (name, args) in enumerate(passes(argv[0], user_expr)):
            junit = Path(tmp) / f"pass{n}.xml"
            print(f"\n=== {name}: pytest {' '.join(args + rest)}", flush=True)
            code = subprocess.call([sys.executable, "-m", "pytest", f"--junitxml={junit}", *args, *rest], cwd=REPO)
            got = counts(junit)
            if code == NO_TESTS:
                continue
            ran = True
            if got is None:
                total["failed"] += 1  # pytest died before writing its report: count the pass as a failure
            else:
                failed = got["failures"] + got["errors"]
                total["passed"] += got["tests"] - failed - got["skipped"]
                total["failed"] += failed
                total["skipped"] += got["skipped"]
            if code != 0 and status == 0:
                status = code
    print(f"tests: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped", flush=True)
    return status if ran or status else NO_TESTS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
