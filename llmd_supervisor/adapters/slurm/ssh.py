"""Slurm commands on a remote login node: a `CommandRunner` over one `NodeLink`.

A cluster configured with ``login_host`` runs every Slurm client command (and the few
file commands the supervisor needs where Slurm runs: ``mkdir -p``, ``realpath -m``,
``node/safe_read.py`` reading the marker) over one multiplexed SSH connection to that
host, quoted with shlex, in the same small
environment as locally (`llmd_supervisor.adapters.slurm.runner.command_env`): the login
shell's own variables are cleared, except PASSED_ENV as the login host has them, and the
configured ones (SLURM_CONF) are set -- ``sh -c 'exec env -i ${PATH+"PATH=$PATH"} ...
"$@"' sh SLURM_CONF=... <argv>``. sbatch gets its script on stdin, exactly as locally.

Every SSH failure becomes `SlurmCommandError` (returncode None: "could not be started";
the link's time limit: ``timed_out_after``), so the poller and the verifier treat a lost
login node like a Slurm command that could not answer: the previous knowledge stands.
On cancellation the channel is closed and the remote command is ended by its ``timeout``
wrapper (see `NodeLink.run`).
"""

from __future__ import annotations

import getpass
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from llmd_supervisor.adapters.nodes.remote import NodeLink, SshSettings
from llmd_supervisor.adapters.slurm.runner import FIXED_ENV, PASSED_ENV, CommandResult
from llmd_supervisor.core.config import SshConfig
from llmd_supervisor.errors import RemoteError, SlurmCommandError


def ssh_settings(ssh: SshConfig) -> SshSettings:
    """The `SshSettings` the daemon uses for nodes and login hosts alike."""
    return SshSettings(
        username=ssh.user or getpass.getuser(),
        client_keys=ssh.identity_files,
        known_hosts=ssh.known_hosts,
        port=ssh.port,
        connect_timeout=ssh.connect_timeout_s,
    )


# Keeps each PASSED_ENV variable the remote shell has (and only those): ${V+"V=$V"} is
# one word when V is set, none when it is not.
_CLEAN_ENV_SCRIPT = 'exec env -i -- {} "$@"'.format(
    " ".join(f'${{{name}+"{name}=${name}"}}' for name in PASSED_ENV)
)


def remote_argv(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """`argv` run by ``env -i`` with PASSED_ENV from the remote side, then FIXED_ENV and
    `env` (NodeLink.run shlex-quotes every word; `sh` expands the remote variables)."""
    assigned = {**FIXED_ENV, **env}
    # After the assignments the first word is the command.
    return ["sh", "-c", _CLEAN_ENV_SCRIPT, "sh", *(f"{k}={v}" for k, v in assigned.items()), *argv]


class SshRunner:
    """Runs commands on a login node over `link`, with `env` (e.g. SLURM_CONF) set there."""

    def __init__(self, link: NodeLink, env: Mapping[str, str] | None = None) -> None:
        self.link = link
        self.env = dict(env or {})

    async def run(
        self,
        argv: Sequence[str],
        *,
        time_limit: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        if env is not None:  # admission refuses it: values would show in the remote argv
            raise SlurmCommandError(
                argv,
                None,
                f"on {self.link.host}: a client's environment cannot be exported through a"
                " login host; run the daemon on the login node for --export-env",
            )
        started_at = datetime.now(UTC)
        t0 = time.monotonic()
        try:
            result = await self.link.run(
                remote_argv(argv, self.env), time_limit=time_limit, stdin=stdin
            )
        except RemoteError as exc:
            timed_out = exc.why.startswith("no answer within")
            raise SlurmCommandError(
                argv,
                None,
                f"on {self.link.host}: {exc.why}",
                timed_out_after=time_limit if timed_out else None,
            ) from exc
        return CommandResult.finished(
            argv, result.exit_status, result.stdout, result.stderr, started_at=started_at, t0=t0
        )
