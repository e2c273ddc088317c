"""The daemon root: journal, one poller per cluster, every run's task, the control socket.

`serve(config)` opens the journal, starts the pollers, resumes every run the journal
holds as in flight, starts listening, and reports readiness. SIGTERM/SIGINT stop it
promptly: every state is already journaled, so it cancels its tasks and closes the
journal. **It never cancels a Slurm job on the way out**; the next start resumes them.
"""

from __future__ import annotations

import fcntl
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import anyio
import anyio.abc
import structlog

from llmd_supervisor.adapters import archive
from llmd_supervisor.adapters.control import ControlServer, Handler, Peer, Request, Send, may_access
from llmd_supervisor.adapters.journal import Journal
from llmd_supervisor.adapters.metrics import InstrumentedRunner, Metrics, serve_metrics
from llmd_supervisor.adapters.remote import NodeLink
from llmd_supervisor.adapters.sdnotify import loop_monitor
from llmd_supervisor.adapters.slurm import CommandRunner, LocalRunner, SlurmClient
from llmd_supervisor.adapters.slurm_ssh import SshRunner, ssh_settings
from llmd_supervisor.core.config import ClusterConfig, Config
from llmd_supervisor.core.lifecycle import RunState
from llmd_supervisor.core.render import render_sbatch
from llmd_supervisor.core.spec import load_spec
from llmd_supervisor.errors import ControlError, IllegalTransition, SpecError, SupervisorError
from llmd_supervisor.supervision.poller import Poller
from llmd_supervisor.supervision.runs import RunHandle, Supervisor, run_summary
from llmd_supervisor.supervision.verify import utcnow

log = structlog.get_logger("llmd_supervisor.supervision.daemon")

Notify = Callable[[str], None]


def _no_notify(_: str) -> None:
    return None


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
    config: Config, *, notify: Notify = _no_notify, watchdog_s: float | None = None
) -> None:
    """Run until SIGTERM/SIGINT (or cancellation); see the module docstring.

    `notify` gets the sd_notify messages: ``READY=1`` once the journal is open, every
    in-flight run is re-attached (its task started) and the control socket (and the
    metrics endpoint, if configured) listens; ``STATUS=`` whenever the run counts change;
    ``STOPPING=1`` on SIGTERM/SIGINT; ``WATCHDOG=1`` every `watchdog_s`/2 from the event
    loop when `watchdog_s` is set.
    """
    lock_fd = lock_state_dir(config.state_dir)
    try:
        await _serve(config, notify, watchdog_s)
    finally:
        os.close(lock_fd)


def _runner(
    cluster: ClusterConfig, config: Config, metrics: Metrics, links: list[NodeLink]
) -> CommandRunner:
    """Where this cluster's Slurm commands run: here, or over SSH on its login host."""
    env = {"SLURM_CONF": cluster.slurm_conf} if cluster.slurm_conf else {}
    runner: CommandRunner
    if cluster.login_host is not None:
        link = NodeLink(cluster.login_host, ssh_settings(config.ssh))
        links.append(link)
        runner = SshRunner(link, env)
    else:
        runner = LocalRunner(env)
    return InstrumentedRunner(runner, metrics, cluster.name)


async def _serve(config: Config, notify: Notify, watchdog_s: float | None) -> None:
    metrics = Metrics()
    login_links: list[NodeLink] = []
    journal = await Journal.open(config.journal_path)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(loop_monitor, notify, watchdog_s, metrics.record_lag)
            pollers: dict[str, Poller] = {}
            clients: dict[str, SlurmClient] = {}
            for cluster in config.clusters:
                runner = _runner(cluster, config, metrics, login_links)
                clients[cluster.name] = SlurmClient(runner, timeout=config.poll.command_timeout_s)
                pollers[cluster.name] = Poller(cluster.name, clients[cluster.name], config.poll)
                await tg.start(pollers[cluster.name].run)
            supervisor = Supervisor(config, journal, pollers, clients, tg)
            resumed = await supervisor.resume_all()
            metrics.attach(supervisor.handles)
            if config.metrics_listen is not None:
                await tg.start(serve_metrics, metrics, config.metrics_listen)
            server = ControlServer(
                config.socket_path,
                DaemonHandler(supervisor),
                mode=config.socket_mode,
                group=config.socket_group,
            )
            await tg.start(server.serve)
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
            for link in login_links:
                await link.aclose()
            await journal.aclose()
        log.info("daemon.stopped")


STATUS_REFRESH_S = 2.0


def status_line(handles: Mapping[str, RunHandle]) -> str:
    """The one-line STATUS= text: runs in flight by state, and how many are finished."""
    counts = Counter(h.run.state for h in list(handles.values()))
    order = list(RunState)
    active = sorted((s for s in counts if not s.is_final), key=order.index)
    in_flight = sum(counts[s] for s in active)
    finished = sum(n for s, n in counts.items() if s.is_final)
    detail = ", ".join(f"{counts[s]} {s.value}" for s in active)
    shown = f" ({detail})" if detail else ""
    return f"{in_flight} runs in flight{shown}; {finished} finished"


async def _report_status(supervisor: Supervisor, metrics: Metrics, notify: Notify) -> None:
    """Send STATUS= whenever the counts change (checked every STATUS_REFRESH_S)."""
    last = status_line(supervisor.handles)
    while True:
        await anyio.sleep(STATUS_REFRESH_S)
        metrics.observe_verdicts()
        line = status_line(supervisor.handles)
        if line != last:
            notify(f"STATUS={line}")
            last = line


class DaemonHandler(Handler):
    """Answers control-socket requests from the supervisor's state."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        op, args = request.op, request.args
        if op == "ping":
            return {"pong": True}
        if op == "submit":
            return await self._submit(args, peer)
        if op == "list":
            return self._list(args, peer)
        handle = self._handle(args, peer)
        if op == "status":
            return run_summary(handle, utcnow())
        if op == "cancel":
            try:
                await self.sup.cancel(handle)
            except IllegalTransition as exc:
                raise ControlError(
                    "conflict", f"Run {handle.run.run_id} is already {handle.run.state.value}."
                ) from exc
            return run_summary(handle, utcnow())
        if op == "wait":
            return await self._wait(handle, send)
        if op == "logs":
            return await self._logs(handle, args, send)
        if op == "archive":
            return {"archive": handle.meta.archive_dir, "state": handle.run.state.value}
        raise ControlError("unknown_op", f"Operation {op!r} is not known.")

    def _handle(self, args: Mapping[str, object], peer: Peer) -> RunHandle:
        ref = str(args.get("run", ""))
        handle = self.sup.get(ref)
        if handle is None:
            raise ControlError("not_found", f"No run {ref!r} is known to this daemon.")
        if not may_access(peer, handle.meta.owner_uid, self.sup.config.admin_group):
            raise ControlError(
                "forbidden",
                f"Run {handle.run.run_id} belongs to uid {handle.meta.owner_uid}; uid {peer.uid} "
                "may not see or change it (needs root or the admin group).",
            )
        return handle

    async def _submit(self, args: Mapping[str, object], peer: Peer) -> Mapping[str, object]:
        spec_toml = str(args["spec_toml"])
        where = str(args.get("spec_path") or "the spec")
        cluster = args.get("cluster")
        names = [c.name for c in self.sup.config.clusters]
        if cluster is not None and cluster not in names:
            raise ControlError(
                "bad_request",
                f"Cluster {cluster!r} is not configured in this daemon; "
                f"use one of: {', '.join(names)}.",
            )
        try:
            if args.get("dry_run"):
                script = render_sbatch(load_spec(spec_toml), job_name="llmd-dry-run")
                return {"dry_run": True, "script": script}
            handle = await self.sup.submit(
                spec_toml, owner_uid=peer.uid, cluster=None if cluster is None else str(cluster)
            )
        except SpecError as exc:
            raise ControlError("bad_request", f"{where}: {exc}") from exc
        return run_summary(handle, utcnow())

    def _list(self, args: Mapping[str, object], peer: Peer) -> Mapping[str, object]:
        admin = self.sup.config.admin_group
        show_all = bool(args.get("all"))
        runs = [
            run_summary(h, utcnow())
            for h in self.sup.handles.values()
            if may_access(peer, h.meta.owner_uid, admin)
            and (show_all or not h.run.state.is_final or h.meta.owner_uid == peer.uid)
        ]
        runs.sort(key=lambda r: str(r["created_at"]))
        return {"runs": runs}

    async def _wait(self, handle: RunHandle, send: Send) -> Mapping[str, object]:
        """Stream a summary at each change (at most every 0.5 s) until the run is final."""
        while not handle.run.state.is_final:
            await send(run_summary(handle, utcnow()))
            with anyio.move_on_after(5):
                await handle.changed.wait()
            await anyio.sleep(0.5)
        return run_summary(handle, utcnow())

    async def _logs(
        self, handle: RunHandle, args: Mapping[str, object], send: Send
    ) -> Mapping[str, object]:
        """Stream the local log copies (batch .out by default, or one rank's logs)."""
        rank = args.get("rank")
        follow = bool(args.get("follow"))
        logs = archive.logs_dir(self.sup.config.archive_root, handle.run.run_id)

        def wanted(path: Path) -> bool:
            if rank is None:
                return path.suffix in (".out", ".err")
            return path.name.startswith(f"rank{rank}.")

        offsets: dict[Path, int] = {}
        sent = 0
        while True:
            final = handle.run.state.is_final
            async for path, chunk in _new_bytes(logs, wanted, offsets):
                sent += len(chunk)
                await send(
                    {"file": str(path.relative_to(logs)), "data": chunk.decode("utf-8", "replace")}
                )
            if not follow or final:
                return {"bytes": sent, "state": handle.run.state.value}
            await anyio.sleep(0.1)


async def _new_bytes(
    root: Path, wanted: Callable[[Path], bool], offsets: dict[Path, int]
) -> AsyncIterator[tuple[Path, bytes]]:
    """Bytes appended to the wanted files under `root` since `offsets` (updated)."""
    paths = await anyio.to_thread.run_sync(
        lambda: sorted(p for p in root.rglob("*") if p.is_file())
    )
    for path in paths:
        if not wanted(path):
            continue
        start = offsets.get(path, 0)

        def read(p: Path = path, s: int = start) -> bytes:
            with p.open("rb") as f:
                f.seek(s)
                return f.read(1 << 20)

        data = await anyio.to_thread.run_sync(read)
        if data:
            offsets[path] = start + len(data)
            yield path, data
