"""Runs pytest in passes and closes with one line for all of them (scripts/test.sh, scripts/test-fast.sh).

    python scripts/run_tiers.py all  [pytest args...]   # the fast tier and the prom, browser and slow tiers
                                                        # side by side, in parallel workers, then the engine tier
    python scripts/run_tiers.py fast [pytest args...]   # the fast tier, in parallel workers
    python scripts/run_tiers.py all --store-engine-seconds   # also rewrites tests/engine-seconds.json
    python scripts/run_tiers.py all --install-rest   # installs the Debian packages and vLLM beside the fast tier

Why these passes: the prom, browser and slow tiers mostly wait (on kvwatt daemons, Prometheus, chromium,
real-time scenarios), so pytest-xdist workers overlap them, more workers than cores (KVWATT_WAIT_WORKERS, default
4); the fast tier is mostly CPU with some waiting on subprocesses and loopback HTTP, and has tests that time
themselves against a baseline measured alongside, so it gets one worker more than cores (KVWATT_TEST_WORKERS,
default cores + 1; on 2 cores: 2 workers 226-229 s, 3 workers 177 s, 4 workers 163 s, all passing). The two run
side by side (the waiting tiers used 30-70 % of two cores alone), the fast tier in a session of its own
(FAST_SESSION): 311-357 s for both instead of 234 + 273 s one after the other (CI-like runs here). The engine tier's
tests wait on real-time loads with one engine
computing on one core, so it runs as KVWATT_ENGINE_SHARDS (default: one per core) pytest processes side by
side, each shard's engines bound to its own core (VLLM_CPU_OMP_THREADS_BIND) and niced (KVWATT_ENGINE_NICENESS=10:
the tests' watchers and doubles come first), each shard a fixed set of whole modules (tests/support/
shared_engines.py deals them by their measured seconds, tests/engine-seconds.json); then the modules that start
engines on both cores (marker owns_cores) alone. A shard's output is printed whole when it ends. A ``-m EXPR``
among the arguments narrows every pass. Every pass prints its slowest tests (--durations, pyproject.toml).

A test that failed beside other work (up to MAX_RERUNS of them, and only when pytest said "tests failed", not
an internal error) runs once more at the end, alone on both cores: each real-time scenario here shares two
cores with three others or an engine, and a late thread there is a late window, not a broken feature. One that
passes alone is named on a "flaky:" line and counted as passed; one that fails again is a failure. More failures
than MAX_RERUNS get no rerun: the change broke something.

The last line, "tests: N passed, N failed, N skipped", adds the passes up (CI reads it). Exit status: 0 when
every failure passed alone, else the first failing pass's, else 5 when no pass ran a test (pytest's "no
tests"), else 0. """

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
FAST = "not engine and not prom and not browser and not slow"
NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
# more failures than this in one run: the change broke something; no rerun (each costs up to minutes)
MAX_RERUNS = 4


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


class Run(NamedTuple):
    """One pytest process of a pass."""

    args: list[str]
    env: dict[str, str]  # environment additions
    engine: bool  # the engine tier's tests (their seconds are stored, tests/engine-seconds.json)
    own_session: bool = False  # started in a session of its own (its own scheduler group; FAST_SESSION)
    after_install: bool = False  # started once scripts/install-deps.sh's other steps are done (--install-rest)


# The fast tier beside the waiting tiers: it is CPU, they mostly wait (30-70 % of two cores, measured). In a session
# of its own, so that the scheduler (autogroup: the CPU shared between sessions first, then by nice within one) gives
# it one session's share beside each scenario's daemons, Prometheus and chromium, not a share of the test workers'
# own session. Not niced: at niceness 10 that share fell to ~10 % of one beside several busy sessions, and its own
# timing tests starved (an NVML read missed a 0.5 s deadline, an integrated power read 1.4 % high; CI-like run).
FAST_SESSION = True


def passes(kind: str, user_expr: str | None) -> list[tuple[str, list[Run]]]:
    """Each pass: its name and its pytest processes (more than one: side by side)."""
    cores = os.cpu_count() or 1
    workers = os.environ.get("KVWATT_TEST_WORKERS", str(cores + 1))
    fast = ["-m", both(FAST, user_expr), *parallel(workers)]
    if kind == "fast":
        return [("fast tier", [Run(fast, {}, False)])]
    waiting = Run(["-m", both("not engine and (prom or browser or slow)", user_expr),
                   *parallel(os.environ.get("KVWATT_WAIT_WORKERS", "4"))], {}, False, after_install=True)
    first = ("fast tier, and the prom, browser and slow tiers beside it", [Run(fast, {}, False, FAST_SESSION),
                                                                          waiting])
    engine = ["-m", both("engine", user_expr)]
    shards = int(os.environ.get("KVWATT_ENGINE_SHARDS", str(cores)))
    if shards <= 1:
        return [first, ("engine tier (serial)", [Run(engine, {}, True)])]
    sharded = [Run([*engine, "--engine-shard", f"{k}/{shards}"],
                   {"VLLM_CPU_OMP_THREADS_BIND": str(k % cores), "KVWATT_ENGINE_NICENESS": "10"}, True)
               for k in range(shards)]
    solo = ("engine tier (the modules that own both cores, alone)",
            [Run([*engine, "--engine-shard", "solo"], {}, True)])
    # not beside the shards: the waiting tiers' real-time scenarios failed there (a collapse signature that
    # flapped, a J/token 10 % off), the cores being full with both shards' engines, daemons and loads
    return [first, (f"engine tier ({shards} shards side by side, one core each)", sharded), solo]


class InstallBeside:
    """scripts/install-deps.sh's Debian and vLLM steps, started before the fast tier (which needs neither) and
    waited for before a run that needs them: on a fresh machine they are a minute or more of one core unpacking."""

    def __init__(self, tmp: Path):
        self.log = tmp / "install.log"
        self.started = time.monotonic()
        self.code: int | None = None
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([str(REPO / "scripts" / "install-deps.sh"), "debian", "vllm"], cwd=REPO,
                                         stdout=out, stderr=subprocess.STDOUT)
        print("=== installing the Debian packages and vLLM beside the fast tier (scripts/install-deps.sh debian vllm)",
              flush=True)

    def wait(self) -> int:
        """Its exit status, its output printed the first time."""
        if self.code is None:
            self.code = self.proc.wait()
            sys.stdout.buffer.write(self.log.read_bytes())
            print(f"=== install beside the fast tier: exit {self.code}, {time.monotonic() - self.started:.0f} s",
                  flush=True)
        return self.code


def _start(run: Run, argv: list[str], out) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, env={**os.environ, **run.env}, stdout=out,
                            stderr=subprocess.STDOUT if out else None, start_new_session=run.own_session)


def run_pass(runs: list[Run], rest: list[str], tmp: Path, n: int,
             install: InstallBeside | None = None) -> list[tuple[int | None, Path]]:
    """Run the pass's pytest processes (side by side when several; their output printed whole, in turn, when
    all ended); (exit status, junit path) of each, the status None for a run not started because the install
    failed."""
    procs = []
    try:
        for i, run in enumerate(runs):
            junit = tmp / f"pass{n}-{i}.xml"
            if run.after_install and install is not None and install.wait() != 0:
                procs.append((None, junit, None))
                continue
            argv = [sys.executable, "-m", "pytest", f"--junitxml={junit}", *run.args, *rest]
            if len(runs) > 1:
                print(f"--- started: pytest {' '.join(run.args + rest)}"
                      + "".join(f" {k}={v}" for k, v in run.env.items())
                      + (" (a session of its own)" if run.own_session else ""),
                      flush=True)
            out = open(tmp / f"pass{n}-{i}.log", "wb") if len(runs) > 1 else None
            procs.append((_start(run, argv, out), junit, out))
        results = []
        for i, (proc, junit, out) in enumerate(procs):
            code = None if proc is None else proc.wait()
            if out is not None:
                out.close()
                print(f"\n--- pytest {' '.join(runs[i].args + rest)} (exit {code}):", flush=True)
                sys.stdout.buffer.write((tmp / f"pass{n}-{i}.log").read_bytes())
                sys.stdout.flush()
            results.append((code, junit))
        return results
    except BaseException:  # interrupted: a run in a session of its own would not see the terminal's ^C
        for proc, _, _ in procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        raise


def _cases(junit: Path) -> list[ET.Element]:
    try:
        return list(ET.parse(junit).getroot().iter("testcase"))
    except (OSError, ET.ParseError):
        return []


def _module_of(classname: str) -> tuple[str | None, list[str]]:
    """A junit classname's test module (a path under the repository) and the classes after it."""
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        path = "/".join(parts[:k]) + ".py"
        if (REPO / path).is_file():
            return path, parts[k:]
    return None, []


def module_seconds(junits: list[Path]) -> dict[str, float]:
    """Seconds per test module (setup, call and teardown of its tests) in these junit reports."""
    out: dict[str, float] = {}
    for case in (c for junit in junits for c in _cases(junit)):
        module, _ = _module_of(case.get("classname", ""))
        if module:
            out[module] = out.get(module, 0.0) + float(case.get("time", 0))
    return out


def _node_id(case: ET.Element) -> str | None:
    module, classes = _module_of(case.get("classname", ""))
    return "::".join([module, *classes, case.get("name", "")]) if module else None


def failed_ids(junit: Path) -> list[str]:
    """The pytest node ids of the tests that failed or errored (setup and teardown included) in this report."""
    out = []
    for case in _cases(junit):
        node = _node_id(case)
        if node and node not in out and (case.find("failure") is not None or case.find("error") is not None):
            out.append(node)
    return out


def store_engine_seconds(junits: list[Path], starts_file: Path) -> None:
    """tests/engine-seconds.json from this run: each module's seconds less the shared engines it started, each
    shape's start (tests/support/shared_engines.py deals the shards by them); entries this run lacks are kept."""
    path = REPO / "tests" / "engine-seconds.json"
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    modules, shapes = module_seconds(junits), {}
    lines = starts_file.read_text().splitlines() if starts_file.exists() else []
    for start in map(json.loads, lines):
        modules[start["module"]] = modules.get(start["module"], 0.0) - start["seconds"]
        shapes.setdefault(start["shape"], []).append(start["seconds"])
    stored = {"modules": {**stored.get("modules", {}), **{m: round(max(s, 0.0), 1) for m, s in modules.items()}},
              "starts": {**stored.get("starts", {}), **{k: round(sum(v) / len(v), 1) for k, v in shapes.items()}}}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({k: dict(sorted(v.items())) for k, v in stored.items()}, indent=1) + "\n")
    os.replace(tmp, path)
    print(f"stored the engine modules' seconds and the shapes' starts in {path.relative_to(REPO)}", flush=True)


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


def rerun_alone(failed: list[str], rest: list[str], tmp: Path) -> list[str]:
    """Runs the tests that failed beside other work again, alone (one pytest process, both cores, engines not
    niced); the node ids that passed this time."""
    print(f"\n=== rerun alone: {len(failed)} test(s) failed beside other work: pytest {' '.join(failed)}",
          flush=True)
    started = time.monotonic()
    junit = tmp / "rerun.xml"
    subprocess.run([sys.executable, "-m", "pytest", f"--junitxml={junit}", *failed, *rest], cwd=REPO)
    print(f"=== rerun alone: {time.monotonic() - started:.0f} s", flush=True)
    ran = {_node_id(c) for c in _cases(junit)}
    still = set(failed_ids(junit))
    return [t for t in failed if t in ran and t not in still]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("all", "fast"):
        print("usage: run_tiers.py all|fast [--install-rest] [--store-engine-seconds] [pytest args...]",
              file=sys.stderr)
        return 2
    flags = ("--store-engine-seconds", "--install-rest")
    store, install_rest = (f in argv[1:] for f in flags)
    user_expr, rest = split_marker([a for a in argv[1:] if a not in flags])
    total = {"passed": 0, "failed": 0, "skipped": 0}
    status, ran, engine_junits, failed, unexplained = 0, False, [], [], False
    with tempfile.TemporaryDirectory(prefix="kvwatt-junit-") as tmp:
        starts_file = Path(tmp) / "engine-starts.jsonl"  # every shared-engine start (tests/conftest.py)
        os.environ["KVWATT_ENGINE_STARTS_FILE"] = str(starts_file)
        install = InstallBeside(Path(tmp)) if install_rest and argv[0] == "all" else None
        for n, (name, runs) in enumerate(passes(argv[0], user_expr)):
            if n > 0 and install is not None and install.wait() != 0:
                break  # said below
            print(f"\n=== {name}" + (f": pytest {' '.join(runs[0].args + rest)}" if len(runs) == 1 else ""),
                  flush=True)
            started = time.monotonic()
            for (code, junit), run in zip(run_pass(runs, rest, Path(tmp), n, install), runs):
                if run.engine:
                    engine_junits.append(junit)
                got = counts(junit)
                if code is None or code == NO_TESTS:  # None: not started, the install failed
                    continue
                ran = True
                if got is None:
                    total["failed"] += 1  # pytest died before writing its report: count the run as a failure
                else:
                    failed_here = got["failures"] + got["errors"]
                    total["passed"] += got["tests"] - failed_here - got["skipped"]
                    total["failed"] += failed_here
                    total["skipped"] += got["skipped"]
                    failed += failed_ids(junit)
                # pytest's 1 is "some tests failed"; any other status (internal error, interrupted) is not a flake
                unexplained |= code != 0 and (code != 1 or got is None)
                if code != 0 and status == 0:
                    status = code
            print(f"=== {name}: {time.monotonic() - started:.0f} s", flush=True)
        if install is not None and install.wait() != 0:
            print(f"tests: the install failed (exit {install.code}): only the fast tier ran ({total['passed']} "
                  f"passed, {total['failed']} failed)", flush=True)
            return install.code
        if store:
            store_engine_seconds(engine_junits, starts_file)
        flaky = []
        if argv[0] == "all" and failed and len(failed) <= MAX_RERUNS and not unexplained:
            flaky = rerun_alone(failed, rest, Path(tmp))
    for test in flaky:
        print(f"flaky: {test} failed beside other work and passed alone", flush=True)
    total["failed"] -= len(flaky)
    total["passed"] += len(flaky)
    if flaky and len(flaky) == len(failed) and not unexplained:
        status = 0
    print(f"tests: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped"
          + (f" ({len(flaky)} of them flaky: passed on a rerun alone)" if flaky else ""), flush=True)
    return status if ran or status else NO_TESTS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
