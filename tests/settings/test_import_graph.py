"""kvoffload's modules import one another without a circle (issue #29).

The graph is read from the source files, not from ``sys.modules``: every ``import`` statement
counts, at module level, inside a function or under ``if TYPE_CHECKING:``. Each one says that
the importer sits above what it names; a circle among them is a knot that works only while
every import in it happens to run in the right order, and a later move (or a lazy import that
starts running at import time) turns it into an ``ImportError`` of a half-built module.

Three rules make the graph match what Python runs:

- importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so those are edges too,
  except the packages that hold the importer, which have run before it;
- a module-level ``__getattr__`` is where a module keeps, for one release, the names that moved
  out of it (issue #29); it imports their new home when a user first names one, long after
  both modules are loaded, so its imports are not edges;
- ``importlib.import_module(name)`` is not an import statement: the registries load what a
  configuration names that way, at run time, on purpose.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

import kvoffload

Graph = Mapping[str, frozenset[str]]


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module of the package in ``package_dir``, by dotted name (a package by its own name)."""
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _import_nodes(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    shims = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
    skipped = {id(inner) for shim in shims for inner in ast.walk(shim)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
            yield node


def _named_modules(
    node: ast.Import | ast.ImportFrom, importer: str, modules: Mapping[str, Path]
) -> Iterator[str]:
    """The dotted names ``node`` imports: ``from a import b`` names ``a.b`` where that is a module."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:  # relative: the importer's package, then up one package per extra dot
        package = importer if modules[importer].name == "__init__.py" else importer.rpartition(".")[0]
        parts = package.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    else:
        base = node.module or ""
    for alias in node.names:
        yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base


def _deepest_module(name: str, modules: Mapping[str, Path]) -> str | None:
    """``name`` cut to the module that holds it: ``a.b.X`` is ``a.b``; None outside the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package_dir: Path) -> Graph:
    """Module -> the modules of the same package that importing it runs (see the module docstring)."""
    modules = module_files(package_dir)
    graph: dict[str, frozenset[str]] = {}
    for importer, path in modules.items():
        targets: set[str] = set()
        for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
            for name in _named_modules(node, importer, modules):
                module = _deepest_module(name, modules)
                if module is None:
                    continue
                parts = module.split(".")
                for depth in range(1, len(parts) + 1):
                    target = ".".join(parts[:depth])
                    if not (importer == target or importer.startswith(target + ".")):
                        targets.add(target)
        graph[importer] = frozenset(targets)
    return graph


def find_cycles(graph: Graph) -> list[list[str]]:
    """One circle per knot of ``graph`` (a strongly connected component), as the path that closes it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    knots: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; kvoffload is far too shallow to recurse deeply
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            knot: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                knot.add(member)
                if member == node:
                    break
            if len(knot) > 1 or node in graph.get(node, ()):
                knots.append(knot)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(_circle_in(graph, knot) for knot in knots)


def _circle_in(graph: Graph, knot: set[str]) -> list[str]:
    """The shortest way from the knot's first module back to itself, through the knot."""
    start = min(knot)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & knot):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(knot)} is not strongly connected")


def _circles_text(circles: list[list[str]]) -> str:
    return "; ".join(" -> ".join(circle) for circle in circles)


KVOFFLOAD = Path(kvoffload.__file__).parent


def test_kvoffload_has_no_import_circle() -> None:
    circles = find_cycles(import_graph(KVOFFLOAD))
    assert not circles, f"import circles in kvoffload: {_circles_text(circles)}"


def test_the_vllm_config_module_imports_only_the_standard_library() -> None:
    # As vLLM's own config.py: every layer can name the dataclasses without importing a registry.
    tree = ast.parse((KVOFFLOAD / "config.py").read_text())
    names = {
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in _import_nodes(tree)
        for alias in node.names
    }
    outside = sorted(n for n in names if n.split(".")[0] not in sys.stdlib_module_names | {"__future__"})
    assert outside == []


def test_settings_sits_above_the_registries_it_checks_names_against() -> None:
    graph = import_graph(KVOFFLOAD)
    assert {"kvoffload.config", "kvoffload.cpu.policies", "kvoffload.tiering.factory"} <= graph[
        "kvoffload.settings"
    ]
    assert "kvoffload.settings" not in graph["kvoffload.config"]


# ------------------------------------------------------------------ the graph itself, on toy packages


def write_package(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = root / "toy" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for directory in [root / "toy", *(root / "toy").rglob("*")]:
        if directory.is_dir() and not (directory / "__init__.py").exists():
            (directory / "__init__.py").write_text("")
    return root / "toy"


def circles_of(tmp_path: Path, files: Mapping[str, str]) -> str:
    return _circles_text(find_cycles(import_graph(write_package(tmp_path, files))))


@pytest.mark.parametrize(
    "b_source",
    [
        "import toy.a\n",
        "from toy import a\n",
        "from toy.a import VALUE\n",
        "from . import a\n",
        "from .a import VALUE\n",
        "def late():\n    from toy.a import VALUE\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy.a import VALUE\n",
    ],
    ids=[
        "import",
        "from-package",
        "from-module",
        "relative",
        "relative-from",
        "in-function",
        "type-checking",
    ],
)
def test_every_form_of_import_closes_a_circle(tmp_path: Path, b_source: str) -> None:
    files = {"a.py": "from toy.b import OTHER\nVALUE = 1\n", "b.py": b_source + "OTHER = 2\n"}
    assert circles_of(tmp_path, files) == "toy.a -> toy.b -> toy.a"


def test_a_circle_through_a_package_init_is_named(tmp_path: Path) -> None:
    # Importing toy.sub.x runs toy/sub/__init__.py first, and that imports toy.a.
    files = {"a.py": "from toy.sub.x import X\n", "sub/__init__.py": "import toy.a\n", "sub/x.py": "X = 1\n"}
    assert circles_of(tmp_path, files) == "toy.a -> toy.sub -> toy.a"


def test_a_module_importing_from_its_own_package_is_no_circle(tmp_path: Path) -> None:
    # The package's __init__ has run before any module in it, so naming it is no edge.
    files = {
        "sub/__init__.py": "from toy.sub.x import X\n",
        "sub/x.py": "from toy.sub import SHARED\nX = 1\n",
    }
    assert circles_of(tmp_path, files) == ""


def test_a_module_getattr_shim_is_not_an_edge(tmp_path: Path) -> None:
    files = {
        "old.py": "def __getattr__(name):\n    from toy import new\n    return getattr(new, name)\n",
        "new.py": "import toy.old\nMOVED = 1\n",
    }
    assert circles_of(tmp_path, files) == ""


def test_a_longer_circle_is_named_in_import_order(tmp_path: Path) -> None:
    files = {
        "a.py": "import toy.b\n",
        "b.py": "import toy.c\n",
        "c.py": "import toy.a\n",
        "d.py": "import toy.a\n",
    }
    assert circles_of(tmp_path, files) == "toy.a -> toy.b -> toy.c -> toy.a"
