"""Session-wide fixtures: the real dev cluster, and the guard against blocking the event loop.

Which pass a test runs in (tests/run.sh), and the rule for `slurm_contract`:

- A test that uses the ``cluster`` fixture (directly or through another fixture, such as
  ``daemon``) is a cluster test: it is marked ``cluster`` here, by its fixtures, never by
  hand (a hand-written ``cluster`` mark on a test that does not use the fixture is a
  collection error). Every other test runs in the first pass, without the cluster, with
  ``pytest -n 2``; so a test that needs no cluster cannot end up waiting for one.
- A cluster test runs once, on Slurm 24.11 (the newest version of the run), unless its
  outcome depends on what Slurm itself says or does: sacct/scontrol/squeue output and
  states, requeue, NODE_FAIL, TIMEOUT, scancel and signal delivery, accounting down or
  disabled, ``--exclude``, QOS and limits, StdOut/StdErr of jobs the daemon did not
  write. Those are marked ``@pytest.mark.slurm_contract`` and run on every version of
  the run (22.05 and 24.11). Ask: "would this test fail if Slurm changed what it prints
  or does?" If yes, mark it; if it would only fail because our code changed, do not.
  ``slurm_contract`` on a test that does not use the cluster is a collection error.
- With ``LLMD_TEST_NO_SKIP=1`` (tests/run.sh, CI) a skipped test fails: a component that
  is missing in CI is an error, never a skip.

The cluster is brought up once per session (or reused when already running) and brought
down at the end only if this session started it. A cluster that cannot come up is an
error, never a skip.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from pytest_asyncio import is_async_test

from tests.daemon_helpers import Daemon, stop_started
from tests.devcluster import SLURM_VERSIONS, DevCluster, devcluster, with_slurm_bin

# The `stranger` and `root_dir` fixtures (another local user); `world` (a replayed Slurm
# cluster and node that daemon processes use, tests/fakes/replay_world.py); `postgres`, `pg`
# and `journal_target` (a real PostgreSQL server for the journal's tests, tests/postgres.py).
pytest_plugins = ["tests.strangers", "tests.fakes.replay_world", "tests.postgres"]

# An async test fails when one callback (one step of a task) held the event loop this long.
# Well above what a 2-core machine shared with other test runs adds to a callback that
# does not block (scheduling, a garbage collection: tens of milliseconds), and well below
# what a blocking call takes (a `time.sleep`, a synchronous subprocess or SSH round trip).
# Under pytest-xdist (`-n 2`: two test processes, their daemons and children on 2 cores) a
# callback that does not block can wait longer for a core: 0.6 s there, still well below
# the 1 s blocking calls tests/unit/test_remote_loop_guard.py makes the guard catch.
LOOP_BLOCK_LIMIT_S = 0.6 if os.environ.get("PYTEST_XDIST_WORKER") else 0.3
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slurm-version",
        choices=SLURM_VERSIONS,
        default=None,
        help="Slurm version of the dev cluster the cluster tests run on (default: "
        "$LLMD_TEST_SLURM, else 22.05); tests/run.sh runs them on each",
    )


def slurm_version(config: pytest.Config) -> str:
    """The Slurm version this session's cluster tests run on."""
    chosen = config.getoption("--slurm-version")
    if chosen:
        return str(chosen)
    return os.environ.get("LLMD_TEST_SLURM") or "22.05"


def pytest_report_header(config: pytest.Config) -> str:
    return f"dev cluster: Slurm {slurm_version(config)} (--slurm-version / LLMD_TEST_SLURM)"


def pytest_configure(config: pytest.Config) -> None:
    version = slurm_version(config)
    if version not in SLURM_VERSIONS:
        raise pytest.UsageError(
            f"LLMD_TEST_SLURM={version!r} is not a Slurm version the dev cluster runs; "
            f"use one of {', '.join(SLURM_VERSIONS)}"
        )
    # Every `devcluster up` of the session (the fixture's, a test's restart) takes it.
    os.environ["DEVCLUSTER_SLURM"] = version
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse marks that would put a test in the wrong pass (see the module docstring)."""
    wrong = []
    for item in items:
        uses_cluster = "cluster" in getattr(item, "fixturenames", ())
        if uses_cluster:
            continue
        for mark in ("cluster", "slurm_contract"):
            if item.get_closest_marker(mark) is not None:
                wrong.append(f"{item.nodeid}: marked {mark} but it does not use the cluster")
    if wrong:
        raise pytest.UsageError(
            "tests/conftest.py: a test's pass comes from its fixtures; remove the mark or "
            "use the `cluster` fixture:\n  " + "\n  ".join(wrong)
        )
    items.sort(key=_cluster_pass_position)


def _cluster_pass_position(item: pytest.Item) -> int:
    """Where a test runs in its pass (a stable sort: collection order otherwise).

    Slurm ends a job by TIMEOUT no sooner than a minute after it starts (its smallest time
    limit, then up to 30 s more for slurmctld's periodic check). test_verify_live submits
    that job with its other jobs, first in the pass, and checks it after the other
    tests/cluster tests, so that minute overlaps them instead of being waited for. The
    tests that bring the cluster down and up (the job would be lost) and the campaign
    tests, whose jobs take whole nodes (``--exclusive``) and would wait for the CPU that
    job holds, come after its check; the fault tests, which kill and cut nodes (the job
    would end NODE_FAIL), after all of them.
    """
    path = item.nodeid.split("::")[0]
    if path == "tests/cluster/test_verify_live.py":
        return 2 if "-timeout]" in item.nodeid else 0
    if path in AFTER_THE_TIMEOUT:
        return 3
    if path.startswith("tests/faults/"):
        return 4
    return 1


AFTER_THE_TIMEOUT = (
    "tests/cluster/test_campaign.py",  # --exclusive jobs
    "tests/cluster/test_smoke.py",  # devcluster down, up
    "tests/cluster/test_verify_no_accounting.py",  # devcluster down, up --no-accounting
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """With LLMD_TEST_NO_SKIP=1, a skipped test is a failure (CI has every component)."""
    report = yield
    if (
        os.environ.get("LLMD_TEST_NO_SKIP") == "1"
        and report.skipped
        and not hasattr(report, "wasxfail")
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid}: skipped ({report.longrepr!r}), and LLMD_TEST_NO_SKIP=1: in CI "
            "every component is installed (deploy/install-dev.sh), so a skip is a failure"
        )
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Append this pass's counts to $LLMD_TEST_COUNTS (tests/run.sh prints them)."""
    path = os.environ.get("LLMD_TEST_COUNTS")
    if not path or hasattr(terminalreporter.config, "workerinput"):
        return
    stats = terminalreporter.stats
    counts = {k: len(stats.get(k, [])) for k in ("passed", "failed", "error", "skipped")}
    with open(path, "a") as f:
        f.write(" ".join(f"{k}={v}" for k, v in counts.items()) + "\n")


def _parametrized_names(metafunc: pytest.Metafunc) -> set[str]:
    names: set[str] = set()
    for mark in metafunc.definition.iter_markers(name="parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(argnames, str):
            argnames = argnames.split(",")
        names.update(str(n).strip() for n in argnames)
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # The version goes into the id of every test that uses the cluster: `test_x[slurm-24.11]`
    # (not a test whose own parameter is called `cluster`).
    if "cluster" in metafunc.fixturenames and "cluster" not in _parametrized_names(metafunc):
        version = slurm_version(metafunc.config)
        # A test that uses the cluster is a cluster test, marked or not: tests/run.sh runs
        # `-m cluster` on each Slurm version.
        param = pytest.param(version, id=f"slurm-{version}", marks=pytest.mark.cluster)
        metafunc.parametrize("cluster", [param], indirect=True, scope="session")


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[DevCluster]:
    """The running dev cluster (accounting on) of the session's Slurm version; started
    here if it is not up. Its version is in every cluster test's id (``[slurm-24.11]``)."""
    version = str(request.param)
    if os.geteuid() != 0:
        pytest.fail("cluster tests need root: the dev cluster creates network namespaces")
    status = devcluster("status", "--quiet", check=False)
    started = status.returncode != 0
    if started:
        if status.returncode == 1:  # partly up: a previous run crashed
            devcluster("down")
        devcluster("up", "--slurm", version)
    handle = DevCluster.current()
    if handle.slurm_version != version:
        pytest.fail(
            f"the running dev cluster is Slurm {handle.slurm_version}, this session tests "
            f"Slurm {version}; run `devcluster down` first (or choose --slurm-version "
            f"{handle.slurm_version})"
        )
    if not handle.accounting:
        pytest.fail("the running dev cluster has --no-accounting; run `devcluster down` first")
    # The daemon and the tests run the cluster's clients by name: its own first on PATH
    # (and named, for a test that builds a PATH of its own: tests.devcluster.with_slurm_bin).
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = with_slurm_bin(path, handle.slurm_bin)
    os.environ["DEVCLUSTER_SLURM_BIN"] = handle.slurm_bin
    yield handle
    os.environ["PATH"] = path
    if started:
        devcluster("down")


@pytest.fixture
def daemon(cluster: DevCluster, tmp_path: Path) -> Iterator[Daemon]:
    """A daemon with the default test configuration, stopped after the test."""
    d = Daemon(cluster, tmp_path)
    d.start()
    yield d
    d.stop()


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


class _RunQueueWait:
    """How long one thread waited for a core: Linux's run delay, sampled every 20 ms.

    /proc/thread-self/schedstat's second field is the nanoseconds the thread spent runnable
    but not running (waiting on a run queue). A callback that does not block can still take
    long in wall time when the machine is loaded (two test processes, their daemons and
    the cluster passes on 2 cores): that wait is not the callback's doing, so the guard
    subtracts it. Time the thread spent running or blocked (a `time.sleep`, a synchronous
    read) is not run delay and still counts.
    """

    def __init__(self) -> None:
        self._path = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")
        self._samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="run-queue-wait", daemon=True)
        self._thread.start()

    def _read(self) -> int:
        try:
            return int(self._path.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    def _sample(self) -> None:
        while True:
            self._samples.append((time.monotonic(), self._read()))
            if self._stop.wait(0.02):
                return

    def waited_since(self, start: float) -> float:
        """Seconds the thread waited for a core from about `start` (monotonic) to now."""
        before = next((d for t, d in reversed(self._samples) if t <= start), None)
        if before is None:
            return 0.0
        return max(0, self._read() - before) / 1e9

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class _SlowCallbacks(logging.Handler):
    """Collects the callbacks asyncio's debug mode reports as slow, from `limit` seconds on.

    A callback's time counts without the time its thread waited for a core (`_RunQueueWait`).
    The handler runs in the loop's thread right after the callback, which is the thread
    the context manager was entered in (pytest-asyncio runs the loop in the test's thread).
    """

    def __init__(self, limit: float, wait: _RunQueueWait) -> None:
        super().__init__(logging.WARNING)
        self.limit = limit
        self.wait = wait
        self.found: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if record.msg == _SLOW_CALLBACK_MSG and isinstance(args, tuple) and len(args) == 2:
            what, took = args
            if not isinstance(took, float) or took < self.limit:
                return
            waited = self.wait.waited_since(time.monotonic() - took)
            if took - waited >= self.limit:
                self.found.append(
                    (
                        f"{what} (wall {took:.3f} s, {waited:.3f} s of it waiting for a core)",
                        took - waited,
                    )
                )


@contextlib.contextmanager
def slow_callbacks(limit: float = LOOP_BLOCK_LIMIT_S) -> Iterator[list[tuple[str, float]]]:
    """Yield the list of (callback, seconds) that debug-mode loops report as slower than `limit`.

    Only loops in debug mode report (`loop.set_debug(True)`; pytest-asyncio's loops with
    ``asyncio_debug = true``), and only callbacks slower than their
    `slow_callback_duration` (0.1 s by default), which must not exceed `limit`. The
    seconds are the callback's own: wall time less the time its thread waited for a core.
    """
    logger = logging.getLogger("asyncio")
    wait = _RunQueueWait()
    handler = _SlowCallbacks(limit, wait)
    level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield handler.found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        wait.close()


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
    teardown, listing the callbacks) when one ran for LOOP_BLOCK_LIMIT_S (0.3 s; 0.6 s
    under -n 2) or more: high enough not to flake on a busy 2-core machine, low enough to
    catch any real blocking call. It watches from before the test's loop starts until
    after it closed, so async fixtures' setup and teardown count too. Sync tests are not
    watched, nor tests marked ``@pytest.mark.blocks_event_loop(reason)`` (the blocked
    loop is what they test).
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
