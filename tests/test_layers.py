"""The import graph of the daemon (exporter/) and the lab (lab/kvwatt_lab/), read with ``ast``: no import cycle,
and the packages depend in one direction only (docs/architecture.md). Every import counts, at module level and
inside functions (a function-level import that dodges a cycle is still the cycle), TYPE_CHECKING ones too.
Each failure names the offending import path. tests/test_layers_store.py covers derive's purity (no store, no
clock); this file covers cycles and the directions between packages."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"exporter": ROOT / "exporter", "kvwatt_lab": ROOT / "lab" / "kvwatt_lab"}
ADAPTERS = ("vllm", "sglang", "trtllm", "lmcache", "dynamo")  # exporter/sources/<name>.py
COMMAND_SIDE = ("exporter.commands", "exporter.cli", "exporter.__main__")


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=1)
def _files() -> dict[str, Path]:
    """module name -> file, for every module of both packages."""
    return {_module_name(pkg, root, path): path
            for pkg, root in PACKAGES.items() for path in sorted(root.rglob("*.py"))}


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against the importing module)."""
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports_of(module: str, path: Path) -> set[str]:
    """Every module this one imports, anywhere in it: ``from a import b`` is a.b when that is a module."""
    known = _files()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, path, node)
            subs = {f"{target}.{alias.name}" for alias in node.names} & known.keys()
            found |= subs or {target}
            if subs and len(subs) < len(node.names):
                found.add(target)
    return found


@lru_cache(maxsize=1)
def _graph() -> dict[str, frozenset[str]]:
    return {module: frozenset(_imports_of(module, path)) for module, path in _files().items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _edges(sources: str | tuple[str, ...], targets: str | tuple[str, ...]) -> list[str]:
    """'a -> b' for each import from a module under ``sources`` to one under ``targets``."""
    sources = (sources,) if isinstance(sources, str) else sources
    targets = (targets,) if isinstance(targets, str) else targets
    return sorted(f"{m} -> {t}" for m, imported in _graph().items() if any(_within(m, s) for s in sources)
                  for t in imported if any(_within(t, p) for p in targets))


def _cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The shortest cycle (a path back to its start) through each module that is on one, duplicates dropped:
    within each strongly connected component of more than one module or with a self-import (Tarjan's
    algorithm, iterative: the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(component)
    cycles: dict[frozenset[tuple[str, str]], list[str]] = {}
    for component in components:
        for start in sorted(component):
            cycle = _path_around(graph, component, start)
            cycles.setdefault(frozenset(zip(cycle, cycle[1:])), cycle)
    return list(cycles.values())


def _path_around(graph: dict[str, frozenset[str]], component: set[str], start: str) -> list[str]:
    """A shortest cycle through ``start`` (breadth-first within its component)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [start]


# --- the graph itself ---------------------------------------------------------------------------------------
def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from . import engine\nfrom ..rules import keys\n\ndef f():\n    import exporter.runtime.sampler\n"
                    "    from exporter.sources.vllm import VllmAdapter\n")
    assert _imports_of("exporter.sources.m", path) == {"exporter.sources.engine", "exporter.rules.keys",
                                                       "exporter.runtime.sampler", "exporter.sources.vllm"}
    assert _cycles({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}) \
        == [["a", "b", "c", "a"]]
    assert _cycles({"a": frozenset({"b"}), "b": frozenset({"a", "c"}), "c": frozenset({"b"})}) \
        == [["a", "b", "a"], ["c", "b", "c"]]
    assert _cycles({"a": frozenset({"a"})}) == [["a", "a"]]
    assert _cycles({"a": frozenset({"b"}), "b": frozenset()}) == []


def test_every_module_is_in_the_graph():
    assert {"exporter.sources.engine", "exporter.sources.vllm", "exporter.cli", "kvwatt_lab.replay.command"} \
        <= _graph().keys()


# --- the rules ----------------------------------------------------------------------------------------------
def test_no_import_cycle_anywhere():
    daemon = {m: frozenset(t for t in imported if t in _files()) for m, imported in _graph().items()}
    cycles = [" -> ".join(cycle) for cycle in _cycles(daemon)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_daemon_never_imports_the_lab():
    offending = _edges("exporter", "kvwatt_lab")
    assert not offending, "the daemon imports the lab:\n" + "\n".join(offending)


def test_nothing_in_the_daemon_imports_matplotlib():
    offending = _edges("exporter", ("matplotlib", "pylab"))
    assert not offending, "the daemon imports matplotlib:\n" + "\n".join(offending)


def test_engine_adapters_do_not_import_each_other():
    modules = tuple(f"exporter.sources.{name}" for name in ADAPTERS)
    offending = [edge for edge in _edges(modules, modules) if edge.split(" -> ")[0] != edge.split(" -> ")[1]]
    assert not offending, "an adapter imports another adapter:\n" + "\n".join(offending)


def test_the_seam_and_endpoint_import_no_adapter():
    """The seam (engine.py) owns the registry and the adapters register themselves into it; the HTTP read
    (endpoint.py) and the range words (ranges.py) are engine-neutral."""
    neutral = ("exporter.sources.engine", "exporter.sources.endpoint", "exporter.sources.ranges")
    offending = _edges(neutral, tuple(f"exporter.sources.{name}" for name in ADAPTERS))
    assert not offending, "an engine-neutral module imports an adapter:\n" + "\n".join(offending)


def test_derive_imports_no_source_renderer_model_or_command():
    offending = _edges("exporter.derive", ("exporter.sources", "exporter.serve", "exporter.model", *COMMAND_SIDE))
    assert not offending, "exporter.derive imports outward:\n" + "\n".join(offending)


def test_serve_imports_no_model_derivation_or_source():
    """The renderers serialise figures; they do not compute or read them."""
    offending = _edges("exporter.serve", ("exporter.model", "exporter.derive", "exporter.sources"))
    assert not offending, "exporter.serve imports what it should be handed:\n" + "\n".join(offending)


# what the catalog may not import: the computations it names (``computes`` is a dotted string) and the readers
COMPUTATIONS = ("exporter.derive", "exporter.model", "exporter.sources", "exporter.runtime.sampler", "exporter.config",
                "exporter.runtime.daemon", "exporter.idle")


def test_the_catalog_imports_no_computation():
    """The catalog names each figure's formula as a dotted string; only tests and docs tooling import it."""
    offending = _edges("exporter.catalog", COMPUTATIONS)
    assert not offending, "exporter.catalog imports a computation:\n" + "\n".join(offending)


def _loaded_by(*modules: str) -> set[str]:
    """The exporter modules a fresh interpreter has loaded after importing ``modules``."""
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('exporter.'))))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_serving_the_figures_loads_no_computation_at_runtime():
    """Importing the catalog and the renderers that walk it loads no model, source, sampler or configuration
    module, and no computation beyond what exporter.figures loads (its idle baselines' type)."""
    served = _loaded_by("exporter.catalog", "exporter.serve.collector", "exporter.serve.page")
    types_only = _loaded_by("exporter.figures")
    assert "exporter.catalog.offload" in served and "exporter.results" in types_only  # the probe works
    beyond = sorted(m for m in served - types_only if any(_within(m, p) for p in COMPUTATIONS))
    assert not beyond, "serving the figures loads computations:\n" + "\n".join(beyond)


def test_serve_loads_without_derive():
    """Every module of exporter/serve/ (with the figures and the catalog they read) loads without exporter.derive:
    the result types the figures hold live in exporter/results.py, which derive/ imports, not the reverse."""
    serve = tuple(sorted(m for m in _files() if _within(m, "exporter.serve")))
    loaded = _loaded_by(*serve)
    assert {"exporter.serve.web", "exporter.serve.webconfig", "exporter.figures"} <= loaded  # the probe works
    derive = sorted(m for m in loaded if _within(m, "exporter.derive"))
    assert not derive, "loading exporter/serve/ loads derive/:\n" + "\n".join(derive)


def _private_names_imported(module: str, path: Path) -> list[str]:
    """'module: name from other' for each private name (``_x``, not a dunder) this module takes from another
    module of either package: ``from other import _x``, or ``other._x`` on a module it imported."""
    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    tree = ast.parse(path.read_text(), str(path))
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(module, path, node)
            if not any(_within(target, p) for p in PACKAGES):
                continue
            for alias in node.names:
                if f"{target}.{alias.name}" in _files():
                    modules[alias.asname or alias.name] = f"{target}.{alias.name}"
                elif private(alias.name) and target != module:
                    found.append(f"{module}: {alias.name} from {target}")
        elif isinstance(node, ast.Import):
            modules.update({alias.asname: alias.name for alias in node.names
                            if alias.asname and any(_within(alias.name, p) for p in PACKAGES)})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name) \
                and modules.get(node.value.id, module) != module:
            found.append(f"{module}: {node.attr} from {modules[node.value.id]}")
    return found


def test_the_private_name_scan_sees_both_forms(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from exporter.config.values import _str, parse_url\nfrom exporter.sources import expfmt\n"
                    "from ._local import x\n\ndef f(t):\n    return expfmt._split(t), expfmt.parse(t), t._own\n")
    assert _private_names_imported("exporter.sources.m", path) == [
        "exporter.sources.m: _str from exporter.config.values",
        "exporter.sources.m: _split from exporter.sources.expfmt"]


def test_no_module_takes_a_private_name_from_another():
    """A name another module needs is public (a parser, a number check): ``_x`` means "only this module's".
    Tests may reach into a module to check one of its parts (the exposition's fast path, the page's blocks)."""
    offending = sorted(hit for module, path in _files().items() for hit in _private_names_imported(module, path))
    assert not offending, "private names imported across modules:\n" + "\n".join(offending)


def test_offload_profile_does_not_import_the_model():
    offending = _edges("exporter.recording", "exporter.model")
    assert not offending, "exporter.recording imports exporter.model:\n" + "\n".join(offending)


def test_library_packages_do_not_import_commands_or_the_cli():
    library = tuple(sorted({m for m in _files() if m.startswith("exporter.") and
                            not any(_within(m, c) for c in COMMAND_SIDE)}))
    offending = _edges(library, COMMAND_SIDE)
    assert not offending, "a library module imports the command side:\n" + "\n".join(offending)


# --- two products: the daemon's install pulls no lab and no matplotlib ---------------------------------------
def _project(pyproject: Path) -> dict:
    with pyproject.open("rb") as f:
        return tomllib.load(f)["project"]


def _requirement_names(project: dict) -> set[str]:
    """Distribution names of the runtime dependencies, normalised (PEP 503: case, '-', '_' and '.' alike)."""
    names = set()
    for requirement in project.get("dependencies", []):
        name = re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0]
        names.add(re.sub(r"[-_.]+", "-", name).lower())
    return names


def test_a_daemon_only_install_pulls_neither_the_lab_nor_matplotlib():
    daemon = _requirement_names(_project(ROOT / "pyproject.toml"))
    assert "prometheus-client" in daemon  # the parse found the list
    offending = daemon & {"matplotlib", "kvwatt-lab"}
    assert not offending, f"pyproject.toml [project] dependencies: {sorted(offending)}"


def test_the_lab_depends_on_the_daemon_and_matplotlib_and_declares_its_commands():
    lab = _project(ROOT / "lab" / "pyproject.toml")
    assert {"kvwatt", "matplotlib"} <= _requirement_names(lab), \
        f"lab/pyproject.toml dependencies: {lab['dependencies']}"
    commands = lab.get("entry-points", {}).get("kvwatt.commands", {})
    assert {"replay", "experiment"} <= commands.keys(), f"lab/pyproject.toml kvwatt.commands: {commands}"
    for name, module in commands.items():
        path = _files().get(module)
        assert path is not None, f"entry point {name} = {module}: no such module under lab/"
        defined = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
        assert {"add_arguments", "main"} <= defined, f"{path}: a command defines add_arguments and main"


@pytest.mark.parametrize("argv", [["replay"], ["experiment", "plan.yaml", "--out", "x"]])
def test_a_lab_command_without_the_lab_says_how_to_install_it(argv):
    """No ``kvwatt.commands`` entry points (the lab not installed): one line with the install command, exit 2."""
    code = ("import sys\nimport exporter.cli as cli\ncli.lab_modules = lambda: {}\n"
            f"sys.exit(cli.main({argv!r}))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the daemon alone: lab/ is not on the path
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and r.stdout == "", r.stdout + r.stderr
    assert f"`kvwatt {argv[0]}` is part of the kvwatt lab" in lines[0] and "pip install ./lab" in lines[0], lines
