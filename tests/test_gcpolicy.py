"""exporter/runtime/gcpolicy.py FreezePolicy on the real collector: what it freezes, when, and that a frozen cycle
dropped later (the leak freezing risks) is collected by the refresh once the frozen count grows past the
plateau. Pause lengths are measured by bench/soak.py, not here."""

from __future__ import annotations

import gc
import weakref

import pytest

from exporter.runtime.gcpolicy import REFRESH_GROWTH, FreezePolicy


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture(autouse=True)
def unfrozen():
    gc.collect()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.collect()


def cycle() -> tuple[Node, weakref.ref]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


def test_freezes_what_lives_every_interval_of_tick_time():
    policy = FreezePolicy(refresh_seconds=3600.0, every_seconds=60.0)
    policy.after_tick(0.0)
    keep = [Node() for _ in range(100)]
    policy.after_tick(59.0)
    assert gc.get_freeze_count() == 0  # not a minute yet
    policy.after_tick(60.0)
    assert policy.freezes == 1
    assert all(gc.is_tracked(n) for n in keep)
    frozen = gc.get_freeze_count()
    assert frozen >= 100
    del keep
    assert gc.get_freeze_count() <= frozen - 100  # an acyclic frozen object still leaves by its count


def test_cyclic_garbage_is_collected_before_it_is_frozen():
    policy = FreezePolicy(refresh_seconds=3600.0, every_seconds=60.0)
    policy.after_tick(0.0)
    alive = cycle()[1]  # dropped at once: garbage the freeze must not keep
    policy.after_tick(60.0)
    assert alive() is None


def test_refresh_collects_a_frozen_cycle_once_the_frozen_count_grows_past_the_plateau():
    policy = FreezePolicy(refresh_seconds=600.0, every_seconds=60.0)
    policy.after_tick(0.0)
    held, leaked = cycle()
    policy.after_tick(60.0)  # frozen while alive
    del held
    gc.collect()
    assert leaked() is not None  # frozen: the collector does not see it (the leak the refresh bounds)
    policy.after_tick(600.0)  # first check: the plateau is measured, nothing refreshed
    assert policy.refreshes == 0 and leaked() is not None
    growth = [Node() for _ in range(int(gc.get_freeze_count() * REFRESH_GROWTH) + 100)]
    policy.after_tick(900.0)  # frozen with the rest, but not a span since the check yet
    assert policy.refreshes == 0
    policy.after_tick(1200.0)
    assert policy.refreshes == 1
    assert leaked() is None
    assert len(growth) > 0


def test_no_refresh_while_the_frozen_count_stays_on_its_plateau():
    policy = FreezePolicy(refresh_seconds=600.0, every_seconds=60.0)
    for t in range(0, 3600 * 3, 60):
        policy.after_tick(float(t))
    assert policy.refreshes == 0 and policy.freezes == 3600 * 3 // 60 - 1


def test_the_c_heap_is_held_to_what_it_uses_where_glibc_allows():
    """limit_malloc (called first by `kvwatt run` and its workers): on glibc both settings are accepted; a block of
    the exposition's size is then mmapped, so freeing it gives its pages back (RSS falls), which glibc's raised
    threshold did not do once such blocks had been freed (issue 39: the parent's growth). In a fresh process: a
    heap that already holds a free block that large (this one's, after other tests) serves it whatever the
    threshold."""
    import platform
    import subprocess
    import sys

    from exporter.runtime.gcpolicy import limit_malloc

    if platform.libc_ver()[0] != "glibc":
        assert limit_malloc() is False
        return
    script = """
import ctypes, os, sys
from exporter.runtime.gcpolicy import limit_malloc
if sys.argv[1] == "on":
    assert limit_malloc() is True
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
for _ in range(3):  # what raises glibc's threshold: big blocks made and freed
    p = libc.malloc(8 << 20)
    ctypes.memset(p, 1, 8 << 20)
    libc.free(p)
before = rss()
p = libc.malloc(8 << 20)
ctypes.memset(p, 1, 8 << 20)
touched = rss()
libc.free(p)
print(touched - before, touched - rss())
"""
    got = {}
    for mode in ("on", "off"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
        got[mode] = [int(x) for x in out.stdout.split()]
    grown, given_back = got["on"]
    assert grown > 7000 and given_back > 7000, got  # 8 MiB in, then given back
    assert got["off"][1] < 1000, got  # without it the freed block stays resident: what the parent's RSS showed
