"""The outbox (issue 3.6): which transition makes which event (`core.events.outbox`), and the
journal writing the event and its deliveries in the transition's own transaction
(`adapters.outbox.rows`, `adapters.outbox.store`), against real SQLite files."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
import pytest_asyncio

from llmd_supervisor.adapters.journal.store import Journal, RunMeta
from llmd_supervisor.adapters.outbox.store import Outbox
from llmd_supervisor.core.config import effective, load_config, to_toml
from llmd_supervisor.core.events.model import EventType, Links, RunRef, event_id
from llmd_supervisor.core.events.outbox import (
    DeliveryStatus,
    Outgoing,
    run_event_type,
    run_outgoing,
)
from llmd_supervisor.core.events.routing import Destination, DestinationKind
from llmd_supervisor.core.run.lifecycle import (
    Archived,
    CancelRequested,
    Event,
    LeftQueue,
    Requeued,
    Run,
    RunState,
    Started,
    Submit,
    Submitted,
    Verified,
    WatchersStopped,
    adopted_run,
    new_run,
    step,
)
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.errors import ConfigErrors, JournalConflict
from tests.postgres import JournalTarget

T0 = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)
REF = RunRef("r-1", "demo", "alice", 1000, "dev", "demo", "ab" * 32)
LINKS = Links(archive="/var/lib/llmd/archive/r-1")
ALL = Destination("all", DestinationKind.WEBHOOK, url="http://127.0.0.1:1/", secret_file="/s")
FINISHED_ONLY = replace(ALL, name="ci", types=frozenset({EventType.RUN_FINISHED}))
BOB_ONLY = replace(ALL, name="bob", owners=("bob",))


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def walk(*events: Event) -> list[Run]:
    """Every record of a run from `new_run` through `events`."""
    runs = [new_run("r-1", "llmd-r-1", T0)]
    for i, e in enumerate(events):
        runs.append(step(runs[-1], e, at(i + 1))[0])
    return runs


SUCCESS = (
    Submit(),
    Submitted("4242"),
    Started(("n1", "n2")),
    LeftQueue(),
    WatchersStopped(),
    Verified(Outcome.SUCCEEDED, "State=COMPLETED ExitCode=0:0"),
    Archived(),
)


# --- which transition makes which event -------------------------------------------------

TYPES: list[tuple[str, tuple[Event, ...], list[EventType | None]]] = [
    (
        "a run that succeeds",
        SUCCESS,
        [
            None,  # accepted -> submitting
            EventType.RUN_SUBMITTED,
            EventType.RUN_STARTED,
            None,  # finishing
            None,  # verifying
            None,  # archiving: the verdict is known, not declared
            EventType.RUN_FINISHED,
        ],
    ),
    (
        "a requeue starts the run again",
        (Submit(), Submitted("7"), Started(("n1",)), Requeued(), Started(("n2",))),
        [None, EventType.RUN_SUBMITTED, EventType.RUN_STARTED, None, EventType.RUN_STARTED],
    ),
    ("cancelled before submission", (CancelRequested(),), [EventType.RUN_FINISHED]),
    (
        "a cancel request alone is no transition",
        (Submit(), Submitted("7"), CancelRequested()),
        [None, EventType.RUN_SUBMITTED, None],
    ),
]


@pytest.mark.parametrize(("name", "events", "expected"), TYPES, ids=[t[0] for t in TYPES])
def test_each_transition_makes_its_event(
    name: str, events: tuple[Event, ...], expected: list[EventType | None]
) -> None:
    runs = walk(*events)
    got = [run_event_type(b, a) for b, a in itertools.pairwise(runs)]
    assert got == expected


def test_a_new_run_makes_no_event_and_an_adopted_job_is_submitted() -> None:
    assert run_event_type(None, new_run("r-1", "llmd-r-1", T0)) is None
    adopted = adopted_run("r-1", "adopted-r-1", "99", T0)
    assert run_event_type(None, adopted) is EventType.RUN_SUBMITTED


def test_the_id_is_the_transition_s_index_and_routing_picks_destinations() -> None:
    runs = walk(*SUCCESS)
    dests = (ALL, FINISHED_ONLY, BOB_ONLY)
    (submitted,) = run_outgoing(runs[1], runs[2], REF, LINKS, dests)
    assert submitted.id == event_id(EventType.RUN_SUBMITTED, "run/r-1", 2)
    assert submitted.destinations == ("all",)  # not ci (types), not bob (owners)
    (finished,) = run_outgoing(runs[-2], runs[-1], REF, LINKS, dests)
    assert finished.id == event_id(EventType.RUN_FINISHED, "run/r-1", 7)
    assert finished.destinations == ("all", "ci")
    assert b'"outcome":"succeeded"' in finished.body
    assert b'"archive":"/var/lib/llmd/archive/r-1"' in finished.body
    # The same transition gives the same event, byte for byte.
    assert run_outgoing(runs[-2], runs[-1], REF, LINKS, dests) == (finished,)
    assert run_outgoing(runs[-2], runs[-1], REF, LINKS, ()) == ()
    assert run_outgoing(runs[-2], runs[-1], REF, LINKS, (BOB_ONLY,)) == ()


# --- the journal: same transaction, never twice ------------------------------------------


def meta() -> RunMeta:
    return RunMeta(
        owner_uid=1000,
        cluster="dev",
        spec_toml='name = "demo"\n',
        script="#!/bin/bash\n",
        log_dir="/shared/logs/r",
        archive_dir="/var/lib/llmd/archive/r-1",
        created_at=T0,
    )


@pytest_asyncio.fixture
async def journal(journal_target: JournalTarget) -> AsyncIterator[Journal]:
    """A new journal on each backend (tests/postgres.py)."""
    async with await journal_target.open() as j:
        yield j


async def rows(journal: Journal, sql: str) -> list[tuple[object, ...]]:
    return await journal.read("test", lambda db: [tuple(r) for r in db.execute(sql).fetchall()])


async def journaled_until(journal: Journal, runs: list[Run], last: int) -> list[Outgoing]:
    """Insert runs[0] and save each next record up to runs[last], with its events."""
    await journal.insert_run(runs[0], meta())
    made: list[Outgoing] = []
    for before, after in itertools.pairwise(runs[: last + 1]):
        out = run_outgoing(before, after, REF, LINKS, (ALL, FINISHED_ONLY))
        await journal.save(after, expected=before.state, outgoing=out)
        made += out
    return made


@pytest.mark.asyncio
async def test_events_and_deliveries_commit_with_the_transition(journal: Journal) -> None:
    runs = walk(*SUCCESS)
    made = await journaled_until(journal, runs, len(runs) - 1)
    assert [o.type for o in made] == [
        EventType.RUN_SUBMITTED,
        EventType.RUN_STARTED,
        EventType.RUN_FINISHED,
    ]
    assert await rows(journal, "SELECT event_id, type FROM outbox_events ORDER BY created_at") == [
        (o.id, o.type.value) for o in made
    ]
    got = await rows(
        journal,
        "SELECT event_id, destination, status, attempts FROM deliveries "
        "ORDER BY event_id, destination",
    )
    expected = sorted(
        [(o.id, d, "queued", 0) for o in made for d in o.destinations], key=lambda r: (r[0], r[1])
    )
    assert got == expected
    stored = await Outbox(journal).event(made[-1].id)
    assert stored is not None and stored.body == made[-1].body
    assert [d.destination for d in stored.deliveries] == ["all", "ci"]


@pytest.mark.asyncio
async def test_a_refused_save_journals_no_event(journal: Journal) -> None:
    runs = walk(*SUCCESS)
    await journal.insert_run(runs[0], meta())
    await journal.save(runs[1], expected=RunState.ACCEPTED)
    out = run_outgoing(runs[1], runs[2], REF, LINKS, (ALL,))
    assert out
    with pytest.raises(JournalConflict):  # the compare-and-set fails: nothing commits
        await journal.save(runs[2], expected=RunState.RUNNING, outgoing=out)
    assert await rows(journal, "SELECT count(*) FROM outbox_events") == [(0,)]
    assert await rows(journal, "SELECT count(*) FROM deliveries") == [(0,)]


@pytest.mark.asyncio
async def test_an_event_recorded_again_is_not_duplicated(journal: Journal) -> None:
    runs = walk(*SUCCESS)
    made = await journaled_until(journal, runs, 2)
    outbox = Outbox(journal)
    # The delivery moves on; the same transition's event journaled again changes nothing.
    await outbox.finish_attempt(
        made[0].id,
        "all",
        status=DeliveryStatus.DELIVERED,
        attempts=1,
        next_at=None,
        error="HTTP 200",
        now=at(3),
    )
    await journal.save(runs[2], expected=RunState.PENDING, outgoing=made)
    assert await rows(journal, "SELECT count(*) FROM outbox_events") == [(1,)]
    assert await rows(journal, "SELECT destination, status, attempts FROM deliveries") == [
        ("all", "delivered", 1)
    ]


@pytest.mark.asyncio
async def test_due_retry_disable_and_replay(journal: Journal) -> None:
    runs = walk(*SUCCESS)
    made = await journaled_until(journal, runs, len(runs) - 1)
    outbox = Outbox(journal)
    due = await outbox.due(at(100))
    assert {(d.event_id, d.destination) for d, _ in due} == {
        (o.id, d) for o in made for d in o.destinations
    }
    assert all(body == next(o.body for o in made if o.id == d.event_id) for d, body in due)
    assert await outbox.next_due() == made[0].at
    first = made[0].id
    await outbox.finish_attempt(
        first,
        "all",
        status=DeliveryStatus.RETRYING,
        attempts=1,
        next_at=at(200),
        error="HTTP 500",
        now=at(100),
    )
    assert first not in {d.event_id for d, _ in await outbox.due(at(150))}
    # 410 Gone: this delivery dead, every other pending one of "all" disabled.
    await outbox.finish_attempt(
        first,
        "all",
        status=DeliveryStatus.DEAD,
        attempts=2,
        next_at=None,
        error="HTTP 410 Gone",
        now=at(200),
        disable=True,
    )
    assert await outbox.disabled() == {"all": "HTTP 410 Gone"}
    listed = await outbox.deliveries(run_id="r-1")
    by = {(d.event_id, d.destination): d.status for d in listed}
    assert by[(first, "all")] is DeliveryStatus.DEAD
    assert by[(made[1].id, "all")] is DeliveryStatus.DISABLED
    assert by[(made[2].id, "ci")] is DeliveryStatus.QUEUED
    assert [d.destination for d in await outbox.deliveries(status=DeliveryStatus.DEAD)] == ["all"]
    assert await outbox.deliveries(run_id="other") == []
    # A new event for a disabled destination is journaled disabled.
    later = replace(made[2], id="evt_later", destinations=("all",))
    await journal.save(runs[-1], expected=RunState.SUCCEEDED, outgoing=[later])
    stored = await outbox.event("evt_later")
    assert stored is not None
    assert [d.status for d in stored.deliveries] == [DeliveryStatus.DISABLED]
    # Replay queues the dead one again (attempts from zero) and enables the destination.
    assert await outbox.replay(first, at(300)) == 1
    assert await outbox.disabled() == {}
    again = await outbox.event(first)
    assert again is not None
    (d,) = again.deliveries
    assert (d.status, d.attempts, d.next_at) == (DeliveryStatus.QUEUED, 0, at(300))
    assert await outbox.replay(first, at(300)) == 0  # nothing dead any more
    assert await outbox.event("evt_none") is None


# --- the daemon config's [[events.destination]] -----------------------------------------

ISSUE_SHAPE = """
[[events.destination]]
name = "ci"
kind = "webhook"
url = "https://ci.example/hooks/llmd"
secret_file = "/etc/llmd-supervisor/ci.whsec"
types = ["run.finished", "campaign.finished"]
owners = []

[[events.destination]]
name = "oncall"
kind = "mail"
to = ["oncall@example.org"]
"""


def test_the_config_takes_destinations_in_the_issue_s_shape() -> None:
    config = load_config(ISSUE_SHAPE)
    ci, oncall = config.events.destinations
    assert (ci.name, ci.kind, ci.url) == (
        "ci",
        DestinationKind.WEBHOOK,
        "https://ci.example/hooks/llmd",
    )
    assert ci.types == {EventType.RUN_FINISHED, EventType.CAMPAIGN_FINISHED}
    assert oncall.to == ("oncall@example.org",)
    # `config show` elides a URL's path (a Slack webhook's is its credential).
    shown = effective(config)["events.destination"]
    assert isinstance(shown, list) and shown[0]["url"] == "https://ci.example/..."
    again = load_config(to_toml(effective(config)))
    assert effective(again) == effective(config)
    assert load_config("").events.destinations == ()


@pytest.mark.parametrize(
    ("text", "key", "hint"),
    [
        (
            '[[events.destination]]\nname = "x"\nkind = "webhook"\nurl = "http://ci.example/"\n'
            'secret_file = "/s"',
            "events.destination[0].url",
            "use https",
        ),
        (
            '[[events.destination]]\nname = "x"\nkind = "webhook"\nurl = "https://ci.example/"',
            "events.destination[0].secret_file",
            "absolute path",
        ),
        ("[events]\ndestinations = []", "events.destinations", "allowed here: destination"),
    ],
)
def test_a_bad_destination_names_its_key_and_the_fix(text: str, key: str, hint: str) -> None:
    with pytest.raises(ConfigErrors) as caught:
        load_config(text)
    (problem,) = caught.value.problems
    assert problem.key == key
    assert hint in str(problem)


def test_slack_and_mail_destinations_get_their_own_payload() -> None:
    runs = walk(*SUCCESS)
    slack = Destination("team", DestinationKind.SLACK, url="https://hooks.slack.com/services/x")
    mail = Destination("oncall", DestinationKind.MAIL, to=("oncall@example.org",))
    (out,) = run_outgoing(runs[-2], runs[-1], REF, LINKS, (ALL, slack, mail), "login1.example")
    assert set(out.payloads) == {"team", "oncall"}  # the webhook sends the body itself
    assert out.id.encode() in out.payloads["team"]
    assert f"Message-ID: <{out.id}@login1.example>".encode() in out.payloads["oncall"]
    assert b"From: llmd-supervisor@login1.example" in out.payloads["oncall"]
    # A host name a Message-ID cannot carry falls back to localhost, never an error.
    (odd,) = run_outgoing(runs[-2], runs[-1], REF, LINKS, (mail,), "-bad-")
    assert f"Message-ID: <{out.id}@localhost>".encode() in odd.payloads["oncall"]


@pytest.mark.asyncio
async def test_a_destination_s_backlog_never_hides_another_s_due_delivery(
    journal: Journal,
) -> None:
    backlog = [
        Outgoing(f"evt_a{i:02d}", EventType.RUN_STARTED, "run/r-1", str(i), at(i), b"{}", ("a",))
        for i in range(20)
    ]
    other = Outgoing("evt_b", EventType.RUN_FINISHED, "run/r-1", "99", at(30), b"{}", ("b",))
    await journal.insert_run(new_run("r-1", "llmd-r-1", T0), meta(), [*backlog, other])
    due = await Outbox(journal).due(at(60), per_destination=8)
    assert [d.event_id for d, _ in due] == [o.id for o in backlog[:8]] + ["evt_b"]
