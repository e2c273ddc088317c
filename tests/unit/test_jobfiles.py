"""node/safe_read.py run here (as the shared-log-directory strategy runs it): what a job can
plant in its log directory is refused unread, plain files are read and followed by name,
copies stop at their byte caps; and where a log directory may be at all (core.spec.log_dirs)."""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.adapters.fsutil import process_umask, write_atomic
from llmd_supervisor.adapters.nodes import jobfiles as jobfiles
from llmd_supervisor.adapters.nodes.tail import CopyBudget, tail_to_local
from llmd_supervisor.core.config import load_config
from llmd_supervisor.core.spec.log_dirs import check_canonical, check_log_dir
from llmd_supervisor.errors import ConfigError, FileRefused, LogCapped, SpecError
from llmd_supervisor.supervision.cluster.clusters import SharedLogDir
from tests.fakes.hostile import SECRET, plant
from tests.fakes.hostile_results import write_nested
from tests.waiting import until


@pytest.fixture
def logs(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    secret = tmp_path / "etc" / "shadow"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    d = tmp_path / "runs" / "L"
    return d, plant(d, secret)


@pytest.mark.asyncio
async def test_every_planted_kind_is_refused_with_its_reason_and_never_read(
    logs: tuple[Path, dict[str, str]],
) -> None:
    d, kinds = logs
    with anyio.fail_after(30):
        for name, why in kinds.items():
            with pytest.raises(FileRefused, match=why) as info:
                await jobfiles.read_local(str(d), str(d / name), time_limit=10)
            assert "secret-hash" not in str(info.value)
        (d / "ok").write_bytes(b'{"rc": 0}')
        assert await jobfiles.read_local(str(d), str(d / "ok"), time_limit=10) == b'{"rc": 0}'
        assert await jobfiles.read_local(str(d), str(d / "nope"), time_limit=10) is None
        assert await jobfiles.read_local(str(d), str(d / "5" / "x"), time_limit=10) is None
        assert "link" in await jobfiles.list_local(str(d), str(d), time_limit=10)
        with pytest.raises(FileRefused, match="symbolic link"):
            await jobfiles.list_local(str(d), str(d / "dirlink"), time_limit=10)


def test_the_log_directory_itself_as_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.out").write_bytes(b"theirs")
    (tmp_path / "L").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileRefused, match="L on its way is a symbolic link"):
        anyio.run(
            lambda: jobfiles.read_local(
                str(tmp_path / "L"), str(tmp_path / "L/a.out"), time_limit=10
            )
        )


def _follower(d: Path, name: str, offset: int = 0) -> subprocess.Popen[bytes]:
    root, rel = jobfiles.split(str(d), str(d / name))
    return subprocess.Popen(
        jobfiles.argv(sys.executable, "follow", root, rel, str(offset), "0.05"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_follow_by_name_like_tail_F_then_drain_at_stdin_eof(tmp_path: Path) -> None:
    d = tmp_path / "L"
    d.mkdir()
    log = d / "rank0.log"
    log.write_bytes(b"one\n")
    p = _follower(d, "rank0.log", offset=1)
    assert p.stdout is not None
    first = p.stdout.read(len(b"ne\n"))  # it follows the file from its offset
    log.rename(d / "old")  # replaced: the new file is read from its start
    (d / "new").write_bytes(b"two\n")
    (d / "new").rename(log)
    second = p.stdout.read(len(b"two\n"))  # it read the new file, so it saw the swap
    with log.open("ab") as f:
        f.write(b"three\n")
    out, err = p.communicate(timeout=30)  # stdin EOF: what is left, then exit 0
    assert p.returncode == 0, err
    assert first + second + out == b"ne\ntwo\nthree\n"
    assert b"replaced: L/rank0.log at byte 4\n" in err  # said, never silent


def test_a_truncation_is_said_and_only_when_a_fresh_look_confirms_it(tmp_path: Path) -> None:
    d = tmp_path / "L"
    d.mkdir()
    log = d / "rank0.log"
    log.write_bytes(b"0123456789\n")
    p = _follower(d, "rank0.log")
    assert p.stdout is not None and p.stderr is not None
    first = p.stdout.read(len(b"0123456789\n"))  # it follows the file
    with log.open("r+b") as f:  # truncated in place (same inode), then written again
        f.truncate(0)
    said = p.stderr.readline()  # the truncation seen (and confirmed) before the write
    with log.open("ab") as f:
        f.write(b"new\n")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert first + out == b"0123456789\nnew\n"
    assert said == b"truncated: L/rank0.log from byte 11 to 0\n", said + err


@pytest.mark.asyncio
async def test_the_tailer_hands_a_change_of_its_file_to_on_notice(tmp_path: Path) -> None:
    d = tmp_path / "L"
    d.mkdir()
    (d / "a.log").write_bytes(b"one\n")
    stop = anyio.Event()
    seen: list[str] = []
    noticed = anyio.Event()

    def notice(line: str) -> None:
        seen.append(line)
        noticed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(
            functools.partial(
                tail_to_local,
                jobfiles.LocalFiles(),
                str(d),
                str(d / "a.log"),
                tmp_path / "copy",
                stop=stop,
                poll_interval=0.05,
                on_notice=notice,
            )
        )
        await until(  # it follows a.log: its first line is copied
            lambda: (tmp_path / "copy").is_file() and (tmp_path / "copy").read_bytes() == b"one\n",
            what="a.log's first line in the copy",
        )
        (d / "b.log").write_bytes(b"two\n")
        (d / "b.log").rename(d / "a.log")
        with anyio.fail_after(10):
            await noticed.wait()
        stop.set()
    assert seen == ["replaced: L/a.log at byte 4"]
    assert (tmp_path / "copy").read_bytes() == b"one\ntwo\n"


def test_a_link_swapped_in_while_followed_ends_the_follower_refused(tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_bytes(SECRET)
    d = tmp_path / "L"
    d.mkdir()
    (d / "a.err").write_bytes(b"start\n")
    p = _follower(d, "a.err")
    assert p.stdout is not None
    first = p.stdout.read(len(b"start\n"))  # it follows the file (not a guess by sleeping)
    (d / "a.err").unlink()
    (d / "a.err").symlink_to(secret)
    assert p.wait(timeout=10) == jobfiles.REFUSED  # noticed at its next look, unasked
    rest, err = p.communicate(timeout=10)
    out = first + rest
    assert p.returncode == jobfiles.REFUSED
    assert out == b"start\n" and b"symbolic link" in err and b"secret" not in out


def test_a_fifo_never_blocks_a_follower(tmp_path: Path) -> None:
    d = tmp_path / "L"
    d.mkdir()
    os.mkfifo(d / "a.err")
    p = _follower(d, "a.err")
    out, err = p.communicate(timeout=10)
    assert (p.returncode, out) == (jobfiles.REFUSED, b"") and b"FIFO" in err


@pytest.mark.asyncio
async def test_a_copy_stops_at_the_per_file_cap_and_then_at_the_per_run_cap(
    tmp_path: Path,
) -> None:
    d = tmp_path / "L"
    d.mkdir()
    (d / "a.out").write_bytes(b"a" * 5000)
    (d / "b.out").write_bytes(b"b" * 5000)
    budget = CopyBudget(per_file=3000, per_run=4000)
    stop = anyio.Event()
    stop.set()
    files = jobfiles.LocalFiles()
    with anyio.fail_after(20):
        with pytest.raises(LogCapped, match="3000 bytes"):
            await tail_to_local(
                files, str(d), str(d / "a.out"), tmp_path / "c" / "a.out", stop=stop, budget=budget
            )
        with pytest.raises(LogCapped, match="1000 bytes"):
            await tail_to_local(
                files, str(d), str(d / "b.out"), tmp_path / "c" / "b.out", stop=stop, budget=budget
            )
        # at the cap already: nothing more is read, no error
        await tail_to_local(
            files, str(d), str(d / "b.out"), tmp_path / "c" / "b.out", stop=stop, budget=budget
        )
    assert (tmp_path / "c" / "a.out").read_bytes() == b"a" * 3000
    assert (tmp_path / "c" / "b.out").read_bytes() == b"b" * 1000
    assert budget.used == 4000


def test_archive_files_take_their_mode_from_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        assert process_umask() == 0o027
        write_atomic(tmp_path / "f", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o640


ROOTS = ("/shared/runs", "/var/tmp")
FORBIDDEN = ("/var/tmp/llmd/state", "/var/tmp/llmd/archive")


@pytest.mark.parametrize(
    ("log_dir", "why"),
    [
        ("/shared/runs/alice/demo", None),
        ("/var/tmp/llmd-runs/x", None),
        ("relative/dir", "absolute path in normal form"),
        ("/shared/runs/../../etc", "normal form"),
        ("/shared/runs/./x", "normal form"),
        ("/shared/runs//x", "normal form"),
        ("/shared/runs/x/", "normal form"),
        ("/shared/runs", "below one of daemon.log_roots"),
        ("/etc/llmd", "below one of daemon.log_roots"),
        ("/shared/runsX/y", "below one of daemon.log_roots"),
        ("/var/tmp/llmd/state/archive/r1", "overlaps the daemon's own directory"),
        ("/var/tmp/llmd", "overlaps the daemon's own directory"),
    ],
)
def test_where_a_log_directory_may_be(log_dir: str, why: str | None) -> None:
    if why is None:
        check_log_dir(log_dir, ROOTS, FORBIDDEN)
    else:
        with pytest.raises(SpecError, match=why):
            check_log_dir(log_dir, ROOTS, FORBIDDEN)


def test_no_log_roots_means_no_submission_and_says_how_to_fix_it() -> None:
    with pytest.raises(SpecError, match=r"daemon.log_roots \(e.g. log_roots"):
        check_log_dir("/shared/runs/x", (), ())


def test_a_link_on_the_way_is_refused_naming_the_real_path() -> None:
    check_canonical("/shared/runs/x", "/shared/runs/x")
    with pytest.raises(SpecError, match="leads to /etc; give that path itself"):
        check_canonical("/shared/runs/x", "/etc")


@pytest.mark.parametrize("root", ["relative", "/", "/a/../b", "/a/./b"])
def test_log_roots_must_be_normal_absolute_directories(root: str) -> None:
    with pytest.raises(ConfigError, match=r"daemon\.log_roots"):
        load_config(f'[daemon]\nlog_roots = ["{root}"]\n')


def test_log_roots_lose_a_trailing_slash() -> None:
    assert load_config('[daemon]\nlog_roots = ["/shared/runs/"]\n').log_roots == ("/shared/runs",)


@pytest.mark.asyncio
@pytest.mark.blocks_event_loop(
    "50 readers started at once: each start forks on the loop, and on a loaded 2-core "
    "machine one fork took 0.34 s in CI (what this test checks is the threads, not that)"
)
async def test_fifty_fifos_read_at_once_hold_no_worker_thread(tmp_path: Path) -> None:
    """The finding: forty FIFO runs took anyio's forty worker threads. Reads of job files
    are child processes: no thread is borrowed, and each answers at once."""
    d = tmp_path / "L"
    d.mkdir()
    for i in range(50):
        os.mkfifo(d / f"f{i}.err")
    limiter = anyio.to_thread.current_default_thread_limiter()
    borrowed: list[float] = []

    async def one(i: int) -> None:
        with pytest.raises(FileRefused, match="FIFO"):
            await jobfiles.read_local(str(d), str(d / f"f{i}.err"), time_limit=30)
        borrowed.append(limiter.borrowed_tokens)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(one, i)
    assert len(borrowed) == 50 and max(borrowed) == 0


@pytest.mark.asyncio
async def test_many_files_are_read_through_one_reader_each_judged_alone(
    logs: tuple[Path, dict[str, str]],
) -> None:
    d, kinds = logs
    (d / "ok.json").write_bytes(b'{"completed": 4}')
    (d / "big.json").write_bytes(b"x" * 10)
    paths = [(str(d / "ok.json"), 100), (str(d / "nope"), 100), (str(d / "big.json"), 3)]
    paths += [(str(d / name), jobfiles.SMALL_FILE_MAX) for name in kinds]
    files = SharedLogDir(time_limit=20)
    with anyio.fail_after(30):
        got = await files.read_many(str(d), paths)
    await files.aclose()
    assert got[str(d / "ok.json")] == b'{"completed": 4}'
    assert got[str(d / "nope")] is None
    too_large = got[str(d / "big.json")]
    assert isinstance(too_large, FileRefused) and "larger than 3 bytes" in too_large.why
    for name, why in kinds.items():
        refused = got[str(d / name)]
        assert isinstance(refused, FileRefused) and why in refused.why, (name, refused)
    assert SECRET not in b"".join(v for v in got.values() if isinstance(v, bytes))


@pytest.fixture
def sixteen_large(tmp_path: Path) -> tuple[Path, list[str], bytes]:
    """16 result files of 32 MiB each (written here, off any event loop)."""
    d = tmp_path / "L"
    names = [f"c{i}.json" for i in range(16)]
    return d, names, write_nested(d / "bench", names)


@pytest.mark.asyncio
async def test_sixteen_files_of_32_mib_are_read_without_blocking_the_loop(
    sixteen_large: tuple[Path, list[str], bytes],
) -> None:
    """The finding: the answers were cut out of the reader's output by copying what was
    left of it once per file, on the loop (16 x 32 MiB: an 11.4 s stall). Now each file
    is one answer of a kept reader, received in chunks (the loop guard of
    tests/conftest.py fails this test if a callback holds the loop)."""
    d, names, data = sixteen_large
    paths = [(str(d / "bench" / n), jobfiles.RESULT_FILE_MAX) for n in names]
    paths.insert(3, (str(d / "bench" / "small.json"), 100))
    (d / "bench" / "small.json").write_bytes(b'{"small": 1}')
    files = SharedLogDir(time_limit=60)
    with anyio.fail_after(120):
        got = await files.read_many(str(d), paths)
    await files.aclose()
    assert list(got) == [p for p, _ in paths]
    assert got.pop(str(d / "bench" / "small.json")) == b'{"small": 1}'
    assert all(v == data for v in got.values())


@pytest.mark.parametrize(
    ("head", "op", "limit", "expected"),
    [
        (b"ok 3", "read", 10, ("ok", 3)),
        (b"ok 4106", "read", 10, ("ok", 4106)),  # a reason text may exceed a tiny limit
        (b"ok 4107", "read", 10, None),  # beyond the request's limit and that slack
        (b"ok -1", "read", 10, None),
        (b"ok x", "read", 10, None),
        (b"ok 2000", "list", 10, ("ok", 2000)),  # up to 10 names of 255 bytes
    ],
)
def test_a_reader_answer_that_lies_about_its_length_is_refused(
    head: bytes, op: str, limit: int, expected: tuple[str, int] | None
) -> None:
    """A reader's answer says its length first: one beyond what the request can have is
    not believed (the reader is restarted and nothing past it is read)."""
    assert jobfiles.serve_head(head, op, limit) == expected


@pytest.mark.asyncio
async def test_copy_rests_appends_what_each_file_holds_beyond_its_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmd_supervisor.adapters.nodes import tail as tail

    # Small chunks and pipelined writes: several rounds, several writes per round.
    monkeypatch.setattr(tail, "COPY_CHUNK", 3000)
    monkeypatch.setattr(jobfiles, "PIPELINE_BYTES", 300)
    d = tmp_path / "L"
    d.mkdir()
    (d / "a.log").write_bytes(b"0123456789" * 1000)
    for i in range(40):
        (d / f"r{i}.log").write_bytes(f"rank {i}\n".encode() * (i + 1))
    (d / "link.log").symlink_to(d / "a.log")
    local = tmp_path / "copy"
    local.write_bytes(b"0123")  # an exact prefix, as a cancelled tailer leaves it
    files = [(str(d / "a.log"), local), (str(d / "missing.log"), tmp_path / "m")]
    files += [(str(d / f"r{i}.log"), tmp_path / f"r{i}") for i in range(40)]
    files.append((str(d / "link.log"), tmp_path / "l"))
    reader = jobfiles.SharedFsNode("localhost")
    try:
        seen: list[int] = []
        skipped = await tail.copy_rests(reader, str(d), files, on_bytes=seen.append)
        assert [type(e) for e in skipped] == [FileRefused]  # the link, never followed
        assert local.read_bytes() == (d / "a.log").read_bytes()
        for i in range(40):
            assert (tmp_path / f"r{i}").read_bytes() == (d / f"r{i}.log").read_bytes()
        assert (tmp_path / "m").read_bytes() == b""  # missing: waited for by nobody
        assert sum(seen) == 9996 + sum(len(f"rank {i}\n") * (i + 1) for i in range(40))
        assert await tail.copy_rests(reader, str(d), files[:1]) == []  # nothing more
        assert local.read_bytes() == (d / "a.log").read_bytes()
        budget = CopyBudget(per_file=50, per_run=10**9)
        capped = tmp_path / "capped"
        got = await tail.copy_rests(
            reader, str(d), [(str(d / "a.log"), capped)], budget=budget, time_limit=5
        )
        assert [type(e) for e in got] == [LogCapped]
    finally:
        await reader.aclose()
    assert capped.read_bytes() == b"0123456789" * 5
