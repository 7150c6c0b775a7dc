"""Write the sample frames of the engine expositions (tests/support/engine_expositions.py) under
tests/data/<engine>/<kind>/: NNN.prom is the engine's /metrics at NNN seconds, NNN.sidecar.prom its sidecar's
(LMCache's or Dynamo KVBM's own port). ``--check`` fails when a committed frame differs from the generator.

    python tests/data/engines/generate.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.support.engine_expositions import ENGINES, KINDS, Sequence  # noqa: E402

DATA = ROOT / "tests" / "data"
TIMES = (5, 30)  # seconds: under way, and past the stalled sequence's stall


def frames() -> dict[Path, str]:
    out = {}
    for engine in ENGINES:
        for kind in KINDS:
            seq = Sequence(engine, kind)
            for t in TIMES:
                for part, text in seq.texts(float(t)).items():
                    name = f"{t:03d}.prom" if part == "" else f"{t:03d}.{part}.prom"
                    out[DATA / engine / kind / name] = text
    return out


def write_or_check(files: dict[Path, str], argv: list[str], how: str) -> int:
    """Write each file, or with ``--check`` exit 1 naming those that differ from what the generator makes."""
    check = "--check" in argv
    stale = []
    for path, text in files.items():
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale engine frames (run {how}): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    return write_or_check(frames(), argv, "python tests/data/engines/generate.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
