"""What `nodes` shows to whom (issue 3.2 item 8, the `nodes` half): a user sees the nodes
kept out of everyone's runs and of its own, and the run and reason of a failure only when
the run is its own; root and the admin group see everything."""

from __future__ import annotations

import io
from datetime import timedelta
from pathlib import Path

import pytest

from llmd_supervisor.adapters.control.protocol import Peer
from llmd_supervisor.cli.launch import nodes_table
from llmd_supervisor.cli.run_commands import _print_summary
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.protocol.runs import NodesView, RunSummary, read
from llmd_supervisor.core.run.retry_policy import (
    Evidence,
    NodeFailure,
    Quarantined,
    QuarantineRules,
    quarantine,
)
from llmd_supervisor.supervision.control.api import ControlApi
from tests.unit.test_control_api import ME, OTHER, T0, Supervisor, no_stream, request

ROOT = Peer(uid=0, gid=0, pid=3)
RULES = QuarantineRules(ttl=timedelta(hours=6))


def failure(node: str, owner: int, run: str, minutes: int) -> NodeFailure:
    at = T0 - timedelta(minutes=10 - minutes)
    return NodeFailure("dev", node, owner, run, 1, Evidence.INFERRED, f"{run}: its engine died", at)


class Nodes(Supervisor):
    """The fake supervisor with node failures counted: node1 kept out of everyone's runs
    (another user's runs of two owners), node2 only of OTHER's (two of OTHER's runs),
    node3 counted once for ME."""

    async def nodes(self, release: tuple[str, str] | None = None) -> tuple[list[Quarantined], bool]:
        failures = [
            failure("node1", ME.uid, "mine1", 1),
            failure("node1", OTHER.uid, "theirs1", 2),
            failure("node2", OTHER.uid, "theirs2", 3),
            failure("node2", OTHER.uid, "theirs3", 4),
            failure("node3", ME.uid, "mine2", 5),
        ]
        return quarantine(failures, now=T0, rules=RULES), False


async def shown(peer: Peer, tmp_path: Path) -> list[tuple[str, object, bool, str, str]]:
    api = ControlApi(Nodes(Config(state_dir=tmp_path)), clock=lambda: T0)
    view = read(NodesView, await api.handle(request("nodes"), peer, no_stream))
    return [
        (q["node"], q.get("owner_uid"), q["active"], q["run"], q["reason"]) for q in view["nodes"]
    ]


@pytest.mark.asyncio
async def test_a_user_sees_its_own_runs_and_nothing_of_anothers(tmp_path: Path) -> None:
    theirs = "(another user's run)"
    assert await shown(ME, tmp_path) == [
        ("node1", None, True, "", theirs),  # the last failure counted was OTHER's
        ("node2", None, False, "", theirs),
        ("node3", None, False, "mine2", "mine2: its engine died"),
    ]
    assert await shown(OTHER, tmp_path) == [
        ("node1", None, True, "theirs1", "theirs1: its engine died"),
        ("node2", None, False, "theirs3", "theirs3: its engine died"),
        ("node2", OTHER.uid, True, "theirs3", "theirs3: its engine died"),
        ("node3", None, False, "", theirs),
    ]


@pytest.mark.asyncio
async def test_an_admin_sees_every_run_and_reason(tmp_path: Path) -> None:
    got = await shown(ROOT, tmp_path)
    assert [(n, o, run) for n, o, _, run, _ in got] == [
        ("node1", None, "theirs1"),
        ("node2", None, "theirs3"),
        ("node2", OTHER.uid, "theirs3"),
        ("node3", None, "mine2"),
    ]


@pytest.mark.asyncio
async def test_the_nodes_table_says_for_whom_a_node_is_kept_out(tmp_path: Path) -> None:
    api = ControlApi(Nodes(Config(state_dir=tmp_path)), clock=lambda: T0)
    view = read(NodesView, await api.handle(request("nodes"), OTHER, no_stream))
    lines = nodes_table(view)
    assert lines[0].split()[:4] == ["CLUSTER", "NODE", "FOR", "FAILS"]
    assert lines[1].split()[:5] == ["dev", "node1", "everyone", "2", "quarantined"]
    assert lines[3].split()[:6] == ["dev", "node2", "uid", "1001", "2", "quarantined"]
    assert lines[4].split()[6:] == ["-", "(another", "user's", "run)"]
    # Columns as wide as their cells: the until times (32 characters) do not push it out.
    assert lines[4][lines[0].index("RUN / REASON") :] == "- (another user's run)"


def test_a_held_runs_summary_says_until_when() -> None:
    summary: dict[str, object] = {
        "run": "r1", "job_name": "llmd-r1", "state": "accepted", "outcome": None,
        "reason": "waiting: the job needs 4 nodes ...", "slurm_job_id": None, "attempt": 1,
        "nodes": [], "nodes_healthy": 0, "cancel_requested": False, "cluster": "dev",
        "owner_uid": 1000, "created_at": T0.isoformat(), "elapsed_s": 1.0, "archive": "/a",
        "log_dir": "/l", "health": {}, "transitions": [], "last_log_line": "",
        "held_until": "2026-01-02T03:34:05+00:00",
    }  # fmt: skip
    out = io.StringIO()
    _print_summary(read(RunSummary, summary), out)
    assert "  held until 2026-01-02T03:34:05+00:00: waiting: the job needs 4" in out.getvalue()


def test_the_nodes_table_keeps_its_columns_with_long_names() -> None:
    """Node names longer than 12 characters pushed the later columns out of line."""
    entry = {
        "cluster": "prod-h200", "failures": 3, "active": True, "reason": "NODE_FAIL",
        "run": "a8c78661894a", "since": "2026-01-02T03:04:05+00:00",
        "until": "2026-01-02T09:04:05+00:00", "owner_uid": None,
    }  # fmt: skip
    view = read(
        NodesView,
        {
            "nodes": [entry | {"node": "gpu-node-0001.example.org"}, entry | {"node": "n2"}],
            "released": False,
        },
    )
    head, *lines = nodes_table(view)
    at = head.index("RUN / REASON")
    assert [line[at:] for line in lines] == ["a8c78661894a NODE_FAIL"] * 2
    assert [line[head.index("STATE") :].split()[0] for line in lines] == ["quarantined"] * 2
