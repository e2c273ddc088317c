"""Which clusters this daemon acts for, and the tasks that act for them.

On SQLite (the default) one daemon owns its journal and acts for every configured cluster
for ever (epoch `core.ha.fencing.SINGLE_NODE_EPOCH`). On a PostgreSQL journal each cluster
has a lease (`supervision.ha.leadership.LeaseKeeper`); this daemon acts for a cluster only
while its keeper says so, and then with the keeper's epoch:

* A **tenure** is one epoch of acting. Everything that acts for a cluster (a run's
  driver, a campaign's task) is started in the tenure (`Roles.start`): it writes as the
  cluster's writer of THAT epoch (`adapters.journal.writer.writing_as`), so a task left
  over from an earlier tenure is refused by the database's fence even if the daemon
  leads again, and it is cancelled when the tenure ends (`Roles.end_tenure`).
  Cancelling a run's driver never touches its Slurm job (as at a daemon's stop): the
  next leader resumes it from the journal.
* `follow` is the per-cluster loop the daemon runs: when a tenure starts it calls
  `take_over` (load the cluster's runs and campaigns from the journal, start them), when
  it ends it cancels the tenure's tasks; while it does not lead, it calls `refresh`
  every `REFRESH_S` (the standby's views of the leader's runs, from the database).
* Requests that change a cluster's runs call `require` first: on a standby that is
  `errors.NotLeader`, naming the lease's holder; then they write as that cluster
  (``writing_as(partial(roles.writer, cluster))``): the fence refuses a row of one
  cluster written as another (`core.ha.fencing`), and a lease lost between `require` and
  the write refuses the write (nothing of it committed; the run stays as it was
  journaled, for the next leader's takeover).
* Writes of the team's rows (event deliveries, disabled destinations) state any cluster
  this daemon leads (`Roles.any_writer`): a daemon that leads none writes nothing.
"""

from __future__ import annotations

import functools
import math
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, Protocol, TypeVarTuple

import anyio
import anyio.abc
import structlog

from llmd_supervisor.adapters.journal.lease_pg import Held
from llmd_supervisor.adapters.journal.writer import writing_as
from llmd_supervisor.core.ha.fencing import SINGLE_NODE_EPOCH, Writer
from llmd_supervisor.errors import LeaseError, NotLeader, SupervisorError

__all__ = ["REFRESH_S", "Keeper", "Roles", "holder_name"]

log = structlog.get_logger("llmd_supervisor.leading")

REFRESH_S: Final = 2.0  # a standby's look at the journal for the leader's runs
_Ts = TypeVarTuple("_Ts")


def holder_name() -> str:
    """This daemon process's name in a lease: host, pid and a per-start nonce."""
    return f"{socket.gethostname() or 'localhost'}:{os.getpid()}:{secrets.token_hex(3)}"


class Keeper(Protocol):
    """A cluster's lease as `Roles` reads it (`supervision.ha.leadership.LeaseKeeper`)."""

    @property
    def epoch(self) -> int | None: ...

    def acting_time_left(self) -> float: ...

    async def wait_epoch_change(self, epoch: int | None) -> None: ...


class _SingleNode:
    """SQLite's 'lease': acting with epoch 0 for ever."""

    epoch: int | None = SINGLE_NODE_EPOCH

    def acting_time_left(self) -> float:
        return math.inf

    async def wait_epoch_change(self, epoch: int | None) -> None:
        await anyio.sleep_forever()


LeaderOf = Callable[[str], Awaitable[Held | None]]


class Roles:
    """This daemon's role for each configured cluster (see the module docstring)."""

    def __init__(
        self,
        holder: str,
        keepers: Mapping[str, Keeper],
        *,
        shared: bool,
        leader_of: LeaderOf | None = None,
    ) -> None:
        self.holder = holder
        self.shared = shared  # a PostgreSQL journal: leases, standbys
        self._keepers = dict(keepers)
        self._leader_of = leader_of
        self._tenures: dict[str, tuple[int, anyio.Event]] = {}  # epoch, set when it ends

    @classmethod
    def single_node(cls, clusters: list[str]) -> Roles:
        """Every cluster led, for ever (SQLite)."""
        always = _SingleNode()
        roles = cls(holder_name(), {c: always for c in clusters}, shared=False)
        for cluster in clusters:
            roles.begin_tenure(cluster, SINGLE_NODE_EPOCH)
        return roles

    # --- what the daemon is, now -------------------------------------------------------------

    def epoch(self, cluster: str) -> int | None:
        """The epoch this daemon acts with for `cluster` (None: it does not act for it)."""
        keeper = self._keepers.get(cluster)
        return None if keeper is None else keeper.epoch

    def acting(self, cluster: str) -> bool:
        return self.epoch(cluster) is not None

    def writer(self, cluster: str, epoch: int | None = None) -> Writer | None:
        """The writer of `cluster` now; with `epoch`, only while that tenure lasts."""
        now = self.epoch(cluster)
        if now is None or (epoch is not None and epoch != now):
            return None
        return Writer(cluster, now)

    def any_writer(self) -> Writer | None:
        """A writer of some cluster this daemon leads (writes not tied to one cluster)."""
        for cluster in self._keepers:
            writer = self.writer(cluster)
            if writer is not None:
                return writer
        return None

    def time_left(self, cluster: str) -> float:
        """Seconds this daemon may still act for `cluster` without a renewal (0: it does
        not act; inf: single node)."""
        keeper = self._keepers.get(cluster)
        return 0.0 if keeper is None else keeper.acting_time_left()

    async def require(self, cluster: str) -> None:
        """NotLeader unless this daemon acts for `cluster`."""
        if self.acting(cluster):
            return
        leader: str | None = None
        if self._leader_of is not None:
            try:
                held = await self._leader_of(cluster)
            except LeaseError as exc:
                log.warning("lease.holder_unknown", cluster=cluster, error=str(exc))
            else:
                leader = None if held is None else held.holder
        raise NotLeader(cluster, self.holder, leader)

    # --- tenures ----------------------------------------------------------------------------

    def start(
        self,
        tg: anyio.abc.TaskGroup,
        cluster: str,
        fn: Callable[[*_Ts], Awaitable[object]],
        *args: *_Ts,
    ) -> bool:
        """Start ``fn(*args)`` in `tg` for `cluster`'s current tenure; False (nothing
        started) when this daemon does not act for it."""
        tenure = self._tenures.get(cluster)
        if tenure is None or tenure[0] != self.epoch(cluster):
            return False
        epoch, ended = tenure
        tg.start_soon(self._in_tenure, cluster, epoch, ended, functools.partial(fn, *args))
        return True

    async def _in_tenure(
        self,
        cluster: str,
        epoch: int,
        ended: anyio.Event,
        fn: Callable[[], Awaitable[object]],
    ) -> None:
        with writing_as(functools.partial(self.writer, cluster, epoch)):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_when, ended, tg.cancel_scope)
                await fn()
                tg.cancel_scope.cancel()

    def begin_tenure(self, cluster: str, epoch: int) -> None:
        self._tenures[cluster] = (epoch, anyio.Event())

    def end_tenure(self, cluster: str) -> None:
        """Cancel every task of `cluster`'s tenure (their Slurm jobs are not touched)."""
        tenure = self._tenures.pop(cluster, None)
        if tenure is not None:
            tenure[1].set()

    async def follow(
        self,
        cluster: str,
        take_over: Callable[[str], Awaitable[None]],
        refresh: Callable[[str], Awaitable[None]],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Act for `cluster` while this daemon leads it, follow the leader otherwise; for
        ever (module docstring). Started once the cluster's runs are loaded (taken over
        or refreshed) the first time."""
        keeper = self._keepers[cluster]
        started = False
        while True:
            epoch = keeper.epoch
            if epoch is not None:
                self.begin_tenure(cluster, epoch)
                log.info("leading.acting", cluster=cluster, epoch=epoch, holder=self.holder)
                try:
                    await self._take_over(cluster, epoch, take_over)
                    if not started:
                        task_status.started()
                        started = True
                    await keeper.wait_epoch_change(epoch)
                finally:
                    self.end_tenure(cluster)
                log.info("leading.stopped_acting", cluster=cluster, epoch=epoch)
                continue
            try:
                await refresh(cluster)
            except SupervisorError as exc:  # the database is away: views go stale, no more
                log.warning("leading.refresh_failed", cluster=cluster, error=str(exc))
            if not started:
                task_status.started()
                started = True
            with anyio.move_on_after(REFRESH_S):
                await keeper.wait_epoch_change(None)

    async def _take_over(
        self, cluster: str, epoch: int, take_over: Callable[[str], Awaitable[None]]
    ) -> None:
        """`take_over` until it succeeds or the tenure ends (the journal may be briefly
        away just as this daemon takes over)."""
        while self.epoch(cluster) == epoch:
            try:
                await take_over(cluster)
                return
            except SupervisorError as exc:
                log.error(
                    "leading.take_over_failed",
                    cluster=cluster,
                    error=str(exc),
                    retry_in_s=REFRESH_S,
                )
                await anyio.sleep(REFRESH_S)


async def _cancel_when(ended: anyio.Event, task: anyio.CancelScope) -> None:
    """Cancel `task` once its tenure has `ended`."""
    await ended.wait()
    task.cancel()
