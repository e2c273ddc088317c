"""Only the driver changes a run's handle (issue 3.3): a phase returns what it found and
`supervision/run/driver.py` applies it.

Checked on the source: outside the driver, no statement assigns (or deletes, or grows in
place) an attribute named like one of `RunHandle`'s fields on anything but ``self``,
except where `OWN` says the object is one of that module's own (the poller's tracked
jobs have a `changed` event of their own). A phase sees the run through `RunContext`, whose
members are read-only properties, so mypy refuses such an assignment too; this catches
what a cast or an ``Any`` would let by.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "llmd_supervisor"
DRIVER = PACKAGE / "supervision" / "run" / "driver.py"
# Methods that change a list or a dict in place (the handle's history)
MUTATORS = frozenset(
    {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update"}
)


def handle_fields(source: str) -> frozenset[str]:
    """The fields `RunHandle` declares."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "RunHandle":
            return frozenset(
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            )
    raise AssertionError("RunHandle is not defined in the driver")


def _not_self(node: ast.expr) -> bool:
    return not (isinstance(node, ast.Name) and node.id == "self")


def changes(source: str, fields: frozenset[str]) -> list[str]:
    """Where `source` changes an attribute named like one of `fields` of another object."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            if node.attr in fields and _not_self(node.value):
                found.append((node.lineno, f"{ast.unparse(node)} changed"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
            and isinstance(owner := node.func.value, ast.Attribute)
            and owner.attr in fields
            and _not_self(owner.value)
        ):
            found.append((node.lineno, f"{ast.unparse(node.func)} called"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


FIELDS = handle_fields(DRIVER.read_text(encoding="utf-8"))
# (module, field) pairs where the object is the module's own, not a run's handle
OWN = {"supervision/cluster/poller.py": frozenset({"changed"})}  # a tracked job's `changed` event


def _others() -> list[object]:
    paths = sorted(p for p in PACKAGE.rglob("*.py") if p != DRIVER)
    return [pytest.param(p, id=str(p.relative_to(PACKAGE))) for p in paths]


@pytest.mark.parametrize("path", _others())
def test_no_module_but_the_driver_changes_a_run_handle(path: Path) -> None:
    own = OWN.get(str(path.relative_to(PACKAGE)), frozenset())
    found = changes(path.read_text(encoding="utf-8"), FIELDS - own)
    assert found == [], f"{path.relative_to(PACKAGE)} changes a run's handle: return it instead"


def test_the_guard_knows_the_handle_and_sees_each_kind_of_change() -> None:
    assert {"stored", "attempt", "history", "held_until", "layout"} <= FIELDS
    source = """
def phase(h, ctx):
    h.attempt = None
    h.tail_bytes += 1
    ctx.handle.held_until, x = None, 1
    h.history.append({})
    del h.scontrol_snapshot
    self.attempt = None  # an object's own field: not the handle's
    h.other = 1
    attempt.copies = 2
"""
    assert changes(source, FIELDS) == [
        "line 3: h.attempt changed",
        "line 4: h.tail_bytes changed",
        "line 5: ctx.handle.held_until changed",
        "line 6: h.history.append called",
        "line 7: h.scontrol_snapshot changed",
    ]
