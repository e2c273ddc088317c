"""What a hostile job writes cannot keep its run from ending or write on a terminal (issue
3.2 items 5 and 6): a marker whose reason holds a lone surrogate and terminal escapes
(valid JSON), escape sequences in its batch log's last line and in its status file, next
to a normal run. Both runs end (failed, succeeded), and no escape byte the job wrote
reaches `status`, `list`, `wait`, the daemon's log or its journal.

The whole daemon runs against a replayed cluster (tests/fakes/replay_world.py), and once
on the real dev cluster (a `submit --script` job of its own, beside a demo run)."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

from llmd_supervisor.core.spec.runspec import load_spec
from llmd_supervisor.node.common import status_name
from tests.daemon_helpers import Daemon, demo_spec
from tests.devcluster import DevCluster
from tests.fakes.bench_results import finish_job
from tests.fakes.replay_world import replay_world
from tests.fakes.slurm_replay import ReplayJob

ESCAPES = "\x1b[2K\x1b[1Goutcome succeeded \x1b]52;c;cm0gLXJmIH4=\x07 \x1b]0;pwned\x07 \x9b2J"
REASON = "boom \ud800 " + ESCAPES  # what the marker's JSON decodes to
REASON_SHOWN = "boom \\ud800 \\x1b[2K\\x1b[1Goutcome succeeded \\x1b]52;c;cm0gLXJmIH4=\\x07"
# Bytes a terminal acts on: ESC, BEL, CSI (C1), and a lone surrogate's UTF-8 attempt.
RAW = ("\x1b", "\x07", "\x9b", "\ud800")
BENCHMARK = load_spec(demo_spec(Path("/tmp"))).benchmark  # the demo's, whatever its log dir


def _hostile_finish(job: ReplayJob, log_dir: Path) -> None:
    """A normal job's end, except in the hostile run's directory: results, a last batch
    log line of escapes, a status file naming an escape as its state and failed
    component, then a marker rc 1 whose reason is `REASON`."""
    if log_dir.name != "hostile":
        finish_job(log_dir, job.job_id, BENCHMARK)
        return
    finish_job(log_dir, job.job_id, BENCHMARK, rc=1)
    with open(job._output_paths()[0], "a") as out:
        out.write(ESCAPES + "\n")
    status = {
        "state": "failed\x1b]0;title\x07",
        "rank": 0,
        "host": "127.0.0.1",
        "role": "prefill\x1b[5m",
        "failed_component": "engine\x1b]52;c;eA==\x07",
        "local_rc": 1,
    }
    (log_dir / job.job_id / status_name(0)).write_text(json.dumps(status))
    marker = {"rc": 1, "job_id": job.job_id, "rank": 0, "reason": REASON,
              "finished_at": datetime.now(UTC).isoformat()}  # fmt: skip
    (log_dir / f".bench_done.{job.job_id}").write_text(json.dumps(marker))  # \ud800 escaped


def _assert_shown_escaped(daemon: Daemon, runs: list[str]) -> dict[str, dict[str, object]]:
    """`status`, `list` and `wait` of `runs`, as text and as JSON, hold no raw escape;
    return each run's final summary."""
    finals: dict[str, dict[str, object]] = {}
    outputs = [daemon.cli("list", "--all"), daemon.cli("list", "--all", "--json")]
    for run in runs:
        wait = daemon.cli("wait", run, "--json", check=False)
        finals[run] = json.loads(wait.stdout)
        outputs += [wait, daemon.cli("wait", run, check=False)]
        outputs += [daemon.cli("status", run), daemon.cli("status", run, "--json")]
    for proc in outputs:
        for raw in RAW:
            assert raw not in proc.stdout + proc.stderr, (proc.args, proc.stdout, proc.stderr)
    return finals


def _assert_journal_escaped(daemon: Daemon) -> None:
    with sqlite3.connect(daemon.state_dir / "journal.sqlite3") as db:
        rows = db.execute("SELECT reason FROM runs UNION ALL SELECT fields FROM events").fetchall()
    text = "".join(str(r[0]) for r in rows)
    assert not any(raw in text for raw in RAW)
    assert "\\x1b" in text  # the escaped reason is there


def test_a_hostile_marker_and_logs_reach_no_terminal_and_the_runs_end_replayed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "daemon"
    root.mkdir()
    logs = tmp_path / "logs"
    with replay_world(tmp_path / "world", BENCHMARK, finish=_hostile_finish) as world:
        daemon = Daemon(world, root, replay_socket=world.socket)
        daemon.start()
        try:
            runs = []
            for name in ("hostile", "normal"):
                proc = daemon.submit(demo_spec(logs / name))
                assert proc.returncode == 0, proc.stderr
                runs.append(str(json.loads(proc.stdout)["run"]))
            finals = _assert_shown_escaped(daemon, runs)
        finally:
            daemon.stop()
    hostile, normal = (finals[r] for r in runs)
    assert hostile["outcome"] == "failed", hostile["reason"]
    assert str(hostile["reason"]).startswith(f"marker rc=1 from rank 0: {REASON_SHOWN}")
    assert str(hostile["last_log_line"]).startswith("\\x1b[2K\\x1b[1Goutcome succeeded")
    assert normal["outcome"] == "succeeded", normal["reason"]
    assert not daemon.events("run.supervision_failed")
    assert not any(raw in daemon.log_text() for raw in RAW)
    _assert_journal_escaped(daemon)


HOSTILE_SCRIPT = r"""#!/bin/bash
#SBATCH --nodes=1
#SBATCH --time=00:02:00
#SBATCH --output=hostile-%j.out
# A job whose marker reason is valid JSON with a lone surrogate and terminal escapes, and
# whose batch log ends with escape sequences (issue 3.2 items 5 and 6).
echo "hostile job $SLURM_JOB_ID on $(hostname)"
printf '\033[2K\033[1Goutcome succeeded \033]52;c;cm0gLXJmIH4=\007 \033]0;pwned\007\n'
reason='boom \ud800 \u001b[2K\u001b[1Goutcome succeeded \u001b]52;c;cm0gLXJmIH4=\u0007'
printf '{"rc": 1, "job_id": "%s", "rank": 0, "reason": "%s", "finished_at": "%s"}' \
  "$SLURM_JOB_ID" "$reason" "$(date -Iseconds)" > ".bench_done.$SLURM_JOB_ID.tmp"
mv ".bench_done.$SLURM_JOB_ID.tmp" ".bench_done.$SLURM_JOB_ID"
exit 1
"""


def test_a_hostile_marker_and_logs_reach_no_terminal_and_the_runs_end(
    cluster: DevCluster, tmp_path: Path, shared_tmp: Path
) -> None:
    hostile_dir, normal_dir = shared_tmp / "hostile", shared_tmp / "normal"
    hostile_dir.mkdir()
    script = hostile_dir / "hostile.sbatch"
    script.write_text(HOSTILE_SCRIPT)
    daemon = Daemon(cluster, tmp_path)
    daemon.start()
    try:
        proc = daemon.submit(demo_spec(normal_dir, port=8760, decode_nodes=1))
        assert proc.returncode == 0, proc.stderr
        normal_run = str(json.loads(proc.stdout)["run"])
        proc = daemon.cli(
            "submit", "--script", str(script), "--chdir", str(hostile_dir),
            "--marker", ".bench_done.{job_id}", "--marker-format", "json", "--json",
            check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        hostile_run = str(json.loads(proc.stdout)["run"])
        finals = _assert_shown_escaped(daemon, [hostile_run, normal_run])
    finally:
        daemon.stop()
    hostile, normal = finals[hostile_run], finals[normal_run]
    assert hostile["outcome"] == "failed", hostile["reason"]
    assert f"marker rc=1 from rank 0: {REASON_SHOWN}" in str(hostile["reason"])  # FAILED 1:0
    assert normal["outcome"] == "succeeded", normal["reason"]
    assert not daemon.events("run.supervision_failed")
    assert not any(raw in daemon.log_text() for raw in RAW)
    _assert_journal_escaped(daemon)
