"""`results --format inferencex-agg` against what InferenceX's own code path wrote.

tests/data/inferencex-agg/agg_fixture.json holds the aggregate InferenceX's
utils/process_result.py (commit in the file and in SOURCE.md) wrote for
tests/data/results/inferencex-c32.json, a 2P1D and a single-node deployment. Here the same
result goes through our parser, results table and aggregate, from a spec that says the
same deployment, and must come out field for field, but for what SOURCE.md says we do not
carry.
"""

from __future__ import annotations

import copy
import io
import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from llmd_supervisor.cli.inferencex_agg import inferencex_agg, write_agg
from llmd_supervisor.cli.results import read_run_results
from llmd_supervisor.core.results.evidence import Point, gate, parse_result, results_table
from llmd_supervisor.core.spec.recipe import deployment_of, role_gpus
from llmd_supervisor.core.spec.runspec import RunSpec, parse_spec

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
FIXTURE: dict[str, Any] = json.loads((DATA / "inferencex-agg" / "agg_fixture.json").read_text())
CASES = {case["name"]: case for case in FIXTURE["cases"]}
DEMO = tomllib.loads((REPO / "deploy" / "llm-d" / "demo.toml").read_text())
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def not_carried(key: str) -> bool:
    """What SOURCE.md says our rows leave out: each role's hardware (a spec has one)."""
    return key in ("prefill_hw", "decode_hw")


def bench_result(drop: tuple[str, ...] = ()) -> bytes:
    doc = json.loads((DATA / "results" / "inferencex-c32.json").read_text())
    doc = {k: v for k, v in doc.items() if k not in drop}
    return json.dumps(doc | FIXTURE["bench_result_changes"]).encode()


def spec_like(env: dict[str, str]) -> RunSpec:
    """The demo spec, changed to say the deployment `env` gives InferenceX."""
    data = copy.deepcopy(DEMO)
    per_node = 8
    data["topology"] = {
        "prefill_nodes": int(env["PREFILL_GPUS"]) // per_node,
        "decode_nodes": int(env["DECODE_GPUS"]) // per_node,
        "prefill_workers": int(env["PREFILL_NUM_WORKERS"]),
        "decode_workers": int(env["DECODE_NUM_WORKERS"]),
        "gpus_per_node": per_node,
    }
    data["model"]["served_name"] = FIXTURE["bench_result_changes"]["model_id"]
    data["container"] = {"kind": "docker", "image": env["IMAGE"]}
    data["benchmark"] |= {
        "input_len": int(env["ISL"]),
        "output_len": int(env["OSL"]),
        "concurrencies": [32],
        "prompts_multiplier": 10,
        "result_format": "inferencex",
    }
    router = json.loads(env["ROUTER_METADATA"])
    data["recipe"] = {
        "hw": env["RUNNER_TYPE"],
        "framework": env["FRAMEWORK"],
        "precision": env["PRECISION"],
        "model_prefix": env["MODEL_PREFIX"],
        "spec_decoding": env["SPEC_DECODING"],
        "kv_p2p_transfer": env["KV_P2P_TRANSFER"],
        "router_name": router["name"],
        "router_version": router["version"],
        **{
            f"{role}_{key}": int(env[f"{role.upper()}_{key.upper()}"])
            for role in ("prefill", "decode")
            for key in ("tp", "ep")
        },
        "prefill_dp_attention": env["PREFILL_DP_ATTN"] == "true",
        "decode_dp_attention": env["DECODE_DP_ATTN"] == "true",
    }
    return parse_spec(data)


def ours(
    spec: RunSpec, gpus: Any, *, deployment: bool = True, drop: tuple[str, ...] = ()
) -> Mapping[str, object]:
    p = parse_result(bench_result(drop), "inferencex")
    assert isinstance(p, Point)
    g = gate({32: p}, spec.benchmark.expected_prompts(), spec.benchmark.validity, {})
    assert g.ok, g.reason
    table = results_table(g, gpus, deployment=deployment_of(spec) if deployment else None)
    reply = {"run": "r1", "state": "finished", "outcome": "succeeded", "reason": ""}
    # As the archive holds it and the daemon sends it: JSON, read back by the client.
    (row,) = inferencex_agg(read_run_results(reply | {"results": json.loads(json.dumps(table))}))
    return row


def _same(key: str, mine: object, theirs: object) -> None:
    if isinstance(theirs, float) and not isinstance(theirs, bool):
        assert mine == pytest.approx(theirs, rel=1e-12), key
    else:
        assert mine == theirs and type(mine) is type(theirs), (key, mine, theirs)


def test_the_fixture_says_where_it_comes_from() -> None:
    source = FIXTURE["source"]
    assert source["repository"] == "SemiAnalysisAI/InferenceX"
    assert source["commit"] == "843c6254ff69b567f772f6a5fd97675af3d04431"
    assert source["file"] == "utils/process_result.py"


@pytest.mark.parametrize("name", ["2P1D", "2P1D-p99-no-e2el"])
def test_a_multinode_run_field_for_field(name: str) -> None:
    """Every field InferenceX writes, ours alike; the second case's client reported p99
    alone and no E2EL, and both leave out what it did not report."""
    case = CASES[name]
    theirs: Mapping[str, Any] = case["agg"]
    spec = spec_like(case["env"])
    mine = ours(spec, role_gpus(spec.topology), drop=tuple(case.get("bench_result_drop", ())))
    assert set(mine) - {"run"} == {k for k in theirs if not not_carried(k)}
    for key, value in theirs.items():
        if not_carried(key):
            continue
        if key == "recipe_fingerprint":  # each hashes its own description (SOURCE.md)
            own = mine[key]
            assert isinstance(value, str) and SHA256_HEX.fullmatch(value)
            assert isinstance(own, str) and SHA256_HEX.fullmatch(own)
            continue
        _same(key, mine[key], value)
    # The point of it: output over the 8 decode GPUs, input over the 16 prefill GPUs.
    assert theirs["output_tput_per_gpu"] == pytest.approx(1212.7004432466304 / 8)
    assert theirs["input_tput_per_gpu"] == pytest.approx(
        (40019.114627138806 - 1212.7004432466304) / 16
    )


def test_a_single_node_run_divides_everything_by_its_gpus() -> None:
    case = CASES["single-node-tp8"]
    theirs: Mapping[str, Any] = case["agg"]
    mine = ours(spec_like(CASES["2P1D"]["env"]), int(case["env"]["TP"]), deployment=False)
    for key in ("conc", "tput_per_gpu", "output_tput_per_gpu", "input_tput_per_gpu"):
        _same(key, mine[key], theirs[key])
    for key in (k for k in theirs if k.endswith(("_ttft", "_tpot", "_itl", "_e2el", "_intvty"))):
        if not not_carried(key):
            _same(key, mine[key], theirs[key])


def test_what_a_spec_does_not_say_is_null_and_named() -> None:
    """The demo declares hw and framework, not precision, prefix or image (kind "none")."""
    spec = parse_spec(copy.deepcopy(DEMO))
    p = parse_result(bench_result(), "inferencex")
    assert isinstance(p, Point)
    g = gate({32: p}, {32: 320}, spec.benchmark.validity, {})
    table = results_table(g, role_gpus(spec.topology), deployment=deployment_of(spec))
    reply = {"run": "r1", "state": "finished", "outcome": "succeeded", "reason": ""}
    run = read_run_results(reply | {"results": json.loads(json.dumps(table))})
    out, err = io.StringIO(), io.StringIO()
    write_agg("inferencex-agg", [run], out, err)
    assert err.getvalue() == (
        "llmd-supervisor results: run r1: its spec does not say precision, "
        "infmax_model_prefix, image (the [recipe] table, or topology.gpus_per_node), so they "
        "are null.\n"
    )
    (row,) = json.loads(out.getvalue())
    assert row["precision"] is None and row["hw"] == "devcluster"
    assert (row["num_prefill_gpu"], row["num_decode_gpu"]) == (16, 16)
    assert row["output_tput_per_gpu"] == pytest.approx(p.output_throughput / 16)
