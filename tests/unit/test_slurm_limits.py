"""A submit limit from sacctmgr's answers (core.slurm.limits), captured on the dev cluster
(tests/data/slurm-qos-refusal/SOURCE.md) and varied."""

from __future__ import annotations

import pytest

from llmd_supervisor.core.slurm.limits import submit_limit

# What 22.05 and 24.11 print on the dev cluster: one association, QOS normal, no limits.
ASSOC = "normal||\n"
QOS = "normal|\n"


@pytest.mark.parametrize(
    ("assoc", "qos", "limit"),
    [
        (ASSOC, QOS, None),  # captured: no limit anywhere
        (ASSOC, "normal|2\n", 2),  # the default QOS's MaxSubmitPU
        ("normal||5\n", "normal|\n", 5),  # the association's own MaxSubmit
        ("normal||5\n", "normal|2\n", 2),  # the lower counts
        ("normal,big|big|\n", "normal|2\nbig|30\n", 30),  # the default QOS, not the others
        ("normal,big||\n", "normal|2\nbig|30\n", 2),  # no default: the lowest it may use
        ("normal||\nnormal||7\n", QOS, 7),  # several associations (accounts, partitions)
        ("", QOS, None),  # no association (accounting without one for the user)
        ("garbage\n", "also|not|a|number\n", None),
        ("normal||x\n", "normal|-1\n", None),
    ],
)
def test_the_submit_limit_is_the_lowest_that_applies(
    assoc: str, qos: str, limit: int | None
) -> None:
    assert submit_limit(assoc, qos) == limit
