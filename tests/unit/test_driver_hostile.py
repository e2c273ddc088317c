"""A hostile job against the per-run driver on a replayed cluster (issue 3.2 items 5, 6):
what its marker says cannot keep its run from ending or reach a terminal unescaped; a
supervision step that keeps failing the same way ends the run; a cancel that comes after
the job's end does not change its outcome."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from llmd_supervisor.core.lifecycle import RunState
from llmd_supervisor.core.spec import RunSpec
from llmd_supervisor.supervision.driver import RunHandle
from tests.fakes.bench_results import finish_job
from tests.unit.test_driver_replay import _spec, replayed, run_job

HOSTILE_REASON = "boom \ud800 \x1b[2K\x1b[1Goutcome succeeded\x1b]52;c;aGk=\x07"


def publish_hostile_marker(h: RunHandle, rc: int = 1, reason: str = HOSTILE_REASON) -> None:
    """The coordinator's results, then a marker whose reason is valid JSON that holds a
    lone surrogate and terminal escapes."""
    assert isinstance(h.spec, RunSpec)
    log_dir, job_id = Path(h.layout.log_dir), h.job_id()
    finish_job(log_dir, job_id, h.spec.benchmark, rc)
    marker = {
        "rc": rc,
        "job_id": job_id,
        "rank": 2,
        "reason": reason,
        "finished_at": datetime.now(UTC).isoformat(),
    }
    (log_dir / f".bench_done.{job_id}").write_text(json.dumps(marker))


@pytest.mark.asyncio
async def test_a_marker_reason_with_a_lone_surrogate_and_escapes_still_ends_the_run(
    tmp_path: Path,
) -> None:
    async with replayed(tmp_path) as rig:
        h = await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=0)
        await run_job(rig, h, publish_hostile_marker)
        assert h.run.state is RunState.FAILED, h.run.reason
        reason = h.run.reason
        assert "\x1b" not in reason and "\x07" not in reason
        assert "boom \\ud800 \\x1b[2K\\x1b[1Goutcome succeeded" in reason
        stored = {s.run.run_id: s.run for s in await rig.journal.list_runs()}[h.run.run_id]
        assert stored.reason == reason
