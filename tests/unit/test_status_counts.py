"""The daemon's STATUS= line kept from the runs that changed (a standby of a team journal
knows 100,000 runs; counting them all every 2 s took a few % of a core): the same text
as counting every run."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, cast

from llmd_supervisor.core.run.lifecycle import RunState, new_run
from llmd_supervisor.supervision.daemon import _StatusCounts, status_line
from llmd_supervisor.supervision.run.driver import RunHandle
from tests.unit.test_journal import at


def _handle(run_id: str, state: RunState) -> Any:
    run = dataclasses.replace(new_run(run_id, f"llmd-{run_id}", at(0)), state=state)
    return SimpleNamespace(run=run)


def test_the_counts_kept_from_changes_are_the_counts_of_every_run() -> None:
    handles = {f"r{i}": _handle(f"r{i}", RunState.SUCCEEDED) for i in range(5)}
    handles["r5"] = _handle("r5", RunState.RUNNING)
    counts = _StatusCounts(cast(dict[str, RunHandle], handles))
    changed = [_handle("r5", RunState.VERIFYING), _handle("r6", RunState.PENDING)]
    for h in changed:
        handles[h.run.run_id] = h
    line = counts.update(cast(list[RunHandle], changed))
    assert line == status_line(cast(dict[str, RunHandle], handles))
    assert line == "2 runs in flight (1 pending, 1 verifying); 5 finished"
