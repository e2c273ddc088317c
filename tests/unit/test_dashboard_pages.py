"""The dashboard's pure parts (core.web.pages): escaping, the CSP, the Host and token
rules of the TCP listener, the log stream's resume points, and the pages built from the
control API's typed views."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime
from urllib.parse import parse_qsl

import pytest

from llmd_supervisor.core.campaign.views import CampaignStatus
from llmd_supervisor.core.config import DashboardConfig, load_config
from llmd_supervisor.core.events.outbox import DeliveryView
from llmd_supervisor.core.protocol.runs import PointView, RunBrief, RunResults, RunSummary
from llmd_supervisor.core.results.report_html import build_charts
from llmd_supervisor.core.web import pages as pages
from llmd_supervisor.errors import ConfigError, ControlError

HOSTILE = "<img src=x onerror=alert(1)>\"'&\x1b]0;t\x07"
NOW = datetime(2026, 1, 2, 12, 0, tzinfo=UTC)


def brief(run: str = "r1", **over: object) -> RunBrief:
    b: RunBrief = {
        "run": run,
        "job_name": f"llmd-{run}",
        "state": "running",
        "outcome": None,
        "reason": "",
        "slurm_job_id": "42",
        "attempt": 1,
        "nodes": ["n1", "n2"],
        "nodes_healthy": 2,
        "cancel_requested": False,
        "cluster": "dev",
        "owner_uid": 1000,
        "created_at": "2026-01-02T11:00:00+00:00",
        "elapsed_s": 3600.0,
        "archive": "/var/lib/llmd/archive/r1",
        "name": "demo",
        "finished_at": None,
    }
    b.update(over)  # type: ignore[typeddict-item]
    return b


def summary(**over: object) -> RunSummary:
    s: RunSummary = {
        **brief(),  # type: ignore[typeddict-item]
        "log_dir": "/tmp/logs",
        "health": {
            "n1": {"rank": 0, "reachable": True, "agent_state": "serving"},
            "n2": {"rank": 1, "reachable": True, "agent_state": "benchmarking c=32 (3/7)"},
        },
        "transitions": [
            {"state": "accepted", "at": "2026-01-02T11:00:00+00:00", "event": "submit"},
            {"state": "running", "at": "2026-01-02T11:01:00+00:00", "event": HOSTILE},
        ],
        "last_log_line": HOSTILE,
    }
    s.update(over)  # type: ignore[typeddict-item]
    return s


def no_tags(html: str) -> None:
    """The hostile text never shows as markup: no element, no attribute from it."""
    assert "<img src=x" not in html
    assert "onerror=alert(1)>" not in html.replace("onerror=alert(1)&gt;", "")
    assert "\x1b" not in html and "\x07" not in html


def test_the_csp_loads_only_the_dashboards_own_files() -> None:
    csp = dict(d.strip().split(" ", 1) for d in pages.CSP.split(";"))
    assert csp["default-src"] == "'none'"
    for directive in ("script-src", "style-src", "img-src", "connect-src"):
        assert csp[directive] == "'self'", directive
    assert pages.SECURITY_HEADERS["Content-Security-Policy"] == pages.CSP
    assert "unsafe" not in pages.CSP and "http" not in pages.CSP


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("localhost:8080", True),
        ("127.0.0.1:8765", True),
        ("[::1]:8765", True),
        ("LOCALHOST", True),
        ("login1.example.org:8080", True),  # configured
        ("evil.example:8765", False),  # DNS rebinding: another site's name
        ("127.0.0.1.evil.example", False),
        ("localhost.:8080", False),
        ("", False),
        (None, False),
    ],
)
def test_the_host_must_name_the_loopback_or_a_configured_host(host: str | None, ok: bool) -> None:
    assert pages.host_allowed(host, ("login1.example.org",)) is ok


def test_the_token_is_compared_whole() -> None:
    assert pages.token_matches("s3cret-token-value", "s3cret-token-value")
    assert not pages.token_matches("s3cret-token-valu", "s3cret-token-value")
    assert not pages.token_matches("", "s3cret-token-value")
    assert not pages.token_matches(None, "s3cret-token-value")
    assert not pages.token_matches("x", "")


def test_offsets_round_trip_through_an_event_id() -> None:
    offsets = {"attempt1/llmd-r1-42.out": 1234, "attempt1/42/rank0.log": 0}
    event_id = pages.encode_offsets(offsets)
    assert "\n" not in event_id and "\r" not in event_id
    assert pages.decode_offsets(event_id) == offsets


@pytest.mark.parametrize(
    "event_id",
    [
        None,
        "",
        "not base64 !!",
        base64.urlsafe_b64encode(b"[1, 2]").decode(),
        base64.urlsafe_b64encode(b'{"a": -1}').decode(),
        base64.urlsafe_b64encode(b'{"a": true}').decode(),
        base64.urlsafe_b64encode(b'{"a": "1"}').decode(),
        base64.urlsafe_b64encode(json.dumps({str(i): 1 for i in range(300)}).encode()).decode(),
        "A" * (pages.OFFSETS_MAX_CHARS + 1),
    ],
)
def test_a_bad_last_event_id_starts_afresh(event_id: str | None) -> None:
    assert pages.decode_offsets(event_id) == {}


def test_an_sse_event_keeps_hostile_text_on_one_data_line() -> None:
    raw = pages.sse_event("log", {"file": "a.out", "text": "x\n\ndata: forged\r\n" + HOSTILE}, "i1")
    text = raw.decode("ascii")
    assert text.endswith("\n\n") and text.count("\n\n") == 1
    lines = text.rstrip("\n").split("\n")
    assert lines == ["event: log", "id: i1", lines[2]] and lines[2].startswith("data: ")
    assert json.loads(lines[2][6:])["text"].startswith("x\n\ndata: forged")


def test_hostile_text_in_a_run_shows_as_text_on_every_page() -> None:
    runs = [brief(run="r1", name=HOSTILE, reason=HOSTILE, state="failed", outcome="failed")]
    html = pages.runs_page(
        runs,
        now=NOW,
        owner_names={1000: HOSTILE},
        stages={},
        state="",
        owner="",
        states=["running", "failed"],
        who=HOSTILE,
    )
    no_tags(html)
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    page = pages.run_page(
        summary(reason=HOSTILE, name=HOSTILE),
        None,
        owner_name=HOSTILE,
        chart_src=lambda c: "",
        charts=[],
        who="me",
    )
    no_tags(page)
    assert "\\x1b]0;t\\x07" in page  # terminal escapes shown as escapes


def test_the_run_page_has_the_stage_the_timeline_and_a_log_stream() -> None:
    page = pages.run_page(
        summary(),
        None,
        owner_name="alice",
        chart_src=lambda c: "",
        charts=[],
        who="me",
    )
    assert "running: benchmarking c=32 (3/7)" in page
    assert page.count("<tr><td>2026-01-02T11:0") == 2  # the timeline's two transitions
    assert 'data-stream="/runs/r1/logs"' in page
    assert "<script" in page and 'src="/static/dashboard.js"' in page
    assert "style=" not in page and "onclick" not in page  # nothing inline for the CSP


def test_the_runs_page_filters_by_state_and_owner_and_sorts_newest_first() -> None:
    runs = [
        brief("old", created_at="2026-01-01T00:00:00+00:00", owner_uid=1),
        brief("new", created_at="2026-01-02T00:00:00+00:00", owner_uid=2, state="failed"),
    ]
    names = {1: "alice", 2: "bob"}

    def shown(state: str = "", owner: str = "") -> list[str]:
        html = pages.runs_page(
            runs,
            now=NOW,
            owner_names=names,
            stages={"old": "running: benchmarking c=4 (1/3)"},
            state=state,
            owner=owner,
            states=["running", "failed"],
            who="me",
        )
        return [r for r in ("old", "new") if f'href="/runs/{r}"' in html]

    assert shown() == ["old", "new"]
    html = pages.runs_page(
        runs, now=NOW, owner_names=names, stages={"old": "running: benchmarking c=4 (1/3)"},
        state="", owner="", states=[], who="me",
    )  # fmt: skip
    assert html.index('href="/runs/new"') < html.index('href="/runs/old"')
    assert "running: benchmarking c=4 (1/3)" in html
    assert shown(state="failed") == ["new"]
    assert shown(owner="alice") == ["old"]


def test_stage_text() -> None:
    assert pages.stage_text("pending", ["x"]) == "pending"
    assert pages.stage_text("running", []) == "running"
    assert pages.stage_text("running", ["serving", "benchmarking c=8 (2/4)"]) == (
        "running: benchmarking c=8 (2/4)"
    )
    assert pages.stage_text("running", ["serving", ""]) == "running: serving"


def test_urls_in_an_error_keep_only_their_host() -> None:
    shown = pages.without_urls("POST https://hooks.slack.com/services/T0/B0/secret failed")
    assert shown == "POST https://hooks.slack.com/... failed"
    assert "secret" not in pages.without_urls("http://user:pw@host:8080/x?y=secret")


def results(concurrencies: list[int]) -> RunResults:
    def point(c: int) -> PointView:
        return {
            "file": f"c{c}.json",
            "concurrency": c,
            "num_prompts": 10 * c,
            "completed": 10 * c,
            "failed": 0,
            "duration_s": 10.0,
            "request_throughput": 1.0,
            "output_throughput": 100.0 * c,
            "total_token_throughput": 200.0 * c,
            "input_throughput": 100.0 * c,
            "total_token_throughput_per_gpu": None,
            "output_throughput_per_gpu": None,
            "input_throughput_per_gpu": None,
            "ttft_ms": {"mean": 10.0, "median": 10.0, "p99": 20.0},
            "tpot_ms": {"mean": 5.0, "median": 5.0 + c, "p99": 9.0},
            "itl_ms": None,
            "e2el_ms": None,
            "valid": True,
            "problem": None,
        }

    return {
        "run": "r1",
        "state": "succeeded",
        "outcome": "succeeded",
        "reason": "",
        "results": {
            "format": "vllm",
            "gpus": 4,
            "points": [point(c) for c in concurrencies],
        },
        "finished_at": None,
    }


def test_the_run_page_shows_each_chart_as_a_same_origin_image_with_its_points() -> None:
    r = results([1, 4, 16])
    charts = build_charts([r])
    page = pages.run_page(
        summary(state="succeeded", outcome="succeeded"),
        r,
        owner_name="alice",
        chart_src=lambda c: pages.chart_img(f"/runs/r1/charts/{c.chart_id}.svg?v=1", c),
        charts=charts,
        who="me",
    )
    assert '<img class="chart" src="/runs/r1/charts/total-tput-vs-interactivity.svg?v=1"' in page
    # the table of plotted points below the total-throughput chart: one row per concurrency
    part = page.split('id="total-tput-vs-interactivity"', 1)[1].split("</table>", 1)[0]
    assert part.count("<tr><td") == 3


def test_the_dashboard_config_defaults_beside_the_control_socket() -> None:
    c = load_config('[daemon]\nsocket = "/run/user/1000/llmd/control.sock"\n')
    assert c.dashboard == DashboardConfig()
    assert str(c.dashboard_socket) == "/run/user/1000/llmd/web.sock"
    c = load_config('[dashboard]\ntcp = "127.0.0.1:8765"\nsocket = "/run/x/web.sock"\n')
    assert c.dashboard.tcp == "127.0.0.1:8765" and str(c.dashboard_socket) == "/run/x/web.sock"
    assert c.dashboard.page("/runs/r1") is None  # no url: events carry no dashboard link
    c = load_config('[dashboard]\nurl = "http://localhost:8080/"\n')
    assert c.dashboard.page("/runs/r1") == "http://localhost:8080/runs/r1"
    for bad, key in [
        ('tcp = "0.0.0.0:8765"', "dashboard.tcp"),
        ('socket = "web.sock"', "dashboard.socket"),
        ('socket_mode = "0666"', "dashboard.socket_mode"),
        ("enabled = 1", "dashboard.enabled"),
        ('hosts = ["a:80"]', "dashboard.hosts"),
        ("nope = 1", "dashboard.nope"),
        ('url = "localhost:8080"', "dashboard.url"),
        ('url = "ftp://x"', "dashboard.url"),
        ('url = "http://x/?a=1"', "dashboard.url"),
        ('url = "http://x/<b>"', "dashboard.url"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(f"[dashboard]\n{bad}\n")
        assert info.value.key == key, bad


def test_the_campaign_page_shows_progress_and_failed_points_as_text() -> None:
    status: CampaignStatus = {
        "campaign": "c1",
        "name": HOSTILE,
        "state": "running",
        "reason": "",
        "cluster": "dev",
        "owner_uid": 1000,
        "created_at": "2026-01-02T11:00:00+00:00",
        "updated_at": "2026-01-02T11:30:00+00:00",
        "points": {"verified": 5, "failed: workload": 2, "queued": 0},
        "points_total": 7,
        "jobs": {"running": 1},
        "jobs_total": 3,
        "gpu_hours_useful": 1.5,
        "gpu_hours_lost": 0.25,
        "eta_s": None,
        "qos": None,
        "problems": [
            {
                "job": "abc",
                "topology": "1P1D",
                "values": {},
                "state": "failed",
                "reason": HOSTILE,
                "run": "r9",
            }
        ],
        "problems_total": 1,
        "exit_status": None,
    }
    html = pages.campaign_page(
        status, charts=[], chart_src=lambda c: "", owner_name="alice", who="me"
    )
    no_tags(html)
    assert "<tr><td>verified</td><td>5</td></tr>" in html and ">queued<" not in html
    assert 'href="/runs/r9"' in html and "Failed and blocked points (1)" in html


def test_the_events_page_shows_no_destination_url() -> None:
    delivery: DeliveryView = {
        "event": "e1",
        "type": "run.finished",
        "subject": "run/r1",
        "destination": "slack",
        "status": "retrying",
        "attempts": 2,
        "next_at": "2026-01-02T12:05:00+00:00",
        "last_error": "POST https://hooks.slack.com/services/T0/B0/secret: 500 " + HOSTILE,
        "created_at": "2026-01-02T12:00:00+00:00",
        "updated_at": "2026-01-02T12:01:00+00:00",
    }
    html = pages.events_page([delivery], status="", who="me")
    no_tags(html)
    assert "secret" not in html and "https://hooks.slack.com/..." in html
    assert 'href="/runs/r1"' in html and ">retrying<" in html


def test_a_query_value_a_page_cannot_use_is_a_bad_request_naming_it() -> None:
    def q(text: str) -> pages.Query:
        return pages.Query(parse_qsl(text, keep_blank_values=True))

    assert q("rank=7").rank() == 7 and q("").rank() is None
    assert q("all=1").flag("all") and not q("all=0").flag("all") and not q("").flag("all")
    assert q("state=").choice("state", ["running"]) == ""
    assert q("owner=al%C3%AFce").text("owner", 10) == "alïce"
    assert q(f"from={pages.encode_offsets({'a.out': 5})}").offsets("from") == {"a.out": 5}
    bad: list[tuple[str, Callable[[pages.Query], object]]] = [
        ("rank=%C2%B2", lambda x: x.rank()),  # '²'.isdigit() is True
        ("rank=%EF%BC%91", lambda x: x.rank()),  # fullwidth 1: int() takes it
        ("rank=65536", lambda x: x.rank()),
        ("rank=", lambda x: x.rank()),
        ("rank=1&rank=2", lambda x: x.rank()),
        ("all=yes", lambda x: x.flag("all")),
        ("state=nope", lambda x: x.choice("state", ["running"])),
        ("owner=a%00b", lambda x: x.text("owner", 10)),
        ("owner=%FF", lambda x: x.text("owner", 10)),
        ("owner=" + "a" * 11, lambda x: x.text("owner", 10)),
        ("from=e30x", lambda x: x.offsets("from")),
    ]
    for text, read in bad:
        with pytest.raises(ControlError) as info:
            read(q(text))
        assert info.value.code == "bad_request", text
        assert "query parameter" in info.value.message and "give" in info.value.message
