"""What a foreign job's result files say of its deployment (`core.results.declared`), and how its
`results.json` and InferenceX's aggregate rows carry it: known fields as the files (and
the user's options, and the allocation) say them, the rest unknown, never guessed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmd_supervisor.cli.inferencex_agg import AGG_DEPLOYMENT_FIELDS, inferencex_agg
from llmd_supervisor.cli.results import read_run_results
from llmd_supervisor.core.protocol.runs import DeclaredDeployment, Deployment
from llmd_supervisor.core.results.declared import (
    DECLARED_BOOLS,
    DECLARED_INTS,
    DECLARED_TEXTS,
    declared,
    declared_again,
    known_deployment,
)
from llmd_supervisor.core.results.evidence import (
    Point,
    parse_result,
    parsed_from_json,
    parsed_to_json,
)
from llmd_supervisor.core.results.gpus import RoleGpus
from llmd_supervisor.supervision.run import bench_files as bench_files

DATA = Path(__file__).resolve().parents[1] / "data" / "results"
VLLM_C4: dict[str, Any] = json.loads((DATA / "vllm-serve-c4.json").read_text())
# `vllm bench serve --metadata hw=h200 ...`: each value saved as a string.
METADATA = {
    "hw": "h200",
    "framework": "vllm",
    "precision": "fp8",
    "isl": "1024",
    "osl": "1024",
    "prefill_tp": "8",
    "decode_tp": "8",
    "prefill_num_workers": "2",
    "decode_num_workers": "1",
    "prefill_dp_attention": "False",
    "disagg": "true",
}


def point(**changes: object) -> Point:
    got = parse_result(json.dumps(VLLM_C4 | changes), "vllm")
    assert isinstance(got, Point), got
    return got


def test_the_declarable_fields_are_inferencex_deployment_fields() -> None:
    names = {*DECLARED_TEXTS, *DECLARED_BOOLS, *DECLARED_INTS}
    names |= {"model", "prefill_dp_attention", "decode_dp_attention"}
    assert names == set(DeclaredDeployment.__optional_keys__)
    assert names <= set(Deployment.__required_keys__ | Deployment.__optional_keys__)


def test_metadata_is_read_with_inferencex_types() -> None:
    got = dict(declared(VLLM_C4 | METADATA))
    assert got == {
        "model": VLLM_C4["model_id"],
        "hw": "h200",
        "framework": "vllm",
        "precision": "fp8",
        "isl": 1024,
        "osl": 1024,
        "prefill_tp": 8,
        "decode_tp": 8,
        "prefill_num_workers": 2,
        "decode_num_workers": 1,
        "prefill_dp_attention": "false",  # InferenceX's string
        "disagg": True,
    }


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("prefill_tp", "8.0"),
        ("prefill_tp", "-1"),
        ("prefill_tp", True),
        ("prefill_tp", "9" * 12),
        ("prefill_tp", "٨"),  # a digit, not an ASCII one
        ("decode_ep", 2_000_000),
        ("hw", ""),
        ("hw", "h200\x1b[2J"),
        ("hw", "x" * 201),
        ("hw", 200),
        ("disagg", "yes"),
        ("decode_dp_attention", 1),
    ],
)
def test_a_value_of_the_wrong_shape_is_not_read(key: str, value: object) -> None:
    assert key not in dict(declared({key: value}))


def test_what_the_files_say_alike_is_known_and_nothing_is_guessed() -> None:
    a = declared(VLLM_C4 | METADATA)
    b = declared(VLLM_C4 | METADATA | {"precision": "fp4"})  # the files disagree
    c = declared({"model_id": VLLM_C4["model_id"]})  # says little: no disagreement
    known = known_deployment([a, b, c], None, 3)
    assert "precision" not in known
    assert known.get("hw") == "h200" and known.get("prefill_tp") == 8
    assert known.get("is_multinode") is True  # 3 nodes
    assert known_deployment([c], RoleGpus(16, 8), 1) == {
        "model": VLLM_C4["model_id"],
        "disagg": True,  # prefill and decode GPUs apart
        "is_multinode": False,
    }
    # Unknown roles and nodes: neither is said; a file's own word wins over the nodes.
    assert known_deployment([c], None, None) == {"model": VLLM_C4["model_id"]}
    assert known_deployment([c], RoleGpus(0, 8), None) == {"model": VLLM_C4["model_id"]}
    said = declared({"is_multinode": "false", "disagg": "false"})
    assert known_deployment([said], RoleGpus(8, 8), 2) == {"disagg": False, "is_multinode": False}


def test_the_declaration_crosses_the_parsers_process_boundary() -> None:
    p = point(**METADATA)
    assert parsed_from_json(json.loads(json.dumps(parsed_to_json(p)))) == p
    value = json.loads(json.dumps(parsed_to_json(p)))
    del value["point"]["declared"]  # a parser of an older install says none
    got = parsed_from_json(value)
    assert isinstance(got, Point) and got.declared == ()
    for bad in ([["hw", 7]], [["prefill_tp", "8"]], [["hw"]], {"hw": "h200"}, [["x", "y"]]):
        assert declared_again(bad) is None
        value["point"]["declared"] = bad
        with pytest.raises(ValueError, match="not a deployment"):
            parsed_from_json(value)


def test_a_foreign_jobs_table_and_rows_carry_its_declared_deployment() -> None:
    """`submit --script JOB --prefill-gpus 16 --decode-gpus 8` on 3 nodes, its client run
    with --metadata ...: the rows carry the deployment as a spec's would, null for what
    nothing said, and the per-GPU numbers divided per role."""
    p = point(**METADATA)
    got = bench_files.BenchFiles(parsed={"results/c4.json": p})
    table = bench_files.foreign_table(got, RoleGpus(16, 8), 3)
    assert table.get("declared", {}).get("is_multinode") is True
    reply = {"run": "r1", "state": "succeeded", "outcome": "succeeded", "reason": ""}
    (row,) = inferencex_agg(read_run_results(reply | {"results": json.loads(json.dumps(table))}))
    assert row["model"] == VLLM_C4["model_id"] and row["prefill_tp"] == 8
    assert (row["num_prefill_gpu"], row["num_decode_gpu"]) == (16, 8)
    assert (row["disagg"], row["is_multinode"]) == (True, True)
    assert row["output_tput_per_gpu"] == pytest.approx(p.output_throughput / 8)
    unsaid = {k for k in AGG_DEPLOYMENT_FIELDS if row[k] is None}
    assert unsaid == {
        "image", "infmax_model_prefix", "spec_decoding", "decode_dp_attention",
        *(f"{r}_{k}" for r in ("prefill", "decode") for k in ("pp", "dcp_size", "pcp_size", "ep")),
    }  # fmt: skip
    assert row["recipe_fingerprint"] == ""  # InferenceX's value when none is given
    # Without the options: the files' own num_prefill_gpu / num_decode_gpu count.
    p2 = point(**METADATA, num_prefill_gpu="8", num_decode_gpu="8")
    table = bench_files.foreign_table(bench_files.BenchFiles(parsed={"c.json": p2}), None, 2)
    assert (table.get("prefill_gpus"), table.get("declared", {}).get("disagg")) == (8, True)


def test_the_report_titles_a_foreign_job_with_what_its_files_declared() -> None:
    from llmd_supervisor.cli.report import run_title

    p = point(**METADATA)
    table = bench_files.foreign_table(bench_files.BenchFiles(parsed={"c.json": p}), None, 3)
    reply = {"run": "r1", "state": "succeeded", "outcome": "succeeded", "reason": ""}
    r = read_run_results(reply | {"results": json.loads(json.dumps(table))})
    assert run_title(r) == f"{VLLM_C4['model_id']} · 2P1D · ISL 1024 / OSL 1024"
    table = bench_files.foreign_table(bench_files.BenchFiles(parsed={"c.json": p}), RoleGpus(16, 8))
    r = read_run_results(reply | {"results": json.loads(json.dumps(table))})
    assert run_title(r) == (
        f"{VLLM_C4['model_id']} · 2P1D, 24 GPUs (16 prefill + 8 decode) · ISL 1024 / OSL 1024"
    )
