import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data" / "vllm-0.32-cpu"  # real vLLM 0.32 expositions (see its README)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
