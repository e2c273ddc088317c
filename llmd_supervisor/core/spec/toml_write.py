"""Write a decoded run spec back as TOML text (pure, no I/O).

A campaign submits specs it built by changing a decoded base spec (``core.campaign.expand``);
the daemon stores and renders run specs as TOML text, so the changed dict has to become
text again. This writer covers what ``decode_toml`` can return for a run spec: strings,
integers, floats (``inf``, ``-inf`` and ``nan`` as TOML spells them), booleans, arrays of
scalars and arrays, nested tables and arrays of tables (``[[router.process]]``). Dates
and times are not part of a run spec and are refused.

The guarantee, which ``tests/unit/test_toml_write.py`` checks with generated data:
``decode_toml(dump_toml(x)) == x`` for any such `x`. Comments and the original layout
are not kept.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Final

__all__ = ["dump_toml"]

_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES: Final = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def dump_toml(data: Mapping[str, object]) -> str:
    """`data` as TOML text; TypeError for a value TOML (or a run spec) cannot hold.

    Within each table its plain keys come first, then its sub-tables, then its arrays
    of tables, so the text is valid TOML whatever order the mapping has.
    """
    lines: list[str] = []
    _table(lines, (), data, header=None)
    return "\n".join(lines).lstrip("\n") + "\n"


def _is_table_array(value: object) -> bool:
    """A non-empty list of tables only: written as ``[[name]]`` sections."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _table(
    lines: list[str], path: tuple[str, ...], table: Mapping[str, object], *, header: str | None
) -> None:
    """Append `table` (at `path`) under `header`, then its sub-tables and table arrays."""
    if header is not None:
        lines += ["", header]
    subtables: list[tuple[str, Mapping[str, object]]] = []
    arrays: list[tuple[str, list[Mapping[str, object]]]] = []
    for key, value in table.items():
        if not isinstance(key, str):
            raise TypeError(f"TOML keys are strings, not {key!r}")
        if isinstance(value, Mapping):
            subtables.append((key, value))
        elif _is_table_array(value):
            assert isinstance(value, list)
            arrays.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, sub in subtables:
        name = ".".join(_key(part) for part in (*path, key))
        _table(lines, (*path, key), sub, header=f"[{name}]")
    for key, items in arrays:
        name = ".".join(_key(part) for part in (*path, key))
        for item in items:
            _table(lines, (*path, key), item, header=f"[[{name}]]")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _value(value: object) -> str:
    """An inline TOML value (arrays and inline tables nest)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # '1.0', '1e-05', '1.5e+300': all TOML floats
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(str(k))} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"a run spec holds no {type(value).__name__} value ({value!r})")


def _string(text: str) -> str:
    """A TOML basic string: ASCII only, with escapes for quotes, backslashes, control
    characters (DEL too, which TOML forbids raw) and everything beyond ASCII.

    ``json.dumps`` is not enough: it writes characters beyond the BMP as surrogate pairs
    (``\\ud83d\\ude00``), which TOML refuses; TOML wants ``\\U0001f600``.
    """
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif code < 0x20 or code == 0x7F or 0x7F < code <= 0xFFFF:
            if 0xD800 <= code <= 0xDFFF:
                raise TypeError(f"a lone surrogate (U+{code:04X}) cannot be written as TOML")
            out.append(f"\\u{code:04x}")
        elif code > 0xFFFF:
            out.append(f"\\U{code:08x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)
