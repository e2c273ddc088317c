"""The stand-in knob a hostile-job test uses (`LLMD_FAKE_STATUS_HOSTS`, read by the
stand-ins' fault hooks): a rank's status file claims another host; without it, and
without the stand-ins' hooks at all (production), the rank's own host from the
allocation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmd_supervisor.core.render.agent_config import agent_config
from llmd_supervisor.core.spec.runspec import load_spec
from llmd_supervisor.node.agent.hooks import NoFaults
from llmd_supervisor.node.agent.run import Agent
from llmd_supervisor.node.common import status_name
from llmd_supervisor.standins.faults import agent_faults
from tests.daemon_helpers import demo_spec

HOSTS = ["node1", "node2", "node3", "node4"]


@pytest.mark.parametrize(
    ("claims", "rank", "host"),
    [(None, 1, "node2"), ("node5,node6", 0, "node5"), ("node5,node6", 1, "node6"),
     ("node5,node6", 2, "node3"), ("node5,,node7", 1, "node2")],
)  # fmt: skip
def test_a_status_file_claims_the_knobs_host_or_its_own(
    tmp_path: Path, claims: str | None, rank: int, host: str
) -> None:
    knobs = {} if claims is None else {"LLMD_FAKE_STATUS_HOSTS": claims}
    spec = load_spec(demo_spec(tmp_path, common=knobs))
    cfg = json.loads(json.dumps(agent_config(spec)))
    agent = Agent(cfg, rank, "4242", HOSTS, agent_faults(cfg["env"]["common"], rank))
    assert agent.claimed_host() == host
    assert Agent(cfg, rank, "4242", HOSTS, NoFaults()).claimed_host() == HOSTS[rank]
    (tmp_path / "4242").mkdir()  # the agent makes its job directory at start
    agent.write_status()
    written = json.loads((tmp_path / "4242" / status_name(rank)).read_text())
    assert written["host"] == host
