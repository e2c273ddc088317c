"""A process SIGKILLed right after a journal write returns loses nothing it was told was saved."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.core.run.lifecycle import RunState

# Runs in a fresh interpreter: journal a run, step it through the lifecycle until it reaches
# the target state, then SIGKILL itself the moment the last save returns (no close, no
# atexit, no WAL checkpoint).
CHILD = """
import os, signal, sys
from datetime import UTC, datetime
from pathlib import Path

import anyio

from llmd_supervisor.adapters.journal.store import Journal, RunMeta
from llmd_supervisor.core.run.lifecycle import RunState, Started, Submit, Submitted, new_run, step

async def main(path: Path, target: RunState) -> None:
    journal = await Journal.open(path)
    now = datetime.now(UTC)
    run = new_run("r-crash", "llmd-r-crash", now)
    meta = RunMeta(1000, "dev", "spec", "#!/bin/bash\\n", "/shared/r", "/archive/r", now)
    await journal.insert_run(run, meta)
    await journal.add_event("r-crash", "run.accepted", {"n": 1}, now)
    for event in (Submit(), Submitted("4242"), Started(("n1", "n2"))):
        if run.state is target:
            break
        before = run.state
        run, _ = step(run, event, datetime.now(UTC))
        await journal.save(run, expected=before)
    os.kill(os.getpid(), signal.SIGKILL)

anyio.run(main, Path(sys.argv[1]), RunState(sys.argv[2]))
"""


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("target", "transitions", "job_id", "nodes"),
    [
        (RunState.ACCEPTED, 1, None, ()),
        (RunState.SUBMITTING, 2, None, ()),
        (RunState.PENDING, 3, "4242", ()),
        (RunState.RUNNING, 4, "4242", ("n1", "n2")),
    ],
)
async def test_saved_state_survives_sigkill(
    tmp_path: Path,
    target: RunState,
    transitions: int,
    job_id: str | None,
    nodes: tuple[str, ...],
) -> None:
    path = tmp_path / "state" / "journal.db"
    with anyio.fail_after(60):
        result = await anyio.run_process(
            [sys.executable, "-c", CHILD, str(path), target.value], check=False
        )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()
    # The process died with its WAL un-checkpointed; recovery has to come from the WAL.
    assert path.with_name(path.name + "-wal").stat().st_size > 0

    async with await Journal.open(path) as journal:
        stored = await journal.get("r-crash")
        assert stored is not None
        assert stored.run.state is target
        assert len(stored.run.transitions) == transitions
        assert stored.run.slurm_job_id == job_id
        assert stored.run.nodes == nodes
        assert stored.meta.spec_toml == "spec"
        assert await journal.find_by_job_name("llmd-r-crash") == stored
        assert [e["kind"] for e in await journal.events("r-crash")] == ["run.accepted"]
