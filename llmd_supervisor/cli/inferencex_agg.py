"""``results --format inferencex-agg``: a run's points as InferenceX's aggregate rows.

InferenceX's ``utils/process_result.py`` turns one benchmark result into one aggregate
object (its multi-node case: the deployment's identifying fields, the per-GPU throughputs,
latencies in seconds and interactivity); ``utils/collect_results.py`` gathers them into a
JSON list. `inferencex_agg` makes the same objects from a run's results table, so that
InferenceX's tooling takes them unchanged; ``tests/data/inferencex-agg/`` holds what it is
checked against (``SOURCE.md``, ``agg_fixture.json``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import IO

from llmd_supervisor.core.protocol.runs import Deployment, PointView, RunResults
from llmd_supervisor.core.results.evidence import LATENCIES
from llmd_supervisor.core.results.values import (
    field_of,
    no_results_reason,
    per_gpu_total,
)

__all__ = [
    "AGG_DEPLOYMENT_FIELDS",
    "AGG_POWER",
    "AGG_STATS",
    "agg_latencies",
    "inferencex_agg",
    "write_agg",
]

# The statistics of each latency besides its percentiles, as the client names them.
AGG_STATS = ("mean", "median", "std")

# The identifying fields of InferenceX's aggregate, null when a run's table does not say
# them (a foreign job's result files did not declare them, or an older daemon wrote the
# table): see core.protocol.runs.Deployment and DeclaredDeployment.
AGG_DEPLOYMENT_FIELDS: tuple[str, ...] = tuple(sorted(Deployment.__required_keys__))

# What InferenceX's power step (utils/aggregate_power*.py) adds to an aggregate without
# valid power telemetry: its schema version, and that the power numbers are not valid
# (none is written). We measure no power.
AGG_POWER: dict[str, object] = {"power_metric_schema_version": 2, "power_valid": 0}


def agg_latencies(point: PointView) -> dict[str, float | None]:
    """`point`'s latencies as InferenceX's aggregate has them: for each statistic the
    client reported (mean, median, std, each percentile: p90, p99, p99.9, ...) of TTFT,
    TPOT, ITL and E2EL, ``<stat>_<metric>`` in seconds, and of TPOT also
    ``<stat>_intvty`` = 1000 / TPOT in ms (tokens/s per user; std too, as InferenceX
    turns every TPOT key into one). What the client did not report is left out, as
    InferenceX leaves out what its result file lacks; an interactivity of a TPOT of 0 is
    null (InferenceX's division fails there).
    """
    out: dict[str, float | None] = {}
    for metric in LATENCIES:
        view = field_of(point, f"{metric}_ms")
        if not isinstance(view, dict):
            continue
        values = {s: view.get(s) for s in AGG_STATS}
        each = view.get("percentiles")
        # An older daemon's table kept p99 alone.
        values |= each if isinstance(each, dict) else {"p99": view.get("p99")}
        for stat, ms in values.items():
            if not isinstance(ms, int | float) or isinstance(ms, bool):
                continue
            out[f"{stat}_{metric}"] = ms / 1000.0
            if metric == "tpot":
                out[f"{stat}_intvty"] = 1000.0 / ms if ms else None
    return out


def inferencex_agg(r: RunResults) -> list[dict[str, object]]:
    """InferenceX's aggregate (utils/process_result.py, multi-node) for each valid point.

    The deployment's fields (`hw`, `model`, `framework`, `precision`, `isl`, `osl`,
    `disagg`, `is_multinode`, per-role `tp`/`pp`/`ep`/`dp_attention`/`num_workers`,
    `num_prefill_gpu`, `num_decode_gpu`, `image`, `recipe_fingerprint`, ...): the spec's,
    or what a foreign job's table says of it (`declared`), null where unknown (an
    unknown `recipe_fingerprint` is "", as InferenceX writes it unset); `conc`;
    `tput_per_gpu` (total tok/s / all GPUs), `output_tput_per_gpu` (output tok/s /
    decode GPUs), `input_tput_per_gpu` (input tok/s / prefill GPUs), null when the GPU
    count is unknown; the latencies (`agg_latencies`); the power fields of a run without
    power telemetry (`AGG_POWER`). `run` says which run it is (ours).
    Invalid points are left out (InferenceX writes no aggregate for a failed point).
    """
    table = r["results"]
    if table is None:
        return []
    known = table.get("deployment")
    unknown = (
        dict.fromkeys(AGG_DEPLOYMENT_FIELDS)
        | {
            "recipe_fingerprint": "",
            "num_prefill_gpu": table.get("prefill_gpus"),
            "num_decode_gpu": table.get("decode_gpus"),
        }
        | dict(table.get("declared") or {})
    )
    out = []
    for p in sorted(table["points"], key=lambda p: p["concurrency"]):
        if not p["valid"]:
            continue
        row: dict[str, object] = {
            "run": r["run"],
            **(known if known is not None else unknown),
            "conc": p["concurrency"],
            "tput_per_gpu": per_gpu_total(p, table["gpus"]),
            "output_tput_per_gpu": p["output_throughput_per_gpu"],
            "input_tput_per_gpu": p["input_throughput_per_gpu"],
            **agg_latencies(p),
            **AGG_POWER,
        }
        out.append(row)
    return out


# Deployment fields null unless the spec declares them, in the order a reader fills them.
_DECLARED = (
    "hw",
    "framework",
    "precision",
    "infmax_model_prefix",
    "image",
    "num_prefill_gpu",
    "prefill_tp",
    "decode_tp",
)


def write_agg(fmt: str, runs: Iterable[RunResults], out: IO[str], err: IO[str]) -> None:
    """Print `runs`' aggregate rows to `out` (a JSON list, or with ``inferencex-agg-jsonl``
    one object per line), and to `err` what is left out or unknown, one line per run."""
    rows: list[dict[str, object]] = []
    for r in runs:
        rows += inferencex_agg(r)
        table = r["results"]
        if table is None or not table["points"]:
            print(f"llmd-supervisor results: run {r['run']}: {no_results_reason(r)}.", file=err)
            continue
        skipped = [p["concurrency"] for p in table["points"] if not p["valid"]]
        if skipped:
            print(
                f"llmd-supervisor results: run {r['run']}: left out the invalid points "
                f"c={','.join(map(str, sorted(skipped)))}.",
                file=err,
            )
        if not table["gpus"]:
            print(
                f"llmd-supervisor results: run {r['run']}: the GPU count is unknown, so the "
                "per-GPU fields may be null.",
                file=err,
            )
        elif table.get("decode_gpus") is None:
            print(
                f"llmd-supervisor results: run {r['run']}: the roles' GPUs are unknown, so "
                "every per-GPU field is divided by all its GPUs (InferenceX divides output "
                "tok/s by the decode GPUs, input tok/s by the prefill GPUs).",
                file=err,
            )
        elif table.get("prefill_gpus") == 0:
            print(
                f"llmd-supervisor results: run {r['run']}: it has no prefill GPU, so the "
                "per-GPU fields are null (InferenceX divides a disaggregated run's numbers "
                "only with at least one prefill GPU).",
                file=err,
            )
        deployment = table.get("deployment")
        if deployment is None:
            said = table.get("declared") or {}
            unsaid = [k for k in AGG_DEPLOYMENT_FIELDS if k not in said]
            unsaid = [k for k in unsaid if not (k.startswith("num_") and table.get("decode_gpus"))]
            print(
                f"llmd-supervisor results: run {r['run']}: it was not run from a spec (a "
                "script or an adopted job, or archived by an older daemon), and its result "
                f"files do not say {', '.join(unsaid)}, so they are null (recipe_fingerprint "
                '""): its benchmark client can say them with --metadata KEY=VALUE.',
                file=err,
            )
            continue
        unsaid = [k for k in _DECLARED if deployment.get(k) is None]
        if unsaid:
            print(
                f"llmd-supervisor results: run {r['run']}: its spec does not say "
                f"{', '.join(unsaid)} (the [recipe] table, or topology.gpus_per_node), so "
                "they are null.",
                file=err,
            )
    if fmt == "inferencex-agg-jsonl":
        out.write("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    else:
        out.write(json.dumps(rows, indent=2, sort_keys=True) + "\n")
