"""Value types are built by keyword (issue 40 item 4): no call in the daemon (exporter/) or the lab
(lab/kvwatt_lab/) passes 6 or more positional arguments to a class defined in exporter/. Twelve positional
numbers are a row nobody can read or review (which one is the SE, which the windows?); the value types are
``@dataclass(frozen=True, kw_only=True)``, so most such calls no longer run, and this scan catches the rest (a
NamedTuple, a class with its own ``__init__``, a new type). Read with ``ast``; each failure names file:line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = (ROOT / "exporter", ROOT / "lab" / "kvwatt_lab")
MAX_POSITIONAL = 5


def classes_defined(root: Path) -> frozenset[str]:
    """The names of the classes defined anywhere under ``root``."""
    return frozenset(node.name for path in root.rglob("*.py")
                     for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.ClassDef))


def positional_calls(path: Path, classes: frozenset[str], root: Path = ROOT) -> list[str]:
    """'file:line Name(n positional)' for each call in ``path`` of a class in ``classes`` (by its name, bare or
    as a module attribute) with more than MAX_POSITIONAL positional arguments written out (an unpacked ``*args``
    has no length in the source: a keyword-only type refuses it when it runs)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name not in classes:
            continue
        positional = sum(not isinstance(a, ast.Starred) for a in node.args)
        if positional > MAX_POSITIONAL:
            found.append(f"{path.relative_to(root)}:{node.lineno} {name}({positional} positional)")
    return found


def test_the_scan_sees_a_positional_call(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from exporter import figures as f\n\ndef g(a):\n    x = f.CostFigure('gpu', 1, 2, 3, 4, 5)\n"
                    "    y = CostFigure('gpu', 1, 2, 3, 4)\n    z = CostFigure(*a, 1, 2, 3, 4, 5, 6)\n"
                    "    return Other(1, 2, 3, 4, 5, 6), x, y, z\n")
    assert positional_calls(path, frozenset({"CostFigure"}), tmp_path) == [
        "m.py:4 CostFigure(6 positional)", "m.py:6 CostFigure(6 positional)"]


def test_no_production_call_passes_six_positional_arguments_to_an_exporter_class():
    classes = classes_defined(ROOT / "exporter")
    assert {"CostFigure", "PhaseCosts", "Rule", "Summed"} <= classes  # the scan sees the value types
    offending = [hit for root in PRODUCTION for path in sorted(root.rglob("*.py"))
                 for hit in positional_calls(path, classes)]
    assert not offending, (f"calls passing more than {MAX_POSITIONAL} positional arguments to a value type "
                           "(build it by keyword):\n" + "\n".join(offending))


def frozen_writes(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line in function' for each ``object.__setattr__`` call in ``path`` outside a ``__post_init__`` (where
    a frozen dataclass completes itself before anyone holds it): a figure set after it was built."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name != "__post_init__":
            found += [f"{path.relative_to(root)}:{n.lineno} in {fn.name}" for n in ast.walk(fn)
                      if isinstance(n, ast.Call) and ast.unparse(n.func) == "object.__setattr__"]
    return found


def test_the_setattr_scan_sees_a_write(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("class A:\n    def __post_init__(self):\n        object.__setattr__(self, 'x', 1)\n\n"
                    "def attach(v):\n    object.__setattr__(v, 'advice', ())\n")
    assert frozen_writes(path, tmp_path) == ["m.py:6 in attach"]


def test_no_frozen_figure_is_set_after_it_is_built():
    """A frozen figure is built whole (dataclasses.replace for a copy with more fields), never set afterwards:
    a scrape reads what the tick built (issue 40 item 10; model/advice.py attach set two fields in place)."""
    offending = [hit for root in PRODUCTION for path in sorted(root.rglob("*.py")) for hit in frozen_writes(path)]
    assert not offending, "object.__setattr__ outside __post_init__:\n" + "\n".join(offending)
