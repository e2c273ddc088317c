"""`core.render.node_source.without_prose`: the node files' code without docstrings and comment
lines, line numbers kept, the same syntax tree (issue 3.3's production script size)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

from llmd_supervisor.core.render.node_source import without_prose
from llmd_supervisor.core.render.script import bundled_node_sources
from llmd_supervisor.node import NODE_FILES

CASES = [
    pytest.param(
        '"""Module doc,\non two lines."""\n\nX = 1  # kept: after code\n',
        "\n\n\nX = 1  # kept: after code\n",
        id="module-docstring-blanked-comment-after-code-kept",
    ),
    pytest.param(
        'def f() -> int:\n    """Doc."""\n    # why\n    return 1\n',
        "def f() -> int:\n\n\n    return 1\n",
        id="function-docstring-and-comment-line",
    ),
    pytest.param(
        'class E(Exception):\n    """Only a docstring,\n    two lines."""\n',
        "class E(Exception):\n    ...\n\n",
        id="a-lone-docstring-becomes-ellipsis",
    ),
    pytest.param(
        'def f(): "one line"\n',
        'def f(): "one line"\n',
        id="docstring-on-the-def-line-left",
    ),
    pytest.param(
        'SCRIPT = """\n# not a comment: inside a string\necho hi\n"""\n',
        'SCRIPT = """\n# not a comment: inside a string\necho hi\n"""\n',
        id="hash-lines-inside-a-string-kept",
    ),
    pytest.param(
        '#!/usr/bin/env python3\n# a comment\n"""Doc."""\nimport os\n',
        "#!/usr/bin/env python3\n\n\nimport os\n",
        id="shebang-kept",
    ),
    pytest.param(
        "def f(\n    a: int,  # the first\n    # the second is b\n    b: int,\n) -> int:\n"
        "    return a + b\n",
        "def f(\n    a: int,  # the first\n\n    b: int,\n) -> int:\n    return a + b\n",
        id="comment-line-inside-brackets",
    ),
    pytest.param(
        'def f():\n    """Doc."""\n    "not a docstring"\n    return 1\n',
        'def f():\n    """Doc."""\n    "not a docstring"\n    return 1\n',
        id="a-second-string-would-become-the-docstring-source-kept",
    ),
    pytest.param("def broken(:\n    # x\n", "def broken(:\n    # x\n", id="no-parse-as-is"),
]


@pytest.mark.parametrize(("source", "expected"), CASES)
def test_without_prose(source: str, expected: str) -> None:
    assert without_prose(source) == expected


def _code(source: str) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            first = body[0] if body else None
            doc = first.value if isinstance(first, ast.Expr) else None
            if isinstance(doc, ast.Constant) and isinstance(doc.value, str):
                node.body = body[1:] or [ast.Expr(ast.Constant(...))]
    return ast.dump(tree)


@pytest.mark.parametrize("dest", sorted(NODE_FILES))
def test_every_node_file_keeps_its_code_and_line_numbers(dest: str) -> None:
    from importlib import resources

    original = resources.files("llmd_supervisor").joinpath(*NODE_FILES[dest].split("/"))
    source = original.read_text(encoding="utf-8")
    shipped = bundled_node_sources()[dest]
    assert shipped != source, "nothing blanked"
    assert shipped.count("\n") == source.count("\n")
    for number, (before, after) in enumerate(
        zip(source.splitlines(), shipped.splitlines(), strict=True), 1
    ):
        assert after in (before, "", before[: len(before) - len(before.lstrip())] + "..."), number
    assert _code(shipped) == _code(source)


def test_a_traceback_names_the_repository_line() -> None:
    source = textwrap.dedent(
        '''\
        """A module.

        Its doc.
        """
        # a comment


        def boom() -> None:
            """Raise."""
            raise RuntimeError("here")


        boom()
        '''
    )
    out = subprocess.run(
        [sys.executable, "-c", without_prose(source)], capture_output=True, text=True, check=False
    )
    assert "line 10, in boom" in out.stderr, out.stderr
    assert source.splitlines()[9].strip() == 'raise RuntimeError("here")'
