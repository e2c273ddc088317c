"""The ``[standins]`` table: whether a batch script carries the stand-ins (pure).

The stand-ins (``llmd_supervisor/standins``: engine, benchmark client, router, sidecar and
every ``LLMD_FAKE_*`` fault knob) exist so that tests and the dev cluster can run without
GPUs. A batch script carries them only when its spec says so::

    [standins]
    enabled = true     # default false: the script carries its commands and the agent only

The choice must agree with the rest of the spec, or the spec is refused naming the key:
a command that runs a stand-in (``{node_dir}/engine.py`` ...) or an ``[env]`` knob
``LLMD_FAKE_*`` needs ``enabled = true`` (without it the file would be missing on the
node, or the knob would silently do nothing); ``enabled = true`` with neither would ship
code nothing uses.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Final

from llmd_supervisor.core.spec.fields import check_keys
from llmd_supervisor.errors import SpecError
from llmd_supervisor.node import STANDIN_SCRIPTS

STANDINS_KEYS: Final = ("enabled",)
FAULT_KNOB_PREFIX: Final = "LLMD_FAKE_"
_SCRIPTS: Final = "|".join(re.escape(n) for n in STANDIN_SCRIPTS)
_RUNS_STANDIN: Final = re.compile(rf"\{{node_dir\}}/(?:{_SCRIPTS})\b")


def parse_standins(t: Mapping[str, object]) -> bool:
    """``standins.enabled`` (default false)."""
    check_keys("standins", t, STANDINS_KEYS)
    enabled = t.get("enabled", False)
    if not isinstance(enabled, bool):
        raise SpecError("standins.enabled", enabled, "use true or false (default false)")
    return enabled


def check_standins(
    enabled: bool,
    commands: Iterable[tuple[str, Iterable[str]]],
    env: Iterable[tuple[str, Mapping[str, str]]],
) -> None:
    """Refuse a spec whose ``standins.enabled`` disagrees with its commands (field name,
    argv) and its ``[env]`` tables (table name, variables)."""
    runs = [
        (fld, m.group(0))
        for fld, argv in commands
        for arg in argv
        for m in [_RUNS_STANDIN.search(arg)]
        if m is not None
    ]
    knobs = [
        f"env.{table}.{name}"
        for table, values in env
        for name in values
        if name.startswith(FAULT_KNOB_PREFIX)
    ]
    if enabled and not runs and not knobs:
        raise SpecError(
            "standins.enabled",
            True,
            "no command runs a stand-in ({node_dir}/"
            + ", {node_dir}/".join(STANDIN_SCRIPTS)
            + f") and no [env] table sets an {FAULT_KNOB_PREFIX}* knob; remove the"
            " [standins] table so that the batch script carries the agent and your"
            " commands only",
        )
    if not enabled and runs:
        fld, script = runs[0]
        raise SpecError(
            fld,
            script,
            f"{script} is a stand-in for tests and the dev cluster, and a batch script"
            " carries the stand-ins only when the spec says [standins] enabled = true;"
            " add that table, or run the real program (deploy/llm-d/example-vllm-*.toml)",
        )
    if not enabled and knobs:
        raise SpecError(
            knobs[0],
            FAULT_KNOB_PREFIX + "*",
            f"{FAULT_KNOB_PREFIX}* knobs drive the stand-ins and the agent's fault hooks,"
            " which a batch script carries only when the spec says [standins]"
            " enabled = true; add that table, or remove the knob",
        )
