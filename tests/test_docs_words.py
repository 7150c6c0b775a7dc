"""Docs stay true: no engine "being added" (they are all read), and every repository path a doc names in
backticks or a link exists (a moved module leaves no stale pointer behind)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = ("exporter", "lab", "tests", "docs", "alerts", "dashboards", "deploy", "scripts", "bench", "examples")
PATH = re.compile(r"`((?:%s)/[A-Za-z0-9_./-]+)`|\]\(((?:\.\./)*(?:%s)/[A-Za-z0-9_./-]+)(?:#[^)]*)?\)"
                  % ("|".join(TOP), "|".join(TOP)))
GENERATED = {"results", "runs"}  # directories a command writes (results/..., runs/...), not committed


def docs() -> list[Path]:
    found = [p for p in REPO.rglob("*.md") if not any(part.startswith(".") or part in {"node_modules"}
                                                     for part in p.relative_to(REPO).parts)]
    return [p for p in found if "egg-info" not in str(p) and "/tests/data/" not in str(p)]


def named_paths(doc: Path) -> list[str]:
    return [a or b for a, b in PATH.findall(doc.read_text(encoding="utf-8"))]


def exists(doc: Path, path: str) -> bool:
    path = path.rstrip("/.")
    if any(ch in path for ch in "*{}<>") or path.split("/")[0] in GENERATED:
        return True  # a pattern or a placeholder, not a path
    return (REPO / path).exists() or (doc.parent / path).exists()


def test_no_doc_names_an_engine_as_being_added():
    stale = [f"{d.relative_to(REPO)}: {line.strip()}" for d in docs()
             for line in d.read_text(encoding="utf-8").splitlines() if re.search(r"being\s+added", line, re.I)]
    assert not stale, stale


def test_every_path_a_doc_names_exists():
    missing = [f"{d.relative_to(REPO)}: {p}" for d in docs() for p in named_paths(d) if not exists(d, p)]
    assert not missing, "\n".join(missing)


def test_the_check_sees_a_stale_path(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("see `exporter/vllm_source.py` and [x](docs/nowhere.md#a) and `exporter/rules/__init__.py`")
    assert [p for p in named_paths(doc) if not exists(doc, p)] == ["exporter/vllm_source.py", "docs/nowhere.md"]
