"""docs/architecture.md is a checked map: it names every package of the daemon and the lab and every file the
daemon keeps in its state directory, and every file (and name in it) its "question → file" table points at
exists. A package or state file added without a line there fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end > 0 else None]


def packages() -> list[str]:
    roots = [REPO / "exporter", REPO / "lab" / "kvwatt_lab"]
    return sorted(str(init.parent.relative_to(REPO)) + "/" for root in roots for init in root.rglob("__init__.py")
                  if "__pycache__" not in init.parts)


def state_files() -> list[str]:
    """The names of the files the daemon writes in its state directory: every ``STATE_FILE``/``LOCK_FILE``
    constant of the daemon's modules."""
    names = []
    for path in (REPO / "exporter").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str) \
                    and any(isinstance(t, ast.Name) and t.id in ("STATE_FILE", "LOCK_FILE") for t in node.targets):
                names.append(node.value.value)
    return sorted(names)


def test_every_package_is_on_the_map():
    found = packages()
    assert "exporter/idle/" in found and "lab/kvwatt_lab/replay/" in found  # the scan sees the packages
    the_map = section("The map")
    missing = [p for p in found if f"`{p}`" not in the_map]
    assert not missing, f"docs/architecture.md \"The map\" does not name {missing}"


def test_every_state_file_is_on_the_map():
    found = state_files()
    assert {"idle-baseline.json", "kvwatt.lock"} <= set(found)
    the_map = section("The map")
    missing = [f for f in found if f"`{f}`" not in the_map]
    assert not missing, f"docs/architecture.md \"The map\" does not name the state files {missing}"


def test_the_question_table_points_at_files_and_names_that_exist():
    rows = [line for line in section("Where to look").splitlines() if line.startswith("| ") and "?" in line]
    assert len(rows) >= 10
    for row in rows:
        answer = row.split("|")[2]
        paths = re.findall(r"`((?:exporter|lab)/[\w/]+\.py)`(?: `([\w.]+)`)?", answer)
        assert paths, f"no file in {row}"
        for path, name in paths:
            file = REPO / path
            assert file.is_file(), f"{path} (in {row!r}) does not exist"
            if name:
                defined = {n.name for n in ast.walk(ast.parse(file.read_text(encoding="utf-8")))
                           if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                assert name.split(".")[0] in defined, f"{path} defines no {name} (in {row!r})"
