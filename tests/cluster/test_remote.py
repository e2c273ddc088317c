"""`llmd_supervisor.adapters.nodes.remote` against the dev cluster's real sshd on every node.

The nodes share this machine's filesystem, so a test writes a "remote" file locally (in
`shared_tmp`) and reads it through SSH. Faults (sshd stop, link cut) are always undone.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from llmd_supervisor.adapters.nodes.remote import NodeLink, SshSettings
from llmd_supervisor.adapters.nodes.tail import tail_to_local
from llmd_supervisor.errors import FileRefused, RemoteError, TailConflict
from tests.devcluster import DevCluster, devcluster
from tests.fakes.log_writer import Writer, size_of


@pytest.fixture
def settings(cluster: DevCluster) -> SshSettings:
    # Short keepalives so a cut link is noticed in ~1.5 s instead of ~15 s.
    return SshSettings(
        username=cluster.env["DEVCLUSTER_SSH_USER"],
        client_keys=(cluster.ssh_key,),
        known_hosts=cluster.known_hosts,
        connect_timeout=3.0,
        keepalive_interval=0.5,
    )


@pytest_asyncio.fixture
async def link(cluster: DevCluster, settings: SshSettings) -> AsyncIterator[NodeLink]:
    node = NodeLink(cluster.nodes[0], settings)
    try:
        yield node
    finally:
        await node.aclose()


async def wait_until(what: str, cond: object, limit: float = 20) -> None:
    """Await a condition (a zero-argument callable) by polling it every 10 ms."""
    assert callable(cond)
    with anyio.fail_after(limit):
        # Polling: the conditions are file sizes and link state, which signal no event.
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def fault(*args: str) -> None:
    await anyio.to_thread.run_sync(lambda: devcluster(*args))


def pgrep(pattern: str) -> list[str]:
    """Processes on any node whose command line matches (the nodes share the pid space)."""
    out = subprocess.run(
        ["pgrep", "-af", pattern], capture_output=True, text=True, check=False
    ).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def remote_followers(path: Path) -> list[str]:
    """`safe_read.py follow` processes on any node still following `path`."""
    return pgrep(f"follow {path.parent.parent} {path.parent.name}/{path.name} ")


def known_hosts_lines(cluster: DevCluster) -> list[str]:
    return Path(cluster.known_hosts).read_text().splitlines()


# ---- one-shot operations


@pytest.mark.asyncio
async def test_operations_on_every_node(
    cluster: DevCluster, settings: SshSettings, shared_tmp: Path
) -> None:
    (shared_tmp / "sub").mkdir()
    (shared_tmp / "rank0.status.json").write_bytes(b'{"state": "running"}\n')
    (shared_tmp / ".bench_done.42").write_bytes(b"{}")
    (shared_tmp / "sub" / "link").symlink_to("/etc/shadow")
    for node in cluster.nodes:
        link = NodeLink(node, settings)
        try:
            with anyio.fail_after(30):
                res = await link.run(["uname", "-n"], time_limit=10)
                assert (res.exit_status, res.stdout, res.stderr) == (0, f"{node}\n".encode(), b"")
                res = await link.run(["sh", "-c", "echo 'it''s' >&2; exit 3"], time_limit=10)
                assert (res.exit_status, res.stdout, res.stderr) == (3, b"", b"its\n")
                quoted = await link.run(["printf", "%s|", "a b", "$HOME", "'q'"], time_limit=10)
                assert quoted.stdout == b"a b|$HOME|'q'|"

                status = str(shared_tmp / "rank0.status.json")
                logs = str(shared_tmp)
                assert await link.read_file(logs, status) == b'{"state": "running"}\n'
                assert await link.read_file(logs, str(shared_tmp / "missing")) is None
                assert await link.list_dir(logs, logs) == [
                    ".bench_done.42",
                    "rank0.status.json",
                    "sub",
                ]
                assert await link.list_dir(logs, str(shared_tmp / "missing")) == []
                with pytest.raises(FileRefused, match="symbolic link"):
                    await link.read_file(logs, str(shared_tmp / "sub" / "link"))
                assert link.last_ok is not None and link.reconnects == 0
        finally:
            await link.aclose()


@pytest.mark.asyncio
async def test_one_connection_shared_by_concurrent_operations(
    link: NodeLink, shared_tmp: Path
) -> None:
    log = shared_tmp / "a.log"
    log.write_bytes(b"x" * 1000)
    seen: list[bytes] = []

    async def who() -> None:
        res = await link.run(["sh", "-c", 'echo "$SSH_CONNECTION"'], time_limit=10)
        seen.append(res.stdout)

    stop = anyio.Event()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: tail_to_local(
                    link, str(log.parent), str(log), shared_tmp / "a.copy", stop=stop
                )
            )
            for _ in range(8):
                tg.start_soon(who)
            await wait_until("first bytes", lambda: size_of(shared_tmp / "a.copy") > 0)
            await who()
            stop.set()
    # Same client address and port every time: one TCP connection, many channels.
    assert len(set(seen)) == 1 and len(seen) == 9
    assert link.reconnects == 0


@pytest.mark.asyncio
async def test_time_limit_is_a_remote_error_and_the_link_stays_usable(link: NodeLink) -> None:
    with anyio.fail_after(30):
        started = time.monotonic()
        with pytest.raises(RemoteError, match=r"no answer within 0\.5 s"):
            await link.run(["sleep", "29.25"], time_limit=0.5)
        assert time.monotonic() - started < 1.5
        assert (await link.run(["true"], time_limit=10)).exit_status == 0
        assert link.reconnects == 0
        # sshd does not kill a process whose channel closed; the remote `timeout` does.
        await wait_until("remote process gone", lambda: not pgrep("sleep 29.25"), 10)


@pytest.mark.asyncio
async def test_host_key_mismatch_is_refused(
    cluster: DevCluster, settings: SshSettings, shared_tmp: Path
) -> None:
    a, b = cluster.nodes[0], cluster.nodes[1]
    lines = known_hosts_lines(cluster)
    key_of_b = next(line for line in lines if line.split()[0].split(",")[0] == b).split()[1:]
    addr_a = cluster.addrs[a]
    wrong = shared_tmp / "known_hosts"
    wrong.write_text(f"{a},{addr_a} {' '.join(key_of_b)}\n")
    bad = NodeLink(
        a,
        SshSettings(settings.username, settings.client_keys, str(wrong), connect_timeout=3.0),
    )
    try:
        with anyio.fail_after(20), pytest.raises(RemoteError, match="while connecting"):
            await bad.run(["true"], time_limit=10)
        assert bad.last_ok is None and not bad.connected
    finally:
        await bad.aclose()
    with pytest.raises(ValueError, match="known_hosts"):
        SshSettings(settings.username, settings.client_keys, None)


# ---- tailing


@pytest.mark.asyncio
async def test_tail_of_a_steadily_written_file_is_byte_identical(
    link: NodeLink, shared_tmp: Path
) -> None:
    src, dst = shared_tmp / "rank0.agent.log", shared_tmp / "copy" / "rank0.agent.log"
    writer = Writer(src, lines=600, per_second=300)
    stop = anyio.Event()
    latencies: list[float] = []
    counted: list[int] = []

    async def probe() -> None:
        """Time how long each newly written byte takes to reach the local copy."""
        while writer.written < writer.lines:
            await anyio.sleep(0.05)
            target, t0 = src.stat().st_size, time.monotonic()
            await wait_until("copy", lambda t=target: size_of(dst) >= t, 5)
            latencies.append(time.monotonic() - t0)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: tail_to_local(
                    link, str(src.parent), str(src), dst, stop=stop, on_bytes=counted.append
                )
            )
            async with anyio.create_task_group() as inner:
                inner.start_soon(writer.run)
                await wait_until("file", src.exists)
                inner.start_soon(probe)
            stop.set()
    assert dst.read_bytes() == src.read_bytes()
    assert sum(counted) == src.stat().st_size
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.25, latencies
    assert link.reconnects == 0


@pytest.mark.asyncio
async def test_tail_survives_sshd_stop_and_a_cut_link(
    cluster: DevCluster, link: NodeLink, shared_tmp: Path
) -> None:
    node = link.host
    src, dst = shared_tmp / "rank1.decode.engine.log", shared_tmp / "copy.log"
    writer = Writer(src, lines=1500, per_second=250)
    stop = anyio.Event()
    with capture_logs() as logs, anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop))
            async with anyio.create_task_group() as inner:
                inner.start_soon(writer.run)
                await wait_until("bytes flowing", lambda: size_of(dst) > 0)
                # Existing sessions outlive sshd's listener; the cut makes keepalives fail.
                await fault("sshd", node, "stop")
                try:
                    await fault("node", node, "cut")
                    try:
                        await wait_until("connection dropped", lambda: not link.connected, 30)
                        cut_at = dst.stat().st_size
                        await anyio.sleep(0.5)  # the writer keeps writing while the node is cut
                    finally:
                        await fault("node", node, "restore")
                finally:
                    await fault("sshd", node, "start")
                await wait_until("reconnected", lambda: link.reconnects >= 1, 30)
                await wait_until("catching up", lambda: dst.stat().st_size > cut_at, 30)
            stop.set()
    assert dst.read_bytes() == src.read_bytes()
    assert link.reconnects >= 1
    events = [e["event"] for e in logs]
    assert "ssh.reconnect" in events and "tail.resumed" in events


@pytest.mark.asyncio
async def test_tail_resumes_at_the_local_size(link: NodeLink, shared_tmp: Path) -> None:
    src, dst = shared_tmp / "job.out", shared_tmp / "job.out.copy"
    first = b"".join(b"first %d\n" % i for i in range(1000))
    src.write_bytes(first)
    with anyio.fail_after(30):
        stop = anyio.Event()
        stop.set()  # a tailer that is stopped from the start still drains once
        await tail_to_local(link, str(src.parent), str(src), dst, stop=stop)
        assert dst.read_bytes() == src.read_bytes()

        with src.open("ab") as f:
            f.write(b"".join(b"second %d\n" % i for i in range(1000)))
        stop = anyio.Event()
        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop)
                )
                await wait_until("resumed", lambda: dst.stat().st_size == src.stat().st_size)
                with src.open("ab") as f:
                    f.write(b"third\n")
                stop.set()
    assert dst.read_bytes() == src.read_bytes()
    resumed = [e for e in logs if e["event"] == "tail.resumed"]
    assert resumed and resumed[0]["offset"] == len(first)


@pytest.mark.asyncio
async def test_resume_into_a_missing_file_waits_instead_of_duplicating(
    link: NodeLink, shared_tmp: Path
) -> None:
    src, dst = shared_tmp / "gone.log", shared_tmp / "gone.copy"
    src.write_bytes(b"one\ntwo\n")
    with anyio.fail_after(30):
        stop = anyio.Event()
        stop.set()
        await tail_to_local(link, str(src.parent), str(src), dst, stop=stop)
        content = src.read_bytes()
        src.unlink()
        stop = anyio.Event()
        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop)
                )
                await wait_until(
                    "missing noticed",
                    lambda: any("waiting for" in str(e.get("message")) for e in logs),
                )
                src.write_bytes(content + b"three\n")  # the same file is back (NFS blip)
                await wait_until("copied", lambda: size_of(dst) == size_of(src))
                stop.set()
    assert dst.read_bytes() == b"one\ntwo\nthree\n"


@pytest.mark.asyncio
async def test_tail_waits_for_a_file_that_appears_late(link: NodeLink, shared_tmp: Path) -> None:
    src, dst = shared_tmp / "late" / "rank3.agent.log", shared_tmp / "late.copy"
    stop = anyio.Event()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop))
            await wait_until("tailer started", dst.exists)
            await anyio.sleep(0.5)
            assert dst.stat().st_size == 0
            src.parent.mkdir()
            await Writer(src, lines=100, per_second=500).run()
            await wait_until("copied", lambda: dst.stat().st_size == src.stat().st_size)
            stop.set()
    assert dst.read_bytes() == src.read_bytes()


@pytest.mark.asyncio
async def test_stop_drains_to_the_remote_end(link: NodeLink, shared_tmp: Path) -> None:
    src, dst = shared_tmp / "burst.log", shared_tmp / "burst.copy"
    src.write_bytes(b"")
    stop = anyio.Event()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop))
            await wait_until("tailer started", dst.exists)
            await anyio.sleep(0.3)  # the follower is running
            # A burst written just before stop: the tailer must not return before it.
            src.write_bytes(os.urandom(8 << 20))
            stop.set()
    assert dst.stat().st_size == 8 << 20
    assert dst.read_bytes() == src.read_bytes()


@pytest.mark.asyncio
async def test_cancelled_tail_leaves_a_prefix_and_no_remote_follower(
    link: NodeLink, shared_tmp: Path
) -> None:
    src, dst = shared_tmp / "cancel.log", shared_tmp / "cancel.copy"
    writer = Writer(src, lines=10_000, per_second=1000)
    stop = anyio.Event()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.run)
            tg.start_soon(lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop))
            await wait_until("bytes flowing", lambda: size_of(dst) > 10_000)
            assert remote_followers(src)
            tg.cancel_scope.cancel()
        copied = dst.read_bytes()
        assert copied and src.read_bytes().startswith(copied)
        await wait_until("remote tail gone", lambda: not remote_followers(src), 10)
        # The cancelled copy resumes exactly.
        stop.set()
        await tail_to_local(link, str(src.parent), str(src), dst, stop=stop)
    assert dst.read_bytes() == src.read_bytes()


@pytest.mark.asyncio
async def test_closing_the_link_ends_its_tailers_with_a_remote_error(
    cluster: DevCluster, settings: SshSettings, shared_tmp: Path
) -> None:
    src, dst = shared_tmp / "closing.log", shared_tmp / "closing.copy"
    src.write_bytes(b"data\n")
    own = NodeLink(cluster.nodes[1], settings)
    failed: list[RemoteError] = []

    async def tailer() -> None:
        try:
            await tail_to_local(own, str(src.parent), str(src), dst, stop=anyio.Event())
        except RemoteError as exc:
            failed.append(exc)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(tailer)
            await wait_until("copied", lambda: size_of(dst) == 5)
            await own.aclose()
    assert failed and own.closed
    assert dst.read_bytes() == b"data\n"
    await wait_until("remote tail gone", lambda: not remote_followers(src), 10)


@pytest.mark.asyncio
async def test_a_second_tailer_on_the_same_copy_is_refused(
    link: NodeLink, shared_tmp: Path
) -> None:
    src, dst = shared_tmp / "x.log", shared_tmp / "x.copy"
    src.write_bytes(b"abc\n")
    stop = anyio.Event()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: tail_to_local(link, str(src.parent), str(src), dst, stop=stop))
            await wait_until("copied", lambda: size_of(dst) == 4)
            with pytest.raises(TailConflict, match="already being appended"):
                await tail_to_local(link, str(src.parent), str(src), dst, stop=stop)
            stop.set()
    assert dst.read_bytes() == b"abc\n"


@pytest.fixture(autouse=True)
def _no_fault_left(cluster: DevCluster) -> Iterator[None]:
    """Fail loudly if a test left the faulted node cut or its sshd stopped."""
    yield
    node = cluster.nodes[0]
    assert cluster.ssh(node, "true", check=False).returncode == 0, f"{node} left broken"
