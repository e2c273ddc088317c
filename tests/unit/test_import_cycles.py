"""No module of the package is in an import cycle (issue 3.3).

Every import counts: at module level, inside a function, and under ``TYPE_CHECKING`` (the
cycles this guard was written against were of that kind: helpers that took the whole
driver as a type). A cycle is reported with its modules in order, one per line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llmd_supervisor"
ROOT = PACKAGE.name


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(dotted: str) -> str | None:
    """The package's module a dotted name is (or is an attribute of), if any."""
    parts = dotted.split(".")
    while parts:
        name = ".".join(parts)
        if name in MODULES:
            return name
        parts.pop()
    return None


def imports_of(name: str) -> set[str]:
    """The package's modules that module `name` imports, anywhere in it."""
    return imports_in(MODULES[name].read_text(encoding="utf-8"), name, _is_package(name))


def imports_in(source: str, name: str, is_package: bool = False) -> set[str]:
    """The package's modules that `source` (module `name`) imports, anywhere in it."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from pkg import mod` imports the module; `from mod import name` the module
            targets = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target == ROOT or target.startswith(ROOT + "."):
                resolved = _resolve(target)
                if resolved is not None and resolved != name:
                    found.add(resolved)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of two or more modules (Tarjan), as one cycle through
    them, sorted."""
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
            component: set[str] = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_a_cycle(graph, component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One path from the component's first module back to it (for the message)."""
    start = min(component)
    seen = {start}

    def walk(path: list[str]) -> Iterator[list[str]]:
        for w in sorted(graph.get(path[-1], set()) & component):
            if w == start:
                yield [*path, start]
            elif w not in seen:
                seen.add(w)
                yield from walk([*path, w])

    return next(walk([start]), sorted(component))


def test_the_package_has_no_import_cycle() -> None:
    graph = {name: imports_of(name) for name in MODULES}
    shown = ["\n  -> ".join(cycle) for cycle in cycles(graph)]
    assert shown == [], "import cycles:\n" + "\n\n".join(shown)


def test_the_guard_sees_a_cycle_through_a_type_checking_import() -> None:
    """The shape of the cycles it was written against: a helper importing the driver
    under TYPE_CHECKING, the driver importing the helper."""
    graph = {
        "pkg.driver": {"pkg.steps", "pkg.core"},
        "pkg.steps": {"pkg.driver"},  # if TYPE_CHECKING: from pkg.driver import Supervisor
        "pkg.core": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
    }
    assert cycles(graph) == [
        ["pkg.a", "pkg.b", "pkg.c", "pkg.a"],
        ["pkg.driver", "pkg.steps", "pkg.driver"],
    ]
    assert cycles({"pkg.a": {"pkg.b"}, "pkg.b": set()}) == []


def test_imports_under_type_checking_in_functions_and_relative_count() -> None:
    source = """
from typing import TYPE_CHECKING
from . import context
from .records import RECEIPT_EVENT

if TYPE_CHECKING:
    from llmd_supervisor.supervision.run.driver import Supervisor

def f() -> None:
    import llmd_supervisor.supervision.cluster.poller
"""
    run = "llmd_supervisor.supervision.run"
    assert imports_in(source, f"{run}.submit") == {
        f"{run}.context",
        f"{run}.records",
        f"{run}.driver",
        "llmd_supervisor.supervision.cluster.poller",
    }
    # on the real package: cli/run_commands.py imports the daemon root inside a function
    assert "llmd_supervisor.supervision.daemon" in imports_of("llmd_supervisor.cli.run_commands")
