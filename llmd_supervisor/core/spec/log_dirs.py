"""Where a run's log directory may be (pure).

A spec's ``run.log_dir`` is chosen by whoever submits. The daemon creates it (``mkdir -p``
as its own account), the job writes into it, and the daemon copies from it into its
archive, so it must be a directory the operator set aside for runs: absolute, in
normal form (no ``.``, ``..``, ``//`` or trailing ``/``), under one of ``daemon.log_roots``,
never the daemon's state or archive directory or inside them, and (checked where the file
system is seen, `supervision.run.driver`) without a symbolic link on its way.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from pathlib import Path

from llmd_supervisor.errors import SpecError

# The system service's control socket (`[daemon] socket`'s default; the clients' last choice).
DEFAULT_SOCKET = Path("/run/llmd-supervisor/control.sock")

FIELD = "run.log_dir"


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_log_dir(
    log_dir: str, roots: Sequence[str], forbidden: Sequence[str], *, field: str = FIELD
) -> None:
    """SpecError unless `log_dir` is a normal absolute path under one of `roots` and not
    inside (nor a parent of) any of `forbidden` (the state and archive directories)."""
    if not log_dir.startswith("/") or posixpath.normpath(log_dir) != log_dir:
        raise SpecError(
            field,
            log_dir,
            "use an absolute path in normal form (no '.', '..', '//' or trailing '/')",
        )
    if not roots:
        raise SpecError(
            field,
            log_dir,
            "this daemon accepts no log directory until its operator lists the allowed"
            " parents in daemon.log_roots (e.g. log_roots = ['/shared/llmd-runs'])",
        )
    if not any(_inside(log_dir, root) and log_dir != root for root in roots):
        raise SpecError(
            field, log_dir, f"use a directory below one of daemon.log_roots ({', '.join(roots)})"
        )
    for place in forbidden:
        if _inside(log_dir, place) or _inside(place, log_dir):
            raise SpecError(
                field,
                log_dir,
                f"it overlaps the daemon's own directory {place}; choose one below"
                f" {', '.join(roots)} outside it",
            )


def check_canonical(log_dir: str, resolved: str, *, field: str = FIELD) -> None:
    """SpecError if resolving the links on `log_dir`'s way gives another path."""
    if resolved != log_dir:
        raise SpecError(
            field,
            log_dir,
            f"a symbolic link on its way leads to {resolved}; give that path itself"
            " (links in a log directory's path are not followed)",
        )
