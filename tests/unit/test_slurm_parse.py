"""Table tests for the Slurm output parsers, on text as Slurm 22.05 prints it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmd_supervisor.core.slurm.parse import (
    SACCT_FIELDS,
    SQUEUE_FORMAT,
    ExitCode,
    JobState,
    accounting_disabled,
    allocation_row,
    invalid_job_id,
    job_rows,
    parse_exit_code,
    parse_sacct,
    parse_sacct_batch,
    parse_sbatch_parsable,
    parse_scontrol_config,
    parse_scontrol_job,
    parse_squeue,
    parse_squeue_batch,
    parse_state,
)
from llmd_supervisor.errors import SlurmJobNotFound, SlurmParseError

# --- states --------------------------------------------------------------------------------

SLURM_2205_STATES = [
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "COMPLETING",
    "CONFIGURING",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PENDING",
    "PREEMPTED",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "RESV_DEL_HOLD",
    "REVOKED",
    "SIGNALING",
    "SPECIAL_EXIT",
    "STAGE_OUT",
    "STOPPED",
    "SUSPENDED",
    "TIMEOUT",
]


def test_table_covers_every_documented_state() -> None:
    assert {s.value for s in JobState} == {*SLURM_2205_STATES, "UNKNOWN"}


@pytest.mark.parametrize("name", SLURM_2205_STATES)
def test_every_state_parses_exactly(name: str) -> None:
    parsed = parse_state(name)
    assert parsed.state.value == name
    assert parsed.exact
    assert parsed.state.is_terminal != parsed.state.is_active


@pytest.mark.parametrize(
    ("state", "terminal"),
    [
        (JobState.COMPLETED, True),
        (JobState.FAILED, True),
        (JobState.TIMEOUT, True),
        (JobState.NODE_FAIL, True),
        (JobState.OUT_OF_MEMORY, True),
        (JobState.CANCELLED, True),
        (JobState.PREEMPTED, True),
        (JobState.COMPLETING, False),
        (JobState.REQUEUED, False),
        (JobState.REQUEUE_HOLD, False),
        (JobState.SUSPENDED, False),
        (JobState.STAGE_OUT, False),
        (JobState.PENDING, False),
    ],
)
def test_terminal_states(state: JobState, terminal: bool) -> None:
    assert state.is_terminal is terminal


def test_unknown_is_neither_terminal_nor_active() -> None:
    assert not JobState.UNKNOWN.is_terminal
    assert not JobState.UNKNOWN.is_active


@pytest.mark.parametrize(
    ("text", "state", "by", "truncated", "exact"),
    [
        ("COMPLETED", JobState.COMPLETED, None, False, True),
        ("COMPLETED  \n", JobState.COMPLETED, None, False, True),
        ("CANCELLED by 0", JobState.CANCELLED, "0", False, False),
        ("CANCELLED by 1000", JobState.CANCELLED, "1000", False, False),
        ("CANCELLED+", JobState.CANCELLED, None, True, False),
        ("completed", JobState.COMPLETED, None, False, False),
        ("COMPLETED by 0", JobState.UNKNOWN, None, False, False),
        ("COMPLETED+", JobState.COMPLETED, None, True, False),
        ("EXPLODED", JobState.UNKNOWN, None, False, False),
        ("", JobState.UNKNOWN, None, False, False),
        ("RUNNING RUNNING", JobState.UNKNOWN, None, False, False),
        ("UNKNOWN", JobState.UNKNOWN, None, False, True),
    ],
)
def test_parse_state(
    text: str, state: JobState, by: str | None, truncated: bool, exact: bool
) -> None:
    parsed = parse_state(text)
    assert parsed.state is state
    assert parsed.raw == text
    assert parsed.cancelled_by == by
    assert parsed.truncated is truncated
    assert parsed.exact is exact


# --- exit codes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "status", "signal"),
    [("0:0", 0, 0), ("1:0", 1, 0), ("0:9", 0, 9), ("143:0", 143, 0), (" 0:15\n", 0, 15)],
)
def test_parse_exit_code(text: str, status: int, signal: int) -> None:
    code = parse_exit_code(text)
    assert code == ExitCode(status, signal)
    assert str(code) == f"{status}:{signal}"
    assert code.is_zero is (status == signal == 0)


@pytest.mark.parametrize("text", ["", "0", "0:", ":0", "a:b", "1:2:3", "-1:0", "٣:0", "0 : 0"])
def test_bad_exit_code(text: str) -> None:
    with pytest.raises(SlurmParseError, match="ExitCode"):
        parse_exit_code(text)


# --- sbatch --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "job_id", "cluster"),
    [("123", "123", None), ("123\n", "123", None), ("123;dev\n", "123", "dev")],
)
def test_parse_sbatch(text: str, job_id: str, cluster: str | None) -> None:
    result = parse_sbatch_parsable(text)
    assert (result.job_id, result.cluster) == (job_id, cluster)


@pytest.mark.parametrize(
    "text", ["", "\n", "Submitted batch job 123", "123;", "abc", "12\n13", "123;a b"]
)
def test_bad_sbatch(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_sbatch_parsable(text)


# --- squeue --------------------------------------------------------------------------------


def test_squeue_format_is_the_parsed_one() -> None:
    # No job name (the job's own text), and the one free-text column, the reason, last.
    assert SQUEUE_FORMAT == "%i|%T|%N|%r"


def test_parse_squeue() -> None:
    text = (
        "18|RUNNING|node1|None\n"
        "21|PENDING||BeginTime\n"
        "22_3|COMPLETING|node[2-3]|a reason|with|pipes\n"
        "\n"
    )
    rows = parse_squeue(text)
    assert [r.job_id for r in rows] == ["18", "21", "22_3"]
    assert [r.state.state for r in rows] == [
        JobState.RUNNING,
        JobState.PENDING,
        JobState.COMPLETING,
    ]
    assert rows[1].reason == "BeginTime"
    assert rows[1].node_list == ""
    assert rows[2].reason == "a reason|with|pipes"
    assert rows[0].raw == "18|RUNNING|node1|None"
    assert {r.name for r in rows} == {""}  # not asked for


def test_parse_squeue_in_the_captures_format() -> None:
    """The captures (and SQUEUE_FORMAT before 3.2) printed the name last."""
    text = (
        "18|RUNNING|None|node1|capture-cancelled\n"
        "21|PENDING|BeginTime||capture-requeued_completed\n"
        "22_3|COMPLETING|None|node[2-3]|name|with|pipes\n"
    )
    rows = parse_squeue(text, fmt="%i|%T|%r|%N|%j")
    assert [(r.job_id, r.reason, r.node_list) for r in rows] == [
        ("18", "None", "node1"),
        ("21", "BeginTime", ""),
        ("22_3", "None", "node[2-3]"),
    ]
    assert rows[2].name == "name|with|pipes"
    assert rows[0].raw == "18|RUNNING|None|node1|capture-cancelled"


@pytest.mark.parametrize("fmt", ["%T|%i", "%i|%T|%N|%N", "%i|%N", "%i|%T|%M", "%i %T"])
def test_squeue_formats_the_parser_cannot_read(fmt: str) -> None:
    with pytest.raises(ValueError, match="squeue format"):
        parse_squeue("", fmt=fmt)


@pytest.mark.parametrize(
    ("text", "rows", "rejected"),
    [
        # a line break in the last column (the reason): that job's record only
        ("1|RUNNING|n1|None\n2|PENDING||two\nlines\n3|RUNNING|n3|None\n", ["1", "3"], ["2"]),
        # a record with a cell too few, a bad job id after a good one
        ("1|RUNNING|n1\n3|RUNNING|n3|None\n", ["3"], ["1"]),
        ("3|RUNNING|n3|None\n4x|RUNNING|n3|None\n", [], ["3"]),
        # text before any record belongs to no job
        ("squeue: warning\n3|RUNNING|n3|None\n", ["3"], [None]),
    ],
)
def test_squeue_batch_isolates_a_bad_record(
    text: str, rows: list[str], rejected: list[str | None]
) -> None:
    batch = parse_squeue_batch(text)
    assert [r.job_id for r in batch.rows] == rows
    assert [r.job_id for r in batch.rejected] == rejected
    with pytest.raises(SlurmParseError, match="squeue"):
        parse_squeue(text)  # the strict form refuses the whole text


def test_parse_squeue_empty() -> None:
    assert parse_squeue("") == []


@pytest.mark.parametrize("text", ["18 RUNNING node1", "x|RUNNING|None|n|j", "18|RUNNING|None"])
def test_bad_squeue(text: str) -> None:
    with pytest.raises(SlurmParseError, match="squeue"):
        parse_squeue(text)


# --- sacct ---------------------------------------------------------------------------------

SACCT_TEXT = (
    "15|15|COMPLETED|0:0|0:0|None|node1|2026-11-30T22:05:33|2026-11-30T22:05:33|"
    "2026-11-30T22:05:34|00:00:01|allocation\n"
    "15.batch|15.batch|COMPLETED|0:0|||node1|2026-11-30T22:05:33|2026-11-30T22:05:33|"
    "2026-11-30T22:05:34|00:00:01|batch\n"
    "15.extern|15.extern|COMPLETED|0:0|||node1|2026-11-30T22:05:33|2026-11-30T22:05:33|"
    "2026-11-30T22:05:34|00:00:01|extern\n"
    "15.0|15.0|COMPLETED|0:0|||node[1-2]|2026-11-30T22:05:33|2026-11-30T22:05:33|"
    "2026-11-30T22:05:34|00:00:01|true\n"
    "18|18|CANCELLED by 0|0:0|0:0|None|node1|2026-11-30T22:05:33|2026-11-30T22:05:33|"
    "2026-11-30T22:05:40|00:00:07|job|with|pipes\n"
    "150|150|FAILED|9:0|0:9|None|node1|a|b|c|00:00:01|oom\n"
)


def test_sacct_fields() -> None:
    # No JobName: a job's and its steps' names are the job's own text.
    assert ",".join(SACCT_FIELDS) == (
        "JobIDRaw,JobID,State,ExitCode,DerivedExitCode,Reason,NodeList,Submit,Start,End,Elapsed"
    )


def test_parse_sacct_rows_without_names() -> None:
    """SACCT_TEXT as the client asks for it now: the same rows, no names."""
    text = "".join(line.rsplit("|", 1)[0] + "\n" for line in SACCT_TEXT.splitlines()[:4])
    rows = parse_sacct(text)
    named = parse_sacct(SACCT_TEXT)[:4]
    assert [r.job_name for r in rows] == ["", "", "", ""]
    for row, with_name in zip(rows, named, strict=True):
        assert row.raw == with_name.raw.rsplit("|", 1)[0]
        assert replace(row, job_name="", raw="") == replace(with_name, job_name="", raw="")


def test_parse_sacct_rows() -> None:
    rows = parse_sacct(SACCT_TEXT)
    assert [r.job_id_raw for r in rows] == ["15", "15.batch", "15.extern", "15.0", "18", "150"]
    first = rows[0]
    assert first.state.state is JobState.COMPLETED
    assert first.exit_code == ExitCode(0, 0)
    assert first.derived_exit_code == ExitCode(0, 0)
    assert first.node_list == "node1"
    assert first.end == "2026-11-30T22:05:34"
    assert first.elapsed == "00:00:01"
    assert not first.is_step
    assert rows[1].is_step
    assert rows[1].derived_exit_code is None
    assert rows[4].state.state is JobState.CANCELLED
    assert rows[4].state.cancelled_by == "0"
    assert rows[4].job_name == "job|with|pipes"
    assert rows[5].derived_exit_code == ExitCode(0, 9)
    assert rows[0].raw == SACCT_TEXT.splitlines()[0]


def test_step_rows_may_lack_exit_codes() -> None:
    # As sacct prints the steps of a NODE_FAIL job.
    text = (
        "27|27|NODE_FAIL|0:0|0:0|None|node4|a|b|c|00:00:01|capture-node_fail\n"
        "27.batch|27.batch|CANCELLED||||node4|a|b|c|00:00:01|batch\n"
    )
    rows = parse_sacct(text)
    assert rows[0].exit_code == ExitCode(0, 0)
    assert rows[1].exit_code is None
    assert rows[1].derived_exit_code is None


def test_allocation_row_is_exact() -> None:
    rows = parse_sacct(SACCT_TEXT)
    row = allocation_row(rows, "15")
    assert row is not None and row.job_id_raw == "15"
    assert allocation_row(rows, "1") is None
    assert allocation_row(rows, "15.batch") is None
    assert allocation_row(rows, "16") is None
    assert [r.job_id_raw for r in job_rows(rows, "15")] == ["15", "15.batch", "15.extern", "15.0"]
    assert [r.job_id_raw for r in job_rows(rows, "1")] == []


def test_allocation_row_never_takes_array_or_het_component() -> None:
    text = (
        "123|123_4|COMPLETED|0:0|0:0|None|node1|a|b|c|d|arr\n"
        "123|123+0|COMPLETED|0:0|0:0|None|node1|a|b|c|d|het\n"
        "124|123+1|FAILED|1:0|0:0|None|node1|a|b|c|d|het\n"
    )
    rows = parse_sacct(text)
    assert allocation_row(rows, "123") is None
    assert allocation_row(rows, "124") is None


def test_allocation_row_takes_last_duplicate() -> None:
    text = (
        "7|7|NODE_FAIL|0:0|0:0|None|node1|a|b|c|d|x\n7|7|COMPLETED|0:0|0:0|None|node2|a|b|c|d|x\n"
    )
    row = allocation_row(parse_sacct(text), "7")
    assert row is not None and row.state.state is JobState.COMPLETED


@pytest.mark.parametrize(
    "text",
    [
        "15|15|COMPLETED|0:0",  # too few fields
        "JobIDRaw|JobID|State|ExitCode|DerivedExitCode|Reason|NodeList|Submit|Start|End|E|N",
        "15|15|COMPLETED|zero|0:0|None|node1|a|b|c|d|x",  # bad ExitCode
        "15|15|COMPLETED|0:0|x|None|node1|a|b|c|d|x",  # bad DerivedExitCode
        "sacct: error: Problem talking to the database: Connection refused",
    ],
)
def test_bad_sacct(text: str) -> None:
    with pytest.raises(SlurmParseError, match=r"sacct|ExitCode"):
        parse_sacct(text)


def test_parse_sacct_empty() -> None:
    assert parse_sacct("") == []
    assert parse_sacct("\n\n") == []


TIMES = "2026-11-30T22:05:33|2026-11-30T22:05:33|2026-11-30T22:05:34|00:00:01"


def _row(job: str, state: str = "COMPLETED", exit_code: str = "0:0", name: str = "") -> str:
    """One sacct row; with `name`, in the captures' format (JobName last)."""
    derived = "" if "." in job else "0:0"
    row = f"{job}|{job}|{state}|{exit_code}|{derived}|None|node1|{TIMES}"
    return row + (f"|{name}" if name else "") + "\n"


@pytest.mark.parametrize(
    ("text", "allocations", "rejected"),
    [
        # names with a newline (captures' format): the record is that job's error alone
        (_row("7") + _row("8", name="x\ny") + _row("9"), ["7", "9"], ["8"]),
        (_row("7") + _row("8") + _row("8.0", name="step\nname") + _row("9"), ["7", "8", "9"],
         ["8"]),
        # '|' in a name: part of the name (it is the last column)
        (_row("7", name="a|b|c") + _row("8"), ["7", "8"], []),
        # a bad ExitCode, a missing cell: that job's record only
        (_row("7", exit_code="x") + _row("8"), ["8"], ["7"]),
        (_row("7").replace("|None|", "|") + _row("8"), ["8"], ["7"]),
        # text before any record
        ("sacct: warning\n" + _row("8"), ["8"], [None]),
    ],
)  # fmt: skip
def test_sacct_batch_isolates_a_bad_record(
    text: str, allocations: list[str], rejected: list[str | None]
) -> None:
    batch = parse_sacct_batch(text)
    assert [r.job_id_raw for r in batch.rows if not r.is_step] == allocations
    assert [r.job_id for r in batch.rejected] == rejected
    if not rejected:
        assert parse_sacct(text) == list(batch.rows)
        return
    with pytest.raises(SlurmParseError, match=r"sacct|ExitCode"):
        parse_sacct(text)  # the strict form refuses the whole text


def test_a_name_could_forge_a_row_so_the_client_asks_for_no_names() -> None:
    """In the captures' format a name holding a newline and a whole row reads as another
    job's record; that is why SACCT_FIELDS and SQUEUE_FORMAT leave the name out."""
    forged = _row("7", "FAILED", "1:0").strip()
    rows = parse_sacct(_row("8", name="x\n" + forged) + _row("7"))
    assert [(r.job_id_raw, r.state.state) for r in rows] == [
        ("8", JobState.COMPLETED),
        ("7", JobState.FAILED),  # forged
        ("7", JobState.COMPLETED),
    ]
    assert "JobName" not in SACCT_FIELDS and "%j" not in SQUEUE_FORMAT


def test_a_jobs_own_text_in_a_batch() -> None:
    text = _row("7") + _row("7.batch") + _row("8", name="x\ny") + _row("77") + _row("7.0")
    batch = parse_sacct_batch(text)
    assert batch.text_of("7") == _row("7") + _row("7.batch") + _row("7.0")
    assert batch.text_of("8") == _row("8", name="x\ny")  # both lines, as printed
    assert batch.text_of("77") == _row("77")
    assert batch.text_of("6") == ""
    assert batch.rejected_jobs == frozenset({"8"})
    assert "line break" in str(batch.rejected[0].error)


def test_accounting_disabled() -> None:
    assert accounting_disabled("Slurm accounting storage is disabled\n")
    assert not accounting_disabled("Problem talking to the database: Connection refused")


# --- scontrol show job ---------------------------------------------------------------------

SCONTROL_RUNNING = (
    "JobId=19 JobName=capture-timeout UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "Priority=4294901748 Nice=0 Account=root QOS=normal JobState=RUNNING Reason=None "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:02 "
    "TimeLimit=00:01:00 TimeMin=N/A SubmitTime=2026-11-30T22:05:33 "
    "EligibleTime=2026-11-30T22:05:33 AccrueTime=2026-11-30T22:05:33 "
    "StartTime=2026-11-30T22:05:33 EndTime=2026-11-30T22:06:33 Deadline=N/A "
    "SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-30T22:05:33 Scheduler=Main "
    "Partition=debug AllocNode:Sid=localhost:1084 ReqNodeList=(null) ExcNodeList=node[3-4] "
    "NodeList=node2 BatchHost=node2 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 "
    "ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=100M,node=1,billing=1 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryCPU=100M MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) "
    "Network=(null) Command=/var/tmp/capture/timeout.sh WorkDir=/work/main "
    "StdErr=/var/tmp/capture/timeout-19.out StdIn=/dev/null "
    "StdOut=/var/tmp/capture/timeout-19.out Power= \n"
)


def test_parse_scontrol_job_running() -> None:
    job = parse_scontrol_job(SCONTROL_RUNNING)
    assert job.job_id == "19"
    assert job.job_name == "capture-timeout"
    assert job.state.state is JobState.RUNNING
    assert job.exit_code == ExitCode(0, 0)
    assert job.derived_exit_code is None  # 22.05 omits it for a running job
    assert job.reason == "None"
    assert job.node_list == "node2"
    assert job.restarts == 0
    assert job.run_time == "00:00:02"
    assert job.start_time == "2026-11-30T22:05:33"
    assert job.end_time == "2026-11-30T22:06:33"
    assert job.fields["TRES"] == "cpu=1,mem=100M,node=1,billing=1"
    assert job.fields["AllocNode:Sid"] == "localhost:1084"
    assert job.fields["CPUs/Task"] == "1"
    assert job.fields["Power"] == ""
    assert job.raw == SCONTROL_RUNNING


def test_scontrol_values_with_spaces() -> None:
    text = SCONTROL_RUNNING.replace(
        "Command=/var/tmp/capture/timeout.sh",
        "Command=/path/with space/x.sh arg --opt=1 FOO=bar Comment=some text here",
    ).replace("JobState=RUNNING Reason=None", "JobState=FAILED Reason=NonZeroExitCode")
    text = text.replace("ExitCode=0:0", "ExitCode=1:0 DerivedExitCode=0:0")
    job = parse_scontrol_job(text)
    assert job.fields["Command"] == "/path/with space/x.sh arg --opt=1 FOO=bar"
    assert job.fields["Comment"] == "some text here"
    assert "FOO" not in job.fields
    assert job.state.state is JobState.FAILED
    assert job.exit_code == ExitCode(1, 0)
    assert job.derived_exit_code == ExitCode(0, 0)
    assert job.fields["WorkDir"] == "/work/main"


def test_scontrol_empty_value_then_key() -> None:
    job = parse_scontrol_job(SCONTROL_RUNNING.replace("NodeList=node2", "NodeList="))
    assert job.node_list == ""
    assert job.fields["BatchHost"] == "node2"


def test_scontrol_forged_state_in_free_text_is_refused() -> None:
    text = SCONTROL_RUNNING.replace(
        "Command=/var/tmp/capture/timeout.sh", "Command=/x.sh JobState=COMPLETED ExitCode=0:0"
    )
    with pytest.raises(SlurmParseError, match="appears twice"):
        parse_scontrol_job(text)


def test_scontrol_not_found() -> None:
    text = "slurm_load_jobs error: Invalid job id specified\n"
    assert invalid_job_id(text)
    with pytest.raises(SlurmJobNotFound):
        parse_scontrol_job(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "no equals here",
        " =x JobId=1",
        "JobId=1 JobName=x",  # no JobState / ExitCode
        "JobId=abc JobState=RUNNING ExitCode=0:0",
        "JobId=1 JobState=RUNNING ExitCode=x",
        "JobId=1 JobState=RUNNING ExitCode=0:0 Restarts=many",
        "JobId=1 JobState=RUNNING ExitCode=0:0\nJobId=2 JobState=RUNNING ExitCode=0:0",
    ],
)
def test_bad_scontrol_job(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_scontrol_job(text)


# --- scontrol show config ------------------------------------------------------------------

SCONTROL_CONFIG = """\
Configuration data as of 2026-11-30T22:05:00
AccountingStorageBackupHost = (null)
AccountingStorageEnforce = none
AccountingStorageHost   = localhost
AccountingStorageType   = accounting_storage/slurmdbd
AccountingStoreFlags    = (null)
MinJobAge               = 30 sec
SLURM_CONF              = /var/tmp/rig/slurm.conf
SLURM_VERSION           = 22.05.8

Cgroup Support Configuration:
MinJobAge               = 999 sec

Slurmctld(primary) at host is UP
"""


def test_parse_scontrol_config() -> None:
    config = parse_scontrol_config(SCONTROL_CONFIG)
    assert config.min_job_age == 30
    assert config.accounting_storage_type == "accounting_storage/slurmdbd"
    assert config.accounting_enabled
    assert config.fields["SLURM_VERSION"] == "22.05.8"
    assert config.fields["AccountingStorageBackupHost"] == "(null)"


def test_scontrol_config_accounting_none() -> None:
    text = "MinJobAge = 300\nAccountingStorageType = accounting_storage/none\n"
    config = parse_scontrol_config(text)
    assert config.min_job_age == 300
    assert not config.accounting_enabled


@pytest.mark.parametrize(
    "text",
    [
        "",
        "AccountingStorageType = accounting_storage/none\n",
        "MinJobAge = soon\nAccountingStorageType = accounting_storage/none\n",
        "MinJobAge = 30 sec\n",
    ],
)
def test_bad_scontrol_config(text: str) -> None:
    with pytest.raises(SlurmParseError, match="scontrol show config"):
        parse_scontrol_config(text)
