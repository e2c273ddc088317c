"""The outbound event model (`core.events.model`, issue 3.6): types, stable ids, the canonical
body and its 20 kB cap, hostile text, and the campaign.progress throttle."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd_supervisor.core.events.model import (
    MAX_BODY_BYTES,
    SCHEMA,
    BestOf,
    CampaignFacts,
    CampaignProblem,
    Event,
    EventType,
    Links,
    Owner,
    PingFacts,
    PointCounts,
    PointFacts,
    ProgressGate,
    QuarantineFacts,
    RunFacts,
    SlurmFacts,
    Timing,
    encode,
    event_id,
    iso,
    make_event,
    progress_gate,
)
from tests.events_helpers import BEST, FINISHED, RUN, SHA, T0


def _body(etype: EventType, facts: object, seq: int | str = 7) -> dict[str, object]:
    event = make_event(etype, facts, T0, seq)  # type: ignore[arg-type]  # tests pass all kinds
    value = json.loads(encode(event).decode("utf-8"))
    assert isinstance(value, dict)
    return value


# --- types and ids -------------------------------------------------------------------------


def test_event_types_are_exactly_the_issue_s() -> None:
    assert [t.value for t in EventType] == [
        "run.submitted",
        "run.started",
        "run.point_finished",
        "run.finished",
        "campaign.progress",
        "campaign.finished",
        "node.quarantined",
        "test.ping",
    ]


def test_event_id_is_the_documented_hash() -> None:
    # sha256 of the JSON list [schema, type, subject, seq], base32, lower case, 26 chars
    key = '["llmd-supervisor.event/1","run.finished","run/r-0001","7"]'
    digest = hashlib.sha256(key.encode()).digest()
    independent = "evt_" + base64.b32encode(digest).decode().lower()[:26]
    assert event_id(EventType.RUN_FINISHED, "run/r-0001", 7) == independent
    # pinned: a change of the rule would change every id receivers have deduplicated on
    assert independent == "evt_ifkrqdar5cyokhisfzcmftq4iy"
    point = event_id(EventType.RUN_POINT_FINISHED, "run/r-0001", "1:32")
    assert point == "evt_dte5jxpm4eyxuphs4fslcdqhmn"


def test_the_same_transition_gives_the_same_id_and_another_one_another() -> None:
    a = make_event(EventType.RUN_FINISHED, FINISHED, T0, 7)
    again = make_event(EventType.RUN_FINISHED, replace(FINISHED, reason="other"), T0, 7)
    assert a.id == again.id  # re-derived after a crash: same transition, same id
    assert make_event(EventType.RUN_FINISHED, FINISHED, T0, 8).id != a.id
    assert make_event(EventType.RUN_STARTED, FINISHED, T0, 7).id != a.id
    other_run = replace(FINISHED, run=replace(RUN, id="r-0002"))
    assert make_event(EventType.RUN_FINISHED, other_run, T0, 7).id != a.id
    # seq 7 and "7" are the same position
    assert make_event(EventType.RUN_FINISHED, FINISHED, T0, "7").id == a.id


@pytest.mark.parametrize(
    ("subject", "seq"),
    [("run/r.1", 1), ("run/x", "a.b"), ("campaign/c", "2"), ("node/dev/n1", 3)],
)
def test_event_ids_carry_no_dot(subject: str, seq: int | str) -> None:
    eid = event_id(EventType.RUN_FINISHED, subject, seq)
    assert eid.startswith("evt_") and len(eid) == 30
    assert all(c.isalnum() or c == "_" for c in eid)


def test_make_event_checks_the_facts_against_the_type() -> None:
    with pytest.raises(ValueError, match=r"run\.finished reports RunFacts, not PingFacts"):
        make_event(EventType.RUN_FINISHED, PingFacts("ci", "alice"), T0, 1)
    with pytest.raises(ValueError, match="needs the point that finished"):
        make_event(EventType.RUN_POINT_FINISHED, FINISHED, T0, "1:32")
    with pytest.raises(ValueError, match="no time zone"):
        make_event(EventType.RUN_FINISHED, FINISHED, datetime(2025, 6, 1, 12), 1)


def test_owner_of_each_kind_of_event() -> None:
    run = make_event(EventType.RUN_FINISHED, FINISHED, T0, 1)
    assert run.owner == Owner(1001, "alice")
    q = QuarantineFacts("dev", "n1", None, None, 1, "NODE_FAIL", T0, T0 + timedelta(hours=6))
    assert make_event(EventType.NODE_QUARANTINED, q, T0, 1).owner is None
    mine = replace(q, owner="bob", owner_uid=1002)
    assert make_event(EventType.NODE_QUARANTINED, mine, T0, 1).owner == Owner(1002, "bob")
    assert make_event(EventType.TEST_PING, PingFacts("ci", "root"), T0, 1).owner is None


# --- the body ------------------------------------------------------------------------------


def test_run_finished_body_field_by_field() -> None:
    body = _body(EventType.RUN_FINISHED, FINISHED)
    best = {
        "concurrency": 32,
        "valid": True,
        "completed": 320,
        "num_prompts": 320,
        "total_token_throughput": 12345.5,
        "output_throughput": 6000.25,
        "ttft_ms_median": 120.0,
        "tpot_ms_median": 12.5,
        "problem": None,
    }
    assert body == {
        "schema": "llmd-supervisor.event/1",
        "type": "run.finished",
        "id": "evt_ifkrqdar5cyokhisfzcmftq4iy",
        "timestamp": "2025-06-01T12:00:00.000Z",
        "trimmed": [],
        "data": {
            "run": {
                "id": "r-0001",
                "name": "demo",
                "owner": "alice",
                "owner_uid": 1001,
                "cluster": "dev",
                "spec": {"name": "demo.toml", "sha256": SHA},
            },
            "state": "succeeded",
            "attempt": 1,
            "slurm": {
                "job_id": "4242",
                "state": "COMPLETED",
                "exit_code": "0:0",
                "nodes": ["n1", "n2"],
            },
            "outcome": "succeeded",
            "cause": None,
            "reason": "State=COMPLETED ExitCode=0:0, marker rc=0",
            "evidence": ["sacct: COMPLETED 0:0 (2 reads agree)", "marker rc=0 rank 1"],
            "timing": {
                "submitted_at": "2025-06-01T12:00:00.000Z",
                "started_at": "2025-06-01T12:00:30.000Z",
                "finished_at": "2025-06-01T13:00:30.000Z",
                "queued_s": 30.0,
                "ran_s": 3600.0,
            },
            "gpu_hours": {"useful": 8.0, "lost": 0.0},
            "best_point": best,
            "point": None,
            "points": [{**best, "concurrency": 4, "total_token_throughput": 100.0}, best],
            "links": {
                "archive": "/var/lib/llmd-supervisor/archive/r-0001",
                "report": None,
                "dashboard": None,
            },
        },
    }


def test_body_is_canonical_json() -> None:
    raw = encode(make_event(EventType.RUN_FINISHED, FINISHED, T0, 7))
    assert raw.startswith(b'{"data":{"attempt":1,"best_point":{"completed":320,')
    again = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert raw == again.encode("utf-8")
    assert raw == encode(make_event(EventType.RUN_FINISHED, FINISHED, T0, 7))  # deterministic


# Pinned before the body was typed (TypedDicts): the bytes of a fully populated run event and
# campaign event. Receivers verify signatures over these bytes; they must not change.
_RUN_BYTES = (
    b'{"data":{"attempt":2,"best_point":{"completed":320,"concurrency":32,"num_prompts":32'
    b'0,"output_throughput":6000.25,"problem":null,"total_token_throughput":12345.5,"tpot_'
    b'ms_median":12.5,"ttft_ms_median":120.0,"valid":true},"cause":"benchmark","evidence":'
    b'["sacct: COMPLETED 0:0 (2 reads agree)","marker rc=0 rank 1"],"gpu_hours":{"lost":0.'
    b'0,"useful":8.0},"links":{"archive":"/srv/archive/r-0001","dashboard":"https://dash/r'
    b'-0001","report":"/srv/report.html"},"outcome":"failed","point":{"completed":100,"con'
    b'currency":64,"num_prompts":320,"output_throughput":6000.25,"problem":"100 of 320 com'
    b'pleted","total_token_throughput":12345.5,"tpot_ms_median":12.5,"ttft_ms_median":120.'
    b'0,"valid":false},"points":[{"completed":320,"concurrency":4,"num_prompts":320,"outpu'
    b't_throughput":6000.25,"problem":null,"total_token_throughput":100.0,"tpot_ms_median"'
    b':12.5,"ttft_ms_median":120.0,"valid":true},{"completed":320,"concurrency":32,"num_pr'
    b'ompts":320,"output_throughput":6000.25,"problem":null,"total_token_throughput":12345'
    b'.5,"tpot_ms_median":12.5,"ttft_ms_median":120.0,"valid":true}],"reason":"State=COMPL'
    b'ETED ExitCode=0:0, marker rc=0","run":{"cluster":"dev","id":"r-0001","name":"demo","'
    b'owner":"alice","owner_uid":1001,"spec":{"name":"demo.toml","sha256":"abababababababa'
    b'babababababababababababababababababababababababab"}},"slurm":{"exit_code":"0:0","job'
    b'_id":"4242","nodes":["n1","n2"],"state":"COMPLETED"},"state":"failed","timing":{"fin'
    b'ished_at":"2025-06-01T13:00:30.000Z","queued_s":30.0,"ran_s":3600.0,"started_at":"20'
    b'25-06-01T12:00:30.000Z","submitted_at":"2025-06-01T12:00:00.000Z"}},"id":"evt_ifkrqd'
    b'ar5cyokhisfzcmftq4iy","schema":"llmd-supervisor.event/1","timestamp":"2025-06-01T12:'
    b'00:00.000Z","trimmed":[],"type":"run.finished"}'
)
_CAMPAIGN_BYTES = (
    b'{"data":{"best_point":{"completed":320,"concurrency":32,"num_prompts":320,"output_th'
    b'roughput":6000.25,"problem":null,"total_token_throughput":12345.5,"tpot_ms_median":1'
    b'2.5,"ttft_ms_median":120.0,"valid":true},"best_point_of":{"recipe":"r-c","run":"r-0'
    b'007","topology":"2P+1D/2x1w/8gpn"},"campaign":{"cluster":"dev","id":"camp-1","'
    b'name":"sweep","owner":"alice","owner_uid":1001},"gpu_hours":{"lost":2.25,"useful":16'
    b'.5},"links":{"archive":"/srv/archive","dashboard":"https://dash/camp-1","report":"/s'
    b'rv/c.html"},"outcome":"finished","points":{"blocked":1,"failed":1,"pending":1,"runni'
    b'ng":1,"total":6,"verified":2},"problems":[{"concurrency":8,"reason":"oom","recipe":"'
    b'r-a","state":"failed"},{"concurrency":16,"reason":"r-a failed","recipe":"r-b","state'
    b'":"blocked"}],"reason":"every point settled"},"id":"evt_bk7rb6oxr4hwobnzl3uxcvyoyu",'
    b'"schema":"llmd-supervisor.event/1","timestamp":"2025-06-01T12:00:00.000Z","trimmed":'
    b'[],"type":"campaign.finished"}'
)


def test_fully_populated_bodies_are_byte_for_byte_pinned() -> None:
    run = replace(
        FINISHED,
        state="failed",
        attempt=2,
        outcome="failed",
        cause="benchmark",
        point=replace(
            BEST, concurrency=64, valid=False, completed=100, problem="100 of 320 completed"
        ),
        links=Links(
            archive="/srv/archive/r-0001",
            report="/srv/report.html",
            dashboard="https://dash/r-0001",
        ),
    )
    campaign = CampaignFacts(
        id="camp-1",
        name="sweep",
        owner="alice",
        owner_uid=1001,
        cluster="dev",
        points=PointCounts(total=6, verified=2, running=1, pending=1, failed=1, blocked=1),
        outcome="finished",
        reason="every point settled",
        gpu_hours_useful=16.5,
        gpu_hours_lost=2.25,
        best=BEST,
        best_of=BestOf(run="r-0007", recipe="r-c", topology="2P+1D/2x1w/8gpn"),
        problems=(
            CampaignProblem("r-a", 8, "failed", "oom"),
            CampaignProblem("r-b", 16, "blocked", "r-a failed"),
        ),
        links=Links(archive="/srv/archive", report="/srv/c.html", dashboard="https://dash/camp-1"),
    )
    assert encode(make_event(EventType.RUN_FINISHED, run, T0, 7)) == _RUN_BYTES
    assert encode(make_event(EventType.CAMPAIGN_FINISHED, campaign, T0, 3)) == _CAMPAIGN_BYTES


def test_point_finished_carries_the_point() -> None:
    facts = replace(FINISHED, state="running", outcome=None, reason="", point=BEST)
    body = _body(EventType.RUN_POINT_FINISHED, facts, "1:32")
    data = body["data"]
    assert isinstance(data, dict)
    assert data["point"] == data["best_point"]
    assert body["id"] == "evt_dte5jxpm4eyxuphs4fslcdqhmn"


def test_non_finite_numbers_are_null_and_times_are_utc() -> None:
    plus2 = timezone(timedelta(hours=2))
    facts = replace(
        FINISHED,
        gpu_hours_useful=float("nan"),
        gpu_hours_lost=float("inf"),
        best=replace(BEST, ttft_ms_median=float("-inf")),
        points=(),
        timing=Timing(submitted_at=datetime(2025, 6, 1, 14, 0, tzinfo=plus2)),
    )
    data = _body(EventType.RUN_FINISHED, facts)["data"]
    assert isinstance(data, dict)
    assert data["gpu_hours"] == {"useful": None, "lost": None}
    assert data["best_point"]["ttft_ms_median"] is None
    assert data["timing"]["submitted_at"] == "2025-06-01T12:00:00.000Z"
    assert data["timing"]["queued_s"] is None
    with pytest.raises(ValueError, match="no time zone"):
        iso(datetime(2025, 6, 1))


def test_hostile_text_is_escaped_and_the_body_is_valid_utf8() -> None:
    hostile = replace(
        RUN,
        name="x\x1b[31mred\x07\n\ud800\u202e",
        owner='"><script>alert(1)</script>',
    )
    facts = replace(
        FINISHED,
        run=hostile,
        reason="rank 1\r\nSet-Cookie: a=b",
        evidence=("\x00nul",),
        slurm=SlurmFacts(nodes=("n1\x1b]0;title\x07",)),
    )
    raw = encode(make_event(EventType.RUN_FINISHED, facts, T0, 7))
    raw.decode("utf-8")  # strict: no lone surrogate reached the bytes
    data = json.loads(raw)["data"]
    assert data["run"]["name"] == "x\\x1b[31mred\\x07\\n\\ud800\\u202e"
    assert data["run"]["owner"] == '"><script>alert(1)</script>'  # JSON-quoted, kept as text
    assert data["reason"] == "rank 1\\r\\nSet-Cookie: a=b"
    assert data["evidence"] == ["\\x00nul"]
    assert data["slurm"]["nodes"] == ["n1\\x1b]0;title\\x07"]


def test_long_texts_are_bounded_when_built() -> None:
    facts = replace(FINISHED, reason="r" * 5000, evidence=tuple(f"e{i}" for i in range(100)))
    data = _body(EventType.RUN_FINISHED, facts)["data"]
    assert isinstance(data, dict)
    assert len(data["reason"]) == 1024 and data["reason"].endswith("...")
    assert data["evidence"] == [f"e{i}" for i in range(32)]


# --- the 20 kB cap -----------------------------------------------------------------------


def _points(n: int) -> tuple[PointFacts, ...]:
    return tuple(replace(BEST, concurrency=c + 1, problem=None) for c in range(n))


def test_per_point_detail_is_cut_first() -> None:
    facts = replace(FINISHED, points=_points(400), point=BEST)
    full = json.dumps(json.loads(encode(facts_event(facts), max_bytes=10**7)))
    assert len(full) > MAX_BODY_BYTES
    raw = encode(facts_event(facts))
    assert len(raw) <= MAX_BODY_BYTES
    body = json.loads(raw)
    assert body["trimmed"] == ["points"]
    # halved until it fits (400, 200, 100, 50): the first points by concurrency
    assert [p["concurrency"] for p in body["data"]["points"]] == list(range(1, 51))
    assert body["data"]["best_point"]["concurrency"] == 32  # the headline stays
    assert body["data"]["reason"] == FINISHED.reason  # texts untouched


def facts_event(facts: RunFacts) -> Event:
    return make_event(EventType.RUN_FINISHED, facts, T0, 7)


def test_texts_are_cut_when_dropping_points_is_not_enough() -> None:
    # 32 evidence lines of 512 three-byte characters: about 49 kB of text
    facts = replace(FINISHED, points=_points(10), evidence=("€" * 600,) * 32)
    body = json.loads(encode(facts_event(facts)))
    assert body["trimmed"] == ["points", "text"]
    # cut to 256 characters is still 24.6 kB of evidence; to 64 it fits
    assert body["data"]["evidence"] == ["€" * 61 + "..."] * 32
    assert body["data"]["run"]["spec"]["sha256"] == SHA  # 64 characters: not cut
    assert len(encode(facts_event(facts))) <= MAX_BODY_BYTES


def test_lists_are_cut_when_texts_are_not_enough() -> None:
    # 3000 nodes of 55 characters (165 kB): no text is over 64 characters
    nodes = tuple(f"gpu-node-{i:05d}-" + "x" * 40 for i in range(3000))
    facts = replace(FINISHED, points=(), slurm=SlurmFacts(job_id="1", nodes=nodes))
    raw = encode(facts_event(facts))
    body = json.loads(raw)
    assert body["trimmed"] == ["lists"]  # no points to drop, no text cut
    assert body["data"]["slurm"]["nodes"] == list(nodes[:16])
    assert len(raw) <= MAX_BODY_BYTES
    longer = tuple(n + "y" * 20 for n in nodes)  # 75 characters each
    facts = replace(facts, slurm=SlurmFacts(job_id="1", nodes=longer))
    body = json.loads(encode(facts_event(facts)))
    assert body["trimmed"] == ["text", "lists"]
    assert body["data"]["slurm"]["nodes"] == [n[:61] + "..." for n in longer[:16]]


def test_only_identifiers_are_left_at_the_last_step() -> None:
    raw = encode(facts_event(FINISHED), max_bytes=400)
    assert len(raw) <= 400
    body = json.loads(raw)
    assert body["trimmed"] == ["points", "data"]  # no identifier had to be cut
    assert body["data"] == {
        "run": {"id": "r-0001", "name": "demo"},
        "state": "succeeded",
        "outcome": "succeeded",
    }
    assert body["id"] == "evt_ifkrqdar5cyokhisfzcmftq4iy"
    with pytest.raises(ValueError, match="cannot hold even"):
        encode(facts_event(FINISHED), max_bytes=100)
    long_id = replace(FINISHED, run=replace(RUN, id="r" * 300))
    body = json.loads(encode(facts_event(long_id), max_bytes=400))
    assert body["trimmed"] == ["points", "text", "data"]
    assert body["data"]["run"]["id"] == "r" * 61 + "..."


def test_campaign_problems_are_its_per_point_detail() -> None:
    problems = tuple(
        CampaignProblem("f" * 64, c, "failed", f"benchmark c={c}: 0 of 320 requests completed")
        for c in range(300)
    )
    facts = CampaignFacts(
        id="camp-1",
        name="sweep",
        owner="alice",
        owner_uid=1001,
        cluster="dev",
        points=PointCounts(total=300, failed=300),
        problems=problems,
    )
    body = json.loads(encode(make_event(EventType.CAMPAIGN_PROGRESS, facts, T0, 3)))
    assert body["trimmed"] == ["points"]
    assert [p["concurrency"] for p in body["data"]["problems"]] == list(range(75))  # halved
    assert body["data"]["points"] == {
        "total": 300,
        "verified": 0,
        "running": 0,
        "pending": 0,
        "failed": 300,
        "blocked": 0,
    }


def test_quarantine_and_ping_bodies() -> None:
    q = QuarantineFacts(
        "dev", "n3", None, None, 2, "NODE_FAIL on n3", T0, T0 + timedelta(hours=6), "r-0001"
    )
    assert _body(EventType.NODE_QUARANTINED, q)["data"] == {
        "cluster": "dev",
        "node": "n3",
        "owner": None,
        "owner_uid": None,
        "scope": "everyone",
        "failures": 2,
        "reason": "NODE_FAIL on n3",
        "since": "2025-06-01T12:00:00.000Z",
        "until": "2025-06-01T18:00:00.000Z",
        "run": "r-0001",
    }
    ping = _body(EventType.TEST_PING, PingFacts("ci", "root"), 1)
    assert ping["data"] == {"destination": "ci", "requested_by": "root"}
    assert ping["schema"] == SCHEMA


# every code point, lone surrogates and controls included
_TEXT = st.text(st.characters(exclude_categories=()), max_size=3000)


@settings(max_examples=40, deadline=None)
@given(
    name=_TEXT,
    reason=_TEXT,
    evidence=st.lists(_TEXT, max_size=40),
    nodes=st.lists(st.text(max_size=80), max_size=400),
    npoints=st.integers(0, 300),
    problem=_TEXT,
)
def test_any_run_encodes_to_valid_json_under_the_cap(
    name: str, reason: str, evidence: list[str], nodes: list[str], npoints: int, problem: str
) -> None:
    facts = replace(
        FINISHED,
        run=replace(RUN, name=name),
        reason=reason,
        evidence=tuple(evidence),
        slurm=SlurmFacts(nodes=tuple(nodes)),
        points=tuple(replace(p, problem=problem) for p in _points(npoints)),
    )
    raw = encode(facts_event(facts))
    assert len(raw) <= MAX_BODY_BYTES
    body = json.loads(raw.decode("utf-8"))
    assert body["schema"] == SCHEMA and body["type"] == "run.finished"
    assert body["id"] == "evt_ifkrqdar5cyokhisfzcmftq4iy"
    assert set(body["trimmed"]) <= {"points", "text", "lists", "data"}


# --- campaign.progress throttle --------------------------------------------------------------


@pytest.mark.parametrize(
    ("last", "now", "gate"),
    [
        (None, T0, ProgressGate(emit=True, retry_at=None)),
        (T0, T0, ProgressGate(emit=False, retry_at=T0 + timedelta(minutes=1))),
        (T0, T0 + timedelta(seconds=30), ProgressGate(False, T0 + timedelta(minutes=1))),
        (T0, T0 + timedelta(seconds=59.999), ProgressGate(False, T0 + timedelta(minutes=1))),
        (T0, T0 + timedelta(seconds=60), ProgressGate(emit=True, retry_at=None)),
        (T0, T0 + timedelta(hours=3), ProgressGate(emit=True, retry_at=None)),
        # the clock went back: not silenced for as long as the jump
        (T0, T0 - timedelta(hours=2), ProgressGate(emit=True, retry_at=None)),
    ],
)
def test_progress_gate(last: datetime | None, now: datetime, gate: ProgressGate) -> None:
    assert progress_gate(last, now) == gate
