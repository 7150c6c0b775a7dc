"""Write the production-shape frames of tests/support/rank_expositions.py (DP attention, pipeline stages, a
router, trtllm-serve's latency-only and JSON answers, a Dynamo frontend) as flat files under tests/data/<engine>/.
``--check`` fails when a committed frame differs from the generator.

    python tests/data/engines/shapes.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.data.engines.generate import write_or_check  # noqa: E402
from tests.support.rank_expositions import FRAMES  # noqa: E402

DATA = ROOT / "tests" / "data"


def main(argv: list[str]) -> int:
    files = {DATA / engine / name: build() for (engine, name), build in FRAMES.items()}
    return write_or_check(files, argv, "python tests/data/engines/shapes.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
