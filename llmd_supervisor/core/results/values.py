"""The values a results table's rows are read as, shared by `results`' renderings and
InferenceX's aggregate (`cli.inferencex_agg`): latencies, per-GPU throughput,
interactivity, and the line that names a run's verdict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

from llmd_supervisor.core.protocol.runs import PointView as ResultPoint
from llmd_supervisor.core.protocol.runs import ResultsTable, RunResults

STATS = ("mean", "median", "p99")


def latency(point: ResultPoint, metric: str, stat: str) -> float | None:
    """`point`'s `metric` ("ttft", ...) statistic `stat` ("median", ...) in ms, or None."""
    values = field_of(point, f"{metric}_ms")
    if not isinstance(values, dict):
        return None
    value = values.get(stat)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def field_of(point: ResultPoint, key: str) -> object:
    return cast(Mapping[str, object], point).get(key)


def per_gpu_total(point: ResultPoint, gpus: int | None) -> float | None:
    """Total token throughput per GPU: the table's value, else total / gpus, else None."""
    value = point["total_token_throughput_per_gpu"]
    if value is not None:
        return value
    total = point["total_token_throughput"]
    if total is not None and gpus:
        return total / gpus
    return None


def gpu_text(table: ResultsTable) -> str:
    """`8 GPUs (4 prefill + 4 decode)`, `8 GPUs` (the roles' split unknown: every per-GPU
    number is divided by all of them) or `GPU count unknown`."""
    gpus, prefill, decode = table["gpus"], table.get("prefill_gpus"), table.get("decode_gpus")
    if not gpus:
        return "GPU count unknown"
    if prefill is None or decode is None:
        return f"{gpus} GPUs"
    return f"{gpus} GPUs ({prefill} prefill + {decode} decode)"


def points_text(n: int) -> str:
    """`1 point`, `3 points`."""
    return f"{n} point" if n == 1 else f"{n} points"


def interactivity(point: ResultPoint, stat: str = "median") -> float | None:
    """InferenceX's interactivity: 1000 / TPOT (ms), tokens per second per user."""
    tpot = latency(point, "tpot", stat)
    return 1000.0 / tpot if tpot else None


def verdict_line(r: RunResults) -> str:
    """`run ID: STATE, OUTCOME` (the outcome only once there is one and it is not the
    state already: a finished run's state is its outcome)."""
    head = f"run {r['run']}: {r['state']}"
    return f"{head}, {r['outcome']}" if r["outcome"] not in (None, r["state"]) else head


def no_results_reason(r: RunResults) -> str:
    """Why a run has nothing to show (its verdict's reason when it has one)."""
    if r["results"] is None:
        why = "its archive holds no results table"
    else:
        why = "its results table has no points"
    if r["outcome"] and r["outcome"] != "succeeded":
        return f"{why} (the run {r['outcome']}: {r['reason'] or 'no reason given'})"
    if r["outcome"] is None:
        return f"{why} (the run is {r['state']}, not finished)"
    return why
