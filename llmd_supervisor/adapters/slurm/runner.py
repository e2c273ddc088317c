"""Adapter: runs Slurm client commands (sbatch, squeue, sacct, scontrol, scancel).

Every call has a timeout. A command that cannot be started or times out raises
`SlurmCommandError`; a command that ran returns its `CommandResult` whatever its exit
status, because for queries a failure is an observation ("sacct could not answer"), not
an exception: the verdict decides what it means. Commands whose failure is an error
(sbatch, scancel) check the status here and raise.

On cancellation the running command is killed and reaped by anyio before `Cancelled`
propagates; nothing is left behind.

The commands get a small explicit environment, never the daemon's own (which may hold an
operator's tokens): sbatch hands its environment to the job (``--export=ALL``), so a
variable here reaches every user's job. It is :data:`PASSED_ENV` taken from the daemon's
environment (or the login host's, see ``slurm_ssh``), ``SLURM_UMASK=0077`` (Slurm creates
the job's ``.out``/``.err`` 0600 and starts the batch shell under umask 077), and what the
operator configured for the cluster (``SLURM_CONF``). Other ``SLURM_*``/``SBATCH_*``/
``SQUEUE_*``/``SACCT_*`` input variables would change what is submitted or how the output
looks, so they are dropped too.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Protocol

import anyio

from llmd_supervisor.core.slurm.limits import ASSOC_FORMAT, QOS_FORMAT, submit_limit
from llmd_supervisor.core.slurm.parse import (
    SACCT_FIELDS,
    SQUEUE_FORMAT,
    accounting_disabled,
    parse_sbatch_parsable,
)
from llmd_supervisor.errors import SlurmCommandError

DEFAULT_TIMEOUT_S = 30.0
# What the Slurm commands (and so, through sbatch, the jobs) see of the daemon's environment.
PASSED_ENV: Final = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "SLURM_CONF")
FIXED_ENV: Final = {"SLURM_UMASK": "0077"}
DAEMON_ENV: Final = ("SLURM_CONF",)  # kept from the daemon's own under an exported environment


def command_env(
    environ: Mapping[str, str], configured: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a Slurm command: PASSED_ENV from `environ`, FIXED_ENV, then
    the cluster's `configured` variables (e.g. SLURM_CONF), which win."""
    env = {k: environ[k] for k in PASSED_ENV if k in environ}
    env.update(FIXED_ENV)
    env.update(configured or {})
    return env


@dataclass(frozen=True)
class CommandResult:
    """What one command printed and how it exited."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    started_at: datetime
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @classmethod
    def finished(
        cls,
        argv: Sequence[str],
        returncode: int,
        stdout: bytes,
        stderr: bytes,
        *,
        started_at: datetime,
        t0: float,
    ) -> CommandResult:
        """A command that ran: its output decoded, its duration from `t0` (monotonic)."""
        return cls(
            argv=tuple(argv),
            returncode=returncode,
            stdout=stdout.decode("utf-8", "replace"),
            stderr=stderr.decode("utf-8", "replace"),
            started_at=started_at,
            duration_s=time.monotonic() - t0,
        )


class CommandRunner(Protocol):
    """Runs an argv somewhere (locally, or on a login node over SSH)."""

    async def run(
        self,
        argv: Sequence[str],
        *,
        time_limit: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run `argv`; `env` (sbatch of `submit --export-env`) replaces the daemon's own
        environment, the configured variables still winning."""
        ...


class LocalRunner:
    """Runs commands on this machine in `command_env` (the configured `env` on top)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._configured = dict(env or {})
        self._env = command_env(os.environ, env)
        # Children die with the daemon: an sbatch orphaned by a crash could otherwise
        # submit after the restarted daemon concluded the job did not exist.
        setpriv = shutil.which("setpriv")
        self._prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []

    async def run(
        self,
        argv: Sequence[str],
        *,
        time_limit: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        started_at = datetime.now(UTC)
        t0 = time.monotonic()
        command = list(argv)
        run_env = self._env
        if env is not None:
            # The program is the one the daemon's PATH names, never the client's.
            found = shutil.which(command[0], path=self._env.get("PATH")) if command else None
            command[:1] = [found] if found else command[:1]
            # Which cluster sbatch talks to stays the daemon's choice (its SLURM_CONF,
            # configured or its own), never the exported environment's.
            own = {k: self._env[k] for k in DAEMON_ENV if k in self._env}
            run_env = {**env, **FIXED_ENV, **own, **self._configured}
        try:
            with anyio.fail_after(time_limit):
                proc = await anyio.run_process(
                    [*self._prefix, *command], input=stdin, check=False, env=run_env
                )
        except TimeoutError as exc:
            raise SlurmCommandError(argv, None, "", timed_out_after=time_limit) from exc
        except OSError as exc:
            raise SlurmCommandError(argv, None, str(exc)) from exc
        return CommandResult.finished(
            argv, proc.returncode, proc.stdout, proc.stderr, started_at=started_at, t0=t0
        )


@dataclass(frozen=True)
class NameLookup:
    """The result of looking a job up by its unique name."""

    job_id: str | None
    certain: bool  # both squeue and sacct answered: a None job_id means "never submitted"
    others: tuple[str, ...] = ()  # more jobs of that name: duplicates (the first is job_id)


def _named(ids: list[str], certain: bool) -> NameLookup:
    """The first submitted of the jobs `ids` of one name, and the others."""
    distinct = sorted(set(ids), key=lambda i: (len(i), i))  # numeric order of job ids
    if not distinct:
        return NameLookup(None, certain)
    return NameLookup(distinct[0], certain, tuple(distinct[1:]))


# What `id -un` may print for the account to be usable in `--user=`: one name, no list.
_ACCOUNT_RE = re.compile(r"[^\s,]{1,256}")


class SlurmClient:
    """The Slurm commands the supervisor uses, each built as an argv list."""

    def __init__(self, runner: CommandRunner, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.runner = runner
        self.timeout = timeout
        self._account: str | None = None

    async def account(self) -> str:
        """The account the commands run as, so the one sbatch submits as: the daemon's own
        (the system service's account, or the user of a per-user service), or the SSH
        user on a login host. Asked once (``id -un`` through the runner), then kept.
        Raises SlurmCommandError if it cannot be asked, or prints no single user name."""
        if self._account is None:
            result = await self._run_checked(["id", "-un"])
            name = result.stdout.strip()
            if not _ACCOUNT_RE.fullmatch(name):
                why = f"printed {name[:80]!r}, which is not one user name for --user="
                raise SlurmCommandError(result.argv, result.returncode, why)
            self._account = name
        return self._account

    async def _run(
        self,
        argv: Sequence[str],
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        if env is None:
            return await self.runner.run(argv, time_limit=self.timeout, stdin=stdin)
        return await self.runner.run(argv, time_limit=self.timeout, stdin=stdin, env=env)

    async def _run_checked(
        self,
        argv: Sequence[str],
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        result = await self._run(argv, stdin, env)
        if not result.ok:
            raise SlurmCommandError(argv, result.returncode, _tail(result.stderr))
        return result

    async def sbatch(self, script: str, *options: str, env: Mapping[str, str] | None = None) -> str:
        """Submit a batch script's text (on stdin, so it works through a remote login node
        too); `env`: the job's environment instead of the daemon's (sbatch exports ALL)."""
        argv = ["sbatch", "--parsable", *options]
        result = await self._run_checked(argv, script.encode(), env)
        return parse_sbatch_parsable(result.stdout).job_id

    async def find_by_name(self, job_name: str, *, starttime: str) -> NameLookup:
        """Look for the job named `job_name` that this client's account submitted
        (`account`: another user's job of that name is never the run's), in squeue,
        then in sacct.

        `certain` is True only when both answered (a job purged from slurmctld after
        MinJobAge is only in sacct): then "not found" is a fact. Raises SlurmCommandError
        when the account cannot be learnt, when squeue fails, or when it does not know
        the job and sacct fails.
        """
        user = f"--user={await self.account()}"
        queue = await self._run_checked(
            ["squeue", "--noheader", "--states=all", user, f"--name={job_name}", "--format=%i"]
        )
        ids = queue.stdout.split()
        if ids:
            return _named(ids, certain=True)
        acct = await self._run(
            [
                "sacct",
                "--noheader",
                "--parsable2",
                "--allocations",
                user,
                f"--name={job_name}",
                f"--starttime={starttime}",
                "--format=JobIDRaw",
            ]
        )
        if accounting_disabled(acct.stderr):
            return NameLookup(None, certain=False)
        if not acct.ok:
            raise SlurmCommandError(acct.argv, acct.returncode, _tail(acct.stderr))
        return _named(acct.stdout.split(), certain=True)

    async def submit_limit(self) -> int | None:
        """How many jobs this client's account may have pending or running at once
        (`core.slurm.limits`), None when sacctmgr gives no limit or cannot answer."""
        user = await self.account()
        base = ["sacctmgr", "--noheader", "--parsable2", "show"]
        assoc = await self._run([*base, "assoc", "where", f"user={user}", f"format={ASSOC_FORMAT}"])
        qos = await self._run([*base, "qos", f"format={QOS_FORMAT}"])
        if not (assoc.ok and qos.ok):
            return None
        return submit_limit(assoc.stdout, qos.stdout)

    async def node_names(self, partition: str | None = None) -> list[str]:
        """The cluster's (or partition's) node names, each once (`sinfo --Node`)."""
        argv = ["sinfo", "--noheader", "--Node", "--format=%N"]
        if partition:
            argv.append(f"--partition={partition}")
        result = await self._run_checked(argv)
        return sorted({n for n in result.stdout.split() if n})

    async def node_states(self, nodes: Sequence[str]) -> dict[str, str]:
        """Each node's state as `sinfo --Node` prints it (``idle``, ``down*``, ...)."""
        argv = ["sinfo", "--noheader", "--Node", "--format=%N|%T", f"--nodes={','.join(nodes)}"]
        result = await self._run_checked(argv)
        pairs = (line.split("|", 1) for line in result.stdout.splitlines() if "|" in line)
        return {name.strip(): state.strip() for name, state in pairs}

    async def mkdir(self, path: str) -> None:
        """`mkdir -p` where the Slurm commands run (the log directory must exist for sbatch)."""
        await self._run_checked(["mkdir", "-p", "--", path])

    async def squeue(self, job_ids: Sequence[str]) -> CommandResult:
        """One squeue for all the given jobs, every state (finished jobs too, until purged)."""
        return await self._run(
            [
                "squeue",
                "--noheader",
                f"--format={SQUEUE_FORMAT}",
                "--states=all",
                f"--jobs={','.join(job_ids)}",
            ]
        )

    async def sacct(
        self,
        job_ids: Sequence[str],
        *,
        starttime: str | None = None,
        allocations_only: bool = False,
    ) -> CommandResult:
        """One sacct for all the given jobs (allocation and step rows unless `allocations_only`)."""
        argv = [
            "sacct",
            "--parsable2",
            "--noheader",
            f"--format={','.join(SACCT_FIELDS)}",
            f"--jobs={','.join(job_ids)}",
        ]
        if starttime is not None:
            argv.append(f"--starttime={starttime}")
        if allocations_only:
            argv.append("--allocations")
        return await self._run(argv)

    async def scontrol_job(self, job_id: str) -> CommandResult:
        return await self._run(["scontrol", "show", "job", "--oneliner", job_id])

    async def scontrol_config(self) -> CommandResult:
        return await self._run_checked(["scontrol", "show", "config"])

    async def scancel(self, job_id: str, *, signal: str | None = None) -> None:
        argv = ["scancel"]
        if signal is not None:
            argv.append(f"--signal={signal}")
        argv.append(job_id)
        await self._run_checked(argv)


def _tail(text: str, lines: int = 5) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
