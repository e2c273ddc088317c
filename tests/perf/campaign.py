"""The campaign benchmark, on the replayed cluster (issue 3.5):

    tests/perf/run.sh --campaign [--smoke] [--out tests/perf/campaign-report]

InferenceX's full sweep is 1,355 jobs; this campaign is 5 topologies x 271 ISL/OSL pairs
= 1,355 jobs of 4 concurrencies each (5,420 points). Measured, each against its target:

- expansion: parse and expand the file, every point validated as a run spec (< 2 s);
- admission: one decision over every job at max_jobs = 8 (no target: reported);
- `campaign submit` through a daemon: expansion, the cluster's checks, the journal;
- `campaign status` through the daemon at 5,420 points while 8 jobs run (< 0.5 s, median
  of 10 calls);
- the daemon's RSS then (<= 150 MB);
- end detection: 10 runs whose jobs end within the same second, each one's time from its
  job's end (COMPLETED, half a second after the coordinator's marker, as a job's agents
  stop their engines after it) to the daemon's verified outcome (`run.finished`, after
  verification and the archive), median <= 0.6 s; with its phases (the job seen leaving
  the queue, the copies finished, verification and archive).

- Slurm commands per minute (counted by the replay runner, by program: squeue and
  scontrol ask slurmctld, sacct slurmdbd) over a 30 s window with one run running, then
  over one with the campaign's 8 jobs running and 1,347 waiting: flat when the
  campaign's total is at most 1.5 times the single run's (`rpc_ratio`; the poller asks
  once per tick per cluster, however many jobs it follows).

The daemon reaches Slurm through the replay runner (tests/fakes/replay_world.py): its
commands are counted there (tests/perf/bench.py counts slurmctld's own RPCs for runs on
the dev cluster).
`--smoke` runs it all once with 20 jobs (tests/unit/test_perf_campaign_smoke.py); its
numbers mean nothing. Exit status: 0 when every measurement ran (missed targets
included), 1 on a harness error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmd_supervisor.core.campaign.admission import CampaignLimits, JobState, admit
from llmd_supervisor.core.campaign.expand import expand, parse_campaign
from llmd_supervisor.core.spec.runspec import load_spec
from llmd_supervisor.core.spec.toml_read import decode_toml
from tests.daemon_helpers import Daemon, demo_spec, stop_started
from tests.devcluster import REPO
from tests.fakes.replay_world import ReplayWorld, replay_world
from tests.perf.common import machine, proc_mem_kb, say, summary
from tests.perf.daemons import FINAL_STATES, PerfDaemon, log_time

TARGETS = {
    "expansion_s": 2.0,
    "status_s": 0.5,
    "rss_mb": 150.0,
    "end_median_s": 0.6,
    "rpc_ratio": 1.5,
}
END_RUNS = 10
MARKER_TO_END_S = 0.5


def campaign_text(pairs: int) -> str:
    """5 topologies x `pairs` ISL/OSL pairs, 4 concurrencies each."""
    isl_osl = ", ".join(f"[{64 + 8 * i}, {16 + (i % 7)}]" for i in range(pairs))
    return f"""
name = "sweep"
base = "base.toml"
[limits]
max_jobs = 8
[matrix]
"benchmark.isl_osl" = [{isl_osl}]
"benchmark.concurrencies" = [[1, 2, 4, 8]]
[[zip]]
"topology.prefill_nodes" = [1, 2, 3, 4, 5]
"topology.prefill_workers" = [1, 2, 3, 4, 5]
"""


def timed(fn: Callable[[], object], reps: int) -> float:
    """The median wall time of `reps` calls, in seconds."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slurm_calls_per_min(world: ReplayWorld, seconds: float) -> dict[str, float]:
    """The Slurm commands the daemon ran per minute over the next `seconds`, by program."""

    def counts() -> Counter[str]:
        return Counter(argv[0] for argv in world.cluster.calls)

    before = world.call(counts)
    time.sleep(seconds)
    ran = world.call(counts) - before
    return {program: n * 60 / seconds for program, n in sorted(ran.items())}


def run(work: Path, *, smoke: bool) -> dict[str, Any]:
    pairs = 4 if smoke else 271
    reps = 1 if smoke else 3
    base_text = demo_spec(work / "logs")
    (work / "base.toml").write_text(base_text)
    text = campaign_text(pairs)
    (work / "sweep.toml").write_text(text)
    base = decode_toml(base_text)
    out: dict[str, Any] = {}

    cf = parse_campaign(text, default_name="sweep")
    expansion = expand(cf, base)
    out["jobs"], out["points"] = len(expansion.jobs), expansion.points
    say(f"[campaign] {out['jobs']} jobs, {out['points']} points")
    out["expansion_s"] = timed(lambda: expand(parse_campaign(text, default_name="s"), base), reps)
    states = {j.key: JobState.WAITING for j in expansion.jobs}
    for canary in {j.topology: j for j in reversed(expansion.jobs)}.values():
        states[canary.key] = JobState.SUCCEEDED  # every topology open: the widest choice
    limits = CampaignLimits(max_jobs=8)
    out["admission_s"] = timed(lambda: admit(expansion.jobs, states, limits), reps)

    benchmark = load_spec((REPO / "deploy" / "llm-d" / "demo.toml").read_text()).benchmark
    with replay_world(work / "world", benchmark) as world:
        root = work / "daemon"
        root.mkdir()
        d = Daemon(world, root, replay_socket=world.socket)
        d.start()
        window = 2.0 if smoke else 30.0
        try:
            world.call(lambda: setattr(world, "running_s", 600.0))  # jobs stay running
            one = json.loads(d.submit(demo_spec(work / "logs")).stdout)["run"]
            d.wait_state(str(one), {"running"}, timeout=60)
            calls_one = slurm_calls_per_min(world, window)
            d.cli("cancel", str(one))
            d.wait_state(str(one), FINAL_STATES, timeout=120)
            start = time.perf_counter()
            sub = d.cli("campaign", "submit", str(work / "sweep.toml"), "--json", timeout=600)
            out["submit_s"] = time.perf_counter() - start
            campaign = str(json.loads(sub.stdout)["campaign"])
            time.sleep(1 if smoke else 5)  # jobs submitted and running
            out["status_s"] = timed(
                lambda: d.cli("campaign", "status", campaign, "--json"), 1 if smoke else 10
            )
            calls_campaign = slurm_calls_per_min(world, window)
            out["slurm_calls_per_min"] = {"one_run": calls_one, "campaign": calls_campaign}
            total_one = sum(calls_one.values())
            out["rpc_ratio"] = sum(calls_campaign.values()) / total_one if total_one else None
            assert d.proc is not None
            out["rss_mb"] = proc_mem_kb(d.proc.pid).get("VmRSS", 0) / 1024
            d.cli("campaign", "cancel", campaign)
        finally:
            d.stop()
    out["end"] = end_detection(work, 2 if smoke else END_RUNS)
    out["end_median_s"] = out["end"]["declared_s"]["median"]
    return out


def end_detection(work: Path, runs: int) -> dict[str, Any]:
    """`runs` runs held until all are queued, so that their jobs start, and end, in the same
    tick of the replayed cluster: per run, the seconds from its job's end to
    `run.finished`, and its phases."""
    benchmark = load_spec((REPO / "deploy" / "llm-d" / "demo.toml").read_text()).benchmark
    with (
        replay_world(work / "end-world", benchmark) as world,
        tempfile.TemporaryDirectory(dir="/var/tmp", prefix="llmd-perf-end-") as logs,
    ):
        world.end_s = MARKER_TO_END_S
        root = work / "end-daemon"
        root.mkdir()
        d = PerfDaemon(world, root, replay_socket=world.socket)  # the shipped defaults
        d.start()
        try:
            world.pause()
            summaries = d.submit_many([demo_spec(Path(logs))] * runs)
            ids = [str(s["run"]) for s in summaries]
            jobs = {
                run: str(s["slurm_job_id"]) for run, s in d.wait_runs(ids, {"pending"}, 60).items()
            }
            world.pause(False)
            # polled over the control socket from here: no client process takes a core
            d.wait_runs(ids, FINAL_STATES, 300)
        finally:
            d.stop()
        ended = world.call(lambda: dict(world.ended_at))
    records = d.events("run.finished") + d.events("run.transition")

    def at(run: str, event: str, to: str | None = None) -> float:
        times = [
            log_time(r)
            for r in records
            if r.get("run_id") == run and r["event"] == event and (to is None or r["to"] == to)
        ]
        if not times or jobs[run] not in ended:
            raise RuntimeError(f"run {run} (job {jobs[run]}) lacks its end or {event} {to}")
        return min(times)

    samples = []
    for run, job in jobs.items():
        left, verifying = (
            at(run, "run.transition", "finishing"),
            at(run, "run.transition", "verifying"),
        )
        done = at(run, "run.finished")
        samples.append(
            {
                "declared_s": done - ended[job],
                "left_queue_s": left - ended[job],
                "finishing_s": verifying - left,
                "verify_archive_s": done - verifying,
            }
        )
    spread = max(ended[j] for j in jobs.values()) - min(ended[j] for j in jobs.values())
    return {
        "runs": runs,
        "ends_spread_s": spread,
        **{k: summary([float(s[k]) for s in samples]) for k in samples[0]},
    }


def report(values: dict[str, Any], smoke: bool) -> dict[str, Any]:
    met = {k: values.get(k) is not None and values[k] <= limit for k, limit in TARGETS.items()}
    return {
        "mode": "smoke" if smoke else "full",
        "machine": machine(),
        "values": values,
        "targets": TARGETS,
        "met": met,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tests/perf/run.sh --campaign")
    p.add_argument("--smoke", action="store_true", help="once, 20 jobs (harness check)")
    p.add_argument("--out", type=Path, default=REPO / "tests" / "perf" / "campaign-report")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmd-perf-campaign-") as tmp:
        try:
            values = run(Path(tmp), smoke=args.smoke)
            error = None
        except Exception:  # a harness error: reported, exit 1
            values, error = {}, traceback.format_exc()
        finally:
            stop_started()
    result = report(values, args.smoke) | {"error": error}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, sort_keys=True))
    for key, limit in TARGETS.items():
        say(f"[campaign] {key} = {values.get(key)} (target <= {limit}; met: {result['met'][key]})")
    for key in ("admission_s", "submit_s", "slurm_calls_per_min", "end"):
        say(f"[campaign] {key} = {values.get(key)}")
    if error:
        sys.stderr.write(error)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
