"""Outbound events of a daemon process on a replayed cluster (tests/fakes/replay_world.py),
to a loopback receiver in the world's thread (issue 3.6):

- at least once, with the same id: a daemon SIGKILLed between a webhook receiver's 2xx
  and the journal's ``delivered`` sends the event again after its restart, with the same
  ``webhook-id`` and body, and the delivery ends ``delivered``; no second event is made;
- a campaign whose file names an opt-in destination sends it campaign.progress (once in
  the minute) and campaign.finished; a campaign file naming an unknown one is refused."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import anyio
import anyio.abc
import pytest
from standardwebhooks import Webhook

from llmd_supervisor.adapters.outbox.sender import read_secret_file_now
from llmd_supervisor.core.events.webhooks import unix_seconds, verify
from tests.daemon_helpers import Daemon, demo_spec
from tests.fakes.replay_world import ReplayWorld
from tests.fakes.webhook_receiver import Received, Receiver

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()


@pytest.fixture
def receiver(world: ReplayWorld) -> Iterator[tuple[Receiver, int]]:
    """A loopback webhook receiver in the world's thread, and its port."""
    got = Receiver()

    async def serve(*, task_status: anyio.abc.TaskStatus[tuple[anyio.CancelScope, int]]) -> None:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                port = await tg.start(got.serve)
                task_status.started((scope, port))

    future, (scope, port) = world.portal.start_task(serve)
    try:
        yield got, port
    finally:
        world.portal.call(scope.cancel)
        future.result(timeout=10)


def _until(what: str, check: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:g} s")
        time.sleep(0.1)


def test_a_kill_between_the_2xx_and_its_commit_resends_the_same_webhook_id(
    world: ReplayWorld, receiver: tuple[Receiver, int], tmp_path: Path
) -> None:
    got, port = receiver
    secret_file = tmp_path / "ci.whsec"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    root = tmp_path / "daemon"
    root.mkdir()
    d = Daemon(
        world,
        root,
        replay_socket=world.socket,
        crash_after="webhook_2xx",
        extra_config=f"""
[dashboard]
url = "http://localhost:8080"

[[events.destination]]
name = "ci"
kind = "webhook"
url = "http://127.0.0.1:{port}/hooks/llmd"
secret_file = "{secret_file}"
types = ["run.submitted"]
""",
    )

    def received() -> list[Received]:
        return world.call(lambda: list(got.got))

    d.start()
    try:
        submitted = d.submit(demo_spec(tmp_path / "logs"))
        assert submitted.returncode == 0, submitted.stderr
        run = str(json.loads(submitted.stdout)["run"])
        assert d.proc is not None
        d.proc.wait(timeout=60)  # SIGKILLed once the receiver answered 200
        assert d.proc.returncode == -9, d.log_text()[-2000:]
        (first,) = received()
        assert d.events("test.crash")[0]["webhook_id"] == first.headers["webhook-id"]

        d.crash_after = None
        d.start()  # the delivery was never journaled delivered: it is due again
        _until("no second delivery", lambda: len(received()) >= 2)
        final = d.wait_state(run, {"succeeded", "failed", "unverified"}, timeout=120)
        assert final["state"] == "succeeded", final

        def listed() -> list[dict[str, object]]:
            out = d.cli("events", "list", "--run", run, "--json").stdout
            deliveries = json.loads(out)["deliveries"]
            assert isinstance(deliveries, list)
            return deliveries

        _until("not delivered", lambda: [x["status"] for x in listed()] == ["delivered"])
        (delivery,) = listed()  # one event, one delivery: no second event was made
    finally:
        d.stop()
    again = received()
    assert len(again) == 2, [r.headers.get("webhook-id") for r in again]
    second = again[1]
    assert second.headers["webhook-id"] == first.headers["webhook-id"]
    assert second.body == first.body  # the same event, byte for byte
    body = json.loads(first.body)
    assert body["type"] == "run.submitted" and body["id"] == first.headers["webhook-id"]
    assert body["data"]["run"]["id"] == run
    assert body["data"]["links"]["dashboard"] == f"http://localhost:8080/runs/{run}"
    assert body["data"]["links"]["report"] == f"http://localhost:8080/runs/{run}#results"
    keys = read_secret_file_now(secret_file)
    now = unix_seconds(datetime.now(UTC))
    for r in again:  # each attempt signed anew, each signature good
        verify(keys, r.headers, r.body, now=now)
        # and good for an independent implementation (the standardwebhooks package)
        assert Webhook(SECRET).verify(r.body, r.headers)["id"] == first.headers["webhook-id"]
    assert delivery["event"] == first.headers["webhook-id"]
    assert delivery["attempts"] == 1  # the attempt the kill cut off was never journaled


CAMPAIGN = """
name = "tiny"
base = "base.toml"
[matrix]
"benchmark.concurrencies" = [[1, 2]]
"""


def test_a_campaign_tells_an_opt_in_destination_its_progress_and_its_end(
    world: ReplayWorld, receiver: tuple[Receiver, int], tmp_path: Path
) -> None:
    got, port = receiver
    secret_file = tmp_path / "team.whsec"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    root = tmp_path / "daemon"
    root.mkdir()
    d = Daemon(
        world,
        root,
        replay_socket=world.socket,
        extra_config=f"""
[[events.destination]]
name = "team"
kind = "webhook"
url = "http://127.0.0.1:{port}/hooks/team"
secret_file = "{secret_file}"
types = ["campaign.progress", "campaign.finished"]
opt_in = true
""",
    )
    (tmp_path / "base.toml").write_text(demo_spec(tmp_path / "logs"))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text(CAMPAIGN + '[notify]\ndestinations = ["ci"]\n')
    named = tmp_path / "tiny.toml"
    named.write_text(CAMPAIGN + '[notify]\ndestinations = ["team"]\n')
    d.start()
    try:
        refused = d.cli("campaign", "submit", str(unknown), check=False)
        assert refused.returncode == 2, refused.stdout
        assert "'notify.destinations' has invalid value 'ci'" in refused.stderr
        assert "no destination of that name (team)" in refused.stderr
        done = d.cli("campaign", "submit", str(named), "--wait", check=False, timeout=240)
        assert done.returncode == 0, done.stderr + d.log_text()[-3000:]
        _until("not 2 events", lambda: len(world.call(lambda: list(got.got))) >= 2)
    finally:
        d.stop()
    bodies = [json.loads(r.body) for r in world.call(lambda: list(got.got))]
    # The campaign ran in well under a minute: one progress (its first counts), then its end.
    assert [b["type"] for b in bodies] == ["campaign.progress", "campaign.finished"], bodies
    progress, finished = (b["data"] for b in bodies)
    assert progress["campaign"]["name"] == "tiny" and progress["points"]["total"] == 2
    assert finished["outcome"] == "finished"
    # the best of its verified points, read from the results of the run that verified them
    best = finished["best_point"]
    assert best["valid"] is True and best["concurrency"] in (1, 2), best
    of = finished["best_point_of"]  # the run that verified it, its recipe and topology
    assert of["topology"] and len(of["recipe"]) == 64 and of["run"], of
    assert finished["points"] == {
        "total": 2,
        "verified": 2,
        "running": 0,
        "pending": 0,
        "failed": 0,
        "blocked": 0,
    }
