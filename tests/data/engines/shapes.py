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

from tests.support.rank_expositions import FRAMES  # noqa: E402

DATA = ROOT / "tests" / "data"


def main(argv: list[str]) -> int:
    stale = []
    for (engine, name), build in FRAMES.items():
        path, text = DATA / engine / name, build()
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
    if stale:
        print("stale frames (run tests/data/engines/shapes.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
