"""One object per configured cluster: its Slurm client, its poller and how its files are
reached. Supervision calls these interfaces and never asks which kind of cluster it has.

How a run's files (marker, batch and per-rank logs) are reached besides the per-node SSH
links, one `RunFiles` per cluster:

* `SharedLogDir`: this machine sees the run's log directory (the login node shares the
  cluster file system): the marker is read directly, the job's start is noticed when its
  batch log appears, and at the end the SSH tailers are cancelled (their copies are exact
  prefixes) and the copies completed from the shared file system in milliseconds.
* `ThroughLoginHost`: Slurm commands run on a login host over SSH; the marker is read
  there with `cat`, and at the end the SSH tailers drain (bounded by `finish_drain_s`).

Issue 2.5 adds more implementations (shared file system without SSH to the nodes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio
import structlog

from llmd_supervisor.adapters.fsutil import read_optional
from llmd_supervisor.adapters.remote import NodeLink
from llmd_supervisor.adapters.slurm import CommandRunner, LocalRunner, SlurmClient
from llmd_supervisor.adapters.slurm_ssh import SshRunner, read_file, ssh_settings
from llmd_supervisor.core.config import ClusterConfig, Config
from llmd_supervisor.core.layout import RunLayout
from llmd_supervisor.errors import SlurmCommandError
from llmd_supervisor.supervision.attempt import Attempt, CopyState
from llmd_supervisor.supervision.poller import Poller

log = structlog.get_logger("llmd_supervisor.cluster")


class RunFiles(Protocol):
    """How the daemon reaches a run's files on one cluster."""

    async def read(self, path: str) -> bytes | None:
        """A small file's bytes (the marker); None when missing or unreadable right now."""
        ...

    def local_path(self, path: str) -> Path | None:
        """Where this machine sees a file of the job (to notice it appear), or None."""
        ...

    async def complete_copies(self, attempt: Attempt, layout: RunLayout, job_id: str) -> CopyState:
        """Stop the attempt's watchers and make its local log copies complete."""
        ...


class SharedLogDir:
    """This machine sees the run's log directory."""

    async def read(self, path: str) -> bytes | None:
        return await anyio.to_thread.run_sync(read_optional, Path(path))

    def local_path(self, path: str) -> Path | None:
        return Path(path)

    async def complete_copies(self, attempt: Attempt, layout: RunLayout, job_id: str) -> CopyState:
        # No need to wait for the cancelled tailers' cleanup (channel close, fsync): they
        # append nothing after the cancel, and their copies are exact prefixes.
        attempt.abandon()
        try:
            copied = await anyio.to_thread.run_sync(catch_up, layout, job_id, attempt.number)
        except OSError as exc:
            log.warning("run.catch_up_failed", error=str(exc))
            return CopyState.LOCAL_FAILED
        log.info("run.logs_completed", bytes=copied)
        attempt.on_bytes(copied)  # copied too, if not by a tailer
        return CopyState.COMPLETE


class ThroughLoginHost:
    """Files are read on the cluster's login host; log copies drain over the node links."""

    def __init__(self, client: SlurmClient, host: str) -> None:
        self._client = client
        self._host = host

    async def read(self, path: str) -> bytes | None:
        try:
            return await read_file(self._client.runner, path, time_limit=self._client.timeout)
        except SlurmCommandError as exc:
            log.warning("run.file_unreadable", host=self._host, path=path, error=str(exc))
            return None

    def local_path(self, path: str) -> Path | None:
        return None

    async def complete_copies(self, attempt: Attempt, layout: RunLayout, job_id: str) -> CopyState:
        return await attempt.drain()


def catch_up(layout: RunLayout, job_id: str, attempt: int) -> int:
    """Append to each local copy what its log file (seen through the shared log directory)
    holds beyond it; copies files no tailer saw. Returns the bytes copied."""
    sources = [Path(p) for p in layout.batch_logs(job_id).values()]
    job_dir = Path(layout.job_dir(job_id))
    if job_dir.is_dir():
        sources += sorted(
            p for p in job_dir.iterdir() if layout.is_rank_log(p.name) and p.is_file()
        )
    local_dir = layout.copies(attempt)
    local_dir.mkdir(parents=True, exist_ok=True)
    return sum(_append_missing(s, local_dir / s.name) for s in sources if s.exists())


def _append_missing(source: Path, copy: Path) -> int:
    """Append source's bytes beyond copy's size to copy, fsynced; return how many."""
    with copy.open("ab") as out, source.open("rb") as src:
        src.seek(out.tell())
        n = 0
        while chunk := src.read(1 << 20):
            out.write(chunk)
            n += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return n


@dataclass
class Cluster:
    """Everything per configured cluster."""

    config: ClusterConfig
    client: SlurmClient
    poller: Poller
    files: RunFiles

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
        SharedLogDir()
        if cluster.login_host is None
        else ThroughLoginHost(client, cluster.login_host)
    )
    return Cluster(cluster, client, Poller(cluster.name, client, config.poll), files)
