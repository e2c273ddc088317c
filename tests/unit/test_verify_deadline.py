"""`verify_job` keeps to its evidence deadline even when a Slurm command never answers
(munge refusing, slurmctld unreachable): the round is cut and recorded as failed queries,
and the reason names the commands that failed."""

from __future__ import annotations

import anyio
import pytest

from llmd_supervisor.core.verdict.decide import Outcome, SlurmQuery, Source
from llmd_supervisor.supervision.run.verify_job import QUERY_GRACE_S, verify_job


class Hung:
    """sacct and scontrol that never answer."""

    async def query(self, source: Source, job_id: str) -> SlurmQuery:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def no_marker() -> bytes | None:
    return None


@pytest.mark.asyncio
async def test_a_command_that_never_answers_ends_at_the_deadline_naming_it() -> None:
    with anyio.fail_after(10 + QUERY_GRACE_S):  # the commands would hang forever
        got = await verify_job(Hung(), "42", marker_bytes=no_marker, evidence_timeout=0.5)
    assert got.verdict.outcome is Outcome.UNVERIFIED
    assert "every Slurm query failed (sacct failed: no answer within" in got.verdict.reason
    assert "scontrol failed: no answer within" in got.verdict.reason
