"""Finds literal copies of a shared rule (exporter/rules/__init__.py) in the modules that use the rules.

A copy is a number written in the source where a rule belongs: a numeric literal assigned to, passed as, given
as the default of, keyed by or compared with a name that names a rule (its key or Config attribute, or a
suffix or prefix of either of three words or more: ``onset_per_minute`` names ``preemption_onset_per_minute``),
or a ``threshold`` name given a rule's default (``threshold_line=0.5``). The value
does not matter: a copy that agrees today (0.9) drifts tomorrow, one that disagrees (0.35) already has. Run by
``alerts/generate.py --check``, ``dashboards/generate.py --check`` and tests/test_rules.py.

A method constant (rules.METHODS: a coverage cut-off, CAPACITY_SUSTAINED, the residency levels) is copied by its
value: a number equal to it given to a name holding one of its ``words`` (``MIN_COVERAGE_RATIO = 0.9``,
``covered < 0.8 * width``; another coverage cut-off, collapse's 0.5, is its own idea). In the catalog's texts
(HELP, words) a ratio typed as a number or a percent equal to a ratio rule or method constant (``>= 0.25``,
``80 % covered``) is a copy: the text formats the entry instead (``f"{rules.X.default:g}"``), so it prints the
same and follows the rule.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from exporter import rules

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("alerts/generate.py", "dashboards/generate.py", "deploy/kubernetes/generate.py", "exporter/config/*.py",
           "exporter/tooling/readme_tables.py", "exporter/derive/*.py", "exporter/model/*.py",
           "exporter/model/pressure/*.py",
           "lab/kvwatt_lab/experiment/plan.py", "lab/kvwatt_lab/experiment/measure.py",
           "lab/kvwatt_lab/experiment/analysis.py")
TEXTS_SCANNED = ("exporter/catalog/*.py",)  # where a ratio typed in prose is a copy (HELP, words)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# a ratio in prose: "0.25" (not a version: "0.20+", "0.9.2") or a percent "80 %"
_DECIMAL = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\w+]|\.\d)")
_PERCENT = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?) ?%")


@dataclass(frozen=True)
class Copy:
    path: str
    line: int
    name: str
    value: float
    rule: str

    def __str__(self) -> str:
        if self.name.startswith("the text "):
            return (f"{self.path}:{self.line}: {self.name} is a literal copy of rule {self.rule!r} "
                    f"({self.value:g}): format rules.{_python_name(self.rule)}.default instead")
        return (f"{self.path}:{self.line}: {self.name} = {self.value!r} is a literal copy of rule {self.rule!r}: "
                f"read exporter/rules/__init__.py instead")


def _python_name(key: str) -> str:
    """The name exporter/rules/__init__.py gives the rule (or method constant) ``key``."""
    rule = rules.RULES.get(key) or rules.METHODS[key]
    return next(n for n, v in vars(rules).items() if v is rule)


def rule_named(name: str) -> str | None:
    """The key of the rule ``name`` names, or None."""
    n = name.lower().strip("_")
    for rule in rules.RULES.values():
        for k in {rule.key, rule.attribute}:
            suffix_or_prefix = n.count("_") >= 2 and (k.endswith("_" + n) or k.startswith(n + "_"))
            if n == k or ("_" in k and k in n) or suffix_or_prefix:
                return rule.key
    return None


def _threshold_copy(name: str, value: float) -> str | None:
    """A threshold (``threshold_line=0.5``) equal to a rule's default: the rule it copies."""
    if "threshold" not in name.lower():
        return None
    return next((r.key for r in rules.RULES.values() if r.default == value), None)


def _method_copy(name: str, value: float) -> str | None:
    """A method constant (rules.METHODS) ``name`` copies: its value, given to a name holding one of its words."""
    padded = "_" + name.lower().strip("_") + "_"
    return next((m.key for m in rules.METHODS.values()
                 if m.default == value and any(f"_{w}_" in padded for w in m.words)), None)


def _could_copy(key: str, value: float) -> bool:
    """A number can copy a scalar rule whatever its value; a rule whose default is a list of numbers (``windows``)
    only through one of them, so a count named like it (``windows: int = 0``) is not a copy."""
    if key not in rules.RULES:
        return True  # a method constant: matched by its value already
    default = rules.RULES[key].default
    return not isinstance(default, (list, tuple)) or value in default


def _names(node: ast.AST) -> list[str]:
    """Names a statement or expression binds its numbers to (targets, keywords, dict keys, string arguments)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return [node.slice.value]
    if isinstance(node, ast.BoolOp):  # (share or 0.0) >= 0.5: the number is compared with share
        return [n for value in node.values for n in _names(value)]
    return []


def _is_number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str):
        self.path, self.names, self.found = path, [], []

    def _with(self, names: list[str], *children: ast.AST | None) -> None:
        self.names.extend(names)
        for child in children:
            if child is not None:
                self.visit(child)
        del self.names[len(self.names) - len(names):]

    def visit_Constant(self, node: ast.Constant) -> None:
        if not _is_number(node):
            return
        for name in reversed(self.names):
            key = rule_named(name) or _threshold_copy(name, node.value) or _method_copy(name, node.value)
            if key and _could_copy(key, node.value):
                self.found.append(Copy(self.path, node.lineno, name, node.value, key))
                return

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self.visit(node.value)  # an index is not a value

    def visit_Assign(self, node: ast.Assign) -> None:
        self._with([n for t in node.targets for n in _names(t)], node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._with(_names(node.target), node.value)

    def visit_keyword(self, node: ast.keyword) -> None:
        self._with([node.arg] if node.arg else [], node.value)

    def visit_Dict(self, node: ast.Dict) -> None:
        for k, v in zip(node.keys, node.values):
            key = k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else None
            self._with([key] if key else [], v)

    def visit_Call(self, node: ast.Call) -> None:
        # data.get("kv_pressure_threshold", 0.9): a string argument names the call's other arguments
        strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                   and _IDENTIFIER.match(a.value)]
        self.visit(node.func)
        self._with(strings, *node.args, *node.keywords)

    def visit_arguments(self, node: ast.arguments) -> None:
        positional = node.posonlyargs + node.args
        for arg, default in zip(positional[len(positional) - len(node.defaults):], node.defaults):
            self._with([arg.arg], default)
        for arg, default in zip(node.kwonlyargs, node.kw_defaults):
            self._with([arg.arg], default)

    def visit_Compare(self, node: ast.Compare) -> None:
        # ``x > 0`` is a sign test, not a threshold
        numbers = [c for c in node.comparators if not (_is_number(c) and c.value == 0)]
        self._with(_names(node.left), node.left, *numbers)


def copies_in(source: str, path: str = "<source>") -> list[Copy]:
    finder = _Finder(path)
    finder.visit(ast.parse(source, path))
    return finder.found


def _ratios() -> dict[float, str]:
    """Each ratio a text may not type: the method constants' and the ratio rules' values, and whose they are."""
    out: dict[float, str] = {}
    for r in (*rules.METHODS.values(), *rules.RULES.values()):
        if r.unit == "ratio":
            out.setdefault(round(float(r.default), 9), r.key)
    return out


def text_copies_in(source: str, path: str = "<source>") -> list[Copy]:
    """Ratios typed in the source's string literals (an f-string's literal parts; what it formats is read)."""
    ratios, out = _ratios(), []
    for node in ast.walk(ast.parse(source, path)):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        found = [(m.group(0), float(m.group(1))) for m in _DECIMAL.finditer(node.value)]
        found += [(m.group(0), float(m.group(1)) / 100.0) for m in _PERCENT.finditer(node.value)]
        out += [Copy(path, node.lineno, f"the text {typed!r}", value, ratios[round(value, 9)])
                for typed, value in found if round(value, 9) in ratios]
    return out


def scanned_files(root: Path, patterns: tuple[str, ...] = SCANNED) -> list[Path]:
    return sorted({p for pattern in patterns for p in root.glob(pattern)})


def find_copies(root: Path | None = None) -> list[Copy]:
    """Every literal copy of a rule in the SCANNED modules under ``root`` (default: this checkout)."""
    root = REPO if root is None else root
    out: list[Copy] = []
    for path in scanned_files(root):
        out += copies_in(path.read_text(encoding="utf-8"), str(path.relative_to(root)))
    for path in scanned_files(root, TEXTS_SCANNED):
        out += text_copies_in(path.read_text(encoding="utf-8"), str(path.relative_to(root)))
    return out


def main() -> int:
    found = find_copies()
    for c in found:
        print(c)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
