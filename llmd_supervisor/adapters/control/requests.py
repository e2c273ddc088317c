"""The typed request of every op: one frozen dataclass per op, decoded once from a request
that passed the schema of `protocol.OPS` (`decode_args`).

The schema has already checked each argument's JSON kind and filled in the defaults, so
decoding only gives the values their Python types; what an argument means (a page size
within bounds, a cursor a previous page gave) is checked by whoever serves the request
(`supervision.control.service.RunsService`), so that a caller inside the daemon (the
dashboard) is held to the same rules. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from llmd_supervisor.adapters.control.protocol import Request

__all__ = [
    "REQUESTS",
    "AdoptRequest",
    "ArchiveRequest",
    "CampaignListRequest",
    "CampaignRef",
    "CampaignSubmitRequest",
    "CancelRequest",
    "EventsListRequest",
    "EventsReplayRequest",
    "EventsShowRequest",
    "EventsTestRequest",
    "ListRequest",
    "LogsRequest",
    "NodesRequest",
    "OpRequest",
    "PingRequest",
    "ResultsRequest",
    "StatusRequest",
    "SubmitRequest",
    "SubmitScriptRequest",
    "WaitRequest",
    "WatchRequest",
    "decode_args",
]


def _str(args: Mapping[str, object], name: str) -> str:
    value = args[name]
    assert isinstance(value, str), name  # the schema let only a string through
    return value


def _opt_str(args: Mapping[str, object], name: str) -> str | None:
    value = args[name]
    assert value is None or isinstance(value, str), name
    return value


def _bool(args: Mapping[str, object], name: str) -> bool:
    value = args[name]
    assert isinstance(value, bool), name
    return value


def _opt_int(args: Mapping[str, object], name: str) -> int | None:
    value = args[name]
    assert value is None or (isinstance(value, int) and not isinstance(value, bool)), name
    return value


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class PingRequest:
    """``ping``."""


@dataclass(frozen=True)
class SubmitRequest:
    """``submit``: a run spec's text; with `dry_run` only its batch script."""

    spec_toml: str
    spec_path: str | None = None  # only for messages
    dry_run: bool = False
    cluster: str | None = None  # None: the daemon's first configured cluster


@dataclass(frozen=True)
class SubmitScriptRequest:
    """``submit_script``: a user's batch script as a foreign spec (JSON)."""

    spec_json: str
    cluster: str | None = None


@dataclass(frozen=True)
class AdoptRequest:
    """``adopt``: a job submitted without the daemon, as a foreign spec (JSON)."""

    spec_json: str
    cluster: str | None = None


@dataclass(frozen=True)
class ListRequest:
    """``list``: one page of briefs (`after`: the previous page's ``next``)."""

    all: bool = False
    limit: int | None = None
    after: str | None = None
    cluster: str | None = None  # None: every cluster's


@dataclass(frozen=True)
class StatusRequest:
    """``status``: one run by its ref (run id, job name, job id or CLUSTER:JOBID)."""

    run: str


@dataclass(frozen=True)
class NodesRequest:
    """``nodes``: the quarantined nodes; `release` one first (admins only)."""

    release: str | None = None
    cluster: str | None = None


@dataclass(frozen=True)
class LogsRequest:
    """``logs``: a run's log copies from `offsets` (file -> byte), following with `follow`."""

    run: str
    rank: int | None = None
    follow: bool = False
    offsets: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CancelRequest:
    """``cancel``."""

    run: str


@dataclass(frozen=True)
class WaitRequest:
    """``wait``: a summary whenever the run changed, until it is final."""

    run: str


@dataclass(frozen=True)
class WatchRequest:
    """A subscription to a run's state changes inside the daemon (no op of its own)."""

    run: str


@dataclass(frozen=True)
class ArchiveRequest:
    """``archive``."""

    run: str


@dataclass(frozen=True)
class ResultsRequest:
    """``results``."""

    run: str


# --------------------------------------------------------------------------- campaigns


@dataclass(frozen=True)
class CampaignSubmitRequest:
    """``campaign_submit``: a campaign file and its base spec's (or batch script's) text."""

    file_text: str
    base_text: str
    name: str
    file_path: str | None = None  # only for messages
    file_dir: str | None = None
    export_env_json: str | None = None
    dry_run: bool = False
    rerun: bool = False
    max_points: int | None = None
    cluster: str | None = None


@dataclass(frozen=True)
class CampaignListRequest:
    """``campaign_list``."""


@dataclass(frozen=True)
class CampaignRef:
    """``campaign_status``, ``campaign_cancel``, ``campaign_wait``, ``campaign_results``:
    one campaign by its id or name."""

    campaign: str


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class EventsListRequest:
    """``events_list``: deliveries of one run (a run ref) and in one status."""

    run: str | None = None
    status: str | None = None


@dataclass(frozen=True)
class EventsShowRequest:
    """``events_show``."""

    event: str


@dataclass(frozen=True)
class EventsReplayRequest:
    """``events_replay``: a dead or disabled delivery queued again."""

    event: str
    destination: str | None = None


@dataclass(frozen=True)
class EventsTestRequest:
    """``events_test``: a test.ping to one configured destination."""

    destination: str


OpRequest = (
    PingRequest
    | SubmitRequest
    | SubmitScriptRequest
    | AdoptRequest
    | ListRequest
    | StatusRequest
    | NodesRequest
    | LogsRequest
    | CancelRequest
    | WaitRequest
    | ArchiveRequest
    | ResultsRequest
    | CampaignSubmitRequest
    | CampaignListRequest
    | CampaignRef
    | EventsListRequest
    | EventsShowRequest
    | EventsReplayRequest
    | EventsTestRequest
)


def _offsets(args: Mapping[str, object]) -> Mapping[str, int]:
    given = args["offsets"]  # validated: str -> non-negative int, or None
    if not isinstance(given, Mapping):
        return {}
    return {str(k): v for k, v in given.items() if isinstance(v, int)}


def _run(a: Mapping[str, object]) -> str:
    return _str(a, "run")


def _campaign(a: Mapping[str, object]) -> CampaignRef:
    return CampaignRef(_str(a, "campaign"))


# The one table of how each op's arguments become its request; it must match OPS
# (`supervision.control.api` checks it at import, beside its handlers).
REQUESTS: Final[Mapping[str, Callable[[Mapping[str, object]], OpRequest]]] = MappingProxyType(
    {
        "ping": lambda a: PingRequest(),
        "submit": lambda a: SubmitRequest(
            _str(a, "spec_toml"),
            _opt_str(a, "spec_path"),
            _bool(a, "dry_run"),
            _opt_str(a, "cluster"),
        ),
        "submit_script": lambda a: SubmitScriptRequest(
            _str(a, "spec_json"), _opt_str(a, "cluster")
        ),
        "adopt": lambda a: AdoptRequest(_str(a, "spec_json"), _opt_str(a, "cluster")),
        "list": lambda a: ListRequest(
            _bool(a, "all"), _opt_int(a, "limit"), _opt_str(a, "after"), _opt_str(a, "cluster")
        ),
        "status": lambda a: StatusRequest(_run(a)),
        "nodes": lambda a: NodesRequest(_opt_str(a, "release"), _opt_str(a, "cluster")),
        "logs": lambda a: LogsRequest(
            _run(a), _opt_int(a, "rank"), _bool(a, "follow"), _offsets(a)
        ),
        "cancel": lambda a: CancelRequest(_run(a)),
        "wait": lambda a: WaitRequest(_run(a)),
        "archive": lambda a: ArchiveRequest(_run(a)),
        "results": lambda a: ResultsRequest(_run(a)),
        "campaign_submit": lambda a: CampaignSubmitRequest(
            file_text=_str(a, "file_text"),
            base_text=_str(a, "base_text"),
            name=_str(a, "name"),
            file_path=_opt_str(a, "file_path"),
            file_dir=_opt_str(a, "file_dir"),
            export_env_json=_opt_str(a, "export_env_json"),
            dry_run=_bool(a, "dry_run"),
            rerun=_bool(a, "rerun"),
            max_points=_opt_int(a, "max_points"),
            cluster=_opt_str(a, "cluster"),
        ),
        "campaign_list": lambda a: CampaignListRequest(),
        "campaign_status": _campaign,
        "campaign_cancel": _campaign,
        "campaign_wait": _campaign,
        "campaign_results": _campaign,
        "events_list": lambda a: EventsListRequest(_opt_str(a, "run"), _opt_str(a, "status")),
        "events_show": lambda a: EventsShowRequest(_str(a, "event")),
        "events_replay": lambda a: EventsReplayRequest(
            _str(a, "event"), _opt_str(a, "destination")
        ),
        "events_test": lambda a: EventsTestRequest(_str(a, "destination")),
    }
)


def decode_args(request: Request) -> OpRequest:
    """The typed request of a request that passed `protocol.decode_request`."""
    return REQUESTS[request.op](request.args)
