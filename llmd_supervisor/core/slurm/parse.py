"""Pure parsers for the text Slurm 22.05 client commands print.

Nothing here runs a command or touches a file: every function takes the text a command
printed and returns typed data. Malformed text raises :class:`SlurmParseError` (or its
subclass :class:`SlurmJobNotFound`); a job state that is not in the table parses as
``JobState.UNKNOWN`` with the raw text kept. No other exception escapes these parsers.

Batched squeue and sacct answers (``parse_squeue_batch``, ``parse_sacct_batch``) keep a
record that does not parse to its own job (`core.slurm.records`), and the formats the
client asks for hold no job or step name: a name is the job's own text, and one holding
a newline broke every job's poll (and could forge another job's row).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from llmd_supervisor.core.slurm.records import Batch, Rejected, parse_batch
from llmd_supervisor.errors import SlurmJobNotFound, SlurmParseError

__all__ = [
    "SACCT_FIELDS",
    "SQUEUE_FORMAT",
    "Batch",
    "ExitCode",
    "JobState",
    "ParsedState",
    "Rejected",
    "SacctRow",
    "SbatchResult",
    "ScontrolConfig",
    "ScontrolJob",
    "SqueueRow",
    "accounting_disabled",
    "allocation_row",
    "invalid_job_id",
    "job_rows",
    "parse_exit_code",
    "parse_sacct",
    "parse_sacct_batch",
    "parse_sbatch_parsable",
    "parse_scontrol_config",
    "parse_scontrol_job",
    "parse_squeue",
    "parse_squeue_batch",
    "parse_state",
]


class JobState(StrEnum):
    """Every job state Slurm 22.05 prints (``job_state_string``), plus UNKNOWN."""

    BOOT_FAIL = "BOOT_FAIL"  # terminated: a node failed to boot
    CANCELLED = "CANCELLED"  # terminated by scancel or an admin (sacct adds "by <uid>")
    COMPLETED = "COMPLETED"  # every process ended with exit code 0 on every node
    COMPLETING = "COMPLETING"  # ended, but some nodes are still cleaning up
    CONFIGURING = "CONFIGURING"  # allocated, nodes still booting/configuring
    DEADLINE = "DEADLINE"  # terminated on reaching its --deadline
    FAILED = "FAILED"  # ended with a nonzero exit code or other failure
    NODE_FAIL = "NODE_FAIL"  # terminated because an allocated node failed
    OUT_OF_MEMORY = "OUT_OF_MEMORY"  # a step hit its memory limit (cgroup OOM)
    PENDING = "PENDING"  # waiting for resources
    PREEMPTED = "PREEMPTED"  # terminated by preemption
    RUNNING = "RUNNING"  # holds its allocation and runs
    REQUEUED = "REQUEUED"  # being put back in the queue (becomes PENDING)
    REQUEUE_FED = "REQUEUE_FED"  # being requeued by a federation
    REQUEUE_HOLD = "REQUEUE_HOLD"  # requeued and held
    RESIZING = "RESIZING"  # its allocation is changing size
    RESV_DEL_HOLD = "RESV_DEL_HOLD"  # held because its reservation was deleted
    REVOKED = "REVOKED"  # sibling revoked: the job runs on another federated cluster
    SIGNALING = "SIGNALING"  # outgoing signal pending
    SPECIAL_EXIT = "SPECIAL_EXIT"  # requeued in held state after a special exit value
    STAGE_OUT = "STAGE_OUT"  # staging out burst-buffer data
    STOPPED = "STOPPED"  # SIGSTOPped, still holding its allocation
    SUSPENDED = "SUSPENDED"  # suspended, allocation kept
    TIMEOUT = "TIMEOUT"  # terminated on reaching its time limit
    UNKNOWN = "UNKNOWN"  # not in this table: never a success, never "still running"

    @property
    def is_terminal(self) -> bool:
        """The job has ended for good in this state (UNKNOWN is not terminal)."""
        return self in _TERMINAL

    @property
    def is_active(self) -> bool:
        """The job is queued, held, or holds an allocation (UNKNOWN is not active)."""
        return not self.is_terminal and self is not JobState.UNKNOWN


_TERMINAL = frozenset(
    {
        JobState.BOOT_FAIL,
        JobState.CANCELLED,
        JobState.COMPLETED,
        JobState.DEADLINE,
        JobState.FAILED,
        JobState.NODE_FAIL,
        JobState.OUT_OF_MEMORY,
        JobState.PREEMPTED,
        JobState.REVOKED,
        JobState.TIMEOUT,
    }
)
_STATE_BY_NAME = {member.value: member for member in JobState}
# sacct appends "by <uid>" to CANCELLED; non-parsable output truncates long cells with "+".
_STATE_RE = re.compile(r"([A-Z_]+)(?: BY ([0-9]{1,10}))?(\+)?", re.ASCII)


@dataclass(frozen=True)
class ParsedState:
    """A job state as read, with the text it came from."""

    state: JobState
    raw: str
    cancelled_by: str | None = None  # the uid in "CANCELLED by <uid>"
    truncated: bool = False  # the cell ended in "+" (cut by a fixed-width column)

    @property
    def exact(self) -> bool:
        """The text was exactly the state's name: no suffix, no truncation, no case change."""
        return self.raw.strip() == self.state.value


def parse_state(text: str) -> ParsedState:
    """Normalise a Slurm state cell; never raises.

    ``CANCELLED by 0`` becomes CANCELLED (uid kept), a trailing ``+`` marks truncation,
    surrounding whitespace is ignored and case is folded. Anything not in the table is
    ``JobState.UNKNOWN`` with the raw text kept.
    """
    match = _STATE_RE.fullmatch(text.strip().upper())
    if match is None:
        return ParsedState(JobState.UNKNOWN, text)
    state = _STATE_BY_NAME.get(match.group(1), JobState.UNKNOWN)
    by = match.group(2)
    if by is not None and state is not JobState.CANCELLED:
        return ParsedState(JobState.UNKNOWN, text)
    return ParsedState(state, text, cancelled_by=by, truncated=match.group(3) is not None)


@dataclass(frozen=True, order=True)
class ExitCode:
    """A Slurm ``status:signal`` exit code."""

    status: int
    signal: int

    @property
    def is_zero(self) -> bool:
        """Both the exit status and the signal are 0."""
        return self.status == 0 and self.signal == 0

    def __str__(self) -> str:
        return f"{self.status}:{self.signal}"


_EXIT_RE = re.compile(r"([0-9]{1,10}):([0-9]{1,10})", re.ASCII)


def parse_exit_code(text: str) -> ExitCode:
    """Parse ``a:b`` (exit status, signal); raises SlurmParseError on anything else."""
    match = _EXIT_RE.fullmatch(text.strip())
    if match is None:
        raise SlurmParseError("ExitCode", text, "expected <status>:<signal> in decimal")
    return ExitCode(int(match.group(1)), int(match.group(2)))


def _optional_exit_code(text: str) -> ExitCode | None:
    return None if text.strip() == "" else parse_exit_code(text)


# --- sbatch --------------------------------------------------------------------------------

_JOB_ID_RE = re.compile(r"[0-9]{1,18}", re.ASCII)


@dataclass(frozen=True)
class SbatchResult:
    """What ``sbatch --parsable`` printed: the job id and, with federation, the cluster."""

    job_id: str
    cluster: str | None


def parse_sbatch_parsable(text: str) -> SbatchResult:
    """Parse ``sbatch --parsable`` stdout: ``123`` or ``123;cluster`` (newline allowed)."""
    body = text.strip()
    job_id, sep, cluster = body.partition(";")
    if not _JOB_ID_RE.fullmatch(job_id):
        raise SlurmParseError("sbatch --parsable", text, "expected a numeric job id")
    if sep and not re.fullmatch(r"[A-Za-z0-9_.-]+", cluster, re.ASCII):
        raise SlurmParseError("sbatch --parsable", text, "expected a cluster name after ';'")
    return SbatchResult(job_id, cluster if sep else None)


# --- squeue --------------------------------------------------------------------------------

SQUEUE_FORMAT = "%i|%T|%N|%r"
"""Use as ``squeue --noheader --format=SQUEUE_FORMAT``: id, long state, nodes, reason (last:
slurmctld's free text; a '|' in it stays in it). No name: that is the job's own text."""

_SQUEUE_JOB_ID_RE = re.compile(r"[0-9]{1,18}(?:[_+]\S*)?", re.ASCII)
_SQUEUE_TOKENS = frozenset({"%i", "%T", "%r", "%N", "%j"})


@dataclass(frozen=True)
class SqueueRow:
    """One ``squeue`` line in :data:`SQUEUE_FORMAT` (or another format of its tokens)."""

    job_id: str
    state: ParsedState
    reason: str
    node_list: str
    raw: str
    name: str = ""  # only when the format has %j (the captures')


def _squeue_tokens(fmt: str) -> tuple[str, ...]:
    tokens = tuple(fmt.split("|"))
    known = set(tokens) <= _SQUEUE_TOKENS and len(set(tokens)) == len(tokens)
    if not known or tokens[0] != "%i" or "%T" not in tokens:
        raise ValueError(f"squeue format {fmt!r}: %i first, %T, any of %r %N %j, '|' between")
    return tokens


def parse_squeue_batch(text: str, fmt: str = SQUEUE_FORMAT) -> Batch[SqueueRow]:
    """Parse ``squeue --noheader --format=<fmt>`` output, a bad record kept to its job.

    The last column takes any further '|'. `fmt` is :data:`SQUEUE_FORMAT` or another
    '|'-separated list of %i (first), %T, %r, %N, %j (ValueError otherwise)."""
    tokens = _squeue_tokens(fmt)

    def row(line: str) -> SqueueRow:
        cells = line.split("|", len(tokens) - 1)
        if len(cells) != len(tokens):
            why = f"expected {len(tokens)} '|'-separated cells, got {len(cells)}"
            raise SlurmParseError("squeue", line, why)
        by = dict(zip(tokens, cells, strict=True))
        if not _SQUEUE_JOB_ID_RE.fullmatch(by["%i"]):
            raise SlurmParseError("squeue", line, f"job id {by['%i']!r} is not a Slurm job id")
        return SqueueRow(
            by["%i"], parse_state(by["%T"]), by.get("%r", ""), by.get("%N", ""), line,
            by.get("%j", ""),
        )  # fmt: skip

    return parse_batch(text, "squeue", row)


def parse_squeue(text: str, fmt: str = SQUEUE_FORMAT) -> list[SqueueRow]:
    """Like :func:`parse_squeue_batch`, but any bad record rejects the whole text
    (SlurmParseError); blank lines are skipped."""
    return parse_squeue_batch(text, fmt).strict()


# --- sacct ---------------------------------------------------------------------------------

SACCT_FIELDS = (
    "JobIDRaw",
    "JobID",
    "State",
    "ExitCode",
    "DerivedExitCode",
    "Reason",
    "NodeList",
    "Submit",
    "Start",
    "End",
    "Elapsed",
)
"""Use as ``sacct --parsable2 --noheader --format=`` + ``",".join(SACCT_FIELDS)``. No field
holds text a job chose: JobName (the job's and its steps' names) is left out."""

_SACCT_JOB_ID_RAW_RE = re.compile(r"[0-9]{1,18}(?:\.[A-Za-z0-9_+-]+)?", re.ASCII)


@dataclass(frozen=True)
class SacctRow:
    """One ``sacct`` line in :data:`SACCT_FIELDS` order; times are kept as Slurm printed them."""

    job_id_raw: str
    job_id: str
    state: ParsedState
    exit_code: ExitCode | None  # empty on the step rows of a NODE_FAIL job
    derived_exit_code: ExitCode | None  # empty on step rows
    reason: str
    node_list: str
    submit: str
    start: str
    end: str
    elapsed: str
    job_name: str  # "" unless the text had JobName last (the captures, receipts before 3.2)
    raw: str

    @property
    def is_step(self) -> bool:
        """A step row (``.batch``, ``.extern``, ``.0``...), not the allocation."""
        return "." in self.job_id_raw


def _sacct_row(line: str) -> SacctRow:
    n = len(SACCT_FIELDS)
    cells = line.split("|", n)
    if len(cells) < n:
        why = f"expected {n} '|'-separated cells ({n + 1} with JobName), got {len(cells)}"
        raise SlurmParseError("sacct", line, why)
    raw_id, job_id, state, exit_code, derived, reason, nodes, submit, start, end = cells[:10]
    if not _SACCT_JOB_ID_RAW_RE.fullmatch(raw_id):
        raise SlurmParseError("sacct", line, f"JobIDRaw {raw_id!r} is not a Slurm job id")
    return SacctRow(
        job_id_raw=raw_id,
        job_id=job_id,
        state=parse_state(state),
        exit_code=_optional_exit_code(exit_code),
        derived_exit_code=_optional_exit_code(derived),
        reason=reason,
        node_list=nodes,
        submit=submit,
        start=start,
        end=end,
        elapsed=cells[10],
        job_name=cells[11] if len(cells) > n else "",
        raw=line,
    )


def parse_sacct_batch(text: str) -> Batch[SacctRow]:
    """Parse ``sacct --parsable2 --noheader --format=<SACCT_FIELDS>`` output, a record that
    does not parse (a missing field, a malformed exit code, a line break) kept to its job.

    A row may hold one more field, JobName, last (the captures; receipts written before
    3.2): a ``|`` inside it stays part of it.
    """
    return parse_batch(text, "sacct", _sacct_row)


def parse_sacct(text: str) -> list[SacctRow]:
    """Like :func:`parse_sacct_batch`, but one record that does not parse rejects the
    whole text with SlurmParseError: for one job's rows, a half-understood answer is not
    evidence. Blank lines are skipped."""
    return parse_sacct_batch(text).strict()


def allocation_row(rows: Iterable[SacctRow], job_id: str) -> SacctRow | None:
    """The allocation row of a plain (non-array, non-heterogeneous) job, or None.

    A row matches only if both JobIDRaw and JobID equal ``job_id`` exactly: that excludes
    steps (``123.batch``, ``123.extern``, ``123.0``) and the array task / het component
    that shares the raw id (JobID ``123_4`` or ``123+0`` with JobIDRaw ``123``). If sacct
    lists the id more than once (``--duplicates`` after a requeue), the last row wins:
    sacct prints records oldest first.
    """
    found: SacctRow | None = None
    for row in rows:
        if row.job_id_raw == job_id and row.job_id == job_id and not row.is_step:
            found = row
    return found


def job_rows(rows: Iterable[SacctRow], job_id: str) -> list[SacctRow]:
    """The allocation row and every step row of ``job_id`` (for the receipt), in order."""
    prefix = job_id + "."
    return [r for r in rows if r.job_id_raw == job_id or r.job_id_raw.startswith(prefix)]


def accounting_disabled(stderr: str) -> bool:
    """sacct's stderr says accounting storage is disabled (AccountingStorageType=none)."""
    return "accounting storage is disabled" in stderr.lower()


def invalid_job_id(text: str) -> bool:
    """scontrol/squeue said the job id is unknown (purged after MinJobAge, or never existed)."""
    return "invalid job id specified" in text.lower()


# --- scontrol show job ---------------------------------------------------------------------

# A key starts at the beginning or after whitespace, is identifier-like (Slurm keys include
# "AllocNode:Sid", "CPUs/Task", "ReqB:S:C:T") and is followed by "=".
_KEY_RE = re.compile(r"(?<!\S)([A-Za-z][A-Za-z0-9_-]*(?:[:/][A-Za-z0-9_*]+)*)=", re.ASCII)

# Values that are free text (paths, commands, names, comments) and may contain " Word=".
_FREE_TEXT_KEYS = frozenset(
    {
        "AdminComment",
        "Command",
        "Comment",
        "JobName",
        "Reason",
        "StdErr",
        "StdIn",
        "StdOut",
        "SystemComment",
        "WorkDir",
    }
)

# Every key ``scontrol show job`` prints in 22.05 (slurm_sprint_job_info) and 24.11 (which
# adds ReqTRES and AllocTRES and drops TRES and Power), so that a " Word=" inside a
# free-text value can be told apart from a real key.
_KNOWN_JOB_KEYS_TEXT = """
    JobId ArrayJobId ArrayTaskId ArrayTaskThrottle HetJobId HetJobOffset HetJobIdSet
    JobName UserId GroupId MCS_label Priority Nice Account QOS WCKey JobState Reason
    FailedNode Dependency Requeue Restarts BatchFlag Reboot ExitCode DerivedExitCode
    RunTime TimeLimit TimeMin SubmitTime EligibleTime AccrueTime StartTime EndTime
    Deadline PreemptEligibleTime PreemptTime SuspendTime SecsPreSuspend LastSchedEval
    ResizeTime Scheduler Partition AllocNode:Sid ReqNodeList ExcNodeList NodeList
    BatchHost SchedNodeList NumNodes NumCPUs NumTasks CPUs/Task ReqB:S:C:T TRES
    Socks/Node NtasksPerN:B:S:C CoreSpec ThreadSpec Nodes CPU_IDs Mem GRES JOB_GRES
    MinCPUsNode MinMemoryCPU MinMemoryNode MinTmpDiskNode Features ClusterFeatures
    DelayBoot Reservation OverSubscribe Contiguous Licenses Network Command WorkDir
    AdminComment SystemComment Comment StdErr StdIn StdOut BurstBuffer
    BurstBufferState CpuFreqMin CpuFreqMax CpuFreqGov Power MailUser MailType
    CPUsPerTres MemPerTres TresBind TresFreq TresPerJob TresPerNode TresPerSocket
    TresPerTask NtasksPerTRES Switches Wait-for-Switch KillOInInvalidDependent
    SpreadJob Container SiblingsActive SiblingsViable SiblingsActiveRaw
    SiblingsViableRaw FedOrigin FedViableSiblings FedActiveSiblings FedOriginRaw
    FedViableSiblingsRaw FedActiveSiblingsRaw LicensesAlloc Selinux ReqTRES AllocTRES
"""
_KNOWN_JOB_KEYS = frozenset(_KNOWN_JOB_KEYS_TEXT.split())

# Keys this module exposes; if one of them appears twice the record is ambiguous.
_EXPOSED_JOB_KEYS = (
    "JobId",
    "JobName",
    "JobState",
    "ExitCode",
    "DerivedExitCode",
    "Reason",
    "NodeList",
    "Restarts",
    "RunTime",
    "StartTime",
    "EndTime",
    # who owns the job and where its batch logs are (`adopt`, foreign jobs): a job name or
    # comment holding " UserId=0(root)" or " StdOut=/etc/shadow" is refused, never taken
    "UserId",
    "StdOut",
    "StdErr",
    "WorkDir",
)
_USER_ID_RE = re.compile(r"[^()\s]*\(([0-9]{1,10})\)", re.ASCII)


@dataclass(frozen=True)
class ScontrolJob:
    """One ``scontrol show job --oneliner`` record."""

    job_id: str
    job_name: str
    state: ParsedState
    exit_code: ExitCode
    derived_exit_code: ExitCode | None  # 22.05 omits it while the job is pending/running
    reason: str
    node_list: str
    restarts: int | None
    run_time: str
    start_time: str
    end_time: str
    fields: Mapping[str, str]
    raw: str

    @property
    def user_id(self) -> int | None:
        """The owner's uid from ``UserId=name(uid)`` (None: absent or not that form)."""
        m = _USER_ID_RE.fullmatch(self.fields.get("UserId", ""))
        return int(m.group(1)) if m else None

    @property
    def batch_logs(self) -> tuple[str, ...]:
        """The batch script's StdOut and StdErr paths, as Slurm expanded them (absolute
        paths only; the same file once)."""
        paths = (self.fields.get("StdOut", ""), self.fields.get("StdErr", ""))
        return tuple(dict.fromkeys(p for p in paths if p.startswith("/")))


def _split_keys(line: str) -> list[tuple[str, str]]:
    """Split ``Key=Value Key=Value`` where values may contain spaces."""
    matches = list(_KEY_RE.finditer(line))
    if not matches or matches[0].start() != 0:
        raise SlurmParseError("scontrol show job", line, "expected the record to start with Key=")
    keys: list[tuple[str, int, int]] = []  # key, where the key starts, where its value starts
    for m in matches:
        if keys and keys[-1][0] in _FREE_TEXT_KEYS and m.group(1) not in _KNOWN_JOB_KEYS:
            continue  # " Foo=bar" inside a command line or comment, not a key of its own
        keys.append((m.group(1), m.start(), m.end()))
    ends = [start for _, start, _ in keys[1:]] + [len(line)]
    return [(k, line[value:end].rstrip()) for (k, _, value), end in zip(keys, ends, strict=True)]


def parse_scontrol_job(text: str) -> ScontrolJob:
    """Parse ``scontrol show job --oneliner <id>`` output holding exactly one job record.

    Values may contain spaces. A key is an identifier-like word (``AllocNode:Sid``,
    ``CPUs/Task`` included) at the start or after whitespace, followed by ``=``. After a
    free-text value (Command, Comment, JobName, Reason, WorkDir, Std*), a ``Word=`` that is
    not a key Slurm 22.05 or 24.11 prints is taken as part of that value. The remaining
    ambiguity — free text containing a real key such as `` JobState=COMPLETED`` — is refused, not
    guessed: if any exposed key (JobId, JobState, ExitCode, ...) appears twice the output
    raises SlurmParseError, so a comment can never forge a state. Other duplicated keys
    keep their first value.

    Raises SlurmJobNotFound for "Invalid job id specified", SlurmParseError otherwise.
    """
    if invalid_job_id(text):
        raise SlurmJobNotFound("scontrol show job", text)
    lines = _lines(text)
    if len(lines) != 1:
        raise SlurmParseError(
            "scontrol show job", text, f"expected one --oneliner record, got {len(lines)} lines"
        )
    line = lines[0].strip()
    pairs = _split_keys(line)
    fields: dict[str, str] = {}
    for key, value in pairs:
        if key in fields and key in _EXPOSED_JOB_KEYS:
            raise SlurmParseError(
                "scontrol show job", line, f"key {key} appears twice; a value probably contains it"
            )
        fields.setdefault(key, value)
    for required in ("JobId", "JobState", "ExitCode"):
        if required not in fields:
            raise SlurmParseError("scontrol show job", line, f"no {required}= in the record")
    if not _JOB_ID_RE.fullmatch(fields["JobId"]):
        why = f"JobId {fields['JobId']!r} is not numeric"
        raise SlurmParseError("scontrol show job", line, why)
    restarts = fields.get("Restarts")
    if restarts is not None and not _JOB_ID_RE.fullmatch(restarts):
        raise SlurmParseError("scontrol show job", line, f"Restarts {restarts!r} is not a count")
    return ScontrolJob(
        job_id=fields["JobId"],
        job_name=fields.get("JobName", ""),
        state=parse_state(fields["JobState"]),
        exit_code=parse_exit_code(fields["ExitCode"]),
        derived_exit_code=_optional_exit_code(fields.get("DerivedExitCode", "")),
        reason=fields.get("Reason", ""),
        node_list=fields.get("NodeList", ""),
        restarts=None if restarts is None else int(restarts),
        run_time=fields.get("RunTime", ""),
        start_time=fields.get("StartTime", ""),
        end_time=fields.get("EndTime", ""),
        fields=MappingProxyType(fields),
        raw=text,
    )


# --- scontrol show config ------------------------------------------------------------------

_CONFIG_LINE_RE = re.compile(r"([A-Za-z][A-Za-z0-9_()/.-]*)\s*=\s?(.*)", re.ASCII)
_SECONDS_RE = re.compile(r"([0-9]{1,12})(?: sec)?", re.ASCII)


@dataclass(frozen=True)
class ScontrolConfig:
    """The parts of ``scontrol show config`` the supervisor relies on."""

    min_job_age: int  # seconds a finished job stays visible to scontrol
    accounting_storage_type: str
    fields: Mapping[str, str]
    raw: str

    @property
    def accounting_enabled(self) -> bool:
        """Accounting storage is configured (sacct can answer)."""
        return self.accounting_storage_type != "accounting_storage/none"


def parse_scontrol_config(text: str) -> ScontrolConfig:
    """Parse ``scontrol show config``: ``Key = Value`` lines; other lines are ignored.

    MinJobAge (``300 sec`` or ``300``) and AccountingStorageType must be present, else
    SlurmParseError. A key repeated in a later section keeps its first value.
    """
    fields: dict[str, str] = {}
    for line in _lines(text):
        match = _CONFIG_LINE_RE.fullmatch(line.strip())
        if match is not None:
            fields.setdefault(match.group(1), match.group(2).strip())
    age_text = fields.get("MinJobAge")
    if age_text is None:
        raise SlurmParseError("scontrol show config", text, "no MinJobAge line")
    age = _SECONDS_RE.fullmatch(age_text)
    if age is None:
        why = f"MinJobAge {age_text!r} is not seconds"
        raise SlurmParseError("scontrol show config", text, why)
    storage = fields.get("AccountingStorageType")
    if not storage:
        raise SlurmParseError("scontrol show config", text, "no AccountingStorageType line")
    return ScontrolConfig(int(age.group(1)), storage, MappingProxyType(fields), text)


def _lines(text: str) -> Sequence[str]:
    """Non-blank lines without their line terminator."""
    return [line.rstrip("\r") for line in text.split("\n") if line.strip()]
