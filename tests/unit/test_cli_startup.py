"""A command starts with only its own module's dependencies (`cli.main`'s lazy parsers):
`campaign status` at 5,000 points was mostly the client's start-up (issue 3.5's 0.5 s).
Checked by what gets imported, never by timing."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from llmd_supervisor.cli import main as cli_main


def _commands(add: object) -> set[str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    assert callable(add)
    add(sub)
    return set(sub.choices)


def test_each_command_is_parsed_by_the_module_the_table_names() -> None:
    full = cli_main.build_parser()
    everything = set(next(a for a in full._actions if a.dest == "command").choices or ())
    by_module = {add: _commands(add) for add in cli_main._ADDERS}
    for command in everything - {"render", "verify"}:
        owner = cli_main._OWNER.get(command, cli_main._add_run_commands)
        assert command in by_module[owner], command
    assert everything == set().union(*by_module.values()) | {"render", "verify"}


def _loaded(*argv: str) -> set[str]:
    code = (
        "import json, sys\n"
        "from llmd_supervisor.cli.main import main\n"
        "try:\n"
        f"    main({list(argv)!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize(
    ("argv", "not_loaded"),
    [
        (
            ("campaign", "status", "x", "--socket", "/nonexistent"),
            {
                "llmd_supervisor.cli.run_commands",
                "llmd_supervisor.cli.report",
                "llmd_supervisor.core.campaign.expand",
                "llmd_supervisor.adapters.outbox.sender",
            },
        ),
        (
            ("list", "--socket", "/nonexistent"),
            {"llmd_supervisor.cli.campaign", "llmd_supervisor.cli.report"},
        ),
    ],
)
def test_a_command_loads_only_its_own_modules(argv: tuple[str, ...], not_loaded: set[str]) -> None:
    assert not (_loaded(*argv) & not_loaded)
