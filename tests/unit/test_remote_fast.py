"""`NodeLink` and `tail_to_local` against an in-process SSH server on 127.0.0.1.

The server (tests/fakes/ssh_server.py) is real SSH: host key verified from known_hosts,
public-key login, exec requests run by /bin/sh as local processes, SFTP on the local file
system. So a "remote" file is a local file in tmp_path, and faults (every connection
reset, the server stopped and restarted on its port) take milliseconds. The same
behaviour against the dev cluster's sshd is tested in tests/cluster/test_remote.py.
"""

from __future__ import annotations

import errno
import itertools
import os
import shlex
import time
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import asyncssh
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from llmd_supervisor.adapters.nodes import jobfiles as jobfiles
from llmd_supervisor.adapters.nodes import tail as tail
from llmd_supervisor.adapters.nodes.remote import NodeLink
from llmd_supervisor.adapters.nodes.tail import tail_to_local
from llmd_supervisor.errors import FileRefused, RemoteError, TailConflict
from tests.fakes.hostile import SECRET, plant
from tests.fakes.log_writer import Writer, size_of
from tests.fakes.ssh_server import HOST, FakeSshServer, wait_until
from tests.fakes.ssh_server import ssh_server as ssh_server  # the fixture

FOLLOWER = "' follow "  # in the command line of node/safe_read.py's follower (after its source)


def waiting(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    """The follower's messages that it waits for its file to appear."""
    return [e for e in logs if "waiting for" in str(e.get("message", ""))]


@pytest_asyncio.fixture
async def link(ssh_server: FakeSshServer) -> AsyncIterator[NodeLink]:
    node = NodeLink(HOST, ssh_server.settings())
    try:
        yield node
    finally:
        await node.aclose()


def tail_starts(server: FakeSshServer) -> list[int]:
    """The byte offset each remote follower started at, in order."""
    starts = []
    for command in server.commands:
        argv = shlex.split(command)
        if len(argv) > 5 and argv[4] == jobfiles.SOURCE and argv[5] == "follow":
            starts.append(int(argv[8]))  # follow ROOT REL OFFSET POLL
    return starts


def events(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


# ---- one-shot operations


@pytest.mark.asyncio
async def test_run_passes_argv_stdin_and_the_exit_status(link: NodeLink) -> None:
    with anyio.fail_after(10):
        res = await link.run(
            ["sh", "-c", "cat; echo 'it''s' >&2; exit 3"], time_limit=5, stdin=b"in\n"
        )
        assert (res.exit_status, res.stdout, res.stderr) == (3, b"in\n", b"its\n")
        quoted = await link.run(["printf", "%s|", "a b", "$HOME", "'q'"], time_limit=5)
        assert (quoted.exit_status, quoted.stdout) == (0, b"a b|$HOME|'q'|")
        killed = await link.run(["sh", "-c", "kill -TERM $$"], time_limit=5)
        assert killed.exit_status == -15
        assert link.last_ok is not None and link.reconnects == 0


@pytest.mark.asyncio
async def test_job_files_are_read_by_the_node_reader_and_missing_ones_are_none(
    link: NodeLink, tmp_path: Path
) -> None:
    d = tmp_path / "logs"
    (d / "sub").mkdir(parents=True)
    (d / "rank0.status.json").write_bytes(b'{"state": "running"}\n')
    (d / ".bench_done.42").write_bytes(b"{}")
    with anyio.fail_after(10):
        status = str(d / "rank0.status.json")
        assert await link.read_file(str(d), status) == b'{"state": "running"}\n'
        assert await link.list_dir(str(d), str(d)) == [".bench_done.42", "rank0.status.json", "sub"]
        assert await link.read_file(str(d), str(d / "missing")) is None
        assert await link.list_dir(str(d), str(d / "missing")) == []
        assert await link.read_file(str(d), str(d / "sub" / "missing")) is None


@pytest.mark.asyncio
async def test_links_fifos_directories_and_huge_files_are_refused_unread(
    link: NodeLink, tmp_path: Path
) -> None:
    secret = tmp_path / "secret" / "shadow"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    d = tmp_path / "logs"
    kinds = plant(d, secret)
    with anyio.fail_after(20):
        for name, why in kinds.items():
            with pytest.raises(FileRefused, match=why) as info:
                await link.read_file(str(d), str(d / name))
            assert "secret-hash" not in str(info.value)
        with pytest.raises(FileRefused, match="symbolic link"):
            await link.list_dir(str(d), str(d / "dirlink"))
        # the reader goes on answering after every refusal
        (d / "ok").write_bytes(b"fine")
        assert await link.read_file(str(d), str(d / "ok")) == b"fine"


@pytest.mark.asyncio
async def test_concurrent_operations_share_one_connection(
    ssh_server: FakeSshServer, link: NodeLink, tmp_path: Path
) -> None:
    (tmp_path / "f").write_bytes(b"x" * 100)
    results: list[object] = []

    async def one(i: int) -> None:
        if i % 2:
            results.append((await link.run(["echo", str(i)], time_limit=5)).stdout)
        else:
            data = await link.read_file(str(tmp_path), str(tmp_path / "f"))
            results.append(len(data or b""))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
    assert sorted(map(str, results)) == sorted(
        [str(f"{i}\n".encode()) for i in (1, 3, 5, 7)] + ["100"] * 4
    )
    assert ssh_server.accepted == 1 and link.reconnects == 0


@pytest.mark.asyncio
async def test_time_limit_is_a_remote_error_and_the_remote_process_ends(
    ssh_server: FakeSshServer, link: NodeLink
) -> None:
    with anyio.fail_after(10):
        started = time.monotonic()
        with pytest.raises(RemoteError, match=r"no answer within 0\.5 s"):
            await link.run(["sleep", "29.25"], time_limit=0.5)
        assert time.monotonic() - started < 1.5
        assert (await link.run(["true"], time_limit=5)).exit_status == 0
        assert link.reconnects == 0
        # The channel is closed but sshd does not kill its process; the remote `timeout` does.
        assert ssh_server.running("sleep 29.25")
        await wait_until("remote sleep gone", lambda: not ssh_server.running("sleep 29.25"), 5)


@pytest.mark.asyncio
async def test_a_host_key_not_in_known_hosts_is_refused(
    ssh_server: FakeSshServer, tmp_path: Path
) -> None:
    kind, key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().split()[:2]
    entry = f"[{HOST}]:{ssh_server.port} {kind.decode()} {key.decode()}\n"  # another host's key
    (tmp_path / "wrong_known_hosts").write_text(entry)
    (tmp_path / "empty_known_hosts").write_text("")
    for known in ("wrong_known_hosts", "empty_known_hosts"):
        bad = NodeLink(HOST, ssh_server.settings(known_hosts=str(tmp_path / known)))
        try:
            with anyio.fail_after(10), pytest.raises(RemoteError, match="while connecting"):
                await bad.run(["true"], time_limit=5)
            assert bad.last_ok is None and not bad.connected
        finally:
            await bad.aclose()
    assert not ssh_server.commands


@pytest.mark.asyncio
async def test_a_closed_link_refuses_operations(link: NodeLink) -> None:
    with anyio.fail_after(10):
        assert (await link.run(["true"], time_limit=5)).exit_status == 0
        await link.aclose()
        assert link.closed and not link.connected
        with pytest.raises(RemoteError, match="the link was closed"):
            await link.read_file("/tmp", "/tmp/x")


# ---- reconnecting


@pytest.mark.asyncio
async def test_reconnects_after_the_server_drops_every_connection(
    ssh_server: FakeSshServer, link: NodeLink
) -> None:
    failed: list[RemoteError] = []

    async def in_flight() -> None:
        try:
            await link.run(["sleep", "5"], time_limit=8)
        except RemoteError as exc:
            failed.append(exc)

    with capture_logs() as logs, anyio.fail_after(10):
        assert (await link.run(["true"], time_limit=5)).exit_status == 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(in_flight)
            await wait_until("sleep started", lambda: bool(ssh_server.running("sleep 5")))
            started = time.monotonic()
            assert ssh_server.drop_connections() == 1
        # The operation in flight fails at once instead of waiting for its time limit.
        assert failed and time.monotonic() - started < 2
        assert not link.connected
        assert (await link.run(["echo", "back"], time_limit=5)).stdout == b"back\n"
    assert link.reconnects == 1 and ssh_server.accepted == 2
    assert events(logs, "ssh.reconnect") == [
        {"event": "ssh.reconnect", "host": HOST, "reconnects": 1, "log_level": "info"}
    ]


@pytest.mark.asyncio
async def test_reconnects_with_backoff_while_the_server_is_down_then_after_its_restart(
    ssh_server: FakeSshServer, link: NodeLink
) -> None:
    with capture_logs() as logs, anyio.fail_after(15):
        assert (await link.run(["true"], time_limit=5)).exit_status == 0
        port = ssh_server.port
        await ssh_server.stop()
        await wait_until("drop noticed", lambda: not link.connected)
        attempts: list[float] = []
        for _ in range(3):
            with pytest.raises(RemoteError, match="while connecting"):
                await link.run(["true"], time_limit=10)
            attempts.append(time.monotonic())
        await ssh_server.start()
        assert ssh_server.port == port
        res = await link.run(["echo", "again"], time_limit=10)
    assert res.stdout == b"again\n" and link.reconnects == 1
    errors = [e for e in events(logs, "ssh.error") if e["action"] == "connecting"]
    assert [e["failures"] for e in errors] == [1, 2, 3]
    # Each attempt waited out the jittered backoff the previous failure announced.
    announced = [float(str(e["retry_in_s"])) for e in errors]
    for (a, b), wait in zip(itertools.pairwise(attempts), announced, strict=False):
        assert b - a >= wait - 0.01
    assert 0.1 <= float(str(errors[0]["retry_in_s"])) <= 0.2
    assert 0.4 <= float(str(errors[2]["retry_in_s"])) <= 0.8
    assert events(logs, "ssh.reconnect")


# ---- tailing


@pytest.mark.asyncio
async def test_tail_copies_a_growing_file_byte_exact(
    ssh_server: FakeSshServer, link: NodeLink, tmp_path: Path
) -> None:
    src, dst = tmp_path / "rank0.agent.log", tmp_path / "copy" / "rank0.agent.log"
    writer = Writer(src, lines=400, per_second=1000)
    counted: list[int] = []
    stop = anyio.Event()
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: tail_to_local(
                    link, str(src.parent), str(src), dst, stop=stop, on_bytes=counted.append
                )
            )
            await writer.run()
            stop.set()
        assert dst.read_bytes() == src.read_bytes()
        assert sum(counted) == src.stat().st_size
        assert tail_starts(ssh_server) == [0] and link.reconnects == 0
        await wait_until("remote follower gone", lambda: not ssh_server.running(FOLLOWER))


@pytest.mark.asyncio
async def test_tail_resumes_at_the_local_size_after_every_connection_drops(
    ssh_server: FakeSshServer, link: NodeLink, tmp_path: Path
) -> None:
    src, dst = tmp_path / "rank1.decode.engine.log", tmp_path / "copy.log"
    writer = Writer(src, lines=1500, per_second=1500)
    stop = anyio.Event()
    with capture_logs() as logs, anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop))
            async with anyio.create_task_group() as inner:
                inner.start_soon(writer.run)
                await wait_until("bytes flowing", lambda: size_of(dst) > 20_000)
                ssh_server.drop_connections()
                await wait_until("reconnected", lambda: link.reconnects == 1)
                await wait_until("bytes flowing again", lambda: size_of(dst) > 40_000)
                ssh_server.drop_connections()
                await wait_until("reconnected again", lambda: link.reconnects == 2)
            stop.set()
    assert dst.read_bytes() == src.read_bytes()
    resumed = [int(str(e["offset"])) for e in events(logs, "tail.resumed")]
    starts = tail_starts(ssh_server)
    # Every follower after the first started exactly at the local copy's size then.
    assert len(starts) >= 3 and starts[0] == 0 and set(starts[1:]) <= set(resumed)
    assert starts == sorted(starts)
    await wait_until("remote followers gone", lambda: not ssh_server.running(FOLLOWER))


@pytest.mark.asyncio
async def test_tail_survives_a_server_restart(
    ssh_server: FakeSshServer, link: NodeLink, tmp_path: Path
) -> None:
    src, dst = tmp_path / "job.out", tmp_path / "job.out.copy"
    writer = Writer(src, lines=1200, per_second=1500)
    stop = anyio.Event()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop))
            async with anyio.create_task_group() as inner:
                inner.start_soon(writer.run)
                await wait_until("bytes flowing", lambda: size_of(dst) > 10_000)
                await ssh_server.stop()
                await wait_until("drop noticed", lambda: not link.connected)
                down_at = size_of(dst)
                # The job's log grows while the server is down (whatever the writer's pace
                # under load: it may have written its last line already).
                with src.open("ab") as f:
                    f.write(b"".join(b"while down %06d\n" % i for i in range(1200)))
                await ssh_server.start()
                await wait_until("reconnected", lambda: link.reconnects == 1)
                await wait_until("catching up", lambda: size_of(dst) > down_at + 20_000)
            stop.set()
    assert dst.read_bytes() == src.read_bytes()
    first, *restarts = tail_starts(ssh_server)
    assert first == 0 and restarts and restarts[0] >= down_at


@pytest.mark.asyncio
async def test_stop_drains_a_burst_written_just_before_it(
    ssh_server: FakeSshServer, link: NodeLink, tmp_path: Path
) -> None:
    src, dst = tmp_path / "burst.log", tmp_path / "burst.copy"
    src.write_bytes(b"")
    stop = anyio.Event()
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop))
            await wait_until("follower running", lambda: bool(ssh_server.running(FOLLOWER)))
            src.write_bytes(os.urandom(4 << 20))  # the tailer must not return before it
            stop.set()
    assert dst.read_bytes() == src.read_bytes()


@pytest.mark.asyncio
async def test_the_drain_is_bounded_when_the_node_is_gone(
    ssh_server: FakeSshServer,
    link: NodeLink,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tail, "DRAIN_LIMIT_S", 0.5)
    src, dst = tmp_path / "gone.log", tmp_path / "gone.copy"
    src.write_bytes(b"before\n")
    stop = anyio.Event()
    with capture_logs() as logs, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop))
            await wait_until("copied", lambda: size_of(dst) == 7)
            await ssh_server.stop()
            with src.open("ab") as f:
                f.write(b"after, never copied\n")
            stop.set()
            stopped = time.monotonic()
        took = time.monotonic() - stopped
    assert 0.4 <= took < 2.0, took
    assert dst.read_bytes() == b"before\n"
    assert events(logs, "tail.drain_incomplete")[0]["limit_s"] == 0.5


@pytest.mark.asyncio
async def test_tail_waits_for_a_file_that_appears_late(
    ssh_server: FakeSshServer, link: NodeLink, tmp_path: Path
) -> None:
    src, dst = tmp_path / "late" / "rank3.agent.log", tmp_path / "late.copy"
    stop = anyio.Event()
    with capture_logs() as logs, anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop))
            await wait_until("waiting", lambda: bool(waiting(logs)))
            assert size_of(dst) == 0
            src.parent.mkdir()
            await Writer(src, lines=200, per_second=1000).run()
            await wait_until("copied", lambda: size_of(dst) == size_of(src))
            stop.set()
    assert dst.read_bytes() == src.read_bytes()
    assert tail_starts(ssh_server) == [0]


@pytest.mark.asyncio
async def test_a_local_disk_error_surfaces_as_oserror(
    ssh_server: FakeSshServer, link: NodeLink, tmp_path: Path
) -> None:
    src, dst = tmp_path / "full.log", tmp_path / "full.copy"
    src.write_bytes(b"no room for this\n")
    dst.symlink_to("/dev/full")  # every write fails with ENOSPC
    with anyio.fail_after(10):
        with pytest.raises(OSError) as info:
            await tail_to_local(link, str(src.parent), str(src), dst, stop=anyio.Event())
        assert info.value.errno == errno.ENOSPC
        await wait_until("remote follower gone", lambda: not ssh_server.running(FOLLOWER))


@pytest.mark.asyncio
async def test_a_cancelled_tail_leaves_a_prefix_and_no_remote_follower(
    ssh_server: FakeSshServer, link: NodeLink, tmp_path: Path
) -> None:
    src, dst = tmp_path / "cancel.log", tmp_path / "cancel.copy"
    writer = Writer(src, lines=5000, per_second=2000)
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.run)
            tg.start_soon(
                lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=anyio.Event())
            )
            await wait_until("bytes flowing", lambda: size_of(dst) > 10_000)
            tg.cancel_scope.cancel()
        copied = dst.read_bytes()
        assert copied and src.read_bytes().startswith(copied)
        await wait_until("remote follower gone", lambda: not ssh_server.running(FOLLOWER))
        stop = anyio.Event()
        stop.set()  # a tailer stopped from the start still drains once, from the local size
        await tail_to_local(link, str(src.parent), str(src), dst, stop=stop)
    assert dst.read_bytes() == src.read_bytes()
    assert tail_starts(ssh_server) == [0, len(copied)]


@pytest.mark.asyncio
async def test_closing_the_link_ends_its_tailer_and_a_second_tailer_is_refused(
    ssh_server: FakeSshServer, link: NodeLink, tmp_path: Path
) -> None:
    src, dst = tmp_path / "x.log", tmp_path / "x.copy"
    src.write_bytes(b"data\n")
    failed: list[RemoteError] = []

    async def tailer() -> None:
        try:
            await tail_to_local(link, str(src.parent), str(src), dst, stop=anyio.Event())
        except RemoteError as exc:
            failed.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(tailer)
            await wait_until("copied", lambda: size_of(dst) == 5)
            with pytest.raises(TailConflict, match="already being appended"):
                await tail_to_local(link, str(src.parent), str(src), dst, stop=anyio.Event())
            await link.aclose()
        assert failed and link.closed
        assert dst.read_bytes() == b"data\n"
        await wait_until("remote follower gone", lambda: not ssh_server.running(FOLLOWER))


@pytest.mark.asyncio
async def test_a_job_directory_of_thousands_of_files_lists_up_to_the_bound(
    link: NodeLink, tmp_path: Path
) -> None:
    d = tmp_path / "logs" / "7"

    def make() -> None:
        d.mkdir(parents=True)
        for i in range(5000):
            (d / f"rank{i % 4}.{'x' * 200}.{i}.log").touch()

    await anyio.to_thread.run_sync(make)
    with anyio.fail_after(30):
        names = await link.list_dir(str(tmp_path / "logs"), str(d))
    assert len(names) == jobfiles.LIST_MAX
