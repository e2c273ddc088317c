"""Whether the user's cancel reached its job (`supervision.run.cancel.reached`): only then may
the verdict call the end `cancelled` (issue 3.2 item 5)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from llmd_supervisor.core.run.lifecycle import new_run
from llmd_supervisor.supervision.run.cancel import reached
from llmd_supervisor.supervision.run.records import KILL_EVENT, TERM_EVENT

RUN = new_run("r1", "llmd-r1", datetime(2026, 1, 1, tzinfo=UTC))
TERM = {"kind": TERM_EVENT, "slurm_job_id": "42", "grace_s": 5}


@pytest.mark.parametrize(
    ("events", "cancel_requested", "expected"),
    [
        ([], True, False),  # asked for once the job had left the queue: nothing was sent
        ([{**TERM, "delivered": True, "for": "cancel"}], True, True),
        ([{**TERM, "delivered": True, "for": "cancel"}], False, False),
        ([TERM], True, True),  # journaled before `delivered` existed
        ([{**TERM, "delivered": False, "for": "cancel"}], True, False),  # already completed
        (
            [
                {**TERM, "delivered": False, "for": "cancel"},
                {"kind": KILL_EVENT, "slurm_job_id": "42", "for": "cancel"},
            ],
            True,
            True,
        ),
        ([{**TERM, "delivered": True, "for": "hang"}], True, False),  # ended for a hang
        ([{**TERM, "slurm_job_id": "41", "delivered": True}], True, False),  # an earlier job
        ([{"kind": "node.unreachable", "slurm_job_id": "42"}], True, False),
    ],
)
def test_a_cancel_reached_its_job_only_if_a_signal_was_delivered_to_it(
    events: list[dict[str, object]], cancel_requested: bool, expected: bool
) -> None:
    run = dataclasses.replace(RUN, cancel_requested=cancel_requested)
    assert reached(run, events, "42") is expected
