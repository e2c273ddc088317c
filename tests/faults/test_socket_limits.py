"""A hostile local user against the real daemon's control socket (issue 2.2, DESIGN.md
section 9): floods of idle and half-sent connections are capped, timed out and kept within
a memory bound while another uid is still served; a stranger's run is `not_found`; `list`
pages through a thousand runs; any log (3 MB of text, invalid UTF-8) streams byte for
byte through `logs --follow`; an ambiguous job id is an error naming the candidates.

The hostile peer is a throwaway system user (`tests.strangers`) running
tests/faults/socket_peer.py under setpriv with the system python3.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio

from llmd_supervisor.adapters.journal.rows import RunMeta
from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.core.protocol.runs import LogChunk, chunk_bytes, read
from llmd_supervisor.core.run.lifecycle import Run, RunState, Transition
from llmd_supervisor.core.verdict.decide import Outcome
from tests.daemon_helpers import Daemon, NoCluster, Site, demo_spec
from tests.devcluster import REPO, DevCluster
from tests.strangers import Stranger
from tests.waiting import wait_until

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


@dataclass
class SocketDaemon(Daemon):
    """The test daemon with extra [daemon] keys, a socket the stranger may connect to,
    and optionally a lower open-files limit (as systemd's default 1024)."""

    nofile: int | None = None

    def start(self) -> None:
        saved = resource.getrlimit(resource.RLIMIT_NOFILE)
        if self.nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, saved[1]))
        try:
            super().start()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, saved)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def cpu_s(self) -> float:
        """User plus system CPU seconds the daemon has used."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


def daemon_for(
    root: Path, stranger: Stranger, keys: str = "", site: Site | None = None, **kw: object
) -> SocketDaemon:
    """A daemon whose socket the stranger may use; with no `site`, a daemon with no cluster
    behind it (the control socket's limits do not depend on one)."""
    keys = f'socket_group = "{stranger.name}"\n{keys}'
    site = site or NoCluster(root)
    return SocketDaemon(site, root, daemon_keys=keys, **kw)  # type: ignore[arg-type]


def measured(line: str) -> None:
    """A measured figure, on stderr (shown with -s or in the failure report)."""
    sys.stderr.write(f"\nmeasured: {line}\n")


def timed_cli(d: Daemon, *args: str, timeout: float = 10) -> tuple[float, str]:
    start = time.monotonic()
    out = d.cli(*args, timeout=timeout).stdout
    return time.monotonic() - start, out


def finished_run(
    run_id: str, job_id: str, log_dir: Path, archive: Path, *, owner: int = 0, **kw: object
) -> tuple[Run, RunMeta]:
    """A finished run as the journal keeps it (no job behind it)."""
    created = kw.pop("created", T0)
    assert isinstance(created, datetime)
    job_name = f"llmd-{run_id}"
    run = Run(
        run_id=run_id,
        job_name=job_name,
        state=RunState.SUCCEEDED,
        attempt=1,
        slurm_job_id=job_id,
        nodes=("node1", "node2"),
        cancel_requested=False,
        outcome=Outcome.SUCCEEDED,
        reason=str(kw.pop("reason", "State=COMPLETED ExitCode=0:0, marker rc=0")),
        transitions=(
            Transition(RunState.ACCEPTED, created, "accepted"),
            Transition(RunState.SUCCEEDED, created + timedelta(minutes=1), "archived"),
        ),
    )
    meta = RunMeta(
        owner_uid=owner,
        cluster=str(kw.pop("cluster", "dev")),
        spec_toml=demo_spec(log_dir),
        script="",
        log_dir=str(log_dir),
        archive_dir=str(archive / run_id),
        created_at=created,
    )
    return run, meta


def journal_runs(d: Daemon, runs: list[tuple[Run, RunMeta]]) -> None:
    d.state_dir.mkdir(parents=True, exist_ok=True)

    async def go() -> None:
        async with await Journal.open(d.state_dir / "journal.sqlite3") as journal:
            for run, meta in runs:
                await journal.insert_run(run, meta)

    anyio.run(go)


# ----------------------------------------------------------------------------- floods


def test_an_idle_flood_of_1100_connections_is_capped_and_another_uid_is_served(
    root_dir: Path, stranger: Stranger
) -> None:
    # The daemon gets systemd's default 1024 open files, fewer than the flood.
    d = daemon_for(root_dir, stranger, "first_byte_timeout_s = 4", nofile=1024)
    d.start()
    spec = root_dir / "dry.toml"
    # (beside the daemon's root: a log directory inside the socket's is refused)
    spec.write_text(demo_spec(root_dir.with_name(root_dir.name + "-logs")))
    try:
        with stranger.process("flood", str(d.socket), "1100", "8") as flood:
            assert flood.stdout is not None
            held = json.loads(flood.stdout.readline())
            fds_during = d.fds()
            took_list, out = timed_cli(d, "list", "--json")
            took_dry, script = timed_cli(d, "submit", str(spec), "--dry-run")
            after = json.loads(flood.stdout.readline())
            flood.wait(timeout=30)
    finally:
        rc = d.stop()
    # Only the per-uid cap's worth are admitted; the rest were told `busy` and closed.
    assert held["connected"] == 1100, held
    assert held["open"] == 64 and held["busy"] == 1100 - 64, held
    assert json.loads(out)["runs"] == []
    assert script.startswith("#!")
    assert rc == 0
    # The admitted idle connections were closed at the first-byte timeout, with a reply.
    assert after["open"] == 0 and after["timeout"] == 64, after
    assert took_list < 5 and took_dry < 5, (took_list, took_dry)
    assert fds_during < 200, fds_during
    refused = d.events("control.refused")
    assert refused and all(e["reason"] == "max_connections_per_uid" for e in refused)
    assert len(refused) <= 3, "refusals are rate-limited in the log"
    assert len(d.events("control.timeout")) == 64
    measured(
        f"idle flood of 1100: {fds_during} daemon fds; list {took_list:.2f} s, "
        f"dry-run {took_dry:.2f} s"
    )


def test_the_global_cap_refuses_the_flood_and_says_so(root_dir: Path, stranger: Stranger) -> None:
    keys = "max_connections = 300\nmax_connections_per_uid = 2000\nfirst_byte_timeout_s = 30"
    d = daemon_for(root_dir, stranger, keys, nofile=1024)
    d.start()
    try:
        with stranger.process("flood", str(d.socket), "1100", "2") as flood:
            assert flood.stdout is not None
            held = json.loads(flood.stdout.readline())
            refused = d.cli("list", check=False)
            flood.wait(timeout=30)
        served_after = d.cli("list", "--json", check=False)
    finally:
        d.stop()
    assert held["open"] == 300 and held["busy"] == 800, held
    assert refused.returncode == 2
    assert "daemon.max_connections = 300" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert served_after.returncode == 0  # the flood is gone: served again


def test_500_half_sent_1mib_lines_keep_the_daemon_small_and_answering(
    root_dir: Path, stranger: Stranger
) -> None:
    # All 500 admitted (a cap high enough), so the partial-line budget is what bounds memory.
    keys = "max_connections_per_uid = 600\nrequest_timeout_s = 6"
    d = daemon_for(root_dir, stranger, keys)
    d.start()
    base = d.rss_kib()
    peak = base
    answers: list[float] = []
    try:
        with stranger.process("halfsend", str(d.socket), "500", str(1 << 20), "12") as flood:
            assert flood.stdout is not None
            while flood.poll() is None:
                peak = max(peak, d.rss_kib())
                answers.append(timed_cli(d, "list", "--json", timeout=10)[0])
                time.sleep(0.2)
            lines = [json.loads(line) for line in flood.stdout.read().splitlines()]
        peak = max(peak, d.rss_kib())
        stopping = time.monotonic()
        rc = d.stop()
        stopped_in = time.monotonic() - stopping
    finally:
        d.stop()
    first, last = lines
    assert first["connected"] == 500 and first["busy"] == 0, first
    # Every half-sent line was cut at a timeout, with a `timeout` reply.
    assert last["open"] == 0 and last["timeout"] == 500, last
    grew_mib = (peak - base) / 1024
    measured(
        f"half-sent 500 x 1 MiB: RSS {base / 1024:.0f} -> {peak / 1024:.0f} MiB "
        f"(+{grew_mib:.0f}); the peer got {last['sent'] / 2**20:.0f} MiB in; list max "
        f"{max(answers):.2f} s over {len(answers)} calls; stop {stopped_in:.1f} s"
    )
    # Budget 8 MiB per uid plus one socket read per connection and their objects.
    assert grew_mib < 64, grew_mib  # measured +22 MiB (before these limits: +540)
    # Answering at all is the point (each `list` had 10 s); how fast is the benchmark's
    # (5.08 s was seen once under CI's load beside a cluster pass).
    assert max(answers) < 9, answers
    assert rc == 0 and stopped_in < 10


def _stream_refusals(d: Daemon) -> list[dict[str, object]]:
    """The daemon's `control.refused` lines for streams over max_streams_per_uid."""
    refused = d.events("control.refused")
    return [e for e in refused if e.get("reason") == "max_streams_per_uid"]


def test_400_unread_streams_are_capped_and_cost_no_cpu(root_dir: Path, stranger: Stranger) -> None:
    keys = "max_connections_per_uid = 500\nwrite_timeout_s = 5"
    d = daemon_for(root_dir, stranger, keys)
    archive, logs = d.state_dir / "archive", root_dir / "logs"
    journal_runs(d, [finished_run("theirs", "88", logs, archive, owner=stranger.uid)])
    copies = archive / "theirs" / "logs" / "attempt1"
    copies.mkdir(parents=True)
    (copies / "llmd-theirs-88.out").write_bytes(b"x" * 200 + b"\n" * (8 << 20))
    d.start()
    logs_request = json.dumps({"v": 1, "id": 1, "op": "logs", "args": {"run": "theirs"}})
    try:
        with stranger.process("unread", str(d.socket), "400", logs_request, "8") as peer:
            assert peer.stdout is not None
            # The flood is in (each request answered busy or streaming) and every stream is
            # stuck on its writes.
            wait_until(
                lambda: len(_stream_refusals(d)) == 400 - 16,
                60,
                "the 384 streams over the cap refused",
            )
            cpu0, t0 = d.cpu_s(), time.monotonic()
            time.sleep(2)
            share = (d.cpu_s() - cpu0) / (time.monotonic() - t0)
            took, _ = timed_cli(d, "list", "--json")
            result = json.loads(peer.stdout.readline())
            peer.wait(timeout=30)
    finally:
        d.stop()
    cap = 16
    assert result["busy"] == 400 - cap and result["streamed"] == cap, result
    stalled = d.events("control.write_timeout")
    assert len(stalled) == cap, len(stalled)
    measured(f"400 unread log streams: daemon CPU {share:.0%} of a core; list {took:.2f} s")
    assert share < 0.2
    assert took < 5


# ----------------------------------------------------------------------------- runs


def test_a_strangers_run_is_not_found_and_an_ambiguous_job_id_names_its_runs(
    root_dir: Path, stranger: Stranger
) -> None:
    d = daemon_for(root_dir, stranger)
    archive = d.state_dir / "archive"
    logs = root_dir / "logs"
    journal_runs(
        d,
        [
            finished_run("rootrun", "5", logs, archive, cluster="dev"),
            finished_run("westrun", "5", logs, archive, cluster="west"),
        ],
    )
    d.start()
    try:
        replies = []
        for run in ("rootrun", "llmd-rootrun", "5", "dev:5", "nosuchrun"):
            out = stranger.run(
                "request",
                str(d.socket),
                json.dumps({"v": 1, "id": 1, "op": "status", "args": {"run": run}}),
                json.dumps({"v": 1, "id": 2, "op": "cancel", "args": {"run": run}}),
                json.dumps({"v": 1, "id": 3, "op": "logs", "args": {"run": run}}),
            ).stdout
            replies += [(run, json.loads(line)) for line in out.splitlines()]
        listed = json.loads(
            stranger.run(
                "request",
                str(d.socket),
                json.dumps({"v": 1, "id": 1, "op": "list", "args": {"all": True}}),
            ).stdout
        )
        ambiguous = d.cli("status", "5", check=False)
        picked = json.loads(d.cli("status", "west:5", "--json").stdout)
    finally:
        d.stop()
    for run, reply in replies:
        assert reply["ok"] is False and reply["error"]["code"] == "not_found", (run, reply)
        assert reply["error"]["message"] == f'No run "{run}" is known to this daemon.'
    assert listed["result"]["runs"] == []
    assert ambiguous.returncode == 2
    assert "names 2 runs" in ambiguous.stderr and "CLUSTER:JOBID" in ambiguous.stderr
    assert "rootrun (dev:5" in ambiguous.stderr and "westrun (west:5" in ambiguous.stderr
    assert picked["run"] == "westrun"


def test_list_pages_through_1200_finished_runs(root_dir: Path, stranger: Stranger) -> None:
    d = daemon_for(root_dir, stranger)
    archive, logs = d.state_dir / "archive", root_dir / "logs"
    hostile = "\u0007" * 10_000  # evidence a job could influence: cut in list briefs
    journal_runs(
        d,
        [
            finished_run(
                f"r{i:05d}",
                str(1000 + i),
                logs,
                archive,
                created=T0 + timedelta(seconds=i),
                reason=hostile,
            )
            for i in range(1200)
        ],
    )
    d.start()
    try:
        took, out = timed_cli(d, "list", "--all", "--json", timeout=60)
        table = d.cli("list", "--all").stdout
        page = json.loads(
            subprocess.run(
                [sys.executable, "-c", _ONE_PAGE, str(d.socket)],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
            ).stdout
        )
    finally:
        d.stop()
    runs = json.loads(out)["runs"]
    assert [r["run"] for r in runs] == [f"r{i:05d}" for i in range(1200)]
    assert all(len(r["reason"]) <= 200 for r in runs)
    assert len(table.splitlines()) == 1201
    assert page["count"] < 1200 and page["next"], page  # it took more than one page
    assert took < 20
    measured(f"list --all of 1200 runs: {took:.2f} s; first page {page['count']} runs")


_ONE_PAGE = """
import json, sys, anyio
from pathlib import Path
from llmd_supervisor.adapters.control.client import ControlClient
async def go():
    async with ControlClient(Path(sys.argv[1])) as c:
        r = await c.call("list", {"all": True})
    print(json.dumps({"count": len(r["runs"]), "next": r["next"]}))
anyio.run(go)
"""


def test_a_3mb_log_and_invalid_utf8_stream_byte_exact_through_logs_follow(
    root_dir: Path, stranger: Stranger
) -> None:
    d = daemon_for(root_dir, stranger)
    archive, logs = d.state_dir / "archive", root_dir / "logs"
    journal_runs(d, [finished_run("big", "77", logs, archive)])
    copies = archive / "big" / "logs" / "attempt1"
    copies.mkdir(parents=True)
    text = b"".join(
        b"INFO 12-01 11:00:%02d vllm: step %d throughput %.1f tok/s\n" % (i % 60, i, i * 0.5)
        for i in range(60_000)
    )
    text = (text * (3_000_000 // len(text) + 1))[:3_000_000]
    binary = bytes(range(256)) * 800 + b"caf\xc3" + b"\xff\xfe\xed\xa0\x80" * 20_000 + b"\xe2\x82"
    (copies / "llmd-big-77.out").write_bytes(text)
    (copies / "llmd-big-77.err").write_bytes(binary)
    rank = b"\x00\x01\x1b[31m\xf0\x9f\x98\x80" * 200_000  # control bytes and 4-byte characters
    (copies / "rank0.prefill.engine.log").write_bytes(rank)
    d.start()
    try:
        follow = cli_bytes(d, "logs", "big", "--follow")
        plain = cli_bytes(d, "logs", "big")
        rank_out = cli_bytes(d, "logs", "big", "--rank", "0", "--follow")
    finally:
        d.stop()
    # The CLI prints each file's bytes in order, a chunk of each in turn (.err first).
    assert follow == plain == _interleaved(binary, text)
    assert rank_out == rank


def cli_bytes(d: Daemon, *args: str) -> bytes:
    """A client command's stdout as bytes (exit 0 and nothing on stderr required)."""
    proc = subprocess.run(
        [sys.executable, "-m", "llmd_supervisor", *args, "--socket", str(d.socket)],
        capture_output=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return proc.stdout


def _interleaved(err: bytes, out: bytes) -> bytes:
    """What `logs` prints for two files: one chunk of each in turn (sorted by name)."""
    from llmd_supervisor.supervision.control.log_follow import READ_CHUNK

    printed = b""
    offsets = [0, 0]
    files = [err, out]
    while any(o < len(f) for o, f in zip(offsets, files, strict=True)):
        for i, f in enumerate(files):
            if offsets[i] < len(f):
                printed += f[offsets[i] : offsets[i] + READ_CHUNK]
                offsets[i] += READ_CHUNK
    return printed


def test_stopping_the_daemon_with_a_flood_open_takes_seconds(
    root_dir: Path, stranger: Stranger
) -> None:
    d = daemon_for(root_dir, stranger, "first_byte_timeout_s = 60")
    d.start()
    with stranger.process("flood", str(d.socket), "64", "30") as flood:
        assert flood.stdout is not None
        assert json.loads(flood.stdout.readline())["open"] == 64
        start = time.monotonic()
        rc = d.stop(signal.SIGTERM)
        took = time.monotonic() - start
    assert rc == 0 and took < 10, took


GENERATOR = """
import sys, time
out = sys.stdout.buffer
text = b"".join(b"INFO vllm step %d: 12.5 tok/s \\xe2\\x82\\xac\\n" % i for i in range(20000))
for i in range(30):  # about 3 MB in 30 writes while the run goes on
    out.write(text[:100000] + (b"\\xff\\xfe\\xc3" if i % 3 == 0 else b"") + b"\\xf0\\x9f")
    out.write(b"\\x98\\x80\\n")
    out.flush()
    time.sleep(0.05)
"""


def test_a_live_3mb_rank_log_with_invalid_utf8_follows_byte_exact(
    cluster: DevCluster, root_dir: Path, stranger: Stranger, shared_tmp: Path
) -> None:
    """The real path: the job writes the log on a node, the daemon tails it over SSH into
    its copy while `logs --rank 0 --follow --json` streams it; every file's chunks put
    together are the node's file byte for byte. `submit --wait --follow` of the same run
    prints its batch log byte for byte meanwhile."""
    gen = shared_tmp / "gen.py"
    gen.write_text(GENERATOR)
    spec = demo_spec(shared_tmp, port=8760)
    start = spec.index("prefill_command = [")
    end = spec.index("]\n", start) + 2
    engine = (
        "exec python3 {node_dir}/engine.py --role prefill --host {host} --port {port} "
        "--served-name {served_name}"
    )
    command = json.dumps(["sh", "-c", f"python3 {gen}; {engine}"])
    spec = spec[:start] + f"prefill_command = {command}\n" + spec[end:]
    d = daemon_for(root_dir, stranger, site=cluster)
    (root_dir / "live.toml").write_text(spec)
    d.start()
    err = root_dir / "submit.err"
    try:
        with err.open("wb") as e:
            waiting = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "llmd_supervisor",
                    "submit",
                    str(root_dir / "live.toml"),
                    "--wait",
                    "--follow",
                    "--socket",
                    str(d.socket),
                ],
                stdout=subprocess.PIPE,
                stderr=e,
                cwd=REPO,
            )
        try:
            deadline = time.monotonic() + 60
            while "submitted run " not in err.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            run = err.read_text().split("submitted run ", 1)[1].split()[0]
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "llmd_supervisor",
                    "logs",
                    run,
                    "--rank",
                    "0",
                    "--follow",
                    "--json",
                    "--socket",
                    str(d.socket),
                ],
                capture_output=True,
                timeout=240,
                check=False,
                cwd=REPO,
            )
            batch_out, _ = waiting.communicate(timeout=240)
        finally:
            if waiting.poll() is None:
                waiting.kill()
            waiting.wait()
        final = d.status(run)
    finally:
        d.stop()
    assert waiting.returncode == 0, err.read_text()
    batch = Path(str(final["log_dir"])) / f"{final['job_name']}-{final['slurm_job_id']}.out"
    assert batch_out == batch.read_bytes()
    assert proc.returncode == 0, proc.stderr
    assert final["outcome"] == "succeeded", final["reason"]
    files: dict[str, bytearray] = {}
    encodings: set[str] = set()
    for line in proc.stdout.splitlines():
        chunk = read(LogChunk, json.loads(line))
        encodings.add(chunk.get("encoding", "?"))
        got = files.setdefault(chunk["file"].rsplit("/", 1)[-1], bytearray())
        assert chunk["offset"] == len(got)
        got += chunk_bytes(chunk)
    job_dir = Path(str(final["log_dir"])) / str(final["slurm_job_id"])
    engine_log = files["rank0.prefill.engine.log"]
    assert len(engine_log) > 3_000_000
    assert encodings == {"utf-8", "base64"}
    for name, data in files.items():
        assert bytes(data) == (job_dir / name).read_bytes(), name
    measured(f"live rank log: {len(engine_log)} bytes in {len(proc.stdout.splitlines())} chunks")
