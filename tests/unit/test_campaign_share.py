"""Fair room among users' campaigns (issue 4.1, item 5): the pure sharing decision
(`core.campaign.admission.share_room`) and the per-user GPU cap in `admit`, as tables."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from llmd_supervisor.core.campaign.admission import (
    CampaignLimits,
    JobState,
    UserWork,
    admit,
    share_room,
)


@pytest.mark.parametrize(
    ("users", "room", "per_user", "expected"),
    [
        # one user alone takes what it wants of the room
        ([(1, 6)], 4, None, {1: 4}),
        # two users with plenty of work: the room is split, in turns
        ([(1, 6), (2, 6)], 4, None, {1: 2, 2: 2}),
        # an odd room: the extra turn goes to the lower uid
        ([(1, 6), (2, 6)], 5, None, {1: 3, 2: 2}),
        # one wants little: the other gets the rest
        ([(1, 1), (2, 6)], 4, None, {1: 1, 2: 3}),
        # three users, room 4
        ([(1, 9), (2, 9), (3, 9)], 4, None, {1: 2, 2: 1, 3: 1}),
        # the per-user cap bounds each, and leaves room unused when nobody else wants it
        ([(1, 6)], 4, 3, {1: 3}),
        ([(1, 6), (2, 6)], 8, 3, {1: 3, 2: 3}),
        # no submit limit known: the per-user cap alone (None: no cap)
        ([(1, 6), (2, 6)], None, 2, {1: 2, 2: 2}),
        ([(1, 6)], None, None, {1: None}),
        # the account's room is gone (other runs hold it): nobody gets any
        ([(1, 6), (2, 6)], 0, None, {1: 0, 2: 0}),
    ],
)
def test_share_room(
    users: list[tuple[int, int]],
    room: int | None,
    per_user: int | None,
    expected: dict[int, int | None],
) -> None:
    assert share_room([UserWork(u, w) for u, w in users], room, per_user) == expected


def test_a_user_over_its_share_keeps_its_jobs_and_gets_none_until_the_other_caught_up() -> None:
    # User 1 took 3 of room 4 before user 2 had work; user 2 now wants 6. Shares are 2/2:
    # user 1 (holding 3) may submit nothing, user 2 gets the one free job now and every
    # job user 1 frees until both hold 2.
    share = share_room([UserWork(1, 3 + 6), UserWork(2, 6)], 4, None)
    assert share == {1: 2, 2: 2}
    held = {1: 3, 2: 0}
    assert {u: max(0, (share[u] or 0) - held[u]) for u in held} == {1: 0, 2: 2}


@dataclass(frozen=True)
class Job:
    key: str
    topology: str = "t"
    nodes: int = 1
    gpus: int = 4
    workload: int = 0
    concurrencies: tuple[int, ...] = (1,)


def test_the_per_user_gpu_cap_holds_jobs_back_and_blocks_a_job_it_could_never_hold() -> None:
    jobs = [
        Job("a", workload=1),
        Job("b", workload=2),
        Job("c", workload=3),
        Job("big", "u", gpus=16),
    ]
    states = {"a": JobState.SUCCEEDED}
    got = admit(jobs, states, CampaignLimits(max_jobs=8), gpu_cap=4, per_user_max_gpus=8)
    assert got.submit == ("b",)  # 4 GPUs of room: one 4-GPU job
    assert "limits.per_user_max_gpus = 8" in got.block["big"]
    none = admit(jobs, states, CampaignLimits(max_jobs=8), gpu_cap=0, per_user_max_gpus=8)
    assert none.submit == () and not none.done  # waits for GPUs its other campaigns free
