"""The event-loop blocking guard of tests/conftest.py catches a blocking call in async code.

The fast SSH tests (test_remote_fast.py) rely on it: NodeLink and the tailer must never
block the loop they share with every other run's watchers.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.conftest import LOOP_BLOCK_LIMIT_S, blocked_loop_report, slow_callbacks

ROOT = Path(__file__).resolve().parents[2]


def test_a_blocking_sleep_in_a_debug_loop_is_reported() -> None:
    async def blocks() -> None:
        await asyncio.sleep(0)
        time.sleep(1)  # noqa: ASYNC251 - the blocking call the guard must catch
        await asyncio.sleep(0)

    async def waits() -> None:
        await asyncio.sleep(LOOP_BLOCK_LIMIT_S * 2)  # waiting is not blocking

    with slow_callbacks() as found, asyncio.Runner(debug=True) as runner:
        runner.run(waits())
        assert found == []
        runner.run(blocks())
    assert len(found) == 1
    what, took = found[0]
    # a sleeping thread is not waiting for a core: nearly all of the second counts
    assert took >= 0.9 and "blocks()" in what
    report = blocked_loop_report(found)
    assert report.startswith("the event loop was blocked: 1 callback(s)") and "blocks()" in report


def test_an_async_test_that_blocks_the_loop_fails(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(
            """
            import time

            import anyio
            import pytest


            @pytest.mark.asyncio
            async def test_blocks() -> None:
                await anyio.sleep(0)
                time.sleep(1)


            @pytest.mark.asyncio
            async def test_waits() -> None:
                await anyio.sleep(0.5)


            @pytest.mark.asyncio
            @pytest.mark.blocks_event_loop("the stall is what this test is about")
            async def test_blocks_on_purpose() -> None:
                time.sleep(0.5)


            def test_sync_code_may_block() -> None:
                time.sleep(0.5)
            """
        )
    )
    # The project's pytest settings (asyncio debug mode on) and its conftest as a plugin.
    argv = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")]
    argv += ["-p", "tests.conftest", "-p", "no:cacheprovider", "-q", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    # test_blocks itself passes; the guard fails it at teardown, naming the callback.
    assert "4 passed, 1 error" in out, out
    assert "ERROR at teardown of test_blocks _" in out, out
    assert "the event loop was blocked: 1 callback(s)" in out, out
    assert "coro=<test_blocks()" in out, out
