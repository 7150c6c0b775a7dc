"""Run a command at a lower priority, in its session's scheduler group too (the engine tier's shards niced their
engines, tests/support/engine.py; `kvwatt experiment` starts its engines itself, so its test's plan runs them
through this file):

    python tests/support/niced.py N COMMAND [ARG...]    # COMMAND with niceness N, the exit status its own

Standard library only: run by path, by any Python."""

from __future__ import annotations

import os
import sys
import time


def _group_niceness(niceness: int) -> None:
    # without CAP_SYS_ADMIN the kernel takes one such write per 100 ms machine-wide (EAGAIN): a few tries
    for _ in range(10):
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(niceness))
            return
        except BlockingIOError:
            time.sleep(0.11)
        except OSError:
            return  # no autogroup (disabled, or not Linux), or a raise without the privilege: the nice value is all


def come_first(niceness: int = -10) -> None:
    """The opposite, for a test double that stands in for hardware (a RAPL or NVML counter never lags): a session
    of its own (its own scheduler group, not one share among the test session's workers) at a raised priority,
    where allowed (root). Call it in a forked child, never in the test process itself."""
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader
    try:
        os.nice(niceness)
    except OSError:
        return  # not allowed to raise it: normal priority, in the session it has
    _group_niceness(niceness)


def yield_cpu(niceness: int) -> None:
    """Lower this process's priority and its session's. The scheduler shares the CPU between sessions first
    (autogroup, /proc/sys/kernel/sched_autogroup_enabled) and by nice only within one, so a niced engine in a
    session of its own (started with start_new_session, so that its group can be killed) would otherwise still
    take as much CPU as the whole test session."""
    os.nice(niceness)
    _group_niceness(niceness)


if __name__ == "__main__":
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        print("usage: niced.py N COMMAND [ARG...]", file=sys.stderr)
        sys.exit(2)
    yield_cpu(int(sys.argv[1]))
    os.execvp(sys.argv[2], sys.argv[2:])
