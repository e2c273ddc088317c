"""``llmd-supervisor events``: the daemon's outbound events and their deliveries.

``events list [--run RUN] [--status STATUS]``, ``events show ID``, ``events replay ID
[--destination NAME]`` (a dead or disabled delivery is queued again, with a new series of
attempts) and ``events test DEST`` (a test.ping to one destination; admins). An
expected failure is one line on stderr and an exit status, never a traceback
(`cli.common`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from llmd_supervisor.adapters.control.client import ControlClient
from llmd_supervisor.cli.common import _exits, _read, _run, fit_to_terminal
from llmd_supervisor.core.events.outbox import (
    DeliveryStatus,
    DeliveryView,
    EventList,
    EventView,
    PingQueued,
    Replayed,
)
from llmd_supervisor.core.run.jobtext import job_text

__all__ = ["add_parsers", "delivery_table"]


def add_parsers(sub: argparse._SubParsersAction[Any], socket_default: Callable[[], Path]) -> None:
    top = sub.add_parser(
        "events",
        help="outbound events (webhook, Slack) and their deliveries",
        description="The events the daemon sends to the destinations configured in its "
        "[[events.destination]] tables, and where each delivery stands. See README.md, Events.",
    )
    esub = top.add_subparsers(dest="events_op", metavar="OP", required=True)

    def common(name: str, help_: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = esub.add_parser(name, help=help_, description=help_)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "--socket", type=Path, default=socket_default(), help="daemon control socket"
        )
        return p

    p = common("list", "deliveries, newest event first")
    p.add_argument("--run", default=None, metavar="RUN", help="only this run's events")
    p.add_argument(
        "--status",
        default=None,
        choices=[s.value for s in DeliveryStatus],
        help="only deliveries in this status",
    )
    p.set_defaults(handler=_cmd_list)
    p = common("show", "one event: its body and its deliveries")
    p.add_argument("event", metavar="ID", help="the event id (evt_...)")
    p.set_defaults(handler=_cmd_show)
    p = common("replay", "queue an event's dead or disabled deliveries again")
    p.add_argument("event", metavar="ID", help="the event id (evt_...)")
    p.add_argument(
        "--destination", default=None, metavar="NAME", help="only the delivery to this one"
    )
    p.set_defaults(handler=_cmd_replay)
    p = common("test", "send a test.ping event to one destination (root, the admin group)")
    p.add_argument("destination", metavar="DEST", help="a configured destination's name")
    p.set_defaults(handler=_cmd_test)


def _call(args: argparse.Namespace, op: str, params: Mapping[str, object]) -> object:
    async def go() -> Mapping[str, object]:
        async with ControlClient(args.socket) as c:
            return await c.call(op, params)

    return _run(f"events {args.events_op}", go)


@_exits
def _cmd_list(args: argparse.Namespace) -> int:
    found = _read(
        "events list",
        EventList,
        _call(args, "events_list", {"run": args.run, "status": args.status}),
    )
    if args.json:
        print(json.dumps(found, indent=2, sort_keys=True))
        return 0
    for line in fit_to_terminal(delivery_table(found["deliveries"])):
        print(line)
    return 0


@_exits
def _cmd_show(args: argparse.Namespace) -> int:
    event = _read("events show", EventView, _call(args, "events_show", {"event": args.event}))
    if args.json:
        print(json.dumps(event, indent=2, sort_keys=True))
        return 0
    print(f"event {event['event']}: {event['type']} of {job_text(event['subject'])}")
    print(f"  at {event['created_at']}")
    for line in delivery_table(event["deliveries"]):
        print(f"  {line}")
    print(json.dumps(event["body"], indent=2, sort_keys=True, ensure_ascii=True))
    return 0


@_exits
def _cmd_replay(args: argparse.Namespace) -> int:
    params = {"event": args.event, "destination": args.destination}
    done = _read("events replay", Replayed, _call(args, "events_replay", params))
    if args.json:
        print(json.dumps(done, indent=2, sort_keys=True))
        return 0
    print(f"event {done['event']}: {done['queued']} deliveries queued again")
    return 0


@_exits
def _cmd_test(args: argparse.Namespace) -> int:
    params = {"destination": args.destination}
    done = _read("events test", PingQueued, _call(args, "events_test", params))
    if args.json:
        print(json.dumps(done, indent=2, sort_keys=True))
        return 0
    print(
        f"test.ping {done['event']} queued for {job_text(done['destination'])}; "
        f"`llmd-supervisor events show {done['event']}` tells how its delivery went"
    )
    return 0


def delivery_table(deliveries: list[DeliveryView]) -> list[str]:
    """Deliveries as text: a header and a line each, in columns as wide as needed."""
    if not deliveries:
        return ["no deliveries"]
    rows = [("EVENT", "TYPE", "SUBJECT", "DESTINATION", "STATUS", "ATTEMPTS", "NEXT/LAST")]
    for d in deliveries:
        last = d["next_at"] or d["updated_at"]
        error = f"  {d['last_error']}" if d["last_error"] else ""
        rows.append(
            (
                d["event"],
                d["type"],
                job_text(d["subject"], 80),
                job_text(d["destination"], 64),
                d["status"],
                str(d["attempts"]),
                job_text(last + error, 200),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    ]
