import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data" / "vllm-0.32-cpu"  # real vLLM 0.32 expositions (see its README)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402

# the tiers' guard: a test that starts the engine, Prometheus's binaries or chromium, or runs for tens of
# seconds, needs its marker; each tier's timeout; engine tests without the engine fail with the install step
from tests.support import shared_engines, tiers  # noqa: E402
from tests.support.tiers import (  # noqa: E402,F401
    pytest_configure,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_runtest_setup,
)

_POOL = []  # the session's EnginePool, once the `engines` fixture made it


def pytest_addoption(parser):
    parser.addoption("--engine-shard", default=None, metavar="K/N|solo",
                     help="run only this shard of the engine modules (tests/support/shared_engines.py)")


def pytest_collection_modifyitems(config, items):
    tiers.pytest_collection_modifyitems(config, items)
    shared_engines.order_and_plan(config, items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    shared_engines.after_test(item, _POOL[0] if _POOL else None)


@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    """The real vLLM engines shared by the session's engine tests, one per shape: ``engines.get(blocks=...)``
    (tests/support/engine.py says how to use and extend it)."""
    from tests.support.engine import EnginePool

    pool = EnginePool(log_dir=tmp_path_factory.mktemp("vllm-pool"))
    _POOL.append(pool)
    try:
        yield pool
    finally:
        _POOL.clear()
        pool.close()
        shared_engines.record_starts(pool.starts)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Every vLLM engine this session started (shape, seconds to /health): the engine tier's main cost."""
    for k, n, work, every in shared_engines.SHARD_WORK:
        terminalreporter.write_sep("-", f"engine shard {k}/{n}: ~{work:.0f} s of work by tests/engine-seconds.json "
                                        f"(the shards: {', '.join(f'{w:.0f}' for w in every)} s)")
    engine = sys.modules.get("tests.support.engine")
    starts = getattr(engine, "START_LOG", [])
    if starts:
        ok = [s for _, s in starts if s is not None]
        terminalreporter.write_sep("-", f"vLLM engine starts: {len(starts)} ({len(starts) - len(ok)} failed), "
                                        f"{sum(ok):.0f} s to /health in all")
        for shape, seconds in starts:
            terminalreporter.write_line(f"  {shape}: " + (f"{seconds:.1f} s" if seconds is not None else "failed"))
