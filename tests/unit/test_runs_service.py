"""`RunsService` (supervision.control.service), the one typed way to runs: `watch` follows a
run's changes until it is final, for whoever may see it; the dashboard and the campaigns
reach runs only through it; the control socket decodes each op into its one request type
(issue 4.2 item 5)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import anyio
import pytest

from llmd_supervisor.adapters.control.protocol import OPS, Request
from llmd_supervisor.adapters.control.requests import StatusRequest, WatchRequest, decode_args
from llmd_supervisor.core.config import Config
from llmd_supervisor.core.run.lifecycle import RunState
from llmd_supervisor.errors import ControlError
from llmd_supervisor.supervision.control.api import HANDLERS
from llmd_supervisor.supervision.control.service import SYSTEM_PEER, RunFacts, RunsService
from tests.unit.test_control_api import ME, OTHER, T0, Supervisor

pytestmark = pytest.mark.timeout(30)

PACKAGE = Path(__file__).resolve().parents[2] / "llmd_supervisor"


@pytest.fixture
def sup(tmp_path: Path) -> Supervisor:
    return Supervisor(Config(state_dir=tmp_path, archive_dir=tmp_path / "archive"))


@pytest.mark.asyncio
async def test_watch_yields_a_runs_facts_on_every_change_until_it_is_final(
    sup: Supervisor,
) -> None:
    handle = sup.add("r1")
    runs = RunsService(sup, clock=lambda: T0)
    seen: list[RunFacts] = []
    got_first = anyio.Event()

    async def follow() -> None:
        async with contextlib.aclosing(runs.watch(ME, WatchRequest("r1"))) as changes:
            async for facts in changes:
                seen.append(facts)
                got_first.set()

    with anyio.fail_after(5):  # only the change signal drives it: no refresh interval
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            await got_first.wait()
            handle.update(reason="heartbeat lost on node-1")
            handle.update(state=RunState.SUCCEEDED, reason="every point valid")
    assert seen[0].state is RunState.RUNNING
    assert seen[-1].state is RunState.SUCCEEDED and seen[-1].reason == "every point valid"
    assert seen[-1].owner_uid == ME.uid and seen[-1].archive_dir == sup.config.archive_root / "r1"


@pytest.mark.asyncio
async def test_a_run_another_user_may_not_see_is_not_found_to_watch_and_status(
    sup: Supervisor,
) -> None:
    sup.add("r1", owner=ME.uid)
    runs = RunsService(sup, clock=lambda: T0)
    with pytest.raises(ControlError) as hidden:
        await anext(runs.watch(OTHER, WatchRequest("r1")))
    assert hidden.value.code == "not_found"
    with pytest.raises(ControlError) as hidden:
        await runs.status(OTHER, StatusRequest("r1"))
    assert hidden.value.code == "not_found"
    assert runs.facts(OTHER, "r1") is None
    # The daemon itself (campaigns) sees every run.
    assert (await runs.status(SYSTEM_PEER, StatusRequest("r1")))["owner_uid"] == ME.uid
    facts = runs.facts(SYSTEM_PEER, "r1")
    assert facts is not None and facts.state is RunState.RUNNING


def _source(*parts: str) -> str:
    return "\n".join(p.read_text() for p in sorted(PACKAGE.joinpath(*parts).glob("*.py")))


def test_the_dashboard_casts_no_answer() -> None:
    # It calls the typed services: nothing to turn into JSON and back, nothing to cast.
    text = (PACKAGE / "supervision" / "web" / "dashboard.py").read_text()
    assert "cast(" not in text
    assert "decode_request" not in text and ".handle(" not in text


def test_campaigns_reach_runs_only_through_the_service() -> None:
    text = _source("supervision", "campaign")
    reaches = re.findall(r"\.handles\b|\.history\b|sup\.tg\b|RunHandle\b", text)
    assert reaches == []


def test_every_op_decodes_into_the_request_type_its_handler_takes() -> None:
    filler: dict[str, object] = {"str": "x", "bool": False, "int": 1, "null": None}
    for op, spec in OPS.items():
        args = {
            name: arg.default if not arg.required else filler[min(arg.kinds)]
            for name, arg in spec.args.items()
        }
        decoded = decode_args(Request(id=1, op=op, args=args))
        expected = HANDLERS[op].request
        assert expected is not None and type(decoded) is expected, op
