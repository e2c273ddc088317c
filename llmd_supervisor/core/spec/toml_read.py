"""Decode a run spec's TOML text, turning every way it can go wrong into a `SpecError`.

``tomllib`` alone is not enough for text from anyone who can reach the control socket:

* deeply nested arrays or inline tables raise ``RecursionError``;
* an integer of more than 4300 decimal digits raises a plain ``ValueError`` (Python's
  integer-string conversion limit), and a long hexadecimal one parses but cannot be shown
  in an error message (``repr`` hits the same limit);
* a dotted key of many parts (``a.a.a...a = 1``) costs time and memory quadratic in its
  parts (20,000 parts: 3.7 s and 1.5 GB on Python 3.11);
* a lone surrogate (possible in JSON strings) is not UTF-8 and fails later, on writing.

So the text is bounded in size, scanned once (strings and comments skipped as TOML
defines them) for bracket nesting and dotted-key length before ``tomllib`` sees it, and
every integer of the result must fit in 64 bits. Pure, no I/O.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from typing import Final

from llmd_supervisor.errors import SpecError

__all__ = ["MAX_KEY_PARTS", "MAX_NESTING", "MAX_SPEC_CHARS", "decode_toml"]

MAX_SPEC_CHARS: Final = 256 * 1024
MAX_NESTING: Final = 16  # [ and { open at once (a spec needs 2)
MAX_KEY_PARTS: Final = 16  # parts of one dotted key or table name (a spec needs 3)
_INT_BITS: Final = 64
_RESETS: Final = frozenset("=,\n[]{}")
_FIELD: Final = "<toml>"


def decode_toml(text: str) -> dict[str, object]:
    """The decoded TOML document, or `SpecError` naming what is wrong with the text."""
    if len(text) > MAX_SPEC_CHARS:
        raise SpecError(
            _FIELD, f"{len(text)} characters", f"a run spec is at most {MAX_SPEC_CHARS} characters"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SpecError(
            _FIELD,
            f"character {exc.start}",
            "the text is not valid Unicode (a lone surrogate); write the spec as UTF-8",
        ) from None
    _scan(text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(
            _FIELD, "(TOML syntax)", f"the file is not valid TOML: {exc}; fix it at that line"
        ) from None
    except RecursionError:  # guarded by _scan; kept in case tomllib recurses elsewhere
        raise SpecError(
            _FIELD, text[:80], "arrays or tables are nested too deeply for a run spec"
        ) from None
    except ValueError as exc:  # e.g. "Exceeds the limit (4300 digits) for integer string ..."
        raise SpecError(
            _FIELD,
            text[:80],
            f"a value cannot be decoded ({exc}); integers in a run spec fit in {_INT_BITS} bits",
        ) from None
    _check_ints(data)
    return data


def _scan(text: str) -> None:
    """Refuse nesting deeper than MAX_NESTING and keys of more than MAX_KEY_PARTS parts."""
    depth = dots = 0
    line = 1
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if c in "\"'":
            start = i
            i = _string_end(text, i)
            line += text.count("\n", start, i)
            continue
        if c == "\n":
            line += 1
        if c in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise SpecError(
                    _FIELD,
                    f"line {line}",
                    f"arrays and tables are nested more than {MAX_NESTING} deep;"
                    " a run spec needs at most 2",
                )
        elif c in "]}":
            depth = max(0, depth - 1)
        if c in _RESETS:
            dots = 0
        elif c == ".":
            dots += 1
            if dots >= MAX_KEY_PARTS:
                raise SpecError(
                    _FIELD,
                    f"line {line}",
                    f"a dotted key has more than {MAX_KEY_PARTS} parts;"
                    " a run spec needs at most 3 (e.g. env.common.NAME)",
                )
        i += 1


def _string_end(text: str, i: int) -> int:
    """The index just past the TOML string starting at `i` (unterminated: end of line/text).

    Basic strings (``"``) honour backslash escapes, literal ones (``'``) do not; the
    multi-line forms may end with up to two extra quotes that belong to the content.
    """
    q = text[i]
    n = len(text)
    if text.startswith(q * 3, i):
        j = i + 3
        while j < n:
            if q == '"' and text[j] == "\\":
                j += 2
                continue
            if text.startswith(q * 3, j):
                j += 3
                extra = 0
                while extra < 2 and j < n and text[j] == q:
                    j += 1
                    extra += 1
                return j
            j += 1
        return n
    j = i + 1
    while j < n and text[j] != "\n":
        if q == '"' and text[j] == "\\":
            j += 2
            continue
        if text[j] == q:
            return j + 1
        j += 1
    return j


def _check_ints(data: Mapping[str, object]) -> None:
    """Every integer fits in 64 bits (the only way to show a huge one is to not repr it)."""
    stack: list[tuple[str, object]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Mapping):
            stack += [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value.bit_length() > _INT_BITS - 1
        ):
            raise SpecError(
                path,
                f"an integer of {value.bit_length()} bits",
                f"integers in a run spec fit in {_INT_BITS} bits",
            )
