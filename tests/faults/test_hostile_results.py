"""Hostile benchmark result files through a whole daemon (issue 3.2, item 2).

The finding: a `submit --script` job whose `--results` matched 8 files of 32 MiB of
``[[],[],...]`` kept the control socket from answering `list` for 30 s (the files were
read and parsed on the event loop), and the unit's watchdog would have restarted the
daemon into the same step. Here the job runs on the replayed site
(tests/fakes/replay_world.py) next to another user's normal demo run: `list` answers
within a second throughout, the normal run succeeds, and the hostile run's evidence says
which budget or limit refused each file. Its twin on the dev cluster is
tests/cluster/test_hostile_results.py."""

from __future__ import annotations

import json
from pathlib import Path

from llmd_supervisor.core.spec.runspec import load_spec
from tests.daemon_helpers import Daemon, demo_spec
from tests.fakes.bench_results import finish_job
from tests.fakes.hostile_results import list_until_final, vm_hwm, write_nested
from tests.fakes.replay_world import replay_world
from tests.fakes.slurm_replay import ReplayJob
from tests.foreign_helpers import WATCH, final, submit_script

MIB = 1 << 20
HOSTILE_FILES = 8
# Lowered so that the test is quick: 4 of the 8 files are read (128 MiB), each refused by
# the parser's memory limit; the other 4 are past the run's byte budget.
LIMITS = {"result_parse_memory_bytes": 128 * MIB, "result_bytes_max_per_run": 128 * MIB}
ANSWER_WITHIN_S = 1.0


def hostile_finish(job: ReplayJob, run_dir: Path) -> None:
    """What the hostile script leaves: a log, 8 result files of 32 MiB, marker rc 0."""
    (run_dir / f"slurm_job-{job.job_id}_rank_0.log").write_text("rank 0: benchmarked\n")
    names = [f"ix_c{2**i}.json" for i in range(HOSTILE_FILES)]
    write_nested(run_dir / "results", names)
    (run_dir / f".bench_done.{job.job_id}").write_text("0\n")


def test_hostile_result_files_never_keep_list_from_answering(tmp_path: Path) -> None:
    normal_dir, run_dir = tmp_path / "normal", tmp_path / "ix"
    benchmark = load_spec(demo_spec(normal_dir)).benchmark

    def finish(job: ReplayJob, log_dir: Path) -> None:
        if job.name.startswith("hostile"):
            hostile_finish(job, log_dir)
        else:
            finish_job(log_dir, job.job_id, benchmark)

    root = tmp_path / "daemon"
    root.mkdir()
    run_dir.mkdir()
    with replay_world(tmp_path / "world", benchmark, finish=finish) as world:
        d = Daemon(world, root, limits=dict(LIMITS), replay_socket=world.socket)
        d.start()
        assert d.proc is not None
        try:
            normal = d.submit(demo_spec(normal_dir))
            assert normal.returncode == 0, normal.stderr
            options = ("--job-name-prefix", "hostile", *WATCH, "--json", "--", "--time=00:04:00")
            hostile = submit_script(d, run_dir, 0, *options)
            assert hostile.returncode == 0, hostile.stderr
            runs = {json.loads(normal.stdout)["run"], json.loads(hostile.stdout)["run"]}
            delays = list_until_final(d.socket, runs, within_s=240)
            peak = vm_hwm(d.proc.pid)
            normal_end = final(d, json.loads(normal.stdout)["run"])
            hostile_end = final(d, json.loads(hostile.stdout)["run"])
        finally:
            d.stop()
    assert max(delays) < ANSWER_WITHIN_S, f"list took up to {max(delays):.2f} s"
    assert d.events("daemon.loop_lag") == [], d.events("daemon.loop_lag")
    assert d.starts == 1
    assert normal_end["outcome"] == "succeeded", normal_end["reason"]
    assert hostile_end["outcome"] == "succeeded", hostile_end["reason"]

    archive = Path(str(hostile_end["archive"]))
    rows = json.loads((archive / "results.json").read_text())["points"]
    memory = [r for r in rows if "limits.result_parse_memory_bytes" in str(r["problem"])]
    budget = [r for r in rows if "limits.result_bytes_max_per_run" in str(r["problem"])]
    assert (len(memory), len(budget)) == (4, 4), rows
    for row in memory:
        name = str(row["file"]).removeprefix("results/")
        assert f"parsing {run_dir / name} needs more than 128 MiB of memory" in row["problem"]
    events = [json.loads(line) for line in (archive / "events.jsonl").read_text().splitlines()]
    refused = [e for e in events if e.get("kind") == "log.refused"]
    assert len(refused) == 4, refused
    assert all("(limits.result_bytes_max_per_run)" in json.dumps(e) for e in refused)
    # Four files of 32 MiB are held while they are read and archived; nothing near the
    # 800 MiB one parse of one of them took in the daemon before.
    assert peak < 600 * MIB, f"the daemon's peak RSS was {peak / MIB:.0f} MiB"
