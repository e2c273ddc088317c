"""CLI subcommands about runs, answered by the daemon: submit, adopt, list, status, logs,
cancel, wait, archive and nodes; and `daemon`, which runs the daemon itself.

Every client command takes `--json` (machine output) and `--socket` (default:
$LLMD_SUPERVISOR_SOCKET, else your own service's socket when it exists, else the system
service's). `submit --wait` and `wait` exit 0 only for `succeeded` (the other outcomes
use `verify`'s exit codes). A
client that gets SIGINT/SIGTERM while waiting forwards a cancel for its run unless
`--detach` was given, and waits for the run's end: a second signal, or no end within the
run's grace plus `--cancel-margin-s`, stops waiting at once with exit status 5
(`cli.signals`).

Clients that wait (`wait`, `submit --wait`, `logs --follow`) survive a daemon restart: when
the connection drops or nothing listens yet they reconnect with backoff and resume (a
followed log from the byte offsets already printed, so nothing is printed twice or lost),
for up to `--reconnect-s` seconds per outage; after that they exit 3 with one line on
stderr. A cancel asked for while the daemon is away is sent once it is back.
"""

from __future__ import annotations

import argparse
import functools
import json
import pwd
import sys
from collections.abc import Callable, Mapping
from contextlib import aclosing
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TypeVar

import anyio
import anyio.abc

from llmd_supervisor.adapters.control.client import (
    ControlClient,
    Reconnect,
    call_retrying,
    list_all,
    resumable_stream,
)
from llmd_supervisor.cli import launch, offline
from llmd_supervisor.cli.common import (
    EXIT_DAEMON_UNREACHABLE,
    _Exit,
    _exits,
    _expected,
    _read,
    _run,
    _write,
    fit_to_terminal,
    socket_default,
    unreadable,
)
from llmd_supervisor.cli.signals import DEFAULT_CANCEL_MARGIN_S, WAIT_EXIT_STATUS, Interrupts
from llmd_supervisor.core.protocol.runs import (
    ArchiveInfo,
    DryRun,
    LogChunk,
    NodesView,
    RunBrief,
    RunList,
    RunSummary,
    chunk_bytes,
)
from llmd_supervisor.core.run.jobtext import job_text
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.errors import DaemonUnreachable, OfflineError, SpecError, SupervisorError

DEFAULT_RECONNECT_S = 600.0

T = TypeVar("T")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def add_parsers(sub: argparse._SubParsersAction[Any]) -> None:
    d = sub.add_parser("daemon", help="run the supervisor daemon (foreground)")
    d.add_argument(
        "--config",
        type=Path,
        default=None,
        help="config TOML (default: $LLMD_SUPERVISOR_CONFIG, else"
        " ~/.config/llmd-supervisor/config.toml if it exists, else"
        " /etc/llmd-supervisor/config.toml)",
    )
    d.set_defaults(handler=cmd_daemon)

    def client(name: str, help_: str, *, run: bool = True) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_)
        if run:
            p.add_argument(
                "run",
                metavar="RUN",
                help="run id, job name, Slurm job id, or CLUSTER:JOBID when a job id is ambiguous",
            )
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "--socket", type=Path, default=socket_default(), help="daemon control socket"
        )
        return p

    def reconnect(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--reconnect-s",
            type=_seconds,
            default=DEFAULT_RECONNECT_S,
            metavar="S",
            help="while waiting, how long to keep reconnecting to a daemon that went away "
            f"(default {DEFAULT_RECONNECT_S:g}; 0: give up at once)",
        )

    def stop_waiting(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--cancel-margin-s",
            type=_seconds,
            default=DEFAULT_CANCEL_MARGIN_S,
            metavar="S",
            help="after the first Ctrl-C/SIGTERM asked for the run's cancel, stop waiting "
            "(exit 5) if it has not ended within its grace plus this long "
            f"(default {DEFAULT_CANCEL_MARGIN_S:g})",
        )
        p.epilog = WAIT_EXIT_STATUS
        p.formatter_class = argparse.RawDescriptionHelpFormatter

    def waiting(p: argparse.ArgumentParser) -> None:
        p.add_argument("--wait", action="store_true", help="wait for the verified outcome")
        p.add_argument(
            "--follow",
            action="store_true",
            help="print the batch log while waiting (implies --wait)",
        )
        p.add_argument("--detach", action="store_true", help="on Ctrl-C stop waiting, keep the run")
        p.add_argument(
            "--cluster", default=None, help="the configured cluster to run on (default: the first)"
        )
        reconnect(p)
        stop_waiting(p)

    p = client("submit", "submit a run spec, or your own batch script, to the daemon", run=False)
    p.add_argument("spec", metavar="SPEC", type=Path, nargs="?", help="run spec TOML")
    launch.add_script_options(p)
    p.add_argument("--dry-run", action="store_true", help="validate and print the script only")
    launch.add_watch_options(p)
    waiting(p)
    p.set_defaults(handler=cmd_submit, sbatch_args=[])
    p = client("adopt", "supervise a job already submitted with sbatch", run=False)
    p.add_argument("job_id", metavar="JOBID", help="its Slurm job id")
    launch.add_watch_options(p)
    waiting(p)
    p.set_defaults(handler=cmd_adopt)
    p = client("nodes", "list quarantined nodes; `nodes release NODE` lets one in again", run=False)
    p.add_argument("action", nargs="?", choices=("release",), help="release NODE (admins)")
    p.add_argument("node", nargs="?", metavar="NODE")
    p.add_argument("--cluster", default=None, help="the node's cluster (default: the first)")
    p.set_defaults(handler=cmd_nodes)
    p = client("list", "list runs", run=False)
    p.add_argument("--all", action="store_true", help="include finished runs")
    p.add_argument(
        "--cluster",
        default=None,
        help="only this cluster's runs (a shared journal holds every cluster's of the team)",
    )
    p.set_defaults(handler=cmd_simple, op="list")
    p = client("status", "show one run")
    offline.add_arguments(p)
    p.set_defaults(handler=cmd_simple, op="status")
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
    reconnect(p)
    p.set_defaults(handler=cmd_logs)
    p = client("wait", "wait for a run's verified outcome")
    p.add_argument("--detach", action="store_true", help="on Ctrl-C stop waiting, keep the run")
    reconnect(p)
    stop_waiting(p)
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
    except BaseException as exc:
        found = _expected(exc)  # task groups wrap our errors in an ExceptionGroup
        if not isinstance(found, SupervisorError):
            raise
        notifier.notify(f"STATUS=failed: {found}")
        print(f"llmd-supervisor daemon: {found}", file=sys.stderr)
        return 1
    finally:
        notifier.close()
    return 0


# --- clients ------------------------------------------------------------------------------


@_exits
def cmd_simple(args: argparse.Namespace) -> int:
    if args.op == "status" and offline.wanted(args):
        try:
            if args.json:
                print(json.dumps(offline.run_results(args, args.run), indent=2, sort_keys=True))
            else:
                offline.print_status(args, args.run, sys.stdout)
        except OfflineError as exc:
            print(f"llmd-supervisor status: {exc}", file=sys.stderr)
            return 2
        return 0
    params: dict[str, object] = {}
    if args.op == "list":
        params["all"] = args.all
    else:
        params["run"] = args.run

    async def go() -> Mapping[str, object]:
        async with ControlClient(args.socket) as c:
            if args.op == "list":  # every page, fetched one after another
                return await list_all(c, all_runs=args.all, cluster=args.cluster)
            return await c.call(args.op, params)

    result = _run(args.op, go)
    if args.op == "list":
        runs = _read(args.op, RunList, result)["runs"]
        if args.json:
            print(json.dumps({"runs": runs}, indent=2, sort_keys=True))
            return 0
        print("\n".join(fit_to_terminal(list_table(runs))))
    elif args.op == "archive":
        info = _read(args.op, ArchiveInfo, result)
        print(json.dumps(info, indent=2, sort_keys=True) if args.json else info["archive"])
    else:
        summary = _read(args.op, RunSummary, result)
        if args.json:
            print(json.dumps(summary, indent=2, sort_keys=True))
        else:
            _print_summary(summary)
    return 0


@_exits
def cmd_nodes(args: argparse.Namespace) -> int:
    if (args.action is None) != (args.node is None):
        print("llmd-supervisor nodes: use `nodes` or `nodes release NODE`", file=sys.stderr)
        return 2
    params = {"release": args.node, "cluster": args.cluster}

    async def go() -> Mapping[str, object]:
        async with ControlClient(args.socket) as c:
            return await c.call("nodes", params)

    view = _read("nodes", NodesView, _run("nodes", go))
    if args.json:
        print(json.dumps(view, indent=2, sort_keys=True))
        return 0
    if args.node is not None:
        said = "released" if view["released"] else "had no failures counted; nothing to release"
        print(f"node {args.node}: {said}", file=sys.stderr)
    for line in fit_to_terminal(launch.nodes_table(view)):
        print(line)
    return 0


def _print_summary(r: RunSummary, out: IO[str] | None = None) -> None:
    out = out or sys.stdout
    named = f" {r['name']}" if r.get("name") else ""
    print(f"run {r['run']}{named} ({r['job_name']}): {r['state']}", file=out)
    print(
        f"  slurm job {r['slurm_job_id'] or '-'}, attempt {r['attempt']}, cluster {r['cluster']}",
        file=out,
    )
    if r["nodes"] and r["outcome"]:
        print(f"  nodes {','.join(r['nodes'])}; ended after {r['elapsed_s']:.0f} s", file=out)
    elif r["nodes"]:
        print(
            f"  nodes {','.join(r['nodes'])} ({r['nodes_healthy']}/{len(r['nodes'])} reachable)",
            file=out,
        )
    benchmarking = sorted(
        {n["agent_state"] for n in r["health"].values() if n["agent_state"].startswith("bench")}
    )
    if benchmarking and not r["outcome"]:
        print(f"  {'; '.join(benchmarking)}", file=out)  # e.g. concurrency 4 (2 of 3)
    if r.get("held_until") and not r["outcome"]:
        print(f"  held until {r.get('held_until')}: {r['reason']}", file=out)
    if r["outcome"]:
        print(f"  outcome {r['outcome']}: {r['reason']}", file=out)
    best = r.get("headline")
    if best:
        ttft = best["ttft_ms_median"]
        print(
            f"  best point c={best['concurrency']}: {best['total_token_throughput']:.1f} tok/s"
            f" total, {best['output_throughput']:.1f} tok/s output, median TTFT "
            f"{'-' if ttft is None else f'{ttft:.1f} ms'}",
            file=out,
        )
    attempts = r.get("attempts") or []
    if len(attempts) > 1 or any(a["cause"] for a in attempts):
        for a in attempts:
            where = f" on {','.join(a['nodes'])}" if a["nodes"] else ""
            cause = f", cause {a['cause']}" if a["cause"] else ""
            print(
                f"  attempt {a['attempt']}: job {a['slurm_job_id']}{where}: {a['outcome']}"
                f"{cause}; {a['retry']}",
                file=out,
            )
    usage = r.get("usage")
    if usage and attempts:
        print(
            f"  GPU-hours {usage['gpu_hours_useful']:.2f} useful, {usage['gpu_hours_lost']:.2f}"
            f" lost; node-hours {usage['node_hours_useful']:.3f} useful,"
            f" {usage['node_hours_lost']:.3f} lost",
            file=out,
        )
    print(f"  archive {r['archive']}", file=out)


def _reconnect(args: argparse.Namespace) -> Reconnect:
    return Reconnect(window_s=args.reconnect_s)


@_exits
def cmd_submit(args: argparse.Namespace) -> int:
    foreign_used = [
        f"--{name.replace('_', '-')}"
        for name in ("chdir", "export_env", "job_name_prefix", "log_dir", "logs", "marker",
                     "marker_format", "results")
        if getattr(args, name) not in (None, False, [])
    ]  # fmt: skip
    if args.script is not None or args.sbatch_args:
        if args.spec is not None or args.script is None or args.dry_run:
            print(
                "llmd-supervisor submit: give a run SPEC, or --script JOB.sbatch with sbatch "
                "options after --, not both (and --dry-run only with a SPEC)",
                file=sys.stderr,
            )
            return 2
        return _submit_foreign(args, "submit_script", launch.checked_spec(args, "script"))
    if args.spec is None or foreign_used:
        why = f"{', '.join(foreign_used)} need --script" if foreign_used else "give a run SPEC"
        print(f"llmd-supervisor submit: {why} (or a SPEC alone)", file=sys.stderr)
        return 2
    spec_toml = _checked_spec_text(args.spec)
    params = {
        "spec_toml": spec_toml,
        "spec_path": str(args.spec),
        "dry_run": args.dry_run,
        "cluster": args.cluster,
    }
    if args.dry_run:
        return _dry_run(args, params)
    result = _send_submission(args, "submit", params, waits=_waits(args))
    return _submitted(args, _read("submit", RunSummary, result))


def _checked_spec_text(path: Path) -> str:
    """The run spec's text, checked here before any daemon is asked (exit 2, naming the
    file, when it cannot be read, is a campaign file, or is not a valid run spec)."""
    from llmd_supervisor.core.spec.file_kind import wrong_kind
    from llmd_supervisor.core.spec.runspec import load_spec

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"llmd-supervisor submit: {unreadable('run spec', path, exc)}", file=sys.stderr)
        raise _Exit(2) from None
    problem = wrong_kind(text, str(path), "run spec")
    if problem is None:
        try:
            load_spec(text)
        except SpecError as exc:
            problem = f"{path}: {exc}"
    if problem is not None:
        print(f"llmd-supervisor submit: {problem}", file=sys.stderr)
        raise _Exit(2)
    return text


def _dry_run(args: argparse.Namespace, params: dict[str, object]) -> int:
    """Print the script the daemon would submit; with no daemon, the one the spec renders
    here (checked as a spec, not against a daemon's configuration), and say so."""

    async def go() -> Mapping[str, object] | DaemonUnreachable:
        try:
            async with ControlClient(args.socket) as c:
                return await c.call("submit", params)
        except DaemonUnreachable as exc:
            return exc

    result = _run("submit", go)
    if isinstance(result, DaemonUnreachable):
        from llmd_supervisor.core.render.script import render_sbatch
        from llmd_supervisor.core.spec.runspec import load_spec

        script = render_sbatch(load_spec(str(params["spec_toml"])), job_name="llmd-dry-run")
        print(
            f"llmd-supervisor submit: {str(result).rstrip('.')}. The spec is valid and its"
            " script follows, rendered here; the daemon's own checks (daemon.log_roots, the"
            " cluster, [notify] destinations) run when it is submitted.",
            file=sys.stderr,
        )
        sys.stdout.write(script)
        return 0
    sys.stdout.write(_read("submit", DryRun, result)["script"])
    return 0


@_exits
def cmd_adopt(args: argparse.Namespace) -> int:
    return _submit_foreign(args, "adopt", launch.checked_spec(args, "adopt"))


def _waits(args: argparse.Namespace) -> bool:
    return bool((args.wait or args.follow) and not getattr(args, "dry_run", False))


def _send_submission(
    args: argparse.Namespace,
    op: str,
    params: dict[str, object],
    *,
    waits: bool,
    command: str | None = None,
) -> Mapping[str, object]:
    # Waiting for a daemon that is not up yet is part of waiting; a broken connection
    # after the request was sent is not retried (it may have been accepted).
    policy = _reconnect(args) if waits else Reconnect(window_s=0)

    async def go() -> Mapping[str, object]:
        return await call_retrying(
            args.socket, op, params, reconnect=policy, resend=False, on_lost=_lost(policy)
        )

    return _run(command or op, go)


def _submit_foreign(args: argparse.Namespace, op: str, spec_json: str) -> int:
    params: dict[str, object] = {"spec_json": spec_json, "cluster": args.cluster}
    command = "adopt" if op == "adopt" else "submit"  # what the user typed, not the op
    result = _send_submission(args, op, params, waits=_waits(args), command=command)
    return _submitted(
        args, _read(command, RunSummary, result), verb="adopted" if op == "adopt" else "submitted"
    )


def _submitted(args: argparse.Namespace, summary: RunSummary, verb: str = "submitted") -> int:
    """Say what was submitted; with --wait/--follow, wait for its outcome."""
    waits = _waits(args)
    if not waits:
        if args.json:
            print(json.dumps(summary, indent=2, sort_keys=True))
        else:
            print(f"{verb} run {summary['run']} ({summary['job_name']})")
        return 0
    if not args.json:
        print(f"{verb} run {summary['run']} ({summary['job_name']})", file=sys.stderr)
    return _wait(args, summary["run"], follow=args.follow)


@_exits
def cmd_wait(args: argparse.Namespace) -> int:
    return _wait(args, args.run, follow=False)


@_exits
def cmd_logs(args: argparse.Namespace) -> int:
    params = {"run": args.run, "rank": args.rank, "follow": args.follow}
    labels = sys.stdout.isatty()  # on a terminal, say whose lines follow (like tail)
    last: list[str] = []  # the file whose bytes were shown last

    def show(chunk: LogChunk) -> None:
        if args.json:
            print(json.dumps(chunk), flush=True)
            return
        data = _bytes(chunk)
        if labels and last != [chunk["file"]]:
            _write(f"{chr(10) if last else ''}==> {job_text(chunk['file'])} <==\n".encode())
            last[:] = [chunk["file"]]
        _write(data)

    async def go() -> None:
        if args.follow:
            await _follow(args.socket, params, _reconnect(args), show)
            return
        async with ControlClient(args.socket) as c, aclosing(c.stream("logs", params)) as items:
            async for item in items:
                if "final" not in item:
                    chunk = _read("logs", LogChunk, item)
                    _bytes(chunk)  # checked before it is shown
                    show(chunk)

    _run("logs", go)
    return 0


def _bytes(chunk: LogChunk) -> bytes:
    """A chunk's bytes; one that does not decode ends the command with status 3."""
    try:
        return chunk_bytes(chunk)
    except SupervisorError as exc:
        print(f"llmd-supervisor logs: {exc}", file=sys.stderr)
        raise _Exit(EXIT_DAEMON_UNREACHABLE) from None


def _lost(policy: Reconnect) -> Callable[[str], None]:
    """What to say when the daemon goes away while waiting (on a terminal only)."""

    def say(why: str) -> None:
        if sys.stderr.isatty():
            sys.stderr.write(
                f"\r\x1b[Kllmd-supervisor: lost the daemon ({why}); "
                f"reconnecting for up to {policy.window_s:g} s\n"
            )
            sys.stderr.flush()

    return say


async def _follow(
    socket_path: Path,
    params: dict[str, object],
    policy: Reconnect,
    show: Callable[[LogChunk], None],
) -> None:
    """Stream ``logs`` until its final reply, reconnecting and resuming at the byte offsets
    of what `show` was given (so across a daemon restart nothing repeats or goes missing)."""
    offsets: dict[str, int] = {}

    def request() -> dict[str, object]:
        return {**params, "offsets": dict(offsets)}

    stream = resumable_stream(socket_path, "logs", request, reconnect=policy, on_lost=_lost(policy))
    async with aclosing(stream) as items:
        async for item in items:
            if "final" in item:
                return
            chunk = _read("logs", LogChunk, item)
            if chunk["end"] <= offsets.get(chunk["file"], 0):
                continue  # already shown (a daemon that ignored the offsets)
            show(chunk)
            offsets[chunk["file"]] = chunk["end"]


def _wait(args: argparse.Namespace, run: str, *, follow: bool) -> int:
    """Stream `wait` (and the batch log when following) until the outcome; exit by outcome.

    With `follow`, stdout carries the log alone and the final summary goes to stderr.
    """
    from llmd_supervisor.supervision.run.verify_job import EXIT_CODES

    socket_path: Path = args.socket
    policy = _reconnect(args)
    tty = sys.stderr.isatty() and not args.json
    final: list[RunSummary] = []
    interrupts = Interrupts(run, socket_path, policy, args.detach, args.cancel_margin_s)

    def show_log(chunk: LogChunk) -> None:
        _write(_bytes(chunk))

    async def go() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(interrupts.watch, tg)
            logs_done = anyio.Event()

            async def follow_logs() -> None:
                await _follow(socket_path, {"run": run, "follow": True}, policy, show_log)
                logs_done.set()

            if follow:
                tg.start_soon(follow_logs)
            else:
                logs_done.set()
            stream = resumable_stream(
                socket_path, "wait", lambda: {"run": run}, reconnect=policy, on_lost=_lost(policy)
            )
            async with aclosing(stream) as items:
                async for item in items:
                    interrupts.saw(item.get("final", item))
                    if "final" in item:
                        final.append(_read("wait", RunSummary, item["final"]))
                    elif tty:
                        _status_line(_read("wait", RunSummary, item))
            if tty:
                sys.stderr.write("\r\x1b[K")
            await logs_done.wait()  # the log stream ends once the run is final and read
            tg.cancel_scope.cancel()

    _run("wait", go)
    if not final:
        status, line = interrupts.ended()
        print(line, file=sys.stderr)
        return status
    out = sys.stderr if follow else sys.stdout
    if args.json:
        print(json.dumps(final[0], indent=2, sort_keys=True), file=out)
    else:
        _print_summary(final[0], out)
    outcome = final[0]["outcome"]
    return EXIT_CODES[Outcome(outcome)] if outcome else 1


def list_table(runs: list[RunBrief]) -> list[str]:
    """`list`'s lines: one per run with its name, cluster, Slurm job, owner, start and end
    (local time; the end's date only when it is not the start's), elapsed time (to its
    end once it ended), nodes and outcome or reason. A run without a name (a spec without
    ``[run] name``, or from an older daemon) shows ``-``, as does a run not ended."""
    rows = []
    for r in runs:
        started = datetime.fromisoformat(r["created_at"]).astimezone()
        rows.append(
            (
                r["run"],
                r.get("name") or "-",
                r["state"],
                r["cluster"],
                r["slurm_job_id"] or "-",
                _user(r["owner_uid"]),
                started.strftime("%Y-%m-%d %H:%M"),
                _ended(started, r.get("finished_at")),
                _duration(r["elapsed_s"]),
                str(len(r["nodes"])),
                f"{r['outcome'] or ''} {r['reason']}".strip(),
            )
        )
    head = (
        "RUN", "NAME", "STATE", "CLUSTER", "JOB", "OWNER", "STARTED", "ENDED", "ELAPSED",
        "NODES", "OUTCOME",
    )  # fmt: skip
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head) - 1)]
    return [
        " ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + " " + row[-1]
        for row in [head, *rows]
    ]


def _ended(started: datetime, finished_at: str | None) -> str:
    """A run's end in local time: ``HH:MM`` on the day it started, else with the date."""
    if not finished_at:
        return "-"
    ended = datetime.fromisoformat(finished_at).astimezone()
    return ended.strftime("%H:%M" if ended.date() == started.date() else "%Y-%m-%d %H:%M")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _status_line(item: RunSummary) -> None:
    held = item.get("held_until")
    last = f"held until {held} (too few nodes)" if held else item["last_log_line"][:60]
    line = (
        f"{item['state']:<10} nodes {item['nodes_healthy']}/{len(item['nodes'])}  "
        f"{item['elapsed_s']:7.0f}s  {last}"
    )
    sys.stderr.write("\r\x1b[K" + line)
    sys.stderr.flush()
