"""An event as a person reads it: a Slack incoming-webhook message and a mail (pure).

Both are made from one `Summary` of the event (a title, short labelled fields, labelled
paragraphs: reason, best point, evidence, links), so the two media say the same thing.
Text only: mail is ``text/plain``, never HTML; Slack gets mrkdwn sections.

Everything in an event that a job or a spec wrote (names, reasons, evidence, node names)
is hostile text. `core.events.model` has already escaped its control characters
(`core.run.jobtext`); here, for Slack, ``&``, ``<`` and ``>`` become ``&amp;``, ``&lt;`` and
``&gt;`` (`slack_escape`), so no text can form a link, a user or channel mention
(``<!channel>``) or a date token, and links are not unfurled. Slack's limits (written
down in tests/data/slack/SOURCE.md) are kept by construction: the ``text`` fallback and
every section at most `SLACK_SECTION_MAX` characters after escaping (cut at a character,
never inside an entity), at most `SLACK_FIELDS_MAX` fields of at most
`SLACK_FIELD_MAX`, a handful of blocks (fewer than `SLACK_BLOCKS_MAX`), the event id in
the last (context) block.

The mail (`mail_message`) is what ``sendmail -t -oi`` reads: From, To, Subject, Date (the
event's time), ``Message-ID: <event id@domain>`` (the same on a resend, so mail clients
see one message) and ``Auto-Submitted: auto-generated`` (RFC 3834: no vacation replies).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC
from email.message import EmailMessage
from email.utils import format_datetime
from typing import Final, NotRequired, TypedDict

from llmd_supervisor.core.events.model import (
    CampaignFacts,
    Event,
    EventType,
    Links,
    PingFacts,
    PointFacts,
    QuarantineFacts,
    RunFacts,
    describe,
    iso,
)
from llmd_supervisor.core.run.jobtext import job_text

__all__ = [
    "SLACK_BLOCKS_MAX",
    "SLACK_FIELDS_MAX",
    "SLACK_FIELD_MAX",
    "SLACK_SECTION_MAX",
    "SLACK_TEXT_MAX",
    "SUBJECT_MAX",
    "SlackBlock",
    "SlackMessage",
    "SlackText",
    "Summary",
    "mail_message",
    "slack_escape",
    "slack_message",
    "summary",
]

# Slack's documented limits (tests/data/slack/SOURCE.md).
SLACK_TEXT_MAX: Final = 40_000  # the top-level text; we keep it to SLACK_SECTION_MAX
SLACK_SECTION_MAX: Final = 3000  # a section's text
SLACK_FIELD_MAX: Final = 2000  # one field of a section
SLACK_FIELDS_MAX: Final = 10  # fields of one section
SLACK_BLOCKS_MAX: Final = 50  # blocks of one message
SLACK_CONTEXT_ELEMENTS_MAX: Final = 10
SUBJECT_MAX: Final = 200  # characters of a mail subject after its prefix
SUBJECT_PREFIX: Final = "[llmd-supervisor] "
EVIDENCE_LINES_SHOWN: Final = 10
PROBLEMS_SHOWN: Final = 10
NODES_SHOWN: Final = 8
_ENTITIES: Final = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_LABEL: Final = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DOMAIN: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


class SlackText(TypedDict):
    type: str  # "mrkdwn"
    text: str


class SlackBlock(TypedDict):
    type: str  # "section" | "context"
    text: NotRequired[SlackText]  # section
    fields: NotRequired[list[SlackText]]  # section
    elements: NotRequired[list[SlackText]]  # context


class SlackMessage(TypedDict):
    """The JSON object POSTed to an incoming webhook."""

    text: str  # what the notification shows
    blocks: list[SlackBlock]
    unfurl_links: bool
    unfurl_media: bool


@dataclass(frozen=True)
class Summary:
    """What a person is told of an event, in plain (job-escaped, not Slack-escaped) text."""

    title: str
    fields: tuple[tuple[str, str], ...]  # (label, short value), at most SLACK_FIELDS_MAX
    paragraphs: tuple[tuple[str, str], ...]  # (label, text), in the order shown
    footer: str  # the event's id, type and time


def summary(event: Event) -> Summary:
    """The event as `Summary` (the same for every medium)."""
    f = event.facts
    fields: list[tuple[str, str]]
    paragraphs: list[tuple[str, str]]
    if isinstance(f, RunFacts):
        fields, paragraphs = _run(event.type, f)
    elif isinstance(f, CampaignFacts):
        fields, paragraphs = _campaign(f)
    elif isinstance(f, QuarantineFacts):
        whose = f.owner or f"uid {f.owner_uid}"
        fields = [
            ("Cluster", f.cluster),
            ("Node", f.node),
            ("Kept out of", "everyone's runs" if f.owner_uid is None else f"runs of {whose}"),
            ("Failures counted", str(f.failures)),
            ("Until", iso(f.until)),
        ]
        paragraphs = [("Reason", job_text(f.reason))]
        if f.run:
            paragraphs.append(("Last failed run", job_text(f.run, 256)))
    else:
        assert isinstance(f, PingFacts)
        fields = [("Destination", f.destination), ("Asked by", f.requested_by)]
        paragraphs = [("Test", "This destination receives llmd-supervisor events.")]
    return Summary(
        title=describe(event),
        fields=tuple((k, job_text(v, 256)) for k, v in fields if v)[:SLACK_FIELDS_MAX],
        paragraphs=tuple((k, v) for k, v in paragraphs if v),
        footer=f"event {event.id} · {event.type.value} · {iso(event.at)}",
    )


def _run(etype: EventType, f: RunFacts) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    s = f.slurm
    job = " ".join(x for x in (s.job_id, s.state, s.exit_code) if x)
    fields = [
        ("Outcome" if f.outcome else "State", f.outcome or f.state),
        ("Cause", f.cause or ""),
        ("Owner", f.run.owner or str(f.run.owner_uid)),
        ("Cluster", f.run.cluster),
        ("Spec", f"{f.run.spec_name} ({f.run.spec_sha256[:12]})"),
        ("Slurm job", job),
        ("Attempt", str(f.attempt)),
        ("Nodes", _nodes(s.nodes)),
        ("GPU-hours", _gpu_hours(f.gpu_hours_useful, f.gpu_hours_lost)),
        ("Queued / ran", _timing(f)),
    ]
    paragraphs = [("Reason", job_text(f.reason))]
    if etype is EventType.RUN_POINT_FINISHED and f.point is not None:
        paragraphs.append(("Point", _point(f.point)))
    if f.best is not None:
        paragraphs.append(("Best point", _point(f.best)))
    if f.evidence:
        shown = list(f.evidence[:EVIDENCE_LINES_SHOWN])
        if len(f.evidence) > EVIDENCE_LINES_SHOWN:
            shown.append(f"(and {len(f.evidence) - EVIDENCE_LINES_SHOWN} more lines)")
        paragraphs.append(("Evidence", "\n".join(job_text(line, 512) for line in shown)))
    paragraphs.append(("Links", _links(f.links)))
    return fields, paragraphs


def _campaign(f: CampaignFacts) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    c = f.points
    fields = [
        ("Outcome", f.outcome or ""),
        ("Owner", f.owner or str(f.owner_uid)),
        ("Cluster", f.cluster or ""),
        ("Verified", f"{c.verified} of {c.total}"),
        ("Running / pending", f"{c.running} / {c.pending}"),
        ("Failed / blocked", f"{c.failed} / {c.blocked}"),
        ("GPU-hours", _gpu_hours(f.gpu_hours_useful, f.gpu_hours_lost)),
    ]
    paragraphs = [("Reason", job_text(f.reason))]
    if f.best is not None:
        of = f.best_of
        where = "" if of is None else f" ({job_text(of.topology, 64)}, run {job_text(of.run, 64)})"
        paragraphs.append((f"Best point{where}", _point(f.best)))
    if f.problems:
        lines = [
            f"{job_text(p.state, 32)} {job_text(p.recipe, 64)[:12]} c={p.concurrency}: "
            f"{job_text(p.reason, 300)}"
            for p in f.problems[:PROBLEMS_SHOWN]
        ]
        if len(f.problems) > PROBLEMS_SHOWN:
            lines.append(f"(and {len(f.problems) - PROBLEMS_SHOWN} more points)")
        paragraphs.append(("Failed and blocked points", "\n".join(lines)))
    paragraphs.append(("Links", _links(f.links)))
    return fields, paragraphs


def _nodes(nodes: Sequence[str]) -> str:
    if not nodes:
        return ""
    shown = ", ".join(job_text(n, 64) for n in nodes[:NODES_SHOWN])
    more = len(nodes) - NODES_SHOWN
    return f"{len(nodes)}: {shown}" + (f" (+{more} more)" if more > 0 else "")


def _gpu_hours(useful: float | None, lost: float | None) -> str:
    if useful is None and lost is None:
        return ""
    return f"{_num(useful, '.2f')} useful, {_num(lost, '.2f')} lost"


def _timing(f: RunFacts) -> str:
    t = f.timing
    queued = None if not (t.submitted_at and t.started_at) else t.started_at - t.submitted_at
    ran = None if not (t.started_at and t.finished_at) else t.finished_at - t.started_at
    if queued is None and ran is None:
        return ""
    return " / ".join("-" if d is None else _duration(d.total_seconds()) for d in (queued, ran))


def _duration(seconds: float) -> str:
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _point(p: PointFacts) -> str:
    numbers = [
        f"{_num(p.total_token_throughput, ',.1f')} tok/s total",
        f"{_num(p.output_throughput, ',.1f')} tok/s output",
        f"TTFT median {_num(p.ttft_ms_median, ',.0f')} ms",
        f"TPOT median {_num(p.tpot_ms_median, ',.1f')} ms",
    ]
    if p.completed is not None and p.num_prompts is not None:
        numbers.append(f"{p.completed}/{p.num_prompts} requests completed")
    text = f"c={p.concurrency}: " + ", ".join(numbers)
    if not p.valid:
        text += f" (not valid: {job_text(p.problem or 'no reason given', 512)})"
    return text


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _links(links: Links) -> str:
    shown = [
        f"{label}: {job_text(value, 1024)}"
        for label, value in (
            ("Archive", links.archive),
            ("Report", links.report),
            ("Dashboard", links.dashboard),
        )
        if value
    ]
    return "\n".join(shown)


# --- Slack ------------------------------------------------------------------------------


def slack_escape(text: str) -> str:
    """`text` with Slack's three control characters as entities (``&`` first)."""
    return "".join(_ENTITIES.get(ch, ch) for ch in text)


def _mrkdwn(text: str, limit: int) -> str:
    """`text` escaped for mrkdwn, at most `limit` characters: a longer one is cut between
    characters (never inside an entity) and ends with an ellipsis."""
    escaped = slack_escape(text)
    if len(escaped) <= limit:
        return escaped
    out: list[str] = []
    size = 0
    for ch in text:
        piece = _ENTITIES.get(ch, ch)
        if size + len(piece) > limit - 1:
            break
        out.append(piece)
        size += len(piece)
    return "".join(out) + "…"


def _section(text: str) -> SlackBlock:
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def _labelled(label: str, text: str) -> SlackBlock:
    head = f"*{label}*\n"
    return _section(head + _mrkdwn(text, SLACK_SECTION_MAX - len(head)))


def slack_message(event: Event) -> SlackMessage:
    """The JSON object POSTed to a Slack incoming webhook for `event`."""
    s = summary(event)
    blocks: list[SlackBlock] = [_section("*" + _mrkdwn(s.title, SLACK_SECTION_MAX - 2) + "*")]
    if s.fields:
        blocks.append(
            {
                "type": "section",
                "fields": [
                    {
                        "type": "mrkdwn",
                        "text": f"*{label}*\n" + _mrkdwn(value, SLACK_FIELD_MAX - len(label) - 3),
                    }
                    for label, value in s.fields
                ],
            }
        )
    blocks += [_labelled(label, text) for label, text in s.paragraphs]
    blocks.append(
        {"type": "context", "elements": [{"type": "mrkdwn", "text": _mrkdwn(s.footer, 300)}]}
    )
    assert len(blocks) <= SLACK_BLOCKS_MAX
    return {
        "text": _mrkdwn(s.title, SLACK_SECTION_MAX),
        "blocks": blocks,
        "unfurl_links": False,
        "unfurl_media": False,
    }


# --- mail -------------------------------------------------------------------------------


def mail_message(event: Event, sender: str, to: Sequence[str], domain: str) -> EmailMessage:
    """The plain-text mail of `event` from `sender` to `to` (addresses the daemon's
    config validated); `domain` is the right-hand side of its Message-ID (the daemon
    host's name). ValueError for an empty `to` or a `domain` that is not a host name."""
    if not to:
        raise ValueError("a mail needs at least one recipient")
    if not domain or len(domain) > 253 or not _DOMAIN.fullmatch(domain):
        raise ValueError(f"{domain!r} is not a host name for a Message-ID")
    s = summary(event)
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = ", ".join(to)
    subject = s.title if len(s.title) <= SUBJECT_MAX else s.title[: SUBJECT_MAX - 3] + "..."
    msg["Subject"] = SUBJECT_PREFIX + subject
    msg["Date"] = format_datetime(event.at.astimezone(UTC))
    msg["Message-ID"] = f"<{event.id}@{domain}>"
    msg["Auto-Submitted"] = "auto-generated"
    msg.set_content(_mail_body(s), charset="utf-8")
    return msg


def _mail_body(s: Summary) -> str:
    width = max((len(label) for label, _ in s.fields), default=0)
    lines = [s.title, ""]
    lines += [f"{label + ':':<{width + 1}} {value}" for label, value in s.fields]
    for label, text in s.paragraphs:
        lines += ["", f"{label}:"]
        lines += [f"  {line}" for line in text.splitlines()]
    lines += ["", "-- ", f"llmd-supervisor {s.footer}"]
    return "\n".join(lines) + "\n"
