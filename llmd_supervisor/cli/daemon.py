"""CLI subcommands that run or talk to the daemon: daemon, submit, list, status, logs,
cancel, wait, archive.

Every client command takes `--json` (machine output) and `--socket`. `submit --wait` and
`wait` exit 0 only for `succeeded` (the other outcomes use `verify`'s exit codes). A
client that gets SIGINT/SIGTERM while waiting forwards a cancel for its run unless
`--detach` was given; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

from llmd_supervisor.core.verdict import Outcome
from llmd_supervisor.errors import ControlError, SupervisorError

DEFAULT_SOCKET = Path("/run/llmd-supervisor/control.sock")
EXIT_DAEMON_UNREACHABLE = 3


def socket_default() -> Path:
    return Path(os.environ.get("LLMD_SUPERVISOR_SOCKET", str(DEFAULT_SOCKET)))


def add_parsers(sub: argparse._SubParsersAction[Any]) -> None:
    d = sub.add_parser("daemon", help="run the supervisor daemon (foreground)")
    d.add_argument(
        "--config",
        type=Path,
        default=None,
        help="config TOML (default: $LLMD_SUPERVISOR_CONFIG or /etc/llmd-supervisor/config.toml)",
    )
    d.set_defaults(handler=cmd_daemon)

    def client(name: str, help_: str, *, run: bool = True) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_)
        if run:
            p.add_argument("run", metavar="RUN", help="run id, job name or Slurm job id")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "--socket", type=Path, default=socket_default(), help="daemon control socket"
        )
        return p

    p = client("submit", "submit a run spec to the daemon", run=False)
    p.add_argument("spec", metavar="SPEC", type=Path)
    p.add_argument("--wait", action="store_true", help="wait for the verified outcome")
    p.add_argument("--follow", action="store_true", help="print the batch log while waiting")
    p.add_argument("--dry-run", action="store_true", help="validate and print the script only")
    p.add_argument("--detach", action="store_true", help="on Ctrl-C stop waiting, keep the run")
    p.add_argument(
        "--cluster", default=None, help="the configured cluster to run on (default: the first)"
    )
    p.set_defaults(handler=cmd_submit)
    p = client("list", "list runs", run=False)
    p.add_argument("--all", action="store_true", help="include finished runs")
    p.set_defaults(handler=cmd_simple, op="list")
    client("status", "show one run").set_defaults(handler=cmd_simple, op="status")
    client("cancel", "cancel a run (TERM, grace, then kill)").set_defaults(
        handler=cmd_simple, op="cancel"
    )
    client("archive", "print a run's archive directory").set_defaults(
        handler=cmd_simple, op="archive"
    )
    p = client("logs", "print a run's logs (local copies)")
    p.add_argument(
        "--rank", type=int, default=None, help="one rank's logs instead of the batch log"
    )
    p.add_argument("--follow", action="store_true", help="keep printing until the run ends")
    p.set_defaults(handler=cmd_logs)
    p = client("wait", "wait for a run's verified outcome")
    p.add_argument("--detach", action="store_true", help="on Ctrl-C stop waiting, keep the run")
    p.set_defaults(handler=cmd_wait)


# --- daemon -------------------------------------------------------------------------------


def cmd_daemon(args: argparse.Namespace) -> int:
    from llmd_supervisor.adapters.log import configure
    from llmd_supervisor.adapters.sdnotify import Notifier, watchdog_interval
    from llmd_supervisor.cli.config import config_default
    from llmd_supervisor.core.config import read_config
    from llmd_supervisor.supervision.daemon import serve

    try:
        config = read_config(args.config or config_default())
    except SupervisorError as exc:
        print(f"llmd-supervisor daemon: {exc}", file=sys.stderr)
        return 2
    configure(
        json={"auto": None, "json": True, "console": False}[config.log_format], stream=sys.stdout
    )
    notifier = Notifier.from_environ()
    try:
        anyio.run(
            functools.partial(serve, config, notify=notifier.notify, watchdog_s=watchdog_interval())
        )
    except SupervisorError as exc:
        notifier.notify(f"STATUS=failed: {exc}")
        print(f"llmd-supervisor daemon: {exc}", file=sys.stderr)
        return 1
    finally:
        notifier.close()
    return 0


# --- clients ------------------------------------------------------------------------------


def _fail(command: str, exc: Exception) -> int:
    print(f"llmd-supervisor {command}: {exc}", file=sys.stderr)
    return 2 if isinstance(exc, ControlError) else EXIT_DAEMON_UNREACHABLE


def cmd_simple(args: argparse.Namespace) -> int:
    from llmd_supervisor.adapters.control import ControlClient

    params: dict[str, object] = {}
    if args.op == "list":
        params["all"] = args.all
    else:
        params["run"] = args.run

    async def go() -> dict[str, object]:
        async with ControlClient(args.socket) as c:
            return await c.call(args.op, params)

    try:
        result = anyio.run(go)
    except SupervisorError as exc:
        return _fail(args.op, exc)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif args.op == "list":
        runs = result.get("runs", [])
        assert isinstance(runs, list)
        print(f"{'RUN':14} {'STATE':12} {'JOB':>8} {'NODES':>5} OUTCOME / REASON")
        for r in runs:
            print(
                f"{r['run']:14} {r['state']:12} {r['slurm_job_id'] or '-':>8} "
                f"{len(r['nodes']):>5} {r['outcome'] or ''} {r['reason']}".rstrip()
            )
    elif args.op == "archive":
        print(result["archive"])
    else:
        _print_summary(result)
    return 0


def _print_summary(r: Mapping[str, object]) -> None:
    print(f"run {r['run']} ({r['job_name']}): {r['state']}")
    print(f"  slurm job {r['slurm_job_id'] or '-'}, attempt {r['attempt']}, cluster {r['cluster']}")
    nodes = r.get("nodes") or []
    assert isinstance(nodes, list)
    if nodes:
        print(f"  nodes {','.join(map(str, nodes))} ({r['nodes_healthy']}/{len(nodes)} reachable)")
    if r.get("outcome"):
        print(f"  outcome {r['outcome']}: {r['reason']}")
    print(f"  archive {r['archive']}")


def cmd_submit(args: argparse.Namespace) -> int:
    from llmd_supervisor.adapters.control import ControlClient

    try:
        spec_toml = args.spec.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"llmd-supervisor submit: cannot read {args.spec}: {exc}", file=sys.stderr)
        return 2

    async def go() -> dict[str, object]:
        async with ControlClient(args.socket) as c:
            return await c.call(
                "submit",
                {
                    "spec_toml": spec_toml,
                    "spec_path": str(args.spec),
                    "dry_run": args.dry_run,
                    "cluster": args.cluster,
                },
            )

    try:
        result = anyio.run(go)
    except SupervisorError as exc:
        return _fail("submit", exc)
    if args.dry_run:
        sys.stdout.write(str(result["script"]))
        return 0
    if not args.wait and not args.follow:
        if args.json:
            print(json.dumps(result, indent=2, sort_keys=True))
        else:
            print(f"submitted run {result['run']} ({result['job_name']})")
        return 0
    if not args.json:
        print(f"submitted run {result['run']} ({result['job_name']})", file=sys.stderr)
    return _wait(
        args.socket, str(result["run"]), detach=args.detach, follow=args.follow, as_json=args.json
    )


def cmd_wait(args: argparse.Namespace) -> int:
    return _wait(args.socket, args.run, detach=args.detach, follow=False, as_json=args.json)


def cmd_logs(args: argparse.Namespace) -> int:
    from llmd_supervisor.adapters.control import ControlClient

    async def go() -> None:
        async with ControlClient(args.socket) as c:
            params = {"run": args.run, "rank": args.rank, "follow": args.follow}
            async for item in c.stream("logs", params):
                if "final" in item:
                    continue
                if args.json:
                    print(json.dumps(item), flush=True)
                else:
                    sys.stdout.write(str(item["data"]))
                    sys.stdout.flush()

    try:
        anyio.run(go)
    except SupervisorError as exc:
        return _fail("logs", exc)
    return 0


def _wait(socket_path: Path, run: str, *, detach: bool, follow: bool, as_json: bool) -> int:
    """Stream `wait` (and the batch log when following) until the outcome; exit by outcome."""
    from llmd_supervisor.adapters.control import ControlClient
    from llmd_supervisor.supervision.verify import EXIT_CODES

    tty = sys.stderr.isatty() and not as_json
    final: dict[str, object] = {}

    async def forward_signals(scope: anyio.CancelScope) -> None:
        cancel_sent = False
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if detach or cancel_sent:
                    scope.cancel()
                    return
                cancel_sent = True
                print(
                    f"\nllmd-supervisor: cancelling run {run} (again: stop waiting)",
                    file=sys.stderr,
                )
                try:
                    async with ControlClient(socket_path) as c:
                        await c.call("cancel", {"run": run})
                except ControlError as exc:
                    print(f"llmd-supervisor: {exc}", file=sys.stderr)

    async def follow_logs() -> None:
        async with ControlClient(socket_path) as c:
            async for item in c.stream("logs", {"run": run, "follow": True}):
                if "data" in item:
                    sys.stdout.write(str(item["data"]))
                    sys.stdout.flush()

    async def go() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(forward_signals, tg.cancel_scope)
            if follow:
                tg.start_soon(follow_logs)
            async with ControlClient(socket_path) as c:
                async for item in c.stream("wait", {"run": run}):
                    if "final" in item:
                        result = item["final"]
                        assert isinstance(result, dict)
                        final.update(result)
                    elif tty:
                        _status_line(item)
            if tty:
                sys.stderr.write("\r\x1b[K")
            await anyio.sleep(0.3 if follow else 0)  # let the log stream print its tail
            tg.cancel_scope.cancel()

    try:
        anyio.run(go)
    except SupervisorError as exc:
        return _fail("wait", exc)
    if not final:
        print(f"llmd-supervisor: stopped waiting; run {run} goes on", file=sys.stderr)
        return 0
    if as_json:
        print(json.dumps(final, indent=2, sort_keys=True))
    else:
        _print_summary(final)
    outcome = final.get("outcome")
    return EXIT_CODES[Outcome(str(outcome))] if outcome else 1


def _status_line(item: Mapping[str, object]) -> None:
    nodes = item.get("nodes") or []
    assert isinstance(nodes, list)
    line = (
        f"{item['state']:<10} nodes {item['nodes_healthy']}/{len(nodes)}  "
        f"{float(str(item['elapsed_s'])):7.0f}s  {str(item.get('last_log_line') or '')[:60]}"
    )
    sys.stderr.write("\r\x1b[K" + line)
    sys.stderr.flush()
