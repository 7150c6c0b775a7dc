"""Run a command at a lower priority, in its session's scheduler group too (the engine tier's shards niced their
engines, tests/support/engine.py; `kvwatt experiment` starts its engines itself, so its test's plan runs them
through this file):

    python tests/support/niced.py N COMMAND [ARG...]    # COMMAND with niceness N, the exit status its own

Standard library only: run by path, by any Python."""

from __future__ import annotations

import os
import sys


def yield_cpu(niceness: int) -> None:
    """Lower this process's priority and its session's. The scheduler shares the CPU between sessions first
    (autogroup, /proc/sys/kernel/sched_autogroup_enabled) and by nice only within one, so a niced engine in a
    session of its own (started with start_new_session, so that its group can be killed) would otherwise still
    take as much CPU as the whole test session."""
    os.nice(niceness)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(niceness))
    except OSError:
        pass  # no autogroup (disabled, or not Linux): the process's nice value is all there is


if __name__ == "__main__":
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        print("usage: niced.py N COMMAND [ARG...]", file=sys.stderr)
        sys.exit(2)
    yield_cpu(int(sys.argv[1]))
    os.execvp(sys.argv[2], sys.argv[2:])
