"""Text a user's job wrote, made safe once, where it enters the daemon (pure).

A marker's reason, a status file's agent state, stage and component names, the last line
of a batch log: a job writes them, and the daemon journals them (SQLite refuses a lone
surrogate, which valid JSON such as ``"\\ud800"`` decodes to), logs them, and shows them
in ``status``, ``list`` and ``wait`` on an operator's terminal (where ESC, CSI, OSC and
BEL can rewrite the screen, set the title or write the clipboard). `job_text` is the one
function every such string passes through before anything else sees it:

- every character that ``str.isprintable`` refuses is written as its Python escape, the
  way ``repr`` shows it: C0 controls (``\\x1b``, ``\\x07``, ``\\r``, ``\\n``, ``\\t``), DEL
  and the C1 controls (``\\x7f``, ``\\x9b``), lone surrogates (``\\ud800``), format
  characters such as bidirectional overrides (``\\u202e``), line and paragraph separators,
  non-ASCII spaces, private-use and unassigned code points. A backslash stays as it is:
  the result is for reading, not for decoding back;
- the result is at most `limit` characters (default `JOB_TEXT_MAX`); a longer one is cut
  at an escape's boundary and ends with ``...``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = ["CUT_MARK", "JOB_TEXT_MAX", "job_fields", "job_repr", "job_text"]

# Characters of one job-written string the daemon keeps (escapes included): a reason line
# of `status` and its journal row; `list` and the verdict's reason show less of it again.
JOB_TEXT_MAX: Final = 1024
CUT_MARK: Final = "..."
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def job_text(value: str, limit: int = JOB_TEXT_MAX) -> str:
    """`value` with every unprintable character escaped, at most `limit` characters (see
    the module docstring); ValueError if `limit` cannot hold one character and the mark."""
    if limit <= len(CUT_MARK):
        raise ValueError(f"limit {limit} leaves no room for text beside {CUT_MARK!r}")
    head = value[: limit + 1]  # every character shows as one or more: the rest is cut
    if len(head) <= limit and head.isprintable():
        return head
    pieces: list[str] = []
    size = 0
    for ch in head:
        piece = ch if ch.isprintable() else _escape(ch)
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            break
    if size <= limit and len(value) <= limit:
        return "".join(pieces)
    room = limit - len(CUT_MARK)
    while size > room:
        size -= len(pieces.pop())
    return "".join(pieces) + CUT_MARK


def job_repr(value: object, limit: int = 80) -> str:
    """A job-written value of any JSON type as a message shows it (``repr``), escaped and
    bounded as `job_text` does; a long string is cut before `repr` copies it."""
    if isinstance(value, str):
        value = value[: limit + 1]
    return job_text(repr(value), limit)


def job_fields(value: Mapping[str, object], limit: int = JOB_TEXT_MAX) -> dict[str, object]:
    """A job-written JSON object (a rank's status file) with its string values, and the
    strings in its list values, passed through `job_text`; other values as they are."""

    def clean(v: object) -> object:
        return job_text(v, limit) if isinstance(v, str) else v

    return {k: [clean(x) for x in v] if isinstance(v, list) else clean(v) for k, v in value.items()}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
