"""Facts of one finished run, shared by the tests of outbound events (issue 3.6)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from llmd_supervisor.core.events.model import (
    Links,
    PointFacts,
    RunFacts,
    RunRef,
    SlurmFacts,
    Timing,
)

T0 = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
SHA = "ab" * 32
RUN = RunRef(
    id="r-0001",
    name="demo",
    owner="alice",
    owner_uid=1001,
    cluster="dev",
    spec_name="demo.toml",
    spec_sha256=SHA,
)
BEST = PointFacts(
    concurrency=32,
    valid=True,
    completed=320,
    num_prompts=320,
    total_token_throughput=12345.5,
    output_throughput=6000.25,
    ttft_ms_median=120.0,
    tpot_ms_median=12.5,
)
FINISHED = RunFacts(
    run=RUN,
    state="succeeded",
    attempt=1,
    slurm=SlurmFacts(job_id="4242", state="COMPLETED", exit_code="0:0", nodes=("n1", "n2")),
    timing=Timing(
        submitted_at=T0,
        started_at=T0 + timedelta(seconds=30),
        finished_at=T0 + timedelta(hours=1, seconds=30),
    ),
    outcome="succeeded",
    cause=None,
    reason="State=COMPLETED ExitCode=0:0, marker rc=0",
    evidence=("sacct: COMPLETED 0:0 (2 reads agree)", "marker rc=0 rank 1"),
    gpu_hours_useful=8.0,
    gpu_hours_lost=0.0,
    best=BEST,
    points=(replace(BEST, concurrency=4, total_token_throughput=100.0), BEST),
    links=Links(archive="/var/lib/llmd-supervisor/archive/r-0001", report=None, dashboard=None),
)
