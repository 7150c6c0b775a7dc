"""Layers (docs/architecture.md "Windows"): sources -> samples -> store -> derive -> figures, one way.

Read with ``ast`` from the source files, so the check holds for every module, imported or not:
- no module under exporter/derive imports from exporter.store anything but types (classes), nor the store
  as a module; derive is pure: it opens no file and imports neither os, pathlib nor aiohttp;
- no module under exporter/store imports exporter.derive.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "exporter"
DERIVE = sorted((ROOT / "derive").glob("*.py"))
STORE = sorted((ROOT / "store").glob("*.py"))
IMPURE_MODULES = ("os", "pathlib", "aiohttp")


def imports(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names imported from it; () for ``import module``) for every import in the file, nested ones
    included (a function-level import counts as much as a top-level one)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package of the file
                pkg = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-node.level])
                module = f"{pkg}.{node.module}" if node.module else pkg
            else:
                module = node.module or ""
            out.append((module, tuple(a.name for a in node.names)))
    return out


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def store_names_that_are_not_types(module: str, names: tuple[str, ...]) -> list[str]:
    """The names imported from the store that are not classes (a submodule, a function, a constant)."""
    if not names:
        return [module]  # `import exporter.store...`: the store as a module, not a type
    owner = importlib.import_module(module)
    return [n for n in names if not inspect.isclass(getattr(owner, n, None))]


def opens_files(path: Path) -> list[str]:
    """Calls that read or write files: open(...), io.open, X.read_text/write_text/open, read_json/read_yaml."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in ("open", "read_text", "write_text", "read_bytes", "write_bytes", "read_json", "read_yaml"):
            found.append(f"line {node.lineno}: {name}()")
    return found


@pytest.mark.parametrize("path", DERIVE, ids=lambda p: p.name)
def test_derive_imports_only_types_from_the_store(path):
    bad = [f"{m}.{n}" for m, names in imports(path) if within(m, "exporter.store")
           for n in store_names_that_are_not_types(m, names)]
    assert not bad, f"{path.name} imports store internals other than types: {bad}"


@pytest.mark.parametrize("path", DERIVE, ids=lambda p: p.name)
def test_derive_is_pure(path):
    impure = [m for m, _ in imports(path) if any(within(m, x) for x in IMPURE_MODULES)]
    assert not impure, f"{path.name} imports {impure}: derive does no I/O"
    assert not opens_files(path), f"{path.name} reads or writes files: {opens_files(path)}"


@pytest.mark.parametrize("path", STORE, ids=lambda p: p.name)
def test_store_never_imports_derive(path):
    bad = [m for m, _ in imports(path) if within(m, "exporter.derive")]
    assert not bad, f"{path.name} imports {bad}: the store sits below derive"


def test_the_checks_see_what_they_forbid(tmp_path):
    """The checks would fail on the layering this replaced: derive importing a store helper and reading a
    config file, the store importing derive's aggregate."""
    derive = tmp_path / "exporter" / "derive" / "k.py"
    derive.parent.mkdir(parents=True)
    derive.write_text("import os\nfrom exporter.store import aggregate_of, WindowAggregate\n"
                      "from exporter.config import read_json\n\ndef f(p):\n    return read_json(p), open(p)\n")
    found = imports(derive)
    assert ("os", ()) in found
    assert store_names_that_are_not_types("exporter.store", ("aggregate_of", "WindowAggregate")) == ["aggregate_of"]
    assert store_names_that_are_not_types("exporter.store.buckets", ()) == ["exporter.store.buckets"]
    assert opens_files(derive) == ["line 6: read_json()", "line 6: open()"]
    store = tmp_path / "exporter" / "store" / "history.py"
    store.parent.mkdir(parents=True)
    store.write_text("from exporter.derive.window import WindowAggregate\n")
    assert any(within(m, "exporter.derive") for m, _ in imports(store))


def test_every_layer_has_modules():
    assert len(DERIVE) >= 8 and {p.name for p in STORE} >= {"__init__.py", "aggregate.py", "buckets.py",
                                                              "history.py"}
