"""A waiting client told to stop (issue 3.2 item 5): `wait` and `submit --wait` forward a
cancel on the first SIGINT/SIGTERM and keep waiting for the run's end, but never forever:
a second signal, or no end within the run's grace plus a margin after the cancel, ends
the client at once with one line and exit status 5. The CLI runs as a subprocess against
a real `ControlServer` with a fake run behind it (tests/unit/test_control_reconnect.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.adapters.control.protocol import Peer, Request, Send
from llmd_supervisor.cli.signals import EXIT_STOPPED
from tests.unit.test_control_reconnect import FakeRun, cli, daemon, summary, until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "ctl.sock"


class StuckRun(FakeRun):
    """A run whose cancel is journaled but that never ends (as one stuck in `verifying`
    was); its summaries say its grace."""

    def __init__(self, grace_s: int) -> None:
        super().__init__()
        self.grace_s = grace_s

    async def handle(self, request: Request, peer: Peer, send: Send) -> Mapping[str, object]:
        self.requests.append(request)
        self.requested.set()
        shown = {**summary(self.state, None), "sigterm_grace_s": self.grace_s}
        if request.op == "cancel":
            return {**shown, "cancel_requested": True}
        assert request.op == "wait", request
        await send(shown)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


def _ops(run: FakeRun) -> list[str]:
    return [r.op for r in run.requests]


@pytest.mark.asyncio
@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
async def test_a_second_signal_stops_waiting_at_once(
    sock: Path, tmp_path: Path, first: signal.Signals
) -> None:
    run = StuckRun(grace_s=600)
    with anyio.fail_after(30):
        async with daemon(sock, run) as d:
            await d.start()
            async with cli("wait", "r1", "--socket", str(sock), tmp_path=tmp_path) as (
                proc,
                _,
                err,
            ):
                await until("the client waits", lambda: "wait" in _ops(run))
                proc.send_signal(first)
                await until("the cancel is sent", lambda: "cancel" in _ops(run))
                t0 = anyio.current_time()
                proc.send_signal(signal.SIGTERM)
                assert await proc.wait() == EXIT_STOPPED, err.read_text()
                assert anyio.current_time() - t0 < 3
    text = err.read_text()
    assert "cancelling run r1" in text
    assert text.splitlines()[-1] == (
        "llmd-supervisor: stopped waiting for run r1 at a second signal; its cancel was "
        "asked for and the daemon goes on with it (llmd-supervisor status r1)"
    )
    assert "Traceback" not in text
    assert _ops(run).count("cancel") == 1


@pytest.mark.asyncio
async def test_a_cancel_not_confirmed_within_the_grace_and_margin_stops_waiting(
    sock: Path, tmp_path: Path
) -> None:
    run = StuckRun(grace_s=1)
    spec = tmp_path / "spec.toml"
    spec.write_text("# the fake daemon takes any spec\n")
    args = ("--socket", str(sock), "--cancel-margin-s", "1.5")
    with anyio.fail_after(90):  # a client's start-up on a loaded 2-core machine included
        async with daemon(sock, run) as d:
            await d.start()
            async with cli("wait", "r1", *args, tmp_path=tmp_path) as (proc, _, err):
                await until("the client waits", lambda: "wait" in _ops(run))
                t0 = anyio.current_time()
                proc.send_signal(signal.SIGTERM)  # as `timeout` stops it
                assert await proc.wait() == EXIT_STOPPED, err.read_text()
                took = anyio.current_time() - t0
    # It waited the grace and margin, then stopped by itself (the fail_after above bounds
    # it; a loaded CI machine once took 31.6 s from the signal to the exit).
    assert took >= 2.5, took
    text = err.read_text()
    assert text.splitlines()[-1] == (
        "llmd-supervisor: run r1 did not end within 2.5 s of its cancel (its grace 1 s + "
        "1.5 s); stopped waiting, the daemon goes on with it (llmd-supervisor wait r1)"
    )
    assert _ops(run).count("cancel") == 1


def test_the_exit_status_is_in_the_help() -> None:
    for command in (["wait"], ["submit"], ["adopt"]):
        out = subprocess.run(
            [sys.executable, "-m", "llmd_supervisor", *command, "--help"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "exit status, when it waits" in out and f"  {EXIT_STOPPED}   " in out, out
        assert "--cancel-margin-s" in out
