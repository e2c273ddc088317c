"""What a waiting client (`wait`, `submit --wait`, `adopt --wait`) does when it is told to
stop, by Ctrl-C or by SIGTERM (`timeout`, a CI runner, systemd).

The first SIGINT/SIGTERM asks the daemon to cancel the run (unless `--detach`: then the
client just stops waiting, exit 0) and keeps waiting for the run's end, to report its
outcome. It never waits forever for it: a second signal, or no end within the run's grace
plus `--cancel-margin-s` after the first signal, stops waiting at once with one line on
stderr and exit status `EXIT_STOPPED`; the daemon goes on with the run and its cancel.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import anyio.abc

from llmd_supervisor.adapters.control.client import Reconnect, call_retrying
from llmd_supervisor.core.spec.foreign import DEFAULT_GRACE_S
from llmd_supervisor.errors import SupervisorError

__all__ = [
    "DEFAULT_CANCEL_MARGIN_S",
    "EXIT_STOPPED",
    "WAIT_EXIT_STATUS",
    "Interrupts",
]

EXIT_STOPPED: Final = 5
# Past the run's grace: the plain scancel (grace + 5 s), the job's end seen by the poller,
# the log copies drained (10 s) and a verdict from two agreeing Slurm reads take well under
# two minutes. A verification longer than that (accounting down: up to the daemon's
# verify_timeout_s) is better followed by a new `wait` than by a client that cannot stop.
DEFAULT_CANCEL_MARGIN_S: Final = 120.0

WAIT_EXIT_STATUS: Final = f"""\
exit status, when it waits for the outcome (wait, --wait, --follow):
  0   succeeded (or --detach: stopped waiting at the first signal, the run goes on)
  10  failed      11  cancelled      12  timed_out
  13  node_failed 14  out_of_memory  15  unverified   (as `llmd-supervisor verify`)
  2   an error reply (unknown run, bad spec, ...)
  3   the daemon cannot be reached (after --reconnect-s), or answers nonsense
  {EXIT_STOPPED}   stopped waiting after asking for the run's cancel: a second SIGINT/SIGTERM,
      or the run did not end within its grace + --cancel-margin-s (the daemon goes on)

The first SIGINT/SIGTERM asks for the run's cancel and waits for its end; a second one
stops waiting at once.
"""


@dataclass
class Interrupts:
    """The signals a waiting client got, and the cancel they asked for (see the module
    docstring). `watch` runs in the client's task group and cancels it to stop waiting;
    `stopped` then says why."""

    run: str
    socket_path: Path
    reconnect: Reconnect
    detach: bool
    margin_s: float = DEFAULT_CANCEL_MARGIN_S
    grace_s: int | None = None  # the run's, once the daemon said it (`saw`)
    cancel_sent: bool = False
    stopped: str | None = None  # "detach", "again" or "deadline"

    def saw(self, item: object) -> None:
        """Note the run's grace from a summary the daemon sent."""
        grace = item.get("sigterm_grace_s") if isinstance(item, dict) else None
        if isinstance(grace, int) and not isinstance(grace, bool) and grace >= 0:
            self.grace_s = grace

    @property
    def limit_s(self) -> float:
        """How long after the first signal the client waits for the run's end."""
        grace = DEFAULT_GRACE_S if self.grace_s is None else self.grace_s
        return grace + self.margin_s

    async def watch(self, tg: anyio.abc.TaskGroup) -> None:
        """Forward the first signal as a cancel (retried across a daemon restart); stop
        waiting at the second one or at the deadline."""
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if self.detach or self.cancel_sent:
                    self._stop(tg, "again" if self.cancel_sent else "detach")
                    return
                self.cancel_sent = True
                print(
                    f"\nllmd-supervisor: cancelling run {self.run} (waiting for its end; "
                    "again: stop waiting at once)",
                    file=sys.stderr,
                )
                tg.start_soon(self._send_cancel)
                tg.start_soon(self._deadline, tg)

    def ended(self) -> tuple[int, str]:
        """The exit status and the line to print when waiting stopped before the end."""
        run = self.run
        if self.stopped == "again":
            return EXIT_STOPPED, (
                f"llmd-supervisor: stopped waiting for run {run} at a second signal; its "
                f"cancel was asked for and the daemon goes on with it (llmd-supervisor "
                f"status {run})"
            )
        if self.stopped == "deadline":
            grace = DEFAULT_GRACE_S if self.grace_s is None else self.grace_s
            return EXIT_STOPPED, (
                f"llmd-supervisor: run {run} did not end within {self.limit_s:g} s of its "
                f"cancel (its grace {grace} s + {self.margin_s:g} s); stopped waiting, the "
                f"daemon goes on with it (llmd-supervisor wait {run})"
            )
        what = "its cancel was asked for" if self.cancel_sent else "it goes on"
        return 0, f"llmd-supervisor: stopped waiting for run {run}; {what}"

    def _stop(self, tg: anyio.abc.TaskGroup, why: str) -> None:
        if self.stopped is None:
            self.stopped = why
        tg.cancel_scope.cancel()

    async def _send_cancel(self) -> None:
        try:
            reply = await call_retrying(
                self.socket_path, "cancel", {"run": self.run}, reconnect=self.reconnect, resend=True
            )
        except SupervisorError as exc:
            print(f"llmd-supervisor: {exc}", file=sys.stderr)
            return
        self.saw(reply)

    async def _deadline(self, tg: anyio.abc.TaskGroup) -> None:
        """Stop waiting once `limit_s` has passed since the signal; the run's grace may be
        learnt meanwhile (from the cancel's reply), which moves the end."""
        start = anyio.current_time()
        end = start + self.limit_s
        while anyio.current_time() < end:
            await anyio.sleep(end - anyio.current_time())
            end = start + self.limit_s
        self._stop(tg, "deadline")
