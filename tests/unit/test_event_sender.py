"""The outbox's sender (`adapters.outbox.sender`) against a real HTTP receiver on 127.0.0.1:
signatures a receiver verifies, the same webhook-id on every attempt, the retry schedule,
Retry-After, 410 Gone, no redirect followed; and a daemon whose finished run's
run.finished reaches a configured webhook."""

from __future__ import annotations

import base64
import grp
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import ClassVar

import anyio
import anyio.abc
import pytest

from llmd_supervisor.adapters.control.protocol import Peer
from llmd_supervisor.adapters.journal.campaign_store import CampaignStore, StoredCampaign
from llmd_supervisor.adapters.journal.store import Journal, RunMeta
from llmd_supervisor.adapters.metrics import Metrics
from llmd_supervisor.adapters.outbox.sender import EventSender, post_json, read_secret_file
from llmd_supervisor.adapters.outbox.store import Delivery, Outbox
from llmd_supervisor.cli.config import secret_problems
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.events.delivery import NetworkFailure
from llmd_supervisor.core.events.model import CampaignFacts, EventType, Links, PointCounts, RunRef
from llmd_supervisor.core.events.outbox import (
    DeliveryStatus,
    Outgoing,
    event_outgoing,
    run_outgoing,
)
from llmd_supervisor.core.events.routing import Destination, DestinationKind, EventsConfig
from llmd_supervisor.core.events.webhooks import unix_seconds, verify
from llmd_supervisor.core.protocol.runs import RunSummary, read
from llmd_supervisor.core.run.lifecycle import Submit, Submitted, new_run, step
from llmd_supervisor.core.slurm.parse import JobState
from llmd_supervisor.errors import ControlError, WebhookSecretError, WebhookSignatureError
from llmd_supervisor.supervision.events.api import EventOps
from tests.devcluster import REPO
from tests.fakes.slurm_replay import End, ReplayCluster, Start
from tests.fakes.webhook_receiver import Answer, Receiver
from tests.unit.test_daemon_root import Daemon, _config, _publish_marker, _spec, _started
from tests.waiting import until

T0 = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)
SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
REF = RunRef("r-1", "demo", "alice", 1000, "dev", "demo", "ab" * 32)


class Clock:
    """The sender's clock, moved by the test (retries are minutes apart)."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC)  # webhook-timestamp must verify against real time

    def __call__(self) -> datetime:
        return self.now


class LookingOutbox(Outbox):
    """The real outbox, counting the sender's looks for due deliveries."""

    looks = 0

    async def due(self, now: datetime, per_destination: int = 8) -> list[tuple[Delivery, bytes]]:
        self.looks += 1
        return await super().due(now, per_destination)


@dataclass
class World:
    journal: Journal
    outbox: Outbox
    receiver: Receiver
    clock: Clock
    secret_file: Path
    url: str
    tg: anyio.abc.TaskGroup

    def destination(self, name: str = "ci") -> Destination:
        return Destination(
            name, DestinationKind.WEBHOOK, url=self.url, secret_file=str(self.secret_file)
        )

    async def sender(self, *destinations: Destination) -> EventSender:
        sender = EventSender(
            self.outbox,
            EventsConfig(destinations or (self.destination(),)),
            clock=self.clock,
            rng=lambda: 0.5,
            sendmail=(str(self.secret_file.parent / "sendmail"), "-t", "-oi"),
            idle_s=0.02,
        )
        await self.tg.start(sender.run)
        return sender

    async def submitted(
        self, run_id: str = "r-1", *dests: Destination, owner: int = 1000
    ) -> Outgoing:
        """A run of `owner` journaled up to pending, with its run.submitted for `dests`."""
        run = new_run(run_id, f"llmd-{run_id}", T0)
        meta = RunMeta(owner, "dev", "x", "", "/l", "/a", T0)
        await self.journal.insert_run(run, meta)
        a = step(run, Submit(), T0 + timedelta(seconds=1))[0]
        await self.journal.save(a, expected=run.state)
        b = step(a, Submitted("42"), T0 + timedelta(seconds=2))[0]
        (out,) = run_outgoing(
            a, b, replace(REF, id=run_id), Links(), dests or (self.destination(),)
        )
        await self.journal.save(b, expected=a.state, outgoing=[out])
        return out

    async def looked_again(self, looks: int = 3) -> None:
        """Return once the sender has looked for due deliveries `looks` more times (so
        anything due now would have been sent), and nothing is due now."""
        outbox = self.outbox
        assert isinstance(outbox, LookingOutbox)
        target = outbox.looks + looks
        await until(lambda: outbox.looks >= target, what=f"{looks} more looks of the sender")
        assert await outbox.due(self.clock()) == []

    async def until(self, event_id: str, status: DeliveryStatus, dest: str = "ci") -> Delivery:
        with anyio.fail_after(20):
            while True:
                stored = await self.outbox.event(event_id)
                assert stored is not None
                (d,) = [d for d in stored.deliveries if d.destination == dest]
                if d.status is status:
                    return d
                await anyio.sleep(0.02)


@asynccontextmanager
async def world_in(tmp_path: Path) -> AsyncIterator[World]:
    """A journal, a receiver and a task group for the sender (a fixture would enter the
    task group in another task than the test's)."""
    secret_file = tmp_path / "ci.whsec"
    secret_file.write_text(f"# the CI receiver\n{SECRET}\n")
    secret_file.chmod(0o600)
    async with (
        await Journal.open(tmp_path / "journal.db") as journal,
        anyio.create_task_group() as tg,
    ):
        receiver = Receiver()
        port = await tg.start(receiver.serve)
        yield World(
            journal,
            LookingOutbox(journal),
            receiver,
            Clock(),
            secret_file,
            f"http://127.0.0.1:{port}/hooks/llmd?x=1",
            tg,
        )
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_a_500_is_retried_with_the_same_webhook_id_and_signed(tmp_path: Path) -> None:
    async with world_in(tmp_path) as world:
        await _a_500_is_retried_with_the_same_webhook_id_and_signed(world)


async def _a_500_is_retried_with_the_same_webhook_id_and_signed(world: World) -> None:
    world.receiver.script[:] = [Answer(500)]
    out = await world.submitted()
    sender = await world.sender()
    got = await world.receiver.until(1)
    assert sender.counts() == {("ci", "queued"): 1}  # counted before the first attempt
    retrying = await world.until(out.id, DeliveryStatus.RETRYING)
    assert retrying.attempts == 1 and "HTTP 500" in retrying.last_error
    # Attempt 2 is due 5 s later (jitter 0.5: exactly 5 s): not before.
    assert retrying.next_at == world.clock.now + timedelta(seconds=5)
    world.clock.now += timedelta(seconds=6)
    got = await world.receiver.until(2)
    delivered = await world.until(out.id, DeliveryStatus.DELIVERED)
    assert delivered.attempts == 2
    keys = await read_secret_file(world.secret_file)
    for request in got:
        assert request.target == "/hooks/llmd?x=1"
        assert request.body == out.body  # the event's body, verbatim
        assert request.headers["webhook-id"] == out.id  # the same on every attempt
        assert request.headers["content-type"] == "application/json"
        verify(keys, request.headers, request.body, now=unix_seconds(datetime.now(UTC)))
        with pytest.raises(WebhookSignatureError):
            verify(keys, request.headers, request.body + b" ", now=unix_seconds(datetime.now(UTC)))
    assert json.loads(got[0].body)["type"] == "run.submitted"
    await world.looked_again()
    assert len(world.receiver.got) == 2  # delivered: never sent again


@pytest.mark.asyncio
async def test_410_disables_the_destination_and_replay_enables_it(tmp_path: Path) -> None:
    async with world_in(tmp_path) as world:
        await _410_disables_the_destination_and_replay_enables_it(world)


async def _410_disables_the_destination_and_replay_enables_it(world: World) -> None:
    world.receiver.script[:] = [Answer(410)]
    first = await world.submitted("r-1")
    sender = await world.sender()
    await world.receiver.until(1)
    dead = await world.until(first.id, DeliveryStatus.DEAD)
    assert "410" in dead.last_error
    assert "ci" in await world.outbox.disabled()
    later = await world.submitted("r-2")  # a new event for it is journaled disabled
    await world.until(later.id, DeliveryStatus.DISABLED)
    await world.looked_again()
    assert len(world.receiver.got) == 1
    assert await world.outbox.replay(later.id, world.clock.now) == 1
    sender.wake()
    await world.until(later.id, DeliveryStatus.DELIVERED)
    assert await world.outbox.disabled() == {}


@pytest.mark.parametrize(
    ("answer", "status", "after_s"),
    [
        (Answer(429, (("Retry-After", "120"),)), DeliveryStatus.RETRYING, 120),
        (Answer(302, (("Location", "http://127.0.0.1:1/"),)), DeliveryStatus.RETRYING, 5),
        (Answer(404), DeliveryStatus.DEAD, None),
        (Answer(408), DeliveryStatus.RETRYING, 5),
    ],
    ids=["429 Retry-After", "redirect not followed", "404 final", "408 retried"],
)
@pytest.mark.asyncio
async def test_each_answer_s_next_step(
    tmp_path: Path, answer: Answer, status: DeliveryStatus, after_s: int | None
) -> None:
    async with world_in(tmp_path) as world:
        await _each_answer_s_next_step(world, answer, status, after_s)


async def _each_answer_s_next_step(
    world: World, answer: Answer, status: DeliveryStatus, after_s: int | None
) -> None:
    world.receiver.script[:] = [answer]
    out = await world.submitted()
    await world.sender()
    await world.receiver.until(1)
    d = await world.until(out.id, status)
    expected = None if after_s is None else world.clock.now + timedelta(seconds=after_s)
    assert d.next_at == expected
    await world.looked_again()
    assert len(world.receiver.got) == 1  # the redirect's Location was not asked


@pytest.mark.asyncio
async def test_a_refused_connection_and_a_readable_secret_are_retried(tmp_path: Path) -> None:
    async with world_in(tmp_path) as world:
        await _a_refused_connection_and_a_readable_secret_are_retried(world)


async def _a_refused_connection_and_a_readable_secret_are_retried(world: World) -> None:
    own = world.secret_file.with_name("gone.whsec")
    own.write_text(SECRET)
    own.chmod(0o600)
    closed = replace(world.destination("gone"), url="http://127.0.0.1:9/", secret_file=str(own))
    out = await world.submitted("r-1", closed, world.destination())
    world.secret_file.chmod(0o644)
    await world.sender(closed, world.destination())
    refused = await world.until(out.id, DeliveryStatus.RETRYING, "gone")
    assert "Error" in refused.last_error  # connection refused, named
    unsent = await world.until(out.id, DeliveryStatus.RETRYING, "ci")
    assert "not sent" in unsent.last_error and "mode is 0644" in unsent.last_error
    assert world.receiver.got == []
    with pytest.raises(WebhookSecretError):
        await read_secret_file(world.secret_file)


@pytest.mark.asyncio
async def test_slack_gets_its_message_and_mail_goes_to_sendmail(tmp_path: Path) -> None:
    async with world_in(tmp_path) as world:
        await _slack_gets_its_message_and_mail_goes_to_sendmail(world, tmp_path)


async def _slack_gets_its_message_and_mail_goes_to_sendmail(world: World, tmp: Path) -> None:
    # A sendmail that keeps each message and exits with the status in ./rc (75: try later).
    (tmp / "sendmail").write_text(
        f'#!/bin/sh\n[ "$*" = "-t -oi" ] || exit 64\ncat > "{tmp}/mail.$$"\n'
        f'exit "$(cat "{tmp}/rc")"\n'
    )
    (tmp / "sendmail").chmod(0o755)
    (tmp / "rc").write_text("75\n")
    slack = Destination("team", DestinationKind.SLACK, url=world.url)
    mail = Destination("oncall", DestinationKind.MAIL, to=("oncall@example.org",))
    out = await world.submitted("r-1", slack, mail)
    await world.sender(slack, mail)
    (request,) = await world.receiver.until(1)
    assert "webhook-signature" not in request.headers
    message = json.loads(request.body)
    assert "text" in message and "blocks" in message
    assert out.id in request.body.decode()  # the event id in the context block
    await world.until(out.id, DeliveryStatus.DELIVERED, "team")
    later = await world.until(out.id, DeliveryStatus.RETRYING, "oncall")
    assert "sendmail exited 75" in later.last_error
    (tmp / "rc").write_text("0\n")
    world.clock.now += timedelta(seconds=6)
    await world.until(out.id, DeliveryStatus.DELIVERED, "oncall")
    mails = _mails(tmp)
    assert len(mails) == 2 and mails[0] == mails[1]  # the same mail on every attempt
    text = mails[0].decode()
    assert "To: oncall@example.org" in text and f"Message-ID: <{out.id}@" in text
    assert "Auto-Submitted: auto-generated" in text


def _mails(tmp: Path) -> list[bytes]:
    """What the fake sendmail got, one message each."""
    return [p.read_bytes() for p in sorted(tmp.glob("mail.*"))]


# --- a whole daemon ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_finished_run_s_run_finished_reaches_the_webhook(tmp_path: Path) -> None:
    secret_file = tmp_path / "ci.whsec"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    replay = ReplayCluster(touch_files=True)
    receiver = Receiver()
    log_dir = tmp_path / "logs"
    async with anyio.create_task_group() as outer:
        port = await outer.start(receiver.serve)
        ci = Destination(
            "ci",
            DestinationKind.WEBHOOK,
            url=f"http://127.0.0.1:{port}/hook",
            secret_file=str(secret_file),
            types=frozenset(
                {EventType.RUN_SUBMITTED, EventType.RUN_POINT_FINISHED, EventType.RUN_FINISHED}
            ),
        )
        # Our own group is the admin group: `events test` is for admins.
        admins = grp.getgrgid(os.getgid()).gr_name
        config: Config = replace(_config(tmp_path), events=EventsConfig((ci,)), admin_group=admins)
        daemon = Daemon(config, replay)
        async with anyio.create_task_group() as tg:
            await _started(daemon, tg)
            submitted = read(RunSummary, await daemon.call("submit", spec_toml=_spec(log_dir)))
            run = submitted["run"]
            replay.expect(submitted["job_name"], Start(("127.0.0.1",)), End(JobState.COMPLETED))
            pending = await daemon.until_state(run, "pending")
            replay.step()
            await daemon.until_state(run, "running")
            _publish_marker(pending, log_dir)
            replay.step()
            final = await daemon.until_state(run, "succeeded", "failed")
            assert final["state"] == "succeeded", final["reason"]
            got = list(await receiver.until(5))  # submitted, 3 points (c=1, 2, 4), finished
            await _events_cli(config.socket_path, run, tmp_path)
            (*_, ping) = await receiver.until(6)  # `events test ci`
            assert json.loads(ping.body)["type"] == "test.ping"
            os.kill(os.getpid(), signal.SIGTERM)
        outer.cancel_scope.cancel()
    keys = await read_secret_file(secret_file)
    bodies = [json.loads(r.body) for r in got]
    # Deliveries are not ordered across events (each has its own retries): what arrived.
    assert sorted(b["type"] for b in bodies) == [
        "run.finished",
        *["run.point_finished"] * 3,
        "run.submitted",
    ], [b["type"] for b in bodies]
    points = sorted(
        (b for b in bodies if b["type"] == "run.point_finished"),
        key=lambda b: b["data"]["point"]["concurrency"],
    )
    assert [p["data"]["point"]["concurrency"] for p in points] == [1, 2, 4]
    assert all(p["data"]["point"]["valid"] for p in points)
    assert all(p["data"]["point"]["total_token_throughput"] > 0 for p in points)
    (finished,) = [b for b in bodies if b["type"] == "run.finished"]
    data = finished["data"]
    assert data["run"]["id"] == run
    assert data["outcome"] == "succeeded"
    assert data["reason"] == final["reason"]
    assert data["links"]["archive"] == final["archive"]
    # What the receipt, the attempts and the archived results table say:
    assert (data["slurm"]["state"], data["slurm"]["exit_code"]) == ("COMPLETED", "0:0")
    assert data["slurm"]["nodes"] == ["127.0.0.1"]
    assert any(line.startswith("Slurm (") for line in data["evidence"]), data["evidence"]
    assert any(line.startswith("marker: ") for line in data["evidence"]), data["evidence"]
    assert data["gpu_hours"]["lost"] == 0.0
    assert [p["concurrency"] for p in data["points"]] == [1, 2, 4]
    assert data["best_point"] is not None and data["best_point"]["valid"]
    assert data["timing"]["ran_s"] is not None
    assert finished["trimmed"] == []
    for r in got:
        assert r.headers["webhook-id"] == json.loads(r.body)["id"]
        verify(keys, r.headers, r.body, now=unix_seconds(datetime.now(UTC)))
    async with await Journal.open(config.journal_path) as journal:
        listed = await Outbox(journal).deliveries(run_id=run)
    assert {d.status for d in listed} == {DeliveryStatus.DELIVERED}


# --- the control socket's events ops ------------------------------------------------------


class Owners:
    """Runs r-1 (uid 1000) and r-2 (uid 2000)."""

    owners: ClassVar[Mapping[str, int]] = {"r-1": 1000, "r-2": 2000}

    def owner_of(self, run_id: str) -> int | None:
        return self.owners.get(run_id)

    def run_id_of(self, ref: str) -> str | None:
        return ref if ref in self.owners else None


async def _nothing(_: object) -> None:
    return None


@pytest.mark.asyncio
async def test_events_ops_show_a_user_their_own_runs_events(tmp_path: Path) -> None:
    async with world_in(tmp_path) as world:
        await _events_ops(world)


async def _events_ops(world: World) -> None:
    mine = await world.submitted("r-1")
    world.receiver.once_for[mine.id] = Answer(404)  # the sender's order is by id, not ours
    theirs = await world.submitted("r-2", owner=2000)
    campaign = await _campaign_progress(world, owner=1000)
    woken: list[bool] = []
    ops = EventOps(
        world.outbox,
        Owners(),
        admin_group=None,
        clock=world.clock,
        wake=lambda: woken.append(True),
        events=EventsConfig((world.destination(),)),
    )
    alice, bob, root = Peer(1000, 1000, 1), Peer(2000, 2000, 2), Peer(0, 0, 3)
    no_filter = {"run": None, "status": None}
    listed = await ops.list(no_filter, alice, _nothing)
    assert {d["event"] for d in listed["deliveries"]} == {mine.id, campaign.id}  # her own
    assert {d["event"] for d in (await ops.list(no_filter, root, _nothing))["deliveries"]} == {
        mine.id,
        theirs.id,
        campaign.id,
    }
    assert (await ops.show({"event": campaign.id}, alice, _nothing))["type"] == (
        "campaign.progress"
    )
    with pytest.raises(ControlError) as not_bobs:
        await ops.show({"event": campaign.id}, bob, _nothing)
    assert not_bobs.value.code == "not_found"
    with pytest.raises(ControlError) as hidden:  # another's run: as if it did not exist
        await ops.list({"run": "r-2", "status": None}, alice, _nothing)
    assert hidden.value.code == "not_found"
    with pytest.raises(ControlError) as hidden:
        await ops.show({"event": theirs.id}, alice, _nothing)
    assert hidden.value.code == "not_found"
    with pytest.raises(ControlError) as bad:
        await ops.list({"run": None, "status": "lost"}, alice, _nothing)
    assert bad.value.code == "bad_request" and "queued, retrying" in bad.value.message
    shown = await ops.show({"event": mine.id}, alice, _nothing)
    assert shown["body"] == json.loads(mine.body)
    assert [d["status"] for d in shown["deliveries"]] == ["queued"]
    with pytest.raises(ControlError) as nothing_dead:
        await ops.replay({"event": mine.id, "destination": None}, alice, _nothing)
    assert nothing_dead.value.code == "bad_request"
    # The 404 makes it dead at once; its owner replays it, and it is delivered.
    await world.sender()
    await world.until(mine.id, DeliveryStatus.DEAD)
    dead = await ops.list({"run": "r-1", "status": "dead"}, alice, _nothing)
    assert [d["destination"] for d in dead["deliveries"]] == ["ci"]
    with pytest.raises(ControlError) as unknown:
        await ops.replay({"event": mine.id, "destination": "nope"}, alice, _nothing)
    assert unknown.value.code == "not_found" and "it has: ci" in unknown.value.message
    with pytest.raises(ControlError):
        await ops.replay({"event": mine.id, "destination": None}, bob, _nothing)
    done = await ops.replay({"event": mine.id, "destination": "ci"}, alice, _nothing)
    assert done == {"event": mine.id, "queued": 1} and woken == [True]
    await world.until(mine.id, DeliveryStatus.DELIVERED)
    # events test DEST: admins only, a configured destination only, signed like any other.
    with pytest.raises(ControlError) as refused:
        await ops.test({"destination": "ci"}, alice, _nothing)
    assert refused.value.code == "forbidden"
    with pytest.raises(ControlError) as unknown_dest:
        await ops.test({"destination": "nope"}, root, _nothing)
    assert unknown_dest.value.code == "not_found" and "ci" in unknown_dest.value.message
    ping = await ops.test({"destination": "ci"}, root, _nothing)
    await world.until(ping["event"], DeliveryStatus.DELIVERED)
    request = world.receiver.got[-1]
    assert request.headers["webhook-id"] == ping["event"]
    body = json.loads(request.body)
    assert body["type"] == "test.ping" and body["data"]["destination"] == "ci"
    verify(
        await read_secret_file(world.secret_file),
        request.headers,
        request.body,
        now=unix_seconds(datetime.now(UTC)),
    )
    again = await ops.test({"destination": "ci"}, root, _nothing)
    assert again["event"] != ping["event"]  # each request is an event of its own


async def _campaign_progress(world: World, *, owner: int) -> Outgoing:
    """A campaign of `owner` journaled, with a campaign.progress of it for ci."""
    store = CampaignStore(world.journal)
    stored = StoredCampaign("c-1", "sweep", owner, "dev", "running", "", "", "", {}, T0, T0)
    await store.insert(stored, [])
    facts = CampaignFacts("c-1", "sweep", "alice", owner, "dev", PointCounts(total=2))
    later = T0 + timedelta(hours=1)  # due after the runs' events (the 404 is for r-1's)
    (out,) = event_outgoing(EventType.CAMPAIGN_PROGRESS, facts, later, 1, (world.destination(),))
    await world.outbox.add(out)
    return out


async def _events_cli(socket: Path, run: str, tmp_path: Path) -> None:
    """`events list` and `events show` against the daemon, as a user types them."""

    async def cli(*words: str) -> subprocess.CompletedProcess[bytes]:
        argv = [sys.executable, "-m", "llmd_supervisor", "events", *words, "--socket", str(socket)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return await anyio.run_process(argv, check=False, env=env, cwd=tmp_path)

    with anyio.fail_after(60):
        while True:  # the second delivery's commit may follow its 2xx by a moment
            listed = await cli("list", "--run", run, "--json")
            assert listed.returncode == 0, listed.stderr
            deliveries = json.loads(listed.stdout)["deliveries"]
            if {d["status"] for d in deliveries} == {"delivered"}:
                break
            await anyio.sleep(0.05)
    assert sorted(d["type"] for d in deliveries) == [
        "run.finished",
        *["run.point_finished"] * 3,
        "run.submitted",
    ]
    table = await cli("list", "--run", run)
    assert table.returncode == 0 and b"delivered" in table.stdout
    shown = await cli("show", deliveries[0]["event"])
    assert shown.returncode == 0 and deliveries[0]["event"].encode() in shown.stdout
    missing = await cli("show", "evt_nope")
    assert missing.returncode == 2
    assert missing.stderr.decode().splitlines() == [
        'llmd-supervisor events show: No event "evt_nope" is in the journal.'
    ]
    tested = await cli("test", "ci")
    assert tested.returncode == 0 and b"queued for ci" in tested.stdout, tested.stderr
    unknown = await cli("test", "nope")
    assert unknown.returncode == 2 and b"No destination" in unknown.stderr
    again = await cli("replay", deliveries[0]["event"])
    assert again.returncode == 2 and b"no dead or disabled delivery" in again.stderr
    assert b"Traceback" not in again.stderr + missing.stderr


def test_config_check_names_a_secret_file_the_daemon_could_not_sign_with(tmp_path: Path) -> None:
    good, loose, bad = tmp_path / "good", tmp_path / "loose", tmp_path / "bad"
    for path, text in ((good, SECRET), (loose, SECRET), (bad, "whsec_short")):
        path.write_text(text + "\n")
        path.chmod(0o600)
    loose.chmod(0o640)
    dests = tuple(
        Destination(f"d{i}", DestinationKind.WEBHOOK, url="https://x.example/", secret_file=str(p))
        for i, p in enumerate((good, loose, bad, tmp_path / "missing"))
    )
    problems = secret_problems(Config(events=EventsConfig(dests)))
    assert [p.key for p in problems] == [
        "events.destination[1].secret_file",
        "events.destination[2].secret_file",
        "events.destination[3].secret_file",
    ]
    assert "mode is 0640" in problems[0].hint and "chmod 600" in problems[0].hint
    assert problems[1].hint.startswith("line 1: ")
    assert "cannot be opened" in problems[2].hint
    assert all("whsec_short" not in str(p) for p in problems)  # never the secret


@pytest.mark.asyncio
async def test_a_silent_receiver_times_out_and_nonsense_is_no_answer() -> None:
    async def silent(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await anyio.sleep_forever()

    async def nonsense(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.receive()
            await stream.send(b"SSH-2.0-OpenSSH\r\n\r\n")

    async def serve(
        handler: Callable[[anyio.abc.SocketStream], Awaitable[None]],
        *,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        async with await anyio.create_tcp_listener(
            local_host="127.0.0.1", local_port=0
        ) as listener:
            task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
            await listener.serve(handler)

    async with anyio.create_task_group() as tg:
        ports = [await tg.start(serve, silent), await tg.start(serve, nonsense)]
        with anyio.fail_after(10):
            quiet = await post_json(f"http://127.0.0.1:{ports[0]}/", b"{}", {}, 0.3)
            odd = await post_json(f"http://127.0.0.1:{ports[1]}/", b"{}", {}, 5)
        tg.cancel_scope.cancel()
    assert quiet == NetworkFailure("no answer within 0.3 s")
    assert isinstance(odd, NetworkFailure) and "not an HTTP/1.x answer" in odd.what


def test_the_metrics_show_deliveries_per_destination_and_status() -> None:
    metrics = Metrics()
    assert b"event_deliveries{" not in metrics.exposition()
    metrics.attach_deliveries(lambda: {("ci", "dead"): 2, ("ci", "delivered"): 5})
    text = metrics.exposition()
    assert b'llmd_supervisor_event_deliveries{destination="ci",status="dead"} 2.0' in text
    assert b'llmd_supervisor_event_deliveries{destination="ci",status="delivered"} 5.0' in text
