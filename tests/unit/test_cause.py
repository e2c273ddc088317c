"""The cause of a run that did not succeed (core.verdict.cause): a table over the evidence. Only
the attempt's allocation names nodes (issue 3.2 item 1): a status file's ``host`` is the
job's word; the nodes the daemon saw fail itself are told apart from those inferred."""

from __future__ import annotations

from typing import Any

import pytest

from llmd_supervisor.core.slurm.parse import JobState
from llmd_supervisor.core.verdict.cause import (
    NODE_RCS,
    Cause,
    RankEnd,
    diagnose,
    hang,
    rank_end,
    valid_node_name,
)
from llmd_supervisor.core.verdict.decide import Outcome
from llmd_supervisor.node import common

P, D = "prefill", "decode"
BOTH = frozenset({"engine", "sidecar"})
ALLOC = ("node1", "node2", "node3", "node4")  # the attempt's nodes by rank, from Slurm


def ranks(*rcs: int | None, component: str = "engine") -> list[RankEnd]:
    """2 prefill + 2 decode ranks on node1..node4 with these own exit statuses (a failing
    one names `component` as what failed, on itself; the others passed their engine's
    health check, and the decode ones their sidecar's)."""
    out = []
    for i, rc in enumerate(rcs):
        role, ok = (P, frozenset({"engine"})) if i < 2 else (D, BOTH)
        failing = rc in NODE_RCS
        what, where = (component, i) if failing else (None, None)
        healthy = frozenset() if failing else ok
        out.append(RankEnd(i, f"node{i + 1}", role, rc, what, where, healthy))
    return out


def saw(reporter: RankEnd, rc: int, culprit: int, component: str) -> RankEnd:
    """`reporter` failed because rank `culprit`'s `component` did not answer it."""
    return RankEnd(
        reporter.rank, reporter.node, reporter.role, rc, component, culprit, reporter.healthy
    )


OK4 = ranks(0, 0, 0, 0)
BENCH7 = ranks(7, 7, 7, 7)  # a benchmark point's rc: every rank exits with the marker's
ENGINE = common.RC_ENGINE_DIED
SIDECAR = common.RC_SERVICE_DIED
TERM = common.RC_SIGTERM


def hostile(*statuses: dict[str, object]) -> list[RankEnd]:
    """The rank ends of status files as a job wrote them, on the allocation ALLOC."""
    return [e for s in statuses if (e := rank_end(s, ALLOC)) is not None]


# Ranks 0-1 claim other hosts (node5, node6: not in the allocation) and rank 0's engine
# died beside rank 1's healthy one: the failure is rank 0's node, node1.
LYING = hostile(
    {"rank": 0, "host": "node5", "role": P, "local_rc": ENGINE, "failed_component": "engine",
     "failed_rank": 0},
    {"rank": 1, "host": "node6", "role": P, "local_rc": TERM, "healthy": ["engine"]},
    {"rank": 2, "host": "node5", "role": D, "local_rc": TERM, "healthy": ["engine", "sidecar"]},
    {"rank": 3, "host": "node6", "role": D, "local_rc": TERM, "healthy": ["engine", "sidecar"]},
)  # fmt: skip

# name, evidence, cause, implicated nodes, the implicated nodes the daemon saw fail itself
CASES: list[tuple[str, dict[str, Any], Cause, tuple[str, ...], tuple[str, ...]]] = [
    ("node fail", {"slurm_state": JobState.NODE_FAIL, "unreachable": ["node4"],
     "observed": ["node4"]}, Cause.INFRASTRUCTURE, ("node4",), ("node4",)),
    ("node fail beside a silent status file (the job's doing, maybe)",
     {"slurm_state": JobState.NODE_FAIL, "unreachable": ["node3", "node4"],
      "observed": ["node4"]}, Cause.INFRASTRUCTURE, ("node3", "node4"), ("node4",)),
    ("boot fail", {"slurm_state": JobState.BOOT_FAIL}, Cause.INFRASTRUCTURE, (), ()),
    ("preempted", {"slurm_state": JobState.PREEMPTED}, Cause.INFRASTRUCTURE, (), ()),
    ("oom", {"slurm_state": JobState.OUT_OF_MEMORY}, Cause.WORKLOAD, (), ()),
    ("a peer stopped before its own check is no evidence",
     {"ranks": [RankEnd(0, "node1", P, ENGINE, "engine", 0), RankEnd(1, "node2", P, TERM),
                *OK4[2:]]}, Cause.UNKNOWN, (), ()),
    ("timeout", {"slurm_state": JobState.TIMEOUT, "outcome": Outcome.TIMED_OUT},
     Cause.WORKLOAD, (), ()),
    ("cancel asked", {"cancel_requested": True, "slurm_state": JobState.CANCELLED},
     Cause.CANCELLED, (), ()),
    ("cancelled by slurm", {"outcome": Outcome.CANCELLED}, Cause.CANCELLED, (), ()),
    ("one node silent", {"unreachable": ["node3"], "ranks": OK4},
     Cause.INFRASTRUCTURE, ("node3",), ()),
    ("one node without SSH", {"unreachable": ["node3"], "observed": ["node3"], "ranks": OK4},
     Cause.INFRASTRUCTURE, ("node3",), ("node3",)),
    ("every node silent (our network)", {"unreachable": ["node1", "node2", "node3", "node4"],
     "ranks": OK4}, Cause.UNKNOWN, (), ()),
    ("one decode sidecar died", {"ranks": ranks(TERM, TERM, TERM, SIDECAR, component="sidecar")},
     Cause.INFRASTRUCTURE, ("node4",), ()),
    ("every decode sidecar died",
     {"ranks": ranks(TERM, TERM, SIDECAR, SIDECAR, component="sidecar")}, Cause.WORKLOAD, (), ()),
    ("the router never ready (one per job)",
     {"ranks": ranks(TERM, TERM, common.RC_SERVICE_UNHEALTHY, TERM, component="router")},
     Cause.UNKNOWN, (), ()),
    ("a remote engine not answering the coordinator",
     {"ranks": [*OK4[:2], saw(OK4[2], common.RC_REMOTE_UNHEALTHY, 1, "engine"), OK4[3]]},
     Cause.INFRASTRUCTURE, ("node2",), ()),
    ("the culprit's own record wins over what another rank saw",
     {"ranks": [*OK4[:2], saw(OK4[2], SIDECAR, 3, "engine"),
                ranks(0, 0, 0, SIDECAR, component="sidecar")[3]]},
     Cause.INFRASTRUCTURE, ("node4",), ()),
    ("the only sidecar died (one decode group)",
     {"ranks": [*OK4[:2], RankEnd(2, "node3", D, SIDECAR, "sidecar", 2),
                RankEnd(3, "node4", D, TERM, healthy=frozenset({"engine"}))]},
     Cause.UNKNOWN, (), ()),
    ("one prefill engine died", {"ranks": ranks(ENGINE, TERM, TERM, TERM)},
     Cause.INFRASTRUCTURE, ("node1",), ()),
    ("every prefill engine died", {"ranks": ranks(ENGINE, ENGINE, TERM, TERM)},
     Cause.WORKLOAD, (), ()),
    ("every prefill engine and the decode leader's never healthy (follower unchecked)",
     {"ranks": ranks(*[common.RC_ENGINE_UNHEALTHY] * 3, TERM)}, Cause.WORKLOAD, (), ()),
    ("every engine never healthy",
     {"ranks": ranks(*[common.RC_ENGINE_UNHEALTHY] * 4)}, Cause.WORKLOAD, (), ()),
    ("benchmark rc 7", {"ranks": BENCH7, "benchmark_failed": True}, Cause.WORKLOAD, (), ()),
    ("gate failed", {"ranks": OK4, "benchmark_failed": True}, Cause.WORKLOAD, (), ()),
    ("nothing known", {"ranks": []}, Cause.UNKNOWN, (), ()),
    # A hostile job's words (issue 3.2 item 1): only the allocation names nodes.
    ("status files claiming other hosts name the allocation's node",
     {"ranks": LYING}, Cause.INFRASTRUCTURE, ("node1",), ()),
    ("a node reported unreachable outside the allocation names nothing",
     {"unreachable": ["node9"], "observed": ["node9"], "ranks": OK4}, Cause.UNKNOWN, (), ()),
    ("Slurm's failed node outside the allocation names nothing",
     {"slurm_state": JobState.NODE_FAIL, "unreachable": ["node9"], "observed": ["node9"]},
     Cause.INFRASTRUCTURE, (), ()),
    ("a rank outside the allocation is no evidence",
     {"ranks": hostile({"rank": 7, "host": "node1", "role": P, "local_rc": ENGINE,
                        "failed_component": "engine"}, {"rank": 0, "role": P},
                       {"rank": 1, "role": P})},
     Cause.UNKNOWN, (), ()),
    ("a node name that is no plain name is never named",
     {"allocation": ("node[1-2]", "node2", "a/b", "node4"), "unreachable": ["node[1-2]", "a/b"],
      "observed": ["node[1-2]"], "ranks": [*OK4[1:2], *OK4[3:]]}, Cause.UNKNOWN, (), ()),
]  # fmt: skip


@pytest.mark.parametrize(
    ("evidence", "cause", "nodes", "observed"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_cause(
    evidence: dict[str, Any], cause: Cause, nodes: tuple[str, ...], observed: tuple[str, ...]
) -> None:
    args: dict[str, Any] = {
        "slurm_state": JobState.FAILED,
        "cancel_requested": False,
        "allocation": ALLOC,
        "ranks": OK4,
        "unreachable": [],
        "benchmark_failed": False,
        **evidence,
    }
    outcome = args.pop("outcome", Outcome.FAILED)
    diagnosis = diagnose(outcome, **args)
    assert diagnosis is not None
    assert (diagnosis.cause, diagnosis.nodes, diagnosis.observed) == (cause, nodes, observed), (
        diagnosis.why
    )
    suffix = f"cause={cause.value}" + (f" node={','.join(nodes)}" if nodes else "")
    assert diagnosis.text == suffix
    assert diagnosis.as_json()["observed"] == list(observed)


def test_a_success_has_no_cause() -> None:
    no_cause = diagnose(
        Outcome.SUCCEEDED,
        slurm_state=JobState.COMPLETED,
        cancel_requested=False,
        allocation=ALLOC,
        ranks=OK4,
        unreachable=[],
        benchmark_failed=False,
    )
    assert no_cause is None


@pytest.mark.parametrize(
    ("status", "end"),
    [
        ({"rank": 3, "host": "node4", "role": "decode", "local_rc": 77,
          "failed_component": "sidecar", "failed_rank": 3},
         RankEnd(3, "node4", "decode", 77, "sidecar", 3)),
        ({"rank": 0, "host": "node1", "role": "prefill"}, RankEnd(0, "node1", "prefill", None)),
        ({"rank": 2, "host": "node3", "role": "decode", "healthy": ["engine", "sidecar", 3]},
         RankEnd(2, "node3", "decode", None, healthy=BOTH)),
        ({"rank": 2, "host": "node3", "healthy": "engine"}, RankEnd(2, "node3", "", None)),
        ({"rank": 2, "host": "node3", "failed_rc": 76, "failed_component": "router",
          "failed_rank": 2, "local_rc": None},
         RankEnd(2, "node3", "", 76, "router", 2)),  # the coordinator's own failure
        ({"rank": 1, "host": "n", "role": 5, "local_rc": True}, RankEnd(1, "node2", "", None)),
        ({"rank": 0}, RankEnd(0, "node1", "", None)),  # no host: the allocation says
        # the job's word for its host is never taken: the allocation's rank is the node
        ({"rank": 0, "host": "node5", "local_rc": 73}, RankEnd(0, "node1", "", 73)),
        ({"rank": 1, "host": "node[1-9]", "local_rc": 73}, RankEnd(1, "node2", "", 73)),
        ({"rank": 1, "host": "../../etc", "local_rc": 73}, RankEnd(1, "node2", "", 73)),
        ({"rank": "0", "host": "node1"}, None),
        ({"rank": True, "host": "node1"}, None),
        ({"rank": 4, "host": "node1"}, None),  # beyond the allocation
        ({"rank": -1, "host": "node4"}, None),
    ],
)  # fmt: skip
def test_rank_end_from_a_status_file(status: dict[str, object], end: RankEnd | None) -> None:
    assert rank_end(status, ALLOC) == end


def test_without_the_allocation_a_status_file_names_no_node() -> None:
    assert rank_end({"rank": 0, "host": "node5", "local_rc": 73}, ()) is None


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("node1", True),
        ("gpu-a100.rack_2", True),
        ("n" * 128, True),
        ("n" * 129, False),
        ("", False),
        ("node[1-4]", False),
        ("node1,node2", False),
        ("a/b", False),
        ("../x", False),
        ("-x", False),
        ("node 1", False),
        ("node1\n", False),
        ("nödé", False),
        (None, False),
    ],
)
def test_a_node_name_is_one_plain_name(name: object, ok: bool) -> None:
    assert valid_node_name(name) is ok


@pytest.mark.parametrize(
    ("stage", "rank", "cause", "nodes"),
    [
        ("engines-healthy", 2, Cause.INFRASTRUCTURE, ("node3",)),
        ("benchmark c=4", 2, Cause.WORKLOAD, ()),
        ("engines-healthy", 9, Cause.UNKNOWN, ()),  # no rank of the allocation
        ("engines-healthy", -1, Cause.UNKNOWN, ()),
    ],
)
def test_a_hang_names_the_ranks_node_in_the_allocation(
    stage: str, rank: int, cause: Cause, nodes: tuple[str, ...]
) -> None:
    got = hang(stage, rank, ALLOC)
    assert (got.cause, got.nodes, got.observed) == (cause, nodes, ())


def test_a_port_already_in_use_is_the_workloads_not_the_nodes() -> None:
    """A router that could not bind its port (`router exited rc 1 ... cause=unknown`
    before): the agent says RC_PORT_IN_USE, the cause is the workload's, no node blamed."""
    router = RankEnd(2, "node3", D, common.RC_PORT_IN_USE, "envoy", 2, frozenset({"engine"}))
    got = diagnose(
        Outcome.FAILED,
        slurm_state=JobState.FAILED,
        cancel_requested=False,
        allocation=ALLOC,
        ranks=[*OK4[:2], router, OK4[3]],
        unreachable=[],
        benchmark_failed=False,
    )
    assert got is not None and (got.cause, got.nodes) == (Cause.WORKLOAD, ())
    assert got.why == "the envoy of rank 2 on node3 found its port already in use"
