"""Fixtures shared by the cluster tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon
from tests.devcluster import DevCluster


@pytest.fixture
def daemon(cluster: DevCluster, tmp_path: Path) -> Iterator[Daemon]:
    """A daemon with the default test configuration, stopped after the test."""
    d = Daemon(cluster, tmp_path)
    d.start()
    yield d
    d.stop()
