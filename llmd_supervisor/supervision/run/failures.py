"""When a run's driver stops retrying a step that keeps failing the same way.

The driver (`driver.Supervisor._supervise`) re-enters a run's loop after any error, with a
backoff, from the journaled record. An error that the same data and the same code raise
every time (a bug a job's hostile input reaches; a journal that refuses a value) would be
retried every minute forever, and every `wait` on the run would hang with it. So after
`SAME_FAILURES_MAX` failures in a row that are alike (`SameFailures`) the run ends
`unverified` with the error as its reason (`given_up`: its receipt and the event that the
driver journals and applies), except:

- while submitting: sbatch may be in flight, so a job may exist under the run's name;
  giving it up would leave that job unsupervised (the lifecycle refuses it too);
- for errors of an outside system the daemon has to wait for (`WAITED_FOR`: Slurm's
  commands, SSH to the nodes), whose steps bound their own retries.
"""

from __future__ import annotations

import re
from typing import Final

from llmd_supervisor.core.run.jobtext import job_text
from llmd_supervisor.core.run.lifecycle import RunState, SupervisionFailed
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.errors import RemoteError, SlurmCommandError
from llmd_supervisor.supervision.run.context import RunContext
from llmd_supervisor.supervision.run.records import GivenUpReceipt

# With the driver's backoff (1 s doubling to 60 s) the eighth failure comes about 2 minutes
# after the first (plus the steps' own time): long enough for a passing cause (a race with
# a change of the run, a file being replaced, a busy journal) to clear, short enough that
# a `wait` on a run that hits the same bug every time returns within minutes.
SAME_FAILURES_MAX: Final = 8
WAITED_FOR: Final = (SlurmCommandError, RemoteError)
ERROR_SHOWN: Final = 500  # characters of the error in the run's reason
_DIGITS = re.compile(r"[0-9]+")


class SameFailures:
    """How many times in a row a run's step failed the same way: the same state, error
    type and message (its numbers masked, so that a count or a duration in it does not
    make each failure look new)."""

    def __init__(self) -> None:
        self._last: tuple[RunState, str, str] | None = None
        self._count = 0

    def add(self, state: RunState, exc: BaseException) -> int:
        """Count one failure; return how many in a row were like it."""
        key = (state, type(exc).__qualname__, _DIGITS.sub("#", str(exc)))
        self._count = self._count + 1 if key == self._last else 1
        self._last = key
        return self._count

    def clear(self) -> None:
        """A step completed."""
        self._last, self._count = None, 0


def first_leaf(exc: Exception) -> Exception:
    """The first error inside (task groups wrap what failed in an ExceptionGroup)."""
    while isinstance(exc, ExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def gives_up(state: RunState, exc: Exception, count: int) -> bool:
    """Whether `count` failures in a row like `exc` in `state` end the run."""
    return (
        count >= SAME_FAILURES_MAX
        and state is not RunState.SUBMITTING
        and not isinstance(exc, WAITED_FOR)
    )


def given_up(
    ctx: RunContext, exc: Exception, count: int
) -> tuple[GivenUpReceipt, SupervisionFailed]:
    """The receipt (to journal first) and the event that end the run `unverified` with
    `exc` as its reason. A job still queued is left as it is: the error is the daemon's,
    not the job's."""
    run = ctx.run
    error = job_text(f"{type(exc).__name__}: {exc}", ERROR_SHOWN)
    reason = f"supervision failed {count} times in a row in state {run.state}: {error}"
    if run.slurm_job_id is not None and run.state in (RunState.PENDING, RunState.RUNNING):
        reason += f"; Slurm job {run.slurm_job_id} is left as it is, no longer watched"
    receipt: GivenUpReceipt = {
        "outcome": Outcome.UNVERIFIED.value,
        "reason": reason,
        "attempt": run.attempt,
        "slurm_job_name": run.slurm_job_name,
        "supervision_failed": {"state": run.state.value, "error": error, "failures": count},
        "attempts": list(ctx.history),
    }
    return receipt, SupervisionFailed(reason)
