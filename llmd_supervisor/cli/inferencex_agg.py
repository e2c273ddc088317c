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

from llmd_supervisor.cli.result_values import (
    STATS,
    interactivity,
    latency,
    no_results_reason,
    per_gpu_total,
)
from llmd_supervisor.core.results import LATENCIES
from llmd_supervisor.core.summary import Deployment, RunResults

__all__ = ["AGG_DEPLOYMENT_FIELDS", "AGG_STATS", "inferencex_agg", "write_agg"]

# The statistics of each latency a row carries (InferenceX's also has every percentile
# its client was asked for, e.g. p90 and p99.9: the results table keeps p99 only).
AGG_STATS = (*STATS, "std")

# The identifying fields of InferenceX's aggregate, null when a run's table has no
# deployment (a foreign job, or a table an older daemon wrote): see core.summary.Deployment.
AGG_DEPLOYMENT_FIELDS: tuple[str, ...] = tuple(sorted(Deployment.__required_keys__))


def inferencex_agg(r: RunResults) -> list[dict[str, object]]:
    """InferenceX's aggregate (utils/process_result.py, multi-node) for each valid point.

    The deployment's fields (`hw`, `model`, `framework`, `precision`, `isl`, `osl`,
    `disagg`, `is_multinode`, per-role `tp`/`pp`/`ep`/`dp_attention`/`num_workers`,
    `num_prefill_gpu`, `num_decode_gpu`, `image`, `recipe_fingerprint`, ...; null where
    unknown); `conc`; `tput_per_gpu` (total tok/s / all GPUs), `output_tput_per_gpu`
    (output tok/s / decode GPUs), `input_tput_per_gpu` (input tok/s / prefill GPUs), null
    when the GPU count is unknown; `{mean,median,p99,std}_{ttft,tpot,itl,e2el}` in
    seconds; `{mean,median,p99,std}_intvty` = 1000 / TPOT (ms). `run` says which run it
    is (ours).
    Invalid points are left out (InferenceX writes no aggregate for a failed point).
    """
    table = r["results"]
    if table is None:
        return []
    known = table.get("deployment")
    unknown = dict.fromkeys(AGG_DEPLOYMENT_FIELDS) | {
        "num_prefill_gpu": table.get("prefill_gpus"),
        "num_decode_gpu": table.get("decode_gpus"),
    }
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
        }
        for m in LATENCIES:
            for s in AGG_STATS:
                ms = latency(p, m, s)
                row[f"{s}_{m}"] = None if ms is None else ms / 1000.0
        for s in AGG_STATS:
            # InferenceX turns every TPOT key into one: std_intvty is 1000 / std TPOT too.
            row[f"{s}_intvty"] = interactivity(p, s)
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
        deployment = table.get("deployment")
        if deployment is None:
            print(
                f"llmd-supervisor results: run {r['run']}: its table has no deployment "
                "(a foreign job, or archived by an older daemon), so hw, model, framework, "
                "... are null.",
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
