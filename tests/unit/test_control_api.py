"""The control API: its op table, run summaries, access, and the change-driven streams."""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from llmd_supervisor.adapters.control.protocol import OPS, Peer, Request
from llmd_supervisor.cli.run_commands import _print_summary, list_table
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.protocol.runs import (
    LogChunk,
    LogsDone,
    RunList,
    RunSummary,
    chunk_bytes,
    read,
)
from llmd_supervisor.core.run.layout import RunLayout
from llmd_supervisor.core.run.lifecycle import Run, RunState, Transition, new_run
from llmd_supervisor.core.run.retry_policy import Quarantined
from llmd_supervisor.core.spec import foreign as foreign
from llmd_supervisor.core.spec.foreign import ForeignSpec, Watch
from llmd_supervisor.core.spec.runspec import RunSpec, load_spec
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.errors import AdoptRefused, ControlError, IllegalTransition, SupervisorError
from llmd_supervisor.supervision.control import log_follow as log_follow
from llmd_supervisor.supervision.control.api import HANDLERS, ControlApi, Op, check_handlers

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
ME = Peer(uid=1000, gid=1000, pid=1)
OTHER = Peer(uid=1001, gid=1001, pid=2)
JOB_OWNER = ME.uid  # the fake's adopted job belongs to ME


@dataclass(frozen=True)
class Meta:
    owner_uid: int
    cluster: str
    created_at: datetime
    archive_dir: str
    log_dir: str


@dataclass
class Health:
    rank: int
    reachable: bool
    agent_state: str


@dataclass
class Handle:
    run: Run
    meta: Meta
    health: dict[str, Health] = field(default_factory=dict)
    changed: anyio.Event = field(default_factory=anyio.Event)
    history: list[dict[str, object]] = field(default_factory=list)
    sigterm_grace_s: int = 30
    held_until: datetime | None = None
    name: str = ""

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.meta.log_dir, self.run.job_name, Path(self.meta.archive_dir))

    def update(self, **changes: object) -> None:
        self.run = dataclasses.replace(self.run, **changes)  # type: ignore[arg-type]  # test
        self.changed.set()
        self.changed = anyio.Event()


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.handles: dict[str, Handle] = {}
        self.cancelled: list[str] = []
        self.released: list[tuple[str, str]] = []
        self.unseen: dict[str, Handle] = {}  # in the shared journal, not yet read
        self.looks = 0

    def add(
        self,
        run_id: str,
        owner: int = ME.uid,
        state: RunState = RunState.RUNNING,
        *,
        job_id: str = "42",
        cluster: str = "dev",
        created: datetime = T0,
    ) -> Handle:
        run = dataclasses.replace(
            new_run(run_id, f"llmd-{run_id}", created), state=state, slurm_job_id=job_id
        )
        archive = self.config.archive_root / run_id
        meta = Meta(owner, cluster, created, str(archive), "/shared/logs")
        self.handles[run_id] = Handle(run, meta)
        return self.handles[run_id]

    def get(self, ref: str) -> Handle | None:
        return self.handles.get(ref)

    async def look_again(self) -> bool:
        self.looks += 1
        self.handles.update(self.unseen)
        self.unseen.clear()
        return True

    async def admit(self, spec_toml: str, cluster: str | None = None) -> RunSpec:
        return load_spec(spec_toml)

    async def submit(self, spec_toml: str, *, owner_uid: int, cluster: str | None = None) -> Handle:
        return self.add("new", owner_uid, RunState.ACCEPTED)

    async def submit_script(
        self, spec_json: str, *, owner_uid: int, cluster: str | None = None
    ) -> Handle:
        foreign.load(spec_json)  # SpecError for a bad one
        return self.add("script", owner_uid, RunState.ACCEPTED)

    async def adopt(
        self, spec_json: str, *, owner_uid: int, privileged: bool, cluster: str | None = None
    ) -> Handle:
        spec = foreign.load(spec_json)
        assert spec.job_id is not None
        if owner_uid != JOB_OWNER and not privileged:
            raise AdoptRefused(spec.job_id, JOB_OWNER, owner_uid)
        return self.add("adopted", JOB_OWNER, RunState.PENDING)

    async def nodes(self, release: tuple[str, str] | None = None) -> tuple[list[Quarantined], bool]:
        if release is not None:
            self.released.append(release)
        return [], release is not None

    async def cancel(self, handle: Handle) -> None:
        if handle.run.state.is_final:
            raise IllegalTransition(handle.run.state.value, "Cancel")
        self.cancelled.append(handle.run.run_id)


@pytest.fixture
def sup(tmp_path: Path) -> Supervisor:
    return Supervisor(Config(state_dir=tmp_path, archive_dir=tmp_path / "archive"))


def request(op: str, **args: object) -> Request:
    filled = {name: spec.default for name, spec in OPS[op].args.items()}
    return Request(id=1, op=op, args={**filled, **args})


async def no_stream(item: Mapping[str, object]) -> None:
    raise AssertionError(f"unexpected stream item {item}")


def copies(sup: Supervisor, run_id: str) -> Path:
    d = sup.config.archive_root / run_id / "logs" / "attempt1"
    d.mkdir(parents=True, exist_ok=True)
    return d


# ----------------------------------------------------------------------------- the table


def test_the_handler_table_is_the_protocols_table_of_ops() -> None:
    assert set(HANDLERS) == set(OPS)
    for op, spec in OPS.items():
        assert HANDLERS[op].streaming is spec.streaming, op


def test_a_table_that_does_not_match_names_every_mismatch() -> None:
    table = {k: v for k, v in HANDLERS.items() if k != "archive"}
    table["frob"] = HANDLERS["ping"]
    table["wait"] = Op(HANDLERS["wait"].handler, streaming=False)
    with pytest.raises(SupervisorError) as info:
        check_handlers(table, OPS)
    message = str(info.value)
    assert "op 'archive' has no handler" in message
    assert "handler 'frob' is not an op" in message
    assert "op 'wait' streams but its handler does not" in message
    assert message.endswith(".")
    check_handlers(HANDLERS, OPS)  # the real one is fine


def test_an_op_added_to_the_protocol_without_a_handler_fails_at_import() -> None:
    code = (
        "from types import MappingProxyType\n"
        "import llmd_supervisor.adapters.control.protocol as p\n"
        "p.OPS = MappingProxyType({**p.OPS, 'frobnicate': p.OpSpec({})})\n"
        "import llmd_supervisor.supervision.control.api\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode != 0
    assert "op 'frobnicate' has no handler" in proc.stderr


@pytest.mark.asyncio
async def test_ping(sup: Supervisor) -> None:
    assert await ControlApi(sup).handle(request("ping"), ME, no_stream) == {"pong": True}


# ---------------------------------------------------------------------- requests


@pytest.mark.asyncio
async def test_status_is_a_typed_summary_the_client_reads_back(sup: Supervisor) -> None:
    h = sup.add("r1")
    h.health["node1"] = Health(0, True, "serving")
    h.health["node2"] = Health(1, False, "")
    (copies(sup, "r1") / "llmd-r1-42.out").write_bytes(b"one\ntwo \n\n")
    result = await ControlApi(sup, clock=lambda: T0.replace(minute=5)).handle(
        request("status", run="r1"), ME, no_stream
    )
    summary = read(RunSummary, result)
    assert summary == result
    assert summary["run"] == "r1" and summary["state"] == "running"
    assert summary["nodes_healthy"] == 1
    assert summary["health"]["node1"] == {"rank": 0, "reachable": True, "agent_state": "serving"}
    assert summary["last_log_line"] == "two "
    assert summary["elapsed_s"] == 60.0
    assert summary["transitions"][0]["state"] == "accepted"


@pytest.mark.asyncio
async def test_a_finished_runs_elapsed_time_stops_at_its_end_and_no_reachability_is_shown(
    sup: Supervisor,
) -> None:
    """After the end `status` said `0/4 reachable` and its elapsed time kept growing."""
    h = sup.add("done", state=RunState.SUCCEEDED)
    ended = Transition(RunState.SUCCEEDED, T0 + timedelta(seconds=90), "Archived")
    h.run = dataclasses.replace(
        h.run, nodes=("node1", "node2"), transitions=(*h.run.transitions, ended)
    )
    h.run = dataclasses.replace(h.run, outcome=Outcome.SUCCEEDED, reason="ok")
    api = ControlApi(sup, clock=lambda: T0 + timedelta(hours=5))
    summary = read(RunSummary, await api.handle(request("status", run="done"), ME, no_stream))
    assert summary["elapsed_s"] == 90.0
    out = io.StringIO()
    _print_summary(summary, out)
    assert "nodes node1,node2; ended after 90 s" in out.getvalue()
    assert "reachable" not in out.getvalue()


@pytest.mark.asyncio
async def test_list_shows_runs_in_flight_and_recent_ends_and_all_shows_the_rest(
    sup: Supervisor,
) -> None:
    """`list` and `list --all` printed the same thing: now `list` leaves out runs that
    ended more than a day ago; its table names the run, its cluster, job, owner, start,
    end and elapsed time."""
    sup.add("live", job_id="7").name = "dsr1-2p1d"
    for run_id, ended_after in (("recent", timedelta(hours=30)), ("old", timedelta(hours=1))):
        h = sup.add(run_id, state=RunState.FAILED)
        end = Transition(RunState.FAILED, T0 + ended_after, "Archived")
        h.run = dataclasses.replace(h.run, transitions=(*h.run.transitions, end), reason="x")
    sup.handles["old"].name = "adopted-4711"
    api = ControlApi(sup, clock=lambda: T0 + timedelta(hours=36))
    brief = read(RunList, await api.handle(request("list"), ME, no_stream))["runs"]
    assert [r["run"] for r in brief] == ["live", "recent"]
    assert [(r.get("name"), r.get("finished_at")) for r in brief] == [
        ("dsr1-2p1d", None),
        ("", (T0 + timedelta(hours=30)).isoformat()),
    ]
    every = read(RunList, await api.handle(request("list", all=True), ME, no_stream))["runs"]
    assert [r["run"] for r in every] == ["live", "old", "recent"]  # by start, then id
    head, *lines = list_table(every)
    assert head.split() == [
        "RUN", "NAME", "STATE", "CLUSTER", "JOB", "OWNER", "STARTED", "ENDED", "ELAPSED",
        "NODES", "OUTCOME",
    ]  # fmt: skip
    assert lines[0].split()[:5] == ["live", "dsr1-2p1d", "running", "dev", "7"]
    assert lines[1].split()[:2] == ["old", "adopted-4711"]
    assert lines[2].split()[:2] == ["recent", "-"]  # a spec without [run] name
    started = T0.astimezone()
    ended = [(T0 + timedelta(hours=h)).astimezone() for h in (1, 30)]

    def cell(line: str, column: str) -> str:
        return line[head.index(column) :].split()[0]

    assert cell(lines[0], "ENDED") == "-"  # still running
    # The end's date only when it is not the start's.
    same_day = ended[0].date() == started.date()
    assert cell(lines[1], "ENDED") == ended[0].strftime("%H:%M" if same_day else "%Y-%m-%d")
    assert lines[2][head.index("ENDED") :].startswith(ended[1].strftime("%Y-%m-%d %H:%M"))
    assert "36h00m" in lines[0] and "1h00m" in lines[1] and "30h00m" in lines[2]
    assert lines[1][head.index("OUTCOME") :] == "x"  # columns aligned


def test_list_reads_an_older_daemons_briefs() -> None:
    """A brief without `name` and `finished_at` (an older daemon) lists with "-"."""
    brief = {
        "run": "r1", "job_name": "llmd-r1", "state": "succeeded", "outcome": "succeeded",
        "reason": "ok", "slurm_job_id": "9", "attempt": 1, "nodes": ["node1"],
        "nodes_healthy": 0, "cancel_requested": False, "cluster": "dev", "owner_uid": ME.uid,
        "created_at": T0.isoformat(), "elapsed_s": 90.0, "archive": "/a/r1",
    }  # fmt: skip
    (run,) = read(RunList, {"runs": [brief]})["runs"]
    head, line = list_table([run])
    assert line.split()[:2] == ["r1", "-"]
    assert line[head.index("ENDED") :].startswith("- ")


@pytest.mark.asyncio
async def test_list_of_one_cluster(sup: Supervisor) -> None:
    """A shared journal holds the team's runs of several clusters: `list --cluster`."""
    sup.add("here")
    sup.add("there", cluster="gpu-b")
    api = ControlApi(sup)
    runs = read(RunList, await api.handle(request("list", cluster="gpu-b"), ME, no_stream))
    assert [r["run"] for r in runs["runs"]] == ["there"]
    every = read(RunList, await api.handle(request("list"), ME, no_stream))["runs"]
    assert [r["cluster"] for r in every] == ["dev", "gpu-b"]


@pytest.mark.asyncio
async def test_a_strangers_run_is_refused_and_not_listed(sup: Supervisor) -> None:
    sup.add("mine")
    sup.add("theirs", owner=OTHER.uid)
    a = ControlApi(sup)
    with pytest.raises(ControlError) as info:
        await a.handle(request("status", run="theirs"), ME, no_stream)
    assert info.value.code == "not_found"
    assert info.value.message == 'No run "theirs" is known to this daemon.'
    assert str(OTHER.uid) not in info.value.message
    with pytest.raises(ControlError) as missing:
        await a.handle(request("cancel", run="nope"), ME, no_stream)
    assert missing.value.code == "not_found"
    for op in ("cancel", "archive", "wait", "logs"):
        with pytest.raises(ControlError) as info:
            await a.handle(request(op, run="theirs"), ME, no_stream)
        assert info.value.code == "not_found", op
    assert sup.cancelled == []
    listed = read(RunList, await a.handle(request("list", all=True), ME, no_stream))
    assert [r["run"] for r in listed["runs"]] == ["mine"]
    root = Peer(0, 0, 3)
    listed = read(RunList, await a.handle(request("list", all=True), root, no_stream))
    assert sorted(r["run"] for r in listed["runs"]) == ["mine", "theirs"]


@pytest.mark.asyncio
async def test_a_run_another_daemon_accepted_since_the_last_refresh_is_found(
    sup: Supervisor,
) -> None:
    """A standby asked for a run it does not know reads the journal once more before it
    answers not found; a run it knows costs no read."""
    sup.add("known")
    late = sup.add("late")
    sup.unseen["late"] = sup.handles.pop("late")
    a = ControlApi(sup)
    await a.handle(request("status", run="known"), ME, no_stream)
    assert sup.looks == 0
    status = read(RunSummary, await a.handle(request("status", run="late"), ME, no_stream))
    assert status["run"] == late.run.run_id and sup.looks == 1
    with pytest.raises(ControlError) as missing:
        await a.handle(request("status", run="nope"), ME, no_stream)
    assert missing.value.code == "not_found" and sup.looks == 2


@pytest.mark.asyncio
async def test_cancel_of_a_final_run_is_a_conflict(sup: Supervisor) -> None:
    sup.add("r1")
    sup.add("done", state=RunState.SUCCEEDED)
    a = ControlApi(sup)
    read(RunSummary, await a.handle(request("cancel", run="r1"), ME, no_stream))
    assert sup.cancelled == ["r1"]
    with pytest.raises(ControlError) as info:
        await a.handle(request("cancel", run="done"), ME, no_stream)
    assert (info.value.code, info.value.message) == ("conflict", "Run done is already succeeded.")


@pytest.mark.asyncio
async def test_submit_validates_the_cluster_and_returns_a_summary(sup: Supervisor) -> None:
    a = ControlApi(sup)
    with pytest.raises(ControlError, match="Cluster 'mars' is not configured"):
        await a.handle(request("submit", spec_toml="", cluster="mars"), ME, no_stream)
    summary = read(RunSummary, await a.handle(request("submit", spec_toml="x"), ME, no_stream))
    assert (summary["run"], summary["owner_uid"]) == ("new", ME.uid)


def _adopt_json(job_id: str = "4711") -> str:
    return foreign.dump(ForeignSpec("adopt", Watch("/shared/runs/a"), job_id=job_id))


@pytest.mark.asyncio
async def test_adopt_of_another_users_job_is_not_found_and_a_bad_spec_a_bad_request(
    sup: Supervisor,
) -> None:
    a = ControlApi(sup)
    with pytest.raises(ControlError, match=r"^No job 4711 that you may adopt") as refused:
        await a.handle(request("adopt", spec_json=_adopt_json()), OTHER, no_stream)
    assert refused.value.code == "not_found"  # as a run the peer may not see
    assert "uid" not in refused.value.message and "1000" not in refused.value.message
    with pytest.raises(ControlError, match="'JOBID' has invalid value 'x'") as bad:
        await a.handle(request("adopt", spec_json=_adopt_json("x")), ME, no_stream)
    assert bad.value.code == "bad_request"
    summary = read(
        RunSummary, await a.handle(request("adopt", spec_json=_adopt_json()), ME, no_stream)
    )
    assert (summary["run"], summary["state"]) == ("adopted", "pending")
    with pytest.raises(ControlError, match="starts with '#!'"):
        script = foreign.dump(ForeignSpec("script", Watch("/shared/runs/a"), script="echo"))
        await a.handle(request("submit_script", spec_json=script), ME, no_stream)


@pytest.mark.asyncio
async def test_only_an_admin_may_release_a_node(sup: Supervisor) -> None:
    a = ControlApi(sup)
    with pytest.raises(ControlError, match="admin group may release") as refused:
        await a.handle(request("nodes", release="node4"), OTHER, no_stream)
    assert refused.value.code == "forbidden" and sup.released == []
    listed = await a.handle(request("nodes"), OTHER, no_stream)
    assert listed == {"nodes": [], "released": False}
    root = Peer(uid=0, gid=0, pid=3)
    assert (await a.handle(request("nodes", release="node4"), root, no_stream))["released"]
    assert sup.released == [(sup.config.clusters[0].name, "node4")]


# ---------------------------------------------------------------------- streams


@pytest.mark.asyncio
async def test_wait_sends_on_change_and_returns_the_final_summary(sup: Supervisor) -> None:
    h = sup.add("r1", state=RunState.PENDING)
    got: list[RunSummary] = []
    seen = anyio.Event()

    async def send(item: Mapping[str, object]) -> None:
        got.append(read(RunSummary, item))
        seen.set()

    # Far below WAIT_REFRESH_S: only the change signal can drive this.
    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            results: list[Mapping[str, object]] = []

            async def waiter() -> None:
                results.append(await ControlApi(sup).handle(request("wait", run="r1"), ME, send))

            tg.start_soon(waiter)
            await seen.wait()
            seen = anyio.Event()
            h.update(nodes=("n1",))  # a visible change: a new summary
            await seen.wait()
            h.update(state=RunState.SUCCEEDED, outcome=Outcome.SUCCEEDED, reason="ok")
    assert [s["state"] for s in got] == ["pending", "pending"]
    assert got[1]["nodes"] == ["n1"]
    final = read(RunSummary, results[0])
    assert (final["state"], final["outcome"], final["reason"]) == ("succeeded", "succeeded", "ok")


@pytest.mark.asyncio
async def test_wait_does_not_resend_an_unchanged_summary(sup: Supervisor) -> None:
    h = sup.add("r1")
    got: list[Mapping[str, object]] = []

    async def send(item: Mapping[str, object]) -> None:
        got.append(item)

    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ControlApi(sup).handle, request("wait", run="r1"), ME, send)
            for _ in range(5):  # heartbeats that change nothing a client shows
                await anyio.wait_all_tasks_blocked()
                h.update()
            await anyio.wait_all_tasks_blocked()
            h.update(state=RunState.FAILED)
    assert len(got) == 1


def _chunks(items: list[Mapping[str, object]]) -> list[LogChunk]:
    return [read(LogChunk, i) for i in items]


@pytest.mark.asyncio
async def test_logs_starts_at_the_offsets_given(sup: Supervisor) -> None:
    sup.add("r1", state=RunState.SUCCEEDED)
    d = copies(sup, "r1")
    (d / "llmd-r1-42.out").write_bytes(b"abc\ndef\n")
    (d / "llmd-r1-42.err").write_bytes(b"oops\n")
    (d / "rank1.agent.log").write_bytes(b"rank one\n")
    items: list[Mapping[str, object]] = []

    async def send(item: Mapping[str, object]) -> None:
        items.append(item)

    offsets = {"attempt1/llmd-r1-42.out": 4, "attempt1/llmd-r1-42.err": 5, "unknown": 3}
    done = await ControlApi(sup).handle(request("logs", run="r1", offsets=offsets), ME, send)
    assert _chunks(items) == [
        {
            "file": "attempt1/llmd-r1-42.out",
            "offset": 4,
            "end": 8,
            "data": "def\n",
            "encoding": "utf-8",
        },
    ]
    assert read(LogsDone, done) == {"bytes": 4, "state": "succeeded"}
    items.clear()
    await ControlApi(sup).handle(request("logs", run="r1", rank=1), ME, send)
    assert [c["data"] for c in _chunks(items)] == ["rank one\n"]


@pytest.mark.asyncio
async def test_logs_of_a_rank_the_run_does_not_have_is_an_error_naming_its_ranks(
    sup: Supervisor,
) -> None:
    """`logs RUN --rank 9` of a 4-node run exited 0 with nothing."""
    h = sup.add("r1")
    h.run = dataclasses.replace(h.run, nodes=("node1", "node2", "node3", "node4"))
    with pytest.raises(ControlError) as info:
        await ControlApi(sup).handle(request("logs", run="r1", rank=9), ME, no_stream)
    assert info.value.code == "bad_request"
    assert "has ranks 0 to 3" in info.value.message and "rank 9" in info.value.message


@pytest.mark.asyncio
async def test_logs_sends_a_big_copy_whole_in_bounded_items(sup: Supervisor) -> None:
    sup.add("r1", state=RunState.RUNNING)
    data = bytes(range(256)) * 2400  # 600 KiB, most of it not UTF-8
    (copies(sup, "r1") / "llmd-r1-42.out").write_bytes(data)
    items: list[LogChunk] = []

    async def send(item: Mapping[str, object]) -> None:
        assert len(json.dumps(item)) < 1 << 20  # under the message bound
        items.append(read(LogChunk, item))

    done = await ControlApi(sup).handle(request("logs", run="r1"), ME, send)
    assert [(c["offset"], c["end"]) for c in items] == [
        (0, log_follow.READ_CHUNK),
        (log_follow.READ_CHUNK, 2 * log_follow.READ_CHUNK),
        (2 * log_follow.READ_CHUNK, len(data)),
    ]
    assert {c["encoding"] for c in items} == {"base64"}
    assert b"".join(chunk_bytes(c) for c in items) == data
    assert read(LogsDone, done)["bytes"] == len(data)


@pytest.mark.asyncio
async def test_follow_wakes_on_growth_and_never_splits_a_character(sup: Supervisor) -> None:
    h = sup.add("r1")
    log = copies(sup, "r1") / "llmd-r1-42.out"
    log.write_bytes(b"")
    items: list[LogChunk] = []
    arrived = anyio.Event()

    async def send(item: Mapping[str, object]) -> None:
        nonlocal arrived
        items.append(read(LogChunk, item))
        arrived.set()

    async def grow(data: bytes) -> None:
        nonlocal arrived
        arrived = anyio.Event()
        with log.open("ab") as f:
            f.write(data)
        with anyio.fail_after(0.5):  # far below FOLLOW_SAFETY_S: the growth woke it
            await arrived.wait()

    result: list[Mapping[str, object]] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def follower() -> None:
                result.append(
                    await ControlApi(sup).handle(request("logs", run="r1", follow=True), ME, send)
                )

            tg.start_soon(follower)
            await anyio.wait_all_tasks_blocked()
            await grow(b"line 1\n")
            await grow("caf\u00e9".encode()[:-1])  # "caf" and the first byte of the e-acute
            await grow("\u00e9!\n".encode()[1:])
            h.update(state=RunState.SUCCEEDED)
    assert [(c["offset"], c["end"], c["data"]) for c in items] == [
        (0, 7, "line 1\n"),
        (7, 10, "caf"),
        (10, 14, "\u00e9!\n"),
    ]
    assert read(LogsDone, result[0])["bytes"] == len(log.read_bytes())


def test_inotify_is_there_on_this_machine() -> None:
    # Without it the follower falls back to FOLLOW_POLL_S; the test above would still pass
    # its timing only by luck, so say so plainly.
    growth = log_follow.Growth.open()
    assert growth is not None, "inotify unavailable"
    growth.close()


def test_whole_utf8_holds_back_only_a_cut_character() -> None:
    e = "\u00e9".encode()
    euro = "\u20ac".encode()
    emoji = "\U0001f600".encode()
    assert log_follow.whole_utf8(b"abc") == 3
    assert log_follow.whole_utf8(b"ab" + e[:1]) == 2
    assert log_follow.whole_utf8(b"ab" + e) == 4
    assert log_follow.whole_utf8(b"a" + euro[:2]) == 1
    assert log_follow.whole_utf8(b"a" + emoji[:3]) == 1
    assert log_follow.whole_utf8(b"a" + emoji) == 5
    assert log_follow.whole_utf8(b"a\xff") == 2  # not UTF-8 at all: nothing to wait for
    assert log_follow.whole_utf8(b"") == 0


# ----------------------------------------------------------------------------- hostile peers


@pytest.mark.asyncio
async def test_a_job_id_shared_by_two_clusters_is_ambiguous_until_the_cluster_is_named(
    sup: Supervisor,
) -> None:
    sup.add("east1", job_id="5", cluster="east")
    sup.add("west1", job_id="5", cluster="west")
    sup.add("hidden", owner=OTHER.uid, job_id="6", cluster="east")
    sup.add("mine6", job_id="6", cluster="west")
    a = ControlApi(sup)
    with pytest.raises(ControlError) as info:
        await a.handle(request("cancel", run="5"), ME, no_stream)
    assert info.value.code == "ambiguous"
    assert "east1 (east:5" in info.value.message and "west1 (west:5" in info.value.message
    assert "CLUSTER:JOBID" in info.value.message
    assert sup.cancelled == []
    await a.handle(request("cancel", run="west:5"), ME, no_stream)
    assert sup.cancelled == ["west1"]
    # A run the peer may not see neither makes a ref ambiguous nor is found by cluster.
    got = read(RunSummary, await a.handle(request("status", run="6"), ME, no_stream))
    assert got["run"] == "mine6"
    with pytest.raises(ControlError) as info:
        await a.handle(request("status", run="east:6"), ME, no_stream)
    assert info.value.code == "not_found"
    root = Peer(0, 0, 3)
    with pytest.raises(ControlError) as info:
        await a.handle(request("status", run="6"), root, no_stream)
    assert info.value.code == "ambiguous"


@pytest.mark.asyncio
async def test_error_messages_are_bounded_whatever_the_ref(sup: Supervisor) -> None:
    ref = "\u0001" * 500_000
    with pytest.raises(ControlError) as info:
        await ControlApi(sup).handle(request("status", run=ref), ME, no_stream)
    assert info.value.code == "not_found"
    assert len(info.value.message) < 200


@pytest.mark.asyncio
async def test_list_pages_ten_thousand_runs_each_page_within_the_bound(sup: Supervisor) -> None:
    # Ten thousand handles with 5,000-character reasons: the collector's full passes over
    # them (1.2 s seen in setup under CI's load) are not what the loop guard is about here,
    # so it is off for the test; every page's own work is still watched.
    gc.disable()
    try:
        for i in range(10_000):
            h = sup.add(f"r{i:05d}", state=RunState.SUCCEEDED, created=T0 + timedelta(seconds=i))
            h.update(reason="\u0001" * 5000)  # hostile evidence: briefs cut it
            if i % 50 == 0:
                await anyio.lowlevel.checkpoint()  # setup is not what the guard is about
        sup.add("theirs", owner=OTHER.uid, state=RunState.SUCCEEDED)
        await _pages_of_ten_thousand(sup)
    finally:
        gc.enable()


async def _pages_of_ten_thousand(sup: Supervisor) -> None:
    a = ControlApi(sup)
    seen: list[str] = []
    after: object = None
    pages = 0
    while True:
        result = await a.handle(request("list", all=True, after=after), ME, no_stream)
        assert len(json.dumps(result, separators=(",", ":"))) < 1 << 20
        page = read(RunList, result)
        seen += [r["run"] for r in page["runs"]]
        pages += 1
        after = page.get("next")
        if after is None:
            break
        await anyio.lowlevel.checkpoint()
    assert seen == [f"r{i:05d}" for i in range(10_000)]
    assert pages > 1
    limited = read(RunList, await a.handle(request("list", all=True, limit=3), ME, no_stream))
    assert [r["run"] for r in limited["runs"]] == ["r00000", "r00001", "r00002"]
    for bad in ({"limit": 0}, {"limit": 1001}, {"after": "no-bar"}):
        with pytest.raises(ControlError) as info:
            await a.handle(request("list", **bad), ME, no_stream)
        assert info.value.code == "bad_request"


@pytest.mark.asyncio
async def test_any_bytes_stream_byte_exact_in_chunks_within_the_bound(sup: Supervisor) -> None:
    sup.add("r1", state=RunState.SUCCEEDED)
    d = copies(sup, "r1")
    cases = {
        "llmd-r1-42.out": b"\x01\x02\x1f" * 400_000,  # valid UTF-8, 6 bytes each escaped
        "llmd-r1-42.err": b"ok \xff\xfe half \xe2\x82" * 50_000 + b"\xe2",  # not UTF-8
    }
    for name, data in cases.items():
        (d / name).write_bytes(data)
    got: dict[str, bytearray] = {}

    async def send(item: Mapping[str, object]) -> None:
        assert len(json.dumps(item, separators=(",", ":"))) < (1 << 20) - 4096
        chunk = read(LogChunk, item)
        got.setdefault(chunk["file"].split("/")[-1], bytearray()).extend(chunk_bytes(chunk))

    await ControlApi(sup).handle(request("logs", run="r1"), ME, send)
    assert {k: bytes(v) for k, v in got.items()} == cases
