"""Run spec validation: table tests, unknown keys, injection attempts."""

from __future__ import annotations

import copy
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from llmd_supervisor.core.spec import (
    ContainerKind,
    RunSpec,
    load_spec,
    parse_spec,
    time_limit_seconds,
)
from llmd_supervisor.errors import SpecError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "llm-d"
DEMO = tomllib.loads((DEPLOY / "demo.toml").read_text())

INJECTIONS = [
    "$(rm -rf /)",
    "`rm -rf /`",
    "a;rm -rf /",
    "a\nrm -rf /",
    "a && b",
    "a|b",
    "${HOME}",
    "a b",
    "'quoted'",
    '"quoted"',
    "a%x",
    "a>b",
]


def demo(**changes: Any) -> dict[str, Any]:
    """The demo spec with dotted-path changes applied (value None deletes the key)."""
    data = copy.deepcopy(DEMO)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        table = data
        for p in parents:
            table = table.setdefault(p, {})
        if value is None:
            table.pop(last, None)
        else:
            table[last] = value
    return data


def spec_error(data: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    return info.value


def test_demo_spec_parses() -> None:
    spec = load_spec((DEPLOY / "demo.toml").read_text())
    assert isinstance(spec, RunSpec)
    assert spec.topology.nodes == 4 and spec.topology.coordinator_rank == 2
    assert spec.container.kind is ContainerKind.NONE
    assert spec.benchmark.concurrencies == (1, 2, 4)
    assert math.isinf(spec.benchmark.request_rate)
    assert spec.slurm.requeue is False
    assert spec.sigterm_grace_s == 10


def test_example_gpu_spec_parses() -> None:
    spec = load_spec((DEPLOY / "example-vllm-pyxis.toml").read_text())
    assert spec.container.kind is ContainerKind.PYXIS
    assert spec.container.squash_file is not None
    assert spec.topology.gpus_per_node == 8
    assert spec.slurm.extra_args == ("--exclusive", "--mem=0")


def test_defaults() -> None:
    data = demo(run__sigterm_grace_s=None, container=None, env=None)
    data["engine"].pop("port")
    spec = parse_spec(data)
    assert spec.sigterm_grace_s == 30
    assert spec.container.kind is ContainerKind.NONE and spec.container.python == "python3"
    assert spec.engine.port == 8000 and spec.engine.port_stride == 0
    assert dict(spec.env.common) == {}


def test_toml_syntax_error() -> None:
    with pytest.raises(SpecError) as info:
        load_spec("[run\nlog_dir = 1")
    assert info.value.field == "<toml>"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({**DEMO, "extra": {}}, "extra"),
        (demo(run__logdir="/x"), "run.logdir"),
        (demo(topology__gpus="1"), "topology.gpus"),
        (demo(slurm__qos="high"), "slurm.qos"),
        (demo(env__worker={}), "env.worker"),
    ],
)
def test_unknown_keys_are_named_with_the_allowed_ones(data: dict[str, Any], field: str) -> None:
    err = spec_error(data)
    assert err.field == field
    assert "unknown key" in err.hint and "allowed" in err.hint
    if field == "run.logdir":
        assert "log_dir" in str(err)


@pytest.mark.parametrize(
    ("changes", "field", "hint_part"),
    [
        ({"run": None}, "run", "required"),
        ({"run__log_dir": None}, "run.log_dir", "required"),
        ({"run__log_dir": "relative/dir"}, "run.log_dir", "absolute path"),
        ({"run__sigterm_grace_s": 0}, "run.sigterm_grace_s", "1 to"),
        ({"run__sigterm_grace_s": True}, "run.sigterm_grace_s", "integer"),
        ({"run__sigterm_grace_s": 400}, "run.sigterm_grace_s", "shorter than slurm.time_limit"),
        ({"run__marker_grace_s": -1}, "run.marker_grace_s", "seconds"),
        ({"topology__prefill_nodes": 0}, "topology.prefill_nodes", "integer from 1"),
        ({"topology__decode_nodes": "2"}, "topology.decode_nodes", "integer"),
        ({"topology__prefill_workers": 3}, "topology.prefill_workers", "divisible"),
        ({"topology__decode_workers": 4}, "topology.decode_workers", "divisible"),
        ({"topology__gpus_per_node": -1}, "topology.gpus_per_node", "integer"),
        ({"model__served_name": None}, "model.served_name", "required"),
        ({"container__kind": "podman"}, "container.kind", "'none', 'docker', 'pyxis'"),
        ({"container__kind": "docker"}, "container.image", "needs an image"),
        ({"container__kind": "pyxis"}, "container.squash_file", "needs a squash file"),
        ({"container__image": "vllm/vllm:1"}, "container.kind", "only apply"),
        ({"engine__port": 80}, "engine.port", "1024 to 65535"),
        ({"engine__prefill_command": []}, "engine.prefill_command", "non-empty"),
        ({"engine__prefill_command": "python3 x"}, "engine.prefill_command", "list"),
        ({"engine__decode_command": ["x", 3]}, "engine.decode_command[1]", "string"),
        (
            {"engine__decode_command": ["x", "{nope}"]},
            "engine.decode_command[1]",
            "unknown placeholder",
        ),
        ({"engine__decode_command": ["x", "{port"]}, "engine.decode_command[1]", "'{{'"),
        ({"engine__decode_command": ["a\nb"]}, "engine.decode_command[0]", "control"),
        (
            {"engine__prefill_command": ["x", "{concurrency}"]},
            "engine.prefill_command[1]",
            "unknown placeholder",
        ),
        ({"engine__health_path": "health"}, "engine.health_path", "URL path"),
        ({"benchmark__concurrencies": []}, "benchmark.concurrencies", "at least one"),
        ({"benchmark__concurrencies": [1, 1]}, "benchmark.concurrencies", "duplicate"),
        ({"benchmark__concurrencies": [1, True]}, "benchmark.concurrencies[1]", "integer"),
        ({"benchmark__concurrencies": [0]}, "benchmark.concurrencies[0]", "integer"),
        ({"benchmark__request_rate": 0}, "benchmark.request_rate", "positive"),
        ({"benchmark__request_rate": "fast"}, "benchmark.request_rate", "'inf'"),
        ({"benchmark__input_len": 0}, "benchmark.input_len", "integer"),
        ({"slurm__time_limit": None}, "slurm.time_limit", "required"),
        ({"slurm__time_limit": "1h"}, "slurm.time_limit", "Slurm time"),
        ({"slurm__time_limit": "0:30"}, "slurm.time_limit", "minimum is 1 minute"),
        ({"slurm__requeue": "yes"}, "slurm.requeue", "true or false"),
        ({"slurm__extra_args": "--exclusive"}, "slurm.extra_args", "list"),
        ({"slurm__extra_args": ["-N4"]}, "slurm.extra_args[0]", "'--option'"),
        ({"slurm__extra_args": ["--exclusive", "--nodes=8"]}, "slurm.extra_args[1]", "--nodes"),
        ({"slurm__extra_args": ["--time=1"]}, "slurm.extra_args[0]", "cannot be overridden"),
        ({"slurm__extra_args": ["--part=x"]}, "slurm.extra_args[0]", "--partition"),
        ({"slurm__extra_args": ["--requeue"]}, "slurm.extra_args[0]", "cannot be overridden"),
        ({"slurm__extra_args": ["--signal=B:USR1@5"]}, "slurm.extra_args[0]", "--signal"),
        ({"slurm__extra_args": ["--export=NONE"]}, "slurm.extra_args[0]", "--export"),
        ({"slurm__extra_args": ["--job-name=x"]}, "slurm.extra_args[0]", "--job-name"),
        ({"slurm__extra_args": ["--output=/tmp/x"]}, "slurm.extra_args[0]", "--output"),
        ({"env__common": {"1BAD": "x"}}, "env.common.1BAD", "variable names"),
        ({"env__prefill": {"SLURM_PROCID": "0"}}, "env.prefill.SLURM_PROCID", "set by the agent"),
        ({"env__decode": {"X": ["a"]}}, "env.decode.X", "string"),
        ({"env__bench": {"X": "a\nb"}}, "env.bench.X", "control"),
        ({"env__bench": "X=1"}, "env.bench", "table"),
    ],
)
def test_invalid_values(changes: dict[str, Any], field: str, hint_part: str) -> None:
    err = spec_error(demo(**changes))
    assert err.field == field
    assert hint_part in err.hint
    # The message is a sentence naming the field, the value and the fix.
    assert repr(field) in str(err) and err.hint in str(err)


# Every string that lands in the batch script itself, with what makes the spec valid.
SCRIPT_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("run.log_dir", {}),
    ("model.path", {}),
    ("model.served_name", {}),
    ("container.python", {}),
    ("container.image", {"container__kind": "docker", "container__image": "x"}),
    ("container.squash_file", {"container__kind": "pyxis", "container__squash_file": "/x"}),
    ("container.mounts", {"container__kind": "pyxis", "container__squash_file": "/x"}),
    ("slurm.partition", {}),
    ("slurm.account", {}),
    ("slurm.time_limit", {}),
    ("slurm.extra_args", {}),
    ("engine.health_path", {}),
]


@pytest.mark.parametrize("payload", INJECTIONS)
@pytest.mark.parametrize(("field", "base"), SCRIPT_FIELDS)
def test_injection_into_script_fields_is_rejected(
    field: str, base: dict[str, Any], payload: str
) -> None:
    table, key = field.split(".")
    value: Any = payload
    if key == "mounts":
        value = [f"/a:{payload}"]
    elif key == "extra_args":
        value = [f"--exclusive={payload}"]
    elif key in ("log_dir", "path", "squash_file", "health_path"):
        value = "/ok/" + payload
    err = spec_error(demo(**{**base, f"{table}__{key}": value}))
    assert err.field.startswith(field)


@pytest.mark.parametrize("payload", [p for p in INJECTIONS if "\n" not in p])
def test_shell_metacharacters_in_argv_and_env_are_data(payload: str) -> None:
    # Commands and env values never meet a shell (JSON to the agent, exec of argv lists);
    # they are kept verbatim and proven inert by the render tests.
    # Braces are template syntax in commands; literal ones are doubled.
    arg = payload.replace("{", "{{").replace("}", "}}")
    spec = parse_spec(
        demo(
            engine__prefill_command=["python3", arg],
            env__prefill={"X": payload},
        )
    )
    assert spec.engine.prefill_command == ("python3", arg)
    assert spec.env.prefill["X"] == payload


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30", 1800),
        ("30:15", 1815),
        ("01:30:00", 5400),
        ("2-0", 172800),
        ("1-02:03", 93780),
        ("1-00:00:05", 86405),
    ],
)
def test_time_limit_seconds(value: str, seconds: int) -> None:
    assert time_limit_seconds(value) == seconds
    assert parse_spec(demo(slurm__time_limit=value)).slurm.time_limit_s == seconds


def test_request_rate_number_and_requeue() -> None:
    spec = parse_spec(demo(benchmark__request_rate=2.5, slurm__requeue=True))
    assert spec.benchmark.request_rate == 2.5
    assert spec.slurm.requeue is True


def test_trailing_slash_of_paths_is_dropped() -> None:
    assert parse_spec(demo(run__log_dir="/var/tmp/x/")).log_dir == "/var/tmp/x"
