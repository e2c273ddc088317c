"""The result parser's child process (see `adapters.files.result_parser`, which starts it).

``python -I -m llmd_supervisor.adapters.files.result_parser_child MEMORY`` first limits its own
address space to MEMORY bytes (RLIMIT_AS) and its core dumps to none, and offers itself to
the kernel's OOM killer before the daemon (``oom_score_adj`` 1000). It then writes the
line `READY` (the daemon times each file from there, not from the interpreter's start on a
busy login node) and serves requests from stdin until EOF: each is a line
``[FORMATS, SIZE, CPU]`` followed by SIZE bytes (a result file), and is answered with one
line, `core.results.evidence.parsed_to_json` of what `parse_any` made of the bytes. Before each
file it lets itself CPU more seconds of CPU time (RLIMIT_CPU's soft limit, from what it
used so far: SIGXCPU ends it), so that a child kept for the next files has the same bound
on each as a new one. A file whose parse runs out of memory is answered as a problem of
kind ``refused`` with the detail `OUT_OF_MEMORY` (the daemon words the reason: it knows
the setting), and the next request is served. Imports only the stdlib and `core.results.evidence`,
so it starts quickly and small.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
from collections.abc import Sequence
from typing import BinaryIO

from llmd_supervisor.core.results.evidence import ResultProblem, parse_any, parsed_to_json

OUT_OF_MEMORY = "out of memory"
READY = b"ready\n"


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """Answer each request of `stdin` on `stdout` (see the module docstring)."""
    stdout.write(READY)
    stdout.flush()
    while head := stdin.readline():
        formats, size, cpu = json.loads(head)
        used = resource.getrusage(resource.RUSAGE_SELF)
        allow(resource.RLIMIT_CPU, math.ceil(used.ru_utime + used.ru_stime) + int(cpu))
        data = stdin.read(size)
        try:
            got = parse_any(data, formats)
        except MemoryError:
            got = ResultProblem("refused", OUT_OF_MEMORY)
        del data
        stdout.write(json.dumps(parsed_to_json(got)).encode() + b"\n")
        stdout.flush()


def allow(which: int, value: int) -> None:
    """Set the soft limit `which` to `value` (or to the hard limit, if that is lower)."""
    _, hard = resource.getrlimit(which)
    resource.setrlimit(which, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))


def main(argv: Sequence[str]) -> int:
    memory = int(argv[1])
    # Out of memory in the unit (MemoryMax=): the kernel ends this, not the daemon.
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    allow(resource.RLIMIT_CORE, 0)
    allow(resource.RLIMIT_AS, memory)
    serve(sys.stdin.buffer, sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
