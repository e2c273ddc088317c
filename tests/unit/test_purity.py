"""The pure core imports no I/O machinery (DESIGN.md section 2)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PURE_MODULES = [
    "llmd_supervisor.core.slurm.parse",
    "llmd_supervisor.core.verdict.marker",
    "llmd_supervisor.core.verdict.decide",
    "llmd_supervisor.core.run.lifecycle",
    "llmd_supervisor.core.run.health",
    "llmd_supervisor.core.run.layout",
    "llmd_supervisor.core.protocol.runs",
    "llmd_supervisor.core.results.declared",
    "llmd_supervisor.core.campaign.views",
    "llmd_supervisor.core.spec.foreign",
    "llmd_supervisor.core.run.retry_policy",
    "llmd_supervisor.core.verdict.usage",
    "llmd_supervisor.core.verdict.cause",
    "llmd_supervisor.core.campaign.expand",
    "llmd_supervisor.core.campaign.admission",
    "llmd_supervisor.core.campaign.script",
    "llmd_supervisor.core.spec.toml_write",
    "llmd_supervisor.core.render.node_archive",
    "llmd_supervisor.core.events.model",
    "llmd_supervisor.core.events.webhooks",
    "llmd_supervisor.core.events.delivery",
    "llmd_supervisor.core.events.formats",
    "llmd_supervisor.core.events.routing",
    "llmd_supervisor.core.events.outbox",
    "llmd_supervisor.core.events.facts",
    "llmd_supervisor.core.ha.lease",
    "llmd_supervisor.core.ha.fencing",
    "llmd_supervisor.core.journal.url",
    "llmd_supervisor.core.journal.schema_versions",
    "llmd_supervisor.core.web.pages",
    "llmd_supervisor.core.results.report_html",
    "llmd_supervisor.core.results.values",
]
FORBIDDEN = ["anyio", "asyncssh", "sqlite3", "subprocess", "socket", "asyncio", "structlog"]
# A standard-library module a pure module needs may load one of FORBIDDEN without using
# it; each such allowance names the module, what it loads and why. A pure module itself
# never imports a forbidden one (test_pure_module_source_imports_no_io).
ALLOWED_LOADS: dict[str, frozenset[str]] = {
    # The mail is an email.message.EmailMessage; email.utils (which it imports) imports
    # socket at module level for make_msgid's host name. Nothing here calls make_msgid:
    # the Message-ID comes from the event id and a domain passed in.
    "llmd_supervisor.core.events.formats": frozenset({"socket"}),
    # Makes a Slack destination's message with core.events.formats (as above).
    "llmd_supervisor.core.events.outbox": frozenset({"socket"}),
}

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
    allowed = ALLOWED_LOADS.get(module, frozenset())
    assert sorted(loaded.intersection(FORBIDDEN) - allowed) == []


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_source_imports_no_io(module: str) -> None:
    """The module's own imports (anywhere in it) name no forbidden module, whatever the
    allowances let the standard library load."""
    path = Path(ROOT, *module.split(".")).with_suffix(".py")
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    assert sorted({n for n in names if n.split(".")[0] in FORBIDDEN}) == []
