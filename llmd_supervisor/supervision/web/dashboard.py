"""The read-only web dashboard: a Starlette app over the control API.

Every page is built from the typed services the control socket answers from, called
directly (`RunsService`'s ``list``, ``status``, ``results`` and ``logs``, `CampaignOps`,
`EventOps`'s ``deliveries``) as the viewer: so a viewer sees exactly what the control
socket would show them, bounded the same way, and a run they may not see is not found.

Who the viewer is depends on the listener the request came through (`adapters.web.server`
puts it in the ASGI scope from the socket's family, never from a header):

- the **Unix socket**: the peer's uid and gid (SO_PEERCRED), the control socket's rule: a
  user sees their own runs, root and the admin group every run;
- **loopback TCP**: whoever holds the dashboard's token, the service account's secret: they
  see every run. The token comes once as ``?token=...`` (or the ``llmd_dashboard`` cookie),
  is then kept in an HttpOnly, SameSite=Strict cookie.

On both, the request's Host must name the loopback or a host of ``dashboard.hosts``: through
``ssh -L`` the Unix socket is a loopback port of a workstation, and a page of another site
must not reach it by pointing its own name at 127.0.0.1 (DNS rebinding).

Only GET and HEAD are answered (405 otherwise); every response carries the strict
Content-Security-Policy of `core.web.pages`. A query parameter a page reads that it
cannot use (`dashboard_pages.Query`) is a 400 page, before anything is asked. Live logs are
server-sent events whose ids are the per-file byte offsets, so a browser that reconnects
(``Last-Event-ID``) resumes exactly where it stopped; each listener has its own cap on open
streams and within it a cap per viewer (a uid on the Unix socket, a source address on TCP,
so that one token holder cannot take them all): over one, a stream is answered 503.
Connections are capped per listener and per peer, and a request head must be whole in
time, by `adapters.web.server` (``dashboard.max_connections*``, ``head_timeout_s``).
Charts are the report's (`core.results.report_html`), drawn by matplotlib in a worker thread, one
at a time, and cached per results version.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import functools
import hashlib
import json
import os
import secrets
import socket
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import anyio.to_thread
import structlog
from starlette.applications import Starlette
from starlette.requests import Request as WebRequest
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmd_supervisor.adapters.control.limits import Caps
from llmd_supervisor.adapters.control.protocol import Peer
from llmd_supervisor.adapters.control.requests import (
    CampaignRef,
    EventsListRequest,
    ListRequest,
    LogsRequest,
    ResultsRequest,
    StatusRequest,
)
from llmd_supervisor.adapters.control.server import bind_unix_socket, remove_socket_file
from llmd_supervisor.adapters.web.chart_svg import chart_svg, have_matplotlib
from llmd_supervisor.adapters.web.server import LISTENERS, bind_tcp, serve_asgi
from llmd_supervisor.core.campaign.views import CampaignJobResults, CampaignStatus
from llmd_supervisor.core.config import Config, DashboardConfig
from llmd_supervisor.core.protocol.runs import LogChunk, RunBrief
from llmd_supervisor.core.results.report_html import (
    Chart,
    build_charts,
    campaign_charts,
    escaped_run,
)
from llmd_supervisor.core.run.layout import LOGS
from llmd_supervisor.core.run.lifecycle import RunState
from llmd_supervisor.core.web import pages as pages
from llmd_supervisor.errors import ControlError, SupervisorError
from llmd_supervisor.supervision.control.access import user_name
from llmd_supervisor.supervision.control.api import ControlApi
from llmd_supervisor.supervision.run.verify_job import utcnow

__all__ = ["TOKEN_PEER", "Dashboard", "load_token", "serve_dashboard"]

log = structlog.get_logger("llmd_supervisor.supervision.dashboard")

STATIC = Path(__file__).with_name("dashboard_static")
# The holder of the TCP token: the service account's secret, so every run (as root sees).
TOKEN_PEER: Final = Peer(uid=0, gid=0, pid=0)
RUNS_MAX: Final = 5000  # runs a runs page lists at most (five `list` pages)
STAGES_MAX: Final = 200  # running runs whose stage (agents' states) the runs page asks
TAIL_BYTES: Final = 256 << 10  # a log stream without a resume point starts this far back
TAIL_FILES_MAX: Final = 256
SSE_PING_S: Final = 15.0
CHARTS_CACHED: Final = 64
TOKEN_BYTES: Final = 32


def load_token(config: DashboardConfig, state_dir: Path) -> tuple[str, Path]:
    """The TCP listener's token and the file it is in.

    A configured ``token_file`` is read (it must be the service account's alone: no rights
    for group or others); without one, a new token is written to
    ``<state_dir>/dashboard.token`` (0600) at every start.
    """
    if config.token_file is not None:
        path = Path(config.token_file)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SupervisorError(
                f"The dashboard token file {path} (dashboard.token_file) cannot be opened: "
                f"{exc.strerror}."
            ) from None
        try:
            st = os.fstat(fd)
            if st.st_mode & 0o077:
                raise SupervisorError(
                    f"The dashboard token file {path} has mode {st.st_mode & 0o777:04o}; "
                    f"others may read it: chmod 600 {path} (owned by the service account)."
                )
            token = os.read(fd, 4096).decode("utf-8", "replace").strip()
        finally:
            os.close(fd)
        if len(token) < 16:
            raise SupervisorError(
                f"The dashboard token file {path} holds {len(token)} characters; write a "
                "token of at least 16 (e.g. openssl rand -hex 32 > the file)."
            )
        return token, path
    path = state_dir / "dashboard.token"
    token = secrets.token_urlsafe(TOKEN_BYTES)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token, path


def tail_offsets(root: Path, tail: int = TAIL_BYTES) -> dict[str, int]:
    """Where a fresh log stream starts in each local copy under `root` (the daemon's own
    files): `tail` bytes before its end. Blocking: run in a thread."""
    out: dict[str, int] = {}
    try:
        found = sorted(root.rglob("*"))
    except OSError:
        return out
    for path in found:
        if len(out) >= TAIL_FILES_MAX:
            break
        try:
            if not path.is_file():
                continue
            size = path.stat().st_size
        except OSError:
            continue
        if size > tail:
            out[str(path.relative_to(root))] = size - tail
    return out


def results_version(results: object) -> str:
    """A results reply's version: the hash of its JSON (a chart is drawn once per version)."""
    text = json.dumps(results, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Dashboard:
    """The dashboard's state: the API it asks, its token, its caches and live streams.

    `closing` is set when the daemon stops: live log streams end at once.
    """

    def __init__(
        self,
        api: ControlApi[Any],
        config: DashboardConfig,
        *,
        token: str | None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.api = api
        self.runs = api.runs
        self.config = config
        self.token = token
        self.clock = clock
        self.closing = anyio.Event()
        self._charts: collections.OrderedDict[tuple[str, str, str], bytes] = (
            collections.OrderedDict()
        )
        self._draw_lock = anyio.Lock()  # matplotlib's rc settings are process-wide
        lim = config.limits
        where = {"unix": "Unix socket", "tcp": "TCP listener"}
        self._streams: dict[str, Caps[int | str]] = {
            kind: Caps(
                lim.max_streams,
                lim.max_streams_per_viewer,
                holder=f"The dashboard's {where[kind]}",
                what="live log streams",
                keys=("dashboard.max_streams", "dashboard.max_streams_per_viewer"),
                per="per-viewer",
            )
            for kind in LISTENERS
        }
        self._names: dict[int, str] = {}
        self._js = (STATIC / "dashboard.js").read_bytes()

    def stop(self) -> None:
        self.closing.set()

    # ----------------------------------------------------------------------- the app

    def app(self) -> ASGIApp:
        routes = [
            Route("/", self._runs, methods=["GET", "HEAD"]),
            Route("/runs/{run}", self._run, methods=["GET", "HEAD"]),
            Route("/runs/{run}/logs", self._logs, methods=["GET", "HEAD"]),
            Route("/runs/{run}/charts/{chart}.svg", self._run_chart, methods=["GET", "HEAD"]),
            Route("/campaigns", self._campaigns, methods=["GET", "HEAD"]),
            Route("/campaigns/{campaign}", self._campaign, methods=["GET", "HEAD"]),
            Route(
                "/campaigns/{campaign}/charts/{chart}.svg",
                self._campaign_chart,
                methods=["GET", "HEAD"],
            ),
            Route("/events", self._events, methods=["GET", "HEAD"]),
            Route("/static/dashboard.js", self._script, methods=["GET", "HEAD"]),
            Route("/static/dashboard.css", self._style, methods=["GET", "HEAD"]),
        ]
        return _Guard(Starlette(routes=routes), self)

    # ----------------------------------------------------------------------- helpers

    def owner(self, uid: int) -> str:
        """`uid`'s account name (looked up once per uid), else the number."""
        if uid not in self._names:
            if len(self._names) > 10_000:
                self._names.clear()
            self._names[uid] = user_name(uid) or str(uid)
        return self._names[uid]

    def _html(self, text: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(text, status_code=status)

    def _problem(self, request: WebRequest, exc: ControlError) -> HTMLResponse:
        status = {"not_found": 404, "ambiguous": 409, "bad_request": 400, "forbidden": 403}
        return self._html(
            pages.error_page("Not available", exc.message, who=_who(request)),
            status.get(exc.code, 500),
        )

    # ----------------------------------------------------------------------- pages

    async def _runs(self, request: WebRequest) -> Response:
        peer = _peer(request)
        query = pages.Query(request.query_params.multi_items())
        try:
            show_all = query.flag("all")
            state = query.choice("state", [s.value for s in RunState])
            owner = query.text("owner", pages.SHOWN_MAX)
        except ControlError as exc:
            return self._problem(request, exc)
        briefs: list[RunBrief] = []
        after: str | None = None
        while len(briefs) < RUNS_MAX:
            try:
                page = await self.runs.list(peer, ListRequest(all=show_all, after=after))
            except ControlError as exc:
                return self._problem(request, exc)
            briefs += page["runs"]
            after = page["next"]
            if after is None:
                break
        stages: dict[str, str] = {}
        running = [b for b in briefs if b["state"] == RunState.RUNNING.value][:STAGES_MAX]
        for b in running:
            try:
                s = await self.runs.status(peer, StatusRequest(b["run"]))
            except ControlError:
                continue
            stages[b["run"]] = pages.stage_text(
                s["state"], [n["agent_state"] for n in s["health"].values()]
            )
        text = pages.runs_page(
            briefs,
            now=self.clock(),
            owner_names={b["owner_uid"]: self.owner(b["owner_uid"]) for b in briefs},
            stages=stages,
            state=state,
            owner=owner,
            states=[s.value for s in RunState],
            who=_who(request),
        )
        return self._html(text)

    async def _run(self, request: WebRequest) -> Response:
        peer, run = _peer(request), request.path_params["run"]
        try:
            pages.Query(request.query_params.multi_items()).rank()  # the page's log link's
            summary = await self.runs.status(peer, StatusRequest(run))
            results = await self.runs.results(peer, ResultsRequest(run))
        except ControlError as exc:
            return self._problem(request, exc)
        run_id = summary["run"]
        has_results = results["results"] is not None
        charts = build_charts([escaped_run(results)]) if has_results else []
        version = results_version(results)
        text = pages.run_page(
            summary,
            results if has_results else None,
            owner_name=self.owner(summary["owner_uid"]),
            charts=charts if have_matplotlib() else [],
            chart_src=lambda c: pages.chart_img(
                f"{pages.run_href(run_id)}/charts/{c.chart_id}.svg?v={version}", c
            ),
            who=_who(request),
        )
        return self._html(text)

    async def _run_chart(self, request: WebRequest) -> Response:
        peer, run = _peer(request), request.path_params["run"]
        try:
            results = await self.runs.results(peer, ResultsRequest(run))
        except ControlError as exc:
            return self._problem(request, exc)
        charts = build_charts([escaped_run(results)])
        key = ("run/" + results["run"], request.path_params["chart"], results_version(results))
        return await self._chart(key, charts)

    async def _campaigns(self, request: WebRequest) -> Response:
        peer = _peer(request)
        try:
            found = await self.api.campaigns.list(peer)
        except ControlError as exc:
            return self._problem(request, exc)
        campaigns = found["campaigns"]
        names = {c["owner_uid"]: self.owner(c["owner_uid"]) for c in campaigns}
        return self._html(pages.campaigns_page(campaigns, names, who=_who(request)))

    async def _campaign_jobs(
        self, ref: str, peer: Peer
    ) -> tuple[CampaignStatus, list[CampaignJobResults]]:
        campaigns = self.api.campaigns
        status = await campaigns.status(peer, CampaignRef(ref))
        jobs: list[CampaignJobResults] = []

        async def collect(item: CampaignJobResults) -> None:
            jobs.append(item)

        await campaigns.results(peer, CampaignRef(ref), collect)
        return status, jobs

    async def _campaign(self, request: WebRequest) -> Response:
        peer, ref = _peer(request), request.path_params["campaign"]
        try:
            status, jobs = await self._campaign_jobs(ref, peer)
        except ControlError as exc:
            return self._problem(request, exc)
        version = results_version(jobs)
        href = pages.campaign_href(status["campaign"])
        text = pages.campaign_page(
            status,
            charts=campaign_charts(jobs) if have_matplotlib() else [],
            chart_src=lambda c: pages.chart_img(f"{href}/charts/{c.chart_id}.svg?v={version}", c),
            owner_name=self.owner(status["owner_uid"]),
            who=_who(request),
        )
        return self._html(text)

    async def _campaign_chart(self, request: WebRequest) -> Response:
        peer, ref = _peer(request), request.path_params["campaign"]
        try:
            status, jobs = await self._campaign_jobs(ref, peer)
        except ControlError as exc:
            return self._problem(request, exc)
        chart_id = request.path_params["chart"]
        key = ("campaign/" + status["campaign"], chart_id, results_version(jobs))
        return await self._chart(key, campaign_charts(jobs))

    async def _chart(self, key: tuple[str, str, str], charts: list[Chart]) -> Response:
        """One chart as SVG, drawn off the loop, once per results version."""
        chart = next((c for c in charts if c.chart_id == key[1] and c.series), None)
        if chart is None:
            return Response("no such chart\n", status_code=404, media_type="text/plain")
        svg = self._charts.get(key)
        if svg is None:
            if not have_matplotlib():
                return Response(
                    "charts need matplotlib (the report extra)\n",
                    status_code=404,
                    media_type="text/plain",
                )
            async with self._draw_lock:
                svg = self._charts.get(key)
                if svg is None:
                    text = await anyio.to_thread.run_sync(chart_svg, chart)
                    svg = _svg_document(text)
                    self._charts[key] = svg
                    while len(self._charts) > CHARTS_CACHED:
                        self._charts.popitem(last=False)
        self._charts.move_to_end(key)
        return Response(
            svg,
            media_type="image/svg+xml",
            headers={"Content-Security-Policy": pages.CHART_CSP, "Cache-Control": "private"},
        )

    async def _events(self, request: WebRequest) -> Response:
        peer = _peer(request)
        try:
            status = pages.Query(request.query_params.multi_items()).choice(
                "status", pages.DELIVERY_STATUSES
            )
            found = await self.api.events.deliveries(peer, EventsListRequest(status=status or None))
        except ControlError as exc:
            return self._problem(request, exc)
        return self._html(pages.events_page(found["deliveries"], status=status, who=_who(request)))

    async def _script(self, request: WebRequest) -> Response:
        return Response(self._js, media_type="text/javascript")

    async def _style(self, request: WebRequest) -> Response:
        return Response(pages.DASHBOARD_CSS, media_type="text/css")

    # ----------------------------------------------------------------------- live logs

    async def _logs(self, request: WebRequest) -> Response:
        peer, run = _peer(request), request.path_params["run"]
        query = pages.Query(request.query_params.multi_items())
        try:
            rank = query.rank()
            given = query.offsets("from")
            # The header is the browser's own (a bad one starts afresh); `from` is a link's.
            resume = pages.decode_offsets(request.headers.get("last-event-id")) or given or {}
            summary = await self.runs.status(peer, StatusRequest(run))
        except ControlError as exc:
            return self._problem(request, exc)
        if not resume:
            root = Path(summary["archive"]) / LOGS
            resume = await anyio.to_thread.run_sync(tail_offsets, root)
        listener, viewer, shown = _viewer(request)
        streams = self._streams[listener]
        refusal = streams.refusal(viewer, shown)
        if refusal is not None:
            log.info("dashboard.stream_refused", reason=refusal[0], listener=listener, peer=shown)
            return Response(refusal[1] + "\n", status_code=503, media_type="text/plain")
        streams.opened(viewer)  # counted at once: a burst of requests cannot overshoot
        return _LogStream(self, summary["run"], rank, resume, peer, (streams, viewer))


class _LogStream(Response):
    """A run's log copies as server-sent events, from `offsets`, until the run is final
    (then an ``end`` event), the client goes, or the dashboard closes."""

    def __init__(
        self,
        dash: Dashboard,
        run: str,
        rank: int | None,
        offsets: dict[str, int],
        peer: Peer,
        held: tuple[Caps[int | str], int | str],
    ) -> None:
        # No body, so no Content-Length (as Starlette's StreamingResponse does it)
        self.status_code = 200
        self.background = None
        self.media_type = "text/event-stream"
        self.init_headers({"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self.dash, self.run, self.rank, self.offsets, self.peer = dash, run, rank, offsets, peer
        self.held = held  # the stream's place in its listener's caps, given back at its end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream(scope, receive, send)
        finally:
            self.held[0].closed(self.held[1])

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        if scope["method"] == "HEAD":
            await send({"type": "http.response.body", "body": b""})
            return
        lock = anyio.Lock()

        async def write(data: bytes) -> None:
            async with lock:
                await send({"type": "http.response.body", "body": data, "more_body": True})

        async def chunk(c: LogChunk) -> None:
            self.offsets[c["file"]] = c["end"]
            if len(self.offsets) > pages.OFFSETS_MAX_FILES:
                self.offsets.pop(next(iter(self.offsets)))
            data = c["data"].encode() if c["encoding"] == "utf-8" else _b64(c["data"])
            text = data.decode("utf-8", "replace")
            await write(
                pages.sse_event(
                    "log",
                    {"file": c["file"], "text": text},
                    pages.encode_offsets(self.offsets),
                )
            )

        async with anyio.create_task_group() as tg:

            async def until_gone() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            async def until_closing() -> None:
                await self.dash.closing.wait()
                tg.cancel_scope.cancel()

            async def ping() -> None:
                while True:
                    await anyio.sleep(SSE_PING_S)
                    await write(pages.SSE_PING)

            tg.start_soon(until_gone)
            tg.start_soon(until_closing)
            tg.start_soon(ping)
            follow = LogsRequest(self.run, self.rank, follow=True, offsets=dict(self.offsets))
            try:
                done = await self.dash.runs.logs(self.peer, follow, chunk)
                await write(pages.sse_event("end", {"state": done["state"]}))
            except ControlError as exc:
                await write(pages.sse_event("problem", {"message": exc.message}))
            tg.cancel_scope.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _b64(text: str) -> bytes:
    return base64.b64decode(text)


def _svg_document(svg: str) -> bytes:
    """matplotlib's inline `<svg>` element as a standalone SVG file."""
    return ('<?xml version="1.0" encoding="utf-8"?>\n' + svg).encode("utf-8")


# --------------------------------------------------------------------------- the guard


def _peer(request: WebRequest) -> Peer:
    peer = request.scope["state"].get("viewer")
    assert isinstance(peer, Peer)  # set by _Guard for every request it lets through
    return peer


def _viewer(request: WebRequest) -> tuple[str, int | str, str]:
    """The listener and who the viewer is in it, for the stream caps (as key and as shown):
    a uid on the Unix socket; on TCP, where every token holder is the same `TOKEN_PEER`,
    the source address."""
    state = request.scope["state"]
    if state.get("listener") == "unix":
        uid = _peer(request).uid
        return "unix", uid, f"uid {uid}"
    source = str(state.get("source") or "?")
    return "tcp", source, source


def _who(request: WebRequest) -> str:
    peer = _peer(request)
    if request.scope["state"].get("listener") == "tcp":
        return "token holder: every run"
    return f"{user_name_cached(peer.uid)} (uid {peer.uid})"


@functools.lru_cache(maxsize=1024)
def user_name_cached(uid: int) -> str:
    return user_name(uid) or f"uid {uid}"


class _Guard:
    """Method, listener, token and Host rules before the app; security headers after."""

    def __init__(self, app: ASGIApp, dash: Dashboard) -> None:
        self.app = app
        self.dash = dash

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        state = scope.setdefault("state", {})
        refusal = self._refusal(scope, state)

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                have = {k.lower() for k, _ in headers}
                for name, value in pages.SECURITY_HEADERS.items():
                    if name.lower().encode() not in have:
                        headers.append((name.lower().encode(), value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        if refusal is not None:
            await refusal(scope, receive, secured)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await secured(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            # Logged here, as an event; uvicorn would print it outside the JSON log.
            log.exception("dashboard.request_failed", path=pages.job(scope["path"], 200))
            if not started:
                await _plain(500, "The dashboard failed; see the daemon log.")(
                    scope, receive, secured
                )

    def _refusal(self, scope: Scope, state: dict[str, Any]) -> ASGIApp | None:
        method = scope["method"]
        if method not in ("GET", "HEAD"):
            return Response(
                "The dashboard is read-only: GET and HEAD only.\n",
                status_code=405,
                headers={"Allow": "GET, HEAD"},
                media_type="text/plain",
            )
        listener = state.get("listener")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if not pages.host_allowed(headers.get("host"), self.dash.config.hosts):
            # Through `ssh -L` the Unix socket is a loopback port on a workstation: a page
            # of another site must not reach it by pointing its own name at 127.0.0.1.
            log.info("dashboard.host_refused", host=pages.job(headers.get("host", ""), 100))
            return _plain(
                403,
                "The Host header names neither the loopback nor a host in dashboard.hosts; "
                "open the dashboard as http://localhost:PORT/.",
            )
        if listener == "unix":
            peer = state.get("peer")
            if not isinstance(peer, Peer):
                return _plain(403, "The peer's credentials could not be read.")
            state["viewer"] = peer
            return None
        if listener != "tcp" or self.dash.token is None:
            return _plain(403, "This listener serves no dashboard.")
        cookie = _cookie(headers.get("cookie", ""), pages.TOKEN_COOKIE)
        if pages.token_matches(cookie, self.dash.token):
            state["viewer"] = TOKEN_PEER
            return None
        query = WebRequest(scope).query_params
        if pages.token_matches(query.get(pages.TOKEN_PARAM), self.dash.token):
            # Keep it in a cookie and drop it from the address bar (and from history).
            response = RedirectResponse(scope["path"] or "/", status_code=303)
            response.set_cookie(
                pages.TOKEN_COOKIE,
                self.dash.token,
                httponly=True,
                samesite="strict",
                path="/",
            )
            return response
        return _plain(
            403,
            "This dashboard needs its token: open http://localhost:PORT/?token=... with the "
            "token from the file the daemon logged (dashboard.token_file or "
            "<state_dir>/dashboard.token).",
        )


def _plain(status: int, text: str) -> Response:
    return Response(text + "\n", status_code=status, media_type="text/plain")


def _cookie(header: str, name: str) -> str | None:
    for part in header.split(";"):
        key, eq, value = part.strip().partition("=")
        if eq and key == name:
            return value
    return None


# --------------------------------------------------------------------------- serving


async def serve_dashboard(
    api: ControlApi[Any],
    config: Config,
    *,
    clock: Callable[[], datetime] = utcnow,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the dashboard on its Unix socket (and loopback TCP when configured) until
    cancelled; ready once both listen. The socket gets the control socket's group and
    (unless ``dashboard.socket_mode`` says otherwise) its mode; its file is removed on the
    way out. Raises `ControlSocketError` or `ConfigError` when a listener cannot be set up.
    """
    d = config.dashboard
    path = config.dashboard_socket
    mode = d.socket_mode if d.socket_mode is not None else config.socket_mode
    sock, identity = await bind_unix_socket(path, mode, config.socket_group)
    sockets = [sock]
    try:
        token, token_path = None, None
        if d.tcp is not None:
            sockets.append(bind_tcp(d.tcp, "dashboard.tcp"))
            token, token_path = await anyio.to_thread.run_sync(load_token, d, config.state_dir)
        dash = Dashboard(api, d, token=token, clock=clock)
        log.info(
            "dashboard.listening",
            socket=str(path),
            mode=f"{mode:04o}",
            tcp=d.tcp,
            token_file=None if token_path is None else str(token_path),
            reach=f"ssh -L 8080:{path} {socket.gethostname() or 'LOGIN-NODE'}, then "
            "http://localhost:8080/",
            **dataclasses.asdict(d.limits),
        )
        await serve_asgi(
            dash.app(),
            sockets,
            name="dashboard",
            limits=d.limits,
            on_stop=dash.stop,
            task_status=task_status,
        )
    finally:
        for s in sockets:
            s.close()
        remove_socket_file(path, identity)
