"""The team database at scale (issue 4.1): a standby daemon on a PostgreSQL journal of
100,000 runs with full histories.

    tests/perf/run.sh --team [--smoke] [--out tests/perf/results/2026-12-06-team-journal]

A standby looks at the journal every 2 s (`supervision.ha.leading.REFRESH_S`) for the
leader's runs. It reads only the runs written since its last look
(`Journal.runs_changed_since`, schema version 8); before, it read every run with its
whole history each time. Measured, each against its target:

- the standby's CPU in a steady window while the leader writes (a new run and a step of
  each of 8 runs every 2 s): the daemon process's utime+stime over the window, as % of
  one core (<= 2 %). That is everything the standby does (lease renewals, the poller, the
  control socket), so it bounds its refreshes from above;
- ``list`` through the daemon's control socket (from here: no client start-up), the
  default view and the first page of ``list --all``, median of 5 (< 0.5 s each);
- reported, no target: the standby's first look (every run: from its start until it
  answers for the newest run), one changed-since read from here (client CPU and wall),
  and one read of every run as the refresh did before (client CPU and wall).

The journal is filled in the database itself (generate_series, the triggers off for the
fill only: it is a history, not a write of any leader): 100,000 runs of two clusters
(a quarter on a cluster this daemon does not have), 8 transitions and 3 events each. The
bench holds the lease of the daemon's cluster, so the daemon is its standby, and writes
as its leader. `--smoke` runs it all once with 300 runs (tests/unit/test_perf_team_smoke.py);
its numbers mean nothing. Exit status: 0 when every measurement ran (missed targets
included), 1 on a harness error.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import psycopg

from llmd_supervisor.adapters.control.client import ControlClient
from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.core.journal.url import PostgresJournal
from llmd_supervisor.core.run.lifecycle import Run, RunState, Submit, Submitted, new_run, step
from llmd_supervisor.core.spec.runspec import load_spec
from tests.daemon_helpers import STARTED, Daemon, demo_spec
from tests.devcluster import REPO
from tests.fakes.replay_world import replay_world
from tests.perf.common import machine, proc_cpu_s, proc_mem_kb, say
from tests.postgres import PgServer, lead_for_tests, start_server, stop_server
from tests.unit.test_journal import meta

TARGETS = {"standby_cpu_pct": 2.0, "list_s": 0.5, "list_all_s": 0.5}
CLUSTER = "dev"  # the replayed cluster's name: the daemon is its standby
ELSEWHERE = "elsewhere"  # a team cluster this daemon does not have
STEPS_PER_TICK = 8  # runs the leader steps every 2 s (and one new run)
_HISTORY = (
    "accepted",
    "submitting",
    "pending",
    "running",
    "finishing",
    "verifying",
    "archiving",
    "succeeded",
)


def fill(server: PgServer, dbname: str, runs: int, spec_toml: str) -> float:
    """`runs` final runs with their histories, in the database; the seconds it took."""
    start = time.perf_counter()
    with psycopg.connect(
        host=str(server.base), port=server.port, user="postgres", dbname=dbname, autocommit=True
    ) as conn:
        with conn.transaction():
            # The fill is history, not a leader's write: no fence, no stamps (changed 0).
            conn.execute("SET LOCAL session_replication_role = replica")
            conn.execute(
                """
                INSERT INTO runs (run_id, job_name, state, attempt, slurm_job_id, nodes,
                    cancel_requested, outcome, reason, owner_uid, cluster, spec_toml, script,
                    log_dir, archive_dir, created_at, updated_at, submission)
                SELECT id, 'llmd-' || id, 'succeeded', 1, (100000 + i)::text, '["n1", "n2"]',
                    0, 'succeeded', 'State=COMPLETED ExitCode=0:0, marker rc=0', 1000,
                    CASE WHEN i %% 4 = 0 THEN %(elsewhere)s ELSE %(cluster)s END, %(spec)s, '',
                    '/var/tmp/llmd-perf/' || id, '/var/tmp/llmd-perf-archive/' || id, at, at, 1
                FROM generate_series(1, %(n)s) AS i,
                    LATERAL (SELECT lpad(to_hex(i), 12, '0') AS id,
                        to_char(timestamp '2025-01-01' + i * interval '1 minute',
                                'YYYY-MM-DD"T"HH24:MI:SS.US') || '+00:00' AS at) AS v
                """,
                {"n": runs, "spec": spec_toml, "cluster": CLUSTER, "elsewhere": ELSEWHERE},
            )
            conn.execute(
                """
                INSERT INTO transitions (run_id, seq, state, at, event, cluster)
                SELECT r.run_id, s.seq, (%(states)s::text[])[s.seq + 1], r.created_at,
                    'step ' || s.seq, r.cluster
                FROM runs AS r CROSS JOIN generate_series(0, 7) AS s (seq)
                """,
                {"states": list(_HISTORY)},
            )
            conn.execute(
                """
                INSERT INTO events (run_id, at, kind, fields, cluster)
                SELECT r.run_id, r.created_at, k.kind, '{"n": 1}', r.cluster
                FROM runs AS r CROSS JOIN (VALUES ('run.transition'), ('attempt'),
                    ('job_files')) AS k (kind)
                """
            )
        conn.execute("ANALYZE")
    return time.perf_counter() - start


@dataclass
class Standby(Daemon):
    """The daemon with a journal of its own that may take long to load at start."""

    start_timeout_s: float = 600.0

    def start(self) -> None:
        self.write_config()
        self.starts += 1
        log = open(self.root / f"daemon-{self.starts}.log", "wb")  # noqa: SIM115 - child's
        argv = [sys.executable, "-m", "tests.faults.crash_daemon"]
        argv += ["--replay-socket", str(self.replay_socket), "--config", str(self.config_path)]
        self.proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.cluster.slurm_env, **self.env},
            cwd=REPO,
        )
        STARTED.append(self.proc)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while not any(self.events("daemon.ready")):
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no daemon.ready after {self.start_timeout_s:g} s")
            time.sleep(0.2)

    def ctl(self, op: str, args: dict[str, object] | None = None) -> Mapping[str, object]:
        """One control call, answered in-process (no CLI start-up cost)."""

        async def go() -> Mapping[str, object]:
            with anyio.fail_after(120):
                async with ControlClient(self.socket) as c:
                    return await c.call(op, args or {})

        return anyio.run(go)


class Leader:
    """The bench as the cluster's leader: a new run and a step of `STEPS_PER_TICK` runs
    per tick, through the journal's own writes (fenced, stamped)."""

    def __init__(self, config: PostgresJournal, spec_toml: str) -> None:
        self.config = config
        self.spec_toml = spec_toml
        self.runs: list[Run] = []
        self.made = 0

    async def tick(self, journal: Journal) -> None:
        now = datetime.now(UTC)
        self.made += 1
        run = new_run(f"perf{self.made:08x}", f"llmd-perf{self.made:08x}", now)
        await journal.insert_run(
            run, replace(meta(cluster=CLUSTER, created_at=now), spec_toml=self.spec_toml)
        )
        self.runs.append(run)
        for i, old in enumerate(self.runs[-STEPS_PER_TICK:]):
            event: Submit | Submitted = (
                Submit() if old.state is RunState.ACCEPTED else Submitted(str(9000 + i))
            )
            if old.state not in (RunState.ACCEPTED, RunState.SUBMITTING):
                continue
            stepped, _ = step(old, event, now + timedelta(microseconds=1))
            await journal.save(stepped, expected=old.state)
            self.runs[self.runs.index(old)] = stepped


def timed(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def client_reads(config: PostgresJournal) -> dict[str, float]:
    """One changed-since read after a read of everything, and one read of every run (the
    refresh before version 8), from this process: CPU and wall seconds each."""
    out: dict[str, float] = {}
    async with await Journal.open_postgres(config) as journal:
        cpu, wall = time.process_time(), time.perf_counter()
        every = await journal.list_runs()
        out["read_every_run_cpu_s"] = time.process_time() - cpu
        out["read_every_run_s"] = time.perf_counter() - wall
        out["runs_read"] = len(every)
        del every
        _, horizon = await journal.runs_changed_since(0)
        _ = None
        gc.collect()  # the runs read above are freed here, not in the read measured
        cpus, walls = [], []
        for _n in range(5):  # the median: the first read after a big one pays for its memory
            cpu, wall = time.process_time(), time.perf_counter()
            changed, _ = await journal.runs_changed_since(horizon)
            cpus.append(time.process_time() - cpu)
            walls.append(time.perf_counter() - wall)
        out["read_changed_cpu_s"] = statistics.median(cpus)
        out["read_changed_s"] = statistics.median(walls)
        out["changed_read"] = len(changed)
    return out


def run(work: Path, *, smoke: bool) -> dict[str, Any]:
    runs = 300 if smoke else 100_000
    window_s = 6.0 if smoke else 60.0
    out: dict[str, Any] = {"runs": runs, "window_s": window_s}
    spec_toml = demo_spec(Path("/var/tmp/llmd-perf"))
    server = start_server()
    try:
        dbname = server.new_database()
        config = server.journal_config(dbname)

        async def prepare() -> None:
            async with await Journal.open_postgres(config) as journal:  # the schema
                await lead_for_tests(journal, CLUSTER)  # the daemon is its standby

        anyio.run(prepare)
        out["fill_s"] = fill(server, dbname, runs, spec_toml)
        say(f"[team] {runs} runs filled in {out['fill_s']:.1f} s")
        out.update(anyio.run(client_reads, config))
        benchmark = load_spec((REPO / "deploy" / "llm-d" / "demo.toml").read_text()).benchmark
        with replay_world(work / "world", benchmark) as world:
            root = work / "standby"
            root.mkdir()
            journal_toml = (
                f'\n[journal]\nurl = "{config.url}"\npassword_file = "{server.password_file}"\n'
            )
            d = Standby(world, root, replay_socket=world.socket, extra_config=journal_toml)
            started = time.perf_counter()
            d.start()
            try:
                newest = f"{runs:012x}"
                d.ctl("status", {"run": newest})  # known: the first look read every run
                out["first_look_s"] = time.perf_counter() - started
                say(
                    f"[team] the standby answers for run {newest} after {out['first_look_s']:.1f} s"
                )
                out.update(steady(d, config, spec_toml, window_s))
                out["list_s"] = timed(lambda: d.ctl("list", {}), 1 if smoke else 5)
                out["list_all_s"] = timed(lambda: d.ctl("list", {"all": True}), 1 if smoke else 5)
                assert d.proc is not None
                out["rss_mb"] = proc_mem_kb(d.proc.pid).get("VmRSS", 0) / 1024
            finally:
                d.stop(signal.SIGTERM)
    finally:
        stop_server(server)
    return out


def steady(d: Standby, config: PostgresJournal, spec_toml: str, window_s: float) -> dict[str, Any]:
    """The standby's CPU over `window_s` while the leader writes every 2 s; and that the
    standby saw the leader's last run (its refresh works)."""
    assert d.proc is not None
    pid = d.proc.pid
    leader = Leader(config, spec_toml)

    async def go() -> tuple[float, float]:
        async with await Journal.open_postgres(config) as journal:
            await lead_for_tests(journal, CLUSTER)
            await leader.tick(journal)
            await anyio.sleep(4.0)  # the standby's first changed-since reads
            cpu0, t0 = proc_cpu_s(pid, children=False), time.monotonic()
            while time.monotonic() - t0 < window_s:
                await leader.tick(journal)
                await anyio.sleep(2.0)
            cpu1, t1 = proc_cpu_s(pid, children=False), time.monotonic()
            assert cpu0 is not None and cpu1 is not None
            return cpu1 - cpu0, t1 - t0

    cpu_s, seconds = anyio.run(go)
    last = leader.runs[-1]
    deadline = time.monotonic() + 30
    while True:  # the standby learns the leader's last run within a refresh or two
        status = d.ctl("status", {"run": last.run_id})
        if status.get("state") == last.state.value or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {
        "standby_cpu_s": cpu_s,
        "standby_cpu_pct": 100.0 * cpu_s / seconds,
        "refreshes": seconds / 2.0,
        "leader_writes": leader.made,
        "standby_saw_last_write": status.get("state") == last.state.value,
    }


def report(values: dict[str, Any], error: str | None, mode: str) -> dict[str, Any]:
    met = {
        k: values[k] <= t if k.endswith("_pct") else values[k] < t
        for k, t in TARGETS.items()
        if k in values
    }
    return {
        "date": datetime.now(UTC).date().isoformat(),
        "mode": mode,
        "machine": machine(),
        "targets": TARGETS,
        "values": values,
        "met": met,
        "error": error,
    }


def markdown(rep: dict[str, Any]) -> str:
    v = rep["values"]
    lines = [
        f"# Team journal at scale ({rep['mode']}, {rep['date']})",
        "",
        f"A standby daemon on a PostgreSQL journal of {v.get('runs')} runs (8 transitions and"
        " 3 events each, a quarter of another cluster); the bench leads the cluster and"
        f" writes a new run and steps {STEPS_PER_TICK} runs every 2 s.",
        "",
        "| measurement | value | target | met |",
        "|---|---|---|---|",
    ]
    for key, target in TARGETS.items():
        if key in v:
            unit = "%" if key.endswith("_pct") else "s"
            lines.append(
                f"| {key} | {v[key]:.3f} {unit} | {'<=' if unit == '%' else '<'} {target} {unit}"
                f" | {'yes' if rep['met'].get(key) else 'NO'} |"
            )
    lines += ["", "Reported (no target):", ""]
    for key in (
        "fill_s",
        "first_look_s",
        "standby_cpu_s",
        "refreshes",
        "leader_writes",
        "standby_saw_last_write",
        "read_changed_s",
        "read_changed_cpu_s",
        "changed_read",
        "read_every_run_s",
        "read_every_run_cpu_s",
        "runs_read",
        "rss_mb",
    ):
        if key in v:
            value = v[key]
            lines.append(
                f"- {key}: {value:.3f}" if isinstance(value, float) else f"- {key}: {value}"
            )
    if rep["error"]:
        lines += ["", "Harness error:", "", "```", rep["error"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/perf/run.sh --team")
    parser.add_argument("--smoke", action="store_true", help="300 runs, short window")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "perf" / "team-report")
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    error = None
    with tempfile.TemporaryDirectory(prefix="llmd-perf-team-") as tmp:
        try:
            values = run(Path(tmp), smoke=args.smoke)
        except Exception:
            error = traceback.format_exc()
    rep = report(values, error, "smoke" if args.smoke else "full")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rep))
    say(markdown(rep))
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
