import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data" / "vllm-0.32-cpu"  # real vLLM 0.32 expositions (see its README)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# the tiers' guard: a test that starts the engine, Prometheus's binaries or chromium needs its marker
from tests.support.tiers import (pytest_configure, pytest_runtest_makereport,  # noqa: E402,F401
                                 pytest_runtest_protocol)
