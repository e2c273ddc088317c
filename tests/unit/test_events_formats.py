"""An event as Slack and mail show it (`core.events.formats`): the content, Slack's limits
(tests/data/slack/SOURCE.md), hostile text, and the mail's headers."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import timedelta

import pytest

from llmd_supervisor.core.events.formats import (
    SLACK_BLOCKS_MAX,
    SLACK_FIELD_MAX,
    SLACK_FIELDS_MAX,
    SLACK_SECTION_MAX,
    SlackBlock,
    SlackText,
    mail_message,
    slack_escape,
    slack_message,
)
from llmd_supervisor.core.events.model import (
    CampaignFacts,
    CampaignProblem,
    EventType,
    PingFacts,
    PointCounts,
    QuarantineFacts,
    SlurmFacts,
    make_event,
)
from tests.events_helpers import BEST, FINISHED, RUN, T0

TITLE = "run demo (r-0001) of alice succeeded: State=COMPLETED ExitCode=0:0, marker rc=0"
BEST_LINE = (
    "c=32: 12,345.5 tok/s total, 6,000.2 tok/s output, TTFT median 120 ms, "
    "TPOT median 12.5 ms, 320/320 requests completed"
)
FOOTER = "event evt_ifkrqdar5cyokhisfzcmftq4iy · run.finished · 2025-06-01T12:00:00.000Z"


def _field(label: str, value: str) -> SlackText:
    return {"type": "mrkdwn", "text": f"*{label}*\n{value}"}


def _section(text: str) -> SlackBlock:
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def test_slack_message_of_a_finished_run() -> None:
    assert slack_message(make_event(EventType.RUN_FINISHED, FINISHED, T0, 7)) == {
        "text": TITLE,
        "unfurl_links": False,
        "unfurl_media": False,
        "blocks": [
            _section(f"*{TITLE}*"),
            {
                "type": "section",
                "fields": [
                    _field("Outcome", "succeeded"),
                    _field("Owner", "alice"),
                    _field("Cluster", "dev"),
                    _field("Spec", "demo.toml (abababababab)"),
                    _field("Slurm job", "4242 COMPLETED 0:0"),
                    _field("Attempt", "1"),
                    _field("Nodes", "2: n1, n2"),
                    _field("GPU-hours", "8.00 useful, 0.00 lost"),
                    _field("Queued / ran", "30 s / 1 h 0 min"),
                ],
            },
            _section("*Reason*\nState=COMPLETED ExitCode=0:0, marker rc=0"),
            _section(f"*Best point*\n{BEST_LINE}"),
            _section("*Evidence*\nsacct: COMPLETED 0:0 (2 reads agree)\nmarker rc=0 rank 1"),
            _section("*Links*\nArchive: /var/lib/llmd-supervisor/archive/r-0001"),
            {"type": "context", "elements": [{"type": "mrkdwn", "text": FOOTER}]},
        ],
    }


def test_slack_message_of_a_finished_point() -> None:
    bad = replace(BEST, concurrency=64, valid=False, problem="0 of 640 requests completed")
    facts = replace(FINISHED, state="running", outcome=None, reason="", point=bad, evidence=())
    message = slack_message(make_event(EventType.RUN_POINT_FINISHED, facts, T0, "1:64"))
    assert message["text"] == "run demo (r-0001) of alice finished benchmark point c=64 (not valid)"
    blocks = message["blocks"]
    assert isinstance(blocks, list)
    assert blocks[1]["fields"][0] == _field("State", "running")
    assert blocks[2] == _section(
        "*Point*\nc=64: 12,345.5 tok/s total, 6,000.2 tok/s output, TTFT median 120 ms, "
        "TPOT median 12.5 ms, 320/320 requests completed (not valid: 0 of 640 requests "
        "completed)"
    )
    assert blocks[3] == _section(f"*Best point*\n{BEST_LINE}")


@pytest.mark.parametrize(
    ("text", "escaped"),
    [
        ("a & b", "a &amp; b"),
        ("<!channel>", "&lt;!channel&gt;"),
        ("<https://evil.example|click here>", "&lt;https://evil.example|click here&gt;"),
        ("<@U024BE7LH>", "&lt;@U024BE7LH&gt;"),
        ("&lt; stays text", "&amp;lt; stays text"),
        ("*bold* _it_ `code`", "*bold* _it_ `code`"),  # formatting has no escape in mrkdwn
        ("plain", "plain"),
    ],
)
def test_slack_escape(text: str, escaped: str) -> None:
    assert slack_escape(text) == escaped


def _texts(value: object) -> list[str]:
    """Every mrkdwn text of a Slack message."""
    if isinstance(value, dict):
        own = [value["text"]] if isinstance(value.get("text"), str) else []
        return own + [t for v in value.values() for t in _texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []


_ENTITY = re.compile(r"&(?!amp;|lt;|gt;)")


def test_hostile_text_cannot_form_links_or_mentions() -> None:
    hostile = replace(
        RUN,
        name="<!channel> <https://evil.example|urgent> & <@U1>",
        owner="<!here>",
        cluster="dev>",
    )
    facts = replace(
        FINISHED,
        run=hostile,
        reason="marker rc=7: <!everyone> \x1b[2J",
        evidence=("<script>alert(1)</script>",),
        slurm=SlurmFacts(nodes=("<n1>",)),
    )
    message = slack_message(make_event(EventType.RUN_FINISHED, facts, T0, 7))
    texts = _texts(message)
    assert texts
    for text in texts:
        assert "<" not in text and ">" not in text
        assert not _ENTITY.search(text)
        assert "\x1b" not in text
    assert "&lt;!channel&gt;" in message["text"]
    assert any("marker rc=7: &lt;!everyone&gt; \\x1b[2J" in t for t in texts)


def test_slack_limits_hold_for_the_largest_facts() -> None:
    facts = replace(
        FINISHED,
        run=replace(RUN, name="&" * 5000, owner="<" * 5000),
        reason="&<>" * 5000,
        evidence=tuple("&" * 600 for _ in range(40)),
        slurm=SlurmFacts(
            job_id="&" * 500, state=">" * 500, nodes=tuple("<" * 70 for _ in range(99))
        ),
        best=replace(BEST, problem="&" * 5000, valid=False),
    )
    message = slack_message(make_event(EventType.RUN_FINISHED, facts, T0, 7))
    blocks = message["blocks"]
    assert isinstance(blocks, list) and len(blocks) <= SLACK_BLOCKS_MAX
    text = message["text"]
    assert isinstance(text, str) and len(text) <= SLACK_SECTION_MAX
    for block in blocks:
        if "text" in block:
            assert len(block["text"]["text"]) <= SLACK_SECTION_MAX
        for f in block.get("fields", []):
            assert len(f["text"]) <= SLACK_FIELD_MAX
        assert len(block.get("fields", [])) <= SLACK_FIELDS_MAX
    for t in _texts(message):
        assert not _ENTITY.search(t), "a cut entity"
    evidence = next(b for b in blocks if b.get("text", {}).get("text", "").startswith("*Evid"))
    assert evidence["text"]["text"].endswith("…")
    assert len(json.dumps(message)) < 40_000


def test_slack_messages_of_the_other_events() -> None:
    campaign = CampaignFacts(
        id="camp-1",
        name="sweep",
        owner="alice",
        owner_uid=1001,
        cluster="dev",
        points=PointCounts(total=12, verified=5, running=2, pending=3, failed=1, blocked=1),
        problems=(CampaignProblem("0123456789abcdef", 32, "failed", "benchmark c=32: 0 of 320"),),
    )
    m = slack_message(make_event(EventType.CAMPAIGN_PROGRESS, campaign, T0, 3))
    assert m["text"] == "campaign sweep: 5/12 points verified, 2 running, 1 failed"
    problems = "failed 0123456789ab c=32: benchmark c=32: 0 of 320"
    assert _section(f"*Failed and blocked points*\n{problems}") in m["blocks"]
    done = replace(campaign, outcome="stopped", reason="2 of 3 canaries failed")
    m = slack_message(make_event(EventType.CAMPAIGN_FINISHED, done, T0, 9))
    assert m["text"] == "campaign sweep stopped: 5/12 points verified"
    m = slack_message(make_event(EventType.CAMPAIGN_FINISHED, replace(done, outcome=None), T0, 9))
    assert m["text"] == "campaign sweep finished: 5/12 points verified"
    q = QuarantineFacts("dev", "n3", None, None, 1, "NODE_FAIL", T0, T0 + timedelta(hours=6))
    m = slack_message(make_event(EventType.NODE_QUARANTINED, q, T0, 5))
    assert m["text"] == "node n3 on dev quarantined for everyone"
    mine = replace(q, owner="bob", owner_uid=1002)
    m = slack_message(make_event(EventType.NODE_QUARANTINED, mine, T0, 5))
    assert m["text"] == "node n3 on dev quarantined for runs of bob"
    uid_only = replace(q, owner=None, owner_uid=1004)
    m = slack_message(make_event(EventType.NODE_QUARANTINED, uid_only, T0, 5))
    assert m["text"] == "node n3 on dev quarantined for runs of uid 1004"
    assert _field("Kept out of", "runs of uid 1004") in m["blocks"][1]["fields"]
    nameless = replace(FINISHED, run=replace(RUN, owner=""), slurm=SlurmFacts())
    m = slack_message(make_event(EventType.RUN_SUBMITTED, nameless, T0, 1))
    assert m["text"] == "run demo (r-0001) of uid 1001 submitted as job not known yet"
    ping = slack_message(make_event(EventType.TEST_PING, PingFacts("team", "root"), T0, 1))
    assert ping["text"] == "test event for destination team, asked by root"
    blocks = ping["blocks"]
    assert isinstance(blocks, list)
    assert blocks[-1]["type"] == "context"
    assert blocks[-1]["elements"][0]["text"].startswith("event evt_")


def test_many_nodes_and_evidence_lines_are_summarised() -> None:
    facts = replace(
        FINISHED,
        slurm=SlurmFacts(job_id="1", nodes=tuple(f"n{i}" for i in range(12))),
        evidence=tuple(f"line {i}" for i in range(13)),
    )
    blocks = slack_message(make_event(EventType.RUN_FINISHED, facts, T0, 7))["blocks"]
    assert isinstance(blocks, list)
    assert _field("Nodes", "12: n0, n1, n2, n3, n4, n5, n6, n7 (+4 more)") in blocks[1]["fields"]
    lines = "\n".join(f"line {i}" for i in range(10))
    assert _section(f"*Evidence*\n{lines}\n(and 3 more lines)") in blocks


# --- mail -------------------------------------------------------------------------------------


MAIL_BODY = f"""{TITLE}

Outcome:      succeeded
Owner:        alice
Cluster:      dev
Spec:         demo.toml (abababababab)
Slurm job:    4242 COMPLETED 0:0
Attempt:      1
Nodes:        2: n1, n2
GPU-hours:    8.00 useful, 0.00 lost
Queued / ran: 30 s / 1 h 0 min

Reason:
  State=COMPLETED ExitCode=0:0, marker rc=0

Best point:
  {BEST_LINE}

Evidence:
  sacct: COMPLETED 0:0 (2 reads agree)
  marker rc=0 rank 1

Links:
  Archive: /var/lib/llmd-supervisor/archive/r-0001

--{" "}
llmd-supervisor {FOOTER}
"""
SENDER = "llmd@login1.example.org"
TO = ["a@example.org", "b@example.org"]


def test_mail_of_a_finished_run() -> None:
    event = make_event(EventType.RUN_FINISHED, FINISHED, T0, 7)
    msg = mail_message(
        event, "llmd@login1.example.org", ["a@example.org", "b@example.org"], "login1.example.org"
    )
    assert msg["From"] == "llmd@login1.example.org"
    assert msg["To"] == "a@example.org, b@example.org"
    assert msg["Subject"] == f"[llmd-supervisor] {TITLE}"
    assert msg["Date"] == "Sun, 01 Jun 2025 12:00:00 +0000"
    assert msg["Message-ID"] == "<evt_ifkrqdar5cyokhisfzcmftq4iy@login1.example.org>"
    assert msg["Auto-Submitted"] == "auto-generated"
    assert not msg.is_multipart()
    assert msg.get_content_type() == "text/plain"
    assert msg.get_content_charset() == "utf-8"
    assert msg.get_content() == MAIL_BODY
    # a resend is the same message, byte for byte
    again = mail_message(
        event, "llmd@login1.example.org", ["a@example.org", "b@example.org"], "login1.example.org"
    )
    assert bytes(again) == bytes(msg)


def test_mail_headers_cannot_be_injected() -> None:
    hostile = replace(RUN, name="x\r\nBcc: victim@example.org\r\n\r\n<html>")
    event = make_event(EventType.RUN_FINISHED, replace(FINISHED, run=hostile), T0, 7)
    msg = mail_message(event, "llmd@h.example", ["a@example.org"], "h.example")
    assert msg["Bcc"] is None
    text = msg.as_string()
    assert "\nBcc:" not in text
    assert "x\\r\\nBcc: victim@example.org\\r\\n\\r\\n<html>" in str(msg["Subject"])
    assert msg.get_content_type() == "text/plain"  # text only, whatever the text says


def test_mail_subject_is_bounded_and_encoded() -> None:
    long_name = replace(RUN, name="ü" * 250)
    event = make_event(EventType.RUN_FINISHED, replace(FINISHED, run=long_name), T0, 7)
    msg = mail_message(event, "l@h.example", ["a@example.org"], "h.example")
    subject = str(msg["Subject"])
    assert len(subject) == len("[llmd-supervisor] ") + 200
    assert subject.endswith("...")
    assert "=?utf-8?" in msg.as_string()  # RFC 2047 on the wire


@pytest.mark.parametrize(
    ("to", "domain", "why"),
    [
        ([], "h.example", "at least one recipient"),
        (["a@example.org"], "", "is not a host name"),
        (["a@example.org"], "bad domain", "is not a host name"),
        (["a@example.org"], "h.example>", "is not a host name"),
        (["a@example.org"], "-h.example", "is not a host name"),
    ],
)
def test_mail_refuses(to: list[str], domain: str, why: str) -> None:
    event = make_event(EventType.RUN_FINISHED, FINISHED, T0, 7)
    with pytest.raises(ValueError, match=why):
        mail_message(event, "l@h.example", to, domain)
