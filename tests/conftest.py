"""Session-wide fixtures: the real dev cluster, and the guard against blocking the event loop.

The cluster is brought up once per session (or reused when already running) and brought
down at the end only if this session started it. A cluster that cannot come up is an
error, never a skip: in CI a missing component must fail the run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytest_asyncio import is_async_test

from tests.daemon_helpers import stop_started
from tests.devcluster import DevCluster, devcluster

# The `stranger` and `root_dir` fixtures (another local user).
pytest_plugins = ["tests.strangers"]

# An async test fails when one callback (one step of a task) held the event loop this long.
# Well above what a 2-core machine shared with other test runs adds to a callback that
# does not block (scheduling, a garbage collection: tens of milliseconds), and well below
# what a blocking call takes (a `time.sleep`, a synchronous subprocess or SSH round trip).
LOOP_BLOCK_LIMIT_S = 0.3
# asyncio's debug-mode report of a slow callback (asyncio/base_events.py).
_SLOW_CALLBACK_MSG = "Executing %s took %.3f seconds"


# The whole session's limit: CI stops at 90 minutes (install included), and a run that hangs
# where pytest-timeout's alarm cannot reach (a finalizer, a C call) must still end with
# every thread's stack printed, not be cut off silently. LLMD_TEST_SESSION_LIMIT_S overrides.
SESSION_LIMIT_S = float(os.environ.get("LLMD_TEST_SESSION_LIMIT_S", 80 * 60))


def _session_watchdog(config: pytest.Config, limit_s: float) -> None:
    time.sleep(limit_s)
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # the stacks go to the real stderr, not a test's captured one
        capture.suspend_global_capture(in_=True)
    sys.stderr.write(f"\ntests: the session passed its {limit_s:.0f} s limit; every thread:\n")
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    # And the processes, for a hang on a child.
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["ps", "-eo", "pid,ppid,stat,etime,args"], stdout=sys.stderr, timeout=10)
    os._exit(3)


def pytest_configure(config: pytest.Config) -> None:
    threading.Thread(
        target=_session_watchdog,
        args=(config, SESSION_LIMIT_S),
        name="session-watchdog",
        daemon=True,
    ).start()
    config.addinivalue_line(
        "markers",
        "blocks_event_loop(reason): the test blocks its event loop on purpose; "
        "the blocking guard of tests/conftest.py leaves it alone",
    )


@pytest.fixture(scope="session")
def cluster() -> Iterator[DevCluster]:
    """The running dev cluster (accounting on); started here if it is not up."""
    if os.geteuid() != 0:
        pytest.fail("cluster tests need root: the dev cluster creates network namespaces")
    status = devcluster("status", "--quiet", check=False)
    started = status.returncode != 0
    if started:
        if status.returncode == 1:  # partly up: a previous run crashed
            devcluster("down")
        devcluster("up")
    handle = DevCluster.current()
    if not handle.accounting:
        pytest.fail("the running dev cluster has --no-accounting; run `devcluster down` first")
    yield handle
    if started:
        devcluster("down")


@pytest.fixture(autouse=True)
def _no_daemon_left() -> Iterator[None]:
    """Stop, after each test, every daemon it started and did not stop (a failing test's)."""
    yield
    stop_started()


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory every node sees (the nodes share this machine's filesystem)."""
    with tempfile.TemporaryDirectory(prefix="llmd-test-", dir="/var/tmp") as d:
        path = Path(d)
        path.chmod(0o755)
        yield path


class _SlowCallbacks(logging.Handler):
    """Collects the callbacks asyncio's debug mode reports as slow, from `limit` seconds on."""

    def __init__(self, limit: float) -> None:
        super().__init__(logging.WARNING)
        self.limit = limit
        self.found: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if record.msg == _SLOW_CALLBACK_MSG and isinstance(args, tuple) and len(args) == 2:
            what, took = args
            if isinstance(took, float) and took >= self.limit:
                self.found.append((str(what), took))


@contextlib.contextmanager
def slow_callbacks(limit: float = LOOP_BLOCK_LIMIT_S) -> Iterator[list[tuple[str, float]]]:
    """Yield the list of (callback, seconds) that debug-mode loops report as slower than `limit`.

    Only loops in debug mode report (`loop.set_debug(True)`; pytest-asyncio's loops with
    ``asyncio_debug = true``), and only callbacks slower than their
    `slow_callback_duration` (0.1 s by default), which must not exceed `limit`.
    """
    logger = logging.getLogger("asyncio")
    handler = _SlowCallbacks(limit)
    level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield handler.found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def blocked_loop_report(found: list[tuple[str, float]]) -> str:
    """The failure message for the slow callbacks `slow_callbacks` found."""
    lines = [f"  {took:.3f} s: {what}" for what, took in found]
    return "\n".join(
        [
            f"the event loop was blocked: {len(found)} callback(s) ran for "
            f"{LOOP_BLOCK_LIMIT_S:g} s or more without awaiting (a blocking call in async "
            "code? run it with anyio.to_thread.run_sync or use the async API)",
            *lines,
        ]
    )


@pytest.fixture(autouse=True)
def _event_loop_never_blocks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail an async test whose code, or whose async fixtures, block the event loop.

    pytest-asyncio runs every async test's loop in asyncio debug mode (``asyncio_debug =
    true`` in pyproject.toml), in which the loop logs each callback that ran longer than
    `loop.slow_callback_duration` (0.1 s). This guard fails the test (as an error at
    teardown, listing the callbacks) when one ran for LOOP_BLOCK_LIMIT_S (0.3 s) or more:
    high enough not to flake on a busy 2-core machine, low enough to catch any real
    blocking call. It watches from before the test's loop starts until after it closed,
    so async fixtures' setup and teardown count too. Sync tests are not watched, nor tests
    marked ``@pytest.mark.blocks_event_loop(reason)`` (the blocked loop is what they test).
    """
    node = request.node
    if not is_async_test(node) or node.get_closest_marker("blocks_event_loop") is not None:
        yield
        return
    if not request.config.getini("asyncio_debug"):
        pytest.fail("asyncio_debug is off: the event-loop blocking guard needs debug mode")
    with slow_callbacks() as found:
        yield
    if found:
        pytest.fail(blocked_loop_report(found), pytrace=False)
