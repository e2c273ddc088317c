"""Two daemons as two login nodes on one PostgreSQL journal and the real dev cluster
(issue 3.7): one trial of each fault (tests/faults/takeover_trial.py says what a trial
does and measures). The repeated trials and their report: tests/faults/takeover_trials.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.devcluster import DevCluster
from tests.faults import takeover_trials
from tests.faults.ha_daemons import HaRig, ha_rig
from tests.faults.takeover_trial import FAULTS, run_trial
from tests.ha_net import missing_tools

TAKEOVER_GOAL_S = 30.0


@pytest.fixture
def rig(cluster: DevCluster) -> Iterator[HaRig]:
    missing = missing_tools()
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: deploy/install-dev.sh installs them")
    with ha_rig(cluster) as r:
        yield r


@pytest.mark.parametrize("fault", list(FAULTS))
def test_one_leader_one_job_and_the_run_verified_whatever_the_fault(
    rig: HaRig, tmp_path: Path, fault: str
) -> None:
    trial = run_trial(rig, fault, tmp_path)
    assert trial.two_leaders_s == 0, trial
    assert trial.duplicate_jobs == {}, trial
    assert sum(trial.jobs_per_name.values()) == 1, trial
    assert trial.stale_writes_committed == 0, trial
    assert trial.probes_committed == 0, trial
    assert trial.runs_lost == 0, trial
    if fault in ("sigkill", "sigstop", "cut", "graceful"):  # the leader was away
        assert trial.takeover_s is not None and trial.takeover_s <= TAKEOVER_GOAL_S, trial
        assert trial.probes_refused == 1, trial  # the fence is in place after the fault


def test_the_trials_script_writes_its_report(cluster: DevCluster, tmp_path: Path) -> None:
    """A smoke pass of tests/faults/takeover_trials.py (its own rig): one graceful trial."""
    assert (
        takeover_trials.main(["--trials", "1", "--faults", "graceful", "--results", str(tmp_path)])
        == 0
    )
    (report,) = tmp_path.glob("*-takeover-trials.md")
    assert "| leader stopped (SIGTERM) | 1 | 1 |" in report.read_text()
