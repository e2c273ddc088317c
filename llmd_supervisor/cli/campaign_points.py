"""A campaign's points as rows, from its ``campaign_results`` items (pure): what
``campaign results`` prints (table, ``--json``, ``--csv``) and ``campaign report`` lists."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TypedDict

from llmd_supervisor.core.campaign.views import CampaignJobResults, MatrixValues
from llmd_supervisor.core.protocol.runs import PointView
from llmd_supervisor.core.results.values import latency, per_gpu_total

__all__ = ["PointRow", "point_rows", "values_text", "varying"]


class PointRow(TypedDict):
    """One point of a campaign, in this order (the CSV's columns): its job, state,
    provenance and headline numbers (null when no run proved it or its run has no
    number)."""

    campaign: str
    job: str
    recipe_id: str
    topology: str
    values: str  # the job's matrix values that differ between the jobs (`values_text`)
    concurrency: int
    state: str
    run: str | None
    reused_from: str | None
    total_token_throughput_per_gpu: float | None
    output_throughput_per_gpu: float | None
    ttft_ms_median: float | None
    tpot_ms_median: float | None
    reason: str


def _run_points(job: CampaignJobResults) -> dict[tuple[str, int], PointView]:
    """(run id, concurrency) to its row in that run's results table."""
    out: dict[tuple[str, int], PointView] = {}
    for r in job["runs"]:
        if r["results"] is not None:
            for p in r["results"]["points"]:
                out[(r["run"], p["concurrency"])] = p
    return out


def point_rows(jobs: Sequence[CampaignJobResults]) -> list[PointRow]:
    """One row per point: its state, provenance and headline numbers."""
    rows: list[PointRow] = []
    keys = varying(job["values"] for job in jobs)
    for job in jobs:
        found = _run_points(job)
        values = values_text(job["values"], keys)
        for p in job["points"]:
            point = found.get((str(p["run"]), p["concurrency"]))
            rows.append(
                {
                    "campaign": job["campaign"],
                    "job": job["job"],
                    "recipe_id": job["recipe_id"],
                    "topology": job["topology"],
                    "values": values,
                    "concurrency": p["concurrency"],
                    "state": p["state"],
                    "run": p["run"],
                    "reused_from": p["reused_from"],
                    "total_token_throughput_per_gpu": per_gpu_total(point, None) if point else None,
                    "output_throughput_per_gpu": point["output_throughput_per_gpu"]
                    if point
                    else None,
                    "ttft_ms_median": latency(point, "ttft", "median") if point else None,
                    "tpot_ms_median": latency(point, "tpot", "median") if point else None,
                    "reason": p["reason"],
                }
            )
    return rows


def varying(values: Iterable[MatrixValues]) -> set[str]:
    """The matrix keys whose values differ between these jobs' `values` (the others say
    nothing about a row; the concurrencies are the rows' own column)."""
    seen: dict[str, set[str]] = {}
    for job_values in values:
        for k, v in job_values.items():
            seen.setdefault(k, set()).add(json.dumps(v, sort_keys=True))
    concurrencies = ("benchmark.concurrencies", "launcher.concurrencies")
    return {k for k, vs in seen.items() if len(vs) > 1 and k not in concurrencies}


def values_text(values: MatrixValues, keys: set[str]) -> str:
    """A job's matrix values among `keys`, short: `isl_osl=[64,16] prefill_nodes=1`."""
    return " ".join(
        f"{k.rsplit('.', 1)[-1]}={json.dumps(v, separators=(',', ':'))}"
        for k, v in values.items()
        if k in keys
    )
