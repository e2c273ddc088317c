"""Repeated takeover trials on the real dev cluster and their report (issue 3.7):

    deploy/devcluster/devcluster up --slurm 24.11
    .venv/bin/python -m tests.faults.takeover_trials --trials 10 [--faults sigkill,cut]

runs N trials of each fault (tests/faults/takeover_trial.py) on one two-login rig and
writes tests/perf/results/<date>-takeover-trials.md (and .json). A trial that fails
(the run not verified) is recorded as a run lost, with its error, and the trials go on.
"""

from __future__ import annotations

import argparse
import tempfile
import traceback
from pathlib import Path

from tests.devcluster import DevCluster
from tests.faults.ha_daemons import ha_rig
from tests.faults.ha_trials import RESULTS, Trial, write_report
from tests.faults.takeover_trial import FAULTS, run_trial
from tests.perf.common import say

NOTES = """Two daemons as two login nodes (network namespaces llmd-login1/2 on 10.78.0.0/24),
one PostgreSQL journal (TLS, synchronous_commit on) on 10.78.0.1, the dev cluster (Slurm
{version}), one demo run per trial submitted to the leader (login1) and the fault injected
once it runs; the standby's `wait` must return `succeeded`. Takeover: from the fault to
the next `lease.acquired` (goal <= 30 s; a lease lasts 15 s, a standby tries every 2 s).
Stale writes committed: run transitions a daemon journaled outside its own tenures."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--results", type=Path, default=RESULTS, help="the report's directory")
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    cluster = DevCluster.current()
    trials: list[Trial] = []
    with ha_rig(cluster) as rig:
        for n in range(args.trials):
            for fault in faults:
                root = Path(tempfile.mkdtemp(prefix=f"llmd-trial-{fault}-"))
                try:
                    trial = run_trial(rig, fault, root, port=8600 + 10 * (n % 20))
                except AssertionError as exc:
                    traceback.print_exc()
                    trial = Trial(FAULTS[fault], None, 0.0, runs_lost=1)
                    say(f"trial {n + 1} {fault}: FAILED {str(exc)[:300]}")
                trials.append(trial)
                say(f"trial {n + 1} {fault}: {trial}")
    path = write_report(
        trials, directory=args.results, notes=NOTES.format(version=cluster.slurm_version)
    )
    say(f"report: {path}")
    return 0 if all(t.runs_lost == 0 and not t.duplicate_jobs for t in trials) else 1


if __name__ == "__main__":
    raise SystemExit(main())
