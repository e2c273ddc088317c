"""A scripted Slurm cluster that answers in the exact text of the captured real output.

`ReplayCluster` implements the `CommandRunner` protocol of
`llmd_supervisor.adapters.slurm.runner`, so a `SlurmClient` (and the poller and the run driver
on top of it) can run against it in milliseconds, with no cluster and no real-time sleeps.
It models a small cluster: `sbatch` submits jobs and hands out ids, each job follows a
timeline the test scripts (pending -> running on nodes -> an end state, requeues, purges,
accounting lag), and `squeue`, `sacct`, `scontrol` and `scancel` answer from that model.

Answers are rendered from the captures in ``tests/data/slurm`` (real Slurm 22.05 output,
see its INDEX.md): every sacct row, scontrol record and squeue line is a captured line with
the job's id, name, nodes, times and state put in, and error answers are the captured
texts. The formats the captures were taken with are read from INDEX.md and must hold every
column of `SQUEUE_FORMAT` / `SACCT_FIELDS` of `core/slurm/parse.py` and of the ``--format``
of every call (they may hold more: the job name, which the client no longer asks for); a
column the captures lack raises `ReplayError` ("re-capture"), so format drift cannot pass
unseen. Answers not in the captures (accounting disabled, slurmctld unreachable, scancel
of a finished job) are written from SLURM-FACTS.md or Slurm's source and marked as such.

Jobs have owners: the commands run as `ReplayCluster.user` (``id -un`` answers it; sbatch
submits as it), a job added with ``user=`` belongs to someone else, and ``--user=`` of
squeue and sacct selects by owner (sacct without it and without ``--jobs`` shows a
non-root caller only its own jobs, as its man page says). A job or step name is printed
as it is, a newline or a ``|`` included, as Slurm's ``print_fields_str`` and squeue's
``_print_str`` do (``printf("%s")``, no escaping; to be confirmed by the capture of
``hostile_names``).

Every argv is recorded (`calls`, `argvs(program)`, `count(program)`, `wait_calls`).
Typical use::

    cluster = ReplayCluster()
    client = SlurmClient(cluster)
    cluster.expect("llmd-r1", Start(("node1", "node2")), End("COMPLETED"))
    job_id = await client.sbatch(script)      # the job is PENDING
    cluster.step()                            # each job takes its next step: RUNNING
    cluster.advance(5.0)                      # or: move the fake clock; due steps apply
    cluster.fail("sacct", SACCT_DBD_DOWN)     # the next sacct fails as it really did

Time: `cluster.clock` is a `FakeClock` (UTC, starting at the real current second unless
given, because the daemon derives `sacct --starttime` from the wall clock); it stamps
Submit/Start/End and `CommandResult.started_at`, and only moves when the test says so.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Literal

import anyio
import anyio.lowlevel

from llmd_supervisor.adapters.slurm.runner import CommandResult
from llmd_supervisor.core.slurm.parse import SACCT_FIELDS, SQUEUE_FORMAT, JobState
from llmd_supervisor.core.spec.runspec import time_limit_seconds
from llmd_supervisor.errors import SlurmCommandError

__all__ = [
    "ACCOUNTING_DISABLED",
    "DATA",
    "EMPTY",
    "INVALID_JOB_ID",
    "SACCT_DBD_DOWN",
    "SLURMCTLD_DOWN",
    "SLURM_TIME",
    "TIMEOUT",
    "Captures",
    "End",
    "FakeClock",
    "Gate",
    "LagAccounting",
    "Purge",
    "ReplayCluster",
    "ReplayError",
    "ReplayJob",
    "Reply",
    "Requeue",
    "SetState",
    "Start",
    "Step",
    "SyncAccounting",
    "hostlist",
]

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm"
SLURM_TIME = "%Y-%m-%dT%H:%M:%S"  # how Slurm prints times (local time, no zone)


class ReplayError(AssertionError):
    """The test or the client asked for something the captures cannot answer."""


# --- replies ----------------------------------------------------------------------------------


QOS_REFUSAL = (
    "sbatch: error: QOSMaxSubmitJobPerUserLimit\n"
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy "
    "(job submit limit, user's size and/or time limits)\n"
)


@dataclass(frozen=True)
class Reply:
    """One scripted answer: what the command prints and how it exits.

    `timeout` makes the call raise `SlurmCommandError` as `LocalRunner` does when the time
    limit passes. `applied` carries out the command's effect first (an sbatch whose job
    was submitted although its answer was lost; a scancel that landed but failed).
    """

    returncode: int = 0
    stdout: str = ""
    stderr: str = ""
    timeout: bool = False
    applied: bool = False

    @classmethod
    def captured(cls, name: str) -> Reply:
        """A capture in the ``rc=`` / ``--- stdout`` / ``--- stderr`` layout."""
        return Captures.load().command(name)


# --- the captures -------------------------------------------------------------------------------


class Captures:
    """The captured texts, and the formats they were taken with (from INDEX.md)."""

    def __init__(self, directory: Path = DATA) -> None:
        self.directory = directory
        index = (directory / "INDEX.md").read_text(encoding="utf-8")
        squeue = re.search(r"squeue format: `squeue --noheader --format=([^`]+)`", index)
        sacct = re.search(r"sacct fields: `sacct [^`]*--format=([^` ]+)`", index)
        if squeue is None or sacct is None:
            raise ReplayError(f"{directory}/INDEX.md no longer names the capture formats")
        self.squeue_format = squeue.group(1)
        self.sacct_fields = tuple(sacct.group(1).split(","))
        self.squeue_tokens = tuple(self.squeue_format.split("|"))
        lacking = [t for t in SQUEUE_FORMAT.split("|") if t not in self.squeue_tokens]
        lacking += [f for f in SACCT_FIELDS if f not in self.sacct_fields]
        if lacking:
            raise ReplayError(
                f"format drift: {directory} was captured with squeue {self.squeue_format!r} "
                f"and sacct {','.join(self.sacct_fields)!r}, without {lacking} that "
                f"core/slurm/parse.py asks for ({SQUEUE_FORMAT!r}, {','.join(SACCT_FIELDS)!r}); "
                "re-run deploy/devcluster/capture-slurm-outputs"
            )

    @staticmethod
    def load() -> Captures:
        """The captures in tests/data/slurm (read once)."""
        return _default_captures()

    def text(self, name: str) -> str:
        return (self.directory / name).read_text(encoding="utf-8")

    def lines(self, name: str) -> list[str]:
        return [line for line in self.text(name).split("\n") if line.strip()]

    def command(self, name: str) -> Reply:
        head, _, rest = self.text(name).partition("\n--- stdout\n")
        stdout, _, stderr = rest.partition("--- stderr\n")
        if not head.startswith("rc="):
            raise ReplayError(f"{name} is not an rc=/stdout/stderr capture")
        return Reply(int(head.removeprefix("rc=")), stdout, stderr)

    def squeue_cells(self, name: str) -> list[list[str]]:
        rows = [line.split("|", len(self.squeue_tokens) - 1) for line in self.lines(name)]
        for row in rows:
            if len(row) != len(self.squeue_tokens):
                raise ReplayError(f"{name}: {row} does not have the cells of {self.squeue_format}")
        return rows

    def sacct_rows(self, name: str) -> list[dict[str, str]]:
        n = len(self.sacct_fields)
        rows: list[dict[str, str]] = []
        for line in self.lines(name):
            cells = line.split("|", n - 1)
            if len(cells) != n:
                raise ReplayError(f"{name}: {line!r} does not have the {n} sacct fields")
            rows.append(dict(zip(self.sacct_fields, cells, strict=True)))
        return rows

    def squeue_text(self, name: str, fmt: str = SQUEUE_FORMAT) -> str:
        """A captured squeue file as `fmt` prints it (the captures may hold more columns)."""
        tokens = fmt.split("|")
        rows = [dict(zip(self.squeue_tokens, c, strict=True)) for c in self.squeue_cells(name)]
        return "".join("|".join(row[t] for t in tokens) + "\n" for row in rows)

    def sacct_text(self, name: str, fields: Sequence[str] = SACCT_FIELDS) -> str:
        """A captured sacct file as `fields` print it (the captures may hold more fields)."""
        return "".join("|".join(row[f] for f in fields) + "\n" for row in self.sacct_rows(name))

    def scontrol_record(self, name: str) -> str:
        (line,) = self.lines(name)
        return line

    def end_case(
        self, state: JobState, *, exit_code: str | None = None, restarted: bool = False
    ) -> str:
        """The captured case to replay for a job ending in `state`: one that ended so (with
        that sacct ExitCode and requeue history, when there is one), else `completed`."""
        cases: list[tuple[int, str]] = []
        for path in sorted(self.directory.glob("*.scontrol.txt")):
            case = path.name.removesuffix(".scontrol.txt")
            if not (self.directory / f"{case}.sacct.txt").exists():
                continue  # not an end case (running, requeued_pending)
            record = self.scontrol_record(path.name)
            if JobState(_record_value(record, "JobState")) is not state:
                continue
            alloc = self.sacct_rows(f"{case}.sacct.txt")[0]
            misses = (exit_code is not None and alloc["ExitCode"] != exit_code) + (
                (_record_value(record, "Restarts") != "0") != restarted
            )
            cases.append((misses, case))
        return min(cases)[1] if cases else "completed"


@cache
def _default_captures() -> Captures:
    return Captures()


def _captured(name: str) -> Reply:
    return Reply.captured(name)


# Captured on the dev cluster:
SACCT_DBD_DOWN = _captured("sacct_dbd_down.txt")  # slurmdbd stopped
INVALID_JOB_ID = _captured("squeue_invalid_job.txt")  # squeue -j <purged or unknown id>
_SCONTROL_INVALID = _captured("scontrol_invalid_job.txt")
# Not producible in a capture run; texts from SLURM-FACTS.md and Slurm 22.05's messages:
ACCOUNTING_DISABLED = Reply(1, "", "sacct: error: Slurm accounting storage is disabled\n")
SLURMCTLD_DOWN = Reply(
    1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"
)
TIMEOUT = Reply(timeout=True)
EMPTY = Reply(0, "", "")


_RUNNING_CASE_JOB = "25"  # in running.sacct.txt: an allocation with its batch and srun steps


# --- time -------------------------------------------------------------------------------------


class FakeClock:
    """A UTC clock that moves only when told."""

    def __init__(self, start: datetime | None = None) -> None:
        now = start if start is not None else datetime.now(UTC).replace(microsecond=0)
        if now.tzinfo is None:
            raise ValueError("FakeClock needs an aware datetime")
        self._now = now.astimezone(UTC)

    def now(self) -> datetime:
        return self._now

    def set(self, moment: datetime) -> None:
        if moment < self._now:
            raise ValueError("the clock does not go back")
        self._now = moment

    def advance(self, seconds: float) -> None:
        self.set(self._now + timedelta(seconds=seconds))


def _slurm_time(moment: datetime | None) -> str:
    return "Unknown" if moment is None else moment.astimezone().strftime(SLURM_TIME)


def _elapsed(start: datetime | None, end: datetime | None, *, seconds: int = 0) -> str:
    """[D-]HH:MM:SS from start to end (or of `seconds`), as sacct and scontrol print it."""
    if start is not None and end is not None:
        seconds = max(0, int((end - start).total_seconds()))
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def hostlist(nodes: Sequence[str]) -> str:
    """Compress host names as Slurm prints them: node1,node2,node4 -> node[1-2,4]."""
    entries: list[tuple[str, list[str]]] = []  # (prefix, numbers); no numbers: a plain name
    groups: dict[str, list[str]] = {}
    for node in nodes:
        m = re.fullmatch(r"(.*?)(\d+)", node)
        if m is None:
            entries.append((node, []))
        elif m.group(1) in groups:
            groups[m.group(1)].append(m.group(2))
        else:
            groups[m.group(1)] = [m.group(2)]
            entries.append((m.group(1), groups[m.group(1)]))
    parts: list[str] = []
    for prefix, numbers in entries:
        if len(numbers) <= 1:
            parts.append(prefix + "".join(numbers))
            continue
        ranges: list[str] = []
        i = 0
        while i < len(numbers):
            j = i
            while j + 1 < len(numbers) and int(numbers[j + 1]) == int(numbers[j]) + 1:
                j += 1
            ranges.append(numbers[i] if i == j else f"{numbers[i]}-{numbers[j]}")
            i = j + 1
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)


# --- what a job goes through ------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One scripted change of a job, `after` seconds (fake clock) after the previous one."""

    after: float = field(default=0.0, kw_only=True)

    def apply(self, job: ReplayJob) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Start(Step):
    """The job gets its nodes and runs."""

    nodes: tuple[str, ...] = ("node1",)

    def apply(self, job: ReplayJob) -> None:
        job.start(self.nodes)


@dataclass(frozen=True)
class End(Step):
    """The job ends in `state`; exit codes and reasons are the captured ones for that state
    unless given (`exit_code` sets sacct's and scontrol's ExitCode, e.g. FAILED "7:0")."""

    state: JobState | str = JobState.COMPLETED
    exit_code: str | None = None
    derived_exit_code: str | None = None

    def apply(self, job: ReplayJob) -> None:
        job.end(self.state, exit_code=self.exit_code, derived_exit_code=self.derived_exit_code)


@dataclass(frozen=True)
class Requeue(Step):
    """Slurm requeues the job: same id, PENDING again without nodes, Restarts + 1."""

    previous: JobState | str = JobState.NODE_FAIL  # how sacct --duplicates ends the attempt

    def apply(self, job: ReplayJob) -> None:
        job.requeue(self.previous)


@dataclass(frozen=True)
class SetState(Step):
    """Any other state (COMPLETING, REQUEUED, SUSPENDED, ...), nodes kept."""

    state: JobState | str = JobState.COMPLETING

    def apply(self, job: ReplayJob) -> None:
        job.set_state(self.state)


@dataclass(frozen=True)
class Purge(Step):
    """slurmctld forgets the job (MinJobAge after its end); accounting keeps it."""

    def apply(self, job: ReplayJob) -> None:
        job.purge()


@dataclass(frozen=True)
class LagAccounting(Step):
    """sacct stops following the job: it keeps answering what it last knew."""

    def apply(self, job: ReplayJob) -> None:
        job.lag_accounting()


@dataclass(frozen=True)
class SyncAccounting(Step):
    """sacct catches up with the job and follows it again."""

    def apply(self, job: ReplayJob) -> None:
        job.sync_accounting()


@dataclass(frozen=True)
class _Facts:
    """What one side (slurmctld, or slurmdbd for sacct) holds about the job's attempt."""

    state: JobState
    submit: datetime
    nodes: tuple[str, ...] = ()
    start: datetime | None = None
    end: datetime | None = None
    restarts: int = 0
    ran: bool = False  # it got nodes (a job cancelled while pending has no steps)
    case: str | None = None  # the captured end case whose rows are replayed
    sacct_exit: str = "0:0"
    derived_exit: str = "0:0"
    scontrol_exit: str = "0:0"
    batch_exit: str | None = None  # the .batch step's ExitCode when it differs from the capture


class ReplayJob:
    """One job of the replayed cluster; change it directly or through its timeline."""

    def __init__(
        self,
        cluster: ReplayCluster,
        job_id: str,
        name: str,
        *,
        script: str = "",
        options: Sequence[str] = (),
        steps: Iterable[Step] = (),
        lag_accounting: bool = False,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.cluster = cluster
        self.job_id = job_id
        self.name = name  # printed as it is: a newline or a '|' in it too
        self.user = user or cluster.user  # who submitted it (squeue/sacct --user)
        self.step_name: str | None = None  # the srun steps' name (srun --job-name); None: captured
        self.script = script  # the batch script sbatch read from stdin
        self.options = tuple(options)  # sbatch's argv options
        # The environment sbatch ran in when it was not the daemon's (`submit --export-env`,
        # a script campaign's variables): the job's, as sbatch's --export=ALL hands it on.
        self.env = None if env is None else dict(env)
        self.signals: list[str] = []  # every scancel, in order: "TERM", ..., "KILL"
        # Reactions to scancel: they replace the rest of the timeline. Plain scancel
        # cancels at once by default; --signal=TERM changes nothing unless scripted (the
        # workload decides how its job ends).
        self.on_term: tuple[Step, ...] | None = None
        self.on_kill: tuple[Step, ...] | None = (End(JobState.CANCELLED),)
        self.purged = False
        self._ctld = _Facts(JobState.PENDING, cluster.clock.now())
        self._acct: _Facts | None = None if lag_accounting else self._ctld
        self._lagging = lag_accounting
        self.history: list[_Facts] = []  # accounting records of earlier attempts (requeues)
        self._steps: list[Step] = list(steps)
        self._anchor = cluster.clock.now()

    def __repr__(self) -> str:
        return f"ReplayJob({self.job_id}, {self.name!r}, {self.state.value})"

    # --- what it is --------------------------------------------------------------------

    @property
    def state(self) -> JobState:
        return self._ctld.state

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._ctld.nodes

    @property
    def restarts(self) -> int:
        return self._ctld.restarts

    @property
    def accounting_state(self) -> JobState | None:
        """What sacct would say (None: sacct does not list the job yet)."""
        return None if self._acct is None else self._acct.state

    @property
    def steps_left(self) -> tuple[Step, ...]:
        return tuple(self._steps)

    @property
    def submitted_at(self) -> datetime:
        """The fake clock's time of its (last) submission."""
        return self._ctld.submit

    @property
    def ended_at(self) -> datetime | None:
        """The fake clock's time it ended (None: pending or running)."""
        return self._ctld.end

    # --- changes -------------------------------------------------------------------------

    def start(self, nodes: Sequence[str]) -> None:
        if not nodes:
            raise ReplayError("a running job has nodes")
        self._set(
            replace(
                self._ctld,
                state=JobState.RUNNING,
                nodes=tuple(nodes),
                start=self.cluster.clock.now(),
                end=None,
                ran=True,
            )
        )
        if self.cluster.touch_files:
            for path in self._output_paths():
                Path(path).touch()

    def end(
        self,
        state: JobState | str,
        *,
        exit_code: str | None = None,
        derived_exit_code: str | None = None,
    ) -> None:
        final = JobState(state)
        if not final.is_terminal:
            raise ReplayError(f"{final.value} is not an end state; use set_state")
        self._set(self._ended(self._ctld, final, exit_code, derived_exit_code))

    def _ended(
        self, facts: _Facts, state: JobState, exit_code: str | None, derived: str | None
    ) -> _Facts:
        caps = self.cluster.captures
        case = caps.end_case(state, exit_code=exit_code, restarted=facts.restarts > 0)
        alloc = caps.sacct_rows(f"{case}.sacct.txt")[0]
        record = caps.scontrol_record(f"{case}.scontrol.txt")
        now = self.cluster.clock.now()
        return replace(
            facts,
            state=state,
            end=now,
            start=facts.start or now,
            case=case,
            sacct_exit=exit_code or alloc["ExitCode"],
            derived_exit=derived or alloc["DerivedExitCode"],
            scontrol_exit=exit_code or _record_value(record, "ExitCode"),
            batch_exit=exit_code,
        )

    def set_state(self, state: JobState | str) -> None:
        if JobState(state).is_terminal:
            raise ReplayError(f"{state} is an end state; use end() for its captured rows")
        self._set(replace(self._ctld, state=JobState(state)))

    def requeue(self, previous: JobState | str = JobState.NODE_FAIL) -> None:
        """Back to PENDING (same id, new submit time, Restarts + 1); sacct --duplicates
        shows the earlier attempt ended `previous` (a node failure, as captured)."""
        self.history.append(self._ended(self._ctld, JobState(previous), None, None))
        now = self.cluster.clock.now()
        self._set(_Facts(JobState.PENDING, now, restarts=self._ctld.restarts + 1))

    def purge(self) -> None:
        self.purged = True

    def lag_accounting(self) -> None:
        self._lagging = True

    def sync_accounting(self) -> None:
        self._lagging = False
        self._acct = self._ctld

    def _set(self, facts: _Facts) -> None:
        if self.purged:
            raise ReplayError(f"job {self.job_id} was purged; it cannot change any more")
        self._ctld = facts
        if not self._lagging:
            self._acct = facts

    # --- the timeline ----------------------------------------------------------------------

    def script_steps(self, *steps: Step) -> None:
        """Replace the rest of the timeline (its first step counts from now)."""
        self._steps = list(steps)
        self._anchor = self.cluster.clock.now()

    def step(self) -> Step | None:
        """Take the next scripted step now, whatever its delay; None if there is none."""
        if not self._steps:
            return None
        step = self._steps.pop(0)
        step.apply(self)
        self._anchor = self.cluster.clock.now()
        return step

    def _due(self) -> datetime | None:
        if not self._steps:
            return None
        return self._anchor + timedelta(seconds=self._steps[0].after)

    def _react(self, steps: tuple[Step, ...] | None) -> None:
        if steps is None:
            return
        self.script_steps(*steps)
        while self._steps and self._steps[0].after <= 0:
            self.step()

    # --- rendering -----------------------------------------------------------------------

    def squeue_cells(self) -> dict[str, str]:
        """This job's squeue line, by format token, from the captured line for its state."""
        facts, caps = self._ctld, self.cluster.captures
        if facts.case is not None and (caps.directory / f"{facts.case}.squeue.txt").exists():
            template = caps.squeue_cells(f"{facts.case}.squeue.txt")[0]
        elif facts.state is JobState.PENDING:
            template = caps.squeue_cells("requeued_pending.squeue.txt")[0]
        else:
            template = caps.squeue_cells("running.squeue.txt")[0]
        cells = dict(zip(caps.squeue_tokens, template, strict=True))
        values = {
            "%i": self.job_id,
            "%T": facts.state.value,
            "%N": hostlist(facts.nodes),
            "%j": self.name,
            # the captured reason of the captured end state (e.g. NonZeroExitCode)
            "%r": "None"
            if facts.case is None
            else _record_value(caps.scontrol_record(f"{facts.case}.scontrol.txt"), "Reason"),
        }
        unknown = set(cells) - set(values)
        if unknown:
            raise ReplayError(f"squeue format tokens {sorted(unknown)} are not modelled")
        cells.update(values)
        return cells

    def sacct_rows(self, *, allocations_only: bool, duplicates: bool) -> list[dict[str, str]]:
        """sacct's rows for the job (allocation, then steps), as sacct would print them."""
        if self._acct is None:
            return []
        records = [*self.history, self._acct] if duplicates else [self._acct]
        rows: list[dict[str, str]] = []
        for facts in records:
            rows += self._sacct_rows(facts)
        return [r for r in rows if "." not in r["JobIDRaw"]] if allocations_only else rows

    def _sacct_rows(self, facts: _Facts) -> list[dict[str, str]]:
        caps = self.cluster.captures
        now = self.cluster.clock.now()
        if facts.case is not None:
            template = caps.sacct_rows(f"{facts.case}.sacct.txt")
            if not facts.ran:
                template = template[:1]
        else:
            template = [
                r
                for r in caps.sacct_rows("running.sacct.txt")
                if r["JobIDRaw"].split(".")[0] == _RUNNING_CASE_JOB
            ]
            if not facts.ran:
                template = template[:1]  # no steps before the job starts
        captured_id = template[0]["JobIDRaw"]
        rows: list[dict[str, str]] = []
        for t in template:
            row = dict(t)
            suffix = row["JobIDRaw"].removeprefix(captured_id)
            row["JobIDRaw"] = row["JobID"] = self.job_id + suffix
            row["Submit"] = _slurm_time(facts.submit if not suffix else facts.start)
            row["Start"] = _slurm_time(facts.start)
            row["End"] = _slurm_time(facts.end)
            row["Elapsed"] = _elapsed(facts.start, facts.end or now)
            if suffix == ".batch":
                row["NodeList"] = facts.nodes[0] if facts.nodes else "None assigned"
                if facts.batch_exit is not None:
                    row["ExitCode"] = facts.batch_exit
            elif suffix:
                row["NodeList"] = hostlist(facts.nodes) or "None assigned"
                if self.step_name is not None and suffix[1:].isdigit():
                    row["JobName"] = self.step_name
            else:
                row["NodeList"] = hostlist(facts.nodes) or "None assigned"
                row["JobName"] = self.name
                row["ExitCode"] = facts.sacct_exit
                row["DerivedExitCode"] = facts.derived_exit
                if facts.case is None:
                    row["State"] = facts.state.value
                    row["Reason"] = "None"
            if facts.case is None and suffix:
                row["State"] = facts.state.value if facts.state.is_terminal else "RUNNING"
            rows.append(row)
        return rows

    def scontrol_record(self) -> str:
        """``scontrol show job --oneliner`` for the job, from the captured record for its state."""
        facts, caps = self._ctld, self.cluster.captures
        if facts.case is not None:
            record = caps.scontrol_record(f"{facts.case}.scontrol.txt")
        elif facts.state is JobState.PENDING:
            record = caps.scontrol_record("requeued_pending.scontrol.txt")
        else:
            record = caps.scontrol_record("running.scontrol.txt")
        now = self.cluster.clock.now()
        values = {
            "JobId": self.job_id,
            "JobName": self.name,
            "JobState": facts.state.value,
            "Restarts": str(facts.restarts),
            "ExitCode": facts.scontrol_exit,
            "RunTime": _elapsed(facts.start, facts.end or now),
            "SubmitTime": _slurm_time(facts.submit),
            "StartTime": _slurm_time(facts.start),
            "EndTime": _slurm_time(facts.end),
            "NodeList": hostlist(facts.nodes),
            "BatchHost": facts.nodes[0] if facts.nodes else "",
            "NumNodes": str(len(facts.nodes) or self._sbatch_option("nodes") or 1),
        }
        limit = self._sbatch_option("time")
        limit_s = _seconds(_record_value(record, "TimeLimit"))
        if limit:
            limit_s = time_limit_seconds(limit)
            values["TimeLimit"] = _elapsed(None, None, seconds=limit_s)
        if facts.end is None and facts.start is not None and limit_s is not None:
            values["EndTime"] = _slurm_time(facts.start + timedelta(seconds=limit_s))
        if facts.case is None:
            values["Reason"] = "None"
        out = self._output_paths()
        if out:
            values["StdOut"] = out[0]
            values["StdErr"] = out[-1]
        tokens = []
        for token in record.split(" "):
            key, eq, _ = token.partition("=")
            if eq and key in values:
                if key == "BatchHost" and not values[key]:
                    continue  # a job without nodes has no BatchHost
                token = f"{key}={values[key]}"
            tokens.append(token)
        return " ".join(tokens)

    def _sbatch_option(self, name: str) -> str | None:
        lines = [f"#SBATCH {o}" for o in self.options] + self.script.splitlines()
        for line in lines:
            m = re.match(rf"#SBATCH\s+--{re.escape(name)}=(\S+)", line)
            if m:
                return m.group(1)
        return None

    def _output_paths(self) -> list[str]:
        """--output and --error from the sbatch options or the script, %x and %j expanded;
        a relative one is under --chdir, as slurmd opens it (absolute in scontrol's StdOut)."""
        found: dict[str, str] = {}
        lines = [f"#SBATCH {o}" for o in self.options] + self.script.splitlines()
        for line in lines:
            m = re.match(r"#SBATCH\s+--(output|error)=(\S+)", line)
            if m and m.group(1) not in found:
                found[m.group(1)] = m.group(2).replace("%x", self.name).replace("%j", self.job_id)
        workdir = self._sbatch_option("chdir")
        if workdir is not None:
            found = {k: os.path.join(workdir, v) for k, v in found.items()}
        return [found[k] for k in ("output", "error") if k in found]


def _seconds(text: str) -> int | None:
    """Seconds in a [D-]HH:MM:SS duration; None for UNLIMITED and the like."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d+):(\d+)", text)
    if m is None:
        return None
    days, h, mi, sec = (int(g or 0) for g in m.groups())
    return ((days * 24 + h) * 60 + mi) * 60 + sec


def _record_value(record: str, key: str) -> str:
    m = re.search(rf"(?:^| ){re.escape(key)}=(\S*)", record)
    if m is None:
        raise ReplayError(f"the captured scontrol record has no {key}=")
    return m.group(1)


# --- the cluster --------------------------------------------------------------------------------


class Gate:
    """Holds calls of one program until released (see `ReplayCluster.hold`)."""

    def __init__(self, program: str) -> None:
        self.program = program
        self.entered = anyio.Event()  # a call is waiting at the gate
        self.waiting = 0
        self._open = anyio.Event()

    def release(self) -> None:
        self._open.set()

    async def _pass(self) -> None:
        self.waiting += 1
        self.entered.set()
        try:
            await self._open.wait()
        finally:
            self.waiting -= 1


@dataclass
class _Failure:
    reply: Reply
    times: int
    match: Callable[[tuple[str, ...]], bool] | None = None


@dataclass
class _Waiter:
    program: str | None
    count: int
    event: anyio.Event = field(default_factory=anyio.Event)


class ReplayCluster:
    """A scripted Slurm cluster behind the `CommandRunner` protocol (see the module doc)."""

    def __init__(
        self,
        *,
        clock: FakeClock | None = None,
        first_job_id: int = 100,
        accounting: Literal["up", "down", "disabled"] = "up",
        min_job_age_s: int = 30,
        lag_accounting_on_submit: bool = False,
        touch_files: bool = False,
        captures: Captures | None = None,
        user: str = "root",
    ) -> None:
        self.captures = captures or Captures.load()
        self.user = user  # the account the commands run as (and sbatch submits as)
        self.clock = clock or FakeClock()
        self.accounting = accounting  # "down": sacct fails as with slurmdbd stopped
        self.min_job_age_s = min_job_age_s
        self.lag_accounting_on_submit = lag_accounting_on_submit
        # Like a shared filesystem: mkdir creates the directory, and a job's start creates
        # its --output/--error files as slurmd does (the run driver notices a start by them).
        self.touch_files = touch_files
        self.jobs: dict[str, ReplayJob] = {}
        # A QOS's MaxSubmitJobsPerUser: an sbatch beyond it is refused as slurmctld does
        # (tests/data/slurm-qos-refusal/SOURCE.md); None: no limit.
        self.max_submit: int | None = None
        self.limit_in_sacctmgr = True  # False: sacctmgr shows no limit (sbatch still refuses)
        self.calls: list[tuple[str, ...]] = []
        self.stdin: list[bytes | None] = []
        self.envs: list[Mapping[str, str] | None] = []
        self._next_id = first_job_id
        self._expected: dict[str, tuple[Step, ...]] = {}
        self._failures: dict[str, list[_Failure]] = {}
        self._gates: dict[str, Gate] = {}
        self._waiters: list[_Waiter] = []

    # --- scripting ---------------------------------------------------------------------------

    def expect(self, name: str, *steps: Step) -> None:
        """The timeline of the next job submitted under `name` (counted from its sbatch)."""
        self._expected[name] = steps

    def add_job(
        self,
        name: str,
        *steps: Step,
        job_id: str | None = None,
        lag_accounting: bool = False,
        user: str | None = None,
    ) -> ReplayJob:
        """A job that is already there (submitted by someone else, or by a daemon that
        crashed before it saw sbatch's answer); `user`: its owner (default: `self.user`)."""
        job = ReplayJob(
            self,
            job_id or self._new_id(),
            name,
            steps=steps,
            lag_accounting=lag_accounting,
            user=user,
        )
        self.jobs[job.job_id] = job
        return job

    def job(self, key: str) -> ReplayJob:
        """The job with this id or (the latest with) this name."""
        if key in self.jobs:
            return self.jobs[key]
        named = [j for j in self.jobs.values() if j.name == key]
        if not named:
            raise ReplayError(f"no job {key!r}; jobs: {sorted(self.jobs)}")
        return named[-1]

    def fail(
        self,
        program: str,
        reply: Reply,
        *,
        times: int = 1,
        match: Callable[[tuple[str, ...]], bool] | None = None,
    ) -> None:
        """The next `times` calls of `program` (whose argv `match`es, if given) get `reply`."""
        self._failures.setdefault(program, []).append(_Failure(reply, times, match))

    def hold(self, program: str) -> Gate:
        """Calls of `program` wait at the returned gate until `release()`; they are answered
        from the cluster as it is when released."""
        gate = Gate(program)
        self._gates[program] = gate
        return gate

    def step(self, *job_ids: str) -> None:
        """Every job (or the given ones) takes its next scripted step, whatever its delay."""
        for job in [self.jobs[j] for j in job_ids] if job_ids else list(self.jobs.values()):
            job.step()

    def advance(self, seconds: float = 0.0) -> None:
        """Move the fake clock; every step that falls due on the way is taken, in time order."""
        target = self.clock.now() + timedelta(seconds=seconds)
        while True:
            due = [(d, job) for job in self.jobs.values() if (d := job._due()) and d <= target]
            if not due:
                break
            when, job = min(due, key=lambda pair: pair[0])
            self.clock.set(max(when, self.clock.now()))
            job.step()
        self.clock.set(target)

    # --- what was asked ------------------------------------------------------------------------

    def argvs(self, program: str) -> list[tuple[str, ...]]:
        return [argv for argv in self.calls if argv[0] == program]

    def count(self, program: str | None = None) -> int:
        return len(self.calls) if program is None else len(self.argvs(program))

    def counts(self) -> Counter[str]:
        return Counter(argv[0] for argv in self.calls)

    def reset_calls(self) -> None:
        self.calls.clear()
        self.stdin.clear()

    async def wait_calls(self, program: str | None, count: int) -> None:
        """Return once `count` calls of `program` (None: of anything) have been made."""
        if self.count(program) >= count:
            return
        waiter = _Waiter(program, count)
        self._waiters.append(waiter)
        await waiter.event.wait()

    # --- CommandRunner -----------------------------------------------------------------------

    async def run(
        self,
        argv: Sequence[str],
        *,
        time_limit: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        await anyio.lowlevel.checkpoint()
        self.envs.append(env)
        args = tuple(argv)
        if not args:
            raise ReplayError("empty argv")
        self.calls.append(args)
        self.stdin.append(stdin)
        for waiter in list(self._waiters):
            if self.count(waiter.program) >= waiter.count:
                waiter.event.set()
                self._waiters.remove(waiter)
        gate = self._gates.get(args[0])
        if gate is not None:
            await gate._pass()
        started_at = self.clock.now()
        failure = self._failure(args)
        if failure is not None and not failure.applied:
            reply = failure
        else:
            reply = self._answer(args, stdin, env)
            if failure is not None:
                reply = failure
        if reply.timeout:
            raise SlurmCommandError(args, None, "", timed_out_after=time_limit)
        return CommandResult(args, reply.returncode, reply.stdout, reply.stderr, started_at, 0.0)

    def _failure(self, argv: tuple[str, ...]) -> Reply | None:
        for f in self._failures.get(argv[0], []):
            if f.times > 0 and (f.match is None or f.match(argv)):
                f.times -= 1
                return f.reply
        return None

    def _new_id(self) -> str:
        job_id = str(self._next_id)
        self._next_id += 1
        return job_id

    def _answer(
        self, argv: tuple[str, ...], stdin: bytes | None, env: Mapping[str, str] | None = None
    ) -> Reply:
        program, args = argv[0], argv[1:]
        if program == "sbatch":
            return self._sbatch(args, stdin, env)
        if program == "squeue":
            return self._squeue(args)
        if program == "sacct":
            return self._sacct(args)
        if program == "scontrol":
            return self._scontrol(args)
        if program == "scancel":
            return self._scancel(args)
        if program == "sacctmgr":
            return self._sacctmgr(args)
        if program == "id":
            if args != ("-un",):
                raise ReplayError(f"id {args} is not modelled")
            return Reply(stdout=self.user + "\n")
        if program == "mkdir":
            if args[:2] != ("-p", "--") or len(args) != 3:
                raise ReplayError(f"mkdir {args} is not modelled")
            if self.touch_files:
                Path(args[2]).mkdir(parents=True, exist_ok=True)
            return EMPTY
        if program == "realpath":  # the log directory's check at submission
            if args[:2] != ("-m", "--") or len(args) != 3:
                raise ReplayError(f"realpath {args} is not modelled")
            return Reply(stdout=os.path.realpath(args[2]) + "\n")
        raise ReplayError(f"the replayed cluster does not know {program!r} ({argv})")

    def _sbatch(
        self, args: tuple[str, ...], stdin: bytes | None, env: Mapping[str, str] | None = None
    ) -> Reply:
        opts, _ = _options("sbatch", args, None)
        if "parsable" not in opts:
            raise ReplayError("sbatch without --parsable: its text was not captured")
        script = (stdin or b"").decode()
        names = [a.removeprefix("--job-name=") for a in args if a.startswith("--job-name=")]
        names += re.findall(r"^#SBATCH\s+--job-name=(\S+)", script, re.M)
        name = names[0] if names else "sbatch"
        queued = [j for j in self.jobs.values() if not j.state.is_terminal]
        if self.max_submit is not None and len(queued) >= self.max_submit:
            return Reply(1, "", QOS_REFUSAL)
        options = [a for a in args if a != "--parsable"]
        job = ReplayJob(
            self,
            self._new_id(),
            name,
            script=script,
            options=options,
            steps=self._expected.pop(name, ()),
            lag_accounting=self.lag_accounting_on_submit,
            env=env,
        )
        self.jobs[job.job_id] = job
        template = self.captures.text("completed.sbatch.txt")
        captured_id = template.strip()
        return Reply(0, template.replace(captured_id, job.job_id), "")

    def _sacctmgr(self, args: tuple[str, ...]) -> Reply:
        """`show assoc where user=U format=qos,defaultqos,maxsubmit` and `show qos
        format=name,maxsubmitpu`, as 22.05 and 24.11 print them (one QOS, `normal`)."""
        base = ("--noheader", "--parsable2", "show")
        limit = self.max_submit if self.limit_in_sacctmgr else None
        if args == (
            *base,
            "assoc",
            "where",
            f"user={self.user}",
            "format=qos,defaultqos,maxsubmit",
        ):
            return Reply(stdout="normal||\n")
        if args == (*base, "qos", "format=name,maxsubmitpu"):
            return Reply(stdout=f"normal|{'' if limit is None else limit}\n")
        raise ReplayError(f"sacctmgr {args} is not modelled")

    def _squeue(self, args: tuple[str, ...]) -> Reply:
        opts, _ = _options("squeue", args, {"noheader", "format", "states", "jobs", "name", "user"})
        if "noheader" not in opts:
            raise ReplayError("squeue without --noheader: its header was not captured")
        tokens = opts.get("format", self.captures.squeue_format).split("|")
        unknown = [t for t in tokens if t not in self.captures.squeue_tokens]
        if unknown:
            raise ReplayError(
                f"format drift: squeue tokens {unknown} are not in the captured format "
                f"{self.captures.squeue_format!r}; re-capture"
            )
        all_states = opts.get("states", "").lower() == "all"
        known = [j for j in self.jobs.values() if not j.purged]
        if "jobs" in opts:
            wanted = opts["jobs"].split(",")
            known = [j for j in known if j.job_id in wanted]
            if not known:
                return INVALID_JOB_ID
        if "name" in opts:
            known = [j for j in known if j.name in opts["name"].split(",")]
        if "user" in opts:
            known = [j for j in known if j.user in opts["user"].split(",")]
        if not all_states:
            known = [j for j in known if not j.state.is_terminal]
        lines = []
        for job in sorted(known, key=lambda j: int(j.job_id)):
            cells = job.squeue_cells()
            lines.append("|".join(cells[t] for t in tokens))
        return Reply(0, "".join(line + "\n" for line in lines), "")

    def _sacct(self, args: tuple[str, ...]) -> Reply:
        allowed = {"parsable2", "noheader", "format", "jobs", "starttime", "allocations", "name"}
        allowed.add("user")
        opts, _ = _options("sacct", args, allowed | {"duplicates"})
        if self.accounting == "disabled":
            return ACCOUNTING_DISABLED
        if self.accounting == "down":
            return SACCT_DBD_DOWN
        if "parsable2" not in opts or "noheader" not in opts:
            raise ReplayError("sacct without --parsable2 --noheader: that text was not captured")
        fields = opts.get("format", ",".join(self.captures.sacct_fields)).split(",")
        unknown = [f for f in fields if f not in self.captures.sacct_fields]
        if unknown:
            raise ReplayError(
                f"format drift: sacct fields {unknown} are not in the captured fields "
                f"{','.join(self.captures.sacct_fields)}; re-capture"
            )
        jobs = list(self.jobs.values())
        if "jobs" in opts:
            wanted = opts["jobs"].split(",")
            jobs = [j for j in jobs if j.job_id in wanted]
        if "name" in opts:
            jobs = [j for j in jobs if j.name in opts["name"].split(",")]
        if "user" in opts:
            jobs = [j for j in jobs if j.user in opts["user"].split(",")]
        elif "jobs" not in opts and self.user != "root":
            jobs = [j for j in jobs if j.user == self.user]  # sacct(1): a user's own by default
        if "starttime" in opts:
            since = _parse_slurm_time(opts["starttime"])
            jobs = [j for j in jobs if j._acct and (j._acct.end or self.clock.now()) >= since]
        lines = []
        for job in sorted(jobs, key=lambda j: int(j.job_id)):
            for row in job.sacct_rows(
                allocations_only="allocations" in opts, duplicates="duplicates" in opts
            ):
                lines.append("|".join(row[f] for f in fields))
        return Reply(0, "".join(line + "\n" for line in lines), "")

    def _scontrol(self, args: tuple[str, ...]) -> Reply:
        if args == ("show", "config"):
            text = self.captures.text("scontrol_config.txt")
            storage = (
                "accounting_storage/none"
                if self.accounting == "disabled"
                else "accounting_storage/slurmdbd"
            )
            text = re.sub(r"(?m)^(MinJobAge\s+= ).*$", rf"\g<1>{self.min_job_age_s} sec", text)
            text = re.sub(r"(?m)^(AccountingStorageType\s+= ).*$", rf"\g<1>{storage}", text)
            return Reply(0, text, "")
        if len(args) == 4 and args[:3] == ("show", "job", "--oneliner"):
            job = self.jobs.get(args[3])
            if job is None or job.purged:
                return _SCONTROL_INVALID
            return Reply(0, job.scontrol_record() + "\n", "")
        raise ReplayError(f"scontrol {' '.join(args)} is not modelled")

    def _scancel(self, args: tuple[str, ...]) -> Reply:
        opts, rest = _options("scancel", args, {"signal"}, positional=1)
        if len(rest) != 1:
            raise ReplayError(f"scancel of {rest}: the client cancels one job id at a time")
        signal = opts.get("signal", "KILL").upper().removeprefix("SIG")
        job = self.jobs.get(rest[0])
        if job is None or job.purged or job.state.is_terminal:
            # Modelled on scancel.c (not captured): a finished or unknown job is no error
            # for a plain scancel; with --signal it is.
            if signal == "KILL":
                return EMPTY
            why = (
                "Invalid job id specified"
                if job is None or job.purged
                else ("Job/step already completing or completed")
            )
            return Reply(1, "", f"scancel: error: Kill job error on job id {rest[0]}: {why}\n")
        job.signals.append(signal)
        job._react(job.on_kill if signal == "KILL" else job.on_term if signal == "TERM" else None)
        return EMPTY


def _options(
    program: str, args: tuple[str, ...], known: set[str] | None, *, positional: int = 0
) -> tuple[dict[str, str], list[str]]:
    """Long options (``--key`` or ``--key=value``) by key, and up to `positional` others;
    `known` None accepts any option."""
    opts: dict[str, str] = {}
    rest: list[str] = []
    for arg in args:
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            if known is not None and key not in known:
                raise ReplayError(f"{program} option {arg!r} is not modelled")
            opts[key] = value
        else:
            rest.append(arg)
    if len(rest) > positional:
        raise ReplayError(f"{program} arguments {rest} are not modelled")
    return opts, rest


def _parse_slurm_time(text: str) -> datetime:
    try:
        return datetime.strptime(text, SLURM_TIME).astimezone(UTC)
    except ValueError:
        raise ReplayError(f"--starttime={text!r} is not in the form the client uses") from None
