"""Per-GPU throughputs per role, as InferenceX divides them, against numbers by hand.

InferenceX's utils/process_result.py (tests/data/inferencex-agg/SOURCE.md): total tok/s
over all GPUs, output tok/s over the decode GPUs, input tok/s (total - output) over the
prefill GPUs; a single-node run's three over its GPUs.
"""

from __future__ import annotations

import copy
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from llmd_supervisor.core.render.script import render_sbatch
from llmd_supervisor.core.results.evidence import (
    Point,
    PointEvidence,
    Validity,
    gate,
    judge_alone,
    parse_result,
    parsed_from_json,
    parsed_to_json,
    results_table,
)
from llmd_supervisor.core.results.gpus import PerGpu, RoleGpus, declared_roles, per_gpu
from llmd_supervisor.core.spec.recipe import deployment_of, recipe_fingerprint, role_gpus
from llmd_supervisor.core.spec.runspec import RunSpec, parse_spec
from llmd_supervisor.errors import SpecError

REPO = Path(__file__).resolve().parents[2]
DEMO = tomllib.loads((REPO / "deploy" / "llm-d" / "demo.toml").read_text())
VLLM_C4 = (REPO / "tests" / "data" / "results" / "vllm-serve-c4.json").read_bytes()

# One point measured at 48,000 total tok/s, 12,000 of them output: 36,000 input tok/s.
TOTAL, OUTPUT = 48_000.0, 12_000.0

# (case, GPUs, total/GPU, output/GPU, input/GPU): the quotients worked out by hand,
# 8 GPUs per node.
HAND = [
    # 1P1D: 8 + 8 GPUs. 48000/16, 12000/8, 36000/8.
    ("1P1D", RoleGpus(8, 8), 3000.0, 1500.0, 4500.0),
    # 2P1D: 16 + 8. 48000/24, 12000/8, 36000/16.
    ("2P1D", RoleGpus(16, 8), 2000.0, 1500.0, 2250.0),
    # 1P3D: 8 + 24. 48000/32, 12000/24, 36000/8.
    ("1P3D", RoleGpus(8, 24), 1500.0, 500.0, 4500.0),
    # 2P2D: 16 + 16. 48000/32, 12000/16 (was 12000/32 = 375 before: 2x too low), 36000/16.
    ("2P2D", RoleGpus(16, 16), 1500.0, 750.0, 2250.0),
    # Single node, TP8: all three over its 8 GPUs. 48000/8, 12000/8, 36000/8.
    ("single-node", 8, 6000.0, 1500.0, 4500.0),
    # No decode GPU (InferenceX: output over all GPUs). 48000/8 twice, 36000/8.
    ("prefill-only", RoleGpus(8, 0), 6000.0, 1500.0, 4500.0),
]


@pytest.mark.parametrize(
    ("gpus", "total", "output", "input_"), [h[1:] for h in HAND], ids=[h[0] for h in HAND]
)
def test_per_gpu_by_hand(gpus: int | RoleGpus, total: float, output: float, input_: float) -> None:
    got = per_gpu(TOTAL, OUTPUT, gpus)
    assert (got.total, got.output, got.input) == pytest.approx((total, output, input_))


@pytest.mark.parametrize("gpus", [None, 0, -8, RoleGpus(0, 8), RoleGpus(8, -1)])
def test_per_gpu_unknown(gpus: int | RoleGpus | None) -> None:
    assert per_gpu(TOTAL, OUTPUT, gpus) == PerGpu(None, None, None)


def spec(**topology: Any) -> RunSpec:
    data = copy.deepcopy(DEMO)
    data["topology"] |= topology
    return parse_spec(data)


@pytest.mark.parametrize(
    ("topology", "roles"),
    [
        ({"prefill_nodes": 1, "decode_nodes": 1, "prefill_workers": 1}, RoleGpus(8, 8)),
        ({"prefill_nodes": 2, "decode_nodes": 1}, RoleGpus(16, 8)),
        ({"prefill_nodes": 1, "decode_nodes": 3, "prefill_workers": 1}, RoleGpus(8, 24)),
        ({}, RoleGpus(16, 16)),  # the demo: 2P + 2D, nominal 8 GPUs per stand-in node
        ({"gpus_per_node": 4, "nominal_gpus_per_node": 0}, RoleGpus(8, 8)),
        ({"nominal_gpus_per_node": 0}, None),
    ],
    ids=["1P1D", "2P1D", "1P3D", "demo-2P2D", "real-4-gpus", "no-gpus"],
)
def test_role_gpus_from_the_topology(topology: dict[str, int], roles: RoleGpus | None) -> None:
    assert role_gpus(spec(**topology).topology) == roles


def _evidence(p: Point) -> PointEvidence:
    return gate({4: p}, {4: 40}, Validity(), {}).points[0]


def test_results_table_divides_per_role() -> None:
    p = parse_result(VLLM_C4, "vllm")
    assert isinstance(p, Point)
    table = results_table([_evidence(p)], RoleGpus(16, 8))
    assert (table["gpus"], table["prefill_gpus"], table["decode_gpus"]) == (24, 16, 8)
    row = table["points"][0]
    assert row["total_token_throughput_per_gpu"] == pytest.approx(p.total_token_throughput / 24)
    assert row["output_throughput_per_gpu"] == pytest.approx(p.output_throughput / 8)
    assert row["input_throughput_per_gpu"] == pytest.approx(p.input_throughput / 16)
    # A total alone (a spec's GPUs before the roles were known): all three over it.
    table = results_table([_evidence(p)], 24)
    assert (table["gpus"], table["prefill_gpus"], table["decode_gpus"]) == (24, None, None)
    assert table["points"][0]["output_throughput_per_gpu"] == pytest.approx(
        p.output_throughput / 24
    )


def _with(raw: bytes, **keys: object) -> bytes:
    return json.dumps(json.loads(raw) | keys).encode()


@pytest.mark.parametrize(
    ("keys", "roles"),
    [
        ({"num_prefill_gpu": "16", "num_decode_gpu": "8"}, RoleGpus(16, 8)),  # --metadata
        ({"num_prefill_gpu": 8, "num_decode_gpu": 24}, RoleGpus(8, 24)),
        ({"num_prefill_gpu": 8, "num_decode_gpu": 0}, RoleGpus(8, 0)),
        ({"num_prefill_gpu": 8}, None),
        ({"num_prefill_gpu": 0, "num_decode_gpu": 8}, None),
        ({"num_prefill_gpu": True, "num_decode_gpu": 8}, None),
        ({"num_prefill_gpu": "8 GPUs", "num_decode_gpu": 8}, None),
        ({"num_prefill_gpu": 8.0, "num_decode_gpu": 8}, None),
        ({"num_prefill_gpu": 10**12, "num_decode_gpu": 8}, None),
        ({}, None),
    ],
)
def test_a_result_file_may_declare_its_roles(keys: Mapping[str, object], roles: object) -> None:
    assert declared_roles(keys) == roles
    p = parse_result(_with(VLLM_C4, **keys), "vllm")
    assert isinstance(p, Point) and p.role_gpus == roles  # a bad one never spoils the point
    assert parsed_from_json(json.loads(json.dumps(parsed_to_json(p)))) == p


def test_a_foreign_table_takes_the_roles_its_files_declare() -> None:
    p = parse_result(_with(VLLM_C4, num_prefill_gpu="8", num_decode_gpu="24"), "vllm")
    assert isinstance(p, Point)
    table = results_table([_evidence(p)], None)
    assert (table["gpus"], table["prefill_gpus"], table["decode_gpus"]) == (32, 8, 24)
    assert table["points"][0]["output_throughput_per_gpu"] == pytest.approx(
        p.output_throughput / 24
    )
    # The caller's roles (the spec's) win over what a file says.
    table = results_table([_evidence(p)], RoleGpus(16, 16))
    assert (table["prefill_gpus"], table["decode_gpus"]) == (16, 16)
    # Files that disagree: each row by its own, the table names no split.
    q = parse_result(_with(VLLM_C4, num_prefill_gpu="8", num_decode_gpu="8"), "vllm")
    assert isinstance(q, Point)
    other = PointEvidence(8, "results/c8.json", 40, 38, 2, True, None, q)
    table = results_table([_evidence(p), other], None)
    assert (table["gpus"], table["prefill_gpus"], table["decode_gpus"]) == (None, None, None)
    rows: list[dict[str, Any]] = table["points"]  # type: ignore[assignment]
    assert rows[0]["output_throughput_per_gpu"] == pytest.approx(p.output_throughput / 24)
    assert rows[1]["output_throughput_per_gpu"] == pytest.approx(q.output_throughput / 8)


def test_requested_gpus_win_over_nominal_ones() -> None:
    assert spec(gpus_per_node=4).topology.counted_gpus_per_node == 4  # the demo says 8 nominal
    assert role_gpus(spec(gpus_per_node=4).topology) == RoleGpus(8, 8)


def test_the_demo_declares_nominal_gpus_and_requests_none() -> None:
    demo = spec()
    assert demo.topology.gpus_per_node == 0  # nothing asks Slurm for a GPU
    assert demo.topology.nominal_gpus_per_node == 8
    assert demo.topology.counted_gpus_per_node == 8
    script = render_sbatch(demo, job_name="llmd-demo-1")
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert not [line for line in sbatch if "gpu" in line or "gres" in line], sbatch
    assert "--gpus" not in script and "--gres" not in script
    assert "--gpus-per-node=4" in render_sbatch(spec(gpus_per_node=4), job_name="j")


def _recipe(**recipe: Any) -> RunSpec:
    data = copy.deepcopy(DEMO)
    data["recipe"] = recipe
    return parse_spec(data)


def test_deployment_of_the_demo() -> None:
    d = deployment_of(_recipe(hw="devcluster", framework="llmd-vllm", precision="fp8"))
    assert d["hw"] == "devcluster" and d["framework"] == "llmd-vllm" and d["precision"] == "fp8"
    assert d["model"] == "stand-in/demo-model" and d["image"] is None
    assert (d["isl"], d["osl"]) == (64, 16)
    assert d["disagg"] is True and d["is_multinode"] is True
    assert (d["num_prefill_gpu"], d["num_decode_gpu"]) == (16, 16)
    # TP defaults to one worker's GPUs: 2 prefill workers of 1 node, 1 decode worker of 2.
    assert (d["prefill_tp"], d["decode_tp"]) == (8, 16)
    assert (d["prefill_num_workers"], d["decode_num_workers"]) == (2, 1)
    assert (d["prefill_ep"], d["prefill_dp_attention"], d["spec_decoding"]) == (1, "false", "none")
    assert "router" not in d and "kv_p2p_transfer" not in d
    assert len(d["recipe_fingerprint"]) == 64


def test_declared_parallelism_and_router() -> None:
    d = deployment_of(
        _recipe(
            prefill_tp=1,
            prefill_ep=8,
            prefill_dp_attention=True,
            decode_tp=8,
            router_name="llm-d-router",
            router_version="0.9.0",
            kv_p2p_transfer="nixl",
        )
    )
    assert (d["prefill_tp"], d["prefill_ep"], d["prefill_dp_attention"]) == (1, 8, "true")
    assert d["decode_tp"] == 8 and d["decode_dp_attention"] == "false"
    assert d.get("router") == {"name": "llm-d-router", "version": "0.9.0"}
    assert d.get("kv_p2p_transfer") == "nixl"


@pytest.mark.parametrize(
    ("recipe", "field"),
    [
        ({"router_name": "llm-d-router"}, "recipe.router_version"),
        ({"prefill_tp": 0}, "recipe.prefill_tp"),
        ({"decode_dp_attention": "yes"}, "recipe.decode_dp_attention"),
        ({"hw": "gb200; rm -rf /"}, "recipe.hw"),
        ({"gpus": 8}, "recipe.gpus"),
    ],
)
def test_recipe_errors_name_the_field(recipe: Mapping[str, object], field: str) -> None:
    with pytest.raises(SpecError) as err:
        _recipe(**recipe)
    assert err.value.field == field


def test_the_fingerprint_is_the_configuration_but_the_concurrency() -> None:
    base = recipe_fingerprint(spec())
    assert recipe_fingerprint(spec()) == base  # stable
    data = copy.deepcopy(DEMO)
    data["benchmark"]["concurrencies"] = [8, 16]
    data["run"]["log_dir"] = "/var/tmp/elsewhere"
    data["slurm"]["time_limit"] = "00:30:00"
    assert recipe_fingerprint(parse_spec(data)) == base
    # Counted GPUs are counted GPUs, requested or nominal.
    assert recipe_fingerprint(spec(gpus_per_node=8, nominal_gpus_per_node=0)) == base
    for table, key, value in [
        ("topology", "decode_workers", 2),
        ("topology", "nominal_gpus_per_node", 4),
        ("benchmark", "input_len", 128),
        ("model", "served_name", "other/model"),
        ("recipe", "decode_tp", 8),
        ("env", "common", {"VLLM_X": "1"}),
    ]:
        data = copy.deepcopy(DEMO)
        data.setdefault(table, {})[key] = value
        assert recipe_fingerprint(parse_spec(data)) != base, (table, key)


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        ({}, None),
        ({"completed": 20, "failed": 20}, "20 of 40 requests completed (min 38)"),
        ({"completed": 38, "failed": 2}, None),
        ({"max_concurrency": None}, "result for the wrong concurrency (max_concurrency none"),
        ({"total_output_tokens": 0}, "0 output tokens (min 1)"),
    ],
)
def test_a_script_jobs_result_file_passes_the_default_gate_against_its_own_count(
    keys: Mapping[str, object], problem: str | None
) -> None:
    # A --script job has no spec: what the file says was sent is what it is judged by, so
    # a file whose requests mostly failed never proves a campaign point.
    p = parse_result(_with(VLLM_C4, **keys), "vllm")
    assert isinstance(p, Point)
    got = judge_alone(p)
    assert (got is None) == (problem is None) and (problem or "") in (got or ""), got
