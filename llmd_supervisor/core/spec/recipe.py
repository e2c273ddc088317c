"""A run spec in InferenceX's terms: its roles' GPUs, its deployment, its fingerprint (pure).

`role_gpus` gives the denominators of the per-GPU numbers (`core.results.evidence.per_gpu`);
`deployment_of` the identifying fields InferenceX's aggregate carries beside them
(``utils/process_result.py``, multi-node case; ``tests/data/inferencex-agg/SOURCE.md``),
which ``results.json`` keeps as its ``deployment`` and ``results --format inferencex-agg``
puts in every row.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from collections.abc import Mapping

from llmd_supervisor.core.protocol.runs import Deployment
from llmd_supervisor.core.results.gpus import RoleGpus
from llmd_supervisor.core.spec.recipe_table import RoleParallelism
from llmd_supervisor.core.spec.runspec import RunSpec, Topology

__all__ = ["deployment_of", "recipe_fingerprint", "role_gpus"]


def role_gpus(topology: Topology) -> RoleGpus | None:
    """GPUs per node x each role's nodes (None when the spec counts no GPUs)."""
    per_node = topology.counted_gpus_per_node
    if per_node < 1:
        return None
    return RoleGpus(per_node * topology.prefill_nodes, per_node * topology.decode_nodes)


def _tp(declared: RoleParallelism, gpus: int | None, workers: int) -> int | None:
    """The declared TP, else the GPUs of one worker (pure tensor parallelism)."""
    if declared.tp is not None:
        return declared.tp
    return gpus // workers if gpus else None


def _plain(value: object) -> object:
    """`value` as JSON can hold it, the same for equal specs (for the fingerprint)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # request_rate = inf
    return value


def recipe_fingerprint(spec: RunSpec) -> str:
    """sha256 (hex) of everything in `spec` that defines the measured configuration, but
    the concurrencies: the topology and counted GPUs, the model, the container image, the
    engine, router and sidecar commands, the benchmark's command, lengths, prompts per
    concurrency and request rate, the environment, and the recipe table.

    Left out, as they change where or how long a run goes, not what it measures: the log
    directory, Slurm's partition, account and limits, timeouts, grace periods, retry
    policy, health checks and the validity gate. The JSON is canonical as InferenceX's
    ``process_changelog.recipe_fingerprint`` makes it (sorted keys, no spaces, ASCII).
    """
    b = spec.benchmark
    defined = {
        "topology": _plain(spec.topology),
        "gpus_per_node": spec.topology.counted_gpus_per_node,
        "model": _plain(spec.model),
        "image": spec.container.image,
        "squash_file": spec.container.squash_file,
        "engine": {
            "prefill_command": list(spec.engine.prefill_command),
            "decode_command": list(spec.engine.decode_command),
        },
        "router": _plain(spec.router),
        "sidecar": _plain(spec.sidecar),
        "benchmark": {
            "command": list(b.command),
            "input_len": b.input_len,
            "output_len": b.output_len,
            "prompts_multiplier": b.prompts_multiplier,
            "request_rate": _plain(b.request_rate),
            "result_format": b.result_format,
        },
        "env": _plain(spec.env),
        "recipe": _plain(spec.recipe),
    }
    # Counted GPUs stand for themselves: gpus_per_node = 8 and nominal_gpus_per_node = 8
    # describe one configuration.
    topology = defined["topology"]
    assert isinstance(topology, dict)
    topology.pop("gpus_per_node")
    topology.pop("nominal_gpus_per_node")
    canonical = json.dumps(defined, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def deployment_of(spec: RunSpec) -> Deployment:
    """The fields InferenceX's aggregate identifies a configuration by, from `spec`.

    An own spec always runs prefill and decode on their own nodes: `disagg` and
    `is_multinode` are true. DCP and PCP sizes are 1 (the spec has no way to say
    otherwise). `model` is the served name (the name the benchmark client asks for).
    """
    topo, recipe = spec.topology, spec.recipe
    gpus = role_gpus(topo)
    prefill_gpus = gpus.prefill if gpus else None
    decode_gpus = gpus.decode if gpus else None
    out: Deployment = {
        "hw": recipe.hw,
        "image": recipe.image or spec.container.image,
        "model": spec.model.served_name,
        "infmax_model_prefix": recipe.model_prefix,
        "framework": recipe.framework,
        "precision": recipe.precision,
        "spec_decoding": recipe.spec_decoding,
        "disagg": True,
        "recipe_fingerprint": recipe_fingerprint(spec),
        "isl": spec.benchmark.input_len,
        "osl": spec.benchmark.output_len,
        "is_multinode": topo.nodes > 1,
        "prefill_tp": _tp(recipe.prefill, prefill_gpus, topo.prefill_workers),
        "prefill_pp": recipe.prefill.pp,
        "prefill_dcp_size": 1,
        "prefill_pcp_size": 1,
        "prefill_ep": recipe.prefill.ep,
        "prefill_dp_attention": str(recipe.prefill.dp_attention).lower(),
        "prefill_num_workers": topo.prefill_workers,
        "decode_tp": _tp(recipe.decode, decode_gpus, topo.decode_workers),
        "decode_pp": recipe.decode.pp,
        "decode_dcp_size": 1,
        "decode_pcp_size": 1,
        "decode_ep": recipe.decode.ep,
        "decode_dp_attention": str(recipe.decode.dp_attention).lower(),
        "decode_num_workers": topo.decode_workers,
        "num_prefill_gpu": prefill_gpus,
        "num_decode_gpu": decode_gpus,
    }
    if recipe.router_name is not None and recipe.router_version is not None:
        out["router"] = {"name": recipe.router_name, "version": recipe.router_version}
    if recipe.kv_p2p_transfer is not None:
        out["kv_p2p_transfer"] = recipe.kv_p2p_transfer
    return out
