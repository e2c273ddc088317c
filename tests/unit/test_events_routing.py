"""Destinations in the daemon config and the routing rule (`core.events.routing`): every
refusal names its key and the fix; a spec names destinations, never URLs."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from datetime import timedelta

import pytest

from llmd_supervisor.core.events.model import (
    CampaignFacts,
    Event,
    EventType,
    Owner,
    PingFacts,
    PointCounts,
    QuarantineFacts,
    make_event,
)
from llmd_supervisor.core.events.routing import (
    Destination,
    DestinationKind,
    EventsConfig,
    check_named,
    parse_events,
    parse_named,
    routes,
    shown_url,
)
from llmd_supervisor.errors import ConfigError, ConfigErrors, SpecError
from tests.events_helpers import FINISHED, RUN, T0

ISSUE_EXAMPLE = """
[[events.destination]]
name = "ci"
kind = "webhook"            # webhook | slack | mail
url = "https://ci.example/hooks/llmd"
secret_file = "/etc/llmd-supervisor/ci.whsec"   # webhook only
types = ["run.finished", "campaign.finished"]
owners = []                 # empty: every owner's runs

[[events.destination]]
name = "team-slack"
kind = "slack"
url = "https://hooks.slack.com/services/T0/B0/SECRETTOKEN"
owners = ["alice", 1002]

[[events.destination]]
name = "oncall"
kind = "mail"
to = ["oncall@example.org", "b.smith+llmd@example.org"]
from = "llmd@login1.example.org"
types = ["node.quarantined"]

[[events.destination]]
name = "local"
kind = "webhook"
url = "http://127.0.0.1:8099/hook"
secret_file = "/etc/llmd-supervisor/local.whsec"
opt_in = true
"""


def _events(text: str) -> EventsConfig:
    data = tomllib.loads(text)
    events = data.get("events", {})
    assert isinstance(events, dict)
    return parse_events(events)


CONFIG = _events(ISSUE_EXAMPLE)


def test_the_issue_s_config_shape() -> None:
    ci, team, oncall, local = CONFIG.destinations
    assert ci == Destination(
        name="ci",
        kind=DestinationKind.WEBHOOK,
        url="https://ci.example/hooks/llmd",
        secret_file="/etc/llmd-supervisor/ci.whsec",
        types=frozenset({EventType.RUN_FINISHED, EventType.CAMPAIGN_FINISHED}),
    )
    assert team.kind is DestinationKind.SLACK and team.owners == ("alice", 1002)
    assert team.types == frozenset() and team.secret_file is None
    assert oncall.to == ("oncall@example.org", "b.smith+llmd@example.org")
    assert oncall.sender == "llmd@login1.example.org" and oncall.url is None
    assert local.url == "http://127.0.0.1:8099/hook" and local.opt_in
    assert parse_events({}) == EventsConfig(())
    assert CONFIG.destination("oncall") is oncall
    with pytest.raises(ConfigError, match="no destination of that name \\(ci, team-slack"):
        CONFIG.destination("nope")


def test_a_destination_never_shows_its_url() -> None:
    team = CONFIG.destination("team-slack")
    assert "SECRETTOKEN" not in repr(team)
    assert "SECRETTOKEN" not in repr(CONFIG)


def _problems(text: str) -> list[tuple[str, str]]:
    with pytest.raises(ConfigErrors) as caught:
        _events(text)
    return [(p.key, p.hint) for p in caught.value.problems]


def _one(body: str) -> str:
    return "[[events.destination]]\n" + body


WEBHOOK = 'name = "ci"\nkind = "webhook"\nsecret_file = "/etc/x.whsec"\n'


@pytest.mark.parametrize(
    ("text", "key", "hint"),
    [
        ('[events]\nsink = "x"\n', "events.sink", "unknown key; allowed here: destination"),
        ('[events]\ndestination = "x"\n', "events.destination", "use [[events.destination]]"),
        ("[events]\ndestination = [1]\n", "events.destination[0]", "each entry must be a table"),
        (_one('kind = "mail"\nto = ["a@b.org"]\n'), "events.destination[0].name", "use 1-64 of"),
        (
            _one('name = "my dest"\nkind = "mail"\nto = ["a@b.org"]\n'),
            "events.destination[0].name",
            "use 1-64 of letters",
        ),
        (_one('name = "x"\n'), "events.destination[0].kind", "use webhook, slack or mail"),
        (_one('name = "x"\nkind = "discord"\n'), "events.destination[0].kind", "use webhook"),
        (
            _one('name = "ci"\nkind = "webhook"\nurl = "https://h/x"\n'),
            "events.destination[0].secret_file",
            "a webhook destination needs the absolute path of a file readable only by",
        ),
        (
            _one(WEBHOOK.replace("/etc/x.whsec", "x.whsec") + 'url = "https://h/x"\n'),
            "events.destination[0].secret_file",
            "needs the absolute path",
        ),
        (_one(WEBHOOK), "events.destination[0].url", "a webhook destination needs its url"),
        (
            _one(WEBHOOK + 'url = "http://ci.example/hook"\n'),
            "events.destination[0].url",
            "use https (plain http only to 127.0.0.1, ::1 or localhost)",
        ),
        (
            _one(WEBHOOK + 'url = "ftp://ci.example/hook"\n'),
            "events.destination[0].url",
            "use an https URL",
        ),
        (
            _one(WEBHOOK + 'url = "https://user:pw@ci.example/hook"\n'),
            "events.destination[0].url",
            "a URL with a user or password is refused",
        ),
        (
            _one(WEBHOOK + 'url = "https://ci.example/hook#x"\n'),
            "events.destination[0].url",
            "remove the #fragment",
        ),
        (
            _one(WEBHOOK + 'url = "https://ci.example/a hook"\n'),
            "events.destination[0].url",
            "a URL has no spaces or control characters",
        ),
        (
            _one(WEBHOOK + 'url = "https://ci.example:99999/hook"\n'),
            "events.destination[0].url",
            "not a URL",
        ),
        (
            _one('name = "s"\nkind = "slack"\nurl = "https://h/x"\nsecret_file = "/x"\n'),
            "events.destination[0].secret_file",
            "not a key of a slack destination; allowed: name, kind, types, owners, opt_in, url",
        ),
        (_one('name = "m"\nkind = "mail"\n'), "events.destination[0].to", "needs its recipients"),
        (_one('name = "m"\nkind = "mail"\nto = []\n'), "events.destination[0].to", "recipients"),
        (
            _one('name = "m"\nkind = "mail"\nto = ["not an address"]\n'),
            "events.destination[0].to",
            "use a plain address like oncall@example.org",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b.org, c@d.org"]\n'),
            "events.destination[0].to",
            "use a plain address",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b..org"]\n'),
            "events.destination[0].to",
            "use a plain address",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["<a@b.org>"]\n'),
            "events.destination[0].to",
            "use a plain address",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b.org"]\nfrom = "x\\nBcc: v@e.org"\n'),
            "events.destination[0].from",
            "use a plain address",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b.org"]\nurl = "https://h/x"\n'),
            "events.destination[0].url",
            "not a key of a mail destination",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b.org"]\ntypes = ["run.done"]\n'),
            "events.destination[0].types",
            "not an event type; use one of: run.submitted, run.started",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b.org"]\ntypes = ["test.ping"]\n'),
            "events.destination[0].types",
            "test.ping is sent only by `events test DEST`",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b.org"]\ntypes = "run.finished"\n'),
            "events.destination[0].types",
            "use a list of event types",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b.org"]\nowners = [true]\n'),
            "events.destination[0].owners",
            "use a list of user names and uids",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b.org"]\nowners = [-1]\n'),
            "events.destination[0].owners",
            "a uid is an integer from 0 to 4294967294",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b.org"]\nowners = ["al ice"]\n'),
            "events.destination[0].owners",
            "not a user name",
        ),
        (
            _one('name = "m"\nkind = "mail"\nto = ["a@b.org"]\nopt_in = "yes"\n'),
            "events.destination[0].opt_in",
            "use true or false",
        ),
    ],
)
def test_each_refusal_names_the_key_and_the_fix(text: str, key: str, hint: str) -> None:
    problems = _problems(text)
    assert any(k == key and hint in h for k, h in problems), problems


def test_every_problem_is_reported_at_once() -> None:
    text = (
        _one('name = "a"\nkind = "mail"\nto = ["x"]\nowners = [-1]\n')
        + _one('name = "a"\nkind = "slack"\nurl = "http://hooks.slack.com/services/T/B/TOKEN"\n')
        + _one('name = "b"\nkind = "webhook"\nurl = "https://h/x"\nsecret_file = "/x"\n')
        + _one('name = "b"\nkind = "mail"\nto = ["b@c.org"]\n')
    )
    with pytest.raises(ConfigErrors) as caught:
        _events(text)
    assert [p.key for p in caught.value.problems] == [
        "events.destination[0].owners",
        "events.destination[0].to",
        "events.destination[1].url",
        "events.destination[3].name",  # "b" again (the second "a" was itself refused)
    ]
    assert str(caught.value).startswith("The configuration has 4 problems: (1) Configuration")
    assert "TOKEN" not in str(caught.value)  # a Slack URL is a credential
    assert "'http://hooks.slack.com/...'" in str(caught.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.slack.com/services/T0/B0/SECRET", "https://hooks.slack.com/..."),
        ("https://ci.example:8443/hook?token=x", "https://ci.example:8443/..."),
        ("https://ci.example/", "https://ci.example/"),
        ("https://ci.example", "https://ci.example"),
        ("http://[::1]:8099/hook", "http://[::1]:8099/..."),
        ("https://u:secret@h/x", "https://h/..."),
        ("not a url", "(a URL of 9 characters, not shown)"),
        ("https://h:99999/x", "(a URL of 17 characters, not shown)"),
    ],
)
def test_shown_url(url: str, shown: str) -> None:
    assert shown_url(url) == shown


# --- routes -----------------------------------------------------------------------------------


def _run_event(etype: EventType, owner: str = "alice", uid: int = 1001) -> Event:
    facts = replace(FINISHED, run=replace(RUN, owner=owner, owner_uid=uid))
    if etype is EventType.RUN_POINT_FINISHED:
        facts = replace(facts, point=FINISHED.best)
    return make_event(etype, facts, T0, 1)


def _campaign(owner: str, uid: int) -> Event:
    facts = CampaignFacts("c", "sweep", owner, uid, "dev", PointCounts(total=1))
    return make_event(EventType.CAMPAIGN_FINISHED, facts, T0, 1)


def _quarantine(owner: str | None, uid: int | None) -> Event:
    facts = QuarantineFacts("dev", "n1", owner, uid, 1, "NODE_FAIL", T0, T0 + timedelta(hours=1))
    return make_event(EventType.NODE_QUARANTINED, facts, T0, 1)


@pytest.mark.parametrize(
    ("event", "named", "disabled", "expected"),
    [
        # ci: run.finished and campaign.finished of everyone; team-slack: everything of
        # alice and uid 1002; oncall: node.quarantined of everyone; local: opt-in only
        (_run_event(EventType.RUN_FINISHED), (), (), ["ci", "team-slack"]),
        (_run_event(EventType.RUN_FINISHED), ("local",), (), ["ci", "team-slack", "local"]),
        (_run_event(EventType.RUN_FINISHED), ("local",), ("ci",), ["team-slack", "local"]),
        (_run_event(EventType.RUN_STARTED), (), (), ["team-slack"]),
        (_run_event(EventType.RUN_POINT_FINISHED), (), (), ["team-slack"]),
        (_run_event(EventType.RUN_FINISHED, "carol", 1003), (), (), ["ci"]),
        (_run_event(EventType.RUN_FINISHED, "bob", 1002), (), (), ["ci", "team-slack"]),  # uid
        (_run_event(EventType.RUN_SUBMITTED, "carol", 1003), ("local",), (), ["local"]),
        (_campaign("alice", 1001), (), (), ["ci", "team-slack"]),
        (_quarantine(None, None), (), (), ["oncall"]),  # nobody's: no owner-filtered ones
        (_quarantine("alice", 1001), (), (), ["team-slack", "oncall"]),
        (make_event(EventType.TEST_PING, PingFacts("ci", "root"), T0, 1), ("ci",), (), []),
    ],
)
def test_routes(
    event: Event, named: tuple[str, ...], disabled: tuple[str, ...], expected: list[str]
) -> None:
    assert routes(event, CONFIG.destinations, named, disabled) == expected


# --- a spec's side ------------------------------------------------------------------------------


def test_a_spec_names_destinations() -> None:
    assert parse_named(["local", "team-slack", "local"]) == ("local", "team-slack")
    assert parse_named([]) == ()


@pytest.mark.parametrize(
    ("value", "shown", "hint"),
    [
        (
            ["https://evil.example/collect?k=1"],
            "https://evil.example/...",
            "it never carries a URL or an address",
        ),
        (["http://169.254.169.254/latest"], "http://169.254.169.254/...", "never carries a URL"),
        (["me@example.org"], "me@example.org", "never carries a URL or an address"),
        (["hooks.slack.com/services/x"], "hooks.slack.com/services/x", "never carries a URL"),
        ([""], "", "a destination name is"),
        (["a b"], "a b", "a destination name is"),
        ([1], 1, "a destination name is"),
        ("local", "local", "use a list of destination names"),
    ],
)
def test_a_spec_never_carries_a_url(value: object, shown: object, hint: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_named(value)
    assert caught.value.field == "notify.destinations"
    assert caught.value.value == shown
    assert hint in caught.value.hint


def test_check_named() -> None:
    alice, carol = Owner(1001, "alice"), Owner(1003, "carol")
    check_named(("local", "team-slack", "ci"), alice, CONFIG)
    check_named(("local",), carol, CONFIG)
    with pytest.raises(SpecError, match="no destination of that name \\(ci, team-slack, oncall"):
        check_named(("nope",), alice, CONFIG)
    with pytest.raises(
        SpecError, match="takes the runs of alice, 1002 only, not of carol; ask the operator"
    ):
        check_named(("team-slack",), carol, CONFIG)
