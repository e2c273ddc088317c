"""The pure core imports no I/O machinery (DESIGN.md section 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PURE_MODULES = [
    "llmd_supervisor.core.slurm_parse",
    "llmd_supervisor.core.marker",
    "llmd_supervisor.core.verdict",
    "llmd_supervisor.core.lifecycle",
    "llmd_supervisor.core.health",
    "llmd_supervisor.core.layout",
    "llmd_supervisor.core.summary",
    "llmd_supervisor.core.campaign_views",
    "llmd_supervisor.core.foreign_spec",
    "llmd_supervisor.core.retry_policy",
    "llmd_supervisor.core.usage",
    "llmd_supervisor.core.cause",
    "llmd_supervisor.core.campaign",
    "llmd_supervisor.core.campaign_admission",
    "llmd_supervisor.core.campaign_script",
    "llmd_supervisor.core.toml_write",
    "llmd_supervisor.core.node_archive",
]
FORBIDDEN = ["anyio", "asyncssh", "sqlite3", "subprocess", "socket", "asyncio", "structlog"]

# The checkout under test, first on the path (-I ignores PYTHONPATH: without it the probe
# would import whichever copy of the package is installed).
ROOT = str(Path(__file__).resolve().parents[2])
PROBE = """
import importlib, json, sys
sys.path.insert(0, sys.argv[2])
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_no_io(module: str) -> None:
    # A fresh interpreter, so modules imported by pytest itself do not count.
    result = subprocess.run(
        [sys.executable, "-I", "-c", PROBE, module, ROOT],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    loaded = set(json.loads(result.stdout))
    assert module in loaded
    assert sorted(loaded.intersection(FORBIDDEN)) == []
