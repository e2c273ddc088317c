"""Generic readers for the fields of a decoded TOML table (pure, no I/O).

Each reader takes the table, the field's dotted path (its last part is the key) and the
bounds or pattern it must meet, and returns the typed value, its default, or raises
:class:`~llmd_supervisor.errors.SpecError` naming the field, the value and the fix. The
run spec (:mod:`llmd_supervisor.core.spec.runspec`) is built from them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Final

from llmd_supervisor.errors import SpecError

# Absolute path, no spaces, quotes, `$`, `%` (sbatch filename patterns) or other metachars.
# An absolute path without empty parts. Each part but the last ends in its '/', so a
# string has one way to match: `(?:[...]+/?)*` had exponentially many, and a 40-character
# path with one bad character at its end held the event loop for hours (re is not
# interruptible). tests/unit/test_spec.py times the worst case.
PATH_RE: Final = re.compile(r"/(?:[A-Za-z0-9._+-]+/)*[A-Za-z0-9._+-]*")
PLACEHOLDER_RE: Final = re.compile(r"\{\{|\}\}|\{([a-z_]+)\}|[{}]")
CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f]")


def shown(value: object) -> object:
    """`value` as an error shows it: a long string is cut (error replies are bounded, and
    the hint after the value is what the user needs)."""
    if isinstance(value, str) and len(value) > 80:
        return value[:77] + "..."
    if isinstance(value, list | dict) and len(text := repr(value)) > 80:
        return text[:77] + "..."
    return value


def plain_path(path: str) -> bool:
    """No ``.`` or ``..`` part: the path means what it says (checked after PATH_RE)."""
    return not any(part in (".", "..") for part in path.split("/"))


def check_keys(prefix: str, table: Mapping[str, object], allowed: Sequence[str]) -> None:
    for key in table:
        if key not in allowed:
            where = f"{prefix}.{key}" if prefix else key
            scope = f"in [{prefix}]" if prefix else "at the top level"
            raise SpecError(
                where, shown(table[key]), f"unknown key; allowed {scope}: {', '.join(allowed)}"
            )


def present(t: Mapping[str, object], fld: str, required: bool) -> object | None:
    key = fld.rsplit(".", 1)[1]
    value = t.get(key)
    if value is None and required:
        raise SpecError(fld, None, "this field is required")
    return value


def int_field(
    t: Mapping[str, object], fld: str, *, default: int | None = None, lo: int, hi: int
) -> int:
    value = present(t, fld, default is None)
    if value is None:
        assert default is not None
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpecError(fld, value, f"use an integer from {lo} to {hi}")
    return value


def num_field(t: Mapping[str, object], fld: str, *, default: float, lo: float, hi: float) -> float:
    value = present(t, fld, False)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not lo <= value <= hi
    ):
        raise SpecError(fld, value, f"use a number of seconds from {lo:g} to {hi:g}")
    return float(value)


def pattern_field(
    t: Mapping[str, object],
    fld: str,
    pattern: re.Pattern[str],
    hint: str,
    *,
    required: bool = False,
) -> str | None:
    value = present(t, fld, required)
    if value is None:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise SpecError(fld, shown(value), hint)
    return value


def path_field(t: Mapping[str, object], fld: str, *, required: bool = False) -> str | None:
    hint = (
        "use an absolute path of letters, digits and . _ + - / (no spaces, quotes, $ or %,"
        " no '.' or '..' parts)"
    )
    value = pattern_field(t, fld, PATH_RE, hint, required=required)
    if value is not None and not plain_path(value):
        raise SpecError(fld, value, hint)
    if value is not None and value != "/":
        value = value.rstrip("/")
    return value


def list_field(t: Mapping[str, object], fld: str, *, required: bool = False) -> list[object]:
    value = present(t, fld, required)
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(fld, value, 'use a list, e.g. ["a", "b"]')
    return value


def command_field(
    t: Mapping[str, object], fld: str, placeholders: frozenset[str]
) -> tuple[str, ...]:
    items = list_field(t, fld, required=True)
    if not items:
        raise SpecError(fld, items, "give the command as a non-empty argv list")
    argv: list[str] = []
    for i, item in enumerate(items):
        where = f"{fld}[{i}]"
        if not isinstance(item, str) or not item:
            raise SpecError(where, shown(item), "each argv element is a non-empty string")
        if CONTROL_RE.search(item):
            raise SpecError(where, shown(item), "remove control characters (newlines, tabs, NUL)")
        for m in PLACEHOLDER_RE.finditer(item):
            tok = m.group(0)
            if tok in ("{{", "}}"):
                continue
            name = m.group(1)
            if name is None:
                raise SpecError(where, shown(item), "write literal braces as '{{' and '}}'")
            if name not in placeholders:
                raise SpecError(
                    where,
                    shown(item),
                    f"unknown placeholder {{{name}}}; known: {', '.join(sorted(placeholders))}",
                )
        argv.append(item)
    return tuple(argv)
