"""Benchmark result files as vLLM's `vllm bench serve --save-result` writes them, for
tests that stand in for a job's benchmark (tests/data/results/vllm-serve-c4.json, with
its concurrency and counts set)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from llmd_supervisor.core.spec.runspec import Benchmark
from tests.devcluster import REPO

SAMPLE = REPO / "tests" / "data" / "results" / "vllm-serve-c4.json"


def vllm_result(concurrency: int, num_prompts: int, *, completed: int | None = None) -> bytes:
    """A save-result file of one point: `completed` of `num_prompts` (default all)."""
    doc = json.loads(SAMPLE.read_text())
    done = num_prompts if completed is None else completed
    doc.update(
        max_concurrency=concurrency,
        num_prompts=num_prompts,
        completed=done,
        failed=num_prompts - done,
        total_output_tokens=64 * done,
        total_input_tokens=1024 * done,
    )
    duration = float(doc["duration"])
    doc.update(
        request_throughput=done / duration,
        output_throughput=doc["total_output_tokens"] / duration,
        total_token_throughput=(doc["total_output_tokens"] + doc["total_input_tokens"]) / duration,
    )
    for key in ("latencies", "queue_times"):
        doc.pop(key, None)
    return json.dumps(doc).encode()


def finish_job(log_dir: Path, job_id: str, benchmark: Benchmark, rc: int = 0) -> None:
    """What a job's coordinator leaves at its end: every point's result file, then the
    completion marker (the job's log directory is this machine's in these tests)."""
    bench = log_dir / job_id / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    for c in benchmark.concurrencies:
        (bench / f"c{c}.json").write_bytes(vllm_result(c, benchmark.num_prompts(c)))
    now = datetime.now(UTC).isoformat()
    marker = {"rc": rc, "job_id": job_id, "rank": 2, "reason": "ok", "finished_at": now}
    (log_dir / f".bench_done.{job_id}").write_text(json.dumps(marker))
