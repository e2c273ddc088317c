"""Outbound events beyond a run's record (issue 3.6): run.finished's details from the
receipt, attempts and results table (`core.events.facts`), run.point_finished, the opt-in
of a spec's [notify], campaign.progress's rate limit, node.quarantined, their Slack and
mail renderings, and the journal writing each with what it reports."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import pytest_asyncio

from llmd_supervisor.adapters.journal.store import Journal
from llmd_supervisor.adapters.outbox.store import Outbox
from llmd_supervisor.core.campaign.expand import parse_campaign
from llmd_supervisor.core.events.facts import (
    RunDetails,
    best_point,
    finished_details,
    points_of_table,
)
from llmd_supervisor.core.events.formats import (
    SLACK_BLOCKS_MAX,
    SLACK_FIELD_MAX,
    SLACK_FIELDS_MAX,
    SLACK_SECTION_MAX,
    mail_message,
    slack_message,
)
from llmd_supervisor.core.events.model import (
    MAX_BODY_BYTES,
    CampaignFacts,
    CampaignProblem,
    EventType,
    Facts,
    PointCounts,
    QuarantineFacts,
    encode,
    event_id,
    make_event,
)
from llmd_supervisor.core.events.outbox import (
    LastProgress,
    ProgressStep,
    campaign_counts,
    event_outgoing,
    last_progress,
    progress_step,
    quarantine_outgoing,
    run_outgoing,
)
from llmd_supervisor.core.events.routing import Destination, DestinationKind, EventsConfig
from llmd_supervisor.core.events.routing import check_named as check_named_
from llmd_supervisor.core.run.retry_policy import Evidence, NodeFailure, QuarantineRules
from llmd_supervisor.core.spec.runspec import load_spec
from llmd_supervisor.errors import CampaignError, SpecError
from tests.daemon_helpers import DEMO_SPEC
from tests.events_helpers import BEST, FINISHED
from tests.unit.test_outbox import ALL, LINKS, REF, SUCCESS, T0, meta, rows, walk

# --- run.finished: the details ----------------------------------------------------------

BELIEVED: Mapping[str, object] = {
    "basis": "two reads agree",
    "source": "sacct",
    "state": "COMPLETED",
    "state_raw": "COMPLETED",
    "exit_code": "0:0",
    "derived_exit_code": "0:0",
    "raw": "4242|COMPLETED|0:0",
}
SUCCEEDED_RECEIPT: Mapping[str, object] = {
    "outcome": "succeeded",
    "believed": BELIEVED,
    "marker": {
        "file": "/l/.bench_done.4242",
        "status": "ok",
        "detail": "",
        "raw_text": '{"rc": 0}',
        "parsed": {"format": "json", "rc": 0, "job_id": "4242", "rank": 1, "reason": ""},
    },
    "benchmark": {"ok": True, "reason": "2 points passed", "points": []},
    "cause": None,
    "sacct_rows": ["4242|COMPLETED|0:0"],  # raw rows: never in an event
}
FAILED_RECEIPT: Mapping[str, object] = {
    **SUCCEEDED_RECEIPT,
    "believed": {**BELIEVED, "state": "NODE_FAIL"},
    "cause": {
        "cause": "infrastructure",
        "nodes": ["n2"],
        "observed": ["n2"],
        "why": "Slurm's NODE_FAIL names n2",
    },
    "benchmark": None,
}
ATTEMPTS: list[Mapping[str, object]] = [{"gpu_hours": 1.5}, {"gpu_hours": 8.0}]
TABLE: Mapping[str, object] = {
    "format": "vllm",
    "gpus": 8,
    "points": [
        {
            "concurrency": 32,
            "valid": True,
            "completed": 320,
            "num_prompts": 320,
            "total_token_throughput": 12345.5,
            "output_throughput": 6000.25,
            "ttft_ms": {"mean": 130.0, "median": 120.0, "p99": 400.0},
            "tpot_ms": {"mean": 13.0, "median": 12.5, "p99": 20.0},
            "problem": None,
        },
        {
            "concurrency": 4,
            "valid": True,
            "completed": 40,
            "num_prompts": 40,
            "total_token_throughput": 100.0,
            "output_throughput": 50.0,
            "ttft_ms": None,
            "tpot_ms": None,
            "problem": None,
        },
        {  # the highest throughput, but not valid: never the best point
            "concurrency": 64,
            "valid": False,
            "completed": 10,
            "num_prompts": 640,
            "total_token_throughput": 99999.0,
            "problem": "benchmark c=64: 10 of 640 requests completed",
        },
        {"concurrency": "32", "valid": True},  # not an integer concurrency: left out
    ],
}

DETAILS: list[tuple[str, Mapping[str, object] | None, list[Mapping[str, object]], RunDetails]] = [
    ("nothing known", None, [], RunDetails()),
    (
        "a success",
        SUCCEEDED_RECEIPT,
        ATTEMPTS[1:],
        RunDetails(
            slurm_state="COMPLETED",
            exit_code="0:0",
            evidence=(
                "Slurm (sacct, two reads agree): State=COMPLETED ExitCode=0:0",
                "marker: ok rc=0",
                "benchmark gate passed: 2 points passed",
            ),
            gpu_hours_useful=8.0,
            gpu_hours_lost=0.0,
        ),
    ),
    (
        "an infrastructure failure after a retry",
        FAILED_RECEIPT,
        ATTEMPTS,
        RunDetails(
            slurm_state="NODE_FAIL",
            exit_code="0:0",
            cause="infrastructure",
            evidence=(
                "Slurm (sacct, two reads agree): State=NODE_FAIL ExitCode=0:0",
                "marker: ok rc=0",
                "cause infrastructure: Slurm's NODE_FAIL names n2 (nodes: n2)",
            ),
            gpu_hours_useful=8.0,
            gpu_hours_lost=1.5,
        ),
    ),
    (
        "a hold that expired",
        {"outcome": "failed", "held": {"submission": 2, "reason": "waiting: 1 node left"}},
        [],
        RunDetails(evidence=("held: waiting: 1 node left",)),
    ),
    (
        "a receipt of the wrong shapes (the job wrote none of it, still read defensively)",
        {"believed": "COMPLETED", "marker": [1], "cause": {"cause": 7}, "benchmark": 3},
        [{"gpu_hours": "lots"}],
        RunDetails(
            evidence=("Slurm: no terminal record was believed",),
            gpu_hours_useful=0.0,
            gpu_hours_lost=0.0,
        ),
    ),
]


@pytest.mark.parametrize(
    ("name", "receipt", "attempts", "expected"), DETAILS, ids=[d[0] for d in DETAILS]
)
def test_finished_details(
    name: str,
    receipt: Mapping[str, object] | None,
    attempts: list[Mapping[str, object]],
    expected: RunDetails,
) -> None:
    assert finished_details(receipt, attempts, None) == expected


def test_points_and_the_best_point_from_the_results_table() -> None:
    points = points_of_table(TABLE)
    assert [p.concurrency for p in points] == [4, 32, 64]  # by concurrency
    assert points[1] == BEST
    assert points[0].ttft_ms_median is None  # not measured
    assert best_point(points) == BEST  # c=64 is faster, but not valid
    assert best_point([replace(BEST, concurrency=8), BEST]) == replace(BEST, concurrency=8)
    assert best_point(points[2:]) is None
    assert points_of_table(None) == () == points_of_table({"points": "x"})
    details = finished_details(SUCCEEDED_RECEIPT, ATTEMPTS, TABLE)
    assert (details.best, details.points) == (BEST, points)


def test_run_finished_carries_the_details_and_nothing_raw() -> None:
    runs = walk(*SUCCESS)
    details = finished_details(SUCCEEDED_RECEIPT, ATTEMPTS[1:], TABLE)
    (out,) = run_outgoing(runs[-2], runs[-1], REF, LINKS, (ALL,), details=details)
    data = json.loads(out.body)["data"]
    assert data["slurm"] == {
        "job_id": "4242",
        "state": "COMPLETED",
        "exit_code": "0:0",
        "nodes": ["n1", "n2"],
    }
    assert data["outcome"] == "succeeded" and data["cause"] is None
    assert data["evidence"][0].startswith("Slurm (sacct")
    assert data["gpu_hours"] == {"useful": 8.0, "lost": 0.0}
    assert data["best_point"]["concurrency"] == 32
    assert [p["concurrency"] for p in data["points"]] == [4, 32, 64]
    assert data["timing"]["ran_s"] == 240.0  # running at minute 3, declared at minute 7
    assert data["links"]["archive"] == LINKS.archive
    assert b"sacct_rows" not in out.body and b"4242|COMPLETED" not in out.body
    # Details are run.finished's: the transition into running carries none.
    (started,) = run_outgoing(runs[2], runs[3], REF, LINKS, (ALL,), details=details)
    assert json.loads(started.body)["data"]["points"] == []


def test_a_long_point_list_is_cut_to_its_first_points_and_says_so() -> None:
    points = tuple(replace(BEST, concurrency=c + 1) for c in range(400))
    event = make_event(EventType.RUN_FINISHED, replace(FINISHED, points=points), T0, 7)
    raw = encode(event)
    assert len(raw) <= MAX_BODY_BYTES
    body = json.loads(raw)
    assert body["trimmed"] == ["points"]
    # Halved until it fits (400 -> 200 -> 100): the lowest concurrencies stay.
    assert [p["concurrency"] for p in body["data"]["points"]] == list(range(1, 101))
    assert body["data"]["best_point"]["concurrency"] == 32
    assert encode(event) == raw  # deterministic


# --- run.point_finished -----------------------------------------------------------------

JUDGED = (replace(BEST, concurrency=4, total_token_throughput=100.0), BEST)


def test_each_judged_point_is_an_event_when_the_run_leaves_verifying() -> None:
    runs = walk(*SUCCESS)
    verifying, archiving = runs[5], runs[6]
    out = run_outgoing(verifying, archiving, REF, LINKS, (ALL,), judged=JUDGED)
    assert [o.type for o in out] == [EventType.RUN_POINT_FINISHED] * 2
    assert [o.id for o in out] == [
        event_id(EventType.RUN_POINT_FINISHED, "run/r-1", "1.1:4"),
        event_id(EventType.RUN_POINT_FINISHED, "run/r-1", "1.1:32"),
    ]
    assert [o.seq for o in out] == ["1.1:4", "1.1:32"]
    data = json.loads(out[1].body)["data"]
    assert data["point"]["concurrency"] == 32 and data["point"]["ttft_ms_median"] == 120.0
    assert data["state"] == "archiving"
    # Points are judged only on the way out of verifying.
    assert run_outgoing(runs[2], runs[3], REF, LINKS, (ALL,), judged=JUDGED)[0].type is (
        EventType.RUN_STARTED
    )
    only_finished = replace(ALL, types=frozenset({EventType.RUN_FINISHED}))
    assert run_outgoing(verifying, archiving, REF, LINKS, (only_finished,), judged=JUDGED) == ()


@pytest_asyncio.fixture
async def journal(tmp_path: Path) -> AsyncIterator[Journal]:
    async with await Journal.open(tmp_path / "journal.db") as j:
        yield j


@pytest.mark.asyncio
async def test_point_events_commit_with_the_transition_once(journal: Journal) -> None:
    runs = walk(*SUCCESS)
    await journal.insert_run(runs[0], meta())
    for before, after in itertools.pairwise(runs[:6]):
        await journal.save(after, expected=before.state)
    out = run_outgoing(runs[5], runs[6], REF, LINKS, (ALL,), judged=JUDGED)
    await journal.save(runs[6], expected=runs[5].state, outgoing=out)
    # The same verdict recorded again (a retried save) makes no second event.
    await journal.save(runs[6], expected=runs[6].state, outgoing=out)
    assert await rows(journal, "SELECT seq FROM outbox_events ORDER BY seq") == [
        ("1.1:32",),
        ("1.1:4",),
    ]
    assert await rows(journal, "SELECT count(*) FROM deliveries") == [(2,)]


# --- a spec's [notify] ------------------------------------------------------------------

OPT_IN = Destination(
    "team", DestinationKind.SLACK, url="https://hooks.slack.com/services/x", opt_in=True
)


def test_an_opt_in_destination_gets_a_run_s_events_only_when_its_spec_names_it() -> None:
    runs = walk(*SUCCESS)
    assert run_outgoing(runs[-2], runs[-1], REF, LINKS, (OPT_IN,)) == ()
    (out,) = run_outgoing(runs[-2], runs[-1], REF, LINKS, (ALL, OPT_IN), named=("team",))
    assert out.destinations == ("all", "team")


def _spec(notify: str) -> str:
    return DEMO_SPEC.read_text() + notify


def test_a_run_spec_names_destinations_never_urls() -> None:
    assert load_spec(_spec("")).notify == ()
    spec = load_spec(_spec('\n[notify]\ndestinations = ["ci", "team", "ci"]\n'))
    assert spec.notify == ("ci", "team")
    with pytest.raises(SpecError, match="never carries a URL"):
        load_spec(_spec('\n[notify]\ndestinations = ["https://evil.example/x"]\n'))
    with pytest.raises(SpecError, match=r"'notify\.url'"):
        load_spec(_spec('\n[notify]\nurl = "https://evil.example/x"\n'))


def test_an_unknown_destination_is_refused_naming_the_configured_ones() -> None:
    config = EventsConfig((ALL, OPT_IN))
    check_named_(("team",), None, config)
    with pytest.raises(SpecError) as info:
        check_named_(("ci",), None, config)
    assert str(info.value) == (
        "Run spec field 'notify.destinations' has invalid value 'ci': no destination of "
        "that name (all, team)."
    )
    with pytest.raises(SpecError, match="none is configured"):
        check_named_(("ci",), None, EventsConfig())


CAMPAIGN = """
name = "sweep"
base = "base.toml"
[matrix]
"benchmark.concurrencies" = [[1, 2]]
"""


def test_a_campaign_file_names_destinations() -> None:
    assert parse_campaign(CAMPAIGN, default_name="x").notify == ()
    named = parse_campaign(CAMPAIGN + '[notify]\ndestinations = ["team"]\n', default_name="x")
    assert named.notify == ("team",)
    with pytest.raises(CampaignError, match="never carries a URL"):
        parse_campaign(CAMPAIGN + '[notify]\ndestinations = ["a@b.c"]\n', default_name="x")
    with pytest.raises(CampaignError, match="allowed here: destinations"):
        parse_campaign(CAMPAIGN + '[notify]\nto = ["a"]\n', default_name="x")


# --- campaign.progress ------------------------------------------------------------------

SOME = PointCounts(total=6, verified=1, running=2, pending=3)
MORE = replace(SOME, verified=2, running=1)
T1 = datetime(2025, 3, 4, 6, 0, 0, tzinfo=UTC)
PROGRESS: list[tuple[str, LastProgress | None, PointCounts, datetime, ProgressStep]] = [
    ("the first report", None, SOME, T1, ProgressStep(seq=1)),
    ("nothing changed", LastProgress(T1, 3, SOME), SOME, T1 + timedelta(hours=1), ProgressStep()),
    (
        "a change inside the minute waits for its end",
        LastProgress(T1, 3, SOME),
        MORE,
        T1 + timedelta(seconds=20),
        ProgressStep(retry_at=T1 + timedelta(minutes=1)),
    ),
    (
        "a change after the minute",
        LastProgress(T1, 3, SOME),
        MORE,
        T1 + timedelta(minutes=1),
        ProgressStep(seq=4),
    ),
    (
        "a clock that went back never silences a campaign",
        LastProgress(T1, 3, SOME),
        MORE,
        T1 - timedelta(hours=1),
        ProgressStep(seq=4),
    ),
]


@pytest.mark.parametrize(
    ("name", "last", "points", "now", "expected"), PROGRESS, ids=[p[0] for p in PROGRESS]
)
def test_progress_step(
    name: str,
    last: LastProgress | None,
    points: PointCounts,
    now: datetime,
    expected: ProgressStep,
) -> None:
    assert progress_step(last, points, now) == expected


def _campaign(points: PointCounts = SOME) -> CampaignFacts:
    return CampaignFacts(
        id="c-1", name="sweep", owner="alice", owner_uid=1000, cluster="dev", points=points
    )


def test_the_last_progress_is_read_back_from_its_body() -> None:
    (out,) = event_outgoing(EventType.CAMPAIGN_PROGRESS, _campaign(), T1, 3, (ALL,))
    assert last_progress(out.seq, T1, out.body) == LastProgress(T1, 3, SOME)
    assert last_progress("3", T1, b"{}") is None
    assert last_progress("x", T1, out.body) is None


def test_campaign_counts() -> None:
    by_state = {
        "queued": 2,
        "running": 1,
        "verified": 3,
        "reused": 1,
        "blocked": 1,
        "cancelled": 1,
        "failed: workload": 1,
        "failed: infrastructure": 0,
        "failed: other": 1,
    }
    assert campaign_counts(by_state) == PointCounts(
        total=11, verified=4, running=1, pending=2, failed=3, blocked=1
    )


@pytest.mark.asyncio
async def test_the_last_progress_event_survives_in_the_journal(journal: Journal) -> None:
    outbox = Outbox(journal)
    assert await outbox.last_event("campaign/c-1", "campaign.progress") is None
    for seq, when in ((1, T1), (2, T1 + timedelta(minutes=2))):
        (out,) = event_outgoing(EventType.CAMPAIGN_PROGRESS, _campaign(), when, seq, (ALL,))
        await outbox.add(out)
    found = await outbox.last_event("campaign/c-1", "campaign.progress")
    assert found is not None
    assert last_progress(*found) == LastProgress(T1 + timedelta(minutes=2), 2, SOME)


# --- node.quarantined -------------------------------------------------------------------

RULES = QuarantineRules(ttl=timedelta(hours=6), after_observed=1, after_inferred=2)


def _failure(run: str, evidence: Evidence, owner: int = 1000, node: str = "n2") -> NodeFailure:
    return NodeFailure("dev", node, owner, run, 1, evidence, f"{node} failed in {run}", T1)


def _names(uid: int) -> str | None:
    return {1000: "alice"}.get(uid)


def _quarantined(counted: list[NodeFailure], failure: NodeFailure) -> list[dict[str, object]]:
    out = quarantine_outgoing(
        counted, failure, rules=RULES, destinations=(ALL,), name_of=_names, host="h"
    )
    return [json.loads(o.body)["data"] | {"seq": o.seq} for o in out]


def test_node_quarantined_is_made_by_the_failure_that_makes_the_quarantine() -> None:
    seen = _failure("r-1", Evidence.OBSERVED)
    (everyone,) = _quarantined([], seen)
    assert everyone["scope"] == "everyone" and everyone["owner_uid"] is None
    assert everyone["node"] == "n2" and everyone["failures"] == 1
    assert everyone["seq"] == "r-1:1:everyone"
    assert _quarantined([seen], seen) == []  # the same failure counted again
    assert _quarantined([seen], _failure("r-2", Evidence.OBSERVED)) == []  # already out
    # Inferred: one owner's two runs keep the node out of that owner's runs only.
    first = _failure("r-1", Evidence.INFERRED)
    assert _quarantined([], first) == []
    (own,) = _quarantined([first], _failure("r-2", Evidence.INFERRED))
    assert (own["scope"], own["owner"], own["seq"]) == ("owner", "alice", "r-2:1:uid1000")
    # Another node's failures are not this node's.
    assert _quarantined([first], _failure("r-2", Evidence.INFERRED, node="n3")) == []


@pytest.mark.asyncio
async def test_node_quarantined_commits_with_the_failure_count(journal: Journal) -> None:
    seen = _failure("r-1", Evidence.OBSERVED)
    out = quarantine_outgoing([], seen, rules=RULES, destinations=(ALL,), name_of=_names)
    await journal.count_node_failure(seen, forget_before=T1 - RULES.ttl, outgoing=out)
    await journal.count_node_failure(seen, forget_before=T1 - RULES.ttl, outgoing=out)
    assert await rows(journal, "SELECT type, subject, seq FROM outbox_events") == [
        ("node.quarantined", "node/dev/n2", "r-1:1:everyone")
    ]
    assert len(await journal.node_failures()) == 1


# --- events list: a user's own runs, filtered before the limit ----------------------------


@pytest.mark.asyncio
async def test_a_user_s_deliveries_are_filtered_before_the_limit(journal: Journal) -> None:
    runs = walk(*SUCCESS)
    for run_id, owner in (("r-1", 1000), ("r-2", 2000)):
        mine = [replace(r, run_id=run_id, job_name=f"llmd-{run_id}") for r in runs]
        await journal.insert_run(mine[0], replace(meta(), owner_uid=owner))
        for before, after in itertools.pairwise(mine):
            out = run_outgoing(before, after, replace(REF, id=run_id), LINKS, (ALL,))
            await journal.save(after, expected=before.state, outgoing=out)
    outbox = Outbox(journal)
    assert len(await outbox.deliveries(limit=3)) == 3
    newest = await outbox.deliveries(owner_uid=1000, limit=3)
    assert {d.subject for d in newest} == {"run/r-1"} and len(newest) == 3
    assert await outbox.deliveries(owner_uid=3000) == []


# --- Slack and mail, for each new type ----------------------------------------------------

PROBLEMS = tuple(
    (f"{i:064x}", c, "failed", "<!channel> " + "x" * 600) for i, c in enumerate(range(300))
)


def _events() -> list[tuple[EventType, Facts]]:
    big = replace(
        FINISHED,
        point=BEST,
        evidence=("<@U123> " + "e" * 600,) * 40,
        reason="& <!here> " * 500,
        slurm=replace(FINISHED.slurm, nodes=tuple(f"node{i}" for i in range(500))),
    )
    campaign = replace(
        _campaign(),
        reason="canary failed " * 400,
        problems=tuple(CampaignProblem(*p) for p in PROBLEMS),
        best=BEST,
    )
    quarantine = QuarantineFacts("dev", "n2", "alice", 1000, 3, "<b>" * 900, T1, T1, "r-1")
    return [
        (EventType.RUN_POINT_FINISHED, big),
        (EventType.RUN_FINISHED, big),
        (EventType.CAMPAIGN_PROGRESS, campaign),
        (EventType.CAMPAIGN_FINISHED, replace(campaign, outcome="stopped")),
        (EventType.NODE_QUARANTINED, quarantine),
    ]


@pytest.mark.parametrize(("etype", "facts"), _events(), ids=lambda v: str(v)[:30])
def test_slack_and_mail_of_each_type_keep_slack_s_limits(etype: EventType, facts: Facts) -> None:
    event = make_event(etype, facts, T1, 1)
    message = slack_message(event)
    assert len(message["text"]) <= SLACK_SECTION_MAX
    assert len(message["blocks"]) < SLACK_BLOCKS_MAX
    for block in message["blocks"]:
        if "text" in block:
            assert len(block["text"]["text"]) <= SLACK_SECTION_MAX
        fields = block.get("fields", [])
        assert len(fields) <= SLACK_FIELDS_MAX
        assert all(len(f["text"]) <= SLACK_FIELD_MAX for f in fields)
    text = json.dumps(message)
    assert "<!" not in text and "<@" not in text and "<b>" not in text  # escaped
    assert event.id in message["blocks"][-1]["elements"][0]["text"]
    mail = mail_message(event, "llmd@h.example", ["oncall@example.org"], "h.example")
    assert mail["Message-ID"] == f"<{event.id}@h.example>"
    assert mail["Subject"].startswith("[llmd-supervisor] ")
    assert len(encode(event)) <= MAX_BODY_BYTES


def test_the_point_s_own_numbers_are_in_its_notification() -> None:
    event = make_event(EventType.RUN_POINT_FINISHED, replace(FINISHED, point=BEST), T1, "1:32")
    text = json.dumps(slack_message(event))
    assert "finished benchmark point c=32" in text
    assert "c=32: 12,345.5 tok/s total" in text
    body = mail_message(event, "a@h.example", ["b@h.example"], "h.example").get_content()
    assert "Point:" in body and "TTFT median 120 ms" in body
