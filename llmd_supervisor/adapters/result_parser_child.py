"""The result parser's child process (see `adapters.result_parser`, which starts it).

``python -I -m llmd_supervisor.adapters.result_parser_child MEMORY CPU`` first limits its
own address space to MEMORY bytes (RLIMIT_AS), its CPU time to CPU seconds (RLIMIT_CPU:
SIGXCPU ends it) and its core dumps to none, and offers itself to the kernel's OOM killer
before the daemon (``oom_score_adj`` 1000); then it serves requests from stdin until EOF:
each is a line ``[FORMATS, SIZE]`` followed by SIZE bytes (a result file), and is answered
with one line, `core.results.parsed_to_json` of what `parse_any` made of the bytes. A file
whose parse runs out of memory is answered as a problem of kind ``refused`` with the
detail `OUT_OF_MEMORY` (the daemon words the reason: it knows the setting), and the next
request is served. Imports only the stdlib and `core.results`, so it starts quickly and
small.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
from collections.abc import Sequence
from typing import BinaryIO

from llmd_supervisor.core.results import ResultProblem, parse_any, parsed_to_json

OUT_OF_MEMORY = "out of memory"


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """Answer each request of `stdin` on `stdout` (see the module docstring)."""
    while head := stdin.readline():
        formats, size = json.loads(head)
        data = stdin.read(size)
        try:
            got = parse_any(data, formats)
        except MemoryError:
            got = ResultProblem("refused", OUT_OF_MEMORY)
        del data
        stdout.write(json.dumps(parsed_to_json(got)).encode() + b"\n")
        stdout.flush()


def lower(which: int, value: int) -> None:
    """Lower the soft limit `which` to `value` (or to the hard limit, if that is lower)."""
    _, hard = resource.getrlimit(which)
    resource.setrlimit(which, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))


def main(argv: Sequence[str]) -> int:
    memory, cpu = int(argv[1]), int(argv[2])
    # Out of memory in the unit (MemoryMax=): the kernel ends this, not the daemon.
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    lower(resource.RLIMIT_CORE, 0)
    lower(resource.RLIMIT_CPU, cpu)
    lower(resource.RLIMIT_AS, memory)
    serve(sys.stdin.buffer, sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
