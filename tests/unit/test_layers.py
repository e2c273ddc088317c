"""The package's layers point one way (DESIGN.md section 2).

core imports no adapter, orchestration or CLI module; adapters import no orchestration or
CLI; orchestration imports no CLI; nothing outside ``node/`` imports the node scripts
except the stdlib-only names module ``node.common`` they share. Imports under
``TYPE_CHECKING`` count too: a type is a dependency. (Modules are sized by what they do,
not by a line count; that no import cycle forms is test_import_cycles.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "llmd_supervisor"
# layer -> the package's top-level parts it may import
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset({"core", "errors", "node.common", "__version__"}),
    "adapters": frozenset({"core", "adapters", "errors", "node.common", "__version__"}),
    "supervision": frozenset(
        {"core", "adapters", "supervision", "errors", "node.common", "__version__"}
    ),
    "cli": frozenset(
        {"core", "adapters", "supervision", "cli", "errors", "node.common", "__version__"}
    ),
}
NODE_SCRIPTS = frozenset({"agent", "engine", "bench"})


def _modules() -> list[object]:
    node_side = {"node", "standins"}  # stdlib scripts for the allocation, not layers
    paths = sorted(
        p for p in PACKAGE.rglob("*.py") if not node_side & set(p.relative_to(PACKAGE).parts)
    )
    return [pytest.param(p, id=str(p.relative_to(PACKAGE))) for p in paths]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name under llmd_supervisor) for every import of the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "llmd_supervisor":
                found += [(node.lineno, f"llmd_supervisor.{a.name}") for a in node.names]
            else:
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name.startswith("llmd_supervisor.")]


def _part(dotted: str) -> str:
    parts = dotted.split(".")[1:]
    if parts[0] == "node":  # the scripts are not imported; their package and common are
        return "node." + parts[1] if parts[1:2] and parts[1] in NODE_SCRIPTS else "node.common"
    return parts[0]


def test_every_module_is_in_a_layer() -> None:
    loose = [
        p.name
        for p in PACKAGE.glob("*.py")
        if p.name not in {"__init__.py", "__main__.py", "errors.py"}
    ]
    assert loose == [], "put each module in core/, adapters/, supervision/ or cli/"


@pytest.mark.parametrize("path", _modules())
def test_imports_follow_the_layers(path: Path) -> None:
    rel = path.relative_to(PACKAGE).parts
    if len(rel) == 1:  # __init__, __main__, errors
        allowed = (
            frozenset({"errors", "__version__", "cli"})
            if rel[0] == "__main__.py"
            else (frozenset({"__version__"}))
        )
    else:
        allowed = ALLOWED[rel[0]]
    wrong = [f"line {line}: {name}" for line, name in _imports(path) if _part(name) not in allowed]
    assert wrong == [], f"{path.relative_to(PACKAGE)} imports against the layers"


# The modules that may sit directly in a layer (STYLE.md, "Folders by feature"): everything
# else belongs to one feature package, whose `__init__` docstring says what it owns.
SHARED_MODULES: dict[str, frozenset[str]] = {
    "core": frozenset({"__init__", "config"}),
    "adapters": frozenset({"__init__", "fsutil", "log", "metrics", "sdnotify"}),
    "supervision": frozenset({"__init__", "daemon"}),
}


@pytest.mark.parametrize("layer", sorted(SHARED_MODULES))
def test_a_layer_holds_feature_packages_and_only_its_shared_modules(layer: str) -> None:
    loose = {p.stem for p in (PACKAGE / layer).glob("*.py")} - SHARED_MODULES[layer]
    assert not loose, (
        f"{sorted(loose)} sit directly in {layer}/: put each in the feature package it "
        f"belongs to ({layer}/<feature>/), or, if it is truly shared, add it to "
        "SHARED_MODULES with the reason"
    )
    for package in (PACKAGE / layer).iterdir():
        if package.is_dir() and package.name != "__pycache__" and any(package.glob("*.py")):
            init = package / "__init__.py"
            assert init.is_file(), f"{package} has modules but no __init__.py"
            doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
            assert doc and "import" in doc.lower(), (
                f"{init.relative_to(PACKAGE)} must say in its docstring what the package owns "
                "and what it may import"
            )
