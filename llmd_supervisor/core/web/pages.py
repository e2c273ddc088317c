"""The dashboard's pages and its request rules, pure: typed views in, HTML text out.

Everything shown is HTML-escaped here, and what a job wrote is first escaped as the daemon
escapes job text (`core.run.jobtext`); a page loads nothing but the dashboard's own script and
style sheet (`CSP`). The rules a request must pass are here too: the Host allow-list and
the token of the TCP listener, and the resume point of a log stream (`encode_offsets`).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import html
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Final
from urllib.parse import quote, urlencode

from llmd_supervisor.core.campaign.views import CampaignBrief, CampaignProblem, CampaignStatus
from llmd_supervisor.core.protocol.runs import RunBrief, RunResults, RunSummary
from llmd_supervisor.core.results.report_html import (
    REPORT_CSS,
    Chart,
    chart_parts,
    escaped_run,
    evidence_table,
    run_title,
)
from llmd_supervisor.core.run.jobtext import job_text
from llmd_supervisor.errors import ControlError

if TYPE_CHECKING:  # core.events.outbox builds mails: email.utils loads socket
    from llmd_supervisor.core.events.outbox import DeliveryView

# What a page may load: its own script and style sheet and the charts' images, nothing
# else (no inline script or style, no frame, no form sent elsewhere).
CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
# A chart is an SVG image: matplotlib styles it inline, and an image runs no script.
CHART_CSP: Final = "default-src 'none'; style-src 'unsafe-inline'"
SECURITY_HEADERS: Final[Mapping[str, str]] = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
TOKEN_COOKIE: Final = "llmd_dashboard"
TOKEN_PARAM: Final = "token"
LOCAL_HOSTS: Final = frozenset({"localhost", "127.0.0.1", "::1"})
OFFSETS_MAX_CHARS: Final = 32 << 10  # a Last-Event-ID longer than this starts afresh
OFFSETS_MAX_FILES: Final = 256
SHOWN_MAX: Final = 300  # characters of a reason or error in a table cell

DASHBOARD_CSS: Final = (
    REPORT_CSS
    + """
nav { margin-bottom: 1em; } nav a { margin-right: 1em; }
nav .who { color: #555; float: right; font-size: 0.9em; }
table.runs td, table.runs th { text-align: left; white-space: normal; }
table.facts td, table.timeline td, table.health td, table.attempts td, table.problems td,
table.progress td { text-align: left; }
th[data-sort] { cursor: pointer; } th.sorted-asc::after { content: " \\25b2"; }
th.sorted-desc::after { content: " \\25bc"; }
pre.log { background: #111; color: #ddd; padding: 0.5em; max-height: 40em; overflow: auto;
  font-size: 0.8em; white-space: pre-wrap; word-break: break-all; }
.state-failed, .state-node_failed, .state-timed_out, .state-unverified { color: #b00; }
.state-succeeded { color: #080; }
img.chart { max-width: 100%; height: auto; }
form.filter { margin-bottom: 1em; }
"""
)


# --------------------------------------------------------------------------- request rules


def host_allowed(host_header: str | None, extra: Sequence[str]) -> bool:
    """Whether a TCP request's Host names this machine's loopback (or a configured name),
    on any port (``ssh -L`` moves the port): a page of another site that resolves its
    name to 127.0.0.1 (DNS rebinding) is refused."""
    if not host_header:
        return False
    host = host_header.strip().lower()
    if host.startswith("["):
        name = host[1:].partition("]")[0]
    else:
        name = host.rpartition(":")[0] if host.count(":") == 1 else host
    return name in LOCAL_HOSTS or name in extra


def token_matches(given: str | None, expected: str) -> bool:
    """Whether `given` is the dashboard's token (compared in constant time)."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode())


def encode_offsets(offsets: Mapping[str, int]) -> str:
    """A log stream's resume point (per-file byte offsets) as an SSE event id."""
    text = json.dumps(dict(sorted(offsets.items())), separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode("ascii").rstrip("=")


def decode_offsets(event_id: str | None) -> dict[str, int]:
    """The offsets of a ``Last-Event-ID`` (`encode_offsets`); {} for anything else: a
    client's header is input, and a bad one starts the stream from the tail afresh."""
    return parse_offsets(event_id) or {}


def parse_offsets(event_id: str | None) -> dict[str, int] | None:
    """The offsets of an `encode_offsets` text; None for anything else."""
    if not event_id or len(event_id) > OFFSETS_MAX_CHARS:
        return None
    try:
        raw = base64.urlsafe_b64decode(event_id + "=" * (-len(event_id) % 4))
        value = json.loads(raw)
    except (ValueError, binascii.Error, RecursionError):
        return None
    if not isinstance(value, dict) or len(value) > OFFSETS_MAX_FILES:
        return None
    out: dict[str, int] = {}
    for key, offset in value.items():
        if (
            not isinstance(key, str)
            or len(key) > 512
            or isinstance(offset, bool)
            or not isinstance(offset, int)
            or not 0 <= offset < 1 << 62
        ):
            return None
        out[key] = offset
    return out


# --------------------------------------------------------------------------- queries

RANK_MAX: Final = (1 << 16) - 1
DELIVERY_STATUSES: Final = ("queued", "retrying", "delivered", "dead", "disabled")
_RANK = re.compile(r"[0-9]{1,5}")


class Query:
    """The query parameters a page reads, each given at most once: a value the page cannot
    use is a `ControlError` ``bad_request`` (a 400 page) naming the parameter, the value
    and what it takes. Parameters a page does not read are ignored."""

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self._values: dict[str, list[str]] = {}
        for key, value in pairs:
            self._values.setdefault(key, []).append(value)

    def _one(self, name: str, takes: str) -> str | None:
        given = self._values.get(name)
        if not given:
            return None
        if len(given) > 1:
            raise ControlError(
                "bad_request",
                f"The query parameter {name!r} is given {len(given)} times; give it once "
                f"({takes}).",
            )
        return given[0]

    def _bad(self, name: str, value: str, takes: str) -> ControlError:
        shown = job_text(value, 40)
        return ControlError(
            "bad_request",
            f"The query parameter {name}={shown!r} cannot be used; give {takes}.",
        )

    def flag(self, name: str) -> bool:
        """``1`` (true) or ``0``; absent is false."""
        takes = f"{name}=1 or {name}=0"
        value = self._one(name, takes)
        if value is None or value == "0":
            return False
        if value == "1":
            return True
        raise self._bad(name, value, takes)

    def choice(self, name: str, choices: Sequence[str]) -> str:
        """One of `choices`, or "" (absent or empty: any)."""
        takes = f"one of {', '.join(choices)}, or nothing for any"
        value = self._one(name, takes) or ""
        if value and value not in choices:
            raise self._bad(name, value, takes)
        return value

    def text(self, name: str, limit: int) -> str:
        """Printable text of at most `limit` characters, or "" (any)."""
        takes = f"printable text of at most {limit} characters, or nothing for any"
        value = self._one(name, takes) or ""
        if len(value) > limit or not value.isprintable() or "\ufffd" in value:
            raise self._bad(name, value, takes)  # (U+FFFD: bytes that were not UTF-8)
        return value

    def rank(self, name: str = "rank") -> int | None:
        """A node's rank: decimal digits 0-9 (not any Unicode digit), at most RANK_MAX."""
        takes = f"a rank from 0 to {RANK_MAX} in the digits 0-9"
        value = self._one(name, takes)
        if value is None:
            return None
        if not _RANK.fullmatch(value) or int(value) > RANK_MAX:
            raise self._bad(name, value, takes)
        return int(value)

    def offsets(self, name: str) -> dict[str, int] | None:
        """A log stream's resume point as its events' ids carry it (`encode_offsets`)."""
        takes = "a log event's id (as the stream sent it)"
        value = self._one(name, takes)
        if value is None:
            return None
        found = parse_offsets(value)
        if found is None:
            raise self._bad(name, value, takes)
        return found


def sse_event(event: str, data: Mapping[str, object], event_id: str | None = None) -> bytes:
    """One server-sent event; `data` as one line of JSON (no raw newline can end it)."""
    lines = [f"event: {event}"]
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append("data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=True))
    return ("\n".join(lines) + "\n\n").encode("ascii")


SSE_PING: Final = b": ping\n\n"


# --------------------------------------------------------------------------- text


def esc(value: object) -> str:
    """Any value as HTML text (quotes too: it may be an attribute)."""
    return html.escape("" if value is None else str(value), quote=True)


def job(value: object, limit: int = SHOWN_MAX) -> str:
    """Text a job may have written (a reason, a name, a log line): escaped as job text
    and as HTML, at most `limit` characters."""
    return esc(job_text("" if value is None else str(value), limit))


_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def without_urls(text: str) -> str:
    """`text` with every URL cut to its scheme and host (a webhook's path, or a Slack
    incoming webhook's, is its credential)."""

    def shorten(m: re.Match[str]) -> str:
        scheme, _, rest = m.group(0).partition("://")
        host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
        return f"{scheme}://{host}/..."

    return _URL.sub(shorten, text)


def age_text(seconds: float) -> str:
    """`42 s`, `7 min`, `3.2 h`, `2.5 d`."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def stage_text(state: str, agent_states: Sequence[str]) -> str:
    """What a run is doing: its state, and while running what its agents say they do
    (``benchmarking concurrency 32 (3 of 7)``), the benchmark's first."""
    if state != "running":
        return state
    bench = sorted({s for s in agent_states if s.startswith("bench")})
    shown = bench or sorted({s for s in agent_states if s})
    return f"running: {'; '.join(shown)}" if shown else state


def run_href(run_id: str) -> str:
    return "/runs/" + quote(run_id, safe="")


def campaign_href(campaign_id: str) -> str:
    return "/campaigns/" + quote(campaign_id, safe="")


# --------------------------------------------------------------------------- pages


def page(title: str, body: str, *, who: str) -> str:
    """A whole document: the nav, `body` (already HTML), the script and style sheet."""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f"<title>{job(title, 200)} · llmd-supervisor</title>"
        '<link rel="stylesheet" href="/static/dashboard.css">'
        '<script src="/static/dashboard.js" defer></script></head><body>'
        '<nav><a href="/">Runs</a><a href="/campaigns">Campaigns</a>'
        f'<a href="/events">Events</a><span class="who">{job(who)}</span></nav>'
        f"<main><h1>{job(title, 200)}</h1>{body}</main></body></html>\n"
    )


def error_page(title: str, message: str, *, who: str) -> str:
    return page(title, f'<p class="note">{esc(message)}</p>', who=who)


def _th(name: str, kind: str = "text") -> str:
    return f'<th data-sort="{kind}">{esc(name)}</th>'


def _select(name: str, choices: Sequence[str], chosen: str) -> str:
    options = [f'<option value=""{"" if chosen else " selected"}>any</option>']
    for c in choices:
        sel = " selected" if c == chosen else ""
        options.append(f'<option value="{job(c)}"{sel}>{job(c)}</option>')
    return f'<select name="{esc(name)}">{"".join(options)}</select>'


def runs_page(
    runs: Sequence[RunBrief],
    *,
    now: datetime,
    owner_names: Mapping[int, str],
    stages: Mapping[str, str],
    state: str,
    owner: str,
    states: Sequence[str],
    who: str,
) -> str:
    """The runs table, newest first, filtered by state and owner (name or uid)."""

    def owner_of(r: RunBrief) -> str:  # as shown (and as the filter's choices send it)
        return job_text(owner_names.get(r["owner_uid"], str(r["owner_uid"])), SHOWN_MAX)

    shown = [
        r
        for r in runs
        if (not state or r["state"] == state) and (not owner or owner in (owner_of(r),))
    ]
    shown.sort(key=lambda r: (r["created_at"], r["run"]), reverse=True)
    rows = []
    for r in shown:
        created = datetime.fromisoformat(r["created_at"])
        age = max(0.0, (now - created).total_seconds())
        rows.append(
            "<tr>"
            f'<td><a href="{esc(run_href(r["run"]))}">{esc(r["run"])}</a></td>'
            f"<td>{job(r.get('name') or '')}</td>"
            f"<td>{job(owner_of(r))}</td>"
            f"<td>{esc(r['cluster'])}</td>"
            f"<td>{esc(r['slurm_job_id'] or '-')}</td>"
            f'<td class="state-{esc(r["state"])}">{job(stages.get(r["run"], r["state"]))}</td>'
            f'<td data-value="{age:.0f}">{esc(age_text(age))}</td>'
            f"<td>{esc(r['outcome'] or '')}</td>"
            f'<td class="text">{job(r["reason"])}</td>'
            "</tr>"
        )
    owners = sorted({owner_of(r) for r in runs})
    form = (
        '<form class="filter" method="get" action="/">'
        f"state {_select('state', states, state)} "
        f"owner {_select('owner', owners, owner)} "
        '<button type="submit">filter</button></form>'
    )
    head = (
        _th("run")
        + _th("spec")
        + _th("owner")
        + _th("cluster")
        + _th("job", "num")
        + _th("state and stage")
        + _th("age", "num")
        + _th("outcome")
        + _th("reason")
    )
    table = (
        f'<table class="runs sortable"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
        if rows
        else '<p class="note">No runs to show.</p>'
    )
    count = f'<p class="note">{len(shown)} of {len(runs)} runs.</p>'
    return page("Runs", form + count + table, who=who)


def _facts(pairs: Sequence[tuple[str, str]]) -> str:
    rows = "".join(f'<tr><th>{esc(k)}</th><td class="text">{v}</td></tr>' for k, v in pairs)
    return f'<table class="facts">{rows}</table>'


def run_page(
    s: RunSummary,
    results: RunResults | None,
    *,
    owner_name: str,
    chart_src: Callable[[Chart], str],
    charts: Sequence[Chart],
    who: str,
) -> str:
    """One run: verdict and facts, stage timeline, evidence, node health, live logs,
    results table and charts."""
    run_id = s["run"]
    agent_states = [n["agent_state"] for n in s["health"].values()]
    stage = stage_text(s["state"], agent_states)
    verdict_css = "succeeded" if s["outcome"] == "succeeded" else ("bad" if s["outcome"] else "")
    parts = [
        f'<div class="verdict {verdict_css}"><b>{job(s["outcome"] or stage)}</b>'
        f"{': ' + job(s['reason'], 2000) if s['reason'] else ''}</div>",
        _facts(
            [
                ("spec", job(s.get("name") or "")),
                ("owner", job(owner_name)),
                ("cluster", esc(s["cluster"])),
                ("Slurm job", esc(s["slurm_job_id"] or "-")),
                ("attempt", esc(s["attempt"])),
                ("state", f'<span class="state-{esc(s["state"])}">{job(stage)}</span>'),
                ("nodes", esc(", ".join(s["nodes"]) or "-")),
                ("created", esc(s["created_at"])),
                ("elapsed", esc(age_text(s["elapsed_s"]))),
                ("last log line", job(s["last_log_line"])),
            ]
        ),
        "<h2>Stage timeline</h2>",
        _timeline(s),
        "<h2>Evidence</h2>",
        _evidence(s),
        "<h2>Nodes</h2>",
        _health(s),
        "<h2>Logs</h2>",
        _logs(s),
        '<h2 id="results">Results</h2>',
        _results(results, chart_src, charts),
    ]
    return page(f"Run {run_id}", "".join(parts), who=who)


def _timeline(s: RunSummary) -> str:
    rows = "".join(
        f"<tr><td>{esc(t['at'])}</td><td>{esc(t['state'])}</td>"
        f'<td class="text">{job(t["event"])}</td></tr>'
        for t in s["transitions"]
    )
    if not rows:
        return '<p class="note">No transitions yet.</p>'
    return (
        '<table class="timeline"><thead><tr><th>at</th><th>state</th><th>event</th></tr>'
        f"</thead><tbody>{rows}</tbody></table>"
    )


def _evidence(s: RunSummary) -> str:
    parts = []
    best = s.get("headline")
    if best:
        parts.append(
            f"<p>Best point c={esc(best['concurrency'])}: "
            f"{best['total_token_throughput']:.1f} tok/s total, "
            f"{best['output_throughput']:.1f} tok/s output.</p>"
        )
    attempts = s.get("attempts") or []
    if attempts:
        rows = "".join(
            f"<tr><td>{esc(a['attempt'])}</td><td>{esc(a['slurm_job_id'] or '-')}</td>"
            f"<td>{esc(', '.join(a['nodes']))}</td><td>{job(a['outcome'])}</td>"
            f"<td>{job(a['cause'] or '')}</td>"
            f'<td class="text">{job(a["reason"])}</td>'
            f"<td>{esc(', '.join(a['implicated']))}</td>"
            f"<td>{_hours(a['gpu_hours'])}</td></tr>"
            for a in attempts
        )
        parts.append(
            '<table class="attempts"><thead><tr><th>attempt</th><th>job</th><th>nodes</th>'
            "<th>outcome</th><th>cause</th><th>reason</th><th>implicated</th>"
            f"<th>GPU-hours</th></tr></thead><tbody>{rows}</tbody></table>"
        )
    if not parts:
        parts.append('<p class="note">No verdict yet.</p>')
    return "".join(parts)


def _hours(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _health(s: RunSummary) -> str:
    if not s["health"]:
        return '<p class="note">No node heartbeat yet.</p>'
    rows = "".join(
        f"<tr><td>{esc(node)}</td><td>{esc(n['rank'])}</td>"
        f"<td>{'yes' if n['reachable'] else 'no'}</td><td>{job(n['agent_state'])}</td></tr>"
        for node, n in sorted(s["health"].items(), key=lambda kv: kv[1]["rank"])
    )
    return (
        '<table class="health"><thead><tr><th>node</th><th>rank</th><th>reachable</th>'
        f"<th>agent</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _logs(s: RunSummary) -> str:
    base = run_href(s["run"]) + "/logs"
    links = ['<a href="?">batch log</a>']
    links += [f'<a href="?{urlencode({"rank": i})}">rank {i}</a>' for i in range(len(s["nodes"]))]
    return (
        f'<p class="logs-nav">{" ".join(links)}</p>'
        f'<pre class="log" id="log" data-stream="{esc(base)}"></pre>'
        '<p class="note" id="log-state"></p>'
    )


def _results(
    results: RunResults | None, chart_src: Callable[[Chart], str], charts: Sequence[Chart]
) -> str:
    if results is None:
        return '<p class="note">No results yet.</p>'
    r = escaped_run(results)
    title = run_title(r)
    parts = [f'<p class="title">{esc(title)}</p>'] if title else []
    parts.append(evidence_table(r))
    parts += chart_parts(charts, chart_src)
    return "".join(parts)


def chart_img(src: str, chart: Chart) -> str:
    """A chart as an image of the dashboard's own origin."""
    return f'<img class="chart" src="{esc(src)}" alt="{esc(chart.title)}">'


def campaigns_page(
    campaigns: Sequence[CampaignBrief], owner_names: Mapping[int, str], *, who: str
) -> str:
    rows = "".join(
        f'<tr><td><a href="{esc(campaign_href(c["campaign"]))}">{esc(c["campaign"])}</a></td>'
        f"<td>{job(c['name'])}</td>"
        f"<td>{job(owner_names.get(c['owner_uid'], str(c['owner_uid'])))}</td>"
        f"<td>{esc(c['cluster'])}</td><td>{esc(c['state'])}</td>"
        f'<td data-value="{c["settled"]}">{c["settled"]} of {c["points"]}</td>'
        f"<td>{esc(c['created_at'])}</td></tr>"
        for c in sorted(campaigns, key=lambda c: c["created_at"], reverse=True)
    )
    head = (
        _th("campaign")
        + _th("name")
        + _th("owner")
        + _th("cluster")
        + _th("state")
        + _th("points settled", "num")
        + _th("created")
    )
    body = (
        f'<table class="runs sortable"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
        if rows
        else '<p class="note">No campaigns to show.</p>'
    )
    return page("Campaigns", body, who=who)


def campaign_page(
    c: CampaignStatus,
    *,
    charts: Sequence[Chart],
    chart_src: Callable[[Chart], str],
    owner_name: str,
    who: str,
) -> str:
    """One campaign: progress by state, the Pareto chart, failed and blocked points."""
    progress = "".join(
        f"<tr><td>{esc(state)}</td><td>{n}</td></tr>" for state, n in c["points"].items() if n
    )
    parts = [
        f'<div class="verdict"><b>{esc(c["state"])}</b>'
        f"{': ' + job(c['reason']) if c['reason'] else ''}</div>",
        _facts(
            [
                ("name", job(c["name"])),
                ("owner", job(owner_name)),
                ("cluster", esc(c["cluster"])),
                ("jobs", esc(c["jobs_total"])),
                ("GPU-hours useful", esc(c["gpu_hours_useful"])),
                ("GPU-hours lost", esc(c["gpu_hours_lost"])),
                ("created", esc(c["created_at"])),
                ("updated", esc(c["updated_at"])),
            ]
        ),
        f"<h2>Progress ({c['points_total']} points)</h2>",
        '<table class="progress"><thead><tr><th>point state</th><th>points</th></tr></thead>'
        f"<tbody>{progress}</tbody></table>",
        '<h2 id="charts">Charts</h2>',
        *chart_parts(charts, chart_src),
        f"<h2>Failed and blocked points ({c['problems_total']})</h2>",
        _problems(c["problems"]),
    ]
    return page(f"Campaign {c['name']}", "".join(parts), who=who)


def _problems(problems: Sequence[CampaignProblem]) -> str:
    if not problems:
        return '<p class="note">None.</p>'
    rows = "".join(
        f"<tr><td>{esc(p['job'])}</td><td>{job(p['topology'])}</td><td>{esc(p['state'])}</td>"
        f"<td>{'' if p['run'] is None else _run_link(p['run'])}</td>"
        f'<td class="text">{job(p["reason"])}</td></tr>'
        for p in problems
    )
    return (
        '<table class="problems"><thead><tr><th>job</th><th>topology</th><th>state</th>'
        f"<th>run</th><th>reason</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _run_link(run_id: str) -> str:
    return f'<a href="{esc(run_href(run_id))}">{esc(run_id)}</a>'


def events_page(deliveries: Sequence[DeliveryView], *, status: str, who: str) -> str:
    """The outbox's deliveries, newest first (no destination URL: names only)."""
    rows = []
    for d in deliveries:
        subject = d["subject"]
        shown = _run_link(subject[4:]) if subject.startswith("run/") else esc(subject)
        rows.append(
            f"<tr><td>{esc(d['created_at'])}</td><td>{esc(d['event'])}</td>"
            f"<td>{esc(d['type'])}</td><td>{shown}</td><td>{esc(d['destination'])}</td>"
            f'<td class="status-{esc(d["status"])}">{esc(d["status"])}</td>'
            f"<td>{d['attempts']}</td><td>{esc(d['next_at'] or '')}</td>"
            f'<td class="text">{job(without_urls(d["last_error"] or ""))}</td></tr>'
        )
    head = (
        _th("created")
        + _th("event")
        + _th("type")
        + _th("subject")
        + _th("destination")
        + _th("status")
        + _th("attempts", "num")
        + _th("next attempt")
        + _th("last error")
    )
    statuses = list(DELIVERY_STATUSES)
    form = (
        '<form class="filter" method="get" action="/events">'
        f"status {_select('status', statuses, status)} "
        '<button type="submit">filter</button></form>'
    )
    table = (
        f'<table class="runs sortable"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
        if rows
        else '<p class="note">No deliveries to show.</p>'
    )
    return page("Events", form + table, who=who)
