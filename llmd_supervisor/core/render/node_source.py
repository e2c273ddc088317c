"""The node files' Python source as a batch script carries it: without its prose (pure).

A production batch script carries the node agent's source (issue 3.3: at most a quarter
of the old 167 KB script). Half of that source is prose for its readers: docstrings and
comment lines. `without_prose` blanks them and keeps everything else byte for byte:

- every docstring (module, class, function) becomes empty lines, or ``...`` on its first
  line when it is the whole body; every line that holds only a comment becomes empty;
  a comment after code, strings that are not docstrings and the ``#!`` line stay;
- the line count and every code line's number are the repository's, so a traceback from
  a node names the repository's lines;
- the code is the repository's: `without_prose` parses its result and checks that the
  syntax tree equals the original's with the docstrings removed (what ``python -OO``
  would run). A source it cannot treat so (it does not parse, say) is returned as is.

Only ``__doc__`` differs (None, as under ``-OO``), and the node code does not read it.
"""

from __future__ import annotations

import ast
import io
import tokenize

__all__ = ["without_prose"]

_Scope = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def without_prose(source: str) -> str:
    """`source` with its docstrings and comment-only lines blanked (line numbers kept);
    `source` itself when it does not parse or the result would not be the same code."""
    try:
        tree = ast.parse(source)
        comments = _comment_lines(source)
    except (SyntaxError, tokenize.TokenError, ValueError):
        return source
    lines = source.splitlines(keepends=True)
    blank = set(comments)
    ellipsis: dict[int, int] = {}  # line -> column of a body's lone docstring
    for scope in ast.walk(tree):
        if not isinstance(scope, _Scope) or (doc := _docstring(scope)) is None:
            continue
        if doc.end_lineno is None or (
            not isinstance(scope, ast.Module) and doc.lineno == scope.lineno
        ):
            continue  # ``def f(): "doc"`` on one line: left as is
        blank.update(range(doc.lineno, doc.end_lineno + 1))
        if len(scope.body) == 1:
            ellipsis[doc.lineno] = doc.col_offset
    out = []
    for number, line in enumerate(lines, 1):
        if number in ellipsis:
            out.append(" " * ellipsis[number] + "...\n")
        elif number in blank and not (number == 1 and line.startswith("#!")):
            out.append("\n")
        else:
            out.append(line)
    result = "".join(out)
    return result if _same_code(tree, result) else source


def _docstring(scope: _Scope) -> ast.Expr | None:
    if not scope.body:
        return None
    first = scope.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first
    return None


def _comment_lines(source: str) -> set[int]:
    """The numbers of the lines whose only token is a comment (tokenize never takes a
    ``#`` inside a string for one)."""
    code: set[int] = set()
    comments: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return comments - code


def _same_code(original: ast.Module, result: str) -> bool:
    try:
        stripped = ast.parse(result)
    except SyntaxError:
        return False
    return ast.dump(_no_docstrings(original)) == ast.dump(_no_docstrings(stripped))


def _no_docstrings(tree: ast.Module) -> ast.Module:
    """`tree`, changed in place: no docstrings (a body left empty gets ``...``)."""
    for scope in ast.walk(tree):
        if isinstance(scope, _Scope) and _docstring(scope) is not None:
            scope.body = scope.body[1:] or [ast.Expr(ast.Constant(...))]
    return tree
