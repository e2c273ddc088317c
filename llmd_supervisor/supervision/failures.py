"""When a run's driver stops retrying a step that keeps failing the same way.

The driver (`driver.Supervisor._supervise`) re-enters a run's loop after any error, with a
backoff, from the journaled record. An error that the same data and the same code raise
every time (a bug a job's hostile input reaches; a journal that refuses a value) would be
retried every minute forever, and every `wait` on the run would hang with it. So after
`SAME_FAILURES_MAX` failures in a row that are alike (`SameFailures`) the run ends
`unverified` with the error as its reason (`give_up`), except:

- while submitting: sbatch may be in flight, so a job may exist under the run's name;
  giving it up would leave that job unsupervised (the lifecycle refuses it too);
- for errors of an outside system the daemon has to wait for (`WAITED_FOR`: Slurm's
  commands, SSH to the nodes), whose steps bound their own retries.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

import structlog

from llmd_supervisor.core.jobtext import job_text
from llmd_supervisor.core.lifecycle import RunState, SupervisionFailed
from llmd_supervisor.core.verdict import Outcome
from llmd_supervisor.errors import RemoteError, SlurmCommandError
from llmd_supervisor.supervision.steps import RECEIPT_EVENT

if TYPE_CHECKING:
    from llmd_supervisor.supervision.driver import RunHandle, Supervisor

log = structlog.get_logger("llmd_supervisor.runs")

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


async def give_up(sup: Supervisor, h: RunHandle, exc: Exception, count: int) -> bool:
    """End the run `unverified` with `exc` as its reason (`SupervisionFailed`), its
    receipt journaled first; whether that was done (it needs the journal, which may be
    what fails: then the driver goes on retrying). A job still queued is left as it is:
    the error is the daemon's, not the job's."""
    run = h.run
    error = job_text(f"{type(exc).__name__}: {exc}", ERROR_SHOWN)
    reason = f"supervision failed {count} times in a row in state {run.state}: {error}"
    if run.slurm_job_id is not None and run.state in (RunState.PENDING, RunState.RUNNING):
        reason += f"; Slurm job {run.slurm_job_id} is left as it is, no longer watched"
    receipt: dict[str, object] = {
        "outcome": Outcome.UNVERIFIED.value,
        "reason": reason,
        "attempt": run.attempt,
        "slurm_job_name": run.slurm_job_name,
        "supervision_failed": {"state": run.state.value, "error": error, "failures": count},
        "attempts": h.history,
    }
    try:
        await sup.journal.add_event(run.run_id, RECEIPT_EVENT, {"receipt": receipt}, sup.clock())
        await sup.apply(h, SupervisionFailed(reason))
    except Exception as again:  # the journal (or a bug) again: the driver keeps retrying
        log.error("run.give_up_failed", error=str(first_leaf(again)), reason=reason)
        return False
    log.error("run.given_up", reason=reason, failures=count)
    if run.slurm_job_id is not None and h.configured is not None:
        h.cluster.poller.untrack(run.slurm_job_id)
    return True
