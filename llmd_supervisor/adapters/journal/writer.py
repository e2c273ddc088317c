"""Who a shared journal's write transaction says it writes as (`core.ha.fencing.Writer`).

A PostgreSQL journal's write transaction states its writer's cluster and epoch first
(`core.ha.fencing.SET_WRITER_SQL`), and the fence trigger refuses it unless that is the
cluster's current lease epoch. The writer comes from the task that writes:

* a task that works for one cluster (a run's driver, a campaign, a control request
  about one cluster's run) runs inside ``writing_as(source)``, where ``source()`` is
  that cluster's writer now (`supervision.ha.leading.Roles.writer`): None once the daemon
  no longer acts for it, and the write is refused (fails closed);
* any other write uses the journal's default source (the daemon's: any cluster it leads,
  `supervision.ha.leading.Roles.any_writer`), so a standby, which leads none, writes
  nothing. Only the team's rows (`core.ha.fencing.TEAM_TABLES`) may be written so: the
  fence refuses a cluster's row written as another cluster (schema version 8).

The source is called when the write is handed to the journal, on the event loop; a
context variable carries it because a task's context is copied into the tasks it starts.
SQLite (one daemon, no lease) ignores all of this.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from llmd_supervisor.core.ha.fencing import Writer

__all__ = ["WriterSource", "current_writer", "writing_as"]

WriterSource = Callable[[], Writer | None]

_SOURCE: ContextVar[WriterSource | None] = ContextVar("llmd_journal_writer", default=None)


@contextlib.contextmanager
def writing_as(source: WriterSource) -> Iterator[None]:
    """Journal writes of this task (and of the tasks it starts) are `source()`'s."""
    token = _SOURCE.set(source)
    try:
        yield
    finally:
        _SOURCE.reset(token)


def current_writer(default: WriterSource | None) -> Writer | None:
    """The writer of a write made now: the task's source, else `default`, else None."""
    source = _SOURCE.get() or default
    return None if source is None else source()
