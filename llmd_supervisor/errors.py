"""The one exception hierarchy of llmd-supervisor.

Every error carries the values it is about and builds a full-sentence message from them.
Outside errors (subprocess, asyncssh, sqlite3, OSError) are translated into these at the
adapter boundary with ``raise ... from exc``.
"""

from __future__ import annotations

from collections.abc import Sequence


class SupervisorError(Exception):
    """Base of every error this project raises on purpose."""


class SlurmCommandError(SupervisorError):
    """A Slurm client command failed, timed out or could not be started."""

    def __init__(
        self,
        argv: Sequence[str],
        returncode: int | None,
        stderr_tail: str,
        *,
        timed_out_after: float | None = None,
    ) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr_tail = stderr_tail.strip()
        self.timed_out_after = timed_out_after
        cmd = " ".join(self.argv[:1] + self.argv[1:4]) + (" ..." if len(self.argv) > 4 else "")
        if timed_out_after is not None:
            what = f"timed out after {timed_out_after:g} s"
        elif returncode is None:
            what = "could not be started"
        else:
            what = f"exited with status {returncode}"
        detail = f": {self.stderr_tail}" if self.stderr_tail else ""
        super().__init__(f"Slurm command `{cmd}` {what}{detail}.")


class SlurmParseError(SupervisorError):
    """Slurm printed something that does not have the expected shape."""

    def __init__(self, what: str, text: str, why: str) -> None:
        self.what = what
        self.text = text
        self.why = why
        shown = text if len(text) <= 120 else text[:117] + "..."
        super().__init__(f"Could not parse {what} output {shown!r}: {why}.")


class IllegalTransition(SupervisorError):
    """The run state machine was asked for a transition it does not allow."""

    def __init__(self, state: str, event: str) -> None:
        self.state = state
        self.event = event
        super().__init__(
            f"Event {event!r} is not allowed in run state {state!r}; the transition was rejected."
        )


class SpecError(SupervisorError):
    """A run spec value is invalid."""

    def __init__(self, field: str, value: object, hint: str) -> None:
        self.field = field
        self.value = value
        self.hint = hint
        super().__init__(f"Run spec field {field!r} has invalid value {value!r}: {hint}.")


class CampaignError(SpecError):
    """A campaign file value is invalid, or one point of its matrix is not a valid run spec.

    `field`, `value` and `hint` are as in SpecError (for a point: the run spec's field, or
    the launcher's in a script campaign: `subject` says which).
    `point` is the offending point's matrix values in file order, or None when the error
    is about the campaign file itself.
    """

    def __init__(
        self,
        field: str,
        value: object,
        hint: str,
        *,
        point: Sequence[tuple[str, object]] | None = None,
        subject: str = "Run spec",
    ) -> None:
        super().__init__(field, value, hint)
        self.point = None if point is None else tuple(point)
        if self.point is None:
            message = f"Campaign file field {field!r} has invalid value {value!r}: {hint}."
        else:
            values = ", ".join(f"{k} = {v!r}" for k, v in self.point)
            message = (
                f"Campaign file field {field!r} at point {{{values}}}: "
                f"{subject} field {field!r} has invalid value {value!r}: {hint}."
            )
        self.args = (message,)


class ExpansionStopped(SupervisorError):
    """A campaign's expansion was told to stop (its client went away) before it ended."""

    def __init__(self, campaign: str, built: int, combinations: int) -> None:
        self.campaign = campaign
        self.built = built  # points built (run specs validated) before it stopped
        self.combinations = combinations
        super().__init__(
            f"The expansion of campaign {campaign!r} stopped after {built} points of at most"
            f" {combinations}: its client went away. Submit the campaign again to expand it."
        )


class RemoteError(SupervisorError):
    """An SSH operation on an allocated node failed."""

    def __init__(self, host: str, action: str, why: str) -> None:
        self.host = host
        self.action = action
        self.why = why
        super().__init__(f"SSH to {host} failed while {action}: {why}.")


class SlurmJobNotFound(SlurmParseError):
    """Slurm answered that it does not know the job id (purged or never existed)."""

    def __init__(self, what: str, text: str) -> None:
        super().__init__(what, text, "Slurm does not know this job id")


class ConfigError(SupervisorError):
    """A daemon configuration value is invalid."""

    def __init__(self, key: str, value: object, hint: str) -> None:
        self.key = key
        self.value = value
        self.hint = hint
        super().__init__(f"Configuration key {key!r} has invalid value {value!r}: {hint}.")


class ConfigErrors(ConfigError):
    """Several configuration values are invalid: each one in `problems`, in file order
    (`config check` prints one line each; the daemon's message lists them all)."""

    def __init__(self, problems: list[ConfigError]) -> None:
        first = problems[0]
        super().__init__(first.key, first.value, first.hint)
        self.problems = problems
        if len(problems) > 1:
            listed = " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
            self.args = (f"The configuration has {len(problems)} problems: {listed}",)


class OfflineError(SupervisorError):
    """A run's archive (read without a daemon: --archive, --state-dir) could not be found
    or read."""


class JournalError(SupervisorError):
    """The run journal (SQLite) could not be opened, read or written."""

    def __init__(self, path: str, operation: str, why: str) -> None:
        self.path = path
        self.operation = operation
        self.why = why
        super().__init__(f"Journal {path} could not {operation}: {why}.")


class JournalConflict(JournalError):
    """A journal write was refused because the stored record is not what the writer expected.

    ``expected``/``actual`` are run states (values) for compare-and-set failures and None
    for other conflicts (duplicate run id or job name, diverged transition history).
    """

    def __init__(
        self,
        path: str,
        operation: str,
        run_id: str,
        why: str,
        *,
        expected: str | None = None,
        actual: str | None = None,
    ) -> None:
        self.run_id = run_id
        self.expected = expected
        self.actual = actual
        super().__init__(path, operation, why)


class FencedWrite(JournalError):
    """A shared journal refused a write: the writer's lease epoch is not the cluster's
    current one, or the row is another cluster's (``row_cluster``; core.ha.fencing).
    ``lease_epoch`` is None when the cluster has no lease;
    ``writer_epoch`` is None (and ``cluster`` may be "") when the write stated no writer."""

    def __init__(
        self,
        location: str,
        cluster: str,
        writer_epoch: int | None,
        lease_epoch: int | None,
        row_cluster: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.writer_epoch = writer_epoch
        self.lease_epoch = lease_epoch
        self.row_cluster = row_cluster  # set: the row was another cluster's
        what = f"write for cluster {cluster!r}" if cluster else "write"
        if row_cluster is not None:
            # core.ha.fencing's WRONG_CLUSTER: a bug of the writer, not a lost lease.
            why = (
                f"it touched a row of cluster {row_cluster!r}, and a cluster's leader writes "
                "only its own cluster's rows; the write must state the row's cluster "
                "(adapters.journal.writer.writing_as)"
            )
        elif writer_epoch is None:
            # core.ha.fencing's NO_EPOCH: the writer (this daemon) leads no cluster it named.
            why = (
                "the write stated no cluster and epoch, and a shared journal accepts only "
                "the writes of a cluster's current leader"
            )
        else:
            lease = (
                "the cluster has no lease"
                if lease_epoch is None
                else f"the cluster's lease is at epoch {lease_epoch}"
            )
            why = (
                f"the write carried epoch {writer_epoch} but {lease} (another daemon leads "
                "it now); this daemon stops acting for the cluster"
            )
        super().__init__(location, what, why)


class JournalSchemaTooNew(JournalError):
    """The journal's schema is newer than this daemon's code (core.journal.schema_versions)."""

    def __init__(self, location: str, db_version: int, code_version: int) -> None:
        self.db_version = db_version
        self.code_version = code_version
        super().__init__(
            location,
            "be opened",
            f"the journal's schema is version {db_version}, newer than this daemon's "
            f"{code_version}; upgrade llmd-supervisor",
        )


class LeaseError(SupervisorError):
    """A statement on a cluster's leadership lease (core.ha.lease) failed or timed out; the
    lease's row is unknown (the holder's state machine decides what that means)."""

    def __init__(self, location: str, cluster: str, operation: str, why: str) -> None:
        self.location = location
        self.cluster = cluster
        self.operation = operation
        self.why = why
        super().__init__(
            f"The lease of cluster {cluster!r} in {location} could not {operation}: {why}."
        )


class FileRefused(SupervisorError):
    """A file of a job's log directory is not a plain file the daemon may read."""

    def __init__(self, path: str, why: str) -> None:
        self.path = path
        self.why = why
        super().__init__(f"Refusing to read {path}: {why}; it is not copied or trusted.")


class LogCapped(SupervisorError):
    """A log copy reached its byte cap; the copy keeps what it has and stops."""

    def __init__(self, local_path: str, size: int, per_file: int, per_run: int) -> None:
        self.local_path = local_path
        self.size = size
        super().__init__(
            f"Log copy {local_path} stopped at {size} bytes: the cap is {per_file} bytes per "
            f"file and {per_run} bytes per run (limits.log_copy_max_bytes_per_file / "
            "_per_run); the job's own file is untouched."
        )


class TailConflict(SupervisorError):
    """Another tailer already appends to this local log copy."""

    def __init__(self, local_path: str) -> None:
        self.local_path = local_path
        super().__init__(
            f"Local log copy {local_path} is already being appended by another tailer; "
            "refusing to start a second one (it would duplicate bytes)."
        )


class AdoptRefused(SupervisorError):
    """`adopt` of a job the client does not own (nor may act on as an admin)."""

    def __init__(self, job_id: str, job_uid: int | None, client_uid: int) -> None:
        self.job_id = job_id
        owner = "an owner Slurm does not show" if job_uid is None else f"uid {job_uid}"
        super().__init__(
            f"Job {job_id} belongs to {owner}, not to uid {client_uid}: only its owner or a "
            "member of the daemon's admin group may adopt it."
        )


class ControlError(SupervisorError):
    """A control-socket request was refused; `code` is the wire error code (see control.py)."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(message)


class NotLeader(ControlError):
    """A request that changes a cluster's runs reached a daemon that does not lead that
    cluster (a standby on a shared journal); `leader` is the lease's holder, if any."""

    def __init__(self, cluster: str, holder: str, leader: str | None) -> None:
        self.cluster = cluster
        self.leader = leader
        who = (
            f"its leader is {leader}"
            if leader
            else "no daemon leads it at this moment (a takeover is under way)"
        )
        super().__init__(
            "not_leader",
            f"This daemon ({holder}) does not lead cluster {cluster!r}: {who}. A standby "
            "answers list, status, wait and results; send submissions, cancels and "
            "campaigns to the leader's control socket (or retry once the takeover is done).",
        )


class ControlSocketError(SupervisorError):
    """The daemon could not set up or keep its control socket."""

    def __init__(self, path: object, why: str) -> None:
        self.path = path
        self.why = why
        super().__init__(f"Control socket {path}: {why}.")


class DaemonUnreachable(SupervisorError):
    """The CLI could not connect to the daemon's control socket."""

    def __init__(self, path: object, why: str) -> None:
        self.path = path
        self.why = why
        super().__init__(f"Cannot reach the llmd-supervisor daemon at {path}: {why}.")


class ControlProtocolError(SupervisorError):
    """The control connection broke or carried something that is not the protocol."""

    def __init__(self, path: object, why: str) -> None:
        self.path = path
        self.why = why
        super().__init__(f"Control connection to {path} failed: {why}.")


class SummaryError(SupervisorError):
    """A result from the daemon does not have the shape this client expects."""

    def __init__(self, kind: str, where: str, why: str) -> None:
        self.kind = kind
        self.where = where
        self.why = why
        super().__init__(f"The daemon's {kind} is not what this client expects: {where} {why}.")


class WebhookSecretError(SupervisorError):
    """A Standard Webhooks signing secret (a destination's ``secret_file``) is not usable.

    The message names the file, the line and what is wrong with the value (its length,
    its prefix or its encoding), never the secret itself.
    """

    def __init__(self, source: str, line: int | None, why: str) -> None:
        self.source = source
        self.line = line
        self.why = why
        where = source if line is None else f"{source} line {line}"
        super().__init__(
            f"Webhook secret in {where} is not usable: {why}; the secret itself is not shown."
        )


class WebhookSignatureError(SupervisorError):
    """A signed webhook request did not verify (Standard Webhooks 1.0): a header is
    missing or malformed, its timestamp is outside the tolerance, or no signature
    matches any of the keys."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(f"Webhook request does not verify: {why}.")
