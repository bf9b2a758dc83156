"""The import graph is a DAG of layers, and no import inside a function hides a cycle.

The whole package is walked: every ``import microscale...`` / ``from microscale... import``,
at module level, inside a function or under ``if TYPE_CHECKING:`` (never run, but a
dependency all the same: a circle that only type checking closes is still a circle, e.g.
experiments/compare.py <-> report.py through ``CompareConfig``). Four rules:

1. **Layers.** Each subpackage (and top-level module) has a layer (`LAYERS`, low to high:
   formats -> ops -> model -> outputs -> export -> ptq -> train ->
   experiments/plan/inference/workflows -> cli); an import may only reach the same layer
   or a lower one.
2. **No cycle between subpackages**, counting function-level imports: importing any module
   of a subpackage runs that subpackage's ``__init__``, so a cycle of subpackages is a
   cycle of modules.
3. **No cycle between the modules of a subpackage**, counting function-level imports. With
   the graph acyclic, an import inside a function can be moved to the top without creating
   a cycle, so none is there to dodge one; those left are lazy loads (e.g. the CLI's, to
   start fast).
4. **No import inside a function dodges a cycle**, said directly: for each function-level
   import ``a -> b``, nothing that ``b`` imports (at any depth, counting that importing
   ``pkg.mod`` from outside ``pkg`` runs ``pkg``'s ``__init__``) reaches ``a``, so the
   import could move to the top of ``a`` without creating a cycle.
"""

from __future__ import annotations

import ast
import copy
import functools
from collections import defaultdict
from pathlib import Path

import pytest

import microscale

ROOT = Path(microscale.__file__).parent

# Layer of each subpackage / top-level module, lowest first. "microscale" is the package's
# own __init__ (it re-exports formats and ops), "__main__" the ``python -m`` entry point.
LAYERS: list[set[str]] = [
    {"files", "integrity", "fingerprint", "colors", "progress"},
    {"config", "data", "formats"},
    {"ops"},
    {"microscale", "model"},
    {"outputs"},  # the output folders' owners: file names, detection, what verify checks
    {"export"},
    {"ptq"},  # writes its outputs through export
    {"train"},  # train/adaptive.py and train/precision.py are clients of ptq
    {"experiments", "plan", "inference", "verify", "workflows"},
    {"cli", "__main__"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


@functools.cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_edges(modules: dict[str, Path]) -> dict[str, dict[str, tuple[int, bool]]]:
    """{module: {imported module: (line, inside a function)}} over the microscale modules.
    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
    ``pkg``."""
    return copy.deepcopy(_import_edges(tuple(modules.items())))


@functools.cache
def _import_edges(items: tuple[tuple[str, Path], ...]) -> dict[str, dict[str, tuple[int, bool]]]:
    modules = dict(items)
    edges: dict[str, dict[str, tuple[int, bool]]] = defaultdict(dict)
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        in_function = {
            id(n)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for n in ast.walk(fn)
        }
        for node in ast.walk(tree):
            targets: list[str] = []
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module
                and (node.module == "microscale" or node.module.startswith("microscale."))
            ):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.append(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets = [
                    a.name
                    for a in node.names
                    if a.name == "microscale" or a.name.startswith("microscale.")
                ]
            for target in targets:
                if target != mod and target in modules:
                    edges[mod].setdefault(target, (node.lineno, id(node) in in_function))
    return edges


def unit(module: str) -> str:
    """The subpackage or top-level module ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "microscale"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_unit_has_a_layer():
    units = {unit(m) for m in _modules()}
    assert units - set(RANK) == set(), f"give these a layer in LAYERS: {units - set(RANK)}"


def test_imports_go_down_the_layers():
    found = []
    for src, targets in import_edges(_modules()).items():
        for dst, (line, _) in targets.items():
            a, b = unit(src), unit(dst)
            if a in RANK and b in RANK and RANK[a] < RANK[b]:
                found.append(
                    f"{src}:{line} imports {dst} ({a}, layer {RANK[a]}, may not "
                    f"import {b}, layer {RANK[b]})"
                )
    assert found == [], "\n".join(found)


def test_no_cycle_between_subpackages():
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for src, targets in import_edges(_modules()).items():
        for dst, (line, fn) in targets.items():
            a, b = unit(src), unit(dst)
            if a != b:
                graph[a].add(b)
                where.setdefault((a, b), f"{src}:{line} -> {dst}{' (in a function)' if fn else ''}")
    found = [
        (comp, [where[(a, b)] for a in comp for b in comp if (a, b) in where])
        for comp in cycles(graph)
    ]
    assert found == [], found


def test_no_cycle_between_the_modules_of_a_subpackage():
    graph: dict[str, set[str]] = defaultdict(set)
    edges = import_edges(_modules())
    for src, targets in edges.items():
        for dst in targets:
            if unit(src) == unit(dst):
                graph[src].add(dst)
    found = [
        (
            comp,
            [
                f"{a}:{edges[a][b][0]} -> {b}{' (in a function)' if edges[a][b][1] else ''}"
                for a in comp
                for b in comp
                if b in edges.get(a, {})
            ],
        )
        for comp in cycles(graph)
    ]
    assert found == [], found


def test_the_walk_sees_function_level_imports():
    """The walk is not vacuous: it finds this file's kind of import inside a function."""
    edges = import_edges(_modules())
    assert any(fn for targets in edges.values() for _, fn in targets.values())
    assert edges["microscale.cli.train"]  # the CLI's lazy imports are edges too
    # and so are the imports under ``if TYPE_CHECKING:``
    assert "microscale.ptq.engine" in edges["microscale.ptq.weights"]


@pytest.mark.parametrize("package", ["model", "ops", "formats", "experiments"])
def test_no_function_level_imports_within_the_package(package):
    """Stricter where it already holds: these packages import their own modules only at the
    top (model/layers.py <-> model/rules.py and experiments/compare.py <-> report.py were
    cycles hidden that way)."""
    found = [
        f"{src}:{line} -> {dst}"
        for src, targets in import_edges(_modules()).items()
        if src.startswith(f"microscale.{package}.")
        for dst, (line, fn) in targets.items()
        if fn and dst.startswith(f"microscale.{package}")
    ]
    assert found == [], found


def _module_graph(edges: dict[str, dict[str, tuple[int, bool]]]) -> dict[str, set[str]]:
    """Every import edge ``a -> b``, plus ``a -> P`` for each package ``P`` holding ``b`` but
    not ``a``: importing ``b`` from outside ``P`` runs ``P``'s ``__init__`` first (from
    inside, that ``__init__`` is already running)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for src, targets in edges.items():
        for dst in targets:
            graph[src].add(dst)
            parts = dst.split(".")
            for i in range(1, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg in _modules() and not src.startswith(pkg + "."):
                    graph[src].add(pkg)
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path ``start -> ... -> goal`` in ``graph`` (breadth first), or None."""
    before: dict[str, str | None] = {start: None}
    queue = [start]
    for node in queue:
        if node == goal:
            path = [node]
            while (prev := before[path[-1]]) is not None:
                path.append(prev)
            return path[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in before:
                before[nxt] = node
                queue.append(nxt)
    return None


def test_no_function_level_import_dodges_a_cycle():
    """Each import inside a function could move to the module's top: what it imports never
    leads back to the importing module (the train.init <-> train.loop, ptq.run -> train and
    ptq.run -> train.init edges once did)."""
    edges = import_edges(_modules())
    graph = _module_graph(edges)
    found = []
    for src, targets in edges.items():
        for dst, (line, fn) in targets.items():
            if fn and (back := _reaches(graph, dst, src)) is not None:
                found.append(
                    f"{src}:{line} imports {dst} inside a function; "
                    f"{' -> '.join(back)} closes the cycle"
                )
    assert found == [], "\n".join(found)


def test_the_dodge_check_can_fail():
    """`_reaches` finds a cycle closed through a package's ``__init__``, which
    `_module_graph` adds for imports from outside the package only."""
    graph = {"m.a.x": {"m.b"}, "m.b": {"m.a"}, "m.a": {"m.a.x"}}
    assert _reaches(graph, "m.b", "m.a.x") == ["m.b", "m.a", "m.a.x"]
    assert _reaches(graph, "m.a.x", "m.c") is None
    edges = _module_graph(
        {
            "microscale.ptq.run": {"microscale.train.init": (1, True)},
            "microscale.train.loop": {"microscale.train.init": (1, False)},
        }
    )
    assert edges["microscale.ptq.run"] == {"microscale.train.init", "microscale.train"}
    assert edges["microscale.train.loop"] == {"microscale.train.init"}
