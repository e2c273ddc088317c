"""What `status`, `list` and `wait` show of what a job wrote: escaped and bounded (issue
3.2 item 6), against the control API's fake supervisor (tests/unit/test_control_api.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmd_supervisor.core.config import Config
from llmd_supervisor.core.protocol.runs import RunSummary, read
from llmd_supervisor.supervision.control.api import ControlApi
from tests.unit.test_control_api import ME, T0, Supervisor, copies, no_stream, request

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def sup(tmp_path: Path) -> Supervisor:
    return Supervisor(Config(state_dir=tmp_path, archive_dir=tmp_path / "archive"))


async def _last_line(sup: Supervisor) -> str:
    api = ControlApi(sup, clock=lambda: T0)
    summary = read(RunSummary, await api.handle(request("status", run="r1"), ME, no_stream))
    return summary["last_log_line"]


@pytest.mark.asyncio
async def test_a_hostile_last_log_line_is_shown_escaped_and_bounded(sup: Supervisor) -> None:
    sup.add("r1")
    log = copies(sup, "r1") / "llmd-r1-42.out"
    log.write_bytes(b"one\n\x1b[2K\x1b[1Goutcome succeeded \x1b]52;c;eA==\x07 \xed\xa0\x80\r\n")
    assert await _last_line(sup) == (
        "\\x1b[2K\\x1b[1Goutcome succeeded \\x1b]52;c;eA==\\x07 \ufffd\ufffd\ufffd"
    )
    log.write_bytes(b"\x07" * 4000 + b"\n")
    line = await _last_line(sup)
    assert line.isprintable() and len(line) <= 200 and line.endswith("...")
