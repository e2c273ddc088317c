"""One object per configured cluster: its Slurm client, its poller and how its files are
reached. Supervision calls these interfaces and never asks which kind of cluster it has.

How a run's files (marker, batch and per-rank logs) are reached besides the per-node SSH
links, one `RunFiles` per cluster:

* `SharedLogDir`: this machine sees the run's log directory (the login node shares the
  cluster file system): the marker is read by `node/safe_read.py` run here, the job's start
  is noticed when its batch log appears, and at the end the SSH tailers are cancelled
  (their copies are exact prefixes) and the copies completed from the shared file system
  by the same script run here.
* `ThroughLoginHost`: Slurm commands run on a login host over SSH; the marker is read
  there by `node/safe_read.py`, and at the end the SSH tailers drain (bounded by `finish_drain_s`).

And how one allocated node's files are watched during a run (`Cluster.connect`): a
`NodeLink` per node (``access = "ssh"`` and ``"login-host"``), or a `SharedFsNode` per
node that reads them here (``access = "shared-fs"``: no SSH at all; liveness then comes
from the ranks' status files, see `core.run.health`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio
import structlog

from llmd_supervisor.adapters.nodes import jobfiles as jobfiles
from llmd_supervisor.adapters.nodes.remote import NodeLink
from llmd_supervisor.adapters.nodes.tail import NodeFiles, copy_rests
from llmd_supervisor.adapters.slurm.runner import CommandRunner, LocalRunner, SlurmClient
from llmd_supervisor.adapters.slurm.ssh import SshRunner, ssh_settings
from llmd_supervisor.core.config import Access, ClusterConfig, Config
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.errors import (
    FileRefused,
    RemoteError,
    SlurmCommandError,
    SupervisorError,
)
from llmd_supervisor.supervision.cluster.poller import Poller
from llmd_supervisor.supervision.run.attempt import Attempt, CopyState

log = structlog.get_logger("llmd_supervisor.cluster")

# A run's log copies completed from the shared file system at its end may take this long
# in all (multi-GiB logs on a slow file system); then they are left as exact prefixes.
CATCH_UP_LIMIT_S = 600.0


class RunFiles(Protocol):
    """How the daemon reaches a run's files on one cluster."""

    async def read(
        self, log_dir: str, path: str, limit: int = jobfiles.SMALL_FILE_MAX
    ) -> bytes | None:
        """A file's bytes (the marker, a benchmark result: at most `limit`); None when
        missing or unreadable right now; `FileRefused` when it is not a plain file of the
        job or larger (never read)."""
        ...

    async def read_many(
        self, log_dir: str, paths: Sequence[tuple[str, int]]
    ) -> dict[str, bytes | FileRefused | None]:
        """Several files, each (path, limit): path -> bytes, None (missing or unreadable
        now) or the `FileRefused` saying why it is not read."""
        ...

    async def list_dir(self, log_dir: str, path: str) -> list[str]:
        """A directory's entry names (bounded), [] when missing or unreadable now;
        `FileRefused` when it is a link or not a directory."""
        ...

    def local_path(self, path: str) -> Path | None:
        """Where this machine sees a file of the job (to notice it appear), or None."""
        ...

    async def complete_copies(self, attempt: Attempt, layout: RunLayout, job_id: str) -> CopyState:
        """Stop the attempt's watchers and make its local log copies complete."""
        ...

    async def aclose(self) -> None:
        """End what it keeps running (the daemon stops)."""
        ...


class SharedLogDir:
    """This machine sees the run's log directory: its files are read by the cluster's
    `jobfiles.LocalReaders` (reader children kept running)."""

    def __init__(self, time_limit: float = 30.0) -> None:
        self._time_limit = time_limit  # per read of a file, or copy of one log
        self._readers = jobfiles.LocalReaders()

    async def read(
        self, log_dir: str, path: str, limit: int = jobfiles.SMALL_FILE_MAX
    ) -> bytes | None:
        try:
            async with self._readers.reader(log_dir) as reader:
                return await reader.read_file(
                    log_dir, path, time_limit=self._time_limit, limit=limit
                )
        except RemoteError as exc:  # no answer in time, or the reader ended
            log.warning("run.file_unreadable", path=path, error=exc.why)
            return None

    async def read_many(
        self, log_dir: str, paths: Sequence[tuple[str, int]]
    ) -> dict[str, bytes | FileRefused | None]:
        out: dict[str, bytes | FileRefused | None] = {}
        try:
            async with self._readers.reader(log_dir) as reader:
                for path, limit in paths:
                    try:
                        out[path] = await reader.read_file(
                            log_dir, path, time_limit=self._time_limit, limit=limit
                        )
                    except FileRefused as exc:
                        out[path] = exc
        except RemoteError as exc:
            log.warning("run.file_unreadable", path=log_dir, error=exc.why)
        return {path: out.get(path) for path, _ in paths}

    async def aclose(self) -> None:
        await self._readers.aclose()

    async def list_dir(self, log_dir: str, path: str) -> list[str]:
        try:
            async with self._readers.reader(log_dir) as reader:
                return await reader.list_dir(log_dir, path, time_limit=self._time_limit)
        except RemoteError as exc:
            log.warning("run.file_unreadable", path=path, error=exc.why)
            return []

    def local_path(self, path: str) -> Path | None:
        return Path(path)

    async def complete_copies(self, attempt: Attempt, layout: RunLayout, job_id: str) -> CopyState:
        # The cancelled tailers append nothing after the cancel (their copies are exact
        # prefixes); each copy is taken over once its tailer lets go of its lock.
        attempt.abandon()
        try:
            async with self._readers.reader(layout.log_dir) as reader:
                copied = await catch_up(attempt, layout, job_id, reader, self._time_limit)
        except (OSError, SupervisorError) as exc:
            log.warning("run.catch_up_failed", error=str(exc))
            return CopyState.LOCAL_FAILED
        log.info("run.logs_completed", bytes=copied)
        return CopyState.COMPLETE


class ThroughLoginHost:
    """Files are read on the cluster's login host; log copies drain over the node links."""

    def __init__(self, client: SlurmClient, host: str, python: str) -> None:
        self._client = client
        self._host = host
        self._python = python

    async def aclose(self) -> None:
        """Nothing of its own: its reads use the login host's link (closed with it)."""

    async def read(
        self, log_dir: str, path: str, limit: int = jobfiles.SMALL_FILE_MAX
    ) -> bytes | None:
        root, rel = jobfiles.split(log_dir, path)
        argv = jobfiles.argv(self._python, "read", root, rel, str(limit))
        try:
            result = await self._client.runner.run(argv, time_limit=self._client.timeout)
        except SlurmCommandError as exc:
            log.warning("run.file_unreadable", host=self._host, path=path, error=str(exc))
            return None
        if result.returncode not in (
            jobfiles.OK,
            jobfiles.MISSING,
            jobfiles.REFUSED,
            jobfiles.TOO_LARGE,
        ):
            why = result.stderr.strip()[-300:]
            log.warning("run.file_unreadable", host=self._host, path=path, error=why)
            return None
        data = (result.stdout if result.returncode == jobfiles.OK else result.stderr).encode()
        return jobfiles.answer(path, result.returncode, data, limit)

    async def read_many(
        self, log_dir: str, paths: Sequence[tuple[str, int]]
    ) -> dict[str, bytes | FileRefused | None]:
        out: dict[str, bytes | FileRefused | None] = {}
        for path, limit in paths:  # one command each on the login host
            try:
                out[path] = await self.read(log_dir, path, limit)
            except FileRefused as exc:
                out[path] = exc
        return out

    async def list_dir(self, log_dir: str, path: str) -> list[str]:
        root, rel = jobfiles.split(log_dir, path)
        request = jobfiles.serve_request("list", rel, jobfiles.LIST_MAX)
        argv = jobfiles.argv(self._python, "serve", root)
        try:
            result = await self._client.runner.run(
                argv, time_limit=self._client.timeout, stdin=request
            )
        except SlurmCommandError as exc:
            log.warning("run.file_unreadable", host=self._host, path=path, error=str(exc))
            return []
        head, _, body = result.stdout.encode("utf-8", "surrogateescape").partition(b"\n")
        return jobfiles.listing(path, head.split(b" ")[0].decode(errors="replace"), body)

    def local_path(self, path: str) -> Path | None:
        return None

    async def complete_copies(self, attempt: Attempt, layout: RunLayout, job_id: str) -> CopyState:
        return await attempt.drain()


async def catch_up(
    attempt: Attempt,
    layout: RunLayout,
    job_id: str,
    reader: jobfiles.SharedFsNode,
    time_limit: float,
) -> int:
    """Append to each local copy what its log file (seen through the shared log directory)
    holds beyond it; copies files no tailer saw. Returns the bytes copied. A file that is
    not a plain file of the job, or beyond the copy budget, is skipped (a named event).
    `reader` serves every directory and file, each round of them in one batch (a run's
    end waits for this)."""
    copied = 0

    def count(n: int) -> None:
        nonlocal copied
        copied += n
        attempt.on_bytes(n)

    try:
        sources = dict(layout.batch_logs(job_id))  # copy name -> remote path
        directories = list(layout.log_dirs(job_id, None))
        listed = await reader.list_dirs(layout.log_dir, directories, time_limit=time_limit)
        for directory, names in zip(directories, listed, strict=True):
            if isinstance(names, FileRefused):
                await attempt.refused(names)
                continue
            for name in names:
                copy_name = layout.log_copy_name(job_id, None, directory, name)
                if copy_name is not None:
                    sources.setdefault(copy_name, f"{directory}/{name}")
        local_dir = layout.copies(attempt.number)
        local_dir.mkdir(parents=True, exist_ok=True)
        files = [(source, local_dir / copy_name) for copy_name, source in sources.items()]
        with anyio.fail_after(CATCH_UP_LIMIT_S):
            skipped = await copy_rests(
                reader,
                layout.log_dir,
                files,
                on_bytes=count,
                budget=attempt.budget,
                time_limit=time_limit,
            )
        for exc in skipped:
            await attempt.refused(exc)
    except (RemoteError, TimeoutError) as exc:  # the reader failed or the FS hangs
        raise OSError(f"copying the logs here failed: {exc}") from None
    return copied


@dataclass
class Cluster:
    """Everything per configured cluster."""

    config: ClusterConfig
    client: SlurmClient
    poller: Poller
    files: RunFiles
    connect: Callable[[str], NodeFiles]  # one allocated node's files, watched during a run

    @property
    def name(self) -> str:
        return self.config.name


def build_cluster(
    cluster: ClusterConfig,
    config: Config,
    wrap: Callable[[CommandRunner], CommandRunner],
    links: list[NodeLink],
    *,
    runner: CommandRunner | None = None,
) -> Cluster:
    """The cluster's object; a login host's SSH link is appended to `links` (to close).
    `runner` replaces where the Slurm commands run (a test seam)."""
    env = {"SLURM_CONF": cluster.slurm_conf} if cluster.slurm_conf else {}
    if runner is None and cluster.login_host is not None:
        link = NodeLink(cluster.login_host, ssh_settings(config.ssh))
        links.append(link)
        runner = SshRunner(link, env)
    elif runner is None:
        runner = LocalRunner(env)
    client = SlurmClient(wrap(runner), timeout=config.poll.command_timeout_s)
    files: RunFiles = (
        SharedLogDir(config.poll.command_timeout_s)
        if cluster.login_host is None
        else ThroughLoginHost(client, cluster.login_host, config.ssh.node_python)
    )
    settings = ssh_settings(config.ssh)

    def over_ssh(node: str) -> NodeFiles:
        return NodeLink(node, settings)

    connect = jobfiles.SharedFsNode if cluster.access is Access.SHARED_FS else over_ssh
    return Cluster(cluster, client, Poller(cluster.name, client, config.poll), files, connect)
