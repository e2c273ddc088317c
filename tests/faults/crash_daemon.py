"""The daemon with test seams: ``python -m tests.faults.crash_daemon --config C
[--crash-after STATE[:N]] [--replay-socket PATH]``.

``--crash-after`` SIGKILLs the daemon right after the journal committed the N-th (default
first) transition into STATE, before anything acted on it; ``cancel_requested`` for STATE
crashes right after a cancel request was journaled instead. ``--replay-socket`` sends every
Slurm command to the replayed cluster a test serves there (tests/fakes/replay_service.py);
``--qos-backoff-s`` shortens a campaign's back-off after a QOS submit refusal.
The production daemon has no such seams; they are injected through `Hooks`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import sys
from pathlib import Path

import anyio
import structlog

from llmd_supervisor.adapters.log import configure
from llmd_supervisor.core.config import read_config
from llmd_supervisor.core.lifecycle import Run
from llmd_supervisor.supervision.campaign import runner as campaign_runner
from llmd_supervisor.supervision.daemon import serve
from llmd_supervisor.supervision.run.driver import Hooks
from tests.fakes.replay_service import ReplayRunner

CANCEL_REQUESTED = "cancel_requested"


def crash_hook(state: str, nth: int) -> Hooks:
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
            structlog.get_logger("tests.crash").warning(
                "test.crash", state=state, run_id=run.run_id
            )
            os.kill(os.getpid(), signal.SIGKILL)

    return Hooks(after_journal=after_journal)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--crash-after", help="STATE or STATE:N")
    parser.add_argument("--replay-socket", type=Path)
    parser.add_argument("--qos-backoff-s", type=float, help="a campaign's QOS back-off")
    args = parser.parse_args()
    if args.qos_backoff_s is not None:
        campaign_runner.QOS_BACKOFF_S = args.qos_backoff_s
    hooks = Hooks()
    if args.crash_after is not None:
        state, _, nth = args.crash_after.partition(":")
        hooks = crash_hook(state, int(nth or 1))
    if args.replay_socket is not None:
        hooks = dataclasses.replace(hooks, runner=ReplayRunner(args.replay_socket))
    configure(json=True, stream=sys.stdout)
    serve_ = functools.partial(serve, read_config(args.config), hooks=hooks)
    anyio.run(serve_)
    return 0


if __name__ == "__main__":
    sys.exit(main())
