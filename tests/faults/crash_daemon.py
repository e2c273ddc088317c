"""The daemon with test seams: ``python -m tests.faults.crash_daemon --config C
[--crash-after STATE[:N]] [--replay-socket PATH]``.

``--crash-after`` SIGKILLs the daemon right after the journal committed the N-th (default
first) transition into STATE, before anything acted on it; ``cancel_requested`` for STATE
crashes right after a cancel request was journaled instead, ``sbatch:N`` right after the
N-th sbatch answered (before the journal heard of its job), ``expansion`` once a
campaign file was expanded (before the campaign was journaled), and ``webhook_2xx`` once a
webhook receiver answered 2xx (before the delivery was journaled delivered: the event
sender's POST is wrapped). ``--replay-socket`` sends every Slurm command to the
replayed cluster a test serves there (tests/fakes/replay_service.py);
``--qos-backoff-s`` shortens a campaign's back-off after a QOS submit refusal.
The production daemon has no such seams; they are injected through `Hooks`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, ParamSpec

import anyio
import structlog

from llmd_supervisor.adapters.log import configure
from llmd_supervisor.adapters.outbox import sender as event_sender
from llmd_supervisor.adapters.slurm.runner import CommandResult, CommandRunner, LocalRunner
from llmd_supervisor.core.campaign import expand as campaign
from llmd_supervisor.core.config import Config, read_config
from llmd_supervisor.core.events.delivery import HttpResponse, Result
from llmd_supervisor.core.run.lifecycle import Run
from llmd_supervisor.supervision.campaign import runner as campaign_runner
from llmd_supervisor.supervision.daemon import serve
from llmd_supervisor.supervision.run.driver import Hooks
from tests.fakes.replay_service import ReplayRunner

CANCEL_REQUESTED = "cancel_requested"
P = ParamSpec("P")


def crash_hook(state: str, nth: int) -> Callable[[Run], None]:
    count = 0

    def after_journal(run: Run) -> None:
        nonlocal count
        if state == CANCEL_REQUESTED:
            if not run.cancel_requested:
                return
        elif run.state.value != state:
            return
        count += 1
        if count >= nth:
            _crash(state=state, run_id=run.run_id)

    return after_journal


def _crash(**where: object) -> None:
    structlog.get_logger("tests.crash").warning("test.crash", **where)
    os.kill(os.getpid(), signal.SIGKILL)


class CrashAfterSbatch:
    """Runs Slurm's commands through `inner`; SIGKILLs the daemon when the N-th sbatch
    has answered, before its caller sees the answer."""

    def __init__(self, inner: CommandRunner, nth: int) -> None:
        self.inner, self.nth, self.count = inner, nth, 0

    async def run(
        self,
        argv: Sequence[str],
        *,
        time_limit: float,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        result = await self.inner.run(argv, time_limit=time_limit, stdin=stdin, env=env)
        if argv and Path(argv[0]).name == "sbatch":
            self.count += 1
            if self.count >= self.nth:
                _crash(after="sbatch", nth=self.count, stdout=result.stdout.strip())
        return result


AsyncPost = Callable[
    [str, bytes, Mapping[str, str], float, str | None], Coroutine[Any, Any, Result]
]


def crash_after_webhook_2xx(post: AsyncPost) -> AsyncPost:
    """`post` that SIGKILLs the daemon once a receiver answered 2xx, before the sender
    journals the delivery ``delivered`` (the outbox's at-least-once seam)."""

    async def post_then_crash(
        url: str, body: bytes, headers: Mapping[str, str], timeout_s: float, proxy: str | None
    ) -> Result:
        result = await post(url, body, headers, timeout_s, proxy)
        if isinstance(result, HttpResponse) and 200 <= result.status < 300:
            _crash(after="webhook_2xx", webhook_id=headers.get("webhook-id"))
        return result

    return post_then_crash


def _local_runner(config: Config) -> CommandRunner:
    (cluster,) = config.clusters
    if cluster.login_host is not None:
        raise SystemExit("crash_daemon: --crash-after sbatch:N needs a cluster without login_host")
    return LocalRunner({"SLURM_CONF": cluster.slurm_conf} if cluster.slurm_conf else {})


def _then_crash(expand: Callable[P, campaign.Expansion]) -> Callable[P, campaign.Expansion]:
    def expand_then_crash(*args: P.args, **kwargs: P.kwargs) -> campaign.Expansion:
        expansion = expand(*args, **kwargs)
        _crash(after="expansion", jobs=len(expansion.jobs))
        return expansion

    return expand_then_crash


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--crash-after", help="STATE or STATE:N")
    parser.add_argument("--replay-socket", type=Path)
    parser.add_argument("--qos-backoff-s", type=float, help="a campaign's QOS back-off")
    args = parser.parse_args()
    if args.qos_backoff_s is not None:
        campaign_runner.QOS_BACKOFF_S = args.qos_backoff_s
    config = read_config(args.config)
    hooks = Hooks()
    if args.replay_socket is not None:
        hooks = dataclasses.replace(hooks, runner=ReplayRunner(args.replay_socket))
    if args.crash_after is not None:
        state, _, nth = args.crash_after.partition(":")
        if state == "expansion":
            campaign.expand = _then_crash(campaign.expand)
        elif state == "webhook_2xx":  # the daemon's EventSender posts through this
            wrapped = crash_after_webhook_2xx(event_sender.post_json)
            setattr(event_sender, "post_json", wrapped)  # noqa: B010 - mypy refuses `=` on a def
        elif state == "sbatch":
            inner = hooks.runner or _local_runner(config)
            hooks = dataclasses.replace(hooks, runner=CrashAfterSbatch(inner, int(nth or 1)))
        else:
            hooks = dataclasses.replace(hooks, after_journal=crash_hook(state, int(nth or 1)))
    configure(json=True, stream=sys.stdout)
    serve_ = functools.partial(serve, config, hooks=hooks)
    anyio.run(serve_)
    return 0


if __name__ == "__main__":
    sys.exit(main())
