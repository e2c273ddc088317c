"""The control API: the control socket's ops, decoded and handed to the typed services.

`ControlApi` is the `Handler` the daemon root serves on its control socket. It does no
work of its own: each op's arguments become the op's typed request once
(`adapters.control.requests.decode_args`), the request goes to the service that owns it
(`RunsService` for runs, `CampaignOps` for campaigns, `EventOps` for outbound events)
with the peer, and the typed answer goes back as the reply (stream items through `send`).
Its ops are one table (`HANDLERS`, keyed by op name) that is checked against the
protocol's `OPS` when this module is imported: an op without a handler, a handler without
an op, or a streaming mismatch raises there, not at the first request. Results and stream
items are the typed structures of `llmd_supervisor.core.protocol.runs` (the campaign ops':
`core.campaign.views`).

Access is the services' (`RunsService`: a peer sees and acts on its own runs; root and the
admin group on every run; a run the peer may not see is ``not_found``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any, Final, Generic, TypeVar

import structlog

from llmd_supervisor.adapters.control.protocol import OPS, OpSpec, Peer, Request, Send
from llmd_supervisor.adapters.control.requests import (
    REQUESTS,
    AdoptRequest,
    ArchiveRequest,
    CampaignListRequest,
    CampaignRef,
    CampaignSubmitRequest,
    CancelRequest,
    EventsListRequest,
    EventsReplayRequest,
    EventsShowRequest,
    EventsTestRequest,
    ListRequest,
    LogsRequest,
    NodesRequest,
    OpRequest,
    PingRequest,
    ResultsRequest,
    StatusRequest,
    SubmitRequest,
    SubmitScriptRequest,
    WaitRequest,
    decode_args,
)
from llmd_supervisor.core.config import SocketLimits
from llmd_supervisor.errors import ControlError, SupervisorError
from llmd_supervisor.supervision.campaign.api import CampaignOps
from llmd_supervisor.supervision.control.service import RunsService, SupervisorView
from llmd_supervisor.supervision.control.views import HandleView, run_brief, run_summary
from llmd_supervisor.supervision.events.api import EventOps
from llmd_supervisor.supervision.run.verify_job import utcnow

__all__ = [
    "HANDLERS",
    "ControlApi",
    "Op",
    "SupervisorView",
    "check_handlers",
    "run_brief",
    "run_summary",
]

log = structlog.get_logger("llmd_supervisor.supervision.api")

H = TypeVar("H", bound=HandleView)


# --------------------------------------------------------------------------- the API


class ControlApi(Generic[H]):
    """Answers control-socket requests through the typed services (a `Handler`)."""

    def __init__(
        self,
        supervisor: SupervisorView[H],
        *,
        clock: Callable[[], datetime] = utcnow,
        campaigns: CampaignOps | None = None,
        events: EventOps | None = None,
        runs: RunsService[H] | None = None,
    ) -> None:
        self.sup = supervisor
        self.clock = clock
        self.runs: RunsService[H] = runs or RunsService(supervisor, clock=clock)
        self._campaigns = campaigns
        self._events = events

    @property
    def campaigns(self) -> CampaignOps:
        if self._campaigns is None:
            raise ControlError("internal", "This daemon serves no campaigns.")
        return self._campaigns

    @property
    def events(self) -> EventOps:
        if self._events is None:
            raise ControlError("internal", "This daemon serves no outbound events.")
        return self._events

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        return await HANDLERS[request.op].handler(self, decode_args(request), peer, send)

    @property
    def socket_limits(self) -> SocketLimits:
        """The daemon's control-socket limits (the server takes them from its handler)."""
        return self.runs.config.socket_limits


OpHandler = Callable[[ControlApi[Any], OpRequest, Peer, Send], Awaitable[Mapping[str, object]]]


@dataclass(frozen=True)
class Op:
    """One row of the API table: the op's handler, whether it streams, and the typed
    request it takes (`adapters.control.requests`; None: any)."""

    handler: OpHandler
    streaming: bool = False
    request: type[object] | None = None  # one of OpRequest's types


R = TypeVar("R", bound=OpRequest)


def _op(
    kind: type[R],
    call: Callable[[ControlApi[Any], R, Peer, Send], Awaitable[Mapping[str, object]]],
    *,
    streaming: bool = False,
) -> Op:
    """A table row whose handler takes requests of `kind` (the op's, by `decode_args`)."""

    async def handler(
        api: ControlApi[Any], req: OpRequest, peer: Peer, send: Send
    ) -> Mapping[str, object]:
        if not isinstance(req, kind):
            raise SupervisorError(
                f"The control API was given a {type(req).__name__} where its table expects a "
                f"{kind.__name__}; the op tables of adapters.control disagree."
            )
        return await call(api, req, peer, send)

    return Op(handler, streaming, kind)


async def _pong(
    api: ControlApi[Any], req: PingRequest, peer: Peer, send: Send
) -> Mapping[str, object]:
    return {"pong": True}


# The one table of which service answers each op; it must match the protocol's OPS exactly.
HANDLERS: Final[Mapping[str, Op]] = MappingProxyType(
    {
        "ping": _op(PingRequest, _pong),
        "submit": _op(SubmitRequest, lambda api, r, p, s: api.runs.submit(p, r)),
        "submit_script": _op(
            SubmitScriptRequest, lambda api, r, p, s: api.runs.submit_script(p, r)
        ),
        "adopt": _op(AdoptRequest, lambda api, r, p, s: api.runs.adopt(p, r)),
        "list": _op(ListRequest, lambda api, r, p, s: api.runs.list(p, r)),
        "status": _op(StatusRequest, lambda api, r, p, s: api.runs.status(p, r)),
        "nodes": _op(NodesRequest, lambda api, r, p, s: api.runs.nodes(p, r)),
        "logs": _op(LogsRequest, lambda api, r, p, s: api.runs.logs(p, r, s), streaming=True),
        "cancel": _op(CancelRequest, lambda api, r, p, s: api.runs.cancel(p, r)),
        "wait": _op(WaitRequest, lambda api, r, p, s: api.runs.wait(p, r, s), streaming=True),
        "archive": _op(ArchiveRequest, lambda api, r, p, s: api.runs.archive(p, r)),
        "results": _op(ResultsRequest, lambda api, r, p, s: api.runs.results(p, r)),
        "campaign_submit": _op(
            CampaignSubmitRequest,
            lambda api, r, p, s: api.campaigns.submit(p, r),
            streaming=True,
        ),
        "campaign_list": _op(CampaignListRequest, lambda api, r, p, s: api.campaigns.list(p)),
        "campaign_status": _op(CampaignRef, lambda api, r, p, s: api.campaigns.status(p, r)),
        "campaign_cancel": _op(CampaignRef, lambda api, r, p, s: api.campaigns.cancel(p, r)),
        "campaign_wait": _op(
            CampaignRef, lambda api, r, p, s: api.campaigns.wait(p, r, s), streaming=True
        ),
        "campaign_results": _op(
            CampaignRef, lambda api, r, p, s: api.campaigns.results(p, r, s), streaming=True
        ),
        "events_list": _op(EventsListRequest, lambda api, r, p, s: api.events.deliveries(p, r)),
        "events_show": _op(EventsShowRequest, lambda api, r, p, s: api.events.event(p, r)),
        "events_replay": _op(
            EventsReplayRequest, lambda api, r, p, s: api.events.queue_again(p, r)
        ),
        "events_test": _op(EventsTestRequest, lambda api, r, p, s: api.events.ping(p, r)),
    }
)


def check_handlers(handlers: Mapping[str, Op], ops: Mapping[str, OpSpec]) -> None:
    """Raise `SupervisorError` unless `handlers` has exactly the ops of `ops`, streaming alike."""
    problems = [f"op {op!r} has no handler" for op in sorted(set(ops) - set(handlers))]
    problems += [f"handler {op!r} is not an op" for op in sorted(set(handlers) - set(ops))]
    problems += [
        f"op {op!r} {'streams' if ops[op].streaming else 'does not stream'} but its handler "
        f"{'does not' if ops[op].streaming else 'does'}"
        for op in sorted(set(ops) & set(handlers))
        if ops[op].streaming != handlers[op].streaming
    ]
    if problems:
        raise SupervisorError(
            f"The control API does not match the protocol's table of ops: {'; '.join(problems)}."
        )


check_handlers(HANDLERS, OPS)
if set(REQUESTS) != set(OPS):
    raise SupervisorError(
        "The control protocol's typed requests (adapters.control.requests.REQUESTS) do not "
        f"match its table of ops: {', '.join(sorted(set(REQUESTS) ^ set(OPS)))}."
    )
