"""The daemon root: journal, one poller per cluster, every run's task, the control socket
and the dashboard.

`serve(config)` opens the journal, starts the pollers, resumes every run the journal
holds as in flight, starts listening, and reports readiness. SIGTERM/SIGINT stop it
promptly: every state is already journaled, so it cancels its tasks and closes the
journal. **It never cancels a Slurm job on the way out**; the next start resumes them.
"""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import socket
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import anyio
import anyio.abc
import structlog

from llmd_supervisor.adapters.control.requests import ResultsRequest
from llmd_supervisor.adapters.control.server import ControlServer
from llmd_supervisor.adapters.files import result_parser as result_parser
from llmd_supervisor.adapters.journal.campaign_store import CampaignStore
from llmd_supervisor.adapters.journal.lease_pg import PostgresLease
from llmd_supervisor.adapters.journal.store import Journal, open_journal
from llmd_supervisor.adapters.metrics import (
    InstrumentedRunner,
    LinkCounts,
    Metrics,
    RunSample,
    serve_metrics,
)
from llmd_supervisor.adapters.nodes import remote as remote
from llmd_supervisor.adapters.nodes.remote import NodeLink
from llmd_supervisor.adapters.outbox.sender import EventSender
from llmd_supervisor.adapters.outbox.store import Outbox
from llmd_supervisor.adapters.sdnotify import loop_monitor
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.events.routing import shown_proxy
from llmd_supervisor.core.ha.lease import STATEMENT_TIMEOUT_S
from llmd_supervisor.core.journal.url import PostgresJournal
from llmd_supervisor.core.protocol.runs import RunResults
from llmd_supervisor.core.render.script import bundled_node_sources
from llmd_supervisor.core.run.lifecycle import RunState
from llmd_supervisor.errors import SupervisorError
from llmd_supervisor.supervision.campaign.api import CampaignOps
from llmd_supervisor.supervision.campaign.runner import Campaigns
from llmd_supervisor.supervision.cluster.clusters import Cluster, build_cluster
from llmd_supervisor.supervision.control.api import ControlApi
from llmd_supervisor.supervision.control.service import SYSTEM_PEER, RunsService
from llmd_supervisor.supervision.events.api import EventOps
from llmd_supervisor.supervision.ha.leadership import LeaseKeeper
from llmd_supervisor.supervision.ha.leading import REFRESH_S, Roles, holder_name
from llmd_supervisor.supervision.run.driver import Hooks, RunHandle
from llmd_supervisor.supervision.run.supervisor import Supervisor
from llmd_supervisor.supervision.web.dashboard import serve_dashboard

log = structlog.get_logger("llmd_supervisor.supervision.daemon")

Notify = Callable[[str], None]


def _no_notify(_: str) -> None:
    return None


class _RunOwners:
    """The supervisor's runs as the events ops see them (`events_api.RunOwners`)."""

    def __init__(self, supervisor: Supervisor, runs: RunsService[RunHandle]) -> None:
        self._sup = supervisor
        self._runs = runs

    def owner_of(self, run_id: str) -> int | None:
        facts = self._runs.facts(SYSTEM_PEER, run_id)
        return None if facts is None else facts.owner_uid

    def run_id_of(self, ref: str) -> str | None:
        h = self._sup.get(ref)
        return None if h is None else h.run.run_id


def _control_api(
    supervisor: Supervisor,
    runs: RunsService[RunHandle],
    campaigns: Campaigns,
    outbox: Outbox,
    sender: EventSender | None,
) -> ControlApi[RunHandle]:
    """The control API over the runs' service, the campaigns and the outbox."""

    async def results_of(run_id: str) -> RunResults | None:
        if runs.facts(SYSTEM_PEER, run_id) is None:
            return None
        return await runs.results(SYSTEM_PEER, ResultsRequest(run_id))

    ops = CampaignOps(
        campaigns,
        clock=supervisor.clock,
        run_results=results_of,
    )
    events = EventOps(
        outbox,
        _RunOwners(supervisor, runs),
        admin_group=supervisor.config.admin_group,
        clock=supervisor.clock,
        wake=sender.wake if sender is not None else lambda: None,
        events=supervisor.config.events,
        host=socket.gethostname() or "localhost",
    )
    return ControlApi(supervisor, campaigns=ops, events=events, runs=runs)


def lock_state_dir(state_dir: Path) -> int:
    """Hold an exclusive flock on the state directory for the process's lifetime.

    Two daemons on one journal would both supervise (and reconcile) the same runs.
    """
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    fd = os.open(state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SupervisorError(
            f"Another llmd-supervisor daemon already uses the state directory {state_dir}; "
            "stop it first or give this one its own daemon.state_dir."
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


async def serve(
    config: Config,
    *,
    notify: Notify = _no_notify,
    watchdog_s: float | None = None,
    hooks: Hooks | None = None,
) -> None:
    """Run until SIGTERM/SIGINT (or cancellation); see the module docstring.

    `notify` gets the sd_notify messages: ``READY=1`` once the journal is open, every
    in-flight run is re-attached (its task started) and the control socket, the dashboard
    (unless ``dashboard.enabled = false``) and the metrics endpoint (if configured)
    listen; ``STATUS=`` whenever the run counts change;
    ``STOPPING=1`` on SIGTERM/SIGINT; ``WATCHDOG=1`` every `watchdog_s`/2 from the event
    loop when `watchdog_s` is set. `hooks` are the supervisor's test seams.

    It sets the process's umask to 077 first: what the daemon writes (journal, archives,
    log copies) is its user's alone, whatever umask the shell or unit that started it
    had; what others may read they read through the control socket. The umask it found is
    restored when it returns (for a caller that goes on: a test).
    """
    found = os.umask(0o077)
    try:
        lock_fd = lock_state_dir(config.state_dir)
        try:
            await _serve(config, notify, watchdog_s, hooks)
        finally:
            os.close(lock_fd)
    finally:
        os.umask(found)


async def _serve(
    config: Config, notify: Notify, watchdog_s: float | None, hooks: Hooks | None
) -> None:
    metrics = Metrics()
    login_links: list[NodeLink] = []
    leases: list[PostgresLease] = []
    clusters: dict[str, Cluster] = {}
    journal = await open_journal(config.journal, config.journal_path)
    try:
        async with result_parser.kept_children(), anyio.create_task_group() as tg:
            await tg.start(loop_monitor, notify, watchdog_s, metrics.record_lag)
            for cluster_config in config.clusters:
                wrap = functools.partial(
                    InstrumentedRunner, metrics=metrics, cluster=cluster_config.name
                )
                cluster = build_cluster(
                    cluster_config, config, wrap, login_links, runner=(hooks or Hooks()).runner
                )
                clusters[cluster.name] = cluster
                await tg.start(cluster.poller.run)
            # The node files every batch script carries, prepared once before any submission
            # (ten submissions at once would otherwise each prepare them, ~0.5 s of CPU)
            await anyio.to_thread.run_sync(bundled_node_sources)
            roles = await _roles(config, journal, tg, leases)
            supervisor = Supervisor(config, journal, clusters, tg, hooks=hooks, roles=roles)
            runs = RunsService(supervisor, clock=supervisor.clock)
            campaigns = Campaigns(supervisor, CampaignStore(journal), runs=runs, tg=tg)
            resumed = 0
            if roles.shared:  # each cluster's runs start when this daemon leads it
                tg.start_soon(_follow_elsewhere, supervisor)
                for name in clusters:
                    await tg.start(
                        roles.follow,
                        name,
                        functools.partial(_take_over, supervisor, campaigns),
                        supervisor.refresh,
                    )
            else:
                resumed = await supervisor.resume_all()
                await campaigns.resume_all()  # after the runs: a campaign follows its runs
            outbox = Outbox(journal)
            sender = await _start_sender(config, outbox, supervisor, tg)
            if sender is not None:
                metrics.attach_deliveries(sender.counts)
            metrics.attach(lambda: run_samples(supervisor.handles), link_counts)
            if config.metrics_listen is not None:
                await tg.start(serve_metrics, metrics, config.metrics_listen)
            if config.socket_group is None and config.socket_mode & 0o070:
                log.warning(  # group rights for the primary group of whoever started us
                    "control.socket_group_implicit",
                    socket=str(config.socket_path),
                    mode=f"{config.socket_mode:04o}",
                    gid=os.getgid(),
                    hint="name the group that may connect (daemon.socket_group) or drop "
                    "daemon.socket_mode (0600 without a group)",
                )
            api = _control_api(supervisor, runs, campaigns, outbox, sender)
            server = ControlServer(
                config.socket_path, api, mode=config.socket_mode, group=config.socket_group
            )
            await tg.start(server.serve)
            if config.dashboard.enabled:
                await tg.start(
                    functools.partial(serve_dashboard, api, config, clock=supervisor.clock)
                )
            log.info("daemon.ready", socket=str(config.socket_path), resumed=resumed)
            notify(f"READY=1\nSTATUS={status_line(supervisor.handles)}")
            tg.start_soon(_report_status, supervisor, metrics, notify)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("daemon.stopping", signal=signal.Signals(signum).name)
                    notify("STOPPING=1\nSTATUS=stopping; Slurm jobs keep running")
                    break
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            for cluster in clusters.values():
                await cluster.files.aclose()
            for link in login_links:
                await link.aclose()
            for lease in leases:
                await lease.aclose()
            await journal.aclose()
        log.info("daemon.stopped")


async def _start_sender(
    config: Config, outbox: Outbox, supervisor: Supervisor, tg: anyio.abc.TaskGroup
) -> EventSender | None:
    """Deliver the outbox's events (none configured: nothing to send, no task)."""
    destinations = config.events.destinations
    if not destinations:
        return None
    roles = supervisor.roles
    sender = EventSender(
        outbox,
        config.events,
        clock=supervisor.clock,
        may_send=lambda: roles.any_writer() is not None,
    )
    await tg.start(sender.run)
    proxy = config.events.proxy
    log.info(
        "events.sender_started",
        destinations=[d.name for d in destinations],
        proxy=None if proxy is None else shown_proxy(proxy),  # None: the environment's
        proxy_env=sorted(k for k in os.environ if k.lower().endswith("_proxy")),
    )
    return sender


async def _roles(
    config: Config, journal: Journal, tg: anyio.abc.TaskGroup, leases: list[PostgresLease]
) -> Roles:
    """Every cluster led by this daemon (SQLite), or each cluster's lease kept on the
    shared journal's database, started (PostgreSQL; `supervision.ha.leading`); the leases'
    connections are added to `leases` (the caller closes them)."""
    names = [c.name for c in config.clusters]
    if not isinstance(config.journal, PostgresJournal):
        return Roles.single_node(names)
    holder = holder_name()
    by_cluster = {name: PostgresLease(config.journal) for name in names}
    leases.extend(by_cluster.values())
    keepers = {name: LeaseKeeper(name, holder, lease) for name, lease in by_cluster.items()}
    roles = Roles(
        holder, keepers, shared=True, leader_of=lambda cluster: by_cluster[cluster].holder(cluster)
    )
    journal.set_default_writer(roles.any_writer)
    for keeper in keepers.values():
        await tg.start(keeper.run)
    with anyio.move_on_after(2 * STATEMENT_TIMEOUT_S):  # ready knowing what it is, if it can
        for keeper in keepers.values():
            await keeper.wait_first_answer()
    log.info("leading.candidate", holder=holder, clusters=names, journal=journal.location)
    return roles


async def _follow_elsewhere(supervisor: Supervisor) -> None:
    """The team's runs on clusters this daemon does not have, kept up to date from the
    shared journal (`list` shows them; `list --cluster` picks one)."""
    while True:
        try:
            await supervisor.refresh_elsewhere()
        except SupervisorError as exc:
            log.warning("leading.refresh_failed", cluster=None, error=str(exc))
        await anyio.sleep(REFRESH_S)


async def _take_over(supervisor: Supervisor, campaigns: Campaigns, cluster: str) -> None:
    await supervisor.take_over(cluster)
    await campaigns.resume_all(cluster)  # after the runs: a campaign follows its runs


STATUS_REFRESH_S = 2.0


def status_line(handles: Mapping[str, RunHandle]) -> str:
    """The one-line STATUS= text: runs in flight by state, and how many are finished."""
    return _status_text(Counter(h.run.state for h in list(handles.values())))


class _StatusCounts:
    """The runs by state, kept from the handles that changed (`Supervisor.take_changed`):
    a standby of a team journal knows 100,000 runs, and counting them all every
    STATUS_REFRESH_S took a few % of a core."""

    def __init__(self, handles: Mapping[str, RunHandle]) -> None:
        self._states = {run_id: h.run.state for run_id, h in list(handles.items())}
        self._counts = Counter(self._states.values())

    def update(self, changed: list[RunHandle]) -> str:
        """The STATUS= text after these handles changed."""
        for h in changed:
            before = self._states.get(h.run.run_id)
            if before is not None:
                self._counts[before] -= 1
            self._states[h.run.run_id] = h.run.state
            self._counts[h.run.state] += 1
        return _status_text(self._counts)


def _status_text(counts: Counter[RunState]) -> str:
    counts = +counts  # without the states no run is in any more
    order = list(RunState)
    active = sorted((s for s in counts if not s.is_final), key=order.index)
    in_flight = sum(counts[s] for s in active)
    finished = sum(n for s, n in counts.items() if s.is_final)
    detail = ", ".join(f"{counts[s]} {s.value}" for s in active)
    shown = f" ({detail})" if detail else ""
    return f"{in_flight} runs in flight{shown}; {finished} finished"


async def _report_status(supervisor: Supervisor, metrics: Metrics, notify: Notify) -> None:
    """Send STATUS= whenever the counts change (checked every STATUS_REFRESH_S, when a
    run changed: a standby of a team journal knows 100,000 runs that do not)."""
    counts = _StatusCounts(supervisor.handles)  # the first look's changes: every run
    last = status_line(supervisor.handles)
    while True:
        await anyio.sleep(STATUS_REFRESH_S)
        changed = supervisor.take_changed()
        if not changed:
            continue
        metrics.observe_verdicts(run_samples({h.run.run_id: h for h in changed}))
        line = counts.update(changed)
        if line != last:
            notify(f"STATUS={line}")
            last = line


def run_samples(handles: Mapping[str, RunHandle]) -> list[RunSample]:
    """What the metrics read of every run, now."""
    return [
        RunSample(
            run_id=h.run.run_id,
            cluster=h.meta.cluster,
            state=h.run.state,
            outcome=h.run.outcome,
            transitions=h.run.transitions,
            tail_bytes=h.tail_bytes,
            attempts=tuple(h.history),
        )
        for h in list(handles.values())
    ]


def link_counts() -> LinkCounts:
    """The process-wide SSH link counters, now."""
    s = remote.LINK_STATS
    return LinkCounts(
        open=remote.open_connections(),
        connects=s.connects,
        reconnects=s.reconnects,
        connect_failures=s.connect_failures,
    )
