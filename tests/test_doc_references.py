"""Every `docs/<file>.md "<Section>"` reference in the code and the docs names a heading that exists: a newcomer who
follows one lands on the section it promises. A reference is a Markdown file's name (with or without its
folder) followed by a quoted section name, possibly broken across a comment's lines; it resolves to a heading
of that file whose text (backticks and a leading "2." dropped) is the section or starts with it followed by
":", " (" or ",". Quoted words after a .md name that are not meant as a section are listed in NOT_SECTIONS
with why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = ["exporter", "lab/kvwatt_lab", "docs", "alerts", "dashboards", "deploy", "bench", "scripts", "tests",
           "README.md", "examples"]
REFERENCE = re.compile(r'(?P<file>[\w./-]*\b[\w-]+\.md),?\s+(?:\#\s*)?'
                       r'"(?P<section>[^"\n]+(?:\n\s*(?:\#\s*)?[^"\n]+)?)"')
NOT_SECTIONS = {
    ("alerts/README.md", "runbook_base_url"): "a configuration key that file explains, named in quotes",
}


def scanned_files() -> list[Path]:
    out = []
    for entry in SCANNED:
        path = REPO / entry
        if path.is_file():
            out.append(path)
            continue
        for f in sorted(path.rglob("*")):
            if f.suffix in (".py", ".md", ".yaml", ".yml", ".sh") and "data" not in f.relative_to(REPO).parts[1:2] \
                    and f.is_file():
                out.append(f)
    return out


def references() -> list[tuple[str, int, str, str]]:
    """(file, line, referenced file, section) for every reference in the scanned files."""
    found = []
    for path in scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in REFERENCE.finditer(text):
            section = re.sub(r"\s*\n\s*(?:#\s*)?", " ", m.group("section")).strip()
            line = text.count("\n", 0, m.start()) + 1
            found.append((str(path.relative_to(REPO)), line, m.group("file"), section))
    return found


def target_of(name: str, where: str) -> Path | None:
    """The Markdown file a reference names: as written from the repo root, else in docs/, else beside the file
    that names it."""
    name = name.lstrip("/")
    for candidate in (REPO / name, REPO / "docs" / Path(name).name, (REPO / where).parent / name):
        if candidate.is_file():
            return candidate
    return None


def headings(path: Path) -> list[str]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            out.append(re.sub(r"^\d+(\.\d+)*\.?\s+", "", m.group(1).replace("`", "")).strip())
    return out


def resolves(section: str, titles: list[str]) -> bool:
    section = section.replace("`", "")
    return any(t == section or t.startswith(tuple(section + s for s in (":", " (", ","))) for t in titles)


def test_references_are_found():
    """The scan sees the references it is meant to check (a broken pattern would pass everything)."""
    refs = {(f, s) for _, _, f, s in references()}
    assert ("docs/architecture.md", "Windows") in refs
    assert ("docs/architecture.md", "Data-parallel engines and value ranges") in refs  # across two lines
    assert len(refs) >= 20


@pytest.mark.parametrize("where, line, name, section", references(), ids=lambda v: str(v)[:40])
def test_reference_names_an_existing_section(where, line, name, section):
    if (name, section) in NOT_SECTIONS:
        return
    target = target_of(name, where)
    assert target is not None, f"{where}:{line}: {name} does not exist"
    titles = headings(target)
    assert resolves(section, titles), (f"{where}:{line}: {name} has no section \"{section}\"; its headings: "
                                       f"{titles}")
