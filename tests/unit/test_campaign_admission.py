"""Which campaign jobs to submit next (core.campaign.admission.admit, topology_key)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmd_supervisor.core.campaign.admission import (
    Admission,
    CampaignLimits,
    JobState,
    admit,
    topology_key,
)
from llmd_supervisor.core.campaign.expand import expand, parse_campaign
from llmd_supervisor.core.spec.runspec import parse_spec
from llmd_supervisor.core.spec.toml_read import decode_toml

W = JobState.WAITING
S = JobState.SUBMITTED
R = JobState.RUNNING
OK = JobState.SUCCEEDED
FW = JobState.FAILED_WORKLOAD
FI = JobState.FAILED_INFRA
FO = JobState.FAILED_OTHER
B = JobState.BLOCKED
C = JobState.CANCELLED
RE = JobState.REUSED

DEMO = decode_toml((Path(__file__).resolve().parents[2] / "deploy/llm-d/demo.toml").read_text())


@dataclass(frozen=True)
class Job:
    """The fields admission reads, as core.campaign.expand.CampaignJob carries them."""

    key: str
    topology: str
    workload: int = 1040  # isl 1024 + osl 16
    nodes: int = 4
    gpus: int = 32
    concurrencies: tuple[int, ...] = (1, 4, 16)


# Two topologies of three jobs each, listed out of canary order on purpose:
# a1 (workload 1040) is a's canary, b1 (the smallest max concurrency at 2048) b's.
A = "2P+2D/2x1w/8gpn"
BT = "4P+2D/2x1w/8gpn"
JOBS = (
    Job("a2", A, workload=2048),
    Job("a1", A),
    Job("a3", A, workload=9216),
    Job("b2", BT, workload=2048, nodes=6, gpus=48, concurrencies=(1, 64)),
    Job("b1", BT, workload=2048, nodes=6, gpus=48, concurrencies=(1, 4)),
    Job("b3", BT, workload=9216, nodes=6, gpus=48),
)


DEFAULT = CampaignLimits()


def _admit(
    states: Mapping[str, JobState],
    limits: CampaignLimits = DEFAULT,
    *,
    jobs: tuple[Job, ...] = JOBS,
    qos_cap: int | None = None,
    backoff_until: float | None = None,
    now: float = 0.0,
    failures: Mapping[str, str] | None = None,
) -> Admission:
    return admit(
        jobs,
        states,
        limits,
        qos_cap=qos_cap,
        backoff_until=backoff_until,
        now=now,
        failures=failures,
    )


@pytest.mark.parametrize(
    ("states", "limits", "submit"),
    [
        # Every topology's canary first, nothing else while they run.
        ({}, CampaignLimits(), ("a1", "b1")),
        ({"a1": R, "b1": S}, CampaignLimits(), ()),
        # max_jobs: the first topology's canary only.
        ({}, CampaignLimits(max_jobs=1), ("a1",)),
        # The canary succeeded: the rest of its topology, in canary order.
        # ... b has started fewer jobs, so its canary takes the first turn; a REUSED
        # canary never ran, so a has started none and goes first.
        ({"a1": OK}, CampaignLimits(), ("b1", "a2", "a3")),
        ({"a1": RE}, CampaignLimits(), ("a2", "b1", "a3")),
        ({"a1": OK, "b1": OK}, CampaignLimits(), ("a2", "b2", "a3", "b3")),
        # max_jobs counts SUBMITTED and RUNNING.
        ({"a1": OK, "b1": OK, "a2": R, "b2": S}, CampaignLimits(max_jobs=3), ("a3",)),
        # max_pending counts SUBMITTED only.
        ({"a1": OK, "b1": OK, "a2": S}, CampaignLimits(max_pending=2), ("b2",)),
        ({"a1": OK, "b1": OK, "a2": R}, CampaignLimits(max_pending=2), ("b2", "a3")),
        ({"a1": OK, "b1": OK, "a2": S, "b2": S}, CampaignLimits(max_pending=2), ()),
        # max_nodes (a: 4 per job, b: 6): a2 and b2 hold 10 of 12; a3 waits, b3 too.
        ({"a1": OK, "b1": OK}, CampaignLimits(max_nodes=12), ("a2", "b2")),
        # b3 runs (6 nodes); a has started fewer, so a2 goes first (10 nodes), then
        # neither a3 (4) nor b2 (6) fits the 2 left.
        ({"a1": OK, "b1": OK, "b3": R}, CampaignLimits(max_nodes=12), ("a2",)),
        ({"a1": OK, "b1": OK, "a2": R, "a3": R}, CampaignLimits(max_nodes=12), ()),
        # max_gpus (a: 32 per job, b: 48).
        ({"a1": OK, "b1": OK}, CampaignLimits(max_gpus=100), ("a2", "b2")),
        ({"a1": OK, "b1": OK, "b2": R}, CampaignLimits(max_gpus=100), ("a2",)),
    ],
)
def test_caps_and_canaries(
    states: Mapping[str, JobState], limits: CampaignLimits, submit: tuple[str, ...]
) -> None:
    got = _admit(states, limits)
    assert got.submit == submit
    assert got.stop is None


def test_the_lower_of_max_jobs_and_the_qos_cap_counts() -> None:
    states = {"a1": OK, "b1": OK, "a2": R}
    assert _admit(states, CampaignLimits(max_jobs=4), qos_cap=2).submit == ("b2",)
    assert _admit(states, CampaignLimits(max_jobs=4), qos_cap=1).submit == ()
    assert _admit(states, CampaignLimits(max_jobs=4), qos_cap=0).submit == ()
    assert _admit(states, CampaignLimits(max_jobs=2), qos_cap=10).submit == ("b2",)
    assert _admit(states, CampaignLimits(max_jobs=4), qos_cap=None).submit == ("b2", "a3", "b3")


def test_nothing_is_submitted_before_the_backoff_ends() -> None:
    assert _admit({}, backoff_until=1000.0, now=999.5).submit == ()
    assert _admit({}, backoff_until=1000.0, now=999.5).done is False
    assert _admit({}, backoff_until=1000.0, now=1000.0).submit == ("a1", "b1")
    assert _admit({}, backoff_until=None, now=5.0).submit == ("a1", "b1")


def test_a_canary_workload_failure_blocks_its_topology_naming_the_canary() -> None:
    got = _admit(
        {"a1": FW, "b1": R},
        failures={"a1": "the benchmark exited with status 7 at concurrency 4"},
    )
    assert got.submit == ()
    assert got.block == {
        "a2": f"canary a1 of topology {A} failed: the benchmark exited with status 7 at"
        " concurrency 4",
        "a3": f"canary a1 of topology {A} failed: the benchmark exited with status 7 at"
        " concurrency 4",
    }
    assert got.stop is None  # one canary of two finished: too early to stop
    assert got.done is False
    # Without a recorded reason the cause is named.
    assert _admit({"a1": FW, "b1": R}).block["a2"] == (
        f"canary a1 of topology {A} failed: cause workload"
    )
    # Blocked jobs stay out of the way of the other topology.
    after = _admit({"a1": FW, "a2": B, "a3": B, "b1": OK})
    assert after.submit == ("b2", "b3")
    assert after.block == {}


@pytest.mark.parametrize("failure", [FI, FO, C])
def test_an_infra_failure_makes_the_next_job_the_canary(failure: JobState) -> None:
    got = _admit({"a1": failure, "b1": R})
    assert got.submit == ("a2",)
    assert got.block == {}
    # Until the new canary succeeds, a3 waits.
    assert _admit({"a1": failure, "a2": R, "b1": R}).submit == ()
    assert _admit({"a1": failure, "a2": OK, "b1": R}).submit == ("a3",)
    # The new canary's workload failure blocks the rest, naming it.
    blocked = _admit({"a1": failure, "a2": FW, "b1": R}).block
    assert blocked == {"a3": f"canary a2 of topology {A} failed: cause workload"}


THREE = (
    Job("a1", "1P+1D/1x1w/8gpn", nodes=2, gpus=16),
    Job("a2", "1P+1D/1x1w/8gpn", nodes=2, gpus=16, workload=2048),
    Job("b1", "2P+2D/1x1w/8gpn"),
    Job("b2", "2P+2D/1x1w/8gpn", workload=2048),
    Job("c1", "4P+4D/1x1w/8gpn", nodes=8, gpus=64),
    Job("c2", "4P+4D/1x1w/8gpn", nodes=8, gpus=64, workload=2048),
)


@pytest.mark.parametrize(
    ("states", "fraction", "stopped"),
    [
        ({"a1": FW, "b1": R, "c1": R}, 0.5, False),  # 1 finished of 3: too early
        ({"a1": FW, "b1": OK, "c1": R}, 0.5, False),  # 1 of 2 failed: not more than half
        ({"a1": FW, "b1": FW, "c1": R}, 0.5, True),  # 2 of 2 failed
        ({"a1": FW, "b1": OK, "c1": FW}, 0.5, True),  # 2 of 3
        ({"a1": FW, "b1": OK, "c1": OK}, 0.5, False),  # 1 of 3
        ({"a1": FW, "b1": OK, "c1": R}, 0.0, True),  # fraction 0: any failure, once 2 finished
        ({"a1": FW, "b1": FW, "c1": FW}, 1.0, False),  # fraction 1: never
        ({"a1": FI, "b1": FW, "c1": R}, 0.5, False),  # an infra failure is not a finish
    ],
)
def test_the_campaign_stops_when_too_many_canaries_fail(
    states: Mapping[str, JobState], fraction: float, stopped: bool
) -> None:
    got = _admit(states, CampaignLimits(canary_stop_fraction=fraction), jobs=THREE)
    assert (got.stop is not None) == stopped
    if stopped:
        assert got.submit == ()


def test_the_stop_message_names_counts_topologies_and_the_limit() -> None:
    got = _admit({"a1": FW, "b1": FW, "c1": OK}, jobs=THREE)
    assert got.stop == (
        "the canaries of 2 of the 3 topologies whose canary finished failed with cause"
        " workload (1P+1D/1x1w/8gpn, 2P+2D/1x1w/8gpn), more than"
        " limits.canary_stop_fraction = 0.5 of them"
    )
    assert got.submit == ()  # c2 would be eligible, but the campaign stopped
    assert got.done is True  # nothing is pending or running


def test_a_single_topology_whose_canary_failed_is_all_of_them() -> None:
    jobs = THREE[:2]
    got = _admit({"a1": FW}, jobs=jobs)
    assert got.stop is not None
    assert got.block == {"a2": "canary a1 of topology 1P+1D/1x1w/8gpn failed: cause workload"}
    assert got.done is True


def test_topologies_take_turns() -> None:
    # Equal histories: one job per topology per turn, in the order of first appearance.
    states = {"a1": OK, "b1": OK, "c1": OK}
    got = _admit(states, CampaignLimits(max_jobs=6), jobs=THREE)
    assert got.submit == ("a2", "b2", "c2")
    jobs = (*THREE, Job("a3", "1P+1D/1x1w/8gpn", nodes=2, gpus=16, workload=9216))
    assert _admit(states, CampaignLimits(max_jobs=6), jobs=jobs).submit == (
        "a2",
        "b2",
        "c2",
        "a3",
    )
    # One slot freed at a time: the topology that started fewest jobs gets it, not
    # always the first one.
    busy = {"a1": OK, "a2": R, "b1": OK, "c1": OK, "c2": R}
    assert _admit(busy, CampaignLimits(max_jobs=3), jobs=jobs).submit == ("b2",)


def test_a_job_that_fits_no_cap_is_blocked() -> None:
    got = _admit({"a1": OK}, CampaignLimits(max_nodes=5))
    # Every b job needs 6 nodes: blocked for good; a's jobs go on.
    assert got.block == {
        "b2": "it needs 6 nodes, more than limits.max_nodes = 5",
        "b1": "it needs 6 nodes, more than limits.max_nodes = 5",
        "b3": "it needs 6 nodes, more than limits.max_nodes = 5",
    }
    assert got.submit == ("a2",)  # a3 waits for a2's nodes
    gpus = _admit({}, CampaignLimits(max_gpus=40))
    assert gpus.block["b1"] == "it needs 48 GPUs, more than limits.max_gpus = 40"
    assert gpus.submit == ("a1",)


@pytest.mark.parametrize(
    ("states", "done"),
    [
        ({}, False),
        (dict.fromkeys(("a1", "a2", "a3", "b1", "b2", "b3"), OK), True),
        ({"a1": OK, "a2": FI, "a3": RE, "b1": FW, "b2": B, "b3": B}, True),
        # b2 and b3 are WAITING but blocked by this very decision: final.
        ({"a1": OK, "a2": OK, "a3": C, "b1": FW}, True),
        ({"a1": OK, "a2": OK, "a3": R, "b1": FW}, False),
        ({"a1": OK, "a2": OK, "a3": S, "b1": OK, "b2": OK, "b3": OK}, False),
        ({"a1": OK, "a2": OK, "a3": OK, "b1": OK, "b2": OK}, False),  # b3 still to run
    ],
)
def test_done_when_nothing_waits_pends_or_runs(states: Mapping[str, JobState], done: bool) -> None:
    assert _admit(states).done is done


def test_admission_of_a_real_expansion() -> None:
    sweep = """
base = "demo.toml"
[limits]
max_jobs = 3
[matrix]
"topology.prefill_nodes" = [2, 4]
"benchmark.isl_osl" = [[128, 32], [64, 16]]
"benchmark.concurrencies" = [[1, 2, 4]]
"""
    campaign = parse_campaign(sweep, default_name="demo-sweep")
    e = expand(campaign, DEMO)
    by_values = {(j.topology, j.workload): j.key for j in e.jobs}
    canaries = (by_values[("2P+2D/2x1w/8gpn", 80)], by_values[("4P+2D/2x1w/8gpn", 80)])
    got = admit(e.jobs, {}, campaign.limits)
    assert got.submit == canaries
    ok = dict.fromkeys(canaries, OK)
    assert admit(e.jobs, ok, campaign.limits).submit == (
        by_values[("2P+2D/2x1w/8gpn", 160)],
        by_values[("4P+2D/2x1w/8gpn", 160)],
    )


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({}, "2P+2D/2x1w/8gpn"),
        ({"topology": {"gpus_per_node": 4, "nominal_gpus_per_node": 0}}, "2P+2D/2x1w/4gpn"),
        (
            {
                "recipe": {
                    "prefill_tp": 4,
                    "decode_tp": 8,
                    "decode_ep": 8,
                    "decode_dp_attention": True,
                }
            },
            "2P+2D/2x1w/8gpn/P:tp4,D:tp8ep8dpa",
        ),
        ({"recipe": {"decode_pp": 2}}, "2P+2D/2x1w/8gpn/D:pp2"),
        ({"topology": {"decode_nodes": 4, "decode_workers": 2}}, "2P+4D/2x2w/8gpn"),
    ],
)
def test_topology_key(changes: Mapping[str, Mapping[str, object]], key: str) -> None:
    data = copy.deepcopy(DEMO)
    for table, values in changes.items():
        t = data.setdefault(table, {})
        assert isinstance(t, dict)
        t.update(values)
    assert topology_key(parse_spec(data)) == key
