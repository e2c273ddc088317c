"""Session-wide fixtures: the real dev cluster.

The cluster is brought up once per session (or reused when already running) and brought
down at the end only if this session started it. A cluster that cannot come up is an
error, never a skip: in CI a missing component must fail the run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.devcluster import DevCluster, devcluster


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


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory every node sees (the nodes share this machine's filesystem)."""
    with tempfile.TemporaryDirectory(prefix="llmd-test-", dir="/var/tmp") as d:
        path = Path(d)
        path.chmod(0o755)
        yield path
