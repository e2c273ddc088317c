"""A hostile job: what it plants in its own log directory (links to secrets, FIFOs,
devices, directories, huge files) is never read, copied or streamed; the daemon answers and
stops in time whatever the directory holds; and log directories that lead elsewhere are
refused at submission (issue 2.2).

The planted links, FIFOs and devices run end to end on the real cluster (its stand-in
agents plant them); the directory at the marker path and the copy cap run against a
replayed cluster and the in-process SSH server (tests/fakes/replay_world.py), and the
refused log directories against a daemon with no cluster (nothing reaches Slurm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmd_supervisor.core.spec.runspec import load_spec
from tests.daemon_helpers import Daemon, NoCluster, demo_spec
from tests.devcluster import DevCluster
from tests.fakes.replay_world import JobAction, replay_world
from tests.fakes.slurm_replay import ReplayJob

PORT = 8700
STOP_TIMEOUT_S = 15.0  # the unit's TimeoutStopSec is larger; the daemon must beat it


@pytest.fixture
def secret() -> Iterator[tuple[Path, bytes]]:
    """A file no run may show: its canary must never reach an archive or a client."""
    canary = f"CANARY-{uuid.uuid4().hex}".encode()
    with tempfile.TemporaryDirectory(prefix="llmd-secret-", dir="/var/tmp") as d:
        path = Path(d) / "shadow"
        path.write_bytes(b"root:" + canary + b":19000:0:99999:7:::\n")
        path.chmod(0o600)
        yield path, canary


def _submit(daemon: Daemon, spec: str) -> str:
    proc = daemon.submit(spec)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["run"])


def _tree_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def _archive_events(final: dict[str, object], name: str) -> list[dict[str, object]]:
    lines = (Path(str(final["archive"])) / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("kind", e.get("event")) == name]


def test_planted_links_fifos_and_devices_are_refused_and_the_run_still_succeeds(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path, secret: tuple[Path, bytes]
) -> None:
    path, canary = secret
    plants = ",".join(
        [
            f"link:%j/rank0.shadow.log={path}",
            "fifo:%j/rank0.fifo.log",
            "device:%j/rank0.zero.log",
            "link:%j/rank0.devzero.log=/dev/zero",
            "fifo:%x-%j.err",  # the batch log itself replaced by a FIFO
        ]
    )
    d = Daemon(cluster, tmp_path)
    d.start()
    try:
        spec = demo_spec(
            shared_tmp,
            port=PORT,
            common={
                "LLMD_FAKE_PLANT": plants,
                "LLMD_FAKE_FAULT_RANKS": "0",
                "LLMD_FAKE_MARKER_DELAY_S": "6",
            },
        )
        run = _submit(d, spec)
        deadline = time.monotonic() + 120
        while len(d.events("run.log_refused")) < 3:
            assert time.monotonic() < deadline, d.log_text()[-3000:]
            assert d.status(run)["state"] not in ("succeeded", "failed"), d.status(run)
            time.sleep(0.3)
        # The daemon answers while the files are there, and stops in time.
        assert d.cli("list", "--json", timeout=10).returncode == 0
        started = time.monotonic()
        assert d.stop() == 0
        assert time.monotonic() - started < STOP_TIMEOUT_S
        d.start()  # ... and after a restart it does not block on them either
        assert d.cli("list", "--json", timeout=10).returncode == 0
        final = json.loads(d.cli("wait", run, "--json", check=False, timeout=300).stdout)
        rank0 = d.cli("logs", run, "--rank", "0", check=False, timeout=60)
        batch = d.cli("logs", run, check=False, timeout=60)
    finally:
        d.stop()
    assert final["outcome"] == "succeeded", final
    refused = {
        str(e["path"]).rsplit("/", 1)[-1]: str(e["reason"])
        for e in _archive_events(final, "log.refused")
    }
    job = str(final["slurm_job_id"])
    assert "symbolic link" in refused["rank0.shadow.log"]
    assert "FIFO" in refused["rank0.fifo.log"]
    assert "device" in refused["rank0.zero.log"]
    assert "symbolic link" in refused["rank0.devzero.log"]
    assert any(name.endswith(f"-{job}.err") and "FIFO" in why for name, why in refused.items())
    archive = Path(str(final["archive"]))
    assert canary not in _tree_bytes(archive)
    assert canary.decode() not in rank0.stdout + batch.stdout + d.log_text()
    assert rank0.returncode == 0 and "stand-in" in rank0.stdout  # the plain logs are there


def test_a_directory_at_the_marker_path_fails_the_run_once_with_its_reason(
    tmp_path: Path,
) -> None:
    def plant_dir(job: ReplayJob, log_dir: Path) -> None:
        (log_dir / f".bench_done.{job.job_id}").mkdir()

    final, d = _replayed_run(tmp_path, finish=plant_dir, limits={"verify_timeout_s": 30.0})
    assert final["outcome"] == "failed", final
    assert "is a directory" in str(final["reason"]), final["reason"]
    assert len(d.events("run.finished")) == 1


def test_verify_refuses_a_marker_linked_to_dev_zero_at_once(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    """After the job wrote its marker, it is replaced by a link to /dev/zero: `verify`
    reads nothing through it (no memory blow-up) and says why."""
    d = Daemon(cluster, tmp_path)
    d.start()
    try:
        run = _submit(d, demo_spec(shared_tmp, port=PORT + 20))
        final = json.loads(d.cli("wait", run, "--json", check=False, timeout=300).stdout)
    finally:
        d.stop()
    assert final["outcome"] == "succeeded", final
    job = str(final["slurm_job_id"])
    marker = shared_tmp / f".bench_done.{job}"
    marker.unlink()
    marker.symlink_to("/dev/zero")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "llmd_supervisor", "verify", job, "--log-dir", str(shared_tmp)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **cluster.slurm_env},
        check=False,
    )
    assert proc.returncode != 0 and "symbolic link" in proc.stdout, (proc.stdout, proc.stderr)
    assert time.monotonic() - started < 60
    assert "Traceback" not in proc.stderr


def test_a_log_copy_stops_at_the_run_cap_with_an_event_and_the_outcome_stands(
    tmp_path: Path,
) -> None:
    cap = 1 << 20

    def plant_big(job: ReplayJob, log_dir: Path) -> None:
        (log_dir / job.job_id).mkdir(exist_ok=True)
        (log_dir / job.job_id / "rank0.big.log").write_bytes(b"x" * 3_000_000)

    final, _ = _replayed_run(tmp_path, plant=plant_big, limits={"log_copy_max_bytes_per_run": cap})
    assert final["outcome"] == "succeeded", final
    copies = Path(str(final["archive"])) / "logs"
    assert sum(p.stat().st_size for p in copies.rglob("*") if p.is_file()) == cap
    assert _archive_events(final, "log.capped"), "no log.capped event"


def _replayed_run(
    tmp_path: Path,
    *,
    plant: JobAction | None = None,
    finish: JobAction | None = None,
    limits: dict[str, float] | None = None,
) -> tuple[dict[str, object], Daemon]:
    """One demo run of a hostile job on a replayed cluster, to its end."""
    log_dir = tmp_path / "logs"
    benchmark = load_spec(demo_spec(log_dir)).benchmark
    root = tmp_path / "daemon"
    root.mkdir()
    with replay_world(tmp_path / "world", benchmark, plant=plant, finish=finish) as world:
        d = Daemon(world, root, limits=limits or {}, replay_socket=world.socket)
        d.start()
        try:
            run = _submit(d, demo_spec(log_dir))
            final = json.loads(d.cli("wait", run, "--json", check=False, timeout=120).stdout)
        finally:
            d.stop()
    return final, d


@pytest.mark.parametrize(
    ("log_dir", "why"),
    [
        ("/var/tmp/llmd-x/../../etc/llmd-escape", "no '.' or '..' parts"),
        ("/etc/llmd-escape", "below one of daemon.log_roots"),
        ("{state}/archive/other-run", "overlaps the daemon's own directory"),
        ("{link}/escape", "a symbolic link on its way leads to"),
    ],
)
def test_a_log_directory_that_leads_elsewhere_is_refused_at_submission(
    tmp_path: Path, log_dir: str, why: str
) -> None:
    link = tmp_path / "to-etc"
    link.symlink_to("/etc")
    root = tmp_path / "daemon"
    root.mkdir()
    d = Daemon(NoCluster(root), root)
    d.start()
    try:
        chosen = log_dir.format(state=d.state_dir, link=link)
        proc = d.submit(demo_spec(Path(chosen), port=PORT))
        listed = json.loads(d.cli("list", "--all", "--json").stdout)["runs"]
    finally:
        d.stop()
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert why in proc.stderr and "run.log_dir" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and listed == []
    assert not Path("/etc/llmd-escape").exists() and not (link / "escape").exists()
