"""Every option an llm-d example passes to a real tool exists in that tool's upstream parser.

The tools: ``vllm serve`` (the engines), ``vllm bench serve`` (the benchmark), ``pd-sidecar``
(the P/D sidecar) and the llm-d EPP (``epp``, a router process). Their option lists were
captured from the upstream sources into ``tests/data/upstream/flags/<tool>.txt``; each file's
header names the repository, the version or commit, the files read and how the list was made.

Every ``deploy/llm-d/*.toml`` is checked, a new one included. The demo's stand-ins
(``engine.py``, ``bench.py``, ``sidecar.py``, run with the container's python) claim the real
tools' options, so what the demo passes them is checked against the same lists. The demo's
``router.py`` stands in for Envoy and the EPP together with options of its own, and Envoy has
no list here: both are recognised and not checked. Any other command fails the test, so that
an example cannot pass by using a command this test does not know.

Alias rules, as the upstream parsers apply them:

- vLLM (``FlexibleArgumentParser.parse_args``): underscores in an option's name become dashes
  (``--kv_transfer_config`` is ``--kv-transfer-config``); ``--OPT.key VALUE`` sets a key of
  the JSON option ``--OPT``; ``--no-X`` exists only for the booleans whose parser registers it,
  and those are in the list itself (as are the ``--enable-X``/``--disable-X`` pairs);
  ``-O<n>`` is rewritten to ``--optimization-level``. argparse's unique-prefix abbreviations
  are accepted by vLLM but not here: an example spells options out in full.
- pflag (pd-sidecar, the EPP): ``--name VALUE`` or ``--name=VALUE``, no underscore spelling,
  no ``--no-X`` (a boolean is bare or ``--name=false``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Final

import pytest

from llmd_supervisor.core.spec.runspec import RunSpec, load_spec

ROOT: Final = Path(__file__).resolve().parents[2]
DEPLOY: Final = ROOT / "deploy" / "llm-d"
FLAGS_DIR: Final = ROOT / "tests" / "data" / "upstream" / "flags"
# The run specs (a campaign file, campaign-*.toml, is a matrix over one of them: its
# points are checked by tests/unit/test_render.py).
EXAMPLES: Final = sorted(p for p in DEPLOY.glob("*.toml") if not p.name.startswith("campaign-"))

VLLM_SERVE: Final = "vllm-serve"
VLLM_BENCH: Final = "vllm-bench-serve"
PD_SIDECAR: Final = "pd-sidecar"
EPP: Final = "epp"
TOOLS: Final = (VLLM_SERVE, VLLM_BENCH, PD_SIDECAR, EPP)
VLLM_TOOLS: Final = frozenset({VLLM_SERVE, VLLM_BENCH})
TOOL_TITLES: Final = {
    VLLM_SERVE: "vllm serve",
    VLLM_BENCH: "vllm bench serve",
    PD_SIDECAR: "pd-sidecar",
    EPP: "epp",
}
# The demo's stand-ins (llmd_supervisor/standins/*.py) and the real tool each stands in for.
STAND_INS: Final = {"engine.py": VLLM_SERVE, "bench.py": VLLM_BENCH, "sidecar.py": PD_SIDECAR}
# Known router processes without a list: Envoy, and the demo's router (Envoy + EPP in one).
UNCHECKED: Final = frozenset({"envoy", "router.py"})
# What each part of a spec must run.
SLOT_TOOLS: Final[dict[str, frozenset[str | None]]] = {
    "engine.prefill_command": frozenset({VLLM_SERVE}),
    "engine.decode_command": frozenset({VLLM_SERVE}),
    "benchmark.command": frozenset({VLLM_BENCH}),
    "sidecar.command": frozenset({PD_SIDECAR}),
    "router.process": frozenset({EPP, None}),  # None: a known process that is not checked
}
PYTHON_RE: Final = re.compile(r"python[0-9.]*")
SHORT_RE: Final = re.compile(r"-[A-Za-z][A-Za-z0-9-]*(=.*)?")


@dataclass(frozen=True)
class Command:
    """One argv of a spec, the tool it runs and the arguments that go to that tool."""

    slot: str  # e.g. "engine.prefill_command", "router.process[epp]"
    tool: str | None  # a TOOLS entry; None: recognised, not checked
    stand_in: str | None  # "engine.py" ... when the demo's stand-in runs instead
    args: tuple[str, ...]

    @property
    def title(self) -> str:
        if self.tool is None:
            return "unchecked"
        name = TOOL_TITLES[self.tool]
        return f"{self.stand_in}, standing in for {name}" if self.stand_in else name


@cache
def upstream_flags(tool: str) -> frozenset[str]:
    """The option strings of tests/data/upstream/flags/<tool>.txt (header lines skipped)."""
    lines = (FLAGS_DIR / f"{tool}.txt").read_text().splitlines()
    return frozenset(s for s in (x.strip() for x in lines) if s and not s.startswith("#"))


def classify(slot: str, argv: tuple[str, ...]) -> Command:
    """Which tool `argv` runs; ValueError for a command this test does not know."""
    base = os.path.basename(argv[0]) if argv else ""
    if base == "vllm" and argv[1:2] == ("serve",):
        return Command(slot, VLLM_SERVE, None, argv[2:])
    if base == "vllm" and argv[1:3] == ("bench", "serve"):
        return Command(slot, VLLM_BENCH, None, argv[3:])
    if base in (PD_SIDECAR, EPP):
        return Command(slot, base, None, argv[1:])
    if base in UNCHECKED:
        return Command(slot, None, None, argv[1:])
    if PYTHON_RE.fullmatch(base) and len(argv) > 1:
        script = os.path.basename(argv[1])
        if script in STAND_INS:
            return Command(slot, STAND_INS[script], script, argv[2:])
        if script in UNCHECKED:
            return Command(slot, None, script, argv[2:])
    raise ValueError(f"{slot}: {list(argv[:3])} is not a command this test knows")


def spec_commands(spec: RunSpec) -> list[tuple[str, tuple[str, ...]]]:
    """(slot, argv) of every command a spec runs."""
    out = [
        ("engine.prefill_command", spec.engine.prefill_command),
        ("engine.decode_command", spec.engine.decode_command),
        ("benchmark.command", spec.benchmark.command),
    ]
    if spec.sidecar is not None:
        out.append(("sidecar.command", spec.sidecar.service.command))
    if spec.router is not None:
        out += [(f"router.process[{p.name}]", p.command) for p in spec.router.processes]
    return out


def option_name(tool: str, token: str) -> str:
    """The option a `--` token names, after the tool's own alias rules."""
    name = token.split("=", 1)[0]
    if tool in VLLM_TOOLS:
        # --kv_transfer_config -> --kv-transfer-config; --kv-transfer-config.kv_role -> the option
        name = name.split(".", 1)[0].replace("_", "-")
    return name


def unknown_options(command: Command) -> list[str]:
    """The option tokens of `command` that its tool's upstream list does not hold."""
    assert command.tool is not None
    known = upstream_flags(command.tool)
    bad: list[str] = []
    for token in command.args:
        if token == "--":  # the end of the options
            break
        if token.startswith("--"):
            if option_name(command.tool, token) not in known:
                bad.append(token)
        elif SHORT_RE.fullmatch(token):
            if command.tool in VLLM_TOOLS and token.startswith("-O"):
                continue  # vLLM rewrites -O<n> to --optimization-level <n>
            if token.split("=", 1)[0] not in known:
                bad.append(token)
    return bad


def example_id(path: Path) -> str:
    return path.name


def test_examples_found() -> None:
    names = [p.name for p in EXAMPLES]
    assert "demo.toml" in names and "example-vllm-pyxis.toml" in names, names


@pytest.mark.parametrize("tool", TOOLS)
def test_upstream_list_is_well_formed(tool: str) -> None:
    text = (FLAGS_DIR / f"{tool}.txt").read_text()
    header = [x for x in text.splitlines() if x.startswith("#")]
    body = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert any(x.startswith("# Repository: ") for x in header), tool
    assert any(x.startswith("# Commit: ") for x in header), tool
    assert any(x.startswith("# Files read: ") for x in header), tool
    assert any(x.startswith("# How: ") for x in header), tool
    assert any("Alias rules" in x for x in header), tool
    assert body == sorted(set(body)), f"{tool}: the list is not sorted and unique"
    assert all(re.fullmatch(r"--?[a-z0-9][a-z0-9.-]*", x) for x in body), tool
    assert text.index(body[0]) > text.index(header[-1]), f"{tool}: header lines after the list"


def test_upstream_lists_hold_what_inferencex_passes() -> None:
    """The options InferenceX's launcher and the examples rely on, read at the captured versions."""
    need = {
        VLLM_SERVE: "--served-model-name --host --port --tensor-parallel-size -tp "
        "--kv-transfer-config --enforce-eager --no-enforce-eager",
        VLLM_BENCH: "--backend --base-url --endpoint --model --dataset-name --random-input-len "
        "--random-output-len --num-prompts --max-concurrency --request-rate --ignore-eos "
        "--percentile-metrics --metric-percentiles --save-result --result-dir "
        "--result-filename",
        PD_SIDECAR: "--port --vllm-port --model-server-port --kv-connector --secure-proxy "
        "--enable-prefiller-sampling --cert-path",
        EPP: "--pool-name --pool-namespace --config-file --grpc-port --grpc-health-port "
        "--metrics-port --secure-serving",
    }
    for tool, names in need.items():
        missing = set(names.split()) - upstream_flags(tool)
        assert not missing, f"{tool}: {sorted(missing)}"
    # vLLM's booleans have --no-X only where the parser registers it: store_true ones do not.
    assert "--save-result" in upstream_flags(VLLM_BENCH)
    assert "--no-save-result" not in upstream_flags(VLLM_BENCH)
    # pflag has no --no-X and no underscore spelling.
    assert not any(f.startswith("--no-") for f in upstream_flags(EPP) | upstream_flags(PD_SIDECAR))


def test_alias_rules() -> None:
    assert option_name(VLLM_SERVE, "--kv_transfer_config") == "--kv-transfer-config"
    assert option_name(VLLM_SERVE, "--kv-transfer-config.kv_role=kv_producer") == (
        "--kv-transfer-config"
    )
    assert option_name(VLLM_BENCH, "--result_filename=x.json") == "--result-filename"
    assert option_name(PD_SIDECAR, "--vllm_port=8200") == "--vllm_port"  # pflag: no alias
    assert option_name(EPP, "--grpc-port=9002") == "--grpc-port"
    bad = unknown_options(
        Command("t", VLLM_SERVE, None, ("M", "--served_model_name", "x", "-tp", "8", "--nope"))
    )
    assert bad == ["--nope"]
    assert unknown_options(Command("t", PD_SIDECAR, None, ("--vllm_port=1", "--port=1"))) == [
        "--vllm_port=1"
    ]
    with pytest.raises(ValueError, match="not a command this test knows"):
        classify("benchmark.command", ("bash", "-c", "vllm bench serve"))


@pytest.mark.parametrize("path", EXAMPLES, ids=example_id)
def test_example_flags_exist_upstream(path: Path) -> None:
    spec = load_spec(path.read_text())
    rel = path.relative_to(ROOT)
    problems: list[str] = []
    checked: dict[str, int] = {}
    for slot, argv in spec_commands(spec):
        try:
            command = classify(slot, argv)
        except ValueError as e:
            problems.append(f"{rel}: {e}")
            continue
        allowed = SLOT_TOOLS[slot.split("[", 1)[0]]
        if command.tool not in allowed:
            want = sorted(TOOL_TITLES[t] if t else "a known unchecked one" for t in allowed)
            problems.append(f"{rel}: {slot} runs {command.title}, expected {' or '.join(want)}")
            continue
        if command.tool is None:
            continue
        checked[command.tool] = checked.get(command.tool, 0) + 1
        for token in unknown_options(command):
            problems.append(
                f"{rel}: {slot} ({command.title}): {token} is not an option of "
                f"{TOOL_TITLES[command.tool]} "
                f"(tests/data/upstream/flags/{command.tool}.txt)"
            )
    assert not problems, "\n".join(problems)
    # No vacuous pass: each part the spec has ran a checked command.
    assert checked.get(VLLM_SERVE, 0) == 2, (rel, checked)
    assert checked.get(VLLM_BENCH, 0) == 1, (rel, checked)
    if spec.sidecar is not None:
        assert checked.get(PD_SIDECAR, 0) == 1, (rel, checked)
