"""The campaign ops' answers (`supervision.campaign.views`) are what the CLI reads
(`core.campaign.views`, checked by `core.protocol.runs.read`): every key the daemon sends is
typed (a reader drops the keys it does not know, so a key missing from a type would vanish
from `--json`), and a wrong one is named."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from llmd_supervisor.adapters.journal.campaign_store import StoredCampaign, StoredJob, VerifiedPoint
from llmd_supervisor.core.campaign.views import (
    CampaignBrief,
    CampaignJobResults,
    CampaignStatus,
)
from llmd_supervisor.core.protocol.runs import RunResults, read
from llmd_supervisor.errors import SummaryError
from llmd_supervisor.supervision.campaign import views

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
CAMPAIGN = StoredCampaign(
    campaign_id="c0ffee000001",
    name="sweep",
    owner_uid=1000,
    cluster="dev",
    state="finished",
    reason="",
    file_text='base = "demo.toml"\n',
    base_text="[run]\n",
    settings={"limits": {"max_jobs": 2}, "rerun": False},
    created_at=T0,
    updated_at=T0 + timedelta(hours=1),
)


def _job(key: str, state: str, run_id: str | None, reason: str = "") -> StoredJob:
    return StoredJob(
        campaign_id=CAMPAIGN.campaign_id,
        job_key=key,
        seq=0,
        recipe_id=key * 2,
        topology="2P+2D",
        concurrencies=(1, 4),
        to_run=(4,),
        matrix_values=(("topology.prefill_nodes", 2), ("benchmark.isl_osl", [64, 16])),
        nodes=4,
        gpus=32,
        workload=80,
        time_limit_s=300,
        spec_toml="[run]\n",
        state=state,
        run_id=run_id,
        submissions=1,
        reason=reason,
        updated_at=T0,
    )


JOBS = [_job("aaa", "succeeded", "run2"), _job("bbb", "blocked", None, "canary aaa failed")]
# Point 1 proven first by another user's run0, then by the owner's run1 (the one shown).
PROOFS = {
    ("aaaaaa", 1): (
        VerifiedPoint("aaaaaa", 1, "run0", "c0ffee0000ff", "c1.json", "2" * 64, T0),
        VerifiedPoint("aaaaaa", 1, "run1", "c0ffee000000", "c1.json", "0" * 64, T0),
    ),
    ("aaaaaa", 4): (
        VerifiedPoint("aaaaaa", 4, "run2", CAMPAIGN.campaign_id, "c4.json", "1" * 64, T0),
    ),
}
OWNERS = {"run0": CAMPAIGN.owner_uid + 1, "run1": CAMPAIGN.owner_uid, "run2": CAMPAIGN.owner_uid}
RESULTS: dict[str, RunResults] = {
    "run1": {
        "run": "run1",
        "state": "succeeded",
        "outcome": "succeeded",
        "reason": "ok",
        "results": None,
        "usage": {
            "gpu_hours_useful": 1.5,
            "gpu_hours_lost": 0.0,
            "node_hours_useful": 0.25,
            "node_hours_lost": 0.0,
        },
        "finished_at": "2025-03-01T11:00:00+00:00",
    },
}


def _wire(value: object) -> object:
    return json.loads(json.dumps(value, allow_nan=False))


def test_status_and_list_read_back_as_they_were_sent() -> None:
    status = views.status(CAMPAIGN, JOBS, {}, max_jobs=2, qos="", now=T0)
    assert read(CampaignStatus, _wire(status)) == status
    assert status["problems"] == [
        {
            "job": "bbb",
            "topology": "2P+2D",
            "values": {"topology.prefill_nodes": 2, "benchmark.isl_osl": [64, 16]},
            "state": "blocked",
            "reason": "canary aaa failed",
            "run": None,
        }
    ]
    assert status["exit_status"] == 10 and status["qos"] is None
    brief = views.brief(CAMPAIGN, JOBS)
    assert read(CampaignBrief, _wire(brief)) == brief


def test_a_jobs_results_read_back_with_the_runs_that_proved_it() -> None:
    item = views.job_results(CAMPAIGN, JOBS[0], PROOFS, RESULTS, OWNERS)
    assert read(CampaignJobResults, _wire(item)) == item
    assert [(p["concurrency"], p["state"], p["run"], p["reused_from"]) for p in item["points"]] == [
        (1, "reused", "run1", "c0ffee000000"),
        (4, "verified", "run2", None),
    ]
    assert item["runs"] == [RESULTS["run1"]]


def test_a_wrong_field_deep_in_a_jobs_results_is_named() -> None:
    item = _wire(views.job_results(CAMPAIGN, JOBS[0], PROOFS, RESULTS, OWNERS))
    assert isinstance(item, dict)
    item["runs"][0]["results"] = {"format": "vllm", "gpus": 8, "points": [{"concurrency": 1}]}
    with pytest.raises(SummaryError, match=r"runs\[0\]\.results\.points\[0\]\.num_prompts is"):
        read(CampaignJobResults, item)
    item["runs"] = []
    item["values"] = ["not", "an", "object"]
    with pytest.raises(SummaryError, match=r"CampaignJobResults\.values is a list, not an object"):
        read(CampaignJobResults, item)
