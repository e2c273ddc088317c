"""Node quarantine and held runs through the per-run driver on a replayed cluster
(issue 3.2 items 1 and 3): a job's status files cannot name a node outside its allocation
nor quarantine one for anyone else; a retry that could only run on nodes it must keep out
is reported as not retried; a run held for want of nodes fails at its deadline, and
`status` shows the hold and the deadline meanwhile."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from llmd_supervisor.adapters.outbox.store import Outbox
from llmd_supervisor.core.events.model import EventType
from llmd_supervisor.core.events.routing import Destination, DestinationKind, EventsConfig
from llmd_supervisor.core.run.lifecycle import RunState
from llmd_supervisor.core.run.retry_policy import Evidence, NodeFailure, quarantine
from llmd_supervisor.core.slurm.parse import JobState
from llmd_supervisor.errors import RemoteError
from llmd_supervisor.node import common
from llmd_supervisor.supervision.control.views import run_summary
from llmd_supervisor.supervision.run import retries, verify
from llmd_supervisor.supervision.run.driver import RunHandle
from tests.fakes.slurm_replay import End, Start
from tests.unit.test_driver_replay import Rig, _spec, replayed

ALLOC = ("node1", "node2", "node3", "node4")  # the demo spec's 4 ranks, as Slurm gives them
USER, OTHER = 1000, 1001
NO_RETRY = "\n[retry]\ninfrastructure = 0\n"


def cluster_of(rig: Rig, monkeypatch: pytest.MonkeyPatch, nodes: tuple[str, ...]) -> None:
    """`sinfo`'s node list (the replayed cluster does not answer sinfo)."""
    client = rig.sup.clusters["dev"].client

    async def node_names(partition: str | None = None) -> list[str]:
        return list(nodes)

    monkeypatch.setattr(client, "node_names", node_names)


def write_hostile_statuses(h: RunHandle) -> None:
    """Status files as a hostile job writes them: ranks 0-1 claim hosts outside the
    allocation (node5, node6), rank 0's engine "died" (rc 73) beside rank 1's healthy
    one, the decode ranks claim node5 too."""
    claims = [
        {"rank": 0, "host": "node5", "role": "prefill", "state": "failed",
         "local_rc": common.RC_ENGINE_DIED, "failed_component": "engine", "failed_rank": 0},
        {"rank": 1, "host": "node6", "role": "prefill", "state": "failed",
         "local_rc": common.RC_SIGTERM, "healthy": ["engine"]},
        {"rank": 2, "host": "node5", "role": "decode", "state": "failed",
         "local_rc": common.RC_SIGTERM, "healthy": ["engine", "sidecar"]},
        {"rank": 3, "host": "node6[0-9]", "role": "decode", "state": "failed",
         "local_rc": common.RC_SIGTERM, "healthy": ["engine", "sidecar"]},
    ]  # fmt: skip
    for rank, claim in enumerate(claims):
        path = h.layout.status_file(h.job_id(), rank)
        assert path is not None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(claim))


@pytest.mark.asyncio
async def test_a_jobs_status_files_name_only_its_allocation_and_quarantine_nothing_for_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with replayed(tmp_path) as rig:
        cluster_of(rig, monkeypatch, ALLOC)  # 4 nodes: a retry without node1 cannot run
        h = await rig.sup.submit(_spec(rig.tmp / "logs"), owner_uid=USER)
        rig.replay.expect(h.run.job_name, Start(ALLOC), End(JobState.FAILED, exit_code="73:0"))
        await rig.until(h, lambda h: h.run.state is RunState.PENDING)
        rig.replay.step()
        await rig.until(h, lambda h: h.run.state is RunState.RUNNING)
        write_hostile_statuses(h)
        rig.replay.step()
        await rig.final(h)

        assert h.run.state is RunState.FAILED, h.run.reason
        assert rig.replay.count("sbatch") == 1  # not retried, and never held
        assert "cause=infrastructure node=node1;" in h.run.reason, h.run.reason
        assert h.run.reason.endswith(
            "; no retry: the job needs 4 nodes and only 3 of 4 are not excluded (node1)"
        ), h.run.reason
        (entry,) = h.history
        assert entry["implicated"] == ["node1"] and entry["retried"] is False
        assert entry["unplaced"] is True
        said = json.dumps([h.run.reason, h.history, await rig.journal.events(h.run.run_id)])
        assert "node5" not in said and "node6" not in said  # the job's words name nothing
        failures = await rig.journal.node_failures()
        assert [(f.node, f.owner_uid, f.evidence) for f in failures] == [
            ("node1", USER, Evidence.INFERRED)
        ]
        now = rig.sup.clock()
        found, _ = await rig.sup.nodes()
        assert [(q.node, q.owner_uid, q.active) for q in found] == [("node1", None, False)]
        assert not any(q.keeps_out(OTHER) or q.keeps_out(USER) for q in found)
        # A second run of the same user that fails the same way: node1 is kept out of that
        # user's runs only (two runs of one owner), never out of another user's.
        rules = retries.rules(rig.sup.config.limits)
        again = NodeFailure("dev", "node1", USER, "r2", 1, Evidence.INFERRED, "x", now)
        q = quarantine([*failures, again], now=now, rules=rules)
        assert any(x.keeps_out(USER) for x in q) and not any(x.keeps_out(OTHER) for x in q)


@pytest.mark.asyncio
async def test_a_held_run_shows_its_deadline_and_fails_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with replayed(tmp_path) as rig:
        cluster_of(rig, monkeypatch, ALLOC)
        now = rig.sup.clock()
        seen = NodeFailure("dev", "node4", OTHER, "r0", 1, Evidence.OBSERVED, "NODE_FAIL", now)
        await rig.journal.count_node_failure(seen, forget_before=now - timedelta(hours=6))
        for run in ("r1", "r2"):  # another user's own quarantine of node3: not this user's
            theirs = NodeFailure("dev", "node3", OTHER, run, 1, Evidence.INFERRED, "x", now)
            await rig.journal.count_node_failure(theirs, forget_before=now - timedelta(hours=6))
        spec = _spec(rig.tmp / "logs") + "\n[retry]\nhold_timeout_s = 1.5\n"
        h = await rig.sup.submit(spec, owner_uid=USER)
        await rig.until(h, lambda h: h.held_until is not None)
        assert h.run.state is RunState.ACCEPTED
        shortage = "the job needs 4 nodes and only 3 of 4 are not excluded (node4)"
        assert h.run.reason.startswith(f"waiting: {shortage}; held until "), h.run.reason
        summary = run_summary(h, rig.sup.clock())
        assert h.held_until is not None
        until = h.held_until.isoformat()
        assert summary["held_until"] == until
        assert h.held_until.isoformat(timespec="seconds") in summary["reason"]
        assert 0 < (h.held_until - now).total_seconds() <= 2.5

        ended = (await rig.final(h)).run
        assert ended.state is RunState.FAILED
        assert ended.reason.startswith("held for want of nodes since "), ended.reason
        assert ended.reason.endswith(f"past its 1.5 s hold deadline: {shortage}")
        assert rig.replay.count("sbatch") == 0
        assert run_summary(h, rig.sup.clock())["held_until"] is None
        receipt = json.loads((Path(h.meta.archive_dir) / "receipt.json").read_text())
        assert receipt["outcome"] == "failed" and receipt["reason"] == ended.reason
        assert receipt["held"]["submission"] == 1
        held = [e for e in await rig.journal.events(h.run.run_id) if e["kind"] == "run.held"]
        assert [(e["submission"], e["until"]) for e in held] == [(1, until)]


@pytest.mark.parametrize(
    ("node", "error", "seen"),
    [
        ("node3", str(RemoteError("node3", "connecting", "Connection refused")), True),
        ("node3", str(RemoteError("node3", "connecting", "no connection within 10 s")), True),
        # the job can cause these: a read of its files that hangs, a status file gone stale
        ("node3", str(RemoteError("node3", "reading /x/rank0.status.json", "no answer")), False),
        ("node3", "rank 2's status file was last updated 75 s ago", False),
        ("node3", str(RemoteError("node4", "connecting", "refused")), False),  # another node
        ("node3", None, False),
    ],
)
def test_only_a_refused_ssh_connection_is_the_daemons_own_evidence(
    node: str, error: object, seen: bool
) -> None:
    assert verify.no_ssh(node, error) is seen


@pytest.mark.asyncio
async def test_the_failure_that_quarantines_a_node_journals_node_quarantined_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with replayed(tmp_path) as rig:
        ops = Destination(
            "ops",
            DestinationKind.WEBHOOK,
            url="http://127.0.0.1:9/",
            secret_file="/s",
            types=frozenset({EventType.NODE_QUARANTINED}),
        )
        rig.sup.config = replace(rig.sup.config, events=EventsConfig((ops,)))
        cluster_of(rig, monkeypatch, (*ALLOC, "node5"))  # room for a retry without node1
        now = rig.sup.clock()
        earlier = NodeFailure("dev", "node1", USER, "r0", 1, Evidence.INFERRED, "x", now)
        await rig.journal.count_node_failure(earlier, forget_before=now - timedelta(hours=6))
        h = await rig.sup.submit(_spec(rig.tmp / "logs") + NO_RETRY, owner_uid=USER)
        rig.replay.expect(h.run.job_name, Start(ALLOC), End(JobState.FAILED, exit_code="73:0"))
        await rig.until(h, lambda h: h.run.state is RunState.PENDING)
        rig.replay.step()
        await rig.until(h, lambda h: h.run.state is RunState.RUNNING)
        write_hostile_statuses(h)
        rig.replay.step()
        await rig.final(h)

        # This run's failure of node1 is the user's second run's: node1 is kept out of the
        # user's runs, and the event says so, journaled once with the count.
        listed = await Outbox(rig.journal).deliveries()
        assert [(d.type, d.subject, d.destination) for d in listed] == [
            ("node.quarantined", "node/dev/node1", "ops")
        ]
        stored = await Outbox(rig.journal).event(listed[0].event_id)
        assert stored is not None
        assert stored.seq == f"{h.run.run_id}:1:uid{USER}"
        data = json.loads(stored.body)["data"]
        assert (data["node"], data["scope"], data["owner_uid"], data["failures"]) == (
            "node1",
            "owner",
            USER,
            2,
        )
        assert data["run"] == h.run.run_id
